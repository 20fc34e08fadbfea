//! The circuit breaker of lmcache's newest S3 adapter (docs
//! `mp/l2_storage/s3.rst`, design "L2 Adapter Circuit Breaker Design").
//!
//! - It counts consecutive connection-level failures: refused, reset, name
//!   resolution, timeout. HTTP statuses (403, 404, 5xx) never move it.
//! - At [`BreakerConfig::failure_threshold`] (3) it opens: operations fail at
//!   once with [`crate::error::ErrorKind::Unavailable`] and send nothing.
//! - After the cooldown it re-arms (closed, count 0). Before that, a probe
//!   (`S3Client::probe`, which the adapter sends once a second while its tier
//!   does not answer) goes past it, and any answer closes it at once
//!   ([`Breaker::probe_answered`]); lmcache has no such probe. The cooldown starts at
//!   [`BreakerConfig::initial_cooldown`] (5 s) and doubles on each re-trip up
//!   to [`BreakerConfig::max_cooldown`] (300 s).
//! - Any success resets the count and the cooldown. Outcomes that arrive
//!   while it is open (requests sent before it opened) are ignored.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::retry::Clock;

/// Breaker settings.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive connection failures that open it. Default 3
    /// (lmcache `max_connection_failures`).
    pub failure_threshold: u32,
    /// First cooldown. Default 5 s (`s3_breaker_initial_cooldown_s`).
    pub initial_cooldown: Duration,
    /// Longest cooldown. Default 300 s (`s3_breaker_max_cooldown_s`).
    pub max_cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 3,
            initial_cooldown: Duration::from_secs(5),
            max_cooldown: Duration::from_secs(300),
        }
    }
}

impl BreakerConfig {
    /// Checks the settings; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.failure_threshold == 0 {
            return Err("breaker failure_threshold must be at least 1".to_owned());
        }
        if self.initial_cooldown.is_zero() || self.max_cooldown < self.initial_cooldown {
            return Err(format!(
                "breaker cooldowns must satisfy 0 < initial_cooldown ({:?}) <= max_cooldown ({:?})",
                self.initial_cooldown, self.max_cooldown
            ));
        }
        Ok(())
    }
}

/// What `/status` shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerStatus {
    /// Operations are failing fast.
    pub open: bool,
    /// Seconds until it re-arms (0 when closed).
    pub retry_in_seconds: f64,
    /// Consecutive connection failures counted so far (while closed).
    pub connection_failures: u32,
    /// Times it has opened since the client started.
    pub trips: u64,
    /// The cooldown the next trip will use.
    pub next_cooldown_seconds: f64,
}

struct State {
    consecutive_failures: u32,
    open_until: Option<Instant>,
    next_cooldown: Duration,
    trips: u64,
}

/// One client's breaker.
pub struct Breaker {
    config: BreakerConfig,
    /// Names the client in log lines (`s3`, `resp 127.0.0.1:6379`).
    label: String,
    clock: Arc<dyn Clock>,
    state: RefCell<State>,
}

impl fmt::Debug for Breaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Breaker")
            .field("config", &self.config)
            .field("status", &self.status())
            .finish()
    }
}

impl Breaker {
    /// A closed breaker of an S3 client.
    pub fn new(config: BreakerConfig, clock: Arc<dyn Clock>) -> Breaker {
        Breaker::labeled(config, clock, "s3")
    }

    /// A closed breaker whose log lines name the client `label`.
    pub fn labeled(config: BreakerConfig, clock: Arc<dyn Clock>, label: &str) -> Breaker {
        let next_cooldown = config.initial_cooldown;
        Breaker {
            label: label.to_owned(),
            config,
            clock,
            state: RefCell::new(State {
                consecutive_failures: 0,
                open_until: None,
                next_cooldown,
                trips: 0,
            }),
        }
    }

    /// `Ok` when requests may go out; `Err(time until it re-arms)` when open.
    /// Re-arms when the cooldown has passed.
    pub fn check(&self) -> Result<(), Duration> {
        let now = self.clock.now();
        let mut s = self.state.borrow_mut();
        match s.open_until {
            Some(until) if now < until => Err(until - now),
            Some(_) => {
                s.open_until = None;
                s.consecutive_failures = 0;
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn is_open(&self, s: &State) -> bool {
        matches!(s.open_until, Some(until) if self.clock.now() < until)
    }

    /// A request succeeded: count and cooldown start over.
    pub fn record_success(&self) {
        let mut s = self.state.borrow_mut();
        if self.is_open(&s) {
            return;
        }
        s.open_until = None;
        s.consecutive_failures = 0;
        s.next_cooldown = self.config.initial_cooldown;
    }

    /// A connection-level failure. Returns true when this failure opened
    /// the breaker.
    pub fn record_connection_failure(&self) -> bool {
        let now = self.clock.now();
        let mut s = self.state.borrow_mut();
        if self.is_open(&s) {
            return false;
        }
        if s.open_until.is_some() {
            // The cooldown passed but nobody checked yet: re-arm first.
            s.open_until = None;
            s.consecutive_failures = 0;
        }
        s.consecutive_failures += 1;
        if s.consecutive_failures < self.config.failure_threshold {
            return false;
        }
        let cooldown = s.next_cooldown;
        s.open_until = Some(now + cooldown);
        s.trips += 1;
        s.next_cooldown = cooldown.saturating_mul(2).min(self.config.max_cooldown);
        log::warn!(
            "{}: circuit breaker open after {} consecutive connection failures; retry in {:.1} s (trip {})",
            self.label,
            s.consecutive_failures,
            cooldown.as_secs_f64(),
            s.trips
        );
        true
    }

    /// The endpoint answered a probe sent past the breaker: it closes at
    /// once, whatever is left of the cooldown, and the cooldown starts over.
    /// Returns whether it was open.
    pub fn probe_answered(&self) -> bool {
        let was_open = {
            let s = self.state.borrow();
            self.is_open(&s)
        };
        let mut s = self.state.borrow_mut();
        s.open_until = None;
        s.consecutive_failures = 0;
        s.next_cooldown = self.config.initial_cooldown;
        if was_open {
            log::info!(
                "{}: circuit breaker closed: the endpoint answered a probe",
                self.label
            );
        }
        was_open
    }

    /// A snapshot for `/status`.
    pub fn status(&self) -> BreakerStatus {
        let now = self.clock.now();
        let s = self.state.borrow();
        let (open, retry_in) = match s.open_until {
            Some(until) if now < until => (true, until - now),
            _ => (false, Duration::ZERO),
        };
        BreakerStatus {
            open,
            retry_in_seconds: retry_in.as_secs_f64(),
            connection_failures: if open || s.open_until.is_none() {
                s.consecutive_failures
            } else {
                0
            },
            trips: s.trips,
            next_cooldown_seconds: s.next_cooldown.as_secs_f64(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::ManualClock;

    fn breaker() -> (Breaker, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new());
        let b = Breaker::new(BreakerConfig::default(), clock.clone());
        (b, clock)
    }

    #[test]
    fn opens_at_three_consecutive_failures_and_rearms_after_cooldown() {
        let (b, clock) = breaker();
        assert!(!b.record_connection_failure());
        assert!(!b.record_connection_failure());
        assert_eq!(b.status().connection_failures, 2);
        assert!(b.check().is_ok());
        assert!(b.record_connection_failure(), "third failure trips");
        let st = b.status();
        assert!(st.open);
        assert_eq!(st.trips, 1);
        assert!((st.retry_in_seconds - 5.0).abs() < 1e-9);
        assert_eq!(b.check(), Err(Duration::from_secs(5)));
        // Outcomes of requests already in flight are ignored while open.
        b.record_success();
        assert!(!b.record_connection_failure());
        assert!(b.status().open);
        clock.advance(Duration::from_millis(4999));
        assert!(b.check().is_err());
        clock.advance(Duration::from_millis(1));
        assert!(b.check().is_ok(), "re-armed after 5 s");
        let st = b.status();
        assert!(!st.open && st.connection_failures == 0 && st.retry_in_seconds == 0.0);
    }

    #[test]
    fn cooldown_doubles_per_retrip_up_to_the_cap_and_success_resets_it() {
        let (b, clock) = breaker();
        let mut expected = 5u64;
        for trip in 1..=10u64 {
            for _ in 0..3 {
                b.record_connection_failure();
            }
            let st = b.status();
            assert!(st.open);
            assert_eq!(st.trips, trip);
            assert!(
                (st.retry_in_seconds - expected as f64).abs() < 1e-9,
                "trip {trip}: {st:?}"
            );
            clock.advance(Duration::from_secs(expected));
            assert!(b.check().is_ok());
            expected = (expected * 2).min(300);
        }
        assert_eq!(expected, 300);
        b.record_success();
        for _ in 0..3 {
            b.record_connection_failure();
        }
        assert!((b.status().retry_in_seconds - 5.0).abs() < 1e-9);
    }

    #[test]
    fn a_success_between_failures_restarts_the_count() {
        let (b, _clock) = breaker();
        b.record_connection_failure();
        b.record_connection_failure();
        b.record_success();
        b.record_connection_failure();
        b.record_connection_failure();
        assert!(!b.status().open);
        assert!(b.record_connection_failure());
    }

    #[test]
    fn failure_after_unchecked_cooldown_counts_from_zero() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            b.record_connection_failure();
        }
        clock.advance(Duration::from_secs(6));
        assert!(!b.record_connection_failure());
        assert_eq!(b.status().connection_failures, 1);
    }
}
