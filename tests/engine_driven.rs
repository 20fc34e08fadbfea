//! End to end: the real binary driven through the engine_driven SHM flow
//! (PREPARE/COMMIT over the shared L1 pool), as `lmcache bench server --mode cpu`
//! and vLLM's CPU workers use it.

mod support;
use support::*;

const CS: usize = 16; // --chunk-size in Server::start

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 50_000)
        .collect()
}

/// Registers a worker and returns (shm name, pool size).
fn register(c: &mut Client, iid: i64, ws: i64, mla: bool) -> (String, usize) {
    let r = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(iid, "m", ws, 2, 64, mla, CS as i64)],
        )
        .expect("register reply");
    (
        r.get("shm_name").unwrap().str().to_owned(),
        r.get("pool_size").unwrap().int() as usize,
    )
}

/// Stores `[0, n)` tokens for worker `w`; returns the bytes written per chunk.
fn store_all(
    c: &mut Client,
    pool: &mut ShmMap,
    iid: i64,
    ws: i64,
    w: i64,
    toks: &[u32],
    rid: &str,
) -> Vec<Vec<u8>> {
    let end = (toks.len() / CS * CS) as i64;
    let key = ipc_key("m", ws, Some(w), toks, 0, end, rid, 1);
    let r = c
        .call(OP_PREPARE_STORE, &[key.clone(), V::I(iid)])
        .expect("prepare_store reply");
    let ctx = r.get("context").unwrap();
    let slots = ctx.get("slots").unwrap().arr().to_vec();
    let idx = ctx.get("chunk_indices").unwrap().arr().to_vec();
    assert_eq!(slots.len(), end as usize / CS, "every chunk reserved");
    let mut written = Vec::new();
    for (slot, i) in slots.iter().zip(&idx) {
        let off = slot.get("offset").unwrap().int() as usize;
        let len = slot.get("length").unwrap().int() as usize;
        assert_eq!(slot.get("dtype").unwrap().str(), "float16");
        let data = pattern((iid as u64) << 20 | (w as u64) << 10 | i.int() as u64, len);
        pool.bytes_mut()[off..off + len].copy_from_slice(&data);
        written.push(data);
    }
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[key, V::I(iid), V::Bin(vec![])]),
        Some(V::B(true))
    );
    written
}

fn lookup(c: &mut Client, ws: i64, toks: &[u32], rid: &str, readers: i64) -> i64 {
    let end = (toks.len() / CS * CS) as i64;
    assert_eq!(
        c.call(
            OP_LOOKUP,
            &[ipc_key("m", ws, None, toks, 0, end, rid, readers), V::I(1)]
        ),
        None,
        "lookup ack has no payload"
    );
    c.prefetch_result(rid)
}

/// Reads back every chunk through prepare/commit_retrieve.
fn retrieve_all(
    c: &mut Client,
    pool: &ShmMap,
    iid: i64,
    ws: i64,
    w: i64,
    toks: &[u32],
    rid: &str,
) -> Vec<Vec<u8>> {
    let end = (toks.len() / CS * CS) as i64;
    let key = ipc_key("m", ws, Some(w), toks, 0, end, rid, 1);
    ed_retrieve(c, pool, &key, iid)
}

#[test]
fn store_lookup_retrieve_round_trip() {
    round_trip_with(&["--cores", "0,1"]);
}

/// The same with every prepare_store reserved on the shards (no write
/// credits): a chunk already stored is never handed out again.
#[test]
fn store_lookup_retrieve_round_trip_without_write_credits() {
    round_trip_with(&["--cores", "0,1", "--write-credits", "0"]);
}

/// The same with shards and front polling for work before they sleep
/// (`--spin-us`): nothing is missed or answered twice.
#[test]
fn store_lookup_retrieve_round_trip_spinning() {
    round_trip_with(&["--cores", "0,1", "--spin-us", "500"]);
}

fn round_trip_with(flags: &[&str]) {
    let credits = !flags.contains(&"--write-credits");
    let srv = Server::start(flags);
    let mut c = srv.client();
    assert_eq!(c.call(OP_GET_CHUNK_SIZE, &[]), Some(V::I(CS as i64)));
    assert_eq!(c.call(OP_GET_EXPERIMENTAL, &[]), Some(V::A(vec![])));
    let (name, size) = register(&mut c, 1000, 1, false);
    assert_eq!(name, srv.shm_name);
    assert_eq!(size, 64 << 20);
    let mut pool = ShmMap::open(&name, size);
    // The shards lend the front write credits for the registered size (or
    // nothing without them), counted as used L1 memory.
    if credits {
        wait_until("write credits lent", || {
            srv.l1_count("write_credit_bytes") > 0
        });
    } else {
        assert_eq!(srv.l1_count("write_credit_bytes"), 0);
    }

    let toks = tokens(1, 5 * CS + 3);
    assert_eq!(lookup(&mut c, 1, &toks, "cold", 1), 0, "cold lookup misses");
    let stored = store_all(&mut c, &mut pool, 1000, 1, 0, &toks, "cold");
    assert_eq!(stored.len(), 5);
    assert_eq!(c.call(OP_END_SESSION, &[s("cold")]), None);

    assert_eq!(
        lookup(&mut c, 1, &toks, "warm", 1),
        5,
        "warm lookup hits all chunks"
    );
    // A result is handed out once; later polls answer 0.
    assert_eq!(
        c.call(OP_QUERY_PREFETCH_STATUS, &[s("warm")]),
        Some(V::I(0))
    );
    let back = retrieve_all(&mut c, &pool, 1000, 1, 0, &toks, "warm");
    assert_eq!(back, stored, "bytes read back equal the bytes stored");
    c.call(OP_END_SESSION, &[s("warm")]);

    // Storing the same chunks again after the request's lookup found them
    // reserves nothing: the client skips the commit.
    assert_eq!(lookup(&mut c, 1, &toks, "again", 1), 5);
    let key = ipc_key("m", 1, Some(0), &toks, 0, 5 * CS as i64, "again", 1);
    let r = c
        .call(OP_PREPARE_STORE, &[key.clone(), V::I(1000)])
        .unwrap();
    assert_eq!(
        r.get("context").unwrap().get("slots").unwrap().arr().len(),
        0
    );
    c.call(OP_FREE_LOOKUP_LOCKS, &[key, V::I(1)]);
    c.call(OP_END_SESSION, &[s("again")]);
    // Without a lookup, write credits hand out a slot per chunk (the shards
    // are not asked); the copy is dropped at commit and the stored bytes
    // stay. Reserved on the shards, nothing is handed out.
    let key = ipc_key("m", 1, Some(0), &toks, 0, 5 * CS as i64, "blind", 1);
    let r = c
        .call(OP_PREPARE_STORE, &[key.clone(), V::I(1000)])
        .unwrap();
    let slots = ed_slots(&r);
    assert_eq!(slots.len(), if credits { 5 } else { 0 });
    for slot in &slots {
        let off = slot.get("offset").unwrap().int() as usize;
        let len = slot.get("length").unwrap().int() as usize;
        pool.bytes_mut()[off..off + len].fill(0xab);
    }
    if credits {
        assert_eq!(
            c.call(OP_COMMIT_STORE, &[key, V::I(1000), V::Bin(vec![])]),
            Some(V::B(true))
        );
    }
    c.call(OP_END_SESSION, &[s("blind")]);
    assert_eq!(lookup(&mut c, 1, &toks, "reread", 1), 5);
    let back = retrieve_all(&mut c, &pool, 1000, 1, 0, &toks, "reread");
    assert_eq!(back, stored, "the first copy stays");
    c.call(OP_END_SESSION, &[s("reread")]);
    let from_credits = srv
        .metric("kvshard_prepare_stores_from_credits_total", &[])
        .expect("kvshard_prepare_stores_from_credits_total exposed");
    assert_eq!(
        from_credits > 0.0,
        credits,
        "{from_credits} prepare_stores from credits"
    );

    // A prefix of another request: shares the first chunks only.
    let mut other = toks[..2 * CS].to_vec();
    other.extend(tokens(99, 3 * CS));
    assert_eq!(lookup(&mut c, 1, &other, "partial", 1), 2);
    c.call(
        OP_FREE_LOOKUP_LOCKS,
        &[
            ipc_key("m", 1, None, &other, 0, 2 * CS as i64, "partial", 1),
            V::I(1),
        ],
    );
    c.call(OP_END_SESSION, &[s("partial")]);

    // clear drops everything.
    assert_eq!(c.call(OP_CLEAR, &[V::B(false)]), None);
    assert_eq!(lookup(&mut c, 1, &toks, "after-clear", 1), 0);
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(1000)]), None);
    // No registration uses the size any more: its credits are given back.
    wait_until("write credits returned", || {
        srv.l1_count("write_credit_bytes") == 0
    });
}

#[test]
fn world_size_two_needs_every_rank() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let (name, size) = register(&mut c, 1, 2, false);
    register(&mut c, 2, 2, false);
    let mut pool = ShmMap::open(&name, size);
    let toks = tokens(2, 4 * CS);
    // Only rank 0 stored: no chunk is complete across ranks.
    let r0 = store_all(&mut c, &mut pool, 1, 2, 0, &toks, "s");
    assert_eq!(lookup(&mut c, 2, &toks, "l0", 1), 0);
    c.call(OP_END_SESSION, &[s("l0")]);
    let r1 = store_all(&mut c, &mut pool, 2, 2, 1, &toks, "s");
    assert_ne!(r0, r1);
    assert_eq!(lookup(&mut c, 2, &toks, "l1", 1), 4);
    assert_eq!(retrieve_all(&mut c, &pool, 1, 2, 0, &toks, "l1"), r0);
    assert_eq!(retrieve_all(&mut c, &pool, 2, 2, 1, &toks, "l1"), r1);
    // Each worker released its one lock: a second retrieve without a lookup fails.
    let key = ipc_key("m", 2, Some(0), &toks, 0, 4 * CS as i64, "l1", 1);
    let r = c.call(OP_PREPARE_RETRIEVE, &[key, V::I(1)]).unwrap();
    assert_eq!(r.get("success"), Some(&V::B(false)));
}

#[test]
fn mla_single_writer_many_readers() {
    // MLA: every TP rank shares one kv_rank; only the writer stores, and the lookup
    // takes one read lock per reader.
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let (name, size) = register(&mut c, 10, 1, true);
    register(&mut c, 11, 1, true);
    let mut pool = ShmMap::open(&name, size);
    let toks = tokens(3, 3 * CS);
    let stored = store_all(&mut c, &mut pool, 10, 1, 0, &toks, "w");
    assert_eq!(lookup(&mut c, 1, &toks, "r", 2), 3);
    assert_eq!(retrieve_all(&mut c, &pool, 10, 1, 0, &toks, "r"), stored);
    assert_eq!(
        retrieve_all(&mut c, &pool, 11, 1, 0, &toks, "r"),
        stored,
        "second reader still holds its lock"
    );
    let key = ipc_key("m", 1, Some(0), &toks, 0, 3 * CS as i64, "r", 1);
    let r = c.call(OP_PREPARE_RETRIEVE, &[key, V::I(11)]).unwrap();
    assert_eq!(r.get("success"), Some(&V::B(false)), "both locks released");
}

/// A server that reaps silent workers as soon as it may: 30 s is the smallest
/// reap timeout 0.5.6 (and so kvshard) accepts.
fn reaping_server() -> Server {
    Server::start(&[
        "--worker-reap-timeout-seconds",
        "30",
        "--worker-registration-grace-seconds",
        "30",
    ])
}

#[test]
fn reaper_releases_silent_workers() {
    let srv = reaping_server();
    let mut c = srv.client();
    register(&mut c, 7, 1, false);
    register(&mut c, 8, 1, false);
    let toks = tokens(4, 2 * CS);
    let key = ipc_key("m", 1, Some(0), &toks, 0, 2 * CS as i64, "x", 1);
    // Instance 7 reserves and goes silent; 8 keeps pinging.
    let silent_since = std::time::Instant::now();
    let r = c.call(OP_PREPARE_STORE, &[key.clone(), V::I(7)]).unwrap();
    assert_eq!(
        r.get("context").unwrap().get("slots").unwrap().arr().len(),
        2
    );
    // Scans run every timeout/4 from the start, so 7 goes at the first scan
    // more than 30 s after its last request (37.5 s after the start: the 30 s
    // floor of the timeout is what this test waits out). Wait for the reap
    // itself, pinging 8 all along.
    wait_until_within(
        "the reaper to release silent instance 7",
        std::time::Duration::from_secs(60),
        std::time::Duration::from_millis(250),
        || {
            assert_eq!(c.call(OP_PING, &[V::I(8)]), Some(V::B(true)));
            srv.metric("kvshard_reaped_workers_total", &[]) == Some(1.0)
        },
    );
    // Not before the timeout; within timeout + one scan interval (37.5 s),
    // with the slack the fixed 39 s wait had.
    let silent = silent_since.elapsed();
    assert!(
        silent > std::time::Duration::from_secs(30),
        "7 was reaped {silent:?} after its last request, before the 30 s timeout"
    );
    assert!(
        silent < std::time::Duration::from_secs(39),
        "7 was reaped only {silent:?} after its last request"
    );
    // 7 is gone, its reservation with it: a commit fails and 8 can reserve the chunks.
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[key.clone(), V::I(7), V::Bin(vec![])]),
        Some(V::B(false))
    );
    let (st, body) = srv.http("GET", "/status", None);
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["registered_non_cuda_instance_ids"],
        serde_json::json!([8])
    );
    let r = c.call(OP_PREPARE_STORE, &[key, V::I(8)]).unwrap();
    assert_eq!(
        r.get("context").unwrap().get("slots").unwrap().arr().len(),
        2,
        "reaped reservation released"
    );
    assert_eq!(
        srv.metric("kvshard_reaped_workers_total", &[]),
        Some(1.0),
        "the pinging instance 8 was not reaped"
    );
}

#[test]
fn pipelined_lookup_and_wait_prefetch_status() {
    // A client may send WAIT_PREFETCH_STATUS right behind LOOKUP without waiting
    // for the ack; the wait then parks on the running lookup and gets its result.
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let (name, size) = register(&mut c, 5, 1, false);
    let mut pool = ShmMap::open(&name, size);
    let toks = tokens(5, 4 * CS);
    store_all(&mut c, &mut pool, 5, 1, 0, &toks, "w");
    for round in 0..20 {
        let rid = format!("pipe{round}");
        let key = ipc_key("m", 1, None, &toks, 0, 4 * CS as i64, &rid, 1);
        let lookup_uid = c.send_raw(vec![enc(&V::I(OP_LOOKUP)), enc(&key), enc(&V::I(1))]);
        let wait_uid = c.send_raw(vec![
            enc(&V::I(OP_WAIT_PREFETCH_STATUS)),
            enc(&s(&rid)),
            enc(&V::F(5.0)),
        ]);
        let ack = c.recv(lookup_uid);
        assert_eq!(ack.payload, None, "lookup ack has no payload");
        let waited = c.recv(wait_uid);
        assert_eq!(
            waited.payload,
            Some(V::I(4)),
            "round {round}: the wait gets the lookup's hits"
        );
        // The result was handed out once.
        assert_eq!(c.call(OP_QUERY_PREFETCH_STATUS, &[s(&rid)]), Some(V::I(0)));
        c.call(
            OP_FREE_LOOKUP_LOCKS,
            &[
                ipc_key("m", 1, None, &toks, 0, 4 * CS as i64, &rid, 1),
                V::I(1),
            ],
        );
        c.call(OP_END_SESSION, &[s(&rid)]);
    }
    // Waiting on a request nobody looked up answers 0 at once.
    assert_eq!(
        c.call(OP_WAIT_PREFETCH_STATUS, &[s("nobody"), V::F(5.0)]),
        Some(V::I(0))
    );
}

#[test]
fn a_reaped_worker_takes_its_lookup_locks_with_it() {
    let srv = reaping_server();
    let mut c = srv.client();
    let (name, size) = register(&mut c, 7, 1, false);
    let mut pool = ShmMap::open(&name, size);
    let toks = tokens(21, 3 * CS);
    store_all(&mut c, &mut pool, 7, 1, 0, &toks, "s");
    assert_eq!(c.call(OP_PING, &[V::I(7)]), Some(V::B(true)));
    // The scheduler looks the prefix up for worker 7, which then dies.
    let key = ipc_key("m", 1, None, &toks, 0, 3 * CS as i64, "r", 1);
    assert_eq!(c.call(OP_LOOKUP, &[key, V::I(1)]), None);
    assert_eq!(c.prefetch_result("r"), 3);
    assert_eq!(srv.l1_count("read_locked_count"), 3);
    // Reaped within 37.5 s of its last request; its locks go with it, long
    // before their 300 s TTL.
    wait_until_within(
        "worker 7 to be reaped",
        std::time::Duration::from_secs(60),
        std::time::Duration::from_millis(250),
        || srv.metric("kvshard_reaped_workers_total", &[]) == Some(1.0),
    );
    wait_until("its lookup locks to be released", || {
        srv.l1_count("read_locked_count") == 0
    });
    assert_eq!(
        srv.metric("kvshard_orphaned_read_locks_released_total", &[]),
        Some(3.0)
    );
}

/// A worker's prepare_retrieve after a lookup is answered from the locks the
/// lookup holds (no shard asked) and reads the stored bytes; after a forced
/// clear between the lookup and the retrieve, it fails instead of naming
/// memory that was freed, and a store into that memory is not handed out.
#[test]
fn retrieves_read_through_the_lookups_locks_until_a_forced_clear() {
    let srv = Server::start(&["--cores", "0,1"]);
    let from_lease = |srv: &Server| {
        srv.metric("kvshard_prepare_retrieves_from_lease_total", &[])
            .expect("kvshard_prepare_retrieves_from_lease_total exposed")
    };
    let mut c = srv.client();
    let (name, size) = register(&mut c, 7, 1, false);
    let mut pool = ShmMap::open(&name, size);
    let toks = tokens(5, 4 * CS);
    let stored = store_all(&mut c, &mut pool, 7, 1, 0, &toks, "s");
    c.call(OP_END_SESSION, &[s("s")]);
    assert_eq!(from_lease(&srv), 0.0);

    assert_eq!(lookup(&mut c, 1, &toks, "warm", 1), 4);
    assert_eq!(retrieve_all(&mut c, &pool, 7, 1, 0, &toks, "warm"), stored);
    assert_eq!(from_lease(&srv), 1.0, "answered from the lookup's locks");
    c.call(OP_END_SESSION, &[s("warm")]);

    // Looked up, then force-cleared and stored again with other bytes (which
    // may land in the same slabs) before the worker asks.
    assert_eq!(lookup(&mut c, 1, &toks, "cleared", 1), 4);
    assert_eq!(c.call(OP_CLEAR, &[V::B(true)]), None);
    register(&mut c, 8, 1, false);
    let other = store_all(&mut c, &mut pool, 8, 1, 0, &toks, "s2");
    assert_ne!(other, stored);
    let end = (toks.len() / CS * CS) as i64;
    let key = ipc_key("m", 1, Some(0), &toks, 0, end, "cleared", 1);
    let r = c.call(OP_PREPARE_RETRIEVE, &[key, V::I(7)]).unwrap();
    assert_eq!(
        r.get("success"),
        Some(&V::B(false)),
        "the cleared lookup's locks are gone: {r:?}"
    );
    assert_eq!(from_lease(&srv), 1.0);
}

/// Three requests look up the same prefix. The first frees its lookup locks
/// twice (a retried call); the second's worker retrieves twice. What repeats
/// finds none of its lookup's locks left: it releases nothing, and the repeated
/// retrieve reads under a lock of its own. The third request's locks stay,
/// and its worker reads the stored bytes through them.
#[test]
fn repeated_releases_and_retrieves_leave_other_requests_locks_alone() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let (name, size) = register(&mut c, 7, 1, false);
    let mut pool = ShmMap::open(&name, size);
    let toks = tokens(33, 3 * CS);
    let stored = store_all(&mut c, &mut pool, 7, 1, 0, &toks, "s");
    c.call(OP_END_SESSION, &[s("s")]);
    for rid in ["a", "b", "c"] {
        assert_eq!(lookup(&mut c, 1, &toks, rid, 1), 3);
    }
    let free_a = ipc_key("m", 1, None, &toks, 0, 3 * CS as i64, "a", 1);
    for _ in 0..2 {
        assert_eq!(
            c.call(OP_FREE_LOOKUP_LOCKS, &[free_a.clone(), V::I(1)]),
            None
        );
    }
    assert_eq!(
        srv.metric("kvshard_unheld_lock_releases_total", &[]),
        Some(3.0),
        "the repeated call's three locks were not released"
    );
    for _ in 0..2 {
        assert_eq!(retrieve_all(&mut c, &pool, 7, 1, 0, &toks, "b"), stored);
    }
    assert_eq!(
        srv.l1_count("read_locked_count"),
        3,
        "request c's lookup still holds every chunk"
    );
    assert_eq!(retrieve_all(&mut c, &pool, 7, 1, 0, &toks, "c"), stored);
    assert_eq!(srv.l1_count("read_locked_count"), 0);
}
