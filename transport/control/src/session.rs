//! Sessions: per request_id state kept by the front end between RPCs.
//!
//! A session caches the request's tokens and rolling chunk hashes, so lookup,
//! store and retrieve of one request hash each chunk once, and remembers what its
//! lookup found (the hit prefix and the key it looked up) so `free_lookup_locks` and
//! `end_session` can act on exactly those objects.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvshard_engine::keys::{ChunkHash, ChunkHashes, HashError, TokenHasher};

/// What the last lookup of a session covered, for lock release and LRU touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupScope {
    pub model_name: String,
    pub world_size: u32,
    /// `None` for a scheduler lookup (all kv ranks).
    pub worker_id: Option<u32>,
    pub cache_salt: String,
    pub num_kv_readers: u32,
}

#[derive(Debug)]
pub struct Session {
    tokens: Vec<u32>,
    hashes: ChunkHashes,
    /// [`token_digest`] of `tokens`, once something asked for it.
    digest: Option<TokenDigest>,
    last_used: Instant,
    /// Position in `Sessions::order`: set on every use, increasing.
    use_seq: u64,
    pub lookup: Option<LookupScope>,
    /// Hit prefix (chunks) of the last finished lookup; -1 while none is known.
    pub prefetch_hit_chunks: i64,
}

impl Session {
    fn new(now: Instant, hasher: TokenHasher) -> Self {
        Session {
            tokens: Vec::new(),
            hashes: ChunkHashes::new(hasher),
            digest: None,
            last_used: now,
            use_seq: 0,
            lookup: None,
            prefetch_hit_chunks: -1,
        }
    }

    /// Replaces the tokens; hashes are kept when the new tokens extend the old ones
    /// (vLLM appends decode tokens to the same request).
    pub fn set_tokens(&mut self, tokens: &[u32]) {
        let common = self.tokens.len().min(tokens.len());
        if self.tokens[..common] != tokens[..common] {
            self.hashes.reset();
        } else if tokens.len() < self.tokens.len() {
            // Shorter sequence with the same prefix: hashes of whole chunks still hold,
            // but chunks past the new end must not be served from the cache.
            self.hashes.reset();
        }
        if self.tokens.as_slice() != tokens {
            self.tokens.clear();
            self.tokens.extend_from_slice(tokens);
            self.digest = None;
        }
    }

    /// [`token_digest`] of the session's tokens, computed once for them: a
    /// request's prepare and commit name the same tokens.
    pub fn token_digest(&mut self) -> TokenDigest {
        *self
            .digest
            .get_or_insert_with(|| token_digest(&self.tokens))
    }

    /// When the session was last created or used through `get_or_create`.
    pub fn last_used(&self) -> Instant {
        self.last_used
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Hashes of the chunks of `[start, end)` (token offsets, chunk-aligned).
    pub fn hashes(
        &mut self,
        chunk_size: usize,
        start: usize,
        end: usize,
    ) -> Result<&[ChunkHash], HashError> {
        self.hashes.range(&self.tokens, chunk_size, start, end)
    }

    /// Every chunk hash computed so far, in order.
    pub fn all_hashes(&self) -> &[ChunkHash] {
        self.hashes.all()
    }
}

/// A blake3 digest of a request's token ids.
pub type TokenDigest = [u8; 32];

/// blake3 over the token ids as little-endian u32s. They go in from offset 0
/// in blocks of whole 1 KiB chunks, so blake3 hashes the chunks of a block side
/// by side instead of one after another.
pub fn token_digest(tokens: &[u32]) -> TokenDigest {
    let mut h = blake3::Hasher::new();
    let mut buf = [0u8; 16 << 10];
    for block in tokens.chunks(buf.len() / 4) {
        for (b, t) in buf.chunks_exact_mut(4).zip(block) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..block.len() * 4]);
    }
    *h.finalize().as_bytes()
}

/// Token ids all sessions may hold together (256 MiB of u32s): a few huge
/// requests under different ids cannot grow the server without bound.
pub const MAX_SESSION_TOKENS: usize = 1 << 26;

/// All sessions, bounded in count and in tokens held, expired after a TTL of
/// inactivity.
///
/// `order` holds every session keyed by `(last_used, use_seq)`: its first entry
/// is the least recently used session (among sessions used at the same instant,
/// the one used first), so eviction and expiry never walk the table.
pub struct Sessions {
    map: HashMap<String, Session>,
    order: BTreeMap<(Instant, u64), String>,
    next_use_seq: u64,
    ttl: Duration,
    max: usize,
    /// How every session hashes its tokens (`--hash-algorithm`).
    hasher: TokenHasher,
    max_tokens: usize,
    total_tokens: usize,
    /// Sessions dropped because the table was full (oldest first).
    pub evicted_full: u64,
    pub expired: u64,
}

impl Sessions {
    pub fn new(ttl: Duration, max: usize, hasher: TokenHasher) -> Self {
        assert!(max > 0);
        Sessions {
            map: HashMap::new(),
            order: BTreeMap::new(),
            next_use_seq: 0,
            ttl,
            max,
            hasher,
            max_tokens: MAX_SESSION_TOKENS,
            total_tokens: 0,
            evicted_full: 0,
            expired: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.map.contains_key(id)
    }

    /// The session of `id`; does not count as a use.
    pub fn get_mut(&mut self, id: &str) -> Option<&mut Session> {
        self.map.get_mut(id)
    }

    /// The session of `id`, created if needed; refreshes its last use.
    pub fn get_or_create(&mut self, id: &str, now: Instant) -> &mut Session {
        let use_seq = self.next_use_seq;
        self.next_use_seq += 1;
        match self.map.get_mut(id) {
            Some(s) => {
                let name = self
                    .order
                    .remove(&(s.last_used, s.use_seq))
                    .expect("every session is in the order");
                s.last_used = now;
                s.use_seq = use_seq;
                self.order.insert((now, use_seq), name);
            }
            None => {
                if self.map.len() >= self.max {
                    self.expire(now);
                }
                // Full of live sessions: drop the least recently used one. Its request
                // loses cached hashes and lock bookkeeping; its locks still expire by TTL.
                if self.map.len() >= self.max && self.drop_oldest_except(id) {
                    log::warn!(
                        "session table full ({} sessions): dropped the oldest",
                        self.max
                    );
                }
                let mut s = Session::new(now, self.hasher);
                s.use_seq = use_seq;
                self.order.insert((now, use_seq), id.to_owned());
                self.map.insert(id.to_owned(), s);
            }
        }
        self.map.get_mut(id).expect("session just ensured")
    }

    pub fn remove(&mut self, id: &str) -> Option<Session> {
        let s = self.map.remove(id)?;
        self.order.remove(&(s.last_used, s.use_seq));
        self.total_tokens -= s.tokens.len();
        Some(s)
    }

    /// The session of `id` holding `tokens`, dropping least recently used other
    /// sessions while the token budget would be exceeded.
    pub fn with_tokens(&mut self, id: &str, tokens: &[u32], now: Instant) -> &mut Session {
        let old = self.map.get(id).map_or(0, |s| s.tokens.len());
        while self.total_tokens - old + tokens.len() > self.max_tokens
            && self.drop_oldest_except(id)
        {}
        let s = self.get_or_create(id, now);
        let before = s.tokens.len();
        s.set_tokens(tokens);
        let after = s.tokens.len();
        self.total_tokens = self.total_tokens - before + after;
        self.map.get_mut(id).expect("session just set")
    }

    /// Drops the least recently used session other than `keep`; false if none.
    fn drop_oldest_except(&mut self, keep: &str) -> bool {
        // `keep` is at most one entry: the victim is among the first two.
        let oldest = self.order.values().find(|k| k.as_str() != keep).cloned();
        match oldest {
            Some(k) => {
                self.remove(&k);
                self.evicted_full += 1;
                true
            }
            None => false,
        }
    }

    /// Token ids held by all sessions.
    pub fn total_tokens(&self) -> usize {
        self.total_tokens
    }

    /// Drops sessions idle for longer than the TTL; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut n = 0;
        while let Some(entry) = self.order.first_entry() {
            let (last_used, _) = *entry.key();
            if now.duration_since(last_used) <= self.ttl {
                break;
            }
            let id = entry.remove();
            let s = self
                .map
                .remove(&id)
                .expect("every ordered id has a session");
            self.total_tokens -= s.tokens.len();
            n += 1;
        }
        self.expired += n as u64;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard_engine::keys::chunk_hashes;

    #[test]
    fn token_digest_follows_token_changes() {
        // Past one 16 KiB block, so the blocks join as one byte string.
        let toks: Vec<u32> = (0..5000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let le: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(token_digest(&toks), *blake3::hash(&le).as_bytes());
        let now = Instant::now();
        let mut s = Sessions::new(Duration::from_secs(10), 4, TokenHasher::Blake3);
        let sess = s.get_or_create("a", now);
        sess.set_tokens(&toks[..100]);
        assert_eq!(sess.token_digest(), token_digest(&toks[..100]));
        // Extended, shortened or changed tokens get their own digest.
        sess.set_tokens(&toks[..200]);
        assert_eq!(sess.token_digest(), token_digest(&toks[..200]));
        sess.set_tokens(&toks[..150]);
        assert_eq!(sess.token_digest(), token_digest(&toks[..150]));
        sess.set_tokens(&toks[1..151]);
        assert_eq!(sess.token_digest(), token_digest(&toks[1..151]));
    }

    #[test]
    fn hashes_follow_token_changes() {
        let now = Instant::now();
        let mut s = Sessions::new(Duration::from_secs(10), 4, TokenHasher::Blake3);
        let toks: Vec<u32> = (0..16).collect();
        let sess = s.get_or_create("a", now);
        sess.set_tokens(&toks[..8]);
        let h8 = sess.hashes(4, 0, 8).unwrap().to_vec();
        assert_eq!(h8, chunk_hashes(&toks, 4, 0, 8).unwrap());
        // Extension keeps the cache and hashes the new chunks.
        sess.set_tokens(&toks);
        assert_eq!(
            sess.hashes(4, 8, 16).unwrap(),
            &chunk_hashes(&toks, 4, 8, 16).unwrap()[..]
        );
        // A different sequence under the same id is rehashed.
        let other: Vec<u32> = (100..116).collect();
        sess.set_tokens(&other);
        assert_eq!(
            sess.hashes(4, 0, 16).unwrap(),
            &chunk_hashes(&other, 4, 0, 16).unwrap()[..]
        );
        assert!(sess.hashes(4, 0, 20).is_err());
    }

    #[test]
    fn token_budget_drops_oldest_sessions() {
        let t0 = Instant::now();
        let mut s = Sessions::new(Duration::from_secs(10), 100, TokenHasher::Blake3);
        s.max_tokens = 10;
        s.with_tokens("a", &[1, 2, 3, 4], t0);
        s.with_tokens("b", &[1, 2, 3, 4], t0 + Duration::from_secs(1));
        assert_eq!(s.total_tokens(), 8);
        // Growing "b" past the budget drops "a", never "b" itself.
        s.with_tokens("b", &[1, 2, 3, 4, 5, 6, 7, 8], t0 + Duration::from_secs(2));
        assert!(s.get_mut("a").is_none());
        assert_eq!(s.total_tokens(), 8);
        s.remove("b");
        assert_eq!(s.total_tokens(), 0);
        s.with_tokens("c", &[1; 5], t0);
        s.expire(t0 + Duration::from_secs(30));
        assert_eq!(s.total_tokens(), 0);
    }

    #[test]
    fn bounded_and_expiring() {
        let t0 = Instant::now();
        let mut s = Sessions::new(Duration::from_secs(10), 2, TokenHasher::Blake3);
        s.get_or_create("a", t0);
        s.get_or_create("b", t0 + Duration::from_secs(1));
        s.get_or_create("c", t0 + Duration::from_secs(2));
        assert_eq!(s.len(), 2);
        assert!(s.get_mut("a").is_none(), "oldest dropped when full");
        assert_eq!(s.evicted_full, 1);
        assert_eq!(s.expire(t0 + Duration::from_secs(12)), 1);
        assert!(s.get_mut("c").is_some());
    }

    /// The table as the full scans saw it: a list of (id, last use, tokens).
    /// Eviction takes a session of least `last_used` (the scan's rule); among
    /// ties, the one used first. Expiry drops every session idle past the TTL.
    struct Model {
        ttl: Duration,
        max: usize,
        max_tokens: usize,
        /// (id, last_used, use order, tokens)
        rows: Vec<(String, Instant, u64, usize)>,
        seq: u64,
        evicted_full: u64,
        expired: u64,
    }

    impl Model {
        fn total(&self) -> usize {
            self.rows.iter().map(|r| r.3).sum()
        }

        fn pos(&self, id: &str) -> Option<usize> {
            self.rows.iter().position(|r| r.0 == id)
        }

        fn expire(&mut self, now: Instant) -> usize {
            let before = self.rows.len();
            let ttl = self.ttl;
            self.rows.retain(|r| now.duration_since(r.1) <= ttl);
            let n = before - self.rows.len();
            self.expired += n as u64;
            n
        }

        fn drop_oldest_except(&mut self, keep: &str) -> bool {
            let min = self.rows.iter().filter(|r| r.0 != keep).map(|r| r.1).min();
            let Some(min) = min else { return false };
            let victim = self
                .rows
                .iter()
                .enumerate()
                .filter(|(_, r)| r.0 != keep && r.1 == min)
                .min_by_key(|(_, r)| r.2)
                .map(|(i, _)| i)
                .unwrap();
            self.rows.remove(victim);
            self.evicted_full += 1;
            true
        }

        fn get_or_create(&mut self, id: &str, now: Instant) {
            self.seq += 1;
            if self.pos(id).is_none() {
                if self.rows.len() >= self.max {
                    self.expire(now);
                }
                if self.rows.len() >= self.max {
                    self.drop_oldest_except(id);
                }
                self.rows.push((id.to_owned(), now, 0, 0));
            }
            let i = self.pos(id).unwrap();
            self.rows[i].1 = now;
            self.rows[i].2 = self.seq;
        }

        fn with_tokens(&mut self, id: &str, n: usize, now: Instant) {
            let old = self.pos(id).map_or(0, |i| self.rows[i].3);
            while self.total() - old + n > self.max_tokens && self.drop_oldest_except(id) {}
            self.get_or_create(id, now);
            let i = self.pos(id).unwrap();
            self.rows[i].3 = n;
        }

        fn remove(&mut self, id: &str) -> bool {
            match self.pos(id) {
                Some(i) => {
                    self.rows.remove(i);
                    true
                }
                None => false,
            }
        }
    }

    fn check(s: &Sessions, m: &Model) {
        assert_eq!(s.len(), m.rows.len());
        assert_eq!(s.order.len(), s.map.len());
        assert_eq!(s.total_tokens(), m.total());
        assert_eq!(s.evicted_full, m.evicted_full);
        assert_eq!(s.expired, m.expired);
        for (id, last, _, toks) in &m.rows {
            let sess = s.map.get(id).unwrap_or_else(|| panic!("{id} missing"));
            assert_eq!(sess.last_used(), *last, "{id}");
            assert_eq!(sess.tokens().len(), *toks, "{id}");
        }
    }

    #[test]
    fn eviction_takes_least_recently_used_ties_by_first_use() {
        let t0 = Instant::now();
        let mut s = Sessions::new(Duration::from_secs(100), 3, TokenHasher::Blake3);
        // Three sessions at one instant, then "a" used again at that instant.
        s.get_or_create("a", t0);
        s.get_or_create("b", t0);
        s.get_or_create("c", t0);
        s.get_or_create("a", t0);
        s.get_or_create("d", t0);
        assert!(!s.contains("b"), "b was used first among the ties");
        s.get_or_create("e", t0);
        assert!(!s.contains("c"));
        assert!(s.contains("a") && s.contains("d") && s.contains("e"));
        // An older instant wins over use order.
        s.get_or_create("d", t0 - Duration::from_secs(1));
        s.get_or_create("f", t0);
        assert!(!s.contains("d"));
        assert_eq!(s.evicted_full, 3);
    }

    #[test]
    fn expiry_drops_exactly_the_idle_sessions() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let mut s = Sessions::new(ttl, 100, TokenHasher::Blake3);
        for i in 0..20u64 {
            s.with_tokens(&format!("s{i}"), &[1, 2], t0 + Duration::from_secs(i));
        }
        // Idle exactly the TTL is kept; one nanosecond more is not.
        let now = t0 + Duration::from_secs(5) + ttl;
        assert_eq!(s.expire(now), 5);
        assert!(s.contains("s5") && !s.contains("s4"));
        assert_eq!(s.total_tokens(), 30);
        assert_eq!(s.expire(now + Duration::from_nanos(1)), 1);
        assert!(!s.contains("s5"));
        assert_eq!(s.expired, 6);
    }

    #[test]
    fn matches_the_scanning_model_under_random_use() {
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for round in 0..20 {
            let t0 = Instant::now();
            let max = 1 + next(12) as usize;
            let ttl = Duration::from_millis(50 + next(200));
            let max_tokens = 8 + next(40) as usize;
            let mut s = Sessions::new(ttl, max, TokenHasher::Blake3);
            s.max_tokens = max_tokens;
            let mut m = Model {
                ttl,
                max,
                max_tokens,
                rows: Vec::new(),
                seq: 0,
                evicted_full: 0,
                expired: 0,
            };
            let ids = 4 + next(30);
            let mut now = t0;
            for step in 0..3000 {
                // Many uses share an instant (ties); time never goes far back.
                match next(10) {
                    0..=3 => {}
                    4..=8 => now += Duration::from_millis(next(30)),
                    _ => {
                        now = now
                            .checked_sub(Duration::from_millis(next(5)))
                            .unwrap_or(now)
                    }
                }
                let id = format!("r{}", next(ids));
                match next(10) {
                    0..=3 => {
                        s.get_or_create(&id, now);
                        m.get_or_create(&id, now);
                    }
                    4..=6 => {
                        let n = next(12) as usize;
                        let toks: Vec<u32> = (0..n as u32).collect();
                        s.with_tokens(&id, &toks, now);
                        m.with_tokens(&id, n, now);
                    }
                    7 => assert_eq!(s.remove(&id).is_some(), m.remove(&id)),
                    8 => assert_eq!(s.expire(now), m.expire(now)),
                    _ => {
                        // A plain lookup of the session is no use.
                        assert_eq!(s.get_mut(&id).is_some(), m.pos(&id).is_some());
                    }
                }
                check(&s, &m);
                assert!(s.len() <= max, "round {round} step {step}");
            }
        }
    }
}
