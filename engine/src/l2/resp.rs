//! The `resp` and `valkey` adapters: one key per object in Redis or Valkey,
//! standalone or cluster, named and laid out as lmcache 0.5.6's two RESP
//! adapters do, so a server written by `lmcache server` is read by kvshard
//! and the other way round:
//!
//! - the key is [`naming::s3_object_name`] (`<model>@<kv_rank:08x>@<group:x>@<hash>[@<salt>]`),
//!   after `<key_prefix>@` when a valkey `key_prefix` is set; the value is
//!   the object's bytes;
//! - `EXISTS` looks up, `SET` stores (`SET ... EX ttl_seconds` with a TTL),
//!   `GET` loads, `DEL` evicts, as 0.5.6 does.
//!
//! Each shard drives its own instance over its own
//! [`kvshard_resp::router::Client`] (its own connections, pipelined). What
//! 0.5.6 does, kept: a hit is locked (a reference count) until unlocked and
//! `delete` skips locked keys; a value whose size is not the L1 object's is
//! a miss. What differs: a nil, short or missized reply is a miss and leaves
//! the connection usable; a refused store (`OOM` at `maxmemory`) is a
//! failed store, counted (`oom_rejected`), never retried; every request has
//! a deadline and a dead server fails fast behind its breaker.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use kvshard_resp::client::{Answer, Body, Dest, Op, Options, Request};
use kvshard_resp::router::Client;
use kvshard_resp::Reply;
use kvshard_s3_raw::breaker::BreakerConfig;
use serde_json::json;

use crate::keys::ObjectKey;

use super::config::{RespConfig, RespFlavor, GIB};
use super::health::{Failure, Failures, L2Op};
use super::naming::{check_key, parse_s3_object_name, s3_object_name};
use super::{kv_rank_world_size, KeyPage, L2Adapter, LocalFut, ObjectBytes, StoreResult};

/// Full-chunk object sizes of one model by (world size, object group).
type FullSizes = HashMap<(u32, u32), u64>;

#[derive(Default)]
struct Counters {
    stored: Cell<u64>,
    store_failed: Cell<u64>,
    /// Stores the server refused for want of memory (`OOM`).
    oom_rejected: Cell<u64>,
    hits: Cell<u64>,
    misses: Cell<u64>,
    loaded: Cell<u64>,
    /// GETs that found no value (evicted or expired since the lookup).
    load_missing: Cell<u64>,
    /// GETs whose value had another size than the L1 object.
    load_wrong_size: Cell<u64>,
    load_failed: Cell<u64>,
    deleted: Cell<u64>,
    errors: Cell<u64>,
}

fn bump(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

pub struct RespAdapter {
    kind: &'static str,
    shard: usize,
    client: Rc<Client>,
    /// `<key_prefix>@`, or empty.
    prefix: String,
    ttl: Option<String>,
    nodes: Vec<String>,
    capacity_bytes: u64,
    /// Sizes of values this shard stored or found.
    sizes: RefCell<HashMap<ObjectKey, u64>>,
    locks: RefCell<HashMap<ObjectKey, u32>>,
    full_sizes: RefCell<HashMap<String, FullSizes>>,
    counters: Counters,
    failures: Failures,
}

/// The rustls configuration of `cfg` (system roots plus its CA bundle).
fn tls_config(cfg: &RespConfig) -> io::Result<Option<Arc<rustls::ClientConfig>>> {
    if !cfg.tls_enable {
        return Ok(None);
    }
    let trust = kvshard_s3_raw::net::TlsTrust {
        system_roots: true,
        ca_bundle: cfg.tls_ca_bundle.as_ref().map(Into::into),
    };
    let mut c = (*kvshard_s3_raw::net::tls_client_config(&trust, false)
        .map_err(|e| io::Error::other(format!("TLS: {e}")))?)
    .clone();
    c.alpn_protocols.clear();
    Ok(Some(Arc::new(c)))
}

/// The connection settings of shard `shard` of `num_shards`: its share of
/// `num_workers` connections per node (at least one).
pub fn client_options(cfg: &RespConfig, num_shards: usize) -> io::Result<Options> {
    Ok(Options {
        username: cfg.username.clone(),
        password: cfg.password.as_ref().map(|p| p.0.clone()),
        database: if cfg.cluster_mode {
            None
        } else {
            cfg.database_id
        },
        tls: tls_config(cfg)?,
        connections: (cfg.num_workers as usize)
            .div_ceil(num_shards.max(1))
            .max(1),
        request_timeout: Duration::from_secs_f64(cfg.request_timeout_secs),
        connect_timeout: Duration::from_secs_f64(cfg.connection_timeout_secs),
        breaker: BreakerConfig {
            initial_cooldown: Duration::from_secs_f64(cfg.breaker_initial_cooldown_s),
            max_cooldown: Duration::from_secs_f64(cfg.breaker_max_cooldown_s),
            ..BreakerConfig::default()
        },
    })
}

/// `*`, `?`, `[`, `]` and `\` escaped for a `SCAN ... MATCH` pattern.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl RespAdapter {
    /// This shard's adapter: `1/num_shards` of the capacity, its own client.
    /// Connects on first use.
    pub fn new(cfg: &RespConfig, shard: usize, num_shards: usize) -> io::Result<RespAdapter> {
        let opts = client_options(cfg, num_shards)?;
        let client = Client::new(&cfg.nodes, cfg.cluster_mode, opts);
        Ok(RespAdapter {
            kind: match cfg.flavor {
                RespFlavor::Resp => "resp",
                RespFlavor::Valkey => "valkey",
            },
            shard,
            client: Rc::new(client),
            prefix: if cfg.key_prefix.is_empty() {
                String::new()
            } else {
                format!("{}@", cfg.key_prefix)
            },
            ttl: cfg.ttl_seconds.map(|t| t.to_string()),
            nodes: cfg.nodes.iter().map(|(h, p)| format!("{h}:{p}")).collect(),
            capacity_bytes: (cfg.max_capacity_gb * GIB) as u64 / num_shards.max(1) as u64,
            sizes: RefCell::new(HashMap::new()),
            locks: RefCell::new(HashMap::new()),
            full_sizes: RefCell::new(HashMap::new()),
            counters: Counters::default(),
            failures: Failures::default(),
        })
    }

    fn name_of(&self, key: &ObjectKey) -> Option<String> {
        if let Err(e) = check_key(key) {
            kvshard_io::log_limited!(
                log::Level::Warn,
                "{} adapter: key {key:?} has no name: {e}",
                self.kind
            );
            return None;
        }
        let mut s = self.prefix.clone();
        s.push_str(&s3_object_name(key));
        Some(s)
    }

    fn full_size_of(&self, key: &ObjectKey) -> Option<u64> {
        self.full_sizes
            .borrow()
            .get(key.model_name.as_str())?
            .get(&(kv_rank_world_size(key.kv_rank), key.object_group_id))
            .copied()
    }

    /// Notes a failed request for the adapter's health and logs it.
    fn failed(&self, op: L2Op, what: &str, name: &str, why: &str) {
        bump(&self.counters.errors);
        self.failures.failed(
            op,
            1,
            || format!("{what} {name}: {why}"),
            std::time::Instant::now(),
        );
        kvshard_io::log_limited!(
            per op.name(); kvshard_io::log_limit::Level::Warn,
            "{} adapter (shard {}): {what} {name}: {why}",
            self.kind,
            self.shard
        );
    }

    async fn store_one(&self, key: &ObjectKey, body: ObjectBytes) -> StoreResult {
        if self.sizes.borrow().contains_key(key) {
            return StoreResult::Exists;
        }
        let Some(name) = self.name_of(key) else {
            return StoreResult::Failed;
        };
        // SAFETY: the store controller keeps the object read-locked in L1
        // until this resolves, and the client lets go of the body before
        // its call resolves.
        let b = unsafe { Body::new(body.as_ptr(), body.len()) };
        let req = match &self.ttl {
            None => Request::with_body(Op::Set, &[b"SET", name.as_bytes()], b),
            Some(ttl) => Request::with_body_then(
                Op::Set,
                &[b"SET", name.as_bytes()],
                b,
                &[b"EX", ttl.as_bytes()],
            ),
        };
        let r = self.client.call(name.as_bytes(), req).await;
        self.finish_store(key, &name, body.len() as u64, r)
    }

    fn finish_store(
        &self,
        key: &ObjectKey,
        name: &str,
        size: u64,
        r: Result<Answer, kvshard_resp::client::ClientError>,
    ) -> StoreResult {
        match r {
            Ok(Answer::Reply(Reply::Simple(s))) if s == b"OK" => {
                self.failures.succeeded(L2Op::Store);
                bump(&self.counters.stored);
                self.sizes.borrow_mut().insert(*key, size);
                StoreResult::Stored(size)
            }
            Ok(Answer::Reply(Reply::Error(e))) => {
                bump(&self.counters.store_failed);
                let line = String::from_utf8_lossy(&e);
                if line.starts_with("OOM") {
                    bump(&self.counters.oom_rejected);
                }
                self.failed(L2Op::Store, "SET", name, &line);
                StoreResult::Failed
            }
            Ok(other) => {
                bump(&self.counters.store_failed);
                self.failed(
                    L2Op::Store,
                    "SET",
                    name,
                    &format!("unexpected reply {other:?}"),
                );
                StoreResult::Failed
            }
            Err(e) => {
                bump(&self.counters.store_failed);
                self.failed(L2Op::Store, "SET", name, &e.to_string());
                StoreResult::Failed
            }
        }
    }

    async fn size_of(&self, key: &ObjectKey) -> Option<u64> {
        let name = self.name_of(key)?;
        let known = self
            .sizes
            .borrow()
            .get(key)
            .copied()
            .or_else(|| self.full_size_of(key));
        // EXISTS as 0.5.6 does; STRLEN when the layout's size is not known
        // yet (no request named it).
        let req = match known {
            Some(_) => Request::command(Op::Exists, &[b"EXISTS", name.as_bytes()]),
            None => Request::command(Op::Strlen, &[b"STRLEN", name.as_bytes()]),
        };
        match self.client.call(name.as_bytes(), req).await {
            Ok(Answer::Reply(Reply::Integer(n))) if n > 0 => {
                self.failures.succeeded(L2Op::Lookup);
                bump(&self.counters.hits);
                let size = known.unwrap_or(n as u64);
                self.sizes.borrow_mut().insert(*key, size);
                Some(size)
            }
            Ok(Answer::Reply(Reply::Integer(_))) => {
                self.failures.succeeded(L2Op::Lookup);
                bump(&self.counters.misses);
                self.sizes.borrow_mut().remove(key);
                None
            }
            Ok(other) => {
                bump(&self.counters.misses);
                self.failed(L2Op::Lookup, "EXISTS", &name, &format!("{other:?}"));
                None
            }
            Err(e) => {
                bump(&self.counters.misses);
                self.failed(L2Op::Lookup, "EXISTS", &name, &e.to_string());
                None
            }
        }
    }

    async fn load_one(&self, key: &ObjectKey, dest: ObjectBytes) -> bool {
        let Some(name) = self.name_of(key) else {
            return false;
        };
        // SAFETY: the L1 object is write-locked for this load and stays
        // allocated until it resolves; the client writes it only before its
        // call resolves.
        let d = unsafe { Dest::new(dest.as_ptr(), dest.len()) };
        let req = Request::into_dest(Op::Get, &[b"GET", name.as_bytes()], d);
        match self.client.call(name.as_bytes(), req).await {
            Ok(Answer::Filled) => {
                self.failures.succeeded(L2Op::Load);
                bump(&self.counters.loaded);
                true
            }
            Ok(Answer::Reply(Reply::Nil)) => {
                // Evicted or expired since the lookup.
                self.failures.succeeded(L2Op::Load);
                bump(&self.counters.load_missing);
                self.sizes.borrow_mut().remove(key);
                false
            }
            Ok(Answer::WrongSize(n)) => {
                self.failures.succeeded(L2Op::Load);
                bump(&self.counters.load_wrong_size);
                kvshard_io::log_limited!(
                    log::Level::Warn,
                    "{} adapter: {name} holds {n} bytes, the L1 object has {}; a miss",
                    self.kind,
                    dest.len()
                );
                self.sizes.borrow_mut().remove(key);
                false
            }
            Ok(other) => {
                bump(&self.counters.load_failed);
                self.failed(L2Op::Load, "GET", &name, &format!("{other:?}"));
                false
            }
            Err(e) => {
                bump(&self.counters.load_failed);
                self.failed(L2Op::Load, "GET", &name, &e.to_string());
                false
            }
        }
    }

    async fn delete_one(&self, key: &ObjectKey) -> Option<u64> {
        if self.locks.borrow().contains_key(key) {
            return None;
        }
        let name = self.name_of(key)?;
        let size = self
            .sizes
            .borrow()
            .get(key)
            .copied()
            .or_else(|| self.full_size_of(key))
            .unwrap_or(0);
        let req = Request::command(Op::Del, &[b"DEL", name.as_bytes()]);
        match self.client.call(name.as_bytes(), req).await {
            Ok(Answer::Reply(Reply::Integer(1))) => {
                bump(&self.counters.deleted);
                self.sizes.borrow_mut().remove(key);
                Some(size)
            }
            Ok(Answer::Reply(Reply::Integer(_))) => {
                self.sizes.borrow_mut().remove(key);
                None
            }
            Ok(other) => {
                self.failed(L2Op::Delete, "DEL", &name, &format!("{other:?}"));
                None
            }
            Err(e) => {
                self.failed(L2Op::Delete, "DEL", &name, &e.to_string());
                None
            }
        }
    }

    /// One SCAN page over the masters: `cursor` is `<master index>:<scan
    /// cursor>:<keys of that SCAN call already listed>` (SCAN's COUNT is a
    /// hint: a call may answer more keys than the page has room for, and
    /// the rest are listed from the same call again).
    async fn scan_page(
        &self,
        model_name: Option<&str>,
        page_size: usize,
        cursor: Option<String>,
    ) -> io::Result<KeyPage> {
        let scan_error = |e: String| io::Error::other(format!("{} adapter: SCAN: {e}", self.kind));
        let masters = self
            .client
            .masters()
            .await
            .map_err(|e| scan_error(e.to_string()))?;
        let (mut index, mut at, mut skip) = (0usize, "0".to_owned(), 0usize);
        if let Some(c) = cursor.as_deref() {
            let mut parts = c.splitn(3, ':');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(i), Some(a), Some(k)) => {
                    index = i
                        .parse()
                        .map_err(|_| scan_error(format!("bad cursor {c:?}")))?;
                    at = a.to_owned();
                    skip = k
                        .parse()
                        .map_err(|_| scan_error(format!("bad cursor {c:?}")))?;
                }
                _ => return Err(scan_error(format!("bad cursor {c:?}"))),
            }
        }
        let mut pattern = glob_escape(&self.prefix);
        if let Some(m) = model_name {
            pattern.push_str(&glob_escape(m));
            pattern.push('@');
        }
        pattern.push('*');
        let room = page_size.max(1);
        let count = room.to_string();
        let mut names: Vec<(Vec<u8>, usize)> = Vec::new();
        while index < masters.len() && names.len() < room {
            let req = Request::command(
                Op::Scan,
                &[
                    b"SCAN",
                    at.as_bytes(),
                    b"MATCH",
                    pattern.as_bytes(),
                    b"COUNT",
                    count.as_bytes(),
                ],
            );
            let reply = masters[index]
                .call(&req)
                .await
                .map_err(|e| scan_error(e.to_string()))?;
            let Answer::Reply(Reply::Array(mut parts)) = reply else {
                return Err(scan_error(format!("unexpected reply {reply:?}")));
            };
            let (Some(Reply::Array(keys)), Some(Reply::Bulk(next))) = (parts.pop(), parts.pop())
            else {
                return Err(scan_error("a reply that is not [cursor, keys]".to_owned()));
            };
            let keys: Vec<Vec<u8>> = keys
                .into_iter()
                .filter_map(|k| match k {
                    Reply::Bulk(k) => Some(k),
                    _ => None,
                })
                .collect();
            let left = keys.len().saturating_sub(skip);
            let take = left.min(room - names.len());
            names.extend(keys.into_iter().skip(skip).take(take).map(|k| (k, index)));
            if take < left {
                skip += take;
                break;
            }
            skip = 0;
            at = String::from_utf8_lossy(&next).into_owned();
            if at == "0" {
                index += 1;
            }
        }
        let next_cursor = (index < masters.len()).then(|| format!("{index}:{at}:{skip}"));
        let parsed: Vec<(ObjectKey, Vec<u8>, usize)> = names
            .into_iter()
            .filter_map(|(raw, i)| {
                let name = std::str::from_utf8(&raw).ok()?;
                let key = parse_s3_object_name(name.strip_prefix(&self.prefix)?)?;
                model_name
                    .is_none_or(|m| key.model_name == m)
                    .then_some((key, raw, i))
            })
            .collect();
        let masters = &masters;
        let sizes = join_all(parsed.iter().map(|(_, raw, i)| async move {
            let req = Request::command(Op::Strlen, &[b"STRLEN", raw]);
            match masters[*i].call(&req).await {
                Ok(Answer::Reply(Reply::Integer(n))) => Some(n.max(0) as u64),
                _ => None,
            }
        }))
        .await;
        let keys: Vec<(ObjectKey, u64)> = parsed
            .into_iter()
            .zip(sizes)
            .filter_map(|((key, _, _), size)| Some((key, size.filter(|s| *s > 0)?)))
            .collect();
        Ok(KeyPage {
            modified: vec![None; keys.len()],
            keys,
            next_cursor,
        })
    }
}

impl L2Adapter for RespAdapter {
    fn kind(&self) -> &'static str {
        self.kind
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
        Box::pin(self.scan_page(model_name, page_size, cursor))
    }

    fn failures(&self) -> Vec<Failure> {
        self.failures.current()
    }

    fn probe(&self) -> LocalFut<'_, Result<(), String>> {
        Box::pin(async move { self.client.probe().await.map_err(|e| e.to_string()) })
    }

    fn status(&self) -> serde_json::Value {
        let c = &self.counters;
        json!({
            "type": self.kind,
            "shard": self.shard,
            "nodes": self.nodes,
            "cluster_mode": self.client.is_cluster(),
            "key_prefix": self.prefix,
            "ttl_seconds": self.ttl,
            "capacity_bytes": self.capacity_bytes,
            "known_objects": self.sizes.borrow().len(),
            "locked_keys": self.locks.borrow().len(),
            "stored": c.stored.get(),
            "store_failed": c.store_failed.get(),
            "oom_rejected": c.oom_rejected.get(),
            "hits": c.hits.get(),
            "misses": c.misses.get(),
            "loaded": c.loaded.get(),
            "load_missing": c.load_missing.get(),
            "load_wrong_size": c.load_wrong_size.get(),
            "load_failed": c.load_failed.get(),
            "deleted": c.deleted.get(),
            "errors": c.errors.get(),
            "client": self.client.status(),
        })
    }

    fn set_full_chunk_size(&self, model_name: &str, world_size: u32, og: u32, bytes: u64) {
        let mut sizes = self.full_sizes.borrow_mut();
        let by_ws = match sizes.get_mut(model_name) {
            Some(m) => m,
            None => sizes.entry(model_name.to_owned()).or_default(),
        };
        by_ws.insert((world_size, og), bytes);
    }
}
