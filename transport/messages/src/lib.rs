//! kvshard-messages: what the server's parts share without depending on each
//! other. The configuration the binary builds and every part reads
//! (`config`), the requests the HTTP API hands the front and the answers it
//! gets back (`control`), and the one-shot channel those answers travel on
//! (`oneshot`). It names nothing of the data plane, the control plane or the
//! HTTP server, so each of them can depend on it.

pub mod config;
pub mod control;
pub mod oneshot;

/// The id a worker instance is known by, as the wire decodes it.
pub use kvshard_wire::InstanceId;
