//! The KV block-copy kernel's source and its launch parameters.
//!
//! `kv_block_copy.cu` is embedded and compiled at run time with NVRTC. Its
//! parameter structs are mirrored here with `#[repr(C)]`; the sizes and
//! offsets are pinned by compile-time assertions on this side and
//! `static_assert`s on the CUDA side. Building the parameters goes through
//! [`StrideTable::check_call`], the same validation the CPU executor uses.

use kvshard_layout::stride::{CopyError, StrideTable, MAX_OBJECTS};

/// CUDA C source of the block-copy kernel.
pub const KV_BLOCK_COPY_SRC: &str = include_str!("kv_block_copy.cu");

/// Program name given to NVRTC (appears in its logs).
pub const KV_BLOCK_COPY_NAME: &str = "kv_block_copy.cu";

/// Every `extern "C"` entry point of the kernel source.
pub const KV_BLOCK_COPY_ENTRIES: [&str; 6] = [
    "kv_gather_u16",
    "kv_gather_u4",
    "kv_gather_u2",
    "kv_scatter_u16",
    "kv_scatter_u4",
    "kv_scatter_u2",
];

/// Which way a copy moves KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// Engine to objects (store, lmcache's D2H).
    Gather,
    /// Objects to engine (retrieve, lmcache's H2D).
    Scatter,
}

/// The entry point for a direction and copy width; `None` for a width the
/// kernel is not instantiated for.
pub fn entry_name(direction: CopyDirection, unit_bytes: u32) -> Option<&'static str> {
    let base = match direction {
        CopyDirection::Gather => 0,
        CopyDirection::Scatter => 3,
    };
    let width = match unit_bytes {
        16 => 0,
        4 => 1,
        2 => 2,
        _ => return None,
    };
    Some(KV_BLOCK_COPY_ENTRIES[base + width])
}

/// Mirror of the kernel's `KvObjects`: up to four chunk object addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelObjects {
    pub ptr: [u64; MAX_OBJECTS],
}

/// Mirror of the kernel's `KvLayout` (passed by value). Steps are in units
/// of the entry point's copy width.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLayout {
    pub block_step: i64,
    pub layer_step: i64,
    pub kv_step: i64,
    pub num_blocks: i64,
    pub head_units: i32,
    pub ptr_layer_mul: i32,
    pub ptr_kv_mul: i32,
    pub nl: i32,
    pub bs: i32,
    pub nh: i32,
    pub hnd: i32,
    pub blocked_scale: i32,
    pub chunk_slots: i32,
    pub blocks_per_object: i32,
    pub skip_blocks: i32,
    pub total_blocks: i32,
}

const _: () = assert!(std::mem::size_of::<KernelObjects>() == 32);
const _: () = assert!(std::mem::size_of::<KernelLayout>() == 80);
const _: () = assert!(std::mem::align_of::<KernelLayout>() == 8);
const _: () = assert!(std::mem::offset_of!(KernelLayout, num_blocks) == 24);
const _: () = assert!(std::mem::offset_of!(KernelLayout, head_units) == 32);
const _: () = assert!(std::mem::offset_of!(KernelLayout, total_blocks) == 76);

/// CUDA's limit on `gridDim.y` and `gridDim.z`.
pub const MAX_GRID_YZ: u32 = 65_535;

/// Grid and thread-block dimensions of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

/// Everything one launch needs besides the device pointers. The launcher
/// must also see that every paged base pointer and object pointer is aligned
/// to the table's `unit_bytes` (IPC bases are; offsets inside a shared pool
/// may not be), and that every block id was checked against `nb` on the host
/// (the kernel skips bad ids rather than write out of bounds, silently).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLaunch {
    pub entry: &'static str,
    pub layout: KernelLayout,
    pub dims: LaunchDims,
}

fn to_i32(value: u64, what: &'static str) -> Result<i32, CopyError> {
    i32::try_from(value).map_err(|_| CopyError::CallTooLarge {
        what,
        value,
        max: i32::MAX as u64,
    })
}

impl KernelLaunch {
    /// Builds the launch of one copy call: `blocks` block ids split over
    /// `objects` objects, `skip_blocks` leading blocks left untouched.
    pub fn new(
        table: &StrideTable,
        direction: CopyDirection,
        objects: usize,
        blocks: usize,
        chunk_slots: u64,
        skip_blocks: usize,
    ) -> Result<Self, CopyError> {
        let bpo = table.check_call(objects, blocks, chunk_slots, skip_blocks)?;
        let s = table.shape();
        let total = blocks as u64;
        if total > u64::from(MAX_GRID_YZ) {
            return Err(CopyError::CallTooLarge {
                what: "block ids per launch",
                value: total,
                max: MAX_GRID_YZ.into(),
            });
        }
        if s.nl > MAX_GRID_YZ {
            return Err(CopyError::CallTooLarge {
                what: "layers per launch",
                value: s.nl.into(),
                max: MAX_GRID_YZ.into(),
            });
        }
        // The table is validated: head units, nl, bs and nh fit in i32, and
        // the steps and num_blocks in i64.
        let layout = KernelLayout {
            block_step: table.block_step(),
            layer_step: table.layer_step(),
            kv_step: table.kv_step(),
            num_blocks: s.nb as i64,
            head_units: to_i32(table.head_units(), "head units")?,
            ptr_layer_mul: table.ptr_layer_mul() as i32,
            ptr_kv_mul: table.ptr_kv_mul() as i32,
            nl: s.nl as i32,
            bs: s.bs as i32,
            nh: s.nh as i32,
            hnd: table.hnd().into(),
            blocked_scale: table.blocked_scale().into(),
            chunk_slots: to_i32(chunk_slots, "chunk_slots")?,
            blocks_per_object: to_i32(bpo, "blocks per object")?,
            skip_blocks: to_i32(skip_blocks as u64, "skip_blocks")?,
            total_blocks: to_i32(total, "block ids")?,
        };
        // x: units of one head (the whole row for the blocked-scale format,
        // nh == 1 there), y: heads, z: tokens, at most 1024 threads.
        let units = if table.blocked_scale() {
            table.row_units()
        } else {
            table.head_units()
        };
        let x = units.min(32) as u32;
        let y = s.nh;
        let z = s.bs.min(1024 / (x * y)).clamp(1, 64);
        let entry = entry_name(direction, table.unit_bytes()).ok_or(CopyError::CallTooLarge {
            what: "copy unit bytes",
            value: table.unit_bytes().into(),
            max: 16,
        })?;
        Ok(Self {
            entry,
            layout,
            dims: LaunchDims {
                grid: [s.kv_size, total as u32, s.nl],
                block: [x, y, z],
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard_layout::stride::{EngineKvFormat, PageBufferShape};

    #[test]
    fn source_defines_every_entry() {
        for name in KV_BLOCK_COPY_ENTRIES {
            assert!(
                KV_BLOCK_COPY_SRC.contains(&format!("{name}(")),
                "{name} missing from the kernel source"
            );
        }
        assert!(KV_BLOCK_COPY_SRC.contains("sizeof(KvLayout) == 80"));
    }

    #[test]
    fn launch_for_flash_attention() {
        let shape = PageBufferShape {
            kv_size: 2,
            nl: 32,
            nb: 10_000,
            bs: 16,
            nh: 8,
            hs: 128,
            element_size: 2,
            block_stride_elems: 0,
        };
        let t = StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &shape).unwrap();
        let l = KernelLaunch::new(&t, CopyDirection::Scatter, 4, 64, 256, 3).unwrap();
        assert_eq!(l.entry, "kv_scatter_u16");
        assert_eq!(l.dims.grid, [2, 64, 32]);
        assert_eq!(l.dims.block, [16, 8, 8]);
        assert_eq!(l.layout.head_units, 16);
        assert_eq!(l.layout.block_step, 16 * 8 * 16);
        assert_eq!(l.layout.kv_step, 10_000 * 16 * 8 * 16);
        assert_eq!((l.layout.blocks_per_object, l.layout.skip_blocks), (16, 3));
        assert_eq!(
            KernelLaunch::new(&t, CopyDirection::Gather, 4, 64, 255, 0),
            Err(CopyError::ChunkSlotsMismatch {
                chunk_slots: 255,
                blocks_per_object: 16,
                bs: 16
            })
        );
    }

    #[test]
    fn launch_for_blocked_scale_uses_u4_rows() {
        let shape = PageBufferShape {
            kv_size: 1,
            nl: 2,
            nb: 8,
            bs: 64,
            nh: 1,
            hs: 132,
            element_size: 1,
            block_stride_elems: 0,
        };
        let t = StrideTable::new(EngineKvFormat::NL_X_NB_BSV_BSS, &shape).unwrap();
        let l = KernelLaunch::new(&t, CopyDirection::Gather, 1, 4, 256, 0).unwrap();
        assert_eq!(l.entry, "kv_gather_u4");
        assert_eq!(l.dims.block, [32, 1, 32]);
        assert_eq!(l.layout.blocked_scale, 1);
        assert_eq!(entry_name(CopyDirection::Gather, 8), None);
    }
}
