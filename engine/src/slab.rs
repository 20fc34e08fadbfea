//! Slab allocator over one shard's slice of the L1 arena.
//!
//! The allocator hands out byte ranges (offsets), never pointers: the shard's
//! owner turns an offset into an address in its arena mapping. Every range is a
//! multiple of `align` long and starts on an `align` boundary, so O_DIRECT and
//! DMA can use a slab as is.
//!
//! Free space is kept twice: by offset (to coalesce neighbours on free) and by
//! (length, offset) (for best fit). Objects of one deployment are mostly one
//! size, so best fit leaves exact holes that the next object of that size
//! fills; several models with other sizes still work, just with more
//! fragmentation. Every operation is O(log n) in the number of free ranges
//! and live slabs.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// One allocated byte range `[offset, offset + len)` of the arena.
///
/// `len` is the aligned length actually reserved, which can be more than the
/// object size asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slab {
    pub offset: u64,
    pub len: u64,
}

impl Slab {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// Whether two slabs share at least one byte.
    pub fn overlaps(&self, other: &Slab) -> bool {
        self.offset < other.end() && other.offset < self.end()
    }
}

/// Best-fit allocator of aligned ranges in `[base, base + capacity)`.
#[derive(Debug)]
pub struct SlabAllocator {
    base: u64,
    capacity: u64,
    align: u64,
    /// Free ranges: offset -> length. Never two adjacent ranges (they are
    /// merged on free), never empty ranges.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same free ranges as (length, offset), for best fit.
    free_by_len: BTreeSet<(u64, u64)>,
    /// Live slabs: offset -> length; lets `free` tell a real slab from a
    /// double free or a made-up range.
    live: HashMap<u64, u64>,
    used: u64,
    /// One past the highest byte ever handed out, relative to `base` (what a
    /// lazily faulted arena must have faulted in).
    high_water: u64,
}

impl SlabAllocator {
    /// Manages `[base, base + capacity)`.
    ///
    /// Panics unless `align` is a power of two and `base` and `capacity` are
    /// multiples of it: these come from start-up configuration, and a
    /// misaligned arena would break every O_DIRECT and DMA transfer later.
    pub fn new(base: u64, capacity: u64, align: u64) -> Self {
        assert!(
            align.is_power_of_two(),
            "slab align {align} is not a power of two"
        );
        assert!(
            base % align == 0,
            "slab base {base} is not aligned to {align}"
        );
        assert!(
            capacity % align == 0,
            "slab capacity {capacity} is not aligned to {align}"
        );
        assert!(
            base.checked_add(capacity).is_some(),
            "slab range overflows u64"
        );
        let mut a = SlabAllocator {
            base,
            capacity: 0,
            align,
            free_by_offset: BTreeMap::new(),
            free_by_len: BTreeSet::new(),
            live: HashMap::new(),
            used: 0,
            high_water: 0,
        };
        a.grow(capacity);
        a
    }

    /// First managed offset.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Alignment of every slab offset and length.
    pub fn align(&self) -> u64 {
        self.align
    }

    /// `len` rounded up to the alignment, or `None` if that overflows.
    pub fn aligned_len(&self, len: u64) -> Option<u64> {
        Some(len.checked_add(self.align - 1)? & !(self.align - 1))
    }

    /// Reserves `len` bytes (rounded up to the alignment), best fit.
    ///
    /// `None` when `len` is 0 or no free range is large enough.
    pub fn alloc(&mut self, len: u64) -> Option<Slab> {
        if len == 0 {
            return None;
        }
        let need = self.aligned_len(len)?;
        let &(free_len, offset) = self.free_by_len.range((need, 0)..).next()?;
        self.remove_free(offset, free_len);
        if free_len > need {
            self.insert_free(offset + need, free_len - need);
        }
        let prev = self.live.insert(offset, need);
        assert!(prev.is_none(), "slab {offset:#x} handed out twice");
        self.used += need;
        assert!(
            self.used <= self.capacity,
            "slab accounting: used exceeds capacity"
        );
        self.high_water = self.high_water.max(offset + need - self.base);
        Some(Slab { offset, len: need })
    }

    /// Returns a slab to the free space, merging it with free neighbours.
    ///
    /// Panics if `slab` is not a live slab of this allocator: a double free or
    /// a foreign range means two owners think they hold the same memory.
    pub fn free(&mut self, slab: Slab) {
        match self.live.remove(&slab.offset) {
            Some(len) if len == slab.len => {}
            Some(len) => {
                panic!("slab free of {slab:?} but the live slab at that offset is {len} bytes long")
            }
            None => panic!("slab free of {slab:?}, which is not allocated (double free?)"),
        }
        self.used -= slab.len;
        let mut offset = slab.offset;
        let mut len = slab.len;
        if let Some((&prev_off, &prev_len)) = self.free_by_offset.range(..offset).next_back() {
            assert!(
                prev_off + prev_len <= offset,
                "free range overlaps a live slab"
            );
            if prev_off + prev_len == offset {
                self.remove_free(prev_off, prev_len);
                offset = prev_off;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.free_by_offset.get(&(offset + len)) {
            self.remove_free(offset + len, next_len);
            len += next_len;
        }
        if let Some((&next_off, _)) = self.free_by_offset.range(offset..).next() {
            assert!(next_off >= offset + len, "free range overlaps a live slab");
        }
        self.insert_free(offset, len);
    }

    /// Extends the managed range to `new_capacity` bytes (lazy growth); the new
    /// tail becomes free and merges with a free range before it. A capacity
    /// not above the current one changes nothing.
    ///
    /// Panics if `new_capacity` is not aligned or overflows the offset space
    /// (a configuration bug, not an input).
    pub fn grow(&mut self, new_capacity: u64) {
        assert!(
            new_capacity % self.align == 0,
            "slab capacity {new_capacity} is not aligned to {}",
            self.align
        );
        assert!(
            self.base.checked_add(new_capacity).is_some(),
            "slab range overflows u64"
        );
        if new_capacity <= self.capacity {
            return;
        }
        let mut offset = self.base + self.capacity;
        let mut len = new_capacity - self.capacity;
        if let Some((&prev_off, &prev_len)) = self.free_by_offset.range(..offset).next_back() {
            if prev_off + prev_len == offset {
                self.remove_free(prev_off, prev_len);
                offset = prev_off;
                len += prev_len;
            }
        }
        self.insert_free(offset, len);
        self.capacity = new_capacity;
    }

    /// One past the highest byte ever handed out, from `base`: never more
    /// than the capacity, never going down.
    pub fn high_water(&self) -> u64 {
        self.high_water
    }

    /// Bytes held by live slabs (aligned lengths).
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Bytes managed now (grows with [`grow`](Self::grow)).
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    /// Bytes not held by any slab, contiguous or not.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.used
    }

    /// Length of the largest free range: the largest object that fits now.
    pub fn largest_free(&self) -> u64 {
        self.free_by_len
            .iter()
            .next_back()
            .map_or(0, |&(len, _)| len)
    }

    /// Number of free ranges (1 when unfragmented, 0 when full).
    pub fn free_range_count(&self) -> usize {
        self.free_by_offset.len()
    }

    /// Number of live slabs.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Checks every internal invariant; O(n). Panics on the first broken one.
    /// For tests and debugging.
    pub fn validate(&self) {
        assert_eq!(
            self.free_by_offset.len(),
            self.free_by_len.len(),
            "free indexes differ in size"
        );
        let mut ranges: Vec<(u64, u64, bool)> =
            Vec::with_capacity(self.free_by_offset.len() + self.live.len());
        for (&off, &len) in &self.free_by_offset {
            assert!(
                self.free_by_len.contains(&(len, off)),
                "free range {off:#x}+{len} missing by length"
            );
            ranges.push((off, len, true));
        }
        let mut live_sum = 0;
        for (&off, &len) in &self.live {
            live_sum += len;
            ranges.push((off, len, false));
        }
        assert_eq!(
            live_sum, self.used,
            "used bytes differ from the sum of live slabs"
        );
        assert!(self.high_water <= self.capacity, "high water past capacity");
        for (&off, &len) in &self.live {
            assert!(
                off + len - self.base <= self.high_water,
                "live slab {off:#x}+{len} above the high water {}",
                self.high_water
            );
        }
        ranges.sort_unstable();
        // Free and live ranges must tile [base, base + capacity) exactly, with
        // no two free ranges adjacent (they would have been merged).
        let mut cursor = self.base;
        let mut prev_free = false;
        for (off, len, is_free) in ranges {
            assert!(
                len > 0 && len % self.align == 0 && off % self.align == 0,
                "misaligned range {off:#x}+{len}"
            );
            assert_eq!(off, cursor, "gap or overlap at {cursor:#x}");
            assert!(!(prev_free && is_free), "adjacent free ranges at {off:#x}");
            cursor = off + len;
            prev_free = is_free;
        }
        assert_eq!(
            cursor,
            self.base + self.capacity,
            "ranges do not cover the capacity"
        );
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        debug_assert!(len > 0);
        let prev = self.free_by_offset.insert(offset, len);
        assert!(prev.is_none(), "free range {offset:#x} inserted twice");
        self.free_by_len.insert((len, offset));
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        let removed = self.free_by_offset.remove(&offset);
        assert_eq!(removed, Some(len), "free range {offset:#x} not indexed");
        assert!(
            self.free_by_len.remove(&(len, offset)),
            "free range {offset:#x} not indexed by length"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u64 = 4096;

    #[test]
    fn alloc_rounds_up_and_rejects_zero() {
        let mut a = SlabAllocator::new(0, 16 * A, A);
        assert_eq!(a.alloc(0), None);
        let s = a.alloc(1).unwrap();
        assert_eq!(s, Slab { offset: 0, len: A });
        let t = a.alloc(A + 1).unwrap();
        assert_eq!(
            t,
            Slab {
                offset: A,
                len: 2 * A
            }
        );
        assert_eq!(a.used_bytes(), 3 * A);
        assert_eq!(a.alloc(u64::MAX), None);
        a.validate();
    }

    #[test]
    fn nonzero_base_offsets() {
        let mut a = SlabAllocator::new(64 * A, 4 * A, A);
        let s = a.alloc(A).unwrap();
        assert_eq!(s.offset, 64 * A);
        a.free(s);
        a.validate();
    }

    #[test]
    fn full_then_out_of_memory() {
        let mut a = SlabAllocator::new(0, 4 * A, A);
        let slabs: Vec<_> = (0..4).map(|_| a.alloc(A).unwrap()).collect();
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.largest_free(), 0);
        assert_eq!(a.free_range_count(), 0);
        for s in slabs {
            a.free(s);
        }
        assert_eq!(a.used_bytes(), 0);
        assert_eq!(a.largest_free(), 4 * A);
        assert_eq!(a.free_range_count(), 1);
        a.validate();
    }

    #[test]
    fn fragmentation_and_coalescing() {
        let mut a = SlabAllocator::new(0, 8 * A, A);
        let s: Vec<_> = (0..8).map(|_| a.alloc(A).unwrap()).collect();
        // Free every other slab: 4 free pages, but no two contiguous.
        for i in (0..8).step_by(2) {
            a.free(s[i]);
        }
        assert_eq!(a.free_bytes(), 4 * A);
        assert_eq!(a.largest_free(), A);
        assert_eq!(
            a.alloc(2 * A),
            None,
            "fragmented space must not satisfy a 2-page slab"
        );
        // Freeing slab 1 merges 0,1,2 into one 3-page range.
        a.free(s[1]);
        assert_eq!(a.largest_free(), 3 * A);
        let big = a.alloc(3 * A).unwrap();
        assert_eq!(big.offset, 0);
        a.free(big);
        for i in [3, 5, 7] {
            a.free(s[i]);
        }
        assert_eq!(a.free_range_count(), 1);
        assert_eq!(a.largest_free(), 8 * A);
        a.validate();
    }

    #[test]
    fn best_fit_keeps_large_ranges() {
        let mut a = SlabAllocator::new(0, 10 * A, A);
        let s: Vec<_> = [1, 1, 3, 1, 4]
            .iter()
            .map(|&p| a.alloc(p * A).unwrap())
            .collect();
        a.free(s[0]); // 1-page hole at 0
        a.free(s[2]); // 3-page hole at 2
        let one = a.alloc(A).unwrap();
        assert_eq!(one.offset, 0, "a 1-page slab goes to the 1-page hole");
        let three = a.alloc(3 * A).unwrap();
        assert_eq!(three.offset, 2 * A);
        a.validate();
    }

    #[test]
    fn grow_extends_and_merges_tail() {
        let mut a = SlabAllocator::new(0, 2 * A, A);
        let x = a.alloc(A).unwrap();
        let _y = a.alloc(A).unwrap();
        assert_eq!(a.alloc(A), None);
        a.free(x);
        a.grow(4 * A);
        assert_eq!(a.capacity_bytes(), 4 * A);
        assert_eq!(a.largest_free(), 2 * A);
        a.grow(2 * A); // shrinking is ignored
        assert_eq!(a.capacity_bytes(), 4 * A);
        let z = a.alloc(2 * A).unwrap();
        assert_eq!(z.offset, 2 * A);
        a.validate();
        // Growth right after a free tail merges into one range.
        let mut b = SlabAllocator::new(0, 2 * A, A);
        b.grow(6 * A);
        assert_eq!(b.free_range_count(), 1);
        assert_eq!(b.largest_free(), 6 * A);
        b.validate();
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = SlabAllocator::new(0, 4 * A, A);
        let s = a.alloc(A).unwrap();
        a.free(s);
        a.free(s);
    }

    #[test]
    #[should_panic(expected = "live slab at that offset")]
    fn foreign_length_panics() {
        let mut a = SlabAllocator::new(0, 4 * A, A);
        let s = a.alloc(2 * A).unwrap();
        a.free(Slab {
            offset: s.offset,
            len: A,
        });
    }

    #[test]
    #[should_panic(expected = "not aligned")]
    fn misaligned_capacity_panics() {
        SlabAllocator::new(0, A + 1, A);
    }

    /// Seeded xorshift so failures replay.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Random alloc/free/grow against a page bitmap model: the allocator must
    /// succeed whenever a contiguous run exists (best fit never misses space),
    /// never overlap, and keep its counters exact.
    #[test]
    fn randomized_against_page_model() {
        for seed in [1u64, 0x9e37_79b9_7f4a_7c15, 42, 7777] {
            let mut rng = Rng(seed);
            let align = 64;
            let mut pages = 64u64;
            let mut a = SlabAllocator::new(align * 8, pages * align, align);
            let mut model = vec![false; pages as usize]; // true = used
            let mut live: Vec<Slab> = Vec::new();
            for step in 0..2000 {
                let op = rng.below(10);
                if op < 5 {
                    let len = 1 + rng.below(6 * align);
                    let need = len.div_ceil(align) as usize;
                    let longest_run = model.split(|&u| u).map(|run| run.len()).max().unwrap_or(0);
                    match a.alloc(len) {
                        Some(s) => {
                            assert_eq!(s.len, need as u64 * align, "seed {seed} step {step}");
                            let first = ((s.offset - align * 8) / align) as usize;
                            for p in &mut model[first..first + need] {
                                assert!(!*p, "seed {seed} step {step}: overlap");
                                *p = true;
                            }
                            live.push(s);
                        }
                        None => assert!(
                            longest_run < need,
                            "seed {seed} step {step}: refused {need} pages with a run of {longest_run}"
                        ),
                    }
                } else if op < 9 && !live.is_empty() {
                    let s = live.swap_remove(rng.below(live.len() as u64) as usize);
                    let first = ((s.offset - align * 8) / align) as usize;
                    for p in &mut model[first..first + (s.len / align) as usize] {
                        *p = false;
                    }
                    a.free(s);
                } else if pages < 256 {
                    pages += 1 + rng.below(8);
                    a.grow(pages * align);
                    model.resize(pages as usize, false);
                }
                let used_pages = model.iter().filter(|&&u| u).count() as u64;
                assert_eq!(
                    a.used_bytes(),
                    used_pages * align,
                    "seed {seed} step {step}"
                );
                let longest = model.split(|&u| u).map(|r| r.len()).max().unwrap_or(0) as u64;
                assert_eq!(a.largest_free(), longest * align, "seed {seed} step {step}");
                if step % 64 == 0 {
                    a.validate();
                }
            }
            a.validate();
        }
    }
}
