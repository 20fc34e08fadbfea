//! `kvshard loadgen`: the traffic of N vLLM instances on the lmcache 0.5.6
//! wire, against kvshard or `lmcache server` alike.
//!
//! Each instance is a thread with its own DEALER socket. It registers its TP
//! ranks as engine_driven workers, maps the L1 pool the server advertises,
//! and then runs requests the way vLLM's connector does: the scheduler's
//! LOOKUP and prefetch status, every rank's PREPARE/COMMIT_RETRIEVE of the
//! hit prefix (each byte checked), every writing rank's PREPARE/COMMIT_STORE
//! of the rest, END_SESSION.
//!
//! Prompts: `--system-prompts` shared system prompts, and `--prompts` prompts
//! that each start with one of them; a request picks a prompt from a Zipf
//! distribution (`--zipf`). A chunk's bytes are a function of its token
//! prefix and its rank, so any chunk read back can be checked, whoever
//! stored it.
//!
//! Closed loop by default (each instance sends its next request when the
//! last one finished); `--rate R` runs open loop at R requests/s over all
//! instances, latencies counted from each request's scheduled start.
//! Percentiles come from hdrhistogram; the exit status is 1 when a byte read
//! back was wrong or a request went unanswered.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvshard_io::termination;
use kvshard_transport::msgpack::{decode_value, Value, Writer};
use kvshard_transport::wire::Op;

const OP_REGISTER_KV_CACHE: i64 = Op::RegisterKvCache.id();
const OP_UNREGISTER_KV_CACHE: i64 = Op::UnregisterKvCache.id();
const OP_STORE: i64 = Op::Store.id();
const OP_RETRIEVE: i64 = Op::Retrieve.id();
const OP_LOOKUP: i64 = Op::Lookup.id();
const OP_QUERY_PREFETCH_STATUS: i64 = Op::QueryPrefetchStatus.id();
const OP_END_SESSION: i64 = Op::EndSession.id();
const OP_REGISTER_ENGINE: i64 = Op::RegisterKvCacheEngineDrivenContext.id();
const OP_UNREGISTER_ENGINE: i64 = Op::UnregisterKvCacheEngineDrivenContext.id();
const OP_PREPARE_STORE: i64 = Op::PrepareStore.id();
const OP_COMMIT_STORE: i64 = Op::CommitStore.id();
const OP_PREPARE_RETRIEVE: i64 = Op::PrepareRetrieve.id();
const OP_COMMIT_RETRIEVE: i64 = Op::CommitRetrieve.id();
const OP_GET_CHUNK_SIZE: i64 = Op::GetChunkSize.id();
const OP_PING: i64 = Op::Ping.id();

/// `kvshard loadgen` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadgenArgs {
    /// The server's ZeroMQ endpoint (kvshard or `lmcache server`).
    #[arg(long, default_value = "tcp://127.0.0.1:5555")]
    pub url: String,
    /// vLLM instances, one thread and one socket each.
    #[arg(long, default_value_t = 8)]
    pub instances: usize,
    /// How the instances move KV bytes: engine_driven (each worker copies to
    /// and from the server's shared L1 pool) or lmcache_driven (the server
    /// copies between the L1 and the worker's KV cache, registered as POSIX
    /// shm segments with cpu_shm descriptors, as a CPU vLLM worker does).
    #[arg(long, value_parser = ["engine_driven", "lmcache_driven"], default_value = "engine_driven")]
    pub transfer_mode: String,
    /// Tensor-parallel ranks per instance.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// MLA models: the ranks share one KV rank, rank 0 stores and every rank reads.
    #[arg(long)]
    pub mla: bool,
    /// How long to send requests, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Requests per second over all instances (open loop); 0 runs closed loop.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Distinct prompts.
    #[arg(long, default_value_t = 256)]
    pub prompts: usize,
    /// Zipf exponent of prompt popularity (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Tokens per prompt, the system prompt included (whole chunks are stored).
    #[arg(long, default_value_t = 2048)]
    pub prompt_tokens: usize,
    /// Distinct system prompts the prompts start with.
    #[arg(long, default_value_t = 4)]
    pub system_prompts: usize,
    /// Tokens of each system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_prompt_tokens: usize,
    /// Model layers (the chunk object is [2, layers, chunk, hidden] float16).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Hidden size per token and layer, in elements.
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Store every prompt once first (untimed), then send only lookups
    /// (LOOKUP, prefetch status, END_SESSION): the scheduler's side alone.
    #[arg(long)]
    pub lookup_only: bool,
    /// Model name the instances register.
    #[arg(long, default_value = "loadgen")]
    pub model: String,
    /// Instance id of the first rank of the first instance; ranks and
    /// instances count up from it (give concurrent load generators apart ranges).
    #[arg(long, default_value_t = 1000)]
    pub first_instance_id: i64,
    /// Seed of the prompts, the popularity draws and the chunk bytes.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How long to wait for any reply, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Every rank sends `ping(instance_id)` this often, between requests, as a
    /// vLLM worker's heartbeat does (0: never). A server reaps a registration
    /// that has pinged and then stays silent, releasing what it held.
    #[arg(long, default_value_t = 10.0)]
    pub heartbeat_seconds: f64,
    /// Output: text or json.
    #[arg(long, value_parser = ["text", "json"], default_value = "text")]
    pub format: String,
}

/// Runs the load and prints the report; the process exit status. SIGINT or
/// SIGTERM ends the timed phase early: the report covers what ran, and the
/// KV caches' shm segments are removed as at a normal end.
pub fn run(args: LoadgenArgs) -> i32 {
    termination::catch_signals();
    match Load::new(args).and_then(Load::run) {
        Ok(report) => report.exit_code(),
        Err(e) => {
            eprintln!("kvshard loadgen: {e}");
            2
        }
    }
}

// ------------------------------------------------------------------ prompts

/// splitmix64: the seed mixer for tokens, draws and chunk bytes.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// One prompt: its tokens and, per whole chunk, a digest of the tokens up to
/// the chunk's end (chunks with the same prefix have the same digest).
struct Prompt {
    tokens: Vec<u32>,
    chunk_digest: Vec<u64>,
}

fn prompts(a: &LoadgenArgs, chunk: usize) -> Vec<Prompt> {
    let sys_len = a.system_prompt_tokens.min(a.prompt_tokens);
    (0..a.prompts)
        .map(|p| {
            let sys = (p % a.system_prompts.max(1)) as u64;
            let tokens: Vec<u32> = (0..a.prompt_tokens)
                .map(|i| {
                    let x = if i < sys_len {
                        mix(a.seed ^ (sys << 40) ^ i as u64)
                    } else {
                        mix(a.seed ^ 0x5151 ^ ((p as u64) << 32) ^ i as u64)
                    };
                    (x % 50_000) as u32
                })
                .collect();
            let mut d = mix(a.seed ^ 0xd1ce);
            let chunk_digest = tokens
                .chunks_exact(chunk)
                .map(|c| {
                    for &t in c {
                        d = mix(d ^ u64::from(t));
                    }
                    d
                })
                .collect();
            Prompt {
                tokens,
                chunk_digest,
            }
        })
        .collect()
}

/// Draws prompt indices with P(k) proportional to 1 / (k + 1)^s.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n)
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    fn draw(&self, rng: &mut u64) -> usize {
        *rng = mix(*rng);
        let u = (*rng >> 11) as f64 / (1u64 << 53) as f64;
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// The bytes of a chunk: a function of its prefix digest and rank.
fn fill_chunk(out: &mut [u8], digest: u64, rank: u64) {
    let mut x = mix(digest ^ rank.wrapping_mul(0xa076_1d64_78bd_642f));
    let mut words = out.chunks_exact_mut(8);
    for w in &mut words {
        x = mix(x);
        w.copy_from_slice(&x.to_le_bytes());
    }
    let rest = words.into_remainder();
    let tail = mix(x).to_le_bytes();
    rest.copy_from_slice(&tail[..rest.len()]);
}

/// Whether `got` holds the bytes of that chunk, without allocating.
fn chunk_ok(got: &[u8], digest: u64, rank: u64) -> bool {
    let mut x = mix(digest ^ rank.wrapping_mul(0xa076_1d64_78bd_642f));
    let mut words = got.chunks_exact(8);
    for w in &mut words {
        x = mix(x);
        if w != x.to_le_bytes() {
            return false;
        }
    }
    let rest = words.remainder();
    rest == &mix(x).to_le_bytes()[..rest.len()]
}

// ------------------------------------------------------------------ wire

/// Why a call failed: no reply in time, or a reply that is not the protocol's.
#[derive(Debug)]
enum CallError {
    Timeout(i64),
    Bad(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Timeout(op) => write!(f, "no reply to op {op} in time"),
            CallError::Bad(e) => f.write_str(e),
        }
    }
}

struct Conn {
    sock: zmq::Socket,
    uid: i64,
}

fn enc_int(v: i64) -> Vec<u8> {
    let mut w = Writer::new();
    w.write_int(v);
    w.into_vec()
}

impl Conn {
    fn open(ctx: &zmq::Context, url: &str, timeout_ms: u64) -> Result<Conn, String> {
        let sock = ctx
            .socket(zmq::DEALER)
            .map_err(|e| format!("socket: {e}"))?;
        let t = i32::try_from(timeout_ms).unwrap_or(i32::MAX);
        sock.set_linger(0).map_err(|e| e.to_string())?;
        sock.set_rcvtimeo(t).map_err(|e| e.to_string())?;
        sock.set_sndtimeo(t).map_err(|e| e.to_string())?;
        sock.connect(url)
            .map_err(|e| format!("connecting to {url}: {e}"))?;
        Ok(Conn { sock, uid: 0 })
    }

    /// Sends op `op` with msgpack payload frames and returns the reply's
    /// payload (None when the reply has none).
    fn call(&mut self, op: i64, payload: &[Vec<u8>]) -> Result<Option<Value>, CallError> {
        self.uid += 1;
        let uid = self.uid;
        let mut frames: Vec<&[u8]> = Vec::with_capacity(payload.len() + 2);
        let (u, o) = (enc_int(uid), enc_int(op));
        frames.push(&u);
        frames.push(&o);
        frames.extend(payload.iter().map(Vec::as_slice));
        self.sock
            .send_multipart(frames, 0)
            .map_err(|_| CallError::Timeout(op))?;
        loop {
            let reply = self
                .sock
                .recv_multipart(0)
                .map_err(|_| CallError::Timeout(op))?;
            if reply.len() < 2 {
                return Err(CallError::Bad(format!(
                    "op {op}: a reply of {} frame(s)",
                    reply.len()
                )));
            }
            let got = decode_value(&reply[0]).ok().and_then(|v| v.as_i64());
            if got != Some(uid) {
                // A late reply to a request that timed out: skip it.
                continue;
            }
            return match reply.get(2) {
                None => Ok(None),
                Some(p) => decode_value(p)
                    .map(Some)
                    .map_err(|e| CallError::Bad(format!("op {op}: undecodable reply: {e}"))),
            };
        }
    }
}

/// An `IPCCacheEngineKey` as lmcache 0.5.6's client encodes it.
#[allow(clippy::too_many_arguments)]
fn key(
    model: &str,
    ws: usize,
    worker: Option<usize>,
    tokens: &[u32],
    end: usize,
    rid: &str,
    readers: usize,
) -> Vec<u8> {
    let mut w = Writer::with_capacity(16 + tokens.len() * 3);
    w.write_map_len(10);
    w.write_str("model_name");
    w.write_str(model);
    w.write_str("world_size");
    w.write_uint(ws as u64);
    w.write_str("worker_id");
    match worker {
        Some(r) => w.write_uint(r as u64),
        None => w.write_nil(),
    }
    w.write_str("token_ids");
    w.write_array_len(tokens.len());
    for &t in tokens {
        w.write_uint(u64::from(t));
    }
    w.write_str("start");
    w.write_uint(0);
    w.write_str("end");
    w.write_uint(end as u64);
    w.write_str("request_id");
    w.write_str(rid);
    w.write_str("cache_salt");
    w.write_str("");
    w.write_str("request_configs");
    w.write_nil();
    w.write_str("num_kv_readers");
    w.write_uint(readers as u64);
    w.into_vec()
}

/// The (offset, length) slots of a prepare reply's `context`.
fn slots(reply: &Value) -> Result<Vec<(usize, usize)>, String> {
    let Some(Value::Array(list)) = reply.get("context").and_then(|c| c.get("slots")) else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|s| {
            let off = s.get("offset").and_then(Value::as_i64);
            let len = s.get("length").and_then(Value::as_i64);
            match (off, len) {
                (Some(o), Some(l)) if o >= 0 && l >= 0 => Ok((o as usize, l as usize)),
                _ => Err(format!("a slot without offset/length: {s:?}")),
            }
        })
        .collect()
}

fn chunk_indices(reply: &Value) -> Vec<usize> {
    match reply.get("context").and_then(|c| c.get("chunk_indices")) {
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(Value::as_i64)
            .map(|i| i as usize)
            .collect(),
        _ => Vec::new(),
    }
}

// ------------------------------------------------------------------ the pool

/// A POSIX shm segment (the server's L1 pool, or a layer of a worker's KV
/// cache), mapped read-write and shared.
struct Pool {
    map: memmap2::MmapMut,
}

impl Pool {
    fn map(name: &str, len: usize) -> Result<Pool, String> {
        let path = format!("/dev/shm/{}", name.trim_start_matches('/'));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("opening {path}: {e}"))?;
        // SAFETY: the segment is shared with the server, which writes only the
        // slots it hands out and reads only those it is told to; this process
        // never shrinks the file while it is mapped.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file) }
            .map_err(|e| format!("mapping {len} bytes of {path}: {e}"))?;
        Ok(Pool { map })
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn slot(&mut self, off: usize, len: usize) -> Result<&mut [u8], String> {
        let pool = self.map.len();
        off.checked_add(len)
            .and_then(|end| self.map.get_mut(off..end))
            .ok_or_else(|| format!("slot {off}+{len} outside the {pool}-byte pool"))
    }
}

// ------------------------------------------------------------------ a worker's KV cache

/// Tokens per paged block of the lmcache_driven workers (vLLM's default).
const KV_BLOCK_TOKENS: usize = 16;
/// Head size of the lmcache_driven workers' layers; `--hidden` heads of it.
const KV_HEAD_SIZE: usize = 64;

/// One lmcache_driven rank's KV cache: a float16 paged buffer per layer in a
/// POSIX shm segment of its own, `[2, blocks, 16, heads, 64]` (vLLM's NHD
/// flash layout) or `[blocks, 16, hidden]` for MLA.
struct KvCache {
    names: Vec<String>,
    layers: Vec<Pool>,
    planes: usize,
    blocks: usize,
    /// Bytes of one (plane, block).
    block_bytes: usize,
}

impl KvCache {
    fn create(tag: &str, a: &LoadgenArgs, blocks: usize) -> Result<KvCache, String> {
        let planes = if a.mla { 1 } else { 2 };
        let block_bytes = KV_BLOCK_TOKENS * a.hidden * 2;
        let len = planes * blocks * block_bytes;
        let mut names = Vec::new();
        let mut layers = Vec::new();
        for l in 0..a.layers {
            let name = format!("kvshard_loadgen_{}_{tag}_{l}", std::process::id());
            let path = format!("/dev/shm/{name}");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| format!("creating {path}: {e}"))?;
            names.push(name.clone());
            file.set_len(len as u64)
                .map_err(|e| format!("sizing {path}: {e}"))?;
            layers.push(Pool::map(&name, len)?);
        }
        Ok(KvCache {
            names,
            layers,
            planes,
            blocks,
            block_bytes,
        })
    }

    /// The cpu_shm descriptor of layer `l`: the msgpack map 0.5.6 wraps in
    /// ext type 1.
    fn descriptor(&self, l: usize, a: &LoadgenArgs) -> Vec<u8> {
        let (shape, stride): (Vec<u64>, Vec<u64>) = if a.mla {
            let (nb, bs, h) = (self.blocks as u64, KV_BLOCK_TOKENS as u64, a.hidden as u64);
            (vec![nb, bs, h], vec![bs * h, h, 1])
        } else {
            let (nb, bs) = (self.blocks as u64, KV_BLOCK_TOKENS as u64);
            let (nh, hs) = ((a.hidden / KV_HEAD_SIZE) as u64, KV_HEAD_SIZE as u64);
            (
                vec![2, nb, bs, nh, hs],
                vec![nb * bs * nh * hs, bs * nh * hs, nh * hs, hs, 1],
            )
        };
        let mut inner = Writer::new();
        inner.write_map_len(5);
        inner.write_str("type");
        inner.write_str("cpu_shm");
        inner.write_str("shm_name");
        inner.write_str(&format!("/{}", self.names[l]));
        inner.write_str("nbytes");
        inner.write_uint(self.layers[l].len() as u64);
        inner.write_str("version");
        inner.write_uint(1);
        inner.write_str("metadata");
        inner.write_map_len(5);
        inner.write_str("dtype");
        inner.write_str("float16");
        for (field, dims) in [("shape", &shape), ("stride", &stride)] {
            inner.write_str(field);
            inner.write_array_len(dims.len());
            for &d in dims {
                inner.write_uint(d);
            }
        }
        inner.write_str("storage_offset");
        inner.write_uint(0);
        inner.write_str("device_uuid");
        inner.write_str("cpu");
        inner.into_vec()
    }

    /// (layer, plane, block) as a slice.
    fn block(&mut self, l: usize, plane: usize, b: usize) -> &mut [u8] {
        let at = (plane * self.blocks + b) * self.block_bytes;
        let len = self.block_bytes;
        self.layers[l]
            .slot(at, len)
            .expect("blocks lie inside their layer")
    }

    /// The seed of one block's bytes: its chunk's prefix digest, its place
    /// in the chunk, its layer and plane.
    fn block_digest(chunk_digest: u64, nth: usize, l: usize, plane: usize) -> u64 {
        mix(chunk_digest ^ ((nth as u64) << 20) ^ ((l as u64) << 40) ^ ((plane as u64) << 56))
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = std::fs::remove_file(format!("/dev/shm/{n}"));
        }
    }
}

/// What an instance moves bytes through.
enum Mem {
    /// engine_driven: the server's L1 pool, mapped.
    Pool(Pool),
    /// lmcache_driven: each rank's own KV cache.
    Kv(Vec<KvCache>),
}

/// The frames of REGISTER_KV_CACHE for one lmcache_driven rank.
fn register_kv_cache_frames(iid: i64, kv: &KvCache, a: &LoadgenArgs, ws: usize) -> Vec<Vec<u8>> {
    let mut descs = Writer::new();
    descs.write_array_len(a.layers);
    for l in 0..a.layers {
        descs.write_ext(1, &kv.descriptor(l, a));
    }
    let mut layout = Writer::new();
    layout.write_map_len(1);
    layout.write_str("kv_layout");
    layout.write_str("NHD");
    let mut groups = Writer::new();
    groups.write_array_len(1);
    groups.write_map_len(6);
    groups.write_str("engine_group_id");
    groups.write_uint(0);
    groups.write_str("layer_indices");
    groups.write_array_len(a.layers);
    for l in 0..a.layers {
        groups.write_uint(l as u64);
    }
    groups.write_str("tokens_per_block");
    groups.write_uint(KV_BLOCK_TOKENS as u64);
    groups.write_str("sw_size_tokens");
    groups.write_int(-1);
    groups.write_str("extra_object_group_tag");
    groups.write_uint(0);
    groups.write_str("recurrent_state");
    groups.write_bool(false);
    vec![
        enc_int(iid),
        descs.into_vec(),
        enc_str(&a.model),
        enc_int(ws as i64),
        enc_str("vllm"),
        layout.into_vec(),
        groups.into_vec(),
    ]
}

/// `[[ids...]]`: the block ids of the one KV group.
fn block_ids(ids: impl ExactSizeIterator<Item = usize>) -> Vec<u8> {
    let mut w = Writer::new();
    w.write_array_len(1);
    w.write_array_len(ids.len());
    for b in ids {
        w.write_uint(b as u64);
    }
    w.into_vec()
}

/// STORE/RETRIEVE's `(event, ok)` reply: ok.
fn transfer_ok(reply: Option<Value>) -> Result<bool, CallError> {
    match reply {
        Some(Value::Array(a)) if a.len() == 2 => Ok(a[1].as_bool() == Some(true)),
        other => Err(CallError::Bad(format!("a transfer answered {other:?}"))),
    }
}

// ------------------------------------------------------------------ stats

const OPS: [&str; 4] = ["lookup+status", "retrieve", "store", "request"];

struct Stats {
    hist: Vec<Histogram<u64>>,
    requests: u64,
    hit_chunks: u64,
    stored_chunks: u64,
    bytes_read: u64,
    bytes_written: u64,
    wrong_chunks: u64,
    failed: u64,
    unanswered: u64,
    first_error: Option<String>,
}

impl Stats {
    fn new() -> Stats {
        Stats {
            hist: OPS
                .iter()
                .map(|_| Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds"))
                .collect(),
            requests: 0,
            hit_chunks: 0,
            stored_chunks: 0,
            bytes_read: 0,
            bytes_written: 0,
            wrong_chunks: 0,
            failed: 0,
            unanswered: 0,
            first_error: None,
        }
    }

    fn record(&mut self, op: usize, d: Duration) {
        let us = (d.as_micros() as u64).clamp(1, 60_000_000);
        let _ = self.hist[op].record(us);
    }

    fn error(&mut self, e: String) {
        self.failed += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }

    fn merge(&mut self, o: &Stats) {
        for (a, b) in self.hist.iter_mut().zip(&o.hist) {
            let _ = a.add(b);
        }
        self.requests += o.requests;
        self.hit_chunks += o.hit_chunks;
        self.stored_chunks += o.stored_chunks;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.wrong_chunks += o.wrong_chunks;
        self.failed += o.failed;
        self.unanswered += o.unanswered;
        if self.first_error.is_none() {
            self.first_error.clone_from(&o.first_error);
        }
    }
}

// ------------------------------------------------------------------ the run

struct Load {
    args: LoadgenArgs,
    chunk: usize,
    prompts: Arc<Vec<Prompt>>,
}

struct Report {
    stats: Stats,
    elapsed: Duration,
    args: LoadgenArgs,
    chunk: usize,
}

impl Load {
    fn new(args: LoadgenArgs) -> Result<Load, String> {
        if args.transfer_mode == "lmcache_driven" && args.hidden % KV_HEAD_SIZE != 0 {
            return Err(format!(
                "--hidden must be a multiple of {KV_HEAD_SIZE} (the head size) for lmcache_driven"
            ));
        }
        if args.instances == 0 || args.tp == 0 || args.prompts == 0 {
            return Err("--instances, --tp and --prompts must be at least 1".into());
        }
        let duration_ok = args.duration.is_finite() && args.duration > 0.0;
        if !duration_ok || args.rate < 0.0 || !args.rate.is_finite() {
            return Err("--duration must be positive and --rate at least 0".into());
        }
        let ctx = zmq::Context::new();
        let mut c = Conn::open(&ctx, &args.url, args.timeout_ms)?;
        let chunk = match c.call(OP_GET_CHUNK_SIZE, &[]) {
            Ok(Some(v)) => v
                .as_i64()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("GET_CHUNK_SIZE answered {v:?}"))?
                as usize,
            Ok(None) => return Err("GET_CHUNK_SIZE answered without a payload".into()),
            Err(e) => return Err(format!("asking {} for its chunk size: {e}", args.url)),
        };
        if args.prompt_tokens < chunk {
            return Err(format!(
                "--prompt-tokens {} is less than one chunk ({chunk} tokens)",
                args.prompt_tokens
            ));
        }
        let prompts = Arc::new(prompts(&args, chunk));
        Ok(Load {
            args,
            chunk,
            prompts,
        })
    }

    fn run(self) -> Result<Report, String> {
        let ctx = zmq::Context::new();
        let total = Arc::new(Mutex::new(Stats::new()));
        let timed = Arc::new(Mutex::new(Duration::ZERO));
        let barrier = Arc::new(Barrier::new(self.args.instances));
        let abort = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for i in 0..self.args.instances {
            let inst = Instance {
                index: i,
                args: self.args.clone(),
                chunk: self.chunk,
                prompts: self.prompts.clone(),
                ctx: ctx.clone(),
            };
            let (total, timed, barrier, abort) =
                (total.clone(), timed.clone(), barrier.clone(), abort.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("loadgen-{i}"))
                    .spawn(move || {
                        let (s, d) = inst.run(&barrier, &abort);
                        total.lock().unwrap_or_else(|p| p.into_inner()).merge(&s);
                        let mut t = timed.lock().unwrap_or_else(|p| p.into_inner());
                        *t = (*t).max(d);
                    })
                    .map_err(|e| format!("starting a thread: {e}"))?,
            );
        }
        for t in threads {
            let _ = t.join();
        }
        if termination::requested() {
            eprintln!(
                "kvshard loadgen: interrupted; the report covers the requests sent until then"
            );
        }
        let stats = std::mem::replace(
            &mut *total.lock().unwrap_or_else(|p| p.into_inner()),
            Stats::new(),
        );
        let elapsed = *timed.lock().unwrap_or_else(|p| p.into_inner());
        let report = Report {
            stats,
            elapsed,
            args: self.args,
            chunk: self.chunk,
        };
        report.print();
        Ok(report)
    }
}

/// When an instance's ranks ping next.
struct Heartbeat {
    every: Option<Duration>,
    next: Instant,
}

impl Heartbeat {
    fn new(seconds: f64) -> Heartbeat {
        let every = (seconds > 0.0).then(|| Duration::from_secs_f64(seconds));
        // The first beat goes out with the first request.
        Heartbeat {
            every,
            next: Instant::now(),
        }
    }

    /// How long until the next beat (a long time when there is none).
    fn until_due(&self) -> Duration {
        match self.every {
            Some(_) => self.next.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(3600),
        }
    }

    /// Pings if a beat is due. A ping that fails is reported once; the next
    /// beat tries again.
    fn beat(&mut self, inst: &Instance, conn: &mut Conn, stats: &mut Stats) {
        let Some(every) = self.every else { return };
        let now = Instant::now();
        if now < self.next {
            return;
        }
        self.next = now + every;
        inst.ping(conn, stats);
    }
}

struct Instance {
    index: usize,
    args: LoadgenArgs,
    chunk: usize,
    prompts: Arc<Vec<Prompt>>,
    ctx: zmq::Context,
}

impl Instance {
    /// Worker instance id of rank `r`.
    fn iid(&self, r: usize) -> i64 {
        self.args.first_instance_id + (self.index * self.args.tp + r) as i64
    }

    /// World size the keys and registrations carry.
    fn ws(&self) -> usize {
        if self.args.mla {
            1
        } else {
            self.args.tp
        }
    }

    /// Sets up, warms up, waits for every instance, then sends requests
    /// for `--duration`; its stats and how long its timed phase lasted.
    fn run(&self, barrier: &Barrier, abort: &AtomicBool) -> (Stats, Duration) {
        let mut stats = Stats::new();
        let set_up = self.set_up().and_then(|(mut conn, mut mem)| {
            if self.args.lookup_only {
                // Untimed: this instance's share of the prompts, stored once.
                let mut scratch = Stats::new();
                for p in (self.index..self.prompts.len()).step_by(self.args.instances) {
                    let rid = format!("lg{}-{}-warm{p}", std::process::id(), self.index);
                    self.request(&mut conn, &mut mem, p, &rid, &mut scratch)
                        .map_err(|e| format!("warming up: {e}"))?;
                    let _ = conn.call(OP_END_SESSION, &[enc_str(&rid)]);
                }
                if let Some(e) = scratch.first_error {
                    return Err(format!("warming up: {e}"));
                }
            }
            Ok((conn, mem))
        });
        // Every instance reaches the barrier exactly once, set up or not.
        barrier.wait();
        let (mut conn, mut mem) = match set_up {
            Ok(v) => v,
            Err(e) => {
                stats.error(format!("instance {}: {e}", self.index));
                abort.store(true, Ordering::Relaxed);
                return (stats, Duration::ZERO);
            }
        };
        let started = Instant::now();
        let stop_at = started + Duration::from_secs_f64(self.args.duration);
        let zipf = Zipf::new(self.prompts.len(), self.args.zipf);
        let mut rng = mix(self.args.seed ^ ((self.index as u64 + 1) << 48));
        let gap = (self.args.rate > 0.0)
            .then(|| Duration::from_secs_f64(self.args.instances as f64 / self.args.rate));
        // Open loop: instance i starts at its share of the first gap.
        let mut next = Instant::now()
            + gap.map_or(Duration::ZERO, |g| {
                g.mul_f64(self.index as f64 / self.args.instances as f64)
            });
        let mut n = 0u64;
        let mut heartbeat = Heartbeat::new(self.args.heartbeat_seconds);
        let stopped = || abort.load(Ordering::Relaxed) || termination::requested();
        while Instant::now() < stop_at && !stopped() {
            heartbeat.beat(self, &mut conn, &mut stats);
            let scheduled = match gap {
                Some(g) => {
                    while next > Instant::now() && !stopped() {
                        let wait = next - Instant::now();
                        std::thread::sleep(wait.min(heartbeat.until_due()));
                        heartbeat.beat(self, &mut conn, &mut stats);
                    }
                    let s = next;
                    next += g;
                    s
                }
                None => Instant::now(),
            };
            if scheduled >= stop_at {
                break;
            }
            let p = zipf.draw(&mut rng);
            let rid = format!("lg{}-{}-{n}", std::process::id(), self.index);
            n += 1;
            let outcome = if self.args.lookup_only {
                self.lookup(&mut conn, p, &rid, &mut stats).map(|_| ())
            } else {
                self.request(&mut conn, &mut mem, p, &rid, &mut stats)
            };
            match outcome {
                Ok(()) => {
                    stats.requests += 1;
                    stats.record(3, scheduled.elapsed());
                }
                Err(CallError::Timeout(op)) => {
                    stats.unanswered += 1;
                    stats.error(format!(
                        "instance {}: request {rid}: no reply to op {op} within {} ms",
                        self.index, self.args.timeout_ms
                    ));
                    // The socket may hold a late reply: start a fresh one.
                    match Conn::open(&self.ctx, &self.args.url, self.args.timeout_ms) {
                        Ok(c) => conn = c,
                        Err(_) => break,
                    }
                }
                Err(CallError::Bad(e)) => {
                    stats.error(format!("instance {}: request {rid}: {e}", self.index))
                }
            }
            let _ = conn.call(OP_END_SESSION, &[enc_str(&rid)]);
        }
        let timed = started.elapsed();
        let unregister = match mem {
            Mem::Pool(_) => OP_UNREGISTER_ENGINE,
            Mem::Kv(_) => OP_UNREGISTER_KV_CACHE,
        };
        for r in 0..self.args.tp {
            let _ = conn.call(unregister, &[enc_int(self.iid(r))]);
        }
        (stats, timed)
    }

    /// `ping(instance_id)` for every rank, stopping at (and recording) the
    /// first that is not answered True.
    fn ping(&self, conn: &mut Conn, stats: &mut Stats) {
        for r in 0..self.args.tp {
            let iid = self.iid(r);
            let problem = match conn.call(OP_PING, &[enc_int(iid)]) {
                Ok(Some(Value::Bool(true))) => continue,
                Ok(other) => format!("answered {other:?}"),
                Err(CallError::Timeout(_)) => {
                    stats.unanswered += 1;
                    format!("no reply within {} ms", self.args.timeout_ms)
                }
                Err(CallError::Bad(e)) => e,
            };
            stats.error(format!("instance {}: ping({iid}): {problem}", self.index));
            return;
        }
    }

    fn set_up(&self) -> Result<(Conn, Mem), String> {
        if self.args.transfer_mode == "lmcache_driven" {
            return self.set_up_lmcache_driven();
        }
        let mut conn = Conn::open(&self.ctx, &self.args.url, self.args.timeout_ms)?;
        let mut pool_info = None;
        for r in 0..self.args.tp {
            let mut w = Writer::new();
            w.write_map_len(9);
            w.write_str("instance_id");
            w.write_int(self.iid(r));
            w.write_str("model_name");
            w.write_str(&self.args.model);
            w.write_str("world_size");
            w.write_uint(self.ws() as u64);
            w.write_str("block_size");
            w.write_uint(16);
            w.write_str("num_layers");
            w.write_uint(self.args.layers as u64);
            w.write_str("hidden_dim_size");
            w.write_uint(self.args.hidden as u64);
            w.write_str("dtype_str");
            w.write_str("float16");
            w.write_str("use_mla");
            w.write_bool(self.args.mla);
            w.write_str("num_physical_slots");
            w.write_uint(self.chunk as u64);
            let reply = conn
                .call(OP_REGISTER_ENGINE, &[w.into_vec()])
                .map_err(|e| format!("registering rank {r}: {e}"))?
                .ok_or("REGISTER_ENGINE answered without a payload")?;
            let name = reply.get("shm_name").and_then(Value::as_str).unwrap_or("");
            let size = reply.get("pool_size").and_then(Value::as_i64).unwrap_or(0);
            if name.is_empty() || size <= 0 {
                return Err(format!(
                    "the server offers no shared L1 pool (shm_name {name:?}, pool_size {size}): \
                     start it with the SHM pool on"
                ));
            }
            pool_info = Some((name.to_string(), size as usize));
        }
        let (name, size) = pool_info.ok_or("no rank registered")?;
        Ok((conn, Mem::Pool(Pool::map(&name, size)?)))
    }

    /// Blocks each lmcache_driven rank has: one set to store from, one to
    /// retrieve into, and block 0 (vLLM's null block) left alone.
    fn kv_blocks(&self) -> usize {
        let per_prompt = self.args.prompt_tokens / self.chunk * self.chunk / KV_BLOCK_TOKENS;
        1 + 2 * per_prompt
    }

    fn set_up_lmcache_driven(&self) -> Result<(Conn, Mem), String> {
        if self.chunk % KV_BLOCK_TOKENS != 0 {
            return Err(format!(
                "the server's chunk size {} is not a multiple of the {KV_BLOCK_TOKENS}-token block",
                self.chunk
            ));
        }
        let mut conn = Conn::open(&self.ctx, &self.args.url, self.args.timeout_ms)?;
        let mut kvs = Vec::new();
        for r in 0..self.args.tp {
            let kv = KvCache::create(&format!("{}_{r}", self.index), &self.args, self.kv_blocks())?;
            let frames = register_kv_cache_frames(self.iid(r), &kv, &self.args, self.ws());
            conn.call(OP_REGISTER_KV_CACHE, &frames)
                .map_err(|e| format!("registering rank {r}'s KV cache: {e}"))?;
            kvs.push(kv);
        }
        Ok((conn, Mem::Kv(kvs)))
    }

    /// The scheduler's LOOKUP of prompt `p` and its prefetch status: the
    /// number of chunks hit (read-locked for the ranks until END_SESSION).
    fn lookup(
        &self,
        conn: &mut Conn,
        p: usize,
        rid: &str,
        stats: &mut Stats,
    ) -> Result<usize, CallError> {
        let prompt = &self.prompts[p];
        let chunks = prompt.chunk_digest.len();
        let end = chunks * self.chunk;
        let readers = if self.args.mla { self.args.tp } else { 1 };
        let t = Instant::now();
        let k = key(
            &self.args.model,
            self.ws(),
            None,
            &prompt.tokens[..end],
            end,
            rid,
            readers,
        );
        conn.call(OP_LOOKUP, &[k, enc_int(1)])?;
        let hits = loop {
            match conn.call(OP_QUERY_PREFETCH_STATUS, &[enc_str(rid)])? {
                Some(v) => match v.as_i64() {
                    Some(h) => break h.clamp(0, chunks as i64) as usize,
                    None => return Err(CallError::Bad(format!("prefetch status {v:?}"))),
                },
                None => std::thread::sleep(Duration::from_micros(50)),
            }
        };
        stats.record(0, t.elapsed());
        stats.hit_chunks += hits as u64;
        Ok(hits)
    }

    /// One request of prompt `p`: lookup, retrieve the hits, store the rest.
    fn request(
        &self,
        conn: &mut Conn,
        mem: &mut Mem,
        p: usize,
        rid: &str,
        stats: &mut Stats,
    ) -> Result<(), CallError> {
        match mem {
            Mem::Pool(pool) => self.request_engine_driven(conn, pool, p, rid, stats),
            Mem::Kv(kvs) => self.request_lmcache_driven(conn, kvs, p, rid, stats),
        }
    }

    /// Prompt `p`, its number of whole chunks, and their tokens.
    fn whole_chunks(&self, p: usize) -> (&Prompt, usize, &[u32]) {
        let prompt = &self.prompts[p];
        let chunks = prompt.chunk_digest.len();
        (prompt, chunks, &prompt.tokens[..chunks * self.chunk])
    }

    /// lmcache_driven: STORE/RETRIEVE name block ids of the rank's KV cache;
    /// the server copies. Hits are retrieved into the second block set and
    /// checked there; the whole prompt is written into the first set and
    /// stored.
    fn request_lmcache_driven(
        &self,
        conn: &mut Conn,
        kvs: &mut [KvCache],
        p: usize,
        rid: &str,
        stats: &mut Stats,
    ) -> Result<(), CallError> {
        let (prompt, chunks, toks) = self.whole_chunks(p);
        let end = toks.len();
        let (ws, model) = (self.ws(), &self.args.model);
        let bpc = self.chunk / KV_BLOCK_TOKENS;
        let n = chunks * bpc;
        let store_ids = || 1..1 + n;
        let retrieve_ids = || 1 + n..1 + 2 * n;
        let chunk_bytes =
            |kv: &KvCache| (kv.planes * kv.block_bytes * bpc * self.args.layers) as u64;
        let hits = self.lookup(conn, p, rid, stats)?;

        if hits > 0 {
            let t = Instant::now();
            for (r, kv) in kvs.iter_mut().enumerate() {
                let kv_rank = if self.args.mla { 0 } else { r };
                let k = key(model, ws, Some(kv_rank), toks, hits * self.chunk, rid, 1);
                let reply = conn.call(
                    OP_RETRIEVE,
                    &[
                        k,
                        enc_int(self.iid(r)),
                        block_ids(retrieve_ids().take(hits * bpc)),
                        {
                            let mut w = Writer::new();
                            w.write_bin(b"");
                            w.into_vec()
                        },
                        enc_int(0),
                    ],
                )?;
                if !transfer_ok(reply)? {
                    stats.error(format!("{rid}: retrieve of {hits} hit chunk(s) failed"));
                    continue;
                }
                for c in 0..hits {
                    let mut good = true;
                    for nth in 0..bpc {
                        let b = retrieve_ids().start + c * bpc + nth;
                        for l in 0..self.args.layers {
                            for plane in 0..kv.planes {
                                let d =
                                    KvCache::block_digest(prompt.chunk_digest[c], nth, l, plane);
                                good &= chunk_ok(kv.block(l, plane, b), d, kv_rank as u64);
                            }
                        }
                    }
                    if !good {
                        stats.wrong_chunks += 1;
                        if stats.first_error.is_none() {
                            stats.first_error = Some(format!(
                                "{rid}: chunk {c} of rank {kv_rank} read back wrong"
                            ));
                        }
                    }
                }
                stats.bytes_read += hits as u64 * chunk_bytes(kv);
            }
            stats.record(1, t.elapsed());
        }

        if hits < chunks {
            let t = Instant::now();
            let writers = if self.args.mla { 1 } else { self.args.tp };
            for (r, kv) in kvs.iter_mut().enumerate().take(writers) {
                for c in 0..chunks {
                    for nth in 0..bpc {
                        let b = store_ids().start + c * bpc + nth;
                        for l in 0..self.args.layers {
                            for plane in 0..kv.planes {
                                let d =
                                    KvCache::block_digest(prompt.chunk_digest[c], nth, l, plane);
                                fill_chunk(kv.block(l, plane, b), d, r as u64);
                            }
                        }
                    }
                }
                let k = key(model, ws, Some(r), toks, end, rid, 1);
                let mut event = Writer::new();
                event.write_bin(b"");
                let reply = conn.call(
                    OP_STORE,
                    &[
                        k,
                        enc_int(self.iid(r)),
                        block_ids(store_ids()),
                        event.into_vec(),
                    ],
                )?;
                if !transfer_ok(reply)? {
                    stats.error(format!("{rid}: store of {chunks} chunk(s) failed"));
                    continue;
                }
                stats.stored_chunks += (chunks - hits) as u64;
                stats.bytes_written += (chunks - hits) as u64 * chunk_bytes(kv);
            }
            stats.record(2, t.elapsed());
        }
        Ok(())
    }

    fn request_engine_driven(
        &self,
        conn: &mut Conn,
        pool: &mut Pool,
        p: usize,
        rid: &str,
        stats: &mut Stats,
    ) -> Result<(), CallError> {
        let (prompt, chunks, toks) = self.whole_chunks(p);
        let end = toks.len();
        let (ws, model) = (self.ws(), &self.args.model);
        let hits = self.lookup(conn, p, rid, stats)?;

        if hits > 0 {
            let t = Instant::now();
            for r in 0..self.args.tp {
                let kv_rank = if self.args.mla { 0 } else { r };
                let k = key(model, ws, Some(kv_rank), toks, hits * self.chunk, rid, 1);
                let reply = conn
                    .call(OP_PREPARE_RETRIEVE, &[k.clone(), enc_int(self.iid(r))])?
                    .ok_or_else(|| CallError::Bad("prepare_retrieve: no payload".into()))?;
                if reply.get("success").and_then(Value::as_bool) != Some(true) {
                    stats.error(format!(
                        "{rid}: prepare_retrieve of {hits} hit chunk(s) failed"
                    ));
                    continue;
                }
                let sl = slots(&reply).map_err(CallError::Bad)?;
                for (i, &(off, len)) in sl.iter().enumerate() {
                    let bytes = pool.slot(off, len).map_err(CallError::Bad)?;
                    let digest = prompt.chunk_digest.get(i).copied().unwrap_or(0);
                    if !chunk_ok(bytes, digest, kv_rank as u64) {
                        stats.wrong_chunks += 1;
                        if stats.first_error.is_none() {
                            stats.first_error = Some(format!(
                                "{rid}: chunk {i} of rank {kv_rank} read back wrong"
                            ));
                        }
                    }
                    stats.bytes_read += len as u64;
                }
                conn.call(OP_COMMIT_RETRIEVE, &[k, enc_int(self.iid(r))])?;
            }
            stats.record(1, t.elapsed());
        }

        if hits < chunks {
            let t = Instant::now();
            let writers = if self.args.mla { 1 } else { self.args.tp };
            for r in 0..writers {
                let k = key(model, ws, Some(r), toks, end, rid, 1);
                let reply = conn
                    .call(OP_PREPARE_STORE, &[k.clone(), enc_int(self.iid(r))])?
                    .ok_or_else(|| CallError::Bad("prepare_store: no payload".into()))?;
                let sl = slots(&reply).map_err(CallError::Bad)?;
                if sl.is_empty() {
                    continue; // every chunk is stored already
                }
                let idx = chunk_indices(&reply);
                if idx.len() != sl.len() {
                    return Err(CallError::Bad(format!(
                        "prepare_store: {} slots but {} chunk indices",
                        sl.len(),
                        idx.len()
                    )));
                }
                for (&(off, len), &i) in sl.iter().zip(&idx) {
                    let digest = *prompt.chunk_digest.get(i).ok_or_else(|| {
                        CallError::Bad(format!("prepare_store: chunk index {i} out of range"))
                    })?;
                    fill_chunk(
                        pool.slot(off, len).map_err(CallError::Bad)?,
                        digest,
                        r as u64,
                    );
                    stats.bytes_written += len as u64;
                    stats.stored_chunks += 1;
                }
                let mut empty = Writer::new();
                empty.write_bin(b"");
                let ok = conn.call(
                    OP_COMMIT_STORE,
                    &[k, enc_int(self.iid(r)), empty.into_vec()],
                )?;
                if ok.as_ref().and_then(Value::as_bool) != Some(true) {
                    stats.error(format!("{rid}: commit_store answered {ok:?}"));
                }
            }
            stats.record(2, t.elapsed());
        }
        Ok(())
    }
}

fn enc_str(s: &str) -> Vec<u8> {
    let mut w = Writer::new();
    w.write_str(s);
    w.into_vec()
}

impl Report {
    fn exit_code(&self) -> i32 {
        i32::from(self.stats.wrong_chunks > 0 || self.stats.unanswered > 0 || self.stats.failed > 0)
    }

    fn print(&self) {
        let s = &self.stats;
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let pct = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q);
        if self.args.format == "json" {
            let ops: serde_json::Map<String, serde_json::Value> = OPS
                .iter()
                .zip(&s.hist)
                .map(|(name, h)| {
                    (
                        name.to_string(),
                        serde_json::json!({
                            "count": h.len(),
                            "p50_us": pct(h, 0.50),
                            "p99_us": pct(h, 0.99),
                            "p999_us": pct(h, 0.999),
                            "max_us": h.max(),
                        }),
                    )
                })
                .collect();
            let v = serde_json::json!({
                "url": self.args.url,
                "instances": self.args.instances,
                "tp": self.args.tp,
                "mla": self.args.mla,
                "chunk_tokens": self.chunk,
                "seconds": secs,
                "requests": s.requests,
                "requests_per_s": s.requests as f64 / secs,
                "lookups_per_s": s.hist[0].len() as f64 / secs,
                "hit_chunks": s.hit_chunks,
                "stored_chunks": s.stored_chunks,
                "read_gb_per_s": s.bytes_read as f64 / secs / 1e9,
                "write_gb_per_s": s.bytes_written as f64 / secs / 1e9,
                "wrong_chunks": s.wrong_chunks,
                "failed": s.failed,
                "unanswered": s.unanswered,
                "first_error": s.first_error,
                "ops": ops,
            });
            println!("{v}");
            return;
        }
        println!(
            "loadgen: {} instance(s) x TP {}{} against {} for {secs:.1} s, chunks of {} tokens",
            self.args.instances,
            self.args.tp,
            if self.args.mla { " (MLA)" } else { "" },
            self.args.url,
            self.chunk
        );
        for (name, h) in OPS.iter().zip(&s.hist) {
            println!(
                "  {name:<14} n={:<8} p50={:>9}us p99={:>9}us p99.9={:>9}us max={:>9}us",
                h.len(),
                pct(h, 0.50),
                pct(h, 0.99),
                pct(h, 0.999),
                h.max()
            );
        }
        println!(
            "  throughput: {:.0} requests/s, {:.0} lookups/s, read {:.3} GB/s, written {:.3} GB/s",
            s.requests as f64 / secs,
            s.hist[0].len() as f64 / secs,
            s.bytes_read as f64 / secs / 1e9,
            s.bytes_written as f64 / secs / 1e9
        );
        let hit_rate = if s.hit_chunks + s.stored_chunks > 0 {
            s.hit_chunks as f64 / (s.hit_chunks + s.stored_chunks) as f64
        } else {
            0.0
        };
        println!(
            "  chunks: {} hit, {} stored (hit share {:.1}%); wrong bytes in {} chunk(s); {} failed, {} unanswered",
            s.hit_chunks,
            s.stored_chunks,
            100.0 * hit_rate,
            s.wrong_chunks,
            s.failed,
            s.unanswered
        );
        if let Some(e) = &s.first_error {
            println!("  first error: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_bytes_check_themselves() {
        for len in [0, 1, 7, 8, 9, 4096, 4099] {
            let mut b = vec![0u8; len];
            fill_chunk(&mut b, 42, 1);
            assert!(chunk_ok(&b, 42, 1), "len {len}");
            if len > 0 {
                assert!(
                    !chunk_ok(&b, 42, 0) || len < 8,
                    "another rank's bytes differ"
                );
                let last = b.len() - 1;
                b[last] ^= 1;
                assert!(!chunk_ok(&b, 42, 1), "a flipped byte is caught (len {len})");
            }
        }
    }

    #[test]
    fn prompts_share_their_system_prompt_chunks() {
        let a = LoadgenArgs {
            url: String::new(),
            instances: 1,
            transfer_mode: "engine_driven".into(),
            tp: 1,
            mla: false,
            duration: 1.0,
            rate: 0.0,
            prompts: 8,
            zipf: 1.0,
            prompt_tokens: 64,
            system_prompts: 2,
            system_prompt_tokens: 32,
            layers: 1,
            hidden: 8,
            lookup_only: false,
            first_instance_id: 1000,
            model: "m".into(),
            seed: 3,
            timeout_ms: 1,
            heartbeat_seconds: 0.0,
            format: "text".into(),
        };
        let p = prompts(&a, 16);
        assert_eq!(p[0].chunk_digest.len(), 4);
        // Prompts 0 and 2 share system prompt 0: the same first two chunks,
        // then their own.
        assert_eq!(p[0].chunk_digest[..2], p[2].chunk_digest[..2]);
        assert_ne!(p[0].chunk_digest[2], p[2].chunk_digest[2]);
        assert_ne!(p[0].chunk_digest[0], p[1].chunk_digest[0]);
    }

    #[test]
    fn zipf_prefers_the_first_prompts() {
        let z = Zipf::new(100, 1.0);
        let mut rng = 7;
        let mut counts = [0usize; 100];
        for _ in 0..20_000 {
            counts[z.draw(&mut rng)] += 1;
        }
        assert!(
            counts[0] > counts[9] && counts[9] > counts[99],
            "{counts:?}"
        );
        let uniform = Zipf::new(4, 0.0);
        let mut c = [0usize; 4];
        for _ in 0..8_000 {
            c[uniform.draw(&mut rng)] += 1;
        }
        assert!(c.iter().all(|&n| n > 1_500), "{c:?}");
    }
}
