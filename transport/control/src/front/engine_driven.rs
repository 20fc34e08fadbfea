//! engine_driven transfers: registration, prepare_store (on the shards'
//! reservations or on write credits the front holds), commit_store,
//! prepare_retrieve (from a lookup's lease or fresh read locks) and
//! commit_retrieve. The worker copies through the shared L1 pool itself.

use std::time::Instant;

use kvshard_dataplane::messages::{ObjectSizes, ReplyTo, ShardMsg, ShardOp};
use kvshard_engine::keys::{self, ObjectKey};
use kvshard_engine::l1::WriterTag;
use kvshard_engine::slab::Slab;
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_layout::ObjectLayout;
use kvshard_wire::{self as wire, InstanceId, IpcKey};

use super::inflight::{involved, InflightKind};
use super::lookup::KeyError;
use super::workers::{reserved_instance_id, writer_tag};
use super::Front;
use crate::registry::{EngineEntry, PendingWrite, TransferKey};
use crate::session;

/// Write credits the front holds for one shard and object size.
pub(super) struct CreditPool {
    pub(super) free: Vec<Slab>,
    /// A `GrantCredits` to the shard is awaited.
    pub(super) asked: bool,
    /// Credits to keep: `--write-credits` at first, raised to the largest
    /// part of one request for the shard that found too few (within the
    /// memory bound of [`Front::credit_cap`]).
    pub(super) target: usize,
}

/// The request's chunk index of a worker key's first object.
pub(super) fn first_chunk_of(key: &IpcKey, chunk_size: usize) -> usize {
    usize::try_from(key.start).unwrap_or(0) / chunk_size.max(1)
}

impl Front {
    pub(super) fn register_engine_driven(
        &mut self,
        p: wire::EngineDrivenPayload,
        now: Instant,
    ) -> Option<Vec<u8>> {
        if !self.cfg.transfer_mode.engine_driven_enabled() {
            log_limited!(Level::Error,
                "register_kv_cache_engine_driven_context from instance {}: engine_driven transfer is not enabled \
                 (--supported-transfer-mode {:?})",
                p.instance_id,
                self.cfg.transfer_mode
            );
            return None;
        }
        let Some((shm_name, pool_size)) = self.setup.shm_pool.clone() else {
            log_limited!(Level::Error,
                "register_kv_cache_engine_driven_context from instance {}: the SHM pool is disabled (--shm-name \"\") \
                 and kvshard does not support the pickle transfer fallback",
                p.instance_id
            );
            return None;
        };
        if let Some(e) = reserved_instance_id(p.instance_id) {
            log_limited!(
                Level::Error,
                "register_kv_cache_engine_driven_context refused: {e}"
            );
            self.metrics.bad_requests += 1;
            return None;
        }
        let reply = wire::encode_register_engine_driven_reply(&shm_name, pool_size);
        if self.registry.touch_engine(p.instance_id, now) {
            log_limited!(
                Level::Info,
                "engine_driven instance {} already registered; refreshing liveness",
                p.instance_id
            );
            return Some(reply);
        }
        let world_size = u32::try_from(p.world_size)
            .ok()
            .filter(|w| (1..=keys::MAX_WORLD_SIZE).contains(w));
        let layout = match world_size {
            None => Err(format!("world_size {} is invalid", p.world_size)),
            Some(_) => {
                ObjectLayout::engine_driven(&p, self.cfg.chunk_size).map_err(|e| e.to_string())
            }
        };
        let layout = match layout {
            Ok(l) => l,
            Err(e) => {
                log_limited!(
                    Level::Error,
                    "register_kv_cache_engine_driven_context from instance {}: {e}",
                    p.instance_id
                );
                self.metrics.bad_requests += 1;
                return None;
            }
        };
        let ws = p.world_size as u32;
        if let Err(e) = self.layouts.register(&p.model_name, ws, &layout) {
            log_limited!(
                Level::Error,
                "register_kv_cache_engine_driven_context from instance {}: {e}",
                p.instance_id
            );
            return None;
        }
        let size = layout.bytes;
        let entry = EngineEntry {
            model_name: p.model_name.clone(),
            world_size: ws,
            layout,
            block_size: p.block_size,
            use_mla: p.use_mla,
            last_seen: now,
            pinged: false,
            kv_ranks: Vec::new(),
        };
        if let Err(e) = self.registry.insert_engine(p.instance_id, entry) {
            self.layouts.unregister(&p.model_name, ws);
            log_limited!(Level::Error, "register_kv_cache_engine_driven_context: {e}");
            return None;
        }
        log_limited!(
            Level::Info,
            "registered engine_driven instance {} (model={}, world_size={ws})",
            p.instance_id,
            p.model_name
        );
        for shard in 0..self.shards.len() {
            self.stock_credits(shard, size, true);
        }
        Some(reply)
    }

    /// Resolves `key` to the object keys of `[start, end)` that worker
    /// instance `iid` transfers, and notes the kv rank it transfers (so that
    /// its departure releases only lookup locks it could have read).
    pub(super) fn worker_keys(
        &mut self,
        iid: InstanceId,
        key: &IpcKey,
        now: Instant,
    ) -> Result<Vec<ObjectKey>, KeyError> {
        if key.worker_id.is_none() {
            return Err(KeyError::NoWorker);
        }
        let ranks = Self::ranks_of(key)?;
        if let Some(rank) = ranks.single() {
            self.registry.note_rank(iid, rank);
        }
        let hashes = self.key_hashes(key, false, ranks.len(), now)?;
        let (model, salt) = Self::key_names(&key.model_name, &key.cache_salt)?;
        Ok(Self::object_keys(model, salt, &hashes, ranks))
    }

    /// The [`TransferKey`] of `key` from instance `iid`. Its token digest is
    /// the session's when the session of `key`'s request holds these tokens
    /// (a prepare's hashing left them there; its commit reuses the digest).
    pub(super) fn transfer_key(&mut self, iid: InstanceId, key: &IpcKey) -> TransferKey {
        let tokens = match self.sessions.get_mut(&key.request_id) {
            Some(s) if s.tokens() == key.token_ids.as_slice() => s.token_digest(),
            _ => session::token_digest(&key.token_ids),
        };
        TransferKey::new(iid, key, &tokens)
    }

    pub(super) fn prepare_store(
        &mut self,
        to: ReplyTo,
        key: IpcKey,
        iid: InstanceId,
        now: Instant,
    ) {
        self.metrics.submitted_stores += 1;
        let Some(layout) = self.registry.engine_layout(iid, now) else {
            log_limited!(Level::Error, "prepare_store: engine_driven context not registered (or reaped) for instance {iid}");
            self.metrics.unregistered_instance += 1;
            return self.reply(&to, Some(wire::encode_prepare_store_reply(&[], &[])));
        };
        let objs = match self.worker_keys(iid, &key, now) {
            Ok(o) => o,
            Err(e) => {
                log_limited!(Level::Error, "prepare_store from instance {iid}: {e}");
                self.metrics.bad_requests += 1;
                return self.reply(&to, Some(wire::encode_prepare_store_reply(&[], &[])));
            }
        };
        // Credits of this size exist only where --write-credits and the
        // shards' memory allow one.
        let credits = self.cfg.write_credits > 0 && self.credit_cap(layout.bytes) > 0;
        if credits && self.prepare_store_on_credits(&to, &key, iid, &objs, &layout) {
            return;
        }
        let tkey = self.transfer_key(iid, &key);
        let size = layout.bytes;
        let kind = InflightKind::PrepareStore {
            to,
            tkey,
            keys: objs.clone(),
            layout,
            slabs: vec![None; objs.len()],
        };
        self.reserve_writes(kind, &objs, ObjectSizes::one(size), iid);
    }

    /// Answers a prepare_store from the write credits the shards lent, without
    /// waiting for them: each object the request's lookup did not find gets a
    /// credit of its shard, and the shard is told to stage it there (its
    /// mailbox brings that ahead of the commit). Returns false, having done
    /// nothing, when some shard's credits do not cover its part: the shards
    /// are asked instead (and the credits topped up). The reply goes as soon
    /// as the slots are known; what the commit needs is recorded after it,
    /// before the front reads its next message.
    pub(super) fn prepare_store_on_credits(
        &mut self,
        to: &ReplyTo,
        key: &IpcKey,
        iid: InstanceId,
        objs: &[ObjectKey],
        layout: &ObjectLayout,
    ) -> bool {
        let n = self.shards.len();
        let size = layout.bytes;
        let first_chunk = first_chunk_of(key, self.cfg.chunk_size);
        // The objects of one request are distinct (chained chunk hashes, one
        // kv rank each): none is named twice.
        let skip = self.leases.found(&key.request_id, first_chunk, objs);
        let mut need = vec![0usize; n];
        for (k, skip) in objs.iter().zip(&skip) {
            if !*skip {
                need[k.shard(n)] += 1;
            }
        }
        let short =
            (0..n).find(|&s| need[s] > self.credits[s].get(&size).map_or(0, |p| p.free.len()));
        if let Some(s) = short {
            self.metrics.store_credit_misses += 1;
            let cap = self.credit_cap(size);
            if let Some(pool) = self.credits[s].get_mut(&size) {
                pool.target = pool.target.max(need[s].min(cap));
            }
            self.stock_credits(s, size, true);
            return false;
        }
        let involved: Vec<usize> = (0..n).filter(|&s| need[s] > 0).collect();
        if self.refused(to, involved.iter().copied()) {
            self.reply_failure(to);
            return true;
        }
        let mut per: Vec<Vec<(ObjectKey, Slab)>> = vec![Vec::new(); n];
        let (mut slots, mut indices, mut reserved) = (Vec::new(), Vec::new(), Vec::new());
        for (i, k) in objs.iter().enumerate() {
            if skip[i] {
                continue;
            }
            let s = k.shard(n);
            let slab = self.credits[s]
                .get_mut(&size)
                .and_then(|p| p.free.pop())
                .expect("credits counted above");
            per[s].push((*k, slab));
            slots.push(layout.slot(slab.offset));
            indices.push(i as i64);
            reserved.push(*k);
        }
        self.reply(to, Some(wire::encode_prepare_store_reply(&slots, &indices)));
        if !reserved.is_empty() {
            self.next_credit_tag += 1;
            let tag = WriterTag::credit(self.next_credit_tag);
            // Any earlier prepare's abort goes first, then the adoption.
            let tkey = self.transfer_key(iid, key);
            self.pend_write(tkey, reserved, tag);
            for (s, writes) in per.into_iter().enumerate() {
                if !writes.is_empty() {
                    // Not woken for, nor is the commit's FinishWrite: they
                    // ride along with the shard's next wake-up (a request
                    // that wants its reply, or the lazy one within
                    // LAZY_WAKE_AFTER), far inside the write TTL; mailbox
                    // order keeps a later lookup behind them.
                    let op = ShardOp::AdoptWrite { writes, size, tag };
                    self.send(s, ShardMsg { seq: 0, op });
                }
            }
            self.metrics.store_credit_prepares += 1;
        }
        for s in involved {
            // Short when the next request like this one would find too few.
            let left = self.credits[s].get(&size).map_or(0, |p| p.free.len());
            self.stock_credits(s, size, left < need[s]);
        }
        true
    }

    /// Records `keys`, staged under `tag`, as the pending write of `tkey`; an
    /// earlier prepare of it never committed is abandoned.
    pub(super) fn pend_write(&mut self, tkey: TransferKey, keys: Vec<ObjectKey>, tag: WriterTag) {
        let pending = PendingWrite { keys, tag };
        if let Some(old) = self.registry.pending_writes.insert(tkey, pending) {
            self.post(old.keys, |keys| ShardOp::AbortWrite { keys, tag: old.tag });
        }
    }

    /// The most credits a shard lends for objects of `size` bytes: 1/64 of
    /// its memory.
    pub(super) fn credit_cap(&self, size: u64) -> usize {
        let align = self.cfg.l1.align_bytes.max(1);
        let aligned = size.div_ceil(align).saturating_mul(align).max(1);
        let shard_bytes = self.cfg.l1.size_bytes / self.shards.len().max(1) as u64;
        (shard_bytes / 64 / aligned).min(u32::MAX as u64) as usize
    }

    /// Asks shard `shard` for write credits of `size` bytes, up to its pool's
    /// target, when no request for more is out and half of them are used (or
    /// any, when `short`: a request found too few, or the next one like it
    /// would). A short pool has the shard woken for the grant, one asked
    /// earlier included; otherwise the grant rides along with its next
    /// wake-up.
    pub(super) fn stock_credits(&mut self, shard: usize, size: u64, short: bool) {
        let first = (self.cfg.write_credits as usize).min(self.credit_cap(size));
        if first == 0 || self.dead[shard] {
            return;
        }
        let pool = self.credits[shard]
            .entry(size)
            .or_insert_with(|| CreditPool {
                free: Vec::new(),
                asked: false,
                target: first,
            });
        let target = pool.target;
        if pool.asked {
            if short {
                self.mark_unwoken(shard);
            }
            return;
        }
        // Topped up once half is used: one grant per few requests.
        let low = if short { target } else { target.div_ceil(2) };
        if pool.free.len() >= low {
            return;
        }
        pool.asked = true;
        let count = target - pool.free.len();
        let mut parts = vec![Vec::new(); self.shards.len()];
        parts[shard] = (0..count).collect();
        let kind = InflightKind::Credits {
            shard,
            size,
            slabs: vec![None; count],
        };
        let grant = |_: &[usize]| ShardOp::GrantCredits {
            size,
            count: count as u32,
        };
        // Woken for only when short: otherwise the credits left cover the
        // next request meanwhile.
        if let Some(kind) = self.fan_out_waking(parts, kind, short, grant) {
            self.complete(0, kind); // not reached: the shard's part is not empty
        }
    }

    /// Shard `shard` lent `slabs` of `size` bytes: pooled, or given back when
    /// no registration uses that size any more.
    pub(super) fn credits_granted(&mut self, shard: usize, size: u64, slabs: Vec<Slab>) {
        let wanted = self.registry.engine_sizes().contains(&size);
        match self.credits[shard].get_mut(&size) {
            Some(pool) if wanted => {
                pool.asked = false;
                pool.free.extend(slabs);
            }
            _ => {
                self.credits[shard].remove(&size);
                if !slabs.is_empty() {
                    let op = ShardOp::ReturnCredits { slabs };
                    self.send(shard, ShardMsg { seq: 0, op });
                }
            }
        }
    }

    /// Gives back the credits of sizes no engine_driven registration uses.
    pub(super) fn trim_credits(&mut self) {
        let sizes = self.registry.engine_sizes();
        for shard in 0..self.shards.len() {
            let unused: Vec<u64> = self.credits[shard]
                .keys()
                .filter(|s| !sizes.contains(s))
                .copied()
                .collect();
            for size in unused {
                let pool = self.credits[shard].remove(&size).expect("listed above");
                if !pool.free.is_empty() {
                    let op = ShardOp::ReturnCredits { slabs: pool.free };
                    self.send(shard, ShardMsg { seq: 0, op });
                }
                if pool.asked {
                    // Its grant is given back when it arrives (`credits_granted`).
                    let asked = CreditPool {
                        free: Vec::new(),
                        ..pool
                    };
                    self.credits[shard].insert(size, asked);
                }
            }
        }
    }

    /// Reserves the L1 writes of `keys` (`size` bytes each, writer `iid`) on
    /// their shards; `kind` collects the slabs.
    pub(super) fn reserve_writes(
        &mut self,
        kind: InflightKind,
        keys: &[ObjectKey],
        sizes: ObjectSizes,
        iid: InstanceId,
    ) {
        let parts = self.split(keys);
        if let InflightKind::PrepareStore { to, .. } | InflightKind::CudaStore { to, .. } = &kind {
            if self.refused(to, involved(&parts)) {
                return self.reply_failure(to);
            }
        }
        let tag = writer_tag(iid);
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::ReserveWrite {
            keys: idx.iter().map(|i| keys[*i]).collect(),
            sizes: sizes.clone(),
            tag,
        }) {
            self.complete(0, kind);
        }
    }

    pub(super) fn commit_store(
        &mut self,
        key: &IpcKey,
        iid: InstanceId,
        inline_bytes: usize,
        now: Instant,
    ) -> bool {
        if inline_bytes > 0 {
            log_limited!(
                Level::Error,
                "commit_store from instance {iid} carries {inline_bytes} bytes of inline (pickled) data: \
                 kvshard does not support the pickle transfer fallback; the worker must map the SHM pool \
                 advertised at registration"
            );
            self.metrics.bad_requests += 1;
            self.metrics.pickle_refused += 1;
            return false;
        }
        self.registry.touch_traffic(iid, now);
        let tkey = self.transfer_key(iid, key);
        let Some(PendingWrite { keys, tag }) = self.registry.pending_writes.remove(&tkey) else {
            log_limited!(
                Level::Warn,
                "commit_store from instance {iid} without a pending prepare_store"
            );
            self.metrics.bad_requests += 1;
            return false;
        };
        let n = keys.len() as u64;
        // Shards run their mailbox in order: a lookup sent after this sees the
        // objects. Not woken for (see `lazy`): the writer is answered already.
        self.post(keys, |keys| ShardOp::FinishWrite { keys, tag });
        self.metrics.stored_chunks += n;
        self.metrics.finished_stores += 1;
        true
    }

    pub(super) fn prepare_retrieve(
        &mut self,
        to: ReplyTo,
        key: IpcKey,
        iid: InstanceId,
        now: Instant,
    ) {
        self.metrics.submitted_retrieves += 1;
        let Some(layout) = self.registry.engine_layout(iid, now) else {
            log_limited!(Level::Error, "prepare_retrieve: engine_driven context not registered (or reaped) for instance {iid}");
            self.metrics.unregistered_instance += 1;
            return self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[])));
        };
        let objs = match self.worker_keys(iid, &key, now) {
            Ok(o) if !o.is_empty() => o,
            Ok(_) => return self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[]))),
            Err(e) => {
                log_limited!(Level::Error, "prepare_retrieve from instance {iid}: {e}");
                self.metrics.bad_requests += 1;
                return self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[])));
            }
        };
        let parts = self.split(&objs);
        if self.refused(&to, involved(&parts)) {
            return self.reply_failure(&to);
        }
        let first_chunk = first_chunk_of(&key, self.cfg.chunk_size);
        // The request's lookup holds these objects locked where it found them:
        // no shard needs asking.
        if let Some(offsets) = self
            .leases
            .readable(&key.request_id, first_chunk, &objs, now)
        {
            self.metrics.retrieves_from_lease += 1;
            let take = self.hand_over_locks(&key.request_id, first_chunk, &objs, iid);
            debug_assert!(
                !take.contains(&true),
                "readable: the lease holds every lock"
            );
            self.reply_reads(&to, &offsets, &layout);
            // After the reply: the commit comes after the front's next read.
            let tkey = self.transfer_key(iid, &key);
            return self.pend_reads(tkey, objs);
        }
        let tkey = self.transfer_key(iid, &key);
        let n = objs.len();
        let keys_ref = objs.clone();
        let take = self.hand_over_locks(&key.request_id, first_chunk, &objs, iid);
        let kind = InflightKind::PrepareRetrieve {
            to,
            tkey,
            keys: objs,
            layout,
            slabs: vec![None; n],
        };
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::ReadLocked {
            keys: idx.iter().map(|i| keys_ref[*i]).collect(),
            take: idx.iter().map(|i| take[*i]).collect(),
        }) {
            self.complete(0, kind);
        }
    }

    /// Passes to a transfer of instance `iid` one of request `rid`'s lookup
    /// locks on each of `keys` (the request's chunks `first_chunk..`, one kv
    /// rank each) where its lease still holds one. Returns per key whether the
    /// transfer got none and must take a lock of its own: a repeated
    /// transfer, or one after the lease was forgotten, never releases a lock
    /// that may be another request's.
    pub(super) fn hand_over_locks(
        &mut self,
        rid: &str,
        first_chunk: usize,
        keys: &[ObjectKey],
        iid: InstanceId,
    ) -> Vec<bool> {
        let chunks: Vec<usize> = (first_chunk..first_chunk + keys.len()).collect();
        self.hand_over_locks_at(rid, &chunks, keys, iid)
    }

    /// [`hand_over_locks`](Self::hand_over_locks) of keys each of the
    /// request's chunk `chunks[i]`.
    pub(super) fn hand_over_locks_at(
        &mut self,
        rid: &str,
        chunks: &[usize],
        keys: &[ObjectKey],
        iid: InstanceId,
    ) -> Vec<bool> {
        let at = chunks.iter().copied().zip(keys);
        let held = self.leases.released(rid, at, 1, Some(iid));
        // `held` is the keys handed over, in the order of `keys`.
        let mut held = held.iter().map(|(k, _)| k).peekable();
        keys.iter()
            .map(|k| held.next_if(|h| *h == k).is_none())
            .collect()
    }

    /// Answers a `prepare_retrieve` whose objects are all read-locked at
    /// `offsets`, this transfer holding one lock on each, which
    /// `commit_retrieve` (or the worker's departure) releases: see
    /// [`Front::pend_reads`], called right after.
    pub(super) fn reply_reads(&mut self, to: &ReplyTo, offsets: &[u64], layout: &ObjectLayout) {
        let slots: Vec<_> = offsets.iter().map(|o| layout.slot(*o)).collect();
        self.reply(to, Some(wire::encode_prepare_retrieve_reply(true, &slots)));
    }

    /// Records the read-locked `keys` of transfer `tkey` for its commit; an
    /// earlier prepare of it never committed gives its locks back.
    pub(super) fn pend_reads(&mut self, tkey: TransferKey, keys: Vec<ObjectKey>) {
        if let Some(old) = self.registry.push_pending_read(tkey, keys) {
            self.post(old, |keys| ShardOp::Release { keys, count: 1 });
        }
    }

    pub(super) fn commit_retrieve(&mut self, key: &IpcKey, iid: InstanceId, now: Instant) -> bool {
        self.registry.touch_traffic(iid, now);
        let tkey = self.transfer_key(iid, key);
        match self.registry.pop_pending_read(&tkey) {
            Some(keys) => {
                let n = keys.len() as u64;
                self.post(keys, |keys| ShardOp::Release { keys, count: 1 });
                self.metrics.retrieved_chunks += n;
                self.metrics.finished_retrieves += 1;
                true
            }
            None => {
                log_limited!(
                    Level::Warn,
                    "commit_retrieve from instance {iid} without a pending prepare_retrieve"
                );
                self.metrics.bad_requests += 1;
                false
            }
        }
    }

    /// UNREGISTER_ENGINE_DRIVEN: forgets the instance and releases what it
    /// held.
    pub(super) fn unregister_engine_driven(&mut self, iid: InstanceId) {
        match self.registry.remove_engine(iid) {
            Some(entry) => {
                log_limited!(Level::Info, "unregistered engine_driven instance {iid}");
                self.release_instance(crate::registry::Released::Engine(iid, entry));
            }
            None => log_limited!(Level::Warn, "unregister: no engine_driven instance {iid}"),
        }
    }

    /// A prepare_store's reservations came back: the writer is answered with
    /// the slots it may write, and what was reserved waits for its commit.
    pub(super) fn prepare_store_reserved(
        &mut self,
        to: ReplyTo,
        tkey: TransferKey,
        keys: Vec<ObjectKey>,
        layout: &ObjectLayout,
        slabs: Vec<Option<Slab>>,
    ) {
        let mut slots = Vec::new();
        let mut indices = Vec::new();
        let mut reserved = Vec::new();
        for (i, (k, s)) in keys.into_iter().zip(slabs).enumerate() {
            if let Some(slab) = s {
                slots.push(layout.slot(slab.offset));
                indices.push(i as i64);
                reserved.push(k);
            }
        }
        if !reserved.is_empty() {
            let tag = writer_tag(tkey.instance_id);
            self.pend_write(tkey, reserved, tag);
        }
        self.reply(
            &to,
            Some(wire::encode_prepare_store_reply(&slots, &indices)),
        );
    }

    /// A prepare_retrieve's read locks came back: the reader gets the slots
    /// when every object was locked, else a miss (the locks taken are given
    /// back).
    pub(super) fn prepare_retrieve_locked(
        &mut self,
        to: ReplyTo,
        tkey: TransferKey,
        keys: Vec<ObjectKey>,
        layout: &ObjectLayout,
        slabs: Vec<Option<Slab>>,
    ) {
        if slabs.iter().all(Option::is_some) && !slabs.is_empty() {
            let offsets: Vec<u64> = slabs.iter().flatten().map(|s| s.offset).collect();
            self.reply_reads(&to, &offsets, layout);
            self.pend_reads(tkey, keys);
        } else {
            // Not all read-locked: release the lock this transfer holds on
            // each object found.
            let found: Vec<ObjectKey> = keys
                .into_iter()
                .zip(&slabs)
                .filter(|(_, s)| s.is_some())
                .map(|(k, _)| k)
                .collect();
            self.metrics.retrieve_misses += 1;
            self.post(found, |keys| ShardOp::Release { keys, count: 1 });
            self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[])));
        }
    }
}
