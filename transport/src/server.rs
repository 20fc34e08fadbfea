//! Start-up and shutdown: the L1 arena, one shard executor per core, the HTTP
//! executor and the front thread.

use std::net::ToSocketAddrs;
use std::rc::Rc;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

use kvshard_engine::eviction::{EvictionConfig, EvictionPolicy, PolicyKind};
use kvshard_engine::l1::{L1Config, L1Shard};
use kvshard_engine::slab::SlabAllocator;
use kvshard_gds::slab::{GdsSlab, SlabOptions};
use kvshard_io::arena::{Arena, ArenaConfig, HugePages};
use kvshard_io::clock::SystemClock;
use kvshard_io::executor::{spawn_shard, ShardHandle};
use kvshard_io::mailbox::{mailbox, notify_queue, MailboxSender, NotifySender};
use kvshard_io::prefault::{PrefaultHandle, Prefaulter};
use kvshard_io::termination;

use kvshard_control::control::ControlHandle;
use kvshard_control::front::{FrontLoop, FrontSetup};
use kvshard_control::lookup_log::LookupHashLog;
use kvshard_dataplane::cuda_transfer::L1Memory;
use kvshard_dataplane::messages::{FrontEvent, ShardMsg};
use kvshard_dataplane::shard::{run_shard, ShardBacking, ShardConfig};
use kvshard_http::HttpInfo;
use kvshard_messages::config::{EvictionPolicyName, GdsL1Settings, ServerConfig};

/// Raises the soft open-file limit to the hard one: every HTTP connection,
/// ZeroMQ peer, shm mapping and L2 file is a descriptor, and soft limits of
/// 1024 are common.
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 || lim.rlim_cur >= lim.rlim_max {
            return;
        }
        let before = lim.rlim_cur;
        lim.rlim_cur = lim.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 {
            log::info!("open-file limit raised from {before} to {}", lim.rlim_max);
        }
    }
}

/// Asks a running server (this process) to stop, as SIGTERM does.
pub fn request_stop() {
    termination::request();
}

/// Slices of the arena per shard: (offset, max capacity, initial capacity).
pub fn shard_slices(
    size: u64,
    init: u64,
    lazy: bool,
    align: u64,
    n: usize,
) -> Vec<(u64, u64, u64)> {
    assert!(n > 0 && align.is_power_of_two());
    let per = (size / n as u64) & !(align - 1);
    let per_init = ((init / n as u64) & !(align - 1)).clamp(align.min(per), per);
    (0..n as u64)
        .map(|i| (i * per, per, if lazy { per_init } else { per }))
        .collect()
}

fn policy_of(cfg: &ServerConfig) -> EvictionPolicy {
    let kind = match cfg.l1.eviction_policy {
        EvictionPolicyName::Lru => PolicyKind::Lru,
        EvictionPolicyName::IsolatedLru => PolicyKind::IsolatedLru,
        EvictionPolicyName::Noop => PolicyKind::Noop,
    };
    let mut ec = EvictionConfig::new(kind);
    ec.trigger_watermark = cfg.l1.trigger_watermark;
    ec.eviction_ratio = cfg.l1.eviction_ratio;
    EvictionPolicy::new(ec)
}

/// Runs the server until SIGINT/SIGTERM. Errors are start-up failures, worded for
/// the operator.
pub fn run(cfg: ServerConfig) -> Result<(), String> {
    let cfg = Arc::new(cfg);
    prepare_process();
    // Checked before the arena is made, and again on what was mapped (a
    // device-DAX arena is rounded down to the device alignment).
    let slices = l1_slices(&cfg, cfg.l1.size_bytes)?;
    // Before any memory is taken: a log directory that cannot be written
    // refuses the start, as an unwritable L2 path does.
    let lookup_log = cfg
        .lookup_hash_log
        .as_ref()
        .map(LookupHashLog::open)
        .transpose()
        .map_err(|e| format!("--lookup-hash-log-dir: {e}"))?;
    check_memory_room(&cfg)?;
    let (events_tx, events_rx) = notify_queue();
    let mut l1 = build_l1(&cfg, slices, lookup_log, &events_tx)?;
    let socket = bind_router(&cfg)?;
    check_l2_paths(&cfg)?;
    let Shards {
        senders,
        handles,
        ready,
    } = start_shards(&cfg, &mut l1, &events_tx)?;
    // Serve only once every shard is up; on any failure from here on, stop
    // the shards before returning so that the last reference to the arena
    // goes with them and its shm segment is unlinked.
    let started = shards_ready(&ready, handles.len())
        .and_then(|()| start_http(&cfg, ControlHandle::new(events_tx.clone())));
    let http = match started {
        Ok(http) => http,
        Err(e) => {
            stop_shards(senders, handles);
            return Err(e);
        }
    };
    // Kept to give the SHM pool's name up at the stop, before the shards end.
    let pool = match &l1.store {
        L1Store::Memory(arena) if arena.shm_name().is_some() => Some(arena.clone()),
        _ => None,
    };
    let L1Built {
        store,
        setup,
        prefaulter,
        ..
    } = l1;
    drop(store);
    drop(events_tx);
    let front = FrontLoop::new(cfg.clone(), setup, socket, senders, events_rx);
    let front = serve(&cfg, front);
    // The faulting thread ends after its current step: nothing more is faulted.
    drop(prefaulter);
    stop(front, http, pool, handles, cfg.shutdown_drain);
    Ok(())
}

/// What the process needs before anything starts: the signal handlers, the
/// open-file limit, and no SHM pools of servers that died.
fn prepare_process() {
    termination::catch_signals();
    raise_open_file_limit();
    remove_dead_pools();
}

/// The shards' slices of an L1 of `size` bytes, or why it is too small.
fn l1_slices(cfg: &ServerConfig, size: u64) -> Result<Vec<(u64, u64, u64)>, String> {
    let n = cfg.cores.len().max(1);
    let align = cfg.l1.align_bytes;
    let slices = shard_slices(
        size,
        cfg.l1.init_size_bytes.min(size),
        cfg.l1.use_lazy,
        align,
        n,
    );
    if slices[0].1 == 0 {
        return Err(format!(
            "--l1-size-gb gives {size} bytes, too small for {n} shards of at least --l1-align-bytes {align}"
        ));
    }
    Ok(slices)
}

/// The L1 as built, before the shards take their parts of it.
struct L1Built {
    store: L1Store,
    /// Per shard: (offset, max capacity, initial capacity).
    slices: Vec<(u64, u64, u64)>,
    lock_memory: bool,
    setup: FrontSetup,
    /// The faulting thread of a lazy L1 in memory, and each shard's handle
    /// on it.
    prefaulter: Option<Prefaulter>,
    prefault_handles: Vec<Option<PrefaultHandle>>,
}

/// Makes the L1: GDS slab files, or the arena in memory (with its faulting
/// thread when lazy); and what the front is told about it.
fn build_l1(
    cfg: &Arc<ServerConfig>,
    slices: Vec<(u64, u64, u64)>,
    mut lookup_log: Option<LookupHashLog>,
    events_tx: &NotifySender<FrontEvent>,
) -> Result<L1Built, String> {
    let n = slices.len();
    if let Some(gds) = &cfg.l1.gds {
        let slabs = create_slabs(gds, &slices)?;
        let setup = FrontSetup {
            shm_pool: None,
            huge_pages: HugePages::Off,
            huge_page_bytes: None,
            arena: slabs_status(gds, &slabs),
            l1_memory: None,
            events: events_tx.clone(),
            lookup_log: lookup_log.take(),
        };
        // Offsets are file offsets: every shard's allocator starts at 0.
        let slices = slices
            .iter()
            .map(|&(_, max, init)| (0, max, init))
            .collect::<Vec<_>>();
        return Ok(L1Built {
            store: L1Store::Slabs(slabs),
            slices,
            lock_memory: false,
            setup,
            prefaulter: None,
            prefault_handles: (0..n).map(|_| None).collect(),
        });
    }
    // Device memory is not swapped and a shared file mapping is written back,
    // not swapped: locking either would only pin page cache or fail.
    let lock_memory =
        cfg.l1.devdax_path.is_none() && kvshard_io::arena::can_lock(cfg.l1.size_bytes);
    if !lock_memory && cfg.l1.devdax_path.is_none() {
        log::warn!(
            "RLIMIT_MEMLOCK ({:?} bytes) is below the L1 size ({} bytes): L1 memory will not be mlock'ed and may be \
             swapped. Raise it with `ulimit -l unlimited` or LimitMEMLOCK=infinity in the systemd unit",
            kvshard_io::arena::memlock_limit(),
            cfg.l1.size_bytes
        );
    }
    let arena = Arc::new(create_arena(cfg)?);
    log::info!("L1 arena: {}, {n} shards", arena.describe());
    let slices = l1_slices(cfg, arena.len())?;
    let huge_page_bytes = arena.huge_page_bytes();
    log_huge_pages(&arena, huge_page_bytes);
    let setup = FrontSetup {
        shm_pool: arena.shm_name().map(|s| (s.to_owned(), arena.len())),
        huge_pages: arena.huge_pages(),
        huge_page_bytes,
        arena: arena_status(&arena),
        l1_memory: Some(L1Memory {
            base: arena.base() as usize,
            len: arena.len() as usize,
            keep: arena.clone(),
        }),
        events: events_tx.clone(),
        lookup_log: lookup_log.take(),
    };
    // A lazy L1 in memory is faulted (and locked) in the background, ahead
    // of use: the start waits for none of it.
    let (prefaulter, prefault_handles) = if cfg.l1.use_lazy && cfg.l1.devdax_path.is_none() {
        let parts: Vec<(u64, u64)> = slices.iter().map(|&(off, max, _)| (off, max)).collect();
        let (p, handles) = Prefaulter::start(arena.clone(), &parts, lock_memory)
            .map_err(|e| format!("cannot start the L1 faulting thread: {e}"))?;
        (Some(p), handles.into_iter().map(Some).collect())
    } else {
        (None, (0..n).map(|_| None).collect())
    };
    Ok(L1Built {
        store: L1Store::Memory(arena),
        slices,
        lock_memory,
        setup,
        prefaulter,
        prefault_handles,
    })
}

/// The ROUTER socket, bound where `--host`/`--port` say.
fn bind_router(cfg: &ServerConfig) -> Result<zmq::Socket, String> {
    let ctx = zmq::Context::new();
    let socket = ctx
        .socket(zmq::ROUTER)
        .map_err(|e| format!("zmq socket: {e}"))?;
    socket
        .set_router_mandatory(true)
        .map_err(|e| format!("zmq ROUTER_MANDATORY: {e}"))?;
    socket
        .set_linger(0)
        .map_err(|e| format!("zmq linger: {e}"))?;
    // ZeroMQ drops a message over this with its connection, before the front
    // could answer it: keep it well above the limit the front answers with a
    // failure reply, and still bound what one message can make libzmq allocate.
    let hard_cap = zmq_message_cap(cfg.max_frame_bytes);
    socket
        .set_maxmsgsize(hard_cap)
        .map_err(|e| format!("zmq maxmsgsize: {e}"))?;
    let url = cfg.zmq_bind_url();
    socket
        .bind(&url)
        .map_err(|e| format!("cannot bind the ZeroMQ server on {url}: {e}"))?;
    log::info!("ZeroMQ ROUTER listening on {url}");
    Ok(socket)
}

/// The shards started: their mailboxes, their threads, and where each says
/// it is ready to serve (see [`shards_ready`]).
struct Shards {
    senders: Vec<MailboxSender<ShardMsg>>,
    handles: Vec<ShardHandle>,
    ready: Receiver<Result<(), String>>,
}

/// Starts one shard executor per core, each on its part of the L1. On a
/// failure the ones started are stopped.
fn start_shards(
    cfg: &Arc<ServerConfig>,
    l1: &mut L1Built,
    events_tx: &NotifySender<FrontEvent>,
) -> Result<Shards, String> {
    let n = l1.slices.len();
    let align = cfg.l1.align_bytes;
    let mut senders = Vec::with_capacity(n);
    let mut handles: Vec<ShardHandle> = Vec::with_capacity(n);
    let (ready_tx, ready) = std::sync::mpsc::channel();
    for (i, (offset, max, init)) in l1.slices.iter().copied().enumerate() {
        let (tx, rx) = mailbox(cfg.shard_queue_depth);
        senders.push(tx);
        let core = cfg.cores.get(i).copied();
        let backing = match &mut l1.store {
            L1Store::Memory(arena) => ShardBacking::Memory(arena.clone()),
            L1Store::Slabs(slabs) => ShardBacking::Slab(slabs.remove(0)),
        };
        let replies = events_tx.clone();
        let l1cfg = L1Config {
            write_ttl: cfg.l1.write_ttl,
            read_ttl: cfg.l1.read_ttl,
            ..L1Config::default()
        };
        let policy = policy_of(cfg);
        let scfg = ShardConfig {
            id: i,
            max_capacity_bytes: max,
            slice_offset: offset,
            lock_memory: l1.lock_memory,
            eviction_interval: Duration::from_secs(1),
            spin: cfg.spin,
            shutdown_drain: cfg.shutdown_drain,
            prefault: l1.prefault_handles[i].take(),
            clock: Arc::new(SystemClock),
        };
        let l2 = (cfg.l2.clone(), n);
        let ready = ready_tx.clone();
        let spawned = spawn_shard(i, core, format!("kvshard-shard-{i}"), move || async move {
            let alloc = SlabAllocator::new(offset, init, align);
            let l1 = L1Shard::new(alloc, l1cfg, policy);
            run_shard(scfg, backing, l1, l2, rx, replies, ready).await
        });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                stop_shards(senders, handles);
                return Err(format!("cannot start shard {i} on core {core:?}: {e}"));
            }
        }
    }
    Ok(Shards {
        senders,
        handles,
        ready,
    })
}

/// Runs the front on this thread (pinned to `--front-core` when given) until
/// the stop, and hands it back for [`stop`].
fn serve(cfg: &ServerConfig, mut front: FrontLoop) -> FrontLoop {
    log::info!(
        "kvshard serving: {} shards on cores {:?}, L1 {} bytes, chunk size {}, transfer mode {:?}",
        cfg.cores.len().max(1),
        cfg.cores,
        cfg.l1.size_bytes,
        cfg.chunk_size,
        cfg.transfer_mode
    );
    // Pinned last: every thread started before keeps its own placement.
    match cfg.front_core {
        Some(core) => match kvshard_io::executor::pin_current_thread(core) {
            Ok(()) => log::info!("front pinned to core {core}"),
            Err(e) => log::warn!("cannot pin the front to core {core} ({e}); it runs unpinned"),
        },
        None => {
            log::info!("the shards take every allowed core: the front runs unpinned beside them")
        }
    }
    front.run(termination::flag());
    front
}

/// Refuses an L1 this host cannot hold: the memory it takes at once (the
/// initial size when lazy, all of it otherwise) must fit in `MemAvailable` and
/// in what the memory cgroup's limit leaves. The hugetlb pool, device DAX and
/// GDS slab files are not that memory (their own checks apply).
fn check_memory_room(cfg: &ServerConfig) -> Result<(), String> {
    let l1 = &cfg.l1;
    if l1.gds.is_some() || l1.devdax_path.is_some() || l1.use_hugepages {
        return Ok(());
    }
    let (need, what) = if l1.use_lazy {
        (
            l1.init_size_bytes.min(l1.size_bytes),
            "its initial size (min of --l1-init-size-gb and --l1-size-gb; the L1 is lazy)",
        )
    } else {
        (l1.size_bytes, "all of --l1-size-gb (--no-l1-use-lazy)")
    };
    let room = kvshard_io::memory::MemoryRoom::read();
    match room.room() {
        Some(r) if need > r => {
            Err(format!(
            "the L1 needs {need} bytes of memory at start, {what}, but this host has {r} bytes \
             to give ({}); lower --l1-size-gb{}",
            room.describe(),
            if l1.use_lazy { " or --l1-init-size-gb" } else { "" }
        ))
        }
        Some(r) => {
            if l1.size_bytes > r {
                log::warn!(
                    "the L1 may grow to {} bytes, more than the {r} this host has to give now ({}): \
                     it stops growing when memory runs short",
                    l1.size_bytes,
                    room.describe()
                );
            }
            Ok(())
        }
        None => Ok(()),
    }
}

/// The stop (SIGTERM, SIGINT): first gives up what another server or an
/// operator needs back, whatever L2 still holds: the ZeroMQ port (with the
/// front), the HTTP port, the SHM pool's name and its lock. Then lets the
/// shards finish the L2 stores in flight for up to `drain`, and returns a
/// second after that at the latest, saying which shards it leaves behind (a
/// write stuck in the kernel keeps its thread; the process may not end
/// before the kernel lets it go).
fn stop(
    front: FrontLoop,
    http: HttpListener,
    pool: Option<Arc<Arena>>,
    handles: Vec<ShardHandle>,
    drain: Duration,
) {
    let t0 = std::time::Instant::now();
    // Closes the ZeroMQ socket and the shard mailboxes: the shards start
    // draining their L2 stores.
    drop(front);
    http.close();
    if let Some(arena) = &pool {
        if arena.release_segment() {
            log::info!(
                "stopping: SHM pool /dev/shm/{} removed (clients that map it keep their pages)",
                arena.shm_name().unwrap_or_default()
            );
        }
    }
    drop(pool);
    log::info!(
        "stopping: ports released; waiting up to {:.1} s for L2 stores in flight",
        drain.as_secs_f64()
    );
    let deadline = t0 + drain + Duration::from_secs(1);
    let mut handles: Vec<Option<ShardHandle>> = handles.into_iter().map(Some).collect();
    loop {
        for slot in handles.iter_mut() {
            if slot.as_ref().is_some_and(ShardHandle::is_finished) {
                let h = slot.take().expect("checked above");
                let id = h.shard_id();
                if h.join().is_err() {
                    log::error!("shard {id} panicked while stopping");
                }
            }
        }
        let left: Vec<usize> = handles
            .iter()
            .flatten()
            .map(ShardHandle::shard_id)
            .collect();
        if left.is_empty() {
            log::info!("stopped in {:.2} s", t0.elapsed().as_secs_f64());
            return;
        }
        if std::time::Instant::now() >= deadline {
            log::warn!(
                "stopping: shards {left:?} have not ended {:.1} s after the stop (an L2 write \
                 stuck in the kernel, such as on a frozen file system?): exiting without them; \
                 what they still write to L2 is abandoned",
                t0.elapsed().as_secs_f64()
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Removes the SHM pools that servers started without `--shm-name` left
/// behind when they died without stopping (SIGKILL, the OOM killer): their
/// automatic names are never used again, so nobody else would.
fn remove_dead_pools() {
    for seg in
        kvshard_io::shm_segment::remove_dead_segments(kvshard_messages::config::is_auto_shm_name)
    {
        log::warn!(
            "removed /dev/shm/{} ({} bytes): the SHM pool of a server that is gone (killed \
             before it could remove it)",
            seg.name,
            seg.size_bytes
        );
    }
}

/// Waits until each of the `n` shards reports that it is ready; the first
/// that cannot start gives the error.
fn shards_ready(ready: &Receiver<Result<(), String>>, n: usize) -> Result<(), String> {
    for _ in 0..n {
        match ready.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err("a shard stopped before it was ready to serve".into()),
        }
    }
    Ok(())
}

/// Stops shards that were started: closing their mailboxes ends them.
fn stop_shards(senders: Vec<MailboxSender<ShardMsg>>, handles: Vec<ShardHandle>) {
    drop(senders);
    for h in handles {
        let (id, name) = (h.shard_id(), h.name().to_owned());
        if h.join().is_err() {
            log::error!("shard {id} ('{name}') panicked while stopping");
        }
    }
}

/// The L1 arena: mapped from `--l1-devdax-path` when given, else a POSIX shm
/// segment (the engine_driven SHM pool) or anonymous memory.
fn create_arena(cfg: &ServerConfig) -> Result<Arena, String> {
    let Some(path) = &cfg.l1.devdax_path else {
        return Arena::create(&ArenaConfig {
            size_bytes: cfg.l1.size_bytes,
            shm_name: cfg.shm_name.clone(),
            mlock: false,
            populate: !cfg.l1.use_lazy,
            huge_pages: huge_pages_of(cfg),
        })
        .map_err(|e| format!("cannot create the L1 arena: {e}"));
    };
    // Configuration refuses the SHM pool with devdax: its clients would map
    // /dev/shm, not the device.
    if cfg.shm_name.is_some() {
        return Err("--l1-devdax-path needs the SHM pool off (--shm-name \"\")".into());
    }
    let region = kvshard_gds::devdax::DaxRegion::map(path, cfg.l1.size_bytes)
        .map_err(|e| format!("cannot map the L1 arena: {e}"))?;
    Arena::from_region(Box::new(region)).map_err(|e| format!("cannot create the L1 arena: {e}"))
}

/// Where the shards' L1 objects live.
enum L1Store {
    Memory(Arc<Arena>),
    /// One slab per shard, in shard order (each handed to its shard).
    Slabs(Vec<GdsSlab>),
}

/// The GDS L1 tier: one slab file per shard slice, in `gds.path`.
fn create_slabs(gds: &GdsL1Settings, slices: &[(u64, u64, u64)]) -> Result<Vec<GdsSlab>, String> {
    let options = SlabOptions {
        direct_io: gds.direct_io,
    };
    let slabs = slices
        .iter()
        .enumerate()
        .map(|(i, &(_, max, _))| {
            GdsSlab::create(&gds.path, i, max, options)
                .map_err(|e| format!("cannot create the GDS L1 slab of shard {i}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    log::info!(
        "L1 in {} GDS slab files of {} bytes in {} ({}, backend {})",
        slabs.len(),
        slices[0].1,
        gds.path.display(),
        if gds.direct_io {
            "O_DIRECT"
        } else {
            "page cache"
        },
        gds.backend.as_str()
    );
    Ok(slabs)
}

/// What /status reports about the GDS slabs (under `l1_manager.arena`); the
/// shards add their files' counters (`slabs`).
fn slabs_status(gds: &GdsL1Settings, slabs: &[GdsSlab]) -> serde_json::Value {
    serde_json::json!({
        "kind": "gds_slab",
        "path": gds.path.display().to_string(),
        "size_bytes": slabs.iter().map(|s| s.size_bytes()).sum::<u64>(),
        "direct_io": gds.direct_io,
        "backend": gds.backend.as_str(),
    })
}

/// What /status reports about the arena's backing (under `l1_manager.arena`).
fn arena_status(arena: &Arena) -> serde_json::Value {
    serde_json::json!({
        "kind": arena.kind(),
        "path": arena.path().map(|p| p.display().to_string()),
        "size_bytes": arena.len(),
    })
}

/// Largest message ZeroMQ delivers (`ZMQ_MAXMSGSIZE`): twice the payload frame
/// limit, at least 1 GiB.
pub fn zmq_message_cap(max_frame_bytes: usize) -> i64 {
    (max_frame_bytes as i64).saturating_mul(2).max(1 << 30)
}

/// The arena's page policy: the hugetlb pool when asked; transparent huge
/// pages when the arena is pre-faulted at start anyway (the page faults, and
/// any compaction they need, then happen before serving, never on a request);
/// base pages for a lazy arena.
fn huge_pages_of(cfg: &ServerConfig) -> HugePages {
    if cfg.l1.use_hugepages {
        HugePages::Hugetlb
    } else if !cfg.l1.use_lazy {
        HugePages::Transparent
    } else {
        HugePages::Off
    }
}

fn log_huge_pages(arena: &Arena, huge_bytes: Option<u64>) {
    let policy = arena.huge_pages();
    let Some(huge) = huge_bytes else {
        log::info!("L1 arena pages: {}", policy.as_str());
        return;
    };
    log::info!(
        "L1 arena pages: {}, {huge} of {} bytes on 2 MiB pages",
        policy.as_str(),
        arena.len()
    );
    if policy == HugePages::Transparent && huge < arena.len() / 2 {
        let hint = if arena.shm_name().is_some() {
            "mount /dev/shm with huge=advise (mount -o remount,huge=advise /dev/shm)"
        } else {
            "set /sys/kernel/mm/transparent_hugepage/enabled to madvise"
        };
        log::warn!(
            "the pre-faulted L1 arena got few huge pages ({huge} of {} bytes): O_DIRECT loads from L2 \
             into scattered base pages split into many more disk requests; {hint}",
            arena.len()
        );
    }
}

/// The HTTP API's listening socket, seen from the thread that started it.
struct HttpListener {
    /// A duplicate of the listener's descriptor: `shutdown(2)` on it stops
    /// the socket listening (the port is free again) whatever the HTTP thread
    /// does, and holding it keeps the descriptor number from being reused.
    fd: std::os::fd::OwnedFd,
}

impl HttpListener {
    /// Stops listening: new connections are refused and the HTTP executor's
    /// accept loop ends.
    fn close(self) {
        use std::os::fd::AsRawFd;
        // SAFETY: shutdown(2) on a descriptor this value owns.
        unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

/// Starts the HTTP executor on its own thread; it lives until the process
/// exits, or serves until [`HttpListener::close`].
fn start_http(cfg: &ServerConfig, control: ControlHandle) -> Result<HttpListener, String> {
    let addr = (cfg.http_host.as_str(), cfg.http_port)
        .to_socket_addrs()
        .map_err(|e| format!("--http-host {}: {e}", cfg.http_host))?
        .next()
        .ok_or_else(|| format!("--http-host {} resolves to no address", cfg.http_host))?;
    // Bind here so a busy port fails start-up, then hand the socket to the executor.
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| format!("cannot bind the HTTP server on {addr}: {e}"))?;
    let fd = std::os::fd::AsFd::as_fd(&std_listener)
        .try_clone_to_owned()
        .map_err(|e| format!("cannot duplicate the HTTP listener: {e}"))?;
    log::info!("HTTP API listening on http://{addr}");
    let info = HttpInfo {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        commit_id: option_env!("KVSHARD_COMMIT_ID").unwrap_or("").to_owned(),
        control_timeout: kvshard_http::DEFAULT_CONTROL_TIMEOUT,
        max_connections: cfg.http_max_connections,
    };
    spawn_shard(
        usize::MAX,
        None,
        "kvshard-http".into(),
        move || async move {
            use std::os::fd::{FromRawFd, IntoRawFd};
            // SAFETY: the fd comes from a listener we own and give up here.
            let listener =
                unsafe { glommio::net::TcpListener::from_raw_fd(std_listener.into_raw_fd()) };
            match kvshard_http::serve(listener, control, Rc::new(info)).await {
                Err(e) if !termination::requested() => log::error!("HTTP server stopped: {e}"),
                _ => log::debug!("HTTP server stopped"),
            }
        },
    )
    .map_err(|e| format!("cannot start the HTTP executor: {e}"))?;
    Ok(HttpListener { fd })
}

/// Creates the fs adapters' directories and checks they are writable, so a
/// bad path stops the start with a clear error instead of failing every store.
fn check_l2_paths(cfg: &ServerConfig) -> Result<(), String> {
    use kvshard_engine::l2::config::AdapterKind;
    for (i, spec) in cfg.l2.adapters.iter().enumerate() {
        let AdapterKind::Fs(f) = &spec.kind else {
            continue;
        };
        let mut dirs = vec![std::path::PathBuf::from(&f.base_path)];
        if let Some(t) = &f.relative_tmp_dir {
            dirs.push(std::path::Path::new(&f.base_path).join(t));
        }
        for d in dirs {
            std::fs::create_dir_all(&d).map_err(|e| {
                format!(
                    "--l2-adapter #{}: cannot create {}: {e}",
                    i + 1,
                    d.display()
                )
            })?;
            let probe = d.join(format!(".kvshard-write-probe.{}", std::process::id()));
            std::fs::write(&probe, b"")
                .and_then(|()| std::fs::remove_file(&probe))
                .map_err(|e| {
                    format!(
                        "--l2-adapter #{}: {} is not writable: {e}",
                        i + 1,
                        d.display()
                    )
                })?;
        }
    }
    Ok(())
}
