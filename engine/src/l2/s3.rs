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
//! - only full chunks are stored: an object whose size is not the full
//!   chunk's of its registered layout ([`L2Adapter::set_full_chunk_size`]) is
//!   refused and counted (`unfull_rejected`), never written.
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

use std::future::Future;
use std::time::{Duration, SystemTime};

use futures_util::future::{join_all, select, Either};
use kvshard_s3_raw::addressing::{resolve_bucket, AddressingConfig};
use kvshard_s3_raw::breaker::BreakerConfig;
use kvshard_s3_raw::client::{CredentialsConfig, S3Client, S3ClientConfig};
use kvshard_s3_raw::credentials::{Credentials, Env};
use kvshard_s3_raw::{ErrorKind, Op, Outcome, RecvRegion, S3Error, SendRegion};
use serde_json::json;

/// Full-chunk object sizes of one model by (world size, object group).
type FullSizes = HashMap<(u32, u32), u64>;

use crate::keys::ObjectKey;

use super::config::{S3Config, GIB};
use super::health::{Failure, Failures, L2Op};
use super::naming::{check_key, parse_s3_object_name, s3_object_name};
use super::{kv_rank_world_size, KeyPage, L2Adapter, LocalFut, ObjectBytes, StoreResult};

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

/// One page of an object listing: (object name, size, last modified) and the
/// token of the next page.
pub type ListPage = (Vec<(String, u64, Option<SystemTime>)>, Option<String>);

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
    /// Asks the endpoint for any answer about `name` (which need not exist),
    /// past a circuit breaker that is open and within a short deadline of
    /// its own: `Ok` when it answered at all. Default: a HEAD.
    fn probe<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<(), StoreError>> {
        Box::pin(async move { self.head(name).await.map(|_| ()) })
    }
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
    /// Objects refused because their size is not the full chunk's.
    unfull_rejected: Cell<u64>,
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
    /// Full-chunk object size by model name, then world size.
    full_sizes: RefCell<HashMap<String, FullSizes>>,
    counters: Counters,
    failures: Failures,
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
            full_sizes: RefCell::new(HashMap::new()),
            counters: Counters::default(),
            failures: Failures::default(),
        }
    }

    fn name_of(&self, key: &ObjectKey) -> Option<String> {
        if let Err(e) = check_key(key) {
            kvshard_io::log_limited!(
                log::Level::Warn,
                "s3 adapter: key {key:?} has no object name: {e}"
            );
            return None;
        }
        let mut s = self.prefix.clone();
        s.push_str(&s3_object_name(key));
        Some(s)
    }

    /// Counts a failed request of `op` on object `name`, notes it for the
    /// adapter's health and logs it, one rate-limited budget per operation
    /// (a storm of failing HEADs must not hide why PUTs fail).
    fn failed(&self, op: L2Op, name: &str, e: &StoreError) {
        let c = &self.counters;
        c.errors.set(c.errors.get() + 1);
        match e.kind {
            StoreErrorKind::PermissionDenied => {
                c.permission_errors.set(c.permission_errors.get() + 1)
            }
            StoreErrorKind::Unavailable => c.unavailable_errors.set(c.unavailable_errors.get() + 1),
            StoreErrorKind::NotFound | StoreErrorKind::Other => {}
        }
        let verb = match op {
            L2Op::Store => "PUT",
            L2Op::Load => "GET",
            L2Op::Lookup | L2Op::Probe => "HEAD",
            L2Op::Delete => "DELETE",
            L2Op::List => "LIST",
        };
        // An object another node evicted is a miss, not a failing tier.
        if e.kind != StoreErrorKind::NotFound {
            self.failures.failed(
                op,
                1,
                || format!("{verb} {name}: {e}"),
                std::time::Instant::now(),
            );
        }
        kvshard_io::log_limited!(
            per op.name(); kvshard_io::log_limit::Level::Warn,
            "s3 adapter (shard {}): {verb} {name}: {e}",
            self.shard
        );
    }

    async fn permit(&self) -> glommio::sync::Permit<'_> {
        self.inflight
            .acquire_permit(1)
            .await
            .expect("the semaphore is never closed")
    }

    /// The full-chunk object size of `key`'s layout, once the shard told it.
    fn full_size_of(&self, key: &ObjectKey) -> Option<u64> {
        self.full_sizes
            .borrow()
            .get(key.model_name.as_str())?
            .get(&(kv_rank_world_size(key.kv_rank), key.object_group_id))
            .copied()
    }

    async fn store_one(&self, key: &ObjectKey, body: ObjectBytes) -> StoreResult {
        // 0.5.6's s3 path writes whole chunks only (a partial chunk is logged
        // and skipped); here the full size is the registered layout's. A key
        // whose layout the shard has not named (no request used it yet) cannot
        // be judged and is stored as it is.
        if let Some(full) = self.full_size_of(key) {
            if body.len() as u64 != full {
                let c = &self.counters;
                c.unfull_rejected.set(c.unfull_rejected.get() + 1);
                kvshard_io::log_limited!(
                    log::Level::Warn,
                    "s3 adapter (shard {}): {key:?} has {} bytes, a full chunk of its layout has {full}; only full chunks are stored",
                    self.shard,
                    body.len()
                );
                return StoreResult::Failed;
            }
        }
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
                self.failures.succeeded(L2Op::Store);
                let size = body.len() as u64;
                self.sizes.borrow_mut().insert(*key, size);
                StoreResult::Stored(size)
            }
            Err(e) => {
                self.failed(L2Op::Store, &name, &e);
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
                self.failures.succeeded(L2Op::Lookup);
                self.sizes.borrow_mut().insert(*key, size);
                Some(size)
            }
            Ok(_) => {
                self.failures.succeeded(L2Op::Lookup);
                None
            }
            Err(e) => {
                self.failed(L2Op::Lookup, &name, &e);
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
                kvshard_io::log_limited!(
                    log::Level::Warn,
                    "s3 adapter: {name} holds {size} bytes, the L1 object has {}",
                    dest.len()
                );
                return false;
            }
        }
        let _p = self.permit().await;
        self.counters.gets.set(self.counters.gets.get() + 1);
        match self.store.get_into(&name, dest).await {
            Ok(()) => {
                self.failures.succeeded(L2Op::Load);
                true
            }
            Err(e) => {
                if e.kind == StoreErrorKind::NotFound {
                    // Evicted by another node since the lookup.
                    self.sizes.borrow_mut().remove(key);
                }
                self.failed(L2Op::Load, &name, &e);
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
                self.failed(L2Op::Delete, &name, &e);
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
                    *locks.entry(*key).or_insert(0) += 1;
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
            let (keys, modified) = names
                .into_iter()
                .filter_map(|(name, size, at)| {
                    let key = parse_s3_object_name(name.strip_prefix(&self.prefix)?)?;
                    (model_name.is_none_or(|m| key.model_name == m)).then_some(((key, size), at))
                })
                .unzip();
            Ok(KeyPage {
                keys,
                modified,
                next_cursor: next,
            })
        })
    }

    fn failures(&self) -> Vec<Failure> {
        self.failures.current()
    }

    fn probe(&self) -> LocalFut<'_, Result<(), String>> {
        Box::pin(async move {
            let name = format!("{}kvshard-probe", self.prefix);
            self.store
                .probe(&name)
                .await
                .map_err(|e| format!("HEAD {name}: {e}"))
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
            "unfull_rejected": c.unfull_rejected.get(),
            "client": self.store.status(),
        })
    }

    fn set_full_chunk_size(&self, model_name: &str, world_size: u32, og: u32, bytes: u64) {
        let mut sizes = self.full_sizes.borrow_mut();
        let by_ws = match sizes.get_mut(model_name) {
            Some(m) => m,
            None => sizes.entry(model_name.to_owned()).or_default(),
        };
        let before = by_ws.insert((world_size, og), bytes);
        if before.is_some_and(|b| b != bytes) {
            log::info!(
                "s3 adapter (shard {}): a full chunk of model {model_name} at world size {world_size} (object group {og}) now has {bytes} bytes (was {})",
                self.shard,
                before.unwrap_or(0)
            );
        }
    }
}

// ------------------------------------------------------------ the S3 client

/// How long a probe of a tier that stopped answering waits (the shard sends
/// one a second while it does).
const PROBE_LIMIT: Duration = Duration::from_secs(2);

/// A shard's S3 client as the adapter's [`ObjectStore`].
pub struct S3Store {
    client: S3Client,
    /// PUTs whose body a connection still held a request deadline after the
    /// request had ended (see [`ObjectStore::put`] on this type).
    put_body_held: Cell<u64>,
}

/// `fut`'s output, or `None` when `limit` passes first.
async fn within<F: Future>(limit: Duration, fut: F) -> Option<F::Output> {
    let fut = std::pin::pin!(fut);
    let timer = std::pin::pin!(glommio::timer::sleep(limit));
    match select(fut, timer).await {
        Either::Left((out, _)) => Some(out),
        Either::Right(_) => None,
    }
}

/// L1 memory lent to the client for one PUT. The client's connections may
/// hold slices of it after the operation resolves (until they have written
/// or dropped them); the lease ends when the last one goes, and
/// [`ObjectStore::put`] waits for that before it returns, so the caller's L1
/// lock (kept alive by the store controller while the adapter works)
/// outlives every read of the memory.
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

/// A metric label for an error kind (`permission_denied`, ...).
pub fn error_kind_label(k: ErrorKind) -> &'static str {
    match k {
        ErrorKind::NotFound => "not_found",
        ErrorKind::PermissionDenied => "permission_denied",
        ErrorKind::Throttled => "throttled",
        ErrorKind::Transient => "transient",
        ErrorKind::Fatal => "fatal",
        ErrorKind::Unavailable => "unavailable",
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
        Ok(S3Store {
            client,
            put_body_held: Cell::new(0),
        })
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
            // Every slice of the lease is gone once the channel closes. A
            // connection normally lets go at once: an HTTP/1.1 connection
            // whose request did not finish is closed with its buffers, and an
            // HTTP/2 stream is reset. What can outlive the request is a frame
            // an HTTP/2 connection already queued for a socket the peer
            // stopped reading. The wait is bounded by the request deadline;
            // past it the L1 memory cannot be handed back (the socket may
            // still read it and a reused slab would go out under this key),
            // so this closes the client's connections, which drops what they
            // queued, and goes on waiting: the put does not resolve before the
            // release, and the store controller keeps the object read-locked
            // in L1 until it resolves. Each such PUT is counted
            // (`put_body_held`) and logged.
            let released = &released;
            let drained = || async move { while released.recv().await.is_some() {} };
            let limit = self.client.config().request_timeout;
            if within(limit, drained()).await.is_none() {
                self.put_body_held.set(self.put_body_held.get() + 1);
                let closed = self.client.close_connections();
                log::warn!(
                    "s3 adapter: PUT {name}: a connection still held the L1 body {limit:?} after the request ended; closed {closed} connections, the object stays locked in L1 until the body is released"
                );
                let mut waited = limit;
                while within(limit, drained()).await.is_none() {
                    waited += limit;
                    log::warn!(
                        "s3 adapter: PUT {name}: the L1 body is still held {waited:?} after the request ended; the object stays locked in L1"
                    );
                }
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

    fn probe<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.client
                .probe(name, PROBE_LIMIT)
                .await
                .map_err(store_error)
        })
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
                page.contents
                    .into_iter()
                    .map(|o| (o.key, o.size, o.last_modified))
                    .collect(),
                next,
            ))
        })
    }

    fn status(&self) -> serde_json::Value {
        let b = self.client.breaker_status();
        let st = self.client.stats();
        // Requests by operation and outcome, the ones that happened.
        let mut requests = serde_json::Map::new();
        for op in Op::ALL {
            let mut by_outcome = serde_json::Map::new();
            let outcomes = std::iter::once((Outcome::Ok, "ok")).chain(
                ErrorKind::ALL
                    .iter()
                    .map(|k| (Outcome::Failed(*k), error_kind_label(*k))),
            );
            for (outcome, label) in outcomes {
                let n = st.count(op, outcome);
                if n > 0 {
                    by_outcome.insert(label.to_owned(), n.into());
                }
            }
            if !by_outcome.is_empty() {
                requests.insert(op.name().to_owned(), by_outcome.into());
            }
        }
        json!({
            "protocol": self.client.protocol().map(|p| format!("{p:?}")),
            "breaker_open": b.open,
            "breaker_retry_in_seconds": b.retry_in_seconds,
            "connection_failures": b.connection_failures,
            "breaker_trips": b.trips,
            "retries": st.retries,
            "retry_budget_exhausted": st.retry_budget_exhausted,
            "timeouts": st.timeouts,
            "requests": requests,
            "connect_failures": st.connections.connect_failures,
            "connections_discarded": st.connections.discarded,
            "put_body_held": self.put_body_held.get(),
            "bytes_sent": st.bytes_sent,
            "bytes_received": st.bytes_received,
            "sessions_created": st.sessions_created,
            "multipart_aborts": st.multipart_aborts,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::eviction::{EvictionConfig, PolicyKind};
    use crate::keys::{compute_kv_rank, Name};
    use crate::l2::config::Secret;
    use crate::l2::tier::L2Tier;

    fn run<T>(f: impl Future<Output = T>) -> T {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(512 * 1024)
            .make()
            .expect("executor")
            .run(f)
    }

    fn config(endpoint: String) -> S3Config {
        S3Config {
            endpoint,
            region: "us-east-1".into(),
            num_io_threads: 4,
            prefer_http2: true,
            enable_s3express: false,
            disable_tls: true,
            static_credentials: Some(("ak".into(), Secret("sk".into()))),
            max_capacity_gb: 0.0,
            endpoint_url: None,
            ca_bundle: None,
            key_prefix: String::new(),
            request_timeout_secs: 1.0,
            max_inflight_requests: 4,
            seed_usage_on_start: false,
            breaker_initial_cooldown_s: 5.0,
            breaker_max_cooldown_s: 300.0,
        }
    }

    fn key(model: &str, world_size: u32, i: u8) -> ObjectKey {
        ObjectKey {
            chunk_hash: [i; 32],
            model_name: Name::intern(model).unwrap(),
            kv_rank: compute_kv_rank(world_size, 0, world_size, 0),
            object_group_id: 0,
            cache_salt: Name::EMPTY,
        }
    }

    /// An in-memory bucket: name -> (bytes, last modified).
    #[derive(Default)]
    struct Bucket {
        objects: RefCell<BTreeMap<String, (Vec<u8>, SystemTime)>>,
        puts: Cell<u64>,
    }

    impl ObjectStore for Bucket {
        fn put<'a>(
            &'a self,
            name: &'a str,
            body: ObjectBytes,
        ) -> LocalFut<'a, Result<(), StoreError>> {
            self.puts.set(self.puts.get() + 1);
            // SAFETY: the caller keeps the memory alive and unwritten for the call.
            let bytes = unsafe { body.as_slice() }.to_vec();
            self.objects
                .borrow_mut()
                .insert(name.to_owned(), (bytes, SystemTime::now()));
            Box::pin(async { Ok(()) })
        }

        fn get_into<'a>(
            &'a self,
            name: &'a str,
            dest: ObjectBytes,
        ) -> LocalFut<'a, Result<(), StoreError>> {
            let r = match self.objects.borrow().get(name) {
                Some((b, _)) if b.len() == dest.len() => {
                    // SAFETY: the caller lends the buffer for the call.
                    unsafe { dest.as_mut_slice() }.copy_from_slice(b);
                    Ok(())
                }
                _ => Err(StoreError {
                    kind: StoreErrorKind::NotFound,
                    message: name.to_owned(),
                }),
            };
            Box::pin(async { r })
        }

        fn head<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<Option<u64>, StoreError>> {
            let r = self.objects.borrow().get(name).map(|(b, _)| b.len() as u64);
            Box::pin(async move { Ok(r) })
        }

        fn delete<'a>(&'a self, name: &'a str) -> LocalFut<'a, Result<(), StoreError>> {
            self.objects.borrow_mut().remove(name);
            Box::pin(async { Ok(()) })
        }

        fn list<'a>(
            &'a self,
            prefix: &'a str,
            continuation: Option<String>,
            max_keys: usize,
        ) -> LocalFut<'a, Result<ListPage, StoreError>> {
            let objects = self.objects.borrow();
            let mut page: Vec<(String, u64, Option<SystemTime>)> = objects
                .iter()
                .filter(|(n, _)| n.starts_with(prefix))
                .filter(|(n, _)| continuation.as_deref().is_none_or(|c| n.as_str() > c))
                .map(|(n, (b, at))| (n.clone(), b.len() as u64, Some(*at)))
                .take(max_keys + 1)
                .collect();
            let next = (page.len() > max_keys).then(|| {
                page.truncate(max_keys);
                page.last().map(|(n, _, _)| n.clone()).unwrap_or_default()
            });
            Box::pin(async move { Ok((page, next)) })
        }

        fn status(&self) -> serde_json::Value {
            json!({})
        }
    }

    #[test]
    fn only_full_chunks_of_a_known_layout_are_stored() {
        run(async {
            let bucket = Rc::new(Bucket::default());
            let a = S3Adapter::new(&config("b.localhost:9".into()), bucket.clone(), 0, 1);
            a.set_full_chunk_size("m", 1, 0, 4096);
            let mut full = vec![1u8; 4096];
            let mut short = vec![2u8; 1000];
            let mut other_ws = vec![3u8; 1000];
            let mut other_model = vec![4u8; 1000];
            // SAFETY: the buffers outlive `items` and every awaited call that
            // receives it, and nothing else touches them meanwhile.
            let items = unsafe {
                [
                    (key("m", 1, 1), ObjectBytes::from_mut_slice(&mut full)),
                    (key("m", 1, 2), ObjectBytes::from_mut_slice(&mut short)),
                    (key("m", 2, 3), ObjectBytes::from_mut_slice(&mut other_ws)),
                    (
                        key("n", 1, 4),
                        ObjectBytes::from_mut_slice(&mut other_model),
                    ),
                ]
            };
            assert_eq!(
                a.store(&items).await,
                vec![
                    StoreResult::Stored(4096),
                    StoreResult::Failed,
                    StoreResult::Stored(1000),
                    StoreResult::Stored(1000),
                ],
                "a short object of a known layout is refused; unknown layouts cannot be judged"
            );
            assert_eq!(bucket.puts.get(), 3, "the refused object was never sent");
            assert!(!bucket
                .objects
                .borrow()
                .contains_key(&s3_object_name(&key("m", 1, 2))));
            assert_eq!(a.status()["unfull_rejected"], 1);
            assert_eq!(a.lookup_and_lock(&[key("m", 1, 2)]).await, vec![None]);
            // A full chunk that is already stored: not written again.
            assert_eq!(a.store(&items[..1]).await, vec![StoreResult::Exists]);
            // The layout changes: its new full size is what is stored.
            a.set_full_chunk_size("m", 1, 0, 1000);
            assert_eq!(a.store(&items[1..2]).await, vec![StoreResult::Stored(1000)]);
            assert_eq!(a.status()["unfull_rejected"], 1);
        });
    }

    #[test]
    fn seeding_adopts_the_oldest_objects_first_so_they_are_evicted_first() {
        run(async {
            let bucket = Rc::new(Bucket::default());
            let keys: Vec<ObjectKey> = (0..6).map(|i| key("m", 1, i * 40)).collect();
            let mut names: Vec<String> = keys.iter().map(s3_object_name).collect();
            names.sort();
            // The first name is the newest, the last the oldest.
            let base = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            for (i, n) in names.iter().enumerate() {
                let at = base + Duration::from_secs(60 * (6 - i as u64));
                bucket
                    .objects
                    .borrow_mut()
                    .insert(n.clone(), (vec![0; 1000], at));
            }
            let mut cfg = config("b.localhost:9".into());
            cfg.max_capacity_gb = 6000.0 / GIB;
            let eviction = EvictionConfig {
                policy: PolicyKind::Lru,
                trigger_watermark: 0.8,
                eviction_ratio: 0.5,
            };
            let tier = L2Tier::new(
                "s3#1".into(),
                Box::new(S3Adapter::new(&cfg, bucket.clone(), 0, 1)),
                Some(eviction),
            );
            // Two listing pages of the adapter's own.
            let page = tier.list(None, 4, None).await.unwrap();
            assert_eq!(page.keys.len(), 4);
            assert_eq!(page.modified.len(), 4);
            assert!(page.modified.iter().all(Option::is_some));
            assert_eq!(tier.seed_usage(0, 1).await.unwrap(), 6);
            assert_eq!(tier.usage().used_bytes, 6000);
            let out = tier.evict_tick().await;
            assert_eq!(out.evicted_keys, 3);
            let left: Vec<String> = bucket.objects.borrow().keys().cloned().collect();
            assert_eq!(left, names[..3], "the oldest three go first");
            assert_eq!(tier.usage().used_bytes, 3000);
        });
    }

    /// An HTTP/2 server (h2c) that grants the client every flow-control
    /// window it could want and then never reads: a request body fills the
    /// socket buffers, and the connection ends up holding a frame of it.
    fn h2_server_that_stops_reading() -> (u16, Arc<AtomicBool>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let done = stop.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            listener.set_nonblocking(true).unwrap();
            while !done.load(Ordering::SeqCst) {
                if let Ok((mut s, _)) = listener.accept() {
                    s.set_nonblocking(false).unwrap();
                    let frame = |kind: u8, payload: &[u8]| {
                        let len = payload.len() as u32;
                        let mut f = len.to_be_bytes()[1..].to_vec();
                        f.extend([kind, 0, 0, 0, 0, 0]);
                        f.extend(payload);
                        f
                    };
                    // SETTINGS: INITIAL_WINDOW_SIZE = 2^31-1.
                    let mut settings = 4u16.to_be_bytes().to_vec();
                    settings.extend(0x7fff_ffffu32.to_be_bytes());
                    let _ = s.write_all(&frame(4, &settings));
                    // WINDOW_UPDATE on the connection up to 2^31-1.
                    let _ = s.write_all(&frame(8, &(0x7fff_ffffu32 - 65_535).to_be_bytes()));
                    held.push(s);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        (port, stop)
    }

    #[test]
    fn a_put_body_a_connection_still_holds_keeps_the_put_until_the_connections_close() {
        let (port, stop) = h2_server_that_stops_reading();
        let cfg = config(format!("stall.localhost:{port}"));
        run(async move {
            let store = S3Store::connect(&cfg, 1).unwrap();
            let a = S3Adapter::new(&cfg, Rc::new(store), 0, 1);
            // One object as large as a single PUT gets (8 MiB): more than the
            // socket buffers take.
            let mut body = vec![7u8; 8 << 20];
            let t0 = Instant::now();
            // SAFETY: `body` outlives the awaited store (which waits for the
            // connections to let go of it) and nothing else touches it.
            let view = unsafe { ObjectBytes::from_mut_slice(&mut body) };
            let res = a.store(&[(key("m", 1, 1), view)]).await;
            assert_eq!(res, vec![StoreResult::Failed]);
            let st = a.status();
            assert!(st["client"]["timeouts"].as_u64().unwrap() >= 1, "{st}");
            assert_eq!(
                st["client"]["put_body_held"], 1,
                "the body outlived the request: {st}"
            );
            // Bounded: the attempts (1 s each), one request deadline of
            // waiting, and the close.
            assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
            // The store resolved, so nothing holds `body` any more.
            drop(body);
        });
        stop.store(true, Ordering::SeqCst);
    }
}
