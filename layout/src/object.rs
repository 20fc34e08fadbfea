//! The chunk object: the shape and dtype of one full chunk in L1, as workers
//! see it in an SHM slot and as L2 stores it.

use std::sync::Arc;

use kvshard_wire as wire;

use crate::error::{invalid, DetectError};

/// Largest object kvshard accepts (a chunk of a very large model is well below this).
pub(crate) const MAX_OBJECT_BYTES: u64 = 1 << 36;

/// Shape, dtype and length of the object of one full chunk. Shape and dtype
/// are shared: every request of an instance takes a copy.
///
/// lmcache_driven objects are `[kv_size, num_layers, chunk_tokens, hidden]`
/// (0.5.6's `get_kernel_group_shape_dtype`); engine_driven ones are what the
/// worker registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectLayout {
    pub bytes: u64,
    pub shape: Arc<[u64]>,
    pub dtype: Arc<str>,
}

impl ObjectLayout {
    /// `shape` of `dtype` elements of `elem_bytes` each; `None` when the
    /// object would be larger than kvshard accepts.
    pub fn new(shape: Vec<u64>, dtype: &str, elem_bytes: u64) -> Option<ObjectLayout> {
        let bytes = shape
            .iter()
            .try_fold(1u64, |a, d| a.checked_mul(*d))
            .and_then(|e| e.checked_mul(elem_bytes))
            .filter(|b| *b <= MAX_OBJECT_BYTES)?;
        Some(ObjectLayout {
            bytes,
            shape: shape.into(),
            dtype: dtype.into(),
        })
    }

    /// 0.5.6's engine_driven layout: `[2, layers, slots, hidden]`, or
    /// `[layers, slots, hidden]` for MLA. The worker's `world_size` is the
    /// key's concern and is checked there.
    pub fn engine_driven(
        p: &wire::EngineDrivenPayload,
        chunk_size: usize,
    ) -> Result<ObjectLayout, DetectError> {
        let size = wire::dtype_itemsize(&p.dtype_str).ok_or_else(|| {
            invalid(format!("invalid dtype_str '{}': must be a torch dtype name such as float16, bfloat16, float32", p.dtype_str))
        })?;
        let slots = match p.num_physical_slots {
            None => chunk_size as i64,
            Some(s) if s > 0 => s,
            Some(s) => {
                return Err(invalid(format!(
                    "num_physical_slots must be positive, got {s}"
                )))
            }
        };
        if p.num_layers <= 0 || p.hidden_dim_size <= 0 {
            return Err(invalid(format!(
                "num_layers {} and hidden_dim_size {} must be positive",
                p.num_layers, p.hidden_dim_size
            )));
        }
        let mut shape = vec![p.num_layers as u64, slots as u64, p.hidden_dim_size as u64];
        if !p.use_mla {
            shape.insert(0, 2);
        }
        let described = format!("object shape {shape:?} of {} is too large", p.dtype_str);
        ObjectLayout::new(shape, &p.dtype_str, size).ok_or_else(|| invalid(described))
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
