//! Start time and resident memory against the L1 size: from spawning
//! `kvshard server` to its first answered noop, and what it holds resident
//! then (the SHM pool's pages and everything else), for a lazy L1 (the
//! default) and one faulted whole at start (`--no-l1-use-lazy`). Each is
//! printed beside the start of the smallest L1 in the same run, the cost of
//! starting a server at all.
//!
//! `cargo bench --bench start` (sizes the host's free memory allows, up to
//! 64 GiB lazy and 4 GiB faulted at start); a tiny run under `cargo test`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::Instant;

use hdrhistogram::Histogram;
use kvshard_io::memory::MemoryRoom;
use support::*;

const BASE_GB: f64 = 0.0625;

/// Bytes free in /dev/shm (the SHM pool must fit there).
fn dev_shm_free() -> u64 {
    let path = std::ffi::CString::new("/dev/shm").unwrap();
    // SAFETY: statvfs fills a zeroed struct we own; result checked.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(path.as_ptr(), &mut st) != 0 {
            return 0;
        }
        st.f_bavail as u64 * st.f_frsize as u64
    }
}

/// Starts the server `runs` times; the start-to-noop times and the resident
/// memory at the last one's answer. An L1 larger than /dev/shm has room for
/// is anonymous memory (`--shm-name ""`), `anon` says so.
fn starts(gb: f64, lazy: bool, runs: usize) -> (Histogram<u64>, RssSplit, bool) {
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds");
    let mut rss = RssSplit::default();
    let size = gb.to_string();
    let mut flags = vec!["--l1-size-gb", size.as_str()];
    if !lazy {
        flags.push("--no-l1-use-lazy");
    }
    let anon = gb * (1u64 << 30) as f64 > dev_shm_free() as f64;
    if anon {
        flags.extend(["--shm-name", ""]);
    }
    for _ in 0..runs {
        let t0 = Instant::now();
        let srv = Server::start(&flags);
        h.record(t0.elapsed().as_micros().max(1) as u64).unwrap();
        rss = if anon {
            // The anonymous arena is every mapping's Rss; nothing to split.
            RssSplit {
                outside: rss_split(srv.child.id(), "").outside,
                ..RssSplit::default()
            }
        } else {
            srv.rss_split()
        };
        drop(srv);
    }
    (h, rss, anon)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run under cargo test: debug build, small sizes, one start each; figures come from `cargo bench`)");
    }
    let room = MemoryRoom::read();
    let free_gb = room.room().unwrap_or(0) as f64 / (1u64 << 30) as f64;
    println!("memory: {}", room.describe());
    let runs = if full { 5 } else { 1 };
    let (lazy_sizes, eager_sizes): (Vec<f64>, Vec<f64>) = if full {
        // Faulting 8 GiB at start takes longer than the support's 10 s
        // wait for the first answer on a small VM.
        (vec![1.0, 4.0, 16.0, 64.0], vec![1.0, 4.0])
    } else {
        (vec![1.0], vec![0.25])
    };
    let (base, _, _) = starts(BASE_GB, true, runs);
    let base_p50 = base.value_at_quantile(0.5).max(1);
    println!(
        "{:<34} start p50 {:>8.1} ms  (the baseline)",
        format!("L1 {BASE_GB} GiB, lazy"),
        base_p50 as f64 / 1000.0
    );
    for (sizes, lazy) in [(lazy_sizes, true), (eager_sizes, false)] {
        for gb in sizes {
            // A lazy start must fit min(20 GiB, size) (the start refuses
            // it otherwise) but faults only a lead; one faulted at start
            // takes it all: leave half the room free then.
            let fits = if lazy {
                gb.min(20.0) < free_gb - 1.0
            } else {
                gb < free_gb / 2.0
            };
            if !fits {
                println!(
                    "L1 {gb} GiB ({}): skipped, {free_gb:.1} GiB free",
                    if lazy { "lazy" } else { "faulted at start" }
                );
                continue;
            }
            let (h, rss, anon) = starts(gb, lazy, runs);
            let p50 = h.value_at_quantile(0.5);
            let kind = match (lazy, anon) {
                (true, false) => "lazy",
                (true, true) => "lazy, anonymous",
                (false, _) => "faulted at start",
            };
            let resident = if anon {
                format!("{:>5.0} MiB in all", mib(rss.outside))
            } else {
                format!(
                    "pool {:>7.0} MiB, other {:>5.0} MiB",
                    mib(rss.arena_rss),
                    mib(rss.outside)
                )
            };
            println!(
                "{:<34} start p50 {:>8.1} ms max {:>8.1} ms = {:>5.2}x the baseline; resident at the answer: {resident}",
                format!("L1 {gb} GiB, {kind}"),
                p50 as f64 / 1000.0,
                h.max() as f64 / 1000.0,
                p50 as f64 / base_p50 as f64,
            );
        }
    }
}
