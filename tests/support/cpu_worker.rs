//! An lmcache_driven CPU worker (cpu_shm) for the tests of where the L1
//! lives (`--l1-devdax-path`, `--gds-l1-path`): one `LM_LAYER_*` layer of 8
//! blocks, one chunk per block, stored and retrieved through the real binary.
//! A cpu_shm worker needs no SHM pool, so these servers run without one.

use std::path::PathBuf;

use super::*;

/// `--l1-size-gb 0.0625` in `Server::start`.
pub const L1_BYTES: u64 = 64 << 20;
/// One chunk (`--chunk-size 16`) is one block of the `LM_LAYER_*` layer.
pub const BLOCK_BYTES: usize = 16 * 2 * 32 * 2;
pub const BLOCKS: usize = 8;
/// The 0.5.6 object of one chunk: the K block, then the V block.
pub const OBJECT_BYTES: usize = 2 * BLOCK_BYTES;
pub const IID: i64 = 7;

/// A path under the temp dir, removed (file or directory) when dropped.
pub struct TempPath(pub PathBuf);

impl TempPath {
    pub fn new(tag: &str) -> TempPath {
        TempPath(std::env::temp_dir().join(unique(&format!("kvshard_l1_{tag}"))))
    }

    /// A file of `len` bytes, as `fallocate -l` would leave it.
    pub fn file(tag: &str, len: u64) -> TempPath {
        let t = TempPath::new(tag);
        std::fs::File::create(&t.0).unwrap().set_len(len).unwrap();
        t
    }

    pub fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Byte range of (plane, block) in the layer.
pub fn block_range(plane: usize, block: usize) -> std::ops::Range<usize> {
    let off = (plane * BLOCKS + block) * BLOCK_BYTES;
    off..off + BLOCK_BYTES
}

/// The object STORE makes of `block`: K plane, then V plane.
pub fn object(layer: &[u8], block: usize) -> Vec<u8> {
    let mut out = layer[block_range(0, block)].to_vec();
    out.extend_from_slice(&layer[block_range(1, block)]);
    out
}

pub fn tokens(seed: u32) -> Vec<u32> {
    ed_tokens(seed, 3 * ED_CHUNK)
}

pub fn key(toks: &[u32], worker: Option<i64>, rid: &str) -> V {
    ipc_key("lm", 1, worker, toks, 0, toks.len() as i64, rid, 1)
}

pub fn blocks(ids: &[i64]) -> V {
    V::A(vec![V::A(ids.iter().map(|b| V::I(*b)).collect())])
}

/// STORE/RETRIEVE answer `(event, ok)`; a cpu_shm worker gets no event.
pub fn ok(reply: Option<V>) -> bool {
    match reply {
        Some(V::A(a)) if a.len() == 2 => a[1].boolean(),
        other => panic!("expected (bytes, bool), got {other:?}"),
    }
}

pub fn store(c: &mut Client, toks: &[u32], ids: &[i64]) -> bool {
    ok(c.call(
        OP_STORE,
        &[
            key(toks, Some(0), "store"),
            V::I(IID),
            blocks(ids),
            V::Bin(b"stub_ipc_handle".to_vec()),
        ],
    ))
}

/// Scheduler lookup of the whole key; returns the hit chunks.
pub fn lookup(c: &mut Client, toks: &[u32], rid: &str) -> i64 {
    assert_eq!(
        c.call(OP_LOOKUP, &[key(toks, None, rid), V::I(1)]),
        None,
        "lookup ack has no payload"
    );
    c.prefetch_result(rid)
}

pub fn retrieve(c: &mut Client, toks: &[u32], rid: &str, ids: &[i64]) -> bool {
    ok(c.call(
        OP_RETRIEVE,
        &[
            key(toks, Some(0), rid),
            V::I(IID),
            blocks(ids),
            V::Bin(b"stub_ipc_handle".to_vec()),
            V::I(0),
        ],
    ))
}

/// Registers a fresh worker layer filled from `seed`; returns its mapping
/// (the registration lives as long as the server remembers the instance).
pub fn worker(c: &mut Client, seed: u64) -> ShmMap {
    let (mut layer, desc) = lm_layer("kvt_l1");
    assert_eq!(layer.len, 2 * BLOCKS * BLOCK_BYTES, "layer geometry");
    layer
        .bytes_mut()
        .copy_from_slice(&pattern(seed, 2 * BLOCKS * BLOCK_BYTES));
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(IID, desc)),
        None
    );
    layer
}

/// Stores blocks 1..=3, retrieves them into blocks 5..=7 and checks the bytes;
/// returns the stored objects.
pub fn round_trip(srv: &Server, seed: u64) -> Vec<Vec<u8>> {
    let mut c = srv.client();
    let mut layer = worker(&mut c, seed);
    let toks = tokens(seed as u32);
    let stored: Vec<Vec<u8>> = (1..=3).map(|b| object(layer.bytes(), b)).collect();
    assert!(store(&mut c, &toks, &[1, 2, 3]), "store into the L1");
    assert_eq!(c.call(OP_END_SESSION, &[s("store")]), None);

    for b in 5..=7 {
        for plane in 0..2 {
            layer.bytes_mut()[block_range(plane, b)].fill(0);
        }
    }
    assert_eq!(lookup(&mut c, &toks, "read"), 3, "every chunk hits");
    assert!(retrieve(&mut c, &toks, "read", &[5, 6, 7]));
    for (i, b) in (5..=7).enumerate() {
        assert!(
            object(layer.bytes(), b) == stored[i],
            "chunk {i} retrieved from the L1 differs from what was stored"
        );
    }
    assert_eq!(c.call(OP_END_SESSION, &[s("read")]), None);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(IID)]), None);
    stored
}
