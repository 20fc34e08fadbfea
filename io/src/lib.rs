//! kvshard-io: per-core executors and placement, memory arenas, cross-thread
//! mailboxes and the glue that runs hyper on glommio.

pub mod arena;
pub mod clock;
pub mod executor;
pub mod http;
pub mod json_text;
pub mod log_limit;
pub mod mailbox;
pub mod memory;
pub mod prefault;
pub mod shm_segment;
pub mod termination;
pub mod timeout;
