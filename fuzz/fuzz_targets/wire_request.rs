//! The ZeroMQ request decoder: `decode_op` on the op frame, `decode_request` on
//! the payload frames, `msgpack::decode_value` on every frame. The payloads
//! are decoded again through a token cache kept across inputs (twice, so the
//! second finds what the first kept): the same request or the same error.
//!
//! Input: the frames of one request after its uid, each as a little-endian
//! `u16` length and that many bytes (a length past the end takes what is
//! left). The first frame is the op frame; the rest are payloads. Any byte
//! string is some split into frames, so the fuzzer explores frame counts and
//! boundaries as well as contents. `fuzz/make-corpus.py` writes lmcache
//! 0.5.6's golden frames in this form.

#![no_main]

use std::cell::RefCell;

use kvshard_wire::msgpack::{decode_value, encode_value, TokenCache};
use kvshard_wire::{decode_op, decode_request, decode_request_cached, Op};
use libfuzzer_sys::fuzz_target;

thread_local! {
    static TOKENS: RefCell<TokenCache> = RefCell::new(TokenCache::new());
}

/// More frames than any RPC has parameters, so count errors are reached too.
const MAX_FRAMES: usize = 16;

fn split_frames(mut data: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    while data.len() >= 2 && frames.len() < MAX_FRAMES {
        let len = usize::from(u16::from_le_bytes([data[0], data[1]]));
        let rest = &data[2..];
        let (frame, tail) = rest.split_at(len.min(rest.len()));
        frames.push(frame);
        data = tail;
    }
    frames
}

/// A decoded value encodes to a frame that decodes again to the same
/// encoding (bytes are compared, so a NaN does not count as a difference).
fn check_value(frame: &[u8]) {
    let Ok(value) = decode_value(frame) else {
        return;
    };
    let encoded = encode_value(&value);
    let again = decode_value(&encoded).expect("an encoded value decodes");
    assert_eq!(encode_value(&again), encoded, "msgpack round trip changed");
}

fuzz_target!(|data: &[u8]| {
    check_value(data);
    let frames = split_frames(data);
    let Some((op_frame, payloads)) = frames.split_first() else {
        return;
    };
    for frame in &frames {
        check_value(frame);
    }
    let op = match decode_op(op_frame) {
        Ok(op) => op,
        // Still decode the payloads, as some operation's, so that coverage of
        // the payload decoders does not wait on a valid op frame.
        Err(_) => match op_frame.first() {
            Some(b) => Op::ALL[usize::from(*b) % Op::ALL.len()],
            None => return,
        },
    };
    let plain = decode_request(op, payloads);
    TOKENS.with(|c| {
        let mut c = c.borrow_mut();
        for _ in 0..2 {
            assert_eq!(decode_request_cached(op, payloads, &mut c), plain);
        }
    });
});
