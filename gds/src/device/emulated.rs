//! A CPU stand-in for the device threads, so the CUDA path can be tested end
//! to end on hosts without a GPU. Never for serving: the server turns it on
//! only when `KVSHARD_CUDA_EMULATION=1` is in its environment, and says so
//! in its log.
//!
//! It plays one GPU, ordinal 0 with UUID [`EMULATED_UUID`], whose "device
//! memory" is POSIX shared memory: the 64 bytes of a `cuda_raw` descriptor's
//! IPC handle carry a shm name, NUL-padded (`cuda` and `cuda_vmm`
//! descriptors are refused). Everything else is what the device threads do,
//! minus the driver: the registration goes through [`check_spec`], a
//! transfer through [`validate_chunks`] and [`plan_batches`], and each batch
//! is copied by the CPU executor of the same stride table the kernel reads
//! ([`stride::gather`] and [`stride::scatter`]). The exported event it
//! answers with is 64 bytes that no CUDA process can open.
//!
//! [`check_spec`]: super::worker::check_spec
//! [`validate_chunks`]: super::worker::validate_chunks
//! [`plan_batches`]: super::worker::plan_batches
//! [`stride::gather`]: kvshard_layout::stride::gather
//! [`stride::scatter`]: kvshard_layout::stride::scatter

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use crate::cuda::{CudaDevice, CudaEnv};
use kvshard_layout::stride;

use super::error::WorkerError;
use super::event::{TimelineEvent, WorkerEvent, TIMELINE_SLOTS};
use super::ipc::IpcMemHandle;
use super::worker::{
    check_spec, plan_batches, read_len, validate_chunks, CopyDir, DeviceJob, InstanceSpec,
    LayerMemory, LayerRead,
};
use super::DeviceError;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that turns the emulation on (value `1`).
pub const EMULATION_ENV: &str = "KVSHARD_CUDA_EMULATION";

/// Milliseconds the stand-in takes to answer a registration, as a real GPU
/// takes to pin a large L1 (tests of what waits on the set-up); 0 if unset.
pub const SETUP_MS_ENV: &str = "KVSHARD_CUDA_EMULATION_SETUP_MS";

/// The UUID of the emulated GPU (torch's format).
pub const EMULATED_UUID: &str = "00000000-0000-4000-8000-0000000ee0e0";

/// The event handle every emulated transfer answers with (without
/// `--isolated-ipc`).
pub const EMULATED_EVENT: [u8; 64] = [0xee; 64];

/// How long a transfer waits for a worker's timeline semaphore to reach its
/// sequence.
pub const TIMELINE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The emulated GPU's semaphore buffer (`--isolated-ipc`): a shm segment of
/// [`TIMELINE_SLOTS`] 8-byte slots whose name the exported events carry.
struct SemaphoreBuffer {
    name: String,
    map: Mapping,
    next_slot: u64,
}

impl SemaphoreBuffer {
    fn create() -> Result<Self, WorkerError> {
        let name = format!("/kvshard_emu_sem_{}", std::process::id());
        let len = (TIMELINE_SLOTS * 8) as usize;
        let c = CString::new(name.clone()).map_err(|_| WorkerError::NotAShmName)?;
        let shm_err = |call| WorkerError::Shm {
            call,
            name: name.clone(),
            bytes: Some(len),
            source: Arc::new(std::io::Error::last_os_error()),
        };
        // SAFETY: a NUL-terminated name; the descriptor is closed below.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600) };
        if fd < 0 {
            return Err(shm_err("shm_open"));
        }
        // SAFETY: `fd` is open; sizing a fresh or stale segment (zeroed).
        let sized = unsafe { libc::ftruncate(fd, 0) == 0 && libc::ftruncate(fd, len as i64) == 0 };
        // SAFETY: `fd` is open and owned here.
        unsafe { libc::close(fd) };
        if !sized {
            return Err(shm_err("ftruncate"));
        }
        let mut handle = [0u8; 64];
        handle[..name.len()].copy_from_slice(name.as_bytes());
        let map = map_handle(&handle, len)?;
        Ok(Self {
            name,
            map,
            next_slot: 1,
        })
    }

    fn handle(&self) -> IpcMemHandle {
        let mut h = [0u8; 64];
        h[..self.name.len()].copy_from_slice(self.name.as_bytes());
        IpcMemHandle(h)
    }

    fn claim_slot(&mut self) -> Result<u64, WorkerError> {
        if self.next_slot >= TIMELINE_SLOTS {
            return Err(WorkerError::Device(DeviceError::invalid(
                "all semaphore slots are taken",
                "giving an instance a timeline-semaphore slot",
            )));
        }
        self.next_slot += 1;
        Ok((self.next_slot - 1) * 8)
    }

    /// Writes `seq` into the slot (what `cuStreamWriteValue64` does).
    fn signal(&self, slot_offset: u64, seq: u64) -> TimelineEvent {
        // SAFETY: the slot is one of the mapping's 8-byte slots (claim_slot).
        unsafe {
            let p = self.map.addr.add(slot_offset as usize).cast::<AtomicU64>();
            (*p).store(seq, Ordering::Release);
        }
        TimelineEvent {
            buffer: self.handle(),
            slot_offset,
            seq,
        }
    }
}

impl Drop for SemaphoreBuffer {
    fn drop(&mut self) {
        if let Ok(c) = CString::new(self.name.clone()) {
            // SAFETY: a NUL-terminated name.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

/// Waits until the 64-bit value in `ev`'s slot of the worker's mapped
/// semaphore buffer reaches `ev.seq` (what `cuStreamWaitValue64` GEQ does).
fn wait_timeline(map: &Mapping, ev: &TimelineEvent) -> Result<(), WorkerError> {
    if ev.slot_offset as usize + 8 > map.len {
        return Err(WorkerError::Device(DeviceError::invalid(
            format!(
                "slot {} is outside the worker's semaphore buffer",
                ev.slot_offset
            ),
            "waiting on a worker's timeline semaphore",
        )));
    }
    // SAFETY: inside the mapping (checked above), 8-byte aligned
    // (TimelineEvent::from_bytes); the worker writes it concurrently, hence
    // the atomic load.
    let slot = unsafe { &*map.addr.add(ev.slot_offset as usize).cast::<AtomicU64>() };
    let deadline = std::time::Instant::now() + TIMELINE_WAIT;
    loop {
        let value = slot.load(Ordering::Acquire);
        if value >= ev.seq {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(WorkerError::Device(DeviceError::invalid(
                format!(
                    "the worker's semaphore is at {value} after {} s, short of {}",
                    TIMELINE_WAIT.as_secs(),
                    ev.seq
                ),
                "waiting on a worker's timeline semaphore",
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Whether the environment asks for the emulation.
pub fn enabled() -> bool {
    std::env::var_os(EMULATION_ENV).is_some_and(|v| v == "1")
}

/// The probe result of the emulated host: one GPU.
pub fn emulated_env() -> CudaEnv {
    CudaEnv {
        driver_version: 0,
        devices: vec![CudaDevice {
            ordinal: 0,
            uuid: EMULATED_UUID.to_string(),
            name: "kvshard CPU emulation".to_string(),
            compute_capability: (9, 0),
        }],
    }
}

/// One shared-memory mapping standing in for a device allocation.
struct Mapping {
    addr: *mut u8,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr..addr+len` is a mapping this value made and owns.
        unsafe { libc::munmap(self.addr.cast(), self.len) };
    }
}

/// Maps `len` bytes of the shm segment named by a NUL-padded handle.
fn map_handle(handle: &[u8; 64], len: usize) -> Result<Mapping, WorkerError> {
    let end = handle.iter().position(|&b| b == 0).unwrap_or(handle.len());
    let name = std::str::from_utf8(&handle[..end])
        .ok()
        .filter(|n| n.starts_with('/') && n.len() > 1)
        .ok_or(WorkerError::NotAShmName)?;
    // The name ends before the first NUL, so it holds none.
    let c = CString::new(name).map_err(|_| WorkerError::NotAShmName)?;
    if len == 0 {
        return Err(WorkerError::EmptyShmSegment {
            name: name.to_string(),
        });
    }
    // SAFETY: a NUL-terminated name; the descriptor is closed below.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR, 0) };
    if fd < 0 {
        return Err(WorkerError::Shm {
            call: "shm_open",
            name: name.to_string(),
            bytes: None,
            source: Arc::new(std::io::Error::last_os_error()),
        });
    }
    // SAFETY: mapping an open descriptor; the result is checked.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    let err = std::io::Error::last_os_error();
    // SAFETY: `fd` is open and owned here; the mapping keeps the segment.
    unsafe { libc::close(fd) };
    if addr == libc::MAP_FAILED {
        return Err(WorkerError::Shm {
            call: "mmap",
            name: name.to_string(),
            bytes: Some(len),
            source: Arc::new(err),
        });
    }
    Ok(Mapping {
        addr: addr.cast(),
        len,
    })
}

/// A registered instance: its mappings and the kernel's paged buffers.
struct Instance {
    spec: InstanceSpec,
    _maps: Vec<Mapping>,
    /// Per registered tensor: the address of its first element and the
    /// bytes its view spans.
    views: Vec<(usize, u64)>,
    /// Per kernel group, per kernel pointer: first byte and length of the
    /// paged buffer.
    paged: Vec<Vec<(usize, usize)>>,
    /// `--isolated-ipc`: this instance's slot of the device's semaphore
    /// buffer, its last sequence, and the worker's buffer as mapped here.
    timeline: Option<Timeline>,
}

/// An instance's timeline-semaphore state (`--isolated-ipc`).
struct Timeline {
    slot_offset: u64,
    seq: u64,
    /// The worker's semaphore buffer, mapped.
    import: Option<(IpcMemHandle, Mapping)>,
}

fn register(spec: InstanceSpec) -> Result<Instance, WorkerError> {
    check_spec(&spec)?;
    let mut maps = Vec::with_capacity(spec.layers.len());
    let mut firsts = Vec::with_capacity(spec.layers.len());
    for (i, layer) in spec.layers.iter().enumerate() {
        let LayerMemory::Raw {
            handle,
            alloc_offset,
            nbytes,
        } = &layer.memory
        else {
            return Err(WorkerError::EmulationMemoryKind.in_layer(i));
        };
        let len = alloc_offset
            .checked_add(*nbytes)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| WorkerError::Overflow { what: "range" }.in_layer(i))?;
        let map = map_handle(&handle.0, len).map_err(|e| e.in_layer(i))?;
        firsts.push(map.addr as usize + (*alloc_offset + layer.view_offset) as usize);
        maps.push(map);
    }
    let paged = spec
        .groups
        .iter()
        .map(|g| {
            let span = g.table.paged_span_bytes() as usize;
            g.kernel_layers.iter().map(|&l| (firsts[l], span)).collect()
        })
        .collect();
    let views = firsts
        .iter()
        .zip(&spec.layers)
        .map(|(&first, l)| (first, l.view_bytes))
        .collect();
    Ok(Instance {
        spec,
        _maps: maps,
        views,
        paged,
        timeline: None,
    })
}

fn transfer(
    inst: &Instance,
    dir: CopyDir,
    chunks: &[super::worker::ChunkCopy],
) -> Result<(), WorkerError> {
    let s = &inst.spec;
    validate_chunks(chunks, dir, s)?;
    for batch in plan_batches(chunks, s) {
        let object = s.object_groups[batch.object_group].object_bytes as usize;
        let hosts = &chunks[batch.first_chunk..batch.first_chunk + batch.chunks];
        for (g, ((group, gb), paged)) in s
            .groups
            .iter()
            .zip(&batch.groups)
            .zip(&inst.paged)
            .enumerate()
        {
            if gb.fully_skipped() {
                continue;
            }
            // The group's region of each object: the kernel's object pointer.
            let region = object - group.object_offset as usize;
            let at = |c: &super::worker::ChunkCopy| c.host_addr + group.object_offset as usize;
            if dir == CopyDir::ToHost && group.keep_blocks < group.blocks_per_chunk {
                // A window shorter than the chunk fills the start of the
                // region; the rest is zeros, as the device's zeroed slots give.
                let full = group.table.object_bytes(s.chunk_slots);
                let moved = group.table.object_bytes(group.transfer_slots);
                let (Ok(full), Ok(moved)) = (full, moved) else {
                    return Err(WorkerError::Overflow { what: "a region" }.in_group(g));
                };
                for c in hosts {
                    // SAFETY: the region lies inside the caller's object (the
                    // DeviceJob contract; check_spec tiled the object).
                    unsafe {
                        std::ptr::write_bytes(
                            (at(c) + moved as usize) as *mut u8,
                            0,
                            (full - moved) as usize,
                        )
                    };
                }
            }
            // SAFETY (all slices below): the paged buffers are inside this
            // instance's live mappings (check_spec checked their spans), and
            // each host object is the caller's reserved or read-locked L1
            // object of `object_bytes` (the DeviceJob contract), of which the
            // region is the tail from the group's offset; the worker does not
            // touch these blocks while it waits for the transfer.
            let res = match dir {
                CopyDir::ToHost => {
                    let paged: Vec<&[u8]> = paged
                        .iter()
                        .map(|&(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) })
                        .collect();
                    let mut objs: Vec<&mut [u8]> = hosts
                        .iter()
                        .map(|c| unsafe {
                            std::slice::from_raw_parts_mut(at(c) as *mut u8, region)
                        })
                        .collect();
                    stride::gather(
                        &group.table,
                        &paged,
                        &mut objs,
                        &gb.ids,
                        group.transfer_slots,
                        gb.skip_blocks,
                    )
                }
                CopyDir::ToDevice => {
                    let mut paged: Vec<&mut [u8]> = paged
                        .iter()
                        .map(|&(a, n)| unsafe { std::slice::from_raw_parts_mut(a as *mut u8, n) })
                        .collect();
                    let objs: Vec<&[u8]> = hosts
                        .iter()
                        .map(|c| unsafe { std::slice::from_raw_parts(at(c) as *const u8, region) })
                        .collect();
                    stride::scatter(
                        &group.table,
                        &mut paged,
                        &objs,
                        &gb.ids,
                        group.transfer_slots,
                        gb.skip_blocks,
                    )
                }
            };
            res.map_err(|source| {
                WorkerError::CopyRefused {
                    first_chunk: batch.first_chunk,
                    source,
                }
                .in_group(g)
            })?;
        }
    }
    Ok(())
}

/// What the device thread's read-back copies, from the shm "device memory".
fn read_back(inst: &Instance, iid: i64, reads: &[LayerRead]) -> Result<Vec<Vec<u8>>, WorkerError> {
    reads
        .iter()
        .map(|read| {
            let &(first, view_bytes) =
                inst.views
                    .get(read.layer)
                    .ok_or(WorkerError::UnknownLayer {
                        device: 0,
                        instance: iid,
                        layer: read.layer,
                    })?;
            let mut buf = Vec::with_capacity(read_len(read, view_bytes)?);
            for &(off, len) in &read.ranges {
                // SAFETY: inside the layer's view (checked above), which the
                // instance's mapping keeps mapped.
                let src = unsafe {
                    std::slice::from_raw_parts((first + off as usize) as *const u8, len as usize)
                };
                buf.extend_from_slice(src);
            }
            Ok(buf)
        })
        .collect()
}

/// Parses the worker's event as the device thread does and, for a
/// timeline semaphore, waits for it.
fn waited(inst: &mut Instance, event: Option<&[u8]>) -> Result<(), WorkerError> {
    let Some(bytes) = event else { return Ok(()) };
    let ev = match WorkerEvent::parse(bytes, inst.spec.isolated_ipc).map_err(WorkerError::Device)? {
        WorkerEvent::Cuda(_) => return Ok(()),
        WorkerEvent::Timeline(ev) => ev,
    };
    let Some(Timeline { import, .. }) = &mut inst.timeline else {
        return Ok(());
    };
    if import.as_ref().is_none_or(|(h, _)| *h != ev.buffer) {
        let map = map_handle(&ev.buffer.0, (TIMELINE_SLOTS * 8) as usize)?;
        *import = Some((ev.buffer, map));
    }
    let (_, map) = import.as_ref().expect("mapped above");
    wait_timeline(map, &ev)
}

fn serve(jobs: mpsc::Receiver<DeviceJob>) {
    let mut instances: HashMap<i64, Instance> = HashMap::new();
    let mut semaphores: Option<SemaphoreBuffer> = None;
    let setup = std::env::var(SETUP_MS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_millis);
    for job in jobs {
        match job {
            DeviceJob::Register { iid, spec, done } => {
                if let Some(d) = setup {
                    std::thread::sleep(d);
                }
                let isolated = spec.isolated_ipc;
                let registered = register(spec).and_then(|mut inst| {
                    if isolated {
                        if semaphores.is_none() {
                            semaphores = Some(SemaphoreBuffer::create()?);
                        }
                        let slot = semaphores.as_mut().expect("made above").claim_slot()?;
                        inst.timeline = Some(Timeline {
                            slot_offset: slot,
                            seq: 0,
                            import: None,
                        });
                    }
                    Ok(inst)
                });
                match registered {
                    Ok(inst) => {
                        instances.insert(iid, inst);
                        done(Ok(()));
                    }
                    Err(e) => {
                        instances.remove(&iid);
                        done(Err(e));
                    }
                }
            }
            DeviceJob::Transfer {
                iid,
                dir,
                worker_event,
                chunks,
                done,
            } => {
                let res = match instances.get_mut(&iid) {
                    Some(inst) => waited(inst, worker_event.as_deref())
                        .and_then(|()| transfer(inst, dir, &chunks))
                        .map(|()| match (&mut inst.timeline, &semaphores) {
                            (Some(tl), Some(buffer)) => {
                                tl.seq += 1;
                                buffer.signal(tl.slot_offset, tl.seq).to_bytes()
                            }
                            _ => EMULATED_EVENT.to_vec(),
                        }),
                    None => Err(WorkerError::UnknownInstance {
                        device: 0,
                        instance: iid,
                    }),
                };
                done(res);
            }
            DeviceJob::Unregister { iid } => {
                instances.remove(&iid);
            }
            DeviceJob::ReadBack { iid, reads, done } => {
                done(match instances.get(&iid) {
                    Some(inst) => read_back(inst, iid, &reads),
                    None => Err(WorkerError::UnknownInstance {
                        device: 0,
                        instance: iid,
                    }),
                });
            }
        }
    }
}

/// The emulated GPU's thread.
pub struct EmulatedDevice {
    tx: Option<mpsc::SyncSender<DeviceJob>>,
    thread: Option<JoinHandle<()>>,
}

impl EmulatedDevice {
    pub fn start() -> Result<EmulatedDevice, WorkerError> {
        let (tx, rx) = mpsc::sync_channel(super::worker::DEFAULT_QUEUE_DEPTH);
        let thread = std::thread::Builder::new()
            .name("kvshard-cuda-emu".into())
            .spawn(move || serve(rx))
            .map_err(|e| WorkerError::ThreadSpawn {
                what: "the CUDA emulation thread",
                source: Arc::new(e),
            })?;
        log::warn!(
            "CUDA emulation ({EMULATION_ENV}=1): GPU transfers are copied on the CPU from POSIX \
             shm; this is a test harness, not a GPU"
        );
        Ok(EmulatedDevice {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues a job (ordinal 0 only); hands it back when it cannot (as
    /// [`DeviceThreads::submit`](super::worker::DeviceThreads::submit)).
    #[allow(clippy::result_large_err)]
    pub fn submit(&self, ordinal: usize, job: DeviceJob) -> Result<(), DeviceJob> {
        if ordinal != 0 {
            return Err(job);
        }
        match &self.tx {
            Some(tx) => tx.try_send(job).map_err(|e| match e {
                mpsc::TrySendError::Full(j) | mpsc::TrySendError::Disconnected(j) => j,
            }),
            None => Err(job),
        }
    }
}

impl Drop for EmulatedDevice {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
