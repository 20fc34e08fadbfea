//! The L2 tier on the real disk, each figure beside a baseline measured in the
//! same run:
//!
//! 1. `FsAdapter` store/load throughput of 64 x 4 MiB objects with O_DIRECT
//!    next to a raw io_uring O_DIRECT write/read of the same sizes and buffers.
//! 2. Warm L2 prefetch of a 2048-token request through the real server (L1
//!    empty and pre-faulted, so on huge pages where the kernel allows them;
//!    8 x 4 MiB chunks loaded from fs) next to an io_uring O_DIRECT read of the
//!    same 8 files, all in flight, from this process into huge-page heap
//!    buffers (the disk's ceiling for that request). Also shown: the same read
//!    into a shm segment of base pages, and plain pread one file at a time.
//! 3. L1-hit lookup + retrieve latency while the server writes >= 1 GiB behind
//!    to fs, next to the same loop with no flush running and the same loop
//!    while this process writes as many bytes to a file itself. Both servers
//!    pre-fault L1 (`--no-l1-use-lazy`, as recommended with an L2: stores
//!    then never wait on page faults).
//! 4. Redis: `RespAdapter` (flavor resp, num_workers 8, one shard, on a
//!    glommio executor) storing batches of N objects into one local
//!    `redis-server` the bench starts (loopback, `--save "" --appendonly no`,
//!    no maxmemory, default io-threads) and loading them back into other
//!    buffers: 4 MiB and 32 MiB objects (the 256-token chunks of a 32-layer
//!    fp16 model with 1 and 8 KV heads of 128), 1, 8 and 64 in flight, at
//!    least 2 GiB each way per cell. GB/s and client CPU s/GB (getrusage of
//!    this process over the timed calls; redis-server's CPU is not counted) next
//!    to lmcache 0.5.6's own resp adapter on the same objects in the same run
//!    (`common/resp_lmcache_bench.py`, run by the venv at
//!    `$KVSHARD_COMPAT_VENV` or `~/.cache/kvshard/lmcache-0.5.6` that
//!    `tools/compat/run.sh` installs; skipped, saying why, without it) and
//!    `redis-benchmark -P 1 -c N` (SET and GET as two runs, each with its own
//!    CPU from getrusage of children). Prints whether the bars hold (>= 2x
//!    lmcache's GB/s at <= half its CPU per GB; >= 0.8x redis-benchmark's)
//!    without asserting them; the loaded bytes are asserted.
//!
//! Sections 2 and 3 print whether L1 got huge pages: O_DIRECT into scattered
//! base pages is split into many more disk requests (on this kind of VM a
//! 4 MiB read into base pages runs at a third of the speed), so the prefetch
//! figure is only meaningful with `/dev/shm` mounted `huge=advise`.
//!
//! `cargo bench --bench l2` runs the full sizes; under `cargo test` (no
//! `--bench` argument) it runs tiny sizes and a few iterations, still checking
//! the bytes (section 4: 64 KiB objects, 1 and 8 in flight, without its two
//! baselines). `KVSHARD_BENCH_ONLY=2` runs one part; in section 4,
//! `KVSHARD_BENCH_INFLIGHT=64` (a comma list) runs only those columns and
//! `KVSHARD_BENCH_BASELINES=0` leaves the baselines out. Files live in
//! `target/l2-bench-<pid>` (on the real disk, not tmpfs, so O_DIRECT means
//! something); with `KVSHARD_BENCH_DIR` set, the `l2-bench-<pid>` directory is
//! made there instead. It is removed at the end.

#[path = "common/bench_dir.rs"]
mod bench_dir;
#[path = "common/pattern.rs"]
mod pattern;
#[path = "common/raw_direct.rs"]
mod raw_direct;
#[path = "../tests/support/mod.rs"]
mod support;

use std::alloc::Layout;
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench_dir::BenchDir;
use hdrhistogram::Histogram;
use io_uring::IoUring;
use kvshard_engine::keys::{Name, ObjectKey};
use kvshard_engine::l2::config::{FsConfig, RespConfig, RespFlavor};
use kvshard_engine::l2::fs::FsAdapter;
use kvshard_engine::l2::resp::RespAdapter;
use kvshard_engine::l2::{L2Adapter, ObjectBytes, StoreResult};
use pattern::fill;
use raw_direct::{raw_direct, RawOp};
use support::*;

const ALIGN: usize = 4096;
const CHUNK_TOKENS: usize = 256;
const REQ_CHUNKS: usize = 8;
const REQ_TOKENS: usize = CHUNK_TOKENS * REQ_CHUNKS;
const MODEL: &str = "l2bench";
/// Transfers in flight in the raw io_uring baseline (as the adapter's ring).
const RAW_DEPTH: usize = 32;
/// Section 4: bytes each way per (size, in flight) cell at full size.
const REDIS_CELL_BYTES: usize = 2 << 30;

// ------------------------------------------------------------------ helpers

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds")
}

fn report(name: &str, h: &Histogram<u64>) {
    println!(
        "{name:<44} n={:<5} p50={:>9.1}us p99={:>9.1}us max={:>9.1}us",
        h.len(),
        h.value_at_quantile(0.5) as f64 / 1e3,
        h.value_at_quantile(0.99) as f64 / 1e3,
        h.max() as f64 / 1e3,
    );
}

fn p50_ratio(a: &Histogram<u64>, b: &Histogram<u64>) -> f64 {
    a.value_at_quantile(0.5) as f64 / b.value_at_quantile(0.5) as f64
}

fn p99_ratio(a: &Histogram<u64>, b: &Histogram<u64>) -> f64 {
    a.value_at_quantile(0.99) as f64 / b.value_at_quantile(0.99) as f64
}

/// Alignment of bench buffers: 2 MiB, so that transparent huge pages can back
/// them and a baseline read lands in physically contiguous memory (the disk's
/// ceiling, not the scatter of 4 KiB pages).
const BUF_ALIGN: usize = 2 << 20;

/// A heap buffer aligned for O_DIRECT, on transparent huge pages where the
/// kernel allows them.
struct Aligned {
    ptr: *mut u8,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        assert!(len > 0 && len % ALIGN == 0);
        let layout = Layout::from_size_align(len, BUF_ALIGN).unwrap();
        // SAFETY: non-zero size; checked for null below.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null(), "out of memory allocating {len} bytes");
        // Advise before the first touch; a refusal only means base pages.
        // SAFETY: the range is exactly this allocation.
        unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
        // SAFETY: `len` bytes were just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Aligned { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated and initialised by `zeroed`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// # Safety
    /// As [`ObjectBytes::new`]: `self` outlives, and nobody else touches it
    /// during, every adapter call that receives the view.
    unsafe fn view(&mut self) -> ObjectBytes {
        // SAFETY: the caller keeps the buffer alive and untouched for the
        // adapter calls.
        unsafe { ObjectBytes::from_mut_slice(self.bytes_mut()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr,
                Layout::from_size_align(self.len, BUF_ALIGN).unwrap(),
            )
        };
    }
}

/// Writes (`write`) or reads each `paths[i]` whole from/into `bufs[i]` with
/// O_DIRECT through `ring`, `RAW_DEPTH` transfers in flight. Open and close are
/// part of the work, as they are in the adapter.
fn raw_uring(ring: &mut IoUring, paths: &[PathBuf], bufs: &mut [&mut [u8]], write: bool) {
    let files: Vec<File> = paths
        .iter()
        .map(|p| {
            let mut o = OpenOptions::new();
            if write {
                o.write(true).create(true).truncate(true).mode(0o644);
            } else {
                o.read(true);
            }
            o.custom_flags(libc::O_DIRECT)
                .open(p)
                .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", p.display()))
        })
        .collect();
    let mut ops: Vec<RawOp<'_>> = files
        .iter()
        .zip(bufs.iter_mut())
        .map(|(f, buf)| RawOp {
            fd: f.as_raw_fd(),
            offset: 0,
            buf: &mut buf[..],
        })
        .collect();
    raw_direct(ring, &mut ops, write, RAW_DEPTH);
    drop(files);
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_nanos() as f64
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s[s.len() / 2]
}

fn glommio_run<T>(f: impl std::future::Future<Output = T>) -> T {
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .io_memory(512 * 1024)
        .make()
        .expect("glommio executor")
        .run(f)
}

// ------------------------------------------------- 1. fs adapter vs raw disk

fn object_key(round: usize, i: usize) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&(round as u64).to_le_bytes());
    h[8..16].copy_from_slice(&(i as u64).to_le_bytes());
    h[31] = 0xb5;
    ObjectKey {
        chunk_hash: h,
        model_name: Name::intern(MODEL).unwrap(),
        kv_rank: 0,
        object_group_id: 0,
        cache_salt: Name::EMPTY,
    }
}

fn adapter_throughput(dir: &Path, n_obj: usize, obj: usize, rounds: usize) {
    println!(
        "== 1. FsAdapter (use_odirect) store/load of {n_obj} x {} KiB vs the disk's ceiling: raw io_uring \
         O_DIRECT write/read of the same sizes and buffers, {RAW_DEPTH} in flight (open+close timed in both; \
         median of {rounds} alternating rounds) in {}",
        obj >> 10,
        dir.display()
    );
    let fs_dir = dir.join("adapter");
    let raw_dir = dir.join("raw");
    fs::create_dir_all(&raw_dir).unwrap();
    let mut src: Vec<Aligned> = (0..n_obj)
        .map(|i| {
            let mut b = Aligned::zeroed(obj);
            fill(b.bytes_mut(), 0x1000 + i as u64);
            b
        })
        .collect();
    let mut dst: Vec<Aligned> = (0..n_obj).map(|_| Aligned::zeroed(obj)).collect();
    let total = n_obj * obj;
    let cfg = FsConfig {
        base_path: fs_dir.to_str().unwrap().to_owned(),
        relative_tmp_dir: None,
        read_ahead_size: None,
        use_odirect: true,
        max_capacity_gb: 0.0,
    };
    let (store, load, write, read) = glommio_run(async move {
        let adapter = FsAdapter::new(&cfg, 0, 1).expect("fs adapter");
        let mut ring = IoUring::new(RAW_DEPTH as u32).expect("io_uring");
        let (mut store, mut load, mut write, mut read) = (vec![], vec![], vec![], vec![]);
        for round in 0..rounds {
            let keys: Vec<ObjectKey> = (0..n_obj).map(|i| object_key(round, i)).collect();
            let raw_paths: Vec<PathBuf> = (0..n_obj)
                .map(|i| raw_dir.join(format!("r{round}-{i}.raw")))
                .collect();
            // Alternate who goes first so drift of the disk (or of the
            // neighbours on this machine) does not favour one side.
            for step in 0..2 {
                if (round + step) % 2 == 0 {
                    let items: Vec<(ObjectKey, ObjectBytes)> = keys
                        .iter()
                        .cloned()
                        // SAFETY: `src` outlives the awaited store; nothing
                        // writes it meanwhile.
                        .zip(src.iter_mut().map(|b| unsafe { b.view() }))
                        .collect();
                    let t = Instant::now();
                    let res = adapter.store(&items).await;
                    store.push(gbps(total, t.elapsed()));
                    assert!(
                        res.iter().all(|r| *r == StoreResult::Stored(obj as u64)),
                        "store round {round}: {res:?}"
                    );
                    for b in dst.iter_mut() {
                        b.bytes_mut().fill(0);
                    }
                    let items: Vec<(ObjectKey, ObjectBytes)> = keys
                        .iter()
                        .cloned()
                        // SAFETY: `dst` outlives the awaited load; nothing
                        // else touches it meanwhile.
                        .zip(dst.iter_mut().map(|b| unsafe { b.view() }))
                        .collect();
                    let t = Instant::now();
                    let ok = adapter.load(&items).await;
                    load.push(gbps(total, t.elapsed()));
                    assert!(ok.iter().all(|x| *x), "load round {round}: {ok:?}");
                    if round == 0 {
                        for (i, (a, b)) in src.iter().zip(&dst).enumerate() {
                            assert!(a.bytes() == b.bytes(), "object {i}: loaded bytes differ");
                        }
                    }
                } else {
                    let t = Instant::now();
                    let mut bufs: Vec<&mut [u8]> = src.iter_mut().map(|b| b.bytes_mut()).collect();
                    raw_uring(&mut ring, &raw_paths, &mut bufs, true);
                    write.push(gbps(total, t.elapsed()));
                    let t = Instant::now();
                    let mut bufs: Vec<&mut [u8]> = dst.iter_mut().map(|b| b.bytes_mut()).collect();
                    raw_uring(&mut ring, &raw_paths, &mut bufs, false);
                    read.push(gbps(total, t.elapsed()));
                    if round == 0 {
                        for (i, (a, b)) in src.iter().zip(&dst).enumerate() {
                            assert!(a.bytes() == b.bytes(), "raw file {i}: read bytes differ");
                        }
                    }
                }
            }
            // Keep the disk footprint to one round.
            let freed = adapter.delete(&keys).await;
            assert!(freed.iter().all(|f| *f == Some(obj as u64)), "{freed:?}");
            for p in &raw_paths {
                fs::remove_file(p).unwrap();
            }
        }
        (store, load, write, read)
    });
    let line = |name: &str, v: &[f64]| {
        let rounds: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
        println!(
            "{name:<44} median {:>6.2} GB/s  (rounds: {})",
            median(v),
            rounds.join(" ")
        );
    };
    line("fs store (FsAdapter::store, one batch)", &store);
    line("baseline: raw io_uring O_DIRECT write", &write);
    line("fs load (FsAdapter::load, one batch)", &load);
    line("baseline: raw io_uring O_DIRECT read", &read);
    println!(
        "fs store / raw write = {:.2}, fs load / raw read = {:.2}",
        median(&store) / median(&write),
        median(&load) / median(&read)
    );
}

// ------------------------------------------------------ server-side helpers

fn fs_adapter_json(dir: &Path) -> String {
    serde_json::json!({
        "type": "fs",
        "base_path": dir.to_str().unwrap(),
        "use_odirect": true,
    })
    .to_string()
}

/// A registered engine_driven worker and its mapping of the server's pool.
struct Worker {
    c: Client,
    pool: ShmMap,
    iid: i64,
    chunk_bytes: usize,
}

impl Worker {
    fn register(port: u16, iid: i64, layers: i64, hidden: i64) -> Worker {
        let mut c = Client::connect(port);
        let r = c
            .call(
                OP_REGISTER_ENGINE,
                &[engine_ctx_payload(
                    iid,
                    MODEL,
                    1,
                    layers,
                    hidden,
                    false,
                    CHUNK_TOKENS as i64,
                )],
            )
            .expect("register_engine reply");
        let name = r.get("shm_name").expect("shm_name").str().to_owned();
        let size = r.get("pool_size").expect("pool_size").int() as usize;
        Worker {
            c,
            pool: ShmMap::open(&name, size),
            iid,
            chunk_bytes: Self::chunk_bytes(layers, hidden),
        }
    }

    /// Bytes of one chunk: [2, layers, chunk, hidden] float16.
    fn chunk_bytes(layers: i64, hidden: i64) -> usize {
        (2 * layers * CHUNK_TOKENS as i64 * hidden * 2) as usize
    }

    fn key(&self, toks: &[u32], rid: &str, worker: bool) -> V {
        ipc_key(
            MODEL,
            1,
            worker.then_some(0),
            toks,
            0,
            REQ_TOKENS as i64,
            rid,
            1,
        )
    }

    /// Stores the request's 8 chunks, `fill(i, slot)` writing chunk `i`.
    fn store(&mut self, toks: &[u32], rid: &str, mut fill: impl FnMut(usize, &mut [u8])) {
        let key = self.key(toks, rid, true);
        let r = self
            .c
            .call(OP_PREPARE_STORE, &[key.clone(), V::I(self.iid)])
            .expect("prepare_store reply");
        let slots = ed_slots(&r);
        assert_eq!(
            slots.len(),
            REQ_CHUNKS,
            "prepare_store reserved every chunk"
        );
        for (i, slot) in slots.iter().enumerate() {
            let off = slot.get("offset").unwrap().int() as usize;
            let len = slot.get("length").unwrap().int() as usize;
            assert_eq!(len, self.chunk_bytes, "slot length");
            fill(i, &mut self.pool.bytes_mut()[off..off + len]);
        }
        assert_eq!(
            self.c
                .call(OP_COMMIT_STORE, &[key, V::I(self.iid), V::Bin(vec![])]),
            Some(V::B(true)),
            "commit_store"
        );
        self.c.call(OP_END_SESSION, &[s(rid)]);
    }

    /// LOOKUP and WAIT_PREFETCH_STATUS: the hit chunks.
    fn lookup_wait(&mut self, toks: &[u32], rid: &str) -> i64 {
        assert_eq!(
            self.c
                .call(OP_LOOKUP, &[self.key(toks, rid, false), V::I(1)]),
            None,
            "lookup ack"
        );
        self.c
            .call(OP_WAIT_PREFETCH_STATUS, &[s(rid), V::F(30.0)])
            .expect("wait_prefetch_status answers the hits")
            .int()
    }

    /// PREPARE_RETRIEVE + COMMIT_RETRIEVE; with `copy`, the slots' bytes.
    fn retrieve(&mut self, toks: &[u32], rid: &str, copy: bool) -> Vec<Vec<u8>> {
        let key = self.key(toks, rid, true);
        let r = self
            .c
            .call(OP_PREPARE_RETRIEVE, &[key.clone(), V::I(self.iid)])
            .expect("prepare_retrieve reply");
        assert_eq!(
            r.get("success"),
            Some(&V::B(true)),
            "prepare_retrieve: {r:?}"
        );
        let out = if copy {
            ed_slots(&r)
                .iter()
                .map(|slot| {
                    let off = slot.get("offset").unwrap().int() as usize;
                    let len = slot.get("length").unwrap().int() as usize;
                    self.pool.bytes()[off..off + len].to_vec()
                })
                .collect()
        } else {
            Vec::new()
        };
        assert_eq!(
            self.c.call(OP_COMMIT_RETRIEVE, &[key, V::I(self.iid)]),
            Some(V::B(true)),
            "commit_retrieve"
        );
        out
    }

    fn free_and_end(&mut self, toks: &[u32], rid: &str) {
        assert_eq!(
            self.c
                .call(OP_FREE_LOOKUP_LOCKS, &[self.key(toks, rid, false), V::I(1)]),
            None
        );
        self.c.call(OP_END_SESSION, &[s(rid)]);
    }
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn l1_objects(srv: &Server) -> u64 {
    srv.get_json("/status")["storage_manager"]["l1_manager"]["total_object_count"]
        .as_u64()
        .expect("total_object_count")
}

fn metric(srv: &Server, name: &str) -> f64 {
    srv.metric(name, &[])
        .unwrap_or_else(|| panic!("metric {name} not exposed"))
}

/// No L2 store is in flight or waiting for the in-flight budget.
fn l2_stores_settled(srv: &Server) -> bool {
    metric(srv, "lmcache_mp_num_inflight_l2_stores") == 0.0
        && metric(srv, "lmcache_mp_l2_store_completed_requests_total")
            == metric(srv, "lmcache_mp_l2_store_submitted_requests_total")
}

fn chunk_seed(req: u64, chunk: usize) -> u64 {
    req * 1_000 + chunk as u64
}

// ------------------------------------------------ 2. warm L2 prefetch latency

/// Reads each of `paths` whole into `bufs[i]` with O_DIRECT pread, one file
/// after another (open, pread, close each).
fn read_direct_pread(paths: &[PathBuf], bufs: &mut [&mut [u8]]) {
    for (p, b) in paths.iter().zip(bufs.iter_mut()) {
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(p)
            .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", p.display()));
        let mut done = 0;
        while done < b.len() {
            let n = f
                .read_at(&mut b[done..], done as u64)
                .unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            assert!(n > 0, "{} is short", p.display());
            done += n;
        }
    }
}

fn prefetch_latency(dir: &Path, layers: i64, hidden: i64, iters: usize, warmup: usize) {
    // A pre-faulted L1 (--no-l1-use-lazy) asks for transparent huge pages.
    let srv = Server::start(&[
        "--chunk-size",
        "256",
        "--l1-size-gb",
        "1",
        "--no-l1-use-lazy",
        "--eviction-policy",
        "noop",
        "--l2-store-policy",
        "skip_l1",
        "--l2-adapter",
        &fs_adapter_json(dir),
    ]);
    let mut w = Worker::register(srv.port, 1, layers, hidden);
    let chunk = w.chunk_bytes;
    let l1 = &srv.get_json("/status")["storage_manager"]["l1_manager"];
    println!(
        "(L1 pages: {}, {} of {} bytes on huge pages at start)",
        l1["huge_pages"], l1["huge_page_bytes_at_start"], l1["memory_configured_bytes"]
    );
    if l1["huge_page_bytes_at_start"].as_u64() == Some(0) {
        println!(
            "(L1 is on base pages: expect the prefetch to run at the speed of scattered-page DMA; \
             `mount -o remount,huge=advise /dev/shm` gives it huge pages)"
        );
    }
    println!(
        "== 2. warm L2 prefetch of {REQ_TOKENS} tokens ({REQ_CHUNKS} x {} KiB from fs, O_DIRECT, L1 empty): \
         LOOKUP -> WAIT_PREFETCH_STATUS == {REQ_CHUNKS}, vs this process reading the same {REQ_CHUNKS} files \
         with O_DIRECT through io_uring, all in flight, into aligned heap buffers (baseline: the disk's \
         ceiling for this request); also into a shm segment (the kind of memory L1 is) and with plain \
         pread one file after another",
        chunk >> 10
    );
    let toks = ed_tokens(0x12_0000, REQ_TOKENS);
    let mut stored = Vec::new();
    w.store(&toks, "store", |i, slot| {
        fill(slot, chunk_seed(1, i));
        stored.push(slot.to_vec());
    });
    wait_until(
        "skip_l1 to drop the stored chunks",
        Duration::from_secs(60),
        || l1_objects(&srv) == 0,
    );
    let mut paths: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "data"))
        .collect();
    paths.sort();
    assert_eq!(paths.len(), REQ_CHUNKS, "one file per chunk: {paths:?}");

    // Correctness: the L2-loaded bytes and the files equal what was stored.
    assert_eq!(w.lookup_wait(&toks, "check"), REQ_CHUNKS as i64);
    let back = w.retrieve(&toks, "check", true);
    assert!(
        back == stored,
        "bytes loaded from L2 differ from the bytes stored"
    );
    w.c.call(OP_END_SESSION, &[s("check")]);
    let mut heap: Vec<Aligned> = (0..REQ_CHUNKS).map(|_| Aligned::zeroed(chunk)).collect();
    let mut heap_bufs: Vec<&mut [u8]> = heap.iter_mut().map(|b| b.bytes_mut()).collect();
    let mut shm = ShmMap::create(&unique("kvshard_l2bench"), REQ_CHUNKS * chunk);
    // Fault the pages in up front, as L1's are.
    shm.bytes_mut().fill(0);
    let mut shm_bufs: Vec<&mut [u8]> = shm.bytes_mut().chunks_exact_mut(chunk).collect();
    let mut ring = IoUring::new(RAW_DEPTH as u32).expect("io_uring");
    for bufs in [&mut heap_bufs, &mut shm_bufs] {
        raw_uring(&mut ring, &paths, bufs, false);
        for (p, b) in paths.iter().zip(bufs.iter()) {
            assert!(
                stored.iter().any(|x| x[..] == **b),
                "{} holds bytes that were not stored",
                p.display()
            );
        }
    }

    let (mut hp, mut hr, mut hs, mut hq) = (hist(), hist(), hist(), hist());
    for i in 0..warmup + iters {
        wait_until("L1 to be empty again", Duration::from_secs(30), || {
            l1_objects(&srv) == 0
        });
        let rid = format!("p{i}");
        let record = |h: &mut Histogram<u64>, t: Instant| {
            let ns = t.elapsed().as_nanos() as u64;
            if i >= warmup {
                h.record(ns).unwrap();
            }
        };
        // Rotate the order so that drift of the disk favours no one.
        for step in 0..4 {
            match (i + step) % 4 {
                0 => {
                    let t = Instant::now();
                    let hits = w.lookup_wait(&toks, &rid);
                    record(&mut hp, t);
                    assert_eq!(
                        hits, REQ_CHUNKS as i64,
                        "iteration {i}: every chunk from L2"
                    );
                    w.free_and_end(&toks, &rid);
                }
                1 => {
                    let t = Instant::now();
                    raw_uring(&mut ring, &paths, &mut heap_bufs, false);
                    record(&mut hr, t);
                }
                2 => {
                    let t = Instant::now();
                    raw_uring(&mut ring, &paths, &mut shm_bufs, false);
                    record(&mut hs, t);
                }
                _ => {
                    let t = Instant::now();
                    read_direct_pread(&paths, &mut heap_bufs);
                    record(&mut hq, t);
                }
            }
        }
    }
    // Every timed lookup went to L2: nothing was served from a stale L1 copy.
    let loaded = metric(&srv, "lmcache_mp_l2_prefetch_load_completed_chunks_total");
    assert_eq!(
        loaded as usize,
        REQ_CHUNKS * (warmup + iters + 1),
        "chunks loaded from L2"
    );
    report("warm L2 prefetch (lookup -> result)", &hp);
    report("baseline: io_uring O_DIRECT into heap", &hr);
    report("(also: io_uring O_DIRECT into shm)", &hs);
    report("(also: O_DIRECT pread, one after another)", &hq);
    println!(
        "prefetch / raw io_uring into heap: p50 {:.2} (bar <= 1.2), p99 {:.2}; prefetch / raw into shm: \
         p50 {:.2}, p99 {:.2}; prefetch / sequential pread: p50 {:.2}",
        p50_ratio(&hp, &hr),
        p99_ratio(&hp, &hr),
        p50_ratio(&hp, &hs),
        p99_ratio(&hp, &hs),
        p50_ratio(&hp, &hq)
    );
}

// --------------------------------------- 3. L1 hits while an L2 flush runs

/// The measured request: an L1-hit lookup (+ wait) and a retrieve of `toks`.
struct HitLoop {
    w: Worker,
    toks: Vec<u32>,
    stored: Vec<Vec<u8>>,
    seq: usize,
}

impl HitLoop {
    /// Registers a worker on `srv`, stores the request's chunks and waits
    /// until `settled` says the server is quiet again.
    fn new(srv: &Server, layers: i64, hidden: i64, settled: impl Fn() -> bool) -> HitLoop {
        let mut w = Worker::register(srv.port, 1, layers, hidden);
        let toks = ed_tokens(0x13_0000, REQ_TOKENS);
        let mut stored = Vec::new();
        w.store(&toks, "store", |i, slot| {
            fill(slot, chunk_seed(2, i));
            stored.push(slot.to_vec());
        });
        wait_until(
            "the first request to settle",
            Duration::from_secs(60),
            settled,
        );
        std::thread::sleep(Duration::from_millis(200));
        let mut l = HitLoop {
            w,
            toks,
            stored,
            seq: 0,
        };
        l.check("check-before");
        l
    }

    fn one(&mut self, h: Option<&mut Histogram<u64>>) {
        let rid = format!("h{}", self.seq);
        self.seq += 1;
        let t = Instant::now();
        let hits = self.w.lookup_wait(&self.toks, &rid);
        assert_eq!(hits, REQ_CHUNKS as i64, "{rid}: L1 hit of every chunk");
        self.w.retrieve(&self.toks, &rid, false);
        let ns = t.elapsed().as_nanos() as u64;
        self.w.c.call(OP_END_SESSION, &[s(&rid)]);
        if let Some(h) = h {
            h.record(ns).unwrap();
        }
    }

    /// Runs the request until `done` holds; returns the histogram.
    fn until(&mut self, mut done: impl FnMut() -> bool) -> Histogram<u64> {
        let mut h = hist();
        let t0 = Instant::now();
        while !done() {
            self.one(Some(&mut h));
            assert!(
                t0.elapsed() < Duration::from_secs(300),
                "the background work did not finish in 5 minutes"
            );
        }
        h
    }

    fn check(&mut self, rid: &str) {
        assert_eq!(self.w.lookup_wait(&self.toks, rid), REQ_CHUNKS as i64);
        assert!(
            self.w.retrieve(&self.toks, rid, true) == self.stored,
            "retrieved bytes differ from the stored ones"
        );
        self.w.c.call(OP_END_SESSION, &[s(rid)]);
    }
}

/// A second client (own connection, own worker) storing `requests` requests
/// as fast as it can; sets `done` when its last store is committed.
fn spawn_storer(
    port: u16,
    layers: i64,
    hidden: i64,
    requests: usize,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Duration> {
    std::thread::spawn(move || {
        let mut w2 = Worker::register(port, 2, layers, hidden);
        let t = Instant::now();
        for r in 0..requests {
            let toks = ed_tokens(0x14_0000 + r as u32, REQ_TOKENS);
            w2.store(&toks, &format!("flush{r}"), |i, slot| {
                slot.fill((r * REQ_CHUNKS + i) as u8)
            });
        }
        let took = t.elapsed();
        done.store(true, Ordering::Release);
        took
    })
}

fn hit_latency_under_flush(
    dir: &Path,
    layers: i64,
    hidden: i64,
    iters: usize,
    flush_requests: usize,
) {
    let args = |l2: bool| {
        let mut a: Vec<String> = [
            "--chunk-size",
            "256",
            "--l1-size-gb",
            "2",
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
        ]
        .map(String::from)
        .to_vec();
        if l2 {
            a.extend(["--l2-store-inflight-gb".into(), "0.25".into()]);
            a.extend(["--l2-adapter".into(), fs_adapter_json(dir)]);
        }
        a
    };
    let req_bytes = REQ_CHUNKS * Worker::chunk_bytes(layers, hidden);
    let flush_bytes = flush_requests * req_bytes;
    println!(
        "== 3. L1-hit lookup+wait + prepare/commit retrieve of {REQ_TOKENS} tokens ({REQ_CHUNKS} x {} KiB), \
         alone (baseline); while this process writes {} MiB to a file with O_DIRECT (the machine's own \
         cost of that much disk writing); while a second client stores {} MiB into a server with no L2 \
         (the cost of serving the stores); and while the same client stores them into a server that \
         writes them behind to fs (O_DIRECT, --l2-store-inflight-gb 0.25): the flush",
        (req_bytes / REQ_CHUNKS) >> 10,
        flush_bytes >> 20,
        flush_bytes >> 20
    );

    // Server without L2: baseline, raw disk write, stores without a flush.
    let a = args(false);
    let plain = Server::start(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let mut lp = HitLoop::new(&plain, layers, hidden, || true);
    for _ in 0..iters / 10 {
        lp.one(None);
    }
    let mut ha = hist();
    for _ in 0..iters {
        lp.one(Some(&mut ha));
    }

    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (path, done) = (dir.join("raw-writer.bin"), done.clone());
        std::thread::spawn(move || {
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", path.display()));
            let mut buf = Aligned::zeroed(req_bytes);
            for r in 0..flush_requests {
                buf.bytes_mut().fill(r as u8);
                f.write_all_at(buf.bytes(), (r * req_bytes) as u64)
                    .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            }
            drop(f);
            let _ = fs::remove_file(&path);
            done.store(true, Ordering::Release);
        })
    };
    let hw = lp.until(|| done.load(Ordering::Acquire));
    writer.join().expect("raw writer thread");

    let done = Arc::new(AtomicBool::new(false));
    let storer = spawn_storer(plain.port, layers, hidden, flush_requests, done.clone());
    let hs = lp.until(|| done.load(Ordering::Acquire));
    let plain_store_took = storer.join().expect("storer thread");
    lp.check("check-after");
    drop(lp);
    drop(plain);

    // Server with the fs adapter: the flush.
    let a = args(true);
    let srv = Server::start(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let mut lf = HitLoop::new(&srv, layers, hidden, || l2_stores_settled(&srv));
    for _ in 0..iters / 10 {
        lf.one(None);
    }
    let done = Arc::new(AtomicBool::new(false));
    let storer = spawn_storer(srv.port, layers, hidden, flush_requests, done.clone());
    let t_flush = Instant::now();
    let mut last_poll = Instant::now();
    let hb = lf.until(|| {
        if done.load(Ordering::Acquire) && last_poll.elapsed() >= Duration::from_millis(50) {
            last_poll = Instant::now();
            return l2_stores_settled(&srv);
        }
        false
    });
    let flush_took = t_flush.elapsed();
    let store_took = storer.join().expect("storer thread");
    lf.check("check-after");
    let written = metric(&srv, "lmcache_mp_l2_store_completed_objects_chunks_total") as usize;
    assert_eq!(
        written,
        REQ_CHUNKS * (flush_requests + 1),
        "every stored chunk was written to L2"
    );

    let q = |h: &Histogram<u64>, x: f64| h.value_at_quantile(x) as f64;
    let ratios = |a: &Histogram<u64>, b: &Histogram<u64>| {
        format!(
            "p50 {:.2}, p90 {:.2}, p99 {:.2}",
            q(a, 0.5) / q(b, 0.5),
            q(a, 0.9) / q(b, 0.9),
            q(a, 0.99) / q(b, 0.99)
        )
    };
    report("L1 hit lookup+retrieve, alone (baseline)", &ha);
    report("  ... during a raw disk write", &hw);
    report("  ... during stores, no L2", &hs);
    report("  ... during stores + L2 flush", &hb);
    println!(
        "during flush / alone: {}; during flush / during stores with no L2: {}; during raw disk write / \
         alone: {}",
        ratios(&hb, &ha),
        ratios(&hb, &hs),
        ratios(&hw, &ha)
    );
    println!(
        "flush of {} MiB: client stores {:.2} s (into the server with no L2: {:.2} s), written behind \
         after {:.2} s ({:.2} GB/s)",
        flush_bytes >> 20,
        store_took.as_secs_f64(),
        plain_store_took.as_secs_f64(),
        flush_took.as_secs_f64(),
        gbps(flush_bytes, flush_took)
    );
}

// ------------------------------- 4. Redis: resp adapter vs lmcache and redis-benchmark

/// Bytes of one 256-token chunk of a 32-layer fp16 model with `kv_heads`
/// KV heads of 128: [2, 32, 256, heads * 128] float16.
fn redis_chunk_bytes(kv_heads: usize) -> usize {
    2 * 32 * CHUNK_TOKENS * 128 * 2 * kv_heads
}

/// Stride of the per-round spot check: 64 bytes every this many bytes.
const SPOT_STRIDE: usize = 1 << 20;

fn rusage_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, exclusively borrowed rusage.
    assert_eq!(unsafe { libc::getrusage(who, &mut ru) }, 0, "getrusage");
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// User + system CPU seconds of this whole process (every thread).
fn cpu_seconds() -> f64 {
    rusage_seconds(libc::RUSAGE_SELF)
}

/// Bytes moved one way, the wall time they took and the client CPU spent.
#[derive(Clone, Copy, Default)]
struct Moved {
    bytes: usize,
    secs: f64,
    cpu: f64,
}

impl Moved {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.secs
    }

    fn cpu_per_gb(&self) -> f64 {
        self.cpu / (self.bytes as f64 / 1e9)
    }

    fn add(&mut self, bytes: usize, t: Instant, cpu0: f64) {
        self.secs += t.elapsed().as_secs_f64();
        self.cpu += cpu_seconds() - cpu0;
        self.bytes += bytes;
    }
}

/// One cell's store (SET) and load (GET) figures.
#[derive(Clone, Copy)]
struct StoreLoad {
    store: Moved,
    load: Moved,
}

/// One cell of the matrix: `inflight` objects per batch, `rounds` batches.
#[derive(Clone, Copy)]
struct RedisCell {
    inflight: usize,
    rounds: usize,
}

/// The ranges the per-round spot check compares: both ends and 64 bytes
/// every [`SPOT_STRIDE`] (as `resp_lmcache_bench.py` does).
fn spot_ranges(size: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    [0..64, size - 64..size].into_iter().chain(
        (SPOT_STRIDE / 2..size.saturating_sub(64))
            .step_by(SPOT_STRIDE)
            .map(|o| o..o + 64),
    )
}

/// Marks object `i` of round `round` of cell `cell` at both ends, so a load
/// that returns another round's (or object's) bytes is caught by the spot
/// check.
fn tag_object(buf: &mut [u8], cell: usize, round: usize, i: usize) {
    let mut t = [0u8; 8];
    t[..2].copy_from_slice(&(cell as u16).to_le_bytes());
    t[2..4].copy_from_slice(&(i as u16).to_le_bytes());
    t[4..].copy_from_slice(&(round as u32).to_le_bytes());
    let n = buf.len();
    buf[..8].copy_from_slice(&t);
    buf[n - 8..].copy_from_slice(&t);
}

fn resp_config(port: u16) -> RespConfig {
    RespConfig {
        flavor: RespFlavor::Resp,
        nodes: vec![("127.0.0.1".to_owned(), port)],
        cluster_mode: false,
        username: None,
        password: None,
        key_prefix: String::new(),
        num_workers: 8,
        tls_enable: false,
        tls_ca_bundle: None,
        database_id: None,
        request_timeout_secs: 60.0,
        connection_timeout_secs: 10.0,
        max_capacity_gb: 0.0,
        ttl_seconds: None,
        breaker_initial_cooldown_s: 5.0,
        breaker_max_cooldown_s: 300.0,
    }
}

/// kvshard's `RespAdapter` (one shard) storing and loading every cell of
/// objects of `size` bytes, on one glommio executor.
///
/// The executor runs on a thread of its own: the sockets its rings still
/// hold when it ends are cancelled by the kernel on the ring's thread, which
/// can interrupt (EINTR) a blocking read that thread makes next, such as the
/// plain-socket commands `redis_throughput` sends between the runs.
fn kvshard_resp(port: u16, size: usize, cells: &[RedisCell]) -> Vec<StoreLoad> {
    let cells = cells.to_vec();
    std::thread::spawn(move || kvshard_resp_cells(port, size, &cells))
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

fn kvshard_resp_cells(port: u16, size: usize, cells: &[RedisCell]) -> Vec<StoreLoad> {
    let most = cells.iter().map(|c| c.inflight).max().unwrap();
    let mut src: Vec<Aligned> = (0..most)
        .map(|i| {
            let mut b = Aligned::zeroed(size);
            fill(b.bytes_mut(), 0x4000 + i as u64);
            b
        })
        .collect();
    let mut dst: Vec<Aligned> = (0..most).map(|_| Aligned::zeroed(size)).collect();
    glommio_run(async move {
        let adapter = RespAdapter::new(&resp_config(port), 0, 1).expect("resp adapter");
        // Open the connections before timing anything: one batch over all 8.
        let warm: Vec<ObjectKey> = (0..most.min(8))
            .map(|i| object_key(usize::MAX, i))
            .collect();
        let items: Vec<(ObjectKey, ObjectBytes)> = warm
            .iter()
            .cloned()
            // SAFETY: `src` outlives the awaited store; nothing writes it.
            .zip(src.iter_mut().map(|b| unsafe { b.view() }))
            .collect();
        let res = adapter.store(&items).await;
        assert!(
            res.iter().all(|r| *r == StoreResult::Stored(size as u64)),
            "warm-up store: {res:?}"
        );
        let items: Vec<(ObjectKey, ObjectBytes)> = warm
            .iter()
            .cloned()
            // SAFETY: `dst` outlives the awaited load; nothing else touches it.
            .zip(dst.iter_mut().map(|b| unsafe { b.view() }))
            .collect();
        let ok = adapter.load(&items).await;
        assert!(ok.iter().all(|x| *x), "warm-up load: {ok:?}");
        let freed = adapter.delete(&warm).await;
        assert!(
            freed.iter().all(|f| f.is_some()),
            "warm-up delete: {freed:?}"
        );

        let mut out = Vec::new();
        for (c, cell) in cells.iter().enumerate() {
            let n = cell.inflight;
            let (mut store, mut load) = (Moved::default(), Moved::default());
            for b in &mut dst[..n] {
                b.bytes_mut().fill(0);
            }
            for round in 0..cell.rounds {
                let keys: Vec<ObjectKey> =
                    (0..n).map(|i| object_key((c << 32) | round, i)).collect();
                for (i, (s, d)) in src.iter_mut().zip(dst.iter_mut()).take(n).enumerate() {
                    tag_object(s.bytes_mut(), c, round, i);
                    for r in spot_ranges(size) {
                        d.bytes_mut()[r].fill(0);
                    }
                }
                let items: Vec<(ObjectKey, ObjectBytes)> = keys
                    .iter()
                    .cloned()
                    // SAFETY: `src` outlives the awaited store; nothing
                    // writes it meanwhile.
                    .zip(src.iter_mut().map(|b| unsafe { b.view() }))
                    .collect();
                let (cpu0, t) = (cpu_seconds(), Instant::now());
                let res = adapter.store(&items).await;
                store.add(n * size, t, cpu0);
                assert!(
                    res.iter().all(|r| *r == StoreResult::Stored(size as u64)),
                    "{n} in flight, store round {round}: {res:?}"
                );
                let items: Vec<(ObjectKey, ObjectBytes)> = keys
                    .iter()
                    .cloned()
                    // SAFETY: `dst` outlives the awaited load; nothing else
                    // touches it meanwhile.
                    .zip(dst.iter_mut().map(|b| unsafe { b.view() }))
                    .collect();
                let (cpu0, t) = (cpu_seconds(), Instant::now());
                let ok = adapter.load(&items).await;
                load.add(n * size, t, cpu0);
                assert!(
                    ok.iter().all(|x| *x),
                    "{n} in flight, load round {round}: {ok:?}"
                );
                for (i, (s, d)) in src.iter().zip(&dst).take(n).enumerate() {
                    for r in spot_ranges(size) {
                        assert!(
                            s.bytes()[r.clone()] == d.bytes()[r.clone()],
                            "{n} in flight, round {round}, object {i}: loaded bytes {r:?} differ"
                        );
                    }
                    if round == 0 {
                        assert!(
                            s.bytes() == d.bytes(),
                            "{n} in flight, object {i}: loaded bytes differ"
                        );
                    }
                }
                // Keep the server's footprint to one batch.
                let freed = adapter.delete(&keys).await;
                assert!(freed.iter().all(|f| *f == Some(size as u64)), "{freed:?}");
            }
            out.push(StoreLoad { store, load });
        }
        out
    })
}

/// The lmcache 0.5.6 virtualenv's python, or why there is none.
fn lmcache_python() -> Result<String, String> {
    let venv = match std::env::var("KVSHARD_COMPAT_VENV") {
        Ok(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(std::env::var("HOME").map_err(|_| "HOME is not set".to_owned())?)
            .join(".cache/kvshard/lmcache-0.5.6"),
    };
    let python = venv.join("bin/python");
    if !python.exists() {
        return Err(format!(
            "no lmcache 0.5.6 virtualenv at {} (tools/compat/run.sh installs it; KVSHARD_COMPAT_VENV \
             names another)",
            venv.display()
        ));
    }
    let probe = std::process::Command::new(&python)
        .args(["-c", "import lmcache.lmcache_redis, numpy"])
        .env("LMCACHE_DISABLE_BANNER", "1")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !probe.status.success() {
        let err = String::from_utf8_lossy(&probe.stderr);
        return Err(format!(
            "{} cannot import lmcache.lmcache_redis: {}",
            python.display(),
            err.lines().last().unwrap_or("").trim()
        ));
    }
    Ok(python.to_str().unwrap().to_owned())
}

/// lmcache 0.5.6's resp adapter on the same cells, as its own process
/// (`common/resp_lmcache_bench.py`) reports them.
fn lmcache_resp(python: &str, port: u16, size: usize, cells: &[RedisCell]) -> Vec<StoreLoad> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/common/resp_lmcache_bench.py"
    );
    let spec: Vec<String> = cells
        .iter()
        .map(|c| format!("{}:{}", c.inflight, c.rounds))
        .collect();
    let out = std::process::Command::new(python)
        .arg(script)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--num-workers",
            "8",
        ])
        .args(["--size", &size.to_string(), "--cells", &spec.join(",")])
        .env("LMCACHE_DISABLE_BANNER", "1")
        .output()
        .expect("run resp_lmcache_bench.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "resp_lmcache_bench.py failed ({}): {}{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .expect("a JSON line");
    let v: serde_json::Value = serde_json::from_str(line).expect("resp_lmcache_bench.py's JSON");
    assert_eq!(v["size"].as_u64(), Some(size as u64), "{v}");
    let got = v["cells"].as_array().expect("cells");
    assert_eq!(got.len(), cells.len(), "{v}");
    got.iter()
        .zip(cells)
        .map(|(g, c)| {
            assert_eq!(g["inflight"].as_u64(), Some(c.inflight as u64), "{g}");
            assert_eq!(g["verified"], true, "lmcache's loaded bytes: {g}");
            let bytes = g["bytes"].as_u64().unwrap() as usize;
            assert_eq!(bytes, c.inflight * c.rounds * size, "{g}");
            let f = |k: &str| g[k].as_f64().unwrap_or_else(|| panic!("{k} in {g}"));
            StoreLoad {
                store: Moved {
                    bytes,
                    secs: f("store_seconds"),
                    cpu: f("store_cpu_seconds"),
                },
                load: Moved {
                    bytes,
                    secs: f("load_seconds"),
                    cpu: f("load_cpu_seconds"),
                },
            }
        })
        .collect()
}

/// One `redis-benchmark -t <test>` run: its requests/s times `size`, and
/// its CPU (getrusage of children around it).
fn redis_benchmark(
    bin: &Path,
    port: u16,
    test: &str,
    size: usize,
    clients: usize,
    count: usize,
) -> Moved {
    let cpu0 = rusage_seconds(libc::RUSAGE_CHILDREN);
    let out = std::process::Command::new(bin)
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", test])
        .args(["-d", &size.to_string(), "-n", &count.to_string(), "-P", "1"])
        .args(["-c", &clients.to_string(), "--csv"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run redis-benchmark");
    let cpu = rusage_seconds(libc::RUSAGE_CHILDREN) - cpu0;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "redis-benchmark -t {test} failed ({}): {}{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let want = format!("\"{}\"", test.to_uppercase());
    let rps: f64 = stdout
        .lines()
        .find_map(|l| {
            let mut f = l.split(',');
            (f.next() == Some(want.as_str()))
                .then(|| f.next().unwrap().trim_matches('"').parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {want} line in redis-benchmark's output: {stdout}"));
    let bytes = count * size;
    Moved {
        bytes,
        secs: count as f64 / rps,
        cpu,
    }
}

/// redis-benchmark's SET then GET of `size`-byte values on every cell, the
/// in-flight count as its clients, as many requests as the adapters move.
fn redis_benchmark_cells(
    bin: &Path,
    srv: &RedisServer,
    size: usize,
    cells: &[RedisCell],
) -> Vec<StoreLoad> {
    cells
        .iter()
        .map(|c| {
            let count = c.inflight * c.rounds;
            let store = redis_benchmark(bin, srv.port, "set", size, c.inflight, count);
            // It really sent `size` bytes (its -d is capped at 1 GiB).
            assert_eq!(
                srv.command(&["STRLEN", "key:__rand_int__"]),
                size.to_string(),
                "redis-benchmark -d"
            );
            let load = redis_benchmark(bin, srv.port, "get", size, c.inflight, count);
            srv.command(&["DEL", "key:__rand_int__"]);
            StoreLoad { store, load }
        })
        .collect()
}

/// Whether kvshard's figure `k` clears the bars against lmcache's `l`
/// (>= 2x the throughput at <= half the CPU per GB) and redis-benchmark's
/// `r` (>= 0.8x the throughput).
fn bar_lmcache(k: &Moved, l: &Moved) -> bool {
    k.gbps() >= 2.0 * l.gbps() && k.cpu_per_gb() <= 0.5 * l.cpu_per_gb()
}

fn bar_redis_benchmark(k: &Moved, r: &Moved) -> bool {
    k.gbps() >= 0.8 * r.gbps()
}

fn size_label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn redis_throughput(
    sizes: &[(usize, &str)],
    inflight: &[usize],
    cell_bytes: usize,
    baselines: bool,
) {
    let srv = RedisServer::start(&[]);
    let version = srv
        .command(&["INFO", "server"])
        .lines()
        .find_map(|l| {
            l.strip_prefix("redis_version:")
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_default();
    let python = if baselines {
        lmcache_python()
    } else {
        Err("left out (a smoke run under cargo test, or KVSHARD_BENCH_BASELINES=0)".to_owned())
    };
    let rb_bin = redis_bin_dir().join("redis-benchmark");
    let rb = if !baselines {
        Err("left out (a smoke run under cargo test, or KVSHARD_BENCH_BASELINES=0)".to_owned())
    } else if rb_bin.exists() {
        Ok(rb_bin)
    } else {
        Err(format!("no {} (Debian's redis-tools)", rb_bin.display()))
    };
    println!(
        "== 4. Redis {version} on loopback (one redis-server: --save \"\" --appendonly no, no maxmemory, default \
         io-threads): store N objects in one batch, then load them back into other buffers, N in flight, batches \
         repeated to move >= {} each way per cell (at least 2 batches); bytes checked every batch at both ends \
         and a 1 MiB stride, whole in the first. kvshard: RespAdapter (resp, num_workers 8, one shard, glommio). \
         Baselines: lmcache 0.5.6's resp adapter (NativeConnectorL2Adapter over LMCacheRedisClient, num_workers 8, \
         submit + poll on its eventfd as its storage controllers do), and redis-benchmark -t set / -t get -d SIZE \
         -P 1 -c N with as many requests. GB/s = 1e9 bytes/s; CPU = client user+sys s per GB (getrusage; \
         redis-server's CPU is not counted)",
        size_label(cell_bytes)
    );
    if let Err(why) = &python {
        println!("(lmcache baseline skipped: {why})");
    }
    if let Err(why) = &rb {
        println!("(redis-benchmark baseline skipped: {why})");
    }
    let mut misses: Vec<String> = Vec::new();
    let (mut bar1, mut bar2) = ((0, 0), (0, 0));
    for &(size, what) in sizes {
        let cells: Vec<RedisCell> = inflight
            .iter()
            .map(|&n| RedisCell {
                inflight: n,
                rounds: cell_bytes.div_ceil(n * size).max(2),
            })
            .collect();
        let kv = kvshard_resp(srv.port, size, &cells);
        assert_eq!(srv.command(&["DBSIZE"]), "0", "kvshard left keys behind");
        let lm = python
            .as_ref()
            .ok()
            .map(|py| lmcache_resp(py, srv.port, size, &cells));
        assert_eq!(srv.command(&["DBSIZE"]), "0", "lmcache left keys behind");
        let rbf = rb
            .as_ref()
            .ok()
            .map(|b| redis_benchmark_cells(b, &srv, size, &cells));
        let fig = |v: Option<f64>| v.map_or_else(|| format!("{:>6}", "-"), |x| format!("{x:>6.2}"));
        let ratio =
            |v: Option<f64>| v.map_or_else(|| format!("{:>5}", "-"), |x| format!("{x:>5.2}"));
        println!("-- {} objects ({what})", size_label(size));
        println!(
            "{:>8} | {:^13} | {:^13} | {:^13} | {:^11} | {:^11} | {:^41}",
            "",
            "kvshard GB/s",
            "lmcache GB/s",
            "redis-bench",
            "kv/lmcache",
            "kv/redis-b",
            "client CPU s/GB"
        );
        println!(
            "{:>8} | {:>6} {:>6} | {:>6} {:>6} | {:>6} {:>6} | {:>5} {:>5} | {:>5} {:>5} | {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
            "inflight", "store", "load", "store", "load", "set", "get", "store", "load", "store", "load",
            "kv st", "kv ld", "lm st", "lm ld", "rb set", "rb get"
        );
        for (j, c) in cells.iter().enumerate() {
            let k = &kv[j];
            let l = lm.as_ref().map(|v| v[j]);
            let r = rbf.as_ref().map(|v| v[j]);
            println!(
                "{:>8} | {} {} | {} {} | {} {} | {} {} | {} {} | {} {} {} {} {} {}",
                c.inflight,
                fig(Some(k.store.gbps())),
                fig(Some(k.load.gbps())),
                fig(l.map(|l| l.store.gbps())),
                fig(l.map(|l| l.load.gbps())),
                fig(r.map(|r| r.store.gbps())),
                fig(r.map(|r| r.load.gbps())),
                ratio(l.map(|l| k.store.gbps() / l.store.gbps())),
                ratio(l.map(|l| k.load.gbps() / l.load.gbps())),
                ratio(r.map(|r| k.store.gbps() / r.store.gbps())),
                ratio(r.map(|r| k.load.gbps() / r.load.gbps())),
                fig(Some(k.store.cpu_per_gb())),
                fig(Some(k.load.cpu_per_gb())),
                fig(l.map(|l| l.store.cpu_per_gb())),
                fig(l.map(|l| l.load.cpu_per_gb())),
                fig(r.map(|r| r.store.cpu_per_gb())),
                fig(r.map(|r| r.load.cpu_per_gb())),
            );
            for (op, km, lm, rm) in [
                ("store", k.store, l.map(|l| l.store), r.map(|r| r.store)),
                ("load", k.load, l.map(|l| l.load), r.map(|r| r.load)),
            ] {
                let at = format!("{} x {} {op}", size_label(size), c.inflight);
                if let Some(lm) = lm {
                    bar1.1 += 1;
                    if bar_lmcache(&km, &lm) {
                        bar1.0 += 1;
                    } else {
                        misses.push(format!(
                            "bar 1 misses at {at}: {:.2}x lmcache's GB/s at {:.2}x its CPU/GB",
                            km.gbps() / lm.gbps(),
                            km.cpu_per_gb() / lm.cpu_per_gb()
                        ));
                    }
                }
                if let Some(rm) = rm {
                    bar2.1 += 1;
                    if bar_redis_benchmark(&km, &rm) {
                        bar2.0 += 1;
                    } else {
                        misses.push(format!(
                            "bar 2 misses at {at}: {:.2}x redis-benchmark's GB/s",
                            km.gbps() / rm.gbps()
                        ));
                    }
                }
            }
        }
    }
    let verdict = |(ok, all): (usize, usize)| match (ok, all) {
        (_, 0) => "not measured (baseline skipped)".to_owned(),
        (ok, all) if ok == all => format!("holds ({ok} of {all} cells x directions)"),
        (ok, all) => format!("does not hold ({ok} of {all} cells x directions)"),
    };
    println!(
        "bar 1, kvshard >= 2x lmcache 0.5.6's GB/s at <= 0.5x its client CPU s/GB: {}",
        verdict(bar1)
    );
    println!(
        "bar 2, kvshard >= 0.8x redis-benchmark's GB/s: {}",
        verdict(bar2)
    );
    for m in &misses {
        println!("  {m}");
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run under cargo test: debug build, tiny sizes, few iterations; figures come from `cargo bench`)");
    }
    let dir = BenchDir::new("l2-bench");
    let t0 = Instant::now();
    if full {
        // 8 layers x hidden 512: one 256-token chunk is 4 MiB.
        let only = std::env::var("KVSHARD_BENCH_ONLY").unwrap_or_default();
        if only.is_empty() || only == "1" {
            adapter_throughput(&dir.sub("s1"), 64, 4 << 20, 3);
        }
        if only.is_empty() || only == "2" {
            prefetch_latency(&dir.sub("s2"), 8, 512, 100, 5);
        }
        if only.is_empty() || only == "3" {
            hit_latency_under_flush(&dir.sub("s3"), 8, 512, 1000, 32);
        }
        if only.is_empty() || only == "4" {
            let inflight: Vec<usize> = match std::env::var("KVSHARD_BENCH_INFLIGHT") {
                Ok(v) => v
                    .split(',')
                    .map(|n| n.trim().parse().expect("KVSHARD_BENCH_INFLIGHT: numbers"))
                    .collect(),
                Err(_) => vec![1, 8, 64],
            };
            let baselines = std::env::var("KVSHARD_BENCH_BASELINES").as_deref() != Ok("0");
            redis_throughput(
                &[
                    (
                        redis_chunk_bytes(1),
                        "32 layers x 1 KV head of 128, 256 tokens, fp16",
                    ),
                    (
                        redis_chunk_bytes(8),
                        "32 layers x 8 KV heads of 128, 256 tokens, fp16",
                    ),
                ],
                &inflight,
                REDIS_CELL_BYTES,
                baselines,
            );
        }
    } else {
        // 1 layer x hidden 64: 64 KiB chunks, still O_DIRECT-aligned.
        adapter_throughput(&dir.sub("s1"), 4, 64 << 10, 3);
        prefetch_latency(&dir.sub("s2"), 1, 64, 3, 1);
        hit_latency_under_flush(&dir.sub("s3"), 1, 64, 5, 2);
        // 64 KiB objects, 4 batches each; the baselines are left out.
        redis_throughput(&[(64 << 10, "smoke size")], &[1, 8], 256 << 10, false);
    }
    println!("(whole run {:.1} s)", t0.elapsed().as_secs_f64());
}
