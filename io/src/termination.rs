//! SIGINT and SIGTERM turned into a flag the process's loops poll, so that a
//! stopped server or load generator still runs its clean-up (shm segments
//! removed, sockets closed) instead of dying where it stands.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    REQUESTED.store(true, Ordering::Relaxed);
}

/// From now on SIGINT and SIGTERM set the flag instead of ending the process.
pub fn catch_signals() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe;
    // `sa` is a zeroed sigaction whose mask is emptied before use.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
    }
}

/// Sets the flag, as a caught signal does.
pub fn request() {
    REQUESTED.store(true, Ordering::Relaxed);
}

/// Whether a stop was asked for (a caught signal, or [`request`]).
pub fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}

/// The flag itself, for loops that take one.
pub fn flag() -> &'static AtomicBool {
    &REQUESTED
}
