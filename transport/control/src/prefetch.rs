//! Prefetch jobs: per request_id, the state of its last lookup as
//! `query_prefetch_status` / `wait_prefetch_status` see it, and the callers
//! parked on a running one.
//!
//! Parked callers are also indexed by deadline, so the front finds the next
//! deadline and the expired callers without walking the jobs.
//!
//! A lookup is acked as soon as its shards have it, and runs in two phases:
//! the shards' L1 reservation and L2 existence check, then (for L2 hits) the
//! loads into L1. A `query_prefetch_status` that arrives during the first
//! phase is held until that phase ends (see [`PrefetchJobs::hold`]), so the
//! client's first poll after the ack finds an L1 result instead of "running".

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use kvshard_dataplane::messages::{ReplyTo, Seq};

/// A caller parked on a pending job: a `wait_prefetch_status`, or a
/// `query_prefetch_status` held through the lookup's first phase.
pub struct Waiter {
    pub to: ReplyTo,
    pub deadline: Instant,
    /// Key of the waiter in `PrefetchJobs::deadlines` with `deadline`.
    id: u64,
    /// Held only until the lookup's first phase ends ([`PrefetchJobs::hold`]).
    first_phase: bool,
}

/// A lookup's result as `query_prefetch_status` sees it.
pub enum Job {
    /// Running; `seq` is the lookup's sequence number. Waiters in arrival
    /// order (the first gets the result).
    Pending {
        seq: Seq,
        waiters: Vec<Waiter>,
        /// The first phase is over and L2 hits are loading into L1.
        loading: bool,
    },
    Done {
        hit_chunks: i64,
    },
}

#[derive(Default)]
pub struct PrefetchJobs {
    jobs: HashMap<String, Job>,
    /// Every parked waiter by (deadline, id), with the request it waits on.
    deadlines: BTreeMap<(Instant, u64), String>,
    next_waiter: u64,
}

impl PrefetchJobs {
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Callers parked on pending jobs.
    pub fn num_waiters(&self) -> usize {
        self.deadlines.len()
    }

    pub fn get(&self, rid: &str) -> Option<&Job> {
        self.jobs.get(rid)
    }

    /// Whether `rid`'s job is the pending lookup `seq`.
    pub fn is_current(&self, rid: &str, seq: Seq) -> bool {
        matches!(self.jobs.get(rid), Some(Job::Pending { seq: s, .. }) if *s == seq)
    }

    /// Sets the job of `rid` to a new pending lookup. Callers waiting on a
    /// pending job it replaces keep waiting on the new one (they asked about
    /// the request, not the lookup).
    pub fn start(&mut self, rid: String, seq: Seq) {
        let waiters = match self.jobs.remove(&rid) {
            Some(Job::Pending { waiters, .. }) => waiters,
            _ => Vec::new(),
        };
        self.jobs.insert(
            rid,
            Job::Pending {
                seq,
                waiters,
                loading: false,
            },
        );
    }

    /// Sets the job of `rid` to a result. Returns the waiters of the pending
    /// job it replaces, if any: the caller answers them.
    pub fn finish(&mut self, rid: String, hit_chunks: i64) -> Vec<Waiter> {
        let old = self.take_waiters(&rid);
        self.jobs.insert(rid, Job::Done { hit_chunks });
        old
    }

    /// Removes the job of `rid`; a pending job's waiters are returned.
    pub fn remove(&mut self, rid: &str) -> Option<Job> {
        let job = self.jobs.remove(rid)?;
        if let Job::Pending { waiters, .. } = &job {
            self.unindex(waiters);
        }
        Some(job)
    }

    /// Removes the job of `rid` and returns its waiters (none unless pending).
    pub fn take_waiters(&mut self, rid: &str) -> Vec<Waiter> {
        match self.remove(rid) {
            Some(Job::Pending { waiters, .. }) => waiters,
            _ => Vec::new(),
        }
    }

    /// Parks `to` on the pending job of `rid` until `deadline`; gives `to` back
    /// if `rid` has no pending job.
    pub fn park(&mut self, rid: &str, to: ReplyTo, deadline: Instant) -> Result<(), ReplyTo> {
        self.add_waiter(rid, to, deadline, false)
    }

    /// Holds `to` on the pending job of `rid` until its first phase ends (the
    /// job concludes, or [`PrefetchJobs::begin_load`] hands it back) or until
    /// `deadline`. Gives `to` back if `rid` has no job in its first phase.
    pub fn hold(&mut self, rid: &str, to: ReplyTo, deadline: Instant) -> Result<(), ReplyTo> {
        self.add_waiter(rid, to, deadline, true)
    }

    /// Marks the pending job of `rid` as loading (its first phase is over) and
    /// returns the callers [`PrefetchJobs::hold`] held; the caller answers them.
    pub fn begin_load(&mut self, rid: &str) -> Vec<ReplyTo> {
        let Some(Job::Pending {
            waiters, loading, ..
        }) = self.jobs.get_mut(rid)
        else {
            return Vec::new();
        };
        *loading = true;
        let (held, parked): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(waiters)
            .into_iter()
            .partition(|w| w.first_phase);
        *waiters = parked;
        self.unindex(&held);
        held.into_iter().map(|w| w.to).collect()
    }

    fn add_waiter(
        &mut self,
        rid: &str,
        to: ReplyTo,
        deadline: Instant,
        first_phase: bool,
    ) -> Result<(), ReplyTo> {
        match self.jobs.get_mut(rid) {
            Some(Job::Pending {
                waiters, loading, ..
            }) if !(first_phase && *loading) => {
                let id = self.next_waiter;
                self.next_waiter += 1;
                self.deadlines.insert((deadline, id), rid.to_owned());
                waiters.push(Waiter {
                    to,
                    deadline,
                    id,
                    first_phase,
                });
                Ok(())
            }
            _ => Err(to),
        }
    }

    /// The earliest deadline of a parked waiter.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.keys().next().map(|(d, _)| *d)
    }

    /// Takes out the waiters whose deadline is at or before `now`, earliest
    /// first. Their jobs stay.
    pub fn expire_waiters(&mut self, now: Instant) -> Vec<ReplyTo> {
        let mut out = Vec::new();
        while let Some(entry) = self.deadlines.first_entry() {
            let (deadline, id) = *entry.key();
            if deadline > now {
                break;
            }
            let rid = entry.remove();
            if let Some(Job::Pending { waiters, .. }) = self.jobs.get_mut(&rid) {
                if let Some(i) = waiters.iter().position(|w| w.id == id) {
                    out.push(waiters.remove(i).to);
                }
            }
        }
        out
    }

    /// Keeps pending jobs and the results `keep` accepts. Returns how many
    /// results were dropped.
    pub fn retain_done(&mut self, mut keep: impl FnMut(&str) -> bool) -> usize {
        let before = self.jobs.len();
        self.jobs
            .retain(|rid, j| matches!(j, Job::Pending { .. }) || keep(rid));
        before - self.jobs.len()
    }

    fn unindex(&mut self, waiters: &[Waiter]) {
        for w in waiters {
            self.deadlines.remove(&(w.deadline, w.id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn to(n: u8) -> ReplyTo {
        ReplyTo {
            identity: vec![n],
            uid: vec![n],
            op: Vec::new(),
        }
    }

    fn ids(v: &[ReplyTo]) -> Vec<u8> {
        v.iter().map(|t| t.identity[0]).collect()
    }

    #[test]
    fn waiters_expire_in_deadline_order_and_leave_with_their_job() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut j = PrefetchJobs::default();
        assert!(j.park("a", to(0), t0).is_err(), "no job: not parked");
        j.start("a".into(), 1);
        j.start("b".into(), 2);
        assert!(j.park("a", to(1), t0 + 3 * s).is_ok());
        assert!(j.park("b", to(2), t0 + s).is_ok());
        assert!(j.park("a", to(3), t0 + 2 * s).is_ok());
        assert!(j.park("b", to(4), t0 + 5 * s).is_ok());
        assert_eq!(j.num_waiters(), 4);
        assert_eq!(j.next_deadline(), Some(t0 + s));
        assert!(j.expire_waiters(t0).is_empty());
        assert_eq!(ids(&j.expire_waiters(t0 + 3 * s)), vec![2, 3, 1]);
        assert_eq!(j.num_waiters(), 1);
        assert_eq!(j.next_deadline(), Some(t0 + 5 * s));
        // A new lookup of "b" keeps its waiter; its result hands it out.
        j.start("b".into(), 7);
        assert!(j.is_current("b", 7) && !j.is_current("b", 2));
        let w = j.finish("b".into(), 9);
        assert_eq!(
            w.iter().map(|w| w.to.identity[0]).collect::<Vec<_>>(),
            vec![4]
        );
        assert_eq!(j.num_waiters(), 0);
        assert_eq!(j.next_deadline(), None);
        assert!(matches!(j.get("b"), Some(Job::Done { hit_chunks: 9 })));
        assert!(j.park("b", to(5), t0).is_err(), "done: not parked");
        // Removing a pending job unparks its waiters.
        assert!(j.park("a", to(6), t0 + s).is_ok());
        assert_eq!(j.take_waiters("a").len(), 1);
        assert_eq!(j.num_waiters(), 0);
        assert!(j.expire_waiters(t0 + 10 * s).is_empty());
        j.start("c".into(), 8);
        assert_eq!(j.retain_done(|_| false), 1);
        assert_eq!(j.len(), 1);
    }

    #[test]
    fn a_held_query_leaves_when_the_first_phase_ends() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut j = PrefetchJobs::default();
        assert!(j.hold("a", to(0), t0 + s).is_err(), "no job: not held");
        j.start("a".into(), 1);
        assert!(j.hold("a", to(1), t0 + s).is_ok());
        assert!(j.park("a", to(2), t0 + 2 * s).is_ok());
        assert!(j.hold("a", to(3), t0 + 3 * s).is_ok());
        assert_eq!(j.num_waiters(), 3);
        // L2 hits start loading: the held queries go, the parked wait stays.
        assert_eq!(ids(&j.begin_load("a")), vec![1, 3]);
        assert_eq!(j.num_waiters(), 1);
        assert_eq!(j.next_deadline(), Some(t0 + 2 * s));
        assert!(j.hold("a", to(4), t0 + s).is_err(), "loading: not held");
        assert!(j.park("a", to(5), t0 + s).is_ok(), "loading: still parked");
        assert!(j.begin_load("a").is_empty());
        // A new lookup of the request is in its first phase again.
        j.start("a".into(), 2);
        assert!(j.hold("a", to(6), t0 + s).is_ok());
        let w = j.finish("a".into(), 4);
        assert_eq!(
            w.iter().map(|w| w.to.identity[0]).collect::<Vec<_>>(),
            vec![2, 5, 6]
        );
        assert_eq!(j.num_waiters(), 0);
        assert!(j.begin_load("b").is_empty(), "no job: nothing held");
    }
}
