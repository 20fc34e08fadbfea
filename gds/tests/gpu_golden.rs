//! The device copy path against lmcache 0.5.6's gather output
//! (`golden/golden_kernel_gather.json`), on a real GPU.
//!
//! Two tests, each skipping with one `skipped: <reason>` line on stderr when
//! there is no usable driver, no device 0 or no NVRTC (set
//! `KVSHARD_REQUIRE_CUDA=1` / `KVSHARD_REQUIRE_NVRTC=1` to make that a
//! failure instead):
//!
//! - `worker_store_and_retrieve_match_golden` drives the server's own device
//!   thread ([`DeviceThreads`]: `Register`, `Transfer` to host and to device,
//!   `Unregister`) with a pinned host arena, so the IPC import, the kernel
//!   compile, the batch planner, the temp-slot staging, the arena's piece
//!   splitting and the completion wait are the server's code. The worker
//!   imports layers with `cuIpcOpenMemHandle`, which refuses allocations of
//!   the calling process, so the page buffers live in a child process: this
//!   test binary re-run with [`CHILD_ENV`] set (test `child_page_buffers`),
//!   which allocates and fills them, prints their IPC handles and later dumps
//!   the retrieve targets back on request.
//! - `kernel_gather_and_scatter_match_golden` goes one level lower, in one
//!   process: [`KernelModule::compile`] (NVRTC, this device's arch),
//!   [`KernelLaunch`] and [`KernelModule::launch`] on device page buffers,
//!   with the worker's staging (device temp slots, then copies cut at the
//!   registrations of a [`PinnedRegion`] by [`host_copy_parts`]). It pins
//!   the objects in 4 KiB pieces and places them across piece boundaries.
//!
//! Store (gather) results must equal the golden bytes and their sha256;
//! retrieve (scatter) results, read back from device memory, must equal the
//! CPU [`scatter`] of the golden objects into zeroed buffers with the case's
//! skip. A watchdog aborts the process with the last step it reached if the
//! binary runs longer than [`WATCHDOG_SECONDS`].

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use kvshard_gds::cuda::CudaEnv;
use kvshard_gds::device::exec::{DeviceBuffer, KernelModule, LaunchArgs, Stream};
use kvshard_gds::device::ipc::IpcMemHandle;
use kvshard_gds::device::pin::PinnedRegion;
use kvshard_gds::device::worker::{
    host_copy_parts, ChunkCopy, CopyDir, DeviceJob, DeviceThreads, GroupSpec, InstanceSpec,
    LayerMemory, LayerSpec, ObjectGroupSpec, PinView,
};
use kvshard_gds::device::{require_symbols, Device, WorkerError};
use kvshard_gds::kernel::{CopyDirection, KernelLaunch, KernelObjects};
use kvshard_gds::nvrtc::Nvrtc;
use kvshard_layout::stride::{gather, scatter};

mod common;
use common::diag::{skip, Diag, HostBuf};
use common::golden::{cases, golden_paged, hex_decode, hex_encode, sha256_hex, Case};

/// Set (to anything) in the child process that owns the page buffers.
const CHILD_ENV: &str = "KVSHARD_GPU_GOLDEN_CHILD";

/// The whole binary is aborted after this long.
const WATCHDOG_SECONDS: u64 = 180;

/// Progress lines (`gpu_golden: ...`) and the watchdog.
static DIAG: Diag = Diag {
    prefix: "gpu_golden",
    watchdog_seconds: WATCHDOG_SECONDS,
    watchdog_last: "; last step: ",
};

/// How long one device job or one child reply may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// The child rounds each allocation up to this, so no two buffers share a
/// driver allocation (an IPC handle exports the whole allocation).
const CHILD_ALLOC_ROUND: usize = 2 << 20;

/// The CPU executor's gather of `paged` (checked against lmcache by
/// layout_golden.rs), objects concatenated.
fn cpu_gather(c: &Case, paged: &[Vec<u8>], skip: usize) -> Vec<u8> {
    let table = c.table();
    let size = table.object_bytes(c.chunk_slots).expect("object bytes") as usize;
    let mut objs = vec![vec![0u8; size]; c.objects];
    let paged_refs: Vec<&[u8]> = paged.iter().map(Vec::as_slice).collect();
    let mut obj_refs: Vec<&mut [u8]> = objs.iter_mut().map(Vec::as_mut_slice).collect();
    gather(
        &table,
        &paged_refs,
        &mut obj_refs,
        &c.ids,
        c.chunk_slots,
        skip,
    )
    .unwrap_or_else(|e| panic!("{}: CPU gather: {e}", c.name));
    objs.concat()
}

/// The CPU executor's scatter of the golden objects into zeroed buffers of
/// the golden sizes, with the case's skip.
fn cpu_scatter_of_golden(c: &Case) -> Vec<Vec<u8>> {
    let table = c.table();
    let mut paged: Vec<Vec<u8>> = golden_paged(c).iter().map(|p| vec![0u8; p.len()]).collect();
    let size = c.bytes.len() / c.objects;
    let objs: Vec<&[u8]> = c.bytes.chunks(size).collect();
    let mut paged_refs: Vec<&mut [u8]> = paged.iter_mut().map(Vec::as_mut_slice).collect();
    scatter(
        &table,
        &mut paged_refs,
        &objs,
        &c.ids,
        c.chunk_slots,
        c.skip,
    )
    .unwrap_or_else(|e| panic!("{}: CPU scatter: {e}", c.name));
    paged
}

/// Which object bytes a gather with the case's skip writes.
fn copied_with_skip(c: &Case) -> Vec<bool> {
    let marked: Vec<Vec<u8>> = golden_paged(c)
        .iter()
        .map(|p| vec![0xff; p.len()])
        .collect();
    cpu_gather(c, &marked, c.skip)
        .into_iter()
        .map(|b| b == 0xff)
        .collect()
}

/// Where two byte strings first differ, for a short failure message.
fn first_difference(got: &[u8], want: &[u8]) -> String {
    if got.len() != want.len() {
        return format!("lengths differ: got {} want {}", got.len(), want.len());
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => "equal".into(),
        Some(i) => {
            let end = (i + 16).min(got.len());
            format!(
                "first difference at byte {i}: got {} want {}",
                hex_encode(&got[i..end]),
                hex_encode(&want[i..end])
            )
        }
    }
}

// ---------------------------------------------------------------------------
// Opening the GPU, or skipping.
// ---------------------------------------------------------------------------

/// The probe, device 0 opened on this thread, and NVRTC; `None` (after the
/// skip line) when any is missing, and at once in the child process (which
/// runs only `child_page_buffers`).
fn open_gpu(test: &str) -> Option<(CudaEnv, Device, Nvrtc)> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return None;
    }
    let env = match CudaEnv::probe() {
        Ok(env) => env,
        Err(e) => {
            skip(test, "KVSHARD_REQUIRE_CUDA", &e.to_string());
            return None;
        }
    };
    let nvrtc = match Nvrtc::load() {
        Ok(n) => n,
        Err(e) => {
            skip(
                test,
                "KVSHARD_REQUIRE_NVRTC",
                &format!("libcuda works but the kernel cannot be built: {e}"),
            );
            return None;
        }
    };
    DIAG.start_watchdog();
    DIAG.init_log();
    let device = match Device::open(&env, 0) {
        Ok(d) => d,
        Err(e) => {
            skip(test, "KVSHARD_REQUIRE_CUDA", &e.to_string());
            return None;
        }
    };
    let d0 = &env.devices[0];
    DIAG.step(format!(
        "{test}: device 0 {} (sm_{}{}, uuid {}), driver {} ({}), NVRTC {:?} from {} \
         (supports {:?})",
        d0.name,
        d0.compute_capability.0,
        d0.compute_capability.1,
        d0.uuid,
        env.driver_version_string(),
        env.driver_version,
        nvrtc.version(),
        nvrtc.source(),
        nvrtc.supported_archs()
    ));
    Some((env, device, nvrtc))
}

fn ok<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

// ---------------------------------------------------------------------------
// Device helpers (exec.rs's buffers and stream).
// ---------------------------------------------------------------------------

/// A device buffer holding `bytes` (synchronously uploaded).
fn upload(device: &Device, stream: &Stream, bytes: &[u8], what: &str) -> DeviceBuffer {
    let buf = ok(what, DeviceBuffer::alloc(device, bytes.len().max(1)));
    // SAFETY: `bytes` outlives the synchronize below; the range is inside
    // `buf` (checked by copy_to_device).
    ok(what, unsafe {
        stream.copy_to_device(&buf, 0, bytes.as_ptr(), bytes.len())
    });
    ok(what, stream.synchronize());
    buf
}

/// The whole of `buf`, copied back with cuMemcpyDtoHAsync + synchronize.
fn download(stream: &Stream, buf: &DeviceBuffer, len: usize, what: &str) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` is live, writable and untouched until the synchronize.
    ok(what, unsafe {
        stream.copy_to_host(out.as_mut_ptr(), buf, 0, len)
    });
    ok(what, stream.synchronize());
    out
}

fn u64_bytes(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

// ---------------------------------------------------------------------------
// Test 1: the kernel module, launches and pinned staging, in one process.
// ---------------------------------------------------------------------------

#[test]
fn kernel_gather_and_scatter_match_golden() {
    const TEST: &str = "kernel_gather_and_scatter_match_golden";
    let Some((_env, device, nvrtc)) = open_gpu(TEST) else {
        return;
    };
    DIAG.step(format!(
        "{TEST}: compiling the block-copy kernel with NVRTC"
    ));
    let started = Instant::now();
    let module = ok(
        "KernelModule::compile",
        KernelModule::compile(&device, &nvrtc),
    );
    DIAG.step(format!(
        "{TEST}: kernel loaded as {} in {:?}",
        module.arch(),
        started.elapsed()
    ));
    let stream = ok("Stream::new", Stream::new(&device));

    // All objects of every case in one pinned region of 4 KiB pieces, each
    // case's objects starting 304 bytes before a piece boundary so that host
    // copies are cut as the worker cuts them.
    let all = cases();
    assert_eq!(all.len(), 9);
    let page = 4096usize;
    let max_objects_bytes = all.iter().map(|c| c.bytes.len()).max().expect("cases");
    let stride = (max_objects_bytes + page).next_multiple_of(page);
    let host = HostBuf::new(stride * (all.len() + 1));
    // SAFETY: `host` is mapped, page-aligned, registered by nobody else, and
    // outlives `region` (declared after it, dropped first).
    let region = ok("PinnedRegion::register", unsafe {
        PinnedRegion::register(&device, host.ptr(), host.len() as u64, page as u64)
    });
    DIAG.step(format!(
        "{TEST}: pinned {} bytes in {} pieces",
        region.len(),
        region.pieces().len()
    ));
    let view = PinView {
        base: host.addr() as u64,
        len: region.len(),
        pieces: region.pieces().to_vec(),
    };

    let mut failures = Vec::new();
    for (n, c) in all.iter().enumerate() {
        let table = c.table();
        let obj = table.object_bytes(c.chunk_slots).expect("object bytes") as usize;
        assert_eq!(obj * c.objects, c.bytes.len(), "{}", c.name);
        let host_off = (n + 1) * stride - 304;
        let host_addr = |o: usize| (host.addr() + host_off + o * obj) as u64;
        let paged = golden_paged(c);
        assert_eq!(sha256_hex(&cpu_gather(c, &paged, c.skip)), c.sha256);

        // The engine side: one device buffer per kernel pointer.
        let bufs: Vec<DeviceBuffer> = paged
            .iter()
            .enumerate()
            .map(|(i, p)| upload(&device, &stream, p, &format!("{}: paged {i}", c.name)))
            .collect();
        let ptrs: Vec<u64> = bufs.iter().map(DeviceBuffer::ptr).collect();
        let paged_arr = upload(&device, &stream, &u64_bytes(&ptrs), "paged pointers");
        let ids = upload(&device, &stream, &i64_bytes(&c.ids), "block ids");
        // The worker's temp slots, zeroed so skipped bytes read as zero.
        let slots = upload(&device, &stream, &vec![0u8; obj * c.objects], "temp slots");
        let mut objects = KernelObjects::default();
        for (i, p) in objects.ptr.iter_mut().take(c.objects).enumerate() {
            *p = ok("slot range", slots.range(i * obj, obj));
        }
        let args = LaunchArgs {
            paged: paged_arr.ptr(),
            objects,
            ids: ids.ptr(),
        };

        // Gather: kernel into the slots, then slot -> pinned host copies.
        let launch = ok(
            "KernelLaunch::new(gather)",
            KernelLaunch::new(
                &table,
                CopyDirection::Gather,
                c.objects,
                c.ids.len(),
                c.chunk_slots,
                c.skip,
            ),
        );
        DIAG.step(format!(
            "{TEST}: {}: gather {} grid {:?} block {:?}",
            c.name, launch.entry, launch.dims.grid, launch.dims.block
        ));
        // SAFETY: the page buffers, pointer array, ids and slots are live
        // device allocations of the sizes the layout implies (the page
        // buffers hold paged_span_bytes, checked by layout_golden.rs); they
        // outlive the synchronize below.
        ok("launch gather", unsafe {
            module.launch(&stream, &launch, &args)
        });
        let mut split = 0;
        for o in 0..c.objects {
            let parts = ok(
                "host_copy_parts",
                host_copy_parts(Some(&view), host_addr(o), obj as u64),
            );
            split += parts.len();
            for p in parts {
                // SAFETY: inside the pinned host buffer, which nothing reads
                // until the synchronize; the slot range is checked.
                ok("copy_to_host", unsafe {
                    stream.copy_to_host(
                        (host_addr(o) + p.offset) as *mut u8,
                        &slots,
                        o * obj + p.offset as usize,
                        p.len as usize,
                    )
                });
            }
        }
        ok("synchronize after gather", stream.synchronize());
        let got = host.read(host_off, obj * c.objects);
        let sha = sha256_hex(&got);
        if got == c.bytes && sha == c.sha256 {
            DIAG.step(format!(
                "{TEST}: {}: gather OK ({} bytes in {split} host copies, sha256 {sha})",
                c.name,
                got.len()
            ));
        } else {
            failures.push(format!(
                "{}: gather differs from golden (sha256 {sha}, want {}): {}",
                c.name,
                c.sha256,
                first_difference(&got, &c.bytes)
            ));
        }

        // Scatter: golden objects in pinned memory -> slots -> zeroed pages.
        host.write(host_off, &c.bytes);
        let zero_slots = vec![0u8; obj * c.objects];
        // SAFETY: `zero_slots` outlives the synchronize below.
        ok("zeroing the slots", unsafe {
            stream.copy_to_device(&slots, 0, zero_slots.as_ptr(), zero_slots.len())
        });
        let targets: Vec<DeviceBuffer> = paged
            .iter()
            .enumerate()
            .map(|(i, p)| {
                upload(
                    &device,
                    &stream,
                    &vec![0u8; p.len()],
                    &format!("{}: target {i}", c.name),
                )
            })
            .collect();
        let target_ptrs: Vec<u64> = targets.iter().map(DeviceBuffer::ptr).collect();
        let target_arr = upload(
            &device,
            &stream,
            &u64_bytes(&target_ptrs),
            "target pointers",
        );
        for o in 0..c.objects {
            for p in ok(
                "host_copy_parts",
                host_copy_parts(Some(&view), host_addr(o), obj as u64),
            ) {
                // SAFETY: pinned host bytes left unchanged until the
                // synchronize; the slot range is checked.
                ok("copy_to_device", unsafe {
                    stream.copy_to_device(
                        &slots,
                        o * obj + p.offset as usize,
                        (host_addr(o) + p.offset) as *const u8,
                        p.len as usize,
                    )
                });
            }
        }
        let launch = ok(
            "KernelLaunch::new(scatter)",
            KernelLaunch::new(
                &table,
                CopyDirection::Scatter,
                c.objects,
                c.ids.len(),
                c.chunk_slots,
                c.skip,
            ),
        );
        let args = LaunchArgs {
            paged: target_arr.ptr(),
            ..args
        };
        // SAFETY: as for the gather; the targets have the page buffers'
        // sizes.
        ok("launch scatter", unsafe {
            module.launch(&stream, &launch, &args)
        });
        ok("synchronize after scatter", stream.synchronize());
        let want = cpu_scatter_of_golden(c);
        for (i, (t, w)) in targets.iter().zip(&want).enumerate() {
            let got = download(&stream, t, w.len(), "reading a target back");
            if &got != w {
                failures.push(format!(
                    "{}: scatter into buffer {i} differs from the CPU scatter: {}",
                    c.name,
                    first_difference(&got, w)
                ));
            }
        }
        DIAG.step(format!("{TEST}: {}: scatter checked", c.name));
    }
    drop(region);
    drop(host);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    DIAG.step(format!("{TEST}: all {} cases match", all.len()));
}

// ---------------------------------------------------------------------------
// Test 2: the server's device thread, with the page buffers in a child.
// ---------------------------------------------------------------------------

/// The child side: allocates every case's source buffers (filled as the
/// golden script fills them) and zeroed target buffers, prints
/// `@@buf <case> <src|dst> <index> <len> <handle hex>` per buffer and
/// `@@ready`, then serves `dump` (prints `@@dump <case> <index> <hex>` for
/// every target, then `@@dumped`) until `exit` or end of input.
#[test]
fn child_page_buffers() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    DIAG.start_watchdog();
    let fail = child_fail;
    let env = CudaEnv::probe().unwrap_or_else(|e| fail(&e.to_string()));
    let device = Device::open(&env, 0).unwrap_or_else(|e| fail(&e.to_string()));
    if let Err(e) = require_symbols(&["cuIpcGetMemHandle"], "exporting page buffers") {
        fail(&e.to_string());
    }
    let stream = Stream::new(&device).unwrap_or_else(|e| fail(&e.to_string()));
    let export = |buf: &DeviceBuffer| -> String {
        let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
        let ptr = buf.ptr();
        // SAFETY: symbol checked above; `ptr` is the base of a live
        // cuMemAlloc allocation; the out-pointer is a local.
        let rc = unsafe { sys::cuIpcGetMemHandle(&mut raw, ptr) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            fail(&format!("cuIpcGetMemHandle({ptr:#x}) failed with {rc:?}"));
        }
        hex_encode(&raw.reserved.map(|b| b as u8))
    };
    let mut keep: Vec<DeviceBuffer> = Vec::new();
    let mut targets: Vec<(usize, usize, usize, usize)> = Vec::new(); // (case, index, keep idx, len)
    for (n, c) in cases().iter().enumerate() {
        for (i, p) in golden_paged(c).iter().enumerate() {
            for (kind, bytes) in [("src", p.clone()), ("dst", vec![0u8; p.len()])] {
                let alloc = p.len().next_multiple_of(CHILD_ALLOC_ROUND);
                let buf =
                    DeviceBuffer::alloc(&device, alloc).unwrap_or_else(|e| fail(&e.to_string()));
                // SAFETY: `bytes` outlives the synchronize below; the range
                // is checked.
                unsafe { stream.copy_to_device(&buf, 0, bytes.as_ptr(), bytes.len()) }
                    .and_then(|()| stream.synchronize())
                    .unwrap_or_else(|e| fail(&e.to_string()));
                println!("@@buf {n} {kind} {i} {} {}", p.len(), export(&buf));
                if kind == "dst" {
                    targets.push((n, i, keep.len(), p.len()));
                }
                keep.push(buf);
            }
        }
    }
    println!("@@ready");
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        match line.trim() {
            "dump" => {
                for &(n, i, k, len) in &targets {
                    let bytes = download(&stream, &keep[k], len, "dumping a target");
                    println!("@@dump {n} {i} {}", hex_encode(&bytes));
                }
                println!("@@dumped");
            }
            "exit" => break,
            other => println!("@@error unknown command {other:?}"),
        }
    }
}

/// Reports a child failure to the parent, then fails the child's test.
fn child_fail(what: &str) -> ! {
    println!("@@error {what}");
    panic!("{what}");
}

/// The child process and its output lines (read on a thread, so every wait
/// has a timeout). Killed on drop if still running.
struct ChildPages {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl ChildPages {
    fn spawn() -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "child_page_buffers",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", exe.display()))?;
        let stdout = child.stdout.take().ok_or("no child stdout")?;
        let stdin = child.stdin.take();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness may print "test NAME ... " on the same line
                // before the child's first line.
                if let Some(at) = line.find("@@") {
                    if tx.send(line[at..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            lines: rx,
        })
    }

    /// Lines up to (not including) `end`.
    fn read_until(&self, end: &str) -> Result<Vec<String>, String> {
        let deadline = Instant::now() + REPLY_TIMEOUT;
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).map_err(|e| {
                format!("waiting for {end} from the child: {e} (see its stderr above)")
            })?;
            if line == end {
                return Ok(out);
            }
            if let Some(e) = line.strip_prefix("@@error ") {
                return Err(format!("the child failed: {e}"));
            }
            out.push(line);
        }
    }

    fn send(&mut self, cmd: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("child stdin closed")?;
        writeln!(stdin, "{cmd}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("writing {cmd:?} to the child: {e}"))
    }
}

impl Drop for ChildPages {
    fn drop(&mut self) {
        let _ = self.send("exit");
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One exported buffer: (case, src/dst, index) -> (len, handle).
type Exports = std::collections::HashMap<(usize, bool, usize), (u64, IpcMemHandle)>;

fn parse_exports(lines: &[String]) -> Exports {
    let mut out = Exports::new();
    for line in lines {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(f.len() == 6 && f[0] == "@@buf", "bad child line {line:?}");
        let handle = ok(
            "IPC handle from the child",
            IpcMemHandle::from_bytes(&hex_decode(f[5])),
        );
        let key = (
            f[1].parse().expect("case"),
            f[2] == "src",
            f[3].parse().expect("index"),
        );
        out.insert(key, (f[4].parse().expect("len"), handle));
    }
    out
}

/// Submits a job and waits for its answer, with a timeout.
fn run_job<T: Send + 'static>(
    threads: &DeviceThreads,
    make: impl FnOnce(Box<dyn FnOnce(Result<T, WorkerError>) + Send>) -> DeviceJob,
) -> Result<T, String> {
    let (tx, rx) = channel();
    let job = make(Box::new(move |r| {
        let _ = tx.send(r);
    }));
    threads
        .submit(0, job)
        .map_err(|j| format!("the device thread handed back {j:?}"))?;
    rx.recv_timeout(REPLY_TIMEOUT)
        .map_err(|e| format!("no answer from the device thread: {e}"))?
        .map_err(|e| e.to_string())
}

fn spec_for(c: &Case, exports: &Exports, n: usize, src: bool) -> InstanceSpec {
    let table = c.table();
    let layers: Vec<LayerSpec> = (0..table.paged_buffers())
        .map(|i| {
            let &(len, handle) = exports
                .get(&(n, src, i))
                .unwrap_or_else(|| panic!("{}: the child exported no buffer {i}", c.name));
            LayerSpec {
                memory: LayerMemory::Raw {
                    handle,
                    alloc_offset: 0,
                    nbytes: len,
                },
                view_offset: 0,
                view_bytes: len,
            }
        })
        .collect();
    InstanceSpec {
        ordinal: 0,
        groups: vec![GroupSpec {
            kernel_layers: (0..layers.len()).collect(),
            table,
            blocks_per_chunk: c.blocks_per_object(),
            keep_blocks: c.blocks_per_object(),
            transfer_slots: c.chunk_slots,
            object_offset: 0,
        }],
        layers,
        chunk_slots: c.chunk_slots,
        object_groups: ObjectGroupSpec::every(
            1,
            table.object_bytes(c.chunk_slots).expect("object bytes"),
        ),
        object_bytes: table.object_bytes(c.chunk_slots).expect("object bytes"),
        isolated_ipc: false,
    }
}

#[test]
fn worker_store_and_retrieve_match_golden() {
    const TEST: &str = "worker_store_and_retrieve_match_golden";
    let Some((env, device, _nvrtc)) = open_gpu(TEST) else {
        return;
    };
    // The device thread opens its own handle on the primary context.
    drop(device);
    let all = cases();

    DIAG.step(format!(
        "{TEST}: starting the child that owns the page buffers"
    ));
    let mut child = ok("starting the child", ChildPages::spawn());
    let exports = parse_exports(&ok("child exports", child.read_until("@@ready")));
    DIAG.step(format!(
        "{TEST}: the child exported {} buffers",
        exports.len()
    ));

    // The L1 arena, pinned by the device thread in 64 MiB pieces: case n's
    // objects start 512 bytes before the end of piece n, so every case's
    // host copies are split at a registration boundary.
    let piece = kvshard_gds::device::pin::DEFAULT_PIECE_BYTES as usize;
    let arena = Arc::new(HostBuf::new(all.len() * piece + (1 << 20)));
    let arena_off = |n: usize| (n + 1) * piece - 512;
    let keepalive: Arc<dyn std::any::Any + Send + Sync> = arena.clone();
    // SAFETY: the arena is mapped, page-aligned and registered by nobody
    // else, and `keepalive` holds it for as long as the threads run; every
    // chunk below lies inside it and the test touches a chunk only while no
    // job on it is in flight (each job is awaited).
    let threads = unsafe { DeviceThreads::new(env, Some((arena.addr(), arena.len())), keepalive) };

    let mut failures = Vec::new();
    for (n, c) in all.iter().enumerate() {
        let bpo = c.blocks_per_object();
        let obj = c.bytes.len() / c.objects;
        let base = arena.addr() + arena_off(n);
        let (iid_src, iid_dst) = (n as i64, 100 + n as i64);
        for (iid, src) in [(iid_src, true), (iid_dst, false)] {
            let spec = spec_for(c, &exports, n, src);
            DIAG.step(format!("{TEST}: {}: registering instance {iid}", c.name));
            if let Err(e) = run_job(&threads, |done| DeviceJob::Register { iid, spec, done }) {
                panic!("{}: registering instance {iid}: {e}", c.name);
            }
        }

        // The case's objects in the arena as one transfer, the flat skip
        // expressed per chunk (plan_batches turns it back into the flat
        // skip).
        let transfer = |iid: i64, dir: CopyDir, skip: usize| {
            let chunks: Vec<ChunkCopy> = (0..c.objects)
                .map(|o| ChunkCopy {
                    object_group: 0,
                    host_addr: base + o * obj,
                    block_ids: c.ids[o * bpo..(o + 1) * bpo].to_vec(),
                    skip_tokens: skip.saturating_sub(o * bpo).min(bpo) * c.shape.bs as usize,
                })
                .collect();
            run_job(&threads, |done| DeviceJob::Transfer {
                iid,
                dir,
                worker_event: None,
                chunks,
                done,
            })
        };

        // STORE refuses skips, so it gathers every block; the golden bytes
        // (skip 1) must match outside the skipped prefix.
        DIAG.step(format!("{TEST}: {}: store", c.name));
        let event = transfer(iid_src, CopyDir::ToHost, 0);
        match event {
            Err(e) => failures.push(format!("{}: store failed: {e}", c.name)),
            Ok(ev) => {
                assert_eq!(ev.len(), 64, "{}: exported event bytes", c.name);
                let got = arena.read(arena_off(n), c.bytes.len());
                let want = cpu_gather(c, &golden_paged(c), 0);
                // The golden file holds zeros where the skipped blocks were;
                // everywhere else the bytes are lmcache's.
                let matches_golden = got
                    .iter()
                    .zip(&c.bytes)
                    .zip(copied_with_skip(c))
                    .all(|((g, w), copied)| !copied || g == w);
                if got == want && matches_golden {
                    let also = if c.skip == 0 && sha256_hex(&got) == c.sha256 {
                        ", sha256 equal"
                    } else {
                        ""
                    };
                    DIAG.step(format!(
                        "{TEST}: {}: store OK ({} bytes; golden outside the {} skipped \
                         block(s){also})",
                        c.name,
                        got.len(),
                        c.skip
                    ));
                } else {
                    failures.push(format!(
                        "{}: store differs from the CPU gather: {}",
                        c.name,
                        first_difference(&got, &want)
                    ));
                }
            }
        }

        // RETRIEVE the golden objects with the case's flat skip.
        arena.write(arena_off(n), &c.bytes);
        DIAG.step(format!("{TEST}: {}: retrieve", c.name));
        let event = transfer(iid_dst, CopyDir::ToDevice, c.skip);
        if let Err(e) = event {
            failures.push(format!("{}: retrieve failed: {e}", c.name));
        }
        for iid in [iid_src, iid_dst] {
            ok(
                "unregister",
                threads
                    .submit(0, DeviceJob::Unregister { iid })
                    .map_err(|j| format!("the device thread handed back {j:?}")),
            );
        }
    }

    // Read every retrieve target back through the child.
    ok("asking the child to dump", child.send("dump"));
    let dumps = ok("child dump", child.read_until("@@dumped"));
    let mut seen = 0;
    for line in &dumps {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(f.len() == 4 && f[0] == "@@dump", "bad child line {line:?}");
        let (n, i): (usize, usize) = (f[1].parse().expect("case"), f[2].parse().expect("index"));
        let c = &all[n];
        let want = &cpu_scatter_of_golden(c)[i];
        let got = hex_decode(f[3]);
        seen += 1;
        if &got != want {
            failures.push(format!(
                "{}: retrieve into buffer {i} differs from the CPU scatter: {}",
                c.name,
                first_difference(&got, want)
            ));
        }
    }
    let want_targets: usize = all.iter().map(|c| c.table().paged_buffers()).sum();
    assert_eq!(seen, want_targets, "targets dumped by the child");
    DIAG.step(format!("{TEST}: {seen} retrieve targets read back"));
    // Stops the device thread (instances closed, arena unregistered) before
    // the child frees the memory it mapped.
    drop(threads);
    drop(child);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    DIAG.step(format!("{TEST}: all {} cases match", all.len()));
}
