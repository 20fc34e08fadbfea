//! End to end: the real binary under L1 memory pressure. A small L1 (the
//! support default, 64 MiB) and large engine_driven objects make every test
//! store several times what fits: eviction on reservation, the watermark
//! eviction tick, the noop policy and lazy arena growth are all observed from
//! outside, through the wire protocol, `/status` and `/metrics`.

mod support;
use support::*;

use std::time::{Duration, Instant};

const CS: usize = 16; // --chunk-size in Server::start
const LAYERS: usize = 4;
const HIDDEN: usize = 1024;
/// Bytes of one chunk object: [2, layers, 16 slots, hidden] float16.
const OBJ: usize = 2 * LAYERS * CS * HIDDEN * 2;
/// Chunks per request.
const PER: usize = 8;
const IID: i64 = 1;
const CONFIGURED: u64 = 64 << 20; // --l1-size-gb 0.0625

/// `--cores` with at most two of the cores this process may run on, so the
/// per-shard split of the L1 is exact (64 MiB / 1 or 2) wherever it runs.
fn cores_arg() -> String {
    // SAFETY: sched_getaffinity fills a zeroed set we own; result checked.
    let allowed: Vec<usize> = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    };
    assert!(!allowed.is_empty());
    allowed
        .iter()
        .take(2)
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn start(extra: &[&str]) -> Server {
    let cores = cores_arg();
    let mut args = vec!["--cores", cores.as_str()];
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 50_000)
        .collect()
}

fn request_tokens(req: usize) -> Vec<u32> {
    tokens(req as u32 + 1, PER * CS)
}

fn rid(req: usize) -> String {
    format!("req{req}")
}

/// `/status`'s `storage_manager.l1_manager`.
fn l1(srv: &Server) -> serde_json::Value {
    let (st, body) = srv.http("GET", "/status", None);
    assert_eq!(st, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["storage_manager"]["l1_manager"].clone()
}

fn used_total(srv: &Server) -> (u64, u64) {
    let m = l1(srv);
    (
        m["memory_used_bytes"].as_u64().unwrap(),
        m["memory_total_bytes"].as_u64().unwrap(),
    )
}

fn metric(srv: &Server, name: &str) -> u64 {
    let (st, body) = srv.http("GET", "/metrics", None);
    assert_eq!(st, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name} in /metrics"))
        .trim()
        .parse::<f64>()
        .unwrap() as u64
}

fn register(c: &mut Client) -> ShmMap {
    let r = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                IID,
                "m",
                1,
                LAYERS as i64,
                HIDDEN as i64,
                false,
                CS as i64,
            )],
        )
        .expect("register reply");
    ShmMap::open(
        r.get("shm_name").unwrap().str(),
        r.get("pool_size").unwrap().int() as usize,
    )
}

fn seed(req: usize, chunk: usize) -> u64 {
    (req as u64) << 8 | chunk as u64
}

/// A chunk's bytes: a fill byte with a distinct pattern at both ends, cheap
/// to write and compare at this size even unoptimised.
fn chunk_bytes(seed: u64) -> Vec<u8> {
    let mut v = vec![seed as u8 ^ 0x5a; OBJ];
    v[..64].copy_from_slice(&pattern(seed, 64));
    v[OBJ - 64..].copy_from_slice(&pattern(!seed, 64));
    v
}

fn key(req: usize, worker: Option<i64>, rid: &str) -> V {
    let toks = request_tokens(req);
    ipc_key("m", 1, worker, &toks, 0, (PER * CS) as i64, rid, 1)
}

/// Reserves, fills and commits request `req`'s chunks as the 0.5.6 client
/// does (no commit when nothing was reserved); returns the reserved indices.
fn store(c: &mut Client, pool: &mut ShmMap, req: usize) -> Vec<usize> {
    let k = key(req, Some(0), &rid(req));
    let r = c
        .call(OP_PREPARE_STORE, &[k.clone(), V::I(IID)])
        .expect("prepare_store reply");
    let ctx = r.get("context").expect("a context, also when nothing fits");
    let slots = ctx.get("slots").expect("slots").arr().to_vec();
    let idx: Vec<usize> = ctx
        .get("chunk_indices")
        .expect("chunk_indices")
        .arr()
        .iter()
        .map(|i| i.int() as usize)
        .collect();
    assert_eq!(slots.len(), idx.len());
    for (slot, &i) in slots.iter().zip(&idx) {
        let off = slot.get("offset").unwrap().int() as usize;
        let len = slot.get("length").unwrap().int() as usize;
        assert_eq!(len, OBJ);
        pool.bytes_mut()[off..off + len].copy_from_slice(&chunk_bytes(seed(req, i)));
    }
    if !idx.is_empty() {
        assert_eq!(
            c.call(OP_COMMIT_STORE, &[k, V::I(IID), V::Bin(vec![])]),
            Some(V::B(true)),
            "commit of request {req}"
        );
    }
    assert_eq!(c.call(OP_END_SESSION, &[s(&rid(req))]), None);
    idx
}

fn lookup(c: &mut Client, req: usize, lookup_id: &str) -> i64 {
    assert_eq!(
        c.call(OP_LOOKUP, &[key(req, None, lookup_id), V::I(1)]),
        None
    );
    c.prefetch_result(lookup_id)
}

/// Reads request `req` back under the locks of lookup `lookup_id` and checks
/// every byte of every chunk.
fn check_read_back(c: &mut Client, pool: &ShmMap, req: usize, lookup_id: &str) {
    let k = key(req, Some(0), lookup_id);
    let r = c
        .call(OP_PREPARE_RETRIEVE, &[k.clone(), V::I(IID)])
        .expect("prepare_retrieve reply");
    assert_eq!(r.get("success"), Some(&V::B(true)), "request {req}: {r:?}");
    let slots = r
        .get("context")
        .unwrap()
        .get("slots")
        .unwrap()
        .arr()
        .to_vec();
    assert_eq!(slots.len(), PER);
    for (i, slot) in slots.iter().enumerate() {
        let off = slot.get("offset").unwrap().int() as usize;
        assert!(
            pool.bytes()[off..off + OBJ] == chunk_bytes(seed(req, i))[..],
            "request {req} chunk {i}: bytes read back differ from the bytes stored"
        );
    }
    assert_eq!(
        c.call(OP_COMMIT_RETRIEVE, &[k, V::I(IID)]),
        Some(V::B(true))
    );
}

/// Chunks that fit in the configured L1.
fn fit() -> usize {
    CONFIGURED as usize / OBJ
}

#[test]
fn stores_keep_succeeding_under_pressure() {
    let mut srv = start(&[]);
    let mut c = srv.client();
    let mut pool = register(&mut c);
    assert_eq!(
        l1(&srv)["memory_configured_bytes"].as_u64(),
        Some(CONFIGURED)
    );
    let reqs = 3 * fit() / PER;
    for req in 0..reqs {
        assert_eq!(
            store(&mut c, &mut pool, req).len(),
            PER,
            "request {req}: every chunk reserved, older objects evicted"
        );
        let (used, total) = used_total(&srv);
        assert!(
            used <= total && total <= CONFIGURED,
            "request {req}: used {used} total {total} configured {CONFIGURED}"
        );
    }
    assert!(srv.alive());
    let last = reqs - 1;
    assert_eq!(lookup(&mut c, last, "last"), PER as i64, "newest fully hit");
    check_read_back(&mut c, &pool, last, "last");
    assert_eq!(lookup(&mut c, 0, "first"), 0, "oldest evicted");
    assert!(metric(&srv, "lmcache_mp_l1_evicted_chunks_total") >= (reqs * PER - fit()) as u64);
}

#[test]
fn read_locked_object_survives_pressure() {
    let srv = start(&[]);
    let mut c = srv.client();
    let mut pool = register(&mut c);
    assert_eq!(store(&mut c, &mut pool, 0).len(), PER);
    assert_eq!(store(&mut c, &mut pool, 1).len(), PER);
    // Lookup done, retrieve not yet: request 0 is read-locked (and the oldest).
    assert_eq!(lookup(&mut c, 0, "locked"), PER as i64);
    for req in 2..2 + 3 * fit() / PER {
        assert_eq!(store(&mut c, &mut pool, req).len(), PER, "request {req}");
    }
    assert_eq!(
        lookup(&mut c, 1, "unlocked"),
        0,
        "the unlocked neighbour was evicted"
    );
    check_read_back(&mut c, &pool, 0, "locked");
}

#[test]
fn watermark_tick_evicts_below_the_mark() {
    let srv = start(&[
        "--eviction-trigger-watermark",
        "0.5",
        "--eviction-ratio",
        "0.5",
    ]);
    let mut c = srv.client();
    let mut pool = register(&mut c);
    let before = metric(&srv, "lmcache_mp_l1_evicted_chunks_total");
    assert_eq!(before, 0);
    // About 75% of the L1: above the mark, below what forces evictions on
    // reservation.
    let reqs = 3 * fit() / 4 / PER;
    for req in 0..reqs {
        assert_eq!(store(&mut c, &mut pool, req).len(), PER);
    }
    // The tick runs once a second on each shard.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (used, total) = used_total(&srv);
        if (used as f64) < 0.5 * total as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "usage {used}/{total} still at or above the 0.5 watermark"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let after = metric(&srv, "lmcache_mp_l1_evicted_chunks_total");
    assert!(after > before, "evicted chunks {before} -> {after}");
    // Least recently used first.
    assert_eq!(lookup(&mut c, 0, "oldest"), 0);
    assert_eq!(lookup(&mut c, reqs - 1, "newest"), PER as i64);
    check_read_back(&mut c, &pool, reqs - 1, "newest");
}

#[test]
fn noop_policy_never_evicts() {
    let srv = start(&["--eviction-policy", "noop"]);
    let mut c = srv.client();
    let mut pool = register(&mut c);
    let mut total_chunks = 0;
    let mut empty_in_a_row = 0;
    for req in 0..2 * fit() / PER {
        let got = store(&mut c, &mut pool, req).len();
        total_chunks += got;
        empty_in_a_row = if got == 0 { empty_in_a_row + 1 } else { 0 };
        if empty_in_a_row == 3 {
            break;
        }
    }
    assert_eq!(
        empty_in_a_row, 3,
        "a full L1 answers prepare_store with no slots"
    );
    let (used, total) = used_total(&srv);
    assert_eq!(total, CONFIGURED);
    // Write credits lent before the L1 filled up stay lent (noop evicts
    // nothing to make room for more).
    let credits = srv.l1_count("write_credit_bytes");
    assert_eq!(
        (total_chunks * OBJ) as u64 + credits,
        CONFIGURED,
        "filled to the last object (and the credits lent), no further"
    );
    assert_eq!(used, (total_chunks * OBJ) as u64 + credits);

    // Far above the default 0.8 watermark across eviction ticks: every tick
    // finds the L1 over the mark (it triggers) and nothing goes.
    let triggered = metric(&srv, "lmcache_mp_l1_eviction_loop_triggered_total");
    srv.wait_l1_ticks_after(srv.l1_ticks());
    let shards = srv.l1_count("num_shards");
    assert!(
        metric(&srv, "lmcache_mp_l1_eviction_loop_triggered_total") >= triggered + 2 * shards,
        "the ticks found the full L1 above the watermark"
    );
    assert_eq!(metric(&srv, "lmcache_mp_l1_evicted_chunks_total"), 0);
    assert_eq!(used_total(&srv).0, used);
    c.noop_ok();
    assert_eq!(
        lookup(&mut c, 0, "first"),
        PER as i64,
        "oldest still resident"
    );
    check_read_back(&mut c, &pool, 0, "first");
}

#[test]
fn lazy_l1_grows_on_demand() {
    let srv = start(&["--l1-use-lazy", "--l1-init-size-gb", "0"]);
    let mut c = srv.client();
    let mut pool = register(&mut c);
    let (used0, total0) = used_total(&srv);
    assert_eq!(
        used0,
        srv.l1_count("write_credit_bytes"),
        "only the write credits"
    );
    assert!(
        total0 < (2 * PER * OBJ) as u64,
        "lazy start is small: {total0}"
    );

    for req in 0..2 {
        assert_eq!(store(&mut c, &mut pool, req).len(), PER);
    }
    let (used1, total1) = used_total(&srv);
    assert!(
        total1 > total0 && total1 >= used1 && used1 >= (2 * PER * OBJ) as u64,
        "grown: {total0} -> {total1}, used {used1}"
    );
    assert!(total1 <= CONFIGURED);
    for req in 0..2 {
        let id = format!("r{req}");
        assert_eq!(lookup(&mut c, req, &id), PER as i64);
        check_read_back(&mut c, &pool, req, &id);
    }

    // Beyond the configured size: growth stops there and eviction takes over.
    let reqs = 2 + 2 * fit() / PER;
    for req in 2..reqs {
        assert_eq!(store(&mut c, &mut pool, req).len(), PER, "request {req}");
        let (used, total) = used_total(&srv);
        assert!(used <= total && total <= CONFIGURED, "{used}/{total}");
    }
    assert_eq!(
        used_total(&srv).1,
        CONFIGURED,
        "grown to the configured size"
    );
    assert_eq!(lookup(&mut c, reqs - 1, "last"), PER as i64);
    check_read_back(&mut c, &pool, reqs - 1, "last");
}

#[test]
fn eager_l1_is_fully_allocated_from_the_start() {
    let srv = start(&["--no-l1-use-lazy"]);
    assert_eq!(used_total(&srv), (0, CONFIGURED));
    let mut c = srv.client();
    let mut pool = register(&mut c);
    assert_eq!(store(&mut c, &mut pool, 0).len(), PER);
    let credits = srv.l1_count("write_credit_bytes");
    assert_eq!(used_total(&srv), ((PER * OBJ) as u64 + credits, CONFIGURED));
}

#[test]
fn allocation_failures_are_the_store_and_load_refusals() {
    let srv = start(&[]);
    let mut c = srv.client();
    let _pool = register(&mut c);
    // Reservations never committed hold their memory until the write TTL, so
    // 1.5x what fits leaves the last third of the chunks without room.
    let reqs = 3 * fit() / 2 / PER;
    let mut refused = 0;
    for req in 0..reqs {
        let r = c
            .call(OP_PREPARE_STORE, &[key(req, Some(0), &rid(req)), V::I(IID)])
            .expect("prepare_store reply");
        let reserved = r.get("context").unwrap().get("slots").unwrap().arr().len();
        refused += PER - reserved;
    }
    assert!(refused >= fit() / 2 - PER, "{refused} chunks found no room");
    let failures = metric(&srv, "lmcache_mp_l1_allocation_failure_chunks_total");
    assert_eq!(failures, refused as u64);
    assert_eq!(metric(&srv, "kvshard_store_oom_chunks_total"), failures);
    assert_eq!(metric(&srv, "kvshard_l2_load_oom_chunks_total"), 0);
    let mut srv = srv;
    assert!(srv.alive());
}
