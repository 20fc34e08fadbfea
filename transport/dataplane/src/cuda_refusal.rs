//! GPU workers whose `register_kv_cache` carries CUDA IPC descriptors that
//! this server will not serve.
//!
//! With `--cuda-transfer on`, a CUDA driver that sees the worker's GPU and an
//! L1 in memory, such a registration goes to the CUDA path
//! (`cuda_transfer`). Otherwise it is answered (as every request is),
//! recorded as refused with the reason, and the worker's PINGs are answered
//! `False`, so lmcache's client enters its degraded mode with a warning
//! instead of sending transfers that fail one by one. The reason names what
//! is missing and the way a GPU worker can use kvshard instead: engine_driven
//! transfers over the shared L1 pool.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvshard_wire::{CudaIpc, InstanceId, IpcData, VmmKind};

/// What kvshard found out about CUDA on this host (probed once, on the first
/// CUDA registration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaHost {
    /// No usable driver, with the probe's reason.
    Absent(String),
    /// A driver and its devices (UUIDs in torch's format: lowercase
    /// 8-4-4-4-12 hex, no `GPU-` prefix).
    Present(kvshard_gds::cuda::CudaEnv),
}

impl CudaHost {
    /// Probes the CUDA driver; never panics.
    pub fn probe() -> CudaHost {
        #[cfg(debug_assertions)]
        if kvshard_gds::device::emulated::enabled() {
            return CudaHost::Present(kvshard_gds::device::emulated::emulated_env());
        }
        match kvshard_gds::cuda::CudaEnv::probe() {
            Ok(env) => CudaHost::Present(env),
            Err(e) => CudaHost::Absent(e.reason),
        }
    }
}

/// How a torch shareable handle (item 1 of `_share_cuda_()`) describes the
/// allocation behind a CUDA storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TorchHandle<'a> {
    /// A plain cudaMalloc block: its 64-byte `cudaIpcMemHandle_t`.
    Block(&'a [u8]),
    /// An expandable segment, whose pages must be fetched from the producer
    /// process; kvshard cannot map these.
    ExpandableSegment,
}

/// Parses torch's shareable handle: a bare 64-byte `cudaIpcMemHandle_t`
/// (torch before the versioned format) or `[version][type][payload]` with type
/// `'c'` (a block, 64-byte payload) or `'e'` (an expandable segment). Any
/// version byte is accepted: the `'c'` payload has not changed between them.
pub fn parse_torch_handle(h: &[u8]) -> Result<TorchHandle<'_>, String> {
    const IPC_HANDLE: usize = 64;
    if h.len() == IPC_HANDLE {
        return Ok(TorchHandle::Block(h));
    }
    match h {
        [_, b'c', payload @ ..] if payload.len() == IPC_HANDLE => Ok(TorchHandle::Block(payload)),
        [_, b'c', payload @ ..] => Err(format!(
            "a block handle must carry 64 bytes, this one carries {}",
            payload.len()
        )),
        [_, b'e', ..] => Ok(TorchHandle::ExpandableSegment),
        [v, t, ..] => Err(format!(
            "unknown handle type {:#04x} (version byte {v}); expected 'c' or 'e'",
            t
        )),
        _ => Err(format!("{} bytes is too short for a handle", h.len())),
    }
}

/// A refused registration: the descriptor tag and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub descriptor: &'static str,
    pub reason: String,
}

/// What the server offers GPU workers instead, for the refusal message.
#[derive(Debug, Clone, Copy)]
pub struct Alternatives<'a> {
    /// The SHM pool segment engine_driven workers map, if there is one.
    pub shm_name: Option<&'a str>,
    /// Whether `--supported-transfer-mode` loads the engine_driven path.
    pub engine_driven_enabled: bool,
}

/// The tag of the first CUDA descriptor in `kv_cache`, if it has any.
pub fn cuda_descriptor(kv_cache: &[IpcData]) -> Option<&'static str> {
    kv_cache.iter().find_map(|d| match d {
        IpcData::Cuda(_) => Some("cuda"),
        IpcData::CudaRaw(_) => Some("cuda_raw"),
        IpcData::CudaVmm(_) => Some("cuda_vmm"),
        _ => None,
    })
}

/// Whether this server serves CUDA transfers at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaGate {
    /// `--cuda-transfer off`.
    Off,
    /// The L1 lives in GDS slab files, which the device copies cannot reach.
    SlabL1,
    On,
}

/// Whether `kv_cache` holds CUDA descriptors this server refuses, and why;
/// `None` for other registrations and for CUDA ones the CUDA path takes.
pub fn check(
    kv_cache: &[IpcData],
    host: &CudaHost,
    alt: Alternatives<'_>,
    gate: CudaGate,
) -> Option<Refusal> {
    let first = cuda_descriptor(kv_cache)?;
    let cause = descriptor_problem(kv_cache)
        .or_else(|| host_problem(kv_cache, host))
        .or_else(|| gate_problem(gate))?;
    Some(Refusal {
        descriptor: first,
        reason: format!("{cause}. {}", remedy(alt)),
    })
}

/// A descriptor kvshard could never map, whatever the host.
fn descriptor_problem(kv_cache: &[IpcData]) -> Option<String> {
    kv_cache.iter().enumerate().find_map(|(i, d)| match d {
        IpcData::Cuda(CudaIpc { handle, .. }) => match handle.mem_handle.as_deref() {
            None => Some(format!("layer {i}'s CUDA storage carries no memory handle")),
            Some(h) => match parse_torch_handle(h) {
                Ok(TorchHandle::Block(_)) => None,
                Ok(TorchHandle::ExpandableSegment) => Some(format!(
                    "layer {i}'s KV cache lives in a PyTorch expandable segment, which cannot be \
                     mapped from another process; start vLLM with \
                     PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
                )),
                Err(e) => Some(format!(
                    "layer {i}'s CUDA IPC handle is not understood: {e}"
                )),
            },
        },
        IpcData::CudaVmm(v) if v.kind == VmmKind::PosixFd => Some(format!(
            "layer {i} is a posix_fd CUDA VMM export, which needs a file-descriptor channel \
             the lmcache 0.5.6 protocol does not have (only fabric exports can be imported)"
        )),
        _ => None,
    })
}

fn gate_problem(gate: CudaGate) -> Option<String> {
    match gate {
        CudaGate::On => None,
        CudaGate::Off => Some(
            "CUDA IPC transfers (lmcache_driven on GPU workers) are off in this server: \
             --cuda-transfer on (the default) enables them"
                .to_owned(),
        ),
        CudaGate::SlabL1 => Some(
            "CUDA IPC transfers need the L1 in memory, and this server keeps it in GDS slab \
             files (--gds-l1-path)"
                .to_owned(),
        ),
    }
}

fn host_problem(kv_cache: &[IpcData], host: &CudaHost) -> Option<String> {
    match host {
        CudaHost::Absent(why) => Some(format!("this host has no usable CUDA driver ({why})")),
        CudaHost::Present(env) => kv_cache.iter().find_map(|d| {
            let device_uuids: Vec<&str> = env.devices.iter().map(|d| d.uuid.as_str()).collect();
            let uuid = &d.metadata()?.device_uuid;
            let uuid = uuid.strip_prefix("GPU-").unwrap_or(uuid);
            (!device_uuids.contains(&uuid)).then(|| {
                format!(
                    "the worker's GPU {uuid} is not visible to kvshard (it sees {}); \
                     start kvshard with every GPU its workers use visible",
                    if device_uuids.is_empty() {
                        "none".to_owned()
                    } else {
                        device_uuids.join(", ")
                    }
                )
            })
        }),
    }
}

fn remedy(alt: Alternatives<'_>) -> String {
    let mut s = String::from(
        "GPU workers can use kvshard through engine_driven transfers: start vLLM with \
         LMCACHE_MP_TRANSFER_MODE=engine_driven (or kv_connector_extra_config \
         \"lmcache.mp.mp_transfer_mode\": \"engine_driven\") on this host",
    );
    match alt.shm_name {
        Some(name) => s.push_str(&format!(", sharing /dev/shm so it can map /dev/shm/{name}")),
        None => s.push_str(
            "; this server has no SHM pool, which that path needs: start it without --shm-name \"\"",
        ),
    }
    if !alt.engine_driven_enabled {
        s.push_str(", and start kvshard with --supported-transfer-mode auto");
    }
    s.push_str(
        ". Until then this worker's PINGs are answered False, so its client runs in degraded mode \
         (no KV cache)",
    );
    s
}

/// A refused instance, kept so its PINGs and `/status` can say so.
#[derive(Debug, Clone)]
pub struct RefusedEntry {
    pub model_name: String,
    pub world_size: i64,
    pub descriptor: &'static str,
    pub reason: String,
    pub last_seen: Instant,
}

/// Refused instances, bounded; silent ones are forgotten like reaped workers.
#[derive(Debug)]
pub struct RefusedTable {
    map: HashMap<InstanceId, RefusedEntry>,
    max: usize,
}

impl RefusedTable {
    pub fn new(max: usize) -> Self {
        RefusedTable {
            map: HashMap::new(),
            max: max.max(1),
        }
    }

    /// Records a refusal; false when `iid` was already refused (only its
    /// liveness is refreshed). A full table forgets its stalest entry.
    pub fn insert(&mut self, iid: InstanceId, e: RefusedEntry) -> bool {
        if let Some(old) = self.map.get_mut(&iid) {
            old.last_seen = e.last_seen;
            return false;
        }
        if self.map.len() >= self.max {
            if let Some(stalest) = self
                .map
                .iter()
                .min_by_key(|(_, e)| e.last_seen)
                .map(|(i, _)| *i)
            {
                self.map.remove(&stalest);
            }
        }
        self.map.insert(iid, e);
        true
    }

    pub fn contains(&self, iid: InstanceId) -> bool {
        self.map.contains_key(&iid)
    }

    /// Refreshes a refused instance's liveness; true if it is refused.
    pub fn touch(&mut self, iid: InstanceId, now: Instant) -> bool {
        match self.map.get_mut(&iid) {
            Some(e) => {
                e.last_seen = now;
                true
            }
            None => false,
        }
    }

    pub fn remove(&mut self, iid: InstanceId) -> Option<RefusedEntry> {
        self.map.remove(&iid)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Forgets entries silent for longer than `timeout`; returns how many.
    pub fn reap(&mut self, now: Instant, timeout: Duration) -> usize {
        let before = self.map.len();
        self.map
            .retain(|_, e| now.duration_since(e.last_seen) <= timeout);
        before - self.map.len()
    }

    /// `/status`'s view, ordered by instance id.
    pub fn to_json(&self, now: Instant) -> serde_json::Value {
        let mut ids: Vec<&InstanceId> = self.map.keys().collect();
        ids.sort_unstable();
        ids.into_iter()
            .map(|i| {
                let e = &self.map[i];
                serde_json::json!({
                    "instance_id": i.0,
                    "model_name": e.model_name,
                    "world_size": e.world_size,
                    "descriptor": e.descriptor,
                    "reason": e.reason,
                    "seconds_since_last_seen": now.duration_since(e.last_seen).as_secs_f64(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard_wire::{CudaIpcHandle, RawCudaIpc, TensorMetadata, VmmCudaIpc};

    const UUID: &str = "8f6b2c1e-0000-1111-2222-333344445555";

    fn meta() -> TensorMetadata {
        TensorMetadata {
            dtype: "bfloat16".into(),
            shape: vec![2, 4, 16, 8, 128],
            stride: vec![65536, 16384, 1024, 128, 1],
            storage_offset: 0,
            device_uuid: UUID.into(),
        }
    }

    fn cuda(handle: Option<Vec<u8>>) -> IpcData {
        IpcData::Cuda(CudaIpc {
            handle: CudaIpcHandle {
                device: 0,
                mem_handle: handle,
                storage_size: 1 << 20,
                storage_offset: 0,
                ref_counter_handle: None,
                ref_counter_offset: 0,
                event_handle: None,
                event_sync_required: false,
            },
            version: 1,
            metadata: meta(),
        })
    }

    fn versioned(kind: u8) -> Vec<u8> {
        let mut h = vec![2, kind];
        h.extend(0..64u8);
        h
    }

    const ALT: Alternatives<'static> = Alternatives {
        shm_name: Some("lmcache_l1_pool_x"),
        engine_driven_enabled: true,
    };

    #[test]
    fn torch_handles() {
        let bare: Vec<u8> = (0..64).collect();
        assert_eq!(parse_torch_handle(&bare), Ok(TorchHandle::Block(&bare[..])));
        for v in [1u8, 2, 3, 9] {
            let mut h = versioned(b'c');
            h[0] = v;
            assert_eq!(parse_torch_handle(&h), Ok(TorchHandle::Block(&h[2..])));
        }
        assert_eq!(
            parse_torch_handle(&versioned(b'e')),
            Ok(TorchHandle::ExpandableSegment)
        );
        assert!(parse_torch_handle(&versioned(b'x'))
            .unwrap_err()
            .contains("unknown handle type 0x78"));
        assert!(parse_torch_handle(&[2, b'c', 1, 2])
            .unwrap_err()
            .contains("carries 2"));
        assert!(parse_torch_handle(&[2]).unwrap_err().contains("too short"));
    }

    #[test]
    fn non_cuda_registrations_are_not_refused_here() {
        let absent = CudaHost::Absent("x".into());
        assert_eq!(check(&[], &absent, ALT, CudaGate::Off), None);
        let other = IpcData::Unsupported { tag: "npu".into() };
        assert_eq!(check(&[other], &absent, ALT, CudaGate::Off), None);
    }

    #[test]
    fn reasons_name_the_cause_and_the_remedy() {
        let absent = CudaHost::Absent("libcuda.so.1 not found".into());
        let r = check(&[cuda(Some(versioned(b'c')))], &absent, ALT, CudaGate::On).unwrap();
        assert_eq!(r.descriptor, "cuda");
        assert!(
            r.reason
                .contains("no usable CUDA driver (libcuda.so.1 not found)"),
            "{}",
            r.reason
        );
        assert!(r.reason.contains("LMCACHE_MP_TRANSFER_MODE=engine_driven"));
        assert!(r.reason.contains("/dev/shm/lmcache_l1_pool_x"));
        assert!(r.reason.contains("PINGs are answered False"));

        // Descriptor problems come first: they hold on any host.
        let r = check(&[cuda(Some(versioned(b'e')))], &absent, ALT, CudaGate::On).unwrap();
        assert!(
            r.reason.contains("expandable_segments:False"),
            "{}",
            r.reason
        );
        let r = check(&[cuda(None)], &absent, ALT, CudaGate::On).unwrap();
        assert!(r.reason.contains("no memory handle"));
        let vmm = IpcData::CudaVmm(VmmCudaIpc {
            export_id: [0; 16],
            kind: VmmKind::PosixFd,
            fabric_blob: None,
            alloc_size: 1 << 21,
            alloc_offset: 0,
            nbytes: 1 << 20,
            version: 1,
            metadata: meta(),
        });
        let r = check(&[vmm], &absent, ALT, CudaGate::On).unwrap();
        assert_eq!(r.descriptor, "cuda_vmm");
        assert!(r.reason.contains("posix_fd"));

        // A host with a driver: the worker's GPU must be visible, and then the
        // transfer itself is what is missing.
        let raw = IpcData::CudaRaw(RawCudaIpc {
            ipc_handle: [0; 64],
            alloc_offset: 0,
            nbytes: 1 << 20,
            version: 1,
            metadata: meta(),
        });
        let host_with = |uuid: &str| {
            CudaHost::Present(kvshard_gds::cuda::CudaEnv {
                driver_version: 12080,
                devices: vec![kvshard_gds::cuda::CudaDevice {
                    ordinal: 0,
                    uuid: uuid.into(),
                    name: "test".into(),
                    compute_capability: (9, 0),
                }],
            })
        };
        let other_gpu = host_with("00000000-0000-0000-0000-000000000001");
        let r = check(std::slice::from_ref(&raw), &other_gpu, ALT, CudaGate::On).unwrap();
        assert!(
            r.reason.contains(&format!("GPU {UUID} is not visible")),
            "{}",
            r.reason
        );
        let same_gpu = host_with(UUID);
        let r = check(std::slice::from_ref(&raw), &same_gpu, ALT, CudaGate::Off).unwrap();
        assert!(r.reason.contains("--cuda-transfer on"), "{}", r.reason);
        let r = check(std::slice::from_ref(&raw), &same_gpu, ALT, CudaGate::SlabL1).unwrap();
        assert!(r.reason.contains("--gds-l1-path"), "{}", r.reason);
        // Served: the CUDA path takes it.
        assert_eq!(check(&[raw], &same_gpu, ALT, CudaGate::On), None);

        // The remedy says what the server itself lacks for it.
        let bare = Alternatives {
            shm_name: None,
            engine_driven_enabled: false,
        };
        let r = check(&[cuda(Some(versioned(b'c')))], &absent, bare, CudaGate::On).unwrap();
        assert!(r.reason.contains("without --shm-name \"\""), "{}", r.reason);
        assert!(r.reason.contains("--supported-transfer-mode auto"));
    }

    #[test]
    fn refused_table_is_bounded_and_reaped() {
        let t0 = Instant::now();
        let entry = |at: Instant| RefusedEntry {
            model_name: "m".into(),
            world_size: 1,
            descriptor: "cuda",
            reason: "r".into(),
            last_seen: at,
        };
        let mut t = RefusedTable::new(2);
        assert!(t.insert(InstanceId(1), entry(t0)));
        assert!(!t.insert(InstanceId(1), entry(t0 + Duration::from_secs(1))));
        assert!(t.insert(InstanceId(2), entry(t0 + Duration::from_secs(2))));
        // Full: the stalest (1, seen at +1 s) goes.
        assert!(t.insert(InstanceId(3), entry(t0 + Duration::from_secs(3))));
        assert!(
            !t.contains(InstanceId(1)) && t.contains(InstanceId(2)) && t.contains(InstanceId(3))
        );
        assert!(t.touch(InstanceId(2), t0 + Duration::from_secs(10)));
        assert!(!t.touch(InstanceId(7), t0));
        assert_eq!(
            t.reap(t0 + Duration::from_secs(12), Duration::from_secs(5)),
            1
        );
        assert!(t.contains(InstanceId(2)) && !t.contains(InstanceId(3)));
        let j = t.to_json(t0 + Duration::from_secs(12));
        assert_eq!(j[0]["instance_id"], 2);
        assert_eq!(j[0]["descriptor"], "cuda");
        assert_eq!(t.remove(InstanceId(2)).unwrap().model_name, "m");
        assert!(t.is_empty());
    }
}
