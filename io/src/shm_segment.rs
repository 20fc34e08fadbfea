//! Who owns a named POSIX shm segment, across processes.
//!
//! The engine_driven L1 pool is a segment with a fixed name
//! (`lmcache_l1_pool_<--shm-name>`), so two servers started with the same name
//! meet in `/dev/shm`. The owner holds an exclusive `flock` on the segment for as
//! long as it lives (the kernel drops it when the process dies, however it dies):
//!
//! - a segment whose lock can be taken is stale (its server is gone) and is
//!   replaced, as lmcache 0.5.6 replaces it;
//! - a segment whose lock is held belongs to a live server: creation fails with
//!   an error naming that process, and the segment is left alone;
//! - at exit the owner unlinks the name only while it still refers to the
//!   segment it created (same device and inode), so a process never removes a
//!   segment another one made.
//!
//! Clients map the segment without locking it, so they never interfere.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Attempts at claiming the name while other processes race for it.
const CLAIM_ATTEMPTS: usize = 4;

/// A segment this process created and holds the lock of. Dropping it unlinks
/// the name if the name still refers to this segment, then closes the fd (which
/// releases the lock).
#[derive(Debug)]
pub struct OwnedSegment {
    name: String,
    fd: OwnedFd,
}

/// The process holding a segment's lock, as far as `/proc` tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// Its command line, space-separated ("" if unreadable).
    pub cmdline: String,
}

/// Why a segment could not be claimed.
#[derive(Debug)]
pub enum SegmentError {
    /// A live process holds the segment's lock. `holder` is `None` when
    /// `/proc/locks` does not show it (another pid namespace, for one).
    InUse {
        name: String,
        holder: Option<Holder>,
    },
    /// A system call failed.
    Os {
        op: &'static str,
        name: String,
        source: io::Error,
    },
}

impl fmt::Display for SegmentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SegmentError::InUse { name, holder } => {
                write!(f, "shm segment '/{name}' is in use by ")?;
                match holder {
                    Some(h) if h.cmdline.is_empty() => write!(f, "process {}", h.pid)?,
                    Some(h) => write!(f, "process {} ({})", h.pid, h.cmdline)?,
                    None => write!(f, "a live process (not visible in /proc/locks)")?,
                }
                write!(
                    f,
                    ": another server runs with this --shm-name. Stop it first, or give this \
                     server another --shm-name"
                )
            }
            SegmentError::Os { op, name, source } => {
                write!(f, "{op} failed for shm segment '/{name}': {source}")
            }
        }
    }
}

impl std::error::Error for SegmentError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SegmentError::Os { source, .. } => Some(source),
            SegmentError::InUse { .. } => None,
        }
    }
}

fn cname(name: &str) -> CString {
    CString::new(format!("/{name}")).expect("shm names are validated: no NUL")
}

/// Where glibc's `shm_open` keeps segments.
fn path_of(name: &str) -> String {
    format!("/dev/shm/{name}")
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid out-parameter; `fd` is open.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Whether `/dev/shm/<name>` is the file open as `fd`.
fn name_refers_to(name: &str, fd: RawFd) -> io::Result<bool> {
    let mine = fstat(fd)?;
    let path = CString::new(path_of(name)).expect("no NUL");
    // SAFETY: as in `fstat`; `path` is NUL-terminated.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::stat(path.as_ptr(), &mut st) } != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(false),
            _ => Err(e),
        };
    }
    Ok(st.st_dev == mine.st_dev && st.st_ino == mine.st_ino)
}

fn shm_open(name: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = cname(name);
    // SAFETY: `c` is NUL-terminated.
    let raw = unsafe { libc::shm_open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o600) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Takes the exclusive `flock` without waiting; false if another open file holds it.
pub fn try_lock(fd: RawFd) -> io::Result<bool> {
    // SAFETY: flock on an open fd.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        _ => Err(e),
    }
}

fn unlink(name: &str) -> io::Result<()> {
    let c = cname(name);
    // SAFETY: `c` is NUL-terminated.
    if unsafe { libc::shm_unlink(c.as_ptr()) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOENT) {
            return Err(e);
        }
    }
    Ok(())
}

impl OwnedSegment {
    /// Creates the segment `/dev/shm/<name>` (empty, mode 0600) and takes its
    /// lock. A segment of that name that no live process holds is removed first;
    /// one that a live process holds is left alone and reported as
    /// [`SegmentError::InUse`].
    pub fn create(name: &str) -> Result<OwnedSegment, SegmentError> {
        let os = |op: &'static str, source: io::Error| SegmentError::Os {
            op,
            name: name.to_owned(),
            source,
        };
        for _ in 0..CLAIM_ATTEMPTS {
            match shm_open(name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR) {
                Ok(fd) => {
                    // Another starter may have judged this fresh segment stale and
                    // replaced it before the lock was taken: check both.
                    if try_lock(fd.as_raw_fd()).map_err(|e| os("flock", e))?
                        && name_refers_to(name, fd.as_raw_fd()).map_err(|e| os("stat", e))?
                    {
                        return Ok(OwnedSegment {
                            name: name.to_owned(),
                            fd,
                        });
                    }
                    continue;
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(os("shm_open", e)),
            }
            let old = match shm_open(name, libc::O_RDWR) {
                Ok(fd) => fd,
                // Removed since: try creating again.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => return Err(os("shm_open (existing segment)", e)),
            };
            if !try_lock(old.as_raw_fd()).map_err(|e| os("flock", e))? {
                return Err(SegmentError::InUse {
                    name: name.to_owned(),
                    holder: holder_of(old.as_raw_fd()),
                });
            }
            // Nobody alive holds it. Clients that still map it keep their pages.
            if name_refers_to(name, old.as_raw_fd()).map_err(|e| os("stat", e))? {
                unlink(name).map_err(|e| os("shm_unlink (stale segment)", e))?;
                log::warn!(
                    "removed stale shm segment {} (no live process held it)",
                    path_of(name)
                );
            }
        }
        Err(os(
            "claiming",
            io::Error::other(format!(
                "the name changed hands {CLAIM_ATTEMPTS} times while this server started: \
                 other processes keep creating it"
            )),
        ))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for OwnedSegment {
    fn drop(&mut self) {
        // While this process holds the lock nobody can replace the segment, so a
        // name that refers to it now still does when it is unlinked.
        match name_refers_to(&self.name, self.fd.as_raw_fd()) {
            Ok(true) => {
                if let Err(e) = unlink(&self.name) {
                    log::warn!("shm_unlink(/{}) failed: {e}", self.name);
                }
            }
            Ok(false) => log::warn!(
                "shm segment {} no longer refers to the segment this process created; left in place",
                path_of(&self.name)
            ),
            Err(e) => log::warn!(
                "cannot check shm segment {} before removing it: {e}; left in place",
                path_of(&self.name)
            ),
        }
    }
}

/// A segment [`remove_dead_segments`] removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovedSegment {
    pub name: String,
    pub size_bytes: u64,
}

/// Removes the segments in `/dev/shm` whose name `is_candidate` accepts and
/// whose owner is gone: nobody holds their lock (a server killed with
/// SIGKILL, or by the OOM killer, cannot remove its own). A segment whose
/// lock is held belongs to a live server and is left alone; so is one another
/// starter creates meanwhile (it takes the lock, or retries its claim when it
/// finds the name gone). Errors skip the segment. Clients that still map a
/// removed segment keep their pages until they unmap them.
pub fn remove_dead_segments(is_candidate: impl Fn(&str) -> bool) -> Vec<RemovedSegment> {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if !is_candidate(&name) {
            continue;
        }
        let Ok(fd) = shm_open(&name, libc::O_RDWR) else {
            continue;
        };
        // Held: its server is alive. The lock is ours until `fd` closes.
        if !try_lock(fd.as_raw_fd()).unwrap_or(false) {
            continue;
        }
        let Ok(st) = fstat(fd.as_raw_fd()) else {
            continue;
        };
        if name_refers_to(&name, fd.as_raw_fd()).unwrap_or(false) && unlink(&name).is_ok() {
            removed.push(RemovedSegment {
                name,
                size_bytes: st.st_size.max(0) as u64,
            });
        }
    }
    removed
}

/// The process holding an flock on the file open as `fd`, from `/proc/locks`.
pub fn holder_of(fd: RawFd) -> Option<Holder> {
    let st = fstat(fd).ok()?;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let pid = flock_holder(
        &locks,
        libc::major(st.st_dev),
        libc::minor(st.st_dev),
        st.st_ino,
    )?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            let s: Vec<String> = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            s.join(" ")
        })
        .unwrap_or_default();
    Some(Holder { pid, cmdline })
}

/// The pid of the first granted FLOCK in `/proc/locks` text on the file
/// (device `major:minor`, inode `ino`). Lines look like
/// `3: FLOCK  ADVISORY  WRITE 4242 00:1a:12345 0 EOF`; waiters (`->`) are skipped.
fn flock_holder(locks: &str, major: u32, minor: u32, ino: u64) -> Option<u32> {
    locks.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        let _id = f.next()?;
        if f.next()? != "FLOCK" {
            return None;
        }
        let (_mode, _rw, pid, file) = (f.next()?, f.next()?, f.next()?, f.next()?);
        let mut parts = file.split(':');
        let maj = u32::from_str_radix(parts.next()?, 16).ok()?;
        let min = u32::from_str_radix(parts.next()?, 16).ok()?;
        let i: u64 = parts.next()?.parse().ok()?;
        (maj == major && min == minor && i == ino)
            .then(|| pid.parse().ok())
            .flatten()
            .filter(|p| *p > 0)
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A segment name no other test (or test process) uses.
    pub(crate) fn unique_name(tag: &str) -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        format!(
            "kvshard_test_{tag}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn exists(name: &str) -> bool {
        std::path::Path::new(&path_of(name)).exists()
    }

    #[test]
    fn proc_locks_lines_are_matched_by_device_and_inode() {
        let text = "1: POSIX  ADVISORY  WRITE 10 00:1a:99 0 EOF\n\
                    2: FLOCK  ADVISORY  WRITE 4242 00:1a:12345 0 EOF\n\
                    2: -> FLOCK  ADVISORY  WRITE 77 00:1a:12345 0 EOF\n\
                    3: FLOCK  ADVISORY  WRITE 5151 fd:01:12345 0 EOF\n";
        assert_eq!(flock_holder(text, 0, 0x1a, 12345), Some(4242));
        assert_eq!(flock_holder(text, 0xfd, 1, 12345), Some(5151));
        assert_eq!(
            flock_holder(text, 0, 0x1a, 99),
            None,
            "POSIX locks are not ours"
        );
        assert_eq!(flock_holder(text, 0, 0x1b, 12345), None);
        assert_eq!(flock_holder("garbage\n\n1:", 0, 0, 0), None);
    }

    #[test]
    fn a_held_segment_is_refused_naming_the_holder_and_left_alone() {
        let name = unique_name("held");
        let first = OwnedSegment::create(&name).unwrap();
        match OwnedSegment::create(&name) {
            Err(SegmentError::InUse { name: n, holder }) => {
                assert_eq!(n, name);
                let h = holder.expect("our own flock shows in /proc/locks");
                assert_eq!(h.pid, std::process::id());
                let msg = SegmentError::InUse {
                    name: n,
                    holder: Some(h),
                }
                .to_string();
                assert!(
                    msg.contains(&format!("process {}", std::process::id())),
                    "{msg}"
                );
            }
            other => panic!("expected InUse, got {other:?}"),
        }
        assert!(exists(&name), "the live segment must stay");
        assert!(name_refers_to(&name, first.fd()).unwrap());
        drop(first);
        assert!(!exists(&name), "its owner removes it");
    }

    #[test]
    fn an_unlocked_segment_is_stale_and_replaced() {
        let name = unique_name("stale");
        let stale = shm_open(&name, libc::O_CREAT | libc::O_RDWR).unwrap();
        let seg = OwnedSegment::create(&name).unwrap();
        assert!(!name_refers_to(&name, stale.as_raw_fd()).unwrap());
        assert!(name_refers_to(&name, seg.fd()).unwrap());
    }

    #[test]
    fn only_dead_candidates_are_removed() {
        let dead = unique_name("dead_owner");
        let live = unique_name("live_owner");
        let other = unique_name("not_a_candidate");
        // A segment nobody holds (its creator is gone), one a live owner
        // holds, and one whose name the caller does not claim.
        let stale = shm_open(&dead, libc::O_CREAT | libc::O_RDWR).unwrap();
        // SAFETY: `stale` is an open shm fd.
        assert_eq!(unsafe { libc::ftruncate(stale.as_raw_fd(), 8192) }, 0);
        drop(stale);
        let held = OwnedSegment::create(&live).unwrap();
        drop(shm_open(&other, libc::O_CREAT | libc::O_RDWR).unwrap());
        let removed = remove_dead_segments(|n| n == dead || n == live);
        assert_eq!(
            removed,
            vec![RemovedSegment {
                name: dead.clone(),
                size_bytes: 8192
            }]
        );
        assert!(!exists(&dead));
        assert!(exists(&live), "a live owner's segment stays");
        assert!(exists(&other), "not a candidate");
        drop(held);
        unlink(&other).unwrap();
    }

    #[test]
    fn drop_leaves_a_segment_it_did_not_create() {
        let name = unique_name("replaced");
        let old = OwnedSegment::create(&name).unwrap();
        // Someone removed ours and made their own under the name.
        unlink(&name).unwrap();
        let theirs = shm_open(&name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR).unwrap();
        drop(old);
        assert!(
            exists(&name),
            "the other process's segment must survive our exit"
        );
        assert!(name_refers_to(&name, theirs.as_raw_fd()).unwrap());
        unlink(&name).unwrap();
    }
}
