//! End to end: an L2 tier that fails or hangs, as an operator meets it. A
//! lookup waits at most `--l2-prefetch-load-timeout` for L2 and concludes with
//! what L1 holds; a tier that stops answering is closed to requests and
//! probed every second, and serves again once it answers; each adapter's
//! health in `/status` says what failed (a full disk, a deleted directory,
//! refused credentials, a frozen disk) while `/healthcheck` stays 200 with
//! L1 serving; and the failures are logged with their cause, rate-limited.

mod support;
use support::*;

use std::path::Path;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_millis(500);
/// How soon after a tier answers again it serves: the next probe (one a
/// second) and its answer, with room for a loaded machine.
const REOPEN_BOUND: Duration = Duration::from_millis(2500);

fn adapter_status(srv: &Server) -> serde_json::Value {
    srv.get_json("/status")["storage_manager"]["l2_adapters"][0].clone()
}

fn healthy(srv: &Server) -> bool {
    adapter_status(srv)["is_healthy"] == true
}

/// `/healthcheck`'s status: a liveness probe that L2 trouble must not fail.
fn healthcheck(srv: &Server) -> u16 {
    srv.http("GET", "/healthcheck", None).0
}

/// A lookup of `n` chunks of `toks` by a fresh request: (hits, how long from
/// sending it to its result).
fn timed_lookup(c: &mut Client, toks: &[u32], n: usize, rid: &str) -> (i64, Duration) {
    let t0 = Instant::now();
    let hits = ed_lookup(c, &ed_key("m", None, toks, n, rid));
    (hits, t0.elapsed())
}

/// Stores `n` chunks of `toks`, waits for them in `count()` L2 objects, and
/// empties L1: they are then in L2 only.
fn in_l2_only(srv: &Server, toks: &[u32], n: usize, count: impl Fn() -> usize) -> Vec<Vec<u8>> {
    let stored = ed_store_chunks(srv, 1, toks, n, 3);
    wait_until("the chunks in L2", || count() >= n);
    // The store controller lets go of the L1 copies once it is done.
    wait_until("the stores settled", || srv.stores_settled());
    let (st, body) = srv.http("POST", "/cache/clear", None);
    assert_eq!(st, 200, "{body}");
    assert_eq!(srv.l1_count("total_object_count"), 0);
    stored
}

#[test]
fn with_s3_hung_lookups_conclude_at_their_deadline_with_l1_and_recover_within_a_probe() {
    let s3 = S3sFs::start(&["hung"]);
    let log = log_path("kvshard-hung");
    let srv = Server::start_logged(&["--l2-adapter", &s3.adapter("hung", "")], &log);
    let toks = ed_tokens(7, 4 * ED_CHUNK);
    let bucket = || s3.objects("hung").len();
    let stored = in_l2_only(&srv, &toks, 4, bucket);
    // The first two chunks go back to L1; the last two are in S3 only.
    ed_store_chunks(&srv, 1, &toks, 2, 3);
    let mut c = srv.client();
    let (name, size) = ed_register(&mut c, 2, "m");
    let pool = ShmMap::open(&name, size);

    s3.freeze();
    // Each lookup concludes at its deadline with the two chunks L1 holds;
    // the first one marks the adapter unhealthy, and after three in a row
    // the tier is closed to requests: lookups then miss it at once.
    let mut late = Vec::new();
    for i in 0..4 {
        let rid = format!("hung-{i}");
        let (hits, took) = timed_lookup(&mut c, &toks, 4, &rid);
        assert_eq!(hits, 2, "lookup {i}: the prefix L1 holds");
        let got = ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 2, &rid), 2);
        assert!(got == stored[..2], "lookup {i}: L1's bytes");
        if i == 0 {
            // The shard counts the load that ran out at the same deadline
            // the front answered at: within a deadline more.
            wait_until_within(
                "the adapter unhealthy",
                DEADLINE,
                Duration::from_millis(5),
                || !healthy(&srv),
            );
            let st = adapter_status(&srv);
            let why = st["unhealthy_reason"].as_str().unwrap();
            assert!(why.contains("--l2-prefetch-load-timeout"), "{why}");
            assert_eq!(
                healthcheck(&srv),
                200,
                "L1 serves: the liveness probe passes"
            );
        }
        if i < 3 {
            late.push(took.saturating_sub(DEADLINE));
            assert!(took >= DEADLINE, "lookup {i} waited {took:?}");
        } else {
            assert!(took < DEADLINE, "a closed tier is not waited for: {took:?}");
        }
    }
    late.sort();
    eprintln!("lateness past the deadline of the lookups that waited: {late:?}");
    assert!(late[1] < Duration::from_millis(100), "{late:?}");
    assert!(late[2] < Duration::from_millis(500), "{late:?}");
    let st = adapter_status(&srv);
    assert_eq!(st["connection_disabled"], true, "{st}");
    assert_eq!(
        srv.metric("kvshard_l2_gate_closed_shards", &[("l2_name", "s3#1")]),
        Some(st["shards"].as_array().unwrap().len() as f64)
    );
    let status = srv.get_json("/status");
    assert_eq!(status["storage_manager"]["is_healthy"], false);
    assert_eq!(status["is_healthy"], false);
    assert_eq!(healthcheck(&srv), 200);

    // S3 answers again: the next probe opens the tier, and lookups load from
    // it (the loads that hung have landed in L1 meanwhile, or load now).
    s3.thaw();
    let back = Instant::now();
    wait_until_within(
        "the tier to serve again",
        Duration::from_secs(3),
        Duration::from_millis(20),
        || healthy(&srv) || adapter_status(&srv)["connection_disabled"] == false,
    );
    let reopened = back.elapsed();
    eprintln!("the tier served again {reopened:?} after S3 returned");
    assert!(reopened < REOPEN_BOUND, "{reopened:?}");
    let (hits, _) = timed_lookup(&mut c, &toks, 4, "after");
    assert_eq!(hits, 4);
    let got = ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 4, "after"), 2);
    assert!(got == stored, "every chunk with its bytes");
    wait_until("healthy again", || healthy(&srv));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("answers again after"), "{text}");
    let _ = std::fs::remove_file(&log);
}

#[test]
fn with_a_frozen_file_system_lookups_conclude_at_their_deadline_and_the_tier_recovers() {
    let Some(mut disk) = Freezable::mount(256) else {
        return;
    };
    let dir = disk.dir("l2");
    let adapter = format!(r#"{{"type":"fs","base_path":"{}"}}"#, dir.display());
    let mut srv = Server::start(&["--l2-adapter", &adapter]);
    let toks = ed_tokens(8, 2 * ED_CHUNK);
    let files = || std::fs::read_dir(&dir).map_or(0, |d| d.count());
    let stored = in_l2_only(&srv, &toks, 2, files);

    disk.freeze();
    // Writes behind hang in the kernel and hold the adapter's blocking
    // thread; the lookups of what the tier holds conclude at their deadline
    // anyway, and once the tier is closed, at once.
    for i in 0..4 {
        ed_store_chunks(&srv, 1, &ed_tokens(50 + i, 2 * ED_CHUNK), 2, 20 + i as u64);
    }
    wait_until("writes behind in flight", || {
        srv.metric("kvshard_l2_inflight_store_bytes", &[])
            .unwrap_or(0.0)
            > 0.0
    });
    let mut c = srv.client();
    for i in 0..5 {
        let (_, took) = timed_lookup(&mut c, &toks, 2, &format!("frozen-{i}"));
        assert!(
            took < DEADLINE + Duration::from_millis(500),
            "lookup {i}: {took:?}"
        );
    }
    assert!(!healthy(&srv));
    assert_eq!(healthcheck(&srv), 200);
    assert_serving(&mut srv);

    disk.thaw();
    wait_until("the tier to serve again", || {
        let (hits, _) = timed_lookup(&mut c, &toks, 2, &unique("thawed"));
        hits == 2
    });
    let (name, size) = ed_register(&mut c, 2, "m");
    let pool = ShmMap::open(&name, size);
    let rid = unique("read");
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, &rid)), 2);
    let got = ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 2, &rid), 2);
    assert!(got == stored);
    wait_until("healthy again", || healthy(&srv));
}

/// Stores `reqs` requests of `n` chunks each (tokens of seeds `first..`)
/// and waits until the store controller has settled them all.
fn store_many(srv: &Server, first: u32, reqs: u32, n: usize) {
    for r in first..first + reqs {
        ed_store_chunks(srv, 1, &ed_tokens(1000 + r, n * ED_CHUNK), n, r as u64);
    }
    wait_until("the stores settled", || srv.stores_settled());
}

fn log_lines(log: &Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_full_disk_makes_the_fs_tier_unhealthy_with_its_cause_logs_a_few_lines_and_l1_serves() {
    let Some(disk) = Tmpfs::mount("256k", false) else {
        return;
    };
    let adapter = format!(r#"{{"type":"fs","base_path":"{}"}}"#, disk.path.display());
    let log = log_path("kvshard-enospc");
    let mut srv = Server::start_logged(&["--l2-adapter", &adapter], &log);
    assert!(healthy(&srv));
    // 8 KiB chunks: 40 requests of 8 chunks are 2.5 MiB, ten times the disk.
    store_many(&srv, 0, 40, 8);
    let failed = srv
        .metric(
            "kvshard_l2_store_failed_objects_total",
            &[("l2_name", "fs#1")],
        )
        .unwrap();
    assert!(failed >= 200.0, "{failed} objects failed");
    let st = adapter_status(&srv);
    assert_eq!(st["is_healthy"], false, "{st}");
    let why = st["unhealthy_reason"].as_str().unwrap();
    assert!(
        why.contains("store") && why.contains("No space left on device"),
        "{why}"
    );
    assert_eq!(
        srv.get_json("/status")["storage_manager"]["is_healthy"],
        false
    );
    assert_eq!(healthcheck(&srv), 200);
    assert_serving(&mut srv);
    // Hundreds of failed objects, a handful of lines, each with the cause.
    let lines: Vec<String> = log_lines(&log, "fs adapter (shard")
        .into_iter()
        .filter(|l| l.contains("WARN"))
        .collect();
    assert!(
        !lines.is_empty() && lines.len() <= 12,
        "{} lines:\n{}",
        lines.len(),
        lines.join("\n")
    );
    assert!(
        lines
            .iter()
            .all(|l| l.contains("No space left on device") || l.contains("similar lines")),
        "{lines:?}"
    );
    let _ = std::fs::remove_file(&log);
}

#[test]
fn a_deleted_base_path_makes_the_fs_tier_unhealthy() {
    let dir = std::env::temp_dir().join(unique("kvshard-gone"));
    let adapter = format!(r#"{{"type":"fs","base_path":"{}"}}"#, dir.display());
    let srv = Server::start(&["--l2-adapter", &adapter]);
    store_many(&srv, 0, 2, 4);
    assert!(healthy(&srv));
    std::fs::remove_dir_all(&dir).unwrap();
    store_many(&srv, 2, 2, 4);
    let st = adapter_status(&srv);
    assert_eq!(st["is_healthy"], false, "{st}");
    let why = st["unhealthy_reason"].as_str().unwrap();
    assert!(why.contains("No such file or directory"), "{why}");
    assert_eq!(healthcheck(&srv), 200);
}

#[test]
fn refused_s3_credentials_make_the_tier_unhealthy_and_are_logged_for_lookups_and_stores() {
    let s3 = S3sFs::start(&["creds"]);
    let adapter = s3
        .adapter("creds", "")
        .replace(S3_SECRET_KEY, "not-the-secret");
    let log = log_path("kvshard-403");
    let srv = Server::start_logged(&["--l2-adapter", &adapter], &log);
    store_many(&srv, 0, 2, 2);
    let mut c = srv.client();
    let toks = ed_tokens(99, 2 * ED_CHUNK);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 2, "l")), 0);
    let st = adapter_status(&srv);
    assert_eq!(st["is_healthy"], false, "{st}");
    let why = st["unhealthy_reason"].as_str().unwrap();
    assert!(
        why.contains("403") || why.contains("PermissionDenied"),
        "{why}"
    );
    assert_eq!(healthcheck(&srv), 200);
    // Both kinds of request say why they failed in the log.
    for op in ["PUT", "HEAD"] {
        let lines = log_lines(&log, &format!("): {op} "));
        assert!(!lines.is_empty(), "no {op} failure logged");
        assert!(lines.len() <= 6, "{op}: {} lines", lines.len());
    }
    let _ = std::fs::remove_file(&log);
}

#[test]
fn a_store_stuck_on_a_frozen_disk_makes_the_tier_unhealthy_while_it_hangs() {
    let Some(mut disk) = Freezable::mount(256) else {
        return;
    };
    let dir = disk.dir("l2");
    let adapter = format!(r#"{{"type":"fs","base_path":"{}"}}"#, dir.display());
    let srv = Server::start(&["--l2-adapter", &adapter]);
    store_many(&srv, 0, 1, 2);
    disk.freeze();
    ed_store_chunks(&srv, 1, &ed_tokens(77, 2 * ED_CHUNK), 2, 5);
    wait_until("the stuck store reported", || {
        let st = adapter_status(&srv);
        st["is_healthy"] == false
            && st["unhealthy_reason"]
                .as_str()
                .is_some_and(|w| w.contains("a store has run for"))
    });
    assert_eq!(healthcheck(&srv), 200);
    disk.thaw();
    wait_until("healthy once the store ended", || healthy(&srv));
}
