//! KV block-copy geometry: how a paged engine KV cache maps onto L1 chunk
//! objects, and a CPU executor of that mapping.
//!
//! lmcache 0.5.6 moves KV between an engine's paged buffers and its chunk
//! objects with one CUDA kernel, `multi_layer_block_transfer_kernel`, launched
//! once per kernel group with one thread block per (kv plane, flat block,
//! layer). Every engine layout it supports (formats 0-14 and 18) reduces to a
//! small stride table, computed here on the host in units of the copy width
//! `U` (16, 4 or 2 bytes):
//!
//! ```text
//! engine = paged[l * ptr_layer_mul + k * ptr_kv_mul]
//!          + id * block_step + l * layer_step + k * kv_step
//! object = objs[f / bpo] + ((k * nl + l) * chunk_slots + (f % bpo) * bs) * row
//! ```
//!
//! Inside one block, token `t` of head `h` sits at `h * head + t * row` (NHD)
//! or `(h * bs + t) * head` (HND); in the object it is always at
//! `h * head + t * row` (`[kv, layer, token, nh * hs]`). The DSA indexer
//! format (14) stores all tokens' values first and then all tokens' 4-byte
//! scales; the object keeps each token's values and scale side by side.
//!
//! [`gather`] and [`scatter`] execute exactly the copies the kernel in
//! `kv_block_copy.cu` performs, with every offset checked, so the tables can
//! be proven against lmcache's own output on a host without a GPU. Nothing in
//! this module touches CUDA.

use std::fmt;

/// lmcache 0.5.6's `EngineKVFormat`, restricted to the values its CUDA kernel
/// is instantiated for (0-14 and 18). The discriminants are the wire values.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum EngineKvFormat {
    /// Cross-layer single tensor `[NB, NL, 2, BS, NH, HS]` (TRT-LLM style).
    NB_NL_TWO_BS_NH_HS = 0,
    /// Per layer `[2, NB, BS, NH, HS]` (vLLM FlashAttention).
    NL_X_TWO_NB_BS_NH_HS = 1,
    /// Per layer `[NB, 2, BS, NH, HS]` (vLLM FlashInfer).
    NL_X_NB_TWO_BS_NH_HS = 2,
    /// Per layer `[NB, BS, HS]` (MLA; one head).
    NL_X_NB_BS_HS = 3,
    /// SGLang: a list of NL K tensors then NL V tensors, each `[NB*BS, NH, HS]`.
    TWO_X_NL_X_NBBS_NH_HS = 4,
    /// Per layer `[NB*BS, 1, HS]` (SGLang MLA).
    NL_X_NBBS_ONE_HS = 5,
    /// Per layer `[2, NB, NH, BS, HS]` (FlashAttention HND).
    NL_X_TWO_NB_NH_BS_HS = 6,
    /// Per layer `[NB, 2, NH, BS, HS]` (FlashInfer HND).
    NL_X_NB_TWO_NH_BS_HS = 7,
    /// Cross-layer single tensor `[NB, NL, 2, NH, BS, HS]`.
    NB_NL_TWO_NH_BS_HS = 8,
    /// SGLang: NL K tensors then NL V tensors, each `[NB, BS, NH, HS]`.
    TWO_X_NL_X_NB_BS_NH_HS = 9,
    /// Per layer `[NB, NH, BS, 2, HS]`, K/V fused into one plane (HND).
    NL_X_NB_NH_BS_TWO_HS = 10,
    /// Per layer `[NB, BS, NH, 2, HS]`, K/V fused into one plane.
    NL_X_NB_BS_NH_TWO_HS = 11,
    /// Per layer `[NB, NH, BS, CS]`, fused content of size CS (HND).
    NL_X_NB_NH_BS_CS = 12,
    /// Per layer `[NB, BS, NH, CS]`, fused content of size CS.
    NL_X_NB_BS_NH_CS = 13,
    /// DSA indexer keys `[NB, BS, 132]` uint8 with blocked scales:
    /// per block `[BS x values][BS x 4-byte scale]`.
    NL_X_NB_BSV_BSS = 14,
    /// Per layer `[NB, BS, NH, HS]`, one independent K or V component.
    NL_X_NB_BS_NH_HS = 18,
}

impl EngineKvFormat {
    /// Every format the block-copy kernel handles, in wire order.
    pub const ALL: [EngineKvFormat; 16] = [
        Self::NB_NL_TWO_BS_NH_HS,
        Self::NL_X_TWO_NB_BS_NH_HS,
        Self::NL_X_NB_TWO_BS_NH_HS,
        Self::NL_X_NB_BS_HS,
        Self::TWO_X_NL_X_NBBS_NH_HS,
        Self::NL_X_NBBS_ONE_HS,
        Self::NL_X_TWO_NB_NH_BS_HS,
        Self::NL_X_NB_TWO_NH_BS_HS,
        Self::NB_NL_TWO_NH_BS_HS,
        Self::TWO_X_NL_X_NB_BS_NH_HS,
        Self::NL_X_NB_NH_BS_TWO_HS,
        Self::NL_X_NB_BS_NH_TWO_HS,
        Self::NL_X_NB_NH_BS_CS,
        Self::NL_X_NB_BS_NH_CS,
        Self::NL_X_NB_BSV_BSS,
        Self::NL_X_NB_BS_NH_HS,
    ];

    /// Decodes lmcache's numeric value. 15, 16 and 17 are real 0.5.6 formats
    /// that the CUDA copy path does not handle; they are refused with the
    /// reason, as is anything unknown.
    pub fn from_u32(value: u32) -> Result<Self, LayoutError> {
        if let Some(f) = Self::ALL.iter().find(|f| f.as_u32() == value) {
            return Ok(*f);
        }
        let refused = |name: &'static str, reason: &'static str| LayoutError::UnsupportedFormat {
            value,
            name,
            reason,
        };
        Err(match value {
            15 => refused(
                "NL_X_TWO_NB_NH_ONE_BS_HS",
                "vLLM-RBLN layout; lmcache 0.5.6 has no CUDA kernel instance for it",
            ),
            16 => refused(
                "NL_X_TWO_X_NB_BS_NH_HS",
                "per-layer (K, V) tuples cannot be carried by a CUDA tensor registration",
            ),
            17 => refused(
                "NL_X_NP_X_NB_BS_ONE_HS",
                "per-layer plane tuples cannot be carried by a CUDA tensor registration",
            ),
            _ => LayoutError::UnknownFormat { value },
        })
    }

    /// The wire value.
    pub fn as_u32(self) -> u32 {
        self as u32
    }

    /// lmcache's name for the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::NB_NL_TWO_BS_NH_HS => "NB_NL_TWO_BS_NH_HS",
            Self::NL_X_TWO_NB_BS_NH_HS => "NL_X_TWO_NB_BS_NH_HS",
            Self::NL_X_NB_TWO_BS_NH_HS => "NL_X_NB_TWO_BS_NH_HS",
            Self::NL_X_NB_BS_HS => "NL_X_NB_BS_HS",
            Self::TWO_X_NL_X_NBBS_NH_HS => "TWO_X_NL_X_NBBS_NH_HS",
            Self::NL_X_NBBS_ONE_HS => "NL_X_NBBS_ONE_HS",
            Self::NL_X_TWO_NB_NH_BS_HS => "NL_X_TWO_NB_NH_BS_HS",
            Self::NL_X_NB_TWO_NH_BS_HS => "NL_X_NB_TWO_NH_BS_HS",
            Self::NB_NL_TWO_NH_BS_HS => "NB_NL_TWO_NH_BS_HS",
            Self::TWO_X_NL_X_NB_BS_NH_HS => "TWO_X_NL_X_NB_BS_NH_HS",
            Self::NL_X_NB_NH_BS_TWO_HS => "NL_X_NB_NH_BS_TWO_HS",
            Self::NL_X_NB_BS_NH_TWO_HS => "NL_X_NB_BS_NH_TWO_HS",
            Self::NL_X_NB_NH_BS_CS => "NL_X_NB_NH_BS_CS",
            Self::NL_X_NB_BS_NH_CS => "NL_X_NB_BS_NH_CS",
            Self::NL_X_NB_BSV_BSS => "NL_X_NB_BSV_BSS",
            Self::NL_X_NB_BS_NH_HS => "NL_X_NB_BS_NH_HS",
        }
    }

    /// Number of KV planes (`kv_size`) lmcache reports for the format: 2 for
    /// separate K and V, 1 for MLA, fused and single-component layouts.
    pub fn kv_size(self) -> u32 {
        match self {
            Self::NB_NL_TWO_BS_NH_HS
            | Self::NL_X_TWO_NB_BS_NH_HS
            | Self::NL_X_NB_TWO_BS_NH_HS
            | Self::TWO_X_NL_X_NBBS_NH_HS
            | Self::NL_X_TWO_NB_NH_BS_HS
            | Self::NL_X_NB_TWO_NH_BS_HS
            | Self::NB_NL_TWO_NH_BS_HS
            | Self::TWO_X_NL_X_NB_BS_NH_HS => 2,
            _ => 1,
        }
    }

    /// Heads before tokens inside a block.
    pub fn is_hnd(self) -> bool {
        matches!(
            self,
            Self::NL_X_TWO_NB_NH_BS_HS
                | Self::NL_X_NB_TWO_NH_BS_HS
                | Self::NB_NL_TWO_NH_BS_HS
                | Self::NL_X_NB_NH_BS_TWO_HS
                | Self::NL_X_NB_NH_BS_CS
        )
    }

    /// Values and scales stored in separate runs inside a block.
    pub fn is_blocked_scale(self) -> bool {
        self == Self::NL_X_NB_BSV_BSS
    }

    /// Formats whose block axis comes first in each layer tensor, so a padded
    /// block stride (`block_stride_elems > 0`) is meaningful. lmcache rejects
    /// dim-0 padding on every other format.
    pub fn allows_block_stride(self) -> bool {
        matches!(
            self,
            Self::NL_X_NB_BS_HS
                | Self::NL_X_NB_BSV_BSS
                | Self::NL_X_NB_NH_BS_CS
                | Self::NL_X_NB_BS_NH_CS
                | Self::NL_X_NB_BS_NH_HS
        )
    }

    fn is_cross_layer(self) -> bool {
        matches!(self, Self::NB_NL_TWO_BS_NH_HS | Self::NB_NL_TWO_NH_BS_HS)
    }

    fn is_kv_list(self) -> bool {
        matches!(
            self,
            Self::TWO_X_NL_X_NBBS_NH_HS | Self::TWO_X_NL_X_NB_BS_NH_HS
        )
    }
}

impl fmt::Display for EngineKvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.as_u32())
    }
}

/// lmcache 0.5.6's `PageBufferShapeDesc` for one kernel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageBufferShape {
    /// KV planes: 2 (K and V) or 1.
    pub kv_size: u32,
    /// Layers in the group.
    pub nl: u32,
    /// Blocks in each paged buffer (block-axis size).
    pub nb: u64,
    /// Physical token slots per block.
    pub bs: u32,
    /// Heads per token.
    pub nh: u32,
    /// Elements per head (the content size for fused formats).
    pub hs: u32,
    /// Bytes per element.
    pub element_size: u32,
    /// Elements from one block to the next when the block axis is padded or
    /// interleaves layers; 0 means tight (`bs * nh * hs`).
    pub block_stride_elems: u64,
}

/// The largest `nh` the kernel's thread block can hold (one warp-row per head).
pub const MAX_HEADS: u32 = 32;

/// The most objects one launch writes (lmcache's `max_batch_size`).
pub const MAX_OBJECTS: usize = 4;

/// Bytes of the per-token scale of the blocked-scale format.
pub const BLOCKED_SCALE_BYTES: u64 = 4;

/// Why a stride table cannot be built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// A format value lmcache 0.5.6 does not define.
    UnknownFormat { value: u32 },
    /// A 0.5.6 format the CUDA copy path does not handle.
    UnsupportedFormat {
        value: u32,
        name: &'static str,
        reason: &'static str,
    },
    /// A dimension of the shape is zero.
    ZeroDimension { field: &'static str },
    /// A dimension does not fit the kernel's 32-bit parameters.
    DimensionTooLarge {
        field: &'static str,
        value: u64,
        max: u64,
    },
    /// `kv_size` disagrees with what the format implies.
    KvSizeMismatch {
        format: EngineKvFormat,
        expected: u32,
        got: u32,
    },
    /// More heads than the kernel's thread block holds.
    TooManyHeads { nh: u32 },
    /// A head must be a whole number of 2-byte units.
    OddHeadBytes { head_bytes: u64 },
    /// A padded block stride on a format without a leading block axis.
    BlockStrideNotAllowed { format: EngineKvFormat },
    /// A block stride smaller than one block would make blocks overlap.
    BlockStrideTooSmall { block_stride_elems: u64, min: u64 },
    /// The block stride is not a whole number of copy units.
    BlockStrideUnaligned { block_bytes: u64, unit_bytes: u32 },
    /// The blocked-scale format's geometry is wrong.
    BlockedScaleGeometry { reason: &'static str },
    /// An offset or size does not fit in 64 bits.
    Overflow { what: &'static str },
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownFormat { value } => {
                write!(f, "unknown engine KV format {value} (lmcache 0.5.6 defines 0-18)")
            }
            Self::UnsupportedFormat {
                value,
                name,
                reason,
            } => write!(f, "engine KV format {name} ({value}) is not supported: {reason}"),
            Self::ZeroDimension { field } => write!(f, "page buffer shape: {field} is 0"),
            Self::DimensionTooLarge { field, value, max } => {
                write!(f, "page buffer shape: {field} = {value} exceeds {max}")
            }
            Self::KvSizeMismatch {
                format,
                expected,
                got,
            } => write!(f, "format {format} has kv_size {expected}, shape says {got}"),
            Self::TooManyHeads { nh } => {
                write!(f, "nh = {nh} exceeds the kernel limit of {MAX_HEADS} heads")
            }
            Self::OddHeadBytes { head_bytes } => {
                write!(f, "head of {head_bytes} bytes is odd; the copy unit is at least 2 bytes")
            }
            Self::BlockStrideNotAllowed { format } => write!(
                f,
                "format {format} has no leading block axis; a padded block stride is not allowed"
            ),
            Self::BlockStrideTooSmall {
                block_stride_elems,
                min,
            } => write!(
                f,
                "block_stride_elems = {block_stride_elems} is smaller than one block ({min} elements)"
            ),
            Self::BlockStrideUnaligned {
                block_bytes,
                unit_bytes,
            } => write!(
                f,
                "block stride of {block_bytes} bytes is not a multiple of the {unit_bytes}-byte copy unit"
            ),
            Self::BlockedScaleGeometry { reason } => {
                write!(f, "blocked-scale format NL_X_NB_BSV_BSS: {reason}")
            }
            Self::Overflow { what } => write!(f, "{what} overflows 64-bit arithmetic"),
        }
    }
}

impl std::error::Error for LayoutError {}

/// Why one copy call cannot run. Nothing has been written when this is
/// returned: every block is checked before the first byte moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyError {
    /// 1 to [`MAX_OBJECTS`] objects per call.
    ObjectCount { got: usize },
    /// The block ids do not split evenly over the objects.
    BlocksNotDivisible { blocks: usize, objects: usize },
    /// `blocks_per_object * bs` must equal `chunk_slots`.
    ChunkSlotsMismatch {
        chunk_slots: u64,
        blocks_per_object: u64,
        bs: u32,
    },
    /// More blocks skipped than there are.
    SkipTooLarge { skip_blocks: usize, blocks: usize },
    /// The call does not fit the kernel's 32-bit or grid limits.
    CallTooLarge {
        what: &'static str,
        value: u64,
        max: u64,
    },
    /// The number of paged buffers differs from what the format addresses.
    PagedCount { expected: usize, got: usize },
    /// A block id outside `0..nb`.
    BlockIdOutOfRange { index: usize, id: i64, nb: u64 },
    /// An engine block would fall outside its paged buffer.
    PagedOutOfBounds {
        buffer: usize,
        offset: u64,
        len: u64,
        buffer_len: u64,
    },
    /// An object is smaller than one chunk of the group.
    ObjectTooSmall { object: usize, need: u64, got: u64 },
    /// An offset or size does not fit in 64 bits.
    Overflow { what: &'static str },
}

impl fmt::Display for CopyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ObjectCount { got } => {
                write!(f, "{got} objects in one copy; 1 to {MAX_OBJECTS} are allowed")
            }
            Self::BlocksNotDivisible { blocks, objects } => {
                write!(f, "{blocks} block ids do not split evenly over {objects} objects")
            }
            Self::ChunkSlotsMismatch {
                chunk_slots,
                blocks_per_object,
                bs,
            } => write!(
                f,
                "{blocks_per_object} blocks per object x {bs} slots != chunk_slots {chunk_slots}"
            ),
            Self::SkipTooLarge {
                skip_blocks,
                blocks,
            } => write!(f, "skip_blocks {skip_blocks} exceeds the {blocks} block ids"),
            Self::CallTooLarge { what, value, max } => {
                write!(f, "{what} = {value} exceeds the kernel limit {max}")
            }
            Self::PagedCount { expected, got } => {
                write!(f, "{got} paged buffers given, the format addresses {expected}")
            }
            Self::BlockIdOutOfRange { index, id, nb } => {
                write!(f, "block id {id} at position {index} is outside 0..{nb}")
            }
            Self::PagedOutOfBounds {
                buffer,
                offset,
                len,
                buffer_len,
            } => write!(
                f,
                "engine block at byte {offset} (+{len}) is outside paged buffer {buffer} of {buffer_len} bytes"
            ),
            Self::ObjectTooSmall { object, need, got } => {
                write!(f, "object {object} has {got} bytes, one chunk needs {need}")
            }
            Self::Overflow { what } => write!(f, "{what} overflows 64-bit arithmetic"),
        }
    }
}

impl std::error::Error for CopyError {}

/// The host-side stride table of one kernel group. All steps are in units of
/// [`StrideTable::unit_bytes`]; built only by [`StrideTable::new`], so every
/// table in existence has been validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StrideTable {
    format: EngineKvFormat,
    shape: PageBufferShape,
    unit_bytes: u32,
    head_bytes: u64,
    row_bytes: u64,
    block_bytes: u64,
    block_step: i64,
    layer_step: i64,
    kv_step: i64,
    ptr_layer_mul: u32,
    ptr_kv_mul: u32,
    paged_buffers: usize,
    paged_span_bytes: u64,
}

fn nonzero(value: u64, field: &'static str) -> Result<u64, LayoutError> {
    if value == 0 {
        Err(LayoutError::ZeroDimension { field })
    } else {
        Ok(value)
    }
}

fn fits_i32(value: u64, field: &'static str) -> Result<(), LayoutError> {
    let max = i32::MAX as u64;
    if value > max {
        return Err(LayoutError::DimensionTooLarge { field, value, max });
    }
    Ok(())
}

fn mul(a: u64, b: u64, what: &'static str) -> Result<u64, LayoutError> {
    a.checked_mul(b).ok_or(LayoutError::Overflow { what })
}

fn add(a: u64, b: u64, what: &'static str) -> Result<u64, LayoutError> {
    a.checked_add(b).ok_or(LayoutError::Overflow { what })
}

fn to_i64(v: u64, what: &'static str) -> Result<i64, LayoutError> {
    i64::try_from(v).map_err(|_| LayoutError::Overflow { what })
}

impl StrideTable {
    /// Validates `shape` for `format` and precomputes the stride table.
    pub fn new(format: EngineKvFormat, shape: &PageBufferShape) -> Result<Self, LayoutError> {
        let s = *shape;
        let kv = nonzero(s.kv_size.into(), "kv_size")?;
        let nl = nonzero(s.nl.into(), "nl")?;
        let nb = nonzero(s.nb, "nb")?;
        let bs = nonzero(s.bs.into(), "bs")?;
        let nh = nonzero(s.nh.into(), "nh")?;
        let hs = nonzero(s.hs.into(), "hs")?;
        let es = nonzero(s.element_size.into(), "element_size")?;
        if s.kv_size != format.kv_size() {
            return Err(LayoutError::KvSizeMismatch {
                format,
                expected: format.kv_size(),
                got: s.kv_size,
            });
        }
        if s.nh > MAX_HEADS {
            return Err(LayoutError::TooManyHeads { nh: s.nh });
        }
        // The kernel takes these as 32-bit ints; the block index is 64-bit.
        fits_i32(nl, "nl")?;
        fits_i32(bs, "bs")?;
        let head_bytes = mul(hs, es, "head bytes (hs * element_size)")?;
        if head_bytes % 2 != 0 {
            return Err(LayoutError::OddHeadBytes { head_bytes });
        }
        let row_bytes = mul(nh, head_bytes, "row bytes (nh * head bytes)")?;
        let tight_elems = mul(bs * nh, hs, "block elements (bs * nh * hs)")?;
        if format.is_blocked_scale() {
            if s.nh != 1 {
                return Err(LayoutError::BlockedScaleGeometry {
                    reason: "nh must be 1",
                });
            }
            if head_bytes <= BLOCKED_SCALE_BYTES || head_bytes % 4 != 0 {
                return Err(LayoutError::BlockedScaleGeometry {
                    reason: "a token row must be a multiple of 4 bytes with values before a 4-byte scale",
                });
            }
        }
        if s.block_stride_elems != 0 {
            if !format.allows_block_stride() {
                return Err(LayoutError::BlockStrideNotAllowed { format });
            }
            if s.block_stride_elems < tight_elems {
                return Err(LayoutError::BlockStrideTooSmall {
                    block_stride_elems: s.block_stride_elems,
                    min: tight_elems,
                });
            }
        }
        let block_elems = if s.block_stride_elems != 0 {
            s.block_stride_elems
        } else {
            tight_elems
        };
        let block_bytes = mul(block_elems, es, "block bytes")?;

        // lmcache picks the widest unit that divides a head (format 14: always
        // 4 bytes). A padded block stride must also be a whole number of
        // units; rather than misaddress, narrow the unit until it is, which
        // copies the same bytes.
        let mut unit: u32 = if format.is_blocked_scale() {
            4
        } else if head_bytes % 16 == 0 {
            16
        } else if head_bytes % 4 == 0 {
            4
        } else {
            2
        };
        while block_bytes % u64::from(unit) != 0 {
            let narrower = match unit {
                16 => 4,
                4 if !format.is_blocked_scale() => 2,
                _ => {
                    return Err(LayoutError::BlockStrideUnaligned {
                        block_bytes,
                        unit_bytes: unit,
                    })
                }
            };
            unit = narrower;
        }
        let u = u64::from(unit);
        let head_units = head_bytes / u;
        fits_i32(head_units, "head units")?;
        let blk = block_bytes / u;

        let (block_step, layer_step, kv_step, ptr_layer_mul, ptr_kv_mul) =
            if format.is_cross_layer() {
                let kv_blk = mul(kv, blk, "kv step")?;
                (mul(nl, kv_blk, "block step")?, kv_blk, blk, 0u32, 0u32)
            } else if format.is_kv_list() {
                (blk, 0, 0, 1, s.nl)
            } else {
                match format {
                    EngineKvFormat::NL_X_TWO_NB_BS_NH_HS | EngineKvFormat::NL_X_TWO_NB_NH_BS_HS => {
                        (blk, 0, mul(nb, blk, "kv step")?, 1, 0)
                    }
                    EngineKvFormat::NL_X_NB_TWO_BS_NH_HS | EngineKvFormat::NL_X_NB_TWO_NH_BS_HS => {
                        (mul(kv, blk, "block step")?, 0, blk, 1, 0)
                    }
                    _ => (blk, 0, 0, 1, 0),
                }
            };
        let paged_buffers = if format.is_cross_layer() {
            1
        } else if format.is_kv_list() {
            (kv * nl) as usize
        } else {
            nl as usize
        };

        // Bytes each paged buffer must hold: the last block of the last layer
        // and plane, plus one tight block (a block's footprint is always
        // bs * row bytes, whatever the layout inside it).
        let last = add(
            add(
                mul(nb - 1, block_step, "block offset")?,
                mul(
                    if layer_step == 0 { 0 } else { nl - 1 },
                    layer_step,
                    "layer offset",
                )?,
                "engine offset",
            )?,
            mul(kv - 1, kv_step, "kv offset")?,
            "engine offset",
        )?;
        let block_footprint = mul(bs, row_bytes, "block footprint")?;
        let paged_span_bytes = add(
            mul(last, u, "engine offset")?,
            block_footprint,
            "paged span",
        )?;
        to_i64(paged_span_bytes, "paged span")?;

        Ok(Self {
            format,
            shape: s,
            unit_bytes: unit,
            head_bytes,
            row_bytes,
            block_bytes,
            block_step: to_i64(block_step, "block step")?,
            layer_step: to_i64(layer_step, "layer step")?,
            kv_step: to_i64(kv_step, "kv step")?,
            ptr_layer_mul,
            ptr_kv_mul,
            paged_buffers,
            paged_span_bytes,
        })
    }

    pub fn format(&self) -> EngineKvFormat {
        self.format
    }

    pub fn shape(&self) -> &PageBufferShape {
        &self.shape
    }

    /// Copy width `U` in bytes: 16, 4 or 2.
    pub fn unit_bytes(&self) -> u32 {
        self.unit_bytes
    }

    /// Bytes of one head of one token.
    pub fn head_bytes(&self) -> u64 {
        self.head_bytes
    }

    /// Bytes of one token (all heads); also the object's row size.
    pub fn row_bytes(&self) -> u64 {
        self.row_bytes
    }

    /// Bytes from one block to the next within one plane of one layer.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    pub fn head_units(&self) -> u64 {
        self.head_bytes / u64::from(self.unit_bytes)
    }

    pub fn row_units(&self) -> u64 {
        self.row_bytes / u64::from(self.unit_bytes)
    }

    /// Engine step per block id, in units.
    pub fn block_step(&self) -> i64 {
        self.block_step
    }

    /// Engine step per layer inside one tensor (cross-layer formats), in units.
    pub fn layer_step(&self) -> i64 {
        self.layer_step
    }

    /// Engine step per KV plane inside one tensor, in units.
    pub fn kv_step(&self) -> i64 {
        self.kv_step
    }

    /// Paged pointer index = `layer * ptr_layer_mul + kv * ptr_kv_mul`.
    pub fn ptr_layer_mul(&self) -> u32 {
        self.ptr_layer_mul
    }

    pub fn ptr_kv_mul(&self) -> u32 {
        self.ptr_kv_mul
    }

    pub fn hnd(&self) -> bool {
        self.format.is_hnd()
    }

    pub fn blocked_scale(&self) -> bool {
        self.format.is_blocked_scale()
    }

    /// How many base pointers the format addresses (1, nl, or kv * nl).
    pub fn paged_buffers(&self) -> usize {
        self.paged_buffers
    }

    /// The fewest bytes each paged buffer must hold for every block id in
    /// `0..nb` to be addressable.
    pub fn paged_span_bytes(&self) -> u64 {
        self.paged_span_bytes
    }

    /// Bytes one chunk of this group occupies in an object:
    /// `kv * nl * chunk_slots * row`.
    pub fn object_bytes(&self, chunk_slots: u64) -> Result<u64, CopyError> {
        let planes = u64::from(self.shape.kv_size) * u64::from(self.shape.nl);
        planes
            .checked_mul(chunk_slots)
            .and_then(|v| v.checked_mul(self.row_bytes))
            .ok_or(CopyError::Overflow {
                what: "object bytes",
            })
    }

    /// Paged pointer index for (layer, kv plane).
    pub fn ptr_index(&self, layer: u32, kv: u32) -> usize {
        layer as usize * self.ptr_layer_mul as usize + kv as usize * self.ptr_kv_mul as usize
    }

    /// Engine byte offset of block `block_id` for (layer, kv plane) from its
    /// paged base pointer. `None` when the id is outside `0..nb`.
    pub fn engine_offset_bytes(&self, block_id: i64, layer: u32, kv: u32) -> Option<u64> {
        let id = u64::try_from(block_id)
            .ok()
            .filter(|&id| id < self.shape.nb)?;
        if layer >= self.shape.nl || kv >= self.shape.kv_size {
            return None;
        }
        // Cannot overflow: paged_span_bytes, computed with checked math at
        // construction, bounds every in-range offset.
        let units = id * self.block_step as u64
            + u64::from(layer) * self.layer_step as u64
            + u64::from(kv) * self.kv_step as u64;
        Some(units * u64::from(self.unit_bytes))
    }

    /// Validates one copy call's shape and returns blocks per object.
    pub fn check_call(
        &self,
        objects: usize,
        blocks: usize,
        chunk_slots: u64,
        skip_blocks: usize,
    ) -> Result<u64, CopyError> {
        if objects == 0 || objects > MAX_OBJECTS {
            return Err(CopyError::ObjectCount { got: objects });
        }
        if blocks % objects != 0 {
            return Err(CopyError::BlocksNotDivisible { blocks, objects });
        }
        let bpo = (blocks / objects) as u64;
        if bpo.checked_mul(u64::from(self.shape.bs)) != Some(chunk_slots) || chunk_slots == 0 {
            return Err(CopyError::ChunkSlotsMismatch {
                chunk_slots,
                blocks_per_object: bpo,
                bs: self.shape.bs,
            });
        }
        if skip_blocks > blocks {
            return Err(CopyError::SkipTooLarge {
                skip_blocks,
                blocks,
            });
        }
        let max = i32::MAX as u64;
        if chunk_slots > max {
            return Err(CopyError::CallTooLarge {
                what: "chunk_slots",
                value: chunk_slots,
                max,
            });
        }
        self.object_bytes(chunk_slots)?;
        Ok(bpo)
    }
}

/// One block's copy: the engine side (buffer, byte offset) and the object
/// side (object, byte offset). Both spans are `bs * row` bytes.
#[derive(Clone, Copy, Debug)]
struct BlockCopy {
    buffer: usize,
    engine: usize,
    object: usize,
    chunk: usize,
}

/// Validates a call and lists its block copies in the kernel's grid order,
/// checking every block against its buffers before anything is copied.
fn plan(
    table: &StrideTable,
    paged_lens: &[usize],
    object_lens: &[usize],
    ids: &[i64],
    chunk_slots: u64,
    skip_blocks: usize,
) -> Result<Vec<BlockCopy>, CopyError> {
    let bpo = table.check_call(object_lens.len(), ids.len(), chunk_slots, skip_blocks)?;
    if paged_lens.len() != table.paged_buffers() {
        return Err(CopyError::PagedCount {
            expected: table.paged_buffers(),
            got: paged_lens.len(),
        });
    }
    let need = table.object_bytes(chunk_slots)?;
    for (object, &len) in object_lens.iter().enumerate() {
        if (len as u64) < need {
            return Err(CopyError::ObjectTooSmall {
                object,
                need,
                got: len as u64,
            });
        }
    }
    let s = table.shape();
    let footprint = u64::from(s.bs) * table.row_bytes();
    let mut out = Vec::new();
    for kv in 0..s.kv_size {
        for (flat, &id) in ids.iter().enumerate().skip(skip_blocks) {
            let (object, j) = (flat as u64 / bpo, flat as u64 % bpo);
            for layer in 0..s.nl {
                let buffer = table.ptr_index(layer, kv);
                let engine = table.engine_offset_bytes(id, layer, kv).ok_or(
                    CopyError::BlockIdOutOfRange {
                        index: flat,
                        id,
                        nb: s.nb,
                    },
                )?;
                let buffer_len = paged_lens[buffer] as u64;
                if engine
                    .checked_add(footprint)
                    .is_none_or(|end| end > buffer_len)
                {
                    return Err(CopyError::PagedOutOfBounds {
                        buffer,
                        offset: engine,
                        len: footprint,
                        buffer_len,
                    });
                }
                // Within `need`, which every object was checked to hold.
                let plane = u64::from(kv) * u64::from(s.nl) + u64::from(layer);
                let chunk = (plane * chunk_slots + j * u64::from(s.bs)) * table.row_bytes();
                out.push(BlockCopy {
                    buffer,
                    engine: engine as usize,
                    object: object as usize,
                    chunk: chunk as usize,
                });
            }
        }
    }
    Ok(out)
}

/// Calls `f(engine_offset, chunk_offset, len)` for every run of bytes one
/// block copies, offsets relative to the block's start on each side. This is
/// the thread-level body of the kernel, in units of `U` scaled to bytes.
fn for_each_run(table: &StrideTable, mut f: impl FnMut(usize, usize, usize)) {
    let u = table.unit_bytes() as usize;
    let bs = table.shape().bs as usize;
    let row = table.row_units() as usize;
    let hu = table.head_units() as usize;
    if table.blocked_scale() {
        let su = BLOCKED_SCALE_BYTES as usize / u;
        let vu = row - su;
        for t in 0..bs {
            f(t * vu * u, t * row * u, vu * u);
            f((bs * vu + t * su) * u, (t * row + vu) * u, su * u);
        }
        return;
    }
    for t in 0..bs {
        for h in 0..table.shape().nh as usize {
            let e = if table.hnd() {
                (h * bs + t) * hu
            } else {
                h * hu + t * row
            };
            f(e * u, (h * hu + t * row) * u, hu * u);
        }
    }
}

/// Engine to objects (lmcache's D2H / store direction). `paged` holds one
/// slice per base pointer in kernel order; `objs` one chunk buffer per
/// object. Returns the bytes copied. On error nothing has been written.
pub fn gather(
    table: &StrideTable,
    paged: &[&[u8]],
    objs: &mut [&mut [u8]],
    ids: &[i64],
    chunk_slots: u64,
    skip_blocks: usize,
) -> Result<u64, CopyError> {
    let paged_lens: Vec<usize> = paged.iter().map(|p| p.len()).collect();
    let object_lens: Vec<usize> = objs.iter().map(|o| o.len()).collect();
    let blocks = plan(
        table,
        &paged_lens,
        &object_lens,
        ids,
        chunk_slots,
        skip_blocks,
    )?;
    let mut copied = 0u64;
    for b in &blocks {
        let src = paged[b.buffer];
        let dst = &mut *objs[b.object];
        for_each_run(table, |e, c, n| {
            dst[b.chunk + c..b.chunk + c + n].copy_from_slice(&src[b.engine + e..b.engine + e + n]);
            copied += n as u64;
        });
    }
    Ok(copied)
}

/// Objects to engine (lmcache's H2D / retrieve direction): the inverse of
/// [`gather`] over the same bytes. Returns the bytes copied. On error nothing
/// has been written.
pub fn scatter(
    table: &StrideTable,
    paged: &mut [&mut [u8]],
    objs: &[&[u8]],
    ids: &[i64],
    chunk_slots: u64,
    skip_blocks: usize,
) -> Result<u64, CopyError> {
    let paged_lens: Vec<usize> = paged.iter().map(|p| p.len()).collect();
    let object_lens: Vec<usize> = objs.iter().map(|o| o.len()).collect();
    let blocks = plan(
        table,
        &paged_lens,
        &object_lens,
        ids,
        chunk_slots,
        skip_blocks,
    )?;
    let mut copied = 0u64;
    for b in &blocks {
        let src = objs[b.object];
        let dst = &mut *paged[b.buffer];
        for_each_run(table, |e, c, n| {
            dst[b.engine + e..b.engine + e + n].copy_from_slice(&src[b.chunk + c..b.chunk + c + n]);
            copied += n as u64;
        });
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kv: u32, nh: u32, hs: u32, es: u32) -> PageBufferShape {
        PageBufferShape {
            kv_size: kv,
            nl: 2,
            nb: 6,
            bs: 4,
            nh,
            hs,
            element_size: es,
            block_stride_elems: 0,
        }
    }

    #[test]
    fn format_numbering_round_trips() {
        for f in EngineKvFormat::ALL {
            assert_eq!(EngineKvFormat::from_u32(f.as_u32()), Ok(f));
        }
        assert_eq!(EngineKvFormat::NL_X_NB_BS_NH_HS.as_u32(), 18);
        assert_eq!(EngineKvFormat::NL_X_NB_BSV_BSS.name(), "NL_X_NB_BSV_BSS");
        for v in [15, 16, 17] {
            let e = EngineKvFormat::from_u32(v).unwrap_err();
            assert!(matches!(e, LayoutError::UnsupportedFormat { value, .. } if value == v));
            assert!(e.to_string().contains("not supported"), "{e}");
        }
        assert_eq!(
            EngineKvFormat::from_u32(19),
            Err(LayoutError::UnknownFormat { value: 19 })
        );
    }

    #[test]
    fn unit_width_follows_head_bytes() {
        let f = EngineKvFormat::NL_X_TWO_NB_BS_NH_HS;
        let unit = |hs, es| {
            StrideTable::new(f, &shape(2, 2, hs, es))
                .unwrap()
                .unit_bytes()
        };
        assert_eq!(unit(8, 2), 16);
        assert_eq!(unit(6, 2), 4);
        assert_eq!(unit(3, 2), 2);
        assert_eq!(unit(5, 4), 4);
        let dsa = StrideTable::new(EngineKvFormat::NL_X_NB_BSV_BSS, &shape(1, 1, 132, 1)).unwrap();
        assert_eq!(dsa.unit_bytes(), 4);
        assert!(dsa.blocked_scale());
    }

    #[test]
    fn padded_stride_narrows_the_unit() {
        let mut s = shape(1, 1, 8, 2);
        s.block_stride_elems = 4 * 8 + 2; // 68 bytes: a multiple of 4, not 16
        let t = StrideTable::new(EngineKvFormat::NL_X_NB_BS_HS, &s).unwrap();
        assert_eq!(t.unit_bytes(), 4);
        assert_eq!(t.block_step(), 17);
    }

    #[test]
    fn stride_rows_match_the_format_table() {
        let s = shape(2, 2, 8, 2); // blk = 4 * 2 * 8 * 2 = 128 bytes = 8 units
        let t = |f| StrideTable::new(f, &s).unwrap();
        let cross = t(EngineKvFormat::NB_NL_TWO_BS_NH_HS);
        assert_eq!(
            (cross.block_step(), cross.layer_step(), cross.kv_step()),
            (32, 16, 8)
        );
        assert_eq!((cross.ptr_layer_mul(), cross.paged_buffers()), (0, 1));
        let two = t(EngineKvFormat::NL_X_TWO_NB_NH_BS_HS);
        assert_eq!((two.block_step(), two.kv_step(), two.hnd()), (8, 48, true));
        let nb_two = t(EngineKvFormat::NL_X_NB_TWO_BS_NH_HS);
        assert_eq!((nb_two.block_step(), nb_two.kv_step()), (16, 8));
        let sgl = t(EngineKvFormat::TWO_X_NL_X_NB_BS_NH_HS);
        assert_eq!(
            (sgl.ptr_kv_mul(), sgl.paged_buffers(), sgl.kv_step()),
            (2, 4, 0)
        );
        assert_eq!(sgl.ptr_index(1, 1), 3);
    }

    #[test]
    fn validation_errors() {
        let f = EngineKvFormat::NL_X_TWO_NB_BS_NH_HS;
        let err = |s: PageBufferShape| StrideTable::new(f, &s).unwrap_err();
        for (field, s) in [
            (
                "kv_size",
                PageBufferShape {
                    kv_size: 0,
                    ..shape(2, 2, 8, 2)
                },
            ),
            (
                "nl",
                PageBufferShape {
                    nl: 0,
                    ..shape(2, 2, 8, 2)
                },
            ),
            (
                "nb",
                PageBufferShape {
                    nb: 0,
                    ..shape(2, 2, 8, 2)
                },
            ),
            (
                "bs",
                PageBufferShape {
                    bs: 0,
                    ..shape(2, 2, 8, 2)
                },
            ),
            ("nh", shape(2, 0, 8, 2)),
            ("hs", shape(2, 2, 0, 2)),
            ("element_size", shape(2, 2, 8, 0)),
        ] {
            assert_eq!(err(s), LayoutError::ZeroDimension { field });
        }
        assert_eq!(
            err(shape(2, 33, 8, 2)),
            LayoutError::TooManyHeads { nh: 33 }
        );
        assert!(StrideTable::new(f, &shape(2, 32, 8, 2)).is_ok());
        assert_eq!(
            err(shape(2, 2, 3, 1)),
            LayoutError::OddHeadBytes { head_bytes: 3 }
        );
        assert!(matches!(
            err(shape(1, 2, 8, 2)),
            LayoutError::KvSizeMismatch {
                expected: 2,
                got: 1,
                ..
            }
        ));
        let padded = PageBufferShape {
            block_stride_elems: 200,
            ..shape(2, 2, 8, 2)
        };
        assert_eq!(
            err(padded),
            LayoutError::BlockStrideNotAllowed { format: f }
        );
        let mla = EngineKvFormat::NL_X_NB_BS_HS;
        let short = PageBufferShape {
            block_stride_elems: 31,
            ..shape(1, 1, 8, 2)
        };
        assert_eq!(
            StrideTable::new(mla, &short),
            Err(LayoutError::BlockStrideTooSmall {
                block_stride_elems: 31,
                min: 32
            })
        );
        let odd = PageBufferShape {
            block_stride_elems: 33,
            ..shape(1, 1, 8, 1)
        };
        assert!(matches!(
            StrideTable::new(mla, &odd),
            Err(LayoutError::BlockStrideUnaligned {
                block_bytes: 33,
                ..
            })
        ));
        let dsa = EngineKvFormat::NL_X_NB_BSV_BSS;
        assert!(matches!(
            StrideTable::new(dsa, &shape(1, 2, 132, 1)),
            Err(LayoutError::BlockedScaleGeometry { .. })
        ));
        assert!(matches!(
            StrideTable::new(dsa, &shape(1, 1, 4, 1)),
            Err(LayoutError::BlockedScaleGeometry { .. })
        ));
        assert!(matches!(
            StrideTable::new(dsa, &shape(1, 1, 130, 1)),
            Err(LayoutError::BlockedScaleGeometry { .. })
        ));
    }

    #[test]
    fn overflow_is_an_error() {
        let huge = PageBufferShape {
            nb: u64::MAX / 2,
            ..shape(2, 2, 8, 2)
        };
        assert!(matches!(
            StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &huge),
            Err(LayoutError::Overflow { .. })
        ));
        let wide = PageBufferShape {
            bs: u32::MAX,
            ..shape(2, 2, 8, 2)
        };
        assert!(matches!(
            StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &wide),
            Err(LayoutError::DimensionTooLarge { field: "bs", .. })
        ));
        // Past 2^31 bytes per buffer still works: offsets are 64-bit.
        let big = PageBufferShape {
            nb: 1 << 24,
            ..shape(2, 8, 128, 2)
        };
        let t = StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &big).unwrap();
        let off = t.engine_offset_bytes((1 << 24) - 1, 1, 1).unwrap();
        assert!(off > u64::from(u32::MAX));
        assert_eq!(t.paged_span_bytes(), 2 * (1u64 << 24) * 4 * 8 * 256);
    }

    #[test]
    fn call_checks() {
        let t = StrideTable::new(EngineKvFormat::NL_X_NB_BS_HS, &shape(1, 1, 8, 2)).unwrap();
        let paged_buf = vec![0u8; t.paged_span_bytes() as usize];
        let paged: Vec<&[u8]> = vec![&paged_buf, &paged_buf];
        let mut o0 = vec![0u8; t.object_bytes(8).unwrap() as usize];
        let mut o1 = o0.clone();
        let mut objs: Vec<&mut [u8]> = vec![&mut o0, &mut o1];
        let ids = [5i64, 1, 3, 0];
        assert_eq!(
            gather(&t, &paged, &mut objs, &ids, 8, 0),
            Ok(4 * 2 * 4 * 16)
        );
        assert_eq!(
            gather(&t, &paged, &mut objs, &ids, 12, 0),
            Err(CopyError::ChunkSlotsMismatch {
                chunk_slots: 12,
                blocks_per_object: 2,
                bs: 4
            })
        );
        assert_eq!(
            gather(&t, &paged, &mut objs, &ids[..3], 8, 0),
            Err(CopyError::BlocksNotDivisible {
                blocks: 3,
                objects: 2
            })
        );
        assert_eq!(
            gather(&t, &paged, &mut objs, &ids, 8, 5),
            Err(CopyError::SkipTooLarge {
                skip_blocks: 5,
                blocks: 4
            })
        );
        assert_eq!(
            gather(&t, &paged, &mut objs, &[5, 1, 6, 0], 8, 0),
            Err(CopyError::BlockIdOutOfRange {
                index: 2,
                id: 6,
                nb: 6
            })
        );
        assert_eq!(
            gather(&t, &paged, &mut objs, &[5, -1, 3, 0], 8, 0),
            Err(CopyError::BlockIdOutOfRange {
                index: 1,
                id: -1,
                nb: 6
            })
        );
        // A skipped id is never addressed, so it may be anything.
        assert!(gather(&t, &paged, &mut objs, &[-7, 1, 3, 0], 8, 1).is_ok());
        assert_eq!(
            gather(&t, &paged[..1], &mut objs, &ids, 8, 0),
            Err(CopyError::PagedCount {
                expected: 2,
                got: 1
            })
        );
        let short = &paged_buf[..paged_buf.len() - 1];
        assert!(matches!(
            gather(&t, &[short, short], &mut objs, &ids, 8, 0),
            Err(CopyError::PagedOutOfBounds { buffer: 0, .. })
        ));
        let mut small = vec![0u8; 10];
        let mut objs_small: Vec<&mut [u8]> = vec![&mut small];
        assert!(matches!(
            gather(&t, &paged, &mut objs_small, &ids, 16, 0),
            Err(CopyError::ObjectTooSmall { object: 0, .. })
        ));
        let mut none: Vec<&mut [u8]> = Vec::new();
        assert_eq!(
            gather(&t, &paged, &mut none, &ids, 8, 0),
            Err(CopyError::ObjectCount { got: 0 })
        );
    }

    #[test]
    fn blocked_scale_splits_values_and_scales() {
        // One layer, bs = 2, 12-byte rows: 8 value bytes then a 4-byte scale.
        let s = PageBufferShape {
            kv_size: 1,
            nl: 1,
            nb: 1,
            bs: 2,
            nh: 1,
            hs: 12,
            element_size: 1,
            block_stride_elems: 0,
        };
        let t = StrideTable::new(EngineKvFormat::NL_X_NB_BSV_BSS, &s).unwrap();
        let engine: Vec<u8> = (0..24).collect();
        let mut obj = vec![0xffu8; 24];
        gather(&t, &[&engine], &mut [&mut obj], &[0], 2, 0).unwrap();
        let want: Vec<u8> = (0..8).chain(16..20).chain(8..16).chain(20..24).collect();
        assert_eq!(obj, want);
        let mut back = vec![0u8; 24];
        scatter(&t, &mut [&mut back], &[&obj], &[0], 2, 0).unwrap();
        assert_eq!(back, engine);
    }
}
