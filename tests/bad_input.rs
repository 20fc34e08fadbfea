//! End to end: the real binary fed malformed, mistyped, out-of-range and
//! out-of-order requests. Every request that names an operation gets an answer
//! a 0.5.6 client reads as a failure or a miss (never silence, never a crash),
//! and afterwards the server still serves a whole store / lookup / retrieve
//! round trip.

mod support;
use support::*;

use std::time::{Duration, Instant};

const CS: i64 = ED_CHUNK as i64;

/// STORE / RETRIEVE failure: `(b"", False)`.
fn transfer_failed() -> Option<V> {
    Some(V::A(vec![V::Bin(vec![]), V::B(false)]))
}

fn assert_nothing_reserved(reply: Option<V>, what: &str) {
    let r = reply.unwrap_or_else(|| panic!("{what}: prepare_store answered without a payload"));
    assert_eq!(ed_slots(&r), Vec::<V>::new(), "{what}: no slot reserved");
    let idx = r.get("context").unwrap().get("chunk_indices");
    assert_eq!(idx, Some(&V::A(vec![])), "{what}: no chunk index");
}

fn assert_retrieve_refused(reply: Option<V>, what: &str) {
    let r = reply.unwrap_or_else(|| panic!("{what}: prepare_retrieve answered without a payload"));
    assert_eq!(r.get("success"), Some(&V::B(false)), "{what}: {r:?}");
}

/// Sends `[op, *payloads]` as given and returns the reply, checking the op
/// frame is echoed byte for byte.
fn raw(c: &mut Client, op: Vec<u8>, payloads: Vec<Vec<u8>>) -> Reply {
    let mut frames = vec![op.clone()];
    frames.extend(payloads);
    let uid = c.send_raw(frames);
    let r = c.recv(uid);
    assert_eq!(r.op, op, "op frame echoed verbatim");
    r
}

/// Calls legacy op `op` with pre-encoded payload frames.
fn call_frames(c: &mut Client, op: i64, frames: Vec<Vec<u8>>) -> Option<V> {
    raw(c, enc(&V::I(op)), frames).payload
}

/// True when nothing arrives on `c` within `ms`.
fn silent_for(c: &Client, ms: i64) -> bool {
    c.sock.poll(zmq::POLLIN, ms).unwrap() == 0
}

fn counter(srv: &Server, name: &str) -> f64 {
    srv.metric(name, &[]).unwrap_or(0.0)
}

fn status(srv: &Server) -> serde_json::Value {
    srv.get_json("/status")
}

fn engine_ids(srv: &Server) -> Vec<i64> {
    serde_json::from_value(status(srv)["registered_non_cuda_instance_ids"].clone()).unwrap()
}

/// Registers engine_driven worker `iid` for model "m" and maps the pool.
fn worker(c: &mut Client, iid: i64) -> ShmMap {
    let (name, size) = ed_register(c, iid, "m");
    ShmMap::open(&name, size)
}

// ------------------------------------------------------------------ payloads

#[test]
fn malformed_msgpack_payload_frames() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let _pool = worker(&mut c, 1);
    let toks = ed_tokens(1, 4 * ED_CHUNK);
    let key = enc(&ed_key("m", Some(0), &toks, 4, "r"));
    let truncated = key[..key.len() - 3].to_vec();
    let mut trailing = key.clone();
    trailing.push(0xc0);
    let mut invalid_inside = key.clone();
    invalid_inside[1] = 0xc1; // the first field name's header
    let bads: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", truncated),
        ("trailing bytes", trailing),
        ("0xc1 inside", invalid_inside),
        ("lone 0xc1", vec![0xc1]),
        ("empty frame", vec![]),
        (
            "str header past the end",
            vec![0xdb, 0xff, 0xff, 0xff, 0xff, b'a'],
        ),
        (
            "array header past the end",
            vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0x01],
        ),
    ];
    let iid = enc(&V::I(1));
    let blocks = enc(&V::A(vec![V::A(vec![V::I(1)])]));
    let event = enc(&V::Bin(b"stub_ipc_handle".to_vec()));
    let mut refused = 0.0;
    for (what, bad) in &bads {
        let b = || bad.clone();
        // The broken frame as the key.
        assert_eq!(
            call_frames(
                &mut c,
                OP_STORE,
                vec![b(), iid.clone(), blocks.clone(), event.clone()]
            ),
            transfer_failed(),
            "store, key {what}"
        );
        assert_eq!(
            call_frames(
                &mut c,
                OP_RETRIEVE,
                vec![
                    b(),
                    iid.clone(),
                    blocks.clone(),
                    event.clone(),
                    enc(&V::I(0))
                ]
            ),
            transfer_failed(),
            "retrieve, key {what}"
        );
        assert_nothing_reserved(
            call_frames(&mut c, OP_PREPARE_STORE, vec![b(), iid.clone()]),
            &format!("prepare_store, key {what}"),
        );
        assert_retrieve_refused(
            call_frames(&mut c, OP_PREPARE_RETRIEVE, vec![b(), iid.clone()]),
            &format!("prepare_retrieve, key {what}"),
        );
        assert_eq!(
            call_frames(
                &mut c,
                OP_COMMIT_STORE,
                vec![b(), iid.clone(), enc(&V::Bin(vec![]))]
            ),
            Some(V::B(false)),
            "commit_store, key {what}"
        );
        assert_eq!(
            call_frames(&mut c, OP_COMMIT_RETRIEVE, vec![b(), iid.clone()]),
            Some(V::B(false)),
            "commit_retrieve, key {what}"
        );
        assert_eq!(
            call_frames(&mut c, OP_LOOKUP, vec![b(), enc(&V::I(1))]),
            None,
            "lookup, key {what}"
        );
        // The broken frame in a later position.
        assert_eq!(
            call_frames(
                &mut c,
                OP_STORE,
                vec![key.clone(), b(), blocks.clone(), event.clone()]
            ),
            transfer_failed(),
            "store, instance_id {what}"
        );
        assert_nothing_reserved(
            call_frames(&mut c, OP_PREPARE_STORE, vec![key.clone(), b()]),
            &format!("prepare_store, instance_id {what}"),
        );
        assert_eq!(
            call_frames(&mut c, OP_QUERY_PREFETCH_STATUS, vec![b()]),
            Some(V::I(0)),
            "query_prefetch_status {what}"
        );
        assert_eq!(
            call_frames(&mut c, OP_WAIT_PREFETCH_STATUS, vec![enc(&s("r")), b()]),
            Some(V::I(0)),
            "wait_prefetch_status, timeout {what}"
        );
        assert_eq!(
            call_frames(&mut c, OP_PING, vec![b()]),
            Some(V::B(false)),
            "ping {what}"
        );
        assert_eq!(
            call_frames(&mut c, OP_REGISTER_ENGINE, vec![b()]),
            None,
            "register {what}"
        );
        assert_eq!(
            call_frames(&mut c, OP_END_SESSION, vec![b()]),
            None,
            "end_session {what}"
        );
        assert_eq!(
            call_frames(&mut c, OP_CLEAR, vec![b()]),
            None,
            "clear {what}"
        );
        refused += 15.0;
    }
    // None of the broken lookups ran: the request id has no result.
    assert_eq!(c.prefetch_result("r"), 0);
    assert_eq!(counter(&srv, "kvshard_bad_requests_total"), refused);
    assert_eq!(
        counter(&srv, "lmcache_mp_lookups_requests_total"),
        0.0,
        "no broken lookup was counted as a lookup"
    );
    assert_serving(&mut srv);
}

/// Encodes map `v` with field `name` (added if absent) set to the raw bytes
/// `value`: for values the test encoder cannot build, like 100k-deep nesting.
fn enc_with_raw_field(v: &V, name: &str, value: &[u8]) -> Vec<u8> {
    let V::M(m) = with_field(v, name, V::Nil) else {
        unreachable!()
    };
    assert!(m.len() <= 15, "fixmap only");
    let mut out = vec![0x80 | m.len() as u8];
    for (k, x) in &m {
        out.extend(enc(k));
        if *k == s(name) {
            out.extend(value);
        } else {
            out.extend(enc(x));
        }
    }
    out
}

#[test]
fn deeply_nested_values_are_refused_not_recursed() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let _pool = worker(&mut c, 1);
    let toks = ed_tokens(2, 2 * ED_CHUNK);
    // 100k nested one-element arrays, as request_configs (a str-keyed dict that
    // is decoded) and as an unknown field (which is skipped).
    let mut nested = vec![0x91u8; 100_000];
    nested.push(0xc0);
    let mut configs = vec![0x81, 0xa1, b'x'];
    configs.extend(&nested);
    let skey = ed_key("m", None, &toks, 2, "deep");
    let frame = enc_with_raw_field(&skey, "request_configs", &configs);
    assert_eq!(
        call_frames(&mut c, OP_LOOKUP, vec![frame, enc(&V::I(1))]),
        None
    );
    let wkey = ed_key("m", Some(0), &toks, 2, "deep");
    let frame = enc_with_raw_field(&wkey, "x_unknown", &nested);
    assert_nothing_reserved(
        call_frames(&mut c, OP_PREPARE_STORE, vec![frame, enc(&V::I(1))]),
        "prepare_store with a deep unknown field",
    );
    assert_eq!(c.prefetch_result("deep"), 0, "the deep lookup did not run");
    assert_eq!(counter(&srv, "kvshard_bad_requests_total"), 2.0);
    assert_serving(&mut srv);
}

#[test]
fn wrong_payload_types() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(3, 3 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 3, "t");
    let skey = ed_key("m", None, &toks, 3, "t");
    let stored = ed_store(&mut c, &mut pool, &wkey, 1, 3);
    assert_eq!(stored.len(), 3);

    // str world_size in a lookup: refused, so the request has no result.
    let k = with_field(&skey, "world_size", s("1"));
    assert_eq!(c.call(OP_LOOKUP, &[k, V::I(1)]), None);
    assert_eq!(c.prefetch_result("t"), 0, "str world_size: no lookup ran");
    // float token ids.
    let floats = V::A(toks.iter().map(|t| V::F(*t as f64)).collect());
    let k = with_field(&wkey, "token_ids", floats);
    assert_retrieve_refused(
        c.call(OP_PREPARE_RETRIEVE, &[k, V::I(1)]),
        "float token ids",
    );
    // bool instance_id (msgspec refuses bool for int).
    let blocks = V::A(vec![V::A(vec![V::I(1), V::I(2), V::I(3)])]);
    let ev = V::Bin(vec![]);
    assert_eq!(
        c.call(
            OP_STORE,
            &[wkey.clone(), V::B(true), blocks.clone(), ev.clone()]
        ),
        transfer_failed()
    );
    assert_nothing_reserved(
        c.call(OP_PREPARE_STORE, &[wkey.clone(), V::B(true)]),
        "bool instance_id",
    );
    // nil request_id.
    let k = with_field(&wkey, "request_id", V::Nil);
    assert_eq!(c.call(OP_COMMIT_RETRIEVE, &[k, V::I(1)]), Some(V::B(false)));
    // a list where a map is expected (the key's values in order).
    let V::M(fields) = &wkey else { unreachable!() };
    let as_list = V::A(fields.iter().map(|(_, v)| v.clone()).collect());
    assert_nothing_reserved(
        c.call(OP_PREPARE_STORE, &[as_list, V::I(1)]),
        "key as a list",
    );
    let V::M(p) = engine_ctx_payload(5, "m", 1, 2, 64, false, CS) else {
        unreachable!()
    };
    let payload_list = V::A(p.iter().map(|(_, v)| v.clone()).collect());
    assert_eq!(c.call(OP_REGISTER_ENGINE, &[payload_list]), None);
    let p = with_field(
        &engine_ctx_payload(6, "m", 1, 2, 64, false, CS),
        "use_mla",
        V::I(0),
    );
    assert_eq!(
        c.call(OP_REGISTER_ENGINE, &[p]),
        None,
        "int for a bool field"
    );
    let p = with_field(
        &engine_ctx_payload(7, "m", 1, 2, 64, false, CS),
        "instance_id",
        s("7"),
    );
    assert_eq!(c.call(OP_REGISTER_ENGINE, &[p]), None, "str instance_id");
    // a map where a list is expected.
    assert_eq!(
        c.call(
            OP_STORE,
            &[wkey.clone(), V::I(1), map(&[("0", V::I(1))]), ev]
        ),
        transfer_failed()
    );
    // scalar ops.
    assert_eq!(c.call(OP_QUERY_PREFETCH_STATUS, &[V::I(5)]), Some(V::I(0)));
    assert_eq!(
        c.call(OP_WAIT_PREFETCH_STATUS, &[s("t"), s("1.0")]),
        Some(V::I(0))
    );
    assert_eq!(c.call(OP_PING, &[s("1")]), Some(V::B(false)));
    assert_eq!(c.call(OP_END_SESSION, &[V::I(1)]), None);
    // clear(force=1): an int is not a bool, so nothing is cleared.
    assert_eq!(c.call(OP_CLEAR, &[V::I(1)]), None);
    assert_eq!(
        ed_lookup(&mut c, &skey),
        3,
        "a refused clear clears nothing"
    );
    assert_eq!(ed_retrieve(&mut c, &pool, &wkey, 1), stored);

    assert_eq!(
        engine_ids(&srv),
        vec![1],
        "no refused registration took effect"
    );
    assert_serving(&mut srv);
}

#[test]
fn token_ids_out_of_u32_range() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(4, 2 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 2, "u");
    let skey = ed_key("m", None, &toks, 2, "u");
    for bad in [1i64 << 32, -1, i64::MAX, i64::MIN] {
        let mut t: Vec<V> = toks.iter().map(|x| V::I(*x as i64)).collect();
        t[5] = V::I(bad);
        let arr = V::A(t);
        assert_eq!(
            c.call(
                OP_LOOKUP,
                &[with_field(&skey, "token_ids", arr.clone()), V::I(1)]
            ),
            None
        );
        assert_eq!(c.prefetch_result("u"), 0, "token {bad}: no lookup ran");
        assert_nothing_reserved(
            c.call(
                OP_PREPARE_STORE,
                &[with_field(&wkey, "token_ids", arr.clone()), V::I(1)],
            ),
            &format!("token {bad}"),
        );
        assert_eq!(
            c.call(
                OP_STORE,
                &[
                    with_field(&wkey, "token_ids", arr),
                    V::I(1),
                    V::A(vec![V::A(vec![V::I(1), V::I(2)])]),
                    V::Bin(vec![])
                ]
            ),
            transfer_failed()
        );
    }
    // The same request id still works with valid tokens.
    assert_eq!(ed_store(&mut c, &mut pool, &wkey, 1, 4).len(), 2);
    assert_eq!(ed_lookup(&mut c, &skey), 2);
    assert_serving(&mut srv);
}

#[test]
fn negative_unaligned_and_out_of_bounds_ranges() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(5, 4 * ED_CHUNK + 3);
    let len = toks.len() as i64;
    let ranges = [
        (-CS, 2 * CS),
        (0, -CS),
        (3, 2 * CS),
        (0, CS + 1),
        (CS, 5 * CS), // end beyond the tokens
        (0, len),     // unaligned end at the token count
        (3 * CS, CS), // start after end
        (i64::MIN, i64::MAX),
    ];
    for (start, end) in ranges {
        let what = format!("[{start}, {end})");
        let wkey = ipc_key("m", 1, Some(0), &toks, start, end, "g", 1);
        assert_nothing_reserved(c.call(OP_PREPARE_STORE, &[wkey.clone(), V::I(1)]), &what);
        assert_retrieve_refused(c.call(OP_PREPARE_RETRIEVE, &[wkey.clone(), V::I(1)]), &what);
        assert_eq!(
            c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(1), V::Bin(vec![])]),
            Some(V::B(false)),
            "{what}"
        );
        let skey = ipc_key("m", 1, None, &toks, start, end, "g", 1);
        assert_eq!(
            c.call(OP_FREE_LOOKUP_LOCKS, &[skey, V::I(1)]),
            None,
            "{what}"
        );
    }
    // Lookups hash from token 0, so only a bad end matters to them.
    for end in [-CS, CS + 1, 5 * CS, len] {
        let skey = ipc_key("m", 1, None, &toks, 0, end, "g", 1);
        assert_eq!(ed_lookup(&mut c, &skey), 0, "lookup end {end}");
    }
    // Nothing was reserved along the way: a valid store gets every chunk.
    let wkey = ed_key("m", Some(0), &toks, 4, "g");
    assert_eq!(ed_store(&mut c, &mut pool, &wkey, 1, 5).len(), 4);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 4, "g")), 4);
    assert_serving(&mut srv);
}

#[test]
fn worker_id_and_world_size_out_of_range() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let _pool = worker(&mut c, 1);
    let toks = ed_tokens(6, 2 * ED_CHUNK);
    let e = 2 * CS;
    for (ws, w) in [
        (1, 1),
        (1, -1),
        (1, 1 << 40),
        (2, 2),
        (0, 0),
        (300, 0),
        (256, 0),
        (-1, 0),
    ] {
        let wkey = ipc_key("m", ws, Some(w), &toks, 0, e, "w", 1);
        let what = format!("world_size {ws} worker {w}");
        assert_nothing_reserved(c.call(OP_PREPARE_STORE, &[wkey.clone(), V::I(1)]), &what);
        assert_retrieve_refused(c.call(OP_PREPARE_RETRIEVE, &[wkey, V::I(1)]), &what);
    }
    for ws in [0, 300, 256, -1] {
        let skey = ipc_key("m", ws, None, &toks, 0, e, "w", 1);
        assert_eq!(ed_lookup(&mut c, &skey), 0, "lookup world_size {ws}");
    }
    let before = counter(&srv, "kvshard_bad_requests_total");
    for ws in [0, 300, -1] {
        let p = engine_ctx_payload(50 + ws, "m", ws, 2, 64, false, CS);
        assert_eq!(
            c.call(OP_REGISTER_ENGINE, &[p]),
            None,
            "register world_size {ws}"
        );
    }
    assert_eq!(counter(&srv, "kvshard_bad_requests_total"), before + 3.0);
    assert_eq!(engine_ids(&srv), vec![1]);
    assert_serving(&mut srv);
}

#[test]
fn lookup_without_kv_readers_answers_zero_and_locks_nothing() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(7, 3 * ED_CHUNK);
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 3, "s"),
        1,
        7,
    );
    assert_eq!(stored.len(), 3);
    for readers in [0, -1, 1 << 40] {
        let key = ipc_key("m", 1, None, &toks, 0, 3 * CS, "z", readers);
        assert_eq!(ed_lookup(&mut c, &key), 0, "num_kv_readers {readers}");
    }
    let st = status(&srv);
    assert_eq!(
        st["storage_manager"]["l1_manager"]["read_locked_count"], 0,
        "a refused lookup takes no read lock"
    );
    assert_eq!(
        srv.metric(
            "lmcache_mp_lookup_early_exit_requests_total",
            &[("reason", "bad_request")]
        ),
        Some(3.0)
    );
    // The same request with a reader finds everything.
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "z")), 3);
    assert_eq!(
        ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 3, "z"), 1),
        stored
    );
    assert_serving(&mut srv);
}

// ------------------------------------------------------------------ op frames

#[test]
fn unknown_operation_frames_are_answered_without_payload() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let ops: Vec<Vec<u8>> = vec![
        enc(&V::I(99)),
        enc(&s("frobnicate")),
        enc(&V::I(11)), // retired legacy id
        enc(&V::F(8.0)),
        enc(&V::B(true)),
        enc(&V::I(-8)),
        enc(&V::Nil),
        enc(&V::Bin(vec![8])),
        enc(&V::A(vec![V::I(8)])),
        enc(&V::I(8)).into_iter().chain([0x00]).collect(), // trailing byte
        vec![0xc1],
        vec![0xa5, b'n', b'o'], // truncated str
    ];
    for op in &ops {
        let r = raw(&mut c, op.clone(), vec![enc(&s("payload"))]);
        assert_eq!(r.payload, None, "op frame {op:02x?}");
    }
    assert_eq!(counter(&srv, "kvshard_unknown_ops_total"), ops.len() as f64);
    assert_serving(&mut srv);
}

#[test]
fn unsupported_operations_are_answered_and_counted() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let calls: Vec<(&str, Vec<u8>, Vec<V>)> = vec![
        ("cb_protocol_handshake", enc(&V::I(33)), vec![V::I(1)]),
        (
            "cb_protocol_handshake",
            enc(&s("cb_protocol_handshake")),
            vec![V::I(2)],
        ),
        (
            "p2p_lookup_and_lock",
            enc(&V::I(29)),
            vec![V::A(vec![]), V::M(vec![])],
        ),
        (
            "subscribe_kv_events",
            enc(&s("subscribe_kv_events")),
            vec![V::I(1), s("m"), V::I(0), V::I(16)],
        ),
        // Wrong frame counts do not change the answer for an unsupported op.
        ("server_module_call", enc(&s("server_module_call")), vec![]),
        ("register_q_cache", enc(&V::I(3)), vec![V::I(1)]),
    ];
    for (name, op, args) in &calls {
        let r = raw(&mut c, op.clone(), args.iter().map(enc).collect());
        assert_eq!(r.payload, None, "{name}: answered with no payload");
    }
    for (name, n) in [
        ("cb_protocol_handshake", 2.0),
        ("p2p_lookup_and_lock", 1.0),
        ("subscribe_kv_events", 1.0),
        ("server_module_call", 1.0),
        ("register_q_cache", 1.0),
    ] {
        assert_eq!(
            srv.metric("kvshard_unsupported_ops_total", &[("op", name)]),
            Some(n),
            "{name} counted"
        );
    }
    assert_eq!(counter(&srv, "kvshard_unknown_ops_total"), 0.0);
    assert_serving(&mut srv);
}

#[test]
fn wrong_frame_counts() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(8, 2 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 2, "f");
    let skey = ed_key("m", None, &toks, 2, "f");
    let stored = ed_store(&mut c, &mut pool, &wkey, 1, 8);
    let (k, i) = (enc(&wkey), enc(&V::I(1)));
    let blocks = enc(&V::A(vec![V::A(vec![V::I(1), V::I(2)])]));
    let ev = enc(&V::Bin(vec![]));

    assert_eq!(call_frames(&mut c, OP_LOOKUP, vec![enc(&skey)]), None);
    assert_eq!(
        call_frames(&mut c, OP_LOOKUP, vec![enc(&skey), i.clone(), i.clone()]),
        None
    );
    assert_eq!(c.prefetch_result("f"), 0, "neither lookup ran");
    let other = ed_tokens(80, 2 * ED_CHUNK);
    let okey = enc(&ed_key("m", Some(0), &other, 2, "f2"));
    assert_nothing_reserved(
        call_frames(&mut c, OP_PREPARE_STORE, vec![okey.clone()]),
        "1 frame",
    );
    assert_nothing_reserved(
        call_frames(&mut c, OP_PREPARE_STORE, vec![okey, i.clone(), i.clone()]),
        "3 frames",
    );
    assert_eq!(
        call_frames(&mut c, OP_COMMIT_STORE, vec![k.clone(), i.clone()]),
        Some(V::B(false))
    );
    assert_eq!(
        call_frames(
            &mut c,
            OP_COMMIT_STORE,
            vec![k.clone(), i.clone(), ev.clone(), ev.clone()]
        ),
        Some(V::B(false))
    );
    assert_eq!(
        call_frames(&mut c, OP_STORE, vec![k.clone(), i.clone(), blocks.clone()]),
        transfer_failed()
    );
    assert_eq!(
        call_frames(
            &mut c,
            OP_RETRIEVE,
            vec![
                k.clone(),
                i.clone(),
                blocks,
                ev.clone(),
                i.clone(),
                i.clone()
            ]
        ),
        transfer_failed()
    );
    assert_retrieve_refused(
        call_frames(&mut c, OP_PREPARE_RETRIEVE, vec![k.clone()]),
        "1 frame",
    );
    assert_eq!(
        call_frames(&mut c, OP_COMMIT_RETRIEVE, vec![k]),
        Some(V::B(false))
    );
    assert_eq!(
        call_frames(&mut c, OP_QUERY_PREFETCH_STATUS, vec![]),
        Some(V::I(0))
    );
    assert_eq!(
        call_frames(
            &mut c,
            OP_QUERY_PREFETCH_STATUS,
            vec![enc(&s("f")), ev.clone()]
        ),
        Some(V::I(0))
    );
    assert_eq!(call_frames(&mut c, OP_PING, vec![]), Some(V::B(false)));
    assert_eq!(
        call_frames(&mut c, OP_NOOP, vec![ev.clone()]),
        Some(s("OK"))
    );
    assert_eq!(
        call_frames(&mut c, OP_GET_CHUNK_SIZE, vec![ev.clone()]),
        Some(V::I(CS))
    );
    assert_eq!(call_frames(&mut c, OP_REGISTER_ENGINE, vec![]), None);
    // clear with two payloads is refused: nothing is cleared.
    assert_eq!(
        call_frames(&mut c, OP_CLEAR, vec![enc(&V::B(false)), ev]),
        None
    );
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, "f3")), 2);
    assert_eq!(
        ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 2, "f3"), 1),
        stored
    );
    // The nothing-reserved answers above left nothing staged.
    assert_eq!(
        ed_store(
            &mut c,
            &mut pool,
            &ed_key("m", Some(0), &other, 2, "f2"),
            1,
            80
        )
        .len(),
        2
    );
    assert_serving(&mut srv);
}

#[test]
fn oversized_frames() {
    let mut srv = Server::start(&["--max-frame-bytes", "65536"]);
    let mut c = srv.client();
    let _pool = worker(&mut c, 1);
    // 40k tokens of 3 bytes each: a 120 KB key frame.
    let toks: Vec<u32> = (0..40_000u32).map(|i| 1_000 + i % 50_000).collect();
    let end = (toks.len() / ED_CHUNK * ED_CHUNK) as i64;
    let wkey = ipc_key("m", 1, Some(0), &toks, 0, end, "big", 1);
    let skey = ipc_key("m", 1, None, &toks, 0, end, "big", 1);
    assert!(enc(&wkey).len() > 100_000);
    assert_eq!(c.call(OP_LOOKUP, &[skey, V::I(1)]), None);
    assert_eq!(c.prefetch_result("big"), 0);
    assert_nothing_reserved(
        c.call(OP_PREPARE_STORE, &[wkey.clone(), V::I(1)]),
        "120 KB key",
    );
    let small = ed_key("m", Some(0), &toks[..32], 2, "small");
    assert_eq!(
        c.call(
            OP_STORE,
            &[small, V::I(1), V::A(vec![]), V::Bin(vec![7; 100_000])]
        ),
        transfer_failed(),
        "100 KB event handle"
    );
    assert_eq!(
        c.call(OP_QUERY_PREFETCH_STATUS, &[s(&"x".repeat(100_000))]),
        Some(V::I(0))
    );
    assert_eq!(counter(&srv, "kvshard_bad_requests_total"), 4.0);
    assert_eq!(
        counter(&srv, "lmcache_mp_lookups_requests_total"),
        0.0,
        "an oversized lookup is not run"
    );
    assert_serving(&mut srv);
}

#[test]
fn frame_far_over_the_limit_drops_only_that_connection() {
    let mut srv = Server::start(&["--max-frame-bytes", "65536"]);
    // Above ZeroMQ's hard cap (twice --max-frame-bytes, at least 1 GiB) the
    // transport drops the connection as soon as it reads the frame's length,
    // before the front sees the message; the server carries on. (The zeroed
    // buffer is never written: it costs the test no memory.)
    let cap = kvshard_transport::server::zmq_message_cap(65536) as usize;
    assert_eq!(cap, 1 << 30);
    let mut bad = srv.client();
    bad.send_raw(vec![enc(&V::I(OP_NOOP)), vec![0u8; cap + 1]]);
    assert!(
        silent_for(&bad, 500),
        "a frame above the transport cap gets no reply"
    );
    assert!(srv.alive());
    assert_serving(&mut srv);
}

#[test]
fn message_with_only_a_uid_frame_is_echoed() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let uid = c.send_raw(vec![]);
    let frames = c
        .sock
        .recv_multipart(0)
        .expect("an answer to a uid-only message");
    assert_eq!(frames, vec![enc(&V::I(uid))]);
    c.sock.send_multipart([Vec::<u8>::new()], 0).unwrap();
    let frames = c
        .sock
        .recv_multipart(0)
        .expect("an answer to an empty message");
    assert_eq!(frames, vec![Vec::<u8>::new()]);
    c.noop_ok();
    assert!(counter(&srv, "kvshard_bad_requests_total") >= 2.0);
    assert_serving(&mut srv);
}

#[test]
fn empty_op_frame_is_a_stream_control_with_no_reply() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    c.send_raw(vec![vec![], b"ack".to_vec()]);
    c.send_raw(vec![vec![], b"cancel".to_vec()]);
    c.send_raw(vec![vec![]]);
    c.send_raw(vec![vec![], enc(&V::I(OP_NOOP)), vec![0xc1]]);
    assert!(silent_for(&c, 300), "stream controls are not answered");
    // `call` matches the uid, so a stray reply to the controls would fail here.
    c.noop_ok();
    assert_eq!(c.call(OP_GET_CHUNK_SIZE, &[]), Some(V::I(CS)));
    assert_serving(&mut srv);
}

// ------------------------------------------------------------------ protocol order

#[test]
fn commits_without_a_prepare_fail() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let pool = worker(&mut c, 1);
    let toks = ed_tokens(9, 3 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 3, "c");
    let empty = V::Bin(vec![]);
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(1), empty.clone()]),
        Some(V::B(false))
    );
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[wkey.clone(), V::I(1)]),
        Some(V::B(false))
    );
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(404), empty.clone()]),
        Some(V::B(false))
    );
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[wkey.clone(), V::I(404)]),
        Some(V::B(false))
    );

    // A commit for another range than the one prepared fails; the prepared one
    // still commits, once.
    let r = c.call(OP_PREPARE_STORE, &[wkey.clone(), V::I(1)]).unwrap();
    assert_eq!(ed_slots(&r).len(), 3);
    let shorter = ed_key("m", Some(0), &toks, 2, "c");
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[shorter, V::I(1), empty.clone()]),
        Some(V::B(false))
    );
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(2), empty.clone()]),
        Some(V::B(false))
    );
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(1), empty.clone()]),
        Some(V::B(true))
    );
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(1), empty]),
        Some(V::B(false))
    );

    // A prepare_retrieve that failed (no lookup holds locks) leaves nothing to commit.
    assert_retrieve_refused(
        c.call(OP_PREPARE_RETRIEVE, &[wkey.clone(), V::I(1)]),
        "no lookup",
    );
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[wkey.clone(), V::I(1)]),
        Some(V::B(false))
    );
    // After a real retrieve, a second commit fails.
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "c2")), 3);
    let key2 = ed_key("m", Some(0), &toks, 3, "c2");
    ed_retrieve(&mut c, &pool, &key2, 1);
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[key2, V::I(1)]),
        Some(V::B(false))
    );
    assert_serving(&mut srv);
}

#[test]
fn force_clear_and_unregister_in_the_middle_of_transfers() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let empty = V::Bin(vec![]);
    // prepare_store, force clear, commit: the freed slots must not come back as
    // objects (their memory may already hold something else).
    let toks = ed_tokens(30, 2 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 2, "fc");
    let r = c.call(OP_PREPARE_STORE, &[wkey.clone(), V::I(1)]).unwrap();
    assert_eq!(ed_slots(&r).len(), 2);
    assert_eq!(c.call(OP_CLEAR, &[V::B(true)]), None);
    let committed = c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(1), empty.clone()]);
    assert!(matches!(committed, Some(V::B(_))), "{committed:?}");
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, "fc2")), 0);
    // Stored, looked up (locked), force-cleared, then retrieved: refused or
    // answered, never a hang; afterwards nothing is left.
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 2, "fc3"),
        1,
        30,
    );
    assert_eq!(stored.len(), 2);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, "fc4")), 2);
    assert_eq!(c.call(OP_CLEAR, &[V::B(true)]), None);
    let rkey = ed_key("m", Some(0), &toks, 2, "fc4");
    assert_retrieve_refused(
        c.call(OP_PREPARE_RETRIEVE, &[rkey.clone(), V::I(1)]),
        "after force clear",
    );
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[rkey, V::I(1)]),
        Some(V::B(false))
    );
    let st = status(&srv);
    assert_eq!(st["storage_manager"]["l1_manager"]["total_object_count"], 0);
    // Unregistering drops a pending reservation: its commit fails, nothing shows.
    let other = ed_tokens(31, 2 * ED_CHUNK);
    let okey = ed_key("m", Some(0), &other, 2, "un");
    let r = c.call(OP_PREPARE_STORE, &[okey.clone(), V::I(1)]).unwrap();
    assert_eq!(ed_slots(&r).len(), 2);
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(1)]), None);
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[okey, V::I(1), empty]),
        Some(V::B(false))
    );
    let _pool2 = worker(&mut c, 2);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &other, 2, "un2")), 0);
    let st = status(&srv);
    assert_eq!(
        st["storage_manager"]["l1_manager"]["staging_object_count"],
        0
    );
    assert_serving(&mut srv);
}

#[test]
fn transfers_from_unregistered_instances_fail() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let toks = ed_tokens(10, 2 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 2, "x");
    let blocks = V::A(vec![V::A(vec![V::I(1), V::I(2)])]);
    let ev = V::Bin(b"stub_ipc_handle".to_vec());
    let check = |c: &mut Client, iid: i64| {
        assert_nothing_reserved(
            c.call(OP_PREPARE_STORE, &[wkey.clone(), V::I(iid)]),
            "unregistered",
        );
        assert_retrieve_refused(
            c.call(OP_PREPARE_RETRIEVE, &[wkey.clone(), V::I(iid)]),
            "unregistered",
        );
        assert_eq!(
            c.call(
                OP_STORE,
                &[wkey.clone(), V::I(iid), blocks.clone(), ev.clone()]
            ),
            transfer_failed()
        );
        assert_eq!(
            c.call(
                OP_RETRIEVE,
                &[wkey.clone(), V::I(iid), blocks.clone(), ev.clone(), V::I(0)]
            ),
            transfer_failed()
        );
    };
    check(&mut c, 777);
    // Unregistered after registering: the same.
    let _pool = worker(&mut c, 778);
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(778)]), None);
    check(&mut c, 778);
    // Unregistering twice, or something never registered, is harmless.
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(778)]), None);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(779)]), None);
    assert_eq!(
        counter(&srv, "kvshard_unregistered_instance_requests_total"),
        8.0
    );
    assert_eq!(engine_ids(&srv), Vec::<i64>::new());
    assert_serving(&mut srv);
}

// ------------------------------------------------------------------ registrations

fn lm_store(c: &mut Client, iid: i64, toks: &[u32]) -> Option<V> {
    c.call(
        OP_STORE,
        &[
            ed_key("lm", Some(0), toks, 1, "lm"),
            V::I(iid),
            V::A(vec![V::A(vec![V::I(1)])]),
            V::Bin(b"stub_ipc_handle".to_vec()),
        ],
    )
}

#[test]
fn register_kv_cache_with_a_missing_shm_segment() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let toks = ed_tokens(11, ED_CHUNK);
    // Control: the same descriptor over a segment that exists registers and stores.
    let (_layer, good) = lm_layer("kvt_layer");
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(20, good)),
        None
    );
    assert_eq!(
        lm_store(&mut c, 20, &toks),
        Some(V::A(vec![V::Bin(vec![]), V::B(true)]))
    );

    let missing = format!("/{}", unique("kvt_no_such_segment"));
    let bad = cpu_shm_wrapper(
        &missing,
        LM_LAYER_BYTES,
        "float16",
        &LM_LAYER_SHAPE,
        &LM_LAYER_STRIDE,
    );
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(21, bad)),
        None
    );
    assert_eq!(
        lm_store(&mut c, 21, &ed_tokens(12, ED_CHUNK)),
        transfer_failed()
    );
    assert_eq!(counter(&srv, "kvshard_failed_registrations_total"), 1.0);
    let st = status(&srv);
    assert_eq!(st["registered_gpu_ids"], serde_json::json!([20]));
    assert_serving(&mut srv);
}

#[test]
fn register_kv_cache_with_a_cuda_descriptor_is_refused() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let inner = map(&[
        ("type", s("cuda")),
        (
            "handle",
            V::A(vec![
                V::I(0),
                V::Nil,
                V::I(LM_LAYER_BYTES),
                V::I(0),
                V::Nil,
                V::I(0),
                V::Nil,
                V::B(false),
            ]),
        ),
        ("version", V::I(1)),
        (
            "metadata",
            map(&[
                ("dtype", s("float16")),
                (
                    "shape",
                    V::A(LM_LAYER_SHAPE.iter().map(|x| V::I(*x)).collect()),
                ),
                (
                    "stride",
                    V::A(LM_LAYER_STRIDE.iter().map(|x| V::I(*x)).collect()),
                ),
                ("storage_offset", V::I(0)),
                ("device_uuid", s("GPU-00000000-0000-0000-0000-000000000000")),
            ]),
        ),
    ]);
    let desc = V::Ext(1, enc(&inner));
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(30, desc)),
        None
    );
    assert_eq!(
        lm_store(&mut c, 30, &ed_tokens(13, ED_CHUNK)),
        transfer_failed()
    );
    assert_eq!(counter(&srv, "kvshard_failed_registrations_total"), 1.0);
    // An unknown descriptor type is refused the same way.
    let other = V::Ext(1, enc(&map(&[("type", s("npu")), ("version", V::I(1))])));
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(31, other)),
        None
    );
    assert_eq!(
        lm_store(&mut c, 31, &ed_tokens(14, ED_CHUNK)),
        transfer_failed()
    );
    assert_eq!(counter(&srv, "kvshard_failed_registrations_total"), 2.0);
    assert_eq!(status(&srv)["registered_gpu_ids"], serde_json::json!([]));
    // No layout was registered for the model: lookups miss early.
    let k = ed_key("lm", None, &ed_tokens(13, ED_CHUNK), 1, "q");
    assert_eq!(ed_lookup(&mut c, &k), 0);
    assert_eq!(
        srv.metric(
            "lmcache_mp_lookup_early_exit_requests_total",
            &[("reason", "no_gpu_context")]
        ),
        Some(1.0)
    );
    assert_serving(&mut srv);
}

#[test]
fn double_engine_driven_registration_is_idempotent() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let first = ed_register(&mut c, 5, "m");
    assert_eq!(first, (srv.shm_name.clone(), 64 << 20));
    assert_eq!(ed_register(&mut c, 5, "m"), first);
    let mut pool = ShmMap::open(&first.0, first.1);
    let toks = ed_tokens(15, 2 * ED_CHUNK);
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 2, "d"),
        5,
        15,
    );
    assert_eq!(stored.len(), 2);
    // A third registration while data is stored changes nothing.
    assert_eq!(ed_register(&mut c, 5, "m"), first);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, "d")), 2);
    assert_eq!(
        ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 2, "d"), 5),
        stored
    );
    assert_eq!(engine_ids(&srv), vec![5]);
    // One unregister removes it.
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(5)]), None);
    assert_eq!(engine_ids(&srv), Vec::<i64>::new());
    assert_serving(&mut srv);
}

#[test]
fn engine_driven_registration_with_bad_fields_is_refused_and_counted() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let base = engine_ctx_payload(40, "bad-model", 1, 2, 64, false, CS);
    let bads = [
        with_field(&base, "dtype_str", s("float17")),
        with_field(&base, "dtype_str", s("")),
        with_field(&base, "num_layers", V::I(0)),
        with_field(&base, "num_layers", V::I(-2)),
        with_field(&base, "hidden_dim_size", V::I(0)),
        with_field(&base, "num_physical_slots", V::I(0)),
        with_field(&base, "num_layers", V::I(1 << 40)), // object far too large
    ];
    for p in &bads {
        assert_eq!(
            c.call(OP_REGISTER_ENGINE, std::slice::from_ref(p)),
            None,
            "{p:?}"
        );
    }
    assert_eq!(
        counter(&srv, "kvshard_bad_requests_total"),
        bads.len() as f64
    );
    assert_eq!(engine_ids(&srv), Vec::<i64>::new());
    assert_nothing_reserved(
        c.call(
            OP_PREPARE_STORE,
            &[
                ed_key("bad-model", Some(0), &ed_tokens(16, ED_CHUNK), 1, "b"),
                V::I(40),
            ],
        ),
        "refused registration",
    );
    // The model has no layout: a lookup exits early.
    assert_eq!(
        ed_lookup(
            &mut c,
            &ed_key("bad-model", None, &ed_tokens(16, ED_CHUNK), 1, "b")
        ),
        0
    );
    assert_serving(&mut srv);
}

#[test]
fn conflicting_layouts_for_one_model_are_refused() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    // Same (model, world_size), twice the hidden size, then MLA.
    for (iid, p) in [
        (2, engine_ctx_payload(2, "m", 1, 2, 128, false, CS)),
        (3, engine_ctx_payload(3, "m", 1, 2, 64, true, CS)),
    ] {
        assert_eq!(
            c.call(OP_REGISTER_ENGINE, &[p]),
            None,
            "instance {iid} refused"
        );
        assert_nothing_reserved(
            c.call(
                OP_PREPARE_STORE,
                &[
                    ed_key("m", Some(0), &ed_tokens(17, ED_CHUNK), 1, "l"),
                    V::I(iid),
                ],
            ),
            "refused instance",
        );
    }
    assert_eq!(engine_ids(&srv), vec![1]);
    // The first registration is unaffected.
    let toks = ed_tokens(18, 2 * ED_CHUNK);
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 2, "l"),
        1,
        18,
    );
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, "l")), 2);
    assert_eq!(
        ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 2, "l"), 1),
        stored
    );
    // Once the last holder of the layout leaves, another layout may register.
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(1)]), None);
    let r = c.call(
        OP_REGISTER_ENGINE,
        &[engine_ctx_payload(2, "m", 1, 2, 128, false, CS)],
    );
    assert!(r.is_some(), "the model's layout is free again");
    assert_eq!(engine_ids(&srv), vec![2]);
    assert_serving(&mut srv);
}

#[test]
fn pickle_mode_commit_is_refused() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let _pool = worker(&mut c, 1);
    let toks = ed_tokens(19, 2 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 2, "p");
    let pickle = V::Bin(vec![0x80, 0x04, 0x95, 0x00, b'.']);
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(1), pickle.clone()]),
        Some(V::B(false))
    );
    let r = c.call(OP_PREPARE_STORE, &[wkey.clone(), V::I(1)]).unwrap();
    assert_eq!(ed_slots(&r).len(), 2);
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[wkey.clone(), V::I(1), pickle]),
        Some(V::B(false))
    );
    // Nothing became visible.
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, "p")), 0);
    assert_serving(&mut srv);
}

// ------------------------------------------------------------------ size and noise

#[test]
fn million_token_lookup_is_answered() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(20, 1_000_000);
    // Store the first 3 chunks with a key that carries only them.
    let head = ed_key("m", Some(0), &toks[..3 * ED_CHUNK], 3, "h");
    assert_eq!(ed_store(&mut c, &mut pool, &head, 1, 20).len(), 3);
    let t0 = Instant::now();
    let key = ipc_key("m", 1, None, &toks, 0, 1_000_000, "million", 1);
    assert_eq!(ed_lookup(&mut c, &key), 3, "prefix of a 62500-chunk lookup");
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(
        counter(&srv, "lmcache_mp_lookup_requested_tokens_total"),
        1_000_000.0
    );
    assert_eq!(c.call(OP_END_SESSION, &[s("million")]), None);
    assert_serving(&mut srv);
}

/// xorshift64*: a small seeded PRNG so a failing fuzz run can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn value(&mut self, depth: u32) -> V {
        match self.below(if depth >= 3 { 7 } else { 9 }) {
            0 => V::Nil,
            1 => V::B(self.below(2) == 1),
            2 => V::I(self.next() as i64 >> self.below(64)),
            3 => V::F(f64::from_bits(self.next())),
            4 => V::S(String::from_utf8_lossy(&self.bytes(12)).into_owned()),
            5 => V::Bin(self.bytes(12)),
            6 => s(
                ["model_name", "token_ids", "request_id", "m", "", "float16"]
                    [self.below(6) as usize],
            ),
            7 => {
                let n = self.below(5);
                V::A((0..n).map(|_| self.value(depth + 1)).collect())
            }
            _ => {
                let n = self.below(5);
                V::M(
                    (0..n)
                        .map(|_| (self.value(depth + 1), self.value(depth + 1)))
                        .collect(),
                )
            }
        }
    }
}

/// Legacy ids of the 0.5.6 table and a few names.
const FUZZ_OPS: [i64; 32] = [
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
    28, 29, 30, 31, 32, 33,
];

/// One fuzz message: `[uid, op?, payloads...]`, 1 to 6 frames.
fn fuzz_message(rng: &mut Rng, valid: &[Vec<Vec<u8>>]) -> Vec<Vec<u8>> {
    if rng.below(3) == 0 {
        // A valid request with one frame mutated, dropped, duplicated or replaced.
        let mut m = valid[rng.below(valid.len() as u64) as usize].clone();
        let i = 1 + rng.below(m.len() as u64 - 1) as usize;
        match rng.below(4) {
            0 if !m[i].is_empty() => {
                for _ in 0..1 + rng.below(3) {
                    let at = rng.below(m[i].len() as u64) as usize;
                    m[i][at] = rng.next() as u8;
                }
            }
            1 if i > 1 => {
                m.remove(i);
            }
            2 if m.len() < 6 => {
                let f = m[i].clone();
                m.push(f);
            }
            _ => {
                let at = rng.below(m[i].len() as u64 + 1) as usize;
                m[i].truncate(at);
            }
        }
        return m;
    }
    let n = 1 + rng.below(6) as usize;
    let mut frames = vec![match rng.below(3) {
        0 => rng.bytes(9),
        _ => enc(&V::I(rng.below(1 << 20) as i64)),
    }];
    if n >= 2 {
        frames.push(match rng.below(10) {
            0..=5 => enc(&V::I(FUZZ_OPS[rng.below(32) as usize])),
            6 => enc(&s([
                "lookup",
                "store",
                "subscribe_kv_events",
                "cb_reorder_plan",
                "frob",
            ][rng.below(5) as usize])),
            7 => vec![],
            _ => rng.bytes(6),
        });
    }
    while frames.len() < n {
        frames.push(match rng.below(3) {
            0 => rng.bytes(40),
            _ => enc(&rng.value(0)),
        });
    }
    frames
}

#[test]
fn random_frames_fuzz() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let _pool = worker(&mut c, 1);
    let toks = ed_tokens(21, 2 * ED_CHUNK);
    let wkey = ed_key("m", Some(0), &toks, 2, "fz");
    let skey = ed_key("m", None, &toks, 2, "fz");
    let uid = enc(&V::I(0));
    let valid: Vec<Vec<Vec<u8>>> = vec![
        vec![
            uid.clone(),
            enc(&V::I(OP_LOOKUP)),
            enc(&skey),
            enc(&V::I(1)),
        ],
        vec![
            uid.clone(),
            enc(&V::I(OP_PREPARE_STORE)),
            enc(&wkey),
            enc(&V::I(1)),
        ],
        vec![
            uid.clone(),
            enc(&V::I(OP_COMMIT_STORE)),
            enc(&wkey),
            enc(&V::I(1)),
            enc(&V::Bin(vec![])),
        ],
        vec![
            uid.clone(),
            enc(&V::I(OP_PREPARE_RETRIEVE)),
            enc(&wkey),
            enc(&V::I(1)),
        ],
        vec![
            uid.clone(),
            enc(&V::I(OP_STORE)),
            enc(&wkey),
            enc(&V::I(1)),
            enc(&V::A(vec![V::A(vec![V::I(1), V::I(2)])])),
            enc(&V::Bin(vec![])),
        ],
        vec![
            uid.clone(),
            enc(&V::I(OP_REGISTER_ENGINE)),
            enc(&engine_ctx_payload(2, "m", 1, 2, 64, false, CS)),
        ],
        vec![
            uid.clone(),
            enc(&V::I(OP_QUERY_PREFETCH_STATUS)),
            enc(&s("fz")),
        ],
        vec![
            uid,
            enc(&V::I(OP_REGISTER_KV_CACHE)),
            enc(&V::I(3)),
            enc(&V::A(vec![cpu_shm_wrapper(
                "/nope",
                64,
                "float16",
                &[2, 1, 16, 1, 1],
                &[16, 16, 1, 1, 1],
            )])),
        ],
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut answered = 0;
    for i in 0..2000 {
        let frames = fuzz_message(&mut rng, &valid);
        let expect_reply = frames.len() == 1 || !frames[1].is_empty();
        c.sock.send_multipart(frames.clone(), 0).unwrap();
        if !expect_reply {
            continue;
        }
        let reply = c
            .sock
            .recv_multipart(0)
            .unwrap_or_else(|e| panic!("message {i} ({frames:02x?}) got no answer: {e}"));
        assert_eq!(reply[0], frames[0], "message {i}: uid echoed");
        if frames.len() >= 2 {
            assert!(
                reply.len() == 2 || reply.len() == 3,
                "message {i}: {} reply frames",
                reply.len()
            );
            assert_eq!(reply[1], frames[1], "message {i}: op echoed");
        }
        answered += 1;
    }
    assert!(
        answered > 1500,
        "most fuzz messages name an op ({answered})"
    );
    assert!(silent_for(&c, 200), "no stray replies");
    assert!(counter(&srv, "kvshard_requests_total") >= 2000.0);
    assert_serving(&mut srv);
}

#[test]
fn bad_and_good_clients_interleaved() {
    let mut srv = Server::start(&["--cores", "0,1"]);
    let port = srv.port;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bad = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let c = Client::connect(port);
            let mut rng = Rng(42);
            let valid = vec![vec![enc(&V::I(0)), enc(&V::I(OP_NOOP))]];
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && sent < 20_000 {
                let frames = fuzz_message(&mut rng, &valid);
                let expect = frames.len() == 1 || !frames[1].is_empty();
                c.sock.send_multipart(frames, 0).unwrap();
                if expect {
                    c.sock
                        .recv_multipart(0)
                        .expect("the bad client is answered too");
                }
                sent += 1;
            }
            sent
        })
    };
    let mut good = srv.client();
    // An instance id the fuzz does not send: its random requests include
    // valid unregistrations of small ids, which another client may send.
    const IID: i64 = 0x2f3a_9b17;
    let (name, size) = ed_register(&mut good, IID, "m");
    let mut pool = ShmMap::open(&name, size);
    for round in 0..30u32 {
        let toks = ed_tokens(1000 + round, 3 * ED_CHUNK);
        let rid = format!("good-{round}");
        let stored = ed_store(
            &mut good,
            &mut pool,
            &ed_key("m", Some(0), &toks, 3, &rid),
            IID,
            round as u64,
        );
        assert_eq!(stored.len(), 3, "round {round}");
        assert_eq!(
            ed_lookup(&mut good, &ed_key("m", None, &toks, 3, &rid)),
            3,
            "round {round}"
        );
        let back = ed_retrieve(&mut good, &pool, &ed_key("m", Some(0), &toks, 3, &rid), IID);
        assert_eq!(back, stored, "round {round}");
        assert_eq!(good.call(OP_END_SESSION, &[s(&rid)]), None);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = bad.join().expect("bad client thread");
    assert!(sent > 0);
    assert_serving(&mut srv);
}

#[test]
fn a_client_that_never_reads_replies_does_not_stall_others() {
    let mut srv = Server::start(&[]);
    // The greedy client sends requests with 16 KiB op frames (echoed in every
    // reply) and never reads: its queues fill up.
    let ctx = zmq::Context::new();
    let greedy = ctx.socket(zmq::DEALER).unwrap();
    greedy.set_linger(0).unwrap();
    greedy.set_rcvhwm(1).unwrap();
    greedy.set_rcvbuf(4096).unwrap();
    greedy.set_sndtimeo(0).unwrap();
    greedy
        .connect(&format!("tcp://127.0.0.1:{}", srv.port))
        .unwrap();
    let op = enc(&s(&"x".repeat(16 << 10)));
    let t0 = Instant::now();
    let mut sent = 0;
    while sent < 6000 && t0.elapsed() < Duration::from_secs(5) {
        match greedy.send_multipart([enc(&V::I(sent)), op.clone()], zmq::DONTWAIT) {
            Ok(()) => sent += 1,
            Err(zmq::Error::EAGAIN) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("greedy send: {e}"),
        }
    }
    // Whatever the greedy client left queued, others are still served promptly.
    let mut c = srv.client();
    c.sock.set_rcvtimeo(5_000).unwrap();
    for _ in 0..20 {
        c.noop_ok();
    }
    // The greedy client's surplus replies were dropped (and counted), not queued
    // without bound or waited for.
    wait_until_within(
        "a reply to the greedy client to be dropped",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || counter(&srv, "kvshard_reply_failures_total") > 0.0,
    );
    assert_serving(&mut srv);
    drop(greedy);
}

/// Peak resident memory of the server process (VmHWM), in bytes.
fn peak_rss_bytes(srv: &Server) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{}/status", srv.child.id())).unwrap();
    let kb: u64 = st
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kb << 10
}

#[test]
fn wide_lookup_memory_is_bounded() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    // Any client may register a layout of world size 255.
    let p = engine_ctx_payload(77, "w", 255, 2, 64, false, CS);
    assert!(c.call(OP_REGISTER_ENGINE, &[p]).is_some());
    let before = peak_rss_bytes(&srv);
    let toks = ed_tokens(99, 1_000_000);
    let key = ipc_key("w", 255, None, &toks, 0, 1_000_000, "wide", 1);
    c.sock.set_rcvtimeo(120_000).unwrap();
    assert_eq!(c.call(OP_LOOKUP, &[key, V::I(1)]), None);
    let t0 = Instant::now();
    while c.call(OP_QUERY_PREFETCH_STATUS, &[s("wide")]).is_none() {
        assert!(t0.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(10));
    }
    let grown = peak_rss_bytes(&srv).saturating_sub(before);
    assert!(
        grown < 512 << 20,
        "one 3 MB lookup grew the server by {} MiB",
        grown >> 20
    );
    assert_serving(&mut srv);
}
