//! Backpressure and dead shards, through the real binary: a busy shard never
//! stalls the front (requests beyond its mailbox and overflow queue are
//! answered with their failure reply and counted), and a shard whose thread
//! ended makes the requests that need it fail at once, never hang, while the
//! other shards keep serving and `/healthcheck` says unhealthy.

mod support;
use support::*;

use std::time::{Duration, Instant};

/// Receives one reply on a pipelining client: (uid, payload).
fn recv_any(c: &mut Client) -> (i64, Option<V>) {
    let frames = c
        .sock
        .recv_multipart(0)
        .expect("reply within 10 s (the server must always answer)");
    assert!(frames.len() == 2 || frames.len() == 3, "reply frames");
    (dec(&frames[0]).int(), frames.get(2).map(|f| dec(f)))
}

fn counter(srv: &Server, name: &str) -> f64 {
    srv.metric(name, &[])
        .unwrap_or_else(|| panic!("{name} is exposed"))
}

/// STORE's `(event, ok)`.
fn store_ok(reply: &Option<V>) -> bool {
    match reply {
        Some(V::A(a)) if a.len() == 2 => a[1].boolean(),
        other => panic!("expected (bytes, bool), got {other:?}"),
    }
}

// A cpu_shm worker whose chunks are large, so that the shard's gather (a copy
// of every chunk it stores) takes far longer than the front's work per STORE.
const NB: usize = 16; // blocks per layer; one block is one chunk (--chunk-size 16)
const NH: i64 = 64;
const HS: i64 = 128;
const PLANE_BLOCK_BYTES: usize = 16 * (NH * HS) as usize * 2;
const LAYER_BYTES: usize = 2 * NB * PLANE_BLOCK_BYTES;
const STORE_IID: i64 = 77;

fn big_worker(c: &mut Client) -> ShmMap {
    let seg = unique("kvt_bp");
    let mut layer = ShmMap::create(&seg, LAYER_BYTES);
    layer.bytes_mut().copy_from_slice(&pattern(3, LAYER_BYTES));
    let nb = NB as i64;
    let desc = cpu_shm_wrapper(
        &format!("/{seg}"),
        LAYER_BYTES as i64,
        "float16",
        &[2, nb, 16, NH, HS],
        &[nb * 16 * NH * HS, 16 * NH * HS, NH * HS, HS, 1],
    );
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(STORE_IID, desc)),
        None
    );
    layer
}

/// A STORE of all `NB` blocks as the chunks of a fresh token sequence.
fn big_store_frames(seed: u32) -> Vec<Vec<u8>> {
    let toks = ed_tokens(seed, NB * ED_CHUNK);
    let key = ipc_key(
        "lm",
        1,
        Some(0),
        &toks,
        0,
        toks.len() as i64,
        &format!("bp-{seed}"),
        1,
    );
    let ids = V::A(vec![V::A((0..NB as i64).map(V::I).collect())]);
    [
        V::I(OP_STORE),
        key,
        V::I(STORE_IID),
        ids,
        V::Bin(b"stub_ipc_handle".to_vec()),
    ]
    .iter()
    .map(enc)
    .collect()
}

#[test]
fn busy_shard_overflow_is_refused_counted_and_never_stalls() {
    const REQUESTS: usize = 64;
    // One shard with room for one message in its mailbox and one more in its
    // overflow queue; the L1 holds every store (no refusal for lack of memory).
    let mut srv = Server::start(&[
        "--cores",
        "0",
        "--shard-queue-depth",
        "1",
        "--l1-size-gb",
        "1",
    ]);
    let mut c = srv.client();
    let _layer = big_worker(&mut c);
    let before = counter(&srv, "kvshard_shard_overflow_refused_total");
    assert_eq!(before, 0.0);

    // Pipelined: every STORE is sent before any reply is read.
    let t0 = Instant::now();
    let mut pending = std::collections::HashSet::new();
    for i in 0..REQUESTS {
        pending.insert(c.send_raw(big_store_frames(1000 + i as u32)));
    }
    // A request that needs no shard is answered while the shard is busy.
    let noop = c.send_raw(vec![enc(&V::I(OP_NOOP))]);
    let (mut ok, mut failed, mut noop_seen) = (0usize, 0usize, false);
    while !pending.is_empty() || !noop_seen {
        let (uid, payload) = recv_any(&mut c);
        if uid == noop {
            assert_eq!(payload, Some(s("OK")));
            noop_seen = true;
            continue;
        }
        assert!(pending.remove(&uid), "one reply per request (uid {uid})");
        if store_ok(&payload) {
            ok += 1;
        } else {
            failed += 1;
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "every request answered well within its deadline"
    );
    eprintln!("burst of {REQUESTS} stores: {ok} served, {failed} refused");
    assert_eq!(ok + failed, REQUESTS);
    assert!(
        failed > 0,
        "the shard was busy for the whole burst: requests beyond its mailbox and overflow are refused"
    );
    assert!(ok >= 2, "the mailbox and overflow queue were served");
    // Exact: every failure here is an overflow refusal.
    assert_eq!(
        counter(&srv, "kvshard_shard_overflow_refused_total"),
        failed as f64
    );
    assert!(counter(&srv, "kvshard_shard_mailbox_full_total") >= 1.0);
    wait_until("the overflow queue drains", || {
        counter(&srv, "kvshard_shard_overflow_queued") == 0.0
    });
    assert_eq!(
        srv.get_json("/status")["shards"]["overflow_queued"],
        serde_json::json!([0])
    );
    assert_eq!(srv.http("GET", "/healthcheck", None).0, 200);

    // Served normally afterwards.
    for seed in 2000..2004u32 {
        let frames = big_store_frames(seed);
        let uid = c.send_raw(frames);
        assert!(store_ok(&c.recv(uid).payload), "store after the burst");
    }
    assert_serving(&mut srv);
    assert_eq!(
        counter(&srv, "kvshard_shard_overflow_refused_total"),
        failed as f64,
        "nothing refused once the burst is over"
    );
}

/// A one-chunk engine_driven key per seed; the chunk's shard is its hash's.
fn one_chunk(seed: u32) -> (Vec<u32>, V) {
    let toks = ed_tokens(seed, ED_CHUNK);
    let key = ed_key("m", Some(0), &toks, 1, &format!("dead-{seed}"));
    (toks, key)
}

// The stop-shard hook is compiled into debug builds only.
#[cfg(debug_assertions)]
#[test]
fn a_stopped_shard_fails_its_requests_and_the_others_keep_serving() {
    // Without write credits: the registration sends the shards nothing, and
    // the first store part for shard 1 is the message that stops it.
    stopped_shard(false);
}

/// The same with write credits: the registration asks every shard for them,
/// which stops shard 1 then; each later prepare_store of its chunks is
/// refused before anything is handed out.
#[cfg(debug_assertions)]
#[test]
fn a_stopped_shard_fails_its_stores_on_write_credits_too() {
    stopped_shard(true);
}

#[cfg(debug_assertions)]
fn stopped_shard(credits: bool) {
    let dir = std::env::temp_dir().join(unique("kvshard_dead_shard"));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("server.log");
    let write_credits = if credits { "32" } else { "0" };
    let mut srv = Server::start_logged_env(
        &["--cores", "0-1", "--write-credits", write_credits],
        &log,
        &[("KVSHARD_TEST_STOP_SHARD", "1")],
    );
    let mut c = srv.client();
    let (name, size) = ed_register(&mut c, 5, "m");
    let mut pool = ShmMap::open(&name, size);
    // (No /status or /healthcheck before this point: each asks every shard,
    // and the hook stops shard 1 on its first message of any kind.)

    // One-chunk stores: those owned by shard 0 succeed; the first one owned
    // by shard 1 stops it (the hook) while in flight, the later ones are
    // refused at once.
    let (mut stored, mut failed) = (Vec::new(), 0usize);
    for seed in 0..32u32 {
        let (toks, key) = one_chunk(seed);
        let r = c
            .call(OP_PREPARE_STORE, &[key.clone(), V::I(5)])
            .expect("prepare_store reply");
        if ed_slots(&r).is_empty() {
            failed += 1;
            continue;
        }
        let slot = &ed_slots(&r)[0];
        let off = slot.get("offset").unwrap().int() as usize;
        let len = slot.get("length").unwrap().int() as usize;
        let data = pattern(seed as u64, len);
        pool.bytes_mut()[off..off + len].copy_from_slice(&data);
        assert_eq!(
            c.call(OP_COMMIT_STORE, &[key, V::I(5), V::Bin(vec![])]),
            Some(V::B(true))
        );
        stored.push((toks, data));
    }
    assert!(!stored.is_empty(), "shard 0 keeps serving");
    assert!(failed >= 2, "shard 1's chunks fail");
    // Without credits the first failure was in flight when the shard
    // stopped, and the rest were refused before being sent; with them, all
    // were refused.
    assert_eq!(
        counter(&srv, "kvshard_shard_dead_refused_total"),
        (failed - usize::from(!credits)) as f64
    );
    if credits {
        assert!(
            counter(&srv, "kvshard_prepare_stores_from_credits_total") > 0.0,
            "shard 0's stores were answered from its credits"
        );
    }
    assert_eq!(counter(&srv, "kvshard_dead_shards"), 1.0);

    let (st, body) = srv.http("GET", "/healthcheck", None);
    assert_eq!(st, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"], "unhealthy");
    assert!(
        v["reason"].as_str().unwrap().contains("[1]"),
        "the reason names the shard: {body}"
    );
    let status = srv.get_json("/status");
    assert_eq!(status["is_healthy"], false);
    assert_eq!(status["shards"]["dead_shards"], serde_json::json!([1]));

    // A lookup over chunks of both shards is answered (a miss), not hung.
    let toks = ed_tokens(77, 8 * ED_CHUNK);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 8, "both")), 0);
    c.call(OP_END_SESSION, &[s("both")]);
    // What shard 0 holds is still found and retrieved intact.
    for (i, (toks, data)) in stored.iter().enumerate().take(3) {
        let rid = format!("read-{i}");
        assert_eq!(ed_lookup(&mut c, &ed_key("m", None, toks, 1, &rid)), 1);
        let back = ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), toks, 1, &rid), 5);
        assert_eq!(back.as_slice(), std::slice::from_ref(data));
        c.call(OP_END_SESSION, &[s(&rid)]);
    }
    // A clear needs every shard: refused, answered.
    assert_eq!(c.call(OP_CLEAR, &[V::B(false)]), None);
    c.noop_ok();
    assert!(srv.alive());

    let text = std::fs::read_to_string(&log).unwrap();
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("shard 1 has stopped"))
        .collect();
    assert_eq!(
        errors.len(),
        1,
        "one clear ERROR line names the shard:\n{text}"
    );
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn instance_ids_in_the_internal_tag_space_are_refused() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    // engine_driven: no pool handed out, and the id cannot store.
    let reply = c.call(
        OP_REGISTER_ENGINE,
        &[engine_ctx_payload(-3, "m", 1, 2, 64, false, 16)],
    );
    assert_eq!(reply, None, "registration refused");
    let toks = ed_tokens(1, ED_CHUNK);
    let r = c
        .call(
            OP_PREPARE_STORE,
            &[ed_key("m", Some(0), &toks, 1, "neg"), V::I(-3)],
        )
        .expect("prepare_store reply");
    assert!(ed_slots(&r).is_empty());
    // lmcache_driven: refused, its STOREs fail.
    let (_layer, desc) = lm_layer("kvt_neg");
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(-5, desc)),
        None
    );
    let key = ipc_key("lm", 1, Some(0), &toks, 0, ED_CHUNK as i64, "neg", 1);
    let r = c.call(
        OP_STORE,
        &[
            key,
            V::I(-5),
            V::A(vec![V::A(vec![V::I(0)])]),
            V::Bin(b"stub_ipc_handle".to_vec()),
        ],
    );
    assert!(!store_ok(&r));
    assert!(srv.get_json("/status")["registered_gpu_ids"]
        .as_array()
        .unwrap()
        .is_empty());
    // The largest id vLLM can send (uuid4 & (2^63 - 1)) is fine.
    let big = i64::MAX;
    assert!(c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(big, "m", 1, 2, 64, false, 16)],
        )
        .is_some());
    let mut pool = {
        let r = c
            .call(
                OP_REGISTER_ENGINE,
                &[engine_ctx_payload(big, "m", 1, 2, 64, false, 16)],
            )
            .unwrap();
        ShmMap::open(
            r.get("shm_name").unwrap().str(),
            r.get("pool_size").unwrap().int() as usize,
        )
    };
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 1, "big"),
        big,
        9,
    );
    assert_eq!(stored.len(), 1);
}
