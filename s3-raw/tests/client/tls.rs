//! TLS: an in-process rustls front (rcgen certificate, ALPN h2 and
//! http/1.1) that forwards the decrypted bytes to s3s-fs, which speaks both
//! HTTP/1.1 and HTTP/2, or to a mock STS. The client trusts the certificate
//! through the CA bundle option only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_rustls::TlsAcceptor;
use kvshard_s3_raw::addressing::{resolve_bucket, AddressingConfig, BucketAddress};
use kvshard_s3_raw::credential_http::{FetchConfig, HttpFetcher};
use kvshard_s3_raw::credentials::{resolve_credentials, CredentialSource, Env};
use kvshard_s3_raw::error::Cause;
use kvshard_s3_raw::http::Protocol;
use kvshard_s3_raw::net::TlsTrust;
use kvshard_s3_raw::{ErrorKind, RecvRegion, S3Client, SendRegion};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::mock_http::{sts_response, MockResponse, MockServer};
use crate::roundtrip;
use crate::support::*;

/// A self-signed certificate for `localhost` and 127.0.0.1, with its PEM
/// written to a file for the CA-bundle option.
struct TestCert {
    der: CertificateDer<'static>,
    key: Vec<u8>,
    pem_dir: TempDir,
}

impl TestCert {
    fn new() -> TestCert {
        let ck = rcgen::generate_simple_self_signed(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
        ])
        .expect("generate a certificate");
        let pem_dir = TempDir::new("tls");
        std::fs::write(pem_dir.path().join("ca.pem"), ck.cert.pem()).expect("write PEM");
        TestCert {
            der: ck.cert.der().clone(),
            key: ck.signing_key.serialize_der(),
            pem_dir,
        }
    }

    fn pem_path(&self) -> std::path::PathBuf {
        self.pem_dir.path().join("ca.pem")
    }
}

/// The TLS front: accepts TLS on a loopback port and pipes each connection
/// to `backend_port`. Records the ALPN protocol of every connection.
struct TlsFront {
    port: u16,
    alpn: Arc<Mutex<Vec<Option<Vec<u8>>>>>,
    stop: Arc<AtomicBool>,
    shard: Option<kvshard_io::executor::ShardHandle>,
}

impl TlsFront {
    fn start(cert: &TestCert, backend_port: u16) -> TlsFront {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.key.clone())),
            )
            .expect("server certificate");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let alpn = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let shard = {
            let (alpn, stop) = (alpn.clone(), stop.clone());
            kvshard_io::executor::spawn_shard(0, None, "tls-front".into(), move || async move {
                let listener = glommio::net::TcpListener::bind("127.0.0.1:0").unwrap();
                port_tx.send(listener.local_addr().unwrap().port()).unwrap();
                let stopped = {
                    let stop = stop.clone();
                    move || stop.load(Ordering::SeqCst)
                };
                loop {
                    let accepted =
                        futures_lite::future::or(async { Some(listener.accept().await) }, async {
                            while !stopped() {
                                glommio::timer::sleep(Duration::from_millis(20)).await;
                            }
                            None
                        })
                        .await;
                    let Some(Ok(stream)) = accepted else { break };
                    let (acceptor, alpn) = (acceptor.clone(), alpn.clone());
                    glommio::spawn_local(async move {
                        let Ok(tls) = acceptor.accept(stream).await else {
                            alpn.lock()
                                .unwrap()
                                .push(Some(b"handshake failed".to_vec()));
                            return;
                        };
                        alpn.lock()
                            .unwrap()
                            .push(tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec));
                        let backend = glommio::net::TcpStream::connect(("127.0.0.1", backend_port))
                            .await
                            .expect("connect to s3s-fs");
                        let (tls_r, tls_w) = futures_lite::io::split(tls);
                        let (be_r, be_w) = futures_lite::io::split(backend);
                        let _ = futures_lite::future::or(
                            futures_lite::io::copy(tls_r, be_w),
                            futures_lite::io::copy(be_r, tls_w),
                        )
                        .await;
                    })
                    .detach();
                }
            })
            .expect("start the TLS front")
        };
        TlsFront {
            port: port_rx.recv().unwrap(),
            alpn,
            stop,
            shard: Some(shard),
        }
    }

    fn protocols(&self) -> Vec<Option<Vec<u8>>> {
        self.alpn.lock().unwrap().clone()
    }

    fn address(&self, bucket: &str) -> BucketAddress {
        // An IP host keeps s3s-fs on path style (it reads other host names
        // as virtual-hosted buckets); the certificate covers 127.0.0.1.
        let endpoint = format!("https://127.0.0.1:{}", self.port);
        resolve_bucket(&AddressingConfig {
            bucket_url: bucket,
            region: REGION,
            endpoint_url: Some(&endpoint),
            disable_tls: false,
        })
        .expect("https address")
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(shard) = self.shard.take() {
            // Detached pipes may still run; the thread ends with the test.
            std::thread::spawn(move || shard.join());
        }
    }
}

#[test]
fn tls_with_alpn_h2_round_trips_and_verifies_the_certificate() {
    let server = S3sFs::start("kvshard-tls");
    let cert = TestCert::new();
    let front = TlsFront::start(&cert, server.port);
    let mut h2 = test_config(front.address("kvshard-tls"), true);
    whole_object_gets(&mut h2);
    h2.ca_bundle = Some(cert.pem_path());
    h2.system_roots = false;
    let mut h1 = h2.clone();
    h1.prefer_http2 = false;

    // A bundle with some other certificate: the handshake must fail.
    let other = TestCert::new();
    let mut untrusted = h2.clone();
    untrusted.ca_bundle = Some(other.pem_path());
    untrusted.system_roots = true;

    on_shard("s3-tls", move || async move {
        let client = S3Client::new(h2).unwrap();
        roundtrip::suite(&client, "tls-h2").await;
        assert_eq!(client.protocol(), Some(Protocol::Http2));
        let stats = client.stats();
        assert_eq!(stats.connections.http1_opened, 0);
        assert_eq!(stats.connections.http2_opened, 1, "{:?}", stats.connections);
        assert_eq!(stats.connections.tls_opened, 1);

        let client = S3Client::new(h1).unwrap();
        let data = pattern(70_000, 4);
        client
            .put_object("tls@h1", SendRegion::from_vec(data.clone()))
            .await
            .unwrap();
        let mut back = vec![0u8; data.len()];
        client
            .get_object_into("tls@h1", RecvRegion::from_mut_slice(&mut back))
            .await
            .unwrap();
        assert!(back == data);
        assert_eq!(client.protocol(), Some(Protocol::Http1));

        let client = S3Client::new(untrusted).unwrap();
        let e = client.head_object("tls@h1").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Fatal, "{e}");
        assert!(matches!(e.cause(), Cause::Connect(_)), "{e}");
        assert!(
            e.to_string().contains("certificate") || e.to_string().contains("Certificate"),
            "{e}"
        );
        assert_eq!(e.attempts(), 1, "a certificate failure is not retried");
        assert_eq!(client.breaker_status().connection_failures, 0);
    });

    let seen = front.protocols();
    assert_eq!(seen.first(), Some(&Some(b"h2".to_vec())), "{seen:?}");
    assert!(seen.contains(&Some(b"http/1.1".to_vec())), "{seen:?}");
    assert_eq!(
        seen.iter().filter(|p| p.as_deref() == Some(b"h2")).count(),
        1,
        "one multiplexed h2 connection: {seen:?}"
    );
    drop(front);
    drop(server);
}

#[test]
fn web_identity_over_https_speaks_http1_and_verifies_the_certificate() {
    let sts = MockServer::start(Arc::new(|_, req| {
        if req.form_field("Action").as_deref() != Some("AssumeRoleWithWebIdentity") {
            return MockResponse::new(400, "");
        }
        MockResponse::new(
            200,
            sts_response(
                "ASIATLSSTS",
                "tls-sts-secret",
                "tls-sts-token",
                Duration::from_secs(3600),
            ),
        )
    }));
    let cert = TestCert::new();
    let front = TlsFront::start(&cert, sts.port);
    let home = TempDir::new("sts-tls");
    let token_file = home.path().join("token");
    std::fs::write(&token_file, "header.payload.signature").unwrap();
    let env = Env::from_pairs([
        ("HOME".to_owned(), home.path().display().to_string()),
        (
            "AWS_WEB_IDENTITY_TOKEN_FILE".to_owned(),
            token_file.display().to_string(),
        ),
        (
            "AWS_ROLE_ARN".to_owned(),
            "arn:aws:iam::123456789012:role/kv".to_owned(),
        ),
        (
            "AWS_ENDPOINT_URL_STS".to_owned(),
            format!("https://127.0.0.1:{}/", front.port),
        ),
    ]);
    let trusted = FetchConfig {
        trust: TlsTrust {
            system_roots: false,
            ca_bundle: Some(cert.pem_path()),
        },
        ..FetchConfig::default()
    };
    // A bundle with some other certificate: the handshake must fail.
    let other = TestCert::new();
    let untrusted = FetchConfig {
        trust: TlsTrust {
            system_roots: true,
            ca_bundle: Some(other.pem_path()),
        },
        ..FetchConfig::default()
    };
    let (ok, refused) = on_shard("sts-tls", move || async move {
        let ok = resolve_credentials(&env, &HttpFetcher::new(trusted)).await;
        let refused = resolve_credentials(&env, &HttpFetcher::new(untrusted)).await;
        (ok, refused)
    });
    let c = ok.unwrap();
    assert_eq!(c.access_key_id(), "ASIATLSSTS");
    assert_eq!(c.session_token(), Some("tls-sts-token"));
    assert_eq!(c.source(), &CredentialSource::WebIdentity);
    let text = refused.unwrap_err().to_string();
    assert!(text.contains("web identity (STS)"), "{text}");
    assert!(text.contains("certificate"), "{text}");
    assert_eq!(sts.request_count(), 1);
    // Only http/1.1 is offered.
    let seen = front.protocols();
    assert_eq!(seen.first(), Some(&Some(b"http/1.1".to_vec())), "{seen:?}");
    drop(front);
}
