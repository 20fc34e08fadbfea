//! Object keys and chunk hashing, byte-compatible with lmcache 0.5.6.
//!
//! A request's tokens are cut into `chunk_size` chunks; each complete chunk gets a
//! 32-byte blake3 digest chained on the previous one (the first is chained on
//! `NONE_HASH`). An [`ObjectKey`] names one kv_rank shard of one chunk.

use std::fmt;

/// Length of a chunk hash in bytes (blake3 digest).
pub const CHUNK_HASH_LEN: usize = 32;

/// A chunk's rolling hash.
pub type ChunkHash = [u8; CHUNK_HASH_LEN];

/// Longest cache_salt accepted, in characters (0.5.6's `_SALT_MAX_LEN`).
pub const CACHE_SALT_MAX_CHARS: usize = 128;

/// `hash_func((0, (0,), None))`: blake3 over an 8-byte zero prefix and one zero
/// token, i.e. twelve zero bytes.
pub fn none_hash() -> ChunkHash {
    *blake3::hash(&[0u8; 12]).as_bytes()
}

/// Why tokens could not be hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashError {
    /// A token id outside `0..2^32` (0.5.6 packs tokens as big-endian u32).
    TokenOutOfRange { index: usize, value: i64 },
    /// `start` or `end` is not a multiple of the chunk size.
    Unaligned {
        start: usize,
        end: usize,
        chunk_size: usize,
    },
    /// `end` runs past the tokens, or `start > end`.
    BadRange {
        start: usize,
        end: usize,
        len: usize,
    },
}

impl fmt::Display for HashError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HashError::TokenOutOfRange { index, value } => {
                write!(f, "token {index} = {value} is not a u32 token id")
            }
            HashError::Unaligned {
                start,
                end,
                chunk_size,
            } => write!(
                f,
                "range [{start}, {end}) is not aligned to chunk size {chunk_size}"
            ),
            HashError::BadRange { start, end, len } => {
                write!(f, "range [{start}, {end}) is outside the {len} tokens")
            }
        }
    }
}

impl std::error::Error for HashError {}

/// Hashes one chunk of tokens chained on `prefix`.
pub fn hash_chunk(prefix: &ChunkHash, tokens: &[u32]) -> ChunkHash {
    let mut h = blake3::Hasher::new();
    h.update(prefix);
    // Pack tokens big-endian in a stack buffer, a block at a time.
    let mut buf = [0u8; 1024];
    for block in tokens.chunks(buf.len() / 4) {
        for (i, t) in block.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_be_bytes());
        }
        h.update(&buf[..block.len() * 4]);
    }
    *h.finalize().as_bytes()
}

/// Converts wire token ids (msgpack ints) to u32, rejecting what 0.5.6's
/// `struct.pack(">I")` would reject.
pub fn tokens_to_u32(tokens: &[i64]) -> Result<Vec<u32>, HashError> {
    tokens
        .iter()
        .enumerate()
        .map(|(index, &value)| {
            u32::try_from(value).map_err(|_| HashError::TokenOutOfRange { index, value })
        })
        .collect()
}

/// Rolling chunk hashes of a token sequence, computed incrementally.
///
/// Holds the hashes of every complete chunk hashed so far; extending to a longer
/// range hashes only the new chunks. Used per session (request_id) so a request's
/// lookup, store and retrieve hash each chunk once.
#[derive(Debug, Clone, Default)]
pub struct ChunkHashes {
    hashes: Vec<ChunkHash>,
}

impl ChunkHashes {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of chunks hashed so far.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Every hash computed so far, in chunk order.
    pub fn all(&self) -> &[ChunkHash] {
        &self.hashes
    }

    /// Forgets all hashes (the tokens changed).
    pub fn reset(&mut self) {
        self.hashes.clear();
    }

    /// Makes sure every complete chunk up to token `end` is hashed.
    pub fn extend_to(&mut self, tokens: &[u32], chunk_size: usize, end: usize) {
        assert!(chunk_size > 0, "chunk_size must be positive");
        let end = end.min(tokens.len());
        let want = end / chunk_size;
        while self.hashes.len() < want {
            let i = self.hashes.len();
            let prefix = match i {
                0 => none_hash(),
                _ => self.hashes[i - 1],
            };
            let h = hash_chunk(&prefix, &tokens[i * chunk_size..(i + 1) * chunk_size]);
            self.hashes.push(h);
        }
    }

    /// Hashes of the chunks in token range `[start, end)`, both chunk-aligned.
    pub fn range(
        &mut self,
        tokens: &[u32],
        chunk_size: usize,
        start: usize,
        end: usize,
    ) -> Result<&[ChunkHash], HashError> {
        check_range(tokens.len(), chunk_size, start, end)?;
        self.extend_to(tokens, chunk_size, end);
        Ok(&self.hashes[start / chunk_size..end / chunk_size])
    }
}

/// Checks a `[start, end)` token range as 0.5.6's `resolve_obj_keys` does.
pub fn check_range(
    len: usize,
    chunk_size: usize,
    start: usize,
    end: usize,
) -> Result<(), HashError> {
    if start % chunk_size != 0 || end % chunk_size != 0 {
        return Err(HashError::Unaligned {
            start,
            end,
            chunk_size,
        });
    }
    if start > end || end > len {
        return Err(HashError::BadRange { start, end, len });
    }
    Ok(())
}

/// One-shot hashing of the complete chunks in `[start, end)` (test and tool use).
pub fn chunk_hashes(
    tokens: &[u32],
    chunk_size: usize,
    start: usize,
    end: usize,
) -> Result<Vec<ChunkHash>, HashError> {
    let mut h = ChunkHashes::new();
    Ok(h.range(tokens, chunk_size, start, end)?.to_vec())
}

/// 0.5.6's `ObjectKey.ComputeKVRank`: `(ws << 24) | (rank << 16) | (local_ws << 8) | local_rank`.
pub fn compute_kv_rank(
    world_size: u32,
    global_rank: u32,
    local_world_size: u32,
    local_rank: u32,
) -> u32 {
    (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank
}

/// The kv_rank of worker `worker_id` in a world of `world_size`, as the MP server
/// computes it (global = local).
pub fn worker_kv_rank(world_size: u32, worker_id: u32) -> u32 {
    compute_kv_rank(world_size, worker_id, world_size, worker_id)
}

/// Largest world size a kv_rank can encode (one byte per field).
pub const MAX_WORLD_SIZE: u32 = 255;

/// Identity of one stored object: one kv_rank shard of one chunk of one model.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub chunk_hash: ChunkHash,
    pub model_name: String,
    pub kv_rank: u32,
    pub object_group_id: u32,
    pub cache_salt: String,
}

impl ObjectKey {
    /// Shard that owns this key: by chunk hash alone, so every kv_rank of a chunk
    /// lives on one shard.
    pub fn shard(&self, num_shards: usize) -> usize {
        shard_of(&self.chunk_hash, num_shards)
    }

    /// 0.5.6's fs-adapter file stem: `model@0xRANK@GROUP@HASH[@salt]`.
    pub fn file_stem(&self) -> String {
        let mut s = format!(
            "{}@{:#010x}@{:x}@{}",
            self.model_name.replace('/', "-SEP-"),
            self.kv_rank,
            self.object_group_id,
            hex(&self.chunk_hash)
        );
        if !self.cache_salt.is_empty() {
            s.push('@');
            s.push_str(&self.cache_salt);
        }
        s
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file_stem())
    }
}

/// Shard owning a chunk: the first 8 hash bytes, modulo the shard count.
pub fn shard_of(chunk_hash: &ChunkHash, num_shards: usize) -> usize {
    let mut b = [0u8; 8];
    b.copy_from_slice(&chunk_hash[..8]);
    (u64::from_le_bytes(b) % num_shards as u64) as usize
}

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Why a cache_salt is refused (0.5.6's `IPCCacheServerKey.__post_init__`).
pub fn check_cache_salt(salt: &str) -> Result<(), String> {
    if let Some(c) = salt.chars().find(|c| matches!(c, '@' | '/' | '\\' | '\0')) {
        return Err(format!("cache_salt must not contain {c:?} (got {salt:?})"));
    }
    let n = salt.chars().count();
    if n > CACHE_SALT_MAX_CHARS {
        return Err(format!(
            "cache_salt exceeds max length {CACHE_SALT_MAX_CHARS} (got {n})"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_matches_lmcache() {
        assert_eq!(
            hex(&none_hash()),
            "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
        );
    }

    #[test]
    fn chunk4_vector() {
        let tokens: Vec<u32> = (1..=8).collect();
        let h = chunk_hashes(&tokens, 4, 0, 8).unwrap();
        assert_eq!(
            hex(&h[0]),
            "6309ed506b8721905753f5c73c070bb21c3aafbd9b474b1e231f41368b71123c"
        );
        assert_eq!(
            hex(&h[1]),
            "98efc76eafb06cfe774c31ff151f300b61a614c27982a211bb8cdbd83a8c0e19"
        );
        // A sub-range returns the same chained values.
        let tail = chunk_hashes(&tokens, 4, 4, 8).unwrap();
        assert_eq!(tail, vec![h[1]]);
    }

    #[test]
    fn bench_vector() {
        let mut tokens = vec![0u32];
        tokens.extend(std::iter::repeat_n(9906u32, 512));
        let h = chunk_hashes(&tokens, 256, 0, 512).unwrap();
        assert_eq!(
            hex(&h[0]),
            "d65391f7dcbfb7f8472e8942ce76f5ca70a3ab0ffd0978c0640a27d07a9a336f"
        );
        assert_eq!(
            hex(&h[1]),
            "4d033f8a28112da0d40257c88d086c2816f3827becdbb9056a484d19d8ea4b64"
        );
    }

    #[test]
    fn incomplete_chunks_are_not_hashed() {
        let tokens: Vec<u32> = (0..10).collect();
        let mut h = ChunkHashes::new();
        h.extend_to(&tokens, 4, 10);
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn range_checks() {
        let tokens: Vec<u32> = (0..8).collect();
        assert!(matches!(
            chunk_hashes(&tokens, 4, 1, 8),
            Err(HashError::Unaligned { .. })
        ));
        assert!(matches!(
            chunk_hashes(&tokens, 4, 0, 12),
            Err(HashError::BadRange { .. })
        ));
        assert!(matches!(
            chunk_hashes(&tokens, 4, 8, 4),
            Err(HashError::BadRange { .. })
        ));
        assert!(chunk_hashes(&tokens, 4, 4, 4).unwrap().is_empty());
    }

    #[test]
    fn token_range() {
        assert!(tokens_to_u32(&[0, 1, u32::MAX as i64]).is_ok());
        assert_eq!(
            tokens_to_u32(&[0, -1]),
            Err(HashError::TokenOutOfRange {
                index: 1,
                value: -1
            })
        );
        assert!(tokens_to_u32(&[1 << 32]).is_err());
    }

    #[test]
    fn kv_rank_packing() {
        assert_eq!(worker_kv_rank(1, 0), 0x0100_0100);
        assert_eq!(worker_kv_rank(2, 1), 0x0201_0201);
    }

    #[test]
    fn file_stem_format() {
        let mut tokens = vec![0u32];
        tokens.extend(std::iter::repeat_n(9906u32, 256));
        let h = chunk_hashes(&tokens, 256, 0, 256).unwrap()[0];
        let mut k = ObjectKey {
            chunk_hash: h,
            model_name: "org/test-model".into(),
            kv_rank: worker_kv_rank(1, 0),
            object_group_id: 0,
            cache_salt: String::new(),
        };
        assert_eq!(
            k.file_stem(),
            format!("org-SEP-test-model@0x01000100@0@{}", hex(&h))
        );
        k.cache_salt = "tenant".into();
        k.object_group_id = 10;
        assert!(k.file_stem().ends_with(&format!("@a@{}@tenant", hex(&h))));
    }

    #[test]
    fn salt_rules() {
        assert!(check_cache_salt("").is_ok());
        assert!(check_cache_salt("a@b").is_err());
        assert!(check_cache_salt(&"x".repeat(129)).is_err());
        assert!(check_cache_salt(&"x".repeat(128)).is_ok());
    }

    #[test]
    fn routing_is_by_hash_only() {
        let h = [7u8; 32];
        let a = ObjectKey {
            chunk_hash: h,
            model_name: "m".into(),
            kv_rank: 1,
            object_group_id: 0,
            cache_salt: String::new(),
        };
        let b = ObjectKey {
            kv_rank: 2,
            cache_salt: "s".into(),
            ..a.clone()
        };
        assert_eq!(a.shard(4), b.shard(4));
    }
}
