//! End to end: the L2 tier behind the real binary. Chunks are written behind to
//! an fs (or mock) adapter, outlive a restart with an empty L1, and are loaded
//! back on lookup; `skip_l1` and `retain` change what stays in L1; a kill -9 in
//! the middle of stores never leaves a torn object under a real name.

mod support;
use std::path::{Path, PathBuf};

use support::*;

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(unique(&format!("kvshard-l2-{tag}")));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn fs_adapter(dir: &TempDir) -> String {
    format!(r#"{{"type":"fs","base_path":"{}"}}"#, dir.path())
}

/// Object files (real names) in `dir`, with their sizes. A file the server
/// evicts between the listing and its `stat` is left out, as if listed after.
fn data_files(dir: &Path) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.ends_with(".data") {
                return None;
            }
            match e.metadata() {
                Ok(m) => Some((name, m.len())),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
                Err(err) => panic!("stat of {name}: {err}"),
            }
        })
        .collect();
    v.sort();
    v
}

#[test]
fn fs_chunks_outlive_a_restart_and_load_back_from_l2() {
    let dir = TempDir::new("restart");
    let adapter = fs_adapter(&dir);
    let toks = ed_tokens(11, 4 * ED_CHUNK + 3);
    let stored = {
        let srv = Server::start(&["--cores", "0,1", "--l2-adapter", &adapter]);
        let stored = ed_store_chunks(&srv, 1, &toks, 4, 7);
        // A file is renamed into place before its store result reaches the
        // adapter's counters: wait for both.
        wait_until("4 objects written behind to fs and counted", || {
            data_files(&dir.0).len() == 4
                && srv.get_json("/status")["storage_manager"]["l2_adapters"][0]
                    ["stored_object_count"]
                    == 4
                && srv.metric("lmcache_mp_l2_store_completed_objects_chunks_total", &[])
                    == Some(4.0)
        });
        assert!(
            data_files(&dir.0)
                .iter()
                .all(|(n, len)| *len == ED_CHUNK_BYTES as u64 && n.starts_with("m@0x01000100@0@")),
            "{:?}",
            data_files(&dir.0)
        );
        let st = srv.get_json("/status");
        assert_eq!(st["storage_manager"]["num_l2_adapters"], 1);
        assert_eq!(
            st["storage_manager"]["l2_adapters"][0]["type"],
            "FSL2Adapter"
        );
        assert_eq!(
            st["storage_manager"]["l2_adapters"][0]["stored_object_count"],
            4
        );
        assert_eq!(
            srv.metric("lmcache_mp_l2_store_completed_objects_chunks_total", &[]),
            Some(4.0)
        );
        let ca = srv.get_json("/config/adapters");
        assert_eq!(ca["adapters"][0]["type_name"], "fs");
        assert_eq!(ca["adapters"][0]["config"]["base_path"], dir.path());
        stored
    };

    // A new process with an empty L1: the lookup finds the chunks in L2, loads
    // them and the retrieve returns the stored bytes.
    let srv = Server::start(&["--cores", "0,1", "--l2-adapter", &adapter]);
    assert_eq!(srv.l1_count("total_object_count"), 0);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 4, "warm");
    assert_eq!(hits, 4, "every chunk hits from L2");
    assert_eq!(back, stored, "bytes loaded from L2 equal the bytes stored");
    assert_eq!(
        srv.metric("lmcache_mp_lookup_hit_l2_keys_total", &[]),
        Some(4.0)
    );
    assert_eq!(
        srv.metric("lmcache_mp_l2_prefetch_load_completed_chunks_total", &[]),
        Some(4.0)
    );
    // The shards said where they loaded each chunk: the worker's
    // prepare_retrieve was answered from the lookup's locks.
    assert_eq!(
        srv.metric("kvshard_prepare_retrieves_from_lease_total", &[]),
        Some(1.0)
    );
    // Default prefetch policy: loaded objects are temporary, freed once read.
    wait_until("temporary objects freed", || {
        srv.l1_count("total_object_count") == 0
    });
    // And they hit again (loaded again).
    let (hits, back) = ed_lookup_retrieve(&srv, 3, &toks, 4, "warm2");
    assert_eq!((hits, back), (4, stored));

    // A prefix that diverges after two chunks hits two.
    let mut other = toks[..2 * ED_CHUNK].to_vec();
    other.extend(ed_tokens(99, 3 * ED_CHUNK));
    let (hits, _) = ed_lookup_retrieve(&srv, 4, &other, 5, "partial");
    assert_eq!(hits, 2);
}

#[test]
fn retain_keeps_loaded_chunks_in_l1() {
    let dir = TempDir::new("retain");
    let adapter = fs_adapter(&dir);
    let toks = ed_tokens(12, 3 * ED_CHUNK);
    let stored = {
        let srv = Server::start(&["--l2-adapter", &adapter]);
        let stored = ed_store_chunks(&srv, 1, &toks, 3, 8);
        wait_until("3 objects in fs", || data_files(&dir.0).len() == 3);
        stored
    };
    let srv = Server::start(&["--l2-adapter", &adapter, "--l2-prefetch-policy", "retain"]);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "warm");
    assert_eq!((hits, back), (3, stored));
    let ticks = srv.l1_ticks();
    // Loaded as resident objects, not temporary ones: neither the end of the
    // read nor a tick's expiry frees them.
    assert_eq!(
        srv.l1_count("temporary_count"),
        0,
        "retained chunks are not temporary"
    );
    srv.wait_l1_ticks_after(ticks);
    assert_eq!(
        srv.l1_count("total_object_count"),
        3,
        "retained chunks stay in L1"
    );
    // Now they are L1 hits: nothing more is loaded from L2.
    let loaded = srv.metric("lmcache_mp_l2_prefetch_load_completed_chunks_total", &[]);
    let (hits, _) = ed_lookup_retrieve(&srv, 3, &toks, 3, "again");
    assert_eq!(hits, 3);
    assert_eq!(
        srv.metric("lmcache_mp_l2_prefetch_load_completed_chunks_total", &[]),
        loaded
    );
}

#[test]
fn skip_l1_keeps_l1_empty_while_hits_come_from_l2() {
    let srv = Server::start(&[
        "--eviction-policy",
        "noop",
        "--l2-store-policy",
        "skip_l1",
        "--l2-adapter",
        r#"{"type":"mock","max_size_gb":0.01,"mock_bandwidth_gb":50}"#,
    ]);
    let toks = ed_tokens(13, 3 * ED_CHUNK);
    let stored = ed_store_chunks(&srv, 1, &toks, 3, 9);
    wait_until("L1 dropped after the L2 store", || {
        srv.l1_count("total_object_count") == 0
    });
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "warm");
    assert_eq!((hits, back), (3, stored));
    wait_until("L1 empty again after the retrieve", || {
        srv.l1_count("total_object_count") == 0
    });
    assert_eq!(
        srv.metric("lmcache_mp_lookup_hit_l2_keys_total", &[]),
        Some(3.0)
    );
}

/// Bytes of one chunk of a `big_register`ed worker: [2, 16 layers, 16 slots, 2048] f16.
const BIG_CHUNK_BYTES: usize = 2 * 16 * ED_CHUNK * 2048 * 2;

fn big_register(c: &mut Client, iid: i64) -> ShmMap {
    let r = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                iid,
                "big",
                1,
                16,
                2048,
                false,
                ED_CHUNK as i64,
            )],
        )
        .expect("register reply");
    ShmMap::open(
        r.get("shm_name").unwrap().str(),
        r.get("pool_size").unwrap().int() as usize,
    )
}

/// PREPARE_STORE + fill + COMMIT_STORE of `n` chunks; returns the bytes per chunk.
fn big_store(
    c: &mut Client,
    pool: &mut ShmMap,
    iid: i64,
    toks: &[u32],
    n: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    let key = ipc_key("big", 1, Some(0), toks, 0, (n * ED_CHUNK) as i64, "s", 1);
    let r = c.call(OP_PREPARE_STORE, &[key.clone(), V::I(iid)]).unwrap();
    let slots = ed_slots(&r);
    assert_eq!(slots.len(), n);
    let mut out = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        let off = slot.get("offset").unwrap().int() as usize;
        let len = slot.get("length").unwrap().int() as usize;
        assert_eq!(len, BIG_CHUNK_BYTES);
        let data = pattern(seed * 16 + i as u64, len);
        pool.bytes_mut()[off..off + len].copy_from_slice(&data);
        out.push(data);
    }
    assert_eq!(
        c.call(OP_COMMIT_STORE, &[key, V::I(iid), V::Bin(vec![])]),
        Some(V::B(true))
    );
    out
}

#[test]
fn kill_9_mid_store_leaves_no_torn_object() {
    let dir = TempDir::new("crash");
    let adapter = fs_adapter(&dir);
    // 2 MiB objects written behind while more arrive: the kill lands while
    // some are being written.
    let requests: Vec<Vec<u32>> = (0..40).map(|i| ed_tokens(1000 + i, 4 * ED_CHUNK)).collect();
    let mut stored: Vec<Vec<Vec<u8>>> = Vec::new();
    {
        let mut srv = Server::start(&["--l1-size-gb", "1", "--l2-adapter", &adapter]);
        let mut c = srv.client();
        let mut pool = big_register(&mut c, 1);
        for (i, toks) in requests.iter().enumerate() {
            stored.push(big_store(&mut c, &mut pool, 1, toks, 4, 5000 + i as u64));
            if i == 30 {
                // SAFETY: plain kill(2) of our child.
                unsafe { libc::kill(srv.child.id() as i32, libc::SIGKILL) };
                let _ = srv.child.wait();
                break;
            }
        }
        assert!(!srv.alive());
    }
    let files = data_files(&dir.0);
    let tmp = std::fs::read_dir(&dir.0)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        })
        .count();
    eprintln!(
        "after the kill: {} objects under real names, {tmp} temporary files",
        files.len()
    );
    for (name, len) in &files {
        assert_eq!(*len, BIG_CHUNK_BYTES as u64, "{name} is torn");
    }
    // Whatever made it to disk loads back with the bytes stored.
    let srv = Server::start(&["--l1-size-gb", "1", "--l2-adapter", &adapter]);
    let mut c = srv.client();
    let pool = big_register(&mut c, 2);
    let mut hit_total = 0;
    for (i, toks) in requests.iter().enumerate().take(stored.len()) {
        let rid = format!("r{i}");
        let hits = ed_lookup(
            &mut c,
            &ipc_key("big", 1, None, toks, 0, 4 * ED_CHUNK as i64, &rid, 1),
        );
        if hits > 0 {
            let key = ipc_key("big", 1, Some(0), toks, 0, hits * ED_CHUNK as i64, &rid, 1);
            let back = ed_retrieve(&mut c, &pool, &key, 2);
            assert!(
                back[..] == stored[i][..hits as usize],
                "request {i}: bytes differ"
            );
        }
        c.call(OP_END_SESSION, &[s(&rid)]);
        hit_total += hits;
    }
    assert!(
        hit_total > 0,
        "some stores reached the disk before the kill"
    );
    assert!(files.len() as i64 >= hit_total);
}

#[test]
fn fs_capacity_evicts_the_least_recently_used_objects() {
    let dir = TempDir::new("evict");
    // Room for 6 objects on the one shard; evict half the tracked keys at 80%.
    let cap_gb = 6.0 * ED_CHUNK_BYTES as f64 / (1u64 << 30) as f64;
    let adapter = format!(
        r#"{{"type":"fs","base_path":"{}","max_capacity_gb":{cap_gb},
            "eviction":{{"eviction_policy":"LRU","trigger_watermark":0.8,"eviction_ratio":0.5}}}}"#,
        dir.path()
    );
    let srv = Server::start(&[
        "--cores",
        "0",
        "--eviction-policy",
        "noop",
        "--l2-store-policy",
        "skip_l1",
        "--l2-adapter",
        &adapter,
    ]);
    let reqs: Vec<Vec<u32>> = (0..4).map(|i| ed_tokens(40 + i, 2 * ED_CHUNK)).collect();
    let mut c = srv.client();
    let (name, size) = ed_register(&mut c, 1, "m");
    let mut pool = ShmMap::open(&name, size);
    for (i, toks) in reqs.iter().enumerate() {
        let rid = format!("s{i}");
        ed_store(
            &mut c,
            &mut pool,
            &ed_key("m", Some(0), toks, 2, &rid),
            1,
            60 + i as u64,
        );
        c.call(OP_END_SESSION, &[s(&rid)]);
        // One request at a time, so the L2 recency order is the store order.
        wait_until("L1 copies dropped", || {
            srv.l1_count("total_object_count") == 0
        });
    }
    // 8 objects over a capacity of 6: a tick evicts the 4 least recent.
    // The pass counts its evictions once all its deletes are done, after the
    // files are gone: wait for both.
    wait_until("L2 eviction", || {
        data_files(&dir.0).len() == 4
            && srv.metric("lmcache_mp_l2_evicted_objects_chunks_total", &[]) == Some(4.0)
    });
    // Two more passes start: the first of them began after the eviction was
    // seen and had finished before the second began (one pass at a time).
    let l2_ticks = || {
        srv.metric("kvshard_l2_eviction_ticks_total", &[])
            .expect("kvshard_l2_eviction_ticks_total in /metrics")
    };
    let ticks = l2_ticks();
    wait_until("two more L2 eviction passes", || l2_ticks() >= ticks + 2.0);
    assert_eq!(
        data_files(&dir.0).len(),
        4,
        "below the watermark nothing more goes"
    );
    assert_eq!(
        srv.metric("lmcache_mp_l2_evicted_objects_chunks_total", &[]),
        Some(4.0),
        "below the watermark nothing more is evicted"
    );
    let hits: Vec<i64> = reqs
        .iter()
        .enumerate()
        .map(|(i, toks)| {
            let rid = format!("l{i}");
            let h = ed_lookup(&mut c, &ed_key("m", None, toks, 2, &rid));
            c.call(
                OP_FREE_LOOKUP_LOCKS,
                &[ed_key("m", None, toks, 2, &rid), V::I(1)],
            );
            c.call(OP_END_SESSION, &[s(&rid)]);
            h
        })
        .collect();
    assert_eq!(hits, [0, 0, 2, 2], "the two oldest requests were evicted");
    let st = srv.get_json("/status");
    assert_eq!(
        st["storage_manager"]["l2_adapters"][0]["stored_object_count"],
        4
    );
}

#[test]
fn fs_capacity_counts_what_is_on_disk_at_start_and_holds_across_restarts() {
    let dir = TempDir::new("rescan");
    // 20 requests of 2 chunks written by a server without a cap.
    let reqs: Vec<Vec<u32>> = (0..20).map(|i| ed_tokens(300 + i, 2 * ED_CHUNK)).collect();
    {
        let srv = Server::start(&["--l2-adapter", &fs_adapter(&dir)]);
        for (i, toks) in reqs.iter().enumerate() {
            ed_store_chunks(&srv, 1, toks, 2, 500 + i as u64);
        }
        wait_until("40 files", || data_files(&dir.0).len() == 40);
    }
    // Dated a minute apart, in name order: the LRU order a restart must
    // find.
    let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let files = data_files(&dir.0);
    for (n, (file, _)) in files.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(dir.0.join(file))
            .unwrap();
        f.set_modified(t0 + std::time::Duration::from_secs(60 * n as u64))
            .unwrap();
    }

    // A start with a cap of 10 objects and LRU eviction counts all 40 at
    // once, and evicts the oldest down to the watermark.
    let cap_gb = 10.0 * ED_CHUNK_BYTES as f64 / (1u64 << 30) as f64;
    let capped = format!(
        r#"{{"type":"fs","base_path":"{}","max_capacity_gb":{cap_gb},
            "eviction":{{"eviction_policy":"LRU","trigger_watermark":0.8,"eviction_ratio":0.5}}}}"#,
        dir.path()
    );
    let srv = Server::start(&["--cores", "0", "--l2-adapter", &capped]);
    wait_until("the scan done", || {
        let st = srv.get_json("/status");
        st["storage_manager"]["l2_adapters"][0]["shards"][0]["usage_seed"]["state"] == "done"
    });
    let seed = srv.get_json("/status")["storage_manager"]["l2_adapters"][0]["shards"][0]
        ["usage_seed"]
        .clone();
    assert_eq!(seed["objects_adopted"], 40, "{seed}");
    assert_eq!(seed["bytes_adopted"], 40 * ED_CHUNK_BYTES as u64, "{seed}");
    wait_until("the directory under its cap", || {
        data_files(&dir.0).len() <= 8
    });
    // The newest files are the ones kept.
    let kept: Vec<String> = data_files(&dir.0).into_iter().map(|(n, _)| n).collect();
    let newest: Vec<String> = files[files.len() - kept.len()..]
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(
        kept, newest,
        "eviction took the oldest by modification time"
    );

    // More stores keep it there, and so does another restart.
    for i in 0..10 {
        ed_store_chunks(
            &srv,
            1,
            &ed_tokens(900 + i, 2 * ED_CHUNK),
            2,
            900 + i as u64,
        );
    }
    let srv_ticks = || {
        srv.metric("kvshard_l2_eviction_ticks_total", &[])
            .unwrap_or(0.0)
    };
    let ticks = srv_ticks();
    wait_until("two eviction passes", || srv_ticks() >= ticks + 2.0);
    assert!(
        data_files(&dir.0).len() <= 10,
        "{} files",
        data_files(&dir.0).len()
    );
    drop(srv);
    let on_disk = data_files(&dir.0).len() as u64;
    let srv = Server::start(&["--cores", "0", "--l2-adapter", &capped]);
    wait_until("the second scan", || {
        let st = srv.get_json("/status");
        st["storage_manager"]["l2_adapters"][0]["stored_object_count"] == on_disk
    });
}
