//! Connections to one endpoint: HTTP/2 multiplexed or an HTTP/1.1
//! keep-alive pool, over TCP or rustls.
//!
//! Protocol choice:
//! - TLS with `prefer_http2`: ALPN offers `h2`, `http/1.1`; the first
//!   connection's answer fixes the mode for the pool (S3 itself picks
//!   HTTP/1.1).
//! - TLS without it: ALPN `http/1.1` only.
//! - Plain TCP with `prefer_http2`: HTTP/2 with prior knowledge (h2c) when
//!   the server speaks it, else HTTP/1.1. Before the first connection a
//!   probe connection sends the HTTP/2 preface and an empty SETTINGS frame:
//!   an HTTP/2 server answers with its SETTINGS, an HTTP/1.1 one with an
//!   error or by closing (lmcache's CRT client never tries h2c, so a config
//!   that works there against an HTTP/1.1-only store must work here too).
//! - Plain TCP without it: HTTP/1.1.
//!
//! Bounds: at most `max_in_flight` requests at once across the pool (a FIFO
//! semaphore; further requests wait their turn). HTTP/1.1 opens a
//! connection per in-flight request, so that is also its connection limit,
//! and finished connections wait in an idle list. HTTP/2 sends every request
//! over the least loaded connection with fewer than
//! `h2_max_streams_per_connection` requests in flight, and opens another
//! one, up to `h2_max_connections`, only when all are that busy; past that,
//! requests share the least loaded connection. A server that allows fewer
//! concurrent streams (`MAX_CONCURRENT_STREAMS`) makes hyper queue the
//! excess until a stream frees up.
//!
//! HTTP/2 runs on hyper. HTTP/1.1 runs on our own connections ([`crate::h1`]),
//! which read response bodies straight into caller memory.
//!
//! A connection that failed, or whose request was abandoned half way, is
//! closed and forgotten; the next request connects again. An idle HTTP/1.1
//! connection is checked before reuse (the server may have closed it).

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use bytes::Bytes;
use futures_rustls::TlsConnector;
use glommio::sync::{Semaphore, StaticPermit};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request};
use rustls::pki_types::ServerName;

use crate::h1::{self, H1Conn};
pub use crate::h1::{Head, HttpError};
use crate::net::{self, ConnectError, HyperIo, LocalExec, LocalTimer, Stream, ALPN_H2};
use crate::region::Window;

/// The request body type: one buffer, sent as it is.
pub type Body = Full<Bytes>;

/// The wire protocol of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1.
    Http1,
    /// HTTP/2 (over TLS by ALPN, or h2c with prior knowledge).
    Http2,
}

/// Where and how to connect.
#[derive(Clone)]
pub struct EndpointConfig {
    /// Host to connect to (name or IP literal).
    pub connect_host: String,
    /// TCP port.
    pub port: u16,
    /// TLS settings; `None` for plain TCP.
    pub tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    /// Use HTTP/2 (h2c on plain TCP; offered by ALPN with TLS).
    pub prefer_http2: bool,
    /// Requests in flight at once. lmcache's `s3_num_io_threads` (64).
    pub max_in_flight: usize,
    /// HTTP/2 connections at most.
    pub h2_max_connections: usize,
    /// HTTP/2 streams per connection at most (the server may allow fewer).
    pub h2_max_streams_per_connection: usize,
    /// HTTP/2 initial stream window, bytes.
    pub h2_stream_window_bytes: u32,
    /// HTTP/2 initial connection window, bytes.
    pub h2_connection_window_bytes: u32,
    /// Largest HTTP/2 frame we accept, bytes.
    pub h2_max_frame_bytes: u32,
}

impl fmt::Debug for EndpointConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EndpointConfig")
            .field("connect_host", &self.connect_host)
            .field("port", &self.port)
            .field("tls", &self.tls.as_ref().map(|(_, name)| name))
            .field("prefer_http2", &self.prefer_http2)
            .field("max_in_flight", &self.max_in_flight)
            .field("h2_max_connections", &self.h2_max_connections)
            .finish_non_exhaustive()
    }
}

/// Connection counters.
#[derive(Debug, Default)]
pub struct ConnectionCounters {
    /// HTTP/1.1 connections opened.
    pub http1_opened: Cell<u64>,
    /// HTTP/2 connections opened.
    pub http2_opened: Cell<u64>,
    /// Of those, over TLS.
    pub tls_opened: Cell<u64>,
    /// Connection attempts that failed.
    pub connect_failures: Cell<u64>,
    /// Connections dropped because a request on them failed or was
    /// abandoned.
    pub discarded: Cell<u64>,
    /// HTTP/1.1 connections reused from the idle list.
    pub http1_reused: Cell<u64>,
}

fn bump(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

/// Closes an HTTP/2 connection: its driver task, and its socket as hyper
/// sees it ([`Killable`]) (hyper drives the connection from a task of its
/// own, which holds the queued request bodies).
#[derive(Default)]
struct KillSwitch {
    killed: Cell<bool>,
    /// Tasks to wake on a kill: the one waiting in [`KillSwitch::wait`] and
    /// the ones that last polled the socket.
    wakers: RefCell<Vec<Waker>>,
}

impl KillSwitch {
    fn kill(&self) {
        self.killed.set(true);
        for w in self.wakers.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// True once killed; otherwise remembers the polling task for the kill.
    fn check(&self, waker: &Waker) -> bool {
        if self.killed.get() {
            return true;
        }
        let mut wakers = self.wakers.borrow_mut();
        if !wakers.iter().any(|w| w.will_wake(waker)) {
            wakers.push(waker.clone());
        }
        false
    }

    fn wait(self: Rc<Self>) -> impl Future<Output = ()> {
        std::future::poll_fn(move |cx| {
            if self.check(cx.waker()) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }
}

/// A connection's socket as hyper drives it: once its [`KillSwitch`] is
/// thrown, every read and write fails, so hyper tears the connection down
/// and drops the buffers it still queued for the socket (slices of request
/// bodies among them) even when the peer stopped reading.
struct Killable<T> {
    io: T,
    kill: Rc<KillSwitch>,
}

fn killed_error() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "connection closed by the client",
    )
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for Killable<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.kill.check(cx.waker()) {
            return Poll::Ready(Err(killed_error()));
        }
        std::pin::Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for Killable<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.kill.check(cx.waker()) {
            return Poll::Ready(Err(killed_error()));
        }
        std::pin::Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.kill.check(cx.waker()) {
            return Poll::Ready(Err(killed_error()));
        }
        std::pin::Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.kill.check(cx.waker()) {
            return Poll::Ready(Err(killed_error()));
        }
        std::pin::Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.kill.check(cx.waker()) {
            return Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

struct H2Conn {
    sender: http2::SendRequest<Body>,
    active: Cell<usize>,
    kill: Rc<KillSwitch>,
}

enum Conn {
    H1(H1Conn),
    H2(Rc<H2Conn>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// HTTP/2 preferred and no connection yet: the server decides (by ALPN
    /// over TLS, by the h2c probe over plain TCP).
    Unknown,
    H1,
    H2,
}

struct PoolInner {
    cfg: EndpointConfig,
    connector: Option<TlsConnector>,
    mode: Cell<Mode>,
    slots: Rc<Semaphore>,
    connect_lock: Rc<Semaphore>,
    h1_idle: RefCell<Vec<H1Conn>>,
    h2_conns: RefCell<Vec<Rc<H2Conn>>>,
    counters: Rc<ConnectionCounters>,
}

/// The connections of one endpoint. Cheap to clone (shared).
#[derive(Clone)]
pub struct Pool {
    inner: Rc<PoolInner>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("cfg", &self.inner.cfg)
            .field("mode", &self.inner.mode.get())
            .field("h1_idle", &self.inner.h1_idle.borrow().len())
            .field("h2_conns", &self.inner.h2_conns.borrow().len())
            .finish()
    }
}

impl Pool {
    /// A pool with no connections yet.
    pub fn new(cfg: EndpointConfig, counters: Rc<ConnectionCounters>) -> Pool {
        assert!(cfg.max_in_flight > 0, "max_in_flight must be positive");
        assert!(
            cfg.h2_max_connections > 0,
            "h2_max_connections must be positive"
        );
        let mode = match (&cfg.tls, cfg.prefer_http2) {
            (_, true) => Mode::Unknown,
            (_, false) => Mode::H1,
        };
        let connector = cfg
            .tls
            .as_ref()
            .map(|(config, _)| TlsConnector::from(config.clone()));
        Pool {
            inner: Rc::new(PoolInner {
                slots: Rc::new(Semaphore::new(cfg.max_in_flight as u64)),
                connect_lock: Rc::new(Semaphore::new(1)),
                cfg,
                connector,
                mode: Cell::new(mode),
                h1_idle: RefCell::new(Vec::new()),
                h2_conns: RefCell::new(Vec::new()),
                counters,
            }),
        }
    }

    /// The protocol in use, once known.
    pub fn protocol(&self) -> Option<Protocol> {
        match self.inner.mode.get() {
            Mode::Unknown => None,
            Mode::H1 => Some(Protocol::Http1),
            Mode::H2 => Some(Protocol::Http2),
        }
    }

    /// Open connections (idle HTTP/1.1 plus live HTTP/2).
    pub fn open_connections(&self) -> usize {
        let h1 = self.inner.h1_idle.borrow().len();
        let h2 = self
            .inner
            .h2_conns
            .borrow()
            .iter()
            .filter(|c| !c.sender.is_closed())
            .count();
        h1 + h2
    }

    /// Closes the HTTP/2 connections and the idle HTTP/1.1 ones (see
    /// [`crate::client::S3Client::close_connections`]); answers how many.
    /// HTTP/1.1 connections lent to a request are closed when their lease
    /// is dropped unfinished, so they need no help here.
    pub fn close_all(&self) -> usize {
        let h2: Vec<Rc<H2Conn>> = std::mem::take(&mut *self.inner.h2_conns.borrow_mut());
        let h1: Vec<H1Conn> = std::mem::take(&mut *self.inner.h1_idle.borrow_mut());
        for c in &h2 {
            c.kill.kill();
        }
        // Dropping an idle HTTP/1.1 connection closes its socket.
        h2.len() + h1.len()
    }

    /// Waits for a request slot (at most `max_in_flight` are out at once).
    pub async fn acquire_slot(&self) -> Slot {
        let permit = self
            .inner
            .slots
            .clone()
            .acquire_static_permit(1)
            .await
            .expect("the pool semaphore is never closed");
        Slot(permit)
    }

    /// A connection for a request that holds `slot`.
    pub async fn lease(&self, slot: Slot) -> Result<Lease, ConnectError> {
        let inner = &self.inner;
        loop {
            match inner.mode.get() {
                Mode::H1 => {
                    let conn = self.h1_connection().await?;
                    return Ok(Lease {
                        pool: self.clone(),
                        conn: Some(LeaseConn::H1(Box::new(conn))),
                        h2_body: None,
                        reusable: false,
                        _slot: slot,
                    });
                }
                Mode::H2 => {
                    let conn = self.h2_connection().await?;
                    conn.active.set(conn.active.get() + 1);
                    return Ok(Lease {
                        pool: self.clone(),
                        conn: Some(LeaseConn::H2(conn)),
                        h2_body: None,
                        reusable: false,
                        _slot: slot,
                    });
                }
                Mode::Unknown => {
                    let _lock = inner
                        .connect_lock
                        .acquire_permit(1)
                        .await
                        .expect("the connect lock is never closed");
                    if inner.mode.get() != Mode::Unknown {
                        continue;
                    }
                    match self.connect().await? {
                        Conn::H1(c) => {
                            inner.mode.set(Mode::H1);
                            inner.h1_idle.borrow_mut().push(c);
                        }
                        Conn::H2(c) => {
                            inner.mode.set(Mode::H2);
                            inner.h2_conns.borrow_mut().push(c);
                        }
                    }
                }
            }
        }
    }

    async fn h1_connection(&self) -> Result<H1Conn, ConnectError> {
        loop {
            let idle = self.inner.h1_idle.borrow_mut().pop();
            let Some(conn) = idle else { break };
            // The server may have closed it while it was idle.
            if conn.is_alive() {
                if conn.is_reused() {
                    bump(&self.inner.counters.http1_reused);
                }
                return Ok(conn);
            }
        }
        match self.connect().await? {
            Conn::H1(c) => Ok(c),
            Conn::H2(_) => Err(ConnectError::TlsRejected(
                "server negotiated h2 on a pool that speaks HTTP/1.1".to_owned(),
            )),
        }
    }

    fn pick_h2(&self) -> Option<Rc<H2Conn>> {
        let cap = self.inner.cfg.h2_max_streams_per_connection;
        let mut conns = self.inner.h2_conns.borrow_mut();
        conns.retain(|c| !c.sender.is_closed());
        conns
            .iter()
            .filter(|c| c.active.get() < cap)
            .min_by_key(|c| c.active.get())
            .cloned()
    }

    async fn h2_connection(&self) -> Result<Rc<H2Conn>, ConnectError> {
        if let Some(c) = self.pick_h2() {
            return Ok(c);
        }
        let inner = &self.inner;
        let _lock = inner
            .connect_lock
            .acquire_permit(1)
            .await
            .expect("the connect lock is never closed");
        // Another request may have connected while we waited.
        if let Some(c) = self.pick_h2() {
            return Ok(c);
        }
        let live = inner.h2_conns.borrow().len();
        if live >= inner.cfg.h2_max_connections {
            // All full: share the least loaded; hyper queues for a stream.
            let conns = inner.h2_conns.borrow();
            let least = conns
                .iter()
                .min_by_key(|c| c.active.get())
                .cloned()
                .expect("live > 0 connections");
            return Ok(least);
        }
        match self.connect().await? {
            Conn::H2(c) => {
                inner.h2_conns.borrow_mut().push(c.clone());
                Ok(c)
            }
            Conn::H1(_) => Err(ConnectError::TlsRejected(
                "server negotiated http/1.1 on a pool that speaks HTTP/2".to_owned(),
            )),
        }
    }

    /// Opens one connection (and, for HTTP/2, starts its driver task).
    async fn connect(&self) -> Result<Conn, ConnectError> {
        let inner = &self.inner;
        let result = self.connect_inner().await;
        if result.is_err() {
            bump(&inner.counters.connect_failures);
        }
        result
    }

    async fn connect_inner(&self) -> Result<Conn, ConnectError> {
        let inner = &self.inner;
        let cfg = &inner.cfg;
        let tcp = net::connect_tcp(&cfg.connect_host, cfg.port).await?;
        let stream = match (&inner.connector, &cfg.tls) {
            (Some(connector), Some((_, name))) => {
                let tls = net::connect_tls(connector, name.clone(), tcp).await?;
                bump(&inner.counters.tls_opened);
                Stream::Tls(Box::new(tls))
            }
            _ => Stream::Tcp(tcp),
        };
        let http2 = match &stream {
            Stream::Tls(_) => stream.alpn_protocol() == Some(ALPN_H2),
            Stream::Tcp(_) => match inner.mode.get() {
                Mode::H1 => false,
                Mode::H2 => true,
                Mode::Unknown => {
                    let h2c = probe_h2c(&cfg.connect_host, cfg.port).await?;
                    if !h2c {
                        log::info!(
                            "s3: {}:{} does not speak HTTP/2 without TLS (h2c); using HTTP/1.1",
                            cfg.connect_host,
                            cfg.port
                        );
                    }
                    h2c
                }
            },
        };
        if !http2 {
            bump(&inner.counters.http1_opened);
            return Ok(Conn::H1(H1Conn::new(stream)));
        }
        // Quick ACKs: response bodies arrive here, and a server using Nagle's
        // algorithm would otherwise wait for our delayed ACK at the end of
        // each one.
        let fd = stream.tcp_fd();
        let kill = Rc::new(KillSwitch::default());
        let io = Killable {
            io: HyperIo::new(stream).with_quickack(fd),
            kill: kill.clone(),
        };
        let mut builder = http2::Builder::new(LocalExec);
        builder
            .timer(LocalTimer)
            .initial_stream_window_size(cfg.h2_stream_window_bytes)
            .initial_connection_window_size(cfg.h2_connection_window_bytes)
            .max_frame_size(cfg.h2_max_frame_bytes);
        let (sender, conn) = builder
            .handshake(io)
            .await
            .map_err(|e| ConnectError::Handshake(e.to_string()))?;
        let killed = kill.clone().wait();
        glommio::spawn_local(async move {
            let run = async {
                if let Err(e) = conn.await {
                    log::debug!("s3 http2 connection closed: {e}");
                }
            };
            futures_lite::future::or(run, killed).await;
        })
        .detach();
        bump(&inner.counters.http2_opened);
        Ok(Conn::H2(Rc::new(H2Conn {
            sender,
            active: Cell::new(0),
            kill,
        })))
    }
}

/// How long the h2c probe waits for the server's first bytes.
const H2C_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether the server at `host:port` speaks HTTP/2 with prior knowledge:
/// sends the connection preface and an empty SETTINGS frame on a connection
/// of its own and looks at the first frame header that comes back. Anything
/// but a SETTINGS frame (an HTTP/1.1 error, a close, silence) means no; a
/// failed connect is an error (the server is down, which says nothing).
async fn probe_h2c(host: &str, port: u16) -> Result<bool, ConnectError> {
    use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = net::connect_tcp(host, port).await?;
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // Frame header: length 0, type SETTINGS (4), flags 0, stream 0.
    const EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];
    let probe = async {
        let mut hello = PREFACE.to_vec();
        hello.extend_from_slice(&EMPTY_SETTINGS);
        tcp.write_all(&hello).await.ok()?;
        let mut header = [0u8; 9];
        tcp.read_exact(&mut header).await.ok()?;
        // Type SETTINGS without ACK, on stream 0.
        Some(header[3] == 4 && header[4] & 1 == 0 && header[5..9] == [0, 0, 0, 0])
    };
    Ok(futures_lite::future::or(probe, async {
        glommio::timer::sleep(H2C_PROBE_TIMEOUT).await;
        None
    })
    .await
    .unwrap_or(false))
}

/// A request slot: one of the pool's `max_in_flight`.
// Held only to be released on drop.
pub struct Slot(#[allow(dead_code)] StaticPermit);

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Slot")
    }
}

/// A request as it goes on the wire (signed headers included).
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// Method.
    pub method: &'a Method,
    /// Encoded path and query.
    pub target: &'a str,
    /// `http` or `https` (HTTP/2 sends it).
    pub scheme: &'a str,
    /// The `Host` header (HTTP/2's `:authority`).
    pub authority: &'a str,
    /// Headers besides `Host`.
    pub headers: &'a [(HeaderName, HeaderValue)],
    /// Body (caller memory, not copied).
    pub body: &'a Bytes,
}

/// Why [`Lease::send`] failed.
#[derive(Debug)]
pub enum SendError {
    /// The connection closed before the server answered anything, and it
    /// was a kept-alive connection the server may have just closed: the
    /// request may be sent on another connection without counting as an
    /// attempt.
    NotSent(HttpError),
    /// The exchange failed after the request went out.
    Failed(HttpError),
}

enum LeaseConn {
    H1(Box<H1Conn>),
    H2(Rc<H2Conn>),
}

/// One request slot on one connection: send a request, then read its
/// response body. Dropping it without [`Lease::release`] after the body
/// was read to its end closes an HTTP/1.1 connection (its state is
/// unknown).
pub struct Lease {
    pool: Pool,
    conn: Option<LeaseConn>,
    /// The body of the HTTP/2 response being read.
    h2_body: Option<Incoming>,
    reusable: bool,
    _slot: Slot,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lease({:?})", self.protocol())
    }
}

impl Lease {
    /// The connection's protocol.
    pub fn protocol(&self) -> Protocol {
        match self.conn {
            Some(LeaseConn::H1(_)) => Protocol::Http1,
            Some(LeaseConn::H2(_)) | None => Protocol::Http2,
        }
    }

    /// Sends a request and waits for the response head.
    pub async fn send(&mut self, req: &Outgoing<'_>) -> Result<Head, SendError> {
        match self.conn.as_mut().expect("lease holds a connection") {
            LeaseConn::H1(c) => {
                let mut head = Vec::with_capacity(1024);
                h1::write_head(
                    &mut head,
                    req.method.as_str(),
                    req.target,
                    req.authority,
                    req.headers,
                    req.body.len(),
                );
                let reused = c.is_reused();
                c.exchange(&head, req.body, req.method != Method::HEAD)
                    .await
                    .map_err(|e| match e {
                        HttpError::ClosedBeforeResponse if reused => SendError::NotSent(e),
                        e => SendError::Failed(e),
                    })
            }
            LeaseConn::H2(c) => {
                let uri = format!("{}://{}{}", req.scheme, req.authority, req.target);
                let mut builder = Request::builder().method(req.method.clone()).uri(uri);
                for (name, value) in req.headers {
                    builder = builder.header(name, value);
                }
                let request = builder
                    .body(Full::new(req.body.clone()))
                    .map_err(|e| SendError::Failed(HttpError::Protocol(format!("request: {e}"))))?;
                let mut sender = c.sender.clone();
                let resp = sender.try_send_request(request).await.map_err(|mut e| {
                    match e.take_message() {
                        Some(_) => SendError::NotSent(HttpError::Hyper(e.into_error())),
                        None => SendError::Failed(HttpError::Hyper(e.into_error())),
                    }
                })?;
                let (parts, body) = resp.into_parts();
                self.h2_body = Some(body);
                Ok(Head {
                    status: parts.status.as_u16(),
                    headers: parts.headers,
                })
            }
        }
    }

    /// Reads the response body to its end (either protocol), handing each
    /// piece to `sink`, which returns false to stop early.
    async fn read_body(&mut self, mut sink: impl FnMut(&[u8]) -> bool) -> Result<(), HttpError> {
        if let Some(LeaseConn::H1(c)) = self.conn.as_mut() {
            return c.read_body(sink).await;
        }
        let Some(body) = self.h2_body.as_mut() else {
            return Ok(());
        };
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.map_err(HttpError::Hyper)?.into_data() {
                if !sink(&data) {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Reads the whole response body into `window`; returns the body's
    /// length (which may be less than the window). A body longer than the
    /// window is [`HttpError::TooLong`].
    pub(crate) async fn read_body_into(&mut self, window: &mut Window) -> Result<usize, HttpError> {
        if let Some(LeaseConn::H1(c)) = self.conn.as_mut() {
            // Straight from the socket into the window.
            let n = c.read_body_into(window.unfilled_mut()).await?;
            window.advance(n);
            return Ok(n);
        }
        let capacity = window.len() - window.filled();
        let mut total = 0usize;
        let mut fits = true;
        self.read_body(|piece| {
            total += piece.len();
            fits = window.push(piece);
            fits
        })
        .await?;
        if !fits {
            return Err(HttpError::TooLong {
                capacity: capacity as u64,
                actual: total as u64,
            });
        }
        Ok(total)
    }

    /// Appends the response body to `out`, up to `limit` bytes in all;
    /// returns the body bytes received and whether the body ended within
    /// the limit.
    pub async fn read_body_limited(
        &mut self,
        out: &mut Vec<u8>,
        limit: usize,
    ) -> Result<(usize, bool), HttpError> {
        let mut received = 0usize;
        let mut within = true;
        self.read_body(|piece| {
            received += piece.len();
            within = h1::append_limited(out, piece, limit);
            within
        })
        .await?;
        Ok((received, within))
    }

    /// Reads and drops the rest of the response body; returns its length.
    pub async fn discard_body(&mut self) -> Result<usize, HttpError> {
        let mut received = 0usize;
        self.read_body(|piece| {
            received += piece.len();
            true
        })
        .await?;
        Ok(received)
    }

    /// The exchange finished cleanly (body read to the end): an HTTP/1.1
    /// connection goes back to the idle list.
    pub fn release(mut self) {
        self.reusable = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        match self.conn.take() {
            Some(LeaseConn::H1(c)) => {
                if self.reusable && c.is_reusable() {
                    self.pool.inner.h1_idle.borrow_mut().push(*c);
                } else if !self.reusable {
                    bump(&self.pool.inner.counters.discarded);
                }
            }
            Some(LeaseConn::H2(c)) => {
                c.active.set(c.active.get() - 1);
            }
            None => {}
        }
    }
}
