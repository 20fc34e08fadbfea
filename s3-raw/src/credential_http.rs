//! The credential sources that need HTTP: EC2 instance metadata (IMDSv2),
//! the ECS/EKS container credentials endpoint, and STS
//! AssumeRoleWithWebIdentity.
//!
//! [`HttpFetcher`] runs on the calling glommio executor (the shard's) and
//! never blocks it: every exchange is one request on a fresh HTTP/1.1
//! connection of the S3 data path's own kind ([`crate::h1::H1Conn`] over
//! [`crate::net::connect_addrs`], and [`crate::net::connect_tls`] for
//! `https`, offering only `http/1.1` and always verifying the server's
//! certificate against the same [`TlsTrust`] as S3). Name lookups and the
//! token files are read on glommio's blocking pool.
//!
//! - IMDSv2: `PUT /latest/api/token` (a 6 h token), then
//!   `GET /latest/meta-data/iam/security-credentials/` for the role name and
//!   `GET .../security-credentials/<role>` for the credentials, both with the
//!   token header. IMDSv1 is never used.
//! - Container: `GET` of the URI with `Authorization` from
//!   `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE` (read again on every fetch) or
//!   `AWS_CONTAINER_AUTHORIZATION_TOKEN`. Over plain `http` the host must be a
//!   loopback address (a name counts only when every address it resolves to
//!   is loopback, and then exactly those addresses are dialled) or one of the
//!   ECS/EKS link-local addresses, as the AWS SDKs require; `https` may go to
//!   any host.
//! - Web identity: an unsigned `POST` of the query-protocol form
//!   (`Action=AssumeRoleWithWebIdentity`, `Version=2011-06-15`, `RoleArn`,
//!   `RoleSessionName`, `WebIdentityToken` read from the token file on every
//!   fetch) to the STS endpoint the plan chose.
//!
//! Limits of every exchange: [`FetchConfig::connect_timeout`] for the name
//! lookup and for each TCP connect attempt, then one
//! [`FetchConfig::read_timeout`] for the rest (TLS handshake, request, whole
//! response); the body is read up to [`MAX_CREDENTIALS_BODY_BYTES`]. The
//! JSON answers are parsed with `serde_json`, the STS XML with
//! [`crate::xml`]. Errors name the source and the URL, never a token or a
//! secret.

use std::cell::RefCell;
use std::fmt;
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_rustls::TlsConnector;
use hyper::header::{HeaderName, HeaderValue};
use serde_json::{Map, Value};

use crate::credentials::{
    CredentialSource, Credentials, CredentialsError, HttpCredentialFetcher, HttpCredentialSource,
};
use crate::h1::{self, H1Conn, HttpError};
use crate::net::{self, Stream, TlsTrust};
use crate::sigv4::encode_query;
use crate::time::parse_rfc3339;
use crate::xml;
use kvshard_io::timeout::with_timeout;

/// Lifetime asked for an IMDSv2 session token, seconds (the SDKs' 6 h).
pub const IMDS_TOKEN_TTL_SECS: u32 = 21_600;
/// Largest response body accepted from a credentials endpoint.
pub const MAX_CREDENTIALS_BODY_BYTES: usize = 64 << 10;
/// Largest token file read (web identity or container authorization).
pub const MAX_TOKEN_FILE_BYTES: u64 = 64 << 10;
/// The hosts a plain-`http` container credentials URI may name besides
/// loopback: the ECS endpoint and the EKS Pod Identity endpoints.
pub const CONTAINER_LINK_LOCAL_HOSTS: [IpAddr; 3] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 2)),
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 23)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23)),
];

const IMDS: &str = "IMDSv2";
const CONTAINER: &str = "container credentials endpoint";
const WEB_IDENTITY: &str = "web identity (STS)";

/// Timeouts and TLS trust of the credential fetches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchConfig {
    /// Limit of the name lookup and of each TCP connect attempt (per address
    /// tried). Default 2 s.
    pub connect_timeout: Duration,
    /// Limit of the rest of one exchange: TLS handshake, request, whole
    /// response. Default 5 s.
    pub read_timeout: Duration,
    /// Roots trusted for `https` endpoints (STS, an https container URI).
    /// Default: the system roots.
    pub trust: TlsTrust,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            connect_timeout: Duration::from_secs(2),
            read_timeout: Duration::from_secs(5),
            trust: TlsTrust {
                system_roots: true,
                ca_bundle: None,
            },
        }
    }
}

/// Fetches credentials from the HTTP sources, on the calling glommio
/// executor.
pub struct HttpFetcher {
    cfg: FetchConfig,
    /// Built on the first `https` fetch, on the blocking pool (loading the
    /// system roots reads files); a failure is kept too.
    tls: RefCell<Option<Result<TlsConnector, String>>>,
}

impl fmt::Debug for HttpFetcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpFetcher")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Default for HttpFetcher {
    fn default() -> Self {
        HttpFetcher::new(FetchConfig::default())
    }
}

impl HttpCredentialFetcher for HttpFetcher {
    async fn fetch(&self, source: &HttpCredentialSource) -> Result<Credentials, CredentialsError> {
        match source {
            HttpCredentialSource::Imds { endpoint } => self.imds(endpoint).await,
            HttpCredentialSource::Container {
                uri,
                auth_token,
                auth_token_file,
            } => {
                self.container(uri, auth_token.as_deref(), auth_token_file.as_deref())
                    .await
            }
            HttpCredentialSource::WebIdentity {
                role_arn,
                token_file,
                session_name,
                endpoint,
            } => {
                self.web_identity(role_arn, token_file, session_name.as_deref(), endpoint)
                    .await
            }
        }
    }
}

/// An error of one exchange, labelled with the source and the request.
fn http_error(
    source: &'static str,
    method: &str,
    url: &str,
    what: impl fmt::Display,
) -> CredentialsError {
    CredentialsError::Http {
        source,
        message: format!("{method} {url}: {what}"),
    }
}

/// A response: status and body.
#[derive(Debug)]
struct Response {
    status: u16,
    body: Vec<u8>,
}

/// A header of a request.
fn header(name: &'static str, value: &str) -> Result<(HeaderName, HeaderValue), String> {
    let value = HeaderValue::from_bytes(value.as_bytes())
        .map_err(|_| format!("the {name} header value has characters HTTP does not allow"))?;
    Ok((HeaderName::from_static(name), value))
}

/// An [`HttpError`] in words.
fn describe(e: HttpError) -> String {
    match e {
        HttpError::ClosedBeforeResponse => "connection closed without an answer".to_owned(),
        e => e.to_string(),
    }
}

impl HttpFetcher {
    /// A fetcher with these settings.
    pub fn new(cfg: FetchConfig) -> HttpFetcher {
        HttpFetcher {
            cfg,
            tls: RefCell::new(None),
        }
    }

    /// The settings.
    pub fn config(&self) -> &FetchConfig {
        &self.cfg
    }

    /// The TLS connector: HTTP/1.1 only, certificates verified.
    async fn tls_connector(&self) -> Result<TlsConnector, String> {
        if let Some(built) = &*self.tls.borrow() {
            return built.clone();
        }
        let trust = self.cfg.trust.clone();
        let built = glommio::executor()
            .spawn_blocking(move || net::tls_client_config(&trust, false))
            .await
            .map(TlsConnector::from)
            .map_err(|e| format!("TLS configuration: {e}"));
        *self.tls.borrow_mut() = Some(built.clone());
        built
    }

    /// One exchange; `source` and `url_text` label errors. `addrs`, when
    /// given, are dialled instead of resolving the URL's host.
    async fn call(
        &self,
        source: &'static str,
        method: &str,
        url_text: &str,
        addrs: Option<Vec<SocketAddr>>,
        headers: &[(&'static str, &str)],
        body: Bytes,
    ) -> Result<Response, CredentialsError> {
        let url = Url::parse(url_text).map_err(|e| CredentialsError::Invalid {
            source: source.to_owned(),
            reason: format!("URL {url_text:?}: {e}"),
        })?;
        self.exchange(&url, addrs, method, headers, body)
            .await
            .map_err(|e| http_error(source, method, url_text, e))
    }

    async fn exchange(
        &self,
        url: &Url,
        addrs: Option<Vec<SocketAddr>>,
        method: &str,
        headers: &[(&'static str, &str)],
        body: Bytes,
    ) -> Result<Response, String> {
        let mut all = vec![
            header("user-agent", "kvshard-s3-raw")?,
            header("accept", "*/*")?,
            header("connection", "close")?,
        ];
        for (name, value) in headers {
            all.push(header(name, value)?);
        }
        let mut head = Vec::new();
        h1::write_head(
            &mut head,
            method,
            &url.target,
            &url.host_header(),
            &all,
            body.len(),
        );
        let addrs = match addrs {
            Some(addrs) => addrs,
            None => self.resolve(&url.host, url.port).await?,
        };
        let tcp = net::connect_addrs(&addrs, Some(self.cfg.connect_timeout))
            .await
            .map_err(|e| e.to_string())?;
        let tls = if url.https {
            let connector = self.tls_connector().await?;
            Some((connector, net::server_name(&url.host)?))
        } else {
            None
        };
        let limit = self.cfg.read_timeout;
        let exchange = async move {
            let stream = match tls {
                Some((connector, name)) => Stream::Tls(Box::new(
                    net::connect_tls(&connector, name, tcp)
                        .await
                        .map_err(|e| e.to_string())?,
                )),
                None => Stream::Tcp(tcp),
            };
            let mut conn = H1Conn::new(stream);
            let response = conn.exchange(&head, &body, true).await.map_err(describe)?;
            let mut out = Vec::new();
            let (_, complete) = conn
                .read_body_limited(&mut out, MAX_CREDENTIALS_BODY_BYTES)
                .await
                .map_err(describe)?;
            if !complete {
                return Err(format!(
                    "response body larger than {MAX_CREDENTIALS_BODY_BYTES} bytes"
                ));
            }
            Ok(Response {
                status: response.status,
                body: out,
            })
        };
        with_timeout(limit, exchange)
            .await
            .unwrap_or_else(|| Err(format!("no complete answer within {limit:?}")))
    }

    /// The addresses of `host`, looked up under the connect timeout.
    async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
        let limit = self.cfg.connect_timeout;
        match with_timeout(limit, net::resolve(host, port)).await {
            Some(Ok(addrs)) => Ok(addrs),
            Some(Err(e)) => Err(e.to_string()),
            None => Err(format!(
                "cannot resolve {host:?}: no answer within {limit:?}"
            )),
        }
    }

    async fn imds(&self, endpoint: &str) -> Result<Credentials, CredentialsError> {
        let base = endpoint.trim_end_matches('/');
        let token_url = format!("{base}/latest/api/token");
        let ttl = IMDS_TOKEN_TTL_SECS.to_string();
        let resp = self
            .call(
                IMDS,
                "PUT",
                &token_url,
                None,
                &[("x-aws-ec2-metadata-token-ttl-seconds", &ttl)],
                Bytes::new(),
            )
            .await?;
        let fail = |method: &str, url: &str, what: String| http_error(IMDS, method, url, what);
        match resp.status {
            200 => {}
            403 => {
                return Err(fail(
                    "PUT",
                    &token_url,
                    "HTTP 403: the instance refuses IMDSv2 tokens (metadata disabled, or the request came through too many hops)".to_owned(),
                ))
            }
            s => return Err(fail("PUT", &token_url, format!("HTTP {s}"))),
        }
        let token = String::from_utf8(resp.body)
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| {
                fail(
                    "PUT",
                    &token_url,
                    "the token is empty or not printable ASCII".to_owned(),
                )
            })?;
        let token_header = [("x-aws-ec2-metadata-token", token.as_str())];

        let roles_url = format!("{base}/latest/meta-data/iam/security-credentials/");
        let resp = self
            .call(IMDS, "GET", &roles_url, None, &token_header, Bytes::new())
            .await?;
        match resp.status {
            200 => {}
            404 => {
                return Err(fail(
                    "GET",
                    &roles_url,
                    "HTTP 404: no IAM role is attached to this instance".to_owned(),
                ))
            }
            s => return Err(fail("GET", &roles_url, format!("HTTP {s}"))),
        }
        let text = String::from_utf8(resp.body)
            .map_err(|_| fail("GET", &roles_url, "the role list is not UTF-8".to_owned()))?;
        let role = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .ok_or_else(|| {
                fail(
                    "GET",
                    &roles_url,
                    "no IAM role is attached to this instance".to_owned(),
                )
            })?;
        let valid_role = role
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+=,.@_-".contains(&b));
        if !valid_role {
            return Err(fail(
                "GET",
                &roles_url,
                format!("{role:?} is not an IAM role name"),
            ));
        }

        let creds_url = format!("{roles_url}{role}");
        let resp = self
            .call(IMDS, "GET", &creds_url, None, &token_header, Bytes::new())
            .await?;
        if resp.status != 200 {
            return Err(fail("GET", &creds_url, format!("HTTP {}", resp.status)));
        }
        credentials_from_json(&resp.body, CredentialSource::Imds)
            .map_err(|e| fail("GET", &creds_url, e))
    }

    async fn container(
        &self,
        uri: &str,
        auth_token: Option<&str>,
        auth_token_file: Option<&Path>,
    ) -> Result<Credentials, CredentialsError> {
        let url = Url::parse(uri).map_err(|e| CredentialsError::Invalid {
            source: "container credentials URI".to_owned(),
            reason: format!("{uri:?}: {e}"),
        })?;
        let addrs = if url.https {
            None
        } else {
            Some(self.container_http_addrs(&url).await?)
        };
        let auth = match (auth_token_file, auth_token) {
            (Some(path), _) => Some(
                read_token_file(path.to_owned(), "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE").await?,
            ),
            (None, Some(token)) => Some(token.trim().to_owned()),
            (None, None) => None,
        };
        if let Some(value) = &auth {
            let header_safe = value
                .bytes()
                .all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f));
            if value.is_empty() || !header_safe {
                return Err(CredentialsError::Invalid {
                    source: if auth_token_file.is_some() {
                        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE".to_owned()
                    } else {
                        "AWS_CONTAINER_AUTHORIZATION_TOKEN".to_owned()
                    },
                    reason: "the authorization token is empty or has control characters".to_owned(),
                });
            }
        }
        let headers: Vec<(&'static str, &str)> = match &auth {
            Some(value) => vec![("authorization", value.as_str())],
            None => Vec::new(),
        };
        let resp = self
            .call(CONTAINER, "GET", uri, addrs, &headers, Bytes::new())
            .await?;
        if resp.status != 200 {
            let mut what = format!("HTTP {}", resp.status);
            if let Ok(fields) = json_object(&resp.body) {
                let get = |k: &str| {
                    string_field(&fields, k)
                        .or_else(|| string_field(&fields, &k.to_ascii_lowercase()))
                };
                if let Some(code) = get("Code") {
                    what.push_str(&format!(" {}", truncate(code, 100)));
                }
                if let Some(message) = get("Message") {
                    what.push_str(&format!(": {}", truncate(message, 300)));
                }
            }
            return Err(http_error(CONTAINER, "GET", uri, what));
        }
        credentials_from_json(&resp.body, CredentialSource::Container)
            .map_err(|e| http_error(CONTAINER, "GET", uri, e))
    }

    /// The addresses a plain-`http` container URI may be dialled at, or why
    /// not.
    async fn container_http_addrs(&self, url: &Url) -> Result<Vec<SocketAddr>, CredentialsError> {
        let refuse = |detail: String| CredentialsError::Invalid {
            source: "AWS_CONTAINER_CREDENTIALS_FULL_URI".to_owned(),
            reason: format!(
                "plain http is only allowed to loopback or to the ECS/EKS container endpoints \
                 (169.254.170.2, 169.254.170.23, fd00:ec2::23); {detail}; use https for other hosts"
            ),
        };
        if let Ok(ip) = url.host.parse::<IpAddr>() {
            if plain_http_allowed(ip) {
                return Ok(vec![SocketAddr::new(ip, url.port)]);
            }
            return Err(refuse(format!("{ip} is neither")));
        }
        let addrs =
            self.resolve(&url.host, url.port)
                .await
                .map_err(|e| CredentialsError::Http {
                    source: CONTAINER,
                    message: e,
                })?;
        if addrs.iter().all(|a| is_loopback(a.ip())) {
            Ok(addrs)
        } else {
            Err(refuse(format!(
                "{:?} resolves to an address that is not loopback",
                url.host
            )))
        }
    }

    async fn web_identity(
        &self,
        role_arn: &str,
        token_file: &Path,
        session_name: Option<&str>,
        endpoint: &str,
    ) -> Result<Credentials, CredentialsError> {
        let token = read_token_file(token_file.to_owned(), "web identity token file").await?;
        let generated;
        let session_name = match session_name {
            Some(name) => name,
            None => {
                generated = default_session_name();
                &generated
            }
        };
        let mut form = String::new();
        encode_query(
            &[
                ("Action", "AssumeRoleWithWebIdentity"),
                ("Version", "2011-06-15"),
                ("RoleArn", role_arn),
                ("RoleSessionName", session_name),
                ("WebIdentityToken", &token),
            ],
            &mut form,
        );
        let resp = self
            .call(
                WEB_IDENTITY,
                "POST",
                endpoint,
                None,
                &[(
                    "content-type",
                    "application/x-www-form-urlencoded; charset=utf-8",
                )],
                Bytes::from(form),
            )
            .await?;
        let text = std::str::from_utf8(&resp.body).ok();
        if resp.status != 200 {
            let mut what = format!("HTTP {}", resp.status);
            if let Some(e) = text.and_then(|t| xml::parse_sts_error(t).ok()) {
                what.push_str(&format!(" {}", truncate(&e.code, 100)));
                if let Some(m) = &e.message {
                    what.push_str(&format!(": {}", truncate(m, 300)));
                }
                if let Some(id) = &e.request_id {
                    what.push_str(&format!(" (request id {})", truncate(id, 100)));
                }
            }
            return Err(http_error(WEB_IDENTITY, "POST", endpoint, what));
        }
        let text = text
            .ok_or_else(|| http_error(WEB_IDENTITY, "POST", endpoint, "the answer is not UTF-8"))?;
        xml::parse_assume_role_with_web_identity(text).map_err(|e| {
            http_error(
                WEB_IDENTITY,
                "POST",
                endpoint,
                format!("AssumeRoleWithWebIdentity answer: {e}"),
            )
        })
    }
}

/// `kvshard-<unix milliseconds>`: a valid RoleSessionName (2 to 64 of
/// `[\w+=,.@-]`).
fn default_session_name() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    format!("kvshard-{millis}")
}

fn truncate(text: &str, max_chars: usize) -> String {
    let mut out: String = text.chars().take(max_chars).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}

/// Reads a token file (again on every fetch: they are rotated), trimmed, on
/// the blocking pool.
async fn read_token_file(path: PathBuf, what: &'static str) -> Result<String, CredentialsError> {
    glommio::executor()
        .spawn_blocking(move || read_token_file_now(&path, what))
        .await
}

fn read_token_file_now(path: &Path, what: &str) -> Result<String, CredentialsError> {
    let io_err = |e: io::Error| CredentialsError::Io {
        path: path.to_owned(),
        kind: e.kind(),
        message: format!("{what}: {e}"),
    };
    let file = std::fs::File::open(path).map_err(io_err)?;
    let mut bytes = Vec::new();
    file.take(MAX_TOKEN_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err)?;
    let invalid = |reason: String| CredentialsError::Invalid {
        source: format!("{what} {}", path.display()),
        reason,
    };
    if bytes.len() as u64 > MAX_TOKEN_FILE_BYTES {
        return Err(invalid(format!("larger than {MAX_TOKEN_FILE_BYTES} bytes")));
    }
    let text = String::from_utf8(bytes).map_err(|_| invalid("not UTF-8".to_owned()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(invalid("the file is empty".to_owned()));
    }
    Ok(token.to_owned())
}

/// True when plain `http` may go to `ip`: loopback or an ECS/EKS container
/// endpoint.
fn plain_http_allowed(ip: IpAddr) -> bool {
    is_loopback(ip) || CONTAINER_LINK_LOCAL_HOSTS.contains(&ip)
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// The JSON object an endpoint answered.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(fields)) => Ok(fields),
        Ok(_) => Err("the answer is not a JSON object".to_owned()),
        Err(e) => Err(format!("the answer is not a JSON object ({e})")),
    }
}

/// A string member of a JSON object (members of other types count as
/// absent).
fn string_field<'a>(fields: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    fields.get(key).and_then(Value::as_str)
}

/// Credentials from the JSON the IMDS and container endpoints answer:
/// `AccessKeyId`, `SecretAccessKey`, `Token`, `Expiration` (ISO 8601), and
/// from IMDS `Code` (must be `Success`).
fn credentials_from_json(body: &[u8], source: CredentialSource) -> Result<Credentials, String> {
    let fields = json_object(body)?;
    if let Some(code) = string_field(&fields, "Code") {
        if code != "Success" {
            let mut what = format!("the answer says Code {:?}", truncate(code, 100));
            if let Some(m) = string_field(&fields, "Message") {
                what.push_str(&format!(": {}", truncate(m, 300)));
            }
            return Err(what);
        }
    }
    let get = |k: &'static str| {
        string_field(&fields, k)
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("the answer has no {k}"))
    };
    let access_key = get("AccessKeyId")?;
    let secret = get("SecretAccessKey")?;
    let token = string_field(&fields, "Token")
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    let expiration = get("Expiration")?;
    let expiry = parse_rfc3339(expiration).map_err(|e| format!("Expiration: {e}"))?;
    Credentials::new(access_key, secret, token, Some(expiry))
        .map(|c| c.with_source(source))
        .map_err(|e| match e {
            CredentialsError::Invalid { reason, .. } => reason,
            other => other.to_string(),
        })
}

/// An `http` or `https` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Url {
    https: bool,
    /// Host without brackets.
    host: String,
    port: u16,
    /// Path and query, at least `/`.
    target: String,
}

impl Url {
    fn parse(text: &str) -> Result<Url, String> {
        let (https, rest) = if let Some(rest) = strip_prefix_ignore_case(text, "https://") {
            (true, rest)
        } else if let Some(rest) = strip_prefix_ignore_case(text, "http://") {
            (false, rest)
        } else {
            return Err("not an http:// or https:// URL".to_owned());
        };
        let split = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(split);
        let tail = tail.split('#').next().unwrap_or("");
        if authority.contains('@') {
            return Err("user information in a URL is not supported".to_owned());
        }
        let (host, port_text) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| "unclosed '[' in the host".to_owned())?;
            if host.parse::<Ipv6Addr>().is_err() {
                return Err(format!("{host:?} is not an IPv6 address"));
            }
            match after {
                "" => (host, None),
                p => (
                    host,
                    Some(
                        p.strip_prefix(':')
                            .ok_or_else(|| "text after ']' in the host".to_owned())?,
                    ),
                ),
            }
        } else {
            match authority.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err("no host".to_owned());
        }
        if !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(&b))
        {
            return Err(format!("{host:?} is not a host name"));
        }
        let port = match port_text {
            None | Some("") => {
                if https {
                    443
                } else {
                    80
                }
            }
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("{p:?} is not a port"))?,
        };
        let target = if tail.is_empty() {
            "/".to_owned()
        } else if tail.starts_with('?') {
            format!("/{tail}")
        } else {
            tail.to_owned()
        };
        if !target.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the path has spaces, control or non-ASCII characters".to_owned());
        }
        Ok(Url {
            https,
            host: host.to_ascii_lowercase(),
            port,
            target,
        })
    }

    fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let default_port = if self.https { 443 } else { 80 };
        if self.port == default_port {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }
}

fn strip_prefix_ignore_case<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let head = text.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &text[prefix.len()..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        let u = Url::parse("http://169.254.170.2/v2/credentials/x?a=b").unwrap();
        assert_eq!(
            (u.https, u.host.as_str(), u.port, u.target.as_str()),
            (false, "169.254.170.2", 80, "/v2/credentials/x?a=b")
        );
        assert_eq!(u.host_header(), "169.254.170.2");
        let u = Url::parse("HTTPS://STS.us-east-1.amazonaws.com").unwrap();
        assert_eq!(
            (u.https, u.host.as_str(), u.port, u.target.as_str()),
            (true, "sts.us-east-1.amazonaws.com", 443, "/")
        );
        let u = Url::parse("http://[fd00:ec2::23]:8080/get").unwrap();
        assert_eq!(u.host, "fd00:ec2::23");
        assert_eq!(u.host_header(), "[fd00:ec2::23]:8080");
        assert_eq!(Url::parse("http://127.0.0.1:9/").unwrap().port, 9);
        for bad in [
            "ftp://x/",
            "http://",
            "http://user:pw@host/",
            "http://host:0/",
            "http://host:99999/",
            "http://[::1/",
            "http://ho st/",
            "http://host/a b",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn json_answers_parse_with_serde_json() {
        let body = br#" {"Code":"Success","LastUpdated":"2024-01-01T00:00:00Z","Type":"AWS-HMAC",
            "AccessKeyId":"ASIA\u0041","SecretAccessKey":"s\/e\"c","Token":"t\ud83d\ude00",
            "Expiration":"2030-01-01T00:00:00Z","n":-1.5e3,"o":{"a":[1,true,null,{}]},"e":[]} "#;
        let c = credentials_from_json(body, CredentialSource::Imds).unwrap();
        assert_eq!(c.access_key_id(), "ASIAA");
        assert_eq!(c.secret_access_key(), "s/e\"c");
        assert_eq!(c.session_token(), Some("t\u{1f600}"));
        let f = json_object(body).unwrap();
        assert_eq!(string_field(&f, "n"), None);
        for bad in [
            &b"[]"[..],
            b"{",
            b"{\"a\":}",
            b"{\"a\":1,}",
            b"{\"a\":\"x\"} x",
            b"{\"a\":\"\\ud800\"}",
            b"{\"a\":tru}",
            b"{\"a\":\"\x01\"}",
            b"\xff",
        ] {
            let e = credentials_from_json(bad, CredentialSource::Imds).unwrap_err();
            assert!(
                e.contains("not a JSON object"),
                "{:?}: {e}",
                String::from_utf8_lossy(bad)
            );
        }
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(json_object(deep.as_bytes()).is_err());
    }

    #[test]
    fn credentials_json_needs_the_fields() {
        let ok = br#"{"AccessKeyId":"AK","SecretAccessKey":"SK","Token":"T","Expiration":"2030-01-01T00:00:00Z"}"#;
        let c = credentials_from_json(ok, CredentialSource::Container).unwrap();
        assert_eq!(c.access_key_id(), "AK");
        assert_eq!(c.session_token(), Some("T"));
        assert_eq!(c.source(), &CredentialSource::Container);
        let e = credentials_from_json(
            br#"{"AccessKeyId":"AK","SecretAccessKey":"SK","Token":"T"}"#,
            CredentialSource::Imds,
        )
        .unwrap_err();
        assert!(e.contains("Expiration"), "{e}");
        let e = credentials_from_json(
            br#"{"Code":"AssumeRoleUnauthorizedAccess","Message":"no"}"#,
            CredentialSource::Imds,
        )
        .unwrap_err();
        assert!(e.contains("AssumeRoleUnauthorizedAccess"), "{e}");
        let e = credentials_from_json(
            br#"{"AccessKeyId":"AK","SecretAccessKey":"SK","Expiration":"soon"}"#,
            CredentialSource::Imds,
        )
        .unwrap_err();
        assert!(e.contains("Expiration"), "{e}");
    }

    #[test]
    fn container_hosts() {
        let ok = |u: &str| {
            let url = Url::parse(u).unwrap();
            plain_http_allowed(url.host.parse().unwrap())
        };
        assert!(ok("http://127.0.0.1:8080/x"));
        assert!(ok("http://127.8.9.1/x"));
        assert!(ok("http://[::1]/x"));
        assert!(ok("http://169.254.170.2/x"));
        assert!(ok("http://169.254.170.23/v1/credentials"));
        assert!(ok("http://[fd00:ec2::23]/v1/credentials"));
        assert!(!ok("http://192.0.2.10/creds"));
        assert!(!ok("http://169.254.169.254/x"));
        assert!(!ok("http://[::ffff:10.0.0.1]/x"));
        assert!(ok("http://[::ffff:127.0.0.1]/x"));
    }
}
