//! Caller memory the client sends from and receives into, without an
//! intermediate buffer.
//!
//! **PUT** ([`SendRegion`]): the body is a [`Bytes`] made with
//! [`Bytes::from_owner`] over an owner the caller hands over (an L1 lock
//! guard, a `Vec`, an mmap). hyper queues slices of it for the socket (or
//! for rustls, which encrypts from it); multipart uploads send
//! `Bytes::slice`s of it. Nothing is copied in between. The owner is dropped
//! when the last `Bytes` referring to it is dropped, which can be after the
//! operation future is gone: a connection task may still hold a queued
//! slice when the caller drops the future. So the memory stays valid for as
//! long as anything can read it, whatever the caller does with the future;
//! releasing the memory is the owner's `Drop`.
//!
//! **GET** ([`RecvRegion`]): a raw destination (pointer and length). Over
//! HTTP/1.1 a body with a `Content-Length` is read from the socket straight
//! into the destination at its offset (plain TCP: the kernel's copy is the
//! only one; TLS: rustls decrypts into it). Over HTTP/2 hyper hands out body
//! frames and the client copies each into place. Writes happen only while
//! the operation future is being polled; dropping the future stops them,
//! because part downloads are sub-futures of the operation future, never
//! detached tasks.

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::rc::Rc;

use bytes::Bytes;

/// A PUT body in caller memory. Not `Send`: it belongs to the shard that
/// owns the client.
#[derive(Clone)]
pub struct SendRegion {
    bytes: Bytes,
    _local: PhantomData<Rc<()>>,
}

impl fmt::Debug for SendRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SendRegion({} bytes)", self.bytes.len())
    }
}

/// Declares a `!Send` owner sendable; see [`SendRegion::from_local_owner`].
struct LocalOwner<T>(T);

// SAFETY: only constructed by `SendRegion::from_local_owner`, whose caller
// promises the value is used and dropped on the creating thread. `Bytes`
// needs `Send` for its owner only because `Bytes` itself is `Send`.
unsafe impl<T> Send for LocalOwner<T> {}

impl<T: AsRef<[u8]>> AsRef<[u8]> for LocalOwner<T> {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref()
    }
}

impl SendRegion {
    /// The bytes of `owner`, which is dropped once neither the caller nor
    /// any connection holds a reference. `owner.as_ref()` must return the
    /// same bytes every time (an owner whose contents change while a PUT is
    /// in flight uploads a mix).
    pub fn from_owner<T>(owner: T) -> SendRegion
    where
        T: AsRef<[u8]> + Send + 'static,
    {
        SendRegion {
            bytes: Bytes::from_owner(owner),
            _local: PhantomData,
        }
    }

    /// As [`SendRegion::from_owner`] for an owner that is not `Send` (an L1
    /// guard holding `Rc`s).
    ///
    /// # Safety
    /// The region and every clone of its bytes must stay on the creating
    /// thread. The client guarantees that for what it holds: it is `!Send`
    /// and every connection task runs on the same glommio executor. The
    /// caller must not pass [`SendRegion::bytes`] to other threads.
    pub unsafe fn from_local_owner<T>(owner: T) -> SendRegion
    where
        T: AsRef<[u8]> + 'static,
    {
        SendRegion::from_owner(LocalOwner(owner))
    }

    /// An owned buffer.
    pub fn from_vec(data: Vec<u8>) -> SendRegion {
        SendRegion::from_bytes(Bytes::from(data))
    }

    /// Existing `Bytes`.
    pub fn from_bytes(bytes: Bytes) -> SendRegion {
        SendRegion {
            bytes,
            _local: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The body as `Bytes` (shares the owner).
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }
}

/// A GET destination: `len` writable bytes at `ptr`, borrowed for `'a`.
pub struct RecvRegion<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl fmt::Debug for RecvRegion<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecvRegion({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl<'a> RecvRegion<'a> {
    /// A destination over a borrowed buffer.
    pub fn from_mut_slice(buf: &'a mut [u8]) -> RecvRegion<'a> {
        RecvRegion {
            ptr: NonNull::new(buf.as_mut_ptr()).expect("slice pointers are never null"),
            len: buf.len(),
            _borrow: PhantomData,
        }
    }

    /// A destination over raw memory (an L1 slab object).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for writes, and not read or written
    /// by anyone else, for as long as an operation future that received
    /// this region exists (writes stop when it is dropped).
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> RecvRegion<'a> {
        RecvRegion {
            ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
            len,
            _borrow: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A window of `len` bytes at `offset`, for one part.
    pub(crate) fn window(&self, offset: usize, len: usize) -> Window {
        let end = offset.checked_add(len).expect("window end overflows");
        assert!(end <= self.len, "window {offset}+{len} beyond {}", self.len);
        Window {
            // SAFETY: `offset <= end <= self.len`, inside the region.
            ptr: unsafe { self.ptr.as_ptr().add(offset) },
            len,
            filled: 0,
        }
    }
}

/// Part of a [`RecvRegion`] that one response fills from its start.
/// Windows of one operation never overlap.
pub(crate) struct Window {
    ptr: *mut u8,
    len: usize,
    filled: usize,
}

impl Window {
    /// Copies `data` after what is already filled; false (and nothing
    /// written) when it does not fit.
    pub fn push(&mut self, data: &[u8]) -> bool {
        if data.len() > self.len - self.filled {
            return false;
        }
        // SAFETY: the window lies inside a RecvRegion whose contract makes
        // it writable and exclusively ours while the operation runs, and
        // `filled + data.len() <= len` keeps the copy inside the window.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(self.filled), data.len());
        }
        self.filled += data.len();
        true
    }

    /// The bytes not filled yet, for a reader that writes into them
    /// directly; follow with [`Window::advance`].
    pub fn unfilled_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `push`: the window is writable and exclusively ours
        // while the operation runs; the slice stays inside it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(self.filled), self.len - self.filled) }
    }

    /// Marks `n` more bytes as filled (written through `unfilled_mut`).
    pub fn advance(&mut self, n: usize) {
        assert!(n <= self.len - self.filled, "advance past the window");
        self.filled += n;
    }

    /// Bytes written so far.
    pub fn filled(&self) -> usize {
        self.filled
    }

    /// Window length.
    pub fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    struct Tracked(Vec<u8>, Arc<AtomicBool>);

    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn owner_lives_until_the_last_slice_is_dropped() {
        let dropped = Arc::new(AtomicBool::new(false));
        let region = SendRegion::from_owner(Tracked(vec![7; 100], dropped.clone()));
        let slice = region.bytes().slice(10..20);
        drop(region);
        assert!(!dropped.load(Ordering::SeqCst));
        assert_eq!(&slice[..], &[7; 10]);
        drop(slice);
        assert!(dropped.load(Ordering::SeqCst));
    }

    #[test]
    fn windows_write_only_inside_their_range() {
        let mut buf = vec![0u8; 10];
        let region = RecvRegion::from_mut_slice(&mut buf);
        let mut w = region.window(3, 4);
        assert!(w.push(&[1, 2]));
        assert!(w.push(&[3, 4]));
        assert!(!w.push(&[5]), "full");
        assert_eq!(w.filled(), 4);
        // A retried part writes a fresh window over the same bytes.
        let mut again = region.window(3, 4);
        assert!(again.push(&[9]));
        assert_eq!(buf, [0, 0, 0, 9, 2, 3, 4, 0, 0, 0]);
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn window_past_the_end_panics() {
        let mut buf = vec![0u8; 4];
        let region = RecvRegion::from_mut_slice(&mut buf);
        let _ = region.window(2, 3);
    }
}
