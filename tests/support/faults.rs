//! A fault-injecting TCP proxy (plain threads) to put between kvshard and
//! s3s-fs: it passes traffic through, or misbehaves as told, so the s3
//! adapter meets dead endpoints, cut connections, stalls and throttling
//! through the real server.
//!
//! HTTP/1.1 connections are relayed request by request, so a fault can pick
//! its requests (by method) and start or stop between two requests on one
//! kept-alive connection. HTTP/2 (h2c) connections are piped as bytes; only
//! the connection-level faults ([`Fault::Refuse`], [`Fault::Stall`]) reach
//! them.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the proxy does to the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Pass everything through.
    None,
    /// Close every new connection as soon as it is accepted.
    Refuse,
    /// Accept and read whatever comes, never answer (any protocol).
    Stall,
    /// HTTP/1.1 requests of this method: read the request, never answer.
    StallRequests(&'static str),
    /// HTTP/1.1 PUTs: forward the head and the first `n` body bytes, then
    /// close both sides (the server sees a body cut short).
    CutPutBody(usize),
    /// HTTP/1.1 GETs: forward the request, then the answer's head and the
    /// first `n` body bytes, then close both sides.
    CutGetBody(usize),
    /// HTTP/1.1 requests (of this method, or all): answer `503 SlowDown`
    /// with an S3 XML error body, as S3 does when throttling (no body for a
    /// HEAD, which the client then sees as a plain 503).
    SlowDown(Option<&'static str>),
}

impl Fault {
    fn connection_level(self) -> bool {
        matches!(self, Fault::Refuse | Fault::Stall)
    }

    fn applies_to(self, method: &str) -> bool {
        match self {
            Fault::None | Fault::Refuse | Fault::Stall => false,
            Fault::StallRequests(m) => m == method,
            Fault::CutPutBody(_) => method == "PUT",
            Fault::CutGetBody(_) => method == "GET",
            Fault::SlowDown(m) => m.is_none_or(|m| m == method),
        }
    }
}

const SLOW_DOWN_XML: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message><RequestId>FAULTPROXY</RequestId></Error>";

struct Shared {
    upstream: AtomicU16,
    /// The fault and how many more times it fires (`None`: until replaced).
    fault: Mutex<(Fault, Option<u64>)>,
    injected: AtomicU64,
    requests: AtomicU64,
    /// Both sockets of every connection, to cut them.
    live: Mutex<Vec<TcpStream>>,
    stop: AtomicBool,
}

impl Shared {
    /// The fault for a new connection, when it is a connection-level one.
    fn take_connection_fault(&self) -> Option<Fault> {
        self.take(|f| f.connection_level())
    }

    fn take_request_fault(&self, method: &str) -> Option<Fault> {
        self.take(|f| f.applies_to(method))
    }

    fn take(&self, applies: impl Fn(Fault) -> bool) -> Option<Fault> {
        let mut st = self.fault.lock().unwrap();
        let (fault, left) = *st;
        if !applies(fault) {
            return None;
        }
        match left {
            Some(0) => {
                *st = (Fault::None, None);
                return None;
            }
            Some(n) => {
                *st = if n == 1 {
                    (Fault::None, None)
                } else {
                    (fault, Some(n - 1))
                };
            }
            None => {}
        }
        self.injected.fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }

    fn track(&self, s: &TcpStream) {
        if let Ok(c) = s.try_clone() {
            self.live.lock().unwrap().push(c);
        }
    }

    fn cut_all(&self) {
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// The proxy: listens on `127.0.0.1:port` and relays to the upstream port.
pub struct FaultProxy {
    pub port: u16,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Listens now; relays once [`FaultProxy::set_upstream`] names the
    /// server (connections before that are closed).
    pub fn start() -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            upstream: AtomicU16::new(0),
            fault: Mutex::new((Fault::None, None)),
            injected: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            live: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if sh.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let sh = sh.clone();
                std::thread::spawn(move || serve(conn, &sh));
            }
        });
        FaultProxy { port, shared }
    }

    pub fn set_upstream(&self, port: u16) {
        self.shared.upstream.store(port, Ordering::SeqCst);
    }

    /// Applies `fault` from now on. A connection-level fault also cuts the
    /// connections already open, so that no request slips through on one.
    pub fn set(&self, fault: Fault) {
        *self.shared.fault.lock().unwrap() = (fault, None);
        if fault.connection_level() {
            self.shared.cut_all();
        }
    }

    /// Applies `fault` to the next `n` requests (connections, for a
    /// connection-level fault) it concerns, then passes traffic again.
    pub fn set_times(&self, fault: Fault, n: u64) {
        *self.shared.fault.lock().unwrap() = (fault, Some(n));
        if fault.connection_level() {
            self.shared.cut_all();
        }
    }

    /// Closes every open connection (both sides).
    pub fn cut_all(&self) {
        self.shared.cut_all();
    }

    /// Times a fault fired (requests or connections it hit).
    pub fn injected(&self) -> u64 {
        self.shared.injected.load(Ordering::SeqCst)
    }

    /// HTTP/1.1 requests seen.
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.cut_all();
        // Wakes the accept loop so that it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Reads and drops whatever comes until the peer closes.
fn drain(mut s: &TcpStream) {
    let mut buf = [0u8; 16 << 10];
    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
}

fn serve(client: TcpStream, sh: &Shared) {
    sh.track(&client);
    if sh.stop.load(Ordering::SeqCst) {
        return;
    }
    match sh.take_connection_fault() {
        Some(Fault::Refuse) => {
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        Some(_) => {
            drain(&client);
            return;
        }
        None => {}
    }
    let upstream = match sh.upstream.load(Ordering::SeqCst) {
        0 => None,
        port => TcpStream::connect(("127.0.0.1", port)).ok(),
    };
    let Some(upstream) = upstream else {
        // The server is gone: as if the connection was reset.
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    sh.track(&upstream);
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    // h2c with prior knowledge starts with "PRI * HTTP/2.0".
    let mut first = [0u8; 3];
    let h2 = loop {
        match client.peek(&mut first) {
            Ok(0) | Err(_) => return,
            Ok(n) if n < first.len() => std::thread::sleep(Duration::from_millis(1)),
            Ok(_) => break &first == b"PRI",
        }
    };
    if h2 {
        pipe(client, upstream);
    } else {
        let _ = relay_http1(&client, &upstream, sh);
        let _ = client.shutdown(Shutdown::Both);
        let _ = upstream.shutdown(Shutdown::Both);
    }
}

/// Copies bytes both ways until either side closes.
fn pipe(client: TcpStream, upstream: TcpStream) {
    let (c2, u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut &c2, &mut &u2);
        let _ = u2.shutdown(Shutdown::Write);
    });
    let _ = io::copy(&mut &upstream, &mut &client);
    let _ = client.shutdown(Shutdown::Both);
    let _ = upstream.shutdown(Shutdown::Both);
    let _ = up.join();
}

/// A message head: the raw bytes, the first line and the headers.
struct Head {
    raw: Vec<u8>,
    line: String,
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn content_length(&self) -> Option<u64> {
        self.header("content-length")
            .and_then(|v| v.trim().parse().ok())
    }

    fn chunked(&self) -> bool {
        self.header("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
    }
}

/// The next head, `None` at a clean end of stream.
fn read_head(r: &mut impl BufRead) -> io::Result<Option<Head>> {
    let mut raw = Vec::new();
    let mut line = String::new();
    let mut headers = Vec::new();
    loop {
        let mut l = Vec::new();
        if r.read_until(b'\n', &mut l)? == 0 {
            if raw.is_empty() {
                return Ok(None);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        raw.extend_from_slice(&l);
        let text = String::from_utf8_lossy(&l).trim_end().to_owned();
        if text.is_empty() {
            if line.is_empty() {
                continue; // stray CRLF between messages
            }
            return Ok(Some(Head { raw, line, headers }));
        }
        if line.is_empty() {
            line = text;
        } else if let Some((k, v)) = text.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
}

/// Copies exactly `n` bytes.
fn copy_n(r: &mut impl Read, w: &mut impl Write, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), w)?;
    if copied < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Relays a chunked body as it is.
fn copy_chunked(r: &mut impl BufRead, w: &mut impl Write) -> io::Result<()> {
    loop {
        let mut l = Vec::new();
        r.read_until(b'\n', &mut l)?;
        w.write_all(&l)?;
        let text = String::from_utf8_lossy(&l);
        let size = text.trim().split(';').next().unwrap_or("");
        let size = u64::from_str_radix(size, 16)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad chunk size"))?;
        if size == 0 {
            // Trailers, then the empty line.
            loop {
                let mut t = Vec::new();
                if r.read_until(b'\n', &mut t)? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                w.write_all(&t)?;
                if t == b"\r\n" || t == b"\n" {
                    return Ok(());
                }
            }
        }
        copy_n(r, w, size + 2)?;
    }
}

fn relay_http1(client: &TcpStream, upstream: &TcpStream, sh: &Shared) -> io::Result<()> {
    let mut from_client = BufReader::new(client.try_clone()?);
    let mut from_upstream = BufReader::new(upstream.try_clone()?);
    let (mut to_client, mut to_upstream) = (client, upstream);
    loop {
        let Some(req) = read_head(&mut from_client)? else {
            return Ok(());
        };
        sh.requests.fetch_add(1, Ordering::SeqCst);
        let method = req.line.split(' ').next().unwrap_or("").to_owned();
        let body_len = req.content_length().unwrap_or(0);
        match sh.take_request_fault(&method) {
            Some(Fault::StallRequests(_)) => {
                copy_n(&mut from_client, &mut io::sink(), body_len)?;
                drain(client);
                return Ok(());
            }
            Some(Fault::SlowDown(_)) => {
                copy_n(&mut from_client, &mut io::sink(), body_len)?;
                // An answer to a HEAD has no body (S3 sends no error code then).
                let body = if method == "HEAD" { "" } else { SLOW_DOWN_XML };
                let resp = format!(
                    "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nx-amz-request-id: FAULTPROXY\r\n\r\n{body}",
                    body.len()
                );
                to_client.write_all(resp.as_bytes())?;
                continue;
            }
            Some(Fault::CutPutBody(n)) => {
                to_upstream.write_all(&req.raw)?;
                copy_n(&mut from_client, &mut to_upstream, (n as u64).min(body_len))?;
                to_upstream.flush()?;
                // Let the server read what it got before the cut.
                std::thread::sleep(Duration::from_millis(50));
                return Ok(());
            }
            Some(Fault::CutGetBody(n)) => {
                to_upstream.write_all(&req.raw)?;
                copy_n(&mut from_client, &mut to_upstream, body_len)?;
                let Some(resp) = read_head(&mut from_upstream)? else {
                    return Ok(());
                };
                to_client.write_all(&resp.raw)?;
                let len = resp.content_length().unwrap_or(u64::MAX);
                copy_n(&mut from_upstream, &mut to_client, (n as u64).min(len))?;
                to_client.flush()?;
                std::thread::sleep(Duration::from_millis(50));
                return Ok(());
            }
            _ => {}
        }
        to_upstream.write_all(&req.raw)?;
        if req.chunked() {
            copy_chunked(&mut from_client, &mut to_upstream)?;
        } else {
            copy_n(&mut from_client, &mut to_upstream, body_len)?;
        }
        let Some(resp) = read_head(&mut from_upstream)? else {
            return Ok(());
        };
        to_client.write_all(&resp.raw)?;
        let status: u16 = resp
            .line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if method == "HEAD" || status == 204 || status == 304 || (100..200).contains(&status) {
            continue;
        }
        if resp.chunked() {
            copy_chunked(&mut from_upstream, &mut to_client)?;
        } else if let Some(len) = resp.content_length() {
            copy_n(&mut from_upstream, &mut to_client, len)?;
        } else {
            io::copy(&mut from_upstream, &mut to_client)?;
            return Ok(());
        }
    }
}
