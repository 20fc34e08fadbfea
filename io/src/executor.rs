//! One glommio executor per core ("shard"), core lists and placement.

use std::future::Future;
use std::io;
use std::path::Path;
use std::thread::JoinHandle;

use glommio::{LocalExecutorBuilder, Placement};

/// glommio refuses to start below this RLIMIT_MEMLOCK (it registers
/// io_uring buffers).
pub const GLOMMIO_MIN_MEMLOCK_BYTES: u64 = 512 * 1024;

/// Memory glommio pre-registers with io_uring per executor. Registered
/// buffers are not used on our data path, so keep it small: many shards then
/// fit in an 8 MiB memlock limit as non-root.
const SHARD_IO_MEMORY_BYTES: usize = 512 * 1024;

/// The cores this process may run on (sched_getaffinity), ascending.
pub fn allowed_cores() -> Vec<usize> {
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid out-buffer of the size passed.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        log::warn!(
            "sched_getaffinity failed ({}); assuming every online core",
            io::Error::last_os_error()
        );
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        return (0..n).collect();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` < CPU_SETSIZE, the capacity of `set`.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Parse a core list such as `"0-3,6"` into sorted, de-duplicated core ids.
pub fn parse_core_list(s: &str) -> Result<Vec<usize>, String> {
    const MAX_CORE: usize = libc::CPU_SETSIZE as usize - 1;
    let parse = |t: &str| -> Result<usize, String> {
        let t = t.trim();
        let v = t
            .parse::<usize>()
            .map_err(|_| format!("invalid core id '{t}' in core list '{s}'"))?;
        if v > MAX_CORE {
            return Err(format!("core id {v} in core list '{s}' exceeds {MAX_CORE}"));
        }
        Ok(v)
    };
    let mut cores = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("empty entry in core list '{s}'"));
        }
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (parse(a)?, parse(b)?);
                if a > b {
                    return Err(format!("descending range '{part}' in core list '{s}'"));
                }
                cores.extend(a..=b);
            }
            None => cores.push(parse(part)?),
        }
    }
    cores.sort_unstable();
    cores.dedup();
    Ok(cores)
}

/// A running shard thread.
#[derive(Debug)]
pub struct ShardHandle {
    shard_id: usize,
    core: Option<usize>,
    name: String,
    thread: JoinHandle<()>,
}

impl ShardHandle {
    pub fn shard_id(&self) -> usize {
        self.shard_id
    }

    /// The core the shard is pinned to (None = unbound).
    pub fn core(&self) -> Option<usize> {
        self.core
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// True once the shard thread has ended (its future returned or panicked).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Wait for the shard's future to finish; Err carries its panic.
    pub fn join(self) -> std::thread::Result<()> {
        self.thread.join()
    }
}

fn memlock_error(limit: u64) -> io::Error {
    io::Error::other(format!(
        "RLIMIT_MEMLOCK is {limit} bytes but a shard executor (glommio) needs at least \
         {GLOMMIO_MIN_MEMLOCK_BYTES}; raise it with `ulimit -l unlimited` or \
         LimitMEMLOCK=infinity in the systemd unit"
    ))
}

/// Pins the calling thread to `core` (`sched_setaffinity` on this thread
/// only; threads it starts later inherit the mask).
pub fn pin_current_thread(core: usize) -> io::Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::other(format!("core {core} is past CPU_SETSIZE")));
    }
    // SAFETY: an all-zero cpu_set_t is the empty set; CPU_SET writes inside it
    // for a core below CPU_SETSIZE (checked above).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Start shard `shard_id` on its own thread named `name`, running a glommio
/// executor pinned to `core` (or unbound when None), and run `f()` on it.
///
/// Returns only after the executor is built, so a bad core or a missing
/// io_uring is reported here rather than as a panic in the thread.
pub fn spawn_shard<F, Fut>(
    shard_id: usize,
    core: Option<usize>,
    name: String,
    f: F,
) -> io::Result<ShardHandle>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    if let Some(limit) = crate::arena::memlock_limit() {
        if limit < GLOMMIO_MIN_MEMLOCK_BYTES {
            return Err(memlock_error(limit));
        }
    }
    let placement = match core {
        Some(c) => Placement::Fixed(c),
        None => Placement::Unbound,
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<io::Result<()>>(1);
    let thread_name = name.clone();
    let thread = std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let built = LocalExecutorBuilder::new(placement)
                .name(&thread_name)
                .io_memory(SHARD_IO_MEMORY_BYTES)
                .make();
            let ex = match built {
                Ok(ex) => ex,
                Err(e) => {
                    let where_ = match core {
                        Some(c) => format!("on core {c}"),
                        None => "unbound".to_string(),
                    };
                    let msg = format!(
                        "cannot start shard {shard_id} executor '{thread_name}' {where_}: {e}"
                    );
                    let _ = ready_tx.send(Err(io::Error::other(msg)));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            drop(ready_tx);
            ex.run(f());
        })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(ShardHandle {
            shard_id,
            core,
            name,
            thread,
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(io::Error::other(format!(
                "shard {shard_id} thread '{name}' died while starting its executor"
            )))
        }
    }
}

/// Work around glommio 0.9's IOPOLL probe (DataDog/glommio#605, #670): the
/// first DmaFile opened on a block device decides, per executor thread,
/// whether that device gets the IOPOLL ring. An empty file makes the probe
/// read hit EOF and wrongly cache "pollable", after which every read on that
/// device fails with EOPNOTSUPP on devices without poll queues. Opening a
/// non-empty file first lets the probe see the real answer.
///
/// Call it inside each executor, before any other DmaFile is opened on the
/// device holding `dir`. It writes and removes a small scratch file in `dir`.
pub async fn warm_dma_probe(dir: &Path) -> io::Result<()> {
    use std::io::Write;
    // One O_DIRECT block of the largest common logical block size.
    const PROBE_LEN: usize = 4096;
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let path = dir.join(format!(".kvshard-dma-probe-{}-{tid}", std::process::id()));
    let result = async {
        let mut f = std::fs::File::create(&path)?;
        f.write_all(&[0u8; PROBE_LEN])?;
        f.sync_all()?;
        drop(f);
        let dma = glommio::io::DmaFile::open(&path)
            .await
            .map_err(io::Error::from)?;
        dma.close().await.map_err(io::Error::from)
    }
    .await;
    let removed = std::fs::remove_file(&path);
    result.map_err(|e| io::Error::new(e.kind(), format!("DMA probe in {}: {e}", dir.display())))?;
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn core_lists_parse() {
        assert_eq!(parse_core_list("0-3,6").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_core_list(" 6, 1-2 ,2,1").unwrap(), vec![1, 2, 6]);
        assert_eq!(parse_core_list("5").unwrap(), vec![5]);
        for bad in ["", "1,,2", "3-1", "a", "1-", "-1", "99999", "1-2-3"] {
            assert!(parse_core_list(bad).is_err(), "'{bad}' should be rejected");
        }
    }

    #[test]
    fn pinning_binds_only_the_calling_thread() {
        let all = allowed_cores();
        let last = *all.last().unwrap();
        let pinned = std::thread::spawn(move || {
            pin_current_thread(last).unwrap();
            allowed_cores()
        })
        .join()
        .unwrap();
        assert_eq!(pinned, [last]);
        assert_eq!(allowed_cores(), all, "the test thread keeps its mask");
        assert!(pin_current_thread(libc::CPU_SETSIZE as usize).is_err());
    }

    #[test]
    fn allowed_cores_is_nonempty_and_sorted() {
        let cores = allowed_cores();
        assert!(!cores.is_empty());
        assert!(cores.windows(2).all(|w| w[0] < w[1]));
    }

    fn current_affinity() -> Vec<usize> {
        allowed_cores()
    }

    #[test]
    fn shard_runs_pinned_on_its_core_and_joins() {
        let core = *allowed_cores().last().unwrap();
        let seen = Arc::new(std::sync::Mutex::new(None));
        let seen2 = seen.clone();
        let ran = Arc::new(AtomicUsize::new(0));
        let ran2 = ran.clone();
        let h = spawn_shard(3, Some(core), "kvs-test-3".into(), move || async move {
            glommio::yield_if_needed().await;
            *seen2.lock().unwrap() = Some((
                current_affinity(),
                std::thread::current().name().map(str::to_string),
            ));
            ran2.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        assert_eq!(h.shard_id(), 3);
        assert_eq!(h.core(), Some(core));
        assert_eq!(h.name(), "kvs-test-3");
        h.join().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        let (aff, name) = seen.lock().unwrap().take().unwrap();
        assert_eq!(aff, vec![core]);
        assert_eq!(name.as_deref(), Some("kvs-test-3"));
    }

    #[test]
    fn unbound_shard_runs() {
        let h = spawn_shard(0, None, "kvs-unbound".into(), || async {}).unwrap();
        assert_eq!(h.core(), None);
        h.join().unwrap();
    }

    #[test]
    fn bad_core_is_reported_at_spawn() {
        let err = spawn_shard(1, Some(4000), "kvs-bad".into(), || async {}).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("core 4000"), "{msg}");
    }

    #[test]
    fn shard_panic_surfaces_in_join() {
        let h = spawn_shard(2, None, "kvs-panic".into(), || async {
            panic!("boom");
        })
        .unwrap();
        assert!(h.join().is_err());
    }

    #[test]
    fn memlock_error_explains_the_fix() {
        let msg = memlock_error(256 * 1024).to_string();
        assert!(msg.contains("262144") && msg.contains("524288"), "{msg}");
        assert!(msg.contains("ulimit -l unlimited"), "{msg}");
    }

    #[test]
    fn dma_probe_makes_later_reads_work() {
        let dir = std::env::temp_dir();
        let h = spawn_shard(0, None, "kvs-dma".into(), move || async move {
            warm_dma_probe(&dir).await.unwrap();
            // An empty, freshly created file is what triggers the glommio bug
            // when it is the first DmaFile on the device.
            let path = dir.join(format!("kvshard-dma-test-{}", std::process::id()));
            let file = glommio::io::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .dma_open(&path)
                .await
                .unwrap();
            let mut buf = file.alloc_dma_buffer(4096);
            buf.as_bytes_mut().fill(0xab);
            assert_eq!(file.write_at(buf, 0).await.unwrap(), 4096);
            let read = file.read_at_aligned(0, 4096).await;
            file.close().await.unwrap();
            std::fs::remove_file(&path).unwrap();
            let read = read.expect("read after the probe");
            assert_eq!(read.len(), 4096);
            assert!(read.iter().all(|b| *b == 0xab));
            let leftovers = std::fs::read_dir(&dir)
                .unwrap()
                .filter_map(|e| e.ok())
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(&format!(".kvshard-dma-probe-{}-", std::process::id()))
                })
                .count();
            assert_eq!(leftovers, 0, "probe file removed");
        })
        .unwrap();
        h.join().unwrap();
    }
}
