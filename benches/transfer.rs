//! Transfer paths, each beside a baseline measured in the same run:
//!
//! 1. cpu_shm gather/scatter bandwidth next to a single-thread memcpy of the
//!    same bytes (the bar: >= 50% of memcpy). Layout of `lmcache bench
//!    server`'s default KV cache: 32 layers of [2, blocks, 16, 8, 128]
//!    float16; one 256-token chunk is 32 MiB.
//! 2. The GDS L1 slab's O_DIRECT path (`GdsSlab::write_many`/`read_many`:
//!    pieces of <= 16 MiB, `RING_DEPTH` in flight) next to raw io_uring
//!    O_DIRECT (one request per object, the same number in flight) on a
//!    second preallocated file in the same directory, with the same objects,
//!    offsets and buffers (the bar: >= 70% of raw). Batch throughput and
//!    latency, and per-object latency one at a time, as hdrhistogram
//!    percentiles. Files live in `target/transfer-bench-<pid>` (on the disk,
//!    not tmpfs), or under `KVSHARD_BENCH_DIR`, and are removed at the end.
//!
//! `cargo bench --bench transfer` runs the full sizes; under `cargo test`
//! (no `--bench` argument) it runs tiny sizes and a few iterations, still
//! checking the bytes.

#[path = "common/bench_dir.rs"]
mod bench_dir;
#[path = "common/pattern.rs"]
mod pattern;
#[path = "common/raw_direct.rs"]
mod raw_direct;
#[path = "../tests/support/mod.rs"]
mod support;

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use bench_dir::BenchDir;
use hdrhistogram::Histogram;
use io_uring::IoUring;
use kvshard_gds::slab::{AlignedBuf, FsType, GdsSlab, SlabOptions, RING_DEPTH};
use kvshard_layout::ShmTensorSpec;
use kvshard_transport::cpu_shm::CpuShmRegistration;
use pattern::fill;
use raw_direct::{raw_direct, RawOp};

fn gbps(bytes: usize, ns: u64) -> f64 {
    bytes as f64 / ns as f64
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run under cargo test: debug build, few iterations; figures come from `cargo bench`)");
    }
    cpu_shm_vs_memcpy(full);
    slab_vs_raw_odirect(full);
}

// ------------------------------------------------ 1. cpu_shm vs memcpy

fn cpu_shm_vs_memcpy(full: bool) {
    println!("== 1. cpu_shm gather/scatter vs memcpy");
    let (layers, blocks, iters) = if full {
        (32usize, 1024usize, 60usize)
    } else {
        (2, 64, 3)
    };
    let (bs, heads, hs) = (16usize, 8usize, 128usize);
    let layer_bytes = 2 * blocks * bs * heads * hs * 2;
    let segs: Vec<(String, support::ShmMap)> = (0..layers)
        .map(|_| {
            let name = support::unique("kvshard_bench");
            let mut map = support::ShmMap::create(&name, layer_bytes);
            // Pre-fault so page faults stay out of the figures.
            map.bytes_mut().fill(0x5a);
            (name, map)
        })
        .collect();
    let specs: Vec<ShmTensorSpec> = segs
        .iter()
        .map(|(name, _)| ShmTensorSpec {
            shm_name: format!("/{name}"),
            nbytes: layer_bytes as u64,
            dtype: "float16".into(),
            shape: vec![2, blocks as i64, bs as i64, heads as i64, hs as i64],
            stride: vec![
                (blocks * bs * heads * hs) as i64,
                (bs * heads * hs) as i64,
                (heads * hs) as i64,
                hs as i64,
                1,
            ],
            storage_offset: 0,
        })
        .collect();
    let reg = CpuShmRegistration::open(&specs, &[], 256, Some("NHD"), 0).expect("register");
    let obj = reg.object_layout().bytes as usize;
    let bpc = reg.ids_per_chunk();
    let mut dst = vec![0u8; obj];
    let src = vec![0xa5u8; obj];
    let mut copy = vec![0u8; obj];
    copy.copy_from_slice(&src); // warm the destination

    // Scattered block ids, as a paged cache hands them out.
    let ids = |i: usize| -> Vec<i64> {
        (0..bpc)
            .map(|b| (((i * bpc + b) * 7 + 3) % blocks) as i64)
            .collect()
    };
    let mut hm = Histogram::<u64>::new(3).unwrap();
    let mut hg = Histogram::<u64>::new(3).unwrap();
    let mut hs_ = Histogram::<u64>::new(3).unwrap();
    for i in 0..iters {
        let t = Instant::now();
        copy.copy_from_slice(std::hint::black_box(&src));
        hm.record(t.elapsed().as_nanos() as u64).unwrap();
        let b = ids(i);
        let t = Instant::now();
        reg.gather(&b, &mut dst).expect("gather");
        hg.record(t.elapsed().as_nanos() as u64).unwrap();
        let t = Instant::now();
        reg.scatter(&dst, &b, 0).expect("scatter");
        hs_.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    let line = |name: &str, h: &Histogram<u64>| {
        println!(
            "{name:<24} chunk {obj:>9} B  p50 {:>6.2} GB/s  (p99 time {:>7.1} us)",
            gbps(obj, h.value_at_quantile(0.5)),
            h.value_at_quantile(0.99) as f64 / 1e3
        )
    };
    line("memcpy (baseline)", &hm);
    line("cpu_shm gather", &hg);
    line("cpu_shm scatter", &hs_);
    let m = gbps(obj, hm.value_at_quantile(0.5));
    println!(
        "gather/memcpy = {:.2}, scatter/memcpy = {:.2}",
        gbps(obj, hg.value_at_quantile(0.5)) / m,
        gbps(obj, hs_.value_at_quantile(0.5)) / m
    );
}

// ------------------------------------- 2. GDS slab vs raw O_DIRECT

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds")
}

/// Bytes that differ per seed and per position.
fn filled(len: usize, seed: u64) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len);
    fill(&mut b, seed);
    b
}

/// The baseline's file: created, preallocated and reopened O_DIRECT as the
/// slab's is, so both write into allocated blocks.
fn raw_file(path: &Path, size: usize) -> File {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(path)
        .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    // SAFETY: an open descriptor.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, size as libc::off_t) };
    assert_eq!(r, 0, "posix_fallocate {}: errno {r}", path.display());
    drop(f);
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} O_DIRECT: {e}", path.display()))
}

/// Raw O_DIRECT: each `(offset, buffer)` of `file` as one request,
/// `RING_DEPTH` in flight.
fn raw_batch(ring: &mut IoUring, file: &File, ops: &mut [(u64, &mut [u8])], write: bool) {
    let fd = file.as_raw_fd();
    let mut raw: Vec<RawOp<'_>> = ops
        .iter_mut()
        .map(|(offset, buf)| RawOp {
            fd,
            offset: *offset,
            buf: &mut buf[..],
        })
        .collect();
    raw_direct(ring, &mut raw, write, RING_DEPTH);
}

fn slab_vs_raw_odirect(full: bool) {
    let dir = BenchDir::new("transfer-bench");
    let fs_type = FsType::of(&dir.0).expect("statfs of the bench directory");
    println!(
        "== 2. GDS slab O_DIRECT (write_many/read_many: pieces <= 16 MiB, {RING_DEPTH} in flight) vs raw \
         io_uring O_DIRECT (one request per object, {RING_DEPTH} in flight), same objects, offsets and \
         buffers, two preallocated files in {} ({fs_type}); after one unrecorded warm-up round, rounds \
         alternate which side goes first",
        dir.0.display()
    );
    // (object bytes, objects per batch): 256 MiB per batch at full size.
    let (sizes, rounds, lat_n): (&[(usize, usize)], usize, usize) = if full {
        (&[(4 << 20, 64), (32 << 20, 8)], 10, 64)
    } else {
        (&[(64 << 10, 4), (1 << 20, 2)], 2, 4)
    };
    let mut ratios = Vec::new();
    for &(obj, count) in sizes {
        let total = obj * count;
        let mut slab = GdsSlab::create(&dir.0, 0, total as u64, SlabOptions { direct_io: true })
            .expect("gds slab on the bench directory");
        let raw_path = dir.0.join("raw.bin");
        let raw = raw_file(&raw_path, total);
        let mut ring = IoUring::new(RING_DEPTH as u32).expect("io_uring");
        let offsets: Vec<u64> = (0..count).map(|i| (i * obj) as u64).collect();
        let src: Vec<AlignedBuf> = (0..count).map(|i| filled(obj, 0x5000 + i as u64)).collect();
        let mut dst: Vec<AlignedBuf> = (0..count).map(|_| AlignedBuf::zeroed(obj)).collect();
        let (mut sw, mut sr, mut rw, mut rr) = (hist(), hist(), hist(), hist());

        let slab_write = |slab: &mut GdsSlab| {
            let ops: Vec<(u64, &[u8])> = offsets
                .iter()
                .copied()
                .zip(src.iter().map(|b| &b[..]))
                .collect();
            let t = Instant::now();
            slab.write_many(&ops).expect("slab write");
            t.elapsed().as_nanos() as u64
        };
        let slab_read = |slab: &mut GdsSlab, dst: &mut [AlignedBuf]| {
            let mut ops: Vec<(u64, &mut [u8])> = offsets
                .iter()
                .copied()
                .zip(dst.iter_mut().map(|b| &mut b[..]))
                .collect();
            let t = Instant::now();
            slab.read_many(&mut ops).expect("slab read");
            t.elapsed().as_nanos() as u64
        };
        // The kernel only reads from the buffers of a write; the baseline
        // takes `&mut` for both directions, so writes go from a copy made
        // once, outside the timing.
        let mut src_copy: Vec<AlignedBuf> = src
            .iter()
            .map(|b| {
                let mut c = AlignedBuf::zeroed(obj);
                c.copy_from_slice(b);
                c
            })
            .collect();
        let raw_io = |ring: &mut IoUring, bufs: &mut [AlignedBuf], write: bool| {
            let mut ops: Vec<(u64, &mut [u8])> = offsets
                .iter()
                .copied()
                .zip(bufs.iter_mut().map(|b| &mut b[..]))
                .collect();
            let t = Instant::now();
            raw_batch(ring, &raw, &mut ops, write);
            t.elapsed().as_nanos() as u64
        };
        let check = |dst: &[AlignedBuf], what: &str| {
            for (i, (a, b)) in src.iter().zip(dst).enumerate() {
                assert!(a[..] == b[..], "{what}: object {i} read back differs");
            }
        };
        let clear = |dst: &mut [AlignedBuf]| dst.iter_mut().for_each(|b| b.fill(0));

        // Warm-up: first writes into preallocated (unwritten) extents, and
        // the bytes checked once per side.
        slab_write(&mut slab);
        slab_read(&mut slab, &mut dst);
        check(&dst, "slab");
        clear(&mut dst);
        raw_io(&mut ring, &mut src_copy, true);
        raw_io(&mut ring, &mut dst, false);
        check(&dst, "raw");
        for round in 0..rounds {
            for step in 0..2 {
                if (round + step) % 2 == 0 {
                    sw.record(slab_write(&mut slab)).unwrap();
                    clear(&mut dst);
                    sr.record(slab_read(&mut slab, &mut dst)).unwrap();
                    if round == 0 {
                        check(&dst, "slab");
                    }
                } else {
                    rw.record(raw_io(&mut ring, &mut src_copy, true)).unwrap();
                    clear(&mut dst);
                    rr.record(raw_io(&mut ring, &mut dst, false)).unwrap();
                    if round == 0 {
                        check(&dst, "raw");
                    }
                }
            }
        }

        // One object at a time (queue depth 1 per call), alternating sides.
        let (mut lsw, mut lsr, mut lrw, mut lrr) = (hist(), hist(), hist(), hist());
        for k in 0..lat_n {
            let i = k % count;
            let off = offsets[i];
            let one = |h: &mut Histogram<u64>, f: &mut dyn FnMut()| {
                let t = Instant::now();
                f();
                h.record(t.elapsed().as_nanos() as u64).unwrap();
            };
            let slab_first = k % 2 == 0;
            for side in 0..2 {
                if (side == 0) == slab_first {
                    one(&mut lsw, &mut || {
                        slab.write_at(off, &src[i]).expect("slab write_at")
                    });
                    one(&mut lsr, &mut || {
                        slab.read_at(off, &mut dst[i]).expect("slab read_at")
                    });
                } else {
                    one(&mut lrw, &mut || {
                        raw_batch(&mut ring, &raw, &mut [(off, &mut src_copy[i][..])], true)
                    });
                    one(&mut lrr, &mut || {
                        raw_batch(&mut ring, &raw, &mut [(off, &mut dst[i][..])], false)
                    });
                }
            }
        }
        check(&dst, "one at a time");

        let gb =
            |bytes: usize, h: &Histogram<u64>, q: f64| bytes as f64 / h.value_at_quantile(q) as f64;
        let us = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1e3;
        println!(
            "-- {count} x {} KiB objects ({} KiB per batch), {rounds} rounds; one at a time: {lat_n} objects",
            obj >> 10,
            total >> 10
        );
        let line = |name: &str, h: &Histogram<u64>, lat: &Histogram<u64>| {
            println!(
                "{name:<11} batch p50 {:>6.2} GB/s (p50 {:>9.1} us, p99 {:>9.1} us, max {:>9.1} us) | \
                 one object p50 {:>8.1} us p99 {:>8.1} us",
                gb(total, h, 0.5),
                us(h, 0.5),
                us(h, 0.99),
                h.max() as f64 / 1e3,
                us(lat, 0.5),
                us(lat, 0.99),
            )
        };
        line("slab write", &sw, &lsw);
        line("raw write", &rw, &lrw);
        line("slab read", &sr, &lsr);
        line("raw read", &rr, &lrr);
        // Throughput ratio slab/raw = raw time / slab time.
        let ratio = |slab: &Histogram<u64>, raw: &Histogram<u64>| {
            raw.value_at_quantile(0.5) as f64 / slab.value_at_quantile(0.5) as f64
        };
        let (w, r) = (ratio(&sw, &rw), ratio(&sr, &rr));
        println!(
            "slab/raw throughput (p50): write {w:.2}, read {r:.2} (bar >= 0.70); one object p50: write {:.2}, read {:.2}",
            ratio(&lsw, &lrw),
            ratio(&lsr, &lrr)
        );
        println!("{}", slab.describe());
        ratios.push((obj, w, r));
        drop(slab);
        drop(raw);
        fs::remove_file(&raw_path).unwrap();
    }
    if full {
        for (obj, w, r) in ratios {
            if w < 0.7 || r < 0.7 {
                println!(
                    "BELOW THE BAR: {} KiB objects, slab/raw write {w:.2}, read {r:.2}",
                    obj >> 10
                );
            }
        }
    }
}
