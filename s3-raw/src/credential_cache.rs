//! The base credentials of one client: static, or from the provider chain
//! with their expiry, refreshed ahead of it.
//!
//! Chain credentials are resolved on the shard's own executor
//! ([`crate::credentials::resolve_credentials`] with
//! [`crate::credential_http::HttpFetcher`]): the profile files are read on
//! glommio's blocking pool, and the HTTP sources are async HTTP/1.1 with a
//! time limit on every exchange, so a metadata service that does not answer
//! stalls only the fetch, never the executor.
//!
//! As with S3 Express sessions ([`crate::express`]): a request signs with
//! the cached credentials while they have more than
//! [`CredentialsRefreshConfig::expiry_margin`] left. When less than
//! [`CredentialsRefreshConfig::refresh_before`] is left, the request still
//! uses them and starts one background fetch, so no request waits for a
//! refresh while valid credentials exist. A failed background fetch is
//! logged and tried again [`CredentialsRefreshConfig::retry_after`] later,
//! the old credentials staying in use meanwhile. Only when nothing usable
//! is cached (the first fetch, or after the expiry) does a request wait, and
//! concurrent requests then share one fetch. If that fetch fails, the
//! requests fail with [`Cause::Credentials`] (fatal, not retried), and for
//! `retry_after` further requests get the same error at once instead of
//! each fetching again. A fetch runs to its end even when the request that
//! started it is dropped (an attempt timeout), so its result is not lost.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime};

use glommio::sync::Semaphore;

use crate::credential_http::{FetchConfig, HttpFetcher};
use crate::credentials::{
    resolve_credentials, CredentialSource, Credentials, CredentialsError, Env,
};
use crate::error::{Cause, Failure};
use crate::time::AmzDate;

/// Chain credentials are fetched again when they expire within this
/// (the default of [`CredentialsRefreshConfig::refresh_before`]).
pub const CREDENTIALS_REFRESH_MARGIN: Duration = Duration::from_secs(300);

/// Refresh and fetch settings of chain credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialsRefreshConfig {
    /// Start a background fetch when the credentials have less than this
    /// left. Default [`CREDENTIALS_REFRESH_MARGIN`] (5 min, as the SDKs).
    pub refresh_before: Duration,
    /// Do not sign with credentials that have less than this left (wait for
    /// a fetch instead). Default 15 s.
    pub expiry_margin: Duration,
    /// After a failed fetch: wait this long before a background refresh is
    /// tried again, and fail requests at once for this long when nothing
    /// usable is cached. Default 5 s.
    pub retry_after: Duration,
    /// Limit of the name lookup and of each TCP connect attempt of one
    /// credentials request. Default 2 s.
    pub connect_timeout: Duration,
    /// Limit of the rest of one credentials request (TLS, request, whole
    /// answer). Default 5 s.
    pub read_timeout: Duration,
}

impl Default for CredentialsRefreshConfig {
    fn default() -> Self {
        let fetch = FetchConfig::default();
        CredentialsRefreshConfig {
            refresh_before: CREDENTIALS_REFRESH_MARGIN,
            expiry_margin: Duration::from_secs(15),
            retry_after: Duration::from_secs(5),
            connect_timeout: fetch.connect_timeout,
            read_timeout: fetch.read_timeout,
        }
    }
}

impl CredentialsRefreshConfig {
    /// Checks the settings; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.refresh_before <= self.expiry_margin {
            return Err(format!(
                "credentials refresh_before ({:?}) must exceed expiry_margin ({:?})",
                self.refresh_before, self.expiry_margin
            ));
        }
        if self.connect_timeout.is_zero() || self.read_timeout.is_zero() {
            return Err("credentials connect_timeout and read_timeout must be positive".to_owned());
        }
        Ok(())
    }
}

/// Counters of the chain fetches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CacheStats {
    pub fetched: u64,
    pub refreshed: u64,
    pub refresh_failures: u64,
}

enum Source {
    Static(Rc<Credentials>),
    Chain { env: Env, fetcher: HttpFetcher },
}

/// The base credentials of one client.
pub(crate) struct CredentialsCache {
    cfg: CredentialsRefreshConfig,
    source: Source,
    current: RefCell<Option<Rc<Credentials>>>,
    refreshing: Cell<bool>,
    /// No background refresh starts before this.
    refresh_not_before: Cell<Option<Instant>>,
    /// The last failed waited-for fetch.
    failure: RefCell<Option<(Instant, CredentialsError)>>,
    /// Held by whoever is fetching.
    fetch_lock: Rc<Semaphore>,
    stats: Cell<CacheStats>,
}

fn credentials_failure(error: CredentialsError) -> Failure {
    Failure::fatal(Cause::Credentials(error))
}

impl CredentialsCache {
    /// Fixed credentials.
    pub fn fixed(creds: Credentials) -> CredentialsCache {
        CredentialsCache::with_source(
            CredentialsRefreshConfig::default(),
            Source::Static(Rc::new(creds)),
        )
    }

    /// The provider chain over `env`, fetching with `fetch`.
    pub fn chain(cfg: CredentialsRefreshConfig, env: Env, fetch: FetchConfig) -> CredentialsCache {
        let fetcher = HttpFetcher::new(fetch);
        CredentialsCache::with_source(cfg, Source::Chain { env, fetcher })
    }

    fn with_source(cfg: CredentialsRefreshConfig, source: Source) -> CredentialsCache {
        CredentialsCache {
            cfg,
            source,
            current: RefCell::new(None),
            refreshing: Cell::new(false),
            refresh_not_before: Cell::new(None),
            failure: RefCell::new(None),
            fetch_lock: Rc::new(Semaphore::new(1)),
            stats: Cell::new(CacheStats::default()),
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.stats.get()
    }

    fn bump(&self, f: impl FnOnce(&mut CacheStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    /// Credentials to sign a request with.
    pub async fn credentials(self: &Rc<Self>) -> Result<Rc<Credentials>, Failure> {
        if let Source::Static(creds) = &self.source {
            return Ok(creds.clone());
        }
        if let Some(c) = self.usable() {
            return Ok(c);
        }
        let permit = self
            .fetch_lock
            .acquire_static_permit(1)
            .await
            .expect("the credentials lock is never closed");
        if let Some(c) = self.usable() {
            return Ok(c);
        }
        if let Some((at, error)) = &*self.failure.borrow() {
            if at.elapsed() < self.cfg.retry_after {
                return Err(credentials_failure(error.clone()));
            }
        }
        // The fetch is a task of its own holding the lock: if this request
        // is dropped, the fetch still completes and is stored, and nobody
        // starts a second one meanwhile.
        let this = self.clone();
        let fetch = glommio::spawn_local(async move {
            let _permit = permit;
            let result = this.fetch().await;
            match &result {
                Ok(creds) => {
                    *this.current.borrow_mut() = Some(creds.clone());
                    *this.failure.borrow_mut() = None;
                }
                Err(e) => *this.failure.borrow_mut() = Some((Instant::now(), e.clone())),
            }
            result
        })
        .detach();
        match fetch.await {
            Some(result) => result.map_err(credentials_failure),
            None => Err(credentials_failure(CredentialsError::Http {
                source: "credential chain",
                message: "the fetch task was cancelled".to_owned(),
            })),
        }
    }

    /// The cached credentials if they may still be used; starts a
    /// background refresh when they are close to expiry.
    fn usable(self: &Rc<Self>) -> Option<Rc<Credentials>> {
        let creds = self.current.borrow().clone()?;
        let Some(expiry) = creds.expiry() else {
            return Some(creds);
        };
        let now = SystemTime::now();
        if expiry <= now + self.cfg.expiry_margin {
            return None;
        }
        if expiry <= now + self.cfg.refresh_before {
            self.start_refresh();
        }
        Some(creds)
    }

    fn start_refresh(self: &Rc<Self>) {
        if self.refreshing.get() {
            return;
        }
        if self
            .refresh_not_before
            .get()
            .is_some_and(|t| Instant::now() < t)
        {
            return;
        }
        self.refreshing.set(true);
        let this = self.clone();
        glommio::spawn_local(async move {
            let _permit = this
                .fetch_lock
                .acquire_static_permit(1)
                .await
                .expect("the credentials lock is never closed");
            // A waited-for fetch may have replaced them meanwhile.
            let still_due = this
                .current
                .borrow()
                .as_ref()
                .is_none_or(|c| c.expires_within(SystemTime::now(), this.cfg.refresh_before));
            if still_due {
                match this.fetch().await {
                    Ok(creds) => {
                        *this.current.borrow_mut() = Some(creds);
                        this.bump(|s| s.refreshed += 1);
                    }
                    Err(e) => {
                        log::warn!(
                            "s3: refreshing credentials failed, still using the current ones: {e}"
                        );
                        this.bump(|s| s.refresh_failures += 1);
                    }
                }
            }
            this.refresh_not_before
                .set(Some(Instant::now() + this.cfg.retry_after));
            this.refreshing.set(false);
        })
        .detach();
    }

    /// Resolves the chain.
    async fn fetch(&self) -> Result<Rc<Credentials>, CredentialsError> {
        let Source::Chain { env, fetcher } = &self.source else {
            unreachable!("static credentials are never fetched");
        };
        let creds = resolve_credentials(env, fetcher).await?;
        if let Some(expiry) = creds.expiry() {
            if expiry <= SystemTime::now() + self.cfg.expiry_margin {
                let at = AmzDate::from_system_time(expiry)
                    .map(|d| d.to_string())
                    .unwrap_or_else(|_| format!("{expiry:?}"));
                return Err(CredentialsError::Invalid {
                    source: source_label(creds.source()),
                    reason: format!(
                        "the credentials expire at {at}, less than {:?} from now",
                        self.cfg.expiry_margin
                    ),
                });
            }
        }
        log::info!(
            "s3: credentials from {} (access key {})",
            source_label(creds.source()),
            creds.access_key_id()
        );
        self.bump(|s| s.fetched += 1);
        Ok(Rc::new(creds))
    }
}

fn source_label(source: &CredentialSource) -> String {
    match source {
        CredentialSource::Static => "static configuration".to_owned(),
        CredentialSource::Environment => "environment".to_owned(),
        CredentialSource::SharedCredentialsFile { profile } => {
            format!("profile {profile:?} in the shared credentials file")
        }
        CredentialSource::ConfigFile { profile } => {
            format!("profile {profile:?} in the config file")
        }
        CredentialSource::WebIdentity => "web identity (STS)".to_owned(),
        CredentialSource::Container => "container credentials endpoint".to_owned(),
        CredentialSource::Imds => "IMDSv2".to_owned(),
        CredentialSource::S3ExpressSession => "S3 Express session".to_owned(),
    }
}
