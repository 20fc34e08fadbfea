//! kvshard-dataplane: what runs on the shard cores and moves bytes. The
//! per-core shard tasks (L1 plus the L2 controllers), the cpu_shm and CUDA
//! transfer paths, and the messages the front, the shards and the device
//! threads exchange (`messages`, a leaf module). The configuration and the
//! HTTP API's requests are kvshard-messages.

pub mod cpu_shm;
pub mod cuda_refusal;
pub mod cuda_transfer;
mod l1_slab;
pub mod messages;
pub mod shard;
