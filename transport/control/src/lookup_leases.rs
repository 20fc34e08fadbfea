//! Which read locks each lookup still holds, so that locks nobody can release any
//! more are released when their workers go away.
//!
//! A lookup read-locks the prefix it found, `readers` locks per object, on behalf
//! of the workers that will retrieve it: each worker that retrieves an object (or
//! the scheduler's `free_lookup_locks`) releases its share. A worker that dies
//! between the lookup and its retrieve never does, and its locks would pin the
//! objects until the read-lock TTL (300 s by default).
//!
//! The book keeps, per request id, what the latest lookup holds: the prefix's
//! chunk hashes and kv ranks and the count of locks still held per object, which
//! every release sent on the request's behalf decrements. The lookup does not say
//! which worker will read it (the scheduler asks, the workers read), so when an
//! instance is reaped or unregistered the front counts, per object, the live
//! instances that may still read it (same model and world size, that kv rank or a
//! rank not known yet, not already done with this lookup). Locks beyond that
//! count can be released by nobody: those are released. The count errs on the
//! side of keeping a lock: an instance that may read the object keeps it held.
//!
//! The book only ever releases locks it saw granted and not released. An entry
//! is dropped before its locks' TTL can have passed (the TTL counts from when the
//! lookup was sent, which is before the shard locked), so a lock the shard has
//! already expired and perhaps re-granted to someone else is never released.
//!
//! A lease also remembers where each L1 hit lies (its slab's offset, as the
//! shard reported when it locked it). While the lease holds a lock on every
//! object a worker asks for, those objects cannot move or go, so the front
//! answers that worker's `prepare_retrieve` from the lease without asking the
//! shards ([`LeaseBook::readable`]).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvshard_dataplane::messages::NO_SLAB;
use kvshard_engine::keys::{ChunkHash, Name, ObjectKey};
use kvshard_engine::l1::MAX_READ_LOCK_COUNT;
use kvshard_wire::InstanceId;

/// Locks one call takes or releases per key, as the shard clamps it.
pub(crate) fn clamped(count: u32) -> u32 {
    count.clamp(1, MAX_READ_LOCK_COUNT)
}

/// What one request's lookup holds.
#[derive(Debug, Clone)]
struct Lease {
    model: Name,
    salt: Name,
    world_size: u32,
    /// kv ranks of one chunk and object group, in key order.
    ranks: Vec<u32>,
    /// Object groups of one chunk: a chunk's keys are each group's ranks.
    groups: u32,
    /// The held prefix's chunk hashes, from chunk 0.
    hashes: Vec<ChunkHash>,
    /// Locks still held, per object (chunk-major, then object group, then
    /// rank).
    held: Vec<u32>,
    /// Per object: the offset of its slab, or `NO_SLAB` if no shard said.
    slabs: Vec<u64>,
    /// Instances that released locks of this lease (they are done with it).
    consumers: Vec<InstanceId>,
    /// When the shard's locks may start expiring: forget the lease then.
    expires: Instant,
    /// Its key in `LeaseBook::by_expiry`, with `expires`.
    order: u64,
}

impl Lease {
    /// Keys of one chunk.
    fn row_count(&self) -> usize {
        self.ranks.len() * self.groups as usize
    }

    /// The object group and kv rank of a chunk's `row`th key.
    fn row(&self, row: usize) -> (u32, u32) {
        let nr = self.ranks.len();
        ((row / nr) as u32, self.ranks[row % nr])
    }

    fn key(&self, chunk: usize, row: usize) -> ObjectKey {
        let (og, rank) = self.row(row);
        ObjectKey {
            chunk_hash: self.hashes[chunk],
            model_name: self.model,
            kv_rank: rank,
            object_group_id: og,
            cache_salt: self.salt,
        }
    }

    /// Index of `key` (chunk `chunk` of the request) in `held`, if this lease
    /// covers it.
    fn position(&self, chunk: usize, key: &ObjectKey) -> Option<usize> {
        if self.hashes.get(chunk) != Some(&key.chunk_hash)
            || key.model_name != self.model
            || key.cache_salt != self.salt
            || key.object_group_id >= self.groups
        {
            return None;
        }
        let r = self.ranks.iter().position(|r| *r == key.kv_rank)?;
        let row = key.object_group_id as usize * self.ranks.len() + r;
        Some(chunk * self.row_count() + row)
    }
}

/// The lookup leases of every live request, bounded in number.
#[derive(Debug)]
pub struct LeaseBook {
    leases: HashMap<String, Lease>,
    /// Every lease by (expiry, insertion order): the first is the one to
    /// forget first, found without walking the book.
    by_expiry: BTreeMap<(Instant, u64), String>,
    next_order: u64,
    max: usize,
    ttl: Duration,
}

/// A lookup's grant: what [`LeaseBook::grant`] records.
pub struct Grant<'a> {
    pub request_id: &'a str,
    pub world_size: u32,
    /// kv ranks of one chunk and object group, in key order.
    pub ranks: &'a [u32],
    /// Object groups of one chunk (1 unless a layout's are separate).
    pub groups: u32,
    /// Chunk-major, then object group, then rank, from chunk 0.
    pub keys: &'a [ObjectKey],
    /// Per key: whether the lookup holds its locks (not when the group does
    /// not need that chunk, or it was not found); empty: every key.
    pub locked: &'a [bool],
    /// Per key: its slab's offset as the shard that locked it reported, or
    /// `NO_SLAB`; empty when none is known.
    pub slabs: &'a [u64],
    pub readers: u32,
    /// When the lookup was sent to the shards (before they locked).
    pub sent_at: Instant,
}

impl LeaseBook {
    /// A book of at most `max` leases, each forgotten `ttl` (the read-lock
    /// TTL) after its lookup was sent.
    pub fn new(max: usize, ttl: Duration) -> Self {
        LeaseBook {
            leases: HashMap::new(),
            by_expiry: BTreeMap::new(),
            next_order: 0,
            max: max.max(1),
            ttl,
        }
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Records that a lookup holds `readers` read locks on each of its keys. A
    /// later lookup of the same request adds to what the earlier one still
    /// holds on the same objects (and every instance has to read them again);
    /// on other objects, the earlier lease is forgotten (its locks then end by
    /// TTL or by the workers' releases).
    pub fn grant(&mut self, g: Grant<'_>) {
        let nr = g.ranks.len() * g.groups as usize;
        if nr == 0 || g.keys.is_empty() || g.keys.len() % nr != 0 {
            return;
        }
        let first = &g.keys[0];
        let held = if g.locked.len() == g.keys.len() {
            g.locked
                .iter()
                .map(|l| if *l { clamped(g.readers) } else { 0 })
                .collect()
        } else {
            vec![clamped(g.readers); g.keys.len()]
        };
        let mut lease = Lease {
            model: first.model_name,
            salt: first.cache_salt,
            world_size: g.world_size,
            ranks: g.ranks.to_vec(),
            groups: g.groups,
            hashes: g.keys.iter().step_by(nr).map(|k| k.chunk_hash).collect(),
            held,
            slabs: if g.slabs.len() == g.keys.len() {
                g.slabs.to_vec()
            } else {
                vec![NO_SLAB; g.keys.len()]
            },
            consumers: Vec::new(),
            expires: g.sent_at + self.ttl,
            order: 0,
        };
        if let Some(old) = self.leases.get(g.request_id) {
            let common = old.hashes.len().min(lease.hashes.len());
            if old.model == lease.model
                && old.salt == lease.salt
                && old.ranks == lease.ranks
                && old.groups == lease.groups
                && old.hashes[..common] == lease.hashes[..common]
            {
                for (h, o) in lease.held.iter_mut().zip(&old.held) {
                    *h = h.saturating_add(*o);
                }
                // An object the old lease still holds stayed where it was.
                for ((s, o), held) in lease.slabs.iter_mut().zip(&old.slabs).zip(&old.held) {
                    if *s == NO_SLAB && *held > 0 {
                        *s = *o;
                    }
                }
                // The older locks may expire first.
                lease.expires = lease.expires.min(old.expires);
            }
        }
        self.insert(g.request_id, lease);
    }

    fn insert(&mut self, rid: &str, mut lease: Lease) {
        if self.forget(rid).is_none() && self.leases.len() >= self.max {
            // Full: forget the lease closest to expiry (its locks still end by TTL).
            if let Some(victim) = self.by_expiry.values().next().cloned() {
                self.forget(&victim);
            }
        }
        lease.order = self.next_order;
        self.next_order += 1;
        self.by_expiry
            .insert((lease.expires, lease.order), rid.to_owned());
        self.leases.insert(rid.to_owned(), lease);
    }

    /// Removes the lease of `rid` from the book.
    fn forget(&mut self, rid: &str) -> Option<Lease> {
        let lease = self.leases.remove(rid)?;
        self.by_expiry.remove(&(lease.expires, lease.order));
        Some(lease)
    }

    /// The slab offsets of `keys` (the objects of chunks `first_chunk..` of
    /// request `rid` that one worker reads, one kv rank each) if the lease of
    /// `rid` holds a lock on every one, knows where each lies, and is in the
    /// first half of its life at `now` (so its locks outlast the worker's copy
    /// by far). `None` otherwise: then only the shards can tell.
    pub fn readable(
        &self,
        rid: &str,
        first_chunk: usize,
        keys: &[ObjectKey],
        now: Instant,
    ) -> Option<Vec<u64>> {
        let lease = self.leases.get(rid)?;
        if now + self.ttl / 2 >= lease.expires {
            return None;
        }
        keys.iter()
            .enumerate()
            .map(|(i, k)| {
                let p = lease.position(first_chunk + i, k)?;
                (lease.held[p] > 0 && lease.slabs[p] != NO_SLAB).then_some(lease.slabs[p])
            })
            .collect()
    }

    /// Per key of `keys` (laid out as for [`readable`](Self::readable)):
    /// whether the lookup of `rid` found it. A hint, not a guarantee: an
    /// object the lease no longer holds a lock on may have gone since.
    pub fn found(&self, rid: &str, first_chunk: usize, keys: &[ObjectKey]) -> Vec<bool> {
        let Some(lease) = self.leases.get(rid) else {
            return vec![false; keys.len()];
        };
        keys.iter()
            .enumerate()
            .map(|(i, k)| lease.position(first_chunk + i, k).is_some())
            .collect()
    }

    /// Records that `count` locks were released for request `rid` on each key
    /// of `keys` (with the request's chunk index it belongs to), by instance
    /// `by` if a worker released them. Keys the lease does not cover are
    /// ignored. Returns each key with the locks the lease still held on it (at
    /// most `count`), leaving out keys it held none of: only those are the
    /// lookup's to give back, so a release repeated, or sent after the lease
    /// was forgotten (expired, cleared), names nothing that may be someone
    /// else's.
    pub fn released<'k>(
        &mut self,
        rid: &str,
        keys: impl IntoIterator<Item = (usize, &'k ObjectKey)>,
        count: u32,
        by: Option<InstanceId>,
    ) -> Vec<(ObjectKey, u32)> {
        let Some(lease) = self.leases.get_mut(rid) else {
            return Vec::new();
        };
        let count = clamped(count);
        let mut covered = false;
        let mut held = Vec::new();
        for (chunk, k) in keys {
            if let Some(p) = lease.position(chunk, k) {
                covered = true;
                let n = lease.held[p].min(count);
                if n > 0 {
                    lease.held[p] -= n;
                    held.push((*k, n));
                }
            }
        }
        // Only a worker that read this lookup's objects is done with it.
        if let (Some(iid), true) = (by, covered) {
            if !lease.consumers.contains(&iid) {
                lease.consumers.push(iid);
            }
        }
        if lease.held.iter().all(|h| *h == 0) {
            self.forget(rid);
        }
        held
    }

    /// The locks of `model`/`world_size` leases that no live instance can
    /// release any more, taken out of the book: per object, the locks held
    /// beyond `readers(rank, consumers)`, the number of live instances that may
    /// still read an object of that kv rank (those in `consumers` are done with
    /// the lease). Returns `(key, locks)` pairs to release.
    pub fn orphaned(
        &mut self,
        model: &str,
        world_size: u32,
        readers: impl Fn(u32, &[InstanceId]) -> u32,
    ) -> Vec<(ObjectKey, u32)> {
        let mut out = Vec::new();
        let mut emptied = Vec::new();
        for (rid, lease) in self.leases.iter_mut() {
            if lease.model != model || lease.world_size != world_size {
                continue;
            }
            let nr = lease.row_count();
            let may_read: Vec<u32> = (0..nr)
                .map(|row| readers(lease.row(row).1, &lease.consumers))
                .collect();
            for p in 0..lease.held.len() {
                let keep = may_read[p % nr];
                if lease.held[p] > keep {
                    out.push((lease.key(p / nr, p % nr), lease.held[p] - keep));
                    lease.held[p] = keep;
                }
            }
            if lease.held.iter().all(|h| *h == 0) {
                emptied.push(rid.clone());
            }
        }
        for rid in emptied {
            self.forget(&rid);
        }
        out
    }

    /// Forgets leases whose locks may have expired by `now`. Returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut n = 0;
        while let Some(entry) = self.by_expiry.first_entry() {
            if entry.key().0 > now {
                break;
            }
            self.leases.remove(&entry.remove());
            n += 1;
        }
        n
    }

    /// Forgets every lease (a forced clear removed locked objects: a lock on a
    /// key stored again later is not theirs to release).
    pub fn clear(&mut self) {
        self.leases.clear();
        self.by_expiry.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(chunk: u8, rank: u32) -> ObjectKey {
        ObjectKey {
            chunk_hash: [chunk; 32],
            model_name: Name::intern("m").unwrap(),
            kv_rank: rank,
            object_group_id: 0,
            cache_salt: Name::EMPTY,
        }
    }

    /// Keys of chunks 0..n over `ranks`, chunk-major.
    fn keys(n: u8, ranks: &[u32]) -> Vec<ObjectKey> {
        (0..n)
            .flat_map(|c| ranks.iter().map(move |r| key(c, *r)))
            .collect()
    }

    /// `keys` with their chunk indices: `per` keys per chunk from chunk `first`.
    fn chunks(first: usize, per: usize, keys: &[ObjectKey]) -> Vec<(usize, &ObjectKey)> {
        keys.iter()
            .enumerate()
            .map(|(i, k)| (first + i / per, k))
            .collect()
    }

    fn book() -> LeaseBook {
        LeaseBook::new(16, Duration::from_secs(300))
    }

    fn grant(b: &mut LeaseBook, rid: &str, ranks: &[u32], n: u8, readers: u32, t: Instant) {
        b.grant(Grant {
            request_id: rid,
            world_size: ranks.len() as u32,
            ranks,
            groups: 1,
            locked: &[],
            keys: &keys(n, ranks),
            slabs: &[],
            readers,
            sent_at: t,
        });
    }

    #[test]
    fn object_groups_hold_only_the_keys_their_lookup_locked() {
        let t = Instant::now();
        let mut b = book();
        // Two chunks of two object groups, one rank; group 1 (a window of one
        // chunk) was locked for chunk 1 only.
        let og = |c: u8, g: u32| ObjectKey {
            object_group_id: g,
            ..key(c, 0)
        };
        let keys = [og(0, 0), og(0, 1), og(1, 0), og(1, 1)];
        b.grant(Grant {
            request_id: "r",
            world_size: 1,
            ranks: &[0],
            groups: 2,
            locked: &[true, false, true, true],
            keys: &keys,
            slabs: &[],
            readers: 1,
            sent_at: t,
        });
        assert_eq!(b.found("r", 0, &[og(0, 1)]), [true], "covered");
        let out = b.released("r", [(0, &og(0, 1)), (1, &og(1, 1))], 1, None);
        assert_eq!(out, [(og(1, 1), 1)], "only the locked one is given back");
        // A group the lease does not have is not its.
        assert!(b.released("r", [(0, &og(0, 2))], 1, None).is_empty());
        let out = b.orphaned("m", 1, |_, _| 0);
        assert_eq!(out, [(og(0, 0), 1), (og(1, 0), 1)]);
    }

    #[test]
    fn a_worker_that_never_came_leaves_its_share_to_release() {
        let t = Instant::now();
        let mut b = book();
        // TP 2: one lock per object, rank 0 read by worker 10, rank 1 by worker 11.
        grant(&mut b, "r", &[0, 1], 3, 1, t);
        // Worker 10 retrieves its rank.
        b.released("r", chunks(0, 1, &keys(3, &[0])), 1, Some(InstanceId(10)));
        // Worker 11 dies: nobody else may read rank 1; rank 0 is done.
        let out = b.orphaned("m", 2, |_, _| 0);
        assert_eq!(out, (0..3).map(|c| (key(c, 1), 1)).collect::<Vec<_>>());
        assert!(b.is_empty(), "nothing left held");
    }

    #[test]
    fn locks_a_live_reader_may_still_release_are_kept() {
        let t = Instant::now();
        let mut b = book();
        // MLA over TP 3: every worker reads rank 0, three locks per object.
        grant(&mut b, "r", &[0], 2, 3, t);
        b.released("r", chunks(0, 1, &keys(2, &[0])), 1, Some(InstanceId(1)));
        // Worker 2 died; worker 3 is alive and has not read yet; worker 1 is done.
        let out = b.orphaned("m", 1, |rank, consumers| {
            assert_eq!(rank, 0);
            assert_eq!(consumers, &[InstanceId(1)]);
            1
        });
        assert_eq!(out, vec![(key(0, 0), 1), (key(1, 0), 1)]);
        // Worker 3 reads later: its lock is still there and the lease empties.
        b.released("r", chunks(0, 1, &keys(2, &[0])), 1, Some(InstanceId(3)));
        assert!(b.is_empty());
    }

    #[test]
    fn other_models_and_world_sizes_are_untouched() {
        let t = Instant::now();
        let mut b = book();
        grant(&mut b, "r", &[0], 2, 1, t);
        assert!(b.orphaned("other", 1, |_, _| 0).is_empty());
        assert!(b.orphaned("m", 2, |_, _| 0).is_empty());
        assert_eq!(b.orphaned("m", 1, |_, _| 0).len(), 2);
    }

    #[test]
    fn releases_of_other_objects_do_not_count() {
        let t = Instant::now();
        let mut b = book();
        grant(&mut b, "r", &[0], 2, 1, t);
        // Same request, other tokens: not what the lookup locked.
        b.released("r", [(0, &key(9, 0))], 1, Some(InstanceId(1)));
        // Past the held prefix.
        b.released("r", [(2, &key(2, 0))], 1, Some(InstanceId(1)));
        // Instance 1 read none of the lease's objects: it still counts as a reader.
        let out = b.orphaned("m", 1, |_, done| {
            assert!(done.is_empty(), "{done:?}");
            0
        });
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn free_lookup_locks_release_every_reader_and_partial_ranges() {
        let t = Instant::now();
        let mut b = book();
        grant(&mut b, "r", &[0, 1], 4, 2, t);
        // The scheduler frees chunks 2..4 (both ranks, both readers).
        let tail: Vec<ObjectKey> = keys(4, &[0, 1])[4..].to_vec();
        let freed = b.released("r", chunks(2, 2, &tail), 2, None);
        assert_eq!(freed, tail.iter().map(|k| (*k, 2)).collect::<Vec<_>>());
        // Repeated: the lease holds none of them any more, so none is named.
        assert!(b.released("r", chunks(2, 2, &tail), 2, None).is_empty());
        // Three locks asked for chunk 0 rank 0: the two held are named.
        let head = keys(1, &[0, 1]);
        assert_eq!(
            b.released("r", chunks(0, 2, &head[..1]), 3, None),
            vec![(head[0], 2)]
        );
        let out = b.orphaned("m", 2, |_, _| 0);
        assert_eq!(out, vec![(key(0, 1), 2), (key(1, 0), 2), (key(1, 1), 2)]);
    }

    #[test]
    fn a_second_lookup_adds_to_the_same_objects_and_replaces_others() {
        let t = Instant::now();
        let mut b = book();
        grant(&mut b, "r", &[0], 2, 1, t);
        grant(&mut b, "r", &[0], 3, 1, t);
        let out = b.orphaned("m", 1, |_, _| 0);
        assert_eq!(out, vec![(key(0, 0), 2), (key(1, 0), 2), (key(2, 0), 1)]);

        grant(&mut b, "s", &[0], 2, 1, t);
        // Another model under the same request id: the old lease is forgotten.
        let mut other = keys(1, &[0]);
        other[0].model_name = Name::intern("n").unwrap();
        b.grant(Grant {
            request_id: "s",
            world_size: 1,
            ranks: &[0],
            groups: 1,
            locked: &[],
            keys: &other,
            slabs: &[],
            readers: 1,
            sent_at: t,
        });
        assert!(b.orphaned("m", 1, |_, _| 0).is_empty());
        assert_eq!(b.orphaned("n", 1, |_, _| 0), vec![(other[0], 1)]);
    }

    #[test]
    fn a_worker_reads_from_the_lease_only_what_it_still_holds_and_knows() {
        let t = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = LeaseBook::new(4, 100 * s);
        let ks = keys(3, &[0, 1]);
        // Where chunk 2 rank 1 lies is not known.
        let slabs = [10, 11, 20, 21, 30, NO_SLAB];
        // One lookup of chunks 0..3 over ranks 0 and 1, with these places.
        let lookup = |b: &mut LeaseBook, slabs: &[u64]| {
            b.grant(Grant {
                request_id: "r",
                world_size: 2,
                ranks: &[0, 1],
                groups: 1,
                locked: &[],
                keys: &ks,
                slabs,
                readers: 1,
                sent_at: t,
            })
        };
        lookup(&mut b, &slabs);
        let rank = |r: u32, from: u8, to: u8| -> Vec<ObjectKey> {
            (from..to).map(|c| key(c, r)).collect()
        };
        assert_eq!(
            b.readable("r", 0, &rank(0, 0, 3), t),
            Some(vec![10, 20, 30])
        );
        assert_eq!(b.readable("r", 1, &rank(1, 1, 2), t), Some(vec![21]));
        assert_eq!(b.readable("r", 0, &rank(1, 0, 3), t), None, "unknown slab");
        assert_eq!(b.readable("r", 1, &rank(0, 0, 1), t), None, "wrong chunk");
        assert_eq!(
            b.readable("r", 0, &rank(0, 0, 4), t),
            None,
            "past the prefix"
        );
        assert_eq!(b.readable("q", 0, &rank(0, 0, 1), t), None, "no lease");
        assert_eq!(
            b.readable("r", 0, &rank(0, 0, 1), t + 50 * s),
            None,
            "half its life"
        );
        assert!(b.readable("r", 0, &rank(0, 0, 1), t + 49 * s).is_some());
        // Worker 7 passes its lock on rank 0 to its transfer: none is left.
        b.released("r", chunks(0, 1, &rank(0, 0, 3)), 1, Some(InstanceId(7)));
        assert_eq!(b.readable("r", 0, &rank(0, 0, 1), t), None, "released");
        assert_eq!(b.readable("r", 0, &rank(1, 0, 2), t), Some(vec![11, 21]));
        // A second lookup that loaded chunk 0 rank 1 keeps its known place.
        let mut again = slabs;
        again[1] = NO_SLAB;
        lookup(&mut b, &again);
        assert_eq!(b.readable("r", 0, &rank(1, 0, 2), t), Some(vec![11, 21]));
        assert_eq!(b.readable("r", 0, &rank(0, 0, 1), t), Some(vec![10]));
        // Chunk 0 rank 0 was released by every reader before a lookup that
        // loaded it again: the old place is not taken for it.
        b.released("r", chunks(0, 1, &rank(0, 0, 3)), 1, Some(InstanceId(7)));
        let mut third = slabs;
        third[0] = NO_SLAB;
        lookup(&mut b, &third);
        assert_eq!(b.readable("r", 0, &rank(0, 0, 1), t), None, "a stale place");
        assert_eq!(b.readable("r", 1, &rank(0, 1, 3), t), Some(vec![20, 30]));
        // A forced clear forgets every lease.
        b.clear();
        assert_eq!(b.readable("r", 0, &rank(0, 0, 1), t), None);
    }

    #[test]
    fn leases_expire_with_their_locks_and_the_book_is_bounded() {
        let t = Instant::now();
        let mut b = LeaseBook::new(2, Duration::from_secs(10));
        grant(&mut b, "a", &[0], 1, 1, t);
        grant(&mut b, "b", &[0], 1, 1, t + Duration::from_secs(1));
        grant(&mut b, "c", &[0], 1, 1, t + Duration::from_secs(2));
        assert_eq!(b.len(), 2, "the one nearest expiry was forgotten");
        assert_eq!(b.expire(t + Duration::from_secs(11)), 1);
        assert_eq!(b.expire(t + Duration::from_secs(12)), 1);
        assert!(b.is_empty());
    }

    #[test]
    fn the_full_book_forgets_the_earliest_expiry_first_granted_on_ties() {
        let t = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = LeaseBook::new(3, Duration::from_secs(10));
        grant(&mut b, "a", &[0], 1, 1, t + s);
        grant(&mut b, "b", &[0], 1, 1, t + s);
        grant(&mut b, "c", &[0], 1, 1, t);
        // A new grant for "c" keeps the older expiry; it is still first to go.
        grant(&mut b, "c", &[0], 1, 1, t + 5 * s);
        grant(&mut b, "d", &[0], 1, 1, t + 2 * s);
        assert!(!b.leases.contains_key("c"));
        grant(&mut b, "e", &[0], 1, 1, t + 2 * s);
        assert!(
            !b.leases.contains_key("a"),
            "a and b tie: a was granted first"
        );
        assert_eq!(b.by_expiry.len(), b.leases.len());
        // Fully released and orphaned leases leave the index too.
        b.released("b", chunks(0, 1, &keys(1, &[0])), 1, None);
        assert_eq!(b.orphaned("m", 1, |_, _| 0).len(), 2);
        assert!(b.is_empty() && b.by_expiry.is_empty());
        grant(&mut b, "f", &[0], 1, 1, t);
        assert_eq!(b.expire(t + 10 * s), 1);
        assert!(b.by_expiry.is_empty());
    }
}
