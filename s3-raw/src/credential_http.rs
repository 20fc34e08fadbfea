//! The credential sources that need HTTP: EC2 instance metadata (IMDSv2),
//! the ECS/EKS container credentials endpoint, and STS
//! AssumeRoleWithWebIdentity.
//!
//! [`HttpFetcher`] is a small blocking HTTP/1.1 client on std sockets (and
//! rustls for `https`, with the same trust settings as the S3 client). It is
//! meant to run off the shard executors: the client runs it on a thread of
//! its own (see [`crate::client`]), tests call it directly.
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
//! Every exchange has a connect timeout per address and one deadline for the
//! rest (TLS handshake, request, whole response); bodies are bounded. Errors
//! name the source and the URL, never a token or a secret.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::credentials::{
    CredentialSource, Credentials, CredentialsError, HttpCredentialFetcher, HttpCredentialSource,
};
use crate::net::{self, TlsConfigError, TlsTrust};
use crate::sigv4::encode_query;
use crate::time::parse_rfc3339;
use crate::xml;

/// Lifetime asked for an IMDSv2 session token, seconds (the SDKs' 6 h).
pub const IMDS_TOKEN_TTL_SECS: u32 = 21_600;
/// Largest response body accepted from a credentials endpoint.
pub const MAX_CREDENTIALS_BODY_BYTES: usize = 64 << 10;
/// Largest response head accepted.
pub const MAX_RESPONSE_HEAD_BYTES: usize = 16 << 10;
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
    /// Limit of one TCP connect (per address tried). Default 2 s.
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

/// Fetches credentials from the HTTP sources (blocking: run it off the
/// shard executors).
pub struct HttpFetcher {
    cfg: FetchConfig,
    /// Built on the first `https` fetch (loading the system roots reads
    /// files).
    tls: OnceLock<Result<Arc<rustls::ClientConfig>, TlsConfigError>>,
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
    fn fetch(&self, source: &HttpCredentialSource) -> Result<Credentials, CredentialsError> {
        match source {
            HttpCredentialSource::Imds { endpoint } => self.imds(endpoint),
            HttpCredentialSource::Container {
                uri,
                auth_token,
                auth_token_file,
            } => self.container(uri, auth_token.as_deref(), auth_token_file.as_deref()),
            HttpCredentialSource::WebIdentity {
                role_arn,
                token_file,
                session_name,
                endpoint,
            } => self.web_identity(role_arn, token_file, session_name.as_deref(), endpoint),
        }
    }
}

/// An error of one exchange, before it is labelled with the source.
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

impl HttpFetcher {
    /// A fetcher with these settings.
    pub fn new(cfg: FetchConfig) -> HttpFetcher {
        HttpFetcher {
            cfg,
            tls: OnceLock::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &FetchConfig {
        &self.cfg
    }

    fn tls_config(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        self.tls
            .get_or_init(|| net::tls_client_config(&self.cfg.trust, false))
            .clone()
            .map_err(|e| format!("TLS configuration: {e}"))
    }

    /// One exchange; `source` and `url` label errors.
    fn call(
        &self,
        source: &'static str,
        method: &str,
        url_text: &str,
        addrs: Option<Vec<SocketAddr>>,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<HttpResponse, CredentialsError> {
        let url = Url::parse(url_text).map_err(|e| CredentialsError::Invalid {
            source: source.to_owned(),
            reason: format!("URL {url_text:?}: {e}"),
        })?;
        self.exchange(&url, addrs, method, headers, body)
            .map_err(|e| http_error(source, method, url_text, e))
    }

    fn exchange(
        &self,
        url: &Url,
        addrs: Option<Vec<SocketAddr>>,
        method: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<HttpResponse, String> {
        let addrs = match addrs {
            Some(addrs) => addrs,
            None => resolve(&url.host, url.port)?,
        };
        let tcp = connect(&addrs, self.cfg.connect_timeout)?;
        let deadline = Instant::now() + self.cfg.read_timeout;
        let mut conn = if url.https {
            let config = self.tls_config()?;
            let name = net::server_name(&url.host)?;
            let session = rustls::ClientConnection::new(config, name)
                .map_err(|e| format!("TLS setup: {e}"))?;
            Conn::Tls(Box::new(rustls::StreamOwned::new(session, tcp)))
        } else {
            Conn::Plain(tcp)
        };
        let mut head = format!(
            "{method} {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: kvshard-s3-raw\r\nAccept: */*\r\nConnection: close\r\n",
            url.target,
            url.host_header()
        );
        if !body.is_empty() || matches!(method, "POST" | "PUT") {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        for (name, value) in headers {
            head.push_str(name);
            head.push_str(": ");
            head.push_str(value);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        let mut wire = Wire {
            conn: &mut conn,
            deadline,
            timeout: self.cfg.read_timeout,
            buf: Vec::new(),
        };
        wire.send(head.as_bytes(), body)?;
        wire.response()
    }

    fn imds(&self, endpoint: &str) -> Result<Credentials, CredentialsError> {
        let base = endpoint.trim_end_matches('/');
        let token_url = format!("{base}/latest/api/token");
        let ttl = IMDS_TOKEN_TTL_SECS.to_string();
        let resp = self.call(
            IMDS,
            "PUT",
            &token_url,
            None,
            &[("X-aws-ec2-metadata-token-ttl-seconds", &ttl)],
            b"",
        )?;
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
        let token_header = [("X-aws-ec2-metadata-token", token.as_str())];

        let roles_url = format!("{base}/latest/meta-data/iam/security-credentials/");
        let resp = self.call(IMDS, "GET", &roles_url, None, &token_header, b"")?;
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
        let resp = self.call(IMDS, "GET", &creds_url, None, &token_header, b"")?;
        if resp.status != 200 {
            return Err(fail("GET", &creds_url, format!("HTTP {}", resp.status)));
        }
        credentials_from_json(&resp.body, CredentialSource::Imds)
            .map_err(|e| fail("GET", &creds_url, e))
    }

    fn container(
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
            Some(container_http_addrs(&url)?)
        };
        let auth = match (auth_token_file, auth_token) {
            (Some(path), _) => Some(read_token_file(
                path,
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            )?),
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
        let headers: Vec<(&str, &str)> = match &auth {
            Some(value) => vec![("Authorization", value.as_str())],
            None => Vec::new(),
        };
        let resp = self.call(CONTAINER, "GET", uri, addrs, &headers, b"")?;
        if resp.status != 200 {
            let mut what = format!("HTTP {}", resp.status);
            if let Ok(fields) = json_string_fields(&resp.body) {
                let get = |k: &str| {
                    fields
                        .get(k)
                        .or_else(|| fields.get(&k.to_ascii_lowercase()))
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

    fn web_identity(
        &self,
        role_arn: &str,
        token_file: &Path,
        session_name: Option<&str>,
        endpoint: &str,
    ) -> Result<Credentials, CredentialsError> {
        let token = read_token_file(token_file, "web identity token file")?;
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
        let resp = self.call(
            WEB_IDENTITY,
            "POST",
            endpoint,
            None,
            &[(
                "Content-Type",
                "application/x-www-form-urlencoded; charset=utf-8",
            )],
            form.as_bytes(),
        )?;
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

/// Reads a token file (again on every fetch: they are rotated), trimmed.
fn read_token_file(path: &Path, what: &str) -> Result<String, CredentialsError> {
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

/// The addresses a plain-`http` container URI may be dialled at, or why
/// not.
fn container_http_addrs(url: &Url) -> Result<Vec<SocketAddr>, CredentialsError> {
    let refuse = |detail: String| CredentialsError::Invalid {
        source: "AWS_CONTAINER_CREDENTIALS_FULL_URI".to_owned(),
        reason: format!(
            "plain http is only allowed to loopback or to the ECS/EKS container endpoints \
             (169.254.170.2, 169.254.170.23, fd00:ec2::23); {detail}; use https for other hosts"
        ),
    };
    if let Ok(ip) = url.host.parse::<IpAddr>() {
        if is_loopback(ip) || CONTAINER_LINK_LOCAL_HOSTS.contains(&ip) {
            return Ok(vec![SocketAddr::new(ip, url.port)]);
        }
        return Err(refuse(format!("{ip} is neither")));
    }
    let addrs = resolve(&url.host, url.port).map_err(|e| CredentialsError::Http {
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

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("cannot resolve {host:?}: no addresses"));
    }
    Ok(addrs)
}

fn connect(addrs: &[SocketAddr], timeout: Duration) -> Result<TcpStream, String> {
    let mut last = String::from("no address to connect to");
    for addr in addrs {
        match TcpStream::connect_timeout(addr, timeout) {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                last = format!("connect to {addr}: no answer within {timeout:?}");
            }
            Err(e) => last = format!("connect to {addr}: {e}"),
        }
    }
    Err(last)
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

/// A connection, plain or TLS.
enum Conn {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Conn {
    fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(s) => s,
            Conn::Tls(s) => &s.sock,
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Plain(s) => s.read(buf),
            Conn::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Plain(s) => s.write(buf),
            Conn::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Plain(s) => s.flush(),
            Conn::Tls(s) => s.flush(),
        }
    }
}

/// A response: status and body (headers are only used for framing).
#[derive(Debug)]
struct HttpResponse {
    status: u16,
    body: Vec<u8>,
}

/// One exchange on a connection, under a deadline.
struct Wire<'c> {
    conn: &'c mut Conn,
    deadline: Instant,
    timeout: Duration,
    /// Bytes read and not yet consumed.
    buf: Vec<u8>,
}

impl Wire<'_> {
    fn remaining(&self) -> Result<Duration, String> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no complete answer within {:?}", self.timeout));
        }
        Ok(left)
    }

    fn io_error(&self, doing: &str, e: io::Error) -> String {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                format!("no complete answer within {:?}", self.timeout)
            }
            _ => format!("{doing}: {e}"),
        }
    }

    fn send(&mut self, head: &[u8], body: &[u8]) -> Result<(), String> {
        let left = self.remaining()?;
        let tcp = self.conn.tcp();
        tcp.set_write_timeout(Some(left))
            .and_then(|()| tcp.set_read_timeout(Some(left)))
            .map_err(|e| format!("socket options: {e}"))?;
        let mut message = Vec::with_capacity(head.len() + body.len());
        message.extend_from_slice(head);
        message.extend_from_slice(body);
        self.conn
            .write_all(&message)
            .and_then(|()| self.conn.flush())
            .map_err(|e| self.io_error("sending the request", e))
    }

    /// Reads more bytes into `buf`; false at the end of the stream.
    fn fill(&mut self, limit: usize) -> Result<bool, String> {
        if self.buf.len() >= limit {
            return Err(format!(
                "response larger than {} bytes",
                limit.saturating_sub(MAX_RESPONSE_HEAD_BYTES)
            ));
        }
        let left = self.remaining()?;
        self.conn
            .tcp()
            .set_read_timeout(Some(left))
            .map_err(|e| format!("socket options: {e}"))?;
        let mut chunk = [0u8; 8192];
        let want = chunk.len().min(limit - self.buf.len());
        match self.conn.read(&mut chunk[..want]) {
            Ok(0) => Ok(false),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(self.io_error("reading the response", e)),
        }
    }

    fn response(&mut self) -> Result<HttpResponse, String> {
        let limit = MAX_RESPONSE_HEAD_BYTES + MAX_CREDENTIALS_BODY_BYTES;
        loop {
            let head_end = loop {
                if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                    break i;
                }
                if self.buf.len() > MAX_RESPONSE_HEAD_BYTES {
                    return Err(format!(
                        "response head larger than {MAX_RESPONSE_HEAD_BYTES} bytes"
                    ));
                }
                if !self.fill(limit)? {
                    return Err(if self.buf.is_empty() {
                        "connection closed without an answer".to_owned()
                    } else {
                        "connection closed in the response head".to_owned()
                    });
                }
            };
            let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
            self.buf.drain(..head_end + 4);
            let mut lines = head.split("\r\n");
            let status_line = lines.next().unwrap_or("");
            let mut parts = status_line.splitn(3, ' ');
            let version = parts.next().unwrap_or("");
            let status = parts
                .next()
                .and_then(|s| s.parse::<u16>().ok())
                .filter(|s| (100..1000).contains(s));
            let Some(status) = status.filter(|_| version.starts_with("HTTP/1.")) else {
                return Err(format!(
                    "not an HTTP/1.x status line: {:?}",
                    truncate(status_line, 80)
                ));
            };
            if (100..200).contains(&status) {
                // An interim answer (100 Continue): the real one follows.
                continue;
            }
            let mut content_length = None;
            let mut chunked = false;
            for line in lines {
                let Some((name, value)) = line.split_once(':') else {
                    continue;
                };
                let name = name.trim();
                let value = value.trim();
                if name.eq_ignore_ascii_case("content-length") {
                    let n = value
                        .parse::<usize>()
                        .map_err(|_| format!("bad Content-Length {value:?}"))?;
                    content_length = Some(n);
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    chunked = value
                        .rsplit(',')
                        .next()
                        .is_some_and(|v| v.trim().eq_ignore_ascii_case("chunked"));
                }
            }
            let body = if status == 204 || status == 304 {
                Vec::new()
            } else if chunked {
                self.chunked_body(limit)?
            } else if let Some(n) = content_length {
                if n > MAX_CREDENTIALS_BODY_BYTES {
                    return Err(format!(
                        "response body of {n} bytes is larger than {MAX_CREDENTIALS_BODY_BYTES}"
                    ));
                }
                while self.buf.len() < n {
                    if !self.fill(limit)? {
                        return Err(format!(
                            "connection closed after {} of {n} body bytes",
                            self.buf.len()
                        ));
                    }
                }
                self.buf.truncate(n);
                std::mem::take(&mut self.buf)
            } else {
                while self.fill(limit)? {}
                std::mem::take(&mut self.buf)
            };
            return Ok(HttpResponse { status, body });
        }
    }

    fn chunked_body(&mut self, limit: usize) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find(&self.buf, b"\r\n") {
                    break i;
                }
                if !self.fill(limit)? {
                    return Err("connection closed in a chunk header".to_owned());
                }
            };
            let line = String::from_utf8_lossy(&self.buf[..line_end]).into_owned();
            let size_text = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| format!("bad chunk size {:?}", truncate(size_text, 20)))?;
            self.buf.drain(..line_end + 2);
            if size == 0 {
                // Trailers are not needed: the connection closes after this.
                return Ok(body);
            }
            if body.len() + size > MAX_CREDENTIALS_BODY_BYTES {
                return Err(format!(
                    "response body larger than {MAX_CREDENTIALS_BODY_BYTES} bytes"
                ));
            }
            while self.buf.len() < size + 2 {
                if !self.fill(limit)? {
                    return Err("connection closed in a chunk".to_owned());
                }
            }
            if &self.buf[size..size + 2] != b"\r\n" {
                return Err("chunk not followed by CRLF".to_owned());
            }
            body.extend_from_slice(&self.buf[..size]);
            self.buf.drain(..size + 2);
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Credentials from the JSON the IMDS and container endpoints answer:
/// `AccessKeyId`, `SecretAccessKey`, `Token`, `Expiration` (ISO 8601), and
/// from IMDS `Code` (must be `Success`).
fn credentials_from_json(body: &[u8], source: CredentialSource) -> Result<Credentials, String> {
    let fields = json_string_fields(body)?;
    if let Some(code) = fields.get("Code") {
        if code != "Success" {
            let mut what = format!("the answer says Code {:?}", truncate(code, 100));
            if let Some(m) = fields.get("Message") {
                what.push_str(&format!(": {}", truncate(m, 300)));
            }
            return Err(what);
        }
    }
    let get = |k: &'static str| {
        fields
            .get(k)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("the answer has no {k}"))
    };
    let access_key = get("AccessKeyId")?;
    let secret = get("SecretAccessKey")?;
    let token = fields
        .get("Token")
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

/// The string members of a JSON object (other members are checked for
/// syntax and skipped). Enough for the credential endpoints' flat answers.
fn json_string_fields(body: &[u8]) -> Result<HashMap<String, String>, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the answer is not UTF-8".to_owned())?;
    let mut p = Json {
        b: text.as_bytes(),
        pos: 0,
    };
    p.ws();
    if p.peek() != Some(b'{') {
        return Err("the answer is not a JSON object".to_owned());
    }
    p.pos += 1;
    let mut out = HashMap::new();
    p.ws();
    if p.peek() == Some(b'}') {
        p.pos += 1;
    } else {
        loop {
            p.ws();
            let key = p.string()?;
            p.ws();
            p.expect(b':')?;
            p.ws();
            if p.peek() == Some(b'"') {
                let value = p.string()?;
                out.insert(key, value);
            } else {
                p.skip_value(1)?;
            }
            p.ws();
            match p.next() {
                Some(b',') => continue,
                Some(b'}') => break,
                _ => return Err(p.error("expected ',' or '}'")),
            }
        }
    }
    p.ws();
    if p.pos != p.b.len() {
        return Err(p.error("text after the object"));
    }
    Ok(out)
}

const MAX_JSON_DEPTH: usize = 32;

struct Json<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Json<'_> {
    fn error(&self, what: &str) -> String {
        format!("malformed JSON at byte {}: {what}", self.pos)
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.pos).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.pos += 1;
        Some(c)
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.pos += 1;
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.next() == Some(c) {
            Ok(())
        } else {
            Err(self.error(&format!("expected '{}'", c as char)))
        }
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let digits = self
            .b
            .get(self.pos..self.pos + 4)
            .and_then(|d| std::str::from_utf8(d).ok())
            .and_then(|d| u32::from_str_radix(d, 16).ok())
            .ok_or_else(|| self.error("bad \\u escape"))?;
        self.pos += 4;
        Ok(digits)
    }

    fn string(&mut self) -> Result<String, String> {
        self.expect(b'"')?;
        let mut out = Vec::new();
        loop {
            let c = self
                .next()
                .ok_or_else(|| self.error("unterminated string"))?;
            match c {
                b'"' => break,
                b'\\' => {
                    let e = self
                        .next()
                        .ok_or_else(|| self.error("unterminated escape"))?;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let code = if (0xd800..0xdc00).contains(&hi) {
                                if self.next() != Some(b'\\') || self.next() != Some(b'u') {
                                    return Err(self.error("unpaired surrogate"));
                                }
                                let lo = self.hex4()?;
                                if !(0xdc00..0xe000).contains(&lo) {
                                    return Err(self.error("unpaired surrogate"));
                                }
                                0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00)
                            } else {
                                hi
                            };
                            char::from_u32(code).ok_or_else(|| self.error("bad \\u escape"))?
                        }
                        _ => return Err(self.error("unknown escape")),
                    };
                    let mut tmp = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut tmp).as_bytes());
                }
                c if c < 0x20 => return Err(self.error("control character in a string")),
                c => out.push(c),
            }
        }
        // The input is UTF-8 and escapes add whole characters.
        String::from_utf8(out).map_err(|_| self.error("invalid UTF-8 in a string"))
    }

    fn skip_value(&mut self, depth: usize) -> Result<(), String> {
        if depth > MAX_JSON_DEPTH {
            return Err(self.error("nested too deeply"));
        }
        match self.peek() {
            Some(b'"') => self.string().map(drop),
            Some(open @ (b'{' | b'[')) => {
                let close = if open == b'{' { b'}' } else { b']' };
                self.pos += 1;
                self.ws();
                if self.peek() == Some(close) {
                    self.pos += 1;
                    return Ok(());
                }
                loop {
                    self.ws();
                    if open == b'{' {
                        self.string()?;
                        self.ws();
                        self.expect(b':')?;
                        self.ws();
                    }
                    self.skip_value(depth + 1)?;
                    self.ws();
                    match self.next() {
                        Some(b',') => continue,
                        Some(c) if c == close => return Ok(()),
                        _ => return Err(self.error("expected ',' or a closing bracket")),
                    }
                }
            }
            Some(b't') => self.word("true"),
            Some(b'f') => self.word("false"),
            Some(b'n') => self.word("null"),
            Some(b'-' | b'0'..=b'9') => {
                let start = self.pos;
                while matches!(
                    self.peek(),
                    Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                ) {
                    self.pos += 1;
                }
                let text = std::str::from_utf8(&self.b[start..self.pos]).unwrap_or("");
                text.parse::<f64>()
                    .map(drop)
                    .map_err(|_| self.error("bad number"))
            }
            _ => Err(self.error("expected a value")),
        }
    }

    fn word(&mut self, word: &str) -> Result<(), String> {
        if self.b[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.error("expected a value"))
        }
    }
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
    fn json_fields() {
        let body = br#" {"Code":"Success","LastUpdated":"2024-01-01T00:00:00Z","Type":"AWS-HMAC",
            "AccessKeyId":"ASIA\u0041","SecretAccessKey":"s\/e\"c","Token":"t\ud83d\ude00",
            "Expiration":"2030-01-01T00:00:00Z","n":-1.5e3,"o":{"a":[1,true,null,{}]},"e":[]} "#;
        let f = json_string_fields(body).unwrap();
        assert_eq!(f["AccessKeyId"], "ASIAA");
        assert_eq!(f["SecretAccessKey"], "s/e\"c");
        assert_eq!(f["Token"], "t\u{1f600}");
        assert!(!f.contains_key("n"));
        for bad in [
            &b"[]"[..],
            b"{",
            b"{\"a\":}",
            b"{\"a\":1,}",
            b"{\"a\":\"x\"} x",
            b"{\"a\":\"\\ud800\"}",
            b"{\"a\":tru}",
            b"{\"a\":\"\x01\"}",
        ] {
            assert!(
                json_string_fields(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(40), "]".repeat(40));
        assert!(json_string_fields(deep.as_bytes()).is_err());
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
        let ok = |u: &str| container_http_addrs(&Url::parse(u).unwrap());
        assert!(ok("http://127.0.0.1:8080/x").is_ok());
        assert!(ok("http://127.8.9.1/x").is_ok());
        assert!(ok("http://[::1]/x").is_ok());
        assert!(ok("http://169.254.170.2/x").is_ok());
        assert!(ok("http://169.254.170.23/v1/credentials").is_ok());
        assert!(ok("http://[fd00:ec2::23]/v1/credentials").is_ok());
        let e = ok("http://192.0.2.10/creds").unwrap_err();
        assert!(e.to_string().contains("use https"), "{e}");
        assert!(ok("http://169.254.169.254/x").is_err());
        assert!(ok("http://[::ffff:10.0.0.1]/x").is_err());
        assert!(ok("http://[::ffff:127.0.0.1]/x").is_ok());
    }
}
