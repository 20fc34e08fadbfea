//! End to end on a real GPU: lmcache_driven workers over CUDA IPC
//! (`--cuda-transfer on`, the default) against the real binary, through the real device
//! path: the driver's IPC imports, the NVRTC kernel, the pinned L1 and the
//! events the server exports.
//!
//! The workers here are plain CUDA programs: this test process allocates
//! device memory with the driver API and shares it with `cuIpcGetMemHandle`
//! (the `cuda_raw` descriptor), and, where a Python with a CUDA-enabled torch
//! is found (`KVSHARD_TEST_PYTHON`, default `python3`), a torch process
//! shares its tensors' storages with `_share_cuda_()` (the `cuda`
//! descriptor, which is what lmcache 0.5.6 sends by default). The bytes are
//! checked against what was written, and against a CPU worker of the same
//! model reading the same chunks over the cpu_shm path, whose objects match
//! lmcache 0.5.6 byte for byte.
//!
//! Where there is no GPU (CI has none) each test prints why and passes;
//! `tools/gpu/selftest.sh` runs them on a GPU host. A GPU host without NVRTC
//! skips them too, naming what was looked for.

mod support;

use std::ffi::c_void;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use cudarc::driver::sys;
use kvshard_gds::cuda::CudaEnv;
use kvshard_gds::device::Device;
use support::*;

const CS: usize = 16; // --chunk-size in Server::start
const BS: usize = 4;
const BPC: usize = CS / BS;
const NB: usize = 256;
const NL: usize = 4;
const NH: usize = 8;
const HS: usize = 128;
const MLA_DIM: usize = 576;
const ES: usize = 2; // bfloat16
const MODEL: &str = "gpu-e2e";
/// Where layer 0 starts in a worker's one allocation; every layer of a
/// worker shares that allocation's IPC handle, at its own offset.
const ALLOC_OFFSET: usize = 8192;

/// A layer of this file's sizes, in each layout the workers register.
type Kind = PagedKv;
const NHD: Kind = PagedKv {
    layout: Layout::Nhd,
    blocks: NB,
    block_tokens: BS,
    heads: NH,
    head_size: HS,
    mla_dim: MLA_DIM,
    elem: ES,
};
const HND: Kind = NHD.with(Layout::Hnd);
const MLA: Kind = NHD.with(Layout::Mla);

impl PagedKv {
    fn metadata(self, uuid: &str) -> V {
        let (shape, stride) = self.shape_stride();
        map(&[
            ("dtype", s("bfloat16")),
            ("shape", V::A(shape.into_iter().map(V::I).collect())),
            ("stride", V::A(stride.into_iter().map(V::I).collect())),
            ("storage_offset", V::I(0)),
            ("device_uuid", s(uuid)),
        ])
    }
}

// ------------------------------------------------------------ the driver side

fn ck(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call} failed");
}

/// This process's CUDA context on GPU 0, or why the test cannot run here.
struct Gpu {
    _device: Device,
    uuid: String,
}

fn gpu(test: &str) -> Option<Gpu> {
    let env = match CudaEnv::probe() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("{test}: skipped: no GPU here ({e})");
            return None;
        }
    };
    let Some(info) = env.devices.iter().find(|d| d.ordinal == 0) else {
        eprintln!("{test}: skipped: the CUDA driver lists no device");
        return None;
    };
    if let Err(e) = kvshard_gds::nvrtc::Nvrtc::load() {
        eprintln!(
            "{test}: skipped: a GPU but no NVRTC, which the server needs for its kernel ({e})"
        );
        return None;
    }
    let device = Device::open(&env, 0).expect("open GPU 0");
    Some(Gpu {
        _device: device,
        uuid: info.uuid.clone(),
    })
}

/// One device allocation of this process, zeroed.
struct DevMem {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DevMem {
    fn alloc(len: usize) -> DevMem {
        let mut ptr = 0;
        // SAFETY: a live out-pointer; the context is current (see `gpu`).
        ck("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) });
        // SAFETY: `ptr` owns `len` bytes.
        ck("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, len) });
        DevMem { ptr, len }
    }

    fn write(&self, at: usize, bytes: &[u8]) {
        assert!(at + bytes.len() <= self.len);
        // SAFETY: in bounds (above); the source is a live slice.
        ck("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + at as u64,
                bytes.as_ptr() as *const c_void,
                bytes.len(),
            )
        });
    }

    fn read(&self, at: usize, len: usize) -> Vec<u8> {
        assert!(at + len <= self.len);
        let mut out = vec![0u8; len];
        // SAFETY: in bounds (above); the destination is a live buffer.
        ck("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, self.ptr + at as u64, len)
        });
        out
    }

    fn ipc_handle(&self) -> Vec<u8> {
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `ptr` is the base of a cuMemAlloc allocation.
        ck("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, self.ptr)
        });
        h.reserved.iter().map(|&b| b as u8).collect()
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc and freed once.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// An interprocess event recorded after everything this process queued on
/// the legacy stream, and its IPC handle: what a worker sends with STORE and
/// RETRIEVE.
fn worker_event() -> (sys::CUevent, Vec<u8>) {
    let mut ev = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: live out-pointers; the event is destroyed by the caller.
    unsafe {
        ck("cuEventCreate", sys::cuEventCreate(&mut ev, flags));
        ck(
            "cuEventRecord",
            sys::cuEventRecord(ev, std::ptr::null_mut()),
        );
        let mut h = sys::CUipcEventHandle_st { reserved: [0; 64] };
        ck("cuIpcGetEventHandle", sys::cuIpcGetEventHandle(&mut h, ev));
        (ev, h.reserved.iter().map(|&b| b as u8).collect())
    }
}

fn destroy_event(ev: sys::CUevent) {
    // SAFETY: created by cuEventCreate/cuIpcOpenEventHandle, destroyed once.
    unsafe { sys::cuEventDestroy_v2(ev) };
}

/// Waits for an event the server exported, as the worker does before it
/// touches the blocks of a finished STORE or RETRIEVE.
fn wait_server_event(handle: &[u8]) {
    assert_eq!(handle.len(), 64, "the server's event is a CUDA IPC handle");
    let mut h = sys::CUipcEventHandle_st { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(handle) {
        *d = *s as _;
    }
    let mut ev = std::ptr::null_mut();
    // SAFETY: a live out-pointer; the handle is 64 bytes from the server.
    unsafe {
        ck(
            "cuIpcOpenEventHandle",
            sys::cuIpcOpenEventHandle(&mut ev, h),
        );
        ck("cuEventSynchronize", sys::cuEventSynchronize(ev));
    }
    destroy_event(ev);
}

// ------------------------------------------------------------------ workers

/// How a worker's KV memory is read, written and shared.
trait KvMemory {
    fn kind(&self) -> Kind;
    fn read_layer(&mut self, layer: usize) -> Vec<u8>;
    fn write_block(&mut self, layer: usize, at: usize, bytes: &[u8]);
    /// The descriptors of REGISTER_KV_CACHE, one per layer.
    fn descriptors(&mut self) -> Vec<V>;
    /// An event recorded after this worker's writes, as (IPC handle, keep).
    fn event(&mut self) -> Vec<u8>;
    fn wait(&mut self, server_event: &[u8]);
    fn flush(&mut self) {}
}

/// A CUDA program's KV cache: one allocation holding every layer.
struct RawMemory {
    kind: Kind,
    mem: DevMem,
    offsets: Vec<usize>,
    uuid: String,
    events: Vec<sys::CUevent>,
}

impl RawMemory {
    fn new(kind: Kind, seed: u64, uuid: &str) -> RawMemory {
        let padded = kind.layer_bytes().next_multiple_of(1 << 20) + 4096;
        let offsets: Vec<usize> = (0..NL).map(|l| ALLOC_OFFSET + l * padded).collect();
        let mem = DevMem::alloc(ALLOC_OFFSET + NL * padded);
        for (l, &at) in offsets.iter().enumerate() {
            mem.write(at, &pattern(seed * 1000 + l as u64, kind.layer_bytes()));
        }
        RawMemory {
            kind,
            mem,
            offsets,
            uuid: uuid.to_string(),
            events: Vec::new(),
        }
    }
}

impl KvMemory for RawMemory {
    fn kind(&self) -> Kind {
        self.kind
    }

    fn read_layer(&mut self, layer: usize) -> Vec<u8> {
        self.mem.read(self.offsets[layer], self.kind.layer_bytes())
    }

    fn write_block(&mut self, layer: usize, at: usize, bytes: &[u8]) {
        self.mem.write(self.offsets[layer] + at, bytes);
    }

    fn descriptors(&mut self) -> Vec<V> {
        let handle = self.mem.ipc_handle();
        self.offsets
            .iter()
            .map(|&at| {
                let inner = map(&[
                    ("type", s("cuda_raw")),
                    ("ipc_handle", V::Bin(handle.clone())),
                    ("alloc_offset", V::I(at as i64)),
                    ("nbytes", V::I(self.kind.layer_bytes() as i64)),
                    ("version", V::I(1)),
                    ("metadata", self.kind.metadata(&self.uuid)),
                ]);
                V::Ext(1, enc(&inner))
            })
            .collect()
    }

    fn event(&mut self) -> Vec<u8> {
        let (ev, handle) = worker_event();
        self.events.push(ev);
        handle
    }

    fn wait(&mut self, server_event: &[u8]) {
        wait_server_event(server_event);
    }
}

impl Drop for RawMemory {
    fn drop(&mut self) {
        for ev in self.events.drain(..) {
            destroy_event(ev);
        }
    }
}

/// The worker's view of the protocol over any [`KvMemory`].
struct Worker<M: KvMemory> {
    iid: i64,
    ws: i64,
    rank: i64,
    mem: M,
}

fn key(ws: i64, worker: Option<i64>, toks: &[u32], rid: &str, readers: i64) -> V {
    ipc_key(MODEL, ws, worker, toks, 0, toks.len() as i64, rid, readers)
}

fn lookup(c: &mut Client, ws: i64, toks: &[u32], rid: &str, readers: i64) -> i64 {
    assert_eq!(
        c.call(OP_LOOKUP, &[key(ws, None, toks, rid, readers), V::I(1)]),
        None
    );
    c.prefetch_result(rid)
}

impl<M: KvMemory> Worker<M> {
    fn register(&mut self, srv: &Server, c: &mut Client) {
        let frames = register_kv_cache_frames(
            self.iid,
            self.mem.descriptors(),
            MODEL,
            self.ws,
            self.mem.kind().hint(),
            vec![kv_group(NL, BS)],
        );
        assert_eq!(c.call(OP_REGISTER_KV_CACHE, &frames), None);
        // Answered once the device thread has set the instance up (the
        // first one pins the L1): the worker's next STORE finds it.
        let iid = self.iid;
        if let Some(reason) = refused_gpu_reason(srv, iid) {
            panic!("instance {iid} was refused: {reason}");
        }
        assert!(
            registered_gpu_ids(srv).contains(&iid),
            "REGISTER_KV_CACHE of instance {iid} answered before it was set up"
        );
    }

    fn snapshot(&mut self) -> Vec<Vec<u8>> {
        (0..NL).map(|l| self.mem.read_layer(l)).collect()
    }

    fn fill_blocks(&mut self, blocks: &[i64], byte: u8) {
        let kind = self.mem.kind();
        let fill = vec![byte; kind.block()];
        for l in 0..NL {
            for plane in 0..kind.planes() {
                for &b in blocks {
                    let at = (plane * NB + b as usize) * kind.block();
                    self.mem.write_block(l, at, &fill);
                }
            }
        }
        self.mem.flush();
    }

    fn store(&mut self, c: &mut Client, toks: &[u32], rid: &str, blocks: &[i64]) -> bool {
        let event = self.mem.event();
        let k = key(self.ws, Some(self.rank), toks, rid, 1);
        let (ev, ok) = transfer_outcome(c.call(
            OP_STORE,
            &[k, V::I(self.iid), group_ids(blocks), V::Bin(event)],
        ));
        if ok {
            self.mem.wait(&ev);
        } else {
            assert!(ev.is_empty(), "a failed store has no event");
        }
        ok
    }

    fn retrieve(
        &mut self,
        c: &mut Client,
        toks: &[u32],
        rid: &str,
        blocks: &[i64],
        skip: usize,
    ) -> bool {
        let event = self.mem.event();
        let k = key(self.ws, Some(self.rank), toks, rid, 1);
        let (ev, ok) = transfer_outcome(c.call(
            OP_RETRIEVE,
            &[
                k,
                V::I(self.iid),
                group_ids(blocks),
                V::Bin(event),
                V::I(skip as i64),
            ],
        ));
        if ok {
            self.mem.wait(&ev);
        }
        ok
    }
}

/// What a worker's cache must hold after a retrieve: `before`, with block
/// `dst[i]` replaced by the stored block `src[i]` for every list position
/// from `skip_blocks` on.
fn scattered(
    kind: Kind,
    before: &[Vec<u8>],
    stored: &[Vec<u8>],
    src: &[i64],
    dst: &[i64],
    skip_blocks: usize,
) -> Vec<Vec<u8>> {
    let mut out = before.to_vec();
    let bb = kind.block();
    for l in 0..NL {
        for plane in 0..kind.planes() {
            for i in skip_blocks..dst.len() {
                let s = (plane * NB + src[i] as usize) * bb;
                let d = (plane * NB + dst[i] as usize) * bb;
                out[l][d..d + bb].copy_from_slice(&stored[l][s..s + bb]);
            }
        }
    }
    out
}

fn assert_cache_eq(got: &[Vec<u8>], want: &[Vec<u8>], what: &str) {
    for (l, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            let first = g.iter().zip(w).position(|(a, b)| a != b).unwrap();
            panic!("{what}: layer {l} differs first at byte {first}");
        }
    }
}

/// Block ids `1 + (start + i * step) mod (NB - 1)`: `n` distinct ids when
/// `step` is coprime to NB - 1 (255), never block 0, vLLM's null block,
/// which a retrieve does not write (as in 0.5.6).
fn spread(n: usize, start: usize, step: usize) -> Vec<i64> {
    (0..n)
        .map(|i| (1 + (start + i * step) % (NB - 1)) as i64)
        .collect()
}

/// The server on its defaults, where `--cuda-transfer` is on.
fn start(dir: &std::path::Path) -> Server {
    Server::start_logged_env(&[], &dir.join("server.log"), &[])
}

fn test_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(unique(name));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One worker stores `chunks` chunks, its blocks are cleared, and it reads
/// them back into other blocks, whole and with a partial first block
/// skipped; then the same chunks are read by a CPU worker of the model.
/// Returns the `/cache/checksums` digests of the blocks it read the chunks
/// into whole, read back from the GPU.
fn round_trip<M: KvMemory>(
    srv: &Server,
    c: &mut Client,
    w: &mut Worker<M>,
    seed: u32,
    chunks: usize,
) -> serde_json::Value {
    let kind = w.mem.kind();
    let n = chunks * BPC;
    let src = spread(n, 0, 7);
    let dst = spread(n, 3, 13);
    let toks = ed_tokens(seed, chunks * CS);
    let stored = w.snapshot();
    assert!(w.store(c, &toks, &format!("s{seed}"), &src), "store");
    assert_eq!(c.call(OP_END_SESSION, &[s(&format!("s{seed}"))]), None);
    w.fill_blocks(&src, 0);
    w.fill_blocks(&dst, 0);
    let before = w.snapshot();

    // Answered after the commit: the very next lookup sees every chunk.
    let rid = format!("r{seed}");
    assert_eq!(lookup(c, w.ws, &toks, &rid, 1), chunks as i64);
    assert!(w.retrieve(c, &toks, &rid, &dst, 0), "retrieve");
    let want = scattered(kind, &before, &stored, &src, &dst, 0);
    assert_cache_eq(
        &w.snapshot(),
        &want,
        "retrieved blocks equal the stored ones",
    );
    assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
    let sums = srv.checksums(w.iid, &dst, BPC, false)["chunk_checksums"].clone();

    // skip_first_n_tokens = BS + 1: the first block is left alone and the
    // partially skipped second block is rewritten whole, as in 0.5.6.
    w.fill_blocks(&dst, 0x5a);
    let before = w.snapshot();
    let rid = format!("k{seed}");
    assert_eq!(lookup(c, w.ws, &toks, &rid, 1), chunks as i64);
    assert!(
        w.retrieve(c, &toks, &rid, &dst, BS + 1),
        "retrieve with a skip"
    );
    let want = scattered(kind, &before, &stored, &src, &dst, 1);
    assert_cache_eq(&w.snapshot(), &want, "a skipped retrieve");
    assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
    assert_eq!(srv.l1_count("read_locked_count"), 0, "locks released");
    sums
}

/// A CPU worker of the same model and layout reads chunks a GPU worker
/// stored: the GPU path's objects have the cpu_shm path's (0.5.6's) layout,
/// and its blocks' checksums are the `gpu_sums` the GPU worker's gave.
fn cpu_reads_gpu_chunks(
    srv: &Server,
    c: &mut Client,
    kind: Kind,
    stored: &[Vec<u8>],
    seed: u32,
    chunks: usize,
    gpu_sums: &serde_json::Value,
) {
    let n = chunks * BPC;
    let src = spread(n, 0, 7);
    let dst = spread(n, 1, 29);
    let toks = ed_tokens(seed, chunks * CS);
    let (shape, stride) = kind.shape_stride();
    let mut segs = Vec::new();
    let mut descs = Vec::new();
    for _ in 0..NL {
        let name = unique("kvgpu_cpu");
        let seg = ShmMap::create(&name, kind.layer_bytes());
        descs.push(cpu_shm_wrapper(
            &format!("/{name}"),
            kind.layer_bytes() as i64,
            "bfloat16",
            &shape,
            &stride,
        ));
        segs.push(seg);
    }
    let iid = 900 + seed as i64;
    let frames =
        register_kv_cache_frames(iid, descs, MODEL, 1, kind.hint(), vec![kv_group(NL, BS)]);
    assert_eq!(c.call(OP_REGISTER_KV_CACHE, &frames), None);
    let rid = format!("cpu{seed}");
    assert_eq!(lookup(c, 1, &toks, &rid, 1), chunks as i64);
    let (ev, ok) = transfer_outcome(c.call(
        OP_RETRIEVE,
        &[
            key(1, Some(0), &toks, &rid, 1),
            V::I(iid),
            group_ids(&dst),
            V::Bin(vec![]),
            V::I(0),
        ],
    ));
    assert!(ok && ev.is_empty(), "cpu_shm retrieve");
    let before: Vec<Vec<u8>> = (0..NL).map(|_| vec![0u8; kind.layer_bytes()]).collect();
    let want = scattered(kind, &before, stored, &src, &dst, 0);
    let got: Vec<Vec<u8>> = segs.iter().map(|s| s.bytes().to_vec()).collect();
    assert_cache_eq(&got, &want, "the CPU worker gets the GPU worker's bytes");
    assert_eq!(
        srv.checksums(iid, &dst, BPC, false)["chunk_checksums"],
        *gpu_sums,
        "checksums of the same bytes read back from the GPU and from shm"
    );
    assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(iid)]), None);
}

#[test]
fn raw_cuda_workers_round_trip_every_layout() {
    let Some(g) = gpu("raw_cuda_workers_round_trip_every_layout") else {
        return;
    };
    let dir = test_dir("cuda-gpu-raw");
    let srv = start(&dir);
    let mut c = srv.client();
    for (i, kind) in [NHD, HND, MLA].into_iter().enumerate() {
        let seed = 10 + i as u32;
        let mut w = Worker {
            iid: 300 + i as i64,
            ws: 1,
            rank: 0,
            mem: RawMemory::new(kind, seed as u64, &g.uuid),
        };
        w.register(&srv, &mut c);
        let stored = w.snapshot();
        // 40 chunks: ten batches of the device thread's four.
        let sums = round_trip(&srv, &mut c, &mut w, seed, 40);
        cpu_reads_gpu_chunks(&srv, &mut c, kind, &stored, seed, 40, &sums);
        assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(w.iid)]), None);
        assert!(!registered_gpu_ids(&srv).contains(&w.iid));
        // Its transfers then fail cleanly, with no event.
        let toks = ed_tokens(seed, CS);
        assert!(!w.store(&mut c, &toks, "gone", &spread(BPC, 0, 1)));
    }
    let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    eprintln!("server log:\n{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tp2_ranks_and_mla_readers_share_one_gpu() {
    let Some(g) = gpu("tp2_ranks_and_mla_readers_share_one_gpu") else {
        return;
    };
    let dir = test_dir("cuda-gpu-tp2");
    let srv = start(&dir);
    let mut c = srv.client();

    // TP 2: each rank stores its own half; each gets its own back.
    let mut ranks: Vec<Worker<RawMemory>> = (0..2)
        .map(|r| Worker {
            iid: 400 + r,
            ws: 2,
            rank: r,
            mem: RawMemory::new(NHD, 40 + r as u64, &g.uuid),
        })
        .collect();
    for w in &mut ranks {
        w.register(&srv, &mut c);
    }
    let toks = ed_tokens(40, 8 * CS);
    let src = spread(8 * BPC, 0, 7);
    let dst = spread(8 * BPC, 5, 11);
    let stored: Vec<_> = ranks.iter_mut().map(|w| w.snapshot()).collect();
    for w in &mut ranks {
        assert!(
            w.store(&mut c, &toks, "tp-s", &src),
            "rank {} store",
            w.rank
        );
    }
    for w in &mut ranks {
        w.fill_blocks(&dst, 0);
    }
    assert_eq!(lookup(&mut c, 2, &toks, "tp-r", 1), 8);
    for (w, stored) in ranks.iter_mut().zip(&stored) {
        let before = w.snapshot();
        assert!(
            w.retrieve(&mut c, &toks, "tp-r", &dst, 0),
            "rank {}",
            w.rank
        );
        let want = scattered(NHD, &before, stored, &src, &dst, 0);
        assert_cache_eq(
            &w.snapshot(),
            &want,
            &format!("rank {} reads its own", w.rank),
        );
    }
    assert_eq!(c.call(OP_END_SESSION, &[s("tp-r")]), None);

    // MLA at TP 2: ranks share one kv_rank, so only the writer stores and
    // both read it.
    let mut writer = Worker {
        iid: 410,
        ws: 1,
        rank: 0,
        mem: RawMemory::new(MLA, 50, &g.uuid),
    };
    let mut reader = Worker {
        iid: 411,
        ws: 1,
        rank: 0,
        mem: RawMemory::new(MLA, 51, &g.uuid),
    };
    writer.register(&srv, &mut c);
    reader.register(&srv, &mut c);
    let toks = ed_tokens(50, 4 * CS);
    let src = spread(4 * BPC, 0, 7);
    let dst = spread(4 * BPC, 9, 19);
    let stored = writer.snapshot();
    assert!(writer.store(&mut c, &toks, "mla-s", &src));
    writer.fill_blocks(&dst, 0);
    let (bw, br) = (writer.snapshot(), reader.snapshot());
    assert_eq!(lookup(&mut c, 1, &toks, "mla-r", 2), 4);
    assert!(writer.retrieve(&mut c, &toks, "mla-r", &dst, 0));
    assert!(reader.retrieve(&mut c, &toks, "mla-r", &dst, 0));
    let want_w = scattered(MLA, &bw, &stored, &src, &dst, 0);
    let want_r = scattered(MLA, &br, &stored, &src, &dst, 0);
    assert_cache_eq(&writer.snapshot(), &want_w, "the MLA writer reads back");
    assert_cache_eq(
        &reader.snapshot(),
        &want_r,
        "the MLA reader gets the writer's KV",
    );
    assert_eq!(srv.l1_count("read_locked_count"), 0, "both locks released");
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------------- a torch worker

/// A Python process holding torch tensors on GPU 0, driven line by line.
const TORCH_WORKER: &str = r#"
import json, sys, torch
cfg = json.loads(sys.argv[1])
torch.cuda.set_device(0)
shape = cfg["shape"]
layers = []
for path in cfg["files"]:
    data = bytearray(open(path, "rb").read())
    t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    t.copy_(torch.frombuffer(data, dtype=torch.bfloat16).view(shape))
    layers.append(t)
torch.cuda.synchronize()
out = []
for t in layers:
    st = t.untyped_storage()
    dev, handle, size, off, ref, ref_off, ev, sync = st._share_cuda_()
    hx = lambda b: None if b is None else bytes(b).hex()
    out.append({"device": dev, "handle": hx(handle), "size": size, "offset": off,
                "ref": hx(ref), "ref_offset": ref_off, "event": hx(ev), "sync": bool(sync),
                "storage_offset": t.storage_offset()})
props = torch.cuda.get_device_properties(0)
print(json.dumps({"torch": torch.__version__, "uuid": str(props.uuid), "layers": out}), flush=True)
keep = []
while True:
    line = sys.stdin.readline()
    if not line:
        break
    cmd = line.split()
    if not cmd:
        continue
    if cmd[0] == "event":
        e = torch.cuda.Event(interprocess=True)
        e.record()
        keep.append(e)
        print(bytes(e.ipc_handle()).hex(), flush=True)
    elif cmd[0] == "wait":
        e = torch.cuda.Event.from_ipc_handle(0, bytes.fromhex(cmd[1]))
        e.synchronize()
        print("ok", flush=True)
    elif cmd[0] == "fill":
        layer, at, n, byte = (int(x) for x in cmd[1:5])
        layers[layer].view(torch.uint8).view(-1)[at:at + n].fill_(byte)
        print("ok", flush=True)
    elif cmd[0] == "sync":
        torch.cuda.synchronize()
        print("ok", flush=True)
    elif cmd[0] == "dump":
        torch.cuda.synchronize()
        with open(cmd[2], "wb") as f:
            f.write(layers[int(cmd[1])].view(torch.uint8).cpu().numpy().tobytes())
        print("ok", flush=True)
    elif cmd[0] == "quit":
        break
"#;

struct TorchMemory {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    info: serde_json::Value,
    dir: std::path::PathBuf,
}

impl TorchMemory {
    /// Starts the torch worker with NHD layers of `pattern(seed..)`, or
    /// `None` (printed) where no CUDA-enabled torch is found.
    fn start(test: &str, dir: &std::path::Path, seed: u64) -> Option<TorchMemory> {
        let python = std::env::var("KVSHARD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let probe = Command::new(&python)
            .args([
                "-c",
                "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
            ])
            .output();
        if !matches!(&probe, Ok(o) if o.status.success()) {
            eprintln!("{test}: skipped: {python} has no CUDA-enabled torch");
            return None;
        }
        let files: Vec<String> = (0..NL)
            .map(|l| {
                let path = dir.join(format!("layer{l}.bin"));
                std::fs::write(&path, pattern(seed * 1000 + l as u64, NHD.layer_bytes())).unwrap();
                path.to_string_lossy().into_owned()
            })
            .collect();
        let cfg = serde_json::json!({ "shape": NHD.shape_stride().0, "files": files });
        let mut child = Command::new(&python)
            .args(["-c", TORCH_WORKER, &cfg.to_string()])
            .env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the torch worker");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let info: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the torch worker's first line {line:?}: {e}"));
        eprintln!("{test}: torch worker: {info}");
        Some(TorchMemory {
            child,
            stdin,
            stdout,
            info,
            dir: dir.to_path_buf(),
        })
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "the torch worker exited at {cmd:?}");
        line.trim().to_string()
    }
}

fn hex_bytes(v: &serde_json::Value) -> V {
    match v.as_str() {
        None => V::Nil,
        Some(h) => V::Bin(
            (0..h.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
                .collect(),
        ),
    }
}

impl KvMemory for TorchMemory {
    fn kind(&self) -> Kind {
        NHD
    }

    fn read_layer(&mut self, layer: usize) -> Vec<u8> {
        let path = self.dir.join(format!("dump{layer}.bin"));
        assert_eq!(self.ask(&format!("dump {layer} {}", path.display())), "ok");
        std::fs::read(&path).unwrap()
    }

    fn write_block(&mut self, layer: usize, at: usize, bytes: &[u8]) {
        let byte = bytes[0];
        assert!(
            bytes.iter().all(|&b| b == byte),
            "the torch worker fills only"
        );
        let reply = self.ask(&format!("fill {layer} {at} {} {byte}", bytes.len()));
        assert_eq!(reply, "ok");
    }

    fn flush(&mut self) {
        assert_eq!(self.ask("sync"), "ok");
    }

    fn descriptors(&mut self) -> Vec<V> {
        let uuid = self.info["uuid"].as_str().unwrap().to_string();
        let layers = self.info["layers"].as_array().unwrap().clone();
        layers
            .iter()
            .map(|l| {
                let handle = V::A(vec![
                    V::I(l["device"].as_i64().unwrap()),
                    hex_bytes(&l["handle"]),
                    V::I(l["size"].as_i64().unwrap()),
                    V::I(l["offset"].as_i64().unwrap()),
                    hex_bytes(&l["ref"]),
                    V::I(l["ref_offset"].as_i64().unwrap()),
                    hex_bytes(&l["event"]),
                    V::B(l["sync"].as_bool().unwrap()),
                ]);
                let mut meta = NHD.metadata(&uuid);
                if let V::M(pairs) = &mut meta {
                    for (k, v) in pairs.iter_mut() {
                        if *k == s("storage_offset") {
                            *v = V::I(l["storage_offset"].as_i64().unwrap());
                        }
                    }
                }
                let inner = map(&[
                    ("type", s("cuda")),
                    ("handle", handle),
                    ("version", V::I(1)),
                    ("metadata", meta),
                ]);
                V::Ext(1, enc(&inner))
            })
            .collect()
    }

    fn event(&mut self) -> Vec<u8> {
        match hex_bytes(&serde_json::Value::String(self.ask("event"))) {
            V::Bin(b) => b,
            _ => unreachable!(),
        }
    }

    fn wait(&mut self, server_event: &[u8]) {
        let hex: String = server_event.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(self.ask(&format!("wait {hex}")), "ok");
    }
}

impl Drop for TorchMemory {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

#[test]
fn torch_storage_worker_round_trips() {
    let Some(_g) = gpu("torch_storage_worker_round_trips") else {
        return;
    };
    let dir = test_dir("cuda-gpu-torch");
    let Some(mem) = TorchMemory::start("torch_storage_worker_round_trips", &dir, 60) else {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    };
    let srv = start(&dir);
    let mut c = srv.client();
    let mut w = Worker {
        iid: 500,
        ws: 1,
        rank: 0,
        mem,
    };
    w.register(&srv, &mut c);
    let stored = w.snapshot();
    let sums = round_trip(&srv, &mut c, &mut w, 60, 12);
    cpu_reads_gpu_chunks(&srv, &mut c, NHD, &stored, 60, 12, &sums);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(500)]), None);
    drop(w);
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------------------ hybrid caches

/// The hybrid layouts of lmcache 0.5.6's own multi-group gathers (see
/// `support::group_golden`), through a real GPU: a CUDA worker whose tensors
/// each have an allocation of their own stores every case's chunks, whose
/// objects in an fs L2 must be 0.5.6's byte for byte, and retrieves them
/// with each of the case's skips into zeroed device memory, which must then
/// hold what 0.5.6's scatter leaves.
#[test]
fn hybrid_raw_cuda_workers_move_the_0_5_6_objects() {
    const TEST: &str = "hybrid_raw_cuda_workers_move_the_0_5_6_objects";
    let Some(g) = gpu(TEST) else { return };
    for case in group_golden_cases() {
        replay_group_case_on(&g, &case);
    }
}

/// `--separate-object-groups` on the GPU: lmcache 0.5.6's objects (one per
/// chunk and object group) and retrieves (windows' last chunks only).
#[test]
fn separate_object_groups_on_the_gpu_move_the_0_5_6_objects() {
    const TEST: &str = "separate_object_groups_on_the_gpu_move_the_0_5_6_objects";
    let Some(g) = gpu(TEST) else { return };
    for case in og_golden_cases() {
        replay_group_case_on(&g, &case);
    }
}

/// One multi-group golden case through a raw-CUDA worker: its store's
/// objects and each retrieve's tensors must be 0.5.6's (the cases of
/// `golden_og_gather.json` under `--separate-object-groups`).
fn replay_group_case_on(g: &Gpu, case: &serde_json::Value) {
    let name = case["name"].as_str().unwrap();
    assert_eq!(
        case["chunk_size"], CS as u64,
        "{name}: the server's chunk size"
    );
    let dir = test_dir("cuda-gpu-groups");
    let l2 = dir.join("l2");
    std::fs::create_dir_all(&l2).unwrap();
    let args = golden_server_args(&l2, case);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let srv = Server::start_logged_env(&args, &dir.join("server.log"), &[]);
    let mut c = srv.client();
    let tensors = golden_tensors(case);
    let groups = golden_group_infos(case);
    let hint = case["layout_hint"].as_str().unwrap();
    let alloc = |filled: bool| -> Vec<DevMem> {
        tensors
            .iter()
            .enumerate()
            .map(|(t, spec)| {
                let m = DevMem::alloc(spec.bytes);
                if filled {
                    m.write(0, &golden_fill(spec.bytes, t));
                }
                m
            })
            .collect()
    };
    let register = |c: &mut Client, iid: i64, mems: &[DevMem]| {
        let ints = |v: &[i64]| V::A(v.iter().map(|&x| V::I(x)).collect());
        let descs = mems
            .iter()
            .zip(&tensors)
            .map(|(m, t)| {
                let meta = map(&[
                    ("dtype", s(&t.dtype)),
                    ("shape", ints(&t.shape)),
                    ("stride", ints(&t.stride)),
                    ("storage_offset", V::I(0)),
                    ("device_uuid", s(&g.uuid)),
                ]);
                let inner = map(&[
                    ("type", s("cuda_raw")),
                    ("ipc_handle", V::Bin(m.ipc_handle())),
                    ("alloc_offset", V::I(0)),
                    ("nbytes", V::I(t.bytes as i64)),
                    ("version", V::I(1)),
                    ("metadata", meta),
                ]);
                V::Ext(1, enc(&inner))
            })
            .collect();
        let frames = register_kv_cache_frames(iid, descs, MODEL, 1, hint, groups.clone());
        assert_eq!(c.call(OP_REGISTER_KV_CACHE, &frames), None, "{name}");
        if let Some(reason) = refused_gpu_reason(&srv, iid) {
            panic!("{name}: instance {iid} was refused: {reason}");
        }
        assert!(registered_gpu_ids(&srv).contains(&iid), "{name}: {iid}");
    };
    // Sends a transfer with this process's event; waits for the server's.
    let transfer = |c: &mut Client, op: i64, frames: Vec<V>| -> bool {
        let (ev, handle) = worker_event();
        let mut frames = frames;
        frames.insert(3, V::Bin(handle));
        let (server_ev, ok) = transfer_outcome(c.call(op, &frames));
        if ok {
            wait_server_event(&server_ev);
        }
        destroy_event(ev);
        ok
    };

    let src = alloc(true);
    register(&mut c, 600, &src);
    let chunks = case["num_chunks"].as_u64().unwrap() as usize;
    let toks = ed_tokens(60, chunks * CS);
    let stored = transfer(
        &mut c,
        OP_STORE,
        vec![
            key(1, Some(0), &toks, "hs", 1),
            V::I(600),
            block_lists(&case["store"]["block_ids"]),
        ],
    );
    assert!(stored, "{name}: store");
    assert_eq!(c.call(OP_END_SESSION, &[s("hs")]), None);
    let want = golden_objects(case);
    let got = l2_objects(&l2, want.len());
    assert!(
        got == want,
        "{name}: the objects the GPU gathered differ from lmcache 0.5.6's ({} of {})",
        got.len(),
        want.len()
    );

    for (r, retrieve) in case["retrieves"].as_array().unwrap().iter().enumerate() {
        let iid = 610 + r as i64;
        let dst = alloc(false);
        register(&mut c, iid, &dst);
        let rid = format!("hr{iid}");
        assert_eq!(lookup(&mut c, 1, &toks, &rid, 1), chunks as i64, "{name}");
        let skip = retrieve["skip_first_n_tokens"].as_i64().unwrap();
        let ok = transfer(
            &mut c,
            OP_RETRIEVE,
            vec![
                key(1, Some(0), &toks, &rid, 1),
                V::I(iid),
                block_lists(&retrieve["block_ids"]),
                V::I(skip),
            ],
        );
        assert!(ok, "{name}: retrieve into {iid}");
        assert_eq!(c.call(OP_END_SESSION, &[s(&rid)]), None);
        let sums: Vec<String> = dst
            .iter()
            .zip(&tensors)
            .map(|(m, t)| sha256_hex(&m.read(0, t.bytes)))
            .collect();
        let want: Vec<String> = retrieve["paged_sha256"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            sums, want,
            "{name}: tensors after a retrieve skipping {skip} tokens"
        );
    }
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}

// -- --isolated-ipc: timeline semaphores in device memory --------------------

/// Slots of a semaphore buffer, 8 bytes each (lmcache 0.5.6's).
const SEM_SLOTS: usize = 4096;

/// Another process's device allocation, opened here by its IPC handle.
struct Imported {
    ptr: sys::CUdeviceptr,
}

impl Imported {
    fn open(handle: &[u8]) -> Imported {
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        let mut ptr = 0;
        // SAFETY: a live out-pointer; the handle is 64 bytes from the server.
        ck("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags)
        });
        Imported { ptr }
    }

    fn slot(&self, slot_offset: u64) -> u64 {
        let mut b = [0u8; 8];
        // SAFETY: the slot lies inside the server's semaphore buffer (the
        // test checks the offset first); the destination is a live array.
        ck("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(b.as_mut_ptr() as *mut c_void, self.ptr + slot_offset, 8)
        });
        u64::from_le_bytes(b)
    }

    /// Waits (up to 10 s) for the slot to reach `seq`, as the worker's
    /// stream would wait on it.
    fn wait(&self, slot_offset: u64, seq: u64) {
        let t0 = std::time::Instant::now();
        while self.slot(slot_offset) < seq {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "the server's slot at {slot_offset} never reached {seq}"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: opened by cuIpcOpenMemHandle_v2, closed once.
        unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

/// `--isolated-ipc` on the GPU: a worker's STORE and RETRIEVE carry
/// timeline-semaphore events of a semaphore buffer in its device memory
/// (shared by CUDA IPC memory handle); the server's stream waits
/// (`cuStreamWaitValue64`) until the worker's slot reaches the event's
/// sequence before it copies, and answers with an event of its own
/// semaphore buffer whose slot its stream sets (`cuStreamWriteValue64`) once
/// the copies are done. A CUDA IPC event handle is refused there.
#[test]
fn isolated_ipc_worker_waits_and_signals_through_device_semaphores() {
    const TEST: &str = "isolated_ipc_worker_waits_and_signals_through_device_semaphores";
    let Some(g) = gpu(TEST) else { return };
    let dir = test_dir("cuda-gpu-iso");
    let srv = Server::start_logged_env(&["--isolated-ipc"], &dir.join("server.log"), &[]);
    let mut c = srv.client();
    let mut w = Worker {
        iid: 720,
        ws: 1,
        rank: 0,
        mem: RawMemory::new(NHD, 72, &g.uuid),
    };
    w.register(&srv, &mut c);
    let sem = DevMem::alloc(SEM_SLOTS * 8);
    let handle = sem.ipc_handle();
    sem.write(8, &5u64.to_le_bytes());
    let chunks = 2;
    let toks = ed_tokens(72, chunks * CS);
    let src = spread(chunks * BPC, 0, 7);
    let dst = spread(chunks * BPC, 5, 11);
    let stored = w.snapshot();

    let k = key(1, Some(0), &toks, "iso-s", 1);
    let (reply, ok) = transfer_outcome(c.call(
        OP_STORE,
        &[
            k,
            V::I(720),
            group_ids(&src),
            V::Bin(timeline_event(&handle, 8, 5)),
        ],
    ));
    assert!(ok, "a store whose semaphore already reached its sequence");
    let (server_buf, slot, seq) = parse_timeline(&reply);
    assert!(slot % 8 == 0 && (slot as usize) < SEM_SLOTS * 8, "{slot}");
    let server = Imported::open(&server_buf);
    server.wait(slot, seq);
    assert_eq!(c.call(OP_END_SESSION, &[s("iso-s")]), None);

    // A retrieve whose sequence the worker reaches later: nothing is copied
    // until then.
    w.fill_blocks(&dst, 0);
    let before = w.snapshot();
    assert_eq!(lookup(&mut c, 1, &toks, "iso-r", 1), chunks as i64);
    let k = key(1, Some(0), &toks, "iso-r", 1);
    let mut frames = vec![enc(&V::I(OP_RETRIEVE))];
    for a in [
        k,
        V::I(720),
        group_ids(&dst),
        V::Bin(timeline_event(&handle, 8, 6)),
        V::I(0),
    ] {
        frames.push(enc(&a));
    }
    let uid = c.send_raw(frames);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        w.snapshot() == before,
        "the server copied before the worker's semaphore reached the event"
    );
    sem.write(8, &6u64.to_le_bytes());
    let (reply, ok) = transfer_outcome(c.recv(uid).payload);
    assert!(ok, "retrieve");
    let (buf2, slot2, seq2) = parse_timeline(&reply);
    assert_eq!((buf2, slot2), (server_buf, slot), "one slot per instance");
    assert_eq!(seq2, seq + 1, "each event a later sequence");
    server.wait(slot2, seq2);
    let want = scattered(NHD, &before, &stored, &src, &dst, 0);
    assert_cache_eq(&w.snapshot(), &want, "retrieved after the wait");
    assert_eq!(c.call(OP_END_SESSION, &[s("iso-r")]), None);

    // A CUDA IPC event handle is refused under --isolated-ipc.
    let (ev, cuda_handle) = worker_event();
    let k = key(1, Some(0), &toks, "iso-x", 1);
    let (reply, ok) = transfer_outcome(c.call(
        OP_STORE,
        &[k, V::I(720), group_ids(&src), V::Bin(cuda_handle)],
    ));
    destroy_event(ev);
    assert!(!ok && reply.is_empty(), "a 64-byte event is refused");
    drop(server);
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}
