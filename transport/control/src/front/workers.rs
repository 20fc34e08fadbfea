//! Worker instances across both modes: their writer tags, PING (liveness and
//! the re-registration edge), and the release of what a departed or reaped
//! instance held.

use std::collections::HashMap;
use std::time::Instant;

use kvshard_dataplane::messages::ShardOp;
use kvshard_engine::keys::ObjectKey;
use kvshard_engine::l1::WriterTag;
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_wire::InstanceId;

use super::Front;
use crate::registry::{LmcTransfer, PendingWrite};

/// The writer tag of worker instance `iid`'s reservations. Registration
/// refuses the ids that have none ([`reserved_instance_id`]), so every
/// registered instance has one.
pub(super) fn writer_tag(iid: InstanceId) -> WriterTag {
    WriterTag::worker(iid.0).unwrap_or_else(|| {
        panic!("instance id {iid} is in the internal writer-tag space; registration refuses it")
    })
}

/// Why an instance id cannot be registered, if it cannot: it has no writer
/// tag of its own ([`WriterTag::worker`]).
pub(super) fn reserved_instance_id(iid: InstanceId) -> Option<String> {
    WriterTag::worker(iid.0).is_none().then(|| {
        format!(
            "instance id {iid} is negative: kvshard reserves those writer tags for its L2 loads \
             (lmcache's instance ids are never negative)"
        )
    })
}

impl Front {
    /// A worker's heartbeat: whether to tell it the server is healthy.
    ///
    /// - A worker kvshard refused (CUDA) hears it is not, and its client
    ///   degrades with a warning instead of failing every transfer.
    /// - A worker this server does not know (it registered with a server that
    ///   ran before this one) hears `false` once, then `true`: 0.5.6's adapter
    ///   re-registers its KV caches only on an unhealthy-to-healthy edge of its
    ///   heartbeat, and would otherwise store into a server that cannot serve it.
    pub(super) fn ping(&mut self, iid: InstanceId, now: Instant) -> bool {
        self.registry.ping(iid, now);
        if self.refused.touch(iid, now) {
            return self.registry.is_registered(iid);
        }
        if self.registry.is_registered(iid) || self.cuda_regs.contains_key(&iid) {
            self.unknown_pinged.remove(&iid);
            return true;
        }
        if self.unknown_pinged.remove(&iid) {
            // Its second ping: the edge its adapter re-registers on.
            return true;
        }
        if self.unknown_pinged.len() >= self.cfg.max_registrations {
            // Instances that never came back: forget them all (bounded).
            self.unknown_pinged.clear();
        }
        self.unknown_pinged.insert(iid);
        self.metrics.unknown_instance_pings += 1;
        log_limited!(
            Level::Warn,
            "PING from instance {iid}, which is not registered here (registered with a server \
             that ran before this one?): answered unhealthy once, so that its client registers again"
        );
        false
    }

    /// Releases what a removed registration held: pending reservations and read
    /// locks, and the lookup locks that no live instance can release any more.
    pub(super) fn release_instance(&mut self, released: crate::registry::Released) {
        let (iid, model, ws) = released.identity();
        self.layouts.unregister(&model, ws);
        if let crate::registry::Released::Lmc(_, e) = &released {
            if let LmcTransfer::Cuda(c) = &e.reg {
                self.cuda_unregister(iid, c.ordinal);
            }
        }
        // Pending SHM transfers belong to the engine_driven context only.
        if matches!(released, crate::registry::Released::Engine(..)) {
            let (writes, reads) = self.registry.take_pending(iid);
            for PendingWrite { keys, tag } in writes {
                self.post(keys, |keys| ShardOp::AbortWrite { keys, tag });
            }
            for keys in reads {
                self.post(keys, |keys| ShardOp::Release { keys, count: 1 });
            }
        }
        self.release_orphaned_locks(&model, ws, iid);
        self.trim_credits();
    }

    /// Releases the read locks of `model`/`ws` lookups beyond what the live
    /// instances may still read (instance `gone` just left).
    pub(super) fn release_orphaned_locks(&mut self, model: &str, ws: u32, gone: InstanceId) {
        // A lease past its TTL may hold locks the shard has already expired.
        self.leases.expire(self.clock.now());
        let registry = &self.registry;
        let orphans = self.leases.orphaned(model, ws, |rank, done| {
            registry
                .readers_of(model, ws, rank)
                .iter()
                .filter(|i| !done.contains(i))
                .count() as u32
        });
        if orphans.is_empty() {
            return;
        }
        let total: u64 = orphans.iter().map(|(_, n)| *n as u64).sum();
        self.metrics.orphaned_read_locks += total;
        log_limited!(
            Level::Info,
            "released {total} read locks on {} objects: lookups of model {model} (world size {ws}) \
             held them for workers that are gone (instance {gone} was the last that could read them)",
            orphans.len()
        );
        let mut by_count: HashMap<u32, Vec<ObjectKey>> = HashMap::new();
        for (k, n) in orphans {
            by_count.entry(n).or_default().push(k);
        }
        for (count, keys) in by_count {
            self.post(keys, |keys| ShardOp::Release { keys, count });
        }
    }
}
