//! Counters of the front end and the Prometheus text exposition of `/metrics`.
//!
//! Names follow lmcache 0.5.6's `lmcache_mp_*` metrics (OTel names exported through
//! Prometheus: dots to underscores, unit suffixes, `_total` on counters) for what
//! kvshard implements; kvshard-only series are prefixed `kvshard_`. Shard-side
//! counters are summed over shards at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::shard::ShardReport;

/// Counters owned by the front thread.
#[derive(Debug, Default, Clone)]
pub struct Metrics {
    pub requests: u64,
    pub bad_requests: u64,
    pub unknown_ops: u64,
    pub unsupported_ops: BTreeMap<&'static str, u64>,
    pub reply_failures: u64,
    pub mailbox_full: u64,
    pub lookups: u64,
    pub lookup_requested_tokens: u64,
    pub lookup_hit_tokens: u64,
    pub lookup_hit_keys: u64,
    pub early_exits: BTreeMap<&'static str, u64>,
    pub submitted_stores: u64,
    pub finished_stores: u64,
    pub submitted_retrieves: u64,
    pub finished_retrieves: u64,
    pub stored_chunks: u64,
    pub retrieved_chunks: u64,
    pub store_oom_chunks: u64,
    pub retrieve_misses: u64,
    pub unregistered_instance: u64,
    pub failed_registrations: u64,
    pub reaped_workers: u64,
    pub block_allocation_records: u64,
}

impl Metrics {
    pub fn count_unsupported(&mut self, op: &'static str) {
        *self.unsupported_ops.entry(op).or_default() += 1;
    }

    pub fn count_early_exit(&mut self, reason: &'static str) {
        *self.early_exits.entry(reason).or_default() += 1;
    }

    pub fn render(&self, t: &mut PromText, shards: &[ShardReport], sessions: usize, jobs: usize) {
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
            "Chunks that could not be allocated in L1",
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
            self.lookup_hit_tokens,
        );
        t.counter(
            "lmcache_mp_lookup_hit_l2_tokens_total",
            "Prefix tokens found in L2",
            0,
        );
        t.counter(
            "lmcache_mp_lookup_hit_l1_keys_total",
            "Object keys found in L1",
            self.lookup_hit_keys,
        );
        t.counter(
            "lmcache_mp_lookup_hit_l2_keys_total",
            "Object keys found in L2",
            0,
        );
        t.counter(
            "lmcache_mp_lookups_requests_total",
            "Lookup requests",
            self.lookups,
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
            "kvshard_shard_mailbox_full_total",
            "Times the front waited on a full shard mailbox",
            self.mailbox_full,
        );
        t.counter(
            "kvshard_store_oom_chunks_total",
            "Chunks not stored for lack of L1 memory",
            self.store_oom_chunks,
        );
        t.counter(
            "kvshard_retrieve_misses_total",
            "Retrieves that did not find every chunk read-locked",
            self.retrieve_misses,
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
            "kvshard_reaped_workers_total",
            "Worker registrations reaped for silence",
            self.reaped_workers,
        );
        t.counter(
            "kvshard_expired_stages_total",
            "Write reservations reclaimed after their TTL",
            sum(&|r| r.stats.expired_stages),
        );
        t.gauge("kvshard_active_sessions", "Sessions held", sessions as f64);
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

    pub fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.declare(name, help, "gauge");
        let _ = writeln!(self.out, "{name} {v}");
    }

    pub fn finish(self) -> String {
        self.out
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
}
