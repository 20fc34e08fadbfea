//! Retry policy: decorrelated-jitter backoff, a per-client retry budget, and
//! the injectable clock the breaker and the budget use.
//!
//! Backoff (the "decorrelated jitter" of the AWS architecture blog):
//! `sleep = min(cap, uniform(base, 3 * previous_sleep))`, starting from
//! `previous_sleep = base`. Spreads retries of many clients apart while
//! still growing roughly geometrically.
//!
//! Budget: a token bucket per client. A retry takes [`RetryConfig::retry_cost`]
//! tokens ([`RetryConfig::timeout_retry_cost`] after a timeout); every
//! successful attempt puts [`RetryConfig::success_refill`] back, up to the
//! capacity. When an outage empties the bucket, failures are returned at
//! once instead of multiplying the load on a sick server; as requests start
//! succeeding again the bucket refills. (The AWS SDKs' standard retry mode
//! uses the same numbers: 500 tokens, 5 per retry, 10 per timeout retry.)

use std::cell::Cell;
use std::fmt;
use std::time::{Duration, Instant, SystemTime};

/// A source of monotonic time. Tests inject [`ManualClock`].
pub trait Clock: Send + Sync {
    /// Now.
    fn now(&self) -> Instant;

    /// Wall-clock time: request signing dates and S3 Express session
    /// expiries. Default the system's.
    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// The real monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to (both its monotonic and its wall
/// time).
#[derive(Debug)]
pub struct ManualClock {
    base: Instant,
    base_wall: SystemTime,
    offset_nanos: std::sync::atomic::AtomicU64,
}

impl ManualClock {
    /// A clock standing at the moment of creation.
    pub fn new() -> ManualClock {
        ManualClock {
            base: Instant::now(),
            base_wall: SystemTime::now(),
            offset_nanos: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn offset(&self) -> Duration {
        Duration::from_nanos(self.offset_nanos.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).expect("advance fits in u64 nanoseconds");
        self.offset_nanos
            .fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + self.offset()
    }

    fn wall(&self) -> SystemTime {
        self.base_wall + self.offset()
    }
}

/// Retry settings. Every default is documented on its field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    /// HTTP requests per operation (or per part), first one included.
    /// Default 3; 1 disables retries.
    pub max_attempts: u32,
    /// Backoff floor and first sleep. Default 50 ms.
    pub base_delay: Duration,
    /// Longest single sleep. Default 5 s.
    pub max_delay: Duration,
    /// Token bucket capacity (and initial fill). Default 500.
    pub budget_tokens: u32,
    /// Tokens a retry takes. Default 5.
    pub retry_cost: u32,
    /// Tokens a retry after a timeout takes. Default 10.
    pub timeout_retry_cost: u32,
    /// Tokens a successful attempt returns. Default 1.
    pub success_refill: u32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 3,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(5),
            budget_tokens: 500,
            retry_cost: 5,
            timeout_retry_cost: 10,
            success_refill: 1,
        }
    }
}

impl RetryConfig {
    /// Checks the settings; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_attempts == 0 {
            return Err("retry max_attempts must be at least 1".to_owned());
        }
        if self.base_delay.is_zero() || self.max_delay < self.base_delay {
            return Err(format!(
                "retry delays must satisfy 0 < base_delay ({:?}) <= max_delay ({:?})",
                self.base_delay, self.max_delay
            ));
        }
        Ok(())
    }
}

/// A small xorshift64* generator; jitter needs spread, not secrecy.
#[derive(Debug, Clone)]
pub struct Jitter(u64);

impl Jitter {
    /// Seeded from the wall clock and a per-call address, so shards and
    /// processes started together do not retry in lockstep.
    pub fn from_entropy() -> Jitter {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let local = 0u8;
        let addr = &local as *const u8 as u64;
        Jitter::seeded(nanos ^ addr.rotate_left(32) ^ u64::from(std::process::id()))
    }

    /// A fixed seed (tests).
    pub fn seeded(seed: u64) -> Jitter {
        Jitter(seed | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[low, high]` (nanosecond resolution).
    pub fn between(&mut self, low: Duration, high: Duration) -> Duration {
        if high <= low {
            return low;
        }
        let span = (high - low).as_nanos() as u64;
        low + Duration::from_nanos(self.next_u64() % (span + 1))
    }
}

/// Decorrelated-jitter backoff for one operation.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    previous: Duration,
}

impl Backoff {
    /// A fresh sequence.
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap,
            previous: base,
        }
    }

    /// The next sleep.
    pub fn next_delay(&mut self, jitter: &mut Jitter) -> Duration {
        let high = self.previous.saturating_mul(3).min(self.cap);
        let delay = jitter.between(self.base, high).min(self.cap);
        self.previous = delay.max(self.base);
        delay
    }
}

/// The per-client retry token bucket.
pub struct RetryBudget {
    capacity: u32,
    tokens: Cell<u32>,
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("capacity", &self.capacity)
            .field("tokens", &self.tokens.get())
            .finish()
    }
}

impl RetryBudget {
    /// A full bucket.
    pub fn new(capacity: u32) -> RetryBudget {
        RetryBudget {
            capacity,
            tokens: Cell::new(capacity),
        }
    }

    /// Takes `cost` tokens; false (and nothing taken) when there are fewer.
    pub fn try_withdraw(&self, cost: u32) -> bool {
        let have = self.tokens.get();
        if have < cost {
            return false;
        }
        self.tokens.set(have - cost);
        true
    }

    /// Returns `amount` tokens, up to the capacity.
    pub fn deposit(&self, amount: u32) {
        let have = self.tokens.get();
        self.tokens
            .set(have.saturating_add(amount).min(self.capacity));
    }

    /// Tokens left.
    pub fn available(&self) -> u32 {
        self.tokens.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_between_base_and_cap_and_grows() {
        let base = Duration::from_millis(50);
        let cap = Duration::from_secs(5);
        let mut jitter = Jitter::seeded(42);
        let mut longest = Duration::ZERO;
        for _ in 0..200 {
            let mut b = Backoff::new(base, cap);
            for _ in 0..10 {
                let d = b.next_delay(&mut jitter);
                assert!(d >= base && d <= cap, "{d:?}");
                longest = longest.max(d);
            }
        }
        // After ten steps the sequence reaches seconds, not stays at base.
        assert!(longest > Duration::from_secs(1), "{longest:?}");
        // The first sleep is at most 3 * base.
        let mut b = Backoff::new(base, cap);
        assert!(b.next_delay(&mut jitter) <= base * 3);
    }

    #[test]
    fn budget_withdraws_until_empty_and_refills_to_capacity() {
        let budget = RetryBudget::new(12);
        assert!(budget.try_withdraw(5));
        assert!(budget.try_withdraw(5));
        assert!(!budget.try_withdraw(5), "2 tokens left");
        assert_eq!(budget.available(), 2);
        for _ in 0..100 {
            budget.deposit(1);
        }
        assert_eq!(budget.available(), 12);
    }

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new();
        let t0 = clock.now();
        assert_eq!(clock.now(), t0);
        clock.advance(Duration::from_secs(7));
        assert_eq!(clock.now() - t0, Duration::from_secs(7));
    }

    #[test]
    fn config_validation_names_the_problem() {
        assert!(RetryConfig::default().validate().is_ok());
        let zero = RetryConfig {
            max_attempts: 0,
            ..RetryConfig::default()
        };
        assert!(zero.validate().unwrap_err().contains("max_attempts"));
    }
}
