//! A small stderr logger: `LMCACHE_LOG_LEVEL` (as lmcache) or `KVSHARD_LOG`
//! chooses the level (error, warn, info, debug, trace; default info).

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

struct StderrLogger {
    level: log::LevelFilter,
}

impl log::Log for StderrLogger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= self.level
    }

    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("-");
        let line = format!(
            "[{}.{:03}] {:<5} {} ({name}): {}\n",
            t.as_secs(),
            t.subsec_millis(),
            r.level(),
            r.target(),
            r.args()
        );
        // One write per line so lines from different threads do not interleave.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

pub fn init() {
    let level = std::env::var("KVSHARD_LOG")
        .or_else(|_| std::env::var("LMCACHE_LOG_LEVEL"))
        .ok()
        .and_then(|v| match v.to_ascii_lowercase().as_str() {
            "error" => Some(log::LevelFilter::Error),
            "warn" | "warning" => Some(log::LevelFilter::Warn),
            "info" => Some(log::LevelFilter::Info),
            "debug" => Some(log::LevelFilter::Debug),
            "trace" => Some(log::LevelFilter::Trace),
            "off" => Some(log::LevelFilter::Off),
            _ => None,
        })
        .unwrap_or(log::LevelFilter::Info);
    let logger = Box::leak(Box::new(StderrLogger { level }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}
