//! End to end: an L2 load that takes longer than `--l1-write-ttl-seconds`.
//! The load stages its objects in L1 under write reservations and the
//! adapter writes them at the end of a slow read; meanwhile other stores
//! fill L1 and wait for memory. The reservations must be renewed while the
//! adapter works: the loaded chunks come back byte for byte, and no chunk
//! stored meanwhile is overwritten by the late write.

mod support;
use support::*;

use std::time::{Duration, Instant};

/// Hidden size of the workers here: chunk objects of 256 KiB.
const HIDDEN: usize = 2048;
const CHUNK: usize = ed_chunk_bytes(HIDDEN);
/// `--l1-size-gb`: 4 MiB, room for 16 chunks on the one shard.
const L1_GB: &str = "0.00390625";
/// Chunks loaded back from L2.
const LOADED: usize = 4;
/// The mock adapter's load latency: three write TTLs.
const LOAD_LATENCY_MS: u64 = 3000;

/// The first core this process may run on: one shard holds every key, so
/// the loaded chunks and the competing stores share one L1.
fn one_core() -> String {
    // SAFETY: sched_getaffinity fills a zeroed set we own; result checked.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("an allowed core")
            .to_string()
    }
}

#[test]
fn a_load_slower_than_the_write_ttl_keeps_its_stages_and_corrupts_nothing() {
    let core = one_core();
    let adapter = format!(
        r#"{{"type":"mock","max_size_gb":0.0625,"mock_bandwidth_gb":50,"mock_load_latency_ms":{LOAD_LATENCY_MS}}}"#
    );
    // noop: nothing is evicted for room, so a competing store finds memory
    // only where a write reservation was given up.
    let srv = Server::start(&[
        "--cores",
        &core,
        "--l1-size-gb",
        L1_GB,
        "--eviction-policy",
        "noop",
        "--l1-write-ttl-seconds",
        "1",
        "--l2-adapter",
        &adapter,
        // The lookup waits for its slow load (the subject here), not its
        // default deadline.
        "--l2-prefetch-load-timeout",
        "0",
    ]);
    let toks = ed_tokens(21, LOADED * ED_CHUNK);
    let stored = ed_store_chunks_of(&srv, 1, "m", HIDDEN, &toks, LOADED, 77);
    wait_until("the chunks written behind to L2", || {
        srv.metric("lmcache_mp_l2_store_completed_objects_chunks_total", &[]) == Some(LOADED as f64)
    });
    let (st, body) = srv.http("POST", "/cache/clear", None);
    assert_eq!(st, 200, "{body}");
    assert_eq!(srv.l1_count("total_object_count"), 0);

    // The lookup misses L1, finds the chunks in L2 and starts a load that
    // stages them in L1 and waits on the adapter.
    let mut loader = srv.client();
    let (name, size) = ed_register_hidden(&mut loader, 2, "m", HIDDEN);
    let loader_pool = ShmMap::open(&name, size);
    assert_eq!(
        loader.call(
            OP_LOOKUP,
            &[ed_key("m", None, &toks, LOADED, "load"), V::I(1)]
        ),
        None,
        "lookup ack"
    );
    wait_until("the load staged in L1", || {
        srv.l1_count("staging_object_count") == LOADED as u64
    });

    // Competing stores until the load answers: each chunk that finds room is
    // read-locked by a lookup of its own, so it stays in L1 (and, had it been
    // given a lapsed stage's memory, would show the adapter's late write).
    let mut c = srv.client();
    let (name, size) = ed_register_hidden(&mut c, 3, "m", HIDDEN);
    let mut pool = ShmMap::open(&name, size);
    let mut pinned: Vec<(Vec<u32>, String, Vec<u8>)> = Vec::new();
    let mut attempt = 0u32;
    let t0 = Instant::now();
    let hits = loop {
        if let Some(v) = loader.call(OP_QUERY_PREFETCH_STATUS, &[s("load")]) {
            break v.int();
        }
        attempt += 1;
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the load never answered"
        );
        let ctoks = ed_tokens(1_000 + attempt, ED_CHUNK);
        let rid = format!("c{attempt}");
        let key = ed_key("m", Some(0), &ctoks, 1, &rid);
        let bytes = ed_store_sized(&mut c, &mut pool, &key, 3, 9_000 + attempt as u64, CHUNK);
        assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
        match bytes.len() {
            0 => std::thread::sleep(Duration::from_millis(20)), // L1 full: retry
            1 => {
                let lid = format!("p{attempt}");
                assert_eq!(
                    ed_lookup(&mut c, &ed_key("m", None, &ctoks, 1, &lid)),
                    1,
                    "competing chunk {attempt} hits L1 right after its store"
                );
                pinned.push((ctoks, lid, bytes.into_iter().next().unwrap()));
            }
            n => panic!("{n} chunks reserved for a one-chunk store"),
        }
    };
    assert!(
        srv.metric("lmcache_mp_l1_allocation_failure_chunks_total", &[])
            .unwrap_or(0.0)
            > 0.0,
        "the competing stores filled L1 and waited for memory during the load"
    );
    assert!(!pinned.is_empty(), "some competing stores found room");

    for (ctoks, lid, want) in &pinned {
        let got = ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), ctoks, 1, lid), 3);
        assert!(
            got.len() == 1 && got[0] == *want,
            "competing chunk {lid} was overwritten while it was read-locked in L1"
        );
    }
    assert_eq!(hits, LOADED as i64, "every chunk loaded from L2");
    let back = ed_retrieve(
        &mut loader,
        &loader_pool,
        &ed_key("m", Some(0), &toks, LOADED, "load"),
        2,
    );
    assert!(back == stored, "the loaded chunks equal the stored ones");
    assert_eq!(
        srv.metric("lmcache_mp_l2_prefetch_load_completed_chunks_total", &[]),
        Some(LOADED as f64)
    );
}
