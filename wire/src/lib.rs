//! The typed request/reply layer of lmcache 0.5.6's ZeroMQ protocol.
//!
//! A request is `[uid, op, *payloads]`: `op` is a msgpack int (frozen legacy id)
//! or str (operation name), and each payload frame holds one msgpack value, in
//! the order of the RPC's parameters. Payloads are decoded with msgspec's
//! strictness (an int field rejects bool/float/str, a bool field rejects ints,
//! str rejects bin); dataclasses and msgspec Structs are maps keyed by field
//! name, in any order, unknown keys ignored unless the type forbids them.
//!
//! Replies are a single payload frame encoded exactly as msgspec encodes the
//! Python return value (field definition order), or no frame for `None`.

use std::fmt;

pub mod msgpack;

use crate::msgpack::{DecodeError, Kind, Reader, TokenCache, Value, Writer};

// ---------------------------------------------------------------------------
// Key rules (the engine re-exports these from `kvshard_engine::keys`)
// ---------------------------------------------------------------------------

/// Longest cache_salt accepted, in characters (0.5.6's `_SALT_MAX_LEN`).
pub const CACHE_SALT_MAX_CHARS: usize = 128;

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Why a cache_salt is refused (0.5.6's `IPCCacheServerKey.__post_init__`).
pub fn check_cache_salt(salt: &str) -> Result<(), String> {
    if let Some(c) = salt.chars().find(|c| matches!(c, '@' | '/' | '\\' | '\0')) {
        return Err(format!("cache_salt must not contain {c:?} (got {salt:?})"));
    }
    let n = salt.chars().count();
    if n > CACHE_SALT_MAX_CHARS {
        return Err(format!(
            "cache_salt exceeds max length {CACHE_SALT_MAX_CHARS} (got {n})"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------

/// Every operation of the 0.5.6 RPC table, supported or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    RegisterKvCache,
    UnregisterKvCache,
    RegisterQCache,
    UnregisterQCache,
    StoreQ,
    Store,
    Retrieve,
    Lookup,
    QueryPrefetchStatus,
    WaitPrefetchStatus,
    FreeLookupLocks,
    EndSession,
    RegisterKvCacheEngineDrivenContext,
    UnregisterKvCacheEngineDrivenContext,
    PrepareStore,
    CommitStore,
    PrepareRetrieve,
    CommitRetrieve,
    Clear,
    GetChunkSize,
    Ping,
    ReportBlockAllocation,
    Noop,
    CbRegisterRope,
    CbUnregisterRope,
    CbRetrievePreComputed,
    CbUnifiedLookup,
    CbReorderPlan,
    CbProtocolHandshake,
    P2pLookupAndLock,
    P2pQueryLookupResults,
    P2pUnlockObjects,
    GetExperimental,
    SubscribeKvEvents,
    ServerModuleCall,
}

struct OpInfo {
    op: Op,
    name: &'static str,
    /// `LEGACY_OPERATION_IDS` (frozen; id 11 is retired).
    legacy_id: Option<u8>,
    /// Parameter names of `RequestClient.<op>`, in payload-frame order.
    params: &'static [&'static str],
    /// Whether kvshard decodes and serves this operation.
    supported: bool,
}

const fn op(
    op: Op,
    name: &'static str,
    legacy_id: Option<u8>,
    params: &'static [&'static str],
    supported: bool,
) -> OpInfo {
    OpInfo {
        op,
        name,
        legacy_id,
        params,
        supported,
    }
}

/// The 0.5.6 table (`transport/base.py` signatures, `zmq_impl/wire.py` ids), in
/// `Op` declaration order.
#[rustfmt::skip]
const OPS: [OpInfo; 35] = {
    use Op::*;
    const KEY_IID: &[&str] = &["key", "instance_id"];
    const IID: &[&str] = &["instance_id"];
    const STORE: &[&str] = &["key", "instance_id", "block_ids", "event_ipc_handle"];
    [
        op(RegisterKvCache, "register_kv_cache", Some(1),
           &["instance_id", "kv_cache", "model_name", "world_size", "engine_type", "layout_hints", "engine_group_infos"], true),
        op(UnregisterKvCache, "unregister_kv_cache", Some(2), IID, true),
        op(RegisterQCache, "register_q_cache", Some(3),
           &["instance_id", "q_cache", "model_name", "world_size", "engine_type", "layout_hints", "engine_group_infos"], false),
        op(UnregisterQCache, "unregister_q_cache", Some(4), IID, false),
        op(StoreQ, "store_q", Some(5), STORE, false),
        op(Store, "store", Some(6), STORE, true),
        op(Retrieve, "retrieve", Some(7),
           &["key", "instance_id", "block_ids", "event_ipc_handle", "skip_first_n_tokens"], true),
        op(Lookup, "lookup", Some(8), &["key", "tp_size"], true),
        op(QueryPrefetchStatus, "query_prefetch_status", Some(9), &["request_id"], true),
        op(WaitPrefetchStatus, "wait_prefetch_status", Some(10), &["request_id", "timeout"], true),
        op(FreeLookupLocks, "free_lookup_locks", Some(12), &["key", "tp_size"], true),
        op(EndSession, "end_session", Some(13), &["request_id"], true),
        op(RegisterKvCacheEngineDrivenContext, "register_kv_cache_engine_driven_context", Some(14), &["payload"], true),
        op(UnregisterKvCacheEngineDrivenContext, "unregister_kv_cache_engine_driven_context", Some(15), IID, true),
        op(PrepareStore, "prepare_store", Some(16), KEY_IID, true),
        op(CommitStore, "commit_store", Some(17), &["key", "instance_id", "data"], true),
        op(PrepareRetrieve, "prepare_retrieve", Some(18), KEY_IID, true),
        op(CommitRetrieve, "commit_retrieve", Some(19), KEY_IID, true),
        op(Clear, "clear", Some(20), &["force"], true),
        op(GetChunkSize, "get_chunk_size", Some(21), &[], true),
        op(Ping, "ping", Some(22), IID, true),
        op(ReportBlockAllocation, "report_block_allocation", Some(23), &["instance_id", "model_name", "records"], true),
        op(Noop, "noop", Some(24), &[], true),
        op(CbRegisterRope, "cb_register_rope", Some(25),
           &["instance_id", "cos_sin_caches_ipc", "head_size", "is_neox_style", "group_to_cache", "group_rot",
             "group_head_size", "kv_quant"], false),
        op(CbUnregisterRope, "cb_unregister_rope", Some(26), IID, false),
        op(CbRetrievePreComputed, "cb_retrieve_pre_computed", Some(27),
           &["key", "match_results", "block_ids", "instance_id", "event_ipc_handle"], false),
        op(CbUnifiedLookup, "cb_unified_lookup", Some(28), &["key", "tp_size"], false),
        op(CbReorderPlan, "cb_reorder_plan", None, &["key", "keep_prefix", "budget_ms"], false),
        op(CbProtocolHandshake, "cb_protocol_handshake", Some(33), &["client_version"], false),
        op(P2pLookupAndLock, "p2p_lookup_and_lock", Some(29), &["keys", "group_layout_descs"], false),
        op(P2pQueryLookupResults, "p2p_query_lookup_results", Some(30), &["task_id"], false),
        op(P2pUnlockObjects, "p2p_unlock_objects", Some(31), &["keys"], false),
        op(GetExperimental, "get_experimental", Some(32), &[], true),
        op(SubscribeKvEvents, "subscribe_kv_events", None, &["instance_id", "model_name", "cursor", "max_events"], false),
        op(ServerModuleCall, "server_module_call", None, &["request"], false),
    ]
};

// `Op::info` indexes the table by discriminant.
const _: () = {
    let mut i = 0;
    while i < OPS.len() {
        assert!(
            OPS[i].op as usize == i,
            "OPS must follow Op declaration order"
        );
        i += 1;
    }
};

impl Op {
    /// Every operation, in table order.
    pub const ALL: [Op; 35] = {
        let mut all = [Op::Noop; 35];
        let mut i = 0;
        while i < OPS.len() {
            all[i] = OPS[i].op;
            i += 1;
        }
        all
    };

    fn info(self) -> &'static OpInfo {
        &OPS[self as usize]
    }

    /// The operation name (`RpcOperation`), e.g. `"lookup"`.
    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// The frozen legacy id, or `None` for ops sent by name only.
    pub const fn legacy_id(self) -> Option<u8> {
        OPS[self as usize].legacy_id
    }

    /// The legacy id as the op frame's integer, for the ops that have one
    /// (a compile-time error where a constant asks it of one that has none):
    /// test clients and the load generator take their op numbers from here.
    pub const fn id(self) -> i64 {
        match self.legacy_id() {
            Some(id) => id as i64,
            None => panic!("this operation is sent by name only"),
        }
    }

    /// Parameter names in payload-frame order.
    pub fn params(self) -> &'static [&'static str] {
        self.info().params
    }

    /// Whether kvshard serves this operation (the others decode to
    /// [`RequestError::Unsupported`]).
    pub fn is_supported(self) -> bool {
        self.info().supported
    }

    pub fn from_legacy_id(id: u64) -> Option<Op> {
        OPS.iter()
            .find(|i| i.legacy_id.map(u64::from) == Some(id))
            .map(|i| i.op)
    }

    /// Any operation name, including those that also have a legacy id.
    pub fn from_name(name: &str) -> Option<Op> {
        OPS.iter().find(|i| i.name == name).map(|i| i.op)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why an operation frame names no operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpError {
    /// An empty frame: in 0.5.6 this marks a stream control message
    /// (`[uid, b"", b"ack"|b"cancel"]`), not an operation.
    Empty,
    /// Not a single well-formed msgpack value.
    Malformed(DecodeError),
    /// A msgpack value that is neither int nor str.
    NotIntOrStr(Kind),
    /// An int that is not in the legacy id table (including retired id 11).
    UnknownId(i128),
    /// A str that names no operation.
    UnknownName(String),
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Empty => f.write_str("empty operation frame (stream control message)"),
            OpError::Malformed(e) => write!(f, "malformed operation frame: {e}"),
            OpError::NotIntOrStr(kind) => {
                write!(f, "operation frame is a msgpack {kind}, not int or str")
            }
            OpError::UnknownId(id) => write!(f, "unknown legacy operation id {id}"),
            OpError::UnknownName(name) => write!(f, "unknown operation {name:?}"),
        }
    }
}

impl std::error::Error for OpError {}

/// Decodes the operation frame of a request.
pub fn decode_op(frame: &[u8]) -> Result<Op, OpError> {
    if frame.is_empty() {
        return Err(OpError::Empty);
    }
    let mut r = Reader::new(frame);
    let kind = r.peek_kind().map_err(OpError::Malformed)?;
    let op = match kind {
        Kind::Int => {
            let id: i128 = r.read_int_as("operation id").map_err(OpError::Malformed)?;
            r.finish().map_err(OpError::Malformed)?;
            u64::try_from(id)
                .ok()
                .and_then(Op::from_legacy_id)
                .ok_or(OpError::UnknownId(id))?
        }
        Kind::Str => {
            let name = r.read_str().map_err(OpError::Malformed)?;
            r.finish().map_err(OpError::Malformed)?;
            Op::from_name(name).ok_or_else(|| OpError::UnknownName(name.to_string()))?
        }
        other => return Err(OpError::NotIntOrStr(other)),
    };
    Ok(op)
}

/// Encodes an operation frame as the 0.5.6 client does: its legacy id when it
/// has one, else its name.
pub fn encode_op(op: Op) -> Vec<u8> {
    let mut w = Writer::new();
    match op.legacy_id() {
        Some(id) => w.write_uint(id as u64),
        None => w.write_str(op.name()),
    }
    w.into_vec()
}

// ---------------------------------------------------------------------------
// Message types
// ---------------------------------------------------------------------------

/// A worker instance's id as its client sends it (vLLM's are
/// `uuid4 & (2^63 - 1)`; nothing stops another client from sending any
/// integer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(pub i64);

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// `IPCCacheServerKey`: the full token sequence of a request and the chunk-aligned
/// range `[start, end)` an operation is about.
#[derive(Debug, Clone, PartialEq)]
pub struct IpcKey {
    pub model_name: String,
    pub world_size: i64,
    /// `None` for scheduler calls (lookup, free_lookup_locks).
    pub worker_id: Option<i64>,
    pub token_ids: Vec<u32>,
    pub start: i64,
    pub end: i64,
    pub request_id: String,
    pub cache_salt: String,
    /// `dict[str, Any] | None`, a map with str keys when present.
    pub request_configs: Option<Value>,
    /// 0 when the client did not send it (0.5.6 lookups reject 0).
    pub num_kv_readers: i64,
}

impl IpcKey {
    /// Encodes the key as msgspec does (all fields, definition order).
    pub fn write(&self, w: &mut Writer) {
        w.write_map_len(10);
        w.write_str("model_name");
        w.write_str(&self.model_name);
        w.write_str("world_size");
        w.write_int(self.world_size);
        w.write_str("worker_id");
        match self.worker_id {
            Some(id) => w.write_int(id),
            None => w.write_nil(),
        }
        w.write_str("token_ids");
        w.write_array_len(self.token_ids.len());
        for &t in &self.token_ids {
            w.write_uint(t as u64);
        }
        w.write_str("start");
        w.write_int(self.start);
        w.write_str("end");
        w.write_int(self.end);
        w.write_str("request_id");
        w.write_str(&self.request_id);
        w.write_str("cache_salt");
        w.write_str(&self.cache_salt);
        w.write_str("request_configs");
        match &self.request_configs {
            Some(v) => w.write_value(v),
            None => w.write_nil(),
        }
        w.write_str("num_kv_readers");
        w.write_int(self.num_kv_readers);
    }
}

/// `RegisterEngineDrivenContextPayload` (a msgspec Struct).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDrivenPayload {
    pub instance_id: InstanceId,
    pub model_name: String,
    pub world_size: i64,
    pub block_size: i64,
    pub num_layers: i64,
    pub hidden_dim_size: i64,
    pub dtype_str: String,
    pub use_mla: bool,
    /// `None` is the legacy protocol: one physical slot per token of a chunk.
    pub num_physical_slots: Option<i64>,
}

impl EngineDrivenPayload {
    /// Encodes the payload as msgspec does (all fields, definition order).
    pub fn write(&self, w: &mut Writer) {
        w.write_map_len(9);
        w.write_str("instance_id");
        w.write_int(self.instance_id.0);
        w.write_str("model_name");
        w.write_str(&self.model_name);
        w.write_str("world_size");
        w.write_int(self.world_size);
        w.write_str("block_size");
        w.write_int(self.block_size);
        w.write_str("num_layers");
        w.write_int(self.num_layers);
        w.write_str("hidden_dim_size");
        w.write_int(self.hidden_dim_size);
        w.write_str("dtype_str");
        w.write_str(&self.dtype_str);
        w.write_str("use_mla");
        w.write_bool(self.use_mla);
        w.write_str("num_physical_slots");
        match self.num_physical_slots {
            Some(n) => w.write_int(n),
            None => w.write_nil(),
        }
    }
}

/// `EngineGroupInfo` (group_view.py): one LMCache KV group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineGroupInfo {
    pub engine_group_id: i64,
    pub layer_indices: Vec<i64>,
    /// 0: not reported by the engine.
    pub tokens_per_block: i64,
    /// -1: not sliding-window attention.
    pub sw_size_tokens: i64,
    pub extra_object_group_tag: i64,
    pub recurrent_state: bool,
}

/// The fields' defaults in group_view.py (every field but `engine_group_id`
/// may be left out on the wire).
impl Default for EngineGroupInfo {
    fn default() -> Self {
        EngineGroupInfo {
            engine_group_id: 0,
            layer_indices: Vec::new(),
            tokens_per_block: 0,
            sw_size_tokens: -1,
            extra_object_group_tag: 0,
            recurrent_state: false,
        }
    }
}

/// `BlockAllocationRecord`: one request's GPU block allocation delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockAllocationRecord {
    pub req_id: String,
    pub new_block_ids: Vec<i64>,
    pub new_token_ids: Vec<i64>,
}

/// `TensorMetadata` (ipc_wire.py): the tensor view inside the shared storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMetadata {
    /// torch dtype name without `torch.`, e.g. `"float16"`.
    pub dtype: String,
    pub shape: Vec<i64>,
    /// In elements.
    pub stride: Vec<i64>,
    /// In elements.
    pub storage_offset: i64,
    pub device_uuid: String,
}

impl TensorMetadata {
    /// Exclusive end, in bytes, of the view within its storage (0.5.6's
    /// `byte_span`); `None` if it overflows u64. Decoded metadata always has a
    /// known dtype and non-negative dims.
    pub fn byte_span(&self) -> Option<u64> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        let itemsize = dtype_itemsize(&self.dtype)?;
        let mut elems = u64::try_from(self.storage_offset).ok()?.checked_add(1)?;
        for (&size, &stride) in self.shape.iter().zip(&self.stride) {
            let size = u64::try_from(size).ok()?;
            let stride = u64::try_from(stride).ok()?;
            elems = elems.checked_add((size - 1).checked_mul(stride)?)?;
        }
        elems.checked_mul(itemsize)
    }
}

/// Bytes per element of a torch dtype name (as `str(dtype)` without `torch.`);
/// `None` for names torch does not define.
pub fn dtype_itemsize(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "bool" | "uint8" | "int8" | "quint8" | "qint8" | "quint4x2" | "quint2x4"
        | "float8_e4m3fn" | "float8_e4m3fnuz" | "float8_e5m2" | "float8_e5m2fnuz"
        | "float8_e8m0fnu" | "float4_e2m1fn_x2" | "bits8" | "bits1x8" | "bits2x4" | "bits4x2"
        | "uint1" | "uint2" | "uint3" | "uint4" | "uint5" | "uint6" | "uint7" | "int1" | "int2"
        | "int3" | "int4" | "int5" | "int6" | "int7" => 1,
        "float16" | "bfloat16" | "int16" | "uint16" | "bits16" => 2,
        "float32" | "int32" | "uint32" | "qint32" | "complex32" => 4,
        "float64" | "int64" | "uint64" | "complex64" => 8,
        "complex128" => 16,
        _ => return None,
    })
}

/// `CpuShmIPCData`: a worker tensor in a named POSIX shm segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuShmIpc {
    /// POSIX shm name, e.g. `/lmcache_kv_<pid>_<n>` (empty for empty tensors).
    pub shm_name: String,
    /// Mapping length of the segment.
    pub nbytes: u64,
    pub version: i64,
    pub metadata: TensorMetadata,
}

/// The `storage._share_cuda_()` tuple of a CUDA storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaIpcHandle {
    pub device: i64,
    /// cudaIpcMemHandle (64 bytes).
    pub mem_handle: Option<Vec<u8>>,
    pub storage_size: u64,
    pub storage_offset: u64,
    pub ref_counter_handle: Option<Vec<u8>>,
    pub ref_counter_offset: u64,
    pub event_handle: Option<Vec<u8>>,
    pub event_sync_required: bool,
}

/// `CudaIPCData`: torch shared CUDA storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaIpc {
    pub handle: CudaIpcHandle,
    pub version: i64,
    pub metadata: TensorMetadata,
}

/// `RawCudaIPCData`: a driver IPC memory handle and byte range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawCudaIpc {
    pub ipc_handle: [u8; 64],
    pub alloc_offset: u64,
    pub nbytes: u64,
    pub version: i64,
    pub metadata: TensorMetadata,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmKind {
    PosixFd,
    Fabric,
}

/// `VmmCudaIPCData`: a CUDA VMM allocation export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmCudaIpc {
    pub export_id: [u8; 16],
    pub kind: VmmKind,
    /// Present exactly when `kind` is `Fabric`.
    pub fabric_blob: Option<Vec<u8>>,
    pub alloc_size: u64,
    pub alloc_offset: u64,
    pub nbytes: u64,
    pub version: i64,
    pub metadata: TensorMetadata,
}

/// One `DeviceIPCWrapper` (msgpack ext code 1) of `register_kv_cache`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcData {
    CpuShm(CpuShmIpc),
    Cuda(CudaIpc),
    CudaRaw(RawCudaIpc),
    CudaVmm(VmmCudaIpc),
    /// A descriptor kvshard cannot use (musa, npu, or a tag it does not know);
    /// decoded so the server can refuse the registration clearly.
    Unsupported {
        tag: String,
    },
}

impl IpcData {
    /// The descriptor's `type` tag.
    pub fn tag(&self) -> &str {
        match self {
            IpcData::CpuShm(_) => "cpu_shm",
            IpcData::Cuda(_) => "cuda",
            IpcData::CudaRaw(_) => "cuda_raw",
            IpcData::CudaVmm(_) => "cuda_vmm",
            IpcData::Unsupported { tag } => tag,
        }
    }

    pub fn metadata(&self) -> Option<&TensorMetadata> {
        match self {
            IpcData::CpuShm(d) => Some(&d.metadata),
            IpcData::Cuda(d) => Some(&d.metadata),
            IpcData::CudaRaw(d) => Some(&d.metadata),
            IpcData::CudaVmm(d) => Some(&d.metadata),
            IpcData::Unsupported { .. } => None,
        }
    }
}

/// The ext code 0.5.6 registers for `DeviceIPCWrapper`.
pub const DEVICE_IPC_EXT_CODE: i8 = 1;

/// `EngineType` values.
pub const ENGINE_TYPES: [&str; 5] = ["vllm", "atom", "sglang", "trtllm", "mock"];

/// A decoded request payload.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    RegisterKvCache {
        instance_id: InstanceId,
        kv_cache: Vec<IpcData>,
        model_name: String,
        world_size: i64,
        /// One of [`ENGINE_TYPES`].
        engine_type: String,
        /// `LayoutHints`: a map with str keys (`kv_layout`, `num_kv_heads`, ...).
        layout_hints: Value,
        engine_group_infos: Vec<EngineGroupInfo>,
    },
    UnregisterKvCache {
        instance_id: InstanceId,
    },
    Store {
        key: IpcKey,
        instance_id: InstanceId,
        /// Per LMCache KV group.
        block_ids: Vec<Vec<i64>>,
        event_ipc_handle: Vec<u8>,
    },
    Retrieve {
        key: IpcKey,
        instance_id: InstanceId,
        block_ids: Vec<Vec<i64>>,
        event_ipc_handle: Vec<u8>,
        skip_first_n_tokens: i64,
    },
    Lookup {
        key: IpcKey,
        /// Legacy, ignored by 0.5.6.
        tp_size: i64,
    },
    FreeLookupLocks {
        key: IpcKey,
        tp_size: i64,
    },
    QueryPrefetchStatus {
        request_id: String,
    },
    WaitPrefetchStatus {
        request_id: String,
        timeout_seconds: f64,
    },
    EndSession {
        request_id: String,
    },
    RegisterEngineDriven(EngineDrivenPayload),
    UnregisterEngineDriven {
        instance_id: InstanceId,
    },
    PrepareStore {
        key: IpcKey,
        instance_id: InstanceId,
    },
    CommitStore {
        key: IpcKey,
        instance_id: InstanceId,
        /// Bytes of the `data` frame's payload: 0 in SHM mode; a pickle of the
        /// chunks in the pickle fallback, which kvshard refuses (so the bytes
        /// themselves are never copied out of the frame).
        inline_bytes: usize,
    },
    PrepareRetrieve {
        key: IpcKey,
        instance_id: InstanceId,
    },
    CommitRetrieve {
        key: IpcKey,
        instance_id: InstanceId,
    },
    Clear {
        force: bool,
    },
    GetChunkSize,
    Ping {
        instance_id: Option<InstanceId>,
    },
    ReportBlockAllocation {
        instance_id: InstanceId,
        model_name: String,
        records: Vec<BlockAllocationRecord>,
    },
    Noop,
    GetExperimental,
}

impl Request {
    pub fn op(&self) -> Op {
        match self {
            Request::RegisterKvCache { .. } => Op::RegisterKvCache,
            Request::UnregisterKvCache { .. } => Op::UnregisterKvCache,
            Request::Store { .. } => Op::Store,
            Request::Retrieve { .. } => Op::Retrieve,
            Request::Lookup { .. } => Op::Lookup,
            Request::FreeLookupLocks { .. } => Op::FreeLookupLocks,
            Request::QueryPrefetchStatus { .. } => Op::QueryPrefetchStatus,
            Request::WaitPrefetchStatus { .. } => Op::WaitPrefetchStatus,
            Request::EndSession { .. } => Op::EndSession,
            Request::RegisterEngineDriven(_) => Op::RegisterKvCacheEngineDrivenContext,
            Request::UnregisterEngineDriven { .. } => Op::UnregisterKvCacheEngineDrivenContext,
            Request::PrepareStore { .. } => Op::PrepareStore,
            Request::CommitStore { .. } => Op::CommitStore,
            Request::PrepareRetrieve { .. } => Op::PrepareRetrieve,
            Request::CommitRetrieve { .. } => Op::CommitRetrieve,
            Request::Clear { .. } => Op::Clear,
            Request::GetChunkSize => Op::GetChunkSize,
            Request::Ping { .. } => Op::Ping,
            Request::ReportBlockAllocation { .. } => Op::ReportBlockAllocation,
            Request::Noop => Op::Noop,
            Request::GetExperimental => Op::GetExperimental,
        }
    }
}

/// Why a request's payload frames were refused.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestError {
    /// An operation of the 0.5.6 table that kvshard does not implement.
    Unsupported(Op),
    /// Too few or too many payload frames.
    FrameCount { op: Op, expected: usize, got: usize },
    /// Payload `field` (an RPC parameter) did not decode.
    Field {
        op: Op,
        field: &'static str,
        error: DecodeError,
    },
}

impl RequestError {
    /// The full path of the offending value, e.g. `key.token_ids[3]`.
    pub fn path(&self) -> Option<String> {
        match self {
            RequestError::Field { field, error, .. } => Some(match error.path() {
                "" => field.to_string(),
                p if p.starts_with('[') => format!("{field}{p}"),
                p => format!("{field}.{p}"),
            }),
            _ => None,
        }
    }
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Unsupported(op) => {
                write!(f, "operation {op} is not supported by kvshard")
            }
            RequestError::FrameCount { op, expected, got } => {
                write!(f, "{op}: expected {expected} payload frames, got {got}")
            }
            RequestError::Field { op, error, .. } => {
                let path = self.path().unwrap_or_default();
                write!(f, "{op}: bad payload `{path}`: {}", error.root())
            }
        }
    }
}

impl std::error::Error for RequestError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RequestError::Field { error, .. } => Some(error),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------
// Request decoding
// ---------------------------------------------------------------------------

/// Payload frames in parameter order, each decoded as one whole msgpack value.
struct Payloads<'f, 'c> {
    op: Op,
    frames: &'f [&'f [u8]],
    next: usize,
    tokens: Option<&'c mut TokenCache>,
}

impl<'f> Payloads<'f, '_> {
    /// An `IpcKey` parameter, its tokens read through the cache if any.
    fn key(&mut self) -> Result<IpcKey, RequestError> {
        let mut tokens = self.tokens.take();
        let key = self.take(|r| read_ipc_key(r, tokens.as_deref_mut()));
        self.tokens = tokens;
        key
    }

    fn take<T>(
        &mut self,
        decode: impl FnOnce(&mut Reader<'f>) -> Result<T, DecodeError>,
    ) -> Result<T, RequestError> {
        let field = self.op.params()[self.next];
        let frame = self.frames[self.next];
        self.next += 1;
        let mut r = Reader::new(frame);
        decode(&mut r)
            .and_then(|v| r.finish().map(|()| v))
            .map_err(|error| RequestError::Field {
                op: self.op,
                field,
                error,
            })
    }

    /// A trailing parameter with a Python default, which may be left out.
    fn take_or<T>(
        &mut self,
        default: T,
        decode: impl FnOnce(&mut Reader<'f>) -> Result<T, DecodeError>,
    ) -> Result<T, RequestError> {
        if self.next == self.frames.len() {
            self.next += 1;
            return Ok(default);
        }
        self.take(decode)
    }
}

/// Number of trailing parameters with a Python default in `RequestClient`
/// (only those may be absent).
fn defaulted_params(op: Op) -> usize {
    match op {
        Op::Clear => 1,
        _ => 0,
    }
}

/// Decodes a request's payload frames (everything after the op frame).
pub fn decode_request(op: Op, payload_frames: &[&[u8]]) -> Result<Request, RequestError> {
    decode_with(op, payload_frames, None)
}

/// [`decode_request`], with the token arrays of keys read through `tokens`:
/// an array decoded lately is copied instead of decoded again.
pub fn decode_request_cached(
    op: Op,
    payload_frames: &[&[u8]],
    tokens: &mut TokenCache,
) -> Result<Request, RequestError> {
    decode_with(op, payload_frames, Some(tokens))
}

fn decode_with(
    op: Op,
    payload_frames: &[&[u8]],
    tokens: Option<&mut TokenCache>,
) -> Result<Request, RequestError> {
    if !op.is_supported() {
        return Err(RequestError::Unsupported(op));
    }
    let expected = op.params().len();
    let got = payload_frames.len();
    if got > expected || got < expected - defaulted_params(op) {
        return Err(RequestError::FrameCount { op, expected, got });
    }
    let mut p = Payloads {
        op,
        frames: payload_frames,
        next: 0,
        tokens,
    };
    let req = match op {
        Op::RegisterKvCache => {
            let instance_id = InstanceId(p.take(read_int)?);
            let kv_cache = p.take(read_ipc_list)?;
            let model_name = p.take(read_string)?;
            let world_size = p.take(read_int)?;
            let engine_type = p.take(read_engine_type)?;
            let layout_hints = p.take(read_layout_hints)?;
            let engine_group_infos = p.take(|r| read_list(r, read_engine_group_info))?;
            Request::RegisterKvCache {
                instance_id,
                kv_cache,
                model_name,
                world_size,
                engine_type,
                layout_hints,
                engine_group_infos,
            }
        }
        Op::UnregisterKvCache => Request::UnregisterKvCache {
            instance_id: InstanceId(p.take(read_int)?),
        },
        Op::Store => {
            let key = p.key()?;
            let instance_id = InstanceId(p.take(read_int)?);
            let block_ids = p.take(read_block_ids)?;
            let event_ipc_handle = p.take(read_bytes)?;
            Request::Store {
                key,
                instance_id,
                block_ids,
                event_ipc_handle,
            }
        }
        Op::Retrieve => {
            let key = p.key()?;
            let instance_id = InstanceId(p.take(read_int)?);
            let block_ids = p.take(read_block_ids)?;
            let event_ipc_handle = p.take(read_bytes)?;
            let skip_first_n_tokens = p.take(read_int)?;
            Request::Retrieve {
                key,
                instance_id,
                block_ids,
                event_ipc_handle,
                skip_first_n_tokens,
            }
        }
        Op::Lookup => {
            let key = p.key()?;
            Request::Lookup {
                key,
                tp_size: p.take(read_int)?,
            }
        }
        Op::FreeLookupLocks => {
            let key = p.key()?;
            Request::FreeLookupLocks {
                key,
                tp_size: p.take(read_int)?,
            }
        }
        Op::QueryPrefetchStatus => Request::QueryPrefetchStatus {
            request_id: p.take(read_string)?,
        },
        Op::WaitPrefetchStatus => {
            let request_id = p.take(read_string)?;
            Request::WaitPrefetchStatus {
                request_id,
                timeout_seconds: p.take(|r| r.read_f64())?,
            }
        }
        Op::EndSession => Request::EndSession {
            request_id: p.take(read_string)?,
        },
        Op::RegisterKvCacheEngineDrivenContext => {
            Request::RegisterEngineDriven(p.take(read_engine_driven)?)
        }
        Op::UnregisterKvCacheEngineDrivenContext => Request::UnregisterEngineDriven {
            instance_id: InstanceId(p.take(read_int)?),
        },
        Op::PrepareStore => {
            let key = p.key()?;
            Request::PrepareStore {
                key,
                instance_id: InstanceId(p.take(read_int)?),
            }
        }
        Op::CommitStore => {
            let key = p.key()?;
            let instance_id = InstanceId(p.take(read_int)?);
            Request::CommitStore {
                key,
                instance_id,
                inline_bytes: p.take(|r| r.read_bin().map(<[u8]>::len))?,
            }
        }
        Op::PrepareRetrieve => {
            let key = p.key()?;
            Request::PrepareRetrieve {
                key,
                instance_id: InstanceId(p.take(read_int)?),
            }
        }
        Op::CommitRetrieve => {
            let key = p.key()?;
            Request::CommitRetrieve {
                key,
                instance_id: InstanceId(p.take(read_int)?),
            }
        }
        Op::Clear => Request::Clear {
            force: p.take_or(false, |r| r.read_bool())?,
        },
        Op::GetChunkSize => Request::GetChunkSize,
        Op::Ping => Request::Ping {
            instance_id: p.take(|r| read_opt(r, read_int))?.map(InstanceId),
        },
        Op::ReportBlockAllocation => {
            let instance_id = InstanceId(p.take(read_int)?);
            let model_name = p.take(read_string)?;
            let records = p.take(|r| read_list(r, read_block_allocation_record))?;
            Request::ReportBlockAllocation {
                instance_id,
                model_name,
                records,
            }
        }
        Op::Noop => Request::Noop,
        Op::GetExperimental => Request::GetExperimental,
        Op::RegisterQCache
        | Op::UnregisterQCache
        | Op::StoreQ
        | Op::CbRegisterRope
        | Op::CbUnregisterRope
        | Op::CbRetrievePreComputed
        | Op::CbUnifiedLookup
        | Op::CbReorderPlan
        | Op::CbProtocolHandshake
        | Op::P2pLookupAndLock
        | Op::P2pQueryLookupResults
        | Op::P2pUnlockObjects
        | Op::SubscribeKvEvents
        | Op::ServerModuleCall => unreachable!("unsupported ops return before decoding"),
    };
    assert!(
        p.next == expected,
        "{op}: decoded {} of {expected} payloads",
        p.next
    );
    Ok(req)
}

// --- field readers -----------------------------------------------------------

fn read_int(r: &mut Reader<'_>) -> Result<i64, DecodeError> {
    r.read_int()
}

fn read_string(r: &mut Reader<'_>) -> Result<String, DecodeError> {
    r.read_str().map(str::to_owned)
}

fn read_bytes(r: &mut Reader<'_>) -> Result<Vec<u8>, DecodeError> {
    r.read_bin().map(<[u8]>::to_vec)
}

fn read_nonneg(r: &mut Reader<'_>) -> Result<u64, DecodeError> {
    r.read_int_as("non-negative int")
}

fn read_nonneg_i64(r: &mut Reader<'_>) -> Result<i64, DecodeError> {
    let offset = r.offset();
    let v: i64 = r.read_int_as("non-negative int")?;
    if v < 0 {
        return Err(DecodeError::IntOutOfRange {
            offset,
            expected: "non-negative int",
            value: v as i128,
        });
    }
    Ok(v)
}

fn read_opt<'a, T>(
    r: &mut Reader<'a>,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T, DecodeError>,
) -> Result<Option<T>, DecodeError> {
    if r.is_nil() {
        r.read_nil()?;
        return Ok(None);
    }
    read(r).map(Some)
}

/// An array, each element's error naming its index. Preallocation is capped
/// because elements may be much larger in memory than on the wire.
fn read_list<'a, T>(
    r: &mut Reader<'a>,
    mut read: impl FnMut(&mut Reader<'a>) -> Result<T, DecodeError>,
) -> Result<Vec<T>, DecodeError> {
    let n = r.read_array_len()?;
    let mut out = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        out.push(read(r).map_err(|e| e.at_index(i))?);
    }
    Ok(out)
}

fn read_int_list(r: &mut Reader<'_>) -> Result<Vec<i64>, DecodeError> {
    let n = r.read_array_len()?;
    // Every element takes at least one wire byte, so this is bounded by the frame.
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(r.read_int().map_err(|e| e.at_index(i))?);
    }
    Ok(out)
}

fn read_block_ids(r: &mut Reader<'_>) -> Result<Vec<Vec<i64>>, DecodeError> {
    read_list(r, read_int_list)
}

/// Token ids straight into u32 (the hot path: lookups carry thousands).
fn read_token_ids(
    r: &mut Reader<'_>,
    cache: Option<&mut TokenCache>,
) -> Result<Vec<u32>, DecodeError> {
    let n = r.read_array_len()?;
    let mut out = Vec::new();
    match cache {
        Some(c) => c.read(r, n, &mut out)?,
        None => r.read_u32_elements(n, &mut out)?,
    }
    Ok(out)
}

/// Walks a msgspec object (a map keyed by field name). `field` decodes the
/// value of a name it knows and returns `Ok(false)` for one it does not; unknown
/// fields are skipped, or refused when `forbid_unknown`. Returns the offset of
/// the map, for missing-field errors.
fn read_object<'a>(
    r: &mut Reader<'a>,
    forbid_unknown: bool,
    mut field: impl FnMut(&'a str, &mut Reader<'a>) -> Result<bool, DecodeError>,
) -> Result<usize, DecodeError> {
    let start = r.offset();
    let n = r.read_map_len()?;
    for _ in 0..n {
        let key_offset = r.offset();
        let name = r.read_str()?;
        if !field(name, r).map_err(|e| e.at(name))? {
            if forbid_unknown {
                return Err(DecodeError::UnknownField {
                    offset: key_offset,
                    field: name.to_string(),
                });
            }
            r.skip_value().map_err(|e| e.at(name))?;
        }
    }
    Ok(start)
}

fn required<T>(v: Option<T>, offset: usize, field: &'static str) -> Result<T, DecodeError> {
    v.ok_or(DecodeError::MissingField { offset, field })
}

fn invalid(offset: usize, reason: impl Into<String>) -> DecodeError {
    DecodeError::InvalidValue {
        offset,
        reason: reason.into(),
    }
}

/// A `dict[str, ...]`: a map whose keys are all str.
fn read_str_keyed_map(r: &mut Reader<'_>) -> Result<Value, DecodeError> {
    let offset = r.offset();
    if r.peek_kind()? != Kind::Map {
        return Err(DecodeError::TypeMismatch {
            offset,
            expected: "map",
            found: r.peek_kind()?,
        });
    }
    let v = r.read_value()?;
    if let Value::Map(entries) = &v {
        if let Some((k, _)) = entries.iter().find(|(k, _)| k.as_str().is_none()) {
            return Err(DecodeError::TypeMismatch {
                offset,
                expected: "str key",
                found: k.kind(),
            });
        }
    }
    Ok(v)
}

fn read_ipc_key(
    r: &mut Reader<'_>,
    mut tokens: Option<&mut TokenCache>,
) -> Result<IpcKey, DecodeError> {
    let mut model_name = None;
    let mut world_size = None;
    let mut worker_id = None;
    let mut token_ids = None;
    let mut start = None;
    let mut end = None;
    let mut request_id = None;
    let mut cache_salt = String::new();
    let mut request_configs = None;
    let mut num_kv_readers = 0;
    let offset = read_object(r, false, |name, r| {
        match name {
            "model_name" => model_name = Some(read_string(r)?),
            "world_size" => world_size = Some(r.read_int()?),
            "worker_id" => worker_id = Some(read_opt(r, read_int)?),
            "token_ids" => token_ids = Some(read_token_ids(r, tokens.as_deref_mut())?),
            "start" => start = Some(r.read_int()?),
            "end" => end = Some(r.read_int()?),
            "request_id" => request_id = Some(read_string(r)?),
            "cache_salt" => {
                let at = r.offset();
                let salt = r.read_str()?;
                check_cache_salt(salt).map_err(|reason| invalid(at, reason))?;
                cache_salt = salt.to_string();
            }
            "request_configs" => request_configs = read_opt(r, read_str_keyed_map)?,
            "num_kv_readers" => num_kv_readers = r.read_int()?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(IpcKey {
        model_name: required(model_name, offset, "model_name")?,
        world_size: required(world_size, offset, "world_size")?,
        worker_id: required(worker_id, offset, "worker_id")?,
        token_ids: required(token_ids, offset, "token_ids")?,
        start: required(start, offset, "start")?,
        end: required(end, offset, "end")?,
        request_id: required(request_id, offset, "request_id")?,
        cache_salt,
        request_configs,
        num_kv_readers,
    })
}

fn read_engine_driven(r: &mut Reader<'_>) -> Result<EngineDrivenPayload, DecodeError> {
    let (mut instance_id, mut model_name, mut world_size, mut block_size) =
        (None, None, None, None);
    let (mut num_layers, mut hidden_dim_size, mut dtype_str, mut use_mla) =
        (None, None, None, None);
    let mut num_physical_slots = None;
    let offset = read_object(r, false, |name, r| {
        match name {
            "instance_id" => instance_id = Some(InstanceId(r.read_int()?)),
            "model_name" => model_name = Some(read_string(r)?),
            "world_size" => world_size = Some(r.read_int()?),
            "block_size" => block_size = Some(r.read_int()?),
            "num_layers" => num_layers = Some(r.read_int()?),
            "hidden_dim_size" => hidden_dim_size = Some(r.read_int()?),
            "dtype_str" => dtype_str = Some(read_string(r)?),
            "use_mla" => use_mla = Some(r.read_bool()?),
            "num_physical_slots" => num_physical_slots = read_opt(r, read_int)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(EngineDrivenPayload {
        instance_id: required(instance_id, offset, "instance_id")?,
        model_name: required(model_name, offset, "model_name")?,
        world_size: required(world_size, offset, "world_size")?,
        block_size: required(block_size, offset, "block_size")?,
        num_layers: required(num_layers, offset, "num_layers")?,
        hidden_dim_size: required(hidden_dim_size, offset, "hidden_dim_size")?,
        dtype_str: required(dtype_str, offset, "dtype_str")?,
        use_mla: required(use_mla, offset, "use_mla")?,
        num_physical_slots,
    })
}

fn read_engine_group_info(r: &mut Reader<'_>) -> Result<EngineGroupInfo, DecodeError> {
    let mut engine_group_id = None;
    let mut info = EngineGroupInfo::default();
    let offset = read_object(r, false, |name, r| {
        match name {
            "engine_group_id" => engine_group_id = Some(r.read_int()?),
            "layer_indices" => info.layer_indices = read_int_list(r)?,
            "tokens_per_block" => info.tokens_per_block = r.read_int()?,
            "sw_size_tokens" => info.sw_size_tokens = r.read_int()?,
            "extra_object_group_tag" => info.extra_object_group_tag = r.read_int()?,
            "recurrent_state" => info.recurrent_state = r.read_bool()?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    info.engine_group_id = required(engine_group_id, offset, "engine_group_id")?;
    Ok(info)
}

fn read_block_allocation_record(r: &mut Reader<'_>) -> Result<BlockAllocationRecord, DecodeError> {
    let (mut req_id, mut new_block_ids, mut new_token_ids) = (None, None, None);
    let offset = read_object(r, false, |name, r| {
        match name {
            "req_id" => req_id = Some(read_string(r)?),
            "new_block_ids" => new_block_ids = Some(read_int_list(r)?),
            "new_token_ids" => new_token_ids = Some(read_int_list(r)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(BlockAllocationRecord {
        req_id: required(req_id, offset, "req_id")?,
        new_block_ids: required(new_block_ids, offset, "new_block_ids")?,
        new_token_ids: required(new_token_ids, offset, "new_token_ids")?,
    })
}

fn read_engine_type(r: &mut Reader<'_>) -> Result<String, DecodeError> {
    let offset = r.offset();
    let s = r.read_str()?;
    if !ENGINE_TYPES.contains(&s) {
        return Err(invalid(offset, format!("unknown engine type {s:?}")));
    }
    Ok(s.to_string())
}

/// `LayoutHints` (a `TypedDict(total=False)`): a str-keyed map whose known keys
/// are type-checked; unknown keys are kept as msgspec ignores them.
fn read_layout_hints(r: &mut Reader<'_>) -> Result<Value, DecodeError> {
    let offset = r.offset();
    let hints = read_str_keyed_map(r)?;
    let Value::Map(entries) = &hints else {
        unreachable!("read_str_keyed_map returns a map")
    };
    for (k, v) in entries {
        let key = k.as_str().unwrap_or_default();
        let ok = match key {
            "kv_layout" => matches!(v.as_str(), Some("NHD" | "HND" | "BLHNC" | "BLNHC")),
            "kv_list_layout" => matches!(v.as_str(), Some("k_v" | "unified")),
            "num_kv_heads" | "tokens_per_block" | "head_dim" => matches!(v, Value::Int(_)),
            _ => true,
        };
        if !ok {
            return Err(invalid(offset, format!("invalid value {v:?}")).at(key));
        }
    }
    Ok(hints)
}

// --- DeviceIPCWrapper ----------------------------------------------------------

fn read_ipc_list(r: &mut Reader<'_>) -> Result<Vec<IpcData>, DecodeError> {
    read_list(r, read_ipc_data)
}

fn read_ipc_data(r: &mut Reader<'_>) -> Result<IpcData, DecodeError> {
    let offset = r.offset();
    let kind = r.peek_kind()?;
    if kind != Kind::Ext {
        return Err(DecodeError::TypeMismatch {
            offset,
            expected: "ext 1 (DeviceIPCWrapper)",
            found: kind,
        });
    }
    let (code, payload) = r.read_ext()?;
    if code != DEVICE_IPC_EXT_CODE {
        return Err(invalid(
            offset,
            format!("unsupported ext code {code} (DeviceIPCWrapper is ext 1)"),
        ));
    }
    let mut inner = Reader::nested(payload, r.offset() - payload.len());
    let data = read_ipc_descriptor(&mut inner)?;
    inner.finish()?;
    Ok(data)
}

/// The ext payload: a msgspec Struct tagged by its `"type"` field, which may
/// come anywhere in the map (kw_only base fields follow the subclass's).
fn read_ipc_descriptor(r: &mut Reader<'_>) -> Result<IpcData, DecodeError> {
    let start = r.offset();
    let mut scan = *r;
    let mut tag = None;
    read_object(&mut scan, false, |name, s| {
        if name != "type" {
            return Ok(false);
        }
        tag = Some(s.read_str()?);
        Ok(true)
    })?;
    let tag = required(tag, start, "type")?;
    let mut version = None;
    let mut metadata = None;
    // Every variant forbids unknown fields; `common` takes the base-class ones.
    let mut common = |name: &str, r: &mut Reader<'_>| -> Result<bool, DecodeError> {
        match name {
            "type" => {
                r.read_str()?;
            }
            "version" => {
                let at = r.offset();
                if r.read_int()? != 1 {
                    return Err(invalid(at, "IPC descriptor version must be 1"));
                }
                version = Some(1);
            }
            "metadata" => metadata = Some(read_tensor_metadata(r)?),
            _ => return Ok(false),
        }
        Ok(true)
    };
    let data = match tag {
        "cpu_shm" => {
            let (mut shm_name, mut nbytes) = (None, None);
            read_object(r, true, |name, r| {
                match name {
                    "shm_name" => shm_name = Some(read_string(r)?),
                    "nbytes" => nbytes = Some(read_nonneg(r)?),
                    _ => return common(name, r),
                }
                Ok(true)
            })?;
            let d = CpuShmIpc {
                shm_name: required(shm_name, start, "shm_name")?,
                nbytes: required(nbytes, start, "nbytes")?,
                version: required(version, start, "version")?,
                metadata: required(metadata, start, "metadata")?,
            };
            check_span(&d.metadata, d.nbytes, start, "CPU shared-memory segment")?;
            IpcData::CpuShm(d)
        }
        "cuda" => {
            let mut handle = None;
            read_object(r, true, |name, r| {
                match name {
                    "handle" => handle = Some(read_cuda_handle(r)?),
                    _ => return common(name, r),
                }
                Ok(true)
            })?;
            let d = CudaIpc {
                handle: required(handle, start, "handle")?,
                version: required(version, start, "version")?,
                metadata: required(metadata, start, "metadata")?,
            };
            check_span(&d.metadata, d.handle.storage_size, start, "CUDA storage")?;
            IpcData::Cuda(d)
        }
        "cuda_raw" => {
            let (mut ipc_handle, mut alloc_offset, mut nbytes) = (None, None, None);
            read_object(r, true, |name, r| {
                match name {
                    "ipc_handle" => ipc_handle = Some(read_fixed_bytes::<64>(r)?),
                    "alloc_offset" => alloc_offset = Some(read_nonneg(r)?),
                    "nbytes" => nbytes = Some(read_nonneg(r)?),
                    _ => return common(name, r),
                }
                Ok(true)
            })?;
            let d = RawCudaIpc {
                ipc_handle: required(ipc_handle, start, "ipc_handle")?,
                alloc_offset: required(alloc_offset, start, "alloc_offset")?,
                nbytes: required(nbytes, start, "nbytes")?,
                version: required(version, start, "version")?,
                metadata: required(metadata, start, "metadata")?,
            };
            check_span(&d.metadata, d.nbytes, start, "raw CUDA byte range")?;
            IpcData::CudaRaw(d)
        }
        "cuda_vmm" => {
            let (mut export_id, mut kind, mut fabric_blob) = (None, None, None);
            let (mut alloc_size, mut alloc_offset, mut nbytes) = (None, None, None);
            read_object(r, true, |name, r| {
                match name {
                    "export_id" => export_id = Some(read_fixed_bytes::<16>(r)?),
                    "kind" => {
                        let at = r.offset();
                        kind = Some(match r.read_str()? {
                            "posix_fd" => VmmKind::PosixFd,
                            "fabric" => VmmKind::Fabric,
                            other => {
                                return Err(invalid(at, format!("unknown VMM kind {other:?}")))
                            }
                        });
                    }
                    "fabric_blob" => fabric_blob = Some(read_opt(r, read_bytes)?),
                    "alloc_size" => alloc_size = Some(read_nonneg(r)?),
                    "alloc_offset" => alloc_offset = Some(read_nonneg(r)?),
                    "nbytes" => nbytes = Some(read_nonneg(r)?),
                    _ => return common(name, r),
                }
                Ok(true)
            })?;
            let d = VmmCudaIpc {
                export_id: required(export_id, start, "export_id")?,
                kind: required(kind, start, "kind")?,
                fabric_blob: required(fabric_blob, start, "fabric_blob")?,
                alloc_size: required(alloc_size, start, "alloc_size")?,
                alloc_offset: required(alloc_offset, start, "alloc_offset")?,
                nbytes: required(nbytes, start, "nbytes")?,
                version: required(version, start, "version")?,
                metadata: required(metadata, start, "metadata")?,
            };
            check_span(&d.metadata, d.nbytes, start, "VMM byte range")?;
            if d.alloc_offset
                .checked_add(d.nbytes)
                .is_none_or(|end| end > d.alloc_size)
            {
                return Err(invalid(start, "IPC view exceeds VMM allocation"));
            }
            if (d.kind == VmmKind::Fabric) != d.fabric_blob.is_some() {
                return Err(invalid(
                    start,
                    "IPC fabric handle does not match allocation kind",
                ));
            }
            IpcData::CudaVmm(d)
        }
        "pickle" => return Err(invalid(start, "pickled IPC descriptors are rejected")),
        other => {
            *r = scan;
            IpcData::Unsupported {
                tag: other.to_string(),
            }
        }
    };
    Ok(data)
}

fn check_span(
    m: &TensorMetadata,
    limit: u64,
    offset: usize,
    what: &str,
) -> Result<(), DecodeError> {
    match m.byte_span() {
        Some(span) if span <= limit => Ok(()),
        _ => Err(invalid(
            offset,
            format!("IPC view exceeds {what} ({limit} bytes)"),
        )),
    }
}

fn read_fixed_bytes<const N: usize>(r: &mut Reader<'_>) -> Result<[u8; N], DecodeError> {
    let offset = r.offset();
    let b = r.read_bin()?;
    b.try_into()
        .map_err(|_| invalid(offset, format!("expected {N} bytes, got {}", b.len())))
}

fn read_cuda_handle(r: &mut Reader<'_>) -> Result<CudaIpcHandle, DecodeError> {
    let offset = r.offset();
    let n = r.read_array_len()?;
    if n != 8 {
        return Err(invalid(
            offset,
            format!("CUDA IPC handle must have 8 items, got {n}"),
        ));
    }
    fn item<T>(i: usize, v: Result<T, DecodeError>) -> Result<T, DecodeError> {
        v.map_err(|e| e.at_index(i))
    }
    // Struct fields are evaluated in the order written: tuple order.
    Ok(CudaIpcHandle {
        device: item(0, r.read_int())?,
        mem_handle: item(1, read_opt(r, read_bytes))?,
        storage_size: item(2, read_nonneg(r))?,
        storage_offset: item(3, read_nonneg(r))?,
        ref_counter_handle: item(4, read_opt(r, read_bytes))?,
        ref_counter_offset: item(5, read_nonneg(r))?,
        event_handle: item(6, read_opt(r, read_bytes))?,
        event_sync_required: item(7, r.read_bool())?,
    })
}

fn read_tensor_metadata(r: &mut Reader<'_>) -> Result<TensorMetadata, DecodeError> {
    let (mut dtype, mut shape, mut stride, mut storage_offset, mut device_uuid) =
        (None, None, None, None, None);
    let offset = read_object(r, true, |name, r| {
        match name {
            "dtype" => {
                let at = r.offset();
                let d = r.read_str()?;
                if dtype_itemsize(d).is_none() {
                    return Err(invalid(at, format!("unsupported IPC tensor dtype {d:?}")));
                }
                dtype = Some(d.to_string());
            }
            "shape" => shape = Some(read_list(r, read_nonneg_i64)?),
            "stride" => stride = Some(read_list(r, read_nonneg_i64)?),
            "storage_offset" => storage_offset = Some(read_nonneg_i64(r)?),
            "device_uuid" => device_uuid = Some(read_string(r)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let m = TensorMetadata {
        dtype: required(dtype, offset, "dtype")?,
        shape: required(shape, offset, "shape")?,
        stride: required(stride, offset, "stride")?,
        storage_offset: required(storage_offset, offset, "storage_offset")?,
        device_uuid: required(device_uuid, offset, "device_uuid")?,
    };
    if m.shape.len() != m.stride.len() {
        return Err(invalid(offset, "IPC shape and stride ranks must match"));
    }
    Ok(m)
}

// ---------------------------------------------------------------------------
// Reply encoders (each returns the single payload frame)
// ---------------------------------------------------------------------------

/// One engine-driven SHM slot (`ShmSlotDescriptor.to_dict`). Shape and
/// dtype are borrowed from the object layout every slot of a reply shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmSlot<'a> {
    /// Byte offset into the L1 pool segment.
    pub offset: u64,
    /// Byte length of the slot.
    pub length: u64,
    /// Tensor shape to view the slot as.
    pub shape: &'a [u64],
    /// torch dtype name, e.g. `"float16"`.
    pub dtype: &'a str,
}

/// Bytes a slot's encoding takes at most: the map and its four keys, two
/// uint64s, the shape's array header and dims, the dtype string.
fn slot_bound(s: &ShmSlot) -> usize {
    40 + 9 * (2 + s.shape.len()) + 5 + s.dtype.len()
}

/// Room for `slots` and a few fixed fields: a reply is written without
/// growing its buffer.
fn slots_capacity(slots: &[ShmSlot]) -> usize {
    64 + slots.first().map_or(0, slot_bound) * slots.len()
}

impl ShmSlot<'_> {
    fn write(&self, w: &mut Writer) {
        w.write_map_len(4);
        w.write_str("offset");
        w.write_uint(self.offset);
        w.write_str("length");
        w.write_uint(self.length);
        w.write_str("shape");
        w.write_array_len(self.shape.len());
        for &d in self.shape {
            w.write_uint(d);
        }
        w.write_str("dtype");
        w.write_str(self.dtype);
    }
}

fn write_slots(w: &mut Writer, slots: &[ShmSlot]) {
    w.write_str("slots");
    w.write_array_len(slots.len());
    for s in slots {
        s.write(w);
    }
}

/// STORE / RETRIEVE reply `tuple[bytes, bool]`: `(event_handle, ok)`. An empty
/// handle tells the client no device work is pending.
pub fn encode_store_reply(event: &[u8], ok: bool) -> Vec<u8> {
    let mut w = Writer::with_capacity(8 + event.len());
    w.write_array_len(2);
    w.write_bin(event);
    w.write_bool(ok);
    w.into_vec()
}

pub fn encode_bool(v: bool) -> Vec<u8> {
    let mut w = Writer::with_capacity(1);
    w.write_bool(v);
    w.into_vec()
}

pub fn encode_int(v: i64) -> Vec<u8> {
    let mut w = Writer::with_capacity(9);
    w.write_int(v);
    w.into_vec()
}

pub fn encode_str(s: &str) -> Vec<u8> {
    let mut w = Writer::with_capacity(5 + s.len());
    w.write_str(s);
    w.into_vec()
}

pub fn encode_str_list<S: AsRef<str>>(items: &[S]) -> Vec<u8> {
    let mut w = Writer::new();
    w.write_array_len(items.len());
    for s in items {
        w.write_str(s.as_ref());
    }
    w.into_vec()
}

/// `RegisterEngineDrivenContextResponse(shm_name, pool_size)`; `("", 0)` would
/// select the pickle fallback on the client.
pub fn encode_register_engine_driven_reply(shm_name: &str, pool_size: u64) -> Vec<u8> {
    let mut w = Writer::new();
    w.write_map_len(2);
    w.write_str("shm_name");
    w.write_str(shm_name);
    w.write_str("pool_size");
    w.write_uint(pool_size);
    w.into_vec()
}

/// `PrepareStoreResponse` in SHM mode: the reserved slots and, for each, the
/// index of its chunk in the key's range. No slots means every chunk is
/// already stored (the client then skips the commit).
pub fn encode_prepare_store_reply(slots: &[ShmSlot], chunk_indices: &[i64]) -> Vec<u8> {
    assert_eq!(slots.len(), chunk_indices.len(), "one chunk index per slot");
    let mut w = Writer::with_capacity(slots_capacity(slots) + 9 * chunk_indices.len());
    w.write_map_len(1);
    w.write_str("context");
    w.write_map_len(2);
    write_slots(&mut w, slots);
    w.write_str("chunk_indices");
    w.write_array_len(chunk_indices.len());
    for &i in chunk_indices {
        w.write_int(i);
    }
    w.into_vec()
}

/// `PrepareStoreResponse(context={})`: 0.5.6's pickle-mode answer.
pub fn encode_prepare_store_reply_empty_context() -> Vec<u8> {
    let mut w = Writer::new();
    w.write_map_len(1);
    w.write_str("context");
    w.write_map_len(0);
    w.into_vec()
}

/// `PrepareRetrieveResponse`: on success the slots to read from; on failure
/// `context` is `{}` as in 0.5.6.
pub fn encode_prepare_retrieve_reply(success: bool, slots: &[ShmSlot]) -> Vec<u8> {
    assert!(
        success || slots.is_empty(),
        "a failed prepare_retrieve carries no slots"
    );
    let mut w = Writer::with_capacity(slots_capacity(slots));
    w.write_map_len(3);
    w.write_str("success");
    w.write_bool(success);
    w.write_str("data");
    w.write_bin(b"");
    w.write_str("context");
    if success {
        w.write_map_len(1);
        write_slots(&mut w, slots);
    } else {
        w.write_map_len(0);
    }
    w.into_vec()
}

/// The frames lmcache 0.5.6 encoded for GPU workers
/// (`testdata/golden_cuda_register.json`), for the tests of this crate and
/// (feature `golden`) of the others.
#[cfg(any(test, feature = "golden"))]
pub mod golden {
    use super::{decode_op, Op};

    pub fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    pub fn cuda_golden() -> serde_json::Value {
        serde_json::from_str(include_str!("../testdata/golden_cuda_register.json")).unwrap()
    }

    /// The op and payload frames of golden message `name`.
    pub fn golden_frames(g: &serde_json::Value, name: &str) -> (Op, Vec<Vec<u8>>) {
        let frames: Vec<Vec<u8>> = g[name]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| unhex(f.as_str().unwrap()))
            .collect();
        (decode_op(&frames[1]).unwrap(), frames[2..].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msgpack::{decode_value, encode_value};

    use super::golden::unhex;

    fn s(v: &str) -> Value {
        Value::Str(v.to_string())
    }

    fn int(v: i64) -> Value {
        Value::Int(v)
    }

    fn map(entries: &[(&str, Value)]) -> Value {
        Value::Map(entries.iter().map(|(k, v)| (s(k), v.clone())).collect())
    }

    fn ints(v: &[i64]) -> Value {
        Value::Array(v.iter().map(|&i| int(i)).collect())
    }

    /// Decodes `op` with the given payload frames.
    fn decode(op: Op, frames: &[Vec<u8>]) -> Result<Request, RequestError> {
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        decode_request(op, &refs)
    }

    /// The error's full path and root cause, for a Field error.
    fn field_err(e: RequestError) -> (String, DecodeError) {
        let path = e.path().unwrap_or_else(|| panic!("not a field error: {e}"));
        match e {
            RequestError::Field { error, .. } => (path, error.root().clone()),
            _ => unreachable!(),
        }
    }

    // Golden frames (lmcache-wire-examples-0.5.6.txt).
    const LOOKUP_KEY: &str = "8aaa6d6f64656c5f6e616d65aa746573742d6d6f64656caa776f726c645f73697a6501a9776f726b65725f6964c0a9746f6b656e5f6964739401020304a5737461727400a3656e6404aa726571756573745f6964a57265712d31aa63616368655f73616c74a0af726571756573745f636f6e66696773c0ae6e756d5f6b765f7265616465727301";
    const ENGINE_DRIVEN: &str = "89ab696e7374616e63655f6964cd03e8aa6d6f64656c5f6e616d65aa746573742d6d6f64656caa776f726c645f73697a6501aa626c6f636b5f73697a6510aa6e756d5f6c617965727320af68696464656e5f64696d5f73697a65cd0400a964747970655f737472a7666c6f61743136a77573655f6d6c61c2b26e756d5f706879736963616c5f736c6f7473cd0100";
    const ENGINE_DRIVEN_REPLY: &str =
        "82a873686d5f6e616d65b16c6d63616368655f6c315f706f6f6c5f78a9706f6f6c5f73697a65ce40000000";
    const PREPARE_STORE_REPLY: &str = "81a7636f6e7465787482a5736c6f74739184a66f666673657400a66c656e677468ce00400000a57368617065940220cd0100cd0400a56474797065a7666c6f61743136ad6368756e6b5f696e64696365739100";
    const PREPARE_RETRIEVE_REPLY: &str = "83a773756363657373c3a464617461c400a7636f6e7465787481a5736c6f74739184a66f666673657400a66c656e677468ce00400000a57368617065940220cd0100cd0400a56474797065a7666c6f61743136";

    /// The golden LOOKUP key with one field replaced (or removed, for `None`).
    fn key_with(field: &str, value: Option<Value>) -> Vec<u8> {
        let Value::Map(mut entries) = decode_value(&unhex(LOOKUP_KEY)).unwrap() else {
            panic!()
        };
        let i = entries.iter().position(|(k, _)| k.as_str() == Some(field));
        match (i, value) {
            (Some(i), Some(v)) => entries[i].1 = v,
            (Some(i), None) => drop(entries.remove(i)),
            (None, Some(v)) => entries.push((s(field), v)),
            (None, None) => {}
        }
        encode_value(&Value::Map(entries))
    }

    fn lookup_with_key(key: Vec<u8>) -> Result<Request, RequestError> {
        decode(Op::Lookup, &[key, vec![0x01]])
    }

    #[test]
    fn a_token_cache_changes_no_decoded_request() {
        // The same tokens again (copied), others of one length (decoded), and
        // a bad one: through a cache, each request or error is what a plain
        // decode gives, for every op that carries a key.
        let mix: Vec<i64> = (0..2048)
            .map(|i| (i * 2_654_435_761i64) % 150_000)
            .collect();
        let mut other = mix.clone();
        other[2047] += 1;
        let mut bad = mix.clone();
        bad[1000] = -1;
        let mut cache = TokenCache::new();
        for toks in [&mix, &mix, &other, &mix, &bad, &bad, &other] {
            let key = key_with("token_ids", Some(ints(toks)));
            for (op, rest) in [
                (Op::Lookup, vec![vec![0x01]]),
                (Op::PrepareStore, vec![vec![0x01]]),
                (Op::CommitStore, vec![vec![0x01], vec![0xc4, 0x00]]),
                (Op::CommitRetrieve, vec![vec![0x01]]),
            ] {
                let frames: Vec<&[u8]> = std::iter::once(key.as_slice())
                    .chain(rest.iter().map(Vec::as_slice))
                    .collect();
                let plain = decode_request(op, &frames);
                assert_eq!(
                    decode_request_cached(op, &frames, &mut cache),
                    plain,
                    "{op:?}"
                );
            }
        }
        assert!(cache.hits >= 16, "{} hits", cache.hits);
    }

    fn slot() -> ShmSlot<'static> {
        ShmSlot {
            offset: 0,
            length: 0x40_0000,
            shape: &[2, 32, 256, 1024],
            dtype: "float16",
        }
    }

    #[test]
    fn slot_replies_fit_the_room_they_reserve() {
        // Every number at its widest encoding, and a long dtype name.
        let shape = [u64::MAX; 6];
        let wide = ShmSlot {
            offset: u64::MAX,
            length: u64::MAX,
            shape: &shape,
            dtype: "a_dtype_name_longer_than_a_fixstr_holds",
        };
        for n in [0, 1, 7, 300] {
            let slots = vec![wide; n];
            let indices = vec![i64::MIN; n];
            let store = encode_prepare_store_reply(&slots, &indices);
            assert!(store.len() <= slots_capacity(&slots) + 9 * n, "{n} slots");
            let retrieve = encode_prepare_retrieve_reply(n > 0, &slots);
            assert!(retrieve.len() <= slots_capacity(&slots), "{n} slots");
        }
    }

    #[test]
    fn op_table_is_consistent() {
        let mut legacy = 0;
        for op in Op::ALL {
            assert_eq!(Op::from_name(op.name()), Some(op));
            assert_eq!(decode_op(&encode_op(op)), Ok(op));
            if let Some(id) = op.legacy_id() {
                legacy += 1;
                assert_eq!(Op::from_legacy_id(id as u64), Some(op));
            }
        }
        assert_eq!(legacy, 32);
        assert_eq!(Op::from_legacy_id(11), None, "id 11 is retired");
        assert_eq!(Op::from_legacy_id(8), Some(Op::Lookup));
        assert_eq!(Op::from_legacy_id(33), Some(Op::CbProtocolHandshake));
        assert_eq!(Op::CbReorderPlan.legacy_id(), None);
        assert_eq!(Op::ServerModuleCall.legacy_id(), None);
        // Names of legacy ops are accepted too.
        assert_eq!(decode_op(&encode_str("lookup")), Ok(Op::Lookup));
    }

    #[test]
    fn golden_op_frames() {
        assert_eq!(decode_op(&[0x15]), Ok(Op::GetChunkSize));
        assert_eq!(decode_op(&[0x08]), Ok(Op::Lookup));
        assert_eq!(decode_op(&[0x09]), Ok(Op::QueryPrefetchStatus));
        assert_eq!(decode_op(&[0x16]), Ok(Op::Ping));
        let sub = unhex("b37375627363726962655f6b765f6576656e7473");
        assert_eq!(decode_op(&sub), Ok(Op::SubscribeKvEvents));
        assert_eq!(encode_op(Op::SubscribeKvEvents), sub);
        assert_eq!(encode_op(Op::GetChunkSize), vec![0x15]);
    }

    #[test]
    fn bad_op_frames() {
        assert_eq!(decode_op(&[0x0b]), Err(OpError::UnknownId(11)));
        assert_eq!(decode_op(&[0x63]), Err(OpError::UnknownId(99)));
        assert_eq!(decode_op(&[0xff]), Err(OpError::UnknownId(-1)));
        assert_eq!(
            decode_op(&unhex("cfffffffffffffffff")),
            Err(OpError::UnknownId(u64::MAX as i128))
        );
        assert_eq!(
            decode_op(&encode_str("nope")),
            Err(OpError::UnknownName("nope".into()))
        );
        assert_eq!(
            decode_op(&unhex("cb4020000000000000")),
            Err(OpError::NotIntOrStr(Kind::Float))
        );
        assert_eq!(decode_op(&[0xc3]), Err(OpError::NotIntOrStr(Kind::Bool)));
        assert_eq!(
            decode_op(&[0xc4, 0x00]),
            Err(OpError::NotIntOrStr(Kind::Bin))
        );
        assert_eq!(decode_op(b""), Err(OpError::Empty));
        assert!(matches!(
            decode_op(&[0xcd, 0x01]),
            Err(OpError::Malformed(DecodeError::Truncated { .. }))
        ));
        assert!(matches!(
            decode_op(&[0x08, 0x01]),
            Err(OpError::Malformed(DecodeError::TrailingBytes { .. }))
        ));
    }

    #[test]
    fn golden_get_chunk_size() {
        assert_eq!(decode(Op::GetChunkSize, &[]), Ok(Request::GetChunkSize));
        assert_eq!(hex(&encode_int(256)), "cd0100");
    }

    #[test]
    fn golden_lookup_request() {
        let req = lookup_with_key(unhex(LOOKUP_KEY)).unwrap();
        let Request::Lookup { key, tp_size } = req else {
            panic!("{req:?}")
        };
        assert_eq!(tp_size, 1);
        assert_eq!(
            key,
            IpcKey {
                model_name: "test-model".into(),
                world_size: 1,
                worker_id: None,
                token_ids: vec![1, 2, 3, 4],
                start: 0,
                end: 4,
                request_id: "req-1".into(),
                cache_salt: String::new(),
                request_configs: None,
                num_kv_readers: 1,
            }
        );
        let mut w = Writer::new();
        key.write(&mut w);
        assert_eq!(hex(w.as_bytes()), LOOKUP_KEY);
    }

    #[test]
    fn golden_prefetch_status_and_ping() {
        assert_eq!(
            decode(Op::QueryPrefetchStatus, &[unhex("a57265712d31")]),
            Ok(Request::QueryPrefetchStatus {
                request_id: "req-1".into()
            })
        );
        assert_eq!(hex(&encode_int(1)), "01");
        assert_eq!(
            decode(Op::Ping, &[vec![0xc0]]),
            Ok(Request::Ping { instance_id: None })
        );
        assert_eq!(hex(&encode_bool(true)), "c3");
    }

    #[test]
    fn golden_engine_driven_register() {
        let req = decode(
            Op::RegisterKvCacheEngineDrivenContext,
            &[unhex(ENGINE_DRIVEN)],
        )
        .unwrap();
        let Request::RegisterEngineDriven(p) = req else {
            panic!("{req:?}")
        };
        assert_eq!(
            p,
            EngineDrivenPayload {
                instance_id: InstanceId(1000),
                model_name: "test-model".into(),
                world_size: 1,
                block_size: 16,
                num_layers: 32,
                hidden_dim_size: 1024,
                dtype_str: "float16".into(),
                use_mla: false,
                num_physical_slots: Some(256),
            }
        );
        let mut w = Writer::new();
        p.write(&mut w);
        assert_eq!(hex(w.as_bytes()), ENGINE_DRIVEN);
        assert_eq!(
            hex(&encode_register_engine_driven_reply(
                "lmcache_l1_pool_x",
                0x4000_0000
            )),
            ENGINE_DRIVEN_REPLY
        );
    }

    /// REGISTER/STORE/RETRIEVE frames lmcache 0.5.6's encoders produced for GPU
    /// workers (`cuda`, `cuda_raw` and `cuda_vmm` descriptors).
    use super::golden::{cuda_golden, golden_frames};

    #[test]
    fn golden_cuda_registrations() {
        let g = cuda_golden();
        let meta = TensorMetadata {
            dtype: "bfloat16".into(),
            shape: vec![2, 1024, 16, 8, 128],
            stride: vec![16777216, 16384, 1024, 128, 1],
            storage_offset: 0,
            device_uuid: "8f6b2c1e-0000-1111-2222-333344445555".into(),
        };
        let seq = |n: u8| (0..n).collect::<Vec<u8>>();
        for (name, tag) in [
            ("register_kv_cache_cuda", "cuda"),
            ("register_kv_cache_cuda_raw", "cuda_raw"),
            ("register_kv_cache_cuda_vmm", "cuda_vmm"),
        ] {
            let (op, frames) = golden_frames(&g, name);
            assert_eq!(op, Op::RegisterKvCache, "{name}");
            let Request::RegisterKvCache {
                instance_id,
                kv_cache,
                model_name,
                world_size,
                engine_type,
                engine_group_infos,
                ..
            } = decode(op, &frames).unwrap()
            else {
                panic!("{name}")
            };
            assert_eq!(
                (
                    instance_id,
                    model_name.as_str(),
                    world_size,
                    engine_type.as_str()
                ),
                (InstanceId(123456789), "Qwen/Qwen3-8B", 1, "vllm"),
                "{name}"
            );
            assert_eq!(engine_group_infos.len(), 1);
            assert_eq!(engine_group_infos[0].layer_indices, vec![0, 1]);
            assert_eq!(kv_cache.len(), 2, "{name}");
            for d in &kv_cache {
                assert_eq!(d.tag(), tag);
                assert_eq!(d.metadata(), Some(&meta));
            }
            match &kv_cache[0] {
                IpcData::Cuda(c) => {
                    let h = &c.handle;
                    let mut shareable = vec![2, b'c'];
                    shareable.extend(seq(64));
                    assert_eq!(h.mem_handle.as_deref(), Some(&shareable[..]));
                    assert_eq!((h.storage_size, h.storage_offset), (64 << 20, 4096));
                    assert_eq!(
                        h.ref_counter_handle.as_deref(),
                        Some(&b"/torch_1234_567_0"[..])
                    );
                    assert_eq!(h.ref_counter_offset, 3);
                    assert_eq!(
                        h.event_handle.as_deref(),
                        Some(&(100..164).collect::<Vec<u8>>()[..])
                    );
                    assert!(h.event_sync_required);
                }
                IpcData::CudaRaw(r) => {
                    assert_eq!(r.ipc_handle.to_vec(), seq(64));
                    assert_eq!((r.alloc_offset, r.nbytes), (4096, 64 << 20));
                }
                IpcData::CudaVmm(v) => {
                    assert_eq!(v.export_id.to_vec(), seq(16));
                    assert_eq!(v.kind, VmmKind::Fabric);
                    assert_eq!(v.fabric_blob.as_deref(), Some(&seq(64)[..]));
                    assert_eq!(
                        (v.alloc_size, v.alloc_offset, v.nbytes),
                        (1 << 30, 0, 64 << 20)
                    );
                }
                d => panic!("{name}: {d:?}"),
            }
        }
    }

    #[test]
    fn golden_cuda_store_and_retrieve() {
        let g = cuda_golden();
        let blocks: Vec<i64> = (1..=32).collect();
        let event: Vec<u8> = (100..164).collect();
        let (op, frames) = golden_frames(&g, "store");
        let Request::Store {
            key,
            instance_id,
            block_ids,
            event_ipc_handle,
        } = decode(op, &frames).unwrap()
        else {
            panic!("store")
        };
        assert_eq!((key.start, key.end, key.token_ids.len()), (0, 512, 512));
        assert_eq!(key.worker_id, Some(0));
        assert_eq!(instance_id, InstanceId(123456789));
        assert_eq!(block_ids, vec![blocks.clone()]);
        assert_eq!(event_ipc_handle, event);
        let (op, frames) = golden_frames(&g, "retrieve");
        let Request::Retrieve {
            block_ids,
            event_ipc_handle,
            skip_first_n_tokens,
            ..
        } = decode(op, &frames).unwrap()
        else {
            panic!("retrieve")
        };
        assert_eq!(block_ids, vec![blocks]);
        assert_eq!(event_ipc_handle, event);
        assert_eq!(skip_first_n_tokens, 16);
        // The two replies: a server event handle with success, and the
        // unregistered instance's empty handle with failure.
        let ok: Vec<u8> = (200..=255).chain(std::iter::repeat_n(0, 8)).collect();
        assert_eq!(
            hex(&encode_store_reply(&ok, true)),
            g["store_response_ok"].as_str().unwrap()
        );
        assert_eq!(
            hex(&encode_store_reply(b"", false)),
            g["store_response_unregistered"].as_str().unwrap()
        );
    }

    #[test]
    fn golden_replies() {
        assert_eq!(hex(&encode_store_reply(b"", true)), "92c400c3");
        assert_eq!(
            hex(&encode_prepare_store_reply(&[slot()], &[0])),
            PREPARE_STORE_REPLY
        );
        assert_eq!(
            hex(&encode_prepare_retrieve_reply(true, &[slot()])),
            PREPARE_RETRIEVE_REPLY
        );
        // {"context": {}} and a failed retrieve's {"success": False, "data": b"", "context": {}}.
        assert_eq!(
            hex(&encode_prepare_store_reply_empty_context()),
            "81a7636f6e7465787480"
        );
        assert_eq!(
            hex(&encode_prepare_retrieve_reply(false, &[])),
            "83a773756363657373c2a464617461c400a7636f6e7465787480"
        );
        // All chunks already cached: empty slots and indices.
        assert_eq!(
            decode_value(&encode_prepare_store_reply(&[], &[])).unwrap(),
            map(&[(
                "context",
                map(&[
                    ("slots", Value::Array(vec![])),
                    ("chunk_indices", Value::Array(vec![]))
                ])
            )])
        );
        assert_eq!(hex(&encode_str("OK")), "a24f4b");
        assert_eq!(
            decode_value(&encode_str_list(&["kv_event_stream"])).unwrap(),
            Value::Array(vec![s("kv_event_stream")])
        );
        assert_eq!(hex(&encode_store_reply(b"ev", false)), "92c4026576c2");
    }

    #[test]
    fn key_fields_in_any_order_with_defaults_and_unknown_keys() {
        let key = map(&[
            ("future_field", map(&[("x", ints(&[1, 2]))])),
            ("request_id", s("r")),
            ("end", int(0)),
            ("start", int(0)),
            ("token_ids", Value::Array(vec![])),
            ("worker_id", int(3)),
            ("world_size", int(4)),
            ("model_name", s("m")),
        ]);
        let Request::Lookup { key, .. } = lookup_with_key(encode_value(&key)).unwrap() else {
            panic!()
        };
        assert_eq!(key.worker_id, Some(3));
        assert_eq!(key.cache_salt, "");
        assert_eq!(key.request_configs, None);
        assert_eq!(key.num_kv_readers, 0);
        let configs = map(&[("lmcache.tag", s("t")), ("n", int(1))]);
        let Request::Lookup { key, .. } =
            lookup_with_key(key_with("request_configs", Some(configs.clone()))).unwrap()
        else {
            panic!()
        };
        assert_eq!(key.request_configs, Some(configs));
    }

    #[test]
    fn key_missing_required_field() {
        for field in [
            "model_name",
            "world_size",
            "worker_id",
            "token_ids",
            "start",
            "end",
            "request_id",
        ] {
            let (path, root) = field_err(lookup_with_key(key_with(field, None)).unwrap_err());
            assert_eq!(path, "key");
            assert!(
                matches!(root, DecodeError::MissingField { field: f, offset: 0 } if f == field),
                "{field}: {root}"
            );
        }
    }

    #[test]
    fn key_wrong_type_per_field() {
        let cases: Vec<(&str, Value, &str, Kind)> = vec![
            ("model_name", int(1), "key.model_name", Kind::Int),
            (
                "world_size",
                Value::Bool(true),
                "key.world_size",
                Kind::Bool,
            ),
            ("world_size", Value::F64(1.0), "key.world_size", Kind::Float),
            ("world_size", s("1"), "key.world_size", Kind::Str),
            ("worker_id", s("0"), "key.worker_id", Kind::Str),
            ("token_ids", s("1234"), "key.token_ids", Kind::Str),
            (
                "token_ids",
                Value::Array(vec![int(1), Value::Bool(true)]),
                "key.token_ids[1]",
                Kind::Bool,
            ),
            (
                "token_ids",
                Value::Array(vec![Value::F64(1.0)]),
                "key.token_ids[0]",
                Kind::Float,
            ),
            ("start", Value::F64(0.0), "key.start", Kind::Float),
            ("end", Value::Nil, "key.end", Kind::Nil),
            (
                "request_id",
                Value::Bin(b"req-1".to_vec()),
                "key.request_id",
                Kind::Bin,
            ),
            ("cache_salt", Value::Nil, "key.cache_salt", Kind::Nil),
            (
                "request_configs",
                ints(&[1]),
                "key.request_configs",
                Kind::Array,
            ),
            (
                "request_configs",
                Value::Map(vec![(int(1), int(2))]),
                "key.request_configs",
                Kind::Int,
            ),
            (
                "num_kv_readers",
                Value::Bool(true),
                "key.num_kv_readers",
                Kind::Bool,
            ),
        ];
        for (field, value, want_path, want_found) in cases {
            let (path, root) =
                field_err(lookup_with_key(key_with(field, Some(value.clone()))).unwrap_err());
            assert_eq!(path, want_path, "{field} = {value:?}");
            assert!(
                matches!(root, DecodeError::TypeMismatch { found, .. } if found == want_found),
                "{field} = {value:?}: {root}"
            );
        }
    }

    #[test]
    fn token_ids_must_be_u32() {
        let max = key_with("token_ids", Some(ints(&[0, u32::MAX as i64])));
        let Request::Lookup { key, .. } = lookup_with_key(max).unwrap() else {
            panic!()
        };
        assert_eq!(key.token_ids, vec![0, u32::MAX]);
        for (tokens, index, value) in [(vec![1, 1 << 32], 1, 1i128 << 32), (vec![-1], 0, -1)] {
            let (path, root) =
                field_err(lookup_with_key(key_with("token_ids", Some(ints(&tokens)))).unwrap_err());
            assert_eq!(path, format!("key.token_ids[{index}]"));
            assert!(
                matches!(root, DecodeError::IntOutOfRange { value: v, .. } if v == value),
                "{root}"
            );
        }
    }

    #[test]
    fn many_tokens_in_mixed_encodings() {
        let tokens: Vec<u32> = (0..8192u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32))
            .collect();
        let key = IpcKey {
            model_name: "m".into(),
            world_size: 2,
            worker_id: Some(1),
            token_ids: tokens.clone(),
            start: 0,
            end: 8192,
            request_id: "r".into(),
            cache_salt: "tenant-a".into(),
            request_configs: None,
            num_kv_readers: 1,
        };
        let mut w = Writer::new();
        key.write(&mut w);
        let Request::Lookup { key: got, .. } = lookup_with_key(w.into_vec()).unwrap() else {
            panic!()
        };
        assert_eq!(got, key);
    }

    #[test]
    fn bad_cache_salt() {
        for salt in ["a/b", "a@b", "a\\b", "a\0b"] {
            let (path, root) =
                field_err(lookup_with_key(key_with("cache_salt", Some(s(salt)))).unwrap_err());
            assert_eq!(path, "key.cache_salt");
            assert!(
                matches!(root, DecodeError::InvalidValue { .. }),
                "{salt:?}: {root}"
            );
        }
        assert!(lookup_with_key(key_with("cache_salt", Some(s(&"x".repeat(129))))).is_err());
        assert!(lookup_with_key(key_with("cache_salt", Some(s(&"é".repeat(128))))).is_ok());
    }

    #[test]
    fn truncated_and_trailing_frames() {
        let key = unhex(LOOKUP_KEY);
        for cut in [0, 1, 10, key.len() / 2, key.len() - 1] {
            let err = lookup_with_key(key[..cut].to_vec()).unwrap_err();
            let (path, root) = field_err(err);
            assert!(path.starts_with("key"), "{path}");
            assert!(
                matches!(
                    root,
                    DecodeError::Truncated { .. } | DecodeError::LengthTooLarge { .. }
                ),
                "cut {cut}: {root}"
            );
        }
        let mut long = key.clone();
        long.push(0x00);
        let (path, root) = field_err(lookup_with_key(long).unwrap_err());
        assert_eq!(path, "key");
        assert_eq!(
            root,
            DecodeError::TrailingBytes {
                offset: key.len(),
                remaining: 1
            }
        );
        let (path, _) = field_err(decode(Op::Lookup, &[key, vec![0x01, 0x01]]).unwrap_err());
        assert_eq!(path, "tp_size");
    }

    #[test]
    fn huge_declared_lengths_in_payloads() {
        let mut w = Writer::new();
        w.write_map_len(1);
        w.write_str("token_ids");
        let mut frame = w.into_vec();
        frame.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]);
        let (path, root) = field_err(lookup_with_key(frame).unwrap_err());
        assert_eq!(path, "key.token_ids");
        assert!(
            matches!(
                root,
                DecodeError::LengthTooLarge {
                    kind: Kind::Array,
                    ..
                }
            ),
            "{root}"
        );

        let mut frame = unhex("81aa6d6f64656c5f6e616d65");
        frame.extend_from_slice(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']);
        let (_, root) = field_err(lookup_with_key(frame).unwrap_err());
        assert!(
            matches!(
                root,
                DecodeError::LengthTooLarge {
                    kind: Kind::Str,
                    ..
                }
            ),
            "{root}"
        );

        let (_, root) =
            field_err(lookup_with_key(vec![0xdf, 0xff, 0xff, 0xff, 0xff, 0x00]).unwrap_err());
        assert!(
            matches!(
                root,
                DecodeError::LengthTooLarge {
                    kind: Kind::Map,
                    ..
                }
            ),
            "{root}"
        );

        let frames = [
            unhex(LOOKUP_KEY),
            vec![0x01],
            vec![0x90],
            vec![0xc6, 0xff, 0xff, 0xff, 0xff, 0x00],
        ];
        let (path, root) = field_err(decode(Op::Store, &frames).unwrap_err());
        assert_eq!(path, "event_ipc_handle");
        assert!(
            matches!(
                root,
                DecodeError::LengthTooLarge {
                    kind: Kind::Bin,
                    ..
                }
            ),
            "{root}"
        );
    }

    #[test]
    fn excessive_nesting() {
        let mut deep = Value::Nil;
        for _ in 0..100 {
            deep = Value::Array(vec![deep]);
        }
        let (path, root) = field_err(
            lookup_with_key(key_with(
                "request_configs",
                Some(map(&[("a", deep.clone())])),
            ))
            .unwrap_err(),
        );
        assert!(path.starts_with("key.request_configs"), "{path}");
        assert!(matches!(root, DecodeError::DepthExceeded { .. }), "{root}");
        // Unknown fields are skipped, but not without bound.
        let (path, root) = field_err(lookup_with_key(key_with("future", Some(deep))).unwrap_err());
        assert_eq!(path, "key.future");
        assert!(matches!(root, DecodeError::DepthExceeded { .. }), "{root}");
    }

    #[test]
    fn wrong_frame_count() {
        let key = unhex(LOOKUP_KEY);
        assert_eq!(
            decode(Op::Lookup, std::slice::from_ref(&key)),
            Err(RequestError::FrameCount {
                op: Op::Lookup,
                expected: 2,
                got: 1
            })
        );
        assert_eq!(
            decode(Op::Lookup, &[key.clone(), vec![1], vec![1]]),
            Err(RequestError::FrameCount {
                op: Op::Lookup,
                expected: 2,
                got: 3
            })
        );
        assert!(matches!(
            decode(Op::GetChunkSize, &[vec![0xc0]]),
            Err(RequestError::FrameCount { .. })
        ));
        assert!(matches!(
            decode(Op::Clear, &[vec![0xc2], vec![0xc2]]),
            Err(RequestError::FrameCount { .. })
        ));
        // Only `clear(force=False)` has a default and may omit its frame.
        assert_eq!(decode(Op::Clear, &[]), Ok(Request::Clear { force: false }));
        assert!(matches!(
            decode(Op::Ping, &[]),
            Err(RequestError::FrameCount { .. })
        ));
        assert!(matches!(
            decode(Op::Store, &[key, vec![1], vec![0x90]]),
            Err(RequestError::FrameCount { .. })
        ));
    }

    #[test]
    fn unsupported_ops() {
        for op in [
            Op::RegisterQCache,
            Op::StoreQ,
            Op::CbRegisterRope,
            Op::CbReorderPlan,
            Op::CbProtocolHandshake,
            Op::P2pLookupAndLock,
            Op::SubscribeKvEvents,
            Op::ServerModuleCall,
        ] {
            assert!(!op.is_supported());
            assert_eq!(
                decode(op, &[vec![0x01]]),
                Err(RequestError::Unsupported(op))
            );
        }
    }

    #[test]
    fn top_level_scalars_are_strict() {
        let key = unhex(LOOKUP_KEY);
        let (path, root) = field_err(decode(Op::Lookup, &[key.clone(), vec![0xc3]]).unwrap_err());
        assert_eq!(path, "tp_size");
        assert!(matches!(
            root,
            DecodeError::TypeMismatch {
                found: Kind::Bool,
                ..
            }
        ));
        assert_eq!(
            decode(Op::Clear, &[vec![0xc3]]),
            Ok(Request::Clear { force: true })
        );
        let (path, _) = field_err(decode(Op::Clear, &[vec![0x01]]).unwrap_err());
        assert_eq!(path, "force");
        assert!(decode(Op::Ping, &[vec![0xc3]]).is_err());
        assert!(decode(Op::UnregisterKvCache, &[encode_str("1")]).is_err());
        assert!(decode(Op::EndSession, &[vec![0xc4, 0x00]]).is_err());
        // vLLM's instance ids are uuid4 & (2^63 - 1), sent as uint64.
        let big = unhex("cf7fffffffffffffff");
        assert_eq!(
            decode(Op::Ping, std::slice::from_ref(&big)),
            Ok(Request::Ping {
                instance_id: Some(InstanceId(i64::MAX))
            })
        );
        assert_eq!(
            decode(Op::UnregisterKvCache, &[big]),
            Ok(Request::UnregisterKvCache {
                instance_id: InstanceId(i64::MAX)
            })
        );
        let (_, root) = field_err(decode(Op::Ping, &[unhex("cf8000000000000000")]).unwrap_err());
        assert!(matches!(root, DecodeError::IntOutOfRange { .. }));
        // timeout: float, and ints are accepted for floats.
        assert_eq!(
            decode(Op::WaitPrefetchStatus, &[encode_str("r"), vec![0x05]]),
            Ok(Request::WaitPrefetchStatus {
                request_id: "r".into(),
                timeout_seconds: 5.0
            })
        );
        assert!(decode(Op::WaitPrefetchStatus, &[encode_str("r"), vec![0xc2]]).is_err());
    }

    #[test]
    fn store_retrieve_commit_payloads() {
        let key = unhex(LOOKUP_KEY);
        let block_ids = encode_value(&Value::Array(vec![ints(&[1, 2, 0]), ints(&[7])]));
        let event = encode_value(&Value::Bin(b"stub_ipc_handle".to_vec()));
        let req = decode(
            Op::Retrieve,
            &[
                key.clone(),
                encode_int(1000),
                block_ids.clone(),
                event,
                encode_int(16),
            ],
        )
        .unwrap();
        let Request::Retrieve {
            instance_id,
            block_ids: b,
            event_ipc_handle,
            skip_first_n_tokens,
            ..
        } = req
        else {
            panic!()
        };
        assert_eq!((instance_id, skip_first_n_tokens), (InstanceId(1000), 16));
        assert_eq!(b, vec![vec![1, 2, 0], vec![7]]);
        assert_eq!(event_ipc_handle, b"stub_ipc_handle");
        let (path, _) = field_err(
            decode(
                Op::Store,
                &[
                    key.clone(),
                    encode_int(1),
                    encode_value(&ints(&[1])),
                    vec![0xc4, 0],
                ],
            )
            .unwrap_err(),
        );
        assert_eq!(path, "block_ids[0]");
        let req = decode(
            Op::CommitStore,
            &[key.clone(), encode_int(1), vec![0xc4, 0x00]],
        )
        .unwrap();
        assert!(matches!(
            req,
            Request::CommitStore {
                inline_bytes: 0,
                ..
            }
        ));
        assert_eq!(req.op(), Op::CommitStore);
        for op in [Op::PrepareStore, Op::PrepareRetrieve, Op::CommitRetrieve] {
            assert_eq!(decode(op, &[key.clone(), encode_int(1)]).unwrap().op(), op);
        }
    }

    #[test]
    fn engine_driven_payload_rules() {
        let Value::Map(mut entries) = decode_value(&unhex(ENGINE_DRIVEN)).unwrap() else {
            panic!()
        };
        entries.pop(); // num_physical_slots: defaulted
        entries.insert(0, (s("newer_field"), int(1)));
        let req = decode(
            Op::RegisterKvCacheEngineDrivenContext,
            &[encode_value(&Value::Map(entries.clone()))],
        )
        .unwrap();
        assert!(matches!(
            req,
            Request::RegisterEngineDriven(EngineDrivenPayload {
                num_physical_slots: None,
                ..
            })
        ));
        let mla = entries
            .iter()
            .position(|(k, _)| k.as_str() == Some("use_mla"))
            .unwrap();
        entries[mla].1 = int(0);
        let (path, root) = field_err(
            decode(
                Op::RegisterKvCacheEngineDrivenContext,
                &[encode_value(&Value::Map(entries.clone()))],
            )
            .unwrap_err(),
        );
        assert_eq!(path, "payload.use_mla");
        assert!(matches!(
            root,
            DecodeError::TypeMismatch {
                found: Kind::Int,
                ..
            }
        ));
        entries.remove(mla);
        let (_, root) = field_err(
            decode(
                Op::RegisterKvCacheEngineDrivenContext,
                &[encode_value(&Value::Map(entries))],
            )
            .unwrap_err(),
        );
        assert!(matches!(
            root,
            DecodeError::MissingField {
                field: "use_mla",
                ..
            }
        ));
    }

    #[test]
    fn report_block_allocation() {
        let records = Value::Array(vec![map(&[
            ("req_id", s("r1")),
            ("new_block_ids", ints(&[4, 5])),
            ("new_token_ids", ints(&[9906])),
        ])]);
        let req = decode(
            Op::ReportBlockAllocation,
            &[encode_int(7), encode_str("m"), encode_value(&records)],
        )
        .unwrap();
        assert_eq!(
            req,
            Request::ReportBlockAllocation {
                instance_id: InstanceId(7),
                model_name: "m".into(),
                records: vec![BlockAllocationRecord {
                    req_id: "r1".into(),
                    new_block_ids: vec![4, 5],
                    new_token_ids: vec![9906],
                }],
            }
        );
        let bad = Value::Array(vec![map(&[
            ("req_id", s("r1")),
            ("new_block_ids", ints(&[4])),
        ])]);
        let (path, root) = field_err(
            decode(
                Op::ReportBlockAllocation,
                &[encode_int(7), encode_str("m"), encode_value(&bad)],
            )
            .unwrap_err(),
        );
        assert_eq!(path, "records[0]");
        assert!(matches!(
            root,
            DecodeError::MissingField {
                field: "new_token_ids",
                ..
            }
        ));
    }

    // --- register_kv_cache and DeviceIPCWrapper ---------------------------------

    fn metadata() -> Value {
        map(&[
            ("dtype", s("float16")),
            ("shape", ints(&[2, 4, 16, 8])),
            ("stride", ints(&[512, 128, 8, 1])),
            ("storage_offset", int(0)),
            ("device_uuid", s("cpu")),
        ])
    }

    /// A `CpuShmIPCData` ext built by hand, keys in msgspec's order
    /// (tag, subclass fields, then the kw_only base fields).
    fn cpu_shm_ext(nbytes: u64, metadata: &Value) -> Value {
        let mut w = Writer::new();
        w.write_map_len(5);
        w.write_str("type");
        w.write_str("cpu_shm");
        w.write_str("shm_name");
        w.write_str("/lmcache_kv_42_0");
        w.write_str("nbytes");
        w.write_uint(nbytes);
        w.write_str("version");
        w.write_int(1);
        w.write_str("metadata");
        w.write_value(metadata);
        Value::Ext(1, w.into_vec())
    }

    fn ext_of(descriptor: &Value) -> Value {
        Value::Ext(1, encode_value(descriptor))
    }

    fn register_frames(kv_cache: Vec<Value>) -> Vec<Vec<u8>> {
        vec![
            encode_int(1000),
            encode_value(&Value::Array(kv_cache)),
            encode_str("test-model"),
            encode_int(1),
            encode_str("vllm"),
            encode_value(&map(&[("kv_layout", s("NHD"))])),
            encode_value(&Value::Array(vec![map(&[
                ("engine_group_id", int(0)),
                ("layer_indices", ints(&[0, 1])),
            ])])),
        ]
    }

    fn register(kv_cache: Vec<Value>) -> Result<Request, RequestError> {
        decode(Op::RegisterKvCache, &register_frames(kv_cache))
    }

    fn register_one(descriptor: Value) -> Result<IpcData, RequestError> {
        match register(vec![descriptor])? {
            Request::RegisterKvCache { mut kv_cache, .. } => Ok(kv_cache.remove(0)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn register_kv_cache_cpu_shm() {
        let req = register(vec![
            cpu_shm_ext(4096, &metadata()),
            cpu_shm_ext(2048, &metadata()),
        ])
        .unwrap();
        let Request::RegisterKvCache {
            instance_id,
            kv_cache,
            model_name,
            world_size,
            engine_type,
            layout_hints,
            engine_group_infos,
        } = req
        else {
            panic!()
        };
        assert_eq!(
            (
                instance_id,
                model_name.as_str(),
                world_size,
                engine_type.as_str()
            ),
            (InstanceId(1000), "test-model", 1, "vllm")
        );
        assert_eq!(layout_hints.get("kv_layout"), Some(&s("NHD")));
        assert_eq!(
            engine_group_infos,
            vec![EngineGroupInfo {
                engine_group_id: 0,
                layer_indices: vec![0, 1],
                tokens_per_block: 0,
                sw_size_tokens: -1,
                extra_object_group_tag: 0,
                recurrent_state: false,
            }]
        );
        assert_eq!(kv_cache.len(), 2);
        let IpcData::CpuShm(d) = &kv_cache[0] else {
            panic!("{:?}", kv_cache[0])
        };
        assert_eq!(d.shm_name, "/lmcache_kv_42_0");
        assert_eq!(d.nbytes, 4096);
        assert_eq!(d.version, 1);
        assert_eq!(
            d.metadata,
            TensorMetadata {
                dtype: "float16".into(),
                shape: vec![2, 4, 16, 8],
                stride: vec![512, 128, 8, 1],
                storage_offset: 0,
                device_uuid: "cpu".into(),
            }
        );
        // The view spans exactly 2 * 1024 elements of 2 bytes.
        assert_eq!(d.metadata.byte_span(), Some(2048));
        assert_eq!(kv_cache[1].tag(), "cpu_shm");
    }

    #[test]
    fn ipc_fields_in_any_order() {
        let d = map(&[
            ("metadata", metadata()),
            ("version", int(1)),
            ("nbytes", int(4096)),
            ("shm_name", s("/x")),
            ("type", s("cpu_shm")),
        ]);
        assert!(matches!(
            register_one(ext_of(&d)).unwrap(),
            IpcData::CpuShm(CpuShmIpc { nbytes: 4096, .. })
        ));
    }

    #[test]
    fn ipc_cuda_variants() {
        let handle = Value::Array(vec![
            int(0),
            Value::Bin(vec![7; 64]),
            int(8192),
            int(0),
            Value::Bin(vec![1; 16]),
            int(0),
            Value::Nil,
            Value::Bool(true),
        ]);
        let cuda = map(&[
            ("type", s("cuda")),
            ("handle", handle.clone()),
            ("version", int(1)),
            ("metadata", metadata()),
        ]);
        let IpcData::Cuda(c) = register_one(ext_of(&cuda)).unwrap() else {
            panic!()
        };
        assert_eq!(c.handle.mem_handle, Some(vec![7; 64]));
        assert_eq!(
            (
                c.handle.storage_size,
                c.handle.event_handle.clone(),
                c.handle.event_sync_required
            ),
            (8192, None, true)
        );

        // The view (2048 bytes) must fit the storage.
        let mut small = handle.clone();
        if let Value::Array(items) = &mut small {
            items[2] = int(100);
        }
        let cuda_small = map(&[
            ("type", s("cuda")),
            ("handle", small),
            ("version", int(1)),
            ("metadata", metadata()),
        ]);
        let (path, root) = field_err(register_one(ext_of(&cuda_small)).unwrap_err());
        assert_eq!(path, "kv_cache[0]");
        assert!(matches!(root, DecodeError::InvalidValue { .. }), "{root}");

        let mut bad_item = handle;
        if let Value::Array(items) = &mut bad_item {
            items[7] = int(1);
        }
        let cuda_bad = map(&[
            ("type", s("cuda")),
            ("handle", bad_item),
            ("version", int(1)),
            ("metadata", metadata()),
        ]);
        let (path, _) = field_err(register_one(ext_of(&cuda_bad)).unwrap_err());
        assert_eq!(path, "kv_cache[0].handle[7]");

        let raw = |len: usize| {
            map(&[
                ("type", s("cuda_raw")),
                ("ipc_handle", Value::Bin(vec![3; len])),
                ("alloc_offset", int(0)),
                ("nbytes", int(4096)),
                ("version", int(1)),
                ("metadata", metadata()),
            ])
        };
        let IpcData::CudaRaw(r) = register_one(ext_of(&raw(64))).unwrap() else {
            panic!()
        };
        assert_eq!(r.ipc_handle, [3; 64]);
        let (path, _) = field_err(register_one(ext_of(&raw(63))).unwrap_err());
        assert_eq!(path, "kv_cache[0].ipc_handle");

        let vmm = |kind: &str, blob: Value, alloc_size: i64| {
            map(&[
                ("type", s("cuda_vmm")),
                ("export_id", Value::Bin(vec![5; 16])),
                ("kind", s(kind)),
                ("fabric_blob", blob),
                ("alloc_size", int(alloc_size)),
                ("alloc_offset", int(0)),
                ("nbytes", int(4096)),
                ("version", int(1)),
                ("metadata", metadata()),
            ])
        };
        let IpcData::CudaVmm(v) = register_one(ext_of(&vmm("posix_fd", Value::Nil, 8192))).unwrap()
        else {
            panic!()
        };
        assert_eq!((v.kind, v.alloc_size), (VmmKind::PosixFd, 8192));
        assert!(register_one(ext_of(&vmm("fabric", Value::Nil, 8192))).is_err());
        assert!(register_one(ext_of(&vmm("posix_fd", Value::Nil, 100))).is_err());
        assert!(register_one(ext_of(&vmm("other", Value::Nil, 8192))).is_err());
    }

    #[test]
    fn ipc_unknown_ext_code() {
        let Value::Ext(_, payload) = cpu_shm_ext(4096, &metadata()) else {
            panic!()
        };
        let (path, root) = field_err(register_one(Value::Ext(2, payload)).unwrap_err());
        assert_eq!(path, "kv_cache[0]");
        assert!(
            matches!(root, DecodeError::InvalidValue { ref reason, .. } if reason.contains("ext code 2")),
            "{root}"
        );
    }

    #[test]
    fn ipc_metadata_forbids_unknown_fields() {
        let Value::Map(mut m) = metadata() else {
            panic!()
        };
        m.push((s("requires_grad"), Value::Bool(false)));
        let (path, root) = field_err(register_one(cpu_shm_ext(4096, &Value::Map(m))).unwrap_err());
        assert_eq!(path, "kv_cache[0].metadata");
        assert!(
            matches!(root, DecodeError::UnknownField { ref field, .. } if field == "requires_grad"),
            "{root}"
        );
        // ... and so do the descriptors themselves.
        let d = map(&[
            ("type", s("cpu_shm")),
            ("shm_name", s("/x")),
            ("nbytes", int(4096)),
            ("version", int(1)),
            ("metadata", metadata()),
            ("extra", int(0)),
        ]);
        let (_, root) = field_err(register_one(ext_of(&d)).unwrap_err());
        assert!(matches!(root, DecodeError::UnknownField { .. }), "{root}");
    }

    #[test]
    fn ipc_metadata_rules() {
        let with = |field: &str, v: Value| {
            let Value::Map(mut m) = metadata() else {
                panic!()
            };
            m.iter_mut()
                .find(|(k, _)| k.as_str() == Some(field))
                .unwrap()
                .1 = v;
            register_one(cpu_shm_ext(1 << 20, &Value::Map(m)))
        };
        assert!(with("dtype", s("float17")).is_err());
        assert!(with("dtype", s("bfloat16")).is_ok());
        assert!(with("stride", ints(&[1, 1, 1])).is_err(), "rank mismatch");
        let (path, _) = field_err(with("shape", ints(&[2, -4, 16, 8])).unwrap_err());
        assert_eq!(path, "kv_cache[0].metadata.shape[1]");
        assert!(with("storage_offset", int(-1)).is_err());
        // The view must lie inside the segment.
        assert!(register_one(cpu_shm_ext(2047, &metadata())).is_err());
        assert!(register_one(cpu_shm_ext(2048, &metadata())).is_ok());
        let d = map(&[
            ("type", s("cpu_shm")),
            ("shm_name", s("/x")),
            ("nbytes", int(4096)),
            ("version", int(2)),
            ("metadata", metadata()),
        ]);
        assert!(register_one(ext_of(&d)).is_err(), "version 2");
        let d = map(&[
            ("type", s("cpu_shm")),
            ("shm_name", s("/x")),
            ("nbytes", int(4096)),
            ("metadata", metadata()),
        ]);
        let (_, root) = field_err(register_one(ext_of(&d)).unwrap_err());
        assert!(matches!(
            root,
            DecodeError::MissingField {
                field: "version",
                ..
            }
        ));
    }

    #[test]
    fn ipc_unsupported_and_rejected_descriptors() {
        let musa = map(&[
            ("type", s("musa")),
            ("handle", ints(&[1, 2])),
            ("version", int(1)),
            ("metadata", metadata()),
        ]);
        assert_eq!(
            register_one(ext_of(&musa)).unwrap(),
            IpcData::Unsupported { tag: "musa".into() }
        );
        let npu = map(&[
            ("version", int(1)),
            ("bare", Value::Bool(true)),
            ("planes", Value::Array(vec![])),
            ("type", s("npu")),
        ]);
        assert_eq!(
            register_one(ext_of(&npu)).unwrap(),
            IpcData::Unsupported { tag: "npu".into() }
        );
        let pickle = map(&[
            ("type", s("pickle")),
            ("data", Value::Bin(vec![0x80, 0x04])),
        ]);
        assert!(register_one(ext_of(&pickle)).is_err());
        // Legacy pickled wrappers (protocol 4 opcode stream) are not msgpack maps.
        assert!(register_one(Value::Ext(
            1,
            vec![0x80, 0x04, 0x95, 0x10, 0, 0, 0, 0, 0, 0, 0]
        ))
        .is_err());
        // No tag at all.
        assert!(register_one(ext_of(&map(&[("version", int(1))]))).is_err());
        // Not an ext.
        let (path, root) = field_err(register_one(metadata()).unwrap_err());
        assert_eq!(path, "kv_cache[0]");
        assert!(matches!(
            root,
            DecodeError::TypeMismatch {
                found: Kind::Map,
                ..
            }
        ));
        // Trailing bytes inside the ext payload.
        let Value::Ext(_, mut payload) = cpu_shm_ext(4096, &metadata()) else {
            panic!()
        };
        payload.push(0xc0);
        assert!(matches!(
            field_err(register_one(Value::Ext(1, payload)).unwrap_err()).1,
            DecodeError::TrailingBytes { .. }
        ));
    }

    #[test]
    fn register_kv_cache_other_fields() {
        let mut frames = register_frames(vec![cpu_shm_ext(4096, &metadata())]);
        frames[4] = encode_str("tensorrt");
        let (path, _) = field_err(decode(Op::RegisterKvCache, &frames).unwrap_err());
        assert_eq!(path, "engine_type");
        let mut frames = register_frames(vec![]);
        frames[5] = vec![0xc0];
        let (path, _) = field_err(decode(Op::RegisterKvCache, &frames).unwrap_err());
        assert_eq!(path, "layout_hints");
        frames[5] = encode_value(&map(&[("kv_layout", s("XYZ"))]));
        let (path, _) = field_err(decode(Op::RegisterKvCache, &frames).unwrap_err());
        assert_eq!(path, "layout_hints.kv_layout");
        frames[5] = encode_value(&map(&[
            ("head_dim", int(128)),
            ("engine_specific", s("kept")),
        ]));
        assert!(decode(Op::RegisterKvCache, &frames).is_ok());
        frames[6] = encode_value(&Value::Array(vec![map(&[("layer_indices", ints(&[0]))])]));
        let (path, root) = field_err(decode(Op::RegisterKvCache, &frames).unwrap_err());
        assert_eq!(path, "engine_group_infos[0]");
        assert!(matches!(
            root,
            DecodeError::MissingField {
                field: "engine_group_id",
                ..
            }
        ));
    }

    #[test]
    fn error_messages_name_op_and_field() {
        let err = lookup_with_key(key_with("token_ids", Some(ints(&[1, -5])))).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("lookup: bad payload `key.token_ids[1]`"),
            "{msg}"
        );
        assert!(msg.contains("-5"), "{msg}");
        assert_eq!(
            RequestError::Unsupported(Op::SubscribeKvEvents).to_string(),
            "operation subscribe_kv_events is not supported by kvshard"
        );
    }
}
