//! What an L2 tier's recent outcomes say of its health, and the gate that
//! stops sending requests to a tier that does not answer.
//!
//! - [`Failures`]: per operation, the failure its latest outcome was (with
//!   the cause and how often since the last success). An operation whose
//!   latest outcome was a success is not listed. Adapters keep one for the
//!   errors they see (a full disk, a refused credential); the tier keeps one
//!   for what it sees itself (a lookup that ran past its deadline).
//! - [`Gate`]: consecutive requests that did not answer in time (a lookup
//!   past `--l2-prefetch-load-timeout`, a probe that fails). At
//!   [`Gate::THRESHOLD`] it closes the tier: lookups miss at once, stores and
//!   loads skip it, and nothing more piles up on a hung disk or endpoint.
//!   While closed, the shard probes the tier every second (one probe at a
//!   time); the first answer opens it again, so recovery follows the tier's
//!   return by at most a second, whatever happened before.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The L2 operations whose failures are told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum L2Op {
    Store,
    Lookup,
    Load,
    Delete,
    List,
    Probe,
}

impl L2Op {
    pub fn name(self) -> &'static str {
        match self {
            L2Op::Store => "store",
            L2Op::Lookup => "lookup",
            L2Op::Load => "load",
            L2Op::Delete => "delete",
            L2Op::List => "list",
            L2Op::Probe => "probe",
        }
    }
}

/// The failure an operation's latest outcome was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub op: L2Op,
    /// The latest failure's cause, worded for an operator.
    pub cause: String,
    /// Failures since the operation last succeeded.
    pub count: u64,
    /// The first of them.
    pub since: Instant,
}

/// Per operation, the failure its latest outcome was.
#[derive(Debug, Default)]
pub struct Failures {
    failing: RefCell<BTreeMap<L2Op, Failure>>,
}

impl Failures {
    /// `n` objects (or requests) of `op` failed; `cause` says why.
    pub fn failed(&self, op: L2Op, n: u64, cause: impl FnOnce() -> String, now: Instant) {
        if n == 0 {
            return;
        }
        let cause = cause();
        let mut f = self.failing.borrow_mut();
        match f.get_mut(&op) {
            Some(e) => {
                e.count += n;
                e.cause = cause;
            }
            None => {
                f.insert(
                    op,
                    Failure {
                        op,
                        cause,
                        count: n,
                        since: now,
                    },
                );
            }
        }
    }

    /// `op` succeeded: its failures are over.
    pub fn succeeded(&self, op: L2Op) {
        if !self.failing.borrow().is_empty() {
            self.failing.borrow_mut().remove(&op);
        }
    }

    /// The operations whose latest outcome was a failure.
    pub fn current(&self) -> Vec<Failure> {
        self.failing.borrow().values().cloned().collect()
    }
}

/// Whether requests may use a tier; see the module doc.
#[derive(Debug, Default)]
pub struct Gate {
    /// Per operation, requests in a row that did not answer in time (a
    /// tier whose lookups answer from what it knows while its loads hang is
    /// hung all the same).
    consecutive: RefCell<BTreeMap<L2Op, u32>>,
    /// Since when the tier is closed to requests.
    closed_since: Cell<Option<Instant>>,
    /// A probe is running.
    probing: Cell<bool>,
    /// Times the gate closed.
    trips: Cell<u64>,
    /// Requests that did not answer in time, ever.
    timeouts: Cell<u64>,
}

/// What the gate says for `/status`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateStatus {
    pub closed: bool,
    pub closed_for: Option<Duration>,
    pub consecutive_timeouts: u32,
    pub timeouts: u64,
    pub trips: u64,
}

impl Gate {
    /// Requests in a row without an answer in time that close the tier
    /// (lmcache's `max_connection_failures`).
    pub const THRESHOLD: u32 = 3;

    /// Whether requests may be sent to the tier.
    pub fn is_open(&self) -> bool {
        self.closed_since.get().is_none()
    }

    /// A request of `op` did not answer in time (it may still be running).
    /// Returns true when this closed the gate.
    pub fn timed_out(&self, op: L2Op, now: Instant) -> bool {
        self.timeouts.set(self.timeouts.get() + 1);
        let n = {
            let mut c = self.consecutive.borrow_mut();
            let n = c.entry(op).or_insert(0);
            *n += 1;
            *n
        };
        if n >= Self::THRESHOLD && self.closed_since.get().is_none() {
            self.closed_since.set(Some(now));
            self.trips.set(self.trips.get() + 1);
            return true;
        }
        false
    }

    /// A request of `op` answered in time: its count starts over. A closed
    /// gate opens only through a probe.
    pub fn answered(&self, op: L2Op) {
        if self.is_open() {
            self.consecutive.borrow_mut().remove(&op);
        }
    }

    /// Starts a probe if the gate is closed and none is running; the caller
    /// runs it and reports with [`Gate::probed`].
    pub fn begin_probe(&self) -> bool {
        if self.is_open() || self.probing.get() {
            return false;
        }
        self.probing.set(true);
        true
    }

    /// The probe's outcome; returns how long the tier was closed when an
    /// answer opened it.
    pub fn probed(&self, answered: bool, now: Instant) -> Option<Duration> {
        self.probing.set(false);
        if !answered {
            return None;
        }
        let since = self.closed_since.take()?;
        self.consecutive.borrow_mut().clear();
        Some(now.saturating_duration_since(since))
    }

    pub fn status(&self, now: Instant) -> GateStatus {
        GateStatus {
            closed: !self.is_open(),
            closed_for: self
                .closed_since
                .get()
                .map(|s| now.saturating_duration_since(s)),
            consecutive_timeouts: self
                .consecutive
                .borrow()
                .values()
                .copied()
                .max()
                .unwrap_or(0),
            timeouts: self.timeouts.get(),
            trips: self.trips.get(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_outcome_of_each_operation_is_what_counts() {
        let f = Failures::default();
        let t0 = Instant::now();
        f.failed(L2Op::Store, 2, || "ENOSPC".into(), t0);
        f.failed(
            L2Op::Store,
            3,
            || "ENOSPC again".into(),
            t0 + Duration::from_secs(1),
        );
        f.failed(L2Op::Lookup, 0, || unreachable!("nothing failed"), t0);
        let now = f.current();
        assert_eq!(now.len(), 1);
        assert_eq!((now[0].count, now[0].since), (5, t0));
        assert_eq!(now[0].cause, "ENOSPC again");
        f.succeeded(L2Op::Lookup);
        assert_eq!(
            f.current().len(),
            1,
            "another operation's success changes nothing"
        );
        f.succeeded(L2Op::Store);
        assert!(f.current().is_empty());
    }

    #[test]
    fn the_gate_closes_after_three_timeouts_and_opens_on_a_probe_answer() {
        let g = Gate::default();
        let t0 = Instant::now();
        assert!(!g.begin_probe(), "an open gate is not probed");
        assert!(!g.timed_out(L2Op::Load, t0));
        g.answered(L2Op::Load);
        assert!(!g.timed_out(L2Op::Load, t0));
        assert!(!g.timed_out(L2Op::Load, t0));
        g.answered(L2Op::Lookup);
        assert!(
            g.timed_out(L2Op::Load, t0),
            "the third load in a row closes it, whatever lookups do"
        );
        assert!(!g.is_open());
        assert!(!g.timed_out(L2Op::Lookup, t0), "closes once");
        g.answered(L2Op::Load);
        assert!(!g.is_open(), "late answers do not open it");
        assert!(g.begin_probe());
        assert!(!g.begin_probe(), "one probe at a time");
        assert_eq!(g.probed(false, t0), None);
        assert!(!g.is_open());
        assert!(g.begin_probe());
        let s = Duration::from_secs(2);
        assert_eq!(g.probed(true, t0 + s), Some(s));
        assert!(g.is_open());
        let st = g.status(t0);
        assert_eq!((st.trips, st.timeouts, st.consecutive_timeouts), (1, 5, 0));
    }
}
