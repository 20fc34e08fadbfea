//! kvshard-dataplane: what runs on the shard cores and moves bytes. The
//! per-core shard tasks (L1 plus the L2 controllers), the cpu_shm and CUDA
//! transfer paths, the server's configuration, and the messages the front,
//! the shards, the device threads and the HTTP API exchange (`messages`, a
//! leaf module).

pub mod config;
pub mod cpu_shm;
pub mod cuda_refusal;
pub mod cuda_transfer;
mod l1_slab;
pub mod layout;
pub mod messages;
pub mod oneshot;
pub mod shard;
