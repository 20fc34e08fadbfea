//! End to end: what an operator runs into with a live deployment. Idle HTTP
//! clients, huge request frames, a second start with the same `--shm-name`, one
//! instance registered in both transfer modes, lookup locks of workers that went
//! away, floods of bad frames in the log, and the L1 allocation counters.

mod support;
use support::*;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A GET on a fresh connection; fails the test unless it answers 200 within
/// `limit`. Returns the body.
fn get_within(srv: &Server, path: &str, limit: Duration) -> String {
    let started = Instant::now();
    let mut st = TcpStream::connect(("127.0.0.1", srv.http_port)).unwrap();
    st.set_read_timeout(Some(limit)).unwrap();
    write!(
        st,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    st.read_to_string(&mut out)
        .unwrap_or_else(|e| panic!("GET {path}: no answer within {limit:?}: {e}"));
    assert!(
        started.elapsed() < limit,
        "GET {path} took {:?}",
        started.elapsed()
    );
    assert!(out.starts_with("HTTP/1.1 200"), "GET {path}: {out}");
    out
}

fn metric(srv: &Server, name: &str) -> f64 {
    srv.metric(name, &[])
        .unwrap_or_else(|| panic!("{name} is not exposed"))
}

/// `count` connections to the HTTP port that each sent a partial request line.
fn idle_http_clients(srv: &Server, count: usize) -> Vec<TcpStream> {
    (0..count)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", srv.http_port)).unwrap();
            s.write_all(b"GET /status HTTP/1.1\r\n").unwrap();
            s
        })
        .collect()
}

#[test]
fn idle_http_clients_never_keep_healthcheck_and_metrics_waiting() {
    let srv = Server::start(&["--http-max-connections", "256"]);
    let limit = Duration::from_secs(1);
    let mut held = idle_http_clients(&srv, 200);
    get_within(&srv, "/healthcheck", limit);
    get_within(&srv, "/metrics", limit);
    assert_eq!(
        metric(&srv, "kvshard_http_connections_shed_total"),
        0.0,
        "under the bound nothing gives way"
    );
    // 300 idle clients against a bound of 256: the ones that have waited
    // longest make room for the newcomers.
    held.extend(idle_http_clients(&srv, 100));
    get_within(&srv, "/healthcheck", limit);
    let text = get_within(&srv, "/metrics", limit);
    assert_eq!(metric(&srv, "kvshard_http_connections_max"), 256.0);
    let shed = metric(&srv, "kvshard_http_connections_shed_total");
    assert!(shed >= 44.0, "shed {shed}\n{text}");
    let open = metric(&srv, "kvshard_http_connections_open");
    assert!(open <= 256.0, "open {open}");
    // The oldest idle client was closed without an answer.
    let mut first = held.swap_remove(0);
    first
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut rest = Vec::new();
    assert_eq!(first.read_to_end(&mut rest).unwrap_or(0), 0);
    drop(held);
    let mut srv = srv;
    assert_serving(&mut srv);
}

/// A commit_store whose `data` frame is a msgpack bin of `len` bytes (the
/// pickle fallback's shape), sent raw; returns the uid.
fn send_commit_store_with_data(c: &mut Client, len: usize) -> i64 {
    let toks = ed_tokens(7, 2 * ED_CHUNK);
    let key = ed_key("m", Some(0), &toks, 2, "pickled");
    let mut data = Vec::with_capacity(len + 5);
    data.push(0xc6);
    data.extend((len as u32).to_be_bytes());
    data.resize(len + 5, 0x5a);
    c.send_raw(vec![
        enc(&V::I(OP_COMMIT_STORE)),
        enc(&key),
        enc(&V::I(1)),
        data,
    ])
}

/// Sends a commit_store carrying `mib` MiB of data; it must be answered with
/// the failure reply, not dropped or left hanging. The bound is generous:
/// moving a few hundred MiB over loopback on a loaded 2-core machine can take
/// seconds, and speed is the benchmarks' business.
fn commit_store_is_refused_in_time(c: &mut Client, mib: usize) {
    c.sock.set_rcvtimeo(60_000).unwrap();
    let started = Instant::now();
    let uid = send_commit_store_with_data(c, mib << 20);
    let r = c.recv(uid);
    assert_eq!(r.payload, Some(V::B(false)), "{mib} MiB: failure reply");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{mib} MiB answered after {:?}",
        started.elapsed()
    );
}

#[test]
fn request_frames_of_every_size_get_a_reply() {
    // The default limit takes a pickled store of 8 chunks of 32 MiB: such a
    // frame reaches its handler, which refuses the pickle path by name.
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    ed_register(&mut c, 1, "m");
    commit_store_is_refused_in_time(&mut c, 257);
    assert_eq!(metric(&srv, "kvshard_pickle_stores_refused_total"), 1.0);
    assert_eq!(metric(&srv, "kvshard_oversized_frames_total"), 0.0);
    assert_serving(&mut srv);
    drop(srv);

    // Under a 256 MiB limit, the larger frames are answered as too large.
    let mut srv = Server::start(&["--max-frame-bytes", "268435456"]);
    let mut c = srv.client();
    ed_register(&mut c, 1, "m");
    for mib in [255, 257, 400] {
        commit_store_is_refused_in_time(&mut c, mib);
    }
    assert_eq!(metric(&srv, "kvshard_pickle_stores_refused_total"), 1.0);
    assert_eq!(metric(&srv, "kvshard_oversized_frames_total"), 2.0);
    assert_serving(&mut srv);
}

#[test]
fn a_second_start_with_the_same_shm_name_leaves_the_first_serving() {
    use std::os::unix::fs::MetadataExt;
    let mut first = Server::start(&[]);
    let segment = format!("/dev/shm/{}", first.shm_name);
    let inode = std::fs::metadata(&segment).unwrap().ino();

    // The very same command line again.
    let second = Command::new(env!("CARGO_BIN_EXE_kvshard"))
        .args(&first.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run the second server");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "the second start must fail");
    let holder = format!("in use by process {}", first.child.id());
    assert!(
        stderr.contains(&holder) && stderr.contains("--shm-name"),
        "the failure names the process holding the segment: {stderr}"
    );
    assert_eq!(
        std::fs::metadata(&segment).map(|m| m.ino()).ok(),
        Some(inode),
        "the live server's segment is untouched"
    );
    // New engine_driven clients still map the pool and round-trip through it.
    assert_serving(&mut first);

    // After the first server stops, its segment is gone and the name is free.
    drop(first);
    assert!(!std::path::Path::new(&segment).exists());
}

#[test]
fn one_instance_registers_in_both_transfer_modes() {
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let iid = 42;
    let (name, size) = ed_register(&mut c, iid, "m");
    let (mut layer, desc) = lm_layer("both");
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(iid, desc)),
        None
    );
    let status = srv.get_json("/status");
    assert_eq!(status["registered_gpu_ids"], serde_json::json!([iid]));
    assert_eq!(
        status["registered_non_cuda_instance_ids"],
        serde_json::json!([iid])
    );

    // lmcache_driven: the store gathers block 1 of the layer.
    layer.bytes_mut().fill(0x33);
    let toks = ed_tokens(3, ED_CHUNK);
    let lm_key = ipc_key("lm", 1, Some(0), &toks, 0, ED_CHUNK as i64, "lm-req", 1);
    let stored = c.call(
        OP_STORE,
        &[
            lm_key,
            V::I(iid),
            V::A(vec![V::A(vec![V::I(1)])]),
            V::Bin(b"stub_ipc_handle".to_vec()),
        ],
    );
    assert_eq!(
        stored,
        Some(V::A(vec![V::Bin(vec![]), V::B(true)])),
        "an lmcache_driven store of an instance also registered engine_driven"
    );
    // engine_driven under the same id still works.
    let mut pool = ShmMap::open(&name, size);
    let ed = ed_key("m", Some(0), &toks, 1, "ed-req");
    assert_eq!(ed_store(&mut c, &mut pool, &ed, iid, 5).len(), 1);

    // Unregistering one mode leaves the other.
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(iid)]), None);
    let status = srv.get_json("/status");
    assert_eq!(status["registered_gpu_ids"], serde_json::json!([]));
    assert_eq!(
        status["registered_non_cuda_instance_ids"],
        serde_json::json!([iid])
    );
    let ed2 = ed_key("m", Some(0), &ed_tokens(4, ED_CHUNK), 1, "ed-req-2");
    assert_eq!(ed_store(&mut c, &mut pool, &ed2, iid, 6).len(), 1);
    assert_serving(&mut srv);
}

#[test]
fn lookup_locks_go_with_the_last_worker_that_could_read_them() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    // Worker 1 stores 3 chunks; the scheduler's lookup read-locks them for it.
    let toks = ed_tokens(11, 3 * ED_CHUNK);
    ed_store_chunks(&srv, 1, &toks, 3, 1);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "req")), 3);
    assert_eq!(srv.l1_count("read_locked_count"), 3);
    // Another worker of the same model could still read them.
    ed_register(&mut c, 2, "m");
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(1)]), None);
    assert_eq!(
        srv.l1_count("read_locked_count"),
        3,
        "worker 2 may still retrieve"
    );
    assert_eq!(
        metric(&srv, "kvshard_orphaned_read_locks_released_total"),
        0.0
    );
    // Now nobody can: the locks go at once instead of after the 300 s TTL.
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(2)]), None);
    wait_until("the orphaned locks to be released", || {
        srv.l1_count("read_locked_count") == 0
    });
    assert_eq!(
        metric(&srv, "kvshard_orphaned_read_locks_released_total"),
        3.0
    );
    assert_eq!(metric(&srv, "kvshard_lookup_leases"), 0.0);

    // A worker that retrieved its share leaves nothing behind to release.
    let toks = ed_tokens(12, 3 * ED_CHUNK);
    ed_store_chunks(&srv, 3, &toks, 3, 2);
    let (hits, back) = ed_lookup_retrieve(&srv, 3, &toks, 3, "req-2");
    assert_eq!((hits, back.len()), (3, 3));
    assert_eq!(srv.l1_count("read_locked_count"), 0);
    assert_eq!(metric(&srv, "kvshard_lookup_leases"), 0.0);
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(3)]), None);
    assert_eq!(
        metric(&srv, "kvshard_orphaned_read_locks_released_total"),
        3.0
    );
}

#[test]
fn a_flood_of_bad_frames_writes_a_bounded_log_and_exact_counters() {
    let dir = std::env::temp_dir().join(unique("kvshard-log"));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("server.log");
    let mut srv = Server::start_logged(&[], &log);
    let mut c = srv.client();
    let n = 20_000;
    // Unknown operations, each answered with no payload. Pipelined in batches
    // below ZeroMQ's queue bound (1000 messages): the server never waits on a
    // client, so replies to one that stops reading past that bound are dropped.
    for _ in 0..n / 500 {
        let uids: Vec<i64> = (0..500)
            .map(|_| c.send_raw(vec![enc(&s("no_such_operation"))]))
            .collect();
        for uid in uids {
            assert_eq!(c.recv(uid).payload, None);
        }
    }
    assert_eq!(metric(&srv, "kvshard_unknown_ops_total"), n as f64);
    let text = || std::fs::read_to_string(&log).unwrap();
    let lines = text()
        .lines()
        .filter(|l| l.contains("unknown operation"))
        .count();
    assert!(
        (1..=20).contains(&lines),
        "{lines} log lines for {n} bad frames"
    );
    // Once the rate-limit window ends, the count of what was left out is logged.
    wait_until("the suppressed-lines summary", || {
        text().contains("lines from") && text().contains("were not logged")
    });
    assert!(
        std::fs::metadata(&log).unwrap().len() < 64 * 1024,
        "the log stays small"
    );
    assert_serving(&mut srv);
    let _ = std::fs::remove_dir_all(&dir);
}
