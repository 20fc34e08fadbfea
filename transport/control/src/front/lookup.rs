//! LOOKUP and its prefetch job: the first phase asks each shard what it holds
//! (L1, L2, miss), the hit prefix is planned, L2 hits of the prefix are
//! loaded into L1 (within `--l2-prefetch-max-in-flight` and the L2
//! deadline), and the result is handed to `query_prefetch_status` and
//! `wait_prefetch_status`; the prefix's read locks go to a lease until the
//! workers read it or free them.

use std::time::{Duration, Instant};

use kvshard_dataplane::messages::{
    Found, L2Deadline, ObjectSizes, ReplyTo, Seq, ShardMsg, ShardOp, NO_SLAB,
};
use kvshard_engine::keys::{self, HashError, Name, NameError, ObjectKey};
use kvshard_engine::l1::WriterTag;
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_layout::geometry::window_start;
use kvshard_wire::{self as wire, IpcKey};

use super::inflight::{involved, InflightKind};
use super::{Front, MAX_OBJECTS_PER_REQUEST};
use crate::lookup_leases::{clamped, Grant, LeaseBook};
use crate::lookup_log::{LookupRecord, SendOutcome, WRITER_QUEUE_RECORDS};
use crate::prefetch::{Job, Waiter};
use crate::session::LookupScope;

/// The second half of a lookup that found chunks of its prefix only in L2.
pub(super) struct PendingLoad {
    pub(super) request_id: String,
    /// Sequence number of the lookup (the job it will complete).
    pub(super) job_seq: Seq,
    /// The prefix's keys: chunk-major, then object group, then kv rank.
    pub(super) keys: Vec<ObjectKey>,
    /// Per key: where the shards found it.
    pub(super) found: Vec<Found>,
    /// Per key: its slab's offset if an L1 hit, else `NO_SLAB`.
    pub(super) slabs: Vec<u64>,
    /// kv ranks of each object group of a chunk.
    pub(super) num_ranks: usize,
    /// Per object group: its sliding window in chunks (-1: full attention).
    pub(super) windows: Vec<i64>,
    pub(super) world_size: u32,
    pub(super) readers: u32,
    /// Bytes of one object of each object group of the request's layout
    /// (for L2 lookups and loads).
    pub(super) sizes: ObjectSizes,
    /// When the lookup was sent to the shards (its read locks' TTL starts after).
    pub(super) sent_at: Instant,
}

impl PendingLoad {
    /// Keys of one chunk: every object group's kv ranks.
    fn rows(&self) -> usize {
        self.windows.len() * self.num_ranks
    }

    /// Whether key `i` is one a hit of `len` chunks needs: full-attention
    /// groups need every chunk of it, a window of `w` chunks its last `w`
    /// (0.5.6's `unfold`).
    fn needed(&self, i: usize, len: usize) -> bool {
        let rows = self.rows();
        let (chunk, og) = (i / rows, (i % rows) / self.num_ranks);
        chunk < len && chunk >= window_start(self.windows[og], len)
    }

    /// Keys of the first `len` chunks (and their slabs), with whether the
    /// lookup holds each (`held`) for its lease.
    fn grant(&self, leases: &mut LeaseBook, len: usize, held: &[bool]) {
        let n = len * self.rows();
        if n == 0 || self.num_ranks == 0 {
            return;
        }
        let ranks: Vec<u32> = self.keys[..self.num_ranks]
            .iter()
            .map(|k| k.kv_rank)
            .collect();
        leases.grant(Grant {
            request_id: &self.request_id,
            world_size: self.world_size,
            ranks: &ranks,
            groups: self.windows.len() as u32,
            keys: &self.keys[..n],
            locked: &held[..n],
            slabs: &self.slabs[..n.min(self.slabs.len())],
            readers: self.readers,
            sent_at: self.sent_at,
        });
    }
}

/// The longest prefix every object group can serve (0.5.6's `fold` and its
/// highest set bit), from per-key values laid out chunk-major, then object
/// group (`windows.len()` of them), then kv rank (`num_ranks`): a chunk of a
/// group is present when `hit` holds for each of its ranks; a full-attention
/// group serves `L` chunks when chunks `0..L` are present, a group of a
/// window of `w` chunks when its last `min(w, L)` chunks are.
fn hit_prefix<T>(
    per_key: &[T],
    num_ranks: usize,
    windows: &[i64],
    hit: impl Fn(&T) -> bool,
) -> usize {
    let rows = windows.len() * num_ranks;
    if rows == 0 {
        return 0;
    }
    let chunks = per_key.len() / rows;
    // Per group: the run of present chunks ending at the current chunk.
    let mut runs = vec![0usize; windows.len()];
    let mut best = 0;
    for c in 0..chunks {
        let row = &per_key[c * rows..(c + 1) * rows];
        let mut servable = true;
        for (g, w) in windows.iter().enumerate() {
            let present = row[g * num_ranks..(g + 1) * num_ranks].iter().all(&hit);
            runs[g] = if present { runs[g] + 1 } else { 0 };
            let len = c + 1;
            servable &= runs[g] >= len - window_start(*w, len);
        }
        if servable {
            best = c + 1;
        } else if windows.iter().all(|w| *w < 1) {
            // Full attention only: nothing past the first gap is servable.
            break;
        }
    }
    best
}

/// The longest a `query_prefetch_status` is held for a lookup's first phase
/// (the shards' L1 reservation and L2 existence check) before it is answered
/// "still running". Far below a client's request timeout.
pub(super) const FIRST_PHASE_HOLD: Duration = Duration::from_secs(1);

/// The kv_ranks a key addresses: one worker's, or every worker's of a world
/// (a scheduler key), without a list of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ranks {
    pub(super) world_size: u32,
    /// Workers `first..end`.
    pub(super) first: u32,
    pub(super) end: u32,
}

impl Ranks {
    /// Worker `worker`'s rank in a world of `world_size`, or every worker's.
    pub(super) fn of(world_size: u32, worker: Option<u32>) -> Ranks {
        let (first, end) = match worker {
            Some(w) => (w, w + 1),
            None => (0, world_size),
        };
        Ranks {
            world_size,
            first,
            end,
        }
    }

    pub(super) fn len(&self) -> usize {
        (self.end - self.first) as usize
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = u32> {
        let ws = self.world_size;
        (self.first..self.end).map(move |w| keys::worker_kv_rank(ws, w))
    }

    /// The rank, when there is one.
    pub(super) fn single(&self) -> Option<u32> {
        (self.len() == 1).then(|| keys::worker_kv_rank(self.world_size, self.first))
    }
}

impl Front {
    /// Sets the job of `rid`: a pending lookup (`Some(seq)`) or a miss (`None`).
    /// Callers waiting on a pending job it replaces keep waiting on a new
    /// pending one (they asked about the request, not the lookup), and get 0
    /// from a miss.
    pub(super) fn set_job(&mut self, rid: String, pending: Option<Seq>) {
        match pending {
            Some(seq) => self.jobs.start(rid, seq),
            None => {
                let old = self.jobs.finish(rid, 0);
                self.answer_waiters(old, 0);
            }
        }
        // Bound the results nobody asks for between periodic sweeps.
        if self.jobs.len() > self.jobs_sweep_above {
            self.drop_orphan_jobs();
        }
    }

    /// Drops finished lookup results whose session is gone: no live request can
    /// ask for them. Returns how many.
    pub(super) fn drop_orphan_jobs(&mut self) -> usize {
        let sessions = &self.sessions;
        let dropped = self.jobs.retain_done(|rid| sessions.contains(rid));
        // Pending jobs and live sessions' results stay: sweep again only once
        // the jobs have doubled, so a sweep costs O(1) per job set.
        self.jobs_sweep_above = (2 * self.cfg.max_sessions).max(2 * self.jobs.len());
        dropped
    }

    /// Answers parked wait_prefetch_status callers: the first gets `hits` (a result
    /// is handed out once), the rest 0.
    pub(super) fn answer_waiters(&mut self, waiters: Vec<Waiter>, hits: i64) {
        let mut first = true;
        for Waiter { to, .. } in waiters {
            let v = if first { hits } else { 0 };
            first = false;
            self.reply(&to, Some(wire::encode_int(v)));
        }
    }

    /// Object keys of chunks `hashes` for `ranks`, chunk-major and rank-minor.
    pub(super) fn object_keys(
        model: Name,
        salt: Name,
        hashes: &[keys::ChunkHash],
        ranks: Ranks,
    ) -> Vec<ObjectKey> {
        Self::object_keys_of_groups(model, salt, hashes, ranks, 1)
    }

    /// Object keys of chunks `hashes` for object groups `0..groups` and
    /// `ranks`: chunk-major, then object group, then rank.
    pub(super) fn object_keys_of_groups(
        model: Name,
        salt: Name,
        hashes: &[keys::ChunkHash],
        ranks: Ranks,
        groups: u32,
    ) -> Vec<ObjectKey> {
        let mut out = Vec::with_capacity(hashes.len() * ranks.len() * groups as usize);
        for h in hashes {
            for og in 0..groups {
                for kv_rank in ranks.iter() {
                    out.push(ObjectKey {
                        chunk_hash: *h,
                        model_name: model,
                        kv_rank,
                        object_group_id: og,
                        cache_salt: salt,
                    });
                }
            }
        }
        out
    }

    /// The object groups a request of `model` at `world_size` addresses: 1
    /// when no registration names them.
    pub(super) fn object_group_count(&self, model: &str, world_size: u32) -> u32 {
        self.layouts
            .get(model, world_size)
            .map_or(1, |g| g.len() as u32)
    }

    /// Interned (model_name, cache_salt) of a request, once per request.
    pub(super) fn key_names(model: &str, salt: &str) -> Result<(Name, Name), KeyError> {
        let name = |field, s| Name::intern(s).map_err(|source| KeyError::Name { field, source });
        Ok((name("model_name", model)?, name("cache_salt", salt)?))
    }

    /// kv_ranks a key addresses: one worker's, or every worker's for a scheduler key.
    pub(super) fn ranks_of(key: &IpcKey) -> Result<Ranks, KeyError> {
        let ws = u32::try_from(key.world_size)
            .ok()
            .filter(|w| (1..=keys::MAX_WORLD_SIZE).contains(w))
            .ok_or(KeyError::WorldSize(key.world_size))?;
        match key.worker_id {
            Some(w) if w < 0 || w as u64 >= ws as u64 => Err(KeyError::WorkerId {
                worker: w,
                world_size: ws,
            }),
            w => Ok(Ranks::of(ws, w.map(|w| w as u32))),
        }
    }

    /// Chunk hashes of `[start, end)` of `key`, through its session.
    /// Refuses (before any work) a request that would address more than
    /// [`MAX_OBJECTS_PER_REQUEST`] objects: chunks times kv ranks.
    pub(super) fn key_hashes(
        &mut self,
        key: &IpcKey,
        from_zero: bool,
        num_ranks: usize,
        now: Instant,
    ) -> Result<Vec<keys::ChunkHash>, KeyError> {
        let cs = self.cfg.chunk_size;
        let start = if from_zero {
            0
        } else {
            usize::try_from(key.start).map_err(|_| KeyError::NegativeStart(key.start))?
        };
        let end = usize::try_from(key.end).map_err(|_| KeyError::NegativeEnd(key.end))?;
        let objects = (end.saturating_sub(start) / cs).saturating_mul(num_ranks);
        if objects > MAX_OBJECTS_PER_REQUEST {
            return Err(KeyError::TooManyObjects {
                start,
                end,
                ranks: num_ranks,
                objects,
            });
        }
        let s = self
            .sessions
            .with_tokens(&key.request_id, &key.token_ids, now);
        s.hashes(cs, start, end)
            .map(|h| h.to_vec())
            .map_err(KeyError::Tokens)
    }

    pub(super) fn lookup(&mut self, to: ReplyTo, key: IpcKey, now: Instant) {
        self.metrics.lookups += 1;
        // Every lookup is acked alike, with no payload (as 0.5.6 does), so the
        // ack leaves first and the hashing and posting below overlap its trip.
        // Nothing can see the difference: the front reads the client's next
        // request (its status query) only once this one has registered its job.
        self.reply(&to, None);
        let rid = key.request_id.clone();
        let early = |front: &mut Front, reason: &'static str| {
            front.metrics.count_early_exit(reason);
            front.set_job(rid.clone(), None);
        };
        let Some(layout) = u32::try_from(key.world_size)
            .ok()
            .and_then(|ws| self.layouts.get(&key.model_name, ws))
            .map(|groups| groups.to_vec())
        else {
            log_limited!(
                Level::Error,
                "No GPU context found for model {} with world size {} during lookup",
                key.model_name,
                key.world_size
            );
            return early(self, "no_gpu_context");
        };
        let readers = match u32::try_from(key.num_kv_readers) {
            Ok(r) if r >= 1 => r,
            _ => {
                log_limited!(Level::Error,
                    "lookup {rid}: num_kv_readers={} — this server requires clients that send num_kv_readers",
                    key.num_kv_readers
                );
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        let ranks = match Self::ranks_of(&key) {
            Ok(r) => r,
            Err(e) => {
                log_limited!(Level::Error, "lookup {rid}: {e}");
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        let hashes = match self.key_hashes(&key, true, ranks.len() * layout.len(), now) {
            Ok(h) => h,
            Err(e) => {
                log_limited!(Level::Error, "lookup {rid}: {e}");
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        let (model, salt) = match Self::key_names(&key.model_name, &key.cache_salt) {
            Ok(n) => n,
            Err(e) => {
                log_limited!(Level::Error, "lookup {rid}: {e}");
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        if let Some(s) = self.sessions.get_mut(&rid) {
            s.lookup = Some(LookupScope {
                model_name: key.model_name.clone(),
                world_size: key.world_size as u32,
                worker_id: key.worker_id.map(|w| w as u32),
                cache_salt: key.cache_salt.clone(),
                num_kv_readers: readers,
            });
            s.prefetch_hit_chunks = -1;
        }
        if let Some(writer) = self.lookup_log.as_ref() {
            // Formatted and written on the writer thread; never waited for.
            let outcome = writer.send(LookupRecord {
                at: std::time::SystemTime::now(),
                request_id: rid.clone(),
                model_name: key.model_name.clone(),
                chunk_size: self.cfg.chunk_size,
                seq_len: key.token_ids.len(),
                dtype: layout[0].layout.dtype.to_string(),
                shape: layout[0].layout.shape.to_vec(),
                chunk_hashes: hashes.clone(),
            });
            match outcome {
                SendOutcome::Queued => {}
                SendOutcome::Full => {
                    self.metrics.lookup_hash_log_dropped += 1;
                    log_limited!(
                        Level::Warn,
                        "lookup hash log: the writer is {WRITER_QUEUE_RECORDS} records behind; \
                         the line of lookup {rid} was dropped"
                    );
                }
                // An I/O error disabled the log (the writer said so).
                SendOutcome::Closed => self.lookup_log = None,
            }
        }
        if hashes.is_empty() {
            return early(self, "empty_chunk_hashes");
        }
        self.metrics.lookup_requested_tokens += (hashes.len() * self.cfg.chunk_size) as u64;
        let num_ranks = ranks.len();
        let objs = Self::object_keys_of_groups(model, salt, &hashes, ranks, layout.len() as u32);
        let parts = self.split(&objs);
        if self.refused(&to, involved(&parts)) {
            return early(self, "shard_unavailable");
        }
        let seq = self.next_seq;
        // One key list per involved shard, in the order fan_out visits them.
        let sent: Vec<Vec<ObjectKey>> = parts
            .iter()
            .filter(|idx| !idx.is_empty())
            .map(|idx| idx.iter().map(|i| objs[*i]).collect())
            .collect();
        let sizes = ObjectSizes::new(layout.iter().map(|g| g.layout.bytes).collect());
        let kind = InflightKind::Lookup {
            lookup: PendingLoad {
                request_id: rid.clone(),
                job_seq: seq,
                keys: objs,
                found: Vec::new(),
                slabs: Vec::new(),
                num_ranks,
                windows: layout.iter().map(|g| g.window_chunks).collect(),
                world_size: key.world_size as u32,
                readers,
                sizes: sizes.clone(),
                sent_at: now,
            },
        };
        let mut sent = sent.into_iter();
        let deadline = self.l2_deadline(now);
        let immediate = self.fan_out(parts, kind, |_| ShardOp::Lookup {
            keys: sent.next().unwrap_or_default(),
            readers,
            sizes: sizes.clone(),
            deadline,
        });
        debug_assert!(
            immediate.is_none(),
            "a non-empty lookup always involves a shard"
        );
        // A status query read after this is held until the shards answer.
        self.set_job(rid, Some(seq));
    }

    /// First half of a finished lookup: plans the prefix from L1 and L2 hits,
    /// releases every lock beyond it, and either concludes or starts loading
    /// the prefix's L2 hits into L1.
    pub(super) fn finish_lookup(
        &mut self,
        seq: Seq,
        mut p: PendingLoad,
    ) -> Option<(Vec<Waiter>, i64)> {
        let prefix = hit_prefix(&p.found, p.num_ranks, &p.windows, |f| *f != Found::Miss);
        let current = self.is_current(&p.request_id, seq);
        // Locks the prefix does not need are released; a superseded lookup
        // keeps none.
        let len = if current { prefix } else { 0 };
        let unneeded: Vec<usize> = (0..p.keys.len())
            .filter(|&i| p.found[i] != Found::Miss && !p.needed(i, len))
            .collect();
        let keys: Vec<ObjectKey> = unneeded.iter().map(|&i| p.keys[i]).collect();
        let found: Vec<Found> = unneeded.iter().map(|&i| p.found[i]).collect();
        self.release_found(&keys, &found, p.readers);
        if !current {
            return None;
        }
        for i in unneeded {
            p.found[i] = Found::Miss;
        }
        let keep = len * p.rows();
        p.keys.truncate(keep);
        p.found.truncate(keep);
        p.slabs.truncate(keep);
        if !p.found.iter().any(|f| f.is_l2()) {
            let held: Vec<bool> = p.found.iter().map(|f| *f == Found::L1).collect();
            p.grant(&mut self.leases, prefix, &held);
            let hit_keys = held.iter().filter(|h| **h).count();
            return self.conclude_lookup(&p.request_id, prefix, hit_keys, 0, 0);
        }
        // Status queries held through the first phase learn the job runs on.
        for to in self.jobs.begin_load(&p.request_id) {
            self.reply(&to, None);
        }
        let (job_seq, deadline) = (p.job_seq, self.l2_deadline(p.sent_at));
        if self.loads_inflight < self.cfg.l2.prefetch_max_in_flight {
            self.start_load(p);
        } else {
            self.load_queue.push_back(p);
        }
        if let Some(d) = deadline {
            if d.at <= self.clock.now() {
                // The L2 check took the whole wait: conclude now; the loads
                // started above still land.
                self.conclude_at_deadline(job_seq);
            } else {
                self.load_deadlines.insert((d.at, job_seq));
            }
        }
        None
    }

    /// The deadline for L2 of a lookup that arrived at `arrived`; `None`
    /// when `--l2-prefetch-load-timeout` is 0 or there is no L2.
    pub(super) fn l2_deadline(&self, arrived: Instant) -> Option<L2Deadline> {
        let limit = self.cfg.l2.prefetch_load_timeout;
        (!limit.is_zero() && !self.cfg.l2.adapters.is_empty()).then(|| L2Deadline {
            at: arrived + limit,
            limit,
        })
    }

    /// The lookup of job `job_seq` ran out of time for its L2 loads: it
    /// concludes with the prefix L1 held when it was looked up (those locks
    /// go to its lease, the rest are released); the loads running go on, and
    /// what they load is released when they end (it stays in L1 for the
    /// next request); loads still queued are dropped. Nothing when the job
    /// concluded or was superseded already.
    pub(super) fn conclude_at_deadline(&mut self, job_seq: Seq) {
        let jobs = &self.jobs;
        let found = self
            .inflight
            .values_mut()
            .find_map(|inf| match &mut inf.kind {
                InflightKind::Load { load, .. } if load.job_seq == job_seq => Some(load),
                _ => None,
            })
            .or_else(|| self.load_queue.iter_mut().find(|p| p.job_seq == job_seq));
        let Some(p) = found.filter(|p| jobs.is_current(&p.request_id, job_seq)) else {
            return;
        };
        let prefix = hit_prefix(&p.found, p.num_ranks, &p.windows, |f| *f == Found::L1);
        let held: Vec<bool> = (0..p.keys.len())
            .map(|i| p.found[i] == Found::L1 && p.needed(i, prefix))
            .collect();
        p.grant(&mut self.leases, prefix, &held);
        let hit_keys = held.iter().filter(|h| **h).count();
        let beyond: Vec<ObjectKey> = (0..p.keys.len())
            .filter(|&i| p.found[i] == Found::L1 && !held[i])
            .map(|i| p.keys[i])
            .collect();
        // Handed to the lease or released here: whatever ends the load
        // later no longer sees these locks.
        for f in p.found.iter_mut().filter(|f| **f == Found::L1) {
            *f = Found::Miss;
        }
        let (rid, readers) = (p.request_id.clone(), p.readers);
        self.post(beyond, |keys| ShardOp::Release {
            keys,
            count: readers,
        });
        self.metrics.lookups_cut_at_deadline += 1;
        log_limited!(
            Level::Warn,
            "lookup {rid}: L2 did not answer within --l2-prefetch-load-timeout ({:?}): \
             concluded with the {prefix} chunks L1 holds; the loads running go on",
            self.cfg.l2.prefetch_load_timeout
        );
        if let Some((waiters, hits)) = self.conclude_lookup(&rid, prefix, hit_keys, 0, 0) {
            self.answer_waiters(waiters, hits);
        }
    }

    pub(super) fn is_current(&self, rid: &str, seq: Seq) -> bool {
        self.jobs.is_current(rid, seq)
    }

    /// Releases what a lookup holds on `keys`: `readers` L1 read locks on L1
    /// hits, one L2 lock on L2 hits.
    pub(super) fn release_found(&mut self, keys: &[ObjectKey], found: &[Found], readers: u32) {
        let mut l1 = Vec::new();
        let mut l2: Vec<Vec<(ObjectKey, Found)>> = vec![Vec::new(); self.shards.len()];
        let n = self.shards.len();
        for (k, f) in keys.iter().zip(found) {
            match *f {
                Found::Miss => {}
                Found::L1 => l1.push(*k),
                f @ Found::L2(_) => l2[k.shard(n)].push((*k, f)),
            }
        }
        self.post(l1, |keys| ShardOp::Release {
            keys,
            count: readers,
        });
        for (shard, keys) in l2.into_iter().enumerate() {
            if !keys.is_empty() {
                self.send(
                    shard,
                    ShardMsg {
                        seq: 0,
                        op: ShardOp::UnlockL2 { keys },
                    },
                );
            }
        }
    }

    pub(super) fn start_load(&mut self, p: PendingLoad) {
        if !self.is_current(&p.request_id, p.job_seq) {
            // Superseded or ended while queued.
            self.release_found(&p.keys, &p.found, p.readers);
            return self.next_load();
        }
        self.loads_inflight += 1;
        let loading: Vec<usize> = (0..p.keys.len()).filter(|&i| p.found[i].is_l2()).collect();
        let lkeys: Vec<(ObjectKey, Found)> =
            loading.iter().map(|&i| (p.keys[i], p.found[i])).collect();
        let n = self.shards.len();
        let mut parts = vec![Vec::new(); n];
        for (j, (k, _)) in lkeys.iter().enumerate() {
            parts[k.shard(n)].push(j);
        }
        self.next_load_tag += 1;
        let tag = WriterTag::load(self.next_load_tag);
        let (sizes, readers) = (p.sizes.clone(), p.readers);
        let deadline = self.l2_deadline(p.sent_at);
        let kind = InflightKind::Load {
            loaded: vec![false; lkeys.len()],
            slabs: vec![NO_SLAB; lkeys.len()],
            load: p,
            loading,
        };
        let immediate = self.fan_out(parts, kind, |idx| ShardOp::Load {
            keys: idx.iter().map(|&j| lkeys[j]).collect(),
            sizes: sizes.clone(),
            readers,
            tag,
            deadline,
        });
        debug_assert!(immediate.is_none(), "a load always involves a shard");
    }

    pub(super) fn next_load(&mut self) {
        while self.loads_inflight < self.cfg.l2.prefetch_max_in_flight {
            let Some(p) = self.load_queue.pop_front() else {
                return;
            };
            if self.is_current(&p.request_id, p.job_seq) {
                return self.start_load(p);
            }
            self.release_found(&p.keys, &p.found, p.readers);
        }
    }

    /// Second half: the prefix is what is in L1 now (hits and loaded objects).
    pub(super) fn finish_load(
        &mut self,
        mut p: PendingLoad,
        loading: &[usize],
        loaded: &[bool],
        slabs: &[u64],
    ) -> Option<(Vec<Waiter>, i64)> {
        self.loads_inflight -= 1;
        // Per key: readable in L1 now (holding `readers` locks), and where.
        let mut ok: Vec<bool> = p.found.iter().map(|f| *f == Found::L1).collect();
        for ((&i, &l), &at) in loading.iter().zip(loaded).zip(slabs) {
            ok[i] = l;
            p.slabs[i] = if l { at } else { NO_SLAB };
        }
        let prefix = hit_prefix(&ok, p.num_ranks, &p.windows, |b| *b);
        let current = self.is_current(&p.request_id, p.job_seq);
        let len = if current { prefix } else { 0 };
        let held: Vec<bool> = (0..ok.len()).map(|i| ok[i] && p.needed(i, len)).collect();
        let release: Vec<ObjectKey> = (0..ok.len())
            .filter(|&i| ok[i] && !held[i])
            .map(|i| p.keys[i])
            .collect();
        self.post(release, |keys| ShardOp::Release {
            keys,
            count: p.readers,
        });
        let failed = loaded.iter().filter(|l| !**l).count();
        if failed > 0 {
            log_limited!(Level::Warn,
                "lookup {}: {failed} objects found in L2 could not be loaded; the hit prefix is cut at the first",
                p.request_id
            );
        }
        self.next_load();
        if !current {
            return None;
        }
        let rows = p.rows();
        let from_l2 = |i: usize| held[i] && p.found[i].is_l2();
        let l2_chunks = (0..prefix)
            .filter(|c| (c * rows..(c + 1) * rows).any(from_l2))
            .count();
        let l2_keys = (0..held.len()).filter(|&i| from_l2(i)).count();
        let hit_keys = held.iter().filter(|h| **h).count();
        p.grant(&mut self.leases, prefix, &held);
        self.conclude_lookup(&p.request_id, prefix, hit_keys, l2_chunks, l2_keys)
    }

    /// Records a lookup's result: `prefix` chunks hit through `hit_keys`
    /// objects, `l2_chunks` of them (partly) loaded from L2 through
    /// `l2_keys` objects.
    pub(super) fn conclude_lookup(
        &mut self,
        rid: &str,
        prefix: usize,
        hit_keys: usize,
        l2_chunks: usize,
        l2_keys: usize,
    ) -> Option<(Vec<Waiter>, i64)> {
        let cs = self.cfg.chunk_size as u64;
        self.metrics.lookup_hit_tokens += prefix as u64 * cs;
        self.metrics.lookup_hit_keys += hit_keys as u64;
        self.metrics.lookup_hit_l2_tokens += l2_chunks as u64 * cs;
        self.metrics.lookup_hit_l2_keys += l2_keys as u64;
        if let Some(s) = self.sessions.get_mut(rid) {
            s.prefetch_hit_chunks = prefix as i64;
        }
        let waiters = self.jobs.take_waiters(rid);
        if waiters.is_empty() {
            self.jobs.finish(rid.to_owned(), prefix as i64);
            None
        } else {
            // The first waiter consumes the result.
            Some((waiters, prefix as i64))
        }
    }

    pub(super) fn query_prefetch(&mut self, to: ReplyTo, rid: &str, now: Instant) {
        match self.jobs.get(rid) {
            None => self.reply(&to, Some(wire::encode_int(0))),
            Some(Job::Pending { .. }) => {
                // In the first phase the answer is the shards' hop away: hold
                // the query for it. Loading from L2: still running.
                if let Err(to) = self.jobs.hold(rid, to, now + FIRST_PHASE_HOLD) {
                    self.reply(&to, None);
                }
            }
            Some(Job::Done { hit_chunks }) => {
                let n = *hit_chunks;
                self.jobs.remove(rid);
                self.reply(&to, Some(wire::encode_int(n)))
            }
        }
    }

    pub(super) fn wait_prefetch(&mut self, to: ReplyTo, rid: &str, timeout_s: f64, now: Instant) {
        let wait = if timeout_s.is_finite() && timeout_s > 0.0 {
            Duration::from_secs_f64(timeout_s.min(3600.0))
        } else {
            Duration::ZERO
        };
        if wait.is_zero() {
            return self.query_prefetch(to, rid, now);
        }
        if let Err(to) = self.jobs.park(rid, to, now + wait) {
            self.query_prefetch(to, rid, now);
        }
    }

    pub(super) fn free_lookup_locks(&mut self, key: &IpcKey, now: Instant) {
        if key.start >= key.end {
            return;
        }
        let rid = key.request_id.clone();
        let hit = match self.sessions.get_mut(&rid).map(|s| s.prefetch_hit_chunks) {
            Some(h) if h >= 0 => h,
            _ => {
                match self.jobs.get(&rid) {
                    Some(Job::Done { hit_chunks }) => {
                        let h = *hit_chunks;
                        self.jobs.remove(&rid);
                        h
                    }
                    Some(Job::Pending { .. }) => {
                        log_limited!(Level::Warn, "free_lookup_locks for {rid} while its lookup is running; its locks expire by TTL");
                        return;
                    }
                    None => {
                        log_limited!(Level::Warn, "free_lookup_locks for {rid} without a lookup result; nothing to release");
                        return;
                    }
                }
            }
        };
        let readers = match u32::try_from(key.num_kv_readers) {
            Ok(r) if r >= 1 => r,
            _ => {
                log_limited!(
                    Level::Error,
                    "free_lookup_locks {rid}: num_kv_readers={} is invalid",
                    key.num_kv_readers
                );
                return;
            }
        };
        let cs = self.cfg.chunk_size as i64;
        let (start_chunk, end_chunk) = (key.start / cs, key.end / cs);
        let hi = end_chunk.min(hit);
        if start_chunk >= hi || key.start < 0 {
            return;
        }
        let ranks = match Self::ranks_of(key) {
            Ok(r) => r,
            Err(e) => return log_limited!(Level::Error, "free_lookup_locks {rid}: {e}"),
        };
        let mut range_key = key.clone();
        range_key.end = hi * cs;
        let groups = self.object_group_count(&key.model_name, ranks.world_size);
        let hashes = match self.key_hashes(&range_key, false, ranks.len() * groups as usize, now) {
            Ok(h) => h,
            Err(e) => return log_limited!(Level::Error, "free_lookup_locks {rid}: {e}"),
        };
        let (model, salt) = match Self::key_names(&key.model_name, &key.cache_salt) {
            Ok(n) => n,
            Err(e) => return log_limited!(Level::Error, "free_lookup_locks {rid}: {e}"),
        };
        let objs = Self::object_keys_of_groups(model, salt, &hashes, ranks, groups);
        let (first, nr) = (start_chunk as usize, ranks.len() * groups as usize);
        let chunks = objs.iter().enumerate().map(|(i, k)| (first + i / nr, k));
        // Only what the lookup still holds: a repeated call, or one after the
        // locks expired or a forced clear, must not take away another
        // request's locks on the same objects.
        let held = self.leases.released(&rid, chunks, readers, None);
        let asked = objs.len() as u64 * u64::from(clamped(readers));
        let freed: u64 = held.iter().map(|(_, n)| u64::from(*n)).sum();
        if freed < asked {
            self.metrics.unheld_lock_releases += asked - freed;
            log_limited!(
                Level::Warn,
                "free_lookup_locks {rid}: {} of the {asked} read locks asked for are no longer held by \
                 its lookup (released already, expired or cleared); only the rest are released",
                asked - freed
            );
        }
        let mut by_count: Vec<(u32, Vec<ObjectKey>)> = Vec::new();
        for (key, n) in held {
            match by_count.iter_mut().find(|(c, _)| *c == n) {
                Some((_, keys)) => keys.push(key),
                None => by_count.push((n, vec![key])),
            }
        }
        for (count, keys) in by_count {
            self.post(keys, |keys| ShardOp::Release { keys, count });
        }
    }

    pub(super) fn end_session(&mut self, rid: &str) {
        // The request is over: its waiters get what a timed-out wait gets.
        for Waiter { to, .. } in self.jobs.take_waiters(rid) {
            self.reply(&to, None);
        }
        let Some(s) = self.sessions.remove(rid) else {
            log::debug!("end_session: session {rid} not found");
            return;
        };
        let Some(scope) = s.lookup.as_ref() else {
            return;
        };
        let ranks = Ranks::of(scope.world_size, scope.worker_id);
        let (model, salt) = match Self::key_names(&scope.model_name, &scope.cache_salt) {
            Ok(n) => n,
            Err(e) => return log_limited!(Level::Error, "end_session {rid}: {e}"),
        };
        let groups = self.object_group_count(&scope.model_name, scope.world_size);
        let objs = Self::object_keys_of_groups(model, salt, s.all_hashes(), ranks, groups);
        self.post(objs, |keys| ShardOp::Touch { keys });
    }

    /// A lookup's first phase came back from its shards.
    pub(super) fn lookup_answered(&mut self, seq: Seq, lookup: PendingLoad) {
        if let Some((waiters, hits)) = self.finish_lookup(seq, lookup) {
            self.answer_waiters(waiters, hits);
        }
    }

    /// A lookup's L2 loads came back from their shards.
    pub(super) fn load_answered(
        &mut self,
        load: PendingLoad,
        loading: &[usize],
        loaded: &[bool],
        slabs: &[u64],
    ) {
        if let Some((waiters, hits)) = self.finish_load(load, loading, loaded, slabs) {
            self.answer_waiters(waiters, hits);
        }
    }
}

/// Why a request's key addresses no object.
#[derive(Debug)]
pub(super) enum KeyError {
    WorldSize(i64),
    WorkerId {
        worker: i64,
        world_size: u32,
    },
    NegativeStart(i64),
    NegativeEnd(i64),
    /// More than [`MAX_OBJECTS_PER_REQUEST`] objects (chunks times kv ranks).
    TooManyObjects {
        start: usize,
        end: usize,
        ranks: usize,
        objects: usize,
    },
    Name {
        field: &'static str,
        source: NameError,
    },
    /// The range does not fit the request's tokens.
    Tokens(HashError),
    /// A worker's transfer key without the worker it is for.
    NoWorker,
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::WorldSize(ws) => {
                write!(f, "world_size {ws} outside 1..={}", keys::MAX_WORLD_SIZE)
            }
            KeyError::WorkerId { worker, world_size } => {
                write!(f, "worker_id {worker} outside world_size {world_size}")
            }
            KeyError::NegativeStart(s) => write!(f, "negative start {s}"),
            KeyError::NegativeEnd(e) => write!(f, "negative end {e}"),
            KeyError::TooManyObjects {
                start,
                end,
                ranks,
                objects,
            } => write!(
                f,
                "[{start}, {end}) x {ranks} kv ranks addresses {objects} objects, more than the \
                 {MAX_OBJECTS_PER_REQUEST} one request may"
            ),
            KeyError::Name { field, source } => write!(f, "{field}: {source}"),
            KeyError::Tokens(e) => e.fmt(f),
            KeyError::NoWorker => f.write_str("key has no worker_id"),
        }
    }
}

impl std::error::Error for KeyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KeyError::Name { source, .. } => Some(source),
            KeyError::Tokens(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per-key presence of `chunks` chunks of two object groups of one rank
    /// each: `full[c]` and `window[c]`.
    fn keys_of(full: &[bool], window: &[bool]) -> Vec<bool> {
        full.iter()
            .zip(window)
            .flat_map(|(a, b)| [*a, *b])
            .collect()
    }

    #[test]
    fn full_attention_alone_is_the_leading_run() {
        let present = [true, true, false, true];
        assert_eq!(hit_prefix(&present, 1, &[-1], |b| *b), 2);
        // Two ranks: a chunk counts only with both.
        let ranks = [true, true, true, false, true, true];
        assert_eq!(hit_prefix(&ranks, 2, &[-1], |b| *b), 1);
        assert_eq!(hit_prefix::<bool>(&[], 1, &[-1], |b| *b), 0);
    }

    #[test]
    fn a_window_needs_only_the_last_chunks_of_the_hit() {
        let t = true;
        let f = false;
        // Window of 2 chunks: chunks 0 and 3 of it missing; 3 chunks need its
        // chunks 1 and 2 only.
        let k = keys_of(&[t, t, t, t], &[f, t, t, f]);
        assert_eq!(hit_prefix(&k, 1, &[-1, 2], |b| *b), 3);
        // Its only chunk that a hit of 4 or 2 would need missing too: 0.
        let k = keys_of(&[t, t, t, t], &[f, f, t, f]);
        assert_eq!(hit_prefix(&k, 1, &[-1, 2], |b| *b), 0);
        // The full group's gap bounds the hit whatever the window holds.
        let k = keys_of(&[t, t, f, t], &[t, t, t, t]);
        assert_eq!(hit_prefix(&k, 1, &[-1, 2], |b| *b), 2);
        // Windows only: the highest servable length, past a gap.
        let k = keys_of(&[t, f, t, t], &[t, f, t, t]);
        assert_eq!(hit_prefix(&k, 1, &[1, 2], |b| *b), 4);
    }

    #[test]
    fn window_start_is_where_a_group_starts_needing_chunks() {
        assert_eq!(window_start(-1, 5), 0);
        assert_eq!(window_start(2, 5), 3);
        assert_eq!(window_start(8, 5), 0);
        assert_eq!(window_start(1, 0), 0);
    }
}
