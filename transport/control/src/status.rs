//! `/status`: what the front and its shards report, taken on the front as a
//! [`StatusSnapshot`] and rendered to JSON by whoever receives it (the HTTP API's
//! thread), so that building the document costs the front nothing.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use kvshard_dataplane::messages::ShardReport;
use kvshard_messages::config::ServerConfig;
use kvshard_wire::InstanceId;

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
    pub lmc_ids: Vec<InstanceId>,
    pub lmc_meta: serde_json::Value,
    pub engine_ids: Vec<InstanceId>,
    pub engine_meta: serde_json::Value,
    /// Per registered worker: id, transfer mode, last seen, whether it pinged.
    pub liveness: Vec<(InstanceId, &'static str, Instant, bool)>,
    pub refused_gpu_instances: serde_json::Value,
    /// Per shard: its thread has ended.
    pub dead: Vec<bool>,
    pub overflow_bound: usize,
    /// Per shard: messages in its overflow queue.
    pub overflow_queued: Vec<usize>,
}

impl StatusSnapshot {
    /// The `/status` document (what `lmcache describe kvcache` reads): 0.5.6's
    /// keys with its meanings, and kvshard's own beside them.
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
        let dead: Vec<usize> = (0..self.dead.len()).filter(|s| self.dead[*s]).collect();
        // 0.5.6's controllers are threads; kvshard's run on the shards.
        let alive = dead.is_empty();
        let cfg = &self.cfg;
        let mut by_backend = serde_json::Map::new();
        by_backend.insert(self.l1_backend().into(), configured.into());
        let l1_manager = json!({
            "is_healthy": true,
            "total_object_count": sum(&|r| r.status.total_object_count as u64),
            "write_locked_count": sum(&|r| r.status.write_locked_count as u64),
            "read_locked_count": sum(&|r| r.status.read_locked_count as u64),
            "temporary_count": sum(&|r| r.status.temporary_count as u64),
            "staging_object_count": sum(&|r| r.status.staging_object_count as u64),
            "staging_bytes": sum(&|r| r.status.staging_bytes),
            "memory_used_bytes": used,
            "memory_total_bytes": total,
            "memory_configured_bytes": configured,
            "capacity_bytes_by_backend": by_backend,
            // `lmcache describe kvcache` shows L1 use only when this is present.
            "memory_usage_ratio": usage_ratio,
            "write_ttl_seconds": seconds(cfg.l1.write_ttl),
            "read_ttl_seconds": seconds(cfg.l1.read_ttl),
            // kvshard only: memory lent to the front for prepare_stores, and
            // what backs the arena.
            "write_credit_bytes": sum(&|r| r.write_credit_bytes),
            "num_shards": self.num_shards,
            "huge_pages": self.huge_pages,
            "huge_page_bytes_at_start": self.huge_page_bytes,
            "arena": self.arena_json(),
        });
        let adapters = cfg.l2.adapters.len();
        let with_adapters = |mut v: serde_json::Value| {
            v["num_l2_adapters"] = adapters.into();
            v["num_active_adapters"] = adapters.into();
            // Adapters are never reconfigured away, so none drains.
            v["num_draining_adapters"] = 0.into();
            v
        };
        let store_controller = with_adapters(json!({
            "is_healthy": alive,
            "thread_alive": alive,
            "in_flight_task_count": sum(&|r| r.l2_ctl.inflight_stores),
        }));
        let l1_eviction_controller = json!({
            "is_healthy": alive,
            "thread_alive": alive,
            "eviction_policy": cfg.l1.eviction_policy.as_str(),
            "trigger_watermark": cfg.l1.trigger_watermark,
            "eviction_ratio": cfg.l1.eviction_ratio,
            "evicted_chunks": sum(&|r| r.stats.evicted_chunks),
        });
        let now = self.taken_at;
        let l2_adapters = self.l2_status();
        // 0.5.6's storage manager is healthy when every component is, the
        // L2 adapters included; the server's is_healthy is the storage
        // manager's.
        let storage_healthy = alive && l2_adapters.iter().all(|a| a["is_healthy"] != false);
        let mut liveness_by_instance = serde_json::Map::new();
        for (iid, mode, last_seen, pinged) in &self.liveness {
            liveness_by_instance.insert(
                iid.to_string(),
                json!({"transfer_mode": mode, "seconds_since_last_seen": now.duration_since(*last_seen).as_secs_f64(), "has_liveness_signal": pinged}),
            );
        }
        let mut status = json!({
            "is_healthy": storage_healthy,
            "engine_type": "MPCacheServer",
            "chunk_size": cfg.chunk_size,
            "hash_algorithm": cfg.hash_algorithm,
            "active_sessions": self.active_sessions,
            "storage_manager": {
                "is_healthy": storage_healthy,
                // One L1 (0.5.6's single-tier layout): the maps hold it
                // under 0.5.6's default tag, and the singular keys repeat it.
                "l1_managers": {"_default": l1_manager.clone()},
                "store_controllers": {"_default": store_controller.clone()},
                "l1_eviction_controllers": {"_default": l1_eviction_controller.clone()},
                "prefetch_controller": with_adapters(json!({
                    "is_healthy": alive,
                    "thread_alive": alive,
                    "max_in_flight": cfg.l2.prefetch_max_in_flight,
                    "inflight_loads": self.inflight_loads,
                    "queued_loads": self.queued_loads,
                })),
                "l2_eviction_controller": {
                    "is_healthy": alive,
                    "thread_alive": alive,
                    "adapters": self.l2_eviction_status(),
                },
                "l2_adapters": l2_adapters,
                "num_l2_adapters": adapters,
                "l1_usage": [used, total],
                "l1_capacity_bytes_by_backend": l1_manager["capacity_bytes_by_backend"].clone(),
                "l1_manager": l1_manager,
                "store_controller": store_controller,
                "l1_eviction_controller": l1_eviction_controller,
                // Read by `lmcache describe kvcache` (0.5.6 itself never reports it).
                "eviction_controller": {"eviction_policy": cfg.l1.eviction_policy.as_str()},
                "l2_store_policy": cfg.l2.store_policy,
                "l2_prefetch_policy": cfg.l2.prefetch_policy,
            },
            "active_prefetch_jobs": self.active_prefetch_jobs,
            // kvshard has no peer-to-peer lookups.
            "active_p2p_lookup_jobs": 0,
            "p2p_enabled": false,
            "p2p_state": "unregistered",
            "p2p_peer_count": 0,
            "p2p_peers": [],
            "worker_liveness": {
                "enabled": !cfg.worker_reap_timeout.is_zero(),
                "reap_timeout_seconds": cfg.worker_reap_timeout.as_secs_f64(),
                "registration_grace_seconds": cfg.worker_registration_grace.as_secs_f64(),
                "tracked_instances": self.liveness.len(),
            },
            // kvshard records no KV events (subscribe_kv_events is refused).
            "kv_events": {"enabled": false},
            "registered_gpu_ids": self.lmc_ids.iter().map(|i| i.0).collect::<Vec<i64>>(),
            "cache_context_meta": self.lmc_meta,
            "registered_non_cuda_instance_ids": self.engine_ids.iter().map(|i| i.0).collect::<Vec<i64>>(),
            "non_cuda_context_meta": self.engine_meta,
            // kvshard only from here: whether every shard serves from L1
            // (what /healthcheck answers), the server, its uptime, each
            // registered worker's liveness.
            "serving": alive,
            "server": "kvshard",
            "uptime_seconds": now.duration_since(self.started).as_secs_f64(),
            "worker_liveness_by_instance": liveness_by_instance,
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
        } else if let Some(a) = status["storage_manager"]["l2_adapters"]
            .as_array()
            .and_then(|a| a.iter().find(|a| a["is_healthy"] == false))
        {
            status["unhealthy_reason"] = format!(
                "L2 adapter {}: {}",
                a["name"].as_str().unwrap_or("?"),
                a["unhealthy_reason"].as_str().unwrap_or("unhealthy")
            )
            .into();
        }
        status
    }

    /// 0.5.6's `L1BackendType` of the arena: `dram`, `devdax` or `gds`.
    fn l1_backend(&self) -> &'static str {
        match self.arena["kind"].as_str() {
            Some("gds_slab") => "gds",
            // A DAX device, or a file standing in for one (--l1-devdax-path).
            Some("devdax" | "file") => "devdax",
            _ => "dram",
        }
    }

    /// 0.5.6's L2 eviction controller entries: one per adapter with an
    /// eviction policy, summed over shards.
    fn l2_eviction_status(&self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        for (i, spec) in self.cfg.l2.adapters.iter().enumerate() {
            let Some(e) = &spec.eviction else { continue };
            let usages: Vec<_> = self
                .reports
                .iter()
                .filter_map(|r| r.l2.get(i))
                .map(|t| &t.usage)
                .collect();
            let used: u64 = usages.iter().map(|u| u.used_bytes).sum();
            let capacity = spec.capacity_bytes();
            let salts: std::collections::BTreeSet<&String> =
                usages.iter().flat_map(|u| u.bytes_by_salt.keys()).collect();
            out.push(json!({
                "eviction_policy": e.policy.name(),
                "trigger_watermark": e.trigger_watermark,
                "eviction_ratio": e.eviction_ratio,
                // used / capacity, -1 without a capacity (0.5.6's "no signal").
                "current_usage": if capacity > 0 { used as f64 / capacity as f64 } else { -1.0 },
                "total_bytes_used": used,
                "total_capacity_bytes": capacity,
                "num_cache_salt_buckets": salts.len(),
            }));
        }
        out
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
                .all(|t| t.status["health"]["is_healthy"].as_bool().unwrap_or(true));
            // The first shard's reason, naming it.
            let cause = tiers.iter().enumerate().find_map(|(shard, t)| {
                t.status["health"]["cause"]
                    .as_str()
                    .map(|c| format!("shard {shard}: {c}"))
            });
            let mut v = json!({
                "is_healthy": healthy,
                "unhealthy_reason": cause,
                "type": adapter_class(spec),
                "name": kvshard_dataplane::shard::l2::tier_name(spec, i),
                "stored_object_count": keys,
                "current_size_bytes": used,
                "max_capacity_bytes": spec.capacity_bytes(),
                "eviction_policy": spec.eviction.as_ref().map(|e| e.policy.name()),
                "shards": tiers.iter().map(|t| t.status.clone()).collect::<Vec<_>>(),
            });
            match &spec.kind {
                kvshard_engine::l2::config::AdapterKind::Fs(f) => {
                    v["base_path"] = serde_json::Value::String(f.base_path.clone());
                    v["use_odirect"] = f.use_odirect.into();
                }
                kvshard_engine::l2::config::AdapterKind::S3(c) => {
                    // 0.5.6's report_status keys, summed over shards.
                    let shard_client = |k: &str| {
                        tiers
                            .iter()
                            .filter_map(|t| t.status["adapter"]["client"][k].as_u64())
                            .sum::<u64>()
                    };
                    // The client's breaker counts connection failures; the
                    // tier's gate counts requests that did not answer in time.
                    let disabled = tiers.iter().any(|t| {
                        t.status["adapter"]["client"]["breaker_open"] == true
                            || t.status["health"]["gate"]["closed"] == true
                    });
                    let timeouts: u64 = tiers
                        .iter()
                        .filter_map(|t| t.status["health"]["gate"]["consecutive_timeouts"].as_u64())
                        .sum();
                    v["endpoint"] = serde_json::Value::String(c.endpoint.clone());
                    v["region"] = serde_json::Value::String(c.region.clone());
                    v["connection_failures"] =
                        (shard_client("connection_failures") + timeouts).into();
                    v["connection_disabled"] = disabled.into();
                    if disabled {
                        v["is_healthy"] = false.into();
                    }
                }
                kvshard_engine::l2::config::AdapterKind::Resp(c) => {
                    let disabled = tiers.iter().any(|t| {
                        t.status["adapter"]["client"]["breaker_open"] == true
                            || t.status["health"]["gate"]["closed"] == true
                    });
                    let locked: u64 = tiers
                        .iter()
                        .filter_map(|t| t.status["adapter"]["locked_keys"].as_u64())
                        .sum();
                    v["nodes"] = c
                        .nodes
                        .iter()
                        .map(|(h, p)| format!("{h}:{p}"))
                        .collect::<Vec<_>>()
                        .into();
                    v["cluster_mode"] = c.cluster_mode.into();
                    v["locked_key_count"] = locked.into();
                    v["connection_disabled"] = disabled.into();
                    if disabled {
                        v["is_healthy"] = false.into();
                    }
                }
                kvshard_engine::l2::config::AdapterKind::Mock(_) => {
                    let locked: u64 = tiers
                        .iter()
                        .filter_map(|t| t.status["locked_keys"].as_u64())
                        .sum();
                    v["locked_key_count"] = locked.into();
                }
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

/// The class 0.5.6 names an adapter of this type by in `/status`
/// (`lmcache describe kvcache` shows it as the adapter's type).
fn adapter_class(spec: &kvshard_engine::l2::config::AdapterSpec) -> &'static str {
    match spec.kind {
        kvshard_engine::l2::config::AdapterKind::Mock(_) => "MockL2Adapter",
        kvshard_engine::l2::config::AdapterKind::Fs(_) => "FSL2Adapter",
        kvshard_engine::l2::config::AdapterKind::S3(_) => "S3L2Adapter",
        kvshard_engine::l2::config::AdapterKind::Resp(ref c) => match c.flavor {
            kvshard_engine::l2::config::RespFlavor::Resp => "NativeConnectorL2Adapter",
            kvshard_engine::l2::config::RespFlavor::Valkey => "ValkeyL2Adapter",
        },
    }
}

/// A duration as 0.5.6 reports a configured number of seconds: an integer
/// when it is whole.
fn seconds(d: std::time::Duration) -> serde_json::Value {
    if d.subsec_nanos() == 0 {
        d.as_secs().into()
    } else {
        d.as_secs_f64().into()
    }
}
