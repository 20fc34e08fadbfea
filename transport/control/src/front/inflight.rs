//! Fan-out and fan-in: a request split by owning shard ([`Front::split`]),
//! its parts sent ([`Front::fan_out`], [`Front::broadcast`]), and the
//! answers folded back in ([`merge`], or [`fail_items`] for a shard that
//! died) until the last one completes it ([`Front::settle_part`]).

use kvshard_dataplane::messages::{
    Found, ReplyTo, Seq, ShardMsg, ShardOp, ShardReply, ShardReplyBody, ShardReport, StoreOutcome,
    NO_SLAB,
};
use kvshard_engine::keys::ObjectKey;
use kvshard_engine::slab::Slab;
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_layout::ObjectLayout;
use kvshard_messages::control::{ControlRequest, Responder};
use kvshard_wire::InstanceId;

use super::lookup::PendingLoad;
use super::Front;
use crate::registry::TransferKey;

/// A request waiting for its shards.
///
/// Invariants (checked by [`Inflight::check`] at every change): `remaining`
/// counts the shards still `waiting`; a shard no longer waited for has no
/// part left. Each awaited part is settled once (`waiting` goes false), and
/// the request completes once, when `remaining` reaches 0 and it leaves
/// `Front::inflight`.
pub(super) struct Inflight {
    remaining: usize,
    /// Global item indices sent to each shard, in the order sent (a
    /// broadcast sends none and waits for every shard).
    parts: Vec<Vec<usize>>,
    /// Per shard: its answer is still awaited. A part whose shard died is
    /// failed (and no longer awaited) by `Front::fail_dead_parts`.
    waiting: Vec<bool>,
    pub(super) kind: InflightKind,
}

impl Inflight {
    fn new(parts: Vec<Vec<usize>>, waiting: Vec<bool>, kind: InflightKind) -> Self {
        let inf = Inflight {
            remaining: waiting.iter().filter(|w| **w).count(),
            parts,
            waiting,
            kind,
        };
        debug_assert!(inf.remaining > 0, "a request in flight awaits some shard");
        inf.check();
        inf
    }

    fn check(&self) {
        debug_assert_eq!(self.parts.len(), self.waiting.len());
        debug_assert_eq!(
            self.remaining,
            self.waiting.iter().filter(|w| **w).count(),
            "remaining parts and awaited shards disagree"
        );
        debug_assert!(
            self.waiting
                .iter()
                .zip(&self.parts)
                .all(|(waiting, part)| *waiting || part.is_empty()),
            "a settled shard still has items"
        );
    }
}

pub(super) enum InflightKind {
    /// A lookup's first phase. Its ack went out when the shards were sent
    /// their parts; a status query meanwhile is held until this completes, so
    /// the client's first poll finds the L1 result (the 0.5.6 bench client
    /// sleeps 50 ms after a poll that finds the prefetch still running).
    Lookup {
        /// What was asked (its `found` is filled in as the shards answer).
        lookup: PendingLoad,
    },
    /// A lookup's L2 loads.
    Load {
        load: PendingLoad,
        /// Indices (into `load.keys`) of the keys being loaded, in send order.
        loading: Vec<usize>,
        loaded: Vec<bool>,
        /// Where each loaded key's slab lies (`NO_SLAB` if not loaded).
        slabs: Vec<u64>,
    },
    PrepareStore {
        to: ReplyTo,
        tkey: TransferKey,
        keys: Vec<ObjectKey>,
        layout: ObjectLayout,
        slabs: Vec<Option<Slab>>,
    },
    PrepareRetrieve {
        to: ReplyTo,
        tkey: TransferKey,
        keys: Vec<ObjectKey>,
        layout: ObjectLayout,
        slabs: Vec<Option<Slab>>,
    },
    Store {
        to: ReplyTo,
        outcomes: Vec<StoreOutcome>,
    },
    /// Write credits asked of one shard.
    Credits {
        shard: usize,
        size: u64,
        slabs: Vec<Option<Slab>>,
    },
    /// A GPU worker's STORE, reserving its objects.
    CudaStore {
        to: ReplyTo,
        iid: InstanceId,
        keys: Vec<ObjectKey>,
        blocks: Vec<Vec<i64>>,
        event: Vec<u8>,
        slabs: Vec<Option<Slab>>,
    },
    /// A GPU worker's RETRIEVE, finding its read-locked objects.
    CudaRetrieve {
        to: ReplyTo,
        iid: InstanceId,
        keys: Vec<ObjectKey>,
        blocks: Vec<Vec<i64>>,
        /// Tokens each chunk leaves untouched (skip_first_n_tokens).
        skips: Vec<usize>,
        event: Vec<u8>,
        slabs: Vec<Option<Slab>>,
    },
    Retrieve {
        to: ReplyTo,
        oks: Vec<bool>,
    },
    Clear {
        to: Option<ReplyTo>,
        responder: Option<Responder>,
        cleared: u64,
    },
    Reports {
        request: ControlRequest,
        responder: Responder,
        reports: Vec<Option<ShardReport>>,
    },
}

/// The shards a request split into `parts` involves.
pub(super) fn involved(parts: &[Vec<usize>]) -> impl Iterator<Item = usize> + '_ {
    parts
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(s, _)| s)
}

/// Marks the items `idx` of a request failed: their shard stopped before it
/// answered. Most kinds start out as failed already (no slab, not loaded, not
/// retrieved, no report); a lookup finds nothing there.
pub(super) fn fail_items(kind: &mut InflightKind, idx: &[usize]) {
    match kind {
        InflightKind::Lookup { lookup, .. } => {
            if lookup.found.is_empty() {
                lookup.found = vec![Found::Miss; lookup.keys.len()];
                lookup.slabs = vec![NO_SLAB; lookup.keys.len()];
            }
            for i in idx {
                lookup.found[*i] = Found::Miss;
                lookup.slabs[*i] = NO_SLAB;
            }
        }
        InflightKind::Store { outcomes, .. } => {
            for i in idx {
                outcomes[*i] = StoreOutcome::Failed;
            }
        }
        InflightKind::Load { loaded, slabs, .. } => {
            for i in idx {
                loaded[*i] = false;
                slabs[*i] = NO_SLAB;
            }
        }
        InflightKind::Retrieve { oks, .. } => {
            for i in idx {
                oks[*i] = false;
            }
        }
        InflightKind::PrepareStore { slabs, .. }
        | InflightKind::PrepareRetrieve { slabs, .. }
        | InflightKind::CudaStore { slabs, .. }
        | InflightKind::CudaRetrieve { slabs, .. }
        | InflightKind::Credits { slabs, .. } => {
            for i in idx {
                slabs[*i] = None;
            }
        }
        InflightKind::Clear { .. } | InflightKind::Reports { .. } => {}
    }
}

/// Folds one shard's reply into the request it belongs to.
pub(super) fn merge(kind: &mut InflightKind, idx: &[usize], shard: usize, body: ShardReplyBody) {
    match (kind, body) {
        (InflightKind::Lookup { lookup, .. }, ShardReplyBody::Found { found, slabs }) => {
            let n = lookup.keys.len();
            if lookup.found.is_empty() {
                lookup.found = vec![Found::Miss; n];
                lookup.slabs = vec![NO_SLAB; n];
            }
            for (i, v) in idx.iter().zip(found) {
                lookup.found[*i] = v;
            }
            for (i, s) in idx.iter().zip(slabs) {
                lookup.slabs[*i] = s;
            }
        }
        (InflightKind::Load { loaded, slabs, .. }, ShardReplyBody::Loaded { ok, slabs: at }) => {
            for ((i, v), s) in idx.iter().zip(ok).zip(at) {
                loaded[*i] = v;
                slabs[*i] = s;
            }
        }
        (
            InflightKind::PrepareStore { slabs, .. }
            | InflightKind::PrepareRetrieve { slabs, .. }
            | InflightKind::CudaStore { slabs, .. }
            | InflightKind::CudaRetrieve { slabs, .. }
            | InflightKind::Credits { slabs, .. },
            ShardReplyBody::Slabs(s),
        ) => {
            for (i, v) in idx.iter().zip(s) {
                slabs[*i] = v;
            }
        }
        (InflightKind::Store { outcomes, .. }, ShardReplyBody::Stored(o)) => {
            for (i, v) in idx.iter().zip(o) {
                outcomes[*i] = v;
            }
        }
        (InflightKind::Retrieve { oks, .. }, ShardReplyBody::Retrieved(o)) => {
            for (i, v) in idx.iter().zip(o) {
                oks[*i] = v;
            }
        }
        (InflightKind::Clear { cleared, .. }, ShardReplyBody::Count(n)) => *cleared += n,
        (InflightKind::Reports { reports, .. }, ShardReplyBody::Status(r)) => {
            reports[shard] = Some(*r)
        }
        (_, _) => log_limited!(
            Level::Error,
            "shard {shard} answered with a reply of the wrong kind"
        ),
    }
}

impl Front {
    /// Fails every part of an in-flight request that awaits a dead shard; a
    /// request whose last awaited part that was completes (answered once, as a
    /// failure for the dead shard's items).
    pub(super) fn fail_dead_parts(&mut self) {
        // Completing a request may send more (to dead shards too): repeat.
        while std::mem::take(&mut self.dead_parts_pending) {
            let dead = &self.dead;
            let parts: Vec<(Seq, usize)> = self
                .inflight
                .iter()
                .flat_map(|(seq, inf)| {
                    inf.waiting
                        .iter()
                        .enumerate()
                        .filter(|(s, w)| **w && dead[*s])
                        .map(move |(s, _)| (*seq, s))
                })
                .collect();
            for (seq, shard) in parts {
                self.settle_part(seq, shard, None);
            }
        }
    }

    /// Folds shard `shard`'s answer to request `seq` in (`None`: the shard is
    /// dead, its items fail) and completes the request after its last part.
    pub(super) fn settle_part(&mut self, seq: Seq, shard: usize, body: Option<ShardReplyBody>) {
        let Some(inf) = self.inflight.get_mut(&seq) else {
            if !self.dead[shard] {
                log_limited!(
                    Level::Error,
                    "reply for unknown request {seq} from shard {shard}"
                );
            }
            return;
        };
        if !inf.waiting[shard] {
            // An answer racing the shard's death, after its part was failed.
            log::debug!("late reply to request {seq} from stopped shard {shard} ignored");
            return;
        }
        inf.waiting[shard] = false;
        let idx = std::mem::take(&mut inf.parts[shard]);
        match body {
            Some(body) => merge(&mut inf.kind, &idx, shard, body),
            None => fail_items(&mut inf.kind, &idx),
        }
        inf.remaining -= 1;
        inf.check();
        if inf.remaining > 0 {
            return;
        }
        let inf = self.inflight.remove(&seq).expect("looked up above");
        debug_assert!(!inf.waiting.contains(&true));
        self.complete(seq, inf.kind);
    }

    /// Splits `keys` by owning shard (keeping their order) and returns, per shard,
    /// the indices taken.
    pub(super) fn split(&self, keys: &[ObjectKey]) -> Vec<Vec<usize>> {
        let n = self.shards.len();
        let mut parts = vec![Vec::new(); n];
        for (i, k) in keys.iter().enumerate() {
            parts[k.shard(n)].push(i);
        }
        parts
    }

    /// Sends one message per shard that owns some of `keys`; `make` builds the op
    /// from that shard's indices. Registers `kind` to collect the replies, or, if no
    /// shard was involved, returns the kind for immediate completion.
    pub(super) fn fan_out(
        &mut self,
        parts: Vec<Vec<usize>>,
        kind: InflightKind,
        make: impl FnMut(&[usize]) -> ShardOp,
    ) -> Option<InflightKind> {
        self.fan_out_waking(parts, kind, true, make)
    }

    /// [`fan_out`](Self::fan_out), waking the shards for the messages only
    /// when `wake` (see [`send_waking`](Self::send_waking)).
    pub(super) fn fan_out_waking(
        &mut self,
        parts: Vec<Vec<usize>>,
        kind: InflightKind,
        wake: bool,
        mut make: impl FnMut(&[usize]) -> ShardOp,
    ) -> Option<InflightKind> {
        let involved = parts.iter().filter(|p| !p.is_empty()).count();
        if involved == 0 {
            return Some(kind);
        }
        let seq = self.alloc_seq();
        for (shard, idx) in parts.iter().enumerate() {
            if !idx.is_empty() {
                let op = make(idx);
                self.send_waking(shard, ShardMsg { seq, op }, wake);
            }
        }
        let waiting = parts.iter().map(|p| !p.is_empty()).collect();
        let inf = Inflight::new(parts, waiting, kind);
        debug_assert_eq!(inf.remaining, involved);
        let earlier = self.inflight.insert(seq, inf);
        debug_assert!(earlier.is_none(), "sequence number {seq} in flight twice");
        None
    }

    pub(super) fn broadcast(&mut self, kind: InflightKind, make: impl Fn() -> ShardOp) {
        let n = self.shards.len();
        let seq = self.alloc_seq();
        for i in 0..n {
            self.send(i, ShardMsg { seq, op: make() });
        }
        let inf = Inflight::new(vec![Vec::new(); n], vec![true; n], kind);
        let earlier = self.inflight.insert(seq, inf);
        debug_assert!(earlier.is_none(), "sequence number {seq} in flight twice");
    }

    pub(super) fn on_shard_reply(&mut self, reply: ShardReply) {
        self.settle_part(reply.seq, reply.shard, Some(reply.body));
    }
}
