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

#[derive(Debug, Clone, PartialEq)]
pub enum AdapterKind {
    Mock(MockConfig),
    Fs(FsConfig),
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
        }
    }

    /// Capacity of the whole adapter (all shards) in bytes; 0 = unbounded.
    pub fn capacity_bytes(&self) -> u64 {
        match &self.kind {
            AdapterKind::Mock(m) => (m.max_size_gb * GIB) as u64,
            AdapterKind::Fs(f) => (f.max_capacity_gb * GIB) as u64,
        }
    }
}

/// Adapter types this build has.
pub const KNOWN_TYPES: &[&str] = &["fs", "mock"];

/// Adapter types of lmcache 0.5.6 that kvshard does not build (yet).
const UNBUILT_TYPES: &[&str] = &[
    "s3",
    "fs_native",
    "nixl_store",
    "nixl_store_dynamic",
    "nixl_native",
    "mooncake_store",
    "resp",
    "valkey",
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
        "mock" => &["max_size_gb", "mock_bandwidth_gb"],
        "fs" => &[
            "base_path",
            "relative_tmp_dir",
            "read_ahead_size",
            "use_odirect",
            "max_capacity_gb",
        ],
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
    let kind = match type_name {
        "mock" => AdapterKind::Mock(MockConfig {
            max_size_gb: positive(obj, "max_size_gb", &at)?,
            mock_bandwidth_gb: positive(obj, "mock_bandwidth_gb", &at)?,
        }),
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
        json: json.clone(),
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
                mock_bandwidth_gb: 10.0
            })
        );
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
        assert!(err(r#"{"type":"s3"}"#).contains("not available"));
        assert!(err(r#"{"type":"mock","max_size_gb":1}"#).contains("'mock_bandwidth_gb'"));
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
}
