//! The KV layout concepts, in one place for the cpu_shm and CUDA paths:
//!
//! - [`format`]: the element types and the per-layer paged formats of vLLM's
//!   KV tensors, and 0.5.6's detector that tells them apart;
//! - [`geometry`]: what a registration's tensors say (each view checked, the
//!   sizes every layer shares, the layers of a chunk object), and the tighter
//!   geometry the GPU copy kernel needs ([`DeviceGeometry`]);
//! - [`object`]: the chunk object's shape, dtype and length ([`ObjectLayout`]);
//! - [`stride`]: the stride tables of 0.5.6's block-copy kernel for every
//!   engine format it handles, and a CPU executor of them;
//! - [`checksum`]: `/cache/checksums`, as 0.5.6 computes and reports it.
//!
//! Nothing here maps memory or touches a device.

pub mod checksum;
pub mod error;
pub mod format;
pub mod geometry;
pub mod object;
pub mod stride;

pub use error::DetectError;
pub use format::{KvDtype, KvFormat};
pub use geometry::{DeviceGeometry, Geometry, KernelGroup, ObjectGroup, ShmTensorSpec};
pub use object::ObjectLayout;
