//! kvshard-engine: keys and chunk hashing, the L1 shard (slab allocator, object
//! table, TTL locks, staging) and eviction policies. Pure, synchronous code: each
//! shard's executor owns one [`l1::L1Shard`] and nothing here is shared between
//! threads.

pub mod eviction;
pub mod keys;
pub mod l1;
pub mod slab;
