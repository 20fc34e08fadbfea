//! lmcache_driven CUDA workers: the refusal of those kvshard cannot serve,
//! set-up on the GPU's device thread, and STORE and RETRIEVE as copies the
//! device thread runs between the worker's GPU blocks and L1.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_dataplane::cuda_refusal::{Alternatives, CudaGate, CudaHost, Refusal, RefusedEntry};
use kvshard_dataplane::cuda_transfer::{CudaExecutor, CudaOp, PendingRegistration};
use kvshard_dataplane::messages::{CudaEvent, FrontEvent, ReplyTo, ShardOp};
use kvshard_engine::keys::ObjectKey;
use kvshard_engine::slab::Slab;
use kvshard_gds::device::worker::{ChunkCopy, CopyDir, DeviceJob};
use kvshard_gds::device::WorkerError;
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_wire as wire;
use kvshard_wire::InstanceId;

use super::workers::writer_tag;
use super::Front;
use crate::registry::{LmcEntry, LmcTransfer};

/// What a CUDA RETRIEVE's shards found read-locked.
pub(super) struct CudaFound {
    pub(super) keys: Vec<ObjectKey>,
    pub(super) slabs: Vec<Option<Slab>>,
}

/// How long a REGISTER_KV_CACHE waits for its GPU's device thread to set the
/// instance up before it is answered anyway (a driver call that never
/// returns must not hang the worker; its transfers fail until it is done).
pub(super) const CUDA_SETUP_ANSWER: Duration = Duration::from_secs(60);

/// Why a CUDA STORE or RETRIEVE failed.
#[derive(Debug)]
pub(super) enum CudaOpError {
    /// The worker's event handle is not CUDA's 64 bytes (81 with
    /// `--isolated-ipc`).
    EventHandleLength { len: usize, isolated_ipc: bool },
    /// The GPU's device thread handed the job back.
    NotTakingWork { ordinal: usize },
    /// The instance was unregistered before its retrieve could start.
    NoLongerRegistered { iid: InstanceId },
    /// The L1 is not in host memory.
    L1NotInMemory,
    /// Some of a retrieve's chunks were not read-locked by its lookup.
    NotReadLocked { missing: usize, chunks: usize },
    /// The device thread ran the job and it failed.
    Device(WorkerError),
}

impl std::fmt::Display for CudaOpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CudaOpError::EventHandleLength {
                len,
                isolated_ipc: false,
            } => write!(
                f,
                "the worker sent a {len}-byte event handle where CUDA's are 64 bytes{}",
                if *len == 81 {
                    " (81 bytes is lmcache's isolated_ipc timeline-semaphore form: start \
                     kvshard with --isolated-ipc, as the worker runs with \
                     lmcache.mp.isolated_ipc)"
                } else {
                    ""
                }
            ),
            CudaOpError::EventHandleLength {
                len,
                isolated_ipc: true,
            } => write!(
                f,
                "the worker sent a {len}-byte event handle where --isolated-ipc's \
                 timeline-semaphore events are 81 bytes{}",
                if *len == 64 {
                    " (64 bytes is a CUDA IPC event handle: the worker does not run with \
                     lmcache.mp.isolated_ipc; start kvshard without --isolated-ipc)"
                } else {
                    ""
                }
            ),
            CudaOpError::NotTakingWork { ordinal } => write!(
                f,
                "the CUDA device thread of GPU {ordinal} is not taking work"
            ),
            CudaOpError::NoLongerRegistered { iid } => {
                write!(f, "instance {iid} is no longer registered")
            }
            CudaOpError::L1NotInMemory => write!(f, "the L1 is not in memory"),
            CudaOpError::NotReadLocked { missing, chunks } => write!(
                f,
                "{missing} of {chunks} chunks are not read-locked by a lookup"
            ),
            CudaOpError::Device(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for CudaOpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CudaOpError::Device(e) => Some(e),
            _ => None,
        }
    }
}

impl Front {
    /// Refuses a registration carrying CUDA descriptors (true), recording the
    /// instance so its PINGs report it unhealthy; a repeat only refreshes it.
    pub(super) fn refuse_cuda(
        &mut self,
        iid: InstanceId,
        kv_cache: &[wire::IpcData],
        model_name: &str,
        world_size: i64,
        now: Instant,
    ) -> bool {
        if kvshard_dataplane::cuda_refusal::cuda_descriptor(kv_cache).is_none() {
            return false;
        }
        if self.refused.touch(iid, now) {
            return true;
        }
        let host = self.cuda_host.get_or_insert_with(CudaHost::probe);
        let alt = Alternatives {
            shm_name: self.setup.shm_pool.as_ref().map(|(n, _)| n.as_str()),
            engine_driven_enabled: self.cfg.transfer_mode.engine_driven_enabled(),
        };
        let gate = match (self.cfg.cuda_transfer, &self.setup.l1_memory) {
            (false, _) => CudaGate::Off,
            (true, None) => CudaGate::SlabL1,
            (true, Some(_)) => CudaGate::On,
        };
        let Some(refusal) = kvshard_dataplane::cuda_refusal::check(kv_cache, host, alt, gate)
        else {
            return false;
        };
        self.refuse_with(iid, refusal, model_name, world_size, now);
        true
    }

    /// Records GPU instance `iid` as refused (its PINGs then answer False).
    pub(super) fn refuse_with(
        &mut self,
        iid: InstanceId,
        refusal: Refusal,
        model_name: &str,
        world_size: i64,
        now: Instant,
    ) {
        self.metrics.failed_registrations += 1;
        self.metrics.refused_cuda_registrations += 1;
        log_limited!(
            Level::Error,
            "register_kv_cache from GPU instance {iid} (model={model_name}, world_size={world_size}, {} descriptors) refused: {}",
            refusal.descriptor,
            refusal.reason
        );
        self.refused.insert(
            iid,
            RefusedEntry {
                model_name: model_name.to_owned(),
                world_size,
                descriptor: refusal.descriptor,
                reason: refusal.reason,
                last_seen: now,
            },
        );
    }

    /// Hands a CUDA registration to its GPU's device thread; the answer
    /// comes back as [`CudaEvent::Registered`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn register_cuda(
        &mut self,
        iid: InstanceId,
        kv_cache: &[wire::IpcData],
        model_name: String,
        ws: u32,
        layout_hints: &kvshard_wire::msgpack::Value,
        groups: &[wire::EngineGroupInfo],
        now: Instant,
    ) {
        let descriptor =
            kvshard_dataplane::cuda_refusal::cuda_descriptor(kv_cache).unwrap_or("cuda");
        let (Some(CudaHost::Present(env)), Some(mem)) = (&self.cuda_host, &self.setup.l1_memory)
        else {
            // refuse_cuda took every other case.
            return;
        };
        let (env, mem) = (env.clone(), mem.clone());
        let refuse = |reason: String| Refusal { descriptor, reason };
        let built = kvshard_dataplane::cuda_transfer::build(
            kv_cache,
            groups,
            layout_hints,
            self.cfg.chunk_size,
            self.cfg.null_block_id,
            &env.devices,
            self.cfg.isolated_ipc,
            self.cfg.separate_object_groups,
        );
        let (instance, spec) = match built {
            Ok(b) => b,
            Err(e) => return self.refuse_with(iid, refuse(e), &model_name, ws as i64, now),
        };
        if let Err(e) = self
            .layouts
            .register_groups(&model_name, ws, instance.object_groups())
        {
            return self.refuse_with(iid, refuse(e.to_string()), &model_name, ws as i64, now);
        }
        if self.cuda_threads.is_none() {
            match CudaExecutor::start(env, &mem) {
                Ok(x) => self.cuda_threads = Some(Arc::new(x)),
                Err(e) => {
                    self.layouts.unregister(&model_name, ws);
                    return self.refuse_with(
                        iid,
                        refuse(e.to_string()),
                        &model_name,
                        ws as i64,
                        now,
                    );
                }
            }
        }
        let Some(threads) = &self.cuda_threads else {
            return;
        };
        let tx = self.setup.events.clone();
        let job = DeviceJob::Register {
            iid: iid.0,
            spec,
            done: Box::new(move |result| {
                tx.send(FrontEvent::Cuda(CudaEvent::Registered { iid, result }));
            }),
        };
        let ordinal = instance.ordinal;
        if threads.submit(ordinal, job).is_err() {
            self.layouts.unregister(&model_name, ws);
            let reason =
                format!("the CUDA device thread of GPU {ordinal} is not taking work (see the log)");
            return self.refuse_with(iid, refuse(reason), &model_name, ws as i64, now);
        }
        log_limited!(
            Level::Info,
            "setting up lmcache_driven CUDA instance {iid} (model={model_name}, world_size={ws}, {} layers, GPU {ordinal})",
            kv_cache.len()
        );
        self.cuda_regs.insert(
            iid,
            PendingRegistration {
                model_name,
                world_size: ws,
                descriptor,
                instance,
                replies: Vec::new(),
                since: now,
            },
        );
    }

    pub(super) fn on_cuda_event(&mut self, ev: CudaEvent) {
        let now = self.clock.now();
        match ev {
            CudaEvent::Registered { iid, result } => {
                let Some(mut p) = self.cuda_regs.remove(&iid) else {
                    // Unregistered while it was being set up: undone already.
                    return;
                };
                let replies = std::mem::take(&mut p.replies);
                self.finish_cuda_registration(iid, p, result, now);
                for to in &replies {
                    self.reply(to, None);
                }
            }
            CudaEvent::Transferred { seq, result } => match self.cuda_ops.remove(&seq) {
                Some(op) => self.finish_cuda_op(op, result.map_err(CudaOpError::Device)),
                None => log_limited!(
                    Level::Error,
                    "CUDA transfer {seq} finished but nobody waits for it"
                ),
            },
        }
    }

    /// Answers the REGISTER_KV_CACHE requests of set-ups that have taken
    /// longer than [`CUDA_SETUP_ANSWER`].
    pub(super) fn answer_slow_cuda_setups(&mut self, now: Instant) {
        let mut late = Vec::new();
        for (iid, p) in &mut self.cuda_regs {
            if !p.replies.is_empty() && now.duration_since(p.since) >= CUDA_SETUP_ANSWER {
                late.push((*iid, std::mem::take(&mut p.replies)));
            }
        }
        for (iid, replies) in late {
            log_limited!(
                Level::Warn,
                "lmcache_driven CUDA instance {iid} is still being set up after {} s; its \
                 registration is answered now and its transfers fail until the set-up ends",
                CUDA_SETUP_ANSWER.as_secs()
            );
            for to in &replies {
                self.reply(to, None);
            }
        }
    }

    /// Registers (or refuses) a CUDA instance whose set-up on its GPU ended.
    pub(super) fn finish_cuda_registration(
        &mut self,
        iid: InstanceId,
        p: PendingRegistration,
        result: Result<(), WorkerError>,
        now: Instant,
    ) {
        let ordinal = p.instance.ordinal;
        if let Err(e) = result {
            self.layouts.unregister(&p.model_name, p.world_size);
            let refusal = Refusal {
                descriptor: p.descriptor,
                reason: format!("setting it up on GPU {ordinal} failed: {e}"),
            };
            return self.refuse_with(iid, refusal, &p.model_name, p.world_size as i64, now);
        }
        let entry = LmcEntry {
            model_name: p.model_name.clone(),
            world_size: p.world_size,
            layout: p.instance.layout(),
            reg: LmcTransfer::Cuda(Arc::new(p.instance)),
            last_seen: now,
            pinged: false,
            kv_ranks: Vec::new(),
        };
        if let Err(e) = self.registry.insert_lmc(iid, entry) {
            self.layouts.unregister(&p.model_name, p.world_size);
            self.cuda_unregister(iid, ordinal);
            return log_limited!(Level::Error, "register_kv_cache: {e}");
        }
        log_limited!(
            Level::Info,
            "registered lmcache_driven CUDA instance {iid} (model={}, world_size={}, GPU {ordinal})",
            p.model_name,
            p.world_size
        );
    }

    /// Drops instance `iid` on its device thread (after its queued work).
    pub(super) fn cuda_unregister(&mut self, iid: InstanceId, ordinal: usize) {
        if let Some(threads) = &self.cuda_threads {
            if threads
                .submit(ordinal, DeviceJob::Unregister { iid: iid.0 })
                .is_err()
            {
                log_limited!(
                    Level::Error,
                    "cannot release CUDA instance {iid} on GPU {ordinal}: its device thread is not taking work"
                );
            }
        }
    }

    /// Queues a transfer's copies; `op` is finished when they end.
    pub(super) fn submit_cuda_transfer(
        &mut self,
        ordinal: usize,
        iid: InstanceId,
        dir: CopyDir,
        event: Vec<u8>,
        chunks: Vec<ChunkCopy>,
        op: CudaOp,
    ) {
        let expected = if self.cfg.isolated_ipc { 81 } else { 64 };
        if !event.is_empty() && event.len() != expected {
            let e = CudaOpError::EventHandleLength {
                len: event.len(),
                isolated_ipc: self.cfg.isolated_ipc,
            };
            return self.finish_cuda_op(op, Err(e));
        }
        let seq = self.alloc_seq();
        let tx = self.setup.events.clone();
        let job = DeviceJob::Transfer {
            iid: iid.0,
            dir,
            worker_event: (!event.is_empty()).then_some(event),
            chunks,
            done: Box::new(move |result| {
                tx.send(FrontEvent::Cuda(CudaEvent::Transferred { seq, result }));
            }),
        };
        let submitted = match &self.cuda_threads {
            Some(t) => t.submit(ordinal, job).is_ok(),
            None => false,
        };
        if submitted {
            self.cuda_ops.insert(seq, op);
        } else {
            self.finish_cuda_op(op, Err(CudaOpError::NotTakingWork { ordinal }));
        }
    }

    /// Settles a CUDA transfer: commits or releases what it held, and answers.
    pub(super) fn finish_cuda_op(&mut self, op: CudaOp, result: Result<Vec<u8>, CudaOpError>) {
        match op {
            CudaOp::Store { to, iid, keys } => {
                self.metrics.finished_stores += 1;
                let reply = match result {
                    Ok(handle) => {
                        self.metrics.stored_chunks += keys.len() as u64;
                        // Posted before the reply: a lookup sent after the
                        // reply reaches each shard after its commit.
                        self.post(keys, |keys| ShardOp::FinishWrite {
                            keys,
                            tag: writer_tag(iid),
                        });
                        wire::encode_store_reply(&handle, true)
                    }
                    Err(e) => {
                        log_limited!(Level::Error, "store from CUDA instance {iid} failed: {e}");
                        self.post(keys, |keys| ShardOp::AbortWrite {
                            keys,
                            tag: writer_tag(iid),
                        });
                        wire::encode_store_reply(b"", false)
                    }
                };
                self.reply(&to, Some(reply));
            }
            CudaOp::Retrieve { to, iid, locked } => {
                self.metrics.finished_retrieves += 1;
                let n = locked.len() as u64;
                self.post(locked, |keys| ShardOp::Release { keys, count: 1 });
                let reply = match result {
                    Ok(handle) => {
                        self.metrics.retrieved_chunks += n;
                        wire::encode_store_reply(&handle, true)
                    }
                    Err(e) => {
                        log_limited!(
                            Level::Error,
                            "retrieve from CUDA instance {iid} failed: {e}"
                        );
                        self.metrics.retrieve_misses += 1;
                        wire::encode_store_reply(b"", false)
                    }
                };
                self.reply(&to, Some(reply));
            }
        }
    }

    /// A CUDA STORE's objects are reserved: copy into the reserved ones.
    pub(super) fn cuda_store_reserved(
        &mut self,
        to: ReplyTo,
        iid: InstanceId,
        keys: Vec<ObjectKey>,
        blocks: Vec<Vec<i64>>,
        event: Vec<u8>,
        slabs: Vec<Option<Slab>>,
    ) {
        let (Some(mem), Some(ordinal)) = (
            self.setup.l1_memory.as_ref().map(|m| m.base),
            self.cuda_ordinal(iid),
        ) else {
            let reserved: Vec<ObjectKey> = keys
                .into_iter()
                .zip(&slabs)
                .filter(|(_, s)| s.is_some())
                .map(|(k, _)| k)
                .collect();
            self.post(reserved, |keys| ShardOp::AbortWrite {
                keys,
                tag: writer_tag(iid),
            });
            return self.reply_unregistered_transfer(&to, "store", iid);
        };
        let mut chunks = Vec::new();
        let mut reserved = Vec::new();
        for ((key, block_ids), slab) in keys.into_iter().zip(blocks).zip(slabs) {
            // Not reserved: already resident (or no room, as 0.5.6 skips it).
            if let Some(slab) = slab {
                chunks.push(ChunkCopy {
                    object_group: key.object_group_id as usize,
                    host_addr: mem + slab.offset as usize,
                    block_ids,
                    skip_tokens: 0,
                });
                reserved.push(key);
            }
        }
        if chunks.is_empty() {
            self.metrics.finished_stores += 1;
            return self.reply(&to, Some(wire::encode_store_reply(b"", true)));
        }
        let op = CudaOp::Store {
            to,
            iid,
            keys: reserved,
        };
        self.submit_cuda_transfer(ordinal, iid, CopyDir::ToHost, event, chunks, op);
    }

    /// A CUDA RETRIEVE found its objects: copy them if every one is
    /// read-locked, else fail and give back the locks it found.
    pub(super) fn cuda_retrieve_locked(
        &mut self,
        to: ReplyTo,
        iid: InstanceId,
        found: CudaFound,
        blocks: Vec<Vec<i64>>,
        skips: Vec<usize>,
        event: Vec<u8>,
    ) {
        let CudaFound { keys, slabs } = found;
        let locked: Vec<ObjectKey> = keys
            .iter()
            .zip(&slabs)
            .filter(|(_, s)| s.is_some())
            .map(|(k, _)| *k)
            .collect();
        let missing = keys.len() - locked.len();
        let target = match (
            self.setup.l1_memory.as_ref().map(|m| m.base),
            self.cuda_ordinal(iid),
        ) {
            (_, None) => Err(CudaOpError::NoLongerRegistered { iid }),
            (None, _) => Err(CudaOpError::L1NotInMemory),
            _ if missing > 0 => Err(CudaOpError::NotReadLocked {
                missing,
                chunks: keys.len(),
            }),
            (Some(base), Some(ordinal)) => Ok((base, ordinal)),
        };
        let (base, ordinal) = match target {
            Ok(t) => t,
            Err(e) => {
                let op = CudaOp::Retrieve { to, iid, locked };
                return self.finish_cuda_op(op, Err(e));
            }
        };
        let chunks = slabs
            .into_iter()
            .zip(&keys)
            .zip(blocks)
            .zip(skips)
            .map(|(((slab, key), block_ids), skip_tokens)| ChunkCopy {
                object_group: key.object_group_id as usize,
                host_addr: base + slab.map_or(0, |s| s.offset as usize),
                block_ids,
                skip_tokens,
            })
            .collect();
        let op = CudaOp::Retrieve { to, iid, locked };
        self.submit_cuda_transfer(ordinal, iid, CopyDir::ToDevice, event, chunks, op);
    }

    /// The GPU of a registered CUDA instance.
    pub(super) fn cuda_ordinal(&mut self, iid: InstanceId) -> Option<usize> {
        match self.registry.lmc_reg(iid, self.clock.now()) {
            Some((LmcTransfer::Cuda(c), _)) => Some(c.ordinal),
            _ => None,
        }
    }
}
