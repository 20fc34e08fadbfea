//! AWS Signature Version 4 for request headers, by hand, on `ring`'s SHA-256
//! and HMAC-SHA256.
//!
//! The canonical request is
//!
//! ```text
//! METHOD '\n' encoded-path '\n' canonical-query '\n'
//! (name ':' value '\n')*  '\n'  signed-header-names '\n'  payload-hash
//! ```
//!
//! and the string to sign is `AWS4-HMAC-SHA256 '\n' x-amz-date '\n'
//! date/region/service/aws4_request '\n' hex(sha256(canonical request))`.
//!
//! S3 rules ([`SigningSettings::s3`], the default):
//! - the raw path is URI-encoded once: every byte outside `A-Za-z0-9-_.~` and
//!   `/` becomes `%XX` (uppercase hex); no normalisation, so `//`, `.` and `..`
//!   segments are signed as they are;
//! - query keys and values are encoded the same way, `/` included, and the
//!   pairs are sorted by encoded key, then encoded value;
//! - header names are lowercased, values trimmed and runs of spaces and tabs
//!   collapsed to one space; repeated names are joined with `,` in the order
//!   given; the list is sorted by name;
//! - `x-amz-content-sha256` is always sent and signed: the hex SHA-256 of the
//!   body, or `UNSIGNED-PAYLOAD`;
//! - a session token goes in `x-amz-security-token` and is signed.
//!
//! S3 Express data plane ([`SigningSettings::s3_express_data_plane`], service
//! `s3express`, session credentials from CreateSession): the token goes in
//! `x-amz-s3session-token` instead, signed, and `x-amz-security-token` is never
//! sent. CreateSession itself is signed with the IAM credentials under the
//! plain S3 settings and service `s3express`.
//!
//! The other settings (path normalisation, double path encoding, no
//! `x-amz-content-sha256` header, an unsigned token) exist for non-S3
//! services and AWS's signing test suite.
//!
//! Headers named `user-agent`, `expect`, `transfer-encoding` and
//! `x-amzn-trace-id` are left out of the signature, as botocore does, because
//! proxies rewrite them; the caller still sends them. The headers this module
//! produces (`host`, `authorization`, `x-amz-date`, `x-amz-content-sha256`,
//! and both token headers) may not be passed in.
//!
//! Cost: a [`Signer`] reuses its buffers and caches the derived signing key
//! per (secret, date, region, service), so a warm `sign` allocates nothing
//! (`tests/sign_cost.rs` checks this with a counting allocator) and hashes
//! the canonical request once plus one HMAC over the string to sign.
//! Measured with `cargo test -p kvshard-s3-raw --release --test sign_cost --
//! --ignored --nocapture` on the shared 2-core development VM, for a GET with
//! four headers, a session token and a two-pair query: about 2.1-2.3 µs per
//! warm sign, about 3.8 µs when the key must be derived (a new day, region
//! or service), against about 10 µs for the `aws-sigv4` crate on the same
//! request. A debug build takes about 40 µs (unoptimised `ring`).

use std::fmt;
use std::ops::Range;
use std::time::SystemTime;

use ring::{digest, hmac};

use crate::credentials::Credentials;
use crate::time::{AmzDate, TimeError};

/// The only algorithm this module signs with.
pub const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// Payload hash value for a body that is not signed.
pub const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";
/// Hex SHA-256 of the empty string.
pub const EMPTY_SHA256_HEX: &str =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
/// Header carrying the request time.
pub const X_AMZ_DATE: &str = "x-amz-date";
/// Header carrying the payload hash (required by S3).
pub const X_AMZ_CONTENT_SHA256: &str = "x-amz-content-sha256";
/// Header carrying an STS session token.
pub const X_AMZ_SECURITY_TOKEN: &str = "x-amz-security-token";
/// Header carrying an S3 Express session token.
pub const X_AMZ_S3SESSION_TOKEN: &str = "x-amz-s3session-token";
/// Header carrying the signature.
pub const AUTHORIZATION: &str = "authorization";

/// Headers left out of the signature because intermediaries change them.
const UNSIGNED_HEADERS: [&str; 4] = [
    "expect",
    "transfer-encoding",
    "user-agent",
    "x-amzn-trace-id",
];
/// Headers the signer produces itself; callers may not supply them.
const RESERVED_HEADERS: [&str; 6] = [
    "host",
    AUTHORIZATION,
    X_AMZ_DATE,
    X_AMZ_CONTENT_SHA256,
    X_AMZ_SECURITY_TOKEN,
    X_AMZ_S3SESSION_TOKEN,
];

/// Derived signing keys kept per [`Signer`]. One process talks to a handful of
/// (credentials, region, service) combinations: the bucket's IAM identity for
/// `s3` and `s3express`, plus one S3 Express session per directory bucket.
pub const SIGNING_KEY_CACHE_SLOTS: usize = 8;

/// What goes into the payload-hash line and `x-amz-content-sha256`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum PayloadHash<'a> {
    /// `UNSIGNED-PAYLOAD`: the body is not covered by the signature (what
    /// lmcache's CRT client sends for every request).
    Unsigned,
    /// A precomputed hex SHA-256 of the body (64 lowercase hex digits).
    Sha256Hex(&'a str),
    /// The body itself; the signer hashes it.
    Body(&'a [u8]),
}

impl fmt::Debug for PayloadHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PayloadHash::Unsigned => f.write_str("Unsigned"),
            PayloadHash::Sha256Hex(hex) => write!(f, "Sha256Hex({hex})"),
            PayloadHash::Body(body) => write!(f, "Body({} bytes)", body.len()),
        }
    }
}

/// Which header carries the credentials' session token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionTokenHeader {
    /// `x-amz-security-token` (STS credentials; every normal request and
    /// CreateSession).
    SecurityToken,
    /// `x-amz-s3session-token` (S3 Express data plane with session
    /// credentials).
    S3Session,
}

impl SessionTokenHeader {
    /// The lowercase header name.
    pub fn name(self) -> &'static str {
        match self {
            SessionTokenHeader::SecurityToken => X_AMZ_SECURITY_TOKEN,
            SessionTokenHeader::S3Session => X_AMZ_S3SESSION_TOKEN,
        }
    }
}

/// How the path is URI-encoded in the canonical request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathEncoding {
    /// Encode the raw path once (S3).
    Single,
    /// Encode the raw path, then encode the result again, so `%` becomes
    /// `%25` (most non-S3 services, which do not decode the path before
    /// checking the signature).
    Double,
}

/// Signing rules. Every field documents its S3 value; [`Default`] is
/// [`SigningSettings::s3`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigningSettings {
    /// Remove empty, `.` and `..` path segments before encoding (RFC 3986
    /// dot-segment removal). S3: `false`; S3 keys may contain any of these.
    pub normalize_path: bool,
    /// Path encoding. S3: [`PathEncoding::Single`].
    pub path_encoding: PathEncoding,
    /// Send and sign `x-amz-content-sha256`. S3: `true` (S3 rejects requests
    /// without it).
    pub content_sha256_header: bool,
    /// Header for the session token. S3: [`SessionTokenHeader::SecurityToken`].
    pub session_token_header: SessionTokenHeader,
    /// Sign the session-token header. S3: `true`. When `false` the header is
    /// still returned but is not part of the signature (a few non-S3
    /// services want it that way).
    pub sign_session_token: bool,
}

impl SigningSettings {
    /// The rules for S3 (service `s3`) and for CreateSession (service
    /// `s3express`, IAM credentials).
    pub fn s3() -> SigningSettings {
        SigningSettings {
            normalize_path: false,
            path_encoding: PathEncoding::Single,
            content_sha256_header: true,
            session_token_header: SessionTokenHeader::SecurityToken,
            sign_session_token: true,
        }
    }

    /// S3 Express data-plane requests (service `s3express`, session
    /// credentials): as [`SigningSettings::s3`] with the token in
    /// `x-amz-s3session-token`.
    pub fn s3_express_data_plane() -> SigningSettings {
        SigningSettings {
            session_token_header: SessionTokenHeader::S3Session,
            ..SigningSettings::s3()
        }
    }

    /// Generic SigV4 for other AWS services: normalised path, double
    /// encoding, no `x-amz-content-sha256`.
    pub fn general() -> SigningSettings {
        SigningSettings {
            normalize_path: true,
            path_encoding: PathEncoding::Double,
            content_sha256_header: false,
            session_token_header: SessionTokenHeader::SecurityToken,
            sign_session_token: true,
        }
    }
}

impl Default for SigningSettings {
    fn default() -> Self {
        SigningSettings::s3()
    }
}

/// The request to sign. Nothing is encoded yet: the signer encodes `path` and
/// `query`, and the caller must send exactly that encoding (see
/// [`encode_path`] and [`encode_query_component`]).
#[derive(Debug, Clone, Copy)]
pub struct SignableRequest<'a> {
    /// HTTP method, e.g. `GET`.
    pub method: &'a str,
    /// The `Host` header value exactly as it will be sent (with the port if
    /// one is sent).
    pub host: &'a str,
    /// The raw (not percent-encoded) path, starting with `/`, e.g.
    /// `/model@0000001a@0@abcd`. An empty path means `/`.
    pub path: &'a str,
    /// Raw query pairs; a parameter without a value (`?uploads`) has value
    /// `""`.
    pub query: &'a [(&'a str, &'a str)],
    /// Extra headers to sign, as (name, value); any case for the name.
    pub headers: &'a [(&'a str, &'a str)],
    /// Payload hash mode.
    pub payload: PayloadHash<'a>,
}

/// When the request is signed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SigningTime {
    /// Seconds since the Unix epoch (UTC).
    UnixSecs(u64),
    /// A wall-clock instant (sub-second part dropped).
    System(SystemTime),
}

impl SigningTime {
    /// The current wall-clock time.
    pub fn now() -> SigningTime {
        SigningTime::System(SystemTime::now())
    }

    fn amz_date(self) -> Result<AmzDate, TimeError> {
        match self {
            SigningTime::UnixSecs(secs) => AmzDate::from_unix_secs(secs),
            SigningTime::System(time) => AmzDate::from_system_time(time),
        }
    }
}

/// Who signs, where, and when.
#[derive(Debug, Clone, Copy)]
pub struct SigningParams<'a> {
    /// The signing identity.
    pub credentials: &'a Credentials,
    /// Region in the credential scope, e.g. `us-east-1`.
    pub region: &'a str,
    /// Service in the credential scope: `s3` or `s3express`.
    pub service: &'a str,
    /// Request time.
    pub time: SigningTime,
    /// Rules.
    pub settings: &'a SigningSettings,
}

/// Why a request could not be signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignError {
    /// The method is empty or not an HTTP token.
    InvalidMethod(String),
    /// The host is empty or contains whitespace or control characters.
    InvalidHost(String),
    /// The path does not start with `/`.
    PathNotAbsolute(String),
    /// A header name is empty or not an HTTP token.
    InvalidHeaderName(String),
    /// A header value contains CR, LF or another control character (only
    /// horizontal tab is allowed).
    InvalidHeaderValue {
        /// The header's name.
        name: String,
    },
    /// The caller passed a header the signer produces itself.
    ReservedHeader(String),
    /// `PayloadHash::Sha256Hex` was not 64 lowercase hex digits.
    InvalidPayloadHash(String),
    /// Region or service is empty or contains `/`, whitespace or control
    /// characters.
    InvalidScope {
        /// `"region"` or `"service"`.
        field: &'static str,
        /// The value given.
        value: String,
    },
    /// The session token cannot be sent as a header value.
    InvalidSessionToken,
    /// The signing time cannot be formatted.
    Time(TimeError),
}

impl fmt::Display for SignError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SignError::InvalidMethod(m) => write!(f, "invalid HTTP method {m:?}"),
            SignError::InvalidHost(h) => write!(f, "invalid Host header value {h:?}"),
            SignError::PathNotAbsolute(p) => {
                write!(f, "request path {p:?} does not start with '/'")
            }
            SignError::InvalidHeaderName(n) => write!(f, "invalid header name {n:?}"),
            SignError::InvalidHeaderValue { name } => {
                write!(
                    f,
                    "header {name:?} has a value with CR, LF or control characters"
                )
            }
            SignError::ReservedHeader(n) => {
                write!(
                    f,
                    "header {n:?} is produced by the signer and may not be passed in"
                )
            }
            SignError::InvalidPayloadHash(h) => {
                write!(f, "payload hash {h:?} is not 64 lowercase hex digits")
            }
            SignError::InvalidScope { field, value } => {
                write!(f, "invalid signing {field} {value:?}")
            }
            SignError::InvalidSessionToken => {
                write!(
                    f,
                    "session token contains characters not allowed in a header value"
                )
            }
            SignError::Time(e) => write!(f, "cannot format signing time: {e}"),
        }
    }
}

impl std::error::Error for SignError {}

/// Lowercase hex of `bytes` into `out` (`out.len() == 2 * bytes.len()`).
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    assert_eq!(out.len(), bytes.len() * 2);
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = DIGITS[usize::from(b >> 4)];
        out[2 * i + 1] = DIGITS[usize::from(b & 0x0f)];
    }
}

/// A hex SHA-256 digest, 64 lowercase ASCII digits, on the stack.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sha256Hex([u8; 64]);

impl Sha256Hex {
    /// Hashes `data`.
    pub fn of(data: &[u8]) -> Sha256Hex {
        Sha256Hex::from_digest(digest::digest(&digest::SHA256, data).as_ref())
    }

    fn from_digest(digest: &[u8]) -> Sha256Hex {
        let mut out = [0u8; 64];
        hex_into(digest, &mut out);
        Sha256Hex(out)
    }

    /// The hex text.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl fmt::Debug for Sha256Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256Hex({})", self.as_str())
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~')
}

fn push_encoded(out: &mut String, raw: &str, keep_slash: bool) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in raw.as_bytes() {
        if is_unreserved(b) || (keep_slash && b == b'/') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
    }
}

/// Appends the S3 encoding of a raw path (every byte outside
/// `A-Za-z0-9-_.~/` as `%XX`). This is the path to put on the wire.
pub fn encode_path(raw_path: &str, out: &mut String) {
    push_encoded(out, raw_path, true);
}

/// Appends the encoding of a query key or value (as [`encode_path`], and `/`
/// is encoded too).
pub fn encode_query_component(raw: &str, out: &mut String) {
    push_encoded(out, raw, false);
}

/// Appends the encoded query string (`k=v&k=v`, no leading `?`) for `query`
/// in the order given; sorting is only needed for the canonical form, servers
/// accept any order.
pub fn encode_query(query: &[(&str, &str)], out: &mut String) {
    for (i, (key, value)) in query.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        encode_query_component(key, out);
        out.push('=');
        encode_query_component(value, out);
    }
}

/// Appends `path` with empty, `.` and `..` segments removed. A trailing
/// slash (or a trailing `.`/`..` segment) is kept as a trailing slash.
fn normalize_path_into(path: &str, out: &mut String) {
    let base = out.len();
    let mut segments = 0usize;
    let mut ends_with_dir = false;
    for segment in path.split('/').skip(1) {
        ends_with_dir = matches!(segment, "" | "." | "..");
        match segment {
            "" | "." => {}
            ".." => {
                if segments > 0 {
                    let cut = out[base..].rfind('/').expect("a segment was pushed") + base;
                    out.truncate(cut);
                    segments -= 1;
                }
            }
            _ => {
                out.push('/');
                out.push_str(segment);
                segments += 1;
            }
        }
    }
    if segments == 0 || ends_with_dir {
        out.push('/');
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'!' | b'#'
                | b'$'
                | b'%'
                | b'&'
                | b'\''
                | b'*'
                | b'+'
                | b'-'
                | b'.'
                | b'^'
                | b'_'
                | b'`'
                | b'|'
                | b'~'
        )
}

fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

/// Header values may hold visible ASCII, spaces, tabs and non-ASCII UTF-8.
fn is_valid_header_value(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// Appends `value` trimmed, with every run of spaces and tabs as one space.
fn push_normalized_value(out: &mut String, value: &str) {
    let mut wrote = false;
    for part in value.split([' ', '\t']).filter(|p| !p.is_empty()) {
        if wrote {
            out.push(' ');
        }
        out.push_str(part);
        wrote = true;
    }
}

fn validate_scope(field: &'static str, value: &str) -> Result<(), SignError> {
    let ok = !value.is_empty() && value.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
    if ok {
        Ok(())
    } else {
        Err(SignError::InvalidScope {
            field,
            value: value.to_owned(),
        })
    }
}

/// One derived key: HMAC chain over ("AWS4" + secret, date, region, service,
/// "aws4_request").
struct CachedKey {
    secret_fingerprint: [u8; 32],
    date: [u8; 8],
    region: String,
    service: String,
    key: hmac::Key,
    last_used: u64,
}

/// Counters a signer keeps; visible so the key cache can be checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SignerStats {
    /// Requests signed.
    pub signs: u64,
    /// Signing keys derived (cache misses).
    pub key_derivations: u64,
    /// Cache entries replaced because all slots were in use.
    pub key_evictions: u64,
}

/// A header of the canonical request: byte ranges into the signer's arena.
#[derive(Clone)]
struct HeaderSlot {
    name: Range<usize>,
    value: Range<usize>,
}

/// A query pair of the canonical request: ranges into the arena.
#[derive(Clone)]
struct QuerySlot {
    key: Range<usize>,
    value: Range<usize>,
}

/// Signs requests into reusable buffers. One per executor; not shared.
///
/// [`Signer::sign`] returns a [`SignedRequest`] that borrows the buffers until
/// the next call.
pub struct Signer {
    keys: Vec<CachedKey>,
    clock: u64,
    stats: SignerStats,
    /// Lowercased header names, normalised header values, encoded query pairs.
    arena: String,
    headers: Vec<HeaderSlot>,
    query: Vec<QuerySlot>,
    path: String,
    canonical: String,
    signed_headers: String,
    string_to_sign: String,
    authorization: String,
    content_sha256: String,
    amz_date: String,
    signature: [u8; 64],
}

impl Default for Signer {
    fn default() -> Self {
        Signer::new()
    }
}

impl fmt::Debug for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Derived keys are secret-equivalent for their day: only scopes shown.
        let scopes: Vec<String> = self
            .keys
            .iter()
            .map(|k| {
                format!(
                    "{}/{}/{}",
                    String::from_utf8_lossy(&k.date),
                    k.region,
                    k.service
                )
            })
            .collect();
        f.debug_struct("Signer")
            .field("stats", &self.stats)
            .field("cached_key_scopes", &scopes)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// A signer with empty buffers and an empty key cache.
    pub fn new() -> Signer {
        Signer {
            keys: Vec::with_capacity(SIGNING_KEY_CACHE_SLOTS),
            clock: 0,
            stats: SignerStats::default(),
            arena: String::with_capacity(1024),
            headers: Vec::with_capacity(16),
            query: Vec::with_capacity(8),
            path: String::with_capacity(256),
            canonical: String::with_capacity(1024),
            signed_headers: String::with_capacity(128),
            string_to_sign: String::with_capacity(160),
            authorization: String::with_capacity(256),
            content_sha256: String::with_capacity(64),
            amz_date: String::with_capacity(16),
            signature: [0; 64],
        }
    }

    /// Counters since creation.
    pub fn stats(&self) -> SignerStats {
        self.stats
    }

    /// Signs `req`. The result borrows this signer's buffers and the
    /// credentials until the next call.
    pub fn sign<'s>(
        &'s mut self,
        req: &SignableRequest<'_>,
        params: &SigningParams<'s>,
    ) -> Result<SignedRequest<'s>, SignError> {
        let settings = params.settings;
        let creds = params.credentials;
        if !is_token(req.method) {
            return Err(SignError::InvalidMethod(req.method.to_owned()));
        }
        if req.host.is_empty() || !req.host.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(SignError::InvalidHost(req.host.to_owned()));
        }
        if !req.path.is_empty() && !req.path.starts_with('/') {
            return Err(SignError::PathNotAbsolute(req.path.to_owned()));
        }
        validate_scope("region", params.region)?;
        validate_scope("service", params.service)?;
        let token = creds.session_token();
        if let Some(token) = token {
            if !is_valid_header_value(token) || token.trim() != token || token.is_empty() {
                return Err(SignError::InvalidSessionToken);
            }
        }
        let amz_date = params.time.amz_date().map_err(SignError::Time)?;

        // Payload hash.
        self.content_sha256.clear();
        match req.payload {
            PayloadHash::Unsigned => self.content_sha256.push_str(UNSIGNED_PAYLOAD),
            PayloadHash::Sha256Hex(hex) => {
                let ok = hex.len() == 64
                    && hex
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
                if !ok {
                    return Err(SignError::InvalidPayloadHash(hex.to_owned()));
                }
                self.content_sha256.push_str(hex);
            }
            PayloadHash::Body(body) => self.content_sha256.push_str(Sha256Hex::of(body).as_str()),
        }
        self.amz_date.clear();
        self.amz_date.push_str(amz_date.as_str());

        // Headers: collect, lowercase, normalise, add ours, sort.
        self.arena.clear();
        self.headers.clear();
        for &(name, value) in req.headers {
            if !is_token(name) {
                return Err(SignError::InvalidHeaderName(name.to_owned()));
            }
            if !is_valid_header_value(value) {
                return Err(SignError::InvalidHeaderValue {
                    name: name.to_owned(),
                });
            }
            if RESERVED_HEADERS
                .iter()
                .any(|r| name.eq_ignore_ascii_case(r))
            {
                return Err(SignError::ReservedHeader(name.to_owned()));
            }
            if UNSIGNED_HEADERS
                .iter()
                .any(|u| name.eq_ignore_ascii_case(u))
            {
                continue;
            }
            let start = self.arena.len();
            for c in name.bytes() {
                self.arena.push(char::from(c.to_ascii_lowercase()));
            }
            let name_range = start..self.arena.len();
            let start = self.arena.len();
            push_normalized_value(&mut self.arena, value);
            let value_range = start..self.arena.len();
            self.headers.push(HeaderSlot {
                name: name_range,
                value: value_range,
            });
        }
        self.push_fixed_header("host", req.host);
        self.push_fixed_header(X_AMZ_DATE, amz_date.as_str());
        if settings.content_sha256_header {
            let start = self.arena.len();
            self.arena.push_str(X_AMZ_CONTENT_SHA256);
            let name = start..self.arena.len();
            let start = self.arena.len();
            self.arena.push_str(&self.content_sha256);
            let value = start..self.arena.len();
            self.headers.push(HeaderSlot { name, value });
        }
        if let (Some(token), true) = (token, settings.sign_session_token) {
            self.push_fixed_header(settings.session_token_header.name(), token);
        }
        {
            let arena = &self.arena;
            // Stable: repeated names keep the caller's order.
            self.headers
                .sort_by(|a, b| arena[a.name.clone()].cmp(&arena[b.name.clone()]));
        }

        // Query: encode each pair, sort on the encoded text.
        self.query.clear();
        for &(key, value) in req.query {
            let start = self.arena.len();
            encode_query_component(key, &mut self.arena);
            let key_range = start..self.arena.len();
            let start = self.arena.len();
            encode_query_component(value, &mut self.arena);
            let value_range = start..self.arena.len();
            self.query.push(QuerySlot {
                key: key_range,
                value: value_range,
            });
        }
        {
            let arena = &self.arena;
            self.query.sort_by(|a, b| {
                arena[a.key.clone()]
                    .cmp(&arena[b.key.clone()])
                    .then_with(|| arena[a.value.clone()].cmp(&arena[b.value.clone()]))
            });
        }

        // Path.
        self.path.clear();
        let raw_path = if req.path.is_empty() { "/" } else { req.path };
        if settings.normalize_path {
            // Normalise into `canonical` (used here as scratch), encode from it.
            self.canonical.clear();
            normalize_path_into(raw_path, &mut self.canonical);
            encode_path(&self.canonical, &mut self.path);
        } else {
            encode_path(raw_path, &mut self.path);
        }
        if settings.path_encoding == PathEncoding::Double {
            self.canonical.clear();
            self.canonical.push_str(&self.path);
            self.path.clear();
            encode_path(&self.canonical, &mut self.path);
        }

        // Canonical request.
        let c = &mut self.canonical;
        c.clear();
        c.push_str(req.method);
        c.push('\n');
        c.push_str(&self.path);
        c.push('\n');
        for (i, q) in self.query.iter().enumerate() {
            if i > 0 {
                c.push('&');
            }
            c.push_str(&self.arena[q.key.clone()]);
            c.push('=');
            c.push_str(&self.arena[q.value.clone()]);
        }
        c.push('\n');
        self.signed_headers.clear();
        let mut previous: Option<&str> = None;
        for h in &self.headers {
            let name = &self.arena[h.name.clone()];
            if previous == Some(name) {
                c.push(',');
            } else {
                if previous.is_some() {
                    c.push('\n');
                    self.signed_headers.push(';');
                }
                c.push_str(name);
                c.push(':');
                self.signed_headers.push_str(name);
                previous = Some(name);
            }
            c.push_str(&self.arena[h.value.clone()]);
        }
        c.push('\n');
        c.push('\n');
        c.push_str(&self.signed_headers);
        c.push('\n');
        c.push_str(&self.content_sha256);

        // String to sign.
        let creq_hash = Sha256Hex::of(self.canonical.as_bytes());
        let s = &mut self.string_to_sign;
        s.clear();
        s.push_str(ALGORITHM);
        s.push('\n');
        s.push_str(amz_date.as_str());
        s.push('\n');
        push_scope(s, amz_date.date(), params.region, params.service);
        s.push('\n');
        s.push_str(creq_hash.as_str());

        // Signature.
        let slot = self.signing_key(creds, amz_date, params.region, params.service);
        let tag = hmac::sign(&self.keys[slot].key, self.string_to_sign.as_bytes());
        hex_into(tag.as_ref(), &mut self.signature);
        let signature = std::str::from_utf8(&self.signature).expect("hex is ASCII");

        let a = &mut self.authorization;
        a.clear();
        a.push_str(ALGORITHM);
        a.push_str(" Credential=");
        a.push_str(creds.access_key_id());
        a.push('/');
        push_scope(a, amz_date.date(), params.region, params.service);
        a.push_str(", SignedHeaders=");
        a.push_str(&self.signed_headers);
        a.push_str(", Signature=");
        a.push_str(signature);

        self.stats.signs += 1;
        Ok(SignedRequest {
            amz_date: &self.amz_date,
            content_sha256: &self.content_sha256,
            content_sha256_header: settings.content_sha256_header,
            session_token: token.map(|t| (settings.session_token_header.name(), t)),
            authorization: &self.authorization,
            signature,
            signed_headers: &self.signed_headers,
            canonical_request: &self.canonical,
            string_to_sign: &self.string_to_sign,
        })
    }

    fn push_fixed_header(&mut self, name: &str, value: &str) {
        let start = self.arena.len();
        self.arena.push_str(name);
        let name = start..self.arena.len();
        let start = self.arena.len();
        push_normalized_value(&mut self.arena, value);
        let value = start..self.arena.len();
        self.headers.push(HeaderSlot { name, value });
    }

    /// Index of the cached signing key for this scope, deriving it on a miss.
    fn signing_key(
        &mut self,
        creds: &Credentials,
        amz_date: AmzDate,
        region: &str,
        service: &str,
    ) -> usize {
        self.clock += 1;
        let mut date = [0u8; 8];
        date.copy_from_slice(amz_date.date().as_bytes());
        let fingerprint = creds.secret_fingerprint();
        if let Some(i) = self.keys.iter().position(|k| {
            k.secret_fingerprint == *fingerprint
                && k.date == date
                && k.region == region
                && k.service == service
        }) {
            self.keys[i].last_used = self.clock;
            return i;
        }
        self.stats.key_derivations += 1;
        let key = derive_signing_key(creds.secret_access_key(), amz_date.date(), region, service);
        let entry = CachedKey {
            secret_fingerprint: *fingerprint,
            date,
            region: region.to_owned(),
            service: service.to_owned(),
            key,
            last_used: self.clock,
        };
        if self.keys.len() < SIGNING_KEY_CACHE_SLOTS {
            self.keys.push(entry);
            self.keys.len() - 1
        } else {
            self.stats.key_evictions += 1;
            let oldest = self
                .keys
                .iter()
                .enumerate()
                .min_by_key(|(_, k)| k.last_used)
                .map(|(i, _)| i)
                .expect("cache is full, so not empty");
            self.keys[oldest] = entry;
            oldest
        }
    }
}

fn push_scope(out: &mut String, date: &str, region: &str, service: &str) {
    out.push_str(date);
    out.push('/');
    out.push_str(region);
    out.push('/');
    out.push_str(service);
    out.push_str("/aws4_request");
}

/// HMAC chain `kDate = HMAC("AWS4" + secret, date)`, then region, service and
/// `aws4_request`.
fn derive_signing_key(secret: &str, date: &str, region: &str, service: &str) -> hmac::Key {
    let mut seed = Vec::with_capacity(4 + secret.len());
    seed.extend_from_slice(b"AWS4");
    seed.extend_from_slice(secret.as_bytes());
    let k_date = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, &seed), date.as_bytes());
    seed.iter_mut().for_each(|b| *b = 0);
    let k_region = hmac::sign(
        &hmac::Key::new(hmac::HMAC_SHA256, k_date.as_ref()),
        region.as_bytes(),
    );
    let k_service = hmac::sign(
        &hmac::Key::new(hmac::HMAC_SHA256, k_region.as_ref()),
        service.as_bytes(),
    );
    let k_signing = hmac::sign(
        &hmac::Key::new(hmac::HMAC_SHA256, k_service.as_ref()),
        b"aws4_request",
    );
    hmac::Key::new(hmac::HMAC_SHA256, k_signing.as_ref())
}

/// The result of [`Signer::sign`]: the headers to add to the request, and the
/// intermediate texts for debugging and tests. Borrows the signer's buffers.
#[derive(Clone, Copy)]
pub struct SignedRequest<'s> {
    amz_date: &'s str,
    content_sha256: &'s str,
    content_sha256_header: bool,
    session_token: Option<(&'static str, &'s str)>,
    authorization: &'s str,
    signature: &'s str,
    signed_headers: &'s str,
    canonical_request: &'s str,
    string_to_sign: &'s str,
}

impl<'s> SignedRequest<'s> {
    /// The headers to add, as (lowercase name, value): `x-amz-date`,
    /// `x-amz-content-sha256` (when enabled), the session-token header (when
    /// the credentials carry a token) and `authorization`. The `Host` header
    /// must be sent exactly as given to the signer.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &'s str)> + '_ {
        let content = self
            .content_sha256_header
            .then_some((X_AMZ_CONTENT_SHA256, self.content_sha256));
        [
            Some((X_AMZ_DATE, self.amz_date)),
            content,
            self.session_token,
            Some((AUTHORIZATION, self.authorization)),
        ]
        .into_iter()
        .flatten()
    }

    /// `x-amz-date` value.
    pub fn amz_date(&self) -> &'s str {
        self.amz_date
    }

    /// The payload hash line (`x-amz-content-sha256` value).
    pub fn content_sha256(&self) -> &'s str {
        self.content_sha256
    }

    /// (header name, token) when the credentials carry a session token.
    pub fn session_token_header(&self) -> Option<(&'static str, &'s str)> {
        self.session_token
    }

    /// `authorization` value.
    pub fn authorization(&self) -> &'s str {
        self.authorization
    }

    /// The hex signature.
    pub fn signature(&self) -> &'s str {
        self.signature
    }

    /// `;`-joined signed header names.
    pub fn signed_headers(&self) -> &'s str {
        self.signed_headers
    }

    /// The canonical request. Contains the session token when one is signed:
    /// do not log it.
    pub fn canonical_request(&self) -> &'s str {
        self.canonical_request
    }

    /// The string to sign.
    pub fn string_to_sign(&self) -> &'s str {
        self.string_to_sign
    }
}

impl fmt::Debug for SignedRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignedRequest")
            .field("amz_date", &self.amz_date)
            .field("content_sha256", &self.content_sha256)
            .field(
                "session_token_header",
                &self.session_token.map(|(name, _)| (name, "<redacted>")),
            )
            .field("authorization", &self.authorization)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(token: Option<&str>) -> Credentials {
        Credentials::new(
            "AKIDEXAMPLE",
            "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            token.map(str::to_owned),
            None,
        )
        .unwrap()
    }

    /// (canonical request, signature, headers to add).
    type Outcome = (String, String, Vec<(String, String)>);

    fn sign_one(
        signer: &mut Signer,
        creds: &Credentials,
        settings: &SigningSettings,
        req: &SignableRequest<'_>,
        service: &str,
        secs: u64,
    ) -> Result<Outcome, SignError> {
        let params = SigningParams {
            credentials: creds,
            region: "us-east-1",
            service,
            time: SigningTime::UnixSecs(secs),
            settings,
        };
        let signed = signer.sign(req, &params)?;
        Ok((
            signed.canonical_request().to_owned(),
            signed.signature().to_owned(),
            signed
                .headers()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        ))
    }

    fn request<'a>(
        path: &'a str,
        query: &'a [(&'a str, &'a str)],
        headers: &'a [(&'a str, &'a str)],
    ) -> SignableRequest<'a> {
        SignableRequest {
            method: "GET",
            host: "bucket.example.com:9000",
            path,
            query,
            headers,
            payload: PayloadHash::Unsigned,
        }
    }

    #[test]
    fn encodes_s3_paths_once() {
        let mut out = String::new();
        encode_path("/a b/c@d%2F~é/..//x?y#z+", &mut out);
        assert_eq!(out, "/a%20b/c%40d%252F~%C3%A9/..//x%3Fy%23z%2B");
        out.clear();
        encode_query_component("a/b=c&d", &mut out);
        assert_eq!(out, "a%2Fb%3Dc%26d");
        out.clear();
        encode_query(
            &[("list-type", "2"), ("continuation-token", "1/A+b=")],
            &mut out,
        );
        assert_eq!(out, "list-type=2&continuation-token=1%2FA%2Bb%3D");
    }

    #[test]
    fn normalizes_paths_like_rfc3986() {
        let norm = |p: &str| {
            let mut out = String::new();
            normalize_path_into(p, &mut out);
            out
        };
        assert_eq!(norm("/"), "/");
        assert_eq!(norm("//example//"), "/example/");
        assert_eq!(norm("/example1/example2/../.."), "/");
        assert_eq!(norm("/example/.."), "/");
        assert_eq!(norm("/./example"), "/example");
        assert_eq!(norm("/a/b/.."), "/a/");
        assert_eq!(norm("/a/./b/."), "/a/b/");
        assert_eq!(norm("/../a"), "/a");
    }

    #[test]
    fn header_values_are_trimmed_and_collapsed() {
        let mut out = String::new();
        for (input, want) in [
            ("  a   b \t c  ", "a b c"),
            ("", ""),
            ("   ", ""),
            ("x", "x"),
            ("\"a   b\"", "\"a b\""),
        ] {
            out.clear();
            push_normalized_value(&mut out, input);
            assert_eq!(out, want, "input {input:?}");
        }
    }

    #[test]
    fn canonical_request_has_s3_shape() {
        let mut signer = Signer::new();
        let c = creds(None);
        let req = SignableRequest {
            method: "PUT",
            host: "bucket.example.com:9000",
            path: "/model@0000001a@0@ab cd",
            query: &[("uploadId", "x/y"), ("partNumber", "3")],
            headers: &[
                ("Content-Type", " application/octet-stream "),
                ("X-Amz-Meta-A", "2"),
                ("x-amz-meta-a", "1"),
                ("User-Agent", "not signed"),
            ],
            payload: PayloadHash::Body(b"hello"),
        };
        let (creq, _, headers) = sign_one(
            &mut signer,
            &c,
            &SigningSettings::s3(),
            &req,
            "s3",
            1_440_938_160,
        )
        .unwrap();
        let body_hash = Sha256Hex::of(b"hello");
        let want = format!(
            "PUT\n/model%400000001a%400%40ab%20cd\npartNumber=3&uploadId=x%2Fy\n\
             content-type:application/octet-stream\nhost:bucket.example.com:9000\n\
             x-amz-content-sha256:{h}\nx-amz-date:20150830T123600Z\nx-amz-meta-a:2,1\n\n\
             content-type;host;x-amz-content-sha256;x-amz-date;x-amz-meta-a\n{h}",
            h = body_hash.as_str()
        );
        assert_eq!(creq, want);
        let names: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, [X_AMZ_DATE, X_AMZ_CONTENT_SHA256, AUTHORIZATION]);
    }

    #[test]
    fn token_header_depends_on_settings() {
        let mut signer = Signer::new();
        let c = creds(Some("TOKEN"));
        let req = request("/k", &[], &[]);
        let (creq, _, headers) =
            sign_one(&mut signer, &c, &SigningSettings::s3(), &req, "s3", 0).unwrap();
        assert!(creq.contains("\nx-amz-security-token:TOKEN\n"));
        assert!(headers.contains(&(X_AMZ_SECURITY_TOKEN.into(), "TOKEN".into())));
        assert!(!creq.contains(X_AMZ_S3SESSION_TOKEN));

        let express = SigningSettings::s3_express_data_plane();
        let (creq, _, headers) = sign_one(&mut signer, &c, &express, &req, "s3express", 0).unwrap();
        assert!(creq.contains("\nx-amz-s3session-token:TOKEN\n"));
        assert!(creq.ends_with(
            "host;x-amz-content-sha256;x-amz-date;x-amz-s3session-token\nUNSIGNED-PAYLOAD"
        ));
        assert!(headers.iter().all(|(k, _)| k != X_AMZ_SECURITY_TOKEN));
        assert!(headers.contains(&(X_AMZ_S3SESSION_TOKEN.into(), "TOKEN".into())));

        let unsigned_token = SigningSettings {
            sign_session_token: false,
            ..SigningSettings::s3()
        };
        let (creq, _, headers) = sign_one(&mut signer, &c, &unsigned_token, &req, "s3", 0).unwrap();
        assert!(!creq.contains("TOKEN"));
        assert!(headers.contains(&(X_AMZ_SECURITY_TOKEN.into(), "TOKEN".into())));
    }

    #[test]
    fn rejects_bad_input() {
        let mut signer = Signer::new();
        let c = creds(None);
        let s3 = SigningSettings::s3();
        let run = |signer: &mut Signer, req: SignableRequest<'_>| {
            sign_one(signer, &c, &s3, &req, "s3", 0).map(|_| ())
        };
        let ok = request("/k", &[], &[]);
        assert!(run(&mut signer, ok).is_ok());
        for reserved in [
            "Host",
            "Authorization",
            "X-Amz-Date",
            "x-amz-content-sha256",
            "X-Amz-Security-Token",
            "x-amz-s3session-token",
        ] {
            let headers = [(reserved, "v")];
            assert_eq!(
                run(&mut signer, request("/k", &[], &headers)),
                Err(SignError::ReservedHeader(reserved.to_owned()))
            );
        }
        let headers = [("bad name", "v")];
        assert!(matches!(
            run(&mut signer, request("/k", &[], &headers)),
            Err(SignError::InvalidHeaderName(_))
        ));
        let headers = [("x-amz-meta-a", "line\r\nInjected: 1")];
        assert!(matches!(
            run(&mut signer, request("/k", &[], &headers)),
            Err(SignError::InvalidHeaderValue { .. })
        ));
        assert!(matches!(
            run(&mut signer, request("k", &[], &[])),
            Err(SignError::PathNotAbsolute(_))
        ));
        assert!(matches!(
            run(
                &mut signer,
                SignableRequest {
                    method: "G ET",
                    ..ok
                }
            ),
            Err(SignError::InvalidMethod(_))
        ));
        assert!(matches!(
            run(&mut signer, SignableRequest { host: "a b", ..ok }),
            Err(SignError::InvalidHost(_))
        ));
        assert!(matches!(
            run(
                &mut signer,
                SignableRequest {
                    payload: PayloadHash::Sha256Hex("ABC"),
                    ..ok
                }
            ),
            Err(SignError::InvalidPayloadHash(_))
        ));
        let params = SigningParams {
            credentials: &c,
            region: "us east",
            service: "s3",
            time: SigningTime::UnixSecs(0),
            settings: &s3,
        };
        assert!(matches!(
            signer.sign(&ok, &params),
            Err(SignError::InvalidScope {
                field: "region",
                ..
            })
        ));
        // Credentials refuse such a token up front; the signer checks again.
        assert!(Credentials::new("AK", "SK", Some("a\nb".to_owned()), None).is_err());
    }

    #[test]
    fn signing_key_is_derived_once_per_scope() {
        let mut signer = Signer::new();
        let c = creds(None);
        let other = Credentials::new("AKIDEXAMPLE", "another-secret", None, None).unwrap();
        let s3 = SigningSettings::s3();
        let req = request("/k", &[], &[]);
        let day = 86_400;
        for i in 0..100 {
            sign_one(&mut signer, &c, &s3, &req, "s3", 10 * day + i).unwrap();
        }
        assert_eq!(signer.stats().key_derivations, 1);
        sign_one(&mut signer, &c, &s3, &req, "s3express", 10 * day).unwrap();
        sign_one(&mut signer, &c, &s3, &req, "s3", 11 * day).unwrap();
        // Same access key id, different secret: a different key.
        let (_, sig_other, _) = sign_one(&mut signer, &other, &s3, &req, "s3", 11 * day).unwrap();
        let (_, sig_c, _) = sign_one(&mut signer, &c, &s3, &req, "s3", 11 * day).unwrap();
        assert_ne!(sig_other, sig_c);
        assert_eq!(signer.stats().key_derivations, 4);
        // More scopes than slots: the least recently used is replaced, results
        // stay correct.
        for d in 0..(SIGNING_KEY_CACHE_SLOTS as u64 + 3) {
            sign_one(&mut signer, &c, &s3, &req, "s3", (20 + d) * day).unwrap();
        }
        assert!(signer.stats().key_evictions > 0);
        let (_, again, _) = sign_one(&mut signer, &c, &s3, &req, "s3", 11 * day).unwrap();
        assert_eq!(again, sig_c);
        assert_eq!(
            signer.stats().signs,
            100 + 4 + SIGNING_KEY_CACHE_SLOTS as u64 + 3 + 1
        );
    }

    #[test]
    fn debug_output_hides_secrets() {
        let mut signer = Signer::new();
        let c = creds(Some("SESSIONTOKENVALUE"));
        let s3 = SigningSettings::s3();
        let req = request("/k", &[], &[]);
        let params = SigningParams {
            credentials: &c,
            region: "us-east-1",
            service: "s3",
            time: SigningTime::UnixSecs(0),
            settings: &s3,
        };
        let signed = signer.sign(&req, &params).unwrap();
        let text = format!("{signed:?}");
        assert!(!text.contains("SESSIONTOKENVALUE"), "{text}");
        assert!(text.contains("<redacted>"));
        let text = format!("{signer:?} {params:?}");
        assert!(!text.contains("SESSIONTOKENVALUE"), "{text}");
        assert!(!text.contains("wJalrXUtnFEMI"), "{text}");
    }
}
