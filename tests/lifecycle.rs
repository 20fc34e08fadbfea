//! End to end: what a running deployment sees when the server stops, starts
//! or restarts: a stop gives the SHM pool and the ports back at once and ends
//! within its drain whatever L2 still holds (S3 hung, a frozen file system);
//! a start clears the pools of servers that were killed; a worker that
//! outlives a restart registers again through its heartbeat.

mod support;
use support::*;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn sigterm(srv: &Server) {
    // SAFETY: kill(2) of the test's own child, not yet reaped.
    unsafe { libc::kill(srv.child.id() as i32, libc::SIGTERM) };
}

fn pool_of(srv: &Server) -> PathBuf {
    assert!(!srv.shm_name.is_empty());
    Path::new("/dev/shm").join(&srv.shm_name)
}

/// Stores 6 requests of 2 chunks each (no lookup first: a lookup's L2 check
/// would find the tier failing and nothing would be written behind) and
/// waits until L2 writes are in flight and stuck.
fn store_until_l2_writes_hang(srv: &Server) {
    for i in 0..6 {
        let toks = ed_tokens(100 + i, 2 * ED_CHUNK);
        ed_store_chunks(srv, 1, &toks, 2, 10 + i as u64);
    }
    wait_until("L2 writes in flight", || {
        srv.metric("kvshard_l2_inflight_store_bytes", &[])
            .unwrap_or(0.0)
            > 0.0
    });
}

/// With L2 writes stuck in flight, SIGTERM: the SHM pool must be gone
/// within a second. Returns when the signal went.
fn stop_with_l2_hung(srv: &Server, pool: &Path) -> Instant {
    store_until_l2_writes_hang(srv);
    let t0 = Instant::now();
    sigterm(srv);
    wait_until_within(
        "the SHM pool to go",
        Duration::from_secs(1),
        Duration::from_millis(5),
        || !pool.exists(),
    );
    t0
}

/// Waits for the child to exit within `limit`; its status, or `None`.
fn exited_within(srv: &mut Server, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(st) = srv.child.try_wait().unwrap() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

#[test]
fn a_stop_with_s3_hung_removes_the_pool_at_once_and_exits_after_the_drain() {
    let s3 = S3sFs::start(&["hung"]);
    let log = log_path("kvshard-stop-s3");
    let mut srv = Server::start_logged_auto_shm(
        &[
            "--l2-adapter",
            &s3.adapter("hung", ""),
            "--shutdown-drain-seconds",
            "2",
        ],
        &log,
    );
    let pool = pool_of(&srv);
    assert!(pool.exists());
    ed_store_chunks(&srv, 1, &ed_tokens(1, 2 * ED_CHUNK), 2, 1);
    wait_until("2 objects in S3", || s3.objects("hung").len() == 2);

    s3.freeze();
    let t0 = stop_with_l2_hung(&srv, &pool);
    // Another server may take the ports at once.
    let http = std::net::TcpListener::bind(("127.0.0.1", srv.http_port));
    let status = exited_within(
        &mut srv,
        Duration::from_secs(3) + Duration::from_millis(500),
    )
    .unwrap_or_else(|| panic!("still running {:?} after SIGTERM", t0.elapsed()));
    assert!(status.success(), "{status}");
    assert!(
        http.is_ok(),
        "the HTTP port was still taken after the pool went"
    );
    s3.thaw();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("still pending") && text.contains("abandoned"),
        "the log says what was abandoned: {text}"
    );
    let _ = std::fs::remove_file(&log);
}

#[test]
fn a_stop_with_a_frozen_file_system_removes_the_pool_at_once_and_says_what_it_abandons() {
    let Some(mut disk) = Freezable::mount(256) else {
        return;
    };
    let dir = disk.dir("l2");
    let adapter = format!(r#"{{"type":"fs","base_path":"{}"}}"#, dir.display());
    let log = log_path("kvshard-stop-frozen");
    let mut srv = Server::start_logged_auto_shm(
        &["--l2-adapter", &adapter, "--shutdown-drain-seconds", "2"],
        &log,
    );
    let pool = pool_of(&srv);
    ed_store_chunks(&srv, 1, &ed_tokens(2, 2 * ED_CHUNK), 2, 1);
    wait_until("2 files in the fs tier", || {
        std::fs::read_dir(&dir).map_or(0, |d| d.count()) == 2
    });

    disk.freeze();
    let t0 = stop_with_l2_hung(&srv, &pool);
    // Within the drain and a second, the server has said what it abandons
    // (it may not end before the file system lets its writers go).
    let said = || {
        let text = std::fs::read_to_string(&log).unwrap();
        text.contains("abandoned")
    };
    wait_until_within(
        "the log to say what was abandoned",
        Duration::from_secs(3) + Duration::from_millis(500),
        Duration::from_millis(20),
        said,
    );
    disk.thaw();
    let status = exited_within(&mut srv, Duration::from_secs(10)).unwrap_or_else(|| {
        panic!(
            "still running {:?} after SIGTERM and the thaw",
            t0.elapsed()
        )
    });
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_file(&log);
}

#[test]
fn a_start_removes_the_automatic_pool_a_killed_server_left() {
    let log = log_path("kvshard-killed");
    let mut first = Server::start_logged_auto_shm(&[], &log);
    let left = pool_of(&first);
    let _ = first.child.kill();
    let _ = first.child.wait();
    assert!(left.exists(), "SIGKILL leaves the pool behind");
    // A pool a live server holds is not touched.
    let live_log = log_path("kvshard-live");
    let live = Server::start_logged_auto_shm(&[], &live_log);
    let second_log = log_path("kvshard-next");
    let second = Server::start_logged_auto_shm(&[], &second_log);
    assert!(
        !left.exists(),
        "the dead server's pool is removed at a start"
    );
    assert!(pool_of(&live).exists() && pool_of(&second).exists());
    drop((live, second));
    for l in [log, live_log, second_log] {
        let _ = std::fs::remove_file(l);
    }
}

/// lmcache 0.5.6's worker heartbeat (`HeartbeatThread._execute` in
/// `integration/vllm/vllm_multi_process_adapter.py`): a PING per interval; on
/// an unhealthy-to-healthy edge the recover callback (the worker registers
/// its KV caches again) runs before the worker counts the server as healthy.
/// While unhealthy the worker skips its transfers.
struct Heartbeat {
    iid: i64,
    healthy: bool,
}

impl Heartbeat {
    fn beat(&mut self, c: &mut Client, reregister: impl FnOnce(&mut Client)) {
        let was = self.healthy;
        let ok = c.call(OP_PING, &[V::I(self.iid)]) == Some(V::B(true));
        if ok && !was {
            reregister(c);
        }
        self.healthy = ok;
    }
}

#[test]
fn a_worker_that_outlives_a_restart_registers_again_within_two_heartbeats() {
    let mut srv = Server::start(&[]);
    let iid = 7;
    let mut c = srv.client();
    let (name, size) = ed_register(&mut c, iid, "m");
    let mut pool = ShmMap::open(&name, size);
    let mut hb = Heartbeat { iid, healthy: true };
    hb.beat(&mut c, |_| unreachable!("healthy all along"));
    assert!(hb.healthy);
    let toks = ed_tokens(5, 4 * ED_CHUNK);
    let key = ed_key("m", Some(0), &toks, 2, "before");
    assert_eq!(ed_store(&mut c, &mut pool, &key, iid, 1).len(), 2);

    // The server dies and comes back on the same ports with an empty L1 and
    // no registrations; the worker's connection reconnects by itself.
    srv.kill_and_restart();
    let pool = std::cell::RefCell::new(None);
    let reregister = |c: &mut Client| {
        let (name, size) = ed_register(c, iid, "m");
        *pool.borrow_mut() = Some(ShmMap::open(&name, size));
    };

    // First heartbeat after the restart: unhealthy, so the worker degrades
    // instead of storing into a server that does not know it.
    hb.beat(&mut c, reregister);
    assert!(
        !hb.healthy,
        "the first PING of an unknown instance is unhealthy"
    );
    assert_eq!(
        srv.metric("kvshard_unknown_instance_pings_total", &[]),
        Some(1.0)
    );
    // Second heartbeat: healthy again, and the edge re-registered it.
    hb.beat(&mut c, reregister);
    assert!(hb.healthy);
    let mut pool = pool.into_inner().expect("registered again on the edge");

    // Storing again: the chunks land and a scheduler lookup finds them.
    let key = ed_key("m", Some(0), &toks, 4, "after");
    let stored = ed_store(&mut c, &mut pool, &key, iid, 2);
    assert_eq!(stored.len(), 4);
    let lookup = ed_key("m", None, &toks, 4, "look");
    assert_eq!(ed_lookup(&mut c, &lookup), 4);
    assert_eq!(
        ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 4, "look"), iid),
        stored
    );

    // Registered now: its heartbeats stay healthy, and nothing more is counted.
    hb.beat(&mut c, |_| unreachable!("no edge while healthy"));
    assert!(hb.healthy);
    assert_eq!(
        srv.metric("kvshard_unknown_instance_pings_total", &[]),
        Some(1.0)
    );
}

/// Runs `kvshard server` with the support defaults plus `extra` inside the
/// memory cgroup `cgroup` (v1 or v2 directory) when given, expecting it to
/// refuse the start; returns its stderr.
fn refused_in(extra: &[&str], cgroup: Option<&Path>) -> String {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(kvshard_bin());
    cmd.args(["server", "--eviction-policy", "LRU", "--host", "127.0.0.1"])
        .args(["--port", &free_port().to_string()])
        .args(["--http-port", &free_port().to_string()])
        .args(extra)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    if let Some(dir) = cgroup {
        let procs = std::ffi::CString::new(dir.join("cgroup.procs").to_str().unwrap()).unwrap();
        // SAFETY: between fork and exec only async-signal-safe calls:
        // open, write, close of a path prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // "0" is the writing process itself.
                let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                libc::close(fd);
                if ok {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
    let out = cmd
        .spawn()
        .expect("spawn kvshard")
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{extra:?} started: {err}");
    err
}

/// A memory cgroup of its own with `limit` bytes, removed on drop; `None`
/// (after saying why) where cgroups cannot be made here.
struct MemoryCgroup(PathBuf);

impl MemoryCgroup {
    fn new(limit: u64) -> Option<MemoryCgroup> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let (parent, file) = own.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
            let rel = path.trim_start_matches('/');
            if ctl.split(',').any(|c| c == "memory") {
                Some((
                    Path::new("/sys/fs/cgroup/memory").join(rel),
                    "memory.limit_in_bytes",
                ))
            } else if ctl.is_empty() && Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
                Some((Path::new("/sys/fs/cgroup").join(rel), "memory.max"))
            } else {
                None
            }
        })?;
        let dir = parent.join(unique("kvshard-test"));
        let made = std::fs::create_dir(&dir)
            .and_then(|()| std::fs::write(dir.join(file), limit.to_string()));
        match made {
            Ok(()) => Some(MemoryCgroup(dir)),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                if std::env::var_os("KVSHARD_REQUIRE_MOUNTS").is_some_and(|v| v == "1") {
                    panic!("a memory cgroup is required (KVSHARD_REQUIRE_MOUNTS=1): {e}");
                }
                eprintln!("SKIPPED: cannot make a memory cgroup here ({e})");
                None
            }
        }
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_default_lazy_8_gib_l1_serves_at_once_and_faults_ahead_of_use() {
    let t0 = Instant::now();
    let srv = Server::start(&["--l1-size-gb", "8"]);
    let took = t0.elapsed();
    let rss = srv.rss_split();
    eprintln!(
        "8 GiB lazy L1: answered {took:?} after the spawn; {} of its {} bytes resident, {} outside",
        rss.arena_rss, rss.arena_size, rss.outside
    );
    // The old start locked the whole initial size (min(20 GiB, 8 GiB))
    // before serving: 12 s and 8.4 GB resident on this kind of machine.
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(rss.arena_size, 8 << 30);
    // What is faulted is a lead ahead of use (256 MiB), and no more.
    wait_until("the lead faulted", || {
        srv.rss_split().arena_rss >= 256 << 20
    });
    std::thread::sleep(Duration::from_millis(500));
    let rss = srv.rss_split();
    assert!(rss.arena_rss < 1 << 30, "{} bytes faulted", rss.arena_rss);
    let mut srv = srv;
    assert_serving(&mut srv);
}

#[test]
fn an_l1_larger_than_the_memory_there_is_refused_with_both_figures() {
    let huge = (100_000u64 << 30).to_string();
    for (extra, needs) in [
        (
            vec![
                "--l1-size-gb",
                "100000",
                "--no-l1-use-lazy",
                "--shm-name",
                "",
            ],
            "all of --l1-size-gb",
        ),
        (
            vec!["--l1-size-gb", "100000", "--l1-init-size-gb", "100000"],
            "--l1-init-size-gb",
        ),
    ] {
        let err = refused_in(&extra, None);
        assert!(err.contains(&format!("needs {huge} bytes")), "{err}");
        assert!(err.contains("MemAvailable"), "{err}");
        assert!(err.contains(needs), "{err}");
    }
    // A memory cgroup's limit counts too, with its own figure.
    let Some(cg) = MemoryCgroup::new(256 << 20) else {
        return;
    };
    let err = refused_in(
        &["--l1-size-gb", "1", "--no-l1-use-lazy", "--shm-name", ""],
        Some(&cg.0),
    );
    assert!(
        err.contains(&format!("needs {} bytes", 1u64 << 30)),
        "{err}"
    );
    assert!(
        err.contains(&format!("memory cgroup limit {}", 256u64 << 20)),
        "{err}"
    );
}
