//! Why a device job failed: [`WorkerError`], what the device threads (and
//! the CPU emulation of them) answer a job with, and what the checks they
//! run before any driver call report.

use std::error::Error;
use std::fmt;
use std::io;
use std::sync::Arc;

use super::pin::PlanError;
use super::DeviceError;
use crate::nvrtc::NvrtcUnavailable;
use kvshard_layout::stride::{CopyError, EngineKvFormat, MAX_OBJECTS};

/// Which job of an instance an error happened in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Registering,
    Transferring,
    Unregistering,
    ReadingBack,
}

impl Step {
    /// The job as a gerund, e.g. "reading back".
    pub fn doing(self) -> &'static str {
        match self {
            Step::Registering => "registering",
            Step::Transferring => "transferring",
            Step::Unregistering => "unregistering",
            Step::ReadingBack => "reading back",
        }
    }
}

/// A failed device job, or a registration, transfer or read-back refused
/// before anything was done.
#[derive(Clone, Debug)]
pub enum WorkerError {
    // -- the driver and the device thread ------------------------------------
    /// A driver call failed, or the driver lacks what it needs.
    Device(DeviceError),
    /// The GPU's thread could not open its device; every job it is given is
    /// answered with this.
    Unusable {
        ordinal: usize,
        source: Box<WorkerError>,
    },
    /// The ordinal does not fit the driver's type.
    OrdinalOutOfRange {
        ordinal: usize,
    },
    /// Opening the device panicked (in the driver loader, most likely).
    OpenPanicked {
        ordinal: u32,
        message: String,
    },
    /// NVRTC could not be loaded, so the block-copy kernel cannot be built.
    NvrtcUnavailable(NvrtcUnavailable),
    /// Compiling or loading the block-copy kernel failed.
    KernelBuild(DeviceError),
    /// A transfer found no kernel loaded.
    KernelNotLoaded,
    /// The job's work panicked; the instance's stream was drained.
    Panicked {
        device: u32,
        instance: i64,
        step: Step,
        message: String,
    },
    /// A thread of the device runtime could not be started.
    ThreadSpawn {
        what: &'static str,
        source: Arc<io::Error>,
    },
    /// What `step` of instance `instance` on device `device` failed on.
    During {
        device: u32,
        instance: i64,
        step: Step,
        source: Box<WorkerError>,
    },

    // -- instances -------------------------------------------------------------
    /// No instance `instance` is registered on the device.
    UnknownInstance {
        device: u32,
        instance: i64,
    },
    /// A read-back named a layer the instance does not have.
    UnknownLayer {
        device: u32,
        instance: i64,
        layer: usize,
    },

    // -- the registration ------------------------------------------------------
    /// What is wrong with layer `layer` of a registration or read-back.
    Layer {
        layer: usize,
        source: Box<WorkerError>,
    },
    /// The spec names another GPU than the thread's.
    WrongDevice {
        spec: usize,
        thread: u32,
    },
    NoLayers,
    /// What is wrong with kernel group `group` of a registration.
    Group {
        group: usize,
        source: Box<WorkerError>,
    },
    /// A registration without a kernel group.
    NoGroups,
    /// What is wrong with object group `object_group` of a registration.
    ObjectGroup {
        object_group: usize,
        source: Box<WorkerError>,
    },
    /// A registration without an object group.
    NoObjectGroups,
    /// An object group names a kernel group the registration does not
    /// have, or one another object group holds.
    ObjectGroupMember {
        group: usize,
        groups: usize,
    },
    /// A kernel group no object group holds.
    GroupInNoObjectGroup {
        group: usize,
    },
    /// A chunk of a transfer names an object group the registration does not
    /// have.
    ObjectGroupOutOfRange {
        chunk: usize,
        object_group: usize,
        object_groups: usize,
    },
    /// A group's region of the object does not start where the previous one
    /// ends (regions lie end to end, in group order).
    RegionOffset {
        offset: u64,
        expected: u64,
    },
    /// A group's region, or the object, is not whole copy units of the group.
    RegionMisaligned {
        offset: u64,
        object_bytes: u64,
        unit: u64,
    },
    /// The blocks a group moves per chunk are not its last whole blocks of a
    /// window.
    WindowNotWholeBlocks {
        keep_blocks: usize,
        blocks_per_chunk: usize,
        block_size: u32,
        transfer_slots: u64,
    },
    /// The group's blocks of a chunk do not cover the chunk's token slots.
    ChunkNotWholeBlocks {
        blocks_per_chunk: usize,
        block_size: u32,
        chunk_slots: u64,
    },
    /// The number of kernel layers differs from the format's paged buffers.
    KernelLayerCount {
        format: EngineKvFormat,
        expected: usize,
        got: usize,
    },
    ZeroBlocksPerChunk,
    /// The spec's ordinal does not fit the driver's type.
    SpecOrdinalOutOfRange {
        ordinal: usize,
    },
    /// A kernel pointer names a layer that is not registered.
    KernelLayerMissing {
        pointer: usize,
        layer: usize,
        registered: usize,
    },
    /// A kernel layer's view is smaller than the layout addresses.
    KernelLayerTooSmall {
        pointer: usize,
        layer: usize,
        bytes: u64,
        needed: u64,
    },
    /// A size computed from the spec overflows.
    Overflow {
        what: &'static str,
    },
    /// A full batch of the registered layout cannot be launched.
    BatchUnlaunchable(CopyError),
    /// The stride table refused a copy or launch.
    Copy(CopyError),
    /// The spec's object size is not the layout's.
    ObjectBytesMismatch {
        got: u64,
        expected: u64,
    },
    /// A kernel base pointer is not aligned to the copy unit.
    Misaligned {
        pointer: usize,
        addr: u64,
        unit: u64,
    },

    // -- a layer's memory ------------------------------------------------------
    /// A `cuda_vmm` range outside its allocation.
    FabricRangeOutside {
        offset: u64,
        bytes: u64,
        alloc_size: u64,
    },
    /// A shared range whose end overflows.
    SharedRangeOverflows {
        offset: u64,
        bytes: u64,
    },
    /// A tensor view that does not fit its shared range.
    ViewOutsideRange {
        view_offset: u64,
        view_bytes: u64,
        range_bytes: u64,
    },

    // -- a transfer's chunks ---------------------------------------------------
    BlockIdCount {
        chunk: usize,
        got: usize,
        expected: usize,
    },
    BlockIdOutOfRange {
        chunk: usize,
        index: usize,
        id: i64,
        nb: u64,
    },
    SkipTooLarge {
        chunk: usize,
        skip_tokens: usize,
        tokens: u64,
    },
    /// A store must fill whole objects.
    StoreSkips {
        chunk: usize,
        skip_tokens: usize,
    },
    NullHostAddress {
        chunk: usize,
    },
    /// A host range whose end wraps (of chunk `chunk` when known).
    HostRangeWraps {
        chunk: Option<usize>,
        addr: u64,
        len: u64,
    },
    /// A host copy could not be cut at the pinned arena's pieces.
    HostSplit(PlanError),

    // -- a read-back -----------------------------------------------------------
    /// Bytes outside the layer's view.
    ReadOutsideView {
        layer: usize,
        offset: u64,
        len: u64,
        view_bytes: u64,
    },
    /// More bytes than this host can hold in one buffer.
    ReadTooLarge {
        layer: usize,
        bytes: u64,
    },

    // -- the CPU emulation -----------------------------------------------------
    /// The emulation maps `cuda_raw` descriptors only.
    EmulationMemoryKind,
    /// The IPC handle does not carry a shm name.
    NotAShmName,
    /// A shm segment of zero bytes.
    EmptyShmSegment {
        name: String,
    },
    /// `shm_open` or `mmap` of the emulated device memory failed.
    Shm {
        call: &'static str,
        name: String,
        bytes: Option<usize>,
        source: Arc<io::Error>,
    },
    /// The CPU copy of a batch was refused.
    CopyRefused {
        first_chunk: usize,
        source: CopyError,
    },
}

impl WorkerError {
    /// `self` as what `step` of `instance` on `device` failed on.
    pub fn during(self, device: u32, instance: i64, step: Step) -> WorkerError {
        WorkerError::During {
            device,
            instance,
            step,
            source: Box::new(self),
        }
    }

    /// `self` as what is wrong with layer `layer`.
    pub fn in_layer(self, layer: usize) -> WorkerError {
        WorkerError::Layer {
            layer,
            source: Box::new(self),
        }
    }

    /// `self` as what is wrong with kernel group `group`.
    pub fn in_group(self, group: usize) -> WorkerError {
        WorkerError::Group {
            group,
            source: Box::new(self),
        }
    }

    pub fn in_object_group(self, object_group: usize) -> WorkerError {
        WorkerError::ObjectGroup {
            object_group,
            source: Box::new(self),
        }
    }

    /// The innermost error under the context variants.
    pub fn root(&self) -> &WorkerError {
        match self {
            WorkerError::Unusable { source, .. }
            | WorkerError::During { source, .. }
            | WorkerError::Layer { source, .. }
            | WorkerError::Group { source, .. }
            | WorkerError::ObjectGroup { source, .. } => source.root(),
            other => other,
        }
    }
}

impl From<DeviceError> for WorkerError {
    fn from(e: DeviceError) -> Self {
        WorkerError::Device(e)
    }
}

impl fmt::Display for WorkerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use WorkerError as E;
        match self {
            E::Device(e) | E::KernelBuild(e) => write!(f, "{e}"),
            E::Unusable { ordinal, source } => {
                write!(f, "CUDA device {ordinal} is unusable: {source}")
            }
            E::OrdinalOutOfRange { ordinal } => write!(f, "ordinal {ordinal} is out of range"),
            E::OpenPanicked { ordinal, message } => {
                write!(f, "opening CUDA device {ordinal} panicked: {message}")
            }
            E::NvrtcUnavailable(e) => write!(f, "{e}"),
            E::KernelNotLoaded => write!(f, "the block-copy kernel is not loaded"),
            E::Panicked {
                device,
                instance,
                step,
                message,
            } => write!(
                f,
                "device {device}: internal error while {} instance {instance}: {message}",
                step.doing()
            ),
            E::ThreadSpawn { what, source } => write!(f, "cannot start {what}: {source}"),
            E::During {
                device,
                instance,
                step,
                source,
            } => match step {
                Step::Registering => {
                    write!(
                        f,
                        "device {device}: registering instance {instance}: {source}"
                    )
                }
                Step::Transferring => write!(
                    f,
                    "device {device}: transfer for instance {instance}: {source}"
                ),
                Step::Unregistering => write!(
                    f,
                    "device {device}: unregistering instance {instance}: {source}"
                ),
                Step::ReadingBack => write!(f, "device {device}: instance {instance}: {source}"),
            },
            E::UnknownInstance { device, instance } => {
                write!(f, "device {device}: instance {instance} is not registered")
            }
            E::UnknownLayer {
                device,
                instance,
                layer,
            } => write!(
                f,
                "device {device}: instance {instance} has no layer {layer}"
            ),
            E::Layer { layer, source } => write!(f, "layer {layer}: {source}"),
            E::WrongDevice { spec, thread } => write!(
                f,
                "the spec is for device {spec}, this thread serves device {thread}"
            ),
            E::NoLayers => write!(f, "no layers"),
            E::Group { group, source } => write!(f, "kernel group {group}: {source}"),
            E::NoGroups => write!(f, "no kernel groups"),
            E::ObjectGroup {
                object_group,
                source,
            } => write!(f, "object group {object_group}: {source}"),
            E::NoObjectGroups => write!(f, "no object groups"),
            E::ObjectGroupMember { group, groups } => write!(
                f,
                "kernel group {group} is not one of the {groups} kernel groups, or is in \
                 another object group already"
            ),
            E::GroupInNoObjectGroup { group } => {
                write!(f, "kernel group {group} is in no object group")
            }
            E::ObjectGroupOutOfRange {
                chunk,
                object_group,
                object_groups,
            } => write!(
                f,
                "chunk {chunk} is of object group {object_group}, of a registration of \
                 {object_groups}"
            ),
            E::RegionOffset { offset, expected } => write!(
                f,
                "its region starts at byte {offset} of the object, but the previous group's \
                 ends at {expected}"
            ),
            E::RegionMisaligned {
                offset,
                object_bytes,
                unit,
            } => write!(
                f,
                "its region at byte {offset} of a {object_bytes}-byte object is not aligned to \
                 its {unit}-byte copy unit"
            ),
            E::WindowNotWholeBlocks {
                keep_blocks,
                blocks_per_chunk,
                block_size,
                transfer_slots,
            } => write!(
                f,
                "it moves {keep_blocks} of {blocks_per_chunk} blocks of {block_size} tokens a \
                 chunk, which is not a window of {transfer_slots} tokens"
            ),
            E::ChunkNotWholeBlocks {
                blocks_per_chunk,
                block_size,
                chunk_slots,
            } => write!(
                f,
                "{blocks_per_chunk} blocks of {block_size} tokens do not make a chunk of \
                 {chunk_slots} tokens"
            ),
            E::KernelLayerCount {
                format,
                expected,
                got,
            } => write!(
                f,
                "the {format} format addresses {expected} paged buffers, got {got} kernel layers"
            ),
            E::ZeroBlocksPerChunk => write!(f, "blocks_per_chunk is 0"),
            E::SpecOrdinalOutOfRange { .. } => write!(f, "ordinal out of range"),
            E::KernelLayerMissing {
                pointer,
                layer,
                registered,
            } => write!(
                f,
                "kernel pointer {pointer} names layer {layer}, but only {registered} are registered"
            ),
            E::KernelLayerTooSmall {
                pointer,
                layer,
                bytes,
                needed,
            } => write!(
                f,
                "kernel pointer {pointer} (layer {layer}) spans {bytes} bytes, but the layout \
                 addresses {needed}"
            ),
            E::Overflow { what } => write!(f, "{what} overflows"),
            E::BatchUnlaunchable(e) => {
                write!(f, "a batch of {MAX_OBJECTS} chunks cannot be launched: {e}")
            }
            E::Copy(e) => write!(f, "{e}"),
            E::ObjectBytesMismatch { got, expected } => write!(
                f,
                "object_bytes is {got} but one chunk of this layout is {expected} bytes"
            ),
            E::Misaligned {
                pointer,
                addr,
                unit,
            } => write!(
                f,
                "kernel pointer {pointer} at {addr:#x} is not aligned to the layout's \
                 {unit}-byte copy unit"
            ),
            E::FabricRangeOutside {
                offset,
                bytes,
                alloc_size,
            } => write!(
                f,
                "fabric range at offset {offset} of {bytes} bytes exceeds the {alloc_size} byte \
                 allocation"
            ),
            E::SharedRangeOverflows { offset, bytes } => write!(
                f,
                "shared range at offset {offset} of {bytes} bytes overflows"
            ),
            E::ViewOutsideRange {
                view_offset,
                view_bytes,
                range_bytes,
            } => write!(
                f,
                "view at offset {view_offset} of {view_bytes} bytes does not fit the \
                 {range_bytes} byte shared range"
            ),
            E::BlockIdCount {
                chunk,
                got,
                expected,
            } => write!(f, "chunk {chunk} has {got} block ids, expected {expected}"),
            E::BlockIdOutOfRange {
                chunk,
                index,
                id,
                nb,
            } => write!(
                f,
                "chunk {chunk}: block id {id} (index {index}) is outside 0..{nb}"
            ),
            E::SkipTooLarge {
                chunk,
                skip_tokens,
                tokens,
            } => write!(
                f,
                "chunk {chunk}: skipping {skip_tokens} tokens exceeds its {tokens} tokens"
            ),
            E::StoreSkips { chunk, skip_tokens } => write!(
                f,
                "chunk {chunk}: a store cannot skip tokens (skip_tokens {skip_tokens})"
            ),
            E::NullHostAddress { chunk } => write!(f, "chunk {chunk}: null host address"),
            E::HostRangeWraps { chunk, addr, len } => {
                if let Some(c) = chunk {
                    write!(f, "chunk {c}: ")?;
                }
                write!(f, "host range {addr:#x} + {len} wraps")
            }
            E::HostSplit(e) => write!(f, "splitting a host copy at the pinned pieces: {e}"),
            E::ReadOutsideView {
                layer,
                offset,
                len,
                view_bytes,
            } => write!(
                f,
                "layer {layer}: bytes {offset}..+{len} are outside its {view_bytes}-byte view"
            ),
            E::ReadTooLarge { layer, bytes } => write!(f, "layer {layer}: {bytes} bytes"),
            E::EmulationMemoryKind => {
                write!(f, "the CPU emulation maps cuda_raw descriptors only")
            }
            E::NotAShmName => write!(
                f,
                "the IPC handle does not carry a shm name (/name, NUL-padded)"
            ),
            E::EmptyShmSegment { name } => write!(f, "shm segment {name}: nothing to map"),
            E::Shm {
                call,
                name,
                bytes,
                source,
            } => match bytes {
                Some(n) => write!(f, "{call} {name} ({n} bytes): {source}"),
                None => write!(f, "{call} {name}: {source}"),
            },
            E::CopyRefused {
                first_chunk,
                source,
            } => write!(f, "copy of chunks {first_chunk}..: {source}"),
        }
    }
}

impl Error for WorkerError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        use WorkerError as E;
        match self {
            E::Device(e) | E::KernelBuild(e) => Some(e),
            E::NvrtcUnavailable(e) => Some(e),
            E::Unusable { source, .. }
            | E::During { source, .. }
            | E::Layer { source, .. }
            | E::Group { source, .. }
            | E::ObjectGroup { source, .. } => Some(source.as_ref()),
            E::ThreadSpawn { source, .. } | E::Shm { source, .. } => Some(source.as_ref()),
            E::BatchUnlaunchable(e) | E::Copy(e) | E::CopyRefused { source: e, .. } => Some(e),
            E::HostSplit(e) => Some(e),
            E::OrdinalOutOfRange { .. }
            | E::OpenPanicked { .. }
            | E::KernelNotLoaded
            | E::Panicked { .. }
            | E::UnknownInstance { .. }
            | E::UnknownLayer { .. }
            | E::WrongDevice { .. }
            | E::NoLayers
            | E::NoGroups
            | E::NoObjectGroups
            | E::ObjectGroupMember { .. }
            | E::GroupInNoObjectGroup { .. }
            | E::ObjectGroupOutOfRange { .. }
            | E::RegionOffset { .. }
            | E::RegionMisaligned { .. }
            | E::ChunkNotWholeBlocks { .. }
            | E::WindowNotWholeBlocks { .. }
            | E::KernelLayerCount { .. }
            | E::ZeroBlocksPerChunk
            | E::SpecOrdinalOutOfRange { .. }
            | E::KernelLayerMissing { .. }
            | E::KernelLayerTooSmall { .. }
            | E::Overflow { .. }
            | E::ObjectBytesMismatch { .. }
            | E::Misaligned { .. }
            | E::FabricRangeOutside { .. }
            | E::SharedRangeOverflows { .. }
            | E::ViewOutsideRange { .. }
            | E::BlockIdCount { .. }
            | E::BlockIdOutOfRange { .. }
            | E::SkipTooLarge { .. }
            | E::StoreSkips { .. }
            | E::NullHostAddress { .. }
            | E::HostRangeWraps { .. }
            | E::ReadOutsideView { .. }
            | E::ReadTooLarge { .. }
            | E::EmulationMemoryKind
            | E::NotAShmName
            | E::EmptyShmSegment { .. } => None,
        }
    }
}

const _: () = {
    const fn send_static<T: Send + Sync + 'static>() {}
    send_static::<WorkerError>();
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_renders_around_its_source_and_chains_to_it() {
        let leaf = WorkerError::Device(DeviceError::invalid("bad handle", "opening"));
        let e = leaf.in_layer(2).during(0, 7, Step::Registering);
        assert_eq!(
            e.to_string(),
            "device 0: registering instance 7: layer 2: opening: bad handle"
        );
        let layer = e.source().expect("the layer context");
        assert_eq!(layer.to_string(), "layer 2: opening: bad handle");
        let leaf = layer.source().expect("the failed driver call");
        assert!(matches!(
            leaf.downcast_ref::<WorkerError>(),
            Some(WorkerError::Device(_))
        ));
        let device = leaf.source().expect("the device error");
        assert!(device.downcast_ref::<DeviceError>().is_some());
        assert!(matches!(e.root(), WorkerError::Device(_)));
    }

    #[test]
    fn a_panic_names_the_step() {
        let e = WorkerError::Panicked {
            device: 1,
            instance: 3,
            step: Step::ReadingBack,
            message: "boom".into(),
        };
        assert_eq!(
            e.to_string(),
            "device 1: internal error while reading back instance 3: boom"
        );
        assert!(e.source().is_none());
    }
}
