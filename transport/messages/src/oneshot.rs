//! A one-value channel between threads whose receiver is a future.
//!
//! The front end answers HTTP control requests through it: the HTTP executor awaits
//! the receiver while the front thread (a plain thread) completes the sender.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
    sender_gone: bool,
}

pub struct Sender<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

pub struct Receiver<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let slot = Arc::new(Mutex::new(Slot {
        value: None,
        waker: None,
        sender_gone: false,
    }));
    (Sender { slot: slot.clone() }, Receiver { slot })
}

impl<T> Sender<T> {
    pub fn send(self, value: T) {
        let waker = {
            let mut s = self.slot.lock().unwrap_or_else(|e| e.into_inner());
            s.value = Some(value);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        // Drop runs next and marks the sender gone; the value is already in place.
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut s = self.slot.lock().unwrap_or_else(|e| e.into_inner());
            s.sender_gone = true;
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// Resolves to `None` when the sender was dropped without a value.
impl<T> Future for Receiver<T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut s = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = s.value.take() {
            return Poll::Ready(Some(v));
        }
        if s.sender_gone {
            return Poll::Ready(None);
        }
        s.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_crosses_threads() {
        let (tx, rx) = channel();
        std::thread::spawn(move || tx.send(7u32));
        assert_eq!(futures_lite::future::block_on(rx), Some(7));
    }

    #[test]
    fn dropped_sender_resolves_none() {
        let (tx, rx) = channel::<u32>();
        drop(tx);
        assert_eq!(futures_lite::future::block_on(rx), None);
    }
}
