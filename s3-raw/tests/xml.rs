//! S3 and STS XML responses, entities, the CompleteMultipartUpload writer, and
//! garbage that must be rejected without panicking.

use std::time::{Duration, UNIX_EPOCH};

use kvshard_s3_raw::credentials::CredentialSource;
use kvshard_s3_raw::xml::{
    parse, parse_assume_role_with_web_identity, parse_bytes, parse_create_session, parse_error,
    parse_initiate_multipart_upload, parse_list_objects_v2, parse_sts_error,
    write_complete_multipart_upload, CompletedPart, XmlError, MAX_XML_DEPTH,
};

const LIST_PAGE: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>lmcache-kv</Name>
  <Prefix>Qwen/Qwen3@</Prefix>
  <KeyCount>2</KeyCount>
  <MaxKeys>2</MaxKeys>
  <IsTruncated>true</IsTruncated>
  <ContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</ContinuationToken>
  <NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
  <Contents>
    <Key>Qwen/Qwen3@0000001a@0@6c9faa6ae5af1bdf</Key>
    <LastModified>2024-02-01T03:04:05.000Z</LastModified>
    <ETag>&quot;fba9dede5f27731c9771645a39863328&quot;</ETag>
    <Size>16777216</Size>
    <StorageClass>STANDARD</StorageClass>
  </Contents>
  <Contents>
    <Key> spaced &lt;&amp;&gt; &#x1F980; &#233; key </Key>
    <LastModified>2024-02-01T03:04:06Z</LastModified>
    <ETag>"a-4"</ETag>
    <Size>0</Size>
  </Contents>
</ListBucketResult>"#;

#[test]
fn list_objects_v2_page() {
    let page = parse_list_objects_v2(LIST_PAGE).unwrap();
    assert_eq!(page.name.as_deref(), Some("lmcache-kv"));
    assert_eq!(page.prefix.as_deref(), Some("Qwen/Qwen3@"));
    assert_eq!(page.key_count, Some(2));
    assert_eq!(page.max_keys, Some(2));
    assert!(page.is_truncated);
    assert_eq!(
        page.next_continuation_token.as_deref(),
        Some("1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=")
    );
    assert_eq!(page.contents.len(), 2);
    let first = &page.contents[0];
    assert_eq!(first.key, "Qwen/Qwen3@0000001a@0@6c9faa6ae5af1bdf");
    assert_eq!(first.size, 16 << 20);
    assert_eq!(
        first.etag.as_deref(),
        Some("\"fba9dede5f27731c9771645a39863328\"")
    );
    assert_eq!(
        first.last_modified,
        Some(UNIX_EPOCH + Duration::from_secs(1_706_756_645))
    );
    // Text is kept exactly, entities and references decoded.
    assert_eq!(page.contents[1].key, " spaced <&> 🦀 é key ");
    assert_eq!(page.contents[1].size, 0);
}

#[test]
fn list_objects_v2_edge_cases() {
    // Last page, empty prefix element, no contents, common prefixes.
    let page = parse_list_objects_v2(
        "<ListBucketResult><Name>b</Name><Prefix/><KeyCount>0</KeyCount>\
         <IsTruncated>false</IsTruncated>\
         <CommonPrefixes><Prefix>a/</Prefix></CommonPrefixes>\
         <CommonPrefixes><Prefix>b/</Prefix></CommonPrefixes></ListBucketResult>",
    )
    .unwrap();
    assert_eq!(page.prefix.as_deref(), Some(""));
    assert!(!page.is_truncated);
    assert!(page.contents.is_empty());
    assert_eq!(page.common_prefixes, ["a/", "b/"]);

    // A namespace prefix on every element is tolerated.
    let page = parse_list_objects_v2(
        "<s3:ListBucketResult xmlns:s3='http://s3.amazonaws.com/doc/2006-03-01/'>\
         <s3:Contents><s3:Key>k</s3:Key><s3:Size> 7 </s3:Size></s3:Contents>\
         </s3:ListBucketResult>",
    )
    .unwrap();
    assert_eq!(page.contents[0].key, "k");
    assert_eq!(page.contents[0].size, 7);
    assert_eq!(page.contents[0].last_modified, None);

    // The S3 Express page recorded by aws-sdk-s3 (CRC32 element first).
    let page = parse_list_objects_v2(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
         <Name>s3express-test-bucket--usw2-az1--x-s3</Name><Prefix/><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>\
         <IsTruncated>false</IsTruncated><Contents><ChecksumAlgorithm>CRC32</ChecksumAlgorithm><Key>hello-world.txt</Key>\
         <LastModified>2024-01-29T18:32:24.000Z</LastModified><ETag>\"c6f3f6f3a0c4c4e4c1b3d4e0f9c7a6b5\"</ETag>\
         <Size>14</Size><StorageClass>EXPRESS_ONEZONE</StorageClass></Contents></ListBucketResult>",
    )
    .unwrap();
    assert_eq!(page.contents[0].key, "hello-world.txt");
    assert_eq!(page.contents[0].size, 14);

    // Semantic errors.
    let cases: &[(&str, XmlError)] = &[
        (
            "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
            XmlError::Missing {
                element: "ListBucketResult/NextContinuationToken",
            },
        ),
        (
            "<ListBucketResult><Contents><Key>k</Key></Contents></ListBucketResult>",
            XmlError::Missing {
                element: "Contents/Size",
            },
        ),
        (
            "<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>",
            XmlError::Missing {
                element: "Contents/Key",
            },
        ),
        (
            "<ListBucketResult><Contents><Key>k</Key><Size>-1</Size></Contents></ListBucketResult>",
            XmlError::InvalidValue {
                element: "Contents/Size",
                value: "-1".into(),
                expected: "an unsigned integer",
            },
        ),
        (
            "<ListBucketResult><Contents><Key>k</Key><Key>j</Key><Size>1</Size></Contents></ListBucketResult>",
            XmlError::Duplicate {
                element: "Contents/Key",
            },
        ),
        (
            "<ListBucketResult><IsTruncated>yes</IsTruncated></ListBucketResult>",
            XmlError::InvalidValue {
                element: "ListBucketResult/IsTruncated",
                value: "yes".into(),
                expected: "true or false",
            },
        ),
        (
            "<Error><Code>AccessDenied</Code></Error>",
            XmlError::UnexpectedRoot {
                expected: "ListBucketResult",
                found: "Error".into(),
            },
        ),
    ];
    for (text, want) in cases {
        assert_eq!(parse_list_objects_v2(text).as_ref(), Err(want), "{text}");
    }
    let err = parse_list_objects_v2(
        "<ListBucketResult><Contents><Key>k</Key><Size>1</Size><LastModified>yesterday</LastModified></Contents></ListBucketResult>",
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            XmlError::InvalidValue {
                element: "Contents/LastModified",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(parse_list_objects_v2(
        "<ListBucketResult><Contents><Key>k</Key><Size>18446744073709551616</Size></Contents></ListBucketResult>"
    )
    .is_err());
}

#[test]
fn error_bodies() {
    let e = parse_error(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>NoSuchKey</Code>\
         <Message>The specified key does not exist.</Message><Key>m@0000001a@0@ab</Key>\
         <RequestId>4442587FB7D0A2F9</RequestId><HostId>abc=</HostId></Error>",
    )
    .unwrap();
    assert_eq!(e.code, "NoSuchKey");
    assert_eq!(
        e.message.as_deref(),
        Some("The specified key does not exist.")
    );
    assert_eq!(e.resource.as_deref(), Some("m@0000001a@0@ab"));
    assert_eq!(e.request_id.as_deref(), Some("4442587FB7D0A2F9"));
    assert_eq!(e.host_id.as_deref(), Some("abc="));

    // Minimal (MinIO/s3s style with Resource), and missing code.
    let e = parse_error("<Error><Code>SlowDown</Code><Resource>/b/k</Resource></Error>").unwrap();
    assert_eq!((e.code.as_str(), e.message), ("SlowDown", None));
    assert_eq!(e.resource.as_deref(), Some("/b/k"));
    assert_eq!(
        parse_error("<Error><Message>x</Message></Error>"),
        Err(XmlError::Missing {
            element: "Error/Code"
        })
    );
}

#[test]
fn create_session_result() {
    let creds = parse_create_session(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CreateSessionResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
         <Credentials><SessionToken>TESTSESSIONTOKEN</SessionToken><SecretAccessKey>TESTSECRETKEY</SecretAccessKey>\
         <AccessKeyId>ASIARTESTID</AccessKeyId><Expiration>2024-01-29T18:53:01Z</Expiration></Credentials>\
         </CreateSessionResult>",
    )
    .unwrap();
    assert_eq!(creds.access_key_id(), "ASIARTESTID");
    assert_eq!(creds.secret_access_key(), "TESTSECRETKEY");
    assert_eq!(creds.session_token(), Some("TESTSESSIONTOKEN"));
    assert_eq!(
        creds.expiry(),
        Some(UNIX_EPOCH + Duration::from_secs(1_706_554_381))
    );
    assert_eq!(creds.source(), &CredentialSource::S3ExpressSession);

    for (text, element) in [
        ("<CreateSessionResult/>", "CreateSessionResult/Credentials"),
        (
            "<CreateSessionResult><Credentials><SecretAccessKey>s</SecretAccessKey><AccessKeyId>a</AccessKeyId>\
             <Expiration>2024-01-29T18:53:01Z</Expiration></Credentials></CreateSessionResult>",
            "Credentials/SessionToken",
        ),
        (
            "<CreateSessionResult><Credentials><SessionToken>t</SessionToken><SecretAccessKey>s</SecretAccessKey>\
             <AccessKeyId>a</AccessKeyId></Credentials></CreateSessionResult>",
            "Credentials/Expiration",
        ),
    ] {
        assert_eq!(parse_create_session(text).unwrap_err(), XmlError::Missing { element }, "{text}");
    }
    // Empty secret: rejected, and the error does not echo the values.
    let err = parse_create_session(
        "<CreateSessionResult><Credentials><SessionToken>SESSIONTOKENVALUE</SessionToken><SecretAccessKey></SecretAccessKey>\
         <AccessKeyId>a</AccessKeyId><Expiration>2024-01-29T18:53:01Z</Expiration></Credentials></CreateSessionResult>",
    )
    .unwrap_err();
    assert!(matches!(err, XmlError::InvalidValue { .. }));
    assert!(!err.to_string().contains("SESSIONTOKENVALUE"), "{err}");
}

#[test]
fn sts_web_identity_result_and_errors() {
    let creds = parse_assume_role_with_web_identity(
        "<AssumeRoleWithWebIdentityResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">\
         <AssumeRoleWithWebIdentityResult><SubjectFromWebIdentityToken>sub</SubjectFromWebIdentityToken>\
         <Audience>sts.amazonaws.com</Audience><AssumedRoleUser><Arn>arn</Arn><AssumedRoleId>id</AssumedRoleId></AssumedRoleUser>\
         <Credentials><SessionToken> STSTOKEN </SessionToken><SecretAccessKey>STSSECRET</SecretAccessKey>\
         <Expiration>2024-01-29T18:53:01.123Z</Expiration><AccessKeyId>ASIASTS</AccessKeyId></Credentials>\
         <Provider>www.amazon.com</Provider></AssumeRoleWithWebIdentityResult>\
         <ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></AssumeRoleWithWebIdentityResponse>",
    )
    .unwrap();
    assert_eq!(creds.access_key_id(), "ASIASTS");
    assert_eq!(creds.secret_access_key(), "STSSECRET");
    assert_eq!(creds.session_token(), Some("STSTOKEN"));
    assert_eq!(
        creds.expiry(),
        Some(UNIX_EPOCH + Duration::from_millis(1_706_554_381_123))
    );
    assert_eq!(creds.source(), &CredentialSource::WebIdentity);
    assert_eq!(
        parse_assume_role_with_web_identity(
            "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult/></AssumeRoleWithWebIdentityResponse>"
        )
        .unwrap_err(),
        XmlError::Missing {
            element: "AssumeRoleWithWebIdentityResult/Credentials"
        }
    );
    assert!(matches!(
        parse_assume_role_with_web_identity("<CreateSessionResult/>"),
        Err(XmlError::UnexpectedRoot { .. })
    ));

    let e = parse_sts_error(
        "<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error><Type>Sender</Type>\
         <Code>InvalidIdentityToken</Code><Message>No OpenIDConnect provider found</Message></Error>\
         <RequestId>rid</RequestId></ErrorResponse>",
    )
    .unwrap();
    assert_eq!(e.code, "InvalidIdentityToken");
    assert_eq!(
        e.message.as_deref(),
        Some("No OpenIDConnect provider found")
    );
    assert_eq!(e.request_id.as_deref(), Some("rid"));
    let e = parse_sts_error("<Error><Code>Throttling</Code></Error>").unwrap();
    assert_eq!((e.code.as_str(), e.message), ("Throttling", None));
    assert!(parse_sts_error("<ErrorResponse/>").is_err());
    assert!(parse_sts_error("<html/>").is_err());
}

#[test]
fn initiate_multipart_upload_result() {
    let r = parse_initiate_multipart_upload(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<InitiateMultipartUploadResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
         <Bucket>lmcache-kv</Bucket><Key>m@1</Key>\
         <UploadId>VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA</UploadId></InitiateMultipartUploadResult>",
    )
    .unwrap();
    assert_eq!(
        r.upload_id,
        "VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA"
    );
    assert_eq!(r.bucket.as_deref(), Some("lmcache-kv"));
    assert_eq!(r.key.as_deref(), Some("m@1"));
    assert!(matches!(
        parse_initiate_multipart_upload(
            "<InitiateMultipartUploadResult><UploadId> </UploadId></InitiateMultipartUploadResult>"
        ),
        Err(XmlError::InvalidValue { .. })
    ));
    assert!(matches!(
        parse_initiate_multipart_upload("<InitiateMultipartUploadResult/>"),
        Err(XmlError::Missing { .. })
    ));
}

#[test]
fn complete_multipart_upload_writer() {
    let parts = [
        CompletedPart {
            part_number: 1,
            etag: "\"a54357aff0632cce46d942af68356b38\"".into(),
        },
        CompletedPart {
            part_number: 2,
            etag: "\"0c78aef83f66abc1fa1e8477f296d394\"".into(),
        },
        CompletedPart {
            part_number: 10_000,
            etag: "odd<&>'".into(),
        },
    ];
    let mut body = String::new();
    write_complete_multipart_upload(&parts, &mut body).unwrap();
    assert_eq!(
        body,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\
         <CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
         <Part><PartNumber>1</PartNumber><ETag>&quot;a54357aff0632cce46d942af68356b38&quot;</ETag></Part>\
         <Part><PartNumber>2</PartNumber><ETag>&quot;0c78aef83f66abc1fa1e8477f296d394&quot;</ETag></Part>\
         <Part><PartNumber>10000</PartNumber><ETag>odd&lt;&amp;&gt;&apos;</ETag></Part>\
         </CompleteMultipartUpload>"
    );
    // It reads back through our own parser.
    let root = parse(&body).unwrap();
    let etags: Vec<&str> = root
        .children_named("Part")
        .map(|p| p.children_named("ETag").next().unwrap().text())
        .collect();
    assert_eq!(
        etags,
        parts.iter().map(|p| p.etag.as_str()).collect::<Vec<_>>()
    );

    let bad = |parts: &[CompletedPart]| write_complete_multipart_upload(parts, &mut String::new());
    assert!(bad(&[]).is_err());
    let part = |n: u32, e: &str| CompletedPart {
        part_number: n,
        etag: e.into(),
    };
    assert!(bad(&[part(0, "e")]).is_err());
    assert!(bad(&[part(10_001, "e")]).is_err());
    assert!(bad(&[part(2, "e"), part(1, "e")]).is_err());
    assert!(bad(&[part(1, "e"), part(1, "e")]).is_err());
    assert!(bad(&[part(1, "")]).is_err());
    assert!(bad(&[part(1, "a\nb")]).is_err());
}

#[test]
fn entities_cdata_comments_and_declarations() {
    let root = parse(
        "\u{FEFF}<?xml version='1.0'?><!-- lead --><?pi x?>\
         <R a='1' b = \"&lt;2&gt;\">&amp;&lt;&gt;&quot;&apos;&#65;&#x42;&#X43;<![CDATA[<raw & text>]]><!-- c -->\r\nz\rw</R>\
         <!-- trail -->\n",
    )
    .unwrap();
    assert_eq!(root.name(), "R");
    assert_eq!(root.text(), "&<>\"'ABC<raw & text>\nz\nw");
    assert!(root.children().is_empty());
    assert_eq!(parse_bytes(b"<a>x</a>").unwrap().text(), "x");
}

/// Inputs that must be rejected, each with a syntax (or structural) error.
const GARBAGE: &[&str] = &[
    "",
    "   ",
    "not xml",
    "<",
    "<a",
    "<a>",
    "<a></b>",
    "<a><b></a></b>",
    "<a>text",
    "</a>",
    "<a/><b/>",
    "<a/>trailing",
    "text<a/>",
    "<a>&unknown;</a>",
    "<a>&amp</a>",
    "<a>& b</a>",
    "<a>&#;</a>",
    "<a>&#x;</a>",
    "<a>&#0;</a>",
    "<a>&#xD800;</a>",
    "<a>&#x110000;</a>",
    "<a>&#99999999999;</a>",
    "<a>\u{1}</a>",
    "<a b></a>",
    "<a b=1></a>",
    "<a b='1></a>",
    "<a b='<'></a>",
    "<a b='1'c='2'></a>",
    "<a><!-- unterminated </a>",
    "<a><![CDATA[ unterminated</a>",
    "<a><?pi unterminated</a>",
    "<!DOCTYPE a [<!ENTITY x 'y'>]><a>&x;</a>",
    "<a><!ELEMENT x></a>",
    "<1a/>",
    "< a/>",
    "<a:/>",
    "<a></a >x",
    "<a></a",
    "<?xml version='1.0'?>",
    "<!-- only a comment -->",
];

#[test]
fn garbage_is_rejected() {
    for text in GARBAGE {
        assert!(parse(text).is_err(), "{text:?} was accepted");
    }
    assert!(parse_bytes(b"<a>\xff</a>").is_err());
    let deep = "<a>".repeat(MAX_XML_DEPTH + 1) + &"</a>".repeat(MAX_XML_DEPTH + 1);
    assert_eq!(parse(&deep), Err(XmlError::TooDeep));
    let ok_depth = "<a>".repeat(MAX_XML_DEPTH) + &"</a>".repeat(MAX_XML_DEPTH);
    assert!(parse(&ok_depth).is_ok());
}

/// Every prefix of real responses (a truncated body) and a seeded stream of
/// byte-level corruptions: errors, never panics.
#[test]
fn truncated_and_corrupted_inputs_never_panic() {
    let samples = [
        LIST_PAGE,
        "<Error><Code>NoSuchKey</Code><Message>m</Message><RequestId>r</RequestId></Error>",
        "<CreateSessionResult><Credentials><SessionToken>t</SessionToken><SecretAccessKey>s</SecretAccessKey>\
         <AccessKeyId>a</AccessKeyId><Expiration>2024-01-29T18:53:01Z</Expiration></Credentials></CreateSessionResult>",
        "<InitiateMultipartUploadResult><UploadId>u</UploadId></InitiateMultipartUploadResult>",
    ];
    for sample in samples {
        let bytes = sample.as_bytes();
        for cut in 0..bytes.len() {
            let prefix = &bytes[..cut];
            let whole = parse_bytes(prefix);
            // A prefix is never a complete document except when only
            // trailing whitespace/comments were cut, which the samples lack.
            assert!(whole.is_err(), "prefix of {cut} bytes parsed");
            if let Ok(text) = std::str::from_utf8(prefix) {
                let _ = parse_list_objects_v2(text);
                let _ = parse_error(text);
                let _ = parse_create_session(text);
                let _ = parse_initiate_multipart_upload(text);
            }
        }
    }

    let mut state: u64 = 0x00c0_ffee_1234_5678;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    const NOISE: &[u8] = b"<>/&;#x=\"' ![]-?CDATA\r\n\t\x00\xff\xc3";
    let mut accepted = 0;
    for i in 0..20_000 {
        let mut bytes = samples[i % samples.len()].as_bytes().to_vec();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % (bytes.len() + 1);
            match next() % 3 {
                0 if at < bytes.len() => {
                    bytes.remove(at);
                }
                1 => bytes.insert(at, NOISE[(next() as usize) % NOISE.len()]),
                _ if at < bytes.len() => bytes[at] = NOISE[(next() as usize) % NOISE.len()],
                _ => {}
            }
        }
        if let Ok(text) = std::str::from_utf8(&bytes) {
            accepted += usize::from(parse(text).is_ok());
            let _ = parse_list_objects_v2(text);
            let _ = parse_error(text);
            let _ = parse_create_session(text);
            let _ = parse_initiate_multipart_upload(text);
        } else {
            assert!(parse_bytes(&bytes).is_err());
        }
    }
    // Some mutations (in text content) still leave well-formed XML.
    assert!(accepted < 20_000);
}
