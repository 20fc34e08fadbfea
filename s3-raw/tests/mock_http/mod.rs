//! Small HTTP/1.1 servers on 127.0.0.1 for the credential sources: a
//! generic one that answers through a closure, a mock EC2 instance metadata
//! service (IMDSv2 only: a GET without a valid token gets 401), and helpers
//! for the credential JSON and the STS XML.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use kvshard_s3_raw::time::AmzDate;

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
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn read_request(stream: &mut TcpStream) -> Option<MockRequest> {
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
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).ok()?;
    Some(MockRequest {
        method,
        target,
        headers,
        body,
    })
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
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a mock server");
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let count = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (seen, count, stop) = (seen.clone(), count.clone(), stop.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut stream) = conn else { continue };
                    let (handler, seen, count) = (handler.clone(), seen.clone(), count.clone());
                    std::thread::spawn(move || {
                        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                        let Some(req) = read_request(&mut stream) else {
                            return;
                        };
                        let n = count.fetch_add(1, Ordering::SeqCst);
                        seen.lock().unwrap().push(req.clone());
                        let resp = handler(n, &req);
                        std::thread::sleep(resp.delay);
                        if !resp.hang_up {
                            write_response(&mut stream, &resp);
                        }
                    });
                }
            })
        };
        MockServer {
            port,
            seen,
            count,
            stop,
            thread: Some(thread),
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

impl Drop for MockServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
