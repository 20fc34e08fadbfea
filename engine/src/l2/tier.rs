//! One L2 adapter as a shard sees it: the adapter plus what 0.5.6 keeps beside
//! it (the listener-driven usage accounting, the per-adapter eviction policy
//! and the quota table), and counters for `/metrics`.
//!
//! Accounting follows the objects this shard stored, deleted or found: a key
//! found by a lookup that the shard has not accounted yet (stored by an earlier
//! run or another process) is adopted with the size the adapter reported, so
//! eviction can reach it.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::eviction::{eviction_target, EvictionConfig, EvictionPolicy, PolicyKind, Scope};
use crate::keys::{KeyMap, Name, ObjectKey};

use super::health::{Failure, Failures, Gate, L2Op};
use super::{KeyPage, L2Adapter, ObjectBytes, StoreResult};

/// An operation that has run this long without an answer makes the tier
/// unhealthy (a frozen disk, a hung endpoint), while it still runs.
pub const STALL_AFTER: Duration = Duration::from_secs(10);

/// Counters of one tier on one shard (summed over shards for `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub store_keys: u64,
    pub stored_keys: u64,
    pub stored_bytes: u64,
    pub store_existing_keys: u64,
    pub store_failed_keys: u64,
    pub lookup_keys: u64,
    pub lookup_hit_keys: u64,
    pub load_keys: u64,
    pub loaded_keys: u64,
    pub loaded_bytes: u64,
    pub load_failed_keys: u64,
    pub deleted_keys: u64,
    pub deleted_bytes: u64,
    pub evicted_keys: u64,
    pub evicted_bytes: u64,
    pub eviction_ticks: u64,
    pub eviction_triggered: u64,
    /// Keys not sent to the adapter because its gate was closed (stores
    /// failed, lookups missed, loads failed at once).
    pub gate_skipped_keys: u64,
}

/// Bytes held, by cache_salt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub used_bytes: u64,
    /// 0 = unbounded.
    pub capacity_bytes: u64,
    pub keys: u64,
    pub bytes_by_salt: BTreeMap<String, u64>,
}

impl TierUsage {
    /// used / capacity, or -1 without a capacity (0.5.6's "no signal").
    pub fn usage_fraction(&self) -> f64 {
        if self.capacity_bytes == 0 {
            -1.0
        } else {
            self.used_bytes as f64 / self.capacity_bytes as f64
        }
    }
}

#[derive(Default)]
struct Book {
    sizes: KeyMap<ObjectKey, u64>,
    locks: KeyMap<ObjectKey, u32>,
    /// Everything but `bytes_by_salt`, which `salt_bytes` holds.
    usage: TierUsage,
    /// cache_salt -> bytes held.
    salt_bytes: BTreeMap<Name, u64>,
    stats: TierStats,
}

impl Book {
    fn add(&mut self, key: &ObjectKey, size: u64) -> bool {
        if self.sizes.contains_key(key) {
            return false;
        }
        self.sizes.insert(*key, size);
        self.usage.used_bytes += size;
        self.usage.keys += 1;
        *self.salt_bytes.entry(key.cache_salt).or_default() += size;
        true
    }

    fn remove(&mut self, key: &ObjectKey) -> Option<u64> {
        let size = self.sizes.remove(key)?;
        self.usage.used_bytes -= size;
        self.usage.keys -= 1;
        if let Some(b) = self.salt_bytes.get_mut(&key.cache_salt) {
            *b -= size;
            if *b == 0 {
                self.salt_bytes.remove(&key.cache_salt);
            }
        }
        Some(size)
    }
}

/// [`L2Tier::health`].
#[derive(Debug, Clone, PartialEq)]
pub struct TierHealth {
    pub healthy: bool,
    /// Why not, in one line (the gate, a stall, or the first failure).
    pub cause: Option<String>,
    /// Operations whose latest outcome was a failure.
    pub failing: Vec<Failure>,
    /// The oldest operation running past [`STALL_AFTER`], and for how long.
    pub stalled: Option<(L2Op, Duration)>,
    pub gate_closed: bool,
    pub gate_closed_for: Option<Duration>,
    pub consecutive_timeouts: u32,
    pub timeouts: u64,
    pub gate_trips: u64,
}

impl TierHealth {
    pub fn json(&self) -> serde_json::Value {
        let now = Instant::now();
        serde_json::json!({
            "is_healthy": self.healthy,
            "cause": self.cause,
            "failing": self.failing.iter().map(|f| serde_json::json!({
                "op": f.op.name(),
                "cause": f.cause,
                "count": f.count,
                "since_seconds": now.saturating_duration_since(f.since).as_secs_f64(),
            })).collect::<Vec<_>>(),
            "stalled": self.stalled.map(|(op, d)| serde_json::json!({
                "op": op.name(), "running_seconds": d.as_secs_f64(),
            })),
            "gate": {
                "closed": self.gate_closed,
                "closed_for_seconds": self.gate_closed_for.map(|d| d.as_secs_f64()),
                "consecutive_timeouts": self.consecutive_timeouts,
                "timeouts": self.timeouts,
                "trips": self.gate_trips,
            },
        })
    }
}

/// Result of one eviction tick.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierEvictOutcome {
    pub triggered: bool,
    pub evicted_keys: u64,
    pub evicted_bytes: u64,
}

pub struct L2Tier {
    name: String,
    adapter: Box<dyn L2Adapter>,
    book: RefCell<Book>,
    policy: RefCell<Option<EvictionPolicy>>,
    gate: Gate,
    /// Failures the tier sees itself (lookups past their deadline).
    failures: Failures,
    /// Operations running on the adapter, by a sequence number: when each
    /// started (a stall shows while it lasts).
    running: RefCell<BTreeMap<u64, (L2Op, Instant)>>,
    next_op: Cell<u64>,
    /// Counting what the adapter held at start ([`L2Tier::seed_usage`]).
    seed: RefCell<Seed>,
}

/// Where [`L2Tier::seed_usage`] is.
enum Seed {
    Off,
    Scanning {
        since: Instant,
        seen: super::ScanSeen,
    },
    Done {
        objects: u64,
        bytes: u64,
        took: Duration,
        /// Why the scan stopped early (what it found before is counted).
        error: Option<String>,
    },
}

/// Removes its operation from [`L2Tier::running`] when the operation ends.
struct Running<'a> {
    tier: &'a L2Tier,
    id: u64,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.tier.running.borrow_mut().remove(&self.id);
    }
}

impl L2Tier {
    /// `name` identifies the tier in logs and status (e.g. `fs#1`).
    pub fn new(
        name: String,
        adapter: Box<dyn L2Adapter>,
        eviction: Option<EvictionConfig>,
    ) -> Self {
        let book = Book {
            usage: TierUsage {
                capacity_bytes: adapter.capacity_bytes(),
                ..TierUsage::default()
            },
            ..Book::default()
        };
        L2Tier {
            name,
            adapter,
            book: RefCell::new(book),
            policy: RefCell::new(eviction.map(EvictionPolicy::new)),
            gate: Gate::default(),
            failures: Failures::default(),
            running: RefCell::new(BTreeMap::new()),
            next_op: Cell::new(0),
            seed: RefCell::new(Seed::Off),
        }
    }

    fn begin(&self, op: L2Op) -> Running<'_> {
        let id = self.next_op.get();
        self.next_op.set(id + 1);
        self.running.borrow_mut().insert(id, (op, Instant::now()));
        Running { tier: self, id }
    }

    /// Whether requests may go to the adapter (see [`Gate`]).
    pub fn is_open(&self) -> bool {
        self.gate.is_open()
    }

    /// Counts `n` keys not sent because the gate is closed.
    fn skipped(&self, n: usize) {
        self.book.borrow_mut().stats.gate_skipped_keys += n as u64;
    }

    /// A lookup or load (`op`) of this tier answered, within its lookup's
    /// deadline or after it: the count toward the gate starts over (a tier
    /// that answers slowly is not closed for it; one that does not answer at
    /// all is), and the operation's latest outcome is this answer.
    pub fn answered(&self, op: L2Op) {
        self.gate.answered(op);
        self.failures.succeeded(op);
    }

    /// A lookup or load (`op`) of this tier ran past its lookup's deadline
    /// `limit` (it goes on: what a lookup finds is given back, what a load
    /// loads lands in L1). Counts toward the gate at once.
    pub fn timed_out(&self, op: L2Op, limit: Duration) {
        let now = Instant::now();
        self.failures.failed(
            op,
            1,
            || format!("no answer within {limit:?} (--l2-prefetch-load-timeout)"),
            now,
        );
        if self.gate.timed_out(op, now) {
            log::warn!(
                "L2 {}: {} {}s in a row got no answer within {limit:?}: lookups miss and stores \
                 skip it until it answers a probe (one a second)",
                self.name,
                Gate::THRESHOLD,
                op.name()
            );
        }
    }

    /// Probes the adapter if the gate is closed and no probe runs (the shard
    /// calls it every second); an answer opens the gate.
    pub async fn probe(&self) {
        if !self.gate.begin_probe() {
            return;
        }
        let res = {
            let _op = self.begin(L2Op::Probe);
            self.adapter.probe().await
        };
        let now = Instant::now();
        match &res {
            Ok(()) => self.failures.succeeded(L2Op::Probe),
            Err(e) => self.failures.failed(L2Op::Probe, 1, || e.clone(), now),
        }
        if let Some(closed) = self.gate.probed(res.is_ok(), now) {
            log::info!(
                "L2 {}: answers again after {:.1} s: lookups and stores use it again",
                self.name,
                closed.as_secs_f64()
            );
        }
    }

    /// Whether the tier is healthy and why not: its gate, its own and the
    /// adapter's latest failures, and operations stalled past
    /// [`STALL_AFTER`].
    pub fn health(&self, now: Instant) -> TierHealth {
        let mut failing = self.adapter.failures();
        failing.extend(self.failures.current());
        failing.sort_by_key(|f| f.op);
        let stalled = self
            .running
            .borrow()
            .values()
            .filter(|(_, at)| now.saturating_duration_since(*at) >= STALL_AFTER)
            .min_by_key(|(_, at)| *at)
            .map(|&(op, at)| (op, now.saturating_duration_since(at)));
        let gate = self.gate.status(now);
        let cause = if gate.closed {
            Some(format!(
                "closed to requests for {:.1} s: {} requests in a row got no answer in time; probed every second",
                gate.closed_for.unwrap_or_default().as_secs_f64(),
                gate.consecutive_timeouts
            ))
        } else if let Some((op, d)) = stalled {
            Some(format!(
                "a {} has run for {:.1} s without an answer",
                op.name(),
                d.as_secs_f64()
            ))
        } else {
            failing
                .first()
                .map(|f| format!("{}: {}", f.op.name(), f.cause))
        };
        TierHealth {
            healthy: cause.is_none(),
            cause,
            failing,
            stalled,
            gate_closed: gate.closed,
            gate_closed_for: gate.closed_for,
            consecutive_timeouts: gate.consecutive_timeouts,
            timeouts: gate.timeouts,
            gate_trips: gate.trips,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn adapter(&self) -> &dyn L2Adapter {
        &*self.adapter
    }

    pub async fn store(&self, items: &[(ObjectKey, ObjectBytes)]) -> Vec<StoreResult> {
        if !self.is_open() {
            self.skipped(items.len());
            let mut book = self.book.borrow_mut();
            book.stats.store_keys += items.len() as u64;
            book.stats.store_failed_keys += items.len() as u64;
            return vec![StoreResult::Failed; items.len()];
        }
        let res = {
            let _op = self.begin(L2Op::Store);
            self.adapter.store(items).await
        };
        let mut book = self.book.borrow_mut();
        let mut created = Vec::new();
        book.stats.store_keys += items.len() as u64;
        for ((key, _), r) in items.iter().zip(&res) {
            match r {
                StoreResult::Stored(size) => {
                    book.stats.stored_keys += 1;
                    book.stats.stored_bytes += size;
                    if book.add(key, *size) {
                        created.push(*key);
                    }
                }
                StoreResult::Exists => book.stats.store_existing_keys += 1,
                StoreResult::Failed => book.stats.store_failed_keys += 1,
            }
        }
        drop(book);
        if let Some(p) = self.policy.borrow_mut().as_mut() {
            p.on_keys_created(created.iter());
        }
        res
    }

    /// Looks up and locks; hits are touched (and adopted into the accounting
    /// when this shard did not know them).
    pub async fn lookup_and_lock(&self, keys: &[ObjectKey]) -> Vec<Option<u64>> {
        if !self.is_open() {
            self.skipped(keys.len());
            self.book.borrow_mut().stats.lookup_keys += keys.len() as u64;
            return vec![None; keys.len()];
        }
        let res = {
            let _op = self.begin(L2Op::Lookup);
            self.adapter.lookup_and_lock(keys).await
        };
        let mut book = self.book.borrow_mut();
        book.stats.lookup_keys += keys.len() as u64;
        let mut adopted = Vec::new();
        let mut touched = Vec::new();
        for (key, r) in keys.iter().zip(&res) {
            if let Some(size) = r {
                book.stats.lookup_hit_keys += 1;
                *book.locks.entry(*key).or_default() += 1;
                if book.add(key, *size) {
                    adopted.push(*key);
                } else {
                    touched.push(*key);
                }
            }
        }
        drop(book);
        if let Some(p) = self.policy.borrow_mut().as_mut() {
            p.on_keys_created(adopted.iter());
            p.on_keys_touched(touched.iter());
        }
        res
    }

    pub async fn load(&self, items: &[(ObjectKey, ObjectBytes)]) -> Vec<bool> {
        if !self.is_open() {
            self.skipped(items.len());
            let mut book = self.book.borrow_mut();
            book.stats.load_keys += items.len() as u64;
            book.stats.load_failed_keys += items.len() as u64;
            return vec![false; items.len()];
        }
        let res = {
            let _op = self.begin(L2Op::Load);
            self.adapter.load(items).await
        };
        let mut book = self.book.borrow_mut();
        book.stats.load_keys += items.len() as u64;
        for ((_, buf), ok) in items.iter().zip(&res) {
            if *ok {
                book.stats.loaded_keys += 1;
                book.stats.loaded_bytes += buf.len() as u64;
            } else {
                book.stats.load_failed_keys += 1;
            }
        }
        res
    }

    pub fn unlock(&self, keys: &[ObjectKey]) {
        if keys.is_empty() {
            return;
        }
        {
            let mut book = self.book.borrow_mut();
            for key in keys {
                if let Some(n) = book.locks.get_mut(key) {
                    *n -= 1;
                    if *n == 0 {
                        book.locks.remove(key);
                    }
                }
            }
        }
        self.adapter.unlock(keys);
    }

    /// Deletes unlocked keys; answers the bytes freed per key.
    pub async fn delete(&self, keys: &[ObjectKey]) -> Vec<Option<u64>> {
        if !self.is_open() {
            return vec![None; keys.len()];
        }
        let res = {
            let _op = self.begin(L2Op::Delete);
            self.adapter.delete(keys).await
        };
        let mut book = self.book.borrow_mut();
        let mut policy = self.policy.borrow_mut();
        for (key, r) in keys.iter().zip(&res) {
            if let Some(size) = r {
                book.stats.deleted_keys += 1;
                book.stats.deleted_bytes += size;
            }
            // Deleted, or (unlocked and not deleted) missing or failing: the
            // tier stops accounting it; a later lookup hit adopts it again.
            if r.is_some() || !book.locks.contains_key(key) {
                book.remove(key);
                if let Some(p) = policy.as_mut() {
                    p.on_key_removed(key);
                }
            }
        }
        res
    }

    /// One eviction pass (the shard calls it every second): LRU against the
    /// capacity and watermark, IsolatedLRU against the quotas (a salt without
    /// a quota is wiped, as 0.5.6).
    pub async fn evict_tick(&self) -> TierEvictOutcome {
        let victims = {
            let policy = self.policy.borrow();
            let Some(policy) = policy.as_ref() else {
                return TierEvictOutcome::default();
            };
            let mut book = self.book.borrow_mut();
            book.stats.eviction_ticks += 1;
            let cfg = policy.config().clone();
            let evictable = |k: &ObjectKey| -> Option<u64> {
                if book.locks.contains_key(k) {
                    None
                } else {
                    book.sizes.get(k).copied()
                }
            };
            let mut victims = Vec::new();
            match cfg.policy {
                PolicyKind::Noop => {}
                PolicyKind::Lru => {
                    let u = &book.usage;
                    if u.capacity_bytes > 0
                        && u.used_bytes as f64 >= cfg.trigger_watermark * u.capacity_bytes as f64
                    {
                        let target =
                            eviction_target(policy.tracked_len(Scope::All), cfg.eviction_ratio);
                        victims = policy.victims(Scope::All, target, 0, evictable);
                    }
                }
                PolicyKind::IsolatedLru => {
                    for (&salt, &bytes) in &book.salt_bytes {
                        let limit = policy.quota(&salt).unwrap_or(0);
                        let threshold = cfg.trigger_watermark * limit as f64;
                        if bytes == 0 || (bytes as f64) < threshold {
                            continue;
                        }
                        let (ratio, min_bytes) = if limit == 0 || threshold <= 0.0 {
                            (1.0, bytes)
                        } else {
                            let keep = (threshold.ceil() as u64).saturating_sub(1);
                            (cfg.eviction_ratio, bytes.saturating_sub(keep))
                        };
                        let min_count =
                            eviction_target(policy.tracked_len(Scope::Salt(salt)), ratio);
                        victims.extend(policy.victims(
                            Scope::Salt(salt),
                            min_count,
                            min_bytes,
                            &evictable,
                        ));
                    }
                }
            }
            if !victims.is_empty() {
                book.stats.eviction_triggered += 1;
            }
            victims
        };
        if victims.is_empty() {
            return TierEvictOutcome::default();
        }
        let freed = self.delete(&victims).await;
        let mut out = TierEvictOutcome {
            triggered: true,
            ..TierEvictOutcome::default()
        };
        for b in freed.into_iter().flatten() {
            out.evicted_keys += 1;
            out.evicted_bytes += b;
        }
        let mut book = self.book.borrow_mut();
        book.stats.evicted_keys += out.evicted_keys;
        book.stats.evicted_bytes += out.evicted_bytes;
        if out.evicted_keys > 0 {
            log::debug!(
                "L2 {}: evicted {} objects ({} bytes)",
                self.name,
                out.evicted_keys,
                out.evicted_bytes
            );
        }
        out
    }

    pub async fn list(
        &self,
        model_name: Option<&str>,
        page_size: usize,
        cursor: Option<String>,
    ) -> std::io::Result<KeyPage> {
        self.adapter.list(model_name, page_size, cursor).await
    }

    /// Counts what the adapter already holds toward usage and eviction: pages
    /// through [`L2Tier::list`], keeps the keys this shard owns (every shard
    /// lists the whole store and keeps its own) and adopts them oldest first,
    /// by the modification time the adapter reports, as 0.5.6 orders its
    /// bucket listing (`_order_entries_by_last_modified`), so the LRU evicts
    /// the oldest objects first. Keys without a time count as older than
    /// the dated ones. Returns the keys adopted; a listing error stops the
    /// scan, and what was listed before it is still adopted.
    pub async fn seed_usage(&self, shard: usize, num_shards: usize) -> std::io::Result<u64> {
        let t0 = Instant::now();
        let seen: super::ScanSeen = Default::default();
        *self.seed.borrow_mut() = Seed::Scanning {
            since: t0,
            seen: seen.clone(),
        };
        let (mut found, listed) = {
            let _op = self.begin(L2Op::List);
            self.adapter.scan(shard, num_shards, seen).await
        };
        // One batch, newest first: the policy makes a batch's last key its
        // least recently used, so the oldest object is evicted first. The
        // sort is stable, and undated keys sort as the oldest.
        found.sort_by_key(|(_, _, at)| std::cmp::Reverse(*at));
        let mut adopted = Vec::new();
        let mut bytes = 0;
        {
            let mut book = self.book.borrow_mut();
            for (key, size, _) in found {
                if book.add(&key, size) {
                    adopted.push(key);
                    bytes += size;
                }
            }
        }
        if let Some(p) = self.policy.borrow_mut().as_mut() {
            p.on_keys_created(adopted.iter());
        }
        let n = adopted.len() as u64;
        *self.seed.borrow_mut() = Seed::Done {
            objects: n,
            bytes,
            took: t0.elapsed(),
            error: listed.as_ref().err().map(|e| e.to_string()),
        };
        listed.map(|()| n)
    }

    /// The usage seeding's progress, for `/status`.
    fn seed_json(&self) -> serde_json::Value {
        match &*self.seed.borrow() {
            Seed::Off => serde_json::json!({"state": "off"}),
            Seed::Scanning { since, seen } => serde_json::json!({
                "state": "scanning",
                "objects_seen": seen.load(std::sync::atomic::Ordering::Relaxed),
                "seconds": since.elapsed().as_secs_f64(),
            }),
            Seed::Done {
                objects,
                bytes,
                took,
                error,
            } => serde_json::json!({
                "state": if error.is_some() { "stopped" } else { "done" },
                "objects_adopted": objects,
                "bytes_adopted": bytes,
                "seconds": took.as_secs_f64(),
                "error": error,
            }),
        }
    }

    /// Sets this shard's share of `salt`'s quota (IsolatedLRU).
    pub fn set_quota(&self, salt: &str, limit_bytes: u64) {
        if let Some(p) = self.policy.borrow_mut().as_mut() {
            p.set_quota(salt, limit_bytes);
        }
    }

    pub fn remove_quota(&self, salt: &str) {
        if let Some(p) = self.policy.borrow_mut().as_mut() {
            p.remove_quota(salt);
        }
    }

    pub fn eviction_policy(&self) -> Option<PolicyKind> {
        self.policy.borrow().as_ref().map(|p| p.kind())
    }

    pub fn usage(&self) -> TierUsage {
        let book = self.book.borrow();
        TierUsage {
            bytes_by_salt: book
                .salt_bytes
                .iter()
                .map(|(s, &b)| (s.to_string(), b))
                .collect(),
            ..book.usage.clone()
        }
    }

    pub fn stats(&self) -> TierStats {
        self.book.borrow().stats
    }

    pub fn reset_stats(&self) {
        self.book.borrow_mut().stats = TierStats::default();
    }

    /// Keys this shard holds a lookup lock on.
    pub fn locked_keys(&self) -> usize {
        self.book.borrow().locks.len()
    }

    pub fn status(&self) -> serde_json::Value {
        let u = self.usage();
        let h = self.health(Instant::now());
        serde_json::json!({
            "health": h.json(),
            "usage_seed": self.seed_json(),
            "name": self.name,
            "type": self.adapter.kind(),
            "used_bytes": u.used_bytes,
            "capacity_bytes": u.capacity_bytes,
            "usage_fraction": u.usage_fraction(),
            "keys": u.keys,
            "locked_keys": self.locked_keys(),
            "eviction_policy": self.eviction_policy().map(|p| p.name()),
            "adapter": self.adapter.status(),
        })
    }
}
