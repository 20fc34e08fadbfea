//! The `fs` adapter: one file per object under `base_path`, named and laid out
//! as lmcache 0.5.6's fs adapter does (raw object bytes, no header), so either
//! can read what the other wrote.
//!
//! Every syscall runs on glommio's blocking pool, one job per batch call, so
//! the shard's executor never waits on the disk. Inside a job, O_DIRECT
//! transfers go through a private io_uring with many objects in flight, and
//! buffered ones through `pread`/`pwrite`; either way straight from/to the L1
//! memory.
//!
//! A store writes a temporary file with a name unique to the writer and then
//! renames it onto the object name without replacing an existing file, so an
//! object name only ever shows complete content, also after a crash of the
//! writer (which may leave temporary files; [`FsAdapter::new`] removes those of
//! dead processes). Like 0.5.6 it does not fsync: after a power loss a file
//! may be short or empty, which a load then refuses by its size.
//!
//! Unlike 0.5.6 the adapter counts locks per key (taken by
//! `lookup_and_lock`), so delete and eviction skip objects about to be loaded.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};
use serde_json::json;

use super::config::{FsConfig, GIB};
use super::health::{Failure, Failures, L2Op};
use super::naming::{check_key, file_name, parse_file_name};
use super::{KeyPage, L2Adapter, LocalFut, ObjectBytes, ScanSeen, Scanned, StoreResult};
use crate::keys::ObjectKey;

/// Alignment of buffers, sizes and offsets for O_DIRECT (covers 512-byte and
/// 4 KiB logical blocks).
const DIRECT_ALIGN: usize = 4096;
/// Transfers in flight on one io_uring.
const RING_DEPTH: usize = 32;
/// Largest single read/write request (the SQE length is a u32).
const MAX_IO_CHUNK: usize = 1 << 30;
/// Longest file name on the usual Linux filesystems.
const NAME_MAX: usize = 255;

/// Makes temporary names unique among all adapters of this process (shards
/// share a directory); the pid in the name separates processes.
static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// What the blocking jobs need, shared with them.
struct Shared {
    base: PathBuf,
    tmp_dir: PathBuf,
    use_odirect: bool,
    read_ahead: Option<u64>,
    /// One ring kept between jobs; a job that finds it taken makes its own.
    ring: Mutex<Option<IoUring>>,
    odirect_refused_logged: AtomicBool,
    ring_unavailable_logged: AtomicBool,
}

/// I/O counts of one job, added to the adapter's counters on the executor.
/// Failures are not logged on the blocking thread: the job notes how many
/// objects failed and the first cause, and the executor logs one
/// rate-limited line per job ([`FsAdapter::settle`]), so a full disk writes a
/// few lines, not one per chunk.
#[derive(Debug, Default, Clone)]
struct Tally {
    odirect: u64,
    buffered: u64,
    /// System calls that failed.
    errors: u64,
    /// Objects the job could not handle (I/O errors, files of the wrong size).
    failed: u64,
    first_failure: Option<String>,
}

impl Tally {
    /// One object failed; `io` when a system call failed.
    fn fail(&mut self, io: bool, cause: impl FnOnce() -> String) {
        self.failed += 1;
        if io {
            self.errors += 1;
        }
        if self.first_failure.is_none() {
            self.first_failure = Some(cause());
        }
    }
}

pub struct FsAdapter {
    shared: Arc<Shared>,
    shard: usize,
    capacity: u64,
    locks: RefCell<HashMap<ObjectKey, u32>>,
    odirect_ios: Cell<u64>,
    buffered_ios: Cell<u64>,
    io_errors: Cell<u64>,
    stale_tmp_removed: u64,
    failures: Failures,
}

impl FsAdapter {
    /// Creates `base_path` (and the temporary directory) when missing and
    /// removes temporary files left by processes that no longer run.
    pub fn new(cfg: &FsConfig, shard: usize, num_shards: usize) -> io::Result<FsAdapter> {
        let base = PathBuf::from(&cfg.base_path);
        fs::create_dir_all(&base)?;
        let tmp_dir = match &cfg.relative_tmp_dir {
            Some(rel) => {
                let d = base.join(rel);
                fs::create_dir_all(&d)?;
                d
            }
            None => base.clone(),
        };
        let stale_tmp_removed = remove_stale_tmp_files(&tmp_dir);
        let capacity = if cfg.max_capacity_gb > 0.0 {
            ((cfg.max_capacity_gb * GIB) as u64) / num_shards.max(1) as u64
        } else {
            0
        };
        log::info!(
            "fs adapter (shard {shard}): base_path={} tmp_dir={} use_odirect={} read_ahead_size={:?} capacity_bytes={capacity}",
            base.display(),
            tmp_dir.display(),
            cfg.use_odirect,
            cfg.read_ahead_size,
        );
        Ok(FsAdapter {
            shared: Arc::new(Shared {
                base,
                tmp_dir,
                use_odirect: cfg.use_odirect,
                read_ahead: cfg.read_ahead_size,
                ring: Mutex::new(None),
                odirect_refused_logged: AtomicBool::new(false),
                ring_unavailable_logged: AtomicBool::new(false),
            }),
            shard,
            capacity,
            locks: RefCell::new(HashMap::new()),
            odirect_ios: Cell::new(0),
            buffered_ios: Cell::new(0),
            io_errors: Cell::new(0),
            stale_tmp_removed,
            failures: Failures::default(),
        })
    }

    /// Adds a job's counts to the adapter's and notes and logs its failures,
    /// if any (one rate-limited budget per operation).
    fn settle(&self, op: L2Op, t: Tally) {
        self.odirect_ios.set(self.odirect_ios.get() + t.odirect);
        self.buffered_ios.set(self.buffered_ios.get() + t.buffered);
        self.io_errors.set(self.io_errors.get() + t.errors);
        let Some(first) = t.first_failure else {
            self.failures.succeeded(op);
            return;
        };
        self.failures
            .failed(op, t.failed, || first.clone(), std::time::Instant::now());
        let not_done = match op {
            L2Op::Store => "not stored",
            L2Op::Load => "not loaded",
            L2Op::Lookup => "not checked (counted as misses)",
            L2Op::Delete => "not deleted",
            L2Op::List | L2Op::Probe => "not listed",
        };
        kvshard_io::log_limited!(
            per op.name(); kvshard_io::log_limit::Level::Warn,
            "fs adapter (shard {}): {}: {} objects {not_done}; first: {first}",
            self.shard,
            op.name(),
            t.failed
        );
    }

    /// The key's path, or `None` (logged) for a key 0.5.6 cannot name.
    fn path_of(&self, key: &ObjectKey) -> Option<PathBuf> {
        match check_key(key) {
            Ok(()) => Some(self.shared.base.join(file_name(key))),
            Err(e) => {
                kvshard_io::log_limited!(
                    log::Level::Warn,
                    "fs adapter: key {key:?} has no file name: {e}"
                );
                None
            }
        }
    }

    fn lock_count(&self, key: &ObjectKey) -> u32 {
        self.locks.borrow().get(key).copied().unwrap_or(0)
    }
}

/// The temporary name for writing `final_name`: `<final_name>.<pid>.<seq>.tmp`,
/// with `final_name` cut short where the whole would exceed `NAME_MAX`.
fn tmp_name(final_name: &str) -> String {
    let seq = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
    let suffix = format!(".{}.{seq}.tmp", std::process::id());
    let room = NAME_MAX.saturating_sub(suffix.len());
    let mut cut = final_name.len().min(room);
    while !final_name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{suffix}", &final_name[..cut])
}

/// The pid embedded in a temporary name written by [`tmp_name`].
fn tmp_owner_pid(name: &str) -> Option<libc::pid_t> {
    let rest = name.strip_suffix(".tmp")?;
    let mut it = rest.rsplitn(3, '.');
    let seq = it.next()?;
    let pid = it.next()?;
    it.next()?;
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse::<libc::pid_t>().ok().filter(|p| *p > 0)
}

fn process_is_gone(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Removes our temporary files whose writer process is gone. Files of live
/// processes (other shards, other servers on the same directory) and files of
/// other naming schemes are left alone.
fn remove_stale_tmp_files(dir: &Path) -> u64 {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            log::warn!(
                "fs adapter: cannot scan {} for stale temporary files: {e}",
                dir.display()
            );
            return 0;
        }
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = tmp_owner_pid(name) else {
            continue;
        };
        if !process_is_gone(pid) {
            continue;
        }
        let path = entry.path();
        match fs::remove_file(&path) {
            Ok(()) => {
                removed += 1;
                log::info!(
                    "fs adapter: removed {} (its writer, pid {pid}, is gone)",
                    path.display()
                );
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => log::warn!("fs adapter: cannot remove stale {}: {e}", path.display()),
        }
    }
    removed
}

fn is_direct_eligible(b: &ObjectBytes) -> bool {
    !b.is_empty() && (b.as_ptr() as usize) % DIRECT_ALIGN == 0 && b.len() % DIRECT_ALIGN == 0
}

fn is_einval(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

fn io_err(path: &Path, what: &str, e: &io::Error) -> String {
    format!(
        "{what} {}: {e} (errno {})",
        path.display(),
        e.raw_os_error().unwrap_or(0)
    )
}

impl Shared {
    /// Opens with O_DIRECT when asked, falling back to buffered when the
    /// filesystem refuses O_DIRECT. Returns the file and whether it is direct.
    fn open(&self, path: &Path, write: bool, direct: bool) -> io::Result<(File, bool)> {
        let options = |direct: bool| {
            let mut o = OpenOptions::new();
            if write {
                o.write(true).create_new(true).mode(0o644);
            } else {
                o.read(true);
            }
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o
        };
        if direct {
            match options(true).open(path) {
                Ok(f) => return Ok((f, true)),
                Err(e) if is_einval(&e) => {
                    if !self.odirect_refused_logged.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "fs adapter: the filesystem of {} refuses O_DIRECT ({e}); using buffered I/O",
                            path.display()
                        );
                    }
                    // Some filesystems create the file before refusing the flag.
                    if write {
                        let _ = fs::remove_file(path);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        options(false).open(path).map(|f| (f, false))
    }

    fn take_ring(&self) -> Option<IoUring> {
        if let Ok(mut slot) = self.ring.try_lock() {
            if let Some(r) = slot.take() {
                return Some(r);
            }
        }
        match IoUring::new(RING_DEPTH as u32) {
            Ok(r) => Some(r),
            Err(e) => {
                if !self.ring_unavailable_logged.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "fs adapter: io_uring unavailable ({e}); O_DIRECT transfers run one at a time"
                    );
                }
                None
            }
        }
    }

    fn put_ring(&self, ring: IoUring) {
        if let Ok(mut slot) = self.ring.try_lock() {
            if slot.is_none() {
                *slot = Some(ring);
            }
        }
    }
}

/// One whole-object transfer between a file and object memory.
struct Transfer {
    fd: RawFd,
    buf: ObjectBytes,
    write: bool,
    direct: bool,
    done: usize,
    /// The first `head` bytes are read on their own first (read-ahead hint).
    head: usize,
    error: Option<io::Error>,
}

impl Transfer {
    fn complete(&self) -> bool {
        self.error.is_none() && self.done == self.buf.len()
    }
}

/// Finishes `t` with plain pread/pwrite from `t.done` on. An O_DIRECT
/// descriptor is switched to buffered first, as the rest may be unaligned.
fn finish_buffered(t: &mut Transfer) {
    if t.direct {
        // SAFETY: fcntl on a descriptor this job owns.
        let flags = unsafe { libc::fcntl(t.fd, libc::F_GETFL) };
        if flags == -1 || unsafe { libc::fcntl(t.fd, libc::F_SETFL, flags & !libc::O_DIRECT) } == -1
        {
            t.error = Some(io::Error::last_os_error());
            return;
        }
        t.direct = false;
    }
    positional_io(t);
}

/// pread/pwrite until `t` is complete or fails (on its descriptor as it is).
fn positional_io(t: &mut Transfer) {
    let len = t.buf.len();
    while t.done < len {
        let end = if t.done < t.head { t.head } else { len };
        // SAFETY: the ObjectBytes contract gives this job the memory; the
        // range lies within it.
        let r = unsafe {
            let p = t.buf.as_ptr().add(t.done);
            let n = (end - t.done).min(MAX_IO_CHUNK);
            if t.write {
                libc::pwrite(t.fd, p as *const libc::c_void, n, t.done as libc::off_t)
            } else {
                libc::pread(t.fd, p as *mut libc::c_void, n, t.done as libc::off_t)
            }
        };
        match r {
            n if n > 0 => t.done += n as usize,
            0 => {
                t.error = Some(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("file ended after {} of {len} bytes", t.done),
                ));
                return;
            }
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    t.error = Some(e);
                    return;
                }
            }
        }
    }
}

/// Runs every transfer to completion or error: direct ones through an
/// io_uring, up to `RING_DEPTH` in flight, the others (and direct ones whose
/// rest became unaligned or was refused) with pread/pwrite.
fn run_transfers(shared: &Shared, ts: &mut [Transfer], tally: &mut Tally) {
    let direct: Vec<usize> = (0..ts.len()).filter(|&i| ts[i].direct).collect();
    if !direct.is_empty() {
        match shared.take_ring() {
            Some(mut ring) => {
                if drive_ring(&mut ring, ts, &direct) {
                    shared.put_ring(ring);
                }
            }
            // Still direct, just one at a time; an unaligned rest or a
            // refusal of the device is finished buffered below.
            None => {
                for &i in &direct {
                    let t = &mut ts[i];
                    positional_io(t);
                    if t.error.as_ref().is_some_and(is_einval) {
                        t.error = None;
                    }
                }
            }
        }
    }
    for t in ts.iter_mut() {
        if t.error.is_none() && t.done < t.buf.len() {
            finish_buffered(t);
        }
        if t.direct {
            tally.odirect += 1;
        } else {
            tally.buffered += 1;
        }
    }
}

/// Returns false when the ring ended in an unexpected state and must not be
/// reused.
fn drive_ring(ring: &mut IoUring, ts: &mut [Transfer], direct: &[usize]) -> bool {
    let mut queue: std::collections::VecDeque<usize> = direct.iter().copied().collect();
    let mut in_flight = 0usize;
    let mut cqes: Vec<(usize, i32)> = Vec::with_capacity(RING_DEPTH);
    loop {
        while in_flight < RING_DEPTH {
            let Some(i) = queue.pop_front() else { break };
            let t = &ts[i];
            let n = (t.buf.len() - t.done).min(MAX_IO_CHUNK) as u32;
            // SAFETY: the range is inside the object memory, which this job
            // may use until it returns; it waits for every request it queued.
            let sqe = unsafe {
                let p = t.buf.as_ptr().add(t.done);
                if t.write {
                    opcode::Write::new(types::Fd(t.fd), p as *const u8, n)
                        .offset(t.done as u64)
                        .build()
                } else {
                    opcode::Read::new(types::Fd(t.fd), p, n)
                        .offset(t.done as u64)
                        .build()
                }
            }
            .user_data(i as u64);
            // SAFETY: see above.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                queue.push_front(i);
                break;
            }
            in_flight += 1;
        }
        if in_flight == 0 {
            return true;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) => {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            Err(e) => {
                // Not expected with a valid ring; the requests not completed
                // are failed and the ring is dropped.
                log::error!("fs adapter: io_uring submit failed: {e}");
                for t in ts.iter_mut() {
                    if t.direct && t.error.is_none() && t.done < t.buf.len() {
                        t.error = Some(io::Error::new(e.kind(), e.to_string()));
                    }
                }
                return false;
            }
        }
        cqes.clear();
        cqes.extend(
            ring.completion()
                .map(|c| (c.user_data() as usize, c.result())),
        );
        for &(i, res) in &cqes {
            in_flight = in_flight.saturating_sub(1);
            let Some(t) = ts.get_mut(i) else { continue };
            if res > 0 {
                t.done += res as usize;
                // A short transfer continues here while the rest stays
                // aligned, else buffered after the ring.
                if t.done < t.buf.len() && t.done % DIRECT_ALIGN == 0 {
                    queue.push_back(i);
                }
            } else if res == 0 {
                t.error = Some(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("file ended after {} of {} bytes", t.done, t.buf.len()),
                ));
            } else if res == -libc::EINTR || res == -libc::EAGAIN {
                queue.push_back(i);
            } else if res == -libc::EINVAL {
                // The device wants a larger alignment: finished buffered.
            } else {
                t.error = Some(io::Error::from_raw_os_error(-res));
            }
        }
    }
}

/// Closes `fd`, reporting the error (NFS reports some write errors here).
fn close_checked(f: File) -> io::Result<()> {
    let fd = f.into_raw_fd();
    // SAFETY: the descriptor was owned by `f` and is closed once.
    if unsafe { libc::close(fd) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

enum Rename {
    Done,
    TargetExists,
}

/// Renames `from` onto `to` unless `to` exists; plain rename where the
/// filesystem lacks RENAME_NOREPLACE (the content under one name is always
/// the same object, so replacing it is harmless there).
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<Rename> {
    let cfrom = CString::new(from.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let cto = CString::new(to.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: two valid C strings; the syscall only reads them.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            cfrom.as_ptr(),
            libc::AT_FDCWD,
            cto.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        return Ok(Rename::Done);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EEXIST) => Ok(Rename::TargetExists),
        Some(libc::EINVAL) | Some(libc::ENOSYS) => fs::rename(from, to).map(|()| Rename::Done),
        _ => Err(e),
    }
}

struct StoreJob {
    path: PathBuf,
    tmp: PathBuf,
    buf: ObjectBytes,
}

fn store_blocking(shared: &Shared, jobs: Vec<StoreJob>) -> (Vec<StoreResult>, Tally) {
    let mut tally = Tally::default();
    let mut results = vec![StoreResult::Failed; jobs.len()];
    // (job index, open tmp file) of the objects to write.
    let mut open: Vec<(usize, File)> = Vec::new();
    let mut ts: Vec<Transfer> = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        match fs::metadata(&job.path) {
            Ok(_) => {
                results[j] = StoreResult::Exists;
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tally.fail(true, || io_err(&job.path, "cannot stat", &e));
                continue;
            }
        }
        let want_direct = shared.use_odirect && is_direct_eligible(&job.buf);
        match shared.open(&job.tmp, true, want_direct) {
            Ok((f, direct)) => {
                ts.push(Transfer {
                    fd: f.as_raw_fd(),
                    buf: job.buf,
                    write: true,
                    direct,
                    done: 0,
                    head: 0,
                    error: None,
                });
                open.push((j, f));
            }
            Err(e) => tally.fail(true, || io_err(&job.tmp, "cannot create", &e)),
        }
    }
    run_transfers(shared, &mut ts, &mut tally);
    for ((j, f), t) in open.into_iter().zip(ts) {
        let job = &jobs[j];
        let outcome = match t.error {
            Some(e) => Err(io_err(&job.tmp, "cannot write", &e)),
            None => match close_checked(f) {
                Err(e) => Err(io_err(&job.tmp, "cannot write (close)", &e)),
                Ok(()) => match rename_noreplace(&job.tmp, &job.path) {
                    Ok(Rename::Done) => Ok(StoreResult::Stored(job.buf.len() as u64)),
                    Ok(Rename::TargetExists) => Ok(StoreResult::Exists),
                    Err(e) => Err(io_err(&job.path, "cannot rename onto", &e)),
                },
            },
        };
        results[j] = match outcome {
            Ok(StoreResult::Stored(n)) => StoreResult::Stored(n),
            Ok(other) => {
                let _ = fs::remove_file(&job.tmp);
                other
            }
            Err(msg) => {
                let cleanup = match fs::remove_file(&job.tmp) {
                    Ok(()) => String::new(),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
                    Err(e) => format!("; temporary file left behind: {e}"),
                };
                tally.fail(true, || format!("{msg}{cleanup}"));
                StoreResult::Failed
            }
        };
    }
    (results, tally)
}

fn load_blocking(shared: &Shared, jobs: Vec<(PathBuf, ObjectBytes)>) -> (Vec<bool>, Tally) {
    let mut tally = Tally::default();
    let mut ok = vec![false; jobs.len()];
    let mut open: Vec<(usize, File)> = Vec::new();
    let mut ts: Vec<Transfer> = Vec::new();
    for (j, (path, buf)) in jobs.iter().enumerate() {
        let want_direct = shared.use_odirect && is_direct_eligible(buf);
        let (f, direct) = match shared.open(path, false, want_direct) {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                log::debug!("fs adapter: load: {} is missing", path.display());
                continue;
            }
            Err(e) => {
                tally.fail(true, || io_err(path, "cannot open", &e));
                continue;
            }
        };
        match f.metadata() {
            Ok(m) if m.len() == buf.len() as u64 => {}
            Ok(m) => {
                tally.fail(false, || {
                    format!(
                        "{} holds {} bytes, the buffer has {}",
                        path.display(),
                        m.len(),
                        buf.len()
                    )
                });
                continue;
            }
            Err(e) => {
                tally.fail(true, || io_err(path, "cannot stat", &e));
                continue;
            }
        }
        // 0.5.6 reads the first `read_ahead_size` bytes on their own to
        // trigger the filesystem's read-ahead (buffered reads only).
        let head = match shared.read_ahead {
            Some(ra) if !direct && (ra as usize) < buf.len() => ra as usize,
            _ => 0,
        };
        ts.push(Transfer {
            fd: f.as_raw_fd(),
            buf: *buf,
            write: false,
            direct,
            done: 0,
            head,
            error: None,
        });
        open.push((j, f));
    }
    run_transfers(shared, &mut ts, &mut tally);
    for ((j, _f), t) in open.into_iter().zip(ts) {
        if t.complete() {
            ok[j] = true;
        } else {
            let e = t
                .error
                .unwrap_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof));
            tally.fail(true, || io_err(&jobs[j].0, "cannot read", &e));
        }
    }
    (ok, tally)
}

/// Size of the object file at `path`: `Ok(None)` when missing.
fn object_size(path: &Path) -> io::Result<Option<u64>> {
    match fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(Some(m.len())),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn list_blocking(
    base: &Path,
    model: Option<&str>,
    page_size: usize,
    cursor: Option<&str>,
    tally: &mut Tally,
) -> io::Result<KeyPage> {
    let mut names: Vec<(String, ObjectKey)> = Vec::new();
    for entry in fs::read_dir(base)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(c) = cursor {
            if name <= c {
                continue;
            }
        }
        let Some(key) = parse_file_name(name) else {
            continue;
        };
        if model.is_some_and(|m| m != key.model_name) {
            continue;
        }
        names.push((name.to_string(), key));
    }
    names.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let mut page = KeyPage::default();
    let mut rest = names.into_iter();
    while let Some((name, key)) = rest.next() {
        match object_size(&base.join(&name)) {
            Ok(Some(size)) => page.keys.push((key, size)),
            // Deleted since the scan.
            Ok(None) => {}
            Err(e) => tally.fail(true, || io_err(&base.join(&name), "cannot stat", &e)),
        }
        if page.keys.len() == page_size {
            if rest.len() > 0 {
                page.next_cursor = Some(name);
            }
            break;
        }
    }
    Ok(page)
}

/// The object files of `base` whose keys shard `shard` of `num_shards`
/// owns, with sizes and modification times, in one pass over the directory
/// (each shard stats only its own files). Files that vanish meanwhile are
/// skipped; a stat that fails is counted in `tally`.
fn scan_blocking(
    base: &Path,
    shard: usize,
    num_shards: usize,
    seen: &ScanSeen,
    tally: &mut Tally,
) -> (Vec<Scanned>, io::Result<()>) {
    let mut found = Vec::new();
    let entries = match fs::read_dir(base) {
        Ok(e) => e,
        Err(e) => return (found, Err(e)),
    };
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => return (found, Err(e)),
        };
        seen.fetch_add(1, Ordering::Relaxed);
        let name = entry.file_name();
        let Some(key) = name.to_str().and_then(parse_file_name) else {
            continue;
        };
        if key.shard(num_shards) != shard {
            continue;
        }
        match entry.metadata() {
            Ok(m) if m.is_file() => found.push((key, m.len(), m.modified().ok())),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tally.fail(true, || io_err(&entry.path(), "cannot stat", &e)),
        }
    }
    (found, Ok(()))
}

impl L2Adapter for FsAdapter {
    fn kind(&self) -> &'static str {
        "fs"
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    fn store<'a>(
        &'a self,
        items: &'a [(ObjectKey, ObjectBytes)],
    ) -> LocalFut<'a, Vec<StoreResult>> {
        Box::pin(async move {
            let mut results = vec![StoreResult::Failed; items.len()];
            let mut idx = Vec::with_capacity(items.len());
            let mut jobs = Vec::with_capacity(items.len());
            for (i, (key, buf)) in items.iter().enumerate() {
                let Some(path) = self.path_of(key) else {
                    continue;
                };
                let name = file_name(key);
                jobs.push(StoreJob {
                    path,
                    tmp: self.shared.tmp_dir.join(tmp_name(&name)),
                    buf: *buf,
                });
                idx.push(i);
            }
            if jobs.is_empty() {
                return results;
            }
            let shared = self.shared.clone();
            let (r, tally) = glommio::executor()
                .spawn_blocking(move || store_blocking(&shared, jobs))
                .await;
            self.settle(L2Op::Store, tally);
            for (i, r) in idx.into_iter().zip(r) {
                results[i] = r;
            }
            results
        })
    }

    fn lookup_and_lock<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>> {
        Box::pin(async move {
            let paths: Vec<Option<PathBuf>> = keys.iter().map(|k| self.path_of(k)).collect();
            let (sizes, tally) = glommio::executor()
                .spawn_blocking(move || {
                    let mut tally = Tally::default();
                    let sizes: Vec<Option<u64>> = paths
                        .iter()
                        .map(|p| {
                            let p = p.as_ref()?;
                            object_size(p).unwrap_or_else(|e| {
                                tally.fail(true, || io_err(p, "cannot stat", &e));
                                None
                            })
                        })
                        .collect();
                    (sizes, tally)
                })
                .await;
            self.settle(L2Op::Lookup, tally);
            let mut locks = self.locks.borrow_mut();
            for (key, size) in keys.iter().zip(&sizes) {
                if size.is_some() {
                    *locks.entry(*key).or_insert(0) += 1;
                }
            }
            sizes
        })
    }

    fn load<'a>(&'a self, items: &'a [(ObjectKey, ObjectBytes)]) -> LocalFut<'a, Vec<bool>> {
        Box::pin(async move {
            let mut results = vec![false; items.len()];
            let mut idx = Vec::with_capacity(items.len());
            let mut jobs = Vec::with_capacity(items.len());
            for (i, (key, buf)) in items.iter().enumerate() {
                if let Some(path) = self.path_of(key) {
                    jobs.push((path, *buf));
                    idx.push(i);
                }
            }
            if jobs.is_empty() {
                return results;
            }
            let shared = self.shared.clone();
            let (r, tally) = glommio::executor()
                .spawn_blocking(move || load_blocking(&shared, jobs))
                .await;
            self.settle(L2Op::Load, tally);
            for (i, r) in idx.into_iter().zip(r) {
                results[i] = r;
            }
            results
        })
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut locks = self.locks.borrow_mut();
        for key in keys {
            if let Some(n) = locks.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    locks.remove(key);
                }
            }
        }
    }

    fn delete<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>> {
        Box::pin(async move {
            let mut results = vec![None; keys.len()];
            let mut idx = Vec::new();
            let mut paths = Vec::new();
            for (i, key) in keys.iter().enumerate() {
                if self.lock_count(key) > 0 {
                    continue;
                }
                if let Some(p) = self.path_of(key) {
                    paths.push(p);
                    idx.push(i);
                }
            }
            if paths.is_empty() {
                return results;
            }
            let (freed, tally) = glommio::executor()
                .spawn_blocking(move || {
                    let mut tally = Tally::default();
                    let freed: Vec<Option<u64>> = paths
                        .iter()
                        .map(|p| {
                            let size = match object_size(p) {
                                Ok(s) => s?,
                                Err(e) => {
                                    tally.fail(true, || io_err(p, "cannot stat", &e));
                                    return None;
                                }
                            };
                            match fs::remove_file(p) {
                                Ok(()) => Some(size),
                                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                                Err(e) => {
                                    tally.fail(true, || io_err(p, "cannot remove", &e));
                                    None
                                }
                            }
                        })
                        .collect();
                    (freed, tally)
                })
                .await;
            self.settle(L2Op::Delete, tally);
            for (i, f) in idx.into_iter().zip(freed) {
                results[i] = f;
            }
            results
        })
    }

    fn list<'a>(
        &'a self,
        model_name: Option<&'a str>,
        page_size: usize,
        cursor: Option<String>,
    ) -> LocalFut<'a, io::Result<KeyPage>> {
        Box::pin(async move {
            if page_size == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "page_size must be at least 1",
                ));
            }
            let base = self.shared.base.clone();
            let model = model_name.map(str::to_string);
            let (r, mut tally) = glommio::executor()
                .spawn_blocking(move || {
                    let mut tally = Tally::default();
                    let page = list_blocking(
                        &base,
                        model.as_deref(),
                        page_size,
                        cursor.as_deref(),
                        &mut tally,
                    );
                    (page, tally)
                })
                .await;
            if let Err(e) = &r {
                tally.fail(true, || {
                    io_err(&self.shared.base, "cannot read directory", e)
                });
            }
            self.settle(L2Op::List, tally);
            r
        })
    }

    fn failures(&self) -> Vec<Failure> {
        self.failures.current()
    }

    fn scan(
        &self,
        shard: usize,
        num_shards: usize,
        seen: ScanSeen,
    ) -> LocalFut<'_, (Vec<Scanned>, io::Result<()>)> {
        Box::pin(async move {
            let base = self.shared.base.clone();
            let (found, done, tally) = glommio::executor()
                .spawn_blocking(move || {
                    let mut tally = Tally::default();
                    let (found, done) = scan_blocking(&base, shard, num_shards, &seen, &mut tally);
                    (found, done, tally)
                })
                .await;
            self.settle(L2Op::List, tally);
            (found, done)
        })
    }

    /// Creates and removes a file in the temporary directory: an answer
    /// means the file system takes writes again (a frozen one does not
    /// answer until it is thawed).
    fn probe(&self) -> LocalFut<'_, Result<(), String>> {
        Box::pin(async move {
            let path = self.shared.tmp_dir.join(format!(
                ".kvshard-probe.{}.{}",
                std::process::id(),
                self.shard
            ));
            glommio::executor()
                .spawn_blocking(move || {
                    fs::write(&path, b"")
                        .and_then(|()| fs::remove_file(&path))
                        .map_err(|e| io_err(&path, "cannot write", &e))
                })
                .await
        })
    }

    fn status(&self) -> serde_json::Value {
        json!({
            "type": "fs",
            "shard": self.shard,
            "base_path": self.shared.base.display().to_string(),
            "tmp_dir": self.shared.tmp_dir.display().to_string(),
            "use_odirect": self.shared.use_odirect,
            "read_ahead_size": self.shared.read_ahead,
            "capacity_bytes": self.capacity,
            "locked_keys": self.locks.borrow().len(),
            "odirect_ios": self.odirect_ios.get(),
            "buffered_ios": self.buffered_ios.get(),
            "io_errors": self.io_errors.get(),
            "stale_tmp_removed": self.stale_tmp_removed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tmp_names_fit_and_carry_the_pid() {
        let long = "m".repeat(250);
        for name in ["a.data", long.as_str()] {
            let t = tmp_name(name);
            assert!(t.len() <= NAME_MAX, "{t}");
            assert!(t.ends_with(".tmp"));
            assert_eq!(tmp_owner_pid(&t), Some(std::process::id() as libc::pid_t));
            assert!(parse_file_name(&t).is_none());
        }
        assert_ne!(tmp_name("a.data"), tmp_name("a.data"));
    }

    #[test]
    fn only_our_tmp_names_have_an_owner() {
        assert_eq!(tmp_owner_pid("x.data.999999999.1.tmp"), Some(999_999_999));
        assert_eq!(tmp_owner_pid("x.tmp"), None);
        assert_eq!(tmp_owner_pid("x.data.tmp"), None);
        assert_eq!(tmp_owner_pid("x.data.12.tmp"), None);
        assert_eq!(tmp_owner_pid("x.data.-1.2.tmp"), None);
        assert_eq!(tmp_owner_pid("x.data.0.2.tmp"), None);
        assert_eq!(tmp_owner_pid("x.data.99999999999.2.tmp"), None);
        assert_eq!(tmp_owner_pid("x.data.12.2a.tmp"), None);
        assert_eq!(tmp_owner_pid("x.data.12.3.data"), None);
    }
}
