//! Our HTTP/1.1 connections against hand-written servers that frame their
//! answers in the ways HTTP/1.1 allows and S3 servers use: chunked bodies
//! cut anywhere, interim 100 answers, bodies written in small pieces with
//! pauses (the receive low-water mark must never wait for bytes that will
//! not come), `Connection: close`, idle connections the server closes, and
//! bodies that are short or too long.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvshard_s3_raw::error::Cause;
use kvshard_s3_raw::http::Protocol;
use kvshard_s3_raw::{ErrorKind, RecvRegion, S3Client, S3Error};

use crate::support::*;

/// Writes `bytes` in pieces of `piece` bytes, pausing `pause` between them.
fn dribble(stream: &mut TcpStream, bytes: &[u8], piece: usize, pause: Duration) -> bool {
    for part in bytes.chunks(piece.max(1)) {
        if stream
            .write_all(part)
            .and_then(|()| stream.flush())
            .is_err()
        {
            return false;
        }
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
    true
}

fn chunked(body: &[u8], chunk: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, part) in body.chunks(chunk).enumerate() {
        // Extensions on some chunk lines, as the grammar allows.
        if i % 2 == 0 {
            out.extend_from_slice(format!("{:x};note=x\r\n", part.len()).as_bytes());
        } else {
            out.extend_from_slice(format!("{:X}\r\n", part.len()).as_bytes());
        }
        out.extend_from_slice(part);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\nx-trailer: done\r\n\r\n");
    out
}

async fn get(client: &S3Client, key: &str, len: usize) -> Result<Vec<u8>, S3Error> {
    let mut buf = vec![0u8; len];
    client
        .get_object_into(key, RecvRegion::from_mut_slice(&mut buf))
        .await?;
    Ok(buf)
}

#[test]
fn chunked_bodies_cut_anywhere_arrive_whole_and_the_connection_is_reused() {
    let body = pattern(300_007, 11);
    let wire = chunked(&body, 65_000);
    let server = ScriptedServer::start(Arc::new(move |n, req, stream| {
        if !skip_body(stream, req.body_len) {
            return Action::Close;
        }
        let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/octet-stream\r\n\r\n";
        let mut all = head.to_vec();
        all.extend_from_slice(&wire);
        // Odd piece sizes put cuts inside chunk lines, CRLFs and data.
        let piece = [7, 1, 4093, 65_536][n % 4];
        if dribble(stream, &all, piece, Duration::ZERO) {
            Action::KeepAlive
        } else {
            Action::Close
        }
    }));
    let cfg = test_config(local_address("kvshard-chunked", server.port), false);
    on_shard("s3-h1-chunked", move || async move {
        let client = S3Client::new(cfg).unwrap();
        for i in 0..4 {
            let back = get(&client, &format!("k{i}"), body.len())
                .await
                .expect("GET");
            assert!(back == body, "request {i}: bytes differ");
        }
        let stats = client.stats();
        assert_eq!(client.protocol(), Some(Protocol::Http1));
        assert_eq!(stats.connections.http1_opened, 1, "{:?}", stats.connections);
        assert_eq!(stats.retries, 0);
    });
}

#[test]
fn bodies_written_in_small_pieces_with_pauses_arrive_whole() {
    // 1 MiB + 5 in 8 KiB writes with pauses, then a 3-byte tail after a
    // longer pause: a reader that asked the kernel for more bytes than are
    // still to come would wait for the request deadline.
    let body = pattern((1 << 20) + 5, 12);
    let served = body.clone();
    let server = ScriptedServer::start(Arc::new(move |_, req, stream| {
        if !skip_body(stream, req.body_len) {
            return Action::Close;
        }
        let head = format!(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
            served.len()
        );
        let (bulk, tail) = served.split_at(served.len() - 3);
        let ok = dribble(stream, head.as_bytes(), 5, Duration::ZERO)
            && dribble(stream, bulk, 8192, Duration::from_micros(200))
            && {
                std::thread::sleep(Duration::from_millis(50));
                dribble(stream, tail, 1, Duration::from_millis(5))
            };
        if ok {
            Action::KeepAlive
        } else {
            Action::Close
        }
    }));
    let mut cfg = test_config(local_address("kvshard-dribble", server.port), false);
    cfg.request_timeout = Duration::from_secs(5);
    on_shard("s3-h1-dribble", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let t0 = std::time::Instant::now();
        let back = get(&client, "k", body.len()).await.expect("GET");
        assert!(back == body, "bytes differ");
        assert!(
            t0.elapsed() < Duration::from_secs(4),
            "the GET waited for bytes that were not coming: {:?}",
            t0.elapsed()
        );
        assert_eq!(client.stats().retries, 0);
    });
}

#[test]
fn connection_close_and_idle_closes_cost_no_attempt() {
    // Answer 0 says `Connection: close`; after answer 1 the server closes
    // the kept-alive connection while it is idle.
    let server = ScriptedServer::start(Arc::new(move |n, req, stream| {
        if !skip_body(stream, req.body_len) {
            return Action::Close;
        }
        match n {
            0 => {
                respond(stream, "200 OK", &[("Connection", "close")], b"abc");
                Action::Close
            }
            1 => {
                respond(stream, "200 OK", &[], b"abc");
                Action::Close
            }
            _ => {
                respond(stream, "200 OK", &[], b"abc");
                Action::KeepAlive
            }
        }
    }));
    let cfg = test_config(local_address("kvshard-closes", server.port), false);
    on_shard("s3-h1-close", move || async move {
        let client = S3Client::new(cfg).unwrap();
        for i in 0..4 {
            let back = get(&client, &format!("k{i}"), 3).await.expect("GET");
            assert_eq!(back, b"abc");
            // Let the idle close reach us before the next request.
            glommio::timer::sleep(Duration::from_millis(20)).await;
        }
        let stats = client.stats();
        assert_eq!(stats.retries, 0, "{stats:?}");
        assert_eq!(stats.connections.http1_opened, 3, "{:?}", stats.connections);
    });
}

#[test]
fn short_bodies_are_retried_and_long_ones_refused() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let seen = attempts.clone();
    let server = ScriptedServer::start(Arc::new(move |_, req, stream| {
        if !skip_body(stream, req.body_len) {
            return Action::Close;
        }
        if req.target.ends_with("/long") {
            respond(stream, "200 OK", &[], b"0123456789");
            return Action::KeepAlive;
        }
        if seen.fetch_add(1, Ordering::SeqCst) == 0 {
            // Announces 10 bytes, sends 4, hangs up.
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123");
            return Action::Close;
        }
        respond(stream, "200 OK", &[], b"0123456789");
        Action::KeepAlive
    }));
    let cfg = test_config(local_address("kvshard-short", server.port), false);
    on_shard("s3-h1-short", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let back = get(&client, "short", 10).await.expect("GET after a retry");
        assert_eq!(back, b"0123456789");
        assert_eq!(client.stats().retries, 1);
        let e = get(&client, "long", 4)
            .await
            .expect_err("10 bytes do not fit 4");
        assert_eq!(e.kind(), ErrorKind::Fatal, "{e}");
        assert!(
            matches!(
                e.cause(),
                Cause::SizeMismatch {
                    expected: 4,
                    actual: 10
                }
            ),
            "{e}"
        );
        assert_eq!(client.stats().retries, 1, "a size mismatch is not retried");
    });
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
}
