//! Sessions: per request_id state kept by the front end between RPCs.
//!
//! A session caches the request's tokens and rolling chunk hashes, so lookup,
//! store and retrieve of one request hash each chunk once, and remembers what its
//! lookup found (the hit prefix and the key it looked up) so `free_lookup_locks` and
//! `end_session` can act on exactly those objects.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvshard_engine::keys::{ChunkHash, ChunkHashes, HashError};

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
    pub last_used: Instant,
    pub lookup: Option<LookupScope>,
    /// Hit prefix (chunks) of the last finished lookup; -1 while none is known.
    pub prefetch_hit_chunks: i64,
}

impl Session {
    fn new(now: Instant) -> Self {
        Session {
            tokens: Vec::new(),
            hashes: ChunkHashes::new(),
            last_used: now,
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
        }
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

/// Token ids all sessions may hold together (256 MiB of u32s): a few huge
/// requests under different ids cannot grow the server without bound.
pub const MAX_SESSION_TOKENS: usize = 1 << 26;

/// All sessions, bounded in count and in tokens held, expired after a TTL of
/// inactivity.
pub struct Sessions {
    map: HashMap<String, Session>,
    ttl: Duration,
    max: usize,
    max_tokens: usize,
    total_tokens: usize,
    /// Sessions dropped because the table was full (oldest first).
    pub evicted_full: u64,
    pub expired: u64,
}

impl Sessions {
    pub fn new(ttl: Duration, max: usize) -> Self {
        assert!(max > 0);
        Sessions {
            map: HashMap::new(),
            ttl,
            max,
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

    pub fn get_mut(&mut self, id: &str) -> Option<&mut Session> {
        self.map.get_mut(id)
    }

    /// The session of `id`, created if needed; refreshes its last use.
    pub fn get_or_create(&mut self, id: &str, now: Instant) -> &mut Session {
        if !self.map.contains_key(id) {
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
            self.map.insert(id.to_owned(), Session::new(now));
        }
        let s = self.map.get_mut(id).expect("session just ensured");
        s.last_used = now;
        s
    }

    pub fn remove(&mut self, id: &str) -> Option<Session> {
        let s = self.map.remove(id)?;
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
        let oldest = self
            .map
            .iter()
            .filter(|(k, _)| k.as_str() != keep)
            .min_by_key(|(_, s)| s.last_used)
            .map(|(k, _)| k.clone());
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
        let ttl = self.ttl;
        let before = self.map.len();
        let mut freed = 0;
        self.map.retain(|_, s| {
            let keep = now.duration_since(s.last_used) <= ttl;
            if !keep {
                freed += s.tokens.len();
            }
            keep
        });
        self.total_tokens -= freed;
        let n = before - self.map.len();
        self.expired += n as u64;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard_engine::keys::chunk_hashes;

    #[test]
    fn hashes_follow_token_changes() {
        let now = Instant::now();
        let mut s = Sessions::new(Duration::from_secs(10), 4);
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
        let mut s = Sessions::new(Duration::from_secs(10), 100);
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
        let mut s = Sessions::new(Duration::from_secs(10), 2);
        s.get_or_create("a", t0);
        s.get_or_create("b", t0 + Duration::from_secs(1));
        s.get_or_create("c", t0 + Duration::from_secs(2));
        assert_eq!(s.len(), 2);
        assert!(s.get_mut("a").is_none(), "oldest dropped when full");
        assert_eq!(s.evicted_full, 1);
        assert_eq!(s.expire(t0 + Duration::from_secs(12)), 1);
        assert!(s.get_mut("c").is_some());
    }
}
