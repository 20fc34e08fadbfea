//! cpu_shm gather/scatter bandwidth next to a single-thread memcpy of the same
//! bytes, measured in the same run (the bar: >= 50% of memcpy).
//!
//! Layout of `lmcache bench server`'s default KV cache: 32 layers of
//! [2, blocks, 16, 8, 128] float16; one 256-token chunk is 32 MiB.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::Instant;

use hdrhistogram::Histogram;
use kvshard_transport::cpu_shm::{CpuShmRegistration, ShmTensorSpec};

fn gbps(bytes: usize, ns: u64) -> f64 {
    bytes as f64 / ns as f64
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run under cargo test: debug build, few iterations; figures come from `cargo bench`)");
    }
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
    let bpc = reg.blocks_per_chunk();
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
