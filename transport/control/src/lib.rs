//! kvshard-control: the control plane. The front thread (the ZeroMQ ROUTER,
//! RPC handlers, sessions, lookup leases, the worker registry), the metrics and
//! `/status` snapshot it answers with, the lookup-hash log, and the handle the
//! HTTP API calls it through.

pub mod control;
pub mod front;
#[cfg(test)]
mod front_model;
pub mod lookup_leases;
pub mod lookup_log;
pub mod metrics;
pub mod prefetch;
pub mod registry;
pub mod session;
pub mod status;
