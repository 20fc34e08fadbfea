//! Observability of a running server: the log line formats (`--log-format
//! text|json`, RFC 3339 UTC times), the standard `process_*` series in
//! `/metrics`, and the Grafana dashboard in `tools/grafana` against a live scrape.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::*;

const LEVELS: [&str; 5] = ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"];

/// A scratch directory of this test, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(prefix: &str) -> Scratch {
        let dir = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn is_leap(y: u64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// Parses `YYYY-MM-DDTHH:MM:SS.mmmZ` strictly (exactly that shape, fields in
/// range, the day valid for its month) into Unix seconds.
fn parse_rfc3339_ms(ts: &str) -> Result<f64, String> {
    let b = ts.as_bytes();
    if b.len() != 24 {
        return Err(format!("{ts:?}: not 24 bytes"));
    }
    for (i, sep) in [
        (4, b'-'),
        (7, b'-'),
        (10, b'T'),
        (13, b':'),
        (16, b':'),
        (19, b'.'),
        (23, b'Z'),
    ] {
        if b[i] != sep {
            return Err(format!("{ts:?}: byte {i} is not {:?}", sep as char));
        }
    }
    let num = |from: usize, to: usize| -> Result<u64, String> {
        let s = &ts[from..to];
        if !s.bytes().all(|c| c.is_ascii_digit()) {
            return Err(format!("{ts:?}: {s:?} is not digits"));
        }
        Ok(s.parse().unwrap())
    };
    let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hour, min, sec, ms) = (num(11, 13)?, num(14, 16)?, num(17, 19)?, num(20, 23)?);
    let mut month_days = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if is_leap(year) {
        month_days[1] = 29;
    }
    if year < 1970 || !(1..=12).contains(&month) {
        return Err(format!("{ts:?}: year or month out of range"));
    }
    if day == 0 || day > month_days[month as usize - 1] || hour > 23 || min > 59 || sec > 59 {
        return Err(format!("{ts:?}: day or time out of range"));
    }
    let days = (1970..year)
        .map(|y| if is_leap(y) { 366 } else { 365 })
        .sum::<u64>()
        + month_days[..month as usize - 1].iter().sum::<u64>()
        + day
        - 1;
    Ok((days * 86_400 + hour * 3600 + min * 60 + sec) as f64 + ms as f64 / 1000.0)
}

#[test]
fn rfc3339_parser_of_this_test_is_strict() {
    assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00.000Z"), Ok(0.0));
    assert_eq!(
        parse_rfc3339_ms("2000-02-29T00:00:00.500Z"),
        Ok(951_782_400.5)
    );
    assert_eq!(
        parse_rfc3339_ms("2024-12-31T23:59:59.999Z"),
        Ok(1_735_689_599.999)
    );
    for bad in [
        "2023-02-29T00:00:00.000Z",
        "2024-13-01T00:00:00.000Z",
        "2024-01-01 00:00:00.000Z",
        "2024-01-01T00:00:00.000",
        "2024-01-01T24:00:00.000Z",
        "2024-01-01T00:00:00Z",
        "[1732592654.123]",
    ] {
        assert!(parse_rfc3339_ms(bad).is_err(), "{bad}");
    }
}

/// The server's log, after it stopped (so every line is written).
fn log_of(srv: Server, log: &Path) -> String {
    drop(srv);
    let text = std::fs::read_to_string(log).unwrap();
    assert!(text.ends_with('\n'), "the log ends in a whole line: {text}");
    text
}

/// A time from a log line: within a minute of now.
fn check_recent(ts: &str, line: &str) {
    let t = parse_rfc3339_ms(ts).unwrap_or_else(|e| panic!("{e} in {line:?}"));
    let now = now_unix();
    assert!(
        (now - 60.0..=now + 1.0).contains(&t),
        "{ts} is not within a minute of now ({now}): {line:?}"
    );
}

#[test]
fn text_log_lines_start_with_an_rfc3339_utc_time() {
    let dir = Scratch::new("kvshard-obs-text");
    let log = dir.path("server.log");
    let srv = Server::start_logged(&[], &log);
    assert_eq!(srv.http("GET", "/healthcheck", None).0, 200);
    let text = log_of(srv, &log);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 3, "{text}");
    for line in &lines {
        // `<time> <LEVEL padded to 5> <target> (<thread>): <message>`
        let (ts, rest) = line
            .split_once(' ')
            .unwrap_or_else(|| panic!("no time in {line:?}"));
        check_recent(ts, line);
        let level = rest[..5].trim_end();
        assert!(LEVELS.contains(&level), "level {level:?} in {line:?}");
        let rest = &rest[5..];
        assert!(
            rest.starts_with(' ') && !rest[1..].starts_with(' '),
            "{line:?}"
        );
        let (target, rest) = rest[1..].split_once(" (").expect("a thread");
        assert!(!target.is_empty(), "{line:?}");
        assert!(rest.contains("): "), "{line:?}");
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" INFO  kvshard_transport::server (main): ")),
        "{text}"
    );
    // The stamps are in order (one clock, lines written as they are made; a
    // line's time is taken before it waits for stderr, so allow a little).
    let times: Vec<f64> = lines
        .iter()
        .map(|l| parse_rfc3339_ms(&l[..24]).unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[1] >= w[0] - 0.5), "{text}");
}

/// Checks one JSON log line and returns its `msg`.
fn check_json_line(line: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: not JSON: {line:?}"));
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {line:?}"));
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["level", "msg", "target", "thread", "ts"], "{line:?}");
    let field = |k: &str| {
        obj[k]
            .as_str()
            .unwrap_or_else(|| panic!("{k} is not a string: {line:?}"))
            .to_owned()
    };
    check_recent(&field("ts"), line);
    assert!(LEVELS.contains(&field("level").as_str()), "{line:?}");
    assert!(!field("target").is_empty(), "{line:?}");
    assert!(!field("thread").is_empty(), "{line:?}");
    field("msg")
}

#[test]
fn json_log_lines_are_objects_with_time_level_target_thread_and_message() {
    let dir = Scratch::new("kvshard-obs-json");
    for (how, log, extra, envs) in [
        (
            "--log-format json",
            dir.path("flag.log"),
            &["--log-format", "json"][..],
            &[][..],
        ),
        (
            "KVSHARD_LOG_FORMAT=json",
            dir.path("env.log"),
            &[][..],
            &[("KVSHARD_LOG_FORMAT", "json")][..],
        ),
    ] {
        let srv = Server::start_logged_env(extra, &log, envs);
        // The escaping of quotes, backslashes and control characters is
        // covered by the logger's unit tests; here, real lines parse.
        let mut c = srv.client();
        c.noop_ok();
        let text = log_of(srv, &log);
        let msgs: Vec<String> = text.lines().map(check_json_line).collect();
        assert!(msgs.len() >= 3, "{how}: {text}");
        assert!(
            msgs.iter()
                .any(|m| m.starts_with("ZeroMQ ROUTER listening on")),
            "{how}: {text}"
        );
    }
    // The flag wins over the environment.
    let log = dir.path("both.log");
    let srv = Server::start_logged_env(
        &["--log-format", "text"],
        &log,
        &[("KVSHARD_LOG_FORMAT", "json")],
    );
    let text = log_of(srv, &log);
    assert!(text.lines().all(|l| !l.starts_with('{')), "{text}");
}

#[test]
fn an_unknown_log_format_is_refused() {
    let err = Server::start_refused(&["--log-format", "yaml"]);
    assert!(err.contains("--log-format"), "{err}");
    assert!(err.contains("text") && err.contains("json"), "{err}");
}

/// The value of an unlabeled series, with its declared TYPE checked.
fn series(text: &str, name: &str, kind: &str) -> f64 {
    assert!(
        text.contains(&format!("# TYPE {name} {kind}\n")),
        "{name} is not declared a {kind}"
    );
    assert!(
        text.contains(&format!("# HELP {name} ")),
        "{name} has no HELP"
    );
    let samples: Vec<f64> = parse_prometheus(text)
        .into_iter()
        .filter(|s| s.name == name)
        .map(|s| {
            assert!(s.labels.is_empty(), "{name}: {:?}", s.labels);
            s.value
        })
        .collect();
    assert_eq!(samples.len(), 1, "{name}: {samples:?}");
    samples[0]
}

#[test]
fn process_series_describe_the_server_process() {
    let before = now_unix();
    let srv = Server::start(&[]);
    let after = now_unix();
    let pid = srv.child.id();
    let scrape = || {
        let (st, text) = srv.http("GET", "/metrics", None);
        assert_eq!(st, 200, "{text}");
        text
    };
    let text = scrape();

    let rss = series(&text, "process_resident_memory_bytes", "gauge");
    let vsize = series(&text, "process_virtual_memory_bytes", "gauge");
    assert!(rss > 0.0 && vsize >= rss, "rss {rss}, virtual {vsize}");
    // The server's own RSS as the kernel reports it now, in a wide band (the
    // L1 pool is touched lazily, and the scrape itself allocates).
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let vm_rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    assert!(
        rss > vm_rss_kib * 1024.0 / 4.0 && rss < vm_rss_kib * 1024.0 * 4.0,
        "process_resident_memory_bytes {rss} against VmRSS {vm_rss_kib} KiB"
    );

    // /proc/stat's btime is whole seconds, the start in clock ticks.
    let start = series(&text, "process_start_time_seconds", "gauge");
    assert!(
        (before - 2.0..=after + 2.0).contains(&start),
        "start {start} not between {before} and {after}"
    );
    assert!((now_unix() - start).abs() < 60.0, "start {start}");

    let open = series(&text, "process_open_fds", "gauge");
    let max = series(&text, "process_max_fds", "gauge");
    assert!(open > 0.0 && open <= max, "open {open}, max {max}");
    let seen = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as f64;
    assert!(
        (open - seen).abs() <= 16.0,
        "process_open_fds {open}, /proc/{pid}/fd has {seen}"
    );

    let cpu0 = series(&text, "process_cpu_seconds_total", "counter");
    assert!(cpu0 >= 0.0, "{cpu0}");
    // Some work: requests through the front, scrapes through the HTTP thread.
    let mut c = srv.client();
    let deadline = std::time::Instant::now() + Duration::from_millis(500);
    while std::time::Instant::now() < deadline {
        for _ in 0..100 {
            c.noop_ok();
        }
        scrape();
    }
    let cpu1 = series(&scrape(), "process_cpu_seconds_total", "counter");
    assert!(cpu1 >= cpu0, "CPU seconds went back: {cpu0} then {cpu1}");
    assert!(cpu1 > 0.0, "500 ms of requests used no CPU: {cpu1}");
}

fn check_dashboard(scrape: &str) -> std::process::Output {
    let root = env!("CARGO_MANIFEST_DIR");
    Command::new("python3")
        .arg(Path::new(root).join("tools/grafana/check-dashboard.py"))
        .arg(scrape)
        .output()
        .expect("run python3 tools/grafana/check-dashboard.py")
}

#[test]
fn grafana_dashboard_uses_only_exported_metric_names() {
    // The per-adapter (l2_name) and kvshard_s3_* series exist only with L2
    // adapters: an fs one, and an s3 one whose endpoint nobody serves (the
    // series are there before its first request).
    let dir = Scratch::new("kvshard-obs-dash");
    std::fs::create_dir_all(dir.path("l2")).unwrap();
    let fs = format!(
        r#"{{"type":"fs","base_path":"{}"}}"#,
        dir.path("l2").display()
    );
    let s3 = r#"{"type":"s3","s3_endpoint":"kvb.localhost:9","s3_region":"us-east-1","disable_tls":true,"aws_access_key_id":"id","aws_secret_access_key":"secret"}"#;
    let srv = Server::start(&["--l2-adapter", &fs, "--l2-adapter", s3]);

    let url = format!("http://127.0.0.1:{}/metrics", srv.http_port);
    let out = check_dashboard(&url);
    assert!(
        out.status.success(),
        "check-dashboard.py {url}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // It does fail on a name the scrape lacks, naming it.
    let (st, text) = srv.http("GET", "/metrics", None);
    assert_eq!(st, 200);
    let without: String = text
        .lines()
        .filter(|l| !l.starts_with("process_open_fds"))
        .map(|l| format!("{l}\n"))
        .collect();
    let file = dir.path("scrape.txt");
    std::fs::write(&file, without).unwrap();
    let out = check_dashboard(file.to_str().unwrap());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("process_open_fds"), "{err}");
}
