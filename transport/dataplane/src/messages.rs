//! The messages the front, the shards and the device threads exchange (the
//! HTTP API's requests are `kvshard_messages::control`). This module names no
//! other module of the server but the leaf `cpu_shm` (a lmcache_driven STORE
//! carries its registration), so every part can depend on it without a
//! cycle.

use std::sync::Arc;
use std::time::Instant;

use kvshard_engine::keys::ObjectKey;
use kvshard_engine::l1::{L1Stats, L1Status, WriterTag};
use kvshard_engine::l2::tier::{TierStats, TierUsage};
use kvshard_engine::slab::Slab;
use kvshard_gds::device::WorkerError;

use kvshard_messages::control::{ControlRequest, Responder};
use kvshard_wire::InstanceId;

use crate::cpu_shm::CpuShmRegistration;

/// Sequence number the front uses to match replies to requests; 0 = no reply wanted.
pub type Seq = u64;

/// Bytes of one full chunk's object of each object group of a request's
/// layout, by object group id (a key's `object_group_id`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectSizes(Arc<[u64]>);

impl ObjectSizes {
    pub fn new(by_group: Vec<u64>) -> Self {
        ObjectSizes(by_group.into())
    }

    /// A layout of one object group.
    pub fn one(size: u64) -> Self {
        ObjectSizes(Arc::from([size]))
    }

    /// The size of `key`'s object; 0 for a group the layout does not have
    /// (no object of that size exists, so it is a miss).
    pub fn of(&self, key: &ObjectKey) -> u64 {
        self.group(key.object_group_id)
    }

    pub fn group(&self, og: u32) -> u64 {
        self.0.get(og as usize).copied().unwrap_or(0)
    }

    pub fn groups(&self) -> &[u64] {
        &self.0
    }
}

pub struct ShardMsg {
    pub seq: Seq,
    pub op: ShardOp,
}

pub enum ShardOp {
    /// Read-lock every present key `readers` times and touch the hits (LRU);
    /// look the misses up in L2 (locking what is found there with the size
    /// `sizes` gives its object group). Answers [`ShardReplyBody::Found`] with the hits' slabs.
    Lookup {
        keys: Vec<ObjectKey>,
        readers: u32,
        sizes: ObjectSizes,
        /// When the lookup's wait for L2 ends: the misses L2 has not
        /// answered by then are answered as misses (the L2 check goes on and
        /// gives back what it finds). `None`: no limit.
        deadline: Option<L2Deadline>,
    },
    /// Load keys found in L2 by a lookup into L1 with `readers` read locks
    /// each; answers [`ShardReplyBody::Loaded`]. A load still running at
    /// `deadline` (the front answered the lookup without it) counts against
    /// its tiers, and lands in L1 all the same.
    Load {
        keys: Vec<(ObjectKey, Found)>,
        sizes: ObjectSizes,
        readers: u32,
        tag: WriterTag,
        deadline: Option<L2Deadline>,
    },
    /// Release L2 lookup locks (keys with their `Found` code).
    UnlockL2 {
        keys: Vec<(ObjectKey, Found)>,
    },
    /// Release `count` read locks on each key.
    Release {
        keys: Vec<ObjectKey>,
        count: u32,
    },
    Touch {
        keys: Vec<ObjectKey>,
    },
    /// Stage writes of `sizes.of(key)` bytes per key under writer `tag`.
    ReserveWrite {
        keys: Vec<ObjectKey>,
        sizes: ObjectSizes,
        tag: WriterTag,
    },
    /// Lend the front up to `count` write credits of `size` bytes (slabs it
    /// hands to writers without asking the shard); answers
    /// [`ShardReplyBody::Slabs`] with those granted.
    GrantCredits {
        size: u64,
        count: u32,
    },
    /// Credits the front no longer needs: freed.
    ReturnCredits {
        slabs: Vec<Slab>,
    },
    /// Stage each key in the credit the front gave its writer, under `tag`
    /// (unique to this write), as if reserved now. Sent before the front
    /// answers the writer, so the mailbox brings it ahead of the commit.
    AdoptWrite {
        writes: Vec<(ObjectKey, Slab)>,
        size: u64,
        tag: WriterTag,
    },
    FinishWrite {
        keys: Vec<ObjectKey>,
        tag: WriterTag,
    },
    AbortWrite {
        keys: Vec<ObjectKey>,
        tag: WriterTag,
    },
    /// Slabs of keys that must already be read-locked (by a lookup), for a
    /// transfer that then holds one lock on each key answered with a slab:
    /// the lookup's lock it was handed, or, where `take[i]` is set (the
    /// lookup's lease held none left for it), one more lock taken for it.
    ReadLocked {
        keys: Vec<ObjectKey>,
        take: Vec<bool>,
    },
    /// lmcache_driven STORE: reserve, gather the worker's blocks, finish.
    Store {
        reg: Arc<CpuShmRegistration>,
        items: Vec<(ObjectKey, Vec<i64>)>,
        sizes: ObjectSizes,
        tag: WriterTag,
    },
    /// lmcache_driven RETRIEVE: scatter each read-locked object, then release
    /// the one lock the transfer holds on it (see [`RetrieveItem::take`]).
    Retrieve {
        reg: Arc<CpuShmRegistration>,
        items: Vec<RetrieveItem>,
    },
    Clear {
        force: bool,
    },
    Status,
    SetQuota {
        cache_salt: String,
        limit_bytes: u64,
    },
    RemoveQuota {
        cache_salt: String,
    },
    ResetStats,
}

/// One chunk of an lmcache_driven RETRIEVE.
#[derive(Debug)]
pub struct RetrieveItem {
    pub key: ObjectKey,
    /// The worker's blocks to scatter the chunk into.
    pub blocks: Vec<i64>,
    /// Tokens at the chunk's start that the worker already has.
    pub skip: usize,
    /// The request's lookup handed this transfer none of its locks on the
    /// object (its lease held none left): a lock is taken for the copy first.
    pub take: bool,
}

/// A lookup's deadline for L2 (`--l2-prefetch-load-timeout` after the
/// lookup arrived).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L2Deadline {
    pub at: Instant,
    /// The configured wait, for the log and `/status`.
    pub limit: std::time::Duration,
}

/// Outcome of storing one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    Stored,
    /// Already resident (or being written by someone else): nothing to do.
    AlreadyPresent,
    OutOfMemory,
    Failed,
}

pub enum ShardReplyBody {
    /// Per key: where it was found, and for an L1 hit the offset of its slab
    /// (which this lookup read-locked) or [`NO_SLAB`].
    Found {
        found: Vec<Found>,
        slabs: Vec<u64>,
    },
    /// Per key: whether it is readable in L1 now, holding the load's read
    /// locks, and if so the offset of its slab (else [`NO_SLAB`]).
    Loaded {
        ok: Vec<bool>,
        slabs: Vec<u64>,
    },
    Slabs(Vec<Option<Slab>>),
    Stored(Vec<StoreOutcome>),
    Retrieved(Vec<bool>),
    Count(u64),
    Status(Box<ShardReport>),
    Done,
}

pub struct ShardReply {
    pub seq: Seq,
    pub shard: usize,
    pub body: ShardReplyBody,
}

/// A shard's view for `/status` and `/metrics`.
#[derive(Debug, Clone)]
pub struct ShardReport {
    pub status: L1Status,
    pub stats: L1Stats,
    pub capacity_max_bytes: u64,
    pub bytes_by_salt: Vec<(String, u64)>,
    pub mailbox_full: u64,
    /// Chunks of client stores (engine_driven prepare_store and lmcache_driven
    /// store) refused for lack of L1 memory. With the L2 loads that found no
    /// room (`l2_ctl.prefetch_load_oom_objects`) these are every L1 allocation
    /// failure (`stats.allocation_failure_chunks`).
    pub store_oom_chunks: u64,
    /// Bytes of L1 memory lent to the front as write credits (in
    /// `status.memory_used_bytes`, held by no object yet).
    pub write_credit_bytes: u64,
    pub l2: Vec<TierReport>,
    pub l2_ctl: L2CtlStats,
    /// The shard's GDS slab (file, counters), when the L1 lives in one.
    pub l1_slab: Option<serde_json::Value>,
}

/// Where a lookup found a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Miss,
    /// In L1, read-locked for the lookup.
    L1,
    /// In the L2 tier of this index (cascade order), locked there for the
    /// lookup.
    L2(u8),
}

impl Found {
    pub fn is_l2(self) -> bool {
        matches!(self, Found::L2(_))
    }
}

/// A slab offset that names no slab (a key that was no L1 hit).
pub const NO_SLAB: u64 = u64::MAX;

/// Controller counters of one shard (0.5.6's `lmcache_mp_l2_*` families).
#[derive(Debug, Clone, Copy, Default)]
pub struct L2CtlStats {
    pub store_submitted_requests: u64,
    pub store_submitted_objects: u64,
    pub store_completed_requests: u64,
    pub store_completed_objects: u64,
    /// Objects not stored because their L1 read lock had expired while they
    /// waited for the byte budget.
    pub store_lock_expired_objects: u64,
    pub skip_l1_deleted_objects: u64,
    pub prefetch_lookup_requests: u64,
    pub prefetch_lookup_objects: u64,
    pub prefetch_load_submitted_requests: u64,
    pub prefetch_load_submitted_objects: u64,
    pub prefetch_load_completed_objects: u64,
    pub prefetch_failure_objects: u64,
    /// L2 hits that could not be loaded because L1 had no room for them.
    pub prefetch_load_oom_objects: u64,
    /// L2 hits whose size is not the registered object size (treated as misses).
    pub size_mismatch_objects: u64,
    /// Lookups whose L2 check had not answered by their deadline
    /// (`--l2-prefetch-load-timeout`), and loads still running at it.
    pub prefetch_lookup_timeouts: u64,
    pub prefetch_load_timeouts: u64,
    pub inflight_stores: u64,
    pub inflight_store_bytes: u64,
    pub inflight_loads: u64,
    pub inflight_load_bytes: u64,
}

/// One tier's figures for `/status` and `/metrics`.
#[derive(Debug, Clone)]
pub struct TierReport {
    pub name: String,
    pub usage: TierUsage,
    pub stats: TierStats,
    pub status: serde_json::Value,
}

/// Everything that wakes the front besides the ROUTER socket.
pub enum FrontEvent {
    Shard(ShardReply),
    Control(ControlRequest, Responder),
    Cuda(CudaEvent),
}

/// Where a reply goes: the peer identity and the request's uid and op frames, echoed
/// verbatim.
#[derive(Clone)]
pub struct ReplyTo {
    pub identity: Vec<u8>,
    pub uid: Vec<u8>,
    pub op: Vec<u8>,
}

/// What a device thread reports to the front (on its event queue).
pub enum CudaEvent {
    /// A registration was set up on its GPU, or why not.
    Registered {
        iid: InstanceId,
        result: Result<(), WorkerError>,
    },
    /// A transfer's copies completed (with the exported event), or why not.
    Transferred {
        seq: Seq,
        result: Result<Vec<u8>, WorkerError>,
    },
}
