//! S3 Express One Zone session auth for directory buckets.
//!
//! `CreateSession` (`GET /?session` on the bucket's zonal host, signed with
//! the base credentials under service `s3express`) returns credentials
//! valid for five minutes. Data-plane requests are signed with them under
//! [`crate::sigv4::SigningSettings::s3_express_data_plane`]: service
//! `s3express`, token in `x-amz-s3session-token`, never
//! `x-amz-security-token`.
//!
//! The cache keeps one session per bucket. A request uses the cached
//! session while it has more than [`ExpressConfig::expiry_margin`] left (the
//! CRT's 5 s). When it has less than [`ExpressConfig::refresh_before`] left
//! (the CRT's 60 s), the request still uses it and starts one background
//! CreateSession, so no request waits for a refresh while a valid session
//! exists. Only when no usable session exists does a request wait, and
//! concurrent requests then share one CreateSession. A request refused with
//! `ExpiredToken`/`InvalidToken` drops the session, and its retry creates a
//! new one.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use glommio::sync::Semaphore;

use crate::credentials::Credentials;
use crate::error::{Cause, Failure, S3Error};

/// Session refresh settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpressConfig {
    /// Start a background refresh when the session has less than this left.
    /// Default 60 s.
    pub refresh_before: Duration,
    /// Do not use a session with less than this left. Default 5 s.
    pub expiry_margin: Duration,
}

impl Default for ExpressConfig {
    fn default() -> Self {
        ExpressConfig {
            refresh_before: Duration::from_secs(60),
            expiry_margin: Duration::from_secs(5),
        }
    }
}

impl ExpressConfig {
    /// Checks the settings; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.refresh_before <= self.expiry_margin {
            return Err(format!(
                "express refresh_before ({:?}) must exceed expiry_margin ({:?})",
                self.refresh_before, self.expiry_margin
            ));
        }
        Ok(())
    }
}

/// What the cache needs from the client that owns it.
pub(crate) trait CreateSession: Sized + 'static {
    /// Wall-clock time used for session expiry.
    fn wall_now(&self) -> SystemTime;

    /// CreateSession for the client's bucket, signed with the base
    /// credentials under service `s3express`. The credentials it returns
    /// carry their expiry.
    async fn create_session(self: &Rc<Self>) -> Result<Credentials, S3Error>;

    /// The client's session cache, the one a background refresh updates.
    fn session_cache(&self) -> Option<&SessionCache<Self>>;

    /// Called after a background refresh stored a new session.
    fn note_session_refresh(&self);
}

struct Session {
    creds: Rc<Credentials>,
    expires_at: SystemTime,
}

/// The session of the client's bucket (the client serves one bucket).
pub(crate) struct SessionCache<C> {
    cfg: ExpressConfig,
    session: RefCell<Option<Session>>,
    refreshing: Cell<bool>,
    create_lock: Rc<Semaphore>,
    client: PhantomData<fn(&C)>,
}

impl<C: CreateSession> SessionCache<C> {
    pub fn new(cfg: ExpressConfig) -> SessionCache<C> {
        SessionCache {
            cfg,
            session: RefCell::new(None),
            refreshing: Cell::new(false),
            create_lock: Rc::new(Semaphore::new(1)),
            client: PhantomData,
        }
    }

    /// A session usable now, if cached. Starts a background refresh when
    /// it is close to expiry.
    fn usable(&self, client: &Rc<C>) -> Option<Rc<Credentials>> {
        let now = client.wall_now();
        let (creds, expires_at) = {
            let session = self.session.borrow();
            let s = session.as_ref()?;
            (s.creds.clone(), s.expires_at)
        };
        if expires_at <= now + self.cfg.expiry_margin {
            return None;
        }
        if expires_at <= now + self.cfg.refresh_before && !self.refreshing.get() {
            self.refreshing.set(true);
            let client = client.clone();
            // glommio polls a spawned task at once, inline: no borrow of the
            // session may be held here (the refresh can finish in that poll).
            glommio::spawn_local(async move {
                refresh_session_in_background(client).await;
            })
            .detach();
        }
        Some(creds)
    }

    fn store(&self, creds: Credentials) -> Rc<Credentials> {
        let expires_at = creds
            .expiry()
            .expect("parse_create_session always sets the expiry");
        let creds = Rc::new(creds);
        *self.session.borrow_mut() = Some(Session {
            creds: creds.clone(),
            expires_at,
        });
        creds
    }

    /// Drops the cached session (the server refused its token).
    pub fn invalidate(&self) {
        *self.session.borrow_mut() = None;
    }

    /// Session credentials for a data-plane request.
    pub async fn credentials(&self, client: &Rc<C>) -> Result<Rc<Credentials>, Failure> {
        if let Some(c) = self.usable(client) {
            return Ok(c);
        }
        let _lock = self
            .create_lock
            .acquire_permit(1)
            .await
            .expect("the session lock is never closed");
        if let Some(c) = self.usable(client) {
            return Ok(c);
        }
        match create_session_boxed(client).await {
            Ok(creds) => Ok(self.store(creds)),
            Err(e) => Err(Failure {
                kind: e.kind(),
                cause: Cause::Session(Box::new(e)),
                connection_level: false,
            }),
        }
    }

    /// Records the result of a background refresh.
    fn refreshed(&self, creds: Credentials) {
        self.store(creds);
        self.refreshing.set(false);
    }

    fn refresh_failed(&self) {
        self.refreshing.set(false);
    }
}

/// CreateSession behind a box: it signs and sends through the same path as
/// the data-plane request that asked for the session, so the future types
/// would otherwise contain themselves.
fn create_session_boxed<C: CreateSession>(
    client: &Rc<C>,
) -> Pin<Box<dyn Future<Output = Result<Credentials, S3Error>> + '_>> {
    Box::pin(client.create_session())
}

async fn refresh_session_in_background<C: CreateSession>(client: Rc<C>) {
    let Some(cache) = client.session_cache() else {
        return;
    };
    match create_session_boxed(&client).await {
        Ok(creds) => {
            cache.refreshed(creds);
            client.note_session_refresh();
        }
        Err(e) => {
            log::warn!("s3 express: background session refresh failed: {e}");
            cache.refresh_failed();
        }
    }
}
