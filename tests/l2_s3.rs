//! End to end: the s3 adapter behind the real binary, on a real S3 server on
//! loopback (s3s-fs, which checks every signature). Chunks are written behind
//! under lmcache 0.5.6's object names, outlive a restart with an empty L1, are
//! shared by two servers on one bucket, and a wrong secret or a dead endpoint
//! costs L2 hits, never the server or its L1.

mod support;

use support::*;

fn l2_stores_done(srv: &Server, n: f64) -> bool {
    srv.metric("lmcache_mp_l2_store_completed_objects_chunks_total", &[]) == Some(n)
}

#[test]
fn chunks_outlive_a_restart_under_0_5_6_names_and_load_back_from_s3() {
    let s3 = S3sFs::start(&["kvb"]);
    let adapter = s3.adapter("kvb", "");
    let toks = ed_tokens(21, 4 * ED_CHUNK + 5);
    let stored = {
        let srv = Server::start(&["--l2-adapter", &adapter]);
        let stored = ed_store_chunks(&srv, 1, &toks, 4, 3);
        wait_until("4 objects in the bucket", || s3.objects("kvb").len() == 4);
        wait_until("the store controller to count them", || {
            l2_stores_done(&srv, 4.0)
        });
        for (name, len) in s3.objects("kvb") {
            assert_eq!(len, ED_CHUNK_BYTES as u64, "{name}");
            assert!(
                name.starts_with("m@01000100@0@"),
                "0.5.6 object name: {name}"
            );
        }
        let st = srv.get_json("/status");
        let a = &st["storage_manager"]["l2_adapters"][0];
        assert_eq!(a["type"], "S3L2Adapter");
        assert_eq!(a["stored_object_count"], 4);
        // The secret never shows.
        let cfg = srv.http("GET", "/config/adapters", None).1;
        assert!(!cfg.contains(S3_SECRET_KEY), "{cfg}");
        assert!(!st.to_string().contains(S3_SECRET_KEY));
        stored
    };
    // A new process with an empty L1 finds every chunk in the bucket.
    let srv = Server::start(&["--l2-adapter", &adapter]);
    let (hits, back) = ed_lookup_retrieve(&srv, 1, &toks, 4, "warm");
    assert_eq!(hits, 4);
    assert!(
        back == stored,
        "bytes loaded from S3 differ from the stored ones"
    );
    assert_eq!(
        srv.metric("lmcache_mp_lookup_hit_l2_keys_total", &[]),
        Some(4.0)
    );
}

#[test]
fn two_servers_share_one_bucket() {
    let s3 = S3sFs::start(&["shared"]);
    let adapter = s3.adapter("shared", "");
    let a = Server::start(&["--l2-adapter", &adapter]);
    let b = Server::start(&["--l2-adapter", &adapter]);
    let toks = ed_tokens(22, 3 * ED_CHUNK);
    let stored = ed_store_chunks(&a, 1, &toks, 3, 5);
    wait_until("A's 3 objects in the bucket", || {
        s3.objects("shared").len() == 3
    });
    wait_until("A's stores to complete", || l2_stores_done(&a, 3.0));
    let (hits, back) = ed_lookup_retrieve(&b, 2, &toks, 3, "on-b");
    assert_eq!(
        hits, 3,
        "a chunk stored by one server is a hit on the other"
    );
    assert!(back == stored);
}

#[test]
fn a_wrong_secret_costs_l2_not_the_server() {
    let s3 = S3sFs::start(&["deny"]);
    let adapter = s3
        .adapter("deny", "")
        .replace(S3_SECRET_KEY, "not-the-secret");
    let srv = Server::start(&["--l2-adapter", &adapter]);
    let toks = ed_tokens(23, 2 * ED_CHUNK);
    let stored = ed_store_chunks(&srv, 1, &toks, 2, 9);
    wait_until("the store controller to finish", || {
        srv.metric("lmcache_mp_l2_store_completed_requests_total", &[]) >= Some(1.0)
    });
    assert!(s3.objects("deny").is_empty());
    let st = srv.get_json("/status");
    let shards = st["storage_manager"]["l2_adapters"][0]["shards"]
        .as_array()
        .unwrap()
        .clone();
    let denied: u64 = shards
        .iter()
        .map(|s| s["adapter"]["permission_errors"].as_u64().unwrap())
        .sum();
    assert!(denied >= 1, "{st}");
    // L1 keeps serving.
    let (hits, back) = ed_lookup_retrieve(&srv, 1, &toks, 2, "l1");
    assert_eq!(hits, 2);
    assert!(back == stored);
}

#[test]
fn a_dead_endpoint_costs_l2_hits_only() {
    let mut s3 = S3sFs::start(&["gone"]);
    let adapter = s3.adapter("gone", r#","s3_request_timeout_secs":2"#);
    let srv = Server::start(&["--l2-adapter", &adapter]);
    s3.kill();
    let toks = ed_tokens(24, 2 * ED_CHUNK);
    let stored = ed_store_chunks(&srv, 1, &toks, 2, 11);
    let other = ed_tokens(25, 2 * ED_CHUNK);
    // A lookup of chunks that L1 lacks answers (a miss) instead of hanging.
    let (hits, _) = ed_lookup_retrieve(&srv, 1, &other, 2, "miss");
    assert_eq!(hits, 0);
    let (hits, back) = ed_lookup_retrieve(&srv, 1, &toks, 2, "l1");
    assert_eq!(hits, 2);
    assert!(back == stored);
}
