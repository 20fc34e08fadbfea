//! RPC round-trip latency against the real server: noop, lookup + prefetch status
//! for a 2048-token request, and the engine_driven prepare/commit round trips,
//! each as a ratio to a bare libzmq echo measured in the same run, the store also
//! beside its floor (the echo answering its prepare only once it has decoded it
//! and hashed its chunks, which no server can answer before); then lookups
//! under saturation (with a 1 GiB store and /status polling beside them), and the
//! server's resident memory outside the L1 arena after many lookups.
//!
//! `cargo bench --bench rpc` runs the full sizes (`-- round_trips`, `saturation` or
//! `rss` runs only those sections; `KVSHARD_BENCH_SPIN_US=N` starts the servers with
//! `--spin-us N`, and `KVSHARD_BENCH_CORES=LIST` with `--cores LIST`); under `cargo test` (no `--bench` argument) it
//! runs a few iterations so the harness cannot rot. Timing bars are
//! printed as PASS/ABOVE and never fail the run; a request left unanswered does
//! (exit status 1).

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvshard_engine::keys::chunk_hashes;
use kvshard_transport::wire;
use support::*;

const CHUNK: usize = 256;
const TOKENS: usize = 2048;
const MIB: f64 = (1u64 << 20) as f64;
const GIB: u64 = 1 << 30;

fn report(name: &str, h: &Histogram<u64>) {
    println!(
        "{name:<34} n={:<7} p50={:>7.1}us p99={:>7.1}us p99.9={:>7.1}us p99.99={:>7.1}us max={:>8.1}us",
        h.len(),
        h.value_at_quantile(0.5) as f64 / 1e3,
        h.value_at_quantile(0.99) as f64 / 1e3,
        h.value_at_quantile(0.999) as f64 / 1e3,
        h.value_at_quantile(0.9999) as f64 / 1e3,
        h.max() as f64 / 1e3,
    );
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "ABOVE"
    }
}

fn tokens(seed: usize) -> Vec<u32> {
    std::iter::once(seed as u32)
        .chain(std::iter::repeat_n(9906, TOKENS))
        .collect()
}

/// A bare ZeroMQ ROUTER that echoes every request back: the floor any server on
/// libzmq can reach on this machine, measured with the same client and the same
/// frames as the server's noop.
fn echo_baseline(n: usize) -> Histogram<u64> {
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    let port = bind_loopback(&router);
    let total = n + n / 10;
    let echo = std::thread::spawn(move || {
        for _ in 0..total {
            let mut frames = router.recv_multipart(0).unwrap();
            // Answer as the server does: [identity, uid, op, "OK"].
            frames.push(vec![0xa2, b'O', b'K']);
            router.send_multipart(frames, 0).unwrap();
        }
    });
    let mut c = Client::connect(port);
    for _ in 0..n / 10 {
        c.noop_ok();
    }
    let mut h = hist();
    for _ in 0..n {
        let t = Instant::now();
        c.noop_ok();
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    echo.join().unwrap();
    h
}

/// The same echo with one hand-off to a second thread and back, as the server
/// hands a lookup or a prepare to a shard: the ROUTER thread passes each
/// request to a worker over a channel and waits for the answer on an eventfd
/// it polls beside the socket. Both threads are pinned as the server's front
/// (last allowed core) and first shard (first core) are. A round trip of it
/// minus a plain echo's is the cost of the thread hop alone on this machine.
fn hop_echo_baseline(n: usize) -> Histogram<u64> {
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    let port = bind_loopback(&router);
    let total = n + n / 10;
    // SAFETY: eventfd takes no pointers; the fd is owned by this function's threads.
    let done_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) };
    assert!(done_fd >= 0, "eventfd");
    let (to_worker, from_router) = std::sync::mpsc::channel::<Vec<Vec<u8>>>();
    let (to_router, from_worker) = std::sync::mpsc::channel::<Vec<Vec<u8>>>();
    let cores = allowed_cores();
    let (worker_core, router_core) = (cores[0], *cores.last().unwrap());
    let worker = std::thread::spawn(move || {
        pin(worker_core);
        for mut frames in from_router {
            frames.push(vec![0xa2, b'O', b'K']);
            to_router.send(frames).unwrap();
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to the eventfd.
            unsafe { libc::write(done_fd, one.as_ptr().cast(), 8) };
        }
    });
    let echo = std::thread::spawn(move || {
        pin(router_core);
        let mut answered = 0;
        while answered < total {
            let mut items = [
                router.as_poll_item(zmq::POLLIN),
                zmq::PollItem::from_fd(done_fd, zmq::POLLIN),
            ];
            zmq::poll(&mut items, -1).unwrap();
            if items[0].is_readable() {
                while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
                    to_worker.send(frames).unwrap();
                }
            }
            if items[1].is_readable() {
                let mut buf = [0u8; 8];
                // SAFETY: reads 8 bytes into a live buffer from the eventfd.
                unsafe { libc::read(done_fd, buf.as_mut_ptr().cast(), 8) };
                while let Ok(frames) = from_worker.try_recv() {
                    router.send_multipart(frames, 0).unwrap();
                    answered += 1;
                }
            }
        }
        drop(to_worker);
    });
    let mut c = Client::connect(port);
    for _ in 0..n / 10 {
        c.noop_ok();
    }
    let mut h = hist();
    for _ in 0..n {
        let t = Instant::now();
        c.noop_ok();
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    echo.join().unwrap();
    worker.join().unwrap();
    // SAFETY: both threads that used the fd have ended.
    unsafe { libc::close(done_fd) };
    h
}

/// The cores this process may run on, ascending.
fn allowed_cores() -> Vec<usize> {
    // SAFETY: the set is zeroed and sized for sched_getaffinity.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a live cpu_set_t of `size` bytes.
    let rc = unsafe { libc::sched_getaffinity(0, size, &mut set) };
    assert_eq!(rc, 0, "sched_getaffinity");
    // SAFETY: CPU_ISSET reads the initialised set.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

fn pin(core: usize) {
    // SAFETY: the set is zeroed, one bit set, and passed with its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Sends a request of encoded `frames` (the op first) and returns the reply's
/// payload.
fn call_frames(c: &mut Client, frames: Vec<Vec<u8>>) -> Option<V> {
    let op = frames[0].clone();
    let uid = c.send_raw(frames);
    let r = c.recv(uid);
    assert_eq!(r.op, op, "op echoed");
    r.payload
}

/// A bare libzmq echo kept running beside the server, sampled in blocks
/// between the server's measurements so both see the same machine load.
struct Echo {
    c: Client,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The echo thread's id, for its CPU time.
    tid: Arc<std::sync::atomic::AtomicI32>,
}

impl Echo {
    fn start() -> Echo {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.set_rcvtimeo(50).unwrap();
        let port = bind_loopback(&router);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let tid = Arc::new(std::sync::atomic::AtomicI32::new(0));
        let tid_out = tid.clone();
        let thread = std::thread::spawn(move || {
            let _ctx = ctx;
            // SAFETY: gettid takes no arguments and cannot fail.
            tid_out.store(unsafe { libc::gettid() }, Ordering::Relaxed);
            while !flag.load(Ordering::Relaxed) {
                if let Ok(mut frames) = router.recv_multipart(0) {
                    prepare_store_work(&frames);
                    // [identity, uid, op] and a short answer, whatever came after.
                    frames.truncate(3);
                    frames.push(vec![0xa2, b'O', b'K']);
                    router.send_multipart(frames, 0).unwrap();
                }
            }
        });
        let mut c = Client::connect(port);
        for _ in 0..1000 {
            c.noop_ok();
        }
        Echo {
            c,
            stop,
            thread: Some(thread),
            tid,
        }
    }

    /// CPU time the echo thread has used so far.
    fn cpu(&self) -> Duration {
        let tid = self.tid.load(Ordering::Relaxed) as u32;
        thread_cpu(std::process::id(), tid).unwrap_or_default()
    }

    /// `n` echo round trips recorded into `h`.
    fn sample(&mut self, n: usize, h: &mut Histogram<u64>) {
        for _ in 0..n {
            let t = Instant::now();
            self.c.noop_ok();
            h.record(t.elapsed().as_nanos() as u64).unwrap();
        }
    }

    /// `n` times the requests of `requests` (each its frames, the op first)
    /// sent to the echo one after the other, each answered with the echo's
    /// short reply; the round trips of each time recorded into `h` as one.
    fn sample_requests(&mut self, n: usize, requests: &[&[Vec<u8>]], h: &mut Histogram<u64>) {
        for _ in 0..n {
            let copies: Vec<Vec<Vec<u8>>> = requests.iter().map(|r| r.to_vec()).collect();
            let t = Instant::now();
            for frames in copies {
                call_frames(&mut self.c, frames);
            }
            h.record(t.elapsed().as_nanos() as u64).unwrap();
        }
    }
}

/// What any server has to do with a prepare_store before it can answer it,
/// done by the echo to `frames` ([identity, uid, op, payloads...]) when they
/// are one: decode the request and hash its complete chunks (lmcache's chained
/// blake3), whose hashes name the objects and so the shards that own them.
/// Nothing for any other request.
fn prepare_store_work(frames: &[Vec<u8>]) {
    let Some(op) = frames.get(2).and_then(|f| wire::decode_op(f).ok()) else {
        return;
    };
    if op != wire::Op::PrepareStore {
        return;
    }
    let payloads: Vec<&[u8]> = frames[3..].iter().map(Vec::as_slice).collect();
    let Ok(wire::Request::PrepareStore { key, .. }) = wire::decode_request(op, &payloads) else {
        panic!("the bench's prepare_store decodes");
    };
    let end = usize::try_from(key.end).expect("a positive end");
    let hashes = chunk_hashes(&key.token_ids, CHUNK, 0, end - end % CHUNK).expect("hashable");
    std::hint::black_box(hashes);
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// CPU time (user + system) thread `tid` of process `pid` has used so far,
/// from `/proc`; `None` where it cannot be read (the thread is gone).
fn thread_cpu(pid: u32, tid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    // After the command name's closing parenthesis come the state (field 3)
    // and, 11 and 12 fields on, utime and stime (fields 14 and 15), in ticks.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_nanos(
        ticks * 1_000_000_000 / clock_ticks_per_s(),
    ))
}

/// The unit of `/proc`'s CPU times, per second.
fn clock_ticks_per_s() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64
}

/// The server's CPU time so far: its front (the main thread), its shards,
/// and every thread (ZeroMQ's and the HTTP thread's included).
#[derive(Clone, Copy, Default)]
struct ServerCpu {
    front: Duration,
    shards: Duration,
    all: Duration,
}

impl ServerCpu {
    fn of(pid: u32) -> ServerCpu {
        let mut cpu = ServerCpu::default();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return cpu;
        };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            let t = thread_cpu(pid, tid).unwrap_or_default();
            cpu.all += t;
            if tid == pid {
                cpu.front = t;
            }
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.starts_with("kvshard-shard") {
                cpu.shards += t;
            }
        }
        cpu
    }
}

/// The CPU time the server and the echo's thread use over one section of
/// the round trips.
struct CpuWindow {
    pid: u32,
    server: ServerCpu,
    echo: Duration,
}

impl CpuWindow {
    fn start(pid: u32, echo: &Echo) -> CpuWindow {
        CpuWindow {
            pid,
            server: ServerCpu::of(pid),
            echo: echo.cpu(),
        }
    }

    /// Prints the CPU time each of `n` operations of `what` (of `requests`
    /// requests each) cost the server since the start, beside what each of
    /// the `echoes` round trips cost the echo's thread meanwhile.
    fn report(&self, what: &str, n: usize, requests: usize, echo: &Echo, echoes: u64) {
        let now = ServerCpu::of(self.pid);
        let per = |d: Duration, n: u64| d.as_secs_f64() * 1e6 / n.max(1) as f64;
        let n = n as u64;
        println!(
            "  server CPU per {what}: front {:.1}us, shards {:.1}us, all threads {:.1}us \
             ({requests} requests; the echo's thread: {:.1}us per round trip; /proc ticks of {}ms)",
            per(now.front.saturating_sub(self.server.front), n),
            per(now.shards.saturating_sub(self.server.shards), n),
            per(now.all.saturating_sub(self.server.all), n),
            per(echo.cpu().saturating_sub(self.echo), echoes),
            1000 / clock_ticks_per_s(),
        );
    }
}

/// Echo blocks per measured operation.
const ECHO_BLOCKS: usize = 10;

/// The bar of each two-round-trip operation, over the echo at p50.
const PAIR_BAR: f64 = 2.4;

/// The round-trip histograms of [`round_trips`].
struct RoundTrips {
    noop: Histogram<u64>,
    lookup: Histogram<u64>,
    store: Histogram<u64>,
    retrieve: Histogram<u64>,
    /// prepare+commit store in vLLM's order: after the scheduler's lookup of
    /// the same request (a miss), whose chunk hashes its session keeps.
    store_after_lookup: Histogram<u64>,
    /// The echo sampled between the blocks of each: beside noop, beside
    /// prepare+commit store, beside lookup (and retrieve), beside the store
    /// after a lookup.
    echo_noop: Histogram<u64>,
    echo_store: Histogram<u64>,
    echo_lookup: Histogram<u64>,
    echo_store_after: Histogram<u64>,
    /// The floor of a store, sampled beside it: the same prepare_store and
    /// commit_store sent to the echo, which decodes the prepare and hashes
    /// its chunks before answering it (see [`prepare_store_work`]).
    store_floor: Histogram<u64>,
    /// The echo of a request carrying a 2048-token key (a lookup's frames),
    /// sampled beside lookup and retrieve: what such a request costs the
    /// transport alone.
    echo_sized: Histogram<u64>,
}

/// noop, prepare+commit store, lookup+status and prepare+commit retrieve, one
/// at a time on one connection, against a server of its own; each in
/// [`ECHO_BLOCKS`] blocks alternating with as many echo round trips.
fn round_trips(n_noop: usize, n_lookup: usize, n_pc: usize) -> RoundTrips {
    let mut echo = Echo::start();
    let (mut echo_noop, mut echo_store, mut echo_lookup) = (hist(), hist(), hist());
    let mut echo_sized = hist();
    let flags = server_flags(&[
        "--chunk-size",
        "256",
        "--l1-size-gb",
        "1",
        "--no-l1-use-lazy",
    ]);
    let srv = Server::start(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    println!("server flags: {}", flags.join(" "));
    let mut c = srv.client();

    // noop: the floor of a round trip through the front thread.
    for _ in 0..n_noop / 10 {
        c.noop_ok();
    }
    let pid = srv.child.id();
    let cpu = CpuWindow::start(pid, &echo);
    let mut h = hist();
    for i in 0..n_noop {
        if i % (n_noop / ECHO_BLOCKS) == 0 {
            echo.sample(n_noop / ECHO_BLOCKS, &mut echo_noop);
        }
        let t = Instant::now();
        c.noop_ok();
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    report("noop round trip", &h);
    cpu.report("noop", n_noop, 1, &echo, echo_noop.len());

    // A small layout keeps the data copy out of the RPC figures.
    let reg = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                1,
                "bench",
                1,
                2,
                64,
                false,
                CHUNK as i64,
            )],
        )
        .expect("register reply");
    let pool_name = reg.get("shm_name").unwrap().str().to_owned();
    let pool_len = reg.get("pool_size").unwrap().int() as usize;
    let _pool = ShmMap::open(&pool_name, pool_len);
    let end = (TOKENS / CHUNK * CHUNK) as i64;

    // Requests are encoded before the clock starts: the figures are the round
    // trips and the server, not this client's msgpack encoder.
    let (one, empty) = (enc(&V::I(1)), enc(&V::Bin(vec![])));
    let req = |op: i64, payloads: &[&Vec<u8>]| -> Vec<Vec<u8>> {
        std::iter::once(enc(&V::I(op)))
            .chain(payloads.iter().map(|p| p.to_vec()))
            .collect()
    };
    // prepare_store + commit_store of `key` (8 chunks, every one answered
    // with a slot): the whole and the prepare's part of it.
    let store = |c: &mut Client, key: &Vec<u8>| -> (Duration, Duration) {
        let (prep, commit) = (
            req(OP_PREPARE_STORE, &[key, &one]),
            req(OP_COMMIT_STORE, &[key, &one, &empty]),
        );
        let t = Instant::now();
        let r = call_frames(c, prep).expect("prepare_store");
        let prepared = t.elapsed();
        assert_eq!(
            r.get("context").unwrap().get("slots").unwrap().arr().len(),
            TOKENS / CHUNK
        );
        assert_eq!(call_frames(c, commit), Some(V::B(true)));
        (t.elapsed(), prepared)
    };

    // prepare_store + commit_store of a fresh 2048-token request (8 chunks).
    let wakeups = || counter(srv.http_port, "kvshard_shard_wakeups_total").unwrap_or(f64::NAN);
    let wakeups_before = wakeups();
    let cpu = CpuWindow::start(pid, &echo);
    let mut hp = hist();
    let (mut hp_prep, mut hp_commit) = (hist(), hist());
    let mut store_floor = hist();
    for i in 0..n_pc {
        let key = key_frame("bench", Some(0), &tokens(i), end, &format!("s{i}"));
        if i % (n_pc / ECHO_BLOCKS) == 0 {
            echo.sample(n_pc / ECHO_BLOCKS, &mut echo_store);
            let (prep, commit) = (
                req(OP_PREPARE_STORE, &[&key, &one]),
                req(OP_COMMIT_STORE, &[&key, &one, &empty]),
            );
            echo.sample_requests(n_pc / ECHO_BLOCKS, &[&prep, &commit], &mut store_floor);
        }
        let (whole, prepared) = store(&mut c, &key);
        split(&mut hp, &mut hp_prep, &mut hp_commit, whole, prepared);
        c.call(OP_END_SESSION, &[s(&format!("s{i}"))]);
    }
    report("prepare+commit store (8 chunks)", &hp);
    report("  of which the prepare", &hp_prep);
    report("  of which the commit", &hp_commit);
    let echoes = echo_store.len() + 2 * store_floor.len();
    cpu.report("store and end_session", n_pc, 3, &echo, echoes);
    println!(
        "  shard wake-ups per store and end_session: {:.2}",
        (wakeups() - wakeups_before) / n_pc as f64
    );
    let credit = |name| counter(srv.http_port, name).map_or("?".into(), |v| v.to_string());
    println!(
        "  prepare_stores answered from write credits: {}; that asked the shards for lack of them: {}",
        credit("kvshard_prepare_stores_from_credits_total"),
        credit("kvshard_prepare_store_credit_misses_total")
    );

    // lookup + query_prefetch_status of a stored request: a full hit of 8 chunks.
    let cpu = CpuWindow::start(pid, &echo);
    let mut hl = hist();
    let (mut hl_lookup, mut hl_status) = (hist(), hist());
    let mut hr = hist();
    let (mut hr_prep, mut hr_commit) = (hist(), hist());
    for i in 0..n_lookup {
        if i % (n_lookup / ECHO_BLOCKS) == 0 {
            echo.sample(n_lookup / ECHO_BLOCKS, &mut echo_lookup);
        }
        // The most recent requests: older ones may have been evicted from L1.
        let idx = n_pc - 1 - i % n_pc.min(256);
        let toks = enc_tokens(&tokens(idx));
        let rid = format!("l{i}");
        let lookup = req(
            OP_LOOKUP,
            &[&key_frame_enc("bench", None, &toks, end, &rid), &one],
        );
        if i % (n_lookup / ECHO_BLOCKS) == 0 {
            echo.sample_requests(n_lookup / ECHO_BLOCKS, &[&lookup], &mut echo_sized);
        }
        let t = Instant::now();
        assert_eq!(call_frames(&mut c, lookup), None);
        let looked_up = t.elapsed();
        let hits = c.prefetch_result(&rid);
        split(
            &mut hl,
            &mut hl_lookup,
            &mut hl_status,
            t.elapsed(),
            looked_up,
        );
        assert_eq!(hits, (TOKENS / CHUNK) as i64);
        // Then the retrieve round trips, which release the lookup's locks.
        let key = key_frame_enc("bench", Some(0), &toks, end, &rid);
        let (prep, commit) = (
            req(OP_PREPARE_RETRIEVE, &[&key, &one]),
            req(OP_COMMIT_RETRIEVE, &[&key, &one]),
        );
        let t = Instant::now();
        let r = call_frames(&mut c, prep).expect("prepare_retrieve");
        let prepared = t.elapsed();
        assert_eq!(r.get("success"), Some(&V::B(true)));
        assert_eq!(call_frames(&mut c, commit), Some(V::B(true)));
        split(&mut hr, &mut hr_prep, &mut hr_commit, t.elapsed(), prepared);
        c.call(OP_END_SESSION, &[s(&rid)]);
    }
    report("lookup+status (2048 tokens, hit)", &hl);
    report("  of which the lookup", &hl_lookup);
    report("  of which the status", &hl_status);
    report("prepare+commit retrieve (8 chunks)", &hr);
    report("  of which the prepare", &hr_prep);
    report("  of which the commit", &hr_commit);
    let what = "lookup, status, retrieve and end_session";
    let echoes = echo_lookup.len() + echo_sized.len();
    cpu.report(what, n_lookup, 5, &echo, echoes);

    // vLLM's order for a store: the scheduler looks the request up first (a
    // miss, with its status query; untimed), then the worker prepares and
    // commits it. Fresh tokens (past every seed stored above); this runs last
    // so its stores evict none of the objects the lookups above hit.
    let mut hv = hist();
    let mut echo_store_after = hist();
    for i in 0..n_pc {
        if i % (n_pc / ECHO_BLOCKS) == 0 {
            echo.sample(n_pc / ECHO_BLOCKS, &mut echo_store_after);
        }
        let toks = enc_tokens(&tokens(n_pc + i));
        let rid = format!("v{i}");
        let lookup = req(
            OP_LOOKUP,
            &[&key_frame_enc("bench", None, &toks, end, &rid), &one],
        );
        assert_eq!(call_frames(&mut c, lookup), None);
        assert_eq!(c.prefetch_result(&rid), 0, "fresh tokens cannot hit");
        let key = key_frame_enc("bench", Some(0), &toks, end, &rid);
        let (whole, _) = store(&mut c, &key);
        hv.record(whole.as_nanos() as u64).unwrap();
        c.call(OP_END_SESSION, &[s(&rid)]);
    }
    report("prepare+commit store after a lookup", &hv);
    RoundTrips {
        noop: h,
        lookup: hl,
        store: hp,
        retrieve: hr,
        store_after_lookup: hv,
        echo_noop,
        echo_store,
        echo_lookup,
        echo_store_after,
        store_floor,
        echo_sized,
    }
}

/// Records a two-round-trip operation that took `total`, the first of its
/// round trips having taken `first`, in `whole`, `one` and `two`.
fn split(
    whole: &mut Histogram<u64>,
    one: &mut Histogram<u64>,
    two: &mut Histogram<u64>,
    total: Duration,
    first: Duration,
) {
    whole.record(total.as_nanos() as u64).unwrap();
    one.record(first.as_nanos() as u64).unwrap();
    two.record((total - first).as_nanos() as u64).unwrap();
}

/// `--spin-us` for the servers of the round trips and the saturation:
/// `KVSHARD_BENCH_SPIN_US`, 0 (the server's default) when unset.
fn spin_us() -> String {
    std::env::var("KVSHARD_BENCH_SPIN_US").unwrap_or_else(|_| "0".into())
}

/// Those servers' flags: `--spin-us`, and `--cores KVSHARD_BENCH_CORES` when
/// set (the shards' cores; the front takes the last allowed core left, and the
/// bench's own threads the rest), after `base`.
fn server_flags(base: &[&str]) -> Vec<String> {
    let mut flags: Vec<String> = base.iter().map(|s| s.to_string()).collect();
    flags.extend(["--spin-us".to_string(), spin_us()]);
    if let Ok(cores) = std::env::var("KVSHARD_BENCH_CORES") {
        flags.extend(["--cores".to_string(), cores]);
    }
    flags
}

/// `h`'s value at quantile `q` over `echo`'s.
fn ratio(h: &Histogram<u64>, echo: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / echo.value_at_quantile(q) as f64
}

/// Prints each round trip's p50 and p99 over those of the echo sampled
/// between its blocks, with its bar.
fn ratios(rt: &RoundTrips, before: &Histogram<u64>, after: &Histogram<u64>, hop: &Histogram<u64>) {
    report("echo alone, before the server", before);
    report("echo alone, after the server", after);
    report("echo with a hop to a 2nd thread", hop);
    report("echo beside noop", &rt.echo_noop);
    report("echo beside prepare+commit store", &rt.echo_store);
    report("echo beside lookup and retrieve", &rt.echo_lookup);
    report("echo of a 2048-token request", &rt.echo_sized);
    println!(
        "ratios use the echo sampled in {ECHO_BLOCKS} blocks alternating with the measured \
         operation (same machine load); the runs before and after are for reference"
    );
    for (name, h, echo, bar) in [
        ("noop", &rt.noop, &rt.echo_noop, 1.15),
        (
            "lookup+status (2 round trips)",
            &rt.lookup,
            &rt.echo_lookup,
            PAIR_BAR,
        ),
        (
            "prepare+commit store (8 chunks)",
            &rt.store,
            &rt.echo_store,
            PAIR_BAR,
        ),
        (
            "prepare+commit retrieve (8 chunks)",
            &rt.retrieve,
            &rt.echo_lookup,
            PAIR_BAR,
        ),
    ] {
        let (r50, r99) = (ratio(h, echo, 0.5), ratio(h, echo, 0.99));
        println!(
            "ratio to echo  {name:<34} p50 {r50:>5.2}x {:<5}  p99 {r99:>5.2}x {:<5}  (bar <= {bar}x)",
            verdict(r50 <= bar),
            verdict(r99 <= bar),
        );
    }
    println!(
        "ratio to echo  {:<34} p50 {:>5.2}x        (vLLM's order, the scheduler's lookup first: \
         no bar, for reference)",
        "prepare+commit store after lookup",
        ratio(&rt.store_after_lookup, &rt.echo_store_after, 0.5),
    );
    // No measured request is answered only after a shard's reply: a lookup
    // is answered at once (the shards work on it while that reply travels;
    // its status query waits for them only if they are slower),
    // prepare_store from the write credits the shards lent, prepare_retrieve
    // from the locks the lookup holds. A request that did wait would pay this.
    let echo50 = before.value_at_quantile(0.5) as f64;
    let hop50 = hop.value_at_quantile(0.5) as f64;
    println!(
        "a hand-off to a second thread and back adds {:.1}us to an echo at p50 ({:.2}x the \
         echo); no measured request waits for one",
        (hop50 - echo50) / 1e3,
        hop50 / echo50
    );
    // Every request of those but the status carries the 2048-token key
    // (about 8 KiB): that much more for the transport to move, with no
    // server work. The floor of lookup+status is a sized echo and a plain
    // one, that of each prepare+commit two sized echoes (the echo answers
    // short, as the server does), to which a store adds its hashing (below).
    let plain50 = rt.echo_lookup.value_at_quantile(0.5) as f64;
    let sized50 = rt.echo_sized.value_at_quantile(0.5) as f64;
    println!(
        "payload: an echo of a 2048-token request takes {:.1}us more than a plain echo at p50 \
         ({:.2}x it)",
        (sized50 - plain50) / 1e3,
        sized50 / plain50
    );
    for (name, h, floor) in [
        ("lookup+status", &rt.lookup, sized50 + plain50),
        ("prepare+commit store", &rt.store, 2.0 * sized50),
        ("prepare+commit retrieve", &rt.retrieve, 2.0 * sized50),
    ] {
        println!(
            "over the echoes of the same requests  {name:<24} p50 {:>5.2}x",
            h.value_at_quantile(0.5) as f64 / floor
        );
    }
    // A store's prepare cannot be answered before its chunks are hashed: the
    // hashes name the objects, and so the shards whose memory the slots are
    // in. Its floor is the echo doing that much (decode and hash) and no more.
    report("store floor: echo + decode + hash", &rt.store_floor);
    let floor = ratio(&rt.store_floor, &rt.echo_store, 0.5);
    println!(
        "store floor (the echo of its two requests, the prepare decoded and its 8 chunks hashed \
         first) p50 {floor:.2}x the echo; the store is {:.2}x this floor",
        ratio(&rt.store, &rt.store_floor, 0.5)
    );
    if floor > PAIR_BAR {
        println!("  the store's bar ({PAIR_BAR}x the echo) is below this floor in this run");
    }
}

// ------------------------------------------------------------- saturation

/// Requests sent and replies received by one load client.
#[derive(Default, Clone, Copy)]
struct Tally {
    sent: u64,
    got: u64,
    /// Replies that were wrong (a hit count other than the stored request's, a
    /// refused commit, an HTTP status other than 200).
    bad: u64,
}

impl Tally {
    fn add(&mut self, o: Tally) {
        self.sent += o.sent;
        self.got += o.got;
        self.bad += o.bad;
    }
}

/// One request on `c`: `Some(payload)` or `None` when no reply came within
/// the socket's receive timeout (the socket is then out of step).
fn try_call(c: &mut Client, t: &mut Tally, frames: Vec<Vec<u8>>) -> Option<Option<V>> {
    let op = frames[0].clone();
    let uid = c.send_raw(frames);
    t.sent += 1;
    let r = c.sock.recv_multipart(0).ok()?;
    t.got += 1;
    assert_eq!(dec(&r[0]), V::I(uid), "uid echoed");
    assert_eq!(r[1], op, "op echoed");
    Some(r.get(2).map(|f| dec(f)))
}

/// `GET path`: the status code and the time to the end of the body; `None`
/// if the server did not answer within 5 s.
fn http_get(port: u16, path: &str) -> Option<(u16, Duration)> {
    let t = Instant::now();
    let (code, _) = http_fetch(port, path)?;
    Some((code, t.elapsed()))
}

/// `GET path`: the status code and the whole response; `None` if the server
/// did not answer within 5 s.
fn http_fetch(port: u16, path: &str) -> Option<(u16, Vec<u8>)> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut st = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    st.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    st.write_all(req.as_bytes()).ok()?;
    let mut out = Vec::new();
    st.read_to_end(&mut out).ok()?;
    let code = std::str::from_utf8(out.get(..12)?)
        .ok()?
        .split(' ')
        .nth(1)?
        .parse()
        .ok()?;
    Some((code, out))
}

/// The value of the unlabelled counter `name` on the server's `/metrics`.
fn counter(port: u16, name: &str) -> Option<f64> {
    let (_, body) = http_fetch(port, "/metrics")?;
    let text = String::from_utf8_lossy(&body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Lookup client `t` of the saturation: lookup + status of a stored request
/// (timed), then free_lookup_locks and end_session, until `stop`. `stored`
/// holds the stored requests' token lists, msgpack-encoded.
fn lookup_client(
    port: u16,
    t: usize,
    stored: &[Vec<u8>],
    stop: &AtomicBool,
) -> (Tally, Histogram<u64>, u64) {
    let mut c = Client::connect(port);
    c.sock.set_rcvtimeo(5_000).unwrap();
    let mut tally = Tally::default();
    let mut h = hist();
    let end = (TOKENS / CHUNK * CHUNK) as i64;
    let mut k = 0usize;
    'run: while !stop.load(Ordering::Relaxed) {
        let toks = &stored[(t * 7 + k) % stored.len()];
        let rid = format!("sat-{t}-{k}");
        k += 1;
        let start = Instant::now();
        let lookup = vec![
            enc(&V::I(OP_LOOKUP)),
            key_frame_enc("bench", None, toks, end, &rid),
            enc(&V::I(1)),
        ];
        match try_call(&mut c, &mut tally, lookup) {
            None => break 'run,
            Some(None) => {}
            Some(Some(_)) => tally.bad += 1,
        }
        let hits = loop {
            let q = vec![enc(&V::I(OP_QUERY_PREFETCH_STATUS)), enc(&s(&rid))];
            match try_call(&mut c, &mut tally, q) {
                None => break 'run,
                Some(Some(v)) => break v.int(),
                Some(None) => std::thread::sleep(Duration::from_micros(200)),
            }
        };
        h.record(start.elapsed().as_nanos() as u64).unwrap();
        if hits != (TOKENS / CHUNK) as i64 {
            tally.bad += 1;
        }
        let free = vec![
            enc(&V::I(OP_FREE_LOOKUP_LOCKS)),
            key_frame_enc("bench", None, toks, end, &rid),
            enc(&V::I(1)),
        ];
        let done = vec![enc(&V::I(OP_END_SESSION)), enc(&s(&rid))];
        if try_call(&mut c, &mut tally, free).is_none()
            || try_call(&mut c, &mut tally, done).is_none()
        {
            break;
        }
    }
    let n = h.len();
    (tally, h, n)
}

/// The store client of the saturation: `total` bytes of fresh 8-chunk
/// requests of 2 MiB chunks, written into the pool and committed. Returns
/// its tally, the bytes committed and the time it took.
fn store_client(port: u16, total: u64) -> (Tally, u64, Duration) {
    // 2 (K and V) x 2 layers x 256 tokens x hidden 1024 x 2 bytes = 2 MiB.
    const HIDDEN: i64 = 1024;
    const CHUNK_BYTES: usize = 2 * 2 * CHUNK * HIDDEN as usize * 2;
    let mut c = Client::connect(port);
    c.sock.set_rcvtimeo(5_000).unwrap();
    let reg = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                2,
                "bulk",
                1,
                2,
                HIDDEN,
                false,
                CHUNK as i64,
            )],
        )
        .expect("register reply");
    let pool_len = reg.get("pool_size").unwrap().int() as usize;
    let mut pool = ShmMap::open(reg.get("shm_name").unwrap().str(), pool_len);
    let data = pattern(7, CHUNK_BYTES);
    let end = (TOKENS / CHUNK * CHUNK) as i64;
    let mut tally = Tally::default();
    let mut committed = 0u64;
    let t0 = Instant::now();
    let mut j = 0usize;
    while committed < total {
        let toks = LookupMix::stored_tokens(TOKENS, 1_000_000 + j);
        let rid = format!("bulk-{j}");
        j += 1;
        let key = key_frame("bulk", Some(0), &toks, end, &rid);
        let prep = vec![enc(&V::I(OP_PREPARE_STORE)), key.clone(), enc(&V::I(2))];
        let Some(r) = try_call(&mut c, &mut tally, prep) else {
            break;
        };
        let slots = r.as_ref().map(ed_slots).unwrap_or_default();
        let mut bytes = 0;
        for slot in &slots {
            let off = slot.get("offset").unwrap().int() as usize;
            let len = slot.get("length").unwrap().int() as usize;
            assert_eq!(len, CHUNK_BYTES, "slot length of the bulk layout");
            pool.bytes_mut()[off..off + len].copy_from_slice(&data);
            bytes += len as u64;
        }
        if slots.len() != TOKENS / CHUNK {
            tally.bad += 1;
        }
        let commit = vec![
            enc(&V::I(OP_COMMIT_STORE)),
            key,
            enc(&V::I(2)),
            enc(&V::Bin(vec![])),
        ];
        match try_call(&mut c, &mut tally, commit) {
            None => break,
            Some(Some(V::B(true))) => committed += bytes,
            Some(_) => tally.bad += 1,
        }
        if try_call(
            &mut c,
            &mut tally,
            vec![enc(&V::I(OP_END_SESSION)), enc(&s(&rid))],
        )
        .is_none()
        {
            break;
        }
    }
    (tally, committed, t0.elapsed())
}

/// 8 lookup clients for `window`, a client storing `store_bytes` and a
/// /status poller, all at once. Returns false when a request went unanswered.
fn saturation(window: Duration, store_bytes: u64) -> bool {
    const LOOKUP_CLIENTS: usize = 8;
    const STORED: usize = 64;
    // 64 MiB of lookup targets plus the bulk store stay under the eviction
    // watermark (0.8) of a 2 GiB L1, so every lookup is a full hit.
    let flags = server_flags(&[
        "--chunk-size",
        "256",
        "--l1-size-gb",
        "2",
        "--no-l1-use-lazy",
    ]);
    let srv = Server::start(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let stored: Vec<Vec<u32>> = (0..STORED)
        .map(|j| LookupMix::stored_tokens(TOKENS, j))
        .collect();
    let (_, pool_len) = store_requests(&mut srv.client(), 1, "bench", 64, CHUNK, &stored);
    let stored: Vec<Vec<u8>> = stored.iter().map(|t| enc_tokens(t)).collect();
    assert!(
        (STORED as u64 * 8 * 128 * 1024 + store_bytes) as f64 <= 0.8 * pool_len as f64,
        "the L1 pool ({pool_len} bytes) is too small for the saturation run"
    );
    let (port, http_port) = (srv.port, srv.http_port);
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let (lookups, store, status) = std::thread::scope(|sc| {
        let lookups: Vec<_> = (0..LOOKUP_CLIENTS)
            .map(|t| {
                let (stored, stop) = (&stored, &stop);
                sc.spawn(move || lookup_client(port, t, stored, stop))
            })
            .collect();
        let store = sc.spawn(move || store_client(port, store_bytes));
        let status = {
            let stop = &stop;
            sc.spawn(move || {
                let mut tally = Tally::default();
                let mut h = hist();
                while !stop.load(Ordering::Relaxed) {
                    tally.sent += 1;
                    match http_get(http_port, "/status") {
                        Some((code, d)) => {
                            tally.got += 1;
                            if code != 200 {
                                tally.bad += 1;
                            }
                            h.record(d.as_nanos() as u64).unwrap();
                        }
                        None => break,
                    }
                }
                (tally, h)
            })
        };
        std::thread::sleep(window);
        stop.store(true, Ordering::Relaxed);
        let lookups: Vec<_> = lookups.into_iter().map(|j| j.join().unwrap()).collect();
        let elapsed = t0.elapsed();
        (
            (lookups, elapsed),
            store.join().unwrap(),
            status.join().unwrap(),
        )
    });
    let ((per_client, elapsed), (st_tally, committed, st_time), (http_tally, hs)) =
        (lookups, store, status);
    let mut lk_tally = Tally::default();
    let mut hl = hist();
    let mut n_lookups = 0;
    for (t, h, n) in &per_client {
        lk_tally.add(*t);
        hl.add(h).unwrap();
        n_lookups += n;
    }
    println!(
        "saturation: {LOOKUP_CLIENTS} lookup clients for {:.2}s, 1 store client, 1 /status poller",
        elapsed.as_secs_f64()
    );
    println!(
        "  lookups: {n_lookups} ({:.0}/s aggregate), lookup+status p50={:.1}us p99={:.1}us",
        n_lookups as f64 / elapsed.as_secs_f64(),
        hl.value_at_quantile(0.5) as f64 / 1e3,
        hl.value_at_quantile(0.99) as f64 / 1e3,
    );
    println!(
        "  store: {committed} bytes committed ({:.3} GiB of 2 MiB chunks, target {:.3} GiB) in {:.2}s = {:.2} GiB/s{}",
        committed as f64 / GIB as f64,
        store_bytes as f64 / GIB as f64,
        st_time.as_secs_f64(),
        committed as f64 / GIB as f64 / st_time.as_secs_f64(),
        if st_time > elapsed {
            " (outlasted the lookup window)"
        } else {
            ""
        }
    );
    let p99_ms = hs.value_at_quantile(0.99) as f64 / 1e6;
    println!(
        "  GET /status: n={} p50={:.2}ms p99={p99_ms:.2}ms (bar p99 <= 10 ms) {}",
        hs.len(),
        hs.value_at_quantile(0.5) as f64 / 1e6,
        verdict(p99_ms <= 10.0)
    );
    let mut ok = true;
    for (what, t) in [
        ("lookup clients", lk_tally),
        ("store client", st_tally),
        ("/status poller", http_tally),
    ] {
        println!(
            "  {what:<15} requests sent {:>8}  replies got {:>8}  wrong replies {}",
            t.sent, t.got, t.bad
        );
        if t.sent != t.got {
            println!(
                "FAILURE: {what}: {} request(s) got no reply within 5 s",
                t.sent - t.got
            );
            ok = false;
        }
        if t.bad != 0 {
            println!("FAILURE: {what}: {} wrong reply(ies)", t.bad);
            ok = false;
        }
    }
    if committed < store_bytes {
        println!("FAILURE: store client committed {committed} of {store_bytes} bytes");
        ok = false;
    }
    ok
}

// -------------------------------------------------------------------- RSS

/// The server's resident memory outside its L1 arena before and after
/// `n` lookups of 2048 tokens (a mix of hits and misses, distinct request ids).
fn rss_after_lookups(n: u64) {
    let srv = Server::start(&[
        "--chunk-size",
        "256",
        "--l1-size-gb",
        "0.5",
        "--no-l1-use-lazy",
    ]);
    let mix = LookupMix::new("bench", CHUNK, TOKENS, "rss", 64);
    store_requests(&mut srv.client(), 1, "bench", 64, CHUNK, &mix.stored);
    let show = |what: &str, r: RssSplit| {
        println!(
            "  {what:<22} RSS outside the arena {:>7.1} MiB (arena: {} mapping(s), {:.0} MiB mapped, {:.0} MiB resident)",
            r.outside as f64 / MIB,
            r.arena_mappings,
            r.arena_size as f64 / MIB,
            r.arena_rss as f64 / MIB
        );
        r
    };
    println!("server RSS after {n} lookups of {TOKENS} tokens (/proc/<pid>/smaps; the arena is /dev/shm/{}):", srv.shm_name);
    let r0 = show("before the lookups", srv.rss_split());
    assert_eq!(r0.arena_size, GIB / 2, "arena mapping found by its path");
    let t0 = Instant::now();
    let a = mix.run(srv.port, 0..n / 2, 4, 32);
    let r1 = show(&format!("after {} lookups", n / 2), srv.rss_split());
    let b = mix.run(srv.port, n / 2..n, 4, 32);
    let secs = t0.elapsed().as_secs_f64();
    let r2 = show(&format!("after {n} lookups"), srv.rss_split());
    println!(
        "  {} lookups in {secs:.1}s ({:.0}/s): {} full hits, {} half hits, {} misses",
        a.total() + b.total(),
        n as f64 / secs,
        a.full + b.full,
        a.partial + b.partial,
        a.miss + b.miss
    );
    println!(
        "  growth over the second half {:+.1} MiB; RSS outside the arena {:.1} MiB (bar <= 64 MiB) {}",
        (r2.outside as f64 - r1.outside as f64) / MIB,
        r2.outside as f64 / MIB,
        verdict(r2.outside <= 64 << 20)
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let full = args.iter().any(|a| a == "--bench");
    // Positional arguments pick sections: round_trips, saturation, rss.
    let picked: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .map(String::as_str)
        .collect();
    let run = |section: &str| picked.is_empty() || picked.contains(&section);
    if !full {
        println!("(smoke run under cargo test: debug build, few iterations; figures come from `cargo bench`)");
    }
    let (n_noop, n_lookup, n_pc) = if full {
        (50_000, 5_000, 2_000)
    } else {
        (200, 20, 10)
    };
    if run("round_trips") {
        let before = echo_baseline(n_noop);
        let rt = round_trips(n_noop, n_lookup, n_pc);
        let after = echo_baseline(n_noop);
        let hop = hop_echo_baseline(n_noop);
        ratios(&rt, &before, &after, &hop);
    }

    let ok = !run("saturation")
        || if full {
            saturation(Duration::from_secs(10), GIB)
        } else {
            saturation(Duration::from_millis(300), 32 << 20)
        };

    if run("rss") {
        rss_after_lookups(if full { 1_000_000 } else { 2_000 });
    }

    if !ok {
        println!("FAILURE: requests went unanswered or were answered wrongly (see above)");
        std::process::exit(1);
    }
}
