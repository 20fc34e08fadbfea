//! kvshard-engine: keys and chunk hashing, the L1 shard (slab allocator, object
//! table, TTL locks, staging), eviction policies, and the L2 adapters. Each
//! shard's executor owns one [`l1::L1Shard`] (pure, synchronous code) and its own
//! [`l2`] adapter instances (async, on that executor); nothing here is shared
//! between threads.

pub mod eviction;
pub mod keys;
pub mod l1;
pub mod l2;
pub mod slab;
