//! `--l2-adapter '<json>'` specs: parsed and checked at start, before any
//! shard runs, so a typo is an error that names the field rather than an
//! adapter that silently does something else.
//!
//! Keys every adapter accepts: `type` (required), `eviction` (optional
//! `{"eviction_policy", "trigger_watermark", "eviction_ratio"}`), and
//! `persist_enabled` (accepted; stored objects always persist). Anything else
//! must be one of the adapter type's own fields.

use serde_json::{Map, Value};

use crate::eviction::{EvictionConfig, PolicyKind};

pub const GIB: f64 = (1u64 << 30) as f64;

/// `{"type":"mock", "max_size_gb", "mock_bandwidth_gb"}`: an in-memory adapter
/// with a capacity and a simulated bandwidth (both required, > 0).
#[derive(Debug, Clone, PartialEq)]
pub struct MockConfig {
    pub max_size_gb: f64,
    pub mock_bandwidth_gb: f64,
    /// kvshard: `mock_load_latency_ms`, how long every load waits before it
    /// writes the objects into their buffers, as a slow read whose bytes land
    /// at the end would (default 0: none). For tests of slow L2 loads.
    pub mock_load_latency_ms: u64,
}

/// `{"type":"fs", "base_path", ...}`: one file per object under `base_path`,
/// named as lmcache 0.5.6's fs adapter names them.
#[derive(Debug, Clone, PartialEq)]
pub struct FsConfig {
    /// Directory of the object files (created if missing).
    pub base_path: String,
    /// Sub-directory of `base_path` for files being written; `None` writes
    /// `<name>.tmp` beside the final name.
    pub relative_tmp_dir: Option<String>,
    /// Read this many bytes first to trigger the filesystem's read-ahead.
    pub read_ahead_size: Option<u64>,
    /// Bypass the page cache (O_DIRECT) where sizes and buffers are aligned.
    pub use_odirect: bool,
    /// kvshard: capacity in GiB for L2 eviction; 0 (default) = unbounded.
    pub max_capacity_gb: f64,
}

/// A credential that never appears in `Debug` output, logs or `/config`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

/// What `/config/adapters` shows in place of a secret.
pub const REDACTED: &str = "***";

/// `{"type":"s3", "s3_endpoint", "s3_region", ...}`: one object per chunk in
/// a bucket, named as lmcache 0.5.6's s3 adapter names them. The fields of
/// 0.5.6 keep its names and defaults; the `s3_*` fields marked kvshard are
/// ours.
#[derive(Debug, Clone, PartialEq)]
pub struct S3Config {
    /// `s3_endpoint`: `s3://bucket`, `s3://bucket.host[:port]` or
    /// `bucket.host[:port]` (virtual-hosted, Host sent verbatim); with
    /// `s3_endpoint_url`, just the bucket.
    pub endpoint: String,
    /// `s3_region`: the SigV4 region.
    pub region: String,
    /// `s3_num_io_threads` (64): connections to the bucket, split over shards.
    pub num_io_threads: u32,
    /// `s3_prefer_http2` (true): offer h2 by ALPN (h2c over plain HTTP).
    pub prefer_http2: bool,
    /// `s3_enable_s3express` (false): S3 Express session auth for directory
    /// buckets.
    pub enable_s3express: bool,
    /// `disable_tls` (false): plain HTTP.
    pub disable_tls: bool,
    /// `aws_access_key_id` + `aws_secret_access_key`, both or neither; without
    /// them the AWS credential chain (environment, profile files, ...).
    pub static_credentials: Option<(String, Secret)>,
    /// `max_capacity_gb` (0 = no aggregate capacity).
    pub max_capacity_gb: f64,
    /// kvshard `s3_endpoint_url`: an explicit `http[s]://host[:port]`
    /// endpoint, path-style addressing (MinIO-like stores); falls back to
    /// `AWS_ENDPOINT_URL` when unset.
    pub endpoint_url: Option<String>,
    /// kvshard `s3_ca_bundle`: extra PEM roots (else `AWS_CA_BUNDLE`).
    pub ca_bundle: Option<String>,
    /// kvshard `s3_key_prefix` (""): objects are `<prefix>/<name>`.
    pub key_prefix: String,
    /// kvshard `s3_request_timeout_secs` (30): deadline of one request.
    pub request_timeout_secs: f64,
    /// kvshard `s3_max_inflight_requests` (= `s3_num_io_threads`): requests
    /// in flight at once, whole server.
    pub max_inflight_requests: u32,
    /// kvshard `s3_seed_usage_on_start` (false): list the bucket at start to
    /// count what it already holds toward usage and eviction.
    pub seed_usage_on_start: bool,
    /// kvshard `s3_breaker_initial_cooldown_s` (5.0) and
    /// `s3_breaker_max_cooldown_s` (300.0), named as in lmcache's later
    /// releases: the circuit breaker's cooldown, doubling per re-trip.
    pub breaker_initial_cooldown_s: f64,
    pub breaker_max_cooldown_s: f64,
}

/// Which of lmcache 0.5.6's two RESP adapters a spec names: the same
/// engine serves both, the fields differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RespFlavor {
    /// `{"type":"resp", "host", "port", ...}` (0.5.6's C++ connector).
    Resp,
    /// `{"type":"valkey", "startup_nodes", ...}` (0.5.6's valkey-glide one).
    Valkey,
}

/// `{"type":"resp"|"valkey", ...}`: one key per object in Redis or Valkey
/// (standalone or cluster), named as lmcache 0.5.6 names them.
#[derive(Debug, Clone, PartialEq)]
pub struct RespConfig {
    pub flavor: RespFlavor,
    /// `host` + `port` (resp), `startup_nodes` (valkey): the server, or a
    /// cluster's seed nodes.
    pub nodes: Vec<(String, u16)>,
    /// `cluster_mode` (valkey, false): Redis Cluster / Valkey Cluster.
    pub cluster_mode: bool,
    /// `username` / `password`: `AUTH`; for resp, the
    /// `LMCACHE_RESP_USERNAME` / `LMCACHE_RESP_PASSWORD` fallbacks.
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// `key_prefix` (valkey, ""): keys are `<prefix>@<name>`.
    pub key_prefix: String,
    /// `num_workers` (8): connections per node, split over shards.
    pub num_workers: u32,
    /// `tls_enable` (false): TLS by rustls, the server's certificate
    /// verified against the system roots and `tls_ca_bundle`.
    pub tls_enable: bool,
    /// kvshard `tls_ca_bundle`: extra PEM roots.
    pub tls_ca_bundle: Option<String>,
    /// `database_id` (valkey): `SELECT` after connecting (standalone only).
    pub database_id: Option<u32>,
    /// `request_timeout` (5 s) and `connection_timeout` (10 s), seconds.
    pub request_timeout_secs: f64,
    pub connection_timeout_secs: f64,
    /// `max_capacity_gb` (0 = no aggregate capacity).
    pub max_capacity_gb: f64,
    /// `ttl_seconds` (valkey): `SET ... EX` when set.
    pub ttl_seconds: Option<u64>,
    /// kvshard `breaker_initial_cooldown_s` (5) / `breaker_max_cooldown_s`
    /// (300): each node's circuit breaker.
    pub breaker_initial_cooldown_s: f64,
    pub breaker_max_cooldown_s: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AdapterKind {
    Mock(MockConfig),
    Fs(FsConfig),
    S3(S3Config),
    Resp(RespConfig),
}

/// One `--l2-adapter` flag, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterSpec {
    pub kind: AdapterKind,
    /// Per-adapter eviction; `None` = never evicted.
    pub eviction: Option<EvictionConfig>,
    /// The JSON as given, for `/config/adapters`.
    pub json: Value,
}

impl AdapterSpec {
    pub fn type_name(&self) -> &'static str {
        match self.kind {
            AdapterKind::Mock(_) => "mock",
            AdapterKind::Fs(_) => "fs",
            AdapterKind::S3(_) => "s3",
            AdapterKind::Resp(ref c) => match c.flavor {
                RespFlavor::Resp => "resp",
                RespFlavor::Valkey => "valkey",
            },
        }
    }

    /// Whether usage is counted from what the adapter holds at start.
    /// Whether a start counts what the adapter holds already: an s3 adapter
    /// when asked (`s3_seed_usage_on_start`; a bucket listing costs requests),
    /// an fs adapter with a capacity always (its directory is scanned, so
    /// that `max_capacity_gb` holds across restarts).
    pub fn seed_usage_on_start(&self) -> bool {
        match &self.kind {
            AdapterKind::S3(c) => c.seed_usage_on_start,
            AdapterKind::Fs(f) => f.max_capacity_gb > 0.0,
            AdapterKind::Mock(_) | AdapterKind::Resp(_) => false,
        }
    }

    /// Capacity of the whole adapter (all shards) in bytes; 0 = unbounded.
    pub fn capacity_bytes(&self) -> u64 {
        match &self.kind {
            AdapterKind::Mock(m) => (m.max_size_gb * GIB) as u64,
            AdapterKind::Fs(f) => (f.max_capacity_gb * GIB) as u64,
            AdapterKind::S3(c) => (c.max_capacity_gb * GIB) as u64,
            AdapterKind::Resp(c) => (c.max_capacity_gb * GIB) as u64,
        }
    }
}

/// Adapter types this build has.
pub const KNOWN_TYPES: &[&str] = &["fs", "mock", "resp", "s3", "valkey"];

/// Adapter types of lmcache 0.5.6 that kvshard does not build (yet).
const UNBUILT_TYPES: &[&str] = &[
    "fs_native",
    "nixl_store",
    "nixl_store_dynamic",
    "nixl_native",
    "mooncake_store",
    "aerospike",
    "bigtable",
    "hf3fs",
    "hfbucket",
    "dax",
    "raw_block",
    "p2p",
    "plugin",
    "native_plugin",
    "native_connector",
    "sagemaker_hyperpod",
    "fault_inject",
];

const COMMON_FIELDS: &[&str] = &["type", "eviction", "persist_enabled"];

/// Parses flag number `index` (1-based, for messages).
pub fn parse_adapter_spec(index: usize, raw: &str) -> Result<AdapterSpec, String> {
    let at = format!("--l2-adapter #{index}");
    let json: Value =
        serde_json::from_str(raw).map_err(|e| format!("{at}: invalid JSON ({e}): {raw}"))?;
    let obj = json
        .as_object()
        .ok_or_else(|| format!("{at}: expected a JSON object, got {}", kind_of(&json)))?;
    let type_name = match obj.get("type") {
        None => {
            return Err(format!(
                "{at}: missing field 'type' (one of {KNOWN_TYPES:?})"
            ))
        }
        Some(Value::String(s)) => s.as_str(),
        Some(v) => {
            return Err(format!(
                "{at}: field 'type' must be a string, got {}",
                kind_of(v)
            ))
        }
    };
    let own_fields: &[&str] = match type_name {
        "mock" => &["max_size_gb", "mock_bandwidth_gb", "mock_load_latency_ms"],
        "fs" => &[
            "base_path",
            "relative_tmp_dir",
            "read_ahead_size",
            "use_odirect",
            "max_capacity_gb",
        ],
        "s3" => S3_FIELDS,
        "resp" => RESP_FIELDS,
        "valkey" => VALKEY_FIELDS,
        t if UNBUILT_TYPES.contains(&t) => {
            return Err(format!(
                "{at}: adapter type '{t}' is not available in this build of kvshard (available: {KNOWN_TYPES:?})"
            ))
        }
        t => return Err(format!("{at}: unknown adapter type '{t}' (available: {KNOWN_TYPES:?})")),
    };
    for k in obj.keys() {
        if k == "serde" {
            return Err(format!(
                "{at}: field 'serde' (L2 serialization such as fp8) is not available in this build of kvshard"
            ));
        }
        if k == "affinity_tag" {
            // One L1 per server: only the default tag exists.
            if obj[k] != Value::String("_default".into()) {
                return Err(format!(
                    "{at}: field 'affinity_tag': kvshard runs one L1, only \"_default\" is accepted"
                ));
            }
            continue;
        }
        if !COMMON_FIELDS.contains(&k.as_str()) && !own_fields.contains(&k.as_str()) {
            return Err(format!(
                "{at}: unknown field '{k}' for adapter type '{type_name}' (fields: {:?})",
                [own_fields, COMMON_FIELDS].concat()
            ));
        }
    }
    if let Some(v) = obj.get("persist_enabled") {
        if !v.is_boolean() {
            return Err(format!("{at}: field 'persist_enabled' must be a boolean"));
        }
    }
    let mut json = json.clone();
    let kind = match type_name {
        "mock" => AdapterKind::Mock(MockConfig {
            max_size_gb: positive(obj, "max_size_gb", &at)?,
            mock_bandwidth_gb: positive(obj, "mock_bandwidth_gb", &at)?,
            mock_load_latency_ms: match obj.get("mock_load_latency_ms") {
                None => 0,
                Some(v) => v.as_u64().ok_or_else(|| {
                    format!("{at}: field 'mock_load_latency_ms' must be a non-negative integer")
                })?,
            },
        }),
        "s3" => {
            let c = parse_s3(obj, &at)?;
            if let Some(v) = json.get_mut("aws_secret_access_key") {
                *v = Value::String(REDACTED.into());
            }
            AdapterKind::S3(c)
        }
        "resp" | "valkey" => {
            let c = parse_resp(obj, type_name == "valkey", &at)?;
            if let Some(v) = json.get_mut("password") {
                *v = Value::String(REDACTED.into());
            }
            AdapterKind::Resp(c)
        }
        _ => {
            let base_path = match obj.get("base_path") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                _ => {
                    return Err(format!(
                        "{at}: field 'base_path' must be a non-empty string"
                    ))
                }
            };
            let relative_tmp_dir = match obj.get("relative_tmp_dir") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => {
                    if s.is_empty() || s.starts_with('/') || s.split('/').any(|p| p == "..") {
                        return Err(format!(
                            "{at}: field 'relative_tmp_dir' must be a relative path inside base_path, got {s:?}"
                        ));
                    }
                    Some(s.clone())
                }
                Some(_) => return Err(format!("{at}: field 'relative_tmp_dir' must be a string")),
            };
            let read_ahead_size = match obj.get("read_ahead_size") {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_u64() {
                    Some(n) if n > 0 => Some(n),
                    _ => {
                        return Err(format!(
                            "{at}: field 'read_ahead_size' must be a positive integer"
                        ))
                    }
                },
            };
            let use_odirect = match obj.get("use_odirect") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(format!("{at}: field 'use_odirect' must be a boolean")),
            };
            let max_capacity_gb = match obj.get("max_capacity_gb") {
                None => 0.0,
                Some(v) => match v.as_f64() {
                    Some(x) if x >= 0.0 && x.is_finite() && !v.is_boolean() => x,
                    _ => {
                        return Err(format!(
                            "{at}: field 'max_capacity_gb' must be a non-negative number"
                        ))
                    }
                },
            };
            AdapterKind::Fs(FsConfig {
                base_path,
                relative_tmp_dir,
                read_ahead_size,
                use_odirect,
                max_capacity_gb,
            })
        }
    };
    let eviction = match obj.get("eviction") {
        None | Some(Value::Null) => None,
        Some(Value::Object(e)) => Some(parse_eviction(e, &at)?),
        Some(v) => {
            return Err(format!(
                "{at}: field 'eviction' must be an object, got {}",
                kind_of(v)
            ))
        }
    };
    let spec = AdapterSpec {
        kind,
        eviction,
        json,
    };
    if let Some(ev) = &spec.eviction {
        if ev.policy == PolicyKind::Lru && spec.capacity_bytes() == 0 {
            return Err(format!(
                "{at}: field 'eviction': LRU needs a capacity (set 'max_capacity_gb' > 0); IsolatedLRU works with /quota alone"
            ));
        }
    }
    Ok(spec)
}

const S3_FIELDS: &[&str] = &[
    "s3_endpoint",
    "s3_region",
    "s3_num_io_threads",
    "s3_prefer_http2",
    "s3_enable_s3express",
    "disable_tls",
    "aws_access_key_id",
    "aws_secret_access_key",
    "max_capacity_gb",
    "s3_endpoint_url",
    "s3_ca_bundle",
    "s3_key_prefix",
    "s3_request_timeout_secs",
    "s3_max_inflight_requests",
    "s3_seed_usage_on_start",
    "s3_breaker_initial_cooldown_s",
    "s3_breaker_max_cooldown_s",
];

fn parse_s3(obj: &Map<String, Value>, at: &str) -> Result<S3Config, String> {
    let string = |k: &str, required: bool| -> Result<Option<String>, String> {
        match obj.get(k) {
            None | Some(Value::Null) if !required => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            _ => Err(format!("{at}: field '{k}' must be a non-empty string")),
        }
    };
    let boolean = |k: &str, default: bool| -> Result<bool, String> {
        match obj.get(k) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(format!("{at}: field '{k}' must be a boolean")),
        }
    };
    // 0.5.6 refuses floats and booleans for its integer fields.
    let count = |k: &str, default: Option<u32>| -> Result<Option<u32>, String> {
        match obj.get(k) {
            None => Ok(default),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && n <= u32::MAX as u64 => Ok(Some(n as u32)),
                _ => Err(format!("{at}: field '{k}' must be a positive integer")),
            },
        }
    };
    let seconds = |k: &str, default: f64| -> Result<f64, String> {
        match obj.get(k) {
            None => Ok(default),
            Some(v) if !v.is_boolean() => match v.as_f64() {
                Some(x) if x > 0.0 && x.is_finite() => Ok(x),
                _ => Err(format!(
                    "{at}: field '{k}' must be a positive number of seconds"
                )),
            },
            Some(_) => Err(format!(
                "{at}: field '{k}' must be a positive number of seconds"
            )),
        }
    };
    let endpoint = string("s3_endpoint", true)?.expect("required");
    let region = string("s3_region", true)?.expect("required");
    let disable_tls = boolean("disable_tls", false)?;
    let endpoint_url = string("s3_endpoint_url", false)?;
    // The endpoint is resolved now so that a malformed one stops the start.
    kvshard_s3_raw::addressing::resolve_bucket(&kvshard_s3_raw::addressing::AddressingConfig {
        bucket_url: &endpoint,
        region: &region,
        endpoint_url: endpoint_url.as_deref(),
        disable_tls,
    })
    .map_err(|e| format!("{at}: field 's3_endpoint' {endpoint:?}: {e}"))?;
    let static_credentials = match (
        string("aws_access_key_id", false)?,
        string("aws_secret_access_key", false)?,
    ) {
        (Some(id), Some(secret)) => Some((id, Secret(secret))),
        (None, None) => None,
        _ => {
            return Err(format!(
                "{at}: fields 'aws_access_key_id' and 'aws_secret_access_key' go together: set both, or \
                 neither to use the AWS credential chain"
            ))
        }
    };
    let max_capacity_gb = match obj.get("max_capacity_gb") {
        None => 0.0,
        Some(v) => match v.as_f64() {
            Some(x) if x >= 0.0 && x.is_finite() && !v.is_boolean() => x,
            _ => {
                return Err(format!(
                    "{at}: field 'max_capacity_gb' must be a non-negative number"
                ))
            }
        },
    };
    let key_prefix = match obj.get("s3_key_prefix") {
        None => String::new(),
        Some(Value::String(p)) => {
            if p.starts_with('/') || p.ends_with('/') {
                return Err(format!(
                    "{at}: field 's3_key_prefix' must not start or end with '/' (got {p:?})"
                ));
            }
            p.clone()
        }
        Some(_) => return Err(format!("{at}: field 's3_key_prefix' must be a string")),
    };
    let num_io_threads = count("s3_num_io_threads", Some(64))?.expect("defaulted");
    let breaker_initial_cooldown_s = seconds("s3_breaker_initial_cooldown_s", 5.0)?;
    let breaker_max_cooldown_s = seconds("s3_breaker_max_cooldown_s", 300.0)?;
    if breaker_max_cooldown_s < breaker_initial_cooldown_s {
        return Err(format!(
            "{at}: field 's3_breaker_max_cooldown_s' ({breaker_max_cooldown_s}) is below \
             's3_breaker_initial_cooldown_s' ({breaker_initial_cooldown_s})"
        ));
    }
    Ok(S3Config {
        endpoint,
        region,
        num_io_threads,
        prefer_http2: boolean("s3_prefer_http2", true)?,
        enable_s3express: boolean("s3_enable_s3express", false)?,
        disable_tls,
        static_credentials,
        max_capacity_gb,
        endpoint_url,
        ca_bundle: string("s3_ca_bundle", false)?,
        key_prefix,
        request_timeout_secs: seconds("s3_request_timeout_secs", 30.0)?,
        max_inflight_requests: count("s3_max_inflight_requests", Some(num_io_threads))?
            .expect("defaulted"),
        seed_usage_on_start: boolean("s3_seed_usage_on_start", false)?,
        breaker_initial_cooldown_s,
        breaker_max_cooldown_s,
    })
}

const RESP_FIELDS: &[&str] = &[
    "host",
    "port",
    "num_workers",
    "username",
    "password",
    "max_capacity_gb",
    // kvshard: the valkey type's connection settings, on resp too.
    "tls_enable",
    "database_id",
    "request_timeout",
    "connection_timeout",
    "tls_ca_bundle",
    "breaker_initial_cooldown_s",
    "breaker_max_cooldown_s",
];

const VALKEY_FIELDS: &[&str] = &[
    "startup_nodes",
    "cluster_mode",
    "username",
    "password",
    "key_prefix",
    "num_workers",
    "tls_enable",
    "database_id",
    "request_timeout",
    "connection_timeout",
    "max_capacity_gb",
    "ttl_seconds",
    "tls_ca_bundle",
    "breaker_initial_cooldown_s",
    "breaker_max_cooldown_s",
];

/// `host:port[,host:port...]` (0.5.6's `startup_nodes`).
fn parse_nodes(raw: &str) -> Result<Vec<(String, u16)>, String> {
    let mut nodes = Vec::new();
    for entry in raw.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (host, port) = entry
            .rsplit_once(':')
            .filter(|(h, _)| !h.is_empty())
            .ok_or_else(|| format!("entry {entry:?} is not host:port"))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("entry {entry:?} has no port in 1..65535"))?;
        nodes.push((host.to_owned(), port));
    }
    if nodes.is_empty() {
        return Err("no host:port entry".to_owned());
    }
    Ok(nodes)
}

fn parse_resp(obj: &Map<String, Value>, valkey: bool, at: &str) -> Result<RespConfig, String> {
    let text = |k: &str| -> Result<Option<String>, String> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("{at}: field '{k}' must be a string")),
        }
    };
    let boolean = |k: &str| -> Result<bool, String> {
        match obj.get(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(format!("{at}: field '{k}' must be a boolean")),
        }
    };
    // 0.5.6 refuses booleans and floats for its integer fields.
    let integer = |k: &str, min: u64, max: u64| -> Result<Option<u64>, String> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
                _ => Err(format!(
                    "{at}: field '{k}' must be an integer in {min}..={max}"
                )),
            },
        }
    };
    let seconds = |k: &str, default: f64| -> Result<f64, String> {
        match obj.get(k) {
            None => Ok(default),
            Some(v) if !v.is_boolean() => match v.as_f64() {
                Some(x) if x > 0.0 && x.is_finite() => Ok(x),
                _ => Err(format!(
                    "{at}: field '{k}' must be a positive number of seconds"
                )),
            },
            Some(_) => Err(format!(
                "{at}: field '{k}' must be a positive number of seconds"
            )),
        }
    };
    let nodes = if valkey {
        let raw = match obj.get("startup_nodes") {
            Some(Value::String(s)) => s.as_str(),
            _ => {
                return Err(format!(
                    "{at}: field 'startup_nodes' must be a 'host:port[,host:port...]' string"
                ))
            }
        };
        parse_nodes(raw).map_err(|e| format!("{at}: field 'startup_nodes': {e}"))?
    } else {
        let host = text("host")?
            .ok_or_else(|| format!("{at}: field 'host' must be a non-empty string"))?;
        let port = integer("port", 1, u16::MAX as u64)?
            .ok_or_else(|| format!("{at}: field 'port' must be an integer in 1..=65535"))?;
        vec![(host, port as u16)]
    };
    let cluster_mode = boolean("cluster_mode")?;
    if !cluster_mode && nodes.len() > 1 {
        // 0.5.6 uses the first and logs a warning; a second server that
        // is never used is a mistake worth stopping for.
        return Err(format!(
            "{at}: field 'startup_nodes' lists {} nodes but 'cluster_mode' is false: a standalone \
             server is one node (list it alone, or set \"cluster_mode\": true)",
            nodes.len()
        ));
    }
    let database_id = integer("database_id", 0, u32::MAX as u64)?.map(|d| d as u32);
    if cluster_mode && database_id.is_some_and(|d| d != 0) {
        return Err(format!(
            "{at}: field 'database_id': a cluster has database 0 only (0.5.6 ignores the field in cluster_mode)"
        ));
    }
    let (env_user, env_password) = if valkey {
        (None, None)
    } else {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        (env("LMCACHE_RESP_USERNAME"), env("LMCACHE_RESP_PASSWORD"))
    };
    let username = text("username")?.or(env_user);
    let password = text("password")?.or(env_password).map(Secret);
    if username.is_some() && password.is_none() {
        return Err(format!(
            "{at}: field 'username' needs a 'password' (AUTH with an ACL user takes both)"
        ));
    }
    let key_prefix = text("key_prefix")?.unwrap_or_default();
    if key_prefix.contains('@') {
        return Err(format!(
            "{at}: field 'key_prefix' must not contain '@' (got {key_prefix:?})"
        ));
    }
    let max_capacity_gb = match obj.get("max_capacity_gb") {
        None => 0.0,
        Some(v) => match v.as_f64() {
            Some(x) if x >= 0.0 && x.is_finite() && !v.is_boolean() => x,
            _ => {
                return Err(format!(
                    "{at}: field 'max_capacity_gb' must be a non-negative number"
                ))
            }
        },
    };
    let ttl_seconds = integer("ttl_seconds", 1, u32::MAX as u64)?;
    if ttl_seconds.is_some() && max_capacity_gb > 0.0 {
        log::warn!(
            "{at}: 'ttl_seconds' with 'max_capacity_gb' > 0: keys Redis expires are still counted toward the capacity until kvshard finds them gone"
        );
    }
    let breaker_initial_cooldown_s = seconds("breaker_initial_cooldown_s", 5.0)?;
    let breaker_max_cooldown_s = seconds("breaker_max_cooldown_s", 300.0)?;
    if breaker_max_cooldown_s < breaker_initial_cooldown_s {
        return Err(format!(
            "{at}: field 'breaker_max_cooldown_s' ({breaker_max_cooldown_s}) is below 'breaker_initial_cooldown_s' ({breaker_initial_cooldown_s})"
        ));
    }
    Ok(RespConfig {
        flavor: if valkey {
            RespFlavor::Valkey
        } else {
            RespFlavor::Resp
        },
        nodes,
        cluster_mode,
        username,
        password,
        key_prefix,
        num_workers: integer("num_workers", 1, 4096)?.unwrap_or(8) as u32,
        tls_enable: boolean("tls_enable")?,
        tls_ca_bundle: text("tls_ca_bundle")?,
        database_id,
        request_timeout_secs: seconds("request_timeout", 5.0)?,
        connection_timeout_secs: seconds("connection_timeout", 10.0)?,
        max_capacity_gb,
        ttl_seconds,
        breaker_initial_cooldown_s,
        breaker_max_cooldown_s,
    })
}

fn parse_eviction(e: &Map<String, Value>, at: &str) -> Result<EvictionConfig, String> {
    for k in e.keys() {
        if !["eviction_policy", "trigger_watermark", "eviction_ratio"].contains(&k.as_str()) {
            return Err(format!(
                "{at}: unknown field 'eviction.{k}' (fields: eviction_policy, trigger_watermark, eviction_ratio)"
            ));
        }
    }
    let policy = match e.get("eviction_policy").and_then(Value::as_str) {
        Some("LRU") => PolicyKind::Lru,
        Some("IsolatedLRU") => PolicyKind::IsolatedLru,
        Some("noop") => PolicyKind::Noop,
        Some("ARC") => {
            return Err(format!(
            "{at}: field 'eviction.eviction_policy': ARC is not available in this build of kvshard"
        ))
        }
        _ => {
            return Err(format!(
                "{at}: field 'eviction.eviction_policy' must be 'LRU', 'IsolatedLRU' or 'noop'"
            ))
        }
    };
    let mut cfg = EvictionConfig::new(policy);
    for (name, slot) in [
        ("trigger_watermark", &mut cfg.trigger_watermark),
        ("eviction_ratio", &mut cfg.eviction_ratio),
    ] {
        if let Some(v) = e.get(name) {
            match v.as_f64() {
                Some(x) if x > 0.0 && x <= 1.0 => *slot = x,
                _ => {
                    return Err(format!(
                        "{at}: field 'eviction.{name}' must be a number in (0, 1]"
                    ))
                }
            }
        }
    }
    Ok(cfg)
}

fn positive(obj: &Map<String, Value>, field: &str, at: &str) -> Result<f64, String> {
    match obj.get(field) {
        Some(v) if !v.is_boolean() => match v.as_f64() {
            Some(x) if x > 0.0 && x.is_finite() => Ok(x),
            _ => Err(format!("{at}: field '{field}' must be a positive number")),
        },
        _ => Err(format!("{at}: field '{field}' must be a positive number")),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(raw: &str) -> String {
        parse_adapter_spec(1, raw).unwrap_err()
    }

    #[test]
    fn parses_mock_and_fs() {
        let m = parse_adapter_spec(
            1,
            r#"{"type":"mock","max_size_gb":2,"mock_bandwidth_gb":10}"#,
        )
        .unwrap();
        assert_eq!(
            m.kind,
            AdapterKind::Mock(MockConfig {
                max_size_gb: 2.0,
                mock_bandwidth_gb: 10.0,
                mock_load_latency_ms: 0,
            })
        );
        let slow = parse_adapter_spec(
            1,
            r#"{"type":"mock","max_size_gb":1,"mock_bandwidth_gb":1,"mock_load_latency_ms":1500}"#,
        )
        .unwrap();
        let AdapterKind::Mock(slow) = &slow.kind else {
            panic!()
        };
        assert_eq!(slow.mock_load_latency_ms, 1500);
        assert_eq!(m.capacity_bytes(), 2 << 30);
        assert!(m.eviction.is_none());
        let f = parse_adapter_spec(
            2,
            r#"{"type":"fs","base_path":"/x","use_odirect":true,"relative_tmp_dir":"tmp",
                "eviction":{"eviction_policy":"IsolatedLRU","trigger_watermark":0.5}}"#,
        )
        .unwrap();
        let AdapterKind::Fs(fs) = &f.kind else {
            panic!()
        };
        assert_eq!(fs.base_path, "/x");
        assert!(fs.use_odirect);
        assert_eq!(fs.relative_tmp_dir.as_deref(), Some("tmp"));
        let ev = f.eviction.unwrap();
        assert_eq!(ev.policy, PolicyKind::IsolatedLru);
        assert_eq!(ev.trigger_watermark, 0.5);
        assert_eq!(ev.eviction_ratio, 0.2);
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err("{").contains("invalid JSON"));
        assert!(err("[1]").contains("expected a JSON object"));
        assert!(err(r#"{"base_path":"/x"}"#).contains("'type'"));
        assert!(err(r#"{"type":"disk"}"#).contains("unknown adapter type 'disk'"));
        assert!(err(r#"{"type":"nixl_store"}"#).contains("not available"));
        assert!(err(r#"{"type":"mock","max_size_gb":1}"#).contains("'mock_bandwidth_gb'"));
        assert!(err(
            r#"{"type":"mock","max_size_gb":1,"mock_bandwidth_gb":1,"mock_load_latency_ms":-5}"#
        )
        .contains("'mock_load_latency_ms'"));
        assert!(
            err(r#"{"type":"mock","max_size_gb":-1,"mock_bandwidth_gb":1}"#)
                .contains("'max_size_gb'")
        );
        assert!(
            err(r#"{"type":"fs","base_path":"/x","use_odirect":"yes"}"#).contains("'use_odirect'")
        );
        assert!(err(r#"{"type":"fs","base_path":"/x","basepath":"/y"}"#)
            .contains("unknown field 'basepath'"));
        assert!(err(r#"{"type":"fs","base_path":""}"#).contains("'base_path'"));
        assert!(
            err(r#"{"type":"fs","base_path":"/x","relative_tmp_dir":"../t"}"#)
                .contains("'relative_tmp_dir'")
        );
        assert!(
            err(r#"{"type":"fs","base_path":"/x","eviction":{"eviction_policy":"LRU"}}"#)
                .contains("max_capacity_gb")
        );
        assert!(err(
            r#"{"type":"fs","base_path":"/x","eviction":{"eviction_policy":"IsolatedLRU","ratio":1}}"#
        )
        .contains("'eviction.ratio'"));
        assert!(
            err(r#"{"type":"fs","base_path":"/x","serde":{"type":"fp8"}}"#).contains("'serde'")
        );
    }

    #[test]
    fn parses_the_seed_s3_spec_with_0_5_6_defaults() {
        // The MP example of the S3 backend documentation.
        let spec = parse_adapter_spec(
            2,
            r#"{"type":"s3","s3_endpoint":"s3://my-bucket","s3_region":"us-east-1",
                "s3_num_io_threads":64,"s3_prefer_http2":true,"s3_enable_s3express":false,
                "disable_tls":false,"max_capacity_gb":500,
                "eviction":{"eviction_policy":"LRU","trigger_watermark":0.85,"eviction_ratio":0.2}}"#,
        )
        .unwrap();
        assert_eq!(spec.type_name(), "s3");
        assert_eq!(spec.capacity_bytes(), 500 << 30);
        let AdapterKind::S3(c) = &spec.kind else {
            panic!("{spec:?}")
        };
        assert_eq!(c.endpoint, "s3://my-bucket");
        assert_eq!((c.num_io_threads, c.max_inflight_requests), (64, 64));
        assert!(c.prefer_http2 && !c.enable_s3express && !c.disable_tls);
        assert_eq!(c.static_credentials, None);
        assert_eq!(c.request_timeout_secs, 30.0);
        assert_eq!(
            (c.breaker_initial_cooldown_s, c.breaker_max_cooldown_s),
            (5.0, 300.0)
        );
        let ev = spec.eviction.unwrap();
        assert_eq!((ev.trigger_watermark, ev.eviction_ratio), (0.85, 0.2));

        // Minimal form: only the two required fields.
        let spec = parse_adapter_spec(
            1,
            r#"{"type":"s3","s3_endpoint":"kvbkt.localhost:9000","s3_region":"us-east-1"}"#,
        )
        .unwrap();
        assert_eq!(spec.capacity_bytes(), 0);
    }

    #[test]
    fn s3_secrets_are_redacted_and_checked() {
        let spec = parse_adapter_spec(
            1,
            r#"{"type":"s3","s3_endpoint":"bkt.localhost:1","s3_region":"r",
                "aws_access_key_id":"AKID","aws_secret_access_key":"very-secret"}"#,
        )
        .unwrap();
        let AdapterKind::S3(c) = &spec.kind else {
            panic!()
        };
        assert_eq!(
            c.static_credentials,
            Some(("AKID".into(), Secret("very-secret".into())))
        );
        assert_eq!(spec.json["aws_secret_access_key"], REDACTED);
        assert_eq!(spec.json["aws_access_key_id"], "AKID");
        let shown = format!("{spec:?} {}", spec.json);
        assert!(!shown.contains("very-secret"), "{shown}");
        assert!(err(
            r#"{"type":"s3","s3_endpoint":"bkt.localhost:1","s3_region":"r","aws_access_key_id":"A"}"#
        )
        .contains("go together"));
    }

    #[test]
    fn s3_errors_name_the_field() {
        let s3 = |extra: &str| {
            err(&format!(
                r#"{{"type":"s3","s3_endpoint":"bkt.localhost:9000","s3_region":"us-east-1"{extra}}}"#
            ))
        };
        assert!(err(r#"{"type":"s3","s3_region":"r"}"#).contains("'s3_endpoint'"));
        assert!(err(r#"{"type":"s3","s3_endpoint":"bkt.h"}"#).contains("'s3_region'"));
        assert!(s3(r#","s3_num_io_threads":0"#).contains("'s3_num_io_threads'"));
        assert!(s3(r#","s3_num_io_threads":2.5"#).contains("'s3_num_io_threads'"));
        assert!(s3(r#","s3_num_io_threads":true"#).contains("'s3_num_io_threads'"));
        assert!(s3(r#","s3_prefer_http2":"yes""#).contains("'s3_prefer_http2'"));
        assert!(s3(r#","disable_tls":1"#).contains("'disable_tls'"));
        assert!(s3(r#","max_capacity_gb":-1"#).contains("'max_capacity_gb'"));
        assert!(s3(r#","s3_key_prefix":"/a""#).contains("'s3_key_prefix'"));
        assert!(s3(r#","s3_request_timeout_secs":0"#).contains("'s3_request_timeout_secs'"));
        assert!(s3(r#","s3_breaker_max_cooldown_s":1"#).contains("'s3_breaker_max_cooldown_s'"));
        assert!(s3(r#","s3_bucket":"x""#).contains("unknown field 's3_bucket'"));
        assert!(s3(r#","serde":{"type":"fp8"}"#).contains("'serde'"));
        // A malformed endpoint stops the start.
        assert!(
            err(r#"{"type":"s3","s3_endpoint":"http://bkt.h","s3_region":"r"}"#)
                .contains("'s3_endpoint'")
        );
        assert!(
            err(r#"{"type":"s3","s3_endpoint":"bkt.h:notaport","s3_region":"r"}"#)
                .contains("'s3_endpoint'")
        );
    }

    #[test]
    fn parses_resp_and_valkey_with_0_5_6_defaults() {
        let spec = parse_adapter_spec(
            1,
            r#"{"type":"resp","host":"10.0.0.5","port":6379,"password":"pw","max_capacity_gb":2}"#,
        )
        .unwrap();
        assert_eq!(spec.type_name(), "resp");
        assert_eq!(spec.capacity_bytes(), 2 << 30);
        assert_eq!(spec.json["password"], REDACTED);
        let AdapterKind::Resp(c) = &spec.kind else {
            panic!("{spec:?}")
        };
        assert_eq!(c.nodes, [("10.0.0.5".to_owned(), 6379)]);
        assert_eq!(c.password, Some(Secret("pw".into())));
        assert_eq!(
            (c.num_workers, c.cluster_mode, c.tls_enable),
            (8, false, false)
        );
        assert_eq!(
            (c.request_timeout_secs, c.connection_timeout_secs),
            (5.0, 10.0)
        );
        assert!(c.key_prefix.is_empty() && c.ttl_seconds.is_none());
        assert!(!format!("{spec:?}").contains("pw\""));

        let spec = parse_adapter_spec(
            2,
            r#"{"type":"valkey","startup_nodes":"h1:7000, h2:7001,[::1]:7002","cluster_mode":true,
                "username":"kv","password":"s","key_prefix":"prod","num_workers":16,"tls_enable":true,
                "request_timeout":2.5,"connection_timeout":3,"ttl_seconds":600,"database_id":0}"#,
        )
        .unwrap();
        assert_eq!(spec.type_name(), "valkey");
        let AdapterKind::Resp(c) = &spec.kind else {
            panic!("{spec:?}")
        };
        assert_eq!(c.flavor, RespFlavor::Valkey);
        assert_eq!(
            c.nodes,
            [
                ("h1".to_owned(), 7000),
                ("h2".to_owned(), 7001),
                ("::1".to_owned(), 7002)
            ]
        );
        assert!(c.cluster_mode && c.tls_enable);
        assert_eq!(c.username.as_deref(), Some("kv"));
        assert_eq!(c.key_prefix, "prod");
        assert_eq!((c.num_workers, c.ttl_seconds), (16, Some(600)));
        assert_eq!(
            (c.request_timeout_secs, c.connection_timeout_secs),
            (2.5, 3.0)
        );
    }

    #[test]
    fn resp_errors_name_the_field() {
        assert!(err(r#"{"type":"resp","port":1}"#).contains("'host'"));
        assert!(err(r#"{"type":"resp","host":"h"}"#).contains("'port'"));
        assert!(err(r#"{"type":"resp","host":"h","port":70000}"#).contains("'port'"));
        assert!(
            err(r#"{"type":"resp","host":"h","port":1,"num_workers":0}"#).contains("'num_workers'")
        );
        assert!(
            err(r#"{"type":"resp","host":"h","port":1,"num_workers":true}"#)
                .contains("'num_workers'")
        );
        assert!(
            err(r#"{"type":"resp","host":"h","port":1,"key_prefix":"p"}"#)
                .contains("unknown field 'key_prefix'")
        );
        assert!(err(r#"{"type":"resp","host":"h","port":1,"username":"u"}"#).contains("'password'"));
        assert!(err(r#"{"type":"valkey"}"#).contains("'startup_nodes'"));
        assert!(err(r#"{"type":"valkey","startup_nodes":"h"}"#).contains("host:port"));
        assert!(err(r#"{"type":"valkey","startup_nodes":"h:0"}"#).contains("'startup_nodes'"));
        assert!(err(r#"{"type":"valkey","startup_nodes":"a:1,b:2"}"#).contains("'cluster_mode'"));
        assert!(
            err(r#"{"type":"valkey","startup_nodes":"a:1","key_prefix":"a@b"}"#)
                .contains("'key_prefix'")
        );
        assert!(
            err(r#"{"type":"valkey","startup_nodes":"a:1","ttl_seconds":0}"#)
                .contains("'ttl_seconds'")
        );
        assert!(
            err(r#"{"type":"valkey","startup_nodes":"a:1","ttl_seconds":1.5}"#)
                .contains("'ttl_seconds'")
        );
        assert!(
            err(r#"{"type":"valkey","startup_nodes":"a:1","request_timeout":0}"#)
                .contains("'request_timeout'")
        );
        assert!(err(
            r#"{"type":"valkey","startup_nodes":"a:1","cluster_mode":true,"database_id":3}"#
        )
        .contains("'database_id'"));
        assert!(
            err(r#"{"type":"valkey","startup_nodes":"a:1","cluster":true}"#)
                .contains("unknown field 'cluster'")
        );
    }
}
