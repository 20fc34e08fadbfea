//! Bucket URL forms and their errors.

use kvshard_s3_raw::addressing::{
    aws_virtual_host, is_directory_bucket, parse_directory_bucket, resolve_bucket,
    s3express_zonal_host, validate_bucket_name, AddressingConfig, AddressingError, AddressingStyle,
    BucketAddress, CreateSessionRequest, DirectoryBucket, Scheme,
};

fn resolve(bucket_url: &str) -> Result<BucketAddress, AddressingError> {
    resolve_bucket(&AddressingConfig {
        bucket_url,
        region: "us-west-2",
        endpoint_url: None,
        disable_tls: false,
    })
}

fn resolve_with(
    bucket_url: &str,
    endpoint_url: Option<&str>,
    disable_tls: bool,
) -> Result<BucketAddress, AddressingError> {
    resolve_bucket(&AddressingConfig {
        bucket_url,
        region: "us-west-2",
        endpoint_url,
        disable_tls,
    })
}

#[test]
fn bare_bucket_uses_the_aws_regional_virtual_host() {
    let a = resolve("s3://lmcache-kv").unwrap();
    assert_eq!(a.bucket, "lmcache-kv");
    assert_eq!(a.scheme, Scheme::Https);
    assert_eq!(a.port, 443);
    assert_eq!(a.host_header, "lmcache-kv.s3.us-west-2.amazonaws.com");
    assert_eq!(a.connect_host, a.host_header);
    assert_eq!(a.style, AddressingStyle::VirtualHosted);
    assert_eq!(a.object_path("m@0000001a@0@ab"), "/m@0000001a@0@ab");
    assert_eq!(a.bucket_path(), "/");
    assert_eq!(a.directory_bucket, None);
    assert_eq!(
        aws_virtual_host("b1b", "eu-west-1"),
        "b1b.s3.eu-west-1.amazonaws.com"
    );
    // The scheme is optional and case-insensitive; a trailing slash is fine.
    assert_eq!(resolve("lmcache-kv").unwrap(), a);
    assert_eq!(resolve("S3://lmcache-kv/").unwrap(), a);
}

#[test]
fn disable_tls_means_http_on_port_80() {
    let a = resolve_with("s3://lmcache-kv", None, true).unwrap();
    assert_eq!((a.scheme, a.port), (Scheme::Http, 80));
    let a = resolve_with("lmcache-kv.minio.internal", None, true).unwrap();
    assert_eq!((a.scheme, a.port), (Scheme::Http, 80));
    assert_eq!(a.host_header, "lmcache-kv.minio.internal");
    // An explicit port is kept either way.
    let a = resolve_with("lmcache-kv.minio.internal:9000", None, true).unwrap();
    assert_eq!((a.scheme, a.port), (Scheme::Http, 9000));
}

#[test]
fn bucket_dot_host_sends_host_verbatim() {
    for url in [
        "s3://lmcache-kv.minio.local:9000",
        "lmcache-kv.minio.local:9000",
    ] {
        let a = resolve(url).unwrap();
        assert_eq!(a.bucket, "lmcache-kv");
        assert_eq!(a.host_header, "lmcache-kv.minio.local:9000");
        assert_eq!(a.connect_host, "lmcache-kv.minio.local");
        assert_eq!(a.port, 9000);
        assert_eq!(a.scheme, Scheme::Https);
        assert_eq!(a.style, AddressingStyle::VirtualHosted);
        assert_eq!(a.path_prefix, "");
        assert_eq!(a.object_path("k"), "/k");
    }
    // The lmcache recipe's AWS form.
    let a = resolve("s3://my-bucket.s3.us-east-1.amazonaws.com").unwrap();
    assert_eq!(a.bucket, "my-bucket");
    assert_eq!(a.host_header, "my-bucket.s3.us-east-1.amazonaws.com");
    assert_eq!(a.port, 443);
}

#[test]
fn localhost_names_connect_to_loopback() {
    let a = resolve("lmcache-kv.localhost:9000").unwrap();
    assert_eq!(a.connect_host, "127.0.0.1");
    assert_eq!(a.host_header, "lmcache-kv.localhost:9000");
    assert_eq!(a.port, 9000);
    let a = resolve("s3://probe-bucket.LOCALHOST").unwrap();
    assert_eq!(a.connect_host, "127.0.0.1");
    assert_eq!(a.host_header, "probe-bucket.LOCALHOST");
    let a = resolve_with("b1b", Some("http://localhost:8014"), false).unwrap();
    assert_eq!(a.connect_host, "127.0.0.1");
    assert_eq!(a.host_header, "localhost:8014");
    // bucket.<IPv4> connects to the address.
    let a = resolve("lmcache-kv.127.0.0.1:9000").unwrap();
    assert_eq!(a.connect_host, "127.0.0.1");
    assert_eq!(a.host_header, "lmcache-kv.127.0.0.1:9000");
}

#[test]
fn explicit_endpoint_gives_path_style() {
    let a = resolve_with("s3://lmcache-kv", Some("http://127.0.0.1:8014"), false).unwrap();
    assert_eq!(a.style, AddressingStyle::Path);
    assert_eq!(a.scheme, Scheme::Http);
    assert_eq!(a.connect_host, "127.0.0.1");
    assert_eq!(a.port, 8014);
    assert_eq!(a.host_header, "127.0.0.1:8014");
    assert_eq!(a.path_prefix, "/lmcache-kv");
    assert_eq!(a.object_path("m@1"), "/lmcache-kv/m@1");
    assert_eq!(a.bucket_path(), "/lmcache-kv");

    // Default ports, trailing slash, dotted bucket names, IPv6.
    let a = resolve_with("my.dotted.bucket", Some("https://s3.example.com/"), false).unwrap();
    assert_eq!((a.scheme, a.port), (Scheme::Https, 443));
    assert_eq!(a.bucket, "my.dotted.bucket");
    assert_eq!(a.host_header, "s3.example.com");
    let a = resolve_with("b1b", Some("http://[::1]:9000"), false).unwrap();
    assert_eq!(a.connect_host, "::1");
    assert_eq!(a.host_header, "[::1]:9000");
    assert_eq!(a.port, 9000);
    let a = resolve_with("b1b", Some("http://[::1]"), false).unwrap();
    assert_eq!(a.port, 80);
    let a = resolve_with("b1b", Some("http://minio:9000"), true).unwrap();
    assert_eq!(a.scheme, Scheme::Http);
}

#[test]
fn directory_buckets() {
    assert_eq!(
        parse_directory_bucket("bucket-base-name--usw2-az1--x-s3"),
        Some(DirectoryBucket {
            base_name: "bucket-base-name".into(),
            zone_id: "usw2-az1".into(),
        })
    );
    assert!(is_directory_bucket("a--use1-az4--x-s3"));
    for name in [
        "lmcache-kv",
        "x-s3",
        "--x-s3",
        "a--x-s3",
        "--usw2-az1--x-s3",
        "a--USW2--x-s3",
    ] {
        assert!(!is_directory_bucket(name), "{name}");
    }
    assert_eq!(
        s3express_zonal_host("b--usw2-az1--x-s3", "usw2-az1", "us-west-2"),
        "b--usw2-az1--x-s3.s3express-usw2-az1.us-west-2.amazonaws.com"
    );

    // s3://<directory bucket> goes to the zonal endpoint.
    let a = resolve("s3://kv--usw2-az1--x-s3").unwrap();
    assert_eq!(
        a.host_header,
        "kv--usw2-az1--x-s3.s3express-usw2-az1.us-west-2.amazonaws.com"
    );
    assert_eq!(a.directory_bucket.as_ref().unwrap().zone_id, "usw2-az1");
    // The lmcache recipe's explicit zonal form is recognised too.
    let a = resolve("s3://kv--usw2-az1--x-s3.s3express-usw2-az1.us-west-2.amazonaws.com").unwrap();
    assert_eq!(a.bucket, "kv--usw2-az1--x-s3");
    assert!(a.directory_bucket.is_some());

    // CreateSession: GET /?session, service s3express, on the zonal host.
    let cs = a.create_session_request().unwrap();
    assert_eq!(cs.path, "/");
    assert_eq!(cs.host_header, a.host_header);
    assert_eq!(CreateSessionRequest::METHOD, "GET");
    assert_eq!(CreateSessionRequest::QUERY, [("session", "")]);
    assert_eq!(CreateSessionRequest::SERVICE, "s3express");
    // Path-style (a local mock): /<bucket>?session.
    let a = resolve_with("kv--usw2-az1--x-s3", Some("http://127.0.0.1:9000"), false).unwrap();
    assert_eq!(
        a.create_session_request().unwrap().path,
        "/kv--usw2-az1--x-s3"
    );
    // Not for general-purpose buckets.
    assert_eq!(
        resolve("s3://lmcache-kv").unwrap().create_session_request(),
        Err(AddressingError::NotDirectoryBucket("lmcache-kv".into()))
    );
}

#[test]
fn bucket_name_rules() {
    for ok in ["abc", "lmcache-kv", "a.b.c", "0bucket9", &"a".repeat(63)] {
        assert_eq!(validate_bucket_name(ok), Ok(()), "{ok}");
    }
    for bad in [
        "",
        "ab",
        "Upper",
        "under_score",
        "-lead",
        "trail-",
        "a..b",
        "192.168.1.1",
        &"a".repeat(64),
        "sp ace",
    ] {
        assert!(
            matches!(
                validate_bucket_name(bad),
                Err(AddressingError::InvalidBucketName { .. })
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn malformed_inputs_have_typed_errors() {
    use AddressingError::*;
    assert_eq!(resolve(""), Err(Empty));
    assert_eq!(resolve("s3://"), Err(Empty));
    assert_eq!(resolve("  "), Err(Empty));
    assert!(matches!(resolve("gs://bucket"), Err(UnsupportedScheme(_))));
    assert!(matches!(
        resolve("https://bucket.host"),
        Err(UnsupportedScheme(_))
    ));
    assert!(matches!(resolve("s3://ab"), Err(InvalidBucketName { .. })));
    assert!(matches!(
        resolve("s3://Bucket.host"),
        Err(InvalidBucketName { .. })
    ));
    assert!(matches!(
        resolve("s3://.host"),
        Err(InvalidBucketName { .. })
    ));
    assert_eq!(resolve("bucket.host:"), Err(BadPort(String::new())));
    assert_eq!(resolve("bucket.host:0"), Err(BadPort("0".into())));
    assert_eq!(resolve("bucket.host:65536"), Err(BadPort("65536".into())));
    assert_eq!(resolve("bucket.host:9x"), Err(BadPort("9x".into())));
    assert_eq!(resolve("bucket.host:+80"), Err(BadPort("+80".into())));
    assert!(matches!(resolve("localhost:9000"), Err(InvalidHost(_))));
    assert!(matches!(resolve("bucket.:9000"), Err(InvalidHost(_))));
    assert!(matches!(
        resolve("bucket.ho st"),
        Err(InvalidHost(_)) | Err(InvalidBucketName { .. })
    ));
    assert!(matches!(resolve("bucket.a..b"), Err(InvalidHost(_))));
    assert!(matches!(
        resolve("s3://bucket/prefix"),
        Err(UnsupportedUrlPart { .. })
    ));
    assert!(matches!(
        resolve("s3://bucket.host/a/b"),
        Err(UnsupportedUrlPart { .. })
    ));
    assert!(matches!(
        resolve("s3://bucket.host?x=1"),
        Err(UnsupportedUrlPart { .. })
    ));
    assert!(matches!(
        resolve("s3://user@bucket.host"),
        Err(UnsupportedUrlPart { .. })
    ));
    assert!(matches!(
        resolve_bucket(&AddressingConfig {
            bucket_url: "s3://lmcache-kv",
            region: "",
            endpoint_url: None,
            disable_tls: false
        }),
        Err(InvalidRegion(_))
    ));
    assert!(matches!(
        resolve_bucket(&AddressingConfig {
            bucket_url: "s3://lmcache-kv",
            region: "us west",
            endpoint_url: None,
            disable_tls: false
        }),
        Err(InvalidRegion(_))
    ));

    // Endpoint URL errors.
    assert!(matches!(
        resolve_with("b1b", Some("ftp://host"), false),
        Err(UnsupportedScheme(_))
    ));
    assert!(matches!(
        resolve_with("b1b", Some("host:9000"), false),
        Err(UnsupportedScheme(_))
    ));
    assert!(matches!(
        resolve_with("b1b", Some("http://"), false),
        Err(InvalidHost(_))
    ));
    assert!(matches!(
        resolve_with("b1b", Some("http://h:99999"), false),
        Err(BadPort(_))
    ));
    assert!(matches!(
        resolve_with("b1b", Some("http://h/base"), false),
        Err(UnsupportedUrlPart { .. })
    ));
    assert!(matches!(
        resolve_with("b1b", Some("http://[zz]:1"), false),
        Err(InvalidHost(_))
    ));
    assert!(matches!(
        resolve_with("b1b", Some("http://[::1]x"), false),
        Err(InvalidHost(_))
    ));
    assert!(matches!(
        resolve_with("b1b", Some("https://h"), true),
        Err(TlsConflict(_))
    ));
    assert!(matches!(
        resolve_with("b1b.localhost:9000", Some("http://h"), false),
        Err(ConflictingEndpoint { .. })
    ));
    assert!(matches!(
        resolve_with("B1B", Some("http://h"), false),
        Err(InvalidBucketName { .. })
    ));

    // Every error explains itself.
    let err = resolve("bucket.host:0").unwrap_err();
    assert!(err.to_string().contains("bad port"), "{err}");
}
