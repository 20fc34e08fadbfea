//! HTTP/1.1 test servers on 127.0.0.1, each connection on a std thread,
//! shared by the credential tests and the client tests: [`ScriptedServer`]
//! (a script gets each request head and the socket), [`MockServer`] (on top
//! of it: answers each parsed request through a closure, one request per
//! connection), a mock EC2 instance metadata service (IMDSv2 only: a GET
//! without a valid token gets 401), helpers for the credential JSON and the
//! STS XML; and [`on_shard`], to run async code on a glommio executor.

#![allow(dead_code)]

use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use kvshard_s3_raw::time::AmzDate;

/// Runs `f` on a fresh glommio executor thread and returns its output; a
/// panic inside fails the calling test with the same message.
pub fn on_shard<T, F, Fut>(name: &str, f: F) -> T
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    let out = Arc::new(Mutex::new(None));
    let slot = out.clone();
    let handle = kvshard_io::executor::spawn_shard(0, None, name.to_owned(), move || async move {
        let value = f().await;
        *slot.lock().unwrap() = Some(value);
    })
    .expect("start a glommio executor");
    if let Err(panic) = handle.join() {
        std::panic::resume_unwind(panic);
    }
    let value = out.lock().unwrap().take();
    value.expect("the shard ran to its end")
}

/// A request as the scripted server saw it.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body_len: usize,
}

/// What the scripted server does with request number `n` (0-based) of the
/// whole server. It gets the socket after the request head was read (the
/// body is still unread).
pub type Script = dyn Fn(usize, &SeenRequest, &mut TcpStream) -> Action + Send + Sync;

/// After a scripted answer.
pub enum Action {
    /// Read the next request on this connection.
    KeepAlive,
    /// Close the connection.
    Close,
}

/// A tiny HTTP/1.1 server on a std thread; every connection on its own
/// thread, running the script.
pub struct ScriptedServer {
    pub port: u16,
    pub requests: Arc<AtomicUsize>,
    pub seen: Arc<Mutex<Vec<SeenRequest>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Reads a request head; `None` at EOF.
pub fn read_head(stream: &mut TcpStream) -> Option<SeenRequest> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
        if head.len() > 64 << 10 {
            return None;
        }
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let mut request_line = lines.next()?.split(' ');
    let method = request_line.next()?.to_owned();
    let target = request_line.next()?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body_len = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    Some(SeenRequest {
        method,
        target,
        headers,
        body_len,
    })
}

/// Reads and discards `len` body bytes.
pub fn skip_body(stream: &mut TcpStream, len: usize) -> bool {
    let mut left = len;
    let mut buf = vec![0u8; 64 << 10];
    while left > 0 {
        match stream.read(&mut buf[..left.min(64 << 10)]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => left -= n,
        }
    }
    true
}

/// Writes a whole response with a body.
pub fn respond(stream: &mut TcpStream, status: &str, headers: &[(&str, &str)], body: &[u8]) {
    let mut out = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let _ = stream.write_all(out.as_bytes());
    let _ = stream.write_all(body);
    let _ = stream.flush();
}

impl ScriptedServer {
    pub fn start(script: Arc<Script>) -> ScriptedServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind scripted server");
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (requests, seen, stop) = (requests.clone(), seen.clone(), stop.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut stream) = conn else { continue };
                    let (script, requests, seen, stop) =
                        (script.clone(), requests.clone(), seen.clone(), stop.clone());
                    std::thread::spawn(move || {
                        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
                        while !stop.load(Ordering::SeqCst) {
                            let Some(req) = read_head(&mut stream) else {
                                return;
                            };
                            let n = requests.fetch_add(1, Ordering::SeqCst);
                            seen.lock().unwrap().push(req.clone());
                            match script(n, &req, &mut stream) {
                                Action::KeepAlive => {}
                                Action::Close => return,
                            }
                        }
                    });
                }
            })
        };
        ScriptedServer {
            port,
            requests,
            seen,
            stop,
            thread: Some(thread),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn request_count(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A request as the mock saw it.
#[derive(Debug, Clone)]
pub struct MockRequest {
    pub method: String,
    pub target: String,
    /// Lowercased names.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl MockRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    /// The body as `application/x-www-form-urlencoded` pairs, decoded.
    pub fn form(&self) -> Vec<(String, String)> {
        form_decode(std::str::from_utf8(&self.body).expect("form body is UTF-8"))
    }

    pub fn form_field(&self, name: &str) -> Option<String> {
        self.form()
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }
}

/// What the mock answers.
#[derive(Debug, Clone)]
pub struct MockResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Wait this long before answering.
    pub delay: Duration,
    /// Send the body with chunked transfer encoding.
    pub chunked: bool,
    /// Close the connection without answering.
    pub hang_up: bool,
}

impl MockResponse {
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> MockResponse {
        MockResponse {
            status,
            headers: Vec::new(),
            body: body.into(),
            delay: Duration::ZERO,
            chunked: false,
            hang_up: false,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> MockResponse {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn delayed(mut self, delay: Duration) -> MockResponse {
        self.delay = delay;
        self
    }

    pub fn chunked(mut self) -> MockResponse {
        self.chunked = true;
        self
    }

    pub fn hang_up() -> MockResponse {
        let mut r = MockResponse::new(0, Vec::new());
        r.hang_up = true;
        r
    }
}

pub type Handler = dyn Fn(usize, &MockRequest) -> MockResponse + Send + Sync;

/// An HTTP/1.1 server answering every request through a closure (given the
/// request's 0-based number), one connection per request.
pub struct MockServer {
    pub port: u16,
    seen: Arc<Mutex<Vec<MockRequest>>>,
    /// Requests received.
    pub count: Arc<AtomicUsize>,
    server: ScriptedServer,
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        500 => "Internal Server Error",
        _ => "Whatever",
    }
}

fn write_response(stream: &mut TcpStream, r: &MockResponse) {
    let mut out = format!("HTTP/1.1 {} {}\r\n", r.status, reason(r.status));
    for (k, v) in &r.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("Connection: close\r\n");
    let mut bytes = Vec::new();
    if r.chunked {
        out.push_str("Transfer-Encoding: chunked\r\n\r\n");
        bytes.extend_from_slice(out.as_bytes());
        for piece in r.body.chunks(7) {
            bytes.extend_from_slice(format!("{:x};ext=1\r\n", piece.len()).as_bytes());
            bytes.extend_from_slice(piece);
            bytes.extend_from_slice(b"\r\n");
        }
        bytes.extend_from_slice(b"0\r\nX-Trailer: 1\r\n\r\n");
    } else {
        out.push_str(&format!("Content-Length: {}\r\n\r\n", r.body.len()));
        bytes.extend_from_slice(out.as_bytes());
        bytes.extend_from_slice(&r.body);
    }
    let _ = stream.write_all(&bytes);
    let _ = stream.flush();
}

impl MockServer {
    pub fn start(handler: Arc<Handler>) -> MockServer {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let server = ScriptedServer::start(Arc::new(move |n, head, stream| {
            let mut body = vec![0u8; head.body_len];
            if stream.read_exact(&mut body).is_err() {
                return Action::Close;
            }
            let req = MockRequest {
                method: head.method.clone(),
                target: head.target.clone(),
                headers: head.headers.clone(),
                body,
            };
            record.lock().unwrap().push(req.clone());
            let resp = handler(n, &req);
            std::thread::sleep(resp.delay);
            if !resp.hang_up {
                write_response(stream, &resp);
            }
            Action::Close
        }));
        MockServer {
            port: server.port,
            count: server.requests.clone(),
            seen,
            server,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn requests(&self) -> Vec<MockRequest> {
        self.seen.lock().unwrap().clone()
    }

    pub fn request_count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// `2024-01-29T18:53:01Z`.
pub fn iso8601(time: SystemTime) -> String {
    let d = AmzDate::from_system_time(time).unwrap();
    let s = d.as_str();
    format!(
        "{}-{}-{}T{}:{}:{}Z",
        &s[0..4],
        &s[4..6],
        &s[6..8],
        &s[9..11],
        &s[11..13],
        &s[13..15]
    )
}

/// The JSON the IMDS and container endpoints answer.
pub fn credentials_json(
    access_key: &str,
    secret: &str,
    token: Option<&str>,
    expires_in: Duration,
) -> String {
    let token = token
        .map(|t| format!("\"Token\" : \"{t}\",\n  "))
        .unwrap_or_default();
    format!(
        "{{\n  \"Code\" : \"Success\",\n  \"LastUpdated\" : \"{}\",\n  \"Type\" : \"AWS-HMAC\",\n  \"AccessKeyId\" : \"{access_key}\",\n  \"SecretAccessKey\" : \"{secret}\",\n  {token}\"Expiration\" : \"{}\"\n}}",
        iso8601(SystemTime::now()),
        iso8601(SystemTime::now() + expires_in)
    )
}

/// An STS AssumeRoleWithWebIdentity answer.
pub fn sts_response(access_key: &str, secret: &str, token: &str, expires_in: Duration) -> String {
    format!(
        "<AssumeRoleWithWebIdentityResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">\n  <AssumeRoleWithWebIdentityResult>\n    <SubjectFromWebIdentityToken>system:serviceaccount:kv:kvshard</SubjectFromWebIdentityToken>\n    <AssumedRoleUser>\n      <Arn>arn:aws:sts::123456789012:assumed-role/kv/s</Arn>\n      <AssumedRoleId>AROA:s</AssumedRoleId>\n    </AssumedRoleUser>\n    <Credentials>\n      <SessionToken>{token}</SessionToken>\n      <SecretAccessKey>{secret}</SecretAccessKey>\n      <Expiration>{}</Expiration>\n      <AccessKeyId>{access_key}</AccessKeyId>\n    </Credentials>\n    <Audience>sts.amazonaws.com</Audience>\n  </AssumeRoleWithWebIdentityResult>\n  <ResponseMetadata>\n    <RequestId>req-1</RequestId>\n  </ResponseMetadata>\n</AssumeRoleWithWebIdentityResponse>\n",
        iso8601(SystemTime::now() + expires_in)
    )
}

/// Decodes `k=v&k=v` with `+` and `%XX`.
pub fn form_decode(text: &str) -> Vec<(String, String)> {
    fn decode(s: &str) -> String {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < b.len() => {
                    let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
                    out.push(u8::from_str_radix(hex, 16).unwrap());
                    i += 2;
                }
                c => out.push(c),
            }
            i += 1;
        }
        String::from_utf8(out).unwrap()
    }
    text.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

pub const IMDS_ROLE: &str = "kvshard-role";

/// A mock IMDSv2: `PUT /latest/api/token` (needs the TTL header) hands out
/// a token; the metadata GETs need it (else 401). `creds(n)` answers the
/// n-th credentials GET (0-based).
pub struct MockImds {
    pub server: MockServer,
    pub credential_gets: Arc<AtomicUsize>,
}

pub type CredsAnswer = dyn Fn(usize) -> MockResponse + Send + Sync;

impl MockImds {
    pub fn start(creds: Arc<CredsAnswer>) -> MockImds {
        let credential_gets = Arc::new(AtomicUsize::new(0));
        let tokens = Arc::new(AtomicUsize::new(0));
        let gets = credential_gets.clone();
        let server = MockServer::start(Arc::new(move |_, req| {
            let role_path = format!("/latest/meta-data/iam/security-credentials/{IMDS_ROLE}");
            match (req.method.as_str(), req.path()) {
                ("PUT", "/latest/api/token") => {
                    match req.header("x-aws-ec2-metadata-token-ttl-seconds") {
                        Some(ttl) if ttl.parse::<u32>().is_ok_and(|t| (1..=21600).contains(&t)) => {
                            let n = tokens.fetch_add(1, Ordering::SeqCst);
                            MockResponse::new(200, format!("IMDS-TOKEN-{n}"))
                                .header("X-aws-ec2-metadata-token-ttl-seconds", ttl)
                        }
                        _ => MockResponse::new(400, ""),
                    }
                }
                (_, "/latest/api/token") => MockResponse::new(405, ""),
                ("GET", path) => {
                    let issued = tokens.load(Ordering::SeqCst);
                    let valid = req
                        .header("x-aws-ec2-metadata-token")
                        .is_some_and(|t| (0..issued).any(|n| t == format!("IMDS-TOKEN-{n}")));
                    if !valid {
                        return MockResponse::new(401, "");
                    }
                    if path == "/latest/meta-data/iam/security-credentials/" {
                        MockResponse::new(200, format!("{IMDS_ROLE}\n"))
                    } else if path == role_path {
                        creds(gets.fetch_add(1, Ordering::SeqCst))
                    } else {
                        MockResponse::new(404, "")
                    }
                }
                _ => MockResponse::new(405, ""),
            }
        }));
        MockImds {
            server,
            credential_gets,
        }
    }

    /// Serves these credentials every time.
    pub fn serving(access_key: &str, secret: &str, token: Option<&str>) -> MockImds {
        let json = credentials_json(access_key, secret, token, Duration::from_secs(6 * 3600));
        MockImds::start(Arc::new(move |_| MockResponse::new(200, json.clone())))
    }

    pub fn endpoint(&self) -> String {
        self.server.url()
    }

    pub fn credential_gets(&self) -> usize {
        self.credential_gets.load(Ordering::SeqCst)
    }
}
