//! Control requests from the HTTP API to the front end.
//!
//! The front thread owns every piece of server state (sessions, registrations, the
//! shards' mailboxes), so the HTTP executor asks it through the front's event queue
//! and awaits the answer on a oneshot channel. The front answers `/status` and
//! `/metrics` with a snapshot of its state and the shards' reports, rendered here.

use kvshard_io::mailbox::NotifySender;

use kvshard_dataplane::messages::FrontEvent;
use kvshard_messages::control::{ControlRequest, ControlResponse};
use kvshard_messages::oneshot;

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
    /// A body the front left to render (`/status`, `/metrics`) is rendered here, on
    /// the caller's thread.
    pub async fn call(&self, req: ControlRequest) -> ControlResponse {
        let (tx, rx) = oneshot::channel();
        self.tx.send(FrontEvent::Control(req, tx));
        rx.await.map_or_else(
            || ControlResponse::error(503, "server is shutting down"),
            ControlResponse::rendered,
        )
    }
}
