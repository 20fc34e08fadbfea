//! Test servers and helpers: s3s-fs on a free port, payload patterns,
//! addresses and client settings. The scripted HTTP/1.1 server and
//! `on_shard` live in `mock_http` (shared with the credential tests) and
//! are re-exported here.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvshard_s3_raw::addressing::{resolve_bucket, AddressingConfig, BucketAddress};
use kvshard_s3_raw::credentials::Credentials;
use kvshard_s3_raw::retry::RetryConfig;
use kvshard_s3_raw::{CredentialsConfig, S3ClientConfig};

pub use crate::mock_http::{
    on_shard, respond, skip_body, Action, Script, ScriptedServer, SeenRequest,
};

pub const ACCESS_KEY: &str = "AKIDKVSHARDTEST";
pub const SECRET_KEY: &str = "kvshard-test-secret";
pub const REGION: &str = "us-east-1";

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

pub use crate::common::TempDir;

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
