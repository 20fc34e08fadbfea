//! The link to the shards: sequence numbers, sends that never wait (a full
//! mailbox spills into an overflow queue, bounded for client requests),
//! wake-ups deferred to the end of each entry point or, for replyless
//! messages, to the next one that wants a reply, and the shards that died.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvshard_dataplane::messages::{ReplyTo, Seq, ShardMsg, ShardOp};
use kvshard_engine::keys::ObjectKey;
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_io::mailbox::SendError;
use kvshard_wire as wire;

use super::Front;

/// Test hook, compiled into debug builds only (those the test suite runs;
/// release binaries have none): `KVSHARD_TEST_STOP_SHARD=N` makes the front drop its mailbox
/// sender of shard N just before its first message to it, so that the shard
/// thread ends as it does at shutdown and that message finds the mailbox
/// closed: the path of a shard thread that died. Never set in production.
#[cfg(debug_assertions)]
pub(super) const TEST_STOP_SHARD_ENV: &str = "KVSHARD_TEST_STOP_SHARD";

/// The shard [`TEST_STOP_SHARD_ENV`] names, if set (logged: a test hook).
#[cfg(debug_assertions)]
pub(super) fn test_stop_shard_from_env() -> Option<usize> {
    let shard = std::env::var(TEST_STOP_SHARD_ENV)
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(i) = shard {
        log::warn!(
            "{TEST_STOP_SHARD_ENV}={i} is set: shard {i} will be stopped on its first message \
             (a test hook)"
        );
    }
    shard
}

/// One shard's overflow queue (see `Front::overflow`), counting the messages
/// in it that want a reply.
#[derive(Default)]
pub(super) struct Overflow {
    pub(super) queue: VecDeque<ShardMsg>,
    pub(super) requests: usize,
}

impl Overflow {
    pub(super) fn push_back(&mut self, msg: ShardMsg) {
        self.requests += usize::from(msg.seq != 0);
        self.queue.push_back(msg);
    }

    pub(super) fn push_front(&mut self, msg: ShardMsg) {
        self.requests += usize::from(msg.seq != 0);
        self.queue.push_front(msg);
    }

    pub(super) fn pop_front(&mut self) -> Option<ShardMsg> {
        let msg = self.queue.pop_front()?;
        self.requests -= usize::from(msg.seq != 0);
        Some(msg)
    }

    pub(super) fn clear(&mut self) {
        self.queue.clear();
        self.requests = 0;
    }

    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// How long a message that wants no reply may wait in a shard's mailbox for
/// the shard to be woken by something else (see `Front::lazy`); the loop's
/// next timer pass after that wakes it (the poll then sleeps 1 ms at most).
pub(super) const LAZY_WAKE_AFTER: Duration = Duration::from_millis(1);

/// Replyless messages for one shard that wake it without waiting.
pub(super) const LAZY_WAKE_BACKLOG: u32 = 32;

impl Front {
    pub(super) fn alloc_seq(&mut self) -> Seq {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// Gives `msg` to shard `shard` without ever waiting. When its mailbox is
    /// full the message joins the shard's overflow queue (drained as room
    /// appears, in order). The overflow bound applies to client requests only,
    /// checked before any of their parts is sent ([`Front::refused`]): the
    /// other messages (lock releases, aborts, commits and the other posts with
    /// seq 0, L2 loads, control requests) always queue, as dropping one would
    /// leak a lock or a reservation. They are bounded by the requests that
    /// caused them, and control requests by the HTTP API's connection limit.
    ///
    /// A message for a dead shard is dropped; a request's part of it is failed
    /// by [`Front::fail_dead_parts`] (its `Inflight` still awaits that shard).
    pub(super) fn send(&mut self, shard: usize, msg: ShardMsg) {
        let wake = msg.seq != 0;
        self.send_waking(shard, msg, wake);
    }

    /// [`send`](Self::send), waking the shard for the message only when
    /// `wake`: a message that wants a reply but no prompt one (a credit top-up)
    /// rides along with the next wake-up, as replyless ones do.
    pub(super) fn send_waking(&mut self, shard: usize, msg: ShardMsg, wake: bool) {
        #[cfg(debug_assertions)]
        if self.test_stop_shard == Some(shard) {
            self.test_stop_shard = None;
            self.stop_shard_for_test(shard);
        }
        if self.dead[shard] {
            self.dead_parts_pending |= msg.seq != 0;
            return;
        }
        if !self.overflow[shard].is_empty() {
            self.drain_overflow(shard);
            if !self.overflow[shard].is_empty() {
                self.overflow[shard].push_back(msg);
                return;
            }
        }
        match self.shards[shard].try_send_unwoken(msg) {
            Ok(()) if wake => self.mark_unwoken(shard),
            Ok(()) => self.mark_lazy(shard),
            Err(SendError::Full(msg)) => {
                // Whatever fills the mailbox, the shard is woken to empty it.
                self.mark_unwoken(shard);
                self.metrics.mailbox_full += 1;
                self.overflowing += 1;
                self.overflow[shard].push_back(msg);
            }
            Err(SendError::Closed(msg)) => {
                self.dead_parts_pending |= msg.seq != 0;
                self.mark_dead(shard, "its mailbox is closed");
            }
        }
    }

    pub(super) fn mark_unwoken(&mut self, shard: usize) {
        if !self.is_unwoken[shard] {
            self.is_unwoken[shard] = true;
            self.unwoken.push(shard);
        }
    }

    /// Notes a message that wants no reply, queued for `shard` unwoken.
    pub(super) fn mark_lazy(&mut self, shard: usize) {
        let (count, since) = &mut self.lazy[shard];
        *count += 1;
        since.get_or_insert_with(|| self.clock.now());
        if *count >= LAZY_WAKE_BACKLOG {
            self.mark_unwoken(shard);
        }
    }

    /// Wakes every shard sent a message that wants a reply since the last
    /// call, and those whose replyless messages waited long enough.
    pub(super) fn wake_shards(&mut self) {
        for shard in self.unwoken.drain(..) {
            self.is_unwoken[shard] = false;
            self.lazy[shard] = (0, None);
            self.shards[shard].wake();
        }
    }

    /// Marks for waking the shards whose oldest replyless message was sent
    /// [`LAZY_WAKE_AFTER`] before `now`.
    pub(super) fn lazy_due(&mut self, now: Instant) {
        for shard in 0..self.lazy.len() {
            if self.lazy[shard]
                .1
                .is_some_and(|since| since + LAZY_WAKE_AFTER <= now)
            {
                self.mark_unwoken(shard);
            }
        }
    }

    /// Moves what fits of shard `shard`'s overflow queue into its mailbox.
    pub(super) fn drain_overflow(&mut self, shard: usize) {
        debug_assert!(!self.overflow[shard].is_empty());
        while let Some(msg) = self.overflow[shard].pop_front() {
            match self.shards[shard].try_send_unwoken(msg) {
                Ok(()) => self.mark_unwoken(shard),
                Err(SendError::Full(msg)) => {
                    self.overflow[shard].push_front(msg);
                    return;
                }
                Err(SendError::Closed(_)) => {
                    // Drops the rest; the requests among them are failed by
                    // fail_dead_parts like every other part awaiting the shard.
                    self.overflow[shard].clear();
                    self.overflowing -= 1;
                    self.mark_dead(shard, "its mailbox is closed");
                    return;
                }
            }
        }
        self.overflowing -= 1;
    }

    /// Runs on every turn of the loop: moves overflow into mailboxes that have
    /// room, notices shards whose thread ended, and fails what awaited them.
    pub(super) fn watch_shards(&mut self) {
        if self.overflowing > 0 {
            for shard in 0..self.shards.len() {
                if !self.overflow[shard].is_empty() {
                    self.drain_overflow(shard);
                }
            }
        }
        for shard in 0..self.shards.len() {
            if !self.dead[shard] && self.shards[shard].is_closed() {
                self.mark_dead(shard, "its thread ended");
            }
        }
        self.fail_dead_parts();
    }

    /// Records that shard `shard`'s thread is gone: from now on every request
    /// that needs it is answered with its failure reply, `/healthcheck` says
    /// unhealthy and `/status` names it. Its queued messages are dropped.
    pub(super) fn mark_dead(&mut self, shard: usize, why: &str) {
        if self.dead[shard] {
            return;
        }
        self.dead[shard] = true;
        if !self.overflow[shard].is_empty() {
            self.overflow[shard].clear();
            self.overflowing -= 1;
        }
        self.dead_parts_pending = true;
        log::error!(
            "shard {shard} has stopped ({why}): requests that need it are answered with their \
             failure reply from now on, and /healthcheck reports unhealthy; restart the server"
        );
    }

    /// Test hook ([`TEST_STOP_SHARD_ENV`]): drops the front's only sender of
    /// shard `shard`'s mailbox, keeping a closed one in its place. The shard's
    /// loop then ends and its thread exits, as at shutdown.
    #[cfg(debug_assertions)]
    pub(super) fn stop_shard_for_test(&mut self, shard: usize) {
        log::warn!("test hook: stopping shard {shard}");
        let (closed, rx) = kvshard_io::mailbox::mailbox(1);
        drop(rx);
        self.shards[shard] = closed;
    }

    /// Whether a client request that needs `shards` must be refused now: one
    /// of them is dead, or its overflow queue holds `overflow_bound` messages.
    /// Checked before any part is sent, so a request is given to all its shards
    /// or to none. Counts and logs the refusal; the caller answers.
    pub(super) fn refused(
        &mut self,
        to: &ReplyTo,
        shards: impl IntoIterator<Item = usize>,
    ) -> bool {
        let op = wire::decode_op(&to.op).map_or("request", |o| o.name());
        for shard in shards {
            if !self.dead[shard] && self.shards[shard].is_closed() {
                self.mark_dead(shard, "its thread ended");
            }
            if self.dead[shard] {
                self.metrics.shard_dead_refused += 1;
                log_limited!(
                    Level::Warn,
                    "{op} needs stopped shard {shard}: answered with the failure reply"
                );
                return true;
            }
            // Counted in messages that want a reply: the replyless ones a
            // client's commit or release leaves (lazily woken) must not get
            // its next request refused.
            if self.overflow[shard].requests >= self.overflow_bound {
                self.drain_overflow(shard);
            }
            if self.overflow[shard].requests >= self.overflow_bound {
                self.metrics.shard_overflow_refused += 1;
                log_limited!(
                    Level::Warn,
                    "{op}: shard {shard} is overloaded (its mailbox is full and {} more messages wait, \
                     the bound of --shard-queue-depth); answered with the failure reply",
                    self.overflow[shard].len()
                );
                return true;
            }
        }
        false
    }

    /// Sends `make(keys)` to every shard owning some of `keys`, wanting no
    /// reply; the shards are not woken for it (see `lazy`).
    pub(super) fn post(&mut self, keys: Vec<ObjectKey>, make: impl Fn(Vec<ObjectKey>) -> ShardOp) {
        let n = self.shards.len();
        if n == 1 {
            if !keys.is_empty() {
                let op = make(keys);
                self.send(0, ShardMsg { seq: 0, op });
            }
            return;
        }
        let mut per: Vec<Vec<ObjectKey>> = vec![Vec::new(); n];
        for k in keys {
            per[k.shard(n)].push(k);
        }
        for (i, ks) in per.into_iter().enumerate() {
            if !ks.is_empty() {
                let op = make(ks);
                self.send(i, ShardMsg { seq: 0, op });
            }
        }
    }

    pub(super) fn post_all(&mut self, make: impl Fn() -> ShardOp) {
        for i in 0..self.shards.len() {
            self.send(i, ShardMsg { seq: 0, op: make() });
        }
    }
}
