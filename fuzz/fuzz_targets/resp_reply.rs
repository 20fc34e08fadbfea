//! kvshard-resp reading an arbitrary reply stream: replies parsed one after
//! another, whole ([`parse_reply`]) and head first ([`parse_head`], with the
//! bulk body taken as the client takes it), never panicking, never taking
//! more bytes than there are, agreeing with each other, and every reply
//! parsed re-encoding to bytes that parse back to it (each cut short of its
//! end asking for more).

#![no_main]

use kvshard_resp::{check_bulk_end, encode_reply, parse_head, parse_reply, Head, Reply};
use libfuzzer_sys::fuzz_target;

/// Bytes a head-first reader takes for the reply at the start of `buf`, as
/// a client reads a reply into its destination; `None` while it waits.
fn head_first(buf: &[u8], depth: usize) -> Result<Option<usize>, kvshard_resp::RespError> {
    let Some((head, mut used)) = parse_head(buf)? else {
        return Ok(None);
    };
    match head {
        Head::Bulk(n) => {
            let Some(end) = buf.get(used + n..used + n + 2) else {
                return Ok(None);
            };
            check_bulk_end([end[0], end[1]])?;
            used += n + 2;
        }
        Head::Array(n) => {
            if depth >= kvshard_resp::MAX_DEPTH {
                return Err(kvshard_resp::RespError::TooDeep);
            }
            for _ in 0..n {
                let Some(took) = head_first(&buf[used..], depth + 1)? else {
                    return Ok(None);
                };
                used += took;
            }
        }
        _ => {}
    }
    Ok(Some(used))
}

fuzz_target!(|data: &[u8]| {
    let mut at = 0;
    while at < data.len() {
        let rest = &data[at..];
        let whole = parse_reply(rest);
        let streamed = head_first(rest, 0);
        match (&whole, &streamed) {
            (Ok(Some((_, a))), Ok(Some(b))) => assert_eq!(a, b, "both readers take one reply"),
            (Ok(None), Ok(None)) => {}
            (Err(a), Err(b)) => assert_eq!(a, b, "both readers fail alike"),
            _ => panic!("the readers disagree: {whole:?} / {streamed:?}"),
        }
        let Ok(Some((reply, used))) = whole else {
            break;
        };
        assert!(used > 0 && used <= rest.len());
        let mut again = Vec::new();
        encode_reply(&mut again, &reply);
        assert_eq!(parse_reply(&again), Ok(Some((reply.clone(), again.len()))));
        if again.len() < 4096 {
            for cut in 0..again.len() {
                assert_eq!(parse_reply(&again[..cut]), Ok(None), "cut at {cut}");
            }
        }
        if let Reply::Simple(t) | Reply::Error(t) = &reply {
            assert!(!t.contains(&b'\r') && !t.contains(&b'\n'));
        }
        at += used;
    }
});
