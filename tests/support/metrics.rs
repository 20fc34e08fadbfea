//! What the server exposes about itself: `/metrics` parsed as Prometheus
//! text, and its resident memory split into the L1 arena and the rest.

use super::*;

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct PromSample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parses Prometheus text format 0.0.4 strictly: every line is a `# HELP` /
/// `# TYPE` comment or `name{labels} value`; panics on anything else.
pub fn parse_prometheus(text: &str) -> Vec<PromSample> {
    let is_name = |n: &str| {
        let mut cs = n.chars();
        cs.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && cs.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let mut out = Vec::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let parts: Vec<&str> = rest.trim_start().splitn(3, ' ').collect();
            assert!(
                matches!(parts.first(), Some(&"HELP") | Some(&"TYPE")) && parts.len() >= 2,
                "bad comment line {line:?}"
            );
            assert!(is_name(parts[1]), "bad metric name in {line:?}");
            if parts[0] == "TYPE" {
                assert!(
                    matches!(
                        parts.get(2).copied(),
                        Some("counter" | "gauge" | "histogram" | "summary" | "untyped")
                    ),
                    "bad TYPE line {line:?}"
                );
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("sample line without a value: {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad sample value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, Vec::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels in {line:?}"));
                (name, parse_labels(body, line))
            }
        };
        assert!(is_name(name), "bad metric name in {line:?}");
        out.push(PromSample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    out
}

fn parse_labels(body: &str, line: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (k, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("bad label in {line:?}"));
        assert!(
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad label name in {line:?}"
        );
        let mut val = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => val.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => val.push(c),
                    _ => panic!("bad escape in {line:?}"),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => val.push(c),
                None => panic!("unterminated label value in {line:?}"),
            }
        };
        out.push((k.to_owned(), val));
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    out
}

impl Server {
    /// Whether the store controller has settled every L2 store it was given
    /// (none in flight; each submitted object completed or failed), summed
    /// over the shards.
    pub fn stores_settled(&self) -> bool {
        let s = self.scrape();
        let get = |name: &str| {
            s.iter()
                .filter(|x| x.name == name)
                .map(|x| x.value)
                .sum::<f64>()
        };
        get("lmcache_mp_num_inflight_l2_stores") == 0.0
            && get("lmcache_mp_l2_store_submitted_objects_chunks_total")
                == get("lmcache_mp_l2_store_completed_objects_chunks_total")
                    + get("kvshard_l2_store_failed_objects_total")
    }

    /// `GET /metrics`, parsed (and so checked) as Prometheus text.
    pub fn scrape(&self) -> Vec<PromSample> {
        let (st, body) = self.http("GET", "/metrics", None);
        assert_eq!(st, 200, "/metrics: {body}");
        parse_prometheus(&body)
    }

    /// The value of the sample `name` whose labels include `labels`, if exposed.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.scrape()
            .into_iter()
            .find(|x| {
                x.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| x.labels.iter().any(|(a, b)| a == k && b == v))
            })
            .map(|x| x.value)
    }

    /// A count of `/status`'s `storage_manager.l1_manager` (`total_object_count`,
    /// `read_locked_count`, ...).
    pub fn l1_count(&self, field: &str) -> u64 {
        self.get_json("/status")["storage_manager"]["l1_manager"][field]
            .as_u64()
            .unwrap_or_else(|| panic!("l1_manager.{field} is not a count"))
    }

    /// L1 eviction ticks run so far (`lmcache_mp_l1_eviction_loop_ticks_total`,
    /// summed over shards).
    pub fn l1_ticks(&self) -> f64 {
        self.metric("lmcache_mp_l1_eviction_loop_ticks_total", &[])
            .expect("lmcache_mp_l1_eviction_loop_ticks_total in /metrics")
    }

    /// Waits until the L1 tick (TTL expiry, then eviction; once a second on
    /// each shard) has run two more times per shard than the `ticks` read
    /// earlier with [`Server::l1_ticks`], so what a test sees afterwards has
    /// been through whole ticks. A tick runs on its shard's thread between
    /// messages, so a count read includes only finished ticks. The counter is
    /// a sum over shards: with several, this holds for each shard as long as
    /// the shards tick at the same pace.
    pub fn wait_l1_ticks_after(&self, ticks: f64) {
        let target = ticks + 2.0 * self.l1_count("num_shards") as f64;
        wait_until("two L1 eviction ticks per shard", || {
            self.l1_ticks() >= target
        });
    }

    /// `GET` of a JSON endpoint that must answer 200.
    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let (st, body) = self.http("GET", path, None);
        assert_eq!(st, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"))
    }
}

// ------------------------------------------ resident memory and a lookup load
//
// Shared by benches/rpc.rs and tests/rss_lookups.rs.

/// Resident memory of a process from `/proc/<pid>/smaps`, split into the L1
/// arena's mappings and everything else (bytes).
#[derive(Debug, Clone, Copy, Default)]
pub struct RssSplit {
    /// Rss of every mapping but the arena's.
    pub outside: u64,
    /// Rss of the arena's mappings.
    pub arena_rss: u64,
    /// Size of the arena's mappings.
    pub arena_size: u64,
    pub arena_mappings: usize,
}

/// [`RssSplit`] of process `pid`, the arena being every mapping of the file
/// `arena_path`.
pub fn rss_split(pid: u32, arena_path: &str) -> RssSplit {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/smaps: {e}"));
    let mut r = RssSplit::default();
    let mut in_arena = false;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if first.ends_with(':') {
            if first == "Rss:" {
                let kb: u64 = words.next().and_then(|w| w.parse().ok()).expect("Rss kB");
                if in_arena {
                    r.arena_rss += kb << 10;
                } else {
                    r.outside += kb << 10;
                }
            }
            continue;
        }
        // A mapping: "start-end perms offset dev inode [path]".
        let (lo, hi) = first.split_once('-').expect("smaps mapping line");
        in_arena = line.split_whitespace().nth(5) == Some(arena_path);
        if in_arena {
            let lo = u64::from_str_radix(lo, 16).unwrap();
            let hi = u64::from_str_radix(hi, 16).unwrap();
            r.arena_size += hi - lo;
            r.arena_mappings += 1;
        }
    }
    r
}

impl Server {
    /// [`rss_split`] of this server; its arena is the SHM pool `/dev/shm/<shm_name>`.
    pub fn rss_split(&self) -> RssSplit {
        rss_split(self.child.id(), &format!("/dev/shm/{}", self.shm_name))
    }
}
