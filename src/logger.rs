//! A small stderr logger: `LMCACHE_LOG_LEVEL` (as lmcache) or `KVSHARD_LOG`
//! chooses the level (error, warn, info, debug, trace; default info), and
//! `--log-format` (or `KVSHARD_LOG_FORMAT`) the line format:
//!
//! - `text`: `2026-11-26T03:44:14.123Z INFO  target (thread): message`
//! - `json`: `{"ts":"2026-11-26T03:44:14.123Z","level":"INFO","target":"...","thread":"...","msg":"..."}`
//!
//! Times are UTC with millisecond precision (RFC 3339), computed here from the
//! Unix time. Each line is one `write` to stderr, so lines from different
//! threads never interleave.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvshard_io::json_text::{push_string, NonAscii};

/// How each log line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `<RFC 3339 time> LEVEL target (thread): message`.
    Text,
    /// One JSON object per line: `ts`, `level`, `target`, `thread`, `msg`.
    Json,
}

struct StderrLogger {
    level: log::LevelFilter,
    format: LogFormat,
}

impl log::Log for StderrLogger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= self.level
    }

    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let thread = std::thread::current();
        let line = format_line(
            self.format,
            since_epoch,
            r.level(),
            r.target(),
            thread.name().unwrap_or("-"),
            r.args(),
        );
        // One write per line so lines from different threads do not interleave.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

/// One whole log line, newline included.
fn format_line(
    format: LogFormat,
    since_epoch: Duration,
    level: log::Level,
    target: &str,
    thread: &str,
    msg: &std::fmt::Arguments,
) -> String {
    let mut line = String::with_capacity(128);
    match format {
        LogFormat::Text => {
            write_rfc3339(&mut line, since_epoch);
            let _ = writeln!(line, " {level:<5} {target} ({thread}): {msg}");
        }
        LogFormat::Json => {
            line.push_str("{\"ts\":\"");
            write_rfc3339(&mut line, since_epoch);
            let _ = write!(line, "\",\"level\":\"{level}\",\"target\":");
            push_json_string(&mut line, target);
            line.push_str(",\"thread\":");
            push_json_string(&mut line, thread);
            line.push_str(",\"msg\":");
            // Formatted apart so the message can be escaped as a whole.
            push_json_string(&mut line, &msg.to_string());
            line.push_str("}\n");
        }
    }
    line
}

const SECONDS_PER_DAY: u64 = 86_400;
/// Days in 400 Gregorian years: the calendar repeats after them, from any start.
const DAYS_PER_400_YEARS: u64 = 146_097;

fn is_leap_year(year: u64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_year(year: u64) -> u64 {
    if is_leap_year(year) {
        366
    } else {
        365
    }
}

/// The civil (proleptic Gregorian) date `(year, month 1-12, day 1-31)` of the
/// day `days` after 1970-01-01.
fn civil_date(days: u64) -> (u64, u32, u32) {
    // Whole 400-year cycles first, so the year walk below is at most 399 steps
    // (about 56 today).
    let mut year = 1970 + 400 * (days / DAYS_PER_400_YEARS);
    let mut day_of_year = days % DAYS_PER_400_YEARS;
    while day_of_year >= days_in_year(year) {
        day_of_year -= days_in_year(year);
        year += 1;
    }
    let february = if is_leap_year(year) { 29 } else { 28 };
    let month_lengths = [31, february, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    let mut month = 1;
    for len in month_lengths {
        if day_of_year < len {
            break;
        }
        day_of_year -= len;
        month += 1;
    }
    assert!(
        (1..=12).contains(&month) && day_of_year < 31,
        "civil_date({days}): month {month}, day index {day_of_year}"
    );
    (year, month, day_of_year as u32 + 1)
}

/// Appends `since_epoch` as an RFC 3339 UTC time with milliseconds:
/// `YYYY-MM-DDTHH:MM:SS.mmmZ`.
fn write_rfc3339(out: &mut String, since_epoch: Duration) {
    let secs = since_epoch.as_secs();
    let (year, month, day) = civil_date(secs / SECONDS_PER_DAY);
    let of_day = secs % SECONDS_PER_DAY;
    let _ = write!(
        out,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60,
        since_epoch.subsec_millis()
    );
}

/// Appends `s` as a JSON string literal (RFC 8259): quotes, backslashes and
/// control characters escaped; everything else, non-ASCII included, kept as UTF-8.
fn push_json_string(out: &mut String, s: &str) {
    push_string(out, s, NonAscii::Keep);
}

pub fn init(format: LogFormat) {
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
    let logger = Box::leak(Box::new(StderrLogger { level, format }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rfc3339(secs: u64, millis: u32) -> String {
        let mut s = String::new();
        write_rfc3339(
            &mut s,
            Duration::from_secs(secs) + Duration::from_millis(millis.into()),
        );
        s
    }

    #[test]
    fn logger_rfc3339_known_instants() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(86_399, 999), "1970-01-01T23:59:59.999Z");
        assert_eq!(rfc3339(86_400, 0), "1970-01-02T00:00:00.000Z");
        // A leap day of a year divisible by 400, and the day after it.
        assert_eq!(rfc3339(951_782_400, 0), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(951_868_800, 0), "2000-03-01T00:00:00.000Z");
        // The last millisecond of a leap year, and the next one.
        assert_eq!(rfc3339(1_735_689_599, 999), "2024-12-31T23:59:59.999Z");
        assert_eq!(rfc3339(1_735_689_600, 0), "2025-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_709_164_800, 0), "2024-02-29T00:00:00.000Z");
        // 2100 is not a leap year: 28 February is followed by 1 March.
        assert_eq!(rfc3339(4_107_542_399, 0), "2100-02-28T23:59:59.000Z");
        assert_eq!(rfc3339(4_107_542_400, 0), "2100-03-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_664_654, 123), "2026-11-26T03:44:14.123Z");
        // Millisecond precision truncates, as the old `[secs.ms]` stamp did.
        let s = {
            let mut s = String::new();
            write_rfc3339(&mut s, Duration::new(0, 999_999_999));
            s
        };
        assert_eq!(s, "1970-01-01T00:00:00.999Z");
    }

    #[test]
    fn logger_leap_years() {
        for (year, leap) in [
            (1970, false),
            (1972, true),
            (1900, false),
            (2000, true),
            (2023, false),
            (2024, true),
            (2100, false),
            (2400, true),
        ] {
            assert_eq!(is_leap_year(year), leap, "{year}");
        }
    }

    /// Days since 1970-01-01 of a civil date, counted the slow way: an
    /// independent inverse of `civil_date`.
    fn days_since_epoch(year: u64, month: u32, day: u32) -> u64 {
        let years: u64 = (1970..year).map(days_in_year).sum();
        let mut lengths = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
        if is_leap_year(year) {
            lengths[1] = 29;
        }
        let months: u64 = lengths[..month as usize - 1].iter().sum();
        years + months + u64::from(day) - 1
    }

    #[test]
    fn logger_civil_date_walks_every_day() {
        // Every day from 1970 to past 2400 (a non-leap and a leap century, and a
        // whole 400-year cycle): consecutive, valid, and the inverse agrees.
        let mut prev = civil_date(0);
        assert_eq!(prev, (1970, 1, 1));
        for days in 1..(DAYS_PER_400_YEARS + 200 * 365) {
            let (y, m, d) = civil_date(days);
            let (py, pm, pd) = prev;
            let next_day = (y, m, d) == (py, pm, pd + 1);
            let next_month = y == py && m == pm + 1 && d == 1;
            let next_year = y == py + 1 && (m, d) == (1, 1) && (pm, pd) == (12, 31);
            assert!(
                next_day || next_month || next_year,
                "{days}: {prev:?} then {:?}",
                (y, m, d)
            );
            if days % 97 == 0 || (m, d) == (2, 29) || (m, d) == (12, 31) {
                assert_eq!(days_since_epoch(y, m, d), days, "{y}-{m}-{d}");
            }
            prev = (y, m, d);
        }
    }

    fn json(s: &str) -> String {
        let mut out = String::new();
        push_json_string(&mut out, s);
        out
    }

    #[test]
    fn logger_json_string_escaping() {
        assert_eq!(json("plain"), r#""plain""#);
        assert_eq!(json(r#"say "hi" \ bye"#), r#""say \"hi\" \\ bye""#);
        assert_eq!(json("a\nb\rc\td"), r#""a\nb\rc\td""#);
        assert_eq!(json("\u{08}\u{0c}\u{00}\u{1f}"), r#""\b\f\u0000\u001f""#);
        // DEL and non-ASCII need no escape; UTF-8 is kept as it is.
        assert_eq!(json("\u{7f}é→🦀\u{2028}"), "\"\u{7f}é→🦀\u{2028}\"");
        // Every control character round-trips through a real JSON parser.
        let all: String = (0u8..0x80).map(char::from).collect::<String>() + "ü中";
        let back: String = serde_json::from_str(&json(&all)).unwrap();
        assert_eq!(back, all);
    }

    #[test]
    fn logger_line_formats() {
        let at = Duration::from_millis(1_795_664_654_123);
        let text = format_line(
            LogFormat::Text,
            at,
            log::Level::Info,
            "kvshard::front",
            "front",
            &format_args!("started {} shards", 2),
        );
        assert_eq!(
            text,
            "2026-11-26T03:44:14.123Z INFO  kvshard::front (front): started 2 shards\n"
        );
        let line = format_line(
            LogFormat::Json,
            at,
            log::Level::Warn,
            "t",
            "shard-0",
            &format_args!("bad \"key\"\n\\ {}", "é"),
        );
        assert!(
            line.ends_with("}\n") && line.matches('\n').count() == 1,
            "{line}"
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "ts": "2026-11-26T03:44:14.123Z",
                "level": "WARN",
                "target": "t",
                "thread": "shard-0",
                "msg": "bad \"key\"\n\\ é",
            })
        );
    }
}
