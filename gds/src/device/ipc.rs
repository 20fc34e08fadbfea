//! Importing workers' GPU memory: legacy CUDA IPC handles (wire tags `cuda`
//! and `cuda_raw`) and VMM fabric handles (`cuda_vmm`, kind `fabric`).
//!
//! Several layers often sit in one allocation and arrive with the same
//! handle bytes, and a process may map one allocation only once (a single
//! `cuIpcCloseMemHandle` unmaps it for every user). So mappings live in a
//! [`MappingRegistry`] keyed by (device ordinal, handle bytes) with a
//! reference count: the first [`MappingRegistry::open`] maps, the last
//! [`MappingRegistry::release`] unmaps. The registry's bookkeeping is generic
//! over an [`IpcOpener`]; [`DriverIpcOpener`] is the one that calls CUDA.
//!
//! Unmap only after every stream that used the mapping is synchronized; the
//! registry cannot know that, its owner (the instance teardown) does.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::fmt;

use cudarc::driver::sys;

use super::{driver_call, require_symbols, Device, DeviceError};

/// Bytes of a `cudaIpcMemHandle_t` / `CUipcMemHandle`.
pub const IPC_MEM_HANDLE_BYTES: usize = 64;

/// Bytes of a `CUmemFabricHandle`.
pub const FABRIC_HANDLE_BYTES: usize = 64;

/// Default bound on distinct live mappings per registry (one per worker
/// allocation; a model has at most a few hundred layers per instance).
pub const DEFAULT_MAX_MAPPINGS: usize = 4096;

/// `CU_MEM_HANDLE_TYPE_FABRIC` appeared in CUDA 12.3.
pub const VMM_MIN_DRIVER_VERSION: i32 = 12030;

/// Entry points of the fabric import, checked on first use (not all
/// drivers export them).
pub const VMM_SYMBOLS: [&str; 7] = [
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemRelease",
];

fn short_hex(bytes: &[u8]) -> String {
    bytes.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

fn exact_64(bytes: &[u8], what: &str) -> Result<[u8; 64], DeviceError> {
    <[u8; 64]>::try_from(bytes).map_err(|_| {
        DeviceError::invalid(
            format!("{what} must be exactly 64 bytes, got {}", bytes.len()),
            format!("parsing a {what}"),
        )
    })
}

/// The 64 bytes of a `cudaIpcMemHandle_t`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; IPC_MEM_HANDLE_BYTES]);

impl IpcMemHandle {
    /// Takes exactly 64 bytes; any other length is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DeviceError> {
        exact_64(bytes, "CUDA IPC memory handle").map(Self)
    }
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcMemHandle({}..)", short_hex(&self.0))
    }
}

/// The 64 bytes of a `CUmemFabricHandle`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricHandle(pub [u8; FABRIC_HANDLE_BYTES]);

impl FabricHandle {
    /// Takes exactly 64 bytes; any other length is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DeviceError> {
        exact_64(bytes, "CUDA fabric handle").map(Self)
    }
}

impl fmt::Debug for FabricHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FabricHandle({}..)", short_hex(&self.0))
    }
}

/// Where an allocation comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemSource {
    /// Legacy IPC handle of a cudaMalloc'd allocation base (`cuda`, `cuda_raw`).
    Ipc(IpcMemHandle),
    /// VMM fabric handle of a physical chunk of `alloc_size` bytes (`cuda_vmm`).
    Fabric {
        handle: FabricHandle,
        alloc_size: u64,
    },
}

/// Identifies one mapping: the allocation and the local device it is mapped on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MappingKey {
    pub ordinal: u32,
    pub source: MemSource,
}

impl MappingKey {
    pub fn ipc(ordinal: u32, handle: IpcMemHandle) -> Self {
        Self {
            ordinal,
            source: MemSource::Ipc(handle),
        }
    }

    pub fn fabric(ordinal: u32, handle: FabricHandle, alloc_size: u64) -> Self {
        Self {
            ordinal,
            source: MemSource::Fabric { handle, alloc_size },
        }
    }
}

/// A mapped allocation: device address of its first byte and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub base: u64,
    pub len: u64,
}

/// A byte range inside a mapping, as one registered tensor uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRange {
    pub key: MappingKey,
    /// The mapping's base address.
    pub base: u64,
    /// Device address of the range's first byte (`base + offset`).
    pub ptr: u64,
    pub len: u64,
}

/// What a release did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// Other users remain; `refs` references are left.
    Shared { refs: u32 },
    /// That was the last reference; the mapping is closed.
    Closed,
}

/// Maps and unmaps one allocation. Implemented by [`DriverIpcOpener`] and,
/// in tests, by a recording fake.
pub trait IpcOpener {
    /// Maps the allocation `key` names. On error nothing stays mapped.
    fn open(&mut self, key: &MappingKey) -> Result<Mapping, DeviceError>;
    /// Unmaps what `open` returned for `key`; called once per successful open.
    fn close(&mut self, key: &MappingKey, mapping: Mapping) -> Result<(), DeviceError>;
}

struct Entry {
    mapping: Mapping,
    refs: u32,
}

/// Refcounted, deduplicating registry of mapped allocations; bounded to
/// `max_mappings` distinct mappings.
pub struct MappingRegistry<O: IpcOpener> {
    opener: O,
    entries: HashMap<MappingKey, Entry>,
    max_mappings: usize,
}

impl<O: IpcOpener> MappingRegistry<O> {
    pub fn new(opener: O) -> Self {
        Self::with_max_mappings(opener, DEFAULT_MAX_MAPPINGS)
    }

    pub fn with_max_mappings(opener: O, max_mappings: usize) -> Self {
        assert!(max_mappings > 0, "a registry must allow one mapping");
        Self {
            opener,
            entries: HashMap::new(),
            max_mappings,
        }
    }

    /// Takes one reference to the mapping of `key`, mapping it on first use.
    pub fn open(&mut self, key: &MappingKey) -> Result<Mapping, DeviceError> {
        if let Some(e) = self.entries.get_mut(key) {
            e.refs = e.refs.checked_add(1).ok_or_else(|| {
                DeviceError::invalid("reference count would overflow", format!("opening {key:?}"))
            })?;
            return Ok(e.mapping);
        }
        if self.entries.len() >= self.max_mappings {
            return Err(DeviceError::invalid(
                format!(
                    "the registry already holds its limit of {} mappings",
                    self.max_mappings
                ),
                format!("opening {key:?}"),
            ));
        }
        let mapping = self.opener.open(key)?;
        assert!(
            mapping.base != 0 && mapping.len > 0 && mapping.base.checked_add(mapping.len).is_some(),
            "opener returned a bad mapping {mapping:?} for {key:?}"
        );
        self.entries.insert(*key, Entry { mapping, refs: 1 });
        Ok(mapping)
    }

    /// Takes one reference and returns the range `[offset, offset + len)` of
    /// the mapping. A range outside the mapping is refused and the reference
    /// is given back (so a first use that fails leaves nothing mapped).
    ///
    /// For `cuda_raw`, `offset` is `alloc_offset` and `len` is `nbytes`; for
    /// `cuda`, the storage offset `handle[3]` and size `handle[2]`.
    pub fn open_range(
        &mut self,
        key: &MappingKey,
        offset: u64,
        len: u64,
    ) -> Result<MappedRange, DeviceError> {
        let mapping = self.open(key)?;
        match offset.checked_add(len) {
            Some(end) if end <= mapping.len => Ok(MappedRange {
                key: *key,
                base: mapping.base,
                ptr: mapping.base + offset,
                len,
            }),
            _ => {
                let err = DeviceError::invalid(
                    format!(
                        "range at offset {offset} of {len} bytes is outside the {} byte allocation",
                        mapping.len
                    ),
                    format!("opening {key:?}"),
                );
                if let Err(e) = self.release(key) {
                    log::warn!("{e}");
                }
                Err(err)
            }
        }
    }

    /// Gives back one reference; the last one closes the mapping. An unknown
    /// key is an error. When closing fails the entry is dropped anyway (the
    /// driver state is unknown and a retry would double-close).
    pub fn release(&mut self, key: &MappingKey) -> Result<Released, DeviceError> {
        let Some(entry) = self.entries.get_mut(key) else {
            return Err(DeviceError::invalid(
                "no open mapping for this key",
                format!("releasing {key:?}"),
            ));
        };
        assert!(entry.refs > 0, "live mapping entry with no references");
        entry.refs -= 1;
        if entry.refs > 0 {
            return Ok(Released::Shared { refs: entry.refs });
        }
        let entry = self.entries.remove(key).expect("entry just found");
        self.opener.close(key, entry.mapping)?;
        Ok(Released::Closed)
    }

    /// References held on `key` (0 when not mapped).
    pub fn refs(&self, key: &MappingKey) -> u32 {
        self.entries.get(key).map_or(0, |e| e.refs)
    }

    /// Distinct live mappings.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn opener(&self) -> &O {
        &self.opener
    }

    /// Closes every mapping regardless of references (teardown after the
    /// streams are synchronized); returns the close errors.
    pub fn close_all(&mut self) -> Vec<DeviceError> {
        let mut errors = Vec::new();
        for (key, entry) in std::mem::take(&mut self.entries) {
            if let Err(e) = self.opener.close(&key, entry.mapping) {
                errors.push(e);
            }
        }
        errors
    }
}

impl<O: IpcOpener> Drop for MappingRegistry<O> {
    fn drop(&mut self) {
        if !self.entries.is_empty() {
            log::warn!(
                "IPC registry dropped with {} mapping(s) still open; closing them",
                self.entries.len()
            );
        }
        for e in self.close_all() {
            log::warn!("{e}");
        }
    }
}

/// The [`IpcOpener`] that maps through the CUDA driver on one device.
pub struct DriverIpcOpener {
    device: Device,
}

impl DriverIpcOpener {
    pub fn new(device: Device) -> Self {
        Self { device }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn open_ipc(&self, handle: &IpcMemHandle, doing: &str) -> Result<Mapping, DeviceError> {
        let raw = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as c_char),
        };
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        let mut base: sys::CUdeviceptr = 0;
        driver_call(
            "cuIpcOpenMemHandle_v2",
            || doing.to_string(),
            // SAFETY: symbol checked in Device::open; the handle is passed by
            // value; the out-pointer is a live local.
            || unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags) },
        )?;
        let close = |why: DeviceError| {
            super::driver_call_in_drop(
                "cuIpcCloseMemHandle",
                || format!("{doing} (undoing after: {why})"),
                // SAFETY: `base` was just returned by cuIpcOpenMemHandle_v2.
                || unsafe { sys::cuIpcCloseMemHandle(base) },
            );
            why
        };
        let (mut range_base, mut range_len): (sys::CUdeviceptr, usize) = (0, 0);
        driver_call(
            "cuMemGetAddressRange_v2",
            || format!("{doing}: sizing the opened allocation"),
            // SAFETY: symbol checked; `base` is a mapped device address;
            // both out-pointers are live locals.
            || unsafe { sys::cuMemGetAddressRange_v2(&mut range_base, &mut range_len, base) },
        )
        .map_err(close)?;
        let end = range_base.checked_add(range_len as u64);
        match end {
            Some(end) if base != 0 && range_base <= base && base < end => Ok(Mapping {
                base,
                len: end - base,
            }),
            _ => Err(close(DeviceError::invalid(
                format!(
                    "the driver mapped the allocation at {base:#x} but reports the range \
                     {range_base:#x}+{range_len}"
                ),
                doing,
            ))),
        }
    }

    fn import_fabric(
        &self,
        handle: &FabricHandle,
        alloc_size: u64,
        doing: &str,
    ) -> Result<Mapping, DeviceError> {
        let version = self.device.driver_version();
        if version < VMM_MIN_DRIVER_VERSION {
            return Err(DeviceError::unavailable(
                format!(
                    "fabric handles need a CUDA 12.3 or newer driver; this one is {}.{}",
                    version / 1000,
                    (version % 1000) / 10
                ),
                doing,
            ));
        }
        require_symbols(&VMM_SYMBOLS, doing)?;
        let mut supported: c_int = 0;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED;
        let dev = self.device.cu_device();
        driver_call(
            "cuDeviceGetAttribute",
            || format!("{doing}: asking for fabric handle support"),
            // SAFETY: symbol checked in Device::open; out-pointer is a local.
            || unsafe { sys::cuDeviceGetAttribute(&mut supported, attr, dev) },
        )?;
        if supported == 0 {
            return Err(DeviceError::unavailable(
                "this device does not support fabric handles (needs an IMEX-provisioned \
                 NVLink system); use the cuda or cuda_raw transfer instead",
                doing,
            ));
        }
        let size = usize::try_from(alloc_size)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| {
                DeviceError::invalid(format!("bad allocation size {alloc_size}"), doing)
            })?;

        let mut fabric = sys::CUmemFabricHandle { data: handle.0 };
        let mut alloc: sys::CUmemGenericAllocationHandle = 0;
        driver_call(
            "cuMemImportFromShareableHandle",
            || doing.to_string(),
            // SAFETY: symbols checked above; for the fabric type the OS
            // handle argument is a pointer to a CUmemFabricHandle, which
            // `fabric` is and which outlives the call.
            || unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut alloc,
                    (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                )
            },
        )?;
        let release_alloc = || {
            super::driver_call_in_drop(
                "cuMemRelease",
                || format!("{doing}: releasing the imported allocation handle"),
                // SAFETY: `alloc` came from the import above, released once.
                || unsafe { sys::cuMemRelease(alloc) },
            );
        };

        let mut base: sys::CUdeviceptr = 0;
        if let Err(e) = driver_call(
            "cuMemAddressReserve",
            || format!("{doing}: reserving {size} bytes of address space"),
            // SAFETY: out-pointer is a local; alignment 0 and address 0 ask
            // for the defaults; flags must be 0.
            || unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) },
        ) {
            release_alloc();
            return Err(e);
        }
        let free_va = || {
            super::driver_call_in_drop(
                "cuMemAddressFree",
                || format!("{doing}: freeing the reserved address space"),
                // SAFETY: the range was reserved above with this size.
                || unsafe { sys::cuMemAddressFree(base, size) },
            );
        };
        if let Err(e) = driver_call(
            "cuMemMap",
            || format!("{doing}: mapping {size} bytes"),
            // SAFETY: [base, base+size) is our reservation; offset 0 into
            // the imported allocation; flags must be 0.
            || unsafe { sys::cuMemMap(base, size, 0, alloc, 0) },
        ) {
            free_va();
            release_alloc();
            return Err(e);
        }
        let ordinal = c_int::try_from(self.device.ordinal()).unwrap_or(c_int::MAX);
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        if let Err(e) = driver_call(
            "cuMemSetAccess",
            || format!("{doing}: granting device {ordinal} read/write access"),
            // SAFETY: the range is mapped above; one descriptor, alive for
            // the call.
            || unsafe { sys::cuMemSetAccess(base, size, &desc, 1) },
        ) {
            super::driver_call_in_drop(
                "cuMemUnmap",
                || format!("{doing}: unmapping after a failed access grant"),
                // SAFETY: the range was mapped above.
                || unsafe { sys::cuMemUnmap(base, size) },
            );
            free_va();
            release_alloc();
            return Err(e);
        }
        // The mapping keeps the physical memory alive; the handle itself is
        // no longer needed (memory is freed once unmapped and released).
        release_alloc();
        Ok(Mapping {
            base,
            len: alloc_size,
        })
    }
}

impl IpcOpener for DriverIpcOpener {
    fn open(&mut self, key: &MappingKey) -> Result<Mapping, DeviceError> {
        let doing = match key.source {
            MemSource::Ipc(h) => format!("opening {h:?} on device {}", key.ordinal),
            MemSource::Fabric { handle, alloc_size } => format!(
                "importing {handle:?} ({alloc_size} bytes) on device {}",
                key.ordinal
            ),
        };
        if key.ordinal != self.device.ordinal() {
            return Err(DeviceError::invalid(
                format!("this opener maps on device {}", self.device.ordinal()),
                doing,
            ));
        }
        self.device.bind_current()?;
        match key.source {
            MemSource::Ipc(h) => self.open_ipc(&h, &doing),
            MemSource::Fabric { handle, alloc_size } => {
                self.import_fabric(&handle, alloc_size, &doing)
            }
        }
    }

    fn close(&mut self, key: &MappingKey, mapping: Mapping) -> Result<(), DeviceError> {
        let doing = || format!("closing {key:?} at {:#x}", mapping.base);
        self.device.bind_current()?;
        match key.source {
            MemSource::Ipc(_) => driver_call(
                "cuIpcCloseMemHandle",
                doing,
                // SAFETY: `mapping.base` came from cuIpcOpenMemHandle_v2 and
                // the registry closes each mapping exactly once.
                || unsafe { sys::cuIpcCloseMemHandle(mapping.base) },
            ),
            MemSource::Fabric { .. } => {
                let size = usize::try_from(mapping.len).expect("mapped length fits usize");
                let unmapped = driver_call(
                    "cuMemUnmap",
                    doing,
                    // SAFETY: the range was mapped by import_fabric with this
                    // size and is unmapped once.
                    || unsafe { sys::cuMemUnmap(mapping.base, size) },
                );
                let freed = driver_call(
                    "cuMemAddressFree",
                    doing,
                    // SAFETY: the reservation made by import_fabric.
                    || unsafe { sys::cuMemAddressFree(mapping.base, size) },
                );
                unmapped.and(freed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::DeviceErrorKind;
    use super::*;

    /// Records every open and close. It stands in for [`DriverIpcOpener`]
    /// because the build host has no GPU; the registry logic under test is
    /// the same for both.
    #[derive(Default)]
    struct RecordingOpener {
        opens: Vec<MappingKey>,
        closes: Vec<(MappingKey, Mapping)>,
        fail_next_open: bool,
        fail_closes: bool,
        next_base: u64,
    }

    const ALLOC_LEN: u64 = 1 << 20;

    impl IpcOpener for RecordingOpener {
        fn open(&mut self, key: &MappingKey) -> Result<Mapping, DeviceError> {
            self.opens.push(*key);
            if std::mem::take(&mut self.fail_next_open) {
                return Err(DeviceError::driver(
                    "cuIpcOpenMemHandle_v2",
                    sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
                    "fake open",
                ));
            }
            self.next_base += 0x1000_0000;
            Ok(Mapping {
                base: self.next_base,
                len: ALLOC_LEN,
            })
        }

        fn close(&mut self, key: &MappingKey, mapping: Mapping) -> Result<(), DeviceError> {
            self.closes.push((*key, mapping));
            if self.fail_closes {
                return Err(DeviceError::driver(
                    "cuIpcCloseMemHandle",
                    sys::CUresult::CUDA_ERROR_INVALID_VALUE,
                    "fake close",
                ));
            }
            Ok(())
        }
    }

    fn key(byte: u8) -> MappingKey {
        MappingKey::ipc(0, IpcMemHandle([byte; 64]))
    }

    fn registry() -> MappingRegistry<RecordingOpener> {
        MappingRegistry::new(RecordingOpener::default())
    }

    #[test]
    fn handles_must_be_64_bytes() {
        for n in [0, 63, 65, 66] {
            let e = IpcMemHandle::from_bytes(&vec![1; n]).unwrap_err();
            assert!(e.to_string().contains(&format!("got {n}")), "{e}");
            assert!(FabricHandle::from_bytes(&vec![1; n]).is_err());
        }
        assert_eq!(IpcMemHandle::from_bytes(&[7; 64]).unwrap().0, [7; 64]);
        assert_eq!(FabricHandle::from_bytes(&[7; 64]).unwrap().0, [7; 64]);
    }

    #[test]
    fn layers_sharing_a_handle_map_once_and_close_once() {
        let mut r = registry();
        let k = key(1);
        let a = r.open(&k).unwrap();
        let b = r.open_range(&k, 4096, 8192).unwrap();
        let c = r.open_range(&k, 0, ALLOC_LEN).unwrap();
        assert_eq!(r.opener().opens, vec![k]);
        assert_eq!((b.base, b.ptr, b.len), (a.base, a.base + 4096, 8192));
        assert_eq!(c.ptr, a.base);
        assert_eq!(r.refs(&k), 3);
        assert_eq!(r.release(&k), Ok(Released::Shared { refs: 2 }));
        assert_eq!(r.release(&k), Ok(Released::Shared { refs: 1 }));
        assert!(r.opener().closes.is_empty());
        assert_eq!(r.release(&k), Ok(Released::Closed));
        assert_eq!(r.opener().closes, vec![(k, a)]);
        assert!(r.is_empty());
        // Reopening after the close maps again.
        r.open(&k).unwrap();
        assert_eq!(r.opener().opens.len(), 2);
    }

    #[test]
    fn distinct_handles_and_devices_map_separately() {
        let mut r = registry();
        let k1 = key(1);
        let k2 = key(2);
        let k1_dev1 = MappingKey::ipc(1, IpcMemHandle([1; 64]));
        let fab = MappingKey::fabric(0, FabricHandle([1; 64]), ALLOC_LEN);
        let bases: Vec<u64> = [k1, k2, k1_dev1, fab]
            .iter()
            .map(|k| r.open(k).unwrap().base)
            .collect();
        assert_eq!(r.len(), 4);
        let mut unique = bases.clone();
        unique.dedup();
        assert_eq!(unique, bases);
        assert_eq!(r.release(&k2), Ok(Released::Closed));
        assert_eq!(r.refs(&k1), 1);
    }

    #[test]
    fn a_failed_open_leaves_nothing_behind() {
        let mut r = registry();
        let k = key(3);
        r.opener.fail_next_open = true;
        let e = r.open(&k).unwrap_err();
        assert_eq!(e.result(), Some(sys::CUresult::CUDA_ERROR_INVALID_HANDLE));
        assert!(r.is_empty());
        assert_eq!(r.refs(&k), 0);
        assert!(r.release(&k).is_err());
        assert!(r.opener().closes.is_empty());
        // The next try opens afresh.
        r.open(&k).unwrap();
        assert_eq!(r.opener().opens, vec![k, k]);
        assert_eq!(r.refs(&k), 1);
    }

    #[test]
    fn releasing_an_unknown_mapping_is_an_error() {
        let mut r = registry();
        let e = r.release(&key(9)).unwrap_err();
        assert!(matches!(e.kind, DeviceErrorKind::Invalid(_)), "{e}");
        assert!(e.to_string().contains("no open mapping"), "{e}");
        // Over-release after close too.
        r.open(&key(9)).unwrap();
        r.release(&key(9)).unwrap();
        assert!(r.release(&key(9)).is_err());
        assert_eq!(r.opener().closes.len(), 1);
    }

    #[test]
    fn out_of_range_is_refused_and_gives_the_reference_back() {
        let mut r = registry();
        let k = key(4);
        // Exactly at the end is fine (and a zero-length range at the end).
        r.open_range(&k, ALLOC_LEN - 16, 16).unwrap();
        r.open_range(&k, ALLOC_LEN, 0).unwrap();
        assert_eq!(r.refs(&k), 2);
        for (off, len) in [
            (ALLOC_LEN - 16, 17),
            (ALLOC_LEN + 1, 0),
            (u64::MAX, 2),
            (1, u64::MAX),
        ] {
            let e = r.open_range(&k, off, len).unwrap_err();
            assert!(e.to_string().contains("outside"), "{e}");
            assert_eq!(r.refs(&k), 2, "({off}, {len}) leaked a reference");
        }
        assert!(r.opener().closes.is_empty());
        // On first use, a refused range closes the mapping again.
        let k2 = key(5);
        assert!(r.open_range(&k2, 0, ALLOC_LEN + 1).is_err());
        assert_eq!(r.refs(&k2), 0);
        assert_eq!(r.opener().closes.len(), 1);
        assert_eq!(r.opener().closes[0].0, k2);
    }

    #[test]
    fn a_failed_close_still_forgets_the_mapping() {
        let mut r = registry();
        let k = key(6);
        r.open(&k).unwrap();
        r.opener.fail_closes = true;
        let e = r.release(&k).unwrap_err();
        assert_eq!(e.result(), Some(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        assert!(r.is_empty());
        assert_eq!(r.opener().closes.len(), 1);
    }

    #[test]
    fn the_mapping_limit_is_an_error_without_an_open() {
        let mut r = MappingRegistry::with_max_mappings(RecordingOpener::default(), 2);
        r.open(&key(1)).unwrap();
        r.open(&key(2)).unwrap();
        let e = r.open(&key(3)).unwrap_err();
        assert!(e.to_string().contains("limit of 2"), "{e}");
        assert_eq!(r.opener().opens.len(), 2);
        // More references to a live mapping are still fine.
        r.open(&key(1)).unwrap();
        assert_eq!(r.refs(&key(1)), 2);
    }

    #[test]
    fn close_all_closes_every_mapping_once() {
        let mut r = registry();
        r.open(&key(1)).unwrap();
        r.open(&key(1)).unwrap();
        r.open(&key(2)).unwrap();
        assert!(r.close_all().is_empty());
        assert_eq!(r.opener().closes.len(), 2);
        assert!(r.is_empty());
        assert!(r.close_all().is_empty());
        assert_eq!(r.opener().closes.len(), 2);
    }
}
