//! A RESP2 client for one glommio shard: per node, a few connections, each
//! carrying many requests at once (pipelined: written back to back, replies
//! matched in order).
//!
//! - A value body is written from the caller's memory ([`Body`]) and a bulk
//!   reply is read from the socket into the caller's memory ([`Dest`]): no
//!   copy of the value on either side but what TLS needs.
//! - Every request has a deadline. One that passes it closes its
//!   connection (the replies behind it would be out of step), and every
//!   request on that connection fails; the caller hears the failure only
//!   once the connection's tasks are done with its memory.
//! - A connection is set up (TCP, TLS by rustls, AUTH, SELECT) within the
//!   connect deadline. A failed one is tried again after a backoff that
//!   doubles from [`BACKOFF_START`] to [`BACKOFF_MAX`]; meanwhile requests
//!   fail at once.
//! - Connection-level failures (connect, timeout, a connection that breaks)
//!   move the node's circuit breaker; while it is open requests fail at
//!   once, until its cooldown ends or a probe (a PING) is answered. One
//!   request per [`PROBE_EVERY`] sends that probe first, so the node is used
//!   again within about a second of its return, however long the cooldown
//!   has grown.
//! - A nil reply, or a bulk of another size than the destination, is an
//!   answer ([`Answer`]), read to its end: the connection stays in step.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use kvshard_s3_raw::breaker::{Breaker, BreakerConfig};
use kvshard_s3_raw::net::{self, Stream};
use kvshard_s3_raw::retry::SystemClock;

use crate::{check_bulk_end, encode, parse_head, parse_reply, Head, Reply, RespError, CRLF};

/// First wait before a failed connect is tried again.
pub const BACKOFF_START: Duration = Duration::from_millis(100);
/// Longest wait between connect attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Commands without a body written in one go, at most.
const COALESCE_BYTES: usize = 64 * 1024;
/// Read buffer of a connection; grows for a large small reply (a slot map).
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Largest reply read whole into the buffer.
const MAX_BUFFERED_REPLY: usize = 16 << 20;
/// A bulk reply at least this large counts against
/// [`LARGE_REPLIES_PER_CONNECTION`].
pub const LARGE_REPLY_BYTES: usize = 1 << 20;
/// Large replies a node's server is asked for at once, per connection. The
/// server builds a reply in its own memory before it sends it, so a deep
/// pipeline of large GETs only grows the server's buffers (64 of 32 MiB on
/// 8 connections is 2 GiB there) and slows every reply; the requests behind
/// wait here, within their deadline.
pub const LARGE_REPLIES_PER_CONNECTION: usize = 1;
/// How often a node whose breaker is open is probed by a request.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long a probe waits for its PING.
pub const PROBE_LIMIT: Duration = Duration::from_secs(2);

/// The commands the counters tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Op {
    Get,
    Set,
    Exists,
    Strlen,
    Del,
    Scan,
    Ping,
    Cluster,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::Set => "set",
            Op::Exists => "exists",
            Op::Strlen => "strlen",
            Op::Del => "del",
            Op::Scan => "scan",
            Op::Ping => "ping",
            Op::Cluster => "cluster",
        }
    }
}

/// Caller memory a value body is written from.
#[derive(Debug, Clone, Copy)]
pub struct Body {
    ptr: *const u8,
    len: usize,
}

impl Body {
    /// # Safety
    /// `ptr..ptr+len` stays valid for reads, and unwritten, until the
    /// [`Node::call`] (or [`crate::router`] call) it is handed to resolves,
    /// and that call is driven to completion.
    pub unsafe fn new(ptr: *const u8, len: usize) -> Body {
        Body { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn slice(&self) -> &[u8] {
        // SAFETY: the constructor's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Caller memory a bulk reply is read into.
#[derive(Debug, Clone, Copy)]
pub struct Dest {
    ptr: *mut u8,
    len: usize,
}

impl Dest {
    /// # Safety
    /// `ptr..ptr+len` stays valid for writes, and used by nobody else,
    /// until the call it is handed to resolves, and that call is driven to
    /// completion.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Dest {
        Dest { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[allow(clippy::mut_from_ref)]
    fn slice(&self) -> &mut [u8] {
        // SAFETY: the constructor's contract; only the connection's reader
        // touches it, one reply at a time.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// One command, ready to send (again, after a redirect).
#[derive(Debug, Clone)]
pub struct Request {
    pub op: Op,
    /// The encoded command; with a body, up to the body's bulk length line.
    head: Vec<u8>,
    body: Option<Body>,
    /// Arguments after the body (its CRLF first).
    tail: Vec<u8>,
    /// Read a bulk reply of `dest.len()` bytes into `dest`.
    dest: Option<Dest>,
    /// Send `ASKING` first (a cluster's ASK redirect).
    pub asking: bool,
}

impl Request {
    /// A command of small arguments; its reply is parsed whole.
    pub fn command(op: Op, args: &[&[u8]]) -> Request {
        let mut head = Vec::new();
        encode(&mut head, args);
        Request {
            op,
            head,
            body: None,
            tail: Vec::new(),
            dest: None,
            asking: false,
        }
    }

    /// A command whose last argument is `body`, sent from where it lies.
    pub fn with_body(op: Op, args: &[&[u8]], body: Body) -> Request {
        Request::with_body_then(op, args, body, &[])
    }

    /// A command of `args`, then `body` (sent from where it lies), then
    /// `after` (`SET key value EX ttl`).
    pub fn with_body_then(op: Op, args: &[&[u8]], body: Body, after: &[&[u8]]) -> Request {
        let mut head = Vec::new();
        crate::encode_arguments(&mut head, args, body.len(), after.len());
        let mut tail = CRLF.to_vec();
        for a in after {
            crate::encode_bulk(&mut tail, a);
        }
        Request {
            op,
            head,
            body: Some(body),
            tail,
            dest: None,
            asking: false,
        }
    }

    /// A command whose bulk reply is read into `dest` when its size is
    /// `dest.len()` ([`Answer::Filled`]).
    pub fn into_dest(op: Op, args: &[&[u8]], dest: Dest) -> Request {
        let mut r = Request::command(op, args);
        r.dest = Some(dest);
        r
    }

    /// Bytes this request writes.
    pub fn wire_len(&self) -> usize {
        self.head.len() + self.body.map_or(0, |b| b.len()) + self.tail.len()
    }
}

/// What a request got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A reply, parsed whole (for a destination request: any reply that is
    /// not a bulk string, nil and errors included).
    Reply(Reply),
    /// The bulk reply was read into the destination, whole.
    Filled,
    /// The bulk reply had this many bytes, not the destination's; it was
    /// read and dropped.
    WrongSize(usize),
}

/// Why a request got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Not sent: no connection (connect failed, backing off) or the breaker
    /// is open.
    Unavailable,
    /// No reply within the request deadline.
    Timeout,
    /// The connection broke (reset, closed) before the reply.
    Connection,
    /// The server's bytes are not RESP.
    Protocol,
    /// AUTH or SELECT refused: a configuration problem.
    Refused,
}

impl ErrorKind {
    /// The outcome label of the counters.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Connection => "connection",
            ErrorKind::Protocol => "protocol",
            ErrorKind::Refused => "refused",
        }
    }

    /// Counts toward the breaker.
    fn is_connection_level(self) -> bool {
        matches!(
            self,
            ErrorKind::Timeout | ErrorKind::Connection | ErrorKind::Protocol
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientError {
    pub kind: ErrorKind,
    pub message: String,
}

impl ClientError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ClientError {
        ClientError {
            kind,
            message: message.into(),
        }
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.label(), self.message)
    }
}

impl std::error::Error for ClientError {}

/// How to reach and talk to the servers.
#[derive(Clone)]
pub struct Options {
    /// `AUTH username password` (ACL user) when both, `AUTH password` with
    /// only a password.
    pub username: Option<String>,
    pub password: Option<String>,
    /// `SELECT` after connecting (standalone only).
    pub database: Option<u32>,
    /// TLS (rustls, server certificate verified) when set.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Connections per node.
    pub connections: usize,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub breaker: BreakerConfig,
}

impl fmt::Debug for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Options")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("database", &self.database)
            .field("tls", &self.tls.is_some())
            .field("connections", &self.connections)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// Counters of one client (all its nodes), for `/status` and metrics.
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests by (command, outcome).
    requests: RefCell<BTreeMap<(&'static str, &'static str), u64>>,
    pub connects: Cell<u64>,
    pub connect_failures: Cell<u64>,
    pub timeouts: Cell<u64>,
    pub breaker_trips: Cell<u64>,
    pub bytes_sent: Cell<u64>,
    pub bytes_received: Cell<u64>,
}

impl Stats {
    /// Counts one request of `op` that ended as `outcome`.
    pub fn count(&self, op: Op, outcome: &'static str) {
        *self
            .requests
            .borrow_mut()
            .entry((op.name(), outcome))
            .or_default() += 1;
    }

    fn add(cell: &Cell<u64>, n: u64) {
        cell.set(cell.get() + n);
    }

    /// The counters as JSON: `requests.{op}.{outcome}` and the totals.
    pub fn json(&self) -> serde_json::Value {
        let mut requests = serde_json::Map::new();
        for ((op, outcome), n) in self.requests.borrow().iter() {
            let e = requests
                .entry(op.to_string())
                .or_insert_with(|| serde_json::json!({}));
            e[*outcome] = (*n).into();
        }
        serde_json::json!({
            "requests": requests,
            "connects": self.connects.get(),
            "connect_failures": self.connect_failures.get(),
            "timeouts": self.timeouts.get(),
            "breaker_trips": self.breaker_trips.get(),
            "bytes_sent": self.bytes_sent.get(),
            "bytes_received": self.bytes_received.get(),
        })
    }
}

// ------------------------------------------------------------ a connection

type Done = LocalSender<Result<Answer, ClientError>>;

/// A request written, waiting for its reply.
struct Pending {
    dest: Option<Dest>,
    /// The reply to skip (`ASKING`'s) has no one waiting.
    done: Option<Done>,
}

/// A request waiting to be written.
struct Outgoing {
    head: Vec<u8>,
    body: Option<Body>,
    tail: Vec<u8>,
    asking: bool,
    pending: Pending,
    /// Dropped once the writer is done with `body`.
    _body_lease: Option<LocalSender<()>>,
}

struct ConnState {
    fd: RawFd,
    dead: Cell<bool>,
    why: RefCell<String>,
    /// Written, reply not read yet, in order.
    written: RefCell<VecDeque<Pending>>,
    /// Not written yet.
    outgoing: RefCell<VecDeque<Outgoing>>,
    /// Requests handed in and not answered.
    inflight: Cell<usize>,
    stats: Rc<Stats>,
}

impl ConnState {
    /// Marks the connection dead and shuts its socket down, which ends both
    /// of its tasks' socket calls; they then fail what they hold.
    fn kill(&self, why: &str) {
        if self.dead.replace(true) {
            return;
        }
        *self.why.borrow_mut() = why.to_owned();
        // SAFETY: the fd is open: both tasks hold halves of the stream and
        // end only after `dead` is set, which this call just did.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }

    fn failure(&self) -> ClientError {
        let why = self.why.borrow();
        let kind = if why.starts_with("protocol") {
            ErrorKind::Protocol
        } else if why.starts_with("timeout") {
            ErrorKind::Timeout
        } else {
            ErrorKind::Connection
        };
        ClientError::new(kind, why.clone())
    }

    fn fail_all(&self) {
        let e = self.failure();
        let written: Vec<Pending> = self.written.borrow_mut().drain(..).collect();
        for p in written {
            if let Some(d) = p.done {
                let _ = d.try_send(Err(e.clone()));
            }
        }
        let outgoing: Vec<Outgoing> = self.outgoing.borrow_mut().drain(..).collect();
        for o in outgoing {
            if let Some(d) = o.pending.done {
                let _ = d.try_send(Err(e.clone()));
            }
        }
    }
}

struct Conn {
    state: Rc<ConnState>,
    /// Rings the writer; dropping it ends the writer.
    doorbell: LocalSender<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The tasks end on their own once the socket is shut down.
        self.state.kill("connection closed by the client");
    }
}

impl Conn {
    fn is_alive(&self) -> bool {
        !self.state.dead.get()
    }

    /// Hands `req` to the connection; the answer comes on the returned
    /// channel, and for a body, the lease channel closes once the body is
    /// written or dropped.
    fn submit(
        &self,
        req: &Request,
    ) -> (
        LocalReceiver<Result<Answer, ClientError>>,
        Option<LocalReceiver<()>>,
    ) {
        let (done, answer) = local_channel::new_bounded(1);
        let (lease, released) = match req.body {
            Some(_) => {
                let (tx, rx) = local_channel::new_bounded(1);
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        let pending = Pending {
            dest: req.dest,
            done: Some(done),
        };
        if self.state.dead.get() {
            if let Some(d) = pending.done {
                let _ = d.try_send(Err(self.state.failure()));
            }
            return (answer, released);
        }
        self.state.outgoing.borrow_mut().push_back(Outgoing {
            head: req.head.clone(),
            body: req.body,
            tail: req.tail.clone(),
            asking: req.asking,
            pending,
            _body_lease: lease,
        });
        let _ = self.doorbell.try_send(());
        (answer, released)
    }
}

async fn write_all_parts(wr: &mut WriteHalf<Stream>, parts: &[&[u8]]) -> io::Result<usize> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let (mut part, mut off) = (0usize, 0usize);
    while part < parts.len() {
        let slices: Vec<io::IoSlice<'_>> = std::iter::once(&parts[part][off..])
            .chain(parts[part + 1..].iter().copied())
            .map(io::IoSlice::new)
            .collect();
        let mut n = wr.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "the socket took no bytes",
            ));
        }
        while part < parts.len() && n >= parts[part].len() - off {
            n -= parts[part].len() - off;
            part += 1;
            off = 0;
        }
        off += n;
    }
    Ok(total)
}

async fn writer(state: Rc<ConnState>, mut wr: WriteHalf<Stream>, doorbell: LocalReceiver<()>) {
    let mut batch: Vec<u8> = Vec::with_capacity(COALESCE_BYTES);
    let asking = {
        let mut v = Vec::new();
        encode(&mut v, &[b"ASKING"]);
        v
    };
    while doorbell.recv().await.is_some() {
        loop {
            let Some(out) = state.outgoing.borrow_mut().pop_front() else {
                break;
            };
            if state.dead.get() {
                if let Some(d) = out.pending.done {
                    let _ = d.try_send(Err(state.failure()));
                }
                continue;
            }
            {
                let mut written = state.written.borrow_mut();
                if out.asking {
                    written.push_back(Pending {
                        dest: None,
                        done: None,
                    });
                    batch.extend_from_slice(&asking);
                }
                written.push_back(out.pending);
            }
            batch.extend_from_slice(&out.head);
            let more = !state.outgoing.borrow().is_empty();
            let r = match out.body {
                Some(body) => {
                    let r = write_all_parts(&mut wr, &[&batch, body.slice(), &out.tail]).await;
                    batch.clear();
                    r
                }
                None if batch.len() >= COALESCE_BYTES || !more => {
                    let r = write_all_parts(&mut wr, &[&batch]).await;
                    batch.clear();
                    r
                }
                None => Ok(0),
            };
            // The body lease ends here: nothing reads the body any more.
            drop(out._body_lease);
            match r {
                Ok(n) => Stats::add(&state.stats.bytes_sent, n as u64),
                Err(e) => {
                    state.kill(&format!("write: {e}"));
                    batch.clear();
                }
            }
        }
        if !batch.is_empty() && !state.dead.get() {
            if let Err(e) = write_all_parts(&mut wr, &[&batch]).await {
                state.kill(&format!("write: {e}"));
            }
            batch.clear();
        }
        if !state.dead.get() {
            if let Err(e) = wr.flush().await {
                state.kill(&format!("write: {e}"));
            }
        }
        if state.dead.get() {
            state.fail_all();
        }
    }
    state.fail_all();
}

/// The read side's buffer.
struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl ReadBuf {
    fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Reads more; an error at end of stream.
    async fn fill(&mut self, rd: &mut ReadHalf<Stream>, stats: &Stats) -> Result<(), String> {
        if self.start > 0 && self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            if self.buf.len() >= MAX_BUFFERED_REPLY {
                return Err(format!(
                    "protocol: a reply is larger than the {MAX_BUFFERED_REPLY} bytes read whole"
                ));
            }
            let len = (self.buf.len() * 2).min(MAX_BUFFERED_REPLY);
            self.buf.resize(len, 0);
        }
        let end = self.end;
        match rd.read(&mut self.buf[end..]).await {
            Ok(0) => Err("the server closed the connection".to_owned()),
            Ok(n) => {
                self.end += n;
                Stats::add(&stats.bytes_received, n as u64);
                Ok(())
            }
            Err(e) => Err(format!("read: {e}")),
        }
    }
}

fn protocol(e: RespError) -> String {
    format!("protocol: {e}")
}

/// Reads one whole reply.
async fn read_reply(
    rd: &mut ReadHalf<Stream>,
    buf: &mut ReadBuf,
    stats: &Stats,
) -> Result<Reply, String> {
    loop {
        if let Some((reply, used)) = parse_reply(buf.data()).map_err(protocol)? {
            buf.consume(used);
            return Ok(reply);
        }
        buf.fill(rd, stats).await?;
    }
}

/// Most bytes a value body's read waits for before it is woken
/// (`SO_RCVLOWAT`): fewer wake-ups per large value.
const BODY_LOWAT_BYTES: usize = 256 * 1024;

/// Sets the socket's `SO_RCVLOWAT`; a failure only costs wake-ups.
fn set_rcvlowat(fd: RawFd, bytes: usize) {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: `fd` is the connection's open socket and `v` a live c_int of
    // the length passed.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Reads `n` bytes into `out`, buffered ones first.
///
/// With `body_lowat`, `out` is a value body that its bulk's CRLF follows,
/// read straight from that plain TCP socket: each wait is for as many bytes
/// as are still due, up to [`BODY_LOWAT_BYTES`], so that the task wakes
/// once per piece of that size and not per segment. The low mark is back at
/// 1 when it returns. (Not under TLS: rustls may hold bytes of the body
/// already, and the socket would wait for bytes that never come.)
async fn read_exact_into(
    rd: &mut ReadHalf<Stream>,
    buf: &mut ReadBuf,
    out: &mut [u8],
    body_lowat: Option<RawFd>,
    stats: &Stats,
) -> Result<(), String> {
    let have = buf.data().len().min(out.len());
    out[..have].copy_from_slice(&buf.data()[..have]);
    buf.consume(have);
    let mut filled = have;
    let mut lowat = 1;
    let r = loop {
        if filled == out.len() {
            break Ok(());
        }
        if let Some(fd) = body_lowat {
            // The CRLF is due too, so a mark of `left + 2` never waits for
            // bytes that will not come.
            let want = (out.len() - filled + 2).min(BODY_LOWAT_BYTES);
            if want != lowat {
                set_rcvlowat(fd, want);
                lowat = want;
            }
        }
        match rd.read(&mut out[filled..]).await {
            Ok(0) => {
                break Err(format!(
                    "the server closed the connection {filled} bytes into a {}-byte value",
                    out.len()
                ))
            }
            Ok(n) => {
                filled += n;
                Stats::add(&stats.bytes_received, n as u64);
            }
            Err(e) => break Err(format!("read: {e}")),
        }
    };
    if let Some(fd) = body_lowat.filter(|_| lowat != 1) {
        set_rcvlowat(fd, 1);
    }
    r
}

/// Reads the reply to a destination request.
async fn read_into(
    rd: &mut ReadHalf<Stream>,
    buf: &mut ReadBuf,
    dest: Dest,
    body_lowat: Option<RawFd>,
    stats: &Stats,
) -> Result<Answer, String> {
    let (len, used) = loop {
        match parse_head(buf.data()).map_err(protocol)? {
            Some((Head::Bulk(n), used)) => break (n, used),
            Some(_) => return read_reply(rd, buf, stats).await.map(Answer::Reply),
            None => buf.fill(rd, stats).await?,
        }
    };
    buf.consume(used);
    let answer = if len == dest.len() {
        read_exact_into(rd, buf, dest.slice(), body_lowat, stats).await?;
        Answer::Filled
    } else {
        // Drop a value of the wrong size, in buffer-sized pieces.
        let mut left = len;
        let mut scratch = vec![0u8; left.min(READ_BUFFER_BYTES)];
        while left > 0 {
            let n = left.min(scratch.len());
            read_exact_into(rd, buf, &mut scratch[..n], None, stats).await?;
            left -= n;
        }
        Answer::WrongSize(len)
    };
    let mut end = [0u8; 2];
    read_exact_into(rd, buf, &mut end, None, stats).await?;
    check_bulk_end(end).map_err(protocol)?;
    Ok(answer)
}

/// `body_lowat`: the socket, when value bodies are read straight from it
/// (plain TCP; see [`read_exact_into`]).
async fn reader(state: Rc<ConnState>, mut rd: ReadHalf<Stream>, body_lowat: Option<RawFd>) {
    let mut buf = ReadBuf {
        buf: vec![0; READ_BUFFER_BYTES],
        start: 0,
        end: 0,
    };
    let stats = state.stats.clone();
    let why = loop {
        if buf.data().is_empty() {
            if let Err(e) = buf.fill(&mut rd, &stats).await {
                break e;
            }
        }
        let Some(p) = state.written.borrow_mut().pop_front() else {
            if state.dead.get() {
                break "connection closed".to_owned();
            }
            break "protocol: the server sent a reply nobody asked for".to_owned();
        };
        let r = match p.dest {
            Some(d) => read_into(&mut rd, &mut buf, d, body_lowat, &stats).await,
            None => read_reply(&mut rd, &mut buf, &stats)
                .await
                .map(Answer::Reply),
        };
        match r {
            Ok(a) => {
                if let Some(d) = p.done {
                    let _ = d.try_send(Ok(a));
                }
            }
            Err(e) => {
                state.kill(&e);
                if let Some(d) = p.done {
                    let _ = d.try_send(Err(state.failure()));
                }
                break e;
            }
        }
    };
    state.kill(&why);
    state.fail_all();
}

/// Writes `args` and reads one reply on a stream not yet split (the
/// handshake).
async fn exchange(stream: &mut Stream, args: &[&[u8]]) -> Result<Reply, String> {
    let mut out = Vec::new();
    encode(&mut out, args);
    stream
        .write_all(&out)
        .await
        .map_err(|e| format!("write: {e}"))?;
    stream.flush().await.map_err(|e| format!("write: {e}"))?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 512];
    loop {
        if let Some((reply, _)) = parse_reply(&buf).map_err(protocol)? {
            return Ok(reply);
        }
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("the server closed the connection".to_owned());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 64 * 1024 {
            return Err("protocol: a handshake reply is too long".to_owned());
        }
    }
}

fn expect_ok(what: &str, reply: Reply) -> Result<(), ClientError> {
    match reply {
        Reply::Simple(s) if s == b"OK" => Ok(()),
        Reply::Error(e) => Err(ClientError::new(
            ErrorKind::Refused,
            format!("{what} refused: {}", String::from_utf8_lossy(&e)),
        )),
        other => Err(ClientError::new(
            ErrorKind::Protocol,
            format!("{what}: unexpected reply {other:?}"),
        )),
    }
}

async fn open(
    host: &str,
    port: u16,
    opts: &Options,
    stats: &Rc<Stats>,
) -> Result<Conn, ClientError> {
    let unavailable = |m: String| ClientError::new(ErrorKind::Unavailable, m);
    let addrs = net::resolve(host, port)
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let tcp = net::connect_addrs(&addrs, Some(opts.connect_timeout))
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let mut stream = match &opts.tls {
        None => Stream::Tcp(tcp),
        Some(cfg) => {
            let name = net::server_name(host).map_err(|e| unavailable(e.to_string()))?;
            let connector = futures_rustls::TlsConnector::from(cfg.clone());
            let tls = net::connect_tls(&connector, name, tcp)
                .await
                .map_err(|e| match e {
                    net::ConnectError::TlsRejected(m) => {
                        ClientError::new(ErrorKind::Refused, format!("TLS handshake rejected: {m}"))
                    }
                    e => unavailable(e.to_string()),
                })?;
            Stream::Tls(Box::new(tls))
        }
    };
    let handshake = |e: String| ClientError::new(ErrorKind::Connection, e);
    if let Some(password) = &opts.password {
        let reply = match &opts.username {
            Some(user) => {
                exchange(
                    &mut stream,
                    &[b"AUTH", user.as_bytes(), password.as_bytes()],
                )
                .await
            }
            None => exchange(&mut stream, &[b"AUTH", password.as_bytes()]).await,
        }
        .map_err(handshake)?;
        expect_ok("AUTH", reply)?;
    }
    if let Some(db) = opts.database {
        let reply = exchange(&mut stream, &[b"SELECT", db.to_string().as_bytes()])
            .await
            .map_err(handshake)?;
        expect_ok("SELECT", reply)?;
    }
    let fd = stream.tcp_fd();
    let body_lowat = matches!(stream, Stream::Tcp(_)).then_some(fd);
    let (rd, wr) = stream.split();
    let state = Rc::new(ConnState {
        fd,
        dead: Cell::new(false),
        why: RefCell::new(String::new()),
        written: RefCell::new(VecDeque::new()),
        outgoing: RefCell::new(VecDeque::new()),
        inflight: Cell::new(0),
        stats: stats.clone(),
    });
    let (doorbell, ring) = local_channel::new_bounded(1);
    glommio::spawn_local(writer(state.clone(), wr, ring)).detach();
    glommio::spawn_local(reader(state.clone(), rd, body_lowat)).detach();
    Ok(Conn { state, doorbell })
}

// ------------------------------------------------------------ a node

/// The connections of one shard to one server.
pub struct Node {
    host: String,
    port: u16,
    opts: Options,
    conns: RefCell<Vec<Rc<Conn>>>,
    /// One connect at a time.
    connect_gate: glommio::sync::Semaphore,
    /// Large replies asked for at once ([`LARGE_REPLIES_PER_CONNECTION`]).
    large_gate: glommio::sync::Semaphore,
    /// No connect before this (after a failed one).
    retry_at: Cell<Option<Instant>>,
    backoff: Cell<Duration>,
    last_connect_error: RefCell<Option<ClientError>>,
    breaker: Breaker,
    /// When a request last probed past the open breaker, and whether one
    /// does now.
    last_probe: Cell<Option<Instant>>,
    probing: Cell<bool>,
    stats: Rc<Stats>,
}

impl Node {
    pub fn new(host: &str, port: u16, opts: Options, stats: Rc<Stats>) -> Node {
        let breaker = Breaker::labeled(
            opts.breaker.clone(),
            Arc::new(SystemClock),
            &format!("resp {host}:{port}"),
        );
        let large = opts.connections.max(1) * LARGE_REPLIES_PER_CONNECTION;
        Node {
            host: host.to_owned(),
            port,
            opts,
            conns: RefCell::new(Vec::new()),
            connect_gate: glommio::sync::Semaphore::new(1),
            large_gate: glommio::sync::Semaphore::new(large as u64),
            retry_at: Cell::new(None),
            backoff: Cell::new(BACKOFF_START),
            last_connect_error: RefCell::new(None),
            breaker,
            last_probe: Cell::new(None),
            probing: Cell::new(false),
            stats,
        }
    }

    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// Whether requests fail at once: the breaker is open, or there is no
    /// connection and the next connect waits out a backoff.
    pub fn breaker_open(&self) -> bool {
        self.breaker.status().open || (self.connections() == 0 && self.backing_off())
    }

    /// Live connections.
    pub fn connections(&self) -> usize {
        self.conns.borrow().iter().filter(|c| c.is_alive()).count()
    }

    /// Closes every connection (their requests fail).
    pub fn close_connections(&self) -> usize {
        let conns: Vec<Rc<Conn>> = self.conns.borrow_mut().drain(..).collect();
        let n = conns.len();
        for c in &conns {
            c.state.kill("connection closed by the client");
        }
        n
    }

    /// `/status` of the node.
    pub fn status(&self) -> serde_json::Value {
        let b = self.breaker.status();
        serde_json::json!({
            "address": self.address(),
            "connections": self.connections(),
            "breaker_open": self.breaker_open(),
            "breaker_retry_in_seconds": b.retry_in_seconds,
            "breaker_trips": b.trips,
            "last_connect_error": self.last_connect_error.borrow().as_ref().map(|e| e.to_string()),
        })
    }

    /// The live connection with the fewest requests in flight.
    fn least_busy(&self) -> Option<Rc<Conn>> {
        let mut conns = self.conns.borrow_mut();
        conns.retain(|c| c.is_alive());
        conns.iter().min_by_key(|c| c.state.inflight.get()).cloned()
    }

    fn backing_off(&self) -> bool {
        self.retry_at.get().is_some_and(|at| Instant::now() < at)
    }

    /// [`Node::least_busy`], opening a connection when there is none, or
    /// when there are fewer than wanted and every one is busy (one connect
    /// at a time; none while backing off after a failed one).
    async fn pick(&self) -> Result<Rc<Conn>, ClientError> {
        let want = self.opts.connections.max(1);
        if let Some(c) = self.least_busy() {
            if c.state.inflight.get() == 0
                || self.conns.borrow().len() >= want
                || self.backing_off()
            {
                return Ok(c);
            }
            let Ok(_permit) = self.connect_gate.try_acquire_permit(1) else {
                return Ok(c);
            };
            return Ok(self.connect().await.unwrap_or(c));
        }
        let _permit = self
            .connect_gate
            .acquire_permit(1)
            .await
            .expect("the gate is never closed");
        if let Some(c) = self.least_busy() {
            return Ok(c);
        }
        if self.backing_off() {
            return Err(self
                .last_connect_error
                .borrow()
                .clone()
                .unwrap_or_else(|| ClientError::new(ErrorKind::Unavailable, "reconnecting")));
        }
        self.connect().await
    }

    /// Opens one more connection (the caller holds the connect gate).
    async fn connect(&self) -> Result<Rc<Conn>, ClientError> {
        let opened = kvshard_io::timeout::with_timeout(
            self.opts.connect_timeout,
            open(&self.host, self.port, &self.opts, &self.stats),
        )
        .await
        .unwrap_or_else(|| {
            Err(ClientError::new(
                ErrorKind::Unavailable,
                format!("no answer within {:?}", self.opts.connect_timeout),
            ))
        });
        match opened {
            Ok(c) => {
                Stats::add(&self.stats.connects, 1);
                self.retry_at.set(None);
                self.backoff.set(BACKOFF_START);
                *self.last_connect_error.borrow_mut() = None;
                let c = Rc::new(c);
                self.conns.borrow_mut().push(c.clone());
                Ok(c)
            }
            Err(mut e) => {
                Stats::add(&self.stats.connect_failures, 1);
                e.message = format!("connect to {}: {}", self.address(), e.message);
                let wait = self.backoff.get();
                self.retry_at.set(Some(Instant::now() + wait));
                self.backoff.set((wait * 2).min(BACKOFF_MAX));
                if e.kind != ErrorKind::Refused && self.breaker.record_connection_failure() {
                    Stats::add(&self.stats.breaker_trips, 1);
                }
                kvshard_io::log_limited!(log::Level::Warn, "resp: {e}; next try in {wait:?}");
                *self.last_connect_error.borrow_mut() = Some(e.clone());
                Err(e)
            }
        }
    }

    /// Sends `req` and waits for its answer (or its failure) within the
    /// request deadline; counts the outcome under `req.op`, the caller
    /// counting what the answer means.
    pub async fn call(&self, req: &Request) -> Result<Answer, ClientError> {
        if let Err(left) = self.breaker.check() {
            // Once a [`PROBE_EVERY`] a request probes first, so that the
            // breaker closes within about that long of the server's return
            // whatever its cooldown has grown to.
            let due = !self.probing.get()
                && self
                    .last_probe
                    .get()
                    .is_none_or(|at| at.elapsed() >= PROBE_EVERY);
            let answered = if due {
                self.probing.set(true);
                self.last_probe.set(Some(Instant::now()));
                let r = self.probe().await;
                self.probing.set(false);
                r.is_ok()
            } else {
                false
            };
            if !answered {
                self.stats.count(req.op, "unavailable");
                return Err(ClientError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "{}: circuit breaker open, retry in {:.1} s",
                        self.address(),
                        left.as_secs_f64()
                    ),
                ));
            }
        }
        let r = self.call_past_breaker(req, self.opts.request_timeout).await;
        match &r {
            Ok(_) => self.breaker.record_success(),
            Err(e) if e.kind.is_connection_level() => {
                if self.breaker.record_connection_failure() {
                    Stats::add(&self.stats.breaker_trips, 1);
                }
            }
            Err(_) => {}
        }
        r
    }

    async fn call_past_breaker(
        &self,
        req: &Request,
        limit: Duration,
    ) -> Result<Answer, ClientError> {
        let start = Instant::now();
        let _large = match req.dest {
            Some(d) if d.len() >= LARGE_REPLY_BYTES => {
                let waited =
                    kvshard_io::timeout::with_timeout(limit, self.large_gate.acquire_permit(1))
                        .await;
                match waited {
                    Some(p) => Some(p.expect("the gate is never closed")),
                    None => {
                        Stats::add(&self.stats.timeouts, 1);
                        let e = ClientError::new(
                            ErrorKind::Timeout,
                            format!(
                                "no turn on {} within {limit:?} (large replies queued)",
                                self.address()
                            ),
                        );
                        self.stats.count(req.op, e.kind.label());
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        let limit = limit.saturating_sub(start.elapsed());
        let conn = match self.pick().await {
            Ok(c) => c,
            Err(e) => {
                self.stats.count(req.op, e.kind.label());
                return Err(e);
            }
        };
        let state = conn.state.clone();
        state.inflight.set(state.inflight.get() + 1);
        let (answer, released) = conn.submit(req);
        drop(conn);
        let mut timed_out = false;
        let got = match kvshard_io::timeout::with_timeout(limit, answer.recv()).await {
            Some(a) => a,
            None => {
                timed_out = true;
                Stats::add(&self.stats.timeouts, 1);
                state.kill(&format!(
                    "timeout: no reply from {} within {limit:?}",
                    self.address()
                ));
                // The connection's tasks answer once they let go of the
                // request's memory.
                answer.recv().await
            }
        };
        if let Some(r) = released {
            while r.recv().await.is_some() {}
        }
        state.inflight.set(state.inflight.get() - 1);
        let r = match got {
            Some(Ok(a)) if !timed_out => Ok(a),
            Some(Err(e)) => Err(e),
            Some(Ok(_)) | None => Err(ClientError::new(
                ErrorKind::Timeout,
                format!("no reply from {} within {limit:?}", self.address()),
            )),
        };
        match &r {
            Ok(Answer::Reply(Reply::Error(_))) => self.stats.count(req.op, "error"),
            Ok(Answer::Reply(Reply::Nil)) => self.stats.count(req.op, "nil"),
            Ok(Answer::WrongSize(_)) => self.stats.count(req.op, "wrong_size"),
            Ok(_) => self.stats.count(req.op, "ok"),
            Err(e) => self.stats.count(req.op, e.kind.label()),
        }
        r
    }

    /// PING past an open breaker, within [`PROBE_LIMIT`]: `Ok` when the
    /// server answered at all (which closes the breaker).
    pub async fn probe(&self) -> Result<(), ClientError> {
        let req = Request::command(Op::Ping, &[b"PING"]);
        let limit = PROBE_LIMIT.min(self.opts.request_timeout);
        // A probe may connect at once, whatever the backoff says.
        self.retry_at.set(None);
        match self.call_past_breaker(&req, limit).await {
            Ok(_) => {
                if self.breaker.probe_answered() {
                    log::info!("resp {}: the server answers again", self.address());
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
