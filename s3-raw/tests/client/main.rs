//! The S3 client against real servers on loopback: s3s-fs (HTTP/1.1, h2c,
//! and TLS with ALPN h2 through an in-process rustls front), small
//! hand-written HTTP/1.1 servers for faults, and an S3 Express mock that
//! verifies every signature with the `aws-sigv4` crate; credentials from a
//! mock instance metadata service.
//!
//! s3s-fs must be installed (`tools/s3/install-s3s-fs.sh`); without it these
//! tests fail and say how to install it.

#[path = "../common/mod.rs"]
mod common;

#[path = "../mock_http/mod.rs"]
mod mock_http;

mod credentials;
mod express;
mod faults;
mod h1;
mod roundtrip;
mod support;
mod tls;
