//! Why layout detection refuses a registration's tensors.

use std::fmt;

/// Why a registration's tensors describe no KV layout this server moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectError {
    /// A layout, dtype or configuration no transfer path implements.
    Unsupported(String),
    /// The registration is malformed.
    Invalid(String),
    /// A tensor view reaches past the end of the memory the worker shares.
    SegmentTooSmall {
        name: String,
        needed_bytes: u64,
        segment_bytes: u64,
    },
}

impl fmt::Display for DetectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DetectError::Unsupported(msg) => write!(f, "unsupported: {msg}"),
            DetectError::Invalid(msg) => write!(f, "invalid: {msg}"),
            DetectError::SegmentTooSmall {
                name,
                needed_bytes,
                segment_bytes,
            } => write!(
                f,
                "shm segment '{name}' is {segment_bytes} bytes but the tensor view needs \
                 {needed_bytes}"
            ),
        }
    }
}

impl std::error::Error for DetectError {}

pub(crate) fn invalid(msg: impl Into<String>) -> DetectError {
    DetectError::Invalid(msg.into())
}

pub(crate) fn unsupported(msg: impl Into<String>) -> DetectError {
    DetectError::Unsupported(msg.into())
}
