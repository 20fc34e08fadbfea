//! What a registration's tensors say about the KV cache they hold: each view
//! checked against the memory shared, the format and sizes every layer
//! shares, the layers a chunk object holds, and the tighter geometry the GPU
//! copy kernel needs. Nothing here maps or touches the memory.

use kvshard_wire::EngineGroupInfo;

use crate::error::{invalid, unsupported, DetectError};
use crate::format::{default_kv_layout, detect_format, normalise_dims, KvDtype, KvFormat};
use crate::object::ObjectLayout;

/// Upper bound on the tensors one registration may carry (a model has at most
/// a few hundred layers); bounds every loop sized by the request.
pub const MAX_REGISTERED_TENSORS: usize = 4096;

/// lmcache 0.5.6's default `--null-block-id` (vLLM's null block).
pub const DEFAULT_NULL_BLOCK_ID: i64 = 0;

/// Tensor ranks a per-layer KV tensor may have before format detection.
const MAX_TENSOR_RANK: usize = 8;

/// One registered tensor, as a `CpuShmIPCData` describes it on the wire.
/// `shape`, `stride` and `storage_offset` count elements of `dtype`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmTensorSpec {
    /// POSIX shm name, e.g. `/lmcache_kv_1234_0`.
    pub shm_name: String,
    /// Length of the segment the worker shares (the mapping length).
    pub nbytes: u64,
    /// torch dtype name without `torch.`, e.g. `float16`.
    pub dtype: String,
    pub shape: Vec<i64>,
    pub stride: Vec<i64>,
    pub storage_offset: i64,
}

/// Whether the chunk's block ids are all `null_block_id`; such chunks carry no
/// KV and 0.5.6 does not store them.
pub fn all_null(block_ids: &[i64], null_block_id: i64) -> bool {
    block_ids.iter().all(|&b| b == null_block_id)
}

/// Of the blocks a group moves for one chunk (its last `keep_blocks` of
/// `blocks_per_chunk`, all of them unless a sliding window is shorter than
/// the chunk), how many a retrieve leaves untouched when it skips the
/// chunk's first `skip_tokens` tokens: the kept blocks among the chunk's
/// first whole blocks of those tokens (0.5.6's `recalculate_blocks_to_skip`,
/// per chunk).
pub fn kept_skip_blocks(
    skip_tokens: usize,
    block_size: usize,
    blocks_per_chunk: usize,
    keep_blocks: usize,
) -> usize {
    let skipped = (skip_tokens / block_size.max(1)).min(blocks_per_chunk);
    skipped.saturating_sub(blocks_per_chunk - keep_blocks.min(blocks_per_chunk))
}

/// Tokens to leave untouched in chunk `chunk_index` of a RETRIEVE whose
/// `skip_first_n_tokens` counts from the request range start (`key.start`).
pub fn chunk_skip_tokens(
    skip_first_n_tokens: usize,
    chunk_index: usize,
    chunk_size_tokens: usize,
) -> usize {
    let chunk_start = chunk_index.saturating_mul(chunk_size_tokens);
    skip_first_n_tokens
        .saturating_sub(chunk_start)
        .min(chunk_size_tokens)
}

/// Geometry shared by every registered layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub format: KvFormat,
    pub dtype: KvDtype,
    pub kv_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_heads: usize,
    pub head_size: usize,
}

impl Geometry {
    /// Elements of one token of one layer and plane (heads times head size).
    pub fn hidden(&self) -> usize {
        self.num_heads * self.head_size
    }
}

fn to_usize(value: i64, what: &str) -> Result<usize, DetectError> {
    usize::try_from(value).map_err(|_| invalid(format!("{what} {value} is negative")))
}

/// Validate one tensor spec: returns (dtype, shape, strides, storage_offset)
/// as unsigned element counts, with its view checked against `nbytes`.
fn check_tensor(
    index: usize,
    spec: &ShmTensorSpec,
) -> Result<(KvDtype, Vec<usize>, Vec<usize>, usize), DetectError> {
    let dtype = KvDtype::parse(&spec.dtype)?;
    if spec.shape.is_empty() || spec.shape.len() > MAX_TENSOR_RANK {
        return Err(invalid(format!(
            "tensor {index}: rank {} is outside 1..={MAX_TENSOR_RANK}",
            spec.shape.len()
        )));
    }
    if spec.stride.len() != spec.shape.len() {
        return Err(invalid(format!(
            "tensor {index}: {} strides for {} dims",
            spec.stride.len(),
            spec.shape.len()
        )));
    }
    let mut shape = Vec::with_capacity(spec.shape.len());
    let mut strides = Vec::with_capacity(spec.shape.len());
    for (&d, &s) in spec.shape.iter().zip(&spec.stride) {
        let d = to_usize(d, "dimension")?;
        if d == 0 {
            return Err(invalid(format!(
                "tensor {index}: empty tensor (shape {:?})",
                spec.shape
            )));
        }
        shape.push(d);
        strides.push(to_usize(s, "stride")?);
    }
    let storage_offset = to_usize(spec.storage_offset, "storage_offset")?;
    // Highest element index the view touches, +1; strides are non-negative.
    // Checked: hostile shapes and strides can overflow even 128 bits.
    let overflow = || invalid(format!("tensor {index}: view extent overflows"));
    let mut extent = storage_offset as u128 + 1;
    for (&d, &s) in shape.iter().zip(&strides) {
        let span = (d as u128 - 1)
            .checked_mul(s as u128)
            .ok_or_else(overflow)?;
        extent = extent.checked_add(span).ok_or_else(overflow)?;
    }
    let needed_bytes = extent
        .checked_mul(dtype.size_bytes() as u128)
        .ok_or_else(overflow)?;
    // 0.5.6 views the segment as whole elements of the dtype.
    let usable = (spec.nbytes / dtype.size_bytes() as u64) * dtype.size_bytes() as u64;
    if needed_bytes > usable as u128 {
        return Err(DetectError::SegmentTooSmall {
            name: spec.shm_name.clone(),
            needed_bytes: u64::try_from(needed_bytes).unwrap_or(u64::MAX),
            segment_bytes: spec.nbytes,
        });
    }
    Ok((dtype, shape, strides, storage_offset))
}

/// One kernel group (0.5.6's `KernelGroupInfo`): the registered layers that
/// share a geometry and an engine group, moved by one copy. Its region of the
/// chunk object is `[kv_size, layers, chunk_tokens, hidden]` in its dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelGroup {
    /// What every layer of the group shares.
    pub geometry: Geometry,
    /// Registered tensor indices, ascending.
    pub layers: Vec<usize>,
    /// Engine group (paged-block address space) its block ids come from.
    pub engine_group_id: i64,
    /// Block ids of one chunk in this group's list.
    pub blocks_per_chunk: usize,
    /// Token slots of each chunk the group moves: the chunk, or a sliding
    /// window shorter than the chunk (0.5.6's `get_slots_per_chunk_in_sw`),
    /// whose last `keep_blocks` blocks of each chunk are moved, into the
    /// `[kv_size, layers, transfer_slots, hidden]` start of the group's
    /// region (the rest of the region is zeros).
    pub transfer_slots: usize,
    /// Blocks of each chunk moved: its last `transfer_slots / block_size`.
    pub keep_blocks: usize,
    /// Bytes from the object's start to this group's region.
    pub object_offset: u64,
    /// Bytes of this group's region of one chunk.
    pub region_bytes: u64,
}

impl KernelGroup {
    /// Bytes of KV per token over the group's layers.
    pub fn bytes_per_token(&self) -> usize {
        let g = &self.geometry;
        g.kv_size * self.layers.len() * g.hidden() * g.dtype.size_bytes()
    }

    /// The shape of the group's region of a chunk of `chunk_tokens` tokens
    /// (0.5.6's `get_kernel_group_shape_dtype`).
    pub fn region_shape(&self, chunk_tokens: usize) -> Vec<u64> {
        let g = &self.geometry;
        vec![
            g.kv_size as u64,
            self.layers.len() as u64,
            chunk_tokens as u64,
            g.hidden() as u64,
        ]
    }
}

/// What makes two layers one kernel group (0.5.6's `KernelGroupIdentity`):
/// everything but the block count, and the engine group.
fn identity(g: &Geometry) -> (KvFormat, KvDtype, usize, usize, usize, usize) {
    (
        g.format,
        g.dtype,
        g.kv_size,
        g.num_heads,
        g.head_size,
        g.block_size,
    )
}

/// Per registered tensor, the engine group it belongs to; `None` for a
/// tensor no group lists (0.5.6 leaves those out of every object, e.g.
/// cross-layer KV-sharing layers). Without group metadata every tensor is
/// in engine group 0.
fn engine_group_of_layers(
    infos: &[EngineGroupInfo],
    num_tensors: usize,
) -> Result<Vec<Option<i64>>, DetectError> {
    if infos.is_empty() {
        return Ok(vec![Some(0); num_tensors]);
    }
    let mut of_layer = vec![None; num_tensors];
    for (g, info) in infos.iter().enumerate() {
        if info.engine_group_id < 0 {
            return Err(invalid(format!(
                "group {g}: engine_group_id {} is negative",
                info.engine_group_id
            )));
        }
        if info.layer_indices.is_empty() {
            return Err(invalid(format!("group {g}: KV group has no layers")));
        }
        let mut prev = None;
        for &raw in &info.layer_indices {
            let index = to_usize(raw, "layer index")?;
            if index >= num_tensors {
                return Err(invalid(format!(
                    "group {g}: layer index {index} is outside the {num_tensors} registered \
                     tensors"
                )));
            }
            if prev.is_some_and(|p| p >= index) {
                return Err(invalid(format!(
                    "group {g}: layer indices {:?} are not strictly ascending",
                    info.layer_indices
                )));
            }
            if of_layer[index].is_some() {
                return Err(invalid(format!("layer {index} is listed by two KV groups")));
            }
            of_layer[index] = Some(info.engine_group_id);
            prev = Some(index);
        }
    }
    Ok(of_layer)
}

/// What the group metadata says about one kernel group that this path can
/// transfer, or why it cannot.
fn check_group_info(
    g: usize,
    info: &EngineGroupInfo,
    block_size: usize,
    chunk_size_tokens: usize,
) -> Result<(), DetectError> {
    if info.recurrent_state {
        return Err(unsupported(format!(
            "group {g}: recurrent-state (Mamba/GDN) KV groups; kvshard has no workaround for \
             them: serve this model through lmcache server"
        )));
    }
    if info.extra_object_group_tag != 0 {
        return Err(unsupported(format!(
            "group {g}: connector-private extra object groups (extra_object_group_tag {}); \
             register the KV cache without the connector's extra pools",
            info.extra_object_group_tag
        )));
    }
    let tokens_per_block = match info.tokens_per_block {
        0 => block_size,
        t if t < 0 => {
            return Err(invalid(format!(
                "group {g}: tokens_per_block {t} is negative"
            )))
        }
        t => to_usize(t, "tokens_per_block")?,
    };
    if tokens_per_block % block_size != 0 || chunk_size_tokens % tokens_per_block != 0 {
        return Err(invalid(format!(
            "group {g}: tokens_per_block {tokens_per_block} must be a multiple of the block \
             size {block_size} and divide the chunk size {chunk_size_tokens}"
        )));
    }
    if tokens_per_block != block_size {
        return Err(unsupported(format!(
            "group {g}: compressed KV groups (tokens_per_block {tokens_per_block} over \
             {block_size} slots per block); kvshard has no workaround for them: serve this \
             model through lmcache server"
        )));
    }
    // A window shorter than the chunk keeps each chunk's last blocks of it,
    // so it must be whole blocks (0.5.6 refuses it otherwise).
    let sw = info.sw_size_tokens;
    if sw == 0 || sw < -1 {
        return Err(invalid(format!(
            "group {g}: sliding window of {sw} tokens (-1: not sliding-window attention)"
        )));
    }
    if sw > 0 && (sw as u64) < chunk_size_tokens as u64 && sw as usize % tokens_per_block != 0 {
        return Err(invalid(format!(
            "group {g}: a sliding window shorter than the chunk must be whole blocks: {sw} \
             tokens is not a multiple of tokens_per_block {tokens_per_block}"
        )));
    }
    Ok(())
}

/// Partitions the registered layers into kernel groups, ordered by their
/// first layer, as 0.5.6's `KVLayerGroupsManager` does, and lays their
/// regions end to end in one chunk object. With group metadata, there must
/// be one `EngineGroupInfo` per kernel group, listing exactly its layers.
fn kernel_groups(
    layers: &[Geometry],
    infos: &[EngineGroupInfo],
    chunk_size_tokens: usize,
) -> Result<Vec<KernelGroup>, DetectError> {
    let of_layer = engine_group_of_layers(infos, layers.len())?;
    let mut groups: Vec<KernelGroup> = Vec::new();
    for (index, (layer, engine)) in layers.iter().zip(&of_layer).enumerate() {
        let Some(engine) = *engine else { continue };
        let key = identity(layer);
        match groups
            .iter_mut()
            .find(|k| k.engine_group_id == engine && identity(&k.geometry) == key)
        {
            Some(k) => {
                if k.geometry.num_blocks != layer.num_blocks {
                    return Err(unsupported(format!(
                        "tensor {index} has {} blocks but tensor {} of its kernel group has \
                         {}; the layers of one engine group share a block count",
                        layer.num_blocks, k.layers[0], k.geometry.num_blocks
                    )));
                }
                k.layers.push(index);
            }
            None => groups.push(KernelGroup {
                geometry: *layer,
                layers: vec![index],
                engine_group_id: engine,
                blocks_per_chunk: 0,
                transfer_slots: 0,
                keep_blocks: 0,
                object_offset: 0,
                region_bytes: 0,
            }),
        }
    }
    if groups.is_empty() {
        return Err(invalid("no registered tensor is in a KV group"));
    }
    if !infos.is_empty() && infos.len() != groups.len() {
        return Err(invalid(format!(
            "{} KV groups for {} kernel groups (layers of one shape, dtype, format and \
             engine group); expecting one group per kernel group",
            infos.len(),
            groups.len()
        )));
    }
    let too_large = || invalid("the chunk object would be larger than kvshard accepts");
    let mut offset = 0u64;
    for (g, group) in groups.iter_mut().enumerate() {
        let block_size = group.geometry.block_size;
        if chunk_size_tokens % block_size != 0 {
            return Err(invalid(format!(
                "chunk size {chunk_size_tokens} is not a multiple of the block size \
                 {block_size} (group {g})"
            )));
        }
        if let Some(info) = infos.get(g) {
            let listed: Vec<usize> = info.layer_indices.iter().map(|&i| i as usize).collect();
            if listed != group.layers {
                return Err(invalid(format!(
                    "group {g}: the KV group lists layers {listed:?} but the kernel group \
                     holds layers {:?}",
                    group.layers
                )));
            }
            check_group_info(g, info, block_size, chunk_size_tokens)?;
        }
        group.blocks_per_chunk = chunk_size_tokens / block_size;
        group.transfer_slots = match infos.get(g).map(|i| i.sw_size_tokens) {
            Some(sw) if sw > 0 && (sw as u64) < chunk_size_tokens as u64 => sw as usize,
            _ => chunk_size_tokens,
        };
        group.keep_blocks = group.transfer_slots / block_size;
        group.object_offset = offset;
        group.region_bytes = u64::try_from(group.bytes_per_token())
            .ok()
            .and_then(|b| b.checked_mul(chunk_size_tokens as u64))
            .ok_or_else(too_large)?;
        offset = offset
            .checked_add(group.region_bytes)
            .ok_or_else(too_large)?;
    }
    Ok(groups)
}

/// One object group (0.5.6's `ObjectGroupInfo`): the kernel groups whose
/// regions one object of each chunk holds, end to end in kernel group order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectGroup {
    /// Indices of its kernel groups, ascending.
    pub kernel_groups: Vec<usize>,
    /// Its cross-chunk sliding window in whole chunks (0.5.6's
    /// `num_chunks_in_sw`): a prefix of `L` chunks needs only its last
    /// `window_chunks` chunks of this group; `-1`: every chunk (full
    /// attention).
    pub window_chunks: i64,
    /// Its object of one chunk. Shape and dtype are its first kernel
    /// group's, as 0.5.6's memory objects report them.
    pub layout: ObjectLayout,
}

impl ObjectGroup {
    /// The first of the chunks of a prefix of `len` chunks this group needs.
    pub fn needed_from(&self, len: usize) -> usize {
        window_start(self.window_chunks, len)
    }
}

/// The first chunk of a prefix of `len` chunks that a group of a sliding
/// window of `window` chunks needs (0.5.6's `unfold_range`: it needs
/// `[window_start, len)`); 0 for full attention (`window` < 1).
pub fn window_start(window: i64, len: usize) -> usize {
    match usize::try_from(window) {
        Ok(w) if w >= 1 => len.saturating_sub(w),
        _ => 0,
    }
}

/// Buckets the kernel groups into object groups as 0.5.6's
/// `KVLayerGroupsManager` does, and places each kernel group's region in its
/// group's object (`object_offset` from that object's start). Without
/// `separate` (0.5.6's `--separate-object-groups` off) every kernel group is
/// in one object group of full attention; with it, kernel groups of one
/// (extra tag, recurrent state, sliding window in whole chunks) share one,
/// ordered by their first kernel group.
pub fn object_groups(
    groups: &mut [KernelGroup],
    infos: &[EngineGroupInfo],
    chunk_size_tokens: usize,
    separate: bool,
) -> Vec<ObjectGroup> {
    let chunk = chunk_size_tokens.max(1) as i64;
    let bucket = |g: usize| {
        let info = infos.get(g);
        let sw_chunks = match info.map_or(-1, |i| i.sw_size_tokens) {
            sw if sw <= 0 => -1,
            sw => sw.saturating_add(chunk - 1) / chunk,
        };
        let tag = info.map_or(0, |i| i.extra_object_group_tag);
        let recurrent = info.is_some_and(|i| i.recurrent_state);
        (tag, recurrent, sw_chunks)
    };
    let mut buckets: Vec<((i64, bool, i64), Vec<usize>)> = Vec::new();
    for g in 0..groups.len() {
        let b = if separate { bucket(g) } else { (0, false, -1) };
        match buckets.iter_mut().find(|(k, _)| *k == b) {
            Some((_, members)) => members.push(g),
            None => buckets.push((b, vec![g])),
        }
    }
    // Extras after the regular groups, each set by its first kernel group.
    buckets.sort_by_key(|((tag, _, _), members)| (*tag != 0, members[0]));
    buckets
        .into_iter()
        .map(|((_, _, window_chunks), members)| {
            let mut offset = 0u64;
            for &g in &members {
                groups[g].object_offset = offset;
                offset += groups[g].region_bytes;
            }
            let first = &groups[members[0]];
            ObjectGroup {
                layout: ObjectLayout {
                    bytes: offset,
                    shape: first.region_shape(chunk_size_tokens).into(),
                    dtype: first.geometry.dtype.name().into(),
                },
                window_chunks,
                kernel_groups: members,
            }
        })
        .collect()
}

/// Whether every block id object group `og`'s kernel groups have in a
/// chunk's list (every kernel group's `blocks_per_chunk` ids end to end) is
/// `null_block_id`: such a chunk carries no KV of the group and 0.5.6 does
/// not store its object (`all_null_chunk_masks`).
pub fn object_group_all_null(
    groups: &[KernelGroup],
    og: &ObjectGroup,
    block_ids: &[i64],
    null_block_id: i64,
) -> bool {
    let mut first = 0;
    groups.iter().enumerate().all(|(g, k)| {
        let ids = block_ids
            .get(first..first + k.blocks_per_chunk)
            .unwrap_or(&[]);
        first += k.blocks_per_chunk;
        !og.kernel_groups.contains(&g) || all_null(ids, null_block_id)
    })
}

/// What a registration's tensors say, before anything is mapped: each
/// view checked, its normalised shape and geometry, the kernel groups and
/// the chunk object they make.
#[derive(Debug)]
pub struct Analysis {
    /// Per tensor: dtype, shape, strides and storage offset, as unsigned
    /// element counts.
    pub checked: Vec<(KvDtype, Vec<usize>, Vec<usize>, usize)>,
    /// Per tensor: its shape and strides reordered by stride.
    pub normalised: Vec<(Vec<usize>, Vec<usize>)>,
    /// Per tensor: its format and sizes.
    pub layers: Vec<Geometry>,
    /// The kernel groups, in object order.
    pub groups: Vec<KernelGroup>,
    /// Object group 0's object of one chunk (every group's, unless object
    /// groups are separate).
    pub object_layout: ObjectLayout,
    /// The object groups, in object group id order.
    pub object_groups: Vec<ObjectGroup>,
}

/// Checks and classifies a registration's tensors. `kv_layout_hint` is
/// REGISTER_KV_CACHE's `layout_hints["kv_layout"]` (`NHD`, `HND`, `BLHNC`,
/// `BLNHC`); `None` behaves like a 0.5.6 server without an accelerator (HND,
/// see [`default_kv_layout`]). `separate` is `--separate-object-groups`.
pub fn analyse(
    tensors: &[ShmTensorSpec],
    groups: &[EngineGroupInfo],
    chunk_size_tokens: usize,
    kv_layout_hint: Option<&str>,
    separate: bool,
) -> Result<Analysis, DetectError> {
    if tensors.is_empty() {
        return Err(invalid("registration carries no KV tensors"));
    }
    if tensors.len() > MAX_REGISTERED_TENSORS {
        return Err(invalid(format!(
            "{} KV tensors exceed the limit of {MAX_REGISTERED_TENSORS}",
            tensors.len()
        )));
    }
    if chunk_size_tokens == 0 {
        return Err(invalid("chunk size is 0"));
    }
    let layout = kv_layout_hint.unwrap_or_else(|| default_kv_layout(false));
    let is_hnd = match layout {
        "NHD" | "BLNHC" => false,
        "HND" | "BLHNC" => true,
        other => {
            return Err(invalid(format!(
                "kv_layout hint '{other}' is not one of NHD, HND, BLHNC, BLNHC"
            )))
        }
    };

    // Validate every view before mapping anything.
    let mut checked = Vec::with_capacity(tensors.len());
    for (index, spec) in tensors.iter().enumerate() {
        checked.push(check_tensor(index, spec)?);
    }

    let mut layers = Vec::with_capacity(tensors.len());
    let mut normalised = Vec::with_capacity(tensors.len());
    for (index, (dtype, shape, strides, _)) in checked.iter().enumerate() {
        let (n_shape, n_strides) = normalise_dims(shape, strides);
        let format = detect_format(&n_shape, *dtype, is_hnd)?;
        let axes = format.axes();
        if n_strides[axes.elem] != 1 {
            return Err(unsupported(format!(
                "tensor {index}: the head dimension has stride {} (must be 1)",
                n_strides[axes.elem]
            )));
        }
        layers.push(Geometry {
            format,
            dtype: *dtype,
            kv_size: format.kv_size(),
            num_blocks: n_shape[axes.block],
            block_size: n_shape[axes.token],
            num_heads: axes.head.map_or(1, |h| n_shape[h]),
            head_size: n_shape[axes.elem],
        });
        normalised.push((n_shape, n_strides));
    }
    let mut kernel = kernel_groups(&layers, groups, chunk_size_tokens)?;
    let object_groups = object_groups(&mut kernel, groups, chunk_size_tokens, separate);
    if let Some(total) = object_groups
        .iter()
        .map(|o| o.layout.bytes)
        .find(|b| *b > crate::object::MAX_OBJECT_BYTES)
    {
        return Err(invalid(format!(
            "the chunk object of {total} bytes is larger than kvshard accepts"
        )));
    }
    let object_layout = object_groups[0].layout.clone();

    Ok(Analysis {
        checked,
        normalised,
        layers,
        groups: kernel,
        object_layout,
        object_groups,
    })
}

/// The geometry of a registration whose tensors live in GPU memory, as the
/// CUDA copy kernel needs it: the same detection and kernel groups as the
/// cpu_shm path, plus the kernel's requirement that each layer is laid out
/// tightly in its format (only a padded block axis is allowed, for the
/// formats whose block axis is outermost, and the same padding across a
/// group, whose layers one stride table walks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceGeometry {
    /// The kernel groups, in object order; the kernel runs once per group.
    pub groups: Vec<KernelGroup>,
    /// Per kernel group: elements from one block to the next when the block
    /// axis is padded; 0 when tight.
    pub block_stride_elems: Vec<u64>,
    /// Per registered tensor: its format and sizes.
    pub layers: Vec<Geometry>,
    /// Per registered tensor: bytes from its storage start to its first
    /// element, and bytes its view spans from there.
    pub views: Vec<(u64, u64)>,
    /// Per registered tensor: its normalised shape and strides (elements).
    pub layer_dims: Vec<(Vec<usize>, Vec<usize>)>,
    pub chunk_size_tokens: usize,
    /// Object group 0's object of one chunk.
    pub object_layout: ObjectLayout,
    /// The object groups, by id (one unless they are separate).
    pub object_groups: Vec<ObjectGroup>,
}

impl DeviceGeometry {
    /// Checks GPU tensors (given as specs whose `nbytes` is the bytes the
    /// worker shares for each: the storage or the exported range) and
    /// returns what the copy kernel needs.
    pub fn detect(
        tensors: &[ShmTensorSpec],
        groups: &[EngineGroupInfo],
        chunk_size_tokens: usize,
        kv_layout_hint: Option<&str>,
        separate: bool,
    ) -> Result<DeviceGeometry, DetectError> {
        // A GPU server's detector defaults to NHD (0.5.6 with an accelerator).
        let hint = kv_layout_hint.unwrap_or_else(|| default_kv_layout(true));
        let Analysis {
            checked,
            normalised,
            layers,
            groups: kernel,
            object_layout,
            object_groups,
        } = analyse(tensors, groups, chunk_size_tokens, Some(hint), separate)?;
        if kernel.is_empty() {
            return Err(invalid("registration carries no KV tensors"));
        }
        let mut block_strides = Vec::with_capacity(tensors.len());
        let mut views = Vec::with_capacity(tensors.len());
        for (index, ((dtype, _, _, storage_offset), (shape, strides))) in
            checked.iter().zip(&normalised).enumerate()
        {
            let format = layers[index].format;
            let axes = format.axes();
            // Row-major strides of the normalised shape: the kernel's layout.
            let mut tight = vec![1usize; shape.len()];
            for d in (0..shape.len().saturating_sub(1)).rev() {
                tight[d] = tight[d + 1] * shape[d + 1];
            }
            let padded_block_axis = axes.block == 0 && axes.plane.is_none();
            let inner_tight = strides[1..] == tight[1..];
            let outer_ok = strides[0] == tight[0] || (padded_block_axis && strides[0] > tight[0]);
            if !inner_tight || !outer_ok {
                return Err(unsupported(format!(
                    "tensor {index}: strides {strides:?} of shape {shape:?} are not the tight \
                     {} layout the GPU copy kernel reads (only a padded block axis is allowed, \
                     for block-first formats)",
                    format.name()
                )));
            }
            block_strides.push(if strides[0] == tight[0] {
                0
            } else {
                strides[0] as u64
            });
            let es = dtype.size_bytes() as u64;
            let mut last = 0u64;
            for (&d, &st) in shape.iter().zip(strides) {
                last += (d as u64 - 1) * st as u64;
            }
            views.push((*storage_offset as u64 * es, (last + 1) * es));
        }
        // One stride table walks a group's layers: they share one padding.
        let mut group_strides = Vec::with_capacity(kernel.len());
        for (gi, group) in kernel.iter().enumerate() {
            let first = group.layers[0];
            if let Some(&other) = group
                .layers
                .iter()
                .find(|&&l| block_strides[l] != block_strides[first])
            {
                return Err(unsupported(format!(
                    "tensor {other}: block stride {} differs from tensor {first}'s {} in kernel \
                     group {gi}; the layers of a group must share one layout",
                    block_strides[other], block_strides[first]
                )));
            }
            group_strides.push(block_strides[first]);
        }
        Ok(DeviceGeometry {
            groups: kernel,
            block_stride_elems: group_strides,
            layers,
            views,
            layer_dims: normalised,
            chunk_size_tokens,
            object_layout,
            object_groups,
        })
    }

    /// Block ids of one chunk over every group, end to end.
    pub fn ids_per_chunk(&self) -> usize {
        self.groups.iter().map(|g| g.blocks_per_chunk).sum()
    }
}
