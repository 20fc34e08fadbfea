//! End to end: the s3 adapter behind the real binary when S3 misbehaves. A
//! fault-injecting proxy sits between kvshard and s3s-fs and cuts PUT and GET
//! bodies half way, stalls requests past `s3_request_timeout_secs`, or
//! answers `503 SlowDown` for a while; s3s-fs itself dies and comes back for
//! the circuit breaker. Through all of it the server keeps serving, what L1
//! holds retrieves byte-equal, a failed L2 load is a miss (never a hit with
//! wrong bytes), no partial object appears under a real name, and the
//! counters of `/metrics` say what happened.
//!
//! Also here: usage seeding by listing (oldest first, so eviction deletes the
//! oldest objects), and objects of a layout whose size is not a multiple of
//! the L1 alignment.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use support::*;

const BUCKET: &str = "faults";
const L2: &str = "s3#1";

/// A proxy in front of an s3s-fs that serves the bucket under the proxy's
/// port.
struct Rig {
    proxy: FaultProxy,
    s3: S3sFs,
}

impl Rig {
    /// Stores the first `n` chunks of `toks` through a server with
    /// `adapter`, waits until they are in the bucket, and starts a fresh
    /// server (empty L1) on the same adapter: (the bytes stored, it).
    fn stored_then_fresh_server(
        &self,
        adapter: &str,
        toks: &[u32],
        n: usize,
        seed: u64,
    ) -> (Vec<Vec<u8>>, Server) {
        let srv = Server::start(&["--l2-adapter", adapter]);
        let stored = ed_store_chunks(&srv, 1, toks, n, seed);
        wait_until("the objects in the bucket", || {
            self.objects().len() == n && srv.stores_settled()
        });
        drop(srv);
        (stored, Server::start(&["--l2-adapter", adapter]))
    }

    fn start() -> Rig {
        let proxy = FaultProxy::start();
        let s3 = S3sFs::start_with_domain(&[BUCKET], Some(proxy.port));
        proxy.set_upstream(s3.port);
        Rig { proxy, s3 }
    }

    /// The adapter spec through the proxy, over HTTP/1.1 (so faults can pick
    /// requests), plus `extra` fields.
    fn adapter(&self, extra: &str) -> String {
        self.s3
            .adapter(BUCKET, &format!(r#","s3_prefer_http2":false{extra}"#))
    }

    /// The objects of model "m" (the tests' own chunks; `assert_serving`
    /// stores under a model of its own).
    fn objects(&self) -> Vec<(String, u64)> {
        let mut v = self.s3.objects(BUCKET);
        v.retain(|(n, _)| n.starts_with("m@"));
        v
    }

    fn names(&self) -> BTreeSet<String> {
        self.objects().into_iter().map(|(n, _)| n).collect()
    }

    /// Every object in the bucket is whole, and each of model "m" holds the
    /// bytes of one of the chunks stored.
    fn assert_objects_are(&self, chunks: &[&Vec<Vec<u8>>]) {
        for (name, len) in self.s3.objects(BUCKET) {
            assert_eq!(len, ED_CHUNK_BYTES as u64, "{name} is not a whole chunk");
        }
        for (name, _) in self.objects() {
            let bytes = self.s3.object_bytes(BUCKET, &name);
            assert!(
                chunks.iter().any(|set| set.contains(&bytes)),
                "{name} holds bytes that were never stored"
            );
        }
    }
}

/// A counter of `/metrics` for the s3 adapter (0 when not exposed yet).
fn counter(srv: &Server, name: &str) -> f64 {
    srv.metric(name, &[("l2_name", L2)]).unwrap_or(0.0)
}

fn requests(srv: &Server, op: &str, outcome: &str) -> f64 {
    srv.metric(
        "kvshard_s3_requests_total",
        &[("l2_name", L2), ("op", op), ("outcome", outcome)],
    )
    .unwrap_or(0.0)
}

fn adapter_status(srv: &Server) -> serde_json::Value {
    srv.get_json("/status")["storage_manager"]["l2_adapters"][0].clone()
}

fn breaker_open(srv: &Server) -> bool {
    adapter_status(srv)["connection_disabled"] == true
}

/// Every object submitted to the store controller has been stored or has
/// failed, and no store batch is running.

#[test]
fn a_put_cut_mid_body_leaves_no_partial_object_and_l1_keeps_serving() {
    let rig = Rig::start();
    let adapter =
        rig.adapter(r#","s3_request_timeout_secs":2,"s3_breaker_initial_cooldown_s":0.5"#);
    let mut srv = Server::start(&["--l2-adapter", &adapter]);

    // One PUT cut half way: the retry stores the object whole.
    rig.proxy
        .set_times(Fault::CutPutBody(ED_CHUNK_BYTES / 2), 1);
    let first = ed_store_chunks(&srv, 1, &ed_tokens(31, 2 * ED_CHUNK), 2, 1);
    wait_until("2 objects stored despite one cut", || {
        rig.objects().len() == 2 && srv.stores_settled()
    });
    assert_eq!(rig.proxy.injected(), 1);
    rig.assert_objects_are(&[&first]);
    assert!(counter(&srv, "kvshard_s3_retries_total") >= 1.0);
    assert!(requests(&srv, "PutObject", "transient") >= 1.0);
    assert_eq!(counter(&srv, "kvshard_l2_store_failed_objects_total"), 0.0);

    // Every PUT cut: nothing is stored, and nothing partial shows.
    rig.proxy.set(Fault::CutPutBody(1000));
    let before = rig.names();
    let toks = ed_tokens(32, 3 * ED_CHUNK);
    let second = ed_store_chunks(&srv, 2, &toks, 3, 2);
    wait_until("the failed stores to settle", || srv.stores_settled());
    assert!(counter(&srv, "kvshard_l2_store_failed_objects_total") >= 3.0);
    assert_eq!(rig.names(), before, "a cut PUT left an object behind");
    rig.assert_objects_are(&[&first]);
    // L1 still holds them, byte for byte, and the server serves.
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "l1");
    assert_eq!(hits, 3);
    assert!(back == second, "L1 bytes changed under failed stores");
    assert_serving(&mut srv);

    // The endpoint recovers: stores succeed again once the breaker (tripped
    // by the cuts, which are connection failures) has re-armed.
    rig.proxy.set(Fault::None);
    wait_until("the breaker to close", || !breaker_open(&srv));
    let n = rig.objects().len();
    let third = ed_store_chunks(&srv, 3, &ed_tokens(33, 2 * ED_CHUNK), 2, 3);
    wait_until("new stores after the recovery", || {
        rig.objects().len() == n + 2 && srv.stores_settled()
    });
    rig.assert_objects_are(&[&first, &third]);
    // Healthy once the latest outcome of each operation is a success (a
    // store batch that failed in the outage may end after the first ones
    // that succeed).
    wait_until("the adapter to report healthy", || {
        adapter_status(&srv)["is_healthy"] == true
    });
}

#[test]
fn a_get_cut_mid_body_is_a_miss_or_a_retry_with_the_right_bytes() {
    let rig = Rig::start();
    let adapter =
        rig.adapter(r#","s3_request_timeout_secs":2,"s3_breaker_initial_cooldown_s":0.5"#);
    let toks = ed_tokens(41, 3 * ED_CHUNK);
    // A fresh server: the chunks are in S3 only.
    let (stored, mut srv) = rig.stored_then_fresh_server(&adapter, &toks, 3, 4);

    // One GET cut half way: the retry loads the right bytes.
    rig.proxy
        .set_times(Fault::CutGetBody(ED_CHUNK_BYTES / 2), 1);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "cut-once");
    assert_eq!(rig.proxy.injected(), 1);
    assert_eq!(hits, 3);
    assert!(back == stored, "a retried GET loaded wrong bytes");
    assert!(requests(&srv, "GetObject", "transient") >= 1.0);
    assert!(counter(&srv, "kvshard_s3_retries_total") >= 1.0);
    // Loaded objects are temporary: freed once retrieved.
    wait_until("loaded objects freed", || {
        srv.l1_count("total_object_count") == 0
    });

    // Every GET cut: the lookup finds them (HEAD answers), the loads fail,
    // and the chunks are misses, never hits with half-written bytes.
    rig.proxy.set(Fault::CutGetBody(1000));
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "cut");
    assert_eq!(hits, 0, "a failed load became a hit");
    assert!(back.is_empty());
    assert!(counter(&srv, "kvshard_l2_load_failed_objects_total") >= 1.0);
    assert!(srv.metric("lmcache_mp_l2_prefetch_failure_chunks_total", &[]) >= Some(1.0));
    assert_eq!(
        srv.l1_count("total_object_count"),
        0,
        "a failed load left an object in L1"
    );
    assert_serving(&mut srv);

    // Recovered: a later lookup hits with the right bytes.
    rig.proxy.set(Fault::None);
    let mut attempt = 0;
    wait_until("a hit with the right bytes after the recovery", || {
        attempt += 1;
        let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, &format!("again-{attempt}"));
        if hits > 0 {
            assert!(
                back == stored[..hits as usize],
                "wrong bytes after a recovery"
            );
        }
        hits == 3
    });
    rig.assert_objects_are(&[&stored]);
}

#[test]
fn a_stalled_server_costs_the_request_deadline_not_the_server() {
    let rig = Rig::start();
    let adapter =
        rig.adapter(r#","s3_request_timeout_secs":1,"s3_breaker_initial_cooldown_s":0.5"#);
    let toks = ed_tokens(51, 2 * ED_CHUNK);
    let (stored, mut srv) = rig.stored_then_fresh_server(&adapter, &toks, 2, 5);

    // GETs that are read and never answered: the lookup concludes at its L2
    // deadline (--l2-prefetch-load-timeout) with the chunks as misses, and
    // the loads go on until they time out at the request deadline.
    rig.proxy.set(Fault::StallRequests("GET"));
    let t0 = Instant::now();
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 2, "stalled");
    assert_eq!((hits, back.len()), (0, 0));
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    assert_eq!(
        srv.metric("kvshard_lookups_cut_at_deadline_total", &[]),
        Some(1.0)
    );
    wait_until("the stalled GETs to time out", || {
        counter(&srv, "kvshard_s3_timeouts_total") >= 1.0
            && requests(&srv, "GetObject", "transient") >= 1.0
            && counter(&srv, "kvshard_l2_load_failed_objects_total") >= 1.0
    });

    // A server that stalls whole connections (reads, never answers): the
    // stores fail at the deadline, L1 keeps what was stored in it.
    rig.proxy.set(Fault::Stall);
    let names = rig.names();
    let other = ed_tokens(52, 2 * ED_CHUNK);
    let in_l1 = ed_store_chunks(&srv, 3, &other, 2, 6);
    wait_until("the stalled stores to fail", || srv.stores_settled());
    assert!(counter(&srv, "kvshard_l2_store_failed_objects_total") >= 2.0);
    assert_eq!(rig.names(), names);
    let (hits, back) = ed_lookup_retrieve(&srv, 3, &other, 2, "l1");
    assert_eq!(hits, 2);
    assert!(back == in_l1);
    assert_serving(&mut srv);

    // Answering again: the chunks in S3 hit with their bytes.
    rig.proxy.set(Fault::None);
    let mut attempt = 0;
    wait_until("hits after the stall", || {
        attempt += 1;
        let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 2, &format!("after-{attempt}"));
        if hits > 0 {
            assert!(back == stored[..hits as usize]);
        }
        hits == 2
    });
}

#[test]
fn slow_down_is_retried_and_a_throttled_spell_costs_only_l2() {
    let rig = Rig::start();
    let adapter = rig.adapter(r#","s3_request_timeout_secs":2"#);
    let mut srv = Server::start(&["--l2-adapter", &adapter]);

    // Two throttled PUTs: the retries store every object.
    rig.proxy.set_times(Fault::SlowDown(Some("PUT")), 2);
    let toks = ed_tokens(61, 2 * ED_CHUNK);
    let first = ed_store_chunks(&srv, 1, &toks, 2, 7);
    wait_until("2 objects stored after throttling", || {
        rig.objects().len() == 2 && srv.stores_settled()
    });
    assert_eq!(rig.proxy.injected(), 2);
    rig.assert_objects_are(&[&first]);
    assert_eq!(counter(&srv, "kvshard_s3_throttled_total"), 2.0);
    assert_eq!(requests(&srv, "PutObject", "throttled"), 2.0);
    assert!(counter(&srv, "kvshard_s3_retries_total") >= 2.0);

    // Throttled for a while: stores fail, lookups of what L1 lacks miss,
    // L1 serves; a status error never trips the breaker.
    rig.proxy.set(Fault::SlowDown(None));
    let toks2 = ed_tokens(62, 2 * ED_CHUNK);
    let second = ed_store_chunks(&srv, 2, &toks2, 2, 8);
    wait_until("throttled stores to fail", || srv.stores_settled());
    assert!(counter(&srv, "kvshard_l2_store_failed_objects_total") >= 2.0);
    assert_eq!(rig.objects().len(), 2);
    let (hits, _) = ed_lookup_retrieve(&srv, 2, &ed_tokens(69, 2 * ED_CHUNK), 2, "unknown");
    assert_eq!(hits, 0);
    // A 503 to a HEAD carries no error code: a transient failure.
    assert!(requests(&srv, "HeadObject", "transient") >= 1.0);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks2, 2, "l1");
    assert_eq!(hits, 2);
    assert!(back == second);
    assert_serving(&mut srv);
    assert!(!breaker_open(&srv));
    assert_eq!(counter(&srv, "kvshard_s3_breaker_trips_total"), 0.0);
    assert!(counter(&srv, "kvshard_s3_throttled_total") > 2.0);

    // Recovered: stores go through again, and what was stored loads back.
    rig.proxy.set(Fault::None);
    let third = ed_store_chunks(&srv, 3, &ed_tokens(63, 2 * ED_CHUNK), 2, 9);
    wait_until("stores after the throttling", || {
        rig.objects().len() == 4 && srv.stores_settled()
    });
    rig.assert_objects_are(&[&first, &third]);
    drop(srv);
    let srv = Server::start(&["--l2-adapter", &adapter]);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 2, "from-s3");
    assert_eq!(hits, 2);
    assert!(back == first);
}

#[test]
fn the_breaker_opens_on_a_dead_endpoint_short_circuits_and_closes_after_its_cooldown() {
    let mut s3 = S3sFs::start(&["brk"]);
    // Default protocol (h2c), straight to s3s-fs.
    let adapter = s3.adapter(
        "brk",
        r#","s3_request_timeout_secs":1,"s3_breaker_initial_cooldown_s":2.5"#,
    );
    let in_s3 = ed_tokens(71, 4 * ED_CHUNK);
    let stored = {
        let srv = Server::start(&["--l2-adapter", &adapter]);
        let stored = ed_store_chunks(&srv, 1, &in_s3, 4, 10);
        wait_until("4 objects", || {
            s3.objects("brk").len() == 4 && srv.stores_settled()
        });
        stored
    };
    let mut srv = Server::start(&["--l2-adapter", &adapter]);
    let shards = adapter_status(&srv)["shards"].as_array().unwrap().len();

    // The endpoint dies: stores fail on refused connections until every
    // shard's breaker opens.
    s3.kill();
    let in_l1 = ed_tokens(72, 8 * ED_CHUNK);
    let kept = ed_store_chunks(&srv, 2, &in_l1, 8, 11);
    wait_until("every shard's breaker to open", || {
        adapter_status(&srv)["shards"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["adapter"]["client"]["breaker_open"] == true)
    });
    let st = adapter_status(&srv);
    assert_eq!(st["connection_disabled"], true, "{st}");
    assert_eq!(st["is_healthy"], false, "{st}");
    assert_eq!(
        counter(&srv, "kvshard_s3_breaker_open_shards"),
        shards as f64
    );
    assert!(counter(&srv, "kvshard_s3_breaker_trips_total") >= shards as f64);
    assert!(counter(&srv, "kvshard_s3_connect_failures_total") >= 3.0);

    // Back, but the breaker is still open: lookups short-circuit (nothing is
    // sent, so the objects that are there are misses for now).
    s3.restart();
    let refused = requests(&srv, "HeadObject", "unavailable");
    let connects = counter(&srv, "kvshard_s3_connect_failures_total");
    let (hits, _) = ed_lookup_retrieve(&srv, 3, &in_s3, 4, "open");
    assert!(breaker_open(&srv), "the cooldown ran out before the check");
    assert_eq!(hits, 0);
    assert!(requests(&srv, "HeadObject", "unavailable") > refused);
    assert_eq!(counter(&srv, "kvshard_s3_connect_failures_total"), connects);
    // L1 serves meanwhile.
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &in_l1, 8, "l1");
    assert_eq!(hits, 8);
    assert!(back == kept);
    assert_serving(&mut srv);

    // The cooldown passes: the breaker closes, loads and stores work again.
    wait_until("the breaker to close", || !breaker_open(&srv));
    let (hits, back) = ed_lookup_retrieve(&srv, 3, &in_s3, 4, "closed");
    assert_eq!(hits, 4);
    assert!(back == stored);
    let n = s3.objects("brk").len();
    let _ = ed_store_chunks(&srv, 4, &ed_tokens(73, 2 * ED_CHUNK), 2, 12);
    wait_until("stores after the breaker closed", || {
        s3.objects("brk").len() == n + 2
    });
    // Healthy once the latest outcome of each operation is a success (a
    // store batch that failed in the outage may end after the first ones
    // that succeed).
    wait_until("the adapter to report healthy", || {
        adapter_status(&srv)["is_healthy"] == true
    });
}

#[test]
fn seeded_usage_counts_the_bucket_and_eviction_deletes_the_oldest_first() {
    const N: usize = 6;
    let s3 = S3sFs::start(&["seed"]);
    let plain = s3.adapter("seed", "");
    {
        let srv = Server::start(&["--l2-adapter", &plain]);
        ed_store_chunks(&srv, 1, &ed_tokens(81, N * ED_CHUNK), N, 13);
        wait_until("6 objects", || {
            s3.objects("seed").len() == N && srv.stores_settled()
        });
    }
    // Ages opposite to the listing (name) order: the last name is the oldest.
    let names: Vec<String> = s3.objects("seed").into_iter().map(|(n, _)| n).collect();
    let base = SystemTime::now() - Duration::from_secs(3600);
    for (i, name) in names.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(s3.object_path("seed", name))
            .unwrap();
        f.set_modified(base + Duration::from_secs(60 * (N - i) as u64))
            .unwrap();
    }
    let bytes = (N * ED_CHUNK_BYTES) as u64;

    // Seeding on, no capacity: usage counts every object.
    {
        let seeded = s3.adapter("seed", r#","s3_seed_usage_on_start":true"#);
        let srv = Server::start(&["--cores", "0", "--l2-adapter", &seeded]);
        wait_until("usage seeded from the listing", || {
            let st = adapter_status(&srv);
            st["current_size_bytes"] == bytes && st["stored_object_count"] == N
        });
        assert_eq!(
            srv.metric("lmcache_mp_l2_usage_bytes", &[("l2_name", L2)]),
            Some(bytes as f64)
        );
    }
    assert_eq!(s3.objects("seed").len(), N);

    // Seeding on, capacity of exactly those objects, LRU at 80 %: the
    // seeded usage triggers eviction, which deletes the oldest half.
    let gb = bytes as f64 / (1u64 << 30) as f64;
    let evicting = s3.adapter(
        "seed",
        &format!(
            r#","s3_seed_usage_on_start":true,"max_capacity_gb":{gb},"eviction":{{"eviction_policy":"LRU","trigger_watermark":0.8,"eviction_ratio":0.5}}"#
        ),
    );
    let srv = Server::start(&["--cores", "0", "--l2-adapter", &evicting]);
    wait_until("eviction of half the seeded objects", || {
        s3.objects("seed").len() == N / 2
    });
    let left: Vec<String> = s3.objects("seed").into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        left,
        names[..N / 2],
        "eviction did not take the oldest first"
    );
    wait_until("usage after the eviction", || {
        adapter_status(&srv)["current_size_bytes"] == (N / 2 * ED_CHUNK_BYTES) as u64
    });
    assert!(srv.metric("lmcache_mp_l2_evicted_objects_chunks_total", &[]) >= Some((N / 2) as f64));
}

/// Hidden size of the odd layout: a chunk object of 2 x 2 layers x 16
/// tokens x 48 x 2 bytes = 6144 bytes, which is not a multiple of the
/// 4096-byte L1 alignment.
const ODD_HIDDEN: usize = 48;
const ODD_CHUNK_BYTES: usize = ed_chunk_bytes(ODD_HIDDEN);

#[test]
fn chunks_off_the_l1_alignment_are_stored_whole_and_only_whole() {
    let s3 = S3sFs::start(&["odd"]);
    let adapter = s3.adapter("odd", "");
    let toks = ed_tokens(91, 3 * ED_CHUNK);
    let stored = {
        let srv = Server::start(&["--l2-adapter", &adapter]);
        let stored = ed_store_chunks_of(&srv, 1, "odd", ODD_HIDDEN, &toks, 3, 14);
        wait_until("3 objects", || {
            s3.objects("odd").len() == 3 && srv.stores_settled()
        });
        // The object is the chunk, not the chunk plus the slab's padding.
        for (name, len) in s3.objects("odd") {
            assert_eq!(len, ODD_CHUNK_BYTES as u64, "{name}");
            assert!(stored.contains(&s3.object_bytes("odd", &name)), "{name}");
        }
        assert_eq!(
            counter(&srv, "kvshard_s3_unfull_rejected_objects_total"),
            0.0
        );
        assert_eq!(counter(&srv, "kvshard_l2_store_failed_objects_total"), 0.0);
        stored
    };
    // And they load back as hits (the size matches the layout on lookup).
    let srv = Server::start(&["--l2-adapter", &adapter]);
    let (hits, back) = ed_lookup_retrieve_of(&srv, 2, "odd", ODD_HIDDEN, &toks, 3, "odd-load");
    assert_eq!(hits, 3);
    assert!(back == stored);
    assert_eq!(
        srv.metric("kvshard_l2_size_mismatch_objects_total", &[]),
        Some(0.0)
    );
}
