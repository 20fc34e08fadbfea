//! hyper 1.x on glommio: an IO adapter over glommio's TcpStream, a local
//! executor, a timer, and an HTTP/1.1 accept loop.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use futures_lite::io::{AsyncRead, AsyncWrite};
use hyper::body::{Body, Incoming};
use hyper::rt::{ReadBufCursor, Sleep, Timer};
use hyper::service::Service;
use hyper::{Request, Response};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Bytes zero-initialised for the first read of a stream, and the least a
/// read ever asks for.
const MIN_READ_CHUNK: usize = 16 * 1024;
/// Most bytes asked for (and zero-initialised) per read.
const MAX_READ_CHUNK: usize = 256 * 1024;

/// A futures-io stream (a glommio `TcpStream`, or a TLS stream over one) as
/// hyper IO.
///
/// hyper hands out uninitialised spare capacity for every read, and only
/// initialised memory may be given to a futures-io read, so each read zeroes
/// what it asks for. The size asked for adapts to what the socket delivers:
/// it doubles while reads fill it and halves while they use less than a
/// quarter, so a server that writes 8 KiB at a time does not cost a 256 KiB
/// memset per 8 KiB, and a bulk transfer still reads in large pieces.
///
/// With [`HyperIo::with_quickack`], every read that returned data re-arms
/// `TCP_QUICKACK` on the socket: the kernel then acknowledges at once instead
/// of up to 40 ms later. A client receiving a response body wants that: a
/// server that sends with Nagle's algorithm holds the last partial segment of
/// the response until the previous one is acknowledged.
pub struct HyperIo<S> {
    stream: S,
    read_size: usize,
    quickack_fd: Option<RawFd>,
}

impl<S> HyperIo<S> {
    /// Wraps `stream`.
    pub fn new(stream: S) -> HyperIo<S> {
        HyperIo {
            stream,
            read_size: MIN_READ_CHUNK,
            quickack_fd: None,
        }
    }

    /// Re-arms `TCP_QUICKACK` on `fd` (the TCP socket under `stream`) after
    /// every read that returned data.
    pub fn with_quickack(mut self, fd: RawFd) -> HyperIo<S> {
        self.quickack_fd = Some(fd);
        self
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// Bytes the next read asks for, given `n` bytes read into a buffer of
    /// `asked`.
    fn adapt(&mut self, asked: usize, n: usize) {
        if n == asked {
            self.read_size = (self.read_size * 2).min(MAX_READ_CHUNK);
        } else if n < asked / 4 {
            self.read_size = (self.read_size / 2).max(MIN_READ_CHUNK);
        }
    }
}

impl<S> std::fmt::Debug for HyperIo<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HyperIo")
            .field("read_size", &self.read_size)
            .field("quickack_fd", &self.quickack_fd)
            .finish_non_exhaustive()
    }
}

impl<S: AsyncRead + Unpin> hyper::rt::Read for HyperIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let want = buf.remaining().min(this.read_size);
        let dst = buf.initialize_unfilled_to(want);
        let n = match Pin::new(&mut this.stream).poll_read(cx, dst) {
            Poll::Ready(Ok(n)) => n,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        };
        assert!(n <= want, "read returned more bytes than the buffer holds");
        // SAFETY: the first `want` unfilled bytes were initialised above and
        // `n <= want` of them now hold data.
        unsafe { buf.advance(n) };
        if n > 0 {
            if want > 0 {
                this.adapt(want, n);
            }
            if let Some(fd) = this.quickack_fd {
                set_quickack(fd);
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Asks the kernel to acknowledge received data at once (`TCP_QUICKACK`,
/// which the kernel clears again by itself). Best effort: a failure (the
/// socket is closing) changes nothing a caller could act on.
pub fn set_quickack(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a valid
    // pointer; `fd` is the caller's open socket.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_QUICKACK,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

impl<S: AsyncWrite + Unpin> hyper::rt::Write for HyperIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    /// True so that hyper's HTTP/1.1 writer queues body buffers as they are
    /// instead of copying them behind the head into one buffer.
    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_close(cx)
    }
}

/// Runs hyper's background futures as detached tasks on the current glommio
/// executor (hyper needs no `Send` for them).
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future + 'static,
    F::Output: 'static,
{
    fn execute(&self, fut: F) {
        glommio::spawn_local(fut).detach();
    }
}

/// hyper timer backed by glommio timers. Its sleeps must be polled on a
/// glommio executor thread.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalTimer;

impl Timer for LocalTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        Box::pin(LocalSleep::new(Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Sleep>> {
        Box::pin(LocalSleep::new(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<LocalSleep>() {
            Some(s) => s.get_mut().reset(new_deadline),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

/// A sleep whose glommio timer is created lazily on the polling thread.
struct LocalSleep {
    deadline: Instant,
    /// The glommio timer and the thread it belongs to.
    timer: Option<(ThreadId, glommio::timer::Timer)>,
}

// SAFETY: hyper requires `Sleep: Send + Sync`. The only non-thread-safe part
// is the glommio timer (Rc inside). It is created, polled, reset and dropped
// only on the thread recorded next to it; if the sleep is ever used or dropped
// on another thread, the old timer is leaked untouched (`mem::forget` only
// moves bytes). `&LocalSleep` exposes nothing, so sharing it is harmless.
unsafe impl Send for LocalSleep {}
// SAFETY: see `Send`.
unsafe impl Sync for LocalSleep {}

impl LocalSleep {
    fn new(deadline: Instant) -> Self {
        LocalSleep {
            deadline,
            timer: None,
        }
    }

    /// Forget a timer that belongs to another thread.
    fn release_foreign(&mut self) {
        let me = std::thread::current().id();
        if matches!(&self.timer, Some((owner, _)) if *owner != me) {
            std::mem::forget(self.timer.take());
        }
    }

    fn reset(&mut self, deadline: Instant) {
        self.deadline = deadline;
        self.release_foreign();
        if let Some((_, t)) = &mut self.timer {
            t.reset(deadline.saturating_duration_since(Instant::now()));
        }
    }
}

impl Future for LocalSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let now = Instant::now();
        if now >= this.deadline {
            return Poll::Ready(());
        }
        this.release_foreign();
        let (_, timer) = this.timer.get_or_insert_with(|| {
            (
                std::thread::current().id(),
                glommio::timer::Timer::new(this.deadline - now),
            )
        });
        Pin::new(timer).poll(cx).map(|_fired_at| ())
    }
}

impl Sleep for LocalSleep {}

impl Drop for LocalSleep {
    fn drop(&mut self) {
        self.release_foreign();
    }
}

/// Limits for [`serve_http1_with`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpServeConfig {
    /// Connections kept open at once. A client arriving when they are all open
    /// takes the place of the one that has waited longest on its client (idle
    /// between requests, or sending its headers or body slowly); if every
    /// connection is being answered, the newcomer gets 503. Default 1024.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, also the idle limit of
    /// a kept-alive connection (None = unlimited). Default 10 s.
    pub header_read_timeout: Option<Duration>,
    /// Most bytes buffered per connection for a request's headers (hyper's
    /// read buffer; at least 8192). Default 64 KiB.
    pub max_buf_size: usize,
}

impl Default for HttpServeConfig {
    fn default() -> Self {
        HttpServeConfig {
            max_connections: 1024,
            header_read_timeout: Some(Duration::from_secs(10)),
            max_buf_size: 64 * 1024,
        }
    }
}

/// Counters of one HTTP server, read on its executor (for `/metrics`).
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Connections open now.
    pub open: Cell<u64>,
    pub accepted: Cell<u64>,
    /// Connections closed to make room while they waited on their client.
    pub shed: Cell<u64>,
    /// Clients answered 503 because every connection was being answered.
    pub refused: Cell<u64>,
    /// Connections closed because the client did not send its headers in time.
    pub header_timeouts: Cell<u64>,
}

fn bump(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

/// Who a connection is waiting on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pace {
    /// The client: the next request's headers, or a request body. Such a
    /// connection may be shed to make room.
    Client,
    /// The server: a request is being answered.
    Server,
}

struct ConnState {
    pace: Cell<Pace>,
    /// When `pace` last changed.
    since: Cell<Instant>,
    shed: Cell<bool>,
    waker: Cell<Option<Waker>>,
}

impl ConnState {
    fn set_pace(&self, pace: Pace) {
        self.pace.set(pace);
        self.since.set(Instant::now());
    }

    fn shed(&self) {
        self.shed.set(true);
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// A served connection, as its service sees it.
#[derive(Clone)]
pub struct Conn(Rc<ConnState>);

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("pace", &self.0.pace.get())
            .field("shed", &self.0.shed.get())
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// Runs `fut` (reading a request body, say) as time spent waiting on the
    /// client: if the server is full meanwhile, this connection may be closed
    /// to make room, as an idle one would.
    pub async fn client_paced<F: Future>(&self, fut: F) -> F::Output {
        struct Back<'a>(&'a ConnState);
        impl Drop for Back<'_> {
            fn drop(&mut self) {
                self.0.set_pace(Pace::Server);
            }
        }
        self.0.set_pace(Pace::Client);
        let _back = Back(&self.0);
        fut.await
    }
}

/// Resolves once the connection is shed.
struct Shed<'a>(&'a ConnState);

impl Future for Shed<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0.shed.get() {
            return Poll::Ready(());
        }
        self.0.waker.set(Some(cx.waker().clone()));
        Poll::Pending
    }
}

/// A service that marks its connection server-paced while it answers.
struct Tracked<S> {
    inner: S,
    conn: Conn,
}

impl<S, Req> Service<Req> for Tracked<S>
where
    S: Service<Req>,
    S::Future: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>>>>;

    fn call(&self, req: Req) -> Self::Future {
        struct Idle(Conn);
        impl Drop for Idle {
            fn drop(&mut self) {
                // Answered (or dropped): the connection waits on its client again.
                self.0 .0.set_pace(Pace::Client);
            }
        }
        self.conn.0.set_pace(Pace::Server);
        let idle = Idle(self.conn.clone());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let out = fut.await;
            drop(idle);
            out
        })
    }
}

/// The open connections of one server.
#[derive(Default)]
struct Conns {
    next_id: u64,
    open: HashMap<u64, Rc<ConnState>>,
}

impl Conns {
    /// The connection that has waited longest on its client, not shed yet.
    fn longest_waiting(&self) -> Option<&Rc<ConnState>> {
        self.open
            .values()
            .filter(|c| c.pace.get() == Pace::Client && !c.shed.get())
            .min_by_key(|c| c.since.get())
    }

    /// Connections not shed.
    fn live(&self) -> usize {
        self.open.values().filter(|c| !c.shed.get()).count()
    }
}

/// The answer to a client that finds every connection being answered.
fn refusal() -> Vec<u8> {
    let body = r#"{"detail":"every connection is busy; retry in a moment"}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serve HTTP/1.1 on `listener` with the default [`HttpServeConfig`], giving
/// each connection a fresh service from `make_service`.
pub async fn serve_http1<M, S, B>(
    listener: glommio::net::TcpListener,
    make_service: M,
) -> io::Result<()>
where
    M: Fn() -> S,
    S: Service<Request<Incoming>, Response = Response<B>> + 'static,
    S::Error: Into<BoxError>,
    S::Future: 'static,
    B: Body + 'static,
    B::Error: Into<BoxError>,
{
    let stats = Rc::new(HttpStats::default());
    serve_http1_with(listener, HttpServeConfig::default(), stats, |_| {
        make_service()
    })
    .await
}

/// Accept connections forever, serving each on its own detached task with a
/// service from `make_service` (which gets the connection's [`Conn`]). Open
/// connections are bounded by `cfg.max_connections`: at the bound, a new
/// client takes the place of the connection that has waited longest on its
/// client, or gets 503 when none is waiting on its client. Nothing a client
/// does or fails to do makes others wait. A failing connection is logged at
/// debug and does not stop the loop. Returns only on a listener error that
/// retrying cannot fix. Must run inside a glommio executor.
pub async fn serve_http1_with<M, S, B>(
    listener: glommio::net::TcpListener,
    cfg: HttpServeConfig,
    stats: Rc<HttpStats>,
    make_service: M,
) -> io::Result<()>
where
    M: Fn(&Conn) -> S,
    S: Service<Request<Incoming>, Response = Response<B>> + 'static,
    S::Error: Into<BoxError>,
    S::Future: 'static,
    B: Body + 'static,
    B::Error: Into<BoxError>,
{
    if cfg.max_connections == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "http max_connections must be at least 1",
        ));
    }
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(LocalTimer)
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(cfg.max_buf_size.max(8192));
    let conns = Rc::new(RefCell::new(Conns::default()));
    loop {
        let stream = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                let e = io::Error::from(e);
                if accept_error_is_transient(&e) {
                    log::debug!("http accept: {e}");
                    continue;
                }
                if accept_error_is_resource(&e) {
                    log::warn!("http accept: {e}; retrying in 100 ms");
                    glommio::timer::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                return Err(e);
            }
        };
        bump(&stats.accepted);
        if conns.borrow().live() >= cfg.max_connections {
            let victim = conns.borrow().longest_waiting().cloned();
            match victim {
                Some(v) => {
                    v.shed();
                    bump(&stats.shed);
                }
                None => {
                    bump(&stats.refused);
                    log_refusal(cfg.max_connections);
                    glommio::spawn_local(refuse(stream)).detach();
                    continue;
                }
            }
        }
        // Small responses: do not let Nagle hold them back.
        let _ = stream.set_nodelay(true);
        let peer = stream.peer_addr().ok();
        let state = Rc::new(ConnState {
            pace: Cell::new(Pace::Client),
            since: Cell::new(Instant::now()),
            shed: Cell::new(false),
            waker: Cell::new(None),
        });
        let conn = Conn(state.clone());
        let service = Tracked {
            inner: make_service(&conn),
            conn,
        };
        let id = {
            let mut c = conns.borrow_mut();
            c.next_id += 1;
            let id = c.next_id;
            c.open.insert(id, state.clone());
            id
        };
        stats.open.set(stats.open.get() + 1);
        let served = builder.serve_connection(HyperIo::new(stream), service);
        let (conns, stats) = (conns.clone(), stats.clone());
        glommio::spawn_local(async move {
            let ended = futures_lite::future::or(async { Some(served.await) }, async {
                Shed(&state).await;
                None
            })
            .await;
            match ended {
                // Shed: dropping the connection closed its socket.
                None => log::debug!("http connection from {peer:?} shed to make room"),
                Some(Ok(())) => {}
                Some(Err(e)) if e.is_timeout() => {
                    bump(&stats.header_timeouts);
                    log::debug!("http connection from {peer:?}: headers not sent in time");
                }
                Some(Err(e)) => log::debug!("http connection from {peer:?}: {e}"),
            }
            conns.borrow_mut().open.remove(&id);
            stats.open.set(stats.open.get() - 1);
        })
        .detach();
    }
}

/// Answers 503 and closes, within a second whatever the client does. The
/// request is read (and dropped) before closing: closing a socket with unread
/// bytes resets it, and the client could lose the answer.
async fn refuse(mut stream: glommio::net::TcpStream) {
    use futures_lite::{AsyncReadExt, AsyncWriteExt};
    let answer = refusal();
    let exchange = async {
        stream.write_all(&answer).await?;
        stream.shutdown(std::net::Shutdown::Write).await?;
        let mut sink = [0u8; 4096];
        let mut budget: usize = 64 * 1024;
        while budget > 0 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => budget = budget.saturating_sub(n),
            }
        }
        io::Result::Ok(())
    };
    let _ = crate::timeout::with_timeout(Duration::from_secs(1), exchange).await;
}

/// Logs that a client was refused because every connection is busy (at most
/// a few lines per window: a flood of clients must not flood the log).
fn log_refusal(max: usize) {
    crate::log_limited!(
        log::Level::Warn,
        "http: all {max} connections are being answered; a new client got 503"
    );
}

fn accept_error_is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    ) || matches!(e.raw_os_error(), Some(libc::EPROTO) | Some(libc::EPERM))
}

fn accept_error_is_resource(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS) | Some(libc::ENOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};

    type TestResult = Result<Response<Full<Bytes>>, hyper::Error>;

    async fn handle(req: Request<Incoming>, conn: Conn, stats: Rc<HttpStats>) -> TestResult {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let body = conn
            .client_paced(req.into_body().collect())
            .await?
            .to_bytes();
        let (status, text) = match (method.as_str(), path.as_str()) {
            ("GET", "/health") => (200, "ok".to_string()),
            ("GET", "/sleep") => {
                glommio::timer::sleep(Duration::from_millis(500)).await;
                (200, "slept".to_string())
            }
            ("GET", "/stats") => (
                200,
                format!(
                    "open={} accepted={} shed={} refused={} header_timeouts={}",
                    stats.open.get(),
                    stats.accepted.get(),
                    stats.shed.get(),
                    stats.refused.get(),
                    stats.header_timeouts.get()
                ),
            ),
            ("POST", "/echo") => (
                201,
                format!(
                    "got {} bytes: {}",
                    body.len(),
                    String::from_utf8_lossy(&body)
                ),
            ),
            ("POST", "/sum") => (
                200,
                format!(
                    "{} {}",
                    body.len(),
                    body.iter().map(|b| *b as u64).sum::<u64>()
                ),
            ),
            _ => (404, "not found".to_string()),
        };
        Ok(Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(text)))
            .unwrap())
    }

    fn serve_test(
        listener: glommio::net::TcpListener,
        cfg: HttpServeConfig,
    ) -> impl Future<Output = io::Result<()>> {
        let stats = Rc::new(HttpStats::default());
        serve_http1_with(listener, cfg, stats.clone(), move |conn| {
            let (conn, stats) = (conn.clone(), stats.clone());
            hyper::service::service_fn(move |req| handle(req, conn.clone(), stats.clone()))
        })
    }

    /// Starts a server shard; returns its address and a stop handle.
    fn start_server(
        cfg: HttpServeConfig,
    ) -> (
        SocketAddr,
        crate::mailbox::MailboxSender<()>,
        crate::executor::ShardHandle,
    ) {
        let (stop_tx, stop_rx) = crate::mailbox::mailbox::<()>(1);
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let shard =
            crate::executor::spawn_shard(0, None, "kvs-http-test".into(), move || async move {
                let mut stop_rx = stop_rx;
                let listener = glommio::net::TcpListener::bind("127.0.0.1:0").unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                let serve = serve_test(listener, cfg);
                let stop = async {
                    stop_rx.recv().await;
                    Ok(())
                };
                futures_lite::future::or(serve, stop).await.unwrap();
            })
            .unwrap();
        (addr_rx.recv().unwrap(), stop_tx, shard)
    }

    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        exchange(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
    }

    /// A client that sent `head` and waits; reads what the server says.
    fn stalled(addr: SocketAddr, head: &[u8]) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(head).unwrap();
        s
    }

    /// True if the server closed `s` without answering.
    fn closed_unanswered(s: &mut TcpStream) -> bool {
        let mut rest = Vec::new();
        let n = s.read_to_end(&mut rest).unwrap_or(0);
        n == 0 || !rest.starts_with(b"HTTP/1.1 2")
    }

    fn exchange(addr: SocketAddr, raw: &[u8]) -> (u16, String) {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(raw).unwrap();
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).unwrap();
        let resp = String::from_utf8(resp).unwrap();
        let status: u16 = resp
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {resp:?}"));
        let body = resp
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_string();
        (status, body)
    }

    #[test]
    fn get_post_malformed_and_keeps_serving() {
        let (addr, stop, shard) = start_server(HttpServeConfig::default());

        let (st, body) = exchange(
            addr,
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert_eq!((st, body.as_str()), (200, "ok"));

        let (st, body) = exchange(
            addr,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
        );
        assert_eq!((st, body.as_str()), (201, "got 5 bytes: hello"));

        // A body larger than one read chunk arrives whole.
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut req = format!(
            "POST /sum HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            big.len()
        )
        .into_bytes();
        req.extend_from_slice(&big);
        let (st, body) = exchange(addr, &req);
        let want = format!(
            "{} {}",
            big.len(),
            big.iter().map(|b| *b as u64).sum::<u64>()
        );
        assert_eq!((st, body), (200, want));

        let (st, _) = exchange(addr, b"NOT A REQUEST\x01\r\n\r\n");
        assert_eq!(st, 400);

        let (st, body) = exchange(
            addr,
            b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert_eq!((st, body.as_str()), (404, "not found"));

        // Two requests on one kept-alive connection.
        let (st, body) = exchange(
            addr,
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(st, 200);
        assert!(
            body.contains("ok") && body.matches("HTTP/1.1 200").count() == 1,
            "{body:?}"
        );

        stop.try_send(()).unwrap();
        shard.join().unwrap();
    }

    #[test]
    fn a_full_server_sheds_the_client_waiting_longest() {
        let (addr, stop, shard) = start_server(HttpServeConfig {
            max_connections: 2,
            ..HttpServeConfig::default()
        });
        let mut oldest = stalled(addr, b"GET /health HTTP/1.1\r\n");
        std::thread::sleep(Duration::from_millis(50));
        let mut newer = stalled(addr, b"GET /health HTTP/1.1\r\nHost:");
        std::thread::sleep(Duration::from_millis(50));
        // Both places are taken by clients that never finish their headers.
        let started = Instant::now();
        assert_eq!(get(addr, "/health"), (200, "ok".to_string()));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(
            closed_unanswered(&mut oldest),
            "the longest-waiting client is shed"
        );
        // The other one is still open: it can finish its request.
        newer.write_all(b" x\r\nConnection: close\r\n\r\n").unwrap();
        let mut answer = String::new();
        newer.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let (_, stats) = get(addr, "/stats");
        assert_eq!(
            stats, "open=1 accepted=4 shed=1 refused=0 header_timeouts=0",
            "one shed, none refused"
        );
        stop.try_send(()).unwrap();
        shard.join().unwrap();
    }

    #[test]
    fn a_slow_body_is_shed_but_an_answer_in_progress_is_not() {
        let (addr, stop, shard) = start_server(HttpServeConfig {
            max_connections: 1,
            ..HttpServeConfig::default()
        });
        // Headers done, body promised but not sent: the client sets the pace.
        let mut slow_body = stalled(
            addr,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc",
        );
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(get(addr, "/health"), (200, "ok".to_string()));
        assert!(closed_unanswered(&mut slow_body));

        // A request being answered holds its place: the newcomer gets 503 at once.
        let sleeper = std::thread::spawn(move || get(addr, "/sleep"));
        std::thread::sleep(Duration::from_millis(150));
        let started = Instant::now();
        let (st, body) = get(addr, "/health");
        assert_eq!(st, 503, "{body}");
        assert!(started.elapsed() < Duration::from_millis(400));
        assert_eq!(sleeper.join().unwrap(), (200, "slept".to_string()));
        let (_, stats) = get(addr, "/stats");
        assert!(stats.contains("shed=1 refused=1"), "{stats}");
        stop.try_send(()).unwrap();
        shard.join().unwrap();
    }

    #[test]
    fn slow_headers_are_cut_off_and_counted() {
        let (addr, stop, shard) = start_server(HttpServeConfig {
            header_read_timeout: Some(Duration::from_millis(200)),
            ..HttpServeConfig::default()
        });
        let started = Instant::now();
        let mut slow = stalled(addr, b"GET /health HTTP/1.1\r\nHost:");
        assert!(closed_unanswered(&mut slow));
        assert!(started.elapsed() >= Duration::from_millis(150));
        let (_, stats) = get(addr, "/stats");
        assert!(stats.ends_with("header_timeouts=1"), "{stats}");
        stop.try_send(()).unwrap();
        shard.join().unwrap();
    }

    #[test]
    fn oversized_headers_are_refused() {
        let (addr, stop, shard) = start_server(HttpServeConfig {
            max_buf_size: 8192,
            ..HttpServeConfig::default()
        });
        let big = format!(
            "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(20_000)
        );
        let (st, _) = exchange(addr, big.as_bytes());
        assert_eq!(st, 431);
        assert_eq!(get(addr, "/health"), (200, "ok".to_string()));
        stop.try_send(()).unwrap();
        shard.join().unwrap();
    }

    #[test]
    fn zero_connection_limit_is_rejected() {
        let (tx, rx) = std::sync::mpsc::channel();
        crate::executor::spawn_shard(0, None, "kvs-http-zero".into(), move || async move {
            let listener = glommio::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let cfg = HttpServeConfig {
                max_connections: 0,
                ..HttpServeConfig::default()
            };
            let r = serve_test(listener, cfg).await;
            tx.send(r.map_err(|e| e.kind())).unwrap();
        })
        .unwrap()
        .join()
        .unwrap();
        assert_eq!(rx.recv().unwrap(), Err(io::ErrorKind::InvalidInput));
    }

    #[test]
    fn local_timer_sleeps_and_resets() {
        crate::executor::spawn_shard(0, None, "kvs-timer".into(), || async {
            let t = LocalTimer;
            let start = Instant::now();
            t.sleep(Duration::from_millis(30)).await;
            assert!(start.elapsed() >= Duration::from_millis(30));
            let mut s = t.sleep(Duration::from_secs(60));
            // Poll once so the glommio timer exists, then pull the deadline in.
            let _ = futures_lite::future::poll_once(&mut s).await;
            t.reset(&mut s, Instant::now() + Duration::from_millis(20));
            let start = Instant::now();
            s.await;
            assert!(start.elapsed() < Duration::from_secs(5));
        })
        .unwrap()
        .join()
        .unwrap();
    }
}
