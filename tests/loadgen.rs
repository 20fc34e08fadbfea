//! `kvshard loadgen` against the real server: every load shape runs, checks
//! the bytes it reads back and reports them; a server that never answers is
//! reported, not waited on forever.

mod support;

use std::process::Command;
use support::*;

/// Runs `kvshard loadgen --format json` with `args`; (exit code, report).
fn loadgen(args: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(kvshard_bin())
        .arg("loadgen")
        .args(["--format", "json"])
        .args(args)
        .output()
        .expect("run kvshard loadgen");
    let text = String::from_utf8_lossy(&out.stdout);
    let report = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "loadgen printed no JSON report ({e}): {text}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), report)
}

#[test]
fn every_load_shape_reads_back_what_was_stored() {
    let srv = Server::start(&["--l1-size-gb", "0.25"]);
    let url = format!("tcp://127.0.0.1:{}", srv.port);
    let lmc: &[&str] = &["--transfer-mode", "lmcache_driven"];
    let shapes: [&[&str]; 9] = [
        &["--instances", "3"],
        &[lmc[0], lmc[1], "--instances", "2", "--model", "lmc"],
        &[
            lmc[0],
            lmc[1],
            "--instances",
            "2",
            "--tp",
            "2",
            "--model",
            "lmc-tp2",
        ],
        &[
            lmc[0],
            lmc[1],
            "--instances",
            "2",
            "--tp",
            "2",
            "--mla",
            "--model",
            "lmc-mla",
        ],
        &[
            lmc[0],
            lmc[1],
            "--instances",
            "2",
            "--lookup-only",
            "--model",
            "lmc-lookups",
        ],
        &["--instances", "2", "--rate", "200", "--model", "open-loop"],
        &["--instances", "2", "--tp", "2", "--model", "tp2"],
        &["--instances", "2", "--tp", "2", "--mla", "--model", "mla"],
        &["--instances", "2", "--lookup-only", "--model", "lookups"],
    ];
    for shape in shapes {
        let mut args = vec![
            "--url",
            &url,
            "--duration",
            "1.5",
            "--prompts",
            "12",
            "--prompt-tokens",
            "96",
            "--system-prompt-tokens",
            "32",
            "--layers",
            "2",
            "--hidden",
            "64",
        ];
        args.extend_from_slice(shape);
        let (code, r) = loadgen(&args);
        assert_eq!(code, 0, "{shape:?}: {r}");
        assert!(r["requests"].as_u64().unwrap() > 0, "{shape:?}: {r}");
        assert_eq!(r["wrong_chunks"], 0, "{shape:?}: {r}");
        assert_eq!(r["unanswered"], 0, "{shape:?}: {r}");
        // 12 prompts of 6 chunks, 2 of them shared system-prompt chunks:
        // repeats hit, and something was read back and checked.
        assert!(r["hit_chunks"].as_u64().unwrap() > 0, "{shape:?}: {r}");
        if !shape.contains(&"--lookup-only") {
            assert!(r["stored_chunks"].as_u64().unwrap() > 0, "{shape:?}: {r}");
            assert!(r["read_gb_per_s"].as_f64().unwrap() > 0.0, "{shape:?}: {r}");
        }
    }
    assert_eq!(srv.l1_count("read_locked_count"), 0, "every lock released");
}

#[test]
fn a_server_that_never_answers_is_reported() {
    // A ROUTER that takes requests and never replies, as lmcache 0.5.6 does
    // when a handler fails.
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    let port = bind_loopback(&router);
    let t0 = std::time::Instant::now();
    let out = Command::new(kvshard_bin())
        .args(["loadgen", "--timeout-ms", "300", "--duration", "1"])
        .args(["--url", &format!("tcp://127.0.0.1:{port}")])
        .output()
        .expect("run kvshard loadgen");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("chunk size") && err.contains("no reply"),
        "{err}"
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(20),
        "gave up after its timeout, not hung"
    );
}

#[test]
fn bad_settings_are_refused_before_connecting() {
    for (args, want) in [
        (
            &["--transfer-mode", "lmcache_driven", "--hidden", "100"][..],
            "multiple of 64",
        ),
        (&["--instances", "0"][..], "at least 1"),
    ] {
        let out = Command::new(kvshard_bin())
            .arg("loadgen")
            .args(args)
            .output()
            .expect("run kvshard loadgen");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `has_liveness_signal` of every worker in `/status`, by instance id.
fn liveness(srv: &Server) -> Vec<(String, bool)> {
    let status = srv.get_json("/status");
    let workers = status["worker_liveness_by_instance"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    workers
        .into_iter()
        .map(|(iid, w)| {
            (
                iid,
                w["has_liveness_signal"] == serde_json::Value::Bool(true),
            )
        })
        .collect()
}

#[test]
fn every_rank_sends_the_heartbeat() {
    let srv = Server::start(&["--l1-size-gb", "0.25"]);
    let url = format!("tcp://127.0.0.1:{}", srv.port);
    // Two instances of TP 2 each time (ranks first..first+4), running long
    // enough to be seen registered: pinging every 0.2 s in both modes, then
    // with the heartbeat off.
    let runs = [
        ("engine_driven", 500, "0.2"),
        ("lmcache_driven", 600, "0.2"),
        ("engine_driven", 700, "0"),
    ];
    for (mode, first, heartbeat) in runs {
        let mut child = std::process::Command::new(kvshard_bin())
            .args(["loadgen", "--url", &url, "--transfer-mode", mode])
            .args(["--instances", "2", "--tp", "2"])
            .args(["--first-instance-id", &first.to_string()])
            .args(["--model", mode, "--duration", "30"])
            .args(["--heartbeat-seconds", heartbeat, "--format", "json"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start kvshard loadgen");
        let want: Vec<String> = (first..first + 4).map(|i| i.to_string()).collect();
        let pings = heartbeat != "0";
        let mut seen = Vec::new();
        wait_until_within(
            &format!(
                "{mode}, heartbeat {heartbeat}: every rank registered (and pinged if it pings)"
            ),
            std::time::Duration::from_secs(20),
            std::time::Duration::from_millis(100),
            || {
                seen = liveness(&srv);
                want.iter().all(|iid| {
                    seen.iter()
                        .any(|(i, pinged)| i == iid && (*pinged || !pings))
                })
            },
        );
        // Stopped as Ctrl-C or a supervisor stops it: it ends well before its
        // 30 s, and its KV caches' shm segments (lmcache_driven) go with it.
        let pid = child.id();
        // SAFETY: kill takes no pointers; `pid` is our child, not yet waited for.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
        wait_until_within(
            &format!("{mode}: kvshard loadgen ends on SIGTERM"),
            std::time::Duration::from_secs(15),
            std::time::Duration::from_millis(50),
            || {
                child
                    .try_wait()
                    .expect("wait for kvshard loadgen")
                    .is_some()
            },
        );
        let left: Vec<String> = std::fs::read_dir("/dev/shm")
            .expect("list /dev/shm")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&format!("kvshard_loadgen_{pid}_")))
            .collect();
        assert!(
            left.is_empty(),
            "{mode}: shm segments left behind: {left:?}"
        );
        if !pings {
            for (iid, pinged) in seen.iter().filter(|(i, _)| want.contains(i)) {
                assert!(!pinged, "rank {iid} pinged with the heartbeat off");
            }
        }
    }
}
