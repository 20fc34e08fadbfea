//! End to end: the L1 arena mapped from `--l1-devdax-path`. A regular file
//! stands in for a /dev/daxX.Y device (the same MAP_SHARED mapping; only the
//! size and alignment come from st_size and the page size instead of sysfs).
//! The test plays an lmcache_driven CPU worker (cpu_shm), which needs no SHM
//! pool, and checks the chunks land in the file.

mod support;
use support::*;

use std::path::{Path, PathBuf};

/// `--l1-size-gb 0.0625` in `Server::start`.
const L1_BYTES: u64 = 64 << 20;
/// One chunk (`--chunk-size 16`) is one block of the `LM_LAYER_*` layer.
const BLOCK_BYTES: usize = 16 * 2 * 32 * 2;
const BLOCKS: usize = 8;
/// The 0.5.6 object of one chunk: the K block, then the V block.
const OBJECT_BYTES: usize = 2 * BLOCK_BYTES;
const IID: i64 = 7;

/// A path under the temp dir, removed (file or directory) when dropped.
struct TempPath(PathBuf);

impl TempPath {
    fn new(tag: &str) -> TempPath {
        TempPath(std::env::temp_dir().join(unique(&format!("kvshard_devdax_{tag}"))))
    }

    /// A file of `len` bytes, as `fallocate -l` would leave it.
    fn file(tag: &str, len: u64) -> TempPath {
        let t = TempPath::new(tag);
        std::fs::File::create(&t.0).unwrap().set_len(len).unwrap();
        t
    }

    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn start_on(path: &Path) -> Server {
    Server::start(&["--l1-devdax-path", path.to_str().unwrap(), "--shm-name", ""])
}

/// Byte range of (plane, block) in the layer.
fn block_range(plane: usize, block: usize) -> std::ops::Range<usize> {
    let off = (plane * BLOCKS + block) * BLOCK_BYTES;
    off..off + BLOCK_BYTES
}

/// The object STORE makes of `block`: K plane, then V plane.
fn object(layer: &[u8], block: usize) -> Vec<u8> {
    let mut out = layer[block_range(0, block)].to_vec();
    out.extend_from_slice(&layer[block_range(1, block)]);
    out
}

fn tokens(seed: u32) -> Vec<u32> {
    ed_tokens(seed, 3 * ED_CHUNK)
}

fn key(toks: &[u32], worker: Option<i64>, rid: &str) -> V {
    ipc_key("lm", 1, worker, toks, 0, toks.len() as i64, rid, 1)
}

fn blocks(ids: &[i64]) -> V {
    V::A(vec![V::A(ids.iter().map(|b| V::I(*b)).collect())])
}

/// STORE/RETRIEVE answer `(event, ok)`; a cpu_shm worker gets no event.
fn ok(reply: Option<V>) -> bool {
    match reply {
        Some(V::A(a)) if a.len() == 2 => a[1].boolean(),
        other => panic!("expected (bytes, bool), got {other:?}"),
    }
}

fn store(c: &mut Client, toks: &[u32], ids: &[i64]) -> bool {
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
fn lookup(c: &mut Client, toks: &[u32], rid: &str) -> i64 {
    assert_eq!(
        c.call(OP_LOOKUP, &[key(toks, None, rid), V::I(1)]),
        None,
        "lookup ack has no payload"
    );
    c.prefetch_result(rid)
}

fn retrieve(c: &mut Client, toks: &[u32], rid: &str, ids: &[i64]) -> bool {
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
fn worker(c: &mut Client, seed: u64) -> ShmMap {
    let (mut layer, desc) = lm_layer("kvt_devdax");
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
fn round_trip(srv: &Server, seed: u64) -> Vec<Vec<u8>> {
    let mut c = srv.client();
    let mut layer = worker(&mut c, seed);
    let toks = tokens(seed as u32);
    let stored: Vec<Vec<u8>> = (1..=3).map(|b| object(layer.bytes(), b)).collect();
    assert!(store(&mut c, &toks, &[1, 2, 3]), "store into the devdax L1");
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
            "chunk {i} retrieved from the devdax L1 differs from what was stored"
        );
    }
    assert_eq!(c.call(OP_END_SESSION, &[s("read")]), None);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(IID)]), None);
    stored
}

#[test]
fn devdax_file_holds_the_l1_and_restarts_empty() {
    let file = TempPath::file("l1", L1_BYTES);
    let mut srv = start_on(&file.0);

    let arena = &srv.get_json("/status")["storage_manager"]["l1_manager"]["arena"];
    assert_eq!(arena["kind"], "file", "{arena}");
    assert_eq!(arena["path"], file.arg(), "{arena}");
    assert_eq!(arena["size_bytes"], L1_BYTES, "{arena}");

    let stored = round_trip(&srv, 11);
    // The chunks live in the file: objects sit at --l1-align-bytes (4096)
    // offsets, and one object is exactly that long.
    assert_eq!(OBJECT_BYTES, 4096);
    let image = std::fs::read(&file.0).unwrap();
    assert_eq!(image.len() as u64, L1_BYTES, "the file keeps its size");
    for (i, obj) in stored.iter().enumerate() {
        assert!(
            image.chunks_exact(OBJECT_BYTES).any(|c| c == obj),
            "stored chunk {i} is not in the devdax file"
        );
    }
    assert!(srv.alive());
    drop(srv);

    // L1 is not persistent: after a restart on the same file nothing hits,
    // although the old bytes are still in it, and the server works.
    srv = start_on(&file.0);
    let mut c = srv.client();
    let _layer = worker(&mut c, 11);
    assert_eq!(lookup(&mut c, &tokens(11), "after-restart"), 0);
    assert_eq!(c.call(OP_END_SESSION, &[s("after-restart")]), None);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(IID)]), None);
    drop(c);
    let stored = round_trip(&srv, 12);
    let image = std::fs::read(&file.0).unwrap();
    assert!(
        image.chunks_exact(OBJECT_BYTES).any(|c| c == stored[0]),
        "chunk stored after the restart is not in the devdax file"
    );
    assert!(srv.alive());
}

#[test]
fn devdax_file_smaller_than_the_l1_is_refused_naming_both_sizes() {
    let file = TempPath::file("small", L1_BYTES / 2);
    let err = Server::start_refused(&["--l1-devdax-path", file.arg(), "--shm-name", ""]);
    assert!(err.contains(file.arg()), "{err}");
    assert!(err.contains(&(L1_BYTES / 2).to_string()), "{err}");
    assert!(err.contains(&L1_BYTES.to_string()), "{err}");
    assert!(err.contains("fallocate -l"), "{err}");
}

#[test]
fn devdax_missing_path_and_directory_are_refused() {
    let missing = TempPath::new("missing");
    let err = Server::start_refused(&["--l1-devdax-path", missing.arg(), "--shm-name", ""]);
    assert!(
        err.contains(missing.arg()) && err.contains("no such file"),
        "{err}"
    );

    let dir = TempPath::new("dir");
    std::fs::create_dir(&dir.0).unwrap();
    let err = Server::start_refused(&["--l1-devdax-path", dir.arg(), "--shm-name", ""]);
    assert!(
        err.contains(dir.arg()) && err.contains("is a directory"),
        "{err}"
    );
}

#[test]
fn devdax_with_the_shm_pool_is_refused_naming_the_fix() {
    // Without devdax the arena is the SHM pool, and /status says so.
    let srv = Server::start(&[]);
    let arena = &srv.get_json("/status")["storage_manager"]["l1_manager"]["arena"];
    assert_eq!(arena["kind"], "shm", "{arena}");
    assert_eq!(
        arena["path"],
        format!("/dev/shm/{}", srv.shm_name),
        "{arena}"
    );
    drop(srv);

    let file = TempPath::file("shm", L1_BYTES);
    // Server::start's defaults name an SHM pool.
    let err = Server::start_refused(&["--l1-devdax-path", file.arg()]);
    assert!(
        err.contains("--l1-devdax-path") && err.contains("add --shm-name \"\""),
        "{err}"
    );
}

#[test]
fn devdax_file_held_by_a_running_server_is_refused() {
    let file = TempPath::file("held", L1_BYTES);
    let mut first = start_on(&file.0);
    let err = Server::start_refused(&["--l1-devdax-path", file.arg(), "--shm-name", ""]);
    assert!(err.contains("in use"), "{err}");
    assert!(first.alive(), "the first server keeps serving");
    round_trip(&first, 21);
}
