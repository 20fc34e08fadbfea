//! The resolved server configuration: what `kvshard server ...` flags mean once
//! validated. Plain data, built once at start-up by the binary's CLI layer and
//! shared read-only by every component (and printed by the HTTP `/config`).
//!
//! Durations serialise as seconds (f64) so `/config` reads like the flags.

use std::fmt;
use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use kvshard_engine::keys::{hex, TokenHasher};
use kvshard_engine::l2::config::AdapterSpec;
use serde::{Serialize, Serializer};

/// Prefix of every L1 pool segment name; 0.5.6 enforces it so a stale-segment
/// cleanup can never unlink a segment that is not an LMCache pool.
pub const SHM_POOL_PREFIX: &str = "lmcache_l1_pool_";

/// POSIX shm names live in one directory (/dev/shm): one path component of at most NAME_MAX bytes.
const SHM_NAME_MAX: usize = 255;

/// A start-up configuration error, always naming the command-line flag at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The value is malformed or out of range.
    Invalid { flag: &'static str, reason: String },
    /// The flag asks for a feature kvshard does not have (yet); it is refused rather
    /// than silently ignored. The reason says what is missing and what to do instead.
    Unsupported { flag: &'static str, reason: String },
}

impl ConfigError {
    pub fn invalid(flag: &'static str, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            flag,
            reason: reason.into(),
        }
    }

    pub fn unsupported(flag: &'static str, reason: impl Into<String>) -> Self {
        ConfigError::Unsupported {
            flag,
            reason: reason.into(),
        }
    }

    /// The offending flag, e.g. `--l1-size-gb`.
    pub fn flag(&self) -> &'static str {
        match self {
            ConfigError::Invalid { flag, .. } | ConfigError::Unsupported { flag, .. } => flag,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Invalid { flag, reason } => write!(f, "invalid {flag}: {reason}"),
            ConfigError::Unsupported { flag, reason } => {
                write!(f, "unsupported {flag}: {reason}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Which worker -> server transfer paths are loaded (`--supported-transfer-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    /// STORE/RETRIEVE: the server gathers/scatters the worker's registered KV buffers.
    LmcacheDriven,
    /// PREPARE/COMMIT: the worker copies into slots of the shared L1 pool.
    EngineDriven,
    /// Both paths, so workers of either kind can connect.
    Auto,
}

impl TransferMode {
    /// Parses the flag's spelling (`lmcache_driven`, `engine_driven`, `auto`).
    pub fn from_flag(s: &str) -> Option<Self> {
        match s {
            "lmcache_driven" => Some(TransferMode::LmcacheDriven),
            "engine_driven" => Some(TransferMode::EngineDriven),
            "auto" => Some(TransferMode::Auto),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::LmcacheDriven => "lmcache_driven",
            TransferMode::EngineDriven => "engine_driven",
            TransferMode::Auto => "auto",
        }
    }

    pub fn engine_driven_enabled(self) -> bool {
        matches!(self, TransferMode::EngineDriven | TransferMode::Auto)
    }

    pub fn lmcache_driven_enabled(self) -> bool {
        matches!(self, TransferMode::LmcacheDriven | TransferMode::Auto)
    }
}

/// L1 eviction policy (`--eviction-policy`); serialised with the flag's spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EvictionPolicyName {
    #[serde(rename = "LRU")]
    Lru,
    /// One LRU list per cache_salt, bounded by per-salt quotas set over HTTP.
    #[serde(rename = "IsolatedLRU")]
    IsolatedLru,
    /// Never evict: L1 is a pure write buffer.
    #[serde(rename = "noop")]
    Noop,
}

impl EvictionPolicyName {
    /// Parses the flag's spelling. `ARC` (a 0.5.6 choice) is not implemented and yields None.
    pub fn from_flag(s: &str) -> Option<Self> {
        match s {
            "LRU" => Some(EvictionPolicyName::Lru),
            "IsolatedLRU" => Some(EvictionPolicyName::IsolatedLru),
            "noop" => Some(EvictionPolicyName::Noop),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EvictionPolicyName::Lru => "LRU",
            EvictionPolicyName::IsolatedLru => "IsolatedLRU",
            EvictionPolicyName::Noop => "noop",
        }
    }
}

/// The L1 tier: one arena cut into one slice per shard.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct L1Settings {
    /// Whole L1 arena, all shards together (`--l1-size-gb`, GiB as 0.5.6 counts them).
    pub size_bytes: u64,
    /// Grow lazily instead of pre-faulting the whole arena (`--l1-use-lazy`).
    pub use_lazy: bool,
    /// Back the arena with the 2 MiB hugetlb pool (`--l1-use-hugepages`).
    pub use_hugepages: bool,
    /// First allocation when lazy (`--l1-init-size-gb`), already clamped to `size_bytes`.
    pub init_size_bytes: u64,
    /// Slab alignment; a power of two >= 64 (`--l1-align-bytes`).
    pub align_bytes: u64,
    /// Map the arena from this device-DAX device or file instead of /dev/shm or
    /// anonymous memory (`--l1-devdax-path`); `None` = not used.
    pub devdax_path: Option<PathBuf>,
    /// Keep the L1 objects in one preallocated slab file per shard instead of
    /// memory (`--gds-l1-path`); `None` = not used.
    pub gds: Option<GdsL1Settings>,
    #[serde(serialize_with = "duration_as_secs")]
    pub write_ttl: Duration,
    #[serde(serialize_with = "duration_as_secs")]
    pub read_ttl: Duration,
    pub eviction_policy: EvictionPolicyName,
    /// Usage fraction in (0, 1] that triggers an eviction pass.
    pub trigger_watermark: f64,
    /// Fraction in (0, 1] of tracked objects evicted per pass.
    pub eviction_ratio: f64,
}

/// Alignment of GDS slab offsets and lengths (direct I/O).
pub use kvshard_gds::slab::SLAB_ALIGN as GDS_SLAB_ALIGN;

/// The GDS L1 tier: the shards' L1 objects live in slab files on a disk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GdsL1Settings {
    /// Directory of the slab files, one `lmcache_gds_slab.<shard>.bin` per
    /// shard (`--gds-l1-path`).
    pub path: PathBuf,
    /// Open the slabs with O_DIRECT (`--gds-l1-use-direct-io`).
    pub direct_io: bool,
    /// How the slabs are read and written (`--gds-l1-backend`).
    pub backend: GdsBackend,
}

/// The transfer engine of the GDS L1 slabs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GdsBackend {
    /// The shard's own io_uring (O_DIRECT unless turned off), staging each
    /// object through an aligned host buffer; what `auto` selects, since
    /// the objects kvshard moves are in host memory.
    IoUring,
}

impl GdsBackend {
    pub fn as_str(self) -> &'static str {
        match self {
            GdsBackend::IoUring => "io_uring",
        }
    }
}

/// What happens to a chunk once it is written to L1 (`--l2-store-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum L2StorePolicy {
    /// Store to every adapter and keep the L1 copy.
    Default,
    /// Store to every adapter, then drop the L1 copy once stored.
    SkipL1,
}

/// What happens to chunks loaded from L2 (`--l2-prefetch-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum L2PrefetchPolicy {
    /// Temporary L1 objects, freed once every reader retrieved them.
    Default,
    /// Loaded objects stay in L1 like stored ones.
    Retain,
}

/// The L2 tier: adapters in cascade order and the controllers' limits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct L2Settings {
    /// One per `--l2-adapter`, in flag order; shown as the JSON given.
    #[serde(serialize_with = "adapters_as_json")]
    pub adapters: Vec<AdapterSpec>,
    pub store_policy: L2StorePolicy,
    pub prefetch_policy: L2PrefetchPolicy,
    /// Requests whose L2 loads may run at once, server-wide (`--l2-prefetch-max-in-flight`).
    pub prefetch_max_in_flight: usize,
    /// How long a lookup waits for L2 before it concludes with what L1 holds
    /// (`--l2-prefetch-load-timeout`); zero waits as long as L2 takes.
    #[serde(serialize_with = "duration_as_secs")]
    pub prefetch_load_timeout: Duration,
    /// Bytes of L1 objects being stored to L2 at once, server-wide; further
    /// stores wait (their L1 objects stay read-locked meanwhile).
    pub store_inflight_bytes: u64,
}

impl Default for L2Settings {
    fn default() -> Self {
        L2Settings {
            adapters: Vec::new(),
            store_policy: L2StorePolicy::Default,
            prefetch_policy: L2PrefetchPolicy::Default,
            prefetch_max_in_flight: 8,
            prefetch_load_timeout: Duration::from_millis(500),
            store_inflight_bytes: 1 << 30,
        }
    }
}

fn adapters_as_json<S: serde::Serializer>(a: &[AdapterSpec], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(a.len()))?;
    for spec in a {
        seq.serialize_element(&spec.json)?;
    }
    seq.end()
}

/// Rotating JSONL log of chunk hashes computed by lookups (`--lookup-hash-log-*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LookupHashLogSettings {
    pub dir: PathBuf,
    #[serde(serialize_with = "duration_as_secs")]
    pub rotation_interval: Duration,
    pub rotation_max_bytes: u64,
    pub max_files: usize,
}

/// Everything the server needs to start, validated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerConfig {
    /// `--instance-id`, or a random UUID v4 minted at start.
    pub instance_id: String,
    /// ZMQ bind host as given (`--host`); see [`ServerConfig::zmq_bind_url`].
    pub host: String,
    pub port: u16,
    /// Tokens per chunk (`--chunk-size`).
    pub chunk_size: usize,
    /// `--hash-algorithm` as given (`/status` reports it so).
    pub hash_algorithm: String,
    /// How chunk hashes are computed, and the prefix the first chunk is chained on.
    #[serde(skip)]
    pub token_hasher: TokenHasher,
    /// One shard per listed CPU core, in this order (shard i runs on `cores[i]`).
    pub cores: Vec<usize>,
    /// The core the front thread is pinned to: one no shard runs on; `None`
    /// leaves it unpinned (the shards take every allowed core).
    pub front_core: Option<usize>,
    pub transfer_mode: TransferMode,
    /// L1 pool segment name without the leading '/', e.g. `lmcache_l1_pool_bench`;
    /// None when SHM is disabled (`--shm-name ""`) or the engine_driven path is not loaded.
    pub shm_name: Option<String>,
    #[serde(serialize_with = "duration_as_secs")]
    pub session_ttl: Duration,
    /// Silence after which a pinging worker's registration is reaped; zero disables reaping.
    #[serde(serialize_with = "duration_as_secs")]
    pub worker_reap_timeout: Duration,
    /// Silence budget for a worker that registered but never pinged; >= `worker_reap_timeout`.
    #[serde(serialize_with = "duration_as_secs")]
    pub worker_registration_grace: Duration,
    /// Engine block id that means "no KV data here" (`--null-block-id`).
    pub null_block_id: i64,
    /// `--separate-object-groups`: kernel groups of different sliding windows
    /// (in whole chunks) form separate object groups, one object per chunk
    /// and group.
    pub separate_object_groups: bool,
    /// `--isolated-ipc`: CUDA workers exchange timeline-semaphore events
    /// (81 bytes, over CUDA IPC memory) instead of CUDA interprocess events.
    pub isolated_ipc: bool,
    /// CPU store/eviction records kept for KV-event subscribers; 0 disables the channel.
    pub kv_event_log_size: usize,
    pub l1: L1Settings,
    pub l2: L2Settings,
    pub http_host: String,
    pub http_port: u16,
    pub lookup_hash_log: Option<LookupHashLogSettings>,
    pub disable_observability: bool,
    pub disable_metrics: bool,
    pub disable_logging: bool,
    /// Bound of each shard's request mailbox.
    pub shard_queue_depth: usize,
    /// Write credits each shard lends the front per object size
    /// (`--write-credits`); 0 reserves every prepare_store on the shards.
    pub write_credits: u32,
    pub max_sessions: usize,
    pub max_registrations: usize,
    /// Request frames larger than this are refused with the op's failure reply.
    pub max_frame_bytes: usize,
    /// Serve lmcache_driven transfers of GPU workers over CUDA IPC
    /// (`--cuda-transfer on`, the default); refused with the engine_driven
    /// recipe otherwise.
    pub cuda_transfer: bool,
    /// HTTP API connections kept open at once (`--http-max-connections`).
    pub http_max_connections: usize,
    /// Cache salts with a `/quota` limit at once (`--max-quotas`).
    pub max_quotas: usize,
    /// Block ids one `/cache/checksums` request may name (`--max-checksum-blocks`).
    pub max_checksum_blocks: usize,
    /// How long a stopping server waits for L2 writes in flight
    /// (`--shutdown-drain-seconds`).
    #[serde(serialize_with = "duration_as_secs")]
    pub shutdown_drain: Duration,
    /// How long shards and the front poll for their next piece of work
    /// before sleeping (`--spin-us`); zero sleeps at once.
    pub spin: Duration,
}

impl ServerConfig {
    /// The ZMQ endpoint to bind. libzmq binds interfaces and addresses, not host
    /// names, so `localhost` becomes 127.0.0.1 and the any-address forms become `*`.
    /// An IPv6 literal is bracketed (the socket then needs ZMQ_IPV6 enabled).
    pub fn zmq_bind_url(&self) -> String {
        let host = match self.host.as_str() {
            "localhost" => "127.0.0.1".to_string(),
            "0.0.0.0" | "*" => "*".to_string(),
            h => bracket_ipv6(h),
        };
        format!("tcp://{}:{}", host, self.port)
    }

    /// A complete configuration with the server's defaults on two cores, for
    /// tests of the parts that take one.
    pub fn example() -> ServerConfig {
        ServerConfig {
            instance_id: "id".into(),
            host: "localhost".into(),
            port: 5555,
            chunk_size: 256,
            hash_algorithm: "blake3".into(),
            token_hasher: TokenHasher::Blake3,
            cores: vec![0, 1],
            front_core: None,
            transfer_mode: TransferMode::Auto,
            shm_name: Some("lmcache_l1_pool_x".into()),
            session_ttl: Duration::from_secs(600),
            worker_reap_timeout: Duration::from_secs(120),
            worker_registration_grace: Duration::from_secs(3600),
            null_block_id: 0,
            separate_object_groups: false,
            isolated_ipc: false,
            kv_event_log_size: 32768,
            l1: L1Settings {
                size_bytes: 1 << 30,
                use_lazy: true,
                use_hugepages: false,
                init_size_bytes: 1 << 30,
                align_bytes: 4096,
                devdax_path: None,
                gds: None,
                write_ttl: Duration::from_secs(600),
                read_ttl: Duration::from_secs(300),
                eviction_policy: EvictionPolicyName::Lru,
                trigger_watermark: 0.8,
                eviction_ratio: 0.2,
            },
            l2: L2Settings::default(),
            http_host: "127.0.0.1".into(),
            http_port: 8080,
            lookup_hash_log: None,
            disable_observability: false,
            disable_metrics: false,
            disable_logging: false,
            shard_queue_depth: 4096,
            write_credits: 32,
            max_sessions: 65536,
            max_registrations: 4096,
            max_frame_bytes: 512 << 20,
            cuda_transfer: true,
            http_max_connections: 1024,
            max_quotas: 4096,
            max_checksum_blocks: 16384,
            shutdown_drain: Duration::from_secs(10),
            spin: Duration::ZERO,
        }
    }

    /// `host:port` for the HTTP listener (IPv6 literals bracketed).
    pub fn http_bind_addr(&self) -> String {
        format!("{}:{}", bracket_ipv6(&self.http_host), self.http_port)
    }
}

fn bracket_ipv6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

fn duration_as_secs<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// GB to bytes exactly as 0.5.6 does: `int(gb * (1 << 30))` (binary GiB, truncated).
/// None when the result is not a finite, non-negative byte count that fits in u64.
pub fn gb_to_bytes(gb: f64) -> Option<u64> {
    let bytes = gb * (1u64 << 30) as f64;
    // 2^64 itself is exactly representable; anything at or above it does not fit
    // (the range also excludes NaN and infinities).
    if !(0.0..18_446_744_073_709_551_616.0).contains(&bytes) {
        return None;
    }
    Some(bytes as u64)
}

/// Normalises an explicit, non-empty `--shm-name` as 0.5.6 does: leading '/'s are
/// stripped and the `lmcache_l1_pool_` prefix is added unless already there
/// (`bench` -> `lmcache_l1_pool_bench`). Names POSIX shm cannot hold are refused.
pub fn normalize_shm_name(raw: &str) -> Result<String, ConfigError> {
    let bare = raw.trim_start_matches('/');
    if bare.is_empty() {
        return Err(ConfigError::invalid(
            "--shm-name",
            format!("{raw:?} names no segment (use --shm-name \"\" to disable SHM)"),
        ));
    }
    if bare.contains('/') || bare.contains('\0') {
        return Err(ConfigError::invalid(
            "--shm-name",
            format!("{raw:?}: a POSIX shm name cannot contain '/' or NUL after its leading '/'"),
        ));
    }
    let name = if bare.starts_with(SHM_POOL_PREFIX) {
        bare.to_string()
    } else {
        format!("{SHM_POOL_PREFIX}{bare}")
    };
    if name.len() > SHM_NAME_MAX {
        return Err(ConfigError::invalid(
            "--shm-name",
            format!(
                "segment name {name:?} is {} bytes, longer than the {SHM_NAME_MAX}-byte limit",
                name.len()
            ),
        ));
    }
    Ok(name)
}

/// Segment name used when `--shm-name` is not given: unique per process and start,
/// so two servers on one host never share (or unlink) each other's pool.
pub fn auto_shm_name() -> String {
    let mut r = [0u8; 4];
    fill_random(&mut r);
    format!(
        "{SHM_POOL_PREFIX}kvshard_{}_{}",
        std::process::id(),
        hex(&r)
    )
}

/// Whether `segment` (a name in `/dev/shm`) is one [`auto_shm_name`] makes:
/// `lmcache_l1_pool_kvshard_<pid>_<8 hex digits>`. A start removes those whose
/// server is gone; segments of names given with `--shm-name` are left alone.
pub fn is_auto_shm_name(segment: &str) -> bool {
    let Some(rest) = segment
        .strip_prefix(SHM_POOL_PREFIX)
        .and_then(|r| r.strip_prefix("kvshard_"))
    else {
        return false;
    };
    let Some((pid, rand)) = rest.split_once('_') else {
        return false;
    };
    !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
        && rand.len() == 8
        && rand
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// A random (version 4, RFC 4122 variant) UUID in its canonical lowercase form.
pub fn new_uuid_v4() -> String {
    let mut b = [0u8; 16];
    fill_random(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Fills `buf` from /dev/urandom. If that device cannot be read (a stripped-down
/// container), falls back to std's per-process randomly keyed SipHash, which
/// is seeded from the OS as well; these bytes name things, they guard no secret.
fn fill_random(buf: &mut [u8]) {
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .is_ok();
    if ok {
        return;
    }
    use std::hash::{BuildHasher, Hasher};
    let state = std::collections::hash_map::RandomState::new();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let mut h = state.build_hasher();
        h.write_u128(nanos);
        h.write_usize(i);
        h.write_u32(std::process::id());
        let word = h.finish().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_zmq_bind_url_maps_hosts_zmq_cannot_bind() {
        let mut c = ServerConfig::example();
        assert_eq!(c.zmq_bind_url(), "tcp://127.0.0.1:5555");
        c.host = "0.0.0.0".into();
        assert_eq!(c.zmq_bind_url(), "tcp://*:5555");
        c.host = "*".into();
        assert_eq!(c.zmq_bind_url(), "tcp://*:5555");
        c.host = "10.1.2.3".into();
        c.port = 6000;
        assert_eq!(c.zmq_bind_url(), "tcp://10.1.2.3:6000");
        c.host = "::1".into();
        assert_eq!(c.zmq_bind_url(), "tcp://[::1]:6000");
    }

    #[test]
    fn config_http_bind_addr() {
        let mut c = ServerConfig::example();
        assert_eq!(c.http_bind_addr(), "127.0.0.1:8080");
        c.http_host = "::".into();
        assert_eq!(c.http_bind_addr(), "[::]:8080");
    }

    #[test]
    fn config_transfer_mode_paths() {
        let m = |s| TransferMode::from_flag(s).unwrap();
        assert!(m("auto").engine_driven_enabled() && m("auto").lmcache_driven_enabled());
        assert!(m("engine_driven").engine_driven_enabled());
        assert!(!m("engine_driven").lmcache_driven_enabled());
        assert!(!m("lmcache_driven").engine_driven_enabled());
        assert!(m("lmcache_driven").lmcache_driven_enabled());
        assert_eq!(TransferMode::from_flag("pickle"), None);
        for s in ["auto", "engine_driven", "lmcache_driven"] {
            assert_eq!(m(s).as_str(), s);
        }
    }

    #[test]
    fn config_eviction_policy_names() {
        for s in ["LRU", "IsolatedLRU", "noop"] {
            assert_eq!(EvictionPolicyName::from_flag(s).unwrap().as_str(), s);
        }
        assert_eq!(EvictionPolicyName::from_flag("ARC"), None);
        assert_eq!(EvictionPolicyName::from_flag("lru"), None);
    }

    #[test]
    fn config_gb_to_bytes_is_binary_and_truncates() {
        assert_eq!(gb_to_bytes(1.0), Some(1 << 30));
        assert_eq!(gb_to_bytes(0.5), Some(1 << 29));
        assert_eq!(gb_to_bytes(100.0), Some(100 << 30));
        // int(1e-9 * 2**30) == 1 in Python: truncation, not rounding.
        assert_eq!(gb_to_bytes(1e-9), Some(1));
        assert_eq!(gb_to_bytes(1.000000001), Some(1_073_741_825));
        assert_eq!(gb_to_bytes(f64::NAN), None);
        assert_eq!(gb_to_bytes(f64::INFINITY), None);
        assert_eq!(gb_to_bytes(-1.0), None);
        assert_eq!(gb_to_bytes(1e12), None);
    }

    #[test]
    fn config_shm_name_normalised_like_lmcache() {
        assert_eq!(
            normalize_shm_name("bench").unwrap(),
            "lmcache_l1_pool_bench"
        );
        assert_eq!(
            normalize_shm_name("/bench").unwrap(),
            "lmcache_l1_pool_bench"
        );
        assert_eq!(
            normalize_shm_name("//bench").unwrap(),
            "lmcache_l1_pool_bench"
        );
        assert_eq!(
            normalize_shm_name("lmcache_l1_pool_x").unwrap(),
            "lmcache_l1_pool_x"
        );
        assert_eq!(
            normalize_shm_name("/lmcache_l1_pool_x").unwrap(),
            "lmcache_l1_pool_x"
        );
        for bad in ["/", "a/b", "a\0b"] {
            let e = normalize_shm_name(bad).unwrap_err();
            assert_eq!(e.flag(), "--shm-name", "{bad:?}");
        }
        assert!(normalize_shm_name(&"x".repeat(300)).is_err());
        assert!(normalize_shm_name(&"x".repeat(255 - SHM_POOL_PREFIX.len())).is_ok());
    }

    #[test]
    fn config_auto_shm_name_is_prefixed_and_unique() {
        let a = auto_shm_name();
        let b = auto_shm_name();
        let want = format!("lmcache_l1_pool_kvshard_{}_", std::process::id());
        assert!(a.starts_with(&want), "{a}");
        assert_eq!(a.len(), want.len() + 8);
        assert_ne!(a, b);
        // It must already be in normalised form.
        assert_eq!(normalize_shm_name(&a).unwrap(), a);
        assert!(is_auto_shm_name(&a) && is_auto_shm_name(&b));
        for given in [
            "lmcache_l1_pool_bench",
            "lmcache_l1_pool_kvshard_",
            "lmcache_l1_pool_kvshard_12_0a0b0c0",
            "lmcache_l1_pool_kvshard_12_0a0b0c0d0",
            "lmcache_l1_pool_kvshard_12_0A0B0C0D",
            "lmcache_l1_pool_kvshard_x2_0a0b0c0d",
            "lmcache_l1_pool_kvshard__0a0b0c0d",
            "kvshard_12_0a0b0c0d",
        ] {
            assert!(!is_auto_shm_name(given), "{given}");
        }
    }

    #[test]
    fn config_uuid_v4_format() {
        let u = new_uuid_v4();
        assert_eq!(u.len(), 36);
        let parts: Vec<&str> = u.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(u
            .chars()
            .all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c)));
        assert_eq!(&parts[2][..1], "4");
        assert!(matches!(&parts[3][..1], "8" | "9" | "a" | "b"));
        assert_ne!(new_uuid_v4(), u);
    }

    #[test]
    fn config_error_names_flag() {
        let e = ConfigError::unsupported("--l2-adapter", "L2 is not implemented yet");
        assert_eq!(e.flag(), "--l2-adapter");
        assert_eq!(
            e.to_string(),
            "unsupported --l2-adapter: L2 is not implemented yet"
        );
        let e = ConfigError::invalid("--port", "must be 1-65535");
        assert_eq!(e.to_string(), "invalid --port: must be 1-65535");
    }

    #[test]
    fn config_serialises_durations_as_seconds() {
        let v = serde_json::to_value(ServerConfig::example()).unwrap();
        assert_eq!(v["session_ttl"], 600.0);
        assert_eq!(v["l1"]["read_ttl"], 300.0);
        assert_eq!(v["transfer_mode"], "auto");
        assert_eq!(v["l1"]["eviction_policy"], "LRU");
        assert_eq!(v["shm_name"], "lmcache_l1_pool_x");
        assert!(v["lookup_hash_log"].is_null());
    }
}
