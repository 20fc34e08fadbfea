//! The lazy L1's memory, faulted in (and mlocked where the limit allows) on a
//! thread of its own, in bounded steps, a little ahead of what each shard
//! uses.
//!
//! A lazy L1 used to lock its whole initial size on the shards' threads
//! before the server served: 8 GiB took 12 s, and an L1 larger than the
//! machine's memory met the OOM killer before the first log line. Now the
//! server serves at once, and this thread keeps each shard's slice faulted
//! [`AHEAD`] bytes past the highest byte the shard's allocator has handed
//! out, [`STEP`] bytes at a time (as lmcache 0.5.6's lazy allocator pins in
//! 64 MB pieces behind its growing address space). A write that outruns it
//! takes its own page faults, as before.
//!
//! Before each step it reads what memory is left ([`MemoryRoom`]): when a
//! step would leave less than [`RESERVE`], it stops faulting and reports the
//! shortage ([`PrefaultHandle::memory_short`]), so that the shards stop
//! growing their allocators into memory that is not there; it looks again
//! every second.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::arena::Arena;
use crate::memory::MemoryRoom;

/// Bytes faulted (or locked) in one step.
pub const STEP: u64 = 64 << 20;
/// How far ahead of a shard's highest allocated byte its slice is faulted.
pub const AHEAD: u64 = 256 << 20;
/// Memory left to everything else: a step that would leave less waits.
pub const RESERVE: u64 = 512 << 20;
/// How often a shortage is looked at again.
const RECHECK: Duration = Duration::from_secs(1);

struct Slice {
    /// Arena offset of the slice.
    offset: u64,
    /// Its length: nothing past it is faulted.
    max: u64,
    /// Bytes from the start of the slice the shard wants faulted. Read
    /// without the lock (the shard asks on every reservation, and mostly for
    /// what it asked before); raised under it, so the thread cannot miss a
    /// wake-up.
    target: AtomicU64,
    /// Bytes from its start faulted so far.
    faulted: AtomicU64,
}

struct State {
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    slices: Vec<Slice>,
    /// A step was held back for lack of memory, and still is.
    short: AtomicBool,
}

/// The faulting thread. Dropping it stops the thread after its current step.
pub struct Prefaulter {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// One shard's view of the faulting thread.
#[derive(Clone)]
pub struct PrefaultHandle {
    shared: Arc<Shared>,
    slice: usize,
}

impl Prefaulter {
    /// Starts the thread for `slices` of `arena` (`(arena offset, length)`
    /// each, one per shard), faulting nothing until a shard asks. `lock`:
    /// mlock the pages (which faults them in), else fault them with
    /// `MADV_POPULATE_WRITE`.
    pub fn start(
        arena: Arc<Arena>,
        slices: &[(u64, u64)],
        lock: bool,
    ) -> std::io::Result<(Prefaulter, Vec<PrefaultHandle>)> {
        Self::start_with_room(arena, slices, lock, Box::new(MemoryRoom::read))
    }

    /// [`Prefaulter::start`] reading what memory is left with `room`.
    pub fn start_with_room(
        arena: Arc<Arena>,
        slices: &[(u64, u64)],
        lock: bool,
        room: Box<dyn Fn() -> MemoryRoom + Send>,
    ) -> std::io::Result<(Prefaulter, Vec<PrefaultHandle>)> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State { stop: false }),
            wake: Condvar::new(),
            slices: slices
                .iter()
                .map(|&(offset, max)| Slice {
                    offset,
                    max,
                    target: AtomicU64::new(0),
                    faulted: AtomicU64::new(0),
                })
                .collect(),
            short: AtomicBool::new(false),
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvshard-l1-fault".into())
            .spawn(move || run(&worker, &arena, lock, &*room))?;
        let handles = (0..slices.len())
            .map(|slice| PrefaultHandle {
                shared: shared.clone(),
                slice,
            })
            .collect();
        Ok((
            Prefaulter {
                shared,
                thread: Some(thread),
            },
            handles,
        ))
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        lock(&self.shared.state).stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl PrefaultHandle {
    /// The shard's allocator has handed out bytes up to `high_water` of its
    /// slice: keep [`AHEAD`] more faulted. Returns at once.
    pub fn used_up_to(&self, high_water: u64) {
        self.want(high_water.saturating_add(AHEAD));
    }

    /// Asks for the first `upto` bytes of the slice to be faulted. Returns
    /// at once; the thread gets to it in steps.
    pub fn want(&self, upto: u64) {
        let s = &self.shared.slices[self.slice];
        let upto = upto.min(s.max);
        if upto <= s.target.load(Ordering::Relaxed) {
            return;
        }
        let st = lock(&self.shared.state);
        s.target.fetch_max(upto, Ordering::Relaxed);
        drop(st);
        self.shared.wake.notify_all();
    }

    /// Bytes from the start of the slice faulted so far.
    pub fn faulted(&self) -> u64 {
        self.shared.slices[self.slice]
            .faulted
            .load(Ordering::Relaxed)
    }

    /// Whether the thread holds back for lack of memory: the shard should
    /// not grow its allocator meanwhile.
    pub fn memory_short(&self) -> bool {
        self.shared.short.load(Ordering::Relaxed)
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(shared: &Shared, arena: &Arena, mut mlock: bool, read_room: &dyn Fn() -> MemoryRoom) {
    let mut next = 0usize;
    let mut unsupported_logged = false;
    loop {
        // The next slice behind its target, round robin.
        let step = {
            let mut st = lock(&shared.state);
            loop {
                if st.stop {
                    return;
                }
                let n = shared.slices.len();
                let behind = |s: &Slice| {
                    let (target, done) = (
                        s.target.load(Ordering::Relaxed),
                        s.faulted.load(Ordering::Relaxed),
                    );
                    (target > done).then_some((done, target))
                };
                let found = (0..n)
                    .map(|i| (next + i) % n)
                    .find_map(|i| behind(&shared.slices[i]).map(|b| (i, b)));
                match found {
                    Some((i, (done, target))) => {
                        let s = &shared.slices[i];
                        break (i, s.offset + done, (target - done).min(STEP));
                    }
                    None => st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        let (i, at, len) = step;
        next = i + 1;
        let room = read_room();
        if room.room().is_some_and(|r| r < len + RESERVE) {
            if !shared.short.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "L1 memory: faulting more would leave less than {RESERVE} bytes ({}): the \
                     L1 stops growing where it is until memory is freed",
                    room.describe()
                );
            }
            let st = lock(&shared.state);
            if st.stop {
                return;
            }
            drop(shared.wake.wait_timeout(st, RECHECK));
            continue;
        }
        if shared.short.swap(false, Ordering::Relaxed) {
            log::info!(
                "L1 memory: room again ({}); the L1 grows again",
                room.describe()
            );
        }
        let res = if mlock {
            arena.lock_range(at, len)
        } else {
            arena.populate_range(at, len)
        };
        if let Err(e) = res {
            if mlock {
                // The limit was lower than it looked, or was lowered: go on
                // faulting without locking.
                log::warn!(
                    "could not mlock L1 memory ({e}); pages may be swapped out. Raise the limit \
                     with `ulimit -l unlimited` or LimitMEMLOCK=infinity in the systemd unit"
                );
                mlock = false;
                continue;
            }
            if !unsupported_logged {
                unsupported_logged = true;
                log::info!("L1 memory is faulted on first use: {e}");
            }
        }
        shared.slices[i].faulted.fetch_add(len, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::{ArenaConfig, HugePages};

    fn arena(size: u64) -> Arc<Arena> {
        Arc::new(
            Arena::create(&ArenaConfig {
                size_bytes: size,
                shm_name: None,
                mlock: false,
                populate: false,
                huge_pages: HugePages::Off,
            })
            .unwrap(),
        )
    }

    fn wait_faulted(h: &PrefaultHandle, bytes: u64) {
        let t0 = std::time::Instant::now();
        while h.faulted() < bytes {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{} < {bytes}",
                h.faulted()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn slices_are_faulted_ahead_of_use_and_never_past_their_end() {
        let size = 2 * (AHEAD + 3 * STEP);
        let a = arena(size);
        let half = size / 2;
        let (p, h) = Prefaulter::start(a.clone(), &[(0, half), (half, half)], false).unwrap();
        assert_eq!(
            (h[0].faulted(), h[1].faulted()),
            (0, 0),
            "nothing until asked"
        );
        h[0].used_up_to(STEP / 2);
        wait_faulted(&h[0], AHEAD + STEP / 2);
        std::thread::sleep(Duration::from_millis(50));
        assert!(h[0].faulted() <= AHEAD + STEP, "only a step past the lead");
        assert_eq!(h[1].faulted(), 0, "the other shard asked for nothing");
        // Past the end of the slice: faulted to the end and no further.
        h[1].used_up_to(half);
        wait_faulted(&h[1], half);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(h[1].faulted(), half);
        assert!(!h[1].memory_short());
        // The pages are there (Rss of the mapping) and still zero.
        // SAFETY: nobody else touches the arena.
        assert!(unsafe { a.slice(half, half) }.iter().all(|b| *b == 0));
        drop(p);
    }

    #[test]
    fn a_shortage_holds_the_faulting_back_until_memory_is_free_again() {
        let a = arena(AHEAD + 2 * STEP);
        let free = Arc::new(AtomicU64::new(RESERVE));
        let seen = free.clone();
        let room = Box::new(move || MemoryRoom {
            mem_available: Some(seen.load(Ordering::Relaxed)),
            cgroup_limit: None,
            cgroup_used: None,
        });
        let (p, h) = Prefaulter::start_with_room(a, &[(0, AHEAD + 2 * STEP)], false, room).unwrap();
        h[0].used_up_to(0);
        let t0 = std::time::Instant::now();
        while !h[0].memory_short() {
            assert!(t0.elapsed() < Duration::from_secs(5), "no shortage seen");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            h[0].faulted(),
            0,
            "nothing faulted into memory that is not there"
        );
        free.store(RESERVE + 16 * STEP, Ordering::Relaxed);
        wait_faulted(&h[0], AHEAD);
        assert!(!h[0].memory_short());
        drop(p);
    }
}
