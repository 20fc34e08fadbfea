//! The client's own msgpack encoder and decoder, the request payloads it
//! builds (keys, registrations, key frames) and the DEALER client itself.

use super::*;
use kvshard_transport::wire::Op;

// ------------------------------------------------------------------ msgpack

/// A msgpack value for building requests and reading replies.
#[derive(Debug, Clone, PartialEq)]
pub enum V {
    Nil,
    B(bool),
    I(i64),
    F(f64),
    S(String),
    Bin(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
    Ext(i8, Vec<u8>),
}

pub fn s(x: &str) -> V {
    V::S(x.to_owned())
}

pub fn map(pairs: &[(&str, V)]) -> V {
    V::M(pairs.iter().map(|(k, v)| (s(k), v.clone())).collect())
}

impl V {
    pub fn get(&self, key: &str) -> Option<&V> {
        match self {
            V::M(m) => m
                .iter()
                .find(|(k, _)| *k == V::S(key.to_owned()))
                .map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn int(&self) -> i64 {
        match self {
            V::I(i) => *i,
            other => panic!("expected int, got {other:?}"),
        }
    }
    pub fn str(&self) -> &str {
        match self {
            V::S(s) => s,
            other => panic!("expected str, got {other:?}"),
        }
    }
    pub fn arr(&self) -> &[V] {
        match self {
            V::A(a) => a,
            other => panic!("expected array, got {other:?}"),
        }
    }
    pub fn boolean(&self) -> bool {
        match self {
            V::B(b) => *b,
            other => panic!("expected bool, got {other:?}"),
        }
    }
}

pub fn enc(v: &V) -> Vec<u8> {
    let mut o = Vec::new();
    enc_into(v, &mut o);
    o
}

fn enc_len(o: &mut Vec<u8>, n: usize, fix: Option<(u8, usize)>, m8: Option<u8>, m16: u8, m32: u8) {
    match (fix, m8) {
        (Some((base, max)), _) if n <= max => o.push(base | n as u8),
        (_, Some(c)) if n <= 0xff => o.extend([c, n as u8]),
        _ if n <= 0xffff => {
            o.push(m16);
            o.extend((n as u16).to_be_bytes());
        }
        _ => {
            o.push(m32);
            o.extend((n as u32).to_be_bytes());
        }
    }
}

fn enc_into(v: &V, o: &mut Vec<u8>) {
    match v {
        V::Nil => o.push(0xc0),
        V::B(b) => o.push(if *b { 0xc3 } else { 0xc2 }),
        V::I(i) => {
            let i = *i;
            if (0..=127).contains(&i) {
                o.push(i as u8)
            } else if (-32..0).contains(&i) {
                o.push(i as i8 as u8)
            } else if (0..=0xff).contains(&i) {
                o.extend([0xcc, i as u8])
            } else if (0..=0xffff).contains(&i) {
                o.push(0xcd);
                o.extend((i as u16).to_be_bytes())
            } else if (0..=0xffff_ffff).contains(&i) {
                o.push(0xce);
                o.extend((i as u32).to_be_bytes())
            } else if i > 0 {
                o.push(0xcf);
                o.extend((i as u64).to_be_bytes())
            } else {
                o.push(0xd3);
                o.extend(i.to_be_bytes())
            }
        }
        V::F(f) => {
            o.push(0xcb);
            o.extend(f.to_be_bytes())
        }
        V::S(st) => {
            enc_len(o, st.len(), Some((0xa0, 31)), Some(0xd9), 0xda, 0xdb);
            o.extend(st.as_bytes())
        }
        V::Bin(b) => {
            enc_len(o, b.len(), None, Some(0xc4), 0xc5, 0xc6);
            o.extend(b)
        }
        V::A(a) => {
            enc_len(o, a.len(), Some((0x90, 15)), None, 0xdc, 0xdd);
            for x in a {
                enc_into(x, o)
            }
        }
        V::M(m) => {
            enc_len(o, m.len(), Some((0x80, 15)), None, 0xde, 0xdf);
            for (k, x) in m {
                enc_into(k, o);
                enc_into(x, o)
            }
        }
        V::Ext(t, d) => {
            if d.len() < 256 {
                o.push(0xc7);
                o.push(d.len() as u8);
            } else {
                o.push(0xc8);
                o.extend(u16::try_from(d.len()).expect("ext16 length").to_be_bytes());
            }
            o.push(*t as u8);
            o.extend(d)
        }
    }
}

pub fn dec(b: &[u8]) -> V {
    let mut p = 0;
    let v = dec_at(b, &mut p);
    assert_eq!(p, b.len(), "trailing bytes in reply frame");
    v
}

fn take<'a>(b: &'a [u8], p: &mut usize, n: usize) -> &'a [u8] {
    let s = &b[*p..*p + n];
    *p += n;
    s
}

fn be(b: &[u8]) -> u64 {
    b.iter().fold(0u64, |a, x| (a << 8) | *x as u64)
}

fn dec_at(b: &[u8], p: &mut usize) -> V {
    let c = b[*p];
    *p += 1;
    let str_of = |d: &[u8]| V::S(String::from_utf8(d.to_vec()).expect("utf8"));
    match c {
        0x00..=0x7f => V::I(c as i64),
        0x80..=0x8f => dec_map(b, p, (c & 0x0f) as usize),
        0x90..=0x9f => dec_arr(b, p, (c & 0x0f) as usize),
        0xa0..=0xbf => str_of(take(b, p, (c & 0x1f) as usize)),
        0xc0 => V::Nil,
        0xc2 => V::B(false),
        0xc3 => V::B(true),
        0xc4 => {
            let n = be(take(b, p, 1)) as usize;
            V::Bin(take(b, p, n).to_vec())
        }
        0xc5 => {
            let n = be(take(b, p, 2)) as usize;
            V::Bin(take(b, p, n).to_vec())
        }
        0xcb => V::F(f64::from_bits(be(take(b, p, 8)))),
        0xcc => V::I(be(take(b, p, 1)) as i64),
        0xcd => V::I(be(take(b, p, 2)) as i64),
        0xce => V::I(be(take(b, p, 4)) as i64),
        0xcf => V::I(be(take(b, p, 8)) as i64),
        0xd0 => V::I(take(b, p, 1)[0] as i8 as i64),
        0xd1 => V::I(be(take(b, p, 2)) as u16 as i16 as i64),
        0xd2 => V::I(be(take(b, p, 4)) as u32 as i32 as i64),
        0xd3 => V::I(be(take(b, p, 8)) as i64),
        0xd9 => {
            let n = be(take(b, p, 1)) as usize;
            str_of(take(b, p, n))
        }
        0xda => {
            let n = be(take(b, p, 2)) as usize;
            str_of(take(b, p, n))
        }
        0xdc => {
            let n = be(take(b, p, 2)) as usize;
            dec_arr(b, p, n)
        }
        0xdd => {
            let n = be(take(b, p, 4)) as usize;
            dec_arr(b, p, n)
        }
        0xde => {
            let n = be(take(b, p, 2)) as usize;
            dec_map(b, p, n)
        }
        0xe0..=0xff => V::I(c as i8 as i64),
        other => panic!("test decoder: unsupported msgpack byte {other:#x}"),
    }
}

fn dec_arr(b: &[u8], p: &mut usize, n: usize) -> V {
    V::A((0..n).map(|_| dec_at(b, p)).collect())
}

fn dec_map(b: &[u8], p: &mut usize, n: usize) -> V {
    V::M((0..n).map(|_| (dec_at(b, p), dec_at(b, p))).collect())
}

// ------------------------------------------------------------- wire helpers

/// IPCCacheServerKey as the 0.5.6 client encodes it (a map in field order).
#[allow(clippy::too_many_arguments)]
pub fn ipc_key(
    model: &str,
    ws: i64,
    worker: Option<i64>,
    tokens: &[u32],
    start: i64,
    end: i64,
    rid: &str,
    readers: i64,
) -> V {
    map(&[
        ("model_name", s(model)),
        ("world_size", V::I(ws)),
        ("worker_id", worker.map_or(V::Nil, V::I)),
        (
            "token_ids",
            V::A(tokens.iter().map(|t| V::I(*t as i64)).collect()),
        ),
        ("start", V::I(start)),
        ("end", V::I(end)),
        ("request_id", s(rid)),
        ("cache_salt", s("")),
        ("request_configs", V::Nil),
        ("num_kv_readers", V::I(readers)),
    ])
}

pub fn engine_ctx_payload(
    iid: i64,
    model: &str,
    ws: i64,
    layers: i64,
    hidden: i64,
    mla: bool,
    slots: i64,
) -> V {
    map(&[
        ("instance_id", V::I(iid)),
        ("model_name", s(model)),
        ("world_size", V::I(ws)),
        ("block_size", V::I(16)),
        ("num_layers", V::I(layers)),
        ("hidden_dim_size", V::I(hidden)),
        ("dtype_str", s("float16")),
        ("use_mla", V::B(mla)),
        ("num_physical_slots", V::I(slots)),
    ])
}

/// A `CpuShmIPCData` wrapped in msgpack ext 1, keys in msgspec's order.
pub fn cpu_shm_wrapper(
    shm_name: &str,
    nbytes: i64,
    dtype: &str,
    shape: &[i64],
    stride: &[i64],
) -> V {
    let inner = map(&[
        ("type", s("cpu_shm")),
        ("shm_name", s(shm_name)),
        ("nbytes", V::I(nbytes)),
        ("version", V::I(1)),
        (
            "metadata",
            map(&[
                ("dtype", s(dtype)),
                ("shape", V::A(shape.iter().map(|x| V::I(*x)).collect())),
                ("stride", V::A(stride.iter().map(|x| V::I(*x)).collect())),
                ("storage_offset", V::I(0)),
                ("device_uuid", s("cpu")),
            ]),
        ),
    ]);
    V::Ext(1, enc(&inner))
}

/// One `EngineGroupInfo` of a plain full-attention model: layers
/// `0..layers`, `tokens_per_block` tokens per block, engine group 0.
pub fn kv_group(layers: usize, tokens_per_block: usize) -> V {
    let all: Vec<i64> = (0..layers as i64).collect();
    kv_group_of(0, &all, tokens_per_block)
}

/// A full-attention `EngineGroupInfo` of engine group `engine_group_id` over
/// registered tensors `layers`.
pub fn kv_group_of(engine_group_id: i64, layers: &[i64], tokens_per_block: usize) -> V {
    kv_group_windowed(engine_group_id, layers, tokens_per_block, -1)
}

/// [`kv_group_of`] of sliding-window layers: `sw_size_tokens` (-1: full
/// attention).
pub fn kv_group_windowed(
    engine_group_id: i64,
    layers: &[i64],
    tokens_per_block: usize,
    sw_size_tokens: i64,
) -> V {
    map(&[
        ("engine_group_id", V::I(engine_group_id)),
        (
            "layer_indices",
            V::A(layers.iter().map(|&l| V::I(l)).collect()),
        ),
        ("tokens_per_block", V::I(tokens_per_block as i64)),
        ("sw_size_tokens", V::I(sw_size_tokens)),
        ("extra_object_group_tag", V::I(0)),
        ("recurrent_state", V::B(false)),
    ])
}

// ------------------------------------------------------------------ client

pub struct Client {
    pub sock: zmq::Socket,
    _ctx: zmq::Context,
    uid: i64,
}

/// A reply: the echoed op frame and the payload, if any.
#[derive(Debug)]
pub struct Reply {
    pub op: Vec<u8>,
    pub payload: Option<V>,
}

impl Client {
    pub fn connect(port: u16) -> Client {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER).unwrap();
        sock.set_linger(0).unwrap();
        sock.set_rcvtimeo(10_000).unwrap();
        sock.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        Client {
            sock,
            _ctx: ctx,
            uid: 0,
        }
    }

    /// Sends raw frames after the uid; returns the uid used.
    pub fn send_raw(&mut self, frames: Vec<Vec<u8>>) -> i64 {
        let uid = self.uid;
        self.uid += 1;
        let mut all = vec![enc(&V::I(uid))];
        all.extend(frames);
        self.sock.send_multipart(all, 0).unwrap();
        uid
    }

    pub fn recv(&mut self, uid: i64) -> Reply {
        let frames = self
            .sock
            .recv_multipart(0)
            .expect("reply within 10 s (the server must always answer)");
        assert!(
            frames.len() == 2 || frames.len() == 3,
            "reply has {} frames",
            frames.len()
        );
        assert_eq!(dec(&frames[0]), V::I(uid), "uid echoed");
        Reply {
            op: frames[1].clone(),
            payload: frames.get(2).map(|f| dec(f)),
        }
    }

    /// Calls `op` (legacy int id) with msgpack payload frames.
    pub fn call(&mut self, op: i64, args: &[V]) -> Option<V> {
        let mut frames = vec![enc(&V::I(op))];
        frames.extend(args.iter().map(enc));
        let uid = self.send_raw(frames);
        let r = self.recv(uid);
        assert_eq!(dec(&r.op), V::I(op), "op echoed");
        r.payload
    }

    pub fn noop_ok(&mut self) {
        assert_eq!(self.call(OP_NOOP, &[]), Some(s("OK")));
    }

    /// Polls query_prefetch_status until it answers an int.
    pub fn prefetch_result(&mut self, rid: &str) -> i64 {
        let t0 = Instant::now();
        loop {
            if let Some(v) = self.call(OP_QUERY_PREFETCH_STATUS, &[s(rid)]) {
                return v.int();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "prefetch never finished"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

// The op numbers, from the wire's table of lmcache 0.5.6's operations (the
// golden frames of 0.5.6 check it); everything else here is independent.
pub const OP_REGISTER_KV_CACHE: i64 = Op::RegisterKvCache.id();
pub const OP_UNREGISTER_KV_CACHE: i64 = Op::UnregisterKvCache.id();
pub const OP_STORE: i64 = Op::Store.id();
pub const OP_RETRIEVE: i64 = Op::Retrieve.id();
pub const OP_LOOKUP: i64 = Op::Lookup.id();
pub const OP_QUERY_PREFETCH_STATUS: i64 = Op::QueryPrefetchStatus.id();
pub const OP_WAIT_PREFETCH_STATUS: i64 = Op::WaitPrefetchStatus.id();
pub const OP_FREE_LOOKUP_LOCKS: i64 = Op::FreeLookupLocks.id();
pub const OP_END_SESSION: i64 = Op::EndSession.id();
pub const OP_REGISTER_ENGINE: i64 = Op::RegisterKvCacheEngineDrivenContext.id();
pub const OP_UNREGISTER_ENGINE: i64 = Op::UnregisterKvCacheEngineDrivenContext.id();
pub const OP_PREPARE_STORE: i64 = Op::PrepareStore.id();
pub const OP_COMMIT_STORE: i64 = Op::CommitStore.id();
pub const OP_PREPARE_RETRIEVE: i64 = Op::PrepareRetrieve.id();
pub const OP_COMMIT_RETRIEVE: i64 = Op::CommitRetrieve.id();
pub const OP_CLEAR: i64 = Op::Clear.id();
pub const OP_GET_CHUNK_SIZE: i64 = Op::GetChunkSize.id();
pub const OP_PING: i64 = Op::Ping.id();
pub const OP_NOOP: i64 = Op::Noop.id();
pub const OP_GET_EXPERIMENTAL: i64 = Op::GetExperimental.id();

pub fn put_uint(o: &mut Vec<u8>, x: u64) {
    match x {
        0..=0x7f => o.push(x as u8),
        0x80..=0xff => o.extend([0xcc, x as u8]),
        0x100..=0xffff => {
            o.push(0xcd);
            o.extend((x as u16).to_be_bytes())
        }
        0x1_0000..=0xffff_ffff => {
            o.push(0xce);
            o.extend((x as u32).to_be_bytes())
        }
        _ => {
            o.push(0xcf);
            o.extend(x.to_be_bytes())
        }
    }
}

pub fn uint_len(x: u32) -> usize {
    match x {
        0..=0x7f => 1,
        0x80..=0xff => 2,
        0x100..=0xffff => 3,
        _ => 5,
    }
}

/// The msgpack array of a token list.
pub fn enc_tokens(toks: &[u32]) -> Vec<u8> {
    let mut o = Vec::with_capacity(toks.len() * 5 + 5);
    enc_len(&mut o, toks.len(), Some((0x90, 15)), None, 0xdc, 0xdd);
    for t in toks {
        put_uint(&mut o, *t as u64);
    }
    o
}

/// The msgpack frame of [`ipc_key`]`(model, 1, worker, toks, 0, end, rid, 1)`,
/// written without building a [`V`] per token (load generators send millions).
pub fn key_frame(model: &str, worker: Option<i64>, toks: &[u32], end: i64, rid: &str) -> Vec<u8> {
    key_frame_enc(model, worker, &enc_tokens(toks), end, rid)
}

/// [`key_frame`] with the token list already encoded ([`enc_tokens`]).
pub fn key_frame_enc(
    model: &str,
    worker: Option<i64>,
    toks_enc: &[u8],
    end: i64,
    rid: &str,
) -> Vec<u8> {
    fn field(o: &mut Vec<u8>, name: &str, v: V) {
        enc_into(&s(name), o);
        enc_into(&v, o);
    }
    let mut o = Vec::with_capacity(toks_enc.len() + 200);
    o.push(0x8a);
    field(&mut o, "model_name", s(model));
    field(&mut o, "world_size", V::I(1));
    field(&mut o, "worker_id", worker.map_or(V::Nil, V::I));
    enc_into(&s("token_ids"), &mut o);
    o.extend_from_slice(toks_enc);
    field(&mut o, "start", V::I(0));
    field(&mut o, "end", V::I(end));
    field(&mut o, "request_id", s(rid));
    field(&mut o, "cache_salt", s(""));
    field(&mut o, "request_configs", V::Nil);
    field(&mut o, "num_kv_readers", V::I(1));
    o
}

impl Client {
    /// Sends every request (frames after the uid) at once, then takes the
    /// replies in whatever order they come; returns each request's payload.
    pub fn batch(&mut self, reqs: Vec<Vec<Vec<u8>>>) -> Vec<Option<V>> {
        let n = reqs.len();
        let ops: Vec<Vec<u8>> = reqs.iter().map(|r| r[0].clone()).collect();
        let first = self.uid;
        for r in reqs {
            self.send_raw(r);
        }
        let mut out: Vec<Option<Option<V>>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let frames = self
                .sock
                .recv_multipart(0)
                .expect("reply within the receive timeout (the server must always answer)");
            assert!(
                frames.len() == 2 || frames.len() == 3,
                "reply has {} frames",
                frames.len()
            );
            let i = (dec(&frames[0]).int() - first) as usize;
            assert!(
                i < n && out[i].is_none(),
                "reply uid {} unexpected",
                i as i64 + first
            );
            assert_eq!(frames[1], ops[i], "op echoed");
            out[i] = Some(frames.get(2).map(|f| dec(f)));
        }
        out.into_iter().map(|x| x.unwrap()).collect()
    }
}
