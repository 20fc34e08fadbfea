//! Cost of signing: a warm `Signer` must not allocate, and the ignored test
//! prints the time per sign (no timing assertions):
//!
//! ```text
//! cargo test -p kvshard-s3-raw --release --test sign_cost -- --ignored --nocapture
//! ```
//!
//! The non-ignored test runs the same loop a few times so it keeps working.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;
use std::time::Instant;

use kvshard_s3_raw::credentials::Credentials;
use kvshard_s3_raw::sigv4::{
    PayloadHash, SignableRequest, Signer, SigningParams, SigningSettings, SigningTime,
};

/// Counts heap allocations made by the current thread.
struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// A ranged GET as lmcache's CRT client sends it, plus a ListObjectsV2 query.
fn sign_loop(signer: &mut Signer, creds: &Credentials, iterations: u64) -> u64 {
    let settings = SigningSettings::s3();
    let query = [
        ("list-type", "2"),
        (
            "continuation-token",
            "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=",
        ),
    ];
    let headers = [
        ("Range", "bytes=0-8388607"),
        ("Content-Type", "application/octet-stream"),
        ("User-Agent", "kvshard/0.1"),
        ("x-amz-meta-kv-rank", "0000001a"),
    ];
    let mut checksum = 0u64;
    for i in 0..iterations {
        let req = SignableRequest {
            method: "GET",
            host: "lmcache-kv.s3.us-east-1.amazonaws.com",
            path: "/Qwen/Qwen3-Coder-30B@0000001a@0@6c9faa6ae5af1bdf6c9faa6ae5af1bdf",
            query: &query,
            headers: &headers,
            payload: PayloadHash::Unsigned,
        };
        let params = SigningParams {
            credentials: creds,
            region: "us-east-1",
            service: "s3",
            // Same day, changing second: the key cache hits.
            time: SigningTime::UnixSecs(1_706_745_600 + i % 86_400),
            settings: &settings,
        };
        let signed = signer.sign(black_box(&req), &params).expect("signs");
        checksum = checksum.wrapping_add(u64::from(signed.signature().as_bytes()[0]));
    }
    checksum
}

fn creds() -> Credentials {
    Credentials::new(
        "AKIDEXAMPLE",
        "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        Some("FwoGZXIvYXdzEBYaDH+session+token+of+a+realistic+length+for+sts".to_owned()),
        None,
    )
    .unwrap()
}

#[test]
fn warm_signer_does_not_allocate() {
    let creds = creds();
    let mut signer = Signer::new();
    // Warm up: buffers grow to size, the key is derived.
    sign_loop(&mut signer, &creds, 4);
    let before = allocations();
    black_box(sign_loop(&mut signer, &creds, 200));
    let after = allocations();
    assert_eq!(after - before, 0, "warm signs allocated");
    assert_eq!(signer.stats().key_derivations, 1);
}

#[test]
#[ignore = "prints timings; run with --release --ignored --nocapture"]
fn sign_cost() {
    let creds = creds();
    let mut signer = Signer::new();
    sign_loop(&mut signer, &creds, 1000);
    let iterations = 200_000;
    let start = Instant::now();
    black_box(sign_loop(&mut signer, &creds, iterations));
    let warm = start.elapsed();

    // Cold: a fresh signer per request, so every sign derives the key and
    // grows its buffers.
    let cold_iterations = 20_000;
    let start = Instant::now();
    for _ in 0..cold_iterations {
        let mut fresh = Signer::new();
        black_box(sign_loop(&mut fresh, &creds, 1));
    }
    let cold = start.elapsed();
    let oracle_iterations = 20_000;
    let oracle = time_aws_sigv4(oracle_iterations);
    println!(
        "warm sign: {:.0} ns; cold sign (new signer, key derivation): {:.0} ns; \
         aws-sigv4 for comparison: {:.0} ns",
        warm.as_nanos() as f64 / iterations as f64,
        cold.as_nanos() as f64 / cold_iterations as f64,
        oracle.as_nanos() as f64 / oracle_iterations as f64
    );
}

/// The same request through the `aws-sigv4` crate (S3 settings).
fn time_aws_sigv4(iterations: u32) -> std::time::Duration {
    use aws_sigv4::http_request::{
        sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest as Req,
        SigningSettings as Settings, UriPathNormalizationMode,
    };
    let identity = aws_credential_types::Credentials::new(
        "AKIDEXAMPLE",
        "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        Some("FwoGZXIvYXdzEBYaDH+session+token+of+a+realistic+length+for+sts".to_owned()),
        None,
        "bench",
    )
    .into();
    let mut settings = Settings::default();
    settings.percent_encoding_mode = PercentEncodingMode::Single;
    settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
    settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region("us-east-1")
        .name("s3")
        .time(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_706_745_600))
        .settings(settings)
        .build()
        .unwrap()
        .into();
    let uri = "https://lmcache-kv.s3.us-east-1.amazonaws.com/Qwen/Qwen3-Coder-30B%400000001a%400%406c9faa6ae5af1bdf6c9faa6ae5af1bdf?list-type=2&continuation-token=1ueGcxLPRx1Tr%2FXYExHnhbYLgveDs2J%2Fwm36Hy4vbOwM%3D";
    let headers = [
        ("Range", "bytes=0-8388607"),
        ("Content-Type", "application/octet-stream"),
        ("User-Agent", "kvshard/0.1"),
        ("x-amz-meta-kv-rank", "0000001a"),
    ];
    let start = Instant::now();
    for _ in 0..iterations {
        let req = Req::new(
            "GET",
            uri,
            headers.iter().copied(),
            SignableBody::UnsignedPayload,
        )
        .unwrap();
        black_box(sign(req, &params).unwrap());
    }
    start.elapsed()
}
