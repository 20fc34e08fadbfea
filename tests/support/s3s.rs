//! An s3s-fs server for tests (the root crate's end-to-end tests and the
//! engine's adapter tests include this file).

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

fn s3s_free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn s3s_unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// An s3s-fs 0.14.1 server on loopback (it checks SigV4 signatures and payload
/// hashes, and speaks HTTP/1.1 and h2c), with its own root directory, stopped
/// and removed on drop. Its binary comes from [`s3s_fs_binary`].
pub struct S3sFs {
    child: Child,
    pub port: u16,
    /// The port of the `Host` names it serves virtual-hosted buckets under:
    /// its own, or that of a proxy in front of it.
    pub domain_port: u16,
    pub root: std::path::PathBuf,
}

pub const S3_ACCESS_KEY: &str = "kvshard-test-ak";
pub const S3_SECRET_KEY: &str = "kvshard-test-secret";

/// The s3s-fs binary: `KVSHARD_S3S_FS`, else where
/// `tools/s3/install-s3s-fs.sh` installs it, installing it first when it is
/// missing (once: the script serializes concurrent installs), so that
/// `cargo test --workspace` needs nothing else.
pub fn s3s_fs_binary() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KVSHARD_S3S_FS") {
        return p.into();
    }
    let home = std::env::var_os("HOME").expect("HOME");
    let p = std::path::Path::new(&home).join(".cache/kvshard/s3s-fs-0.14.1/bin/s3s-fs");
    if p.exists() {
        return p;
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("tools/s3/install-s3s-fs.sh"))
        .find(|s| s.exists())
        .expect("tools/s3/install-s3s-fs.sh above the crate");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .expect("run tools/s3/install-s3s-fs.sh");
    assert!(
        out.status.success(),
        "installing s3s-fs with {} failed ({}); install it by hand or set KVSHARD_S3S_FS",
        script.display(),
        out.status
    );
    let installed = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        installed.exists(),
        "{} is missing after the install",
        installed.display()
    );
    installed
}

impl S3sFs {
    /// Starts the server with `buckets` created, virtual-hosted style on
    /// `localhost:<port>` (so `<bucket>.localhost:<port>` addresses a bucket).
    pub fn start(buckets: &[&str]) -> S3sFs {
        Self::start_with_domain(buckets, None)
    }

    /// As [`S3sFs::start`], for clients that reach it through a proxy on
    /// `domain_port` (the `Host` header is signed, so the proxy cannot
    /// rewrite it, and s3s-fs matches it against its domain verbatim).
    pub fn start_with_domain(buckets: &[&str], domain_port: Option<u16>) -> S3sFs {
        let root = std::env::temp_dir().join(s3s_unique("kvshard-s3s"));
        for b in buckets {
            std::fs::create_dir_all(root.join(b)).unwrap();
        }
        let port = s3s_free_port();
        let domain_port = domain_port.unwrap_or(port);
        let child = Self::spawn(port, domain_port, &root);
        S3sFs {
            child,
            port,
            domain_port,
            root,
        }
    }

    fn spawn(port: u16, domain_port: u16, root: &std::path::Path) -> Child {
        let child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", S3_ACCESS_KEY, "--secret-key", S3_SECRET_KEY])
            .args(["--domain", &format!("localhost:{domain_port}")])
            .arg(root)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn s3s-fs");
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "s3s-fs did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    }

    /// Starts the server again (after [`S3sFs::kill`]) on the same port and
    /// root: the same buckets and objects.
    pub fn restart(&mut self) {
        self.kill();
        self.child = Self::spawn(self.port, self.domain_port, &self.root);
    }

    /// An `--l2-adapter` spec for `bucket` on this server (virtual-hosted,
    /// plain HTTP, static keys), plus `extra` JSON fields (`,"k":v...`).
    pub fn adapter(&self, bucket: &str, extra: &str) -> String {
        format!(
            r#"{{"type":"s3","s3_endpoint":"{bucket}.localhost:{}","s3_region":"us-east-1","disable_tls":true,"aws_access_key_id":"{S3_ACCESS_KEY}","aws_secret_access_key":"{S3_SECRET_KEY}"{extra}}}"#,
            self.domain_port
        )
    }

    /// The bytes of object `name` in `bucket`.
    pub fn object_bytes(&self, bucket: &str, name: &str) -> Vec<u8> {
        std::fs::read(self.root.join(bucket).join(name)).unwrap()
    }

    /// The file of object `name` in `bucket` (its mtime is the object's
    /// LastModified).
    pub fn object_path(&self, bucket: &str, name: &str) -> std::path::PathBuf {
        self.root.join(bucket).join(name)
    }

    /// Object names in `bucket` (files under its directory, recursively).
    pub fn objects(&self, bucket: &str) -> Vec<(String, u64)> {
        fn walk(dir: &std::path::Path, base: &std::path::Path, out: &mut Vec<(String, u64)>) {
            let Ok(rd) = std::fs::read_dir(dir) else {
                return;
            };
            for e in rd.flatten() {
                let p = e.path();
                // A file s3s-fs removes (an object deleted, a temporary
                // renamed) while the walk runs is not there.
                let Ok(md) = e.metadata() else {
                    continue;
                };
                if md.is_dir() {
                    walk(&p, base, out);
                } else {
                    let name = p.strip_prefix(base).unwrap().to_string_lossy().into_owned();
                    // s3s-fs keeps upload parts and metadata beside objects.
                    if !name.contains(".upload") && !name.starts_with('.') {
                        out.push((name, md.len()));
                    }
                }
            }
        }
        let mut v = Vec::new();
        let base = self.root.join(bucket);
        walk(&base, &base, &mut v);
        v.sort();
        v
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGSTOP: the server keeps its sockets (connections are accepted by
    /// the kernel) and answers nothing, as a hung S3 does.
    pub fn freeze(&self) {
        // SAFETY: kill(2) of our own, not yet reaped child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGSTOP) };
    }

    /// SIGCONT after [`S3sFs::freeze`].
    pub fn thaw(&self) {
        // SAFETY: as in `freeze`.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGCONT) };
    }
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        // A stopped process still dies of SIGKILL.
        self.kill();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
