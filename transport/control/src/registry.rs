//! Worker registrations (engine_driven contexts and lmcache_driven cpu_shm
//! mappings), their liveness, pending SHM reservations, and the object layout
//! registered per (model, world_size).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_engine::keys::ObjectKey;

use kvshard_dataplane::cpu_shm::{CpuShmRegistration, TransferError};
use kvshard_dataplane::cuda_transfer::CudaInstance;
use kvshard_layout::{ObjectGroup, ObjectLayout, ShmTensorSpec};
use kvshard_wire::msgpack::Value;
use kvshard_wire::{self as wire, InstanceId, IpcData, IpcKey};

/// Why a registration was refused.
#[derive(Debug)]
pub enum RegistryError {
    /// The table holds `--max-registrations` instances.
    Full {
        max: usize,
    },
    /// The (model, world size) is registered already with another object
    /// layout: objects are keyed without it, so one worker would read
    /// another's bytes as its own shape.
    LayoutConflict {
        model: String,
        world_size: u32,
        registered: ObjectLayout,
        asked: ObjectLayout,
    },
    /// The (model, world size) is registered already with other object
    /// groups (their count, sizes or windows).
    ObjectGroupsConflict {
        model: String,
        world_size: u32,
        /// Per object group: bytes of its object, window in chunks.
        registered: Vec<(u64, i64)>,
        asked: Vec<(u64, i64)>,
    },
    EmptyKvCache,
    /// A layer of a cpu_shm registration is a CUDA tensor.
    CudaLayer {
        layer: usize,
    },
    UnsupportedDescriptor {
        layer: usize,
        tag: String,
    },
    /// The worker's SHM tensors cannot be opened or laid out.
    CpuShm(TransferError),
}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryError::Full { max } => {
                write!(f, "registration table full ({max} instances, --max-registrations)")
            }
            RegistryError::LayoutConflict {
                model,
                world_size,
                registered: l,
                asked,
            } => write!(
                f,
                "model {model} world_size {world_size} is already registered with object layout \
                 {:?} {} ({} bytes); this registration has {:?} {} ({} bytes)",
                l.shape, l.dtype, l.bytes, asked.shape, asked.dtype, asked.bytes
            ),
            RegistryError::ObjectGroupsConflict {
                model,
                world_size,
                registered,
                asked,
            } => write!(
                f,
                "model {model} world_size {world_size} is already registered with object groups \
                 of (bytes, sliding window chunks) {registered:?}; this registration forms \
                 {asked:?}"
            ),
            RegistryError::EmptyKvCache => f.write_str("kv_cache is empty"),
            RegistryError::CudaLayer { layer } => write!(
                f,
                "layer {layer} is a CUDA IPC tensor: CUDA transfer is unavailable in this kvshard \
                 build; run the worker with mp_transfer_mode=engine_driven or a cpu_shm registration"
            ),
            RegistryError::UnsupportedDescriptor { layer, tag } => {
                write!(f, "layer {layer} has unsupported device descriptor type {tag:?}")
            }
            RegistryError::CpuShm(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for RegistryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RegistryError::CpuShm(e) => Some(e),
            _ => None,
        }
    }
}

/// The object groups of each (model, world_size), reference-counted by
/// registrations. A layout of one object group (engine_driven, CUDA, or
/// object groups not separate) is one group of full attention.
#[derive(Default)]
pub struct Layouts {
    map: HashMap<(String, u32), (Vec<ObjectGroup>, usize)>,
}

/// Per object group: its object's bytes and its window in chunks.
fn shape_of(groups: &[ObjectGroup]) -> Vec<(u64, i64)> {
    groups
        .iter()
        .map(|g| (g.layout.bytes, g.window_chunks))
        .collect()
}

impl Layouts {
    pub fn get(&self, model: &str, ws: u32) -> Option<&[ObjectGroup]> {
        self.map.get(&(model.to_owned(), ws)).map(|(l, _)| &l[..])
    }

    /// Registers a layout of one object group.
    pub fn register(
        &mut self,
        model: &str,
        ws: u32,
        layout: &ObjectLayout,
    ) -> Result<(), RegistryError> {
        let group = ObjectGroup {
            kernel_groups: Vec::new(),
            window_chunks: -1,
            layout: layout.clone(),
        };
        self.register_groups(model, ws, std::slice::from_ref(&group))
    }

    /// Objects are keyed without their layout, so two layouts for one
    /// (model, world_size) would let one worker read another's bytes as its own
    /// shape: refuse the second.
    pub fn register_groups(
        &mut self,
        model: &str,
        ws: u32,
        groups: &[ObjectGroup],
    ) -> Result<(), RegistryError> {
        match self.map.get_mut(&(model.to_owned(), ws)) {
            Some((l, refs)) if shape_of(l) == shape_of(groups) => {
                *refs += 1;
                Ok(())
            }
            Some((l, _)) if l[0].layout.bytes != groups[0].layout.bytes => {
                Err(RegistryError::LayoutConflict {
                    model: model.to_owned(),
                    world_size: ws,
                    registered: l[0].layout.clone(),
                    asked: groups[0].layout.clone(),
                })
            }
            Some((l, _)) => Err(RegistryError::ObjectGroupsConflict {
                model: model.to_owned(),
                world_size: ws,
                registered: shape_of(l),
                asked: shape_of(groups),
            }),
            None => {
                self.map
                    .insert((model.to_owned(), ws), (groups.to_vec(), 1));
                Ok(())
            }
        }
    }

    pub fn unregister(&mut self, model: &str, ws: u32) {
        let k = (model.to_owned(), ws);
        if let Some((_, refs)) = self.map.get_mut(&k) {
            *refs -= 1;
            if *refs == 0 {
                self.map.remove(&k);
            }
        }
    }
}

/// Identity of a pending SHM transfer: the instance and the key as 0.5.6 compares
/// it (request_id, request_configs and num_kv_readers excluded).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TransferKey {
    pub instance_id: InstanceId,
    digest: [u8; 32],
}

impl TransferKey {
    /// `tokens` is the [`token_digest`](crate::session::token_digest) of
    /// `key.token_ids`, which the caller may have at hand.
    pub fn new(instance_id: InstanceId, key: &IpcKey, tokens: &[u8; 32]) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(&(key.model_name.len() as u64).to_le_bytes());
        h.update(key.model_name.as_bytes());
        h.update(&key.world_size.to_le_bytes());
        h.update(&key.worker_id.map_or(-1, |w| w).to_le_bytes());
        h.update(&key.start.to_le_bytes());
        h.update(&key.end.to_le_bytes());
        h.update(&(key.cache_salt.len() as u64).to_le_bytes());
        h.update(key.cache_salt.as_bytes());
        h.update(tokens);
        TransferKey {
            instance_id,
            digest: *h.finalize().as_bytes(),
        }
    }
}

pub struct EngineEntry {
    pub model_name: String,
    pub world_size: u32,
    pub layout: ObjectLayout,
    pub block_size: i64,
    pub use_mla: bool,
    pub last_seen: Instant,
    pub pinged: bool,
    /// kv ranks this worker has sent keys for (empty until its first transfer).
    pub kv_ranks: Vec<u32>,
}

/// How an lmcache_driven worker's KV cache is reached.
#[derive(Debug, Clone)]
pub enum LmcTransfer {
    /// CPU tensors in POSIX shm (cpu_shm).
    CpuShm(Arc<CpuShmRegistration>),
    /// GPU tensors over CUDA IPC, copied by a device thread.
    Cuda(Arc<CudaInstance>),
}

impl LmcTransfer {
    /// The object groups, by id.
    pub fn object_groups(&self) -> &[ObjectGroup] {
        match self {
            LmcTransfer::CpuShm(r) => r.object_groups(),
            LmcTransfer::Cuda(c) => c.object_groups(),
        }
    }

    /// Whether object group `og`'s block ids of a chunk are all the null
    /// block id: its object is not stored.
    pub fn all_null_in(&self, og: usize, block_ids: &[i64]) -> bool {
        match self {
            LmcTransfer::CpuShm(r) => r.all_null_in(og, block_ids),
            LmcTransfer::Cuda(c) => c.all_null_in(og, block_ids),
        }
    }

    /// Bytes of one full chunk's object of each object group.
    pub fn object_sizes(&self) -> kvshard_dataplane::messages::ObjectSizes {
        let bytes = self.object_groups().iter().map(|g| g.layout.bytes);
        kvshard_dataplane::messages::ObjectSizes::new(bytes.collect())
    }
}

pub struct LmcEntry {
    pub model_name: String,
    pub world_size: u32,
    pub reg: LmcTransfer,
    pub layout: ObjectLayout,
    pub last_seen: Instant,
    pub pinged: bool,
    /// kv ranks this worker has sent keys for (empty until its first transfer).
    pub kv_ranks: Vec<u32>,
}

/// A registration taken out of the registry (unregistered or reaped).
pub enum Released {
    Engine(InstanceId, EngineEntry),
    Lmc(InstanceId, LmcEntry),
}

impl Released {
    pub fn identity(&self) -> (InstanceId, String, u32) {
        match self {
            Released::Engine(i, e) => (*i, e.model_name.clone(), e.world_size),
            Released::Lmc(i, e) => (*i, e.model_name.clone(), e.world_size),
        }
    }
}

/// A prepare_store not committed yet: the objects staged for it and the
/// writer tag they are staged under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWrite {
    pub keys: Vec<ObjectKey>,
    pub tag: kvshard_engine::l1::WriterTag,
}

pub struct Registry {
    engine: HashMap<InstanceId, EngineEntry>,
    lmc: HashMap<InstanceId, LmcEntry>,
    pub pending_writes: HashMap<TransferKey, PendingWrite>,
    /// Read-locked objects of each prepare_retrieve not committed yet, oldest
    /// first. One instance may retrieve the same token range for two requests
    /// at once (the transfer key leaves the request id out, as 0.5.6's does):
    /// each prepare keeps its own share and each commit releases one.
    pending_reads: HashMap<TransferKey, VecDeque<Vec<ObjectKey>>>,
    max: usize,
}

/// Uncommitted prepare_retrieves kept per transfer key; beyond it the oldest
/// is released (its worker never committed).
pub const MAX_PENDING_READS_PER_KEY: usize = 16;

impl Registry {
    pub fn new(max: usize) -> Self {
        Registry {
            engine: HashMap::new(),
            lmc: HashMap::new(),
            pending_writes: HashMap::new(),
            pending_reads: HashMap::new(),
            max,
        }
    }

    fn room(&self) -> Result<(), RegistryError> {
        if self.engine.len() + self.lmc.len() >= self.max {
            return Err(RegistryError::Full { max: self.max });
        }
        Ok(())
    }

    pub fn insert_engine(&mut self, iid: InstanceId, e: EngineEntry) -> Result<(), RegistryError> {
        self.room()?;
        self.engine.insert(iid, e);
        Ok(())
    }

    pub fn insert_lmc(&mut self, iid: InstanceId, e: LmcEntry) -> Result<(), RegistryError> {
        self.room()?;
        self.lmc.insert(iid, e);
        Ok(())
    }

    pub fn remove_engine(&mut self, iid: InstanceId) -> Option<EngineEntry> {
        self.engine.remove(&iid)
    }

    pub fn remove_lmc(&mut self, iid: InstanceId) -> Option<LmcEntry> {
        self.lmc.remove(&iid)
    }

    /// Whether `iid` holds a registration in either transfer mode.
    pub fn is_registered(&self, iid: InstanceId) -> bool {
        self.engine.contains_key(&iid) || self.lmc.contains_key(&iid)
    }

    /// PING: refreshes liveness and marks the instance as ping-proven.
    pub fn ping(&mut self, iid: InstanceId, now: Instant) {
        if let Some(e) = self.engine.get_mut(&iid) {
            e.last_seen = now;
            e.pinged = true;
        }
        if let Some(e) = self.lmc.get_mut(&iid) {
            e.last_seen = now;
            e.pinged = true;
        }
    }

    /// Traffic refreshes liveness without the ping latch (0.5.6 behaviour).
    pub fn touch_traffic(&mut self, iid: InstanceId, now: Instant) {
        if let Some(e) = self.engine.get_mut(&iid) {
            e.last_seen = now;
        }
        if let Some(e) = self.lmc.get_mut(&iid) {
            e.last_seen = now;
        }
    }

    /// A repeated engine_driven registration of a known instance only refreshes
    /// its liveness (0.5.6). An lmcache_driven registration of the same id is
    /// another context: the two coexist, as in 0.5.6's two transfer modules.
    pub fn touch_engine(&mut self, iid: InstanceId, now: Instant) -> bool {
        self.engine
            .get_mut(&iid)
            .map(|e| e.last_seen = now)
            .is_some()
    }

    /// [`touch_engine`](Self::touch_engine) for lmcache_driven registrations.
    pub fn touch_lmc(&mut self, iid: InstanceId, now: Instant) -> bool {
        self.lmc.get_mut(&iid).map(|e| e.last_seen = now).is_some()
    }

    /// Notes that instance `iid` reads and writes objects of kv rank `rank`.
    pub fn note_rank(&mut self, iid: InstanceId, rank: u32) {
        let note = |ranks: &mut Vec<u32>| {
            if !ranks.contains(&rank) {
                ranks.push(rank);
            }
        };
        if let Some(e) = self.engine.get_mut(&iid) {
            note(&mut e.kv_ranks);
        }
        if let Some(e) = self.lmc.get_mut(&iid) {
            note(&mut e.kv_ranks);
        }
    }

    /// Live instances (either mode, each once) of `model`/`world_size` that may
    /// read objects of kv rank `rank`: those seen with that rank, and those
    /// whose rank is not known yet.
    pub fn readers_of(&self, model: &str, world_size: u32, rank: u32) -> Vec<InstanceId> {
        let may = |m: &str, ws: u32, ranks: &[u32]| {
            m == model && ws == world_size && (ranks.is_empty() || ranks.contains(&rank))
        };
        let mut ids: Vec<InstanceId> = self
            .engine
            .iter()
            .filter(|(_, e)| may(&e.model_name, e.world_size, &e.kv_ranks))
            .map(|(i, _)| *i)
            .chain(
                self.lmc
                    .iter()
                    .filter(|(_, e)| may(&e.model_name, e.world_size, &e.kv_ranks))
                    .map(|(i, _)| *i),
            )
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The object sizes of the engine_driven registrations, each once.
    pub fn engine_sizes(&self) -> Vec<u64> {
        let mut sizes: Vec<u64> = self.engine.values().map(|e| e.layout.bytes).collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    pub fn engine_layout(&mut self, iid: InstanceId, now: Instant) -> Option<ObjectLayout> {
        let e = self.engine.get_mut(&iid)?;
        e.last_seen = now;
        Some(e.layout.clone())
    }

    pub fn lmc_reg(
        &mut self,
        iid: InstanceId,
        now: Instant,
    ) -> Option<(LmcTransfer, ObjectLayout)> {
        let e = self.lmc.get_mut(&iid)?;
        e.last_seen = now;
        Some((e.reg.clone(), e.layout.clone()))
    }

    /// Removes instances silent past their budget: `timeout` once they have pinged,
    /// `grace` before their first ping.
    pub fn reap(
        &mut self,
        now: Instant,
        timeout: Duration,
        grace: Duration,
    ) -> Vec<(InstanceId, Released)> {
        let stale = |last: Instant, pinged: bool| {
            now.duration_since(last) > if pinged { timeout } else { grace }
        };
        let e_ids: Vec<InstanceId> = self
            .engine
            .iter()
            .filter(|(_, e)| stale(e.last_seen, e.pinged))
            .map(|(i, _)| *i)
            .collect();
        let l_ids: Vec<InstanceId> = self
            .lmc
            .iter()
            .filter(|(_, e)| stale(e.last_seen, e.pinged))
            .map(|(i, _)| *i)
            .collect();
        let mut out = Vec::new();
        for i in e_ids {
            if let Some(e) = self.engine.remove(&i) {
                out.push((i, Released::Engine(i, e)));
            }
        }
        for i in l_ids {
            if let Some(e) = self.lmc.remove(&i) {
                out.push((i, Released::Lmc(i, e)));
            }
        }
        out
    }

    /// Records a prepare_retrieve's read-locked objects. Returns the objects
    /// of an older prepare of the same transfer key to release, when that key
    /// already holds [`MAX_PENDING_READS_PER_KEY`].
    pub fn push_pending_read(
        &mut self,
        key: TransferKey,
        objs: Vec<ObjectKey>,
    ) -> Option<Vec<ObjectKey>> {
        let q = self.pending_reads.entry(key).or_default();
        q.push_back(objs);
        if q.len() > MAX_PENDING_READS_PER_KEY {
            q.pop_front()
        } else {
            None
        }
    }

    /// The objects of the oldest uncommitted prepare_retrieve of `key`.
    pub fn pop_pending_read(&mut self, key: &TransferKey) -> Option<Vec<ObjectKey>> {
        let q = self.pending_reads.get_mut(key)?;
        let objs = q.pop_front();
        if q.is_empty() {
            self.pending_reads.remove(key);
        }
        objs
    }

    /// Takes every pending reservation of `iid` (writes, reads).
    pub fn take_pending(&mut self, iid: InstanceId) -> (Vec<PendingWrite>, Vec<Vec<ObjectKey>>) {
        let of_iid = |k: &TransferKey| k.instance_id == iid;
        let wkeys: Vec<TransferKey> = self
            .pending_writes
            .keys()
            .filter(|k| of_iid(k))
            .cloned()
            .collect();
        let writes = wkeys
            .into_iter()
            .filter_map(|k| self.pending_writes.remove(&k))
            .collect();
        let rkeys: Vec<TransferKey> = self
            .pending_reads
            .keys()
            .filter(|k| of_iid(k))
            .cloned()
            .collect();
        let reads = rkeys
            .into_iter()
            .filter_map(|k| self.pending_reads.remove(&k))
            .flatten()
            .collect();
        (writes, reads)
    }

    pub fn liveness(&self) -> Vec<(InstanceId, &'static str, Instant, bool)> {
        let mut v: Vec<_> = self
            .engine
            .iter()
            .map(|(i, e)| (*i, "engine_driven", e.last_seen, e.pinged))
            .collect();
        v.extend(
            self.lmc
                .iter()
                .map(|(i, e)| (*i, "lmcache_driven", e.last_seen, e.pinged)),
        );
        v
    }

    pub fn engine_ids(&self) -> Vec<InstanceId> {
        let mut v: Vec<InstanceId> = self.engine.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn lmc_ids(&self) -> Vec<InstanceId> {
        let mut v: Vec<InstanceId> = self.lmc.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn engine_meta(&self) -> serde_json::Value {
        let m: serde_json::Map<String, serde_json::Value> = self
            .engine
            .iter()
            .map(|(i, e)| {
                (
                    i.to_string(),
                    serde_json::json!({"model_name": e.model_name, "world_size": e.world_size, "block_size": e.block_size, "use_mla": e.use_mla}),
                )
            })
            .collect();
        serde_json::Value::Object(m)
    }

    pub fn lmc_meta(&self) -> serde_json::Value {
        let m: serde_json::Map<String, serde_json::Value> = self
            .lmc
            .iter()
            .map(|(i, e)| {
                // 0.5.6's `GPUCacheContext.report_status()` shape: `lmcache describe
                // kvcache` reads it as a dict (a string there crashes it).
                let (layout, device) = match &e.reg {
                    LmcTransfer::CpuShm(r) => (
                        layout_status(
                            r.num_registered_tensors(),
                            r.kernel_groups(),
                            r.object_groups(),
                        ),
                        "cpu_shm".to_string(),
                    ),
                    LmcTransfer::Cuda(c) => (
                        layout_status(
                            c.geometry.views.len(),
                            &c.geometry.groups,
                            c.object_groups(),
                        ),
                        format!("cuda:{}", c.ordinal),
                    ),
                };
                (
                    i.to_string(),
                    serde_json::json!({"model_name": e.model_name, "world_size": e.world_size, "kv_cache_layout": layout, "device": device}),
                )
            })
            .collect();
        serde_json::Value::Object(m)
    }
}

/// A registration's `kv_cache_layout` in `/status`: its tensors and kernel
/// groups as 0.5.6's `report_status()` writes them, and (kvshard's) its
/// object groups: each one's kernel groups, sliding window in chunks (-1:
/// full attention) and object bytes.
fn layout_status(
    num_layers: usize,
    groups: &[kvshard_layout::KernelGroup],
    object_groups: &[ObjectGroup],
) -> serde_json::Value {
    let og_of = |k: usize| {
        object_groups
            .iter()
            .position(|o| o.kernel_groups.contains(&k))
            .unwrap_or(0)
    };
    serde_json::json!({
        "num_layers": num_layers,
        "num_blocks": groups.first().map_or(0, |k| k.geometry.num_blocks),
        "cache_size_per_token": groups.iter().map(|k| k.bytes_per_token()).sum::<usize>(),
        "kernel_groups": groups
            .iter()
            .enumerate()
            .map(|(i, k)| kernel_group_status(i, og_of(i), k.engine_group_id, &k.geometry, &k.layers))
            .collect::<Vec<_>>(),
        "object_groups": object_groups
            .iter()
            .enumerate()
            .map(|(i, o)| serde_json::json!({
                "object_group_idx": i,
                "kernel_group_indices": o.kernel_groups,
                "sliding_window_chunks": o.window_chunks,
                "object_bytes": o.layout.bytes,
            }))
            .collect::<Vec<_>>(),
    })
}

/// One entry of `/status`'s `kernel_groups`, as 0.5.6's
/// `GPUCacheContext.report_status()` writes it.
fn kernel_group_status(
    index: usize,
    object_group: usize,
    engine_group_id: i64,
    g: &kvshard_layout::Geometry,
    layers: &[usize],
) -> serde_json::Value {
    let f = g.format;
    serde_json::json!({
        "kernel_group_idx": index,
        "engine_group_idx": engine_group_id,
        "object_group_idx": object_group,
        "num_layers": layers.len(),
        "layer_indices": layers,
        "tokens_per_block": g.block_size,
        "slots_per_block": g.block_size,
        "dtype": format!("torch.{}", g.dtype.name()),
        "engine_kv_concrete_shape": f.concrete_shape(
            layers.len(),
            g.num_blocks,
            g.block_size,
            g.num_heads,
            g.head_size,
        ),
        "is_mla": f.is_mla(),
        "engine_kv_format": f.name(),
        "engine_kv_shape": f.shape_description(),
        "attention_backend": f.attention_backend(),
    })
}

/// Opens a cpu_shm registration from the wire's descriptors; CUDA and other device
/// descriptors are refused with a message saying so.
pub fn open_cpu_shm(
    kv_cache: &[IpcData],
    groups: &[wire::EngineGroupInfo],
    layout_hints: &Value,
    engine_type: &str,
    chunk_size: usize,
    null_block_id: i64,
    separate_object_groups: bool,
) -> Result<CpuShmRegistration, RegistryError> {
    if kv_cache.is_empty() {
        return Err(RegistryError::EmptyKvCache);
    }
    let mut tensors = Vec::with_capacity(kv_cache.len());
    for (i, d) in kv_cache.iter().enumerate() {
        match d {
            IpcData::CpuShm(c) => tensors.push(ShmTensorSpec {
                shm_name: c.shm_name.clone(),
                nbytes: c.nbytes,
                dtype: c.metadata.dtype.clone(),
                shape: c.metadata.shape.clone(),
                stride: c.metadata.stride.clone(),
                storage_offset: c.metadata.storage_offset,
            }),
            IpcData::Cuda(_) | IpcData::CudaRaw(_) | IpcData::CudaVmm(_) => {
                return Err(RegistryError::CudaLayer { layer: i })
            }
            IpcData::Unsupported { tag } => {
                return Err(RegistryError::UnsupportedDescriptor {
                    layer: i,
                    tag: tag.clone(),
                })
            }
        }
    }
    let hint = kvshard_dataplane::cuda_transfer::kv_layout_hint(layout_hints);
    if engine_type != "vllm" && engine_type != "mock" {
        kvshard_io::log_limited!(
            log::Level::Warn,
            "register_kv_cache: engine_type {engine_type:?} is treated like vllm's paged layout"
        );
    }
    CpuShmRegistration::open_grouped(
        &tensors,
        groups,
        chunk_size,
        hint.as_deref(),
        null_block_id,
        separate_object_groups,
    )
    .map_err(RegistryError::CpuShm)
}
