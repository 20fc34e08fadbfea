//! A shard's L2 controllers: the store controller (L1 -> every adapter, write
//! behind), the prefetch side (L2 lookups and loads into L1) and the L2
//! eviction ticks, all on the shard's own executor and adapters.
//!
//! - Stores run in a task queue with a smaller share than the one serving
//!   lookups and retrieves, and the bytes being stored at once are bounded (a
//!   semaphore counted in bytes).
//! - An object being stored is read-locked in L1 from the moment its write
//!   finished until every adapter is done with it, so it is neither evicted
//!   nor rewritten while an adapter reads its memory; the lock's TTL is
//!   renewed while the adapters work, however long they take.
//! - Adapters are told the full-chunk object size of every layout a request
//!   names ([`L2Shard::note_layout`]).
//! - Loads go into staged (write-locked) L1 objects that only become visible
//!   when the whole object is in; the write reservations are renewed while
//!   the adapters work, so a slow load never writes memory L1 gave away.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use glommio::sync::Semaphore;
use glommio::{Latency, Shares, TaskQueueHandle};
use kvshard_engine::keys::{Name, ObjectKey};
use kvshard_engine::l1::{L1Error, WriterTag};
use kvshard_engine::l2::config::{AdapterKind, AdapterSpec};
use kvshard_engine::l2::fs::FsAdapter;
use kvshard_engine::l2::health::L2Op;
use kvshard_engine::l2::mock::MockAdapter;
use kvshard_engine::l2::tier::L2Tier;
use kvshard_engine::l2::{kv_rank_world_size, L2Adapter, ObjectBytes, StoreResult};
use kvshard_gds::slab::AlignedBuf;
use kvshard_io::clock::SharedClock;

use crate::messages::{Found, L2CtlStats, L2Deadline, ObjectSizes, TierReport, NO_SLAB};
use crate::shard::State;

/// Full-chunk object sizes of one model by (world size, object group).
type GroupSizes = HashMap<(u32, u32), u64>;
use kvshard_messages::config::{L2PrefetchPolicy, L2Settings, L2StorePolicy};

pub struct L2Shard {
    pub tiers: Vec<L2Tier>,
    store_policy: L2StorePolicy,
    prefetch_policy: L2PrefetchPolicy,
    budget: Semaphore,
    budget_bytes: u64,
    queue: TaskQueueHandle,
    stats: Cell<L2CtlStats>,
    evicting: Cell<bool>,
    /// Store tasks submitted and not finished (waiting for budget included).
    pending_stores: Cell<u64>,
    /// skip_l1: stored keys that were read-locked (a reader got to them first)
    /// when the store finished; dropped from L1 once unlocked.
    skip_l1_later: RefCell<Vec<ObjectKey>>,
    /// Full-chunk object sizes the adapters were told, by model name, then
    /// world size and object group.
    layouts: RefCell<HashMap<Name, GroupSizes>>,
    /// Where the controller reads the time (the shard's clock).
    clock: SharedClock,
}

/// Tier names: `<type>#<flag position>`, e.g. `fs#1`.
pub fn tier_name(spec: &AdapterSpec, index: usize) -> String {
    format!("{}#{}", spec.type_name(), index + 1)
}

fn build_adapter(
    spec: &AdapterSpec,
    shard: usize,
    num_shards: usize,
) -> std::io::Result<Box<dyn L2Adapter>> {
    Ok(match &spec.kind {
        AdapterKind::Mock(m) => Box::new(MockAdapter::new(m, shard, num_shards)),
        AdapterKind::Fs(f) => Box::new(FsAdapter::new(f, shard, num_shards)?),
        AdapterKind::S3(c) => {
            let store = kvshard_engine::l2::s3::S3Store::connect(c, num_shards)?;
            Box::new(kvshard_engine::l2::s3::S3Adapter::new(
                c,
                Rc::new(store),
                shard,
                num_shards,
            ))
        }
        AdapterKind::Resp(c) => Box::new(kvshard_engine::l2::resp::RespAdapter::new(
            c, shard, num_shards,
        )?),
    })
}

impl L2Shard {
    /// The time on the shard's clock.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Builds this shard's adapter instances. Must run on the shard's executor.
    pub fn new(
        settings: &L2Settings,
        shard: usize,
        num_shards: usize,
        clock: SharedClock,
    ) -> Result<Self, String> {
        let mut tiers = Vec::with_capacity(settings.adapters.len());
        for (i, spec) in settings.adapters.iter().enumerate() {
            let name = tier_name(spec, i);
            let adapter = build_adapter(spec, shard, num_shards)
                .map_err(|e| format!("L2 adapter {name}: {e}"))?;
            tiers.push(L2Tier::new(name, adapter, spec.eviction.clone()));
        }
        let budget_bytes = (settings.store_inflight_bytes / num_shards.max(1) as u64).max(1);
        let queue =
            glommio::executor().create_task_queue(Shares::Static(100), Latency::NotImportant, "l2");
        Ok(L2Shard {
            clock,
            tiers,
            store_policy: settings.store_policy,
            prefetch_policy: settings.prefetch_policy,
            budget: Semaphore::new(budget_bytes),
            budget_bytes,
            queue,
            stats: Cell::new(L2CtlStats::default()),
            evicting: Cell::new(false),
            pending_stores: Cell::new(0),
            skip_l1_later: RefCell::new(Vec::new()),
            layouts: RefCell::new(HashMap::new()),
        })
    }

    /// A request named objects of `size(key)` bytes (its registered
    /// layout's full chunk of the key's object group) for `keys`: tells every
    /// adapter the size for the keys' model, world size and object group,
    /// when it is new or changed.
    pub fn note_layout<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k ObjectKey>,
        size_of: impl Fn(&ObjectKey) -> u64,
    ) {
        if self.tiers.is_empty() {
            return;
        }
        let mut last: Option<(Name, (u32, u32))> = None;
        for key in keys {
            let group = (kv_rank_world_size(key.kv_rank), key.object_group_id);
            let size = size_of(key);
            let this = (key.model_name, group);
            if last == Some(this) {
                continue;
            }
            last = Some(this);
            let known = self
                .layouts
                .borrow()
                .get(&this.0)
                .and_then(|m| m.get(&group))
                .copied();
            if known == Some(size) {
                continue;
            }
            self.layouts
                .borrow_mut()
                .entry(key.model_name)
                .or_default()
                .insert(group, size);
            for t in &self.tiers {
                t.adapter()
                    .set_full_chunk_size(&key.model_name, group.0, group.1, size);
            }
        }
    }

    /// Starts counting what the adapters already hold (an fs adapter with a
    /// capacity, an s3 adapter with `s3_seed_usage_on_start`), in the
    /// background on the L2 task queue; `/status` shows the progress.
    pub fn seed_usage(self: &Rc<Self>, settings: &L2Settings, shard: usize, num_shards: usize) {
        for (t, spec) in settings.adapters.iter().enumerate() {
            if !spec.seed_usage_on_start() {
                continue;
            }
            let l2 = self.clone();
            let spawned = glommio::spawn_local_into(
                async move {
                    let tier = &l2.tiers[t];
                    match tier.seed_usage(shard, num_shards).await {
                        Ok(n) => log::info!(
                            "shard {shard}: {}: counted {n} objects already stored ({} bytes)",
                            tier.name(),
                            tier.usage().used_bytes
                        ),
                        Err(e) => {
                            log::warn!("shard {shard}: {}: usage seeding stopped: {e}", tier.name())
                        }
                    }
                },
                self.queue,
            );
            match spawned {
                Ok(task) => {
                    task.detach();
                }
                Err(e) => log::warn!("shard {shard}: cannot start usage seeding: {e}"),
            }
        }
    }

    pub fn is_enabled(&self) -> bool {
        !self.tiers.is_empty()
    }

    pub fn stats(&self) -> L2CtlStats {
        self.stats.get()
    }

    fn bump(&self, f: impl FnOnce(&mut L2CtlStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    pub fn reset_stats(&self) {
        let s = self.stats.get();
        // In-flight gauges survive a reset.
        self.stats.set(L2CtlStats {
            inflight_stores: s.inflight_stores,
            inflight_store_bytes: s.inflight_store_bytes,
            inflight_loads: s.inflight_loads,
            inflight_load_bytes: s.inflight_load_bytes,
            ..L2CtlStats::default()
        });
        for t in &self.tiers {
            t.reset_stats();
        }
    }

    pub fn reports(&self) -> Vec<TierReport> {
        self.tiers
            .iter()
            .map(|t| TierReport {
                name: t.name().to_owned(),
                usage: t.usage(),
                stats: t.stats(),
                status: t.status(),
            })
            .collect()
    }

    pub fn set_quota(&self, salt: &str, limit_bytes: u64) {
        for t in &self.tiers {
            t.set_quota(salt, limit_bytes);
        }
    }

    pub fn remove_quota(&self, salt: &str) {
        for t in &self.tiers {
            t.remove_quota(salt);
        }
    }
}

/// Store controller: `keys` just became resident in L1 (not temporary). Locks
/// them and writes them behind to every adapter.
pub(crate) fn submit_store(state: &State, l2: &Rc<L2Shard>, keys: Vec<ObjectKey>) {
    if !l2.is_enabled() || keys.is_empty() {
        return;
    }
    let now = l2.now();
    let locked: Vec<(ObjectKey, u64)> = {
        let mut st = state.borrow_mut();
        let res = st.l1.reserve_read(&keys, 1, now);
        keys.into_iter()
            .zip(res)
            .filter_map(|(k, r)| r.ok().map(|slab| (k, slab.len)))
            .collect()
    };
    if locked.is_empty() {
        return;
    }
    let bytes: u64 = locked.iter().map(|(_, b)| *b).sum();
    l2.bump(|s| {
        s.store_submitted_requests += 1;
        s.store_submitted_objects += locked.len() as u64;
    });
    let (state, l2c) = (state.clone(), l2.clone());
    l2.pending_stores.set(l2.pending_stores.get() + 1);
    let spawned = glommio::spawn_local_into(
        async move {
            store_task(state, l2c.clone(), locked, bytes).await;
            l2c.pending_stores.set(l2c.pending_stores.get() - 1);
        },
        l2.queue,
    );
    match spawned {
        Ok(t) => {
            t.detach();
        }
        Err(e) => {
            // Only at shutdown; the read locks expire by TTL.
            l2.pending_stores.set(l2.pending_stores.get() - 1);
            log::error!("cannot start an L2 store task: {e}");
        }
    }
}

async fn store_task(state: State, l2: Rc<L2Shard>, locked: Vec<(ObjectKey, u64)>, bytes: u64) {
    let units = bytes.min(l2.budget_bytes);
    if l2.budget.acquire(units).await.is_err() {
        // Closed at shutdown: give the locks back.
        let keys: Vec<ObjectKey> = locked.into_iter().map(|(k, _)| k).collect();
        state.borrow_mut().l1.finish_read(&keys, 1, l2.now());
        return;
    }
    l2.bump(|s| {
        s.inflight_stores += 1;
        s.inflight_store_bytes += bytes;
    });
    // The read lock taken at submission must still be live: an object whose
    // lock expired while waiting may have been evicted and its memory reused.
    let now = l2.now();
    let mut items = Vec::with_capacity(locked.len());
    let mut expired = Vec::new();
    let slab_l1 = state.borrow().slab_l1();
    // Objects of a slab-backed L1, to read into `staged` first.
    let mut from_slab = Vec::new();
    let (keys, renew_every) = {
        let mut st = state.borrow_mut();
        for (key, _) in locked {
            match st.l1.read_locked(&key, now) {
                Ok(slab) => {
                    // The object's own size: the slab is that rounded up to
                    // the L1 alignment, and the bytes past the object are not
                    // part of it (an adapter would store them, and the
                    // object would never match its layout again).
                    let size = st.l1.info(&key, now).map_or(slab.len, |i| i.size);
                    if slab_l1.is_some() {
                        from_slab.push((key, slab, size));
                        continue;
                    }
                    // SAFETY: read-locked in L1 until finish_read below (the
                    // lock is renewed while the adapters work), so the memory
                    // is neither freed nor written while adapters read it.
                    let bytes = unsafe { ObjectBytes::new(st.ptr(&slab), size as usize) };
                    items.push((key, bytes));
                }
                Err(_) => expired.push(key),
            }
        }
        let keys: Vec<ObjectKey> = items
            .iter()
            .map(|(k, _)| k)
            .chain(from_slab.iter().map(|(k, ..)| k))
            .cloned()
            .collect();
        st.l1.renew_read(&keys, now);
        let every = (st.l1.config().read_ttl / 4).max(Duration::from_millis(100));
        (keys, every)
    };
    // Owns the copies the adapters read from a slab-backed L1, until the end.
    let mut staged: Vec<AlignedBuf> = match &slab_l1 {
        Some(slab_l1) if !from_slab.is_empty() => {
            let ranges = from_slab
                .iter()
                .map(|(_, slab, _)| (slab.offset, slab.len as usize))
                .collect();
            slab_l1.read(ranges).await.unwrap_or_else(|e| {
                kvshard_io::log_limited!(
                    log::Level::Error,
                    "{} objects were not stored to L2: reading them from the L1 slab failed: {e}",
                    from_slab.len()
                );
                Vec::new()
            })
        }
        _ => Vec::new(),
    };
    // Without buffers (the read failed) the zip leaves the objects out.
    for ((key, _, size), buf) in from_slab.into_iter().zip(staged.iter_mut()) {
        // SAFETY: `staged` owns the buffer and outlives every adapter call
        // below; nothing else touches it.
        let bytes = unsafe { ObjectBytes::new(buf.as_mut_ptr(), size as usize) };
        items.push((key, bytes));
    }
    if !expired.is_empty() {
        kvshard_io::log_limited!(
            log::Level::Warn,
            "{} objects were not stored to L2: their L1 read lock expired while waiting for the L2 store budget",
            expired.len()
        );
        l2.bump(|s| s.store_lock_expired_objects += expired.len() as u64);
    }
    let mut stored_anywhere = vec![false; items.len()];
    let stores = async {
        for tier in &l2.tiers {
            let res = tier.store(&items).await;
            for (i, r) in res.iter().enumerate() {
                if matches!(r, StoreResult::Stored(_) | StoreResult::Exists) {
                    stored_anywhere[i] = true;
                }
            }
        }
    };
    // An adapter may hold the memory longer than the read TTL (a slow PUT, or
    // a socket that still reads the body after its request ended): the lock
    // must not lapse under it, or L1 could evict the object and reuse the
    // memory while it is still being read.
    let renew = async {
        loop {
            glommio::timer::sleep(renew_every).await;
            state.borrow_mut().l1.renew_read(&keys, l2.now());
        }
    };
    futures_lite::future::or(stores, renew).await;
    let now = l2.now();
    {
        let mut st = state.borrow_mut();
        st.l1.finish_read(&keys, 1, now);
        if l2.store_policy == L2StorePolicy::SkipL1 {
            let done: Vec<ObjectKey> = items
                .iter()
                .map(|(k, _)| k)
                .zip(&stored_anywhere)
                .filter(|(_, s)| **s)
                .map(|(k, _)| *k)
                .collect();
            let res = st.l1.delete(&done, false, now);
            let n = res.iter().filter(|r| r.is_ok()).count() as u64;
            l2.bump(|s| s.skip_l1_deleted_objects += n);
            let mut later = l2.skip_l1_later.borrow_mut();
            for (k, r) in done.into_iter().zip(res) {
                if r == Err(L1Error::KeyIsLocked) {
                    later.push(k);
                }
            }
        }
    }
    l2.budget.signal(units);
    l2.bump(|s| {
        s.inflight_stores -= 1;
        s.inflight_store_bytes -= bytes;
        s.store_completed_requests += 1;
        s.store_completed_objects += stored_anywhere.iter().filter(|s| **s).count() as u64;
    });
}

/// Looks up `keys` (the L1 misses of a lookup) tier by tier; each key found is
/// locked in the first tier that has it with the expected `size`. A tier that
/// has not answered by `deadline` leaves its keys (and the later tiers') as
/// misses: its lookup goes on, gives back what it locked, and counts against
/// the tier.
pub async fn lookup(
    l2: &Rc<L2Shard>,
    keys: &[ObjectKey],
    sizes: &ObjectSizes,
    deadline: Option<L2Deadline>,
) -> Vec<Found> {
    let mut found = vec![Found::Miss; keys.len()];
    l2.bump(|s| {
        s.prefetch_lookup_requests += 1;
        s.prefetch_lookup_objects += keys.len() as u64;
    });
    let mut pending: Vec<usize> = (0..keys.len()).collect();
    for (t, tier) in l2.tiers.iter().enumerate() {
        if pending.is_empty() {
            break;
        }
        let ask: Vec<ObjectKey> = pending.iter().map(|&i| keys[i]).collect();
        let res = match deadline {
            None => tier.lookup_and_lock(&ask).await,
            Some(d) => match lookup_within(l2, t, ask.clone(), d.at).await {
                Some(res) => {
                    tier.answered(L2Op::Lookup);
                    res
                }
                None => {
                    tier.timed_out(L2Op::Lookup, d.limit);
                    l2.bump(|s| s.prefetch_lookup_timeouts += 1);
                    break;
                }
            },
        };
        let mut wrong = Vec::new();
        let mut still = Vec::new();
        for ((&i, key), r) in pending.iter().zip(ask).zip(res) {
            let size = sizes.of(&key);
            match r {
                Some(s) if s == size => found[i] = Found::L2(t as u8),
                Some(s) => {
                    kvshard_io::log_limited!(
                        log::Level::Warn,
                        "L2 {}: object {key:?} has {s} bytes, the registered layout needs {size}; treated as a miss",
                        tier.name()
                    );
                    l2.bump(|st| st.size_mismatch_objects += 1);
                    wrong.push(key);
                    still.push(i);
                }
                None => still.push(i),
            }
        }
        tier.unlock(&wrong);
        pending = still;
    }
    found
}

/// Tier `t`'s lookup of `keys`, or `None` when it has not answered by `at`.
/// The lookup runs as a task of its own, so it goes on when this gives up on
/// it; what it then locks it unlocks at once (nobody will load it).
async fn lookup_within(
    l2: &Rc<L2Shard>,
    t: usize,
    keys: Vec<ObjectKey>,
    at: Instant,
) -> Option<Vec<Option<u64>>> {
    let late = Rc::new(Cell::new(false));
    let mut task = {
        let (l2, late) = (l2.clone(), late.clone());
        glommio::spawn_local(async move {
            let tier = &l2.tiers[t];
            let res = tier.lookup_and_lock(&keys).await;
            if late.get() {
                let found: Vec<ObjectKey> = keys
                    .iter()
                    .zip(&res)
                    .filter(|(_, r)| r.is_some())
                    .map(|(k, _)| *k)
                    .collect();
                tier.unlock(&found);
                // Late, but it answered: the tier is slow, not gone.
                tier.answered(L2Op::Lookup);
            }
            res
        })
    };
    let left = at.saturating_duration_since(l2.now());
    // The task goes on when this gives up on it: it is only borrowed here.
    let answered = kvshard_io::timeout::with_timeout(left, &mut task).await;
    if answered.is_none() {
        // Nothing runs between the timer and this: a lookup that ended in
        // the meantime was taken above.
        late.set(true);
        task.detach();
    }
    answered
}

/// [`load`], counting against its tiers when it is still running at
/// `deadline` (it goes on to the end: the objects land in L1 for the next
/// request).
pub(crate) async fn load_by(
    state: &State,
    l2: &L2Shard,
    keys: Vec<(ObjectKey, Found)>,
    size: u64,
    readers: u32,
    tag: WriterTag,
    deadline: Option<L2Deadline>,
) -> (Vec<bool>, Vec<u64>) {
    let Some(d) = deadline else {
        return load(state, l2, keys, size, readers, tag).await;
    };
    let tiers: Vec<u8> = {
        let mut t: Vec<u8> = keys
            .iter()
            .filter_map(|(_, f)| match f {
                Found::L2(t) => Some(*t),
                _ => None,
            })
            .collect();
        t.sort_unstable();
        t.dedup();
        t
    };
    let mut work = std::pin::pin!(load(state, l2, keys, size, readers, tag));
    let left = d.at.saturating_duration_since(l2.now());
    // Only borrowed: the load is driven to its end below either way.
    let first = kvshard_io::timeout::with_timeout(left, &mut work).await;
    let of_tiers = |f: &dyn Fn(&L2Tier)| {
        for &t in &tiers {
            if let Some(tier) = l2.tiers.get(t as usize) {
                f(tier);
            }
        }
    };
    match first {
        Some(done) => {
            of_tiers(&|tier| tier.answered(L2Op::Load));
            done
        }
        None => {
            of_tiers(&|tier| tier.timed_out(L2Op::Load, d.limit));
            l2.bump(|s| s.prefetch_load_timeouts += 1);
            let done = work.await;
            if done.0.iter().any(|ok| *ok) {
                // Late, but it loaded: the tier is slow, not gone.
                of_tiers(&|tier| tier.answered(L2Op::Load));
            }
            done
        }
    }
}

/// Releases L2 lookup locks: keys found in an L2 tier.
pub fn unlock(l2: &L2Shard, keys: &[(ObjectKey, Found)]) {
    for (t, tier) in l2.tiers.iter().enumerate() {
        let mine: Vec<ObjectKey> = keys
            .iter()
            .filter(|(_, f)| *f == Found::L2(t as u8))
            .map(|(k, _)| *k)
            .collect();
        tier.unlock(&mine);
    }
}

/// Loads `keys` (locked by [`lookup`] in the tier their code names) into new L1
/// objects of `size` bytes with `readers` read locks each; releases the L2
/// locks. Answers per key whether it is now readable in L1, and where its
/// slab lies if so ([`NO_SLAB`] if not).
pub(crate) async fn load(
    state: &State,
    l2: &L2Shard,
    keys: Vec<(ObjectKey, Found)>,
    size: u64,
    readers: u32,
    tag: WriterTag,
) -> (Vec<bool>, Vec<u64>) {
    let now = l2.now();
    let temporary = l2.prefetch_policy == L2PrefetchPolicy::Default;
    let plain: Vec<ObjectKey> = keys.iter().map(|(k, _)| *k).collect();
    l2.bump(|s| {
        s.prefetch_load_submitted_requests += 1;
        s.prefetch_load_submitted_objects += keys.len() as u64;
        s.inflight_loads += 1;
        s.inflight_load_bytes += size * keys.len() as u64;
    });
    let slabs = {
        let mut st = state.borrow_mut();
        st.maybe_grow(size * plain.len() as u64, None);
        st.l1.reserve_write(&plain, size, tag, temporary, now)
    };
    let oom = crate::shard::count_oom(&slabs);
    if oom > 0 {
        l2.bump(|s| s.prefetch_load_oom_objects += oom);
        kvshard_io::log_limited!(
            log::Level::Warn,
            "{oom} of {} objects found in L2 could not be loaded: no L1 memory for them (misses)",
            plain.len()
        );
    }
    let mut ok = vec![false; keys.len()];
    // Keys that are resident already (another load or a store won the race):
    // read-lock the resident copy instead.
    let mut resident = Vec::new();
    // A slab-backed L1 is loaded through buffers, written to the slab after.
    let slab_l1 = state.borrow().slab_l1();
    let mut bufs: Vec<Option<AlignedBuf>> = (0..keys.len()).map(|_| None).collect();
    // The keys staged for this load, whose write reservations must stay live
    // until the load is finished or aborted below.
    let staged: Vec<ObjectKey> = plain
        .iter()
        .zip(&slabs)
        .filter(|(_, s)| s.is_ok())
        .map(|(k, _)| *k)
        .collect();
    let work = async {
        for (t, tier) in l2.tiers.iter().enumerate() {
            let mut idx = Vec::new();
            let mut items = Vec::new();
            {
                let st = state.borrow();
                for (i, ((key, code), slab)) in keys.iter().zip(&slabs).enumerate() {
                    if *code != Found::L2(t as u8) {
                        continue;
                    }
                    match slab {
                        Ok(slab) => {
                            let ptr = match &slab_l1 {
                                None => st.ptr(slab),
                                Some(_) => bufs[i]
                                    .insert(AlignedBuf::zeroed(slab.len as usize))
                                    .as_mut_ptr(),
                            };
                            // SAFETY: staged for this tag only: invisible to
                            // readers and neither evicted nor handed to another
                            // writer while its write reservation is live, which
                            // `renew` below keeps it until the load is finished
                            // or aborted (or a buffer in `bufs`, which outlives
                            // the load). The load awaits every adapter call.
                            let b = unsafe { ObjectBytes::new(ptr, size as usize) };
                            idx.push(i);
                            items.push((*key, b));
                        }
                        Err(L1Error::KeyNotWritable) => resident.push(i),
                        Err(_) => {}
                    }
                }
            }
            if !items.is_empty() {
                let res = tier.load(&items).await;
                for (i, r) in idx.into_iter().zip(res) {
                    ok[i] = r;
                }
            }
        }
        unlock(l2, &keys);
        if let Some(slab_l1) = &slab_l1 {
            let (mut idx, mut writes) = (Vec::new(), Vec::new());
            for (i, buf) in bufs.iter_mut().enumerate() {
                if let (true, Some(buf), Ok(slab)) = (ok[i], buf.take(), &slabs[i]) {
                    idx.push(i);
                    writes.push((slab.offset, buf));
                }
            }
            // Only into stages that are still ours: a lapsed one may hold
            // another writer's object by now.
            let wkeys: Vec<ObjectKey> = idx.iter().map(|&i| plain[i]).collect();
            let live = state.borrow_mut().l1.renew_write(&wkeys, tag, l2.now());
            let mut lapsed = 0;
            let (mut idx_live, mut writes_live) = (Vec::new(), Vec::new());
            for ((i, w), live) in idx.into_iter().zip(writes).zip(live) {
                if live {
                    idx_live.push(i);
                    writes_live.push(w);
                } else {
                    ok[i] = false;
                    lapsed += 1;
                }
            }
            if lapsed > 0 {
                log_lapsed(lapsed);
            }
            if !writes_live.is_empty() {
                if let Err(e) = slab_l1.write(writes_live).await {
                    kvshard_io::log_limited!(
                        log::Level::Error,
                        "{} objects loaded from L2 were dropped: writing them to the L1 slab failed: {e}",
                        idx_live.len()
                    );
                    for i in idx_live {
                        ok[i] = false;
                    }
                }
            }
        }
    };
    // An adapter may take longer than the write TTL (a slow GET, a busy
    // disk): the reservation must not lapse under it, or L1 could free the
    // stage, or hand it to another writer, and reuse the memory while the
    // adapter still writes into it.
    let renew_every = {
        let ttl = state.borrow().l1.config().write_ttl;
        (ttl / 4).max(Duration::from_millis(100))
    };
    let renew = async {
        loop {
            glommio::timer::sleep(renew_every).await;
            state.borrow_mut().l1.renew_write(&staged, tag, l2.now());
        }
    };
    futures_lite::future::or(work, renew).await;
    let now = l2.now();
    let mut st = state.borrow_mut();
    let (mut done, mut failed) = (Vec::new(), Vec::new());
    for (i, key) in plain.iter().enumerate() {
        if slabs[i].is_ok() {
            if ok[i] {
                done.push((i, *key));
            } else {
                failed.push(*key);
            }
        }
    }
    let done_keys: Vec<ObjectKey> = done.iter().map(|(_, k)| *k).collect();
    let res = st
        .l1
        .finish_write_and_reserve_read(&done_keys, tag, readers, now);
    let mut at = vec![NO_SLAB; keys.len()];
    let mut lapsed = 0;
    for ((i, key), r) in done.into_iter().zip(res) {
        ok[i] = r.is_ok();
        if let Ok(slab) = &r {
            at[i] = slab.offset;
        }
        if r.is_err() {
            // The reservation lapsed (only if the shard stalled for most of
            // the write TTL): the stage is gone or another writer's (nothing
            // of ours to drop), or still ours and expired (dropped now rather
            // than left to the expiry tick).
            lapsed += 1;
            failed.push(key);
        }
    }
    if lapsed > 0 {
        log_lapsed(lapsed);
    }
    if !failed.is_empty() {
        st.l1.abort_write(&failed, tag);
    }
    if !resident.is_empty() {
        let rk: Vec<ObjectKey> = resident.iter().map(|&i| plain[i]).collect();
        for (&i, r) in resident.iter().zip(st.l1.reserve_read(&rk, readers, now)) {
            ok[i] = r.is_ok();
            if let Ok(slab) = r {
                at[i] = slab.offset;
            }
        }
    }
    drop(st);
    let loaded = ok.iter().filter(|b| **b).count() as u64;
    l2.bump(|s| {
        s.inflight_loads -= 1;
        s.inflight_load_bytes -= size * keys.len() as u64;
        s.prefetch_load_completed_objects += loaded;
        s.prefetch_failure_objects += keys.len() as u64 - loaded;
    });
    (ok, at)
}

/// A load's L1 write reservations lapsed before it finished: the objects
/// are dropped, and the memory may have been reused while an adapter wrote it.
fn log_lapsed(n: usize) {
    kvshard_io::log_limited!(
        log::Level::Error,
        "{n} objects loaded from L2 were dropped: their L1 write reservation lapsed before the load finished (the shard stalled for most of --l1-write-ttl-seconds)"
    );
}

/// skip_l1: drops from L1 the stored keys that were locked when their store
/// finished, now that their readers are done (runs every tick).
pub(crate) fn drop_stored_from_l1(state: &State, l2: &L2Shard) {
    let keys = std::mem::take(&mut *l2.skip_l1_later.borrow_mut());
    if keys.is_empty() {
        return;
    }
    let res = state.borrow_mut().l1.delete(&keys, false, l2.now());
    let mut later = l2.skip_l1_later.borrow_mut();
    let mut n = 0;
    for (k, r) in keys.into_iter().zip(res) {
        match r {
            Ok(()) => n += 1,
            Err(L1Error::KeyIsLocked) => later.push(k),
            Err(_) => {}
        }
    }
    l2.bump(|s| s.skip_l1_deleted_objects += n);
}

/// Starts an eviction pass over every tier with an eviction policy, unless
/// the previous pass is still running.
pub fn tick(l2: &Rc<L2Shard>) {
    if !l2.is_enabled() {
        return;
    }
    // Tiers that stopped answering are probed, one probe each at a time, on
    // the shard's main queue: their return is noticed within a second.
    for t in 0..l2.tiers.len() {
        if !l2.tiers[t].is_open() {
            let l2c = l2.clone();
            glommio::spawn_local(async move { l2c.tiers[t].probe().await }).detach();
        }
    }
    if l2.evicting.get() {
        return;
    }
    l2.evicting.set(true);
    let l2c = l2.clone();
    let spawned = glommio::spawn_local_into(
        async move {
            for tier in &l2c.tiers {
                tier.evict_tick().await;
            }
            l2c.evicting.set(false);
        },
        l2.queue,
    );
    match spawned {
        Ok(t) => {
            t.detach();
        }
        Err(e) => {
            l2.evicting.set(false);
            log::error!("cannot start an L2 eviction pass: {e}");
        }
    }
}

/// At shutdown: waits (up to `limit`) for stores in flight to finish, then
/// says what it abandons.
pub async fn drain(l2: &L2Shard, shard: usize, limit: Duration) {
    let until = l2.now() + limit;
    while l2.pending_stores.get() > 0 {
        if l2.now() >= until {
            let s = l2.stats.get();
            log::warn!(
                "shard {shard}: {} L2 store batches ({} bytes being written, the rest waiting \
                 their turn) still pending {:.1} s after the stop (--shutdown-drain-seconds): \
                 abandoned, their objects are not in L2",
                l2.pending_stores.get(),
                s.inflight_store_bytes,
                limit.as_secs_f64()
            );
            return;
        }
        glommio::timer::sleep(Duration::from_millis(20)).await;
    }
}
