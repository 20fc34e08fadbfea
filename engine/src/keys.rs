//! Object keys and chunk hashing, byte-compatible with lmcache 0.5.6.
//!
//! A request's tokens are cut into `chunk_size` chunks; each complete chunk gets a
//! 32-byte digest chained on the previous one (the first is chained on a none
//! hash): blake3 by default, or vLLM's sha256_cbor ([`TokenHasher`]). An
//! [`ObjectKey`] names one kv_rank shard of one chunk.

use std::collections::HashSet;
use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::ops::Deref;
use std::sync::{Mutex, OnceLock};

/// Length of a chunk hash in bytes (blake3 digest).
pub const CHUNK_HASH_LEN: usize = 32;

/// A chunk's rolling hash.
pub type ChunkHash = [u8; CHUNK_HASH_LEN];

// The salt rule and hex belong to the protocol; the wire crate owns them.
pub use kvshard_wire::{check_cache_salt, hex, CACHE_SALT_MAX_CHARS};

/// `hash_func((0, (0,), None))`: blake3 over an 8-byte zero prefix and one zero
/// token, i.e. twelve zero bytes.
pub fn none_hash() -> ChunkHash {
    *blake3::hash(&[0u8; 12]).as_bytes()
}

/// How chunk hashes are computed (`--hash-algorithm`) and the prefix the first
/// chunk is chained on.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenHasher {
    /// 0.5.6's own blake3 hash, chained on [`none_hash`].
    #[default]
    Blake3,
    /// vLLM's `sha256_cbor`: sha256 of the canonical CBOR encoding of
    /// `(prefix, tuple(tokens), None)`, chained on `none_hash` (see
    /// [`sha256_cbor_seeded_none_hash`] and [`sha256_cbor_fallback_none_hash`]).
    Sha256Cbor { none_hash: ChunkHash },
}

impl fmt::Debug for TokenHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenHasher::Blake3 => f.write_str("Blake3"),
            TokenHasher::Sha256Cbor { none_hash } => {
                write!(f, "Sha256Cbor(none_hash={})", hex(none_hash))
            }
        }
    }
}

impl TokenHasher {
    /// The prefix the first chunk of every request is chained on.
    pub fn none_hash(&self) -> ChunkHash {
        match self {
            TokenHasher::Blake3 => none_hash(),
            TokenHasher::Sha256Cbor { none_hash } => *none_hash,
        }
    }

    /// Hashes one chunk of tokens chained on `prefix`.
    pub fn hash_chunk(&self, prefix: &ChunkHash, tokens: &[u32]) -> ChunkHash {
        match self {
            TokenHasher::Blake3 => hash_chunk(prefix, tokens),
            TokenHasher::Sha256Cbor { .. } => sha256_cbor_chunk(prefix, tokens),
        }
    }

    /// One-shot hashing of the complete chunks in `[start, end)`.
    pub fn chunk_hashes(
        self,
        tokens: &[u32],
        chunk_size: usize,
        start: usize,
        end: usize,
    ) -> Result<Vec<ChunkHash>, HashError> {
        let mut h = ChunkHashes::new(self);
        Ok(h.range(tokens, chunk_size, start, end)?.to_vec())
    }
}

/// Writes a CBOR head (major type `major`, argument `value`) in its shortest
/// form, as canonical CBOR requires; returns its length.
fn cbor_head(out: &mut [u8], major: u8, value: u64) -> usize {
    let m = major << 5;
    if value < 24 {
        out[0] = m | value as u8;
        1
    } else if value <= 0xff {
        out[0] = m | 24;
        out[1] = value as u8;
        2
    } else if value <= 0xffff {
        out[0] = m | 25;
        out[1..3].copy_from_slice(&(value as u16).to_be_bytes());
        3
    } else if value <= 0xffff_ffff {
        out[0] = m | 26;
        out[1..5].copy_from_slice(&(value as u32).to_be_bytes());
        5
    } else {
        out[0] = m | 27;
        out[1..9].copy_from_slice(&value.to_be_bytes());
        9
    }
}

/// sha256 over `parts` in order.
fn sha256_of(parts: &[&[u8]]) -> ChunkHash {
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    for p in parts {
        h.update(p);
    }
    finish(h)
}

fn finish(h: ring::digest::Context) -> ChunkHash {
    let mut out = [0u8; CHUNK_HASH_LEN];
    out.copy_from_slice(h.finish().as_ref());
    out
}

/// `sha256(cbor2.dumps((prefix, tuple(tokens), None), canonical=True))`.
fn sha256_cbor_chunk(prefix: &ChunkHash, tokens: &[u32]) -> ChunkHash {
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    // A 3-array, then the prefix as a 32-byte byte string.
    h.update(&[0x83, 0x58, CHUNK_HASH_LEN as u8]);
    h.update(prefix);
    // The tokens as an array of unsigned ints, encoded a block at a time.
    const BLOCK: usize = 128;
    let mut buf = [0u8; 9 * BLOCK];
    let n = cbor_head(&mut buf, 4, tokens.len() as u64);
    h.update(&buf[..n]);
    for block in tokens.chunks(BLOCK) {
        let mut at = 0;
        for &t in block {
            at += cbor_head(&mut buf[at..], 0, u64::from(t));
        }
        h.update(&buf[..at]);
    }
    h.update(&[0xf6]); // None
    finish(h)
}

/// vLLM's `init_none_hash` with `PYTHONHASHSEED` set: `sha256_cbor(seed)`, the
/// seed being the variable's text (a CBOR text string).
pub fn sha256_cbor_seeded_none_hash(python_hash_seed: &str) -> ChunkHash {
    let mut head = [0u8; 9];
    let n = cbor_head(&mut head, 3, python_hash_seed.len() as u64);
    sha256_of(&[&head[..n], python_hash_seed.as_bytes()])
}

/// vLLM's `init_none_hash` without `PYTHONHASHSEED`: 32 random bytes (None when
/// the system's random source fails).
pub fn random_none_hash() -> Option<ChunkHash> {
    use ring::rand::SecureRandom;
    let mut out = [0u8; CHUNK_HASH_LEN];
    ring::rand::SystemRandom::new().fill(&mut out).ok()?;
    Some(out)
}

/// 0.5.6's none hash where vLLM's `init_none_hash` cannot be imported:
/// `sha256_cbor((0, (0,), None))`, i.e. the CBOR `[0, [0], null]`.
pub fn sha256_cbor_fallback_none_hash() -> ChunkHash {
    sha256_of(&[&[0x83, 0x00, 0x81, 0x00, 0xf6]])
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
    hasher: TokenHasher,
    hashes: Vec<ChunkHash>,
}

impl ChunkHashes {
    pub fn new(hasher: TokenHasher) -> Self {
        ChunkHashes {
            hasher,
            hashes: Vec::new(),
        }
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
                0 => self.hasher.none_hash(),
                _ => self.hashes[i - 1],
            };
            let h = self
                .hasher
                .hash_chunk(&prefix, &tokens[i * chunk_size..(i + 1) * chunk_size]);
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

/// One-shot blake3 hashing of the complete chunks in `[start, end)` (test and
/// tool use).
pub fn chunk_hashes(
    tokens: &[u32],
    chunk_size: usize,
    start: usize,
    end: usize,
) -> Result<Vec<ChunkHash>, HashError> {
    TokenHasher::Blake3.chunk_hashes(tokens, chunk_size, start, end)
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

/// Most distinct names the process-wide table holds.
pub const MAX_NAMES: usize = 65_536;

/// Most bytes of name text the process-wide table holds.
pub const MAX_NAME_BYTES: usize = 16 << 20;

/// Why a string could not be interned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameError {
    /// The table already holds `limit` distinct names.
    TooManyNames { limit: usize },
    /// Adding the name would take the table past `limit` bytes of text.
    TooManyBytes { limit: usize },
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameError::TooManyNames { limit } => {
                write!(
                    f,
                    "too many distinct model names and cache salts (limit {limit})"
                )
            }
            NameError::TooManyBytes { limit } => write!(
                f,
                "model names and cache salts exceed {limit} bytes in total"
            ),
        }
    }
}

impl std::error::Error for NameError {}

/// A table of leaked strings, each stored once, with bounds on count and bytes.
struct Interner {
    names: HashSet<&'static str>,
    bytes: usize,
    max_names: usize,
    max_bytes: usize,
}

impl Interner {
    fn new(max_names: usize, max_bytes: usize) -> Self {
        Interner {
            names: HashSet::new(),
            bytes: 0,
            max_names,
            max_bytes,
        }
    }

    fn intern(&mut self, s: &str) -> Result<Name, NameError> {
        if s.is_empty() {
            return Ok(Name::EMPTY);
        }
        if let Some(&held) = self.names.get(s) {
            return Ok(Name(held));
        }
        if self.names.len() >= self.max_names {
            return Err(NameError::TooManyNames {
                limit: self.max_names,
            });
        }
        if self.bytes + s.len() > self.max_bytes {
            return Err(NameError::TooManyBytes {
                limit: self.max_bytes,
            });
        }
        let held: &'static str = Box::leak(Box::from(s));
        self.names.insert(held);
        self.bytes += s.len();
        Ok(Name(held))
    }
}

fn names() -> &'static Mutex<Interner> {
    static NAMES: OnceLock<Mutex<Interner>> = OnceLock::new();
    NAMES.get_or_init(|| Mutex::new(Interner::new(MAX_NAMES, MAX_NAME_BYTES)))
}

/// An interned string (model name or cache salt): a `&'static str`, `Copy`.
///
/// Every non-empty `Name` with the same text points at the same leaked
/// string, so equality and hashing go by address; ordering goes by text.
/// Interning takes a process-wide lock, so it belongs where requests are
/// decoded or configuration is read, not on a shard's hot path.
#[derive(Clone, Copy)]
pub struct Name(&'static str);

impl Name {
    /// The empty name (no cache salt). Not stored in the table.
    pub const EMPTY: Name = Name("");

    /// The interned `Name` for `s`, adding it to the table if new. Fails when
    /// the table is at its bound ([`MAX_NAMES`] names or [`MAX_NAME_BYTES`]
    /// bytes); names already held are always returned.
    pub fn intern(s: &str) -> Result<Name, NameError> {
        if s.is_empty() {
            return Ok(Name::EMPTY);
        }
        names().lock().unwrap_or_else(|e| e.into_inner()).intern(s)
    }

    pub fn as_str(self) -> &'static str {
        self.0
    }

    /// Address identifying the name; 0 for the empty name.
    fn addr(self) -> usize {
        if self.0.is_empty() {
            0
        } else {
            self.0.as_ptr() as usize
        }
    }
}

impl Default for Name {
    fn default() -> Self {
        Name::EMPTY
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Name) -> bool {
        self.addr() == other.addr()
    }
}

impl Eq for Name {}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        self.0 == other.as_str()
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        self == other.0
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        *self == other.0
    }
}

impl PartialEq<Name> for String {
    fn eq(&self, other: &Name) -> bool {
        self.as_str() == other.0
    }
}

impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_usize(self.addr());
    }
}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Name) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Name) -> std::cmp::Ordering {
        if self == other {
            std::cmp::Ordering::Equal
        } else {
            self.0.cmp(other.0)
        }
    }
}

impl Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.0, f)
    }
}

/// Identity of one stored object: one kv_rank shard of one chunk of one model.
///
/// `Copy`: the names are interned. Hashing writes the first 8 bytes of the
/// chunk hash (a blake3 digest), kv_rank, group and the two name addresses.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ObjectKey {
    pub chunk_hash: ChunkHash,
    pub model_name: Name,
    pub kv_rank: u32,
    pub object_group_id: u32,
    pub cache_salt: Name,
}

impl Hash for ObjectKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.chunk_hash[..8]);
        state.write_u64(u64::from_le_bytes(b));
        state.write_u64(((self.kv_rank as u64) << 32) | self.object_group_id as u64);
        state.write_usize(self.model_name.addr());
        state.write_usize(self.cache_salt.addr());
    }
}

/// Multiply-xor hasher for [`ObjectKey`] and [`Name`] maps, whose hashed
/// words are already well spread (digest bytes, addresses). Not DoS
/// resistant on arbitrary input; the chunk hash is a blake3 digest.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyHasher(u64);

const KEY_HASH_MUL: u64 = 0x9e37_79b9_7f4a_7c15;

impl KeyHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(KEY_HASH_MUL);
    }
}

impl Hasher for KeyHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            self.add(u64::from_le_bytes(b));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(b) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // The last multiply leaves the high bits best mixed; bring them down
        // to the low bits the table indexes by.
        self.0 ^ (self.0 >> 32)
    }
}

/// `BuildHasher` for maps keyed by [`ObjectKey`] or [`Name`].
pub type KeyBuildHasher = BuildHasherDefault<KeyHasher>;

/// `HashMap` keyed by [`ObjectKey`] (or [`Name`]) with [`KeyHasher`].
pub type KeyMap<K, V> = std::collections::HashMap<K, V, KeyBuildHasher>;

/// `HashSet` of [`ObjectKey`] (or [`Name`]) with [`KeyHasher`].
pub type KeySet<K> = std::collections::HashSet<K, KeyBuildHasher>;

impl ObjectKey {
    /// Shard that owns this key: by chunk hash alone, so every kv_rank of a chunk
    /// lives on one shard.
    pub fn shard(&self, num_shards: usize) -> usize {
        shard_of(&self.chunk_hash, num_shards)
    }

    /// 0.5.6's fs-adapter file stem: `model@0xRANK@GROUP@HASH[@salt]`.
    pub fn file_stem(&self) -> String {
        file_stem_of(
            &self.model_name,
            self.kv_rank,
            self.object_group_id,
            &self.chunk_hash,
            &self.cache_salt,
        )
    }
}

/// [`ObjectKey::file_stem`] of a key given by its parts (names not interned).
pub(crate) fn file_stem_of(
    model_name: &str,
    kv_rank: u32,
    object_group_id: u32,
    chunk_hash: &ChunkHash,
    cache_salt: &str,
) -> String {
    let mut s = format!(
        "{}@{:#010x}@{:x}@{}",
        model_name.replace('/', "-SEP-"),
        kv_rank,
        object_group_id,
        hex(chunk_hash)
    );
    if !cache_salt.is_empty() {
        s.push('@');
        s.push_str(cache_salt);
    }
    s
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
        let mut h = ChunkHashes::new(TokenHasher::Blake3);
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
            model_name: Name::intern("org/test-model").unwrap(),
            kv_rank: worker_kv_rank(1, 0),
            object_group_id: 0,
            cache_salt: Name::EMPTY,
        };
        assert_eq!(
            k.file_stem(),
            format!("org-SEP-test-model@0x01000100@0@{}", hex(&h))
        );
        k.cache_salt = Name::intern("tenant").unwrap();
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
            model_name: Name::intern("m").unwrap(),
            kv_rank: 1,
            object_group_id: 0,
            cache_salt: Name::EMPTY,
        };
        let b = ObjectKey {
            kv_rank: 2,
            cache_salt: Name::intern("s").unwrap(),
            ..a
        };
        assert_eq!(a.shard(4), b.shard(4));
    }

    fn name(s: &str) -> Name {
        Name::intern(s).unwrap()
    }

    #[test]
    fn interned_names_share_one_string() {
        let a = name("keys-test/model");
        let owned = String::from("keys-test/model");
        let b = name(&owned);
        assert_eq!(a, b);
        assert!(std::ptr::eq(a.as_str(), b.as_str()));
        assert_ne!(a, name("keys-test/other"));
        assert_eq!(a.as_str(), "keys-test/model");
        assert_eq!(&*a, "keys-test/model");
        assert_eq!(a.to_string(), "keys-test/model");
        assert_eq!(format!("{a:?}"), "\"keys-test/model\"");
        assert_eq!(name(""), Name::EMPTY);
        assert_eq!(Name::default(), Name::EMPTY);
        assert!(Name::EMPTY.is_empty());
        assert_ne!(name("keys-test/salt"), Name::EMPTY);
    }

    #[test]
    fn names_order_by_text() {
        let mut v = [
            name("keys-test-c"),
            name("keys-test-a"),
            Name::EMPTY,
            name("keys-test-b"),
        ];
        v.sort();
        let texts: Vec<&str> = v.iter().map(|n| n.as_str()).collect();
        assert_eq!(texts, ["", "keys-test-a", "keys-test-b", "keys-test-c"]);
        assert_eq!(
            name("keys-test-a").cmp(&name("keys-test-a")),
            std::cmp::Ordering::Equal
        );
    }

    #[test]
    fn intern_bound_is_enforced() {
        let mut t = Interner::new(3, 10);
        let a = t.intern("aa").unwrap();
        t.intern("bb").unwrap();
        assert_eq!(t.intern("").unwrap(), Name::EMPTY);
        // Names already held are returned at the bound.
        assert_eq!(t.intern("aa").unwrap(), a);
        assert_eq!(
            t.intern("ccccccc"),
            Err(NameError::TooManyBytes { limit: 10 })
        );
        t.intern("cccccc").unwrap();
        assert_eq!(t.intern("d"), Err(NameError::TooManyNames { limit: 3 }));
        assert!(t.intern("d").unwrap_err().to_string().contains("limit 3"));
        assert!(NameError::TooManyBytes { limit: 10 }
            .to_string()
            .contains("10 bytes"));
        assert_eq!(t.names.len(), 3);
        assert_eq!(t.bytes, 10);
    }

    #[test]
    fn object_keys_differ_in_every_field() {
        use std::collections::HashSet;
        let base = ObjectKey {
            chunk_hash: [3; 32],
            model_name: name("keys-test/m1"),
            kv_rank: 1,
            object_group_id: 0,
            cache_salt: Name::EMPTY,
        };
        let mut tail = [3u8; 32];
        tail[31] = 4;
        let variants = [
            base,
            ObjectKey {
                chunk_hash: [4; 32],
                ..base
            },
            // Differs only past the hashed prefix: still a distinct key.
            ObjectKey {
                chunk_hash: tail,
                ..base
            },
            ObjectKey {
                model_name: name("keys-test/m2"),
                ..base
            },
            ObjectKey { kv_rank: 2, ..base },
            ObjectKey {
                object_group_id: 1,
                ..base
            },
            ObjectKey {
                cache_salt: name("keys-test/s1"),
                ..base
            },
            ObjectKey {
                cache_salt: name("keys-test/s2"),
                ..base
            },
        ];
        for (i, a) in variants.iter().enumerate() {
            for (j, b) in variants.iter().enumerate() {
                assert_eq!(a == b, i == j, "{a:?} vs {b:?}");
            }
        }
        let mut std_set: HashSet<ObjectKey> = HashSet::new();
        let mut fast: KeySet<ObjectKey> = KeySet::default();
        for k in variants {
            assert!(std_set.insert(k));
            assert!(fast.insert(k));
        }
        // The same key built from freshly interned names is found again.
        let again = ObjectKey {
            model_name: Name::intern(&String::from("keys-test/m1")).unwrap(),
            cache_salt: Name::intern(&String::from("keys-test/s1")).unwrap(),
            ..base
        };
        assert!(fast.contains(&again));
        assert!(!fast.insert(again));
        assert_eq!(fast.len(), variants.len());
        let h = |k: &ObjectKey| {
            use std::hash::BuildHasher;
            KeyBuildHasher::default().hash_one(k)
        };
        assert_eq!(h(&again), h(&variants[6]));
    }

    #[test]
    fn key_hasher_spreads_low_bits() {
        use std::hash::BuildHasher;
        let m = name("keys-test/spread");
        let mut low: std::collections::HashSet<u64> = std::collections::HashSet::new();
        for i in 0..256u32 {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&i.to_le_bytes());
            let k = ObjectKey {
                chunk_hash: h,
                model_name: m,
                kv_rank: 0,
                object_group_id: 0,
                cache_salt: Name::EMPTY,
            };
            low.insert(KeyBuildHasher::default().hash_one(k) & 1023);
        }
        assert!(
            low.len() > 200,
            "only {} distinct low-bit buckets",
            low.len()
        );
    }
}
