//! The server as a process: free ports, log files, starting and stopping the
//! real binary, SHM mappings, and waiting for a condition.

use super::*;

// ------------------------------------------------------------------ server

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Binds `socket` to a port of loopback the kernel picks and returns it: a
/// port [`free_port`] found free can be taken by another test's connection
/// before a later bind.
pub fn bind_loopback(socket: &zmq::Socket) -> u16 {
    socket
        .bind("tcp://127.0.0.1:*")
        .expect("bind to a kernel-picked port");
    let endpoint = socket
        .get_last_endpoint()
        .expect("last endpoint")
        .expect("endpoint is UTF-8");
    endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {endpoint}"))
}

/// The server log at `path` for each start of one [`Server`]: created by the
/// first, appended to by a retried one.
fn log_file(path: &std::path::Path) -> impl Fn() -> Stdio + '_ {
    let first = std::cell::Cell::new(true);
    move || {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(first.get())
            .append(!first.get())
            .open(path)
            .expect("open the server log");
        first.set(false);
        Stdio::from(file)
    }
}

static SEQ: AtomicU32 = AtomicU32::new(0);

pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A fresh path in the temp directory for one test's server log.
pub fn log_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{}.log", unique(tag)))
}

/// The server binary: `KVSHARD_BIN` when set (a test executable carried to
/// another host with a prebuilt server beside it), else the one cargo built.
pub fn kvshard_bin() -> std::path::PathBuf {
    std::env::var_os("KVSHARD_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvshard").into())
}

/// How long a server may take to answer its first noop. A pre-faulted L1
/// (`--no-l1-use-lazy`) is touched page by page at start, which on these
/// shared VMs has taken 10.6 s of kernel time for 2 GiB right after a test
/// run had freed its memory (1.4 s on the next start); a hung start still
/// fails.
pub const START_BOUND: Duration = Duration::from_secs(60);

pub struct Server {
    pub child: Child,
    pub port: u16,
    pub http_port: u16,
    pub shm_name: String,
    /// The command line after the binary, to start the same server again.
    pub args: Vec<String>,
}

impl Server {
    /// Starts `kvshard server` with small defaults plus `extra` flags and waits
    /// until it answers a noop.
    pub fn start(extra: &[&str]) -> Server {
        let stderr = || {
            if std::env::var_os("KVSHARD_TEST_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            }
        };
        Self::start_full(extra, &stderr, &[])
    }

    /// [`Server::start`] with the server's log (stderr) written to `log`.
    pub fn start_logged(extra: &[&str], log: &std::path::Path) -> Server {
        Self::start_full(extra, &log_file(log), &[])
    }

    /// The command line of [`Server::start`]: its small defaults, then `extra`.
    /// `shm` names the SHM pool; `None` leaves `--shm-name` out (the server
    /// then makes up a name).
    fn args(port: u16, http_port: u16, shm: Option<&str>, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "server".into(),
            "--l1-size-gb".into(),
            "0.0625".into(),
            "--eviction-policy".into(),
            "LRU".into(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--http-port".into(),
            http_port.to_string(),
            "--chunk-size".into(),
            "16".into(),
        ];
        if let Some(shm) = shm {
            args.extend(["--shm-name".to_string(), shm.to_string()]);
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    }

    /// Runs the server with [`Server::start`]'s defaults plus `extra`. If it
    /// exits within 20 s it must exit non-zero, and its stderr is returned;
    /// `None` (after killing it) if it is still serving then.
    pub fn start_or_refuse(extra: &[&str]) -> Option<String> {
        let args = Self::args(free_port(), free_port(), Some(&unique("kvtest")), extra);
        let mut child = Command::new(kvshard_bin())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvshard");
        let t0 = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if t0.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert!(
            !status.success(),
            "{extra:?}: a refused start exits non-zero: {err}"
        );
        Some(err)
    }

    /// [`Server::start_or_refuse`] for `extra` that must make the server
    /// refuse to start.
    pub fn start_refused(extra: &[&str]) -> String {
        Self::start_or_refuse(extra)
            .unwrap_or_else(|| panic!("{extra:?}: the server started instead of refusing"))
    }

    /// [`Server::start_logged`] with `envs` added to the server's environment.
    pub fn start_logged_env(
        extra: &[&str],
        log: &std::path::Path,
        envs: &[(&str, &str)],
    ) -> Server {
        Self::start_full(extra, &log_file(log), envs)
    }

    /// [`Server::start_logged`] without `--shm-name`: the server names its
    /// SHM pool itself (`lmcache_l1_pool_kvshard_<pid>_<random>`), as a
    /// deployment that does not give one gets. `shm_name` is read from its
    /// `/status`.
    pub fn start_logged_auto_shm(extra: &[&str], log: &std::path::Path) -> Server {
        let mut srv = Self::start_with(None, extra, &log_file(log), &[]);
        let v = srv.get_json("/status");
        let path = v["storage_manager"]["l1_manager"]["arena"]["path"]
            .as_str()
            .expect("a named arena reports its path")
            .to_owned();
        srv.shm_name = path.trim_start_matches("/dev/shm/").to_owned();
        srv
    }

    /// Spawns the server and waits for its noop reply. A server that exits
    /// before it answers is started again on other ports (3 tries in all): a
    /// port `free_port` found free can be taken by another test's connection
    /// before the server binds it.
    fn start_full(extra: &[&str], stderr: &dyn Fn() -> Stdio, envs: &[(&str, &str)]) -> Server {
        Self::start_with(Some(&unique("kvtest")), extra, stderr, envs)
    }

    /// [`Server::start_full`] with the pool's name `shm` (`None`: automatic).
    fn start_with(
        shm: Option<&str>,
        extra: &[&str],
        stderr: &dyn Fn() -> Stdio,
        envs: &[(&str, &str)],
    ) -> Server {
        const TRIES: u32 = 3;
        let mut attempt = 1;
        loop {
            let port = free_port();
            let http_port = free_port();
            let args = Self::args(port, http_port, shm, extra);
            let child = Command::new(kvshard_bin())
                .args(&args)
                .envs(envs.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr())
                .spawn()
                .expect("spawn kvshard");
            let mut srv = Server {
                child,
                port,
                http_port,
                shm_name: shm.map_or_else(String::new, |s| format!("lmcache_l1_pool_{s}")),
                args,
            };
            match srv.answers_noop() {
                Ok(()) => return srv,
                Err(status) if attempt < TRIES => {
                    eprintln!("kvshard exited at start ({status}); starting it on other ports");
                    attempt += 1;
                }
                Err(status) => panic!("kvshard exited at start {TRIES} times, last with {status}"),
            }
        }
    }

    /// Waits for a noop's reply; `Err` with the exit status if the server
    /// exits first. No reply within [`START_BOUND`] fails the test.
    fn answers_noop(&mut self) -> Result<(), std::process::ExitStatus> {
        let mut c = Client::connect(self.port);
        let uid = c.send_raw(vec![enc(&V::I(OP_NOOP))]);
        let t0 = Instant::now();
        loop {
            if c.sock.poll(zmq::POLLIN, 50).expect("poll the test client") > 0 {
                let r = c.recv(uid);
                assert_eq!(dec(&r.op), V::I(OP_NOOP), "op echoed");
                assert_eq!(r.payload, Some(s("OK")), "noop answered");
                return Ok(());
            }
            if let Some(status) = self.child.try_wait().expect("wait for kvshard") {
                return Err(status);
            }
            assert!(
                t0.elapsed() < START_BOUND,
                "kvshard answered no noop within {} s of its start",
                START_BOUND.as_secs()
            );
        }
    }

    pub fn client(&self) -> Client {
        Client::connect(self.port)
    }

    /// Kills the server with SIGKILL (as a crash or the OOM killer would) and
    /// starts it again with the same command line, so on the same ports: the
    /// clients connected to it reconnect by themselves. Its log, if any, is
    /// not kept.
    pub fn kill_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The ports are ephemeral ones: a client's connection attempt (the
        // test's own clients reconnect) may hold one as its local port for a
        // moment, and the bind fails. Tried again a few times.
        const TRIES: u32 = 10;
        for attempt in 1..=TRIES {
            self.child = Command::new(kvshard_bin())
                .args(&self.args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(if std::env::var_os("KVSHARD_TEST_LOG").is_some() {
                    Stdio::inherit()
                } else {
                    Stdio::null()
                })
                .spawn()
                .expect("spawn kvshard again");
            match self.answers_noop() {
                Ok(()) => return,
                Err(status) if attempt < TRIES => {
                    eprintln!("kvshard exited when started again on its ports ({status}); again");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(status) => {
                    panic!("kvshard exited when started again on its ports {TRIES} times: {status}")
                }
            }
        }
    }

    /// A plain HTTP/1.1 request; returns (status, body).
    /// `POST /cache/checksums` of instance `iid`'s `blocks`, `chunk_size`
    /// blocks per digest; asserts a 200 and returns its JSON.
    pub fn checksums(
        &self,
        iid: i64,
        blocks: &[i64],
        chunk_size: usize,
        layerwise: bool,
    ) -> serde_json::Value {
        let body = format!(
            r#"{{"instance_id": {iid}, "block_ids": {blocks:?}, "chunk_size": {chunk_size}, "layerwise": {layerwise}}}"#
        );
        let (st, reply) = self.http("POST", "/cache/checksums", Some(&body));
        assert_eq!(st, 200, "{reply}");
        serde_json::from_str(&reply).unwrap()
    }

    pub fn http(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let mut st = TcpStream::connect(("127.0.0.1", self.http_port)).unwrap();
        st.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let b = body.unwrap_or("");
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        );
        st.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        st.read_to_string(&mut out).unwrap();
        let status: u16 = out
            .split(' ')
            .nth(1)
            .and_then(|x| x.parse().ok())
            .expect("status line");
        let body = match out.find("\r\n\r\n") {
            Some(i) => out[i + 4..].to_string(),
            None => String::new(),
        };
        // Chunked bodies: strip the chunk framing for small single-chunk replies.
        let body = if out
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(&body)
        } else {
            body
        };
        (status, body)
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

fn dechunk(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("\r\n") {
        let n = usize::from_str_radix(rest[..i].trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[i + 2..i + 2 + n]);
        rest = &rest[i + 2 + n + 2..];
    }
    out
}

impl Drop for Server {
    fn drop(&mut self) {
        // A child already waited for may have had its pid reused: not signalled.
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            // SAFETY: plain kill(2) of our child, not yet reaped.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        }
        let t0 = Instant::now();
        let mut stopped = false;
        while t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                stopped = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if !stopped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // A server that was killed (a test's SIGKILL, or the one above) could
        // not remove its SHM pool; the name is this test's own, so nobody else
        // uses it. Left behind, each run would keep its whole L1 in /dev/shm.
        if !self.shm_name.is_empty() {
            let _ = std::fs::remove_file(format!("/dev/shm/{}", self.shm_name));
        }
    }
}

// --------------------------------------------------------------- shm maps

/// A read-write mapping of a POSIX shm segment.
pub struct ShmMap {
    pub ptr: *mut u8,
    pub len: usize,
    name: String,
    owned: bool,
}

impl ShmMap {
    fn map(name: &str, len: usize, create: bool) -> ShmMap {
        let cname = std::ffi::CString::new(format!("/{name}")).unwrap();
        // SAFETY: plain POSIX calls; results checked.
        unsafe {
            let flags = if create {
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR
            } else {
                libc::O_RDWR
            };
            let fd = libc::shm_open(cname.as_ptr(), flags, 0o600);
            assert!(
                fd >= 0,
                "shm_open {name}: {}",
                std::io::Error::last_os_error()
            );
            if create {
                assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            }
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            assert_ne!(ptr, libc::MAP_FAILED, "mmap {name}");
            ShmMap {
                ptr: ptr as *mut u8,
                len,
                name: name.to_owned(),
                owned: create,
            }
        }
    }

    pub fn open(name: &str, len: usize) -> ShmMap {
        Self::map(name, len, false)
    }

    pub fn create(name: &str, len: usize) -> ShmMap {
        Self::map(name, len, true)
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: mapping of `len` bytes alive for self's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` makes this the only view from this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for ShmMap {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
            if self.owned {
                let cname = std::ffi::CString::new(format!("/{}", self.name)).unwrap();
                libc::shm_unlink(cname.as_ptr());
            }
        }
    }
}

/// Deterministic bytes for a chunk: a function of a seed and the position.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Polls `f` every 20 ms until it holds; fails the test after 30 s.
pub fn wait_until(what: &str, f: impl FnMut() -> bool) {
    wait_until_within(what, Duration::from_secs(30), Duration::from_millis(20), f)
}

/// Polls `f` every `every` until it holds; fails the test after `limit`.
pub fn wait_until_within(
    what: &str,
    limit: Duration,
    every: Duration,
    mut f: impl FnMut() -> bool,
) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(every);
    }
}
