//! The front's I/O edge: where replies leave ([`ReplyPort`], the ROUTER
//! socket as [`ZmqPort`]), where time comes from ([`Clock`]), and the loop
//! that polls the socket and the event queue and feeds [`Front`]
//! ([`FrontLoop`]). Everything past this file is free of I/O.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvshard_dataplane::messages::{FrontEvent, ShardMsg};
pub use kvshard_io::clock::{Clock, SystemClock};
use kvshard_io::log_limit::Level;
use kvshard_io::log_limited;
use kvshard_io::mailbox::{MailboxSender, NotifyReceiver};
use kvshard_messages::config::ServerConfig;

use super::{Front, FrontSetup};

/// Where the front's replies go: the ROUTER socket in the server
/// ([`ZmqPort`]), a recorder in tests.
pub trait ReplyPort {
    /// Sends one multipart reply (`[identity, uid, op, payload?]`) without
    /// blocking.
    fn send(&mut self, frames: &[&[u8]]) -> Result<(), Undelivered>;
}

/// Why a reply was not delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undelivered {
    /// The peer's queue is full: it is not reading its replies.
    QueueFull,
    /// The peer is gone, or another socket error.
    Other(String),
}

/// The ROUTER socket as the front's [`ReplyPort`].
pub struct ZmqPort(pub Rc<zmq::Socket>);

impl ReplyPort for ZmqPort {
    fn send(&mut self, frames: &[&[u8]]) -> Result<(), Undelivered> {
        // Never block: with ROUTER_MANDATORY a blocking send waits while one
        // peer's queue is full, so a client that stops reading its replies
        // would stall the front for every client. That client loses its
        // replies instead.
        self.0
            .send_multipart(frames, zmq::DONTWAIT)
            .map_err(|e| match e {
                zmq::Error::EAGAIN => Undelivered::QueueFull,
                e => Undelivered::Other(e.to_string()),
            })
    }
}

/// The I/O shell around [`Front`]: polls the ROUTER socket and the front's
/// event queue, feeds what arrives to the front, and runs its timers.
pub struct FrontLoop {
    front: Front,
    socket: Rc<zmq::Socket>,
    events: NotifyReceiver<FrontEvent>,
    /// How long to poll for work before sleeping in `zmq::poll` (`--spin-us`).
    spin: Duration,
}

impl FrontLoop {
    pub fn new(
        cfg: Arc<ServerConfig>,
        setup: FrontSetup,
        socket: zmq::Socket,
        shards: Vec<MailboxSender<ShardMsg>>,
        events: NotifyReceiver<FrontEvent>,
    ) -> Self {
        let socket = Rc::new(socket);
        let port = Box::new(ZmqPort(socket.clone()));
        let spin = cfg.spin;
        FrontLoop {
            front: Front::new(cfg, setup, port, Box::new(SystemClock), shards),
            socket,
            events,
            spin,
        }
    }

    /// Polls the event queue and the socket until `spin` has passed, moving
    /// events into `events`; whether there is work. Shards skip the eventfd
    /// write meanwhile (see [`NotifyReceiver::take_awake`]).
    pub(super) fn spin_for_work(&mut self, events: &mut Vec<FrontEvent>) -> bool {
        let until = Instant::now() + self.spin;
        let mut checks = 0u32;
        loop {
            if self.events.take_awake(events) > 0 {
                return true;
            }
            checks = checks.wrapping_add(1);
            if checks % 16 == 0 {
                // ZMQ_EVENTS: whether a message is ready, without waiting.
                if self
                    .socket
                    .get_events()
                    .is_ok_and(|e| e.contains(zmq::POLLIN))
                {
                    return true;
                }
                if Instant::now() >= until {
                    return false;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Serves until `stop` is set, seen within [`STOP_CHECK_MS`].
    pub fn run(&mut self, stop: &AtomicBool) {
        let mut events: Vec<FrontEvent> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let mut timeout_ms = self.front.poll_timeout_ms().min(STOP_CHECK_MS);
            if !self.spin.is_zero() && timeout_ms != 0 {
                let found = self.spin_for_work(&mut events);
                // Re-arm the eventfd before sleeping on it, taking what came
                // while the shards were told not to signal.
                self.events.drain(&mut events);
                if found || !events.is_empty() {
                    timeout_ms = 0;
                }
                for ev in events.drain(..) {
                    self.front.on_event(ev);
                }
            }
            let (sock_ready, ev_ready) = {
                let mut items = [
                    self.socket.as_poll_item(zmq::POLLIN),
                    zmq::PollItem::from_fd(self.events.fd(), zmq::POLLIN),
                ];
                match zmq::poll(&mut items, timeout_ms) {
                    Ok(_) => (items[0].is_readable(), items[1].is_readable()),
                    Err(zmq::Error::EINTR) => continue,
                    Err(e) => {
                        log_limited!(Level::Error, "zmq poll failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        (false, false)
                    }
                }
            };
            if ev_ready {
                self.events.drain(&mut events);
                for ev in events.drain(..) {
                    self.front.on_event(ev);
                }
            }
            if sock_ready {
                // Bounded batch so shard replies are not starved by a flood of requests.
                for _ in 0..256 {
                    match self.recv_frames() {
                        Ok(frames) => self.front.on_message(frames),
                        Err(zmq::Error::EAGAIN) => break,
                        Err(zmq::Error::EINTR) => break,
                        Err(e) => {
                            log_limited!(Level::Error, "zmq recv failed: {e}");
                            break;
                        }
                    }
                }
            }
            let now = self.front.clock.now();
            self.front.on_timers(now);
        }
        self.front.finish_lookup_log();
    }

    /// Receives one multipart message, its frames left in ZeroMQ's own buffers
    /// (a payload frame can be hundreds of MiB; it is read in place, never copied).
    pub(super) fn recv_frames(&self) -> Result<Vec<zmq::Message>, zmq::Error> {
        let mut frames = Vec::with_capacity(4);
        loop {
            let mut m = zmq::Message::new();
            // The parts of a message arrive together: only the first can find none.
            self.socket.recv(&mut m, zmq::DONTWAIT)?;
            let more = m.get_more();
            frames.push(m);
            if !more {
                return Ok(frames);
            }
        }
    }
}

/// The longest the front's loop sleeps between looks at the stop flag: a
/// SIGTERM caught by another thread does not interrupt its poll.
pub(super) const STOP_CHECK_MS: i64 = 100;
