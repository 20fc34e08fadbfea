//! The GPUDirect-Storage L1 slab file, CPU side: one preallocated file per
//! shard that L1 objects live in at their slab offsets, read and written with
//! O_DIRECT through the slab's own io_uring.
//!
//! # The file
//!
//! lmcache 0.5.6 keeps one slab per process at `DIR/lmcache_gds_slab.bin`.
//! kvshard has one slab per shard, so each is named
//! `DIR/lmcache_gds_slab.<shard>.bin` (shard 0: `lmcache_gds_slab.0.bin`);
//! the distinct name keeps a kvshard slab from ever being mistaken for, or
//! truncated under, a running 0.5.6 server's slab in the same directory.
//!
//! Byte layout: none beyond the objects themselves. The file is exactly the
//! slab size (the requested size rounded up to [`SLAB_ALIGN`]); an object of
//! `n` bytes at slab offset `o` is the raw bytes `o..o + n` of the file, with
//! no header, index or checksum. Nothing persists: like 0.5.6 the file is
//! emptied at every start (`O_CREAT | O_RDWR`, mode 0644, then truncated
//! once this process holds the file's exclusive `flock`, so a second server
//! on the same directory is refused instead of truncating a live slab), so
//! what an earlier run left is gone, then preallocated with
//! `posix_fallocate` (later writes never extend the file or allocate blocks)
//! and reopened `O_RDWR | O_DIRECT` when direct I/O is asked for. Dropping a
//! [`GdsSlab`] closes the file and leaves it on disk; the next start
//! truncates it.
//!
//! # Transfers
//!
//! Offsets, lengths and buffer addresses must all be multiples of
//! [`SLAB_ALIGN`] (4 KiB, which covers 512-byte and 4 KiB logical blocks);
//! anything else is refused with [`SlabError::Misaligned`] before the kernel
//! sees it, whether or not the slab uses O_DIRECT, so the contract does not
//! change with the option. A transfer is split into submissions of at most
//! [`MAX_SUBMISSION_BYTES`] (the 16 MiB region bound of 0.5.6's cuFile path),
//! up to [`RING_DEPTH`] in flight; short transfers are continued from where
//! they stopped. A batch ([`GdsSlab::write_many`], [`GdsSlab::read_many`])
//! keeps pieces of all its objects in flight together.
//!
//! # Threading
//!
//! The API is blocking: each call submits to the slab's private ring and
//! waits for all of its completions before it returns, so caller buffers are
//! never referenced by the kernel after a call. The slab is `Send` and owns
//! its ring (no lock, nothing shared with other slabs or threads): a shard
//! moves it into the job or thread that drives it, e.g. a blocking job as the
//! fs L2 adapter does or the device thread, and the executor never waits on
//! the disk. When io_uring is unavailable (disabled by sysctl or seccomp)
//! the slab still works, one `pread`/`pwrite` at a time, and says so in
//! [`GdsSlab::describe`].

use std::alloc::Layout;
use std::collections::VecDeque;
use std::ffi::CString;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use kvshard_io::shm_segment::{holder_of, try_lock, Holder};

/// Alignment of slab offsets, transfer lengths, buffer addresses and the slab
/// size (0.5.6's `AddressManager(size, align=4096)`).
pub const SLAB_ALIGN: usize = 4096;
/// Largest single read or write submitted for one piece of a transfer.
pub const MAX_SUBMISSION_BYTES: usize = 16 << 20;
/// Submissions in flight on a slab's ring (as the fs adapter's ring).
pub const RING_DEPTH: usize = 32;

const _: () = assert!(MAX_SUBMISSION_BYTES % SLAB_ALIGN == 0);
// An SQE's length is a u32.
const _: () = assert!(MAX_SUBMISSION_BYTES <= u32::MAX as usize);
const _: () = assert!(SLAB_ALIGN.is_power_of_two());

/// Buffers of at least this size are aligned to 2 MiB so transparent huge
/// pages can back them: O_DIRECT into scattered 4 KiB pages is split into
/// many more device requests.
const HUGE_ALIGN: usize = 2 << 20;

/// Options of a slab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlabOptions {
    /// Open the slab with `O_DIRECT` (`--gds-l1-use-direct-io`, default
    /// true as in 0.5.6). Refused on filesystems that cannot do it, tmpfs
    /// and ramfs included; `--no-gds-l1-use-direct-io` uses the page cache.
    pub direct_io: bool,
}

impl Default for SlabOptions {
    fn default() -> SlabOptions {
        SlabOptions { direct_io: true }
    }
}

/// The direction of a transfer, for errors and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlabOp {
    Create,
    Write,
    Read,
}

impl SlabOp {
    pub fn name(self) -> &'static str {
        match self {
            SlabOp::Create => "create",
            SlabOp::Write => "write",
            SlabOp::Read => "read",
        }
    }
}

/// Which part of a transfer broke the alignment rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misalignment {
    Offset,
    Length,
    BufferAddress,
}

impl Misalignment {
    fn name(self) -> &'static str {
        match self {
            Misalignment::Offset => "slab offset",
            Misalignment::Length => "length",
            Misalignment::BufferAddress => "buffer address",
        }
    }
}

/// Why a slab could not be created or a transfer was refused or failed.
#[derive(Debug)]
pub enum SlabError {
    /// The requested size is below one [`SLAB_ALIGN`] page (or overflows
    /// when rounded up).
    TooSmall { size_bytes: u64 },
    /// The filesystem of the slab directory cannot do direct I/O.
    DirectIoRefused {
        path: PathBuf,
        filesystem: FsType,
        /// The kernel's refusal, when it gave one (tmpfs and ramfs are
        /// refused by type, see [`GdsSlab::create`]).
        cause: Option<io::Error>,
    },
    /// An offset, length or buffer address is not a multiple of
    /// [`SLAB_ALIGN`]. Nothing of the call was transferred.
    Misaligned {
        op: SlabOp,
        what: Misalignment,
        value: u64,
    },
    /// A range ends past the slab. Nothing of the call was transferred.
    OutOfRange {
        op: SlabOp,
        offset: u64,
        len: u64,
        slab_bytes: u64,
    },
    /// Two ranges of one `write_many` overlap, so the result would depend
    /// on the order the device completes them. Nothing was transferred.
    OverlappingWrites { first: u64, second: u64 },
    /// Another process (a running server) holds the slab file's lock.
    InUse {
        path: PathBuf,
        holder: Option<Holder>,
    },
    /// A system call failed.
    Io {
        op: SlabOp,
        path: PathBuf,
        /// Slab offset where the failed piece (or step) started.
        offset: u64,
        /// Bytes that piece still had to move.
        len: u64,
        source: io::Error,
    },
}

impl fmt::Display for SlabError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlabError::TooSmall { size_bytes } => write!(
                f,
                "gds slab of {size_bytes} bytes refused: a slab needs at least one {SLAB_ALIGN}-byte page"
            ),
            SlabError::DirectIoRefused {
                path,
                filesystem,
                cause,
            } => {
                write!(
                    f,
                    "gds slab {}: the filesystem ({filesystem}) cannot do direct I/O (O_DIRECT)",
                    path.display()
                )?;
                match cause {
                    Some(e) => write!(f, ": {e}")?,
                    None if filesystem.is_memory() => write!(
                        f,
                        ": it keeps file data in the page cache, so direct I/O would not reach a device"
                    )?,
                    None => {}
                }
                write!(
                    f,
                    "; put --gds-l1-path on a block-device filesystem (ext4, xfs, ...) or pass \
                     --no-gds-l1-use-direct-io to use the page cache"
                )
            }
            SlabError::Misaligned { op, what, value } => write!(
                f,
                "gds slab {}: {} {value:#x} is not a multiple of {SLAB_ALIGN} (direct I/O needs \
                 {SLAB_ALIGN}-byte aligned offsets, lengths and buffers)",
                op.name(),
                what.name()
            ),
            SlabError::OutOfRange {
                op,
                offset,
                len,
                slab_bytes,
            } => write!(
                f,
                "gds slab {}: range at offset {offset} of {len} bytes ends past the slab end \
                 ({slab_bytes} bytes)",
                op.name()
            ),
            SlabError::OverlappingWrites { first, second } => write!(
                f,
                "gds slab write: the ranges at offsets {first} and {second} of one batch overlap"
            ),
            SlabError::InUse { path, holder } => {
                write!(f, "gds slab {} is in use", path.display())?;
                if let Some(h) = holder {
                    write!(f, " by process {} ({})", h.pid, h.cmdline)?;
                }
                write!(
                    f,
                    ": another server runs with this --gds-l1-path; give each server its own directory"
                )
            }
            SlabError::Io {
                op,
                path,
                offset,
                len,
                source,
            } => write!(
                f,
                "gds slab {} {} at offset {offset} ({len} bytes): {source}",
                op.name(),
                path.display()
            ),
        }
    }
}

impl std::error::Error for SlabError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SlabError::Io { source, .. } => Some(source),
            SlabError::DirectIoRefused { cause: Some(e), .. } => Some(e),
            _ => None,
        }
    }
}

/// A filesystem type as `statfs` reports it (`f_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsType {
    pub magic: u64,
}

impl FsType {
    pub const TMPFS: u64 = 0x0102_1994;
    pub const RAMFS: u64 = 0x8584_58f6;

    /// The filesystem `path` lives on.
    pub fn of(path: &Path) -> io::Result<FsType> {
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
        // SAFETY: a valid C string and a zeroed out-parameter of the right type.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(FsType {
            magic: st.f_type as u64,
        })
    }

    /// Memory filesystems: direct I/O there never reaches a device.
    pub fn is_memory(self) -> bool {
        matches!(self.magic, FsType::TMPFS | FsType::RAMFS)
    }

    /// A short name for the usual types, `None` for others.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.magic {
            FsType::TMPFS => "tmpfs",
            FsType::RAMFS => "ramfs",
            0xef53 => "ext4",
            0x5846_5342 => "xfs",
            0x9123_683e => "btrfs",
            0x2fc1_2fc1 => "zfs",
            0x794c_7630 => "overlayfs",
            0x6969 => "nfs",
            0x6573_5546 => "fuse",
            0x0102_1997 => "9p",
            0xf2f5_2010 => "f2fs",
            _ => return None,
        })
    }
}

impl fmt::Display for FsType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}, f_type {:#x}", self.magic),
            None => write!(f, "f_type {:#x}", self.magic),
        }
    }
}

/// A zeroed heap buffer whose address and length are multiples of
/// [`SLAB_ALIGN`], as slab transfers need. Buffers of 2 MiB and more are
/// 2 MiB-aligned and advised for transparent huge pages.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// # Panics
    /// When `len` is 0 or not a multiple of [`SLAB_ALIGN`], or on
    /// allocation failure.
    pub fn zeroed(len: usize) -> AlignedBuf {
        assert!(
            len > 0 && len % SLAB_ALIGN == 0,
            "AlignedBuf of {len} bytes: the length must be a non-zero multiple of {SLAB_ALIGN}"
        );
        let layout = Self::layout(len);
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        if layout.align() == HUGE_ALIGN {
            // Before the first touch; a refusal only means base pages.
            // SAFETY: the range is exactly this allocation.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `len` bytes were just allocated.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        let align = if len >= HUGE_ALIGN {
            HUGE_ALIGN
        } else {
            SLAB_ALIGN
        };
        Layout::from_size_align(len, align).expect("buffer layout")
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `deref`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AlignedBuf({:p}, {} bytes)", self.ptr, self.len)
    }
}

/// Counts of a slab's transfers since it was created.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SlabCounters {
    pub bytes_written: u64,
    pub bytes_read: u64,
    /// Reads and writes submitted (ring entries or system calls).
    pub submissions: u64,
    /// Submissions that moved fewer bytes than asked and were continued.
    pub short_transfers: u64,
    /// Submissions repeated after EINTR/EAGAIN, and ring waits repeated
    /// after the kernel was busy.
    pub retries: u64,
    /// Calls that ended with an I/O error.
    pub errors: u64,
}

/// How transfers reach the kernel.
enum Driver {
    Ring(Box<IoUring>),
    /// io_uring could not be set up: blocking pread/pwrite, one at a time.
    Positional,
}

/// One bounded piece of a transfer.
struct Piece {
    /// Slab offset of the piece's first byte.
    offset: u64,
    ptr: *mut u8,
    len: usize,
    done: usize,
}

/// Result of one submission of a piece.
enum Step {
    Complete,
    Continue,
    Failed(io::Error),
}

/// The GDS L1 slab file of one shard. See the module docs.
pub struct GdsSlab {
    file: File,
    /// Holds the exclusive `flock` that marks the slab as in use.
    _lock: File,
    path: PathBuf,
    shard_index: usize,
    size_bytes: u64,
    direct_io: bool,
    filesystem: FsType,
    driver: Driver,
    /// Reused by every call, so transfers do not allocate once warm.
    pieces: Vec<Piece>,
    again: VecDeque<usize>,
    counters: SlabCounters,
}

// SAFETY: `pieces` holds raw pointers only during a call (it is cleared
// before every return); the rest (File, IoUring, plain data) is Send.
unsafe impl Send for GdsSlab {}

impl GdsSlab {
    /// The slab file name of `shard_index` (see the module docs).
    pub fn file_name(shard_index: usize) -> String {
        format!("lmcache_gds_slab.{shard_index}.bin")
    }

    /// Creates (`mkdir -p`) `dir`, then creates or truncates this shard's
    /// slab file there, preallocates `size_bytes` rounded up to
    /// [`SLAB_ALIGN`], and reopens it for direct I/O when asked.
    ///
    /// With `direct_io`, a filesystem that refuses O_DIRECT (EINVAL on open)
    /// fails with [`SlabError::DirectIoRefused`], and so do tmpfs and ramfs:
    /// kernels from 6.6 accept O_DIRECT there but still copy through the
    /// page cache, older ones refuse it, and the slab behaves the same on
    /// every kernel.
    pub fn create(
        dir: &Path,
        shard_index: usize,
        size_bytes: u64,
        options: SlabOptions,
    ) -> Result<GdsSlab, SlabError> {
        Self::create_with(dir, shard_index, size_bytes, options, true)
    }

    fn create_with(
        dir: &Path,
        shard_index: usize,
        size_bytes: u64,
        options: SlabOptions,
        use_ring: bool,
    ) -> Result<GdsSlab, SlabError> {
        let align = SLAB_ALIGN as u64;
        if size_bytes < align {
            return Err(SlabError::TooSmall { size_bytes });
        }
        let size = size_bytes
            .checked_next_multiple_of(align)
            .filter(|&s| s <= i64::MAX as u64)
            .ok_or(SlabError::TooSmall { size_bytes })?;
        let path = dir.join(Self::file_name(shard_index));
        let create_err = |what: &str, e: io::Error| SlabError::Io {
            op: SlabOp::Create,
            path: path.clone(),
            offset: 0,
            len: size,
            source: io::Error::new(e.kind(), format!("{what}: {e}")),
        };
        fs::create_dir_all(dir).map_err(|e| SlabError::Io {
            op: SlabOp::Create,
            path: dir.to_owned(),
            offset: 0,
            len: size,
            source: io::Error::new(e.kind(), format!("mkdir -p: {e}")),
        })?;
        let filesystem = FsType::of(dir).map_err(|e| SlabError::Io {
            op: SlabOp::Create,
            path: dir.to_owned(),
            offset: 0,
            len: size,
            source: io::Error::new(e.kind(), format!("statfs: {e}")),
        })?;
        // Refused before the file is made, so nothing lands in memory.
        if options.direct_io && filesystem.is_memory() {
            return Err(SlabError::DirectIoRefused {
                path,
                filesystem,
                cause: None,
            });
        }
        // Opened without O_TRUNC: the file is only emptied once this process
        // holds its lock, so a second server pointed at the same directory
        // is refused instead of truncating a live server's objects.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(|e| create_err("open O_CREAT|O_RDWR", e))?;
        if !try_lock(file.as_raw_fd()).map_err(|e| create_err("flock", e))? {
            let holder = holder_of(file.as_raw_fd());
            return Err(SlabError::InUse { path, holder });
        }
        // Space of a slab that failed to come up is given back.
        let remove = |what: &str, e: io::Error| {
            let _ = fs::remove_file(&path);
            create_err(what, e)
        };
        // What an earlier run left is gone (0.5.6 opens with O_TRUNC).
        file.set_len(0).map_err(|e| remove("ftruncate", e))?;
        // posix_fallocate returns the error number instead of setting errno.
        // SAFETY: an open descriptor; the size is checked to fit off_t.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
        if r != 0 {
            return Err(remove("posix_fallocate", io::Error::from_raw_os_error(r)));
        }
        // The descriptor that holds the lock stays open for the slab's life;
        // transfers go through a second one when O_DIRECT is asked for.
        let lock = file;
        let file = if options.direct_io {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    let _ = fs::remove_file(&path);
                    return Err(SlabError::DirectIoRefused {
                        path,
                        filesystem,
                        cause: Some(e),
                    });
                }
                Err(e) => return Err(remove("open O_RDWR|O_DIRECT", e)),
            }
        } else {
            lock.try_clone().map_err(|e| remove("dup", e))?
        };
        let driver = if use_ring {
            match IoUring::new(RING_DEPTH as u32) {
                Ok(r) => Driver::Ring(Box::new(r)),
                Err(e) => {
                    log::warn!(
                        "gds slab {}: io_uring unavailable ({e}); transfers run one pread/pwrite at a time",
                        path.display()
                    );
                    Driver::Positional
                }
            }
        } else {
            Driver::Positional
        };
        let slab = GdsSlab {
            file,
            _lock: lock,
            path,
            shard_index,
            size_bytes: size,
            direct_io: options.direct_io,
            filesystem,
            driver,
            pieces: Vec::with_capacity(RING_DEPTH),
            again: VecDeque::with_capacity(RING_DEPTH),
            counters: SlabCounters::default(),
        };
        log::info!("{}", slab.describe());
        Ok(slab)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn shard_index(&self) -> usize {
        self.shard_index
    }

    /// The slab size: the requested size rounded up to [`SLAB_ALIGN`].
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    pub fn filesystem(&self) -> FsType {
        self.filesystem
    }

    /// Whether transfers go through io_uring (else pread/pwrite).
    pub fn uses_io_uring(&self) -> bool {
        matches!(self.driver, Driver::Ring(_))
    }

    pub fn counters(&self) -> SlabCounters {
        self.counters
    }

    /// One line for logs and status.
    pub fn describe(&self) -> String {
        let c = &self.counters;
        format!(
            "gds slab (shard {}): {} ({}), size_bytes={}, direct_io={}, {}, \
             submissions <= {} MiB; written {} B, read {} B, {} submissions, {} short, {} retries, {} errors",
            self.shard_index,
            self.path.display(),
            self.filesystem,
            self.size_bytes,
            self.direct_io,
            match self.driver {
                Driver::Ring(_) => format!("io_uring, {RING_DEPTH} in flight"),
                Driver::Positional => "pread/pwrite (io_uring unavailable)".to_owned(),
            },
            MAX_SUBMISSION_BYTES >> 20,
            c.bytes_written,
            c.bytes_read,
            c.submissions,
            c.short_transfers,
            c.retries,
            c.errors,
        )
    }

    /// Writes `buf` at slab `offset`.
    pub fn write_at(&mut self, offset: u64, buf: &[u8]) -> Result<(), SlabError> {
        self.write_many(&[(offset, buf)])
    }

    /// Reads slab `offset..offset + buf.len()` into `buf`.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), SlabError> {
        self.read_many(&mut [(offset, buf)])
    }

    /// Writes every `(offset, bytes)` with pieces of all of them in flight
    /// together. All ranges are checked first; on a refusal nothing is
    /// written. After an I/O error the slab bytes of the batch are
    /// unspecified.
    pub fn write_many(&mut self, ops: &[(u64, &[u8])]) -> Result<(), SlabError> {
        for (offset, buf) in ops {
            self.check(SlabOp::Write, *offset, buf.as_ptr() as usize, buf.len())?;
        }
        check_no_overlap(ops)?;
        for (offset, buf) in ops {
            // The kernel only reads through this pointer for a write.
            self.push_pieces(*offset, buf.as_ptr() as *mut u8, buf.len());
        }
        self.run(SlabOp::Write)
    }

    /// Reads every `(offset, buffer)`, with pieces of all of them in flight
    /// together. All ranges are checked first; on a refusal nothing is
    /// read. After an I/O error the buffers' contents are unspecified.
    pub fn read_many(&mut self, ops: &mut [(u64, &mut [u8])]) -> Result<(), SlabError> {
        for (offset, buf) in ops.iter() {
            self.check(SlabOp::Read, *offset, buf.as_ptr() as usize, buf.len())?;
        }
        for (offset, buf) in ops.iter_mut() {
            self.push_pieces(*offset, buf.as_mut_ptr(), buf.len());
        }
        self.run(SlabOp::Read)
    }

    fn check(&self, op: SlabOp, offset: u64, addr: usize, len: usize) -> Result<(), SlabError> {
        let misaligned = |what, value: u64| Err(SlabError::Misaligned { op, what, value });
        if offset % SLAB_ALIGN as u64 != 0 {
            return misaligned(Misalignment::Offset, offset);
        }
        if len % SLAB_ALIGN != 0 {
            return misaligned(Misalignment::Length, len as u64);
        }
        // An empty slice's address is dangling and never used.
        if len > 0 && addr % SLAB_ALIGN != 0 {
            return misaligned(Misalignment::BufferAddress, addr as u64);
        }
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.size_bytes)
        {
            return Err(SlabError::OutOfRange {
                op,
                offset,
                len: len as u64,
                slab_bytes: self.size_bytes,
            });
        }
        Ok(())
    }

    fn push_pieces(&mut self, offset: u64, ptr: *mut u8, len: usize) {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(MAX_SUBMISSION_BYTES);
            self.pieces.push(Piece {
                offset: offset + at as u64,
                // SAFETY: `at < len`, inside the caller's buffer.
                ptr: unsafe { ptr.add(at) },
                len: n,
                done: 0,
            });
            at += n;
        }
    }

    /// Moves every queued piece, then clears the queue (also on error, so no
    /// pointer into a caller buffer outlives the call).
    fn run(&mut self, op: SlabOp) -> Result<(), SlabError> {
        let result = match self.driver {
            Driver::Ring(_) => self.run_ring(op),
            Driver::Positional => self.run_positional(op),
        };
        if result.is_ok() {
            let moved: u64 = self.pieces.iter().map(|p| p.len as u64).sum();
            match op {
                SlabOp::Write => self.counters.bytes_written += moved,
                _ => self.counters.bytes_read += moved,
            }
        } else {
            self.counters.errors += 1;
        }
        self.pieces.clear();
        self.again.clear();
        result
    }

    fn run_ring(&mut self, op: SlabOp) -> Result<(), SlabError> {
        let fd = types::Fd(self.file.as_raw_fd());
        let GdsSlab {
            driver,
            pieces,
            again,
            counters,
            path,
            ..
        } = self;
        let Driver::Ring(ring) = driver else {
            unreachable!("run_ring without a ring")
        };
        let mut next = 0usize;
        let mut in_flight = 0usize;
        let mut first_err: Option<SlabError> = None;
        loop {
            // After an error only the requests in flight are waited for.
            while first_err.is_none() && in_flight < RING_DEPTH {
                let i = match again.pop_front() {
                    Some(i) => i,
                    None if next < pieces.len() => {
                        next += 1;
                        next - 1
                    }
                    None => break,
                };
                let p = &pieces[i];
                let n = (p.len - p.done) as u32;
                // SAFETY: the range lies inside the caller's buffer, which
                // outlives the request: this call waits for every request it
                // queued before returning.
                let sqe = unsafe {
                    let buf = p.ptr.add(p.done);
                    let at = p.offset + p.done as u64;
                    match op {
                        SlabOp::Write => opcode::Write::new(fd, buf, n).offset(at).build(),
                        _ => opcode::Read::new(fd, buf, n).offset(at).build(),
                    }
                }
                .user_data(i as u64);
                // SAFETY: see above.
                if unsafe { ring.submission().push(&sqe) }.is_err() {
                    again.push_front(i);
                    break;
                }
                in_flight += 1;
                counters.submissions += 1;
            }
            if in_flight == 0 {
                break;
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                    counters.retries += 1;
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                // Requests in flight still point into the caller's buffers;
                // returning would let the kernel write into memory the
                // caller may reuse. Not expected with a valid ring.
                Err(e) => panic!(
                    "gds slab {}: io_uring_enter failed with {in_flight} requests in flight: {e}",
                    path.display()
                ),
            }
            for cqe in ring.completion() {
                in_flight -= 1;
                let i = cqe.user_data() as usize;
                let p = &mut pieces[i];
                match step(op, p, cqe.result() as isize, counters) {
                    Step::Complete => {}
                    Step::Continue => again.push_back(i),
                    Step::Failed(e) => {
                        if first_err.is_none() {
                            first_err = Some(piece_error(op, path, p, e));
                        }
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => {
                assert!(
                    pieces.iter().all(|p| p.done == p.len),
                    "gds slab: a transfer ended with pieces not done"
                );
                Ok(())
            }
        }
    }

    fn run_positional(&mut self, op: SlabOp) -> Result<(), SlabError> {
        let fd = self.file.as_raw_fd();
        for i in 0..self.pieces.len() {
            loop {
                let p = &mut self.pieces[i];
                if p.done == p.len {
                    break;
                }
                self.counters.submissions += 1;
                // SAFETY: the range lies inside the caller's buffer.
                let r = unsafe {
                    let buf = p.ptr.add(p.done).cast::<libc::c_void>();
                    let n = p.len - p.done;
                    let at = (p.offset + p.done as u64) as libc::off_t;
                    match op {
                        SlabOp::Write => libc::pwrite(fd, buf, n, at),
                        _ => libc::pread(fd, buf, n, at),
                    }
                };
                let res = if r < 0 {
                    -(io::Error::last_os_error()
                        .raw_os_error()
                        .unwrap_or(libc::EIO) as isize)
                } else {
                    r
                };
                match step(op, p, res, &mut self.counters) {
                    Step::Complete | Step::Continue => {}
                    Step::Failed(e) => return Err(piece_error(op, &self.path, p, e)),
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for GdsSlab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Accounts one completed submission of `p`: `res` is bytes moved or a
/// negated errno.
fn step(op: SlabOp, p: &mut Piece, res: isize, counters: &mut SlabCounters) -> Step {
    if res > 0 {
        let n = res as usize;
        assert!(
            n <= p.len - p.done,
            "the kernel reported {n} bytes for a request of {}",
            p.len - p.done
        );
        p.done += n;
        if p.done == p.len {
            return Step::Complete;
        }
        // The rest starts where the kernel stopped; an O_DIRECT device stops
        // at its block boundaries, so it stays aligned for it.
        counters.short_transfers += 1;
        return Step::Continue;
    }
    if res == 0 {
        return Step::Failed(match op {
            SlabOp::Write => io::Error::new(
                io::ErrorKind::WriteZero,
                "the kernel wrote 0 bytes (is the filesystem full?)",
            ),
            _ => io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the slab file ends before the slab does (was it truncated by another process?)",
            ),
        });
    }
    let errno = (-res) as i32;
    if errno == libc::EINTR || errno == libc::EAGAIN {
        counters.retries += 1;
        return Step::Continue;
    }
    Step::Failed(io::Error::from_raw_os_error(errno))
}

fn piece_error(op: SlabOp, path: &Path, p: &Piece, e: io::Error) -> SlabError {
    SlabError::Io {
        op,
        path: path.to_owned(),
        offset: p.offset + p.done as u64,
        len: (p.len - p.done) as u64,
        source: e,
    }
}

/// Refuses a write batch whose ranges overlap.
fn check_no_overlap(ops: &[(u64, &[u8])]) -> Result<(), SlabError> {
    if ops.len() < 2 {
        return Ok(());
    }
    let mut ranges: Vec<(u64, u64)> = ops
        .iter()
        .filter(|(_, b)| !b.is_empty())
        .map(|(o, b)| (*o, *o + b.len() as u64))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(SlabError::OverlappingWrites {
                first: w[0].0,
                second: w[1].0,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory on the disk that holds the build (tmpfs would not
    /// test O_DIRECT), removed when dropped.
    struct DiskDir(PathBuf);

    impl DiskDir {
        fn new(name: &str) -> DiskDir {
            let d = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/tmp")
                .join(format!("gds-slab-unit-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            let t = FsType::of(&d).unwrap();
            assert!(!t.is_memory(), "{} is on {t}, not a disk", d.display());
            DiskDir(d)
        }
    }

    impl Drop for DiskDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn pattern(buf: &mut [u8], seed: u8) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8;
        }
    }

    #[test]
    fn slab_size_rounds_up_and_small_sizes_are_refused() {
        let d = DiskDir::new("size");
        let s = GdsSlab::create(&d.0, 0, 4096 + 1, SlabOptions::default()).unwrap();
        assert_eq!(s.size_bytes(), 8192);
        assert_eq!(fs::metadata(s.path()).unwrap().len(), 8192);
        for size in [0, 1, 4095] {
            let e = GdsSlab::create(&d.0, 1, size, SlabOptions::default()).unwrap_err();
            assert!(matches!(e, SlabError::TooSmall { size_bytes } if size_bytes == size));
            assert!(e.to_string().contains("at least one 4096-byte page"), "{e}");
        }
        let e = GdsSlab::create(&d.0, 1, u64::MAX, SlabOptions::default()).unwrap_err();
        assert!(matches!(e, SlabError::TooSmall { .. }), "{e}");
    }

    #[test]
    fn slab_pieces_are_bounded() {
        let d = DiskDir::new("pieces");
        let mut s = GdsSlab::create(&d.0, 0, 64 << 20, SlabOptions::default()).unwrap();
        let buf = AlignedBuf::zeroed(40 << 20);
        s.push_pieces(8192, buf.as_ptr() as *mut u8, buf.len());
        let lens: Vec<usize> = s.pieces.iter().map(|p| p.len).collect();
        assert_eq!(lens, [16 << 20, 16 << 20, 8 << 20]);
        assert_eq!(s.pieces[2].offset, 8192 + (32 << 20));
        s.pieces.clear();
    }

    #[test]
    fn slab_positional_driver_round_trip() {
        let d = DiskDir::new("positional");
        let mut s = GdsSlab::create_with(&d.0, 3, 48 << 20, SlabOptions::default(), false).unwrap();
        assert!(!s.uses_io_uring());
        assert!(s.describe().contains("pread/pwrite"), "{}", s.describe());
        let mut a = AlignedBuf::zeroed(20 << 20);
        pattern(&mut a, 7);
        let mut b = AlignedBuf::zeroed(4096);
        pattern(&mut b, 9);
        s.write_many(&[(4096, &a), (40 << 20, &b)]).unwrap();
        let mut ra = AlignedBuf::zeroed(20 << 20);
        let mut rb = AlignedBuf::zeroed(4096);
        s.read_many(&mut [(4096, &mut ra), (40 << 20, &mut rb)])
            .unwrap();
        assert!(ra[..] == a[..]);
        assert!(rb[..] == b[..]);
        let c = s.counters();
        assert_eq!(c.bytes_written, (20 << 20) + 4096);
        assert_eq!(c.bytes_read, (20 << 20) + 4096);
        // 20 MiB is two pieces, plus one for the page, each way.
        assert_eq!(c.submissions, 6);
    }

    #[test]
    fn slab_shrunk_file_gives_eof_error_on_both_drivers() {
        for use_ring in [true, false] {
            let d = DiskDir::new(if use_ring { "eof-ring" } else { "eof-pos" });
            let mut s =
                GdsSlab::create_with(&d.0, 0, 1 << 20, SlabOptions::default(), use_ring).unwrap();
            let mut w = AlignedBuf::zeroed(1 << 20);
            pattern(&mut w, 1);
            s.write_at(0, &w).unwrap();
            // Another process shrinks the file behind the slab's back.
            fs::OpenOptions::new()
                .write(true)
                .open(s.path())
                .unwrap()
                .set_len(256 << 10)
                .unwrap();
            let mut r = AlignedBuf::zeroed(1 << 20);
            let e = s.read_at(0, &mut r).unwrap_err();
            match &e {
                SlabError::Io {
                    op: SlabOp::Read,
                    offset,
                    source,
                    ..
                } => {
                    assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof, "{e}");
                    assert_eq!(*offset, 256 << 10, "{e}");
                }
                _ => panic!("unexpected error {e}"),
            }
            assert!(s.counters().short_transfers >= 1, "{:?}", s.counters());
            assert_eq!(s.counters().errors, 1);
            assert!(r[..256 << 10] == w[..256 << 10]);
        }
    }

    #[test]
    fn slab_overlapping_writes_in_one_batch_are_refused() {
        let d = DiskDir::new("overlap");
        let mut s = GdsSlab::create(&d.0, 0, 1 << 20, SlabOptions::default()).unwrap();
        let a = AlignedBuf::zeroed(16384);
        let b = AlignedBuf::zeroed(4096);
        let e = s.write_many(&[(0, &a), (12288, &b)]).unwrap_err();
        assert!(
            matches!(
                e,
                SlabError::OverlappingWrites {
                    first: 0,
                    second: 12288
                }
            ),
            "{e}"
        );
        assert_eq!(s.counters().submissions, 0);
        // Adjacent ranges are fine, and so is an empty one anywhere.
        s.write_many(&[(0, &a), (16384, &b), (8192, &[])]).unwrap();
        assert_eq!(s.counters().bytes_written, 16384 + 4096);
    }

    #[test]
    fn slab_aligned_buf_alignment() {
        let small = AlignedBuf::zeroed(8192);
        assert_eq!(small.as_ptr() as usize % SLAB_ALIGN, 0);
        assert!(small.iter().all(|&x| x == 0));
        let big = AlignedBuf::zeroed(4 << 20);
        assert_eq!(big.as_ptr() as usize % HUGE_ALIGN, 0);
        assert_eq!(big.len(), 4 << 20);
    }

    #[test]
    #[should_panic(expected = "non-zero multiple of 4096")]
    fn slab_aligned_buf_refuses_odd_length() {
        let _ = AlignedBuf::zeroed(100);
    }
}
