//! HTTP/1.1 client connections, written for S3's bulk transfers.
//!
//! One request at a time per connection (no pipelining), responses framed by
//! `Content-Length`, chunked transfer coding, or the end of the connection.
//! What it does that a general-purpose client does not:
//!
//! - **Bodies go straight into caller memory.** A response body with a
//!   `Content-Length` is read from the socket directly into the caller's
//!   buffer (an L1 slab object); only the few bytes that arrived together
//!   with the response head pass through the connection's small buffer. Over
//!   TLS the only copy is rustls's decryption.
//! - **Few wake-ups per body.** On plain TCP the socket's `SO_RCVLOWAT` is
//!   raised while a long body is read, so the kernel wakes us once per
//!   [`MAX_LOWAT`] bytes instead of once per segment the server happened to
//!   write. We know exactly how many body bytes are still in the socket, so
//!   the mark never asks for more than will come; the last [`TAIL_BYTES`]
//!   are read with the mark at 1 so that a server holding its final partial
//!   segment for our ACK (Nagle's algorithm) gets that ACK at once.
//! - **Quick ACKs.** Every read that returned data re-arms `TCP_QUICKACK`,
//!   for the same reason.
//!
//! Requests are written as they are: the head, then the body `Bytes`
//! (caller memory) with no copy.
//!
//! The HTTP credential sources ([`crate::credential_http`]) use the same
//! connections for their small exchanges, one request per connection.

use std::fmt;
use std::io;
use std::os::fd::RawFd;

use bytes::Bytes;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};

use crate::net::Stream;

/// Read buffer for response heads and small bodies.
const HEAD_BUFFER_BYTES: usize = 16 * 1024;
/// Largest response head accepted.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers in a response head.
const MAX_HEADERS: usize = 96;
/// Highest `SO_RCVLOWAT` set while reading a body.
pub const MAX_LOWAT: usize = 256 * 1024;
/// Body bytes read at the end with `SO_RCVLOWAT` at 1 (more than a
/// loopback segment, the largest a sender holds back for an ACK).
pub const TAIL_BYTES: usize = 80 * 1024;
/// Below this, raising `SO_RCVLOWAT` saves no wake-up worth a syscall.
const MIN_LOWAT: usize = 32 * 1024;
/// Request bodies up to this size are sent in one write with the head.
const COALESCE_BODY_BYTES: usize = 8 * 1024;

/// Why an exchange failed (either protocol).
#[derive(Debug)]
pub enum HttpError {
    /// hyper (HTTP/2) reported an error.
    Hyper(hyper::Error),
    /// The socket failed (reset, closed early, I/O error).
    Io(io::Error),
    /// The server closed the connection before sending any byte of the
    /// response: on a reused connection the request most likely never
    /// reached a live server.
    ClosedBeforeResponse,
    /// The response is not valid HTTP/1.1, or its framing is broken.
    Protocol(String),
    /// The body holds more bytes than the caller's buffer.
    TooLong {
        /// The caller's buffer.
        capacity: u64,
        /// The body length, when announced; else at least `capacity + 1`.
        actual: u64,
    },
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpError::Hyper(e) => {
                write!(f, "{e}")?;
                let mut source = std::error::Error::source(e);
                while let Some(s) = source {
                    write!(f, ": {s}")?;
                    source = s.source();
                }
                Ok(())
            }
            HttpError::Io(e) => write!(f, "HTTP/1.1 connection: {e}"),
            HttpError::ClosedBeforeResponse => {
                f.write_str("HTTP/1.1 connection closed before the response")
            }
            HttpError::Protocol(e) => write!(f, "HTTP/1.1 response: {e}"),
            HttpError::TooLong { capacity, actual } => write!(
                f,
                "response body of {actual} bytes does not fit {capacity} bytes"
            ),
        }
    }
}

impl std::error::Error for HttpError {}

impl From<io::Error> for HttpError {
    fn from(e: io::Error) -> HttpError {
        HttpError::Io(e)
    }
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    /// Status code.
    pub status: u16,
    /// Headers.
    pub headers: HeaderMap,
}

/// How the body of the response being read ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No response is being read, or its body is complete.
    Done,
    /// This many body bytes are still to come.
    Length(u64),
    /// Chunked transfer coding, in this state.
    Chunked(Chunk),
    /// The body ends when the server closes the connection.
    UntilClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// This many bytes of chunk data left.
    Data(u64),
    /// Expecting the CRLF after chunk data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
}

/// One HTTP/1.1 connection.
pub struct H1Conn {
    stream: Stream,
    fd: RawFd,
    /// Plain TCP: `SO_RCVLOWAT` applies (over TLS the socket holds records
    /// and rustls buffers some, so the body bytes left say nothing exact
    /// about what the socket will still receive).
    plain: bool,
    buf: Vec<u8>,
    /// Unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// `SO_RCVLOWAT` as last set (1 is the kernel's default).
    lowat: usize,
    framing: Framing,
    /// The server asked to close after this response, or the framing broke.
    close: bool,
    /// Requests sent on this connection.
    requests: u64,
}

impl fmt::Debug for H1Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("H1Conn")
            .field("stream", &self.stream)
            .field("framing", &self.framing)
            .field("requests", &self.requests)
            .finish_non_exhaustive()
    }
}

impl H1Conn {
    /// A connection over `stream`.
    pub fn new(stream: Stream) -> H1Conn {
        let fd = stream.tcp_fd();
        let plain = matches!(stream, Stream::Tcp(_));
        H1Conn {
            stream,
            fd,
            plain,
            buf: vec![0; HEAD_BUFFER_BYTES],
            start: 0,
            end: 0,
            lowat: 1,
            framing: Framing::Done,
            close: false,
            requests: 0,
        }
    }

    /// True when a request was sent on this connection before.
    pub fn is_reused(&self) -> bool {
        self.requests > 0
    }

    /// True when the last response was read to its end, the server did not
    /// ask to close, and no stray bytes follow it.
    pub fn is_reusable(&self) -> bool {
        self.framing == Framing::Done && !self.close && self.start == self.end
    }

    /// [`H1Conn::is_reusable`], and the peer has not closed the socket since:
    /// the connection can carry another request.
    pub fn is_alive(&self) -> bool {
        self.is_reusable() && self.peer_open()
    }

    /// Looks at the socket without reading. Between responses a plain
    /// connection is healthy only when open with nothing to read (end of
    /// stream, stray bytes or an error all mean it is done); a TLS one may
    /// hold records that are not data (a session ticket, a key update), so
    /// there only end of stream and errors count.
    fn peer_open(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: recv into one valid byte; MSG_PEEK leaves the data queued.
        let n = unsafe {
            libc::recv(
                self.fd,
                &mut byte as *mut u8 as *mut libc::c_void,
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => false,
            n if n > 0 => !self.plain,
            _ => io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock,
        }
    }

    /// Writes the request head and body, then reads the response head.
    /// `expect_body` is false for HEAD requests (their answers announce a
    /// length but carry no body).
    pub async fn exchange(
        &mut self,
        head: &[u8],
        body: &Bytes,
        expect_body: bool,
    ) -> Result<Head, HttpError> {
        debug_assert!(self.framing == Framing::Done, "previous body not read");
        self.requests += 1;
        self.set_lowat(1);
        let write = self.write_request(head, body).await;
        match write {
            Ok(()) => self.read_head(expect_body).await,
            // A server that refuses a request early may answer and close
            // before reading the body: its answer says more than EPIPE.
            Err(e) => match self.read_head(expect_body).await {
                Ok(h) => {
                    self.close = true;
                    Ok(h)
                }
                Err(HttpError::ClosedBeforeResponse) if self.is_reused() => {
                    Err(HttpError::ClosedBeforeResponse)
                }
                Err(_) => Err(HttpError::Io(e)),
            },
        }
    }

    async fn write_request(&mut self, head: &[u8], body: &Bytes) -> io::Result<()> {
        if !body.is_empty() && body.len() <= COALESCE_BODY_BYTES {
            let mut one = Vec::with_capacity(head.len() + body.len());
            one.extend_from_slice(head);
            one.extend_from_slice(body);
            self.stream.write_all(&one).await?;
        } else {
            self.stream.write_all(head).await?;
            if !body.is_empty() {
                self.stream.write_all(body).await?;
            }
        }
        self.stream.flush().await
    }

    /// Reads more bytes into the buffer after `end`; 0 at end of stream.
    async fn fill(&mut self) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            if self.buf.len() >= MAX_HEAD_BYTES {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "no room left in the response buffer",
                ));
            }
            let len = (self.buf.len() * 2).min(MAX_HEAD_BYTES);
            self.buf.resize(len, 0);
        }
        let end = self.end;
        let n = self.stream.read(&mut self.buf[end..]).await?;
        self.end += n;
        if n > 0 {
            self.quickack();
        }
        Ok(n)
    }

    async fn read_head(&mut self, expect_body: bool) -> Result<Head, HttpError> {
        let mut received = self.end > self.start;
        loop {
            if self.end > self.start {
                let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
                let mut resp = httparse::Response::new(&mut slots);
                match resp.parse(&self.buf[self.start..self.end]) {
                    Ok(httparse::Status::Complete(len)) => {
                        let status = resp.code.unwrap_or(0);
                        if resp.version != Some(1) && resp.version != Some(0) {
                            return Err(HttpError::Protocol("not an HTTP/1.x response".into()));
                        }
                        let head = build_head(status, resp.headers)?;
                        let http10 = resp.version == Some(0);
                        self.start += len;
                        if (100..200).contains(&status) {
                            if status == 101 {
                                return Err(HttpError::Protocol(
                                    "unexpected 101 Switching Protocols".into(),
                                ));
                            }
                            // Interim answer (100 Continue): the real one follows.
                            continue;
                        }
                        self.framing = framing(&head, expect_body)?;
                        self.close = http10 || wants_close(&head.headers);
                        if self.framing == Framing::UntilClose {
                            self.close = true;
                        }
                        return Ok(head);
                    }
                    Ok(httparse::Status::Partial) => {}
                    Err(e) => {
                        self.close = true;
                        return Err(HttpError::Protocol(format!("bad response head: {e}")));
                    }
                }
            }
            let n = match self.fill().await {
                Ok(n) => n,
                Err(e) if !received && is_reset(&e) => {
                    self.close = true;
                    return Err(HttpError::ClosedBeforeResponse);
                }
                Err(e) => {
                    self.close = true;
                    return Err(HttpError::Io(e));
                }
            };
            if n == 0 {
                self.close = true;
                return Err(if received {
                    HttpError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed in the response head",
                    ))
                } else {
                    HttpError::ClosedBeforeResponse
                });
            }
            received = true;
        }
    }

    /// True once the body of the current response has been read.
    pub fn body_done(&self) -> bool {
        self.framing == Framing::Done
    }

    /// Reads the whole body into `dst`, which must hold it; returns the
    /// body's length. A body announced longer than `dst` is refused before
    /// a byte is read; one that turns out longer is an error after `dst` is
    /// full.
    pub async fn read_body_into(&mut self, dst: &mut [u8]) -> Result<usize, HttpError> {
        if let Framing::Length(len) = self.framing {
            if len > dst.len() as u64 {
                self.close = true;
                return Err(HttpError::TooLong {
                    capacity: dst.len() as u64,
                    actual: len,
                });
            }
            let len = len as usize;
            let mut filled = self.take_buffered(&mut dst[..len]);
            while filled < len {
                let left = len - filled;
                self.set_lowat(lowat_for(left, self.plain));
                let n = match self.stream.read(&mut dst[filled..len]).await {
                    Ok(n) => n,
                    Err(e) => {
                        self.close = true;
                        return Err(HttpError::Io(e));
                    }
                };
                if n == 0 {
                    self.close = true;
                    return Err(HttpError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("connection closed after {filled} of {len} body bytes"),
                    )));
                }
                self.quickack();
                filled += n;
            }
            self.set_lowat(1);
            self.framing = Framing::Done;
            return Ok(len);
        }
        let capacity = dst.len();
        let mut filled = 0usize;
        let mut overflow = false;
        self.read_body(|piece| {
            if piece.len() > capacity - filled {
                overflow = true;
                return false;
            }
            dst[filled..filled + piece.len()].copy_from_slice(piece);
            filled += piece.len();
            true
        })
        .await?;
        if overflow {
            self.close = true;
            return Err(HttpError::TooLong {
                capacity: capacity as u64,
                actual: capacity as u64 + 1,
            });
        }
        Ok(filled)
    }

    /// Moves buffered body bytes (those that came with the head) to the
    /// front of `dst`; returns how many.
    fn take_buffered(&mut self, dst: &mut [u8]) -> usize {
        let n = (self.end - self.start).min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        if let Framing::Length(left) = &mut self.framing {
            *left -= n as u64;
        }
        n
    }

    /// Reads the body to its end, handing each piece to `sink`, which
    /// returns false to stop early (the connection is then not reusable).
    pub async fn read_body(
        &mut self,
        mut sink: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), HttpError> {
        let result = self.read_body_inner(&mut sink).await;
        if result.is_err() || self.framing != Framing::Done {
            self.close = true;
        }
        result
    }

    /// Appends the body to `out`, up to `limit` bytes in all, and stops
    /// reading at the first piece that does not fit (the connection is then
    /// not reusable). Returns the body bytes received and whether the body
    /// ended within the limit.
    pub async fn read_body_limited(
        &mut self,
        out: &mut Vec<u8>,
        limit: usize,
    ) -> Result<(usize, bool), HttpError> {
        let mut received = 0usize;
        let mut within = true;
        self.read_body(|piece| {
            received += piece.len();
            within = append_limited(out, piece, limit);
            within
        })
        .await?;
        Ok((received, within && self.body_done()))
    }

    async fn read_body_inner(
        &mut self,
        sink: &mut impl FnMut(&[u8]) -> bool,
    ) -> Result<(), HttpError> {
        loop {
            match self.framing {
                Framing::Done => return Ok(()),
                Framing::Length(0) => self.framing = Framing::Done,
                Framing::Length(left) => {
                    let (left, keep) = self.pass_data(left, "in the body", sink).await?;
                    self.framing = Framing::Length(left);
                    if !keep {
                        return Ok(());
                    }
                }
                Framing::UntilClose => {
                    if self.start == self.end && self.fill_body().await? == 0 {
                        self.framing = Framing::Done;
                        return Ok(());
                    }
                    let keep = sink(&self.buf[self.start..self.end]);
                    self.start = self.end;
                    if !keep {
                        return Ok(());
                    }
                }
                Framing::Chunked(Chunk::Data(left)) => {
                    let (left, keep) = self.pass_data(left, "in a chunk", sink).await?;
                    self.framing = Framing::Chunked(if left == 0 {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left)
                    });
                    if !keep {
                        return Ok(());
                    }
                }
                Framing::Chunked(state) => {
                    let Some(line_end) = self.buf[self.start..self.end]
                        .windows(2)
                        .position(|w| w == b"\r\n")
                    else {
                        if self.end - self.start > 4096 {
                            return Err(HttpError::Protocol("chunk line too long".into()));
                        }
                        if self.fill_body().await? == 0 {
                            return Err(eof("in chunk framing"));
                        }
                        continue;
                    };
                    let line = &self.buf[self.start..self.start + line_end];
                    let next = match state {
                        Chunk::Size => {
                            let size = parse_chunk_size(line)?;
                            if size == 0 {
                                Framing::Chunked(Chunk::Trailers)
                            } else {
                                Framing::Chunked(Chunk::Data(size))
                            }
                        }
                        Chunk::DataEnd => {
                            if !line.is_empty() {
                                return Err(HttpError::Protocol(
                                    "chunk data overruns its size".into(),
                                ));
                            }
                            Framing::Chunked(Chunk::Size)
                        }
                        Chunk::Trailers if line.is_empty() => Framing::Done,
                        Chunk::Trailers => Framing::Chunked(Chunk::Trailers),
                        Chunk::Data(_) => unreachable!("handled above"),
                    };
                    self.start += line_end + 2;
                    self.framing = next;
                }
            }
        }
    }

    /// Hands up to `left` body bytes (at least one, reading if none is
    /// buffered) to `sink`; returns the bytes still to come and the sink's
    /// answer.
    async fn pass_data(
        &mut self,
        left: u64,
        place: &str,
        sink: &mut impl FnMut(&[u8]) -> bool,
    ) -> Result<(u64, bool), HttpError> {
        if self.start == self.end && self.fill_body().await? == 0 {
            return Err(eof(place));
        }
        let n = (self.end - self.start).min(usize::try_from(left).unwrap_or(usize::MAX));
        let keep = sink(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok((left - n as u64, keep))
    }

    /// Like [`H1Conn::fill`], mapping errors for body reads.
    async fn fill_body(&mut self) -> Result<usize, HttpError> {
        self.fill().await.map_err(HttpError::Io)
    }

    /// Sets `SO_RCVLOWAT` (plain TCP only; best effort).
    fn set_lowat(&mut self, bytes: usize) {
        if !self.plain || bytes == self.lowat {
            return;
        }
        let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
        // SAFETY: setsockopt reads one c_int from a valid pointer.
        let rc = unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                &value as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        // On failure the mark stays where it was; remember the truth so a
        // raised mark is never assumed lowered.
        if rc == 0 {
            self.lowat = bytes;
        }
    }

    fn quickack(&self) {
        kvshard_io::http::set_quickack(self.fd);
    }
}

/// Appends what fits of `piece` to `out` without passing `limit` bytes;
/// false when some of it did not fit.
pub fn append_limited(out: &mut Vec<u8>, piece: &[u8], limit: usize) -> bool {
    let room = limit.saturating_sub(out.len());
    out.extend_from_slice(&piece[..piece.len().min(room)]);
    piece.len() <= room
}

/// The receive low-water mark for reading `left` more body bytes straight
/// from the socket: at most [`MAX_LOWAT`], never more than will come before
/// the tail, and 1 (the default) for the tail and over TLS.
fn lowat_for(left: usize, plain: bool) -> usize {
    if !plain || left < TAIL_BYTES + MIN_LOWAT {
        return 1;
    }
    (left - TAIL_BYTES).min(MAX_LOWAT)
}

fn eof(place: &str) -> HttpError {
    HttpError::Io(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("connection closed {place}"),
    ))
}

fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
    )
}

fn build_head(status: u16, raw: &[httparse::Header<'_>]) -> Result<Head, HttpError> {
    let mut headers = HeaderMap::with_capacity(raw.len());
    for h in raw {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| HttpError::Protocol(format!("bad header name {:?}", h.name)))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| HttpError::Protocol(format!("bad value of header {}", h.name)))?;
        headers.append(name, value);
    }
    Ok(Head { status, headers })
}

/// The body framing of a response (RFC 9112 section 6.3).
fn framing(head: &Head, expect_body: bool) -> Result<Framing, HttpError> {
    if !expect_body || head.status == 204 || head.status == 304 {
        return Ok(Framing::Done);
    }
    let codings: Vec<&[u8]> = head
        .headers
        .get_all(hyper::header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|c| c.trim_ascii())
        .filter(|c| !c.is_empty())
        .collect();
    if let Some(last) = codings.last() {
        return Ok(if last.eq_ignore_ascii_case(b"chunked") {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::UntilClose
        });
    }
    let mut length: Option<u64> = None;
    for v in head.headers.get_all(hyper::header::CONTENT_LENGTH) {
        for part in v.as_bytes().split(|&b| b == b',') {
            let n = std::str::from_utf8(part.trim_ascii())
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| HttpError::Protocol(format!("bad Content-Length {v:?}")))?;
            if length.is_some_and(|l| l != n) {
                return Err(HttpError::Protocol(
                    "conflicting Content-Length values".into(),
                ));
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(0) => Framing::Done,
        Some(n) => Framing::Length(n),
        None => Framing::UntilClose,
    })
}

fn wants_close(headers: &HeaderMap) -> bool {
    headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"))
}

fn parse_chunk_size(line: &[u8]) -> Result<u64, HttpError> {
    let digits = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return Err(HttpError::Protocol(format!(
            "bad chunk size line {:?}",
            String::from_utf8_lossy(line)
        )));
    }
    let text = std::str::from_utf8(digits).expect("hex digits are ASCII");
    Ok(u64::from_str_radix(text, 16).expect("at most 15 hex digits"))
}

/// Writes a request head: request line, `Host`, the given headers, and a
/// `Content-Length` when the body is not empty or the method sends one
/// (PUT, POST) and none is given.
pub fn write_head(
    out: &mut Vec<u8>,
    method: &str,
    target: &str,
    host: &str,
    headers: &[(HeaderName, HeaderValue)],
    body_len: usize,
) {
    out.clear();
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut has_length = false;
    for (name, value) in headers {
        has_length |= name == hyper::header::CONTENT_LENGTH;
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !has_length && (body_len > 0 || method == "PUT" || method == "POST") {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(body_len.to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(status: u16, pairs: &[(&str, &str)]) -> Head {
        let mut headers = HeaderMap::new();
        for (k, v) in pairs {
            headers.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        Head { status, headers }
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let f = |status, pairs: &[(&str, &str)], body| framing(&head(status, pairs), body);
        assert_eq!(
            f(200, &[("content-length", "5")], true).unwrap(),
            Framing::Length(5)
        );
        assert_eq!(
            f(200, &[("content-length", "5")], false).unwrap(),
            Framing::Done
        );
        assert_eq!(f(204, &[], true).unwrap(), Framing::Done);
        assert_eq!(
            f(304, &[("content-length", "9")], true).unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(200, &[("content-length", "0")], true).unwrap(),
            Framing::Done
        );
        assert_eq!(
            f(
                200,
                &[
                    ("transfer-encoding", "gzip, chunked"),
                    ("content-length", "3")
                ],
                true
            )
            .unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        assert_eq!(
            f(200, &[("transfer-encoding", "gzip")], true).unwrap(),
            Framing::UntilClose
        );
        assert_eq!(f(200, &[], true).unwrap(), Framing::UntilClose);
        assert_eq!(
            f(
                200,
                &[("content-length", "7"), ("content-length", "7")],
                true
            )
            .unwrap(),
            Framing::Length(7)
        );
        assert!(f(200, &[("content-length", "7, 8")], true).is_err());
        assert!(f(200, &[("content-length", "-1")], true).is_err());
        assert!(f(200, &[("content-length", "+5")], true).is_err());
        assert!(f(200, &[("content-length", "")], true).is_err());
    }

    #[test]
    fn chunk_sizes_parse_with_extensions_and_refuse_garbage() {
        assert_eq!(parse_chunk_size(b"1a").unwrap(), 26);
        assert_eq!(parse_chunk_size(b"FF;name=value").unwrap(), 255);
        assert_eq!(parse_chunk_size(b"0").unwrap(), 0);
        assert!(parse_chunk_size(b"").is_err());
        assert!(parse_chunk_size(b"xyz").is_err());
        assert!(parse_chunk_size(b"1234567890abcdef0").is_err());
    }

    #[test]
    fn lowat_never_reaches_into_the_tail() {
        assert_eq!(lowat_for(10 << 20, true), MAX_LOWAT);
        assert_eq!(lowat_for(10 << 20, false), 1);
        assert_eq!(lowat_for(TAIL_BYTES + MIN_LOWAT - 1, true), 1);
        assert_eq!(lowat_for(TAIL_BYTES + MIN_LOWAT, true), MIN_LOWAT);
        for left in [
            0,
            1,
            TAIL_BYTES,
            TAIL_BYTES + MIN_LOWAT + 7,
            300 << 10,
            4 << 20,
        ] {
            let w = lowat_for(left, true);
            assert!(w == 1 || w + TAIL_BYTES <= left, "left {left}: mark {w}");
        }
    }

    #[test]
    fn request_heads_carry_host_headers_and_length() {
        let mut out = Vec::new();
        let hs = [(
            HeaderName::from_static("x-amz-date"),
            HeaderValue::from_static("20260101T000000Z"),
        )];
        write_head(&mut out, "PUT", "/b/k%40x", "b.localhost:9000", &hs, 3);
        assert_eq!(
            out,
            b"PUT /b/k%40x HTTP/1.1\r\nhost: b.localhost:9000\r\nx-amz-date: 20260101T000000Z\r\ncontent-length: 3\r\n\r\n"
        );
        write_head(&mut out, "GET", "/k", "h", &[], 0);
        assert_eq!(out, b"GET /k HTTP/1.1\r\nhost: h\r\n\r\n");
        write_head(&mut out, "POST", "/k?uploads", "h", &[], 0);
        assert_eq!(
            out,
            b"POST /k?uploads HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\n\r\n"
        );
    }
}
