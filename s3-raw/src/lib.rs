//! kvshard-s3-raw: the pieces of an S3 client that need no network, written
//! directly against the wire formats.
//!
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
//! Each module has its own error type. Nothing here does I/O except
//! [`credentials`] reading the AWS profile files.

pub mod addressing;
pub mod credentials;
pub mod sigv4;
pub mod time;
pub mod xml;
