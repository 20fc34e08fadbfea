//! engine_driven flows: registration, store, lookup and retrieve through the
//! SHM pool, and the round trip that checks a server still serves.

use super::*;

// ------------------------------------------ engine_driven flow and scrape helpers
//
// Shared by tests/bad_input.rs and tests/http_api.rs: one worker's whole
// engine_driven flow (register, prepare/commit store, lookup, prepare/commit
// retrieve) and a Prometheus text reader.

/// Tokens per chunk of `Server::start` (its `--chunk-size`).
pub const ED_CHUNK: usize = 16;

/// Hidden size of an `ed_register`ed worker.
pub const ED_HIDDEN: usize = 64;

/// Bytes of one chunk object of a worker registered with hidden size
/// `hidden`: [2, 2 layers, 16 slots, hidden] f16.
pub const fn ed_chunk_bytes(hidden: usize) -> usize {
    2 * 2 * ED_CHUNK * hidden * 2
}

/// Bytes of one chunk object of an `ed_register`ed worker.
pub const ED_CHUNK_BYTES: usize = ed_chunk_bytes(ED_HIDDEN);

/// A token sequence of `n` tokens that differs for every seed.
pub fn ed_tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            seed.wrapping_mul(2_654_435_761)
                .wrapping_add(i.wrapping_mul(40_503))
                % 60_000
        })
        .collect()
}

/// A key of `n_chunks` whole chunks of `toks` for one worker (`Some`) or the
/// scheduler (`None`), one reader.
pub fn ed_key(model: &str, worker: Option<i64>, toks: &[u32], n_chunks: usize, rid: &str) -> V {
    ipc_key(
        model,
        1,
        worker,
        toks,
        0,
        (n_chunks * ED_CHUNK) as i64,
        rid,
        1,
    )
}

/// Replaces field `name` of a msgpack map (adding it when absent).
pub fn with_field(v: &V, name: &str, value: V) -> V {
    let V::M(m) = v else {
        panic!("with_field on a non-map: {v:?}")
    };
    let mut m = m.clone();
    match m.iter_mut().find(|(k, _)| *k == s(name)) {
        Some((_, x)) => *x = value,
        None => m.push((s(name), value)),
    }
    V::M(m)
}

/// Registers an engine_driven worker of `model` (world size 1, 2 layers, hidden
/// 64, float16); returns the pool's (shm name, size).
pub fn ed_register(c: &mut Client, iid: i64, model: &str) -> (String, usize) {
    ed_register_hidden(c, iid, model, ED_HIDDEN)
}

/// [`ed_register`] with hidden size `hidden` (chunk objects of
/// [`ed_chunk_bytes`]`(hidden)`).
pub fn ed_register_hidden(c: &mut Client, iid: i64, model: &str, hidden: usize) -> (String, usize) {
    let r = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                iid,
                model,
                1,
                2,
                hidden as i64,
                false,
                ED_CHUNK as i64,
            )],
        )
        .expect("engine_driven registration answered with a payload");
    (
        r.get("shm_name").expect("shm_name").str().to_owned(),
        r.get("pool_size").expect("pool_size").int() as usize,
    )
}

/// The slots of a PREPARE_STORE reply (empty: nothing reserved).
pub fn ed_slots(reply: &V) -> Vec<V> {
    reply
        .get("context")
        .and_then(|c| c.get("slots"))
        .unwrap_or_else(|| panic!("prepare_store reply without context.slots: {reply:?}"))
        .arr()
        .to_vec()
}

/// PREPARE_STORE, fill every reserved slot with a pattern, COMMIT_STORE (which
/// must succeed). Returns the bytes written, in chunk order; an empty list when
/// nothing needed storing.
pub fn ed_store(c: &mut Client, pool: &mut ShmMap, key: &V, iid: i64, seed: u64) -> Vec<Vec<u8>> {
    ed_store_sized(c, pool, key, iid, seed, ED_CHUNK_BYTES)
}

/// [`ed_store`] for a worker whose chunk objects are `chunk_bytes` long.
pub fn ed_store_sized(
    c: &mut Client,
    pool: &mut ShmMap,
    key: &V,
    iid: i64,
    seed: u64,
    chunk_bytes: usize,
) -> Vec<Vec<u8>> {
    let r = c
        .call(OP_PREPARE_STORE, &[key.clone(), V::I(iid)])
        .expect("prepare_store reply");
    let slots = ed_slots(&r);
    if slots.is_empty() {
        return Vec::new();
    }
    let mut written = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        let off = slot.get("offset").unwrap().int() as usize;
        let len = slot.get("length").unwrap().int() as usize;
        assert_eq!(len, chunk_bytes, "slot length");
        let data = pattern(seed.wrapping_mul(1_000_003).wrapping_add(i as u64), len);
        pool.bytes_mut()[off..off + len].copy_from_slice(&data);
        written.push(data);
    }
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[key.clone(), V::I(iid), V::Bin(vec![])]),
        Some(V::B(true)),
        "commit_store after a prepare_store that reserved slots"
    );
    written
}

/// LOOKUP (scheduler key) and the hit prefix in chunks.
pub fn ed_lookup(c: &mut Client, key: &V) -> i64 {
    assert_eq!(
        c.call(OP_LOOKUP, &[key.clone(), V::I(1)]),
        None,
        "lookup ack"
    );
    let rid = key.get("request_id").unwrap().str().to_owned();
    c.prefetch_result(&rid)
}

/// PREPARE_RETRIEVE (must succeed), copy every slot out, COMMIT_RETRIEVE.
pub fn ed_retrieve(c: &mut Client, pool: &ShmMap, key: &V, iid: i64) -> Vec<Vec<u8>> {
    let r = c
        .call(OP_PREPARE_RETRIEVE, &[key.clone(), V::I(iid)])
        .expect("prepare_retrieve reply");
    assert_eq!(
        r.get("success"),
        Some(&V::B(true)),
        "prepare_retrieve: {r:?}"
    );
    let out = r
        .get("context")
        .unwrap()
        .get("slots")
        .unwrap()
        .arr()
        .iter()
        .map(|slot| {
            let off = slot.get("offset").unwrap().int() as usize;
            let len = slot.get("length").unwrap().int() as usize;
            pool.bytes()[off..off + len].to_vec()
        })
        .collect();
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[key.clone(), V::I(iid)]),
        Some(V::B(true))
    );
    out
}

static SERVING_SEQ: AtomicU32 = AtomicU32::new(0);
/// Registers worker `iid` on model "m" and stores the first `n` chunks of
/// `toks` (engine_driven) under request "store"; returns the bytes stored.
pub fn ed_store_chunks(srv: &Server, iid: i64, toks: &[u32], n: usize, seed: u64) -> Vec<Vec<u8>> {
    ed_store_chunks_of(srv, iid, "m", ED_HIDDEN, toks, n, seed)
}

/// [`ed_store_chunks`] on model `model` with hidden size `hidden`.
pub fn ed_store_chunks_of(
    srv: &Server,
    iid: i64,
    model: &str,
    hidden: usize,
    toks: &[u32],
    n: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    let mut c = srv.client();
    let (name, size) = ed_register_hidden(&mut c, iid, model, hidden);
    let mut pool = ShmMap::open(&name, size);
    let key = ed_key(model, Some(0), toks, n, "store");
    let stored = ed_store_sized(&mut c, &mut pool, &key, iid, seed, ed_chunk_bytes(hidden));
    assert_eq!(stored.len(), n);
    c.call(OP_END_SESSION, &[s("store")]);
    stored
}

/// Registers worker `iid` on model "m", looks `n` chunks of `toks` up under
/// request `rid` and retrieves the hit prefix: (hits, the bytes retrieved).
pub fn ed_lookup_retrieve(
    srv: &Server,
    iid: i64,
    toks: &[u32],
    n: usize,
    rid: &str,
) -> (i64, Vec<Vec<u8>>) {
    ed_lookup_retrieve_of(srv, iid, "m", ED_HIDDEN, toks, n, rid)
}

/// [`ed_lookup_retrieve`] on model `model` with hidden size `hidden`.
pub fn ed_lookup_retrieve_of(
    srv: &Server,
    iid: i64,
    model: &str,
    hidden: usize,
    toks: &[u32],
    n: usize,
    rid: &str,
) -> (i64, Vec<Vec<u8>>) {
    let mut c = srv.client();
    let (name, size) = ed_register_hidden(&mut c, iid, model, hidden);
    let pool = ShmMap::open(&name, size);
    let hits = ed_lookup(&mut c, &ed_key(model, None, toks, n, rid));
    let back = if hits > 0 {
        ed_retrieve(
            &mut c,
            &pool,
            &ed_key(model, Some(0), toks, hits as usize, rid),
            iid,
        )
    } else {
        Vec::new()
    };
    c.call(OP_END_SESSION, &[s(rid)]);
    (hits, back)
}

/// The server process is alive, answers a noop, and serves a whole engine_driven
/// round trip (register, store, lookup hit, retrieve of the same bytes) on a
/// fresh connection, under a model of its own.
pub fn assert_serving(srv: &mut Server) {
    assert!(srv.alive(), "server process exited");
    let mut c = srv.client();
    c.noop_ok();
    let n = SERVING_SEQ.fetch_add(1, Ordering::Relaxed);
    let iid = 9_000_000 + n as i64;
    let model = "serving-check";
    let (name, size) = ed_register(&mut c, iid, model);
    let mut pool = ShmMap::open(&name, size);
    let toks = ed_tokens(0x5e41_0000 + n, 3 * ED_CHUNK + 5);
    let rid = format!("serving-{n}");
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key(model, Some(0), &toks, 3, &rid),
        iid,
        iid as u64,
    );
    assert_eq!(stored.len(), 3, "round trip: every chunk stored");
    assert_eq!(
        ed_lookup(&mut c, &ed_key(model, None, &toks, 3, &rid)),
        3,
        "round trip: lookup hits what was stored"
    );
    assert_eq!(
        ed_retrieve(&mut c, &pool, &ed_key(model, Some(0), &toks, 3, &rid), iid),
        stored,
        "round trip: retrieve returns the stored bytes"
    );
    assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(iid)]), None);
    assert!(srv.alive(), "server process exited");
}
