//! The GDS L1 slab file on a real disk (the build's target directory, checked
//! not to be tmpfs) and on tmpfs (/dev/shm, where there is one).

// The same data the storage benchmarks write.
#[path = "../../benches/common/pattern.rs"]
mod pattern;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use kvshard_gds::slab::{
    AlignedBuf, FsType, GdsSlab, Misalignment, SlabError, SlabOp, SlabOptions,
    MAX_SUBMISSION_BYTES, SLAB_ALIGN,
};

const MIB: usize = 1 << 20;
const DIRECT: SlabOptions = SlabOptions { direct_io: true };
const BUFFERED: SlabOptions = SlabOptions { direct_io: false };

/// A fresh directory, removed when dropped.
struct TestDir(PathBuf);

impl TestDir {
    /// Under the build's temporary directory, which must be on a disk.
    fn disk(name: &str) -> TestDir {
        let parent = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let fs_type = FsType::of(parent).unwrap();
        assert!(
            !fs_type.is_memory(),
            "{} is on {fs_type}: the slab tests need a disk-backed target directory",
            parent.display()
        );
        TestDir::make(parent.join(format!("gds-slab-{}-{name}", std::process::id())))
    }

    /// On tmpfs, or None (with the reason printed) when there is none.
    fn tmpfs(name: &str) -> Option<TestDir> {
        let shm = Path::new("/dev/shm");
        match FsType::of(shm) {
            Ok(t) if t.magic == FsType::TMPFS => Some(TestDir::make(
                shm.join(format!("kvshard-gds-slab-{}-{name}", std::process::id())),
            )),
            Ok(t) => {
                println!("skipped: /dev/shm is {t}, not tmpfs");
                None
            }
            Err(e) => {
                println!("skipped: no /dev/shm ({e})");
                None
            }
        }
    }

    fn make(d: PathBuf) -> TestDir {
        let _ = fs::remove_dir_all(&d);
        // Not created here: GdsSlab::create makes it (mkdir -p).
        TestDir(d)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Bytes that differ per seed and per position (also across 4 KiB pages, so
/// a page landing at the wrong offset is caught).
fn filled(len: usize, seed: u64) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len);
    pattern::fill(&mut b, seed);
    b
}

/// The file's bytes at `offset`, read without the slab.
fn file_bytes(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut v, offset)
        .unwrap();
    v
}

#[test]
fn slab_round_trip_of_objects_at_several_offsets() {
    let d = TestDir::disk("round-trip");
    let mut slab = GdsSlab::create(&d.0, 0, 96 * MIB as u64, DIRECT).unwrap();
    assert!(slab.direct_io());
    assert!(slab.uses_io_uring(), "{}", slab.describe());
    assert_eq!(slab.path(), d.0.join("lmcache_gds_slab.0.bin"));
    // (offset, length): one page, a small object, one crossing a 16 MiB
    // submission boundary, a 40 MiB one over three submissions that ends at
    // the slab's last byte.
    let layout: [(u64, usize); 4] = [
        (0, SLAB_ALIGN),
        (8192, 64 << 10),
        (12 * MIB as u64, 8 * MIB),
        (56 * MIB as u64, 40 * MIB),
    ];
    let objs: Vec<AlignedBuf> = layout
        .iter()
        .enumerate()
        .map(|(i, &(_, len))| filled(len, 100 + i as u64))
        .collect();
    // The first two one by one, the others in one batch.
    slab.write_at(layout[0].0, &objs[0]).unwrap();
    slab.write_at(layout[1].0, &objs[1]).unwrap();
    slab.write_many(&[(layout[2].0, &objs[2][..]), (layout[3].0, &objs[3][..])])
        .unwrap();
    let c = slab.counters();
    let total: usize = layout.iter().map(|(_, l)| l).sum();
    assert_eq!(c.bytes_written, total as u64);
    // 1 + 1 + 1 + 3 pieces of at most 16 MiB.
    assert!(c.submissions >= 6, "{c:?}");
    assert_eq!(c.errors, 0);

    // Each object is the raw bytes at its offset in the file.
    for (&(off, len), obj) in layout.iter().zip(&objs) {
        assert!(
            file_bytes(slab.path(), off, len) == obj[..],
            "object at {off} in the file"
        );
    }

    // Back through the slab: one by one, then all in one batch.
    for (&(off, len), obj) in layout.iter().zip(&objs) {
        let mut back = AlignedBuf::zeroed(len);
        slab.read_at(off, &mut back).unwrap();
        assert!(back[..] == obj[..], "object at {off} read back");
    }
    let mut backs: Vec<AlignedBuf> = layout
        .iter()
        .map(|&(_, len)| AlignedBuf::zeroed(len))
        .collect();
    let mut ops: Vec<(u64, &mut [u8])> = layout
        .iter()
        .zip(backs.iter_mut())
        .map(|(&(off, _), b)| (off, &mut b[..]))
        .collect();
    slab.read_many(&mut ops).unwrap();
    for ((&(off, _), obj), back) in layout.iter().zip(&objs).zip(&backs) {
        assert!(back[..] == obj[..], "object at {off} read back in a batch");
    }
    assert_eq!(slab.counters().bytes_read, 2 * total as u64);

    // Bytes between objects were never written: still the preallocated zeros.
    let mut gap = AlignedBuf::zeroed(SLAB_ALIGN);
    gap.fill(0xff);
    slab.read_at(4096, &mut gap).unwrap();
    assert!(gap.iter().all(|&b| b == 0));

    // Overwriting in place keeps the neighbours.
    let newer = filled(64 << 10, 999);
    slab.write_at(8192, &newer).unwrap();
    let mut back = AlignedBuf::zeroed(64 << 10);
    slab.read_at(8192, &mut back).unwrap();
    assert!(back[..] == newer[..]);
    let mut first = AlignedBuf::zeroed(SLAB_ALIGN);
    slab.read_at(0, &mut first).unwrap();
    assert!(first[..] == objs[0][..]);
}

#[test]
fn slab_a_transfer_spans_several_bounded_submissions() {
    let d = TestDir::disk("bounded");
    let mut slab = GdsSlab::create(&d.0, 1, 40 * MIB as u64, DIRECT).unwrap();
    let obj = filled(40 * MIB, 7);
    slab.write_at(0, &obj).unwrap();
    let writes = slab.counters().submissions;
    assert!(
        writes >= (40 * MIB).div_ceil(MAX_SUBMISSION_BYTES) as u64,
        "40 MiB went out in {writes} submissions"
    );
    let mut back = AlignedBuf::zeroed(40 * MIB);
    slab.read_at(0, &mut back).unwrap();
    assert!(back[..] == obj[..]);
    assert!(slab.counters().submissions - writes >= 3);
}

#[test]
fn slab_restart_truncates_and_resizes() {
    let d = TestDir::disk("restart");
    let path = d.0.join(GdsSlab::file_name(2));
    {
        let mut slab = GdsSlab::create(&d.0, 2, 2 * MIB as u64, DIRECT).unwrap();
        slab.write_at(MIB as u64, &filled(MIB, 5)).unwrap();
        assert!(file_bytes(&path, MIB as u64, 16).iter().any(|&b| b != 0));
    }
    // Drop closed it and left the file.
    assert_eq!(fs::metadata(&path).unwrap().len(), 2 * MIB as u64);

    // Next start, a different (unaligned) size: rounded up, old data gone.
    let mut slab = GdsSlab::create(&d.0, 2, 3 * MIB as u64 + 1, DIRECT).unwrap();
    assert_eq!(slab.size_bytes(), 3 * MIB as u64 + SLAB_ALIGN as u64);
    assert_eq!(fs::metadata(&path).unwrap().len(), slab.size_bytes());
    let mut back = AlignedBuf::zeroed(2 * MIB);
    back.fill(0xee);
    slab.read_at(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "data of the earlier start survived"
    );
    assert!(file_bytes(&path, 0, 2 * MIB).iter().all(|&b| b == 0));

    // A smaller slab at the next start shrinks the file.
    drop(slab);
    let slab = GdsSlab::create(&d.0, 2, 8192, DIRECT).unwrap();
    assert_eq!(fs::metadata(&path).unwrap().len(), 8192);
    assert_eq!(slab.size_bytes(), 8192);
}

#[test]
fn slab_misaligned_offset_length_and_buffer_are_refused() {
    let d = TestDir::disk("misaligned");
    let mut slab = GdsSlab::create(&d.0, 0, MIB as u64, DIRECT).unwrap();
    let good = filled(2 * SLAB_ALIGN, 3);
    slab.write_at(0, &good).unwrap();
    let before = slab.counters();

    let check = |e: SlabError, op: SlabOp, what: Misalignment, value: u64, words: &str| {
        let text = e.to_string();
        match e {
            SlabError::Misaligned {
                op: o,
                what: w,
                value: v,
            } => {
                assert_eq!((o, w, v), (op, what, value), "{text}");
            }
            other => panic!("expected Misaligned, got {other}"),
        }
        assert!(
            text.contains(words) && text.contains("not a multiple of 4096"),
            "{text}"
        );
    };

    // Offset.
    let e = slab.write_at(100, &good[..SLAB_ALIGN]).unwrap_err();
    check(e, SlabOp::Write, Misalignment::Offset, 100, "slab offset");
    let mut back = AlignedBuf::zeroed(SLAB_ALIGN);
    let e = slab.read_at(512, &mut back).unwrap_err();
    check(e, SlabOp::Read, Misalignment::Offset, 512, "slab offset");
    // Length.
    let e = slab.write_at(0, &good[..SLAB_ALIGN + 512]).unwrap_err();
    check(e, SlabOp::Write, Misalignment::Length, 4608, "length");
    let e = slab.read_at(0, &mut back[..100]).unwrap_err();
    check(e, SlabOp::Read, Misalignment::Length, 100, "length");
    // Buffer address (the length is fine).
    let addr = good[1..].as_ptr() as u64;
    let e = slab.write_at(0, &good[1..SLAB_ALIGN + 1]).unwrap_err();
    check(
        e,
        SlabOp::Write,
        Misalignment::BufferAddress,
        addr,
        "buffer address",
    );
    let mut big = AlignedBuf::zeroed(2 * SLAB_ALIGN);
    let addr = big[512..].as_ptr() as u64;
    let e = slab
        .read_at(0, &mut big[512..512 + SLAB_ALIGN])
        .unwrap_err();
    check(
        e,
        SlabOp::Read,
        Misalignment::BufferAddress,
        addr,
        "buffer address",
    );

    // One bad entry refuses the whole batch before anything is written.
    let other = filled(SLAB_ALIGN, 77);
    let e = slab
        .write_many(&[(8192, &other[..]), (12288 + 4, &other[..])])
        .unwrap_err();
    assert!(matches!(e, SlabError::Misaligned { .. }), "{e}");
    assert_eq!(slab.counters(), before, "a refused call reached the kernel");
    assert!(file_bytes(slab.path(), 8192, SLAB_ALIGN)
        .iter()
        .all(|&b| b == 0));
    assert!(file_bytes(slab.path(), 0, 2 * SLAB_ALIGN) == good[..]);
}

#[test]
fn slab_ranges_past_the_end_are_refused() {
    let d = TestDir::disk("past-end");
    let mut slab = GdsSlab::create(&d.0, 0, MIB as u64, DIRECT).unwrap();
    let size = slab.size_bytes();
    let buf = filled(2 * SLAB_ALIGN, 1);
    // Ends exactly at the end: fine.
    slab.write_at(size - 2 * SLAB_ALIGN as u64, &buf).unwrap();
    let before = slab.counters();
    for (off, len) in [
        (size, SLAB_ALIGN),
        (size - SLAB_ALIGN as u64, 2 * SLAB_ALIGN),
        (u64::MAX - (SLAB_ALIGN as u64 - 1), SLAB_ALIGN),
    ] {
        let e = slab.write_at(off, &buf[..len]).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, SlabError::OutOfRange { op: SlabOp::Write, offset, len: l, slab_bytes }
                if offset == off && l == len as u64 && slab_bytes == size),
            "{text}"
        );
        assert!(text.contains("past the slab end"), "{text}");
        let mut back = AlignedBuf::zeroed(len);
        let e = slab.read_at(off, &mut back).unwrap_err();
        assert!(
            matches!(
                e,
                SlabError::OutOfRange {
                    op: SlabOp::Read,
                    ..
                }
            ),
            "{e}"
        );
    }
    // In a batch, a valid range before the bad one is not written either.
    let other = filled(SLAB_ALIGN, 2);
    let e = slab
        .write_many(&[(0, &other[..]), (size, &other[..])])
        .unwrap_err();
    assert!(matches!(e, SlabError::OutOfRange { .. }), "{e}");
    assert_eq!(slab.counters(), before);
    assert!(file_bytes(slab.path(), 0, SLAB_ALIGN)
        .iter()
        .all(|&b| b == 0));
    assert_eq!(fs::metadata(slab.path()).unwrap().len(), size);
}

#[test]
fn slab_smaller_than_a_page_is_refused() {
    let d = TestDir::disk("too-small");
    for size in [0u64, 1, 4095] {
        let e = GdsSlab::create(&d.0, 0, size, DIRECT).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, SlabError::TooSmall { size_bytes } if size_bytes == size),
            "{text}"
        );
        assert!(text.contains("at least one 4096-byte page"), "{text}");
    }
    assert!(!d.0.join(GdsSlab::file_name(0)).exists());
    // One page is the smallest slab.
    let mut slab = GdsSlab::create(&d.0, 0, 4096, DIRECT).unwrap();
    slab.write_at(0, &filled(SLAB_ALIGN, 4)).unwrap();
}

#[test]
fn slab_shards_get_their_own_files() {
    let d = TestDir::disk("shards");
    let mut a = GdsSlab::create(&d.0, 0, MIB as u64, DIRECT).unwrap();
    let mut b = GdsSlab::create(&d.0, 1, MIB as u64, DIRECT).unwrap();
    assert_ne!(a.path(), b.path());
    a.write_at(0, &filled(SLAB_ALIGN, 10)).unwrap();
    b.write_at(0, &filled(SLAB_ALIGN, 11)).unwrap();
    let mut back = AlignedBuf::zeroed(SLAB_ALIGN);
    a.read_at(0, &mut back).unwrap();
    assert!(back[..] == filled(SLAB_ALIGN, 10)[..]);
    let text = b.describe();
    assert!(
        text.contains("shard 1")
            && text.contains("lmcache_gds_slab.1.bin")
            && text.contains("size_bytes=1048576")
            && text.contains("direct_io=true")
            && text.contains("io_uring"),
        "{text}"
    );
    // Each slab moves to the thread that drives it.
    std::thread::spawn(move || {
        let mut back = AlignedBuf::zeroed(SLAB_ALIGN);
        b.read_at(0, &mut back).unwrap();
        assert!(back[..] == filled(SLAB_ALIGN, 11)[..]);
    })
    .join()
    .unwrap();
}

#[test]
fn slab_without_direct_io_works_on_tmpfs() {
    let Some(d) = TestDir::tmpfs("buffered") else {
        return;
    };
    let mut slab = GdsSlab::create(&d.0, 0, 20 * MIB as u64, BUFFERED).unwrap();
    assert!(!slab.direct_io());
    assert!(slab.filesystem().is_memory());
    assert!(slab.describe().contains("tmpfs"), "{}", slab.describe());
    let obj = filled(18 * MIB, 21);
    slab.write_at(2 * MIB as u64, &obj).unwrap();
    let mut back = AlignedBuf::zeroed(18 * MIB);
    slab.read_at(2 * MIB as u64, &mut back).unwrap();
    assert!(back[..] == obj[..]);
    // The alignment contract does not depend on the option.
    let e = slab.write_at(100, &obj[..SLAB_ALIGN]).unwrap_err();
    assert!(matches!(e, SlabError::Misaligned { .. }), "{e}");
}

#[test]
fn slab_direct_io_on_tmpfs_is_refused_clearly() {
    let Some(d) = TestDir::tmpfs("direct") else {
        return;
    };
    let e = GdsSlab::create(&d.0, 0, MIB as u64, DIRECT).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(&e, SlabError::DirectIoRefused { filesystem, .. } if filesystem.magic == FsType::TMPFS),
        "{text}"
    );
    assert!(
        text.contains("tmpfs")
            && text.contains("direct I/O")
            && text.contains("--no-gds-l1-use-direct-io"),
        "{text}"
    );
    // Refused before the file was made.
    assert!(!d.0.join(GdsSlab::file_name(0)).exists());
}
