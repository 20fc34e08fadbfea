//! RPC round-trip latency against the real server: noop, lookup + prefetch status
//! for a 2048-token request, and the engine_driven prepare/commit round trips.
//!
//! `cargo bench --bench rpc` runs the full sizes; under `cargo test` (no `--bench`
//! argument) it runs a few iterations so the harness cannot rot.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::Instant;

use hdrhistogram::Histogram;
use support::*;

const CHUNK: usize = 256;
const TOKENS: usize = 2048;

fn report(name: &str, h: &Histogram<u64>) {
    println!(
        "{name:<34} n={:<7} p50={:>7.1}us p99={:>7.1}us p99.9={:>7.1}us p99.99={:>7.1}us max={:>8.1}us",
        h.len(),
        h.value_at_quantile(0.5) as f64 / 1e3,
        h.value_at_quantile(0.99) as f64 / 1e3,
        h.value_at_quantile(0.999) as f64 / 1e3,
        h.value_at_quantile(0.9999) as f64 / 1e3,
        h.max() as f64 / 1e3,
    );
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

fn tokens(seed: usize) -> Vec<u32> {
    std::iter::once(seed as u32)
        .chain(std::iter::repeat_n(9906, TOKENS))
        .collect()
}

/// A bare ZeroMQ ROUTER that echoes every request back: the floor any server on
/// libzmq can reach on this machine, measured with the same client and the same
/// frames as the server's noop.
fn echo_baseline(n: usize) -> Histogram<u64> {
    let port = free_port();
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
    let total = n + n / 10;
    let echo = std::thread::spawn(move || {
        for _ in 0..total {
            let mut frames = router.recv_multipart(0).unwrap();
            // Answer as the server does: [identity, uid, op, "OK"].
            frames.push(vec![0xa2, b'O', b'K']);
            router.send_multipart(frames, 0).unwrap();
        }
    });
    let mut c = Client::connect(port);
    for _ in 0..n / 10 {
        c.noop_ok();
    }
    let mut h = hist();
    for _ in 0..n {
        let t = Instant::now();
        c.noop_ok();
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    echo.join().unwrap();
    h
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run under cargo test: debug build, few iterations; figures come from `cargo bench`)");
    }
    let (n_noop, n_lookup, n_pc) = if full {
        (50_000, 5_000, 2_000)
    } else {
        (200, 20, 10)
    };
    let srv = Server::start(&[
        "--chunk-size",
        "256",
        "--l1-size-gb",
        "1",
        "--no-l1-use-lazy",
    ]);
    let mut c = srv.client();

    // noop: the floor of a round trip through the front thread.
    for _ in 0..n_noop / 10 {
        c.noop_ok();
    }
    let mut h = hist();
    for _ in 0..n_noop {
        let t = Instant::now();
        c.noop_ok();
        h.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    report("noop round trip", &h);
    let base = echo_baseline(n_noop);
    report("baseline: bare libzmq echo", &base);
    println!(
        "noop p50 / bare echo p50 = {:.2}",
        h.value_at_quantile(0.5) as f64 / base.value_at_quantile(0.5) as f64
    );

    // A small layout keeps the data copy out of the RPC figures.
    let reg = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                1,
                "bench",
                1,
                2,
                64,
                false,
                CHUNK as i64,
            )],
        )
        .expect("register reply");
    let pool_name = reg.get("shm_name").unwrap().str().to_owned();
    let pool_len = reg.get("pool_size").unwrap().int() as usize;
    let _pool = ShmMap::open(&pool_name, pool_len);
    let end = (TOKENS / CHUNK * CHUNK) as i64;

    // prepare_store + commit_store of a fresh 2048-token request (8 chunks).
    let mut hp = hist();
    for i in 0..n_pc {
        let toks = tokens(i);
        let key = ipc_key("bench", 1, Some(0), &toks, 0, end, &format!("s{i}"), 1);
        let t = Instant::now();
        let r = c
            .call(OP_PREPARE_STORE, &[key.clone(), V::I(1)])
            .expect("prepare_store");
        assert_eq!(
            r.get("context").unwrap().get("slots").unwrap().arr().len(),
            TOKENS / CHUNK
        );
        assert_eq!(
            c.call(OP_COMMIT_STORE, &[key, V::I(1), V::Bin(vec![])]),
            Some(V::B(true))
        );
        hp.record(t.elapsed().as_nanos() as u64).unwrap();
        c.call(OP_END_SESSION, &[s(&format!("s{i}"))]);
    }
    report("prepare+commit store (8 chunks)", &hp);

    // lookup + query_prefetch_status of a stored request: a full hit of 8 chunks.
    let mut hl = hist();
    let mut hr = hist();
    for i in 0..n_lookup {
        // The most recent requests: older ones may have been evicted from L1.
        let idx = n_pc - 1 - i % n_pc.min(256);
        let toks = tokens(idx);
        let rid = format!("l{i}");
        let t = Instant::now();
        assert_eq!(
            c.call(
                OP_LOOKUP,
                &[ipc_key("bench", 1, None, &toks, 0, end, &rid, 1), V::I(1)]
            ),
            None
        );
        let hits = c.prefetch_result(&rid);
        hl.record(t.elapsed().as_nanos() as u64).unwrap();
        assert_eq!(hits, (TOKENS / CHUNK) as i64);
        // Then the retrieve round trips, which release the lookup's locks.
        let key = ipc_key("bench", 1, Some(0), &toks, 0, end, &rid, 1);
        let t = Instant::now();
        let r = c
            .call(OP_PREPARE_RETRIEVE, &[key.clone(), V::I(1)])
            .expect("prepare_retrieve");
        assert_eq!(r.get("success"), Some(&V::B(true)));
        assert_eq!(
            c.call(OP_COMMIT_RETRIEVE, &[key, V::I(1)]),
            Some(V::B(true))
        );
        hr.record(t.elapsed().as_nanos() as u64).unwrap();
        c.call(OP_END_SESSION, &[s(&rid)]);
    }
    report("lookup+status (2048 tokens, hit)", &hl);
    report("prepare+commit retrieve (8 chunks)", &hr);
}
