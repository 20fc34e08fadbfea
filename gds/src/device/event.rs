//! Interprocess events: waiting on a worker's event, exporting our own.
//!
//! A worker sends, with every STORE/RETRIEVE, the 64-byte
//! `cudaIpcEventHandle_t` of an event recorded after the work the copy must
//! follow; [`ImportedEvent`] opens it and makes the instance stream wait on
//! it. The reply carries the handle of a server event recorded after the
//! copies; [`ExportRing`] creates those (`DISABLE_TIMING | INTERPROCESS`)
//! and keeps the last N alive, as 0.5.6 keeps 2048 exports alive so a worker
//! can still open a handle it received a while ago. Once the ring is full
//! the oldest event is recorded again (its previous record must have
//! completed). The ring's slot logic ([`RingSlots`]) is generic so it is
//! tested without a GPU.

use std::ffi::{c_char, c_uint};
use std::fmt;

use cudarc::driver::sys;

use super::exec::{query_outcome, Stream};
use super::{driver_call, guarded_call, Device, DeviceError};

/// Bytes of a `cudaIpcEventHandle_t` / `CUipcEventHandle`.
pub const IPC_EVENT_HANDLE_BYTES: usize = 64;

/// Exported events kept alive per ring, as in lmcache 0.5.6.
pub const DEFAULT_EXPORT_RING: usize = 2048;

/// The 64 bytes of a `cudaIpcEventHandle_t`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle(pub [u8; IPC_EVENT_HANDLE_BYTES]);

impl IpcEventHandle {
    /// Takes exactly 64 bytes; any other length is an error (an 81-byte
    /// handle is a timeline-semaphore handle from an `isolated_ipc` worker).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DeviceError> {
        <[u8; IPC_EVENT_HANDLE_BYTES]>::try_from(bytes)
            .map(Self)
            .map_err(|_| {
                let hint = if bytes.len() == 81 {
                    " (81 bytes is the isolated_ipc timeline-semaphore form)"
                } else {
                    ""
                };
                DeviceError::invalid(
                    format!(
                        "a CUDA IPC event handle is exactly 64 bytes, got {}{hint}",
                        bytes.len()
                    ),
                    "parsing a worker event handle",
                )
            })
    }

    pub fn as_bytes(&self) -> &[u8; IPC_EVENT_HANDLE_BYTES] {
        &self.0
    }

    fn to_raw(self) -> sys::CUipcEventHandle {
        sys::CUipcEventHandle {
            reserved: self.0.map(|b| b as c_char),
        }
    }

    fn from_raw(raw: &sys::CUipcEventHandle) -> Self {
        Self(raw.reserved.map(|c| c as u8))
    }
}

impl fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: String = self.0.iter().take(8).map(|b| format!("{b:02x}")).collect();
        write!(f, "IpcEventHandle({head}..)")
    }
}

/// A worker's event opened in this process; destroyed on drop. Dropping it
/// after [`ImportedEvent::wait_on`] is allowed by CUDA (the wait is already
/// enqueued), but keeping it until the op completes is the conservative
/// order lmcache uses.
pub struct ImportedEvent {
    device: Device,
    raw: sys::CUevent,
}

impl ImportedEvent {
    /// Opens a worker's exported event (`cuIpcOpenEventHandle`).
    pub fn import(device: &Device, handle: &IpcEventHandle) -> Result<Self, DeviceError> {
        device.bind_current()?;
        let raw_handle = handle.to_raw();
        let mut raw: sys::CUevent = std::ptr::null_mut();
        driver_call(
            "cuIpcOpenEventHandle",
            || format!("opening worker {handle:?} on device {}", device.ordinal()),
            // SAFETY: symbol checked in Device::open; handle by value; the
            // out-pointer is a live local.
            || unsafe { sys::cuIpcOpenEventHandle(&mut raw, raw_handle) },
        )?;
        assert!(!raw.is_null(), "cuIpcOpenEventHandle gave a null event");
        Ok(Self {
            device: device.clone(),
            raw,
        })
    }

    /// Makes `stream` wait (on the device) until the worker's event fires.
    pub fn wait_on(&self, stream: &Stream) -> Result<(), DeviceError> {
        let (s, e) = (stream.raw(), self.raw);
        driver_call(
            "cuStreamWaitEvent",
            || {
                format!(
                    "making a stream on device {} wait on a worker event",
                    self.device.ordinal()
                )
            },
            // SAFETY: both handles are live (owned by `stream` and `self`);
            // flags must be 0.
            || unsafe { sys::cuStreamWaitEvent(s, e, 0) },
        )
    }
}

impl Drop for ImportedEvent {
    fn drop(&mut self) {
        // SAFETY: `raw` came from cuIpcOpenEventHandle and is destroyed once, here.
        unsafe { self.device.destroy_event_in_drop(self.raw, "an imported") };
    }
}

/// Counters of a [`RingSlots`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingStats {
    pub created: u64,
    pub reused: u64,
    /// Claims refused because the oldest slot was still busy.
    pub refused_busy: u64,
}

/// A fixed-capacity ring of reusable slots: filled by creating values, then
/// the oldest is handed out again, but only once it is idle.
pub struct RingSlots<T> {
    slots: Vec<T>,
    capacity: usize,
    /// When full: the index of the oldest slot, the next to reuse.
    next: usize,
    stats: RingStats,
}

impl<T> RingSlots<T> {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "a ring needs at least one slot");
        Self {
            slots: Vec::new(),
            capacity,
            next: 0,
            stats: RingStats::default(),
        }
    }

    /// Returns a slot to use now: a new value from `create` while the ring
    /// is filling, then the oldest value if `is_idle` says so. A busy oldest
    /// slot is an error and changes nothing (the next claim asks again). A
    /// failed `create` adds nothing.
    pub fn claim(
        &mut self,
        create: impl FnOnce() -> Result<T, DeviceError>,
        is_idle: impl FnOnce(&T) -> Result<bool, DeviceError>,
    ) -> Result<(usize, &mut T), DeviceError> {
        if self.slots.len() < self.capacity {
            assert_eq!(self.next, 0, "the ring reuses slots only once full");
            let value = create()?;
            self.slots.push(value);
            self.stats.created += 1;
            let index = self.slots.len() - 1;
            return Ok((index, &mut self.slots[index]));
        }
        assert!(self.next < self.capacity);
        let index = self.next;
        if !is_idle(&self.slots[index])? {
            self.stats.refused_busy += 1;
            return Err(DeviceError::invalid(
                format!(
                    "all {} exported events are in use: the oldest has not completed",
                    self.capacity
                ),
                "claiming an export event",
            ));
        }
        self.next = (index + 1) % self.capacity;
        self.stats.reused += 1;
        Ok((index, &mut self.slots[index]))
    }

    /// Values created so far (at most the capacity).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn stats(&self) -> RingStats {
        self.stats
    }
}

/// One server event that workers can open: created with
/// `DISABLE_TIMING | INTERPROCESS`, its handle fetched once.
pub struct ServerEvent {
    device: Device,
    raw: sys::CUevent,
    handle: IpcEventHandle,
}

impl ServerEvent {
    fn create(device: &Device) -> Result<Self, DeviceError> {
        let doing = || {
            format!(
                "creating an exportable event on device {}",
                device.ordinal()
            )
        };
        let flags = (sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint)
            | (sys::CUevent_flags::CU_EVENT_INTERPROCESS as c_uint);
        let mut raw: sys::CUevent = std::ptr::null_mut();
        driver_call(
            "cuEventCreate",
            doing,
            // SAFETY: symbol checked in Device::open; out-pointer is a local.
            || unsafe { sys::cuEventCreate(&mut raw, flags) },
        )?;
        assert!(!raw.is_null(), "cuEventCreate gave a null event");
        // Owned from here, so an error below destroys it.
        let mut event = Self {
            device: device.clone(),
            raw,
            handle: IpcEventHandle([0; IPC_EVENT_HANDLE_BYTES]),
        };
        let mut out = sys::CUipcEventHandle {
            reserved: [0; IPC_EVENT_HANDLE_BYTES],
        };
        driver_call(
            "cuIpcGetEventHandle",
            doing,
            // SAFETY: `raw` is a live interprocess event; out-pointer is a local.
            || unsafe { sys::cuIpcGetEventHandle(&mut out, raw) },
        )?;
        event.handle = IpcEventHandle::from_raw(&out);
        Ok(event)
    }

    pub fn handle(&self) -> IpcEventHandle {
        self.handle
    }

    /// Whether the last record has completed (true when never recorded).
    pub fn is_done(&self) -> Result<bool, DeviceError> {
        let raw = self.raw;
        let doing = || {
            format!(
                "querying an exported event on device {}",
                self.device.ordinal()
            )
        };
        // SAFETY: `raw` is a live event owned by `self`.
        let rc = guarded_call("cuEventQuery", doing, || unsafe { sys::cuEventQuery(raw) })?;
        query_outcome("cuEventQuery", rc, doing)
    }

    fn record(&self, stream: &Stream) -> Result<(), DeviceError> {
        let (e, s) = (self.raw, stream.raw());
        driver_call(
            "cuEventRecord",
            || {
                format!(
                    "recording an exported event on device {}",
                    self.device.ordinal()
                )
            },
            // SAFETY: both handles are live and belong to the same context.
            || unsafe { sys::cuEventRecord(e, s) },
        )
    }
}

impl Drop for ServerEvent {
    fn drop(&mut self) {
        // SAFETY: `raw` came from cuEventCreate and is destroyed once, here.
        unsafe { self.device.destroy_event_in_drop(self.raw, "an exported") };
    }
}

/// The export ring of one device: [`ExportRing::export`] records an event
/// after everything enqueued on a stream and returns its 64-byte handle.
pub struct ExportRing {
    device: Device,
    ring: RingSlots<ServerEvent>,
}

impl ExportRing {
    /// A ring keeping the last `capacity` exports alive
    /// ([`DEFAULT_EXPORT_RING`] in production). Events are created lazily.
    pub fn new(device: &Device, capacity: usize) -> Self {
        Self {
            device: device.clone(),
            ring: RingSlots::new(capacity),
        }
    }

    /// Records an event on `stream` (after all work enqueued so far) and
    /// returns the handle to send to the worker.
    pub fn export(&mut self, stream: &Stream) -> Result<IpcEventHandle, DeviceError> {
        assert_eq!(
            stream.device().ordinal(),
            self.device.ordinal(),
            "exporting on another device's stream"
        );
        let device = &self.device;
        let (_, event) = self
            .ring
            .claim(|| ServerEvent::create(device), |e| e.is_done())?;
        event.record(stream)?;
        Ok(event.handle())
    }

    pub fn stats(&self) -> RingStats {
        self.ring.stats()
    }

    /// Events created so far.
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_handles_must_be_64_bytes() {
        assert_eq!(IpcEventHandle::from_bytes(&[3; 64]).unwrap().0, [3; 64]);
        for n in [0, 1, 63, 65] {
            let e = IpcEventHandle::from_bytes(&vec![0; n]).unwrap_err();
            assert!(e.to_string().contains(&format!("got {n}")), "{e}");
        }
        let e = IpcEventHandle::from_bytes(&[0; 81]).unwrap_err();
        assert!(e.to_string().contains("isolated_ipc"), "{e}");
    }

    #[test]
    fn raw_handle_round_trip_keeps_every_byte() {
        let mut bytes = [0u8; 64];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(200);
        }
        let h = IpcEventHandle(bytes);
        assert_eq!(IpcEventHandle::from_raw(&h.to_raw()), h);
    }

    /// Plain integers stand in for CUDA events (no GPU on the build host);
    /// `busy` marks values whose last record has not completed.
    #[test]
    fn ring_fills_then_reuses_oldest_first() {
        let mut ring: RingSlots<u32> = RingSlots::new(3);
        let mut made = 0;
        let mut claim = |ring: &mut RingSlots<u32>| {
            ring.claim(
                || {
                    made += 1;
                    Ok(made)
                },
                |_| Ok(true),
            )
            .map(|(i, v)| (i, *v))
        };
        assert_eq!(claim(&mut ring), Ok((0, 1)));
        assert_eq!(claim(&mut ring), Ok((1, 2)));
        assert_eq!(claim(&mut ring), Ok((2, 3)));
        // Full: the oldest comes back, in order, forever.
        let reused: Vec<(usize, u32)> = (0..7).map(|_| claim(&mut ring).unwrap()).collect();
        assert_eq!(
            reused,
            vec![(0, 1), (1, 2), (2, 3), (0, 1), (1, 2), (2, 3), (0, 1)]
        );
        assert_eq!(
            ring.stats(),
            RingStats {
                created: 3,
                reused: 7,
                refused_busy: 0
            }
        );
        assert_eq!(ring.len(), 3);
    }

    #[test]
    fn a_busy_oldest_slot_is_refused_without_moving() {
        let mut ring: RingSlots<u32> = RingSlots::new(2);
        ring.claim(|| Ok(10), |_| unreachable!()).unwrap();
        ring.claim(|| Ok(11), |_| unreachable!()).unwrap();
        let e = ring.claim(|| unreachable!(), |v| Ok(*v != 10)).unwrap_err();
        assert!(e.to_string().contains("all 2 exported events"), "{e}");
        assert_eq!(ring.stats().refused_busy, 1);
        // The same (oldest) slot is asked again, and taken once idle.
        let (i, v) = ring.claim(|| unreachable!(), |_| Ok(true)).unwrap();
        assert_eq!((i, *v), (0, 10));
        let (i, _) = ring.claim(|| unreachable!(), |_| Ok(true)).unwrap();
        assert_eq!(i, 1);
    }

    #[test]
    fn failures_leave_the_ring_unchanged() {
        let mut ring: RingSlots<u32> = RingSlots::new(1);
        let fail = || DeviceError::invalid("fake", "test");
        assert!(ring.claim(|| Err(fail()), |_| unreachable!()).is_err());
        assert!(ring.is_empty());
        assert_eq!(ring.stats(), RingStats::default());
        ring.claim(|| Ok(5), |_| unreachable!()).unwrap();
        // A failing idle query is passed on; nothing is reused.
        assert!(ring.claim(|| unreachable!(), |_| Err(fail())).is_err());
        assert_eq!(ring.stats().reused, 0);
        // Capacity one: the single slot comes back each time.
        for _ in 0..3 {
            let (i, v) = ring.claim(|| unreachable!(), |_| Ok(true)).unwrap();
            assert_eq!((i, *v), (0, 5));
        }
    }
}
