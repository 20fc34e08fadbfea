//! From a bucket URL to where requests go: scheme, the host to connect to,
//! port, the `Host` header, and the path prefix in front of object keys.
//!
//! Accepted forms (`bucket_url` is lmcache's `s3_endpoint` / `remote_url`):
//!
//! | input | addressing | `Host` | path |
//! | --- | --- | --- | --- |
//! | `s3://bucket` | AWS virtual-hosted | `bucket.s3.<region>.amazonaws.com` | `/<key>` |
//! | `s3://base--azid--x-s3` | S3 Express zonal | `<bucket>.s3express-<azid>.<region>.amazonaws.com` | `/<key>` |
//! | `s3://bucket.host[:port]` or `bucket.host[:port]` | virtual-hosted | `bucket.host[:port]` verbatim | `/<key>` |
//! | any bucket name + explicit `endpoint_url` `http[s]://host[:port]` | path style | `host[:port]` verbatim | `/<bucket>/<key>` |
//!
//! lmcache 0.5.6 (`S3L2Adapter.__init__`, `S3Connector.__init__`) strips an
//! `s3://` prefix and sends the rest verbatim as the `Host` header with path
//! `"/" + quote(key)`; the CRT then connects to that host and its port. The
//! scheme is HTTPS with port 443, or HTTP with port 80 under `disable_tls`.
//! kvshard does the same for `bucket.host[:port]` and keeps the bucket as the
//! first DNS label. The non-MP connector insists on the `s3://` prefix and the
//! MP adapter does not; kvshard accepts both everywhere. Deviations:
//! - `s3://bucket` without a host: lmcache sends `Host: bucket`, which cannot
//!   resolve; kvshard uses the AWS regional virtual-hosted endpoint (or the
//!   zonal endpoint for an S3 Express directory bucket).
//! - `localhost` and `*.localhost` connect to 127.0.0.1 without DNS or
//!   `/etc/hosts` (lmcache's MinIO guide asks for an `/etc/hosts` line).
//! - `bucket.<IPv4>[:port]` connects to the IPv4 address (lmcache's docs
//!   suggest this form, but it does not resolve there).
//! - An explicit endpoint URL (`AWS_ENDPOINT_URL` or a config field) gives
//!   path-style addressing, which lmcache cannot do; `bucket_url` then names
//!   only the bucket.
//! - One trailing `/` after the host is accepted; anything else after it is
//!   rejected (lmcache would put it into the `Host` header).
//! - Bucket names are checked against S3's naming rules and malformed ports
//!   and hosts are errors ([`AddressingError`]); lmcache passes any string on.

use std::fmt;
use std::net::Ipv4Addr;

/// The loopback address `localhost` names resolve to.
pub const LOCALHOST_ADDR: &str = "127.0.0.1";
/// Suffix of S3 Express directory bucket names.
pub const DIRECTORY_BUCKET_SUFFIX: &str = "--x-s3";
/// Signing service of S3 Express (CreateSession and data plane).
pub const S3EXPRESS_SERVICE: &str = "s3express";
/// Signing service of S3.
pub const S3_SERVICE: &str = "s3";
/// Optional CreateSession header: `ReadWrite` (default) or `ReadOnly`.
pub const CREATE_SESSION_MODE_HEADER: &str = "x-amz-create-session-mode";

/// Transport security.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Plain HTTP (`disable_tls`, local servers).
    Http,
    /// HTTPS.
    Https,
}

impl Scheme {
    /// `http` or `https`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }

    /// 80 or 443.
    pub fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }
}

/// Where the bucket name goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressingStyle {
    /// In the host: `Host: bucket.host`, path `/<key>`.
    VirtualHosted,
    /// In the path: `Host: host`, path `/<bucket>/<key>`.
    Path,
}

/// An S3 Express directory bucket name, `<base>--<zone id>--x-s3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectoryBucket {
    /// The part before the zone id.
    pub base_name: String,
    /// Availability zone id, e.g. `usw2-az1`.
    pub zone_id: String,
}

/// Splits a directory bucket name, or `None` for a general-purpose bucket.
/// Like botocore, anything ending in `--x-s3` is a directory bucket; the zone
/// id is the text between the last two `--` separators.
pub fn parse_directory_bucket(bucket: &str) -> Option<DirectoryBucket> {
    let stem = bucket.strip_suffix(DIRECTORY_BUCKET_SUFFIX)?;
    let (base, zone) = stem.rsplit_once("--")?;
    let zone_ok = !zone.is_empty()
        && zone
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if base.is_empty() || !zone_ok {
        return None;
    }
    Some(DirectoryBucket {
        base_name: base.to_owned(),
        zone_id: zone.to_owned(),
    })
}

/// True for S3 Express directory bucket names.
pub fn is_directory_bucket(bucket: &str) -> bool {
    parse_directory_bucket(bucket).is_some()
}

/// `<bucket>.s3.<region>.amazonaws.com`.
pub fn aws_virtual_host(bucket: &str, region: &str) -> String {
    format!("{bucket}.s3.{region}.amazonaws.com")
}

/// `<bucket>.s3express-<zone id>.<region>.amazonaws.com`.
pub fn s3express_zonal_host(bucket: &str, zone_id: &str, region: &str) -> String {
    format!("{bucket}.s3express-{zone_id}.{region}.amazonaws.com")
}

/// Inputs of [`resolve_bucket`].
#[derive(Debug, Clone, Copy)]
pub struct AddressingConfig<'a> {
    /// `s3://bucket`, `s3://bucket.host[:port]`, `bucket.host[:port]`; with
    /// `endpoint_url`, `[s3://]bucket`.
    pub bucket_url: &'a str,
    /// SigV4 region; also names the AWS endpoint for `s3://bucket`.
    pub region: &'a str,
    /// Explicit endpoint, `http[s]://host[:port]`: path-style addressing.
    pub endpoint_url: Option<&'a str>,
    /// Plain HTTP with default port 80 (lmcache's `disable_tls`).
    pub disable_tls: bool,
}

/// Where a bucket's requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketAddress {
    /// The bucket name.
    pub bucket: String,
    /// HTTP or HTTPS.
    pub scheme: Scheme,
    /// Host to open the TCP connection to: a DNS name or an IP literal
    /// (IPv6 without brackets). Also the TLS server name when it is a name.
    pub connect_host: String,
    /// TCP port.
    pub port: u16,
    /// `Host` header value, sent (and signed) verbatim.
    pub host_header: String,
    /// Virtual-hosted or path style.
    pub style: AddressingStyle,
    /// Raw path in front of `/<key>`: empty, or `/<bucket>` for path style.
    pub path_prefix: String,
    /// Set for S3 Express directory buckets.
    pub directory_bucket: Option<DirectoryBucket>,
}

impl BucketAddress {
    /// The raw (unencoded) request path of an object; the signer encodes it.
    pub fn object_path(&self, key: &str) -> String {
        let mut path = String::with_capacity(self.path_prefix.len() + 1 + key.len());
        path.push_str(&self.path_prefix);
        path.push('/');
        path.push_str(key);
        path
    }

    /// The raw path of bucket-level requests (ListObjectsV2, CreateSession):
    /// `/` or `/<bucket>`.
    pub fn bucket_path(&self) -> String {
        if self.path_prefix.is_empty() {
            "/".to_owned()
        } else {
            self.path_prefix.clone()
        }
    }

    /// The CreateSession request for a directory bucket.
    pub fn create_session_request(&self) -> Result<CreateSessionRequest, AddressingError> {
        if self.directory_bucket.is_none() {
            return Err(AddressingError::NotDirectoryBucket(self.bucket.clone()));
        }
        Ok(CreateSessionRequest {
            path: self.bucket_path(),
            host_header: self.host_header.clone(),
        })
    }
}

/// S3 Express CreateSession: `GET /?session` on the zonal endpoint, signed
/// with the IAM credentials under the S3 rules and service `s3express`
/// (token, if any, in `x-amz-security-token`; no `x-amz-s3session-token`).
/// The answer is a `CreateSessionResult` (see `xml`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateSessionRequest {
    /// Raw path, `/` (or `/<bucket>` on a path-style endpoint).
    pub path: String,
    /// `Host` header value.
    pub host_header: String,
}

impl CreateSessionRequest {
    /// `GET`.
    pub const METHOD: &'static str = "GET";
    /// The query: `session` with an empty value (canonical `session=`).
    pub const QUERY: [(&'static str, &'static str); 1] = [("session", "")];
    /// Signing service.
    pub const SERVICE: &'static str = S3EXPRESS_SERVICE;
}

/// Why a bucket URL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddressingError {
    /// The bucket URL is empty (or only a scheme).
    Empty,
    /// A scheme other than `s3://` on the bucket URL, or other than
    /// `http://`/`https://` on the endpoint URL.
    UnsupportedScheme(String),
    /// The bucket name breaks S3's naming rules.
    InvalidBucketName {
        /// The name.
        name: String,
        /// Which rule.
        reason: &'static str,
    },
    /// The port is not a number in 1..=65535.
    BadPort(String),
    /// The host part is empty or has characters a host name cannot have.
    InvalidHost(String),
    /// Something follows the host: a key prefix, query, fragment or user info.
    UnsupportedUrlPart {
        /// The whole URL.
        url: String,
        /// What was found.
        part: &'static str,
    },
    /// The region is needed for an AWS host name but is empty or malformed.
    InvalidRegion(String),
    /// `disable_tls` is set but the endpoint URL says `https://`.
    TlsConflict(String),
    /// An explicit endpoint URL was given and the bucket URL names a host too.
    ConflictingEndpoint {
        /// The bucket URL.
        bucket_url: String,
        /// The endpoint URL.
        endpoint_url: String,
    },
    /// CreateSession was asked for a general-purpose bucket.
    NotDirectoryBucket(String),
}

impl fmt::Display for AddressingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddressingError::Empty => write!(f, "bucket URL is empty"),
            AddressingError::UnsupportedScheme(url) => write!(
                f,
                "unsupported scheme in {url:?}: the bucket URL takes s3:// or no scheme, an endpoint URL http:// or https://"
            ),
            AddressingError::InvalidBucketName { name, reason } => {
                write!(f, "invalid bucket name {name:?}: {reason}")
            }
            AddressingError::BadPort(port) => write!(f, "bad port {port:?}: expected 1..=65535"),
            AddressingError::InvalidHost(host) => write!(f, "invalid host {host:?}"),
            AddressingError::UnsupportedUrlPart { url, part } => {
                write!(f, "{url:?} has a {part}, which is not supported here")
            }
            AddressingError::InvalidRegion(region) => {
                write!(f, "invalid region {region:?} for an AWS endpoint")
            }
            AddressingError::TlsConflict(url) => {
                write!(f, "disable_tls is set but the endpoint {url:?} is https")
            }
            AddressingError::ConflictingEndpoint {
                bucket_url,
                endpoint_url,
            } => write!(
                f,
                "bucket URL {bucket_url:?} names a host, but endpoint {endpoint_url:?} is given too; with an endpoint URL, name only the bucket"
            ),
            AddressingError::NotDirectoryBucket(bucket) => write!(
                f,
                "bucket {bucket:?} is not an S3 Express directory bucket (<base>--<zone id>--x-s3)"
            ),
        }
    }
}

impl std::error::Error for AddressingError {}

/// Checks S3's general-purpose bucket naming rules: 3 to 63 characters of
/// `a-z`, `0-9`, `.` and `-`, beginning and ending with a letter or digit, no
/// `..`, not an IPv4 address.
pub fn validate_bucket_name(name: &str) -> Result<(), AddressingError> {
    let bad = |reason| {
        Err(AddressingError::InvalidBucketName {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("empty");
    }
    if !(3..=63).contains(&name.len()) {
        return bad("must be 3 to 63 characters long");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
    {
        return bad("only lowercase letters, digits, '.' and '-' are allowed");
    }
    let edge_ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if !edge_ok(name.as_bytes()[0]) || !edge_ok(name.as_bytes()[name.len() - 1]) {
        return bad("must begin and end with a letter or digit");
    }
    if name.contains("..") {
        return bad("must not contain '..'");
    }
    if name.parse::<Ipv4Addr>().is_ok() {
        return bad("must not look like an IPv4 address");
    }
    Ok(())
}

fn validate_region(region: &str) -> Result<(), AddressingError> {
    let ok = !region.is_empty()
        && region
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(AddressingError::InvalidRegion(region.to_owned()))
    }
}

fn is_host_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

fn parse_port(text: &str) -> Result<u16, AddressingError> {
    let bad = || AddressingError::BadPort(text.to_owned());
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match text.parse::<u16>() {
        Ok(0) | Err(_) => Err(bad()),
        Ok(port) => Ok(port),
    }
}

/// `localhost` and `*.localhost` connect to loopback without DNS.
fn connect_host_for(host: &str) -> String {
    let lower = host.to_ascii_lowercase();
    if lower == "localhost" || lower.ends_with(".localhost") {
        LOCALHOST_ADDR.to_owned()
    } else {
        host.to_owned()
    }
}

/// Splits `scheme://rest`, returning the lowercased scheme.
fn split_scheme(url: &str) -> Option<(String, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let valid = !scheme.is_empty()
        && scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
    valid.then(|| (scheme.to_ascii_lowercase(), rest))
}

/// The authority of `rest` (text after the scheme), allowing one trailing
/// `/` and nothing else after it.
fn authority_of<'a>(url: &str, rest: &'a str) -> Result<&'a str, AddressingError> {
    let unsupported = |part| AddressingError::UnsupportedUrlPart {
        url: url.to_owned(),
        part,
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if let Some(i) = authority.find(['/', '?', '#', '@']) {
        return Err(unsupported(match authority.as_bytes()[i] {
            b'/' => "path (key prefixes are not supported)",
            b'?' => "query",
            b'#' => "fragment",
            _ => "user info",
        }));
    }
    Ok(authority)
}

/// Resolves a bucket URL (and optional explicit endpoint) to an address.
pub fn resolve_bucket(config: &AddressingConfig<'_>) -> Result<BucketAddress, AddressingError> {
    let url = config.bucket_url.trim();
    let rest = match split_scheme(url) {
        Some((scheme, rest)) if scheme == "s3" => rest,
        Some(_) => return Err(AddressingError::UnsupportedScheme(url.to_owned())),
        None => url,
    };
    let authority = authority_of(url, rest)?;
    if authority.is_empty() {
        return Err(AddressingError::Empty);
    }
    let default_scheme = if config.disable_tls {
        Scheme::Http
    } else {
        Scheme::Https
    };

    if let Some(endpoint_url) = config.endpoint_url {
        return resolve_path_style(config, url, authority, endpoint_url.trim());
    }

    // A bare bucket name: AWS.
    if !authority.contains(['.', ':']) {
        let bucket = authority;
        validate_bucket_name(bucket)?;
        validate_region(config.region)?;
        let directory_bucket = parse_directory_bucket(bucket);
        let host = match &directory_bucket {
            Some(dir) => s3express_zonal_host(bucket, &dir.zone_id, config.region),
            None => aws_virtual_host(bucket, config.region),
        };
        return Ok(BucketAddress {
            bucket: bucket.to_owned(),
            scheme: default_scheme,
            connect_host: host.clone(),
            port: default_scheme.default_port(),
            host_header: host,
            style: AddressingStyle::VirtualHosted,
            path_prefix: String::new(),
            directory_bucket,
        });
    }

    // `bucket.host[:port]`, Host verbatim.
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) => (host, parse_port(port)?),
        None => (authority, default_scheme.default_port()),
    };
    let Some((bucket, domain)) = host.split_once('.') else {
        return Err(AddressingError::InvalidHost(format!(
            "{authority} (expected bucket.host[:port]; the bucket is the first label)"
        )));
    };
    validate_bucket_name(bucket)?;
    if !is_host_name(domain) {
        return Err(AddressingError::InvalidHost(host.to_owned()));
    }
    let connect_host = match domain.parse::<Ipv4Addr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => connect_host_for(host),
    };
    Ok(BucketAddress {
        bucket: bucket.to_owned(),
        scheme: default_scheme,
        connect_host,
        port,
        host_header: authority.to_owned(),
        style: AddressingStyle::VirtualHosted,
        path_prefix: String::new(),
        directory_bucket: parse_directory_bucket(bucket),
    })
}

fn resolve_path_style(
    config: &AddressingConfig<'_>,
    bucket_url: &str,
    bucket: &str,
    endpoint_url: &str,
) -> Result<BucketAddress, AddressingError> {
    if bucket.contains(':') {
        return Err(AddressingError::ConflictingEndpoint {
            bucket_url: bucket_url.to_owned(),
            endpoint_url: endpoint_url.to_owned(),
        });
    }
    validate_bucket_name(bucket)?;
    let (scheme, rest) = match split_scheme(endpoint_url) {
        Some((s, rest)) if s == "http" => (Scheme::Http, rest),
        Some((s, rest)) if s == "https" => (Scheme::Https, rest),
        _ => return Err(AddressingError::UnsupportedScheme(endpoint_url.to_owned())),
    };
    if config.disable_tls && scheme == Scheme::Https {
        return Err(AddressingError::TlsConflict(endpoint_url.to_owned()));
    }
    let authority = authority_of(endpoint_url, rest)?;
    if authority.is_empty() {
        return Err(AddressingError::InvalidHost(endpoint_url.to_owned()));
    }
    let (host, port_text) = if let Some(after) = authority.strip_prefix('[') {
        // IPv6 literal.
        let (ip, tail) = after
            .split_once(']')
            .ok_or_else(|| AddressingError::InvalidHost(authority.to_owned()))?;
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(AddressingError::InvalidHost(authority.to_owned()));
        }
        let port = match tail {
            "" => None,
            _ => Some(
                tail.strip_prefix(':')
                    .ok_or_else(|| AddressingError::InvalidHost(authority.to_owned()))?,
            ),
        };
        (ip, port)
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let is_ipv6 = authority.starts_with('[');
    if !is_ipv6 && !is_host_name(host) {
        return Err(AddressingError::InvalidHost(host.to_owned()));
    }
    let port = match port_text {
        Some(p) => parse_port(p)?,
        None => scheme.default_port(),
    };
    Ok(BucketAddress {
        bucket: bucket.to_owned(),
        scheme,
        connect_host: if is_ipv6 {
            host.to_owned()
        } else {
            connect_host_for(host)
        },
        port,
        host_header: authority.to_owned(),
        style: AddressingStyle::Path,
        path_prefix: format!("/{bucket}"),
        directory_bucket: parse_directory_bucket(bucket),
    })
}
