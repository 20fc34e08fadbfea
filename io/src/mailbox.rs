//! Cross-thread queues with wake-ups.
//!
//! - [`mailbox`]: plain threads (the ZeroMQ transport thread) -> one shard's
//!   glommio executor. Bounded; a full mailbox is refused at once.
//! - [`notify_queue`]: shards (and the HTTP thread) -> the transport thread,
//!   which sleeps in `zmq::poll` and watches this queue's fd.
//!
//! Both avoid a syscall per message: the consumer publishes that it is about
//! to sleep, and a producer only signals the fd when it is the one that flips
//! that flag back. The pattern is the usual store / fence / load pair on both
//! sides, so either the consumer sees the item or the producer sees the flag.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;

/// The wake side shared by the producers of one queue.
#[derive(Debug)]
struct Wake {
    /// The consumer is (about to be) parked and needs a signal.
    sleeping: AtomicBool,
    /// Write end of the wake channel (socketpair end or eventfd), nonblocking.
    fd: OwnedFd,
    /// The consumer is gone (a mailbox's receiver was dropped: its shard
    /// thread ended). Set once, never cleared.
    receiver_gone: AtomicBool,
    /// eventfd counters take 8-byte writes; socketpairs take one byte.
    eventfd: bool,
    /// Wake-up writes made (the consumer was parked when an item came).
    signals: AtomicU64,
}

impl Wake {
    /// Called after publishing an item (or a disconnect).
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.signal();
        }
    }

    fn signal(&self) {
        self.signals.fetch_add(1, Ordering::Relaxed);
        let rc = if self.eventfd {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our own eventfd.
            unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) }
        } else {
            // SAFETY: sends one byte from a valid buffer; MSG_NOSIGNAL keeps a
            // closed peer from raising SIGPIPE.
            unsafe {
                libc::send(
                    self.fd.as_raw_fd(),
                    b"w".as_ptr().cast(),
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            }
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            // Full: a wake-up is already pending. Gone: nobody to wake.
            if !matches!(
                e.raw_os_error(),
                Some(libc::EAGAIN) | Some(libc::EPIPE) | Some(libc::ECONNRESET)
            ) {
                log::warn!("mailbox wake-up write failed: {e}");
            }
        }
    }
}

/// Read everything pending on a nonblocking fd; returns whether anything was.
/// A read that does not fill the buffer took everything there was (an
/// eventfd's whole counter, or a socketpair's last bytes): no second read
/// is spent to hear EAGAIN. Whatever is written after it makes the fd
/// readable again for the next wait.
fn drain_fd(fd: RawFd) -> bool {
    let mut buf = [0u8; 64];
    let mut any = false;
    loop {
        // SAFETY: reads into a valid stack buffer of the given length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            any = true;
            if (n as usize) < buf.len() {
                return true;
            }
            continue;
        }
        if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return any;
    }
}

fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid out-array of two ints.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

// ---------------------------------------------------------------------------
// transport thread -> shard

struct SenderInner<T> {
    /// Option only so that Drop can release it before the final wake-up.
    tx: Option<SyncSender<T>>,
    wake: Arc<Wake>,
}

impl<T> Drop for SenderInner<T> {
    fn drop(&mut self) {
        // The last sender is gone: disconnect first, then wake the receiver so
        // that it observes the disconnect and returns None.
        drop(self.tx.take());
        self.wake.notify();
    }
}

/// Producer side of a shard mailbox. Cheap to clone; usable from any thread.
pub struct MailboxSender<T> {
    inner: Arc<SenderInner<T>>,
}

impl<T> Clone for MailboxSender<T> {
    fn clone(&self) -> Self {
        MailboxSender {
            inner: self.inner.clone(),
        }
    }
}

impl<T> std::fmt::Debug for MailboxSender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MailboxSender").finish_non_exhaustive()
    }
}

/// Why [`MailboxSender::try_send`] handed a message back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendError<T> {
    /// The mailbox holds its capacity: try again once the consumer took some.
    Full(T),
    /// The receiver is gone (its shard thread ended): no retry can succeed.
    Closed(T),
}

impl<T> SendError<T> {
    /// The message that was not queued.
    pub fn into_inner(self) -> T {
        match self {
            SendError::Full(m) | SendError::Closed(m) => m,
        }
    }
}

impl<T: Send> MailboxSender<T> {
    /// Queue `msg` without blocking, or hand it back saying why not: the
    /// mailbox is full (the caller decides whether to queue it elsewhere or
    /// refuse it) or closed (the receiver is gone for good).
    pub fn try_send(&self, msg: T) -> Result<(), SendError<T>> {
        self.try_send_unwoken(msg)?;
        self.wake();
        Ok(())
    }

    /// [`MailboxSender::try_send`] without the wake-up. The caller must call
    /// [`MailboxSender::wake`] after it (once for a batch of messages, or
    /// after it has answered its own client, keeping the wake-up's syscall
    /// off that client's round trip); until then a parked consumer sleeps on
    /// the message. Order is kept: the messages are queued at once.
    pub fn try_send_unwoken(&self, msg: T) -> Result<(), SendError<T>> {
        let tx = self.inner.tx.as_ref().expect("sender alive until drop");
        match tx.try_send(msg) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(m)) => Err(SendError::Full(m)),
            Err(TrySendError::Disconnected(m)) => Err(SendError::Closed(m)),
        }
    }

    /// Wakes the consumer if it is parked: one syscall then, none otherwise.
    pub fn wake(&self) {
        self.inner.wake.notify();
    }

    /// How many times the consumer was woken from its park (wake-up
    /// syscalls made by all senders).
    pub fn wakeups(&self) -> u64 {
        self.inner.wake.signals.load(Ordering::Relaxed)
    }

    /// Whether the receiver is gone (dropped, e.g. because its shard thread
    /// ended), so that a sender with nothing to send can still find out. One
    /// atomic load.
    pub fn is_closed(&self) -> bool {
        self.inner.wake.receiver_gone.load(Ordering::SeqCst)
    }
}

/// A wake-up stream kept by the executor that owns a [`MailboxReceiver`]
/// (glommio streams are `!Send`, so it cannot live in the receiver itself).
pub struct Parker {
    stream: glommio::net::UnixStream,
}

impl Parker {
    async fn park(&mut self, wake_fd: RawFd) -> io::Result<()> {
        use futures_lite::AsyncReadExt;
        // One byte fills the buffer, so glommio does not arm a follow-up poll
        // for a stream that may be dropped next; drain_fd takes the rest.
        let mut byte = [0u8; 1];
        let n = self.stream.read(&mut byte).await?;
        if n == 0 {
            // Cannot happen while the sender side holds the write end; report it
            // rather than spin on a closed socket.
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "mailbox wake socket closed",
            ));
        }
        drain_fd(wake_fd);
        Ok(())
    }
}

/// Consumer side of a shard mailbox, polled inside a glommio executor. It is
/// `Send` so it can be built on the main thread and moved into the shard.
pub struct MailboxReceiver<T> {
    rx: Receiver<T>,
    wake: Arc<Wake>,
    /// Read end of the wake socketpair.
    wake_rx: OwnedFd,
    /// A park failed once already (logged; now polling).
    park_failed: bool,
    /// How long to poll an empty queue before parking (see [`MailboxReceiver::set_spin`]).
    spin: std::time::Duration,
}

impl<T> Drop for MailboxReceiver<T> {
    fn drop(&mut self) {
        // Before the channel's receiver (a field, dropped after this): a
        // sender that sees the channel disconnected also sees the flag.
        self.wake.receiver_gone.store(true, Ordering::SeqCst);
    }
}

impl<T> std::fmt::Debug for MailboxReceiver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MailboxReceiver")
            .field("wake_rx", &self.wake_rx)
            .finish_non_exhaustive()
    }
}

/// A bounded mailbox holding at most `capacity` (> 0) messages.
///
/// # Panics
/// If `capacity` is 0 or the wake socketpair cannot be created (fd exhaustion
/// at start-up).
pub fn mailbox<T: Send>(capacity: usize) -> (MailboxSender<T>, MailboxReceiver<T>) {
    try_mailbox(capacity).unwrap_or_else(|e| panic!("cannot create a shard mailbox: {e}"))
}

/// Like [`mailbox`] but reports a socketpair failure instead of panicking.
pub fn try_mailbox<T: Send>(capacity: usize) -> io::Result<(MailboxSender<T>, MailboxReceiver<T>)> {
    assert!(
        capacity > 0,
        "a mailbox needs room for at least one message"
    );
    let (tx, rx) = mpsc::sync_channel(capacity);
    let (rd, wr) = socketpair()?;
    let wake = Arc::new(Wake {
        sleeping: AtomicBool::new(false),
        fd: wr,
        receiver_gone: AtomicBool::new(false),
        eventfd: false,
        signals: AtomicU64::new(0),
    });
    let sender = MailboxSender {
        inner: Arc::new(SenderInner {
            tx: Some(tx),
            wake: wake.clone(),
        }),
    };
    Ok((
        sender,
        MailboxReceiver {
            rx,
            wake,
            wake_rx: rd,
            park_failed: false,
            spin: std::time::Duration::ZERO,
        },
    ))
}

impl<T: Send> MailboxReceiver<T> {
    /// Take one message if one is queued. `Err(Disconnected)` once every sender
    /// is dropped and the queue is empty.
    pub fn try_recv(&mut self) -> Result<T, TryRecvError> {
        self.rx.try_recv()
    }

    /// For a consumer that polls [`try_recv`](Self::try_recv) on its own
    /// schedule instead of awaiting [`recv`](Self::recv) (a test playing a
    /// shard): says it is parked, as `recv` does before it waits. Call it once
    /// `try_recv` found the queue empty; a sender then signals its next
    /// message's wake-up (counted in [`MailboxSender::wakeups`]), which
    /// [`unpark_polled`](Self::unpark_polled) takes.
    pub fn park_polled(&self) {
        self.wake.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Ends a [`park_polled`](Self::park_polled): no longer parked, and the
    /// wake channel drained. Returns whether a sender signalled a wake-up.
    pub fn unpark_polled(&self) -> bool {
        self.wake.sleeping.store(false, Ordering::SeqCst);
        drain_fd(self.wake_rx.as_raw_fd())
    }

    /// Wait for the next message; None once every sender is dropped and the
    /// queue is empty. Must run inside a glommio executor.
    pub async fn recv(&mut self) -> Option<T> {
        self.recv_inner(None).await
    }

    /// A [`Parker`] for this mailbox, bound to the calling executor: a shard that
    /// parks often keeps one instead of opening a stream per park.
    pub fn parker(&self) -> io::Result<Parker> {
        // SAFETY: dup has no memory-safety preconditions.
        let dup = unsafe { libc::fcntl(self.wake_rx.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `dup` is a fresh fd that the stream now owns and closes.
        Ok(Parker {
            stream: unsafe { glommio::net::UnixStream::from_raw_fd(dup) },
        })
    }

    /// [`MailboxReceiver::recv`] parking on `parker`.
    pub async fn recv_with(&mut self, parker: &mut Parker) -> Option<T> {
        self.recv_inner(Some(parker)).await
    }

    /// Poll an empty queue for `spin` before parking, yielding to the
    /// executor's other tasks every few checks. A message that arrives
    /// meanwhile is taken without the park's wake-up: no syscall on either
    /// side and no sleep. Worth it only on a core the executor has to itself.
    pub fn set_spin(&mut self, spin: std::time::Duration) {
        self.spin = spin;
    }

    /// Polls the queue until `spin` has passed; `None` if nothing came.
    async fn spin_for_message(&mut self) -> Option<Option<T>> {
        let until = std::time::Instant::now() + self.spin;
        let mut checks = 0u32;
        loop {
            match self.rx.try_recv() {
                Ok(m) => return Some(Some(m)),
                Err(TryRecvError::Disconnected) => return Some(None),
                Err(TryRecvError::Empty) => {}
            }
            checks = checks.wrapping_add(1);
            if checks % 64 == 0 {
                if std::time::Instant::now() >= until {
                    return None;
                }
                // The ticker, L2 and copy tasks keep running while this spins.
                futures_lite::future::yield_now().await;
            } else {
                std::hint::spin_loop();
            }
        }
    }

    async fn recv_inner(&mut self, mut parker: Option<&mut Parker>) -> Option<T> {
        loop {
            match self.rx.try_recv() {
                Ok(m) => return Some(m),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {}
            }
            if !self.spin.is_zero() {
                if let Some(got) = self.spin_for_message().await {
                    return got;
                }
            }
            // Publish "sleeping", then look again: a sender that pushed before
            // seeing the flag is caught by this second look.
            self.wake.sleeping.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            match self.rx.try_recv() {
                Ok(m) => {
                    self.wake.sleeping.store(false, Ordering::SeqCst);
                    return Some(m);
                }
                Err(TryRecvError::Disconnected) => {
                    self.wake.sleeping.store(false, Ordering::SeqCst);
                    return None;
                }
                Err(TryRecvError::Empty) => {}
            }
            let parked = match parker.as_deref_mut() {
                Some(p) => p.park(self.wake_rx.as_raw_fd()).await,
                None => self.park().await,
            };
            // A stale wake byte may end a park without any sender clearing the
            // flag; we are awake either way.
            self.wake.sleeping.store(false, Ordering::SeqCst);
            if let Err(e) = parked {
                // Cannot wait on the fd (e.g. out of fds): poll every
                // millisecond so messages still flow, and say so once.
                if !self.park_failed {
                    log::error!("shard mailbox wake-up wait failed, polling every 1 ms: {e}");
                    self.park_failed = true;
                }
                glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
    }

    /// Wait until the wake fd is readable, then clear every pending wake byte.
    async fn park(&self) -> io::Result<()> {
        // glommio streams are !Send and would make this receiver !Send; a
        // short-lived parker over a dup of the fd keeps it movable. This costs
        // a dup/close per park, never per message.
        self.parker()?.park(self.wake_rx.as_raw_fd()).await
    }
}

// ---------------------------------------------------------------------------
// shards -> transport thread

/// Producer side of the notify queue; clone it into every shard.
pub struct NotifySender<T> {
    tx: mpsc::Sender<T>,
    wake: Arc<Wake>,
}

impl<T> Clone for NotifySender<T> {
    fn clone(&self) -> Self {
        NotifySender {
            tx: self.tx.clone(),
            wake: self.wake.clone(),
        }
    }
}

impl<T> std::fmt::Debug for NotifySender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifySender").finish_non_exhaustive()
    }
}

impl<T: Send> NotifySender<T> {
    /// Queue `item` and make the receiver's fd readable if it may be waiting.
    /// Never blocks. The queue is unbounded on purpose: every item answers a
    /// request that was admitted through a bounded mailbox, so the number in
    /// flight is bounded by the sum of mailbox capacities. Returns false when
    /// the receiver is gone (the item is dropped).
    pub fn send(&self, item: T) -> bool {
        if self.tx.send(item).is_err() {
            return false;
        }
        self.wake.notify();
        true
    }
}

/// Consumer side of the notify queue, owned by the transport thread.
pub struct NotifyReceiver<T> {
    rx: Receiver<T>,
    wake: Arc<Wake>,
}

impl<T> std::fmt::Debug for NotifyReceiver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifyReceiver")
            .field("fd", &self.wake.fd)
            .finish_non_exhaustive()
    }
}

/// An unbounded MPSC queue whose receiver exposes a pollable fd.
///
/// # Panics
/// If the eventfd cannot be created (fd exhaustion at start-up).
pub fn notify_queue<T: Send>() -> (NotifySender<T>, NotifyReceiver<T>) {
    try_notify_queue().unwrap_or_else(|e| panic!("cannot create the notify queue: {e}"))
}

/// Like [`notify_queue`] but reports an eventfd failure instead of panicking.
pub fn try_notify_queue<T: Send>() -> io::Result<(NotifySender<T>, NotifyReceiver<T>)> {
    // SAFETY: eventfd has no memory-safety preconditions.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let wake = Arc::new(Wake {
        // Nothing drained yet: the consumer counts as waiting.
        sleeping: AtomicBool::new(true),
        fd,
        receiver_gone: AtomicBool::new(false),
        eventfd: true,
        signals: AtomicU64::new(0),
    });
    let (tx, rx) = mpsc::channel();
    Ok((
        NotifySender {
            tx,
            wake: wake.clone(),
        },
        NotifyReceiver { rx, wake },
    ))
}

impl<T: Send> NotifyReceiver<T> {
    /// An fd that stays readable (level-triggered) while items may be pending,
    /// for `zmq::PollItem::from_fd(fd, POLLIN)`. It can be readable with no
    /// item left (a harmless spurious wake); `drain` clears it.
    pub fn fd(&self) -> RawFd {
        self.wake.fd.as_raw_fd()
    }

    /// Move every pending item into `out` while the consumer is busy polling:
    /// producers skip the wake-up signal until the next [`NotifyReceiver::drain`],
    /// which the consumer must call before it sleeps on [`NotifyReceiver::fd`].
    pub fn take_awake(&mut self, out: &mut Vec<T>) -> usize {
        self.wake.sleeping.store(false, Ordering::SeqCst);
        let before = out.len();
        while let Ok(item) = self.rx.try_recv() {
            out.push(item);
        }
        out.len() - before
    }

    /// Clear the wake state, then move every pending item into `out` (in send
    /// order per sender). Returns how many were moved.
    pub fn drain(&mut self, out: &mut Vec<T>) -> usize {
        drain_fd(self.wake.fd.as_raw_fd());
        self.wake.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let before = out.len();
        while let Ok(item) = self.rx.try_recv() {
            out.push(item);
        }
        out.len() - before
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn only_a_parked_consumer_is_signalled_and_counted() {
        let (tx, mut rx) = mailbox::<u32>(8);
        tx.try_send(1).unwrap();
        assert_eq!(
            tx.wakeups(),
            0,
            "a consumer that is not parked needs no wake-up"
        );
        assert!(!rx.unpark_polled());
        assert_eq!(rx.try_recv(), Ok(1));
        rx.park_polled();
        tx.try_send_unwoken(2).unwrap();
        assert_eq!(tx.wakeups(), 0, "an unwoken send signals nothing");
        tx.try_send(3).unwrap();
        tx.try_send(4).unwrap();
        // The first send clears the flag: one signal for both.
        assert_eq!(tx.wakeups(), 1);
        assert!(rx.unpark_polled());
        assert!(!rx.unpark_polled(), "the wake channel was drained");
        assert_eq!((rx.try_recv(), rx.try_recv()), (Ok(2), Ok(3)));
        rx.park_polled();
        tx.clone().wake();
        assert_eq!(tx.wakeups(), 2, "every sender's wake-ups count");
        assert!(rx.unpark_polled());
    }

    fn fd_readable(fd: RawFd, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        rc == 1 && p.revents & libc::POLLIN != 0
    }

    /// Runs `f` on a shard and waits for it, failing (not hanging) after 20 s.
    fn run_shard<F, Fut>(f: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let shard = crate::executor::spawn_shard(0, None, "kvs-mbox-test".into(), move || {
            let fut = f();
            async move {
                fut.await;
                let _ = done_tx.send(());
            }
        })
        .unwrap();
        let finished = done_rx.recv_timeout(Duration::from_secs(20));
        if finished.is_err() {
            // Either it panicked (join reports it) or it hangs (fail here).
            assert!(shard.is_finished(), "shard future did not finish in 20 s");
        }
        shard.join().unwrap();
    }

    #[test]
    fn full_mailbox_refuses_and_returns_the_message() {
        let (tx, mut rx) = mailbox::<u32>(2);
        assert_eq!(tx.try_send(1), Ok(()));
        assert_eq!(tx.try_send(2), Ok(()));
        assert_eq!(tx.try_send(3), Err(SendError::Full(3)));
        assert_eq!(rx.try_recv(), Ok(1));
        assert_eq!(tx.try_send(4), Ok(()));
        assert_eq!(rx.try_recv(), Ok(2));
        assert_eq!(rx.try_recv(), Ok(4));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed(), "receiver gone");
        assert_eq!(tx.try_send(5), Err(SendError::Closed(5)), "receiver gone");
    }

    #[test]
    fn closed_is_told_apart_from_full_even_with_a_full_queue() {
        let (tx, rx) = mailbox::<u32>(1);
        assert_eq!(tx.try_send(1), Ok(()));
        assert_eq!(tx.try_send(2), Err(SendError::Full(2)));
        let tx2 = tx.clone();
        // The consumer's thread ends with a message still queued.
        std::thread::spawn(move || drop(rx)).join().unwrap();
        assert!(tx.is_closed() && tx2.is_closed());
        assert_eq!(tx2.try_send(3), Err(SendError::Closed(3)));
        assert_eq!(SendError::Full(7).into_inner(), 7);
    }

    #[test]
    fn many_senders_all_items_in_order_none_lost() {
        const SENDERS: u64 = 4;
        const PER: u64 = 20_000;
        let (tx, rx) = mailbox::<(u64, u64)>(64);
        let mut producers = Vec::new();
        for s in 0..SENDERS {
            let tx = tx.clone();
            producers.push(std::thread::spawn(move || {
                let mut full = 0u64;
                for i in 0..PER {
                    let mut m = (s, i);
                    loop {
                        match tx.try_send(m) {
                            Ok(()) => break,
                            Err(back) => {
                                full += 1;
                                m = back.into_inner();
                                std::thread::yield_now();
                            }
                        }
                    }
                }
                full
            }));
        }
        drop(tx);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        run_shard(move || async move {
            let mut rx = rx;
            let mut next = vec![0u64; SENDERS as usize];
            let mut total = 0u64;
            while let Some((s, i)) = rx.recv().await {
                assert_eq!(i, next[s as usize], "per-sender order");
                next[s as usize] += 1;
                total += 1;
            }
            done_tx.send((total, next)).unwrap();
        });
        for p in producers {
            p.join().unwrap();
        }
        let (total, next) = done_rx.recv().unwrap();
        assert_eq!(total, SENDERS * PER);
        assert!(next.iter().all(|n| *n == PER));
    }

    #[test]
    fn parked_shard_wakes_promptly_and_sees_disconnect() {
        let (tx, rx) = mailbox::<Instant>(8);
        let (lat_tx, lat_rx) = std::sync::mpsc::channel();
        let shard =
            crate::executor::spawn_shard(0, None, "kvs-mbox-wake".into(), move || async move {
                let mut rx = rx;
                while let Some(sent) = rx.recv().await {
                    lat_tx.send(sent.elapsed()).unwrap();
                }
                lat_tx.send(Duration::MAX).unwrap();
            })
            .unwrap();
        for _ in 0..5 {
            // Give the shard time to park so each send must wake it.
            std::thread::sleep(Duration::from_millis(20));
            tx.try_send(Instant::now()).unwrap();
            let lat = lat_rx.recv_timeout(Duration::from_secs(5)).expect("woken");
            assert!(lat < Duration::from_millis(500), "wake-up took {lat:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
        drop(tx);
        let end = lat_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("recv returned");
        assert_eq!(
            end,
            Duration::MAX,
            "recv must return None after senders drop"
        );
        shard.join().unwrap();
    }

    #[test]
    fn recv_returns_none_when_senders_dropped_before_start() {
        let (tx, rx) = mailbox::<u8>(4);
        tx.try_send(9).unwrap();
        let tx2 = tx.clone();
        drop(tx);
        drop(tx2);
        run_shard(move || async move {
            let mut rx = rx;
            assert_eq!(rx.recv().await, Some(9));
            assert_eq!(rx.recv().await, None);
        });
    }

    #[test]
    fn notify_queue_fd_is_level_readable_until_drained() {
        let (tx, mut rx) = notify_queue::<u32>();
        let mut out = Vec::new();
        assert!(!fd_readable(rx.fd(), 0));
        assert_eq!(rx.drain(&mut out), 0);
        assert!(tx.send(1));
        assert!(tx.send(2));
        assert!(fd_readable(rx.fd(), 0));
        assert!(fd_readable(rx.fd(), 0), "still readable: level-triggered");
        assert_eq!(rx.drain(&mut out), 2);
        assert_eq!(out, vec![1, 2]);
        assert!(!fd_readable(rx.fd(), 0));
        assert!(tx.send(3));
        assert!(fd_readable(rx.fd(), 0), "readable again after a drain");
        out.clear();
        rx.drain(&mut out);
        assert_eq!(out, vec![3]);
        drop(rx);
        assert!(!tx.send(4), "receiver gone");
    }

    #[test]
    fn notify_queue_many_threads_no_lost_wakeups() {
        const SENDERS: u64 = 4;
        const PER: u64 = 20_000;
        let (tx, mut rx) = notify_queue::<(u64, u64)>();
        let mut producers = Vec::new();
        for s in 0..SENDERS {
            let tx = tx.clone();
            producers.push(std::thread::spawn(move || {
                for i in 0..PER {
                    assert!(tx.send((s, i)));
                    if i % 1000 == 0 {
                        std::thread::yield_now();
                    }
                }
            }));
        }
        drop(tx);
        let mut next = vec![0u64; SENDERS as usize];
        let mut total = 0u64;
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while total < SENDERS * PER {
            assert!(Instant::now() < deadline, "lost wake-up: {total} items");
            // Only drain when the fd says so: a lost wake-up hangs here.
            if !fd_readable(rx.fd(), 1000) {
                continue;
            }
            out.clear();
            rx.drain(&mut out);
            for &(s, i) in &out {
                assert_eq!(i, next[s as usize], "per-sender order");
                next[s as usize] += 1;
                total += 1;
            }
        }
        for p in producers {
            p.join().unwrap();
        }
        assert!(next.iter().all(|n| *n == PER));
    }

    #[test]
    fn notify_from_glommio_shard_reaches_std_thread() {
        let (tx, mut rx) = notify_queue::<usize>();
        let shard =
            crate::executor::spawn_shard(0, None, "kvs-notify".into(), move || async move {
                for i in 0..100 {
                    tx.send(i);
                    if i % 10 == 0 {
                        glommio::timer::sleep(Duration::from_millis(1)).await;
                    }
                }
            })
            .unwrap();
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.len() < 100 {
            assert!(Instant::now() < deadline);
            if fd_readable(rx.fd(), 1000) {
                rx.drain(&mut out);
            }
        }
        assert_eq!(out, (0..100).collect::<Vec<_>>());
        shard.join().unwrap();
    }
}
