//! End to end: the real binary driven through the lmcache_driven `cpu_shm` flow,
//! as `lmcache bench server --mode cpu --transfer-mode lmcache_driven` drives it.
//! The test plays the CPU worker: it shares paged per-layer KV tensors through
//! POSIX shm, registers them, and names the blocks STORE gathers from and
//! RETRIEVE scatters into. Every expectation is computed here from the vLLM
//! paged layout and the 0.5.6 object format, never with the server's code.

mod support;
use support::*;

const CS: usize = 16; // --chunk-size in Server::start
const BS: usize = 4; // tokens per paged block, so one chunk spans several blocks
const BPC: usize = CS / BS;
const NB: usize = 64; // blocks per layer
const NL: usize = 4; // layers
const NH: usize = 2; // KV heads
const HS: usize = 8; // head size
const MLA_DIM: usize = 32; // MLA latent width
const ES: usize = 2; // float16
const MODEL: &str = "lmc-model";
const EVENT: &[u8] = b"stub_ipc_handle";

/// A layer of this file's sizes, in each layout the workers register.
type Kind = PagedKv;
const NHD: Kind = PagedKv {
    layout: Layout::Nhd,
    blocks: NB,
    block_tokens: BS,
    heads: NH,
    head_size: HS,
    mla_dim: MLA_DIM,
    elem: ES,
};
const HND: Kind = NHD.with(Layout::Hnd);
const MLA: Kind = NHD.with(Layout::Mla);

/// A CPU worker: one shm segment per layer, filled with a known pattern.
struct Worker {
    iid: i64,
    kind: Kind,
    names: Vec<String>,
    segs: Vec<ShmMap>,
}

impl Worker {
    fn new(iid: i64, kind: Kind, seed: u64) -> Worker {
        let len = kind.layer_bytes();
        let mut names = Vec::new();
        let mut segs = Vec::new();
        for l in 0..NL {
            let name = unique("lmckv");
            let mut seg = ShmMap::create(&name, len);
            seg.bytes_mut()
                .copy_from_slice(&pattern(seed * 1000 + l as u64, len));
            names.push(name);
            segs.push(seg);
        }
        Worker {
            iid,
            kind,
            names,
            segs,
        }
    }

    /// REGISTER_KV_CACHE frames in the 0.5.6 order.
    fn register_args(&self, ws: i64) -> Vec<V> {
        let (shape, stride) = self.kind.shape_stride();
        let wrappers = self
            .names
            .iter()
            .map(|n| {
                cpu_shm_wrapper(
                    &format!("/{n}"),
                    self.kind.layer_bytes() as i64,
                    "float16",
                    &shape,
                    &stride,
                )
            })
            .collect();
        let group = kv_group(NL, BS);
        vec![
            V::I(self.iid),
            V::A(wrappers),
            s(MODEL),
            V::I(ws),
            s("vllm"),
            map(&[("kv_layout", s(self.kind.hint()))]),
            V::A(vec![group]),
        ]
    }

    fn register(&self, srv: &Server, c: &mut Client, ws: i64) {
        assert_eq!(
            c.call(OP_REGISTER_KV_CACHE, &self.register_args(ws)),
            None,
            "register_kv_cache answers no payload"
        );
        // The reply is the same whether the registration took: /status tells.
        assert!(
            registered_gpu_ids(srv).contains(&self.iid),
            "instance {} registered",
            self.iid
        );
    }

    fn snapshot(&self) -> Vec<Vec<u8>> {
        self.segs.iter().map(|m| m.bytes().to_vec()).collect()
    }

    /// Overwrites every layer and plane of `ids` with `byte`.
    fn fill_blocks(&mut self, ids: &[i64], byte: u8) {
        let kind = self.kind;
        for seg in &mut self.segs {
            for plane in 0..kind.planes() {
                for &id in ids {
                    seg.bytes_mut()[kind.block_range(plane, id as usize)].fill(byte);
                }
            }
        }
    }
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 50_000)
        .collect()
}

fn key(
    ws: i64,
    worker: Option<i64>,
    toks: &[u32],
    range: (usize, usize),
    rid: &str,
    readers: i64,
) -> V {
    ipc_key(
        MODEL,
        ws,
        worker,
        toks,
        range.0 as i64,
        range.1 as i64,
        rid,
        readers,
    )
}

fn ids(v: &[i64]) -> V {
    V::A(v.iter().map(|x| V::I(*x)).collect())
}

/// The `(event_handle, ok)` tuple STORE and RETRIEVE answer.
fn outcome(reply: Option<V>) -> bool {
    match reply {
        Some(V::A(a)) if a.len() == 2 => {
            let ok = a[1].boolean();
            assert!(matches!(a[0], V::Bin(_)), "event handle is bytes: {a:?}");
            if !ok {
                assert_eq!(a[0], V::Bin(vec![]), "a failure carries no event");
            }
            ok
        }
        other => panic!("expected (bytes, bool), got {other:?}"),
    }
}

fn store(c: &mut Client, iid: i64, key: V, blocks: &[i64]) -> bool {
    outcome(c.call(
        OP_STORE,
        &[
            key,
            V::I(iid),
            V::A(vec![ids(blocks)]),
            V::Bin(EVENT.to_vec()),
        ],
    ))
}

fn retrieve(c: &mut Client, iid: i64, key: V, blocks: &[i64], skip: usize) -> bool {
    outcome(c.call(
        OP_RETRIEVE,
        &[
            key,
            V::I(iid),
            V::A(vec![ids(blocks)]),
            V::Bin(EVENT.to_vec()),
            V::I(skip as i64),
        ],
    ))
}

/// Scheduler lookup of `[0, end)` over every rank; returns the hit chunks.
fn lookup(c: &mut Client, ws: i64, toks: &[u32], end: usize, rid: &str, readers: i64) -> i64 {
    assert_eq!(
        c.call(
            OP_LOOKUP,
            &[key(ws, None, toks, (0, end), rid, readers), V::I(1)]
        ),
        None,
        "lookup ack has no payload"
    );
    c.prefetch_result(rid)
}

/// What the worker's cache must hold after a retrieve: `before`, with block
/// `dst[i]` replaced by the stored block `src[i]` for every list position
/// from `skip_blocks` on.
fn scattered(
    kind: Kind,
    before: &[Vec<u8>],
    stored: &[Vec<u8>],
    src: &[i64],
    dst: &[i64],
    skip_blocks: usize,
) -> Vec<Vec<u8>> {
    let mut out = before.to_vec();
    for (layer, image) in out.iter_mut().enumerate() {
        for (&s, &d) in src.iter().zip(dst).skip(skip_blocks) {
            for plane in 0..kind.planes() {
                let from = kind.block_range(plane, s as usize);
                image[kind.block_range(plane, d as usize)].copy_from_slice(&stored[layer][from]);
            }
        }
    }
    out
}

fn assert_cache_eq(kind: Kind, actual: &[Vec<u8>], expected: &[Vec<u8>], what: &str) {
    for (layer, (a, e)) in actual.iter().zip(expected).enumerate() {
        if let Some(at) = a.iter().zip(e).position(|(x, y)| x != y) {
            let b = at / kind.block();
            panic!(
                "{what}: layer {layer} differs first at byte {at} (plane {}, block {})",
                b / NB,
                b % NB
            );
        }
    }
}

/// The 0.5.6 object of one chunk: `[plane][layer][token][row]` where token
/// `t` lives in block `blocks[t / BS]`, slot `t % BS`.
fn expected_object(kind: Kind, cache: &[Vec<u8>], blocks: &[i64]) -> Vec<u8> {
    let mut out = Vec::new();
    for plane in 0..kind.planes() {
        for layer in cache {
            for t in 0..CS {
                out.extend(kind.token_row(layer, plane, blocks[t / BS] as usize, t % BS));
            }
        }
    }
    out
}

// ------------------------------------------------------------------ MD5

/// RFC 1321 MD5, to check `/cache/checksums` digests independently.
fn md5_hex(data: &[u8]) -> String {
    const SHIFT: [u32; 16] = [7, 12, 17, 22, 5, 9, 14, 20, 4, 11, 16, 23, 6, 10, 15, 21];
    let k: Vec<u32> = (0..64)
        .map(|i| ((i as f64 + 1.0).sin().abs() * 4_294_967_296.0) as u32)
        .collect();
    let mut h: [u32; 4] = [0x6745_2301, 0xefcd_ab89, 0x98ba_dcfe, 0x1032_5476];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend((data.len() as u64).wrapping_mul(8).to_le_bytes());
    for block in msg.chunks_exact(64) {
        let m: Vec<u32> = block
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        let [mut a, mut b, mut c, mut d] = h;
        for i in 0..64 {
            let (f, g) = match i / 16 {
                0 => ((b & c) | (!b & d), i),
                1 => ((d & b) | (!d & c), (5 * i + 1) % 16),
                2 => (b ^ c ^ d, (3 * i + 5) % 16),
                _ => (c ^ (b | !d), (7 * i) % 16),
            };
            let f = f.wrapping_add(a).wrapping_add(k[i]).wrapping_add(m[g]);
            a = d;
            d = c;
            c = b;
            b = b.wrapping_add(f.rotate_left(SHIFT[(i / 16) * 4 + i % 4]));
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d]) {
            *x = x.wrapping_add(y);
        }
    }
    h.iter()
        .flat_map(|x| x.to_le_bytes())
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn md5_reference_vectors() {
    assert_eq!(md5_hex(b""), "d41d8cd98f00b204e9800998ecf8427e");
    assert_eq!(md5_hex(b"abc"), "900150983cd24fb0d6963f7d28e17f72");
    assert_eq!(
        md5_hex(
            b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"
        ),
        "57edf4a22be3c955ac49da2e2107b67a"
    );
}

/// 0.5.6's aggregated digest of one chunk of blocks: per layer in order,
/// `layer.index_select(1, ids)` of the `[2, NB, BS, NH, HS]` tensor in C order.
fn expected_digest(cache: &[Vec<u8>], blocks: &[i64], layers: std::ops::Range<usize>) -> String {
    let kind = NHD;
    let mut bytes = Vec::new();
    for layer in &cache[layers] {
        for plane in 0..kind.planes() {
            for &b in blocks {
                bytes.extend_from_slice(&layer[kind.block_range(plane, b as usize)]);
            }
        }
    }
    md5_hex(&bytes)
}

fn checksums(srv: &Server, iid: i64, blocks: &[i64], layerwise: bool) -> serde_json::Value {
    srv.checksums(iid, blocks, BPC, layerwise)
}

fn digests(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .expect("digest list")
        .iter()
        .map(|d| d.as_str().unwrap().to_owned())
        .collect()
}

// ------------------------------------------------------------------ tests

/// A non-contiguous source block table and a disjoint destination table.
const SRC: [i64; 12] = [5, 9, 10, 11, 40, 3, 22, 23, 63, 1, 2, 30];
const DST: [i64; 12] = [12, 13, 14, 15, 50, 51, 7, 8, 33, 34, 35, 36];

#[test]
fn store_then_retrieve_into_another_block_table() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut w = Worker::new(100, NHD, 1);
    w.register(&srv, &mut c, 1);
    // A trailing partial chunk is never part of a key range.
    let toks = tokens(1, 3 * CS + 5);
    let stored = w.snapshot();

    // Two stores; each block list starts at its key's start.
    let k1 = key(1, Some(0), &toks, (0, 2 * CS), "s", 1);
    assert!(store(&mut c, 100, k1, &SRC[..2 * BPC]));
    let k2 = key(1, Some(0), &toks, (2 * CS, 3 * CS), "s", 1);
    assert!(store(&mut c, 100, k2, &SRC[2 * BPC..]));
    // Storing chunks that are already resident succeeds and keeps the first copy.
    let again = key(1, Some(0), &toks, (0, 3 * CS), "s", 1);
    assert!(store(&mut c, 100, again, &DST));
    assert_eq!(c.call(OP_END_SESSION, &[s("s")]), None);

    // The worker reuses the source blocks for something else.
    w.fill_blocks(&SRC, 0);
    let before = w.snapshot();
    assert_eq!(
        lookup(&mut c, 1, &toks, 3 * CS, "r", 1),
        3,
        "every chunk hits"
    );
    let rk = key(1, Some(0), &toks, (0, 3 * CS), "r", 1);
    assert!(retrieve(&mut c, 100, rk.clone(), &DST, 0));
    let expected = scattered(NHD, &before, &stored, &SRC, &DST, 0);
    assert_cache_eq(NHD, &w.snapshot(), &expected, "after retrieve");

    // The retrieve consumed the lookup's only read lock.
    w.fill_blocks(&DST, 0x5a);
    let before = w.snapshot();
    assert!(!retrieve(&mut c, 100, rk, &DST, 0));
    assert_cache_eq(NHD, &w.snapshot(), &before, "failed retrieve");

    // A prefix of the stored range: lookup and retrieve of the first chunks only.
    assert_eq!(lookup(&mut c, 1, &toks, 2 * CS, "p", 1), 2);
    let pk = key(1, Some(0), &toks, (0, 2 * CS), "p", 1);
    assert!(retrieve(&mut c, 100, pk, &DST[..2 * BPC], 0));
    let expected = scattered(NHD, &before, &stored, &SRC, &DST[..2 * BPC], 0);
    assert_cache_eq(NHD, &w.snapshot(), &expected, "prefix retrieve");

    // A retrieve from a later start: its block list and skip_first_n_tokens
    // count from key.start; the locks it does not use are freed by the scheduler.
    w.fill_blocks(&DST, 0x77);
    let before = w.snapshot();
    assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "o", 1), 3);
    let ok = key(1, Some(0), &toks, (CS, 3 * CS), "o", 1);
    assert!(retrieve(&mut c, 100, ok, &DST[BPC..], BS + 1));
    let expected = scattered(NHD, &before, &stored, &SRC[BPC..], &DST[BPC..], 1);
    assert_cache_eq(NHD, &w.snapshot(), &expected, "retrieve from chunk 1");
    let free = key(1, None, &toks, (0, CS), "o", 1);
    assert_eq!(c.call(OP_FREE_LOOKUP_LOCKS, &[free, V::I(1)]), None);
    assert_eq!(c.call(OP_END_SESSION, &[s("o")]), None);
    let (st, body) = srv.http("GET", "/status", None);
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["storage_manager"]["l1_manager"]["read_locked_count"], 0,
        "every lookup lock was used or freed"
    );
}

#[test]
fn objects_have_the_0_5_6_byte_layout() {
    // An engine_driven reader of the same model sees the object bytes that
    // lmcache_driven stored: they must be [plane][layer][token][heads x elems].
    for kind in [NHD, HND, MLA] {
        let srv = Server::start(&[]);
        let mut c = srv.client();
        let w = Worker::new(1, kind, 7);
        w.register(&srv, &mut c, 1);
        let toks = tokens(9, 3 * CS);
        let cache = w.snapshot();
        assert!(store(
            &mut c,
            1,
            key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
            &SRC
        ));

        let hidden = if kind == MLA { MLA_DIM } else { NH * HS };
        let payload = engine_ctx_payload(
            500,
            MODEL,
            1,
            NL as i64,
            hidden as i64,
            kind == MLA,
            CS as i64,
        );
        let r = c
            .call(OP_REGISTER_ENGINE, &[payload])
            .unwrap_or_else(|| panic!("{kind:?}: engine_driven reader registered"));
        let pool = ShmMap::open(
            r.get("shm_name").unwrap().str(),
            r.get("pool_size").unwrap().int() as usize,
        );

        assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "r", 1), 3);
        let rk = key(1, Some(0), &toks, (0, 3 * CS), "r", 1);
        let r = c
            .call(OP_PREPARE_RETRIEVE, &[rk.clone(), V::I(500)])
            .unwrap();
        assert_eq!(r.get("success"), Some(&V::B(true)), "{kind:?}: {r:?}");
        let slots = r
            .get("context")
            .unwrap()
            .get("slots")
            .unwrap()
            .arr()
            .to_vec();
        assert_eq!(slots.len(), 3);
        for (chunk, slot) in slots.iter().enumerate() {
            let off = slot.get("offset").unwrap().int() as usize;
            let len = slot.get("length").unwrap().int() as usize;
            let want = expected_object(kind, &cache, &SRC[chunk * BPC..(chunk + 1) * BPC]);
            assert_eq!(len, want.len(), "{kind:?}: object size");
            assert!(
                pool.bytes()[off..off + len] == want[..],
                "{kind:?}: chunk {chunk} bytes differ from the 0.5.6 object layout"
            );
        }
        assert_eq!(
            c.call(OP_COMMIT_RETRIEVE, &[rk, V::I(500)]),
            Some(V::B(true))
        );
    }
}

#[test]
fn hnd_and_mla_round_trips() {
    for kind in [HND, MLA] {
        let srv = Server::start(&[]);
        let mut c = srv.client();
        let mut w = Worker::new(3, kind, 11);
        w.register(&srv, &mut c, 1);
        let toks = tokens(4, 3 * CS);
        let stored = w.snapshot();
        assert!(store(
            &mut c,
            3,
            key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
            &SRC
        ));
        w.fill_blocks(&SRC, 0);
        let before = w.snapshot();
        assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "r", 1), 3);
        let rk = key(1, Some(0), &toks, (0, 3 * CS), "r", 1);
        assert!(retrieve(&mut c, 3, rk, &DST, 0));
        let expected = scattered(kind, &before, &stored, &SRC, &DST, 0);
        assert_cache_eq(kind, &w.snapshot(), &expected, &format!("{kind:?}"));
    }
}

#[test]
fn skip_first_n_tokens_leaves_the_prefix_untouched() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut w = Worker::new(7, NHD, 3);
    w.register(&srv, &mut c, 1);
    let toks = tokens(2, 3 * CS);
    let stored = w.snapshot();
    assert!(store(
        &mut c,
        7,
        key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
        &SRC
    ));

    // 0; one block; mid-block (rounds down); mid-chunk; a whole chunk; more
    // than a chunk; every token.
    for skip in [
        0,
        BS,
        BS + 2,
        2 * BS + 2,
        CS,
        CS + BS + 2,
        2 * CS + 2 * BS,
        3 * CS,
    ] {
        w.fill_blocks(&DST, 0xab);
        let before = w.snapshot();
        let rid = format!("skip{skip}");
        assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, &rid, 1), 3);
        let rk = key(1, Some(0), &toks, (0, 3 * CS), &rid, 1);
        assert!(retrieve(&mut c, 7, rk, &DST, skip), "skip {skip}");
        // Whole blocks only: a partly skipped block is skipped entirely.
        let expected = scattered(NHD, &before, &stored, &SRC, &DST, skip / BS);
        assert_cache_eq(
            NHD,
            &w.snapshot(),
            &expected,
            &format!("skip_first_n_tokens {skip}"),
        );
    }
}

#[test]
fn all_null_chunk_is_not_stored() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let w = Worker::new(8, NHD, 4);
    w.register(&srv, &mut c, 1);
    let toks = tokens(3, 3 * CS);
    // Chunk 1 names only the null block (0); chunk 2 only partly.
    let blocks = [5, 6, 7, 8, 0, 0, 0, 0, 9, 0, 11, 12];
    assert!(store(
        &mut c,
        8,
        key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
        &blocks
    ));
    assert_eq!(
        lookup(&mut c, 1, &toks, 3 * CS, "l", 1),
        1,
        "the lookup stops at the chunk that was not stored"
    );
    // The partly-null chunk 2 was stored: it hits once chunk 1 is stored too.
    let real = [5, 6, 7, 8, 20, 21, 22, 23, 9, 0, 11, 12];
    assert!(store(
        &mut c,
        8,
        key(1, Some(0), &toks, (0, 3 * CS), "s2", 1),
        &real
    ));
    assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "l2", 1), 3);
}

#[test]
fn world_size_two_stores_and_retrieves_per_rank() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut w0 = Worker::new(1, NHD, 21);
    let mut w1 = Worker::new(2, NHD, 22);
    w0.register(&srv, &mut c, 2);
    w1.register(&srv, &mut c, 2);
    let toks = tokens(5, 3 * CS);
    let (s0, s1) = (w0.snapshot(), w1.snapshot());
    let src1 = [60, 61, 62, 2, 17, 18, 19, 20, 44, 45, 46, 47];

    assert!(store(
        &mut c,
        1,
        key(2, Some(0), &toks, (0, 3 * CS), "s", 1),
        &SRC
    ));
    assert_eq!(
        lookup(&mut c, 2, &toks, 3 * CS, "l0", 1),
        0,
        "a chunk is a hit only once every rank stored it"
    );
    assert!(store(
        &mut c,
        2,
        key(2, Some(1), &toks, (0, 3 * CS), "s", 1),
        &src1
    ));
    assert_eq!(lookup(&mut c, 2, &toks, 3 * CS, "l1", 1), 3);

    w0.fill_blocks(&SRC, 0);
    w1.fill_blocks(&src1, 0);
    let (b0, b1) = (w0.snapshot(), w1.snapshot());
    assert!(retrieve(
        &mut c,
        1,
        key(2, Some(0), &toks, (0, 3 * CS), "l1", 1),
        &DST,
        0
    ));
    assert!(retrieve(
        &mut c,
        2,
        key(2, Some(1), &toks, (0, 3 * CS), "l1", 1),
        &DST,
        0
    ));
    let e0 = scattered(NHD, &b0, &s0, &SRC, &DST, 0);
    let e1 = scattered(NHD, &b1, &s1, &src1, &DST, 0);
    assert_cache_eq(NHD, &w0.snapshot(), &e0, "rank 0 gets its own KV");
    assert_cache_eq(NHD, &w1.snapshot(), &e1, "rank 1 gets its own KV");

    // Each rank held one lock; both are used up.
    let again = key(2, Some(0), &toks, (0, 3 * CS), "l1", 1);
    assert!(!retrieve(&mut c, 1, again, &DST, 0));
}

#[test]
fn mla_one_writer_two_readers() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut writer = Worker::new(10, MLA, 31);
    let reader = Worker::new(11, MLA, 32);
    writer.register(&srv, &mut c, 1);
    reader.register(&srv, &mut c, 1);
    let toks = tokens(6, 3 * CS);
    let stored = writer.snapshot();
    // MLA ranks share one kv_rank: only the writer stores.
    assert!(store(
        &mut c,
        10,
        key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
        &SRC
    ));
    writer.fill_blocks(&SRC, 0);
    let (bw, br) = (writer.snapshot(), reader.snapshot());

    assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "r", 2), 3);
    let rk = key(1, Some(0), &toks, (0, 3 * CS), "r", 1);
    assert!(retrieve(&mut c, 10, rk.clone(), &DST, 0));
    assert!(
        retrieve(&mut c, 11, rk.clone(), &DST, 0),
        "the second reader still holds its lock"
    );
    let ew = scattered(MLA, &bw, &stored, &SRC, &DST, 0);
    let er = scattered(MLA, &br, &stored, &SRC, &DST, 0);
    assert_cache_eq(MLA, &writer.snapshot(), &ew, "writer reads back");
    assert_cache_eq(MLA, &reader.snapshot(), &er, "reader gets the writer's KV");
    assert!(!retrieve(&mut c, 11, rk, &DST, 0), "both locks released");
}

/// A RETRIEVE repeated after it used its lookup's lock reads under a lock of
/// its own while another request holds the objects, and takes nothing away
/// from that request's lookup.
#[test]
fn a_repeated_retrieve_leaves_another_requests_locks_alone() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let w = Worker::new(13, NHD, 6);
    w.register(&srv, &mut c, 1);
    let toks = tokens(8, 3 * CS);
    let sk = key(1, Some(0), &toks, (0, 3 * CS), "s", 1);
    assert!(store(&mut c, 13, sk, &SRC));
    for rid in ["r1", "r2"] {
        assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, rid, 1), 3);
    }
    let r1 = key(1, Some(0), &toks, (0, 3 * CS), "r1", 1);
    for _ in 0..2 {
        assert!(retrieve(&mut c, 13, r1.clone(), &DST, 0));
    }
    assert_eq!(
        srv.l1_count("read_locked_count"),
        3,
        "r2's lookup still holds every chunk"
    );
    let r2 = key(1, Some(0), &toks, (0, 3 * CS), "r2", 1);
    assert!(retrieve(&mut c, 13, r2, &DST, 0));
    assert_eq!(srv.l1_count("read_locked_count"), 0);
}

#[test]
fn retrieve_without_lookup_lock_fails() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let w = Worker::new(12, NHD, 5);
    w.register(&srv, &mut c, 1);
    let toks = tokens(7, 3 * CS);
    assert!(store(
        &mut c,
        12,
        key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
        &SRC
    ));
    let before = w.snapshot();
    let rk = key(1, Some(0), &toks, (0, 3 * CS), "s", 1);
    assert_eq!(
        c.call(
            OP_RETRIEVE,
            &[
                rk,
                V::I(12),
                V::A(vec![ids(&DST)]),
                V::Bin(EVENT.to_vec()),
                V::I(0)
            ],
        ),
        Some(V::A(vec![V::Bin(vec![]), V::B(false)]))
    );
    assert_cache_eq(NHD, &w.snapshot(), &before, "nothing written");
}

#[test]
fn too_few_block_ids_fail_cleanly() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut w = Worker::new(13, NHD, 6);
    w.register(&srv, &mut c, 1);
    let toks = tokens(8, 3 * CS);
    let full = key(1, Some(0), &toks, (0, 3 * CS), "s", 1);
    assert!(!store(&mut c, 13, full.clone(), &SRC[..11]));
    assert!(!store(&mut c, 13, full.clone(), &[]));
    assert_eq!(
        lookup(&mut c, 1, &toks, 3 * CS, "l", 1),
        0,
        "nothing stored"
    );

    let stored = w.snapshot();
    assert!(store(&mut c, 13, full, &SRC));
    assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "r", 1), 3);
    let before = w.snapshot();
    let rk = key(1, Some(0), &toks, (0, 3 * CS), "r", 1);
    assert!(!retrieve(&mut c, 13, rk.clone(), &DST[..11], 0));
    assert_cache_eq(NHD, &w.snapshot(), &before, "short retrieve writes nothing");
    // The rejected request left the lookup's locks in place.
    w.fill_blocks(&DST, 1);
    let before = w.snapshot();
    assert!(retrieve(&mut c, 13, rk, &DST, 0));
    let expected = scattered(NHD, &before, &stored, &SRC, &DST, 0);
    assert_cache_eq(NHD, &w.snapshot(), &expected, "valid retrieve after");
}

#[test]
fn block_id_out_of_range_fails_cleanly() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut w = Worker::new(14, NHD, 8);
    w.register(&srv, &mut c, 1);
    let toks = tokens(10, 3 * CS);
    let full = key(1, Some(0), &toks, (0, 3 * CS), "s", 1);
    for bad in [NB as i64, -3, i64::MAX] {
        let mut blocks = SRC;
        blocks[9] = bad;
        assert!(!store(&mut c, 14, full.clone(), &blocks), "block id {bad}");
    }
    assert_eq!(
        lookup(&mut c, 1, &toks, 3 * CS, "l", 1),
        0,
        "nothing stored"
    );

    let stored = w.snapshot();
    assert!(store(&mut c, 14, full, &SRC));
    assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "r", 1), 3);
    let before = w.snapshot();
    let rk = key(1, Some(0), &toks, (0, 3 * CS), "r", 1);
    let mut bad = DST;
    bad[4] = NB as i64 + 7;
    assert!(!retrieve(&mut c, 14, rk.clone(), &bad, 0));
    assert_cache_eq(NHD, &w.snapshot(), &before, "bad retrieve writes nothing");
    w.fill_blocks(&DST, 2);
    let before = w.snapshot();
    assert!(retrieve(&mut c, 14, rk, &DST, 0));
    let expected = scattered(NHD, &before, &stored, &SRC, &DST, 0);
    assert_cache_eq(NHD, &w.snapshot(), &expected, "valid retrieve after");
    c.noop_ok();
}

#[test]
fn unregistered_instance_cannot_store() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let w = Worker::new(15, NHD, 9);
    w.register(&srv, &mut c, 1);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(15)]), None);
    assert!(!registered_gpu_ids(&srv).contains(&15));
    let toks = tokens(11, 3 * CS);
    assert_eq!(
        c.call(
            OP_STORE,
            &[
                key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
                V::I(15),
                V::A(vec![ids(&SRC)]),
                V::Bin(EVENT.to_vec()),
            ],
        ),
        Some(V::A(vec![V::Bin(vec![]), V::B(false)]))
    );
    // A never-registered instance is refused the same way.
    assert!(!store(
        &mut c,
        99,
        key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
        &SRC
    ));
    c.noop_ok();
}

#[test]
fn checksums_match_before_and_after_a_round_trip() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut w = Worker::new(16, NHD, 10);
    w.register(&srv, &mut c, 1);
    let toks = tokens(12, 3 * CS);
    let cache = w.snapshot();

    let src_sums = checksums(&srv, 16, &SRC, false);
    assert_eq!(src_sums["status"], "success");
    assert_eq!(src_sums["num_chunks"], 3);
    let src_digests = digests(&src_sums["chunk_checksums"]);
    let want: Vec<String> = SRC
        .chunks(BPC)
        .map(|b| expected_digest(&cache, b, 0..NL))
        .collect();
    assert_eq!(
        src_digests, want,
        "MD5 over index_select(block axis) per layer"
    );
    let layerwise = checksums(&srv, 16, &SRC, true);
    for l in 0..NL {
        let want: Vec<String> = SRC
            .chunks(BPC)
            .map(|b| expected_digest(&cache, b, l..l + 1))
            .collect();
        assert_eq!(
            digests(&layerwise["chunk_checksums"][format!("layer_{l}")]),
            want
        );
    }
    assert_ne!(
        digests(&checksums(&srv, 16, &DST, false)["chunk_checksums"]),
        src_digests,
        "different blocks hash differently"
    );

    assert!(store(
        &mut c,
        16,
        key(1, Some(0), &toks, (0, 3 * CS), "s", 1),
        &SRC
    ));
    w.fill_blocks(&SRC, 0);
    assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "r", 1), 3);
    assert!(retrieve(
        &mut c,
        16,
        key(1, Some(0), &toks, (0, 3 * CS), "r", 1),
        &DST,
        0
    ));
    assert_eq!(
        digests(&checksums(&srv, 16, &DST, false)["chunk_checksums"]),
        src_digests,
        "destination blocks hash like the source blocks did"
    );
    assert_ne!(
        digests(&checksums(&srv, 16, &SRC, false)["chunk_checksums"]),
        src_digests,
        "the zeroed source blocks no longer do"
    );

    let (st, _) = srv.http(
        "POST",
        "/cache/checksums",
        Some(r#"{"instance_id": 999, "block_ids": [1], "chunk_size": 1}"#),
    );
    assert_eq!(st, 404, "unknown instance");
}

#[test]
fn a_store_partly_without_l1_memory_succeeds_and_counts_what_it_left_out() {
    // Room for 10 chunk objects of 4 KiB (whatever the shard count), and no
    // eviction: a store of 16 chunks finds memory for at most 10 of them.
    let obj = NL * 2 * CS * NH * HS * ES;
    assert_eq!(obj, 4096);
    let log = std::env::temp_dir().join(format!("{}.log", unique("kvshard-partial")));
    let srv = Server::start_logged(
        &["--l1-size-gb", "0.00004", "--eviction-policy", "noop"],
        &log,
    );
    let mut c = srv.client();
    let w = Worker::new(100, NHD, 1);
    w.register(&srv, &mut c, 1);
    let blocks: Vec<i64> = (0..16 * BPC as i64).collect();
    let toks = tokens(9, 16 * CS);
    let k = key(1, Some(0), &toks, (0, 16 * CS), "s", 1);
    assert!(
        store(&mut c, 100, k, &blocks),
        "answered as a success, as 0.5.6 answers it"
    );
    let metric = |name: &str| srv.metric(name, &[]).unwrap_or(0.0) as u64;
    let left_out = metric("kvshard_store_chunks_left_out_total");
    let stored = metric("lmcache_mp_l1_write_chunks_total");
    assert!((6..16).contains(&left_out), "{left_out} chunks left out");
    assert_eq!(stored + left_out, 16, "{stored} stored");
    assert_eq!(metric("kvshard_partial_stores_total"), 1);
    assert_eq!(
        metric("lmcache_mp_l1_allocation_failure_chunks_total"),
        left_out
    );
    // What was left out is a miss: the hit prefix is at most what was stored.
    let hits = lookup(&mut c, 1, &toks, 16 * CS, "r", 1);
    assert!(hits as u64 <= stored, "{hits} hits, {stored} stored");
    // Logged at the default level, with the L1's state and 0.5.6's answer.
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(&format!(
            "{left_out} of 16 chunks of a store found no L1 memory"
        )) && text.contains("WARN"),
        "{text}"
    );
    assert!(
        text.contains("answered as a success, as lmcache 0.5.6 does"),
        "{text}"
    );
    let _ = std::fs::remove_file(&log);
}

/// A hybrid model's registration: two classical layers (0 and 2) and an MLA
/// layer (1) in another engine group form two kernel groups, each with its
/// own block list. STORE gathers every group's blocks into one object per
/// chunk, RETRIEVE scatters each group's region back into its own blocks,
/// and a request with the wrong number of block lists fails without
/// touching the cache.
#[test]
fn kernel_groups_round_trip_each_through_its_own_block_list() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let kinds = [NHD, MLA, NHD];
    let names: Vec<String> = kinds.iter().map(|_| unique("lmckvh")).collect();
    let mut segs: Vec<ShmMap> = kinds
        .iter()
        .zip(&names)
        .enumerate()
        .map(|(l, (k, n))| {
            let mut m = ShmMap::create(n, k.layer_bytes());
            m.bytes_mut()
                .copy_from_slice(&pattern(4000 + l as u64, k.layer_bytes()));
            m
        })
        .collect();
    let wrappers = kinds
        .iter()
        .zip(&names)
        .map(|(k, n)| {
            let (shape, stride) = k.shape_stride();
            cpu_shm_wrapper(
                &format!("/{n}"),
                k.layer_bytes() as i64,
                "float16",
                &shape,
                &stride,
            )
        })
        .collect();
    let iid = 300;
    let groups = vec![kv_group_of(0, &[0, 2], BS), kv_group_of(1, &[1], BS)];
    let args = register_kv_cache_frames(iid, wrappers, MODEL, 1, "NHD", groups);
    assert_eq!(c.call(OP_REGISTER_KV_CACHE, &args), None);
    assert!(registered_gpu_ids(&srv).contains(&iid), "hybrid registered");
    let status = srv.get_json("/status");
    let layout = &status["cache_context_meta"][iid.to_string()]["kv_cache_layout"];
    let groups = layout["kernel_groups"].as_array().expect("kernel_groups");
    assert_eq!(groups.len(), 2, "{layout}");
    assert_eq!(groups[0]["layer_indices"], serde_json::json!([0, 2]));
    assert_eq!(groups[1]["layer_indices"], serde_json::json!([1]));
    assert_eq!(groups[1]["engine_group_idx"], 1);
    assert_eq!(groups[1]["is_mla"], true);
    assert_eq!(
        layout["cache_size_per_token"],
        2 * NHD.row() * 2 + MLA.row(),
        "both groups' bytes per token"
    );

    // The MLA group's blocks are other ids than the classical group's.
    let src_mla: Vec<i64> = SRC.iter().map(|b| (b + 17) % NB as i64).collect();
    let dst_mla: Vec<i64> = DST.iter().map(|b| (b + 3) % NB as i64).collect();
    let lists = |a: &[i64], b: &[i64]| V::A(vec![ids(a), ids(b)]);
    let toks = tokens(30, 3 * CS);
    let stored: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    let sk = key(1, Some(0), &toks, (0, 3 * CS), "s", 1);
    let reply = c.call(
        OP_STORE,
        &[
            sk.clone(),
            V::I(iid),
            lists(&SRC, &src_mla),
            V::Bin(EVENT.to_vec()),
        ],
    );
    assert!(outcome(reply), "hybrid store");
    // One list, or three, for two groups: the failure reply.
    for wrong in [
        V::A(vec![ids(&SRC)]),
        V::A(vec![ids(&SRC), ids(&SRC), ids(&SRC)]),
    ] {
        let reply = c.call(
            OP_STORE,
            &[sk.clone(), V::I(iid), wrong, V::Bin(EVENT.to_vec())],
        );
        assert!(
            !outcome(reply),
            "a store with the wrong number of lists fails"
        );
    }
    assert_eq!(c.call(OP_END_SESSION, &[s("s")]), None);

    for m in &mut segs {
        m.bytes_mut().fill(0x33);
    }
    let before: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    assert_eq!(lookup(&mut c, 1, &toks, 3 * CS, "r", 1), 3);
    let rk = key(1, Some(0), &toks, (0, 3 * CS), "r", 1);
    let short = V::A(vec![ids(&DST), ids(&dst_mla[..BPC])]);
    let reply = c.call(
        OP_RETRIEVE,
        &[
            rk.clone(),
            V::I(iid),
            short,
            V::Bin(EVENT.to_vec()),
            V::I(0),
        ],
    );
    assert!(
        !outcome(reply),
        "a group list too short for the chunks fails"
    );
    let after: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    assert!(after == before, "a failed retrieve writes nothing");
    let reply = c.call(
        OP_RETRIEVE,
        &[
            rk,
            V::I(iid),
            lists(&DST, &dst_mla),
            V::Bin(EVENT.to_vec()),
            V::I(BS as i64),
        ],
    );
    assert!(outcome(reply), "hybrid retrieve");
    // Each layer got its group's blocks, the first block of the range skipped.
    for (l, kind) in kinds.iter().enumerate() {
        let (src, dst) = if l == 1 {
            (&src_mla[..], &dst_mla[..])
        } else {
            (&SRC[..], &DST[..])
        };
        let want = scattered(
            *kind,
            std::slice::from_ref(&before[l]),
            std::slice::from_ref(&stored[l]),
            src,
            dst,
            1,
        );
        assert_cache_eq(
            *kind,
            std::slice::from_ref(&segs[l].bytes().to_vec()),
            &want,
            &format!("layer {l} after the hybrid retrieve"),
        );
    }

    // Checksums: one block list over every layer, each in its own layout.
    let blocks = &DST[BPC..2 * BPC];
    let mut bytes = Vec::new();
    for (l, kind) in kinds.iter().enumerate() {
        for plane in 0..kind.planes() {
            for &b in blocks {
                bytes.extend_from_slice(&segs[l].bytes()[kind.block_range(plane, b as usize)]);
            }
        }
    }
    let sums = checksums(&srv, iid, blocks, false);
    assert_eq!(digests(&sums["chunk_checksums"]), [md5_hex(&bytes)]);
}

/// The `.data` files of an fs L2 under `dir`, waiting as [`l2_files`]:
/// `(object group, path)` by the file name's third field.
fn og_files(dir: &std::path::Path, n: usize) -> Vec<(u32, std::path::PathBuf)> {
    l2_files(dir, n)
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            let og = name.split('@').nth(2).expect("og field");
            (u32::from_str_radix(og, 16).expect("og hex"), p)
        })
        .collect()
}

/// `--separate-object-groups` as 0.5.6 buckets kernel groups: a group of a
/// sliding window of two chunks forms object group 1 beside the
/// full-attention group 0, one object per chunk and group, each holding only
/// its groups' regions. A hit needs the full group's every chunk but the
/// windowed group's last two only (0.5.6's fold), and a retrieve writes the
/// windowed group's last two chunks only.
#[test]
fn separate_object_groups_store_each_group_and_serve_its_window() {
    const CHUNKS: usize = 4;
    let dir = std::env::temp_dir().join(unique("lmc-og"));
    std::fs::create_dir_all(&dir).expect("l2 dir");
    let adapter = fs_adapter(&dir);
    let args = [
        "--separate-object-groups",
        "--l2-adapter",
        adapter.as_str(),
        "--l2-prefetch-load-timeout",
        "30",
    ];
    let srv = Server::start(&args);
    let mut c = srv.client();
    // Layers 0 and 1 attend fully (engine group 0); layer 2 slides over two
    // chunks (engine group 1).
    let names: Vec<String> = (0..3).map(|_| unique("lmckvog")).collect();
    let mut segs: Vec<ShmMap> = names
        .iter()
        .enumerate()
        .map(|(l, n)| {
            let mut m = ShmMap::create(n, NHD.layer_bytes());
            m.bytes_mut()
                .copy_from_slice(&pattern(7000 + l as u64, NHD.layer_bytes()));
            m
        })
        .collect();
    let (shape, stride) = NHD.shape_stride();
    let wrappers = names
        .iter()
        .map(|n| {
            let bytes = NHD.layer_bytes() as i64;
            cpu_shm_wrapper(&format!("/{n}"), bytes, "float16", &shape, &stride)
        })
        .collect();
    let iid = 310;
    let groups = vec![
        kv_group_windowed(0, &[0, 1], BS, -1),
        kv_group_windowed(1, &[2], BS, 2 * CS as i64),
    ];
    let register = register_kv_cache_frames(iid, wrappers, MODEL, 1, "NHD", groups);
    assert_eq!(c.call(OP_REGISTER_KV_CACHE, &register), None);
    assert!(registered_gpu_ids(&srv).contains(&iid), "registered");
    let status = srv.get_json("/status");
    let layout = &status["cache_context_meta"][iid.to_string()]["kv_cache_layout"];
    assert_eq!(
        layout["kernel_groups"][1]["object_group_idx"], 1,
        "{layout}"
    );
    let ogs = layout["object_groups"].as_array().expect("object_groups");
    assert_eq!(ogs.len(), 2, "{layout}");
    assert_eq!(ogs[0]["sliding_window_chunks"], -1);
    assert_eq!(ogs[1]["sliding_window_chunks"], 2);
    assert_eq!(ogs[0]["object_bytes"], 2 * NHD.row() * 2 * CS);
    assert_eq!(ogs[1]["object_bytes"], NHD.row() * 2 * CS);

    let src_a: Vec<i64> = (0..(CHUNKS * BPC) as i64).map(|i| 3 + i).collect();
    let src_b: Vec<i64> = (0..(CHUNKS * BPC) as i64).map(|i| 63 - 2 * i).collect();
    let dst_a: Vec<i64> = (0..(CHUNKS * BPC) as i64).map(|i| 62 - 3 * i / 2).collect();
    let dst_b: Vec<i64> = (0..(CHUNKS * BPC) as i64).map(|i| 2 + 2 * i).collect();
    let lists = |a: &[i64], b: &[i64]| V::A(vec![ids(a), ids(b)]);
    let toks = tokens(41, CHUNKS * CS);
    let stored: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    let sk = key(1, Some(0), &toks, (0, CHUNKS * CS), "s", 1);
    let ev = || V::Bin(EVENT.to_vec());
    let reply = c.call(OP_STORE, &[sk, V::I(iid), lists(&src_a, &src_b), ev()]);
    assert!(outcome(reply), "store");
    assert_eq!(c.call(OP_END_SESSION, &[s("s")]), None);

    // One object per chunk and object group, each its groups' regions only.
    let files = og_files(&dir, 2 * CHUNKS);
    assert_eq!(files.len(), 2 * CHUNKS, "{files:?}");
    let chunk_blocks = |v: &[i64], c: usize| v[c * BPC..(c + 1) * BPC].to_vec();
    let mut og1_of_chunk = vec![None; CHUNKS];
    for (og, path) in &files {
        let bytes = std::fs::read(path).expect("object");
        let (layers, src) = match og {
            0 => (&stored[..2], &src_a),
            1 => (&stored[2..], &src_b),
            other => panic!("object group {other}"),
        };
        let chunk = (0..CHUNKS)
            .find(|&c| bytes == expected_object(NHD, layers, &chunk_blocks(src, c)))
            .unwrap_or_else(|| panic!("object group {og}: {path:?} is no chunk's object"));
        if *og == 1 {
            og1_of_chunk[chunk] = Some(path.clone());
        }
    }

    // A hit of every chunk; the retrieve writes the windowed layer's last two
    // chunks only.
    for m in &mut segs {
        m.bytes_mut().fill(0x33);
    }
    let before: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    assert_eq!(lookup(&mut c, 1, &toks, CHUNKS * CS, "r", 1), CHUNKS as i64);
    let rk = key(1, Some(0), &toks, (0, CHUNKS * CS), "r", 1);
    let reply = c.call(
        OP_RETRIEVE,
        &[rk, V::I(iid), lists(&dst_a, &dst_b), ev(), V::I(0)],
    );
    assert!(outcome(reply), "retrieve");
    let after: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    let want_full = scattered(NHD, &before[..2], &stored[..2], &src_a, &dst_a, 0);
    assert_cache_eq(NHD, &after[..2], &want_full, "full-attention layers");
    let skip = 2 * BPC; // the windowed group's first two chunks
    let want_window = scattered(NHD, &before[2..], &stored[2..], &src_b, &dst_b, skip);
    assert_cache_eq(NHD, &after[2..], &want_window, "windowed layer");
    drop(c);
    drop(srv);

    // From L2 alone: without the windowed group's objects of chunks 0 and 3,
    // a 4-chunk hit lacks its chunk 3, but 3 chunks need only chunks 1 and 2
    // of it: the hit is 3, and a retrieve of them reads those.
    for c in [0, 3] {
        std::fs::remove_file(og1_of_chunk[c].as_ref().expect("og 1 object")).expect("rm");
    }
    let srv = Server::start(&args);
    let mut c = srv.client();
    assert_eq!(c.call(OP_REGISTER_KV_CACHE, &register), None);
    for m in &mut segs {
        m.bytes_mut().fill(0x44);
    }
    let before: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    assert_eq!(lookup(&mut c, 1, &toks, CHUNKS * CS, "l2", 1), 3);
    let rk = key(1, Some(0), &toks, (0, 3 * CS), "l2", 1);
    let reply = c.call(
        OP_RETRIEVE,
        &[rk, V::I(iid), lists(&dst_a, &dst_b), ev(), V::I(0)],
    );
    assert!(outcome(reply), "retrieve of the 3-chunk hit");
    let after: Vec<Vec<u8>> = segs.iter().map(|m| m.bytes().to_vec()).collect();
    let n = 3 * BPC;
    let want_full = scattered(NHD, &before[..2], &stored[..2], &src_a[..n], &dst_a[..n], 0);
    assert_cache_eq(
        NHD,
        &after[..2],
        &want_full,
        "full-attention layers from L2",
    );
    let want_window = scattered(
        NHD,
        &before[2..],
        &stored[2..],
        &src_b[..n],
        &dst_b[..n],
        BPC,
    );
    assert_cache_eq(NHD, &after[2..], &want_window, "windowed layer from L2");
    let _ = std::fs::remove_dir_all(&dir);
}
