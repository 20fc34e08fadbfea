//! The shard side: one task per core that owns an [`L1Shard`] and executes the
//! front end's requests for the keys routed to it.
//!
//! Requests arrive on the shard's mailbox in the order the front sent them, so a
//! write finished before a lookup was sent is visible to that lookup. Replies go back
//! on the front's notify queue tagged with the request's sequence number.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use glommio::{Latency, Shares};
use std::time::{Duration, Instant};

use kvshard_engine::keys::ObjectKey;
use kvshard_engine::l1::{Admission, L1Error, L1Shard, WriterTag};
use kvshard_engine::slab::Slab;
use kvshard_gds::slab::{AlignedBuf, GdsSlab};
use kvshard_io::arena::Arena;
use kvshard_io::clock::SharedClock;
use kvshard_io::mailbox::{MailboxReceiver, NotifySender};
use kvshard_io::prefault::PrefaultHandle;

use crate::cpu_shm::CpuShmRegistration;
use crate::l1_slab::SlabL1;
use crate::messages::{
    Found, FrontEvent, L2CtlStats, L2Deadline, ObjectSizes, RetrieveItem, Seq, ShardMsg, ShardOp,
    ShardReply, ShardReplyBody, ShardReport, StoreOutcome, NO_SLAB,
};
use kvshard_messages::config::L2Settings;

pub mod l2;
use l2::L2Shard;

pub struct ShardConfig {
    pub id: usize,
    /// The most this shard's allocator may grow to (its slice of the arena).
    pub max_capacity_bytes: u64,
    /// Arena-global offset where this shard's slice starts.
    pub slice_offset: u64,
    pub lock_memory: bool,
    pub eviction_interval: Duration,
    /// How long to poll an empty mailbox before parking (`--spin-us`).
    pub spin: Duration,
    /// How long L2 stores in flight may finish once the mailbox closes
    /// (`--shutdown-drain-seconds`).
    pub shutdown_drain: Duration,
    /// A lazy L1 in memory: the thread that faults (and mlocks) the slice
    /// ahead of use, which also says when memory runs short. `None`: the
    /// slice is faulted (and locked) whole at start, or is not memory.
    pub prefault: Option<PrefaultHandle>,
    /// Where the shard reads the time.
    pub clock: SharedClock,
}

/// What holds a shard's L1 objects, as the server hands it to the shard.
pub enum ShardBacking {
    /// Its slice of the memory arena (offsets are arena offsets).
    Memory(Arc<Arena>),
    /// Its own GDS slab file (offsets are file offsets).
    Slab(GdsSlab),
}

/// [`ShardBacking`] on the shard's thread.
enum Backing {
    Memory(Arc<Arena>),
    Slab(Rc<SlabL1>),
}

pub(crate) struct ShardState {
    cfg: ShardConfig,
    backing: Backing,
    pub(crate) l1: L1Shard,
    /// Keys that became resident (not temporary) during the current message:
    /// the store controller writes them behind to L2.
    to_l2: Vec<ObjectKey>,
    /// See [`ShardReport::store_oom_chunks`].
    store_oom_chunks: u64,
}

impl ShardState {
    /// The time on the shard's clock.
    pub(crate) fn now(&self) -> Instant {
        self.cfg.clock.now()
    }

    /// The memory of an object of a memory-backed L1. Callers move the
    /// bytes of a slab-backed L1 through [`ShardState::slab_l1`] instead.
    pub(crate) fn ptr(&self, slab: &Slab) -> *mut u8 {
        let Backing::Memory(arena) = &self.backing else {
            unreachable!("a slab-backed L1 object has no memory; callers check slab_l1() first")
        };
        assert!(
            slab.offset + slab.len <= arena.len(),
            "slab outside the arena"
        );
        // SAFETY: bounds asserted above; the arena outlives the shard (Arc).
        unsafe { arena.base().add(slab.offset as usize) }
    }

    /// The slab file holding this shard's L1 objects, if they live in one.
    pub(crate) fn slab_l1(&self) -> Option<Rc<SlabL1>> {
        match &self.backing {
            Backing::Slab(s) => Some(s.clone()),
            Backing::Memory(_) => None,
        }
    }

    /// Lazy growth: extend the allocator before eviction would kick in,
    /// unless memory is short (the faulting thread says so), and keep the
    /// slice faulted ahead of what `extra_bytes` more will use.
    pub(crate) fn maybe_grow(&mut self, extra_bytes: u64, watermark: Option<f64>) {
        let (used, cap) = self.l1.usage();
        let max = self.cfg.max_capacity_bytes;
        self.fault_ahead(extra_bytes);
        if cap >= max {
            return;
        }
        let need_room = used + extra_bytes > cap;
        let over_mark = watermark.is_some_and(|w| cap > 0 && used as f64 >= w * cap as f64);
        if !need_room && !over_mark {
            return;
        }
        if self.cfg.prefault.as_ref().is_some_and(|p| p.memory_short()) {
            kvshard_io::log_limited!(
                log::Level::Warn,
                "shard {}: L1 stays at {cap} of its {max} bytes: the host is short of memory \
                 (eviction makes room instead)",
                self.cfg.id
            );
            return;
        }
        let target = (cap.saturating_mul(2)).max(used + extra_bytes).min(max);
        self.l1.grow(target);
    }

    /// Asks the faulting thread to keep the slice faulted past the highest
    /// byte handed out so far plus `extra_bytes`.
    fn fault_ahead(&self, extra_bytes: u64) {
        if let Some(p) = &self.cfg.prefault {
            let hw = self.l1.allocator().high_water();
            p.used_up_to(hw.saturating_add(extra_bytes));
        }
    }

    /// Counts and logs (rate-limited) `oom` of a store's `asked` chunks that
    /// found no L1 memory, even after eviction: they are left out.
    fn note_store_oom(&mut self, oom: u64, asked: usize) {
        if oom == 0 {
            return;
        }
        self.store_oom_chunks += oom;
        let (used, cap) = self.l1.usage();
        let st = self.l1.status(self.now());
        kvshard_io::log_limited!(
            log::Level::Warn,
            "shard {}: {oom} of {asked} chunks of a store found no L1 memory and are left out \
             ({used} of {cap} bytes used, {} objects read-locked, {} staged; policy {:?})",
            self.cfg.id,
            st.read_locked_count,
            st.staging_object_count,
            self.l1.policy().config().policy
        );
    }

    /// At start: a slice faulted whole at start (`--no-l1-use-lazy`) is
    /// locked whole; a lazy one is faulted (and locked) by the faulting
    /// thread, ahead of use, starting now.
    fn lock_at_start(&self) {
        if self.cfg.prefault.is_some() {
            return self.fault_ahead(0);
        }
        let Backing::Memory(arena) = &self.backing else {
            return;
        };
        if !self.cfg.lock_memory {
            return;
        }
        if let Err(e) = arena.lock_range(self.cfg.slice_offset, self.cfg.max_capacity_bytes) {
            log::warn!(
                "shard {}: could not mlock L1 memory ({e}); pages may be swapped out. \
                 Raise the limit with `ulimit -l unlimited` or LimitMEMLOCK=infinity in the systemd unit",
                self.cfg.id
            );
        }
    }

    fn handle(&mut self, op: ShardOp) -> ShardReplyBody {
        let now = self.now();
        match op {
            ShardOp::Lookup { keys, readers, .. } => {
                let (found, slabs) = self.lookup_l1(&keys, readers, now);
                ShardReplyBody::Found { found, slabs }
            }
            ShardOp::Load { .. } | ShardOp::UnlockL2 { .. } => {
                unreachable!("L2 ops are dispatched by run_shard")
            }
            ShardOp::Release { keys, count } => {
                self.l1.finish_read(&keys, count, now);
                ShardReplyBody::Done
            }
            ShardOp::Touch { keys } => {
                self.l1.touch(&keys, now);
                ShardReplyBody::Done
            }
            ShardOp::ReserveWrite { keys, sizes, tag } => {
                let mut slabs = vec![None; keys.len()];
                for (size, idx) in by_object_group(&sizes, keys.iter()) {
                    let part: Vec<ObjectKey> = idx.iter().map(|&i| keys[i]).collect();
                    self.maybe_grow(size * part.len() as u64, None);
                    let res = self.l1.reserve_write(&part, size, tag, false, now);
                    self.note_store_oom(count_oom(&res), part.len());
                    for (&i, r) in idx.iter().zip(res) {
                        slabs[i] = r.ok();
                    }
                }
                ShardReplyBody::Slabs(slabs)
            }
            ShardOp::GrantCredits { size, count } => {
                self.maybe_grow(size.saturating_mul(count as u64), None);
                let slabs = self.l1.grant_credits(size, count as usize, now);
                ShardReplyBody::Slabs(slabs.into_iter().map(Some).collect())
            }
            ShardOp::ReturnCredits { slabs } => {
                self.l1.return_credits(&slabs);
                ShardReplyBody::Done
            }
            ShardOp::AdoptWrite { writes, size, tag } => {
                let res = self.l1.adopt_write(&writes, size, tag, now);
                let refused = res.iter().filter(|r| r.is_err()).count();
                if refused > 0 {
                    // Only a front that lost track of its credits gets here;
                    // a refused slab stays lent (its writer may be writing).
                    log::error!(
                        "shard {}: {refused} of {} writes could not be staged in their credits (tag {tag})",
                        self.cfg.id,
                        writes.len()
                    );
                }
                ShardReplyBody::Done
            }
            ShardOp::FinishWrite { keys, tag } => {
                let res = self.l1.finish_write(&keys, tag, now);
                self.note_admitted(keys, &res);
                ShardReplyBody::Done
            }
            ShardOp::AbortWrite { keys, tag } => {
                self.l1.abort_write(&keys, tag);
                ShardReplyBody::Done
            }
            ShardOp::ReadLocked { keys, take } => ShardReplyBody::Slabs(
                keys.iter()
                    .enumerate()
                    .map(|(i, k)| self.lock_for_transfer(k, take.get(i) == Some(&true), now))
                    .collect(),
            ),
            ShardOp::Store { .. } | ShardOp::Retrieve { .. } => {
                unreachable!("copies are dispatched by run_shard")
            }
            ShardOp::Clear { force } => ShardReplyBody::Count(self.l1.clear(force, now) as u64),
            ShardOp::Status => ShardReplyBody::Status(Box::new(self.report(now))),
            ShardOp::SetQuota {
                cache_salt,
                limit_bytes,
            } => {
                self.l1.policy_mut().set_quota(&cache_salt, limit_bytes);
                ShardReplyBody::Done
            }
            ShardOp::RemoveQuota { cache_salt } => {
                self.l1.policy_mut().remove_quota(&cache_salt);
                ShardReplyBody::Done
            }
            ShardOp::ResetStats => {
                self.l1.reset_stats();
                self.store_oom_chunks = 0;
                ShardReplyBody::Done
            }
        }
    }

    /// The slab of `key` if a lookup read-locked it, for a transfer that
    /// holds one of those locks, or one more taken for it when `take`.
    fn lock_for_transfer(&mut self, key: &ObjectKey, take: bool, now: Instant) -> Option<Slab> {
        let slab = self.l1.read_locked(key, now).ok()?;
        if take {
            self.l1
                .reserve_read(std::slice::from_ref(key), 1, now)
                .pop()?
                .ok()?;
        }
        Some(slab)
    }

    /// L1 part of a lookup: read-lock and touch the hits. Returns per key its
    /// place ([`Found`]) and its slab's offset ([`NO_SLAB`] for a miss).
    fn lookup_l1(
        &mut self,
        keys: &[ObjectKey],
        readers: u32,
        now: Instant,
    ) -> (Vec<Found>, Vec<u64>) {
        let res = self.l1.reserve_read(keys, readers, now);
        let found: Vec<Found> = res
            .iter()
            .map(|r| if r.is_ok() { Found::L1 } else { Found::Miss })
            .collect();
        let slabs: Vec<u64> = res
            .iter()
            .map(|r| r.as_ref().map_or(NO_SLAB, |s| s.offset))
            .collect();
        let hit_keys: Vec<ObjectKey> = keys
            .iter()
            .zip(&found)
            .filter(|(_, f)| **f == Found::L1)
            .map(|(k, _)| *k)
            .collect();
        if !hit_keys.is_empty() {
            self.l1.touch(&hit_keys, now);
        }
        (found, slabs)
    }

    /// Remembers the keys a finish_write made resident, for the store controller.
    fn note_admitted(&mut self, keys: Vec<ObjectKey>, res: &[Result<Admission, L1Error>]) {
        for (k, r) in keys.into_iter().zip(res) {
            if matches!(r, Ok(Admission::Admitted)) {
                self.to_l2.push(k);
            }
        }
    }

    /// Reserves the L1 writes of a STORE. Returns one outcome per item
    /// (`Stored` for the reserved ones, to be settled by [`Self::end_store`])
    /// and the reserved items with their positions.
    fn reserve_store(
        &mut self,
        items: Vec<(ObjectKey, Vec<i64>)>,
        size: u64,
        tag: WriterTag,
        now: Instant,
    ) -> (Vec<StoreOutcome>, Vec<StagedStore>) {
        let keys: Vec<ObjectKey> = items.iter().map(|(k, _)| *k).collect();
        self.maybe_grow(size * keys.len() as u64, None);
        let reserved = self.l1.reserve_write(&keys, size, tag, false, now);
        let oom = count_oom(&reserved);
        if oom > 0 && size > self.cfg.max_capacity_bytes {
            kvshard_io::log_limited!(
                log::Level::Error,
                "store refused: one object is {size} bytes, more than shard {}'s whole L1 of {} bytes \
                 (--l1-size-gb split over the shards); raise --l1-size-gb or lower --chunk-size",
                self.cfg.id,
                self.cfg.max_capacity_bytes
            );
        }
        self.note_store_oom(oom, keys.len());
        let mut out = Vec::with_capacity(keys.len());
        let mut staged = Vec::new();
        for (i, ((key, blocks), res)) in items.into_iter().zip(reserved).enumerate() {
            match res {
                Ok(slab) => {
                    staged.push(StagedStore {
                        index: i,
                        key,
                        blocks,
                        slab,
                    });
                    out.push(StoreOutcome::Stored);
                }
                Err(L1Error::OutOfMemory) => out.push(StoreOutcome::OutOfMemory),
                Err(_) => out.push(StoreOutcome::AlreadyPresent),
            }
        }
        (out, staged)
    }

    /// Makes the written keys resident and drops the failed reservations.
    fn end_store(
        &mut self,
        written: Vec<ObjectKey>,
        failed: Vec<ObjectKey>,
        tag: WriterTag,
        now: Instant,
    ) {
        if !written.is_empty() {
            let res = self.l1.finish_write(&written, tag, now);
            self.note_admitted(written, &res);
        }
        if !failed.is_empty() {
            self.l1.abort_write(&failed, tag);
        }
    }

    fn report(&self, now: Instant) -> ShardReport {
        ShardReport {
            status: self.l1.status(now),
            stats: *self.l1.stats(),
            capacity_max_bytes: self.cfg.max_capacity_bytes,
            bytes_by_salt: self
                .l1
                .bytes_by_salt()
                .map(|(s, b)| (s.to_owned(), b))
                .collect(),
            mailbox_full: 0,
            store_oom_chunks: self.store_oom_chunks,
            write_credit_bytes: self.l1.credits().1,
            l2: Vec::new(),
            l2_ctl: L2CtlStats::default(),
            l1_slab: self.slab_l1().map(|s| s.status()),
        }
    }

    fn tick(&mut self) {
        let now = self.now();
        self.l1.expire(now);
        let mark = self.l1.policy().config().trigger_watermark;
        self.maybe_grow(0, Some(mark));
        self.l1.evict(now);
        kvshard_io::log_limit::flush(now);
    }
}

/// Reservations refused for lack of L1 memory.
pub(crate) fn count_oom<T>(res: &[Result<T, L1Error>]) -> u64 {
    res.iter()
        .filter(|r| matches!(r, Err(L1Error::OutOfMemory)))
        .count() as u64
}

/// A STORE item whose L1 write is reserved.
struct StagedStore {
    /// Position in the request.
    index: usize,
    key: ObjectKey,
    blocks: Vec<i64>,
    slab: Slab,
}

/// Gathers one chunk into `dst`; false (logged) if the worker's blocks do
/// not make one.
fn gather_logged(
    reg: &CpuShmRegistration,
    key: &ObjectKey,
    blocks: &[i64],
    dst: &mut [u8],
) -> bool {
    match reg.gather_group(key.object_group_id as usize, blocks, dst) {
        Ok(()) => true,
        Err(e) => {
            kvshard_io::log_limited!(log::Level::Error, "store of {key:?} failed in gather: {e}");
            false
        }
    }
}

/// A message's keys by object group: each group's object size and the
/// keys' positions, groups in order of first appearance. Keys of a group
/// whose size is unknown (0) are left out: nothing of theirs can exist.
fn by_object_group<'k>(
    sizes: &ObjectSizes,
    keys: impl Iterator<Item = &'k ObjectKey>,
) -> Vec<(u64, Vec<usize>)> {
    let mut groups: Vec<(u32, u64, Vec<usize>)> = Vec::new();
    for (i, k) in keys.enumerate() {
        let og = k.object_group_id;
        match groups.iter_mut().find(|(g, ..)| *g == og) {
            Some((.., idx)) => idx.push(i),
            None => groups.push((og, sizes.group(og), vec![i])),
        }
    }
    groups
        .into_iter()
        .filter(|(_, size, _)| *size > 0)
        .map(|(_, size, idx)| (size, idx))
        .collect()
}

/// Scatters one object (`src` may run past it into the slab's padding)
/// into the worker's blocks; false (logged) on failure.
fn scatter_logged(
    reg: &CpuShmRegistration,
    key: &ObjectKey,
    src: &[u8],
    blocks: &[i64],
    skip: usize,
) -> bool {
    let og = key.object_group_id as usize;
    let len = reg
        .object_groups()
        .get(og)
        .map_or(0, |o| o.layout.bytes as usize);
    let Some(object) = src.get(..len) else {
        kvshard_io::log_limited!(
            log::Level::Error,
            "retrieve of {key:?} failed: the object is {} bytes, the registered layout needs {len}",
            src.len()
        );
        return false;
    };
    match reg.scatter_group(og, object, blocks, skip) {
        Ok(()) => true,
        Err(e) => {
            kvshard_io::log_limited!(
                log::Level::Error,
                "retrieve of {key:?} failed in scatter: {e}"
            );
            false
        }
    }
}

/// lmcache_driven STORE into a memory-backed L1, run on the shard's copy
/// task queue: the objects are reserved at once, then each is gathered from
/// the worker's blocks in one synchronous copy, yielding between objects so
/// the shard's message loop and tickers keep their share. Before each copy
/// the reservation is renewed: a stage that expired meanwhile may belong to
/// another writer already, so it is never written.
async fn store_in_memory(
    state: &State,
    reg: &CpuShmRegistration,
    items: Vec<(ObjectKey, Vec<i64>)>,
    size: u64,
    tag: WriterTag,
) -> Vec<StoreOutcome> {
    let now = now_of(state);
    let (mut out, staged) = state.borrow_mut().reserve_store(items, size, tag, now);
    let (mut written, mut failed) = (Vec::new(), Vec::new());
    for st in staged {
        glommio::yield_if_needed().await;
        let mut shard = state.borrow_mut();
        let now = shard.now();
        let live = shard
            .l1
            .renew_write(std::slice::from_ref(&st.key), tag, now);
        if live != [true] {
            out[st.index] = StoreOutcome::Failed;
            failed.push(st.key);
            continue;
        }
        // SAFETY: the stage is live for this writer only (just renewed, and
        // nothing else runs on this thread until the copy returns); nobody
        // reads it before finish_write.
        let dst = unsafe { std::slice::from_raw_parts_mut(shard.ptr(&st.slab), size as usize) };
        drop(shard);
        if gather_logged(reg, &st.key, &st.blocks, dst) {
            written.push(st.key);
        } else {
            out[st.index] = StoreOutcome::Failed;
            failed.push(st.key);
        }
    }
    let now = now_of(state);
    state.borrow_mut().end_store(written, failed, tag, now);
    out
}

/// lmcache_driven RETRIEVE from a memory-backed L1, on the copy task queue:
/// each object is looked up read-locked right before its synchronous
/// scatter (a lock that expired during an earlier yield is a miss), and one
/// lock per retrieved object is released at the end.
async fn retrieve_in_memory(
    state: &State,
    reg: &CpuShmRegistration,
    items: Vec<RetrieveItem>,
) -> Vec<bool> {
    let mut out = Vec::with_capacity(items.len());
    let mut done = Vec::with_capacity(items.len());
    for RetrieveItem {
        key,
        blocks,
        skip,
        take,
    } in items
    {
        glommio::yield_if_needed().await;
        let mut shard = state.borrow_mut();
        let now = shard.now();
        match shard.lock_for_transfer(&key, take, now) {
            Some(slab) => {
                // SAFETY: the object is read-locked, so it is neither freed
                // nor rewritten while this synchronous copy runs.
                let src =
                    unsafe { std::slice::from_raw_parts(shard.ptr(&slab), slab.len as usize) };
                drop(shard);
                out.push(scatter_logged(reg, &key, src, &blocks, skip));
                done.push(key);
            }
            None => out.push(false),
        }
    }
    // The one read lock this transfer holds per retrieved key.
    if !done.is_empty() {
        let now = now_of(state);
        state.borrow_mut().l1.finish_read(&done, 1, now);
    }
    out
}

/// lmcache_driven STORE into a slab-backed L1: gather into aligned buffers,
/// write them, then finish the writes (see `l1_slab`).
async fn store_to_slab(
    state: &State,
    slab_l1: &SlabL1,
    reg: &CpuShmRegistration,
    items: Vec<(ObjectKey, Vec<i64>)>,
    size: u64,
    tag: WriterTag,
) -> Vec<StoreOutcome> {
    let now = now_of(state);
    let (mut out, staged) = state.borrow_mut().reserve_store(items, size, tag, now);
    let (mut written, mut failed, mut writes) = (Vec::new(), Vec::new(), Vec::new());
    for st in staged {
        let mut buf = AlignedBuf::zeroed(st.slab.len as usize);
        if gather_logged(reg, &st.key, &st.blocks, &mut buf[..size as usize]) {
            writes.push((st.slab.offset, buf));
            written.push((st.index, st.key));
        } else {
            out[st.index] = StoreOutcome::Failed;
            failed.push(st.key);
        }
    }
    if !writes.is_empty() {
        if let Err(e) = slab_l1.write(writes).await {
            kvshard_io::log_limited!(
                log::Level::Error,
                "store of {} chunks failed writing the L1 slab: {e}",
                written.len()
            );
            for (i, key) in written.drain(..) {
                out[i] = StoreOutcome::Failed;
                failed.push(key);
            }
        }
    }
    let written = written.into_iter().map(|(_, k)| k).collect();
    let now = now_of(state);
    state.borrow_mut().end_store(written, failed, tag, now);
    out
}

/// lmcache_driven RETRIEVE from a slab-backed L1: read the read-locked
/// objects, scatter them, then release one lock each.
async fn retrieve_from_slab(
    state: &State,
    slab_l1: &SlabL1,
    reg: &CpuShmRegistration,
    items: Vec<RetrieveItem>,
) -> Vec<bool> {
    let mut out = vec![false; items.len()];
    let mut locked = Vec::with_capacity(items.len());
    {
        let mut st = state.borrow_mut();
        let now = st.now();
        for (i, it) in items.into_iter().enumerate() {
            if let Some(slab) = st.lock_for_transfer(&it.key, it.take, now) {
                locked.push((i, it.key, it.blocks, it.skip, slab));
            }
        }
    }
    if locked.is_empty() {
        return out;
    }
    let ranges = locked
        .iter()
        .map(|(.., slab)| (slab.offset, slab.len as usize))
        .collect();
    match slab_l1.read(ranges).await {
        Ok(bufs) => {
            for ((i, key, blocks, skip, _), buf) in locked.iter().zip(bufs) {
                out[*i] = scatter_logged(reg, key, &buf, blocks, *skip);
            }
        }
        Err(e) => kvshard_io::log_limited!(
            log::Level::Error,
            "retrieve of {} chunks failed reading the L1 slab: {e}",
            locked.len()
        ),
    }
    let keys: Vec<ObjectKey> = locked.into_iter().map(|(_, k, ..)| k).collect();
    let now = now_of(state);
    state.borrow_mut().l1.finish_read(&keys, 1, now);
    out
}

pub(crate) type State = Rc<RefCell<ShardState>>;

/// The time on the shard's clock (the state borrowed for a moment only).
pub(crate) fn now_of(state: &State) -> Instant {
    state.borrow().now()
}

/// Where a shard's answer to one message goes; the notify queue is only
/// cloned for the messages answered from a spawned task.
#[derive(Clone, Copy)]
struct ReplyAddr {
    seq: Seq,
    shard: usize,
}

impl ReplyAddr {
    fn send(self, replies: &NotifySender<FrontEvent>, body: ShardReplyBody) {
        if self.seq != 0 {
            replies.send(FrontEvent::Shard(ShardReply {
                seq: self.seq,
                shard: self.shard,
                body,
            }));
        }
    }
}

/// How a shard tells the server, once, that it is ready to serve (`Ok`) or
/// why it cannot start (`Err`, worded for the operator, naming the shard).
pub type ShardReady = std::sync::mpsc::Sender<Result<(), String>>;

/// Runs one shard until its mailbox closes. Reports on `ready` once its L2
/// is built; a shard that cannot start returns right after reporting why,
/// dropping what it holds (its share of the arena) and serving nothing.
pub async fn run_shard(
    cfg: ShardConfig,
    backing: ShardBacking,
    l1: L1Shard,
    l2: (L2Settings, usize),
    mut rx: MailboxReceiver<ShardMsg>,
    replies: NotifySender<FrontEvent>,
    ready: ShardReady,
) {
    let id = cfg.id;
    let (interval, drain_limit) = (cfg.eviction_interval, cfg.shutdown_drain);
    rx.set_spin(cfg.spin);
    let l2 = match build_l2(&l2.0, id, l2.1, cfg.clock.clone()) {
        Ok(l2) => l2,
        Err(e) => {
            // The server stops every shard and returns this; a server that is
            // gone already has nobody left to tell.
            let _ = ready.send(Err(e));
            return;
        }
    };
    let state = start_state(cfg, backing, l1);
    let ticker = start_ticker(&state, &l2, interval);
    // Object copies (lmcache_driven STORE and RETRIEVE, megabytes each) run
    // as tasks of their own queue, beside the message loop, so lookups and
    // small messages are not queued behind them.
    let copies = glommio::executor().create_task_queue(
        Shares::Static(1000),
        Latency::NotImportant,
        "copies",
    );
    let shard = Shard {
        id,
        state,
        l2,
        replies,
        copies,
    };
    let _ = ready.send(Ok(()));
    drop(ready);
    shard.serve(&mut rx).await;
    drop(ticker.cancel());
    l2::drain(&shard.l2, id, drain_limit).await;
    log::debug!("shard {id} stopped");
}

/// The shard's L2 tiers, with their usage counted from what they hold.
fn build_l2(
    settings: &L2Settings,
    id: usize,
    shards: usize,
    clock: SharedClock,
) -> Result<Rc<L2Shard>, String> {
    let built = L2Shard::new(settings, id, shards, clock)
        .map_err(|e| format!("shard {id} cannot start: {e}"))?;
    let built = Rc::new(built);
    built.seed_usage(settings, id, shards);
    Ok(built)
}

/// The shard's state over its L1, its slice locked where the start asks.
fn start_state(cfg: ShardConfig, backing: ShardBacking, l1: L1Shard) -> State {
    let backing = match backing {
        ShardBacking::Memory(arena) => Backing::Memory(arena),
        ShardBacking::Slab(slab) => Backing::Slab(Rc::new(SlabL1::new(slab))),
    };
    let state = Rc::new(RefCell::new(ShardState {
        cfg,
        backing,
        l1,
        to_l2: Vec::new(),
        store_oom_chunks: 0,
    }));
    state.borrow().lock_at_start();
    state
}

/// The task that expires, evicts and hands L2 its work every `interval`.
fn start_ticker(state: &State, l2: &Rc<L2Shard>, interval: Duration) -> glommio::Task<()> {
    let (state, l2) = (state.clone(), l2.clone());
    glommio::spawn_local(async move {
        loop {
            glommio::timer::sleep(interval).await;
            state.borrow_mut().tick();
            l2::drop_stored_from_l1(&state, &l2);
            l2::tick(&l2);
        }
    })
}

/// One shard's message loop and what each message needs.
struct Shard {
    id: usize,
    state: State,
    l2: Rc<L2Shard>,
    replies: NotifySender<FrontEvent>,
    copies: glommio::TaskQueueHandle,
}

impl Shard {
    /// Serves the mailbox until it closes.
    async fn serve(&self, rx: &mut MailboxReceiver<ShardMsg>) {
        let mut parker = rx.parker();
        if let Err(e) = &parker {
            log::warn!(
                "shard {}: no persistent wake stream ({e}); parking per message",
                self.id
            );
        }
        loop {
            // Taking the next message never waits while some are queued: give
            // the ticker and the L2 tasks their turn once this task queue's
            // time slice is used up, or a saturating client starves expiry
            // and eviction.
            glommio::yield_if_needed().await;
            let next = match parker.as_mut() {
                Ok(p) => rx.recv_with(p).await,
                Err(_) => rx.recv().await,
            };
            let Some(msg) = next else { break };
            self.handle(msg);
        }
    }

    fn handle(&self, msg: ShardMsg) {
        let to = ReplyAddr {
            seq: msg.seq,
            shard: self.id,
        };
        note_layout(&self.l2, &msg.op);
        match msg.op {
            ShardOp::Lookup {
                keys,
                readers,
                sizes,
                deadline,
            } => self.lookup(to, keys, readers, sizes, deadline),
            ShardOp::Load {
                keys,
                sizes,
                readers,
                tag,
                deadline,
            } => {
                let (state, l2, replies) =
                    (self.state.clone(), self.l2.clone(), self.replies.clone());
                glommio::spawn_local(async move {
                    // One load per object group (each has its own object
                    // size), all at once.
                    let groups = by_object_group(&sizes, keys.iter().map(|(k, _)| k));
                    let loads = groups.iter().map(|(size, idx)| {
                        let part = idx.iter().map(|&i| keys[i]).collect();
                        l2::load_by(&state, &l2, part, *size, readers, tag, deadline)
                    });
                    let done = futures_util::future::join_all(loads).await;
                    let mut ok = vec![false; keys.len()];
                    let mut slabs = vec![NO_SLAB; keys.len()];
                    for ((_, idx), (o, s)) in groups.iter().zip(done) {
                        for ((&i, o), s) in idx.iter().zip(o).zip(s) {
                            ok[i] = o;
                            slabs[i] = s;
                        }
                    }
                    to.send(&replies, ShardReplyBody::Loaded { ok, slabs });
                })
                .detach();
            }
            ShardOp::UnlockL2 { keys } => {
                l2::unlock(&self.l2, &keys);
                to.send(&self.replies, ShardReplyBody::Done);
            }
            ShardOp::Store {
                reg,
                items,
                sizes,
                tag,
            } => self.store(to, reg, items, sizes, tag),
            ShardOp::Retrieve { reg, items } => self.retrieve(to, reg, items),
            op => self.other(to, op),
        }
    }

    /// A lookup: L1 first, then (for the misses, on a task of their own)
    /// the L2 tiers.
    fn lookup(
        &self,
        to: ReplyAddr,
        keys: Vec<ObjectKey>,
        readers: u32,
        sizes: ObjectSizes,
        deadline: Option<L2Deadline>,
    ) {
        let now = now_of(&self.state);
        let (found, slabs) = self.state.borrow_mut().lookup_l1(&keys, readers, now);
        if !self.l2.is_enabled() || found.iter().all(|f| *f == Found::L1) {
            return to.send(&self.replies, ShardReplyBody::Found { found, slabs });
        }
        let (l2, replies) = (self.l2.clone(), self.replies.clone());
        glommio::spawn_local(async move {
            let misses: Vec<usize> = (0..keys.len())
                .filter(|&i| found[i] == Found::Miss)
                .collect();
            let ask: Vec<ObjectKey> = misses.iter().map(|&i| keys[i]).collect();
            let in_l2 = l2::lookup(&l2, &ask, &sizes, deadline).await;
            let mut found = found;
            for (i, f) in misses.into_iter().zip(in_l2) {
                found[i] = f;
            }
            to.send(&replies, ShardReplyBody::Found { found, slabs });
        })
        .detach();
    }

    /// An lmcache_driven STORE, copied on the copies queue.
    fn store(
        &self,
        to: ReplyAddr,
        reg: Arc<CpuShmRegistration>,
        items: Vec<(ObjectKey, Vec<i64>)>,
        sizes: ObjectSizes,
        tag: WriterTag,
    ) {
        let n = items.len();
        let (state, l2, replies) = (self.state.clone(), self.l2.clone(), self.replies.clone());
        let spawned = glommio::spawn_local_into(
            async move {
                let slab = state.borrow().slab_l1();
                // One pass per object group: each has its own object size.
                let mut out = vec![StoreOutcome::Failed; n];
                let groups = by_object_group(&sizes, items.iter().map(|(k, _)| k));
                let mut items: Vec<Option<(ObjectKey, Vec<i64>)>> =
                    items.into_iter().map(Some).collect();
                for (size, idx) in groups {
                    let part = idx.iter().filter_map(|&i| items[i].take()).collect();
                    let o = match &slab {
                        Some(slab) => store_to_slab(&state, slab, &reg, part, size, tag).await,
                        None => store_in_memory(&state, &reg, part, size, tag).await,
                    };
                    for (&i, o) in idx.iter().zip(o) {
                        out[i] = o;
                    }
                }
                let admitted = std::mem::take(&mut state.borrow_mut().to_l2);
                l2::submit_store(&state, &l2, admitted);
                to.send(&replies, ShardReplyBody::Stored(out));
            },
            self.copies,
        );
        if let Err(e) = spawned.map(|t| t.detach()) {
            log::error!("shard {}: cannot start a store's copy task: {e}", self.id);
            to.send(
                &self.replies,
                ShardReplyBody::Stored(vec![StoreOutcome::Failed; n]),
            );
        }
    }

    /// An lmcache_driven RETRIEVE, copied on the copies queue.
    fn retrieve(&self, to: ReplyAddr, reg: Arc<CpuShmRegistration>, items: Vec<RetrieveItem>) {
        let n = items.len();
        let (state, replies) = (self.state.clone(), self.replies.clone());
        let spawned = glommio::spawn_local_into(
            async move {
                let slab = state.borrow().slab_l1();
                let out = match slab {
                    Some(slab) => retrieve_from_slab(&state, &slab, &reg, items).await,
                    None => retrieve_in_memory(&state, &reg, items).await,
                };
                to.send(&replies, ShardReplyBody::Retrieved(out));
            },
            self.copies,
        );
        if let Err(e) = spawned.map(|t| t.detach()) {
            // The lookup's read locks expire by TTL.
            log::error!(
                "shard {}: cannot start a retrieve's copy task: {e}",
                self.id
            );
            to.send(&self.replies, ShardReplyBody::Retrieved(vec![false; n]));
        }
    }

    /// Every other message, answered at once from the shard's state (the
    /// quota and statistics ones reach the L2 controller too).
    fn other(&self, to: ReplyAddr, op: ShardOp) {
        match &op {
            ShardOp::SetQuota {
                cache_salt,
                limit_bytes,
            } => self.l2.set_quota(cache_salt, *limit_bytes),
            ShardOp::RemoveQuota { cache_salt } => self.l2.remove_quota(cache_salt),
            ShardOp::ResetStats => self.l2.reset_stats(),
            _ => {}
        }
        let body = {
            let mut st = self.state.borrow_mut();
            let mut body = st.handle(op);
            if let ShardReplyBody::Status(r) = &mut body {
                r.l2 = self.l2.reports();
                r.l2_ctl = self.l2.stats();
            }
            body
        };
        let admitted = std::mem::take(&mut self.state.borrow_mut().to_l2);
        l2::submit_store(&self.state, &self.l2, admitted);
        to.send(&self.replies, body);
    }
}

/// Tells L2 the size a message's keys have: a request names its registered
/// layout's full chunk.
fn note_layout(l2: &L2Shard, op: &ShardOp) {
    match op {
        ShardOp::Lookup { keys, sizes, .. } => l2.note_layout(keys, |k| sizes.of(k)),
        ShardOp::ReserveWrite { keys, sizes, .. } => l2.note_layout(keys, |k| sizes.of(k)),
        ShardOp::AdoptWrite { writes, size, .. } => {
            l2.note_layout(writes.iter().map(|(k, _)| k), |_| *size)
        }
        ShardOp::Store { items, sizes, .. } => {
            l2.note_layout(items.iter().map(|(k, _)| k), |k| sizes.of(k))
        }
        _ => {}
    }
}
