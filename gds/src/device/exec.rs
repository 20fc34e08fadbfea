//! The per-device executor's pieces: the kernel module, streams, launches,
//! completion events and device buffers.
//!
//! The block-copy kernel (`kv_block_copy.cu`) is compiled with NVRTC for the
//! device's exact `sm_XY` and loaded with `cuModuleLoadData`; when that
//! CUBIN cannot be built or loaded (an NVRTC that does not know the GPU, a
//! driver older than the NVRTC), PTX for a virtual architecture is tried,
//! which the driver JIT-compiles. Work runs on non-blocking streams; each op
//! ends with a private completion event the device thread can poll.

use std::ffi::{c_uint, c_void, CString};

use cudarc::driver::sys;

use super::{driver_call, driver_call_in_drop, guarded_call, Device, DeviceError};
use crate::kernel::{
    entry_name, CopyDirection, KernelLaunch, KernelObjects, KV_BLOCK_COPY_ENTRIES,
    KV_BLOCK_COPY_NAME, KV_BLOCK_COPY_SRC,
};
use crate::nvrtc::{Arch, Nvrtc};

/// Oldest virtual architecture used for the PTX fallback (NVRTC 13 rejects
/// older ones).
pub const PTX_FALLBACK_ARCH: u32 = 75;

/// Largest thread block the kernel is built for (`__launch_bounds__(1024)`).
pub const MAX_BLOCK_THREADS: u32 = 1024;

/// CUDA's limit on `gridDim.x`.
pub const MAX_GRID_X: u32 = i32::MAX as u32;

/// Maps an event/stream query result: done, not yet, or an error.
pub fn query_outcome(
    call: &'static str,
    result: sys::CUresult,
    doing: impl FnOnce() -> String,
) -> Result<bool, DeviceError> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(DeviceError::driver(call, other, doing())),
    }
}

/// Images to try for a device of compute capability `cc`, best first:
/// CUBIN for the exact `sm_XY` (when NVRTC lists it, or cannot list its
/// architectures), then PTX for the newest virtual architecture NVRTC
/// supports that is not newer than the device, at least
/// [`PTX_FALLBACK_ARCH`] (or the device's own when older than that).
pub fn arch_candidates(cc: (u32, u32), supported: Option<&[u32]>) -> Vec<Arch> {
    let code = cc.0 * 10 + cc.1;
    let mut out = Vec::with_capacity(2);
    if supported.is_none_or(|list| list.contains(&code)) {
        out.push(Arch::Cubin(code));
    }
    let floor = PTX_FALLBACK_ARCH.min(code);
    let ptx = supported
        .and_then(|list| list.iter().copied().filter(|&a| a <= code).max())
        .map_or(floor, |best| best.max(floor));
    out.push(Arch::Ptx(ptx));
    out
}

/// Copy width in bytes of a kernel entry point.
fn entry_unit_bytes(entry: &str) -> Option<u32> {
    [CopyDirection::Gather, CopyDirection::Scatter]
        .into_iter()
        .flat_map(|d| [16, 4, 2].map(|u| (d, u)))
        .find(|&(d, u)| entry_name(d, u) == Some(entry))
        .map(|(_, u)| u)
}

/// Device addresses a launch reads and writes besides its layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchArgs {
    /// Device address of the u64 array of paged base pointers (kernel order).
    pub paged: u64,
    /// Chunk objects: temp slots, or pinned host addresses mapped for the GPU.
    pub objects: KernelObjects,
    /// Device address of the i64 block ids of this launch.
    pub ids: u64,
}

/// Checks what can be checked on the host before a launch: the grid and
/// block fit CUDA's limits, the layout matches the grid, and every pointer
/// the launch uses is non-null and aligned.
pub fn validate_launch(launch: &KernelLaunch, args: &LaunchArgs) -> Result<u32, DeviceError> {
    let doing = || format!("launching {}", launch.entry);
    let bad = |why: String| Err(DeviceError::invalid(why, doing()));
    let unit = match entry_unit_bytes(launch.entry) {
        Some(u) => u,
        None => return bad(format!("{} is not a block-copy entry point", launch.entry)),
    };
    let [gx, gy, gz] = launch.dims.grid;
    let [bx, by, bz] = launch.dims.block;
    if [gx, gy, gz, bx, by, bz].contains(&0) {
        return bad(format!("empty launch dimensions {:?}", launch.dims));
    }
    if gx > MAX_GRID_X || gy > crate::kernel::MAX_GRID_YZ || gz > crate::kernel::MAX_GRID_YZ {
        return bad(format!("grid {:?} exceeds CUDA's limits", launch.dims.grid));
    }
    let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
    if threads > u64::from(MAX_BLOCK_THREADS) || bz > 64 {
        return bad(format!(
            "thread block {:?} exceeds the kernel's limits",
            launch.dims.block
        ));
    }
    let l = &launch.layout;
    if i64::from(gy) != i64::from(l.total_blocks) || l.blocks_per_object <= 0 {
        return bad(format!(
            "grid y {gy} does not match the layout's {} block ids ({} per object)",
            l.total_blocks, l.blocks_per_object
        ));
    }
    if args.paged == 0 || args.paged % 8 != 0 || args.ids == 0 || args.ids % 8 != 0 {
        return bad(format!(
            "paged pointer array {:#x} and block ids {:#x} must be non-null and 8-byte aligned",
            args.paged, args.ids
        ));
    }
    let objects = (l.total_blocks as u32).div_ceil(l.blocks_per_object as u32) as usize;
    if objects > args.objects.ptr.len() {
        return bad(format!(
            "{objects} objects needed, at most {}",
            args.objects.ptr.len()
        ));
    }
    for (i, &p) in args.objects.ptr[..objects].iter().enumerate() {
        if p == 0 || p % u64::from(unit) != 0 {
            return bad(format!(
                "object {i} at {p:#x} must be non-null and {unit}-byte aligned"
            ));
        }
    }
    Ok(unit)
}

/// A loaded block-copy module with its six entry points.
pub struct KernelModule {
    device: Device,
    raw: sys::CUmodule,
    functions: [sys::CUfunction; KV_BLOCK_COPY_ENTRIES.len()],
    arch: Arch,
}

impl KernelModule {
    /// Compiles the kernel for this device and loads it, trying
    /// [`arch_candidates`] in order; the error lists every attempt.
    pub fn compile(device: &Device, nvrtc: &Nvrtc) -> Result<Self, DeviceError> {
        let supported = nvrtc.supported_archs();
        let candidates = arch_candidates(device.compute_capability(), supported.as_deref());
        let mut failures = Vec::new();
        for arch in candidates {
            let image = match nvrtc.compile(KV_BLOCK_COPY_SRC, KV_BLOCK_COPY_NAME, arch, &[]) {
                Ok(image) => image,
                Err(e) => {
                    failures.push(format!("{arch}: {e}"));
                    continue;
                }
            };
            match Self::load(device, &image, arch) {
                Ok(module) => {
                    if !failures.is_empty() {
                        log::warn!(
                            "device {}: block-copy kernel loaded as {arch} after: {}",
                            device.ordinal(),
                            failures.join("; ")
                        );
                    }
                    return Ok(module);
                }
                Err(e) => failures.push(format!("{arch}: {e}")),
            }
        }
        Err(DeviceError::unavailable(
            format!(
                "no kernel image could be built and loaded: {}",
                failures.join("; ")
            ),
            format!(
                "loading the block-copy kernel on device {} (sm_{}{}, NVRTC {:?})",
                device.ordinal(),
                device.compute_capability().0,
                device.compute_capability().1,
                nvrtc.version()
            ),
        ))
    }

    /// Loads a compiled image (PTX text or CUBIN, as `arch` says) and looks
    /// up every entry point.
    pub fn load(device: &Device, image: &[u8], arch: Arch) -> Result<Self, DeviceError> {
        let doing = || {
            format!(
                "loading the {arch} block-copy module on device {}",
                device.ordinal()
            )
        };
        if image.is_empty() {
            return Err(DeviceError::invalid("empty module image", doing()));
        }
        device.bind_current()?;
        // An 8-aligned copy with at least one trailing NUL: PTX must be a C
        // string, and the ELF reader gets an aligned image.
        let mut buf = vec![0u64; image.len() / 8 + 1];
        // SAFETY: `buf` holds at least image.len() + 1 bytes; the regions
        // cannot overlap (fresh allocation).
        unsafe {
            std::ptr::copy_nonoverlapping(
                image.as_ptr(),
                buf.as_mut_ptr().cast::<u8>(),
                image.len(),
            )
        };
        let mut raw: sys::CUmodule = std::ptr::null_mut();
        driver_call(
            "cuModuleLoadData",
            doing,
            // SAFETY: symbol checked in Device::open; `buf` is a complete
            // image that outlives the call; out-pointer is a local.
            || unsafe { sys::cuModuleLoadData(&mut raw, buf.as_ptr().cast::<c_void>()) },
        )?;
        assert!(!raw.is_null(), "cuModuleLoadData gave a null module");
        let mut module = Self {
            device: device.clone(),
            raw,
            functions: [std::ptr::null_mut(); KV_BLOCK_COPY_ENTRIES.len()],
            arch,
        };
        for (slot, name) in module.functions.iter_mut().zip(KV_BLOCK_COPY_ENTRIES) {
            let c_name = CString::new(name).expect("entry names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            driver_call(
                "cuModuleGetFunction",
                || {
                    format!(
                        "looking up {name} in the {arch} module on device {}",
                        device.ordinal()
                    )
                },
                // SAFETY: `raw` is the live module; the name is a C string
                // alive for the call; out-pointer is a local.
                || unsafe { sys::cuModuleGetFunction(&mut f, raw, c_name.as_ptr()) },
            )?;
            assert!(!f.is_null(), "cuModuleGetFunction gave a null function");
            *slot = f;
        }
        Ok(module)
    }

    /// What the loaded image was built for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    fn function(&self, entry: &str) -> Option<sys::CUfunction> {
        KV_BLOCK_COPY_ENTRIES
            .iter()
            .position(|&e| e == entry)
            .map(|i| self.functions[i])
    }

    /// Enqueues one gather/scatter on `stream`. The parameters are laid out
    /// as the entry points declare them:
    /// `(const u64* paged, KvObjects objs, const i64* ids, KvLayout layout)`.
    ///
    /// # Safety
    /// `args.paged` must hold the layout's paged base pointers (each aligned
    /// to the copy width), every engine block the ids select and every
    /// object must be mapped device-accessible memory of the sizes the
    /// layout implies, `args.ids` must hold `total_blocks` ids checked
    /// against `nb`, and all of it must stay valid until the stream has run
    /// the kernel. The kernel writes through these addresses.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        launch: &KernelLaunch,
        args: &LaunchArgs,
    ) -> Result<(), DeviceError> {
        validate_launch(launch, args)?;
        assert_eq!(
            stream.device().ordinal(),
            self.device.ordinal(),
            "launching on another device's stream"
        );
        let f = self.function(launch.entry).ok_or_else(|| {
            DeviceError::invalid(
                "entry point not in the module",
                format!("launching {}", launch.entry),
            )
        })?;
        let mut paged: u64 = args.paged;
        let mut objects: KernelObjects = args.objects;
        let mut ids: u64 = args.ids;
        let mut layout = launch.layout;
        let mut params: [*mut c_void; 4] = [
            (&mut paged as *mut u64).cast(),
            (&mut objects as *mut KernelObjects).cast(),
            (&mut ids as *mut u64).cast(),
            (&mut layout as *mut crate::kernel::KernelLayout).cast(),
        ];
        let [gx, gy, gz] = launch.dims.grid;
        let [bx, by, bz] = launch.dims.block;
        let s = stream.raw();
        driver_call(
            "cuLaunchKernel",
            || {
                format!(
                    "launching {} grid {:?} block {:?} on device {}",
                    launch.entry,
                    launch.dims.grid,
                    launch.dims.block,
                    self.device.ordinal()
                )
            },
            // SAFETY: `f` belongs to this live module; `params` points at
            // four locals whose types match the entry's parameters (a u64
            // pointer, the 32-byte KvObjects, a u64 pointer, the 80-byte
            // KvLayout, all #[repr(C)] mirrors) and that outlive the call,
            // which copies them; no shared memory, no `extra`. The caller
            // vouches for the addresses (this function's contract).
            || unsafe {
                sys::cuLaunchKernel(
                    f,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    0,
                    s,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
        )
    }
}

impl Drop for KernelModule {
    fn drop(&mut self) {
        let raw = self.raw;
        self.device.bind_for_drop();
        driver_call_in_drop(
            "cuModuleUnload",
            || {
                format!(
                    "unloading the block-copy module on device {}",
                    self.device.ordinal()
                )
            },
            // SAFETY: `raw` came from cuModuleLoadData and is unloaded once;
            // the function handles die with `self`.
            || unsafe { sys::cuModuleUnload(raw) },
        );
    }
}

/// A non-blocking stream (no implicit sync with the legacy default stream).
pub struct Stream {
    device: Device,
    raw: sys::CUstream,
}

impl Stream {
    pub fn new(device: &Device) -> Result<Self, DeviceError> {
        device.bind_current()?;
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        driver_call(
            "cuStreamCreate",
            || format!("creating a stream on device {}", device.ordinal()),
            // SAFETY: symbol checked in Device::open; out-pointer is a local.
            || unsafe { sys::cuStreamCreate(&mut raw, flags) },
        )?;
        assert!(
            !raw.is_null(),
            "cuStreamCreate gave the null (default) stream"
        );
        Ok(Self {
            device: device.clone(),
            raw,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Blocks until everything enqueued so far has run.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let raw = self.raw;
        driver_call(
            "cuStreamSynchronize",
            || format!("synchronizing a stream on device {}", self.device.ordinal()),
            // SAFETY: `raw` is the live stream owned by `self`.
            || unsafe { sys::cuStreamSynchronize(raw) },
        )
    }

    /// Enqueues a host-to-device copy of `len` bytes from `src` into
    /// `dst[dst_offset..]`.
    ///
    /// # Safety
    /// `src..src+len` must be readable host memory that stays valid and
    /// unchanged until the stream has run the copy (pinned memory, or the
    /// copy is synchronous with respect to the host).
    pub unsafe fn copy_to_device(
        &self,
        dst: &DeviceBuffer,
        dst_offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        let d = dst.range(dst_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let s = self.raw;
        driver_call(
            "cuMemcpyHtoDAsync_v2",
            || {
                format!(
                    "copying {len} bytes to device {} at {d:#x}",
                    self.device.ordinal()
                )
            },
            // SAFETY: the device range is inside `dst` (checked above); the
            // host range is the caller's contract.
            || unsafe { sys::cuMemcpyHtoDAsync_v2(d, src.cast::<c_void>(), len, s) },
        )
    }

    /// Enqueues a device-to-host copy of `len` bytes from `src[src_offset..]`
    /// to `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must be writable host memory that nothing else reads
    /// or writes until the stream has run the copy, and that stays valid
    /// until then.
    pub unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        let sp = src.range(src_offset, len)?;
        // SAFETY: the device range is inside `src` (checked above), which
        // the caller keeps alive; the host range is the caller's contract.
        unsafe { self.copy_raw_to_host(dst, sp, len) }
    }

    /// Enqueues a device-to-host copy of `len` bytes from device address
    /// `src` (memory this context can read, such as an imported IPC range)
    /// to `dst`.
    ///
    /// # Safety
    /// `src..src+len` must be device memory mapped in this context until the
    /// stream has run the copy; `dst..dst+len` as for
    /// [`copy_to_host`](Self::copy_to_host).
    pub unsafe fn copy_raw_to_host(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        let s = self.raw;
        driver_call(
            "cuMemcpyDtoHAsync_v2",
            || {
                format!(
                    "copying {len} bytes from device {} at {src:#x}",
                    self.device.ordinal()
                )
            },
            // SAFETY: the caller's contract.
            || unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, s) },
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let raw = self.raw;
        self.device.bind_for_drop();
        driver_call_in_drop(
            "cuStreamDestroy_v2",
            || format!("destroying a stream on device {}", self.device.ordinal()),
            // SAFETY: `raw` came from cuStreamCreate and is destroyed once;
            // work still queued completes before the driver frees it.
            || unsafe { sys::cuStreamDestroy_v2(raw) },
        );
    }
}

/// A private (not interprocess) event marking the end of one op.
pub struct CompletionEvent {
    device: Device,
    raw: sys::CUevent,
}

impl CompletionEvent {
    pub fn new(device: &Device) -> Result<Self, DeviceError> {
        device.bind_current()?;
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        driver_call(
            "cuEventCreate",
            || format!("creating a completion event on device {}", device.ordinal()),
            // SAFETY: symbol checked in Device::open; out-pointer is a local.
            || unsafe { sys::cuEventCreate(&mut raw, flags) },
        )?;
        assert!(!raw.is_null(), "cuEventCreate gave a null event");
        Ok(Self {
            device: device.clone(),
            raw,
        })
    }

    /// Marks the point after everything enqueued on `stream` so far.
    pub fn record(&self, stream: &Stream) -> Result<(), DeviceError> {
        let (e, s) = (self.raw, stream.raw());
        driver_call(
            "cuEventRecord",
            || {
                format!(
                    "recording a completion event on device {}",
                    self.device.ordinal()
                )
            },
            // SAFETY: both handles are live and of the same context.
            || unsafe { sys::cuEventRecord(e, s) },
        )
    }

    /// Whether the recorded work has finished (true if never recorded).
    pub fn is_done(&self) -> Result<bool, DeviceError> {
        let raw = self.raw;
        let doing = || {
            format!(
                "querying a completion event on device {}",
                self.device.ordinal()
            )
        };
        // SAFETY: `raw` is the live event owned by `self`.
        let rc = guarded_call("cuEventQuery", doing, || unsafe { sys::cuEventQuery(raw) })?;
        query_outcome("cuEventQuery", rc, doing)
    }

    /// Blocks until the recorded work has finished.
    pub fn wait(&self) -> Result<(), DeviceError> {
        let raw = self.raw;
        driver_call(
            "cuEventSynchronize",
            || {
                format!(
                    "waiting for a completion event on device {}",
                    self.device.ordinal()
                )
            },
            // SAFETY: `raw` is the live event owned by `self`.
            || unsafe { sys::cuEventSynchronize(raw) },
        )
    }
}

impl Drop for CompletionEvent {
    fn drop(&mut self) {
        // SAFETY: `raw` came from cuEventCreate and is destroyed once, here.
        unsafe { self.device.destroy_event_in_drop(self.raw, "a completion") };
    }
}

/// Device memory from `cuMemAlloc_v2`, freed on drop (temp slots, id and
/// pointer arrays).
pub struct DeviceBuffer {
    device: Device,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (> 0) on `device`; the base is 256-byte aligned.
    pub fn alloc(device: &Device, len: usize) -> Result<Self, DeviceError> {
        let doing = || format!("allocating {len} bytes on device {}", device.ordinal());
        if len == 0 {
            return Err(DeviceError::invalid("zero-length allocation", doing()));
        }
        device.bind_current()?;
        let mut ptr: sys::CUdeviceptr = 0;
        driver_call(
            "cuMemAlloc_v2",
            doing,
            // SAFETY: symbol checked in Device::open; out-pointer is a local.
            || unsafe { sys::cuMemAlloc_v2(&mut ptr, len) },
        )?;
        assert!(ptr != 0, "cuMemAlloc_v2 gave a null pointer");
        Ok(Self {
            device: device.clone(),
            ptr,
            len,
        })
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Sets every byte to zero (`cuMemsetD8`, before anything else uses
    /// the buffer).
    pub fn zero(&self) -> Result<(), DeviceError> {
        self.device.bind_current()?;
        let (ptr, len) = (self.ptr, self.len);
        driver_call(
            "cuMemsetD8_v2",
            || format!("zeroing {len} bytes on device {}", self.device.ordinal()),
            // SAFETY: symbol checked in Device::open; the range is this live
            // allocation.
            || unsafe { sys::cuMemsetD8_v2(ptr, 0, len) },
        )
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of `[offset, offset + len)`, which must lie inside.
    pub fn range(&self, offset: usize, len: usize) -> Result<u64, DeviceError> {
        buffer_range(self.ptr, self.len, offset, len)
    }
}

fn buffer_range(base: u64, buf_len: usize, offset: usize, len: usize) -> Result<u64, DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= buf_len => Ok(base + offset as u64),
        _ => Err(DeviceError::invalid(
            format!("range at {offset} of {len} bytes is outside the {buf_len} byte buffer"),
            format!("addressing device buffer {base:#x}"),
        )),
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let ptr = self.ptr;
        self.device.bind_for_drop();
        driver_call_in_drop(
            "cuMemFree_v2",
            || {
                format!(
                    "freeing {} bytes on device {}",
                    self.len,
                    self.device.ordinal()
                )
            },
            // SAFETY: `ptr` came from cuMemAlloc_v2 and is freed once.
            || unsafe { sys::cuMemFree_v2(ptr) },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::DeviceErrorKind;
    use super::*;

    #[test]
    fn query_maps_ready_not_ready_and_errors() {
        assert_eq!(
            query_outcome("cuEventQuery", sys::CUresult::CUDA_SUCCESS, String::new),
            Ok(true)
        );
        assert_eq!(
            query_outcome(
                "cuEventQuery",
                sys::CUresult::CUDA_ERROR_NOT_READY,
                String::new
            ),
            Ok(false)
        );
        let e = query_outcome(
            "cuEventQuery",
            sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
            || "q".into(),
        )
        .unwrap_err();
        assert_eq!(e.result(), Some(sys::CUresult::CUDA_ERROR_LAUNCH_FAILED));
    }

    #[test]
    fn arch_candidates_prefer_exact_cubin_then_ptx() {
        let list = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(
            arch_candidates((9, 0), Some(&list)),
            vec![Arch::Cubin(90), Arch::Ptx(90)]
        );
        // An NVRTC that does not know the GPU: PTX of the newest it knows.
        assert_eq!(arch_candidates((10, 3), Some(&list)), vec![Arch::Ptx(100)]);
        // Unknown list: try the CUBIN, then the default PTX.
        assert_eq!(
            arch_candidates((8, 0), None),
            vec![Arch::Cubin(80), Arch::Ptx(PTX_FALLBACK_ARCH)]
        );
        // A GPU older than the fallback gets its own PTX, never a newer one.
        assert_eq!(
            arch_candidates((7, 0), None),
            vec![Arch::Cubin(70), Arch::Ptx(70)]
        );
        assert_eq!(arch_candidates((7, 0), Some(&list)), vec![Arch::Ptx(70)]);
    }

    #[test]
    fn entry_units_follow_the_names() {
        assert_eq!(entry_unit_bytes("kv_gather_u16"), Some(16));
        assert_eq!(entry_unit_bytes("kv_scatter_u4"), Some(4));
        assert_eq!(entry_unit_bytes("kv_scatter_u2"), Some(2));
        assert_eq!(entry_unit_bytes("kv_gather_u8"), None);
    }

    fn flash_launch() -> KernelLaunch {
        let t = super::super::flash_table(4);
        KernelLaunch::new(&t, CopyDirection::Gather, 2, 32, 256, 0).unwrap()
    }

    fn good_args() -> LaunchArgs {
        LaunchArgs {
            paged: 0x7000_0000,
            objects: KernelObjects {
                ptr: [0x1000_0000, 0x2000_0000, 0, 0],
            },
            ids: 0x3000_0000,
        }
    }

    #[test]
    fn launch_validation_accepts_a_good_launch() {
        assert_eq!(validate_launch(&flash_launch(), &good_args()), Ok(16));
    }

    #[test]
    fn launch_validation_refuses_bad_pointers_and_dims() {
        let l = flash_launch();
        let mut a = good_args();
        a.objects.ptr[1] = 0;
        assert!(validate_launch(&l, &a).is_err(), "second object is used");
        let mut a = good_args();
        a.objects.ptr[0] += 8;
        let e = validate_launch(&l, &a).unwrap_err();
        assert!(e.to_string().contains("16-byte aligned"), "{e}");
        assert!(matches!(e.kind, DeviceErrorKind::Invalid(_)));
        let mut a = good_args();
        a.ids = 4;
        assert!(validate_launch(&l, &a).is_err());
        let mut a = good_args();
        a.paged = 0;
        assert!(validate_launch(&l, &a).is_err());

        let mut bad = l;
        bad.dims.block = [32, 32, 2];
        assert!(validate_launch(&bad, &good_args()).is_err());
        let mut bad = l;
        bad.dims.grid[1] = 31;
        assert!(validate_launch(&bad, &good_args()).is_err());
        let mut bad = l;
        bad.dims.grid[2] = 0;
        assert!(validate_launch(&bad, &good_args()).is_err());
        let mut bad = l;
        bad.entry = "kv_gather_u8";
        assert!(validate_launch(&bad, &good_args()).is_err());
    }

    #[test]
    fn buffer_ranges_are_bounded() {
        assert_eq!(buffer_range(0x1000, 100, 0, 100), Ok(0x1000));
        assert_eq!(buffer_range(0x1000, 100, 100, 0), Ok(0x1000 + 100));
        assert!(buffer_range(0x1000, 100, 1, 100).is_err());
        assert!(buffer_range(0x1000, 100, usize::MAX, 2).is_err());
    }
}
