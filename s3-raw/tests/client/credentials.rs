//! The client's chain credentials: fetched on the shard's executor,
//! refreshed in the background ahead of expiry, a failed first fetch failing
//! requests clearly; and end to end, IMDS credentials signing requests to
//! s3s-fs.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvshard_s3_raw::credentials::Env;
use kvshard_s3_raw::error::Cause;
use kvshard_s3_raw::{
    CredentialsConfig, ErrorKind, Op, Outcome, RecvRegion, S3Client, S3ClientConfig, SendRegion,
};

use crate::mock_http::*;
use crate::support::*;

/// An environment with no profile files whose chain ends at `imds`.
fn imds_env(home: &TempDir, imds_endpoint: &str) -> Env {
    Env::from_pairs([
        ("HOME", home.path().to_str().unwrap()),
        ("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds_endpoint),
    ])
}

/// Access key and session token of each request, in arrival order.
type Signed = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// An S3 stand-in that accepts every PUT and records the access key and
/// session token each request was signed with.
fn recording_s3() -> (ScriptedServer, Signed) {
    let signed = Arc::new(Mutex::new(Vec::new()));
    let record = signed.clone();
    let server = ScriptedServer::start(Arc::new(move |_, req, stream: &mut TcpStream| {
        if !skip_body(stream, req.body_len) {
            return Action::Close;
        }
        let header = |name: &str| {
            req.headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let key = header("authorization")
            .and_then(|a| {
                a.split("Credential=")
                    .nth(1)
                    .and_then(|c| c.split('/').next())
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        record
            .lock()
            .unwrap()
            .push((key, header("x-amz-security-token")));
        respond(stream, "200 OK", &[("ETag", "\"e\"")], b"");
        Action::KeepAlive
    }));
    (server, signed)
}

fn chain_config(address: kvshard_s3_raw::addressing::BucketAddress, env: Env) -> S3ClientConfig {
    let mut cfg = test_config(address, false);
    cfg.credentials = CredentialsConfig::Chain(env);
    cfg.credentials_refresh.connect_timeout = Duration::from_millis(500);
    cfg.credentials_refresh.read_timeout = Duration::from_secs(5);
    cfg
}

#[test]
fn imds_credentials_sign_requests_to_s3s_fs() {
    // s3s-fs 0.14.1 checks the signature (the security token header is
    // signed like any other) and ignores the token's value, so the mock
    // IMDS hands out a session token as the real one does.
    let server = S3sFs::start("kvshard-imds-e2e");
    let imds = MockImds::serving(ACCESS_KEY, SECRET_KEY, Some("imds-session-token"));
    let home = TempDir::new("imds-e2e");
    let cfg = chain_config(
        server.path_style_address(),
        imds_env(&home, &imds.endpoint()),
    );
    let credential_gets = imds.credential_gets.clone();
    on_shard("s3-imds-e2e", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let data = pattern(300 << 10, 11);
        client
            .put_object("imds@1", SendRegion::from_vec(data.clone()))
            .await
            .unwrap();
        let mut back = vec![0u8; data.len()];
        client
            .get_object_into("imds@1", RecvRegion::from_mut_slice(&mut back))
            .await
            .unwrap();
        assert!(back == data, "object differs");
        assert_eq!(client.head_object("imds@1").await.unwrap(), Some(300 << 10));
        assert!(client.delete_object("imds@1").await.unwrap());
        let stats = client.stats();
        assert_eq!(stats.credentials_fetched, 1);
        assert_eq!(stats.credentials_refreshed, 0);
        assert_eq!(credential_gets.load(Ordering::SeqCst), 1);
    });
    // Token PUT, role list, credentials: once for all four operations.
    assert_eq!(imds.server.request_count(), 3);
}

#[test]
fn credentials_are_refreshed_ahead_of_expiry_without_stalling_requests() {
    // First credentials expire in 10 minutes, inside the 15-minute refresh
    // window: the first request that finds them starts a background fetch,
    // which the mock answers slowly.
    let imds = MockImds::start(Arc::new(|n| {
        if n == 0 {
            MockResponse::new(
                200,
                credentials_json(
                    "ASIAFIRST",
                    "first-secret",
                    Some("first-token"),
                    Duration::from_secs(600),
                ),
            )
        } else {
            MockResponse::new(
                200,
                credentials_json(
                    "ASIASECOND",
                    "second-secret",
                    Some("second-token"),
                    Duration::from_secs(6 * 3600),
                ),
            )
            .delayed(Duration::from_millis(1500))
        }
    }));
    let (s3, signed) = recording_s3();
    let home = TempDir::new("refresh");
    let mut cfg = chain_config(
        local_address("kvshard-refresh", s3.port),
        imds_env(&home, &imds.endpoint()),
    );
    cfg.credentials_refresh.refresh_before = Duration::from_secs(15 * 60);
    let credential_gets = imds.credential_gets.clone();
    on_shard("s3-cred-refresh", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let put = |n: u32| {
            let client = client.clone();
            async move {
                let started = Instant::now();
                client
                    .put_object(&format!("k@{n}"), SendRegion::from_vec(vec![1; 100]))
                    .await
                    .unwrap();
                started.elapsed()
            }
        };
        // The first request waits for the first fetch.
        put(0).await;
        assert_eq!(client.stats().credentials_fetched, 1);

        // While the refresh is under way, requests go out at once with the
        // current credentials.
        let refresh_started = Instant::now();
        let mut n = 1;
        while credential_gets.load(Ordering::SeqCst) < 2
            || refresh_started.elapsed() < Duration::from_millis(500)
        {
            let took = put(n).await;
            assert!(
                took < Duration::from_millis(1000),
                "request {n} stalled for {took:?} during the refresh"
            );
            n += 1;
            glommio::timer::sleep(Duration::from_millis(50)).await;
            assert!(refresh_started.elapsed() < Duration::from_secs(10));
        }
        assert_eq!(
            client.stats().credentials_refreshed,
            0,
            "the refresh is slow"
        );
        let during = n;

        // Once it lands, requests use the new credentials.
        let deadline = Instant::now() + Duration::from_secs(10);
        while client.stats().credentials_refreshed == 0 {
            assert!(Instant::now() < deadline, "no refresh within 10 s");
            glommio::timer::sleep(Duration::from_millis(50)).await;
        }
        put(n).await;
        let stats = client.stats();
        assert_eq!(
            (stats.credentials_fetched, stats.credentials_refreshed),
            (2, 1)
        );
        assert_eq!(credential_gets.load(Ordering::SeqCst), 2);

        let signed = signed.lock().unwrap().clone();
        assert_eq!(signed.len() as u32, n + 1);
        for (i, (key, token)) in signed.iter().enumerate() {
            let expected = if (i as u32) < during {
                ("ASIAFIRST", "first-token")
            } else {
                ("ASIASECOND", "second-token")
            };
            assert_eq!(
                (key.as_str(), token.as_deref()),
                (expected.0, Some(expected.1))
            );
        }
    });
}

#[test]
fn failed_refresh_keeps_valid_credentials_and_retries_later() {
    let imds = MockImds::start(Arc::new(|n| {
        if n == 0 {
            MockResponse::new(
                200,
                credentials_json(
                    "ASIAKEEP",
                    "keep-secret",
                    Some("keep-token"),
                    Duration::from_secs(600),
                ),
            )
        } else {
            MockResponse::new(500, "")
        }
    }));
    let (s3, signed) = recording_s3();
    let home = TempDir::new("refresh-fails");
    let mut cfg = chain_config(
        local_address("kvshard-refresh-fails", s3.port),
        imds_env(&home, &imds.endpoint()),
    );
    cfg.credentials_refresh.refresh_before = Duration::from_secs(15 * 60);
    cfg.credentials_refresh.retry_after = Duration::from_millis(100);
    on_shard("s3-cred-refresh-fails", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut n = 0;
        while client.stats().credentials_refresh_failures < 2 {
            assert!(Instant::now() < deadline, "{:?}", client.stats());
            client
                .put_object(&format!("k@{n}"), SendRegion::from_vec(vec![2; 10]))
                .await
                .unwrap();
            n += 1;
            glommio::timer::sleep(Duration::from_millis(60)).await;
        }
        let stats = client.stats();
        assert_eq!(
            (stats.credentials_fetched, stats.credentials_refreshed),
            (1, 0)
        );
        assert!(signed
            .lock()
            .unwrap()
            .iter()
            .all(|(k, t)| k == "ASIAKEEP" && t.as_deref() == Some("keep-token")));
    });
}

#[test]
fn a_failed_first_fetch_fails_requests_clearly_and_is_not_retried() {
    let healthy = Arc::new(AtomicBool::new(false));
    let imds = {
        let healthy = healthy.clone();
        MockServer::start(Arc::new(move |_, req| {
            if !healthy.load(Ordering::SeqCst) {
                return MockResponse::new(500, "");
            }
            match (req.method.as_str(), req.path()) {
                ("PUT", _) => MockResponse::new(200, "T"),
                (_, "/latest/meta-data/iam/security-credentials/") => {
                    MockResponse::new(200, "role")
                }
                _ => MockResponse::new(
                    200,
                    credentials_json("ASIALATE", "late-secret", None, Duration::from_secs(3600)),
                ),
            }
        }))
    };
    let (s3, signed) = recording_s3();
    let home = TempDir::new("first-fails");
    let mut cfg = chain_config(
        local_address("kvshard-first-fails", s3.port),
        imds_env(&home, &imds.url()),
    );
    cfg.credentials_refresh.retry_after = Duration::from_millis(300);
    let imds_url = imds.url();
    let imds_count = imds.count.clone();
    let count = move || imds_count.load(Ordering::SeqCst);
    let s3_requests = s3.requests.clone();
    on_shard("s3-cred-first-fails", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let put = |key: &'static str| {
            let client = client.clone();
            async move {
                client
                    .put_object(key, SendRegion::from_vec(vec![3; 10]))
                    .await
            }
        };
        let started = Instant::now();
        let e = put("k@1").await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3));
        assert_eq!(e.kind(), ErrorKind::Fatal, "{e}");
        assert_eq!(e.attempts(), 1, "not retried: {e}");
        assert!(matches!(e.cause(), Cause::Credentials(_)), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("IMDSv2"), "{text}");
        assert!(
            text.contains(&format!("PUT {imds_url}/latest/api/token: HTTP 500")),
            "{text}"
        );
        assert_eq!(count(), 1);

        // Within retry_after the same error comes back without a fetch.
        let e = put("k@2").await.unwrap_err();
        assert!(matches!(e.cause(), Cause::Credentials(_)), "{e:?}");
        assert_eq!(count(), 1);
        // Nothing reached S3, and refusals are not counted as sent.
        assert_eq!(s3_requests.load(Ordering::SeqCst), 0);
        assert_eq!(client.stats().sent(Op::PutObject), 0);

        // Later, with the metadata service back, the next request fetches.
        healthy.store(true, Ordering::SeqCst);
        glommio::timer::sleep(Duration::from_millis(350)).await;
        put("k@3").await.unwrap();
        assert_eq!(count(), 4);
        let stats = client.stats();
        assert_eq!(stats.credentials_fetched, 1);
        assert_eq!(stats.count(Op::PutObject, Outcome::Ok), 1);
        assert_eq!(
            signed.lock().unwrap().clone(),
            vec![("ASIALATE".to_owned(), None)]
        );
    });
}
