//! kvshard-transport: starts the server (`server::run`: the shards, the front
//! end and the HTTP API) and re-exports its parts under one name:
//!
//! - `wire` (crate kvshard-wire): lmcache 0.5.6's msgpack and typed RPCs, with
//!   no dependencies;
//! - `config` and `oneshot` (crate kvshard-messages, a leaf every part
//!   depends on): the server's configuration, and the channel the HTTP API's
//!   answers come back on (its requests are `kvshard_messages::control`);
//! - the data plane (kvshard-dataplane): shards, L2 controllers, transfer
//!   paths, and the `messages` the front and the shards exchange;
//! - the control plane (kvshard-control): the front, registry, sessions,
//!   metrics;
//! - `http_api` (kvshard-http), which serves the routes and reads the bodies
//!   of kvshard-http-api (no I/O, no server types: the fuzz targets use it alone).

pub mod server;

pub use kvshard_control::{control, front, lookup_leases, lookup_log, metrics, registry, session};
pub use kvshard_dataplane::{cpu_shm, cuda_refusal, cuda_transfer, messages, shard};
pub use kvshard_http as http_api;
pub use kvshard_messages::{config, oneshot};
pub use kvshard_wire as wire;
pub use kvshard_wire::msgpack;
