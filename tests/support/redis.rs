//! Real `redis-server` processes for tests (the root crate's end-to-end
//! tests and the engine's adapter tests include this file): one standalone
//! server, or a cluster of masters with replicas built by
//! `redis-cli --cluster create`. Each runs on loopback ports in its own
//! directory, stopped and removed on drop. The binaries come from
//! `tools/redis/install.sh` (Debian's packages), installed on first use.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

fn redis_free_port() -> u16 {
    // A cluster node also listens on port + 10000: keep both free.
    loop {
        let p = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        if p < 55000 && TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
            return p;
        }
    }
}

/// The directory of `redis-server` and `redis-cli`, installed first when
/// missing.
pub fn redis_bin_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .map(|d| d.join("tools/redis/install.sh"))
            .find(|s| s.exists())
            .expect("tools/redis/install.sh above the crate");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .expect("run tools/redis/install.sh");
        assert!(out.status.success(), "tools/redis/install.sh failed");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
    .clone()
}

/// A user's credentials for [`redis_call`].
pub type RedisAuth<'a> = Option<(&'a str, &'a str)>;

/// One command on a fresh connection, after `AUTH user password` when
/// `auth` is given: its reply, bytes as they are.
pub fn redis_call(port: u16, auth: RedisAuth<'_>, args: &[&[u8]]) -> kvshard_resp::Reply {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to redis");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = Vec::new();
    let mut want = 1;
    if let Some((user, password)) = auth {
        kvshard_resp::encode(&mut out, &[b"AUTH", user.as_bytes(), password.as_bytes()]);
        want = 2;
    }
    kvshard_resp::encode(&mut out, args);
    s.write_all(&out).unwrap();
    let mut buf = Vec::new();
    let mut replies = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    while replies.len() < want {
        match kvshard_resp::parse_reply(&buf).expect("RESP from redis") {
            Some((reply, used)) => {
                buf.drain(..used);
                replies.push(reply);
            }
            None => {
                let n = match s.read(&mut chunk) {
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    r => r.expect("redis reply"),
                };
                assert!(n > 0, "redis closed the connection");
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
    if auth.is_some() {
        assert_eq!(
            replies[0],
            kvshard_resp::Reply::Simple(b"OK".to_vec()),
            "AUTH"
        );
    }
    replies.pop().unwrap()
}

/// One command over a fresh connection, its reply as text (`+OK` as `OK`,
/// `-ERR x` as `ERR x`, integers as digits, bulk strings as they are, an
/// array's elements one per line). For setting up and checking servers.
pub fn redis_command(port: u16, args: &[&str]) -> String {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    reply_text(&redis_call(port, None, &args))
}

fn reply_text(r: &kvshard_resp::Reply) -> String {
    use kvshard_resp::Reply;
    match r {
        Reply::Simple(t) | Reply::Error(t) | Reply::Bulk(t) => {
            String::from_utf8_lossy(t).into_owned()
        }
        Reply::Integer(n) => n.to_string(),
        Reply::Nil => "(nil)".to_owned(),
        Reply::Array(items) => items.iter().map(reply_text).collect::<Vec<_>>().join("\n"),
    }
}

fn unique_dir(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "kvshard-redis-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn wait_ping(port: u16, child: &mut Child, log: &Path) {
    let t0 = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "redis-server on {port} exited ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok()
            && redis_command(port, &["PING"]) == "PONG"
        {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "redis-server on {port} does not answer"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One `redis-server` (no persistence), stopped on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    pub dir: PathBuf,
    args: Vec<String>,
}

impl RedisServer {
    /// A server with `extra` settings (`["--maxmemory", "10mb"]`).
    pub fn start(extra: &[&str]) -> RedisServer {
        let port = redis_free_port();
        Self::start_on(port, unique_dir("standalone"), extra)
    }

    fn start_on(port: u16, dir: PathBuf, extra: &[&str]) -> RedisServer {
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            dir.to_str().unwrap(),
            "--logfile",
            "redis.log",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = Self::spawn(&args);
        let mut s = RedisServer {
            child,
            port,
            dir,
            args,
        };
        let log = s.dir.join("redis.log");
        wait_ping(port, &mut s.child, &log);
        s
    }

    fn spawn(args: &[String]) -> Child {
        Command::new(redis_bin_dir().join("redis-server"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start redis-server")
    }

    /// Sends `sig` (`libc::SIGSTOP`, ...) to the server.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Kills the server and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on its port (after [`RedisServer::kill`]).
    pub fn restart(&mut self) {
        self.kill();
        let t0 = Instant::now();
        loop {
            self.child = Self::spawn(&self.args);
            std::thread::sleep(Duration::from_millis(50));
            match self.child.try_wait() {
                Ok(None) => break,
                _ if t0.elapsed() < Duration::from_secs(10) => continue, // port not free yet
                _ => panic!("redis-server on {} does not start again", self.port),
            }
        }
        let log = self.dir.join("redis.log");
        wait_ping(self.port, &mut self.child, &log);
    }

    pub fn command(&self, args: &[&str]) -> String {
        redis_command(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A cluster of `masters` masters with `replicas` replicas each, every slot
/// assigned, stopped on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    dir: PathBuf,
}

impl RedisCluster {
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        let dir = unique_dir("cluster");
        let mut nodes = Vec::new();
        for i in 0..masters * (1 + replicas) {
            let port = redis_free_port();
            let d = dir.join(format!("n{i}"));
            std::fs::create_dir_all(&d).unwrap();
            nodes.push(RedisServer::start_on(
                port,
                d,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            ));
        }
        let mut create = Command::new(redis_bin_dir().join("redis-cli"));
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let c = RedisCluster { nodes, dir };
        c.wait_ok();
        c
    }

    /// Waits until every node says `cluster_state:ok` and knows every node.
    pub fn wait_ok(&self) {
        let t0 = Instant::now();
        let want = self.nodes.len();
        loop {
            let ok = self.nodes.iter().all(|n| {
                let info = n.command(&["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{want}"))
            });
            if ok {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the cluster does not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `host:port,host:port,...` of every node.
    pub fn startup_nodes(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node serving `key`'s slot as master.
    pub fn master_of(&self, key: &str) -> &RedisServer {
        let slot = kvshard_resp::cluster::key_slot(key.as_bytes());
        self.nodes
            .iter()
            .find(|n| {
                n.command(&["CLUSTER", "NODES"])
                    .lines()
                    .any(|l| l.contains("myself") && l.contains("master") && owns(l, slot))
            })
            .expect("a master serves the slot")
    }

    /// Every master's keys, deleted.
    pub fn flush(&self) {
        for n in &self.nodes {
            if n.command(&["ROLE"]).starts_with("master") {
                n.command(&["FLUSHALL"]);
            }
        }
    }
}

/// Whether a `CLUSTER NODES` line lists `slot` among its ranges.
fn owns(line: &str, slot: u16) -> bool {
    line.split(' ').skip(8).any(|r| {
        let (a, b) = r.split_once('-').unwrap_or((r, r));
        match (a.parse::<u16>(), b.parse::<u16>()) {
            (Ok(a), Ok(b)) => (a..=b).contains(&slot),
            _ => false,
        }
    })
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
