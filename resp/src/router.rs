//! Where a request goes: the one server of a standalone deployment, or the
//! master of its key's hash slot in a cluster.
//!
//! In a cluster the slot map comes from `CLUSTER SHARDS` (`CLUSTER SLOTS`
//! on servers without it), asked of any node that answers (the known
//! masters, then the seeds). A `MOVED` reply points the slot at the node it
//! names, sends the request there and refreshes the map; an `ASK` reply
//! sends it there once, after `ASKING`. A request whose node fails at the
//! connection level (a master that died) refreshes the map, and goes again
//! when the slot now has another master (a promoted replica). Refreshes are
//! one at a time and at most one per [`REFRESH_EVERY`], so a storm of
//! failures asks the cluster once.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::client::{Answer, ClientError, ErrorKind, Node, Op, Options, Request, Stats};
use crate::cluster::{
    is_cluster_down, is_try_again, key_slot, parse_cluster_shards, parse_cluster_slots,
    parse_redirect, NodeAddr, Redirect, SlotMap,
};
use crate::Reply;

/// Redirects (and failovers) one request follows at most.
pub const MAX_REDIRECTS: usize = 5;
/// Least time between two slot-map refreshes.
pub const REFRESH_EVERY: Duration = Duration::from_millis(250);
/// Wait before a request that met `TRYAGAIN` or `CLUSTERDOWN` goes again.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

struct Cluster {
    seeds: Vec<NodeAddr>,
    nodes: RefCell<HashMap<NodeAddr, Rc<Node>>>,
    map: RefCell<Option<SlotMap>>,
    refresh_gate: glommio::sync::Semaphore,
    last_refresh: Cell<Option<Instant>>,
    refreshes: Cell<u64>,
    refresh_failures: Cell<u64>,
    moved: Cell<u64>,
    ask: Cell<u64>,
    last_refresh_error: RefCell<Option<String>>,
}

enum Mode {
    Standalone(Rc<Node>),
    Cluster(Box<Cluster>),
}

/// A shard's client of one deployment (standalone or cluster).
pub struct Client {
    opts: Options,
    stats: Rc<Stats>,
    mode: Mode,
}

fn bump(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

impl Client {
    /// A client of the server at `nodes[0]` (standalone), or of the cluster
    /// `nodes` are seeds of. Connects on first use.
    pub fn new(nodes: &[(String, u16)], cluster: bool, opts: Options) -> Client {
        let stats = Rc::new(Stats::default());
        let mode = if cluster {
            Mode::Cluster(Box::new(Cluster {
                seeds: nodes
                    .iter()
                    .map(|(h, p)| NodeAddr {
                        host: h.clone(),
                        port: *p,
                    })
                    .collect(),
                nodes: RefCell::new(HashMap::new()),
                map: RefCell::new(None),
                refresh_gate: glommio::sync::Semaphore::new(1),
                last_refresh: Cell::new(None),
                refreshes: Cell::new(0),
                refresh_failures: Cell::new(0),
                moved: Cell::new(0),
                ask: Cell::new(0),
                last_refresh_error: RefCell::new(None),
            }))
        } else {
            let (host, port) = &nodes[0];
            Mode::Standalone(Rc::new(Node::new(host, *port, opts.clone(), stats.clone())))
        };
        Client { opts, stats, mode }
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.mode, Mode::Cluster(_))
    }

    /// Sends `req`, whose key is `key`, to the node that serves it.
    pub async fn call(&self, key: &[u8], req: Request) -> Result<Answer, ClientError> {
        match &self.mode {
            Mode::Standalone(node) => node.call(&req).await,
            Mode::Cluster(c) => self.call_cluster(c, key_slot(key), req).await,
        }
    }

    /// The nodes a scan must visit: the server, or every master.
    pub async fn masters(&self) -> Result<Vec<Rc<Node>>, ClientError> {
        match &self.mode {
            Mode::Standalone(node) => Ok(vec![node.clone()]),
            Mode::Cluster(c) => {
                if c.map.borrow().is_none() {
                    self.refresh(c, true).await?;
                }
                let masters: Vec<NodeAddr> = {
                    let map = c.map.borrow();
                    let Some(map) = map.as_ref() else {
                        return Err(unavailable("no slot map"));
                    };
                    let mut serving: Vec<NodeAddr> =
                        map.ranges().map(|(_, _, m)| m.clone()).collect();
                    serving.sort();
                    serving.dedup();
                    serving
                };
                Ok(masters.iter().map(|a| self.node(c, a)).collect())
            }
        }
    }

    /// Asks the deployment for any answer past open breakers: the server's,
    /// or any cluster node's (and then refreshes the slot map).
    pub async fn probe(&self) -> Result<(), ClientError> {
        match &self.mode {
            Mode::Standalone(node) => node.probe().await,
            Mode::Cluster(c) => {
                let mut addrs: Vec<NodeAddr> = c.nodes.borrow().keys().cloned().collect();
                for s in &c.seeds {
                    if !addrs.contains(s) {
                        addrs.push(s.clone());
                    }
                }
                let mut last = unavailable("no node to probe");
                let mut answered = false;
                for a in addrs {
                    match self.node(c, &a).probe().await {
                        Ok(()) => answered = true,
                        Err(e) => last = e,
                    }
                }
                if !answered {
                    return Err(last);
                }
                let _ = self.refresh(c, true).await;
                Ok(())
            }
        }
    }

    /// Closes every connection of every node.
    pub fn close_connections(&self) -> usize {
        match &self.mode {
            Mode::Standalone(n) => n.close_connections(),
            Mode::Cluster(c) => c
                .nodes
                .borrow()
                .values()
                .map(|n| n.close_connections())
                .sum(),
        }
    }

    /// Whether any node's breaker is open.
    pub fn breaker_open(&self) -> bool {
        match &self.mode {
            Mode::Standalone(n) => n.breaker_open(),
            Mode::Cluster(c) => c.nodes.borrow().values().any(|n| n.breaker_open()),
        }
    }

    /// Health and counters for `/status` (never secrets).
    pub fn status(&self) -> serde_json::Value {
        let mut s = self.stats.json();
        s["tls"] = self.opts.tls.is_some().into();
        s["breaker_open"] = self.breaker_open().into();
        match &self.mode {
            Mode::Standalone(n) => {
                s["nodes"] = serde_json::json!([n.status()]);
                s["connections"] = n.connections().into();
            }
            Mode::Cluster(c) => {
                let mut nodes: Vec<(NodeAddr, serde_json::Value, usize)> = c
                    .nodes
                    .borrow()
                    .iter()
                    .map(|(a, n)| (a.clone(), n.status(), n.connections()))
                    .collect();
                nodes.sort_by(|a, b| a.0.cmp(&b.0));
                s["connections"] = nodes.iter().map(|n| n.2).sum::<usize>().into();
                s["nodes"] = nodes.into_iter().map(|n| n.1).collect();
                let map = c.map.borrow();
                s["cluster"] = serde_json::json!({
                    "masters": map.as_ref().map_or(0, |m| {
                        let mut v: Vec<&NodeAddr> = m.ranges().map(|r| r.2).collect();
                        v.sort();
                        v.dedup();
                        v.len()
                    }),
                    "covered_slots": map.as_ref().map_or(0, |m| m.covered_slots()),
                    "refreshes": c.refreshes.get(),
                    "refresh_failures": c.refresh_failures.get(),
                    "last_refresh_error": c.last_refresh_error.borrow().clone(),
                    "moved": c.moved.get(),
                    "ask": c.ask.get(),
                });
            }
        }
        s
    }

    fn node(&self, c: &Cluster, addr: &NodeAddr) -> Rc<Node> {
        if let Some(n) = c.nodes.borrow().get(addr) {
            return n.clone();
        }
        let n = Rc::new(Node::new(
            &addr.host,
            addr.port,
            self.opts.clone(),
            self.stats.clone(),
        ));
        c.nodes.borrow_mut().insert(addr.clone(), n.clone());
        n
    }

    fn master_of(c: &Cluster, slot: u16) -> Option<NodeAddr> {
        c.map.borrow().as_ref()?.master_of(slot).cloned()
    }

    async fn call_cluster(
        &self,
        c: &Cluster,
        slot: u16,
        mut req: Request,
    ) -> Result<Answer, ClientError> {
        if Self::master_of(c, slot).is_none() {
            self.refresh(c, true).await?;
        }
        let mut target = Self::master_of(c, slot)
            .ok_or_else(|| unavailable(&format!("no master serves slot {slot}")))?;
        for _ in 0..MAX_REDIRECTS {
            let node = self.node(c, &target);
            let r = node.call(&req).await;
            req.asking = false;
            match r {
                Ok(Answer::Reply(Reply::Error(line))) => {
                    match parse_redirect(&line, &target.host) {
                        Some(Redirect::Moved { slot: s, to }) => {
                            bump(&c.moved);
                            if let Some(map) = c.map.borrow_mut().as_mut() {
                                map.set_slot(s, to.clone());
                            }
                            target = to;
                            let _ = self.refresh(c, false).await;
                        }
                        Some(Redirect::Ask { to, .. }) => {
                            bump(&c.ask);
                            target = to;
                            req.asking = true;
                        }
                        None if is_try_again(&line) || is_cluster_down(&line) => {
                            glommio::timer::sleep(RETRY_PAUSE).await;
                            let _ = self.refresh(c, false).await;
                            if let Some(t) = Self::master_of(c, slot) {
                                target = t;
                            }
                        }
                        None => return Ok(Answer::Reply(Reply::Error(line))),
                    }
                }
                Err(e)
                    if matches!(
                        e.kind,
                        ErrorKind::Unavailable | ErrorKind::Connection | ErrorKind::Timeout
                    ) =>
                {
                    // A master that failed: a replica may have taken over.
                    let _ = self.refresh(c, false).await;
                    match Self::master_of(c, slot) {
                        Some(t) if t != target => target = t,
                        _ => return Err(e),
                    }
                }
                other => return other,
            }
        }
        Err(ClientError::new(
            ErrorKind::Unavailable,
            format!("slot {slot}: more than {MAX_REDIRECTS} redirects"),
        ))
    }

    /// Asks for the slot map; `force` ignores [`REFRESH_EVERY`].
    async fn refresh(&self, c: &Cluster, force: bool) -> Result<(), ClientError> {
        let recent = |c: &Cluster| {
            c.last_refresh
                .get()
                .is_some_and(|at| at.elapsed() < REFRESH_EVERY)
        };
        if !force && recent(c) {
            return Ok(());
        }
        let began = Instant::now();
        let _permit = c
            .refresh_gate
            .acquire_permit(1)
            .await
            .expect("the gate is never closed");
        // Another refresh ran while this one waited.
        if c.last_refresh.get().is_some_and(|at| at >= began) || (!force && recent(c)) {
            return Ok(());
        }
        let mut ask: Vec<NodeAddr> = Vec::new();
        if let Some(map) = c.map.borrow().as_ref() {
            for (_, _, m) in map.ranges() {
                if !ask.contains(m) {
                    ask.push(m.clone());
                }
            }
            for m in map.masters() {
                for r in map.replicas_of(m) {
                    if !ask.contains(r) {
                        ask.push(r.clone());
                    }
                }
            }
        }
        for s in &c.seeds {
            if !ask.contains(s) {
                ask.push(s.clone());
            }
        }
        let mut last = String::from("no node to ask");
        for addr in ask {
            match self.ask_map(c, &addr).await {
                Ok(map) => {
                    bump(&c.refreshes);
                    c.last_refresh.set(Some(Instant::now()));
                    *c.last_refresh_error.borrow_mut() = None;
                    *c.map.borrow_mut() = Some(map);
                    return Ok(());
                }
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        bump(&c.refresh_failures);
        c.last_refresh.set(Some(Instant::now()));
        kvshard_io::log_limited!(log::Level::Warn, "resp cluster: no slot map: {last}");
        *c.last_refresh_error.borrow_mut() = Some(last.clone());
        Err(unavailable(&format!("no slot map: {last}")))
    }

    async fn ask_map(&self, c: &Cluster, addr: &NodeAddr) -> Result<SlotMap, String> {
        let node = self.node(c, addr);
        let tls = self.opts.tls.is_some();
        let shards = Request::command(Op::Cluster, &[b"CLUSTER", b"SHARDS"]);
        let map = match node.call(&shards).await.map_err(|e| e.to_string())? {
            Answer::Reply(Reply::Error(_)) => {
                // Before Redis 7: CLUSTER SLOTS.
                let slots = Request::command(Op::Cluster, &[b"CLUSTER", b"SLOTS"]);
                match node.call(&slots).await.map_err(|e| e.to_string())? {
                    Answer::Reply(Reply::Error(e)) => {
                        return Err(format!("CLUSTER SLOTS: {}", String::from_utf8_lossy(&e)))
                    }
                    Answer::Reply(r) => parse_cluster_slots(&r, &addr.host)?,
                    other => return Err(format!("CLUSTER SLOTS: unexpected {other:?}")),
                }
            }
            Answer::Reply(r) => parse_cluster_shards(&r, &addr.host, tls)?,
            other => return Err(format!("CLUSTER SHARDS: unexpected {other:?}")),
        };
        if map.covered_slots() == 0 {
            return Err("the node serves no slot (not part of a cluster yet?)".to_owned());
        }
        Ok(map)
    }
}

fn unavailable(m: &str) -> ClientError {
    ClientError {
        kind: ErrorKind::Unavailable,
        message: m.to_owned(),
    }
}
