//! Benchmark data: bytes that differ for every seed and position.

/// Fills `buf` with a cheap 64-bit mix per word, so filling 256 MiB stays
/// well under a second and a block read back at the wrong place is caught.
pub fn fill(buf: &mut [u8], seed: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        let mut x = seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(i as u64);
        x ^= x >> 31;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 29;
        w.copy_from_slice(&x.to_le_bytes());
    }
}
