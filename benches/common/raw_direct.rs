//! The raw O_DIRECT baseline the storage benchmarks measure against: plain
//! io_uring reads or writes, one request per buffer (continued when short),
//! `depth` in flight, no framing or bookkeeping of any kind.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

/// One transfer: the file, its offset and the buffer (4 KiB-aligned for
/// O_DIRECT).
pub struct RawOp<'a> {
    pub fd: RawFd,
    pub offset: u64,
    pub buf: &'a mut [u8],
}

/// Runs every op to completion; panics on an I/O error (a benchmark has no
/// one to report it to).
pub fn raw_direct(ring: &mut IoUring, ops: &mut [RawOp<'_>], write: bool, depth: usize) {
    let mut done = vec![0usize; ops.len()];
    let mut queue: std::collections::VecDeque<usize> = (0..ops.len()).collect();
    let mut in_flight = 0;
    loop {
        while in_flight < depth {
            let Some(i) = queue.pop_front() else { break };
            let op = &mut ops[i];
            let n = (op.buf.len() - done[i]) as u32;
            let at = op.offset + done[i] as u64;
            // SAFETY: the range lies inside op.buf, which outlives the ring
            // work: this function waits for every request it queued.
            let p = unsafe { op.buf.as_mut_ptr().add(done[i]) };
            let fd = types::Fd(op.fd);
            let sqe = if write {
                opcode::Write::new(fd, p, n).offset(at).build()
            } else {
                opcode::Read::new(fd, p, n).offset(at).build()
            }
            .user_data(i as u64);
            // SAFETY: see above.
            unsafe { ring.submission().push(&sqe) }.expect("submission queue has room");
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        ring.submit_and_wait(1).expect("io_uring submit");
        let cqes: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (i, res) in cqes {
            in_flight -= 1;
            assert!(
                res > 0,
                "raw {} of fd {} at {}: {}",
                if write { "write" } else { "read" },
                ops[i].fd,
                ops[i].offset + done[i] as u64,
                io::Error::from_raw_os_error(-res)
            );
            done[i] += res as usize;
            if done[i] < ops[i].buf.len() {
                queue.push_back(i);
            }
        }
    }
}
