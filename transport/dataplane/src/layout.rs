//! The shape of one chunk object, as workers see it in an SHM slot.

use std::sync::Arc;

use kvshard_wire as wire;

use crate::cpu_shm::{CpuShmRegistration, ObjectLayout};

/// The shape of one chunk object: what a worker sees in an SHM slot. Shape
/// and dtype are shared: every request of an instance takes a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub bytes: u64,
    pub shape: Arc<[u64]>,
    pub dtype: Arc<str>,
}

/// Largest object kvshard accepts (a chunk of a very large model is well below this).
const MAX_OBJECT_BYTES: u64 = 1 << 36;

impl Layout {
    /// 0.5.6's engine_driven layout: `[2, layers, slots, hidden]`, or
    /// `[layers, slots, hidden]` for MLA.
    pub fn engine_driven(
        p: &wire::EngineDrivenPayload,
        chunk_size: usize,
    ) -> Result<Layout, String> {
        let size = wire::dtype_itemsize(&p.dtype_str).ok_or_else(|| {
            format!("invalid dtype_str '{}': must be a torch dtype name such as float16, bfloat16, float32", p.dtype_str)
        })?;
        let slots = match p.num_physical_slots {
            None => chunk_size as i64,
            Some(s) if s > 0 => s,
            Some(s) => return Err(format!("num_physical_slots must be positive, got {s}")),
        };
        if p.num_layers <= 0 || p.hidden_dim_size <= 0 {
            return Err(format!(
                "num_layers {} and hidden_dim_size {} must be positive",
                p.num_layers, p.hidden_dim_size
            ));
        }
        if p.world_size < 1 || p.world_size > kvshard_engine::keys::MAX_WORLD_SIZE as i64 {
            return Err(format!("world_size {} is invalid", p.world_size));
        }
        let mut shape = vec![p.num_layers as u64, slots as u64, p.hidden_dim_size as u64];
        if !p.use_mla {
            shape.insert(0, 2);
        }
        let elems = shape.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
        let bytes = elems
            .and_then(|e| e.checked_mul(size))
            .filter(|b| *b <= MAX_OBJECT_BYTES);
        let bytes = bytes
            .ok_or_else(|| format!("object shape {shape:?} of {} is too large", p.dtype_str))?;
        Ok(Layout {
            bytes,
            shape: shape.into(),
            dtype: p.dtype_str.as_str().into(),
        })
    }

    pub fn from_registration(reg: &CpuShmRegistration) -> Layout {
        Layout::of(&reg.object_layout())
    }

    /// The layout of objects shaped `l`.
    pub fn of(l: &ObjectLayout) -> Layout {
        Layout {
            bytes: l.bytes,
            shape: l.shape.as_slice().into(),
            dtype: l.dtype.as_str().into(),
        }
    }

    /// The SHM slot descriptor of an object at arena offset `offset`.
    pub fn slot(&self, offset: u64) -> wire::ShmSlot<'_> {
        wire::ShmSlot {
            offset,
            length: self.bytes,
            shape: &self.shape,
            dtype: &self.dtype,
        }
    }
}
