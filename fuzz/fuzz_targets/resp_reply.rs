//! kvshard-resp reading an arbitrary reply stream: replies parsed one after
//! another, whole ([`parse_reply`]) and head first ([`parse_head`], with the
//! bulk body taken as the client takes it), never panicking, never taking
//! more bytes than there are, agreeing with each other, and every reply
//! parsed re-encoding to bytes that parse back to it (each cut short of its
//! end asking for more). Every reply is also read as a cluster's slot map
//! (`CLUSTER SHARDS`, `CLUSTER SLOTS`) and every error line as a redirect:
//! whatever they make of it, they never panic, and a map they accept names
//! a master for a slot only within the ranges it covers.

#![no_main]

use kvshard_resp::cluster::{
    parse_cluster_shards, parse_cluster_slots, parse_redirect, Redirect, SlotMap, SLOTS,
};
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

/// A map's answers agree with its ranges.
fn check_map(map: &SlotMap) {
    let covered = map.covered_slots();
    assert!(covered <= u32::from(SLOTS));
    let mut counted = 0u32;
    let mut last_end: Option<u16> = None;
    for (start, end, master) in map.ranges() {
        assert!(start <= end && end < SLOTS);
        assert!(
            last_end.is_none_or(|e| e < start),
            "ranges overlap or are unsorted"
        );
        last_end = Some(end);
        counted += u32::from(end - start) + 1;
        assert_eq!(map.master_of(start), Some(master));
        assert_eq!(map.master_of(end), Some(master));
    }
    assert_eq!(counted, covered);
    assert_eq!(map.is_complete(), covered == u32::from(SLOTS));
}

/// The cluster readers on one reply.
fn cluster(reply: &Reply) {
    for map in [
        parse_cluster_shards(reply, "10.0.0.1", false),
        parse_cluster_shards(reply, "10.0.0.1", true),
        parse_cluster_slots(reply, "10.0.0.1"),
    ]
    .into_iter()
    .flatten()
    {
        check_map(&map);
        // A redirect to a new node splits a range and keeps the map sound.
        let mut moved = map.clone();
        if let Some((start, end, _)) = map.ranges().next() {
            let slot = start + (end - start) / 2;
            let to = kvshard_resp::cluster::NodeAddr {
                host: "10.9.9.9".into(),
                port: 7777,
            };
            moved.set_slot(slot, to.clone());
            assert_eq!(moved.master_of(slot), Some(&to));
            assert_eq!(moved.covered_slots(), map.covered_slots());
            check_map(&moved);
        }
    }
    if let Reply::Error(line) = reply {
        if let Some(Redirect::Moved { slot, .. } | Redirect::Ask { slot, .. }) =
            parse_redirect(line, "10.0.0.1")
        {
            assert!(slot < SLOTS);
        }
    }
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
        cluster(&reply);
        if let Reply::Simple(t) | Reply::Error(t) = &reply {
            assert!(!t.contains(&b'\r') && !t.contains(&b'\n'));
        }
        at += used;
    }
});
