//! PUT and GET through kvshard's own S3 client (s3-raw) against s3s-fs on
//! loopback, beside awscrt (the client lmcache 0.5.6's s3 adapter uses, set
//! up as that adapter sets it up) on the same objects in the same run:
//! objects of 1, 8 and 32 MiB, 1, 8 and 64 requests in flight. For each point:
//! throughput (object bytes / wall time) and client CPU seconds per GB (user +
//! system time of the client's whole process: our bench process, or the
//! Python process that drives the CRT). A full run measures each point in 3
//! rounds that alternate the two clients and prints medians (throughput and
//! CPU per GB each); the h2c column is one round.
//!
//! Both clients speak HTTP/1.1 here (awscrt does not do h2c); ours over h2c is
//! shown too. The S3 server shares the machine's CPUs with the client, so the
//! absolute throughput is the server's as much as the client's: compare the
//! ratios.
//!
//! `cargo bench --bench s3` runs the full matrix (`KVSHARD_BENCH_POINTS=1x1,32x64`
//! picks points; `KVSHARD_AWSCRT_PYTHON=none` leaves awscrt out). Under `cargo test` it runs
//! 1 MiB objects at 1 and 8 in flight, and the awscrt side only when the
//! lmcache virtualenv of `tools/compat/run.sh` exists. `KVSHARD_AWSCRT_PYTHON`
//! names another Python with awscrt.

#[path = "../tests/support/s3s.rs"]
#[allow(dead_code)]
mod s3s;

use std::process::Command;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvshard_s3_raw::addressing::{resolve_bucket, AddressingConfig};
use kvshard_s3_raw::client::{CredentialsConfig, S3Client, S3ClientConfig};
use kvshard_s3_raw::credentials::Credentials;
use kvshard_s3_raw::{RecvRegion, SendRegion};

const BUCKET: &str = "bench";

fn cpu_seconds() -> f64 {
    // SAFETY: an all-zero rusage is a valid out-parameter.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `r` is a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(r.ru_utime) + t(r.ru_stime)
}

/// One measured operation: wall and CPU seconds for `count` objects of `size`.
#[derive(Debug, Clone, Copy)]
struct Run {
    seconds: f64,
    cpu_seconds: f64,
    bytes: u64,
}

impl Run {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
    fn cpu_per_gb(&self) -> f64 {
        self.cpu_seconds / (self.bytes as f64 / 1e9)
    }
}

fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = vec![0u8; len];
    for w in out.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        w.copy_from_slice(&v[..w.len()]);
    }
    out
}

/// Our client on one glommio executor (as one shard runs it): PUT then GET
/// of `count` objects, `conc` in flight; the first object read back is
/// compared with what was sent.
fn ours(port: u16, size: usize, conc: usize, count: usize, http2: bool, tag: &str) -> (Run, Run) {
    let tag = tag.to_string();
    let ex = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .make()
        .expect("glommio executor");
    ex.run(async move {
        let address = resolve_bucket(&AddressingConfig {
            bucket_url: &format!("{BUCKET}.localhost:{port}"),
            region: "us-east-1",
            endpoint_url: None,
            disable_tls: true,
        })
        .expect("address");
        let creds = Credentials::new(s3s::S3_ACCESS_KEY, s3s::S3_SECRET_KEY, None, None).unwrap();
        let mut cfg = S3ClientConfig::new(address, "us-east-1", CredentialsConfig::Static(creds));
        cfg.prefer_http2 = http2;
        cfg.disable_tls = true;
        cfg.max_connections = 64;
        let client = Rc::new(S3Client::new(cfg).expect("client"));
        let body = Bytes::from(payload(size, 7));
        let keys: Vec<String> = (0..count)
            .map(|i| format!("{tag}/ours-{size}-{i}"))
            .collect();
        // Written once so the pages exist before the clock starts, as L1's
        // do (a fresh zeroed Vec would fault its pages in during the GETs).
        let mut dest: Vec<Vec<u8>> = (0..conc).map(|_| vec![0x5a_u8; size]).collect();

        let bytes = (size * count) as u64;
        let next = std::cell::Cell::new(0usize);
        let put = measured(bytes, async {
            let workers = (0..conc).map(|_| async {
                while let Some(key) = claim(&next, &keys) {
                    client
                        .put_object(key, SendRegion::from_bytes(body.clone()))
                        .await
                        .unwrap_or_else(|e| panic!("PUT {key}: {e}"));
                }
            });
            futures_util::future::join_all(workers).await;
        })
        .await;

        next.set(0);
        let get = measured(bytes, async {
            let workers = dest.iter_mut().map(|d| async {
                while let Some(key) = claim(&next, &keys) {
                    client
                        .get_object_into(key, RecvRegion::from_mut_slice(d.as_mut_slice()))
                        .await
                        .unwrap_or_else(|e| panic!("GET {key}: {e}"));
                }
            });
            futures_util::future::join_all(workers).await;
        })
        .await;
        // Every buffer last held some object, and all objects hold `body`.
        for d in &dest {
            assert!(
                d[..] == body[..],
                "bytes read back differ from the bytes sent"
            );
        }
        (put, get)
    })
}

/// Wall and CPU time of `work`, which moves `bytes` object bytes.
async fn measured(bytes: u64, work: impl std::future::Future<Output = ()>) -> Run {
    let c0 = cpu_seconds();
    let t0 = Instant::now();
    work.await;
    Run {
        seconds: t0.elapsed().as_secs_f64(),
        cpu_seconds: cpu_seconds() - c0,
        bytes,
    }
}

/// The next key no worker has taken yet (`next` is shared by the workers).
fn claim<'k>(next: &std::cell::Cell<usize>, keys: &'k [String]) -> Option<&'k str> {
    let i = next.get();
    next.set(i + 1);
    keys.get(i).map(String::as_str)
}

/// The (object size, requests in flight) points of a full run: every
/// combination of 1, 8 and 32 MiB with 1, 8 and 64, or those named in
/// `KVSHARD_BENCH_POINTS` as `MIBxCONC` separated by commas (`1x1,32x64`).
fn bench_points() -> Vec<(usize, usize)> {
    let Ok(spec) = std::env::var("KVSHARD_BENCH_POINTS") else {
        let mut all = Vec::new();
        for size in [1 << 20, 8 << 20, 32 << 20] {
            for conc in [1, 8, 64] {
                all.push((size, conc));
            }
        }
        return all;
    };
    spec.split(',')
        .map(|p| {
            let parse = |v: Option<&str>| v.and_then(|v| v.trim().parse::<usize>().ok());
            let mut it = p.split('x');
            match (parse(it.next()), parse(it.next())) {
                (Some(mib), Some(conc)) if mib > 0 && conc > 0 => (mib << 20, conc),
                _ => panic!("KVSHARD_BENCH_POINTS: {p:?} is not MIBxCONC"),
            }
        })
        .collect()
}

/// Removes what a point's runs stored, keeping the server's disk footprint
/// to one run.
fn clear_point(server: &s3s::S3sFs, tag: &str) {
    if let Ok(entries) = std::fs::read_dir(server.root.join(BUCKET)) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(tag) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    std::thread::sleep(Duration::from_millis(100));
}

/// The median throughput and the median CPU per GB of each direction, over
/// rounds of (put, get) runs.
fn median_runs(runs: &[(Run, Run)]) -> (Run, Run) {
    let median = |pick: &dyn Fn(&(Run, Run)) -> Run| {
        let mut by_speed: Vec<Run> = runs.iter().map(pick).collect();
        let mut by_cpu = by_speed.clone();
        by_speed.sort_by(|a, b| a.gbps().total_cmp(&b.gbps()));
        by_cpu.sort_by(|a, b| a.cpu_per_gb().total_cmp(&b.cpu_per_gb()));
        let (s, c) = (by_speed[by_speed.len() / 2], by_cpu[by_cpu.len() / 2]);
        // A run with the median speed, carrying the median CPU per GB.
        Run {
            cpu_seconds: c.cpu_per_gb() * (s.bytes as f64 / 1e9),
            ..s
        }
    };
    (median(&|r| r.0), median(&|r| r.1))
}

fn awscrt_python() -> Option<String> {
    if let Ok(p) = std::env::var("KVSHARD_AWSCRT_PYTHON") {
        // "none" leaves the awscrt side out (profiling our client alone).
        return (p != "none").then_some(p);
    }
    let home = std::env::var("HOME").ok()?;
    let p = format!("{home}/.cache/kvshard/lmcache-0.5.6/bin/python");
    std::path::Path::new(&p).exists().then_some(p)
}

fn awscrt(
    python: &str,
    port: u16,
    size: usize,
    conc: usize,
    count: usize,
    tag: &str,
) -> (Run, Run) {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tools/compat/s3_awscrt_bench.py"
    );
    let out = Command::new(python)
        .arg(script)
        .args(["--host", &format!("127.0.0.1:{port}"), "--bucket", BUCKET])
        .args([
            "--access-key",
            s3s::S3_ACCESS_KEY,
            "--secret-key",
            s3s::S3_SECRET_KEY,
        ])
        .args(["--prefix", tag, "--size-bytes", &size.to_string()])
        .args([
            "--concurrency",
            &conc.to_string(),
            "--count",
            &count.to_string(),
        ])
        .output()
        .expect("run the awscrt bench script");
    assert!(
        out.status.success(),
        "awscrt bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut runs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert_eq!(v["errors"], 0, "awscrt reported errors: {v}");
        runs.push(Run {
            seconds: v["seconds"].as_f64().unwrap(),
            cpu_seconds: v["cpu_seconds"].as_f64().unwrap(),
            bytes: v["size"].as_u64().unwrap() * v["count"].as_u64().unwrap(),
        });
    }
    assert_eq!(runs.len(), 2, "put and get lines");
    (runs[0], runs[1])
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let server = s3s::S3sFs::start(&[BUCKET]);
    let python = awscrt_python();
    let (points, total, rounds): (Vec<(usize, usize)>, usize, usize) = if full {
        (bench_points(), 256 << 20, 3)
    } else {
        println!("(smoke run under cargo test: tiny matrix; figures come from `cargo bench`)");
        (vec![(1 << 20, 1), (1 << 20, 8)], 8 << 20, 1)
    };
    if python.is_none() {
        println!("(awscrt side skipped: no lmcache virtualenv; run tools/compat/run.sh first)");
    }
    println!(
        "== s3: PUT/GET against s3s-fs on loopback; throughput GB/s and client CPU s/GB; ours over HTTP/1.1 \
         vs awscrt {} (same objects, same run, median of {rounds}); bars: throughput >= awscrt, CPU/GB <= 0.5x awscrt",
        if python.is_some() { "0.38.1 (lmcache's setup)" } else { "(skipped)" }
    );
    println!(
        "{:>6} {:>4} {:>3} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6} | {:>8}",
        "MiB", "conc", "op", "ours", "awscrt", "ratio", "cpu/GB", "crt", "ratio", "ours-h2c"
    );
    let mut n = 0;
    for (size, conc) in points {
        {
            let count = conc.max(total / size);
            n += 1;
            let tag = format!("p{n}");
            // Rounds alternate the two clients; the figures are medians.
            let mut ours_runs = Vec::new();
            let mut crt_runs = Vec::new();
            for r in 0..rounds {
                ours_runs.push(ours(
                    server.port,
                    size,
                    conc,
                    count,
                    false,
                    &format!("{tag}r{r}"),
                ));
                if let Some(py) = python.as_deref() {
                    crt_runs.push(awscrt(
                        py,
                        server.port,
                        size,
                        conc,
                        count,
                        &format!("{tag}c{r}"),
                    ));
                }
                clear_point(&server, &tag);
            }
            let (op, oh) = median_runs(&ours_runs);
            let crt = (!crt_runs.is_empty()).then(|| median_runs(&crt_runs));
            let (hp, hg) = ours(server.port, size, conc, count, true, &format!("{tag}h"));
            for (name, o, h2, c) in [
                ("put", op, hp, crt.map(|c| c.0)),
                ("get", oh, hg, crt.map(|c| c.1)),
            ] {
                let (cg, cc, r1, r2) = match c {
                    Some(c) => (
                        format!("{:.3}", c.gbps()),
                        format!("{:.3}", c.cpu_per_gb()),
                        format!("{:.2}", o.gbps() / c.gbps()),
                        format!("{:.2}", o.cpu_per_gb() / c.cpu_per_gb()),
                    ),
                    None => ("-".into(), "-".into(), "-".into(), "-".into()),
                };
                println!(
                    "{:>6} {:>4} {:>3} | {:>8.3} {:>8} {:>6} | {:>8.3} {:>8} {:>6} | {:>8.3}",
                    size >> 20,
                    conc,
                    name,
                    o.gbps(),
                    cg,
                    r1,
                    o.cpu_per_gb(),
                    cc,
                    r2,
                    h2.gbps()
                );
            }
            clear_point(&server, &tag);
        }
    }
}
