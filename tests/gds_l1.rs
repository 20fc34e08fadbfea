//! End to end: the GDS L1 tier (`--gds-l1-path`) on its O_DIRECT io_uring
//! backend. Each shard's L1 objects live in its own slab file
//! (`lmcache_gds_slab.<shard>.bin`); the test plays an lmcache_driven CPU
//! worker (cpu_shm) and reads the slab files to check the chunks are there.
//! The slabs go under the build's temporary directory, which is on a disk
//! (O_DIRECT is refused on tmpfs, and that refusal is tested too).

mod support;
use support::cpu_worker::*;
use support::*;

use std::path::{Path, PathBuf};

/// A slab directory, removed with its files when dropped.
struct SlabDir(PathBuf);

impl SlabDir {
    fn on_disk(tag: &str) -> SlabDir {
        SlabDir(Path::new(env!("CARGO_TARGET_TMPDIR")).join(unique(&format!("gds_l1_{tag}"))))
    }

    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }

    /// Every slab file's bytes, in shard order.
    fn images(&self, shards: usize) -> Vec<Vec<u8>> {
        (0..shards)
            .map(|i| std::fs::read(self.0.join(format!("lmcache_gds_slab.{i}.bin"))).unwrap())
            .collect()
    }
}

impl Drop for SlabDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start_on(dir: &SlabDir, extra: &[&str]) -> Server {
    let mut args = vec!["--gds-l1-path", dir.arg(), "--shm-name", ""];
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn arena(srv: &Server) -> serde_json::Value {
    srv.get_json("/status")["storage_manager"]["l1_manager"]["arena"].clone()
}

/// Whether every object is in some slab file at a 4 KiB-aligned offset
/// (objects are exactly one 4 KiB page here).
fn in_slabs(images: &[Vec<u8>], objects: &[Vec<u8>]) -> bool {
    assert_eq!(OBJECT_BYTES, 4096);
    objects.iter().all(|obj| {
        images
            .iter()
            .any(|img| img.chunks_exact(OBJECT_BYTES).any(|c| c == obj))
    })
}

#[test]
fn gds_slabs_hold_the_l1_and_restart_empty() {
    let dir = SlabDir::on_disk("l1");
    let mut srv = start_on(&dir, &[]);

    let a = arena(&srv);
    assert_eq!(a["kind"], "gds_slab", "{a}");
    assert_eq!(a["path"], dir.arg(), "{a}");
    assert_eq!(a["direct_io"], true, "{a}");
    assert_eq!(a["backend"], "io_uring", "{a}");
    assert_eq!(a["size_bytes"], L1_BYTES, "{a}");
    let shards = a["slabs"].as_array().expect("one slab per shard").len();
    assert!(shards >= 1, "{a}");
    for (i, slab) in a["slabs"].as_array().unwrap().iter().enumerate() {
        let file = dir.0.join(format!("lmcache_gds_slab.{i}.bin"));
        assert_eq!(slab["file"], file.to_str().unwrap(), "{a}");
        assert_eq!(slab["size_bytes"], L1_BYTES / shards as u64, "{a}");
        assert_eq!(
            std::fs::metadata(&file).unwrap().len(),
            L1_BYTES / shards as u64,
            "the slab is preallocated to its size"
        );
    }
    // No SHM pool: the objects are not in memory an engine_driven worker could map.
    let st = srv.get_json("/status");
    assert_eq!(
        st["storage_manager"]["l1_manager"]["huge_pages"], "off",
        "{st}"
    );

    let stored = round_trip(&srv, 11);
    assert!(
        in_slabs(&dir.images(shards), &stored),
        "the stored chunks are in the slab files"
    );
    let a = arena(&srv);
    let written: u64 = a["slabs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["bytes_written"].as_u64().unwrap())
        .sum();
    let read: u64 = a["slabs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["bytes_read"].as_u64().unwrap())
        .sum();
    assert_eq!(written, 3 * OBJECT_BYTES as u64, "{a}");
    assert_eq!(read, 3 * OBJECT_BYTES as u64, "{a}");
    assert!(srv.alive());
    drop(srv);

    // Not persistent: a restart empties the slabs (as 0.5.6 truncates its
    // slab), nothing hits, and the server works.
    srv = start_on(&dir, &[]);
    assert!(
        !in_slabs(&dir.images(shards), &stored[..1]),
        "the old chunks are gone from the slab files"
    );
    let mut c = srv.client();
    let _layer = worker(&mut c, 11);
    assert_eq!(lookup(&mut c, &tokens(11), "after-restart"), 0);
    assert_eq!(c.call(OP_END_SESSION, &[s("after-restart")]), None);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(IID)]), None);
    drop(c);
    let stored = round_trip(&srv, 12);
    assert!(in_slabs(&dir.images(shards), &stored));
    assert!(srv.alive());
}

#[test]
fn gds_slab_held_by_a_running_server_is_refused() {
    let dir = SlabDir::on_disk("held");
    let mut first = start_on(&dir, &[]);
    let stored = round_trip(&first, 21);
    let err = Server::start_refused(&["--gds-l1-path", dir.arg(), "--shm-name", ""]);
    assert!(
        err.contains("in use by process") && err.contains("give each server its own directory"),
        "{err}"
    );
    assert!(first.alive(), "the first server keeps serving");
    // Its slabs were not truncated by the refused start.
    let shards = arena(&first)["slabs"].as_array().unwrap().len();
    assert!(in_slabs(&dir.images(shards), &stored));
    round_trip(&first, 22);
}

#[test]
fn gds_direct_io_on_tmpfs_is_refused_and_the_page_cache_mode_works() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("skipped: no /dev/shm");
        return;
    }
    let dir = SlabDir(shm.join(unique("kvshard_gds_tmpfs")));
    let err = Server::start_refused(&["--gds-l1-path", dir.arg(), "--shm-name", ""]);
    assert!(
        err.contains("cannot do direct I/O") && err.contains("--no-gds-l1-use-direct-io"),
        "{err}"
    );

    let srv = start_on(&dir, &["--no-gds-l1-use-direct-io"]);
    assert_eq!(arena(&srv)["direct_io"], false);
    let stored = round_trip(&srv, 31);
    let shards = arena(&srv)["slabs"].as_array().unwrap().len();
    assert!(in_slabs(&dir.images(shards), &stored));
}

#[test]
fn gds_slab_smaller_than_one_object_keeps_nothing_says_why_and_keeps_serving() {
    let dir = SlabDir::on_disk("small");
    let log_dir = SlabDir::on_disk("small_log");
    std::fs::create_dir_all(&log_dir.0).unwrap();
    let log = log_dir.0.join("server.log");
    // Two shards of one 4 KiB page each; a 32-token chunk is two blocks, 8 KiB.
    let mut srv = Server::start_logged(
        &[
            "--gds-l1-path",
            dir.arg(),
            "--shm-name",
            "",
            "--cores",
            "0,1",
            "--l1-size-gb",
            "0.00000762939453125",
            "--chunk-size",
            "32",
        ],
        &log,
    );
    assert_eq!(arena(&srv)["size_bytes"], 8192);
    let mut c = srv.client();
    let _layer = worker(&mut c, 41);
    let toks = ed_tokens(41, 64);
    // Answered as 0.5.6 answers a store it has no room for (done, nothing
    // kept), and nothing is kept: the lookup misses.
    assert!(store(&mut c, &toks, &[1, 2, 3, 4]));
    assert_eq!(c.call(OP_END_SESSION, &[s("store")]), None);
    assert_eq!(
        lookup(&mut c, &toks, "miss"),
        0,
        "a chunk larger than the shard's slab is not stored"
    );
    assert_eq!(c.call(OP_END_SESSION, &[s("miss")]), None);
    wait_until("the refusal is logged", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("more than shard") && text.contains("raise --l1-size-gb")
    });
    assert!(srv.alive());
    c.noop_ok();
    assert_eq!(srv.http("GET", "/status", None).0, 200);
}

#[test]
fn gds_misaligned_and_unsupported_settings_are_refused_at_start() {
    let dir = SlabDir::on_disk("refused");
    let err = Server::start_refused(&[
        "--gds-l1-path",
        dir.arg(),
        "--shm-name",
        "",
        "--l1-align-bytes",
        "512",
    ]);
    assert!(
        err.contains("--l1-align-bytes") && err.contains("4096"),
        "{err}"
    );
    let err = Server::start_refused(&["--gds-l1-path", dir.arg()]);
    assert!(err.contains("--shm-name \"\""), "{err}");
    let err = Server::start_refused(&[
        "--gds-l1-path",
        dir.arg(),
        "--shm-name",
        "",
        "--gds-l1-backend",
        "cufile",
    ]);
    assert!(err.contains("use auto"), "{err}");
    assert!(
        !dir.0.exists(),
        "a refused start leaves no slab directory behind"
    );
}

#[test]
fn gds_l1_writes_behind_to_l2_and_loads_back_into_the_slab() {
    let dir = SlabDir::on_disk("l2");
    let l2 = SlabDir::on_disk("l2_fs");
    let adapter = format!(r#"{{"type":"fs","base_path":"{}"}}"#, l2.arg());
    let srv = start_on(&dir, &["--l2-adapter", &adapter]);
    let mut c = srv.client();
    let mut layer = worker(&mut c, 51);
    let toks = tokens(51);
    let stored: Vec<Vec<u8>> = (1..=3).map(|b| object(layer.bytes(), b)).collect();
    assert!(store(&mut c, &toks, &[1, 2, 3]));
    assert_eq!(c.call(OP_END_SESSION, &[s("store")]), None);
    wait_until("3 objects written behind from the slabs to fs", || {
        srv.get_json("/status")["storage_manager"]["l2_adapters"][0]["stored_object_count"] == 3
    });
    let mut files: Vec<Vec<u8>> = std::fs::read_dir(&l2.0)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".data"))
        .map(|e| std::fs::read(e.path()).unwrap())
        .collect();
    files.sort();
    let mut want = stored.clone();
    want.sort();
    assert_eq!(files, want, "L2 holds the objects byte for byte");

    // An empty L1: the lookup loads from L2 into the slabs, the retrieve reads them.
    let (st, body) = srv.http("POST", "/cache/clear", None);
    assert_eq!(st, 200, "{body}");
    assert_eq!(srv.l1_count("total_object_count"), 0);
    for b in 5..=7 {
        for plane in 0..2 {
            layer.bytes_mut()[block_range(plane, b)].fill(0);
        }
    }
    assert_eq!(lookup(&mut c, &toks, "read"), 3, "every chunk hits from L2");
    assert!(retrieve(&mut c, &toks, "read", &[5, 6, 7]));
    for (i, b) in (5..=7).enumerate() {
        assert!(
            object(layer.bytes(), b) == stored[i],
            "chunk {i} loaded from L2 through the slab differs from what was stored"
        );
    }
    assert_eq!(
        srv.metric("lmcache_mp_l2_prefetch_load_completed_chunks_total", &[]),
        Some(3.0)
    );
}
