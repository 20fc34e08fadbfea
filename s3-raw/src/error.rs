//! The client's error: what failed ([`Op`], key), the semantic class callers
//! act on ([`ErrorKind`]), and the cause ([`Cause`]).
//!
//! Classes, as object_store and mountpoint-s3 map them:
//! - [`ErrorKind::NotFound`]: 404 (`NoSuchKey`, `NoSuchBucket`, `NoSuchUpload`).
//! - [`ErrorKind::PermissionDenied`]: 403, or the codes `AccessDenied`,
//!   `SignatureDoesNotMatch`, `InvalidAccessKeyId`, `NotSignedUp`,
//!   `InvalidToken`, `ExpiredToken` on a plain S3 request. Never retried.
//! - [`ErrorKind::Throttled`]: 429, 503 `SlowDown`, or the codes `SlowDown`,
//!   `Throttling`, `ThrottlingException`, `RequestLimitExceeded`.
//! - [`ErrorKind::Transient`]: other 5xx, 400/408 `RequestTimeout`, refused
//!   or reset connections, name resolution failures, timeouts, bodies cut
//!   short by the connection.
//! - [`ErrorKind::Fatal`]: other 4xx, malformed responses (XML, headers),
//!   size mismatches, signing and configuration problems.
//! - [`ErrorKind::Unavailable`]: the circuit breaker is open; nothing was
//!   sent.
//!
//! Only Throttled and Transient are retried.

use std::fmt;
use std::time::Duration;

use crate::credentials::CredentialsError;
use crate::sigv4::SignError;

/// The S3 operation a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `HEAD /<key>`.
    HeadObject,
    /// `GET /<key>` (whole or one range).
    GetObject,
    /// `PUT /<key>` (single request).
    PutObject,
    /// `POST /<key>?uploads`.
    CreateMultipartUpload,
    /// `PUT /<key>?partNumber=&uploadId=`.
    UploadPart,
    /// `POST /<key>?uploadId=`.
    CompleteMultipartUpload,
    /// `DELETE /<key>?uploadId=`.
    AbortMultipartUpload,
    /// `DELETE /<key>`.
    DeleteObject,
    /// `GET /?list-type=2`.
    ListObjectsV2,
    /// `GET /?session` (S3 Express).
    CreateSession,
}

impl Op {
    /// Number of operations.
    pub const COUNT: usize = 10;
    /// Every operation, in index order.
    pub const ALL: [Op; Op::COUNT] = [
        Op::HeadObject,
        Op::GetObject,
        Op::PutObject,
        Op::CreateMultipartUpload,
        Op::UploadPart,
        Op::CompleteMultipartUpload,
        Op::AbortMultipartUpload,
        Op::DeleteObject,
        Op::ListObjectsV2,
        Op::CreateSession,
    ];

    /// The S3 API name.
    pub fn name(self) -> &'static str {
        match self {
            Op::HeadObject => "HeadObject",
            Op::GetObject => "GetObject",
            Op::PutObject => "PutObject",
            Op::CreateMultipartUpload => "CreateMultipartUpload",
            Op::UploadPart => "UploadPart",
            Op::CompleteMultipartUpload => "CompleteMultipartUpload",
            Op::AbortMultipartUpload => "AbortMultipartUpload",
            Op::DeleteObject => "DeleteObject",
            Op::ListObjectsV2 => "ListObjectsV2",
            Op::CreateSession => "CreateSession",
        }
    }

    /// Position in [`Op::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The semantic class of a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The object (or bucket, or upload) does not exist.
    NotFound,
    /// Credentials or signature rejected. Never retried.
    PermissionDenied,
    /// The server asked us to slow down. Retried.
    Throttled,
    /// A failure that may pass: 5xx, connection loss, timeout. Retried.
    Transient,
    /// A failure retrying cannot fix.
    Fatal,
    /// The circuit breaker is open; the request was not sent.
    Unavailable,
}

impl ErrorKind {
    /// Number of kinds.
    pub const COUNT: usize = 6;
    /// Every kind, in index order.
    pub const ALL: [ErrorKind; ErrorKind::COUNT] = [
        ErrorKind::NotFound,
        ErrorKind::PermissionDenied,
        ErrorKind::Throttled,
        ErrorKind::Transient,
        ErrorKind::Fatal,
        ErrorKind::Unavailable,
    ];

    /// True for the kinds that are retried.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Throttled | ErrorKind::Transient)
    }

    /// Position in [`ErrorKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Lowercase words for messages and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::PermissionDenied => "permission denied",
            ErrorKind::Throttled => "throttled",
            ErrorKind::Transient => "transient",
            ErrorKind::Fatal => "fatal",
            ErrorKind::Unavailable => "unavailable",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What went wrong, in detail.
#[derive(Debug, Clone)]
pub enum Cause {
    /// The server answered with an unexpected status.
    Status {
        /// HTTP status.
        status: u16,
        /// S3 error code from the body, when there was one.
        code: Option<String>,
        /// S3 error message.
        message: Option<String>,
        /// `x-amz-request-id` or the body's RequestId.
        request_id: Option<String>,
    },
    /// The connection could not be set up (resolve, TCP, TLS).
    Connect(String),
    /// The exchange failed after connecting (reset, closed mid-body).
    Io(String),
    /// One attempt ran past its deadline.
    Timeout {
        /// The attempt deadline.
        after: Duration,
    },
    /// The operation's overall deadline passed before an attempt could run.
    DeadlineExceeded {
        /// The operation deadline.
        after: Duration,
    },
    /// The object's size is not what the caller expects, or the body was
    /// longer or shorter than announced.
    SizeMismatch {
        /// Bytes expected.
        expected: u64,
        /// Bytes the server announced or sent.
        actual: u64,
    },
    /// A response could not be understood (XML, headers, status for the
    /// request).
    BadResponse(String),
    /// The request could not be signed.
    Sign(SignError),
    /// No usable credentials.
    Credentials(CredentialsError),
    /// The S3 Express session could not be created.
    Session(Box<S3Error>),
    /// The circuit breaker is open.
    BreakerOpen {
        /// Time until it re-arms.
        retry_in: Duration,
    },
    /// The client is configured in a way that cannot work.
    Config(String),
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::Status {
                status,
                code,
                message,
                request_id,
            } => {
                write!(f, "HTTP {status}")?;
                if let Some(code) = code {
                    write!(f, " {code}")?;
                }
                if let Some(message) = message {
                    write!(f, ": {message}")?;
                }
                if let Some(id) = request_id {
                    write!(f, " (request id {id})")?;
                }
                Ok(())
            }
            Cause::Connect(e) => write!(f, "connect: {e}"),
            Cause::Io(e) => write!(f, "connection: {e}"),
            Cause::Timeout { after } => write!(f, "no complete answer within {after:?}"),
            Cause::DeadlineExceeded { after } => {
                write!(f, "operation deadline of {after:?} passed")
            }
            Cause::SizeMismatch { expected, actual } => {
                write!(f, "size mismatch: expected {expected} bytes, got {actual}")
            }
            Cause::BadResponse(e) => write!(f, "bad response: {e}"),
            Cause::Sign(e) => write!(f, "signing: {e}"),
            Cause::Credentials(e) => write!(f, "credentials: {e}"),
            Cause::Session(e) => write!(f, "S3 Express session: {e}"),
            Cause::BreakerOpen { retry_in } => write!(
                f,
                "circuit breaker open after repeated connection failures; retry in {:.1} s",
                retry_in.as_secs_f64()
            ),
            Cause::Config(e) => write!(f, "configuration: {e}"),
        }
    }
}

/// A failed operation.
#[derive(Debug, Clone)]
pub struct S3Error {
    inner: Box<ErrorInner>,
}

#[derive(Debug, Clone)]
struct ErrorInner {
    op: Op,
    key: Option<String>,
    kind: ErrorKind,
    cause: Cause,
    attempts: u32,
    note: Option<&'static str>,
}

impl S3Error {
    pub(crate) fn new(op: Op, key: Option<&str>, kind: ErrorKind, cause: Cause) -> S3Error {
        S3Error {
            inner: Box::new(ErrorInner {
                op,
                key: key.map(str::to_owned),
                kind,
                cause,
                attempts: 0,
                note: None,
            }),
        }
    }

    pub(crate) fn with_attempts(mut self, attempts: u32) -> S3Error {
        self.inner.attempts = attempts;
        self
    }

    pub(crate) fn with_note(mut self, note: &'static str) -> S3Error {
        self.inner.note = Some(note);
        self
    }

    /// The semantic class.
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// The operation that failed.
    pub fn op(&self) -> Op {
        self.inner.op
    }

    /// The object key (or list prefix), when the operation has one.
    pub fn key(&self) -> Option<&str> {
        self.inner.key.as_deref()
    }

    /// The detailed cause.
    pub fn cause(&self) -> &Cause {
        &self.inner.cause
    }

    /// HTTP requests sent for this operation (0 when none was sent).
    pub fn attempts(&self) -> u32 {
        self.inner.attempts
    }

    /// The HTTP status, when the server answered.
    pub fn status(&self) -> Option<u16> {
        match &self.inner.cause {
            Cause::Status { status, .. } => Some(*status),
            Cause::Session(e) => e.status(),
            _ => None,
        }
    }

    /// The S3 error code, when the server sent one.
    pub fn s3_code(&self) -> Option<&str> {
        match &self.inner.cause {
            Cause::Status { code, .. } => code.as_deref(),
            Cause::Session(e) => e.s3_code(),
            _ => None,
        }
    }
}

impl fmt::Display for S3Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = &self.inner;
        write!(f, "S3 {}", e.op)?;
        if let Some(key) = &e.key {
            write!(f, " {key:?}")?;
        }
        write!(f, ": {}: {}", e.kind, e.cause)?;
        match e.attempts {
            0 => {}
            1 => f.write_str(" (1 attempt)")?,
            n => write!(f, " ({n} attempts)")?,
        }
        if let Some(note) = e.note {
            write!(f, "; {note}")?;
        }
        Ok(())
    }
}

impl std::error::Error for S3Error {}

/// One attempt's failure, before it is tied to an operation.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub kind: ErrorKind,
    pub cause: Cause,
    /// Counts toward the circuit breaker: connect failures, resets and
    /// timeouts, never an HTTP status.
    pub connection_level: bool,
}

impl Failure {
    pub fn new(kind: ErrorKind, cause: Cause) -> Failure {
        Failure {
            kind,
            cause,
            connection_level: false,
        }
    }

    pub fn connection(cause: Cause) -> Failure {
        Failure {
            kind: ErrorKind::Transient,
            cause,
            connection_level: true,
        }
    }

    pub fn fatal(cause: Cause) -> Failure {
        Failure::new(ErrorKind::Fatal, cause)
    }

    pub fn bad_response(message: impl Into<String>) -> Failure {
        Failure::fatal(Cause::BadResponse(message.into()))
    }

    pub fn is_timeout(&self) -> bool {
        matches!(self.cause, Cause::Timeout { .. })
    }

    pub fn into_error(self, op: Op, key: Option<&str>, attempts: u32) -> S3Error {
        S3Error::new(op, key, self.kind, self.cause).with_attempts(attempts)
    }
}

/// Classifies an HTTP error status and its S3 code.
pub fn classify_status(status: u16, code: Option<&str>) -> ErrorKind {
    match code {
        Some(
            "AccessDenied"
            | "SignatureDoesNotMatch"
            | "InvalidAccessKeyId"
            | "NotSignedUp"
            | "InvalidToken"
            | "ExpiredToken"
            | "AllAccessDisabled",
        ) => return ErrorKind::PermissionDenied,
        Some("SlowDown" | "Throttling" | "ThrottlingException" | "RequestLimitExceeded") => {
            return ErrorKind::Throttled
        }
        Some("RequestTimeout" | "InternalError" | "ServiceUnavailable") => {
            return ErrorKind::Transient
        }
        // A fresh signature carries the same clock: retrying cannot help.
        Some("RequestTimeTooSkewed") => return ErrorKind::Fatal,
        Some("NoSuchKey" | "NoSuchBucket" | "NoSuchUpload") => return ErrorKind::NotFound,
        _ => {}
    }
    match status {
        404 => ErrorKind::NotFound,
        401 | 403 => ErrorKind::PermissionDenied,
        408 => ErrorKind::Transient,
        429 => ErrorKind::Throttled,
        500..=599 => ErrorKind::Transient,
        _ => ErrorKind::Fatal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_codes_map_to_kinds() {
        assert_eq!(classify_status(404, None), ErrorKind::NotFound);
        assert_eq!(classify_status(404, Some("NoSuchKey")), ErrorKind::NotFound);
        assert_eq!(classify_status(403, None), ErrorKind::PermissionDenied);
        assert_eq!(
            classify_status(403, Some("SignatureDoesNotMatch")),
            ErrorKind::PermissionDenied
        );
        assert_eq!(
            classify_status(400, Some("InvalidAccessKeyId")),
            ErrorKind::PermissionDenied
        );
        assert_eq!(classify_status(503, Some("SlowDown")), ErrorKind::Throttled);
        assert_eq!(classify_status(429, None), ErrorKind::Throttled);
        assert_eq!(classify_status(503, None), ErrorKind::Transient);
        assert_eq!(
            classify_status(500, Some("InternalError")),
            ErrorKind::Transient
        );
        assert_eq!(
            classify_status(400, Some("RequestTimeout")),
            ErrorKind::Transient
        );
        assert_eq!(
            classify_status(400, Some("InvalidArgument")),
            ErrorKind::Fatal
        );
        assert_eq!(classify_status(416, None), ErrorKind::Fatal);
        assert!(ErrorKind::Throttled.is_retryable() && ErrorKind::Transient.is_retryable());
        assert!(!ErrorKind::PermissionDenied.is_retryable());
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(op.index(), i);
        }
        for (i, kind) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }

    #[test]
    fn display_names_operation_key_status_and_code() {
        let e = S3Error::new(
            Op::PutObject,
            Some("m@0000001a@0@ab"),
            ErrorKind::PermissionDenied,
            Cause::Status {
                status: 403,
                code: Some("SignatureDoesNotMatch".into()),
                message: Some("bad signature".into()),
                request_id: None,
            },
        )
        .with_attempts(1);
        let text = e.to_string();
        assert_eq!(
            text,
            "S3 PutObject \"m@0000001a@0@ab\": permission denied: HTTP 403 SignatureDoesNotMatch: bad signature (1 attempt)"
        );
        assert_eq!(e.status(), Some(403));
        assert_eq!(e.s3_code(), Some("SignatureDoesNotMatch"));
    }
}
