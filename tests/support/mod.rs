//! Test support: starts the real `kvshard` binary and talks to it with an
//! independent ZeroMQ DEALER client and msgpack encoder (written here, apart from
//! the server's codec, so a codec bug cannot hide behind itself).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

// ------------------------------------------------------------------ msgpack

/// A msgpack value for building requests and reading replies.
#[derive(Debug, Clone, PartialEq)]
pub enum V {
    Nil,
    B(bool),
    I(i64),
    F(f64),
    S(String),
    Bin(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
    Ext(i8, Vec<u8>),
}

pub fn s(x: &str) -> V {
    V::S(x.to_owned())
}

pub fn map(pairs: &[(&str, V)]) -> V {
    V::M(pairs.iter().map(|(k, v)| (s(k), v.clone())).collect())
}

impl V {
    pub fn get(&self, key: &str) -> Option<&V> {
        match self {
            V::M(m) => m
                .iter()
                .find(|(k, _)| *k == V::S(key.to_owned()))
                .map(|(_, v)| v),
            _ => None,
        }
    }
    pub fn int(&self) -> i64 {
        match self {
            V::I(i) => *i,
            other => panic!("expected int, got {other:?}"),
        }
    }
    pub fn str(&self) -> &str {
        match self {
            V::S(s) => s,
            other => panic!("expected str, got {other:?}"),
        }
    }
    pub fn arr(&self) -> &[V] {
        match self {
            V::A(a) => a,
            other => panic!("expected array, got {other:?}"),
        }
    }
    pub fn boolean(&self) -> bool {
        match self {
            V::B(b) => *b,
            other => panic!("expected bool, got {other:?}"),
        }
    }
}

pub fn enc(v: &V) -> Vec<u8> {
    let mut o = Vec::new();
    enc_into(v, &mut o);
    o
}

fn enc_len(o: &mut Vec<u8>, n: usize, fix: Option<(u8, usize)>, m8: Option<u8>, m16: u8, m32: u8) {
    match (fix, m8) {
        (Some((base, max)), _) if n <= max => o.push(base | n as u8),
        (_, Some(c)) if n <= 0xff => o.extend([c, n as u8]),
        _ if n <= 0xffff => {
            o.push(m16);
            o.extend((n as u16).to_be_bytes());
        }
        _ => {
            o.push(m32);
            o.extend((n as u32).to_be_bytes());
        }
    }
}

fn enc_into(v: &V, o: &mut Vec<u8>) {
    match v {
        V::Nil => o.push(0xc0),
        V::B(b) => o.push(if *b { 0xc3 } else { 0xc2 }),
        V::I(i) => {
            let i = *i;
            if (0..=127).contains(&i) {
                o.push(i as u8)
            } else if (-32..0).contains(&i) {
                o.push(i as i8 as u8)
            } else if (0..=0xff).contains(&i) {
                o.extend([0xcc, i as u8])
            } else if (0..=0xffff).contains(&i) {
                o.push(0xcd);
                o.extend((i as u16).to_be_bytes())
            } else if (0..=0xffff_ffff).contains(&i) {
                o.push(0xce);
                o.extend((i as u32).to_be_bytes())
            } else if i > 0 {
                o.push(0xcf);
                o.extend((i as u64).to_be_bytes())
            } else {
                o.push(0xd3);
                o.extend(i.to_be_bytes())
            }
        }
        V::F(f) => {
            o.push(0xcb);
            o.extend(f.to_be_bytes())
        }
        V::S(st) => {
            enc_len(o, st.len(), Some((0xa0, 31)), Some(0xd9), 0xda, 0xdb);
            o.extend(st.as_bytes())
        }
        V::Bin(b) => {
            enc_len(o, b.len(), None, Some(0xc4), 0xc5, 0xc6);
            o.extend(b)
        }
        V::A(a) => {
            enc_len(o, a.len(), Some((0x90, 15)), None, 0xdc, 0xdd);
            for x in a {
                enc_into(x, o)
            }
        }
        V::M(m) => {
            enc_len(o, m.len(), Some((0x80, 15)), None, 0xde, 0xdf);
            for (k, x) in m {
                enc_into(k, o);
                enc_into(x, o)
            }
        }
        V::Ext(t, d) => {
            if d.len() < 256 {
                o.push(0xc7);
                o.push(d.len() as u8);
            } else {
                o.push(0xc8);
                o.extend(u16::try_from(d.len()).expect("ext16 length").to_be_bytes());
            }
            o.push(*t as u8);
            o.extend(d)
        }
    }
}

pub fn dec(b: &[u8]) -> V {
    let mut p = 0;
    let v = dec_at(b, &mut p);
    assert_eq!(p, b.len(), "trailing bytes in reply frame");
    v
}

fn take<'a>(b: &'a [u8], p: &mut usize, n: usize) -> &'a [u8] {
    let s = &b[*p..*p + n];
    *p += n;
    s
}

fn be(b: &[u8]) -> u64 {
    b.iter().fold(0u64, |a, x| (a << 8) | *x as u64)
}

fn dec_at(b: &[u8], p: &mut usize) -> V {
    let c = b[*p];
    *p += 1;
    let str_of = |d: &[u8]| V::S(String::from_utf8(d.to_vec()).expect("utf8"));
    match c {
        0x00..=0x7f => V::I(c as i64),
        0x80..=0x8f => dec_map(b, p, (c & 0x0f) as usize),
        0x90..=0x9f => dec_arr(b, p, (c & 0x0f) as usize),
        0xa0..=0xbf => str_of(take(b, p, (c & 0x1f) as usize)),
        0xc0 => V::Nil,
        0xc2 => V::B(false),
        0xc3 => V::B(true),
        0xc4 => {
            let n = be(take(b, p, 1)) as usize;
            V::Bin(take(b, p, n).to_vec())
        }
        0xc5 => {
            let n = be(take(b, p, 2)) as usize;
            V::Bin(take(b, p, n).to_vec())
        }
        0xcb => V::F(f64::from_bits(be(take(b, p, 8)))),
        0xcc => V::I(be(take(b, p, 1)) as i64),
        0xcd => V::I(be(take(b, p, 2)) as i64),
        0xce => V::I(be(take(b, p, 4)) as i64),
        0xcf => V::I(be(take(b, p, 8)) as i64),
        0xd0 => V::I(take(b, p, 1)[0] as i8 as i64),
        0xd1 => V::I(be(take(b, p, 2)) as u16 as i16 as i64),
        0xd2 => V::I(be(take(b, p, 4)) as u32 as i32 as i64),
        0xd3 => V::I(be(take(b, p, 8)) as i64),
        0xd9 => {
            let n = be(take(b, p, 1)) as usize;
            str_of(take(b, p, n))
        }
        0xda => {
            let n = be(take(b, p, 2)) as usize;
            str_of(take(b, p, n))
        }
        0xdc => {
            let n = be(take(b, p, 2)) as usize;
            dec_arr(b, p, n)
        }
        0xdd => {
            let n = be(take(b, p, 4)) as usize;
            dec_arr(b, p, n)
        }
        0xde => {
            let n = be(take(b, p, 2)) as usize;
            dec_map(b, p, n)
        }
        0xe0..=0xff => V::I(c as i8 as i64),
        other => panic!("test decoder: unsupported msgpack byte {other:#x}"),
    }
}

fn dec_arr(b: &[u8], p: &mut usize, n: usize) -> V {
    V::A((0..n).map(|_| dec_at(b, p)).collect())
}

fn dec_map(b: &[u8], p: &mut usize, n: usize) -> V {
    V::M((0..n).map(|_| (dec_at(b, p), dec_at(b, p))).collect())
}

// ------------------------------------------------------------- wire helpers

/// IPCCacheServerKey as the 0.5.6 client encodes it (a map in field order).
#[allow(clippy::too_many_arguments)]
pub fn ipc_key(
    model: &str,
    ws: i64,
    worker: Option<i64>,
    tokens: &[u32],
    start: i64,
    end: i64,
    rid: &str,
    readers: i64,
) -> V {
    map(&[
        ("model_name", s(model)),
        ("world_size", V::I(ws)),
        ("worker_id", worker.map_or(V::Nil, V::I)),
        (
            "token_ids",
            V::A(tokens.iter().map(|t| V::I(*t as i64)).collect()),
        ),
        ("start", V::I(start)),
        ("end", V::I(end)),
        ("request_id", s(rid)),
        ("cache_salt", s("")),
        ("request_configs", V::Nil),
        ("num_kv_readers", V::I(readers)),
    ])
}

pub fn engine_ctx_payload(
    iid: i64,
    model: &str,
    ws: i64,
    layers: i64,
    hidden: i64,
    mla: bool,
    slots: i64,
) -> V {
    map(&[
        ("instance_id", V::I(iid)),
        ("model_name", s(model)),
        ("world_size", V::I(ws)),
        ("block_size", V::I(16)),
        ("num_layers", V::I(layers)),
        ("hidden_dim_size", V::I(hidden)),
        ("dtype_str", s("float16")),
        ("use_mla", V::B(mla)),
        ("num_physical_slots", V::I(slots)),
    ])
}

/// A `CpuShmIPCData` wrapped in msgpack ext 1, keys in msgspec's order.
pub fn cpu_shm_wrapper(
    shm_name: &str,
    nbytes: i64,
    dtype: &str,
    shape: &[i64],
    stride: &[i64],
) -> V {
    let inner = map(&[
        ("type", s("cpu_shm")),
        ("shm_name", s(shm_name)),
        ("nbytes", V::I(nbytes)),
        ("version", V::I(1)),
        (
            "metadata",
            map(&[
                ("dtype", s(dtype)),
                ("shape", V::A(shape.iter().map(|x| V::I(*x)).collect())),
                ("stride", V::A(stride.iter().map(|x| V::I(*x)).collect())),
                ("storage_offset", V::I(0)),
                ("device_uuid", s("cpu")),
            ]),
        ),
    ]);
    V::Ext(1, enc(&inner))
}

/// One `EngineGroupInfo` of a plain full-attention model: layers
/// `0..layers`, `tokens_per_block` tokens per block, engine group 0.
pub fn kv_group(layers: usize, tokens_per_block: usize) -> V {
    map(&[
        ("engine_group_id", V::I(0)),
        (
            "layer_indices",
            V::A((0..layers as i64).map(V::I).collect()),
        ),
        ("tokens_per_block", V::I(tokens_per_block as i64)),
        ("sw_size_tokens", V::I(-1)),
        ("extra_object_group_tag", V::I(0)),
        ("recurrent_state", V::B(false)),
    ])
}

// ------------------------------------------------------------------ client

pub struct Client {
    pub sock: zmq::Socket,
    _ctx: zmq::Context,
    uid: i64,
}

/// A reply: the echoed op frame and the payload, if any.
#[derive(Debug)]
pub struct Reply {
    pub op: Vec<u8>,
    pub payload: Option<V>,
}

impl Client {
    pub fn connect(port: u16) -> Client {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER).unwrap();
        sock.set_linger(0).unwrap();
        sock.set_rcvtimeo(10_000).unwrap();
        sock.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        Client {
            sock,
            _ctx: ctx,
            uid: 0,
        }
    }

    /// Sends raw frames after the uid; returns the uid used.
    pub fn send_raw(&mut self, frames: Vec<Vec<u8>>) -> i64 {
        let uid = self.uid;
        self.uid += 1;
        let mut all = vec![enc(&V::I(uid))];
        all.extend(frames);
        self.sock.send_multipart(all, 0).unwrap();
        uid
    }

    pub fn recv(&mut self, uid: i64) -> Reply {
        let frames = self
            .sock
            .recv_multipart(0)
            .expect("reply within 10 s (the server must always answer)");
        assert!(
            frames.len() == 2 || frames.len() == 3,
            "reply has {} frames",
            frames.len()
        );
        assert_eq!(dec(&frames[0]), V::I(uid), "uid echoed");
        Reply {
            op: frames[1].clone(),
            payload: frames.get(2).map(|f| dec(f)),
        }
    }

    /// Calls `op` (legacy int id) with msgpack payload frames.
    pub fn call(&mut self, op: i64, args: &[V]) -> Option<V> {
        let mut frames = vec![enc(&V::I(op))];
        frames.extend(args.iter().map(enc));
        let uid = self.send_raw(frames);
        let r = self.recv(uid);
        assert_eq!(dec(&r.op), V::I(op), "op echoed");
        r.payload
    }

    pub fn noop_ok(&mut self) {
        assert_eq!(self.call(OP_NOOP, &[]), Some(s("OK")));
    }

    /// Polls query_prefetch_status until it answers an int.
    pub fn prefetch_result(&mut self, rid: &str) -> i64 {
        let t0 = Instant::now();
        loop {
            if let Some(v) = self.call(OP_QUERY_PREFETCH_STATUS, &[s(rid)]) {
                return v.int();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "prefetch never finished"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

pub const OP_REGISTER_KV_CACHE: i64 = 1;
pub const OP_UNREGISTER_KV_CACHE: i64 = 2;
pub const OP_STORE: i64 = 6;
pub const OP_RETRIEVE: i64 = 7;
pub const OP_LOOKUP: i64 = 8;
pub const OP_QUERY_PREFETCH_STATUS: i64 = 9;
pub const OP_WAIT_PREFETCH_STATUS: i64 = 10;
pub const OP_FREE_LOOKUP_LOCKS: i64 = 12;
pub const OP_END_SESSION: i64 = 13;
pub const OP_REGISTER_ENGINE: i64 = 14;
pub const OP_UNREGISTER_ENGINE: i64 = 15;
pub const OP_PREPARE_STORE: i64 = 16;
pub const OP_COMMIT_STORE: i64 = 17;
pub const OP_PREPARE_RETRIEVE: i64 = 18;
pub const OP_COMMIT_RETRIEVE: i64 = 19;
pub const OP_CLEAR: i64 = 20;
pub const OP_GET_CHUNK_SIZE: i64 = 21;
pub const OP_PING: i64 = 22;
pub const OP_NOOP: i64 = 24;
pub const OP_GET_EXPERIMENTAL: i64 = 32;

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
    /// exits first. No reply within 10 s fails the test.
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
                t0.elapsed() < Duration::from_secs(10),
                "kvshard answered no noop within 10 s of its start"
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

// ------------------------------------------ engine_driven flow and scrape helpers
//
// Shared by tests/bad_input.rs and tests/http_api.rs: one worker's whole
// engine_driven flow (register, prepare/commit store, lookup, prepare/commit
// retrieve) and a Prometheus text reader.

/// Tokens per chunk of `Server::start` (its `--chunk-size`).
pub const ED_CHUNK: usize = 16;

/// Hidden size of an `ed_register`ed worker.
pub const ED_HIDDEN: usize = 64;

/// Bytes of one chunk object of a worker registered with hidden size
/// `hidden`: [2, 2 layers, 16 slots, hidden] f16.
pub const fn ed_chunk_bytes(hidden: usize) -> usize {
    2 * 2 * ED_CHUNK * hidden * 2
}

/// Bytes of one chunk object of an `ed_register`ed worker.
pub const ED_CHUNK_BYTES: usize = ed_chunk_bytes(ED_HIDDEN);

/// A token sequence of `n` tokens that differs for every seed.
pub fn ed_tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            seed.wrapping_mul(2_654_435_761)
                .wrapping_add(i.wrapping_mul(40_503))
                % 60_000
        })
        .collect()
}

/// A key of `n_chunks` whole chunks of `toks` for one worker (`Some`) or the
/// scheduler (`None`), one reader.
pub fn ed_key(model: &str, worker: Option<i64>, toks: &[u32], n_chunks: usize, rid: &str) -> V {
    ipc_key(
        model,
        1,
        worker,
        toks,
        0,
        (n_chunks * ED_CHUNK) as i64,
        rid,
        1,
    )
}

/// Replaces field `name` of a msgpack map (adding it when absent).
pub fn with_field(v: &V, name: &str, value: V) -> V {
    let V::M(m) = v else {
        panic!("with_field on a non-map: {v:?}")
    };
    let mut m = m.clone();
    match m.iter_mut().find(|(k, _)| *k == s(name)) {
        Some((_, x)) => *x = value,
        None => m.push((s(name), value)),
    }
    V::M(m)
}

/// Registers an engine_driven worker of `model` (world size 1, 2 layers, hidden
/// 64, float16); returns the pool's (shm name, size).
pub fn ed_register(c: &mut Client, iid: i64, model: &str) -> (String, usize) {
    ed_register_hidden(c, iid, model, ED_HIDDEN)
}

/// [`ed_register`] with hidden size `hidden` (chunk objects of
/// [`ed_chunk_bytes`]`(hidden)`).
pub fn ed_register_hidden(c: &mut Client, iid: i64, model: &str, hidden: usize) -> (String, usize) {
    let r = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                iid,
                model,
                1,
                2,
                hidden as i64,
                false,
                ED_CHUNK as i64,
            )],
        )
        .expect("engine_driven registration answered with a payload");
    (
        r.get("shm_name").expect("shm_name").str().to_owned(),
        r.get("pool_size").expect("pool_size").int() as usize,
    )
}

/// The slots of a PREPARE_STORE reply (empty: nothing reserved).
pub fn ed_slots(reply: &V) -> Vec<V> {
    reply
        .get("context")
        .and_then(|c| c.get("slots"))
        .unwrap_or_else(|| panic!("prepare_store reply without context.slots: {reply:?}"))
        .arr()
        .to_vec()
}

/// PREPARE_STORE, fill every reserved slot with a pattern, COMMIT_STORE (which
/// must succeed). Returns the bytes written, in chunk order; an empty list when
/// nothing needed storing.
pub fn ed_store(c: &mut Client, pool: &mut ShmMap, key: &V, iid: i64, seed: u64) -> Vec<Vec<u8>> {
    ed_store_sized(c, pool, key, iid, seed, ED_CHUNK_BYTES)
}

/// [`ed_store`] for a worker whose chunk objects are `chunk_bytes` long.
pub fn ed_store_sized(
    c: &mut Client,
    pool: &mut ShmMap,
    key: &V,
    iid: i64,
    seed: u64,
    chunk_bytes: usize,
) -> Vec<Vec<u8>> {
    let r = c
        .call(OP_PREPARE_STORE, &[key.clone(), V::I(iid)])
        .expect("prepare_store reply");
    let slots = ed_slots(&r);
    if slots.is_empty() {
        return Vec::new();
    }
    let mut written = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        let off = slot.get("offset").unwrap().int() as usize;
        let len = slot.get("length").unwrap().int() as usize;
        assert_eq!(len, chunk_bytes, "slot length");
        let data = pattern(seed.wrapping_mul(1_000_003).wrapping_add(i as u64), len);
        pool.bytes_mut()[off..off + len].copy_from_slice(&data);
        written.push(data);
    }
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[key.clone(), V::I(iid), V::Bin(vec![])]),
        Some(V::B(true)),
        "commit_store after a prepare_store that reserved slots"
    );
    written
}

/// LOOKUP (scheduler key) and the hit prefix in chunks.
pub fn ed_lookup(c: &mut Client, key: &V) -> i64 {
    assert_eq!(
        c.call(OP_LOOKUP, &[key.clone(), V::I(1)]),
        None,
        "lookup ack"
    );
    let rid = key.get("request_id").unwrap().str().to_owned();
    c.prefetch_result(&rid)
}

/// PREPARE_RETRIEVE (must succeed), copy every slot out, COMMIT_RETRIEVE.
pub fn ed_retrieve(c: &mut Client, pool: &ShmMap, key: &V, iid: i64) -> Vec<Vec<u8>> {
    let r = c
        .call(OP_PREPARE_RETRIEVE, &[key.clone(), V::I(iid)])
        .expect("prepare_retrieve reply");
    assert_eq!(
        r.get("success"),
        Some(&V::B(true)),
        "prepare_retrieve: {r:?}"
    );
    let out = r
        .get("context")
        .unwrap()
        .get("slots")
        .unwrap()
        .arr()
        .iter()
        .map(|slot| {
            let off = slot.get("offset").unwrap().int() as usize;
            let len = slot.get("length").unwrap().int() as usize;
            pool.bytes()[off..off + len].to_vec()
        })
        .collect();
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[key.clone(), V::I(iid)]),
        Some(V::B(true))
    );
    out
}

static SERVING_SEQ: AtomicU32 = AtomicU32::new(0);
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

/// Registers worker `iid` on model "m" and stores the first `n` chunks of
/// `toks` (engine_driven) under request "store"; returns the bytes stored.
pub fn ed_store_chunks(srv: &Server, iid: i64, toks: &[u32], n: usize, seed: u64) -> Vec<Vec<u8>> {
    ed_store_chunks_of(srv, iid, "m", ED_HIDDEN, toks, n, seed)
}

/// [`ed_store_chunks`] on model `model` with hidden size `hidden`.
pub fn ed_store_chunks_of(
    srv: &Server,
    iid: i64,
    model: &str,
    hidden: usize,
    toks: &[u32],
    n: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    let mut c = srv.client();
    let (name, size) = ed_register_hidden(&mut c, iid, model, hidden);
    let mut pool = ShmMap::open(&name, size);
    let key = ed_key(model, Some(0), toks, n, "store");
    let stored = ed_store_sized(&mut c, &mut pool, &key, iid, seed, ed_chunk_bytes(hidden));
    assert_eq!(stored.len(), n);
    c.call(OP_END_SESSION, &[s("store")]);
    stored
}

/// Registers worker `iid` on model "m", looks `n` chunks of `toks` up under
/// request `rid` and retrieves the hit prefix: (hits, the bytes retrieved).
pub fn ed_lookup_retrieve(
    srv: &Server,
    iid: i64,
    toks: &[u32],
    n: usize,
    rid: &str,
) -> (i64, Vec<Vec<u8>>) {
    ed_lookup_retrieve_of(srv, iid, "m", ED_HIDDEN, toks, n, rid)
}

/// [`ed_lookup_retrieve`] on model `model` with hidden size `hidden`.
pub fn ed_lookup_retrieve_of(
    srv: &Server,
    iid: i64,
    model: &str,
    hidden: usize,
    toks: &[u32],
    n: usize,
    rid: &str,
) -> (i64, Vec<Vec<u8>>) {
    let mut c = srv.client();
    let (name, size) = ed_register_hidden(&mut c, iid, model, hidden);
    let pool = ShmMap::open(&name, size);
    let hits = ed_lookup(&mut c, &ed_key(model, None, toks, n, rid));
    let back = if hits > 0 {
        ed_retrieve(
            &mut c,
            &pool,
            &ed_key(model, Some(0), toks, hits as usize, rid),
            iid,
        )
    } else {
        Vec::new()
    };
    c.call(OP_END_SESSION, &[s(rid)]);
    (hits, back)
}

/// The server process is alive, answers a noop, and serves a whole engine_driven
/// round trip (register, store, lookup hit, retrieve of the same bytes) on a
/// fresh connection, under a model of its own.
pub fn assert_serving(srv: &mut Server) {
    assert!(srv.alive(), "server process exited");
    let mut c = srv.client();
    c.noop_ok();
    let n = SERVING_SEQ.fetch_add(1, Ordering::Relaxed);
    let iid = 9_000_000 + n as i64;
    let model = "serving-check";
    let (name, size) = ed_register(&mut c, iid, model);
    let mut pool = ShmMap::open(&name, size);
    let toks = ed_tokens(0x5e41_0000 + n, 3 * ED_CHUNK + 5);
    let rid = format!("serving-{n}");
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key(model, Some(0), &toks, 3, &rid),
        iid,
        iid as u64,
    );
    assert_eq!(stored.len(), 3, "round trip: every chunk stored");
    assert_eq!(
        ed_lookup(&mut c, &ed_key(model, None, &toks, 3, &rid)),
        3,
        "round trip: lookup hits what was stored"
    );
    assert_eq!(
        ed_retrieve(&mut c, &pool, &ed_key(model, Some(0), &toks, 3, &rid), iid),
        stored,
        "round trip: retrieve returns the stored bytes"
    );
    assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
    assert_eq!(c.call(OP_UNREGISTER_ENGINE, &[V::I(iid)]), None);
    assert!(srv.alive(), "server process exited");
}

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct PromSample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parses Prometheus text format 0.0.4 strictly: every line is a `# HELP` /
/// `# TYPE` comment or `name{labels} value`; panics on anything else.
pub fn parse_prometheus(text: &str) -> Vec<PromSample> {
    let is_name = |n: &str| {
        let mut cs = n.chars();
        cs.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && cs.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let mut out = Vec::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let parts: Vec<&str> = rest.trim_start().splitn(3, ' ').collect();
            assert!(
                matches!(parts.first(), Some(&"HELP") | Some(&"TYPE")) && parts.len() >= 2,
                "bad comment line {line:?}"
            );
            assert!(is_name(parts[1]), "bad metric name in {line:?}");
            if parts[0] == "TYPE" {
                assert!(
                    matches!(
                        parts.get(2).copied(),
                        Some("counter" | "gauge" | "histogram" | "summary" | "untyped")
                    ),
                    "bad TYPE line {line:?}"
                );
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("sample line without a value: {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad sample value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, Vec::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels in {line:?}"));
                (name, parse_labels(body, line))
            }
        };
        assert!(is_name(name), "bad metric name in {line:?}");
        out.push(PromSample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    out
}

fn parse_labels(body: &str, line: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (k, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("bad label in {line:?}"));
        assert!(
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad label name in {line:?}"
        );
        let mut val = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => val.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => val.push(c),
                    _ => panic!("bad escape in {line:?}"),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => val.push(c),
                None => panic!("unterminated label value in {line:?}"),
            }
        };
        out.push((k.to_owned(), val));
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    out
}

impl Server {
    /// Whether the store controller has settled every L2 store it was given
    /// (none in flight; each submitted object completed or failed), summed
    /// over the shards.
    pub fn stores_settled(&self) -> bool {
        let s = self.scrape();
        let get = |name: &str| {
            s.iter()
                .filter(|x| x.name == name)
                .map(|x| x.value)
                .sum::<f64>()
        };
        get("lmcache_mp_num_inflight_l2_stores") == 0.0
            && get("lmcache_mp_l2_store_submitted_objects_chunks_total")
                == get("lmcache_mp_l2_store_completed_objects_chunks_total")
                    + get("kvshard_l2_store_failed_objects_total")
    }

    /// `GET /metrics`, parsed (and so checked) as Prometheus text.
    pub fn scrape(&self) -> Vec<PromSample> {
        let (st, body) = self.http("GET", "/metrics", None);
        assert_eq!(st, 200, "/metrics: {body}");
        parse_prometheus(&body)
    }

    /// The value of the sample `name` whose labels include `labels`, if exposed.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.scrape()
            .into_iter()
            .find(|x| {
                x.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| x.labels.iter().any(|(a, b)| a == k && b == v))
            })
            .map(|x| x.value)
    }

    /// A count of `/status`'s `storage_manager.l1_manager` (`total_object_count`,
    /// `read_locked_count`, ...).
    pub fn l1_count(&self, field: &str) -> u64 {
        self.get_json("/status")["storage_manager"]["l1_manager"][field]
            .as_u64()
            .unwrap_or_else(|| panic!("l1_manager.{field} is not a count"))
    }

    /// L1 eviction ticks run so far (`lmcache_mp_l1_eviction_loop_ticks_total`,
    /// summed over shards).
    pub fn l1_ticks(&self) -> f64 {
        self.metric("lmcache_mp_l1_eviction_loop_ticks_total", &[])
            .expect("lmcache_mp_l1_eviction_loop_ticks_total in /metrics")
    }

    /// Waits until the L1 tick (TTL expiry, then eviction; once a second on
    /// each shard) has run two more times per shard than the `ticks` read
    /// earlier with [`Server::l1_ticks`], so what a test sees afterwards has
    /// been through whole ticks. A tick runs on its shard's thread between
    /// messages, so a count read includes only finished ticks. The counter is
    /// a sum over shards: with several, this holds for each shard as long as
    /// the shards tick at the same pace.
    pub fn wait_l1_ticks_after(&self, ticks: f64) {
        let target = ticks + 2.0 * self.l1_count("num_shards") as f64;
        wait_until("two L1 eviction ticks per shard", || {
            self.l1_ticks() >= target
        });
    }

    /// `GET` of a JSON endpoint that must answer 200.
    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let (st, body) = self.http("GET", path, None);
        assert_eq!(st, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"))
    }
}

/// One lmcache_driven (cpu_shm) KV layer: vLLM NHD `[2, 8 blocks, 16 tokens,
/// 2 heads, 32]` float16, contiguous.
pub const LM_LAYER_SHAPE: [i64; 5] = [2, 8, 16, 2, 32];
pub const LM_LAYER_STRIDE: [i64; 5] = [8 * 16 * 64, 16 * 64, 64, 32, 1];
pub const LM_LAYER_BYTES: i64 = 2 * 8 * 16 * 64 * 2;

/// `register_kv_cache` payloads for instance `iid` of model "lm" (world size
/// 1, vLLM, NHD) with one layer described by `desc`.
pub fn lm_register_frames(iid: i64, desc: V) -> Vec<V> {
    vec![
        V::I(iid),
        V::A(vec![desc]),
        s("lm"),
        V::I(1),
        s("vllm"),
        map(&[("kv_layout", s("NHD"))]),
        V::A(vec![]),
    ]
}

/// A fresh lmcache_driven layer segment of the `LM_LAYER_*` geometry and its
/// cpu_shm descriptor (the segment lives as long as the returned map).
pub fn lm_layer(prefix: &str) -> (ShmMap, V) {
    let seg = unique(prefix);
    let map = ShmMap::create(&seg, LM_LAYER_BYTES as usize);
    let desc = cpu_shm_wrapper(
        &format!("/{seg}"),
        LM_LAYER_BYTES,
        "float16",
        &LM_LAYER_SHAPE,
        &LM_LAYER_STRIDE,
    );
    (map, desc)
}

// ------------------------------------------------------------ cpu worker

pub mod cpu_worker;

// ------------------------------------------------------------------ s3s-fs

mod s3s;
#[allow(unused_imports)]
pub use s3s::*;

// ------------------------------------------------------ mounted file systems

mod mounts;
#[allow(unused_imports)]
pub use mounts::*;

// ------------------------------------------------------------ fault proxy

mod faults;
#[allow(unused_imports)]
pub use faults::*;

// ------------------------------------------ resident memory and a lookup load
//
// Shared by benches/rpc.rs and tests/rss_lookups.rs.

/// Resident memory of a process from `/proc/<pid>/smaps`, split into the L1
/// arena's mappings and everything else (bytes).
#[derive(Debug, Clone, Copy, Default)]
pub struct RssSplit {
    /// Rss of every mapping but the arena's.
    pub outside: u64,
    /// Rss of the arena's mappings.
    pub arena_rss: u64,
    /// Size of the arena's mappings.
    pub arena_size: u64,
    pub arena_mappings: usize,
}

/// [`RssSplit`] of process `pid`, the arena being every mapping of the file
/// `arena_path`.
pub fn rss_split(pid: u32, arena_path: &str) -> RssSplit {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/smaps: {e}"));
    let mut r = RssSplit::default();
    let mut in_arena = false;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if first.ends_with(':') {
            if first == "Rss:" {
                let kb: u64 = words.next().and_then(|w| w.parse().ok()).expect("Rss kB");
                if in_arena {
                    r.arena_rss += kb << 10;
                } else {
                    r.outside += kb << 10;
                }
            }
            continue;
        }
        // A mapping: "start-end perms offset dev inode [path]".
        let (lo, hi) = first.split_once('-').expect("smaps mapping line");
        in_arena = line.split_whitespace().nth(5) == Some(arena_path);
        if in_arena {
            let lo = u64::from_str_radix(lo, 16).unwrap();
            let hi = u64::from_str_radix(hi, 16).unwrap();
            r.arena_size += hi - lo;
            r.arena_mappings += 1;
        }
    }
    r
}

impl Server {
    /// [`rss_split`] of this server; its arena is the SHM pool `/dev/shm/<shm_name>`.
    pub fn rss_split(&self) -> RssSplit {
        rss_split(self.child.id(), &format!("/dev/shm/{}", self.shm_name))
    }
}

fn put_uint(o: &mut Vec<u8>, x: u64) {
    match x {
        0..=0x7f => o.push(x as u8),
        0x80..=0xff => o.extend([0xcc, x as u8]),
        0x100..=0xffff => {
            o.push(0xcd);
            o.extend((x as u16).to_be_bytes())
        }
        0x1_0000..=0xffff_ffff => {
            o.push(0xce);
            o.extend((x as u32).to_be_bytes())
        }
        _ => {
            o.push(0xcf);
            o.extend(x.to_be_bytes())
        }
    }
}

fn uint_len(x: u32) -> usize {
    match x {
        0..=0x7f => 1,
        0x80..=0xff => 2,
        0x100..=0xffff => 3,
        _ => 5,
    }
}

/// The msgpack array of a token list.
pub fn enc_tokens(toks: &[u32]) -> Vec<u8> {
    let mut o = Vec::with_capacity(toks.len() * 5 + 5);
    enc_len(&mut o, toks.len(), Some((0x90, 15)), None, 0xdc, 0xdd);
    for t in toks {
        put_uint(&mut o, *t as u64);
    }
    o
}

/// The msgpack frame of [`ipc_key`]`(model, 1, worker, toks, 0, end, rid, 1)`,
/// written without building a [`V`] per token (load generators send millions).
pub fn key_frame(model: &str, worker: Option<i64>, toks: &[u32], end: i64, rid: &str) -> Vec<u8> {
    key_frame_enc(model, worker, &enc_tokens(toks), end, rid)
}

/// [`key_frame`] with the token list already encoded ([`enc_tokens`]).
pub fn key_frame_enc(
    model: &str,
    worker: Option<i64>,
    toks_enc: &[u8],
    end: i64,
    rid: &str,
) -> Vec<u8> {
    fn field(o: &mut Vec<u8>, name: &str, v: V) {
        enc_into(&s(name), o);
        enc_into(&v, o);
    }
    let mut o = Vec::with_capacity(toks_enc.len() + 200);
    o.push(0x8a);
    field(&mut o, "model_name", s(model));
    field(&mut o, "world_size", V::I(1));
    field(&mut o, "worker_id", worker.map_or(V::Nil, V::I));
    enc_into(&s("token_ids"), &mut o);
    o.extend_from_slice(toks_enc);
    field(&mut o, "start", V::I(0));
    field(&mut o, "end", V::I(end));
    field(&mut o, "request_id", s(rid));
    field(&mut o, "cache_salt", s(""));
    field(&mut o, "request_configs", V::Nil);
    field(&mut o, "num_kv_readers", V::I(1));
    o
}

impl Client {
    /// Sends every request (frames after the uid) at once, then takes the
    /// replies in whatever order they come; returns each request's payload.
    pub fn batch(&mut self, reqs: Vec<Vec<Vec<u8>>>) -> Vec<Option<V>> {
        let n = reqs.len();
        let ops: Vec<Vec<u8>> = reqs.iter().map(|r| r[0].clone()).collect();
        let first = self.uid;
        for r in reqs {
            self.send_raw(r);
        }
        let mut out: Vec<Option<Option<V>>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let frames = self
                .sock
                .recv_multipart(0)
                .expect("reply within the receive timeout (the server must always answer)");
            assert!(
                frames.len() == 2 || frames.len() == 3,
                "reply has {} frames",
                frames.len()
            );
            let i = (dec(&frames[0]).int() - first) as usize;
            assert!(
                i < n && out[i].is_none(),
                "reply uid {} unexpected",
                i as i64 + first
            );
            assert_eq!(frames[1], ops[i], "op echoed");
            out[i] = Some(frames.get(2).map(|f| dec(f)));
        }
        out.into_iter().map(|x| x.unwrap()).collect()
    }
}

/// A lookup workload over requests of `tokens` tokens: `stored` holds the
/// token lists the server has stored. Request `i` (request id `<prefix>-<i>`)
/// is, by `i % 4`: 0 and 1 a full hit of a stored request, 2 the same with
/// its second half changed (half the chunks hit), 3 a miss.
pub struct LookupMix {
    pub model: String,
    pub chunk: usize,
    pub tokens: usize,
    pub prefix: String,
    pub stored: Vec<Vec<u32>>,
    /// `stored`, msgpack-encoded.
    stored_enc: Vec<Vec<u8>>,
}

/// Lookups of a [`LookupMix`] run so far, by outcome.
#[derive(Debug, Clone, Copy, Default)]
pub struct MixCounts {
    pub full: u64,
    pub partial: u64,
    pub miss: u64,
}

impl MixCounts {
    pub fn total(&self) -> u64 {
        self.full + self.partial + self.miss
    }
}

impl LookupMix {
    /// A mix over `n_stored` requests of `tokens` tokens ([`LookupMix::stored_tokens`]).
    pub fn new(model: &str, chunk: usize, tokens: usize, prefix: &str, n_stored: usize) -> Self {
        let stored: Vec<Vec<u32>> = (0..n_stored)
            .map(|j| Self::stored_tokens(tokens, j))
            .collect();
        let mix = LookupMix {
            model: model.into(),
            chunk,
            tokens,
            prefix: prefix.into(),
            stored_enc: stored.iter().map(|t| enc_tokens(t)).collect(),
            stored,
        };
        for i in 0..8 {
            assert_eq!(mix.request(i).0, enc_tokens(&mix.request_tokens(i).0));
        }
        mix
    }

    /// Token list `j` to store: distinct first token, then a constant.
    pub fn stored_tokens(tokens: usize, j: usize) -> Vec<u32> {
        std::iter::once(0x0010_0000 + j as u32)
            .chain(std::iter::repeat_n(9906, tokens - 1))
            .collect()
    }

    /// The token changed in request `i` (position, new token), if any, and
    /// the chunks its lookup must hit.
    fn change(&self, i: u64) -> (Option<(usize, u32)>, i64) {
        let chunks = (self.tokens / self.chunk) as i64;
        // Tokens above any stored one, distinct per request.
        let fresh = 0x0100_0000 + (i % 0x80_0000) as u32;
        match i % 4 {
            0 | 1 => (None, chunks),
            2 => (Some((self.tokens / 2, fresh)), chunks / 2),
            _ => (Some((0, fresh)), 0),
        }
    }

    /// Tokens of request `i` and the chunks its lookup must hit.
    pub fn request_tokens(&self, i: u64) -> (Vec<u32>, i64) {
        let mut toks = self.stored[i as usize % self.stored.len()].clone();
        let (change, want) = self.change(i);
        if let Some((k, x)) = change {
            toks[k] = x;
        }
        (toks, want)
    }

    /// [`LookupMix::request_tokens`] msgpack-encoded, spliced from the stored
    /// request's encoding.
    pub fn request(&self, i: u64) -> (Vec<u8>, i64) {
        let j = i as usize % self.stored.len();
        let (toks, base) = (&self.stored[j], &self.stored_enc[j]);
        let (change, want) = self.change(i);
        let Some((k, x)) = change else {
            return (base.clone(), want);
        };
        let header = base.len() - toks.iter().map(|t| uint_len(*t)).sum::<usize>();
        let at = header + toks[..k].iter().map(|t| uint_len(*t)).sum::<usize>();
        let mut o = Vec::with_capacity(base.len() + 4);
        o.extend_from_slice(&base[..at]);
        put_uint(&mut o, x as u64);
        o.extend_from_slice(&base[at + uint_len(toks[k])..]);
        (o, want)
    }

    /// Runs requests `range` on `clients` connections to `port`, `window`
    /// requests in flight on each: lookup, query_prefetch_status until it is
    /// known, free_lookup_locks after a hit, end_session. Panics on a hit
    /// count other than the expected one.
    pub fn run(
        &self,
        port: u16,
        range: std::ops::Range<u64>,
        clients: usize,
        window: usize,
    ) -> MixCounts {
        let end = (self.tokens / self.chunk * self.chunk) as i64;
        let per = std::thread::scope(|sc| {
            let workers: Vec<_> = (0..clients as u64)
                .map(|t| {
                    let range = range.clone();
                    sc.spawn(move || {
                        let mut c = Client::connect(port);
                        let mut counts = MixCounts::default();
                        let mine: Vec<u64> = range.filter(|i| i % clients as u64 == t).collect();
                        for ids in mine.chunks(window) {
                            let reqs: Vec<_> = ids.iter().map(|&i| (i, self.request(i))).collect();
                            let rids: Vec<String> =
                                ids.iter().map(|i| format!("{}-{i}", self.prefix)).collect();
                            let lookups = reqs
                                .iter()
                                .zip(&rids)
                                .map(|((_, (toks, _)), rid)| {
                                    vec![
                                        enc(&V::I(OP_LOOKUP)),
                                        key_frame_enc(&self.model, None, toks, end, rid),
                                        enc(&V::I(1)),
                                    ]
                                })
                                .collect();
                            for r in c.batch(lookups) {
                                assert_eq!(r, None, "lookup ack");
                            }
                            let mut hits: Vec<Option<i64>> = vec![None; ids.len()];
                            let t0 = Instant::now();
                            loop {
                                let pending: Vec<usize> =
                                    (0..ids.len()).filter(|&k| hits[k].is_none()).collect();
                                if pending.is_empty() {
                                    break;
                                }
                                assert!(
                                    t0.elapsed() < Duration::from_secs(10),
                                    "prefetch never finished"
                                );
                                let q = pending
                                    .iter()
                                    .map(|&k| {
                                        vec![
                                            enc(&V::I(OP_QUERY_PREFETCH_STATUS)),
                                            enc(&s(&rids[k])),
                                        ]
                                    })
                                    .collect();
                                for (k, r) in pending.iter().zip(c.batch(q)) {
                                    hits[*k] = r.map(|v| v.int());
                                }
                            }
                            let mut release = Vec::new();
                            for (k, ((i, (toks, want)), rid)) in reqs.iter().zip(&rids).enumerate()
                            {
                                let got = hits[k].unwrap();
                                assert_eq!(got, *want, "request {i}: hit chunks");
                                match got {
                                    0 => counts.miss += 1,
                                    h if h == end / self.chunk as i64 => counts.full += 1,
                                    _ => counts.partial += 1,
                                }
                                if got > 0 {
                                    release.push(vec![
                                        enc(&V::I(OP_FREE_LOOKUP_LOCKS)),
                                        key_frame_enc(&self.model, None, toks, end, rid),
                                        enc(&V::I(1)),
                                    ]);
                                }
                                release.push(vec![enc(&V::I(OP_END_SESSION)), enc(&s(rid))]);
                            }
                            for r in c.batch(release) {
                                assert_eq!(r, None, "free_lookup_locks / end_session ack");
                            }
                        }
                        counts
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap())
                .collect::<Vec<_>>()
        });
        per.into_iter()
            .fold(MixCounts::default(), |a, b| MixCounts {
                full: a.full + b.full,
                partial: a.partial + b.partial,
                miss: a.miss + b.miss,
            })
    }
}

/// Registers engine_driven instance `iid` of `model` (world size 1, 2 layers,
/// hidden `hidden`, float16, `chunk`-token chunks) and stores each of
/// `requests` whole (prepare_store then commit_store, no bytes written).
/// Returns the pool's (shm name, size).
pub fn store_requests(
    c: &mut Client,
    iid: i64,
    model: &str,
    hidden: i64,
    chunk: usize,
    requests: &[Vec<u32>],
) -> (String, usize) {
    let reg = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                iid,
                model,
                1,
                2,
                hidden,
                false,
                chunk as i64,
            )],
        )
        .expect("register reply");
    for (j, toks) in requests.iter().enumerate() {
        let rid = format!("store-{model}-{j}");
        let end = (toks.len() / chunk * chunk) as i64;
        let key = ipc_key(model, 1, Some(0), toks, 0, end, &rid, 1);
        let r = c
            .call(OP_PREPARE_STORE, &[key.clone(), V::I(iid)])
            .expect("prepare_store reply");
        assert_eq!(
            ed_slots(&r).len(),
            toks.len() / chunk,
            "request {j}: slots reserved"
        );
        assert_eq!(
            c.call(OP_COMMIT_STORE, &[key, V::I(iid), V::Bin(vec![])]),
            Some(V::B(true)),
            "request {j}: commit_store"
        );
        c.call(OP_END_SESSION, &[s(&rid)]);
    }
    (
        reg.get("shm_name").unwrap().str().to_owned(),
        reg.get("pool_size").unwrap().int() as usize,
    )
}

// ------------------------------------------ lmcache_driven helpers

/// The block ids of one KV group, as STORE and RETRIEVE carry them.
pub fn group_ids(v: &[i64]) -> V {
    V::A(vec![V::A(v.iter().map(|x| V::I(*x)).collect())])
}

/// STORE/RETRIEVE's `(event, ok)` reply.
pub fn transfer_outcome(reply: Option<V>) -> (Vec<u8>, bool) {
    match reply {
        Some(V::A(a)) if a.len() == 2 => match &a[0] {
            V::Bin(b) => (b.clone(), a[1].boolean()),
            other => panic!("event is not bytes: {other:?}"),
        },
        other => panic!("expected (bytes, bool), got {other:?}"),
    }
}

/// `/status`'s `registered_gpu_ids`.
pub fn registered_gpu_ids(srv: &Server) -> Vec<i64> {
    srv.get_json("/status")["registered_gpu_ids"]
        .as_array()
        .expect("registered_gpu_ids")
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// Why instance `iid` is listed in `/status`'s `refused_gpu_instances`, if it is.
pub fn refused_gpu_reason(srv: &Server, iid: i64) -> Option<String> {
    srv.get_json("/status")["refused_gpu_instances"]
        .as_array()?
        .iter()
        .find(|e| e["instance_id"] == iid)
        .map(|e| e["reason"].as_str().unwrap_or("").to_string())
}

// ------------------------------------------------------------------ paged KV layers

/// How a vLLM worker lays out one layer's paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// `[2, blocks, block_tokens, heads, head_size]`, contiguous (FlashAttention, NHD).
    Nhd,
    /// Same logical dims, heads outside slots in memory (`[2, blocks, heads, block_tokens, head_size]`).
    Hnd,
    /// `[blocks, block_tokens, mla_dim]` (fused latent K/V).
    Mla,
}

/// One layer of a worker's paged KV cache: its layout and sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedKv {
    pub layout: Layout,
    pub blocks: usize,
    pub block_tokens: usize,
    pub heads: usize,
    pub head_size: usize,
    pub mla_dim: usize,
    /// Bytes per element.
    pub elem: usize,
}

impl PagedKv {
    pub const fn with(self, layout: Layout) -> PagedKv {
        PagedKv { layout, ..self }
    }

    pub fn planes(self) -> usize {
        if self.layout == Layout::Mla {
            1
        } else {
            2
        }
    }

    /// Bytes of one token in the object (all heads).
    pub fn row(self) -> usize {
        match self.layout {
            Layout::Mla => self.mla_dim * self.elem,
            _ => self.heads * self.head_size * self.elem,
        }
    }

    /// Bytes of one (plane, block): contiguous in every layout here.
    pub fn block(self) -> usize {
        self.block_tokens * self.row()
    }

    pub fn layer_bytes(self) -> usize {
        self.planes() * self.blocks * self.block()
    }

    /// The `kv_layout` hint a worker sends.
    pub fn hint(self) -> &'static str {
        match self.layout {
            Layout::Hnd => "HND",
            _ => "NHD",
        }
    }

    /// The logical shape and element strides a worker reports.
    pub fn shape_stride(self) -> (Vec<i64>, Vec<i64>) {
        let [nb, bs, nh, hs, md] = [
            self.blocks,
            self.block_tokens,
            self.heads,
            self.head_size,
            self.mla_dim,
        ]
        .map(|d| d as i64);
        match self.layout {
            Layout::Nhd => (
                vec![2, nb, bs, nh, hs],
                vec![nb * bs * nh * hs, bs * nh * hs, nh * hs, hs, 1],
            ),
            Layout::Hnd => (
                vec![2, nb, bs, nh, hs],
                vec![nb * nh * bs * hs, nh * bs * hs, hs, bs * hs, 1],
            ),
            Layout::Mla => (vec![nb, bs, md], vec![bs * md, md, 1]),
        }
    }

    /// Byte range of (plane, block) in a layer.
    pub fn block_range(self, plane: usize, block: usize) -> std::ops::Range<usize> {
        let off = (plane * self.blocks + block) * self.block();
        off..off + self.block()
    }

    /// One token's row as the object stores it: heads, then head elements.
    pub fn token_row(self, layer: &[u8], plane: usize, block: usize, slot: usize) -> Vec<u8> {
        let base = self.block_range(plane, block).start;
        match self.layout {
            Layout::Hnd => (0..self.heads)
                .flat_map(|h| {
                    let off = base + (h * self.block_tokens + slot) * self.head_size * self.elem;
                    layer[off..off + self.head_size * self.elem].iter().copied()
                })
                .collect(),
            _ => {
                let off = base + slot * self.row();
                layer[off..off + self.row()].to_vec()
            }
        }
    }
}
