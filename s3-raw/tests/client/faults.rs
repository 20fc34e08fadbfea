//! Servers that misbehave: throttling, stalling, cutting bodies short,
//! lying about sizes, dying; and a PUT future dropped mid-flight.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_s3_raw::breaker::BreakerConfig;
use kvshard_s3_raw::error::Cause;
use kvshard_s3_raw::retry::RetryConfig;
use kvshard_s3_raw::{ErrorKind, Op, Outcome, RecvRegion, S3Client, SendRegion};

use crate::support::*;

const SLOW_DOWN: &[u8] = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message><RequestId>R1</RequestId></Error>";

fn slow_down(stream: &mut TcpStream, req: &SeenRequest) -> Action {
    if !skip_body(stream, req.body_len) {
        return Action::Close;
    }
    respond(
        stream,
        "503 Slow Down",
        &[("Content-Type", "application/xml")],
        SLOW_DOWN,
    );
    Action::KeepAlive
}

#[test]
fn slow_down_is_throttled_retried_and_bounded_by_the_budget() {
    let server = ScriptedServer::start(Arc::new(|_, req, stream| slow_down(stream, req)));
    let counter = server.requests.clone();
    let mut cfg = test_config(local_address("kvshard-throttle", server.port), false);
    cfg.retry.max_attempts = 3;
    let mut tight = cfg.clone();
    tight.retry = RetryConfig {
        budget_tokens: 5,
        ..cfg.retry.clone()
    };
    on_shard("s3-throttle", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let e = client
            .put_object("k@1", SendRegion::from_vec(vec![5; 1000]))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Throttled, "{e}");
        assert_eq!(e.s3_code(), Some("SlowDown"));
        assert_eq!(e.status(), Some(503));
        assert_eq!(e.attempts(), 3);
        assert_eq!(counter.load(Ordering::SeqCst), 3);
        let stats = client.stats();
        assert_eq!(stats.retries, 2);
        assert_eq!(
            stats.count(Op::PutObject, Outcome::Failed(ErrorKind::Throttled)),
            3
        );
        assert_eq!(client.breaker_status().connection_failures, 0);

        // A budget of one retry: the second failure comes back at once.
        let client = S3Client::new(tight).unwrap();
        let before = counter.load(Ordering::SeqCst);
        let mut buf = vec![0u8; 10];
        let e = client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Throttled, "{e}");
        assert_eq!(e.attempts(), 2);
        assert!(e.to_string().contains("retry budget exhausted"), "{e}");
        assert_eq!(counter.load(Ordering::SeqCst) - before, 2);
        let stats = client.stats();
        assert_eq!((stats.retries, stats.retry_budget_exhausted), (1, 1));
        assert_eq!(client.retry_budget_available(), 0);
    });
}

#[test]
fn throttled_then_ok_succeeds_after_a_retry() {
    let data = Arc::new(pattern(200_000, 3));
    let body = data.clone();
    let server = ScriptedServer::start(Arc::new(move |n, req, stream| {
        if n == 0 {
            return slow_down(stream, req);
        }
        respond(stream, "200 OK", &[], &body);
        Action::KeepAlive
    }));
    let cfg = test_config(local_address("kvshard-recover", server.port), false);
    on_shard("s3-recover", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let mut back = vec![0u8; data.len()];
        client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut back))
            .await
            .unwrap();
        assert!(back == *data);
        let stats = client.stats();
        assert_eq!(stats.retries, 1);
        assert_eq!(stats.count(Op::GetObject, Outcome::Ok), 1);
        assert_eq!(
            stats.count(Op::GetObject, Outcome::Failed(ErrorKind::Throttled)),
            1
        );
    });
    drop(server);
}

#[test]
fn stalled_server_hits_the_attempt_deadline() {
    let server = ScriptedServer::start(Arc::new(|_, req, stream| {
        skip_body(stream, req.body_len);
        // Never answer; hold the socket for a while.
        std::thread::sleep(Duration::from_secs(3));
        Action::Close
    }));
    let counter = server.requests.clone();
    let mut cfg = test_config(local_address("kvshard-stall", server.port), false);
    cfg.request_timeout = Duration::from_millis(300);
    cfg.retry.max_attempts = 2;
    on_shard("s3-stall", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let started = Instant::now();
        let e = client.head_object("k@1").await.unwrap_err();
        let took = started.elapsed();
        assert_eq!(e.kind(), ErrorKind::Transient, "{e}");
        assert!(matches!(e.cause(), Cause::Timeout { .. }), "{e}");
        assert_eq!(e.attempts(), 2);
        assert!(
            took >= Duration::from_millis(600) && took < Duration::from_secs(3),
            "{took:?}"
        );
        assert_eq!(counter.load(Ordering::SeqCst), 2);
        let stats = client.stats();
        assert_eq!(stats.retries, 1);
        // Timeouts are connection-level failures for the breaker.
        assert_eq!(client.breaker_status().connection_failures, 2);

        let mut buf = vec![0xaa; 1000];
        let e = client
            .get_object_into("k@2", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Transient | ErrorKind::Unavailable),
            "{e}"
        );
    });
}

#[test]
fn the_operation_deadline_bounds_all_attempts() {
    let server = ScriptedServer::start(Arc::new(|_, req, stream| {
        skip_body(stream, req.body_len);
        std::thread::sleep(Duration::from_secs(3));
        Action::Close
    }));
    let mut cfg = test_config(local_address("kvshard-deadline", server.port), false);
    cfg.request_timeout = Duration::from_millis(200);
    cfg.operation_timeout = Duration::from_millis(500);
    cfg.retry.max_attempts = 50;
    cfg.breaker.failure_threshold = 1000;
    on_shard("s3-deadline", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let started = Instant::now();
        let e = client.head_object("k@1").await.unwrap_err();
        let took = started.elapsed();
        assert_eq!(e.kind(), ErrorKind::Transient, "{e}");
        assert!(took < Duration::from_millis(1500), "{took:?}: {e}");
        assert!(e.attempts() >= 2 && e.attempts() <= 4, "{e}");
    });
}

/// Answers GETs (whole or ranged) for an object of `len` bytes, sending
/// only half of each body before closing.
fn cut_short(len: usize) -> Arc<Script> {
    let data = Arc::new(pattern(len, 11));
    Arc::new(move |_, req, stream| {
        let range = req
            .headers
            .iter()
            .find(|(k, _)| k == "range")
            .map(|(_, v)| v.clone());
        let (status, start, end, extra) = match range {
            Some(r) => {
                let (a, b) = r.trim_start_matches("bytes=").split_once('-').unwrap();
                let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
                (
                    "206 Partial Content",
                    a,
                    b + 1,
                    format!("Content-Range: bytes {a}-{b}/{len}\r\n"),
                )
            }
            None => ("200 OK", 0, len, String::new()),
        };
        let body = &data[start..end];
        let head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\n{extra}\r\n",
            body.len()
        );
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(&body[..body.len() / 2]);
        let _ = stream.flush();
        Action::Close
    })
}

#[test]
fn body_cut_mid_transfer_is_transient_and_never_ok() {
    let server = ScriptedServer::start(cut_short(300_000));
    let counter = server.requests.clone();
    let cfg = test_config(local_address("kvshard-cut", server.port), false);
    let ranged_server = ScriptedServer::start(cut_short(12 << 20));
    let ranged_cfg = test_config(local_address("kvshard-cut", ranged_server.port), false);
    on_shard("s3-cut", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let mut buf = vec![0u8; 300_000];
        let e = client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transient, "{e}");
        assert!(matches!(e.cause(), Cause::Io(_)), "{e}");
        assert_eq!(e.attempts(), 3);
        assert_eq!(counter.load(Ordering::SeqCst), 3);
        assert_eq!(client.stats().retries, 2);
        // Three connection failures in a row: the breaker opened.
        let st = client.breaker_status();
        assert!(st.open && st.trips == 1, "{st:?}");

        // Parallel ranged GETs (3 parts of at most 5 MiB) fail the same way.
        let client = S3Client::new(ranged_cfg).unwrap();
        let mut buf = vec![0u8; 12 << 20];
        let e = client
            .get_object_into("k@2", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::Transient | ErrorKind::Unavailable),
            "{e}"
        );
    });
    drop(server);
    drop(ranged_server);
}

#[test]
fn size_lies_are_fatal_and_not_retried() {
    // Whole GET: the object is larger than the destination.
    let big = Arc::new(pattern(2000, 5));
    let body = big.clone();
    let server = ScriptedServer::start(Arc::new(move |_, _, stream| {
        respond(stream, "200 OK", &[], &body);
        Action::KeepAlive
    }));
    // Ranged GET: the object's total size differs.
    let ranged = ScriptedServer::start(Arc::new(move |_, req, stream| {
        let r = req
            .headers
            .iter()
            .find(|(k, _)| k == "range")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let (a, b) = r.trim_start_matches("bytes=").split_once('-').unwrap();
        let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
        let content_range = format!("bytes {a}-{b}/{}", (12 << 20) + 1);
        respond(
            stream,
            "206 Partial Content",
            &[("Content-Range", &content_range)],
            &vec![1u8; b - a + 1],
        );
        Action::KeepAlive
    }));
    let counter = server.requests.clone();
    let ranged_counter = ranged.requests.clone();
    let cfg = test_config(local_address("kvshard-size", server.port), false);
    let ranged_cfg = test_config(local_address("kvshard-size", ranged.port), false);
    on_shard("s3-size", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let mut buf = vec![0u8; 1000];
        let e = client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fatal, "{e}");
        assert!(
            matches!(
                e.cause(),
                Cause::SizeMismatch {
                    expected: 1000,
                    actual: 2000
                }
            ),
            "{e}"
        );
        assert_eq!(e.attempts(), 1);
        assert_eq!(counter.load(Ordering::SeqCst), 1);

        let client = S3Client::new(ranged_cfg).unwrap();
        let mut buf = vec![0u8; 12 << 20];
        let e = client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fatal, "{e}");
        assert!(matches!(e.cause(), Cause::SizeMismatch { .. }), "{e}");
        assert_eq!(client.stats().retries, 0);
        // At most the parts in flight were asked for; none was retried.
        assert!(ranged_counter.load(Ordering::SeqCst) <= 4);
    });
    drop(server);
    drop(ranged);
}

#[test]
fn killed_server_trips_the_breaker_which_rearms_after_its_cooldown() {
    let mut server = S3sFs::start("kvshard-breaker");
    let mut cfg = test_config(server.path_style_address(), true);
    cfg.breaker = BreakerConfig {
        failure_threshold: 3,
        initial_cooldown: Duration::from_millis(300),
        max_cooldown: Duration::from_secs(2),
    };
    cfg.retry.max_attempts = 3;
    let data = pattern(50_000, 1);
    on_shard("s3-breaker-put", {
        let cfg = cfg.clone();
        let data = data.clone();
        move || async move {
            let client = S3Client::new(cfg).unwrap();
            client
                .put_object("k@1", SendRegion::from_vec(data))
                .await
                .unwrap();
        }
    });
    server.kill();
    let server = Arc::new(std::sync::Mutex::new(server));
    let restart = server.clone();
    on_shard("s3-breaker", move || async move {
        let client = S3Client::new(cfg).unwrap();
        // Three refused connections: the operation fails and the breaker opens.
        let e = client.head_object("k@1").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transient, "{e}");
        assert!(matches!(e.cause(), Cause::Connect(_)), "{e}");
        assert_eq!(e.attempts(), 3);
        let st = client.breaker_status();
        assert!(st.open && st.trips == 1, "{st:?}");
        assert!(
            st.retry_in_seconds > 0.0 && st.retry_in_seconds <= 0.3,
            "{st:?}"
        );

        // Open: fail fast, nothing sent.
        let e = client.head_object("k@1").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        assert!(matches!(e.cause(), Cause::BreakerOpen { .. }));
        assert_eq!(e.attempts(), 0);
        let mut buf = vec![0u8; 50_000];
        let e = client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        let stats = client.stats();
        assert_eq!(stats.sent(Op::HeadObject), 3);
        assert_eq!(
            stats.count(Op::HeadObject, Outcome::Failed(ErrorKind::Unavailable)),
            1
        );
        assert_eq!(stats.breaker_trips, 1);

        // After the cooldown it re-arms; still dead, it trips again with a
        // doubled cooldown.
        glommio::timer::sleep(Duration::from_millis(350)).await;
        assert!(!client.breaker_status().open);
        let e = client.head_object("k@1").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transient, "{e}");
        let st = client.breaker_status();
        assert!(st.open && st.trips == 2, "{st:?}");
        assert!(
            st.retry_in_seconds > 0.3 && st.retry_in_seconds <= 0.6,
            "{st:?}"
        );

        // Server back, cooldown over: requests flow and the count resets.
        restart.lock().unwrap().restart();
        glommio::timer::sleep(Duration::from_millis(650)).await;
        assert_eq!(client.head_object("k@1").await.unwrap(), Some(50_000));
        let mut buf = vec![0u8; 50_000];
        client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap();
        assert!(buf == pattern(50_000, 1));
        let st = client.breaker_status();
        assert!(
            !st.open && st.connection_failures == 0 && st.trips == 2,
            "{st:?}"
        );
        assert!((st.next_cooldown_seconds - 0.3).abs() < 1e-9, "{st:?}");
    });
    drop(server);
}

/// An anonymous mapping unmapped on drop: reading it afterwards faults.
struct Mapped {
    addr: usize,
    len: usize,
    dropped: Arc<AtomicBool>,
}

impl Mapped {
    fn new(data: &[u8], dropped: Arc<AtomicBool>) -> Mapped {
        // SAFETY: a fresh private anonymous mapping of `len` bytes.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                data.len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        // SAFETY: the mapping is `data.len()` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr.cast(), data.len()) };
        Mapped {
            addr: addr as usize,
            len: data.len(),
            dropped,
        }
    }
}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: mapped until drop.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        self.dropped.store(true, Ordering::SeqCst);
    }
}

#[test]
fn dropping_a_put_mid_flight_never_reads_freed_memory() {
    let len = 8 << 20;
    let data = Arc::new(pattern(len, 21));
    let checked = Arc::new(AtomicUsize::new(0));
    let mismatches = Arc::new(AtomicUsize::new(0));
    let server = {
        let (data, checked, mismatches) = (data.clone(), checked.clone(), mismatches.clone());
        // Reads the body slowly and checks every byte against the pattern.
        ScriptedServer::start(Arc::new(move |_, req, stream| {
            let mut buf = vec![0u8; 16 << 10];
            let mut at = 0;
            while at < req.body_len {
                let n = match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if buf[..n] != data[at..at + n] {
                    mismatches.fetch_add(1, Ordering::SeqCst);
                }
                at += n;
                checked.store(at, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
            Action::Close
        }))
    };
    let mut cfg = test_config(local_address("kvshard-drop", server.port), false);
    cfg.multipart_threshold_bytes = 64 << 20;
    let dropped = Arc::new(AtomicBool::new(false));
    {
        let (data, dropped, checked) = (data.clone(), dropped.clone(), checked.clone());
        on_shard("s3-drop", move || async move {
            let client = S3Client::new(cfg).unwrap();
            let region = SendRegion::from_owner(Mapped::new(&data, dropped.clone()));
            drop(data);
            let put = client.put_object("k@1", region);
            let outcome = futures_lite::future::or(async { Some(put.await) }, async {
                glommio::timer::sleep(Duration::from_millis(200)).await;
                None
            })
            .await;
            assert!(outcome.is_none(), "the PUT cannot finish this fast");
            assert!(
                checked.load(Ordering::SeqCst) > 0,
                "the server got some bytes"
            );
            // The connection is closed and the mapping released soon after.
            let started = Instant::now();
            while !dropped.load(Ordering::SeqCst) {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "the body owner was never released"
                );
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(client.stats().connections.discarded, 1);
        });
    }
    // Let the server drain what the kernel still buffers.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(mismatches.load(Ordering::SeqCst), 0);
    assert!(
        checked.load(Ordering::SeqCst) < len,
        "the upload was cut off"
    );
    drop(server);
}
