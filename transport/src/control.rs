//! Control requests from the HTTP API to the front end.
//!
//! The front thread owns every piece of server state (sessions, registrations, the
//! shards' mailboxes), so the HTTP executor asks it through the front's event queue
//! and awaits the answer on a oneshot channel.

use kvshard_io::mailbox::NotifySender;

use crate::front::FrontEvent;
use crate::oneshot;

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
        instance_id: i64,
        block_ids: Vec<i64>,
        chunk_size_blocks: usize,
        layerwise: bool,
    },
    /// `GET /config/adapters`: the L2 adapters in cascade order.
    ConfigAdapters,
    /// `GET /config`.
    Config,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ControlBody {
    Json(serde_json::Value),
    Text(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ControlResponse {
    pub status: u16,
    pub body: ControlBody,
}

impl ControlResponse {
    pub fn json(value: serde_json::Value) -> Self {
        ControlResponse {
            status: 200,
            body: ControlBody::Json(value),
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

/// What the HTTP side holds to talk to the front.
#[derive(Clone)]
pub struct ControlHandle {
    tx: NotifySender<FrontEvent>,
}

impl ControlHandle {
    pub fn new(tx: NotifySender<FrontEvent>) -> Self {
        ControlHandle { tx }
    }

    /// Sends `req` to the front and waits for its answer (503 if the front is gone).
    pub async fn call(&self, req: ControlRequest) -> ControlResponse {
        let (tx, rx) = oneshot::channel();
        self.tx.send(FrontEvent::Control(req, tx));
        rx.await
            .unwrap_or_else(|| ControlResponse::error(503, "server is shutting down"))
    }
}
