//! The per-GPU device threads the transport drives.
//!
//! [`DeviceThreads`] owns one thread per GPU ordinal (`kvshard-cuda-<N>`),
//! started on the first job for that GPU and fed through a bounded queue.
//! Each thread opens the device's primary context ([`Device`]) and keeps
//! every CUDA object it makes: the block-copy kernel (compiled once, on the
//! first registration), a [`MappingRegistry`] of IPC/fabric imports shared by
//! its instances, and per instance a non-blocking stream, the device array
//! of paged base pointers, a block-id buffer, [`MAX_OBJECTS`] temp slots, a
//! completion event and an [`ExportRing`].
//!
//! A transfer (lmcache 0.5.6's STORE/RETRIEVE staged kernel path) makes the
//! instance stream wait on the worker's event, then runs its chunks in
//! batches of up to [`MAX_OBJECTS`]: STORE gathers the engine blocks into the
//! temp slots and copies each slot to its host object; RETRIEVE copies each
//! host object into its slot and scatters the slots into the engine blocks.
//! The thread waits for the copies to complete before it answers, so the
//! caller may commit, release or reuse the host objects as soon as `done`
//! runs, on success and on failure alike.
//!
//! Host copies to or from the pinned arena are cut at its 64 MiB
//! registration boundaries (one copy may not span two registrations).
//!
//! The pure parts (spec and chunk validation, the batch planner, the layer
//! windows and imports, the host-copy splitter) are free functions tested
//! without a GPU; a host without CUDA exercises the path where the device
//! cannot be opened and every job is answered with the reason.

use std::any::Any;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::error::{Step, WorkerError};
use super::event::{
    wait_value, ExportRing, ImportedEvent, IpcEventHandle, TimelineBuffer, WorkerEvent,
    DEFAULT_EXPORT_RING,
};
use super::exec::{CompletionEvent, DeviceBuffer, KernelModule, LaunchArgs, Stream};
use super::ipc::{
    DriverIpcOpener, FabricHandle, IpcMemHandle, IpcOpener, MappingKey, MappingRegistry,
};
use super::pin::{split_copy, Piece, PinnedRegion, DEFAULT_PIECE_BYTES};
use super::{Device, DeviceError};
use crate::cuda::CudaEnv;
use crate::kernel::{CopyDirection, KernelLaunch, KernelObjects};
use crate::nvrtc::Nvrtc;
use kvshard_layout::stride::{StrideTable, MAX_OBJECTS};

/// Jobs one device thread's queue holds before [`DeviceThreads::submit`]
/// hands a job back.
pub const DEFAULT_QUEUE_DEPTH: usize = 1024;

/// How one registered layer's memory is shared by the worker process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerMemory {
    /// torch storage IPC (`cuda` tag, a 'c' handle): the cudaMalloc block's
    /// handle, the storage's byte offset inside the block (`handle[3]`) and
    /// size (`handle[2]`); `alloc_event` = `handle[6]` when `handle[7]`
    /// (event_sync_required) is true.
    Cuda {
        handle: IpcMemHandle,
        storage_offset: u64,
        storage_bytes: u64,
        alloc_event: Option<IpcEventHandle>,
    },
    /// `cuda_raw`: allocation base handle, byte offset of the tensor in it,
    /// bytes.
    Raw {
        handle: IpcMemHandle,
        alloc_offset: u64,
        nbytes: u64,
    },
    /// `cuda_vmm` fabric export.
    Fabric {
        handle: FabricHandle,
        alloc_size: u64,
        alloc_offset: u64,
        nbytes: u64,
    },
}

/// One registered tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub memory: LayerMemory,
    /// Bytes from the start of the shared range (storage / alloc_offset) to
    /// the tensor's first element (storage_offset * element size).
    pub view_offset: u64,
    /// Bytes the view spans from its first element (must fit the shared
    /// range; for a layer the kernel addresses, at least the table's
    /// `paged_span_bytes`).
    pub view_bytes: u64,
}

/// One kernel group of a registration: the layers one stride table walks,
/// and where their region of every chunk object lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// Indices into the instance's `layers` in the kernel's pointer order
    /// (the paged[] array); exactly `table.paged_buffers()` of them.
    pub kernel_layers: Vec<usize>,
    pub table: StrideTable,
    /// Block ids of one chunk in this group (`chunk_slots / bs`).
    pub blocks_per_chunk: usize,
    /// Of those, the last ones moved: all of them, or a sliding window
    /// shorter than the chunk (`transfer_slots / bs`).
    pub keep_blocks: usize,
    /// Token slots of each chunk moved (`keep_blocks * bs`), into the
    /// `[kv_size, layers, transfer_slots, hidden]` start of the group's
    /// region; the rest of the region is zeros.
    pub transfer_slots: u64,
    /// Bytes from the start of its object group's object to the group's
    /// region, which is `table.object_bytes(chunk_slots)` long. An object
    /// group's regions lie end to end in group order.
    pub object_offset: u64,
}

/// One object group of a registration: the kernel groups whose regions one
/// object of each chunk holds (every group, unless object groups are
/// separate).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectGroupSpec {
    /// Indices into the instance's `groups`, ascending.
    pub groups: Vec<usize>,
    /// Bytes of one chunk's object of this group.
    pub object_bytes: u64,
}

impl ObjectGroupSpec {
    /// The one object group of a registration of `groups` kernel groups
    /// whose objects hold them all.
    pub fn every(groups: usize, object_bytes: u64) -> Vec<ObjectGroupSpec> {
        vec![ObjectGroupSpec {
            groups: (0..groups).collect(),
            object_bytes,
        }]
    }
}

/// Everything a registration needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceSpec {
    pub ordinal: usize,
    /// Every registered tensor, registration order.
    pub layers: Vec<LayerSpec>,
    /// The kernel groups (hybrid models have several), in object order.
    pub groups: Vec<GroupSpec>,
    /// The object groups, by id; each kernel group is in exactly one.
    pub object_groups: Vec<ObjectGroupSpec>,
    /// Token slots per chunk object.
    pub chunk_slots: u64,
    /// Bytes of the largest object group's object of one chunk (a temp
    /// slot).
    pub object_bytes: u64,
    /// Events are timeline semaphores (`--isolated-ipc`: 81-byte handles
    /// over CUDA IPC memory) instead of CUDA interprocess events.
    pub isolated_ipc: bool,
}

impl InstanceSpec {
    /// Block ids of one chunk: every group's, end to end.
    pub fn ids_per_chunk(&self) -> usize {
        self.groups.iter().map(|g| g.blocks_per_chunk).sum()
    }
}

/// One chunk of a transfer: the L1 object in host memory and the worker's
/// blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkCopy {
    /// The chunk's object of this object group: its kernel groups move.
    pub object_group: usize,
    pub host_addr: usize,
    /// Every group's block ids of the chunk, end to end in group order.
    pub block_ids: Vec<i64>,
    /// Leading tokens of this chunk left untouched (retrieve's
    /// skip_first_n_tokens; 0 for store, which refuses anything else). Each
    /// group leaves the whole blocks these tokens cover (0.5.6 rewrites a
    /// partially skipped block); see [`plan_batches`] for how that becomes
    /// the kernel's flat skip of a batch.
    pub skip_tokens: usize,
}

impl GroupSpec {
    /// Of the blocks this group moves for a chunk (its last `keep_blocks`),
    /// how many a retrieve skipping the chunk's first `skip_tokens` tokens
    /// leaves untouched: those among the chunk's first whole blocks of the
    /// skip (0.5.6's `recalculate_blocks_to_skip`, per chunk).
    pub fn kept_skip(&self, skip_tokens: usize) -> usize {
        kvshard_layout::geometry::kept_skip_blocks(
            skip_tokens,
            self.table.shape().bs as usize,
            self.blocks_per_chunk,
            self.keep_blocks,
        )
    }

    /// The ids of a chunk's list (this group's `blocks_per_chunk`) it moves.
    pub fn kept<'a>(&self, ids: &'a [i64]) -> &'a [i64] {
        &ids[ids.len() - self.keep_blocks.min(ids.len())..]
    }
}

/// Which way a transfer moves KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDir {
    /// STORE: gather device blocks into the host object.
    ToHost,
    /// RETRIEVE: scatter the host object into device blocks.
    ToDevice,
}

/// Answer of a registration.
pub type RegisterDone = Box<dyn FnOnce(Result<(), WorkerError>) + Send>;

/// Answer of a transfer: the 64 bytes of the exported server event.
pub type TransferDone = Box<dyn FnOnce(Result<Vec<u8>, WorkerError>) + Send>;

/// One registered tensor's bytes to read back to the host: byte ranges from
/// its first element, copied one after the other into one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRead {
    /// Index into the registration's layers (registration order).
    pub layer: usize,
    pub ranges: Vec<(u64, u64)>,
}

/// The bytes `read` copies, or why one of its ranges is not inside the
/// tensor's view of `view_bytes`.
pub fn read_len(read: &LayerRead, view_bytes: u64) -> Result<usize, WorkerError> {
    let mut total = 0u64;
    for &(off, len) in &read.ranges {
        if off.checked_add(len).is_none_or(|end| end > view_bytes) {
            return Err(WorkerError::ReadOutsideView {
                layer: read.layer,
                offset: off,
                len,
                view_bytes,
            });
        }
        total += len;
    }
    usize::try_from(total).map_err(|_| WorkerError::ReadTooLarge {
        layer: read.layer,
        bytes: total,
    })
}

/// Answer of a read-back: one buffer per [`LayerRead`], in order.
pub type ReadBackDone = Box<dyn FnOnce(Result<Vec<Vec<u8>>, WorkerError>) + Send>;

/// Work for one GPU's thread.
pub enum DeviceJob {
    Register {
        iid: i64,
        spec: InstanceSpec,
        done: RegisterDone,
    },
    /// `done` gets the exported server event handle bytes (64) once every
    /// copy has COMPLETED (the thread waits for completion before calling
    /// it), or an error. After an error the thread also waits until nothing
    /// of the job is still running on the device before calling `done`, so
    /// the caller may free or reuse the host memory then.
    Transfer {
        iid: i64,
        dir: CopyDir,
        worker_event: Option<Vec<u8>>,
        chunks: Vec<ChunkCopy>,
        done: TransferDone,
    },
    Unregister {
        iid: i64,
    },
    /// Copies ranges of a registered instance's tensors to the host (for
    /// `/cache/checksums`), after the jobs queued before it.
    ReadBack {
        iid: i64,
        reads: Vec<LayerRead>,
        done: ReadBackDone,
    },
}

impl fmt::Debug for DeviceJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Register { iid, spec, .. } => f
                .debug_struct("Register")
                .field("iid", iid)
                .field("ordinal", &spec.ordinal)
                .field("layers", &spec.layers.len())
                .finish_non_exhaustive(),
            Self::Transfer {
                iid, dir, chunks, ..
            } => f
                .debug_struct("Transfer")
                .field("iid", iid)
                .field("dir", dir)
                .field("chunks", &chunks.len())
                .finish_non_exhaustive(),
            Self::Unregister { iid } => f.debug_struct("Unregister").field("iid", iid).finish(),
            Self::ReadBack { iid, reads, .. } => f
                .debug_struct("ReadBack")
                .field("iid", iid)
                .field("reads", &reads.len())
                .finish_non_exhaustive(),
        }
    }
}

// ---------------------------------------------------------------------------
// Pure logic: spec and chunk validation, batches, layer windows, host parts.
// ---------------------------------------------------------------------------

/// The shared byte range of one layer inside its mapping, and where the
/// tensor starts in that range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerWindow {
    pub key: MappingKey,
    /// Offset of the shared range inside the mapped allocation.
    pub offset: u64,
    /// Bytes of the shared range.
    pub len: u64,
    /// Offset of the first element inside the shared range.
    pub view_offset: u64,
}

/// Where layer `layer` lives: its mapping and range, checked so the view
/// fits the shared range (`cuda`: first element = block base +
/// storage_offset + view_offset and the view ends inside the storage;
/// `cuda_raw` and `cuda_vmm`: base + alloc_offset + view_offset inside
/// `nbytes`, and for `cuda_vmm` the range inside `alloc_size`).
pub fn layer_window(ordinal: u32, layer: &LayerSpec) -> Result<LayerWindow, WorkerError> {
    let (key, offset, len) = match &layer.memory {
        LayerMemory::Cuda {
            handle,
            storage_offset,
            storage_bytes,
            ..
        } => (
            MappingKey::ipc(ordinal, *handle),
            *storage_offset,
            *storage_bytes,
        ),
        LayerMemory::Raw {
            handle,
            alloc_offset,
            nbytes,
        } => (MappingKey::ipc(ordinal, *handle), *alloc_offset, *nbytes),
        LayerMemory::Fabric {
            handle,
            alloc_size,
            alloc_offset,
            nbytes,
        } => {
            if alloc_offset
                .checked_add(*nbytes)
                .is_none_or(|end| end > *alloc_size)
            {
                return Err(WorkerError::FabricRangeOutside {
                    offset: *alloc_offset,
                    bytes: *nbytes,
                    alloc_size: *alloc_size,
                });
            }
            (
                MappingKey::fabric(ordinal, *handle, *alloc_size),
                *alloc_offset,
                *nbytes,
            )
        }
    };
    if offset.checked_add(len).is_none() {
        return Err(WorkerError::SharedRangeOverflows { offset, bytes: len });
    }
    if layer
        .view_offset
        .checked_add(layer.view_bytes)
        .is_none_or(|end| end > len)
    {
        return Err(WorkerError::ViewOutsideRange {
            view_offset: layer.view_offset,
            view_bytes: layer.view_bytes,
            range_bytes: len,
        });
    }
    Ok(LayerWindow {
        key,
        offset,
        len,
        view_offset: layer.view_offset,
    })
}

/// Checks a registration before anything is mapped or allocated.
pub fn check_spec(spec: &InstanceSpec) -> Result<(), WorkerError> {
    if spec.layers.is_empty() {
        return Err(WorkerError::NoLayers);
    }
    if spec.groups.is_empty() {
        return Err(WorkerError::NoGroups);
    }
    let ordinal = u32::try_from(spec.ordinal).map_err(|_| WorkerError::SpecOrdinalOutOfRange {
        ordinal: spec.ordinal,
    })?;
    for (i, layer) in spec.layers.iter().enumerate() {
        layer_window(ordinal, layer).map_err(|e| e.in_layer(i))?;
    }
    if spec.object_groups.is_empty() {
        return Err(WorkerError::NoObjectGroups);
    }
    let mut held = vec![false; spec.groups.len()];
    for (o, og) in spec.object_groups.iter().enumerate() {
        let mut end = 0u64;
        for &g in &og.groups {
            let member = WorkerError::ObjectGroupMember {
                group: g,
                groups: spec.groups.len(),
            };
            match held.get_mut(g) {
                Some(h) if !*h => *h = true,
                _ => return Err(member.in_object_group(o)),
            }
            let region = check_group(spec, &spec.groups[g], end, og.object_bytes)
                .map_err(|e| e.in_group(g).in_object_group(o))?;
            end = end.checked_add(region).ok_or(WorkerError::Overflow {
                what: "the object's size",
            })?;
        }
        if og.object_bytes != end {
            let e = WorkerError::ObjectBytesMismatch {
                got: og.object_bytes,
                expected: end,
            };
            return Err(e.in_object_group(o));
        }
    }
    if let Some(group) = held.iter().position(|h| !h) {
        return Err(WorkerError::GroupInNoObjectGroup { group });
    }
    let largest = spec
        .object_groups
        .iter()
        .map(|o| o.object_bytes)
        .max()
        .unwrap_or(0);
    if spec.object_bytes != largest {
        return Err(WorkerError::ObjectBytesMismatch {
            got: spec.object_bytes,
            expected: largest,
        });
    }
    (MAX_OBJECTS as u64)
        .checked_mul(spec.object_bytes)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or(WorkerError::Overflow {
            what: "the temp slots' size",
        })?;
    Ok(())
}

/// Checks one group of `spec` whose region should start at byte `offset` of
/// its object group's `object_bytes`-byte object; returns the region's bytes.
fn check_group(
    spec: &InstanceSpec,
    group: &GroupSpec,
    offset: u64,
    object_bytes: u64,
) -> Result<u64, WorkerError> {
    let t = &group.table;
    if group.kernel_layers.len() != t.paged_buffers() {
        return Err(WorkerError::KernelLayerCount {
            format: t.format(),
            expected: t.paged_buffers(),
            got: group.kernel_layers.len(),
        });
    }
    if group.blocks_per_chunk == 0 {
        return Err(WorkerError::ZeroBlocksPerChunk);
    }
    let bs = t.shape().bs;
    if (group.blocks_per_chunk as u64).checked_mul(u64::from(bs)) != Some(spec.chunk_slots) {
        return Err(WorkerError::ChunkNotWholeBlocks {
            blocks_per_chunk: group.blocks_per_chunk,
            block_size: bs,
            chunk_slots: spec.chunk_slots,
        });
    }
    if group.keep_blocks == 0
        || group.keep_blocks > group.blocks_per_chunk
        || (group.keep_blocks as u64).checked_mul(u64::from(bs)) != Some(group.transfer_slots)
    {
        return Err(WorkerError::WindowNotWholeBlocks {
            keep_blocks: group.keep_blocks,
            blocks_per_chunk: group.blocks_per_chunk,
            block_size: bs,
            transfer_slots: group.transfer_slots,
        });
    }
    let span = t.paged_span_bytes();
    for (p, &i) in group.kernel_layers.iter().enumerate() {
        let layer = spec.layers.get(i).ok_or(WorkerError::KernelLayerMissing {
            pointer: p,
            layer: i,
            registered: spec.layers.len(),
        })?;
        if layer.view_bytes < span {
            return Err(WorkerError::KernelLayerTooSmall {
                pointer: p,
                layer: i,
                bytes: layer.view_bytes,
                needed: span,
            });
        }
    }
    let blocks = MAX_OBJECTS
        .checked_mul(group.keep_blocks)
        .ok_or(WorkerError::Overflow {
            what: "blocks_per_chunk",
        })?;
    for dir in [CopyDirection::Gather, CopyDirection::Scatter] {
        KernelLaunch::new(t, dir, MAX_OBJECTS, blocks, group.transfer_slots, 0)
            .map_err(WorkerError::BatchUnlaunchable)?;
    }
    let region = t
        .object_bytes(spec.chunk_slots)
        .map_err(WorkerError::Copy)?;
    if group.object_offset != offset {
        return Err(WorkerError::RegionOffset {
            offset: group.object_offset,
            expected: offset,
        });
    }
    // Each temp slot starts at a multiple of object_bytes and the kernel
    // moves whole units from the region's start.
    let unit = u64::from(t.unit_bytes());
    if group.object_offset % unit != 0 || object_bytes % unit != 0 || spec.object_bytes % unit != 0
    {
        return Err(WorkerError::RegionMisaligned {
            offset: group.object_offset,
            object_bytes,
            unit,
        });
    }
    Ok(region)
}

/// Checks every chunk of a transfer before anything is enqueued: exactly
/// `spec.ids_per_chunk()` ids, each group's in `0..nb` of its own buffers,
/// `skip_tokens <= chunk_slots` (and 0 for a store, which must fill the
/// whole object), an object group of the spec, and a non-null host range
/// `[host_addr, host_addr + object_bytes)` (its group's) that does not wrap.
pub fn validate_chunks(
    chunks: &[ChunkCopy],
    dir: CopyDir,
    spec: &InstanceSpec,
) -> Result<(), WorkerError> {
    let ids_per_chunk = spec.ids_per_chunk();
    for (c, chunk) in chunks.iter().enumerate() {
        if chunk.block_ids.len() != ids_per_chunk {
            return Err(WorkerError::BlockIdCount {
                chunk: c,
                got: chunk.block_ids.len(),
                expected: ids_per_chunk,
            });
        }
        let mut first = 0;
        for group in &spec.groups {
            let nb = group.table.shape().nb;
            let ids = &chunk.block_ids[first..first + group.blocks_per_chunk];
            if let Some((j, id)) = ids
                .iter()
                .enumerate()
                .find(|(_, &id)| u64::try_from(id).map_or(true, |id| id >= nb))
            {
                return Err(WorkerError::BlockIdOutOfRange {
                    chunk: c,
                    index: first + j,
                    id: *id,
                    nb,
                });
            }
            first += group.blocks_per_chunk;
        }
        if chunk.skip_tokens as u64 > spec.chunk_slots {
            return Err(WorkerError::SkipTooLarge {
                chunk: c,
                skip_tokens: chunk.skip_tokens,
                tokens: spec.chunk_slots,
            });
        }
        if dir == CopyDir::ToHost && chunk.skip_tokens != 0 {
            return Err(WorkerError::StoreSkips {
                chunk: c,
                skip_tokens: chunk.skip_tokens,
            });
        }
        let Some(og) = spec.object_groups.get(chunk.object_group) else {
            return Err(WorkerError::ObjectGroupOutOfRange {
                chunk: c,
                object_group: chunk.object_group,
                object_groups: spec.object_groups.len(),
            });
        };
        if chunk.host_addr == 0 {
            return Err(WorkerError::NullHostAddress { chunk: c });
        }
        let end = usize::try_from(og.object_bytes)
            .ok()
            .and_then(|n| chunk.host_addr.checked_add(n));
        if end.is_none() {
            return Err(WorkerError::HostRangeWraps {
                chunk: Some(c),
                addr: chunk.host_addr as u64,
                len: og.object_bytes,
            });
        }
    }
    Ok(())
}

/// One kernel group's part of a batch: one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupBatch {
    /// The chunks' block ids of this group, concatenated (the kernel's flat
    /// index).
    pub ids: Vec<i64>,
    /// Leading flat blocks of the batch the kernel leaves untouched.
    pub skip_blocks: usize,
}

impl GroupBatch {
    /// Whether the kernel would touch nothing (every block skipped).
    pub fn fully_skipped(&self) -> bool {
        self.skip_blocks >= self.ids.len()
    }
}

/// One kernel launch per group's worth of chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The object group of every chunk of the batch.
    pub object_group: usize,
    /// Index of the batch's first chunk in the transfer.
    pub first_chunk: usize,
    /// Chunks (kernel objects) in the batch, 1..=MAX_OBJECTS.
    pub chunks: usize,
    /// Per kernel group, in the spec's order (the groups of other object
    /// groups than the batch's have no ids: they are fully skipped).
    pub groups: Vec<GroupBatch>,
}

impl Batch {
    /// Whether no group's kernel would touch anything.
    pub fn fully_skipped(&self) -> bool {
        self.groups.iter().all(GroupBatch::fully_skipped)
    }
}

/// Groups chunks into batches of at most [`MAX_OBJECTS`] of one object
/// group, in order, each with one launch per kernel group of that object
/// group.
///
/// The kernel skips a flat prefix of a batch's blocks, so a group's skip in
/// a batch is the sum of the skipped blocks of its leading chunks: a chunk
/// may join a batch when, in every group, it skips nothing or every chunk
/// already in the batch is skipped entirely (its own skip then extends the
/// prefix). Any other chunk starts a new batch. So each chunk's own skip is
/// honoured exactly in every group, whatever the pattern.
///
/// For the skips RETRIEVE derives from `skip_first_n_tokens` (whole chunks
/// skipped, then one partial chunk, then none) this gives lmcache 0.5.6's
/// batches and flat skips exactly: fixed batches of four, each group
/// skipping `floor(max(0, skip_tokens - batch_first_token) / bs)` flat
/// blocks of its own block size.
pub fn plan_batches(chunks: &[ChunkCopy], spec: &InstanceSpec) -> Vec<Batch> {
    let mut out: Vec<Batch> = Vec::new();
    let member = |og: usize, g: usize| {
        spec.object_groups
            .get(og)
            .is_some_and(|o| o.groups.contains(&g))
    };
    for (c, chunk) in chunks.iter().enumerate() {
        let og = chunk.object_group;
        let joins = out.last().is_some_and(|b| {
            b.chunks < MAX_OBJECTS
                && b.object_group == og
                && spec
                    .groups
                    .iter()
                    .zip(&b.groups)
                    .enumerate()
                    .filter(|(g, _)| member(og, *g))
                    .all(|(_, (g, gb))| {
                        g.kept_skip(chunk.skip_tokens) == 0
                            || gb.skip_blocks == b.chunks * g.keep_blocks
                    })
        });
        if !joins {
            out.push(Batch {
                object_group: og,
                first_chunk: c,
                chunks: 0,
                groups: spec
                    .groups
                    .iter()
                    .map(|g| GroupBatch {
                        ids: Vec::with_capacity(MAX_OBJECTS * g.keep_blocks),
                        skip_blocks: 0,
                    })
                    .collect(),
            });
        }
        let b = out.last_mut().expect("a batch was just ensured");
        let mut first = 0;
        for (i, (g, gb)) in spec.groups.iter().zip(&mut b.groups).enumerate() {
            let ids = &chunk.block_ids[first..first + g.blocks_per_chunk];
            first += g.blocks_per_chunk;
            if !member(og, i) {
                continue;
            }
            if gb.skip_blocks == b.chunks * g.keep_blocks {
                gb.skip_blocks += g.kept_skip(chunk.skip_tokens);
            }
            gb.ids.extend_from_slice(g.kept(ids));
        }
        b.chunks += 1;
    }
    out
}

/// The pinned arena as the copy splitter sees it: its base address and its
/// registrations (offsets relative to the base).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinView {
    pub base: u64,
    pub len: u64,
    pub pieces: Vec<Piece>,
}

/// One host copy: `[offset, offset + len)` of the host object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPart {
    pub offset: u64,
    pub len: u64,
}

/// Cuts the host range `[addr, addr + len)` into copies that never span
/// two registrations of the pinned arena: the part before the arena, one
/// part per piece inside it, the part after it. Without an arena, or for a
/// range outside it, one copy.
pub fn host_copy_parts(
    pin: Option<&PinView>,
    addr: u64,
    len: u64,
) -> Result<Vec<HostPart>, WorkerError> {
    let end = addr.checked_add(len).ok_or(WorkerError::HostRangeWraps {
        chunk: None,
        addr,
        len,
    })?;
    if len == 0 {
        return Ok(Vec::new());
    }
    let whole = || Ok(vec![HostPart { offset: 0, len }]);
    let Some(pin) = pin else { return whole() };
    let pin_end = pin.base.saturating_add(pin.len);
    let (lo, hi) = (addr.max(pin.base), end.min(pin_end));
    if lo >= hi {
        return whole();
    }
    let mut parts = Vec::new();
    if addr < lo {
        parts.push(HostPart {
            offset: 0,
            len: lo - addr,
        });
    }
    let inside = split_copy(&pin.pieces, lo - pin.base, hi - lo).map_err(WorkerError::HostSplit)?;
    parts.extend(inside.map(|p| HostPart {
        offset: pin.base + p.offset - addr,
        len: p.len,
    }));
    if hi < end {
        parts.push(HostPart {
            offset: hi - addr,
            len: end - hi,
        });
    }
    Ok(parts)
}

/// Checks that every kernel base pointer is aligned to the copy width.
pub fn check_alignment(ptrs: &[u64], unit_bytes: u32) -> Result<(), WorkerError> {
    let unit = u64::from(unit_bytes.max(1));
    match ptrs.iter().enumerate().find(|(_, &p)| p % unit != 0) {
        Some((i, &p)) => Err(WorkerError::Misaligned {
            pointer: i,
            addr: p,
            unit,
        }),
        None => Ok(()),
    }
}

/// A layer mapped for this process: the mapping it holds a reference on and
/// the device address of its first element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportedLayer {
    pub key: MappingKey,
    pub ptr: u64,
}

/// Maps every layer (one registry reference each; layers sharing a handle
/// share the mapping). On any failure the references taken so far are
/// given back and the error names the layer.
pub fn import_layers<O: IpcOpener>(
    registry: &mut MappingRegistry<O>,
    ordinal: u32,
    layers: &[LayerSpec],
) -> Result<Vec<ImportedLayer>, WorkerError> {
    let mut out: Vec<ImportedLayer> = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let imported = layer_window(ordinal, layer).and_then(|w| {
            registry
                .open_range(&w.key, w.offset, w.len)
                .map(|r| ImportedLayer {
                    key: w.key,
                    ptr: r.ptr + w.view_offset,
                })
                .map_err(WorkerError::Device)
        });
        match imported {
            Ok(l) => out.push(l),
            Err(e) => {
                release_layers(registry, out.iter().map(|l| l.key));
                return Err(e.in_layer(i));
            }
        }
    }
    Ok(out)
}

/// Gives back one reference per key; failures are logged (the registry
/// forgets the mapping either way).
pub fn release_layers<O: IpcOpener>(
    registry: &mut MappingRegistry<O>,
    keys: impl IntoIterator<Item = MappingKey>,
) {
    for key in keys {
        if let Err(e) = registry.release(&key) {
            log::warn!("{e}");
        }
    }
}

// ---------------------------------------------------------------------------
// The pinned arena, shared by the device threads.
// ---------------------------------------------------------------------------

enum PinPhase {
    /// No arena was given.
    Absent,
    /// Not registered yet; the first thread whose device opens does it.
    Unclaimed {
        base: usize,
        len: usize,
    },
    Registering,
    Registered(PinView),
    /// Registration failed (copies then go unsplit, as pageable memory).
    Failed,
    /// The owner unregistered it at shutdown.
    Released,
}

struct PinState {
    phase: PinPhase,
    /// Threads other than the owner that split copies at its pieces.
    users: usize,
}

struct PinShared {
    state: Mutex<PinState>,
    cv: Condvar,
}

impl PinShared {
    fn lock(&self) -> MutexGuard<'_, PinState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, PinState>) -> MutexGuard<'a, PinState> {
        self.cv.wait(g).unwrap_or_else(|p| p.into_inner())
    }
}

/// A device thread's part in the arena's life, held until the thread ends.
#[derive(Default)]
struct PinRole {
    /// Set on the thread that registered the arena; unregisters it when
    /// dropped, after every user has gone.
    _owner: Option<PinOwner>,
    /// Set on the other threads that split copies at its pieces.
    _user: Option<PinUser>,
}

struct PinOwner {
    shared: Arc<PinShared>,
    region: Option<PinnedRegion>,
}

impl Drop for PinOwner {
    fn drop(&mut self) {
        let mut g = self.shared.lock();
        if matches!(g.phase, PinPhase::Registering) {
            g.phase = PinPhase::Failed;
            self.shared.cv.notify_all();
        }
        while g.users > 0 {
            g = self.shared.wait(g);
        }
        if self.region.is_some() {
            g.phase = PinPhase::Released;
        }
        drop(g);
        // Unregisters every piece (the other threads are done with it).
        self.region.take();
    }
}

struct PinUser {
    shared: Arc<PinShared>,
}

impl Drop for PinUser {
    fn drop(&mut self) {
        let mut g = self.shared.lock();
        g.users -= 1;
        self.shared.cv.notify_all();
    }
}

/// Joins the arena from a thread whose device is open: registers it when
/// nobody has, waits for the owner's outcome otherwise.
fn join_pin(shared: &Arc<PinShared>, device: &Device) -> (Option<PinView>, PinRole) {
    let mut g = shared.lock();
    let (base, len) = loop {
        match &g.phase {
            PinPhase::Absent | PinPhase::Failed | PinPhase::Released => {
                return (None, PinRole::default())
            }
            PinPhase::Registering => g = shared.wait(g),
            PinPhase::Registered(view) => {
                let view = view.clone();
                g.users += 1;
                let user = PinUser {
                    shared: shared.clone(),
                };
                let role = PinRole {
                    _owner: None,
                    _user: Some(user),
                };
                return (Some(view), role);
            }
            &PinPhase::Unclaimed { base, len } => break (base, len),
        }
    };
    g.phase = PinPhase::Registering;
    drop(g);
    // From here the owner's drop settles the phase even if this panics.
    let mut owner = PinOwner {
        shared: shared.clone(),
        region: None,
    };
    let started = std::time::Instant::now();
    let registered = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `DeviceThreads::new`'s contract: [base, base + len) is
        // mapped host memory, registered by nobody else, that stays mapped
        // while the threads run (the keepalive each thread holds); the
        // region is dropped by its owner only after every thread using it
        // has finished.
        unsafe { PinnedRegion::register(device, base as *mut u8, len as u64, DEFAULT_PIECE_BYTES) }
    }));
    let mut g = shared.lock();
    let view = match registered {
        Ok(Ok(region)) => {
            let view = PinView {
                base: base as u64,
                len: len as u64,
                pieces: region.pieces().to_vec(),
            };
            log::info!(
                "device {}: pinned {len} bytes at {base:#x} in {} pieces in {:?}",
                device.ordinal(),
                view.pieces.len(),
                started.elapsed()
            );
            owner.region = Some(region);
            g.phase = PinPhase::Registered(view.clone());
            Some(view)
        }
        Ok(Err(e)) => {
            log::warn!("{e}; host copies go through pageable memory");
            g.phase = PinPhase::Failed;
            None
        }
        Err(_) => {
            log::warn!("pinning the host arena panicked; host copies go through pageable memory");
            g.phase = PinPhase::Failed;
            None
        }
    };
    shared.cv.notify_all();
    drop(g);
    let role = PinRole {
        _owner: Some(owner),
        _user: None,
    };
    (view, role)
}

// ---------------------------------------------------------------------------
// One device thread.
// ---------------------------------------------------------------------------

/// One registered instance's device state.
struct Instance {
    keys: Vec<MappingKey>,
    /// Per registered tensor: the device address of its first element and
    /// the bytes its view spans.
    views: Vec<(u64, u64)>,
    /// The registration (its kernel groups and object layout).
    spec: InstanceSpec,
    /// Per kernel group: where its pointers start in `paged` and its ids in
    /// `ids` (bytes).
    group_offsets: Vec<(usize, usize)>,
    /// The kernel groups' base pointers, group after group.
    paged: DeviceBuffer,
    ids: DeviceBuffer,
    slots: DeviceBuffer,
    completion: CompletionEvent,
    ring: ExportRing,
    /// `--isolated-ipc`: the slot of the thread's semaphore buffer this
    /// instance signals, its last sequence, and the worker's semaphore
    /// buffer as mapped here (also in `keys`).
    timeline: Option<Timeline>,
    stream: Stream,
}

/// An instance's timeline-semaphore state.
struct Timeline {
    slot_offset: u64,
    seq: u64,
    import: Option<(MappingKey, u64)>,
}

/// What a transfer waits on before it copies.
enum WorkerWait {
    Event(ImportedEvent),
    /// The 64-bit value at this device address reaching this sequence.
    Value(u64, u64),
}

impl Instance {
    /// Waits for the stream, frees the device state, then gives back the
    /// mapping references (nothing may use a mapping once it is closed).
    fn close(mut self, registry: &mut MappingRegistry<DriverIpcOpener>) {
        if let Err(e) = self.stream.synchronize() {
            log::warn!("{e} (closing an instance)");
        }
        let keys = std::mem::take(&mut self.keys);
        drop(self);
        release_layers(registry, keys);
    }
}

struct Worker {
    ordinal: u32,
    device: Device,
    instances: HashMap<i64, Instance>,
    registry: MappingRegistry<DriverIpcOpener>,
    /// Compiled on the first registration; a failure is kept and repeated.
    module: Option<Result<KernelModule, WorkerError>>,
    pin: Option<PinView>,
    /// This thread's semaphore buffer, made on the first `--isolated-ipc`
    /// registration.
    timeline: Option<TimelineBuffer>,
}

fn panic_message(p: &(dyn Any + Send)) -> &str {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or("panic")
}

/// Calls a job's `done`; a panicking callback is logged, not propagated.
fn answer<T>(done: Box<dyn FnOnce(Result<T, WorkerError>) + Send>, result: Result<T, WorkerError>) {
    if let Err(p) = catch_unwind(AssertUnwindSafe(move || done(result))) {
        log::error!(
            "a device job's completion callback panicked: {}",
            panic_message(&*p)
        );
    }
}

/// Answers a job that cannot run.
fn refuse(job: DeviceJob, reason: &WorkerError) {
    match job {
        DeviceJob::Register { done, .. } => answer(done, Err(reason.clone())),
        DeviceJob::Transfer { done, .. } => answer(done, Err(reason.clone())),
        DeviceJob::Unregister { .. } => {}
        DeviceJob::ReadBack { done, .. } => answer(done, Err(reason.clone())),
    }
}

impl Worker {
    fn new(device: Device, pin: Option<PinView>) -> Self {
        Self {
            ordinal: device.ordinal(),
            registry: MappingRegistry::new(DriverIpcOpener::new(device.clone())),
            device,
            instances: HashMap::new(),
            module: None,
            pin,
            timeline: None,
        }
    }

    fn handle(&mut self, job: DeviceJob) {
        match job {
            DeviceJob::Register { iid, spec, done } => {
                let r = self.guarded(iid, Step::Registering, |w| w.register(iid, &spec));
                answer(done, r);
            }
            DeviceJob::Transfer {
                iid,
                dir,
                worker_event,
                chunks,
                done,
            } => {
                let r = self.guarded(iid, Step::Transferring, |w| {
                    w.transfer(iid, dir, worker_event.as_deref(), &chunks)
                });
                answer(done, r);
            }
            DeviceJob::Unregister { iid } => {
                if let Err(e) = self.guarded(iid, Step::Unregistering, |w| {
                    w.unregister(iid);
                    Ok(())
                }) {
                    log::error!("{e}");
                }
            }
            DeviceJob::ReadBack { iid, reads, done } => {
                let r = self.guarded(iid, Step::ReadingBack, |w| w.read_back(iid, &reads));
                answer(done, r);
            }
        }
    }

    /// Copies each read's ranges of a registered tensor into one host
    /// buffer, checked against the tensor's view.
    fn read_back(&self, iid: i64, reads: &[LayerRead]) -> Result<Vec<Vec<u8>>, WorkerError> {
        let ordinal = self.ordinal;
        let inst = self
            .instances
            .get(&iid)
            .ok_or(WorkerError::UnknownInstance {
                device: ordinal,
                instance: iid,
            })?;
        let mut out = Vec::with_capacity(reads.len());
        for read in reads {
            let &(ptr, view_bytes) =
                inst.views
                    .get(read.layer)
                    .ok_or(WorkerError::UnknownLayer {
                        device: ordinal,
                        instance: iid,
                        layer: read.layer,
                    })?;
            let total = read_len(read, view_bytes)
                .map_err(|e| e.during(ordinal, iid, Step::ReadingBack))?;
            let mut buf = vec![0u8; total];
            let mut at = 0usize;
            for &(off, len) in &read.ranges {
                // SAFETY: the source range lies inside the layer's view
                // (checked above), which stays mapped while the instance is
                // registered on this thread; `buf[at..at + len]` is this
                // thread's own memory, untouched until the synchronize below.
                unsafe {
                    inst.stream
                        .copy_raw_to_host(buf.as_mut_ptr().add(at), ptr + off, len as usize)
                }?;
                at += len as usize;
            }
            inst.stream.synchronize()?;
            out.push(buf);
        }
        Ok(out)
    }

    /// Runs one job's work; a panic becomes an error, after the instance's
    /// stream is drained so nothing of the job still runs.
    fn guarded<T>(
        &mut self,
        iid: i64,
        step: Step,
        f: impl FnOnce(&mut Self) -> Result<T, WorkerError>,
    ) -> Result<T, WorkerError> {
        match catch_unwind(AssertUnwindSafe(|| f(self))) {
            Ok(r) => r,
            Err(p) => {
                if let Some(inst) = self.instances.get(&iid) {
                    if let Err(e) = inst.stream.synchronize() {
                        log::error!("{e}");
                    }
                }
                Err(WorkerError::Panicked {
                    device: self.ordinal,
                    instance: iid,
                    step,
                    message: panic_message(&*p).to_string(),
                })
            }
        }
    }

    fn kernel(&mut self) -> Result<&KernelModule, WorkerError> {
        let device = &self.device;
        let module = self.module.get_or_insert_with(|| {
            let nvrtc = Nvrtc::load().map_err(WorkerError::NvrtcUnavailable)?;
            KernelModule::compile(device, &nvrtc).map_err(WorkerError::KernelBuild)
        });
        module.as_ref().map_err(Clone::clone)
    }

    fn register(&mut self, iid: i64, spec: &InstanceSpec) -> Result<(), WorkerError> {
        let ordinal = self.ordinal;
        let doing = |e: WorkerError| e.during(ordinal, iid, Step::Registering);
        if let Some(old) = self.instances.remove(&iid) {
            log::info!(
                "device {}: instance {iid} registered again; closing the old one",
                self.ordinal
            );
            old.close(&mut self.registry);
        }
        if spec.ordinal != self.ordinal as usize {
            return Err(doing(WorkerError::WrongDevice {
                spec: spec.ordinal,
                thread: self.ordinal,
            }));
        }
        check_spec(spec).map_err(doing)?;
        self.kernel().map(|_| ()).map_err(doing)?;
        let slot = if spec.isolated_ipc {
            if self.timeline.is_none() {
                let stream = Stream::new(&self.device).map_err(|e| doing(e.into()))?;
                let buffer =
                    TimelineBuffer::new(&self.device, &stream).map_err(|e| doing(e.into()))?;
                self.timeline = Some(buffer);
            }
            let buffer = self.timeline.as_mut().expect("made above");
            Some(buffer.claim_slot().map_err(|e| doing(e.into()))?)
        } else {
            None
        };
        let layers =
            import_layers(&mut self.registry, self.ordinal, &spec.layers).map_err(doing)?;
        match self.build_instance(spec, &layers, slot) {
            Ok(inst) => {
                self.instances.insert(iid, inst);
                Ok(())
            }
            Err(e) => {
                release_layers(&mut self.registry, layers.iter().map(|l| l.key));
                Err(doing(e))
            }
        }
    }

    /// Allocates an instance's device state, waits once on the allocation
    /// events, uploads the kernel pointers. Everything is allocated before
    /// the first enqueue and the stream is synchronized before returning,
    /// so nothing is dropped while the device may still use it.
    fn build_instance(
        &self,
        spec: &InstanceSpec,
        layers: &[ImportedLayer],
        timeline_slot: Option<u64>,
    ) -> Result<Instance, WorkerError> {
        let mut ptrs: Vec<u64> = Vec::new();
        let mut group_offsets = Vec::with_capacity(spec.groups.len());
        let mut ids_at = 0;
        for (g, group) in spec.groups.iter().enumerate() {
            let group_ptrs: Vec<u64> = group.kernel_layers.iter().map(|&i| layers[i].ptr).collect();
            check_alignment(&group_ptrs, group.table.unit_bytes()).map_err(|e| e.in_group(g))?;
            group_offsets.push((ptrs.len() * 8, ids_at));
            ids_at += MAX_OBJECTS * group.blocks_per_chunk * 8;
            ptrs.extend(group_ptrs);
        }
        let device = &self.device;
        let stream = Stream::new(device)?;
        let mut seen = HashSet::new();
        let mut alloc_events = Vec::new();
        for layer in &spec.layers {
            if let LayerMemory::Cuda {
                alloc_event: Some(h),
                ..
            } = &layer.memory
            {
                if seen.insert(*h) {
                    alloc_events.push(ImportedEvent::import(device, h)?);
                }
            }
        }
        let ptr_bytes = ptrs.len() * 8;
        let paged = DeviceBuffer::alloc(device, ptr_bytes)?;
        let ids = DeviceBuffer::alloc(device, ids_at)?;
        // check_spec made sure this fits usize.
        let slots = DeviceBuffer::alloc(device, MAX_OBJECTS * spec.object_bytes as usize)?;
        // A group moving a window shorter than the chunk leaves the rest of
        // its region untouched: zeros in every object, as the emulation and
        // the cpu_shm path write.
        if spec
            .groups
            .iter()
            .any(|g| g.keep_blocks < g.blocks_per_chunk)
        {
            slots.zero()?;
        }
        let completion = CompletionEvent::new(device)?;
        let ring = ExportRing::new(device, DEFAULT_EXPORT_RING);
        for ev in &alloc_events {
            ev.wait_on(&stream)?;
        }
        // SAFETY: `ptrs` is a live Vec of exactly `ptr_bytes` bytes that
        // outlives the synchronize below; the destination range is inside
        // `paged` (checked by copy_to_device).
        unsafe { stream.copy_to_device(&paged, 0, ptrs.as_ptr().cast::<u8>(), ptr_bytes) }?;
        stream.synchronize()?;
        drop(alloc_events);
        Ok(Instance {
            keys: layers.iter().map(|l| l.key).collect(),
            views: layers
                .iter()
                .zip(&spec.layers)
                .map(|(l, s)| (l.ptr, s.view_bytes))
                .collect(),
            spec: spec.clone(),
            group_offsets,
            paged,
            ids,
            slots,
            completion,
            ring,
            timeline: timeline_slot.map(|slot_offset| Timeline {
                slot_offset,
                seq: 0,
                import: None,
            }),
            stream,
        })
    }

    fn unregister(&mut self, iid: i64) {
        if let Some(inst) = self.instances.remove(&iid) {
            inst.close(&mut self.registry);
        }
    }

    fn transfer(
        &mut self,
        iid: i64,
        dir: CopyDir,
        worker_event: Option<&[u8]>,
        chunks: &[ChunkCopy],
    ) -> Result<Vec<u8>, WorkerError> {
        let ordinal = self.ordinal;
        let doing = |e: WorkerError| e.during(ordinal, iid, Step::Transferring);
        let inst = self
            .instances
            .get_mut(&iid)
            .ok_or(WorkerError::UnknownInstance {
                device: ordinal,
                instance: iid,
            })?;
        // Every registered instance implies a loaded kernel.
        let module = match &self.module {
            Some(Ok(m)) => m,
            _ => return Err(doing(WorkerError::KernelNotLoaded)),
        };
        validate_chunks(chunks, dir, &inst.spec).map_err(doing)?;
        let handle = worker_event
            .map(|b| WorkerEvent::parse(b, inst.spec.isolated_ipc))
            .transpose()
            .map_err(|e| doing(WorkerError::Device(e)))?;
        let batches = plan_batches(chunks, &inst.spec);
        let direction = match dir {
            CopyDir::ToHost => CopyDirection::Gather,
            CopyDir::ToDevice => CopyDirection::Scatter,
        };
        let mut launches = Vec::with_capacity(batches.len());
        let mut copies = Vec::with_capacity(chunks.len());
        for b in &batches {
            // Per group: its launch, or None when it skips every block.
            let mut group_launches = Vec::with_capacity(b.groups.len());
            for (g, (group, gb)) in inst.spec.groups.iter().zip(&b.groups).enumerate() {
                if gb.fully_skipped() {
                    group_launches.push(None);
                    continue;
                }
                let l = KernelLaunch::new(
                    &group.table,
                    direction,
                    b.chunks,
                    gb.ids.len(),
                    group.transfer_slots,
                    gb.skip_blocks,
                )
                .map_err(|e| doing(WorkerError::Copy(e).in_group(g)))?;
                group_launches.push(Some(l));
            }
            launches.push(group_launches);
            let object_bytes = inst.spec.object_groups[b.object_group].object_bytes;
            for chunk in &chunks[b.first_chunk..b.first_chunk + b.chunks] {
                let parts =
                    host_copy_parts(self.pin.as_ref(), chunk.host_addr as u64, object_bytes)
                        .map_err(doing)?;
                copies.push(parts);
            }
        }
        // Nothing is enqueued before this point.
        let imported = match handle {
            None => None,
            Some(WorkerEvent::Cuda(h)) => Some(WorkerWait::Event(
                ImportedEvent::import(&self.device, &h)
                    .map_err(|e| doing(WorkerError::Device(e)))?,
            )),
            Some(WorkerEvent::Timeline(ev)) => {
                // The worker's semaphore buffer, mapped once per buffer.
                let tl = inst.timeline.as_mut().expect("an isolated_ipc instance");
                let key = MappingKey::ipc(ordinal, ev.buffer);
                let base = match tl.import {
                    Some((k, base)) if k == key => base,
                    previous => {
                        let m = self.registry.open(&key).map_err(|e| doing(e.into()))?;
                        if m.len < ev.slot_offset + 8 {
                            let _ = self.registry.release(&key);
                            return Err(doing(WorkerError::Device(DeviceError::invalid(
                                format!(
                                    "the worker's semaphore buffer is {} bytes, its slot at {} \
                                     is outside",
                                    m.len, ev.slot_offset
                                ),
                                "mapping a worker's semaphore buffer",
                            ))));
                        }
                        if let Some((old, _)) = previous {
                            inst.keys.retain(|k| *k != old);
                            let _ = self.registry.release(&old);
                        }
                        inst.keys.push(key);
                        tl.import = Some((key, m.base));
                        m.base
                    }
                };
                Some(WorkerWait::Value(base + ev.slot_offset, ev.seq))
            }
        };
        let enqueued = enqueue(
            module,
            inst,
            dir,
            chunks,
            &batches,
            &launches,
            &copies,
            imported.as_ref(),
        );
        let outcome = enqueued.and_then(|()| inst.completion.wait());
        if let Err(e) = outcome {
            // Let nothing of this job run on after the answer.
            if let Err(se) = inst.stream.synchronize() {
                log::error!("{se} (after: {e})");
            }
            return Err(doing(WorkerError::Device(e)));
        }
        // The worker event, the host ids and the copy plans were kept alive
        // until here, past completion.
        drop(imported);
        drop(batches);
        let exported = match (inst.timeline.as_mut(), self.timeline.as_ref()) {
            (Some(tl), Some(buffer)) => {
                tl.seq += 1;
                buffer
                    .signal(&inst.stream, tl.slot_offset, tl.seq)
                    .map(|ev| ev.to_bytes())
            }
            _ => inst
                .ring
                .export(&inst.stream)
                .map(|h| h.as_bytes().to_vec()),
        };
        exported.map_err(|e| {
            let _ = inst.stream.synchronize();
            doing(WorkerError::Device(e))
        })
    }
}

/// Enqueues one transfer on the instance stream, ending with the
/// completion record. `launches[b][g]` is group `g`'s launch of batch `b`
/// (None: it skips every block); `copies[k]` holds the host parts of chunk
/// `batches[..].first_chunk + ..` in batch order.
#[allow(clippy::too_many_arguments)]
fn enqueue(
    module: &KernelModule,
    inst: &Instance,
    dir: CopyDir,
    chunks: &[ChunkCopy],
    batches: &[Batch],
    launches: &[Vec<Option<KernelLaunch>>],
    copies: &[Vec<HostPart>],
    worker_event: Option<&WorkerWait>,
) -> Result<(), DeviceError> {
    let stream = &inst.stream;
    match worker_event {
        Some(WorkerWait::Event(ev)) => ev.wait_on(stream)?,
        Some(&WorkerWait::Value(addr, seq)) => wait_value(stream, addr, seq)?,
        None => {}
    }
    let obj = inst.spec.object_bytes as usize;
    let mut k = 0;
    for (b, group_launches) in batches.iter().zip(launches) {
        let members = &chunks[b.first_chunk..b.first_chunk + b.chunks];
        let parts = &copies[k..k + b.chunks];
        k += b.chunks;
        if group_launches.iter().all(Option::is_none) {
            // Every block of the batch is skipped: nothing to move.
            continue;
        }
        if dir == CopyDir::ToDevice {
            for (i, (chunk, parts)) in members.iter().zip(parts).enumerate() {
                for p in parts {
                    // SAFETY: `DeviceThreads::new`'s contract: the host object
                    // [host_addr, host_addr + object_bytes) is readable and
                    // unchanged until `done` runs, which is after the copy
                    // completed; the part lies inside it (host_copy_parts),
                    // and the slot range is checked by copy_to_device.
                    unsafe {
                        stream.copy_to_device(
                            &inst.slots,
                            i * obj + p.offset as usize,
                            (chunk.host_addr + p.offset as usize) as *const u8,
                            p.len as usize,
                        )
                    }?;
                }
            }
        }
        for (((group, gb), launch), &(ptr_at, ids_at)) in inst
            .spec
            .groups
            .iter()
            .zip(&b.groups)
            .zip(group_launches)
            .zip(&inst.group_offsets)
        {
            let Some(launch) = launch else { continue };
            let object_bytes = inst.spec.object_groups[b.object_group].object_bytes;
            let region = (object_bytes - group.object_offset) as usize;
            let mut objects = KernelObjects::default();
            for (i, p) in objects.ptr.iter_mut().take(b.chunks).enumerate() {
                *p = inst
                    .slots
                    .range(i * obj + group.object_offset as usize, region)?;
            }
            let args = LaunchArgs {
                paged: inst.paged.ptr() + ptr_at as u64,
                objects,
                ids: inst.ids.ptr() + ids_at as u64,
            };
            // SAFETY: `gb.ids` is a live Vec kept until the transfer
            // completed (the caller waits before dropping it); the range is
            // the group's part of `inst.ids`, sized for MAX_OBJECTS chunks of
            // its blocks (checked by copy_to_device). It is reused by the
            // next batch only in stream order.
            unsafe {
                stream.copy_to_device(
                    &inst.ids,
                    ids_at,
                    gb.ids.as_ptr().cast::<u8>(),
                    gb.ids.len() * 8,
                )
            }?;
            // SAFETY: the group's part of the paged array holds its kernel
            // layers' first elements, each aligned to the copy unit and
            // spanning the layout's paged_span_bytes inside its mapping
            // (checked at registration); every block id is in 0..nb of the
            // group (validate_chunks); the objects are the group's regions of
            // the instance's temp slots (whole units, check_spec); the ids
            // were uploaded just before on this stream. All of it stays alive
            // and mapped until the transfer has completed (the thread waits,
            // or synchronizes on error, before anything is dropped or
            // unregistered).
            unsafe { module.launch(stream, launch, &args) }?;
        }
        if dir == CopyDir::ToHost {
            for (i, (chunk, parts)) in members.iter().zip(parts).enumerate() {
                for p in parts {
                    // SAFETY: `DeviceThreads::new`'s contract: the host object
                    // is writable and untouched by anyone else until `done`
                    // runs, which is after the copy completed; the part lies
                    // inside it, and the slot range is checked.
                    unsafe {
                        stream.copy_to_host(
                            (chunk.host_addr + p.offset as usize) as *mut u8,
                            &inst.slots,
                            i * obj + p.offset as usize,
                            p.len as usize,
                        )
                    }?;
                }
            }
        }
    }
    inst.completion.record(stream)
}

impl Worker {
    /// Closes every instance (streams drained, mappings released).
    fn shutdown(&mut self) {
        let iids: Vec<i64> = self.instances.keys().copied().collect();
        for iid in iids {
            self.unregister(iid);
        }
    }
}

fn run_thread(
    ordinal: usize,
    env: CudaEnv,
    rx: Receiver<DeviceJob>,
    pin: Arc<PinShared>,
    _keepalive: Arc<dyn Any + Send + Sync>,
) {
    let opened = match u32::try_from(ordinal) {
        Err(_) => Err(WorkerError::OrdinalOutOfRange { ordinal }),
        Ok(o) => catch_unwind(AssertUnwindSafe(|| Device::open(&env, o)))
            .map_err(|p| WorkerError::OpenPanicked {
                ordinal: o,
                message: panic_message(&*p).to_string(),
            })
            .and_then(|r| r.map_err(WorkerError::Device)),
    };
    let device = match opened {
        Ok(d) => d,
        Err(e) => {
            let reason = WorkerError::Unusable {
                ordinal,
                source: Box::new(e),
            };
            log::warn!("{reason}");
            for job in rx.iter() {
                refuse(job, &reason);
            }
            return;
        }
    };
    let (view, role) = join_pin(&pin, &device);
    let mut worker = Worker::new(device, view);
    for job in rx.iter() {
        worker.handle(job);
    }
    worker.shutdown();
    drop(worker);
    // The owner waits here until no other thread uses the arena.
    drop(role);
}

// ---------------------------------------------------------------------------
// The thread set.
// ---------------------------------------------------------------------------

struct Lane {
    tx: SyncSender<DeviceJob>,
    handle: JoinHandle<()>,
}

/// The device threads, one per GPU, started on first use.
pub struct DeviceThreads {
    env: CudaEnv,
    pin: Arc<PinShared>,
    keepalive: Arc<dyn Any + Send + Sync>,
    lanes: Mutex<HashMap<usize, Lane>>,
    queue_depth: usize,
}

impl fmt::Debug for DeviceThreads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lanes: Vec<usize> = self
            .lanes
            .lock()
            .map(|l| l.keys().copied().collect())
            .unwrap_or_default();
        f.debug_struct("DeviceThreads")
            .field("devices", &self.env.devices.len())
            .field("threads", &lanes)
            .field("queue_depth", &self.queue_depth)
            .finish()
    }
}

impl DeviceThreads {
    /// `pin`: host memory (the L1 arena, `(base address, bytes)`) that the
    /// first device thread to open its GPU registers with
    /// `cuMemHostRegister` in 64 MiB pieces ([`PinnedRegion`]) before
    /// serving jobs, kept registered until the threads stop; copies to or
    /// from it are split at piece boundaries. A failed registration is
    /// logged and copies then treat the arena as pageable memory.
    /// `keepalive` is held by the threads so that memory stays mapped while
    /// they run.
    ///
    /// # Safety
    /// - `pin`, when given, is mapped host memory with a 4 KiB-aligned base
    ///   that nobody else registers with CUDA, and that stays mapped for as
    ///   long as `keepalive` lives;
    /// - for every [`DeviceJob::Transfer`] later submitted, each chunk's
    ///   `[host_addr, host_addr + object_bytes)` is mapped host memory that
    ///   nothing else reads (for a store) or writes (both directions) until
    ///   the job's `done` has been called; the device copies write into it
    ///   (store) or read from it (retrieve);
    /// - the workers' memory behind registered layers is only what the
    ///   worker process shared (the kernel writes into the blocks it is
    ///   asked to retrieve into).
    pub unsafe fn new(
        env: CudaEnv,
        pin: Option<(usize, usize)>,
        keepalive: Arc<dyn Any + Send + Sync>,
    ) -> DeviceThreads {
        // SAFETY: forwarded contract.
        unsafe { Self::with_queue_depth(env, pin, keepalive, DEFAULT_QUEUE_DEPTH) }
    }

    /// [`DeviceThreads::new`] with another queue bound per thread.
    ///
    /// # Safety
    /// As for [`DeviceThreads::new`].
    pub unsafe fn with_queue_depth(
        env: CudaEnv,
        pin: Option<(usize, usize)>,
        keepalive: Arc<dyn Any + Send + Sync>,
        queue_depth: usize,
    ) -> DeviceThreads {
        let phase = match pin {
            Some((base, len)) if len > 0 => PinPhase::Unclaimed { base, len },
            _ => PinPhase::Absent,
        };
        DeviceThreads {
            env,
            pin: Arc::new(PinShared {
                state: Mutex::new(PinState { phase, users: 0 }),
                cv: Condvar::new(),
            }),
            keepalive,
            lanes: Mutex::new(HashMap::new()),
            queue_depth: queue_depth.max(1),
        }
    }

    /// Queues a job for the GPU `ordinal` (bounded queue); the thread
    /// `kvshard-cuda-<ordinal>` starts on first use. A full queue, an
    /// ordinal the probe did not list, or a thread that could not start or
    /// has died hands the job back (`Err(job)`) so the caller answers the
    /// request itself. A thread whose GPU cannot be opened stays up and
    /// answers every job with the reason.
    // The job itself is the error: handing it back is the point.
    #[allow(clippy::result_large_err)]
    pub fn submit(&self, ordinal: usize, job: DeviceJob) -> Result<(), DeviceJob> {
        let mut lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let lane = match lanes.entry(ordinal) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => {
                if !self
                    .env
                    .devices
                    .iter()
                    .any(|d| d.ordinal as usize == ordinal)
                {
                    log::warn!(
                        "no CUDA device {ordinal} (the probe found {}); job handed back",
                        self.env.devices.len()
                    );
                    return Err(job);
                }
                let (tx, rx) = sync_channel(self.queue_depth);
                let env = self.env.clone();
                let pin = self.pin.clone();
                let keepalive = self.keepalive.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("kvshard-cuda-{ordinal}"))
                    .spawn(move || run_thread(ordinal, env, rx, pin, keepalive));
                match spawned {
                    Ok(handle) => v.insert(Lane { tx, handle }),
                    Err(e) => {
                        log::error!("cannot start the thread for CUDA device {ordinal}: {e}");
                        return Err(job);
                    }
                }
            }
        };
        match lane.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(job)) => Err(job),
            Err(TrySendError::Disconnected(job)) => {
                log::error!("the thread for CUDA device {ordinal} has died; job handed back");
                Err(job)
            }
        }
    }
}

impl Drop for DeviceThreads {
    /// Closes the queues (jobs already queued are still served and
    /// answered) and joins the threads: instances closed, mappings
    /// released, the arena unregistered.
    fn drop(&mut self) {
        let lanes = std::mem::take(self.lanes.get_mut().unwrap_or_else(|p| p.into_inner()));
        let handles: Vec<(usize, JoinHandle<()>)> = lanes
            .into_iter()
            .map(|(ordinal, lane)| {
                drop(lane.tx);
                (ordinal, lane.handle)
            })
            .collect();
        let me = std::thread::current().id();
        for (ordinal, handle) in handles {
            if handle.thread().id() == me {
                // Dropped from one of its own callbacks: that thread ends by
                // itself once the callback returns (its queue is closed).
                continue;
            }
            if handle.join().is_err() {
                log::error!("the thread for CUDA device {ordinal} panicked");
            }
        }
    }
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<DeviceThreads>();
    const fn send<T: Send>() {}
    send::<DeviceJob>();
};

#[cfg(test)]
mod tests {
    use super::super::ipc::Mapping;
    use super::super::DeviceError;
    use super::*;
    use crate::cuda::CudaDevice;
    use crate::device::pin::plan_pieces;
    use std::sync::mpsc::{channel, Sender};
    use std::time::Duration;

    const MIB: u64 = 1 << 20;

    // -- specs ---------------------------------------------------------------

    /// FlashAttention NHD, two layers: 2 paged buffers, 16 blocks a chunk,
    /// 2 MiB objects, each buffer must span 200 blocks of 32 KiB.
    fn table() -> StrideTable {
        super::super::flash_table(2)
    }

    fn raw_layer(handle: u8, alloc_offset: u64, nbytes: u64) -> LayerSpec {
        LayerSpec {
            memory: LayerMemory::Raw {
                handle: IpcMemHandle([handle; 64]),
                alloc_offset,
                nbytes,
            },
            view_offset: 0,
            view_bytes: nbytes,
        }
    }

    fn spec() -> InstanceSpec {
        let t = table();
        let span = t.paged_span_bytes();
        assert_eq!(span, 200 * 32 * 1024);
        InstanceSpec {
            ordinal: 0,
            layers: vec![raw_layer(1, 0, span), raw_layer(1, span, span)],
            groups: vec![GroupSpec {
                kernel_layers: vec![0, 1],
                table: t,
                blocks_per_chunk: 16,
                keep_blocks: 16,
                transfer_slots: 256,
                object_offset: 0,
            }],
            object_groups: ObjectGroupSpec::every(1, 2 * MIB),
            chunk_slots: 256,
            object_bytes: 2 * MIB,
            isolated_ipc: false,
        }
    }

    /// One NHD float16 layer of one head of 8, `nb` blocks of `bs` tokens.
    fn small_group(bs: u32, blocks_per_chunk: usize, nb: u64) -> GroupSpec {
        use kvshard_layout::stride::{EngineKvFormat, PageBufferShape};
        let shape = PageBufferShape {
            kv_size: 2,
            nl: 1,
            nb,
            bs,
            nh: 1,
            hs: 8,
            element_size: 2,
            block_stride_elems: 0,
        };
        GroupSpec {
            kernel_layers: vec![0],
            table: StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &shape).unwrap(),
            blocks_per_chunk,
            keep_blocks: blocks_per_chunk,
            transfer_slots: u64::from(bs) * blocks_per_chunk as u64,
            object_offset: 0,
        }
    }

    /// A spec of `groups` (for chunk checks and batches; not a registration).
    fn spec_of(groups: Vec<GroupSpec>, object_bytes: u64) -> InstanceSpec {
        let g = &groups[0];
        InstanceSpec {
            ordinal: 0,
            layers: Vec::new(),
            chunk_slots: u64::from(g.table.shape().bs) * g.blocks_per_chunk as u64,
            object_groups: ObjectGroupSpec::every(groups.len(), object_bytes),
            groups,
            object_bytes,
            isolated_ipc: false,
        }
    }

    #[test]
    fn a_good_spec_passes() {
        check_spec(&spec()).unwrap();
        assert_eq!(table().object_bytes(256), Ok(2 * MIB));
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        type Edit = Box<dyn Fn(&mut InstanceSpec)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("no layers", Box::new(|s| s.layers.clear())),
            ("no kernel groups", Box::new(|s| s.groups.clear())),
            (
                "kernel group 0: the NL_X_TWO_NB_BS_NH_HS (1) format addresses 2 paged buffers",
                Box::new(|s| s.groups[0].kernel_layers.pop().map(|_| ()).unwrap_or(())),
            ),
            (
                "only 2 are registered",
                Box::new(|s| s.groups[0].kernel_layers[1] = 2),
            ),
            (
                "blocks_per_chunk is 0",
                Box::new(|s| s.groups[0].blocks_per_chunk = 0),
            ),
            (
                "16 blocks of 16 tokens do not make a chunk of 255 tokens",
                Box::new(|s| s.chunk_slots = 255),
            ),
            (
                "8 blocks of 16 tokens",
                Box::new(|s| s.groups[0].blocks_per_chunk = 8),
            ),
            (
                "starts at byte 16 of the object",
                Box::new(|s| s.groups[0].object_offset = 16),
            ),
            (
                "one chunk of this layout is 2097152",
                Box::new(|s| s.object_bytes += 16),
            ),
            (
                "layout addresses 6553600",
                Box::new(|s| s.layers[1].view_bytes -= 1),
            ),
            (
                "layer 0: view at offset 1",
                Box::new(|s| s.layers[0].view_offset = 1),
            ),
            ("ordinal out of range", Box::new(|s| s.ordinal = usize::MAX)),
        ];
        for (want, edit) in cases {
            let mut s = spec();
            edit(&mut s);
            let e = check_spec(&s).unwrap_err().to_string();
            assert!(e.contains(want), "want {want:?} in {e:?}");
        }
        // A layer the kernel does not address may be small.
        let mut s = spec();
        s.layers.push(raw_layer(2, 0, 64));
        check_spec(&s).unwrap();
    }

    #[test]
    fn groups_lie_end_to_end_in_the_object() {
        // Group 1: one layer of 4 heads of 64, blocks of 32 tokens (8 a chunk).
        use kvshard_layout::stride::{EngineKvFormat, PageBufferShape};
        let shape = PageBufferShape {
            kv_size: 2,
            nl: 1,
            nb: 50,
            bs: 32,
            nh: 4,
            hs: 64,
            element_size: 2,
            block_stride_elems: 0,
        };
        let t1 = StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &shape).unwrap();
        let region1 = t1.object_bytes(256).unwrap();
        assert_eq!(region1, 2 * 256 * 4 * 64 * 2);
        let mut s = spec();
        s.layers.push(raw_layer(3, 0, t1.paged_span_bytes()));
        s.groups.push(GroupSpec {
            kernel_layers: vec![2],
            table: t1,
            blocks_per_chunk: 8,
            keep_blocks: 8,
            transfer_slots: 256,
            object_offset: 2 * MIB,
        });
        s.object_bytes = 2 * MIB + region1;
        s.object_groups = ObjectGroupSpec::every(2, s.object_bytes);
        check_spec(&s).unwrap();
        assert_eq!(s.ids_per_chunk(), 24);
        let mut gap = s.clone();
        gap.groups[1].object_offset += 16;
        gap.object_bytes += 16;
        gap.object_groups[0].object_bytes += 16;
        let e = check_spec(&gap).unwrap_err().to_string();
        assert!(
            e.starts_with("object group 0: kernel group 1: its region starts at byte"),
            "{e}"
        );
        let mut short = s.clone();
        short.object_bytes -= region1;
        let e = check_spec(&short).unwrap_err().to_string();
        assert!(e.contains("one chunk of this layout is"), "{e}");
        let mut small = s.clone();
        small.layers[2].view_bytes -= 1;
        let e = check_spec(&small).unwrap_err().to_string();
        assert!(
            e.starts_with("object group 0: kernel group 1: kernel pointer 0 (layer 2)"),
            "{e}"
        );

        // Separate object groups: each group's region starts its own object;
        // the temp slots hold the largest.
        let mut split = s.clone();
        split.groups[1].object_offset = 0;
        split.object_bytes = 2 * MIB;
        split.object_groups = vec![
            ObjectGroupSpec {
                groups: vec![0],
                object_bytes: 2 * MIB,
            },
            ObjectGroupSpec {
                groups: vec![1],
                object_bytes: region1,
            },
        ];
        check_spec(&split).unwrap();
        let mut twice = split.clone();
        twice.object_groups[1].groups = vec![0];
        let e = check_spec(&twice).unwrap_err().to_string();
        assert!(
            e.starts_with("object group 1: kernel group 0 is not one"),
            "{e}"
        );
        let mut largest = split.clone();
        largest.object_bytes = 2 * MIB + region1;
        assert!(
            check_spec(&largest).is_err(),
            "temp slots sized by the largest object"
        );
        // A batch is of one object group; each moves its own groups only, and
        // a host object is its group's size.
        let chunk = |og: usize, at: usize| ChunkCopy {
            object_group: og,
            host_addr: at,
            block_ids: (0..24).collect(),
            skip_tokens: 0,
        };
        let chunks = [chunk(0, 0x1000), chunk(1, 0x2000), chunk(1, 0x3000)];
        validate_chunks(&chunks, CopyDir::ToHost, &split).unwrap();
        let b = plan_batches(&chunks, &split);
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].object_group, b[0].chunks), (0, 1));
        assert_eq!((b[1].object_group, b[1].chunks), (1, 2));
        assert_eq!(b[0].groups[0].ids.len(), 16);
        assert!(b[0].groups[1].fully_skipped());
        assert!(b[1].groups[0].fully_skipped());
        assert_eq!(
            b[1].groups[1].ids,
            [(16..24).collect::<Vec<i64>>(), (16..24).collect()].concat()
        );
        let e = validate_chunks(&[chunk(2, 0x1000)], CopyDir::ToHost, &split).unwrap_err();
        assert!(
            e.to_string()
                .contains("object group 2, of a registration of 2"),
            "{e}"
        );
        let wraps = [chunk(1, usize::MAX - region1 as usize + 1)];
        assert!(matches!(
            validate_chunks(&wraps, CopyDir::ToHost, &split),
            Err(WorkerError::HostRangeWraps { .. })
        ));
        let fits = [chunk(1, usize::MAX - region1 as usize)];
        validate_chunks(&fits, CopyDir::ToHost, &split).unwrap();
    }

    // -- layer windows and imports --------------------------------------------

    const ALLOC: u64 = 64 * MIB;

    /// Maps every key at a distinct base with ALLOC bytes (fabric keys: their
    /// alloc_size), recording opens and closes. The build host has no GPU;
    /// `import_layers` runs the same code with [`DriverIpcOpener`].
    #[derive(Default)]
    struct FakeOpener {
        opens: Vec<MappingKey>,
        closes: Vec<MappingKey>,
        fail_on_open: Option<usize>,
    }

    fn base_of(n: usize) -> u64 {
        0x7f00_0000_0000 + (n as u64 + 1) * 0x1_0000_0000
    }

    impl IpcOpener for FakeOpener {
        fn open(&mut self, key: &MappingKey) -> Result<Mapping, DeviceError> {
            if self.fail_on_open == Some(self.opens.len()) {
                self.opens.push(*key);
                return Err(DeviceError::invalid("fake failure", "fake open"));
            }
            self.opens.push(*key);
            let len = match key.source {
                super::super::ipc::MemSource::Fabric { alloc_size, .. } => alloc_size,
                super::super::ipc::MemSource::Ipc(_) => ALLOC,
            };
            Ok(Mapping {
                base: base_of(self.opens.len() - 1),
                len,
            })
        }

        fn close(&mut self, key: &MappingKey, _: Mapping) -> Result<(), DeviceError> {
            self.closes.push(*key);
            Ok(())
        }
    }

    fn registry() -> MappingRegistry<FakeOpener> {
        MappingRegistry::new(FakeOpener::default())
    }

    #[test]
    fn first_element_addresses_per_memory_kind() {
        let cuda = LayerSpec {
            memory: LayerMemory::Cuda {
                handle: IpcMemHandle([1; 64]),
                storage_offset: 0x20_0000,
                storage_bytes: 0x10_0000,
                alloc_event: Some(IpcEventHandle([9; 64])),
            },
            view_offset: 0x400,
            view_bytes: 0x10_0000 - 0x400,
        };
        let raw = LayerSpec {
            memory: LayerMemory::Raw {
                handle: IpcMemHandle([2; 64]),
                alloc_offset: 0x3000,
                nbytes: 0x8000,
            },
            view_offset: 0x100,
            view_bytes: 0x7f00,
        };
        let fabric = LayerSpec {
            memory: LayerMemory::Fabric {
                handle: FabricHandle([3; 64]),
                alloc_size: 2 * MIB,
                alloc_offset: MIB,
                nbytes: MIB,
            },
            view_offset: 0,
            view_bytes: MIB,
        };
        let mut r = registry();
        let got = import_layers(&mut r, 0, &[cuda, raw, fabric]).unwrap();
        assert_eq!(got[0].ptr, base_of(0) + 0x20_0000 + 0x400);
        assert_eq!(got[1].ptr, base_of(1) + 0x3000 + 0x100);
        assert_eq!(got[2].ptr, base_of(2) + MIB);
        assert_eq!(got[0].key, MappingKey::ipc(0, IpcMemHandle([1; 64])));
        assert_eq!(
            got[2].key,
            MappingKey::fabric(0, FabricHandle([3; 64]), 2 * MIB)
        );
        release_layers(&mut r, got.iter().map(|l| l.key));
        assert!(r.is_empty());
        assert_eq!(r.opener().closes.len(), 3);
    }

    #[test]
    fn layers_sharing_a_block_map_once_and_release_per_layer() {
        let mut r = registry();
        let layers: Vec<LayerSpec> = (0..4).map(|i| raw_layer(7, i * MIB, MIB)).collect();
        let got = import_layers(&mut r, 0, &layers).unwrap();
        assert_eq!(r.opener().opens.len(), 1);
        let key = got[0].key;
        assert_eq!(r.refs(&key), 4);
        let ptrs: Vec<u64> = got.iter().map(|l| l.ptr).collect();
        assert_eq!(
            ptrs,
            (0..4).map(|i| base_of(0) + i * MIB).collect::<Vec<_>>()
        );
        // Another instance of the same worker shares the mapping too.
        let again = import_layers(&mut r, 0, &layers[..1]).unwrap();
        assert_eq!(r.refs(&key), 5);
        release_layers(&mut r, got.iter().map(|l| l.key));
        assert_eq!(r.refs(&key), 1);
        assert!(r.opener().closes.is_empty());
        release_layers(&mut r, again.iter().map(|l| l.key));
        assert_eq!(r.opener().closes, vec![key]);
    }

    #[test]
    fn views_outside_the_shared_range_are_refused_before_mapping() {
        let cuda = |storage_offset, storage_bytes, view_offset, view_bytes| LayerSpec {
            memory: LayerMemory::Cuda {
                handle: IpcMemHandle([1; 64]),
                storage_offset,
                storage_bytes,
                alloc_event: None,
            },
            view_offset,
            view_bytes,
        };
        // Exactly filling the storage is fine.
        assert!(layer_window(0, &cuda(4096, 8192, 4096, 4096)).is_ok());
        for bad in [
            cuda(4096, 8192, 4096, 4097),
            cuda(0, 8192, 8193, 0),
            cuda(0, 8192, u64::MAX, 2),
            cuda(u64::MAX, 2, 0, 1),
        ] {
            let mut r = registry();
            assert!(import_layers(&mut r, 0, &[bad]).is_err());
            assert!(r.opener().opens.is_empty());
        }
        let fabric = LayerSpec {
            memory: LayerMemory::Fabric {
                handle: FabricHandle([3; 64]),
                alloc_size: MIB,
                alloc_offset: 4096,
                nbytes: MIB,
            },
            view_offset: 0,
            view_bytes: 1,
        };
        let e = layer_window(0, &fabric).unwrap_err().to_string();
        assert!(e.contains("exceeds"), "{e}");
    }

    #[test]
    fn a_failed_import_gives_back_every_reference() {
        // Storage beyond the mapped block: the registry refuses it.
        let mut r = registry();
        let layers = vec![
            raw_layer(1, 0, MIB),
            raw_layer(2, 0, MIB),
            raw_layer(1, ALLOC - 10, 11),
        ];
        let e = import_layers(&mut r, 0, &layers).unwrap_err().to_string();
        assert!(e.starts_with("layer 2:") && e.contains("outside"), "{e}");
        assert!(r.is_empty());
        assert_eq!(r.opener().closes.len(), 2);
        // A driver failure on the third mapping.
        let mut r = MappingRegistry::new(FakeOpener {
            fail_on_open: Some(2),
            ..FakeOpener::default()
        });
        let layers = vec![raw_layer(1, 0, 1), raw_layer(2, 0, 1), raw_layer(3, 0, 1)];
        let e = import_layers(&mut r, 0, &layers).unwrap_err().to_string();
        assert!(e.contains("fake failure"), "{e}");
        assert!(r.is_empty());
    }

    #[test]
    fn kernel_pointers_must_be_unit_aligned() {
        assert!(check_alignment(&[0x1000, 0x2010], 16).is_ok());
        let e = check_alignment(&[0x1000, 0x2008], 16).unwrap_err();
        assert!(
            matches!(e, WorkerError::Misaligned { pointer: 1, .. }),
            "{e}"
        );
        let e = e.to_string();
        assert!(e.contains("kernel pointer 1 at 0x2008"), "{e}");
        assert!(check_alignment(&[0x1004], 4).is_ok());
        assert!(check_alignment(&[0x1002], 4).is_err());
        assert!(check_alignment(&[0x1002], 2).is_ok());
        assert!(check_alignment(&[], 16).is_ok());
    }

    // -- chunk validation --------------------------------------------------

    /// A chunk of `n` ids from `first`, skipping `skip` tokens.
    fn chunk(addr: usize, first: i64, n: usize, skip: usize) -> ChunkCopy {
        ChunkCopy {
            object_group: 0,
            host_addr: addr,
            block_ids: (first..first + n as i64).collect(),
            skip_tokens: skip,
        }
    }

    #[test]
    fn chunk_validation() {
        // One group of one-token blocks, 4 a chunk, 100 blocks.
        let spec = spec_of(vec![small_group(1, 4, 100)], 4096);
        let ok = vec![chunk(0x1000, 0, 4, 0), chunk(0x9000, 96, 4, 0)];
        assert!(validate_chunks(&ok, CopyDir::ToHost, &spec).is_ok());
        assert!(validate_chunks(&[], CopyDir::ToHost, &spec).is_ok());
        let retrieve = vec![chunk(0x1000, 0, 4, 4), chunk(0x9000, 0, 4, 2)];
        assert!(validate_chunks(&retrieve, CopyDir::ToDevice, &spec).is_ok());
        let cases = [
            (chunk(0x1000, 0, 3, 0), CopyDir::ToHost, "has 3 block ids"),
            (
                chunk(0x1000, 97, 4, 0),
                CopyDir::ToHost,
                "block id 100 (index 3)",
            ),
            (chunk(0x1000, -1, 4, 0), CopyDir::ToDevice, "block id -1"),
            (
                chunk(0x1000, 0, 4, 5),
                CopyDir::ToDevice,
                "skipping 5 tokens exceeds its 4 tokens",
            ),
            (chunk(0x1000, 0, 4, 1), CopyDir::ToHost, "store cannot skip"),
            (chunk(0, 0, 4, 0), CopyDir::ToHost, "null host address"),
            (chunk(usize::MAX - 100, 0, 4, 0), CopyDir::ToDevice, "wraps"),
        ];
        for (bad, dir, want) in cases {
            let chunks = vec![chunk(0x1000, 0, 4, 0), bad];
            let e = validate_chunks(&chunks, dir, &spec)
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("chunk 1") && e.contains(want),
                "want {want:?}: {e}"
            );
        }
    }

    #[test]
    fn each_group_checks_its_own_ids() {
        // Group 0: 2 blocks a chunk of 100; group 1: 1 block of 8 tokens of 10.
        let spec = spec_of(vec![small_group(4, 2, 100), small_group(8, 1, 10)], 4096);
        assert_eq!(spec.ids_per_chunk(), 3);
        let ok = ChunkCopy {
            object_group: 0,
            host_addr: 0x1000,
            block_ids: vec![99, 98, 9],
            skip_tokens: 0,
        };
        validate_chunks(std::slice::from_ref(&ok), CopyDir::ToHost, &spec).unwrap();
        let bad = ChunkCopy {
            object_group: 0,
            block_ids: vec![99, 98, 10],
            ..ok.clone()
        };
        let e = validate_chunks(&[bad], CopyDir::ToHost, &spec)
            .unwrap_err()
            .to_string();
        assert!(e.contains("block id 10 (index 2) is outside 0..10"), "{e}");
        let short = ChunkCopy {
            object_group: 0,
            block_ids: vec![1, 2],
            ..ok
        };
        let e = validate_chunks(&[short], CopyDir::ToHost, &spec)
            .unwrap_err()
            .to_string();
        assert!(e.contains("has 2 block ids, expected 3"), "{e}");
    }

    // -- batches -----------------------------------------------------------

    fn skips(batches: &[Batch]) -> Vec<(usize, usize, usize)> {
        batches
            .iter()
            .map(|b| (b.first_chunk, b.chunks, b.groups[0].skip_blocks))
            .collect()
    }

    /// One group of one-token blocks, `bpc` a chunk.
    fn unit_spec(bpc: usize) -> InstanceSpec {
        spec_of(vec![small_group(1, bpc, 1 << 20)], 4096)
    }

    /// Chunks skipping `s[i]` blocks (= tokens: one-token blocks).
    fn with_skips(s: &[usize], bpc: usize) -> Vec<ChunkCopy> {
        s.iter()
            .enumerate()
            .map(|(i, &k)| chunk(0x1000 * (i + 1), (i * bpc) as i64, bpc, k))
            .collect()
    }

    #[test]
    fn batches_of_four_with_flat_ids() {
        assert!(plan_batches(&[], &unit_spec(4)).is_empty());
        let chunks = with_skips(&[0; 9], 2);
        let b = plan_batches(&chunks, &unit_spec(2));
        assert_eq!(skips(&b), vec![(0, 4, 0), (4, 4, 0), (8, 1, 0)]);
        assert_eq!(b[0].groups[0].ids, (0..8).collect::<Vec<i64>>());
        assert_eq!(b[1].groups[0].ids, (8..16).collect::<Vec<i64>>());
        assert_eq!(b[2].groups[0].ids, vec![16, 17]);
        assert!(!b[2].fully_skipped());
    }

    #[test]
    fn batch_skip_is_the_first_chunks_skip_when_only_it_skips() {
        let b = plan_batches(&with_skips(&[3, 0, 0, 0, 0, 0], 4), &unit_spec(4));
        assert_eq!(skips(&b), vec![(0, 4, 3), (4, 2, 0)]);
        let b = plan_batches(&with_skips(&[0, 0, 0, 0, 2, 0], 4), &unit_spec(4));
        assert_eq!(skips(&b), vec![(0, 4, 0), (4, 2, 2)]);
    }

    #[test]
    fn a_skipped_prefix_spans_chunks_like_lmcache() {
        // Two whole chunks skipped, then 3 blocks of the third.
        let b = plan_batches(&with_skips(&[4, 4, 3, 0, 0], 4), &unit_spec(4));
        assert_eq!(skips(&b), vec![(0, 4, 11), (4, 1, 0)]);
        // A batch skipped entirely.
        let b = plan_batches(&with_skips(&[4, 4, 4, 4, 4, 1], 4), &unit_spec(4));
        assert_eq!(skips(&b), vec![(0, 4, 16), (4, 2, 5)]);
        assert!(b[0].fully_skipped());
        assert!(!b[1].fully_skipped());
    }

    #[test]
    fn a_skip_after_unskipped_blocks_starts_a_new_batch() {
        let b = plan_batches(&with_skips(&[0, 0, 3, 0, 0, 0, 0], 4), &unit_spec(4));
        assert_eq!(skips(&b), vec![(0, 2, 0), (2, 4, 3), (6, 1, 0)]);
        let b = plan_batches(&with_skips(&[4, 0, 2], 4), &unit_spec(4));
        assert_eq!(skips(&b), vec![(0, 2, 4), (2, 1, 2)]);
    }

    /// lmcache 0.5.6 batches a retrieve in fixed groups of four and, per
    /// kernel group, skips `floor(max(0, skip_tokens - batch_first_token) /
    /// bs)` flat blocks of its own block size; per-chunk skips derived from
    /// the same token count give the same plan, for two groups of different
    /// block sizes at once.
    #[test]
    fn prefix_skips_reproduce_lmcache_batches() {
        let chunk_tokens = 64;
        let groups = [(16usize, 4usize), (32, 2)];
        let spec = spec_of(
            groups
                .iter()
                .map(|&(bs, bpc)| small_group(bs as u32, bpc, 1 << 20))
                .collect(),
            4096,
        );
        let n = 11;
        for skip_tokens in 0..=(n * chunk_tokens + 5) {
            let chunks: Vec<ChunkCopy> = (0..n)
                .map(|c| ChunkCopy {
                    object_group: 0,
                    host_addr: 0x1000 * (c + 1),
                    block_ids: (0..6).map(|i| (c * 6 + i) as i64).collect(),
                    skip_tokens: skip_tokens
                        .saturating_sub(c * chunk_tokens)
                        .min(chunk_tokens),
                })
                .collect();
            let got = plan_batches(&chunks, &spec);
            for (g, &(bs, bpc)) in groups.iter().enumerate() {
                let got: Vec<_> = got
                    .iter()
                    .map(|b| (b.first_chunk, b.chunks, b.groups[g].skip_blocks))
                    .collect();
                let want: Vec<(usize, usize, usize)> = (0..n)
                    .step_by(MAX_OBJECTS)
                    .map(|first| {
                        let chunks = MAX_OBJECTS.min(n - first);
                        let start = first * chunk_tokens;
                        let skip = (skip_tokens.saturating_sub(start) / bs).min(chunks * bpc);
                        (first, chunks, skip)
                    })
                    .collect();
                assert_eq!(got, want, "group {g}, skip_tokens {skip_tokens}");
            }
        }
    }

    #[test]
    fn each_group_launches_over_its_own_slice_of_the_ids() {
        // Group 0: 2 blocks of 4 tokens a chunk; group 1: 1 block of 8.
        let spec = spec_of(vec![small_group(4, 2, 100), small_group(8, 1, 100)], 4096);
        let chunks: Vec<ChunkCopy> = (0..3)
            .map(|c| ChunkCopy {
                object_group: 0,
                host_addr: 0x1000 * (c + 1),
                block_ids: vec![10 * c as i64, 10 * c as i64 + 1, 50 + c as i64],
                // 5 tokens of the first chunk: one block of group 0, none of
                // group 1 (a partial block is rewritten).
                skip_tokens: if c == 0 { 5 } else { 0 },
            })
            .collect();
        let b = plan_batches(&chunks, &spec);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].groups[0].ids, vec![0, 1, 10, 11, 20, 21]);
        assert_eq!(b[0].groups[0].skip_blocks, 1);
        assert_eq!(b[0].groups[1].ids, vec![50, 51, 52]);
        assert_eq!(b[0].groups[1].skip_blocks, 0);
        // A chunk that skips in one group only still starts a new batch
        // after unskipped blocks.
        let mut late = chunks.clone();
        late[0].skip_tokens = 0;
        late[2].skip_tokens = 4;
        let b = plan_batches(&late, &spec);
        assert_eq!(
            b.iter()
                .map(|b| (b.first_chunk, b.chunks))
                .collect::<Vec<_>>(),
            vec![(0, 2), (2, 1)]
        );
        assert_eq!(b[1].groups[0].skip_blocks, 1);
        assert_eq!(b[1].groups[1].skip_blocks, 0);
    }

    #[test]
    fn a_sliding_window_group_moves_the_last_blocks_of_each_chunk() {
        // Group 1 keeps the last 2 of its 4 blocks a chunk (a window of 8 of
        // 16 tokens).
        let mut window = small_group(4, 4, 100);
        window.keep_blocks = 2;
        window.transfer_slots = 8;
        let spec = spec_of(vec![small_group(4, 4, 100), window], 4096);
        let chunk = |c: i64, skip| ChunkCopy {
            object_group: 0,
            host_addr: 0x1000,
            block_ids: (0..8).map(|i| 10 * c + i).collect(),
            skip_tokens: skip,
        };
        let b = plan_batches(&[chunk(0, 0), chunk(1, 0)], &spec);
        assert_eq!(b[0].groups[0].ids, vec![0, 1, 2, 3, 10, 11, 12, 13]);
        assert_eq!(b[0].groups[1].ids, vec![6, 7, 16, 17]);
        // Skipping 13 tokens: 3 blocks of the chunk, of which the window's
        // first (position 2) is one.
        let b = plan_batches(&[chunk(0, 13), chunk(1, 0)], &spec);
        assert_eq!(
            (b[0].groups[0].skip_blocks, b[0].groups[1].skip_blocks),
            (3, 1)
        );
        // A whole chunk skipped skips the window's blocks of it too.
        let b = plan_batches(&[chunk(0, 16), chunk(1, 5)], &spec);
        assert_eq!(
            (b[0].groups[0].skip_blocks, b[0].groups[1].skip_blocks),
            (5, 2)
        );
        assert_eq!(b.len(), 1);
        // Under 2 blocks skipped, the window is untouched.
        assert_eq!(spec.groups[1].kept_skip(7), 0);
        let mut bad = spec.clone();
        bad.groups[1].transfer_slots = 12;
        bad.layers = vec![raw_layer(1, 0, 1 << 20)];
        let e = check_group(&bad, &bad.groups[1], 0, bad.object_bytes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("moves 2 of 4 blocks of 4 tokens"), "{e}");
    }

    /// Every pattern of per-chunk skips (bpc 3, up to 6 chunks): the flat
    /// blocks each batch touches are exactly the blocks at or after each
    /// chunk's own skip, batches cover the chunks in order, 1..=4 each.
    #[test]
    fn every_chunk_skip_is_honoured_exactly() {
        let bpc = 3;
        let spec = unit_spec(bpc);
        for n in 0..=6u32 {
            for code in 0..4usize.pow(n) {
                let s: Vec<usize> = (0..n).map(|i| (code / 4usize.pow(i)) % 4).collect();
                let chunks = with_skips(&s, bpc);
                let batches = plan_batches(&chunks, &spec);
                let mut next = 0;
                for b in &batches {
                    let g = &b.groups[0];
                    assert_eq!(b.first_chunk, next, "{s:?}");
                    assert!((1..=MAX_OBJECTS).contains(&b.chunks), "{s:?}");
                    assert_eq!(g.ids.len(), b.chunks * bpc);
                    for f in 0..g.ids.len() {
                        let c = b.first_chunk + f / bpc;
                        assert_eq!(g.ids[f], chunks[c].block_ids[f % bpc]);
                        let touched = f >= g.skip_blocks;
                        let wanted = f % bpc >= chunks[c].skip_tokens;
                        assert_eq!(touched, wanted, "{s:?} batch {b:?} flat {f}");
                    }
                    next += b.chunks;
                }
                assert_eq!(next, chunks.len());
            }
        }
    }

    // -- host copies -------------------------------------------------------

    fn pin_view(base: u64, len: u64, piece: u64) -> PinView {
        PinView {
            base,
            len,
            pieces: plan_pieces(base, len, piece).unwrap(),
        }
    }

    fn parts(v: &[HostPart]) -> Vec<(u64, u64)> {
        v.iter().map(|p| (p.offset, p.len)).collect()
    }

    #[test]
    fn host_copies_are_cut_at_pinned_pieces() {
        let base = 0x4000_0000;
        let pin = pin_view(base, 150 * MIB, 64 * MIB);
        let p = |addr, len| parts(&host_copy_parts(Some(&pin), addr, len).unwrap());
        // No arena, or outside it: one copy.
        assert_eq!(
            parts(&host_copy_parts(None, base + 60 * MIB, 8 * MIB).unwrap()),
            vec![(0, 8 * MIB)]
        );
        assert_eq!(p(base - 8 * MIB, 8 * MIB), vec![(0, 8 * MIB)]);
        assert_eq!(p(base + 150 * MIB, 8 * MIB), vec![(0, 8 * MIB)]);
        // Inside one piece.
        assert_eq!(p(base + 64 * MIB, 2 * MIB), vec![(0, 2 * MIB)]);
        // Across a boundary.
        assert_eq!(p(base + 63 * MIB, 2 * MIB), vec![(0, MIB), (MIB, MIB)]);
        // Across two boundaries.
        assert_eq!(
            p(base + 60 * MIB, 80 * MIB),
            vec![(0, 4 * MIB), (4 * MIB, 64 * MIB), (68 * MIB, 12 * MIB)]
        );
        // Straddling the arena's start and end.
        assert_eq!(p(base - MIB, 2 * MIB), vec![(0, MIB), (MIB, MIB)]);
        assert_eq!(p(base + 149 * MIB, 3 * MIB), vec![(0, MIB), (MIB, 2 * MIB)]);
        assert_eq!(
            p(base - MIB, 152 * MIB),
            vec![
                (0, MIB),
                (MIB, 64 * MIB),
                (65 * MIB, 64 * MIB),
                (129 * MIB, 22 * MIB),
                (151 * MIB, MIB)
            ]
        );
        assert!(p(base, 0).is_empty());
        assert!(host_copy_parts(Some(&pin), u64::MAX, 2).is_err());
    }

    /// Byte model: parts tile the range in order and none crosses a piece
    /// boundary or the arena's edges.
    #[test]
    fn host_parts_match_a_byte_model() {
        let (base, piece) = (1 << 20, 4096u64);
        let pin = pin_view(base, 5 * piece + 100, piece);
        let piece_of = |a: u64| {
            if a < base || a >= base + pin.len {
                None
            } else {
                Some((a - base) / piece)
            }
        };
        for addr in (base - 3 * piece..base + 7 * piece).step_by(777) {
            for len in (1..4 * piece).step_by(1013) {
                let got = host_copy_parts(Some(&pin), addr, len).unwrap();
                let mut pos = 0;
                for p in &got {
                    assert_eq!(p.offset, pos);
                    assert!(p.len > 0);
                    let (a, z) = (addr + p.offset, addr + p.offset + p.len - 1);
                    assert_eq!(piece_of(a), piece_of(z), "{addr:#x}+{len}: {p:?}");
                    pos += p.len;
                }
                assert_eq!(pos, len);
            }
        }
    }

    // -- the threads without a usable GPU -----------------------------------

    /// A CudaEnv that lists a device no driver has: opening it fails on this
    /// host (no libcuda) and on a GPU host alike (no such ordinal).
    const FAKE: usize = 4096;

    fn fake_env() -> CudaEnv {
        CudaEnv {
            driver_version: 12080,
            devices: vec![CudaDevice {
                ordinal: FAKE as u32,
                uuid: "00000000-0000-0000-0000-000000000000".into(),
                name: "none".into(),
                compute_capability: (9, 0),
            }],
        }
    }

    /// Runs `f` on another thread and fails if it has not finished in time.
    fn within(secs: u64, f: impl FnOnce() + Send + 'static) {
        let (tx, rx) = channel();
        let t = std::thread::spawn(move || {
            f();
            let _ = tx.send(());
        });
        match rx.recv_timeout(Duration::from_secs(secs)) {
            Ok(()) => t.join().unwrap(),
            Err(_) => {
                if t.is_finished() {
                    // Panicked: surface its message.
                    t.join().unwrap();
                }
                panic!("hung for {secs} s");
            }
        }
    }

    fn register_job(iid: i64, tx: Sender<(i64, Result<(), WorkerError>)>) -> DeviceJob {
        let mut s = spec();
        s.ordinal = FAKE;
        DeviceJob::Register {
            iid,
            spec: s,
            done: Box::new(move |r| tx.send((iid, r)).unwrap()),
        }
    }

    fn transfer_job(iid: i64, tx: Sender<(i64, Result<Vec<u8>, WorkerError>)>) -> DeviceJob {
        DeviceJob::Transfer {
            iid,
            dir: CopyDir::ToDevice,
            worker_event: Some(vec![0; 64]),
            chunks: vec![chunk(0x1000, 0, 16, 0)],
            done: Box::new(move |r| tx.send((iid, r)).unwrap()),
        }
    }

    fn threads(pin: Option<(usize, usize)>, depth: usize) -> DeviceThreads {
        // SAFETY: the fake device never opens, so nothing is pinned and no
        // host range is ever copied.
        unsafe { DeviceThreads::with_queue_depth(fake_env(), pin, Arc::new(()), depth) }
    }

    #[test]
    fn an_unusable_device_answers_every_job_with_the_reason() {
        within(30, || {
            let arena = vec![0u8; 3 * 4096].into_boxed_slice();
            let base = (arena.as_ptr() as usize).next_multiple_of(4096);
            let keep: Arc<dyn Any + Send + Sync> = Arc::new(arena);
            // SAFETY: the arena is a live allocation kept by `keep`; the
            // device never opens, so it is never registered or copied.
            let t = unsafe { DeviceThreads::new(fake_env(), Some((base, 4096)), keep) };
            let (rtx, rrx) = channel();
            let (ttx, trx) = channel();
            t.submit(FAKE, register_job(1, rtx.clone())).unwrap();
            t.submit(FAKE, DeviceJob::Unregister { iid: 1 }).unwrap();
            t.submit(FAKE, transfer_job(1, ttx.clone())).unwrap();
            let (iid, r) = rrx.recv().unwrap();
            assert_eq!(iid, 1);
            let e = r.unwrap_err();
            assert!(
                matches!(e, WorkerError::Unusable { ordinal: FAKE, .. }),
                "{e}"
            );
            assert!(matches!(e.root(), WorkerError::Device(_)), "{e}");
            let e = e.to_string();
            assert!(
                e.contains(&format!("CUDA device {FAKE} is unusable")),
                "{e}"
            );
            assert!(e.contains(&format!("opening CUDA device {FAKE}")), "{e}");
            let e = trx.recv().unwrap().1.unwrap_err().to_string();
            assert!(e.contains("unusable"), "{e}");
            // Later jobs, after the thread has failed, are answered too.
            for iid in 2..6 {
                t.submit(FAKE, register_job(iid, rtx.clone())).unwrap();
                t.submit(FAKE, transfer_job(iid, ttx.clone())).unwrap();
            }
            for iid in 2..6 {
                assert_eq!(rrx.recv().unwrap().0, iid);
                assert!(trx.recv().unwrap().1.is_err());
            }
            drop(t);
            // Nothing was left unanswered.
            drop((rtx, ttx));
            assert!(rrx.recv().is_err());
            assert!(trx.recv().is_err());
        });
    }

    #[test]
    fn jobs_queued_at_drop_are_still_answered() {
        within(30, || {
            let t = threads(None, 64);
            let (tx, rx) = channel();
            for iid in 0..50 {
                t.submit(FAKE, transfer_job(iid, tx.clone())).unwrap();
            }
            drop(t);
            drop(tx);
            let answered: Vec<i64> = rx
                .iter()
                .map(|(iid, r)| {
                    assert!(r.is_err());
                    iid
                })
                .collect();
            assert_eq!(answered, (0..50).collect::<Vec<_>>());
        });
    }

    #[test]
    fn an_unknown_ordinal_hands_the_job_back() {
        within(30, || {
            let t = threads(None, 4);
            let (tx, rx) = channel();
            let job = t.submit(3, transfer_job(9, tx)).unwrap_err();
            assert_eq!(
                format!("{job:?}"),
                "Transfer { iid: 9, dir: ToDevice, chunks: 1, .. }"
            );
            let back = t.submit(7, DeviceJob::Unregister { iid: 9 }).unwrap_err();
            assert_eq!(format!("{back:?}"), "Unregister { iid: 9 }");
            // Nothing ran it; the caller answers it itself.
            assert!(rx.try_recv().is_err());
            let DeviceJob::Transfer { done, .. } = job else {
                panic!("not the transfer")
            };
            done(Err(WorkerError::UnknownInstance {
                device: 3,
                instance: 9,
            }));
            let (iid, r) = rx.recv().unwrap();
            assert_eq!(iid, 9);
            assert!(
                matches!(
                    r,
                    Err(WorkerError::UnknownInstance {
                        device: 3,
                        instance: 9
                    })
                ),
                "{r:?}"
            );
            drop(t);
        });
    }

    #[test]
    fn a_full_queue_hands_the_job_back() {
        within(30, || {
            let t = threads(None, 2);
            let (started_tx, started_rx) = channel();
            let (release_tx, release_rx) = channel::<()>();
            // The first job's answer blocks the thread until released.
            t.submit(
                FAKE,
                DeviceJob::Register {
                    iid: 1,
                    spec: spec(),
                    done: Box::new(move |_| {
                        started_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                    }),
                },
            )
            .unwrap();
            started_rx.recv().unwrap();
            let (tx, rx) = channel();
            t.submit(FAKE, transfer_job(2, tx.clone())).unwrap();
            t.submit(FAKE, transfer_job(3, tx.clone())).unwrap();
            let back = t.submit(FAKE, transfer_job(4, tx.clone())).unwrap_err();
            assert!(matches!(back, DeviceJob::Transfer { iid: 4, .. }));
            release_tx.send(()).unwrap();
            assert_eq!(rx.recv().unwrap().0, 2);
            assert_eq!(rx.recv().unwrap().0, 3);
            // Room again.
            t.submit(FAKE, transfer_job(5, tx.clone())).unwrap();
            assert_eq!(rx.recv().unwrap().0, 5);
        });
    }

    #[test]
    fn a_panicking_callback_does_not_kill_the_thread() {
        within(30, || {
            let t = threads(None, 8);
            t.submit(
                FAKE,
                DeviceJob::Register {
                    iid: 1,
                    spec: spec(),
                    done: Box::new(|_| panic!("callback bug")),
                },
            )
            .unwrap();
            let (tx, rx) = channel();
            t.submit(FAKE, transfer_job(2, tx)).unwrap();
            assert!(rx.recv().unwrap().1.is_err());
        });
    }

    #[test]
    fn dropping_unused_threads_is_immediate() {
        within(10, || drop(threads(Some((0x1000, 4096)), 1)));
    }

    #[test]
    fn pin_phases_settle_without_a_device() {
        // An owner that never registered (e.g. it panicked while pinning)
        // marks the arena failed and wakes the waiters.
        let shared = Arc::new(PinShared {
            state: Mutex::new(PinState {
                phase: PinPhase::Registering,
                users: 0,
            }),
            cv: Condvar::new(),
        });
        drop(PinOwner {
            shared: shared.clone(),
            region: None,
        });
        assert!(matches!(shared.lock().phase, PinPhase::Failed));
        // An owner waits for its users before releasing.
        let shared = Arc::new(PinShared {
            state: Mutex::new(PinState {
                phase: PinPhase::Registered(pin_view(0x10000, 4096, 4096)),
                users: 1,
            }),
            cv: Condvar::new(),
        });
        let user = PinUser {
            shared: shared.clone(),
        };
        let (tx, rx) = channel();
        let for_owner = shared.clone();
        let h = std::thread::spawn(move || {
            drop(PinOwner {
                shared: for_owner,
                region: None,
            });
            tx.send(()).unwrap();
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "owner did not wait"
        );
        drop(user);
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        h.join().unwrap();
        assert_eq!(shared.lock().users, 0);
    }
}
