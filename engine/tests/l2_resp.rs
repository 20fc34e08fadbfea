//! The resp and valkey adapters against real `redis-server` processes, in
//! what the conformance suite does not do: values that change or vanish
//! between a lookup and its load, and a cluster whose slots move, whose
//! master fails over while loads and stores run, and whose master dies. Through all of it a load
//! is the stored bytes or a miss, never other bytes, and the connections
//! stay in step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_engine::keys::{Name, ObjectKey};
use kvshard_engine::l2::config::{RespConfig, RespFlavor};
use kvshard_engine::l2::naming::s3_object_name;
use kvshard_engine::l2::resp::RespAdapter;
use kvshard_engine::l2::{L2Adapter, ObjectBytes, StoreResult};

mod common;
use common::{payload, run};

#[path = "../../tests/support/redis.rs"]
#[allow(dead_code)]
mod redis;

const OBJ: usize = 8192;

fn key(i: u32) -> ObjectKey {
    let mut chunk_hash = [0u8; 32];
    chunk_hash[..4].copy_from_slice(&i.to_le_bytes());
    chunk_hash[4..8].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
    ObjectKey {
        chunk_hash,
        model_name: Name::intern("org/m").unwrap(),
        kv_rank: 0x0001_0000,
        object_group_id: 0,
        cache_salt: Name::intern("").unwrap(),
    }
}

fn config(ports: &[u16], cluster_mode: bool, prefix: &str) -> RespConfig {
    RespConfig {
        flavor: RespFlavor::Valkey,
        nodes: ports.iter().map(|p| ("127.0.0.1".to_owned(), *p)).collect(),
        cluster_mode,
        username: None,
        password: None,
        key_prefix: prefix.to_owned(),
        num_workers: 2,
        tls_enable: false,
        tls_ca_bundle: None,
        database_id: None,
        request_timeout_secs: 5.0,
        connection_timeout_secs: 5.0,
        max_capacity_gb: 0.0,
        ttl_seconds: None,
        breaker_initial_cooldown_s: 0.5,
        breaker_max_cooldown_s: 1.0,
    }
}

async fn store_all(a: &RespAdapter, items: &[(ObjectKey, Vec<u8>)]) -> Vec<StoreResult> {
    let mut bufs: Vec<Vec<u8>> = items.iter().map(|(_, b)| b.clone()).collect();
    // SAFETY: `bufs` outlives the awaited store and nothing else touches it.
    let views: Vec<(ObjectKey, ObjectBytes)> = items
        .iter()
        .zip(bufs.iter_mut())
        .map(|((k, _), b)| (*k, unsafe { ObjectBytes::from_mut_slice(b) }))
        .collect();
    a.store(&views).await
}

/// [`store_all`], every item stored.
async fn store_every(a: &RespAdapter, items: &[(ObjectKey, Vec<u8>)]) {
    let res = store_all(a, items).await;
    assert!(
        res.iter().all(|r| matches!(r, StoreResult::Stored(_))),
        "{res:?}"
    );
}

/// Loads every key into a buffer of `len` bytes: (loaded, bytes).
async fn load_all(a: &RespAdapter, keys: &[ObjectKey], len: usize) -> Vec<(bool, Vec<u8>)> {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    // SAFETY: as in `store_all`.
    let views: Vec<(ObjectKey, ObjectBytes)> = keys
        .iter()
        .zip(bufs.iter_mut())
        .map(|(k, b)| (*k, unsafe { ObjectBytes::from_mut_slice(b) }))
        .collect();
    let ok = a.load(&views).await;
    ok.into_iter().zip(bufs).collect()
}

#[test]
fn a_value_deleted_or_resized_after_its_lookup_is_a_miss_and_the_connection_stays_in_step() {
    let server = redis::RedisServer::start(&[]);
    // One connection: every request below shares it.
    let mut cfg = config(&[server.port], false, "");
    cfg.num_workers = 1;
    let a = RespAdapter::new(&cfg, 0, 1).unwrap();
    let items: Vec<(ObjectKey, Vec<u8>)> = (0..4)
        .map(|i| (key(i), payload(100 + i as u64, OBJ)))
        .collect();
    let keys: Vec<ObjectKey> = items.iter().map(|(k, _)| *k).collect();
    run(async {
        store_every(&a, &items).await;
        let found = a.lookup_and_lock(&keys).await;
        assert!(found.iter().all(|f| *f == Some(OBJ as u64)), "{found:?}");
        // Between the lookup and the load: one value deleted, one replaced
        // by a shorter one, one by a longer one.
        let name = |k: &ObjectKey| s3_object_name(k);
        assert_eq!(server.command(&["DEL", &name(&keys[1])]), "1");
        assert_eq!(server.command(&["SET", &name(&keys[2]), "short"]), "OK");
        let long = "y".repeat(OBJ + 100);
        assert_eq!(server.command(&["SET", &name(&keys[3]), &long]), "OK");
        let got = load_all(&a, &keys, OBJ).await;
        assert!(got[0].0 && got[0].1 == items[0].1, "the untouched value");
        assert!(!got[1].0, "a deleted value is a miss");
        assert!(!got[2].0, "a shorter value is a miss");
        assert!(!got[3].0, "a longer value is a miss");
        a.unlock(&keys);
        // The next requests on the same connection read their own replies.
        for _ in 0..3 {
            let again = load_all(&a, &keys[..1], OBJ).await;
            assert!(again[0].0 && again[0].1 == items[0].1);
            // Sizes it no longer knows it asks the server for (STRLEN).
            assert_eq!(
                a.lookup_and_lock(&keys).await,
                [Some(OBJ as u64), None, Some(5), Some(OBJ as u64 + 100)]
            );
            a.unlock(&keys);
        }
        let st = a.status();
        assert_eq!(st["load_missing"], 1, "{st}");
        assert_eq!(st["load_wrong_size"], 2, "{st}");
        assert_eq!(
            st["client"]["connects"], 1,
            "one connection throughout: {st}"
        );
    });
}

#[test]
fn large_loads_past_one_per_connection_wait_their_turn_within_the_deadline() {
    // Values of at least `LARGE_REPLY_BYTES` are asked for one per
    // connection at a time; the rest wait for a turn.
    let big = kvshard_resp::client::LARGE_REPLY_BYTES + 4096;
    let server = redis::RedisServer::start(&[]);
    let mut cfg = config(&[server.port], false, "");
    cfg.num_workers = 2;
    cfg.request_timeout_secs = 1.0;
    let a = RespAdapter::new(&cfg, 0, 1).unwrap();
    let items: Vec<(ObjectKey, Vec<u8>)> = (0..9)
        .map(|i| (key(500 + i), payload(500 + i as u64, big)))
        .collect();
    let keys: Vec<ObjectKey> = items.iter().map(|(k, _)| *k).collect();
    run(async {
        store_every(&a, &items).await;
        // A deleted and a resized value among them: misses, in step.
        let name = |k: &ObjectKey| s3_object_name(k);
        assert_eq!(server.command(&["DEL", &name(&keys[3])]), "1");
        assert_eq!(server.command(&["SET", &name(&keys[6]), "short"]), "OK");
        for _ in 0..2 {
            let got = load_all(&a, &keys, big).await;
            for (i, (ok, bytes)) in got.iter().enumerate() {
                if i == 3 || i == 6 {
                    assert!(!ok, "value {i} is a miss");
                } else {
                    assert!(*ok && *bytes == items[i].1, "value {i}: the stored bytes");
                }
            }
        }
        // Stopped: the queued loads fail too, within one deadline of the
        // batch's start and not one deadline after another.
        server.signal(libc::SIGSTOP);
        let t = Instant::now();
        let got = load_all(&a, &keys, big).await;
        let took = t.elapsed();
        server.signal(libc::SIGCONT);
        assert!(
            got.iter().all(|(ok, _)| !ok),
            "a stopped server serves nothing"
        );
        eprintln!("9 loads on 2 connections of a stopped server: {took:?}");
        assert!(
            took < Duration::from_millis(1800),
            "9 loads on 2 connections took {took:?}"
        );
        let st = a.status();
        assert!(st["client"]["timeouts"].as_u64().unwrap() >= 1, "{st}");
    });
}

/// Node ids of a cluster's nodes by port.
fn node_id(port: u16) -> String {
    redis::redis_command(port, &["CLUSTER", "MYID"])
}

fn redis_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(redis::redis_bin_dir().join("redis-cli"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("redis-cli")
}

/// Loads every key again and again until `done`, asserting each load is a
/// miss or the stored bytes: (rounds, loads that missed).
async fn load_while(
    a: &RespAdapter,
    items: &[(ObjectKey, Vec<u8>)],
    done: &AtomicBool,
) -> (u32, usize) {
    let keys: Vec<ObjectKey> = items.iter().map(|(k, _)| *k).collect();
    let (mut rounds, mut missed) = (0, 0);
    while !done.load(Ordering::Acquire) || rounds == 0 {
        for ((ok, bytes), (k, want)) in load_all(a, &keys, OBJ).await.iter().zip(items) {
            if *ok {
                assert!(bytes == want, "{k:?}: a load returned other bytes");
            } else {
                missed += 1;
            }
        }
        rounds += 1;
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
    (rounds, missed)
}

/// Runs `job` on a thread while loads go on: (rounds, missed loads).
async fn loads_during(
    a: &RespAdapter,
    items: &[(ObjectKey, Vec<u8>)],
    job: impl FnOnce() + Send + 'static,
) -> (u32, usize) {
    let done = Arc::new(AtomicBool::new(false));
    let worker = {
        let done = done.clone();
        std::thread::spawn(move || {
            job();
            done.store(true, Ordering::Release);
        })
    };
    let r = load_while(a, items, &done).await;
    worker.join().expect("the job panicked");
    r
}

#[test]
fn a_cluster_resharded_failed_over_and_losing_a_master_keeps_every_chunk() {
    let mut cluster = redis::RedisCluster::start(3, 1);
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let a = RespAdapter::new(&config(&ports, true, "rs"), 0, 1).unwrap();
    let items: Vec<(ObjectKey, Vec<u8>)> = (0..300)
        .map(|i| (key(i), payload(1000 + i as u64, OBJ)))
        .collect();
    // One executor throughout: the adapter's connections live on it.
    run(async {
        store_every(&a, &items).await;

        // Reshard: the master of the first key gives 1000 of its slots (the
        // first key's among them, as reshard moves a master's lowest slots
        // first) to another master while the loads run.
        let first = format!("rs@{}", s3_object_name(&items[0].0));
        let from = cluster.master_of(&first).port;
        let to = *ports
            .iter()
            .find(|p| **p != from && redis::redis_command(**p, &["ROLE"]).starts_with("master"))
            .unwrap();
        let (from_id, to_id) = (node_id(from), node_id(to));
        let seed = format!("127.0.0.1:{from}");
        let (rounds, missed) = loads_during(&a, &items, move || {
            let out = redis_cli(&[
                "--cluster",
                "reshard",
                &seed,
                "--cluster-from",
                &from_id,
                "--cluster-to",
                &to_id,
                "--cluster-slots",
                "1000",
                "--cluster-yes",
            ]);
            assert!(
                out.status.success(),
                "reshard: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        })
        .await;
        assert_eq!(
            missed, 0,
            "a load missed during the reshard ({rounds} rounds)"
        );
        let st = a.status();
        assert!(
            st["client"]["cluster"]["moved"].as_u64() > Some(0),
            "no MOVED was followed: {st}"
        );
        cluster.wait_ok();

        // Fail over: the replica of the first key's master (now `to`) takes
        // over; the old master becomes its replica.
        let master = cluster.master_of(&first).port;
        let master_id = node_id(master);
        let replica = *ports
            .iter()
            .find(|p| {
                redis::redis_command(**p, &["CLUSTER", "NODES"])
                    .lines()
                    .any(|l| l.contains("myself") && l.contains(&format!("slave {master_id}")))
            })
            .expect("a replica of the master");
        let (_, missed) = loads_during(&a, &items, move || {
            // A manual failover gives up quietly when the replica does not
            // catch up within 5 s (a busy machine): ask again, as an
            // operator would.
            let t0 = Instant::now();
            let mut asked: Option<Instant> = None;
            while !redis::redis_command(replica, &["ROLE"]).starts_with("master") {
                if asked.is_none_or(|at| at.elapsed() > Duration::from_secs(8)) {
                    assert_eq!(
                        redis::redis_command(replica, &["CLUSTER", "FAILOVER"]),
                        "OK"
                    );
                    asked = Some(Instant::now());
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(45),
                    "the failover did not end"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            // Some loads after the switch.
            std::thread::sleep(Duration::from_millis(500));
        })
        .await;
        cluster.wait_ok();
        // Every acknowledged chunk is there and loads, byte for byte.
        let keys: Vec<ObjectKey> = items.iter().map(|(k, _)| *k).collect();
        {
            for ((ok, bytes), (k, want)) in load_all(&a, &keys, OBJ).await.iter().zip(&items) {
                assert!(*ok && bytes == want, "{k:?} after the failover");
            }
            // Stores go to the new master.
            let more: Vec<(ObjectKey, Vec<u8>)> = (300..340)
                .map(|i| (key(i), payload(1000 + i as u64, OBJ)))
                .collect();
            store_every(&a, &more).await;
            let more_keys: Vec<ObjectKey> = more.iter().map(|(k, _)| *k).collect();
            for ((ok, bytes), (_, want)) in load_all(&a, &more_keys, OBJ).await.iter().zip(&more) {
                assert!(*ok && bytes == want);
            }
        }
        eprintln!("failover: {missed} loads missed while the replica took over");

        // The new master dies: the cluster promotes its replica (the old
        // master) by itself, and the client finds it without being told.
        let dead = cluster
            .nodes
            .iter()
            .position(|n| n.port == replica)
            .unwrap();
        cluster.nodes[dead].kill();
        let all: Vec<(ObjectKey, Vec<u8>)> = (0..340)
            .map(|i| (key(i), payload(1000 + i as u64, OBJ)))
            .collect();
        let all_keys: Vec<ObjectKey> = all.iter().map(|(k, _)| *k).collect();
        let t0 = Instant::now();
        loop {
            let got = load_all(&a, &all_keys, OBJ).await;
            let mut missing = 0;
            for ((ok, bytes), (k, want)) in got.iter().zip(&all) {
                if *ok {
                    assert!(bytes == want, "{k:?}: other bytes after the master died");
                } else {
                    missing += 1;
                }
            }
            if missing == 0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(40),
                "{missing} chunks still missing {:?} after their master died",
                t0.elapsed()
            );
            glommio::timer::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            redis::redis_command(master, &["ROLE"]).starts_with("master"),
            "the replica was not promoted"
        );
        eprintln!(
            "a killed master: every chunk loads again {:?} later",
            t0.elapsed()
        );
    });
}
