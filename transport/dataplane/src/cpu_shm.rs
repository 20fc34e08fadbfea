//! lmcache_driven transfers for CPU workers: the `cpu_shm` path.
//!
//! A CPU worker (vLLM on CPU, `lmcache bench server --mode cpu
//! --transfer-mode lmcache_driven`) moves every per-layer paged KV tensor into
//! a POSIX shm segment (`/lmcache_kv_<pid>_<n>`) and registers one
//! `CpuShmIPCData` per tensor with REGISTER_KV_CACHE. The server maps the same
//! pages read-write. On STORE it gathers the blocks of one chunk into the
//! contiguous L1 object; on RETRIEVE it scatters an object back into blocks.
//!
//! Byte format of one object (one chunk of `T` tokens; must match lmcache
//! 0.5.6 byte for byte because objects are shared through S3):
//! `[kv_size][num_layers][T][num_heads * head_size]` in the engine dtype,
//! C order. `kv_size` is 2 (K plane, then V plane) or 1 (MLA, fused K/V);
//! layers are the group's layers in ascending index order; token `t` comes
//! from block `block_ids[t / block_size]`, slot `t % block_size`; inside a
//! token, heads then head elements, whatever the worker's NHD/HND order.
//!
//! What the tensors mean (format detection, geometry, the object's shape,
//! checksums) is `kvshard_layout`'s, shared with the CUDA path; this module
//! maps the segments and moves the bytes.

use std::collections::HashMap;
use std::ffi::CString;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::ptr;

use kvshard_layout::checksum::{
    checksum_axis, digest_kv, index_select_runs, ChecksumDigests, ChecksumRefusal, ChecksumReport,
};
use kvshard_layout::geometry::{analyse, Analysis};
use kvshard_layout::{
    DetectError, Geometry, KernelGroup, ObjectGroup, ObjectLayout, ShmTensorSpec,
};
use kvshard_wire::EngineGroupInfo;
use md5::Md5;
use memmap2::{MmapOptions, MmapRaw};

/// NAME_MAX for a shm name, leading '/' included.
const MAX_SHM_NAME_BYTES: usize = 255;

/// Why a registration, transfer or checksum request failed.
#[derive(Debug)]
pub enum TransferError {
    /// A layout, dtype or configuration this path does not implement.
    Unsupported(String),
    /// The registration or request is malformed.
    Invalid(String),
    /// A system call on a shm segment failed.
    Shm {
        op: &'static str,
        name: String,
        source: io::Error,
    },
    /// A tensor view reaches past the end of its segment.
    SegmentTooSmall {
        name: String,
        needed_bytes: u64,
        segment_bytes: u64,
    },
    /// A block id is neither a valid block nor the null block id.
    BlockIdOutOfRange {
        block_id: i64,
        num_blocks: usize,
        null_block_id: i64,
    },
    /// A chunk came with the wrong number of block ids.
    BlockCount { expected: usize, actual: usize },
    /// An object buffer has the wrong length.
    BufferSize { expected: usize, actual: usize },
    /// An object of an object group the registration does not have.
    ObjectGroup { og: usize, groups: usize },
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransferError::Unsupported(msg) => write!(f, "cpu_shm transfer: unsupported: {msg}"),
            TransferError::Invalid(msg) => write!(f, "cpu_shm transfer: invalid: {msg}"),
            TransferError::Shm { op, name, source } => {
                write!(
                    f,
                    "cpu_shm transfer: {op} of shm segment '{name}' failed: {source}"
                )
            }
            TransferError::SegmentTooSmall {
                name,
                needed_bytes,
                segment_bytes,
            } => write!(
                f,
                "cpu_shm transfer: shm segment '{name}' is {segment_bytes} bytes but the \
                 tensor view needs {needed_bytes}"
            ),
            TransferError::BlockIdOutOfRange {
                block_id,
                num_blocks,
                null_block_id,
            } => write!(
                f,
                "cpu_shm transfer: block id {block_id} is outside 0..{num_blocks} and is \
                 not the null block id {null_block_id}"
            ),
            TransferError::BlockCount { expected, actual } => write!(
                f,
                "cpu_shm transfer: a chunk needs {expected} block ids, got {actual}"
            ),
            TransferError::BufferSize { expected, actual } => write!(
                f,
                "cpu_shm transfer: object buffer must be {expected} bytes, got {actual}"
            ),
            TransferError::ObjectGroup { og, groups } => write!(
                f,
                "cpu_shm transfer: object group {og} of a registration of {groups} object \
                 groups"
            ),
        }
    }
}

impl std::error::Error for TransferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TransferError::Shm { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<DetectError> for TransferError {
    fn from(e: DetectError) -> Self {
        match e {
            DetectError::Unsupported(msg) => TransferError::Unsupported(msg),
            DetectError::Invalid(msg) => TransferError::Invalid(msg),
            DetectError::SegmentTooSmall {
                name,
                needed_bytes,
                segment_bytes,
            } => TransferError::SegmentTooSmall {
                name,
                needed_bytes,
                segment_bytes,
            },
        }
    }
}

fn invalid(msg: impl Into<String>) -> TransferError {
    TransferError::Invalid(msg.into())
}

/// One mapped segment.
struct Segment {
    name: String,
    map: MmapRaw,
}

/// Where one layer's tensor lives and how to walk it. All counts are elements.
struct LayerView {
    geometry: Geometry,
    segment: usize,
    storage_offset: usize,
    /// Normalised (stride-ordered) shape and strides, for checksums.
    shape: Vec<usize>,
    strides: Vec<usize>,
    plane_stride: usize,
    block_stride: usize,
    token_stride: usize,
    head_stride: usize,
    runs: BlockRuns,
    /// Consecutive block ids are consecutive in memory: one copy spans them.
    blocks_adjacent: bool,
}

/// How one (plane, block) of a layer splits into contiguous runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockRuns {
    /// The whole block is one run of `block_size * hidden` elements (NHD).
    Whole,
    /// One run of `hidden` elements per token.
    PerToken,
    /// One run of `head_size` elements per (token, head) (HND).
    PerTokenHead,
}

/// A worker's registered CPU KV cache, mapped read-write.
///
/// Plain copies are sound enough here: the worker only touches the blocks of a
/// request while it is not waiting on the server for that request. The
/// mappings are only ever accessed through raw pointers, never references.
pub struct CpuShmRegistration {
    segments: Vec<Segment>,
    /// Every registered tensor, in registration order.
    layers: Vec<LayerView>,
    /// The kernel groups, in object order; each reads its own block list.
    groups: Vec<KernelGroup>,
    object_layout: ObjectLayout,
    /// The object groups: one object per chunk and group.
    object_groups: Vec<ObjectGroup>,
    chunk_size_tokens: usize,
    /// Block ids of one chunk, every group's end to end.
    ids_per_chunk: usize,
    null_block_id: i64,
}

impl fmt::Debug for CpuShmRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|k| {
                let g = &k.geometry;
                format!(
                    "{} {} x{} ({} blocks of {})",
                    g.format.name(),
                    g.dtype.name(),
                    k.layers.len(),
                    g.num_blocks,
                    g.block_size
                )
            })
            .collect();
        f.debug_struct("CpuShmRegistration")
            .field("registered_tensors", &self.layers.len())
            .field("kernel_groups", &groups)
            .field(
                "segments",
                &self
                    .segments
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn validate_shm_name(name: &str) -> Result<CString, TransferError> {
    let rest = name.strip_prefix('/').unwrap_or("");
    if rest.is_empty() || rest.contains('/') || name.len() > MAX_SHM_NAME_BYTES {
        return Err(invalid(format!(
            "shm name '{name}' must be '/' followed by 1..{} bytes without '/'",
            MAX_SHM_NAME_BYTES - 1
        )));
    }
    CString::new(name).map_err(|_| invalid(format!("shm name '{name}' contains a NUL byte")))
}

/// Open an existing segment read-write and map `len` bytes of it.
fn map_segment(name: &str, len: u64) -> Result<Segment, TransferError> {
    let c_name = validate_shm_name(name)?;
    let os_err = |op: &'static str| TransferError::Shm {
        op,
        name: name.to_string(),
        source: io::Error::last_os_error(),
    };
    // O_NOFOLLOW: a worker must not be able to point us at another file.
    // SAFETY: c_name is a valid NUL-terminated string.
    let fd = unsafe {
        libc::shm_open(
            c_name.as_ptr(),
            libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(os_err("shm_open"));
    }
    // SAFETY: fd is a freshly opened descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    let meta = file.metadata().map_err(|source| TransferError::Shm {
        op: "fstat",
        name: name.to_string(),
        source,
    })?;
    if !meta.file_type().is_file() {
        return Err(invalid(format!(
            "shm segment '{name}' is not a regular file"
        )));
    }
    // Touching a mapping beyond the end of the file raises SIGBUS.
    if meta.len() < len {
        return Err(TransferError::SegmentTooSmall {
            name: name.to_string(),
            needed_bytes: len,
            segment_bytes: meta.len(),
        });
    }
    let len_usize = usize::try_from(len).map_err(|_| invalid("segment length overflows"))?;
    let map = MmapOptions::new()
        .len(len_usize)
        .map_raw(&file)
        .map_err(|source| TransferError::Shm {
            op: "mmap",
            name: name.to_string(),
            source,
        })?;
    Ok(Segment {
        name: name.to_string(),
        map,
    })
}

impl CpuShmRegistration {
    /// Map and validate a worker's registration.
    ///
    /// `kv_layout_hint` is REGISTER_KV_CACHE's `layout_hints["kv_layout"]`
    /// (`NHD`, `HND`, `BLHNC`, `BLNHC`); `None` behaves like a 0.5.6 server
    /// without an accelerator (HND, see [`default_kv_layout`]).
    /// `null_block_id` is the server's `--null-block-id`.
    pub fn open(
        tensors: &[ShmTensorSpec],
        groups: &[EngineGroupInfo],
        chunk_size_tokens: usize,
        kv_layout_hint: Option<&str>,
        null_block_id: i64,
    ) -> Result<Self, TransferError> {
        Self::open_grouped(
            tensors,
            groups,
            chunk_size_tokens,
            kv_layout_hint,
            null_block_id,
            false,
        )
    }

    /// [`open`](Self::open), with the kernel groups bucketed into object
    /// groups as 0.5.6 does under `--separate-object-groups` when `separate`.
    pub fn open_grouped(
        tensors: &[ShmTensorSpec],
        groups: &[EngineGroupInfo],
        chunk_size_tokens: usize,
        kv_layout_hint: Option<&str>,
        null_block_id: i64,
        separate: bool,
    ) -> Result<Self, TransferError> {
        let Analysis {
            checked,
            normalised,
            layers: geometries,
            groups,
            object_layout,
            object_groups,
        } = analyse(tensors, groups, chunk_size_tokens, kv_layout_hint, separate)?;

        // One mapping per distinct segment; layers may share one.
        let mut segment_len: HashMap<&str, u64> = HashMap::new();
        for spec in tensors {
            let len = segment_len.entry(spec.shm_name.as_str()).or_insert(0);
            *len = (*len).max(spec.nbytes);
        }
        let mut segment_index: HashMap<&str, usize> = HashMap::new();
        let mut segments = Vec::new();
        for spec in tensors {
            if !segment_index.contains_key(spec.shm_name.as_str()) {
                let seg = map_segment(&spec.shm_name, segment_len[spec.shm_name.as_str()])?;
                segment_index.insert(spec.shm_name.as_str(), segments.len());
                segments.push(seg);
            }
        }

        let mut layers = Vec::with_capacity(tensors.len());
        for ((spec, geometry), ((_, _, _, storage_offset), (shape, strides))) in tensors
            .iter()
            .zip(geometries)
            .zip(checked.into_iter().zip(normalised))
        {
            let axes = geometry.format.axes();
            let hidden = geometry.hidden();
            let plane_stride = axes.plane.map_or(0, |p| strides[p]);
            let head_stride = axes.head.map_or(geometry.head_size, |h| strides[h]);
            let token_stride = strides[axes.token];
            let block_stride = strides[axes.block];
            let heads_packed = geometry.num_heads == 1 || head_stride == geometry.head_size;
            let runs = if heads_packed && (geometry.block_size == 1 || token_stride == hidden) {
                BlockRuns::Whole
            } else if heads_packed {
                BlockRuns::PerToken
            } else {
                BlockRuns::PerTokenHead
            };
            let blocks_adjacent =
                runs == BlockRuns::Whole && block_stride == geometry.block_size * hidden;
            layers.push(LayerView {
                geometry,
                segment: segment_index[spec.shm_name.as_str()],
                storage_offset,
                shape,
                strides,
                plane_stride,
                block_stride,
                token_stride,
                head_stride,
                runs,
                blocks_adjacent,
            });
        }

        Ok(CpuShmRegistration {
            segments,
            layers,
            ids_per_chunk: groups.iter().map(|k| k.blocks_per_chunk).sum(),
            groups,
            object_layout,
            object_groups,
            chunk_size_tokens,
            null_block_id,
        })
    }

    /// The kernel groups, in object order.
    pub fn kernel_groups(&self) -> &[KernelGroup] {
        &self.groups
    }

    /// All registered tensors, including any no group holds.
    pub fn num_registered_tensors(&self) -> usize {
        self.layers.len()
    }

    /// Block ids of one chunk: each group's `blocks_per_chunk`, end to end
    /// in group order.
    pub fn ids_per_chunk(&self) -> usize {
        self.ids_per_chunk
    }

    pub fn chunk_size_tokens(&self) -> usize {
        self.chunk_size_tokens
    }

    pub fn null_block_id(&self) -> i64 {
        self.null_block_id
    }

    /// Bytes of KV per token over every group's layers (0.5.6's
    /// `cache_size_per_token` for uncompressed groups).
    pub fn cache_size_per_token(&self) -> usize {
        self.groups.iter().map(KernelGroup::bytes_per_token).sum()
    }

    /// Object group 0's object of one full chunk (the only one unless
    /// object groups are separate).
    pub fn object_layout(&self) -> ObjectLayout {
        self.object_layout.clone()
    }

    /// The object groups, by id.
    pub fn object_groups(&self) -> &[ObjectGroup] {
        &self.object_groups
    }

    /// Each group's slice of a chunk's block ids (`ids_per_chunk` long).
    fn group_ids<'a>(
        &'a self,
        block_ids: &'a [i64],
    ) -> impl Iterator<Item = (&'a KernelGroup, &'a [i64])> + 'a {
        let mut start = 0;
        self.groups.iter().map(move |k| {
            let ids = &block_ids[start..start + k.blocks_per_chunk];
            start += k.blocks_per_chunk;
            (k, ids)
        })
    }

    /// [`group_ids`](Self::group_ids) of object group `og`'s kernel groups.
    fn object_group_ids<'a>(
        &'a self,
        og: usize,
        block_ids: &'a [i64],
    ) -> impl Iterator<Item = (&'a KernelGroup, &'a [i64])> + 'a {
        let members = self
            .object_groups
            .get(og)
            .map_or(&[][..], |o| &o.kernel_groups[..]);
        self.group_ids(block_ids)
            .enumerate()
            .filter(move |(g, _)| members.contains(g))
            .map(|(_, x)| x)
    }

    /// Whether every block id object group `og`'s kernel groups have in a
    /// chunk's list is the null block id: such a chunk carries no KV of the
    /// group (0.5.6's `all_null_chunk_masks`).
    pub fn all_null_in(&self, og: usize, block_ids: &[i64]) -> bool {
        self.object_groups.get(og).is_some_and(|o| {
            kvshard_layout::geometry::object_group_all_null(
                &self.groups,
                o,
                block_ids,
                self.null_block_id,
            )
        })
    }

    /// Every id of a chunk's list (`ids_per_chunk` long, the groups' ids
    /// end to end) must be a block of its group's cache or the null block id.
    pub fn validate_block_ids(&self, block_ids: &[i64]) -> Result<(), TransferError> {
        if block_ids.len() != self.ids_per_chunk {
            return Err(TransferError::BlockCount {
                expected: self.ids_per_chunk,
                actual: block_ids.len(),
            });
        }
        for (k, ids) in self.group_ids(block_ids) {
            let num_blocks = k.geometry.num_blocks;
            for &id in ids {
                let in_range = usize::try_from(id).is_ok_and(|b| b < num_blocks);
                if !in_range && id != self.null_block_id {
                    return Err(TransferError::BlockIdOutOfRange {
                        block_id: id,
                        num_blocks,
                        null_block_id: self.null_block_id,
                    });
                }
            }
        }
        Ok(())
    }

    fn check_chunk(
        &self,
        og: usize,
        block_ids: &[i64],
        buf_len: usize,
    ) -> Result<(), TransferError> {
        let Some(group) = self.object_groups.get(og) else {
            return Err(TransferError::ObjectGroup {
                og,
                groups: self.object_groups.len(),
            });
        };
        let bytes = group.layout.bytes as usize;
        if buf_len != bytes {
            return Err(TransferError::BufferSize {
                expected: bytes,
                actual: buf_len,
            });
        }
        self.validate_block_ids(block_ids)
    }

    /// Copy the chunk's blocks (`block_ids.len() == ids_per_chunk()`: each
    /// group's block ids for tokens `chunk_start..chunk_start + T`, end to
    /// end) into `dst`, which is `object_layout().bytes` long. A null block
    /// id that is a real block is read like any other block (as 0.5.6 does);
    /// one outside the cache yields zeros.
    pub fn gather(&self, block_ids: &[i64], dst: &mut [u8]) -> Result<(), TransferError> {
        self.gather_group(0, block_ids, dst)
    }

    /// [`gather`](Self::gather) of object group `og`'s object, which is
    /// `object_groups()[og].layout.bytes` long.
    pub fn gather_group(
        &self,
        og: usize,
        block_ids: &[i64],
        dst: &mut [u8],
    ) -> Result<(), TransferError> {
        self.check_chunk(og, block_ids, dst.len())?;
        let dst_len = dst.len();
        let dst_ptr = dst.as_mut_ptr();
        for (group, ids) in self.object_group_ids(og, block_ids) {
            // A sliding window shorter than the chunk moves the chunk's last
            // blocks into the start of the region; the rest is zeros.
            let moved = group_moved_bytes(group);
            let region = group.object_offset as usize;
            let region_end = region + group.region_bytes as usize;
            assert!(region_end <= dst_len, "region out of bounds");
            // SAFETY: inside the object buffer, checked just above.
            unsafe {
                ptr::write_bytes(dst_ptr.add(region + moved), 0, region_end - region - moved)
            };
            let kept = &ids[ids.len() - group.keep_blocks..];
            self.for_each_span(group, kept, 0, false, |shm, obj, len| {
                assert!(obj + len <= dst_len, "object range out of bounds");
                match shm {
                    Some((seg, off)) => {
                        let map = &self.segments[seg].map;
                        assert!(off + len <= map.len(), "shm range out of bounds");
                        // SAFETY: both ranges were bounds-checked just above;
                        // the object buffer and the shm mapping never overlap.
                        unsafe { copy_run(map.as_ptr().add(off), dst_ptr.add(obj), len) };
                    }
                    // SAFETY: range checked above.
                    None => unsafe { ptr::write_bytes(dst_ptr.add(obj), 0, len) },
                }
            });
        }
        Ok(())
    }

    /// Copy `src` (one object) back into the chunk's blocks, leaving the first
    /// `skip_tokens` tokens of this chunk untouched (rounded down to whole
    /// blocks of each group, as 0.5.6 does). Null block ids are never written.
    pub fn scatter(
        &self,
        src: &[u8],
        block_ids: &[i64],
        skip_tokens: usize,
    ) -> Result<(), TransferError> {
        self.scatter_group(0, src, block_ids, skip_tokens)
    }

    /// [`scatter`](Self::scatter) of object group `og`'s object.
    pub fn scatter_group(
        &self,
        og: usize,
        src: &[u8],
        block_ids: &[i64],
        skip_tokens: usize,
    ) -> Result<(), TransferError> {
        self.check_chunk(og, block_ids, src.len())?;
        let src_len = src.len();
        let src_ptr = src.as_ptr();
        for (group, ids) in self.object_group_ids(og, block_ids) {
            let kept = &ids[ids.len() - group.keep_blocks..];
            let skip_blocks = kept_skip(group, skip_tokens);
            self.for_each_span(group, kept, skip_blocks, true, |shm, obj, len| {
                let Some((seg, off)) = shm else { return };
                assert!(obj + len <= src_len, "object range out of bounds");
                let map = &self.segments[seg].map;
                assert!(off + len <= map.len(), "shm range out of bounds");
                // SAFETY: both ranges were bounds-checked just above; the
                // object buffer and the shm mapping never overlap.
                unsafe { copy_run(src_ptr.add(obj), map.as_mut_ptr().add(off), len) };
            });
        }
        Ok(())
    }

    /// Walk every contiguous run between the shm blocks of `group` and its
    /// region of the object, in object order, for chunk positions
    /// `first_block..block_ids.len()` of the group's ids. `visit(shm,
    /// object_offset, len)` gets byte offsets; `shm` is `(segment, offset)`,
    /// or `None` for a null block outside the cache. With `skip_null`, null
    /// block ids are not visited at all.
    fn for_each_span(
        &self,
        group: &KernelGroup,
        block_ids: &[i64],
        first_block: usize,
        skip_null: bool,
        mut visit: impl FnMut(Option<(usize, usize)>, usize, usize),
    ) {
        let g = &group.geometry;
        let es = g.dtype.size_bytes();
        let hidden = g.hidden();
        let row_bytes = hidden * es;
        let block_bytes = g.block_size * row_bytes;
        let layers_in_object = group.layers.len();
        let region = group.object_offset as usize;
        let block_index = |id: i64| usize::try_from(id).ok().filter(|&b| b < g.num_blocks);
        for (object_layer, &layer_index) in group.layers.iter().enumerate() {
            let layer = &self.layers[layer_index];
            for plane in 0..g.kv_size {
                let plane_obj = region
                    + (plane * layers_in_object + object_layer) * group.transfer_slots * row_bytes;
                let mut pos = first_block;
                while pos < block_ids.len() {
                    let id = block_ids[pos];
                    let obj = plane_obj + pos * block_bytes;
                    if skip_null && id == self.null_block_id {
                        pos += 1;
                        continue;
                    }
                    let Some(block) = block_index(id) else {
                        visit(None, obj, block_bytes);
                        pos += 1;
                        continue;
                    };
                    let base = layer.storage_offset + plane * layer.plane_stride;
                    let seg = layer.segment;
                    match layer.runs {
                        BlockRuns::Whole => {
                            let mut n = 1;
                            if layer.blocks_adjacent {
                                while pos + n < block_ids.len()
                                    && block_ids[pos + n] == id + n as i64
                                    && !(skip_null && block_ids[pos + n] == self.null_block_id)
                                {
                                    n += 1;
                                }
                            }
                            let off = (base + block * layer.block_stride) * es;
                            visit(Some((seg, off)), obj, n * block_bytes);
                            pos += n;
                        }
                        BlockRuns::PerToken => {
                            let block_base = base + block * layer.block_stride;
                            for t in 0..g.block_size {
                                let off = (block_base + t * layer.token_stride) * es;
                                visit(Some((seg, off)), obj + t * row_bytes, row_bytes);
                            }
                            pos += 1;
                        }
                        BlockRuns::PerTokenHead => {
                            let block_base = base + block * layer.block_stride;
                            let head_bytes = g.head_size * es;
                            for t in 0..g.block_size {
                                let token_base = block_base + t * layer.token_stride;
                                for h in 0..g.num_heads {
                                    let off = (token_base + h * layer.head_stride) * es;
                                    visit(
                                        Some((seg, off)),
                                        obj + t * row_bytes + h * head_bytes,
                                        head_bytes,
                                    );
                                }
                            }
                            pos += 1;
                        }
                    }
                }
            }
        }
    }

    /// Why a `/cache/checksums` request for this worker is refused, found
    /// before any block is read.
    pub fn checksum_check(
        &self,
        block_ids: &[i64],
        chunk_size_blocks: usize,
    ) -> Result<(), ChecksumRefusal> {
        for layer in &self.layers {
            checksum_axis(layer.geometry.format, block_ids, chunk_size_blocks)?;
            // index_select rejects ids outside the layer, the null id included.
            let num_blocks = layer.geometry.num_blocks;
            if let Some(&block_id) = block_ids
                .iter()
                .find(|&&id| usize::try_from(id).map_or(true, |b| b >= num_blocks))
            {
                return Err(ChecksumRefusal::bad_request(
                    TransferError::BlockIdOutOfRange {
                        block_id,
                        num_blocks,
                        null_block_id: self.null_block_id,
                    }
                    .to_string(),
                ));
            }
        }
        Ok(())
    }

    /// What 0.5.6's `POST /cache/checksums` computes: MD5 over every
    /// registered layer's blocks gathered on the layer's block axis, in groups
    /// of `chunk_size_blocks` blocks (the last group may be shorter), bfloat16
    /// upcast to float32 first. One block list serves every layer, whatever
    /// its kernel group. Aggregated: one digest per chunk over all layers in
    /// order. Layerwise: `layer_<i>` -> one digest per chunk.
    pub fn checksums(
        &self,
        block_ids: &[i64],
        chunk_size_blocks: usize,
        layerwise: bool,
    ) -> Result<ChecksumReport, ChecksumRefusal> {
        self.checksum_check(block_ids, chunk_size_blocks)?;
        let mut digests = ChecksumDigests::new(self.layers.len(), layerwise);
        let mut scratch = Vec::new();
        for ids in block_ids.chunks(chunk_size_blocks) {
            // Ids were checked against every layer above.
            let indices: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
            digests.push_chunk(|l, md5| {
                self.hash_layer_blocks(&self.layers[l], &indices, &mut scratch, md5)
            });
        }
        Ok(digests.report(block_ids, chunk_size_blocks))
    }

    /// Feed the bytes of `layer.index_select(block_axis, indices)` in C order.
    fn hash_layer_blocks(
        &self,
        layer: &LayerView,
        indices: &[usize],
        scratch: &mut Vec<u8>,
        md5: &mut Md5,
    ) {
        let dtype = layer.geometry.dtype;
        let es = dtype.size_bytes();
        let block_axis = layer
            .geometry
            .format
            .checksum_block_axis()
            .expect("checked by checksum_check");
        let map = &self.segments[layer.segment].map;
        let first = layer.storage_offset * es;
        index_select_runs(
            &layer.shape,
            &layer.strides,
            es,
            block_axis,
            indices,
            |off, len| {
                let off = first + off;
                assert!(off + len <= map.len(), "shm range out of bounds");
                scratch.resize(len, 0);
                // SAFETY: range checked above; scratch is a private buffer.
                unsafe {
                    ptr::copy_nonoverlapping(map.as_ptr().add(off), scratch.as_mut_ptr(), len)
                };
                digest_kv(md5, scratch, dtype);
            },
        );
    }
}

/// Bytes of a group's region a transfer moves: `[kv_size, layers,
/// transfer_slots, hidden]`, all of it unless a sliding window is shorter
/// than the chunk.
fn group_moved_bytes(group: &KernelGroup) -> usize {
    let g = &group.geometry;
    g.kv_size * group.layers.len() * group.transfer_slots * g.hidden() * g.dtype.size_bytes()
}

/// Of the blocks `group` moves for one chunk, how many a retrieve skipping
/// the chunk's first `skip_tokens` tokens leaves untouched.
fn kept_skip(group: &KernelGroup, skip_tokens: usize) -> usize {
    kvshard_layout::geometry::kept_skip_blocks(
        skip_tokens,
        group.geometry.block_size,
        group.blocks_per_chunk,
        group.keep_blocks,
    )
}

/// Runs at least this long whose source and destination sit at different
/// offsets within a cache line take the vector loop instead of memcpy.
const MISALIGNED_RUN_MIN_BYTES: usize = 2048;

/// Copy one contiguous run between the object and a mapping.
///
/// glibc's memcpy moves mid-sized blocks with `rep movsb`, which AMD Zen
/// cores run several times slower when source and destination differ in
/// their offset within a cache line; those copies use a plain vector loop.
///
/// # Safety
/// `src..src+len` must be readable, `dst..dst+len` writable, and the two must
/// not overlap.
#[inline]
unsafe fn copy_run(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= MISALIGNED_RUN_MIN_BYTES && (src as usize ^ dst as usize) & 63 != 0 {
        // SAFETY: forwarded from the caller.
        unsafe { copy_run_vector(src, dst, len) };
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe { ptr::copy_nonoverlapping(src, dst, len) };
}

/// # Safety
/// As for [`copy_run`].
#[cfg(target_arch = "x86_64")]
unsafe fn copy_run_vector(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
    let mut i = 0;
    // SAFETY: every access lies inside the caller's ranges; SSE2 is part of
    // the x86_64 baseline and these loads/stores take unaligned addresses.
    unsafe {
        while i + 64 <= len {
            let a = _mm_loadu_si128(src.add(i) as *const __m128i);
            let b = _mm_loadu_si128(src.add(i + 16) as *const __m128i);
            let c = _mm_loadu_si128(src.add(i + 32) as *const __m128i);
            let d = _mm_loadu_si128(src.add(i + 48) as *const __m128i);
            _mm_storeu_si128(dst.add(i) as *mut __m128i, a);
            _mm_storeu_si128(dst.add(i + 16) as *mut __m128i, b);
            _mm_storeu_si128(dst.add(i + 32) as *mut __m128i, c);
            _mm_storeu_si128(dst.add(i + 48) as *mut __m128i, d);
            i += 64;
        }
        ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard_layout::checksum::ChunkChecksums;
    use kvshard_layout::format::default_kv_layout;
    use kvshard_layout::geometry::{all_null, chunk_skip_tokens};
    use kvshard_layout::{KvDtype, KvFormat};
    use kvshard_wire::hex;
    use md5::Digest;

    use std::sync::atomic::{AtomicUsize, Ordering};

    static NEXT_SEGMENT: AtomicUsize = AtomicUsize::new(0);

    /// A real POSIX shm segment owned by the test; unlinked on drop.
    struct TestSegment {
        name: String,
        ptr: *mut u8,
        len: usize,
    }

    impl TestSegment {
        fn new(len: usize) -> TestSegment {
            let name = format!(
                "/kvshard_test_cpushm_{}_{}",
                std::process::id(),
                NEXT_SEGMENT.fetch_add(1, Ordering::Relaxed)
            );
            let c_name = CString::new(name.clone()).unwrap();
            // SAFETY: plain libc calls on a fresh, test-owned segment.
            unsafe {
                let fd = libc::shm_open(
                    c_name.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                    0o600,
                );
                assert!(fd >= 0, "shm_open: {}", io::Error::last_os_error());
                assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
                let ptr = libc::mmap(
                    ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                );
                assert_ne!(ptr, libc::MAP_FAILED);
                libc::close(fd);
                TestSegment {
                    name,
                    ptr: ptr as *mut u8,
                    len,
                }
            }
        }

        /// Byte `i` = a position-dependent pattern, distinct per seed.
        fn with_pattern(len: usize, seed: u32) -> TestSegment {
            let seg = TestSegment::new(len);
            let bytes: Vec<u8> = (0..len as u32)
                .map(|i| (i.wrapping_mul(131) ^ (i >> 8) ^ seed.wrapping_mul(0x9e)) as u8)
                .collect();
            seg.write(0, &bytes);
            seg
        }

        fn read(&self) -> Vec<u8> {
            let mut out = vec![0u8; self.len];
            // SAFETY: the mapping is `len` bytes long.
            unsafe { ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), self.len) };
            out
        }

        fn write(&self, offset: usize, bytes: &[u8]) {
            assert!(offset + bytes.len() <= self.len);
            // SAFETY: bounds asserted above.
            unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) };
        }
    }

    impl Drop for TestSegment {
        fn drop(&mut self) {
            let c_name = CString::new(self.name.clone()).unwrap();
            // SAFETY: unmapping and unlinking what `new` created.
            unsafe {
                libc::munmap(self.ptr as *mut libc::c_void, self.len);
                libc::shm_unlink(c_name.as_ptr());
            }
        }
    }

    fn row_major_strides(shape: &[usize]) -> Vec<i64> {
        let mut strides = vec![1i64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1] as i64;
        }
        strides
    }

    fn spec(seg: &TestSegment, dtype: &str, shape: &[usize], offset: usize) -> ShmTensorSpec {
        ShmTensorSpec {
            shm_name: seg.name.clone(),
            nbytes: seg.len as u64,
            dtype: dtype.to_string(),
            shape: shape.iter().map(|&d| d as i64).collect(),
            stride: row_major_strides(shape),
            storage_offset: offset as i64,
        }
    }

    /// A physical per-layer layout named by its dims in memory order:
    /// 'P' K/V plane, 'B' block, 'T' slot in block, 'H' head, 'E' head element.
    struct Physical {
        order: &'static str,
        planes: usize,
        blocks: usize,
        block_size: usize,
        heads: usize,
        head_size: usize,
    }

    impl Physical {
        fn dim(&self, c: char) -> usize {
            match c {
                'P' => self.planes,
                'B' => self.blocks,
                'T' => self.block_size,
                'H' => self.heads,
                'E' => self.head_size,
                _ => unreachable!(),
            }
        }

        fn shape(&self) -> Vec<usize> {
            self.order.chars().map(|c| self.dim(c)).collect()
        }

        fn elems(&self) -> usize {
            self.shape().iter().product()
        }

        /// Row-major element index of one named coordinate.
        fn index(&self, p: usize, b: usize, t: usize, h: usize, e: usize) -> usize {
            let mut index = 0;
            for c in self.order.chars() {
                let i = match c {
                    'P' => p,
                    'B' => b,
                    'T' => t,
                    'H' => h,
                    'E' => e,
                    _ => unreachable!(),
                };
                index = index * self.dim(c) + i;
            }
            index
        }
    }

    /// 0.5.6's object, element by element: [plane][layer][token][head][elem].
    fn reference_object(
        phys: &Physical,
        layers: &[(&[u8], usize)],
        block_ids: &[usize],
        es: usize,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        for p in 0..phys.planes {
            for (bytes, offset) in layers {
                for &b in block_ids {
                    for t in 0..phys.block_size {
                        for h in 0..phys.heads {
                            for e in 0..phys.head_size {
                                let at = (offset + phys.index(p, b, t, h, e)) * es;
                                out.extend_from_slice(&bytes[at..at + es]);
                            }
                        }
                    }
                }
            }
        }
        out
    }

    fn gather_vec(reg: &CpuShmRegistration, ids: &[i64]) -> Vec<u8> {
        let mut out = vec![0xAAu8; reg.object_layout().bytes as usize];
        reg.gather(ids, &mut out).unwrap();
        out
    }

    #[test]
    fn registration_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<CpuShmRegistration>();
    }

    #[test]
    fn gather_matches_reference_for_every_layout() {
        // (physical order, dtype, hint, expected format)
        let cases = [
            ("PBTHE", "float16", Some("NHD"), KvFormat::TwoNbBsNhHs),
            ("PBHTE", "float16", Some("HND"), KvFormat::TwoNbNhBsHs),
            ("BPTHE", "bfloat16", Some("NHD"), KvFormat::NbTwoBsNhHs),
            ("BPHTE", "float32", Some("HND"), KvFormat::NbTwoNhBsHs),
            ("BTHE", "uint8", Some("NHD"), KvFormat::NbBsNhCs),
            ("BHTE", "float8_e4m3fn", None, KvFormat::NbNhBsCs),
        ];
        for (order, dtype, hint, format) in cases {
            let planes = if order.contains('P') { 2 } else { 1 };
            let phys = Physical {
                order,
                planes,
                blocks: 9,
                block_size: 4,
                heads: 3,
                head_size: 8,
            };
            let es = KvDtype::parse(dtype).unwrap().size_bytes();
            let segs: Vec<TestSegment> = (0..3)
                .map(|i| TestSegment::with_pattern(phys.elems() * es, i))
                .collect();
            let specs: Vec<ShmTensorSpec> = segs
                .iter()
                .map(|s| spec(s, dtype, &phys.shape(), 0))
                .collect();
            let reg = CpuShmRegistration::open(&specs, &[], 16, hint, 0).unwrap();
            assert_eq!(reg.groups[0].geometry.format, format, "{order}");
            assert_eq!(reg.ids_per_chunk(), 4);
            assert_eq!(reg.groups[0].geometry.num_blocks, 9);
            let layout = reg.object_layout();
            assert_eq!(*layout.shape, [planes as u64, 3, 16, 24], "{order}");
            assert_eq!(&*layout.dtype, dtype);
            let contents: Vec<Vec<u8>> = segs.iter().map(|s| s.read()).collect();
            let layers: Vec<(&[u8], usize)> = contents.iter().map(|c| (&c[..], 0)).collect();
            for ids in [[5usize, 6, 7, 8], [3, 0, 8, 1], [2, 3, 1, 2]] {
                let ids_i64: Vec<i64> = ids.iter().map(|&b| b as i64).collect();
                assert_eq!(
                    gather_vec(&reg, &ids_i64),
                    reference_object(&phys, &layers, &ids, es),
                    "{order} {ids:?}"
                );
            }
        }
    }

    #[test]
    fn vllm_hnd_view_is_normalised_by_stride() {
        // vLLM exposes HND storage [2, NB, NH, BS, HS] as a permuted logical
        // [2, NB, BS, NH, HS] view; the server reorders dims by stride.
        let phys = Physical {
            order: "PBHTE",
            planes: 2,
            blocks: 6,
            block_size: 4,
            heads: 2,
            head_size: 8,
        };
        let seg = TestSegment::with_pattern(phys.elems() * 2, 7);
        let physical_strides = row_major_strides(&phys.shape());
        let logical = ShmTensorSpec {
            shm_name: seg.name.clone(),
            nbytes: seg.len as u64,
            dtype: "float16".to_string(),
            shape: vec![2, 6, 4, 2, 8],
            stride: vec![
                physical_strides[0],
                physical_strides[1],
                physical_strides[3],
                physical_strides[2],
                physical_strides[4],
            ],
            storage_offset: 0,
        };
        let reg = CpuShmRegistration::open(&[logical], &[], 8, Some("HND"), 0).unwrap();
        assert_eq!(reg.groups[0].geometry.format, KvFormat::TwoNbNhBsHs);
        let contents = seg.read();
        assert_eq!(
            gather_vec(&reg, &[4, 1]),
            reference_object(&phys, &[(&contents, 0)], &[4, 1], 2)
        );
    }

    #[test]
    fn mla_layout_and_layer_counts() {
        let phys = Physical {
            order: "BTE",
            planes: 1,
            blocks: 5,
            block_size: 2,
            heads: 1,
            head_size: 16,
        };
        let segs: Vec<TestSegment> = (0..5)
            .map(|i| TestSegment::with_pattern(phys.elems() * 2, 10 + i))
            .collect();
        let specs: Vec<ShmTensorSpec> = segs
            .iter()
            .map(|s| spec(s, "bfloat16", &phys.shape(), 0))
            .collect();
        let reg = CpuShmRegistration::open(&specs, &[], 4, Some("NHD"), 0).unwrap();
        assert!(reg.groups[0].geometry.format.is_mla());
        assert_eq!(reg.groups[0].layers.len(), 5);
        assert_eq!(*reg.object_layout().shape, [1, 5, 4, 16]);
        assert_eq!(reg.object_layout().bytes, 5 * 4 * 16 * 2);
        let contents: Vec<Vec<u8>> = segs.iter().map(|s| s.read()).collect();
        let layers: Vec<(&[u8], usize)> = contents.iter().map(|c| (&c[..], 0)).collect();
        assert_eq!(
            gather_vec(&reg, &[4, 2]),
            reference_object(&phys, &layers, &[4, 2], 2)
        );

        // Two layers of standard K/V: a different layer count and kv_size.
        let kv = Physical {
            order: "PBTHE",
            planes: 2,
            blocks: 3,
            block_size: 2,
            heads: 2,
            head_size: 4,
        };
        let segs: Vec<TestSegment> = (0..2)
            .map(|i| TestSegment::with_pattern(kv.elems() * 2, 20 + i))
            .collect();
        let specs: Vec<ShmTensorSpec> = segs
            .iter()
            .map(|s| spec(s, "float16", &kv.shape(), 0))
            .collect();
        let reg = CpuShmRegistration::open(&specs, &[], 4, Some("NHD"), 0).unwrap();
        assert!(!reg.groups[0].geometry.format.is_mla());
        assert_eq!(*reg.object_layout().shape, [2, 2, 4, 8]);
        assert_eq!(reg.cache_size_per_token(), 2 * 2 * 8 * 2);
        let contents: Vec<Vec<u8>> = segs.iter().map(|s| s.read()).collect();
        let layers: Vec<(&[u8], usize)> = contents.iter().map(|c| (&c[..], 0)).collect();
        assert_eq!(
            gather_vec(&reg, &[2, 0]),
            reference_object(&kv, &layers, &[2, 0], 2)
        );
    }

    #[test]
    fn shared_segment_offsets_and_group_subset() {
        // Three layers packed in one segment; the group keeps layers 0 and 2.
        let phys = Physical {
            order: "PBTHE",
            planes: 2,
            blocks: 4,
            block_size: 2,
            heads: 1,
            head_size: 8,
        };
        let per_layer = phys.elems();
        let seg = TestSegment::with_pattern(3 * per_layer * 2 + 64, 3);
        let specs: Vec<ShmTensorSpec> = (0..3)
            .map(|i| spec(&seg, "float16", &phys.shape(), i * per_layer))
            .collect();
        let group = EngineGroupInfo {
            layer_indices: vec![0, 2],
            tokens_per_block: 2,
            ..EngineGroupInfo::default()
        };
        let reg = CpuShmRegistration::open(&specs, &[group], 4, Some("NHD"), 0).unwrap();
        assert_eq!(reg.groups[0].layers.len(), 2);
        assert_eq!(reg.num_registered_tensors(), 3);
        assert_eq!(&reg.groups[0].layers[..], &[0, 2]);
        let contents = seg.read();
        let layers = [(&contents[..], 0), (&contents[..], 2 * per_layer)];
        assert_eq!(
            gather_vec(&reg, &[3, 1]),
            reference_object(&phys, &layers, &[3, 1], 2)
        );
    }

    /// A hybrid registration: a classical float16 NHD group of two layers,
    /// an MLA bfloat16 layer, and one more classical layer of another engine
    /// group. Each group reads its own block list; the object is the groups'
    /// regions end to end, each as 0.5.6 lays out a single group.
    #[test]
    fn kernel_groups_gather_and_scatter_their_own_blocks() {
        let classic = nhd_phys();
        let mla = Physical {
            order: "BTE",
            planes: 1,
            blocks: 6,
            block_size: 4,
            heads: 1,
            head_size: 8,
        };
        let segs: Vec<TestSegment> = (0..4)
            .map(|i| TestSegment::with_pattern(classic.elems() * 2, 10 + i))
            .collect();
        let specs = vec![
            spec(&segs[0], "float16", &classic.shape(), 0),
            spec(&segs[1], "bfloat16", &mla.shape(), 0),
            spec(&segs[2], "float16", &classic.shape(), 0),
            spec(&segs[3], "float16", &classic.shape(), 0),
        ];
        let info = |engine_group_id: i64, layers: Vec<i64>| EngineGroupInfo {
            engine_group_id,
            layer_indices: layers,
            ..EngineGroupInfo::default()
        };
        let infos = [info(0, vec![0, 2]), info(0, vec![1]), info(1, vec![3])];
        let reg = CpuShmRegistration::open(&specs, &infos, 8, Some("NHD"), 0).unwrap();
        let groups = reg.kernel_groups();
        assert_eq!(groups.len(), 3);
        assert_eq!(groups[0].layers, [0, 2]);
        assert_eq!(groups[1].layers, [1]);
        assert!(groups[1].geometry.format.is_mla());
        assert_eq!(groups[2].engine_group_id, 1);
        // 2 planes x 2 layers x 8 tokens x 8 + 1 x 1 x 8 x 8 + 2 x 1 x 8 x 8, 2 bytes each.
        assert_eq!(reg.object_layout().bytes, (256 + 64 + 128) * 2);
        assert_eq!(*reg.object_layout().shape, [2, 2, 8, 8]);
        assert_eq!(reg.cache_size_per_token(), (32 + 8 + 16) * 2);
        assert_eq!(reg.ids_per_chunk(), 6);

        let contents: Vec<Vec<u8>> = segs.iter().map(|s| s.read()).collect();
        let ids = [3, 7, 5, 0, 9, 2];
        let mut expected = reference_object(
            &classic,
            &[(&contents[0], 0), (&contents[2], 0)],
            &[3, 7],
            2,
        );
        expected.extend(reference_object(&mla, &[(&contents[1], 0)], &[5, 0], 2));
        expected.extend(reference_object(&classic, &[(&contents[3], 0)], &[9, 2], 2));
        let object = gather_vec(&reg, &ids);
        assert_eq!(object, expected);

        // Block 6 is past the MLA group's 6 blocks but inside the others'.
        assert!(matches!(
            reg.validate_block_ids(&[6, 6, 6, 0, 6, 6]),
            Err(TransferError::BlockIdOutOfRange {
                block_id: 6,
                num_blocks: 6,
                ..
            })
        ));
        reg.validate_block_ids(&[6, 6, 5, 0, 6, 6]).unwrap();

        // Scatter into fresh caches at other blocks, skipping the first block
        // of every group; gathering there gives the object back.
        let dest: Vec<TestSegment> = (0..4)
            .map(|_| TestSegment::new(classic.elems() * 2))
            .collect();
        let dest_specs: Vec<ShmTensorSpec> = specs
            .iter()
            .zip(&dest)
            .map(|(s, d)| ShmTensorSpec {
                shm_name: d.name.clone(),
                nbytes: d.len as u64,
                ..s.clone()
            })
            .collect();
        let dest_reg = CpuShmRegistration::open(&dest_specs, &infos, 8, Some("NHD"), 0).unwrap();
        let to = [1, 2, 3, 4, 5, 8];
        dest_reg.scatter(&object, &to, 4).unwrap();
        let back = gather_vec(&dest_reg, &to);
        // The first block of every (plane, layer) slab of each group stayed 0.
        let mut want = object.clone();
        for k in dest_reg.kernel_groups() {
            let g = &k.geometry;
            let row = g.hidden() * g.dtype.size_bytes();
            for slab in 0..g.kv_size * k.layers.len() {
                let start = k.object_offset as usize + slab * 8 * row;
                want[start..start + 4 * row].fill(0);
            }
        }
        assert_eq!(back, want);
    }

    fn nhd_phys() -> Physical {
        Physical {
            order: "PBTHE",
            planes: 2,
            blocks: 10,
            block_size: 4,
            heads: 2,
            head_size: 4,
        }
    }

    #[test]
    fn scatter_round_trip_with_skip() {
        let phys = nhd_phys();
        let bytes = phys.elems() * 2;
        let source: Vec<TestSegment> = (0..2)
            .map(|i| TestSegment::with_pattern(bytes, i))
            .collect();
        let specs: Vec<ShmTensorSpec> = source
            .iter()
            .map(|s| spec(s, "float16", &phys.shape(), 0))
            .collect();
        let src_reg = CpuShmRegistration::open(&specs, &[], 16, Some("NHD"), 0).unwrap();
        let object = gather_vec(&src_reg, &[1, 2, 3, 9]);

        for (skip, skipped_blocks) in [(0usize, 0usize), (5, 1), (8, 2), (16, 4), (100, 4)] {
            let dest: Vec<TestSegment> = (0..2).map(|_| TestSegment::new(bytes)).collect();
            let specs: Vec<ShmTensorSpec> = dest
                .iter()
                .map(|s| spec(s, "float16", &phys.shape(), 0))
                .collect();
            let reg = CpuShmRegistration::open(&specs, &[], 16, Some("NHD"), 0).unwrap();
            let ids = [6i64, 7, 4, 5];
            reg.scatter(&object, &ids, skip).unwrap();

            // Expected destination: the object's blocks placed by hand into
            // zeroed layers, positions before the skip left untouched.
            for (layer, seg) in dest.iter().enumerate() {
                let mut expected = vec![0u8; bytes];
                for (pos, &b) in ids.iter().enumerate().skip(skipped_blocks) {
                    for p in 0..2 {
                        for t in 0..4 {
                            for h in 0..2 {
                                for e in 0..4 {
                                    let obj_elem =
                                        (((p * 2 + layer) * 16 + pos * 4 + t) * 2 + h) * 4 + e;
                                    let at = phys.index(p, b as usize, t, h, e) * 2;
                                    expected[at..at + 2]
                                        .copy_from_slice(&object[obj_elem * 2..obj_elem * 2 + 2]);
                                }
                            }
                        }
                    }
                }
                assert_eq!(seg.read(), expected, "skip {skip} layer {layer}");
            }
            if skip == 0 {
                assert_eq!(gather_vec(&reg, &ids), object);
            }
        }
    }

    #[test]
    fn null_block_ids() {
        let phys = nhd_phys();
        let bytes = phys.elems() * 2;
        let seg = TestSegment::with_pattern(bytes, 5);
        let specs = [spec(&seg, "float16", &phys.shape(), 0)];
        let contents = seg.read();

        // In-cache null block 0: gathered like any block (as 0.5.6 does).
        let reg = CpuShmRegistration::open(&specs, &[], 16, Some("NHD"), 0).unwrap();
        assert_eq!(
            gather_vec(&reg, &[0, 3, 4, 5]),
            reference_object(&phys, &[(&contents, 0)], &[0, 3, 4, 5], 2)
        );
        // ... but never written by a scatter.
        let dest = TestSegment::new(bytes);
        let dest_reg = CpuShmRegistration::open(
            &[spec(&dest, "float16", &phys.shape(), 0)],
            &[],
            16,
            Some("NHD"),
            0,
        )
        .unwrap();
        let object = gather_vec(&reg, &[1, 2, 3, 4]);
        dest_reg.scatter(&object, &[0, 1, 2, 0], 0).unwrap();
        let after = dest.read();
        let block0 = phys.index(0, 0, 0, 0, 0) * 2..phys.index(0, 1, 0, 0, 0) * 2;
        assert!(after[block0].iter().all(|&b| b == 0));
        assert_eq!(
            gather_vec(&dest_reg, &[9, 1, 2, 9])[..],
            {
                let mut expected = reference_object(&phys, &[(&contents, 0)], &[0, 2, 3, 0], 2);
                // Positions 0 and 3 read block 9, never written: zeros.
                let plane = 16 * 8 * 2;
                for p in 0..2 {
                    expected[p * plane..p * plane + 64].fill(0);
                    expected[p * plane + 192..p * plane + 256].fill(0);
                }
                expected
            }[..]
        );

        // A null id outside the cache: accepted, gathered as zeros, skipped on scatter.
        let reg = CpuShmRegistration::open(&specs, &[], 16, Some("NHD"), -1).unwrap();
        reg.validate_block_ids(&[-1, 0, 9, 9]).unwrap();
        assert!(matches!(
            reg.validate_block_ids(&[-2, 0, 0, 0]),
            Err(TransferError::BlockIdOutOfRange { block_id: -2, .. })
        ));
        assert!(matches!(
            reg.validate_block_ids(&[0, 0, 0]),
            Err(TransferError::BlockCount {
                expected: 4,
                actual: 3
            })
        ));
        let mut expected = reference_object(&phys, &[(&contents, 0)], &[3, 3, 4, 5], 2);
        for p in 0..2 {
            expected[p * 256..p * 256 + 64].fill(0);
        }
        assert_eq!(gather_vec(&reg, &[-1, 3, 4, 5]), expected);
        let before = seg.read();
        reg.scatter(&vec![0xFF; 512], &[-1, -1, -1, -1], 0).unwrap();
        assert_eq!(seg.read(), before);

        assert!(all_null(&[0, 0, 0], 0));
        assert!(!all_null(&[0, 5, 0], 0));
        assert!(all_null(&[], 0));
    }

    #[test]
    fn chunk_helpers() {
        assert_eq!(chunk_skip_tokens(0, 0, 256), 0);
        assert_eq!(chunk_skip_tokens(48, 0, 256), 48);
        assert_eq!(chunk_skip_tokens(300, 0, 256), 256);
        assert_eq!(chunk_skip_tokens(300, 1, 256), 44);
        assert_eq!(chunk_skip_tokens(300, 2, 256), 0);

        let phys = nhd_phys();
        let seg = TestSegment::new(phys.elems() * 2);
        let reg = CpuShmRegistration::open(
            &[spec(&seg, "float16", &phys.shape(), 0)],
            &[],
            8,
            Some("NHD"),
            0,
        )
        .unwrap();
        assert_eq!(reg.ids_per_chunk(), 2);
        assert_eq!(default_kv_layout(true), "NHD");
        assert_eq!(default_kv_layout(false), "HND");
    }

    fn open_err(
        specs: &[ShmTensorSpec],
        groups: &[EngineGroupInfo],
        chunk: usize,
        hint: Option<&str>,
    ) -> TransferError {
        CpuShmRegistration::open(specs, groups, chunk, hint, 0).unwrap_err()
    }

    #[test]
    fn bad_registrations_are_rejected() {
        let phys = nhd_phys();
        let bytes = phys.elems() * 2;
        let seg = TestSegment::new(bytes);
        let good = spec(&seg, "float16", &phys.shape(), 0);
        let nhd = Some("NHD");

        let mut missing = good.clone();
        missing.shm_name = format!("{}_missing", seg.name);
        assert!(matches!(
            open_err(&[missing], &[], 16, nhd),
            TransferError::Shm { op: "shm_open", .. }
        ));

        // The worker claims a bigger segment than exists.
        let mut claims_more = good.clone();
        claims_more.nbytes = bytes as u64 + 4096;
        assert!(matches!(
            open_err(&[claims_more], &[], 16, nhd),
            TransferError::SegmentTooSmall { .. }
        ));
        // The view reaches past the segment.
        let mut offset_past = good.clone();
        offset_past.storage_offset = 1;
        assert!(matches!(
            open_err(&[offset_past], &[], 16, nhd),
            TransferError::SegmentTooSmall { .. }
        ));

        // Layers of another shape or dtype form a second kernel group: one
        // group info for both is refused, as 0.5.6 refuses it.
        let other = TestSegment::new(bytes);
        let mut mismatched = spec(&other, "float16", &phys.shape(), 0);
        mismatched.shape[2] = 2;
        mismatched.stride = row_major_strides(&[2, 10, 2, 2, 4]);
        let other_dtype = spec(&other, "bfloat16", &phys.shape(), 0);
        let both = EngineGroupInfo {
            layer_indices: vec![0, 1],
            ..EngineGroupInfo::default()
        };
        for second in [mismatched, other_dtype] {
            let pair = [good.clone(), second];
            let reg = CpuShmRegistration::open(&pair, &[], 16, nhd, 0).unwrap();
            assert_eq!(reg.kernel_groups().len(), 2);
            assert!(matches!(
                open_err(&pair, std::slice::from_ref(&both), 16, nhd),
                TransferError::Invalid(_)
            ));
        }
        // Same shape, fewer blocks: one kernel group whose layers disagree.
        let mut fewer_blocks = spec(&other, "float16", &phys.shape(), 0);
        fewer_blocks.shape[1] = 5;
        fewer_blocks.stride = row_major_strides(&[2, 5, 4, 2, 4]);
        assert!(matches!(
            open_err(&[good.clone(), fewer_blocks], &[], 16, nhd),
            TransferError::Unsupported(_)
        ));

        let mut bad_dtype = good.clone();
        bad_dtype.dtype = "complex64".into();
        assert!(matches!(
            open_err(&[bad_dtype], &[], 16, nhd),
            TransferError::Unsupported(_)
        ));
        assert!(matches!(
            open_err(std::slice::from_ref(&good), &[], 16, Some("XYZ")),
            TransferError::Invalid(_)
        ));
        assert!(matches!(
            open_err(std::slice::from_ref(&good), &[], 6, nhd),
            TransferError::Invalid(_)
        ));
        assert!(matches!(
            open_err(std::slice::from_ref(&good), &[], 0, nhd),
            TransferError::Invalid(_)
        ));
        assert!(matches!(
            open_err(&[], &[], 16, nhd),
            TransferError::Invalid(_)
        ));

        for name in ["", "/", "noslash", "/a/b", "/../etc/passwd"] {
            let mut bad_name = good.clone();
            bad_name.shm_name = name.into();
            assert!(
                matches!(
                    open_err(&[bad_name], &[], 16, nhd),
                    TransferError::Invalid(_)
                ),
                "{name}"
            );
        }
        let mut huge = good.clone();
        huge.shape = vec![i64::MAX; 8];
        huge.stride = vec![i64::MAX; 8];
        assert!(matches!(
            open_err(&[huge], &[], 16, nhd),
            TransferError::Invalid(_)
        ));
        let mut negative = good.clone();
        negative.stride[0] = -1;
        assert!(matches!(
            open_err(&[negative], &[], 16, nhd),
            TransferError::Invalid(_)
        ));
        let mut rank_mismatch = good.clone();
        rank_mismatch.stride.pop();
        assert!(matches!(
            open_err(&[rank_mismatch], &[], 16, nhd),
            TransferError::Invalid(_)
        ));
        let mut six_d = good.clone();
        six_d.shape = vec![2, 10, 4, 1, 1, 4];
        six_d.stride = row_major_strides(&[2, 10, 4, 1, 1, 4]);
        assert!(matches!(
            open_err(&[six_d], &[], 16, nhd),
            TransferError::Unsupported(_)
        ));
        // Neither dim 0 nor dim 1 is the K/V axis.
        let mut no_kv_axis = good.clone();
        no_kv_axis.shape = vec![5, 4, 4, 2, 4];
        no_kv_axis.stride = row_major_strides(&[5, 4, 4, 2, 4]);
        assert!(matches!(
            open_err(&[no_kv_axis], &[], 16, nhd),
            TransferError::Unsupported(_)
        ));
        // Head elements not contiguous.
        let strided = TestSegment::new(bytes * 2);
        let mut spread = spec(&strided, "float16", &phys.shape(), 0);
        spread.stride = row_major_strides(&phys.shape())
            .iter()
            .map(|s| s * 2)
            .collect();
        assert!(matches!(
            open_err(&[spread], &[], 16, nhd),
            TransferError::Unsupported(_)
        ));

        let two_groups = [
            EngineGroupInfo {
                layer_indices: vec![0],
                ..EngineGroupInfo::default()
            },
            EngineGroupInfo {
                engine_group_id: 1,
                layer_indices: vec![0],
                ..EngineGroupInfo::default()
            },
        ];
        // Layer 0 listed twice.
        assert!(matches!(
            open_err(std::slice::from_ref(&good), &two_groups, 16, nhd),
            TransferError::Invalid(_)
        ));
        let window = EngineGroupInfo {
            layer_indices: vec![0],
            sw_size_tokens: 8,
            ..EngineGroupInfo::default()
        };
        // A window shorter than the chunk moves its last blocks of each
        // chunk; it must be whole blocks, and at least one.
        let reg =
            CpuShmRegistration::open(std::slice::from_ref(&good), &[window], 16, nhd, 0).unwrap();
        let k = &reg.kernel_groups()[0];
        assert_eq!(
            (k.blocks_per_chunk, k.keep_blocks, k.transfer_slots),
            (4, 2, 8)
        );
        for sw in [6, 0, -2] {
            let bad = EngineGroupInfo {
                layer_indices: vec![0],
                sw_size_tokens: sw,
                ..EngineGroupInfo::default()
            };
            let e = open_err(std::slice::from_ref(&good), &[bad], 16, nhd);
            assert!(matches!(e, TransferError::Invalid(_)), "window {sw}: {e}");
        }
        let recurrent = EngineGroupInfo {
            layer_indices: vec![0],
            recurrent_state: true,
            ..EngineGroupInfo::default()
        };
        let e = open_err(std::slice::from_ref(&good), &[recurrent], 16, nhd);
        assert!(
            e.to_string()
                .contains("serve this model through lmcache server"),
            "{e}"
        );
        let wide_window = EngineGroupInfo {
            layer_indices: vec![0],
            sw_size_tokens: 4096,
            ..EngineGroupInfo::default()
        };
        CpuShmRegistration::open(std::slice::from_ref(&good), &[wide_window], 16, nhd, 0).unwrap();
        let compressed = EngineGroupInfo {
            layer_indices: vec![0],
            tokens_per_block: 8,
            ..EngineGroupInfo::default()
        };
        let e = open_err(std::slice::from_ref(&good), &[compressed], 16, nhd);
        assert!(matches!(e, TransferError::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("no workaround"), "{e}");
        for layers in [vec![1], vec![], vec![-1]] {
            let bad_layers = EngineGroupInfo {
                layer_indices: layers,
                ..EngineGroupInfo::default()
            };
            assert!(matches!(
                open_err(std::slice::from_ref(&good), &[bad_layers], 16, nhd),
                TransferError::Invalid(_)
            ));
        }
        let unsorted = EngineGroupInfo {
            layer_indices: vec![1, 0],
            ..EngineGroupInfo::default()
        };
        assert!(matches!(
            open_err(&[good.clone(), good.clone()], &[unsorted], 16, nhd),
            TransferError::Invalid(_)
        ));
    }

    #[test]
    fn bad_transfer_requests_are_rejected() {
        let phys = nhd_phys();
        let seg = TestSegment::with_pattern(phys.elems() * 2, 1);
        let reg = CpuShmRegistration::open(
            &[spec(&seg, "float16", &phys.shape(), 0)],
            &[],
            16,
            Some("NHD"),
            0,
        )
        .unwrap();
        let mut buf = vec![0u8; reg.object_layout().bytes as usize];
        assert!(matches!(
            reg.gather(&[1, 2, 10, 3], &mut buf),
            Err(TransferError::BlockIdOutOfRange { block_id: 10, .. })
        ));
        assert!(matches!(
            reg.gather(&[1, -5, 2, 3], &mut buf),
            Err(TransferError::BlockIdOutOfRange { block_id: -5, .. })
        ));
        assert!(matches!(
            reg.gather(&[1, 2, 3], &mut buf),
            Err(TransferError::BlockCount {
                expected: 4,
                actual: 3
            })
        ));
        assert!(matches!(
            reg.gather(&[1, 2, 3, 4], &mut buf[1..]),
            Err(TransferError::BufferSize { .. })
        ));
        let before = seg.read();
        assert!(matches!(
            reg.scatter(&buf, &[1, 2, 3, 4, 5], 0),
            Err(TransferError::BlockCount { .. })
        ));
        assert!(matches!(
            reg.scatter(&buf, &[1, 2, 3, i64::MAX], 0),
            Err(TransferError::BlockIdOutOfRange { .. })
        ));
        assert!(matches!(
            reg.scatter(&buf[..10], &[1, 2, 3, 4], 0),
            Err(TransferError::BufferSize { .. })
        ));
        assert_eq!(seg.read(), before, "a rejected scatter must not write");
    }

    #[test]
    fn checksums_match_hand_computed_md5() {
        // MLA uint8 [NB=4, BS=2, HS=2], byte i = i.
        let seg = TestSegment::new(16);
        seg.write(0, &(0..16).collect::<Vec<u8>>());
        let reg = CpuShmRegistration::open(
            &[spec(&seg, "uint8", &[4, 2, 2], 0)],
            &[],
            2,
            Some("NHD"),
            0,
        )
        .unwrap();
        let report = reg.checksums(&[2, 0, 1], 2, false).unwrap();
        assert_eq!(report.num_chunks, 2);
        assert_eq!(
            report.chunk_checksums,
            ChunkChecksums::Aggregated(vec![
                // md5(08 09 0a 0b 00 01 02 03), md5(04 05 06 07)
                "c97435b395b14407088102c96c9dee8d".to_string(),
                "a6b8537b97d58b417d3dfdd1030b15d2".to_string(),
            ])
        );
        assert_eq!(
            serde_json::to_string(&report).unwrap(),
            "{\"status\":\"success\",\"chunk_size\":2,\"num_chunks\":2,\"chunk_checksums\":\
             [\"c97435b395b14407088102c96c9dee8d\",\"a6b8537b97d58b417d3dfdd1030b15d2\"],\
             \"layerwise\":false,\"block_id_ranges\":[2,0,1]}"
        );

        // bfloat16 is hashed as float32 (bits shifted into the high half).
        let seg = TestSegment::new(32);
        seg.write(0, &(0..32).collect::<Vec<u8>>());
        let reg = CpuShmRegistration::open(
            &[spec(&seg, "bfloat16", &[4, 2, 2], 0)],
            &[],
            2,
            Some("NHD"),
            0,
        )
        .unwrap();
        let report = reg.checksums(&[2, 0, 1], 2, true).unwrap();
        assert_eq!(
            report.chunk_checksums,
            ChunkChecksums::PerLayer(vec![(
                "layer_0".to_string(),
                vec![
                    "d5640d8dcf777c0ee74ac3bc9ab51454".to_string(),
                    "b3c5b1096b5420e6451b8556d8675cba".to_string(),
                ]
            )])
        );
    }

    #[test]
    fn checksums_gather_on_each_layouts_block_axis() {
        // [2, NB, BS, NH, HS]: a chunk hashes all its K blocks, then its V blocks.
        let phys = Physical {
            order: "PBTHE",
            planes: 2,
            blocks: 6,
            block_size: 2,
            heads: 1,
            head_size: 2,
        };
        let segs: Vec<TestSegment> = (0..2)
            .map(|i| TestSegment::with_pattern(phys.elems(), i))
            .collect();
        let specs: Vec<ShmTensorSpec> = segs
            .iter()
            .map(|s| spec(s, "int8", &phys.shape(), 0))
            .collect();
        let reg = CpuShmRegistration::open(&specs, &[], 4, Some("NHD"), 0).unwrap();
        let contents: Vec<Vec<u8>> = segs.iter().map(|s| s.read()).collect();
        let layer_bytes = |layer: usize, ids: &[usize]| {
            let mut out = Vec::new();
            for p in 0..2 {
                for &b in ids {
                    let start = phys.index(p, b, 0, 0, 0);
                    out.extend_from_slice(&contents[layer][start..start + 4]);
                }
            }
            out
        };
        let md5_hex = |bytes: &[u8]| hex(&Md5::digest(bytes));
        let ids = [4i64, 1, 2, 3, 5];
        let chunks: [&[usize]; 3] = [&[4, 1], &[2, 3], &[5]];
        let report = reg.checksums(&ids, 2, false).unwrap();
        let expected: Vec<String> = chunks
            .iter()
            .map(|c| md5_hex(&[layer_bytes(0, c), layer_bytes(1, c)].concat()))
            .collect();
        assert_eq!(report.chunk_checksums, ChunkChecksums::Aggregated(expected));
        assert_eq!(report.num_chunks, 3);
        assert_eq!(report.chunk_size, 2);

        let report = reg.checksums(&ids, 2, true).unwrap();
        let per_layer = (0..2)
            .map(|l| {
                (
                    format!("layer_{l}"),
                    chunks.iter().map(|c| md5_hex(&layer_bytes(l, c))).collect(),
                )
            })
            .collect();
        assert_eq!(report.chunk_checksums, ChunkChecksums::PerLayer(per_layer));
        let json = serde_json::to_string(&report.chunk_checksums).unwrap();
        assert!(json.starts_with("{\"layer_0\":[") && json.contains("],\"layer_1\":["));

        // [NB, 2, BS, NH, HS]: per block, K then V.
        let fi = Physical {
            order: "BPTHE",
            ..phys
        };
        let seg = TestSegment::with_pattern(fi.elems(), 9);
        let reg = CpuShmRegistration::open(
            &[spec(&seg, "uint8", &fi.shape(), 0)],
            &[],
            4,
            Some("NHD"),
            0,
        )
        .unwrap();
        let contents = seg.read();
        let report = reg.checksums(&[3, 0], 8, false).unwrap();
        let expected = md5_hex(&[&contents[3 * 8..4 * 8], &contents[0..8]].concat());
        assert_eq!(
            report.chunk_checksums,
            ChunkChecksums::Aggregated(vec![expected])
        );

        let refused = |ids: &[i64], chunk| reg.checksums(ids, chunk, false).unwrap_err();
        assert_eq!(
            refused(&[], 2),
            ChecksumRefusal::bad_request("block_ids is required")
        );
        assert_eq!(
            refused(&[1], 0),
            ChecksumRefusal::bad_request("chunk_size must be positive")
        );
        let out_of_range = refused(&[1, 6], 2);
        assert_eq!(out_of_range.status, 400);
        assert!(
            out_of_range.detail.contains("block id 6 is outside 0..6"),
            "{out_of_range:?}"
        );
        // Fused K/V layouts are declined, as 0.5.6 answers 501.
        let fused = TestSegment::new(6 * 2 * 2 * 4);
        let reg = CpuShmRegistration::open(
            &[spec(&fused, "uint8", &[6, 2, 2, 4], 0)],
            &[],
            4,
            Some("NHD"),
            0,
        )
        .unwrap();
        assert_eq!(
            reg.checksums(&[1], 1, false).unwrap_err(),
            ChecksumRefusal {
                status: 501,
                detail: "checksum not supported for GPU KV format NL_X_NB_BS_NH_CS".into()
            }
        );
    }

    /// Throughput check against memcpy; run with
    /// `cargo test --release -p kvshard-transport cpu_shm::tests::bandwidth -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn bandwidth() {
        let phys = Physical {
            order: "PBTHE",
            planes: 2,
            blocks: 256,
            block_size: 16,
            heads: 8,
            head_size: 128,
        };
        let layers = 32;
        let segs: Vec<TestSegment> = (0..layers)
            .map(|i| TestSegment::with_pattern(phys.elems() * 2, i))
            .collect();
        let specs: Vec<ShmTensorSpec> = segs
            .iter()
            .map(|s| spec(s, "float16", &phys.shape(), 0))
            .collect();
        let reg = CpuShmRegistration::open(&specs, &[], 256, Some("NHD"), 0).unwrap();
        let bytes = reg.object_layout().bytes as usize;
        // L1 objects are slab-aligned; a buffer 16 bytes off measures the
        // relatively misaligned case too.
        let mut aligned_buf = vec![1u8; bytes + 8192];
        let pad = aligned_buf.as_ptr().align_offset(4096);
        let object = &mut aligned_buf[pad..pad + bytes];
        let mut skewed_buf = vec![1u8; bytes + 8192];
        let pad = skewed_buf.as_ptr().align_offset(4096) + 16;
        let skewed = &mut skewed_buf[pad..pad + bytes];
        let scattered: Vec<i64> = (0..16).map(|i| (i * 37 % 256) as i64).collect();
        let consecutive: Vec<i64> = (100..116).collect();
        let source = vec![3u8; 256 << 20];
        let mut sink_buf = vec![0u8; bytes + 8192];
        let pad = sink_buf.as_ptr().align_offset(4096);
        let sink = &mut sink_buf[pad..pad + bytes];
        // Best of several trials (shared machines are noisy); one untimed
        // round first, since page faults are not copy bandwidth.
        let rate = |f: &mut dyn FnMut(usize)| {
            f(0);
            let mut best = 0f64;
            for trial in 0..8 {
                let start = std::time::Instant::now();
                for r in 0..4 {
                    f(trial * 4 + r);
                }
                best = best.max((bytes * 4) as f64 / start.elapsed().as_secs_f64() / 1e9);
            }
            best
        };
        let memcpy = rate(&mut |r| {
            let off = (r * bytes) % (source.len() - bytes);
            sink.copy_from_slice(&source[off..off + bytes]);
        });
        let gather_scattered = rate(&mut |_| reg.gather(&scattered, object).unwrap());
        let gather_consecutive = rate(&mut |_| reg.gather(&consecutive, object).unwrap());
        let gather_skewed = rate(&mut |_| reg.gather(&scattered, skewed).unwrap());
        let scatter = rate(&mut |_| reg.scatter(object, &scattered, 0).unwrap());
        let scatter_skewed = rate(&mut |_| reg.scatter(skewed, &scattered, 0).unwrap());
        // HND: one 256-byte run per (token, head).
        let hnd = Physical {
            order: "PBHTE",
            ..phys
        };
        let hnd_segs: Vec<TestSegment> = (0..layers)
            .map(|i| TestSegment::with_pattern(hnd.elems() * 2, i))
            .collect();
        let hnd_specs: Vec<ShmTensorSpec> = hnd_segs
            .iter()
            .map(|s| spec(s, "float16", &hnd.shape(), 0))
            .collect();
        let hnd_reg = CpuShmRegistration::open(&hnd_specs, &[], 256, Some("HND"), 0).unwrap();
        let gather_hnd = rate(&mut |_| hnd_reg.gather(&scattered, object).unwrap());
        let scatter_hnd = rate(&mut |_| hnd_reg.scatter(object, &scattered, 0).unwrap());
        println!("HND gather {gather_hnd:.2} GB/s, scatter {scatter_hnd:.2} GB/s");
        println!(
            "memcpy {memcpy:.2} GB/s | gather {gather_scattered:.2} (scattered ids), \
             {gather_consecutive:.2} (consecutive), {gather_skewed:.2} (misaligned object) | \
             scatter {scatter:.2}, {scatter_skewed:.2} (misaligned object)"
        );
    }
}
