//! The `s3` adapter: one object per chunk in a bucket, named as lmcache
//! 0.5.6's s3 adapter names them ([`naming::s3_object_name`]), so a bucket
//! written by `lmcache server` is read by kvshard and the other way round.
//!
//! Each shard drives its own instance over its own [`ObjectStore`] (its own
//! S3 client: connections, signer, sessions). What 0.5.6 does, kept:
//! - lookups HEAD the keys whose size this shard does not know yet; a hit is
//!   locked (a reference count) until unlocked, and `delete` skips locked
//!   keys;
//! - a PUT is atomic in S3, so a key is visible only once complete; a key this
//!   shard knows to be stored is not written again;
//! - loads GET straight into the L1 object; a size that differs from the L1
//!   object's is a failure, never a partial load.
//!
//! What differs: every batch runs its requests concurrently up to this
//! shard's share of `s3_max_inflight_requests`; a key that turns out missing
//! on load is forgotten, so the next lookup asks the bucket again (another
//! node may have evicted it).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::rc::Rc;

use std::time::Duration;

use futures_util::future::join_all;
use kvshard_s3_raw::addressing::{resolve_bucket, AddressingConfig};
use kvshard_s3_raw::breaker::BreakerConfig;
use kvshard_s3_raw::client::{CredentialsConfig, S3Client, S3ClientConfig};
use kvshard_s3_raw::credentials::{Credentials, Env};
use kvshard_s3_raw::{ErrorKind, RecvRegion, S3Error, SendRegion};
use serde_json::json;

use crate::keys::ObjectKey;

use super::config::{S3Config, GIB};
use super::naming::{check_key, parse_s3_object_name, s3_object_name};
use super::{KeyPage, L2Adapter, LocalFut, ObjectBytes, StoreResult};

/// Why an object-store request failed, in the few kinds the adapter treats
/// differently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// The object (or bucket) does not exist.
    NotFound,
    /// Credentials refused: a configuration problem, not retried.
    PermissionDenied,
    /// The endpoint is unreachable or its circuit breaker is open.
    Unavailable,
    /// Anything else (5xx after retries, malformed response, size mismatch).
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError {
    pub kind: StoreErrorKind,
    pub message: String,
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

/// One page of an object listing: (object name, size) pairs and the token of
/// the next page.
pub type ListPage = (Vec<(String, u64)>, Option<String>);

/// The object-store operations the adapter needs, on full object names
/// (already prefixed). Implemented by the S3 client of a shard.
pub trait ObjectStore {
    /// Stores `body` as `name`, whole or not at all.
    fn put<'a>(&'a self, name: &'a str, body: ObjectBytes) -> LocalFut<'a, Result<(), StoreError>>;
    /// Reads `name` into `dest`; an object whose size differs from
    /// `dest.len()` is an error and `dest` is then garbage.
    fn get_into<'a>(
        &'a self,
        name: &'a str,
        dest: ObjectBytes,
    ) -> LocalFut<'a, Result<(), StoreError>>;
    /// The object's size, `None` when it does not exist.
    fn head<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<Option<u64>, StoreError>>;
    /// Deletes `name`; deleting a missing object succeeds.
    fn delete<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<(), StoreError>>;
    /// One page of the names starting with `prefix`.
    fn list<'a>(
        &'a self,
        prefix: &'a str,
        continuation: Option<String>,
        max_keys: usize,
    ) -> LocalFut<'a, Result<ListPage, StoreError>>;
    /// Client health for `/status` (breaker, connections, counters; never
    /// secrets).
    fn status(&self) -> serde_json::Value;
}

#[derive(Default)]
struct Counters {
    puts: Cell<u64>,
    gets: Cell<u64>,
    heads: Cell<u64>,
    deletes: Cell<u64>,
    errors: Cell<u64>,
    permission_errors: Cell<u64>,
    unavailable_errors: Cell<u64>,
}

pub struct S3Adapter {
    shard: usize,
    store: Rc<dyn ObjectStore>,
    /// `<s3_key_prefix>/`, or empty.
    prefix: String,
    endpoint: String,
    region: String,
    capacity_bytes: u64,
    /// Requests of this shard in flight at once.
    inflight: glommio::sync::Semaphore,
    inflight_limit: u64,
    /// Sizes of objects known to be in the bucket.
    sizes: RefCell<HashMap<ObjectKey, u64>>,
    locks: RefCell<HashMap<ObjectKey, u32>>,
    counters: Counters,
    /// First error of each kind is logged at warn, the rest counted.
    warned: Cell<u8>,
}

impl S3Adapter {
    /// This shard's adapter over `store`: `1/num_shards` of the capacity and
    /// of the in-flight request limit (at least one).
    pub fn new(
        cfg: &S3Config,
        store: Rc<dyn ObjectStore>,
        shard: usize,
        num_shards: usize,
    ) -> S3Adapter {
        let shards = num_shards.max(1) as u64;
        let inflight_limit = (u64::from(cfg.max_inflight_requests) / shards).max(1);
        let prefix = if cfg.key_prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", cfg.key_prefix)
        };
        S3Adapter {
            shard,
            store,
            prefix,
            endpoint: cfg.endpoint.clone(),
            region: cfg.region.clone(),
            capacity_bytes: (cfg.max_capacity_gb * GIB) as u64 / shards,
            inflight: glommio::sync::Semaphore::new(inflight_limit),
            inflight_limit,
            sizes: RefCell::new(HashMap::new()),
            locks: RefCell::new(HashMap::new()),
            counters: Counters::default(),
            warned: Cell::new(0),
        }
    }

    fn name_of(&self, key: &ObjectKey) -> Option<String> {
        if let Err(e) = check_key(key) {
            log::warn!("s3 adapter: key {key:?} has no object name: {e}");
            return None;
        }
        let mut s = self.prefix.clone();
        s.push_str(&s3_object_name(key));
        Some(s)
    }

    fn failed(&self, op: &str, name: &str, e: &StoreError) {
        let c = &self.counters;
        c.errors.set(c.errors.get() + 1);
        let bit = match e.kind {
            StoreErrorKind::PermissionDenied => {
                c.permission_errors.set(c.permission_errors.get() + 1);
                1
            }
            StoreErrorKind::Unavailable => {
                c.unavailable_errors.set(c.unavailable_errors.get() + 1);
                2
            }
            StoreErrorKind::NotFound => 4,
            StoreErrorKind::Other => 8,
        };
        if self.warned.get() & bit == 0 {
            self.warned.set(self.warned.get() | bit);
            log::warn!(
                "s3 adapter (shard {}): {op} {name}: {e} (further errors of this kind are counted, not logged)",
                self.shard
            );
        } else {
            log::debug!("s3 adapter (shard {}): {op} {name}: {e}", self.shard);
        }
    }

    async fn permit(&self) -> glommio::sync::Permit<'_> {
        self.inflight
            .acquire_permit(1)
            .await
            .expect("the semaphore is never closed")
    }

    async fn store_one(&self, key: &ObjectKey, body: ObjectBytes) -> StoreResult {
        if self.sizes.borrow().contains_key(key) {
            return StoreResult::Exists;
        }
        let Some(name) = self.name_of(key) else {
            return StoreResult::Failed;
        };
        let _p = self.permit().await;
        self.counters.puts.set(self.counters.puts.get() + 1);
        match self.store.put(&name, body).await {
            Ok(()) => {
                let size = body.len() as u64;
                self.sizes.borrow_mut().insert(key.clone(), size);
                StoreResult::Stored(size)
            }
            Err(e) => {
                self.failed("PUT", &name, &e);
                StoreResult::Failed
            }
        }
    }

    async fn size_of(&self, key: &ObjectKey) -> Option<u64> {
        if let Some(s) = self.sizes.borrow().get(key) {
            return Some(*s);
        }
        let name = self.name_of(key)?;
        let _p = self.permit().await;
        self.counters.heads.set(self.counters.heads.get() + 1);
        match self.store.head(&name).await {
            Ok(Some(size)) if size > 0 => {
                self.sizes.borrow_mut().insert(key.clone(), size);
                Some(size)
            }
            Ok(_) => None,
            Err(e) => {
                self.failed("HEAD", &name, &e);
                None
            }
        }
    }

    async fn load_one(&self, key: &ObjectKey, dest: ObjectBytes) -> bool {
        let Some(name) = self.name_of(key) else {
            return false;
        };
        if let Some(size) = self.sizes.borrow().get(key) {
            if *size != dest.len() as u64 {
                log::warn!(
                    "s3 adapter: {name} holds {size} bytes, the L1 object has {}",
                    dest.len()
                );
                return false;
            }
        }
        let _p = self.permit().await;
        self.counters.gets.set(self.counters.gets.get() + 1);
        match self.store.get_into(&name, dest).await {
            Ok(()) => true,
            Err(e) => {
                if e.kind == StoreErrorKind::NotFound {
                    // Evicted by another node since the lookup.
                    self.sizes.borrow_mut().remove(key);
                }
                self.failed("GET", &name, &e);
                false
            }
        }
    }

    async fn delete_one(&self, key: &ObjectKey) -> Option<u64> {
        if self.locks.borrow().contains_key(key) {
            return None;
        }
        let size = self.size_of(key).await?;
        // A lookup may have locked it while the HEAD ran.
        if self.locks.borrow().contains_key(key) {
            return None;
        }
        let name = self.name_of(key)?;
        let _p = self.permit().await;
        if self.locks.borrow().contains_key(key) {
            return None;
        }
        self.counters.deletes.set(self.counters.deletes.get() + 1);
        match self.store.delete(&name).await {
            Ok(()) => {
                self.sizes.borrow_mut().remove(key);
                Some(size)
            }
            Err(e) => {
                self.failed("DELETE", &name, &e);
                None
            }
        }
    }
}

impl L2Adapter for S3Adapter {
    fn kind(&self) -> &'static str {
        "s3"
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn store<'a>(
        &'a self,
        items: &'a [(ObjectKey, ObjectBytes)],
    ) -> LocalFut<'a, Vec<StoreResult>> {
        Box::pin(join_all(items.iter().map(|(k, b)| self.store_one(k, *b))))
    }

    fn lookup_and_lock<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>> {
        Box::pin(async move {
            let sizes = join_all(keys.iter().map(|k| self.size_of(k))).await;
            let mut locks = self.locks.borrow_mut();
            for (key, size) in keys.iter().zip(&sizes) {
                if size.is_some() {
                    *locks.entry(key.clone()).or_insert(0) += 1;
                }
            }
            sizes
        })
    }

    fn load<'a>(&'a self, items: &'a [(ObjectKey, ObjectBytes)]) -> LocalFut<'a, Vec<bool>> {
        Box::pin(join_all(items.iter().map(|(k, b)| self.load_one(k, *b))))
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut locks = self.locks.borrow_mut();
        for key in keys {
            if let Some(n) = locks.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    locks.remove(key);
                }
            }
        }
    }

    fn delete<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>> {
        Box::pin(join_all(keys.iter().map(|k| self.delete_one(k))))
    }

    fn list<'a>(
        &'a self,
        model_name: Option<&'a str>,
        page_size: usize,
        cursor: Option<String>,
    ) -> LocalFut<'a, io::Result<KeyPage>> {
        Box::pin(async move {
            let mut prefix = self.prefix.clone();
            if let Some(m) = model_name {
                prefix.push_str(m);
                prefix.push('@');
            }
            let (names, next) = self
                .store
                .list(&prefix, cursor, page_size.max(1))
                .await
                .map_err(|e| io::Error::other(format!("s3 adapter: LIST {prefix:?}: {e}")))?;
            let keys = names
                .into_iter()
                .filter_map(|(name, size)| {
                    let key = parse_s3_object_name(name.strip_prefix(&self.prefix)?)?;
                    (model_name.is_none_or(|m| key.model_name == m)).then_some((key, size))
                })
                .collect();
            Ok(KeyPage {
                keys,
                next_cursor: next,
            })
        })
    }

    fn status(&self) -> serde_json::Value {
        let c = &self.counters;
        json!({
            "type": "s3",
            "shard": self.shard,
            "endpoint": self.endpoint,
            "region": self.region,
            "key_prefix": self.prefix,
            "capacity_bytes": self.capacity_bytes,
            "max_inflight_requests": self.inflight_limit,
            "known_objects": self.sizes.borrow().len(),
            "locked_keys": self.locks.borrow().len(),
            "puts": c.puts.get(),
            "gets": c.gets.get(),
            "heads": c.heads.get(),
            "deletes": c.deletes.get(),
            "errors": c.errors.get(),
            "permission_errors": c.permission_errors.get(),
            "unavailable_errors": c.unavailable_errors.get(),
            "client": self.store.status(),
        })
    }
}

// ------------------------------------------------------------ the S3 client

/// A shard's S3 client as the adapter's [`ObjectStore`].
pub struct S3Store {
    client: S3Client,
}

/// L1 memory lent to the client for one PUT. The client's connections may
/// hold slices of it after the operation resolves (until they have written
/// or dropped them); the lease ends when the last one goes, and
/// [`ObjectStore::put`] waits for that before it returns, so the caller's L1
/// lock outlives every read of the memory.
struct L1Lease {
    bytes: ObjectBytes,
    _alive: glommio::channels::local_channel::LocalSender<()>,
}

impl AsRef<[u8]> for L1Lease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the store controller keeps the object read-locked (nobody
        // writes it) until `put` returns, and `put` returns only after this
        // lease is dropped.
        unsafe { self.bytes.as_slice() }
    }
}

fn store_error(e: S3Error) -> StoreError {
    let kind = match e.kind() {
        ErrorKind::NotFound => StoreErrorKind::NotFound,
        ErrorKind::PermissionDenied => StoreErrorKind::PermissionDenied,
        ErrorKind::Unavailable => StoreErrorKind::Unavailable,
        _ => StoreErrorKind::Other,
    };
    StoreError {
        kind,
        message: e.to_string(),
    }
}

impl S3Store {
    /// The client of shard `shard` (of `num_shards`) for `cfg`: its share of
    /// the connections, the breaker's cooldowns, the request deadline.
    pub fn connect(cfg: &S3Config, num_shards: usize) -> io::Result<S3Store> {
        let env_endpoint = std::env::var("AWS_ENDPOINT_URL")
            .ok()
            .filter(|v| !v.is_empty());
        let endpoint_url = cfg.endpoint_url.clone().or(env_endpoint);
        let address = resolve_bucket(&AddressingConfig {
            bucket_url: &cfg.endpoint,
            region: &cfg.region,
            endpoint_url: endpoint_url.as_deref(),
            disable_tls: cfg.disable_tls,
        })
        .map_err(|e| io::Error::other(format!("s3_endpoint {:?}: {e}", cfg.endpoint)))?;
        let credentials = match &cfg.static_credentials {
            Some((id, secret)) => CredentialsConfig::Static(
                Credentials::new(id.clone(), secret.0.clone(), None, None)
                    .map_err(|e| io::Error::other(format!("static S3 credentials: {e}")))?,
            ),
            None => CredentialsConfig::Chain(Env::from_process()),
        };
        let mut c = S3ClientConfig::new(address, cfg.region.clone(), credentials);
        c.prefer_http2 = cfg.prefer_http2;
        c.disable_tls = cfg.disable_tls;
        c.enable_s3express = cfg.enable_s3express;
        if let Some(b) = &cfg.ca_bundle {
            c.ca_bundle = Some(b.into());
        }
        c.request_timeout = Duration::from_secs_f64(cfg.request_timeout_secs);
        c.operation_timeout = c.operation_timeout.max(c.request_timeout * 4);
        c.breaker = BreakerConfig {
            initial_cooldown: Duration::from_secs_f64(cfg.breaker_initial_cooldown_s),
            max_cooldown: Duration::from_secs_f64(cfg.breaker_max_cooldown_s),
            ..BreakerConfig::default()
        };
        c.max_connections = (cfg.num_io_threads as usize / num_shards.max(1)).max(1);
        let client = S3Client::new(c).map_err(|e| io::Error::other(format!("S3 client: {e}")))?;
        Ok(S3Store { client })
    }
}

impl ObjectStore for S3Store {
    fn put<'a>(&'a self, name: &'a str, body: ObjectBytes) -> LocalFut<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let (alive, released) = glommio::channels::local_channel::new_bounded::<()>(1);
            let lease = L1Lease {
                bytes: body,
                _alive: alive,
            };
            // SAFETY: the client is !Send and runs every connection task on
            // this executor, so the lease never leaves this thread.
            let region = unsafe { SendRegion::from_local_owner(lease) };
            let r = self.client.put_object(name, region).await;
            // Every slice of the lease is gone once the channel closes.
            let waited = std::time::Instant::now();
            while released.recv().await.is_some() {}
            if waited.elapsed() > Duration::from_secs(5) {
                log::warn!(
                    "s3 adapter: PUT {name}: the connection held the body {:?} after the request ended",
                    waited.elapsed()
                );
            }
            r.map_err(store_error)
        })
    }

    fn get_into<'a>(
        &'a self,
        name: &'a str,
        dest: ObjectBytes,
    ) -> LocalFut<'a, Result<(), StoreError>> {
        Box::pin(async move {
            // SAFETY: the L1 object is write-locked for this load and stays
            // allocated until it resolves; the client writes only while this
            // future runs.
            let region = unsafe { RecvRegion::from_raw(dest.as_ptr(), dest.len()) };
            self.client
                .get_object_into(name, region)
                .await
                .map_err(store_error)
        })
    }

    fn head<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move { self.client.head_object(name).await.map_err(store_error) })
    }

    fn delete<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.client
                .delete_object(name)
                .await
                .map(|_| ())
                .map_err(store_error)
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        continuation: Option<String>,
        max_keys: usize,
    ) -> LocalFut<'a, Result<ListPage, StoreError>> {
        Box::pin(async move {
            let page = self
                .client
                .list_objects_v2(
                    (!prefix.is_empty()).then_some(prefix),
                    continuation.as_deref(),
                    Some(max_keys.min(1000) as u32),
                )
                .await
                .map_err(store_error)?;
            let next = if page.is_truncated {
                page.next_continuation_token
            } else {
                None
            };
            Ok((
                page.contents.into_iter().map(|o| (o.key, o.size)).collect(),
                next,
            ))
        })
    }

    fn status(&self) -> serde_json::Value {
        let b = self.client.breaker_status();
        let st = self.client.stats();
        json!({
            "protocol": self.client.protocol().map(|p| format!("{p:?}")),
            "breaker_open": b.open,
            "breaker_retry_in_seconds": b.retry_in_seconds,
            "connection_failures": b.connection_failures,
            "breaker_trips": b.trips,
            "retries": st.retries,
            "retry_budget_exhausted": st.retry_budget_exhausted,
            "bytes_sent": st.bytes_sent,
            "bytes_received": st.bytes_received,
            "sessions_created": st.sessions_created,
            "multipart_aborts": st.multipart_aborts,
        })
    }
}
