//! lmcache_driven transfers: REGISTER_KV_CACHE of CPU SHM caches, and STORE
//! and RETRIEVE, which the shards copy between the worker's blocks and L1.
//! CUDA registrations and transfers go on in `cuda.rs`.

use std::sync::Arc;
use std::time::Instant;

use kvshard_dataplane::messages::{ReplyTo, RetrieveItem, ShardOp, StoreOutcome};
use kvshard_engine::keys::{self, ObjectKey};
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_wire::{self as wire, InstanceId, IpcKey};

use super::engine_driven::first_chunk_of;
use super::inflight::{involved, InflightKind};
use super::lookup::KeyError;
use super::workers::{reserved_instance_id, writer_tag};
use super::Front;
use crate::registry::{LmcEntry, LmcTransfer};

/// A RETRIEVE's blocks and the worker's event.
pub(super) struct Transfer {
    pub(super) block_ids: Vec<Vec<i64>>,
    pub(super) event: Vec<u8>,
}

impl Front {
    /// STORE/RETRIEVE from an instance with no lmcache_driven registration:
    /// 0.5.6's `(b"", False)`. A refused GPU worker was told why once, at
    /// registration, so its transfers are logged at debug only.
    pub(super) fn reply_unregistered_transfer(&mut self, to: &ReplyTo, op: &str, iid: InstanceId) {
        let level = if self.refused.contains(iid) {
            Level::Debug
        } else {
            Level::Error
        };
        log_limited!(
            level,
            "{op}: no lmcache_driven registration for instance {iid}"
        );
        self.metrics.unregistered_instance += 1;
        self.reply(to, Some(wire::encode_store_reply(b"", false)))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn register_kv_cache(
        &mut self,
        iid: InstanceId,
        kv_cache: &[wire::IpcData],
        model_name: String,
        world_size: i64,
        engine_type: &str,
        layout_hints: &kvshard_wire::msgpack::Value,
        groups: &[wire::EngineGroupInfo],
        now: Instant,
    ) {
        if !self.cfg.transfer_mode.lmcache_driven_enabled() {
            log_limited!(Level::Error, "register_kv_cache from instance {iid}: lmcache_driven transfer is not enabled (--supported-transfer-mode {:?})", self.cfg.transfer_mode);
            return;
        }
        if let Some(e) = reserved_instance_id(iid) {
            self.metrics.bad_requests += 1;
            self.metrics.failed_registrations += 1;
            return log_limited!(Level::Error, "register_kv_cache refused: {e}");
        }
        if self.registry.touch_lmc(iid, now) {
            log_limited!(
                Level::Info,
                "lmcache_driven instance {iid} already registered; refreshing liveness"
            );
            return;
        }
        if self.cuda_regs.contains_key(&iid) {
            return log_limited!(
                Level::Info,
                "lmcache_driven CUDA instance {iid} is still being set up"
            );
        }
        let ws = match u32::try_from(world_size)
            .ok()
            .filter(|w| (1..=keys::MAX_WORLD_SIZE).contains(w))
        {
            Some(w) => w,
            None => {
                return log_limited!(
                    Level::Error,
                    "register_kv_cache from instance {iid}: world_size {world_size} is invalid"
                )
            }
        };
        if self.refuse_cuda(iid, kv_cache, &model_name, world_size, now) {
            return;
        }
        if kvshard_dataplane::cuda_refusal::cuda_descriptor(kv_cache).is_some() {
            return self.register_cuda(iid, kv_cache, model_name, ws, layout_hints, groups, now);
        }
        let reg = match crate::registry::open_cpu_shm(
            kv_cache,
            groups,
            layout_hints,
            engine_type,
            self.cfg.chunk_size,
            self.cfg.null_block_id,
            self.cfg.separate_object_groups,
        ) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                self.metrics.failed_registrations += 1;
                return log_limited!(
                    Level::Error,
                    "register_kv_cache from instance {iid} failed: {e}"
                );
            }
        };
        let layout = reg.object_layout();
        let object_groups = reg.object_groups().len();
        if let Err(e) = self
            .layouts
            .register_groups(&model_name, ws, reg.object_groups())
        {
            self.metrics.failed_registrations += 1;
            return log_limited!(Level::Error, "register_kv_cache from instance {iid}: {e}");
        }
        let entry = LmcEntry {
            model_name: model_name.clone(),
            world_size: ws,
            reg: LmcTransfer::CpuShm(reg),
            layout,
            last_seen: now,
            pinged: false,
            kv_ranks: Vec::new(),
        };
        if let Err(e) = self.registry.insert_lmc(iid, entry) {
            self.layouts.unregister(&model_name, ws);
            return log_limited!(Level::Error, "register_kv_cache: {e}");
        }
        log_limited!(Level::Info, "registered lmcache_driven cpu_shm instance {iid} (model={model_name}, world_size={ws}, {} layers, {} object groups)", kv_cache.len(), object_groups);
    }

    /// Per-chunk block id lists: for each chunk, every kernel group's
    /// `bpc[g]` ids end to end, each list checked by `validate`; or why the
    /// request's lists (one per kernel group) do not fit.
    pub(super) fn chunk_blocks<E: std::error::Error + Send + Sync + 'static>(
        bpc: &[usize],
        block_ids: &[Vec<i64>],
        num_chunks: usize,
        validate: impl Fn(&[i64]) -> Result<(), E>,
    ) -> Result<Vec<Vec<i64>>, ChunksError> {
        if block_ids.is_empty() {
            return Err(ChunksError::NoBlocks);
        }
        if block_ids.len() != bpc.len() {
            return Err(ChunksError::Groups {
                sent: block_ids.len(),
                registered: bpc.len(),
            });
        }
        for (group, (blocks, &per_chunk)) in block_ids.iter().zip(bpc).enumerate() {
            if blocks.len() < num_chunks * per_chunk {
                return Err(ChunksError::TooFewBlocks {
                    group,
                    have: blocks.len(),
                    chunks: num_chunks,
                    per_chunk,
                });
            }
        }
        let width: usize = bpc.iter().sum();
        let out: Vec<Vec<i64>> = (0..num_chunks)
            .map(|c| {
                let mut ids = Vec::with_capacity(width);
                for (blocks, &per_chunk) in block_ids.iter().zip(bpc) {
                    ids.extend_from_slice(&blocks[c * per_chunk..(c + 1) * per_chunk]);
                }
                ids
            })
            .collect();
        for b in &out {
            validate(b).map_err(|e| ChunksError::BadBlocks(Box::new(e)))?;
        }
        Ok(out)
    }

    /// The chunks of a transfer request: its object keys and their block
    /// lists, or the failure reply already sent.
    pub(super) fn transfer_chunks(
        &mut self,
        to: &ReplyTo,
        op: &str,
        iid: InstanceId,
        key: &IpcKey,
        block_ids: &[Vec<i64>],
        reg: &LmcTransfer,
    ) -> Option<(Vec<ObjectKey>, Vec<Vec<i64>>)> {
        let chunks = self
            .worker_keys(iid, key, self.clock.now())
            .map_err(ChunksError::Key)
            .and_then(|objs| {
                let blocks = match reg {
                    LmcTransfer::CpuShm(r) => {
                        let bpc: Vec<usize> = r
                            .kernel_groups()
                            .iter()
                            .map(|k| k.blocks_per_chunk)
                            .collect();
                        Self::chunk_blocks(&bpc, block_ids, objs.len(), |b| r.validate_block_ids(b))
                    }
                    LmcTransfer::Cuda(c) => {
                        Self::chunk_blocks(&c.blocks_per_chunk(), block_ids, objs.len(), |b| {
                            c.validate_block_ids(b)
                        })
                    }
                }?;
                Ok((objs, blocks))
            });
        match chunks {
            Ok(c) => Some(c),
            Err(e) => {
                log_limited!(Level::Error, "{op} from instance {iid}: {e}");
                self.metrics.bad_requests += 1;
                self.reply(to, Some(wire::encode_store_reply(b"", false)));
                None
            }
        }
    }

    pub(super) fn store(
        &mut self,
        to: ReplyTo,
        key: IpcKey,
        iid: InstanceId,
        block_ids: Vec<Vec<i64>>,
        event: Vec<u8>,
        now: Instant,
    ) {
        self.metrics.submitted_stores += 1;
        let Some((reg, _)) = self.registry.lmc_reg(iid, now) else {
            return self.reply_unregistered_transfer(&to, "store", iid);
        };
        let Some((objs, blocks)) = self.transfer_chunks(&to, "store", iid, &key, &block_ids, &reg)
        else {
            return;
        };
        // All-null chunks (every block of every group null) carry no KV
        // (align-mode recurrent layers): never store them. With object
        // groups, one object per chunk and group, left out where the
        // group's blocks are all null.
        let groups = reg.object_groups().len();
        let mut items = Vec::with_capacity(objs.len() * groups);
        for (key, b) in objs.into_iter().zip(blocks) {
            for og in 0..groups {
                if !reg.all_null_in(og, &b) {
                    let key = ObjectKey {
                        object_group_id: og as u32,
                        ..key
                    };
                    items.push((key, b.clone()));
                }
            }
        }
        let (objs, blocks): (Vec<ObjectKey>, Vec<Vec<i64>>) = items.into_iter().unzip();
        let parts = self.split(&objs);
        if self.refused(&to, involved(&parts)) {
            return self.reply_failure(&to);
        }
        let n = objs.len();
        let sizes = reg.object_sizes();
        let reg = match reg {
            LmcTransfer::CpuShm(reg) => reg,
            LmcTransfer::Cuda(_) => {
                let kind = InflightKind::CudaStore {
                    to,
                    iid,
                    keys: objs.clone(),
                    blocks,
                    event,
                    slabs: vec![None; n],
                };
                return self.reserve_writes(kind, &objs, sizes, iid);
            }
        };
        let kind = InflightKind::Store {
            to,
            outcomes: vec![StoreOutcome::AlreadyPresent; n],
        };
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::Store {
            reg: reg.clone(),
            items: idx.iter().map(|i| (objs[*i], blocks[*i].clone())).collect(),
            sizes: sizes.clone(),
            tag: writer_tag(iid),
        }) {
            self.complete(0, kind);
        }
    }

    pub(super) fn retrieve(
        &mut self,
        to: ReplyTo,
        key: IpcKey,
        iid: InstanceId,
        t: Transfer,
        skip: i64,
        now: Instant,
    ) {
        self.metrics.submitted_retrieves += 1;
        let Some((reg, _)) = self.registry.lmc_reg(iid, now) else {
            return self.reply_unregistered_transfer(&to, "retrieve", iid);
        };
        let Some((objs, blocks)) =
            self.transfer_chunks(&to, "retrieve", iid, &key, &t.block_ids, &reg)
        else {
            return;
        };
        let cs = self.cfg.chunk_size;
        let first = first_chunk_of(&key, cs);
        let skip = usize::try_from(skip).unwrap_or(0);
        // Per object: its chunk (of the request range). With object groups,
        // each group's objects of the chunks it needs: a sliding window of
        // `w` chunks reads the range's last `w` (0.5.6's `group_skips`).
        let (objs, chunk_of): (Vec<ObjectKey>, Vec<usize>) = match reg.object_groups() {
            ogs if ogs.len() > 1 => {
                let n = objs.len();
                let mut out = Vec::new();
                for (og, g) in ogs.iter().enumerate() {
                    for (c, key) in objs.iter().enumerate().skip(g.needed_from(n)) {
                        let key = ObjectKey {
                            object_group_id: og as u32,
                            ..*key
                        };
                        out.push((key, c));
                    }
                }
                out.into_iter().unzip()
            }
            _ => {
                let chunks = (0..objs.len()).collect();
                (objs, chunks)
            }
        };
        let parts = self.split(&objs);
        // Before the lease book hears of the locks this request releases.
        if self.refused(&to, involved(&parts)) {
            return self.reply_failure(&to);
        }
        let n = objs.len();
        let reg = match reg {
            LmcTransfer::CpuShm(reg) => reg,
            LmcTransfer::Cuda(_) => {
                // Each kernel group leaves the whole blocks these cover.
                let skips = chunk_of
                    .iter()
                    .map(|&c| kvshard_layout::geometry::chunk_skip_tokens(skip, c, cs))
                    .collect();
                // The lookup's read locks are released once the copies end.
                let chunks: Vec<usize> = chunk_of.iter().map(|c| first + c).collect();
                let take = self.hand_over_locks_at(&key.request_id, &chunks, &objs, iid);
                let kind = InflightKind::CudaRetrieve {
                    to,
                    iid,
                    keys: objs.clone(),
                    blocks: chunk_of.iter().map(|&c| blocks[c].clone()).collect(),
                    skips,
                    event: t.event,
                    slabs: vec![None; n],
                };
                if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::ReadLocked {
                    keys: idx.iter().map(|i| objs[*i]).collect(),
                    take: idx.iter().map(|i| take[*i]).collect(),
                }) {
                    self.complete(0, kind);
                }
                return;
            }
        };
        // The shard releases the one lock this transfer holds on each object
        // it finds read-locked: one of the lookup's, or one taken for it.
        let chunks: Vec<usize> = chunk_of.iter().map(|c| first + c).collect();
        let take = self.hand_over_locks_at(&key.request_id, &chunks, &objs, iid);
        let kind = InflightKind::Retrieve {
            to,
            oks: vec![false; n],
        };
        if let Some(kind) = self.fan_out(parts, kind, |idx| ShardOp::Retrieve {
            reg: reg.clone(),
            items: idx
                .iter()
                .map(|&i| RetrieveItem {
                    key: objs[i],
                    blocks: blocks[chunk_of[i]].clone(),
                    skip: kvshard_layout::geometry::chunk_skip_tokens(skip, chunk_of[i], cs),
                    take: take[i],
                })
                .collect(),
        }) {
            self.complete(0, kind);
        }
    }

    /// Answers a REGISTER_KV_CACHE. A CUDA registration is answered once its
    /// GPU's device thread has set it up (pinning the L1 can take seconds),
    /// as 0.5.6 answers after opening the handles: a STORE the worker sends
    /// on the answer finds the instance registered.
    pub(super) fn answer_registration(&mut self, to: ReplyTo, iid: InstanceId) {
        match self.cuda_regs.get_mut(&iid) {
            Some(p) => p.replies.push(to),
            None => self.reply(&to, None),
        }
    }

    /// UNREGISTER_KV_CACHE: forgets the instance (refused, being set up on
    /// its GPU, or registered) and releases what it held.
    pub(super) fn unregister_kv_cache(&mut self, iid: InstanceId) {
        let was_refused = self.refused.remove(iid).is_some();
        if let Some(p) = self.cuda_regs.remove(&iid) {
            // Still being set up: its device thread undoes it after.
            self.layouts.unregister(&p.model_name, p.world_size);
            self.cuda_unregister(iid, p.instance.ordinal);
            log_limited!(
                Level::Info,
                "unregistered lmcache_driven CUDA instance {iid} while it was being set up"
            );
            for waiting in &p.replies {
                self.reply(waiting, None);
            }
            return;
        }
        match self.registry.remove_lmc(iid) {
            Some(entry) => {
                log_limited!(Level::Info, "unregistered lmcache_driven instance {iid}");
                self.release_instance(crate::registry::Released::Lmc(iid, entry));
            }
            None if was_refused => {
                log_limited!(Level::Info, "unregistered refused GPU instance {iid}")
            }
            None => log_limited!(Level::Warn, "unregister: no lmcache_driven instance {iid}"),
        }
    }

    /// A STORE's copies into L1 came back: counted, and answered.
    pub(super) fn store_done(&mut self, to: &ReplyTo, outcomes: &[StoreOutcome]) {
        let count = |want: StoreOutcome| outcomes.iter().filter(|o| **o == want).count();
        let failed = count(StoreOutcome::Failed);
        let left_out = count(StoreOutcome::OutOfMemory);
        self.metrics.stored_chunks += count(StoreOutcome::Stored) as u64;
        self.metrics.finished_stores += 1;
        // 0.5.6 answers a STORE whose chunks partly found no L1 memory as a
        // success, leaving them out (lmcache_driven_transfer.py): the worker
        // recomputes them later. Counted and logged here.
        if failed == 0 && left_out > 0 {
            self.metrics.partial_stores += 1;
            self.metrics.store_chunks_left_out += left_out as u64;
            log_limited!(
                Level::Warn,
                "store: {left_out} of {} chunks found no L1 memory and were left out; \
                 answered as a success, as lmcache 0.5.6 does",
                outcomes.len()
            );
        }
        self.reply(to, Some(wire::encode_store_reply(b"", failed == 0)));
    }

    /// A RETRIEVE's copies out of L1 came back: counted, and answered.
    pub(super) fn retrieve_done(&mut self, to: &ReplyTo, oks: &[bool]) {
        let ok = oks.iter().all(|b| *b);
        self.metrics.finished_retrieves += 1;
        self.metrics.retrieved_chunks += oks.iter().filter(|b| **b).count() as u64;
        if !ok {
            self.metrics.retrieve_misses += 1;
        }
        self.reply(to, Some(wire::encode_store_reply(b"", ok)));
    }
}

/// Why a STORE or RETRIEVE names no chunks kvshard can copy.
#[derive(Debug)]
pub(super) enum ChunksError {
    Key(KeyError),
    NoBlocks,
    /// Not one block list per kernel group.
    Groups {
        sent: usize,
        registered: usize,
    },
    TooFewBlocks {
        group: usize,
        have: usize,
        chunks: usize,
        per_chunk: usize,
    },
    /// The registration refused a chunk's block ids.
    BadBlocks(Box<dyn std::error::Error + Send + Sync>),
}

impl std::fmt::Display for ChunksError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChunksError::Key(e) => e.fmt(f),
            ChunksError::NoBlocks => f.write_str("block_ids is empty"),
            ChunksError::Groups { sent, registered } => write!(
                f,
                "{sent} block id lists for a registration of {registered} kernel groups \
                 (one list per group)"
            ),
            ChunksError::TooFewBlocks {
                group,
                have,
                chunks,
                per_chunk,
            } => write!(
                f,
                "group {group}: {have} block ids for {chunks} chunks of {per_chunk} blocks"
            ),
            ChunksError::BadBlocks(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ChunksError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ChunksError::Key(e) => Some(e),
            ChunksError::BadBlocks(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}
