//! Test servers and helpers: s3s-fs on a free port, a glommio shard to run
//! a client on, payload patterns, and a tiny scripted HTTP/1.1 server.

#![allow(dead_code)]

use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvshard_s3_raw::addressing::{resolve_bucket, AddressingConfig, BucketAddress};
use kvshard_s3_raw::credentials::Credentials;
use kvshard_s3_raw::retry::RetryConfig;
use kvshard_s3_raw::{CredentialsConfig, S3ClientConfig};

pub const ACCESS_KEY: &str = "AKIDKVSHARDTEST";
pub const SECRET_KEY: &str = "kvshard-test-secret";
pub const REGION: &str = "us-east-1";

/// Runs `f` on a fresh glommio executor thread and waits; a panic inside
/// fails the calling test with the same message.
pub fn on_shard<F, Fut>(name: &str, f: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let handle = kvshard_io::executor::spawn_shard(0, None, name.to_owned(), f)
        .expect("start a glommio executor");
    if let Err(panic) = handle.join() {
        std::panic::resume_unwind(panic);
    }
}

/// A deterministic payload: different per `seed`, no short period.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        let take = v.len().min(len - out.len());
        out.extend_from_slice(&v[..take]);
    }
    out
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kvshard-s3raw-{label}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

#[path = "../../../tests/support/s3s.rs"]
#[allow(dead_code)]
mod shared_s3s;

/// The s3s-fs binary, installed on first use (see the shared test support).
pub fn s3s_fs_binary() -> PathBuf {
    shared_s3s::s3s_fs_binary()
}

/// s3s-fs on a loopback port with a temp root holding one bucket; killed
/// on drop.
pub struct S3sFs {
    child: Option<Child>,
    pub port: u16,
    pub bucket: String,
    root: TempDir,
}

impl S3sFs {
    pub fn start(bucket: &str) -> S3sFs {
        let root = TempDir::new("s3s");
        std::fs::create_dir_all(root.path().join(bucket)).expect("create bucket dir");
        let mut server = S3sFs {
            child: None,
            port: free_port(),
            bucket: bucket.to_owned(),
            root,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none());
        let mut child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg("--domain")
            .arg(format!("localhost:{}", self.port))
            .arg(self.root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        let started = Instant::now();
        loop {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("s3s-fs exited at start with {status} (port {})", self.port);
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "s3s-fs did not listen on {} within 15 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
    }

    /// Kills the server (the data stays).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and root.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `http://127.0.0.1:port` with path-style addressing.
    pub fn path_style_address(&self) -> BucketAddress {
        let endpoint = format!("http://127.0.0.1:{}", self.port);
        resolve_bucket(&AddressingConfig {
            bucket_url: &self.bucket,
            region: REGION,
            endpoint_url: Some(&endpoint),
            disable_tls: true,
        })
        .expect("path-style address")
    }

    /// `bucket.localhost:port`, virtual-hosted (lmcache's form).
    pub fn virtual_hosted_address(&self) -> BucketAddress {
        let url = format!("s3://{}.localhost:{}", self.bucket, self.port);
        resolve_bucket(&AddressingConfig {
            bucket_url: &url,
            region: REGION,
            endpoint_url: None,
            disable_tls: true,
        })
        .expect("virtual-hosted address")
    }
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn credentials(secret: &str) -> CredentialsConfig {
    CredentialsConfig::Static(Credentials::new(ACCESS_KEY, secret, None, None).expect("creds"))
}

/// Test settings: the smallest parts S3 accepts (5 MiB, multipart above
/// 5 MiB) so multipart uploads and ranged GETs run on small objects; quick
/// retries.
pub fn test_config(address: BucketAddress, prefer_http2: bool) -> S3ClientConfig {
    let mut cfg = S3ClientConfig::new(address, REGION, credentials(SECRET_KEY));
    cfg.prefer_http2 = prefer_http2;
    cfg.ca_bundle = None;
    cfg.multipart_threshold_bytes = 5 << 20;
    cfg.part_size_bytes = 5 << 20;
    cfg.get_part_size_bytes = 5 << 20;
    cfg.max_parallel_parts = 4;
    cfg.request_timeout = Duration::from_secs(20);
    cfg.operation_timeout = Duration::from_secs(60);
    cfg.retry = RetryConfig {
        base_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(50),
        ..RetryConfig::default()
    };
    cfg
}

/// Whole-object GETs only, for HTTP/2 against s3s-fs. s3s-fs 0.14.1 serves
/// a range by streaming the file to its end in 4 KiB reads and truncating,
/// so every read past the range becomes an empty HTTP/2 DATA frame; h2
/// 0.4.20 closes a connection that has received more than 100 empty DATA
/// frames (GOAWAY ENHANCE_YOUR_CALM "too_many_data_frames"). Ranged GETs
/// are tested over HTTP/1.1, where empty chunks are not framed.
pub fn whole_object_gets(cfg: &mut S3ClientConfig) {
    cfg.get_part_size_bytes = 1 << 30;
}

/// Address of a hand-written server at 127.0.0.1:port (path style).
pub fn local_address(bucket: &str, port: u16) -> BucketAddress {
    let endpoint = format!("http://127.0.0.1:{port}");
    resolve_bucket(&AddressingConfig {
        bucket_url: bucket,
        region: REGION,
        endpoint_url: Some(&endpoint),
        disable_tls: true,
    })
    .expect("local address")
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
