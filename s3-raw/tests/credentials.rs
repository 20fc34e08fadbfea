//! Credential sources and the chain, with explicit environments and profile
//! files in temporary directories (the process environment is never read or
//! changed).

mod common;

use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use common::TempDir;
use kvshard_s3_raw::credentials::{
    from_env, parse_profile_file, plan_credentials, profile_file_paths, resolve_credentials,
    selected_profile, static_from_config, CredentialPlan, CredentialSource, Credentials,
    CredentialsError, Env, HttpCredentialFetcher, HttpCredentialSource, ProfileFileKind,
    IMDS_ENDPOINT_IPV4, IMDS_ENDPOINT_IPV6, STS_GLOBAL_ENDPOINT,
};

/// An environment whose HOME is `home` and where IMDS is disabled, plus
/// `vars`.
fn env(home: &Path, vars: &[(&str, &str)]) -> Env {
    let mut pairs: Vec<(String, String)> = vec![
        ("HOME".into(), home.display().to_string()),
        ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
    ];
    pairs.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Env::from_pairs(pairs)
}

fn ready(plan: Result<CredentialPlan, CredentialsError>) -> Credentials {
    match plan {
        Ok(CredentialPlan::Ready(c)) => c,
        other => panic!("expected ready credentials, got {other:?}"),
    }
}

const CREDENTIALS_FILE: &str = "\
# comment line
; another comment
[default]
aws_access_key_id = AKIDDEFAULT
aws_secret_access_key = secret/default+key

[dev]
AWS_ACCESS_KEY_ID=AKIDDEV
aws_secret_access_key: secret-dev
aws_session_token =  token-dev  

[half]
aws_access_key_id = AKIDHALF

[profile looks-like-config]
aws_access_key_id = AKIDLITERAL
aws_secret_access_key = s
";

const CONFIG_FILE: &str = "\
[default]
region = us-west-2
s3 =
  max_concurrent_requests = 20
  addressing_style = virtual

[profile cfgonly]
aws_access_key_id = AKIDCFG
aws_secret_access_key = secret-cfg

[profile dev]
aws_access_key_id = AKIDSHADOWED
aws_secret_access_key = shadowed

[profile webid]
role_arn = arn:aws:iam::123456789012:role/kv
web_identity_token_file = /var/run/token
role_session_name = kvshard

[profile assume]
role_arn = arn:aws:iam::123456789012:role/kv
source_profile = default

[profile sso]
sso_session = corp
sso_account_id = 123456789012

[profile proc]
credential_process = /bin/creds

[profile nokeys]
region = eu-west-1

[sso-session corp]
sso_start_url = https://corp.awsapps.com/start

[notaprofile]
aws_access_key_id = AKIDNOT
aws_secret_access_key = not
";

fn home_with_files(name: &str) -> TempDir {
    let home = TempDir::new(name);
    home.write(".aws/credentials", CREDENTIALS_FILE);
    home.write(".aws/config", CONFIG_FILE);
    home
}

#[test]
fn static_keys_and_debug_redaction() {
    let creds = Credentials::new(
        "AKIDEXAMPLE",
        "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        Some("TOKENVALUE".into()),
        Some(UNIX_EPOCH + Duration::from_secs(1000)),
    )
    .unwrap();
    assert_eq!(creds.source(), &CredentialSource::Static);
    let text = format!("{creds:?}");
    assert!(text.contains("AKIDEXAMPLE"), "{text}");
    assert!(!text.contains("wJalrXUtnFEMI"), "{text}");
    assert!(!text.contains("TOKENVALUE"), "{text}");
    assert!(creds.expires_within(
        UNIX_EPOCH + Duration::from_secs(990),
        Duration::from_secs(10)
    ));
    assert!(!creds.expires_within(
        UNIX_EPOCH + Duration::from_secs(989),
        Duration::from_secs(10)
    ));

    for (ak, sk, token) in [
        ("", "s", None),
        ("AK ID", "s", None),
        ("AK", "", None),
        ("AK", "s", Some("")),
        ("AK", "s", Some(" padded")),
        ("AK", "s", Some("line\nbreak")),
    ] {
        let r = Credentials::new(ak, sk, token.map(str::to_owned), None);
        assert!(
            matches!(r, Err(CredentialsError::Invalid { .. })),
            "{ak:?} {sk:?} {token:?}"
        );
    }

    assert!(static_from_config(None, None).unwrap().is_none());
    assert!(static_from_config(Some(""), Some("")).unwrap().is_none());
    let c = static_from_config(Some("AK"), Some("SK")).unwrap().unwrap();
    assert_eq!((c.access_key_id(), c.secret_access_key()), ("AK", "SK"));
    assert_eq!(
        static_from_config(Some("AK"), None).unwrap_err(),
        CredentialsError::Partial {
            source: "adapter config".into(),
            missing: "aws_secret_access_key".into()
        }
    );
    assert!(matches!(
        static_from_config(None, Some("SK")),
        Err(CredentialsError::Partial { .. })
    ));
}

#[test]
fn environment_source() {
    let home = TempDir::new("env");
    let e = env(
        home.path(),
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDENV"),
            ("AWS_SECRET_ACCESS_KEY", "secret-env"),
            ("AWS_SESSION_TOKEN", "token-env"),
            ("AWS_CREDENTIAL_EXPIRATION", "2030-01-01T00:00:00Z"),
        ],
    );
    let c = from_env(&e).unwrap().unwrap();
    assert_eq!(c.access_key_id(), "AKIDENV");
    assert_eq!(c.secret_access_key(), "secret-env");
    assert_eq!(c.session_token(), Some("token-env"));
    assert_eq!(
        c.expiry(),
        Some(UNIX_EPOCH + Duration::from_secs(1_893_456_000))
    );
    assert_eq!(c.source(), &CredentialSource::Environment);

    // Legacy token name; empty values count as unset.
    let e = env(
        home.path(),
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDENV"),
            ("AWS_SECRET_ACCESS_KEY", "secret-env"),
            ("AWS_SESSION_TOKEN", ""),
            ("AWS_SECURITY_TOKEN", "legacy"),
        ],
    );
    assert_eq!(
        from_env(&e).unwrap().unwrap().session_token(),
        Some("legacy")
    );
    assert!(from_env(&env(home.path(), &[("AWS_ACCESS_KEY_ID", "")]))
        .unwrap()
        .is_none());

    // Missing pieces.
    let err = from_env(&env(home.path(), &[("AWS_ACCESS_KEY_ID", "AK")])).unwrap_err();
    assert_eq!(
        err,
        CredentialsError::Partial {
            source: "environment".into(),
            missing: "AWS_SECRET_ACCESS_KEY".into()
        }
    );
    assert!(err.to_string().contains("AWS_SECRET_ACCESS_KEY"), "{err}");
    let err = from_env(&env(home.path(), &[("AWS_SECRET_ACCESS_KEY", "SK")])).unwrap_err();
    assert!(
        matches!(err, CredentialsError::Partial { ref missing, .. } if missing == "AWS_ACCESS_KEY_ID")
    );
    let err = from_env(&env(
        home.path(),
        &[
            ("AWS_ACCESS_KEY_ID", "AK"),
            ("AWS_SECRET_ACCESS_KEY", "SK"),
            ("AWS_CREDENTIAL_EXPIRATION", "tomorrow"),
        ],
    ))
    .unwrap_err();
    assert!(
        matches!(err, CredentialsError::InvalidExpiry { .. }),
        "{err:?}"
    );
}

#[test]
fn environment_wins_over_profiles() {
    let home = home_with_files("precedence");
    let e = env(
        home.path(),
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDENV"),
            ("AWS_SECRET_ACCESS_KEY", "secret-env"),
            ("AWS_PROFILE", "dev"),
        ],
    );
    assert_eq!(ready(plan_credentials(&e)).access_key_id(), "AKIDENV");
    // Even a broken profile selection does not matter when env keys exist.
    let e = env(
        home.path(),
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDENV"),
            ("AWS_SECRET_ACCESS_KEY", "secret-env"),
            ("AWS_PROFILE", "missing"),
        ],
    );
    assert_eq!(ready(plan_credentials(&e)).access_key_id(), "AKIDENV");
}

#[test]
fn shared_credentials_file_profiles() {
    let home = home_with_files("shared");
    let c = ready(plan_credentials(&env(home.path(), &[])));
    assert_eq!(c.access_key_id(), "AKIDDEFAULT");
    assert_eq!(c.secret_access_key(), "secret/default+key");
    assert_eq!(c.session_token(), None);
    assert_eq!(
        c.source(),
        &CredentialSource::SharedCredentialsFile {
            profile: "default".into()
        }
    );

    // Keys are case-insensitive, ':' separates too, values are trimmed; the
    // credentials file shadows the config file's keys.
    let c = ready(plan_credentials(&env(
        home.path(),
        &[("AWS_PROFILE", "dev")],
    )));
    assert_eq!(c.access_key_id(), "AKIDDEV");
    assert_eq!(c.secret_access_key(), "secret-dev");
    assert_eq!(c.session_token(), Some("token-dev"));

    // AWS_DEFAULT_PROFILE is honoured when AWS_PROFILE is not set.
    let c = ready(plan_credentials(&env(
        home.path(),
        &[("AWS_DEFAULT_PROFILE", "dev")],
    )));
    assert_eq!(c.access_key_id(), "AKIDDEV");
    assert_eq!(
        selected_profile(&env(home.path(), &[])),
        ("default".into(), false)
    );

    // In the credentials file "[profile x]" is a profile literally named so.
    let c = ready(plan_credentials(&env(
        home.path(),
        &[("AWS_PROFILE", "profile looks-like-config")],
    )));
    assert_eq!(c.access_key_id(), "AKIDLITERAL");

    // Missing secret in the profile: a clear error naming file and key.
    let err = plan_credentials(&env(home.path(), &[("AWS_PROFILE", "half")])).unwrap_err();
    match &err {
        CredentialsError::Partial { source, missing } => {
            assert!(source.contains("\"half\""), "{source}");
            assert!(source.contains(".aws/credentials"), "{source}");
            assert_eq!(missing, "aws_secret_access_key");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn config_file_profiles() {
    let home = home_with_files("config");
    let c = ready(plan_credentials(&env(
        home.path(),
        &[("AWS_PROFILE", "cfgonly")],
    )));
    assert_eq!(c.access_key_id(), "AKIDCFG");
    assert_eq!(
        c.source(),
        &CredentialSource::ConfigFile {
            profile: "cfgonly".into()
        }
    );
    // Sections that are not profiles are not profiles.
    let err = plan_credentials(&env(home.path(), &[("AWS_PROFILE", "notaprofile")])).unwrap_err();
    assert!(
        matches!(err, CredentialsError::ProfileNotFound { .. }),
        "{err:?}"
    );
    let err = plan_credentials(&env(home.path(), &[("AWS_PROFILE", "corp")])).unwrap_err();
    assert!(
        matches!(err, CredentialsError::ProfileNotFound { .. }),
        "{err:?}"
    );
}

#[test]
fn explicit_file_locations() {
    let dir = TempDir::new("locations");
    let creds = dir.write(
        "elsewhere/creds.ini",
        "[default]\naws_access_key_id=AKIDELSE\naws_secret_access_key=s\n",
    );
    let config = dir.write(
        "elsewhere/config.ini",
        "[profile x]\naws_access_key_id=AKIDX\naws_secret_access_key=s\n",
    );
    let e = env(
        Path::new("/nonexistent-home"),
        &[
            ("AWS_SHARED_CREDENTIALS_FILE", creds.to_str().unwrap()),
            ("AWS_CONFIG_FILE", config.to_str().unwrap()),
        ],
    );
    assert_eq!(
        profile_file_paths(&e),
        (Some(creds.clone()), Some(config.clone()))
    );
    assert_eq!(ready(plan_credentials(&e)).access_key_id(), "AKIDELSE");
    let e = env(
        Path::new("/nonexistent-home"),
        &[
            ("AWS_SHARED_CREDENTIALS_FILE", creds.to_str().unwrap()),
            ("AWS_CONFIG_FILE", config.to_str().unwrap()),
            ("AWS_PROFILE", "x"),
        ],
    );
    assert_eq!(ready(plan_credentials(&e)).access_key_id(), "AKIDX");

    // `~` expands from HOME in the env map.
    let e = env(
        dir.path(),
        &[("AWS_SHARED_CREDENTIALS_FILE", "~/elsewhere/creds.ini")],
    );
    assert_eq!(profile_file_paths(&e).0, Some(creds));
    // No HOME and no variables: no files, not an error.
    assert_eq!(
        profile_file_paths(&Env::from_pairs([("X", "1")])),
        (None, None)
    );
}

#[test]
fn named_profile_missing_everywhere() {
    let home = home_with_files("missing");
    let err = plan_credentials(&env(home.path(), &[("AWS_PROFILE", "nope")])).unwrap_err();
    match &err {
        CredentialsError::ProfileNotFound { profile, searched } => {
            assert_eq!(profile, "nope");
            assert_eq!(searched.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("\"nope\""), "{err}");
    // The implicit default profile missing is not an error: the chain goes on.
    let empty_home = TempDir::new("empty");
    let err = plan_credentials(&env(empty_home.path(), &[])).unwrap_err();
    assert_eq!(err, CredentialsError::NoCredentials);
}

#[test]
fn unsupported_profile_mechanisms_say_so() {
    let home = home_with_files("unsupported");
    for (profile, what) in [
        ("assume", "role assumption"),
        ("sso", "SSO"),
        ("proc", "credential_process"),
    ] {
        let err = plan_credentials(&env(home.path(), &[("AWS_PROFILE", profile)])).unwrap_err();
        match &err {
            CredentialsError::Unsupported { source, what: w } => {
                assert!(w.contains(what), "{profile}: {w}");
                assert!(source.contains(profile), "{source}");
            }
            other => panic!("{profile}: {other:?}"),
        }
    }
}

#[test]
fn http_sources_plug_in_through_the_fetcher() {
    let home = home_with_files("http");

    // Web identity from the profile.
    let plan = plan_credentials(&env(home.path(), &[("AWS_PROFILE", "webid")])).unwrap();
    let CredentialPlan::Http(source) = plan else {
        panic!("{plan:?}")
    };
    assert_eq!(
        source,
        HttpCredentialSource::WebIdentity {
            role_arn: "arn:aws:iam::123456789012:role/kv".into(),
            token_file: "/var/run/token".into(),
            session_name: Some("kvshard".into()),
            endpoint: STS_GLOBAL_ENDPOINT.into(),
        }
    );

    // Web identity from the environment beats the shared credentials file
    // (botocore's order).
    let e = env(
        home.path(),
        &[
            ("AWS_WEB_IDENTITY_TOKEN_FILE", "/tok"),
            ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r"),
        ],
    );
    assert!(matches!(
        plan_credentials(&e).unwrap(),
        CredentialPlan::Http(HttpCredentialSource::WebIdentity { .. })
    ));
    let err = plan_credentials(&env(
        home.path(),
        &[("AWS_WEB_IDENTITY_TOKEN_FILE", "/tok")],
    ))
    .unwrap_err();
    assert_eq!(
        err,
        CredentialsError::Partial {
            source: "environment".into(),
            missing: "AWS_ROLE_ARN".into()
        }
    );

    // Container credentials, after the profile files.
    let empty = TempDir::new("http-empty");
    let e = env(
        empty.path(),
        &[
            (
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "/v2/credentials/abc",
            ),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "SECRET-AUTH"),
        ],
    );
    let plan = plan_credentials(&e).unwrap();
    let CredentialPlan::Http(source) = &plan else {
        panic!("{plan:?}")
    };
    assert!(
        matches!(source, HttpCredentialSource::Container { uri, .. } if uri == "http://169.254.170.2/v2/credentials/abc")
    );
    assert!(!format!("{plan:?}").contains("SECRET-AUTH"));
    let e = env(
        empty.path(),
        &[(
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "http://127.0.0.1:9911/creds",
        )],
    );
    assert!(matches!(
        plan_credentials(&e).unwrap(),
        CredentialPlan::Http(HttpCredentialSource::Container { uri, .. }) if uri == "http://127.0.0.1:9911/creds"
    ));
    // Profile keys come before the container source.
    let e = env(
        home.path(),
        &[(
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "/v2/credentials/abc",
        )],
    );
    assert_eq!(ready(plan_credentials(&e)).access_key_id(), "AKIDDEFAULT");

    // IMDS last, unless disabled; endpoint overrides.
    let imds = |vars: &[(&str, &str)]| {
        let mut pairs = vec![("HOME".to_owned(), empty.path().display().to_string())];
        pairs.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        plan_credentials(&Env::from_pairs(pairs))
    };
    assert!(
        matches!(imds(&[]).unwrap(), CredentialPlan::Http(HttpCredentialSource::Imds { endpoint }) if endpoint == IMDS_ENDPOINT_IPV4)
    );
    assert!(
        matches!(imds(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "IPv6")]).unwrap(), CredentialPlan::Http(HttpCredentialSource::Imds { endpoint }) if endpoint == IMDS_ENDPOINT_IPV6)
    );
    assert!(
        matches!(imds(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://10.0.0.1:1338/")]).unwrap(), CredentialPlan::Http(HttpCredentialSource::Imds { endpoint }) if endpoint == "http://10.0.0.1:1338")
    );
    assert!(matches!(
        imds(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "IPv5")]),
        Err(CredentialsError::Invalid { .. })
    ));
    assert_eq!(
        imds(&[("AWS_EC2_METADATA_DISABLED", "TRUE")]).unwrap_err(),
        CredentialsError::NoCredentials
    );

    // A fetcher plugs in (the chain runs on a glommio executor).
    struct Fake;
    impl HttpCredentialFetcher for Fake {
        async fn fetch(
            &self,
            source: &HttpCredentialSource,
        ) -> Result<Credentials, CredentialsError> {
            assert!(matches!(source, HttpCredentialSource::Imds { .. }));
            Ok(Credentials::new("ASIAIMDS", "s", Some("t".into()), None)?
                .with_source(CredentialSource::Imds))
        }
    }
    let e = Env::from_pairs([("HOME", empty.path().to_str().unwrap())]);
    let handle =
        kvshard_io::executor::spawn_shard(0, None, "creds-fake".to_owned(), move || async move {
            let c = resolve_credentials(&e, &Fake).await.unwrap();
            assert_eq!(c.access_key_id(), "ASIAIMDS");
            assert_eq!(c.source(), &CredentialSource::Imds);
        })
        .expect("start a glommio executor");
    if let Err(panic) = handle.join() {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn web_identity_sts_endpoint() {
    let home = home_with_files("sts");
    let endpoint = |vars: &[(&str, &str)]| {
        let mut all = vec![
            ("AWS_WEB_IDENTITY_TOKEN_FILE", "/tok"),
            ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r"),
        ];
        all.extend_from_slice(vars);
        match plan_credentials(&env(home.path(), &all)) {
            Ok(CredentialPlan::Http(HttpCredentialSource::WebIdentity { endpoint, .. })) => {
                Ok(endpoint)
            }
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        }
    };
    // The default profile's region (config file) when the environment has none.
    assert_eq!(
        endpoint(&[]).unwrap(),
        "https://sts.us-west-2.amazonaws.com/"
    );
    assert_eq!(
        endpoint(&[("AWS_DEFAULT_REGION", "eu-central-1")]).unwrap(),
        "https://sts.eu-central-1.amazonaws.com/"
    );
    assert_eq!(
        endpoint(&[
            ("AWS_REGION", "cn-north-1"),
            ("AWS_DEFAULT_REGION", "eu-central-1")
        ])
        .unwrap(),
        "https://sts.cn-north-1.amazonaws.com.cn/"
    );
    assert_eq!(
        endpoint(&[
            ("AWS_REGION", "us-east-2"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:1/")
        ])
        .unwrap(),
        "http://127.0.0.1:1/"
    );
    assert_eq!(
        endpoint(&[
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:1/"),
            ("AWS_ENDPOINT_URL_STS", "http://127.0.0.1:2/sts")
        ])
        .unwrap(),
        "http://127.0.0.1:2/sts"
    );
    assert_eq!(
        endpoint(&[
            ("AWS_REGION", "us-east-2"),
            ("AWS_ENDPOINT_URL_STS", "http://127.0.0.1:2/"),
            ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
        ])
        .unwrap(),
        "https://sts.us-east-2.amazonaws.com/"
    );
    assert!(matches!(
        endpoint(&[("AWS_REGION", "us-east-1.evil.example/")]),
        Err(CredentialsError::Invalid { .. })
    ));
    // No region anywhere: the global endpoint.
    let empty = TempDir::new("sts-empty");
    let plan = plan_credentials(&env(
        empty.path(),
        &[
            ("AWS_WEB_IDENTITY_TOKEN_FILE", "/tok"),
            ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r"),
        ],
    ))
    .unwrap();
    assert!(
        matches!(&plan, CredentialPlan::Http(HttpCredentialSource::WebIdentity { endpoint, .. }) if endpoint == STS_GLOBAL_ENDPOINT),
        "{plan:?}"
    );
}

#[test]
fn profile_file_syntax() {
    let path = Path::new("/test/config");
    let p = parse_profile_file(CONFIG_FILE, ProfileFileKind::Config, path).unwrap();
    assert_eq!(p["default"]["region"], "us-west-2");
    assert_eq!(
        p["default"]["s3"],
        "\nmax_concurrent_requests = 20\naddressing_style = virtual"
    );
    assert!(!p.contains_key("notaprofile"));
    assert!(!p.contains_key("corp"));
    assert_eq!(p["webid"]["role_arn"], "arn:aws:iam::123456789012:role/kv");

    // CRLF line ends, `[profile default]`, spaces in headers, trailing
    // comments after a header, repeated sections merged.
    let text = "[profile   default ] # c\r\naws_access_key_id = A\r\n[default]\r\naws_secret_access_key = B\r\n";
    let p = parse_profile_file(text, ProfileFileKind::Config, path).unwrap();
    assert_eq!(p["default"]["aws_access_key_id"], "A");
    assert_eq!(p["default"]["aws_secret_access_key"], "B");
    // Values are verbatim: no inline comments.
    let p = parse_profile_file(
        "[a]\nk = v # not a comment\n",
        ProfileFileKind::Credentials,
        path,
    )
    .unwrap();
    assert_eq!(p["a"]["k"], "v # not a comment");

    for (text, line) in [
        ("key = value\n", 1),
        ("[a]\n[b\n", 2),
        ("[]\n", 1),
        ("[a] junk\n", 1),
        ("[a]\njust words\n", 2),
        ("[a]\n = value\n", 2),
    ] {
        match parse_profile_file(text, ProfileFileKind::Credentials, path) {
            Err(CredentialsError::Parse {
                line: l, path: p, ..
            }) => {
                assert_eq!(l, line, "{text:?}");
                assert_eq!(p, path);
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }

    // A broken file stops the chain with the file and line.
    let home = TempDir::new("broken");
    home.write(".aws/credentials", "[default]\nno equals sign here\n");
    let err = plan_credentials(&env(home.path(), &[])).unwrap_err();
    assert!(err.to_string().contains(".aws/credentials:2"), "{err}");
}
