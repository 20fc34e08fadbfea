//! What the HTTP API makes of a request before it asks the server anything:
//! which route a method and path name ([`routes`]) and what a body says
//! ([`bodies`]), with lmcache 0.5.6's answers for the ones it refuses.
//!
//! Nothing here does I/O or knows the server. `kvshard-http` serves these
//! routes; `fuzz/` drives this crate directly.

pub mod bodies;
pub mod routes;
