//! Device-DAX L1: the L1 arena mapped from a `/dev/daxX.Y` character device
//! (persistent memory or CXL memory exposed as device-DAX) or from any
//! mmap-able regular file (an fsdax file, or a plain file in tests).
//!
//! lmcache 0.5.6 (`--l1-devdax-path`) opens the path `O_RDWR`, checks
//! `size <= st_size` for regular files, and maps `size` bytes `MAP_SHARED` at
//! offset 0. kvshard does the same, and also rounds the length down to the
//! device's alignment (usually 2 MiB, read from sysfs): device-DAX refuses a
//! mapping whose length is not a multiple of it with EINVAL, which 0.5.6
//! leaves to the operator to discover.
//!
//! Nothing here makes the bytes persistent: the server keeps its index in
//! memory, so a restart on the same device starts with an empty L1.

use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use kvshard_io::arena::{map_region, page_size, ArenaRegion};
use kvshard_io::shm_segment::try_lock;

/// Alignment assumed for a device-DAX device whose sysfs `align` cannot be
/// read: the kernel's default for device-DAX (one PMD page on x86-64/aarch64).
pub const DEFAULT_DAX_ALIGN_BYTES: usize = 2 << 20;

/// What the path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DaxKind {
    /// A device-DAX character device (`/dev/daxX.Y`).
    CharDevice,
    /// A regular file (on an fsdax mount, or any filesystem).
    File,
}

impl DaxKind {
    /// The name /status and logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            DaxKind::CharDevice => "devdax",
            DaxKind::File => "file",
        }
    }
}

/// Why a path could not be mapped as the L1 arena.
#[derive(Debug)]
pub enum DaxError {
    /// Nothing exists at the path.
    NotFound { path: PathBuf },
    /// The path is a directory.
    IsDirectory { path: PathBuf },
    /// The path is neither a character device nor a regular file (a block
    /// device, FIFO, socket...).
    UnsupportedFileType { path: PathBuf, file_type: String },
    /// A character device that sysfs says is not a device-DAX device.
    NotDax { path: PathBuf, subsystem: String },
    /// Another open region (another server) holds the path: two arenas on
    /// one device would overwrite each other's chunks.
    InUse { path: PathBuf },
    /// The process may not open the path for reading and writing.
    PermissionDenied { path: PathBuf, source: io::Error },
    /// A regular file shorter than the requested arena.
    FileTooSmall {
        path: PathBuf,
        file_bytes: u64,
        needed_bytes: u64,
    },
    /// A device smaller than the requested arena (size from sysfs).
    DeviceTooSmall {
        path: PathBuf,
        device_bytes: u64,
        needed_bytes: u64,
    },
    /// The requested size rounds down to nothing at the region's alignment.
    SmallerThanAlignment {
        path: PathBuf,
        size_bytes: u64,
        align_bytes: usize,
    },
    /// mmap refused; `align_bytes` is the alignment the length was rounded to.
    Mmap {
        path: PathBuf,
        len: usize,
        align_bytes: usize,
        source: io::Error,
    },
    /// Another system call failed.
    Os {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl fmt::Display for DaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DaxError::NotFound { path } => write!(
                f,
                "--l1-devdax-path {}: no such file or device; give a /dev/daxX.Y device or an \
                 existing file of at least --l1-size-gb",
                path.display()
            ),
            DaxError::IsDirectory { path } => write!(
                f,
                "--l1-devdax-path {}: is a directory; give a /dev/daxX.Y device or a file inside \
                 it (create one with `fallocate -l SIZE FILE`)",
                path.display()
            ),
            DaxError::UnsupportedFileType { path, file_type } => write!(
                f,
                "--l1-devdax-path {}: is a {file_type}; only a device-DAX character device \
                 (/dev/daxX.Y) or a regular file can back the L1 arena",
                path.display()
            ),
            DaxError::NotDax { path, subsystem } => write!(
                f,
                "--l1-devdax-path {}: is a character device of the '{subsystem}' subsystem, not a \
                 device-DAX device (/dev/daxX.Y, see `daxctl list`)",
                path.display()
            ),
            DaxError::InUse { path } => write!(
                f,
                "--l1-devdax-path {}: in use by another kvshard server (it holds an exclusive \
                 flock on it); give each server its own device or file",
                path.display()
            ),
            DaxError::PermissionDenied { path, source } => write!(
                f,
                "--l1-devdax-path {}: cannot open for reading and writing: {source}; the server \
                 needs read-write access to it",
                path.display()
            ),
            DaxError::FileTooSmall {
                path,
                file_bytes,
                needed_bytes,
            } => write!(
                f,
                "--l1-devdax-path {}: the file is {file_bytes} bytes but --l1-size-gb needs \
                 {needed_bytes} bytes; grow it (fallocate -l {needed_bytes} {}) or lower \
                 --l1-size-gb",
                path.display(),
                path.display()
            ),
            DaxError::DeviceTooSmall {
                path,
                device_bytes,
                needed_bytes,
            } => write!(
                f,
                "--l1-devdax-path {}: the device holds {device_bytes} bytes but --l1-size-gb needs \
                 {needed_bytes} bytes; lower --l1-size-gb",
                path.display()
            ),
            DaxError::SmallerThanAlignment {
                path,
                size_bytes,
                align_bytes,
            } => write!(
                f,
                "--l1-devdax-path {}: --l1-size-gb gives {size_bytes} bytes, less than one \
                 alignment unit of {align_bytes} bytes, so nothing can be mapped; raise \
                 --l1-size-gb",
                path.display()
            ),
            DaxError::Mmap {
                path,
                len,
                align_bytes,
                source,
            } => {
                write!(
                    f,
                    "--l1-devdax-path {}: mmap of {len} bytes failed: {source}",
                    path.display()
                )?;
                if source.raw_os_error() == Some(libc::EINVAL) {
                    write!(
                        f,
                        " (the length is a multiple of {align_bytes} bytes, the alignment \
                         kvshard assumed; check the device's alignment in \
                         /sys/bus/dax/devices/<dev>/align)"
                    )?;
                }
                Ok(())
            }
            DaxError::Os { op, path, source } => write!(
                f,
                "--l1-devdax-path {}: {op} failed: {source}",
                path.display()
            ),
        }
    }
}

impl std::error::Error for DaxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DaxError::PermissionDenied { source, .. }
            | DaxError::Mmap { source, .. }
            | DaxError::Os { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A `MAP_SHARED` read-write mapping of a device-DAX device or file, from
/// offset 0. Unmapped on drop.
pub struct DaxRegion {
    base: NonNull<u8>,
    len: usize,
    path: PathBuf,
    kind: DaxKind,
    align_bytes: usize,
    /// Kept open for its exclusive flock, which marks the path as taken.
    _file: std::fs::File,
}

// SAFETY: the region only holds the address of a shared mapping that stays
// valid until drop; who reads or writes which bytes is up to the owner (the
// L1 arena gives each shard a disjoint slice), as for `kvshard_io::arena::Arena`.
unsafe impl Send for DaxRegion {}
// SAFETY: see `Send`: no method mutates the value itself.
unsafe impl Sync for DaxRegion {}

impl fmt::Debug for DaxRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DaxRegion")
            .field("path", &self.path)
            .field("kind", &self.kind)
            .field("base", &self.base)
            .field("len", &self.len)
            .field("align_bytes", &self.align_bytes)
            .finish()
    }
}

/// The sysfs directories that may describe the character device `rdev` at
/// `path`: the device node's own entry, then the dax bus entry by name.
fn sysfs_dirs(path: &Path, rdev: u64) -> Vec<PathBuf> {
    let (major, minor) = (
        libc::major(rdev as libc::dev_t),
        libc::minor(rdev as libc::dev_t),
    );
    let mut dirs = vec![PathBuf::from(format!("/sys/dev/char/{major}:{minor}"))];
    if let Some(name) = path.file_name() {
        dirs.push(Path::new("/sys/bus/dax/devices").join(name));
    }
    dirs
}

fn read_sysfs_u64(dirs: &[PathBuf], attr: &str) -> Option<u64> {
    dirs.iter().find_map(|d| {
        let s = std::fs::read_to_string(d.join(attr)).ok()?;
        let s = s.trim();
        match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => s.parse().ok(),
        }
    })
}

/// The subsystem a character device belongs to ("dax" for device-DAX), when
/// sysfs tells.
fn sysfs_subsystem(dirs: &[PathBuf]) -> Option<String> {
    dirs.iter().find_map(|d| {
        let link = std::fs::read_link(d.join("subsystem")).ok()?;
        Some(link.file_name()?.to_string_lossy().into_owned())
    })
}

/// `size` rounded down to a multiple of `align` (a power of two or any
/// non-zero value).
pub fn round_down(size: u64, align: usize) -> u64 {
    assert!(align > 0, "alignment must be > 0");
    size - size % align as u64
}

impl DaxRegion {
    /// Maps `size_bytes` (rounded down to the region's alignment) of `path`.
    ///
    /// A character device takes its alignment and size from sysfs (alignment
    /// [`DEFAULT_DAX_ALIGN_BYTES`] when unreadable; no size check when the size
    /// is unreadable, as 0.5.6 does none). A regular file must already be at
    /// least `size_bytes` long: mapping past its end would raise SIGBUS on
    /// first touch, so the file is never grown here.
    pub fn map(path: &Path, size_bytes: u64) -> Result<DaxRegion, DaxError> {
        let path_buf = path.to_path_buf();
        let os = |op: &'static str, source: io::Error| DaxError::Os {
            op,
            path: path_buf.clone(),
            source,
        };
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(DaxError::NotFound { path: path_buf })
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return Err(DaxError::PermissionDenied {
                    path: path_buf,
                    source: e,
                })
            }
            Err(e) => return Err(os("stat", e)),
        };
        let ft = meta.file_type();
        if ft.is_dir() {
            return Err(DaxError::IsDirectory { path: path_buf });
        }
        if !ft.is_char_device() && !ft.is_file() {
            let file_type = if ft.is_block_device() {
                "block device"
            } else if ft.is_fifo() {
                "FIFO"
            } else if ft.is_socket() {
                "socket"
            } else {
                "special file"
            };
            return Err(DaxError::UnsupportedFileType {
                path: path_buf,
                file_type: file_type.into(),
            });
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::PermissionDenied => DaxError::PermissionDenied {
                    path: path_buf.clone(),
                    source: e,
                },
                io::ErrorKind::NotFound => DaxError::NotFound {
                    path: path_buf.clone(),
                },
                _ => os("open(O_RDWR)", e),
            })?;
        // The lock goes with the fd, which the region keeps open.
        if !try_lock(file.as_raw_fd()).map_err(|e| os("flock", e))? {
            return Err(DaxError::InUse { path: path_buf });
        }
        // What was opened, not what was stat'ed before (the path may have changed).
        let meta = file.metadata().map_err(|e| os("fstat", e))?;
        let ft = meta.file_type();
        let (kind, align_bytes) = if ft.is_char_device() {
            let dirs = sysfs_dirs(path, meta.rdev());
            if let Some(subsystem) = sysfs_subsystem(&dirs) {
                if subsystem != "dax" {
                    return Err(DaxError::NotDax {
                        path: path_buf,
                        subsystem,
                    });
                }
            }
            let align = read_sysfs_u64(&dirs, "align")
                .and_then(|a| usize::try_from(a).ok())
                .filter(|a| *a > 0)
                .unwrap_or_else(|| {
                    log::info!(
                        "{}: no readable sysfs align attribute; assuming {} bytes",
                        path.display(),
                        DEFAULT_DAX_ALIGN_BYTES
                    );
                    DEFAULT_DAX_ALIGN_BYTES
                });
            if let Some(device_bytes) = read_sysfs_u64(&dirs, "size") {
                if size_bytes > device_bytes {
                    return Err(DaxError::DeviceTooSmall {
                        path: path_buf,
                        device_bytes,
                        needed_bytes: size_bytes,
                    });
                }
            }
            (DaxKind::CharDevice, align)
        } else if ft.is_file() {
            if meta.len() < size_bytes {
                return Err(DaxError::FileTooSmall {
                    path: path_buf,
                    file_bytes: meta.len(),
                    needed_bytes: size_bytes,
                });
            }
            (DaxKind::File, page_size())
        } else {
            return Err(DaxError::UnsupportedFileType {
                path: path_buf,
                file_type: "special file".into(),
            });
        };

        let rounded = round_down(size_bytes, align_bytes);
        if rounded == 0 {
            return Err(DaxError::SmallerThanAlignment {
                path: path_buf,
                size_bytes,
                align_bytes,
            });
        }
        if rounded != size_bytes {
            log::info!(
                "{}: L1 arena of {size_bytes} bytes rounded down to {rounded} bytes, a multiple \
                 of the {align_bytes}-byte alignment",
                path.display()
            );
        }
        let len = usize::try_from(rounded)
            .ok()
            .filter(|l| *l <= isize::MAX as usize)
            .ok_or_else(|| {
                os(
                    "mmap",
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{rounded} bytes do not fit in the address space"),
                    ),
                )
            })?;
        let base =
            map_region(len, libc::MAP_SHARED, file.as_raw_fd(), false).map_err(|source| {
                DaxError::Mmap {
                    path: path_buf.clone(),
                    len,
                    align_bytes,
                    source,
                }
            })?;
        Ok(DaxRegion {
            base,
            len,
            path: path_buf,
            kind,
            align_bytes,
            _file: file,
        })
    }

    /// Start of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Mapped length in bytes: the requested size rounded down to the alignment.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an empty region is refused by [`DaxRegion::map`].
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn kind(&self) -> DaxKind {
        self.kind
    }

    /// The alignment the length was rounded to.
    pub fn align_bytes(&self) -> usize {
        self.align_bytes
    }

    /// msync(MS_SYNC) of the whole region: written bytes reach the file or device.
    pub fn sync(&self) -> io::Result<()> {
        // SAFETY: the range is exactly our mapping.
        let rc = unsafe { libc::msync(self.base.as_ptr().cast(), self.len, libc::MS_SYNC) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl ArenaRegion for DaxRegion {
    fn base(&self) -> *mut u8 {
        DaxRegion::base(self)
    }

    fn len(&self) -> usize {
        DaxRegion::len(self)
    }

    fn kind(&self) -> &'static str {
        self.kind.as_str()
    }

    fn path(&self) -> Option<&Path> {
        Some(&self.path)
    }

    fn describe(&self) -> String {
        let what = match self.kind {
            DaxKind::CharDevice => "device-DAX",
            DaxKind::File => "file",
        };
        format!(
            "{what} {} ({} bytes mapped shared, {}-byte alignment)",
            self.path.display(),
            self.len,
            self.align_bytes
        )
    }
}

impl Drop for DaxRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `map`; the owner
        // (the arena) holds no slice of it past its own drop.
        if unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) } != 0 {
            log::warn!(
                "munmap of {} failed: {}",
                self.path.display(),
                io::Error::last_os_error()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom};
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A path under the temp dir that is removed when dropped.
    struct TempPath(PathBuf);

    impl TempPath {
        fn new(tag: &str) -> TempPath {
            static SEQ: AtomicU32 = AtomicU32::new(0);
            TempPath(std::env::temp_dir().join(format!(
                "kvshard-devdax-{tag}-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            )))
        }

        fn file(tag: &str, len: u64) -> TempPath {
            let t = TempPath::new(tag);
            std::fs::File::create(&t.0).unwrap().set_len(len).unwrap();
            t
        }
    }

    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
            let _ = std::fs::remove_dir(&self.0);
        }
    }

    #[test]
    fn devdax_file_round_trips_bytes_through_the_file() {
        let page = page_size();
        let t = TempPath::file("rt", 4 * page as u64);
        let r = DaxRegion::map(&t.0, 4 * page as u64).unwrap();
        assert_eq!(r.kind(), DaxKind::File);
        assert_eq!(r.len(), 4 * page);
        assert_eq!(r.align_bytes(), page);
        let region: &dyn ArenaRegion = &r;
        assert_eq!(region.kind(), "file");
        assert_eq!(region.path(), Some(t.0.as_path()));
        assert!(region.describe().contains(&t.0.display().to_string()));

        // Written through the mapping, read back through read(2).
        let off = page + 123;
        unsafe {
            std::ptr::copy_nonoverlapping(b"devdax!".as_ptr(), r.base().add(off), 7);
        }
        r.sync().unwrap();
        let mut f = std::fs::File::open(&t.0).unwrap();
        f.seek(SeekFrom::Start(off as u64)).unwrap();
        let mut got = [0u8; 7];
        f.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"devdax!");

        // Written to the file, seen through the mapping (one shared page cache).
        std::fs::OpenOptions::new()
            .write(true)
            .open(&t.0)
            .and_then(|mut w| {
                use std::io::Write;
                w.seek(SeekFrom::Start(3 * page as u64))?;
                w.write_all(b"file->map")
            })
            .unwrap();
        let seen = unsafe { std::slice::from_raw_parts(r.base().add(3 * page), 9) };
        assert_eq!(seen, b"file->map");
    }

    #[test]
    fn devdax_file_larger_than_asked_maps_only_what_was_asked() {
        let page = page_size() as u64;
        let t = TempPath::file("bigger", 8 * page);
        let r = DaxRegion::map(&t.0, 2 * page).unwrap();
        assert_eq!(r.len() as u64, 2 * page);
    }

    #[test]
    fn devdax_too_small_file_is_refused_naming_both_sizes() {
        let page = page_size() as u64;
        let t = TempPath::file("small", 2 * page);
        let err = DaxRegion::map(&t.0, 3 * page).unwrap_err();
        match &err {
            DaxError::FileTooSmall {
                file_bytes,
                needed_bytes,
                ..
            } => {
                assert_eq!(*file_bytes, 2 * page);
                assert_eq!(*needed_bytes, 3 * page);
            }
            other => panic!("expected FileTooSmall, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&(2 * page).to_string()), "{msg}");
        assert!(msg.contains(&(3 * page).to_string()), "{msg}");
        assert!(msg.contains("fallocate -l"), "{msg}");
    }

    #[test]
    fn devdax_directory_and_missing_path_are_refused() {
        let d = TempPath::new("dir");
        std::fs::create_dir(&d.0).unwrap();
        let err = DaxRegion::map(&d.0, 4096).unwrap_err();
        assert!(matches!(err, DaxError::IsDirectory { .. }), "{err:?}");
        assert!(err.to_string().contains("is a directory"), "{err}");

        let missing = TempPath::new("missing");
        let err = DaxRegion::map(&missing.0, 4096).unwrap_err();
        assert!(matches!(err, DaxError::NotFound { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&missing.0.display().to_string()),
            "{err}"
        );
    }

    #[test]
    fn devdax_unwritable_file_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let t = TempPath::file("ro", 4096);
        std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o400)).unwrap();
        // Root ignores file modes; the check is only meaningful for others.
        if std::fs::OpenOptions::new().write(true).open(&t.0).is_ok() {
            return;
        }
        let err = DaxRegion::map(&t.0, 4096).unwrap_err();
        assert!(matches!(err, DaxError::PermissionDenied { .. }), "{err:?}");
        assert!(err.to_string().contains("reading and writing"), "{err}");
    }

    #[test]
    fn devdax_size_is_rounded_down_to_the_alignment_and_refused_below_it() {
        let page = page_size() as u64;
        let t = TempPath::file("round", 4 * page);
        let r = DaxRegion::map(&t.0, 2 * page + 100).unwrap();
        assert_eq!(r.len() as u64, 2 * page);
        drop(r);
        let err = DaxRegion::map(&t.0, page - 1).unwrap_err();
        match &err {
            DaxError::SmallerThanAlignment {
                size_bytes,
                align_bytes,
                ..
            } => {
                assert_eq!(*size_bytes, page - 1);
                assert_eq!(*align_bytes as u64, page);
            }
            other => panic!("expected SmallerThanAlignment, got {other:?}"),
        }
        assert_eq!(round_down(5 << 20, 2 << 20), 4 << 20);
        assert_eq!(round_down(4 << 20, 2 << 20), 4 << 20);
        assert_eq!(round_down((2 << 20) - 1, 2 << 20), 0);
    }

    #[test]
    fn devdax_non_dax_character_device_is_refused_where_sysfs_tells() {
        // /dev/null is a character device of the "mem" subsystem.
        let null = Path::new("/dev/null");
        if !null.exists() {
            return;
        }
        let err = DaxRegion::map(null, 2 << 20).unwrap_err();
        let rdev = std::fs::metadata(null).unwrap().rdev();
        if sysfs_subsystem(&sysfs_dirs(null, rdev)).is_some() {
            assert!(matches!(err, DaxError::NotDax { .. }), "{err:?}");
            assert!(err.to_string().contains("not a device-DAX"), "{err}");
        }
    }

    #[test]
    fn devdax_path_is_held_until_the_region_drops() {
        let t = TempPath::file("held", 8192);
        let first = DaxRegion::map(&t.0, 8192).unwrap();
        let err = DaxRegion::map(&t.0, 8192).unwrap_err();
        assert!(matches!(err, DaxError::InUse { .. }), "{err:?}");
        assert!(err.to_string().contains("in use"), "{err}");
        drop(first);
        DaxRegion::map(&t.0, 8192).unwrap();
    }

    #[test]
    fn devdax_mmap_einval_names_the_alignment() {
        let e = DaxError::Mmap {
            path: "/dev/dax0.0".into(),
            len: 3 << 20,
            align_bytes: 1 << 20,
            source: io::Error::from_raw_os_error(libc::EINVAL),
        };
        let msg = e.to_string();
        assert!(msg.contains("1048576 bytes"), "{msg}");
        assert!(msg.contains("align"), "{msg}");
    }
}
