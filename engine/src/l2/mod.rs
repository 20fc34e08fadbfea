//! The L2 tier: storage behind L1 that chunks are written behind to and
//! prefetched back from.
//!
//! Semantics follow lmcache 0.5.6's `L2AdapterInterface`, made async and per
//! shard: every shard drives its own adapter instances on its own executor, so
//! nothing here is shared between threads and no future is `Send`. Adapters
//! read from and write into L1 slab memory directly ([`ObjectBytes`]); the
//! caller keeps the object locked in L1 until the adapter's future resolves.
//!
//! - [`L2Adapter`]: the trait every adapter implements (store, lookup-and-lock,
//!   load, unlock, delete, list, status).
//! - [`tier::L2Tier`]: one adapter plus its usage accounting (bytes by
//!   cache_salt) and its optional eviction policy.
//! - [`config`]: the `--l2-adapter` JSON specs.
//! - [`mock`], [`fs`] and [`s3`]: the adapters.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use crate::keys::ObjectKey;

pub mod config;
pub mod fs;
pub mod health;
pub mod mock;
pub mod naming;
pub mod resp;
pub mod s3;
pub mod tier;

/// A boxed future local to one executor (adapters are per shard).
pub type LocalFut<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// The bytes of one L1 object, handed to an adapter for a store (read) or a
/// load (write).
///
/// It is a raw view, with no lifetime: adapters hand it to work that is not
/// bounded by a borrow (the fs adapter's blocking pool, an s3 connection that
/// may still read a PUT body after its request ended), and a borrow would end
/// when the adapter's future is dropped while that work still touches the
/// memory. So every constructor is `unsafe` and whoever builds one takes on
/// the whole contract, for the value and every copy of it:
///
/// - the memory stays allocated, and is neither written by anyone else while
///   an adapter stores from it nor read or written by anyone else while an
///   adapter loads into it, until every adapter call that received the view
///   has resolved (in the server the L1 read or write lock, renewed while the
///   adapters work, does this);
/// - such a call's future is driven to completion, not dropped: a dropped
///   future does not stop I/O it already started on another thread or
///   connection.
///
/// It is `Send` so that blocking I/O threads may use it under the same
/// contract. Adapters may rely on it in their `unsafe` blocks; safe code
/// cannot build a view, so cannot hand an adapter dangling memory.
#[derive(Debug, Clone, Copy)]
pub struct ObjectBytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: an ObjectBytes is a pointer plus a length; the constructor's
// contract (memory stays valid and exclusively used for the adapter call)
// makes it sound to touch from the thread that performs the I/O.
unsafe impl Send for ObjectBytes {}

impl ObjectBytes {
    /// A view of `len` bytes at `ptr` (an L1 object).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes and stay so, used by
    /// nobody else in the way described on the type, until every adapter call
    /// that receives this value (or a copy) has resolved; those calls must be
    /// driven to completion.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        ObjectBytes { ptr, len }
    }

    /// A view of a caller-owned buffer (tests, benches, staging copies).
    ///
    /// # Safety
    /// As [`ObjectBytes::new`]: `buf` must not be dropped, moved out of,
    /// read or written until every adapter call that receives this value (or
    /// a copy) has resolved, and those calls must be driven to completion.
    /// The `&mut` borrow ends when this returns; it does not enforce that.
    pub unsafe fn from_mut_slice(buf: &mut [u8]) -> Self {
        ObjectBytes {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// # Safety
    /// Only inside an adapter call that received this view (the type's
    /// contract holds there), and the slice must not outlive that call or
    /// coexist with a slice from [`ObjectBytes::as_mut_slice`].
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// # Safety
    /// Only inside an adapter load that received this view (the type's
    /// contract holds there), and the slice must not outlive that call or
    /// coexist with any other slice of the same memory.
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// Per-key outcome of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreResult {
    /// Written; the object occupies this many bytes in the adapter.
    Stored(u64),
    /// The adapter already holds the key; nothing was written.
    Exists,
    /// Not stored (I/O error, no room, object too large, ...). The adapter
    /// logs the cause; no partial object is visible under the key.
    Failed,
}

/// One page of [`L2Adapter::list`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPage {
    /// Keys with the size each occupies in the adapter.
    pub keys: Vec<(ObjectKey, u64)>,
    /// When the adapter knows them, each key's last modification time, in
    /// `keys` order (usage seeding adopts the oldest first); empty when it
    /// does not.
    pub modified: Vec<Option<std::time::SystemTime>>,
    /// Pass back to get the next page; `None` when this is the last.
    pub next_cursor: Option<String>,
}

/// One object a [`L2Adapter::scan`] found: its key, the bytes it occupies and,
/// when the adapter knows it, when it was last written.
pub type Scanned = (ObjectKey, u64, Option<SystemTime>);

/// Objects a [`L2Adapter::scan`] has looked at so far, all shards' included
/// (shared with the threads it runs on, for `/status`).
pub type ScanSeen = Arc<AtomicU64>;

/// A storage tier behind L1, driven by one shard.
///
/// Every method may be called while other calls on the same instance are in
/// flight (the shard runs many requests concurrently on one thread). Batch
/// methods answer one entry per input key, in input order.
pub trait L2Adapter {
    /// The adapter type, as in `--l2-adapter '{"type": ...}'`.
    fn kind(&self) -> &'static str;

    /// Bytes the adapter may hold on this shard; 0 means unbounded (no global
    /// eviction, as 0.5.6's `max_capacity_bytes=0`).
    fn capacity_bytes(&self) -> u64;

    /// Stores each object's bytes under its key. A key the adapter already
    /// holds is skipped ([`StoreResult::Exists`]). Concurrent stores of one key
    /// leave exactly one complete object. An object is visible under its key
    /// only once it is complete.
    fn store<'a>(&'a self, items: &'a [(ObjectKey, ObjectBytes)])
        -> LocalFut<'a, Vec<StoreResult>>;

    /// For each key: `Some(size)` if the adapter holds it, in which case the
    /// key is now locked against deletion until [`L2Adapter::unlock`]; `None`
    /// if it is missing (nothing is locked).
    fn lookup_and_lock<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>>;

    /// Reads each key's object into its buffer. `true` only if the whole
    /// object was read and its size equals the buffer's length.
    fn load<'a>(&'a self, items: &'a [(ObjectKey, ObjectBytes)]) -> LocalFut<'a, Vec<bool>>;

    /// Releases one lock taken by [`L2Adapter::lookup_and_lock`] per key. It
    /// always succeeds; unknown or unlocked keys are ignored.
    fn unlock(&self, keys: &[ObjectKey]);

    /// Deletes keys that are not locked. For each key: `Some(bytes freed)`
    /// when it was deleted, `None` when it was missing, locked or could not
    /// be deleted.
    fn delete<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>>;

    /// Lists stored keys (of `model_name` when given), `page_size` at a time.
    fn list<'a>(
        &'a self,
        model_name: Option<&'a str>,
        page_size: usize,
        cursor: Option<String>,
    ) -> LocalFut<'a, io::Result<KeyPage>>;

    /// Adapter-specific health and settings for `/status` (never secrets).
    fn status(&self) -> serde_json::Value;

    /// Every object the adapter holds whose key shard `shard` of
    /// `num_shards` owns, for usage seeding; `seen` counts the objects looked
    /// at as it goes. Also answers what it found before an error, with the
    /// error. Default: [`L2Adapter::list`] page by page.
    fn scan(
        &self,
        shard: usize,
        num_shards: usize,
        seen: ScanSeen,
    ) -> LocalFut<'_, (Vec<Scanned>, io::Result<()>)> {
        Box::pin(async move {
            const PAGE: usize = 1000;
            let mut cursor = None;
            let mut found = Vec::new();
            loop {
                let page = match self.list(None, PAGE, cursor).await {
                    Ok(p) => p,
                    Err(e) => return (found, Err(e)),
                };
                seen.fetch_add(page.keys.len() as u64, Ordering::Relaxed);
                let mut modified = page.modified.into_iter();
                for (key, size) in page.keys {
                    let at = modified.next().flatten();
                    if key.shard(num_shards) == shard {
                        found.push((key, size, at));
                    }
                }
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => return (found, Ok(())),
                }
            }
        })
    }

    /// The operations whose latest outcome was a failure, with the cause
    /// (a full disk, a refused credential, an endpoint that does not
    /// connect). Default: none.
    fn failures(&self) -> Vec<health::Failure> {
        Vec::new()
    }

    /// Asks the backing store for an answer (a stat, a HEAD of an object
    /// that need not exist): `Ok` when it answers at all, whatever the
    /// answer. The shard probes a tier its [`health::Gate`] closed; the
    /// probe bounds its own wait where it can. Default: `Ok`.
    fn probe(&self) -> LocalFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    /// The size of one full chunk's object of object group `object_group`
    /// for `model_name` at world size `world_size` (the top byte of a
    /// kv_rank), from the layout registered for them; the shard passes it on
    /// whenever a request names that layout. An adapter that keeps only full
    /// chunks (s3, as 0.5.6's s3 path) refuses to store objects of another
    /// size. Default: ignored.
    fn set_full_chunk_size(
        &self,
        _model_name: &str,
        _world_size: u32,
        _object_group: u32,
        _bytes: u64,
    ) {
    }
}

/// The world size a kv_rank encodes (0.5.6's `ComputeKVRank`: the top byte).
pub fn kv_rank_world_size(kv_rank: u32) -> u32 {
    kv_rank >> 24
}
