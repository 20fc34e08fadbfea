//! The L1 arena: one contiguous memory region that holds the whole L1 tier.
//!
//! Shards each own a disjoint slice of it. With a name, the region is a POSIX
//! shared-memory segment (`/dev/shm/<name>`) that engine_driven clients map
//! with Python's `SharedMemory(name, create=False)` and read or write at the
//! offsets the server hands out. Without a name it is private anonymous memory.
//!
//! Pages are allocated on first touch (tmpfs and anonymous memory are sparse),
//! which is what keeps a lazily used arena cheap; `populate` pre-faults it.
//!
//! Huge pages matter beyond TLB misses: a transfer into memory made of 4 KiB
//! pages touched one at a time is a scatter list of up to one segment per
//! page, and block devices split requests at their segment limit (254 on a
//! virtio disk), so O_DIRECT reads from L2 into such memory run as several
//! times more requests than into 2 MiB pages. [`HugePages`] picks how the
//! arena gets them.
//!
//! An arena can also sit on a mapping somebody else made and owns (an
//! [`ArenaRegion`], e.g. a device-DAX device): it is then split among the
//! shards the same way, but neither mapped nor unmapped here.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::path::Path;
use std::ptr::NonNull;

use crate::shm_segment::{OwnedSegment, SegmentError};

/// How to build an [`Arena`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaConfig {
    /// Size of the whole arena in bytes (must be > 0).
    pub size_bytes: u64,
    /// POSIX shm segment name without the leading '/'; `None` = private
    /// anonymous memory that no other process can map.
    pub shm_name: Option<String>,
    /// mlock the whole arena at creation (implies pre-faulting every page).
    pub mlock: bool,
    /// Pre-fault every page at creation instead of on first touch.
    pub populate: bool,
    /// Page size policy.
    pub huge_pages: HugePages,
}

/// Size of the huge pages the arena asks for (x86-64 and aarch64 PMD size).
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// How the arena is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// Base pages only.
    Off,
    /// Transparent huge pages where the kernel allows them: the mapping is
    /// 2 MiB-aligned and `MADV_HUGEPAGE`d before it is populated. Anonymous
    /// memory gets them when `/sys/kernel/mm/transparent_hugepage/enabled` is
    /// `always` or `madvise`; a shm segment when /dev/shm is mounted with
    /// `huge=advise`, `within_size` or `always`. Never an error: without
    /// kernel support the arena is simply made of base pages.
    Transparent,
    /// The pre-allocated 2 MiB hugetlb pool (`vm.nr_hugepages`), as lmcache
    /// 0.5.6's `--l1-use-hugepages`: anonymous arenas only, always populated,
    /// refused when the pool has too few free pages.
    Hugetlb,
}

impl HugePages {
    pub fn as_str(self) -> &'static str {
        match self {
            HugePages::Off => "off",
            HugePages::Transparent => "transparent",
            HugePages::Hugetlb => "hugetlb",
        }
    }
}

/// Why an arena could not be created or locked.
#[derive(Debug)]
pub enum ArenaError {
    /// The configuration cannot describe an arena (zero size, bad name...).
    InvalidConfig {
        name: Option<String>,
        size_bytes: u64,
        reason: String,
    },
    /// A live process holds the shm segment of that name (another server
    /// started with the same `--shm-name`).
    ShmInUse(SegmentError),
    /// `/dev/shm` has less free room than the arena needs.
    ShmNoSpace {
        name: String,
        size_bytes: u64,
        available_bytes: u64,
    },
    /// A system call failed.
    Os {
        op: &'static str,
        name: Option<String>,
        size_bytes: u64,
        source: io::Error,
    },
    /// `mlock` refused; `memlock_limit` is RLIMIT_MEMLOCK (None = unlimited).
    Lock {
        offset: u64,
        len: u64,
        memlock_limit: Option<u64>,
        source: io::Error,
    },
    /// The 2 MiB hugetlb pool has fewer free pages than the arena needs.
    HugePagesShort {
        size_bytes: u64,
        needed_pages: u64,
        free_pages: Option<u64>,
    },
    /// A range does not lie inside the arena.
    OutOfRange {
        offset: u64,
        len: u64,
        arena_len: u64,
    },
}

impl ArenaError {
    /// The OS error number behind this error, if a system call failed.
    pub fn errno(&self) -> Option<i32> {
        match self {
            ArenaError::Os { source, .. } | ArenaError::Lock { source, .. } => {
                source.raw_os_error()
            }
            _ => None,
        }
    }
}

fn fmt_name(name: &Option<String>) -> String {
    match name {
        Some(n) => format!("shm segment '/{n}'"),
        None => "anonymous arena".to_string(),
    }
}

fn fmt_limit(limit: Option<u64>) -> String {
    match limit {
        Some(l) => format!("{l} bytes"),
        None => "unlimited".to_string(),
    }
}

impl fmt::Display for ArenaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArenaError::InvalidConfig {
                name,
                size_bytes,
                reason,
            } => write!(
                f,
                "invalid L1 arena config ({}, {size_bytes} bytes): {reason}",
                fmt_name(name)
            ),
            ArenaError::ShmInUse(e) => e.fmt(f),
            ArenaError::ShmNoSpace {
                name,
                size_bytes,
                available_bytes,
            } => write!(
                f,
                "/dev/shm has {available_bytes} bytes free but shm segment '/{name}' needs \
                 {size_bytes} bytes; enlarge /dev/shm (mount -o remount,size=...; in a container \
                 --shm-size) or lower --l1-size-gb"
            ),
            ArenaError::Os {
                op,
                name,
                size_bytes,
                source,
            } => write!(
                f,
                "{op} failed for {} of {size_bytes} bytes: {source}",
                fmt_name(name)
            ),
            ArenaError::Lock {
                offset,
                len,
                memlock_limit,
                source,
            } => write!(
                f,
                "mlock of {len} bytes at arena offset {offset} failed: {source} \
                 (RLIMIT_MEMLOCK is {}); raise it with `ulimit -l unlimited` or \
                 LimitMEMLOCK=infinity in the systemd unit",
                fmt_limit(*memlock_limit)
            ),
            ArenaError::HugePagesShort {
                size_bytes,
                needed_pages,
                free_pages,
            } => write!(
                f,
                "an L1 arena of {size_bytes} bytes on hugetlb pages needs {needed_pages} free 2 MiB pages \
                 but the pool has {}; grow it (sysctl vm.nr_hugepages={needed_pages}, or more if other \
                 processes use it) or drop --l1-use-hugepages",
                match free_pages {
                    Some(n) => n.to_string(),
                    None => "none readable (/sys/kernel/mm/hugepages/hugepages-2048kB)".to_string(),
                }
            ),
            ArenaError::OutOfRange {
                offset,
                len,
                arena_len,
            } => write!(
                f,
                "range of {len} bytes at offset {offset} lies outside the arena of {arena_len} bytes"
            ),
        }
    }
}

impl std::error::Error for ArenaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ArenaError::Os { source, .. } | ArenaError::Lock { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A mapping made and owned outside this module that an [`Arena`] can be
/// built over ([`Arena::from_region`]). The region unmaps itself when dropped.
///
/// Implementors promise that `[base, base + len)` is mapped readable and
/// writable, and stays so, with the same base and length, for as long as the
/// region lives.
pub trait ArenaRegion: Send + Sync {
    /// Start of the mapping.
    fn base(&self) -> *mut u8;
    /// Mapped length in bytes.
    fn len(&self) -> usize;
    /// Whether the region maps nothing ([`Arena::from_region`] refuses it).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Short name of what backs the region, for /status ("devdax", "file").
    fn kind(&self) -> &'static str;
    /// The file or device behind the region, if any.
    fn path(&self) -> Option<&Path>;
    /// One line for logs: what is mapped, how much, how aligned.
    fn describe(&self) -> String;
}

/// The mapped L1 region. Unmapped (and its shm name unlinked) on drop.
pub struct Arena {
    base: NonNull<u8>,
    len: usize,
    /// Length of the mapping: `len` rounded up to the page size in use.
    map_len: usize,
    /// The named segment's name (without '/'), kept for reports after the
    /// segment itself is released.
    shm_name: Option<String>,
    /// The named segment behind the mapping, with its ownership lock, until
    /// [`Arena::release_segment`] (or drop) gives both up.
    segment: std::sync::Mutex<Option<OwnedSegment>>,
    huge_pages: HugePages,
    /// The external mapping the arena sits on; `None` when the arena mapped
    /// its memory itself (and so unmaps it on drop).
    region: Option<Box<dyn ArenaRegion>>,
}

// SAFETY: `Arena` only holds the address of a mapping that stays valid until
// drop and has no interior state of its own. Reads and writes through the
// pointer happen via `base()`/`slice*`, whose callers guarantee that no two
// threads touch the same bytes without synchronisation (each shard owns a
// disjoint slice); the mapping itself may be accessed from any thread.
unsafe impl Send for Arena {}
// SAFETY: see `Send`: no method mutates the `Arena` value itself but
// `release_segment`, through its mutex.
unsafe impl Sync for Arena {}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("shm_name", &self.shm_name())
            .field("huge_pages", &self.huge_pages)
            .field("region", &self.region.as_ref().map(|r| r.describe()))
            .finish()
    }
}

/// The base page size (4096 when sysconf cannot say).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p <= 0 {
        4096
    } else {
        p as usize
    }
}

/// RLIMIT_MEMLOCK soft limit in bytes; `None` when unlimited.
pub fn memlock_limit() -> Option<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid out-pointer for getrlimit.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    if rc != 0 || rl.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(rl.rlim_cur)
}

/// One line of /proc/self/status, e.g. `field("CapEff")`.
fn proc_status_field(field: &str) -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim().to_string())
    })
}

/// True when the process holds CAP_IPC_LOCK, which makes the kernel ignore
/// RLIMIT_MEMLOCK.
fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    match proc_status_field("CapEff").and_then(|v| u64::from_str_radix(&v, 16).ok()) {
        Some(caps) => caps & (1u64 << CAP_IPC_LOCK) != 0,
        // SAFETY: geteuid has no preconditions.
        None => (unsafe { libc::geteuid() }) == 0,
    }
}

/// Bytes this process has locked already (VmLck), counted against the limit.
fn locked_bytes() -> u64 {
    proc_status_field("VmLck")
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Whether `bytes` more can be mlocked: CAP_IPC_LOCK (root), an unlimited
/// RLIMIT_MEMLOCK, or enough room left under it.
pub fn can_lock(bytes: u64) -> bool {
    if has_cap_ipc_lock() {
        return true;
    }
    match memlock_limit() {
        None => true,
        Some(limit) => bytes <= limit.saturating_sub(locked_bytes()),
    }
}

/// POSIX shm names as Python's `SharedMemory` accepts them: one path
/// component under /dev/shm.
fn validate_shm_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("shm name is empty".into());
    }
    if name.len() > 255 {
        return Err(format!("shm name is {} bytes long (max 255)", name.len()));
    }
    if name.contains('/') || name.contains('\0') {
        return Err("shm name must not contain '/' or NUL".into());
    }
    if name == "." || name == ".." {
        return Err("shm name must not be '.' or '..'".into());
    }
    Ok(())
}

fn last_os_error() -> io::Error {
    io::Error::last_os_error()
}

/// Free bytes for an unprivileged writer on the filesystem holding `path`.
fn free_bytes(path: &str) -> io::Result<u64> {
    let cpath = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: an all-zero statvfs is a valid value for the out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `cpath` is NUL-terminated and `st` is a valid out-pointer.
    if unsafe { libc::statvfs(cpath.as_ptr(), &mut st) } != 0 {
        return Err(last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Maps `len` bytes with `flags` (and `fd`, or -1). With `huge_aligned` the
/// mapping starts on a 2 MiB boundary, which transparent huge pages need:
/// a larger PROT_NONE region is reserved and the mapping placed inside it.
/// The mapping is readable and writable; unmapping it is the caller's.
pub fn map_region(
    len: usize,
    flags: libc::c_int,
    fd: libc::c_int,
    huge_aligned: bool,
) -> io::Result<NonNull<u8>> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    if !huge_aligned {
        // SAFETY: a fresh mapping (no MAP_FIXED) aliases nothing of ours.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(last_os_error());
        }
        return Ok(NonNull::new(p.cast()).expect("mmap returned NULL without MAP_FIXED"));
    }
    let span = len + HUGE_PAGE_BYTES;
    // SAFETY: a fresh inaccessible reservation.
    let r = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if r == libc::MAP_FAILED {
        return Err(last_os_error());
    }
    let start = r as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE_BYTES);
    // SAFETY: `[aligned, aligned + len)` lies inside the reservation we own.
    let p = unsafe {
        libc::mmap(
            aligned as *mut libc::c_void,
            len,
            prot,
            flags | libc::MAP_FIXED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = last_os_error();
        // SAFETY: unmapping our own reservation.
        unsafe { libc::munmap(r, span) };
        return Err(e);
    }
    // Give back the parts of the reservation around the mapping.
    let end = aligned + len.next_multiple_of(page_size());
    // SAFETY: both ranges are pieces of our reservation outside the mapping.
    unsafe {
        if aligned > start {
            libc::munmap(r, aligned - start);
        }
        if start + span > end {
            libc::munmap(end as *mut libc::c_void, start + span - end);
        }
    }
    Ok(NonNull::new(p.cast()).expect("MAP_FIXED at a non-null address"))
}

/// Free pages in the 2 MiB hugetlb pool.
fn free_huge_pages() -> Option<u64> {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Sums the huge-page fields of the smaps entry whose range holds `addr`.
fn smaps_huge_bytes(smaps: &str, addr: usize) -> Option<u64> {
    let mut inside = false;
    let mut found = false;
    let mut kb = 0u64;
    for line in smaps.lines() {
        let first = line.split_ascii_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                if found {
                    break;
                }
                inside = lo <= addr && addr < hi;
                found = inside;
                continue;
            }
        }
        if !inside {
            continue;
        }
        let Some((field, rest)) = line.split_once(':') else {
            continue;
        };
        if matches!(
            field,
            "AnonHugePages"
                | "ShmemPmdMapped"
                | "FilePmdMapped"
                | "Shared_Hugetlb"
                | "Private_Hugetlb"
        ) {
            kb += rest
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0);
        }
    }
    found.then_some(kb * 1024)
}

impl Arena {
    /// Map a new arena as `cfg` describes. A named arena replaces any stale
    /// segment of the same name (as lmcache 0.5.6 does) and is unlinked when the
    /// `Arena` drops.
    ///
    /// A lazily populated named arena takes tmpfs pages on first touch: if
    /// /dev/shm fills up meanwhile, that touch raises SIGBUS. `populate`
    /// reserves the pages up front (fallocate), which turns that into a clean
    /// error here.
    pub fn create(cfg: &ArenaConfig) -> Result<Arena, ArenaError> {
        let invalid = |reason: String| ArenaError::InvalidConfig {
            name: cfg.shm_name.clone(),
            size_bytes: cfg.size_bytes,
            reason,
        };
        if cfg.size_bytes == 0 {
            return Err(invalid("size is 0".into()));
        }
        let len = usize::try_from(cfg.size_bytes)
            .ok()
            .filter(|l| l.checked_add(2 * HUGE_PAGE_BYTES).is_some() && *l <= isize::MAX as usize)
            .ok_or_else(|| invalid("size does not fit in the address space".into()))?;
        let populate = cfg.populate || cfg.mlock;
        let arena = match (&cfg.shm_name, cfg.huge_pages) {
            (Some(_), HugePages::Hugetlb) => return Err(invalid(
                "hugetlb pages cannot back a POSIX shm segment: disable shm (--shm-name \"\") as \
                     lmcache 0.5.6 requires, or pre-fault the shm arena (--no-l1-use-lazy) for \
                     transparent huge pages where /dev/shm allows them"
                    .into(),
            )),
            (None, HugePages::Hugetlb) => Self::map_hugetlb(cfg, len)?,
            (None, _) => Self::map_anonymous(cfg, len, populate)?,
            (Some(name), _) => {
                validate_shm_name(name).map_err(invalid)?;
                Self::map_named(cfg, name, len, populate)?
            }
        };
        // Core dumps of a cache this size help nobody; the failure is harmless.
        // SAFETY: the range is exactly our mapping.
        unsafe {
            libc::madvise(
                arena.base.as_ptr().cast(),
                arena.map_len,
                libc::MADV_DONTDUMP,
            )
        };
        if cfg.mlock {
            // On failure `arena` drops here, which unmaps and unlinks.
            arena.lock_range(0, cfg.size_bytes)?;
        }
        Ok(arena)
    }

    /// An arena over `region`, a mapping made elsewhere. It is split into
    /// shard slices like any arena; it has no shm name, reports base pages
    /// (the region's own page size is its business), and is neither
    /// madvised, populated nor locked here. Dropping the arena drops the
    /// region, which unmaps it.
    pub fn from_region(region: Box<dyn ArenaRegion>) -> Result<Arena, ArenaError> {
        let len = region.len();
        let invalid = |reason: String| ArenaError::InvalidConfig {
            name: None,
            size_bytes: len as u64,
            reason: format!("{}: {reason}", region.describe()),
        };
        if len == 0 {
            return Err(invalid("size is 0".into()));
        }
        if len > isize::MAX as usize {
            return Err(invalid("size does not fit in the address space".into()));
        }
        let Some(base) = NonNull::new(region.base()) else {
            return Err(invalid("the region has a null base address".into()));
        };
        Ok(Arena {
            base,
            len,
            map_len: len,
            shm_name: None,
            segment: std::sync::Mutex::new(None),
            huge_pages: HugePages::Off,
            region: Some(region),
        })
    }

    fn map_anonymous(cfg: &ArenaConfig, len: usize, populate: bool) -> Result<Arena, ArenaError> {
        let thp = cfg.huge_pages == HugePages::Transparent;
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        if populate && !thp {
            flags |= libc::MAP_POPULATE;
        }
        let os_err = |op: &'static str, source: io::Error| ArenaError::Os {
            op,
            name: None,
            size_bytes: cfg.size_bytes,
            source,
        };
        let base = map_region(len, flags, -1, thp).map_err(|e| os_err("mmap", e))?;
        let arena = Arena {
            base,
            len,
            map_len: len.next_multiple_of(page_size()),
            shm_name: None,
            segment: std::sync::Mutex::new(None),
            huge_pages: cfg.huge_pages,
            region: None,
        };
        if thp {
            arena.advise_huge();
            if populate {
                arena
                    .populate_write()
                    .map_err(|e| os_err("madvise(MADV_POPULATE_WRITE)", e))?;
            }
        }
        Ok(arena)
    }

    fn map_hugetlb(cfg: &ArenaConfig, len: usize) -> Result<Arena, ArenaError> {
        let map_len = len.next_multiple_of(HUGE_PAGE_BYTES);
        let needed_pages = (map_len / HUGE_PAGE_BYTES) as u64;
        let short = || ArenaError::HugePagesShort {
            size_bytes: cfg.size_bytes,
            needed_pages,
            free_pages: free_huge_pages(),
        };
        if free_huge_pages().is_none_or(|free| free < needed_pages) {
            return Err(short());
        }
        // A private hugetlb mapping reserves its pages at mmap time, so a pool
        // that shrank since the check above fails here, not with SIGBUS later.
        let flags = libc::MAP_PRIVATE
            | libc::MAP_ANONYMOUS
            | libc::MAP_HUGETLB
            | libc::MAP_HUGE_2MB
            | libc::MAP_POPULATE;
        let base = map_region(map_len, flags, -1, false).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOMEM) {
                short()
            } else {
                ArenaError::Os {
                    op: "mmap(MAP_HUGETLB)",
                    name: None,
                    size_bytes: cfg.size_bytes,
                    source: e,
                }
            }
        })?;
        Ok(Arena {
            base,
            len,
            map_len,
            shm_name: None,
            segment: std::sync::Mutex::new(None),
            huge_pages: HugePages::Hugetlb,
            region: None,
        })
    }

    fn map_named(
        cfg: &ArenaConfig,
        name: &str,
        len: usize,
        populate: bool,
    ) -> Result<Arena, ArenaError> {
        let os_err = |op: &'static str, source: io::Error| ArenaError::Os {
            op,
            name: Some(name.to_string()),
            size_bytes: cfg.size_bytes,
            source,
        };
        // A segment left by a crashed run is replaced, as lmcache 0.5.6 does;
        // one a live server holds is not. From here on dropping `segment`
        // removes what it created.
        let segment = OwnedSegment::create(name).map_err(|e| match e {
            SegmentError::InUse { .. } => ArenaError::ShmInUse(e),
            SegmentError::Os { op, source, .. } => os_err(op, source),
        })?;
        let fd = segment.fd();
        // Checked after the claim: a stale segment's pages are only freed once
        // it is removed.
        let available = free_bytes("/dev/shm").map_err(|e| os_err("statvfs(/dev/shm)", e))?;
        if available < cfg.size_bytes {
            return Err(ArenaError::ShmNoSpace {
                name: name.to_string(),
                size_bytes: cfg.size_bytes,
                available_bytes: available,
            });
        }
        // SAFETY: `fd` is an open shm fd.
        if unsafe { libc::ftruncate(fd, cfg.size_bytes as libc::off_t) } != 0 {
            return Err(os_err("ftruncate", last_os_error()));
        }
        let thp = cfg.huge_pages == HugePages::Transparent;
        // With transparent huge pages the pages are allocated through the
        // mapping after MADV_HUGEPAGE (fallocate has no mapping to consult, so
        // under `huge=advise` it would allocate base pages).
        if populate && !thp {
            // Reserve the tmpfs pages now: ENOSPC here beats SIGBUS later.
            // SAFETY: `fd` is an open shm fd.
            let rc = unsafe { libc::fallocate(fd, 0, 0, cfg.size_bytes as libc::off_t) };
            if rc != 0 {
                return Err(os_err("fallocate", last_os_error()));
            }
        }
        let mut flags = libc::MAP_SHARED;
        if populate && !thp {
            flags |= libc::MAP_POPULATE;
        }
        let base = map_region(len, flags, fd, thp).map_err(|e| os_err("mmap", e))?;
        // From here on dropping `arena` unmaps and unlinks. The segment's fd
        // stays open: it holds the lock that marks the segment as live.
        let arena = Arena {
            base,
            len,
            map_len: len.next_multiple_of(page_size()),
            shm_name: Some(segment.name().to_owned()),
            segment: std::sync::Mutex::new(Some(segment)),
            huge_pages: cfg.huge_pages,
            region: None,
        };
        if thp {
            arena.advise_huge();
            if populate {
                arena
                    .populate_write()
                    .map_err(|e| os_err("madvise(MADV_POPULATE_WRITE)", e))?;
            }
        }
        Ok(arena)
    }

    /// Asks for transparent huge pages on the whole mapping. A kernel without
    /// THP refuses with EINVAL; the arena then keeps base pages.
    fn advise_huge(&self) {
        // SAFETY: the range is exactly our mapping.
        let rc =
            unsafe { libc::madvise(self.base.as_ptr().cast(), self.map_len, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            log::info!(
                "MADV_HUGEPAGE on the L1 arena refused ({}): base pages only",
                last_os_error()
            );
        }
    }

    /// Faults every page in for writing, so the kernel allocates them now and
    /// as huge pages where it can.
    fn populate_write(&self) -> io::Result<()> {
        // SAFETY: the range is exactly our mapping.
        let rc = unsafe {
            libc::madvise(
                self.base.as_ptr().cast(),
                self.map_len,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
        // Kernels before 5.14 lack MADV_POPULATE_WRITE: touch every page.
        // Nobody else can see the arena yet and its bytes are all zero.
        for off in (0..self.map_len).step_by(page_size()) {
            // SAFETY: `off` lies inside our writable mapping.
            unsafe { std::ptr::write_volatile(self.base.as_ptr().add(off), 0) };
        }
        Ok(())
    }

    /// The page size policy the arena was created with.
    pub fn huge_pages(&self) -> HugePages {
        self.huge_pages
    }

    /// Bytes of the arena the kernel currently backs with huge pages (from
    /// /proc/self/smaps), or `None` when that cannot be read.
    pub fn huge_page_bytes(&self) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        smaps_huge_bytes(&smaps, self.base.as_ptr() as usize)
    }

    /// Start of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Size in bytes (as configured, not page-rounded).
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Always false: a zero-sized arena cannot be created.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shm segment name (without '/'), for a named arena.
    pub fn shm_name(&self) -> Option<&str> {
        self.shm_name.as_deref()
    }

    /// Gives up the named segment's name and its ownership lock now, keeping
    /// the mapping: the name is unlinked (if it still refers to this
    /// segment), so a later server may create it again and nothing is left
    /// in `/dev/shm` should this process not get to drop the arena (a write
    /// stuck in the kernel at shutdown). The memory stays mapped, here and in
    /// the clients that map it, until unmapped. Returns whether there was a
    /// segment to release; a second call does nothing.
    pub fn release_segment(&self) -> bool {
        let taken = self
            .segment
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        taken.is_some()
    }

    /// What backs the arena: "shm" (a POSIX shm segment), "anonymous"
    /// (private memory, base or huge pages), or the kind an [`ArenaRegion`]
    /// names ("devdax", "file").
    pub fn kind(&self) -> &'static str {
        match (&self.region, &self.shm_name) {
            (Some(r), _) => r.kind(),
            (None, Some(_)) => "shm",
            (None, None) => "anonymous",
        }
    }

    /// The file or device behind the arena: `/dev/shm/<name>` for a named
    /// arena, the region's path for one built over a region.
    pub fn path(&self) -> Option<std::path::PathBuf> {
        match (&self.region, &self.shm_name) {
            (Some(r), _) => r.path().map(Path::to_path_buf),
            (None, Some(s)) => Some(Path::new("/dev/shm").join(s)),
            (None, None) => None,
        }
    }

    /// One line for logs.
    pub fn describe(&self) -> String {
        match (&self.region, &self.shm_name) {
            (Some(r), _) => r.describe(),
            (None, Some(s)) => format!("POSIX shm segment /{s} of {} bytes", self.len),
            (None, None) => format!("anonymous memory of {} bytes", self.len),
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(usize, usize), ArenaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok((offset as usize, len as usize)),
            _ => Err(ArenaError::OutOfRange {
                offset,
                len,
                arena_len: self.len as u64,
            }),
        }
    }

    /// `[offset, offset+len)` widened to whole pages, as mapping offsets;
    /// `None` for an empty range.
    fn page_span(&self, offset: u64, len: u64) -> Result<Option<(usize, usize)>, ArenaError> {
        let (off, n) = self.check_range(offset, len)?;
        if n == 0 {
            return Ok(None);
        }
        let page = page_size();
        // The mapping covers whole pages, so rounding the end up stays inside it.
        Ok(Some((off & !(page - 1), (off + n).div_ceil(page) * page)))
    }

    /// mlock `[offset, offset+len)`, widened to whole pages. Locking faults the
    /// pages in. An empty range is a no-op.
    pub fn lock_range(&self, offset: u64, len: u64) -> Result<(), ArenaError> {
        let Some((start, end)) = self.page_span(offset, len)? else {
            return Ok(());
        };
        // SAFETY: `[start, end)` lies inside our mapping (page-rounded).
        let rc = unsafe { libc::mlock(self.base.as_ptr().add(start).cast(), end - start) };
        if rc != 0 {
            return Err(ArenaError::Lock {
                offset,
                len,
                memlock_limit: memlock_limit(),
                source: last_os_error(),
            });
        }
        Ok(())
    }

    /// Faults `[offset, offset+len)` in for writing (widened to whole
    /// pages) without changing a byte, so that later writes to it take no
    /// page fault. Needs `MADV_POPULATE_WRITE` (Linux 5.14): older kernels
    /// answer `Unsupported`, and the pages are then faulted on first use.
    pub fn populate_range(&self, offset: u64, len: u64) -> Result<(), ArenaError> {
        let Some((start, end)) = self.page_span(offset, len)? else {
            return Ok(());
        };
        // SAFETY: `[start, end)` lies inside our mapping (page-rounded);
        // MADV_POPULATE_WRITE faults pages in and leaves their contents alone.
        let rc = unsafe {
            libc::madvise(
                self.base.as_ptr().add(start).cast(),
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        Err(ArenaError::Os {
            op: "madvise(MADV_POPULATE_WRITE)",
            name: self.shm_name.clone(),
            size_bytes: self.len as u64,
            source: last_os_error(),
        })
    }

    /// View `[offset, offset+len)`.
    ///
    /// # Safety
    /// Nobody (this process or a client mapping the segment) may write the
    /// range while the returned slice is alive.
    ///
    /// # Panics
    /// If the range lies outside the arena.
    pub unsafe fn slice(&self, offset: u64, len: u64) -> &[u8] {
        let (off, n) = self
            .check_range(offset, len)
            .unwrap_or_else(|e| panic!("{e}"));
        std::slice::from_raw_parts(self.base.as_ptr().add(off), n)
    }

    /// Mutable view of `[offset, offset+len)`.
    ///
    /// # Safety
    /// The caller must have exclusive access to the range (no other slice of
    /// it alive, no concurrent writer or reader) while the slice is alive.
    ///
    /// # Panics
    /// If the range lies outside the arena.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: u64) -> &mut [u8] {
        let (off, n) = self
            .check_range(offset, len)
            .unwrap_or_else(|e| panic!("{e}"));
        std::slice::from_raw_parts_mut(self.base.as_ptr().add(off), n)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.region.is_some() {
            // The region unmaps its own mapping when it drops, after this.
            return;
        }
        // SAFETY: unmapping exactly the mapping created in `create`; no slice
        // can outlive `self`.
        if unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len) } != 0 {
            log::warn!(
                "munmap of the L1 arena failed: {}",
                io::Error::last_os_error()
            );
        }
        // The segment (if any) drops after this: it unlinks the name only if
        // the name still refers to the segment this arena created.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm_segment::tests::unique_name;

    fn shm_path(name: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("/dev/shm/{name}"))
    }

    /// Maps an existing segment the way a client does (shm_open without
    /// O_CREAT + MAP_SHARED) and returns (ptr, len).
    fn client_map(name: &str, len: usize) -> *mut u8 {
        let cname = CString::new(format!("/{name}")).unwrap();
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0);
            assert!(fd >= 0, "client shm_open: {}", io::Error::last_os_error());
            let mut st: libc::stat = std::mem::zeroed();
            assert_eq!(libc::fstat(fd, &mut st), 0);
            assert_eq!(st.st_size as usize, len, "segment size seen by a client");
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            assert_ne!(p, libc::MAP_FAILED);
            p.cast()
        }
    }

    fn named_cfg(name: &str, size: u64) -> ArenaConfig {
        ArenaConfig {
            size_bytes: size,
            shm_name: Some(name.to_string()),
            mlock: false,
            populate: false,
            huge_pages: HugePages::Off,
        }
    }

    #[test]
    fn named_arena_is_shared_both_ways_and_unlinked_on_drop() {
        let name = unique_name("shared");
        let size = 3 * 4096 + 100;
        let arena = Arena::create(&named_cfg(&name, size)).unwrap();
        assert_eq!(arena.len(), size);
        assert_eq!(arena.shm_name(), Some(name.as_str()));
        assert!(shm_path(&name).exists());

        let client = client_map(&name, size as usize);
        unsafe {
            arena.slice_mut(4096, 4).copy_from_slice(b"srv!");
            assert_eq!(std::slice::from_raw_parts(client.add(4096), 4), b"srv!");
            std::ptr::copy_nonoverlapping(b"cli!".as_ptr(), client.add(size as usize - 4), 4);
            assert_eq!(arena.slice(size - 4, 4), b"cli!");
            libc::munmap(client.cast(), size as usize);
        }
        drop(arena);
        assert!(!shm_path(&name).exists(), "drop must unlink the segment");
    }

    #[test]
    fn a_released_segment_leaves_dev_shm_and_its_name_free_but_stays_mapped() {
        let name = unique_name("release");
        let arena = Arena::create(&named_cfg(&name, 8192)).unwrap();
        // SAFETY: nobody else touches the arena in this test.
        unsafe { arena.slice_mut(0, 4) }.copy_from_slice(b"kept");
        assert!(arena.release_segment());
        assert!(!shm_path(&name).exists(), "the name is unlinked at once");
        assert!(!arena.release_segment(), "a second release does nothing");
        assert_eq!(arena.shm_name(), Some(name.as_str()), "still reported");
        // SAFETY: as above.
        assert_eq!(unsafe { arena.slice(0, 4) }, b"kept", "the mapping stays");
        // Another server may take the name (and its lock) meanwhile, and this
        // arena's drop leaves that one alone.
        let next = Arena::create(&named_cfg(&name, 4096)).unwrap();
        drop(arena);
        assert!(shm_path(&name).exists(), "the new owner's segment stays");
        drop(next);
        assert!(!shm_path(&name).exists());
    }

    #[test]
    fn stale_segment_is_replaced() {
        let name = unique_name("stale");
        let cname = CString::new(format!("/{name}")).unwrap();
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o600);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, 8192), 0);
            assert_eq!(libc::write(fd, b"old".as_ptr().cast(), 3), 3);
            libc::close(fd);
        }
        let arena = Arena::create(&named_cfg(&name, 4096)).unwrap();
        let meta = std::fs::metadata(shm_path(&name)).unwrap();
        assert_eq!(meta.len(), 4096, "new segment, not the stale one");
        assert_eq!(unsafe { arena.slice(0, 3) }, &[0, 0, 0]);
    }

    #[test]
    fn anonymous_arena_reads_back_and_populate_works() {
        for populate in [false, true] {
            let arena = Arena::create(&ArenaConfig {
                size_bytes: 1 << 20,
                shm_name: None,
                mlock: false,
                populate,
                huge_pages: HugePages::Off,
            })
            .unwrap();
            assert_eq!(arena.shm_name(), None);
            assert_eq!(arena.len(), 1 << 20);
            unsafe {
                assert!(arena.slice(0, 1 << 20).iter().all(|b| *b == 0));
                arena.slice_mut(12345, 3).copy_from_slice(&[7, 8, 9]);
                assert_eq!(arena.slice(12345, 3), &[7, 8, 9]);
            }
        }
    }

    #[test]
    fn populated_named_arena_reserves_pages() {
        let name = unique_name("populate");
        let arena = Arena::create(&ArenaConfig {
            size_bytes: 64 * 1024,
            shm_name: Some(name.clone()),
            mlock: true,
            populate: true,
            huge_pages: HugePages::Off,
        })
        .unwrap();
        let meta = std::fs::metadata(shm_path(&name)).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert!(
            meta.blocks() * 512 >= 64 * 1024,
            "tmpfs pages allocated up front"
        );
        drop(arena);
    }

    #[test]
    fn lock_range_small_and_out_of_range() {
        let arena = Arena::create(&ArenaConfig {
            size_bytes: 5 * 4096,
            shm_name: None,
            mlock: false,
            populate: false,
            huge_pages: HugePages::Off,
        })
        .unwrap();
        if can_lock(8192) {
            arena.lock_range(100, 5000).unwrap();
        }
        arena.lock_range(5 * 4096, 0).unwrap();
        match arena.lock_range(4096, 5 * 4096) {
            Err(ArenaError::OutOfRange { arena_len, .. }) => assert_eq!(arena_len, 5 * 4096),
            other => panic!("expected OutOfRange, got {other:?}"),
        }
        assert!(matches!(
            arena.lock_range(u64::MAX, 2),
            Err(ArenaError::OutOfRange { .. })
        ));
    }

    #[test]
    fn invalid_configs_are_rejected() {
        for name in ["", "a/b", ".."] {
            let err = Arena::create(&named_cfg(name, 4096)).unwrap_err();
            assert!(
                matches!(err, ArenaError::InvalidConfig { .. }),
                "{name}: {err}"
            );
        }
        let err = Arena::create(&named_cfg(&unique_name("zero"), 0)).unwrap_err();
        assert!(err.to_string().contains("size is 0"), "{err}");
    }

    #[test]
    fn too_big_for_dev_shm_fails_clearly() {
        let name = unique_name("huge");
        let err = Arena::create(&named_cfg(&name, 1 << 60)).unwrap_err();
        match &err {
            ArenaError::ShmNoSpace { size_bytes, .. } => assert_eq!(*size_bytes, 1 << 60),
            other => panic!("expected ShmNoSpace, got {other}"),
        }
        assert!(err.to_string().contains("/dev/shm"), "{err}");
        assert!(!shm_path(&name).exists());
    }

    #[test]
    fn lock_error_message_names_the_limit_and_the_fix() {
        let e = ArenaError::Lock {
            offset: 0,
            len: 1 << 30,
            memlock_limit: Some(8 << 20),
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        assert_eq!(e.errno(), Some(libc::ENOMEM));
        let msg = e.to_string();
        assert!(msg.contains("8388608 bytes"), "{msg}");
        assert!(msg.contains("ulimit -l unlimited"), "{msg}");
        assert!(msg.contains("LimitMEMLOCK=infinity"), "{msg}");
    }

    #[test]
    fn memlock_helpers_agree_with_rlimit() {
        // Tiny amounts always fit under the glommio-required minimum of 512 KiB.
        assert!(can_lock(4096) || memlock_limit().is_some_and(|l| l < 4096));
        if has_cap_ipc_lock() {
            assert!(can_lock(u64::MAX));
        } else if let Some(limit) = memlock_limit() {
            assert!(!can_lock(limit + 1));
        }
    }

    /// Whether the running kernel hands out transparent huge pages for
    /// madvised anonymous memory, or for madvised shm on /dev/shm.
    fn thp_allowed(shm: bool) -> bool {
        if shm {
            let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
            let opts = mounts
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split(' ').collect();
                    (f.len() > 3 && f[1] == "/dev/shm").then(|| f[3].to_string())
                })
                .next_back()
                .unwrap_or_default();
            let forced =
                std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
                    .is_ok_and(|v| v.contains("[force]"));
            forced
                || opts
                    .split(',')
                    .any(|o| matches!(o, "huge=advise" | "huge=within_size" | "huge=always"))
        } else {
            std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                .is_ok_and(|v| v.contains("[always]") || v.contains("[madvise]"))
        }
    }

    #[test]
    fn transparent_arena_is_aligned_and_gets_huge_pages_where_allowed() {
        let size = 8 * HUGE_PAGE_BYTES as u64 + 4096;
        let anon = Arena::create(&ArenaConfig {
            size_bytes: size,
            shm_name: None,
            mlock: false,
            populate: true,
            huge_pages: HugePages::Transparent,
        })
        .unwrap();
        let name = unique_name("thp");
        let named = Arena::create(&ArenaConfig {
            size_bytes: size,
            shm_name: Some(name.clone()),
            mlock: false,
            populate: true,
            huge_pages: HugePages::Transparent,
        })
        .unwrap();
        for (arena, shm) in [(&anon, false), (&named, true)] {
            assert_eq!(
                arena.base() as usize % HUGE_PAGE_BYTES,
                0,
                "2 MiB-aligned base"
            );
            assert_eq!(arena.huge_pages(), HugePages::Transparent);
            unsafe {
                assert!(arena.slice(0, size).iter().all(|b| *b == 0));
                arena.slice_mut(size - 3, 3).copy_from_slice(&[1, 2, 3]);
                assert_eq!(arena.slice(size - 3, 3), &[1, 2, 3]);
            }
            let huge = arena.huge_page_bytes().expect("smaps entry of the arena");
            if thp_allowed(shm) {
                assert!(
                    huge >= 4 * HUGE_PAGE_BYTES as u64,
                    "shm={shm}: only {huge} bytes on huge pages although the kernel allows them"
                );
            }
        }
        // A client mapping of the transparent shm arena shares its bytes.
        let client = client_map(&name, size as usize);
        unsafe {
            assert_eq!(
                std::slice::from_raw_parts(client.add(size as usize - 3), 3),
                &[1, 2, 3]
            );
            libc::munmap(client.cast(), size as usize);
        }
        drop(named);
        assert!(!shm_path(&name).exists());
    }

    #[test]
    fn hugetlb_arena_needs_the_pool_and_no_shm() {
        let err = Arena::create(&ArenaConfig {
            size_bytes: 1 << 20,
            shm_name: Some(unique_name("hugetlb")),
            mlock: false,
            populate: true,
            huge_pages: HugePages::Hugetlb,
        })
        .unwrap_err();
        assert!(matches!(err, ArenaError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains("--shm-name"), "{err}");

        // One page more than the pool has free is refused with the fix named.
        let free = free_huge_pages().unwrap_or(0);
        let too_big = (free + 1) * HUGE_PAGE_BYTES as u64;
        let err = Arena::create(&ArenaConfig {
            size_bytes: too_big,
            shm_name: None,
            mlock: false,
            populate: true,
            huge_pages: HugePages::Hugetlb,
        })
        .unwrap_err();
        assert!(matches!(err, ArenaError::HugePagesShort { .. }), "{err}");
        assert!(err.to_string().contains("vm.nr_hugepages"), "{err}");

        // Where the pool has a free page, a small arena is rounded up to it.
        if free >= 1 {
            let arena = Arena::create(&ArenaConfig {
                size_bytes: 4096,
                shm_name: None,
                mlock: false,
                populate: true,
                huge_pages: HugePages::Hugetlb,
            })
            .unwrap();
            unsafe { arena.slice_mut(0, 4096).fill(7) };
            assert_eq!(arena.huge_page_bytes(), Some(HUGE_PAGE_BYTES as u64));
        }
    }

    /// A private anonymous mapping standing in for an external region. Its
    /// drop only records that it ran and leaves the memory mapped, so a test
    /// can tell whether the arena unmapped what it does not own.
    struct TestRegion {
        base: *mut u8,
        len: usize,
        dropped: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    // SAFETY: only an address; tests touch the bytes from one thread.
    unsafe impl Send for TestRegion {}
    // SAFETY: see `Send`.
    unsafe impl Sync for TestRegion {}

    impl TestRegion {
        fn new(len: usize) -> (TestRegion, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
            let base = map_region(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, false)
                .unwrap()
                .as_ptr();
            let dropped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            (
                TestRegion {
                    base,
                    len,
                    dropped: dropped.clone(),
                },
                dropped,
            )
        }
    }

    impl ArenaRegion for TestRegion {
        fn base(&self) -> *mut u8 {
            self.base
        }
        fn len(&self) -> usize {
            self.len
        }
        fn kind(&self) -> &'static str {
            "test"
        }
        fn path(&self) -> Option<&Path> {
            Some(Path::new("/test/region"))
        }
        fn describe(&self) -> String {
            format!("test region of {} bytes", self.len)
        }
    }

    impl Drop for TestRegion {
        fn drop(&mut self) {
            self.dropped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn arena_from_region_uses_the_region_and_leaves_unmapping_to_it() {
        let len = 6 * 4096 + 512;
        let (region, dropped) = TestRegion::new(len);
        let base = region.base;
        let arena = Arena::from_region(Box::new(region)).unwrap();
        assert_eq!(arena.base(), base);
        assert_eq!(arena.len(), len as u64);
        assert_eq!(arena.shm_name(), None);
        assert_eq!(arena.huge_pages(), HugePages::Off);
        assert_eq!(arena.kind(), "test");
        assert_eq!(arena.path(), Some(std::path::PathBuf::from("/test/region")));
        assert!(
            arena.describe().contains("test region"),
            "{}",
            arena.describe()
        );
        unsafe {
            arena.slice_mut(len as u64 - 4, 4).copy_from_slice(b"tail");
            assert_eq!(std::slice::from_raw_parts(base.add(len - 4), 4), b"tail");
            assert_eq!(arena.slice(0, 4096), &[0u8; 4096][..]);
        }
        assert!(matches!(
            arena.lock_range(len as u64 - 1, 2),
            Err(ArenaError::OutOfRange { .. })
        ));
        assert_eq!(dropped.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(arena);
        assert_eq!(
            dropped.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the arena drops its region once"
        );
        // Still mapped: the arena must not unmap memory it does not own.
        unsafe {
            assert_eq!(std::slice::from_raw_parts(base.add(len - 4), 4), b"tail");
            assert_eq!(libc::munmap(base.cast(), len), 0);
        }
    }

    #[test]
    fn arena_from_an_empty_region_is_refused() {
        let (mut region, dropped) = TestRegion::new(4096);
        let base = region.base;
        region.len = 0;
        let err = Arena::from_region(Box::new(region)).unwrap_err();
        assert!(matches!(err, ArenaError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains("test region of 0 bytes"), "{err}");
        assert_eq!(dropped.load(std::sync::atomic::Ordering::SeqCst), 1);
        unsafe { assert_eq!(libc::munmap(base.cast(), 4096), 0) };
    }

    #[test]
    fn arena_kind_and_path_of_the_arenas_it_maps_itself() {
        let anon = Arena::create(&ArenaConfig {
            size_bytes: 4096,
            shm_name: None,
            mlock: false,
            populate: false,
            huge_pages: HugePages::Off,
        })
        .unwrap();
        assert_eq!(anon.kind(), "anonymous");
        assert_eq!(anon.path(), None);
        let name = unique_name("kind");
        let named = Arena::create(&named_cfg(&name, 4096)).unwrap();
        assert_eq!(named.kind(), "shm");
        assert_eq!(named.path(), Some(shm_path(&name)));
        assert!(named.describe().contains(&name), "{}", named.describe());
    }

    #[test]
    fn smaps_fields_of_the_entry_holding_the_address_are_summed() {
        let smaps = "\
7f0000000000-7f0000400000 rw-s 00000000 00:1a 77 /dev/shm/x
Size:               4096 kB
AnonHugePages:         0 kB
ShmemPmdMapped:     2048 kB
FilePmdMapped:         0 kB
Shared_Hugetlb:        0 kB
Private_Hugetlb:       0 kB
VmFlags: rd wr sh mr mw me ms hg
7f0000400000-7f0000800000 rw-p 00000000 00:00 0
AnonHugePages:      4096 kB
";
        assert_eq!(smaps_huge_bytes(smaps, 0x7f00_0000_0000), Some(2 << 20));
        assert_eq!(smaps_huge_bytes(smaps, 0x7f00_0010_0000), Some(2 << 20));
        assert_eq!(smaps_huge_bytes(smaps, 0x7f00_0040_0000), Some(4 << 20));
        assert_eq!(smaps_huge_bytes(smaps, 0x1000), None);
    }
}
