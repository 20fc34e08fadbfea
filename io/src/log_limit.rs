//! Rate-limited log lines, for what a client can trigger once per request.
//!
//! A malformed frame or a request from an unknown instance is worth a log line,
//! but a client that sends 80,000 of them must not write 80,000 lines. Each call
//! site of [`log_limited!`](crate::log_limited) may log [`BURST`] lines per
//! [`WINDOW`]; the rest are counted, and the count is reported on the site's next
//! logged line or by [`flush`], which long-lived threads call from their timers.
//! The counters the lines go with (`/metrics`) stay exact: only the log is cut.
//!
//! State is per thread (the front, each shard), so no lock is taken.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Length of one rate-limiting window per call site.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Lines one call site may log per window.
pub const BURST: u32 = 5;

struct Site {
    /// The calling module, the log target of the site's lines.
    target: &'static str,
    level: log::Level,
    window_start: Instant,
    logged: u32,
    suppressed: u64,
}

/// A rate-limited site: the call site (`file:line`) and a key that splits
/// it (`""` for the whole call site).
type SiteKey = (&'static str, &'static str);

thread_local! {
    static SITES: RefCell<HashMap<SiteKey, Site>> = RefCell::new(HashMap::new());
}

/// Whether call site `site`, for `key`, may log a line at `now`: `Some(n)`
/// with the number of its lines suppressed since it last logged (to report
/// with this one), `None` to suppress this line.
pub fn admit(
    site: &'static str,
    key: &'static str,
    target: &'static str,
    level: log::Level,
    now: Instant,
) -> Option<u64> {
    SITES.with(|sites| {
        let mut sites = sites.borrow_mut();
        let s = sites.entry((site, key)).or_insert(Site {
            target,
            level,
            window_start: now,
            logged: 0,
            suppressed: 0,
        });
        if now.duration_since(s.window_start) >= WINDOW {
            s.window_start = now;
            s.logged = 0;
        }
        if s.logged < BURST {
            s.logged += 1;
            Some(std::mem::take(&mut s.suppressed))
        } else {
            s.suppressed += 1;
            None
        }
    })
}

/// Logs, for every call site of this thread whose window has ended with lines
/// suppressed, how many were; returns the number of such sites. Sites quiet for a
/// whole window are forgotten.
pub fn flush(now: Instant) -> usize {
    SITES.with(|sites| {
        let mut reported = 0;
        sites.borrow_mut().retain(|&(site, key), s| {
            if now.duration_since(s.window_start) < WINDOW {
                return true;
            }
            if s.suppressed > 0 {
                log::log!(
                    target: s.target,
                    s.level,
                    "{} more lines from {site}{}{key} were not logged in the last {} s (rate limit {BURST} per {} s)",
                    s.suppressed,
                    if key.is_empty() { "" } else { " " },
                    now.duration_since(s.window_start).as_secs(),
                    WINDOW.as_secs()
                );
                reported += 1;
            }
            false
        });
        reported
    })
}

/// `log::log!` for lines a client can cause per request: at most
/// [`BURST`](crate::log_limit::BURST) lines per call site per
/// [`WINDOW`](crate::log_limit::WINDOW) on this thread; a logged line after
/// suppressed ones says how many were suppressed.
///
/// `per KEY;` first gives each `&'static str` key its own budget at the one
/// call site (an adapter's operations, so that a storm of one cannot hide
/// the others).
///
/// ```
/// kvshard_io::log_limited!(log::Level::Warn, "bad frame from client {}", 7);
/// let op = "store";
/// kvshard_io::log_limited!(per op; log::Level::Warn, "{op} failed");
/// ```
#[macro_export]
macro_rules! log_limited {
    (per $key:expr; $level:expr, $($arg:tt)+) => {{
        const SITE: &str = concat!(file!(), ":", line!());
        let level: $crate::log_limit::Level = $level;
        let target = module_path!();
        if $crate::log_limit::enabled(level) {
            if let Some(skipped) =
                $crate::log_limit::admit(SITE, $key, target, level, ::std::time::Instant::now())
            {
                if skipped == 0 {
                    $crate::log_limit::log_line(target, level, format_args!($($arg)+));
                } else {
                    $crate::log_limit::log_line(
                        target,
                        level,
                        format_args!("{} ({skipped} similar lines were not logged)", format_args!($($arg)+)),
                    );
                }
            }
        }
    }};
    ($level:expr, $($arg:tt)+) => {
        $crate::log_limited!(per ""; $level, $($arg)+)
    };
}

pub use log::Level;

/// Whether `level` is logged at all (so disabled levels cost no bookkeeping).
pub fn enabled(level: Level) -> bool {
    level <= log::max_level()
}

/// Logs one line at `level` for module `target`; the macro's way to reach
/// the `log` crate.
pub fn log_line(target: &str, level: Level, args: std::fmt::Arguments<'_>) {
    log::log!(target: target, level, "{args}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_suppress_then_report() {
        let site = "test:burst";
        let t0 = Instant::now();
        for i in 0..BURST {
            assert_eq!(
                admit(site, "", "t", Level::Warn, t0),
                Some(0),
                "line {i} is logged"
            );
        }
        for _ in 0..1000 {
            assert_eq!(admit(site, "", "t", Level::Warn, t0), None);
        }
        // Still inside the window: suppressed.
        assert_eq!(admit(site, "", "t", Level::Warn, t0 + WINDOW / 2), None);
        // A new window: the first line carries the count.
        assert_eq!(admit(site, "", "t", Level::Warn, t0 + WINDOW), Some(1001));
        assert_eq!(admit(site, "", "t", Level::Warn, t0 + WINDOW), Some(0));
    }

    #[test]
    fn sites_are_independent_and_flush_reports_and_forgets() {
        let (a, b) = ("test:a", "test:b");
        let t0 = Instant::now();
        for _ in 0..BURST + 3 {
            admit(a, "", "t", Level::Warn, t0);
        }
        assert_eq!(admit(b, "", "t", Level::Warn, t0), Some(0));
        assert_eq!(flush(t0), 0, "windows not over yet");
        assert_eq!(flush(t0 + WINDOW), 1, "only a has suppressed lines");
        // Both were forgotten: a starts over with no count to report.
        assert_eq!(admit(a, "", "t", Level::Warn, t0 + WINDOW), Some(0));
    }

    #[test]
    fn keys_split_a_site_into_budgets_of_their_own() {
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert!(admit("test:keyed", "put", "t", Level::Warn, t0).is_some());
        }
        assert_eq!(admit("test:keyed", "put", "t", Level::Warn, t0), None);
        assert_eq!(admit("test:keyed", "head", "t", Level::Warn, t0), Some(0));
    }

    #[test]
    fn macro_compiles_and_runs() {
        for i in 0..20 {
            crate::log_limited!(Level::Debug, "line {i}");
        }
    }
}
