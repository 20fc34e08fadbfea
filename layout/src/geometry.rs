//! What a registration's tensors say about the KV cache they hold: each view
//! checked against the memory shared, the format and sizes every layer
//! shares, the layers a chunk object holds, and the tighter geometry the GPU
//! copy kernel needs. Nothing here maps or touches the memory.

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

/// One LMCache KV group, mirroring 0.5.6's `EngineGroupInfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroupSpec {
    /// Engine group (paged-block address space) the group reads block ids from.
    pub engine_group_id: i64,
    /// Registered tensor indices in this group, ascending.
    pub layer_indices: Vec<i64>,
    /// Logical tokens per block; 0 = not reported (same as the block size).
    pub tokens_per_block: i64,
    /// Sliding window in tokens; -1 = full attention.
    pub sw_size_tokens: i64,
    /// Connector-private extra group tag; 0 = regular group.
    pub extra_object_group_tag: i64,
    /// Pages hold recurrent state (Mamba/GDN) rather than attention KV.
    pub recurrent_state: bool,
}

impl Default for KvGroupSpec {
    fn default() -> Self {
        KvGroupSpec {
            engine_group_id: 0,
            layer_indices: Vec::new(),
            tokens_per_block: 0,
            sw_size_tokens: -1,
            extra_object_group_tag: 0,
            recurrent_state: false,
        }
    }
}

/// Whether the chunk's block ids are all `null_block_id`; such chunks carry no
/// KV and 0.5.6 does not store them.
pub fn all_null(block_ids: &[i64], null_block_id: i64) -> bool {
    block_ids.iter().all(|&b| b == null_block_id)
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

/// Resolve which registered tensors form the object, in object order.
fn group_layer_indices(
    groups: &[KvGroupSpec],
    num_tensors: usize,
    block_size: usize,
    chunk_size_tokens: usize,
) -> Result<Vec<usize>, DetectError> {
    let group = match groups {
        [] => return Ok((0..num_tensors).collect()),
        [group] => group,
        _ => {
            return Err(unsupported(format!(
                "{} KV groups (hybrid models); the cpu_shm path transfers one group",
                groups.len()
            )))
        }
    };
    if group.engine_group_id != 0 {
        return Err(invalid(format!(
            "engine_group_id {} with a single group; ids are dense from 0",
            group.engine_group_id
        )));
    }
    if group.recurrent_state {
        return Err(unsupported("recurrent-state (Mamba/GDN) KV groups"));
    }
    if group.extra_object_group_tag != 0 {
        return Err(unsupported(format!(
            "connector-private extra object group tag {}",
            group.extra_object_group_tag
        )));
    }
    let tokens_per_block = match group.tokens_per_block {
        0 => block_size,
        t if t < 0 => return Err(invalid(format!("tokens_per_block {t} is negative"))),
        t => to_usize(t, "tokens_per_block")?,
    };
    if tokens_per_block % block_size != 0 || chunk_size_tokens % tokens_per_block != 0 {
        return Err(invalid(format!(
            "tokens_per_block {tokens_per_block} must be a multiple of the block size \
             {block_size} and divide the chunk size {chunk_size_tokens}"
        )));
    }
    if tokens_per_block != block_size {
        return Err(unsupported(format!(
            "compressed KV groups (tokens_per_block {tokens_per_block} over \
             {block_size} slots per block)"
        )));
    }
    let sw = group.sw_size_tokens;
    if sw != -1 && sw < chunk_size_tokens as i64 {
        return Err(unsupported(format!(
            "sliding window of {sw} tokens, smaller than the {chunk_size_tokens}-token \
             chunk"
        )));
    }
    if group.layer_indices.is_empty() {
        return Err(invalid("KV group has no layers"));
    }
    let mut indices = Vec::with_capacity(group.layer_indices.len());
    for &raw in &group.layer_indices {
        let index = to_usize(raw, "layer index")?;
        if index >= num_tensors {
            return Err(invalid(format!(
                "layer index {index} is outside the {num_tensors} registered tensors"
            )));
        }
        if indices.last().is_some_and(|&prev| prev >= index) {
            return Err(invalid(format!(
                "group layer indices {:?} are not strictly ascending",
                group.layer_indices
            )));
        }
        indices.push(index);
    }
    Ok(indices)
}

/// What a registration's tensors say, before anything is mapped: each
/// view checked, its normalised shape, the shared geometry and the object's
/// layers.
#[derive(Debug)]
pub struct Analysis {
    /// Per tensor: dtype, shape, strides and storage offset, as unsigned
    /// element counts.
    pub checked: Vec<(KvDtype, Vec<usize>, Vec<usize>, usize)>,
    /// Per tensor: its shape and strides reordered by stride.
    pub normalised: Vec<(Vec<usize>, Vec<usize>)>,
    pub geometry: Geometry,
    /// Registered tensor indices of the object's layers, in object order.
    pub group_layers: Vec<usize>,
}

/// Checks and classifies a registration's tensors. `kv_layout_hint` is
/// REGISTER_KV_CACHE's `layout_hints["kv_layout"]` (`NHD`, `HND`, `BLHNC`,
/// `BLNHC`); `None` behaves like a 0.5.6 server without an accelerator (HND,
/// see [`default_kv_layout`]).
pub fn analyse(
    tensors: &[ShmTensorSpec],
    groups: &[KvGroupSpec],
    chunk_size_tokens: usize,
    kv_layout_hint: Option<&str>,
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

    let mut geometry: Option<(Geometry, Vec<usize>)> = None;
    let mut normalised = Vec::with_capacity(tensors.len());
    for (index, (dtype, shape, strides, _)) in checked.iter().enumerate() {
        let (n_shape, n_strides) = normalise_dims(shape, strides);
        let format = detect_format(&n_shape, *dtype, is_hnd)?;
        let axes = format.axes();
        let this = Geometry {
            format,
            dtype: *dtype,
            kv_size: format.kv_size(),
            num_blocks: n_shape[axes.block],
            block_size: n_shape[axes.token],
            num_heads: axes.head.map_or(1, |h| n_shape[h]),
            head_size: n_shape[axes.elem],
        };
        match &geometry {
            None => geometry = Some((this, n_shape.clone())),
            Some((first, first_shape)) => {
                if first.dtype != this.dtype || *first_shape != n_shape {
                    return Err(unsupported(format!(
                        "tensor {index} is {} {n_shape:?} but tensor 0 is {} \
                             {first_shape:?}; layers of different shapes or dtypes form \
                             several kernel groups",
                        this.dtype.name(),
                        first.dtype.name()
                    )));
                }
            }
        }
        if n_strides[axes.elem] != 1 {
            return Err(unsupported(format!(
                "tensor {index}: the head dimension has stride {} (must be 1)",
                n_strides[axes.elem]
            )));
        }
        normalised.push((n_shape, n_strides));
    }
    let geometry = match geometry {
        Some((g, _)) => g,
        None => return Err(invalid("registration carries no KV tensors")),
    };
    if chunk_size_tokens % geometry.block_size != 0 {
        return Err(invalid(format!(
            "chunk size {chunk_size_tokens} is not a multiple of the block size {}",
            geometry.block_size
        )));
    }
    let group_layers = group_layer_indices(
        groups,
        tensors.len(),
        geometry.block_size,
        chunk_size_tokens,
    )?;

    Ok(Analysis {
        checked,
        normalised,
        geometry,
        group_layers,
    })
}

/// The geometry of a registration whose tensors live in GPU memory, as the
/// CUDA copy kernel needs it: the same detection as the cpu_shm path, plus
/// the kernel's requirement that each layer is laid out tightly in its
/// format (only a padded block axis is allowed, for the formats whose block
/// axis is outermost).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceGeometry {
    /// What every registered layer shares.
    pub layer: Geometry,
    /// Registered tensor indices of the object's layers, in object order.
    pub group_layers: Vec<usize>,
    /// Per registered tensor: bytes from its storage start to its first
    /// element, and bytes its view spans from there.
    pub views: Vec<(u64, u64)>,
    /// Per registered tensor: its normalised shape and strides (elements).
    pub layer_dims: Vec<(Vec<usize>, Vec<usize>)>,
    /// Elements from one block to the next when the block axis is padded;
    /// 0 when tight.
    pub block_stride_elems: u64,
    pub chunk_size_tokens: usize,
    pub blocks_per_chunk: usize,
    pub object_layout: ObjectLayout,
}

impl DeviceGeometry {
    /// Checks GPU tensors (given as specs whose `nbytes` is the bytes the
    /// worker shares for each: the storage or the exported range) and
    /// returns what the copy kernel needs.
    pub fn detect(
        tensors: &[ShmTensorSpec],
        groups: &[KvGroupSpec],
        chunk_size_tokens: usize,
        kv_layout_hint: Option<&str>,
    ) -> Result<DeviceGeometry, DetectError> {
        // A GPU server's detector defaults to NHD (0.5.6 with an accelerator).
        let hint = kv_layout_hint.unwrap_or_else(|| default_kv_layout(true));
        let Analysis {
            checked,
            normalised,
            geometry: g,
            group_layers,
        } = analyse(tensors, groups, chunk_size_tokens, Some(hint))?;
        let axes = g.format.axes();
        let mut block_stride = None;
        let mut views = Vec::with_capacity(tensors.len());
        for (index, ((dtype, _, _, storage_offset), (shape, strides))) in
            checked.iter().zip(&normalised).enumerate()
        {
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
                    g.format.name()
                )));
            }
            let stride = if strides[0] == tight[0] {
                0
            } else {
                strides[0] as u64
            };
            match block_stride {
                None => block_stride = Some(stride),
                Some(s) if s != stride => {
                    return Err(unsupported(format!(
                        "tensor {index}: block stride {stride} differs from tensor 0's {s}; \
                         layers must share one layout"
                    )))
                }
                Some(_) => {}
            }
            let es = dtype.size_bytes() as u64;
            let mut last = 0u64;
            for (&d, &st) in shape.iter().zip(strides) {
                last += (d as u64 - 1) * st as u64;
            }
            views.push((*storage_offset as u64 * es, (last + 1) * es));
        }
        let blocks_per_chunk = chunk_size_tokens / g.block_size;
        let hidden = (g.num_heads * g.head_size) as u64;
        let shape = vec![
            g.kv_size as u64,
            group_layers.len() as u64,
            chunk_size_tokens as u64,
            hidden,
        ];
        let bytes = shape.iter().product::<u64>() * g.dtype.size_bytes() as u64;
        Ok(DeviceGeometry {
            layer: g,
            group_layers,
            views,
            layer_dims: normalised,
            block_stride_elems: block_stride.unwrap_or(0),
            chunk_size_tokens,
            blocks_per_chunk,
            object_layout: ObjectLayout {
                shape: shape.into(),
                dtype: g.dtype.name().into(),
                bytes,
            },
        })
    }
}
