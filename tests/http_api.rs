//! End to end: the HTTP API of the real binary as a user (and `lmcache describe
//! kvcache`, `lmcache quota`, `lmcache kvcache clear`) sees it, including
//! IsolatedLRU quotas enforced on data stored over the ZeroMQ wire.

mod support;
use support::*;

use serde_json::{json, Value};
use std::time::{Duration, Instant};

const GIB: f64 = (1u64 << 30) as f64;

fn post(srv: &Server, path: &str, body: Option<&str>) -> (u16, Value) {
    let (st, text) = srv.http("POST", path, body);
    (
        st,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn put(srv: &Server, path: &str, body: &str) -> (u16, Value) {
    let (st, text) = srv.http("PUT", path, Some(body));
    (
        st,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn delete(srv: &Server, path: &str) -> (u16, Value) {
    let (st, text) = srv.http("DELETE", path, None);
    (
        st,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn counter(srv: &Server, name: &str) -> f64 {
    srv.metric(name, &[])
        .unwrap_or_else(|| panic!("{name} not exposed"))
}

/// Registers engine_driven worker `iid` of model "m" and maps its pool.
fn worker(c: &mut Client, iid: i64) -> ShmMap {
    let (name, size) = ed_register(c, iid, "m");
    ShmMap::open(&name, size)
}

#[test]
fn root_and_healthcheck_bodies() {
    let srv = Server::start(&[]);
    assert_eq!(
        srv.http("GET", "/", None),
        (
            200,
            r#"{"status":"ok","service":"LMCache HTTP API"}"#.to_string()
        )
    );
    assert_eq!(
        srv.http("GET", "/healthcheck", None),
        (200, r#"{"status":"healthy"}"#.to_string())
    );
}

/// Reads `/status` the way `lmcache describe kvcache` (0.5.6,
/// `cli/commands/describe.py`) does, failing where it would crash or show N/A.
fn describe_kvcache(st: &Value) {
    assert_eq!(st["is_healthy"], json!(true));
    assert_eq!(st["engine_type"], json!("MPCacheServer"));
    assert_eq!(st["chunk_size"], json!(ED_CHUNK));
    assert!(st["active_sessions"].is_u64(), "active_sessions: {st}");
    let l1 = &st["storage_manager"]["l1_manager"];
    for k in [
        "memory_total_bytes",
        "memory_used_bytes",
        "total_object_count",
    ] {
        assert!(l1[k].is_u64(), "storage_manager.l1_manager.{k}: {l1}");
    }
    assert!(
        l1["memory_usage_ratio"].is_f64(),
        "storage_manager.l1_manager.memory_usage_ratio: {l1}"
    );
    assert!(st["storage_manager"]["l2_adapters"].is_array());
    // add_models: per GPU context, model_name / world_size and a layout dict.
    let meta = st["cache_context_meta"]
        .as_object()
        .expect("cache_context_meta is a dict");
    for (id, m) in meta {
        assert!(id.parse::<i64>().is_ok(), "instance id key {id}");
        assert!(m["model_name"].is_string(), "{m}");
        assert!(m["world_size"].is_u64(), "{m}");
        let layout = &m["kv_cache_layout"];
        if !layout.is_null() {
            let layout = layout
                .as_object()
                .unwrap_or_else(|| panic!("kv_cache_layout must be a dict: {m}"));
            let groups = layout
                .get("kernel_groups")
                .map_or(&[][..], |g| g.as_array().expect("kernel_groups is a list"));
            for g in groups {
                assert!(g.is_object(), "kernel group {g}");
            }
        }
    }
}

#[test]
fn status_has_what_describe_kvcache_reads_and_reflects_state() {
    let srv = Server::start(&[]);
    let st = srv.get_json("/status");
    describe_kvcache(&st);
    let l1 = &st["storage_manager"]["l1_manager"];
    assert_eq!(l1["total_object_count"], 0);
    assert_eq!(l1["memory_used_bytes"], 0);
    assert_eq!(st["registered_non_cuda_instance_ids"], json!([]));
    assert_eq!(st["registered_gpu_ids"], json!([]));
    assert_eq!(
        st["storage_manager"]["l1_eviction_controller"]["eviction_policy"],
        json!("LRU"),
        "the policy as the flag spells it, as 0.5.6 reports it"
    );

    let mut c = srv.client();
    let mut pool = worker(&mut c, 1000);
    let toks = ed_tokens(1, 5 * ED_CHUNK);
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 5, "s"),
        1000,
        1,
    );
    assert_eq!(stored.len(), 5);
    // An lmcache_driven (cpu_shm) worker too, for cache_context_meta.
    let (_layer, desc) = lm_layer("kvt_http_layer");
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(20, desc)),
        None
    );

    let st = srv.get_json("/status");
    describe_kvcache(&st);
    let l1 = &st["storage_manager"]["l1_manager"];
    assert_eq!(l1["total_object_count"], 5, "{l1}");
    let used = l1["memory_used_bytes"].as_u64().unwrap();
    let total = l1["memory_total_bytes"].as_u64().unwrap();
    assert!(used >= 5 * ED_CHUNK_BYTES as u64, "{l1}");
    assert!(total >= used);
    let ratio = l1["memory_usage_ratio"].as_f64().unwrap();
    assert!((ratio - used as f64 / total as f64).abs() < 1e-9, "{l1}");
    // 0.5.6's shapes: L1 use as (used, total) bytes, capacity by backend type,
    // the one L1 also under its default tag.
    let sm = &st["storage_manager"];
    assert_eq!(sm["l1_usage"], json!([used, total]));
    assert_eq!(
        sm["l1_capacity_bytes_by_backend"],
        json!({"dram": 64 << 20})
    );
    assert_eq!(l1["capacity_bytes_by_backend"], json!({"dram": 64 << 20}));
    assert_eq!(&sm["l1_managers"]["_default"], l1);
    assert_eq!(l1["write_ttl_seconds"], json!(600));
    assert_eq!(
        st["worker_liveness"],
        json!({"enabled": true, "reap_timeout_seconds": 120.0,
               "registration_grace_seconds": 3600.0, "tracked_instances": 2})
    );
    assert_eq!(st["registered_non_cuda_instance_ids"], json!([1000]));
    assert_eq!(
        st["non_cuda_context_meta"]["1000"]["model_name"],
        json!("m")
    );
    assert_eq!(st["registered_gpu_ids"], json!([20]));
    let meta = &st["cache_context_meta"]["20"];
    assert_eq!(meta["model_name"], json!("lm"));
    assert_eq!(meta["world_size"], json!(1));
    let layout = &meta["kv_cache_layout"];
    assert_eq!(layout["num_layers"], json!(1), "{meta}");
    assert_eq!(layout["num_blocks"], json!(8), "{meta}");
    let group = &layout["kernel_groups"][0];
    assert_eq!(group["tokens_per_block"], json!(16), "{meta}");
    assert_eq!(group["engine_kv_shape"], json!("NL x [2, NB, BS, NH, HS]"));
    assert_eq!(
        group["engine_kv_concrete_shape"],
        json!("1 x [2, 8, 16, 2, 32]")
    );
    assert_eq!(
        group["attention_backend"],
        json!("vLLM non-MLA flash attention")
    );
    assert!(st["active_sessions"].as_u64().unwrap() >= 1);
    assert!(st["worker_liveness_by_instance"]["1000"].is_object());

    // Locks show up while a lookup holds them.
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 5, "s")), 5);
    let st = srv.get_json("/status");
    assert_eq!(st["storage_manager"]["l1_manager"]["read_locked_count"], 5);
    ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 5, "s"), 1000);
    let st = srv.get_json("/status");
    assert_eq!(st["storage_manager"]["l1_manager"]["read_locked_count"], 0);
}

#[test]
fn metrics_count_lookups_and_stores() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(2, 5 * ED_CHUNK + 7);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 5, "cold")), 0);
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 5, "cold"),
        1,
        2,
    );
    assert_eq!(stored.len(), 5);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 5, "warm")), 5);
    // A prefix of 2 chunks, then something else.
    let mut other = toks[..2 * ED_CHUNK].to_vec();
    other.extend(ed_tokens(3, 3 * ED_CHUNK));
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &other, 5, "part")), 2);

    let (st, text) = srv.http("GET", "/metrics", None);
    assert_eq!(st, 200);
    let samples = parse_prometheus(&text);
    assert!(!samples.is_empty());
    // Each family is declared once, before its samples.
    for x in &samples {
        let t = format!("# TYPE {} ", x.name);
        let pos = text
            .find(&t)
            .unwrap_or_else(|| panic!("{} has no TYPE", x.name));
        assert_eq!(text.matches(&t).count(), 1, "{} declared once", x.name);
        let first = text
            .lines()
            .position(|l| l.starts_with(&x.name) && !l.starts_with('#'))
            .unwrap();
        let type_line = text[..pos].lines().count();
        assert!(type_line <= first, "{}: TYPE after a sample", x.name);
    }
    let get = |name: &str| {
        samples
            .iter()
            .find(|x| x.name == name && x.labels.is_empty())
            .unwrap_or_else(|| panic!("{name} missing"))
            .value
    };
    let cs = ED_CHUNK as f64;
    assert_eq!(get("lmcache_mp_lookup_requested_tokens_total"), 15.0 * cs);
    assert_eq!(get("lmcache_mp_lookup_hit_tokens_total"), 7.0 * cs);
    assert_eq!(get("lmcache_mp_lookups_requests_total"), 3.0);
    assert_eq!(get("lmcache_mp_l1_write_chunks_total"), 5.0);
    // The objects, and the memory lent as write credits.
    assert_eq!(
        get("lmcache_mp_l1_memory_usage_bytes"),
        5.0 * ED_CHUNK_BYTES as f64 + get("kvshard_l1_write_credit_bytes")
    );
    assert!(get("kvshard_l1_write_credit_bytes") > 0.0);
    assert!(get("kvshard_requests_total") >= 10.0);
}

#[test]
fn metrics_reset_zeroes_counters_but_keeps_data() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(4, 3 * ED_CHUNK);
    ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 3, "a"),
        1,
        4,
    );
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "a")), 3);
    ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 3, "a"), 1);
    assert!(counter(&srv, "lmcache_mp_lookup_hit_tokens_total") > 0.0);

    assert_eq!(
        srv.http("POST", "/metrics/reset", None),
        (200, "ok".to_string())
    );
    for name in [
        "lmcache_mp_lookup_requested_tokens_total",
        "lmcache_mp_lookup_hit_tokens_total",
        "lmcache_mp_lookups_requests_total",
        "lmcache_mp_l1_write_chunks_total",
        "lmcache_mp_l1_read_chunks_total",
        "lmcache_mp_num_submitted_stores_total",
        "kvshard_requests_total",
    ] {
        assert_eq!(counter(&srv, name), 0.0, "{name} after reset");
    }
    // Gauges describe state, which a reset does not touch.
    assert_eq!(
        counter(&srv, "lmcache_mp_l1_memory_usage_bytes"),
        3.0 * ED_CHUNK_BYTES as f64 + counter(&srv, "kvshard_l1_write_credit_bytes")
    );
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "b")), 3);
    assert_eq!(
        counter(&srv, "lmcache_mp_lookup_hit_tokens_total"),
        3.0 * ED_CHUNK as f64
    );
    assert_eq!(srv.http("GET", "/metrics/reset", None).0, 405);
}

#[test]
fn cache_clear_empties_l1_and_refuses_other_tiers() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(5, 3 * ED_CHUNK);
    ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 3, "a"),
        1,
        5,
    );
    for (body, code) in [
        (r#"{"tier":"l2"}"#, 400),
        (r#"{"tier":"all"}"#, 400),
        (r#"{"tier":"l3"}"#, 422),
        (r#"{"force":"maybe"}"#, 422),
        ("[1]", 422),
        ("{not json", 422),
    ] {
        let (st, v) = post(&srv, "/cache/clear", Some(body));
        assert_eq!(st, code, "{body}: {v}");
    }
    assert_eq!(srv.http("GET", "/cache/clear", None).0, 405);
    assert_eq!(
        ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "b")),
        3,
        "refused clears clear nothing"
    );
    ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 3, "b"), 1);

    let (st, v) = post(&srv, "/cache/clear", Some(r#"{"tier":"l1"}"#));
    assert_eq!(
        (st, v),
        (200, json!({"status": "ok", "cleared": {"tier": "l1"}}))
    );
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "c")), 0);
    let st = srv.get_json("/status");
    assert_eq!(st["storage_manager"]["l1_manager"]["total_object_count"], 0);
    // No body at all means the defaults (tier l1).
    ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 3, "d"),
        1,
        6,
    );
    assert_eq!(post(&srv, "/cache/clear", None).0, 200);
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "e")), 0);
}

#[test]
fn quota_put_get_delete_list() {
    let srv = Server::start(&[]);
    assert_eq!(srv.get_json("/quota"), json!({"users": {}}));
    assert_eq!(
        put(&srv, "/quota/tenant", r#"{"limit_gb": 1.5}"#),
        (
            200,
            json!({"cache_salt": "tenant", "limit_gb": 1.5, "status": "ok"})
        )
    );
    assert_eq!(
        srv.get_json("/quota/tenant"),
        json!({"cache_salt": "tenant", "limit_gb": 1.5, "current_usage_gb": 0.0, "exists": true})
    );
    // The anonymous salt "" is spelled `_default` in paths and answers.
    assert_eq!(
        put(&srv, "/quota/_default", r#"{"limit_gb": "2"}"#),
        (
            200,
            json!({"cache_salt": "_default", "limit_gb": 2.0, "status": "ok"})
        )
    );
    assert_eq!(srv.get_json("/quota/_default")["exists"], json!(true));
    let users = srv.get_json("/quota")["users"].clone();
    assert_eq!(users["tenant"]["limit_gb"], json!(1.5));
    assert_eq!(users["_default"]["limit_gb"], json!(2.0));
    assert_eq!(users.as_object().unwrap().len(), 2);
    // A limit is kept in whole bytes, as 0.5.6 keeps it, and read back from them.
    assert_eq!(
        put(&srv, "/quota/tenth", r#"{"limit_gb": 0.1}"#).1["limit_gb"],
        json!(0.1)
    );
    // int(0.1 * 2**30) bytes is 0.09999999962747097 GiB (compared as text:
    // serde_json's own float parsing may be one ulp off).
    let (st, text) = srv.http("GET", "/quota/tenth", None);
    assert_eq!(st, 200);
    assert!(text.contains(r#""limit_gb":0.09999999962747097"#), "{text}");
    assert_eq!(delete(&srv, "/quota/tenth").0, 200);

    // Bad bodies: 400, and the quota is unchanged.
    for body in [
        "not json",
        "{}",
        "[1.0]",
        r#"{"limit": 1}"#,
        r#"{"limit_gb": "lots"}"#,
        r#"{"limit_gb": null}"#,
        r#"{"limit_gb": -1}"#,
        r#"{"limit_gb": NaN}"#,
        r#"{"limit_gb": Infinity}"#,
        r#"{"limit_gb": "1e999"}"#,
    ] {
        let (st, v) = put(&srv, "/quota/tenant", body);
        assert_eq!(st, 400, "{body}: {v}");
        assert!(v["error"].is_string(), "{body}: {v}");
    }
    assert_eq!(srv.get_json("/quota/tenant")["limit_gb"], json!(1.5));

    // Usage follows what is stored under the salt.
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(6, 2 * ED_CHUNK);
    let key = with_field(
        &ed_key("m", Some(0), &toks, 2, "q"),
        "cache_salt",
        s("tenant"),
    );
    assert_eq!(ed_store(&mut c, &mut pool, &key, 1, 6).len(), 2);
    let usage = srv.get_json("/quota/tenant")["current_usage_gb"]
        .as_f64()
        .unwrap();
    assert_eq!(usage, (2 * ED_CHUNK_BYTES) as f64 / GIB);
    assert_eq!(
        srv.get_json("/quota/_default")["current_usage_gb"],
        json!(0.0)
    );

    assert_eq!(
        delete(&srv, "/quota/tenant"),
        (200, json!({"cache_salt": "tenant", "status": "removed"}))
    );
    assert_eq!(
        delete(&srv, "/quota/tenant"),
        (200, json!({"cache_salt": "tenant", "status": "not_found"}))
    );
    assert_eq!(srv.get_json("/quota/tenant")["exists"], json!(false));
    assert_eq!(
        delete(&srv, "/quota/_default"),
        (200, json!({"cache_salt": "_default", "status": "removed"}))
    );
    assert_eq!(srv.get_json("/quota"), json!({"users": {}}));
    assert_eq!(srv.http("POST", "/quota/tenant", Some("{}")).0, 405);
}

#[test]
fn checksums_for_an_unknown_instance_is_404() {
    let srv = Server::start(&[]);
    let (st, v) = post(
        &srv,
        "/cache/checksums",
        Some(r#"{"block_ids":[1,2],"chunk_size":1,"instance_id":4242}"#),
    );
    assert_eq!(st, 404, "{v}");
    assert!(v["detail"].as_str().unwrap().contains("4242"), "{v}");
    // instance_id defaults to 0, which nobody registered either.
    assert_eq!(
        post(
            &srv,
            "/cache/checksums",
            Some(r#"{"block_ids":[1],"chunk_size":1}"#)
        )
        .0,
        404
    );
    // The instance is looked up before the request is checked, as 0.5.6 does.
    assert_eq!(
        post(
            &srv,
            "/cache/checksums",
            Some(r#"{"block_ids":[],"chunk_size":1}"#)
        )
        .0,
        404
    );
    assert_eq!(post(&srv, "/cache/checksums", None).0, 422);
}

#[test]
fn checksums_refuse_as_lmcache_does() {
    let srv = Server::start(&[]);
    let mut c = srv.client();
    let (_layer, desc) = lm_layer("kvt_sums");
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(7, desc)),
        None
    );
    // [NB, BS, NH, CS]: K and V fused in one plane, which 0.5.6 does not checksum.
    let fused_shape = [8, 16, 2, 64];
    let fused_bytes = fused_shape.iter().product::<i64>() * 2;
    let seg = unique("kvt_fused");
    let _fused = ShmMap::create(&seg, fused_bytes as usize);
    let desc = cpu_shm_wrapper(
        &format!("/{seg}"),
        fused_bytes,
        "float16",
        &fused_shape,
        &[16 * 2 * 64, 2 * 64, 64, 1],
    );
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(8, desc)),
        None
    );

    let sums = |body: &str| post(&srv, "/cache/checksums", Some(body));
    let refused = |body: &str, status: u16, detail: &str| {
        assert_eq!(sums(body), (status, json!({ "detail": detail })), "{body}");
    };
    refused(
        r#"{"instance_id":7,"block_ids":[],"chunk_size":1}"#,
        400,
        "block_ids is required",
    );
    refused(
        r#"{"instance_id":7,"block_ids":[1]}"#,
        400,
        "chunk_size must be positive",
    );
    refused(
        r#"{"instance_id":8,"block_ids":[1],"chunk_size":1}"#,
        501,
        "checksum not supported for GPU KV format NL_X_NB_BS_NH_CS",
    );
    let (st, v) = sums(r#"{"instance_id":7,"block_ids":[1,99],"chunk_size":1}"#);
    assert_eq!(st, 400, "{v}");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("block id 99 is outside 0..8"),
        "{v}"
    );
    // The same worker answers a request it can serve.
    let (st, v) = sums(r#"{"instance_id":7,"block_ids":[1,2],"chunk_size":1}"#);
    assert_eq!((st, v["num_chunks"].as_i64()), (200, Some(2)), "{v}");
}

#[test]
fn config_is_json_with_the_flag_values() {
    let srv = Server::start(&[
        "--session-ttl-seconds",
        "123",
        "--max-frame-bytes",
        "131072",
    ]);
    let (st, body) = srv.http("GET", "/config", None);
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).expect("/config is JSON");
    assert_eq!(v["chunk_size"], json!(ED_CHUNK));
    assert_eq!(v["port"], json!(srv.port));
    assert_eq!(v["http_port"], json!(srv.http_port));
    assert_eq!(v["host"], json!("127.0.0.1"));
    assert_eq!(v["hash_algorithm"], json!("blake3"));
    assert_eq!(v["session_ttl"], json!(123.0));
    assert_eq!(v["max_frame_bytes"], json!(131072));
    assert_eq!(v["shm_name"], json!(srv.shm_name));
    assert_eq!(v["l1"]["size_bytes"], json!(64u64 << 20));
    assert_eq!(v["l1"]["eviction_policy"], json!("LRU"));
}

#[test]
fn run_script_and_unknown_paths_are_404() {
    let srv = Server::start(&[]);
    for (method, path) in [
        ("POST", "/run_script"),
        ("GET", "/run_script"),
        ("GET", "/nope"),
        ("POST", "/nope"),
        ("GET", "/quota/a/b"),
        ("GET", "/status/x"),
        ("GET", "/cache"),
    ] {
        let (st, body) = srv.http(method, path, None);
        assert_eq!(st, 404, "{method} {path}: {body}");
        assert_eq!(body, r#"{"detail":"Not Found"}"#, "{method} {path}");
    }
}

// ------------------------------------------------------------------ IsolatedLRU

/// A single-chunk sequence of its own, so lookups test chunks one by one.
fn seq(n: u32) -> Vec<u32> {
    ed_tokens(0x1500 + n, ED_CHUNK)
}

fn salted(key: V, salt: &str) -> V {
    with_field(&key, "cache_salt", s(salt))
}

/// Looks up sequence `n` under `salt`, releases what the lookup locked, and
/// says whether it was found.
fn present(c: &mut Client, n: u32, salt: &str) -> bool {
    let rid = format!("probe-{salt}-{n}");
    let key = salted(ed_key("m", None, &seq(n), 1, &rid), salt);
    let hit = ed_lookup(c, &key);
    if hit > 0 {
        assert_eq!(c.call(OP_FREE_LOOKUP_LOCKS, &[key, V::I(1)]), None);
    }
    assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
    hit > 0
}

fn usage_bytes(srv: &Server, salt: &str) -> f64 {
    srv.get_json(&format!("/quota/{salt}"))["current_usage_gb"]
        .as_f64()
        .unwrap()
        * GIB
}

#[test]
fn isolated_lru_enforces_quotas_over_several_cycles() {
    let mut srv = Server::start(&["--eviction-policy", "IsolatedLRU", "--cores", "0,1"]);
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    // Room for 16 chunks under salt "a"; no quota for "b" (it may keep nothing).
    let limit = 16.0 * ED_CHUNK_BYTES as f64;
    let body = format!(r#"{{"limit_gb": {}}}"#, limit / GIB);
    assert_eq!(put(&srv, "/quota/a", &body).0, 200);
    // The anonymous salt keeps its data (assert_serving stores under it).
    assert_eq!(put(&srv, "/quota/_default", r#"{"limit_gb": 0.01}"#).0, 200);

    let (per_cycle_a, per_cycle_b) = (40u32, 10u32);
    for cycle in 0..3u32 {
        let a: Vec<u32> = (0..per_cycle_a).map(|i| cycle * 1000 + i).collect();
        let b: Vec<u32> = (0..per_cycle_b).map(|i| cycle * 1000 + 500 + i).collect();
        let writes_before = counter(&srv, "lmcache_mp_l1_write_chunks_total");
        for (salt, ns) in [("a", &a), ("b", &b)] {
            for &n in ns {
                let key = salted(ed_key("m", Some(0), &seq(n), 1, &format!("w{n}")), salt);
                assert_eq!(ed_store(&mut c, &mut pool, &key, 1, n as u64).len(), 1);
                assert_eq!(c.call(OP_END_SESSION, &[s(&format!("w{n}"))]), None);
            }
        }
        assert_eq!(
            counter(&srv, "lmcache_mp_l1_write_chunks_total") - writes_before,
            (per_cycle_a + per_cycle_b) as f64,
            "cycle {cycle}: every chunk was written"
        );
        // Eviction ticks every second: wait for "b" to empty and "a" to fit.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (ua, ub) = (usage_bytes(&srv, "a"), usage_bytes(&srv, "b"));
            if ub == 0.0 && ua <= limit {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "cycle {cycle}: quotas not enforced in 10 s (a: {ua} of {limit}, b: {ub})"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Through lookups: nothing of "b" is left, "a" keeps at most its quota.
        for &n in &b {
            assert!(!present(&mut c, n, "b"), "cycle {cycle}: b/{n} survived");
        }
        let kept: Vec<u32> = (0..=cycle)
            .flat_map(|k| (0..per_cycle_a).map(move |i| k * 1000 + i))
            .filter(|&n| present(&mut c, n, "a"))
            .collect();
        assert!(!kept.is_empty(), "cycle {cycle}: the quota keeps some of a");
        assert!(
            kept.len() as f64 * ED_CHUNK_BYTES as f64 <= limit,
            "cycle {cycle}: {} chunks of a kept, quota {limit} bytes",
            kept.len()
        );
        assert_eq!(
            usage_bytes(&srv, "a"),
            kept.len() as f64 * ED_CHUNK_BYTES as f64,
            "cycle {cycle}: usage matches what lookups find"
        );
        // The probes released their locks.
        let st = srv.get_json("/status");
        assert_eq!(st["storage_manager"]["l1_manager"]["read_locked_count"], 0);
    }
    assert!(counter(&srv, "lmcache_mp_l1_evicted_chunks_total") >= 3.0 * 10.0 + 3.0 * 24.0);
    assert!(counter(&srv, "lmcache_mp_l1_eviction_loop_triggered_total") >= 3.0);
    assert_serving(&mut srv);
}

fn l1_status(srv: &Server) -> Value {
    let (st, text) = srv.http("GET", "/status", None);
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&text).unwrap();
    v["storage_manager"]["l1_manager"].clone()
}

#[test]
fn l1_page_policy_is_reported_and_hugetlb_needs_its_pool_and_no_shm() {
    // A lazy L1 keeps base pages.
    let lazy = Server::start(&[]);
    assert_eq!(l1_status(&lazy)["huge_pages"], "off");
    drop(lazy);

    // A pre-faulted L1 asks for transparent huge pages; engine_driven workers
    // map the 2 MiB-aligned pool and data round-trips through it.
    let srv = Server::start(&["--no-l1-use-lazy"]);
    let l1 = l1_status(&srv);
    assert_eq!(l1["huge_pages"], "transparent");
    assert!(l1["huge_page_bytes_at_start"].is_u64(), "{l1}");
    let mut c = srv.client();
    let mut pool = worker(&mut c, 1);
    let toks = ed_tokens(40, 3 * ED_CHUNK);
    let stored = ed_store(
        &mut c,
        &mut pool,
        &ed_key("m", Some(0), &toks, 3, "s"),
        1,
        9,
    );
    assert_eq!(ed_lookup(&mut c, &ed_key("m", None, &toks, 3, "l")), 3);
    let back = ed_retrieve(&mut c, &pool, &ed_key("m", Some(0), &toks, 3, "l"), 1);
    assert!(
        back == stored,
        "bytes retrieved from a transparent-huge-page pool differ"
    );
    drop(srv);

    // The hugetlb pool cannot back the SHM pool (as lmcache 0.5.6).
    let err =
        Server::start_or_refuse(&["--l1-use-hugepages"]).expect("refused with the SHM pool on");
    assert!(
        err.contains("--l1-use-hugepages") && err.contains("--shm-name"),
        "{err}"
    );

    // Without SHM: refused with the sysctl to run when the pool is short,
    // served from hugetlb pages otherwise.
    let free: u64 =
        std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
    let needed = (1u64 << 26) / (2 << 20);
    match Server::start_or_refuse(&["--l1-use-hugepages", "--shm-name", ""]) {
        Some(err) => {
            assert!(
                free < needed,
                "refused although {free} pages were free: {err}"
            );
            assert!(err.contains("vm.nr_hugepages=32"), "{err}");
        }
        None => assert!(
            free >= needed,
            "started with only {free} free hugetlb pages"
        ),
    }
}

#[test]
fn quota_salts_and_checksum_work_are_bounded() {
    let srv = Server::start(&["--max-quotas", "3", "--max-checksum-blocks", "4"]);
    let limit = r#"{"limit_gb": 1}"#;
    for salt in ["a", "b", "_default"] {
        assert_eq!(put(&srv, &format!("/quota/{salt}"), limit).0, 200, "{salt}");
    }
    // A new salt beyond the bound is refused; the ones held can still change.
    let (st, v) = put(&srv, "/quota/c", limit);
    assert_eq!(st, 400, "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(msg.contains("--max-quotas"), "{msg}");
    assert_eq!(put(&srv, "/quota/a", r#"{"limit_gb": 2}"#).0, 200);
    assert_eq!(delete(&srv, "/quota/b").0, 200);
    assert_eq!(put(&srv, "/quota/c", limit).0, 200);
    let (_, list) = srv.http("GET", "/quota", None);
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["users"].as_object().unwrap().len(), 3, "{list}");

    // Salts are checked as on the wire: what no request could carry is refused.
    assert_eq!(delete(&srv, "/quota/c").0, 200);
    for bad in ["nul%00salt", "at%40sign", "back%5Cslash", &"x".repeat(129)] {
        let (st, v) = put(&srv, &format!("/quota/{bad}"), limit);
        assert_eq!(st, 400, "{bad}: {v}");
        assert!(v["error"].as_str().unwrap().contains("cache_salt"), "{v}");
    }
    let (_, list) = srv.http("GET", "/quota", None);
    let list: Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["users"].as_object().unwrap().len(), 2, "{list}");

    // One checksum request names at most --max-checksum-blocks block ids
    // (repeats count: each is read and hashed).
    let mut c = srv.client();
    let (_layer, desc) = lm_layer("kvt_bounded_sums");
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &lm_register_frames(7, desc)),
        None
    );
    let sums = |ids: &str| {
        post(
            &srv,
            "/cache/checksums",
            Some(&format!(
                r#"{{"instance_id":7,"block_ids":{ids},"chunk_size":1}}"#
            )),
        )
    };
    let (st, v) = sums("[1,1,1,1,1]");
    assert_eq!(st, 400, "{v}");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("--max-checksum-blocks"),
        "{v}"
    );
    let (st, v) = sums("[1,2,3,4]");
    assert_eq!((st, v["num_chunks"].as_i64()), (200, Some(4)), "{v}");
}
