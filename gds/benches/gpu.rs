//! Device copy throughput: the block-copy kernel path against plain
//! copies, on one GPU (`cargo bench -p kvshard-gds --bench gpu`).
//!
//! Layout: vLLM FlashAttention NHD (`NL_X_TWO_NB_BS_NH_HS`), bf16, 32
//! layers, blocks of 16 tokens, 8 heads of 128, chunks of 256 tokens
//! (16 blocks, 32 MiB per chunk object), 48 chunks (1.5 GiB) per pass, block
//! ids a fixed shuffle of the pool. Host memory is one anonymous mapping
//! registered as the server pins its L1: [`PinnedRegion`] with
//! `cuMemHostRegister` (`PORTABLE | DEVICEMAP`) in 64 MiB pieces, every copy
//! cut at the pieces by [`host_copy_parts`].
//!
//! Measured, median of [`TIMED_PASSES`] wall-clock passes (enqueue to
//! completion) after [`WARMUP_PASSES`]:
//! - baseline: `cuMemcpyDtoHAsync` / `cuMemcpyHtoDAsync` of the same bytes
//!   between one device buffer and the pinned arena, 64 MiB per copy;
//! - kernel gather / scatter: the device thread's transfer sequence
//!   (`enqueue` in device/worker.rs), rebuilt from the same public pieces:
//!   [`plan_batches`] into batches of 4 chunks, per batch the block ids
//!   uploaded from a host `Vec`, [`KernelModule::launch`] of the
//!   [`KernelLaunch`] into the temp slots, the slot <-> host copies, then a
//!   [`CompletionEvent`] recorded and waited on;
//! - kernel only: the same launches without host copies (device to device).
//!
//! The gathered chunks are checked against the page contents after the
//! gather passes and again after the scatter passes (which write the same
//! bytes back), so a wrong copy cannot pass as a fast one.
//!
//! Without a GPU it prints one line and exits 0. Without NVRTC it measures
//! the baseline and refuses the kernel part with the places it looked
//! (exit 0; 1 with `KVSHARD_REQUIRE_NVRTC=1`). `KVSHARD_GPU_BENCH_CHUNKS`
//! sets the chunks per pass; `--tiny` runs 2 chunks and 3 passes (a smoke
//! run). A watchdog aborts after [`WATCHDOG_SECONDS`].

use std::time::Instant;

use kvshard_gds::cuda::CudaEnv;
use kvshard_gds::device::exec::{CompletionEvent, DeviceBuffer, KernelModule, LaunchArgs, Stream};
use kvshard_gds::device::pin::{PinnedRegion, DEFAULT_PIECE_BYTES};
use kvshard_gds::device::worker::{
    host_copy_parts, plan_batches, Batch, ChunkCopy, CopyDir, GroupSpec, HostPart, InstanceSpec,
    ObjectGroupSpec, PinView,
};
use kvshard_gds::device::Device;
use kvshard_gds::kernel::{CopyDirection, KernelLaunch, KernelObjects};
use kvshard_gds::nvrtc::Nvrtc;
use kvshard_layout::stride::{EngineKvFormat, PageBufferShape, StrideTable, MAX_OBJECTS};

#[path = "../tests/common/diag.rs"]
mod diag;
use diag::{remember, required, Diag, HostBuf};

const WATCHDOG_SECONDS: u64 = 120;
const WARMUP_PASSES: usize = 3;
const TIMED_PASSES: usize = 10;
/// Chunks per pass: 48 x 32 MiB = 1.5 GiB.
const DEFAULT_CHUNKS: usize = 48;
const CHUNKS_ENV: &str = "KVSHARD_GPU_BENCH_CHUNKS";
/// The kernel path must reach this fraction of the plain copies.
const BAR: f64 = 0.80;

const NL: u32 = 32;
const BS: u32 = 16;
const NH: u32 = 8;
const HS: u32 = 128;
const CHUNK_TOKENS: u64 = 256;
const BLOCKS_PER_CHUNK: usize = (CHUNK_TOKENS / BS as u64) as usize;

type BenchResult<T> = Result<T, String>;

/// Log lines (`gpu bench: log ...`) and the watchdog.
static DIAG: Diag = Diag {
    prefix: "gpu bench",
    watchdog_seconds: WATCHDOG_SECONDS,
    watchdog_last: " while ",
};

fn ctx<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> BenchResult<T> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// The page contents: 32-bit word `w` of layer `l`'s buffer.
fn pattern(layer: u32, word: u64) -> u32 {
    (word as u32).wrapping_mul(0x9e37_79b1) ^ layer.wrapping_mul(0x0100_0193) ^ (word >> 32) as u32
}

/// A fixed shuffle of `0..n` (xorshift64*), the block ids of a pass.
fn shuffled_ids(n: usize) -> Vec<i64> {
    let mut ids: Vec<i64> = (0..n as i64).collect();
    let mut s: u64 = 0x6770_7562_656e_6368;
    for i in (1..n).rev() {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        let r = s.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ids.swap(i, (r % (i as u64 + 1)) as usize);
    }
    ids
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs `pass` `warmup + timed` times; returns the median GB/s of the
/// timed ones and their spread.
fn measure(
    what: &str,
    bytes: u64,
    warmup: usize,
    timed: usize,
    mut pass: impl FnMut() -> BenchResult<()>,
) -> BenchResult<f64> {
    remember(format!("measuring {what}"));
    for _ in 0..warmup {
        pass()?;
    }
    let mut rates = Vec::with_capacity(timed);
    for _ in 0..timed {
        let t = Instant::now();
        pass()?;
        rates.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let (lo, hi) = rates
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
    let med = median(rates);
    println!("  {what:<40} {med:8.2} GB/s  (min {lo:.2}, max {hi:.2}, {timed} passes)");
    Ok(med)
}

fn ratio_line(what: &str, kernel: f64, base: f64) {
    let r = kernel / base;
    let verdict = if r >= BAR { "PASS" } else { "BELOW" };
    println!("  {what:<40} {r:8.3}  (bar {BAR:.2}) {verdict}");
}

struct Sizes {
    chunks: usize,
    warmup: usize,
    timed: usize,
}

fn sizes() -> BenchResult<Sizes> {
    // Full size unless asked for the tiny smoke run, so running the binary
    // by hand (with or without cargo's `--bench`) measures the real thing.
    let bench_mode = !std::env::args().any(|a| a == "--tiny");
    let chunks = match std::env::var(CHUNKS_ENV) {
        Ok(v) => v
            .parse::<usize>()
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| format!("{CHUNKS_ENV}={v:?} is not a positive integer"))?,
        Err(_) if bench_mode => DEFAULT_CHUNKS,
        Err(_) => 2,
    };
    Ok(if bench_mode {
        Sizes {
            chunks,
            warmup: WARMUP_PASSES,
            timed: TIMED_PASSES,
        }
    } else {
        Sizes {
            chunks,
            warmup: 1,
            timed: 2,
        }
    })
}

/// The probe and device 0, opened on this thread.
fn open_device0() -> Result<(CudaEnv, Device), String> {
    let env = CudaEnv::probe().map_err(|e| e.to_string())?;
    let device = Device::open(&env, 0).map_err(|e| e.to_string())?;
    Ok((env, device))
}

fn main() {
    DIAG.start_watchdog();
    DIAG.init_log();
    let (env, device) = match open_device0() {
        Ok(opened) => opened,
        Err(e) => {
            println!("gpu bench: no GPU ({e}); nothing to measure");
            return;
        }
    };
    match run(&env, &device) {
        Ok(()) => println!("gpu bench: done"),
        Err(e) => {
            println!("gpu bench: FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// Everything the kernel passes use.
struct KernelPath<'a> {
    module: &'a KernelModule,
    stream: &'a Stream,
    completion: &'a CompletionEvent,
    paged: &'a DeviceBuffer,
    ids: &'a DeviceBuffer,
    slots: &'a DeviceBuffer,
    chunks: &'a [ChunkCopy],
    batches: &'a [Batch],
    gathers: &'a [KernelLaunch],
    scatters: &'a [KernelLaunch],
    /// Host parts of every chunk, chunk order.
    parts: &'a [Vec<HostPart>],
    object_bytes: usize,
}

impl KernelPath<'_> {
    /// One transfer of every chunk, enqueued as the device thread does,
    /// then waited on. `host`: false for launches only.
    fn pass(&self, direction: CopyDirection, host: bool) -> BenchResult<()> {
        let r = self.enqueue(direction, host);
        if r.is_err() {
            // As the device thread does: nothing of a failed pass runs on.
            let _ = self.stream.synchronize();
        }
        r
    }

    fn enqueue(&self, direction: CopyDirection, host: bool) -> BenchResult<()> {
        let s = |e: kvshard_gds::device::DeviceError| e.to_string();
        let obj = self.object_bytes;
        let launches = match direction {
            CopyDirection::Gather => self.gathers,
            CopyDirection::Scatter => self.scatters,
        };
        for (b, launch) in self.batches.iter().zip(launches) {
            let members = &self.chunks[b.first_chunk..b.first_chunk + b.chunks];
            let parts = &self.parts[b.first_chunk..b.first_chunk + b.chunks];
            // Chunk i of the batch <-> slot i, cut at the arena's pieces.
            let copies = || {
                members
                    .iter()
                    .zip(parts)
                    .enumerate()
                    .flat_map(|(i, (chunk, parts))| {
                        parts.iter().map(move |p| {
                            let (offset, len) = (p.offset as usize, p.len as usize);
                            (chunk.host_addr + offset, i * obj + offset, len)
                        })
                    })
            };
            let mut objects = KernelObjects::default();
            for (i, p) in objects.ptr.iter_mut().take(b.chunks).enumerate() {
                *p = self.slots.range(i * obj, obj).map_err(s)?;
            }
            let args = LaunchArgs {
                paged: self.paged.ptr(),
                objects,
                ids: self.ids.ptr(),
            };
            let ids = &b.groups[0].ids;
            // SAFETY: `ids` lives until the wait below; the range fits the
            // ids buffer (checked).
            unsafe {
                self.stream
                    .copy_to_device(self.ids, 0, ids.as_ptr().cast(), ids.len() * 8)
            }
            .map_err(s)?;
            if host && direction == CopyDirection::Scatter {
                // SAFETY: inside the pinned arena, unchanged until the wait
                // below.
                unsafe { enqueue_copies(self.stream, self.slots, CopyDir::ToDevice, copies()) }?;
            }
            // SAFETY: the paged array holds the 32 layer buffers (each
            // spanning the layout's paged_span_bytes), every id is in
            // 0..nb, the objects are the slots, the ids were uploaded just
            // before on this stream; all outlive the wait below.
            unsafe { self.module.launch(self.stream, launch, &args) }.map_err(s)?;
            if host && direction == CopyDirection::Gather {
                // SAFETY: inside the pinned arena, which nothing reads until
                // the wait below.
                unsafe { enqueue_copies(self.stream, self.slots, CopyDir::ToHost, copies()) }?;
            }
        }
        self.completion.record(self.stream).map_err(s)?;
        self.completion.wait().map_err(s)
    }
}

/// Enqueues one copy per `(host address, device offset, length)` between
/// host memory and `dev` on `stream`, in direction `dir`.
///
/// # Safety
///
/// Every host range must be mapped, pinned and left alone (not written
/// while copied to the device, not read while copied to the host) until
/// the stream has been waited on. The device ranges are checked.
unsafe fn enqueue_copies(
    stream: &Stream,
    dev: &DeviceBuffer,
    dir: CopyDir,
    copies: impl IntoIterator<Item = (usize, usize, usize)>,
) -> BenchResult<()> {
    for (host, offset, len) in copies {
        // SAFETY: the host range as the caller promises; the device range
        // is checked.
        unsafe {
            match dir {
                CopyDir::ToHost => stream.copy_to_host(host as *mut u8, dev, offset, len),
                CopyDir::ToDevice => stream.copy_to_device(dev, offset, host as *const u8, len),
            }
        }
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Checks chunk `c` in the arena against the page contents, row by row.
fn verify_chunk(
    arena: &HostBuf,
    table: &StrideTable,
    chunk: &ChunkCopy,
    arena_offset: usize,
) -> BenchResult<()> {
    let row = table.row_bytes() as usize;
    let object = arena.slice(
        arena_offset,
        table.object_bytes(CHUNK_TOKENS).unwrap() as usize,
    );
    for kv in 0..2u32 {
        for layer in 0..NL {
            for slot in 0..CHUNK_TOKENS as usize {
                let id = chunk.block_ids[slot / BS as usize];
                let engine = table
                    .engine_offset_bytes(id, layer, kv)
                    .ok_or("block id out of range")? as usize
                    + (slot % BS as usize) * row;
                let at = ((kv as usize * NL as usize + layer as usize) * CHUNK_TOKENS as usize
                    + slot)
                    * row;
                for w in 0..row / 4 {
                    let got = u32::from_le_bytes(
                        object[at + 4 * w..at + 4 * w + 4]
                            .try_into()
                            .expect("4 bytes"),
                    );
                    let want = pattern(layer, (engine / 4 + w) as u64);
                    if got != want {
                        return Err(format!(
                            "chunk at arena offset {arena_offset}: kv {kv} layer {layer} slot \
                             {slot} word {w}: got {got:#010x}, want {want:#010x}"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn run(env: &CudaEnv, device: &Device) -> BenchResult<()> {
    let sizes = sizes()?;
    let d0 = &env.devices[0];
    println!(
        "gpu bench: device 0 {} (compute capability {}.{}, uuid {}), driver {} ({})",
        d0.name,
        d0.compute_capability.0,
        d0.compute_capability.1,
        d0.uuid,
        env.driver_version_string(),
        env.driver_version
    );
    let nvrtc = Nvrtc::load();
    match &nvrtc {
        Ok(n) => println!(
            "gpu bench: NVRTC {}.{} from {} (CUBIN archs {:?})",
            n.version().0,
            n.version().1,
            n.source(),
            n.supported_archs()
        ),
        Err(e) => println!("gpu bench: NVRTC unavailable: {e}"),
    }

    let shape = PageBufferShape {
        kv_size: 2,
        nl: NL,
        nb: (sizes.chunks * BLOCKS_PER_CHUNK) as u64,
        bs: BS,
        nh: NH,
        hs: HS,
        element_size: 2,
        block_stride_elems: 0,
    };
    let table = ctx(
        "stride table",
        StrideTable::new(EngineKvFormat::NL_X_TWO_NB_BS_NH_HS, &shape),
    )?;
    let object_bytes = ctx("object bytes", table.object_bytes(CHUNK_TOKENS))? as usize;
    let total = object_bytes * sizes.chunks;
    let span = table.paged_span_bytes() as usize;
    println!(
        "gpu bench: {} ({} layers, bs {BS}, {NH}x{HS} bf16), {} chunks of {CHUNK_TOKENS} tokens \
         = {} MiB each, {:.2} GiB per pass; {} warm-up + {} timed passes",
        table.format(),
        NL,
        sizes.chunks,
        object_bytes >> 20,
        total as f64 / (1u64 << 30) as f64,
        sizes.warmup,
        sizes.timed
    );

    let stream = ctx("stream", Stream::new(device))?;
    let s = |e: kvshard_gds::device::DeviceError| e.to_string();

    // The pinned arena: the chunk objects, back to back.
    remember("pinning the host arena");
    let arena = HostBuf::try_new(total)?;
    let t = Instant::now();
    // SAFETY: `arena` is mapped, page-aligned, registered by nobody else and
    // outlives `region` (dropped explicitly before it).
    let region = ctx("pinning the arena", unsafe {
        PinnedRegion::register(device, arena.ptr(), total as u64, DEFAULT_PIECE_BYTES)
    })?;
    println!(
        "gpu bench: pinned {} MiB in {} pieces of {} MiB (cuMemHostRegister) in {:?}",
        total >> 20,
        region.pieces().len(),
        DEFAULT_PIECE_BYTES >> 20,
        t.elapsed()
    );
    let view = PinView {
        base: arena.addr() as u64,
        len: region.len(),
        pieces: region.pieces().to_vec(),
    };

    // (a) Baseline: plain copies of the same bytes, 64 MiB at a time.
    let flat = ctx("device buffer", DeviceBuffer::alloc(device, total))?;
    let whole = host_copy_parts(Some(&view), arena.addr() as u64, total as u64)
        .map_err(|e| e.to_string())?;
    println!("gpu bench: results (GB = 1e9 bytes)");
    // Every pass moves all the chunks, `total` bytes.
    let timed = |what: &str, pass: &mut dyn FnMut() -> BenchResult<()>| {
        measure(what, total as u64, sizes.warmup, sizes.timed, pass)
    };
    let plain = |dir: CopyDir| {
        let copies = whole.iter().map(|p| {
            let (offset, len) = (p.offset as usize, p.len as usize);
            (arena.addr() + offset, offset, len)
        });
        // SAFETY: inside the pinned arena, untouched until the synchronize.
        unsafe { enqueue_copies(&stream, &flat, dir, copies) }?;
        stream.synchronize().map_err(s)
    };
    let dtoh = timed("baseline DtoH (cuMemcpyDtoHAsync)", &mut || {
        plain(CopyDir::ToHost)
    })?;
    let htod = timed("baseline HtoD (cuMemcpyHtoDAsync)", &mut || {
        plain(CopyDir::ToDevice)
    })?;
    drop(flat);

    let nvrtc = match nvrtc {
        Ok(n) => n,
        Err(e) => {
            println!(
                "gpu bench: kernel path REFUSED: the block-copy kernel needs NVRTC, which was \
                 not found: {e}"
            );
            drop(region);
            if required("KVSHARD_REQUIRE_NVRTC") {
                return Err("KVSHARD_REQUIRE_NVRTC=1 and NVRTC is missing".into());
            }
            return Ok(());
        }
    };
    remember("compiling the kernel");
    let t = Instant::now();
    let module = ctx(
        "compiling the block-copy kernel",
        KernelModule::compile(device, &nvrtc),
    )?;
    println!(
        "gpu bench: kernel compiled and loaded as {} in {:?}",
        module.arch(),
        t.elapsed()
    );

    // The engine's page buffers, one per layer, filled with `pattern`.
    remember("filling the page buffers");
    let t = Instant::now();
    let mut staging = vec![0u8; span];
    let mut layers = Vec::with_capacity(NL as usize);
    for layer in 0..NL {
        for (w, word) in staging.chunks_exact_mut(4).enumerate() {
            word.copy_from_slice(&pattern(layer, w as u64).to_le_bytes());
        }
        let buf = ctx("page buffer", DeviceBuffer::alloc(device, span))?;
        // SAFETY: `staging` is unchanged until the synchronize.
        unsafe { stream.copy_to_device(&buf, 0, staging.as_ptr(), span) }.map_err(s)?;
        stream.synchronize().map_err(s)?;
        layers.push(buf);
    }
    drop(staging);
    println!(
        "gpu bench: {NL} page buffers of {} MiB filled in {:?}",
        span >> 20,
        t.elapsed()
    );
    let ptrs: Vec<u8> = layers.iter().flat_map(|b| b.ptr().to_le_bytes()).collect();
    let paged = ctx("paged pointers", DeviceBuffer::alloc(device, ptrs.len()))?;
    // SAFETY: `ptrs` is unchanged until the synchronize.
    unsafe { stream.copy_to_device(&paged, 0, ptrs.as_ptr(), ptrs.len()) }.map_err(s)?;
    stream.synchronize().map_err(s)?;

    // The device thread's per-instance state and its transfer plan.
    let ids_buf = ctx(
        "ids buffer",
        DeviceBuffer::alloc(device, MAX_OBJECTS * BLOCKS_PER_CHUNK * 8),
    )?;
    let slots = ctx(
        "temp slots",
        DeviceBuffer::alloc(device, MAX_OBJECTS * object_bytes),
    )?;
    let completion = ctx("completion event", CompletionEvent::new(device))?;
    let ids = shuffled_ids(sizes.chunks * BLOCKS_PER_CHUNK);
    let chunks: Vec<ChunkCopy> = (0..sizes.chunks)
        .map(|c| ChunkCopy {
            object_group: 0,
            host_addr: arena.addr() + c * object_bytes,
            block_ids: ids[c * BLOCKS_PER_CHUNK..(c + 1) * BLOCKS_PER_CHUNK].to_vec(),
            skip_tokens: 0,
        })
        .collect();
    // One kernel group: the plan only reads the groups and the chunk size.
    let spec = InstanceSpec {
        ordinal: 0,
        layers: Vec::new(),
        groups: vec![GroupSpec {
            kernel_layers: (0..NL as usize).collect(),
            table,
            blocks_per_chunk: BLOCKS_PER_CHUNK,
            keep_blocks: BLOCKS_PER_CHUNK,
            transfer_slots: CHUNK_TOKENS,
            object_offset: 0,
        }],
        object_groups: ObjectGroupSpec::every(1, object_bytes as u64),
        chunk_slots: CHUNK_TOKENS,
        object_bytes: object_bytes as u64,
        isolated_ipc: false,
    };
    let batches = plan_batches(&chunks, &spec);
    let launches = |dir| -> BenchResult<Vec<KernelLaunch>> {
        batches
            .iter()
            .map(|b| {
                KernelLaunch::new(
                    &table,
                    dir,
                    b.chunks,
                    b.groups[0].ids.len(),
                    CHUNK_TOKENS,
                    0,
                )
                .map_err(|e| format!("kernel launch: {e}"))
            })
            .collect()
    };
    let gathers = launches(CopyDirection::Gather)?;
    let scatters = launches(CopyDirection::Scatter)?;
    let parts = chunks
        .iter()
        .map(|c| host_copy_parts(Some(&view), c.host_addr as u64, object_bytes as u64))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    println!(
        "gpu bench: {} batches of up to {MAX_OBJECTS} chunks; launch {} grid {:?} block {:?}",
        batches.len(),
        gathers[0].entry,
        gathers[0].dims.grid,
        gathers[0].dims.block
    );
    let path = KernelPath {
        module: &module,
        stream: &stream,
        completion: &completion,
        paged: &paged,
        ids: &ids_buf,
        slots: &slots,
        chunks: &chunks,
        batches: &batches,
        gathers: &gathers,
        scatters: &scatters,
        parts: &parts,
        object_bytes,
    };
    let verify = |when: &str| -> BenchResult<()> {
        remember(format!("verifying chunks {when}"));
        for c in [0, sizes.chunks / 2, sizes.chunks - 1] {
            verify_chunk(&arena, &table, &chunks[c], c * object_bytes)
                .map_err(|e| format!("{when}: {e}"))?;
        }
        println!(
            "gpu bench: chunks 0, {}, {} verified {when}",
            sizes.chunks / 2,
            sizes.chunks - 1
        );
        Ok(())
    };

    // (b) The kernel path, then (c) the ratios.
    let gather = timed("kernel gather (pages -> slots -> pinned)", &mut || {
        path.pass(CopyDirection::Gather, true)
    })?;
    verify("after the gather passes")?;
    let scatter = timed("kernel scatter (pinned -> slots -> pages)", &mut || {
        path.pass(CopyDirection::Scatter, true)
    })?;
    remember("re-gathering after the scatter passes");
    path.pass(CopyDirection::Gather, true)?;
    verify("after the scatter passes")?;
    let gather_dev = timed("kernel only, gather (pages -> slots)", &mut || {
        path.pass(CopyDirection::Gather, false)
    })?;
    let scatter_dev = timed("kernel only, scatter (slots -> pages)", &mut || {
        path.pass(CopyDirection::Scatter, false)
    })?;
    println!("gpu bench: ratios");
    ratio_line("gather / DtoH", gather, dtoh);
    ratio_line("scatter / HtoD", scatter, htod);
    println!(
        "gpu bench: summary dtoh={dtoh:.2} htod={htod:.2} gather={gather:.2} \
         scatter={scatter:.2} kernel_gather={gather_dev:.2} kernel_scatter={scatter_dev:.2} \
         GB/s arch={}",
        module.arch()
    );
    drop(region);
    Ok(())
}
