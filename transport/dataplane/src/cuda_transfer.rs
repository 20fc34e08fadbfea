//! lmcache_driven transfers for GPU workers: the CUDA IPC path
//! (`--cuda-transfer on`).
//!
//! A GPU worker registers its per-layer paged KV tensors with `cuda`,
//! `cuda_raw` or `cuda_vmm` descriptors. This module turns such a
//! registration into the device thread's [`InstanceSpec`]: the same layout
//! detection as the cpu_shm path ([`DeviceGeometry`]), the copy kernel's
//! stride table, and where each layer's first element sits in the memory the
//! worker shares. The front then drives the transfers (see the control
//! crate's `front/cuda.rs`):
//!
//! - STORE: reserve the chunks' L1 objects on their shards, hand the device
//!   thread the objects' host addresses and the worker's blocks, and once it
//!   reports the copies complete, finish the writes and answer with the
//!   exported event. The reply follows completion, so a stored chunk is
//!   visible to the next lookup (0.5.6 answers first and commits later).
//! - RETRIEVE: look up the read-locked objects, have the device thread
//!   scatter them, then release the lookup's read locks.
//!
//! Nothing here touches CUDA: the device threads own every driver call.

use std::fmt;
use std::sync::Arc;

use kvshard_gds::cuda::{CudaDevice, CudaEnv};
#[cfg(debug_assertions)]
use kvshard_gds::device::emulated::{self, EmulatedDevice};
use kvshard_gds::device::event::IpcEventHandle;
use kvshard_gds::device::ipc::{FabricHandle, IpcMemHandle};
use kvshard_gds::device::worker::{
    DeviceJob, DeviceThreads, GroupSpec, InstanceSpec, LayerMemory, LayerRead, LayerSpec,
    ObjectGroupSpec,
};
use kvshard_gds::device::WorkerError;

use crate::cuda_refusal::{parse_torch_handle, TorchHandle};
use kvshard_layout::checksum::{
    checksum_axis, digest_kv, index_select_runs, ChecksumDigests, ChecksumRefusal, ChecksumReport,
};
use kvshard_layout::stride::{PageBufferShape, StrideTable};
use kvshard_layout::{
    DetectError, DeviceGeometry, KvDtype, ObjectGroup, ObjectLayout, ShmTensorSpec,
};
use kvshard_wire::msgpack::Value;
use kvshard_wire::{EngineGroupInfo, InstanceId, IpcData, TensorMetadata, VmmKind};
use std::sync::mpsc;
use std::time::Duration;

/// A registered GPU worker, as the front sees it.
#[derive(Debug, Clone)]
pub struct CudaInstance {
    /// The device the worker's tensors live on (the server's ordinal).
    pub ordinal: usize,
    pub geometry: DeviceGeometry,
    pub null_block_id: i64,
}

impl CudaInstance {
    /// Block ids of one chunk, per kernel group.
    pub fn blocks_per_chunk(&self) -> Vec<usize> {
        self.geometry
            .groups
            .iter()
            .map(|g| g.blocks_per_chunk)
            .collect()
    }

    /// The L1 object layout of this worker's chunks (object group 0's).
    pub fn layout(&self) -> ObjectLayout {
        self.geometry.object_layout.clone()
    }

    /// The object groups, by id.
    pub fn object_groups(&self) -> &[ObjectGroup] {
        &self.geometry.object_groups
    }

    /// Whether object group `og`'s block ids of a chunk are all the null
    /// block id (its object is not stored).
    pub fn all_null_in(&self, og: usize, block_ids: &[i64]) -> bool {
        self.geometry.object_groups.get(og).is_some_and(|o| {
            kvshard_layout::geometry::object_group_all_null(
                &self.geometry.groups,
                o,
                block_ids,
                self.null_block_id,
            )
        })
    }

    /// One chunk's block ids (every kernel group's, end to end): each must
    /// name a block of its group's paged buffers, which the kernel addresses
    /// (the null block is a real block in vLLM's pools).
    pub fn validate_block_ids(&self, ids: &[i64]) -> Result<(), BlockOutsideBuffers> {
        let mut rest = ids;
        for (group, g) in self.geometry.groups.iter().enumerate() {
            let (mine, after) = rest.split_at(g.blocks_per_chunk.min(rest.len()));
            rest = after;
            let nb = g.geometry.num_blocks as i64;
            if let Some(&block_id) = mine.iter().find(|&&b| !(0..nb).contains(&b)) {
                return Err(BlockOutsideBuffers {
                    block_id,
                    num_blocks: nb,
                    group: (self.geometry.groups.len() > 1).then_some(group),
                    null_block: block_id == self.null_block_id,
                });
            }
        }
        Ok(())
    }
}

/// A block id of a GPU worker's request that names none of its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockOutsideBuffers {
    pub block_id: i64,
    pub num_blocks: i64,
    /// The kernel group whose list holds it, when there are several.
    pub group: Option<usize>,
    /// The id is the server's `--null-block-id`.
    pub null_block: bool,
}

impl fmt::Display for BlockOutsideBuffers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (b, nb) = (self.block_id, self.num_blocks);
        let of = match self.group {
            Some(g) => format!("kernel group {g}'s"),
            None => "the worker's".to_string(),
        };
        if self.null_block {
            write!(
                f,
                "block id {b} is the null block id (--null-block-id) but outside {of} {nb} \
                 blocks, which the GPU copy kernel cannot address"
            )
        } else {
            write!(f, "block id {b} is outside {of} {nb} blocks")
        }
    }
}

impl std::error::Error for BlockOutsideBuffers {}

/// Where one layer's memory is shared, and how many bytes of it its view may
/// use (from the start of the shared range).
fn layer_memory(index: usize, d: &IpcData) -> Result<(LayerMemory, u64, &TensorMetadata), String> {
    match d {
        IpcData::Cuda(c) => {
            let raw =
                c.handle.mem_handle.as_deref().ok_or_else(|| {
                    format!("layer {index}'s CUDA storage carries no memory handle")
                })?;
            let block = match parse_torch_handle(raw)
                .map_err(|e| format!("layer {index}'s CUDA IPC handle: {e}"))?
            {
                TorchHandle::Block(b) => b,
                TorchHandle::ExpandableSegment => {
                    return Err(format!(
                        "layer {index}'s KV cache lives in a PyTorch expandable segment, which \
                         cannot be mapped from another process; start vLLM with \
                         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
                    ))
                }
            };
            let handle = IpcMemHandle::from_bytes(block).map_err(|e| e.to_string())?;
            let alloc_event = match (&c.handle.event_handle, c.handle.event_sync_required) {
                (Some(ev), true) => Some(
                    IpcEventHandle::from_bytes(ev)
                        .map_err(|e| format!("layer {index}'s allocation event: {e}"))?,
                ),
                _ => None,
            };
            Ok((
                LayerMemory::Cuda {
                    handle,
                    storage_offset: c.handle.storage_offset,
                    storage_bytes: c.handle.storage_size,
                    alloc_event,
                },
                c.handle.storage_size,
                &c.metadata,
            ))
        }
        IpcData::CudaRaw(r) => Ok((
            LayerMemory::Raw {
                handle: IpcMemHandle(r.ipc_handle),
                alloc_offset: r.alloc_offset,
                nbytes: r.nbytes,
            },
            r.nbytes,
            &r.metadata,
        )),
        IpcData::CudaVmm(v) => {
            if v.kind != VmmKind::Fabric {
                return Err(format!(
                    "layer {index} is a posix_fd CUDA VMM export, which needs a file-descriptor \
                     channel the lmcache 0.5.6 protocol does not have (only fabric exports can \
                     be imported)"
                ));
            }
            let blob = v
                .fabric_blob
                .as_deref()
                .ok_or_else(|| format!("layer {index}'s fabric export carries no handle"))?;
            let handle = FabricHandle::from_bytes(blob).map_err(|e| e.to_string())?;
            let fits = v
                .alloc_offset
                .checked_add(v.nbytes)
                .is_some_and(|end| end <= v.alloc_size);
            if !fits {
                return Err(format!(
                    "layer {index}: range {}+{} ends past its allocation of {} bytes",
                    v.alloc_offset, v.nbytes, v.alloc_size
                ));
            }
            Ok((
                LayerMemory::Fabric {
                    handle,
                    alloc_size: v.alloc_size,
                    alloc_offset: v.alloc_offset,
                    nbytes: v.nbytes,
                },
                v.nbytes,
                &v.metadata,
            ))
        }
        IpcData::CpuShm(_) => Err(format!(
            "layer {index} is a cpu_shm tensor in a CUDA registration; a worker registers all \
             its layers one way"
        )),
        IpcData::Unsupported { tag } => Err(format!(
            "layer {index} has unsupported device descriptor type {tag:?}"
        )),
    }
}

/// The `kv_layout` hint of a registration, if it names one.
pub fn kv_layout_hint(layout_hints: &Value) -> Option<String> {
    match layout_hints {
        Value::Map(m) => m.iter().find_map(|(k, v)| match (k, v) {
            (Value::Str(k), Value::Str(v)) if k == "kv_layout" => Some(v.clone()),
            _ => None,
        }),
        _ => None,
    }
}

/// Builds the front's view and the device thread's spec of a CUDA
/// registration, checking everything that can be checked without the GPU.
/// `devices` are the GPUs the server sees.
#[allow(clippy::too_many_arguments)]
pub fn build(
    kv_cache: &[IpcData],
    groups: &[EngineGroupInfo],
    layout_hints: &Value,
    chunk_size: usize,
    null_block_id: i64,
    devices: &[CudaDevice],
    isolated_ipc: bool,
    separate_object_groups: bool,
) -> Result<(CudaInstance, InstanceSpec), String> {
    if kv_cache.is_empty() {
        return Err("kv_cache is empty".into());
    }
    let mut memories = Vec::with_capacity(kv_cache.len());
    let mut tensors = Vec::with_capacity(kv_cache.len());
    let mut uuid: Option<&str> = None;
    for (i, d) in kv_cache.iter().enumerate() {
        let (memory, budget, meta) = layer_memory(i, d)?;
        let this = meta
            .device_uuid
            .strip_prefix("GPU-")
            .unwrap_or(&meta.device_uuid);
        match uuid {
            None => uuid = Some(this),
            Some(u) if u != this => {
                return Err(format!(
                    "layer {i} is on GPU {this} but layer 0 on GPU {u}; one worker's KV cache \
                     lives on one GPU"
                ))
            }
            Some(_) => {}
        }
        tensors.push(ShmTensorSpec {
            shm_name: format!("CUDA tensor {i}"),
            nbytes: budget,
            dtype: meta.dtype.clone(),
            shape: meta.shape.clone(),
            stride: meta.stride.clone(),
            storage_offset: meta.storage_offset,
        });
        memories.push(memory);
    }
    let uuid = uuid.unwrap_or_default();
    let device = devices.iter().find(|d| d.uuid == uuid).ok_or_else(|| {
        format!(
            "the worker's GPU {uuid} is not visible to kvshard; start kvshard with every GPU \
             its workers use visible"
        )
    })?;
    let hint = kv_layout_hint(layout_hints);
    let geometry = DeviceGeometry::detect(
        &tensors,
        groups,
        chunk_size,
        hint.as_deref(),
        separate_object_groups,
    )
    .map_err(|e| match e {
        DetectError::SegmentTooSmall {
            name,
            needed_bytes,
            segment_bytes,
        } => format!(
            "CUDA registration: {name} shares {segment_bytes} bytes but its view needs \
                     {needed_bytes}"
        ),
        e => format!("CUDA registration: {e}"),
    })?;
    let chunk_slots = geometry.chunk_size_tokens as u64;
    let mut groups = Vec::with_capacity(geometry.groups.len());
    for (gi, (g, &block_stride_elems)) in geometry
        .groups
        .iter()
        .zip(&geometry.block_stride_elems)
        .enumerate()
    {
        let of = if geometry.groups.len() > 1 {
            format!(" (kernel group {gi})")
        } else {
            String::new()
        };
        let l = &g.geometry;
        let shape = PageBufferShape {
            kv_size: l.kv_size as u32,
            nl: g.layers.len() as u32,
            nb: l.num_blocks as u64,
            bs: l.block_size as u32,
            nh: l.num_heads as u32,
            hs: l.head_size as u32,
            element_size: l.dtype.size_bytes() as u32,
            block_stride_elems,
        };
        let table = StrideTable::new(l.format.engine_format(), &shape).map_err(|e| {
            format!("CUDA registration{of}: the copy kernel cannot take this layout: {e}")
        })?;
        let region = table
            .object_bytes(chunk_slots)
            .map_err(|e| format!("CUDA registration{of}: {e}"))?;
        if region != g.region_bytes {
            return Err(format!(
                "CUDA registration{of}: the copy kernel's region is {region} bytes but the \
                 layout says {}",
                g.region_bytes
            ));
        }
        let unit = u64::from(table.unit_bytes());
        let object_bytes = geometry
            .object_groups
            .iter()
            .find(|o| o.kernel_groups.contains(&gi))
            .map_or(0, |o| o.layout.bytes);
        if g.object_offset % unit != 0 || object_bytes % unit != 0 {
            return Err(format!(
                "CUDA registration{of}: the group's region starts at byte {} of a {}-byte \
                 object, not on its {unit}-byte copy unit; the GPU copy kernel cannot write it",
                g.object_offset, object_bytes
            ));
        }
        groups.push(GroupSpec {
            kernel_layers: g.layers.clone(),
            table,
            blocks_per_chunk: g.blocks_per_chunk,
            keep_blocks: g.keep_blocks,
            transfer_slots: g.transfer_slots as u64,
            object_offset: g.object_offset,
        });
    }
    let object_groups: Vec<ObjectGroupSpec> = geometry
        .object_groups
        .iter()
        .map(|o| ObjectGroupSpec {
            groups: o.kernel_groups.clone(),
            object_bytes: o.layout.bytes,
        })
        .collect();
    // The temp slots hold the largest object; each group's is a prefix.
    let object_bytes = object_groups
        .iter()
        .map(|o| o.object_bytes)
        .max()
        .unwrap_or(0);
    let layers = memories
        .into_iter()
        .zip(&geometry.views)
        .map(|(memory, &(view_offset, view_bytes))| LayerSpec {
            memory,
            view_offset,
            view_bytes,
        })
        .collect();
    let spec = InstanceSpec {
        ordinal: device.ordinal as usize,
        layers,
        groups,
        object_groups,
        chunk_slots,
        object_bytes,
        isolated_ipc,
    };
    let instance = CudaInstance {
        ordinal: device.ordinal as usize,
        geometry,
        null_block_id,
    };
    Ok((instance, spec))
}

/// The L1 arena's host memory, when the L1 lives in memory: what CUDA
/// copies go to and from. `keep` holds the mapping while device threads run.
#[derive(Clone)]
pub struct L1Memory {
    pub base: usize,
    pub len: usize,
    pub keep: Arc<kvshard_io::arena::Arena>,
}

/// A CUDA registration the front waits on its device thread for.
pub struct PendingRegistration {
    pub model_name: String,
    pub world_size: u32,
    pub descriptor: &'static str,
    pub instance: CudaInstance,
    /// The REGISTER_KV_CACHE requests answered once the set-up ends (the
    /// first, and any repeat sent meanwhile).
    pub replies: Vec<crate::messages::ReplyTo>,
    /// When the set-up was handed to the device thread.
    pub since: std::time::Instant,
}

/// A CUDA transfer the front waits on (keyed by its sequence number).
pub enum CudaOp {
    Store {
        to: crate::messages::ReplyTo,
        iid: InstanceId,
        /// The reserved objects, to finish (or abort) once the copies ended.
        keys: Vec<kvshard_engine::keys::ObjectKey>,
    },
    Retrieve {
        to: crate::messages::ReplyTo,
        iid: InstanceId,
        /// Every object the transfer holds one read lock on, to release.
        locked: Vec<kvshard_engine::keys::ObjectKey>,
    },
}

/// What runs the CUDA jobs: the device threads, or (in debug builds only) the
/// CPU emulation the tests use on hosts without a GPU.
pub enum CudaExecutor {
    Device(DeviceThreads),
    #[cfg(debug_assertions)]
    Emulated(EmulatedDevice),
}

impl CudaExecutor {
    /// Starts the executor of `env` (in a debug build, the emulation when
    /// the environment asks for it) over the L1 memory `mem`.
    pub fn start(env: CudaEnv, mem: &L1Memory) -> Result<CudaExecutor, WorkerError> {
        #[cfg(debug_assertions)]
        if emulated::enabled() {
            return EmulatedDevice::start().map(CudaExecutor::Emulated);
        }
        let keep: Arc<dyn std::any::Any + Send + Sync> = mem.keep.clone();
        // SAFETY: the arena is mapped, page-aligned and registered by no one
        // else, and `keep` holds it mapped while the threads run. The front
        // only names L1 objects it reserved (a store's staged objects,
        // invisible to readers until finished) or read-locked (a retrieve's,
        // never rewritten while locked) in a transfer, and finishes or
        // releases them only after the job's `done` ran.
        let threads = unsafe { DeviceThreads::new(env, Some((mem.base, mem.len)), keep) };
        Ok(CudaExecutor::Device(threads))
    }

    /// Queues a job for GPU `ordinal`; hands it back when it cannot.
    #[allow(clippy::result_large_err)]
    pub fn submit(&self, ordinal: usize, job: DeviceJob) -> Result<(), DeviceJob> {
        match self {
            CudaExecutor::Device(t) => t.submit(ordinal, job),
            #[cfg(debug_assertions)]
            CudaExecutor::Emulated(e) => e.submit(ordinal, job),
        }
    }
}

/// What `/cache/checksums` reads back from a CUDA worker's GPU: per chunk of
/// block ids, the bytes of each registered tensor's `index_select(block
/// axis, ids)` in C order (ranges of adjacent runs merged), hashed as the
/// cpu_shm path hashes a CPU worker's tensors: one block list for every
/// layer, whatever its kernel group, each on its own block axis and in its
/// own dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChecksumPlan {
    pub block_ids: Vec<i64>,
    pub chunk_size_blocks: usize,
    pub layerwise: bool,
    /// Per registered tensor.
    pub dtypes: Vec<KvDtype>,
    /// One read per registered tensor, per chunk.
    pub chunks: Vec<Vec<LayerRead>>,
}

/// Most bytes one chunk of a checksum request may read back from a GPU (one
/// chunk is in host memory at a time).
pub const CHECKSUM_CHUNK_BYTES: u64 = 1 << 30;

/// How long a checksum request waits for a GPU to read one chunk back.
const CHECKSUM_READ_TIMEOUT: Duration = Duration::from_secs(60);

impl CudaInstance {
    /// The read-backs of a `/cache/checksums` request, or why it is refused.
    pub fn checksum_plan(
        &self,
        block_ids: &[i64],
        chunk_size_blocks: usize,
        layerwise: bool,
    ) -> Result<ChecksumPlan, ChecksumRefusal> {
        let g = &self.geometry;
        let mut axes = Vec::with_capacity(g.layers.len());
        for layer in &g.layers {
            axes.push(checksum_axis(layer.format, block_ids, chunk_size_blocks)?);
            // index_select rejects ids outside the layer, the null id included.
            let nb = layer.num_blocks as i64;
            if let Some(&block_id) = block_ids.iter().find(|&&b| !(0..nb).contains(&b)) {
                let e = BlockOutsideBuffers {
                    block_id,
                    num_blocks: nb,
                    group: None,
                    null_block: block_id == self.null_block_id,
                };
                return Err(ChecksumRefusal::bad_request(e.to_string()));
            }
        }
        let mut chunks = Vec::with_capacity(block_ids.len().div_ceil(chunk_size_blocks));
        for ids in block_ids.chunks(chunk_size_blocks) {
            // validate_block_ids kept every id in 0..num_blocks.
            let indices: Vec<usize> = ids.iter().map(|&b| b as usize).collect();
            let mut bytes = 0u64;
            let reads: Vec<LayerRead> = g
                .layer_dims
                .iter()
                .enumerate()
                .map(|(layer, (shape, strides))| {
                    let mut ranges: Vec<(u64, u64)> = Vec::new();
                    let es = g.layers[layer].dtype.size_bytes();
                    index_select_runs(shape, strides, es, axes[layer], &indices, |off, len| {
                        let (off, len) = (off as u64, len as u64);
                        bytes += len;
                        match ranges.last_mut() {
                            Some((o, l)) if *o + *l == off => *l += len,
                            _ => ranges.push((off, len)),
                        }
                    });
                    LayerRead { layer, ranges }
                })
                .collect();
            if bytes > CHECKSUM_CHUNK_BYTES {
                return Err(ChecksumRefusal::bad_request(format!(
                    "a chunk of {} blocks is {bytes} bytes of GPU memory to read back, over the \
                     {CHECKSUM_CHUNK_BYTES} kvshard reads at once: ask with a smaller chunk_size",
                    ids.len()
                )));
            }
            chunks.push(reads);
        }
        Ok(ChecksumPlan {
            block_ids: block_ids.to_vec(),
            chunk_size_blocks,
            layerwise,
            dtypes: g.layers.iter().map(|l| l.dtype).collect(),
            chunks,
        })
    }
}

/// Why a checksum plan's read-backs from a GPU failed.
#[derive(Debug)]
pub enum ChecksumReadError {
    /// The GPU's device thread handed the job back.
    NotTakingWork { ordinal: usize },
    /// The device thread did not answer in time.
    TimedOut { ordinal: usize, after: Duration },
    /// The device thread answered with an error.
    Device(WorkerError),
}

impl std::fmt::Display for ChecksumReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChecksumReadError::NotTakingWork { ordinal } => write!(
                f,
                "the CUDA device thread of GPU {ordinal} is not taking work (see the log)"
            ),
            ChecksumReadError::TimedOut { ordinal, after } => write!(
                f,
                "GPU {ordinal} did not read the blocks back within {} s",
                after.as_secs()
            ),
            ChecksumReadError::Device(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ChecksumReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ChecksumReadError::Device(e) => Some(e),
            ChecksumReadError::NotTakingWork { .. } | ChecksumReadError::TimedOut { .. } => None,
        }
    }
}

/// Runs a checksum plan on GPU `ordinal`'s device thread, one chunk at a
/// time, blocking the calling thread (never the front or a shard).
pub fn run_checksums(
    exec: &CudaExecutor,
    ordinal: usize,
    iid: InstanceId,
    plan: ChecksumPlan,
) -> Result<ChecksumReport, ChecksumReadError> {
    let layers = plan.chunks.first().map_or(0, Vec::len);
    let mut digests = ChecksumDigests::new(layers, plan.layerwise);
    for reads in plan.chunks {
        let (tx, rx) = mpsc::channel();
        let job = DeviceJob::ReadBack {
            iid: iid.0,
            reads,
            done: Box::new(move |r| {
                let _ = tx.send(r);
            }),
        };
        if exec.submit(ordinal, job).is_err() {
            return Err(ChecksumReadError::NotTakingWork { ordinal });
        }
        let buffers = match rx.recv_timeout(CHECKSUM_READ_TIMEOUT) {
            Ok(r) => r.map_err(ChecksumReadError::Device)?,
            Err(_) => {
                return Err(ChecksumReadError::TimedOut {
                    ordinal,
                    after: CHECKSUM_READ_TIMEOUT,
                })
            }
        };
        // One buffer per layer, in the reads' (registration) order.
        digests.push_chunk(|layer, md5| digest_kv(md5, &buffers[layer], plan.dtypes[layer]));
    }
    Ok(digests.report(&plan.block_ids, plan.chunk_size_blocks))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard_layout::KvFormat;
    use kvshard_wire::golden::{cuda_golden, golden_frames};
    use kvshard_wire::{decode_request, Request};

    const UUID: &str = "8f6b2c1e-0000-1111-2222-333344445555";

    fn gpus(uuid: &str) -> Vec<CudaDevice> {
        vec![
            CudaDevice {
                ordinal: 0,
                uuid: "00000000-0000-0000-0000-000000000000".into(),
                name: "other".into(),
                compute_capability: (9, 0),
            },
            CudaDevice {
                ordinal: 1,
                uuid: uuid.into(),
                name: "worker's".into(),
                compute_capability: (9, 0),
            },
        ]
    }

    /// The golden REGISTER of `name`: its descriptors, groups and hints.
    fn golden(name: &str) -> (Vec<IpcData>, Vec<EngineGroupInfo>, Value) {
        let (op, frames) = golden_frames(&cuda_golden(), name);
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        match decode_request(op, &refs).unwrap() {
            Request::RegisterKvCache {
                kv_cache,
                layout_hints,
                engine_group_infos,
                ..
            } => (kv_cache, engine_group_infos, layout_hints),
            other => panic!("{name}: {other:?}"),
        }
    }

    #[test]
    fn golden_registrations_build_the_kernel_spec_of_the_layout() {
        // Two bf16 layers [2, 1024, 16, 8, 128] (vLLM flash attention, NHD).
        let layer = 2 * 1024 * 16 * 8 * 128 * 2u64;
        for name in [
            "register_kv_cache_cuda",
            "register_kv_cache_cuda_raw",
            "register_kv_cache_cuda_vmm",
        ] {
            let (kv, groups, hints) = golden(name);
            let (inst, spec) =
                build(&kv, &groups, &hints, 256, 0, &gpus(UUID), false, false).unwrap();
            assert_eq!(inst.ordinal, 1, "{name}: the worker's GPU by UUID");
            assert_eq!(spec.ordinal, 1);
            assert_eq!(inst.geometry.groups.len(), 1, "{name}");
            let g = &inst.geometry.groups[0].geometry;
            assert_eq!(g.format, KvFormat::TwoNbBsNhHs, "{name}");
            assert_eq!(
                (
                    g.kv_size,
                    g.num_blocks,
                    g.block_size,
                    g.num_heads,
                    g.head_size
                ),
                (2, 1024, 16, 8, 128)
            );
            assert_eq!(inst.geometry.views, vec![(0, layer); 2], "{name}");
            assert_eq!(inst.geometry.block_stride_elems, vec![0]);
            assert_eq!(inst.blocks_per_chunk(), vec![16]);
            // [2, layers, chunk, heads x head size] in bf16.
            let l = inst.layout();
            assert_eq!(*l.shape, [2, 2, 256, 1024], "{name}");
            assert_eq!(l.bytes, 2 * 2 * 256 * 1024 * 2);
            assert_eq!(spec.object_bytes, l.bytes);
            assert_eq!(spec.chunk_slots, 256);
            assert_eq!(spec.groups.len(), 1);
            assert_eq!(spec.groups[0].kernel_layers, vec![0, 1]);
            assert_eq!(spec.groups[0].table.format().as_u32(), 1);
            assert_eq!(spec.groups[0].table.unit_bytes(), 16);
            assert_eq!(spec.groups[0].object_offset, 0);
            assert_eq!(spec.layers.len(), 2);
            assert_eq!(spec.layers[0].view_offset, 0);
            assert_eq!(spec.layers[0].view_bytes, layer);
            match (&spec.layers[0].memory, name) {
                (
                    LayerMemory::Cuda {
                        handle,
                        storage_offset,
                        storage_bytes,
                        alloc_event,
                    },
                    "register_kv_cache_cuda",
                ) => {
                    let want: Vec<u8> = (0..64).collect();
                    assert_eq!(handle.0.to_vec(), want, "the 'c' payload");
                    assert_eq!((*storage_offset, *storage_bytes), (4096, layer));
                    assert!(alloc_event.is_some(), "event_sync_required");
                }
                (
                    LayerMemory::Raw {
                        alloc_offset,
                        nbytes,
                        ..
                    },
                    "register_kv_cache_cuda_raw",
                ) => assert_eq!((*alloc_offset, *nbytes), (4096, layer)),
                (
                    LayerMemory::Fabric {
                        alloc_size, nbytes, ..
                    },
                    "register_kv_cache_cuda_vmm",
                ) => {
                    assert_eq!(*nbytes, layer);
                    assert!(*alloc_size >= layer);
                }
                (m, _) => panic!("{name}: wrong memory kind {m:?}"),
            }
        }
    }

    #[test]
    fn registrations_the_kernel_cannot_take_are_refused_with_the_cause() {
        let (kv, groups, hints) = golden("register_kv_cache_cuda_raw");
        // The worker's GPU is not visible.
        let e = build(
            &kv,
            &groups,
            &hints,
            256,
            0,
            &gpus("ffffffff-0000-0000-0000-000000000000"),
            false,
            false,
        )
        .unwrap_err();
        assert!(e.contains(&format!("GPU {UUID} is not visible")), "{e}");
        // A chunk that is not whole blocks.
        let e = build(&kv, &groups, &hints, 24, 0, &gpus(UUID), false, false).unwrap_err();
        assert!(e.contains("multiple of the block size"), "{e}");

        let with_raw = |f: &dyn Fn(&mut kvshard_wire::RawCudaIpc)| -> Vec<IpcData> {
            let mut kv = kv.clone();
            if let IpcData::CudaRaw(r) = &mut kv[0] {
                f(r);
            }
            kv
        };
        // Padded heads: not the tight layout the kernel reads.
        let padded = with_raw(&|r| {
            r.metadata.stride = vec![16777216 * 2, 16384 * 2, 2048, 256, 1];
            r.nbytes *= 2;
        });
        let e = build(&padded, &groups, &hints, 256, 0, &gpus(UUID), false, false).unwrap_err();
        assert!(e.contains("not the tight"), "{e}");
        // A view past the shared range.
        let shifted = with_raw(&|r| r.metadata.storage_offset = 1);
        let e = build(&shifted, &groups, &hints, 256, 0, &gpus(UUID), false, false).unwrap_err();
        assert!(
            e.contains("shares 67108864 bytes") && e.contains("needs"),
            "{e}"
        );
        // Layers on two GPUs.
        let mut two = kv.clone();
        let mut other = kv[0].clone();
        if let IpcData::CudaRaw(r) = &mut other {
            r.metadata.device_uuid = "00000000-0000-0000-0000-000000000000".into();
        }
        two.push(other);
        let e = build(&two, &[], &hints, 256, 0, &gpus(UUID), false, false).unwrap_err();
        assert!(e.contains("one GPU"), "{e}");
        // A posix_fd VMM export.
        let (mut vmm, groups, hints) = golden("register_kv_cache_cuda_vmm");
        if let IpcData::CudaVmm(v) = &mut vmm[0] {
            v.kind = VmmKind::PosixFd;
        }
        let e = build(&vmm, &groups, &hints, 256, 0, &gpus(UUID), false, false).unwrap_err();
        assert!(e.contains("posix_fd"), "{e}");
    }

    #[test]
    fn block_ids_must_name_blocks() {
        let (kv, groups, hints) = golden("register_kv_cache_cuda_raw");
        let (inst, _) = build(&kv, &groups, &hints, 256, 0, &gpus(UUID), false, false).unwrap();
        assert!(inst.validate_block_ids(&[0, 5, 1023]).is_ok());
        assert!(inst
            .validate_block_ids(&[1024])
            .unwrap_err()
            .to_string()
            .contains("outside"));
        assert!(inst.validate_block_ids(&[-1]).is_err());
        let null_outside = CudaInstance {
            null_block_id: -1,
            ..inst
        };
        assert!(null_outside
            .validate_block_ids(&[-1])
            .unwrap_err()
            .to_string()
            .contains("null block id"));
    }
}
