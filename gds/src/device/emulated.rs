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
use super::worker::{
    check_spec, plan_batches, read_len, validate_chunks, CopyDir, DeviceJob, InstanceSpec,
    LayerMemory, LayerRead,
};

/// The environment variable that turns the emulation on (value `1`).
pub const EMULATION_ENV: &str = "KVSHARD_CUDA_EMULATION";

/// Milliseconds the stand-in takes to answer a registration, as a real GPU
/// takes to pin a large L1 (tests of what waits on the set-up); 0 if unset.
pub const SETUP_MS_ENV: &str = "KVSHARD_CUDA_EMULATION_SETUP_MS";

/// The UUID of the emulated GPU (torch's format).
pub const EMULATED_UUID: &str = "00000000-0000-4000-8000-0000000ee0e0";

/// The event handle every emulated transfer answers with.
pub const EMULATED_EVENT: [u8; 64] = [0xee; 64];

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
    /// Per kernel pointer: first byte and length of the paged buffer.
    paged: Vec<(usize, usize)>,
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
    let span = spec.table.paged_span_bytes() as usize;
    let paged = spec
        .kernel_layers
        .iter()
        .map(|&l| (firsts[l], span))
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
    })
}

fn transfer(
    inst: &Instance,
    dir: CopyDir,
    chunks: &[super::worker::ChunkCopy],
) -> Result<(), WorkerError> {
    let s = &inst.spec;
    validate_chunks(
        chunks,
        dir,
        s.blocks_per_chunk,
        s.table.shape().nb,
        s.object_bytes,
    )?;
    let object = s.object_bytes as usize;
    for batch in plan_batches(chunks, s.blocks_per_chunk) {
        if batch.fully_skipped() {
            continue;
        }
        let hosts = &chunks[batch.first_chunk..batch.first_chunk + batch.chunks];
        // SAFETY (all slices below): the paged buffers are inside this
        // instance's live mappings (check_spec checked their spans), and each
        // host object is the caller's reserved or read-locked L1 object of
        // `object_bytes` (the DeviceJob contract); the worker does not touch
        // these blocks while it waits for the transfer.
        let res = match dir {
            CopyDir::ToHost => {
                let paged: Vec<&[u8]> = inst
                    .paged
                    .iter()
                    .map(|&(a, n)| unsafe { std::slice::from_raw_parts(a as *const u8, n) })
                    .collect();
                let mut objs: Vec<&mut [u8]> = hosts
                    .iter()
                    .map(|c| unsafe {
                        std::slice::from_raw_parts_mut(c.host_addr as *mut u8, object)
                    })
                    .collect();
                stride::gather(
                    &s.table,
                    &paged,
                    &mut objs,
                    &batch.ids,
                    s.chunk_slots,
                    batch.skip_blocks,
                )
            }
            CopyDir::ToDevice => {
                let mut paged: Vec<&mut [u8]> = inst
                    .paged
                    .iter()
                    .map(|&(a, n)| unsafe { std::slice::from_raw_parts_mut(a as *mut u8, n) })
                    .collect();
                let objs: Vec<&[u8]> = hosts
                    .iter()
                    .map(|c| unsafe {
                        std::slice::from_raw_parts(c.host_addr as *const u8, object)
                    })
                    .collect();
                stride::scatter(
                    &s.table,
                    &mut paged,
                    &objs,
                    &batch.ids,
                    s.chunk_slots,
                    batch.skip_blocks,
                )
            }
        };
        res.map_err(|source| WorkerError::CopyRefused {
            first_chunk: batch.first_chunk,
            source,
        })?;
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

fn serve(jobs: mpsc::Receiver<DeviceJob>) {
    let mut instances: HashMap<i64, Instance> = HashMap::new();
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
                match register(spec) {
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
                chunks,
                done,
                ..
            } => {
                let res = match instances.get(&iid) {
                    Some(inst) => transfer(inst, dir, &chunks).map(|()| EMULATED_EVENT.to_vec()),
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
