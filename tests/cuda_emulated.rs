//! End to end: GPU workers' lmcache_driven transfers (`--cuda-transfer on`)
//! through the real binary, on a host without a GPU.
//!
//! There is no GPU here, so the server runs with `KVSHARD_CUDA_EMULATION=1`:
//! its device thread is replaced by a CPU stand-in that maps `cuda_raw`
//! handles naming POSIX shm segments and copies with the CPU executor of the
//! kernel's stride tables. Everything else is the real path: the
//! registration checks and layout, the L1 reservations and commits, the
//! lookup read locks, batching and skips, the replies. The driver calls,
//! the IPC imports and the kernel itself are not exercised (see
//! `tools/gpu/check.sh` for a GPU host).
//!
//! The test plays a GPU worker whose "GPU memory" is shm, and checks the
//! bytes against the cpu_shm path (whose objects match lmcache 0.5.6 byte
//! for byte): a chunk stored by the GPU worker is retrieved by a CPU worker
//! of the same model and lands in the same place.
//!
//! The emulation is a test hook, compiled into debug builds only (the ones
//! `cargo test` runs), so this file tests nothing in a release build.
#![cfg(debug_assertions)]

mod support;
use support::*;

const CS: usize = 16; // --chunk-size in Server::start
const BS: usize = 4;
const BPC: usize = CS / BS;
const NB: usize = 32;
const NL: usize = 2;
const NH: usize = 2;
const HS: usize = 8;
const ES: usize = 2; // float16
const BLOCK: usize = BS * NH * HS * ES;
const LAYER: usize = 2 * NB * BLOCK;
/// Where the tensor starts in its "allocation" (the descriptor's alloc_offset).
const ALLOC_OFFSET: usize = 4096;
const MODEL: &str = "gpu-model";
const GPU_UUID: &str = "00000000-0000-4000-8000-0000000ee0e0";
const EMULATION: (&str, &str) = ("KVSHARD_CUDA_EMULATION", "1");
const SRC: [i64; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
const DST: [i64; 12] = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31];

fn shape() -> Vec<i64> {
    vec![2, NB as i64, BS as i64, NH as i64, HS as i64]
}

fn strides() -> Vec<i64> {
    let (nb, bs, nh, hs) = (NB as i64, BS as i64, NH as i64, HS as i64);
    vec![nb * bs * nh * hs, bs * nh * hs, nh * hs, hs, 1]
}

/// A `cuda_raw` descriptor of one float16 layer of this file's shape whose
/// 64-byte handle names the shm segment.
fn cuda_raw(shm: &str, uuid: &str) -> V {
    let tensor = RawTensor {
        alloc_offset: ALLOC_OFFSET,
        nbytes: LAYER,
        dtype: "float16",
        shape: shape(),
        stride: strides(),
    };
    cuda_raw_of(shm, &tensor, uuid)
}

/// One tensor of a `cuda_raw` registration.
struct RawTensor<'a> {
    alloc_offset: usize,
    nbytes: usize,
    dtype: &'a str,
    shape: Vec<i64>,
    stride: Vec<i64>,
}

/// A `cuda_raw` descriptor of `t` whose 64-byte handle names the shm
/// segment.
fn cuda_raw_of(shm: &str, t: &RawTensor, uuid: &str) -> V {
    let mut handle = format!("/{shm}").into_bytes();
    handle.resize(64, 0);
    let ints = |v: &[i64]| V::A(v.iter().map(|&x| V::I(x)).collect());
    let inner = map(&[
        ("type", s("cuda_raw")),
        ("ipc_handle", V::Bin(handle)),
        ("alloc_offset", V::I(t.alloc_offset as i64)),
        ("nbytes", V::I(t.nbytes as i64)),
        ("version", V::I(1)),
        (
            "metadata",
            map(&[
                ("dtype", s(t.dtype)),
                ("shape", ints(&t.shape)),
                ("stride", ints(&t.stride)),
                ("storage_offset", V::I(0)),
                ("device_uuid", s(uuid)),
            ]),
        ),
    ]);
    V::Ext(1, enc(&inner))
}

fn register_frames(iid: i64, descs: Vec<V>) -> Vec<V> {
    register_kv_cache_frames(iid, descs, MODEL, 1, "NHD", vec![kv_group(NL, BS)])
}

/// A worker's per-layer KV memory: shm segments with the layer at `offset`.
struct Layers {
    names: Vec<String>,
    segs: Vec<ShmMap>,
    offset: usize,
}

impl Layers {
    fn new(prefix: &str, offset: usize, seed: u64) -> Layers {
        let mut names = Vec::new();
        let mut segs = Vec::new();
        for l in 0..NL {
            let name = unique(prefix);
            let mut seg = ShmMap::create(&name, offset + LAYER);
            seg.bytes_mut()[offset..].copy_from_slice(&pattern(seed * 100 + l as u64, LAYER));
            names.push(name);
            segs.push(seg);
        }
        Layers {
            names,
            segs,
            offset,
        }
    }

    fn block(&self, layer: usize, plane: usize, id: i64) -> &[u8] {
        let at = self.offset + (plane * NB + id as usize) * BLOCK;
        &self.segs[layer].bytes()[at..at + BLOCK]
    }

    fn fill(&mut self, ids: &[i64], byte: u8) {
        for seg in &mut self.segs {
            for plane in 0..2 {
                for &id in ids {
                    let at = self.offset + (plane * NB + id as usize) * BLOCK;
                    seg.bytes_mut()[at..at + BLOCK].fill(byte);
                }
            }
        }
    }

    /// Every (layer, plane) block of `ids`, for comparisons.
    fn blocks(&self, ids: &[i64]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for layer in 0..NL {
            for plane in 0..2 {
                for &id in ids {
                    out.push(self.block(layer, plane, id).to_vec());
                }
            }
        }
        out
    }
}

fn key(toks: &[u32], worker: Option<i64>, rid: &str) -> V {
    ipc_key(MODEL, 1, worker, toks, 0, toks.len() as i64, rid, 1)
}

fn store(c: &mut Client, iid: i64, toks: &[u32], blocks: &[i64]) -> (Vec<u8>, bool) {
    transfer_outcome(c.call(
        OP_STORE,
        &[
            key(toks, Some(0), "store"),
            V::I(iid),
            group_ids(blocks),
            V::Bin(vec![7; 64]),
        ],
    ))
}

fn lookup(c: &mut Client, toks: &[u32], rid: &str) -> i64 {
    assert_eq!(c.call(OP_LOOKUP, &[key(toks, None, rid), V::I(1)]), None);
    c.prefetch_result(rid)
}

fn retrieve(
    c: &mut Client,
    iid: i64,
    toks: &[u32],
    rid: &str,
    blocks: &[i64],
    skip: i64,
) -> (Vec<u8>, bool) {
    transfer_outcome(c.call(
        OP_RETRIEVE,
        &[
            key(toks, Some(0), rid),
            V::I(iid),
            group_ids(blocks),
            V::Bin(vec![7; 64]),
            V::I(skip),
        ],
    ))
}

fn start(dir: &std::path::Path, extra: &[&str]) -> Server {
    let mut args = vec!["--cuda-transfer", "on"];
    args.extend_from_slice(extra);
    Server::start_logged_env(&args, &dir.join("server.log"), &[EMULATION])
}

#[test]
fn gpu_worker_stores_and_retrieves_the_0_5_6_objects() {
    let dir = std::env::temp_dir().join(unique("cuda-emu"));
    std::fs::create_dir_all(&dir).unwrap();
    // The device thread takes 300 ms to set the instance up, as pinning a
    // large L1 does on a GPU.
    let srv = Server::start_logged_env(
        &["--cuda-transfer", "on"],
        &dir.join("server.log"),
        &[EMULATION, ("KVSHARD_CUDA_EMULATION_SETUP_MS", "300")],
    );
    let mut c = srv.client();
    let mut gpu = Layers::new("kvt_gpu", ALLOC_OFFSET, 1);
    let descs = gpu.names.iter().map(|n| cuda_raw(n, GPU_UUID)).collect();
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &register_frames(300, descs)),
        None
    );
    // Answered once set up: a STORE sent right away finds it registered.
    assert!(
        registered_gpu_ids(&srv).contains(&300),
        "REGISTER_KV_CACHE answered before the device thread set the instance up"
    );
    let meta = &srv.get_json("/status")["cache_context_meta"]["300"];
    assert_eq!(meta["device"], "cuda:0", "{meta}");
    assert_eq!(
        meta["kv_cache_layout"]["kernel_groups"][0]["engine_kv_format"], "NL_X_TWO_NB_BS_NH_HS",
        "{meta}"
    );

    let toks = ed_tokens(5, 3 * CS);
    let stored = gpu.blocks(&SRC);
    let (event, ok) = store(&mut c, 300, &toks, &SRC);
    assert!(ok, "store");
    assert_eq!(event, vec![0xee; 64], "the device's exported event");
    assert_eq!(c.call(OP_END_SESSION, &[s("store")]), None);
    // Answered after the commit: the very next lookup sees every chunk.
    gpu.fill(&SRC, 0);
    assert_eq!(lookup(&mut c, &toks, "r1"), 3);
    let (event, ok) = retrieve(&mut c, 300, &toks, "r1", &DST, 0);
    assert!(ok && event.len() == 64, "retrieve");
    assert_eq!(
        gpu.blocks(&DST),
        stored,
        "retrieved blocks equal the stored ones"
    );
    assert_eq!(c.call(OP_END_SESSION, &[s("r1")]), None);
    assert_eq!(
        srv.l1_count("read_locked_count"),
        0,
        "the lookup's locks are released"
    );

    // skip_first_n_tokens = BS + 1: the first whole block is left alone and
    // the partially skipped second block is rewritten, as in 0.5.6.
    gpu.fill(&DST, 0x5a);
    assert_eq!(lookup(&mut c, &toks, "r2"), 3);
    let (_, ok) = retrieve(&mut c, 300, &toks, "r2", &DST, (BS + 1) as i64);
    assert!(ok);
    for layer in 0..NL {
        for plane in 0..2 {
            assert!(gpu.block(layer, plane, DST[0]).iter().all(|&b| b == 0x5a));
            for (i, &d) in DST.iter().enumerate().skip(1) {
                let want = &stored[(layer * 2 + plane) * SRC.len() + i];
                assert!(gpu.block(layer, plane, d) == &want[..], "block {i}");
            }
        }
    }
    assert_eq!(c.call(OP_END_SESSION, &[s("r2")]), None);

    // A CPU worker of the same model reads the GPU worker's chunks: the
    // objects have the cpu_shm path's (0.5.6's) layout.
    let cpu = Layers::new("kvt_cpu", 0, 2);
    let cpu_descs = cpu
        .names
        .iter()
        .map(|n| {
            cpu_shm_wrapper(
                &format!("/{n}"),
                LAYER as i64,
                "float16",
                &shape(),
                &strides(),
            )
        })
        .collect();
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &register_frames(301, cpu_descs)),
        None
    );
    assert!(registered_gpu_ids(&srv).contains(&301));
    assert_eq!(lookup(&mut c, &toks, "r3"), 3);
    let (event, ok) = retrieve(&mut c, 301, &toks, "r3", &DST, 0);
    assert!(ok && event.is_empty(), "a cpu_shm retrieve has no event");
    assert_eq!(
        cpu.blocks(&DST),
        stored,
        "the CPU worker gets the GPU worker's bytes"
    );
    assert_eq!(c.call(OP_END_SESSION, &[s("r3")]), None);

    // And the other way: the CPU worker stores, the GPU worker retrieves.
    let toks2 = ed_tokens(6, 2 * CS);
    let cpu_stored = cpu.blocks(&SRC[..2 * BPC]);
    assert!(
        transfer_outcome(c.call(
            OP_STORE,
            &[
                key(&toks2, Some(0), "s2"),
                V::I(301),
                group_ids(&SRC[..2 * BPC]),
                V::Bin(vec![])
            ],
        ))
        .1
    );
    assert_eq!(lookup(&mut c, &toks2, "r4"), 2);
    assert!(retrieve(&mut c, 300, &toks2, "r4", &DST[..2 * BPC], 0).1);
    assert!(
        gpu.blocks(&DST[..2 * BPC]) == cpu_stored,
        "the GPU worker gets the CPU worker's bytes"
    );
    // `/cache/checksums` reads a GPU worker's blocks back from its memory
    // and hashes them as the cpu_shm path hashes a CPU worker's: the same
    // bytes give the same digests, aggregated and per layer.
    for layerwise in [false, true] {
        assert_eq!(
            srv.checksums(300, &DST[..2 * BPC], BPC, layerwise)["chunk_checksums"],
            srv.checksums(301, &SRC[..2 * BPC], BPC, layerwise)["chunk_checksums"],
            "layerwise {layerwise}"
        );
    }
    let gpu_sums = srv.checksums(300, &DST[..2 * BPC], BPC, false);
    assert_eq!(gpu_sums["num_chunks"], 2, "{gpu_sums}");
    assert_ne!(
        gpu_sums["chunk_checksums"][0], gpu_sums["chunk_checksums"][1],
        "{gpu_sums}"
    );
    // Ids outside the worker's blocks are refused before the GPU is asked.
    let (st, reply) = srv.http(
        "POST",
        "/cache/checksums",
        Some(r#"{"instance_id": 300, "block_ids": [0, 99999], "chunk_size": 4}"#),
    );
    assert_eq!(st, 400, "{reply}");
    assert!(reply.contains("99999"), "{reply}");

    // Unregistering drops the instance; its transfers then fail cleanly.
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(300)]), None);
    assert!(!registered_gpu_ids(&srv).contains(&300));
    assert_eq!(store(&mut c, 300, &toks, &SRC), (vec![], false));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpu_worker_failures_are_answered_and_refusals_reported() {
    let dir = std::env::temp_dir().join(unique("cuda-emu-bad"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut srv = start(&dir, &[]);
    let mut c = srv.client();
    let gpu = Layers::new("kvt_gpu_bad", ALLOC_OFFSET, 3);
    let descs = gpu.names.iter().map(|n| cuda_raw(n, GPU_UUID)).collect();
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &register_frames(400, descs)),
        None
    );
    wait_until("registered", || registered_gpu_ids(&srv).contains(&400));

    let toks = ed_tokens(9, 3 * CS);
    // Too few block ids, and a block past the worker's blocks.
    assert_eq!(store(&mut c, 400, &toks, &SRC[..5]), (vec![], false));
    let mut bad = SRC;
    bad[3] = NB as i64;
    assert_eq!(store(&mut c, 400, &toks, &bad), (vec![], false));
    // Nothing was kept by the failed stores.
    assert_eq!(lookup(&mut c, &toks, "miss"), 0);
    assert_eq!(c.call(OP_END_SESSION, &[s("miss")]), None);
    // An isolated_ipc worker's 81-byte timeline-semaphore event is refused
    // by a server without --isolated-ipc (and so is any handle that is not
    // CUDA's 64 bytes), its reservations dropped: a good store of the same
    // chunks works right after.
    let store_with_event = |c: &mut Client, ev: Vec<u8>| {
        transfer_outcome(c.call(
            OP_STORE,
            &[
                key(&toks, Some(0), "ev"),
                V::I(400),
                group_ids(&SRC),
                V::Bin(ev),
            ],
        ))
    };
    assert_eq!(store_with_event(&mut c, vec![1; 81]), (vec![], false));
    assert_eq!(store_with_event(&mut c, vec![1; 63]), (vec![], false));
    let text = std::fs::read_to_string(dir.join("server.log")).unwrap();
    assert!(
        text.contains("isolated_ipc timeline-semaphore form: start kvshard with --isolated-ipc"),
        "{text}"
    );
    assert_eq!(lookup(&mut c, &toks, "miss2"), 0);
    assert_eq!(c.call(OP_END_SESSION, &[s("miss2")]), None);
    // A retrieve without the lookup's locks fails and changes nothing.
    assert_eq!(
        retrieve(&mut c, 400, &toks, "nolock", &DST, 0),
        (vec![], false)
    );

    // A registration the device cannot set up is refused, with the cause,
    // and the worker's PINGs then answer False.
    let missing = cuda_raw(&unique("kvt_absent"), GPU_UUID);
    assert_eq!(
        c.call(
            OP_REGISTER_KV_CACHE,
            &register_frames(401, vec![missing.clone(), missing])
        ),
        None
    );
    wait_until("the failed set-up is reported", || {
        refused_gpu_reason(&srv, 401).is_some()
    });
    let reason = refused_gpu_reason(&srv, 401).unwrap();
    assert!(
        reason.contains("setting it up on GPU 0 failed") && reason.contains("shm_open"),
        "{reason}"
    );
    assert_eq!(c.call(OP_PING, &[V::I(401)]), Some(V::B(false)));
    // A GPU the server does not see.
    let other = gpu
        .names
        .iter()
        .map(|n| cuda_raw(n, "11111111-0000-4000-8000-000000000000"))
        .collect();
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &register_frames(402, other)),
        None
    );
    let reason = refused_gpu_reason(&srv, 402).unwrap();
    assert!(reason.contains("not visible to kvshard"), "{reason}");

    // The good instance is still served.
    let stored = gpu.blocks(&SRC);
    assert!(store(&mut c, 400, &toks, &SRC).1);
    assert_eq!(lookup(&mut c, &toks, "hit"), 3);
    assert!(retrieve(&mut c, 400, &toks, "hit", &DST, 0).1);
    assert!(gpu.blocks(&DST) == stored, "the good instance's round trip");
    assert!(srv.alive());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpu_workers_need_the_l1_in_memory() {
    let dir = std::env::temp_dir().join(unique("cuda-emu-gds"));
    std::fs::create_dir_all(&dir).unwrap();
    let slabs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(unique("cuda-emu-slab"));
    let srv = start(
        &dir,
        &["--gds-l1-path", slabs.to_str().unwrap(), "--shm-name", ""],
    );
    let mut c = srv.client();
    let gpu = Layers::new("kvt_gpu_gds", ALLOC_OFFSET, 4);
    let descs = gpu.names.iter().map(|n| cuda_raw(n, GPU_UUID)).collect();
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &register_frames(500, descs)),
        None
    );
    let reason = refused_gpu_reason(&srv, 500).expect("refused");
    assert!(reason.contains("--gds-l1-path"), "{reason}");
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&slabs);
}

// -- hybrid (multi-group) caches against lmcache 0.5.6's own gathers --------

/// A GPU worker of each hybrid layout lmcache 0.5.6 serves (two classical
/// groups of different heads and dtypes, MLA beside classical, uint8, int8
/// and float32 groups, different block sizes, interleaved layers, sliding
/// windows shorter and longer than a chunk) stores chunk objects byte for
/// byte 0.5.6's (read back from the fs L2), so does a CPU worker of the same
/// layout, and RETRIEVEs with skip_first_n_tokens into fresh GPU memory and
/// into a CPU worker leave every tensor as 0.5.6's scatter does.
#[test]
fn hybrid_gpu_workers_move_the_0_5_6_objects() {
    for case in group_golden_cases() {
        replay_group_case(&case);
    }
}

/// Under `--separate-object-groups`, lmcache 0.5.6's own objects (one per
/// chunk and object group, none for a group's all-null chunks) and
/// retrieves (a sliding-window group's last chunks only).
#[test]
fn separate_object_groups_move_the_0_5_6_objects() {
    for case in og_golden_cases() {
        let want = case["object_groups"]
            .as_array()
            .expect("object_groups")
            .len();
        assert!(want > 1, "{}", case["name"]);
        assert_eq!(replay_group_case(&case), want, "{}", case["name"]);
    }
}

/// Replays one multi-group golden case through a GPU worker (emulated) and
/// a CPU worker: both store 0.5.6's objects and restore 0.5.6's bytes (the
/// cases of `golden_og_gather.json` under `--separate-object-groups`).
/// Returns the object groups the registration formed.
fn replay_group_case(case: &serde_json::Value) -> usize {
    let name = case["name"].as_str().unwrap();
    assert_eq!(
        case["chunk_size"], CS as u64,
        "{name}: the server's chunk size"
    );
    let dir = std::env::temp_dir().join(unique("cuda-emu-groups"));
    let l2 = dir.join("l2");
    std::fs::create_dir_all(&l2).unwrap();
    let args = golden_server_args(&l2, case);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let srv = start(&dir, &args);
    let mut c = srv.client();
    let tensors = golden_tensors(case);
    let groups = golden_group_infos(case);
    let hint = case["layout_hint"].as_str().unwrap();
    let register = |c: &mut Client, iid: i64, descs: Vec<V>| {
        let frames = register_kv_cache_frames(iid, descs, MODEL, 1, hint, groups.clone());
        assert_eq!(c.call(OP_REGISTER_KV_CACHE, &frames), None, "{name}");
    };
    // Per tensor: shm "device memory", filled (source) or zeroed.
    let segments = |prefix: &str, filled: bool| -> (Vec<String>, Vec<ShmMap>) {
        tensors
            .iter()
            .enumerate()
            .map(|(t, spec)| {
                let name = unique(prefix);
                let mut seg = ShmMap::create(&name, spec.bytes);
                if filled {
                    seg.bytes_mut().copy_from_slice(&golden_fill(spec.bytes, t));
                }
                (name, seg)
            })
            .unzip()
    };
    let raw = |names: &[String]| -> Vec<V> {
        names
            .iter()
            .zip(&tensors)
            .map(|(n, t)| {
                let t = RawTensor {
                    alloc_offset: 0,
                    nbytes: t.bytes,
                    dtype: &t.dtype,
                    shape: t.shape.clone(),
                    stride: t.stride.clone(),
                };
                cuda_raw_of(n, &t, GPU_UUID)
            })
            .collect()
    };
    let cpu = |names: &[String]| -> Vec<V> {
        names
            .iter()
            .zip(&tensors)
            .map(|(n, t)| {
                cpu_shm_wrapper(
                    &format!("/{n}"),
                    t.bytes as i64,
                    &t.dtype,
                    &t.shape,
                    &t.stride,
                )
            })
            .collect()
    };
    let (src_names, _src) = segments("kvt_gsrc", true);
    register(&mut c, 400, raw(&src_names));
    let meta = &srv.get_json("/status")["cache_context_meta"]["400"]["kv_cache_layout"];
    let want_groups = case["kernel_groups"].as_array().unwrap();
    let got_groups = meta["kernel_groups"].as_array().expect("kernel groups");
    assert_eq!(got_groups.len(), want_groups.len(), "{name}: {meta}");
    for (k, want) in got_groups.iter().zip(want_groups) {
        assert_eq!(k["layer_indices"], want["layers"], "{name}: {meta}");
        assert_eq!(
            k["engine_kv_format"], want["engine_kv_format"],
            "{name}: {meta}"
        );
    }
    let object_groups = meta["object_groups"]
        .as_array()
        .expect("object groups")
        .len();

    // The GPU worker stores, then a CPU worker of the same layout stores
    // the same bytes under other tokens: the fs L2 then holds 0.5.6's
    // objects twice.
    let chunks = case["num_chunks"].as_u64().unwrap() as usize;
    let toks = ed_tokens(40, chunks * CS);
    let store = &case["store"];
    let (cpu_src_names, _cpu_src) = segments("kvt_gcsrc", true);
    register(&mut c, 403, cpu(&cpu_src_names));
    for (iid, seed, event) in [(400, 40, vec![7; 64]), (403, 41, vec![])] {
        let rid = format!("gstore{iid}");
        let (_, ok) = transfer_outcome(c.call(
            OP_STORE,
            &[
                key(&ed_tokens(seed, chunks * CS), Some(0), &rid),
                V::I(iid),
                block_lists(&store["block_ids"]),
                V::Bin(event),
            ],
        ));
        assert!(ok, "{name}: store from {iid}");
        assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
    }
    let want = golden_objects(case);
    let mut twice: Vec<Vec<u8>> = want.iter().flat_map(|o| [o.clone(), o.clone()]).collect();
    twice.sort();
    let got = l2_objects(&l2, twice.len());
    assert_eq!(got.len(), twice.len(), "{name}: objects in the fs L2");
    assert!(
        got == twice,
        "{name}: the stored objects differ from lmcache 0.5.6's gathers"
    );

    // Each RETRIEVE into zeroed memory of a GPU worker, then of a CPU
    // worker.
    for (r, retrieve) in case["retrieves"].as_array().unwrap().iter().enumerate() {
        let skip = retrieve["skip_first_n_tokens"].as_i64().unwrap();
        let want_sums: Vec<String> = retrieve["paged_sha256"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap().to_string())
            .collect();
        let (dst_names, dst) = segments("kvt_gdst", false);
        let (cpu_names, cpu_dst) = segments("kvt_gcpu", false);
        let (gpu_iid, cpu_iid) = (410 + 2 * r as i64, 411 + 2 * r as i64);
        register(&mut c, gpu_iid, raw(&dst_names));
        register(&mut c, cpu_iid, cpu(&cpu_names));
        for (iid, segs) in [(gpu_iid, &dst), (cpu_iid, &cpu_dst)] {
            let rid = format!("gr{iid}");
            assert_eq!(lookup(&mut c, &toks, &rid), chunks as i64, "{name}");
            let (_, ok) = transfer_outcome(c.call(
                OP_RETRIEVE,
                &[
                    key(&toks, Some(0), &rid),
                    V::I(iid),
                    block_lists(&retrieve["block_ids"]),
                    V::Bin(if iid == gpu_iid { vec![7; 64] } else { vec![] }),
                    V::I(skip),
                ],
            ));
            assert!(ok, "{name}: retrieve into {iid}");
            assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
            let sums: Vec<String> = segs.iter().map(|m| sha256_hex(m.bytes())).collect();
            assert_eq!(
                sums, want_sums,
                "{name}: instance {iid}'s tensors after a retrieve skipping {skip} tokens"
            );
        }
    }
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
    object_groups
}

// -- --isolated-ipc: timeline-semaphore events -------------------------------

/// Slots of a semaphore buffer, 8 bytes each (lmcache 0.5.6's).
const SEM_SLOTS: usize = 4096;

/// A timeline-semaphore event naming the shm segment that stands in for
/// the semaphore buffer's CUDA IPC handle.
fn shm_timeline_event(sem: &str, slot_offset: u64, seq: u64) -> Vec<u8> {
    timeline_event(format!("/{sem}").as_bytes(), slot_offset, seq)
}

/// An 81-byte event's (buffer name, slot offset, seq).
fn parse_shm_timeline(ev: &[u8]) -> (String, u64, u64) {
    let (handle, slot, seq) = parse_timeline(ev);
    let end = handle.iter().position(|&b| b == 0).unwrap_or(64);
    (
        String::from_utf8(handle[..end].to_vec()).unwrap(),
        slot,
        seq,
    )
}

fn slot_value(map: &ShmMap, slot_offset: u64) -> u64 {
    let at = slot_offset as usize;
    u64::from_le_bytes(map.bytes()[at..at + 8].try_into().unwrap())
}

fn set_slot(map: &mut ShmMap, slot_offset: u64, value: u64) {
    let at = slot_offset as usize;
    map.bytes_mut()[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

/// With `--isolated-ipc` (workers in containers that share no IPC
/// namespace), STORE and RETRIEVE carry lmcache 0.5.6's timeline-semaphore
/// events: the server copies only once the worker's semaphore slot has
/// reached the event's sequence, and answers with an 81-byte event of its
/// own semaphore buffer whose slot holds that event's sequence once the
/// copies are done. A CUDA IPC event handle is refused there, with the cause.
#[test]
fn isolated_ipc_transfers_wait_on_and_answer_timeline_semaphores() {
    let dir = std::env::temp_dir().join(unique("cuda-emu-iso"));
    std::fs::create_dir_all(&dir).unwrap();
    let srv = start(&dir, &["--isolated-ipc"]);
    assert_eq!(srv.get_json("/config")["isolated_ipc"], true);
    let mut c = srv.client();
    let mut gpu = Layers::new("kvt_iso", ALLOC_OFFSET, 3);
    let descs = gpu.names.iter().map(|n| cuda_raw(n, GPU_UUID)).collect();
    assert_eq!(
        c.call(OP_REGISTER_KV_CACHE, &register_frames(500, descs)),
        None
    );
    assert!(registered_gpu_ids(&srv).contains(&500));
    // The worker's semaphore buffer; its stream signals slot 1.
    let sem_name = unique("kvt_sem");
    let mut sem = ShmMap::create(&sem_name, SEM_SLOTS * 8);
    set_slot(&mut sem, 8, 5);

    let toks = ed_tokens(9, 3 * CS);
    let stored = gpu.blocks(&SRC);
    let (reply, ok) = transfer_outcome(c.call(
        OP_STORE,
        &[
            key(&toks, Some(0), "iso-s"),
            V::I(500),
            group_ids(&SRC),
            V::Bin(shm_timeline_event(&sem_name, 8, 5)),
        ],
    ));
    assert!(ok, "a store whose semaphore already reached its sequence");
    let (server_sem, slot, seq) = parse_shm_timeline(&reply);
    assert!(server_sem.starts_with('/'), "{server_sem}");
    assert!(
        slot > 0 && slot % 8 == 0 && (slot as usize) < SEM_SLOTS * 8,
        "{slot}"
    );
    let server = ShmMap::open(server_sem.trim_start_matches('/'), SEM_SLOTS * 8);
    assert!(
        slot_value(&server, slot) >= seq,
        "the server's slot reached its event"
    );
    assert_eq!(c.call(OP_END_SESSION, &[s("iso-s")]), None);

    // A retrieve whose sequence the worker reaches 300 ms later waits for it.
    gpu.fill(&DST, 0);
    assert_eq!(lookup(&mut c, &toks, "iso-r"), 3);
    let writer = {
        let name = sem_name.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            let mut m = ShmMap::open(&name, SEM_SLOTS * 8);
            set_slot(&mut m, 8, 6);
        })
    };
    let (reply, ok) = transfer_outcome(c.call(
        OP_RETRIEVE,
        &[
            key(&toks, Some(0), "iso-r"),
            V::I(500),
            group_ids(&DST),
            V::Bin(shm_timeline_event(&sem_name, 8, 6)),
            V::I(0),
        ],
    ));
    assert!(ok, "retrieve");
    assert_eq!(
        slot_value(&sem, 8),
        6,
        "the server answered before the worker's semaphore reached the event"
    );
    writer.join().unwrap();
    assert_eq!(gpu.blocks(&DST), stored, "retrieved after the wait");
    let (name2, slot2, seq2) = parse_shm_timeline(&reply);
    assert_eq!((name2, slot2), (server_sem, slot), "one slot per instance");
    assert_eq!(seq2, seq + 1, "each event a later sequence");
    assert!(slot_value(&server, slot) >= seq2);
    assert_eq!(c.call(OP_END_SESSION, &[s("iso-r")]), None);

    // A CUDA IPC event handle is refused under --isolated-ipc, with the cause.
    let (reply, ok) = transfer_outcome(c.call(
        OP_STORE,
        &[
            key(&ed_tokens(10, CS), Some(0), "iso-bad"),
            V::I(500),
            group_ids(&SRC[..BPC]),
            V::Bin(vec![7; 64]),
        ],
    ));
    assert_eq!((reply, ok), (vec![], false));
    let text = std::fs::read_to_string(dir.join("server.log")).unwrap();
    assert!(
        text.contains("64 bytes is a CUDA IPC event handle")
            && text.contains("without --isolated-ipc"),
        "{text}"
    );
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}
