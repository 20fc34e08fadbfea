//! put/get/head/delete/list round trips against s3s-fs over HTTP/1.1 and
//! h2c, byte-compared, with awkward keys and objects on both sides of the
//! multipart threshold.

use kvshard_s3_raw::error::Cause;
use kvshard_s3_raw::http::Protocol;
use kvshard_s3_raw::{ErrorKind, Op, Outcome, PayloadSigning, RecvRegion, S3Client, SendRegion};

use crate::support::*;

/// Keys with `@`, `/`, spaces and `%` (lmcache names contain `@`).
pub const KEYS: &[&str] = &[
    "Qwen_Qwen3-Coder@0000001a@0@6c9faa6ae5af1bdf",
    "model/with/slashes@00000000@1@ab",
    "a key with spaces@00000002@0@cd",
    "percent%20literal%2Fnot-decoded@00000003@0@ef",
];

/// 1 byte and 1 MiB (one request each way), and 11 MiB + 3 (a 3-part
/// multipart upload under the test part size of 5 MiB, the smallest part S3
/// and s3s-fs accept, and over HTTP/1.1 3 ranged GETs) for the keys at even
/// positions.
pub const SIZES: &[usize] = &[1, 1 << 20, (11 << 20) + 3];

fn sizes_for(key_index: usize) -> &'static [usize] {
    if key_index % 2 == 0 {
        SIZES
    } else {
        &SIZES[..2]
    }
}

/// The whole suite on one client.
pub async fn suite(client: &S3Client, label: &str) {
    for (k, key) in KEYS.iter().enumerate() {
        for (s, &size) in sizes_for(k).iter().enumerate() {
            let data = pattern(size, (k * 10 + s) as u64);
            client
                .put_object(key, SendRegion::from_vec(data.clone()))
                .await
                .unwrap_or_else(|e| panic!("{label}: put {key:?} {size}: {e}"));
            assert_eq!(
                client.head_object(key).await.unwrap(),
                Some(size as u64),
                "{label}: head {key:?}"
            );
            let mut back = vec![0u8; size];
            client
                .get_object_into(key, RecvRegion::from_mut_slice(&mut back))
                .await
                .unwrap_or_else(|e| panic!("{label}: get {key:?} {size}: {e}"));
            assert!(back == data, "{label}: bytes differ for {key:?} {size}");

            // A destination of the wrong size is an error, never Ok.
            let mut wrong = vec![0u8; size + 1];
            let e = client
                .get_object_into(key, RecvRegion::from_mut_slice(&mut wrong))
                .await
                .expect_err("a size mismatch must fail");
            assert_eq!(e.kind(), ErrorKind::Fatal, "{label}: {e}");
            if size > 1 {
                let mut short = vec![0u8; size - 1];
                let e = client
                    .get_object_into(key, RecvRegion::from_mut_slice(&mut short))
                    .await
                    .expect_err("a size mismatch must fail");
                assert_eq!(e.kind(), ErrorKind::Fatal, "{label}: {e}");
                assert!(
                    matches!(e.cause(), Cause::SizeMismatch { .. }) || e.status() == Some(416),
                    "{label}: {e}"
                );
            }
        }
    }

    // Missing objects.
    assert_eq!(client.head_object("no/such@key").await.unwrap(), None);
    let mut buf = vec![0u8; 10];
    let e = client
        .get_object_into("no/such@key", RecvRegion::from_mut_slice(&mut buf))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{label}: {e}");

    // Listing with small pages.
    let prefix = "list dir/";
    let mut names: Vec<String> = (0..7).map(|i| format!("{prefix}obj@{i:02} x%")).collect();
    names.sort();
    for (i, name) in names.iter().enumerate() {
        client
            .put_object(name, SendRegion::from_vec(pattern(i + 1, 99)))
            .await
            .unwrap();
    }
    let page = client
        .list_objects_v2(Some(prefix), None, Some(3))
        .await
        .unwrap();
    assert_eq!(page.contents.len(), 3, "{label}: {page:?}");
    assert!(page.is_truncated && page.next_continuation_token.is_some());
    let second = client
        .list_objects_v2(
            Some(prefix),
            page.next_continuation_token.as_deref(),
            Some(3),
        )
        .await
        .unwrap();
    assert_eq!(second.contents.len(), 3);
    assert_ne!(page.contents[0].key, second.contents[0].key);
    let all = client
        .list_all_objects(Some(prefix), Some(2))
        .await
        .unwrap();
    let listed: Vec<String> = all.iter().map(|o| o.key.clone()).collect();
    assert_eq!(listed, names, "{label}");
    assert_eq!(all[6].size, 7);
    let everything = client.list_all_objects(None, Some(5)).await.unwrap();
    assert_eq!(everything.len(), KEYS.len() + names.len(), "{label}");

    // Delete, then it is gone.
    let every_key: Vec<&str> = KEYS
        .iter()
        .copied()
        .chain(names.iter().map(String::as_str))
        .collect();
    for key in every_key {
        assert!(
            client.delete_object(key).await.unwrap(),
            "{label}: delete {key:?}"
        );
        assert_eq!(client.head_object(key).await.unwrap(), None);
    }
    assert!(client
        .list_all_objects(None, None)
        .await
        .unwrap()
        .is_empty());

    let stats = client.stats();
    assert_eq!(stats.retries, 0, "{label}: {stats:?}");
    let multipart_keys = KEYS.len().div_ceil(2) as u64;
    assert_eq!(stats.count(Op::UploadPart, Outcome::Ok), 3 * multipart_keys);
    assert_eq!(
        stats.count(Op::CreateMultipartUpload, Outcome::Ok),
        multipart_keys
    );
    assert_eq!(
        stats.count(Op::CompleteMultipartUpload, Outcome::Ok),
        multipart_keys
    );
    let payload: u64 = (0..KEYS.len())
        .map(|k| sizes_for(k).iter().map(|&s| s as u64).sum::<u64>())
        .sum();
    assert!(stats.bytes_sent >= payload, "{label}: {stats:?}");
    assert!(stats.bytes_received >= payload, "{label}: {stats:?}");
    assert_eq!(stats.breaker_trips, 0);
}

#[test]
fn http1_path_style_round_trips() {
    let server = S3sFs::start("kvshard-h1");
    let cfg = test_config(server.path_style_address(), false);
    on_shard("s3-h1", move || async move {
        let client = S3Client::new(cfg).unwrap();
        suite(&client, "http1").await;
        assert_eq!(client.protocol(), Some(Protocol::Http1));
        let stats = client.stats();
        assert_eq!(stats.connections.http2_opened, 0);
        assert!(stats.connections.http1_opened >= 1);
        assert!(
            stats.connections.http1_reused > stats.connections.http1_opened,
            "keep-alive reuses connections: {:?}",
            stats.connections
        );
        assert!(stats.connections.http1_opened <= 64);
    });
    drop(server);
}

#[test]
fn h2c_virtual_hosted_round_trips() {
    let server = S3sFs::start("kvshard-h2c");
    let mut cfg = test_config(server.virtual_hosted_address(), true);
    whole_object_gets(&mut cfg);
    on_shard("s3-h2c", move || async move {
        let client = S3Client::new(cfg).unwrap();
        suite(&client, "h2c").await;
        assert_eq!(client.protocol(), Some(Protocol::Http2));
        let stats = client.stats();
        assert_eq!(stats.connections.http1_opened, 0);
        // Multiplexed: one connection carries everything.
        assert_eq!(stats.connections.http2_opened, 1, "{:?}", stats.connections);
    });
    drop(server);
}

/// lmcache's default `s3_prefer_http2: true` with `disable_tls: true`
/// against a store that speaks only HTTP/1.1 (the CRT never tries h2c, so
/// that configuration works with lmcache): the h2c probe is refused and the
/// client speaks HTTP/1.1.
#[test]
fn h2c_preference_falls_back_to_http1_on_a_server_without_h2c() {
    use std::sync::Arc;
    let server = ScriptedServer::start(Arc::new(|_, req, stream| {
        if req.method == "PRI" {
            // What an HTTP/1.1 server makes of the HTTP/2 preface.
            respond(stream, "400 Bad Request", &[("Connection", "close")], b"");
            return Action::Close;
        }
        if !skip_body(stream, req.body_len) {
            return Action::Close;
        }
        match req.method.as_str() {
            "PUT" => respond(stream, "200 OK", &[("ETag", "\"e\"")], b""),
            _ => respond(stream, "200 OK", &[], b"hello"),
        }
        Action::KeepAlive
    }));
    let cfg = test_config(local_address("kvshard-h1only", server.port), true);
    on_shard("s3-h2c-fallback", move || async move {
        let client = S3Client::new(cfg).unwrap();
        client
            .put_object(
                "k",
                SendRegion::from_bytes(bytes::Bytes::from_static(b"hello")),
            )
            .await
            .expect("PUT over HTTP/1.1");
        let mut back = [0u8; 5];
        client
            .get_object_into("k", RecvRegion::from_mut_slice(&mut back))
            .await
            .expect("GET over HTTP/1.1");
        assert_eq!(&back, b"hello");
        assert_eq!(client.protocol(), Some(Protocol::Http1));
        let stats = client.stats();
        assert_eq!(stats.connections.http2_opened, 0, "{:?}", stats.connections);
        assert_eq!(stats.connections.http1_opened, 1, "{:?}", stats.connections);
    });
    let methods: Vec<String> = server
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.method.clone())
        .collect();
    assert_eq!(
        methods,
        ["PRI", "PUT", "GET"],
        "one probe, then HTTP/1.1 on one connection"
    );
}

#[test]
fn signed_payload_hashes_are_accepted() {
    // s3s-fs checks x-amz-content-sha256 against the body.
    let server = S3sFs::start("kvshard-sha");
    let mut cfg = test_config(server.path_style_address(), true);
    whole_object_gets(&mut cfg);
    cfg.payload_signing = PayloadSigning::Sha256;
    on_shard("s3-sha", move || async move {
        let client = S3Client::new(cfg).unwrap();
        for &size in &[0usize, 1, (10 << 20) + 1] {
            let key = format!("signed@{size}");
            let data = pattern(size, 7);
            client
                .put_object(&key, SendRegion::from_vec(data.clone()))
                .await
                .unwrap_or_else(|e| panic!("put {size}: {e}"));
            let mut back = vec![0u8; size];
            client
                .get_object_into(&key, RecvRegion::from_mut_slice(&mut back))
                .await
                .unwrap();
            assert!(back == data);
        }
    });
    drop(server);
}

#[test]
fn wrong_secret_is_permission_denied_and_not_retried() {
    let server = S3sFs::start("kvshard-auth");
    let mut cfg = test_config(server.path_style_address(), false);
    cfg.credentials = credentials("not-the-secret");
    on_shard("s3-auth", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let e = client
            .put_object("k@1", SendRegion::from_vec(vec![1, 2, 3]))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
        assert_eq!(e.status(), Some(403));
        assert_eq!(e.s3_code(), Some("SignatureDoesNotMatch"));
        assert_eq!(e.attempts(), 1);
        let text = e.to_string();
        assert!(
            text.contains("PutObject") && text.contains("\"k@1\"") && text.contains("403"),
            "{text}"
        );
        let e = client.head_object("k@1").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
        let mut buf = vec![0u8; 3];
        let e = client
            .get_object_into("k@1", RecvRegion::from_mut_slice(&mut buf))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
        let stats = client.stats();
        assert_eq!(stats.sent(Op::PutObject), 1, "{stats:?}");
        assert_eq!(stats.sent(Op::HeadObject), 1, "{stats:?}");
        assert_eq!(stats.sent(Op::GetObject), 1);
        assert_eq!(
            stats.count(Op::PutObject, Outcome::Failed(ErrorKind::PermissionDenied)),
            1
        );
        assert_eq!(stats.retries, 0);
        // HTTP errors never move the breaker.
        assert_eq!(client.breaker_status().connection_failures, 0);
    });
    drop(server);
}

/// 24 operations at once: PUT then GET, byte-compared.
async fn concurrent_round_trips(client: &S3Client) {
    let ops = (0..24u64).map(|i| async move {
        let key = format!("concurrent/obj@{i:02}");
        let data = pattern(100_000 + i as usize * 1000, i);
        client
            .put_object(&key, SendRegion::from_vec(data.clone()))
            .await
            .unwrap();
        let mut back = vec![0u8; data.len()];
        client
            .get_object_into(&key, RecvRegion::from_mut_slice(&mut back))
            .await
            .unwrap();
        assert!(back == data, "object {i}");
    });
    futures_util::future::join_all(ops).await;
}

#[test]
fn http1_pool_is_bounded_and_queues_waiters() {
    let server = S3sFs::start("kvshard-pool");
    let mut cfg = test_config(server.path_style_address(), false);
    cfg.max_connections = 3;
    on_shard("s3-pool-h1", move || async move {
        let client = S3Client::new(cfg).unwrap();
        concurrent_round_trips(&client).await;
        let c = client.stats().connections;
        assert!(c.http1_opened <= 3, "{c:?}");
        assert!(c.http1_reused >= 48 - 3, "{c:?}");
    });
    drop(server);
}

#[test]
fn h2_opens_another_connection_only_when_streams_run_out() {
    let server = S3sFs::start("kvshard-pool2");
    let mut cfg = test_config(server.path_style_address(), true);
    whole_object_gets(&mut cfg);
    cfg.h2_max_streams_per_connection = 4;
    cfg.h2_max_connections = 2;
    on_shard("s3-pool-h2", move || async move {
        let client = S3Client::new(cfg).unwrap();
        concurrent_round_trips(&client).await;
        let c = client.stats().connections;
        assert_eq!(c.http2_opened, 2, "{c:?}");
        assert_eq!(c.http1_opened, 0, "{c:?}");
    });
    drop(server);
}
