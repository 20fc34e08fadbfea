//! The HTTP API's requests (status, metrics, quotas, clear, checksums,
//! config), answered from the front's state and the shards' reports.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvshard_dataplane::messages::{ReplyTo, ShardOp, ShardReport};
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_layout::checksum::ChecksumRefusal;
use kvshard_messages::control::{ControlBody, ControlRequest, ControlResponse, Responder};
use kvshard_wire as wire;

use super::inflight::InflightKind;
use super::shard_link::Overflow;
use super::Front;
use crate::metrics::{FrontGauges, Metrics, PromText};
use crate::registry::LmcTransfer;
use crate::status::StatusSnapshot;

/// `/cache/checksums` computations running at once; one more is answered 503.
/// Each hashes a whole KV cache on a thread of its own.
pub(super) const MAX_CHECKSUM_THREADS: usize = 2;

pub(super) const GIB: f64 = (1u64 << 30) as f64;

/// Counts one running piece of work in a shared counter while it lives.
pub(super) struct RunningGuard(Arc<AtomicUsize>);

impl RunningGuard {
    pub(super) fn enter(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        RunningGuard(count.clone())
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Front {
    pub(super) fn clear(&mut self, to: Option<ReplyTo>, responder: Option<Responder>, force: bool) {
        if let Some(to) = &to {
            if self.refused(to, 0..self.shards.len()) {
                return self.reply_failure(to);
            }
        }
        if force {
            // Locked objects go too: a lock on a key stored again later is
            // nobody's here.
            self.leases.clear();
        }
        self.broadcast(
            InflightKind::Clear {
                to,
                responder,
                cleared: 0,
            },
            || ShardOp::Clear { force },
        );
    }

    pub(super) fn control(&mut self, req: ControlRequest, responder: Responder) {
        match req {
            ControlRequest::Clear { force } => self.clear(None, Some(responder), force),
            ControlRequest::Status
            | ControlRequest::Metrics
            | ControlRequest::QuotaGet { .. }
            | ControlRequest::QuotaList => {
                let n = self.shards.len();
                self.broadcast(
                    InflightKind::Reports {
                        request: req,
                        responder,
                        reports: vec![None; n],
                    },
                    || ShardOp::Status,
                );
            }
            ControlRequest::ResetMetrics => {
                self.metrics = Metrics::default();
                self.post_all(|| ShardOp::ResetStats);
                responder.send(ControlResponse::json(serde_json::json!({"status": "ok"})));
            }
            ControlRequest::QuotaSet {
                cache_salt,
                limit_gb,
            } => {
                // A salt no request could carry names no cache; the table is
                // bounded so that an admin loop cannot grow it (and /quota) without end.
                if let Err(e) = wire::check_cache_salt(&cache_salt) {
                    return responder.send(ControlResponse::bad_request(e));
                }
                if !self.quotas.contains_key(&cache_salt)
                    && self.quotas.len() >= self.cfg.max_quotas
                {
                    log_limited!(
                        Level::Warn,
                        "PUT /quota refused: {} salts hold quotas, the bound of --max-quotas",
                        self.quotas.len()
                    );
                    return responder.send(ControlResponse::bad_request(format!(
                        "{} cache salts already hold quotas, the most --max-quotas allows; \
                         delete one first, or raise --max-quotas",
                        self.quotas.len()
                    )));
                }
                // Python's int() truncates; `as` does too, saturating at u64::MAX.
                let limit_bytes = (limit_gb * GIB) as u64;
                let per_shard = limit_bytes / self.shards.len() as u64;
                self.quotas.insert(cache_salt.clone(), limit_bytes);
                let salt = cache_salt.clone();
                self.post_all(move || ShardOp::SetQuota {
                    cache_salt: salt.clone(),
                    limit_bytes: per_shard,
                });
                responder.send(ControlResponse::json(serde_json::json!({"cache_salt": cache_salt, "limit_gb": limit_gb, "status": "ok"})));
            }
            ControlRequest::QuotaDelete { cache_salt } => {
                let existed = self.quotas.shift_remove(&cache_salt).is_some();
                let salt = cache_salt.clone();
                self.post_all(move || ShardOp::RemoveQuota {
                    cache_salt: salt.clone(),
                });
                let status = if existed { "removed" } else { "not_found" };
                responder.send(ControlResponse::json(
                    serde_json::json!({"cache_salt": cache_salt, "status": status}),
                ));
            }
            ControlRequest::Checksums {
                instance_id,
                block_ids,
                chunk_size_blocks,
                layerwise,
            } => {
                // Hashing a whole KV cache takes a while: keep it off the
                // request path, on at most MAX_CHECKSUM_THREADS threads.
                let work: Box<
                    dyn FnOnce()
                            -> Result<kvshard_layout::checksum::ChecksumReport, ChecksumRefusal>
                        + Send,
                > = match self.registry.lmc_reg(instance_id, self.clock.now()) {
                    None => {
                        return responder.send(ControlResponse::error(
                            404,
                            format!("instance_id {instance_id} not registered"),
                        ))
                    }
                    // Each block is read and hashed on every layer: bound what
                    // one request can make a checksum thread do.
                    Some(_) if block_ids.len() > self.cfg.max_checksum_blocks => {
                        return responder.send(ControlResponse::error(
                            400,
                            format!(
                                "{} block_ids asked for, more than the {} one request may \
                                 name (--max-checksum-blocks); split the request",
                                block_ids.len(),
                                self.cfg.max_checksum_blocks
                            ),
                        ))
                    }
                    Some((LmcTransfer::Cuda(c), _)) => {
                        let plan = match c.checksum_plan(&block_ids, chunk_size_blocks, layerwise) {
                            Ok(p) => p,
                            Err(r) => {
                                return responder.send(ControlResponse::error(r.status, r.detail))
                            }
                        };
                        let Some(exec) = self.cuda_threads.clone() else {
                            return responder.send(ControlResponse::error(
                                503,
                                "no CUDA device thread is running".to_string(),
                            ));
                        };
                        Box::new(move || {
                            kvshard_dataplane::cuda_transfer::run_checksums(
                                &exec,
                                c.ordinal,
                                instance_id,
                                plan,
                            )
                            .map_err(|e| ChecksumRefusal {
                                status: 500,
                                detail: e.to_string(),
                            })
                        })
                    }
                    Some((LmcTransfer::CpuShm(reg), _)) => {
                        if let Err(r) = reg.checksum_check(&block_ids, chunk_size_blocks) {
                            return responder.send(ControlResponse::error(r.status, r.detail));
                        }
                        Box::new(move || reg.checksums(&block_ids, chunk_size_blocks, layerwise))
                    }
                };
                if self.checksum_threads.load(Ordering::SeqCst) >= MAX_CHECKSUM_THREADS {
                    log_limited!(
                        Level::Warn,
                        "/cache/checksums refused: {MAX_CHECKSUM_THREADS} are already running"
                    );
                    return responder.send(ControlResponse::error(
                        503,
                        format!(
                            "{MAX_CHECKSUM_THREADS} checksum computations are already running \
                             (the most kvshard runs at once); retry when one has finished"
                        ),
                    ));
                }
                // Only this thread increments; the checksum thread
                // decrements when it ends (or never starts).
                let running = RunningGuard::enter(&self.checksum_threads);
                let spawned = std::thread::Builder::new()
                    .name("kvshard-checksums".into())
                    .spawn(move || {
                        let _running = running;
                        responder.send(match work() {
                            Ok(report) => ControlResponse::json(
                                serde_json::to_value(&report).unwrap_or(serde_json::Value::Null),
                            ),
                            Err(r) => ControlResponse::error(r.status, r.detail),
                        });
                    });
                if let Err(e) = spawned {
                    // The closure (guard and responder with it) is
                    // dropped: the HTTP side answers 503.
                    log_limited!(Level::Error, "cannot start a checksum thread: {e}");
                }
            }
            ControlRequest::Config => {
                let v = serde_json::to_value(&*self.cfg).unwrap_or(serde_json::Value::Null);
                responder.send(ControlResponse::json(v));
            }
            ControlRequest::ConfigAdapters => {
                let adapters: Vec<serde_json::Value> = self
                    .cfg
                    .l2
                    .adapters
                    .iter()
                    .enumerate()
                    .map(|(i, spec)| {
                        serde_json::json!({
                            "index": i,
                            "name": kvshard_dataplane::shard::l2::tier_name(spec, i),
                            "type_name": spec.type_name(),
                            "tier": "l2",
                            "primary": i == 0,
                            "reconfigurable": false,
                            "config": spec.json,
                        })
                    })
                    .collect();
                responder.send(ControlResponse::json(
                    serde_json::json!({ "adapters": adapters }),
                ));
            }
        }
    }

    pub(super) fn answer_reports(
        &self,
        req: &ControlRequest,
        reports: Vec<ShardReport>,
    ) -> ControlResponse {
        match req {
            // Both are rendered by the HTTP side from a snapshot taken here.
            ControlRequest::Status => {
                let snapshot = self.status_snapshot(reports);
                ControlResponse::render(move || ControlBody::Json(snapshot.render()))
            }
            ControlRequest::Metrics => {
                let mut metrics = self.metrics.clone();
                metrics.token_arrays_copied = self.token_cache.hits;
                metrics.token_arrays_decoded = self.token_cache.misses;
                metrics.shard_wakeups = self.shards.iter().map(|s| s.wakeups()).sum();
                let gauges = FrontGauges {
                    sessions: self.sessions.len(),
                    jobs: self.jobs.len(),
                    leases: self.leases.len(),
                    refused_gpu_instances: self.refused.len(),
                    dead_shards: self.dead.iter().filter(|d| **d).count(),
                    overflow_queued: self.overflow.iter().map(Overflow::len).sum(),
                };
                ControlResponse::render(move || {
                    let mut t = PromText::default();
                    metrics.render(&mut t, &reports, gauges);
                    ControlBody::Text(t.finish())
                })
            }
            ControlRequest::QuotaGet { cache_salt } => {
                let usage = self.salt_usage(&reports, cache_salt);
                let limit = self.quotas.get(cache_salt);
                ControlResponse::json(serde_json::json!({
                    "cache_salt": cache_salt,
                    "limit_gb": limit.map_or(0.0, |&b| b as f64 / GIB),
                    "current_usage_gb": usage as f64 / GIB,
                    "exists": limit.is_some(),
                }))
            }
            ControlRequest::QuotaList => {
                let mut users = serde_json::Map::new();
                for (salt, limit) in &self.quotas {
                    let usage = self.salt_usage(&reports, salt);
                    users.insert(salt.clone(), serde_json::json!({"limit_gb": *limit as f64 / GIB, "current_usage_gb": usage as f64 / GIB}));
                }
                ControlResponse::json(serde_json::json!({ "users": users }))
            }
            _ => ControlResponse::error(500, "unexpected report request"),
        }
    }

    /// Bytes a cache_salt holds: in the L2 adapters (as 0.5.6 counts quota
    /// usage), or in L1 when there is no L2 tier.
    pub(super) fn salt_usage(&self, reports: &[ShardReport], salt: &str) -> u64 {
        if self.cfg.l2.adapters.is_empty() {
            return reports
                .iter()
                .flat_map(|r| r.bytes_by_salt.iter())
                .filter(|(s, _)| s == salt)
                .map(|(_, b)| *b)
                .sum();
        }
        reports
            .iter()
            .flat_map(|r| r.l2.iter())
            .filter_map(|t| t.usage.bytes_by_salt.get(salt))
            .sum()
    }

    /// What `/status` shows, as of now.
    pub(super) fn status_snapshot(&self, reports: Vec<ShardReport>) -> StatusSnapshot {
        let now = self.clock.now();
        StatusSnapshot {
            taken_at: now,
            started: self.started,
            cfg: self.cfg.clone(),
            reports,
            num_shards: self.shards.len(),
            huge_pages: self.setup.huge_pages.as_str(),
            huge_page_bytes: self.setup.huge_page_bytes,
            arena: self.setup.arena.clone(),
            active_sessions: self.sessions.len(),
            active_prefetch_jobs: self.jobs.len(),
            inflight_loads: self.loads_inflight,
            queued_loads: self.load_queue.len(),
            lmc_ids: self.registry.lmc_ids(),
            lmc_meta: self.registry.lmc_meta(),
            engine_ids: self.registry.engine_ids(),
            engine_meta: self.registry.engine_meta(),
            liveness: self.registry.liveness(),
            refused_gpu_instances: self.refused.to_json(now),
            dead: self.dead.clone(),
            overflow_bound: self.overflow_bound,
            overflow_queued: self.overflow.iter().map(Overflow::len).collect(),
        }
    }

    /// Every shard cleared its L1: the client and the HTTP caller are
    /// answered.
    pub(super) fn cleared(
        &mut self,
        to: Option<ReplyTo>,
        responder: Option<Responder>,
        cleared: u64,
    ) {
        log_limited!(Level::Info, "cleared {cleared} L1 objects");
        if let Some(to) = to {
            self.reply(&to, None);
        }
        if let Some(r) = responder {
            r.send(ControlResponse::json(
                serde_json::json!({"status": "ok", "cleared": {"tier": "l1"}}),
            ));
        }
    }
}
