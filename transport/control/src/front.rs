//! The front end: one thread that owns the ZeroMQ ROUTER socket.
//!
//! It decodes requests, keeps sessions, registrations and prefetch jobs, splits each
//! request's objects by owning shard, sends the parts to the shards' mailboxes and
//! answers the client once every part has come back. Every request gets a reply:
//! a request that fails is answered with what the 0.5.6 client reads as a failure
//! or a miss, and the cause is logged and counted.

use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_engine::keys::{self, Name, ObjectKey};
use kvshard_engine::slab::Slab;
use kvshard_gds::device::worker::{ChunkCopy, CopyDir, DeviceJob};
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_io::mailbox::{MailboxSender, NotifyReceiver, NotifySender, SendError};

use kvshard_dataplane::config::ServerConfig;
use kvshard_dataplane::cuda_refusal::{
    Alternatives, CudaGate, CudaHost, Refusal, RefusedEntry, RefusedTable,
};
use kvshard_dataplane::cuda_transfer::{CudaExecutor, CudaOp, L1Memory, PendingRegistration};
use kvshard_dataplane::layout::Layout;
use kvshard_dataplane::messages::{
    ControlBody, ControlRequest, ControlResponse, CudaEvent, FrontEvent, L2Deadline, ReplyTo,
    Responder, RetrieveItem, Seq, ShardMsg, ShardOp, ShardReply, ShardReplyBody, ShardReport,
    StoreOutcome, FOUND_L1, FOUND_L2, FOUND_MISS, NO_SLAB,
};

use crate::lookup_leases::{clamped, Grant, LeaseBook};
use crate::lookup_log::{
    LookupHashLog, LookupLogWriter, LookupRecord, SendOutcome, WRITER_QUEUE_RECORDS,
};
use crate::metrics::{FrontGauges, Metrics, PromText};
use crate::prefetch::{Job, PrefetchJobs, Waiter};
use crate::registry::{
    EngineEntry, Layouts, LmcEntry, LmcTransfer, PendingWrite, Registry, TransferKey,
};
use crate::session::{self, LookupScope, Sessions};
use crate::status::StatusSnapshot;

/// Writer tags of L2 loads (staged objects of a prefetch): `LOAD_TAG_BIT | n`.
/// Worker instance ids are writer tags too (`iid as u64`), so the ids whose
/// tags would have this bit set, the negative ones, are refused at
/// registration ([`writer_tag`] checks it at every use). vLLM's ids are
/// `uuid4 & (2^63 - 1)`: never negative, and any value below 2^63.
const LOAD_TAG_BIT: u64 = 1 << 63;

/// Writer tags of prepare_stores served from write credits:
/// `LOAD_TAG_BIT | CREDIT_TAG_BIT | n`, one per prepare (the loads' `n`
/// never reaches this bit).
const CREDIT_TAG_BIT: u64 = 1 << 62;

/// `/cache/checksums` computations running at once; one more is answered 503.
/// Each hashes a whole KV cache on a thread of its own.
const MAX_CHECKSUM_THREADS: usize = 2;

/// Test only: `KVSHARD_TEST_STOP_SHARD=N` makes the front drop its mailbox
/// sender of shard N just before its first message to it, so that the shard
/// thread ends as it does at shutdown and that message finds the mailbox
/// closed: the path of a shard thread that died. Never set in production.
const TEST_STOP_SHARD_ENV: &str = "KVSHARD_TEST_STOP_SHARD";
use kvshard_wire::{self as wire, IpcKey, Op, Request, RequestError};

/// A RETRIEVE's blocks and the worker's event.
struct Transfer {
    block_ids: Vec<Vec<i64>>,
    event: Vec<u8>,
}

/// What a CUDA RETRIEVE's shards found read-locked.
struct CudaFound {
    keys: Vec<ObjectKey>,
    slabs: Vec<Option<Slab>>,
}

/// A request waiting for its shards.
struct Inflight {
    remaining: usize,
    /// Global item indices sent to each shard, in the order sent.
    parts: Vec<Vec<usize>>,
    /// Per shard: its answer is still awaited. A part whose shard died is
    /// failed (and no longer awaited) by `Front::fail_dead_parts`.
    waiting: Vec<bool>,
    kind: InflightKind,
}

enum InflightKind {
    /// A lookup's first phase. Its ack went out when the shards were sent
    /// their parts; a status query meanwhile is held until this completes, so
    /// the client's first poll finds the L1 result (the 0.5.6 bench client
    /// sleeps 50 ms after a poll that finds the prefetch still running).
    Lookup {
        /// What was asked (its `found` is filled in as the shards answer).
        lookup: PendingLoad,
    },
    /// A lookup's L2 loads.
    Load {
        load: PendingLoad,
        /// Indices (into `load.keys`) of the keys being loaded, in send order.
        loading: Vec<usize>,
        loaded: Vec<bool>,
        /// Where each loaded key's slab lies (`NO_SLAB` if not loaded).
        slabs: Vec<u64>,
    },
    PrepareStore {
        to: ReplyTo,
        tkey: TransferKey,
        keys: Vec<ObjectKey>,
        layout: Layout,
        slabs: Vec<Option<Slab>>,
    },
    PrepareRetrieve {
        to: ReplyTo,
        tkey: TransferKey,
        keys: Vec<ObjectKey>,
        layout: Layout,
        slabs: Vec<Option<Slab>>,
    },
    Store {
        to: ReplyTo,
        outcomes: Vec<StoreOutcome>,
    },
    /// Write credits asked of one shard.
    Credits {
        shard: usize,
        size: u64,
        slabs: Vec<Option<Slab>>,
    },
    /// A GPU worker's STORE, reserving its objects.
    CudaStore {
        to: ReplyTo,
        iid: i64,
        keys: Vec<ObjectKey>,
        blocks: Vec<Vec<i64>>,
        event: Vec<u8>,
        slabs: Vec<Option<Slab>>,
    },
    /// A GPU worker's RETRIEVE, finding its read-locked objects.
    CudaRetrieve {
        to: ReplyTo,
        iid: i64,
        keys: Vec<ObjectKey>,
        blocks: Vec<Vec<i64>>,
        /// Blocks each chunk leaves untouched (skip_first_n_tokens).
        skips: Vec<usize>,
        event: Vec<u8>,
        slabs: Vec<Option<Slab>>,
    },
    Retrieve {
        to: ReplyTo,
        oks: Vec<bool>,
    },
    Clear {
        to: Option<ReplyTo>,
        responder: Option<Responder>,
        cleared: u64,
    },
    Reports {
        request: ControlRequest,
        responder: Responder,
        reports: Vec<Option<ShardReport>>,
    },
}

/// The second half of a lookup that found chunks of its prefix only in L2.
struct PendingLoad {
    request_id: String,
    /// Sequence number of the lookup (the job it will complete).
    job_seq: Seq,
    /// The prefix's keys, chunk-major.
    keys: Vec<ObjectKey>,
    /// Per key: `shard_l2::FOUND_*`.
    found: Vec<u8>,
    /// Per key: its slab's offset if an L1 hit, else `NO_SLAB`.
    slabs: Vec<u64>,
    num_ranks: usize,
    world_size: u32,
    readers: u32,
    /// Bytes of one object of the request's layout (for L2 loads).
    size: u64,
    /// When the lookup was sent to the shards (its read locks' TTL starts after).
    sent_at: Instant,
}

/// Limits and facts the front needs beyond the config.
pub struct FrontSetup {
    pub shm_pool: Option<(String, u64)>,
    /// The L1 arena's page policy and the bytes on huge pages at start.
    pub huge_pages: kvshard_io::arena::HugePages,
    pub huge_page_bytes: Option<u64>,
    /// What backs the arena (kind, path, mapped bytes), for /status.
    pub arena: serde_json::Value,
    /// The L1's host memory when it lives in memory (what CUDA copies reach).
    pub l1_memory: Option<L1Memory>,
    /// The front's own event queue, for the CUDA device threads' reports.
    pub events: NotifySender<FrontEvent>,
    /// The lookup-hash log (`--lookup-hash-log-dir`), opened at start so that
    /// a directory that cannot be written refuses the start.
    pub lookup_log: Option<LookupHashLog>,
}

impl FrontSetup {
    /// A front driven with no arena behind it (the model test, the front
    /// bench): it advertises `shm_pool` to registrations, and there are no
    /// huge pages and no L1 memory for CUDA copies.
    pub fn without_arena(shm_pool: (String, u64), events: NotifySender<FrontEvent>) -> Self {
        FrontSetup {
            shm_pool: Some(shm_pool),
            huge_pages: kvshard_io::arena::HugePages::Off,
            huge_page_bytes: None,
            arena: serde_json::Value::Null,
            l1_memory: None,
            events,
            lookup_log: None,
        }
    }
}

/// Where the front's replies go: the ROUTER socket in the server
/// ([`ZmqPort`]), a recorder in tests.
pub trait ReplyPort {
    /// Sends one multipart reply (`[identity, uid, op, payload?]`) without
    /// blocking.
    fn send(&mut self, frames: &[&[u8]]) -> Result<(), Undelivered>;
}

/// Why a reply was not delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undelivered {
    /// The peer's queue is full: it is not reading its replies.
    QueueFull,
    /// The peer is gone, or another socket error.
    Other(String),
}

/// The front's time source: the system's monotonic clock in the server, a
/// hand-moved one in tests.
pub trait Clock {
    fn now(&self) -> Instant;
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// The ROUTER socket as the front's [`ReplyPort`].
pub struct ZmqPort(pub Rc<zmq::Socket>);

impl ReplyPort for ZmqPort {
    fn send(&mut self, frames: &[&[u8]]) -> Result<(), Undelivered> {
        // Never block: with ROUTER_MANDATORY a blocking send waits while one
        // peer's queue is full, so a client that stops reading its replies
        // would stall the front for every client. That client loses its
        // replies instead.
        self.0
            .send_multipart(frames, zmq::DONTWAIT)
            .map_err(|e| match e {
                zmq::Error::EAGAIN => Undelivered::QueueFull,
                e => Undelivered::Other(e.to_string()),
            })
    }
}

/// The I/O shell around [`Front`]: polls the ROUTER socket and the front's
/// event queue, feeds what arrives to the front, and runs its timers.
pub struct FrontLoop {
    front: Front,
    socket: Rc<zmq::Socket>,
    events: NotifyReceiver<FrontEvent>,
    /// How long to poll for work before sleeping in `zmq::poll` (`--spin-us`).
    spin: Duration,
}

impl FrontLoop {
    pub fn new(
        cfg: Arc<ServerConfig>,
        setup: FrontSetup,
        socket: zmq::Socket,
        shards: Vec<MailboxSender<ShardMsg>>,
        events: NotifyReceiver<FrontEvent>,
    ) -> Self {
        let socket = Rc::new(socket);
        let port = Box::new(ZmqPort(socket.clone()));
        let spin = cfg.spin;
        FrontLoop {
            front: Front::new(cfg, setup, port, Box::new(SystemClock), shards),
            socket,
            events,
            spin,
        }
    }

    /// Polls the event queue and the socket until `spin` has passed, moving
    /// events into `events`; whether there is work. Shards skip the eventfd
    /// write meanwhile (see [`NotifyReceiver::take_awake`]).
    fn spin_for_work(&mut self, events: &mut Vec<FrontEvent>) -> bool {
        let until = Instant::now() + self.spin;
        let mut checks = 0u32;
        loop {
            if self.events.take_awake(events) > 0 {
                return true;
            }
            checks = checks.wrapping_add(1);
            if checks % 16 == 0 {
                // ZMQ_EVENTS: whether a message is ready, without waiting.
                if self
                    .socket
                    .get_events()
                    .is_ok_and(|e| e.contains(zmq::POLLIN))
                {
                    return true;
                }
                if Instant::now() >= until {
                    return false;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Serves until `stop` is set, seen within [`STOP_CHECK_MS`].
    pub fn run(&mut self, stop: &AtomicBool) {
        let mut events: Vec<FrontEvent> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let mut timeout_ms = self.front.poll_timeout_ms().min(STOP_CHECK_MS);
            if !self.spin.is_zero() && timeout_ms != 0 {
                let found = self.spin_for_work(&mut events);
                // Re-arm the eventfd before sleeping on it, taking what came
                // while the shards were told not to signal.
                self.events.drain(&mut events);
                if found || !events.is_empty() {
                    timeout_ms = 0;
                }
                for ev in events.drain(..) {
                    self.front.on_event(ev);
                }
            }
            let (sock_ready, ev_ready) = {
                let mut items = [
                    self.socket.as_poll_item(zmq::POLLIN),
                    zmq::PollItem::from_fd(self.events.fd(), zmq::POLLIN),
                ];
                match zmq::poll(&mut items, timeout_ms) {
                    Ok(_) => (items[0].is_readable(), items[1].is_readable()),
                    Err(zmq::Error::EINTR) => continue,
                    Err(e) => {
                        log_limited!(Level::Error, "zmq poll failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        (false, false)
                    }
                }
            };
            if ev_ready {
                self.events.drain(&mut events);
                for ev in events.drain(..) {
                    self.front.on_event(ev);
                }
            }
            if sock_ready {
                // Bounded batch so shard replies are not starved by a flood of requests.
                for _ in 0..256 {
                    match self.recv_frames() {
                        Ok(frames) => self.front.on_message(frames),
                        Err(zmq::Error::EAGAIN) => break,
                        Err(zmq::Error::EINTR) => break,
                        Err(e) => {
                            log_limited!(Level::Error, "zmq recv failed: {e}");
                            break;
                        }
                    }
                }
            }
            let now = self.front.clock.now();
            self.front.on_timers(now);
        }
        self.front.finish_lookup_log();
    }

    /// Receives one multipart message, its frames left in ZeroMQ's own buffers
    /// (a payload frame can be hundreds of MiB; it is read in place, never copied).
    fn recv_frames(&self) -> Result<Vec<zmq::Message>, zmq::Error> {
        let mut frames = Vec::with_capacity(4);
        loop {
            let mut m = zmq::Message::new();
            // The parts of a message arrive together: only the first can find none.
            self.socket.recv(&mut m, zmq::DONTWAIT)?;
            let more = m.get_more();
            frames.push(m);
            if !more {
                return Ok(frames);
            }
        }
    }
}

/// The front's state and request handling, free of I/O: requests come in as
/// frames ([`Front::on_message`]), shard, control and device reports as
/// [`FrontEvent`]s ([`Front::on_event`]), time as [`Front::on_timers`];
/// replies leave through its [`ReplyPort`], shard work through the shards'
/// mailboxes, and it reads time from its [`Clock`]. [`FrontLoop`] drives it
/// from the ZeroMQ socket and the event queue.
pub struct Front {
    cfg: Arc<ServerConfig>,
    setup: FrontSetup,
    port: Box<dyn ReplyPort>,
    clock: Box<dyn Clock>,
    shards: Vec<MailboxSender<ShardMsg>>,
    sessions: Sessions,
    /// Token arrays of recent keys, copied when a request names them again.
    token_cache: wire::msgpack::TokenCache,
    /// Prefetch jobs and the wait_prefetch_status callers parked on them.
    jobs: PrefetchJobs,
    /// `set_job` drops orphan results once the jobs outnumber this (at least
    /// twice `--max-sessions`, and twice what the last sweep kept).
    jobs_sweep_above: usize,
    /// Read locks concluded lookups still hold, per request.
    leases: LeaseBook,
    registry: Registry,
    /// GPU workers whose CUDA registrations were refused, and the probe result
    /// behind the refusals (taken on the first one).
    refused: RefusedTable,
    /// Instances whose PING found them unregistered and was answered `false`;
    /// their next PING is answered `true` (see [`Front::ping`]).
    unknown_pinged: HashSet<i64>,
    cuda_host: Option<CudaHost>,
    /// The CUDA device threads, started with the first CUDA registration.
    cuda_threads: Option<Arc<CudaExecutor>>,
    /// CUDA registrations being set up on their device threads.
    cuda_regs: HashMap<i64, PendingRegistration>,
    /// CUDA transfers whose copies are running, by sequence number.
    cuda_ops: HashMap<Seq, CudaOp>,
    layouts: Layouts,
    /// Per shard: messages waiting for room in its full mailbox, in send order
    /// (once a shard has some, later messages to it queue behind them).
    /// Client requests are refused while it holds `overflow_bound` messages
    /// that want a reply; other messages always queue (see `Front::send`).
    overflow: Vec<Overflow>,
    /// Shards whose overflow queue is not empty (the loop polls while any).
    overflowing: usize,
    /// Shards sent messages whose wake-up is still to come: each `on_*`
    /// entry point wakes them when it returns, after any reply it sent, so
    /// the wake-up syscall is not on that client's round trip.
    unwoken: Vec<usize>,
    /// Whether a shard is listed in `unwoken`.
    is_unwoken: Vec<bool>,
    /// Per shard: messages that want no reply (releases, touches, finished
    /// writes) sent since it was last woken, and when the first of them went.
    /// They wait for the next message that wants a reply, for
    /// [`LAZY_WAKE_AFTER`], or for [`LAZY_WAKE_BACKLOG`] of them, whichever
    /// comes first: a client's fire-and-forget request then costs no
    /// wake-up of its own. Ordering is unchanged (one mailbox per shard).
    lazy: Vec<(u32, Option<Instant>)>,
    /// `--shard-queue-depth`: a shard has at most that many client requests
    /// in its mailbox and as many again in its overflow queue.
    overflow_bound: usize,
    /// Shards whose thread has ended (their mailbox is closed).
    dead: Vec<bool>,
    /// Some in-flight request may await a dead shard: `fail_dead_parts` runs.
    dead_parts_pending: bool,
    /// See [`TEST_STOP_SHARD_ENV`].
    test_stop_shard: Option<usize>,
    /// Per shard and object size: write credits lent by the shard, handed to
    /// engine_driven writers without asking it (`--write-credits`).
    credits: Vec<HashMap<u64, CreditPool>>,
    /// The `n` of the next credit writer tag ([`CREDIT_TAG_BIT`]).
    next_credit_tag: u64,
    /// `/cache/checksums` threads running.
    checksum_threads: Arc<AtomicUsize>,
    inflight: HashMap<Seq, Inflight>,
    next_seq: Seq,
    metrics: Metrics,
    unsupported_logged: HashSet<&'static str>,
    /// The lookup-hash log's writer thread (`--lookup-hash-log-dir`).
    lookup_log: Option<LookupLogWriter>,
    /// `/quota` limits in bytes (0.5.6 keeps `int(limit_gb * 2**30)`), in
    /// the order they were first set, as 0.5.6 lists them.
    quotas: indexmap::IndexMap<String, u64>,
    /// Lookups whose L2 loads are running, and those waiting for a slot
    /// (`--l2-prefetch-max-in-flight`).
    loads_inflight: usize,
    /// When the lookups with L2 loads to wait for conclude anyway
    /// (`--l2-prefetch-load-timeout` after they arrived), by their job's seq.
    load_deadlines: std::collections::BTreeSet<(Instant, Seq)>,
    load_queue: std::collections::VecDeque<PendingLoad>,
    next_load_tag: u64,
    started: Instant,
    next_reap: Instant,
    next_session_sweep: Instant,
    /// When rate-limited log lines are next reported (`log_limit::flush`).
    next_log_flush: Instant,
}

const SESSION_SWEEP: Duration = Duration::from_secs(60);

/// The longest the front's loop sleeps between looks at the stop flag: a
/// SIGTERM caught by another thread does not interrupt its poll.
const STOP_CHECK_MS: i64 = 100;

/// How long a REGISTER_KV_CACHE waits for its GPU's device thread to set the
/// instance up before it is answered anyway (a driver call that never
/// returns must not hang the worker; its transfers fail until it is done).
const CUDA_SETUP_ANSWER: Duration = Duration::from_secs(60);

/// One shard's overflow queue (see `Front::overflow`), counting the messages
/// in it that want a reply.
#[derive(Default)]
struct Overflow {
    queue: VecDeque<ShardMsg>,
    requests: usize,
}

impl Overflow {
    fn push_back(&mut self, msg: ShardMsg) {
        self.requests += usize::from(msg.seq != 0);
        self.queue.push_back(msg);
    }

    fn push_front(&mut self, msg: ShardMsg) {
        self.requests += usize::from(msg.seq != 0);
        self.queue.push_front(msg);
    }

    fn pop_front(&mut self) -> Option<ShardMsg> {
        let msg = self.queue.pop_front()?;
        self.requests -= usize::from(msg.seq != 0);
        Some(msg)
    }

    fn clear(&mut self) {
        self.queue.clear();
        self.requests = 0;
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Write credits the front holds for one shard and object size.
struct CreditPool {
    free: Vec<Slab>,
    /// A `GrantCredits` to the shard is awaited.
    asked: bool,
    /// Credits to keep: `--write-credits` at first, raised to the largest
    /// part of one request for the shard that found too few (within the
    /// memory bound of [`Front::credit_cap`]).
    target: usize,
}

/// The longest a `query_prefetch_status` is held for a lookup's first phase
/// (the shards' L1 reservation and L2 existence check) before it is answered
/// "still running". Far below a client's request timeout.
const FIRST_PHASE_HOLD: Duration = Duration::from_secs(1);

/// How long a message that wants no reply may wait in a shard's mailbox for
/// the shard to be woken by something else (see `Front::lazy`); the loop's
/// next timer pass after that wakes it (the poll then sleeps 1 ms at most).
const LAZY_WAKE_AFTER: Duration = Duration::from_millis(1);

/// Replyless messages for one shard that wake it without waiting.
const LAZY_WAKE_BACKLOG: u32 = 32;

/// The kv_ranks a key addresses: one worker's, or every worker's of a world
/// (a scheduler key), without a list of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ranks {
    world_size: u32,
    /// Workers `first..end`.
    first: u32,
    end: u32,
}

impl Ranks {
    /// Worker `worker`'s rank in a world of `world_size`, or every worker's.
    fn of(world_size: u32, worker: Option<u32>) -> Ranks {
        let (first, end) = match worker {
            Some(w) => (w, w + 1),
            None => (0, world_size),
        };
        Ranks {
            world_size,
            first,
            end,
        }
    }

    fn len(&self) -> usize {
        (self.end - self.first) as usize
    }

    fn iter(&self) -> impl Iterator<Item = u32> {
        let ws = self.world_size;
        (self.first..self.end).map(move |w| keys::worker_kv_rank(ws, w))
    }

    /// The rank, when there is one.
    fn single(&self) -> Option<u32> {
        (self.len() == 1).then(|| keys::worker_kv_rank(self.world_size, self.first))
    }
}

/// Objects (chunks x kv ranks) one request may address: bounds the memory and
/// shard work of a single request (a 128k-token context of 256-token chunks at
/// world size 8 is 4096).
pub const MAX_OBJECTS_PER_REQUEST: usize = 1 << 18;

impl Front {
    pub fn new(
        cfg: Arc<ServerConfig>,
        mut setup: FrontSetup,
        port: Box<dyn ReplyPort>,
        clock: Box<dyn Clock>,
        shards: Vec<MailboxSender<ShardMsg>>,
    ) -> Self {
        let now = clock.now();
        let lookup_log = setup.lookup_log.take().and_then(|l| {
            match LookupLogWriter::start(l, WRITER_QUEUE_RECORDS) {
                Ok(w) => Some(w),
                Err(e) => {
                    log::error!(
                        "lookup hash logging disabled: cannot start its writer thread: {e}"
                    );
                    None
                }
            }
        });
        let n = shards.len();
        let test_stop_shard = std::env::var(TEST_STOP_SHARD_ENV)
            .ok()
            .and_then(|v| v.parse::<usize>().ok());
        if let Some(i) = test_stop_shard {
            log::warn!("{TEST_STOP_SHARD_ENV}={i} is set: shard {i} will be stopped on its first message (a test hook)");
        }
        Front {
            token_cache: wire::msgpack::TokenCache::new(),
            overflow: (0..n).map(|_| Overflow::default()).collect(),
            overflowing: 0,
            unwoken: Vec::with_capacity(n),
            is_unwoken: vec![false; n],
            lazy: vec![(0, None); n],
            overflow_bound: cfg.shard_queue_depth.max(1),
            dead: vec![false; n],
            dead_parts_pending: false,
            test_stop_shard,
            checksum_threads: Arc::new(AtomicUsize::new(0)),
            credits: (0..n).map(|_| HashMap::new()).collect(),
            next_credit_tag: 0,
            sessions: Sessions::new(cfg.session_ttl, cfg.max_sessions),
            leases: LeaseBook::new(cfg.max_sessions, cfg.l1.read_ttl),
            registry: Registry::new(cfg.max_registrations),
            refused: RefusedTable::new(cfg.max_registrations),
            unknown_pinged: HashSet::new(),
            cuda_host: None,
            cuda_threads: None,
            cuda_regs: HashMap::new(),
            cuda_ops: HashMap::new(),
            layouts: Layouts::default(),
            jobs: PrefetchJobs::default(),
            jobs_sweep_above: 2 * cfg.max_sessions,
            inflight: HashMap::new(),
            next_seq: 1,
            metrics: Metrics::default(),
            unsupported_logged: HashSet::new(),
            lookup_log,
            quotas: indexmap::IndexMap::new(),
            loads_inflight: 0,
            load_deadlines: std::collections::BTreeSet::new(),
            load_queue: std::collections::VecDeque::new(),
            next_load_tag: 0,
            started: now,
            next_reap: now + reap_interval(&cfg),
            next_session_sweep: now + SESSION_SWEEP,
            next_log_flush: now,
            cfg,
            setup,
            port,
            clock,
            shards,
        }
    }

    /// Stops the lookup-hash log's writer once it wrote and flushed what is
    /// queued (the server is stopping).
    pub fn finish_lookup_log(&mut self) {
        if let Some(mut writer) = self.lookup_log.take() {
            writer.finish();
        }
    }

    /// How long the loop may wait for input before [`Front::on_timers`] is due.
    pub fn poll_timeout_ms(&self) -> i64 {
        if self.overflowing > 0 {
            // A shard frees mailbox room without a word for messages that want
            // no reply: look again soon. Only while some shard is overloaded.
            return 1;
        }
        let now = self.clock.now();
        let mut next = self.next_session_sweep.min(self.next_reap);
        if let Some(d) = self.jobs.next_deadline() {
            next = next.min(d);
        }
        if let Some(&(d, _)) = self.load_deadlines.first() {
            next = next.min(d);
        }
        if self.lazy.iter().any(|(_, since)| since.is_some()) {
            // A replyless message waits for its shard's wake-up.
            return 1;
        }
        let ms = next.saturating_duration_since(now).as_millis();
        ms.clamp(1, 1000) as i64
    }

    // ---------------------------------------------------------------- timers

    /// Runs what is due at `now`: sweeps, reaping, deadlines, dead shards.
    pub fn on_timers(&mut self, now: Instant) {
        self.timers(now);
        self.wake_shards();
    }

    fn timers(&mut self, now: Instant) {
        self.watch_shards();
        self.answer_slow_cuda_setups(now);
        self.lazy_due(now);
        if now >= self.next_log_flush {
            self.next_log_flush = now + Duration::from_secs(1);
            kvshard_io::log_limit::flush(now);
        }
        if now >= self.next_session_sweep {
            self.next_session_sweep = now + SESSION_SWEEP;
            let n = self.sessions.expire(now);
            if n > 0 {
                log::debug!("expired {n} idle sessions");
            }
            self.leases.expire(now);
            let dropped = self.drop_orphan_jobs();
            if dropped > 0 {
                log::debug!("dropped {dropped} unconsumed prefetch results of expired sessions");
            }
        }
        if now >= self.next_reap {
            self.next_reap = now + reap_interval(&self.cfg);
            if !self.cfg.worker_reap_timeout.is_zero() {
                let reaped = self.registry.reap(
                    now,
                    self.cfg.worker_reap_timeout,
                    self.cfg.worker_registration_grace,
                );
                let forgotten = self.refused.reap(
                    now,
                    self.cfg
                        .worker_reap_timeout
                        .max(self.cfg.worker_registration_grace),
                );
                if forgotten > 0 {
                    log::info!("forgot {forgotten} silent refused GPU instances");
                }
                for (iid, released) in reaped {
                    log_limited!(Level::Warn, "reaped silent worker instance {iid}");
                    self.metrics.reaped_workers += 1;
                    self.release_instance(released);
                }
            }
        }
        // wait_prefetch_status deadlines: answer with no payload (still running).
        for to in self.jobs.expire_waiters(now) {
            self.reply(&to, None);
        }
        // Lookups whose L2 loads ran past their deadline conclude with what
        // L1 holds; the loads land all the same.
        while let Some(&(at, job_seq)) = self.load_deadlines.first() {
            if at > now {
                break;
            }
            self.load_deadlines.pop_first();
            self.conclude_at_deadline(job_seq);
        }
    }

    /// Sets the job of `rid`: a pending lookup (`Some(seq)`) or a miss (`None`).
    /// Callers waiting on a pending job it replaces keep waiting on a new
    /// pending one (they asked about the request, not the lookup), and get 0
    /// from a miss.
    fn set_job(&mut self, rid: String, pending: Option<Seq>) {
        match pending {
            Some(seq) => self.jobs.start(rid, seq),
            None => {
                let old = self.jobs.finish(rid, 0);
                self.answer_waiters(old, 0);
            }
        }
        // Bound the results nobody asks for between periodic sweeps.
        if self.jobs.len() > self.jobs_sweep_above {
            self.drop_orphan_jobs();
        }
    }

    /// Drops finished lookup results whose session is gone: no live request can
    /// ask for them. Returns how many.
    fn drop_orphan_jobs(&mut self) -> usize {
        let sessions = &self.sessions;
        let dropped = self.jobs.retain_done(|rid| sessions.contains(rid));
        // Pending jobs and live sessions' results stay: sweep again only once
        // the jobs have doubled, so a sweep costs O(1) per job set.
        self.jobs_sweep_above = (2 * self.cfg.max_sessions).max(2 * self.jobs.len());
        dropped
    }

    /// Answers parked wait_prefetch_status callers: the first gets `hits` (a result
    /// is handed out once), the rest 0.
    fn answer_waiters(&mut self, waiters: Vec<Waiter>, hits: i64) {
        let mut first = true;
        for Waiter { to, .. } in waiters {
            let v = if first { hits } else { 0 };
            first = false;
            self.reply(&to, Some(wire::encode_int(v)));
        }
    }

    // -------------------------------------------------------------- requests

    /// Handles one request, `[identity, uid, op, payloads...]` as the ROUTER
    /// received it (frames are read where they lie, never copied whole).
    pub fn on_message<F: std::ops::Deref<Target = [u8]>>(&mut self, frames: Vec<F>) {
        self.message(frames);
        self.wake_shards();
    }

    fn message<F: std::ops::Deref<Target = [u8]>>(&mut self, frames: Vec<F>) {
        self.metrics.requests += 1;
        if frames.len() < 3 {
            // [identity, uid] without an op cannot be a 0.5.6 request; echo what came.
            self.metrics.bad_requests += 1;
            log_limited!(
                Level::Warn,
                "dropping a {}-frame message: a request needs uid and op frames",
                frames.len()
            );
            if frames.len() == 2 {
                let res = self.port.send(&[&frames[0], &frames[1]]);
                self.count_undelivered(res);
            }
            return;
        }
        let mut it = frames.into_iter();
        let mut small = || it.next().map(|m| m.to_vec()).unwrap_or_default();
        let (identity, uid, op_frame) = (small(), small(), small());
        let payloads: Vec<F> = it.collect();
        if op_frame.is_empty() {
            // Stream credit/cancel controls (subscribe_kv_events): kvshard has no streams.
            return;
        }
        let to = ReplyTo {
            identity,
            uid,
            op: op_frame,
        };
        let op = match wire::decode_op(&to.op) {
            Ok(op) => op,
            Err(e) => {
                self.metrics.unknown_ops += 1;
                log_limited!(
                    Level::Warn,
                    "unknown operation: {e}; answering with no payload"
                );
                self.reply(&to, None);
                return;
            }
        };
        if let Some(big) = payloads
            .iter()
            .map(|m| m.len())
            .max()
            .filter(|n| *n > self.cfg.max_frame_bytes)
        {
            self.metrics.bad_requests += 1;
            self.metrics.oversized_frames += 1;
            log_limited!(
                Level::Warn,
                "{}: payload frame of {big} bytes exceeds --max-frame-bytes {}; answered with the failure reply",
                op.name(),
                self.cfg.max_frame_bytes
            );
            let payload = self.failure_payload(op);
            self.reply(&to, payload);
            return;
        }
        let views: Vec<&[u8]> = payloads.iter().map(|m| &**m).collect();
        match wire::decode_request_cached(op, &views, &mut self.token_cache) {
            Ok(req) => self.dispatch(to, req),
            Err(RequestError::Unsupported(op)) => {
                self.metrics.count_unsupported(op.name());
                if self.unsupported_logged.insert(op.name()) {
                    log_limited!(
                        Level::Warn,
                        "operation {} is not supported by kvshard (logged once)",
                        op.name()
                    );
                }
                self.reply(&to, None);
            }
            Err(e) => {
                self.metrics.bad_requests += 1;
                log_limited!(Level::Warn, "bad {} request: {e}", op.name());
                let payload = self.failure_payload(op);
                self.reply(&to, payload);
            }
        }
    }

    /// The reply a 0.5.6 client reads as failure or miss for `op`.
    fn failure_payload(&self, op: Op) -> Option<Vec<u8>> {
        match op {
            Op::Store | Op::Retrieve => Some(wire::encode_store_reply(b"", false)),
            Op::QueryPrefetchStatus | Op::WaitPrefetchStatus => Some(wire::encode_int(0)),
            Op::PrepareStore => Some(wire::encode_prepare_store_reply(&[], &[])),
            Op::PrepareRetrieve => Some(wire::encode_prepare_retrieve_reply(false, &[])),
            Op::CommitStore | Op::CommitRetrieve | Op::Ping => Some(wire::encode_bool(false)),
            Op::GetChunkSize => Some(wire::encode_int(self.cfg.chunk_size as i64)),
            Op::Noop => Some(wire::encode_str("OK")),
            Op::GetExperimental => Some(wire::encode_str_list::<&str>(&[])),
            _ => None,
        }
    }

    fn reply(&mut self, to: &ReplyTo, payload: Option<Vec<u8>>) {
        let res = match payload {
            Some(p) => self.port.send(&[&to.identity, &to.uid, &to.op, &p]),
            None => self.port.send(&[&to.identity, &to.uid, &to.op]),
        };
        self.count_undelivered(res);
    }

    fn count_undelivered(&mut self, res: Result<(), Undelivered>) {
        let Err(e) = res else {
            return;
        };
        // The peer is gone, or its queue is full (it is not reading). Logged
        // at powers of two so a flood cannot flood the log.
        self.metrics.reply_failures += 1;
        let n = self.metrics.reply_failures;
        if e == Undelivered::QueueFull && n.is_power_of_two() {
            log_limited!(
                Level::Warn,
                "reply dropped: the client's queue is full ({n} undelivered replies so far)"
            );
        } else {
            log::debug!("reply not delivered: {e:?}");
        }
    }

    fn dispatch(&mut self, to: ReplyTo, req: Request) {
        let now = self.clock.now();
        match req {
            Request::Noop => self.reply(&to, Some(wire::encode_str("OK"))),
            Request::GetChunkSize => {
                let p = wire::encode_int(self.cfg.chunk_size as i64);
                self.reply(&to, Some(p))
            }
            Request::GetExperimental => self.reply(&to, Some(wire::encode_str_list::<&str>(&[]))),
            Request::Ping { instance_id } => {
                let healthy = match instance_id {
                    Some(iid) => self.ping(iid, now),
                    None => true,
                };
                self.reply(&to, Some(wire::encode_bool(healthy)))
            }
            Request::ReportBlockAllocation { records, .. } => {
                // Block-allocation records feed 0.5.6's KV-event and block-lifetime metrics,
                // which kvshard does not have; acknowledge so the caller never waits.
                self.metrics.block_allocation_records += records.len() as u64;
                self.reply(&to, None)
            }
            Request::Clear { force } => self.clear(Some(to), None, force),
            Request::Lookup { key, .. } => self.lookup(to, key, now),
            Request::QueryPrefetchStatus { request_id } => {
                self.query_prefetch(to, &request_id, now)
            }
            Request::WaitPrefetchStatus {
                request_id,
                timeout_seconds,
            } => self.wait_prefetch(to, &request_id, timeout_seconds, now),
            // Acked alike whatever follows: the ack goes first.
            Request::FreeLookupLocks { key, .. } => {
                self.reply(&to, None);
                self.free_lookup_locks(&key, now)
            }
            Request::EndSession { request_id } => {
                self.reply(&to, None);
                self.end_session(&request_id)
            }
            Request::RegisterEngineDriven(p) => {
                let reply = self.register_engine_driven(p, now);
                self.reply(&to, reply)
            }
            Request::UnregisterEngineDriven { instance_id } => {
                match self.registry.remove_engine(instance_id) {
                    Some(entry) => {
                        log_limited!(
                            Level::Info,
                            "unregistered engine_driven instance {instance_id}"
                        );
                        self.release_instance(crate::registry::Released::Engine(
                            instance_id,
                            entry,
                        ));
                    }
                    None => log_limited!(
                        Level::Warn,
                        "unregister: no engine_driven instance {instance_id}"
                    ),
                }
                self.reply(&to, None)
            }
            Request::RegisterKvCache {
                instance_id,
                kv_cache,
                model_name,
                world_size,
                engine_type,
                layout_hints,
                engine_group_infos,
            } => {
                self.register_kv_cache(
                    instance_id,
                    &kv_cache,
                    model_name,
                    world_size,
                    &engine_type,
                    &layout_hints,
                    &engine_group_infos,
                    now,
                );
                // A CUDA registration is answered once its GPU's device
                // thread has set it up (pinning the L1 can take seconds), as
                // 0.5.6 answers after opening the handles: a STORE the worker
                // sends on the answer finds the instance registered.
                match self.cuda_regs.get_mut(&instance_id) {
                    Some(p) => p.replies.push(to),
                    None => self.reply(&to, None),
                }
            }
            Request::UnregisterKvCache { instance_id } => {
                let was_refused = self.refused.remove(instance_id).is_some();
                if let Some(p) = self.cuda_regs.remove(&instance_id) {
                    // Still being set up: its device thread undoes it after.
                    self.layouts.unregister(&p.model_name, p.world_size);
                    self.cuda_unregister(instance_id, p.instance.ordinal);
                    log_limited!(
                        Level::Info,
                        "unregistered lmcache_driven CUDA instance {instance_id} while it was being set up"
                    );
                    for waiting in &p.replies {
                        self.reply(waiting, None);
                    }
                    return self.reply(&to, None);
                }
                match self.registry.remove_lmc(instance_id) {
                    Some(entry) => {
                        log_limited!(
                            Level::Info,
                            "unregistered lmcache_driven instance {instance_id}"
                        );
                        self.release_instance(crate::registry::Released::Lmc(instance_id, entry));
                    }
                    None if was_refused => log_limited!(
                        Level::Info,
                        "unregistered refused GPU instance {instance_id}"
                    ),
                    None => log_limited!(
                        Level::Warn,
                        "unregister: no lmcache_driven instance {instance_id}"
                    ),
                }
                self.reply(&to, None)
            }
            Request::PrepareStore { key, instance_id } => {
                self.prepare_store(to, key, instance_id, now)
            }
            Request::CommitStore {
                key,
                instance_id,
                inline_bytes,
            } => {
                let ok = self.commit_store(&key, instance_id, inline_bytes, now);
                self.reply(&to, Some(wire::encode_bool(ok)))
            }
            Request::PrepareRetrieve { key, instance_id } => {
                self.prepare_retrieve(to, key, instance_id, now)
            }
            Request::CommitRetrieve { key, instance_id } => {
                let ok = self.commit_retrieve(&key, instance_id, now);
                self.reply(&to, Some(wire::encode_bool(ok)))
            }
            Request::Store {
                key,
                instance_id,
                block_ids,
                event_ipc_handle,
            } => self.store(to, key, instance_id, block_ids, event_ipc_handle, now),
            Request::Retrieve {
                key,
                instance_id,
                block_ids,
                event_ipc_handle,
                skip_first_n_tokens,
            } => {
                let t = Transfer {
                    block_ids,
                    event: event_ipc_handle,
                };
                self.retrieve(to, key, instance_id, t, skip_first_n_tokens, now)
            }
        }
    }

    /// A worker's heartbeat: whether to tell it the server is healthy.
    ///
    /// - A worker kvshard refused (CUDA) hears it is not, and its client
    ///   degrades with a warning instead of failing every transfer.
    /// - A worker this server does not know (it registered with a server that
    ///   ran before this one) hears `false` once, then `true`: 0.5.6's adapter
    ///   re-registers its KV caches only on an unhealthy-to-healthy edge of its
    ///   heartbeat, and would otherwise store into a server that cannot serve it.
    fn ping(&mut self, iid: i64, now: Instant) -> bool {
        self.registry.ping(iid, now);
        if self.refused.touch(iid, now) {
            return self.registry.is_registered(iid);
        }
        if self.registry.is_registered(iid) || self.cuda_regs.contains_key(&iid) {
            self.unknown_pinged.remove(&iid);
            return true;
        }
        if self.unknown_pinged.remove(&iid) {
            // Its second ping: the edge its adapter re-registers on.
            return true;
        }
        if self.unknown_pinged.len() >= self.cfg.max_registrations {
            // Instances that never came back: forget them all (bounded).
            self.unknown_pinged.clear();
        }
        self.unknown_pinged.insert(iid);
        self.metrics.unknown_instance_pings += 1;
        log_limited!(
            Level::Warn,
            "PING from instance {iid}, which is not registered here (registered with a server \
             that ran before this one?): answered unhealthy once, so that its client registers again"
        );
        false
    }

    // ------------------------------------------------------------ shard I/O

    fn alloc_seq(&mut self) -> Seq {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// Gives `msg` to shard `shard` without ever waiting. When its mailbox is
    /// full the message joins the shard's overflow queue (drained as room
    /// appears, in order). The overflow bound applies to client requests only,
    /// checked before any of their parts is sent ([`Front::refused`]): the
    /// other messages (lock releases, aborts, commits and the other posts with
    /// seq 0, L2 loads, control requests) always queue, as dropping one would
    /// leak a lock or a reservation. They are bounded by the requests that
    /// caused them, and control requests by the HTTP API's connection limit.
    ///
    /// A message for a dead shard is dropped; a request's part of it is failed
    /// by [`Front::fail_dead_parts`] (its `Inflight` still awaits that shard).
    fn send(&mut self, shard: usize, msg: ShardMsg) {
        let wake = msg.seq != 0;
        self.send_waking(shard, msg, wake);
    }

    /// [`send`](Self::send), waking the shard for the message only when
    /// `wake`: a message that wants a reply but no prompt one (a credit top-up)
    /// rides along with the next wake-up, as replyless ones do.
    fn send_waking(&mut self, shard: usize, msg: ShardMsg, wake: bool) {
        if self.test_stop_shard == Some(shard) {
            self.test_stop_shard = None;
            self.stop_shard_for_test(shard);
        }
        if self.dead[shard] {
            self.dead_parts_pending |= msg.seq != 0;
            return;
        }
        if !self.overflow[shard].is_empty() {
            self.drain_overflow(shard);
            if !self.overflow[shard].is_empty() {
                self.overflow[shard].push_back(msg);
                return;
            }
        }
        match self.shards[shard].try_send_unwoken(msg) {
            Ok(()) if wake => self.mark_unwoken(shard),
            Ok(()) => self.mark_lazy(shard),
            Err(SendError::Full(msg)) => {
                // Whatever fills the mailbox, the shard is woken to empty it.
                self.mark_unwoken(shard);
                self.metrics.mailbox_full += 1;
                self.overflowing += 1;
                self.overflow[shard].push_back(msg);
            }
            Err(SendError::Closed(msg)) => {
                self.dead_parts_pending |= msg.seq != 0;
                self.mark_dead(shard, "its mailbox is closed");
            }
        }
    }

    fn mark_unwoken(&mut self, shard: usize) {
        if !self.is_unwoken[shard] {
            self.is_unwoken[shard] = true;
            self.unwoken.push(shard);
        }
    }

    /// The counters, for the model test.
    #[cfg(test)]
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Notes a message that wants no reply, queued for `shard` unwoken.
    fn mark_lazy(&mut self, shard: usize) {
        let (count, since) = &mut self.lazy[shard];
        *count += 1;
        since.get_or_insert_with(|| self.clock.now());
        if *count >= LAZY_WAKE_BACKLOG {
            self.mark_unwoken(shard);
        }
    }

    /// Wakes every shard sent a message that wants a reply since the last
    /// call, and those whose replyless messages waited long enough.
    fn wake_shards(&mut self) {
        for shard in self.unwoken.drain(..) {
            self.is_unwoken[shard] = false;
            self.lazy[shard] = (0, None);
            self.shards[shard].wake();
        }
    }

    /// Marks for waking the shards whose oldest replyless message was sent
    /// [`LAZY_WAKE_AFTER`] before `now`.
    fn lazy_due(&mut self, now: Instant) {
        for shard in 0..self.lazy.len() {
            if self.lazy[shard]
                .1
                .is_some_and(|since| since + LAZY_WAKE_AFTER <= now)
            {
                self.mark_unwoken(shard);
            }
        }
    }

    /// Moves what fits of shard `shard`'s overflow queue into its mailbox.
    fn drain_overflow(&mut self, shard: usize) {
        debug_assert!(!self.overflow[shard].is_empty());
        while let Some(msg) = self.overflow[shard].pop_front() {
            match self.shards[shard].try_send_unwoken(msg) {
                Ok(()) => self.mark_unwoken(shard),
                Err(SendError::Full(msg)) => {
                    self.overflow[shard].push_front(msg);
                    return;
                }
                Err(SendError::Closed(_)) => {
                    // Drops the rest; the requests among them are failed by
                    // fail_dead_parts like every other part awaiting the shard.
                    self.overflow[shard].clear();
                    self.overflowing -= 1;
                    self.mark_dead(shard, "its mailbox is closed");
                    return;
                }
            }
        }
        self.overflowing -= 1;
    }

    /// Runs on every turn of the loop: moves overflow into mailboxes that have
    /// room, notices shards whose thread ended, and fails what awaited them.
    fn watch_shards(&mut self) {
        if self.overflowing > 0 {
            for shard in 0..self.shards.len() {
                if !self.overflow[shard].is_empty() {
                    self.drain_overflow(shard);
                }
            }
        }
        for shard in 0..self.shards.len() {
            if !self.dead[shard] && self.shards[shard].is_closed() {
                self.mark_dead(shard, "its thread ended");
            }
        }
        self.fail_dead_parts();
    }

    /// Records that shard `shard`'s thread is gone: from now on every request
    /// that needs it is answered with its failure reply, `/healthcheck` says
    /// unhealthy and `/status` names it. Its queued messages are dropped.
    fn mark_dead(&mut self, shard: usize, why: &str) {
        if self.dead[shard] {
            return;
        }
        self.dead[shard] = true;
        if !self.overflow[shard].is_empty() {
            self.overflow[shard].clear();
            self.overflowing -= 1;
        }
        self.dead_parts_pending = true;
        log::error!(
            "shard {shard} has stopped ({why}): requests that need it are answered with their \
             failure reply from now on, and /healthcheck reports unhealthy; restart the server"
        );
    }

    /// Fails every part of an in-flight request that awaits a dead shard; a
    /// request whose last awaited part that was completes (answered once, as a
    /// failure for the dead shard's items).
    fn fail_dead_parts(&mut self) {
        // Completing a request may send more (to dead shards too): repeat.
        while std::mem::take(&mut self.dead_parts_pending) {
            let dead = &self.dead;
            let parts: Vec<(Seq, usize)> = self
                .inflight
                .iter()
                .flat_map(|(seq, inf)| {
                    inf.waiting
                        .iter()
                        .enumerate()
                        .filter(|(s, w)| **w && dead[*s])
                        .map(move |(s, _)| (*seq, s))
                })
                .collect();
            for (seq, shard) in parts {
                self.settle_part(seq, shard, None);
            }
        }
    }

    /// Folds shard `shard`'s answer to request `seq` in (`None`: the shard is
    /// dead, its items fail) and completes the request after its last part.
    fn settle_part(&mut self, seq: Seq, shard: usize, body: Option<ShardReplyBody>) {
        let Some(inf) = self.inflight.get_mut(&seq) else {
            if !self.dead[shard] {
                log_limited!(
                    Level::Error,
                    "reply for unknown request {seq} from shard {shard}"
                );
            }
            return;
        };
        if !inf.waiting[shard] {
            // An answer racing the shard's death, after its part was failed.
            log::debug!("late reply to request {seq} from stopped shard {shard} ignored");
            return;
        }
        inf.waiting[shard] = false;
        let idx = std::mem::take(&mut inf.parts[shard]);
        match body {
            Some(body) => merge(&mut inf.kind, &idx, shard, body),
            None => fail_items(&mut inf.kind, &idx),
        }
        inf.remaining -= 1;
        if inf.remaining > 0 {
            return;
        }
        let inf = self.inflight.remove(&seq).expect("looked up above");
        self.complete(seq, inf.kind);
    }

    /// Test hook ([`TEST_STOP_SHARD_ENV`]): drops the front's only sender of
    /// shard `shard`'s mailbox, keeping a closed one in its place. The shard's
    /// loop then ends and its thread exits, as at shutdown.
    fn stop_shard_for_test(&mut self, shard: usize) {
        log::warn!("test hook: stopping shard {shard}");
        let (closed, rx) = kvshard_io::mailbox::mailbox(1);
        drop(rx);
        self.shards[shard] = closed;
    }

    /// Whether a client request that needs `shards` must be refused now: one
    /// of them is dead, or its overflow queue holds `overflow_bound` messages.
    /// Checked before any part is sent, so a request is given to all its shards
    /// or to none. Counts and logs the refusal; the caller answers.
    fn refused(&mut self, to: &ReplyTo, shards: impl IntoIterator<Item = usize>) -> bool {
        let op = wire::decode_op(&to.op).map_or("request", |o| o.name());
        for shard in shards {
            if !self.dead[shard] && self.shards[shard].is_closed() {
                self.mark_dead(shard, "its thread ended");
            }
            if self.dead[shard] {
                self.metrics.shard_dead_refused += 1;
                log_limited!(
                    Level::Warn,
                    "{op} needs stopped shard {shard}: answered with the failure reply"
                );
                return true;
            }
            // Counted in messages that want a reply: the replyless ones a
            // client's commit or release leaves (lazily woken) must not get
            // its next request refused.
            if self.overflow[shard].requests >= self.overflow_bound {
                self.drain_overflow(shard);
            }
            if self.overflow[shard].requests >= self.overflow_bound {
                self.metrics.shard_overflow_refused += 1;
                log_limited!(
                    Level::Warn,
                    "{op}: shard {shard} is overloaded (its mailbox is full and {} more messages wait, \
                     the bound of --shard-queue-depth); answered with the failure reply",
                    self.overflow[shard].len()
                );
                return true;
            }
        }
        false
    }

    /// Answers `to` with its op's failure reply.
    fn reply_failure(&mut self, to: &ReplyTo) {
        let payload = wire::decode_op(&to.op)
            .ok()
            .and_then(|op| self.failure_payload(op));
        self.reply(to, payload);
    }

    /// Splits `keys` by owning shard (keeping their order) and returns, per shard,
    /// the indices taken.
    fn split(&self, keys: &[ObjectKey]) -> Vec<Vec<usize>> {
        let n = self.shards.len();
        let mut parts = vec![Vec::new(); n];
        for (i, k) in keys.iter().enumerate() {
            parts[k.shard(n)].push(i);
        }
        parts
    }

    /// Sends one message per shard that owns some of `keys`; `make` builds the op
    /// from that shard's indices. Registers `kind` to collect the replies, or, if no
    /// shard was involved, returns the kind for immediate completion.
    fn fan_out(
        &mut self,
        parts: Vec<Vec<usize>>,
        kind: InflightKind,
        make: impl FnMut(&[usize]) -> ShardOp,
    ) -> Option<InflightKind> {
        self.fan_out_waking(parts, kind, true, make)
    }

    /// [`fan_out`](Self::fan_out), waking the shards for the messages only
    /// when `wake` (see [`send_waking`](Self::send_waking)).
    fn fan_out_waking(
        &mut self,
        parts: Vec<Vec<usize>>,
        kind: InflightKind,
        wake: bool,
        mut make: impl FnMut(&[usize]) -> ShardOp,
    ) -> Option<InflightKind> {
        let involved = parts.iter().filter(|p| !p.is_empty()).count();
        if involved == 0 {
            return Some(kind);
        }
        let seq = self.alloc_seq();
        for (shard, idx) in parts.iter().enumerate() {
            if !idx.is_empty() {
                let op = make(idx);
                self.send_waking(shard, ShardMsg { seq, op }, wake);
            }
        }
        let waiting = parts.iter().map(|p| !p.is_empty()).collect();
        self.inflight.insert(
            seq,
            Inflight {
                remaining: involved,
                parts,
                waiting,
                kind,
            },
        );
        None
    }

    /// Sends `make(keys)` to every shard owning some of `keys`, wanting no
    /// reply; the shards are not woken for it (see `lazy`).
    fn post(&mut self, keys: Vec<ObjectKey>, make: impl Fn(Vec<ObjectKey>) -> ShardOp) {
        let n = self.shards.len();
        if n == 1 {
            if !keys.is_empty() {
                let op = make(keys);
                self.send(0, ShardMsg { seq: 0, op });
            }
            return;
        }
        let mut per: Vec<Vec<ObjectKey>> = vec![Vec::new(); n];
        for k in keys {
            per[k.shard(n)].push(k);
        }
        for (i, ks) in per.into_iter().enumerate() {
            if !ks.is_empty() {
                let op = make(ks);
                self.send(i, ShardMsg { seq: 0, op });
            }
        }
    }

    fn broadcast(&mut self, kind: InflightKind, make: impl Fn() -> ShardOp) {
        let n = self.shards.len();
        let seq = self.alloc_seq();
        for i in 0..n {
            self.send(i, ShardMsg { seq, op: make() });
        }
        self.inflight.insert(
            seq,
            Inflight {
                remaining: n,
                parts: vec![Vec::new(); n],
                waiting: vec![true; n],
                kind,
            },
        );
    }

    /// Handles a report from a shard, the HTTP API or a device thread.
    pub fn on_event(&mut self, ev: FrontEvent) {
        match ev {
            FrontEvent::Control(req, responder) => self.control(req, responder),
            FrontEvent::Shard(reply) => self.on_shard_reply(reply),
            FrontEvent::Cuda(ev) => self.on_cuda_event(ev),
        }
        self.wake_shards();
    }

    fn on_shard_reply(&mut self, reply: ShardReply) {
        self.settle_part(reply.seq, reply.shard, Some(reply.body));
    }

    fn complete(&mut self, seq: Seq, kind: InflightKind) {
        match kind {
            InflightKind::Lookup { lookup } => {
                if let Some((waiters, hits)) = self.finish_lookup(seq, lookup) {
                    self.answer_waiters(waiters, hits);
                }
            }
            InflightKind::Load {
                load,
                loading,
                loaded,
                slabs,
            } => {
                if let Some((waiters, hits)) = self.finish_load(load, &loading, &loaded, &slabs) {
                    self.answer_waiters(waiters, hits);
                }
            }
            InflightKind::PrepareStore {
                to,
                tkey,
                keys,
                layout,
                slabs,
            } => {
                let mut slots = Vec::new();
                let mut indices = Vec::new();
                let mut reserved = Vec::new();
                for (i, (k, s)) in keys.into_iter().zip(slabs).enumerate() {
                    if let Some(slab) = s {
                        slots.push(layout.slot(slab.offset));
                        indices.push(i as i64);
                        reserved.push(k);
                    }
                }
                if !reserved.is_empty() {
                    let tag = writer_tag(tkey.instance_id);
                    self.pend_write(tkey, reserved, tag);
                }
                self.reply(
                    &to,
                    Some(wire::encode_prepare_store_reply(&slots, &indices)),
                );
            }
            InflightKind::PrepareRetrieve {
                to,
                tkey,
                keys,
                layout,
                slabs,
            } => {
                if slabs.iter().all(Option::is_some) && !slabs.is_empty() {
                    let offsets: Vec<u64> = slabs.iter().flatten().map(|s| s.offset).collect();
                    self.reply_reads(&to, &offsets, &layout);
                    self.pend_reads(tkey, keys);
                } else {
                    // Not all read-locked: release the lock this transfer
                    // holds on each object found.
                    let found: Vec<ObjectKey> = keys
                        .into_iter()
                        .zip(&slabs)
                        .filter(|(_, s)| s.is_some())
                        .map(|(k, _)| k)
                        .collect();
                    self.metrics.retrieve_misses += 1;
                    self.post(found, |keys| ShardOp::Release { keys, count: 1 });
                    self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[])));
                }
            }
            InflightKind::Credits { shard, size, slabs } => {
                self.credits_granted(shard, size, slabs.into_iter().flatten().collect())
            }
            InflightKind::Store { to, outcomes } => {
                let count = |want: StoreOutcome| outcomes.iter().filter(|o| **o == want).count();
                let failed = count(StoreOutcome::Failed);
                let left_out = count(StoreOutcome::OutOfMemory);
                self.metrics.stored_chunks += count(StoreOutcome::Stored) as u64;
                self.metrics.finished_stores += 1;
                // 0.5.6 answers a STORE whose chunks partly found no L1 memory
                // as a success, leaving them out (lmcache_driven_transfer.py):
                // the worker recomputes them later. Counted and logged here.
                if failed == 0 && left_out > 0 {
                    self.metrics.partial_stores += 1;
                    self.metrics.store_chunks_left_out += left_out as u64;
                    log_limited!(
                        Level::Warn,
                        "store: {left_out} of {} chunks found no L1 memory and were left out; \
                         answered as a success, as lmcache 0.5.6 does",
                        outcomes.len()
                    );
                }
                self.reply(&to, Some(wire::encode_store_reply(b"", failed == 0)));
            }
            InflightKind::CudaStore {
                to,
                iid,
                keys,
                blocks,
                event,
                slabs,
            } => self.cuda_store_reserved(to, iid, keys, blocks, event, slabs),
            InflightKind::CudaRetrieve {
                to,
                iid,
                keys,
                blocks,
                skips,
                event,
                slabs,
            } => {
                let found = CudaFound { keys, slabs };
                self.cuda_retrieve_locked(to, iid, found, blocks, skips, event)
            }
            InflightKind::Retrieve { to, oks } => {
                let ok = oks.iter().all(|b| *b);
                self.metrics.finished_retrieves += 1;
                self.metrics.retrieved_chunks += oks.iter().filter(|b| **b).count() as u64;
                if !ok {
                    self.metrics.retrieve_misses += 1;
                }
                self.reply(&to, Some(wire::encode_store_reply(b"", ok)));
            }
            InflightKind::Clear {
                to,
                responder,
                cleared,
            } => {
                log_limited!(Level::Info, "cleared {cleared} L1 objects");
                if let Some(to) = to {
                    self.reply(&to, None);
                }
                if let Some(r) = responder {
                    r.send(ControlResponse::json(
                        serde_json::json!({"status": "ok", "cleared": {"tier": "l1"}}),
                    ));
                }
            }
            InflightKind::Reports {
                request,
                responder,
                reports,
            } => {
                let reports: Vec<ShardReport> = reports.into_iter().flatten().collect();
                let resp = self.answer_reports(&request, reports);
                responder.send(resp);
            }
        }
    }

    // ------------------------------------------------------------- lookups

    /// Object keys of chunks `hashes` for `ranks`, chunk-major and rank-minor.
    fn object_keys(
        model: Name,
        salt: Name,
        hashes: &[keys::ChunkHash],
        ranks: Ranks,
    ) -> Vec<ObjectKey> {
        let mut out = Vec::with_capacity(hashes.len() * ranks.len());
        for h in hashes {
            for kv_rank in ranks.iter() {
                out.push(ObjectKey {
                    chunk_hash: *h,
                    model_name: model,
                    kv_rank,
                    object_group_id: 0,
                    cache_salt: salt,
                });
            }
        }
        out
    }

    /// Interned (model_name, cache_salt) of a request, once per request.
    fn key_names(model: &str, salt: &str) -> Result<(Name, Name), String> {
        let model = Name::intern(model).map_err(|e| format!("model_name: {e}"))?;
        let salt = Name::intern(salt).map_err(|e| format!("cache_salt: {e}"))?;
        Ok((model, salt))
    }

    /// kv_ranks a key addresses: one worker's, or every worker's for a scheduler key.
    fn ranks_of(key: &IpcKey) -> Result<Ranks, String> {
        let ws = u32::try_from(key.world_size)
            .ok()
            .filter(|w| (1..=keys::MAX_WORLD_SIZE).contains(w))
            .ok_or_else(|| {
                format!(
                    "world_size {} outside 1..={}",
                    key.world_size,
                    keys::MAX_WORLD_SIZE
                )
            })?;
        match key.worker_id {
            Some(w) if w < 0 || w as u64 >= ws as u64 => {
                Err(format!("worker_id {w} outside world_size {ws}"))
            }
            w => Ok(Ranks::of(ws, w.map(|w| w as u32))),
        }
    }

    /// Chunk hashes of `[start, end)` of `key`, through its session.
    /// Refuses (before any work) a request that would address more than
    /// [`MAX_OBJECTS_PER_REQUEST`] objects: chunks times kv ranks.
    fn key_hashes(
        &mut self,
        key: &IpcKey,
        from_zero: bool,
        num_ranks: usize,
        now: Instant,
    ) -> Result<Vec<keys::ChunkHash>, String> {
        let cs = self.cfg.chunk_size;
        let start = if from_zero {
            0
        } else {
            usize::try_from(key.start).map_err(|_| format!("negative start {}", key.start))?
        };
        let end = usize::try_from(key.end).map_err(|_| format!("negative end {}", key.end))?;
        let objects = (end.saturating_sub(start) / cs).saturating_mul(num_ranks);
        if objects > MAX_OBJECTS_PER_REQUEST {
            return Err(format!(
                "[{start}, {end}) x {num_ranks} kv ranks addresses {objects} objects, more than the \
                 {MAX_OBJECTS_PER_REQUEST} one request may"
            ));
        }
        let s = self
            .sessions
            .with_tokens(&key.request_id, &key.token_ids, now);
        s.hashes(cs, start, end)
            .map(|h| h.to_vec())
            .map_err(|e| e.to_string())
    }

    fn lookup(&mut self, to: ReplyTo, key: IpcKey, now: Instant) {
        self.metrics.lookups += 1;
        // Every lookup is acked alike, with no payload (as 0.5.6 does), so the
        // ack leaves first and the hashing and posting below overlap its trip.
        // Nothing can see the difference: the front reads the client's next
        // request (its status query) only once this one has registered its job.
        self.reply(&to, None);
        let rid = key.request_id.clone();
        let early = |front: &mut Front, reason: &'static str| {
            front.metrics.count_early_exit(reason);
            front.set_job(rid.clone(), None);
        };
        let Some(layout) = u32::try_from(key.world_size)
            .ok()
            .and_then(|ws| self.layouts.get(&key.model_name, ws))
            .cloned()
        else {
            log_limited!(
                Level::Error,
                "No GPU context found for model {} with world size {} during lookup",
                key.model_name,
                key.world_size
            );
            return early(self, "no_gpu_context");
        };
        let readers = match u32::try_from(key.num_kv_readers) {
            Ok(r) if r >= 1 => r,
            _ => {
                log_limited!(Level::Error,
                    "lookup {rid}: num_kv_readers={} — this server requires clients that send num_kv_readers",
                    key.num_kv_readers
                );
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        let ranks = match Self::ranks_of(&key) {
            Ok(r) => r,
            Err(e) => {
                log_limited!(Level::Error, "lookup {rid}: {e}");
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        let hashes = match self.key_hashes(&key, true, ranks.len(), now) {
            Ok(h) => h,
            Err(e) => {
                log_limited!(Level::Error, "lookup {rid}: {e}");
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        let (model, salt) = match Self::key_names(&key.model_name, &key.cache_salt) {
            Ok(n) => n,
            Err(e) => {
                log_limited!(Level::Error, "lookup {rid}: {e}");
                self.metrics.bad_requests += 1;
                return early(self, "bad_request");
            }
        };
        if let Some(s) = self.sessions.get_mut(&rid) {
            s.lookup = Some(LookupScope {
                model_name: key.model_name.clone(),
                world_size: key.world_size as u32,
                worker_id: key.worker_id.map(|w| w as u32),
                cache_salt: key.cache_salt.clone(),
                num_kv_readers: readers,
            });
            s.prefetch_hit_chunks = -1;
        }
        if let Some(writer) = self.lookup_log.as_ref() {
            // Formatted and written on the writer thread; never waited for.
            let outcome = writer.send(LookupRecord {
                at: std::time::SystemTime::now(),
                request_id: rid.clone(),
                model_name: key.model_name.clone(),
                chunk_size: self.cfg.chunk_size,
                seq_len: key.token_ids.len(),
                dtype: layout.dtype.to_string(),
                shape: layout.shape.to_vec(),
                chunk_hashes: hashes.clone(),
            });
            match outcome {
                SendOutcome::Queued => {}
                SendOutcome::Full => {
                    self.metrics.lookup_hash_log_dropped += 1;
                    log_limited!(
                        Level::Warn,
                        "lookup hash log: the writer is {WRITER_QUEUE_RECORDS} records behind; \
                         the line of lookup {rid} was dropped"
                    );
                }
                // An I/O error disabled the log (the writer said so).
                SendOutcome::Closed => self.lookup_log = None,
            }
        }
        if hashes.is_empty() {
            return early(self, "empty_chunk_hashes");
        }
        self.metrics.lookup_requested_tokens += (hashes.len() * self.cfg.chunk_size) as u64;
        let num_ranks = ranks.len();
        let objs = Self::object_keys(model, salt, &hashes, ranks);
        let parts = self.split(&objs);
        if self.refused(&to, involved(&parts)) {
            return early(self, "shard_unavailable");
        }
        let seq = self.next_seq;
        // One key list per involved shard, in the order fan_out visits them.
        let sent: Vec<Vec<ObjectKey>> = parts
            .iter()
            .filter(|idx| !idx.is_empty())
            .map(|idx| idx.iter().map(|i| objs[*i]).collect())
            .collect();
        let size = layout.bytes;
        let kind = InflightKind::Lookup {
            lookup: PendingLoad {
                request_id: rid.clone(),
                job_seq: seq,
                keys: objs,
                found: Vec::new(),
                slabs: Vec::new(),
                num_ranks,
                world_size: key.world_size as u32,
                readers,
                size,
                sent_at: now,
            },
        };
        let mut sent = sent.into_iter();
        let deadline = self.l2_deadline(now);
        let immediate = self.fan_out(parts, kind, |_| ShardOp::Lookup {
            keys: sent.next().unwrap_or_default(),
            readers,
            size,
            deadline,
        });
        debug_assert!(
            immediate.is_none(),
            "a non-empty lookup always involves a shard"
        );
        // A status query read after this is held until the shards answer.
        self.set_job(rid, Some(seq));
    }

    /// First half of a finished lookup: plans the prefix from L1 and L2 hits,
    /// releases every lock beyond it, and either concludes or starts loading
    /// the prefix's L2 hits into L1.
    fn finish_lookup(&mut self, seq: Seq, mut p: PendingLoad) -> Option<(Vec<Waiter>, i64)> {
        let nr = p.num_ranks;
        let num_chunks = p.keys.len() / nr;
        let prefix = (0..num_chunks)
            .take_while(|c| {
                p.found[c * nr..(c + 1) * nr]
                    .iter()
                    .all(|f| *f != FOUND_MISS)
            })
            .count();
        let current = self.is_current(&p.request_id, seq);
        // Locks beyond the prefix are not needed; a superseded lookup keeps none.
        let keep = if current { prefix * nr } else { 0 };
        self.release_found(&p.keys[keep..], &p.found[keep..], p.readers);
        if !current {
            return None;
        }
        p.keys.truncate(keep);
        p.found.truncate(keep);
        p.slabs.truncate(keep);
        if p.found.iter().all(|f| *f == FOUND_L1) {
            self.grant_lease(&p);
            return self.conclude_lookup(&p.request_id, prefix, nr, 0);
        }
        // Status queries held through the first phase learn the job runs on.
        for to in self.jobs.begin_load(&p.request_id) {
            self.reply(&to, None);
        }
        let (job_seq, deadline) = (p.job_seq, self.l2_deadline(p.sent_at));
        if self.loads_inflight < self.cfg.l2.prefetch_max_in_flight {
            self.start_load(p);
        } else {
            self.load_queue.push_back(p);
        }
        if let Some(d) = deadline {
            if d.at <= self.clock.now() {
                // The L2 check took the whole wait: conclude now; the loads
                // started above still land.
                self.conclude_at_deadline(job_seq);
            } else {
                self.load_deadlines.insert((d.at, job_seq));
            }
        }
        None
    }

    /// The deadline for L2 of a lookup that arrived at `arrived`; `None`
    /// when `--l2-prefetch-load-timeout` is 0 or there is no L2.
    fn l2_deadline(&self, arrived: Instant) -> Option<L2Deadline> {
        let limit = self.cfg.l2.prefetch_load_timeout;
        (!limit.is_zero() && !self.cfg.l2.adapters.is_empty()).then(|| L2Deadline {
            at: arrived + limit,
            limit,
        })
    }

    /// The lookup of job `job_seq` ran out of time for its L2 loads: it
    /// concludes with the prefix L1 held when it was looked up (those locks
    /// go to its lease, the rest are released); the loads running go on, and
    /// what they load is released when they end (it stays in L1 for the
    /// next request); loads still queued are dropped. Nothing when the job
    /// concluded or was superseded already.
    fn conclude_at_deadline(&mut self, job_seq: Seq) {
        let jobs = &self.jobs;
        let found = self
            .inflight
            .values_mut()
            .find_map(|inf| match &mut inf.kind {
                InflightKind::Load { load, .. } if load.job_seq == job_seq => Some(load),
                _ => None,
            })
            .or_else(|| self.load_queue.iter_mut().find(|p| p.job_seq == job_seq));
        let Some(p) = found.filter(|p| jobs.is_current(&p.request_id, job_seq)) else {
            return;
        };
        let nr = p.num_ranks;
        let prefix = (0..p.keys.len() / nr)
            .take_while(|c| p.found[c * nr..(c + 1) * nr].iter().all(|f| *f == FOUND_L1))
            .count();
        let keep = prefix * nr;
        let beyond: Vec<ObjectKey> = (keep..p.keys.len())
            .filter(|&i| p.found[i] == FOUND_L1)
            .map(|i| p.keys[i])
            .collect();
        // Handed to the lease or released here: whatever ends the load
        // later no longer sees these locks.
        for f in p.found.iter_mut().filter(|f| **f == FOUND_L1) {
            *f = FOUND_MISS;
        }
        let rid = p.request_id.clone();
        let (ws, readers, sent_at) = (p.world_size, p.readers, p.sent_at);
        let lease_keys = p.keys[..keep].to_vec();
        let lease_slabs = p.slabs[..keep].to_vec();
        self.post(beyond, |keys| ShardOp::Release {
            keys,
            count: readers,
        });
        if keep > 0 {
            let ranks: Vec<u32> = lease_keys[..nr].iter().map(|k| k.kv_rank).collect();
            self.leases.grant(Grant {
                request_id: &rid,
                world_size: ws,
                ranks: &ranks,
                keys: &lease_keys,
                slabs: &lease_slabs,
                readers,
                sent_at,
            });
        }
        self.metrics.lookups_cut_at_deadline += 1;
        log_limited!(
            Level::Warn,
            "lookup {rid}: L2 did not answer within --l2-prefetch-load-timeout ({:?}): \
             concluded with the {prefix} chunks L1 holds; the loads running go on",
            self.cfg.l2.prefetch_load_timeout
        );
        if let Some((waiters, hits)) = self.conclude_lookup(&rid, prefix, nr, 0) {
            self.answer_waiters(waiters, hits);
        }
    }

    /// Records the read locks a concluded lookup holds on its prefix (`p.keys`)
    /// for the workers that will read it.
    fn grant_lease(&mut self, p: &PendingLoad) {
        if p.keys.len() < p.num_ranks || p.num_ranks == 0 {
            return;
        }
        let ranks: Vec<u32> = p.keys[..p.num_ranks].iter().map(|k| k.kv_rank).collect();
        self.leases.grant(Grant {
            request_id: &p.request_id,
            world_size: p.world_size,
            ranks: &ranks,
            keys: &p.keys,
            slabs: &p.slabs,
            readers: p.readers,
            sent_at: p.sent_at,
        });
    }

    fn is_current(&self, rid: &str, seq: Seq) -> bool {
        self.jobs.is_current(rid, seq)
    }

    /// Releases what a lookup holds on `keys`: `readers` L1 read locks on L1
    /// hits, one L2 lock on L2 hits.
    fn release_found(&mut self, keys: &[ObjectKey], found: &[u8], readers: u32) {
        let mut l1 = Vec::new();
        let mut l2: Vec<Vec<(ObjectKey, u8)>> = vec![Vec::new(); self.shards.len()];
        let n = self.shards.len();
        for (k, f) in keys.iter().zip(found) {
            match *f {
                FOUND_MISS => {}
                FOUND_L1 => l1.push(*k),
                code => l2[k.shard(n)].push((*k, code)),
            }
        }
        self.post(l1, |keys| ShardOp::Release {
            keys,
            count: readers,
        });
        for (shard, keys) in l2.into_iter().enumerate() {
            if !keys.is_empty() {
                self.send(
                    shard,
                    ShardMsg {
                        seq: 0,
                        op: ShardOp::UnlockL2 { keys },
                    },
                );
            }
        }
    }

    fn start_load(&mut self, p: PendingLoad) {
        if !self.is_current(&p.request_id, p.job_seq) {
            // Superseded or ended while queued.
            self.release_found(&p.keys, &p.found, p.readers);
            return self.next_load();
        }
        self.loads_inflight += 1;
        let loading: Vec<usize> = (0..p.keys.len())
            .filter(|&i| p.found[i] >= FOUND_L2)
            .collect();
        let lkeys: Vec<(ObjectKey, u8)> =
            loading.iter().map(|&i| (p.keys[i], p.found[i])).collect();
        let n = self.shards.len();
        let mut parts = vec![Vec::new(); n];
        for (j, (k, _)) in lkeys.iter().enumerate() {
            parts[k.shard(n)].push(j);
        }
        self.next_load_tag += 1;
        let tag = LOAD_TAG_BIT | self.next_load_tag;
        let (size, readers) = (p.size, p.readers);
        let deadline = self.l2_deadline(p.sent_at);
        let kind = InflightKind::Load {
            loaded: vec![false; lkeys.len()],
            slabs: vec![NO_SLAB; lkeys.len()],
            load: p,
            loading,
        };
        let immediate = self.fan_out(parts, kind, |idx| ShardOp::Load {
            keys: idx.iter().map(|&j| lkeys[j]).collect(),
            size,
            readers,
            tag,
            deadline,
        });
        debug_assert!(immediate.is_none(), "a load always involves a shard");
    }

    fn next_load(&mut self) {
        while self.loads_inflight < self.cfg.l2.prefetch_max_in_flight {
            let Some(p) = self.load_queue.pop_front() else {
                return;
            };
            if self.is_current(&p.request_id, p.job_seq) {
                return self.start_load(p);
            }
            self.release_found(&p.keys, &p.found, p.readers);
        }
    }

    /// Second half: the prefix is what is in L1 now (hits and loaded objects).
    fn finish_load(
        &mut self,
        mut p: PendingLoad,
        loading: &[usize],
        loaded: &[bool],
        slabs: &[u64],
    ) -> Option<(Vec<Waiter>, i64)> {
        self.loads_inflight -= 1;
        let nr = p.num_ranks;
        // Per key: readable in L1 now (holding `readers` locks), and where.
        let mut ok: Vec<bool> = p.found.iter().map(|f| *f == FOUND_L1).collect();
        for ((&i, &l), &at) in loading.iter().zip(loaded).zip(slabs) {
            ok[i] = l;
            p.slabs[i] = if l { at } else { NO_SLAB };
        }
        let num_chunks = p.keys.len() / nr;
        let prefix = (0..num_chunks)
            .take_while(|c| ok[c * nr..(c + 1) * nr].iter().all(|b| *b))
            .count();
        let current = self.is_current(&p.request_id, p.job_seq);
        let keep = if current { prefix * nr } else { 0 };
        let release: Vec<ObjectKey> = p.keys[keep..]
            .iter()
            .zip(&ok[keep..])
            .filter(|(_, ok)| **ok)
            .map(|(k, _)| *k)
            .collect();
        self.post(release, |keys| ShardOp::Release {
            keys,
            count: p.readers,
        });
        let failed = loaded.iter().filter(|l| !**l).count();
        if failed > 0 {
            log_limited!(Level::Warn,
                "lookup {}: {failed} objects found in L2 could not be loaded; the hit prefix is cut at the first",
                p.request_id
            );
        }
        self.next_load();
        if !current {
            return None;
        }
        let l2_chunks = (0..prefix)
            .filter(|c| p.found[c * nr..(c + 1) * nr].iter().any(|f| *f >= FOUND_L2))
            .count();
        p.keys.truncate(keep);
        p.slabs.truncate(keep);
        self.grant_lease(&p);
        self.conclude_lookup(&p.request_id, prefix, nr, l2_chunks)
    }

    /// Records a lookup's result: `prefix` chunks hit, `l2_chunks` of them
    /// (partly) loaded from L2.
    fn conclude_lookup(
        &mut self,
        rid: &str,
        prefix: usize,
        num_ranks: usize,
        l2_chunks: usize,
    ) -> Option<(Vec<Waiter>, i64)> {
        let cs = self.cfg.chunk_size as u64;
        self.metrics.lookup_hit_tokens += prefix as u64 * cs;
        self.metrics.lookup_hit_keys += (prefix * num_ranks) as u64;
        self.metrics.lookup_hit_l2_tokens += l2_chunks as u64 * cs;
        self.metrics.lookup_hit_l2_keys += (l2_chunks * num_ranks) as u64;
        if let Some(s) = self.sessions.get_mut(rid) {
            s.prefetch_hit_chunks = prefix as i64;
        }
        let waiters = self.jobs.take_waiters(rid);
        if waiters.is_empty() {
            self.jobs.finish(rid.to_owned(), prefix as i64);
            None
        } else {
            // The first waiter consumes the result.
            Some((waiters, prefix as i64))
        }
    }

    fn query_prefetch(&mut self, to: ReplyTo, rid: &str, now: Instant) {
        match self.jobs.get(rid) {
            None => self.reply(&to, Some(wire::encode_int(0))),
            Some(Job::Pending { .. }) => {
                // In the first phase the answer is the shards' hop away: hold
                // the query for it. Loading from L2: still running.
                if let Err(to) = self.jobs.hold(rid, to, now + FIRST_PHASE_HOLD) {
                    self.reply(&to, None);
                }
            }
            Some(Job::Done { hit_chunks }) => {
                let n = *hit_chunks;
                self.jobs.remove(rid);
                self.reply(&to, Some(wire::encode_int(n)))
            }
        }
    }

    fn wait_prefetch(&mut self, to: ReplyTo, rid: &str, timeout_s: f64, now: Instant) {
        let wait = if timeout_s.is_finite() && timeout_s > 0.0 {
            Duration::from_secs_f64(timeout_s.min(3600.0))
        } else {
            Duration::ZERO
        };
        if wait.is_zero() {
            return self.query_prefetch(to, rid, now);
        }
        if let Err(to) = self.jobs.park(rid, to, now + wait) {
            self.query_prefetch(to, rid, now);
        }
    }

    fn free_lookup_locks(&mut self, key: &IpcKey, now: Instant) {
        if key.start >= key.end {
            return;
        }
        let rid = key.request_id.clone();
        let hit = match self.sessions.get_mut(&rid).map(|s| s.prefetch_hit_chunks) {
            Some(h) if h >= 0 => h,
            _ => {
                match self.jobs.get(&rid) {
                    Some(Job::Done { hit_chunks }) => {
                        let h = *hit_chunks;
                        self.jobs.remove(&rid);
                        h
                    }
                    Some(Job::Pending { .. }) => {
                        log_limited!(Level::Warn, "free_lookup_locks for {rid} while its lookup is running; its locks expire by TTL");
                        return;
                    }
                    None => {
                        log_limited!(Level::Warn, "free_lookup_locks for {rid} without a lookup result; nothing to release");
                        return;
                    }
                }
            }
        };
        let readers = match u32::try_from(key.num_kv_readers) {
            Ok(r) if r >= 1 => r,
            _ => {
                log_limited!(
                    Level::Error,
                    "free_lookup_locks {rid}: num_kv_readers={} is invalid",
                    key.num_kv_readers
                );
                return;
            }
        };
        let cs = self.cfg.chunk_size as i64;
        let (start_chunk, end_chunk) = (key.start / cs, key.end / cs);
        let hi = end_chunk.min(hit);
        if start_chunk >= hi || key.start < 0 {
            return;
        }
        let ranks = match Self::ranks_of(key) {
            Ok(r) => r,
            Err(e) => return log_limited!(Level::Error, "free_lookup_locks {rid}: {e}"),
        };
        let mut range_key = key.clone();
        range_key.end = hi * cs;
        let hashes = match self.key_hashes(&range_key, false, ranks.len(), now) {
            Ok(h) => h,
            Err(e) => return log_limited!(Level::Error, "free_lookup_locks {rid}: {e}"),
        };
        let (model, salt) = match Self::key_names(&key.model_name, &key.cache_salt) {
            Ok(n) => n,
            Err(e) => return log_limited!(Level::Error, "free_lookup_locks {rid}: {e}"),
        };
        let objs = Self::object_keys(model, salt, &hashes, ranks);
        let (first, nr) = (start_chunk as usize, ranks.len());
        let chunks = objs.iter().enumerate().map(|(i, k)| (first + i / nr, k));
        // Only what the lookup still holds: a repeated call, or one after the
        // locks expired or a forced clear, must not take away another
        // request's locks on the same objects.
        let held = self.leases.released(&rid, chunks, readers, None);
        let asked = objs.len() as u64 * u64::from(clamped(readers));
        let freed: u64 = held.iter().map(|(_, n)| u64::from(*n)).sum();
        if freed < asked {
            self.metrics.unheld_lock_releases += asked - freed;
            log_limited!(
                Level::Warn,
                "free_lookup_locks {rid}: {} of the {asked} read locks asked for are no longer held by \
                 its lookup (released already, expired or cleared); only the rest are released",
                asked - freed
            );
        }
        let mut by_count: Vec<(u32, Vec<ObjectKey>)> = Vec::new();
        for (key, n) in held {
            match by_count.iter_mut().find(|(c, _)| *c == n) {
                Some((_, keys)) => keys.push(key),
                None => by_count.push((n, vec![key])),
            }
        }
        for (count, keys) in by_count {
            self.post(keys, |keys| ShardOp::Release { keys, count });
        }
    }

    fn end_session(&mut self, rid: &str) {
        // The request is over: its waiters get what a timed-out wait gets.
        for Waiter { to, .. } in self.jobs.take_waiters(rid) {
            self.reply(&to, None);
        }
        let Some(s) = self.sessions.remove(rid) else {
            log::debug!("end_session: session {rid} not found");
            return;
        };
        let Some(scope) = s.lookup.as_ref() else {
            return;
        };
        let ranks = Ranks::of(scope.world_size, scope.worker_id);
        let (model, salt) = match Self::key_names(&scope.model_name, &scope.cache_salt) {
            Ok(n) => n,
            Err(e) => return log_limited!(Level::Error, "end_session {rid}: {e}"),
        };
        let objs = Self::object_keys(model, salt, s.all_hashes(), ranks);
        self.post(objs, |keys| ShardOp::Touch { keys });
    }

    fn clear(&mut self, to: Option<ReplyTo>, responder: Option<Responder>, force: bool) {
        if let Some(to) = &to {
            if self.refused(to, 0..self.shards.len()) {
                return self.reply_failure(to);
            }
        }
        if force {
            // Locked objects go too: a lock on a key stored again later is
            // nobody's here.
            self.leases.clear();
        }
        self.broadcast(
            InflightKind::Clear {
                to,
                responder,
                cleared: 0,
            },
            || ShardOp::Clear { force },
        );
    }

    // ------------------------------------------------------- engine_driven

    fn register_engine_driven(
        &mut self,
        p: wire::EngineDrivenPayload,
        now: Instant,
    ) -> Option<Vec<u8>> {
        if !self.cfg.transfer_mode.engine_driven_enabled() {
            log_limited!(Level::Error,
                "register_kv_cache_engine_driven_context from instance {}: engine_driven transfer is not enabled \
                 (--supported-transfer-mode {:?})",
                p.instance_id,
                self.cfg.transfer_mode
            );
            return None;
        }
        let Some((shm_name, pool_size)) = self.setup.shm_pool.clone() else {
            log_limited!(Level::Error,
                "register_kv_cache_engine_driven_context from instance {}: the SHM pool is disabled (--shm-name \"\") \
                 and kvshard does not support the pickle transfer fallback",
                p.instance_id
            );
            return None;
        };
        if let Some(e) = reserved_instance_id(p.instance_id) {
            log_limited!(
                Level::Error,
                "register_kv_cache_engine_driven_context refused: {e}"
            );
            self.metrics.bad_requests += 1;
            return None;
        }
        let reply = wire::encode_register_engine_driven_reply(&shm_name, pool_size);
        if self.registry.touch_engine(p.instance_id, now) {
            log_limited!(
                Level::Info,
                "engine_driven instance {} already registered; refreshing liveness",
                p.instance_id
            );
            return Some(reply);
        }
        let layout = match Layout::engine_driven(&p, self.cfg.chunk_size) {
            Ok(l) => l,
            Err(e) => {
                log_limited!(
                    Level::Error,
                    "register_kv_cache_engine_driven_context from instance {}: {e}",
                    p.instance_id
                );
                self.metrics.bad_requests += 1;
                return None;
            }
        };
        let ws = p.world_size as u32;
        if let Err(e) = self.layouts.register(&p.model_name, ws, &layout) {
            log_limited!(
                Level::Error,
                "register_kv_cache_engine_driven_context from instance {}: {e}",
                p.instance_id
            );
            return None;
        }
        let size = layout.bytes;
        let entry = EngineEntry {
            model_name: p.model_name.clone(),
            world_size: ws,
            layout,
            block_size: p.block_size,
            use_mla: p.use_mla,
            last_seen: now,
            pinged: false,
            kv_ranks: Vec::new(),
        };
        if let Err(e) = self.registry.insert_engine(p.instance_id, entry) {
            self.layouts.unregister(&p.model_name, ws);
            log_limited!(Level::Error, "register_kv_cache_engine_driven_context: {e}");
            return None;
        }
        log_limited!(
            Level::Info,
            "registered engine_driven instance {} (model={}, world_size={ws})",
            p.instance_id,
            p.model_name
        );
        for shard in 0..self.shards.len() {
            self.stock_credits(shard, size, true);
        }
        Some(reply)
    }

    /// Resolves `key` to the object keys of `[start, end)` that worker
    /// instance `iid` transfers, and notes the kv rank it transfers (so that
    /// its departure releases only lookup locks it could have read).
    fn worker_keys(
        &mut self,
        iid: i64,
        key: &IpcKey,
        now: Instant,
    ) -> Result<Vec<ObjectKey>, String> {
        if key.worker_id.is_none() {
            return Err("key has no worker_id".into());
        }
        let ranks = Self::ranks_of(key)?;
        if let Some(rank) = ranks.single() {
            self.registry.note_rank(iid, rank);
        }
        let hashes = self.key_hashes(key, false, ranks.len(), now)?;
        let (model, salt) = Self::key_names(&key.model_name, &key.cache_salt)?;
        Ok(Self::object_keys(model, salt, &hashes, ranks))
    }

    /// The [`TransferKey`] of `key` from instance `iid`. Its token digest is
    /// the session's when the session of `key`'s request holds these tokens
    /// (a prepare's hashing left them there; its commit reuses the digest).
    fn transfer_key(&mut self, iid: i64, key: &IpcKey) -> TransferKey {
        let tokens = match self.sessions.get_mut(&key.request_id) {
            Some(s) if s.tokens() == key.token_ids.as_slice() => s.token_digest(),
            _ => session::token_digest(&key.token_ids),
        };
        TransferKey::new(iid, key, &tokens)
    }

    fn prepare_store(&mut self, to: ReplyTo, key: IpcKey, iid: i64, now: Instant) {
        self.metrics.submitted_stores += 1;
        let Some(layout) = self.registry.engine_layout(iid, now) else {
            log_limited!(Level::Error, "prepare_store: engine_driven context not registered (or reaped) for instance {iid}");
            self.metrics.unregistered_instance += 1;
            return self.reply(&to, Some(wire::encode_prepare_store_reply(&[], &[])));
        };
        let objs = match self.worker_keys(iid, &key, now) {
            Ok(o) => o,
            Err(e) => {
                log_limited!(Level::Error, "prepare_store from instance {iid}: {e}");
                self.metrics.bad_requests += 1;
                return self.reply(&to, Some(wire::encode_prepare_store_reply(&[], &[])));
            }
        };
        // Credits of this size exist only where --write-credits and the
        // shards' memory allow one.
        let credits = self.cfg.write_credits > 0 && self.credit_cap(layout.bytes) > 0;
        if credits && self.prepare_store_on_credits(&to, &key, iid, &objs, &layout) {
            return;
        }
        let tkey = self.transfer_key(iid, &key);
        let size = layout.bytes;
        let kind = InflightKind::PrepareStore {
            to,
            tkey,
            keys: objs.clone(),
            layout,
            slabs: vec![None; objs.len()],
        };
        self.reserve_writes(kind, &objs, size, iid);
    }

    /// Answers a prepare_store from the write credits the shards lent, without
    /// waiting for them: each object the request's lookup did not find gets a
    /// credit of its shard, and the shard is told to stage it there (its
    /// mailbox brings that ahead of the commit). Returns false, having done
    /// nothing, when some shard's credits do not cover its part: the shards
    /// are asked instead (and the credits topped up). The reply goes as soon
    /// as the slots are known; what the commit needs is recorded after it,
    /// before the front reads its next message.
    fn prepare_store_on_credits(
        &mut self,
        to: &ReplyTo,
        key: &IpcKey,
        iid: i64,
        objs: &[ObjectKey],
        layout: &Layout,
    ) -> bool {
        let n = self.shards.len();
        let size = layout.bytes;
        let first_chunk = first_chunk_of(key, self.cfg.chunk_size);
        // The objects of one request are distinct (chained chunk hashes, one
        // kv rank each): none is named twice.
        let skip = self.leases.found(&key.request_id, first_chunk, objs);
        let mut need = vec![0usize; n];
        for (k, skip) in objs.iter().zip(&skip) {
            if !*skip {
                need[k.shard(n)] += 1;
            }
        }
        let short =
            (0..n).find(|&s| need[s] > self.credits[s].get(&size).map_or(0, |p| p.free.len()));
        if let Some(s) = short {
            self.metrics.store_credit_misses += 1;
            let cap = self.credit_cap(size);
            if let Some(pool) = self.credits[s].get_mut(&size) {
                pool.target = pool.target.max(need[s].min(cap));
            }
            self.stock_credits(s, size, true);
            return false;
        }
        let involved: Vec<usize> = (0..n).filter(|&s| need[s] > 0).collect();
        if self.refused(to, involved.iter().copied()) {
            self.reply_failure(to);
            return true;
        }
        let mut per: Vec<Vec<(ObjectKey, Slab)>> = vec![Vec::new(); n];
        let (mut slots, mut indices, mut reserved) = (Vec::new(), Vec::new(), Vec::new());
        for (i, k) in objs.iter().enumerate() {
            if skip[i] {
                continue;
            }
            let s = k.shard(n);
            let slab = self.credits[s]
                .get_mut(&size)
                .and_then(|p| p.free.pop())
                .expect("credits counted above");
            per[s].push((*k, slab));
            slots.push(layout.slot(slab.offset));
            indices.push(i as i64);
            reserved.push(*k);
        }
        self.reply(to, Some(wire::encode_prepare_store_reply(&slots, &indices)));
        if !reserved.is_empty() {
            self.next_credit_tag += 1;
            let tag = LOAD_TAG_BIT | CREDIT_TAG_BIT | self.next_credit_tag;
            // Any earlier prepare's abort goes first, then the adoption.
            let tkey = self.transfer_key(iid, key);
            self.pend_write(tkey, reserved, tag);
            for (s, writes) in per.into_iter().enumerate() {
                if !writes.is_empty() {
                    // Not woken for, nor is the commit's FinishWrite: they
                    // ride along with the shard's next wake-up (a request
                    // that wants its reply, or the lazy one within
                    // LAZY_WAKE_AFTER), far inside the write TTL; mailbox
                    // order keeps a later lookup behind them.
                    let op = ShardOp::AdoptWrite { writes, size, tag };
                    self.send(s, ShardMsg { seq: 0, op });
                }
            }
            self.metrics.store_credit_prepares += 1;
        }
        for s in involved {
            // Short when the next request like this one would find too few.
            let left = self.credits[s].get(&size).map_or(0, |p| p.free.len());
            self.stock_credits(s, size, left < need[s]);
        }
        true
    }

    /// Records `keys`, staged under `tag`, as the pending write of `tkey`; an
    /// earlier prepare of it never committed is abandoned.
    fn pend_write(&mut self, tkey: TransferKey, keys: Vec<ObjectKey>, tag: u64) {
        let pending = PendingWrite { keys, tag };
        if let Some(old) = self.registry.pending_writes.insert(tkey, pending) {
            self.post(old.keys, |keys| ShardOp::AbortWrite { keys, tag: old.tag });
        }
    }

    /// The most credits a shard lends for objects of `size` bytes: 1/64 of
    /// its memory.
    fn credit_cap(&self, size: u64) -> usize {
        let align = self.cfg.l1.align_bytes.max(1);
        let aligned = size.div_ceil(align).saturating_mul(align).max(1);
        let shard_bytes = self.cfg.l1.size_bytes / self.shards.len().max(1) as u64;
        (shard_bytes / 64 / aligned).min(u32::MAX as u64) as usize
    }

    /// Asks shard `shard` for write credits of `size` bytes, up to its pool's
    /// target, when no request for more is out and half of them are used (or
    /// any, when `short`: a request found too few, or the next one like it
    /// would). A short pool has the shard woken for the grant, one asked
    /// earlier included; otherwise the grant rides along with its next
    /// wake-up.
    fn stock_credits(&mut self, shard: usize, size: u64, short: bool) {
        let first = (self.cfg.write_credits as usize).min(self.credit_cap(size));
        if first == 0 || self.dead[shard] {
            return;
        }
        let pool = self.credits[shard]
            .entry(size)
            .or_insert_with(|| CreditPool {
                free: Vec::new(),
                asked: false,
                target: first,
            });
        let target = pool.target;
        if pool.asked {
            if short {
                self.mark_unwoken(shard);
            }
            return;
        }
        // Topped up once half is used: one grant per few requests.
        let low = if short { target } else { target.div_ceil(2) };
        if pool.free.len() >= low {
            return;
        }
        pool.asked = true;
        let count = target - pool.free.len();
        let mut parts = vec![Vec::new(); self.shards.len()];
        parts[shard] = (0..count).collect();
        let kind = InflightKind::Credits {
            shard,
            size,
            slabs: vec![None; count],
        };
        let grant = |_: &[usize]| ShardOp::GrantCredits {
            size,
            count: count as u32,
        };
        // Woken for only when short: otherwise the credits left cover the
        // next request meanwhile.
        if let Some(kind) = self.fan_out_waking(parts, kind, short, grant) {
            self.complete(0, kind); // not reached: the shard's part is not empty
        }
    }

    /// Shard `shard` lent `slabs` of `size` bytes: pooled, or given back when
    /// no registration uses that size any more.
    fn credits_granted(&mut self, shard: usize, size: u64, slabs: Vec<Slab>) {
        let wanted = self.registry.engine_sizes().contains(&size);
        match self.credits[shard].get_mut(&size) {
            Some(pool) if wanted => {
                pool.asked = false;
                pool.free.extend(slabs);
            }
            _ => {
                self.credits[shard].remove(&size);
                if !slabs.is_empty() {
                    let op = ShardOp::ReturnCredits { slabs };
                    self.send(shard, ShardMsg { seq: 0, op });
                }
            }
        }
    }

    /// Gives back the credits of sizes no engine_driven registration uses.
    fn trim_credits(&mut self) {
        let sizes = self.registry.engine_sizes();
        for shard in 0..self.shards.len() {
            let unused: Vec<u64> = self.credits[shard]
                .keys()
                .filter(|s| !sizes.contains(s))
                .copied()
                .collect();
            for size in unused {
                let pool = self.credits[shard].remove(&size).expect("listed above");
                if !pool.free.is_empty() {
                    let op = ShardOp::ReturnCredits { slabs: pool.free };
                    self.send(shard, ShardMsg { seq: 0, op });
                }
                if pool.asked {
                    // Its grant is given back when it arrives (`credits_granted`).
                    let asked = CreditPool {
                        free: Vec::new(),
                        ..pool
                    };
                    self.credits[shard].insert(size, asked);
                }
            }
        }
    }

    /// Reserves the L1 writes of `keys` (`size` bytes each, writer `iid`) on
    /// their shards; `kind` collects the slabs.
    fn reserve_writes(&mut self, kind: InflightKind, keys: &[ObjectKey], size: u64, iid: i64) {
        let parts = self.split(keys);
        if let InflightKind::PrepareStore { to, .. } | InflightKind::CudaStore { to, .. } = &kind {
            if self.refused(to, involved(&parts)) {
                return self.reply_failure(to);
            }
        }
        let tag = writer_tag(iid);
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::ReserveWrite {
            keys: idx.iter().map(|i| keys[*i]).collect(),
            size,
            tag,
        }) {
            self.complete(0, kind);
        }
    }

    fn commit_store(&mut self, key: &IpcKey, iid: i64, inline_bytes: usize, now: Instant) -> bool {
        if inline_bytes > 0 {
            log_limited!(
                Level::Error,
                "commit_store from instance {iid} carries {inline_bytes} bytes of inline (pickled) data: \
                 kvshard does not support the pickle transfer fallback; the worker must map the SHM pool \
                 advertised at registration"
            );
            self.metrics.bad_requests += 1;
            self.metrics.pickle_refused += 1;
            return false;
        }
        self.registry.touch_traffic(iid, now);
        let tkey = self.transfer_key(iid, key);
        let Some(PendingWrite { keys, tag }) = self.registry.pending_writes.remove(&tkey) else {
            log_limited!(
                Level::Warn,
                "commit_store from instance {iid} without a pending prepare_store"
            );
            self.metrics.bad_requests += 1;
            return false;
        };
        let n = keys.len() as u64;
        // Shards run their mailbox in order: a lookup sent after this sees the
        // objects. Not woken for (see `lazy`): the writer is answered already.
        self.post(keys, |keys| ShardOp::FinishWrite { keys, tag });
        self.metrics.stored_chunks += n;
        self.metrics.finished_stores += 1;
        true
    }

    fn prepare_retrieve(&mut self, to: ReplyTo, key: IpcKey, iid: i64, now: Instant) {
        self.metrics.submitted_retrieves += 1;
        let Some(layout) = self.registry.engine_layout(iid, now) else {
            log_limited!(Level::Error, "prepare_retrieve: engine_driven context not registered (or reaped) for instance {iid}");
            self.metrics.unregistered_instance += 1;
            return self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[])));
        };
        let objs = match self.worker_keys(iid, &key, now) {
            Ok(o) if !o.is_empty() => o,
            Ok(_) => return self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[]))),
            Err(e) => {
                log_limited!(Level::Error, "prepare_retrieve from instance {iid}: {e}");
                self.metrics.bad_requests += 1;
                return self.reply(&to, Some(wire::encode_prepare_retrieve_reply(false, &[])));
            }
        };
        let parts = self.split(&objs);
        if self.refused(&to, involved(&parts)) {
            return self.reply_failure(&to);
        }
        let first_chunk = first_chunk_of(&key, self.cfg.chunk_size);
        // The request's lookup holds these objects locked where it found them:
        // no shard needs asking.
        if let Some(offsets) = self
            .leases
            .readable(&key.request_id, first_chunk, &objs, now)
        {
            self.metrics.retrieves_from_lease += 1;
            let take = self.hand_over_locks(&key.request_id, first_chunk, &objs, iid);
            debug_assert!(
                !take.contains(&true),
                "readable: the lease holds every lock"
            );
            self.reply_reads(&to, &offsets, &layout);
            // After the reply: the commit comes after the front's next read.
            let tkey = self.transfer_key(iid, &key);
            return self.pend_reads(tkey, objs);
        }
        let tkey = self.transfer_key(iid, &key);
        let n = objs.len();
        let keys_ref = objs.clone();
        let take = self.hand_over_locks(&key.request_id, first_chunk, &objs, iid);
        let kind = InflightKind::PrepareRetrieve {
            to,
            tkey,
            keys: objs,
            layout,
            slabs: vec![None; n],
        };
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::ReadLocked {
            keys: idx.iter().map(|i| keys_ref[*i]).collect(),
            take: idx.iter().map(|i| take[*i]).collect(),
        }) {
            self.complete(0, kind);
        }
    }

    /// Passes to a transfer of instance `iid` one of request `rid`'s lookup
    /// locks on each of `keys` (the request's chunks `first_chunk..`, one kv
    /// rank each) where its lease still holds one. Returns per key whether the
    /// transfer got none and must take a lock of its own: a repeated
    /// transfer, or one after the lease was forgotten, never releases a lock
    /// that may be another request's.
    fn hand_over_locks(
        &mut self,
        rid: &str,
        first_chunk: usize,
        keys: &[ObjectKey],
        iid: i64,
    ) -> Vec<bool> {
        let chunks = keys.iter().enumerate().map(|(i, k)| (first_chunk + i, k));
        let held = self.leases.released(rid, chunks, 1, Some(iid));
        // `held` is the keys handed over, in the order of `keys`.
        let mut held = held.iter().map(|(k, _)| k).peekable();
        keys.iter()
            .map(|k| held.next_if(|h| *h == k).is_none())
            .collect()
    }

    /// Answers a `prepare_retrieve` whose objects are all read-locked at
    /// `offsets`, this transfer holding one lock on each, which
    /// `commit_retrieve` (or the worker's departure) releases: see
    /// [`Front::pend_reads`], called right after.
    fn reply_reads(&mut self, to: &ReplyTo, offsets: &[u64], layout: &Layout) {
        let slots: Vec<_> = offsets.iter().map(|o| layout.slot(*o)).collect();
        self.reply(to, Some(wire::encode_prepare_retrieve_reply(true, &slots)));
    }

    /// Records the read-locked `keys` of transfer `tkey` for its commit; an
    /// earlier prepare of it never committed gives its locks back.
    fn pend_reads(&mut self, tkey: TransferKey, keys: Vec<ObjectKey>) {
        if let Some(old) = self.registry.push_pending_read(tkey, keys) {
            self.post(old, |keys| ShardOp::Release { keys, count: 1 });
        }
    }

    fn commit_retrieve(&mut self, key: &IpcKey, iid: i64, now: Instant) -> bool {
        self.registry.touch_traffic(iid, now);
        let tkey = self.transfer_key(iid, key);
        match self.registry.pop_pending_read(&tkey) {
            Some(keys) => {
                let n = keys.len() as u64;
                self.post(keys, |keys| ShardOp::Release { keys, count: 1 });
                self.metrics.retrieved_chunks += n;
                self.metrics.finished_retrieves += 1;
                true
            }
            None => {
                log_limited!(
                    Level::Warn,
                    "commit_retrieve from instance {iid} without a pending prepare_retrieve"
                );
                self.metrics.bad_requests += 1;
                false
            }
        }
    }

    // ------------------------------------------------------ lmcache_driven

    /// STORE/RETRIEVE from an instance with no lmcache_driven registration:
    /// 0.5.6's `(b"", False)`. A refused GPU worker was told why once, at
    /// registration, so its transfers are logged at debug only.
    fn reply_unregistered_transfer(&mut self, to: &ReplyTo, op: &str, iid: i64) {
        let level = if self.refused.contains(iid) {
            Level::Debug
        } else {
            Level::Error
        };
        log_limited!(
            level,
            "{op}: no lmcache_driven registration for instance {iid}"
        );
        self.metrics.unregistered_instance += 1;
        self.reply(to, Some(wire::encode_store_reply(b"", false)))
    }

    /// Refuses a registration carrying CUDA descriptors (true), recording the
    /// instance so its PINGs report it unhealthy; a repeat only refreshes it.
    fn refuse_cuda(
        &mut self,
        iid: i64,
        kv_cache: &[wire::IpcData],
        model_name: &str,
        world_size: i64,
        now: Instant,
    ) -> bool {
        if kvshard_dataplane::cuda_refusal::cuda_descriptor(kv_cache).is_none() {
            return false;
        }
        if self.refused.touch(iid, now) {
            return true;
        }
        let host = self.cuda_host.get_or_insert_with(CudaHost::probe);
        let alt = Alternatives {
            shm_name: self.setup.shm_pool.as_ref().map(|(n, _)| n.as_str()),
            engine_driven_enabled: self.cfg.transfer_mode.engine_driven_enabled(),
        };
        let gate = match (self.cfg.cuda_transfer, &self.setup.l1_memory) {
            (false, _) => CudaGate::Off,
            (true, None) => CudaGate::SlabL1,
            (true, Some(_)) => CudaGate::On,
        };
        let Some(refusal) = kvshard_dataplane::cuda_refusal::check(kv_cache, host, alt, gate)
        else {
            return false;
        };
        self.refuse_with(iid, refusal, model_name, world_size, now);
        true
    }

    /// Records GPU instance `iid` as refused (its PINGs then answer False).
    fn refuse_with(
        &mut self,
        iid: i64,
        refusal: Refusal,
        model_name: &str,
        world_size: i64,
        now: Instant,
    ) {
        self.metrics.failed_registrations += 1;
        self.metrics.refused_cuda_registrations += 1;
        log_limited!(
            Level::Error,
            "register_kv_cache from GPU instance {iid} (model={model_name}, world_size={world_size}, {} descriptors) refused: {}",
            refusal.descriptor,
            refusal.reason
        );
        self.refused.insert(
            iid,
            RefusedEntry {
                model_name: model_name.to_owned(),
                world_size,
                descriptor: refusal.descriptor,
                reason: refusal.reason,
                last_seen: now,
            },
        );
    }

    /// Hands a CUDA registration to its GPU's device thread; the answer
    /// comes back as [`CudaEvent::Registered`].
    #[allow(clippy::too_many_arguments)]
    fn register_cuda(
        &mut self,
        iid: i64,
        kv_cache: &[wire::IpcData],
        model_name: String,
        ws: u32,
        layout_hints: &kvshard_wire::msgpack::Value,
        groups: &[wire::EngineGroupInfo],
        now: Instant,
    ) {
        let descriptor =
            kvshard_dataplane::cuda_refusal::cuda_descriptor(kv_cache).unwrap_or("cuda");
        let (Some(CudaHost::Present(env)), Some(mem)) = (&self.cuda_host, &self.setup.l1_memory)
        else {
            // refuse_cuda took every other case.
            return;
        };
        let (env, mem) = (env.clone(), mem.clone());
        let refuse = |reason: String| Refusal { descriptor, reason };
        let built = kvshard_dataplane::cuda_transfer::build(
            kv_cache,
            groups,
            layout_hints,
            self.cfg.chunk_size,
            self.cfg.null_block_id,
            &env.devices,
        );
        let (instance, spec) = match built {
            Ok(b) => b,
            Err(e) => return self.refuse_with(iid, refuse(e), &model_name, ws as i64, now),
        };
        if let Err(e) = self.layouts.register(&model_name, ws, &instance.layout()) {
            return self.refuse_with(iid, refuse(e), &model_name, ws as i64, now);
        }
        if self.cuda_threads.is_none() {
            match CudaExecutor::start(env, &mem) {
                Ok(x) => self.cuda_threads = Some(Arc::new(x)),
                Err(e) => {
                    self.layouts.unregister(&model_name, ws);
                    return self.refuse_with(iid, refuse(e), &model_name, ws as i64, now);
                }
            }
        }
        let Some(threads) = &self.cuda_threads else {
            return;
        };
        let tx = self.setup.events.clone();
        let job = DeviceJob::Register {
            iid,
            spec,
            done: Box::new(move |result| {
                tx.send(FrontEvent::Cuda(CudaEvent::Registered { iid, result }));
            }),
        };
        let ordinal = instance.ordinal;
        if threads.submit(ordinal, job).is_err() {
            self.layouts.unregister(&model_name, ws);
            let reason =
                format!("the CUDA device thread of GPU {ordinal} is not taking work (see the log)");
            return self.refuse_with(iid, refuse(reason), &model_name, ws as i64, now);
        }
        log_limited!(
            Level::Info,
            "setting up lmcache_driven CUDA instance {iid} (model={model_name}, world_size={ws}, {} layers, GPU {ordinal})",
            kv_cache.len()
        );
        self.cuda_regs.insert(
            iid,
            PendingRegistration {
                model_name,
                world_size: ws,
                descriptor,
                instance,
                replies: Vec::new(),
                since: now,
            },
        );
    }

    fn on_cuda_event(&mut self, ev: CudaEvent) {
        let now = self.clock.now();
        match ev {
            CudaEvent::Registered { iid, result } => {
                let Some(mut p) = self.cuda_regs.remove(&iid) else {
                    // Unregistered while it was being set up: undone already.
                    return;
                };
                let replies = std::mem::take(&mut p.replies);
                self.finish_cuda_registration(iid, p, result, now);
                for to in &replies {
                    self.reply(to, None);
                }
            }
            CudaEvent::Transferred { seq, result } => match self.cuda_ops.remove(&seq) {
                Some(op) => self.finish_cuda_op(op, result),
                None => log_limited!(
                    Level::Error,
                    "CUDA transfer {seq} finished but nobody waits for it"
                ),
            },
        }
    }

    /// Answers the REGISTER_KV_CACHE requests of set-ups that have taken
    /// longer than [`CUDA_SETUP_ANSWER`].
    fn answer_slow_cuda_setups(&mut self, now: Instant) {
        let mut late = Vec::new();
        for (iid, p) in &mut self.cuda_regs {
            if !p.replies.is_empty() && now.duration_since(p.since) >= CUDA_SETUP_ANSWER {
                late.push((*iid, std::mem::take(&mut p.replies)));
            }
        }
        for (iid, replies) in late {
            log_limited!(
                Level::Warn,
                "lmcache_driven CUDA instance {iid} is still being set up after {} s; its \
                 registration is answered now and its transfers fail until the set-up ends",
                CUDA_SETUP_ANSWER.as_secs()
            );
            for to in &replies {
                self.reply(to, None);
            }
        }
    }

    /// Registers (or refuses) a CUDA instance whose set-up on its GPU ended.
    fn finish_cuda_registration(
        &mut self,
        iid: i64,
        p: PendingRegistration,
        result: Result<(), String>,
        now: Instant,
    ) {
        let ordinal = p.instance.ordinal;
        if let Err(e) = result {
            self.layouts.unregister(&p.model_name, p.world_size);
            let refusal = Refusal {
                descriptor: p.descriptor,
                reason: format!("setting it up on GPU {ordinal} failed: {e}"),
            };
            return self.refuse_with(iid, refusal, &p.model_name, p.world_size as i64, now);
        }
        let entry = LmcEntry {
            model_name: p.model_name.clone(),
            world_size: p.world_size,
            layout: p.instance.layout(),
            reg: LmcTransfer::Cuda(Arc::new(p.instance)),
            last_seen: now,
            pinged: false,
            kv_ranks: Vec::new(),
        };
        if let Err(e) = self.registry.insert_lmc(iid, entry) {
            self.layouts.unregister(&p.model_name, p.world_size);
            self.cuda_unregister(iid, ordinal);
            return log_limited!(Level::Error, "register_kv_cache: {e}");
        }
        log_limited!(
            Level::Info,
            "registered lmcache_driven CUDA instance {iid} (model={}, world_size={}, GPU {ordinal})",
            p.model_name,
            p.world_size
        );
    }

    /// Drops instance `iid` on its device thread (after its queued work).
    fn cuda_unregister(&mut self, iid: i64, ordinal: usize) {
        if let Some(threads) = &self.cuda_threads {
            if threads
                .submit(ordinal, DeviceJob::Unregister { iid })
                .is_err()
            {
                log_limited!(
                    Level::Error,
                    "cannot release CUDA instance {iid} on GPU {ordinal}: its device thread is not taking work"
                );
            }
        }
    }

    /// Queues a transfer's copies; `op` is finished when they end.
    fn submit_cuda_transfer(
        &mut self,
        ordinal: usize,
        iid: i64,
        dir: CopyDir,
        event: Vec<u8>,
        chunks: Vec<ChunkCopy>,
        op: CudaOp,
    ) {
        if !event.is_empty() && event.len() != 64 {
            let e = format!(
                "the worker sent a {}-byte event handle where CUDA's are 64 bytes{}",
                event.len(),
                if event.len() == 81 {
                    " (81 bytes is lmcache's isolated_ipc timeline-semaphore form, which kvshard \
                     does not support: turn lmcache.mp.isolated_ipc off on the worker)"
                } else {
                    ""
                }
            );
            return self.finish_cuda_op(op, Err(e));
        }
        let seq = self.alloc_seq();
        let tx = self.setup.events.clone();
        let job = DeviceJob::Transfer {
            iid,
            dir,
            worker_event: (!event.is_empty()).then_some(event),
            chunks,
            done: Box::new(move |result| {
                tx.send(FrontEvent::Cuda(CudaEvent::Transferred { seq, result }));
            }),
        };
        let submitted = match &self.cuda_threads {
            Some(t) => t.submit(ordinal, job).is_ok(),
            None => false,
        };
        if submitted {
            self.cuda_ops.insert(seq, op);
        } else {
            let e = format!("the CUDA device thread of GPU {ordinal} is not taking work");
            self.finish_cuda_op(op, Err(e));
        }
    }

    /// Settles a CUDA transfer: commits or releases what it held, and answers.
    fn finish_cuda_op(&mut self, op: CudaOp, result: Result<Vec<u8>, String>) {
        match op {
            CudaOp::Store { to, iid, keys } => {
                self.metrics.finished_stores += 1;
                let reply = match result {
                    Ok(handle) => {
                        self.metrics.stored_chunks += keys.len() as u64;
                        // Posted before the reply: a lookup sent after the
                        // reply reaches each shard after its commit.
                        self.post(keys, |keys| ShardOp::FinishWrite {
                            keys,
                            tag: writer_tag(iid),
                        });
                        wire::encode_store_reply(&handle, true)
                    }
                    Err(e) => {
                        log_limited!(Level::Error, "store from CUDA instance {iid} failed: {e}");
                        self.post(keys, |keys| ShardOp::AbortWrite {
                            keys,
                            tag: writer_tag(iid),
                        });
                        wire::encode_store_reply(b"", false)
                    }
                };
                self.reply(&to, Some(reply));
            }
            CudaOp::Retrieve { to, iid, locked } => {
                self.metrics.finished_retrieves += 1;
                let n = locked.len() as u64;
                self.post(locked, |keys| ShardOp::Release { keys, count: 1 });
                let reply = match result {
                    Ok(handle) => {
                        self.metrics.retrieved_chunks += n;
                        wire::encode_store_reply(&handle, true)
                    }
                    Err(e) => {
                        log_limited!(
                            Level::Error,
                            "retrieve from CUDA instance {iid} failed: {e}"
                        );
                        self.metrics.retrieve_misses += 1;
                        wire::encode_store_reply(b"", false)
                    }
                };
                self.reply(&to, Some(reply));
            }
        }
    }

    /// A CUDA STORE's objects are reserved: copy into the reserved ones.
    fn cuda_store_reserved(
        &mut self,
        to: ReplyTo,
        iid: i64,
        keys: Vec<ObjectKey>,
        blocks: Vec<Vec<i64>>,
        event: Vec<u8>,
        slabs: Vec<Option<Slab>>,
    ) {
        let (Some(mem), Some(ordinal)) = (
            self.setup.l1_memory.as_ref().map(|m| m.base),
            self.cuda_ordinal(iid),
        ) else {
            let reserved: Vec<ObjectKey> = keys
                .into_iter()
                .zip(&slabs)
                .filter(|(_, s)| s.is_some())
                .map(|(k, _)| k)
                .collect();
            self.post(reserved, |keys| ShardOp::AbortWrite {
                keys,
                tag: writer_tag(iid),
            });
            return self.reply_unregistered_transfer(&to, "store", iid);
        };
        let mut chunks = Vec::new();
        let mut reserved = Vec::new();
        for ((key, block_ids), slab) in keys.into_iter().zip(blocks).zip(slabs) {
            // Not reserved: already resident (or no room, as 0.5.6 skips it).
            if let Some(slab) = slab {
                chunks.push(ChunkCopy {
                    host_addr: mem + slab.offset as usize,
                    block_ids,
                    skip_blocks: 0,
                });
                reserved.push(key);
            }
        }
        if chunks.is_empty() {
            self.metrics.finished_stores += 1;
            return self.reply(&to, Some(wire::encode_store_reply(b"", true)));
        }
        let op = CudaOp::Store {
            to,
            iid,
            keys: reserved,
        };
        self.submit_cuda_transfer(ordinal, iid, CopyDir::ToHost, event, chunks, op);
    }

    /// A CUDA RETRIEVE found its objects: copy them if every one is
    /// read-locked, else fail and give back the locks it found.
    fn cuda_retrieve_locked(
        &mut self,
        to: ReplyTo,
        iid: i64,
        found: CudaFound,
        blocks: Vec<Vec<i64>>,
        skips: Vec<usize>,
        event: Vec<u8>,
    ) {
        let CudaFound { keys, slabs } = found;
        let locked: Vec<ObjectKey> = keys
            .iter()
            .zip(&slabs)
            .filter(|(_, s)| s.is_some())
            .map(|(k, _)| *k)
            .collect();
        let missing = keys.len() - locked.len();
        let target = match (
            self.setup.l1_memory.as_ref().map(|m| m.base),
            self.cuda_ordinal(iid),
        ) {
            (_, None) => Err(format!("instance {iid} is no longer registered")),
            (None, _) => Err("the L1 is not in memory".to_string()),
            _ if missing > 0 => Err(format!(
                "{missing} of {} chunks are not read-locked by a lookup",
                keys.len()
            )),
            (Some(base), Some(ordinal)) => Ok((base, ordinal)),
        };
        let (base, ordinal) = match target {
            Ok(t) => t,
            Err(e) => {
                let op = CudaOp::Retrieve { to, iid, locked };
                return self.finish_cuda_op(op, Err(e));
            }
        };
        let chunks = slabs
            .into_iter()
            .zip(blocks)
            .zip(skips)
            .map(|((slab, block_ids), skip_blocks)| ChunkCopy {
                host_addr: base + slab.map_or(0, |s| s.offset as usize),
                block_ids,
                skip_blocks,
            })
            .collect();
        let op = CudaOp::Retrieve { to, iid, locked };
        self.submit_cuda_transfer(ordinal, iid, CopyDir::ToDevice, event, chunks, op);
    }

    /// The GPU of a registered CUDA instance.
    fn cuda_ordinal(&mut self, iid: i64) -> Option<usize> {
        match self.registry.lmc_reg(iid, self.clock.now()) {
            Some((LmcTransfer::Cuda(c), _)) => Some(c.ordinal),
            _ => None,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn register_kv_cache(
        &mut self,
        iid: i64,
        kv_cache: &[wire::IpcData],
        model_name: String,
        world_size: i64,
        engine_type: &str,
        layout_hints: &kvshard_wire::msgpack::Value,
        groups: &[wire::EngineGroupInfo],
        now: Instant,
    ) {
        if !self.cfg.transfer_mode.lmcache_driven_enabled() {
            log_limited!(Level::Error, "register_kv_cache from instance {iid}: lmcache_driven transfer is not enabled (--supported-transfer-mode {:?})", self.cfg.transfer_mode);
            return;
        }
        if let Some(e) = reserved_instance_id(iid) {
            self.metrics.bad_requests += 1;
            self.metrics.failed_registrations += 1;
            return log_limited!(Level::Error, "register_kv_cache refused: {e}");
        }
        if self.registry.touch_lmc(iid, now) {
            log_limited!(
                Level::Info,
                "lmcache_driven instance {iid} already registered; refreshing liveness"
            );
            return;
        }
        if self.cuda_regs.contains_key(&iid) {
            return log_limited!(
                Level::Info,
                "lmcache_driven CUDA instance {iid} is still being set up"
            );
        }
        let ws = match u32::try_from(world_size)
            .ok()
            .filter(|w| (1..=keys::MAX_WORLD_SIZE).contains(w))
        {
            Some(w) => w,
            None => {
                return log_limited!(
                    Level::Error,
                    "register_kv_cache from instance {iid}: world_size {world_size} is invalid"
                )
            }
        };
        if self.refuse_cuda(iid, kv_cache, &model_name, world_size, now) {
            return;
        }
        if kvshard_dataplane::cuda_refusal::cuda_descriptor(kv_cache).is_some() {
            return self.register_cuda(iid, kv_cache, model_name, ws, layout_hints, groups, now);
        }
        let reg = match crate::registry::open_cpu_shm(
            kv_cache,
            groups,
            layout_hints,
            engine_type,
            self.cfg.chunk_size,
            self.cfg.null_block_id,
        ) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                self.metrics.failed_registrations += 1;
                return log_limited!(
                    Level::Error,
                    "register_kv_cache from instance {iid} failed: {e}"
                );
            }
        };
        let layout = Layout::from_registration(&reg);
        if let Err(e) = self.layouts.register(&model_name, ws, &layout) {
            self.metrics.failed_registrations += 1;
            return log_limited!(Level::Error, "register_kv_cache from instance {iid}: {e}");
        }
        let entry = LmcEntry {
            model_name: model_name.clone(),
            world_size: ws,
            reg: LmcTransfer::CpuShm(reg),
            layout,
            last_seen: now,
            pinged: false,
            kv_ranks: Vec::new(),
        };
        if let Err(e) = self.registry.insert_lmc(iid, entry) {
            self.layouts.unregister(&model_name, ws);
            return log_limited!(Level::Error, "register_kv_cache: {e}");
        }
        log_limited!(Level::Info, "registered lmcache_driven cpu_shm instance {iid} (model={model_name}, world_size={ws}, {} layers)", kv_cache.len());
    }

    /// Per-chunk block id lists of group 0 (`bpc` ids per chunk, each list
    /// checked by `validate`), or why they do not fit.
    fn chunk_blocks(
        bpc: usize,
        block_ids: &[Vec<i64>],
        num_chunks: usize,
        validate: impl Fn(&[i64]) -> Result<(), String>,
    ) -> Result<Vec<Vec<i64>>, String> {
        let Some(blocks) = block_ids.first() else {
            return Err("block_ids is empty".into());
        };
        if block_ids.len() > 1 {
            return Err(format!(
                "{} KV groups sent; kvshard supports one",
                block_ids.len()
            ));
        }
        if blocks.len() < num_chunks * bpc {
            return Err(format!(
                "{} block ids for {num_chunks} chunks of {bpc} blocks",
                blocks.len()
            ));
        }
        let out: Vec<Vec<i64>> = (0..num_chunks)
            .map(|c| blocks[c * bpc..(c + 1) * bpc].to_vec())
            .collect();
        for b in &out {
            validate(b)?;
        }
        Ok(out)
    }

    /// The chunks of a transfer request: its object keys and their block
    /// lists, or the failure reply already sent.
    fn transfer_chunks(
        &mut self,
        to: &ReplyTo,
        op: &str,
        iid: i64,
        key: &IpcKey,
        block_ids: &[Vec<i64>],
        reg: &LmcTransfer,
    ) -> Option<(Vec<ObjectKey>, Vec<Vec<i64>>)> {
        let chunks = self
            .worker_keys(iid, key, self.clock.now())
            .and_then(|objs| {
                let blocks = match reg {
                    LmcTransfer::CpuShm(r) => {
                        Self::chunk_blocks(r.blocks_per_chunk(), block_ids, objs.len(), |b| {
                            r.validate_block_ids(b).map_err(|e| e.to_string())
                        })
                    }
                    LmcTransfer::Cuda(c) => {
                        Self::chunk_blocks(c.blocks_per_chunk(), block_ids, objs.len(), |b| {
                            c.validate_block_ids(b)
                        })
                    }
                }?;
                Ok((objs, blocks))
            });
        match chunks {
            Ok(c) => Some(c),
            Err(e) => {
                log_limited!(Level::Error, "{op} from instance {iid}: {e}");
                self.metrics.bad_requests += 1;
                self.reply(to, Some(wire::encode_store_reply(b"", false)));
                None
            }
        }
    }

    fn store(
        &mut self,
        to: ReplyTo,
        key: IpcKey,
        iid: i64,
        block_ids: Vec<Vec<i64>>,
        event: Vec<u8>,
        now: Instant,
    ) {
        self.metrics.submitted_stores += 1;
        let Some((reg, layout)) = self.registry.lmc_reg(iid, now) else {
            return self.reply_unregistered_transfer(&to, "store", iid);
        };
        let Some((objs, blocks)) = self.transfer_chunks(&to, "store", iid, &key, &block_ids, &reg)
        else {
            return;
        };
        // All-null chunks carry no KV (align-mode recurrent layers): never store them.
        let null = self.cfg.null_block_id;
        let (objs, blocks): (Vec<ObjectKey>, Vec<Vec<i64>>) = objs
            .into_iter()
            .zip(blocks)
            .filter(|(_, b)| !kvshard_dataplane::cpu_shm::all_null(b, null))
            .unzip();
        let parts = self.split(&objs);
        if self.refused(&to, involved(&parts)) {
            return self.reply_failure(&to);
        }
        let n = objs.len();
        let size = layout.bytes;
        let reg = match reg {
            LmcTransfer::CpuShm(reg) => reg,
            LmcTransfer::Cuda(_) => {
                let kind = InflightKind::CudaStore {
                    to,
                    iid,
                    keys: objs.clone(),
                    blocks,
                    event,
                    slabs: vec![None; n],
                };
                return self.reserve_writes(kind, &objs, size, iid);
            }
        };
        let kind = InflightKind::Store {
            to,
            outcomes: vec![StoreOutcome::AlreadyPresent; n],
        };
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::Store {
            reg: reg.clone(),
            items: idx.iter().map(|i| (objs[*i], blocks[*i].clone())).collect(),
            size,
            tag: writer_tag(iid),
        }) {
            self.complete(0, kind);
        }
    }

    fn retrieve(
        &mut self,
        to: ReplyTo,
        key: IpcKey,
        iid: i64,
        t: Transfer,
        skip: i64,
        now: Instant,
    ) {
        self.metrics.submitted_retrieves += 1;
        let Some((reg, _)) = self.registry.lmc_reg(iid, now) else {
            return self.reply_unregistered_transfer(&to, "retrieve", iid);
        };
        let Some((objs, blocks)) =
            self.transfer_chunks(&to, "retrieve", iid, &key, &t.block_ids, &reg)
        else {
            return;
        };
        let cs = self.cfg.chunk_size;
        let first = first_chunk_of(&key, cs);
        let skip = usize::try_from(skip).unwrap_or(0);
        let parts = self.split(&objs);
        // Before the lease book hears of the locks this request releases.
        if self.refused(&to, involved(&parts)) {
            return self.reply_failure(&to);
        }
        let n = objs.len();
        let reg = match reg {
            LmcTransfer::CpuShm(reg) => reg,
            LmcTransfer::Cuda(c) => {
                let bs = c.geometry.block_size;
                let skips = (0..n)
                    .map(|i| {
                        let tokens = kvshard_dataplane::cpu_shm::chunk_skip_tokens(skip, i, cs);
                        kvshard_dataplane::cuda_transfer::skip_blocks(tokens, bs)
                    })
                    .collect();
                // The lookup's read locks are released once the copies end.
                let take = self.hand_over_locks(&key.request_id, first, &objs, iid);
                let kind = InflightKind::CudaRetrieve {
                    to,
                    iid,
                    keys: objs.clone(),
                    blocks,
                    skips,
                    event: t.event,
                    slabs: vec![None; n],
                };
                if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::ReadLocked {
                    keys: idx.iter().map(|i| objs[*i]).collect(),
                    take: idx.iter().map(|i| take[*i]).collect(),
                }) {
                    self.complete(0, kind);
                }
                return;
            }
        };
        // The shard releases the one lock this transfer holds on each object
        // it finds read-locked: one of the lookup's, or one taken for it.
        let take = self.hand_over_locks(&key.request_id, first, &objs, iid);
        let kind = InflightKind::Retrieve {
            to,
            oks: vec![false; n],
        };
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::Retrieve {
            reg: reg.clone(),
            items: idx
                .iter()
                .map(|i| RetrieveItem {
                    key: objs[*i],
                    blocks: blocks[*i].clone(),
                    skip: kvshard_dataplane::cpu_shm::chunk_skip_tokens(skip, *i, cs),
                    take: take[*i],
                })
                .collect(),
        }) {
            self.complete(0, kind);
        }
    }

    /// Releases what a removed registration held: pending reservations and read
    /// locks, and the lookup locks that no live instance can release any more.
    fn release_instance(&mut self, released: crate::registry::Released) {
        let (iid, model, ws) = released.identity();
        self.layouts.unregister(&model, ws);
        if let crate::registry::Released::Lmc(_, e) = &released {
            if let LmcTransfer::Cuda(c) = &e.reg {
                self.cuda_unregister(iid, c.ordinal);
            }
        }
        // Pending SHM transfers belong to the engine_driven context only.
        if matches!(released, crate::registry::Released::Engine(..)) {
            let (writes, reads) = self.registry.take_pending(iid);
            for PendingWrite { keys, tag } in writes {
                self.post(keys, |keys| ShardOp::AbortWrite { keys, tag });
            }
            for keys in reads {
                self.post(keys, |keys| ShardOp::Release { keys, count: 1 });
            }
        }
        self.release_orphaned_locks(&model, ws, iid);
        self.trim_credits();
    }

    /// Releases the read locks of `model`/`ws` lookups beyond what the live
    /// instances may still read (instance `gone` just left).
    fn release_orphaned_locks(&mut self, model: &str, ws: u32, gone: i64) {
        // A lease past its TTL may hold locks the shard has already expired.
        self.leases.expire(self.clock.now());
        let registry = &self.registry;
        let orphans = self.leases.orphaned(model, ws, |rank, done| {
            registry
                .readers_of(model, ws, rank)
                .iter()
                .filter(|i| !done.contains(i))
                .count() as u32
        });
        if orphans.is_empty() {
            return;
        }
        let total: u64 = orphans.iter().map(|(_, n)| *n as u64).sum();
        self.metrics.orphaned_read_locks += total;
        log_limited!(
            Level::Info,
            "released {total} read locks on {} objects: lookups of model {model} (world size {ws}) \
             held them for workers that are gone (instance {gone} was the last that could read them)",
            orphans.len()
        );
        let mut by_count: HashMap<u32, Vec<ObjectKey>> = HashMap::new();
        for (k, n) in orphans {
            by_count.entry(n).or_default().push(k);
        }
        for (count, keys) in by_count {
            self.post(keys, |keys| ShardOp::Release { keys, count });
        }
    }

    // ------------------------------------------------------------ control

    fn control(&mut self, req: ControlRequest, responder: Responder) {
        match req {
            ControlRequest::Clear { force } => self.clear(None, Some(responder), force),
            ControlRequest::Status
            | ControlRequest::Metrics
            | ControlRequest::QuotaGet { .. }
            | ControlRequest::QuotaList => {
                let n = self.shards.len();
                self.broadcast(
                    InflightKind::Reports {
                        request: req,
                        responder,
                        reports: vec![None; n],
                    },
                    || ShardOp::Status,
                );
            }
            ControlRequest::ResetMetrics => {
                self.metrics = Metrics::default();
                self.post_all(|| ShardOp::ResetStats);
                responder.send(ControlResponse::json(serde_json::json!({"status": "ok"})));
            }
            ControlRequest::QuotaSet {
                cache_salt,
                limit_gb,
            } => {
                // A salt no request could carry names no cache; the table is
                // bounded so that an admin loop cannot grow it (and /quota) without end.
                if let Err(e) = wire::check_cache_salt(&cache_salt) {
                    return responder.send(ControlResponse::bad_request(e));
                }
                if !self.quotas.contains_key(&cache_salt)
                    && self.quotas.len() >= self.cfg.max_quotas
                {
                    log_limited!(
                        Level::Warn,
                        "PUT /quota refused: {} salts hold quotas, the bound of --max-quotas",
                        self.quotas.len()
                    );
                    return responder.send(ControlResponse::bad_request(format!(
                        "{} cache salts already hold quotas, the most --max-quotas allows; \
                         delete one first, or raise --max-quotas",
                        self.quotas.len()
                    )));
                }
                // Python's int() truncates; `as` does too, saturating at u64::MAX.
                let limit_bytes = (limit_gb * GIB) as u64;
                let per_shard = limit_bytes / self.shards.len() as u64;
                self.quotas.insert(cache_salt.clone(), limit_bytes);
                let salt = cache_salt.clone();
                self.post_all(move || ShardOp::SetQuota {
                    cache_salt: salt.clone(),
                    limit_bytes: per_shard,
                });
                responder.send(ControlResponse::json(serde_json::json!({"cache_salt": cache_salt, "limit_gb": limit_gb, "status": "ok"})));
            }
            ControlRequest::QuotaDelete { cache_salt } => {
                let existed = self.quotas.shift_remove(&cache_salt).is_some();
                let salt = cache_salt.clone();
                self.post_all(move || ShardOp::RemoveQuota {
                    cache_salt: salt.clone(),
                });
                let status = if existed { "removed" } else { "not_found" };
                responder.send(ControlResponse::json(
                    serde_json::json!({"cache_salt": cache_salt, "status": status}),
                ));
            }
            ControlRequest::Checksums {
                instance_id,
                block_ids,
                chunk_size_blocks,
                layerwise,
            } => {
                // Hashing a whole KV cache takes a while: keep it off the
                // request path, on at most MAX_CHECKSUM_THREADS threads.
                let work: Box<
                    dyn FnOnce()
                            -> Result<kvshard_dataplane::cpu_shm::ChecksumReport, (u16, String)>
                        + Send,
                > = match self.registry.lmc_reg(instance_id, self.clock.now()) {
                    None => {
                        return responder.send(ControlResponse::error(
                            404,
                            format!("instance_id {instance_id} not registered"),
                        ))
                    }
                    // Each block is read and hashed on every layer: bound what
                    // one request can make a checksum thread do.
                    Some(_) if block_ids.len() > self.cfg.max_checksum_blocks => {
                        return responder.send(ControlResponse::error(
                            400,
                            format!(
                                "{} block_ids asked for, more than the {} one request may \
                                 name (--max-checksum-blocks); split the request",
                                block_ids.len(),
                                self.cfg.max_checksum_blocks
                            ),
                        ))
                    }
                    Some((LmcTransfer::Cuda(c), _)) => {
                        let plan = match c.checksum_plan(&block_ids, chunk_size_blocks, layerwise) {
                            Ok(p) => p,
                            Err(r) => {
                                return responder.send(ControlResponse::error(r.status, r.detail))
                            }
                        };
                        let Some(exec) = self.cuda_threads.clone() else {
                            return responder.send(ControlResponse::error(
                                503,
                                "no CUDA device thread is running".to_string(),
                            ));
                        };
                        Box::new(move || {
                            kvshard_dataplane::cuda_transfer::run_checksums(
                                &exec,
                                c.ordinal,
                                instance_id,
                                plan,
                            )
                            .map_err(|e| (500, e))
                        })
                    }
                    Some((LmcTransfer::CpuShm(reg), _)) => {
                        if let Err(r) = reg.checksum_check(&block_ids, chunk_size_blocks) {
                            return responder.send(ControlResponse::error(r.status, r.detail));
                        }
                        Box::new(move || {
                            reg.checksums(&block_ids, chunk_size_blocks, layerwise)
                                .map_err(|r| (r.status, r.detail))
                        })
                    }
                };
                if self.checksum_threads.load(Ordering::SeqCst) >= MAX_CHECKSUM_THREADS {
                    log_limited!(
                        Level::Warn,
                        "/cache/checksums refused: {MAX_CHECKSUM_THREADS} are already running"
                    );
                    return responder.send(ControlResponse::error(
                        503,
                        format!(
                            "{MAX_CHECKSUM_THREADS} checksum computations are already running \
                             (the most kvshard runs at once); retry when one has finished"
                        ),
                    ));
                }
                // Only this thread increments; the checksum thread
                // decrements when it ends (or never starts).
                let running = RunningGuard::enter(&self.checksum_threads);
                let spawned = std::thread::Builder::new()
                    .name("kvshard-checksums".into())
                    .spawn(move || {
                        let _running = running;
                        responder.send(match work() {
                            Ok(report) => ControlResponse::json(
                                serde_json::to_value(&report).unwrap_or(serde_json::Value::Null),
                            ),
                            Err((status, e)) => ControlResponse::error(status, e),
                        });
                    });
                if let Err(e) = spawned {
                    // The closure (guard and responder with it) is
                    // dropped: the HTTP side answers 503.
                    log_limited!(Level::Error, "cannot start a checksum thread: {e}");
                }
            }
            ControlRequest::Config => {
                let v = serde_json::to_value(&*self.cfg).unwrap_or(serde_json::Value::Null);
                responder.send(ControlResponse::json(v));
            }
            ControlRequest::ConfigAdapters => {
                let adapters: Vec<serde_json::Value> = self
                    .cfg
                    .l2
                    .adapters
                    .iter()
                    .enumerate()
                    .map(|(i, spec)| {
                        serde_json::json!({
                            "index": i,
                            "name": kvshard_dataplane::shard::l2::tier_name(spec, i),
                            "type_name": spec.type_name(),
                            "tier": "l2",
                            "primary": i == 0,
                            "reconfigurable": false,
                            "config": spec.json,
                        })
                    })
                    .collect();
                responder.send(ControlResponse::json(
                    serde_json::json!({ "adapters": adapters }),
                ));
            }
        }
    }

    fn post_all(&mut self, make: impl Fn() -> ShardOp) {
        for i in 0..self.shards.len() {
            self.send(i, ShardMsg { seq: 0, op: make() });
        }
    }

    fn answer_reports(&self, req: &ControlRequest, reports: Vec<ShardReport>) -> ControlResponse {
        match req {
            // Both are rendered by the HTTP side from a snapshot taken here.
            ControlRequest::Status => {
                let snapshot = self.status_snapshot(reports);
                ControlResponse::render(move || ControlBody::Json(snapshot.render()))
            }
            ControlRequest::Metrics => {
                let mut metrics = self.metrics.clone();
                metrics.token_arrays_copied = self.token_cache.hits;
                metrics.token_arrays_decoded = self.token_cache.misses;
                metrics.shard_wakeups = self.shards.iter().map(|s| s.wakeups()).sum();
                let gauges = FrontGauges {
                    sessions: self.sessions.len(),
                    jobs: self.jobs.len(),
                    leases: self.leases.len(),
                    refused_gpu_instances: self.refused.len(),
                    dead_shards: self.dead.iter().filter(|d| **d).count(),
                    overflow_queued: self.overflow.iter().map(Overflow::len).sum(),
                };
                ControlResponse::render(move || {
                    let mut t = PromText::default();
                    metrics.render(&mut t, &reports, gauges);
                    ControlBody::Text(t.finish())
                })
            }
            ControlRequest::QuotaGet { cache_salt } => {
                let usage = self.salt_usage(&reports, cache_salt);
                let limit = self.quotas.get(cache_salt);
                ControlResponse::json(serde_json::json!({
                    "cache_salt": cache_salt,
                    "limit_gb": limit.map_or(0.0, |&b| b as f64 / GIB),
                    "current_usage_gb": usage as f64 / GIB,
                    "exists": limit.is_some(),
                }))
            }
            ControlRequest::QuotaList => {
                let mut users = serde_json::Map::new();
                for (salt, limit) in &self.quotas {
                    let usage = self.salt_usage(&reports, salt);
                    users.insert(salt.clone(), serde_json::json!({"limit_gb": *limit as f64 / GIB, "current_usage_gb": usage as f64 / GIB}));
                }
                ControlResponse::json(serde_json::json!({ "users": users }))
            }
            _ => ControlResponse::error(500, "unexpected report request"),
        }
    }

    /// Bytes a cache_salt holds: in the L2 adapters (as 0.5.6 counts quota
    /// usage), or in L1 when there is no L2 tier.
    fn salt_usage(&self, reports: &[ShardReport], salt: &str) -> u64 {
        if self.cfg.l2.adapters.is_empty() {
            return reports
                .iter()
                .flat_map(|r| r.bytes_by_salt.iter())
                .filter(|(s, _)| s == salt)
                .map(|(_, b)| *b)
                .sum();
        }
        reports
            .iter()
            .flat_map(|r| r.l2.iter())
            .filter_map(|t| t.usage.bytes_by_salt.get(salt))
            .sum()
    }

    /// What `/status` shows, as of now.
    fn status_snapshot(&self, reports: Vec<ShardReport>) -> StatusSnapshot {
        let now = self.clock.now();
        StatusSnapshot {
            taken_at: now,
            started: self.started,
            cfg: self.cfg.clone(),
            reports,
            num_shards: self.shards.len(),
            huge_pages: self.setup.huge_pages.as_str(),
            huge_page_bytes: self.setup.huge_page_bytes,
            arena: self.setup.arena.clone(),
            active_sessions: self.sessions.len(),
            active_prefetch_jobs: self.jobs.len(),
            inflight_loads: self.loads_inflight,
            queued_loads: self.load_queue.len(),
            lmc_ids: self.registry.lmc_ids(),
            lmc_meta: self.registry.lmc_meta(),
            engine_ids: self.registry.engine_ids(),
            engine_meta: self.registry.engine_meta(),
            liveness: self.registry.liveness(),
            refused_gpu_instances: self.refused.to_json(now),
            dead: self.dead.clone(),
            overflow_bound: self.overflow_bound,
            overflow_queued: self.overflow.iter().map(Overflow::len).collect(),
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Counts one running piece of work in a shared counter while it lives.
struct RunningGuard(Arc<AtomicUsize>);

impl RunningGuard {
    fn enter(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        RunningGuard(count.clone())
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The shards a request split into `parts` involves.
fn involved(parts: &[Vec<usize>]) -> impl Iterator<Item = usize> + '_ {
    parts
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(s, _)| s)
}

/// The writer tag of worker instance `iid`'s reservations. Registration
/// refuses the ids whose tags would fall in the L2 loads' space.
fn writer_tag(iid: i64) -> u64 {
    let tag = iid as u64;
    assert!(
        tag & LOAD_TAG_BIT == 0,
        "instance id {iid} is in the internal writer-tag space; registration refuses it"
    );
    tag
}

/// Why an instance id cannot be registered, if it cannot: its writer tag
/// would collide with the L2 loads' (see [`LOAD_TAG_BIT`]).
fn reserved_instance_id(iid: i64) -> Option<String> {
    ((iid as u64) & LOAD_TAG_BIT != 0).then(|| {
        format!(
            "instance id {iid} is negative: kvshard reserves those writer tags for its L2 loads \
             (lmcache's instance ids are never negative)"
        )
    })
}

/// The request's chunk index of a worker key's first object.
fn first_chunk_of(key: &IpcKey, chunk_size: usize) -> usize {
    usize::try_from(key.start).unwrap_or(0) / chunk_size.max(1)
}

fn reap_interval(cfg: &ServerConfig) -> Duration {
    let t = cfg.worker_reap_timeout;
    if t.is_zero() {
        Duration::from_secs(3600)
    } else {
        (t / 4).max(Duration::from_millis(100))
    }
}

/// Marks the items `idx` of a request failed: their shard stopped before it
/// answered. Most kinds start out as failed already (no slab, not loaded, not
/// retrieved, no report); a lookup finds nothing there.
fn fail_items(kind: &mut InflightKind, idx: &[usize]) {
    match kind {
        InflightKind::Lookup { lookup, .. } => {
            if lookup.found.is_empty() {
                lookup.found = vec![FOUND_MISS; lookup.keys.len()];
                lookup.slabs = vec![NO_SLAB; lookup.keys.len()];
            }
            for i in idx {
                lookup.found[*i] = FOUND_MISS;
                lookup.slabs[*i] = NO_SLAB;
            }
        }
        InflightKind::Store { outcomes, .. } => {
            for i in idx {
                outcomes[*i] = StoreOutcome::Failed;
            }
        }
        InflightKind::Load { loaded, slabs, .. } => {
            for i in idx {
                loaded[*i] = false;
                slabs[*i] = NO_SLAB;
            }
        }
        InflightKind::Retrieve { oks, .. } => {
            for i in idx {
                oks[*i] = false;
            }
        }
        InflightKind::PrepareStore { slabs, .. }
        | InflightKind::PrepareRetrieve { slabs, .. }
        | InflightKind::CudaStore { slabs, .. }
        | InflightKind::CudaRetrieve { slabs, .. }
        | InflightKind::Credits { slabs, .. } => {
            for i in idx {
                slabs[*i] = None;
            }
        }
        InflightKind::Clear { .. } | InflightKind::Reports { .. } => {}
    }
}

/// Folds one shard's reply into the request it belongs to.
fn merge(kind: &mut InflightKind, idx: &[usize], shard: usize, body: ShardReplyBody) {
    match (kind, body) {
        (InflightKind::Lookup { lookup, .. }, ShardReplyBody::Found { codes, slabs }) => {
            let n = lookup.keys.len();
            if lookup.found.is_empty() {
                lookup.found = vec![FOUND_MISS; n];
                lookup.slabs = vec![NO_SLAB; n];
            }
            for (i, v) in idx.iter().zip(codes) {
                lookup.found[*i] = v;
            }
            for (i, s) in idx.iter().zip(slabs) {
                lookup.slabs[*i] = s;
            }
        }
        (InflightKind::Load { loaded, slabs, .. }, ShardReplyBody::Loaded { ok, slabs: at }) => {
            for ((i, v), s) in idx.iter().zip(ok).zip(at) {
                loaded[*i] = v;
                slabs[*i] = s;
            }
        }
        (
            InflightKind::PrepareStore { slabs, .. }
            | InflightKind::PrepareRetrieve { slabs, .. }
            | InflightKind::CudaStore { slabs, .. }
            | InflightKind::CudaRetrieve { slabs, .. }
            | InflightKind::Credits { slabs, .. },
            ShardReplyBody::Slabs(s),
        ) => {
            for (i, v) in idx.iter().zip(s) {
                slabs[*i] = v;
            }
        }
        (InflightKind::Store { outcomes, .. }, ShardReplyBody::Stored(o)) => {
            for (i, v) in idx.iter().zip(o) {
                outcomes[*i] = v;
            }
        }
        (InflightKind::Retrieve { oks, .. }, ShardReplyBody::Retrieved(o)) => {
            for (i, v) in idx.iter().zip(o) {
                oks[*i] = v;
            }
        }
        (InflightKind::Clear { cleared, .. }, ShardReplyBody::Count(n)) => *cleared += n,
        (InflightKind::Reports { reports, .. }, ShardReplyBody::Status(r)) => {
            reports[shard] = Some(*r)
        }
        (_, _) => log_limited!(
            Level::Error,
            "shard {shard} answered with a reply of the wrong kind"
        ),
    }
}
