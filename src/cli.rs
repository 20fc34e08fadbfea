//! `kvshard server ...`: the command line of lmcache 0.5.6's `lmcache server`, flag for
//! flag (names, defaults, types, choices), plus a few kvshard-only flags, and its
//! resolution into a validated [`ServerConfig`].
//!
//! Every 0.5.6 flag parses. A flag whose feature kvshard does not have is refused at
//! start with an error naming it when set to anything but its default; a flag that
//! only tunes Python machinery is accepted and produces a start-up note instead.

use crate::logger::LogFormat;
use clap::{ArgAction, Args, Parser, Subcommand};
use kvshard_engine::keys::{self, TokenHasher};
use kvshard_engine::l2::config::{parse_adapter_spec, AdapterSpec};
use kvshard_io::executor::{allowed_cores, parse_core_list};
use kvshard_transport::config::{
    auto_shm_name, gb_to_bytes, new_uuid_v4, normalize_shm_name, ConfigError, EvictionPolicyName,
    GdsBackend, GdsL1Settings, L1Settings, L2PrefetchPolicy, L2Settings, L2StorePolicy,
    LookupHashLogSettings, ServerConfig, TransferMode, GDS_SLAB_ALIGN,
};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "kvshard",
    version,
    about = "Thread-per-core KV-cache server, a drop-in replacement for lmcache 0.5.6's `lmcache server`",
    // argparse semantics: a repeated option keeps its last value, and an unambiguous
    // prefix of a long option is accepted.
    args_override_self = true,
    infer_long_args = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once at start: the size of the server's variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Launch the cache server: the ZeroMQ request server and the HTTP API.
    /// Accepts every flag of `lmcache server` (0.5.6).
    Server(ServerArgs),
    /// Load a server (kvshard or `lmcache server`) as N vLLM instances would,
    /// checking every byte read back, and print latency percentiles and throughput.
    Loadgen(crate::loadgen::LoadgenArgs),
}

/// All flags of `kvshard server`, grouped as lmcache 0.5.6 groups them.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    #[command(flatten)]
    pub mp: MpServerArgs,
    #[command(flatten)]
    pub p2p: P2pArgs,
    #[command(flatten)]
    pub l1: L1MemoryArgs,
    #[command(flatten)]
    pub gds: GdsL1Args,
    #[command(flatten)]
    pub ttl: L1TtlArgs,
    #[command(flatten)]
    pub eviction: EvictionArgs,
    #[command(flatten)]
    pub l2_policy: L2PolicyArgs,
    #[command(flatten)]
    pub l2: L2AdapterArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub obs: ObservabilityArgs,
    #[command(flatten)]
    pub lookup_log: LookupHashLogArgs,
    #[command(flatten)]
    pub gc: GcMonitorArgs,
    #[command(flatten)]
    pub extra_log: ExtraLoggingArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
    #[command(flatten)]
    pub coordinator: CoordinatorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub kvshard: KvshardArgs,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "MP Server")]
pub struct MpServerArgs {
    /// kvshard: an lmcache YAML configuration of an S3 backend (remote_url: s3://..., extra_config)
    /// mapped onto these flags and one s3 L2 adapter; flags given after it win.
    #[arg(long, value_name = "FILE")]
    pub config: Option<String>,

    /// Stable identity of this server (coordinator key, telemetry service.instance.id)
    /// [default: a random UUID v4 minted at start]
    #[arg(long, value_name = "ID")]
    pub instance_id: Option<String>,

    /// Request transport. Only zmq is supported by kvshard.
    #[arg(long, value_name = "TRANSPORT", value_parser = ["zmq", "grpc"], default_value = "zmq")]
    pub transport: String,

    /// Host to bind the ZMQ request server (localhost binds 127.0.0.1; 0.0.0.0 or * binds all).
    #[arg(long, value_name = "HOST", default_value = "localhost")]
    pub host: String,

    /// Port to bind the ZMQ request server.
    #[arg(
        long,
        value_name = "PORT",
        default_value_t = 5555,
        allow_negative_numbers = true
    )]
    pub port: u16,

    /// Chunk size for KV cache operations, in tokens.
    #[arg(
        long,
        value_name = "TOKENS",
        default_value_t = 256,
        allow_negative_numbers = true
    )]
    pub chunk_size: i64,

    /// Engine block ID that denotes absent KV data (vLLM uses 0; e.g. -1 for engines where block 0 is valid).
    #[arg(
        long,
        value_name = "ID",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub null_block_id: i64,

    /// Base number of Python worker threads. Accepted for compatibility; no effect in kvshard
    /// (one shard per --cores core does the work).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        allow_negative_numbers = true
    )]
    pub max_workers: i64,

    /// Python GPU-affinity worker threads [default: --max-workers].
    /// Accepted for compatibility; no effect in kvshard.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_gpu_workers: Option<i64>,

    /// Python CPU worker threads [default: --max-workers].
    /// Accepted for compatibility; no effect in kvshard.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_cpu_workers: Option<i64>,

    /// gRPC dispatch threads, only used by --transport grpc. Accepted; no effect in kvshard.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 32,
        allow_negative_numbers = true
    )]
    pub grpc_server_workers: i64,

    /// Hash algorithm for token chunks (builtin, sha256_cbor, blake3). kvshard accepts blake3 and
    /// sha256_cbor (vLLM's, also named sha256_cbor_64bit); builtin is refused.
    #[arg(long, value_name = "ALGORITHM", default_value = "blake3")]
    pub hash_algorithm: String,

    /// Cache engine type. Only default is supported by kvshard (no CacheBlend).
    #[arg(long, value_name = "TYPE", value_parser = ["default", "blend", "blend_legacy"], default_value = "default")]
    pub engine_type: String,

    /// Worker -> server transfer paths to load: lmcache_driven (STORE/RETRIEVE, CUDA IPC or CPU SHM),
    /// engine_driven (PREPARE/COMMIT through the shared L1 pool), or auto (both).
    #[arg(long, value_name = "MODE", value_parser = ["lmcache_driven", "engine_driven", "auto"], default_value = "auto")]
    pub supported_transfer_mode: String,

    /// Use IPC that works across containers sharing no IPC namespace: CUDA workers'
    /// events are timeline semaphores over CUDA IPC memory (as the workers' own
    /// lmcache.mp.isolated_ipc) [default: off].
    #[arg(long, overrides_with = "no_isolated_ipc")]
    pub isolated_ipc: bool,
    /// Turn --isolated-ipc off.
    #[arg(long, overrides_with = "isolated_ipc")]
    pub no_isolated_ipc: bool,

    /// Runtime plugin scripts or directories (zero or more). Not supported by kvshard.
    #[arg(long, value_name = "PATH", num_args = 0.., action = ArgAction::Set)]
    pub runtime_plugin_locations: Vec<String>,

    /// JSON config forwarded to runtime plugins. Not supported by kvshard unless "{}".
    #[arg(long, value_name = "JSON", default_value = "{}")]
    pub runtime_plugin_config: String,

    /// SHM segment name of the L1 pool for engine_driven transfer (becomes lmcache_l1_pool_<NAME>).
    /// Unset: an automatic unique name; "" (empty): disable SHM. Only used when
    /// --supported-transfer-mode is auto or engine_driven.
    #[arg(long, value_name = "NAME")]
    pub shm_name: Option<String>,

    /// Python modules /run_script may import (zero or more). Not supported by kvshard (no /run_script).
    #[arg(long, value_name = "MODULE", num_args = 0.., action = ArgAction::Set)]
    pub script_allowed_imports: Vec<String>,

    /// Enable the /run_script HTTP endpoint. Not supported by kvshard [default: off].
    #[arg(long, overrides_with = "no_run_script_api_enabled")]
    pub run_script_api_enabled: bool,
    /// Turn --run-script-api-enabled off.
    #[arg(long, overrides_with = "run_script_api_enabled")]
    pub no_run_script_api_enabled: bool,

    /// One object group per sliding-window size (in whole chunks) at registration (hybrid
    /// models): one object per chunk and group, a windowed group needed for a hit's last
    /// chunks only [default: off].
    #[arg(long, overrides_with = "no_separate_object_groups")]
    pub separate_object_groups: bool,
    /// Turn --separate-object-groups off.
    #[arg(long, overrides_with = "separate_object_groups")]
    pub no_separate_object_groups: bool,

    /// Seconds of silence after which a worker that has pinged is reaped; 0 disables reaping,
    /// otherwise at least 30 (keep >= 3x the client heartbeat interval).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 120.0,
        allow_negative_numbers = true
    )]
    pub worker_reap_timeout_seconds: f64,

    /// Seconds a request session may stay idle before it is reaped.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 600.0,
        allow_negative_numbers = true
    )]
    pub session_ttl_seconds: f64,

    /// Seconds of silence allowed for a worker that registered but never pinged;
    /// must be >= --worker-reap-timeout-seconds.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 3600.0,
        allow_negative_numbers = true
    )]
    pub worker_registration_grace_seconds: f64,

    /// CacheBlend only: keep the gapped prefix on a mid-prefix L2 failure. Not supported by kvshard.
    #[arg(long)]
    pub enable_segmented_prefix: bool,

    /// CacheBlend only: index identical chunk content once. Not supported by kvshard.
    #[arg(long)]
    pub enable_dedup_content: bool,

    /// CacheBlend only: answer cb_reorder_plan. Not supported by kvshard.
    #[arg(long)]
    pub enable_blend_reorder: bool,

    /// Experimental transfer modules to enable (e.g. transfer_query). Not supported by kvshard.
    #[arg(long, value_name = "MODULE", num_args = 0.., action = ArgAction::Set)]
    pub enable: Vec<String>,

    /// CPU store/eviction records retained for KV-event subscribers; 0 disables the channel.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 32768,
        allow_negative_numbers = true
    )]
    pub kv_event_log_size: i64,

    /// Out-of-tree Python server-module factory as JSON (repeatable). Not supported by kvshard.
    #[arg(long, value_name = "JSON")]
    pub server_module: Vec<String>,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "P2P (not supported by kvshard: refused unless left at defaults)")]
pub struct P2pArgs {
    /// Transfer-channel host:port advertised to peers; setting it enables P2P ("" = off).
    #[arg(long, value_name = "HOST:PORT", default_value = "")]
    pub p2p_advertise_url: String,
    /// Transfer-channel host:port to bind ("" = --p2p-advertise-url).
    #[arg(long, value_name = "HOST:PORT", default_value = "")]
    pub p2p_listen_url: String,
    /// Seconds before a peer lookup counts as a miss.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 30.0,
        allow_negative_numbers = true
    )]
    pub p2p_lookup_timeout: f64,
    /// Seconds before a peer load counts as a failure.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 30.0,
        allow_negative_numbers = true
    )]
    pub p2p_load_timeout: f64,
    /// Transfer-channel implementation.
    #[arg(long, value_name = "ENGINE", default_value = "nixl")]
    pub p2p_transfer_engine: String,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "L1 Memory Manager")]
pub struct L1MemoryArgs {
    /// Tagged L1 as JSON (type DRAM/DEVDAX/GDS; repeatable). Not supported by kvshard: use the
    /// --l1-* flags.
    #[arg(long, value_name = "JSON")]
    pub l1_manager: Vec<String>,

    /// Size of the L1 tier in GB (GiB: 1 GB = 2^30 bytes, as lmcache counts). Required.
    #[arg(
        long,
        value_name = "GB",
        required_unless_present = "l1_manager",
        allow_negative_numbers = true
    )]
    pub l1_size_gb: Option<f64>,

    /// Allocate L1 lazily: pages are backed on first use instead of all at start [default: on].
    #[arg(long, overrides_with = "no_l1_use_lazy")]
    pub l1_use_lazy: bool,
    /// Pre-fault the whole L1 at start (turns --l1-use-lazy off).
    #[arg(long, overrides_with = "l1_use_lazy")]
    pub no_l1_use_lazy: bool,

    /// Initial L1 allocation in GB (integer) when lazy; clamped to --l1-size-gb [default: 20].
    #[arg(long, value_name = "GB", allow_negative_numbers = true)]
    pub l1_init_size_gb: Option<u64>,

    /// L1 object alignment in bytes; a power of two, at least 64.
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = 4096,
        allow_negative_numbers = true
    )]
    pub l1_align_bytes: u64,

    /// Back L1 with the pre-allocated 2 MiB hugetlb pool (vm.nr_hugepages); needs the SHM pool
    /// off (--shm-name "") and turns lazy allocation off [default: off]. Without it, a pre-faulted
    /// L1 (--no-l1-use-lazy) asks for transparent huge pages.
    #[arg(long, overrides_with = "no_l1_use_hugepages")]
    pub l1_use_hugepages: bool,
    /// Turn --l1-use-hugepages off.
    #[arg(long, overrides_with = "l1_use_hugepages")]
    pub no_l1_use_hugepages: bool,

    /// Map the L1 arena from a device-DAX device (/dev/daxX.Y) or an existing file of at least
    /// --l1-size-gb (e.g. on an fsdax mount; create it with `fallocate -l`). The length is rounded
    /// down to the device alignment; the contents do not survive a restart. Needs the SHM pool off
    /// (--shm-name ""); conflicts with --l1-use-hugepages and --gds-l1-path; turns lazy allocation
    /// off [default: unset].
    #[arg(long, value_name = "PATH")]
    pub l1_devdax_path: Option<String>,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "GDS L1 tier")]
pub struct GdsL1Args {
    /// Directory on a block-device filesystem (NVMe) for the GDS L1 tier: the L1 objects live in one
    /// preallocated slab file per shard (lmcache_gds_slab.<shard>.bin, emptied at every start)
    /// instead of memory; --l1-size-gb sizes the slabs together. Needs the SHM pool off
    /// (--shm-name ""); conflicts with --l1-devdax-path and --l1-use-hugepages; L2 adapters work
    /// with it [default: unset].
    #[arg(long, value_name = "PATH")]
    pub gds_l1_path: Option<String>,

    /// Open the GDS slab with O_DIRECT [default: on]. No effect without --gds-l1-path.
    #[arg(long, overrides_with = "no_gds_l1_use_direct_io")]
    pub gds_l1_use_direct_io: bool,
    /// Turn --gds-l1-use-direct-io off.
    #[arg(long, overrides_with = "gds_l1_use_direct_io")]
    pub no_gds_l1_use_direct_io: bool,

    /// GDS backend. auto: the shard's io_uring, staging objects through aligned host buffers (the
    /// objects kvshard holds are in host memory); cufile, hipfile, mufile, phx and ugds are refused.
    /// No effect without --gds-l1-path.
    #[arg(long, value_name = "BACKEND", value_parser = ["auto", "cufile", "hipfile", "mufile", "phx", "ugds"], default_value = "auto")]
    pub gds_l1_backend: String,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "L1 Manager TTL")]
pub struct L1TtlArgs {
    /// Time-to-live of each object's write lock, in seconds.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 600,
        allow_negative_numbers = true
    )]
    pub l1_write_ttl_seconds: u64,
    /// Time-to-live of each object's read lock, in seconds.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300,
        allow_negative_numbers = true
    )]
    pub l1_read_ttl_seconds: u64,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Eviction Policy")]
pub struct EvictionArgs {
    /// Eviction policy (required). noop: L1 is a pure write buffer; IsolatedLRU: one LRU per
    /// cache_salt bounded by quotas set over HTTP. ARC is not supported by kvshard.
    #[arg(long, value_name = "POLICY", value_parser = ["LRU", "ARC", "IsolatedLRU", "noop"], required_unless_present = "l1_manager")]
    pub eviction_policy: Option<String>,
    /// L1 usage fraction (0, 1] that triggers eviction.
    #[arg(
        long,
        value_name = "FRACTION",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub eviction_trigger_watermark: f64,
    /// Fraction (0, 1] of cached objects to evict when triggered.
    #[arg(
        long,
        value_name = "FRACTION",
        default_value_t = 0.2,
        allow_negative_numbers = true
    )]
    pub eviction_ratio: f64,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "L2 Policies")]
pub struct L2PolicyArgs {
    /// L2 store policy: default (store to every adapter, keep L1) or skip_l1 (drop the
    /// L1 copy once stored).
    #[arg(long, value_name = "POLICY", value_parser = ["default", "skip_l1"], default_value = "default")]
    pub l2_store_policy: String,
    /// L2 prefetch policy: default (chunks loaded from L2 are freed after the retrieve) or
    /// retain (they stay in L1).
    #[arg(long, value_name = "POLICY", value_parser = ["default", "retain"], default_value = "default")]
    pub l2_prefetch_policy: String,
    /// Maximum requests whose L2 loads run at once.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 8,
        allow_negative_numbers = true
    )]
    pub l2_prefetch_max_in_flight: i64,
    /// Seconds a lookup waits for L2 (queueing, the existence check and the loads into L1)
    /// before it concludes with the prefix already in L1; the rest is a miss the engine
    /// recomputes, and loads still running land in L1 for the next request. A lookup that
    /// runs out counts as a failure of the tier that held it up. 0 waits as long as L2 takes.
    /// (The flag of lmcache's later releases; 0.5.6 has none.)
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0.5,
        allow_negative_numbers = true
    )]
    pub l2_prefetch_load_timeout: f64,
    /// Python notifier-thread heartbeat, in ms. Accepted; no effect in kvshard.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 5,
        allow_negative_numbers = true
    )]
    pub periodic_notifier_interval_ms: i64,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "L2 Adapters")]
pub struct L2AdapterArgs {
    /// L2 adapter as JSON with a "type" field (repeatable, in cascade order). Types: fs
    /// ({"base_path", "relative_tmp_dir", "read_ahead_size", "use_odirect", "max_capacity_gb"}),
    /// mock ({"max_size_gb", "mock_bandwidth_gb"}); optional "eviction": {"eviction_policy",
    /// "trigger_watermark", "eviction_ratio"}.
    #[arg(long, value_name = "JSON")]
    pub l2_adapter: Vec<String>,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "HTTP Frontend")]
pub struct HttpArgs {
    /// Host to bind the HTTP API. The API has no authentication and can clear the cache:
    /// bind a non-loopback address only on a trusted network.
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    pub http_host: String,
    /// Port to bind the HTTP API.
    #[arg(
        long,
        value_name = "PORT",
        default_value_t = 8080,
        allow_negative_numbers = true
    )]
    pub http_port: u16,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Observability")]
pub struct ObservabilityArgs {
    /// Disable observability entirely (metrics, logging subscribers).
    #[arg(long)]
    pub disable_observability: bool,
    /// Disable metrics.
    #[arg(long)]
    pub disable_metrics: bool,
    /// Disable gRPC runtime metrics. Accepted; no effect in kvshard (no gRPC).
    #[arg(long)]
    pub disable_grpc_metrics: bool,
    /// Disable logging subscribers.
    #[arg(long)]
    pub disable_logging: bool,
    /// Export OTel traces. Not supported by kvshard.
    #[arg(long)]
    pub enable_tracing: bool,
    /// OTLP gRPC endpoint for metrics and traces. Not supported by kvshard [default: unset].
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// Python EventBus queue bound, in events. Accepted; no effect in kvshard.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 10000,
        allow_negative_numbers = true
    )]
    pub event_bus_queue_size: i64,
    /// Port of the standalone Prometheus endpoint (unused by `server`: metrics are served at
    /// GET /metrics on --http-port). Accepted; no effect in kvshard.
    #[arg(
        long,
        value_name = "PORT",
        default_value_t = 9090,
        allow_negative_numbers = true
    )]
    pub prometheus_port: i64,
    /// Fraction of chunks sampled for lifecycle histograms. Accepted; no effect in kvshard.
    #[arg(
        long,
        value_name = "FRACTION",
        default_value_t = 0.01,
        allow_negative_numbers = true
    )]
    pub metrics_sample_rate: f64,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Lookup Hash Logging")]
pub struct LookupHashLogArgs {
    /// Directory for lookup chunk-hash JSONL files; "" disables logging.
    #[arg(long, value_name = "DIR", default_value = "")]
    pub lookup_hash_log_dir: String,
    /// Seconds before rotating to a new log file.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 21600,
        allow_negative_numbers = true
    )]
    pub lookup_hash_log_rotation_interval: i64,
    /// Bytes after which a log file is rotated even if the interval has not elapsed.
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = 104857600,
        allow_negative_numbers = true
    )]
    pub lookup_hash_log_rotation_max_size: i64,
    /// Number of log files kept; the oldest are deleted.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 100,
        allow_negative_numbers = true
    )]
    pub lookup_hash_log_max_files: i64,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "GC Monitoring (CPython; accepted, no effect in kvshard)")]
pub struct GcMonitorArgs {
    /// Time CPython garbage collections. Accepted; no effect in kvshard.
    #[arg(long)]
    pub enable_gc_monitor: bool,
    /// Only log collections of at least this many ms. Accepted; no effect in kvshard.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub gc_monitor_min_pause_ms: f64,
    /// Object-type breakdown size per logged collection. Accepted; no effect in kvshard.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub gc_monitor_top_objects: i64,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Extra Logging")]
pub struct ExtraLoggingArgs {
    /// Periodically log per-GPU L0<->L1 throughput. Not supported by kvshard.
    #[arg(long)]
    pub enable_extra_logging: bool,
    /// Seconds between extra-logging lines (> 0). No effect without --enable-extra-logging.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10.0,
        allow_negative_numbers = true
    )]
    pub extra_logging_interval: f64,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Trace Recording (not supported by kvshard)")]
pub struct TraceArgs {
    /// Record a replay trace (storage, events). Not supported by kvshard [default: off].
    #[arg(long, value_name = "LEVEL", value_parser = ["storage", "events"])]
    pub trace_level: Option<String>,
    /// Trace file path. Not supported by kvshard [default: unset].
    #[arg(long, value_name = "PATH")]
    pub trace_output: Option<String>,
}

#[derive(Debug, Clone, Args)]
#[command(
    next_help_heading = "Coordinator (not supported by kvshard: refused unless left at defaults)"
)]
pub struct CoordinatorArgs {
    /// Coordinator base URL [default: $LMCACHE_COORDINATOR_URL, else off].
    #[arg(long, value_name = "URL")]
    pub coordinator_url: Option<String>,
    /// IP the coordinator reaches this server at [default: $LMCACHE_COORDINATOR_ADVERTISE_IP].
    #[arg(long, value_name = "IP")]
    pub coordinator_advertise_ip: Option<String>,
    /// Seconds between heartbeats [default: $LMCACHE_COORDINATOR_HEARTBEAT_INTERVAL, else 5].
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub coordinator_heartbeat_interval: Option<f64>,
    /// Stream cache events to the coordinator [default: $LMCACHE_COORDINATOR_EVENT_REPORTING, else off].
    #[arg(long)]
    pub coordinator_event_reporting: bool,
    /// Seconds between cache-event flushes [default: $LMCACHE_COORDINATOR_EVENT_FLUSH_INTERVAL, else 1].
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub coordinator_event_flush_interval: Option<f64>,
    /// Cache-event transport.
    #[arg(long, value_name = "TRANSPORT", value_parser = ["http", "kafka"], default_value = "http")]
    pub coordinator_event_transport: String,
    /// Comma-separated Kafka bootstrap servers.
    #[arg(long, value_name = "SERVERS", default_value = "")]
    pub coordinator_kafka_bootstrap_servers: String,
    /// Kafka topic for cache events.
    #[arg(long, value_name = "TOPIC", default_value = "lmcache-cache-events")]
    pub coordinator_kafka_topic: String,
    /// Seconds the Kafka producer retries a record.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        allow_negative_numbers = true
    )]
    pub coordinator_kafka_delivery_timeout: f64,
    /// Seconds a fleet CacheBlend lookup may take.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub coordinator_blend_timeout: f64,
    /// Fleet CacheBlend match round-trips in flight.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 8,
        allow_negative_numbers = true
    )]
    pub coordinator_blend_match_concurrency: i64,
    /// Deprecated spelling of --coordinator-event-reporting.
    #[arg(long, hide = true)]
    pub coordinator_l2_event_reporting: bool,
    /// Deprecated spelling of --coordinator-event-flush-interval.
    #[arg(
        long,
        hide = true,
        value_name = "SECONDS",
        allow_negative_numbers = true
    )]
    pub coordinator_l2_event_flush_interval: Option<f64>,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Output (lmcache's common CLI flags; no effect for a server)")]
pub struct OutputArgs {
    /// Result-table format (terminal, json). No effect for `server`.
    #[arg(long, value_name = "FORMAT")]
    pub format: Option<String>,
    /// Save the result table to PATH. No effect for `server`.
    #[arg(long, value_name = "PATH")]
    pub output: Option<String>,
    /// Suppress the result table. No effect for `server`.
    #[arg(short = 'q', long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "kvshard only (not lmcache flags)")]
pub struct KvshardArgs {
    /// [kvshard only] CPU cores to run shards on, one shard per core, e.g. 0-3,6. The front (the
    /// thread that serves ZeroMQ) is pinned to the last allowed core no shard uses, or runs
    /// unpinned when the shards take them all [default: every core in the process's allowed CPU
    /// set but the last, which the front gets; the only one on a one-core host].
    #[arg(long, value_name = "LIST")]
    pub cores: Option<String>,
    /// [kvshard only] Bound of each shard's request mailbox, in requests; also the bound of the
    /// front's overflow queue for that shard. A request that finds both full is answered with its
    /// failure reply and counted (kvshard_shard_overflow_refused_total); the front never waits on
    /// a shard.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4096,
        allow_negative_numbers = true
    )]
    pub shard_queue_depth: usize,
    /// [kvshard only] Write credits per shard and object size: L1 slabs a shard lends the front
    /// ahead of time, so an engine_driven prepare_store is answered without waiting for the shard.
    /// Raised to the most chunks one request puts on a shard, and at most 1/64 of a shard's memory
    /// per size; taken from memory (evicting under LRU) and counted as used. Chunks the request's lookup found are left out of the reply; other
    /// chunks that are already stored are copied again and dropped at commit. 0 asks the shards
    /// at every prepare_store, which leaves out every chunk already stored (as lmcache does).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub write_credits: u32,
    /// [kvshard only] Maximum live request sessions; more are refused and counted.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 65536,
        allow_negative_numbers = true
    )]
    pub max_sessions: usize,
    /// [kvshard only] Maximum live KV-cache registrations (worker contexts).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4096,
        allow_negative_numbers = true
    )]
    pub max_registrations: usize,
    /// [kvshard only] Largest request payload frame accepted, in bytes (default 512 MiB: a
    /// pickled store of 8 chunks of 32 MiB fits). A larger frame is answered with the op's
    /// failure reply, logged and counted (kvshard_oversized_frames_total); one over twice this
    /// (at least 1 GiB) is dropped by ZeroMQ with its connection before kvshard sees it.
    #[arg(long, value_name = "BYTES", default_value_t = 512 << 20, allow_negative_numbers = true)]
    pub max_frame_bytes: usize,
    /// [kvshard only] Serve GPU workers' lmcache_driven transfers over CUDA IPC (on, the
    /// default), or answer their registrations with a refusal that points them at engine_driven
    /// (off). Needs a CUDA driver, NVRTC and an L1 in memory (not --gds-l1-path); where any is
    /// missing, registrations are refused the same way, with the cause.
    #[arg(long, value_name = "MODE", value_parser = ["off", "on"], default_value = "on")]
    pub cuda_transfer: String,
    /// [kvshard only] With --hash-algorithm sha256_cbor, the prefix the first chunk is chained
    /// on. vllm: vLLM's init_none_hash, sha256_cbor($PYTHONHASHSEED), as lmcache server derives
    /// it where vLLM imports (without PYTHONHASHSEED it is 32 random bytes, so keys change at every
    /// restart, as there). fallback: sha256_cbor((0, (0,), None)), what lmcache server uses where
    /// vLLM's hashing module imports but its kv_cache_utils does not.
    #[arg(long, value_name = "FROM", value_parser = ["vllm", "fallback"], default_value = "vllm")]
    pub sha256_cbor_none_hash: String,
    /// [kvshard only] HTTP API connections kept open at once. At the bound, a new client takes
    /// the place of the connection that has waited longest on its client (idle, or sending
    /// slowly), counted in kvshard_http_connections_shed_total; idle clients never keep
    /// /healthcheck or /metrics waiting.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1024,
        allow_negative_numbers = true
    )]
    pub http_max_connections: usize,
    /// [kvshard only] Cache salts `PUT /quota/<salt>` may hold limits for at once; a new salt
    /// beyond it is refused with 400 (set or delete existing ones meanwhile).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 4096,
        allow_negative_numbers = true
    )]
    pub max_quotas: usize,
    /// [kvshard only] Block ids one `POST /cache/checksums` may name; a longer list is refused
    /// with 400 (each block is read and hashed on every layer).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 16384,
        allow_negative_numbers = true
    )]
    pub max_checksum_blocks: usize,
    /// [kvshard only] Seconds a stopping server (SIGTERM, SIGINT) waits for L2 writes still
    /// running before it exits anyway, logging what was abandoned. The ports, the SHM pool's
    /// name and its lock are given up first, whatever L2 still holds. 0 does not wait.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10.0,
        allow_negative_numbers = true
    )]
    pub shutdown_drain_seconds: f64,
    /// [kvshard only] Microseconds that each shard and the front keep polling for their next
    /// piece of work before they sleep. A request that arrives meanwhile costs no wake-up (no
    /// syscall, no scheduler latency), at the price of a busy core for that long after each
    /// piece of work. 0 sleeps at once. Worth it only where each shard and the front have a core
    /// to themselves (tools/deploy's plan sets 1000); on shared cores it takes time from vLLM.
    #[arg(
        long,
        value_name = "US",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub spin_us: u64,
    /// [kvshard only] L1 bytes being written to L2 at once, server-wide, in GiB; more
    /// stores wait their turn.
    #[arg(
        long,
        value_name = "GB",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub l2_store_inflight_gb: f64,
    /// [kvshard only] Format of the log lines on stderr: text (`<RFC 3339 UTC time, ms>
    /// LEVEL target (thread): message`) or json (one object per line with ts, level, target,
    /// thread and msg).
    #[arg(
        long,
        value_name = "FORMAT",
        value_enum,
        default_value_t = LogFormat::Text,
        env = "KVSHARD_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
}

/// Facts about the host that resolution depends on, separated so tests can pin them.
#[derive(Debug, Clone)]
pub struct Host {
    /// CPU cores this process may run on (sched_getaffinity).
    pub allowed_cores: Vec<usize>,
    /// `LMCACHE_COORDINATOR_URL`, which 0.5.6 reads when --coordinator-url is absent.
    pub coordinator_url_env: Option<String>,
    /// `LMCACHE_COORDINATOR_EVENT_REPORTING`, read when no reporting flag is given.
    pub coordinator_event_reporting_env: Option<String>,
    /// `PYTHONHASHSEED`, from which vLLM derives sha256_cbor's first prefix.
    pub python_hash_seed: Option<String>,
}

impl Host {
    /// Reads this process's CPU affinity, the coordinator environment variables and
    /// `PYTHONHASHSEED`.
    pub fn probe() -> Host {
        Host {
            allowed_cores: allowed_cores(),
            coordinator_url_env: std::env::var("LMCACHE_COORDINATOR_URL").ok(),
            coordinator_event_reporting_env: std::env::var("LMCACHE_COORDINATOR_EVENT_REPORTING")
                .ok(),
            python_hash_seed: std::env::var("PYTHONHASHSEED").ok(),
        }
    }
}

type Notes = Vec<String>;

fn refuse(flag: &'static str, reason: &str) -> Result<(), ConfigError> {
    Err(ConfigError::unsupported(flag, reason))
}

fn no_effect(notes: &mut Notes, flag: &str, why: &str) {
    notes.push(format!("{flag} has no effect in kvshard: {why}"));
}

/// Seconds given as a float flag to a Duration; `zero_ok` allows exactly 0.
fn seconds(flag: &'static str, v: f64, zero_ok: bool) -> Result<Duration, ConfigError> {
    let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0));
    let d = if ok {
        Duration::try_from_secs_f64(v).ok()
    } else {
        None
    };
    d.ok_or_else(|| {
        let want = if zero_ok { ">= 0" } else { "> 0" };
        ConfigError::invalid(
            flag,
            format!("{v} is not a finite number of seconds {want}"),
        )
    })
}

fn fraction(flag: &'static str, v: f64) -> Result<f64, ConfigError> {
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(ConfigError::invalid(flag, format!("{v} is not in (0, 1]")))
    }
}

fn positive(flag: &'static str, v: i64) -> Result<u64, ConfigError> {
    u64::try_from(v)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| ConfigError::invalid(flag, format!("{v} must be > 0")))
}

fn nonzero(flag: &'static str, v: usize) -> Result<usize, ConfigError> {
    if v == 0 {
        Err(ConfigError::invalid(flag, "must be > 0"))
    } else {
        Ok(v)
    }
}

/// `--spin-us`, at most 10 ms: past that a core is simply never given back.
fn spin_duration(us: u64) -> Result<Duration, ConfigError> {
    const MAX_US: u64 = 10_000;
    if us > MAX_US {
        return Err(ConfigError::invalid(
            "--spin-us",
            format!("must be at most {MAX_US} microseconds"),
        ));
    }
    Ok(Duration::from_micros(us))
}

fn port(flag: &'static str, v: u16) -> Result<u16, ConfigError> {
    if v == 0 {
        Err(ConfigError::invalid(
            flag,
            "port 0 is not allowed: clients must know the port (use 1-65535)",
        ))
    } else {
        Ok(v)
    }
}

fn host_name(flag: &'static str, v: String) -> Result<String, ConfigError> {
    if v.trim().is_empty() {
        Err(ConfigError::invalid(flag, "the host must not be empty"))
    } else {
        Ok(v)
    }
}

/// `0-3,6`-style rendering of a core set, for messages.
fn format_cores(cores: &[usize]) -> String {
    let mut sorted = cores.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

impl ServerArgs {
    /// Validates the flags against this host and resolves them. Returns the config and
    /// start-up notes (accepted flags that do nothing in kvshard, clamped values) for the
    /// binary to log.
    pub fn into_config(self) -> Result<(ServerConfig, Notes), ConfigError> {
        self.resolve(&Host::probe())
    }

    /// [`ServerArgs::into_config`] with the host facts given: each flag group is
    /// resolved on its own, then [`check_cross_group`] checks the flags whose
    /// validity depends on another group. The first error found is returned.
    pub fn resolve(self, host: &Host) -> Result<(ServerConfig, Notes), ConfigError> {
        let mut notes = Notes::new();
        let ServerArgs {
            mp,
            p2p,
            l1,
            gds,
            ttl,
            eviction,
            l2_policy,
            l2,
            http,
            obs,
            lookup_log,
            gc,
            extra_log,
            trace,
            coordinator,
            output,
            kvshard,
        } = self;

        let shm_name_flag = mp.shm_name.clone();
        let mp = mp.resolve(&mut notes)?;
        p2p.check()?;
        // The GDS group goes first: its note precedes the L1 memory notes.
        let gds_l1 = gds.resolve(&mut notes)?;
        let memory = l1.resolve(&mut notes)?;
        let (write_ttl, read_ttl) = ttl.resolve()?;
        let eviction = eviction.resolve()?;
        // `--shm-name` (an MP flag) is resolved after the L1 groups: its note follows
        // theirs.
        let shm_name = shm_pool(mp.transfer_mode, shm_name_flag.as_deref(), &mut notes)?;
        let adapters = l2.resolve()?;
        let l2_policy = l2_policy.resolve(&mut notes)?;
        let (http_host, http_port) = http.resolve()?;
        obs.check(&mut notes)?;
        let lookup_hash_log = lookup_log.resolve()?;
        gc.check(&mut notes);
        extra_log.check(&mut notes)?;
        trace.check()?;
        coordinator.check(host)?;
        output.check(&mut notes);
        let token_hasher = token_hasher(
            mp.sha256_cbor,
            &kvshard.sha256_cbor_none_hash,
            host,
            &mut notes,
        )?;
        let kvshard = kvshard.resolve(host)?;

        let mut config = ServerConfig {
            instance_id: mp.instance_id,
            host: mp.host,
            port: mp.port,
            chunk_size: mp.chunk_size,
            hash_algorithm: mp.hash_algorithm,
            token_hasher,
            cores: kvshard.cores,
            front_core: kvshard.front_core,
            transfer_mode: mp.transfer_mode,
            shm_name,
            session_ttl: mp.session_ttl,
            worker_reap_timeout: mp.worker_reap_timeout,
            worker_registration_grace: mp.worker_registration_grace,
            null_block_id: mp.null_block_id,
            kv_event_log_size: mp.kv_event_log_size,
            separate_object_groups: mp.separate_object_groups,
            isolated_ipc: mp.isolated_ipc,
            l1: L1Settings {
                size_bytes: memory.size_bytes,
                use_lazy: memory.use_lazy,
                use_hugepages: memory.use_hugepages,
                init_size_bytes: memory.init_size_bytes,
                align_bytes: memory.align_bytes,
                devdax_path: memory.devdax_path,
                gds: gds_l1,
                write_ttl,
                read_ttl,
                eviction_policy: eviction.policy,
                trigger_watermark: eviction.trigger_watermark,
                eviction_ratio: eviction.ratio,
            },
            l2: L2Settings {
                adapters,
                store_policy: l2_policy.store_policy,
                prefetch_policy: l2_policy.prefetch_policy,
                prefetch_max_in_flight: l2_policy.prefetch_max_in_flight,
                prefetch_load_timeout: l2_policy.prefetch_load_timeout,
                store_inflight_bytes: kvshard.l2_store_inflight_bytes,
            },
            http_host,
            http_port,
            lookup_hash_log,
            disable_observability: obs.disable_observability,
            disable_metrics: obs.disable_metrics,
            disable_logging: obs.disable_logging,
            shard_queue_depth: kvshard.shard_queue_depth,
            write_credits: kvshard.write_credits,
            max_sessions: kvshard.max_sessions,
            max_registrations: kvshard.max_registrations,
            max_frame_bytes: kvshard.max_frame_bytes,
            cuda_transfer: kvshard.cuda_transfer,
            http_max_connections: kvshard.http_max_connections,
            max_quotas: kvshard.max_quotas,
            max_checksum_blocks: kvshard.max_checksum_blocks,
            shutdown_drain: kvshard.shutdown_drain,
            spin: kvshard.spin,
        };
        check_cross_group(&mut config, &mut notes)?;
        Ok((config, notes))
    }
}

/// The MP server group, resolved.
struct MpServer {
    instance_id: String,
    host: String,
    port: u16,
    chunk_size: usize,
    hash_algorithm: String,
    /// `hash_algorithm` names vLLM's sha256_cbor (else it is blake3).
    sha256_cbor: bool,
    transfer_mode: TransferMode,
    session_ttl: Duration,
    worker_reap_timeout: Duration,
    worker_registration_grace: Duration,
    null_block_id: i64,
    kv_event_log_size: usize,
    separate_object_groups: bool,
    isolated_ipc: bool,
}

impl MpServerArgs {
    /// MP server flags but `--shm-name` (see [`shm_pool`]).
    fn resolve(self, notes: &mut Notes) -> Result<MpServer, ConfigError> {
        if self.transport != "zmq" {
            refuse(
                "--transport",
                "only the zmq transport is implemented (gRPC is not); drop --transport grpc",
            )?;
        }
        let sha256_cbor = match self.hash_algorithm.as_str() {
            "blake3" => false,
            "sha256_cbor" | "sha256_cbor_64bit" => true,
            "builtin" => {
                return Err(ConfigError::unsupported(
                    "--hash-algorithm",
                    "builtin is Python's hash(), which no other process reproduces: CPython \
                     3.11's hash(None) differs in every process, so the keys would match no \
                     lmcache server's, nor this server's after a restart; use blake3 (the \
                     default) or sha256_cbor",
                ))
            }
            "sha256" | "xxhash" | "xxhash_cbor" => {
                return Err(ConfigError::unsupported(
                    "--hash-algorithm",
                    format!(
                        "vLLM's {} is not implemented; use blake3 (the default) or sha256_cbor",
                        self.hash_algorithm
                    ),
                ))
            }
            other => {
                return Err(ConfigError::invalid(
                    "--hash-algorithm",
                    format!("unknown algorithm {other:?}; kvshard accepts blake3 and sha256_cbor"),
                ))
            }
        };
        if self.engine_type != "default" {
            refuse(
                "--engine-type",
                "CacheBlend engines (blend, blend_legacy) are not implemented; use default",
            )?;
        }
        if !self.runtime_plugin_locations.is_empty() {
            refuse(
                "--runtime-plugin-locations",
                "runtime plugins (Python scripts launched by the server) are not supported",
            )?;
        }
        let plugin_config = if self.runtime_plugin_config.is_empty() {
            "{}"
        } else {
            self.runtime_plugin_config.as_str()
        };
        match serde_json::from_str::<serde_json::Value>(plugin_config) {
            Err(e) => {
                return Err(ConfigError::invalid(
                    "--runtime-plugin-config",
                    format!("not valid JSON: {e}"),
                ))
            }
            Ok(serde_json::Value::Object(m)) if m.is_empty() => {}
            Ok(_) => refuse(
                "--runtime-plugin-config",
                "runtime plugins are not supported, so their config has no consumer",
            )?,
        }
        if !self.script_allowed_imports.is_empty() {
            refuse(
                "--script-allowed-imports",
                "kvshard has no /run_script endpoint (it would run Python)",
            )?;
        }
        if self.run_script_api_enabled && !self.no_run_script_api_enabled {
            refuse(
                "--run-script-api-enabled",
                "kvshard has no /run_script endpoint (it would run Python)",
            )?;
        }
        if self.enable_segmented_prefix {
            refuse(
                "--enable-segmented-prefix",
                "it is a CacheBlend option and CacheBlend is not implemented",
            )?;
        }
        if self.enable_dedup_content {
            refuse(
                "--enable-dedup-content",
                "it is a CacheBlend option and CacheBlend is not implemented",
            )?;
        }
        if self.enable_blend_reorder {
            refuse(
                "--enable-blend-reorder",
                "it is a CacheBlend option and CacheBlend is not implemented",
            )?;
        }
        if !self.enable.is_empty() {
            refuse(
                "--enable",
                "experimental transfer modules (e.g. transfer_query) are not implemented",
            )?;
        }
        if !self.server_module.is_empty() {
            refuse(
                "--server-module",
                "out-of-tree Python server modules cannot be loaded",
            )?;
        }
        let transfer_mode =
            TransferMode::from_flag(&self.supported_transfer_mode).ok_or_else(|| {
                ConfigError::invalid(
                    "--supported-transfer-mode",
                    format!(
                        "{:?} is not one of lmcache_driven, engine_driven, auto",
                        self.supported_transfer_mode
                    ),
                )
            })?;
        if self.max_workers != 1 || self.max_gpu_workers.is_some() || self.max_cpu_workers.is_some()
        {
            no_effect(
                notes,
                "--max-workers/--max-gpu-workers/--max-cpu-workers",
                "there are no Python worker pools; one shard per --cores core serves requests",
            );
        }
        if self.grpc_server_workers < 1 {
            return Err(ConfigError::invalid(
                "--grpc-server-workers",
                format!("{} must be >= 1", self.grpc_server_workers),
            ));
        }
        if self.grpc_server_workers != 32 {
            no_effect(notes, "--grpc-server-workers", "there is no gRPC transport");
        }
        let instance_id = match self.instance_id {
            Some(id) if !id.is_empty() => id,
            // 0.5.6: `args.instance_id or uuid4()`, so an empty id also gets a random one.
            _ => new_uuid_v4(),
        };
        let host = host_name("--host", self.host)?;
        let port = port("--port", self.port)?;
        let chunk_size = usize::try_from(self.chunk_size)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| {
                ConfigError::invalid("--chunk-size", format!("{} must be > 0", self.chunk_size))
            })?;
        let kv_event_log_size = usize::try_from(self.kv_event_log_size).map_err(|_| {
            ConfigError::invalid(
                "--kv-event-log-size",
                format!("{} must be >= 0", self.kv_event_log_size),
            )
        })?;

        // 0.5.6 floors a non-zero reap timeout at 30 s so missed pings never reap a live worker.
        let reap = seconds(
            "--worker-reap-timeout-seconds",
            self.worker_reap_timeout_seconds,
            true,
        )?;
        if !reap.is_zero() && reap < Duration::from_secs(30) {
            return Err(ConfigError::invalid(
                "--worker-reap-timeout-seconds",
                format!(
                    "{} must be 0 (disabled) or >= 30; keep it >= 3x the client heartbeat interval",
                    self.worker_reap_timeout_seconds
                ),
            ));
        }
        let grace = seconds(
            "--worker-registration-grace-seconds",
            self.worker_registration_grace_seconds,
            true,
        )?;
        if grace < reap {
            return Err(ConfigError::invalid(
                "--worker-registration-grace-seconds",
                format!(
                    "{} must be >= --worker-reap-timeout-seconds ({})",
                    self.worker_registration_grace_seconds, self.worker_reap_timeout_seconds
                ),
            ));
        }
        let session_ttl = seconds("--session-ttl-seconds", self.session_ttl_seconds, false)?;

        Ok(MpServer {
            instance_id,
            host,
            port,
            chunk_size,
            hash_algorithm: self.hash_algorithm,
            sha256_cbor,
            transfer_mode,
            session_ttl,
            worker_reap_timeout: reap,
            worker_registration_grace: grace,
            null_block_id: self.null_block_id,
            kv_event_log_size,
            separate_object_groups: self.separate_object_groups && !self.no_separate_object_groups,
            isolated_ipc: self.isolated_ipc && !self.no_isolated_ipc,
        })
    }
}

/// `--shm-name`: the SHM pool of the engine_driven path, `None` when that path is
/// not loaded (`--supported-transfer-mode lmcache_driven`) or the pool is disabled.
fn shm_pool(
    transfer_mode: TransferMode,
    shm_name: Option<&str>,
    notes: &mut Notes,
) -> Result<Option<String>, ConfigError> {
    Ok(if transfer_mode.engine_driven_enabled() {
        match shm_name {
            None => Some(auto_shm_name()),
            Some("") => {
                notes.push(
                    "--shm-name \"\" disables the SHM pool: engine_driven (CPU) workers will \
                     be offered no SHM and must use the pickle path, which kvshard does not \
                     support"
                        .to_string(),
                );
                None
            }
            Some(name) => Some(normalize_shm_name(name)?),
        }
    } else {
        if shm_name.is_some() {
            no_effect(
                notes,
                "--shm-name",
                "--supported-transfer-mode lmcache_driven does not load the engine_driven \
                 path that uses the SHM pool",
            );
        }
        None
    })
}

impl P2pArgs {
    /// Peer-to-peer transfer is not implemented: every flag must keep its default.
    fn check(&self) -> Result<(), ConfigError> {
        if !self.p2p_advertise_url.is_empty() {
            refuse(
                "--p2p-advertise-url",
                "peer-to-peer KV transfer is not implemented",
            )?;
        }
        if !self.p2p_listen_url.is_empty() {
            refuse(
                "--p2p-listen-url",
                "peer-to-peer KV transfer is not implemented",
            )?;
        }
        if self.p2p_lookup_timeout != 30.0 {
            refuse(
                "--p2p-lookup-timeout",
                "peer-to-peer KV transfer is not implemented",
            )?;
        }
        if self.p2p_load_timeout != 30.0 {
            refuse(
                "--p2p-load-timeout",
                "peer-to-peer KV transfer is not implemented",
            )?;
        }
        if self.p2p_transfer_engine != "nixl" {
            refuse(
                "--p2p-transfer-engine",
                "peer-to-peer KV transfer is not implemented",
            )?;
        }
        Ok(())
    }
}

/// The L1 memory group, resolved; `use_lazy` does not yet account for the GDS tier.
struct L1Memory {
    size_bytes: u64,
    use_lazy: bool,
    use_hugepages: bool,
    init_size_bytes: u64,
    align_bytes: u64,
    devdax_path: Option<PathBuf>,
}

impl L1MemoryArgs {
    /// `--l1-*`: size, alignment, lazy allocation, hugetlb and device-DAX backing.
    fn resolve(self, notes: &mut Notes) -> Result<L1Memory, ConfigError> {
        if !self.l1_manager.is_empty() {
            refuse(
                "--l1-manager",
                "tagged multi-L1 configurations are not implemented; use --l1-size-gb and the \
                 other --l1-* flags",
            )?;
        }
        let use_hugepages = self.l1_use_hugepages && !self.no_l1_use_hugepages;
        let devdax_path = match self.l1_devdax_path.as_deref() {
            None => None,
            Some("") => {
                return Err(ConfigError::invalid(
                    "--l1-devdax-path",
                    "is empty; give a /dev/daxX.Y device or a file",
                ))
            }
            Some(p) => Some(PathBuf::from(p)),
        };
        if devdax_path.is_some() && use_hugepages {
            return Err(ConfigError::invalid(
                "--l1-devdax-path",
                "conflicts with --l1-use-hugepages: the device-DAX arena is the L1 memory; drop one \
                 of them",
            ));
        }
        let size_gb = self
            .l1_size_gb
            .ok_or_else(|| ConfigError::invalid("--l1-size-gb", "is required"))?;
        let size_bytes = gb_to_bytes(size_gb).filter(|&b| b > 0).ok_or_else(|| {
            ConfigError::invalid("--l1-size-gb", format!("{size_gb} is not a size > 0 GB"))
        })?;
        let align_bytes = self.l1_align_bytes;
        if align_bytes < 64 || !align_bytes.is_power_of_two() {
            return Err(ConfigError::invalid(
                "--l1-align-bytes",
                format!("{align_bytes} is not a power of two >= 64"),
            ));
        }
        if size_bytes < align_bytes {
            return Err(ConfigError::invalid(
                "--l1-size-gb",
                format!("{size_gb} GB ({size_bytes} bytes) is smaller than --l1-align-bytes {align_bytes}"),
            ));
        }
        // BooleanOptionalAction: the last of --l1-use-lazy / --no-l1-use-lazy wins.
        let use_lazy = !self.no_l1_use_lazy && !use_hugepages && devdax_path.is_none();
        if devdax_path.is_some() && !self.no_l1_use_lazy {
            // 0.5.6 refuses devdax without --no-l1-use-lazy; growing shard slices
            // lazily buys nothing on memory that is all there from the start.
            notes.push(
                "--l1-devdax-path turns lazy allocation off: the whole device-DAX arena is given to \
                 the shards at start"
                    .to_string(),
            );
        }
        if use_hugepages && !self.no_l1_use_lazy {
            notes.push(
                "--l1-use-hugepages turns lazy allocation off: the hugetlb pool is reserved at start \
                 (as lmcache 0.5.6 does)"
                    .to_string(),
            );
        }
        let init_size_bytes = match self.l1_init_size_gb {
            None => (20u64 << 30).min(size_bytes),
            Some(gb) => {
                let bytes = gb.checked_mul(1 << 30).ok_or_else(|| {
                    ConfigError::invalid("--l1-init-size-gb", format!("{gb} GB is too large"))
                })?;
                if bytes > size_bytes {
                    notes.push(format!(
                        "--l1-init-size-gb {gb} exceeds --l1-size-gb {size_gb}: the initial \
                         allocation is clamped to {size_bytes} bytes (as lmcache 0.5.6 does)"
                    ));
                }
                bytes.min(size_bytes)
            }
        };
        Ok(L1Memory {
            size_bytes,
            use_lazy,
            use_hugepages,
            init_size_bytes,
            align_bytes,
            devdax_path,
        })
    }
}

impl GdsL1Args {
    /// `--gds-l1-*`: the GDS L1 tier, or `None` without `--gds-l1-path`.
    fn resolve(self, notes: &mut Notes) -> Result<Option<GdsL1Settings>, ConfigError> {
        let path = match self.gds_l1_path.as_deref() {
            None => {
                if self.gds_l1_backend != "auto" {
                    no_effect(
                        notes,
                        "--gds-l1-backend",
                        "it only applies with --gds-l1-path",
                    );
                }
                return Ok(None);
            }
            Some("") => {
                return Err(ConfigError::invalid(
                    "--gds-l1-path",
                    "is empty; give a directory on a block-device filesystem (ext4, xfs, ...)",
                ))
            }
            Some(p) => PathBuf::from(p),
        };
        let backend = match self.gds_l1_backend.as_str() {
            "auto" => GdsBackend::IoUring,
            "cufile" => return Err(ConfigError::unsupported(
                "--gds-l1-backend",
                "cufile moves objects between GPU memory and the slab without host staging, and \
                     kvshard has no cuFile slab backend (GPU workers need the L1 in memory): use \
                     auto, which reads and writes the slab with O_DIRECT through io_uring",
            )),
            "ugds" => return Err(ConfigError::unsupported(
                "--gds-l1-backend",
                "ugds (a raw /dev/ugds_drvX device) is not supported; use auto with a directory",
            )),
            other => {
                return Err(ConfigError::unsupported(
                    "--gds-l1-backend",
                    format!(
                        "{other} drives a non-NVIDIA GPU's storage path, which kvshard does not \
                         support; use auto, which reads and writes the slab with O_DIRECT through \
                         io_uring"
                    ),
                ))
            }
        };
        Ok(Some(GdsL1Settings {
            path,
            direct_io: !self.no_gds_l1_use_direct_io,
            backend,
        }))
    }
}

impl L1TtlArgs {
    /// `--l1-write-ttl-seconds` and `--l1-read-ttl-seconds`, in that order.
    fn resolve(&self) -> Result<(Duration, Duration), ConfigError> {
        if self.l1_write_ttl_seconds == 0 {
            return Err(ConfigError::invalid(
                "--l1-write-ttl-seconds",
                "must be > 0",
            ));
        }
        if self.l1_read_ttl_seconds == 0 {
            return Err(ConfigError::invalid("--l1-read-ttl-seconds", "must be > 0"));
        }
        Ok((
            Duration::from_secs(self.l1_write_ttl_seconds),
            Duration::from_secs(self.l1_read_ttl_seconds),
        ))
    }
}

/// The eviction group, resolved.
struct Eviction {
    policy: EvictionPolicyName,
    trigger_watermark: f64,
    ratio: f64,
}

impl EvictionArgs {
    fn resolve(self) -> Result<Eviction, ConfigError> {
        let policy_flag = self
            .eviction_policy
            .ok_or_else(|| ConfigError::invalid("--eviction-policy", "is required"))?;
        let policy = match EvictionPolicyName::from_flag(&policy_flag) {
            Some(p) => p,
            None if policy_flag == "ARC" => {
                return Err(ConfigError::unsupported(
                    "--eviction-policy",
                    "ARC is not implemented; use LRU, IsolatedLRU or noop",
                ))
            }
            None => {
                return Err(ConfigError::invalid(
                    "--eviction-policy",
                    format!("{policy_flag:?} is not one of LRU, IsolatedLRU, noop"),
                ))
            }
        };
        Ok(Eviction {
            policy,
            trigger_watermark: fraction(
                "--eviction-trigger-watermark",
                self.eviction_trigger_watermark,
            )?,
            ratio: fraction("--eviction-ratio", self.eviction_ratio)?,
        })
    }
}

/// The L2 policy group, resolved.
struct L2Policy {
    store_policy: L2StorePolicy,
    prefetch_policy: L2PrefetchPolicy,
    prefetch_max_in_flight: usize,
    prefetch_load_timeout: Duration,
}

impl L2PolicyArgs {
    fn resolve(&self, notes: &mut Notes) -> Result<L2Policy, ConfigError> {
        let store_policy = match self.l2_store_policy.as_str() {
            "skip_l1" => L2StorePolicy::SkipL1,
            _ => L2StorePolicy::Default,
        };
        let prefetch_policy = match self.l2_prefetch_policy.as_str() {
            "retain" => L2PrefetchPolicy::Retain,
            _ => L2PrefetchPolicy::Default,
        };
        let prefetch_max_in_flight = usize::try_from(self.l2_prefetch_max_in_flight)
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| {
                ConfigError::invalid("--l2-prefetch-max-in-flight", "must be at least 1")
            })?;
        if self.periodic_notifier_interval_ms != 5 {
            no_effect(
                notes,
                "--periodic-notifier-interval-ms",
                "shards are woken by completions; there is no notifier thread",
            );
        }
        let prefetch_load_timeout = seconds(
            "--l2-prefetch-load-timeout",
            self.l2_prefetch_load_timeout,
            true,
        )?;
        Ok(L2Policy {
            store_policy,
            prefetch_policy,
            prefetch_max_in_flight,
            prefetch_load_timeout,
        })
    }
}

impl L2AdapterArgs {
    /// One parsed adapter per `--l2-adapter`, in flag order.
    fn resolve(&self) -> Result<Vec<AdapterSpec>, ConfigError> {
        let mut adapters = Vec::with_capacity(self.l2_adapter.len());
        for (i, raw) in self.l2_adapter.iter().enumerate() {
            let spec = parse_adapter_spec(i + 1, raw)
                .map_err(|e| ConfigError::invalid("--l2-adapter", e))?;
            adapters.push(spec);
        }
        Ok(adapters)
    }
}

impl HttpArgs {
    /// `(--http-host, --http-port)`.
    fn resolve(self) -> Result<(String, u16), ConfigError> {
        Ok((
            host_name("--http-host", self.http_host)?,
            port("--http-port", self.http_port)?,
        ))
    }
}

impl ObservabilityArgs {
    /// Refuses tracing/OTLP and notes the Python-only tuning flags; the `--disable-*`
    /// switches are copied into the config as given.
    fn check(&self, notes: &mut Notes) -> Result<(), ConfigError> {
        if self.enable_tracing {
            refuse(
                "--enable-tracing",
                "OpenTelemetry tracing is not implemented",
            )?;
        }
        if self.otlp_endpoint.as_deref().is_some_and(|e| !e.is_empty()) {
            refuse(
                "--otlp-endpoint",
                "OTLP export is not implemented; scrape GET /metrics on --http-port",
            )?;
        }
        if self.disable_grpc_metrics {
            no_effect(
                notes,
                "--disable-grpc-metrics",
                "there is no gRPC transport",
            );
        }
        if self.event_bus_queue_size != 10000 {
            no_effect(
                notes,
                "--event-bus-queue-size",
                "there is no Python EventBus; shards keep their own counters",
            );
        }
        if self.prometheus_port != 9090 {
            no_effect(
                notes,
                "--prometheus-port",
                "metrics are served at GET /metrics on --http-port (as `lmcache server` does)",
            );
        }
        if self.metrics_sample_rate != 0.01 {
            no_effect(
                notes,
                "--metrics-sample-rate",
                "there are no sampled lifecycle histograms; counters count every event",
            );
        }
        Ok(())
    }
}

impl LookupHashLogArgs {
    /// The lookup hash log, or `None` without `--lookup-hash-log-dir`.
    fn resolve(self) -> Result<Option<LookupHashLogSettings>, ConfigError> {
        if self.lookup_hash_log_dir.is_empty() {
            return Ok(None);
        }
        let interval = positive(
            "--lookup-hash-log-rotation-interval",
            self.lookup_hash_log_rotation_interval,
        )?;
        let max_bytes = positive(
            "--lookup-hash-log-rotation-max-size",
            self.lookup_hash_log_rotation_max_size,
        )?;
        let max_files = positive(
            "--lookup-hash-log-max-files",
            self.lookup_hash_log_max_files,
        )?;
        Ok(Some(LookupHashLogSettings {
            dir: PathBuf::from(self.lookup_hash_log_dir),
            rotation_interval: Duration::from_secs(interval),
            rotation_max_bytes: max_bytes,
            max_files: usize::try_from(max_files).unwrap_or(usize::MAX),
        }))
    }
}

impl GcMonitorArgs {
    fn check(&self, notes: &mut Notes) {
        if self.enable_gc_monitor
            || self.gc_monitor_min_pause_ms != 1.0
            || self.gc_monitor_top_objects != 0
        {
            no_effect(
                notes,
                "--enable-gc-monitor/--gc-monitor-*",
                "there is no garbage collector to time",
            );
        }
    }
}

impl ExtraLoggingArgs {
    fn check(&self, notes: &mut Notes) -> Result<(), ConfigError> {
        if self.enable_extra_logging {
            refuse(
                "--enable-extra-logging",
                "periodic per-GPU L0<->L1 throughput logging is not implemented",
            )?;
        }
        // 0.5.6 validates the interval even when extra logging is off.
        let interval = self.extra_logging_interval;
        if interval.is_nan() || interval <= 0.0 {
            return Err(ConfigError::invalid(
                "--extra-logging-interval",
                format!("{} must be > 0", self.extra_logging_interval),
            ));
        }
        if self.extra_logging_interval != 10.0 {
            no_effect(
                notes,
                "--extra-logging-interval",
                "it only applies with --enable-extra-logging",
            );
        }
        Ok(())
    }
}

impl TraceArgs {
    fn check(&self) -> Result<(), ConfigError> {
        if self.trace_level.is_some() {
            refuse(
                "--trace-level",
                "trace recording for replay is not implemented",
            )?;
        }
        if self.trace_output.is_some() {
            refuse(
                "--trace-output",
                "trace recording for replay is not implemented",
            )?;
        }
        Ok(())
    }
}

impl CoordinatorArgs {
    /// Joining a coordinator is not implemented: refuses any coordinator flag (or
    /// `LMCACHE_COORDINATOR_*` variable in `host`) set to anything but its default.
    fn check(&self, host: &Host) -> Result<(), ConfigError> {
        const NO_COORDINATOR: &str = "joining an MP coordinator is not implemented";
        let coordinator_url = self
            .coordinator_url
            .clone()
            .or_else(|| host.coordinator_url_env.clone())
            .unwrap_or_default();
        if !coordinator_url.is_empty() {
            let reason = if self.coordinator_url.is_some() {
                NO_COORDINATOR.to_string()
            } else {
                format!("{NO_COORDINATOR} (the URL came from LMCACHE_COORDINATOR_URL; unset it)")
            };
            return Err(ConfigError::unsupported("--coordinator-url", reason));
        }
        let reporting_env = host
            .coordinator_event_reporting_env
            .as_deref()
            .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"));
        if self.coordinator_event_reporting || self.coordinator_l2_event_reporting || reporting_env
        {
            refuse(
                "--coordinator-event-reporting",
                "cache-event reporting is not implemented (also check \
                 LMCACHE_COORDINATOR_EVENT_REPORTING)",
            )?;
        }
        if self.coordinator_advertise_ip.is_some() {
            refuse("--coordinator-advertise-ip", NO_COORDINATOR)?;
        }
        if self.coordinator_heartbeat_interval.is_some() {
            refuse("--coordinator-heartbeat-interval", NO_COORDINATOR)?;
        }
        if self.coordinator_event_flush_interval.is_some()
            || self.coordinator_l2_event_flush_interval.is_some()
        {
            refuse("--coordinator-event-flush-interval", NO_COORDINATOR)?;
        }
        if self.coordinator_event_transport != "http" {
            refuse("--coordinator-event-transport", NO_COORDINATOR)?;
        }
        if !self.coordinator_kafka_bootstrap_servers.is_empty() {
            refuse("--coordinator-kafka-bootstrap-servers", NO_COORDINATOR)?;
        }
        if self.coordinator_kafka_topic != "lmcache-cache-events" {
            refuse("--coordinator-kafka-topic", NO_COORDINATOR)?;
        }
        if self.coordinator_kafka_delivery_timeout != 300.0 {
            refuse("--coordinator-kafka-delivery-timeout", NO_COORDINATOR)?;
        }
        if self.coordinator_blend_timeout != 1.0 {
            refuse("--coordinator-blend-timeout", NO_COORDINATOR)?;
        }
        if self.coordinator_blend_match_concurrency != 8 {
            refuse("--coordinator-blend-match-concurrency", NO_COORDINATOR)?;
        }
        Ok(())
    }
}

impl OutputArgs {
    fn check(&self, notes: &mut Notes) {
        if self.format.is_some() || self.output.is_some() || self.quiet {
            no_effect(
                notes,
                "--format/--output/--quiet",
                "the server prints no result table (nor does `lmcache server`)",
            );
        }
    }
}

/// The kvshard-only group, resolved.
struct Kvshard {
    l2_store_inflight_bytes: u64,
    cores: Vec<usize>,
    front_core: Option<usize>,
    shard_queue_depth: usize,
    write_credits: u32,
    max_sessions: usize,
    max_registrations: usize,
    max_frame_bytes: usize,
    cuda_transfer: bool,
    http_max_connections: usize,
    max_quotas: usize,
    max_checksum_blocks: usize,
    shutdown_drain: Duration,
    spin: Duration,
}

/// The chunk hasher of `--hash-algorithm` (sha256_cbor or blake3, as
/// [`MpServerArgs::resolve`] found it) and, for sha256_cbor, the first chunk's prefix
/// (`--sha256-cbor-none-hash`).
fn token_hasher(
    sha256_cbor: bool,
    none_hash_from: &str,
    host: &Host,
    notes: &mut Notes,
) -> Result<TokenHasher, ConfigError> {
    if !sha256_cbor {
        if none_hash_from != "vllm" {
            return Err(ConfigError::invalid(
                "--sha256-cbor-none-hash",
                "it only applies with --hash-algorithm sha256_cbor; blake3 chains the first chunk \
                 on lmcache's own none hash",
            ));
        }
        return Ok(TokenHasher::Blake3);
    }
    let none_hash = match (none_hash_from, host.python_hash_seed.as_deref()) {
        ("fallback", _) => keys::sha256_cbor_fallback_none_hash(),
        (_, Some(seed)) => keys::sha256_cbor_seeded_none_hash(seed),
        (_, None) => {
            notes.push(
                "PYTHONHASHSEED is not set: with --hash-algorithm sha256_cbor the first chunk is \
                 chained on 32 random bytes (as vLLM's init_none_hash does), so chunk keys change \
                 at every restart and match no other server's; set PYTHONHASHSEED to the value \
                 vLLM and the other lmcache servers run with"
                    .to_string(),
            );
            keys::random_none_hash().ok_or_else(|| {
                ConfigError::invalid(
                    "--hash-algorithm",
                    "the system's random source failed to draw the none hash",
                )
            })?
        }
    };
    Ok(TokenHasher::Sha256Cbor { none_hash })
}

impl KvshardArgs {
    /// kvshard-only flags; `--cores` is checked against `host`'s allowed CPU set.
    fn resolve(self, host: &Host) -> Result<Kvshard, ConfigError> {
        let l2_store_inflight_bytes = gb_to_bytes(self.l2_store_inflight_gb)
            .filter(|b| *b > 0)
            .ok_or_else(|| {
                ConfigError::invalid("--l2-store-inflight-gb", "must be a positive number of GiB")
            })?;
        let cores = match self.cores.as_deref() {
            // The front gets the last allowed core to itself when there are two or more.
            None => match host.allowed_cores.split_last() {
                Some((_, shards)) if !shards.is_empty() => shards.to_vec(),
                _ => host.allowed_cores.clone(),
            },
            Some(list) => parse_core_list(list).map_err(|e| ConfigError::invalid("--cores", e))?,
        };
        if cores.is_empty() {
            return Err(ConfigError::invalid(
                "--cores",
                "no CPU core to run a shard on",
            ));
        }
        if let Some(c) = cores.iter().find(|c| !host.allowed_cores.contains(c)) {
            return Err(ConfigError::invalid(
                "--cores",
                format!(
                    "core {c} is not in this process's allowed CPU set ({})",
                    format_cores(&host.allowed_cores)
                ),
            ));
        }
        // The front runs on an allowed core no shard uses, the last one free.
        let front_core = host
            .allowed_cores
            .iter()
            .rev()
            .find(|c| !cores.contains(c))
            .copied();
        Ok(Kvshard {
            l2_store_inflight_bytes,
            cores,
            front_core,
            shard_queue_depth: nonzero("--shard-queue-depth", self.shard_queue_depth)?,
            write_credits: self.write_credits,
            max_sessions: nonzero("--max-sessions", self.max_sessions)?,
            max_registrations: nonzero("--max-registrations", self.max_registrations)?,
            max_frame_bytes: nonzero("--max-frame-bytes", self.max_frame_bytes)?,
            cuda_transfer: self.cuda_transfer == "on",
            http_max_connections: nonzero("--http-max-connections", self.http_max_connections)?,
            max_quotas: nonzero("--max-quotas", self.max_quotas)?,
            max_checksum_blocks: nonzero("--max-checksum-blocks", self.max_checksum_blocks)?,
            shutdown_drain: seconds(
                "--shutdown-drain-seconds",
                self.shutdown_drain_seconds,
                true,
            )?,
            spin: spin_duration(self.spin_us)?,
        })
    }
}

/// Checks between flag groups, on the config the groups resolved to: the L1
/// backings (`--l1-devdax-path`, `--l1-use-hugepages`, `--gds-l1-path`) against each
/// other and against the SHM pool (`--shm-name`, `--supported-transfer-mode`), and
/// `--l2-store-policy skip_l1` against `--l2-adapter`. Turns lazy allocation off
/// for the GDS tier.
fn check_cross_group(config: &mut ServerConfig, notes: &mut Notes) -> Result<(), ConfigError> {
    let l1 = &mut config.l1;
    if l1.devdax_path.is_some() && l1.gds.is_some() {
        return Err(ConfigError::invalid(
            "--l1-devdax-path",
            "conflicts with --gds-l1-path (as in lmcache 0.5.6): only one can hold the L1; drop \
             one of them",
        ));
    }
    if l1.gds.is_some() && l1.use_hugepages {
        return Err(ConfigError::invalid(
            "--gds-l1-path",
            "conflicts with --l1-use-hugepages: the L1 objects live in slab files, not in \
             memory; drop one of them",
        ));
    }
    let align_bytes = l1.align_bytes;
    if l1.gds.is_some() && align_bytes % GDS_SLAB_ALIGN as u64 != 0 {
        return Err(ConfigError::invalid(
            "--l1-align-bytes",
            format!(
                "{align_bytes} is not a multiple of {GDS_SLAB_ALIGN}: GDS slab objects are read and \
                 written with direct I/O, which needs {GDS_SLAB_ALIGN}-byte aligned offsets"
            ),
        ));
    }
    if l1.gds.is_some() {
        // Neither devdax nor hugetlb is set here, so `use_lazy` is the lazy flag as given.
        if l1.use_lazy {
            notes.push(
                "--gds-l1-path turns lazy allocation off: each shard's slab file is preallocated \
                 at start (as lmcache 0.5.6 does)"
                    .to_string(),
            );
        }
        l1.use_lazy = false;
    }

    let shm_pool = config.shm_name.is_some();
    if l1.devdax_path.is_some() && shm_pool {
        return Err(ConfigError::invalid(
            "--l1-devdax-path",
            "conflicts with the engine_driven SHM pool, which lives in /dev/shm, not on the \
             device: add --shm-name \"\" (or --supported-transfer-mode lmcache_driven) to \
             disable it, as lmcache 0.5.6 requires",
        ));
    }
    if l1.gds.is_some() && shm_pool {
        return Err(ConfigError::invalid(
            "--gds-l1-path",
            "conflicts with the engine_driven SHM pool: the L1 objects live in slab files that \
             engine_driven workers cannot map, so the pool would hold none of them: add \
             --shm-name \"\" (or --supported-transfer-mode lmcache_driven) to disable it",
        ));
    }
    if l1.use_hugepages && shm_pool {
        return Err(ConfigError::invalid(
            "--l1-use-hugepages",
            "is incompatible with the SHM pool: set --shm-name \"\" (or --supported-transfer-mode \
             lmcache_driven) to disable it, as lmcache 0.5.6 requires; a pre-faulted SHM pool \
             (--no-l1-use-lazy) gets transparent huge pages where /dev/shm is mounted with huge=advise",
        ));
    }

    if config.l2.store_policy == L2StorePolicy::SkipL1 && config.l2.adapters.is_empty() {
        return Err(ConfigError::invalid(
            "--l2-store-policy",
            "skip_l1 drops chunks from L1 once stored to L2, but no --l2-adapter is configured",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    const REQUIRED: [&str; 4] = ["--l1-size-gb", "1", "--eviction-policy", "LRU"];

    fn host() -> Host {
        Host {
            allowed_cores: (0..8).collect(),
            coordinator_url_env: None,
            coordinator_event_reporting_env: None,
            python_hash_seed: None,
        }
    }

    fn parse(extra: &[&str]) -> ServerArgs {
        let mut argv = vec!["kvshard", "server"];
        argv.extend_from_slice(&REQUIRED);
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv) {
            Ok(Cli {
                command: Command::Server(a),
            }) => a,
            Ok(other) => panic!("parse {extra:?}: not a server command: {other:?}"),
            Err(e) => panic!("parse {extra:?}: {e}"),
        }
    }

    fn resolve(extra: &[&str]) -> Result<(ServerConfig, Notes), ConfigError> {
        parse(extra).resolve(&host())
    }

    fn config(extra: &[&str]) -> ServerConfig {
        resolve(extra)
            .unwrap_or_else(|e| panic!("{extra:?}: {e}"))
            .0
    }

    /// The error for `extra`, which must name `flag` and be of the `unsupported` kind if asked.
    fn rejected(extra: &[&str], flag: &str, unsupported: bool) -> ConfigError {
        let e = match resolve(extra) {
            Ok(_) => panic!("{extra:?} was accepted"),
            Err(e) => e,
        };
        assert_eq!(e.flag(), flag, "{extra:?}: {e}");
        assert!(e.to_string().contains(flag), "{e}");
        assert_eq!(
            matches!(e, ConfigError::Unsupported { .. }),
            unsupported,
            "{extra:?}: {e}"
        );
        e
    }

    fn parse_err(argv: &[&str]) -> clap::Error {
        let mut full = vec!["kvshard", "server"];
        full.extend_from_slice(argv);
        Cli::try_parse_from(full).expect_err("should not parse")
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn cli_defaults_match_lmcache_056() {
        let a = parse(&[]);
        // MP server
        assert_eq!(a.mp.instance_id, None);
        assert_eq!(a.mp.transport, "zmq");
        assert_eq!(a.mp.host, "localhost");
        assert_eq!(a.mp.port, 5555);
        assert_eq!(a.mp.chunk_size, 256);
        assert_eq!(a.mp.null_block_id, 0);
        assert_eq!(a.mp.max_workers, 1);
        assert_eq!(a.mp.max_gpu_workers, None);
        assert_eq!(a.mp.max_cpu_workers, None);
        assert_eq!(a.mp.grpc_server_workers, 32);
        assert_eq!(a.mp.hash_algorithm, "blake3");
        assert_eq!(a.mp.engine_type, "default");
        assert_eq!(a.mp.supported_transfer_mode, "auto");
        assert!(!a.mp.isolated_ipc);
        assert!(a.mp.runtime_plugin_locations.is_empty());
        assert_eq!(a.mp.runtime_plugin_config, "{}");
        assert_eq!(a.mp.shm_name, None);
        assert!(a.mp.script_allowed_imports.is_empty());
        assert!(!a.mp.run_script_api_enabled);
        assert!(!a.mp.separate_object_groups);
        assert_eq!(a.mp.worker_reap_timeout_seconds, 120.0);
        assert_eq!(a.mp.session_ttl_seconds, 600.0);
        assert_eq!(a.mp.worker_registration_grace_seconds, 3600.0);
        assert!(!a.mp.enable_segmented_prefix);
        assert!(!a.mp.enable_dedup_content);
        assert!(!a.mp.enable_blend_reorder);
        assert!(a.mp.enable.is_empty());
        assert_eq!(a.mp.kv_event_log_size, 32768);
        assert!(a.mp.server_module.is_empty());
        // P2P
        assert_eq!(a.p2p.p2p_advertise_url, "");
        assert_eq!(a.p2p.p2p_listen_url, "");
        assert_eq!(a.p2p.p2p_lookup_timeout, 30.0);
        assert_eq!(a.p2p.p2p_load_timeout, 30.0);
        assert_eq!(a.p2p.p2p_transfer_engine, "nixl");
        // L1, GDS, TTL, eviction
        assert!(a.l1.l1_manager.is_empty());
        assert_eq!(a.l1.l1_init_size_gb, None);
        assert_eq!(a.l1.l1_align_bytes, 4096);
        assert!(!a.l1.l1_use_hugepages);
        assert_eq!(a.l1.l1_devdax_path, None);
        assert_eq!(a.gds.gds_l1_path, None);
        assert_eq!(a.gds.gds_l1_backend, "auto");
        assert_eq!(a.ttl.l1_write_ttl_seconds, 600);
        assert_eq!(a.ttl.l1_read_ttl_seconds, 300);
        assert_eq!(a.eviction.eviction_trigger_watermark, 0.8);
        assert_eq!(a.eviction.eviction_ratio, 0.2);
        // L2
        assert_eq!(a.l2_policy.l2_store_policy, "default");
        assert_eq!(a.l2_policy.l2_prefetch_policy, "default");
        assert_eq!(a.l2_policy.l2_prefetch_max_in_flight, 8);
        assert_eq!(a.l2_policy.periodic_notifier_interval_ms, 5);
        assert!(a.l2.l2_adapter.is_empty());
        // HTTP: loopback by default (the API can clear the cache)
        assert_eq!(a.http.http_host, "127.0.0.1");
        assert_eq!(a.http.http_port, 8080);
        // Observability
        assert!(!a.obs.disable_observability && !a.obs.disable_metrics);
        assert!(!a.obs.disable_grpc_metrics && !a.obs.disable_logging);
        assert!(!a.obs.enable_tracing);
        assert_eq!(a.obs.otlp_endpoint, None);
        assert_eq!(a.obs.event_bus_queue_size, 10000);
        assert_eq!(a.obs.prometheus_port, 9090);
        assert_eq!(a.obs.metrics_sample_rate, 0.01);
        assert_eq!(a.lookup_log.lookup_hash_log_dir, "");
        assert_eq!(a.lookup_log.lookup_hash_log_rotation_interval, 21600);
        assert_eq!(a.lookup_log.lookup_hash_log_rotation_max_size, 104857600);
        assert_eq!(a.lookup_log.lookup_hash_log_max_files, 100);
        assert!(!a.gc.enable_gc_monitor);
        assert_eq!(a.gc.gc_monitor_min_pause_ms, 1.0);
        assert_eq!(a.gc.gc_monitor_top_objects, 0);
        assert!(!a.extra_log.enable_extra_logging);
        assert_eq!(a.extra_log.extra_logging_interval, 10.0);
        assert_eq!(a.trace.trace_level, None);
        assert_eq!(a.trace.trace_output, None);
        // Coordinator
        assert_eq!(a.coordinator.coordinator_url, None);
        assert_eq!(a.coordinator.coordinator_event_transport, "http");
        assert_eq!(
            a.coordinator.coordinator_kafka_topic,
            "lmcache-cache-events"
        );
        assert_eq!(a.coordinator.coordinator_kafka_delivery_timeout, 300.0);
        assert_eq!(a.coordinator.coordinator_blend_timeout, 1.0);
        assert_eq!(a.coordinator.coordinator_blend_match_concurrency, 8);
        // kvshard only
        assert_eq!(a.kvshard.cores, None);
        assert_eq!(a.kvshard.shard_queue_depth, 4096);
        assert_eq!(a.kvshard.max_sessions, 65536);
        assert_eq!(a.kvshard.max_registrations, 4096);
        assert_eq!(a.kvshard.max_frame_bytes, 512 * 1024 * 1024);
        assert_eq!(a.kvshard.log_format, LogFormat::Text);
    }

    #[test]
    fn cli_default_config_resolves() {
        let (c, notes) = resolve(&[]).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(c.zmq_bind_url(), "tcp://127.0.0.1:5555");
        assert_eq!(c.http_bind_addr(), "127.0.0.1:8080");
        assert_eq!(c.chunk_size, 256);
        assert_eq!(c.hash_algorithm, "blake3");
        assert_eq!(
            c.cores,
            (0..7).collect::<Vec<_>>(),
            "one core left to the front"
        );
        assert_eq!(c.front_core, Some(7));
        assert_eq!(c.transfer_mode, TransferMode::Auto);
        assert!(c
            .shm_name
            .as_deref()
            .unwrap()
            .starts_with("lmcache_l1_pool_kvshard_"));
        assert_eq!(c.session_ttl, Duration::from_secs(600));
        assert_eq!(c.worker_reap_timeout, Duration::from_secs(120));
        assert_eq!(c.worker_registration_grace, Duration::from_secs(3600));
        assert_eq!(c.kv_event_log_size, 32768);
        assert_eq!(c.l1.size_bytes, 1 << 30);
        assert!(c.l1.use_lazy);
        // The 20 GB initial lazy size is clamped to the 1 GB L1.
        assert_eq!(c.l1.init_size_bytes, 1 << 30);
        assert_eq!(c.l1.align_bytes, 4096);
        assert_eq!(c.l1.write_ttl, Duration::from_secs(600));
        assert_eq!(c.l1.read_ttl, Duration::from_secs(300));
        assert_eq!(c.l1.eviction_policy, EvictionPolicyName::Lru);
        assert_eq!(c.lookup_hash_log, None);
        assert_eq!(c.max_frame_bytes, 512 << 20);
        // A fresh UUID v4 per start.
        assert_eq!(c.instance_id.len(), 36);
        assert_ne!(config(&[]).instance_id, c.instance_id);
        assert_eq!(config(&["--instance-id", "node-a"]).instance_id, "node-a");
    }

    #[test]
    fn cli_required_flags() {
        let e = Cli::try_parse_from(["kvshard", "server", "--eviction-policy", "LRU"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(e.to_string().contains("--l1-size-gb"), "{e}");
        let e = Cli::try_parse_from(["kvshard", "server", "--l1-size-gb", "4"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(e.to_string().contains("--eviction-policy"), "{e}");
        // Choices are enforced like argparse's.
        let e = parse_err(&["--l1-size-gb", "4", "--eviction-policy", "FIFO"]);
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
        let e = parse_err(&[
            "--l1-size-gb",
            "4",
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "pickle",
        ]);
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
        // Unknown flags are errors, as in argparse.
        let e = parse_err(&[
            "--l1-size-gb",
            "4",
            "--eviction-policy",
            "LRU",
            "--no-such-flag",
        ]);
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
    }

    #[test]
    fn cli_gb_conversion_is_binary() {
        let c = config(&["--l1-size-gb", "2.5", "--l1-init-size-gb", "1"]);
        assert_eq!(c.l1.size_bytes, 2_684_354_560); // int(2.5 * 2**30)
        assert_eq!(c.l1.init_size_bytes, 1 << 30);
        let c = config(&["--l1-size-gb", "0.001"]);
        assert_eq!(c.l1.size_bytes, 1_073_741); // truncated, not rounded
        let (c, notes) = resolve(&["--l1-init-size-gb", "4"]).unwrap();
        assert_eq!(c.l1.init_size_bytes, 1 << 30, "clamped to --l1-size-gb");
        assert!(
            notes.iter().any(|n| n.contains("--l1-init-size-gb")),
            "{notes:?}"
        );
        // --l1-init-size-gb is an integer flag in 0.5.6.
        parse_err(&[
            "--l1-size-gb",
            "4",
            "--eviction-policy",
            "LRU",
            "--l1-init-size-gb",
            "1.5",
        ]);
    }

    #[test]
    fn cli_bool_pairs_last_wins() {
        assert!(config(&[]).l1.use_lazy);
        assert!(config(&["--l1-use-lazy"]).l1.use_lazy);
        assert!(!config(&["--no-l1-use-lazy"]).l1.use_lazy);
        assert!(!config(&["--l1-use-lazy", "--no-l1-use-lazy"]).l1.use_lazy);
        assert!(config(&["--no-l1-use-lazy", "--l1-use-lazy"]).l1.use_lazy);
        assert!(config(&["--l1-use-lazy", "--l1-use-lazy"]).l1.use_lazy);
        // Every pair parses both ways.
        for (on, off) in [
            ("--gds-l1-use-direct-io", "--no-gds-l1-use-direct-io"),
            ("--isolated-ipc", "--no-isolated-ipc"),
            ("--run-script-api-enabled", "--no-run-script-api-enabled"),
            ("--separate-object-groups", "--no-separate-object-groups"),
            ("--l1-use-hugepages", "--no-l1-use-hugepages"),
        ] {
            config(&[on, off]);
            config(&[off]);
            parse(&[on]);
        }
        assert!(config(&["--separate-object-groups"]).separate_object_groups);
        assert!(!config(&[]).separate_object_groups);
        assert!(config(&["--no-isolated-ipc", "--isolated-ipc"]).isolated_ipc);
        assert!(!config(&["--isolated-ipc", "--no-isolated-ipc"]).isolated_ipc);
        assert!(!config(&[]).isolated_ipc);
        // The hugetlb pool needs the SHM pool off, and turns lazy allocation off.
        rejected(&["--l1-use-hugepages"], "--l1-use-hugepages", false);
        let c = config(&["--l1-use-hugepages", "--shm-name", ""]);
        assert!(c.l1.use_hugepages && !c.l1.use_lazy);
        let c = config(&[
            "--l1-use-hugepages",
            "--supported-transfer-mode",
            "lmcache_driven",
        ]);
        assert!(c.l1.use_hugepages && !c.l1.use_lazy && c.shm_name.is_none());
        assert!(!config(&[]).l1.use_hugepages);
    }

    #[test]
    fn cli_devdax_needs_the_shm_pool_off_and_conflicts_with_hugetlb_and_gds() {
        // Default: no devdax arena.
        assert_eq!(config(&[]).l1.devdax_path, None);
        // With the SHM pool advertised (the default) it is refused naming the fix.
        let e = rejected(
            &["--l1-devdax-path", "/dev/dax0.0"],
            "--l1-devdax-path",
            false,
        );
        assert!(e.to_string().contains("--shm-name \"\""), "{e}");
        let e = rejected(
            &["--l1-devdax-path", "/dev/dax0.0", "--shm-name", "pool"],
            "--l1-devdax-path",
            false,
        );
        assert!(e.to_string().contains("--shm-name \"\""), "{e}");
        // Accepted with the pool off; lazy allocation is turned off, with a note.
        let (c, notes) = resolve(&["--l1-devdax-path", "/dev/dax0.0", "--shm-name", ""]).unwrap();
        assert_eq!(c.l1.devdax_path, Some(PathBuf::from("/dev/dax0.0")));
        assert!(c.shm_name.is_none() && !c.l1.use_lazy && !c.l1.use_hugepages);
        assert!(
            notes
                .iter()
                .any(|n| n.contains("--l1-devdax-path turns lazy")),
            "{notes:?}"
        );
        let (_, notes) = resolve(&[
            "--l1-devdax-path",
            "/dev/dax0.0",
            "--shm-name",
            "",
            "--no-l1-use-lazy",
        ])
        .unwrap();
        assert!(
            !notes.iter().any(|n| n.contains("--l1-devdax-path")),
            "{notes:?}"
        );
        // lmcache_driven only has no SHM pool either.
        let c = config(&[
            "--l1-devdax-path",
            "/pmem/l1",
            "--supported-transfer-mode",
            "lmcache_driven",
        ]);
        assert_eq!(c.l1.devdax_path, Some(PathBuf::from("/pmem/l1")));
        // Conflicts.
        let e = rejected(
            &[
                "--l1-devdax-path",
                "/dev/dax0.0",
                "--shm-name",
                "",
                "--l1-use-hugepages",
            ],
            "--l1-devdax-path",
            false,
        );
        assert!(e.to_string().contains("--l1-use-hugepages"), "{e}");
        let e = rejected(
            &[
                "--l1-devdax-path",
                "/dev/dax0.0",
                "--shm-name",
                "",
                "--gds-l1-path",
                "/nvme",
            ],
            "--l1-devdax-path",
            false,
        );
        assert!(e.to_string().contains("--gds-l1-path"), "{e}");
        rejected(
            &["--l1-devdax-path", "", "--shm-name", ""],
            "--l1-devdax-path",
            false,
        );
    }

    #[test]
    fn cli_repeated_option_keeps_last_value() {
        let c = config(&["--port", "6000", "--port", "6001", "--chunk-size=512"]);
        assert_eq!(c.port, 6001);
        assert_eq!(c.chunk_size, 512);
    }

    #[test]
    fn cli_unambiguous_prefixes_accepted_like_argparse() {
        let c = config(&["--chunk", "128", "--session-ttl", "30"]);
        assert_eq!(c.chunk_size, 128);
        assert_eq!(c.session_ttl, Duration::from_secs(30));
        // An exact name wins over longer names it prefixes.
        let a = parse(&["--enable", "--port", "7000"]);
        assert!(a.mp.enable.is_empty() && !a.obs.enable_tracing);
        assert_eq!(a.mp.port, 7000);
        // Ambiguous prefixes are errors.
        parse_err(&[
            "--l1-size-gb",
            "4",
            "--eviction-policy",
            "LRU",
            "--max",
            "3",
        ]);
    }

    #[test]
    fn cli_multi_value_and_repeatable_flags() {
        let a = parse(&[
            "--script-allowed-imports",
            "numpy",
            "pandas",
            "--runtime-plugin-locations",
            "/a",
            "/b",
            "--port",
            "7000",
            "--l2-adapter",
            r#"{"type":"mock"}"#,
            "--l2-adapter",
            r#"{"type":"fs","path":"/d"}"#,
            "--enable",
        ]);
        assert_eq!(a.mp.script_allowed_imports, ["numpy", "pandas"]);
        assert_eq!(a.mp.runtime_plugin_locations, ["/a", "/b"]);
        assert_eq!(a.mp.port, 7000);
        assert_eq!(a.l2.l2_adapter.len(), 2);
        assert!(a.mp.enable.is_empty());
        // nargs='*' with no values is the default and accepted.
        config(&["--script-allowed-imports", "--runtime-plugin-locations"]);
        // As with argparse's nargs='*', a later occurrence replaces the earlier list.
        let a = parse(&["--enable", "a", "b", "--enable", "c"]);
        assert_eq!(a.mp.enable, ["c"]);
        config(&[
            "--script-allowed-imports",
            "numpy",
            "--script-allowed-imports",
        ]);
    }

    #[test]
    fn cli_shm_name_resolution() {
        assert_eq!(config(&["--shm-name", ""]).shm_name, None);
        assert_eq!(config(&["--shm-name="]).shm_name, None);
        assert_eq!(
            config(&["--shm-name", "bench"]).shm_name.as_deref(),
            Some("lmcache_l1_pool_bench")
        );
        assert_eq!(
            config(&["--shm-name", "/lmcache_l1_pool_x"])
                .shm_name
                .as_deref(),
            Some("lmcache_l1_pool_x")
        );
        let auto = config(&["--supported-transfer-mode", "engine_driven"])
            .shm_name
            .unwrap();
        assert!(auto.starts_with(&format!("lmcache_l1_pool_kvshard_{}_", std::process::id())));
        // The SHM pool belongs to the engine_driven path only.
        let (c, notes) = resolve(&[
            "--supported-transfer-mode",
            "lmcache_driven",
            "--shm-name",
            "x",
        ])
        .unwrap();
        assert_eq!(c.shm_name, None);
        assert!(
            notes.iter().any(|n| n.starts_with("--shm-name")),
            "{notes:?}"
        );
        assert_eq!(
            config(&["--supported-transfer-mode", "lmcache_driven"]).shm_name,
            None
        );
        rejected(&["--shm-name", "a/b"], "--shm-name", false);
    }

    #[test]
    fn cli_hash_algorithms() {
        let e = rejected(&["--hash-algorithm", "builtin"], "--hash-algorithm", true);
        assert!(e.to_string().contains("hash(None)"), "{e}");
        for other in ["sha256", "xxhash", "xxhash_cbor"] {
            let e = rejected(&["--hash-algorithm", other], "--hash-algorithm", true);
            assert!(e.to_string().contains("not implemented"), "{e}");
        }
        rejected(&["--hash-algorithm", "md5"], "--hash-algorithm", false);
        let c = config(&["--hash-algorithm", "blake3"]);
        assert_eq!(
            (c.hash_algorithm.as_str(), c.token_hasher),
            ("blake3", TokenHasher::Blake3)
        );
        rejected(
            &["--sha256-cbor-none-hash", "fallback"],
            "--sha256-cbor-none-hash",
            false,
        );

        // sha256_cbor: the seed's none hash, the fallback, or random bytes with a warning.
        let seeded = |seed: Option<&str>, extra: &[&str]| {
            let mut args = vec!["--hash-algorithm", "sha256_cbor"];
            args.extend_from_slice(extra);
            let mut h = host();
            h.python_hash_seed = seed.map(str::to_string);
            parse(&args).resolve(&h).expect("accepted")
        };
        let (c, notes) = seeded(Some("7"), &[]);
        assert_eq!(
            c.token_hasher,
            TokenHasher::Sha256Cbor {
                none_hash: keys::sha256_cbor_seeded_none_hash("7")
            }
        );
        assert!(
            !notes.iter().any(|n| n.contains("PYTHONHASHSEED")),
            "{notes:?}"
        );
        let (c, _) = seeded(Some("7"), &["--sha256-cbor-none-hash", "fallback"]);
        assert_eq!(
            c.token_hasher,
            TokenHasher::Sha256Cbor {
                none_hash: keys::sha256_cbor_fallback_none_hash()
            }
        );
        let (a, notes) = seeded(None, &[]);
        let (b, _) = seeded(None, &[]);
        assert!(
            notes
                .iter()
                .any(|n| n.contains("PYTHONHASHSEED is not set")),
            "{notes:?}"
        );
        assert_ne!(
            a.token_hasher, b.token_hasher,
            "a fresh random none hash each start"
        );
        // A later --hash-algorithm overrides the first.
        let (c, _) = seeded(Some("7"), &[]);
        let (d, _) = seeded(Some("7"), &["--hash-algorithm", "sha256_cbor_64bit"]);
        assert_eq!(d.token_hasher, c.token_hasher);
        assert_eq!(d.hash_algorithm, "sha256_cbor_64bit");
    }

    #[test]
    fn cli_l2_adapters_and_policies() {
        let c = config(&[
            "--l2-adapter",
            r#"{"type":"fs","base_path":"/tmp/x"}"#,
            "--l2-adapter",
            r#"{"type":"mock","max_size_gb":1,"mock_bandwidth_gb":5}"#,
            "--l2-store-policy",
            "skip_l1",
            "--l2-prefetch-policy",
            "retain",
            "--l2-prefetch-max-in-flight",
            "16",
        ]);
        let types: Vec<&str> = c.l2.adapters.iter().map(|a| a.type_name()).collect();
        assert_eq!(types, ["fs", "mock"], "cascade order is flag order");
        assert_eq!(c.l2.store_policy, L2StorePolicy::SkipL1);
        assert_eq!(c.l2.prefetch_policy, L2PrefetchPolicy::Retain);
        assert_eq!(c.l2.prefetch_max_in_flight, 16);
        assert_eq!(c.l2.store_inflight_bytes, 1 << 30);
        let e = rejected(
            &["--l2-adapter", r#"{"type":"mock"}"#],
            "--l2-adapter",
            false,
        );
        assert!(e.to_string().contains("max_size_gb"), "{e}");
        let e = rejected(
            &[
                "--l2-adapter",
                r#"{"type":"fs","base_path":"/x","bogus":1}"#,
            ],
            "--l2-adapter",
            false,
        );
        assert!(e.to_string().contains("'bogus'"), "{e}");
        rejected(&["--l2-adapter", "{not json"], "--l2-adapter", false);
        rejected(
            &["--l2-store-policy", "skip_l1"],
            "--l2-store-policy",
            false,
        );
        rejected(
            &["--l2-prefetch-max-in-flight", "0"],
            "--l2-prefetch-max-in-flight",
            false,
        );
        rejected(
            &["--l2-store-inflight-gb", "0"],
            "--l2-store-inflight-gb",
            false,
        );
    }

    #[test]
    fn cli_gds_l1_tier_needs_the_shm_pool_off_and_aligned_objects() {
        let (cfg, notes) = resolve(&["--gds-l1-path", "/nvme/kv", "--shm-name", ""]).unwrap();
        let gds = cfg.l1.gds.as_ref().expect("the GDS tier is configured");
        assert_eq!(gds.path, PathBuf::from("/nvme/kv"));
        assert!(gds.direct_io, "O_DIRECT by default, as in 0.5.6");
        assert_eq!(gds.backend, GdsBackend::IoUring);
        assert!(!cfg.l1.use_lazy, "the slabs are preallocated");
        assert!(cfg.shm_name.is_none());
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("--gds-l1-path turns lazy")),
            "{notes:?}"
        );
        let (cfg, _) = resolve(&[
            "--gds-l1-path",
            "/nvme/kv",
            "--supported-transfer-mode",
            "lmcache_driven",
            "--no-gds-l1-use-direct-io",
            "--gds-l1-backend",
            "auto",
        ])
        .unwrap();
        assert!(!cfg.l1.gds.unwrap().direct_io);

        // The default transfer mode offers the SHM pool, which would hold no objects.
        let e = rejected(&["--gds-l1-path", "/nvme/kv"], "--gds-l1-path", false);
        assert!(e.to_string().contains("--shm-name \"\""), "{e}");
        rejected(
            &["--gds-l1-path", "", "--shm-name", ""],
            "--gds-l1-path",
            false,
        );
        let e = rejected(
            &[
                "--gds-l1-path",
                "/nvme/kv",
                "--shm-name",
                "",
                "--l1-align-bytes",
                "1024",
            ],
            "--l1-align-bytes",
            false,
        );
        assert!(e.to_string().contains("4096"), "{e}");
        rejected(
            &[
                "--gds-l1-path",
                "/nvme/kv",
                "--shm-name",
                "",
                "--l1-use-hugepages",
            ],
            "--gds-l1-path",
            false,
        );
        for backend in ["cufile", "hipfile", "mufile", "phx", "ugds"] {
            let e = rejected(
                &[
                    "--gds-l1-path",
                    "/nvme/kv",
                    "--shm-name",
                    "",
                    "--gds-l1-backend",
                    backend,
                ],
                "--gds-l1-backend",
                true,
            );
            assert!(e.to_string().contains("use auto"), "{backend}: {e}");
        }
    }

    #[test]
    fn cli_gds_l1_tier_without_lazy_flag_has_no_lazy_note() {
        let (cfg, notes) = resolve(&[
            "--gds-l1-path",
            "/nvme/kv",
            "--shm-name",
            "",
            "--no-l1-use-lazy",
        ])
        .unwrap();
        assert!(!cfg.l1.use_lazy);
        assert!(
            !notes.iter().any(|n| n.starts_with("--gds-l1-path")),
            "{notes:?}"
        );
    }

    #[test]
    fn cli_rejects_unsupported_features_naming_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&["--transport", "grpc"], "--transport"),
            (&["--engine-type", "blend"], "--engine-type"),
            (&["--enable-tracing"], "--enable-tracing"),
            (
                &["--otlp-endpoint", "http://localhost:4317"],
                "--otlp-endpoint",
            ),
            (
                &["--runtime-plugin-locations", "/p"],
                "--runtime-plugin-locations",
            ),
            (
                &["--runtime-plugin-config", r#"{"a":1}"#],
                "--runtime-plugin-config",
            ),
            (
                &["--script-allowed-imports", "numpy"],
                "--script-allowed-imports",
            ),
            (&["--run-script-api-enabled"], "--run-script-api-enabled"),
            (&["--l1-manager", r#"{"type":"DRAM"}"#], "--l1-manager"),
            (&["--enable-segmented-prefix"], "--enable-segmented-prefix"),
            (&["--enable-dedup-content"], "--enable-dedup-content"),
            (&["--enable-blend-reorder"], "--enable-blend-reorder"),
            (&["--enable", "transfer_query"], "--enable"),
            (&["--server-module", "{}"], "--server-module"),
            (&["--eviction-policy", "ARC"], "--eviction-policy"),
            (&["--p2p-advertise-url", "h:1"], "--p2p-advertise-url"),
            (&["--trace-level", "storage"], "--trace-level"),
            (&["--enable-extra-logging"], "--enable-extra-logging"),
            (&["--coordinator-url", "http://c:9300"], "--coordinator-url"),
            (
                &["--coordinator-l2-event-reporting"],
                "--coordinator-event-reporting",
            ),
            (
                &["--coordinator-event-transport", "kafka"],
                "--coordinator-event-transport",
            ),
        ];
        for (argv, flag) in cases {
            rejected(argv, flag, true);
        }
        // Defaults given explicitly are fine.
        config(&[
            "--l2-prefetch-max-in-flight",
            "8",
            "--l2-store-policy",
            "default",
            "--runtime-plugin-config",
            "{}",
            "--engine-type",
            "default",
            "--transport",
            "zmq",
            "--coordinator-url",
            "",
        ]);
        // The L1-manager form does not need the legacy required flags to be refused clearly.
        let e = Cli::try_parse_from(["kvshard", "server", "--l1-manager", "{}"])
            .map(|cli| match cli.command {
                Command::Server(a) => a.resolve(&host()),
                other => panic!("not a server command: {other:?}"),
            })
            .expect("parses without --l1-size-gb");
        assert_eq!(e.unwrap_err().flag(), "--l1-manager");
        rejected(
            &["--runtime-plugin-config", "{"],
            "--runtime-plugin-config",
            false,
        );
    }

    #[test]
    fn cli_coordinator_env_is_not_ignored() {
        let mut h = host();
        h.coordinator_url_env = Some("http://coord:9300".into());
        let e = parse(&[]).resolve(&h).unwrap_err();
        assert_eq!(e.flag(), "--coordinator-url");
        assert!(e.to_string().contains("LMCACHE_COORDINATOR_URL"), "{e}");
        // An explicit empty flag overrides the environment, as in 0.5.6.
        parse(&["--coordinator-url", ""]).resolve(&h).unwrap();
        let mut h = host();
        h.coordinator_event_reporting_env = Some("TRUE".into());
        let e = parse(&[]).resolve(&h).unwrap_err();
        assert_eq!(e.flag(), "--coordinator-event-reporting");
        h.coordinator_event_reporting_env = Some("0".into());
        parse(&[]).resolve(&h).unwrap();
    }

    #[test]
    fn cli_python_only_flags_accepted_with_notes() {
        let (_, notes) = resolve(&[
            "--max-workers",
            "4",
            "--max-gpu-workers",
            "2",
            "--periodic-notifier-interval-ms",
            "10",
            "--event-bus-queue-size",
            "5",
            "--metrics-sample-rate",
            "0.5",
            "--prometheus-port",
            "9191",
            "--enable-gc-monitor",
            "--disable-grpc-metrics",
            "--grpc-server-workers",
            "4",
            "--format",
            "json",
            "-q",
            "--gds-l1-backend",
            "cufile",
        ])
        .unwrap();
        for flag in [
            "--max-workers",
            "--periodic-notifier-interval-ms",
            "--event-bus-queue-size",
            "--metrics-sample-rate",
            "--prometheus-port",
            "--enable-gc-monitor",
            "--disable-grpc-metrics",
            "--grpc-server-workers",
            "--format",
            "--gds-l1-backend",
        ] {
            assert!(
                notes.iter().any(|n| n.starts_with(flag)),
                "{flag}: {notes:?}"
            );
        }
        rejected(
            &["--grpc-server-workers", "0"],
            "--grpc-server-workers",
            false,
        );
    }

    #[test]
    fn cli_range_checks_name_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&["--l1-size-gb", "0"], "--l1-size-gb"),
            (&["--l1-size-gb", "-1"], "--l1-size-gb"),
            (&["--l1-size-gb", "nan"], "--l1-size-gb"),
            (&["--l1-size-gb", "0.000000001"], "--l1-size-gb"), // 1 byte < align
            (
                &["--eviction-trigger-watermark", "0"],
                "--eviction-trigger-watermark",
            ),
            (
                &["--eviction-trigger-watermark", "1.5"],
                "--eviction-trigger-watermark",
            ),
            (&["--eviction-ratio", "-0.1"], "--eviction-ratio"),
            (&["--eviction-ratio", "nan"], "--eviction-ratio"),
            (&["--l1-align-bytes", "1000"], "--l1-align-bytes"),
            (&["--l1-align-bytes", "32"], "--l1-align-bytes"),
            (&["--l1-write-ttl-seconds", "0"], "--l1-write-ttl-seconds"),
            (&["--l1-read-ttl-seconds", "0"], "--l1-read-ttl-seconds"),
            (&["--chunk-size", "0"], "--chunk-size"),
            (&["--chunk-size", "-5"], "--chunk-size"),
            (&["--port", "0"], "--port"),
            (&["--http-port", "0"], "--http-port"),
            (&["--spin-us", "10001"], "--spin-us"),
            (&["--host", ""], "--host"),
            (&["--session-ttl-seconds", "0"], "--session-ttl-seconds"),
            (
                &["--worker-reap-timeout-seconds", "10"],
                "--worker-reap-timeout-seconds",
            ),
            (
                &["--worker-reap-timeout-seconds", "-1"],
                "--worker-reap-timeout-seconds",
            ),
            (
                &[
                    "--worker-reap-timeout-seconds",
                    "600",
                    "--worker-registration-grace-seconds",
                    "300",
                ],
                "--worker-registration-grace-seconds",
            ),
            (&["--kv-event-log-size", "-1"], "--kv-event-log-size"),
            (
                &["--extra-logging-interval", "0"],
                "--extra-logging-interval",
            ),
            (
                &[
                    "--lookup-hash-log-dir",
                    "/tmp/x",
                    "--lookup-hash-log-max-files",
                    "0",
                ],
                "--lookup-hash-log-max-files",
            ),
            (&["--shard-queue-depth", "0"], "--shard-queue-depth"),
            (&["--max-sessions", "0"], "--max-sessions"),
            (&["--max-registrations", "0"], "--max-registrations"),
            (&["--max-frame-bytes", "0"], "--max-frame-bytes"),
            (&["--http-max-connections", "0"], "--http-max-connections"),
        ];
        for (argv, flag) in cases {
            rejected(argv, flag, false);
        }
        // Out-of-type values are refused by the parser, naming the flag.
        let e = parse_err(&[
            "--l1-size-gb",
            "4",
            "--eviction-policy",
            "LRU",
            "--port",
            "70000",
        ]);
        assert!(e.to_string().contains("--port"), "{e}");
        for flag in [
            "--port",
            "--http-port",
            "--l1-align-bytes",
            "--max-sessions",
        ] {
            let e = parse_err(&["--l1-size-gb", "4", "--eviction-policy", "LRU", flag, "-1"]);
            assert!(e.to_string().contains(flag), "{e}");
        }
        // Reaping can be disabled, and the grace may then be anything >= 0.
        let c = config(&[
            "--worker-reap-timeout-seconds",
            "0",
            "--worker-registration-grace-seconds",
            "0",
        ]);
        assert!(c.worker_reap_timeout.is_zero());
        assert_eq!(config(&["--null-block-id", "-1"]).null_block_id, -1);
    }

    #[test]
    fn cli_lookup_hash_log() {
        assert_eq!(config(&["--lookup-hash-log-dir", ""]).lookup_hash_log, None);
        let c = config(&[
            "--lookup-hash-log-dir",
            "/var/log/kv",
            "--lookup-hash-log-rotation-interval",
            "60",
            "--lookup-hash-log-rotation-max-size",
            "1024",
            "--lookup-hash-log-max-files",
            "3",
        ]);
        assert_eq!(
            c.lookup_hash_log,
            Some(LookupHashLogSettings {
                dir: PathBuf::from("/var/log/kv"),
                rotation_interval: Duration::from_secs(60),
                rotation_max_bytes: 1024,
                max_files: 3,
            })
        );
    }

    #[test]
    fn cli_cores() {
        assert_eq!(config(&["--cores", "0-1,3"]).cores, [0, 1, 3]);
        assert_eq!(config(&["--cores", "0-1,3"]).front_core, Some(7));
        assert_eq!(
            config(&["--cores", "0-7"]).front_core,
            None,
            "the shards take every core"
        );
        assert_eq!(config(&["--cores", "6-7"]).front_core, Some(5));
        assert_eq!(config(&["--cores", "5"]).cores, [5]);
        for bad in ["", "a", "3-1", "0-", "-1", "1,,2", "0-99"] {
            rejected(&[&format!("--cores={bad}")], "--cores", false);
        }
        // A core outside the allowed set is refused up front, not at pinning time.
        let e = rejected(&["--cores", "8"], "--cores", false);
        assert!(e.to_string().contains("0-7"), "{e}");
        assert_eq!(format_cores(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }

    #[test]
    fn cli_help_documents_flags_units_and_defaults() {
        let mut cmd = Cli::command();
        let server = cmd.find_subcommand_mut("server").unwrap();
        let help = server.render_long_help().to_string();
        for s in [
            "--l1-size-gb <GB>",
            "--l1-use-lazy",
            "--no-l1-use-lazy",
            "--worker-reap-timeout-seconds <SECONDS>",
            "--lookup-hash-log-rotation-max-size <BYTES>",
            "--periodic-notifier-interval-ms <MS>",
            "[default: 5555]",
            "[default: 127.0.0.1]",
            "[default: auto]",
            "[kvshard only]",
            "--max-frame-bytes <BYTES>",
            "Not supported by kvshard",
        ] {
            assert!(help.contains(s), "help lacks {s:?}");
        }
        assert!(!help.contains("--coordinator-l2-event-reporting"));
    }
}
