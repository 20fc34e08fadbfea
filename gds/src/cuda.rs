//! CUDA driver probe: is there a usable driver, and which GPUs does it see?
//!
//! The driver (`libcuda.so.1`) is loaded at run time through cudarc's
//! dynamically loaded bindings. Those bindings panic when the library or a
//! symbol is missing, so the probe first asks whether the library can be
//! opened and whether each symbol it needs exists, and also runs every
//! lookup under `catch_unwind` as a second guard. A host without the driver
//! or without a GPU gets a [`CudaUnavailable`] with the reason.

use std::ffi::{c_char, c_int, CStr};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys;

/// Driver entry points the probe calls; all must exist before any is used.
const PROBE_SYMBOLS: [&str; 7] = [
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGetUuid_v2",
];

/// One GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    /// Driver ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    /// UUID as torch prints it: lowercase 8-4-4-4-12 hex, no `GPU-` prefix.
    pub uuid: String,
    pub name: String,
    /// (major, minor) compute capability, e.g. (9, 0) for an H100.
    pub compute_capability: (u32, u32),
}

/// A working CUDA driver with at least one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaEnv {
    /// `cuDriverGetVersion`'s value, e.g. 12080 for 12.8.
    pub driver_version: i32,
    pub devices: Vec<CudaDevice>,
}

/// Why CUDA cannot be used on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaUnavailable {
    pub reason: String,
}

impl fmt::Display for CudaUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CUDA unavailable: {}", self.reason)
    }
}

impl std::error::Error for CudaUnavailable {}

fn unavailable(reason: impl Into<String>) -> CudaUnavailable {
    CudaUnavailable {
        reason: reason.into(),
    }
}

/// Formats a CUDA UUID as torch does: lowercase 8-4-4-4-12 hex.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let mut s = String::with_capacity(36);
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Runs `f` and turns a panic from cudarc's loader into a reason.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, CudaUnavailable> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("panic");
        unavailable(format!("{what}: {msg}"))
    })
}

fn check(what: &str, rc: sys::CUresult) -> Result<(), CudaUnavailable> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(unavailable(format!("{what} failed: {rc:?}")))
    }
}

impl CudaEnv {
    /// Loads the driver, initialises it and lists the visible devices.
    /// Never panics; every failure is a reason.
    pub fn probe() -> Result<CudaEnv, CudaUnavailable> {
        // SAFETY: only tries to dlopen the candidate driver library names.
        let present = guarded("probing libcuda", || unsafe { sys::is_culib_present() })?;
        if !present {
            return Err(unavailable(
                "libcuda.so.1 not found (is the NVIDIA driver installed?)",
            ));
        }
        for name in PROBE_SYMBOLS {
            // SAFETY: culib() opens the library just found present; the
            // symbol is only looked up, never called through this type.
            let found = guarded("loading libcuda", || unsafe {
                sys::culib()
                    .get::<unsafe extern "C" fn()>(name.as_bytes())
                    .is_ok()
            })?;
            if !found {
                return Err(unavailable(format!(
                    "libcuda lacks {name} (driver too old for CUDA 12)"
                )));
            }
        }

        // SAFETY (this block and the calls below): every symbol used was
        // found above, so cudarc's lazy lookups cannot panic; each call gets
        // valid out-pointers of the C types it declares.
        check("cuInit", guarded("cuInit", || unsafe { sys::cuInit(0) })?)?;
        let mut version: c_int = 0;
        check(
            "cuDriverGetVersion",
            guarded("cuDriverGetVersion", || unsafe {
                sys::cuDriverGetVersion(&mut version)
            })?,
        )?;
        let mut count: c_int = 0;
        check(
            "cuDeviceGetCount",
            guarded("cuDeviceGetCount", || unsafe {
                sys::cuDeviceGetCount(&mut count)
            })?,
        )?;
        if count <= 0 {
            return Err(unavailable(format!(
                "the driver (version {version}) sees no CUDA devices"
            )));
        }
        let mut devices = Vec::with_capacity(count as usize);
        for ordinal in 0..count {
            devices.push(probe_device(ordinal)?);
        }
        Ok(CudaEnv {
            driver_version: version,
            devices,
        })
    }

    /// The driver version as "major.minor".
    pub fn driver_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

fn probe_device(ordinal: c_int) -> Result<CudaDevice, CudaUnavailable> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: symbols checked in probe(); out-pointers are valid locals.
    check(
        "cuDeviceGet",
        guarded("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?,
    )?;

    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: as above; CUuuid is 16 bytes.
    check(
        "cuDeviceGetUuid_v2",
        guarded("cuDeviceGetUuid_v2", || unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, dev)
        })?,
    )?;
    let uuid_bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);

    let mut name_buf: [c_char; 256] = [0; 256];
    // SAFETY: as above; the driver writes at most `len` bytes, NUL included.
    check(
        "cuDeviceGetName",
        guarded("cuDeviceGetName", || unsafe {
            sys::cuDeviceGetName(name_buf.as_mut_ptr(), name_buf.len() as c_int, dev)
        })?,
    )?;
    name_buf[name_buf.len() - 1] = 0;
    // SAFETY: the buffer is NUL-terminated (forced above).
    let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();

    let attr = |a: sys::CUdevice_attribute, what: &str| -> Result<u32, CudaUnavailable> {
        let mut v: c_int = 0;
        // SAFETY: as above.
        check(
            what,
            guarded(what, || unsafe {
                sys::cuDeviceGetAttribute(&mut v, a, dev)
            })?,
        )?;
        Ok(v.max(0) as u32)
    };
    let major = attr(
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)",
    )?;
    let minor = attr(
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)",
    )?;
    Ok(CudaDevice {
        ordinal: ordinal as u32,
        uuid: format_uuid(&uuid_bytes),
        name,
        compute_capability: (major, minor),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_formats_like_torch() {
        let bytes = [
            0x5a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71, 0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7,
            0xe8, 0xf9,
        ];
        assert_eq!(format_uuid(&bytes), "5a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9");
        assert_eq!(
            format_uuid(&[0; 16]),
            "00000000-0000-0000-0000-000000000000"
        );
    }

    /// Passes on both kinds of host: without a driver or GPU the probe must
    /// return a reason (and not panic); with one it must list devices.
    #[test]
    fn probe_reports_devices_or_a_reason() {
        match CudaEnv::probe() {
            Err(e) => {
                assert!(!e.reason.is_empty());
                eprintln!("no CUDA here: {e}");
                assert!(
                    std::env::var("KVSHARD_REQUIRE_CUDA").as_deref() != Ok("1"),
                    "KVSHARD_REQUIRE_CUDA=1 but {e}"
                );
            }
            Ok(env) => {
                assert!(!env.devices.is_empty());
                assert!(env.driver_version >= 11040, "{}", env.driver_version);
                for (i, d) in env.devices.iter().enumerate() {
                    assert_eq!(d.ordinal as usize, i);
                    let groups: Vec<usize> = d.uuid.split('-').map(str::len).collect();
                    assert_eq!(groups, [8, 4, 4, 4, 12], "{}", d.uuid);
                    assert!(d
                        .uuid
                        .chars()
                        .all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c)));
                    assert!(!d.name.is_empty());
                    assert!(d.compute_capability.0 >= 3, "{:?}", d.compute_capability);
                }
                // A second probe sees the same devices.
                assert_eq!(CudaEnv::probe().as_ref(), Ok(&env));
            }
        }
    }

    #[test]
    fn driver_version_string() {
        let env = CudaEnv {
            driver_version: 12080,
            devices: Vec::new(),
        };
        assert_eq!(env.driver_version_string(), "12.8");
    }
}
