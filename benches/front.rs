//! CPU per request of the front thread, without sockets or wake-ups: the real
//! front core (`kvshard_transport::front::Front`) is handed whole requests
//! in-process, its replies recorded, and one shard played by this bench over
//! the real mailbox (it lends write credits and answers lookups with misses;
//! nothing else the store flow sends wants a reply).
//!
//! For 2048-token requests (8 chunks of 256): noop; a store no lookup came
//! before (prepare_store to its reply and whole, with the bookkeeping after
//! the reply; commit_store; end_session); and vLLM's order, a lookup (a miss)
//! and its status query, then the worker's prepare and commit of the same
//! request. The floor printed beside them is the work lmcache's key format
//! leaves no way around, measured in the same run: the chained blake3
//! hashing of the request's chunks. The decode of the same token ids from
//! msgpack, the other per-token work of a request its session has not seen,
//! is printed beside it, and so is `--hash-algorithm sha256_cbor`'s chained
//! hashing of the same chunks, with vLLM's own (CPython, cbor2 and hashlib,
//! what lmcache server runs) timed in the same run where a Python with cbor2
//! is found: `$KVSHARD_BENCH_PYTHON`, the compat venv's, or `python3`.
//!
//! `cargo bench --bench front`; under `cargo test` it runs a few iterations.

#[path = "../tests/support/mod.rs"]
mod support;

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use hdrhistogram::Histogram;
use kvshard_engine::keys::{chunk_hashes, sha256_cbor_fallback_none_hash, TokenHasher};
use kvshard_engine::slab::Slab;
use kvshard_io::mailbox::{mailbox, notify_queue, MailboxReceiver};
use kvshard_transport::config::ServerConfig;
use kvshard_transport::front::{Clock, Front, FrontSetup, ReplyPort, Undelivered};
use kvshard_transport::messages::{
    Found, FrontEvent, ShardMsg, ShardOp, ShardReply, ShardReplyBody, NO_SLAB,
};
use kvshard_transport::msgpack::Reader;
use support::*;

const CHUNK: usize = 256;
const TOKENS: usize = 2048;
const IID: i64 = 1;

/// Counts replies and notes when the first one since the last take went out.
#[derive(Default)]
struct Replies {
    count: Cell<u64>,
    first_at: Cell<Option<Instant>>,
    last: std::cell::RefCell<Vec<u8>>,
}

struct Port(Rc<Replies>);

impl ReplyPort for Port {
    fn send(&mut self, frames: &[&[u8]]) -> Result<(), Undelivered> {
        let r = &self.0;
        if r.first_at.get().is_none() {
            r.first_at.set(Some(Instant::now()));
        }
        r.count.set(r.count.get() + 1);
        let mut last = r.last.borrow_mut();
        last.clear();
        last.extend_from_slice(frames.last().copied().unwrap_or_default());
        Ok(())
    }
}

struct Now;

impl Clock for Now {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

struct Bench {
    front: Front,
    replies: Rc<Replies>,
    shard: MailboxReceiver<ShardMsg>,
    next_offset: u64,
}

impl Bench {
    fn new() -> Bench {
        let mut cfg = ServerConfig::example();
        cfg.chunk_size = CHUNK;
        cfg.cores = vec![0];
        let (events, _) = notify_queue::<FrontEvent>();
        let setup = FrontSetup::without_arena(("kvshard_bench_front".into(), 1 << 40), events);
        let (tx, shard) = mailbox(1 << 16);
        let replies = Rc::new(Replies::default());
        let front = Front::new(
            Arc::new(cfg),
            setup,
            Box::new(Port(replies.clone())),
            Box::new(Now),
            vec![tx],
        );
        Bench {
            front,
            replies,
            shard,
            next_offset: 0,
        }
    }

    /// Hands one request to the front; returns the time to its first reply
    /// (if it came during the call) and the whole call.
    fn request(&mut self, op: i64, payloads: &[&[u8]]) -> (Option<u64>, u64) {
        let mut frames: Vec<&[u8]> = vec![b"client", b"uid"];
        let op = enc(&V::I(op));
        frames.push(&op);
        frames.extend_from_slice(payloads);
        self.replies.first_at.set(None);
        let t = Instant::now();
        self.front.on_message(frames);
        let whole = t.elapsed().as_nanos() as u64;
        let first = self
            .replies
            .first_at
            .get()
            .map(|r| (r - t).as_nanos() as u64);
        (first, whole)
    }

    /// Checks the last reply's payload.
    fn expect_last(&self, want: &V, what: &str) {
        assert_eq!(*self.replies.last.borrow(), enc(want), "reply to {what}");
    }

    /// Plays the shard until its mailbox is empty; returns the CPU the front
    /// spent on the replies.
    fn settle(&mut self) -> u64 {
        let mut front_ns = 0;
        while let Ok(msg) = self.shard.try_recv() {
            let mut fresh = |size: u64, count: usize| {
                let slabs = (0..count)
                    .map(|i| {
                        Some(Slab {
                            offset: self.next_offset + i as u64 * size,
                            len: size,
                        })
                    })
                    .collect();
                self.next_offset += count as u64 * size;
                ShardReplyBody::Slabs(slabs)
            };
            let body = match msg.op {
                ShardOp::GrantCredits { size, count } => fresh(size, count as usize),
                ShardOp::ReserveWrite { keys, sizes, .. } => fresh(sizes.group(0), keys.len()),
                ShardOp::Lookup { keys, .. } => ShardReplyBody::Found {
                    found: vec![Found::Miss; keys.len()],
                    slabs: vec![NO_SLAB; keys.len()],
                },
                _ => ShardReplyBody::Done,
            };
            if msg.seq != 0 {
                let reply = ShardReply {
                    seq: msg.seq,
                    shard: 0,
                    body,
                };
                let t = Instant::now();
                self.front.on_event(FrontEvent::Shard(reply));
                front_ns += t.elapsed().as_nanos() as u64;
            }
        }
        front_ns
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 10_000_000_000, 3).expect("bounds")
}

fn report(name: &str, h: &Histogram<u64>, floor: &Histogram<u64>) {
    println!(
        "{name:<44} n={:<7} p50={:>7.2}us p99={:>7.2}us  p50 {:>5.2}x the chunk hashing",
        h.len(),
        h.value_at_quantile(0.5) as f64 / 1e3,
        h.value_at_quantile(0.99) as f64 / 1e3,
        h.value_at_quantile(0.5) as f64 / floor.value_at_quantile(0.5) as f64
    );
}

fn tokens(seed: usize) -> Vec<u32> {
    (0..TOKENS as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ (seed as u32).wrapping_mul(40_503)) % 150_000)
        .collect()
}

/// vLLM's chained sha256_cbor over `tokens` in CPython, `n` times: the
/// per-request nanoseconds at p50, or why it could not run.
fn python_sha256_cbor_p50(tokens: &[u32], n: usize) -> Result<f64, String> {
    const SCRIPT: &str = r#"
import hashlib, sys, time, cbor2
chunk, n = int(sys.argv[1]), int(sys.argv[2])
toks = [int(t) for t in sys.stdin.read().split()]
none = hashlib.sha256(cbor2.dumps((0, (0,), None), canonical=True)).digest()
def chained():
    prefix, out = none, []
    for i in range(0, len(toks) - len(toks) % chunk, chunk):
        prefix = hashlib.sha256(cbor2.dumps((prefix, tuple(toks[i:i + chunk]), None), canonical=True)).digest()
        out.append(prefix)
    return out
ts = []
for _ in range(n):
    t = time.perf_counter_ns(); chained(); ts.append(time.perf_counter_ns() - t)
ts.sort(); print(ts[len(ts) // 2])
"#;
    use std::io::Write;
    let venv = std::env::var("HOME")
        .map(|h| format!("{h}/.cache/kvshard/lmcache-0.5.6/bin/python"))
        .unwrap_or_default();
    let candidates = std::env::var("KVSHARD_BENCH_PYTHON")
        .into_iter()
        .chain([venv, "python3".to_string()]);
    let mut why = String::from("no python found");
    for python in candidates {
        let child = std::process::Command::new(&python)
            .args(["-c", SCRIPT, &CHUNK.to_string(), &n.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn();
        let Ok(mut child) = child else { continue };
        let text: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(text.join(" ").as_bytes());
        }
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if out.status.success() {
            let p50 = String::from_utf8_lossy(&out.stdout).trim().parse::<f64>();
            return p50.map_err(|e| format!("{python}: {e}"));
        }
        why = format!(
            "{python}: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("failed")
        );
    }
    Err(why)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run under cargo test: debug build, few iterations; figures come from `cargo bench`)");
    }
    let n = if full { 20_000 } else { 20 };
    let mut b = Bench::new();
    let reg = enc(&engine_ctx_payload(
        IID,
        "bench",
        1,
        2,
        64,
        false,
        CHUNK as i64,
    ));
    b.request(OP_REGISTER_ENGINE, &[&reg]);
    assert_eq!(b.replies.count.get(), 1, "registration answered");
    let (one, empty) = (enc(&V::I(IID)), enc(&V::Bin(vec![])));
    let end = TOKENS as i64;

    let (mut floor, mut decode, mut noop) = (hist(), hist(), hist());
    let sha = TokenHasher::Sha256Cbor {
        none_hash: sha256_cbor_fallback_none_hash(),
    };
    let mut sha_hist = hist();
    let mut ids = Vec::with_capacity(TOKENS);
    let (mut prep_reply, mut prep_whole, mut commit) = (hist(), hist(), hist());
    let (mut end_session, mut lookup, mut status) = (hist(), hist(), hist());
    let (mut after_reply, mut after_commit) = (hist(), hist());
    let mut answered = 0;
    for i in 0..n {
        // Requests are encoded before the clock starts.
        let (cold, warm) = (tokens(2 * i), tokens(2 * i + 1));
        let (rid, vrid) = (format!("req{i}"), format!("vllm{i}"));
        let key = key_frame("bench", Some(0), &cold, end, &rid);
        let sched_key = key_frame("bench", None, &warm, end, &vrid);
        let worker_key = key_frame("bench", Some(0), &warm, end, &vrid);
        let (rid_frame, vrid_frame) = (enc(&s(&rid)), enc(&s(&vrid)));

        let t = Instant::now();
        let hashes = chunk_hashes(&cold, CHUNK, 0, TOKENS).expect("aligned");
        floor.record(t.elapsed().as_nanos() as u64).unwrap();
        std::hint::black_box(hashes);
        let t = Instant::now();
        let hashes = sha.chunk_hashes(&cold, CHUNK, 0, TOKENS).expect("aligned");
        sha_hist.record(t.elapsed().as_nanos() as u64).unwrap();
        std::hint::black_box(hashes);

        let array = enc_tokens(&cold);
        ids.clear();
        let t = Instant::now();
        let mut r = Reader::new(&array);
        let n = r.read_array_len().expect("an array");
        r.read_u32_elements(n, &mut ids).expect("token ids");
        decode.record(t.elapsed().as_nanos() as u64).unwrap();
        assert_eq!(ids, cold, "decoded ids");

        let (_, whole) = b.request(OP_NOOP, &[]);
        noop.record(whole).unwrap();

        // A store no lookup came before: the front decodes and hashes its
        // tokens.
        let before = b.replies.count.get();
        let (first, whole) = b.request(OP_PREPARE_STORE, &[&key, &one]);
        let shard_ns = b.settle();
        match first {
            // Served from the credits the shard lent.
            Some(first) => {
                prep_reply.record(first).unwrap();
                prep_whole.record(whole).unwrap();
            }
            // Credits ran short: the shard was asked, and answered.
            None => prep_whole.record(whole + shard_ns).unwrap(),
        }
        let (_, whole) = b.request(OP_COMMIT_STORE, &[&key, &one, &empty]);
        commit.record(whole).unwrap();
        b.expect_last(&V::B(true), &rid);
        b.settle();
        let (_, whole) = b.request(OP_END_SESSION, &[&rid_frame]);
        end_session.record(whole).unwrap();
        b.settle();

        // vLLM's order: the scheduler's lookup (all misses: the shard keeps
        // nothing) with the shard reply's handling, its status, then the
        // worker's store of the same request.
        let (_, whole) = b.request(OP_LOOKUP, &[&sched_key, &one]);
        let shard_ns = b.settle();
        lookup.record(whole + shard_ns).unwrap();
        let (_, whole) = b.request(OP_QUERY_PREFETCH_STATUS, &[&vrid_frame]);
        status.record(whole).unwrap();
        b.expect_last(&V::I(0), &vrid);
        if let (Some(first), _) = b.request(OP_PREPARE_STORE, &[&worker_key, &one]) {
            after_reply.record(first).unwrap();
        }
        b.settle();
        let (_, whole) = b.request(OP_COMMIT_STORE, &[&worker_key, &one, &empty]);
        after_commit.record(whole).unwrap();
        b.expect_last(&V::B(true), &vrid);
        b.request(OP_END_SESSION, &[&vrid_frame]);
        b.settle();
        answered += b.replies.count.get() - before;
    }
    // Each round: prepare, commit, end; lookup, status, prepare, commit, end.
    assert_eq!(answered, 8 * n as u64, "every request answered");

    report("chained chunk hashing (the floor)", &floor, &floor);
    report(
        "  the same, --hash-algorithm sha256_cbor",
        &sha_hist,
        &floor,
    );
    match python_sha256_cbor_p50(&tokens(0), if full { 2_000 } else { 5 }) {
        Ok(p50) => println!(
            "{:<44} p50={:>7.2}us  p50 {:>5.2}x kvshard's sha256_cbor",
            "  vLLM's sha256_cbor in CPython (cbor2)",
            p50 / 1e3,
            p50 / sha_hist.value_at_quantile(0.5) as f64
        ),
        Err(why) => println!("  vLLM's sha256_cbor in CPython: not measured ({why})"),
    }
    report("msgpack decode of the 2048 token ids", &decode, &floor);
    report("noop", &noop, &floor);
    println!("a store with no lookup before it:");
    report("  prepare_store, to its reply", &prep_reply, &floor);
    report("  prepare_store, whole", &prep_whole, &floor);
    report("  commit_store", &commit, &floor);
    report("  end_session", &end_session, &floor);
    println!("vLLM's order, lookup then store of one request:");
    report(
        "  lookup (8 chunk miss), with the shard reply",
        &lookup,
        &floor,
    );
    report("  query_prefetch_status", &status, &floor);
    report("  prepare_store, to its reply", &after_reply, &floor);
    report("  commit_store", &after_commit, &floor);
    println!(
        "prepare_stores served from write credits: {} of {}",
        prep_reply.len() + after_reply.len(),
        2 * n
    );
}
