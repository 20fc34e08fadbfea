//! The GDS L1 tier on the shard side (`--gds-l1-path`): a shard whose L1
//! objects live in its slab file instead of memory.
//!
//! The L1 bookkeeping does not change: the shard's [`L1Shard`] allocates
//! slab offsets (its allocator's base is 0, its capacity the slab size) and
//! keeps the same write and read locks. Only the bytes move differently:
//! every place that would read or write an object's memory stages it through
//! an aligned host buffer and moves the buffer to or from the file with one
//! blocking job on glommio's pool (the slab's own io_uring, O_DIRECT unless
//! turned off), so the shard's executor never waits on the disk:
//!
//! - lmcache_driven STORE: gather into buffers, write them, then finish the
//!   writes. The reply goes out after the write, so an acknowledged store is
//!   resident for the next lookup.
//! - lmcache_driven RETRIEVE: read the read-locked objects, scatter, then
//!   release the locks.
//! - L2 write-behind reads the objects into buffers; L2 loads write what the
//!   adapters filled (see `shard_l2`).
//!
//! Objects are written whole: the slab range of an object is its size
//! rounded up to `--l1-align-bytes` (a multiple of 4 KiB here), and the
//! padding is written as zeros.
//!
//! [`L1Shard`]: kvshard_engine::l1::L1Shard

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use kvshard_gds::slab::{AlignedBuf, GdsSlab, SlabCounters};

/// One shard's slab, shared with the blocking jobs that move its bytes.
/// Only those jobs take the lock, so the shard's executor never waits on it.
pub(crate) struct SlabL1 {
    slab: Arc<Mutex<GdsSlab>>,
    /// What does not change, for /status.
    info: serde_json::Value,
    /// The slab's counters as the last job left them.
    counters: Cell<SlabCounters>,
}

impl SlabL1 {
    pub(crate) fn new(slab: GdsSlab) -> SlabL1 {
        let info = serde_json::json!({
            "file": slab.path().display().to_string(),
            "size_bytes": slab.size_bytes(),
            "direct_io": slab.direct_io(),
            "io_uring": slab.uses_io_uring(),
            "filesystem": slab.filesystem().to_string(),
        });
        SlabL1 {
            counters: Cell::new(slab.counters()),
            slab: Arc::new(Mutex::new(slab)),
            info,
        }
    }

    /// Writes each buffer at its slab offset.
    pub(crate) async fn write(&self, items: Vec<(u64, AlignedBuf)>) -> Result<(), String> {
        let slab = self.slab.clone();
        let (res, counters) = glommio::executor()
            .spawn_blocking(move || {
                let ops: Vec<(u64, &[u8])> = items.iter().map(|(o, b)| (*o, &b[..])).collect();
                let mut s = match lock(&slab) {
                    Ok(s) => s,
                    Err(e) => return (Err(e), None),
                };
                let res = s.write_many(&ops).map_err(|e| e.to_string());
                (res, Some(s.counters()))
            })
            .await;
        if let Some(c) = counters {
            self.counters.set(c);
        }
        res
    }

    /// Reads `len` bytes at each slab offset into fresh aligned buffers.
    pub(crate) async fn read(&self, ranges: Vec<(u64, usize)>) -> Result<Vec<AlignedBuf>, String> {
        let slab = self.slab.clone();
        let (res, counters) = glommio::executor()
            .spawn_blocking(move || {
                let mut bufs: Vec<AlignedBuf> = ranges
                    .iter()
                    .map(|(_, len)| AlignedBuf::zeroed(*len))
                    .collect();
                let mut ops: Vec<(u64, &mut [u8])> = ranges
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|((o, _), b)| (*o, &mut b[..]))
                    .collect();
                let mut s = match lock(&slab) {
                    Ok(s) => s,
                    Err(e) => return (Err(e), None),
                };
                let res = s.read_many(&mut ops).map_err(|e| e.to_string());
                drop(ops);
                (res.map(|()| bufs), Some(s.counters()))
            })
            .await;
        if let Some(c) = counters {
            self.counters.set(c);
        }
        res
    }

    /// What /status reports for this shard's slab.
    pub(crate) fn status(&self) -> serde_json::Value {
        let c = self.counters.get();
        let mut v = self.info.clone();
        v["bytes_written"] = c.bytes_written.into();
        v["bytes_read"] = c.bytes_read.into();
        v["errors"] = c.errors.into();
        v
    }
}

/// The slab behind its lock. A job that panicked mid-transfer may have left
/// requests in the kernel that point into freed buffers, so a poisoned slab
/// is never used again: every later transfer fails (and its objects with it).
fn lock(slab: &Mutex<GdsSlab>) -> Result<std::sync::MutexGuard<'_, GdsSlab>, String> {
    slab.lock().map_err(|_| {
        "the L1 slab is out of service: a transfer on it panicked earlier (see the log)".to_string()
    })
}
