//! The HTTP credential sources (IMDSv2, container endpoint, STS web
//! identity) through the whole chain, run on a glommio executor against
//! HTTP servers started here on 127.0.0.1. Environments are built per test;
//! the process environment is never read or changed.

mod common;
mod mock_http;

use std::cell::Cell;
use std::net::TcpListener;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use kvshard_s3_raw::credential_http::{FetchConfig, HttpFetcher, IMDS_TOKEN_TTL_SECS};
use kvshard_s3_raw::credentials::{
    plan_credentials, resolve_credentials, CredentialPlan, CredentialSource, Credentials,
    CredentialsError, Env,
};
use kvshard_s3_raw::net::TlsTrust;

use common::TempDir;
use mock_http::*;

/// HOME in an empty directory (no profile files), plus `vars`.
fn env(home: &TempDir, vars: &[(&str, &str)]) -> Env {
    let mut pairs = vec![("HOME".to_owned(), home.path().display().to_string())];
    pairs.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Env::from_pairs(pairs)
}

/// Runs the chain for `env` on a fresh glommio executor, fetching with
/// [`fetcher`].
fn resolve(env: &Env) -> Result<Credentials, CredentialsError> {
    let env = env.clone();
    on_shard("credentials-http", move || async move {
        resolve_credentials(&env, &fetcher()).await
    })
}

/// Quick timeouts, so failures show up fast.
fn fetcher() -> HttpFetcher {
    HttpFetcher::new(FetchConfig {
        connect_timeout: Duration::from_millis(500),
        read_timeout: Duration::from_secs(2),
        trust: TlsTrust {
            system_roots: true,
            ca_bundle: None,
        },
    })
}

fn expires_in(c: &Credentials) -> Duration {
    c.expiry()
        .expect("an expiry")
        .duration_since(SystemTime::now())
        .unwrap_or_default()
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

#[test]
fn imds_v2_full_flow() {
    let imds = MockImds::serving(
        "ASIAIMDSKEY",
        "imds-secret-value",
        Some("imds-session-token"),
    );
    let home = TempDir::new("imds");
    let e = env(
        &home,
        &[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.endpoint())],
    );

    // The mock insists on the token: a bare GET is refused.
    let bare = fetcher_get(
        &imds.endpoint(),
        "/latest/meta-data/iam/security-credentials/",
    );
    assert_eq!(bare, 401);

    let c = resolve(&e).unwrap();
    assert_eq!(c.access_key_id(), "ASIAIMDSKEY");
    assert_eq!(c.secret_access_key(), "imds-secret-value");
    assert_eq!(c.session_token(), Some("imds-session-token"));
    assert_eq!(c.source(), &CredentialSource::Imds);
    let left = expires_in(&c);
    assert!(
        left > Duration::from_secs(6 * 3600 - 120) && left <= Duration::from_secs(6 * 3600),
        "{left:?}"
    );

    let seen: Vec<_> = imds.server.requests().into_iter().skip(1).collect();
    assert_eq!(seen.len(), 3, "{seen:#?}");
    assert_eq!(
        (seen[0].method.as_str(), seen[0].target.as_str()),
        ("PUT", "/latest/api/token")
    );
    assert_eq!(
        seen[0].header("x-aws-ec2-metadata-token-ttl-seconds"),
        Some(IMDS_TOKEN_TTL_SECS.to_string().as_str())
    );
    assert_eq!(
        seen[1].target,
        "/latest/meta-data/iam/security-credentials/"
    );
    assert_eq!(
        seen[2].target,
        format!("/latest/meta-data/iam/security-credentials/{IMDS_ROLE}")
    );
    for get in &seen[1..] {
        assert_eq!(get.method, "GET");
        assert_eq!(get.header("x-aws-ec2-metadata-token"), Some("IMDS-TOKEN-0"));
    }
    let host = format!("127.0.0.1:{}", imds.server.port);
    assert!(seen.iter().all(|r| r.header("host") == Some(host.as_str())));

    // Disabled: the chain stops before IMDS, endpoint or not.
    let off = env(
        &home,
        &[
            ("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.endpoint()),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ],
    );
    assert_eq!(resolve(&off).unwrap_err(), CredentialsError::NoCredentials);
    assert_eq!(imds.server.request_count(), 4);
}

/// Status of a plain GET without any IMDS token.
fn fetcher_get(base: &str, path: &str) -> u16 {
    use std::io::{Read, Write};
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split(' ').nth(1).unwrap().parse().unwrap()
}

#[test]
fn imds_refusals_are_explained() {
    let home = TempDir::new("imds-errors");
    let refusal = |server: &MockServer| {
        resolve(&env(
            &home,
            &[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &server.url())],
        ))
        .unwrap_err()
        .to_string()
    };

    let server = MockServer::start(Arc::new(|_, _| MockResponse::new(403, "")));
    let e = refusal(&server);
    assert!(e.contains("IMDSv2"), "{e}");
    assert!(
        e.contains(&format!("PUT {}/latest/api/token", server.url())),
        "{e}"
    );
    assert!(e.contains("HTTP 403"), "{e}");

    // No role attached.
    let server = MockServer::start(Arc::new(|_, req| match req.method.as_str() {
        "PUT" => MockResponse::new(200, "T"),
        _ => MockResponse::new(404, ""),
    }));
    let e = refusal(&server);
    assert!(e.contains("no IAM role"), "{e}");

    // A credentials answer that is not Success.
    let imds = MockImds::start(Arc::new(|_| {
        MockResponse::new(
            200,
            r#"{"Code":"AssumeRoleUnauthorizedAccess","Message":"EC2 cannot assume the role","LastUpdated":"2024-01-01T00:00:00Z"}"#,
        )
    }));
    let e = refusal(&imds.server);
    assert!(e.contains("AssumeRoleUnauthorizedAccess"), "{e}");
    assert!(e.contains(IMDS_ROLE), "{e}");

    // An answer larger than any credentials document.
    let imds = MockImds::start(Arc::new(|_| MockResponse::new(200, vec![b' '; 200 << 10])));
    let e = refusal(&imds.server);
    assert!(e.contains("larger than"), "{e}");
}

#[test]
fn container_endpoint_with_token_file() {
    let server = MockServer::start(Arc::new(|n, _| {
        let json = credentials_json(
            "ASIACONTAINER",
            "container-secret",
            Some("container-token"),
            Duration::from_secs(3600),
        );
        // Every other answer chunked, to cover both framings.
        let r = MockResponse::new(200, json).header("Content-Type", "application/json");
        if n % 2 == 1 {
            r.chunked()
        } else {
            r
        }
    }));
    let home = TempDir::new("container");
    let token_file = home.write("token", "first-auth-token\n");
    let uri = format!("{}/v1/credentials?id=7", server.url());
    let e = env(
        &home,
        &[
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &uri),
            (
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                token_file.to_str().unwrap(),
            ),
            // The file wins over the inline token.
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "inline-token"),
        ],
    );
    let c = resolve(&e).unwrap();
    assert_eq!(c.access_key_id(), "ASIACONTAINER");
    assert_eq!(c.secret_access_key(), "container-secret");
    assert_eq!(c.session_token(), Some("container-token"));
    assert_eq!(c.source(), &CredentialSource::Container);
    assert!(expires_in(&c) > Duration::from_secs(3500));

    // The token file is read again on every fetch (it is rotated).
    std::fs::write(&token_file, "second-auth-token").unwrap();
    let c = resolve(&e).unwrap();
    assert_eq!(c.access_key_id(), "ASIACONTAINER");

    // Inline token only; `localhost` resolves to loopback only, so plain
    // http to it is allowed.
    let local_uri = format!("http://localhost:{}/v1/credentials", server.port);
    let e = env(
        &home,
        &[
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &local_uri),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "inline-token"),
        ],
    );
    resolve(&e).unwrap();

    let seen = server.requests();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|r| r.method == "GET"));
    assert_eq!(seen[0].target, "/v1/credentials?id=7");
    assert_eq!(seen[0].header("authorization"), Some("first-auth-token"));
    assert_eq!(seen[1].header("authorization"), Some("second-auth-token"));
    assert_eq!(seen[2].header("authorization"), Some("inline-token"));

    // An error answer: the status and the endpoint's own words, no token.
    let failing = MockServer::start(Arc::new(|_, _| {
        MockResponse::new(
            403,
            r#"{"code":"AccessDeniedException","message":"token not valid"}"#,
        )
    }));
    let uri = format!("{}/v1/credentials", failing.url());
    let e = env(
        &home,
        &[
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &uri),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "inline-token"),
        ],
    );
    let err = resolve(&e).unwrap_err().to_string();
    assert!(err.contains("container credentials endpoint"), "{err}");
    assert!(err.contains(&format!("GET {uri}")), "{err}");
    assert!(
        err.contains("HTTP 403 AccessDeniedException: token not valid"),
        "{err}"
    );
    assert!(!err.contains("inline-token"), "{err}");

    // A token that would inject a header is refused before sending.
    let bad = home.write("bad-token", "abc\r\nX-Evil: 1");
    let e = env(
        &home,
        &[
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &uri),
            (
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                bad.to_str().unwrap(),
            ),
        ],
    );
    let before = failing.request_count();
    let err = resolve(&e).unwrap_err();
    assert!(matches!(err, CredentialsError::Invalid { .. }), "{err}");
    assert!(!err.to_string().contains("X-Evil"), "{err}");
    assert_eq!(failing.request_count(), before);
}

#[test]
fn plain_http_container_uri_to_other_hosts_is_refused() {
    let home = TempDir::new("container-refused");
    for uri in [
        "http://192.0.2.10/creds",
        "http://169.254.169.254/latest/meta-data/",
        "http://[2001:db8::1]:8080/creds",
    ] {
        let e = env(&home, &[("AWS_CONTAINER_CREDENTIALS_FULL_URI", uri)]);
        let (err, took) = on_shard("container-refused", move || async move {
            let started = Instant::now();
            let err = resolve_credentials(&e, &fetcher()).await.unwrap_err();
            (err, started.elapsed())
        });
        assert!(
            took < Duration::from_millis(400),
            "refused without connecting"
        );
        let CredentialsError::Invalid { source, reason } = &err else {
            panic!("{uri}: {err:?}")
        };
        assert_eq!(source, "AWS_CONTAINER_CREDENTIALS_FULL_URI");
        assert!(reason.contains("use https"), "{reason}");
        assert!(reason.contains("169.254.170.23"), "{reason}");
    }
    // https may go anywhere: this one is only unreachable.
    let e = env(
        &home,
        &[(
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            &format!("https://127.0.0.1:{}/creds", closed_port()),
        )],
    );
    let err = resolve(&e).unwrap_err();
    assert!(
        matches!(&err, CredentialsError::Http { message, .. } if message.contains("connect to")),
        "{err:?}"
    );
}

#[test]
fn web_identity_against_a_mock_sts() {
    let server = MockServer::start(Arc::new(|_, req| {
        let ok = req.method == "POST"
            && req.path() == "/"
            && req
                .header("content-type")
                .is_some_and(|t| t.starts_with("application/x-www-form-urlencoded"))
            && req.header("authorization").is_none();
        if !ok {
            return MockResponse::new(400, "bad request shape");
        }
        if req.form_field("WebIdentityToken").as_deref() == Some("expired.jwt.token") {
            return MockResponse::new(
                400,
                "<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error><Type>Sender</Type><Code>ExpiredTokenException</Code><Message>Token expired: current date/time 1 must be before the expiration date/time 0</Message></Error><RequestId>rid-42</RequestId></ErrorResponse>",
            )
            .header("Content-Type", "text/xml");
        }
        MockResponse::new(
            200,
            sts_response(
                "ASIASTSKEY",
                "sts-secret",
                "sts-session-token",
                Duration::from_secs(3600),
            ),
        )
        .header("Content-Type", "text/xml")
    }));
    let home = TempDir::new("webid");
    let token_file = home.write("token", "header.payload.signature\n");
    let role = "arn:aws:iam::123456789012:role/kv-cache";
    let sts_url = format!("{}/", server.url());
    let base = [
        ("AWS_WEB_IDENTITY_TOKEN_FILE", token_file.to_str().unwrap()),
        ("AWS_ROLE_ARN", role),
        ("AWS_REGION", "eu-west-1"),
        ("AWS_ENDPOINT_URL", "http://127.0.0.1:1/"),
        ("AWS_ENDPOINT_URL_STS", &sts_url),
    ];
    let e = env(&home, &base);
    match plan_credentials(&e).unwrap() {
        CredentialPlan::Http(source) => assert!(format!("{source:?}").contains(&sts_url)),
        other => panic!("{other:?}"),
    }
    let c = resolve(&e).unwrap();
    assert_eq!(c.access_key_id(), "ASIASTSKEY");
    assert_eq!(c.secret_access_key(), "sts-secret");
    assert_eq!(c.session_token(), Some("sts-session-token"));
    assert_eq!(c.source(), &CredentialSource::WebIdentity);
    assert!(expires_in(&c) > Duration::from_secs(3500));

    let seen = server.requests();
    assert_eq!(seen.len(), 1);
    let form = seen[0].form();
    let field = |k: &str| {
        form.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {k} in {form:?}"))
    };
    assert_eq!(field("Action"), "AssumeRoleWithWebIdentity");
    assert_eq!(field("Version"), "2011-06-15");
    assert_eq!(field("RoleArn"), role);
    assert_eq!(field("WebIdentityToken"), "header.payload.signature");
    let session = field("RoleSessionName");
    assert!(
        session.starts_with("kvshard-")
            && (2..=64).contains(&session.len())
            && session
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+=,.@_-".contains(&b)),
        "{session}"
    );
    assert_eq!(form.len(), 5, "{form:?}");
    // Nothing secret in the URL.
    assert_eq!(seen[0].target, "/");

    // A configured session name; the token file is read again.
    std::fs::write(&token_file, "expired.jwt.token").unwrap();
    let mut vars = base.to_vec();
    vars.push(("AWS_ROLE_SESSION_NAME", "kv-node-1"));
    let err = resolve(&env(&home, &vars)).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("web identity (STS)"), "{text}");
    assert!(text.contains(&format!("POST {sts_url}")), "{text}");
    assert!(
        text.contains("HTTP 400 ExpiredTokenException: Token expired"),
        "{text}"
    );
    assert!(text.contains("rid-42"), "{text}");
    assert!(!text.contains("expired.jwt.token"), "{text}");
    assert!(!format!("{err:?}").contains("expired.jwt.token"));
    let seen = server.requests();
    assert_eq!(
        seen[1].form_field("RoleSessionName").as_deref(),
        Some("kv-node-1")
    );

    // A missing token file names the file.
    let mut vars = base.to_vec();
    vars[0] = ("AWS_WEB_IDENTITY_TOKEN_FILE", "/nonexistent/kvshard/token");
    let err = resolve(&env(&home, &vars)).unwrap_err();
    assert!(
        matches!(&err, CredentialsError::Io { path, .. } if path == Path::new("/nonexistent/kvshard/token")),
        "{err:?}"
    );
    assert_eq!(server.request_count(), 2);
}

#[test]
fn failing_endpoints_give_clear_errors() {
    let home = TempDir::new("failing");
    let failure = |endpoint: &str| {
        resolve(&env(
            &home,
            &[("AWS_EC2_METADATA_SERVICE_ENDPOINT", endpoint)],
        ))
        .unwrap_err()
    };

    // Nothing listens.
    let url = format!("http://127.0.0.1:{}", closed_port());
    let err = failure(&url);
    let text = err.to_string();
    assert!(
        text.starts_with("fetching credentials from IMDSv2 failed: PUT "),
        "{text}"
    );
    assert!(text.contains(&format!("{url}/latest/api/token")), "{text}");
    assert!(text.contains("connect to 127.0.0.1"), "{text}");

    // Accepts and never answers: the read deadline ends it, and the
    // executor keeps running other tasks meanwhile.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let e = env(&home, &[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &url)]);
    let (text, took, ticks) = on_shard("credentials-silent", move || async move {
        let ticks = Rc::new(Cell::new(0u32));
        let ticker = {
            let ticks = ticks.clone();
            glommio::spawn_local(async move {
                loop {
                    glommio::timer::sleep(Duration::from_millis(10)).await;
                    ticks.set(ticks.get() + 1);
                }
            })
        };
        let started = Instant::now();
        let err = resolve_credentials(&e, &fetcher()).await.unwrap_err();
        let took = started.elapsed();
        drop(ticker);
        (err.to_string(), took, ticks.get())
    });
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(text.contains("no complete answer within 2s"), "{text}");
    assert!(
        ticks >= 50,
        "the executor stalled: {ticks} timer ticks in {took:?}"
    );

    // Closes without a word.
    let server = MockServer::start(Arc::new(|_, _| MockResponse::hang_up()));
    let text = failure(&server.url()).to_string();
    assert!(
        text.contains("connection closed without an answer"),
        "{text}"
    );

    // An unparsable credentials document.
    let imds = MockImds::start(Arc::new(|_| MockResponse::new(200, "<html>oops</html>")));
    let text = failure(&imds.endpoint()).to_string();
    assert!(text.contains("not a JSON object"), "{text}");
    drop(silent);
}

#[test]
fn secrets_never_appear_in_debug_output() {
    let imds = MockImds::serving(
        "ASIADEBUGKEY",
        "very-secret-access-key",
        Some("very-secret-session-token"),
    );
    let home = TempDir::new("debug");
    let e = env(
        &home,
        &[
            ("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.endpoint()),
            ("AWS_SECRET_ACCESS_KEY_UNUSED", "very-secret-env-value"),
        ],
    );
    let c = resolve(&e).unwrap();
    let shown = format!(
        "{c:?} {e:?} {:?} {:?}",
        fetcher(),
        plan_credentials(&e).unwrap()
    );
    assert!(shown.contains("ASIADEBUGKEY"), "{shown}");
    for secret in [
        "very-secret-access-key",
        "very-secret-session-token",
        "very-secret-env-value",
        "IMDS-TOKEN",
    ] {
        assert!(!shown.contains(secret), "{secret} in {shown}");
    }

    // The container token is redacted in the plan.
    let e = env(
        &home,
        &[
            (
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "/v2/credentials/x",
            ),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "very-secret-auth"),
        ],
    );
    let shown = format!("{:?}", plan_credentials(&e).unwrap());
    assert!(shown.contains("169.254.170.2"), "{shown}");
    assert!(!shown.contains("very-secret-auth"), "{shown}");
}
