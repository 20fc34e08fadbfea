//! Progress lines, a watchdog, a stderr logger, the skip-or-require rule
//! and page-aligned host memory, shared by the GPU tests and the GPU bench
//! (`gds/benches/gpu.rs` includes this file with `#[path]`). Every line
//! starts with the includer's prefix (`gpu_golden:`, `gpu bench:`).

#![allow(dead_code)]

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

fn last_step() -> &'static Mutex<String> {
    static STEP: OnceLock<Mutex<String>> = OnceLock::new();
    STEP.get_or_init(|| Mutex::new("starting".into()))
}

/// Remembers what is being done, for the watchdog's message (prints
/// nothing).
pub fn remember(msg: impl Into<String>) {
    *last_step().lock().unwrap_or_else(|p| p.into_inner()) = msg.into();
}

/// How one binary reports its progress.
pub struct Diag {
    /// Starts every line, before a colon: `gpu_golden`, `gpu bench`.
    pub prefix: &'static str,
    /// The process is aborted after this long.
    pub watchdog_seconds: u64,
    /// Joins the watchdog's "still running after N s" and the last step:
    /// `"; last step: "`, `" while "`.
    pub watchdog_last: &'static str,
}

impl Diag {
    /// Prints a progress line and remembers it for the watchdog.
    pub fn step(&self, msg: impl Into<String>) {
        let msg = msg.into();
        eprintln!("{}: {msg}", self.prefix);
        remember(msg);
    }

    /// Starts (once per process) a thread that aborts the process if it is
    /// still running after `watchdog_seconds`, naming the last step.
    pub fn start_watchdog(&self) {
        static STARTED: OnceLock<()> = OnceLock::new();
        let (prefix, seconds, joiner) = (self.prefix, self.watchdog_seconds, self.watchdog_last);
        STARTED.get_or_init(|| {
            std::thread::Builder::new()
                .name(format!("{}-watchdog", prefix.replace(['_', ' '], "-")))
                .spawn(move || {
                    std::thread::sleep(Duration::from_secs(seconds));
                    let last = last_step()
                        .lock()
                        .map(|s| s.clone())
                        .unwrap_or_else(|p| p.into_inner().clone());
                    eprintln!(
                        "{prefix}: WATCHDOG: still running after {seconds} s{joiner}{last}; \
                         aborting"
                    );
                    std::process::abort();
                })
                .expect("watchdog thread starts");
        });
    }

    /// Prints the crate's log lines (info and up) to stderr, so the device
    /// thread's warnings (a failed pin, a PTX fallback) show in the output.
    pub fn init_log(&self) {
        static LOGGER: OnceLock<StderrLog> = OnceLock::new();
        let logger = LOGGER.get_or_init(|| StderrLog {
            prefix: self.prefix,
        });
        if log::set_logger(logger).is_ok() {
            log::set_max_level(log::LevelFilter::Info);
        }
    }
}

struct StderrLog {
    prefix: &'static str,
}

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Info
    }

    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            eprintln!(
                "{}: log {} {}: {}",
                self.prefix,
                r.level(),
                r.target(),
                r.args()
            );
        }
    }

    fn flush(&self) {}
}

// ---------------------------------------------------------------------------
// Skipping, or failing when the resource is required.
// ---------------------------------------------------------------------------

/// Whether `var` (`KVSHARD_REQUIRE_CUDA`, `KVSHARD_REQUIRE_NVRTC`) is `1`.
pub fn required(var: &str) -> bool {
    std::env::var(var).as_deref() == Ok("1")
}

/// Prints `skipped: <test>: <reason>`, or fails when the variable demands
/// the resource.
pub fn skip(test: &str, require_var: &str, reason: &str) {
    assert!(!required(require_var), "{require_var}=1 but {reason}");
    eprintln!("skipped: {test}: {reason}");
}

// ---------------------------------------------------------------------------
// Host memory.
// ---------------------------------------------------------------------------

/// Zeroed, page-aligned anonymous host memory, unmapped on drop.
pub struct HostBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain owned memory; its users hand its address to the device
// only under the copy's contract (nothing else touches a range until the
// copy into or out of it has completed).
unsafe impl Send for HostBuf {}
// SAFETY: as above; it is only read while no copy into it is in flight.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// Maps `len` bytes (rounded up to pages), or panics.
    pub fn new(len: usize) -> Self {
        Self::map(len).unwrap_or_else(|(len, e)| panic!("mmap of {len} host bytes failed: {e}"))
    }

    /// Maps `len` bytes (rounded up to pages).
    pub fn try_new(len: usize) -> Result<Self, String> {
        Self::map(len).map_err(|(len, e)| format!("mmap of {len} host bytes: {e}"))
    }

    /// The mapping, or the rounded length and the error.
    fn map(len: usize) -> Result<Self, (usize, std::io::Error)> {
        let len = len.max(1).next_multiple_of(4096);
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err((len, std::io::Error::last_os_error()));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The bytes at `[offset, offset + len)`; no copy into them may be in
    /// flight.
    pub fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len);
        // SAFETY: inside the mapping (checked); initialised (zero-filled
        // anonymous memory or completed copies).
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }

    /// A copy of `[offset, offset + len)`; no copy into it may be in flight.
    pub fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        self.slice(offset, len).to_vec()
    }

    /// Writes `bytes` at `offset`; no copy from it may be in flight.
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len);
        // SAFETY: inside the allocation (checked); no other reference to
        // these bytes exists while the caller writes them.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: mapped in map() with this length, unmapped once; nothing
        // uses it any more (its users are dropped or joined first).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
