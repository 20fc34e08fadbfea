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
use kvshard_io::executor::{spawn_shard, ShardHandle};
use kvshard_io::mailbox::{mailbox, notify_queue, MailboxSender};
use kvshard_io::termination;

use kvshard_control::control::ControlHandle;
use kvshard_control::front::{FrontLoop, FrontSetup};
use kvshard_dataplane::config::{EvictionPolicyName, GdsL1Settings, ServerConfig};
use kvshard_dataplane::cuda_transfer::L1Memory;
use kvshard_dataplane::messages::ShardMsg;
use kvshard_dataplane::shard::{run_shard, ShardBacking, ShardConfig};
use kvshard_http::HttpInfo;

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
    termination::catch_signals();
    raise_open_file_limit();
    let n = cfg.cores.len().max(1);
    let align = cfg.l1.align_bytes;
    let slices_of = |size: u64| -> Result<Vec<(u64, u64, u64)>, String> {
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
    };
    // Checked before the arena is made, and again on what was mapped (a
    // device-DAX arena is rounded down to the device alignment).
    let slices = slices_of(cfg.l1.size_bytes)?;
    let (events_tx, events_rx) = notify_queue();
    let (mut store, slices, lock_memory, setup) = match &cfg.l1.gds {
        Some(gds) => {
            let slabs = create_slabs(gds, &slices)?;
            let setup = FrontSetup {
                shm_pool: None,
                huge_pages: HugePages::Off,
                huge_page_bytes: None,
                arena: slabs_status(gds, &slabs),
                l1_memory: None,
                events: events_tx.clone(),
            };
            // Offsets are file offsets: every shard's allocator starts at 0.
            let slices = slices
                .iter()
                .map(|&(_, max, init)| (0, max, init))
                .collect::<Vec<_>>();
            (L1Store::Slabs(slabs), slices, false, setup)
        }
        None => {
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
            let arena = Arc::new(create_arena(&cfg)?);
            log::info!("L1 arena: {}, {n} shards", arena.describe());
            let slices = slices_of(arena.len())?;
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
            };
            (L1Store::Memory(arena), slices, lock_memory, setup)
        }
    };

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

    check_l2_paths(&cfg)?;
    let mut senders = Vec::with_capacity(n);
    let mut handles: Vec<ShardHandle> = Vec::with_capacity(n);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    for (i, (offset, max, init)) in slices.iter().copied().enumerate() {
        let (tx, rx) = mailbox(cfg.shard_queue_depth);
        senders.push(tx);
        let core = cfg.cores.get(i).copied();
        let backing = match &mut store {
            L1Store::Memory(arena) => ShardBacking::Memory(arena.clone()),
            L1Store::Slabs(slabs) => ShardBacking::Slab(slabs.remove(0)),
        };
        let replies = events_tx.clone();
        let l1cfg = L1Config {
            write_ttl: cfg.l1.write_ttl,
            read_ttl: cfg.l1.read_ttl,
            ..L1Config::default()
        };
        let policy = policy_of(&cfg);
        let scfg = ShardConfig {
            id: i,
            max_capacity_bytes: max,
            slice_offset: offset,
            lock_memory,
            eviction_interval: Duration::from_secs(1),
            spin: cfg.spin,
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
    drop(ready_tx);

    // Serve only once every shard is up; on any failure from here on, stop
    // the shards before returning so that the last reference to the arena
    // goes with them and its shm segment is unlinked.
    let started = shards_ready(&ready_rx, n)
        .and_then(|()| start_http(&cfg, ControlHandle::new(events_tx.clone())));
    if let Err(e) = started {
        stop_shards(senders, handles);
        return Err(e);
    }

    drop(store);
    drop(events_tx);
    log::info!(
        "kvshard serving: {n} shards on cores {:?}, L1 {} bytes, chunk size {}, transfer mode {:?}",
        cfg.cores,
        cfg.l1.size_bytes,
        cfg.chunk_size,
        cfg.transfer_mode
    );
    let mut front = FrontLoop::new(cfg.clone(), setup, socket, senders, events_rx);
    // Pinned last: every thread started above keeps its own placement.
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
    log::info!("shutting down");
    drop(front);
    for h in handles {
        let _ = h.join();
    }
    Ok(())
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

/// Starts the HTTP executor on its own thread; it lives until the process exits.
fn start_http(cfg: &ServerConfig, control: ControlHandle) -> Result<(), String> {
    let addr = (cfg.http_host.as_str(), cfg.http_port)
        .to_socket_addrs()
        .map_err(|e| format!("--http-host {}: {e}", cfg.http_host))?
        .next()
        .ok_or_else(|| format!("--http-host {} resolves to no address", cfg.http_host))?;
    // Bind here so a busy port fails start-up, then hand the socket to the executor.
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| format!("cannot bind the HTTP server on {addr}: {e}"))?;
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
            if let Err(e) = kvshard_http::serve(listener, control, Rc::new(info)).await {
                log::error!("HTTP server stopped: {e}");
            }
        },
    )
    .map_err(|e| format!("cannot start the HTTP executor: {e}"))?;
    Ok(())
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
