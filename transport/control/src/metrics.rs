//! Counters of the front end and the Prometheus text exposition of `/metrics`.
//!
//! Names follow lmcache 0.5.6's `lmcache_mp_*` metrics (OTel names exported through
//! Prometheus: dots to underscores, unit suffixes, `_total` on counters) for what
//! kvshard implements; kvshard-only series are prefixed `kvshard_`. Shard-side
//! counters are summed over shards at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;

use kvshard_dataplane::messages::ShardReport;

/// Sizes of front tables, shown as gauges.
#[derive(Debug, Clone, Copy)]
pub struct FrontGauges {
    pub sessions: usize,
    /// Lookup results not consumed yet.
    pub jobs: usize,
    /// Requests whose lookup still holds read locks.
    pub leases: usize,
    /// GPU workers whose CUDA registrations were refused.
    pub refused_gpu_instances: usize,
    /// Shards whose thread ended.
    pub dead_shards: usize,
    /// Messages waiting in the shards' overflow queues (their mailbox is full).
    pub overflow_queued: usize,
}

/// Counters owned by the front thread.
#[derive(Debug, Default, Clone)]
pub struct Metrics {
    pub requests: u64,
    pub bad_requests: u64,
    /// Requests refused because a payload frame exceeded `--max-frame-bytes`.
    pub oversized_frames: u64,
    /// commit_store requests carrying pickled chunks (the unsupported fallback).
    pub pickle_refused: u64,
    pub unknown_ops: u64,
    pub unsupported_ops: BTreeMap<&'static str, u64>,
    pub reply_failures: u64,
    /// Messages that found their shard's mailbox full and joined its overflow queue.
    pub mailbox_full: u64,
    /// Wake-ups of parked shards (filled in when rendered).
    pub shard_wakeups: u64,
    /// Client requests answered with a failure because a shard they need had
    /// its overflow queue at the bound (`--shard-queue-depth`).
    pub shard_overflow_refused: u64,
    /// Client requests answered with a failure because a shard they need stopped.
    pub shard_dead_refused: u64,
    pub lookups: u64,
    pub lookup_requested_tokens: u64,
    pub lookup_hit_tokens: u64,
    pub lookup_hit_keys: u64,
    pub lookup_hit_l2_tokens: u64,
    pub lookup_hit_l2_keys: u64,
    pub early_exits: BTreeMap<&'static str, u64>,
    /// Lookups concluded at their L2 deadline with loads still running or
    /// queued (`--l2-prefetch-load-timeout`).
    pub lookups_cut_at_deadline: u64,
    pub submitted_stores: u64,
    pub finished_stores: u64,
    pub submitted_retrieves: u64,
    pub finished_retrieves: u64,
    pub stored_chunks: u64,
    /// lmcache_driven STOREs answered as a success with some of their chunks
    /// left out for lack of L1 memory (as 0.5.6 answers them), and those chunks.
    pub partial_stores: u64,
    pub store_chunks_left_out: u64,
    pub retrieved_chunks: u64,
    pub retrieve_misses: u64,
    /// engine_driven `prepare_retrieve`s answered from the lookup's lease,
    /// without asking the shards.
    pub retrieves_from_lease: u64,
    /// engine_driven `prepare_store`s answered from write credits, without
    /// asking the shards.
    pub store_credit_prepares: u64,
    /// Those that found too few credits and asked the shards.
    pub store_credit_misses: u64,
    /// Token arrays of keys copied from the front's token cache, and those
    /// decoded (see `kvshard_wire::msgpack::TokenCache`); set when rendered.
    pub token_arrays_copied: u64,
    pub token_arrays_decoded: u64,
    /// Read locks `free_lookup_locks` asked to release that the request's
    /// lookup no longer held (not released).
    pub unheld_lock_releases: u64,
    pub unregistered_instance: u64,
    pub failed_registrations: u64,
    /// register_kv_cache requests refused for carrying CUDA IPC descriptors.
    pub refused_cuda_registrations: u64,
    pub reaped_workers: u64,
    /// PINGs from instances not registered here, answered `false` so that
    /// their client registers again.
    pub unknown_instance_pings: u64,
    /// Lookup read locks released because no live instance could release them.
    pub orphaned_read_locks: u64,
    pub block_allocation_records: u64,
    /// Lookup-hash log records dropped because the writer's channel was full.
    pub lookup_hash_log_dropped: u64,
}

impl Metrics {
    pub fn count_unsupported(&mut self, op: &'static str) {
        *self.unsupported_ops.entry(op).or_default() += 1;
    }

    pub fn count_early_exit(&mut self, reason: &'static str) {
        *self.early_exits.entry(reason).or_default() += 1;
    }

    pub fn render(&self, t: &mut PromText, shards: &[ShardReport], gauges: FrontGauges) {
        let FrontGauges {
            sessions,
            jobs,
            leases,
            refused_gpu_instances,
            dead_shards,
            overflow_queued,
        } = gauges;
        let sum = |f: &dyn Fn(&ShardReport) -> u64| shards.iter().map(f).sum::<u64>();
        // Shard (L1) counters.
        t.counter(
            "lmcache_mp_l1_read_chunks_total",
            "Chunks read from L1",
            sum(&|r| r.stats.read_chunks),
        );
        t.counter(
            "lmcache_mp_l1_write_chunks_total",
            "Chunks written to L1",
            sum(&|r| r.stats.write_chunks),
        );
        t.counter(
            "lmcache_mp_l1_evicted_chunks_total",
            "Chunks evicted from L1",
            sum(&|r| r.stats.evicted_chunks),
        );
        t.counter(
            "lmcache_mp_l1_eviction_loop_ticks_total",
            "L1 eviction loop iterations",
            sum(&|r| r.stats.eviction_loop_ticks),
        );
        t.counter(
            "lmcache_mp_l1_eviction_loop_triggered_total",
            "L1 eviction loop iterations that evicted",
            sum(&|r| r.stats.eviction_loop_triggered),
        );
        t.counter(
            "lmcache_mp_l1_allocation_failure_chunks_total",
            "Chunks that could not be allocated in L1 (client stores and L2 loads)",
            sum(&|r| r.stats.allocation_failure_chunks),
        );
        t.counter(
            "lmcache_mp_l1_read_failure_chunks_total",
            "Chunk reads that failed in L1",
            sum(&|r| r.stats.read_failure_chunks),
        );
        // Front counters.
        t.counter(
            "lmcache_mp_lookup_requested_tokens_total",
            "Tokens submitted for lookup",
            self.lookup_requested_tokens,
        );
        t.counter(
            "lmcache_mp_lookup_hit_tokens_total",
            "Prefix tokens found",
            self.lookup_hit_tokens,
        );
        t.counter(
            "lmcache_mp_lookup_hit_l1_tokens_total",
            "Prefix tokens found in L1",
            self.lookup_hit_tokens - self.lookup_hit_l2_tokens,
        );
        t.counter(
            "lmcache_mp_lookup_hit_l2_tokens_total",
            "Prefix tokens loaded from L2",
            self.lookup_hit_l2_tokens,
        );
        t.counter(
            "lmcache_mp_lookup_hit_l1_keys_total",
            "Object keys found in L1",
            self.lookup_hit_keys - self.lookup_hit_l2_keys,
        );
        t.counter(
            "lmcache_mp_lookup_hit_l2_keys_total",
            "Object keys loaded from L2",
            self.lookup_hit_l2_keys,
        );
        render_l2(t, shards);
        render_s3(t, shards);
        render_resp(t, shards);
        t.counter(
            "lmcache_mp_lookups_requests_total",
            "Lookup requests",
            self.lookups,
        );
        t.counter(
            "kvshard_lookups_cut_at_deadline_total",
            "Lookups concluded at --l2-prefetch-load-timeout with L2 loads still running or queued",
            self.lookups_cut_at_deadline,
        );
        for (reason, n) in &self.early_exits {
            t.counter_labeled(
                "lmcache_mp_lookup_early_exit_requests_total",
                "Lookups answered without a prefetch",
                &[("reason", reason)],
                *n,
            );
        }
        t.counter(
            "lmcache_mp_num_submitted_stores_total",
            "Store requests received",
            self.submitted_stores,
        );
        t.counter(
            "lmcache_mp_num_finished_stores_total",
            "Store requests finished",
            self.finished_stores,
        );
        t.counter(
            "kvshard_partial_stores_total",
            "lmcache_driven STOREs answered as a success with chunks left out for lack of L1 memory",
            self.partial_stores,
        );
        t.counter(
            "kvshard_store_chunks_left_out_total",
            "Chunks of lmcache_driven STOREs answered as a success but not stored (no L1 memory)",
            self.store_chunks_left_out,
        );
        t.counter(
            "lmcache_mp_num_submitted_retrieves_total",
            "Retrieve requests received",
            self.submitted_retrieves,
        );
        t.counter(
            "lmcache_mp_num_finished_retrieves_total",
            "Retrieve requests finished",
            self.finished_retrieves,
        );
        t.counter(
            "lmcache_mp_num_chunks_loaded_total",
            "Chunks handed to workers",
            self.retrieved_chunks,
        );
        // Gauges.
        let used = sum(&|r| r.status.memory_used_bytes);
        let total = sum(&|r| r.status.memory_total_bytes);
        t.gauge(
            "lmcache_mp_l1_memory_usage_bytes",
            "L1 bytes in use",
            used as f64,
        );
        t.gauge(
            "lmcache_mp_l1_usage_ratio",
            "L1 used / allocated",
            if total > 0 {
                used as f64 / total as f64
            } else {
                0.0
            },
        );
        t.gauge(
            "lmcache_mp_l1_staging_bytes",
            "L1 bytes staged by writers",
            sum(&|r| r.status.staging_bytes) as f64,
        );
        t.gauge(
            "lmcache_mp_active_prefetch_jobs",
            "Lookups whose result is not consumed yet",
            jobs as f64,
        );
        // kvshard-only.
        t.counter(
            "kvshard_requests_total",
            "ZeroMQ requests received",
            self.requests,
        );
        t.counter(
            "kvshard_bad_requests_total",
            "Requests answered with a failure because they were malformed or invalid",
            self.bad_requests,
        );
        t.counter(
            "kvshard_oversized_frames_total",
            "Requests answered with a failure because a payload frame exceeded --max-frame-bytes",
            self.oversized_frames,
        );
        t.counter(
            "kvshard_pickle_stores_refused_total",
            "commit_store requests carrying pickled chunks (the pickle fallback is not supported)",
            self.pickle_refused,
        );
        t.counter(
            "kvshard_unknown_ops_total",
            "Requests with an unknown operation",
            self.unknown_ops,
        );
        for (op, n) in &self.unsupported_ops {
            t.counter_labeled(
                "kvshard_unsupported_ops_total",
                "Requests for operations kvshard does not implement",
                &[("op", op)],
                *n,
            );
        }
        t.counter(
            "kvshard_reply_failures_total",
            "Replies ZeroMQ could not deliver (peer gone, or its queue full)",
            self.reply_failures,
        );
        t.counter(
            "kvshard_shard_wakeups_total",
            "Times a parked shard was woken to read its mailbox (one syscall each); \
             messages that want no reply wait for the next one",
            self.shard_wakeups,
        );
        t.counter(
            "kvshard_shard_mailbox_full_total",
            "Messages that found their shard's mailbox full and were queued in its overflow queue",
            self.mailbox_full,
        );
        t.counter(
            "kvshard_shard_overflow_refused_total",
            "Requests answered with a failure because a shard's mailbox and overflow queue were full \
             (--shard-queue-depth each)",
            self.shard_overflow_refused,
        );
        t.counter(
            "kvshard_shard_dead_refused_total",
            "Requests answered with a failure because a shard they need has stopped",
            self.shard_dead_refused,
        );
        // Together these two are lmcache_mp_l1_allocation_failure_chunks_total.
        t.counter(
            "kvshard_store_oom_chunks_total",
            "Chunks of client stores (both transfer modes) refused for lack of L1 memory",
            sum(&|r| r.store_oom_chunks),
        );
        t.gauge(
            "kvshard_l1_write_credit_bytes",
            "L1 memory lent to the front as write credits for prepare_stores (counted as used)",
            sum(&|r| r.write_credit_bytes) as f64,
        );
        t.counter(
            "kvshard_l2_load_oom_chunks_total",
            "Chunks found in L2 that could not be loaded for lack of L1 memory",
            sum(&|r| r.l2_ctl.prefetch_load_oom_objects),
        );
        t.counter(
            "kvshard_retrieve_misses_total",
            "Retrieves that did not find every chunk read-locked",
            self.retrieve_misses,
        );
        t.counter(
            "kvshard_prepare_retrieves_from_lease_total",
            "engine_driven prepare_retrieves answered from the lookup's read locks without a shard round trip",
            self.retrieves_from_lease,
        );
        t.counter(
            "kvshard_prepare_stores_from_credits_total",
            "engine_driven prepare_stores answered from write credits without a shard round trip",
            self.store_credit_prepares,
        );
        t.counter(
            "kvshard_prepare_store_credit_misses_total",
            "engine_driven prepare_stores that found too few write credits and asked the shards",
            self.store_credit_misses,
        );
        t.counter(
            "kvshard_token_arrays_copied_total",
            "Token id arrays of request keys copied from a recent request with the same tokens instead of decoded",
            self.token_arrays_copied,
        );
        t.counter(
            "kvshard_token_arrays_decoded_total",
            "Token id arrays of request keys decoded",
            self.token_arrays_decoded,
        );
        t.counter(
            "kvshard_unheld_lock_releases_total",
            "Read locks free_lookup_locks asked to release that the request's lookup no longer held (released already, expired or cleared): not released",
            self.unheld_lock_releases,
        );
        t.counter(
            "kvshard_unregistered_instance_requests_total",
            "Transfers from unregistered instances",
            self.unregistered_instance,
        );
        t.counter(
            "kvshard_failed_registrations_total",
            "register_kv_cache requests refused",
            self.failed_registrations,
        );
        t.counter(
            "kvshard_refused_cuda_registrations_total",
            "register_kv_cache requests with CUDA IPC descriptors refused (see /status refused_gpu_instances)",
            self.refused_cuda_registrations,
        );
        t.counter(
            "kvshard_reaped_workers_total",
            "Worker registrations reaped for silence",
            self.reaped_workers,
        );
        t.counter(
            "kvshard_unknown_instance_pings_total",
            "PINGs from instances not registered here, answered unhealthy once so that they register again",
            self.unknown_instance_pings,
        );
        t.counter(
            "kvshard_orphaned_read_locks_released_total",
            "Lookup read locks released when the last worker that could read them was reaped or unregistered",
            self.orphaned_read_locks,
        );
        t.counter(
            "kvshard_lookup_hash_log_dropped_total",
            "Lookup hash log lines dropped because the log writer's queue was full",
            self.lookup_hash_log_dropped,
        );
        t.counter(
            "kvshard_expired_stages_total",
            "Write reservations reclaimed after their TTL",
            sum(&|r| r.stats.expired_stages),
        );
        t.gauge("kvshard_active_sessions", "Sessions held", sessions as f64);
        t.gauge(
            "kvshard_dead_shards",
            "Shards whose thread has stopped (see /status shards.dead_shards); /healthcheck is unhealthy",
            dead_shards as f64,
        );
        t.gauge(
            "kvshard_shard_overflow_queued",
            "Messages waiting in the shards' overflow queues for room in their mailbox",
            overflow_queued as f64,
        );
        t.gauge(
            "kvshard_refused_gpu_instances",
            "GPU workers whose CUDA registration was refused; their PINGs are answered False",
            refused_gpu_instances as f64,
        );
        t.gauge(
            "kvshard_lookup_leases",
            "Requests whose lookup still holds read locks the front tracks",
            leases as f64,
        );
        t.gauge(
            "kvshard_shards",
            "Shards (one per core)",
            shards.len() as f64,
        );
        t.gauge(
            "kvshard_l1_objects",
            "Objects resident in L1",
            sum(&|r| r.status.total_object_count as u64) as f64,
        );
    }
}

/// Prometheus text format 0.0.4 writer.
#[derive(Default)]
pub struct PromText {
    out: String,
    declared: std::collections::HashSet<String>,
}

impl PromText {
    fn declare(&mut self, name: &str, help: &str, kind: &str) {
        if self.declared.insert(name.to_owned()) {
            let _ = writeln!(self.out, "# HELP {name} {help}");
            let _ = writeln!(self.out, "# TYPE {name} {kind}");
        }
    }

    pub fn counter(&mut self, name: &str, help: &str, v: u64) {
        self.declare(name, help, "counter");
        let _ = writeln!(self.out, "{name} {v}");
    }

    pub fn counter_labeled(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: u64) {
        self.declare(name, help, "counter");
        let _ = writeln!(self.out, "{name}{{{}}} {v}", fmt_labels(labels));
    }

    pub fn gauge_labeled(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        self.declare(name, help, "gauge");
        let _ = writeln!(self.out, "{name}{{{}}} {v}", fmt_labels(labels));
    }

    pub fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.declare(name, help, "gauge");
        let _ = writeln!(self.out, "{name} {v}");
    }

    /// A counter of a continuous quantity (seconds, ...).
    pub fn counter_f64(&mut self, name: &str, help: &str, v: f64) {
        self.declare(name, help, "counter");
        let _ = writeln!(self.out, "{name} {v}");
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// What the `process_*` series need that only libc can tell. The HTTP side
/// reads it (this crate links no libc) before [`ProcessSample::read`].
#[derive(Debug, Clone, Copy)]
pub struct ProcessLimits {
    /// `sysconf(_SC_CLK_TCK)`: the unit of the CPU and start times in /proc.
    pub clock_ticks_per_second: u64,
    /// The soft `RLIMIT_NOFILE`; `None` when it could not be read.
    pub max_fds: Option<u64>,
}

/// The standard `process_*` series of Prometheus clients, read from /proc
/// when `/metrics` is rendered (on the HTTP thread). A value whose source
/// could not be read is `None` and its series left out: a scrape never fails
/// for it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessSample {
    pub resident_memory_bytes: Option<u64>,
    pub virtual_memory_bytes: Option<u64>,
    /// User plus system CPU time.
    pub cpu_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
    /// Unix time the process started at.
    pub start_time_seconds: Option<f64>,
}

/// The fields of `/proc/<pid>/stat` the `process_*` series use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcStat {
    utime_ticks: u64,
    stime_ticks: u64,
    /// Since boot.
    starttime_ticks: u64,
    vsize_bytes: u64,
    rss_pages: u64,
}

/// Parses `/proc/<pid>/stat` (proc(5)). The command name (field 2) is in
/// parentheses and may itself hold spaces and parentheses, so the fields are
/// counted from the last `)`.
fn parse_proc_stat(text: &str) -> Option<ProcStat> {
    let (_, rest) = text.rsplit_once(')')?;
    // rest starts with field 3 (state), so field n is at index n - 3.
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(ProcStat {
        utime_ticks: field(14)?,
        stime_ticks: field(15)?,
        starttime_ticks: field(22)?,
        vsize_bytes: field(23)?,
        rss_pages: field(24)?,
    })
}

/// The boot time (`btime`, Unix seconds) from `/proc/stat`.
fn parse_boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

impl ProcessSample {
    /// Reads this process's figures from /proc.
    pub fn read(limits: ProcessLimits) -> ProcessSample {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        // The listing's own descriptor is counted too, as other clients count it.
        let open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.filter(|e| e.is_ok()).count() as u64);
        Self::from_proc(
            limits,
            kvshard_io::arena::page_size() as u64,
            read("/proc/self/stat").as_deref(),
            read("/proc/stat").as_deref(),
            open_fds,
        )
    }

    /// The figures from the texts of `/proc/self/stat` and `/proc/stat`.
    fn from_proc(
        limits: ProcessLimits,
        page_size_bytes: u64,
        self_stat: Option<&str>,
        proc_stat: Option<&str>,
        open_fds: Option<u64>,
    ) -> ProcessSample {
        let stat = self_stat.and_then(parse_proc_stat);
        // A zero tick rate would divide by zero: then the times are left out.
        let hz = Some(limits.clock_ticks_per_second)
            .filter(|hz| *hz > 0)
            .map(|hz| hz as f64);
        let boot = proc_stat.and_then(parse_boot_time);
        ProcessSample {
            resident_memory_bytes: stat.map(|s| s.rss_pages.saturating_mul(page_size_bytes)),
            virtual_memory_bytes: stat.map(|s| s.vsize_bytes),
            cpu_seconds: stat
                .zip(hz)
                .map(|(s, hz)| (s.utime_ticks + s.stime_ticks) as f64 / hz),
            open_fds,
            max_fds: limits.max_fds,
            start_time_seconds: stat
                .zip(hz)
                .zip(boot)
                .map(|((s, hz), boot)| boot as f64 + s.starttime_ticks as f64 / hz),
        }
    }

    pub fn render(&self, t: &mut PromText) {
        if let Some(v) = self.cpu_seconds {
            t.counter_f64(
                "process_cpu_seconds_total",
                "User and system CPU time this process has used, in seconds",
                v,
            );
        }
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident set size of this process, in bytes",
                self.resident_memory_bytes.map(|v| v as f64),
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size of this process, in bytes",
                self.virtual_memory_bytes.map(|v| v as f64),
            ),
            (
                "process_open_fds",
                "File descriptors this process has open",
                self.open_fds.map(|v| v as f64),
            ),
            (
                "process_max_fds",
                "Most file descriptors this process may open (soft RLIMIT_NOFILE)",
                self.max_fds.map(|v| v as f64),
            ),
            (
                "process_start_time_seconds",
                "Time this process started, in seconds since the Unix epoch",
                self.start_time_seconds,
            ),
        ];
        for (name, help, v) in gauges {
            if let Some(v) = v {
                t.gauge(name, help, v);
            }
        }
    }
}

/// The `lmcache_mp_l2_*` families, summed over shards; per-adapter series
/// carry `l2_name` (`<type>#<flag position>`).
fn render_l2(t: &mut PromText, shards: &[ShardReport]) {
    let ctl = |f: &dyn Fn(&kvshard_dataplane::messages::L2CtlStats) -> u64| -> u64 {
        shards.iter().map(|r| f(&r.l2_ctl)).sum()
    };
    let tiers = shards.first().map_or(0, |r| r.l2.len());
    let tier = |i: usize, f: &dyn Fn(&kvshard_engine::l2::tier::TierStats) -> u64| -> u64 {
        shards
            .iter()
            .filter_map(|r| r.l2.get(i))
            .map(|t| f(&t.stats))
            .sum()
    };
    let name = |i: usize| shards[0].l2[i].name.clone();
    t.counter(
        "lmcache_mp_l2_store_submitted_requests_total",
        "Batches of L1 objects submitted to the L2 store controller",
        ctl(&|s| s.store_submitted_requests),
    );
    t.counter(
        "lmcache_mp_l2_store_submitted_objects_chunks_total",
        "Objects submitted to the L2 store controller",
        ctl(&|s| s.store_submitted_objects),
    );
    t.counter(
        "lmcache_mp_l2_store_completed_objects_chunks_total",
        "Objects held by at least one adapter after their store",
        ctl(&|s| s.store_completed_objects),
    );
    for i in 0..tiers {
        let n = name(i);
        t.counter_labeled(
            "lmcache_mp_l2_store_completed_requests_total",
            "Store batches an adapter finished",
            &[("l2_name", &n)],
            ctl(&|s| s.store_completed_requests),
        );
        t.counter_labeled(
            "lmcache_mp_l2_load_completed_requests_total",
            "Objects an adapter loaded into L1",
            &[("l2_name", &n)],
            tier(i, &|s| s.loaded_keys),
        );
        t.counter_labeled(
            "kvshard_l2_stored_bytes_total",
            "Bytes an adapter stored",
            &[("l2_name", &n)],
            tier(i, &|s| s.stored_bytes),
        );
        t.counter_labeled(
            "kvshard_l2_store_failed_objects_total",
            "Objects an adapter failed to store",
            &[("l2_name", &n)],
            tier(i, &|s| s.store_failed_keys),
        );
        t.counter_labeled(
            "kvshard_l2_loaded_bytes_total",
            "Bytes an adapter loaded into L1",
            &[("l2_name", &n)],
            tier(i, &|s| s.loaded_bytes),
        );
        t.counter_labeled(
            "kvshard_l2_load_failed_objects_total",
            "Objects an adapter failed to load",
            &[("l2_name", &n)],
            tier(i, &|s| s.load_failed_keys),
        );
        t.counter_labeled(
            "kvshard_l2_eviction_ticks_total",
            "L2 eviction passes",
            &[("l2_name", &n)],
            tier(i, &|s| s.eviction_ticks),
        );
        t.counter_labeled(
            "kvshard_l2_gate_skipped_objects_total",
            "Objects not sent to an adapter that stopped answering in time (stores failed, lookups missed)",
            &[("l2_name", &n)],
            tier(i, &|s| s.gate_skipped_keys),
        );
        let reports = || shards.iter().filter_map(|r| r.l2.get(i));
        let healthy = reports().all(|t| t.status["health"]["is_healthy"] != false);
        t.gauge_labeled(
            "kvshard_l2_healthy",
            "1 while every shard's instance of an adapter is healthy (no recent failure, stall or closed gate), else 0",
            &[("l2_name", &n)],
            if healthy { 1.0 } else { 0.0 },
        );
        t.gauge_labeled(
            "kvshard_l2_gate_closed_shards",
            "Shards on which an adapter is closed to requests until it answers a probe",
            &[("l2_name", &n)],
            reports()
                .filter(|t| t.status["health"]["gate"]["closed"] == true)
                .count() as f64,
        );
        let used: u64 = shards
            .iter()
            .filter_map(|r| r.l2.get(i))
            .map(|t| t.usage.used_bytes)
            .sum();
        t.gauge_labeled(
            "lmcache_mp_l2_usage_bytes",
            "Bytes held by an adapter (objects this server stored or found)",
            &[("l2_name", &n)],
            used as f64,
        );
    }
    let evicted: u64 = (0..tiers).map(|i| tier(i, &|s| s.evicted_keys)).sum();
    t.counter(
        "lmcache_mp_l2_evicted_objects_chunks_total",
        "Objects evicted from L2 adapters",
        evicted,
    );
    t.counter(
        "lmcache_mp_l2_prefetch_lookup_requests_total",
        "Lookups that asked L2",
        ctl(&|s| s.prefetch_lookup_requests),
    );
    t.counter(
        "lmcache_mp_l2_prefetch_lookup_objects_chunks_total",
        "Objects looked up in L2",
        ctl(&|s| s.prefetch_lookup_objects),
    );
    t.counter(
        "lmcache_mp_l2_prefetch_load_submitted_requests_total",
        "L2 load batches started",
        ctl(&|s| s.prefetch_load_submitted_requests),
    );
    t.counter(
        "lmcache_mp_l2_prefetch_load_submitted_objects_chunks_total",
        "Objects submitted for loading from L2",
        ctl(&|s| s.prefetch_load_submitted_objects),
    );
    t.counter(
        "lmcache_mp_l2_prefetch_load_completed_chunks_total",
        "Objects loaded from L2 into L1",
        ctl(&|s| s.prefetch_load_completed_objects),
    );
    t.counter(
        "lmcache_mp_l2_prefetch_failure_chunks_total",
        "Objects found in L2 that could not be loaded",
        ctl(&|s| s.prefetch_failure_objects),
    );
    t.counter(
        "kvshard_l2_store_lock_expired_objects_total",
        "Objects not stored to L2 because their L1 lock expired while waiting for the store budget",
        ctl(&|s| s.store_lock_expired_objects),
    );
    t.counter(
        "kvshard_l2_lookup_timeouts_total",
        "Lookups whose L2 check had not answered by --l2-prefetch-load-timeout (concluded without it)",
        ctl(&|s| s.prefetch_lookup_timeouts),
    );
    t.counter(
        "kvshard_l2_load_timeouts_total",
        "L2 load batches still running at their lookup's --l2-prefetch-load-timeout (they land in L1 after)",
        ctl(&|s| s.prefetch_load_timeouts),
    );
    t.counter(
        "kvshard_l2_size_mismatch_objects_total",
        "L2 objects whose size differs from the registered layout (treated as misses)",
        ctl(&|s| s.size_mismatch_objects),
    );
    t.gauge(
        "lmcache_mp_num_inflight_l2_stores",
        "L2 store batches running",
        ctl(&|s| s.inflight_stores) as f64,
    );
    t.gauge(
        "kvshard_l2_inflight_store_bytes",
        "Bytes of L1 objects being stored to L2",
        ctl(&|s| s.inflight_store_bytes) as f64,
    );
    t.gauge(
        "lmcache_mp_num_inflight_l2_loads",
        "L2 load batches running",
        ctl(&|s| s.inflight_loads) as f64,
    );
    t.gauge(
        "lmcache_mp_inflight_load_memory_usage_bytes",
        "L1 bytes reserved by L2 loads running",
        ctl(&|s| s.inflight_load_bytes) as f64,
    );
    t.gauge(
        "lmcache_mp_l2_store_adapters",
        "L2 adapters stores go to",
        tiers as f64,
    );
    t.gauge(
        "lmcache_mp_l2_prefetch_adapters",
        "L2 adapters lookups ask",
        tiers as f64,
    );
}

/// The `kvshard_s3_*` families of each s3 adapter, summed over shards from
/// what every shard's client reports in `/status` (`adapter.client`).
fn render_s3(t: &mut PromText, shards: &[ShardReport]) {
    let tiers = shards.first().map_or(0, |r| r.l2.len());
    for i in 0..tiers {
        if shards[0].l2[i].status["type"] != "s3" {
            continue;
        }
        let n = shards[0].l2[i].name.clone();
        let adapters: Vec<&serde_json::Value> = shards
            .iter()
            .filter_map(|r| r.l2.get(i))
            .map(|t| &t.status["adapter"])
            .collect();
        let sum = |path: &[&str]| -> u64 {
            adapters
                .iter()
                .map(|a| path.iter().fold(*a, |v, p| &v[*p]).as_u64().unwrap_or(0))
                .sum()
        };
        let mut requests: BTreeMap<(String, String), u64> = BTreeMap::new();
        for a in &adapters {
            let Some(ops) = a["client"]["requests"].as_object() else {
                continue;
            };
            for (op, outcomes) in ops {
                for (outcome, v) in outcomes.as_object().into_iter().flatten() {
                    *requests.entry((op.clone(), outcome.clone())).or_default() +=
                        v.as_u64().unwrap_or(0);
                }
            }
        }
        let throttled: u64 = requests
            .iter()
            .filter(|((_, o), _)| o == "throttled")
            .map(|(_, v)| v)
            .sum();
        for ((op, outcome), v) in &requests {
            t.counter_labeled(
                "kvshard_s3_requests_total",
                "S3 requests by operation and outcome (outcome unavailable: refused by the open circuit breaker, not sent)",
                &[("l2_name", &n), ("op", op), ("outcome", outcome)],
                *v,
            );
        }
        let l = [("l2_name", n.as_str())];
        t.counter_labeled(
            "kvshard_s3_throttled_total",
            "S3 requests answered with a throttling error (503 SlowDown, 429, ...)",
            &l,
            throttled,
        );
        t.counter_labeled(
            "kvshard_s3_retries_total",
            "S3 requests sent again after a retryable failure",
            &l,
            sum(&["client", "retries"]),
        );
        t.counter_labeled(
            "kvshard_s3_retry_budget_exhausted_total",
            "S3 failures returned without a retry because the retry budget was empty",
            &l,
            sum(&["client", "retry_budget_exhausted"]),
        );
        t.counter_labeled(
            "kvshard_s3_timeouts_total",
            "S3 requests that ran past s3_request_timeout_secs",
            &l,
            sum(&["client", "timeouts"]),
        );
        t.counter_labeled(
            "kvshard_s3_connect_failures_total",
            "S3 connection attempts that failed",
            &l,
            sum(&["client", "connect_failures"]),
        );
        t.counter_labeled(
            "kvshard_s3_breaker_trips_total",
            "Times an S3 circuit breaker opened",
            &l,
            sum(&["client", "breaker_trips"]),
        );
        let open = adapters
            .iter()
            .filter(|a| a["client"]["breaker_open"] == true)
            .count();
        t.gauge_labeled(
            "kvshard_s3_breaker_open_shards",
            "Shards whose S3 circuit breaker is open (their S3 operations fail at once)",
            &l,
            open as f64,
        );
        t.counter_labeled(
            "kvshard_s3_unfull_rejected_objects_total",
            "Objects the s3 adapter refused to store because they are not a full chunk of their layout",
            &l,
            sum(&["unfull_rejected"]),
        );
        t.counter_labeled(
            "kvshard_s3_put_body_held_total",
            "PUTs whose L1 body a connection still held a request deadline after the request ended",
            &l,
            sum(&["client", "put_body_held"]),
        );
    }
}

/// The `kvshard_resp_*` families of each resp or valkey adapter, summed
/// over shards from what every shard reports in `/status`.
fn render_resp(t: &mut PromText, shards: &[ShardReport]) {
    let tiers = shards.first().map_or(0, |r| r.l2.len());
    for i in 0..tiers {
        let kind = &shards[0].l2[i].status["type"];
        if kind != "resp" && kind != "valkey" {
            continue;
        }
        let n = shards[0].l2[i].name.clone();
        let adapters: Vec<&serde_json::Value> = shards
            .iter()
            .filter_map(|r| r.l2.get(i))
            .map(|t| &t.status["adapter"])
            .collect();
        let sum = |path: &[&str]| -> u64 {
            adapters
                .iter()
                .map(|a| path.iter().fold(*a, |v, p| &v[*p]).as_u64().unwrap_or(0))
                .sum()
        };
        let mut requests: BTreeMap<(String, String), u64> = BTreeMap::new();
        for a in &adapters {
            let Some(ops) = a["client"]["requests"].as_object() else {
                continue;
            };
            for (op, outcomes) in ops {
                for (outcome, v) in outcomes.as_object().into_iter().flatten() {
                    *requests.entry((op.clone(), outcome.clone())).or_default() +=
                        v.as_u64().unwrap_or(0);
                }
            }
        }
        for ((op, outcome), v) in &requests {
            t.counter_labeled(
                "kvshard_resp_requests_total",
                "Redis/Valkey requests by command and outcome (ok, nil, wrong_size, error: a server error reply; unavailable: not sent, no connection or breaker open; timeout, connection, protocol, refused)",
                &[("l2_name", &n), ("op", op), ("outcome", outcome)],
                *v,
            );
        }
        let l = [("l2_name", n.as_str())];
        for (name, help, path) in [
            (
                "kvshard_resp_timeouts_total",
                "Redis/Valkey requests with no reply within request_timeout (their connection is closed)",
                &["client", "timeouts"][..],
            ),
            (
                "kvshard_resp_connects_total",
                "Redis/Valkey connections opened",
                &["client", "connects"][..],
            ),
            (
                "kvshard_resp_connect_failures_total",
                "Redis/Valkey connection attempts that failed",
                &["client", "connect_failures"][..],
            ),
            (
                "kvshard_resp_breaker_trips_total",
                "Times a Redis/Valkey node's circuit breaker opened",
                &["client", "breaker_trips"][..],
            ),
            (
                "kvshard_resp_sent_bytes_total",
                "Bytes written to Redis/Valkey",
                &["client", "bytes_sent"][..],
            ),
            (
                "kvshard_resp_received_bytes_total",
                "Bytes read from Redis/Valkey",
                &["client", "bytes_received"][..],
            ),
            (
                "kvshard_resp_oom_rejected_total",
                "Stores the server refused for want of memory (OOM at maxmemory)",
                &["oom_rejected"][..],
            ),
            (
                "kvshard_resp_load_missing_total",
                "Loads that found no value (evicted or expired since the lookup)",
                &["load_missing"][..],
            ),
            (
                "kvshard_resp_load_wrong_size_total",
                "Loads whose value had another size than the L1 object (a miss)",
                &["load_wrong_size"][..],
            ),
            (
                "kvshard_resp_cluster_moved_total",
                "MOVED redirects followed",
                &["client", "cluster", "moved"][..],
            ),
            (
                "kvshard_resp_cluster_ask_total",
                "ASK redirects followed",
                &["client", "cluster", "ask"][..],
            ),
            (
                "kvshard_resp_cluster_refreshes_total",
                "Cluster slot maps fetched",
                &["client", "cluster", "refreshes"][..],
            ),
        ] {
            t.counter_labeled(name, help, &l, sum(path));
        }
        t.gauge_labeled(
            "kvshard_resp_connections",
            "Open Redis/Valkey connections",
            &l,
            sum(&["client", "connections"]) as f64,
        );
        let open = adapters
            .iter()
            .filter(|a| a["client"]["breaker_open"] == true)
            .count();
        t.gauge_labeled(
            "kvshard_resp_breaker_open_shards",
            "Shards with an open Redis/Valkey circuit breaker (their requests fail at once)",
            &l,
            open as f64,
        );
    }
}

fn fmt_labels(labels: &[(&str, &str)]) -> String {
    labels
        .iter()
        .map(|(k, v)| {
            format!(
                "{k}=\"{}\"",
                v.replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n")
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format() {
        let mut t = PromText::default();
        t.counter("a_total", "A", 3);
        t.counter_labeled("b_total", "B", &[("reason", "x\"y")], 1);
        t.counter_labeled("b_total", "B", &[("reason", "z")], 2);
        t.gauge("c", "C", 0.5);
        let s = t.finish();
        assert!(s.contains("# TYPE a_total counter\na_total 3\n"));
        assert_eq!(s.matches("# TYPE b_total").count(), 1);
        assert!(s.contains("b_total{reason=\"x\\\"y\"} 1"));
        assert!(s.contains("c 0.5"));
    }

    /// A /proc/<pid>/stat line whose command name holds spaces and parentheses.
    const SELF_STAT: &str = "4242 (kv (shard) 1) S 1 4242 4242 0 -1 4194560 2631 0 0 0 \
        250 130 0 0 20 0 12 0 98765 123456789 5000 18446744073709551615 1 1 0 0 0 0 0 \
        4096 0 0 0 0 17 3 0 0 0 0 0\n";

    #[test]
    fn proc_stat_fields_are_counted_from_the_last_parenthesis() {
        assert_eq!(
            parse_proc_stat(SELF_STAT),
            Some(ProcStat {
                utime_ticks: 250,
                stime_ticks: 130,
                starttime_ticks: 98765,
                vsize_bytes: 123456789,
                rss_pages: 5000,
            })
        );
        assert_eq!(parse_proc_stat("4242 (kv) S 1 2 3"), None);
        assert_eq!(parse_proc_stat(""), None);
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nintr 5\nbtime 1795660000\nprocesses 9\n"),
            Some(1795660000)
        );
        assert_eq!(parse_boot_time("cpu  1 2 3\n"), None);
    }

    #[test]
    fn process_series_from_proc_texts() {
        let limits = ProcessLimits {
            clock_ticks_per_second: 100,
            max_fds: Some(1024),
        };
        let s = ProcessSample::from_proc(
            limits,
            4096,
            Some(SELF_STAT),
            Some("btime 1795660000\n"),
            Some(7),
        );
        assert_eq!(
            s,
            ProcessSample {
                resident_memory_bytes: Some(5000 * 4096),
                virtual_memory_bytes: Some(123456789),
                cpu_seconds: Some(3.8),
                open_fds: Some(7),
                max_fds: Some(1024),
                start_time_seconds: Some(1795660000.0 + 987.65),
            }
        );
        let mut t = PromText::default();
        s.render(&mut t);
        let text = t.finish();
        assert!(text
            .contains("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.8\n"));
        assert!(text.contains(
            "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 20480000\n"
        ));
        assert!(
            text.contains("\nprocess_start_time_seconds 1795660987.65\n"),
            "{text}"
        );
        for name in [
            "process_virtual_memory_bytes",
            "process_open_fds",
            "process_max_fds",
        ] {
            assert!(text.contains(&format!("# HELP {name} ")), "{name}: {text}");
        }
    }

    #[test]
    fn process_series_left_out_when_proc_is_missing() {
        let limits = ProcessLimits {
            clock_ticks_per_second: 100,
            max_fds: None,
        };
        let s = ProcessSample::from_proc(limits, 4096, None, None, None);
        assert_eq!(s, ProcessSample::default());
        let mut t = PromText::default();
        s.render(&mut t);
        assert_eq!(t.finish(), "");
        // Without the boot time only the start time is missing; without a tick
        // rate, the times.
        let s = ProcessSample::from_proc(limits, 4096, Some(SELF_STAT), None, None);
        assert!(s.start_time_seconds.is_none() && s.cpu_seconds.is_some());
        let no_hz = ProcessLimits {
            clock_ticks_per_second: 0,
            ..limits
        };
        let s = ProcessSample::from_proc(no_hz, 4096, Some(SELF_STAT), Some("btime 1\n"), None);
        assert!(s.start_time_seconds.is_none() && s.cpu_seconds.is_none());
        assert_eq!(s.resident_memory_bytes, Some(5000 * 4096));
    }

    #[test]
    fn process_series_of_this_process() {
        let s = ProcessSample::read(ProcessLimits {
            clock_ticks_per_second: 100,
            max_fds: None,
        });
        if std::path::Path::new("/proc/self/stat").exists() {
            assert!(s.resident_memory_bytes.unwrap() > 0, "{s:?}");
            assert!(s.virtual_memory_bytes.unwrap() >= s.resident_memory_bytes.unwrap());
            assert!(s.open_fds.unwrap() >= 3, "{s:?}");
            assert!(s.cpu_seconds.unwrap() >= 0.0);
        }
    }

    #[test]
    fn lookup_hash_log_drops_are_a_counter() {
        let m = Metrics {
            lookup_hash_log_dropped: 7,
            ..Metrics::default()
        };
        let mut t = PromText::default();
        m.render(
            &mut t,
            &[],
            FrontGauges {
                sessions: 0,
                jobs: 0,
                leases: 0,
                refused_gpu_instances: 0,
                dead_shards: 0,
                overflow_queued: 0,
            },
        );
        let s = t.finish();
        assert!(s.contains(
            "# HELP kvshard_lookup_hash_log_dropped_total Lookup hash log lines dropped because \
             the log writer's queue was full\n\
             # TYPE kvshard_lookup_hash_log_dropped_total counter\n\
             kvshard_lookup_hash_log_dropped_total 7\n"
        ));
    }
}
