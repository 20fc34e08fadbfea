//! Replays the signed requests of aws-sdk-s3's recorded S3 Express traffic
//! (`tests/data/express/mixed-auths.json` in the crates.io package) through
//! our signer.
//!
//! aws-sdk-s3 is not a dependency (it takes minutes to compile). Instead the
//! throwaway manifest `tests/vectors-fetch/Cargo.toml` (its own workspace,
//! not a member of ours) depends on a pinned aws-sdk-s3, and this test runs
//! `cargo fetch` on it, which only downloads and unpacks the package sources
//! into the cargo registry. Offline with the package already unpacked, the
//! test runs; offline without it, the test fails and says why.
//!
//! The recording lists objects in two directory buckets (CreateSession, then
//! ListObjectsV2 signed with the session credentials, service `s3express`,
//! token in `x-amz-s3session-token`) and in one general-purpose bucket. The
//! data-plane requests must reproduce exactly. The two recorded CreateSession
//! signatures do not reproduce (an independent Python signer finds the same;
//! aws-sdk-s3's own replay test never compares them), so for those only the
//! request shape is asserted and the outcome is printed.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvshard_s3_raw::addressing::{parse_directory_bucket, CreateSessionRequest};
use kvshard_s3_raw::credentials::Credentials;
use kvshard_s3_raw::sigv4::{
    PayloadHash, SignableRequest, Signer, SigningParams, SigningSettings, SigningTime,
    UNSIGNED_PAYLOAD, X_AMZ_CONTENT_SHA256, X_AMZ_DATE, X_AMZ_S3SESSION_TOKEN,
    X_AMZ_SECURITY_TOKEN,
};
use kvshard_s3_raw::xml::parse_create_session;

/// The IAM identity the recording was made with: aws-credential-types'
/// `Credentials::for_tests()`.
const TEST_ACCESS_KEY: &str = "ANOTREAL";
const TEST_SECRET_KEY: &str = "notrealrnrELgWzOk3IfjzDKtFBhDby";

fn fetch_manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("vectors-fetch")
        .join("Cargo.toml")
}

fn vectors_file() -> PathBuf {
    let manifest = fetch_manifest();
    let relative = Path::new("tests/data/express/mixed-auths.json");
    let locate = || -> Result<PathBuf, String> {
        let dir = common::package_dir(&manifest, "aws-sdk-s3", &["--offline", "--locked"])?;
        let file = dir.join(relative);
        if file.is_file() {
            Ok(file)
        } else {
            Err(format!("{} does not exist", file.display()))
        }
    };
    if let Ok(file) = locate() {
        return file;
    }
    let fetch = Command::new(common::cargo())
        .args(["fetch", "--locked", "--manifest-path"])
        .arg(&manifest)
        .output()
        .expect("cannot run cargo fetch");
    match locate() {
        Ok(file) => file,
        Err(e) => panic!(
            "aws-sdk-s3's S3 Express vectors are not available: {e}\n\
             `cargo fetch --manifest-path {}` exited with {}:\n{}\n\
             (needs network access once, or the package already in the cargo registry)",
            manifest.display(),
            fetch.status,
            String::from_utf8_lossy(&fetch.stderr)
        ),
    }
}

struct Recorded {
    connection: u64,
    method: String,
    uri: String,
    headers: Vec<(String, String)>,
}

impl Recorded {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// (requests, response bodies by connection).
fn load(path: &Path) -> (Vec<Recorded>, HashMap<u64, String>) {
    let text = std::fs::read_to_string(path).expect("vectors file is readable");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("vectors file is JSON");
    let mut requests = Vec::new();
    let mut bodies: HashMap<u64, String> = HashMap::new();
    for event in doc["events"].as_array().expect("events") {
        let connection = event["connection_id"].as_u64().expect("connection_id");
        let action = &event["action"];
        if let Some(req) = action.get("Request") {
            let req = &req["request"];
            let mut headers = Vec::new();
            for (name, values) in req["headers"].as_object().expect("headers") {
                for value in values.as_array().expect("header values") {
                    headers.push((name.clone(), value.as_str().expect("value").to_owned()));
                }
            }
            requests.push(Recorded {
                connection,
                method: req["method"].as_str().expect("method").to_owned(),
                uri: req["uri"].as_str().expect("uri").to_owned(),
                headers,
            });
        } else if let Some(data) = action.get("Data") {
            if data["direction"] == "Response" {
                if let Some(utf8) = data["data"]["Utf8"].as_str() {
                    bodies.entry(connection).or_default().push_str(utf8);
                }
            }
        }
    }
    (requests, bodies)
}

struct Authorization {
    access_key: String,
    region: String,
    service: String,
    signed_headers: Vec<String>,
    signature: String,
}

fn parse_authorization(value: &str) -> Authorization {
    let rest = value
        .strip_prefix("AWS4-HMAC-SHA256 ")
        .expect("SigV4 authorization");
    let mut fields = HashMap::new();
    for part in rest.split(", ") {
        let (k, v) = part.split_once('=').expect("key=value");
        fields.insert(k, v);
    }
    let scope: Vec<&str> = fields["Credential"].split('/').collect();
    assert_eq!(
        scope.len(),
        5,
        "credential scope {:?}",
        fields["Credential"]
    );
    Authorization {
        access_key: scope[0].to_owned(),
        region: scope[2].to_owned(),
        service: scope[3].to_owned(),
        signed_headers: fields["SignedHeaders"]
            .split(';')
            .map(str::to_owned)
            .collect(),
        signature: fields["Signature"].to_owned(),
    }
}

fn split_uri(uri: &str) -> (&str, &str) {
    let rest = uri.strip_prefix("https://").expect("https URI");
    match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    }
}

#[test]
fn s3express_mixed_auths_replay() {
    let path = vectors_file();
    let (requests, bodies) = load(&path);
    let iam = Credentials::new(TEST_ACCESS_KEY, TEST_SECRET_KEY, None, None).unwrap();
    let mut sessions: HashMap<String, Credentials> = HashMap::new();
    let mut signer = Signer::new();
    let mut data_plane_checked = 0;
    let mut s3_checked = 0;
    let mut create_session = Vec::new();

    for req in &requests {
        let auth = parse_authorization(req.header("authorization").expect("signed request"));
        let (host, target) = split_uri(&req.uri);
        let (path, query) = common::split_target(target);
        let is_create_session = query.len() == 1 && query[0].0 == "session";
        let bucket = host.split('.').next().unwrap().to_owned();

        let (creds, settings) = if auth.access_key == TEST_ACCESS_KEY {
            (&iam, SigningSettings::s3())
        } else {
            let session = sessions
                .get(&bucket)
                .unwrap_or_else(|| panic!("no CreateSession answer recorded for {bucket}"));
            assert_eq!(session.access_key_id(), auth.access_key);
            (session, SigningSettings::s3_express_data_plane())
        };

        // The signer produces these; everything else that was signed is
        // passed in.
        let produced = [
            "host",
            X_AMZ_DATE,
            X_AMZ_CONTENT_SHA256,
            X_AMZ_SECURITY_TOKEN,
            X_AMZ_S3SESSION_TOKEN,
        ];
        let headers: Vec<(&str, &str)> = req
            .headers
            .iter()
            .filter(|(k, _)| {
                auth.signed_headers
                    .iter()
                    .any(|s| s.eq_ignore_ascii_case(k))
            })
            .filter(|(k, _)| !produced.iter().any(|p| p.eq_ignore_ascii_case(k)))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let content = req
            .header(X_AMZ_CONTENT_SHA256)
            .expect("x-amz-content-sha256");
        let payload = if content == UNSIGNED_PAYLOAD {
            PayloadHash::Unsigned
        } else {
            PayloadHash::Sha256Hex(content)
        };
        let query_refs: Vec<(&str, &str)> = query
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let signable = SignableRequest {
            method: &req.method,
            host,
            path: &path,
            query: &query_refs,
            headers: &headers,
            payload,
        };
        let params = SigningParams {
            credentials: creds,
            region: &auth.region,
            service: &auth.service,
            time: SigningTime::UnixSecs(common::parse_amz_date(
                req.header(X_AMZ_DATE).expect("x-amz-date"),
            )),
            settings: &settings,
        };
        let signed = signer
            .sign(&signable, &params)
            .expect("recorded request signs");
        let ours_signed: Vec<&str> = signed.signed_headers().split(';').collect();

        if is_create_session {
            // Shape checks that do hold: service, path, no session token.
            assert_eq!(auth.service, CreateSessionRequest::SERVICE);
            assert_eq!(req.method, CreateSessionRequest::METHOD);
            assert_eq!(path, "/");
            assert!(parse_directory_bucket(&bucket).is_some(), "{bucket}");
            assert!(req.header(X_AMZ_S3SESSION_TOKEN).is_none());
            assert_eq!(ours_signed, auth.signed_headers);
            create_session.push((req.connection, signed.signature() == auth.signature));
            let body = bodies
                .get(&req.connection)
                .expect("CreateSession response body");
            let session = parse_create_session(body).expect("CreateSessionResult parses");
            sessions.insert(bucket, session);
            continue;
        }

        assert_eq!(
            ours_signed, auth.signed_headers,
            "signed headers of {} {}",
            req.method, req.uri
        );
        assert_eq!(
            signed.signature(),
            auth.signature,
            "signature of {} {} (connection {})\ncanonical request:\n{}",
            req.method,
            req.uri,
            req.connection,
            signed.canonical_request()
        );
        let produced_headers: Vec<(&str, &str)> = signed.headers().collect();
        if auth.service == "s3express" {
            data_plane_checked += 1;
            assert!(req.header(X_AMZ_SECURITY_TOKEN).is_none());
            assert!(produced_headers
                .iter()
                .all(|(k, _)| *k != X_AMZ_SECURITY_TOKEN));
            let token = req
                .header(X_AMZ_S3SESSION_TOKEN)
                .expect("session token sent");
            assert!(produced_headers.contains(&(X_AMZ_S3SESSION_TOKEN, token)));
        } else {
            s3_checked += 1;
            assert!(produced_headers
                .iter()
                .all(|(k, _)| *k != X_AMZ_S3SESSION_TOKEN));
        }
        assert!(produced_headers.contains(&("authorization", req.header("authorization").unwrap())));
    }

    println!(
        "{}: {data_plane_checked} S3 Express data-plane and {s3_checked} S3 requests reproduced; \
         CreateSession (connection, reproduced): {create_session:?} (recorded signatures are stale, not asserted)",
        path.display()
    );
    assert_eq!(
        data_plane_checked, 3,
        "the recording has three data-plane requests"
    );
    assert_eq!(
        s3_checked, 1,
        "the recording has one general-purpose bucket request"
    );
    assert_eq!(create_session.len(), 2);
}
