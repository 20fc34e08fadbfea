//! Eviction policies of an L1 shard: LRU, noop and IsolatedLRU (one LRU per
//! cache_salt, with per-salt byte quotas).
//!
//! A policy only orders keys and picks victims; the shard decides when to ask
//! (watermark, quotas, allocation pressure), says which keys may go (not locked)
//! and deletes them. Semantics follow lmcache 0.5.6's `eviction_policy/*`:
//! keys created or touched in one batch are inserted in reverse order, so a
//! request's tail chunks are evicted before its prefix.

use std::collections::{BTreeMap, HashMap};

use crate::keys::{KeyMap, Name, ObjectKey};

/// Which policy a shard runs (`--eviction-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// `LRU`: one recency list for the shard.
    Lru,
    /// `noop`: tracks nothing, never evicts (meant for `skip_l1`).
    Noop,
    /// `IsolatedLRU`: one recency list per cache_salt, evicted against per-salt
    /// quotas; salts without a quota are not allowed to keep data.
    IsolatedLru,
}

impl PolicyKind {
    /// The `--eviction-policy` spelling of 0.5.6.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "LRU",
            PolicyKind::Noop => "noop",
            PolicyKind::IsolatedLru => "IsolatedLRU",
        }
    }
}

/// Eviction settings of one shard.
#[derive(Debug, Clone, PartialEq)]
pub struct EvictionConfig {
    pub policy: PolicyKind,
    /// Usage fraction (used / capacity; for IsolatedLRU, salt bytes / salt
    /// quota) at or above which a tick evicts. 0.5.6 default 0.8.
    pub trigger_watermark: f64,
    /// Fraction of the tracked keys (of the salt, for IsolatedLRU) one tick
    /// evicts, at least one key. 0.5.6 default 0.2.
    pub eviction_ratio: f64,
}

impl EvictionConfig {
    /// `policy` with 0.5.6's default watermark (0.8) and ratio (0.2).
    pub fn new(policy: PolicyKind) -> Self {
        EvictionConfig {
            policy,
            trigger_watermark: 0.8,
            eviction_ratio: 0.2,
        }
    }
}

/// How many of `tracked` keys a tick evicts at `ratio`: `floor(tracked *
/// ratio)`, at least 1 when the ratio is positive and anything is tracked
/// (0.5.6's `target_count`). The ratio is clamped to [0, 1].
pub fn eviction_target(tracked: usize, ratio: f64) -> usize {
    let ratio = if ratio.is_nan() {
        0.0
    } else {
        ratio.clamp(0.0, 1.0)
    };
    if tracked == 0 || ratio == 0.0 {
        return 0;
    }
    ((tracked as f64 * ratio) as usize).clamp(1, tracked)
}

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct Node {
    key: ObjectKey,
    /// Towards the least recently used end.
    prev: u32,
    /// Towards the most recently used end.
    next: u32,
}

/// Recency list with O(1) insert, move-to-MRU and remove: nodes live in a
/// vector linked by index, and a map finds a key's node.
#[derive(Debug, Default)]
pub struct LruList {
    nodes: Vec<Node>,
    index: KeyMap<ObjectKey, u32>,
    /// Least recently used node, evicted first.
    head: u32,
    /// Most recently used node.
    tail: u32,
}

impl LruList {
    pub fn new() -> Self {
        LruList {
            nodes: Vec::new(),
            index: KeyMap::default(),
            head: NIL,
            tail: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.index.contains_key(key)
    }

    /// Makes `key` the most recently used, inserting it if new.
    pub fn insert_mru(&mut self, key: &ObjectKey) {
        match self.index.get(key) {
            Some(&i) => self.move_to_tail(i),
            None => {
                assert!(self.nodes.len() < NIL as usize, "LRU list full");
                let i = self.nodes.len() as u32;
                self.nodes.push(Node {
                    key: *key,
                    prev: NIL,
                    next: NIL,
                });
                self.index.insert(*key, i);
                self.link_tail(i);
            }
        }
    }

    /// Makes `key` the most recently used if tracked; returns whether it was.
    pub fn touch(&mut self, key: &ObjectKey) -> bool {
        match self.index.get(key) {
            Some(&i) => {
                self.move_to_tail(i);
                true
            }
            None => false,
        }
    }

    /// Stops tracking `key`; returns whether it was tracked.
    pub fn remove(&mut self, key: &ObjectKey) -> bool {
        let Some(i) = self.index.remove(key) else {
            return false;
        };
        self.unlink(i);
        // Fill the hole with the last node so the vector stays dense.
        let last = (self.nodes.len() - 1) as u32;
        if i != last {
            self.nodes.swap(i as usize, last as usize);
            let (prev, next) = (self.nodes[i as usize].prev, self.nodes[i as usize].next);
            match prev {
                NIL => self.head = i,
                p => self.nodes[p as usize].next = i,
            }
            match next {
                NIL => self.tail = i,
                n => self.nodes[n as usize].prev = i,
            }
            let moved = self.index.get_mut(&self.nodes[i as usize].key);
            *moved.expect("moved LRU node is indexed") = i;
        }
        self.nodes.pop();
        true
    }

    /// Keys from least to most recently used.
    pub fn iter(&self) -> LruIter<'_> {
        LruIter {
            list: self,
            at: self.head,
        }
    }

    fn move_to_tail(&mut self, i: u32) {
        if self.tail == i {
            return;
        }
        self.unlink(i);
        self.link_tail(i);
    }

    fn link_tail(&mut self, i: u32) {
        self.nodes[i as usize].prev = self.tail;
        self.nodes[i as usize].next = NIL;
        match self.tail {
            NIL => self.head = i,
            t => self.nodes[t as usize].next = i,
        }
        self.tail = i;
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next) = (self.nodes[i as usize].prev, self.nodes[i as usize].next);
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = NIL;
    }

    /// Checks links against the index; O(n). For tests.
    pub fn validate(&self) {
        let mut count = 0;
        let mut prev = NIL;
        let mut at = self.head;
        while at != NIL {
            let node = &self.nodes[at as usize];
            assert_eq!(node.prev, prev, "LRU back link broken");
            assert_eq!(self.index.get(&node.key), Some(&at), "LRU index broken");
            prev = at;
            at = node.next;
            count += 1;
            assert!(count <= self.nodes.len(), "LRU list has a cycle");
        }
        assert_eq!(prev, self.tail, "LRU tail broken");
        assert_eq!(count, self.nodes.len(), "LRU list lost nodes");
        assert_eq!(self.index.len(), self.nodes.len(), "LRU index size");
    }
}

/// Iterator over an [`LruList`], least recently used first.
pub struct LruIter<'a> {
    list: &'a LruList,
    at: u32,
}

impl<'a> Iterator for LruIter<'a> {
    type Item = &'a ObjectKey;
    fn next(&mut self) -> Option<&'a ObjectKey> {
        if self.at == NIL {
            return None;
        }
        let node = &self.list.nodes[self.at as usize];
        self.at = node.next;
        Some(&node.key)
    }
}

/// Which tracked keys a victim search walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every tracked key (for IsolatedLRU: salt by salt, in salt order).
    All,
    /// Only keys of one cache_salt.
    Salt(Name),
}

#[derive(Debug)]
enum Tracker {
    Noop,
    Lru(LruList),
    /// cache_salt -> its LRU list; empty lists are dropped.
    Isolated(BTreeMap<Name, LruList>),
}

/// The eviction state of one shard: recency order plus (for IsolatedLRU) the
/// shard's share of each salt's quota.
#[derive(Debug)]
pub struct EvictionPolicy {
    config: EvictionConfig,
    tracker: Tracker,
    /// cache_salt -> byte limit on this shard.
    quotas: HashMap<String, u64>,
}

impl EvictionPolicy {
    pub fn new(config: EvictionConfig) -> Self {
        let tracker = match config.policy {
            PolicyKind::Noop => Tracker::Noop,
            PolicyKind::Lru => Tracker::Lru(LruList::new()),
            PolicyKind::IsolatedLru => Tracker::Isolated(BTreeMap::new()),
        };
        EvictionPolicy {
            config,
            tracker,
            quotas: HashMap::new(),
        }
    }

    pub fn config(&self) -> &EvictionConfig {
        &self.config
    }

    pub fn kind(&self) -> PolicyKind {
        self.config.policy
    }

    /// Keys were created (reserved or written): they become the most recently
    /// used, the batch's last key least recent of them.
    pub fn on_keys_created<'a, I>(&mut self, keys: I)
    where
        I: IntoIterator<Item = &'a ObjectKey>,
        I::IntoIter: DoubleEndedIterator,
    {
        match &mut self.tracker {
            Tracker::Noop => {}
            Tracker::Lru(list) => keys.into_iter().rev().for_each(|k| list.insert_mru(k)),
            Tracker::Isolated(lists) => {
                for k in keys.into_iter().rev() {
                    match lists.get_mut(&k.cache_salt) {
                        Some(list) => list.insert_mru(k),
                        None => {
                            let mut list = LruList::new();
                            list.insert_mru(k);
                            lists.insert(k.cache_salt, list);
                        }
                    }
                }
            }
        }
    }

    /// Keys were used: tracked ones move to most recently used, in reverse
    /// batch order as on creation. Untracked keys are ignored.
    pub fn on_keys_touched<'a, I>(&mut self, keys: I)
    where
        I: IntoIterator<Item = &'a ObjectKey>,
        I::IntoIter: DoubleEndedIterator,
    {
        match &mut self.tracker {
            Tracker::Noop => {}
            Tracker::Lru(list) => keys.into_iter().rev().for_each(|k| {
                list.touch(k);
            }),
            Tracker::Isolated(lists) => {
                for k in keys.into_iter().rev() {
                    if let Some(list) = lists.get_mut(&k.cache_salt) {
                        list.touch(k);
                    }
                }
            }
        }
    }

    /// The key is gone from the shard.
    pub fn on_key_removed(&mut self, key: &ObjectKey) {
        match &mut self.tracker {
            Tracker::Noop => {}
            Tracker::Lru(list) => {
                list.remove(key);
            }
            Tracker::Isolated(lists) => {
                if let Some(list) = lists.get_mut(&key.cache_salt) {
                    list.remove(key);
                    if list.is_empty() {
                        lists.remove(&key.cache_salt);
                    }
                }
            }
        }
    }

    /// Whether the policy tracks `key`.
    pub fn is_tracked(&self, key: &ObjectKey) -> bool {
        match &self.tracker {
            Tracker::Noop => false,
            Tracker::Lru(list) => list.contains(key),
            Tracker::Isolated(lists) => lists.get(&key.cache_salt).is_some_and(|l| l.contains(key)),
        }
    }

    /// Number of tracked keys in `scope`.
    pub fn tracked_len(&self, scope: Scope) -> usize {
        match (&self.tracker, scope) {
            (Tracker::Noop, _) => 0,
            (Tracker::Lru(list), Scope::All) => list.len(),
            (Tracker::Lru(list), Scope::Salt(s)) => {
                list.iter().filter(|k| k.cache_salt == s).count()
            }
            (Tracker::Isolated(lists), Scope::All) => lists.values().map(LruList::len).sum(),
            (Tracker::Isolated(lists), Scope::Salt(s)) => lists.get(&s).map_or(0, LruList::len),
        }
    }

    /// Tracked keys in eviction order (least recently used first) within
    /// `scope`.
    pub fn eviction_order<'a>(
        &'a self,
        scope: Scope,
    ) -> Box<dyn Iterator<Item = &'a ObjectKey> + 'a> {
        match (&self.tracker, scope) {
            (Tracker::Noop, _) => Box::new(std::iter::empty()),
            (Tracker::Lru(list), Scope::All) => Box::new(list.iter()),
            (Tracker::Lru(list), Scope::Salt(s)) => {
                Box::new(list.iter().filter(move |k| k.cache_salt == s))
            }
            (Tracker::Isolated(lists), Scope::All) => {
                Box::new(lists.values().flat_map(LruList::iter))
            }
            (Tracker::Isolated(lists), Scope::Salt(s)) => match lists.get(&s) {
                Some(list) => Box::new(list.iter()),
                None => Box::new(std::iter::empty()),
            },
        }
    }

    /// Picks victims in eviction order within `scope`, skipping keys for which
    /// `evictable_bytes` returns `None` (locked), until at least `min_count`
    /// keys and `min_bytes` bytes are picked or no candidate is left.
    pub fn victims<F>(
        &self,
        scope: Scope,
        min_count: usize,
        min_bytes: u64,
        mut evictable_bytes: F,
    ) -> Vec<ObjectKey>
    where
        F: FnMut(&ObjectKey) -> Option<u64>,
    {
        let mut out = Vec::new();
        if min_count == 0 && min_bytes == 0 {
            return out;
        }
        let mut bytes = 0u64;
        for key in self.eviction_order(scope) {
            if let Some(b) = evictable_bytes(key) {
                out.push(*key);
                bytes = bytes.saturating_add(b);
                if out.len() >= min_count && bytes >= min_bytes {
                    break;
                }
            }
        }
        out
    }

    /// Sets `salt`'s byte limit on this shard (the caller passes the shard's
    /// share of the cluster-wide quota). A limit of 0 means no data allowed.
    pub fn set_quota(&mut self, salt: &str, limit_bytes: u64) {
        self.quotas.insert(salt.to_owned(), limit_bytes);
    }

    /// Removes `salt`'s quota; returns whether it had one. Its data is then
    /// evicted on the next IsolatedLRU tick (allowlist).
    pub fn remove_quota(&mut self, salt: &str) -> bool {
        self.quotas.remove(salt).is_some()
    }

    /// `salt`'s limit, `None` if it has no quota.
    pub fn quota(&self, salt: &str) -> Option<u64> {
        self.quotas.get(salt).copied()
    }

    /// Every registered (salt, limit_bytes).
    pub fn quotas(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.quotas.iter().map(|(s, &l)| (s.as_str(), l))
    }

    /// Checks the recency lists; O(n). For tests.
    pub fn validate(&self) {
        match &self.tracker {
            Tracker::Noop => {}
            Tracker::Lru(list) => list.validate(),
            Tracker::Isolated(lists) => {
                for (salt, list) in lists {
                    assert!(!list.is_empty(), "empty LRU bucket kept for salt {salt:?}");
                    list.validate();
                    assert!(
                        list.iter().all(|k| k.cache_salt == *salt),
                        "key in the wrong salt bucket"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Name {
        Name::intern(s).unwrap()
    }

    fn key(i: u8, salt: &str) -> ObjectKey {
        ObjectKey {
            chunk_hash: [i; 32],
            model_name: name("m"),
            kv_rank: 0,
            object_group_id: 0,
            cache_salt: name(salt),
        }
    }

    fn order(p: &EvictionPolicy, scope: Scope) -> Vec<u8> {
        p.eviction_order(scope).map(|k| k.chunk_hash[0]).collect()
    }

    #[test]
    fn target_count_matches_lmcache() {
        assert_eq!(eviction_target(0, 0.2), 0);
        assert_eq!(eviction_target(3, 0.2), 1);
        assert_eq!(eviction_target(10, 0.2), 2);
        assert_eq!(eviction_target(10, 0.0), 0);
        assert_eq!(eviction_target(10, 1.5), 10);
        assert_eq!(eviction_target(10, f64::NAN), 0);
    }

    #[test]
    fn batches_insert_in_reverse_so_tails_go_first() {
        let mut p = EvictionPolicy::new(EvictionConfig::new(PolicyKind::Lru));
        let req1 = [key(1, ""), key(2, ""), key(3, "")];
        let req2 = [key(4, ""), key(5, "")];
        p.on_keys_created(&req1);
        p.on_keys_created(&req2);
        assert_eq!(order(&p, Scope::All), [3, 2, 1, 5, 4]);
        // Touching req1 makes it most recent, its prefix last to go.
        p.on_keys_touched(&req1);
        assert_eq!(order(&p, Scope::All), [5, 4, 3, 2, 1]);
        // Re-creating a tracked key moves it, does not duplicate it.
        p.on_keys_created(&[key(5, "")]);
        assert_eq!(order(&p, Scope::All), [4, 3, 2, 1, 5]);
        // Touching an untracked key does nothing.
        p.on_keys_touched(&[key(9, "")]);
        assert_eq!(p.tracked_len(Scope::All), 5);
        p.validate();
    }

    #[test]
    fn remove_keeps_links_intact() {
        let mut p = EvictionPolicy::new(EvictionConfig::new(PolicyKind::Lru));
        let keys: Vec<_> = (0..6).map(|i| key(i, "")).collect();
        for k in &keys {
            p.on_keys_created(std::slice::from_ref(k));
        }
        for i in [0u8, 5, 2] {
            p.on_key_removed(&key(i, ""));
            p.validate();
        }
        assert_eq!(order(&p, Scope::All), [1, 3, 4]);
        p.on_key_removed(&key(2, "")); // already gone
        assert!(!p.is_tracked(&key(2, "")));
        assert!(p.is_tracked(&key(3, "")));
        p.on_keys_created(&[key(7, "")]);
        assert_eq!(order(&p, Scope::All), [1, 3, 4, 7]);
        p.validate();
    }

    #[test]
    fn victims_skip_ineligible_and_stop_at_targets() {
        let mut p = EvictionPolicy::new(EvictionConfig::new(PolicyKind::Lru));
        let keys: Vec<_> = (0..5).map(|i| key(i, "")).collect();
        for k in &keys {
            p.on_keys_created(std::slice::from_ref(k));
        }
        let locked = |k: &ObjectKey| if k.chunk_hash[0] == 1 { None } else { Some(10) };
        let v: Vec<u8> = p
            .victims(Scope::All, 2, 0, locked)
            .iter()
            .map(|k| k.chunk_hash[0])
            .collect();
        assert_eq!(v, [0, 2]);
        let v = p.victims(Scope::All, 1, 25, locked);
        assert_eq!(v.len(), 3, "needs three 10-byte keys to reach 25 bytes");
        assert!(p.victims(Scope::All, 0, 0, locked).is_empty());
        assert_eq!(p.victims(Scope::All, 99, 0, locked).len(), 4);
    }

    #[test]
    fn noop_tracks_nothing() {
        let mut p = EvictionPolicy::new(EvictionConfig::new(PolicyKind::Noop));
        p.on_keys_created(&[key(1, "")]);
        assert_eq!(p.tracked_len(Scope::All), 0);
        assert!(p.victims(Scope::All, 1, 0, |_| Some(1)).is_empty());
    }

    #[test]
    fn isolated_lists_per_salt() {
        let mut p = EvictionPolicy::new(EvictionConfig::new(PolicyKind::IsolatedLru));
        p.on_keys_created(&[key(1, "a"), key(2, "b"), key(3, "a")]);
        assert_eq!(order(&p, Scope::Salt(name("a"))), [3, 1]);
        assert_eq!(order(&p, Scope::Salt(name("b"))), [2]);
        assert_eq!(p.tracked_len(Scope::All), 3);
        p.on_keys_touched(&[key(3, "a")]);
        assert_eq!(order(&p, Scope::Salt(name("a"))), [1, 3]);
        p.on_key_removed(&key(2, "b"));
        assert_eq!(p.tracked_len(Scope::Salt(name("b"))), 0);
        p.validate();
        p.set_quota("a", 100);
        assert_eq!(p.quota("a"), Some(100));
        assert_eq!(p.quota("b"), None);
        assert_eq!(p.quotas().collect::<Vec<_>>(), [("a", 100)]);
        assert!(p.remove_quota("a"));
        assert!(!p.remove_quota("a"));
    }

    #[test]
    fn lru_list_random_ops_against_vec() {
        let mut list = LruList::new();
        let mut model: Vec<u8> = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = (x % 16) as u8;
            match (x >> 8) % 3 {
                0 => {
                    list.insert_mru(&key(k, ""));
                    model.retain(|&m| m != k);
                    model.push(k);
                }
                1 => {
                    let was = list.touch(&key(k, ""));
                    assert_eq!(was, model.contains(&k));
                    if was {
                        model.retain(|&m| m != k);
                        model.push(k);
                    }
                }
                _ => {
                    assert_eq!(list.remove(&key(k, "")), model.contains(&k));
                    model.retain(|&m| m != k);
                }
            }
            let got: Vec<u8> = list.iter().map(|k| k.chunk_hash[0]).collect();
            assert_eq!(got, model);
        }
        list.validate();
    }
}
