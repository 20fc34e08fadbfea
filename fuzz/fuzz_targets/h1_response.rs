//! s3-raw's HTTP/1.1 client connection (`h1::H1Conn`) reading an arbitrary
//! response: the head (httparse, interim 1xx answers, header checks, framing by
//! `Transfer-Encoding`/`Content-Length`/close) and the body (chunk lines,
//! chunk data, trailers, bodies that end early or run long).
//!
//! The connection is the real one, on a glommio executor, over one end of a
//! Unix socket pair: the other end holds the response and is shut down for
//! writing, so every read ends at the input's last byte and nothing can wait.
//! (The connection's TCP socket options fail harmlessly there, as they may on
//! any socket: it ignores their errors.)
//!
//! Input: one byte choosing how the caller asks (HEAD or not; which body
//! reader, with which buffer size or limit), then the response bytes.

#![no_main]

use std::io::Write;
use std::net::Shutdown;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::os::unix::net::UnixStream;

use bytes::Bytes;
use glommio::{LocalExecutor, LocalExecutorBuilder, Placement};
use kvshard_s3_raw::h1::{H1Conn, HttpError};
use kvshard_s3_raw::net::Stream;
use libfuzzer_sys::fuzz_target;

/// More than the connection's largest response head (64 KiB), so that limit
/// is reached too.
const MAX_RESPONSE_BYTES: usize = 128 * 1024;

/// What the S3 client sends; the bytes themselves do not matter here.
const REQUEST: &[u8] = b"GET /bucket/key HTTP/1.1\r\nhost: s3.localhost\r\n\r\n";

/// Buffer sizes and limits for the body readers: empty, tiny, around the
/// connection's 16 KiB buffer, and larger than any input.
const SIZES: [usize; 8] = [0, 1, 7, 100, 4096, 16 * 1024, 65_536, 200_000];

thread_local! {
    static EXECUTOR: LocalExecutor = LocalExecutorBuilder::new(Placement::Unbound)
        .make()
        .expect("a glommio executor (io_uring, locked memory)");
}

fn set_sndbuf(s: &UnixStream, bytes: libc::c_int) {
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt reads one c_int from a valid pointer.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &bytes as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

async fn read_response(client: UnixStream, mode: u8) -> Result<(), HttpError> {
    // SAFETY: the fd is an open stream socket that nothing else owns. (A
    // glommio socket is made inside its executor.)
    let stream = unsafe { glommio::net::TcpStream::from_raw_fd(client.into_raw_fd()) };
    let mut conn = H1Conn::new(Stream::Tcp(stream));
    let expect_body = mode & 0x80 == 0;
    let size = SIZES[usize::from(mode & 0x07)];
    let head = conn.exchange(REQUEST, &Bytes::new(), expect_body).await?;
    assert!(
        !(100..200).contains(&head.status),
        "interim answer {} returned as the response",
        head.status
    );
    if !expect_body {
        assert!(conn.body_done(), "a HEAD answer has no body");
    }
    match (mode >> 3) & 0x03 {
        0 => {
            let mut out = Vec::new();
            let (received, within) = conn.read_body_limited(&mut out, size).await?;
            assert!(out.len() <= size && out.len() <= received);
            if within {
                assert_eq!(out.len(), received);
                assert!(conn.body_done());
            }
        }
        1 => {
            let mut dst = vec![0u8; size];
            let n = conn.read_body_into(&mut dst).await?;
            assert!(n <= size);
            assert!(conn.body_done());
        }
        2 => {
            // A caller that stops after a few pieces.
            let mut pieces = 0;
            conn.read_body(|_| {
                pieces += 1;
                pieces < 3
            })
            .await?;
            if !conn.body_done() {
                assert!(!conn.is_reusable());
            }
        }
        _ => {
            conn.read_body(|_| true).await?;
            assert!(conn.body_done());
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, response)) = data.split_first() else {
        return;
    };
    let response = &response[..response.len().min(MAX_RESPONSE_BYTES)];
    let (client, mut server) = UnixStream::pair().expect("socketpair");
    // The whole response is written before the client reads.
    set_sndbuf(&server, 1 << 20);
    server.write_all(response).expect("write the response");
    server
        .shutdown(Shutdown::Write)
        .expect("shut down the writing end");
    client
        .set_nonblocking(true)
        .expect("non-blocking client end");
    let _ = EXECUTOR.with(|ex| ex.run(read_response(client, mode)));
    drop(server);
});
