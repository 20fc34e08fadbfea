//! The front end: one thread that owns the ZeroMQ ROUTER socket.
//!
//! It decodes requests, keeps sessions, registrations and prefetch jobs, splits each
//! request's objects by owning shard, sends the parts to the shards' mailboxes and
//! answers the client once every part has come back. Every request gets a reply:
//! a request that fails is answered with what the 0.5.6 client reads as a failure
//! or a miss, and the cause is logged and counted.

mod control;
mod cuda;
mod edge;
mod engine_driven;
mod inflight;
mod lmcache_driven;
mod lookup;
mod shard_link;
mod workers;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_dataplane::cuda_refusal::{CudaHost, RefusedTable};
use kvshard_dataplane::cuda_transfer::{CudaExecutor, CudaOp, L1Memory, PendingRegistration};
use kvshard_dataplane::messages::{FrontEvent, ReplyTo, Seq, ShardMsg, ShardReport};
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_io::mailbox::{MailboxSender, NotifySender};
use kvshard_messages::config::ServerConfig;
use kvshard_wire::{self as wire, InstanceId, Op, Request, RequestError};

use crate::lookup_leases::LeaseBook;
use crate::lookup_log::{LookupHashLog, LookupLogWriter, WRITER_QUEUE_RECORDS};
use crate::metrics::Metrics;
use crate::prefetch::PrefetchJobs;
use crate::registry::{Layouts, Registry};
use crate::session::Sessions;

use cuda::CudaFound;
pub use edge::{Clock, FrontLoop, ReplyPort, SystemClock, Undelivered, ZmqPort};
use engine_driven::CreditPool;
use inflight::{Inflight, InflightKind};
use lmcache_driven::Transfer;
use lookup::PendingLoad;
use shard_link::Overflow;

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
    unknown_pinged: HashSet<InstanceId>,
    cuda_host: Option<CudaHost>,
    /// The CUDA device threads, started with the first CUDA registration.
    cuda_threads: Option<Arc<CudaExecutor>>,
    /// CUDA registrations being set up on their device threads.
    cuda_regs: HashMap<InstanceId, PendingRegistration>,
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
    /// The shard the test hook stops (see `shard_link::TEST_STOP_SHARD_ENV`).
    #[cfg(debug_assertions)]
    test_stop_shard: Option<usize>,
    /// Per shard and object size: write credits lent by the shard, handed to
    /// engine_driven writers without asking it (`--write-credits`).
    credits: Vec<HashMap<u64, CreditPool>>,
    /// The `n` of the next credit writer tag (`WriterTag::credit`).
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

/// Objects (chunks x kv ranks) one request may address: bounds the memory and
/// shard work of a single request (a 128k-token context of 256-token chunks at
/// world size 8 is 4096).
pub const MAX_OBJECTS_PER_REQUEST: usize = 1 << 18;

fn reap_interval(cfg: &ServerConfig) -> Duration {
    let t = cfg.worker_reap_timeout;
    if t.is_zero() {
        Duration::from_secs(3600)
    } else {
        (t / 4).max(Duration::from_millis(100))
    }
}

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
            #[cfg(debug_assertions)]
            test_stop_shard: shard_link::test_stop_shard_from_env(),
            checksum_threads: Arc::new(AtomicUsize::new(0)),
            credits: (0..n).map(|_| HashMap::new()).collect(),
            next_credit_tag: 0,
            sessions: Sessions::new(cfg.session_ttl, cfg.max_sessions, cfg.token_hasher),
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
                self.unregister_engine_driven(instance_id);
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
                self.answer_registration(to, instance_id)
            }
            Request::UnregisterKvCache { instance_id } => {
                self.unregister_kv_cache(instance_id);
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

    /// The counters, for the model test.
    #[cfg(test)]
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Answers `to` with its op's failure reply.
    fn reply_failure(&mut self, to: &ReplyTo) {
        let payload = wire::decode_op(&to.op)
            .ok()
            .and_then(|op| self.failure_payload(op));
        self.reply(to, payload);
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

    /// A request's last awaited part came back: hands it to its path.
    fn complete(&mut self, seq: Seq, kind: InflightKind) {
        match kind {
            InflightKind::Lookup { lookup } => self.lookup_answered(seq, lookup),
            InflightKind::Load {
                load,
                loading,
                loaded,
                slabs,
            } => self.load_answered(load, &loading, &loaded, &slabs),
            InflightKind::PrepareStore {
                to,
                tkey,
                keys,
                layout,
                slabs,
            } => self.prepare_store_reserved(to, tkey, keys, &layout, slabs),
            InflightKind::PrepareRetrieve {
                to,
                tkey,
                keys,
                layout,
                slabs,
            } => self.prepare_retrieve_locked(to, tkey, keys, &layout, slabs),
            InflightKind::Credits { shard, size, slabs } => {
                self.credits_granted(shard, size, slabs.into_iter().flatten().collect())
            }
            InflightKind::Store { to, outcomes } => self.store_done(&to, &outcomes),
            InflightKind::Retrieve { to, oks } => self.retrieve_done(&to, &oks),
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
            InflightKind::Clear {
                to,
                responder,
                cleared,
            } => self.cleared(to, responder, cleared),
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
}
