//! The S3 client of one shard: signed requests over the connection pool,
//! with deadlines, retries, the circuit breaker and S3 Express sessions.
//!
//! One [`S3Client`] per glommio executor (shard) and bucket. It is `!Send`
//! and must be used on the executor that created it: its connections,
//! signer buffers, credentials and session cache are that shard's alone.
//!
//! Every request is signed with [`crate::sigv4`] (`UNSIGNED-PAYLOAD` by
//! default, as lmcache's CRT client does; [`PayloadSigning::Sha256`] signs
//! the body hash instead), carries `x-amz-content-sha256`, and runs under a
//! per-attempt deadline ([`S3ClientConfig::request_timeout`]) inside the
//! operation's deadline ([`S3ClientConfig::operation_timeout`]).
//!
//! Wire shapes follow the CRT as lmcache uses it: objects above
//! [`S3ClientConfig::multipart_threshold_bytes`] go up as a multipart upload
//! of [`S3ClientConfig::part_size_bytes`] parts, and objects larger than
//! [`S3ClientConfig::get_part_size_bytes`] come down as parallel ranged GETs
//! of that size.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::Method;
use kvshard_io::timeout::with_timeout;

use crate::addressing::{BucketAddress, Scheme, S3EXPRESS_SERVICE, S3_SERVICE};
use crate::breaker::{Breaker, BreakerConfig, BreakerStatus};
use crate::credential_cache::{CredentialsCache, CredentialsRefreshConfig};
use crate::credential_http::FetchConfig;
use crate::credentials::{Credentials, Env};
use crate::error::{classify_status, Cause, ErrorKind, Failure, Op, S3Error};
use crate::express::{CreateSession, ExpressConfig, SessionCache};
use crate::http::{
    ConnectionCounters, EndpointConfig, Head, HttpError, Lease, Outgoing, Pool, Protocol,
    SendError, Slot,
};
use crate::net::{self, ConnectError, TlsTrust};
use crate::region::{RecvRegion, SendRegion, Window};
use crate::retry::{Backoff, Clock, Jitter, RetryBudget, RetryConfig, SystemClock};
use crate::sigv4::{
    encode_path, encode_query, PayloadHash, SignableRequest, Signer, SigningParams,
    SigningSettings, SigningTime,
};
use crate::xml::{self, CompletedPart, ListObjectsV2Page, ListedObject};

/// Content type of object bodies (lmcache sends the same).
pub const OBJECT_CONTENT_TYPE: &str = "application/octet-stream";
/// Largest error or XML response body read, bytes.
pub const MAX_SMALL_BODY_BYTES: usize = xml::MAX_XML_BYTES;
/// Largest error body read, bytes.
pub const MAX_ERROR_BODY_BYTES: usize = 64 << 10;
/// Largest number of parts S3 accepts in one upload.
pub const MAX_PARTS: u64 = xml::MAX_PART_NUMBER as u64;
/// Requests re-sent on a new connection because a pooled one had closed
/// before they were written, per attempt.
pub const MAX_UNSENT_RETRIES: u32 = 2;
pub use crate::credential_cache::CREDENTIALS_REFRESH_MARGIN;

/// Where the signing identity comes from.
#[derive(Clone)]
pub enum CredentialsConfig {
    /// Fixed keys (lmcache's `aws_access_key_id` / `aws_secret_access_key`).
    Static(Credentials),
    /// The provider chain of [`crate::credentials`] over this environment
    /// (environment, profile files, web identity, container endpoint,
    /// IMDSv2): fetched on first use, then refreshed in the background
    /// ahead of the expiry ([`S3ClientConfig::credentials_refresh`]).
    Chain(Env),
}

impl fmt::Debug for CredentialsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CredentialsConfig::Static(c) => f.debug_tuple("Static").field(c).finish(),
            CredentialsConfig::Chain(_) => f.write_str("Chain"),
        }
    }
}

/// The payload hash that is signed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadSigning {
    /// `UNSIGNED-PAYLOAD` (lmcache's CRT; no hashing cost).
    Unsigned,
    /// The hex SHA-256 of each request body (costs one pass over the body).
    Sha256,
}

/// Client settings. [`S3ClientConfig::new`] fills in the documented
/// defaults.
#[derive(Clone)]
pub struct S3ClientConfig {
    /// Where the bucket is ([`crate::addressing::resolve_bucket`]).
    pub address: BucketAddress,
    /// SigV4 region.
    pub region: String,
    /// Signing identity.
    pub credentials: CredentialsConfig,
    /// Offer HTTP/2 (ALPN with TLS, h2c prior knowledge without). Default
    /// true (lmcache `s3_prefer_http2`).
    pub prefer_http2: bool,
    /// Plain HTTP (lmcache `disable_tls`). Must agree with the address's
    /// scheme. Default: from the address.
    pub disable_tls: bool,
    /// Use S3 Express session auth for directory buckets (lmcache
    /// `s3_enable_s3express`). Default false. Ignored for general-purpose
    /// buckets, as the CRT does.
    pub enable_s3express: bool,
    /// Extra trusted roots, PEM. Default: `AWS_CA_BUNDLE` from the process
    /// environment when set.
    pub ca_bundle: Option<PathBuf>,
    /// Trust the operating system's roots too. Default true.
    pub system_roots: bool,
    /// Deadline of one HTTP attempt (connect, send, whole response).
    /// Default 30 s.
    pub request_timeout: Duration,
    /// Deadline of a whole operation, retries and all parts included.
    /// Default 120 s.
    pub operation_timeout: Duration,
    /// Retry policy and budget.
    pub retry: RetryConfig,
    /// Circuit breaker.
    pub breaker: BreakerConfig,
    /// Payload hash mode. Default [`PayloadSigning::Unsigned`].
    pub payload_signing: PayloadSigning,
    /// Objects larger than this go up as multipart uploads. Default 8 MiB
    /// (the CRT's part size, as lmcache runs it).
    pub multipart_threshold_bytes: u64,
    /// Part size of multipart uploads and of ranged GETs. Default 8 MiB. S3
    /// wants at least 5 MiB for every part but the last; it is raised when
    /// an object would need more than 10 000 parts.
    pub part_size_bytes: u64,
    /// Size of the ranged GETs an object larger than this is fetched with.
    /// Default 8 MiB (the CRT uses its part size for both directions).
    pub get_part_size_bytes: u64,
    /// Parts of one object in flight at once. Default 16.
    pub max_parallel_parts: usize,
    /// Requests in flight at once, and HTTP/1.1 connections. Default 64
    /// (lmcache `s3_num_io_threads`).
    pub max_connections: usize,
    /// HTTP/2 connections at most. Default 4.
    pub h2_max_connections: usize,
    /// HTTP/2 streams per connection at most (the server may allow fewer).
    /// Default 100.
    pub h2_max_streams_per_connection: usize,
    /// HTTP/2 initial stream window. Default 8 MiB (one part in flight
    /// without a window update).
    pub h2_stream_window_bytes: u32,
    /// HTTP/2 initial connection window. Default 32 MiB.
    pub h2_connection_window_bytes: u32,
    /// Largest HTTP/2 frame we accept. Default 1 MiB.
    pub h2_max_frame_bytes: u32,
    /// S3 Express session refresh settings.
    pub express: ExpressConfig,
    /// Refresh and fetch settings of [`CredentialsConfig::Chain`]
    /// credentials (the HTTP sources trust [`Self::ca_bundle`] and
    /// [`Self::system_roots`] as S3 does).
    pub credentials_refresh: CredentialsRefreshConfig,
    /// Time as the client sees it: the breaker's cooldowns, the signing
    /// date and S3 Express session expiries (tests inject a manual one).
    /// Default the system clock.
    pub clock: Arc<dyn Clock>,
}

impl fmt::Debug for S3ClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3ClientConfig")
            .field("address", &self.address)
            .field("region", &self.region)
            .field("credentials", &self.credentials)
            .field("prefer_http2", &self.prefer_http2)
            .field("disable_tls", &self.disable_tls)
            .field("enable_s3express", &self.enable_s3express)
            .field("ca_bundle", &self.ca_bundle)
            .field("request_timeout", &self.request_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .field("payload_signing", &self.payload_signing)
            .field("multipart_threshold_bytes", &self.multipart_threshold_bytes)
            .field("part_size_bytes", &self.part_size_bytes)
            .field("get_part_size_bytes", &self.get_part_size_bytes)
            .field("max_parallel_parts", &self.max_parallel_parts)
            .field("max_connections", &self.max_connections)
            .field("credentials_refresh", &self.credentials_refresh)
            .finish_non_exhaustive()
    }
}

// The engine builds configurations on the main thread and hands them to the
// shards.
const _: fn() = || {
    fn is_send<T: Send>() {}
    is_send::<S3ClientConfig>();
};

/// Default part size and multipart threshold.
pub const DEFAULT_PART_SIZE_BYTES: u64 = 8 << 20;

impl S3ClientConfig {
    /// The defaults documented on each field.
    pub fn new(
        address: BucketAddress,
        region: impl Into<String>,
        credentials: CredentialsConfig,
    ) -> S3ClientConfig {
        let disable_tls = address.scheme == Scheme::Http;
        S3ClientConfig {
            address,
            region: region.into(),
            credentials,
            prefer_http2: true,
            disable_tls,
            enable_s3express: false,
            ca_bundle: std::env::var_os("AWS_CA_BUNDLE")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            system_roots: true,
            request_timeout: Duration::from_secs(30),
            operation_timeout: Duration::from_secs(120),
            retry: RetryConfig::default(),
            breaker: BreakerConfig::default(),
            payload_signing: PayloadSigning::Unsigned,
            multipart_threshold_bytes: DEFAULT_PART_SIZE_BYTES,
            part_size_bytes: DEFAULT_PART_SIZE_BYTES,
            get_part_size_bytes: DEFAULT_PART_SIZE_BYTES,
            max_parallel_parts: 16,
            max_connections: 64,
            h2_max_connections: 4,
            h2_max_streams_per_connection: 100,
            h2_stream_window_bytes: 8 << 20,
            h2_connection_window_bytes: 32 << 20,
            h2_max_frame_bytes: 1 << 20,
            express: ExpressConfig::default(),
            credentials_refresh: CredentialsRefreshConfig::default(),
            clock: Arc::new(SystemClock),
        }
    }

    /// Checks the settings; the message names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        if self.disable_tls != (self.address.scheme == Scheme::Http) {
            return bad(format!(
                "disable_tls is {} but the bucket address uses {}",
                self.disable_tls,
                self.address.scheme.as_str()
            ));
        }
        if self.region.is_empty() {
            return bad("region is empty".to_owned());
        }
        if self.request_timeout.is_zero() || self.operation_timeout < self.request_timeout {
            return bad(format!(
                "timeouts must satisfy 0 < request_timeout ({:?}) <= operation_timeout ({:?})",
                self.request_timeout, self.operation_timeout
            ));
        }
        if self.part_size_bytes == 0 || self.get_part_size_bytes == 0 {
            return bad("part_size_bytes and get_part_size_bytes must be positive".to_owned());
        }
        if self.max_parallel_parts == 0 || self.max_connections == 0 {
            return bad("max_parallel_parts and max_connections must be positive".to_owned());
        }
        if self.h2_max_connections == 0 || self.h2_max_streams_per_connection == 0 {
            return bad(
                "h2_max_connections and h2_max_streams_per_connection must be positive".to_owned(),
            );
        }
        self.retry.validate().map_err(ConfigError)?;
        self.breaker.validate().map_err(ConfigError)?;
        self.express.validate().map_err(ConfigError)?;
        self.credentials_refresh.validate().map_err(ConfigError)?;
        Ok(())
    }

    fn uses_s3express(&self) -> bool {
        self.enable_s3express && self.address.directory_bucket.is_some()
    }
}

/// A configuration the client cannot work with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "S3 client configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

/// How a request ended, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Success.
    Ok,
    /// Failed with this kind.
    Failed(ErrorKind),
}

impl Outcome {
    /// Number of outcomes.
    pub const COUNT: usize = 1 + ErrorKind::COUNT;

    /// Index into [`ClientStats::requests`] rows.
    pub fn index(self) -> usize {
        match self {
            Outcome::Ok => 0,
            Outcome::Failed(kind) => 1 + kind.index(),
        }
    }
}

/// Connection counters (a copy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectionStats {
    /// HTTP/1.1 connections opened.
    pub http1_opened: u64,
    /// HTTP/2 connections opened.
    pub http2_opened: u64,
    /// Connections opened over TLS.
    pub tls_opened: u64,
    /// Connection attempts that failed.
    pub connect_failures: u64,
    /// Connections dropped after a failed or abandoned request.
    pub discarded: u64,
    /// HTTP/1.1 requests that reused an idle connection.
    pub http1_reused: u64,
}

/// A snapshot of one client's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// HTTP requests sent, by operation ([`Op::index`]) and outcome
    /// ([`Outcome::index`]). The `Unavailable` column counts requests the
    /// breaker refused (not sent).
    pub requests: [[u64; Outcome::COUNT]; Op::COUNT],
    /// Retries (requests after the first of an operation or part).
    pub retries: u64,
    /// Failures returned without a retry because the budget was empty.
    pub retry_budget_exhausted: u64,
    /// Attempts that ran past [`S3ClientConfig::request_timeout`] (counted
    /// as [`ErrorKind::Transient`] in [`ClientStats::requests`] too).
    pub timeouts: u64,
    /// Request body bytes of requests that got an answer.
    pub bytes_sent: u64,
    /// Response body bytes received.
    pub bytes_received: u64,
    /// Times the breaker opened.
    pub breaker_trips: u64,
    /// S3 Express sessions created (first ones and refreshes).
    pub sessions_created: u64,
    /// Of those, refreshes made in the background ahead of expiry.
    pub session_refreshes: u64,
    /// Credentials fetched from the provider chain (first ones and
    /// refreshes).
    pub credentials_fetched: u64,
    /// Of those, refreshes made in the background ahead of expiry.
    pub credentials_refreshed: u64,
    /// Background credential refreshes that failed (the old credentials
    /// stayed in use).
    pub credentials_refresh_failures: u64,
    /// Multipart uploads aborted after a failure.
    pub multipart_aborts: u64,
    /// Connections.
    pub connections: ConnectionStats,
}

impl ClientStats {
    /// Requests of `op` that ended with `outcome`.
    pub fn count(&self, op: Op, outcome: Outcome) -> u64 {
        self.requests[op.index()][outcome.index()]
    }

    /// Requests of `op` actually sent (all outcomes but breaker refusals).
    pub fn sent(&self, op: Op) -> u64 {
        let unavailable = Outcome::Failed(ErrorKind::Unavailable).index();
        self.requests[op.index()]
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != unavailable)
            .map(|(_, n)| n)
            .sum()
    }
}

#[derive(Default)]
struct Counters {
    requests: RefCell<[[u64; Outcome::COUNT]; Op::COUNT]>,
    retries: Cell<u64>,
    retry_budget_exhausted: Cell<u64>,
    timeouts: Cell<u64>,
    bytes_sent: Cell<u64>,
    bytes_received: Cell<u64>,
    breaker_trips: Cell<u64>,
    sessions_created: Cell<u64>,
    session_refreshes: Cell<u64>,
    multipart_aborts: Cell<u64>,
}

fn add(c: &Cell<u64>, n: u64) {
    c.set(c.get() + n);
}

/// Which credentials sign a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Auth {
    /// Object and bucket operations: base credentials (service `s3`), or
    /// the S3 Express session (service `s3express`, session token header).
    Data,
    /// CreateSession: base credentials, service `s3express`.
    CreateSession,
}

/// One request before signing.
struct Req<'a> {
    method: Method,
    /// Raw path (the signer and the wire encoding are derived from it).
    path: &'a str,
    query: &'a [(&'a str, &'a str)],
    /// Extra headers, signed.
    headers: &'a [(&'a str, &'a str)],
    body: Bytes,
    auth: Auth,
}

struct Identity {
    creds: Rc<Credentials>,
    service: &'static str,
    settings: SigningSettings,
}

/// What an attempt holds when its clock starts: the identity it signs with
/// and its request slot.
pub(crate) struct Ticket {
    id: Identity,
    slot: Slot,
}

/// A signed request's wire parts (besides method, `Host` and body).
struct Wire {
    target: String,
    headers: Vec<(HeaderName, HeaderValue)>,
}

pub(crate) struct ClientInner {
    cfg: S3ClientConfig,
    pool: Pool,
    signer: RefCell<Signer>,
    base_creds: Rc<CredentialsCache>,
    breaker: Breaker,
    budget: RetryBudget,
    jitter: RefCell<Jitter>,
    counters: Counters,
    connections: Rc<ConnectionCounters>,
    express: Option<SessionCache<ClientInner>>,
    /// Uploads whose operation was dropped before it could abort them.
    pending_aborts: RefCell<Vec<(String, String)>>,
}

/// An S3 client for one bucket on one shard. Cheap to clone (shared).
#[derive(Clone)]
pub struct S3Client {
    inner: Rc<ClientInner>,
}

impl fmt::Debug for S3Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Client")
            .field("bucket", &self.inner.cfg.address.bucket)
            .field("host", &self.inner.cfg.address.host_header)
            .field("pool", &self.inner.pool)
            .finish_non_exhaustive()
    }
}

async fn tagged<F: Future>(index: usize, fut: F) -> (usize, F::Output) {
    (index, fut.await)
}

/// Runs the futures with at most `limit` in flight, returning their results
/// in order, or the first error (the others are dropped, which cancels
/// them).
async fn try_join_bounded<T, F>(
    limit: usize,
    futures: impl IntoIterator<Item = F>,
) -> Result<Vec<T>, S3Error>
where
    F: Future<Output = Result<T, S3Error>>,
{
    let mut pending = futures.into_iter().enumerate();
    let mut running = FuturesUnordered::new();
    let mut results: Vec<Option<T>> = Vec::new();
    for (i, f) in pending.by_ref().take(limit.max(1)) {
        running.push(tagged(i, f));
        results.push(None);
    }
    while let Some((i, result)) = running.next().await {
        results[i] = Some(result?);
        if let Some((j, f)) = pending.next() {
            running.push(tagged(j, f));
            results.push(None);
        }
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("every future finished"))
        .collect())
}

fn connect_failure(e: ConnectError) -> Failure {
    if e.is_connection_level() {
        Failure::connection(Cause::Connect(e.to_string()))
    } else {
        Failure::fatal(Cause::Connect(e.to_string()))
    }
}

/// Maps a transport error: the connection's failures (resets, early close,
/// broken framing) are transient and count toward the breaker; a request
/// hyper refuses to send is ours to fix.
fn http_failure(e: HttpError) -> Failure {
    match e {
        HttpError::Hyper(h) if h.is_user() => Failure::fatal(Cause::BadResponse(format!(
            "request rejected by hyper: {}",
            HttpError::Hyper(h)
        ))),
        HttpError::TooLong { capacity, actual } => Failure::fatal(Cause::SizeMismatch {
            expected: capacity,
            actual,
        }),
        e => Failure::connection(Cause::Io(e.to_string())),
    }
}

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn content_length(headers: &HeaderMap) -> Result<Option<u64>, Failure> {
    match headers.get(hyper::header::CONTENT_LENGTH) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(Some)
            .ok_or_else(|| Failure::bad_response(format!("bad Content-Length {v:?}"))),
    }
}

/// The name the server's certificate must carry: the `Host` header without
/// its port (what the CRT sends as SNI). It differs from the connect host
/// for `*.localhost` and `bucket.<IPv4>` addresses.
fn tls_host(host_header: &str) -> &str {
    if let Some(rest) = host_header.strip_prefix('[') {
        return rest.split_once(']').map_or(rest, |(ip, _)| ip);
    }
    match host_header.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => host_header,
    }
}

/// Parses `Content-Range: bytes a-b/total`.
fn parse_content_range(value: &str) -> Option<(u64, u64, u64)> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let a = a.trim().parse().ok()?;
    let b = b.trim().parse().ok()?;
    let total = total.trim().parse().ok()?;
    (a <= b && b < total).then_some((a, b, total))
}

impl S3Client {
    /// A client with no connections yet. Must be used on one glommio
    /// executor (connections and background tasks are spawned there on
    /// first use).
    pub fn new(cfg: S3ClientConfig) -> Result<S3Client, ConfigError> {
        cfg.validate()?;
        let tls = if cfg.disable_tls {
            None
        } else {
            let trust = TlsTrust {
                system_roots: cfg.system_roots,
                ca_bundle: cfg.ca_bundle.clone(),
            };
            let config = net::tls_client_config(&trust, cfg.prefer_http2)
                .map_err(|e| ConfigError(e.to_string()))?;
            let name = net::server_name(tls_host(&cfg.address.host_header)).map_err(ConfigError)?;
            Some((config, name))
        };
        let connections = Rc::new(ConnectionCounters::default());
        let pool = Pool::new(
            EndpointConfig {
                connect_host: cfg.address.connect_host.clone(),
                port: cfg.address.port,
                tls,
                prefer_http2: cfg.prefer_http2,
                max_in_flight: cfg.max_connections,
                h2_max_connections: cfg.h2_max_connections,
                h2_max_streams_per_connection: cfg.h2_max_streams_per_connection,
                h2_stream_window_bytes: cfg.h2_stream_window_bytes,
                h2_connection_window_bytes: cfg.h2_connection_window_bytes,
                h2_max_frame_bytes: cfg.h2_max_frame_bytes,
            },
            connections.clone(),
        );
        let express = cfg
            .uses_s3express()
            .then(|| SessionCache::new(cfg.express.clone()));
        let base_creds = match &cfg.credentials {
            CredentialsConfig::Static(c) => CredentialsCache::fixed(c.clone()),
            CredentialsConfig::Chain(env) => CredentialsCache::chain(
                cfg.credentials_refresh.clone(),
                env.clone(),
                FetchConfig {
                    connect_timeout: cfg.credentials_refresh.connect_timeout,
                    read_timeout: cfg.credentials_refresh.read_timeout,
                    trust: TlsTrust {
                        system_roots: cfg.system_roots,
                        ca_bundle: cfg.ca_bundle.clone(),
                    },
                },
            ),
        };
        let inner = ClientInner {
            breaker: Breaker::new(cfg.breaker.clone(), cfg.clock.clone()),
            budget: RetryBudget::new(cfg.retry.budget_tokens),
            jitter: RefCell::new(Jitter::from_entropy()),
            pool,
            signer: RefCell::new(Signer::new()),
            base_creds: Rc::new(base_creds),
            counters: Counters::default(),
            connections,
            express,
            pending_aborts: RefCell::new(Vec::new()),
            cfg,
        };
        Ok(S3Client {
            inner: Rc::new(inner),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &S3ClientConfig {
        &self.inner.cfg
    }

    /// The breaker's state for `/status`.
    pub fn breaker_status(&self) -> BreakerStatus {
        self.inner.breaker.status()
    }

    /// The protocol the connections speak, once the first one is open.
    pub fn protocol(&self) -> Option<Protocol> {
        self.inner.pool.protocol()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ClientStats {
        let c = &self.inner.counters;
        let k = &self.inner.connections;
        let creds = self.inner.base_creds.stats();
        ClientStats {
            requests: *c.requests.borrow(),
            retries: c.retries.get(),
            retry_budget_exhausted: c.retry_budget_exhausted.get(),
            timeouts: c.timeouts.get(),
            bytes_sent: c.bytes_sent.get(),
            bytes_received: c.bytes_received.get(),
            breaker_trips: c.breaker_trips.get(),
            sessions_created: c.sessions_created.get(),
            session_refreshes: c.session_refreshes.get(),
            credentials_fetched: creds.fetched,
            credentials_refreshed: creds.refreshed,
            credentials_refresh_failures: creds.refresh_failures,
            multipart_aborts: c.multipart_aborts.get(),
            connections: ConnectionStats {
                http1_opened: k.http1_opened.get(),
                http2_opened: k.http2_opened.get(),
                tls_opened: k.tls_opened.get(),
                connect_failures: k.connect_failures.get(),
                discarded: k.discarded.get(),
                http1_reused: k.http1_reused.get(),
            },
        }
    }

    /// Closes every connection that is not lent to a request: the HTTP/2
    /// connections (with the streams still on them, which fail and are
    /// retried as any lost connection) and the idle HTTP/1.1 ones. Whatever
    /// the closed connections still held of request bodies (frames queued
    /// for a socket that stopped taking bytes) is dropped with them. The
    /// next request connects again.
    pub fn close_connections(&self) -> usize {
        self.inner.pool.close_all()
    }

    /// Retry tokens left.
    pub fn retry_budget_available(&self) -> u32 {
        self.inner.budget.available()
    }

    /// One `HEAD /<key>` sent past the circuit breaker, with no retry and
    /// `limit` as its whole deadline (queueing for a connection included):
    /// `Ok` when the endpoint answered at all, whatever the status (an
    /// object that does not exist, a refused credential). An answer closes
    /// the breaker at once. Used to find out that a tier that stopped
    /// answering answers again.
    pub async fn probe(&self, key: &str, limit: Duration) -> Result<(), S3Error> {
        let inner = &self.inner;
        let path = inner.cfg.address.object_path(key);
        let attempt = async {
            let ticket = inner.ticket(Auth::Data).await?;
            let req = inner.req(Method::HEAD, &path, &[], &[], Bytes::new());
            let (head, lease) = inner.exchange(ticket, &req).await?;
            // A HEAD answer has no body: the connection is free.
            lease.release();
            Ok::<u16, Failure>(head.status)
        };
        match with_timeout(limit, attempt).await {
            Some(Ok(status)) => {
                let outcome = match status {
                    200..=299 | 404 => Outcome::Ok,
                    s => Outcome::Failed(crate::error::classify_status(s, None)),
                };
                inner.record(Op::HeadObject, outcome);
                inner.breaker.probe_answered();
                Ok(())
            }
            Some(Err(f)) => {
                inner.record(Op::HeadObject, Outcome::Failed(f.kind));
                Err(f.into_error(Op::HeadObject, Some(key), 1))
            }
            None => {
                add(&inner.counters.timeouts, 1);
                inner.record(Op::HeadObject, Outcome::Failed(ErrorKind::Transient));
                Err(S3Error::new(
                    Op::HeadObject,
                    Some(key),
                    ErrorKind::Transient,
                    Cause::Timeout { after: limit },
                ))
            }
        }
    }

    /// `HEAD /<key>`: the object's size, or `None` when it does not exist.
    pub async fn head_object(&self, key: &str) -> Result<Option<u64>, S3Error> {
        let inner = &self.inner;
        inner.start_op();
        let path = inner.cfg.address.object_path(key);
        let deadline = inner.deadline();
        inner
            .run(
                Op::HeadObject,
                Some(key),
                deadline,
                Auth::Data,
                |ticket| async {
                    let req = inner.req(Method::HEAD, &path, &[], &[], Bytes::new());
                    let (head, lease) = inner.exchange(ticket, &req).await?;
                    match head.status {
                        // A HEAD answer has no body, so the connection is free
                        // once the head is in.
                        200 => {
                            let len = content_length(&head.headers)?.ok_or_else(|| {
                                Failure::bad_response("HEAD answer has no Content-Length")
                            })?;
                            lease.release();
                            Ok(Some(len))
                        }
                        404 => {
                            lease.release();
                            Ok(None)
                        }
                        _ => Err(inner.status_failure(head, lease, &req).await),
                    }
                },
            )
            .await
    }

    /// `GET /<key>` into `dest`, which must be exactly the object's size.
    /// Objects larger than one part come as parallel ranged GETs over
    /// HTTP/1.1 (one connection each). Over HTTP/2 an object is one stream:
    /// the streams of concurrent loads already share the connection, and
    /// some servers (s3s-fs) pad ranged answers with empty DATA frames, which
    /// h2 closes the connection over. A size mismatch, a short body or an
    /// unexpected status is an error, and then `dest` holds garbage.
    pub async fn get_object_into(&self, key: &str, dest: RecvRegion<'_>) -> Result<(), S3Error> {
        let inner = &self.inner;
        inner.start_op();
        let deadline = inner.deadline();
        let len = dest.len() as u64;
        let part = inner.cfg.get_part_size_bytes;
        let path = inner.cfg.address.object_path(key);
        let h2c = inner.cfg.disable_tls && inner.cfg.prefer_http2;
        if len <= part || h2c || inner.pool.protocol() == Some(Protocol::Http2) {
            return inner
                .run(Op::GetObject, Some(key), deadline, Auth::Data, |ticket| {
                    inner.get_whole(ticket, &path, &dest)
                })
                .await;
        }
        let parts = len.div_ceil(part);
        let ranges = (0..parts).map(|i| {
            let start = i * part;
            (start, part.min(len - start))
        });
        let dest = &dest;
        let path = path.as_str();
        let futures = ranges.map(|(start, part_len)| {
            inner.run(
                Op::GetObject,
                Some(key),
                deadline,
                Auth::Data,
                move |ticket| inner.get_range(ticket, path, dest, start, part_len),
            )
        });
        try_join_bounded(inner.cfg.max_parallel_parts, futures).await?;
        Ok(())
    }

    /// `PUT /<key>` of `body`; above the multipart threshold a multipart
    /// upload (aborted again if it fails).
    pub async fn put_object(&self, key: &str, body: SendRegion) -> Result<(), S3Error> {
        let inner = &self.inner;
        inner.start_op();
        let deadline = inner.deadline();
        let path = inner.cfg.address.object_path(key);
        let len = body.len() as u64;
        if len <= inner.cfg.multipart_threshold_bytes {
            let bytes = body.bytes().clone();
            return inner
                .run(Op::PutObject, Some(key), deadline, Auth::Data, |ticket| {
                    inner.upload(ticket, Op::PutObject, &path, &[], bytes.clone())
                })
                .await
                .map(|_etag| ());
        }
        inner.multipart_upload(key, &path, body, deadline).await
    }

    /// `DELETE /<key>`: true when deleted (200/204), false when the server
    /// says 404. (S3 answers 204 for missing keys too.)
    pub async fn delete_object(&self, key: &str) -> Result<bool, S3Error> {
        let inner = &self.inner;
        inner.start_op();
        let path = inner.cfg.address.object_path(key);
        let deadline = inner.deadline();
        inner
            .run(
                Op::DeleteObject,
                Some(key),
                deadline,
                Auth::Data,
                |ticket| async {
                    let req = inner.req(Method::DELETE, &path, &[], &[], Bytes::new());
                    let (head, lease) = inner.exchange(ticket, &req).await?;
                    match head.status {
                        200 | 204 => {
                            inner.finish(lease).await?;
                            Ok(true)
                        }
                        404 => {
                            inner.finish(lease).await?;
                            Ok(false)
                        }
                        _ => Err(inner.status_failure(head, lease, &req).await),
                    }
                },
            )
            .await
    }

    /// One ListObjectsV2 page.
    pub async fn list_objects_v2(
        &self,
        prefix: Option<&str>,
        continuation_token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListObjectsV2Page, S3Error> {
        let inner = &self.inner;
        inner.start_op();
        let deadline = inner.deadline();
        inner
            .list_page(prefix, continuation_token, max_keys, deadline)
            .await
    }

    /// Every object under `prefix`, paging with `page_size` keys per
    /// request (None: the server's default, 1000 on S3).
    pub async fn list_all_objects(
        &self,
        prefix: Option<&str>,
        page_size: Option<u32>,
    ) -> Result<Vec<ListedObject>, S3Error> {
        let inner = &self.inner;
        inner.start_op();
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let deadline = inner.deadline();
            let page = inner
                .list_page(prefix, token.as_deref(), page_size, deadline)
                .await?;
            all.extend(page.contents);
            if !page.is_truncated {
                return Ok(all);
            }
            match page.next_continuation_token {
                Some(next) if Some(&next) != token.as_ref() && !next.is_empty() => {
                    token = Some(next)
                }
                _ => {
                    return Err(S3Error::new(
                        Op::ListObjectsV2,
                        prefix,
                        ErrorKind::Fatal,
                        Cause::BadResponse(
                            "truncated page without a new continuation token".to_owned(),
                        ),
                    ))
                }
            }
        }
    }
}

impl ClientInner {
    fn deadline(&self) -> Instant {
        Instant::now() + self.cfg.operation_timeout
    }

    fn req<'a>(
        &self,
        method: Method,
        path: &'a str,
        query: &'a [(&'a str, &'a str)],
        headers: &'a [(&'a str, &'a str)],
        body: Bytes,
    ) -> Req<'a> {
        Req {
            method,
            path,
            query,
            headers,
            body,
            auth: Auth::Data,
        }
    }

    /// Part size for an object of `len` bytes (raised to stay within
    /// S3's part count).
    fn part_size_for(&self, len: u64) -> u64 {
        self.cfg.part_size_bytes.max(len.div_ceil(MAX_PARTS))
    }

    /// Housekeeping at the start of each operation: aborts of multipart
    /// uploads whose operation was dropped.
    fn start_op(self: &Rc<Self>) {
        let pending = std::mem::take(&mut *self.pending_aborts.borrow_mut());
        for (key, upload_id) in pending {
            let inner = self.clone();
            glommio::spawn_local(async move {
                let deadline = inner.deadline();
                if let Err(e) = inner.abort_upload(&key, &upload_id, deadline).await {
                    log::warn!("s3: aborting a dropped multipart upload: {e}");
                }
            })
            .detach();
        }
    }

    fn record(&self, op: Op, outcome: Outcome) {
        self.counters.requests.borrow_mut()[op.index()][outcome.index()] += 1;
    }

    /// Runs `attempt` until it succeeds, fails for good, or the deadline,
    /// the retry limit or the budget says stop.
    ///
    /// Each attempt first gets its signing identity (which may wait for an
    /// S3 Express session) and a request slot of the pool (which may wait
    /// for other requests to finish), both under the operation deadline
    /// only; the per-request deadline starts once it holds both, so time
    /// spent queueing behind this client's own requests is never taken for
    /// a slow server (nor counted by the breaker).
    async fn run<T, F, Fut>(
        self: &Rc<Self>,
        op: Op,
        key: Option<&str>,
        deadline: Instant,
        auth: Auth,
        mut attempt: F,
    ) -> Result<T, S3Error>
    where
        F: FnMut(Ticket) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let retry = &self.cfg.retry;
        let mut backoff = Backoff::new(retry.base_delay, retry.max_delay);
        let mut attempts = 0u32;
        loop {
            if let Err(retry_in) = self.breaker.check() {
                self.record(op, Outcome::Failed(ErrorKind::Unavailable));
                return Err(S3Error::new(
                    op,
                    key,
                    ErrorKind::Unavailable,
                    Cause::BreakerOpen { retry_in },
                )
                .with_attempts(attempts));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(S3Error::new(
                    op,
                    key,
                    ErrorKind::Transient,
                    Cause::DeadlineExceeded {
                        after: self.cfg.operation_timeout,
                    },
                )
                .with_attempts(attempts));
            }
            attempts += 1;
            let result = match with_timeout(deadline - now, self.ticket(auth)).await {
                Some(Ok(ticket)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let limit = self.cfg.request_timeout.min(left);
                    match with_timeout(limit, attempt(ticket)).await {
                        Some(r) => r,
                        None => {
                            add(&self.counters.timeouts, 1);
                            Err(Failure::connection(Cause::Timeout { after: limit }))
                        }
                    }
                }
                Some(Err(f)) => Err(f),
                None => Err(Failure::new(
                    ErrorKind::Transient,
                    Cause::DeadlineExceeded {
                        after: self.cfg.operation_timeout,
                    },
                )),
            };
            let failure = match result {
                Ok(value) => {
                    self.record(op, Outcome::Ok);
                    self.breaker.record_success();
                    self.budget.deposit(retry.success_refill);
                    return Ok(value);
                }
                Err(f) => f,
            };
            // A session or credentials failure, or a deadline reached while
            // queueing, means this request was never sent (CreateSession
            // counts its own requests).
            if !matches!(
                failure.cause,
                Cause::Session(_) | Cause::Credentials(_) | Cause::DeadlineExceeded { .. }
            ) {
                self.record(op, Outcome::Failed(failure.kind));
            }
            if failure.connection_level && self.breaker.record_connection_failure() {
                add(&self.counters.breaker_trips, 1);
            }
            if !failure.kind.is_retryable() || attempts >= retry.max_attempts {
                return Err(failure.into_error(op, key, attempts));
            }
            let cost = if failure.is_timeout() {
                retry.timeout_retry_cost
            } else {
                retry.retry_cost
            };
            if !self.budget.try_withdraw(cost) {
                add(&self.counters.retry_budget_exhausted, 1);
                return Err(failure
                    .into_error(op, key, attempts)
                    .with_note("retry budget exhausted"));
            }
            let delay = backoff.next_delay(&mut self.jitter.borrow_mut());
            if Instant::now() + delay >= deadline {
                return Err(failure
                    .into_error(op, key, attempts)
                    .with_note("operation deadline reached"));
            }
            add(&self.counters.retries, 1);
            glommio::timer::sleep(delay).await;
        }
    }

    /// What one attempt needs before its clock starts.
    async fn ticket(self: &Rc<Self>, auth: Auth) -> Result<Ticket, Failure> {
        let id = self.identity(auth).await?;
        let slot = self.pool.acquire_slot().await;
        Ok(Ticket { id, slot })
    }

    async fn base_credentials(&self) -> Result<Rc<Credentials>, Failure> {
        self.base_creds.credentials().await
    }

    async fn identity(self: &Rc<Self>, auth: Auth) -> Result<Identity, Failure> {
        match (auth, &self.express) {
            (Auth::Data, Some(cache)) => {
                let creds = cache.credentials(self).await?;
                Ok(Identity {
                    creds,
                    service: S3EXPRESS_SERVICE,
                    settings: SigningSettings::s3_express_data_plane(),
                })
            }
            (Auth::Data, None) => Ok(Identity {
                creds: self.base_credentials().await?,
                service: S3_SERVICE,
                settings: SigningSettings::s3(),
            }),
            (Auth::CreateSession, _) => Ok(Identity {
                creds: self.base_credentials().await?,
                service: S3EXPRESS_SERVICE,
                settings: SigningSettings::s3(),
            }),
        }
    }

    fn build(&self, req: &Req<'_>, id: &Identity) -> Result<Wire, Failure> {
        let address = &self.cfg.address;
        let mut target = String::with_capacity(req.path.len() + 64);
        encode_path(req.path, &mut target);
        if !req.query.is_empty() {
            target.push('?');
            encode_query(req.query, &mut target);
        }
        let payload = match self.cfg.payload_signing {
            PayloadSigning::Unsigned => PayloadHash::Unsigned,
            PayloadSigning::Sha256 => PayloadHash::Body(&req.body),
        };
        let signable = SignableRequest {
            method: req.method.as_str(),
            host: &address.host_header,
            path: req.path,
            query: req.query,
            headers: req.headers,
            payload,
        };
        let params = SigningParams {
            credentials: &id.creds,
            region: &self.cfg.region,
            service: id.service,
            time: SigningTime::System(self.cfg.clock.wall()),
            settings: &id.settings,
        };
        let bad_header =
            |name: &str| Failure::fatal(Cause::Config(format!("header {name} cannot be sent")));
        let mut headers = Vec::with_capacity(req.headers.len() + 4);
        for (name, value) in req.headers {
            headers.push((
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| bad_header(name))?,
                HeaderValue::from_str(value).map_err(|_| bad_header(name))?,
            ));
        }
        let mut signer = self.signer.borrow_mut();
        let signed = signer
            .sign(&signable, &params)
            .map_err(|e| Failure::fatal(Cause::Sign(e)))?;
        for (name, value) in signed.headers() {
            let value = HeaderValue::from_str(value).map_err(|_| bad_header(name))?;
            headers.push((HeaderName::from_static(name), value));
        }
        Ok(Wire { target, headers })
    }

    /// Signs and sends one request; returns the response head and the lease
    /// the body must be read under.
    async fn exchange(
        self: &Rc<Self>,
        ticket: Ticket,
        req: &Req<'_>,
    ) -> Result<(Head, Lease), Failure> {
        let Ticket { id, slot } = ticket;
        let wire = self.build(req, &id)?;
        let address = &self.cfg.address;
        let outgoing = Outgoing {
            method: &req.method,
            target: &wire.target,
            scheme: address.scheme.as_str(),
            authority: &address.host_header,
            headers: &wire.headers,
            body: &req.body,
        };
        let mut slot = Some(slot);
        let mut unsent = 0;
        loop {
            let slot = match slot.take() {
                Some(s) => s,
                None => self.pool.acquire_slot().await,
            };
            let mut lease = self.pool.lease(slot).await.map_err(connect_failure)?;
            match lease.send(&outgoing).await {
                Ok(head) => {
                    add(&self.counters.bytes_sent, req.body.len() as u64);
                    return Ok((head, lease));
                }
                // A pooled connection closed under us before the server
                // answered: try a fresh one, which is not a new attempt.
                Err(SendError::NotSent(e)) => {
                    unsent += 1;
                    if unsent > MAX_UNSENT_RETRIES {
                        return Err(http_failure(e));
                    }
                }
                Err(SendError::Failed(e)) => return Err(http_failure(e)),
            }
        }
    }

    /// Reads the rest of a body we do not need, then returns the connection.
    async fn finish(&self, mut lease: Lease) -> Result<(), Failure> {
        let n = lease.discard_body().await.map_err(http_failure)?;
        add(&self.counters.bytes_received, n as u64);
        lease.release();
        Ok(())
    }

    /// Reads a small body (XML) of at most `limit` bytes.
    async fn read_small(&self, mut lease: Lease, limit: usize) -> Result<Vec<u8>, Failure> {
        let mut out = Vec::new();
        let (n, complete) = lease
            .read_body_limited(&mut out, limit)
            .await
            .map_err(http_failure)?;
        add(&self.counters.bytes_received, n as u64);
        if !complete {
            return Err(Failure::bad_response(format!(
                "response body larger than {limit} bytes"
            )));
        }
        lease.release();
        Ok(out)
    }

    /// Reads a body into `window`, which it must fill exactly.
    async fn read_into(&self, mut lease: Lease, window: &mut Window) -> Result<(), Failure> {
        let n = lease.read_body_into(window).await.map_err(http_failure)?;
        add(&self.counters.bytes_received, n as u64);
        if window.filled() != window.len() {
            return Err(Failure::fatal(Cause::SizeMismatch {
                expected: window.len() as u64,
                actual: window.filled() as u64,
            }));
        }
        lease.release();
        Ok(())
    }

    /// The failure for an unexpected status, with the S3 error body parsed.
    async fn status_failure(&self, head: Head, mut lease: Lease, req: &Req<'_>) -> Failure {
        let status = head.status;
        let header_request_id = header_str(&head.headers, "x-amz-request-id").map(str::to_owned);
        let body = if req.method == Method::HEAD {
            lease.release();
            Vec::new()
        } else {
            let mut out = Vec::new();
            let read = lease
                .read_body_limited(&mut out, MAX_ERROR_BODY_BYTES)
                .await;
            // A server that refuses a request may not have read its body
            // and then closes the connection: do not reuse it.
            if let Ok((n, complete)) = read {
                add(&self.counters.bytes_received, n as u64);
                if complete && req.body.is_empty() {
                    lease.release();
                }
            }
            out
        };
        let parsed = std::str::from_utf8(&body)
            .ok()
            .and_then(|text| xml::parse_error(text).ok());
        let (code, message, body_request_id) = match parsed {
            Some(e) => (Some(e.code), e.message, e.request_id),
            None => (None, None, None),
        };
        let mut kind = classify_status(status, code.as_deref());
        if let (Some(cache), Some(c)) = (&self.express, code.as_deref()) {
            if req.auth == Auth::Data && matches!(c, "ExpiredToken" | "InvalidToken") {
                // The session, not the identity, was refused: a new session
                // can succeed.
                cache.invalidate();
                kind = ErrorKind::Transient;
            }
        }
        Failure::new(
            kind,
            Cause::Status {
                status,
                code,
                message,
                request_id: header_request_id.or(body_request_id),
            },
        )
    }

    /// One whole-object GET into `dest`.
    async fn get_whole(
        self: &Rc<Self>,
        ticket: Ticket,
        path: &str,
        dest: &RecvRegion<'_>,
    ) -> Result<(), Failure> {
        let len = dest.len() as u64;
        let req = self.req(Method::GET, path, &[], &[], Bytes::new());
        let (head, lease) = self.exchange(ticket, &req).await?;
        if head.status != 200 {
            return Err(self.status_failure(head, lease, &req).await);
        }
        if let Some(announced) = content_length(&head.headers)? {
            if announced != len {
                return Err(Failure::fatal(Cause::SizeMismatch {
                    expected: len,
                    actual: announced,
                }));
            }
        }
        let mut window = dest.window(0, dest.len());
        self.read_into(lease, &mut window).await
    }

    /// One ranged GET of `part_len` bytes at `start` into `dest`.
    async fn get_range(
        self: &Rc<Self>,
        ticket: Ticket,
        path: &str,
        dest: &RecvRegion<'_>,
        start: u64,
        part_len: u64,
    ) -> Result<(), Failure> {
        let total = dest.len() as u64;
        let end = start + part_len - 1;
        let range = format!("bytes={start}-{end}");
        let headers = [("range", range.as_str())];
        let req = self.req(Method::GET, path, &[], &headers, Bytes::new());
        let (head, lease) = self.exchange(ticket, &req).await?;
        match head.status {
            206 => {}
            200 => {
                return Err(Failure::bad_response(
                    "server ignored the Range header (200 instead of 206)",
                ))
            }
            _ => return Err(self.status_failure(head, lease, &req).await),
        }
        let content_range = header_str(&head.headers, "content-range")
            .ok_or_else(|| Failure::bad_response("206 answer without Content-Range"))?;
        let (a, b, object_len) = parse_content_range(content_range)
            .ok_or_else(|| Failure::bad_response(format!("bad Content-Range {content_range:?}")))?;
        if object_len != total {
            return Err(Failure::fatal(Cause::SizeMismatch {
                expected: total,
                actual: object_len,
            }));
        }
        if (a, b) != (start, end) {
            return Err(Failure::bad_response(format!(
                "asked for bytes {start}-{end}, got {content_range:?}"
            )));
        }
        let offset = usize::try_from(start).expect("offset within the region");
        let mut window = dest.window(offset, part_len as usize);
        self.read_into(lease, &mut window).await
    }

    /// PUT of a body (a whole object or one part); returns the ETag.
    async fn upload(
        self: &Rc<Self>,
        ticket: Ticket,
        op: Op,
        path: &str,
        query: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Option<String>, Failure> {
        let len = body.len().to_string();
        let headers = [
            ("content-length", len.as_str()),
            ("content-type", OBJECT_CONTENT_TYPE),
        ];
        let req = self.req(Method::PUT, path, query, &headers, body);
        let (head, lease) = self.exchange(ticket, &req).await?;
        if head.status != 200 {
            return Err(self.status_failure(head, lease, &req).await);
        }
        let etag = header_str(&head.headers, "etag").map(str::to_owned);
        if op == Op::UploadPart && etag.is_none() {
            return Err(Failure::bad_response("UploadPart answer has no ETag"));
        }
        self.finish(lease).await?;
        Ok(etag)
    }

    async fn multipart_upload(
        self: &Rc<Self>,
        key: &str,
        path: &str,
        body: SendRegion,
        deadline: Instant,
    ) -> Result<(), S3Error> {
        let upload_id = self.create_upload(key, path, deadline).await?;
        // Abort if this future is dropped before the upload completes.
        let mut guard = UploadGuard {
            inner: self.clone(),
            key: key.to_owned(),
            upload_id: Some(upload_id.clone()),
        };
        let result = self
            .upload_parts_and_complete(key, path, &body, &upload_id, deadline)
            .await;
        guard.upload_id = None;
        if let Err(e) = result {
            add(&self.counters.multipart_aborts, 1);
            let abort_deadline = Instant::now() + self.cfg.request_timeout;
            if let Err(abort) = self.abort_upload(key, &upload_id, abort_deadline).await {
                log::warn!("s3: aborting multipart upload after a failure: {abort}");
            }
            return Err(e);
        }
        Ok(())
    }

    async fn create_upload(
        self: &Rc<Self>,
        key: &str,
        path: &str,
        deadline: Instant,
    ) -> Result<String, S3Error> {
        self.run(
            Op::CreateMultipartUpload,
            Some(key),
            deadline,
            Auth::Data,
            |ticket| async {
                let query = [("uploads", "")];
                let headers = [("content-type", OBJECT_CONTENT_TYPE)];
                let req = self.req(Method::POST, path, &query, &headers, Bytes::new());
                let (head, lease) = self.exchange(ticket, &req).await?;
                if head.status != 200 {
                    return Err(self.status_failure(head, lease, &req).await);
                }
                let body = self.read_small(lease, MAX_SMALL_BODY_BYTES).await?;
                let text = std::str::from_utf8(&body).map_err(|_| {
                    Failure::bad_response("CreateMultipartUpload answer is not UTF-8")
                })?;
                xml::parse_initiate_multipart_upload(text)
                    .map(|r| r.upload_id)
                    .map_err(|e| Failure::bad_response(format!("CreateMultipartUpload: {e}")))
            },
        )
        .await
    }

    async fn upload_parts_and_complete(
        self: &Rc<Self>,
        key: &str,
        path: &str,
        body: &SendRegion,
        upload_id: &str,
        deadline: Instant,
    ) -> Result<(), S3Error> {
        let len = body.len() as u64;
        let part = self.part_size_for(len);
        let count = len.div_ceil(part);
        let bytes = body.bytes();
        let parts = (0..count).map(|i| {
            let start = i * part;
            let end = (start + part).min(len);
            let slice = bytes.slice(start as usize..end as usize);
            let number = u32::try_from(i + 1).expect("part numbers fit u32");
            async move {
                let number_text = number.to_string();
                let query = [
                    ("partNumber", number_text.as_str()),
                    ("uploadId", upload_id),
                ];
                let etag = self
                    .run(Op::UploadPart, Some(key), deadline, Auth::Data, |ticket| {
                        self.upload(ticket, Op::UploadPart, path, &query, slice.clone())
                    })
                    .await?;
                Ok(CompletedPart {
                    part_number: number,
                    etag: etag.expect("UploadPart checks the ETag"),
                })
            }
        });
        let completed = try_join_bounded(self.cfg.max_parallel_parts, parts).await?;
        let mut xml_body = String::new();
        xml::write_complete_multipart_upload(&completed, &mut xml_body).map_err(|e| {
            S3Error::new(
                Op::CompleteMultipartUpload,
                Some(key),
                ErrorKind::Fatal,
                Cause::BadResponse(format!("part list: {e}")),
            )
        })?;
        let xml_body = Bytes::from(xml_body);
        self.run(
            Op::CompleteMultipartUpload,
            Some(key),
            deadline,
            Auth::Data,
            |ticket| async {
                let query = [("uploadId", upload_id)];
                let len = xml_body.len().to_string();
                let headers = [
                    ("content-length", len.as_str()),
                    ("content-type", "application/xml"),
                ];
                let req = self.req(Method::POST, path, &query, &headers, xml_body.clone());
                let (head, lease) = self.exchange(ticket, &req).await?;
                if head.status != 200 {
                    return Err(self.status_failure(head, lease, &req).await);
                }
                // S3 may answer 200 and put an error in the body.
                let body = self.read_small(lease, MAX_SMALL_BODY_BYTES).await?;
                let text = std::str::from_utf8(&body).unwrap_or("");
                if let Ok(e) = xml::parse_error(text) {
                    let kind = classify_status(500, Some(&e.code));
                    return Err(Failure::new(
                        kind,
                        Cause::Status {
                            status: 200,
                            code: Some(e.code),
                            message: e.message,
                            request_id: e.request_id,
                        },
                    ));
                }
                Ok(())
            },
        )
        .await
    }

    async fn abort_upload(
        self: &Rc<Self>,
        key: &str,
        upload_id: &str,
        deadline: Instant,
    ) -> Result<(), S3Error> {
        let path = self.cfg.address.object_path(key);
        self.run(
            Op::AbortMultipartUpload,
            Some(key),
            deadline,
            Auth::Data,
            |ticket| async {
                let query = [("uploadId", upload_id)];
                let req = self.req(Method::DELETE, &path, &query, &[], Bytes::new());
                let (head, lease) = self.exchange(ticket, &req).await?;
                match head.status {
                    200 | 204 | 404 => self.finish(lease).await,
                    _ => Err(self.status_failure(head, lease, &req).await),
                }
            },
        )
        .await
    }

    async fn list_page(
        self: &Rc<Self>,
        prefix: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
        deadline: Instant,
    ) -> Result<ListObjectsV2Page, S3Error> {
        let path = self.cfg.address.bucket_path();
        let max_keys_text = max_keys.map(|n| n.to_string());
        let mut query: Vec<(&str, &str)> = vec![("list-type", "2")];
        if let Some(t) = token {
            query.push(("continuation-token", t));
        }
        if let Some(n) = &max_keys_text {
            query.push(("max-keys", n));
        }
        if let Some(p) = prefix {
            query.push(("prefix", p));
        }
        let query = &query;
        let path = &path;
        self.run(
            Op::ListObjectsV2,
            prefix,
            deadline,
            Auth::Data,
            |ticket| async move {
                let req = self.req(Method::GET, path, query, &[], Bytes::new());
                let (head, lease) = self.exchange(ticket, &req).await?;
                if head.status != 200 {
                    return Err(self.status_failure(head, lease, &req).await);
                }
                let body = self.read_small(lease, MAX_SMALL_BODY_BYTES).await?;
                let text = std::str::from_utf8(&body)
                    .map_err(|_| Failure::bad_response("ListObjectsV2 answer is not UTF-8"))?;
                xml::parse_list_objects_v2(text)
                    .map_err(|e| Failure::bad_response(format!("ListObjectsV2: {e}")))
            },
        )
        .await
    }
}

impl CreateSession for ClientInner {
    /// Wall-clock time as the client sees it ([`S3ClientConfig::clock`]).
    fn wall_now(&self) -> std::time::SystemTime {
        self.cfg.clock.wall()
    }

    /// CreateSession for the client's (directory) bucket.
    async fn create_session(self: &Rc<Self>) -> Result<Credentials, S3Error> {
        let request = self.cfg.address.create_session_request().map_err(|e| {
            S3Error::new(
                Op::CreateSession,
                None,
                ErrorKind::Fatal,
                Cause::Config(e.to_string()),
            )
        })?;
        let deadline = self.deadline();
        let creds = self
            .run(
                Op::CreateSession,
                None,
                deadline,
                Auth::CreateSession,
                |ticket| async {
                    let query = crate::addressing::CreateSessionRequest::QUERY;
                    let req = Req {
                        method: Method::GET,
                        path: &request.path,
                        query: &query,
                        headers: &[],
                        body: Bytes::new(),
                        auth: Auth::CreateSession,
                    };
                    let (head, lease) = self.exchange(ticket, &req).await?;
                    if head.status != 200 {
                        return Err(self.status_failure(head, lease, &req).await);
                    }
                    let body = self.read_small(lease, MAX_SMALL_BODY_BYTES).await?;
                    let text = std::str::from_utf8(&body)
                        .map_err(|_| Failure::bad_response("CreateSession answer is not UTF-8"))?;
                    xml::parse_create_session(text)
                        .map_err(|e| Failure::bad_response(format!("CreateSession: {e}")))
                },
            )
            .await?;
        add(&self.counters.sessions_created, 1);
        Ok(creds)
    }

    fn session_cache(&self) -> Option<&SessionCache<ClientInner>> {
        self.express.as_ref()
    }

    fn note_session_refresh(&self) {
        add(&self.counters.session_refreshes, 1);
    }
}

/// Aborts a multipart upload whose operation future was dropped: the abort
/// is queued and sent at the start of the client's next operation (a
/// destructor cannot await, and may run where spawning is not possible).
struct UploadGuard {
    inner: Rc<ClientInner>,
    key: String,
    upload_id: Option<String>,
}

impl Drop for UploadGuard {
    fn drop(&mut self) {
        if let Some(id) = self.upload_id.take() {
            add(&self.inner.counters.multipart_aborts, 1);
            self.inner
                .pending_aborts
                .borrow_mut()
                .push((std::mem::take(&mut self.key), id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_parses_and_rejects_garbage() {
        assert_eq!(
            parse_content_range("bytes 0-8388607/33554432"),
            Some((0, 8388607, 33554432))
        );
        assert_eq!(parse_content_range("bytes 5-4/10"), None);
        assert_eq!(parse_content_range("bytes 0-10/10"), None);
        assert_eq!(parse_content_range("bytes */10"), None);
        assert_eq!(parse_content_range("items 0-1/2"), None);
    }

    #[test]
    fn tls_name_is_the_host_header_without_port() {
        assert_eq!(
            tls_host("bucket.s3.us-east-1.amazonaws.com"),
            "bucket.s3.us-east-1.amazonaws.com"
        );
        assert_eq!(tls_host("bucket.localhost:9000"), "bucket.localhost");
        assert_eq!(tls_host("[::1]:8443"), "::1");
        assert_eq!(tls_host("127.0.0.1:443"), "127.0.0.1");
    }

    #[test]
    fn outcome_indexes_cover_the_table() {
        assert_eq!(Outcome::Ok.index(), 0);
        assert_eq!(
            Outcome::Failed(ErrorKind::Unavailable).index(),
            Outcome::COUNT - 1
        );
    }
}
