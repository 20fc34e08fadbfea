//! Per-operation costs of one L1 shard (no I/O): reserve+finish a write, a
//! read-lock round trip, LRU touches, and eviction under pressure.
//!
//! `cargo bench --bench l1` for full sizes; a tiny run under `cargo test`.

use std::time::Instant;

use hdrhistogram::Histogram;
use kvshard_engine::eviction::{EvictionConfig, EvictionPolicy, PolicyKind};
use kvshard_engine::keys::{worker_kv_rank, Name, ObjectKey};
use kvshard_engine::l1::{L1Config, L1Shard, WriterTag};
use kvshard_engine::slab::SlabAllocator;

const OBJ: u64 = 64 << 10;

fn key(i: u64) -> ObjectKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&i.to_le_bytes());
    h[8..16].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    ObjectKey {
        chunk_hash: h,
        model_name: Name::intern("bench-model").unwrap(),
        kv_rank: worker_kv_rank(1, 0),
        object_group_id: 0,
        cache_salt: Name::EMPTY,
    }
}

fn shard(capacity_objects: u64) -> L1Shard {
    let alloc = SlabAllocator::new(0, capacity_objects * OBJ, 4096);
    L1Shard::new(
        alloc,
        L1Config::default(),
        EvictionPolicy::new(EvictionConfig::new(PolicyKind::Lru)),
    )
}

fn report(name: &str, h: &Histogram<u64>, batch: u64) {
    println!(
        "{name:<40} n={:<8} per key: p50={:>6}ns p99={:>6}ns p99.9={:>7}ns max={:>8}ns",
        h.len(),
        h.value_at_quantile(0.5) / batch,
        h.value_at_quantile(0.99) / batch,
        h.value_at_quantile(0.999) / batch,
        h.max() / batch
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run under cargo test: debug build, few iterations; figures come from `cargo bench`)");
    }
    let rounds: u64 = if full { 20_000 } else { 50 };
    const BATCH: u64 = 8; // the chunks of a 2048-token request
    let now = Instant::now();
    let new_hist = || Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3).expect("bounds");

    // Writes into a shard large enough that nothing is evicted.
    let mut l1 = shard(rounds * BATCH + 16);
    let mut hw = new_hist();
    for r in 0..rounds {
        let keys: Vec<ObjectKey> = (0..BATCH).map(|i| key(r * BATCH + i)).collect();
        let t = Instant::now();
        let res = l1.reserve_write(&keys, OBJ, WriterTag(1), false, now);
        assert!(res.iter().all(|r| r.is_ok()));
        l1.finish_write(&keys, WriterTag(1), now);
        hw.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    report("reserve_write+finish_write (batch 8)", &hw, BATCH);

    let mut hr = new_hist();
    let mut ht = new_hist();
    for r in 0..rounds {
        let keys: Vec<ObjectKey> = (0..BATCH).map(|i| key(r * BATCH + i)).collect();
        let t = Instant::now();
        let res = l1.reserve_read(&keys, 1, now);
        assert!(res.iter().all(|r| r.is_ok()));
        l1.finish_read(&keys, 1, now);
        hr.record(t.elapsed().as_nanos() as u64).unwrap();
        let t = Instant::now();
        l1.touch(&keys, now);
        ht.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    report("reserve_read+finish_read (batch 8)", &hr, BATCH);
    report("touch (batch 8)", &ht, BATCH);

    // A full shard: every write evicts the LRU tail to make room.
    let cap = 1024;
    let mut l1 = shard(cap);
    let mut he = new_hist();
    for r in 0..rounds + cap / BATCH {
        let keys: Vec<ObjectKey> = (0..BATCH).map(|i| key(1 << 40 | (r * BATCH + i))).collect();
        let t = Instant::now();
        let res = l1.reserve_write(&keys, OBJ, WriterTag(1), false, now);
        assert!(
            res.iter().all(|r| r.is_ok()),
            "pressure eviction makes room"
        );
        l1.finish_write(&keys, WriterTag(1), now);
        if r >= cap / BATCH {
            he.record(t.elapsed().as_nanos() as u64).unwrap();
        }
    }
    report("write with pressure eviction (batch 8)", &he, BATCH);
}
