//! S3 Express against a mock of our own: `GET /?session` mints sessions of
//! a configurable lifetime, every request's signature is recomputed with the
//! `aws-sigv4` crate (service `s3express`; data plane with the session
//! token in `x-amz-s3session-token`, `x-amz-security-token` refused), and
//! objects live in memory.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use kvshard_s3_raw::addressing::{resolve_bucket, AddressingConfig, BucketAddress};
use kvshard_s3_raw::error::Cause;
use kvshard_s3_raw::express::ExpressConfig;
use kvshard_s3_raw::retry::{Clock, ManualClock, SystemClock};
use kvshard_s3_raw::{ErrorKind, Op, Outcome, RecvRegion, S3Client, SendRegion};

use crate::common::parse_amz_date;
use crate::mock_http::iso8601;
use crate::support::*;

const BUCKET: &str = "kvshard--use1-az4--x-s3";
const BASE_KEY: &str = "AKIDEXPRESSBASE";
const BASE_SECRET: &str = "express-base-secret";

struct Session {
    secret: String,
    token: String,
    /// When the mock stops accepting it.
    expires: SystemTime,
}

struct MockState {
    /// The mock's time (the client's, in tests that move it).
    clock: Arc<dyn Clock>,
    /// Lifetime the mock enforces.
    server_ttl: Duration,
    /// Lifetime it reports in `Expiration` (normally the same).
    reported_ttl: Duration,
    sessions: HashMap<String, Session>,
    objects: HashMap<String, Vec<u8>>,
    create_sessions: usize,
    data_requests: usize,
    rejections: Vec<String>,
}

struct Rejection(u16, &'static str, String);

fn reject<T>(status: u16, code: &'static str, why: impl Into<String>) -> Result<T, Rejection> {
    Err(Rejection(status, code, why.into()))
}

fn xml_response(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/xml")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// `Credential=AK/date/region/service/aws4_request, SignedHeaders=.., Signature=..`
struct AuthHeader {
    access_key: String,
    region: String,
    service: String,
    signed_headers: Vec<String>,
    signature: String,
}

fn parse_authorization(value: &str) -> Option<AuthHeader> {
    let rest = value.strip_prefix("AWS4-HMAC-SHA256 ")?;
    let mut credential = None;
    let mut signed = None;
    let mut signature = None;
    for part in rest.split(',') {
        let (k, v) = part.trim().split_once('=')?;
        match k {
            "Credential" => credential = Some(v.to_owned()),
            "SignedHeaders" => signed = Some(v.to_owned()),
            "Signature" => signature = Some(v.to_owned()),
            _ => return None,
        }
    }
    let credential = credential?;
    let fields: Vec<&str> = credential.split('/').collect();
    if fields.len() != 5 || fields[4] != "aws4_request" {
        return None;
    }
    Some(AuthHeader {
        access_key: fields[0].to_owned(),
        region: fields[2].to_owned(),
        service: fields[3].to_owned(),
        signed_headers: signed?.split(';').map(str::to_owned).collect(),
        signature: signature?,
    })
}

fn header<'a>(parts: &'a hyper::http::request::Parts, name: &str) -> Option<&'a str> {
    parts.headers.get(name).and_then(|v| v.to_str().ok())
}

/// Recomputes the signature with `aws-sigv4` and compares.
fn verify_signature(
    parts: &hyper::http::request::Parts,
    auth: &AuthHeader,
    secret: &str,
    session_token: Option<&str>,
) -> Result<(), Rejection> {
    let Some(amz_date) = header(parts, "x-amz-date").filter(|d| d.len() == 16) else {
        return reject(403, "AccessDenied", "missing x-amz-date");
    };
    let secs = parse_amz_date(amz_date);
    let Some(content_sha) = header(parts, "x-amz-content-sha256") else {
        return reject(400, "InvalidRequest", "missing x-amz-content-sha256");
    };
    let host = header(parts, "host").unwrap_or_default().to_owned();
    let generated = [
        "x-amz-date",
        "x-amz-content-sha256",
        "x-amz-s3session-token",
        "x-amz-security-token",
    ];
    let mut headers: Vec<(String, String)> = Vec::new();
    for name in &auth.signed_headers {
        if generated.contains(&name.as_str()) {
            continue;
        }
        let Some(value) = header(parts, name) else {
            return reject(403, "AccessDenied", format!("signed header {name} missing"));
        };
        headers.push((name.clone(), value.to_owned()));
    }
    let identity = aws_credential_types::Credentials::new(
        auth.access_key.clone(),
        secret.to_owned(),
        session_token.map(str::to_owned),
        None,
        "mock",
    )
    .into();
    let mut settings = SigningSettings::default();
    settings.percent_encoding_mode = PercentEncodingMode::Single;
    settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
    settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    if session_token.is_some() {
        settings.session_token_name_override = Some("x-amz-s3session-token");
    }
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(&auth.region)
        .name(&auth.service)
        .time(UNIX_EPOCH + Duration::from_secs(secs))
        .settings(settings)
        .build()
        .unwrap()
        .into();
    let uri = format!(
        "http://{host}{}",
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let body = if content_sha == "UNSIGNED-PAYLOAD" {
        SignableBody::UnsignedPayload
    } else {
        SignableBody::Precomputed(content_sha.to_owned())
    };
    let request = SignableRequest::new(
        parts.method.as_str(),
        uri,
        headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        body,
    )
    .map_err(|e| Rejection(400, "InvalidRequest", format!("unsignable: {e}")))?;
    let (instructions, signature) = sign(request, &params)
        .map_err(|e| Rejection(400, "InvalidRequest", format!("oracle: {e}")))?
        .into_parts();
    if signature != auth.signature {
        return reject(
            403,
            "SignatureDoesNotMatch",
            "signature differs from aws-sigv4's",
        );
    }
    let mut oracle_signed: Vec<String> = instructions
        .headers()
        .map(|(k, _)| k.to_ascii_lowercase())
        .filter(|k| k != "authorization")
        .chain(headers.iter().map(|(k, _)| k.clone()))
        .collect();
    oracle_signed.sort();
    oracle_signed.dedup();
    let mut ours = auth.signed_headers.clone();
    ours.sort();
    if oracle_signed != ours {
        return reject(
            403,
            "SignatureDoesNotMatch",
            format!("signed headers {ours:?} != {oracle_signed:?}"),
        );
    }
    Ok(())
}

impl MockState {
    fn handle(
        &mut self,
        parts: &hyper::http::request::Parts,
        body: Bytes,
    ) -> Result<Response<Full<Bytes>>, Rejection> {
        let Some(auth) = header(parts, "authorization").and_then(parse_authorization) else {
            return reject(403, "AccessDenied", "no or malformed authorization");
        };
        if auth.service != "s3express" || auth.region != REGION {
            return reject(
                403,
                "AccessDenied",
                format!("scope {}/{}", auth.region, auth.service),
            );
        }
        let query = parts.uri.query().unwrap_or("");
        if query == "session=" || query == "session" {
            return self.create_session(parts, &auth);
        }
        self.data_plane(parts, &auth, body)
    }

    fn create_session(
        &mut self,
        parts: &hyper::http::request::Parts,
        auth: &AuthHeader,
    ) -> Result<Response<Full<Bytes>>, Rejection> {
        if parts.method != hyper::Method::GET {
            return reject(405, "MethodNotAllowed", "CreateSession is a GET");
        }
        if header(parts, "x-amz-s3session-token").is_some() {
            return reject(400, "InvalidRequest", "CreateSession with a session token");
        }
        if auth.access_key != BASE_KEY {
            return reject(403, "InvalidAccessKeyId", "unknown base key");
        }
        verify_signature(parts, auth, BASE_SECRET, None)?;
        self.create_sessions += 1;
        let n = self.create_sessions;
        let now = self.clock.wall();
        let key = format!("ASIAMOCK{n:06}");
        let secret = format!("session-secret-{n}");
        let token = format!("session-token-{n}+/=");
        self.sessions.insert(
            key.clone(),
            Session {
                secret: secret.clone(),
                token: token.clone(),
                expires: now + self.server_ttl,
            },
        );
        let xml = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CreateSessionResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Credentials><SessionToken>{token}</SessionToken><SecretAccessKey>{secret}</SecretAccessKey><AccessKeyId>{key}</AccessKeyId><Expiration>{}</Expiration></Credentials></CreateSessionResult>",
            iso8601(now + self.reported_ttl)
        );
        Ok(xml_response(200, xml))
    }

    fn data_plane(
        &mut self,
        parts: &hyper::http::request::Parts,
        auth: &AuthHeader,
        body: Bytes,
    ) -> Result<Response<Full<Bytes>>, Rejection> {
        if header(parts, "x-amz-security-token").is_some() {
            return reject(
                400,
                "InvalidRequest",
                "x-amz-security-token on the data plane",
            );
        }
        let Some(token) = header(parts, "x-amz-s3session-token") else {
            return reject(403, "AccessDenied", "no x-amz-s3session-token");
        };
        let Some(session) = self.sessions.get(&auth.access_key) else {
            return reject(403, "InvalidAccessKeyId", "unknown session key");
        };
        if session.token != token {
            return reject(403, "InvalidToken", "token does not match the session");
        }
        if session.expires <= self.clock.wall() {
            return reject(400, "ExpiredToken", "the session has expired");
        }
        let secret = session.secret.clone();
        let token = session.token.clone();
        verify_signature(parts, auth, &secret, Some(&token))?;
        self.data_requests += 1;
        let path = parts.uri.path().to_owned();
        let empty = || Full::new(Bytes::new());
        let resp = match parts.method.as_str() {
            "PUT" => {
                self.objects.insert(path, body.to_vec());
                Response::builder()
                    .status(200)
                    .header("etag", "\"mock\"")
                    .body(empty())
            }
            "GET" => match self.objects.get(&path) {
                Some(data) => Response::builder()
                    .status(200)
                    .body(Full::new(Bytes::from(data.clone()))),
                None => {
                    return reject(404, "NoSuchKey", "no such key");
                }
            },
            "HEAD" => match self.objects.get(&path) {
                Some(data) => Response::builder()
                    .status(200)
                    .header("content-length", data.len())
                    .body(empty()),
                None => Response::builder().status(404).body(empty()),
            },
            "DELETE" => {
                self.objects.remove(&path);
                Response::builder().status(204).body(empty())
            }
            m => return reject(405, "MethodNotAllowed", m.to_owned()),
        };
        Ok(resp.unwrap())
    }
}

struct ExpressMock {
    port: u16,
    state: Arc<Mutex<MockState>>,
    stop: Arc<AtomicBool>,
    shard: Option<kvshard_io::executor::ShardHandle>,
}

impl ExpressMock {
    fn start(server_ttl: Duration, reported_ttl: Duration) -> ExpressMock {
        ExpressMock::start_with_clock(server_ttl, reported_ttl, Arc::new(SystemClock))
    }

    fn start_with_clock(
        server_ttl: Duration,
        reported_ttl: Duration,
        clock: Arc<dyn Clock>,
    ) -> ExpressMock {
        let state = Arc::new(Mutex::new(MockState {
            clock,
            server_ttl,
            reported_ttl,
            sessions: HashMap::new(),
            objects: HashMap::new(),
            create_sessions: 0,
            data_requests: 0,
            rejections: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let shard = {
            let (state, stop) = (state.clone(), stop.clone());
            kvshard_io::executor::spawn_shard(0, None, "express-mock".into(), move || async move {
                let listener = glommio::net::TcpListener::bind("127.0.0.1:0").unwrap();
                port_tx.send(listener.local_addr().unwrap().port()).unwrap();
                let serve = kvshard_io::http::serve_http1(listener, move || {
                    let state = state.clone();
                    hyper::service::service_fn(move |req: Request<Incoming>| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(&state, req).await) }
                    })
                });
                let stopped = async {
                    while !stop.load(Ordering::SeqCst) {
                        glommio::timer::sleep(Duration::from_millis(20)).await;
                    }
                    Ok(())
                };
                let _ = futures_lite::future::or(serve, stopped).await;
            })
            .expect("start the express mock")
        };
        ExpressMock {
            port: port_rx.recv().unwrap(),
            state,
            stop,
            shard: Some(shard),
        }
    }

    fn address(&self) -> BucketAddress {
        let url = format!("s3://{BUCKET}.localhost:{}", self.port);
        let address = resolve_bucket(&AddressingConfig {
            bucket_url: &url,
            region: REGION,
            endpoint_url: None,
            disable_tls: true,
        })
        .unwrap();
        assert!(address.directory_bucket.is_some());
        address
    }
}

impl Drop for ExpressMock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(shard) = self.shard.take() {
            let _ = shard.join();
        }
    }
}

async fn handle(state: &Mutex<MockState>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut st = state.lock().unwrap();
    match st.handle(&parts, body) {
        Ok(resp) => resp,
        Err(Rejection(status, code, why)) => {
            st.rejections.push(format!(
                "{} {}: {status} {code}: {why}",
                parts.method, parts.uri
            ));
            xml_response(
                status,
                format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{why}</Message></Error>"
                ),
            )
        }
    }
}

fn express_config(mock: &ExpressMock, secret: &str) -> kvshard_s3_raw::S3ClientConfig {
    let mut cfg = test_config(mock.address(), false);
    cfg.credentials = kvshard_s3_raw::CredentialsConfig::Static(
        kvshard_s3_raw::credentials::Credentials::new(BASE_KEY, secret, None, None).unwrap(),
    );
    cfg.enable_s3express = true;
    cfg.multipart_threshold_bytes = 64 << 20;
    cfg.part_size_bytes = 64 << 20;
    cfg
}

#[test]
fn sessions_refresh_ahead_of_expiry_and_no_request_fails() {
    // Sessions of 6 s, refreshed with 5 s left, unusable with 0.5 s left: a
    // 7 s run crosses several refreshes, and each background refresh has
    // over 3 s (the reported expiry is whole seconds) to land before a
    // request would have to wait, which a busy 2-core CI host needs (2 s
    // was not always enough there).
    let ttl = Duration::from_secs(6);
    let mock = ExpressMock::start(ttl, ttl);
    let mut cfg = express_config(&mock, BASE_SECRET);
    cfg.express = ExpressConfig {
        refresh_before: Duration::from_secs(5),
        expiry_margin: Duration::from_millis(500),
    };
    let stats = Arc::new(Mutex::new(None));
    {
        let stats = stats.clone();
        on_shard("s3-express", move || async move {
            let client = S3Client::new(cfg).unwrap();
            let started = Instant::now();
            let mut i = 0usize;
            while started.elapsed() < Duration::from_secs(7) {
                let key = format!("express/obj@{i:04}");
                let data = pattern(1000 + i * 37, i as u64);
                client
                    .put_object(&key, SendRegion::from_vec(data.clone()))
                    .await
                    .unwrap_or_else(|e| panic!("put {i}: {e}"));
                assert_eq!(
                    client.head_object(&key).await.unwrap(),
                    Some(data.len() as u64)
                );
                let mut back = vec![0u8; data.len()];
                client
                    .get_object_into(&key, RecvRegion::from_mut_slice(&mut back))
                    .await
                    .unwrap_or_else(|e| panic!("get {i}: {e}"));
                assert!(back == data, "object {i}");
                if i % 3 == 0 {
                    assert!(client.delete_object(&key).await.unwrap());
                }
                i += 1;
                glommio::timer::sleep(Duration::from_millis(100)).await;
            }
            *stats.lock().unwrap() = Some(client.stats());
        });
    }
    let stats = stats.lock().unwrap().clone().unwrap();
    let st = mock.state.lock().unwrap();
    assert!(st.rejections.is_empty(), "{:#?}", st.rejections);
    assert_eq!(st.create_sessions as u64, stats.sessions_created);
    assert!(stats.sessions_created >= 3, "{stats:?}");
    assert!(stats.session_refreshes >= 2, "{stats:?}");
    // Only the very first session was awaited by a request.
    assert_eq!(
        stats.sessions_created,
        stats.session_refreshes + 1,
        "{stats:?}"
    );
    assert_eq!(stats.retries, 0);
    assert!(st.data_requests > 30);
    for op in [
        Op::PutObject,
        Op::GetObject,
        Op::HeadObject,
        Op::DeleteObject,
    ] {
        assert_eq!(stats.sent(op), stats.count(op, Outcome::Ok), "{op}");
    }
}

/// S3 Express's own lifetime: 5-minute sessions, the client's default
/// refresh settings (a background refresh with 60 s left, never used with
/// less than 5 s), and the client's and the mock's clocks moved 20 s per
/// round across two expiries. Every request is accepted, each expiry is
/// bridged by one background refresh, and no request waits for a session
/// after the first.
#[test]
fn five_minute_sessions_are_refreshed_across_their_expiry() {
    let clock = Arc::new(ManualClock::new());
    let ttl = Duration::from_secs(300);
    let mock = ExpressMock::start_with_clock(ttl, ttl, clock.clone());
    let mut cfg = express_config(&mock, BASE_SECRET);
    cfg.clock = clock.clone();
    assert_eq!(cfg.express, ExpressConfig::default());
    let stats = Arc::new(Mutex::new(None));
    {
        let stats = stats.clone();
        on_shard("s3-express-5min", move || async move {
            let client = S3Client::new(cfg).unwrap();
            // 0 s .. 700 s of the clock, 20 s a round.
            for round in 0..36usize {
                let key = format!("express/five@{round:03}");
                let data = pattern(500 + round, round as u64);
                client
                    .put_object(&key, SendRegion::from_vec(data.clone()))
                    .await
                    .unwrap_or_else(|e| panic!("put at {} s: {e}", round * 20));
                let mut back = vec![0u8; data.len()];
                client
                    .get_object_into(&key, RecvRegion::from_mut_slice(&mut back))
                    .await
                    .unwrap_or_else(|e| panic!("get at {} s: {e}", round * 20));
                assert!(back == data, "object {round}");
                // Room for a background refresh to finish (real time).
                glommio::timer::sleep(Duration::from_millis(30)).await;
                clock.advance(Duration::from_secs(20));
            }
            *stats.lock().unwrap() = Some(client.stats());
        });
    }
    let stats = stats.lock().unwrap().clone().unwrap();
    let st = mock.state.lock().unwrap();
    assert!(st.rejections.is_empty(), "{:#?}", st.rejections);
    // Sessions minted at 0 s, ~240 s and ~480 s (refreshed with <= 60 s left).
    assert_eq!(stats.sessions_created, 3, "{stats:?}");
    assert_eq!(stats.session_refreshes, 2, "{stats:?}");
    assert_eq!(st.create_sessions, 3);
    assert_eq!(stats.retries, 0, "{stats:?}");
    assert_eq!(st.data_requests, 72);
}

#[test]
fn an_expired_session_is_replaced_and_the_request_retried() {
    // The mock says 60 s but expires sessions after 1 s.
    let mock = ExpressMock::start(Duration::from_secs(1), Duration::from_secs(60));
    let mut cfg = express_config(&mock, BASE_SECRET);
    cfg.express = ExpressConfig {
        refresh_before: Duration::from_secs(10),
        expiry_margin: Duration::from_secs(1),
    };
    let stats = Arc::new(Mutex::new(None));
    {
        let stats = stats.clone();
        on_shard("s3-express-expired", move || async move {
            let client = S3Client::new(cfg).unwrap();
            client
                .put_object("a@1", SendRegion::from_vec(vec![1; 10]))
                .await
                .unwrap();
            glommio::timer::sleep(Duration::from_millis(1200)).await;
            let mut back = vec![0u8; 10];
            client
                .get_object_into("a@1", RecvRegion::from_mut_slice(&mut back))
                .await
                .unwrap();
            assert_eq!(back, vec![1; 10]);
            *stats.lock().unwrap() = Some(client.stats());
        });
    }
    let stats = stats.lock().unwrap().clone().unwrap();
    assert_eq!(stats.sessions_created, 2, "{stats:?}");
    assert_eq!(stats.retries, 1, "{stats:?}");
    let st = mock.state.lock().unwrap();
    assert_eq!(st.rejections.len(), 1, "{:?}", st.rejections);
    assert!(
        st.rejections[0].contains("ExpiredToken"),
        "{:?}",
        st.rejections
    );
}

#[test]
fn a_wrong_base_secret_fails_create_session_without_retries() {
    let mock = ExpressMock::start(Duration::from_secs(300), Duration::from_secs(300));
    let cfg = express_config(&mock, "wrong-secret");
    on_shard("s3-express-denied", move || async move {
        let client = S3Client::new(cfg).unwrap();
        let e = client
            .put_object("a@1", SendRegion::from_vec(vec![1; 10]))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
        assert!(matches!(e.cause(), Cause::Session(_)), "{e}");
        assert_eq!(e.s3_code(), Some("SignatureDoesNotMatch"));
        let stats = client.stats();
        assert_eq!(stats.sent(Op::CreateSession), 1, "{stats:?}");
        assert_eq!(stats.sent(Op::PutObject), 0);
        assert_eq!(stats.retries, 0);
    });
    let st = mock.state.lock().unwrap();
    assert_eq!(st.create_sessions, 0);
    assert_eq!(st.rejections.len(), 1, "{:?}", st.rejections);
}
