//! `/status`: what the front and its shards report, taken on the front as a
//! [`StatusSnapshot`] and rendered to JSON by whoever receives it (the HTTP API's
//! thread), so that building the document costs the front nothing.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use kvshard_dataplane::config::ServerConfig;
use kvshard_dataplane::messages::ShardReport;

/// The front's state and its shards' reports at one moment.
pub struct StatusSnapshot {
    /// When it was taken: uptime and ages are as of then.
    pub taken_at: Instant,
    /// When the front started.
    pub started: Instant,
    pub cfg: Arc<ServerConfig>,
    /// One per shard that answered.
    pub reports: Vec<ShardReport>,
    pub num_shards: usize,
    pub huge_pages: &'static str,
    pub huge_page_bytes: Option<u64>,
    /// What backs the L1 arena (`FrontSetup::arena`).
    pub arena: serde_json::Value,
    pub active_sessions: usize,
    /// Lookup results not consumed yet.
    pub active_prefetch_jobs: usize,
    pub inflight_loads: usize,
    pub queued_loads: usize,
    pub lmc_ids: Vec<i64>,
    pub lmc_meta: serde_json::Value,
    pub engine_ids: Vec<i64>,
    pub engine_meta: serde_json::Value,
    /// Per registered worker: id, transfer mode, last seen, whether it pinged.
    pub liveness: Vec<(i64, &'static str, Instant, bool)>,
    pub refused_gpu_instances: serde_json::Value,
    /// Per shard: its thread has ended.
    pub dead: Vec<bool>,
    pub overflow_bound: usize,
    /// Per shard: messages in its overflow queue.
    pub overflow_queued: Vec<usize>,
}

impl StatusSnapshot {
    /// The `/status` document (what `lmcache describe kvcache` reads).
    pub fn render(&self) -> serde_json::Value {
        let reports = &self.reports;
        let sum = |f: &dyn Fn(&ShardReport) -> u64| reports.iter().map(f).sum::<u64>();
        let used = sum(&|r| r.status.memory_used_bytes);
        let total = sum(&|r| r.status.memory_total_bytes);
        let configured = self.cfg.l1.size_bytes;
        let usage_ratio = if total > 0 {
            used as f64 / total as f64
        } else {
            0.0
        };
        let l1_manager = json!({
            "total_object_count": sum(&|r| r.status.total_object_count as u64),
            "write_locked_count": sum(&|r| r.status.write_locked_count as u64),
            "read_locked_count": sum(&|r| r.status.read_locked_count as u64),
            "temporary_count": sum(&|r| r.status.temporary_count as u64),
            "staging_object_count": sum(&|r| r.status.staging_object_count as u64),
            "staging_bytes": sum(&|r| r.status.staging_bytes),
            // kvshard only: memory lent to the front for prepare_stores.
            "write_credit_bytes": sum(&|r| r.write_credit_bytes),
            "memory_used_bytes": used,
            "memory_total_bytes": total,
            "memory_configured_bytes": configured,
            // `lmcache describe kvcache` shows L1 use only when this is present.
            "memory_usage_ratio": usage_ratio,
            "capacity_bytes_by_backend": {"cpu": configured},
            "num_shards": self.num_shards,
            "huge_pages": self.huge_pages,
            "huge_page_bytes_at_start": self.huge_page_bytes,
            "arena": self.arena_json(),
        });
        let mut worker_liveness = serde_json::Map::new();
        let now = self.taken_at;
        for (iid, mode, last_seen, pinged) in &self.liveness {
            worker_liveness.insert(
                iid.to_string(),
                json!({"transfer_mode": mode, "seconds_since_last_seen": now.duration_since(*last_seen).as_secs_f64(), "has_liveness_signal": pinged}),
            );
        }
        let dead: Vec<usize> = (0..self.dead.len()).filter(|s| self.dead[*s]).collect();
        let cfg = &self.cfg;
        let mut status = json!({
            "is_healthy": dead.is_empty(),
            "engine_type": "MPCacheServer",
            "server": "kvshard",
            "chunk_size": cfg.chunk_size,
            "hash_algorithm": "blake3",
            "active_sessions": self.active_sessions,
            "uptime_seconds": now.duration_since(self.started).as_secs_f64(),
            "storage_manager": {
                "is_healthy": true,
                "num_l2_adapters": cfg.l2.adapters.len(),
                "l2_adapters": self.l2_status(),
                "l2_store_policy": cfg.l2.store_policy,
                "l2_prefetch_policy": cfg.l2.prefetch_policy,
                "prefetch_controller": {
                    "max_in_flight": cfg.l2.prefetch_max_in_flight,
                    "inflight_loads": self.inflight_loads,
                    "queued_loads": self.queued_loads,
                },
                "l1_usage": usage_ratio,
                "l1_capacity_bytes_by_backend": {"cpu": configured},
                "l1_manager": l1_manager,
                "l1_eviction_controller": {
                    "eviction_policy": cfg.l1.eviction_policy.as_str(),
                    "trigger_watermark": cfg.l1.trigger_watermark,
                    "eviction_ratio": cfg.l1.eviction_ratio,
                    "evicted_chunks": sum(&|r| r.stats.evicted_chunks),
                },
                // Read by `lmcache describe kvcache` (0.5.6 itself never reports it).
                "eviction_controller": {"eviction_policy": cfg.l1.eviction_policy.as_str()},
            },
            "active_prefetch_jobs": self.active_prefetch_jobs,
            "registered_gpu_ids": self.lmc_ids,
            "cache_context_meta": self.lmc_meta,
            "registered_non_cuda_instance_ids": self.engine_ids,
            "non_cuda_context_meta": self.engine_meta,
            "worker_liveness": worker_liveness,
            // GPU workers whose CUDA registrations were refused, and why.
            "refused_gpu_instances": self.refused_gpu_instances,
            // kvshard only: shards whose thread ended, and the overflow
            // queues of shards whose mailbox is full.
            "shards": {
                "num_shards": self.num_shards,
                "dead_shards": dead,
                "mailbox_depth": cfg.shard_queue_depth,
                "overflow_bound": self.overflow_bound,
                "overflow_queued": self.overflow_queued,
            },
        });
        if !dead.is_empty() {
            // /healthcheck's reason.
            status["unhealthy_reason"] = format!(
                "shard(s) {dead:?} stopped: requests that need them are answered with failure replies"
            )
            .into();
        }
        status
    }

    /// One entry per adapter, summed over shards, with the keys
    /// `lmcache describe kvcache` shows.
    fn l2_status(&self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        for (i, spec) in self.cfg.l2.adapters.iter().enumerate() {
            let tiers: Vec<_> = self.reports.iter().filter_map(|r| r.l2.get(i)).collect();
            let used: u64 = tiers.iter().map(|t| t.usage.used_bytes).sum();
            let keys: u64 = tiers.iter().map(|t| t.usage.keys).sum();
            let healthy = tiers
                .iter()
                .all(|t| t.status["adapter"]["is_healthy"].as_bool().unwrap_or(true));
            let mut v = json!({
                "name": kvshard_dataplane::shard::l2::tier_name(spec, i),
                "type": spec.type_name(),
                "is_healthy": healthy,
                "stored_object_count": keys,
                "current_size_bytes": used,
                "max_capacity_bytes": spec.capacity_bytes(),
                "eviction_policy": spec.eviction.as_ref().map(|e| e.policy.name()),
                "shards": tiers.iter().map(|t| t.status.clone()).collect::<Vec<_>>(),
            });
            match &spec.kind {
                kvshard_engine::l2::config::AdapterKind::Fs(f) => {
                    v["base_path"] = serde_json::Value::String(f.base_path.clone());
                }
                kvshard_engine::l2::config::AdapterKind::S3(c) => {
                    // 0.5.6's report_status keys, summed over shards.
                    let shard_client = |k: &str| {
                        tiers
                            .iter()
                            .filter_map(|t| t.status["adapter"]["client"][k].as_u64())
                            .sum::<u64>()
                    };
                    let disabled = tiers
                        .iter()
                        .any(|t| t.status["adapter"]["client"]["breaker_open"] == true);
                    v["endpoint"] = serde_json::Value::String(c.endpoint.clone());
                    v["region"] = serde_json::Value::String(c.region.clone());
                    v["connection_failures"] = shard_client("connection_failures").into();
                    v["connection_disabled"] = disabled.into();
                    if disabled {
                        v["is_healthy"] = false.into();
                    }
                }
                kvshard_engine::l2::config::AdapterKind::Mock(_) => {}
            }
            out.push(v);
        }
        out
    }

    /// The L1 backing; a slab-backed L1 adds each shard's slab file.
    fn arena_json(&self) -> serde_json::Value {
        let mut arena = self.arena.clone();
        let slabs: Vec<serde_json::Value> = self
            .reports
            .iter()
            .filter_map(|r| r.l1_slab.clone())
            .collect();
        if !slabs.is_empty() {
            arena["slabs"] = slabs.into();
        }
        arena
    }
}
