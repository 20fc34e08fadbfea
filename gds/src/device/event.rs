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

// ---------------------------------------------------------------------------
// Timeline semaphores (`--isolated-ipc`).
// ---------------------------------------------------------------------------

/// Bytes of lmcache 0.5.6's timeline-semaphore event handle: `!B64sQQ`, a
/// version byte, the 64-byte `cudaIpcMemHandle_t` of the sender's semaphore
/// buffer, the byte offset of its slot and the sequence it reaches,
/// big-endian.
pub const TIMELINE_EVENT_BYTES: usize = 81;

/// Slots of a semaphore buffer (8 bytes each), as 0.5.6 allocates them; slot
/// 0 is its support probe's, so a process's streams take slots from 1.
pub const TIMELINE_SLOTS: u64 = 4096;

const TIMELINE_VERSION: u8 = 1;

/// One timeline-semaphore event: complete once the 64-bit value in slot
/// `slot_offset` of the buffer `buffer` names is at least `seq`. What an
/// `isolated_ipc` worker sends, and what the server answers, in place of
/// CUDA's interprocess event handles (which need a shared `/dev/shm`):
/// legacy CUDA IPC memory handles work across isolated containers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimelineEvent {
    pub buffer: super::ipc::IpcMemHandle,
    pub slot_offset: u64,
    pub seq: u64,
}

impl TimelineEvent {
    /// Parses the 81 bytes; anything else, another version, or a slot that
    /// is not one of the buffer's 8-byte slots, is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DeviceError> {
        let doing = "parsing a worker's timeline-semaphore event";
        if bytes.len() != TIMELINE_EVENT_BYTES {
            return Err(DeviceError::invalid(
                format!(
                    "a timeline-semaphore event (--isolated-ipc) is {TIMELINE_EVENT_BYTES} \
                     bytes, got {}{}",
                    bytes.len(),
                    if bytes.len() == IPC_EVENT_HANDLE_BYTES {
                        " (64 bytes is a CUDA IPC event handle: the worker does not run \
                         with lmcache.mp.isolated_ipc, or kvshard should not)"
                    } else {
                        ""
                    }
                ),
                doing,
            ));
        }
        if bytes[0] != TIMELINE_VERSION {
            return Err(DeviceError::invalid(
                format!(
                    "timeline-semaphore event version {} (lmcache 0.5.6 sends {TIMELINE_VERSION})",
                    bytes[0]
                ),
                doing,
            ));
        }
        let mut buffer = [0u8; 64];
        buffer.copy_from_slice(&bytes[1..65]);
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_be_bytes(b)
        };
        let (slot_offset, seq) = (u64_at(65), u64_at(73));
        if slot_offset % 8 != 0 || slot_offset >= TIMELINE_SLOTS * 8 {
            return Err(DeviceError::invalid(
                format!(
                    "slot offset {slot_offset} is not one of the {TIMELINE_SLOTS} 8-byte slots of \
                     a semaphore buffer"
                ),
                doing,
            ));
        }
        Ok(Self {
            buffer: super::ipc::IpcMemHandle(buffer),
            slot_offset,
            seq,
        })
    }

    /// The 81 bytes lmcache 0.5.6 parses.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(TIMELINE_EVENT_BYTES);
        out.push(TIMELINE_VERSION);
        out.extend_from_slice(&self.buffer.0);
        out.extend_from_slice(&self.slot_offset.to_be_bytes());
        out.extend_from_slice(&self.seq.to_be_bytes());
        out
    }
}

/// A worker's event, in the form the server's IPC mode expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    Cuda(IpcEventHandle),
    Timeline(TimelineEvent),
}

impl WorkerEvent {
    /// Parses a worker's event bytes: a timeline-semaphore event when the
    /// server runs with `--isolated-ipc`, else a CUDA IPC event handle.
    pub fn parse(bytes: &[u8], isolated_ipc: bool) -> Result<Self, DeviceError> {
        if isolated_ipc {
            TimelineEvent::from_bytes(bytes).map(Self::Timeline)
        } else {
            IpcEventHandle::from_bytes(bytes).map(Self::Cuda)
        }
    }
}

/// Driver entry points the timeline-semaphore path needs beyond
/// [`Device::open`]'s.
pub const TIMELINE_SYMBOLS: [&str; 3] = [
    "cuIpcGetMemHandle",
    "cuStreamWaitValue64_v2",
    "cuStreamWriteValue64_v2",
];

/// Enqueues on `stream` a wait until the 64-bit value at device address
/// `addr` is at least `seq` (`cuStreamWaitValue64`, GEQ).
pub fn wait_value(stream: &Stream, addr: u64, seq: u64) -> Result<(), DeviceError> {
    let s = stream.raw();
    driver_call(
        "cuStreamWaitValue64_v2",
        || format!("making a stream wait for semaphore {addr:#x} to reach {seq}"),
        // SAFETY: the symbol is checked (TIMELINE_SYMBOLS) before a timeline
        // instance exists; `addr` is inside a live mapping of the worker's
        // semaphore buffer the caller holds until the wait has run.
        || unsafe {
            sys::cuStreamWaitValue64_v2(
                s,
                addr,
                seq,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as c_uint,
            )
        },
    )
}

/// This process's semaphore buffer on one device: allocated zeroed and
/// exported once; each instance stream signals through a slot of its own,
/// whose values only grow (so a GEQ wait never races).
pub struct TimelineBuffer {
    buf: super::exec::DeviceBuffer,
    handle: super::ipc::IpcMemHandle,
    next_slot: u64,
}

impl TimelineBuffer {
    pub fn new(device: &Device, stream: &Stream) -> Result<Self, DeviceError> {
        super::require_symbols(&TIMELINE_SYMBOLS, "setting up timeline-semaphore events")?;
        let len = (TIMELINE_SLOTS * 8) as usize;
        let buf = super::exec::DeviceBuffer::alloc(device, len)?;
        let zeros = vec![0u8; len];
        // SAFETY: `zeros` is live until the synchronize below; the range is
        // the whole buffer.
        unsafe { stream.copy_to_device(&buf, 0, zeros.as_ptr(), len) }?;
        stream.synchronize()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_EVENT_HANDLE_BYTES],
        };
        let ptr = buf.ptr();
        driver_call(
            "cuIpcGetMemHandle",
            || {
                format!(
                    "exporting the semaphore buffer of device {}",
                    device.ordinal()
                )
            },
            // SAFETY: symbol checked above; `ptr` is the base of a live
            // cuMemAlloc allocation; the out-pointer is a local.
            || unsafe { sys::cuIpcGetMemHandle(&mut raw, ptr) },
        )?;
        Ok(Self {
            buf,
            handle: super::ipc::IpcMemHandle(raw.reserved.map(|c| c as u8)),
            next_slot: 1,
        })
    }

    /// A slot of its own for one stream; an error once all are taken.
    pub fn claim_slot(&mut self) -> Result<u64, DeviceError> {
        if self.next_slot >= TIMELINE_SLOTS {
            return Err(DeviceError::invalid(
                format!("all {} semaphore slots are taken", TIMELINE_SLOTS - 1),
                "giving an instance a timeline-semaphore slot",
            ));
        }
        self.next_slot += 1;
        Ok((self.next_slot - 1) * 8)
    }

    /// Enqueues on `stream` the write of `seq` into slot `slot_offset` and
    /// returns the event a worker waits on.
    pub fn signal(
        &self,
        stream: &Stream,
        slot_offset: u64,
        seq: u64,
    ) -> Result<TimelineEvent, DeviceError> {
        let addr = self.buf.range(slot_offset as usize, 8)?;
        let s = stream.raw();
        driver_call(
            "cuStreamWriteValue64_v2",
            || format!("signalling semaphore slot {slot_offset} to {seq}"),
            // SAFETY: symbol checked in new(); `addr` is an 8-byte slot of
            // the live buffer, which outlives every stream that signals it.
            || unsafe {
                sys::cuStreamWriteValue64_v2(
                    s,
                    addr,
                    seq,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as c_uint,
                )
            },
        )?;
        Ok(TimelineEvent {
            buffer: self.handle,
            slot_offset,
            seq,
        })
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

    /// The 81 bytes lmcache 0.5.6's `TimelineSemaphoreEventIPCBackend`
    /// exports for buffer handle bytes 0..64, slot offset 8, sequence 42
    /// (`event_handle_timeline_semaphore` in the CUDA golden frames).
    const GOLDEN_TIMELINE: &str =
        "01000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20\
        2122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f0000000000000008\
        000000000000002a";

    fn unhex(h: &str) -> Vec<u8> {
        (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn timeline_events_are_0_5_6_s_81_bytes() {
        let bytes = unhex(GOLDEN_TIMELINE);
        let ev = TimelineEvent::from_bytes(&bytes).unwrap();
        let want: Vec<u8> = (0..64).collect();
        assert_eq!(ev.buffer.0.to_vec(), want);
        assert_eq!((ev.slot_offset, ev.seq), (8, 42));
        assert_eq!(ev.to_bytes(), bytes, "encodes back to the same bytes");
        assert_eq!(
            WorkerEvent::parse(&bytes, true).unwrap(),
            WorkerEvent::Timeline(ev)
        );
        // The other form, in each mode.
        let e = WorkerEvent::parse(&[0; 64], true).unwrap_err().to_string();
        assert!(e.contains("64 bytes is a CUDA IPC event handle"), "{e}");
        let e = WorkerEvent::parse(&bytes, false).unwrap_err().to_string();
        assert!(e.contains("81 bytes is the isolated_ipc"), "{e}");
        assert!(matches!(
            WorkerEvent::parse(&[5; 64], false),
            Ok(WorkerEvent::Cuda(_))
        ));
        // Another version, a slot that is not one of the buffer's.
        let mut v2 = bytes.clone();
        v2[0] = 2;
        let e = TimelineEvent::from_bytes(&v2).unwrap_err().to_string();
        assert!(e.contains("version 2"), "{e}");
        for bad in [4u64, TIMELINE_SLOTS * 8] {
            let ev = TimelineEvent {
                slot_offset: bad,
                ..ev
            };
            let e = TimelineEvent::from_bytes(&ev.to_bytes())
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("slot offset {bad}")), "{e}");
        }
    }

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
