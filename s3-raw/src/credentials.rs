//! AWS credentials and the provider chain that finds them.
//!
//! lmcache 0.5.6 signs with static keys from its config when both are set and
//! otherwise asks boto3's credential chain. kvshard follows botocore's order,
//! restricted to the sources it knows:
//!
//! 1. environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//!    `AWS_SESSION_TOKEN` (or the legacy `AWS_SECURITY_TOKEN`),
//!    `AWS_CREDENTIAL_EXPIRATION`;
//! 2. the selected profile's role settings: `role_arn` with `source_profile`
//!    or `credential_source` (not supported, an error says so);
//! 3. web identity: `web_identity_token_file` + `role_arn` in the profile, or
//!    `AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN` (+
//!    `AWS_ROLE_SESSION_NAME`) (HTTP, STS);
//! 4. SSO settings in the profile (not supported, an error says so);
//! 5. the shared credentials file (`AWS_SHARED_CREDENTIALS_FILE`, default
//!    `~/.aws/credentials`), section `[name]`;
//! 6. `credential_process` in the profile (not supported, an error says so);
//! 7. the config file (`AWS_CONFIG_FILE`, default `~/.aws/config`), section
//!    `[profile name]` (or `[default]`);
//! 8. container credentials: `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI` or
//!    `AWS_CONTAINER_CREDENTIALS_FULL_URI` (+
//!    `AWS_CONTAINER_AUTHORIZATION_TOKEN[_FILE]`) (HTTP);
//! 9. EC2 instance metadata, IMDSv2 (HTTP), unless
//!    `AWS_EC2_METADATA_DISABLED=true`.
//!
//! The profile is `AWS_PROFILE`, else `AWS_DEFAULT_PROFILE`, else `default`.
//! Profile settings are the config file's merged with the credentials file's
//! (the credentials file wins), as the SDKs do.
//!
//! As in botocore, a source that is configured but incomplete or broken stops
//! the chain with an error instead of falling through to the next one; a
//! profile named explicitly that exists in neither file is an error too.
//! Where kvshard is stricter than botocore: `AWS_SECRET_ACCESS_KEY` without
//! `AWS_ACCESS_KEY_ID` is an error (botocore skips the environment then), and
//! a repeated section is merged (botocore rejects the file).
//!
//! The HTTP sources (web identity, container, IMDSv2) are described by
//! [`HttpCredentialSource`] and fetched through an [`HttpCredentialFetcher`].
//! [`plan_credentials`] stops before any I/O other than reading the profile
//! files (blocking: [`resolve_credentials`] runs it on glommio's blocking
//! pool); [`crate::credential_http::HttpFetcher`] is the fetcher the client
//! uses (async HTTP/1.1 on the shard's executor), and tests can plug in
//! their own or point the sources at local servers through the environment
//! (`AWS_EC2_METADATA_SERVICE_ENDPOINT`, `AWS_CONTAINER_CREDENTIALS_FULL_URI`,
//! `AWS_ENDPOINT_URL_STS`).
//!
//! The STS endpoint of web identity is `AWS_ENDPOINT_URL_STS`, else
//! `AWS_ENDPOINT_URL` (both ignored when
//! `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`), else
//! `https://sts.<region>.amazonaws.com/` for the region of `AWS_REGION`,
//! `AWS_DEFAULT_REGION` or the profile's `region`, else the global
//! `https://sts.amazonaws.com/`.
//!
//! Everything takes the environment as an explicit [`Env`] so tests never
//! touch the process environment.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use ring::digest;

use crate::time::{parse_rfc3339, TimeError};

/// Largest profile file read; anything bigger is not a credentials file.
pub const MAX_PROFILE_FILE_BYTES: u64 = 1 << 20;
/// Container credentials host for `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`.
pub const ECS_CONTAINER_HOST: &str = "http://169.254.170.2";
/// Default IMDS endpoint (IPv4).
pub const IMDS_ENDPOINT_IPV4: &str = "http://169.254.169.254";
/// IMDS endpoint when `AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE=IPv6`.
pub const IMDS_ENDPOINT_IPV6: &str = "http://[fd00:ec2::254]";
/// STS endpoint when no region is configured.
pub const STS_GLOBAL_ENDPOINT: &str = "https://sts.amazonaws.com/";

/// Where a set of credentials came from (for logs and status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CredentialSource {
    /// Given directly (config fields, tests).
    Static,
    /// `AWS_ACCESS_KEY_ID` and friends.
    Environment,
    /// The shared credentials file.
    SharedCredentialsFile {
        /// Profile name.
        profile: String,
    },
    /// The config file.
    ConfigFile {
        /// Profile name.
        profile: String,
    },
    /// STS AssumeRoleWithWebIdentity.
    WebIdentity,
    /// The container credentials endpoint.
    Container,
    /// EC2 instance metadata.
    Imds,
    /// An S3 Express CreateSession response.
    S3ExpressSession,
}

/// An access key, its secret, an optional session token and an optional
/// expiry. `Debug` shows the access key id only.
#[derive(Clone)]
pub struct Credentials {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
    expiry: Option<SystemTime>,
    source: CredentialSource,
    /// SHA-256 of the secret: identifies the secret in the signer's key cache
    /// without keeping another copy of it.
    secret_fingerprint: [u8; 32],
}

impl Credentials {
    /// Static credentials. The access key id must be non-empty without
    /// whitespace or control characters, the secret non-empty, and the token,
    /// when given, non-empty and free of control characters (it is sent as a
    /// header value).
    pub fn new(
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
        session_token: Option<String>,
        expiry: Option<SystemTime>,
    ) -> Result<Credentials, CredentialsError> {
        let access_key_id = access_key_id.into();
        let secret_access_key = secret_access_key.into();
        let invalid = |reason: &str| CredentialsError::Invalid {
            source: "credentials".to_owned(),
            reason: reason.to_owned(),
        };
        if access_key_id.is_empty() || !access_key_id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                "access key id is empty or has whitespace or control characters",
            ));
        }
        if secret_access_key.is_empty() {
            return Err(invalid("secret access key is empty"));
        }
        if let Some(token) = &session_token {
            let header_safe = token
                .bytes()
                .all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f));
            if token.is_empty() || !header_safe || token.trim() != token {
                return Err(invalid(
                    "session token is empty, padded, or has control characters",
                ));
            }
        }
        let mut secret_fingerprint = [0u8; 32];
        secret_fingerprint.copy_from_slice(
            digest::digest(&digest::SHA256, secret_access_key.as_bytes()).as_ref(),
        );
        Ok(Credentials {
            access_key_id,
            secret_access_key,
            session_token,
            expiry,
            source: CredentialSource::Static,
            secret_fingerprint,
        })
    }

    /// Records where these credentials came from.
    pub fn with_source(mut self, source: CredentialSource) -> Credentials {
        self.source = source;
        self
    }

    /// The access key id.
    pub fn access_key_id(&self) -> &str {
        &self.access_key_id
    }

    /// The secret access key.
    pub fn secret_access_key(&self) -> &str {
        &self.secret_access_key
    }

    /// The session token, if any.
    pub fn session_token(&self) -> Option<&str> {
        self.session_token.as_deref()
    }

    /// When these credentials stop working, if known.
    pub fn expiry(&self) -> Option<SystemTime> {
        self.expiry
    }

    /// Where they came from.
    pub fn source(&self) -> &CredentialSource {
        &self.source
    }

    /// True when the expiry is known and is at most `margin` after `now`
    /// (refresh before that point).
    pub fn expires_within(&self, now: SystemTime, margin: Duration) -> bool {
        match self.expiry {
            Some(expiry) => expiry <= now + margin,
            None => false,
        }
    }

    pub(crate) fn secret_fingerprint(&self) -> &[u8; 32] {
        &self.secret_fingerprint
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .field("expiry", &self.expiry)
            .field("source", &self.source)
            .finish()
    }
}

/// Why no credentials could be produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CredentialsError {
    /// A source is configured but a required piece is missing.
    Partial {
        /// The source, e.g. `environment` or `profile "dev" in /root/.aws/credentials`.
        source: String,
        /// The missing setting.
        missing: String,
    },
    /// A value is present but unusable.
    Invalid {
        /// The source.
        source: String,
        /// What is wrong.
        reason: String,
    },
    /// The profile was named explicitly (`AWS_PROFILE`) but is in neither file.
    ProfileNotFound {
        /// The profile name.
        profile: String,
        /// The files searched (those that exist or were named).
        searched: Vec<PathBuf>,
    },
    /// A profile file exists but cannot be read.
    Io {
        /// The file.
        path: PathBuf,
        /// The error kind.
        kind: io::ErrorKind,
        /// The error text.
        message: String,
    },
    /// A profile file is malformed.
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: &'static str,
    },
    /// An expiry timestamp cannot be parsed.
    InvalidExpiry {
        /// The source.
        source: String,
        /// The parse error.
        error: TimeError,
    },
    /// The configuration asks for a mechanism kvshard does not support.
    Unsupported {
        /// The source.
        source: String,
        /// The mechanism.
        what: &'static str,
    },
    /// An HTTP source could not be reached or answered with an error.
    Http {
        /// The source, e.g. `IMDSv2`.
        source: &'static str,
        /// The request (method and URL) and what went wrong; never a token
        /// or a secret.
        message: String,
    },
    /// Nothing is configured and instance metadata is disabled.
    NoCredentials,
}

impl fmt::Display for CredentialsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CredentialsError::Partial { source, missing } => {
                write!(f, "incomplete credentials in {source}: {missing} is not set")
            }
            CredentialsError::Invalid { source, reason } => {
                write!(f, "invalid credentials in {source}: {reason}")
            }
            CredentialsError::ProfileNotFound { profile, searched } => {
                write!(f, "AWS profile {profile:?} not found in")?;
                if searched.is_empty() {
                    write!(f, " any file (no HOME and no AWS_CONFIG_FILE/AWS_SHARED_CREDENTIALS_FILE)")
                } else {
                    for (i, p) in searched.iter().enumerate() {
                        let sep = if i == 0 { " " } else { ", " };
                        write!(f, "{sep}{}", p.display())?;
                    }
                    Ok(())
                }
            }
            CredentialsError::Io {
                path,
                kind,
                message,
            } => write!(f, "cannot read {}: {message} ({kind:?})", path.display()),
            CredentialsError::Parse {
                path,
                line,
                message,
            } => write!(f, "{}:{line}: {message}", path.display()),
            CredentialsError::InvalidExpiry { source, error } => {
                write!(f, "invalid credential expiry in {source}: {error}")
            }
            CredentialsError::Unsupported { source, what } => {
                write!(f, "{source} uses {what}, which kvshard does not support")
            }
            CredentialsError::Http { source, message } => {
                write!(f, "fetching credentials from {source} failed: {message}")
            }
            CredentialsError::NoCredentials => write!(
                f,
                "no AWS credentials found (environment, profile files, web identity, container) and instance metadata is disabled"
            ),
        }
    }
}

impl std::error::Error for CredentialsError {}

/// A snapshot of environment variables. Empty values count as unset, as in
/// the SDKs. `Debug` lists names only.
#[derive(Clone, Default)]
pub struct Env {
    vars: HashMap<String, String>,
}

impl Env {
    /// The current process environment (non-UTF-8 entries are skipped).
    pub fn from_process() -> Env {
        Env {
            vars: std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .collect(),
        }
    }

    /// An explicit environment (tests, embedding).
    pub fn from_pairs<I, K, V>(pairs: I) -> Env
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        Env {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }

    /// The value of `name`, or `None` when unset or empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

impl fmt::Debug for Env {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<&String> = self.vars.keys().collect();
        names.sort();
        f.debug_struct("Env").field("names", &names).finish()
    }
}

/// Static keys from configuration fields (lmcache's `aws_access_key_id` /
/// `aws_secret_access_key`): `Some` when both are set, `None` when neither is.
/// Deviation: lmcache silently falls back to the chain when only one is set;
/// kvshard reports the missing one.
pub fn static_from_config(
    access_key_id: Option<&str>,
    secret_access_key: Option<&str>,
) -> Result<Option<Credentials>, CredentialsError> {
    let source = "adapter config";
    match (
        access_key_id.filter(|s| !s.is_empty()),
        secret_access_key.filter(|s| !s.is_empty()),
    ) {
        (None, None) => Ok(None),
        (Some(_), None) => Err(CredentialsError::Partial {
            source: source.to_owned(),
            missing: "aws_secret_access_key".to_owned(),
        }),
        (None, Some(_)) => Err(CredentialsError::Partial {
            source: source.to_owned(),
            missing: "aws_access_key_id".to_owned(),
        }),
        (Some(ak), Some(sk)) => Credentials::new(ak, sk, None, None)
            .map(Some)
            .map_err(|e| relabel(e, source)),
    }
}

fn relabel(error: CredentialsError, source: &str) -> CredentialsError {
    match error {
        CredentialsError::Invalid { reason, .. } => CredentialsError::Invalid {
            source: source.to_owned(),
            reason,
        },
        other => other,
    }
}

/// Credentials from the environment variables, `Ok(None)` when none are set.
pub fn from_env(env: &Env) -> Result<Option<Credentials>, CredentialsError> {
    let source = "environment";
    let ak = env.get("AWS_ACCESS_KEY_ID");
    let sk = env.get("AWS_SECRET_ACCESS_KEY");
    let (ak, sk) = match (ak, sk) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(CredentialsError::Partial {
                source: source.to_owned(),
                missing: "AWS_SECRET_ACCESS_KEY".to_owned(),
            })
        }
        (None, Some(_)) => {
            return Err(CredentialsError::Partial {
                source: source.to_owned(),
                missing: "AWS_ACCESS_KEY_ID".to_owned(),
            })
        }
        (Some(ak), Some(sk)) => (ak, sk),
    };
    let token = env
        .get("AWS_SESSION_TOKEN")
        .or_else(|| env.get("AWS_SECURITY_TOKEN"))
        .map(str::to_owned);
    let expiry = match env.get("AWS_CREDENTIAL_EXPIRATION") {
        Some(text) => {
            Some(
                parse_rfc3339(text).map_err(|error| CredentialsError::InvalidExpiry {
                    source: "AWS_CREDENTIAL_EXPIRATION".to_owned(),
                    error,
                })?,
            )
        }
        None => None,
    };
    Credentials::new(ak, sk, token, expiry)
        .map(|c| Some(c.with_source(CredentialSource::Environment)))
        .map_err(|e| relabel(e, source))
}

/// Which profile file a text came from; they name sections differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfileFileKind {
    /// `~/.aws/credentials`: `[name]`.
    Credentials,
    /// `~/.aws/config`: `[profile name]` or `[default]`; other sections
    /// (`[sso-session x]`, `[services x]`) are not profiles.
    Config,
}

/// Profile name → (lowercased key → value). Keys whose values continue on
/// indented lines (nested settings such as `s3 =`) keep those lines joined by
/// `\n`.
pub type Profiles = HashMap<String, BTreeMap<String, String>>;

/// Parses a profile file: `[section]` headers, `key = value` (or
/// `key: value`) lines, full-line `#` / `;` comments, indented continuation
/// lines. Values are taken verbatim after trimming (no inline comments), as
/// botocore's parser does. `path` only labels errors.
pub fn parse_profile_file(
    text: &str,
    kind: ProfileFileKind,
    path: &Path,
) -> Result<Profiles, CredentialsError> {
    let mut profiles = Profiles::new();
    // None: before the first section; Some(None): a section that is not a
    // profile (its lines are parsed and dropped).
    let mut section: Option<Option<String>> = None;
    let mut last_key: Option<String> = None;
    for (index, raw_line) in text.lines().enumerate() {
        let line_no = index + 1;
        let err = |message| CredentialsError::Parse {
            path: path.to_owned(),
            line: line_no,
            message,
        };
        let line = raw_line.strip_suffix('\r').unwrap_or(raw_line);
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
            continue;
        }
        let indented = line.starts_with([' ', '\t']);
        if indented {
            if let (Some(section), Some(key)) = (&section, &last_key) {
                if let Some(name) = section {
                    let value = profiles
                        .get_mut(name)
                        .and_then(|p| p.get_mut(key))
                        .expect("continued key exists");
                    value.push('\n');
                    value.push_str(trimmed);
                }
                continue;
            }
        }
        if trimmed.starts_with('[') {
            let close = trimmed
                .rfind(']')
                .ok_or_else(|| err("section header without ']'"))?;
            let rest = trimmed[close + 1..].trim_start();
            if !(rest.is_empty() || rest.starts_with('#') || rest.starts_with(';')) {
                return Err(err("text after a section header"));
            }
            let header = trimmed[1..close].trim();
            if header.is_empty() {
                return Err(err("empty section name"));
            }
            let name = match kind {
                ProfileFileKind::Credentials => Some(header.to_owned()),
                ProfileFileKind::Config => {
                    let mut words = header.split_whitespace();
                    match (words.next(), words.next(), words.next()) {
                        (Some("default"), None, _) => Some("default".to_owned()),
                        (Some("profile"), Some(name), None) => Some(name.to_owned()),
                        _ => None,
                    }
                }
            };
            if let Some(name) = &name {
                profiles.entry(name.clone()).or_default();
            }
            section = Some(name);
            last_key = None;
            continue;
        }
        let Some(section) = &section else {
            return Err(err("setting before the first [section]"));
        };
        let split = trimmed
            .find(['=', ':'])
            .ok_or_else(|| err("expected 'key = value'"))?;
        let key = trimmed[..split].trim().to_ascii_lowercase();
        if key.is_empty() {
            return Err(err("empty key"));
        }
        let value = trimmed[split + 1..].trim().to_owned();
        if let Some(name) = section {
            profiles
                .get_mut(name)
                .expect("section was registered")
                .insert(key.clone(), value);
        }
        last_key = Some(key);
    }
    Ok(profiles)
}

/// Reads a profile file; a missing file is an empty one.
fn read_profile_file(
    path: &Path,
    kind: ProfileFileKind,
) -> Result<Option<Profiles>, CredentialsError> {
    let io_err = |e: io::Error| CredentialsError::Io {
        path: path.to_owned(),
        kind: e.kind(),
        message: e.to_string(),
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    if meta.len() > MAX_PROFILE_FILE_BYTES {
        return Err(CredentialsError::Invalid {
            source: path.display().to_string(),
            reason: format!("file is larger than {MAX_PROFILE_FILE_BYTES} bytes"),
        });
    }
    let text = std::fs::read_to_string(path).map_err(io_err)?;
    parse_profile_file(&text, kind, path).map(Some)
}

fn expand_home(path: &str, env: &Env) -> Option<PathBuf> {
    if let Some(rest) = path.strip_prefix("~/") {
        return env.get("HOME").map(|home| Path::new(home).join(rest));
    }
    if path == "~" {
        return env.get("HOME").map(PathBuf::from);
    }
    Some(PathBuf::from(path))
}

/// Paths of the credentials and config files for `env` (`None` when neither
/// the variable nor `HOME` is set).
pub fn profile_file_paths(env: &Env) -> (Option<PathBuf>, Option<PathBuf>) {
    let pick = |var: &str, default: &str| match env.get(var) {
        Some(p) => expand_home(p, env),
        None => expand_home(default, env),
    };
    (
        pick("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        pick("AWS_CONFIG_FILE", "~/.aws/config"),
    )
}

/// The profile name the chain uses, and whether it was named explicitly.
pub fn selected_profile(env: &Env) -> (String, bool) {
    match env
        .get("AWS_PROFILE")
        .or_else(|| env.get("AWS_DEFAULT_PROFILE"))
    {
        Some(name) => (name.to_owned(), true),
        None => ("default".to_owned(), false),
    }
}

/// A credential source that needs HTTP. The part of the chain that reads no
/// network stops here; a [`HttpCredentialFetcher`] turns it into credentials.
#[derive(Clone, PartialEq, Eq)]
pub enum HttpCredentialSource {
    /// STS AssumeRoleWithWebIdentity with a token read from a file.
    WebIdentity {
        /// Role to assume.
        role_arn: String,
        /// File holding the OIDC token (re-read on every refresh).
        token_file: PathBuf,
        /// Session name, if configured (else the fetcher makes one up).
        session_name: Option<String>,
        /// STS endpoint URL the request goes to.
        endpoint: String,
    },
    /// The ECS / EKS container credentials endpoint.
    Container {
        /// Full URL to GET.
        uri: String,
        /// `Authorization` value, if given inline.
        auth_token: Option<String>,
        /// File holding the `Authorization` value.
        auth_token_file: Option<PathBuf>,
    },
    /// EC2 instance metadata, IMDSv2 (token PUT, then role and credentials
    /// GETs).
    Imds {
        /// Base URL, e.g. `http://169.254.169.254`.
        endpoint: String,
    },
}

impl HttpCredentialSource {
    /// A short name for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            HttpCredentialSource::WebIdentity { .. } => "web identity (STS)",
            HttpCredentialSource::Container { .. } => "container credentials endpoint",
            HttpCredentialSource::Imds { .. } => "IMDSv2",
        }
    }
}

impl fmt::Debug for HttpCredentialSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpCredentialSource::WebIdentity {
                role_arn,
                token_file,
                session_name,
                endpoint,
            } => f
                .debug_struct("WebIdentity")
                .field("role_arn", role_arn)
                .field("token_file", token_file)
                .field("session_name", session_name)
                .field("endpoint", endpoint)
                .finish(),
            HttpCredentialSource::Container {
                uri,
                auth_token,
                auth_token_file,
            } => f
                .debug_struct("Container")
                .field("uri", uri)
                .field("auth_token", &auth_token.as_ref().map(|_| "<redacted>"))
                .field("auth_token_file", auth_token_file)
                .finish(),
            HttpCredentialSource::Imds { endpoint } => {
                f.debug_struct("Imds").field("endpoint", endpoint).finish()
            }
        }
    }
}

/// Fetches credentials over HTTP for a [`HttpCredentialSource`]
/// ([`crate::credential_http::HttpFetcher`] in the client). The future runs
/// on the calling glommio executor and must not block it.
pub trait HttpCredentialFetcher {
    /// Produces credentials (with expiry) or says why not.
    fn fetch(
        &self,
        source: &HttpCredentialSource,
    ) -> impl Future<Output = Result<Credentials, CredentialsError>>;
}

/// What the chain found without network access.
#[derive(Debug, Clone)]
pub enum CredentialPlan {
    /// Credentials are ready.
    Ready(Credentials),
    /// The first configured source needs HTTP.
    Http(HttpCredentialSource),
}

/// Profile settings from both files for one profile, with the file each
/// setting came from (for error messages).
struct ProfileView {
    name: String,
    credentials_file: Option<(PathBuf, BTreeMap<String, String>)>,
    config_file: Option<(PathBuf, BTreeMap<String, String>)>,
}

impl ProfileView {
    /// A setting, credentials file first.
    fn get(&self, key: &str) -> Option<(&str, &Path)> {
        [&self.credentials_file, &self.config_file]
            .into_iter()
            .flatten()
            .find_map(|(path, props)| {
                props
                    .get(key)
                    .filter(|v| !v.is_empty())
                    .map(|v| (v.as_str(), path.as_path()))
            })
    }

    fn label(&self, path: &Path) -> String {
        format!("profile {:?} in {}", self.name, path.display())
    }
}

/// Static keys from one file's profile section.
fn static_from_section(
    props: &BTreeMap<String, String>,
    label: String,
    source: CredentialSource,
) -> Result<Option<Credentials>, CredentialsError> {
    let get = |k: &str| props.get(k).map(String::as_str).filter(|v| !v.is_empty());
    let (ak, sk) = match (get("aws_access_key_id"), get("aws_secret_access_key")) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(CredentialsError::Partial {
                source: label,
                missing: "aws_secret_access_key".to_owned(),
            })
        }
        (None, Some(_)) => {
            return Err(CredentialsError::Partial {
                source: label,
                missing: "aws_access_key_id".to_owned(),
            })
        }
        (Some(ak), Some(sk)) => (ak, sk),
    };
    let token = get("aws_session_token")
        .or_else(|| get("aws_security_token"))
        .map(str::to_owned);
    Credentials::new(ak, sk, token, None)
        .map(|c| Some(c.with_source(source)))
        .map_err(|e| relabel(e, &label))
}

/// The STS endpoint for web identity (see the module documentation).
fn sts_endpoint(env: &Env, view: &ProfileView) -> Result<String, CredentialsError> {
    let ignore_configured = env
        .get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if !ignore_configured {
        if let Some(url) = env
            .get("AWS_ENDPOINT_URL_STS")
            .or_else(|| env.get("AWS_ENDPOINT_URL"))
        {
            return Ok(url.to_owned());
        }
    }
    let (region, source) = match (env.get("AWS_REGION"), env.get("AWS_DEFAULT_REGION")) {
        (Some(r), _) => (r, "AWS_REGION".to_owned()),
        (None, Some(r)) => (r, "AWS_DEFAULT_REGION".to_owned()),
        (None, None) => match view.get("region") {
            Some((r, path)) => (r, view.label(path)),
            None => return Ok(STS_GLOBAL_ENDPOINT.to_owned()),
        },
    };
    let valid = region
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid {
        return Err(CredentialsError::Invalid {
            source,
            reason: format!("region {region:?} is not a region name"),
        });
    }
    let suffix = if region.starts_with("cn-") {
        "amazonaws.com.cn"
    } else {
        "amazonaws.com"
    };
    Ok(format!("https://sts.{region}.{suffix}/"))
}

/// Runs the chain up to the first source that needs HTTP. Reads only the
/// profile files.
pub fn plan_credentials(env: &Env) -> Result<CredentialPlan, CredentialsError> {
    // 1. Environment.
    if let Some(creds) = from_env(env)? {
        return Ok(CredentialPlan::Ready(creds));
    }

    // Load the selected profile from both files.
    let (profile, explicit) = selected_profile(env);
    let (credentials_path, config_path) = profile_file_paths(env);
    let mut searched = Vec::new();
    let mut load = |path: Option<PathBuf>, kind| -> Result<_, CredentialsError> {
        let Some(path) = path else { return Ok(None) };
        searched.push(path.clone());
        Ok(read_profile_file(&path, kind)?
            .and_then(|mut profiles| profiles.remove(&profile))
            .map(|props| (path, props)))
    };
    let view = ProfileView {
        name: profile.clone(),
        credentials_file: load(credentials_path, ProfileFileKind::Credentials)?,
        config_file: load(config_path, ProfileFileKind::Config)?,
    };
    let found = view.credentials_file.is_some() || view.config_file.is_some();
    if explicit && !found {
        return Err(CredentialsError::ProfileNotFound { profile, searched });
    }

    // 2. Role assumption configured in the profile.
    if let Some((_, path)) = view.get("role_arn") {
        if view.get("web_identity_token_file").is_none() {
            let what = if view.get("source_profile").is_some()
                || view.get("credential_source").is_some()
            {
                "role assumption (role_arn with source_profile/credential_source)"
            } else {
                "role_arn without source_profile, credential_source or web_identity_token_file"
            };
            return Err(CredentialsError::Unsupported {
                source: view.label(path),
                what,
            });
        }
    }

    // 3. Web identity: profile first, then environment.
    let web_identity = match view.get("web_identity_token_file") {
        Some((token_file, path)) => Some((
            token_file.to_owned(),
            view.get("role_arn").map(|(v, _)| v.to_owned()),
            view.get("role_session_name").map(|(v, _)| v.to_owned()),
            view.label(path),
            "role_arn",
        )),
        None => env.get("AWS_WEB_IDENTITY_TOKEN_FILE").map(|token_file| {
            (
                token_file.to_owned(),
                env.get("AWS_ROLE_ARN").map(str::to_owned),
                env.get("AWS_ROLE_SESSION_NAME").map(str::to_owned),
                "environment".to_owned(),
                "AWS_ROLE_ARN",
            )
        }),
    };
    if let Some((token_file, role_arn, session_name, source, role_key)) = web_identity {
        let role_arn = role_arn.ok_or_else(|| CredentialsError::Partial {
            source,
            missing: role_key.to_owned(),
        })?;
        return Ok(CredentialPlan::Http(HttpCredentialSource::WebIdentity {
            role_arn,
            token_file: PathBuf::from(token_file),
            session_name,
            endpoint: sts_endpoint(env, &view)?,
        }));
    }

    // 4. SSO.
    if let Some((_, path)) = view
        .get("sso_start_url")
        .or_else(|| view.get("sso_session"))
    {
        return Err(CredentialsError::Unsupported {
            source: view.label(path),
            what: "AWS IAM Identity Center (SSO)",
        });
    }

    // 5. Shared credentials file.
    if let Some((path, props)) = &view.credentials_file {
        let source = CredentialSource::SharedCredentialsFile {
            profile: profile.clone(),
        };
        if let Some(creds) = static_from_section(props, view.label(path), source)? {
            return Ok(CredentialPlan::Ready(creds));
        }
    }

    // 6. credential_process.
    if let Some((_, path)) = view.get("credential_process") {
        return Err(CredentialsError::Unsupported {
            source: view.label(path),
            what: "credential_process",
        });
    }

    // 7. Config file.
    if let Some((path, props)) = &view.config_file {
        let source = CredentialSource::ConfigFile {
            profile: profile.clone(),
        };
        if let Some(creds) = static_from_section(props, view.label(path), source)? {
            return Ok(CredentialPlan::Ready(creds));
        }
    }
    // 8. Container.
    let container_uri = match (
        env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"),
        env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"),
    ) {
        (Some(relative), _) => Some(format!("{ECS_CONTAINER_HOST}{relative}")),
        (None, Some(full)) => Some(full.to_owned()),
        (None, None) => None,
    };
    if let Some(uri) = container_uri {
        return Ok(CredentialPlan::Http(HttpCredentialSource::Container {
            uri,
            auth_token: env
                .get("AWS_CONTAINER_AUTHORIZATION_TOKEN")
                .map(str::to_owned),
            auth_token_file: env
                .get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
                .map(PathBuf::from),
        }));
    }

    // 9. Instance metadata.
    let disabled = env
        .get("AWS_EC2_METADATA_DISABLED")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if disabled {
        return Err(CredentialsError::NoCredentials);
    }
    let endpoint = match env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") {
        Some(endpoint) => endpoint.trim_end_matches('/').to_owned(),
        None => match env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE") {
            Some(mode) if mode.eq_ignore_ascii_case("ipv6") => IMDS_ENDPOINT_IPV6.to_owned(),
            Some(mode) if mode.eq_ignore_ascii_case("ipv4") => IMDS_ENDPOINT_IPV4.to_owned(),
            Some(mode) => {
                return Err(CredentialsError::Invalid {
                    source: "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE".to_owned(),
                    reason: format!("{mode:?} is neither IPv4 nor IPv6"),
                })
            }
            None => IMDS_ENDPOINT_IPV4.to_owned(),
        },
    };
    Ok(CredentialPlan::Http(HttpCredentialSource::Imds {
        endpoint,
    }))
}

/// Runs the whole chain on the calling glommio executor:
/// [`plan_credentials`] (the profile files) on the executor's blocking
/// pool, then `http` for an HTTP source.
pub async fn resolve_credentials(
    env: &Env,
    http: &impl HttpCredentialFetcher,
) -> Result<Credentials, CredentialsError> {
    let planned = env.clone();
    let plan = glommio::executor()
        .spawn_blocking(move || plan_credentials(&planned))
        .await?;
    match plan {
        CredentialPlan::Ready(creds) => Ok(creds),
        CredentialPlan::Http(source) => http.fetch(&source).await,
    }
}
