//! A shard kept saturated with requests still runs its ticker (expiry and
//! eviction): its request loop yields to the shard's other tasks. So does a
//! shard spinning on an empty mailbox.
//!
//! The shard runs in-process on its own executor so that the test can keep
//! its mailbox full: every flooded request is a `/status` report, which costs
//! the shard a walk over its L1 objects and the sender almost nothing, so the
//! mailbox never runs dry and a shard that does not yield never ticks.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_engine::eviction::{EvictionConfig, EvictionPolicy, PolicyKind};
use kvshard_engine::keys::{Name, ObjectKey, CHUNK_HASH_LEN};
use kvshard_engine::l1::{L1Config, L1Shard, WriterTag};
use kvshard_engine::slab::SlabAllocator;
use kvshard_io::arena::{Arena, ArenaConfig, HugePages};
use kvshard_io::executor::{spawn_shard, ShardHandle};
use kvshard_io::mailbox::{mailbox, notify_queue, MailboxSender, NotifyReceiver, SendError};
use kvshard_transport::config::L2Settings;
use kvshard_transport::messages::{FrontEvent, ShardMsg, ShardOp, ShardReplyBody};
use kvshard_transport::shard::{run_shard, ShardBacking, ShardConfig};

use support::wait_until;

/// Resident objects: enough that one status report costs the shard far more
/// than queueing one costs the sender.
const OBJECTS: u64 = 20_000;
const OBJECT_BYTES: u64 = 64;
const MAILBOX_DEPTH: usize = 4096;
/// Every this many flooded requests one asks for a reply.
const REPLY_EVERY: u64 = 64;

fn key(i: u64) -> ObjectKey {
    let mut chunk_hash = [0u8; CHUNK_HASH_LEN];
    chunk_hash[..8].copy_from_slice(&i.to_le_bytes());
    ObjectKey {
        chunk_hash,
        model_name: Name::intern("m").unwrap(),
        kv_rank: 0,
        object_group_id: 0,
        cache_salt: Name::EMPTY,
    }
}

/// A request for the shard's status report; `seq` 0 asks for no reply.
fn status(seq: u64) -> ShardMsg {
    ShardMsg {
        seq,
        op: ShardOp::Status,
    }
}

/// Starts a shard holding [`OBJECTS`] objects, polling an empty mailbox for
/// `spin` before parking, after `prefill` has queued its first requests.
fn start_shard(
    spin: Duration,
    prefill: impl FnOnce(&MailboxSender<ShardMsg>),
) -> (
    MailboxSender<ShardMsg>,
    NotifyReceiver<FrontEvent>,
    ShardHandle,
) {
    let capacity = OBJECTS * OBJECT_BYTES * 2;
    let arena = Arc::new(
        Arena::create(&ArenaConfig {
            size_bytes: capacity,
            shm_name: None,
            mlock: false,
            populate: false,
            huge_pages: HugePages::Off,
        })
        .unwrap(),
    );
    let (tx, rx) = mailbox::<ShardMsg>(MAILBOX_DEPTH);
    let (replies_tx, replies) = notify_queue::<FrontEvent>();
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let cfg = ShardConfig {
        id: 0,
        max_capacity_bytes: capacity,
        slice_offset: 0,
        lock_memory: false,
        // Due at once: only the shard's own scheduling keeps a tick waiting.
        eviction_interval: Duration::from_millis(1),
        spin,
        shutdown_drain: Duration::from_secs(10),
        prefault: None,
        clock: std::sync::Arc::new(kvshard_io::clock::SystemClock),
    };
    let backing = ShardBacking::Memory(arena);
    prefill(&tx);
    let shard = spawn_shard(0, None, "kvs-yield-test".into(), move || async move {
        let alloc = SlabAllocator::new(0, capacity, OBJECT_BYTES);
        let mut l1 = L1Shard::new(
            alloc,
            L1Config::default(),
            EvictionPolicy::new(EvictionConfig::new(PolicyKind::Lru)),
        );
        let keys: Vec<ObjectKey> = (0..OBJECTS).map(key).collect();
        let now = Instant::now();
        let reserved = l1.reserve_write(&keys, OBJECT_BYTES, WriterTag(1), false, now);
        assert!(reserved.iter().all(|r| r.is_ok()));
        let admitted = l1.finish_write(&keys, WriterTag(1), now);
        assert!(admitted.iter().all(|r| r.is_ok()));
        let l2 = (L2Settings::default(), 1);
        run_shard(cfg, backing, l1, l2, rx, replies_tx, ready_tx).await
    })
    .unwrap();
    assert_eq!(ready.recv().unwrap(), Ok(()));
    (tx, replies, shard)
}

/// The tick counts of the status reports among `events`.
fn ticks_reported(
    replies: &mut NotifyReceiver<FrontEvent>,
    events: &mut Vec<FrontEvent>,
) -> Vec<u64> {
    replies.drain(events);
    events
        .drain(..)
        .filter_map(|e| match e {
            FrontEvent::Shard(r) => match r.body {
                ShardReplyBody::Status(report) => Some(report.stats.eviction_loop_ticks),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn a_saturated_shard_still_ticks() {
    // The n-th flooded request; every REPLY_EVERY-th asks for a reply.
    let nth = |n: u64| status(if n % REPLY_EVERY == 0 { n } else { 0 });
    // Full before the shard starts: its first tick is due only after it has
    // begun taking requests, and from then on it always has more queued.
    let (tx, mut replies, shard) = start_shard(Duration::ZERO, |tx| {
        for n in 1..=MAILBOX_DEPTH as u64 {
            assert!(tx.try_send(nth(n)).is_ok());
        }
    });
    let mut n = MAILBOX_DEPTH as u64;
    let mut next = move || {
        n += 1;
        nth(n)
    };

    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut msg = next();
                loop {
                    match tx.try_send(msg) {
                        Ok(()) => break,
                        Err(SendError::Full(back)) => msg = back,
                        Err(SendError::Closed(_)) => panic!("the shard ended while flooded"),
                    }
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            // Dropping the sender closes the mailbox and ends the shard.
        })
    };

    // Ticks counted by the first report and by the latest one: the ticker
    // must keep running between them, while the requests keep coming.
    let mut events = Vec::new();
    let (mut first, mut latest) = (None, 0);
    wait_until("ticks of a shard kept saturated", || {
        for ticks in ticks_reported(&mut replies, &mut events) {
            first.get_or_insert(ticks);
            latest = ticks;
        }
        first.is_some_and(|f| latest >= f + 2)
    });
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    shard.join().unwrap();
}

/// A shard told to spin (`--spin-us`) on an empty mailbox takes requests as
/// they come and still runs its ticker: the spin yields to the shard's other
/// tasks. The spin here outlasts the test, so the shard never parks.
#[test]
fn a_spinning_shard_answers_and_ticks() {
    let (tx, mut replies, shard) = start_shard(Duration::from_secs(3600), |_| {});
    let mut events = Vec::new();
    let mut seen = Vec::new();
    let mut seq = 0;
    wait_until("a spinning shard's reports, its ticks advancing", || {
        seq += 1;
        assert!(tx.try_send(status(seq)).is_ok());
        std::thread::sleep(Duration::from_millis(20));
        seen.extend(ticks_reported(&mut replies, &mut events));
        seen.len() >= 2 && seen.last() >= Some(&(seen[0] + 2))
    });
    drop(tx);
    shard.join().unwrap();
}
