//! Test support: starts the real `kvshard` binary and talks to it with an
//! independent ZeroMQ DEALER client and msgpack encoder (written here, apart from
//! the server's codec, so a codec bug cannot hide behind itself).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

mod codec;
mod engine_driven;
mod group_golden;
mod lmcache_driven;
mod lookup_load;
mod metrics;
mod process;
#[allow(unused_imports)]
pub use codec::*;
#[allow(unused_imports)]
pub use engine_driven::*;
#[allow(unused_imports)]
pub use group_golden::*;
#[allow(unused_imports)]
pub use lmcache_driven::*;
#[allow(unused_imports)]
pub use lookup_load::*;
#[allow(unused_imports)]
pub use metrics::*;
#[allow(unused_imports)]
pub use process::*;

// ------------------------------------------------------------ cpu worker

pub mod cpu_worker;

// ------------------------------------------------------------------ s3s-fs

mod s3s;
#[allow(unused_imports)]
pub use s3s::*;

// ------------------------------------------------------ mounted file systems

mod mounts;
#[allow(unused_imports)]
pub use mounts::*;

// ------------------------------------------------------------ fault proxy

mod faults;
#[allow(unused_imports)]
pub use faults::*;

// ------------------------------------------------------------ redis-server

mod redis;
#[allow(unused_imports)]
pub use redis::*;
