//! kvshard-s3-raw: an S3 client with no AWS SDK, written directly against
//! the wire formats, for one glommio shard.
//!
//! Pieces that need no network:
//! - [`sigv4`]: AWS Signature Version 4 for request headers, with S3's
//!   encoding rules, the S3 Express session-token header, and a signer that
//!   caches derived keys and reuses its buffers.
//! - [`addressing`]: turns lmcache's bucket URL forms (`s3://bucket`,
//!   `bucket.host[:port]`, explicit endpoint URLs, S3 Express directory
//!   buckets) into scheme, connect host, port, `Host` header and path.
//! - [`credentials`]: static keys, environment, shared credentials and config
//!   files with profiles, and the provider chain; the HTTP sources plug in
//!   through [`credentials::HttpCredentialFetcher`].
//! - [`xml`]: a small XML reader for S3's responses (ListObjectsV2, Error,
//!   CreateSession, CreateMultipartUpload) and the CompleteMultipartUpload
//!   writer.
//! - [`time`]: `x-amz-date` formatting and RFC 3339 parsing.
//!
//! The client on top of them:
//! - [`net`]: TCP connect, rustls configuration, plain or TLS sockets.
//! - [`http`]: per-endpoint connections, HTTP/2 multiplexed (hyper) or an
//!   HTTP/1.1 keep-alive pool of our own connections ([`h1`]), which read
//!   bodies straight into caller memory.
//! - [`client`]: [`S3Client`]: HEAD, GET into caller memory (ranged and
//!   parallel), PUT from caller memory (multipart above a threshold),
//!   DELETE, ListObjectsV2; deadlines, retries, counters.
//! - [`region`]: the caller-memory types ([`SendRegion`], [`RecvRegion`]).
//! - [`retry`]: decorrelated-jitter backoff and the retry budget.
//! - [`breaker`]: the circuit breaker.
//! - [`express`]: S3 Express sessions.
//! - [`credential_http`]: the HTTP credential sources (IMDSv2, the ECS/EKS
//!   container endpoint, STS AssumeRoleWithWebIdentity), async on the
//!   shard's executor over [`h1`] connections from [`net`], each exchange
//!   under a time limit.
//! - [`credential_cache`]: the client's base credentials, fetched on the
//!   shard's executor and refreshed in the background ahead of their expiry.
//! - [`error`]: [`S3Error`] and its semantic [`ErrorKind`].

pub mod addressing;
pub mod breaker;
pub mod client;
pub mod credential_cache;
pub mod credential_http;
pub mod credentials;
pub mod error;
pub mod express;
pub mod h1;
pub mod http;
pub mod net;
pub mod region;
pub mod retry;
pub mod sigv4;
pub mod time;
pub mod xml;

pub use client::{
    ClientStats, ConfigError, CredentialsConfig, Outcome, PayloadSigning, S3Client, S3ClientConfig,
};
pub use error::{ErrorKind, Op, S3Error};
pub use region::{RecvRegion, SendRegion};
