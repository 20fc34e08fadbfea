//! The HTTP API's requests to the front and the front's answers: each
//! request travels with a [`Responder`] on the front's event queue, and the
//! answer comes back on it (rendered on the HTTP side when the front sent a
//! snapshot to render).

use crate::oneshot;

use kvshard_wire::InstanceId;

#[derive(Debug, Clone, PartialEq)]
pub enum ControlRequest {
    /// `GET /status`: the JSON `lmcache describe kvcache` reads.
    Status,
    /// `GET /metrics`: Prometheus text exposition.
    Metrics,
    /// `POST /metrics/reset`.
    ResetMetrics,
    /// `POST /cache/clear` (tier l1 only).
    Clear {
        force: bool,
    },
    /// `PUT /quota/{salt}`; the salt is already mapped from the `_default` sentinel.
    QuotaSet {
        cache_salt: String,
        limit_gb: f64,
    },
    QuotaGet {
        cache_salt: String,
    },
    QuotaDelete {
        cache_salt: String,
    },
    QuotaList,
    /// `POST /cache/checksums` (lmcache_driven registrations only).
    Checksums {
        instance_id: InstanceId,
        block_ids: Vec<i64>,
        chunk_size_blocks: usize,
        layerwise: bool,
    },
    /// `GET /config/adapters`: the L2 adapters in cascade order.
    ConfigAdapters,
    /// `GET /config`.
    Config,
}

/// Builds a body from a snapshot the front took, away from the front's thread.
pub type RenderBody = Box<dyn FnOnce() -> ControlBody + Send>;

pub enum ControlBody {
    Json(serde_json::Value),
    Text(String),
    /// To be rendered by the receiver ([`ControlResponse::rendered`]); never itself
    /// a `Render`.
    Render(RenderBody),
}

impl std::fmt::Debug for ControlBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ControlBody::Json(v) => f.debug_tuple("Json").field(v).finish(),
            ControlBody::Text(t) => f.debug_tuple("Text").field(t).finish(),
            ControlBody::Render(_) => f.write_str("Render(..)"),
        }
    }
}

/// Rendered bodies compare by content; a `Render` equals nothing.
impl PartialEq for ControlBody {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ControlBody::Json(a), ControlBody::Json(b)) => a == b,
            (ControlBody::Text(a), ControlBody::Text(b)) => a == b,
            _ => false,
        }
    }
}

#[derive(Debug, PartialEq)]
pub struct ControlResponse {
    pub status: u16,
    pub body: ControlBody,
}

impl ControlResponse {
    /// A 200 whose body `render` builds on the receiving side.
    pub fn render(render: impl FnOnce() -> ControlBody + Send + 'static) -> Self {
        ControlResponse {
            status: 200,
            body: ControlBody::Render(Box::new(render)),
        }
    }

    /// The response with a [`ControlBody::Render`] body rendered, on the calling thread.
    pub fn rendered(self) -> Self {
        match self.body {
            ControlBody::Render(render) => ControlResponse {
                status: self.status,
                body: render(),
            },
            body => ControlResponse {
                status: self.status,
                body,
            },
        }
    }

    pub fn json(value: serde_json::Value) -> Self {
        ControlResponse {
            status: 200,
            body: ControlBody::Json(value),
        }
    }

    /// A 400 as the quota API words its refusals (`{"error": ...}`).
    pub fn bad_request(message: impl Into<String>) -> Self {
        ControlResponse {
            status: 400,
            body: ControlBody::Json(serde_json::json!({ "error": message.into() })),
        }
    }

    pub fn error(status: u16, message: impl Into<String>) -> Self {
        ControlResponse {
            status,
            body: ControlBody::Json(serde_json::json!({ "detail": message.into() })),
        }
    }
}

pub type Responder = oneshot::Sender<ControlResponse>;
