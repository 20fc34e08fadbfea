//! kvshard-transport: the ZeroMQ front end, lmcache 0.5.6's msgpack wire, RPC
//! handlers, transfer paths, worker registry and the HTTP API.

pub mod config;
pub mod control;
pub mod cpu_shm;
pub mod cuda_refusal;
pub mod cuda_transfer;
pub mod front;
pub mod http_api;
mod l1_slab;
pub mod lookup_leases;
pub mod lookup_log;
pub mod metrics;
pub mod msgpack;
pub mod oneshot;
pub mod registry;
pub mod server;
pub mod session;
pub mod shard;
pub mod shard_l2;
pub mod wire;
