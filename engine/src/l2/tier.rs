//! One L2 adapter as a shard sees it: the adapter plus what 0.5.6 keeps beside
//! it (the listener-driven usage accounting, the per-adapter eviction policy
//! and the quota table), and counters for `/metrics`.
//!
//! Accounting follows the objects this shard stored, deleted or found: a key
//! found by a lookup that the shard has not accounted yet (stored by an earlier
//! run or another process) is adopted with the size the adapter reported, so
//! eviction can reach it.

use std::cell::RefCell;
use std::collections::BTreeMap;

use crate::eviction::{eviction_target, EvictionConfig, EvictionPolicy, PolicyKind, Scope};
use crate::keys::{KeyMap, Name, ObjectKey};

use super::{KeyPage, L2Adapter, ObjectBytes, StoreResult};

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
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn adapter(&self) -> &dyn L2Adapter {
        &*self.adapter
    }

    pub async fn store(&self, items: &[(ObjectKey, ObjectBytes)]) -> Vec<StoreResult> {
        let res = self.adapter.store(items).await;
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
        let res = self.adapter.lookup_and_lock(keys).await;
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
        let res = self.adapter.load(items).await;
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
        let res = self.adapter.delete(keys).await;
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
        const PAGE: usize = 1000;
        let mut cursor = None;
        let mut found: Vec<(Option<std::time::SystemTime>, ObjectKey, u64)> = Vec::new();
        let listed = loop {
            let page = match self.adapter.list(None, PAGE, cursor).await {
                Ok(p) => p,
                Err(e) => break Err(e),
            };
            let mut modified = page.modified.into_iter();
            for (key, size) in page.keys {
                let at = modified.next().flatten();
                if key.shard(num_shards) == shard {
                    found.push((at, key, size));
                }
            }
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break Ok(()),
            }
        };
        // One batch, newest first: the policy makes a batch's last key its
        // least recently used, so the oldest object is evicted first. The
        // sort is stable, and undated keys sort as the oldest.
        found.sort_by_key(|(at, _, _)| std::cmp::Reverse(*at));
        let mut adopted = Vec::new();
        {
            let mut book = self.book.borrow_mut();
            for (_, key, size) in found {
                if book.add(&key, size) {
                    adopted.push(key);
                }
            }
        }
        if let Some(p) = self.policy.borrow_mut().as_mut() {
            p.on_keys_created(adopted.iter());
        }
        listed.map(|()| adopted.len() as u64)
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
        serde_json::json!({
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
