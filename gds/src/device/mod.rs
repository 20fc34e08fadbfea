//! The CUDA device runtime: contexts, IPC imports, events, pinned host
//! memory, the kernel module, streams and device buffers.
//!
//! # Model
//!
//! One device thread per GPU owns that GPU's primary context: it builds a
//! [`Device`] (which retains the primary context and makes it current on that
//! thread), and every CUDA object of this module is created, used and dropped
//! on that thread. Shards never call CUDA; they hand the device thread work
//! (a copy plan, host pointers inside their pinned slabs) and learn of
//! completion from it. The handle types hold raw CUDA pointers and an `Rc`,
//! so the compiler keeps them on the thread that made them.
//!
//! Every resource holds a clone of its [`Device`], so the primary context
//! outlives everything created in it and is released after the last one.
//!
//! # Never a panic because CUDA is missing
//!
//! cudarc's dynamically loaded bindings panic when `libcuda.so.1` or a symbol
//! is missing. Nothing here is meant to be called unless
//! [`CudaEnv::probe`](crate::cuda::CudaEnv::probe) succeeded, and the types
//! that call the driver can only be built through [`Device::open`], which
//! takes that `CudaEnv`. Because a `CudaEnv` is plain data, `Device::open`
//! checks again that the library is present and that every symbol this
//! module calls exists before the first call; optional APIs (the VMM fabric
//! import) check their own symbols and the driver version on first use. A
//! missing library or symbol is a [`DeviceError`] that says so. Each driver
//! call also runs under `catch_unwind` as a second guard.

// A test hook: compiled into the builds the test suite runs (debug), absent
// from release binaries.
#[cfg(debug_assertions)]
pub mod emulated;
/// The stride table of a FlashAttention NHD group of `nl` bf16 layers
/// (100 blocks of 16 tokens, 8 heads of 128), for the tests of this module.
#[cfg(test)]
pub(crate) fn flash_table(nl: u32) -> kvshard_layout::stride::StrideTable {
    use kvshard_layout::stride::{EngineKvFormat, PageBufferShape, StrideTable};
    let shape = PageBufferShape {
        kv_size: 2,
        nl,
        nb: 100,
        bs: 16,
        nh: 8,
        hs: 128,
        element_size: 2,
        block_stride_elems: 0,
    };
    StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &shape).unwrap()
}

pub mod error;
pub mod event;
pub mod exec;
pub mod ipc;
pub mod pin;
pub mod worker;

use std::ffi::c_int;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::cuda::CudaEnv;

pub use error::{Step, WorkerError};

/// Why a device operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceErrorKind {
    /// A driver call returned an error.
    Driver {
        call: &'static str,
        result: sys::CUresult,
    },
    /// The driver library, a symbol or a driver feature is missing.
    Unavailable(String),
    /// The request itself is wrong (bad handle length, out-of-range offset,
    /// unknown mapping, ...); nothing was done.
    Invalid(String),
}

/// A failed device operation: what went wrong and what was being done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceError {
    pub kind: DeviceErrorKind,
    /// What was being done, e.g. "opening an IPC memory handle on device 0".
    pub doing: String,
}

impl DeviceError {
    pub fn driver(call: &'static str, result: sys::CUresult, doing: impl Into<String>) -> Self {
        Self {
            kind: DeviceErrorKind::Driver { call, result },
            doing: doing.into(),
        }
    }

    pub fn unavailable(reason: impl Into<String>, doing: impl Into<String>) -> Self {
        Self {
            kind: DeviceErrorKind::Unavailable(reason.into()),
            doing: doing.into(),
        }
    }

    pub fn invalid(reason: impl Into<String>, doing: impl Into<String>) -> Self {
        Self {
            kind: DeviceErrorKind::Invalid(reason.into()),
            doing: doing.into(),
        }
    }

    /// The driver result, when a driver call failed.
    pub fn result(&self) -> Option<sys::CUresult> {
        match self.kind {
            DeviceErrorKind::Driver { result, .. } => Some(result),
            _ => None,
        }
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            DeviceErrorKind::Driver { call, result } => write!(
                f,
                "{}: {call} failed with {result:?} ({})",
                self.doing, *result as u32
            ),
            DeviceErrorKind::Unavailable(reason) => {
                write!(f, "{}: CUDA unavailable: {reason}", self.doing)
            }
            DeviceErrorKind::Invalid(reason) => write!(f, "{}: {reason}", self.doing),
        }
    }
}

impl std::error::Error for DeviceError {}

/// Turns a driver result into `Ok` or a [`DeviceError`]; `doing` is only
/// evaluated on failure.
pub fn check(
    call: &'static str,
    result: sys::CUresult,
    doing: impl FnOnce() -> String,
) -> Result<(), DeviceError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::driver(call, result, doing()))
    }
}

/// Runs one raw driver call under `catch_unwind` and returns its result
/// unchecked (for calls where some errors are answers, like
/// `CUDA_ERROR_NOT_READY`). The symbol must have been checked with
/// [`require_symbols`] first; the guard only turns a loader panic that
/// slipped through into an error.
pub(crate) fn guarded_call(
    call: &'static str,
    doing: impl FnOnce() -> String,
    f: impl FnOnce() -> sys::CUresult,
) -> Result<sys::CUresult, DeviceError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("panic in the driver loader");
        DeviceError::unavailable(format!("{call}: {msg}"), doing())
    })
}

/// Runs one driver call under `catch_unwind` (see [`guarded_call`]) and
/// checks its result.
pub(crate) fn driver_call(
    call: &'static str,
    doing: impl Fn() -> String,
    f: impl FnOnce() -> sys::CUresult,
) -> Result<(), DeviceError> {
    let rc = guarded_call(call, &doing, f)?;
    check(call, rc, doing)
}

/// Like [`driver_call`] for a call made while dropping a resource: failure
/// is logged, since a destructor cannot report it.
pub(crate) fn driver_call_in_drop(
    call: &'static str,
    doing: impl Fn() -> String,
    f: impl FnOnce() -> sys::CUresult,
) {
    if let Err(e) = driver_call(call, doing, f) {
        log::warn!("{e}");
    }
}

/// Every driver entry point [`Device::open`] checks before the first call:
/// the context calls here and everything `event`, `exec`, `ipc` (legacy
/// IPC) and `pin` use. The VMM import has its own list ([`ipc::VMM_SYMBOLS`]).
pub const DEVICE_SYMBOLS: [&str; 31] = [
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    // ipc
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemGetAddressRange_v2",
    // event
    "cuIpcOpenEventHandle",
    "cuIpcGetEventHandle",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    // pin
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    // exec
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuLaunchKernel",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
];

/// Whether `libcuda` can be opened; asked once per process.
fn driver_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: only tries to dlopen the candidate driver library names;
        // a panic inside is caught and counts as "absent".
        catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    })
}

/// Checks that the driver library is present and exports every name in
/// `symbols`, so that cudarc's lazy lookups of those names cannot panic.
pub fn require_symbols(symbols: &[&str], doing: &str) -> Result<(), DeviceError> {
    if !driver_library_present() {
        return Err(DeviceError::unavailable(
            "libcuda.so.1 not found (is the NVIDIA driver installed?)",
            doing,
        ));
    }
    for name in symbols {
        // SAFETY: culib() opens the library found present above (a panic is
        // caught); the symbol is only looked up, never called through this
        // type.
        let found = catch_unwind(|| unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(name.as_bytes())
                .is_ok()
        })
        .unwrap_or(false);
        if !found {
            return Err(DeviceError::unavailable(
                format!("the loaded libcuda lacks {name} (driver too old?)"),
                doing,
            ));
        }
    }
    Ok(())
}

struct DeviceInner {
    ordinal: u32,
    cu_device: sys::CUdevice,
    context: sys::CUcontext,
    compute_capability: (u32, u32),
    driver_version: i32,
}

/// One GPU's retained primary context. Cheap to clone (shared handle); the
/// primary context is released when the last clone, and with it every
/// resource created through it, is dropped. Not `Send`: it belongs to the
/// device thread that opened it.
#[derive(Clone)]
pub struct Device {
    inner: Rc<DeviceInner>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.inner.ordinal)
            .field("compute_capability", &self.inner.compute_capability)
            .field("driver_version", &self.inner.driver_version)
            .finish()
    }
}

impl Device {
    /// Retains the primary context of device `ordinal` (as `env` lists it)
    /// and makes it current on the calling thread.
    pub fn open(env: &CudaEnv, ordinal: u32) -> Result<Device, DeviceError> {
        let doing = format!("opening CUDA device {ordinal}");
        let info = env
            .devices
            .iter()
            .find(|d| d.ordinal == ordinal)
            .ok_or_else(|| {
                DeviceError::invalid(
                    format!(
                        "the probe found {} device(s); ordinal {ordinal} is not one of them",
                        env.devices.len()
                    ),
                    doing.clone(),
                )
            })?;
        require_symbols(&DEVICE_SYMBOLS, &doing)?;
        let raw_ordinal = c_int::try_from(ordinal)
            .map_err(|_| DeviceError::invalid("ordinal does not fit a C int", doing.clone()))?;

        let mut cu_device: sys::CUdevice = 0;
        driver_call(
            "cuDeviceGet",
            || doing.clone(),
            // SAFETY: symbol checked above; the out-pointer is a live local.
            || unsafe { sys::cuDeviceGet(&mut cu_device, raw_ordinal) },
        )?;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        driver_call(
            "cuDevicePrimaryCtxRetain",
            || doing.clone(),
            // SAFETY: symbol checked; `cu_device` came from cuDeviceGet; the
            // out-pointer is a live local.
            || unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, cu_device) },
        )?;
        assert!(
            !context.is_null(),
            "cuDevicePrimaryCtxRetain gave a null context"
        );
        // From here on the retain is owned by `device` and released on drop,
        // including when binding fails below.
        let device = Device {
            inner: Rc::new(DeviceInner {
                ordinal,
                cu_device,
                context,
                compute_capability: info.compute_capability,
                driver_version: env.driver_version,
            }),
        };
        device.bind_current()?;
        Ok(device)
    }

    /// Makes this device's primary context current on the calling thread.
    pub fn bind_current(&self) -> Result<(), DeviceError> {
        let ctx = self.inner.context;
        driver_call(
            "cuCtxSetCurrent",
            || format!("binding device {} to this thread", self.inner.ordinal),
            // SAFETY: symbol checked in open(); `ctx` is retained for as
            // long as `self.inner` lives.
            || unsafe { sys::cuCtxSetCurrent(ctx) },
        )
    }

    /// Driver ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    /// (major, minor) compute capability, e.g. (9, 0).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.compute_capability
    }

    /// `cuDriverGetVersion`'s value from the probe, e.g. 12080.
    pub fn driver_version(&self) -> i32 {
        self.inner.driver_version
    }

    pub(crate) fn cu_device(&self) -> sys::CUdevice {
        self.inner.cu_device
    }

    /// Binds the context before a destructor's driver call; a failure is
    /// logged (the call that follows will report its own error).
    pub(crate) fn bind_for_drop(&self) {
        if let Err(e) = self.bind_current() {
            log::warn!("{e}");
        }
    }

    /// Destroys event `raw` of this device in a destructor (`kind` names it
    /// in the log line of a failure).
    ///
    /// # Safety
    /// `raw` is a live event of this device's context that nothing uses or
    /// destroys afterwards.
    pub(crate) unsafe fn destroy_event_in_drop(&self, raw: sys::CUevent, kind: &str) {
        self.bind_for_drop();
        driver_call_in_drop(
            "cuEventDestroy_v2",
            || format!("destroying {kind} event on device {}", self.ordinal()),
            // SAFETY: forwarded to the caller: `raw` is live and destroyed once.
            || unsafe { sys::cuEventDestroy_v2(raw) },
        );
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        let ctx = self.context;
        let mut current: sys::CUcontext = std::ptr::null_mut();
        let got = driver_call(
            "cuCtxGetCurrent",
            || format!("checking the current context of device {}", self.ordinal),
            // SAFETY: symbols were checked before this value was built; the
            // out-pointer is a live local.
            || unsafe { sys::cuCtxGetCurrent(&mut current) },
        );
        if got.is_ok() && current == ctx {
            // Leave no dangling current context behind on this thread.
            driver_call_in_drop(
                "cuCtxSetCurrent",
                || format!("unbinding device {}", self.ordinal),
                // SAFETY: null is a valid argument (no current context).
                || unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) },
            );
        }
        let dev = self.cu_device;
        driver_call_in_drop(
            "cuDevicePrimaryCtxRelease_v2",
            || format!("releasing the primary context of device {}", self.ordinal),
            // SAFETY: releases the one retain taken in Device::open.
            || unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaDevice;

    #[test]
    fn driver_error_names_the_call_and_the_result() {
        let e = DeviceError::driver(
            "cuIpcOpenMemHandle_v2",
            sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            "opening an IPC memory handle on device 0",
        );
        let s = e.to_string();
        assert!(s.contains("cuIpcOpenMemHandle_v2"), "{s}");
        assert!(s.contains("CUDA_ERROR_INVALID_VALUE (1)"), "{s}");
        assert!(
            s.starts_with("opening an IPC memory handle on device 0"),
            "{s}"
        );
        assert_eq!(e.result(), Some(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
    }

    #[test]
    fn check_maps_success_and_failure() {
        assert!(check("cuX", sys::CUresult::CUDA_SUCCESS, || unreachable!()).is_ok());
        let e = check("cuX", sys::CUresult::CUDA_ERROR_NOT_READY, || {
            "doing".into()
        })
        .unwrap_err();
        assert_eq!(e.result(), Some(sys::CUresult::CUDA_ERROR_NOT_READY));
        assert!(e.to_string().contains("(600)"), "{e}");
    }

    #[test]
    fn a_panicking_call_becomes_an_error() {
        let e = driver_call(
            "cuFake",
            || "testing".into(),
            || panic!("Missing symbol cuFake"),
        )
        .unwrap_err();
        assert!(matches!(e.kind, DeviceErrorKind::Unavailable(_)), "{e}");
        assert!(e.to_string().contains("Missing symbol cuFake"), "{e}");
    }

    /// On a host without the driver (this build host), opening a device from
    /// a hand-made `CudaEnv` must be an error, never a panic; on a GPU host
    /// it opens device 0.
    #[test]
    fn open_without_driver_is_an_error() {
        let env = CudaEnv {
            driver_version: 12080,
            devices: vec![CudaDevice {
                ordinal: 0,
                uuid: "00000000-0000-0000-0000-000000000000".into(),
                name: "none".into(),
                compute_capability: (9, 0),
            }],
        };
        let missing = Device::open(&env, 7).unwrap_err();
        assert!(
            matches!(missing.kind, DeviceErrorKind::Invalid(_)),
            "{missing}"
        );
        match CudaEnv::probe() {
            Err(_) => {
                let e = Device::open(&env, 0).unwrap_err();
                assert!(matches!(e.kind, DeviceErrorKind::Unavailable(_)), "{e}");
                assert!(e.to_string().contains("opening CUDA device 0"), "{e}");
            }
            Ok(real) => {
                let d = Device::open(&real, 0).expect("device 0 opens");
                assert_eq!(d.ordinal(), 0);
                d.bind_current().expect("rebinding works");
            }
        }
    }
}
