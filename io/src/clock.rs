//! Where time comes from: the system's monotonic clock in the server, one a
//! test moves by hand. The front and the shards read the time only through a
//! [`Clock`], so that a whole server can be run on a clock of its own.

use std::sync::Arc;
use std::time::Instant;

pub trait Clock {
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock a shard thread can be handed (the front's needs neither bound).
pub type SharedClock = Arc<dyn Clock + Send + Sync>;
