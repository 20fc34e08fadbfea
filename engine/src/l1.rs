//! One core's L1 shard: the object table (resident and staging objects, TTL
//! read/write locks) over a [`SlabAllocator`], driven by an
//! [`EvictionPolicy`].
//!
//! Semantics follow lmcache 0.5.6's `L1Manager`:
//!
//! ```text
//! None --reserve_write(key, tag)--> staging (write-locked, invisible to readers)
//! staging --finish_write--> resident (ready)       staging --abort_write--> None
//! resident --reserve_read(n)--> read-locked(n) --finish_read--> ready
//! resident --delete / evict--> None   (never while read-locked or staged)
//! ```
//!
//! A key has at most one resident object and any number of staging objects,
//! one per writer tag. Locks are counters with a deadline ([`TtlLock`]): a
//! writer or reader that vanished stops pinning memory once its TTL passes.
//!
//! The shard holds no pointers and reads no clock: it manages offsets in its
//! arena slice, and every call that depends on time takes `now`. It is owned
//! by one executor and is not shared between threads.
//!
//! Where kvshard differs from 0.5.6 (all deliberate):
//! - `reserve_write` evicts to make room before reporting OUT_OF_MEMORY, and
//!   then fails only the keys that did not fit, not the whole batch.
//! - An expired staging object of any tag (not only the caller's) is taken
//!   over or freed by a new `reserve_write` of the key.
//! - `abort_write` drops the caller's staging object even if its write TTL
//!   has expired (0.5.6 answers KEY_IN_WRONG_STATE and leaves it for eviction).
//! - [`L1Shard::expire`] frees temporary objects nobody holds a live read lock
//!   on once the read TTL has passed since admission; 0.5.6 leaks them under
//!   the `noop` policy.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

use crate::eviction::{eviction_target, EvictionPolicy, PolicyKind, Scope};
use crate::keys::{KeyMap, KeySet, Name, ObjectKey};
use crate::slab::{Slab, SlabAllocator};

/// 0.5.6's `MAX_READ_LOCK_COUNT`: the most read locks one call takes or
/// releases per key.
pub const MAX_READ_LOCK_COUNT: u32 = 128;

/// Longest TTL honoured; longer ones are clamped so deadlines cannot overflow.
const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Identity of a writer: staging objects are keyed by (key, tag). The server
/// makes three kinds ([`WriterTag::worker`], [`WriterTag::load`],
/// [`WriterTag::credit`]), which never collide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WriterTag(pub u64);

impl WriterTag {
    /// Set in the tags the server makes for itself, never in a worker's.
    const INTERNAL: u64 = 1 << 63;
    /// Set, beside [`Self::INTERNAL`], in the tags of writes on credits.
    const CREDIT: u64 = 1 << 62;

    /// The tag of worker instance `iid`'s writes: the id itself. `None` for a
    /// negative id, whose tag would fall among the internal ones (lmcache's
    /// instance ids are `uuid4 & (2^63 - 1)`: never negative).
    pub fn worker(iid: i64) -> Option<WriterTag> {
        u64::try_from(iid).ok().map(WriterTag)
    }

    /// The tag of the server's `n`th L2 load (its staged objects).
    pub fn load(n: u64) -> WriterTag {
        debug_assert!(n & (Self::INTERNAL | Self::CREDIT) == 0);
        WriterTag(Self::INTERNAL | (n & !(Self::INTERNAL | Self::CREDIT)))
    }

    /// The tag of the `n`th prepare_store served from write credits.
    pub fn credit(n: u64) -> WriterTag {
        debug_assert!(n & (Self::INTERNAL | Self::CREDIT) == 0);
        WriterTag(Self::INTERNAL | Self::CREDIT | (n & !(Self::INTERNAL | Self::CREDIT)))
    }
}

/// `worker 7`, `load 3`, `credit 12`: what made the tag, for logs.
impl std::fmt::Display for WriterTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0 & !(Self::INTERNAL | Self::CREDIT);
        match (self.0 & Self::INTERNAL != 0, self.0 & Self::CREDIT != 0) {
            (false, _) => write!(f, "worker {}", self.0),
            (true, false) => write!(f, "load {n}"),
            (true, true) => write!(f, "credit {n}"),
        }
    }
}

/// Per-key failure of an L1 operation (0.5.6 `error.py`'s `L1Error`; success
/// is `Ok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum L1Error {
    /// The key does not exist (or, for writes, the tag stages nothing for it).
    KeyNotExist,
    /// The key exists but is not read-locked.
    KeyNotReadable,
    /// The key is resident, or this writer already stages it.
    KeyNotWritable,
    /// The key is in the wrong state (a lock the call expects has expired).
    KeyInWrongState,
    /// The key is read-locked or staged and cannot be deleted.
    KeyIsLocked,
    /// No room, even after evicting what could be evicted.
    OutOfMemory,
    /// kvshard only: an object size of 0 was asked for.
    InvalidSize,
}

impl L1Error {
    /// 0.5.6's enum name, for logs and status.
    pub fn name(self) -> &'static str {
        match self {
            L1Error::KeyNotExist => "KEY_NOT_EXIST",
            L1Error::KeyNotReadable => "KEY_NOT_READABLE",
            L1Error::KeyNotWritable => "KEY_NOT_WRITABLE",
            L1Error::KeyInWrongState => "KEY_IN_WRONG_STATE",
            L1Error::KeyIsLocked => "KEY_IS_LOCKED",
            L1Error::OutOfMemory => "OUT_OF_MEMORY",
            L1Error::InvalidSize => "INVALID_SIZE",
        }
    }
}

impl fmt::Display for L1Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            L1Error::KeyNotExist => "the specified key does not exist",
            L1Error::KeyNotReadable => "the specified key exists but cannot be read",
            L1Error::KeyNotWritable => "the specified key exists but cannot be written",
            L1Error::KeyInWrongState => "the specified key is in the wrong state for the operation",
            L1Error::KeyIsLocked => "the specified key is locked and cannot perform the operation",
            L1Error::OutOfMemory => "not enough memory to complete the operation",
            L1Error::InvalidSize => "object size must be positive",
        };
        write!(f, "{} ({text})", self.name())
    }
}

impl std::error::Error for L1Error {}

/// Lock lifetimes of a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L1Config {
    /// How long a write reservation pins its staging object
    /// (`--l1-write-ttl-seconds`, default 600 s).
    pub write_ttl: Duration,
    /// How long read locks pin an object (`--l1-read-ttl-seconds`, default
    /// 300 s).
    pub read_ttl: Duration,
    /// Upper clamp of the read-lock count of one call (default 128).
    pub max_read_locks: u32,
}

impl Default for L1Config {
    fn default() -> Self {
        L1Config {
            write_ttl: Duration::from_secs(600),
            read_ttl: Duration::from_secs(300),
            max_read_locks: MAX_READ_LOCK_COUNT,
        }
    }
}

/// A counter with a deadline, as 0.5.6's native `TTLLock`: `lock` increments
/// and refreshes the deadline, restarting from 0 if the deadline had passed;
/// `unlock` decrements with a floor of 0; held while count > 0 and the
/// deadline is ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TtlLock {
    count: u32,
    /// `None` until first locked (an expired state).
    deadline: Option<Instant>,
}

impl TtlLock {
    pub const fn new() -> Self {
        TtlLock {
            count: 0,
            deadline: None,
        }
    }

    /// `n` locks at once, same as `n` calls to a single lock.
    pub fn lock(&mut self, n: u32, now: Instant, ttl: Duration) {
        if self.is_expired(now) {
            self.count = 0;
        }
        self.count = self.count.saturating_add(n);
        self.deadline = Some(now + ttl.min(MAX_TTL));
    }

    pub fn unlock(&mut self, n: u32) {
        self.count = self.count.saturating_sub(n);
    }

    /// Pushes the deadline of a live lock to `now + ttl` (never earlier);
    /// false when the lock is not live.
    pub fn extend(&mut self, now: Instant, ttl: Duration) -> bool {
        if !self.is_locked(now) {
            return false;
        }
        let until = now + ttl.min(MAX_TTL);
        if self.deadline.is_none_or(|d| d < until) {
            self.deadline = Some(until);
        }
        true
    }

    pub fn is_locked(&self, now: Instant) -> bool {
        self.count > 0 && !self.is_expired(now)
    }

    /// Lock count, counting expired locks.
    pub fn count(&self) -> u32 {
        self.count
    }

    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    fn is_expired(&self, now: Instant) -> bool {
        self.deadline.is_none_or(|d| now >= d)
    }
}

/// Result of a successful `finish_write`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The staged object became the resident one.
    Admitted,
    /// Another writer made the key resident first; the staged copy was
    /// dropped (0.5.6 reports SUCCESS for this too).
    AlreadyResident,
}

/// Public view of a resident object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectInfo {
    pub slab: Slab,
    /// Object size asked for at reserve_write (`slab.len` is this, aligned).
    pub size: u64,
    pub temporary: bool,
    /// Live read locks (0 when unlocked or expired).
    pub read_locks: u32,
    pub admitted_at: Instant,
    pub last_access: Instant,
}

/// Snapshot of a shard for `/status` (0.5.6's `report_status` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L1Status {
    /// Resident plus staging objects.
    pub total_object_count: usize,
    /// Staging objects whose write lock is live. Like `read_locked_count`,
    /// exact at any `now` not before the last [`L1Shard::expire`]: a lock
    /// that expired by that pass no longer counts for an earlier `now`.
    pub write_locked_count: usize,
    /// Resident objects whose read lock is live (a release counts at once).
    pub read_locked_count: usize,
    /// Temporary objects, resident and staging.
    pub temporary_count: usize,
    pub staging_object_count: usize,
    /// Bytes (aligned) held by staging objects; part of `memory_used_bytes`.
    pub staging_bytes: u64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
}

/// Monotonic counters of a shard, summed over shards at scrape time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L1Stats {
    /// Keys read-locked by `reserve_read`.
    pub read_chunks: u64,
    /// Keys `reserve_read` did not find.
    pub read_failure_chunks: u64,
    /// Staging objects admitted as resident.
    pub write_chunks: u64,
    /// Keys deleted by eviction (periodic ticks and allocation pressure).
    pub evicted_chunks: u64,
    /// Bytes freed by eviction.
    pub evicted_bytes: u64,
    /// The part of `evicted_chunks` evicted to make room for a reserve_write.
    pub pressure_evicted_chunks: u64,
    pub eviction_loop_ticks: u64,
    /// Ticks that found the shard over its watermark (or a salt over quota).
    pub eviction_loop_triggered: u64,
    /// Keys refused with OUT_OF_MEMORY.
    pub allocation_failure_chunks: u64,
    /// Staging objects freed because their write TTL passed.
    pub expired_stages: u64,
    /// Temporary objects freed by `expire` after their read TTL.
    pub expired_temporaries: u64,
}

/// What one eviction tick did.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EvictOutcome {
    /// used / capacity when the tick started.
    pub usage_ratio: f64,
    /// Whether the watermark (or a salt's quota) was reached.
    pub triggered: bool,
    pub evicted_keys: usize,
    pub evicted_bytes: u64,
}

/// What one `expire` call reclaimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpireOutcome {
    pub stages: usize,
    pub temporaries: usize,
}

#[derive(Debug)]
struct Resident {
    slab: Slab,
    size: u64,
    read_lock: TtlLock,
    temporary: bool,
    admitted_at: Instant,
    last_access: Instant,
}

#[derive(Debug)]
struct Stage {
    tag: WriterTag,
    slab: Slab,
    size: u64,
    write_lock: TtlLock,
    temporary: bool,
}

/// Everything a shard holds for one key. Never empty while in the table.
#[derive(Debug, Default)]
struct Entry {
    resident: Option<Resident>,
    stages: Vec<Stage>,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.resident.is_none() && self.stages.is_empty()
    }
}

/// Bytes freed by evicting the key now, or `None` if it must not be evicted:
/// it has a live write reservation, or its resident object is read-locked.
/// A key with only expired staging objects is evictable.
fn evictable_bytes(entry: &Entry, now: Instant) -> Option<u64> {
    if entry.stages.iter().any(|s| s.write_lock.is_locked(now)) {
        return None;
    }
    let staged: u64 = entry.stages.iter().map(|s| s.slab.len).sum();
    match &entry.resident {
        Some(r) if r.read_lock.is_locked(now) => None,
        Some(r) => Some(r.slab.len + staged),
        None if entry.stages.is_empty() => None,
        None => Some(staged),
    }
}

/// Locks of one kind (read locks of resident objects, or write locks of
/// staging objects) held as of the last sweep, so `/status` need not walk
/// every object.
///
/// A lock is counted while its count is above 0 and its deadline is after
/// `swept_until`, the latest `now` that [`sweep`](Self::sweep) saw (the shard
/// sweeps in [`L1Shard::expire`], every tick). The deadlines of counted
/// locks are kept in order, so the locks live at `now` are the counted ones
/// minus those whose deadline is at or before `now`: exact for any `now` not
/// before the last sweep, and the subtraction only visits locks that expired
/// since then.
#[derive(Debug, Default)]
struct LockCount {
    /// Number of counted locks (the sum of `deadlines`' values).
    held: usize,
    /// Deadline -> number of counted locks with that deadline.
    deadlines: BTreeMap<Instant, usize>,
    swept_until: Option<Instant>,
}

impl LockCount {
    /// The deadline `lock` is counted under, or `None` if it is not counted.
    fn slot(&self, lock: &TtlLock) -> Option<Instant> {
        let deadline = lock.deadline()?;
        (lock.count() > 0 && self.swept_until.is_none_or(|s| deadline > s)).then_some(deadline)
    }

    fn add(&mut self, lock: &TtlLock) {
        self.file(self.slot(lock));
    }

    fn remove(&mut self, lock: &TtlLock) {
        self.unfile(self.slot(lock));
    }

    /// Re-files a lock that changed from counted under `before` (its
    /// [`slot`](Self::slot) before the change) to its current state.
    fn changed(&mut self, before: Option<Instant>, lock: &TtlLock) {
        let after = self.slot(lock);
        if before != after {
            self.unfile(before);
            self.file(after);
        }
    }

    fn file(&mut self, slot: Option<Instant>) {
        if let Some(d) = slot {
            *self.deadlines.entry(d).or_default() += 1;
            self.held += 1;
        }
    }

    fn unfile(&mut self, slot: Option<Instant>) {
        if let Some(d) = slot {
            let n = self
                .deadlines
                .get_mut(&d)
                .expect("counted lock's deadline is indexed");
            *n -= 1;
            if *n == 0 {
                self.deadlines.remove(&d);
            }
            self.held -= 1;
        }
    }

    /// Locks live at `now`; O(log n + locks expired since the last sweep).
    fn live(&self, now: Instant) -> usize {
        let expired: usize = self.deadlines.range(..=now).map(|(_, &n)| n).sum();
        self.held - expired
    }

    /// Stops counting locks whose deadline is at or before `now`;
    /// O(expired locks * log n).
    fn sweep(&mut self, now: Instant) {
        let until = self.swept_until.map_or(now, |s| s.max(now));
        self.swept_until = Some(until);
        while let Some(entry) = self.deadlines.first_entry() {
            if *entry.key() > until {
                break;
            }
            self.held -= entry.remove();
        }
    }

    /// Recounts from every lock of this kind; panics on drift.
    fn validate<'a>(&self, locks: impl Iterator<Item = &'a TtlLock>, what: &str) {
        let mut deadlines: BTreeMap<Instant, usize> = BTreeMap::new();
        for lock in locks {
            if let Some(d) = self.slot(lock) {
                *deadlines.entry(d).or_default() += 1;
            }
        }
        assert_eq!(
            deadlines.values().sum::<usize>(),
            self.held,
            "{what}: held count drifted"
        );
        assert_eq!(deadlines, self.deadlines, "{what}: deadline index drifted");
    }
}

/// The object counts `/status` reports, kept up to date as objects change:
/// every change to an entry is bracketed by [`leave`](Self::leave) and
/// [`enter`](Self::enter), and lock-only changes by [`LockCount::changed`].
#[derive(Debug, Default)]
struct Tally {
    residents: usize,
    stages: usize,
    /// Aligned bytes of staging objects.
    staging_bytes: u64,
    /// Temporary objects, resident and staging.
    temporaries: usize,
    read_locks: LockCount,
    write_locks: LockCount,
}

impl Tally {
    /// Takes `entry`'s objects out of the counts, before it changes.
    fn leave(&mut self, entry: &Entry) {
        if let Some(r) = &entry.resident {
            self.remove_resident(r);
        }
        for s in &entry.stages {
            self.remove_stage(s);
        }
    }

    /// Puts `entry`'s objects into the counts, after it changed.
    fn enter(&mut self, entry: &Entry) {
        if let Some(r) = &entry.resident {
            self.add_resident(r);
        }
        for s in &entry.stages {
            self.add_stage(s);
        }
    }

    fn add_resident(&mut self, r: &Resident) {
        self.residents += 1;
        self.temporaries += r.temporary as usize;
        self.read_locks.add(&r.read_lock);
    }

    fn remove_resident(&mut self, r: &Resident) {
        self.residents -= 1;
        self.temporaries -= r.temporary as usize;
        self.read_locks.remove(&r.read_lock);
    }

    fn add_stage(&mut self, s: &Stage) {
        self.stages += 1;
        self.staging_bytes += s.slab.len;
        self.temporaries += s.temporary as usize;
        self.write_locks.add(&s.write_lock);
    }

    fn remove_stage(&mut self, s: &Stage) {
        self.stages -= 1;
        self.staging_bytes -= s.slab.len;
        self.temporaries -= s.temporary as usize;
        self.write_locks.remove(&s.write_lock);
    }
}

/// One core's L1 object table and memory.
#[derive(Debug)]
pub struct L1Shard {
    alloc: SlabAllocator,
    cfg: L1Config,
    policy: EvictionPolicy,
    entries: KeyMap<ObjectKey, Entry>,
    /// Keys with at least one staging object (what `expire` scans).
    staged_keys: KeySet<ObjectKey>,
    /// Keys whose resident object is temporary.
    temporary_keys: KeySet<ObjectKey>,
    /// cache_salt -> bytes held (resident and staging, aligned).
    bytes_by_salt: KeyMap<Name, u64>,
    /// What `status` reports, so it need not walk the table.
    tally: Tally,
    stats: L1Stats,
    /// Write credits: slabs allocated ahead of any key and lent out (to the
    /// front, which hands them to writers without asking the shard), by
    /// offset. Counted in the allocator's usage; owned by no key and no salt
    /// until [`adopt_write`](L1Shard::adopt_write) stages a key in one.
    credits: HashMap<u64, Slab>,
}

impl L1Shard {
    pub fn new(allocator: SlabAllocator, cfg: L1Config, policy: EvictionPolicy) -> Self {
        L1Shard {
            alloc: allocator,
            cfg,
            policy,
            entries: KeyMap::default(),
            staged_keys: KeySet::default(),
            temporary_keys: KeySet::default(),
            bytes_by_salt: KeyMap::default(),
            tally: Tally::default(),
            stats: L1Stats::default(),
            credits: HashMap::new(),
        }
    }

    pub fn config(&self) -> &L1Config {
        &self.cfg
    }

    pub fn policy(&self) -> &EvictionPolicy {
        &self.policy
    }

    /// For quota changes (`set_quota` / `remove_quota`).
    pub fn policy_mut(&mut self) -> &mut EvictionPolicy {
        &mut self.policy
    }

    /// Zeroes the counters (`POST /metrics/reset`).
    pub fn reset_stats(&mut self) {
        self.stats = L1Stats::default();
    }

    pub fn stats(&self) -> &L1Stats {
        &self.stats
    }

    /// (used_bytes, capacity_bytes) of the shard's memory; 0.5.6's usage.
    pub fn usage(&self) -> (u64, u64) {
        (self.alloc.used_bytes(), self.alloc.capacity_bytes())
    }

    /// Lazy growth: extends the managed memory to `new_capacity` bytes.
    pub fn grow(&mut self, new_capacity: u64) {
        self.alloc.grow(new_capacity);
    }

    pub fn allocator(&self) -> &SlabAllocator {
        &self.alloc
    }

    /// Bytes held per cache_salt (resident and staging), for quotas and
    /// `/quota`.
    pub fn bytes_by_salt(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.bytes_by_salt.iter().map(|(s, &b)| (s.as_str(), b))
    }

    fn read_count(&self, count: u32) -> u32 {
        count.clamp(1, self.cfg.max_read_locks.max(1))
    }

    /// Reserves a staging object of `size` bytes for each key, owned by
    /// `tag`. Per key, in order:
    /// - `KeyNotWritable` if the key is resident, this tag already stages it
    ///   with a live write lock, or the key appears earlier in `keys`;
    /// - an expired staging object of the key (any tag) is taken over when its
    ///   slab has the right length, and other expired ones are freed;
    /// - otherwise memory is allocated. When memory runs out, evictable keys
    ///   are evicted (policy order) to make room; if that cannot make room,
    ///   `OutOfMemory` is returned for the keys that did not fit. Those are
    ///   the last keys (in batch order) that needed new memory: every key
    ///   before them keeps its slab.
    /// - `InvalidSize` for every key if `size` is 0.
    pub fn reserve_write(
        &mut self,
        keys: &[ObjectKey],
        size: u64,
        tag: WriterTag,
        temporary: bool,
        now: Instant,
    ) -> Vec<Result<Slab, L1Error>> {
        if size == 0 {
            return vec![Err(L1Error::InvalidSize); keys.len()];
        }
        let need = self.alloc.aligned_len(size);
        let mut out: Vec<Result<Slab, L1Error>> = Vec::with_capacity(keys.len());
        let mut pending: Vec<usize> = Vec::new();
        let mut reserved: Vec<usize> = Vec::new();
        let mut seen: KeySet<&ObjectKey> =
            KeySet::with_capacity_and_hasher(keys.len(), Default::default());
        let write_ttl = self.cfg.write_ttl;

        for (i, key) in keys.iter().enumerate() {
            if !seen.insert(key) {
                out.push(Err(L1Error::KeyNotWritable));
                continue;
            }
            let Some(entry) = self.entries.get_mut(key) else {
                out.push(Err(L1Error::OutOfMemory)); // placeholder, decided below
                pending.push(i);
                continue;
            };
            if entry.resident.is_some()
                || entry
                    .stages
                    .iter()
                    .any(|s| s.tag == tag && s.write_lock.is_locked(now))
            {
                out.push(Err(L1Error::KeyNotWritable));
                continue;
            }
            self.tally.leave(entry);
            // Take over one expired staging object of the right length (the
            // caller's own first), free the other expired ones.
            let expired = |s: &Stage| !s.write_lock.is_locked(now);
            let fits = |s: &Stage| Some(s.slab.len) == need;
            let reuse = entry
                .stages
                .iter()
                .position(|s| s.tag == tag && expired(s) && fits(s))
                .or_else(|| entry.stages.iter().position(|s| expired(s) && fits(s)));
            let mut taken = reuse.map(|at| entry.stages.swap_remove(at));
            let mut freed = Vec::new();
            entry.stages.retain(|s| {
                if expired(s) {
                    freed.push(s.slab);
                }
                !expired(s)
            });
            self.stats.expired_stages += freed.len() as u64;
            if let Some(stage) = taken.as_mut() {
                kvshard_io::log_limited!(
                    log::Level::Warn,
                    "L1: write reservation of {key:?} (tag {}) expired; handing its slab to tag {}",
                    stage.tag.0,
                    tag.0
                );
                stage.tag = tag;
                stage.size = size;
                stage.temporary = temporary;
                stage.write_lock = TtlLock::new();
                stage.write_lock.lock(1, now, write_ttl);
                out.push(Ok(stage.slab));
                reserved.push(i);
            } else {
                out.push(Err(L1Error::OutOfMemory)); // placeholder, decided below
                pending.push(i);
            }
            if let Some(stage) = taken {
                entry.stages.push(stage);
            }
            self.tally.enter(entry);
            for slab in freed {
                self.release(key.cache_salt, slab);
            }
            self.settle(key);
        }

        // Allocation, with eviction to make room.
        let mut exhausted = need.is_none_or(|n| n > self.alloc.capacity_bytes());
        let need = need.unwrap_or(u64::MAX);
        for (n, &i) in pending.iter().enumerate() {
            let key = &keys[i];
            let slab = loop {
                if let Some(slab) = self.alloc.alloc(size) {
                    break Some(slab);
                }
                if exhausted {
                    break None;
                }
                let remaining = (pending.len() - n) as u64;
                let want = need
                    .saturating_mul(remaining)
                    .saturating_sub(self.alloc.free_bytes())
                    .max(1);
                if self.relieve(key.cache_salt, want, now) == 0 {
                    exhausted = true;
                }
            };
            let Some(slab) = slab else {
                self.stats.allocation_failure_chunks += 1;
                continue; // out[i] already says OutOfMemory
            };
            self.account(key.cache_salt, slab.len);
            self.stage_slab(key, tag, slab, size, temporary, now);
            out[i] = Ok(slab);
            reserved.push(i);
        }

        // Tracked from reservation, so an abandoned one is evicted like any
        // unlocked key (0.5.6 `on_keys_reserved`).
        reserved.sort_unstable();
        self.policy
            .on_keys_created(reserved.iter().map(|&i| &keys[i]));
        out
    }

    /// Admits `tag`'s staging objects as the resident objects of their keys.
    /// `KeyNotExist` if the tag stages nothing for the key, `KeyInWrongState`
    /// if its write lock expired (the object stays staged until reclaimed).
    /// If the key became resident meanwhile, the staged copy is dropped and
    /// the result is `Ok(AlreadyResident)`.
    pub fn finish_write(
        &mut self,
        keys: &[ObjectKey],
        tag: WriterTag,
        now: Instant,
    ) -> Vec<Result<Admission, L1Error>> {
        let mut out = Vec::with_capacity(keys.len());
        let mut admitted: Vec<&ObjectKey> = Vec::new();
        for key in keys {
            let r = self.admit(key, tag, now);
            if let Ok((Admission::Admitted, false)) = r {
                admitted.push(key);
            }
            out.push(r.map(|(a, _)| a));
        }
        // Temporary objects are not announced as written (0.5.6: they must
        // not go to L2); they were tracked at reservation.
        self.policy.on_keys_created(admitted);
        out
    }

    /// [`finish_write`](Self::finish_write), then takes `read_locks` read
    /// locks (clamped to 1..=max) on the now-resident object, in one step so
    /// nothing can evict it in between. Returns the resident slab, which is
    /// another writer's when the key was already resident.
    pub fn finish_write_and_reserve_read(
        &mut self,
        keys: &[ObjectKey],
        tag: WriterTag,
        read_locks: u32,
        now: Instant,
    ) -> Vec<Result<Slab, L1Error>> {
        let count = self.read_count(read_locks);
        let read_ttl = self.cfg.read_ttl;
        let mut out = Vec::with_capacity(keys.len());
        let mut admitted: Vec<&ObjectKey> = Vec::new();
        for key in keys {
            match self.admit(key, tag, now) {
                Ok((admission, _)) => {
                    if admission == Admission::Admitted {
                        admitted.push(key);
                    }
                    let entry = self
                        .entries
                        .get_mut(key)
                        .expect("admitted key has an entry");
                    let resident = entry.resident.as_mut().expect("admitted key is resident");
                    let before = self.tally.read_locks.slot(&resident.read_lock);
                    resident.read_lock.lock(count, now, read_ttl);
                    self.tally.read_locks.changed(before, &resident.read_lock);
                    resident.last_access = now;
                    out.push(Ok(resident.slab));
                }
                Err(e) => out.push(Err(e)),
            }
        }
        self.policy.on_keys_created(admitted);
        out
    }

    /// Moves `tag`'s live staging object of `key` to resident. Returns the
    /// admission and whether the object is temporary.
    fn admit(
        &mut self,
        key: &ObjectKey,
        tag: WriterTag,
        now: Instant,
    ) -> Result<(Admission, bool), L1Error> {
        let entry = self.entries.get_mut(key).ok_or(L1Error::KeyNotExist)?;
        let at = entry
            .stages
            .iter()
            .position(|s| s.tag == tag)
            .ok_or(L1Error::KeyNotExist)?;
        if !entry.stages[at].write_lock.is_locked(now) {
            kvshard_io::log_limited!(
                log::Level::Warn,
                "L1: finish_write on {key:?} (tag {}) after its write reservation expired",
                tag.0
            );
            return Err(L1Error::KeyInWrongState);
        }
        let stage = entry.stages.swap_remove(at);
        self.tally.remove_stage(&stage);
        let result = if entry.resident.is_some() {
            let temporary = stage.temporary;
            self.release(key.cache_salt, stage.slab);
            (Admission::AlreadyResident, temporary)
        } else {
            let resident = entry.resident.insert(Resident {
                slab: stage.slab,
                size: stage.size,
                read_lock: TtlLock::new(),
                temporary: stage.temporary,
                admitted_at: now,
                last_access: now,
            });
            self.tally.add_resident(resident);
            self.stats.write_chunks += 1;
            (Admission::Admitted, stage.temporary)
        };
        self.settle(key);
        Ok(result)
    }

    /// Keeps write reservations alive: `tag`'s staging object of each key,
    /// when its write lock is live, gets its deadline pushed to
    /// `now + write_ttl`. For a writer whose work on the memory can outlast
    /// the TTL (an L2 load). Answers per key whether the reservation was
    /// live: once it was not, the stage may have been freed or handed to
    /// another writer, and its memory must not be written any more.
    pub fn renew_write(&mut self, keys: &[ObjectKey], tag: WriterTag, now: Instant) -> Vec<bool> {
        let write_ttl = self.cfg.write_ttl;
        keys.iter()
            .map(|key| {
                let Some(s) = self
                    .entries
                    .get_mut(key)
                    .and_then(|e| e.stages.iter_mut().find(|s| s.tag == tag))
                else {
                    return false;
                };
                let before = self.tally.write_locks.slot(&s.write_lock);
                let live = s.write_lock.extend(now, write_ttl);
                self.tally.write_locks.changed(before, &s.write_lock);
                live
            })
            .collect()
    }

    /// Drops `tag`'s staging objects (0.5.6 `finish_write_and_delete`; the
    /// object never becomes resident). `KeyNotExist` if the tag stages nothing
    /// for the key.
    pub fn abort_write(&mut self, keys: &[ObjectKey], tag: WriterTag) -> Vec<Result<(), L1Error>> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let stage = self.entries.get_mut(key).and_then(|e| {
                e.stages
                    .iter()
                    .position(|s| s.tag == tag)
                    .map(|at| e.stages.swap_remove(at))
            });
            match stage {
                Some(stage) => {
                    self.tally.remove_stage(&stage);
                    self.release(key.cache_salt, stage.slab);
                    self.settle(key);
                    out.push(Ok(()));
                }
                None => out.push(Err(L1Error::KeyNotExist)),
            }
        }
        out
    }

    /// Allocates up to `count` write credits of `size` bytes: slabs lent out
    /// before their keys are known (see [`adopt_write`](Self::adopt_write)).
    /// Free memory is used first; under LRU, evictable keys are evicted to
    /// make room for the rest. Under IsolatedLRU and noop nothing is evicted
    /// for a credit (it has no cache_salt to charge), so fewer may be granted.
    pub fn grant_credits(&mut self, size: u64, count: usize, now: Instant) -> Vec<Slab> {
        let mut out = Vec::new();
        let Some(need) = self.alloc.aligned_len(size).filter(|_| size > 0) else {
            return out;
        };
        if need > self.alloc.capacity_bytes() {
            return out;
        }
        while out.len() < count {
            if let Some(slab) = self.alloc.alloc(size) {
                self.credits.insert(slab.offset, slab);
                out.push(slab);
                continue;
            }
            if self.policy.kind() != PolicyKind::Lru {
                break;
            }
            let want = need
                .saturating_mul((count - out.len()) as u64)
                .saturating_sub(self.alloc.free_bytes())
                .max(1);
            // Under LRU the salt plays no part in choosing victims.
            if self.relieve(Name::EMPTY, want, now) == 0 {
                break;
            }
        }
        out
    }

    /// Frees write credits that were not used. Returns how many were; a slab
    /// that is not an outstanding credit is ignored (and counted out).
    pub fn return_credits(&mut self, slabs: &[Slab]) -> usize {
        let mut freed = 0;
        for slab in slabs {
            if self.credits.get(&slab.offset) == Some(slab) {
                self.credits.remove(&slab.offset);
                self.alloc.free(*slab);
                freed += 1;
            } else {
                kvshard_io::log_limited!(
                    log::Level::Error,
                    "L1: returned write credit {slab:?} is not an outstanding credit; ignored"
                );
            }
        }
        freed
    }

    /// Write credits outstanding: (count, bytes).
    pub fn credits(&self) -> (usize, u64) {
        (
            self.credits.len(),
            self.credits.values().map(|s| s.len).sum(),
        )
    }

    /// Stages each key in a write credit it was given, owned by `tag`, with a
    /// fresh write lock: the writer is already writing into the slab. Unlike
    /// [`reserve_write`](Self::reserve_write), the key may be resident or
    /// staged by other writers (the credit was handed out without asking):
    /// [`finish_write`](Self::finish_write) then drops the copy as
    /// `AlreadyResident`. `tag` must be unique to this write (it may stage
    /// nothing else for the key): `KeyNotWritable` if it does, and
    /// `KeyNotExist` if the slab is not an outstanding credit of `size`
    /// bytes; the slab stays a credit in both cases, for the caller to return.
    pub fn adopt_write(
        &mut self,
        writes: &[(ObjectKey, Slab)],
        size: u64,
        tag: WriterTag,
        now: Instant,
    ) -> Vec<Result<(), L1Error>> {
        let need = self.alloc.aligned_len(size);
        let mut created = Vec::new();
        let out = writes
            .iter()
            .map(|(key, slab)| {
                if size == 0
                    || self.credits.get(&slab.offset) != Some(slab)
                    || Some(slab.len) != need
                {
                    return Err(L1Error::KeyNotExist);
                }
                if self
                    .entries
                    .get(key)
                    .is_some_and(|e| e.stages.iter().any(|s| s.tag == tag))
                {
                    return Err(L1Error::KeyNotWritable);
                }
                self.credits.remove(&slab.offset);
                self.account(key.cache_salt, slab.len);
                if self.stage_slab(key, tag, *slab, size, false, now) {
                    created.push(*key);
                }
                Ok(())
            })
            .collect();
        // Tracked from staging, as reserve_write's keys are.
        self.policy.on_keys_created(created.iter());
        out
    }

    /// Stages `slab` (already charged to the key's salt) for `key` under
    /// `tag` with a fresh write lock. Returns whether the key's entry is new.
    fn stage_slab(
        &mut self,
        key: &ObjectKey,
        tag: WriterTag,
        slab: Slab,
        size: u64,
        temporary: bool,
        now: Instant,
    ) -> bool {
        let mut write_lock = TtlLock::new();
        write_lock.lock(1, now, self.cfg.write_ttl);
        let stage = Stage {
            tag,
            slab,
            size,
            write_lock,
            temporary,
        };
        self.tally.add_stage(&stage);
        let created = match self.entries.get_mut(key) {
            Some(entry) => {
                entry.stages.push(stage);
                false
            }
            None => {
                let stages = vec![stage];
                let entry = Entry {
                    resident: None,
                    stages,
                };
                self.entries.insert(*key, entry);
                true
            }
        };
        self.settle(key);
        created
    }

    /// Takes `count` read locks (clamped to 1..=max) on each resident key and
    /// returns its slab; `KeyNotExist` for keys that are missing or only
    /// staged. Reads do not change eviction order (0.5.6: only `touch` does).
    pub fn reserve_read(
        &mut self,
        keys: &[ObjectKey],
        count: u32,
        now: Instant,
    ) -> Vec<Result<Slab, L1Error>> {
        let count = self.read_count(count);
        let read_ttl = self.cfg.read_ttl;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            match self.entries.get_mut(key).and_then(|e| e.resident.as_mut()) {
                Some(r) => {
                    let before = self.tally.read_locks.slot(&r.read_lock);
                    r.read_lock.lock(count, now, read_ttl);
                    self.tally.read_locks.changed(before, &r.read_lock);
                    r.last_access = now;
                    self.stats.read_chunks += 1;
                    out.push(Ok(r.slab));
                }
                None => {
                    self.stats.read_failure_chunks += 1;
                    out.push(Err(L1Error::KeyNotExist));
                }
            }
        }
        out
    }

    /// Releases `count` read locks (clamped to 1..=max, floor 0) on each key.
    /// A temporary object is freed when no live lock is left. `KeyNotExist`
    /// for a missing key, `KeyInWrongState` if the key holds no live read lock
    /// (its TTL passed: the reader may have read data that was being
    /// replaced).
    pub fn finish_read(
        &mut self,
        keys: &[ObjectKey],
        count: u32,
        now: Instant,
    ) -> Vec<Result<(), L1Error>> {
        let count = self.read_count(count);
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(entry) = self.entries.get_mut(key) else {
                out.push(Err(L1Error::KeyNotExist));
                continue;
            };
            let Some(r) = entry.resident.as_mut() else {
                out.push(Err(L1Error::KeyNotExist));
                continue;
            };
            if !r.read_lock.is_locked(now) {
                kvshard_io::log_limited!(
                    log::Level::Warn,
                    "L1: finish_read on {key:?}, which holds no live read lock"
                );
                out.push(Err(L1Error::KeyInWrongState));
                continue;
            }
            let before = self.tally.read_locks.slot(&r.read_lock);
            r.read_lock.unlock(count);
            self.tally.read_locks.changed(before, &r.read_lock);
            if r.temporary && !r.read_lock.is_locked(now) {
                let resident = entry.resident.take().expect("resident checked above");
                self.tally.remove_resident(&resident);
                self.release(key.cache_salt, resident.slab);
                self.settle(key);
            }
            out.push(Ok(()));
        }
        out
    }

    /// Keeps the read locks of keys alive: each resident key whose read lock
    /// is live gets its deadline pushed to `now + read_ttl`. For a holder
    /// whose work on the memory can outlast the TTL (an L2 store whose
    /// socket still reads it). Answers per key whether the lock was live.
    pub fn renew_read(&mut self, keys: &[ObjectKey], now: Instant) -> Vec<bool> {
        let read_ttl = self.cfg.read_ttl;
        keys.iter()
            .map(|key| {
                let Some(r) = self.entries.get_mut(key).and_then(|e| e.resident.as_mut()) else {
                    return false;
                };
                let before = self.tally.read_locks.slot(&r.read_lock);
                let live = r.read_lock.extend(now, read_ttl);
                self.tally.read_locks.changed(before, &r.read_lock);
                live
            })
            .collect()
    }

    /// The slab of a read-locked key, without taking a lock (0.5.6
    /// `unsafe_read`). `KeyNotReadable` unless read-locked.
    pub fn read_locked(&self, key: &ObjectKey, now: Instant) -> Result<Slab, L1Error> {
        let r = self
            .entries
            .get(key)
            .and_then(|e| e.resident.as_ref())
            .ok_or(L1Error::KeyNotExist)?;
        if r.read_lock.is_locked(now) {
            Ok(r.slab)
        } else {
            Err(L1Error::KeyNotReadable)
        }
    }

    /// The slab of a resident key. Unlocked objects can be evicted by the next
    /// call that takes `&mut self`: hold a read lock across any wait.
    pub fn get(&self, key: &ObjectKey) -> Option<Slab> {
        self.entries.get(key)?.resident.as_ref().map(|r| r.slab)
    }

    /// Whether the key has a resident (readable) object.
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.entries.get(key).is_some_and(|e| e.resident.is_some())
    }

    /// Details of a resident object.
    pub fn info(&self, key: &ObjectKey, now: Instant) -> Option<ObjectInfo> {
        let r = self.entries.get(key)?.resident.as_ref()?;
        Some(ObjectInfo {
            slab: r.slab,
            size: r.size,
            temporary: r.temporary,
            read_locks: if r.read_lock.is_locked(now) {
                r.read_lock.count()
            } else {
                0
            },
            admitted_at: r.admitted_at,
            last_access: r.last_access,
        })
    }

    /// Marks keys as used: most recently used in the eviction order (a
    /// batch's first key last to go), and their access time is `now`.
    pub fn touch(&mut self, keys: &[ObjectKey], now: Instant) {
        for key in keys {
            if let Some(r) = self.entries.get_mut(key).and_then(|e| e.resident.as_mut()) {
                r.last_access = now;
            }
        }
        self.policy.on_keys_touched(keys);
    }

    /// Deletes keys. Staging objects whose write TTL passed are reclaimed
    /// first. `KeyIsLocked` if a live staging object remains or the resident
    /// object is read-locked, unless `force` (which frees those too: a
    /// concurrent writer or reader may then use freed memory). `KeyNotExist`
    /// if the key has nothing in the shard.
    pub fn delete(
        &mut self,
        keys: &[ObjectKey],
        force: bool,
        now: Instant,
    ) -> Vec<Result<(), L1Error>> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(entry) = self.entries.get_mut(key) else {
                out.push(Err(L1Error::KeyNotExist));
                continue;
            };
            self.tally.leave(entry);
            let mut freed = Vec::new();
            let mut expired = 0u64;
            entry.stages.retain(|s| {
                let live = s.write_lock.is_locked(now);
                if live && !force {
                    return true;
                }
                if live {
                    kvshard_io::log_limited!(
                        log::Level::Warn,
                        "L1: force-discarding live staging object {key:?} (tag {})",
                        s.tag.0
                    );
                } else {
                    expired += 1;
                }
                freed.push(s.slab);
                false
            });
            self.stats.expired_stages += expired;
            let result = if !entry.stages.is_empty() {
                Err(L1Error::KeyIsLocked)
            } else {
                match &entry.resident {
                    None => Ok(()),
                    Some(r) if r.read_lock.is_locked(now) && !force => Err(L1Error::KeyIsLocked),
                    Some(r) => {
                        if r.read_lock.is_locked(now) {
                            kvshard_io::log_limited!(
                                log::Level::Warn,
                                "L1: force-deleting read-locked key {key:?}"
                            );
                        }
                        freed.push(entry.resident.take().expect("resident matched").slab);
                        Ok(())
                    }
                }
            };
            self.tally.enter(entry);
            for slab in freed {
                self.release(key.cache_salt, slab);
            }
            self.settle(key);
            out.push(result);
        }
        out
    }

    /// Deletes every unlocked resident object and every expired staging
    /// object; with `force`, everything. Returns the number of objects
    /// (resident and staging) freed.
    pub fn clear(&mut self, force: bool, now: Instant) -> usize {
        let keys: Vec<ObjectKey> = self.entries.keys().copied().collect();
        let mut count = 0;
        for key in &keys {
            let entry = self.entries.get_mut(key).expect("key listed above");
            self.tally.leave(entry);
            let mut freed = Vec::new();
            entry.stages.retain(|s| {
                let keep = !force && s.write_lock.is_locked(now);
                if !keep {
                    freed.push(s.slab);
                }
                keep
            });
            if entry
                .resident
                .as_ref()
                .is_some_and(|r| force || !r.read_lock.is_locked(now))
            {
                freed.push(entry.resident.take().expect("resident checked").slab);
            }
            self.tally.enter(entry);
            count += freed.len();
            for slab in freed {
                self.release(key.cache_salt, slab);
            }
            self.settle(key);
        }
        if force {
            log::warn!("L1: force-cleared {count} objects, including locked ones");
        }
        count
    }

    /// The periodic eviction step (the caller runs it every second).
    ///
    /// LRU: if used / capacity >= trigger_watermark, evicts
    /// `eviction_ratio` of the tracked keys (at least one), least recently
    /// used first, skipping keys that are read-locked or staged with a live
    /// write lock. noop: never evicts.
    ///
    /// IsolatedLRU: for each cache_salt holding bytes, with `limit` its quota
    /// (0 when it has none): if bytes >= watermark * limit, evicts that salt's
    /// least recently used evictable keys, at least `eviction_ratio` of them
    /// (all for limit 0, which is the allowlist rule), and on until the salt
    /// is below watermark * limit or nothing evictable is left.
    pub fn evict(&mut self, now: Instant) -> EvictOutcome {
        self.stats.eviction_loop_ticks += 1;
        let (used, capacity) = self.usage();
        let usage_ratio = if capacity == 0 {
            0.0
        } else {
            used as f64 / capacity as f64
        };
        let watermark = self.policy.config().trigger_watermark;
        let ratio = self.policy.config().eviction_ratio;
        let mut outcome = EvictOutcome {
            usage_ratio,
            ..EvictOutcome::default()
        };
        match self.policy.kind() {
            PolicyKind::Lru | PolicyKind::Noop => {
                if capacity > 0 && usage_ratio >= watermark {
                    outcome.triggered = true;
                    let target = eviction_target(self.policy.tracked_len(Scope::All), ratio);
                    let victims = self.victims(Scope::All, target, 0, now);
                    for key in &victims {
                        outcome.evicted_bytes += self.evict_key(key, now);
                    }
                    outcome.evicted_keys = victims.len();
                }
            }
            PolicyKind::IsolatedLru => {
                let mut salts: Vec<(Name, u64)> =
                    self.bytes_by_salt.iter().map(|(&s, &b)| (s, b)).collect();
                salts.sort_unstable();
                for (salt, bytes) in salts {
                    let limit = self.policy.quota(&salt).unwrap_or(0);
                    let threshold = watermark * limit as f64;
                    if bytes == 0 || (bytes as f64) < threshold {
                        continue;
                    }
                    outcome.triggered = true;
                    let (salt_ratio, min_bytes) = if limit == 0 || threshold <= 0.0 {
                        (1.0, bytes)
                    } else {
                        // Largest byte count that is below the threshold.
                        let keep = (threshold.ceil() as u64).saturating_sub(1);
                        (ratio, bytes.saturating_sub(keep))
                    };
                    let min_count =
                        eviction_target(self.policy.tracked_len(Scope::Salt(salt)), salt_ratio);
                    let victims = self.victims(Scope::Salt(salt), min_count, min_bytes, now);
                    for key in &victims {
                        outcome.evicted_bytes += self.evict_key(key, now);
                    }
                    outcome.evicted_keys += victims.len();
                }
            }
        }
        if outcome.triggered {
            self.stats.eviction_loop_triggered += 1;
        }
        outcome
    }

    /// Frees staging objects whose write TTL passed, and temporary resident
    /// objects without a live read lock whose read TTL has passed since they
    /// were admitted (their reader is gone). O(staging + temporary objects).
    pub fn expire(&mut self, now: Instant) -> ExpireOutcome {
        let mut outcome = ExpireOutcome::default();
        let stale: Vec<ObjectKey> = self
            .staged_keys
            .iter()
            .filter(|k| {
                self.entries[*k]
                    .stages
                    .iter()
                    .any(|s| !s.write_lock.is_locked(now))
            })
            .copied()
            .collect();
        for key in &stale {
            let entry = self.entries.get_mut(key).expect("staged key has an entry");
            self.tally.leave(entry);
            let mut freed = Vec::new();
            entry.stages.retain(|s| {
                let live = s.write_lock.is_locked(now);
                if !live {
                    freed.push(s.slab);
                }
                live
            });
            self.tally.enter(entry);
            outcome.stages += freed.len();
            for slab in freed {
                self.release(key.cache_salt, slab);
            }
            self.settle(key);
        }
        let read_ttl = self.cfg.read_ttl.min(MAX_TTL);
        let abandoned: Vec<ObjectKey> = self
            .temporary_keys
            .iter()
            .filter(|k| {
                let r = self.entries[*k]
                    .resident
                    .as_ref()
                    .expect("temporary key is resident");
                !r.read_lock.is_locked(now) && now >= r.admitted_at + read_ttl
            })
            .copied()
            .collect();
        for key in &abandoned {
            let entry = self
                .entries
                .get_mut(key)
                .expect("temporary key has an entry");
            let resident = entry.resident.take().expect("temporary key is resident");
            self.tally.remove_resident(&resident);
            self.release(key.cache_salt, resident.slab);
            self.settle(key);
        }
        outcome.temporaries = abandoned.len();
        // Locks that ran out without being released stop being counted, so
        // `status` only looks at those that expired since this pass.
        self.tally.read_locks.sweep(now);
        self.tally.write_locks.sweep(now);
        self.stats.expired_stages += outcome.stages as u64;
        self.stats.expired_temporaries += outcome.temporaries as u64;
        outcome
    }

    /// Counts for `/status`, kept up to date as objects change rather than
    /// walked. The lock counts are exact for any `now` not before the last
    /// [`expire`](Self::expire) call; a lock whose deadline passed at or
    /// before that call is not counted even when `now` is earlier.
    /// O(log objects + locks that expired since the last `expire`).
    pub fn status(&self, now: Instant) -> L1Status {
        let t = &self.tally;
        let (memory_used_bytes, memory_total_bytes) = self.usage();
        L1Status {
            total_object_count: t.residents + t.stages,
            write_locked_count: t.write_locks.live(now),
            read_locked_count: t.read_locks.live(now),
            temporary_count: t.temporaries,
            staging_object_count: t.stages,
            staging_bytes: t.staging_bytes,
            memory_used_bytes,
            memory_total_bytes,
        }
    }

    /// Every slab held: (key, the writer tag for a staging object or `None`
    /// for the resident one, slab). For shutdown and tests.
    pub fn slabs(&self) -> impl Iterator<Item = (&ObjectKey, Option<WriterTag>, Slab)> + '_ {
        self.entries.iter().flat_map(|(k, e)| {
            e.resident
                .iter()
                .map(move |r| (k, None, r.slab))
                .chain(e.stages.iter().map(move |s| (k, Some(s.tag), s.slab)))
        })
    }

    /// Checks every invariant of the shard; O(n log n). Panics on the first
    /// broken one. For tests and debugging.
    pub fn validate(&self) {
        self.alloc.validate();
        self.policy.validate();
        let mut slabs: Vec<Slab> = self.slabs().map(|(_, _, s)| s).collect();
        slabs.extend(self.credits.values().copied());
        slabs.sort_unstable();
        for pair in slabs.windows(2) {
            assert!(
                !pair[0].overlaps(&pair[1]),
                "slabs {:?} and {:?} overlap",
                pair[0],
                pair[1]
            );
        }
        let held: u64 = slabs.iter().map(|s| s.len).sum();
        assert_eq!(
            held,
            self.alloc.used_bytes(),
            "slabs held differ from allocator usage"
        );
        assert_eq!(
            slabs.len(),
            self.alloc.live_count(),
            "slab count differs from allocator"
        );
        let mut by_salt: HashMap<Name, u64> = HashMap::new();
        for (key, _, slab) in self.slabs() {
            *by_salt.entry(key.cache_salt).or_default() += slab.len;
        }
        assert_eq!(
            by_salt.len(),
            self.bytes_by_salt.len(),
            "salt accounting has stale salts"
        );
        for (salt, bytes) in &by_salt {
            assert_eq!(
                self.bytes_by_salt.get(salt),
                Some(bytes),
                "salt {salt:?} bytes"
            );
        }
        for (key, entry) in &self.entries {
            assert!(!entry.is_empty(), "empty entry kept for {key:?}");
            assert_eq!(
                !entry.stages.is_empty(),
                self.staged_keys.contains(key),
                "staged set for {key:?}"
            );
            let temp = entry.resident.as_ref().is_some_and(|r| r.temporary);
            assert_eq!(
                temp,
                self.temporary_keys.contains(key),
                "temporary set for {key:?}"
            );
            let mut tags: Vec<WriterTag> = entry.stages.iter().map(|s| s.tag).collect();
            tags.sort_unstable();
            tags.dedup();
            assert_eq!(
                tags.len(),
                entry.stages.len(),
                "two stages of one tag for {key:?}"
            );
            if self.policy.kind() != PolicyKind::Noop {
                assert!(
                    self.policy.is_tracked(key),
                    "{key:?} is held but not tracked"
                );
            }
        }
        assert!(
            self.staged_keys
                .iter()
                .all(|k| self.entries.contains_key(k)),
            "stale staged key"
        );
        assert!(
            self.temporary_keys
                .iter()
                .all(|k| self.entries.contains_key(k)),
            "stale temporary key"
        );
        self.validate_tally();
        assert_eq!(
            self.policy.tracked_len(Scope::All),
            if self.policy.kind() == PolicyKind::Noop {
                0
            } else {
                self.entries.len()
            },
            "policy tracks keys the shard does not hold"
        );
    }

    /// Recounts what `status` reports by a walk; panics where the kept
    /// counts drifted.
    fn validate_tally(&self) {
        let t = &self.tally;
        let residents = self.entries.values().filter_map(|e| e.resident.as_ref());
        let stages = self.entries.values().flat_map(|e| e.stages.iter());
        assert_eq!(residents.clone().count(), t.residents, "resident count");
        assert_eq!(stages.clone().count(), t.stages, "staging count");
        assert_eq!(
            stages.clone().map(|s| s.slab.len).sum::<u64>(),
            t.staging_bytes,
            "staging bytes"
        );
        let temporaries = residents.clone().filter(|r| r.temporary).count()
            + stages.clone().filter(|s| s.temporary).count();
        assert_eq!(temporaries, t.temporaries, "temporary count");
        t.read_locks
            .validate(residents.map(|r| &r.read_lock), "read locks");
        t.write_locks
            .validate(stages.map(|s| &s.write_lock), "write locks");
    }

    /// Eviction candidates in policy order.
    fn victims(
        &self,
        scope: Scope,
        min_count: usize,
        min_bytes: u64,
        now: Instant,
    ) -> Vec<ObjectKey> {
        let entries = &self.entries;
        self.policy.victims(scope, min_count, min_bytes, |k| {
            entries.get(k).and_then(|e| evictable_bytes(e, now))
        })
    }

    /// Evicts keys to free about `want` bytes for a write of a `salt` key.
    /// LRU takes the least recently used evictable keys; IsolatedLRU takes the
    /// writer's own salt first, then salts over their quota. Returns how many
    /// keys were evicted.
    fn relieve(&mut self, salt: Name, want: u64, now: Instant) -> usize {
        let victims = match self.policy.kind() {
            PolicyKind::Noop => Vec::new(),
            PolicyKind::Lru => self.victims(Scope::All, 1, want, now),
            PolicyKind::IsolatedLru => {
                let mut victims = self.victims(Scope::Salt(salt), 1, want, now);
                if victims.is_empty() {
                    let mut over: Vec<Name> = self
                        .bytes_by_salt
                        .iter()
                        .filter(|(&s, &b)| s != salt && b > self.policy.quota(&s).unwrap_or(0))
                        .map(|(&s, _)| s)
                        .collect();
                    over.sort_unstable();
                    for s in over {
                        victims = self.victims(Scope::Salt(s), 1, want, now);
                        if !victims.is_empty() {
                            break;
                        }
                    }
                }
                victims
            }
        };
        for key in &victims {
            self.evict_key(key, now);
        }
        self.stats.pressure_evicted_chunks += victims.len() as u64;
        victims.len()
    }

    /// Deletes an evictable key; returns the bytes freed.
    fn evict_key(&mut self, key: &ObjectKey, now: Instant) -> u64 {
        let entry = self
            .entries
            .remove(key)
            .expect("eviction victim is in the table");
        self.tally.leave(&entry);
        // Evicting a locked object would hand its memory to a new writer while
        // a reader or writer still uses it.
        let bytes = evictable_bytes(&entry, now).expect("eviction victim is locked");
        if let Some(r) = entry.resident {
            self.release(key.cache_salt, r.slab);
        }
        self.stats.expired_stages += entry.stages.len() as u64;
        for stage in entry.stages {
            self.release(key.cache_salt, stage.slab);
        }
        self.settle(key);
        self.stats.evicted_chunks += 1;
        self.stats.evicted_bytes += bytes;
        bytes
    }

    /// Charges `len` bytes to `salt`.
    fn account(&mut self, salt: Name, len: u64) {
        *self.bytes_by_salt.entry(salt).or_default() += len;
    }

    /// Frees a slab held by a `salt` key.
    fn release(&mut self, salt: Name, slab: Slab) {
        self.alloc.free(slab);
        let b = self
            .bytes_by_salt
            .get_mut(&salt)
            .expect("freed slab's salt is accounted");
        assert!(*b >= slab.len, "salt {salt:?} accounting underflow");
        *b -= slab.len;
        if *b == 0 {
            self.bytes_by_salt.remove(&salt);
        }
    }

    /// Brings the side indexes in line with `key`'s entry after a change, and
    /// drops the entry (and its tracking) once it holds nothing.
    fn settle(&mut self, key: &ObjectKey) {
        let (staged, temporary) = match self.entries.get(key) {
            Some(e) if e.is_empty() => {
                self.entries.remove(key);
                (false, false)
            }
            Some(e) => (
                !e.stages.is_empty(),
                e.resident.as_ref().is_some_and(|r| r.temporary),
            ),
            None => (false, false),
        };
        if !self.entries.contains_key(key) {
            self.policy.on_key_removed(key);
        }
        set_membership(&mut self.staged_keys, key, staged);
        set_membership(&mut self.temporary_keys, key, temporary);
    }
}

fn set_membership(set: &mut KeySet<ObjectKey>, key: &ObjectKey, member: bool) {
    if member {
        set.insert(*key);
    } else {
        set.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::EvictionConfig;

    const A: u64 = 4096;
    const T1: WriterTag = WriterTag(1);
    const T2: WriterTag = WriterTag(2);

    fn key(i: u8) -> ObjectKey {
        salted(i, "")
    }

    fn salted(i: u8, salt: &str) -> ObjectKey {
        ObjectKey {
            chunk_hash: [i; 32],
            model_name: Name::intern("m").unwrap(),
            kv_rank: 0,
            object_group_id: 0,
            cache_salt: Name::intern(salt).unwrap(),
        }
    }

    fn keys(ids: &[u8]) -> Vec<ObjectKey> {
        ids.iter().map(|&i| key(i)).collect()
    }

    fn shard(slots: u64, policy: PolicyKind) -> L1Shard {
        let cfg = L1Config {
            write_ttl: Duration::from_secs(10),
            read_ttl: Duration::from_secs(5),
            max_read_locks: MAX_READ_LOCK_COUNT,
        };
        L1Shard::new(
            SlabAllocator::new(0, slots * A, A),
            cfg,
            EvictionPolicy::new(EvictionConfig::new(policy)),
        )
    }

    fn secs(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    /// Reserves and finishes keys with tag T1; returns their slabs.
    fn write(sh: &mut L1Shard, ks: &[ObjectKey], now: Instant) -> Vec<Slab> {
        let slabs: Vec<Slab> = sh
            .reserve_write(ks, A, T1, false, now)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert!(sh
            .finish_write(ks, T1, now)
            .iter()
            .all(|r| r == &Ok(Admission::Admitted)));
        slabs
    }

    fn order(sh: &L1Shard) -> Vec<u8> {
        sh.policy()
            .eviction_order(Scope::All)
            .map(|k| k.chunk_hash[0])
            .collect()
    }

    #[test]
    fn writer_tags_of_the_three_kinds_never_collide() {
        assert_eq!(WriterTag::worker(-1), None);
        assert_eq!(WriterTag::worker(i64::MIN), None);
        let ids = [0, 1, 7, i64::MAX];
        let mut tags: Vec<WriterTag> = ids.iter().map(|&i| WriterTag::worker(i).unwrap()).collect();
        for n in [0, 1, 7, (1 << 62) - 1] {
            tags.push(WriterTag::load(n));
            tags.push(WriterTag::credit(n));
        }
        let distinct: std::collections::HashSet<_> = tags.iter().collect();
        assert_eq!(distinct.len(), tags.len(), "{tags:?}");
        assert_eq!(WriterTag::worker(7).unwrap().to_string(), "worker 7");
        assert_eq!(WriterTag::load(3).to_string(), "load 3");
        assert_eq!(WriterTag::credit(12).to_string(), "credit 12");
    }

    #[test]
    fn ttl_lock_semantics() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(5);
        let mut l = TtlLock::new();
        assert!(!l.is_locked(t0));
        l.lock(2, t0, ttl);
        assert!(l.is_locked(secs(t0, 4)));
        assert!(!l.is_locked(secs(t0, 5)), "expired at the deadline");
        l.lock(1, secs(t0, 3), ttl); // refresh while live: count 3
        assert_eq!(l.count(), 3);
        assert!(l.is_locked(secs(t0, 7)));
        l.lock(1, secs(t0, 20), ttl); // after expiry the count restarts
        assert_eq!(l.count(), 1);
        l.unlock(5);
        assert_eq!(l.count(), 0);
        assert!(!l.is_locked(secs(t0, 20)));
    }

    #[test]
    fn renewed_read_locks_outlive_their_ttl() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let ks = keys(&[1, 2]);
        write(&mut sh, &ks, t0);
        assert_eq!(sh.reserve_read(&ks[..1], 1, t0).len(), 1);
        // Read TTL 5 s: renewed at 4 s, the lock holds until 9 s.
        assert_eq!(sh.renew_read(&ks, secs(t0, 4)), vec![true, false]);
        assert_eq!(sh.read_locked(&ks[0], secs(t0, 8)).map(|_| ()), Ok(()));
        assert_eq!(sh.info(&ks[0], secs(t0, 8)).unwrap().read_locks, 1);
        assert_eq!(
            sh.read_locked(&ks[0], secs(t0, 9)),
            Err(L1Error::KeyNotReadable)
        );
        // An expired lock is not brought back.
        assert_eq!(sh.renew_read(&ks[..1], secs(t0, 9)), vec![false]);
        assert_eq!(sh.renew_read(&keys(&[7]), t0), vec![false]);
    }

    #[test]
    fn write_credits_are_lent_adopted_and_returned() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let credits = sh.grant_credits(100, 3, t0);
        assert_eq!(credits.len(), 3);
        assert_eq!(sh.credits(), (3, 3 * A));
        assert_eq!(sh.usage().0, 3 * A, "credits count as used memory");
        sh.validate();
        // A resident key and a fresh one are both staged in their credits.
        write(&mut sh, &keys(&[1]), t0);
        let t3 = WriterTag(3);
        let adopted = vec![(key(1), credits[0]), (key(2), credits[1])];
        assert_eq!(sh.adopt_write(&adopted, 100, t3, t0), vec![Ok(()), Ok(())]);
        sh.validate();
        assert_eq!(sh.credits(), (1, A));
        assert_eq!(sh.status(t0).staging_object_count, 2);
        // The same tag cannot stage a key twice; a slab that is not a credit
        // (or of another size) is refused; neither uses up the credit.
        assert_eq!(
            sh.adopt_write(&[(key(2), credits[2])], 100, t3, t0),
            vec![Err(L1Error::KeyNotWritable)]
        );
        assert_eq!(
            sh.adopt_write(&[(key(4), credits[0])], 100, t3, t0),
            vec![Err(L1Error::KeyNotExist)]
        );
        assert_eq!(
            sh.adopt_write(&[(key(4), credits[2])], 3 * A, WriterTag(4), t0),
            vec![Err(L1Error::KeyNotExist)]
        );
        assert_eq!(sh.credits(), (1, A));
        // Another writer's reservation of key 2 coexists with the credit's.
        assert!(sh.reserve_write(&keys(&[2]), 100, T2, false, t0)[0].is_ok());
        let done = sh.finish_write(&keys(&[1, 2]), t3, t0);
        assert_eq!(
            done,
            vec![Ok(Admission::AlreadyResident), Ok(Admission::Admitted)]
        );
        assert_eq!(
            sh.get(&key(2)),
            Some(credits[1]),
            "the credit's bytes are resident"
        );
        assert_eq!(
            sh.finish_write(&keys(&[2]), T2, t0),
            vec![Ok(Admission::AlreadyResident)]
        );
        sh.validate();
        assert_eq!(
            sh.return_credits(&[credits[2], credits[0]]),
            1,
            "only outstanding credits"
        );
        assert_eq!(sh.credits(), (0, 0));
        assert_eq!(sh.usage().0, 2 * A);
        sh.validate();
    }

    #[test]
    fn adopted_writes_expire_and_abort_like_reservations() {
        let t0 = Instant::now();
        let mut sh = shard(4, PolicyKind::Lru);
        let c = sh.grant_credits(A, 2, t0);
        let t3 = WriterTag(3);
        sh.adopt_write(&[(key(1), c[0]), (key(2), c[1])], A, t3, t0);
        assert_eq!(sh.abort_write(&keys(&[1]), t3), vec![Ok(())]);
        // Write TTL 10 s: the other stage is reclaimed after it, not before.
        assert_eq!(sh.expire(secs(t0, 9)).stages, 0);
        assert_eq!(sh.expire(secs(t0, 10)).stages, 1);
        assert_eq!(sh.usage().0, 0);
        assert_eq!(
            sh.finish_write(&keys(&[2]), t3, secs(t0, 10)),
            vec![Err(L1Error::KeyNotExist)]
        );
        sh.validate();
    }

    #[test]
    fn credits_evict_under_lru_only() {
        let t0 = Instant::now();
        let mut sh = shard(4, PolicyKind::Lru);
        write(&mut sh, &keys(&[1, 2, 3]), t0);
        assert_eq!(sh.grant_credits(A, 2, t0).len(), 2, "one free, one evicted");
        assert_eq!(
            keys(&[1, 2, 3]).iter().filter(|k| sh.contains(k)).count(),
            2
        );
        sh.validate();
        let mut iso = shard(4, PolicyKind::IsolatedLru);
        iso.policy_mut().set_quota("", 4 * A);
        write(&mut iso, &keys(&[1, 2, 3]), t0);
        assert_eq!(iso.grant_credits(A, 2, t0).len(), 1, "free memory only");
        assert!(iso.contains(&key(1)));
        assert!(sh.grant_credits(0, 1, t0).is_empty());
        assert!(sh.grant_credits(5 * A, 1, t0).is_empty());
        iso.validate();
    }

    #[test]
    fn write_then_read_round_trip() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let ks = keys(&[1, 2]);
        let res = sh.reserve_write(&ks, 100, T1, false, t0);
        let slabs: Vec<Slab> = res.iter().map(|r| r.unwrap()).collect();
        assert_eq!(slabs[0].len, A);
        assert!(!slabs[0].overlaps(&slabs[1]));
        // Staging objects are invisible to readers.
        assert_eq!(
            sh.reserve_read(&ks[..1], 1, t0),
            vec![Err(L1Error::KeyNotExist)]
        );
        assert!(!sh.contains(&ks[0]));
        assert_eq!(
            sh.finish_write(&ks, T1, t0),
            vec![Ok(Admission::Admitted); 2]
        );
        assert_eq!(sh.get(&ks[0]), Some(slabs[0]));
        assert_eq!(
            sh.reserve_read(&ks, 2, t0),
            vec![Ok(slabs[0]), Ok(slabs[1])]
        );
        assert_eq!(sh.read_locked(&ks[1], t0), Ok(slabs[1]));
        assert_eq!(sh.info(&ks[0], t0).unwrap().read_locks, 2);
        assert_eq!(sh.info(&ks[0], t0).unwrap().size, 100);
        assert_eq!(sh.finish_read(&ks, 2, t0), vec![Ok(()); 2]);
        assert_eq!(sh.read_locked(&ks[1], t0), Err(L1Error::KeyNotReadable));
        assert_eq!(sh.read_locked(&key(9), t0), Err(L1Error::KeyNotExist));
        assert_eq!(sh.usage(), (2 * A, 8 * A));
        let st = sh.stats();
        assert_eq!(
            (st.write_chunks, st.read_chunks, st.read_failure_chunks),
            (2, 2, 1)
        );
        sh.validate();
    }

    #[test]
    fn not_writable_cases() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        write(&mut sh, &keys(&[1]), t0);
        let r = sh.reserve_write(&keys(&[1, 2, 2]), A, T1, false, t0);
        assert_eq!(r[0], Err(L1Error::KeyNotWritable), "resident");
        assert!(r[1].is_ok());
        assert_eq!(r[2], Err(L1Error::KeyNotWritable), "duplicate in batch");
        let r = sh.reserve_write(&keys(&[2]), A, T1, false, t0);
        assert_eq!(r[0], Err(L1Error::KeyNotWritable), "same tag, live stage");
        assert!(
            sh.reserve_write(&keys(&[2]), A, T2, false, t0)[0].is_ok(),
            "other tags may stage too"
        );
        assert_eq!(
            sh.reserve_write(&keys(&[3]), 0, T1, false, t0),
            vec![Err(L1Error::InvalidSize)]
        );
        sh.validate();
    }

    #[test]
    fn concurrent_writers_first_finish_wins() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let k = keys(&[1]);
        let a = sh.reserve_write(&k, A, T1, false, t0)[0].unwrap();
        let b = sh.reserve_write(&k, A, T2, false, t0)[0].unwrap();
        assert_ne!(a, b);
        assert_eq!(sh.finish_write(&k, T2, t0), vec![Ok(Admission::Admitted)]);
        assert_eq!(
            sh.finish_write(&k, T1, t0),
            vec![Ok(Admission::AlreadyResident)]
        );
        assert_eq!(sh.get(&k[0]), Some(b));
        assert_eq!(sh.usage().0, A, "the losing copy is freed");
        assert_eq!(sh.finish_write(&k, T1, t0), vec![Err(L1Error::KeyNotExist)]);
        sh.validate();
    }

    #[test]
    fn expired_stage_is_taken_over_by_any_tag() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let k = keys(&[1]);
        let a = sh.reserve_write(&k, A, T1, false, t0)[0].unwrap();
        // Late finish of an expired reservation: wrong state, object stays.
        assert_eq!(
            sh.finish_write(&k, T1, secs(t0, 10)),
            vec![Err(L1Error::KeyInWrongState)]
        );
        let b = sh.reserve_write(&k, A, T2, false, secs(t0, 11))[0].unwrap();
        assert_eq!(a, b, "the expired slab is reused");
        assert_eq!(sh.usage().0, A);
        // The old writer no longer owns it.
        assert_eq!(
            sh.finish_write(&k, T1, secs(t0, 11)),
            vec![Err(L1Error::KeyNotExist)]
        );
        assert_eq!(
            sh.finish_write(&k, T2, secs(t0, 11)),
            vec![Ok(Admission::Admitted)]
        );
        // A takeover with another size frees the old slab and allocates.
        let k2 = keys(&[2]);
        sh.reserve_write(&k2, A, T1, false, t0);
        let c = sh.reserve_write(&k2, 3 * A, T1, false, secs(t0, 12))[0].unwrap();
        assert_eq!(c.len, 3 * A);
        assert_eq!(sh.usage().0, 4 * A);
        assert_eq!(sh.status(secs(t0, 12)).staging_object_count, 1);
        sh.validate();
    }

    #[test]
    fn renewed_write_reservations_outlive_their_ttl() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let ks = keys(&[1, 2]);
        let slabs: Vec<Slab> = sh
            .reserve_write(&ks, A, T1, false, t0)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        // Write TTL 10 s: renewed at 8 s and 16 s, the stages hold past 20 s.
        assert_eq!(sh.renew_write(&ks, T1, secs(t0, 8)), vec![true, true]);
        assert_eq!(sh.renew_write(&ks, T2, secs(t0, 8)), vec![false, false]);
        assert_eq!(sh.renew_write(&ks[..1], T1, secs(t0, 16)), vec![true]);
        // Live stages are neither taken over nor evicted to make room.
        assert_eq!(
            sh.reserve_write(&keys(&[3, 4, 5, 6, 7, 8, 9]), A, T2, false, secs(t0, 17))
                .iter()
                .filter(|r| r.is_ok())
                .count(),
            6
        );
        assert_eq!(
            sh.finish_write(&ks[..1], T1, secs(t0, 20)),
            vec![Ok(Admission::Admitted)]
        );
        assert_eq!(sh.get(&ks[0]), Some(slabs[0]));
        // Key 2 was not renewed at 16 s: expired at 18 s, and an expired
        // reservation is not brought back.
        assert_eq!(sh.renew_write(&ks[1..], T1, secs(t0, 19)), vec![false]);
        sh.validate();
    }

    #[test]
    fn a_writer_whose_stage_expired_never_touches_its_successor() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let k = keys(&[1]);
        let a = sh.reserve_write(&k, A, T1, false, t0)[0].unwrap();
        // Expired at 10 s and taken over by T2: same memory, new owner.
        let b = sh.reserve_write(&k, A, T2, false, secs(t0, 11))[0].unwrap();
        assert_eq!(a, b);
        assert_eq!(sh.renew_write(&k, T1, secs(t0, 12)), vec![false]);
        assert_eq!(
            sh.finish_write(&k, T1, secs(t0, 12)),
            vec![Err(L1Error::KeyNotExist)]
        );
        assert_eq!(sh.abort_write(&k, T1), vec![Err(L1Error::KeyNotExist)]);
        // T2's reservation is untouched by T1's late calls.
        assert_eq!(sh.renew_write(&k, T2, secs(t0, 12)), vec![true]);
        assert_eq!(
            sh.finish_write(&k, T2, secs(t0, 12)),
            vec![Ok(Admission::Admitted)]
        );
        // Expired and not taken over: the late finish fails, the abort frees it.
        let k2 = keys(&[2]);
        sh.reserve_write(&k2, A, T1, false, t0);
        assert_eq!(sh.renew_write(&k2, T1, secs(t0, 10)), vec![false]);
        assert_eq!(
            sh.finish_write(&k2, T1, secs(t0, 10)),
            vec![Err(L1Error::KeyInWrongState)]
        );
        assert_eq!(sh.abort_write(&k2, T1), vec![Ok(())]);
        assert_eq!(sh.usage().0, A);
        sh.validate();
    }

    #[test]
    fn abort_drops_the_stage() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let k = keys(&[1]);
        sh.reserve_write(&k, A, T1, false, t0);
        assert_eq!(sh.abort_write(&k, T2), vec![Err(L1Error::KeyNotExist)]);
        assert_eq!(sh.abort_write(&k, T1), vec![Ok(())]);
        assert_eq!(sh.usage().0, 0);
        assert_eq!(sh.policy().tracked_len(Scope::All), 0);
        assert_eq!(sh.abort_write(&k, T1), vec![Err(L1Error::KeyNotExist)]);
        sh.validate();
    }

    #[test]
    fn read_lock_counts_are_clamped() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let k = keys(&[1]);
        write(&mut sh, &k, t0);
        sh.reserve_read(&k, 0, t0);
        assert_eq!(sh.info(&k[0], t0).unwrap().read_locks, 1);
        sh.reserve_read(&k, 1000, t0);
        assert_eq!(
            sh.info(&k[0], t0).unwrap().read_locks,
            1 + MAX_READ_LOCK_COUNT
        );
        sh.finish_read(&k, 1000, t0);
        assert_eq!(sh.info(&k[0], t0).unwrap().read_locks, 1);
    }

    #[test]
    fn temporary_objects_are_freed_at_zero_locks() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let k = keys(&[1]);
        sh.reserve_write(&k, A, T1, true, t0);
        let s = sh.finish_write_and_reserve_read(&k, T1, 2, t0)[0].unwrap();
        assert_eq!(sh.read_locked(&k[0], t0), Ok(s));
        assert_eq!(sh.status(t0).temporary_count, 1);
        assert_eq!(sh.finish_read(&k, 1, t0), vec![Ok(())]);
        assert!(sh.contains(&k[0]), "one lock left");
        assert_eq!(sh.finish_read(&k, 1, t0), vec![Ok(())]);
        assert!(!sh.contains(&k[0]));
        assert_eq!(sh.usage().0, 0);
        assert_eq!(sh.finish_read(&k, 1, t0), vec![Err(L1Error::KeyNotExist)]);
        // Non-temporary objects stay; a release without a live lock is
        // reported.
        write(&mut sh, &k, t0);
        assert_eq!(
            sh.finish_read(&k, 1, t0),
            vec![Err(L1Error::KeyInWrongState)]
        );
        sh.reserve_read(&k, 1, t0);
        assert_eq!(
            sh.finish_read(&k, 1, secs(t0, 5)),
            vec![Err(L1Error::KeyInWrongState)],
            "lock expired"
        );
        assert!(sh.contains(&k[0]));
        sh.validate();
    }

    #[test]
    fn finish_write_and_reserve_read_locks_the_winner() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let k = keys(&[1]);
        sh.reserve_write(&k, A, T2, true, t0);
        let winner = write(&mut sh, &k, t0)[0];
        let got = sh.finish_write_and_reserve_read(&k, T2, 1, t0);
        assert_eq!(got, vec![Ok(winner)]);
        assert_eq!(sh.info(&k[0], t0).unwrap().read_locks, 1);
        assert_eq!(sh.usage().0, A);
        assert_eq!(
            sh.finish_write_and_reserve_read(&k, T2, 1, t0),
            vec![Err(L1Error::KeyNotExist)]
        );
        sh.validate();
    }

    #[test]
    fn delete_respects_locks_unless_forced() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let ks = keys(&[1, 2, 3]);
        write(&mut sh, &ks[..2], t0);
        sh.reserve_read(&ks[..1], 1, t0);
        sh.reserve_write(&ks[2..], A, T1, false, t0);
        let r = sh.delete(&keys(&[1, 2, 3, 4]), false, t0);
        assert_eq!(
            r,
            vec![
                Err(L1Error::KeyIsLocked),
                Ok(()),
                Err(L1Error::KeyIsLocked),
                Err(L1Error::KeyNotExist)
            ]
        );
        // An expired stage no longer pins the key.
        assert_eq!(sh.delete(&ks[2..], false, secs(t0, 10)), vec![Ok(())]);
        assert_eq!(sh.delete(&ks[..1], true, t0), vec![Ok(())]);
        assert_eq!(sh.usage().0, 0);
        sh.validate();
    }

    #[test]
    fn clear_keeps_locked_objects_unless_forced() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let ks = keys(&[1, 2, 3]);
        write(&mut sh, &ks[..2], t0);
        sh.reserve_read(&ks[..1], 1, t0);
        sh.reserve_write(&ks[2..], A, T1, false, t0);
        assert_eq!(sh.clear(false, t0), 1);
        assert!(sh.contains(&ks[0]) && !sh.contains(&ks[1]));
        assert_eq!(sh.status(t0).staging_object_count, 1);
        assert_eq!(sh.clear(true, t0), 2);
        assert_eq!(sh.usage().0, 0);
        assert_eq!(
            sh.status(t0),
            L1Status {
                memory_total_bytes: 8 * A,
                ..L1Status::default()
            }
        );
        sh.validate();
    }

    #[test]
    fn pressure_eviction_makes_room_in_lru_order() {
        let t0 = Instant::now();
        let mut sh = shard(4, PolicyKind::Lru);
        write(&mut sh, &keys(&[1, 2]), t0);
        write(&mut sh, &keys(&[3, 4]), t0);
        assert_eq!(order(&sh), [2, 1, 4, 3]);
        sh.reserve_read(&keys(&[2]), 1, t0); // locked: must survive
        let r = sh.reserve_write(&keys(&[5, 6]), A, T1, false, t0);
        assert!(r.iter().all(Result::is_ok));
        assert!(sh.contains(&key(2)), "locked key evicted");
        assert!(
            !sh.contains(&key(1)) && !sh.contains(&key(4)),
            "least recent unlocked keys go first"
        );
        assert!(sh.contains(&key(3)));
        assert_eq!(sh.stats().pressure_evicted_chunks, 2);
        sh.validate();
    }

    #[test]
    fn out_of_memory_fails_only_the_tail() {
        let t0 = Instant::now();
        let mut sh = shard(3, PolicyKind::Lru);
        write(&mut sh, &keys(&[1]), t0);
        sh.reserve_read(&keys(&[1]), 1, t0);
        let r = sh.reserve_write(&keys(&[2, 3, 4, 5]), A, T1, false, t0);
        assert!(r[0].is_ok() && r[1].is_ok());
        assert_eq!(
            r[2..],
            [Err(L1Error::OutOfMemory), Err(L1Error::OutOfMemory)]
        );
        assert_eq!(sh.stats().allocation_failure_chunks, 2);
        assert!(sh.contains(&key(1)));
        // Larger than the whole shard: no eviction attempted.
        assert_eq!(
            sh.reserve_write(&keys(&[9]), 4 * A, T1, false, t0),
            vec![Err(L1Error::OutOfMemory)]
        );
        // Lazy growth makes room.
        sh.grow(6 * A);
        assert!(sh
            .reserve_write(&keys(&[4, 5]), A, T1, false, t0)
            .iter()
            .all(Result::is_ok));
        sh.validate();
    }

    #[test]
    fn noop_never_evicts() {
        let t0 = Instant::now();
        let mut sh = shard(2, PolicyKind::Noop);
        write(&mut sh, &keys(&[1, 2]), t0);
        assert_eq!(
            sh.reserve_write(&keys(&[3]), A, T1, false, t0),
            vec![Err(L1Error::OutOfMemory)]
        );
        let out = sh.evict(t0);
        assert!(out.triggered);
        assert_eq!(out.evicted_keys, 0);
        assert!(sh.contains(&key(1)) && sh.contains(&key(2)));
        sh.validate();
    }

    #[test]
    fn lru_tick_evicts_ratio_above_watermark() {
        let t0 = Instant::now();
        let mut sh = shard(10, PolicyKind::Lru);
        write(&mut sh, &keys(&[1, 2, 3, 4, 5, 6, 7]), t0);
        let out = sh.evict(t0);
        assert!(!out.triggered, "70% is below the 0.8 watermark");
        write(&mut sh, &keys(&[8]), t0);
        sh.reserve_read(&keys(&[8]), 1, t0);
        assert_eq!(order(&sh), [7, 6, 5, 4, 3, 2, 1, 8]);
        sh.touch(&keys(&[7]), secs(t0, 1));
        let out = sh.evict(secs(t0, 1));
        assert!(out.triggered);
        // 8 tracked * 0.2 = 1 key: the least recent is now 6.
        assert_eq!(out.evicted_keys, 1);
        assert!(!sh.contains(&key(6)));
        assert_eq!(sh.stats().eviction_loop_ticks, 2);
        assert_eq!(sh.stats().eviction_loop_triggered, 1);
        assert_eq!(sh.stats().evicted_chunks, 1);
        sh.validate();
    }

    #[test]
    fn lru_tick_skips_locked_and_evicts_expired_stages() {
        let t0 = Instant::now();
        let mut sh = shard(5, PolicyKind::Lru);
        write(&mut sh, &keys(&[1, 2]), t0);
        sh.reserve_read(&keys(&[2, 1]), 1, t0);
        sh.reserve_write(&keys(&[3, 4]), A, T1, false, t0);
        // Everything is locked: nothing can go.
        let out = sh.evict(t0);
        assert!(out.triggered && out.evicted_keys == 0);
        // After the write TTL the stages are evictable, the read locks too.
        let out = sh.evict(secs(t0, 10));
        assert_eq!(out.evicted_keys, 1, "4 tracked * 0.2 rounds up to 1");
        assert_eq!(out.evicted_bytes, A);
        sh.validate();
    }

    #[test]
    fn expire_reclaims_stages_and_abandoned_temporaries() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Noop);
        sh.reserve_write(&keys(&[1, 2]), A, T1, false, t0);
        sh.reserve_write(&keys(&[3]), A, T1, true, t0);
        sh.finish_write_and_reserve_read(&keys(&[3]), T1, 1, t0);
        sh.reserve_write(&keys(&[4]), A, T1, true, t0);
        sh.finish_write(&keys(&[4]), T1, t0);
        assert_eq!(sh.expire(secs(t0, 4)), ExpireOutcome::default());
        // Read TTL (5 s) passed: both temporaries are abandoned.
        assert_eq!(
            sh.expire(secs(t0, 5)),
            ExpireOutcome {
                stages: 0,
                temporaries: 2
            }
        );
        assert_eq!(
            sh.expire(secs(t0, 10)),
            ExpireOutcome {
                stages: 2,
                temporaries: 0
            }
        );
        assert_eq!(sh.usage().0, 0);
        assert_eq!(sh.stats().expired_stages, 2);
        assert_eq!(sh.stats().expired_temporaries, 2);
        sh.validate();
    }

    #[test]
    fn status_counts() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        write(&mut sh, &keys(&[1, 2]), t0);
        sh.reserve_read(&keys(&[1]), 3, t0);
        sh.reserve_write(&keys(&[3]), A, T1, true, t0);
        sh.reserve_write(&keys(&[4]), A, T1, false, secs(t0, 0));
        let st = sh.status(t0);
        assert_eq!(
            st,
            L1Status {
                total_object_count: 4,
                write_locked_count: 2,
                read_locked_count: 1,
                temporary_count: 1,
                staging_object_count: 2,
                staging_bytes: 2 * A,
                memory_used_bytes: 4 * A,
                memory_total_bytes: 8 * A,
            }
        );
        let later = sh.status(secs(t0, 10));
        assert_eq!((later.write_locked_count, later.read_locked_count), (0, 0));
    }

    /// `status` as the walk it replaced computes it.
    fn walked_status(sh: &L1Shard, now: Instant) -> L1Status {
        let mut s = L1Status::default();
        for entry in sh.entries.values() {
            if let Some(r) = &entry.resident {
                s.total_object_count += 1;
                s.read_locked_count += r.read_lock.is_locked(now) as usize;
                s.temporary_count += r.temporary as usize;
            }
            for st in &entry.stages {
                s.total_object_count += 1;
                s.staging_object_count += 1;
                s.staging_bytes += st.slab.len;
                s.write_locked_count += st.write_lock.is_locked(now) as usize;
                s.temporary_count += st.temporary as usize;
            }
        }
        (s.memory_used_bytes, s.memory_total_bytes) = sh.usage();
        s
    }

    #[test]
    fn status_counts_follow_lock_expiry_and_sweeps() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        write(&mut sh, &keys(&[1, 2]), t0);
        sh.reserve_read(&keys(&[1]), 2, t0); // deadline t0+5
        sh.reserve_read(&keys(&[2]), 1, secs(t0, 3)); // deadline t0+8
        sh.reserve_write(&keys(&[3]), A, T1, false, t0); // deadline t0+10
        let locked = |sh: &L1Shard, s| {
            let st = sh.status(secs(t0, s));
            assert_eq!(st, walked_status(sh, secs(t0, s)));
            (st.read_locked_count, st.write_locked_count)
        };
        assert_eq!(locked(&sh, 4), (2, 1));
        // Expired but not yet swept: still exact.
        assert_eq!(locked(&sh, 5), (1, 1));
        sh.expire(secs(t0, 6));
        sh.validate();
        assert_eq!(locked(&sh, 6), (1, 1));
        // Releasing a lock counts at once, without an expire pass.
        assert_eq!(sh.finish_read(&keys(&[2]), 1, secs(t0, 7)), vec![Ok(())]);
        assert_eq!(locked(&sh, 7), (0, 1));
        // A renewed write lock moves its deadline; an expired read lock is
        // taken afresh.
        assert_eq!(sh.renew_write(&keys(&[3]), T1, secs(t0, 9)), vec![true]);
        sh.reserve_read(&keys(&[1]), 1, secs(t0, 9));
        sh.validate();
        assert_eq!(locked(&sh, 12), (1, 1));
        sh.expire(secs(t0, 20));
        sh.validate();
        assert_eq!(locked(&sh, 20), (0, 0));
        assert_eq!(sh.status(secs(t0, 20)).total_object_count, 2);
    }

    /// Random operations with time jumping past the TTLs; the kept counts
    /// must match a walk after every step.
    #[test]
    fn status_counts_never_drift() {
        let mut state = 0x5eed_u64;
        let mut rand = |n: u64| {
            // splitmix64
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % n
        };
        let t0 = Instant::now();
        for policy in [PolicyKind::Lru, PolicyKind::Noop, PolicyKind::IsolatedLru] {
            let mut sh = shard(12, policy);
            if policy == PolicyKind::IsolatedLru {
                sh.policy_mut().set_quota("a", 4 * A);
                sh.policy_mut().set_quota("b", 8 * A);
            }
            let mut ms = 0u64;
            for _ in 0..3000 {
                ms += match rand(10) {
                    0..=5 => 0,
                    6..=8 => rand(2000),
                    _ => rand(12_000),
                };
                let now = t0 + Duration::from_millis(ms);
                let ks: Vec<ObjectKey> = (0..1 + rand(3))
                    .map(|_| salted(rand(10) as u8, ["", "a", "b"][rand(3) as usize]))
                    .collect();
                let tag = WriterTag(1 + rand(2));
                let n = rand(4) as u32;
                match rand(14) {
                    0..=2 => {
                        let size = 1 + rand(2 * A);
                        sh.reserve_write(&ks, size, tag, rand(4) == 0, now);
                    }
                    3 => {
                        sh.finish_write(&ks, tag, now);
                    }
                    4 => {
                        sh.finish_write_and_reserve_read(&ks, tag, n, now);
                    }
                    5 => {
                        sh.abort_write(&ks, tag);
                    }
                    6 => {
                        sh.reserve_read(&ks, n, now);
                    }
                    7 => {
                        sh.finish_read(&ks, n, now);
                    }
                    8 => {
                        sh.renew_read(&ks, now);
                        sh.renew_write(&ks, tag, now);
                    }
                    9 => {
                        sh.delete(&ks, rand(4) == 0, now);
                    }
                    10 => {
                        if rand(10) == 0 {
                            sh.clear(rand(2) == 0, now);
                        }
                    }
                    11 => {
                        sh.evict(now);
                    }
                    _ => {
                        sh.expire(now);
                    }
                }
                sh.validate();
                assert_eq!(sh.status(now), walked_status(&sh, now), "{policy:?}");
            }
        }
    }

    #[test]
    fn bytes_are_tracked_per_salt() {
        let t0 = Instant::now();
        let mut sh = shard(8, PolicyKind::Lru);
        let a = [salted(1, "a"), salted(2, "a")];
        let b = [salted(3, "b")];
        sh.reserve_write(&a, A, T1, false, t0);
        sh.reserve_write(&b, 2 * A, T1, false, t0);
        let mut got: Vec<(String, u64)> =
            sh.bytes_by_salt().map(|(s, b)| (s.to_owned(), b)).collect();
        got.sort();
        assert_eq!(got, [("a".to_owned(), 2 * A), ("b".to_owned(), 2 * A)]);
        sh.abort_write(&b, T1);
        assert_eq!(sh.bytes_by_salt().count(), 1);
        sh.validate();
    }

    /// IsolatedLRU keeps enforcing quotas tick after tick (0.5.6 issue #4817:
    /// its eviction thread died on the first cycle).
    #[test]
    fn isolated_lru_enforces_quotas_every_tick() {
        let t0 = Instant::now();
        let mut sh = shard(64, PolicyKind::IsolatedLru);
        sh.policy_mut().set_quota("a", 10 * A);
        sh.policy_mut().set_quota("b", 20 * A);
        let mut next = [0u8; 3];
        let mut pinned = salted(0, "none");
        for tick in 0..50u64 {
            let now = secs(t0, tick);
            // Each tick, every tenant writes 3 chunks; "c" has no quota.
            for (t, salt) in ["a", "b", "c"].iter().enumerate() {
                let ks: Vec<ObjectKey> = (0..3)
                    .map(|_| {
                        next[t] = next[t].wrapping_add(1);
                        ObjectKey {
                            object_group_id: t as u32,
                            ..salted(next[t], salt)
                        }
                    })
                    .collect();
                let r = sh.reserve_write(&ks, A, T1, false, now);
                let ok: Vec<ObjectKey> = ks
                    .iter()
                    .zip(&r)
                    .filter(|(_, r)| r.is_ok())
                    .map(|(k, _)| *k)
                    .collect();
                sh.finish_write(&ok, T1, now);
            }
            // One "b" key stays read-locked for the read TTL (5 s): it must
            // survive every tick meanwhile.
            if tick == 5 {
                pinned = ObjectKey {
                    object_group_id: 1,
                    ..salted(next[1], "b")
                };
                assert!(sh.reserve_read(std::slice::from_ref(&pinned), 1, now)[0].is_ok());
            }
            let out = sh.evict(now);
            if (5..10).contains(&tick) {
                assert!(sh.contains(&pinned), "tick {tick}: read-locked key evicted");
            }
            assert!(
                out.triggered,
                "tick {tick}: salt c always holds unallowed data"
            );
            let bytes: HashMap<String, u64> =
                sh.bytes_by_salt().map(|(s, b)| (s.to_owned(), b)).collect();
            assert!(
                bytes.get("a").copied().unwrap_or(0) < 8 * A,
                "tick {tick}: a over quota: {bytes:?}"
            );
            assert!(
                bytes.get("b").copied().unwrap_or(0) < 16 * A,
                "tick {tick}: b over quota: {bytes:?}"
            );
            assert_eq!(
                bytes.get("c"),
                None,
                "tick {tick}: unallowed salt kept data"
            );
            sh.validate();
        }
        assert_eq!(sh.stats().eviction_loop_triggered, 50);
        assert_eq!(sh.stats().allocation_failure_chunks, 0);
        assert!(
            sh.stats().evicted_chunks >= 100,
            "every tick evicts c's 3 chunks"
        );
    }

    #[test]
    fn isolated_lru_pressure_evicts_own_salt_first() {
        let t0 = Instant::now();
        let mut sh = shard(4, PolicyKind::IsolatedLru);
        sh.policy_mut().set_quota("a", 2 * A);
        sh.policy_mut().set_quota("b", 2 * A);
        let a = [salted(1, "a"), salted(2, "a")];
        let b = [salted(3, "b"), salted(4, "b")];
        for ks in [&a[..], &b[..]] {
            sh.reserve_write(ks, A, T1, false, t0);
            sh.finish_write(ks, T1, t0);
        }
        let r = sh.reserve_write(&[salted(5, "b")], A, T1, false, t0);
        assert!(r[0].is_ok());
        assert!(
            sh.contains(&a[0]) && sh.contains(&a[1]),
            "tenant a untouched"
        );
        assert_eq!(sh.contains(&b[0]) as u8 + sh.contains(&b[1]) as u8, 1);
        sh.validate();
    }
}
