//! UTC calendar arithmetic for SigV4 dates and the timestamps S3 and the
//! credential sources send (`2024-01-29T18:53:01Z`, with optional fraction or
//! offset). Done by hand with the days-from-civil algorithm so the crate needs
//! no date library; only the proleptic Gregorian calendar between the years
//! 1970 and 9999 is supported, which covers every timestamp AWS produces.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Seconds since the epoch of 10000-01-01T00:00:00Z: the first instant whose
/// year no longer fits the four digits of an `x-amz-date`.
const YEAR_10000_UNIX_SECS: u64 = 253_402_300_800;

/// A timestamp that cannot be formatted or parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TimeError {
    /// The instant is before 1970-01-01T00:00:00Z.
    BeforeEpoch,
    /// The instant is in the year 10000 or later.
    AfterYear9999,
    /// The text is not an ISO 8601 / RFC 3339 UTC timestamp.
    Malformed {
        /// The text that was given.
        text: String,
        /// What was wrong with it.
        reason: &'static str,
    },
}

impl fmt::Display for TimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TimeError::BeforeEpoch => write!(f, "timestamp is before 1970-01-01T00:00:00Z"),
            TimeError::AfterYear9999 => write!(f, "timestamp is after 9999-12-31T23:59:59Z"),
            TimeError::Malformed { text, reason } => {
                write!(f, "malformed timestamp {text:?}: {reason}")
            }
        }
    }
}

impl std::error::Error for TimeError {}

/// Seconds since the Unix epoch, checked to lie in the years 1970..=9999.
pub fn unix_secs(time: SystemTime) -> Result<u64, TimeError> {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .map_err(|_| TimeError::BeforeEpoch)?
        .as_secs();
    if secs >= YEAR_10000_UNIX_SECS {
        return Err(TimeError::AfterYear9999);
    }
    Ok(secs)
}

/// `x-amz-date` form, `YYYYMMDD'T'HHMMSS'Z'`: 16 ASCII bytes. The first eight
/// are the credential-scope date.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct AmzDate([u8; 16]);

impl AmzDate {
    /// Formats `secs` seconds after the Unix epoch (UTC).
    pub fn from_unix_secs(secs: u64) -> Result<AmzDate, TimeError> {
        if secs >= YEAR_10000_UNIX_SECS {
            return Err(TimeError::AfterYear9999);
        }
        let days = secs / 86_400;
        let rem = secs % 86_400;
        let (year, month, day) = civil_from_days(days);
        let (hour, minute, second) = (rem / 3600, (rem % 3600) / 60, rem % 60);
        let mut out = [0u8; 16];
        put_digits(&mut out[0..4], year);
        put_digits(&mut out[4..6], month);
        put_digits(&mut out[6..8], day);
        out[8] = b'T';
        put_digits(&mut out[9..11], hour);
        put_digits(&mut out[11..13], minute);
        put_digits(&mut out[13..15], second);
        out[15] = b'Z';
        Ok(AmzDate(out))
    }

    /// Formats a wall-clock instant.
    pub fn from_system_time(time: SystemTime) -> Result<AmzDate, TimeError> {
        AmzDate::from_unix_secs(unix_secs(time)?)
    }

    /// The full `YYYYMMDDTHHMMSSZ` text.
    pub fn as_str(&self) -> &str {
        // Only ASCII digits, 'T' and 'Z' are ever written.
        std::str::from_utf8(&self.0).expect("AmzDate is ASCII")
    }

    /// The `YYYYMMDD` part used in the credential scope.
    pub fn date(&self) -> &str {
        &self.as_str()[..8]
    }
}

impl fmt::Debug for AmzDate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AmzDate({})", self.as_str())
    }
}

impl fmt::Display for AmzDate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn put_digits(out: &mut [u8], mut value: u64) {
    for slot in out.iter_mut().rev() {
        *slot = b'0' + (value % 10) as u8;
        value /= 10;
    }
    assert_eq!(value, 0, "value does not fit its digit field");
}

/// (year, month 1..=12, day 1..=31) of the day `days` after 1970-01-01.
/// Howard Hinnant's `civil_from_days`, restricted to non-negative day counts.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to the given date (year >= 1970), the inverse of
/// [`civil_from_days`].
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ => {
            let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
            if leap {
                29
            } else {
                28
            }
        }
    }
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM)` (RFC 3339; a
/// lowercase `t`/`z` or a space separator is accepted too, as RFC 3339
/// allows). The fraction is kept to nanoseconds. Used for S3's
/// `LastModified`, CreateSession's `Expiration` and credential expiries.
pub fn parse_rfc3339(text: &str) -> Result<SystemTime, TimeError> {
    let bad = |reason: &'static str| TimeError::Malformed {
        text: text.to_owned(),
        reason,
    };
    let b = text.as_bytes();
    if b.len() < 20 {
        return Err(bad("too short"));
    }
    let num = |range: std::ops::Range<usize>| -> Result<u64, TimeError> {
        let digits = &b[range];
        if !digits.iter().all(u8::is_ascii_digit) {
            return Err(bad("expected digits"));
        }
        Ok(digits
            .iter()
            .fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0')))
    };
    if b[4] != b'-' || b[7] != b'-' || b[13] != b':' || b[16] != b':' {
        return Err(bad("expected YYYY-MM-DDTHH:MM:SS"));
    }
    if !matches!(b[10], b'T' | b't' | b' ') {
        return Err(bad("expected 'T' between date and time"));
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if year < 1970 {
        return Err(TimeError::BeforeEpoch);
    }
    if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return Err(bad("no such date"));
    }
    // 60 is a leap second; it is folded into the next minute.
    if hour > 23 || minute > 59 || second > 60 {
        return Err(bad("no such time of day"));
    }
    let mut pos = 19;
    let mut nanos: u64 = 0;
    if b[pos] == b'.' {
        pos += 1;
        let start = pos;
        while pos < b.len() && b[pos].is_ascii_digit() {
            if pos - start < 9 {
                nanos = nanos * 10 + u64::from(b[pos] - b'0');
            }
            pos += 1;
        }
        let digits = pos - start;
        if digits == 0 {
            return Err(bad("empty fraction"));
        }
        for _ in digits..9 {
            nanos *= 10;
        }
    }
    let offset_secs: i64 = match &b[pos..] {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let digits = [*h1, *h2, *m1, *m2];
            if !digits.iter().all(u8::is_ascii_digit) {
                return Err(bad("malformed UTC offset"));
            }
            let hours = i64::from((h1 - b'0') * 10 + (h2 - b'0'));
            let minutes = i64::from((m1 - b'0') * 10 + (m2 - b'0'));
            if hours > 23 || minutes > 59 {
                return Err(bad("malformed UTC offset"));
            }
            let magnitude = hours * 3600 + minutes * 60;
            if *sign == b'+' {
                magnitude
            } else {
                -magnitude
            }
        }
        _ => return Err(bad("expected 'Z' or a ±HH:MM offset")),
    };
    let local = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second;
    // Local time minus the offset is UTC.
    let utc = i64::try_from(local).map_err(|_| TimeError::AfterYear9999)? - offset_secs;
    let utc = u64::try_from(utc).map_err(|_| TimeError::BeforeEpoch)?;
    if utc >= YEAR_10000_UNIX_SECS {
        return Err(TimeError::AfterYear9999);
    }
    Ok(UNIX_EPOCH + Duration::new(utc, nanos as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_dates() {
        assert_eq!(
            AmzDate::from_unix_secs(0).unwrap().as_str(),
            "19700101T000000Z"
        );
        // The AWS suite's timestamp.
        let t = AmzDate::from_unix_secs(1_440_938_160).unwrap();
        assert_eq!(t.as_str(), "20150830T123600Z");
        assert_eq!(t.date(), "20150830");
        // Leap day and the last representable second.
        assert_eq!(
            AmzDate::from_unix_secs(951_782_400).unwrap().as_str(),
            "20000229T000000Z"
        );
        assert_eq!(
            AmzDate::from_unix_secs(YEAR_10000_UNIX_SECS - 1)
                .unwrap()
                .as_str(),
            "99991231T235959Z"
        );
        assert_eq!(
            AmzDate::from_unix_secs(YEAR_10000_UNIX_SECS),
            Err(TimeError::AfterYear9999)
        );
    }

    #[test]
    fn civil_round_trips_every_day() {
        for days in (0..3_000_000u64).step_by(7) {
            let (y, m, d) = civil_from_days(days);
            assert!(d >= 1 && d <= days_in_month(y, m));
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn parses_rfc3339_forms() {
        let at = |s| unix_secs(parse_rfc3339(s).unwrap()).unwrap();
        assert_eq!(at("2015-08-30T12:36:00Z"), 1_440_938_160);
        assert_eq!(at("2015-08-30T14:36:00+02:00"), 1_440_938_160);
        assert_eq!(at("2015-08-30T10:06:00-02:30"), 1_440_938_160);
        assert_eq!(at("2015-08-30 12:36:00z"), 1_440_938_160);
        let frac = parse_rfc3339("2009-10-12T17:50:30.123Z").unwrap();
        assert_eq!(
            frac.duration_since(UNIX_EPOCH).unwrap(),
            Duration::new(1_255_369_830, 123_000_000)
        );
        // More than nine fraction digits are accepted and truncated.
        assert!(parse_rfc3339("2009-10-12T17:50:30.1234567891234Z").is_ok());
    }

    #[test]
    fn rejects_malformed_timestamps() {
        for s in [
            "",
            "2015-08-30",
            "2015-08-30T12:36:00",
            "2015-02-30T12:36:00Z",
            "2015-13-01T12:36:00Z",
            "2015-08-30T24:00:00Z",
            "2015-08-30T12:36:00.Z",
            "2015-08-30T12:36:00+0200",
            "2015-08-30T12:36:00ZZ",
            "2015/08/30T12:36:00Z",
            "20150830T123600Z",
            "２015-08-30T12:36:00Z",
            "1969-12-31T23:59:59Z",
        ] {
            assert!(parse_rfc3339(s).is_err(), "{s:?} should be rejected");
        }
    }
}
