//! A strict, bounded msgpack codec: the subset msgspec 0.22 produces and accepts.
//!
//! Encoding always picks the smallest form, exactly as msgspec does, so replies
//! are byte-identical to lmcache 0.5.6's. Decoding never trusts a declared
//! length: every str/bin/ext length and every array/map count is checked against
//! the bytes left in the frame before anything is allocated, and nesting of
//! untyped values is bounded by [`MAX_DEPTH`].

use std::fmt;

/// Deepest nesting of arrays/maps accepted when reading or skipping an untyped value.
pub const MAX_DEPTH: usize = 64;

/// Largest up-front allocation for an untyped array or map; bigger ones grow as
/// their elements actually arrive, so a frame cannot make us reserve far more
/// memory than it carries.
const MAX_PREALLOC: usize = 4096;

/// The msgpack type family of a value (what a marker byte announces).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::Int => "int",
            Kind::Float => "float",
            Kind::Str => "str",
            Kind::Bin => "bin",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "ext",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a msgpack frame (or a typed value inside it) could not be decoded.
/// Offsets are byte positions in the frame being decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The input ended in the middle of `expected`.
    Truncated {
        offset: usize,
        expected: &'static str,
    },
    /// A value of the wrong type.
    TypeMismatch {
        offset: usize,
        expected: &'static str,
        found: Kind,
    },
    /// Marker byte 0xc1, which msgpack never uses.
    ReservedByte { offset: usize },
    /// A declared length or count the rest of the frame cannot hold.
    LengthTooLarge {
        offset: usize,
        kind: Kind,
        declared: u64,
        remaining: usize,
    },
    /// Arrays/maps nested deeper than [`MAX_DEPTH`].
    DepthExceeded { offset: usize, limit: usize },
    /// An int outside the range of the target type.
    IntOutOfRange {
        offset: usize,
        expected: &'static str,
        value: i128,
    },
    /// A str whose bytes are not UTF-8.
    InvalidUtf8 { offset: usize },
    /// Bytes left over after the frame's value.
    TrailingBytes { offset: usize, remaining: usize },
    /// A required struct field is absent from the map starting at `offset`.
    MissingField { offset: usize, field: &'static str },
    /// A struct that forbids unknown fields got one.
    UnknownField { offset: usize, field: String },
    /// A well-typed value that breaks a rule of the protocol.
    InvalidValue { offset: usize, reason: String },
    /// `source` happened inside the struct field / element at `path`
    /// (e.g. `token_ids[3]`, `metadata.shape`).
    At {
        path: String,
        source: Box<DecodeError>,
    },
}

impl DecodeError {
    /// Wraps the error with the struct field it happened in.
    pub fn at(self, field: &str) -> DecodeError {
        self.prefixed(field)
    }

    /// Wraps the error with the array index it happened at.
    pub fn at_index(self, index: usize) -> DecodeError {
        self.prefixed(&format!("[{index}]"))
    }

    fn prefixed(self, seg: &str) -> DecodeError {
        match self {
            DecodeError::At { path, source } => {
                let path = if path.starts_with('[') {
                    format!("{seg}{path}")
                } else {
                    format!("{seg}.{path}")
                };
                DecodeError::At { path, source }
            }
            other => DecodeError::At {
                path: seg.to_string(),
                source: Box::new(other),
            },
        }
    }

    /// Field path of the error (empty when it is not inside a field).
    pub fn path(&self) -> &str {
        match self {
            DecodeError::At { path, .. } => path,
            _ => "",
        }
    }

    /// The error without its field path.
    pub fn root(&self) -> &DecodeError {
        match self {
            DecodeError::At { source, .. } => source.root(),
            other => other,
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated { offset, expected } => {
                write!(f, "input ends at byte {offset} while reading {expected}")
            }
            DecodeError::TypeMismatch { offset, expected, found } => {
                write!(f, "expected {expected}, found {found} at byte {offset}")
            }
            DecodeError::ReservedByte { offset } => {
                write!(f, "reserved marker byte 0xc1 at byte {offset}")
            }
            DecodeError::LengthTooLarge { offset, kind, declared, remaining } => write!(
                f,
                "{kind} at byte {offset} declares length {declared} but only {remaining} bytes remain"
            ),
            DecodeError::DepthExceeded { offset, limit } => {
                write!(f, "nesting deeper than {limit} at byte {offset}")
            }
            DecodeError::IntOutOfRange { offset, expected, value } => {
                write!(f, "int {value} at byte {offset} is out of range for {expected}")
            }
            DecodeError::InvalidUtf8 { offset } => write!(f, "str at byte {offset} is not valid UTF-8"),
            DecodeError::TrailingBytes { offset, remaining } => {
                write!(f, "{remaining} trailing bytes after the value, from byte {offset}")
            }
            DecodeError::MissingField { offset, field } => {
                write!(f, "object at byte {offset} is missing required field `{field}`")
            }
            DecodeError::UnknownField { offset, field } => {
                write!(f, "unknown field `{field}` at byte {offset}")
            }
            DecodeError::InvalidValue { offset, reason } => write!(f, "{reason} (at byte {offset})"),
            DecodeError::At { path, source } => write!(f, "at `{path}`: {source}"),
        }
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DecodeError::At { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

/// An owned msgpack value. Non-negative ints that fit `i64` decode as [`Value::Int`];
/// only larger ones are [`Value::UInt`], so each integer has one representation.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    F64(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Ext(i8, Vec<u8>),
}

impl Value {
    pub fn kind(&self) -> Kind {
        match self {
            Value::Nil => Kind::Nil,
            Value::Bool(_) => Kind::Bool,
            Value::Int(_) | Value::UInt(_) => Kind::Int,
            Value::F64(_) => Kind::Float,
            Value::Str(_) => Kind::Str,
            Value::Bin(_) => Kind::Bin,
            Value::Array(_) => Kind::Array,
            Value::Map(_) => Kind::Map,
            Value::Ext(..) => Kind::Ext,
        }
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, Value::Nil)
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The value as `i64` if it is an int that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::UInt(u) => i64::try_from(*u).ok(),
            _ => None,
        }
    }

    /// The value of the first entry with str key `key`, if this is a map.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

/// An int in `0..2^32` in the forms that hold one without a sign or a wider
/// type (positive fixint, uint8, uint16, uint32) at the start of `rest`: its
/// value and length; `None` for any other form or too few bytes.
#[inline(always)]
fn short_u32(rest: &[u8]) -> Option<(u32, usize)> {
    match *rest {
        [b @ 0x00..=0x7f, ..] => Some((b as u32, 1)),
        [0xcc, b, ..] => Some((b as u32, 2)),
        [0xcd, b0, b1, ..] => Some((u16::from_be_bytes([b0, b1]) as u32, 3)),
        [0xce, b0, b1, b2, b3, ..] => Some((u32::from_be_bytes([b0, b1, b2, b3]), 5)),
        _ => None,
    }
}

/// The encoded length of the element whose type byte is `b`, for the forms
/// [`short_u32`] takes (positive fixint 1, uint8 2, uint16 3, uint32 5); 0 for
/// any other (at most one term is not 0). Written without branches, so a loop
/// of it vectorizes.
#[inline(always)]
fn short_len(b: u8) -> u8 {
    (b < 0x80) as u8 + (b == 0xcc) as u8 * 2 + (b == 0xcd) as u8 * 3 + (b == 0xce) as u8 * 5
}

/// For an element of encoded length `len` at the top of a big-endian u64:
/// how far to shift its value down, and which bits of it to keep.
const SHORT_SHIFT: [u8; 8] = [0, 56, 48, 40, 0, 24, 0, 0];
const SHORT_MASK: [u32; 8] = [0, 0xff, 0xff, 0xffff, 0, u32::MAX, 0, 0];

/// The type bytes of four uint16s in a row, at offsets 0, 3, 6 and 9 of a
/// big-endian u128, and where they sit.
const UINT16_QUAD_TAGS: u128 = 0xcd00_00cd_0000_cd00_00cd_0000_0000_0000;
const UINT16_QUAD_MASK: u128 = 0xff00_00ff_0000_ff00_00ff_0000_0000_0000;

/// The values of four uint16s in a row at the start of the big-endian `w`,
/// if that is what it holds.
#[inline(always)]
fn uint16_quad(w: u128) -> Option<[u32; 4]> {
    (w & UINT16_QUAD_MASK == UINT16_QUAD_TAGS)
        .then(|| [104, 80, 56, 32].map(|shift| (w >> shift) as u32 & 0xffff))
}

/// Decodes consecutive ints in `0..2^32` from the start of `rest` into `dst`,
/// as [`Reader::read_u32`] would one by one; stops before anything else,
/// when `dst` is full, or when an element starts in the last 16 bytes of
/// `rest`. Returns the bytes used and the elements written.
///
/// Token ids past 65,535 make the forms alternate at random, and a branch on
/// each element's form mispredicted on about half of them. Here the encoded
/// length at every byte offset of a block is worked out first (a loop the
/// compiler vectorizes), so the walk from one element to the next is a table
/// load and an add, and values come out by shift and mask. Four uint16s in a
/// row are still taken at once, and a block that starts with a run of them
/// has its lengths worked out only where the run ends.
fn short_u32_run(rest: &[u8], dst: &mut [u32]) -> (usize, usize) {
    const BLOCK: usize = 512;
    let Some(last) = rest.len().checked_sub(16) else {
        return (0, 0);
    };
    let mut lens = [0u8; BLOCK];
    // Element `i` starts at `base + at`; `at` may pass the block's end by
    // less than an element's length.
    let (mut base, mut at, mut i) = (0usize, 0usize, 0usize);
    loop {
        // A run of uint16s needs no lengths.
        while at < BLOCK && i + 4 <= dst.len() && base + at <= last {
            let pos = base + at;
            let w = u128::from_be_bytes(rest[pos..pos + 16].try_into().expect("16 bytes"));
            let Some(quad) = uint16_quad(w) else {
                break;
            };
            dst[i..i + 4].copy_from_slice(&quad);
            at += 12;
            i += 4;
        }
        if at < BLOCK {
            // No element left starts at or past `end`: the rest of `rest`
            // starts after `last`, and the elements still to read take at
            // most 9 bytes each.
            let end = (base + BLOCK)
                .min(rest.len())
                .min((base + at).saturating_add((dst.len() - i).saturating_mul(9)));
            for (len, &b) in lens.iter_mut().zip(&rest[base..end]) {
                *len = short_len(b);
            }
        }
        while at < BLOCK {
            let pos = base + at;
            if i == dst.len() || pos > last {
                return (pos, i);
            }
            let w = u128::from_be_bytes(rest[pos..pos + 16].try_into().expect("16 bytes"));
            if let Some(quad) = uint16_quad(w).filter(|_| i + 4 <= dst.len()) {
                dst[i..i + 4].copy_from_slice(&quad);
                at += 12;
                i += 4;
                continue;
            }
            let len = lens[at] as usize;
            if len != 0 {
                dst[i] = ((w >> 64) as u64 >> SHORT_SHIFT[len]) as u32 & SHORT_MASK[len];
                at += len;
            } else {
                // A wider form than the id needs (uint64, a signed int) is
                // read as `read_u32` reads it; anything else is the caller's.
                let mut one = Reader::new(&rest[pos..]);
                let Ok(v) = one.read_u32() else {
                    return (pos, i);
                };
                dst[i] = v;
                at += one.pos;
            }
            i += 1;
        }
        at -= BLOCK;
        base += BLOCK;
    }
}

/// Token arrays decoded lately, so a request naming the same tokens again (a
/// commit after its prepare, a retrieve after its lookup, each worker of a
/// tensor-parallel group) copies them instead of decoding them: a copy of
/// 2048 ids takes a fraction of the 5 µs their decode takes when ids past
/// 65,535 mix uint16s and uint32s.
///
/// A candidate is found by a fingerprint of the element count and bytes
/// sampled from the array; it is used only when the frame's bytes start with
/// the candidate's encoding, which then decodes to its tokens exactly.
/// Direct-mapped, [`TokenCache::SLOTS`] arrays of at most
/// [`TokenCache::MAX_TOKENS`] tokens: a few MiB at most.
#[derive(Debug, Default)]
pub struct TokenCache {
    slots: Vec<Option<CachedTokens>>,
    /// Arrays copied from the cache.
    pub hits: u64,
    /// Arrays decoded (and kept, when small enough).
    pub misses: u64,
}

#[derive(Debug)]
struct CachedTokens {
    fingerprint: u64,
    encoded: Vec<u8>,
    tokens: Vec<u32>,
}

impl TokenCache {
    pub const SLOTS: usize = 32;
    /// Longer arrays are decoded every time.
    pub const MAX_TOKENS: usize = 16_384;

    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `n` token ids (as [`Reader::read_u32_elements`]) into `out`.
    pub fn read(
        &mut self,
        r: &mut Reader<'_>,
        n: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), DecodeError> {
        if n > Self::MAX_TOKENS {
            self.misses += 1;
            return r.read_u32_elements(n, out);
        }
        let rest = &r.buf[r.pos..];
        let fingerprint = fingerprint(n, rest);
        let slot = (fingerprint % Self::SLOTS as u64) as usize;
        if let Some(Some(c)) = self.slots.get(slot) {
            if c.fingerprint == fingerprint && c.tokens.len() == n && rest.starts_with(&c.encoded) {
                out.extend_from_slice(&c.tokens);
                r.pos += c.encoded.len();
                self.hits += 1;
                return Ok(());
            }
        }
        self.misses += 1;
        let (at, first) = (r.pos, out.len());
        r.read_u32_elements(n, out)?;
        if self.slots.is_empty() {
            self.slots.resize_with(Self::SLOTS, || None);
        }
        let c = self.slots[slot].get_or_insert_with(|| CachedTokens {
            fingerprint,
            encoded: Vec::new(),
            tokens: Vec::new(),
        });
        c.fingerprint = fingerprint;
        c.encoded.clear();
        c.encoded.extend_from_slice(&r.buf[at..r.pos]);
        c.tokens.clear();
        c.tokens.extend_from_slice(&out[first..]);
        Ok(())
    }
}

/// Mixes the element count with bytes an array of `n` elements must hold: it
/// takes at least `n` bytes, so nothing past it is sampled.
fn fingerprint(n: usize, rest: &[u8]) -> u64 {
    let span = &rest[..n.min(rest.len())];
    let mut h = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut mix = |v: u64| {
        h = (h ^ v).wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 32;
    };
    if span.len() < 8 {
        span.iter().for_each(|&b| mix(u64::from(b)));
    } else {
        // Eight words spread over the span, the first at its start.
        for k in 0..8 {
            let at = (span.len() - 8) * k / 7;
            mix(u64::from_le_bytes(
                span[at..at + 8].try_into().expect("8 bytes"),
            ));
        }
    }
    h
}

/// Appends msgpack encodings to a byte vector, always in the smallest form.
#[derive(Debug, Default, Clone)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            buf: Vec::with_capacity(capacity),
        }
    }

    /// Continues appending to an existing buffer (reuses its allocation).
    pub fn from_vec(buf: Vec<u8>) -> Self {
        Self { buf }
    }

    pub fn into_vec(self) -> Vec<u8> {
        self.buf
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn write_nil(&mut self) {
        self.buf.push(0xc0);
    }

    pub fn write_bool(&mut self, v: bool) {
        self.buf.push(if v { 0xc3 } else { 0xc2 });
    }

    pub fn write_uint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
        } else if v <= u8::MAX as u64 {
            self.buf.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u16::MAX as u64 {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u32::MAX as u64 {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Non-negative values use the unsigned forms, as msgspec does.
    pub fn write_int(&mut self, v: i64) {
        if v >= 0 {
            self.write_uint(v as u64);
        } else if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else if v >= i8::MIN as i64 {
            self.buf.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i16::MIN as i64 {
            self.buf.push(0xd1);
            self.buf.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.buf.push(0xd2);
            self.buf.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Always float64: msgspec never emits float32.
    pub fn write_f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_bits().to_be_bytes());
    }

    pub fn write_str(&mut self, s: &str) {
        let n = len_u32(s.len());
        if n < 32 {
            self.buf.push(0xa0 | n as u8);
        } else if n <= u8::MAX as u32 {
            self.buf.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= u16::MAX as u32 {
            self.buf.push(0xda);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xdb);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
        self.buf.extend_from_slice(s.as_bytes());
    }

    pub fn write_bin(&mut self, b: &[u8]) {
        let n = len_u32(b.len());
        if n <= u8::MAX as u32 {
            self.buf.extend_from_slice(&[0xc4, n as u8]);
        } else if n <= u16::MAX as u32 {
            self.buf.push(0xc5);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xc6);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
        self.buf.extend_from_slice(b);
    }

    pub fn write_array_len(&mut self, len: usize) {
        let n = len_u32(len);
        if n < 16 {
            self.buf.push(0x90 | n as u8);
        } else if n <= u16::MAX as u32 {
            self.buf.push(0xdc);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xdd);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
    }

    pub fn write_map_len(&mut self, len: usize) {
        let n = len_u32(len);
        if n < 16 {
            self.buf.push(0x80 | n as u8);
        } else if n <= u16::MAX as u32 {
            self.buf.push(0xde);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xdf);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
    }

    pub fn write_ext(&mut self, code: i8, data: &[u8]) {
        let n = len_u32(data.len());
        let fixed = match n {
            1 => Some(0xd4),
            2 => Some(0xd5),
            4 => Some(0xd6),
            8 => Some(0xd7),
            16 => Some(0xd8),
            _ => None,
        };
        if let Some(marker) = fixed {
            self.buf.push(marker);
        } else if n <= u8::MAX as u32 {
            self.buf.extend_from_slice(&[0xc7, n as u8]);
        } else if n <= u16::MAX as u32 {
            self.buf.push(0xc8);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(0xc9);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
        self.buf.push(code as u8);
        self.buf.extend_from_slice(data);
    }

    pub fn write_value(&mut self, v: &Value) {
        match v {
            Value::Nil => self.write_nil(),
            Value::Bool(b) => self.write_bool(*b),
            Value::Int(i) => self.write_int(*i),
            Value::UInt(u) => self.write_uint(*u),
            Value::F64(x) => self.write_f64(*x),
            Value::Str(s) => self.write_str(s),
            Value::Bin(b) => self.write_bin(b),
            Value::Array(items) => {
                self.write_array_len(items.len());
                for item in items {
                    self.write_value(item);
                }
            }
            Value::Map(entries) => {
                self.write_map_len(entries.len());
                for (k, v) in entries {
                    self.write_value(k);
                    self.write_value(v);
                }
            }
            Value::Ext(code, data) => self.write_ext(*code, data),
        }
    }
}

/// msgpack cannot express lengths above u32::MAX; producing one would be a bug here.
fn len_u32(len: usize) -> u32 {
    assert!(
        len <= u32::MAX as usize,
        "msgpack length {len} exceeds u32::MAX"
    );
    len as u32
}

/// Encodes one value as a whole frame.
pub fn encode_value(v: &Value) -> Vec<u8> {
    let mut w = Writer::new();
    w.write_value(v);
    w.into_vec()
}

/// Decodes a whole frame holding exactly one value.
pub fn decode_value(frame: &[u8]) -> Result<Value, DecodeError> {
    let mut r = Reader::new(frame);
    let v = r.read_value()?;
    r.finish()?;
    Ok(v)
}

/// A cursor over a msgpack frame. Copying it gives a look-ahead cursor.
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Added to reported offsets, for frames nested inside another (ext payloads).
    base: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            base: 0,
        }
    }

    /// A reader over `buf` that lies at `base` inside an outer frame, so error
    /// offsets point into the outer frame.
    pub fn nested(buf: &'a [u8], base: usize) -> Self {
        Self { buf, pos: 0, base }
    }

    /// Offset of the next byte, as reported in errors.
    pub fn offset(&self) -> usize {
        self.base + self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    /// Checks that the whole frame has been consumed.
    pub fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            remaining => Err(DecodeError::TrailingBytes {
                offset: self.offset(),
                remaining,
            }),
        }
    }

    fn peek_byte(&self, expected: &'static str) -> Result<u8, DecodeError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or(DecodeError::Truncated {
                offset: self.offset(),
                expected,
            })
    }

    fn take(&mut self, n: usize, expected: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated {
                offset: self.offset(),
                expected,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn take_be<const N: usize>(&mut self, expected: &'static str) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, expected)?);
        Ok(a)
    }

    /// The kind of the next value, without consuming it.
    pub fn peek_kind(&self) -> Result<Kind, DecodeError> {
        let b = self.peek_byte("a value")?;
        kind_of(b).ok_or(DecodeError::ReservedByte {
            offset: self.offset(),
        })
    }

    /// True when the next value is nil (false at end of input).
    pub fn is_nil(&self) -> bool {
        self.buf.get(self.pos) == Some(&0xc0)
    }

    fn mismatch(&self, expected: &'static str) -> DecodeError {
        match self.peek_kind() {
            Ok(found) => DecodeError::TypeMismatch {
                offset: self.offset(),
                expected,
                found,
            },
            Err(e) => e,
        }
    }

    pub fn read_nil(&mut self) -> Result<(), DecodeError> {
        if self.peek_byte("nil")? != 0xc0 {
            return Err(self.mismatch("nil"));
        }
        self.pos += 1;
        Ok(())
    }

    pub fn read_bool(&mut self) -> Result<bool, DecodeError> {
        let v = match self.peek_byte("bool")? {
            0xc2 => false,
            0xc3 => true,
            _ => return Err(self.mismatch("bool")),
        };
        self.pos += 1;
        Ok(v)
    }

    /// Any int encoding, widened so every msgpack int fits.
    fn read_int_wide(&mut self, expected: &'static str) -> Result<i128, DecodeError> {
        let b = self.peek_byte(expected)?;
        let v = match b {
            0x00..=0x7f => {
                self.pos += 1;
                return Ok(b as i128);
            }
            0xe0..=0xff => {
                self.pos += 1;
                return Ok(b as i8 as i128);
            }
            0xcc..=0xd3 => {
                self.pos += 1;
                match b {
                    0xcc => u8::from_be_bytes(self.take_be(expected)?) as i128,
                    0xcd => u16::from_be_bytes(self.take_be(expected)?) as i128,
                    0xce => u32::from_be_bytes(self.take_be(expected)?) as i128,
                    0xcf => u64::from_be_bytes(self.take_be(expected)?) as i128,
                    0xd0 => i8::from_be_bytes(self.take_be(expected)?) as i128,
                    0xd1 => i16::from_be_bytes(self.take_be(expected)?) as i128,
                    0xd2 => i32::from_be_bytes(self.take_be(expected)?) as i128,
                    _ => i64::from_be_bytes(self.take_be(expected)?) as i128,
                }
            }
            _ => return Err(self.mismatch(expected)),
        };
        Ok(v)
    }

    /// An int in `T`'s range; out-of-range values are errors naming `expected`.
    pub fn read_int_as<T: TryFrom<i128>>(
        &mut self,
        expected: &'static str,
    ) -> Result<T, DecodeError> {
        let offset = self.offset();
        let v = self.read_int_wide(expected)?;
        T::try_from(v).map_err(|_| DecodeError::IntOutOfRange {
            offset,
            expected,
            value: v,
        })
    }

    /// Any int encoding whose value fits `i64` (uint64 up to 2^63-1 included).
    pub fn read_int(&mut self) -> Result<i64, DecodeError> {
        self.read_int_as("int64")
    }

    /// An int in `0..2^32`. The common encodings are decoded inline: this is
    /// the per-token path of every key.
    #[inline]
    pub fn read_u32(&mut self) -> Result<u32, DecodeError> {
        if let Some((v, len)) = short_u32(&self.buf[self.pos..]) {
            self.pos += len;
            return Ok(v);
        }
        self.read_int_as("uint32")
    }

    /// Reads `n` consecutive ints in `0..2^32` (the elements of an array whose
    /// header was just read) onto `out`; an error names the element's index.
    /// This is the per-token path of every key: [`short_u32_run`] decodes the
    /// elements without a branch on each one's form; what it stops before (an
    /// element that is no int in range, or one in the last 16 bytes of the
    /// buffer) goes through [`read_u32`](Self::read_u32), which names the error.
    pub fn read_u32_elements(&mut self, n: usize, out: &mut Vec<u32>) -> Result<(), DecodeError> {
        let start = out.len();
        out.resize(start + n, 0);
        let dst = &mut out[start..];
        let (used, mut i) = short_u32_run(&self.buf[self.pos..], dst);
        self.pos += used;
        while i < n {
            match self.read_u32() {
                Ok(v) => dst[i] = v,
                Err(e) => {
                    out.truncate(start + i);
                    return Err(e.at_index(i));
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// Any int encoding whose value is non-negative.
    pub fn read_u64(&mut self) -> Result<u64, DecodeError> {
        self.read_int_as("uint64")
    }

    /// float32, float64, or an int (msgspec accepts ints for float fields).
    pub fn read_f64(&mut self) -> Result<f64, DecodeError> {
        match self.peek_byte("float")? {
            0xca => {
                self.pos += 1;
                Ok(f32::from_bits(u32::from_be_bytes(self.take_be("float32")?)) as f64)
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(u64::from_be_bytes(self.take_be("float64")?)))
            }
            b if kind_of(b) == Some(Kind::Int) => Ok(self.read_int_wide("float")? as f64),
            _ => Err(self.mismatch("float")),
        }
    }

    /// Reads a length of `width` bytes that follows a marker.
    fn read_len(&mut self, width: usize, expected: &'static str) -> Result<u64, DecodeError> {
        Ok(match width {
            1 => u8::from_be_bytes(self.take_be(expected)?) as u64,
            2 => u16::from_be_bytes(self.take_be(expected)?) as u64,
            _ => u32::from_be_bytes(self.take_be(expected)?) as u64,
        })
    }

    /// Checks `declared * unit` bytes fit in what is left, before anyone allocates.
    fn check_len(
        &self,
        start: usize,
        kind: Kind,
        declared: u64,
        unit: u64,
    ) -> Result<usize, DecodeError> {
        let remaining = self.remaining();
        if declared.saturating_mul(unit) > remaining as u64 {
            return Err(DecodeError::LengthTooLarge {
                offset: start,
                kind,
                declared,
                remaining,
            });
        }
        Ok(declared as usize)
    }

    pub fn read_str(&mut self) -> Result<&'a str, DecodeError> {
        let start = self.offset();
        let b = self.peek_byte("str")?;
        let n = match b {
            0xa0..=0xbf => {
                self.pos += 1;
                (b & 0x1f) as u64
            }
            0xd9..=0xdb => {
                self.pos += 1;
                self.read_len(1 << (b - 0xd9), "str length")?
            }
            _ => return Err(self.mismatch("str")),
        };
        let n = self.check_len(start, Kind::Str, n, 1)?;
        let bytes = self.take(n, "str")?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { offset: start })
    }

    pub fn read_bin(&mut self) -> Result<&'a [u8], DecodeError> {
        let start = self.offset();
        let b = self.peek_byte("bin")?;
        let n = match b {
            0xc4..=0xc6 => {
                self.pos += 1;
                self.read_len(1 << (b - 0xc4), "bin length")?
            }
            _ => return Err(self.mismatch("bin")),
        };
        let n = self.check_len(start, Kind::Bin, n, 1)?;
        self.take(n, "bin")
    }

    /// An array header; the count is checked against the remaining bytes
    /// (every element takes at least one).
    pub fn read_array_len(&mut self) -> Result<usize, DecodeError> {
        let start = self.offset();
        let b = self.peek_byte("array")?;
        let n = match b {
            0x90..=0x9f => {
                self.pos += 1;
                (b & 0x0f) as u64
            }
            0xdc | 0xdd => {
                self.pos += 1;
                self.read_len(if b == 0xdc { 2 } else { 4 }, "array length")?
            }
            _ => return Err(self.mismatch("array")),
        };
        self.check_len(start, Kind::Array, n, 1)
    }

    /// A map header; the count is checked against the remaining bytes
    /// (every entry takes at least two).
    pub fn read_map_len(&mut self) -> Result<usize, DecodeError> {
        let start = self.offset();
        let b = self.peek_byte("map")?;
        let n = match b {
            0x80..=0x8f => {
                self.pos += 1;
                (b & 0x0f) as u64
            }
            0xde | 0xdf => {
                self.pos += 1;
                self.read_len(if b == 0xde { 2 } else { 4 }, "map length")?
            }
            _ => return Err(self.mismatch("map")),
        };
        self.check_len(start, Kind::Map, n, 2)
    }

    /// An ext value: its type code and payload.
    pub fn read_ext(&mut self) -> Result<(i8, &'a [u8]), DecodeError> {
        let start = self.offset();
        let b = self.peek_byte("ext")?;
        let n = match b {
            0xd4..=0xd8 => {
                self.pos += 1;
                1u64 << (b - 0xd4)
            }
            0xc7..=0xc9 => {
                self.pos += 1;
                self.read_len(1 << (b - 0xc7), "ext length")?
            }
            _ => return Err(self.mismatch("ext")),
        };
        let code = self.take(1, "ext type")?[0] as i8;
        let n = self.check_len(start, Kind::Ext, n, 1)?;
        Ok((code, self.take(n, "ext payload")?))
    }

    /// Skips one value of any kind (nesting bounded by [`MAX_DEPTH`]).
    pub fn skip_value(&mut self) -> Result<(), DecodeError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: usize) -> Result<(), DecodeError> {
        match self.peek_kind()? {
            Kind::Nil => self.read_nil(),
            Kind::Bool => self.read_bool().map(drop),
            Kind::Int => self.read_int_wide("int").map(drop),
            Kind::Float => self.read_f64().map(drop),
            Kind::Str => {
                // Skipping need not validate UTF-8, but msgspec would reject it anywhere.
                self.read_str().map(drop)
            }
            Kind::Bin => self.read_bin().map(drop),
            Kind::Ext => self.read_ext().map(drop),
            Kind::Array => {
                self.enter(depth)?;
                for _ in 0..self.read_array_len()? {
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
            Kind::Map => {
                self.enter(depth)?;
                for _ in 0..self.read_map_len()? {
                    self.skip_at(depth + 1)?;
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
        }
    }

    fn enter(&self, depth: usize) -> Result<(), DecodeError> {
        if depth >= MAX_DEPTH {
            return Err(DecodeError::DepthExceeded {
                offset: self.offset(),
                limit: MAX_DEPTH,
            });
        }
        Ok(())
    }

    /// Reads one value of any kind into an owned tree.
    pub fn read_value(&mut self) -> Result<Value, DecodeError> {
        self.value_at(0)
    }

    fn value_at(&mut self, depth: usize) -> Result<Value, DecodeError> {
        Ok(match self.peek_kind()? {
            Kind::Nil => {
                self.read_nil()?;
                Value::Nil
            }
            Kind::Bool => Value::Bool(self.read_bool()?),
            Kind::Int => {
                let v = self.read_int_wide("int")?;
                match i64::try_from(v) {
                    Ok(i) => Value::Int(i),
                    // Only uint64 values above i64::MAX land here.
                    Err(_) => Value::UInt(v as u64),
                }
            }
            Kind::Float => Value::F64(self.read_f64()?),
            Kind::Str => Value::Str(self.read_str()?.to_owned()),
            Kind::Bin => Value::Bin(self.read_bin()?.to_vec()),
            Kind::Ext => {
                let (code, data) = self.read_ext()?;
                Value::Ext(code, data.to_vec())
            }
            Kind::Array => {
                self.enter(depth)?;
                let n = self.read_array_len()?;
                let mut items = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    items.push(self.value_at(depth + 1)?);
                }
                Value::Array(items)
            }
            Kind::Map => {
                self.enter(depth)?;
                let n = self.read_map_len()?;
                let mut entries = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    let k = self.value_at(depth + 1)?;
                    let v = self.value_at(depth + 1)?;
                    entries.push((k, v));
                }
                Value::Map(entries)
            }
        })
    }
}

fn kind_of(b: u8) -> Option<Kind> {
    Some(match b {
        0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => Kind::Int,
        0x80..=0x8f | 0xde | 0xdf => Kind::Map,
        0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
        0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
        0xc0 => Kind::Nil,
        0xc1 => return None,
        0xc2 | 0xc3 => Kind::Bool,
        0xc4..=0xc6 => Kind::Bin,
        0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
        0xca | 0xcb => Kind::Float,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::hex;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn enc(f: impl FnOnce(&mut Writer)) -> String {
        let mut w = Writer::new();
        f(&mut w);
        hex(w.as_bytes())
    }

    #[test]
    fn golden_scalars() {
        assert_eq!(enc(|w| w.write_int(256)), "cd0100");
        assert_eq!(enc(|w| w.write_int(0x4000_0000)), "ce40000000");
        assert_eq!(enc(|w| w.write_bin(b"")), "c400");
        assert_eq!(enc(|w| w.write_bool(true)), "c3");
        assert_eq!(enc(|w| w.write_nil()), "c0");
        assert_eq!(enc(|w| w.write_int(21)), "15");
        assert_eq!(enc(|w| w.write_str("req-1")), "a57265712d31");
        assert_eq!(
            enc(|w| w.write_str("subscribe_kv_events")),
            "b37375627363726962655f6b765f6576656e7473"
        );
        assert_eq!(enc(|w| w.write_f64(1.5)), "cb3ff8000000000000");
    }

    #[test]
    fn int_boundaries_pick_smallest_form() {
        let cases: &[(i64, &str)] = &[
            (0, "00"),
            (127, "7f"),
            (128, "cc80"),
            (255, "ccff"),
            (256, "cd0100"),
            (65535, "cdffff"),
            (65536, "ce00010000"),
            (u32::MAX as i64, "ceffffffff"),
            (1 << 32, "cf0000000100000000"),
            (-1, "ff"),
            (-32, "e0"),
            (-33, "d0df"),
            (-128, "d080"),
            (-129, "d1ff7f"),
            (-32768, "d18000"),
            (-32769, "d2ffff7fff"),
            (i32::MIN as i64, "d280000000"),
            (i32::MIN as i64 - 1, "d3ffffffff7fffffff"),
            (i64::MIN, "d38000000000000000"),
            (i64::MAX, "cf7fffffffffffffff"),
        ];
        for &(v, want) in cases {
            let got = enc(|w| w.write_int(v));
            assert_eq!(got, want, "encoding {v}");
            let bytes = unhex(&got);
            let mut r = Reader::new(&bytes);
            assert_eq!(r.read_int().unwrap(), v);
            r.finish().unwrap();
            assert_eq!(decode_value(&bytes).unwrap(), Value::Int(v));
        }
        assert_eq!(enc(|w| w.write_uint(u64::MAX)), "cfffffffffffffffff");
        let max = unhex("cfffffffffffffffff");
        assert_eq!(Reader::new(&max).read_u64().unwrap(), u64::MAX);
        assert_eq!(decode_value(&max).unwrap(), Value::UInt(u64::MAX));
        assert!(matches!(
            Reader::new(&max).read_int(),
            Err(DecodeError::IntOutOfRange { value, .. }) if value == u64::MAX as i128
        ));
        assert!(matches!(
            Reader::new(&[0xff]).read_u64(),
            Err(DecodeError::IntOutOfRange { .. })
        ));
    }

    #[test]
    fn int_accepts_wide_encodings_of_small_values() {
        // Other encoders may not use the smallest form; values still decode.
        for bytes in [
            &[0xcf, 0, 0, 0, 0, 0, 0, 0, 5][..],
            &[0xd3, 0, 0, 0, 0, 0, 0, 0, 5],
            &[0xd0, 5],
        ] {
            assert_eq!(Reader::new(bytes).read_int().unwrap(), 5);
        }
    }

    #[test]
    fn u32_elements_fast_and_slow_paths() {
        // fixint, uint8, uint16, uint32, then wide or signed forms of small values.
        let bytes = unhex("05ccc8cd2706ceffffffffd005cf0000000000000007d30000000000000009");
        let mut r = Reader::new(&bytes);
        let mut out = vec![42];
        r.read_u32_elements(7, &mut out).unwrap();
        r.finish().unwrap();
        assert_eq!(out, vec![42, 5, 200, 9990, u32::MAX, 5, 7, 9]);
        let mut out = Vec::new();
        let err = Reader::new(&[0x01, 0xff])
            .read_u32_elements(2, &mut out)
            .unwrap_err();
        assert_eq!(err.path(), "[1]");
        assert!(matches!(
            err.root(),
            DecodeError::IntOutOfRange {
                offset: 1,
                value: -1,
                ..
            }
        ));
        let err = Reader::new(&unhex("01cf0000000100000000"))
            .read_u32_elements(2, &mut out)
            .unwrap_err();
        assert!(
            matches!(err.root(), DecodeError::IntOutOfRange { value, .. } if *value == 1i128 << 32)
        );
        let err = Reader::new(&[0x01, 0xcd, 0x01])
            .read_u32_elements(2, &mut out)
            .unwrap_err();
        assert!(matches!(err.root(), DecodeError::Truncated { .. }), "{err}");
        let err = Reader::new(&[0x01, 0xc3])
            .read_u32_elements(2, &mut out)
            .unwrap_err();
        assert!(matches!(
            err.root(),
            DecodeError::TypeMismatch {
                found: Kind::Bool,
                ..
            }
        ));
    }

    /// xorshift64: a reproducible stream of test inputs from `seed` (not 0).
    fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    #[test]
    fn token_cache_reads_what_a_decode_reads() {
        // Arrays from a small pool, each sent again as is, cut short, with a
        // changed element where the fingerprint may not look, with an element
        // in a wider form, or broken; each followed by other fields' bytes.
        // Read through the cache, every one gives what a plain decode gives:
        // the tokens, the bytes used, or the error.
        let mut next = xorshift(0x0123_4567_89ab_cdef);
        let pool: Vec<Vec<u32>> = (0..6)
            .map(|p| {
                let n = [0, 3, 9, 64, 300, 2048][p];
                (0..n).map(|_| (next() % 150_000) as u32).collect()
            })
            .collect();
        let mut cache = TokenCache::new();
        for round in 0..3000 {
            let r = next();
            let mut toks = pool[(r % 6) as usize].clone();
            let mut w = Writer::new();
            let variant = (r >> 8) % 6;
            match variant {
                1 if !toks.is_empty() => toks.truncate((r >> 16) as usize % toks.len()),
                2 if !toks.is_empty() => {
                    let at = (r >> 16) as usize % toks.len();
                    toks[at] ^= 1;
                }
                _ => {}
            }
            let wide = (variant == 3 && !toks.is_empty()).then(|| (r >> 16) as usize % toks.len());
            let bad = (variant == 4 && !toks.is_empty()).then(|| (r >> 16) as usize % toks.len());
            for (i, &t) in toks.iter().enumerate() {
                if Some(i) == wide {
                    w.buf.push(0xcf);
                    w.buf.extend_from_slice(&u64::from(t).to_be_bytes());
                } else if Some(i) == bad {
                    w.buf.push(0xc3);
                } else {
                    w.write_uint(u64::from(t));
                }
            }
            w.write_str("start");
            w.write_uint(r % 1000);
            let bytes = w.into_vec();
            let n = toks.len();
            let mut plain = Reader::new(&bytes);
            let mut want = Vec::new();
            let want_res = plain
                .read_u32_elements(n, &mut want)
                .map_err(|e| e.to_string());
            let mut cached = Reader::new(&bytes);
            let mut got = Vec::new();
            let got_res = cache
                .read(&mut cached, n, &mut got)
                .map_err(|e| e.to_string());
            assert_eq!(got_res, want_res, "round {round}");
            assert_eq!(got, want, "round {round}");
            assert_eq!(cached.offset(), plain.offset(), "round {round}");
        }
        // Most arrays came again unchanged: those were copied.
        assert!(
            cache.hits > 500,
            "{} hits, {} misses",
            cache.hits,
            cache.misses
        );
    }

    #[test]
    fn token_cache_keeps_no_long_array() {
        let toks: Vec<u32> = (0..TokenCache::MAX_TOKENS as u32 + 1).collect();
        let mut w = Writer::new();
        toks.iter().for_each(|&t| w.write_uint(u64::from(t)));
        let bytes = w.into_vec();
        let mut cache = TokenCache::new();
        for _ in 0..3 {
            let mut out = Vec::new();
            cache
                .read(&mut Reader::new(&bytes), toks.len(), &mut out)
                .unwrap();
            assert_eq!(out, toks);
        }
        assert_eq!((cache.hits, cache.misses), (0, 3));
    }

    #[test]
    fn u32_elements_match_one_by_one_reads() {
        // Every width of value, in every form an encoder may pick (the
        // smallest, or a wider signed or unsigned one), in a random order,
        // read as arrays of every length, in runs short and long enough to
        // cross the decoder's blocks: the tight loop agrees with `read_u32`
        // element by element, stops where it does, and fails where it does
        // on a broken element or a buffer cut short.
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for run in 0..120 {
            let count = if run % 4 == 3 {
                150 + (next() % 900) as usize
            } else {
                64
            };
            let mut w = Writer::new();
            let mut want = Vec::new();
            for _ in 0..count {
                let r = next();
                // A third of the runs is mostly uint16s, in runs of four and
                // more; a third mostly a random mix of uint16s and uint32s.
                let class = match (run % 3, r % 8) {
                    (0, 1..) => 2,
                    (1, 1..) => 2 + (r >> 20) % 2,
                    _ => r % 4,
                };
                let v = match class {
                    0 => r as u32 % 0x80,
                    1 => r as u32 % 0x100,
                    2 => 0x100 + r as u32 % 0xff00,
                    _ => (r >> 8) as u32,
                };
                let form = if class >= 2 && run % 3 < 2 {
                    0
                } else {
                    (r >> 40) % 4
                };
                match form {
                    0 => w.write_uint(v as u64),
                    1 => {
                        w.buf.push(0xce);
                        w.buf.extend_from_slice(&v.to_be_bytes());
                    }
                    2 => {
                        w.buf.push(0xcf);
                        w.buf.extend_from_slice(&(v as u64).to_be_bytes());
                    }
                    _ => {
                        w.buf.push(0xd3);
                        w.buf.extend_from_slice(&(v as i64).to_be_bytes());
                    }
                }
                want.push(v);
            }
            let bytes = w.into_vec();
            let step = if count > 64 { 1 + count / 40 } else { 1 };
            for n in (0..=count).step_by(step).chain([count]) {
                let mut r = Reader::new(&bytes);
                let mut out = Vec::new();
                r.read_u32_elements(n, &mut out).unwrap();
                assert_eq!(out, want[..n], "run {run}");
                let mut one = Reader::new(&bytes);
                for _ in 0..n {
                    one.read_u32().unwrap();
                }
                assert_eq!(r.offset(), one.offset(), "run {run}");
            }
            // A value no token id can be, anywhere: named by its index.
            let bad = (next() % count as u64) as usize;
            let mut r = Reader::new(&bytes);
            r.read_u32_elements(bad, &mut Vec::new()).unwrap();
            let at = r.offset();
            let mut broken = bytes[..at].to_vec();
            // A bool, a negative fixint, a nil, an array, negative ints in
            // each signed form, a uint64 past i64.
            let wrong: [&[u8]; 8] = [
                &[0xc3],
                &[0xe0],
                &[0xc0],
                &[0x90],
                &[0xd0, 0xff],
                &[0xd2, 0x80, 0, 0, 0],
                &[0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe],
                &[0xcf, 0x80, 0, 0, 0, 0, 0, 0, 1],
            ];
            broken.extend_from_slice(wrong[run % 8]);
            broken.extend_from_slice(&bytes[at..]);
            let mut out = Vec::new();
            let err = Reader::new(&broken)
                .read_u32_elements(count, &mut out)
                .unwrap_err();
            assert_eq!(err.path(), format!("[{bad}]"), "run {run}");
            assert_eq!(out, want[..bad], "run {run}");
            // Cut short anywhere: the element cut is named, those before it read.
            let cut = (next() % bytes.len() as u64) as usize;
            let mut one = Reader::new(&bytes[..cut]);
            let whole = (0..count).take_while(|_| one.read_u32().is_ok()).count();
            let mut out = Vec::new();
            let err = Reader::new(&bytes[..cut])
                .read_u32_elements(count, &mut out)
                .unwrap_err();
            assert!(matches!(err.root(), DecodeError::Truncated { .. }), "{err}");
            assert_eq!(err.path(), format!("[{whole}]"), "run {run}");
            assert_eq!(out, want[..whole], "run {run}");
        }
    }

    #[test]
    fn u32_elements_across_uint16_runs() {
        // A run of uint16s (taken four at a time, with no lengths worked out)
        // that ends at every offset of the decoder's first two blocks (a lead
        // of 0 to 11 fixints moves it by a byte), between other forms: each
        // array reads as one-by-one reads do.
        for lead in 0..12 {
            for run in 100..400 {
                let mut want: Vec<u32> = vec![70_000];
                want.extend((0..lead).map(|k| k as u32));
                want.extend((0..run).map(|k| 300 + k as u32));
                want.extend([1 << 20, 5, 200, 40_000, 90_000, 7, 65_536, 0, 255, 256]);
                want.extend((0..40u64).map(|k| (k * 2_654_435_761 % 150_000) as u32));
                let mut w = Writer::new();
                for &v in &want {
                    w.write_uint(v as u64);
                }
                let bytes = w.into_vec();
                let mut r = Reader::new(&bytes);
                let mut out = Vec::new();
                r.read_u32_elements(want.len(), &mut out).unwrap();
                assert_eq!(out, want, "lead {lead}, run {run}");
                r.finish().unwrap();
            }
        }
    }

    #[test]
    fn lengths_pick_smallest_form() {
        assert_eq!(&enc(|w| w.write_str(&"x".repeat(31)))[..2], "bf");
        assert_eq!(&enc(|w| w.write_str(&"x".repeat(32)))[..4], "d920");
        assert_eq!(&enc(|w| w.write_str(&"x".repeat(256)))[..6], "da0100");
        assert_eq!(
            &enc(|w| w.write_str(&"x".repeat(65536)))[..10],
            "db00010000"
        );
        assert_eq!(&enc(|w| w.write_bin(&[0; 256]))[..6], "c50100");
        assert_eq!(&enc(|w| w.write_bin(&[0; 65536]))[..10], "c600010000");
        assert_eq!(enc(|w| w.write_array_len(15)), "9f");
        assert_eq!(enc(|w| w.write_array_len(16)), "dc0010");
        assert_eq!(enc(|w| w.write_array_len(65536)), "dd00010000");
        assert_eq!(enc(|w| w.write_map_len(15)), "8f");
        assert_eq!(enc(|w| w.write_map_len(16)), "de0010");
        assert_eq!(enc(|w| w.write_map_len(65536)), "df00010000");
    }

    #[test]
    fn ext_forms() {
        assert_eq!(enc(|w| w.write_ext(1, &[9])), "d40109");
        assert_eq!(&enc(|w| w.write_ext(1, &[9; 2]))[..4], "d501");
        assert_eq!(&enc(|w| w.write_ext(1, &[9; 4]))[..4], "d601");
        assert_eq!(&enc(|w| w.write_ext(1, &[9; 8]))[..4], "d701");
        assert_eq!(&enc(|w| w.write_ext(1, &[9; 16]))[..4], "d801");
        assert_eq!(enc(|w| w.write_ext(-3, &[9; 3])), "c703fd090909");
        assert_eq!(&enc(|w| w.write_ext(1, &[]))[..6], "c70001");
        assert_eq!(&enc(|w| w.write_ext(1, &[0; 300]))[..8], "c8012c01");
        assert_eq!(&enc(|w| w.write_ext(1, &[0; 70000]))[..12], "c90001117001");
        for n in [0usize, 1, 2, 3, 4, 8, 16, 17, 300, 70000] {
            let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let mut w = Writer::new();
            w.write_ext(-7, &data);
            let bytes = w.into_vec();
            let mut r = Reader::new(&bytes);
            let (code, got) = r.read_ext().unwrap();
            assert_eq!((code, got), (-7, &data[..]));
            r.finish().unwrap();
        }
    }

    #[test]
    fn value_round_trip() {
        let v = Value::Map(vec![
            (
                Value::Str("a".into()),
                Value::Array(vec![Value::Int(-33), Value::UInt(u64::MAX), Value::Nil]),
            ),
            (Value::Int(7), Value::Bin(vec![1, 2, 3])),
            (Value::Str("f".into()), Value::F64(-0.25)),
            (Value::Str("e".into()), Value::Ext(1, vec![0x80])),
            (Value::Bool(false), Value::Str("é".repeat(40))),
        ]);
        let bytes = encode_value(&v);
        assert_eq!(decode_value(&bytes).unwrap(), v);
        let mut r = Reader::new(&bytes);
        r.skip_value().unwrap();
        r.finish().unwrap();
        assert_eq!(v.get("f"), Some(&Value::F64(-0.25)));
    }

    #[test]
    fn f64_accepts_ints_and_float32() {
        assert_eq!(Reader::new(&[0x05]).read_f64().unwrap(), 5.0);
        assert_eq!(Reader::new(&[0xd0, 0xfb]).read_f64().unwrap(), -5.0);
        assert_eq!(
            Reader::new(&[0xca, 0x3f, 0xc0, 0, 0]).read_f64().unwrap(),
            1.5
        );
        assert!(matches!(
            Reader::new(&[0xc3]).read_f64(),
            Err(DecodeError::TypeMismatch {
                found: Kind::Bool,
                ..
            })
        ));
    }

    #[test]
    fn strictness_between_kinds() {
        assert!(matches!(
            Reader::new(&[0xc3]).read_int(),
            Err(DecodeError::TypeMismatch {
                expected: "int64",
                found: Kind::Bool,
                ..
            })
        ));
        assert!(matches!(
            Reader::new(&[0x01]).read_bool(),
            Err(DecodeError::TypeMismatch {
                found: Kind::Int,
                ..
            })
        ));
        assert!(matches!(
            Reader::new(&[0xc4, 0x01, b'a']).read_str(),
            Err(DecodeError::TypeMismatch {
                found: Kind::Bin,
                ..
            })
        ));
        assert!(matches!(
            Reader::new(&[0xcb, 0, 0, 0, 0, 0, 0, 0, 0]).read_int(),
            Err(DecodeError::TypeMismatch {
                found: Kind::Float,
                ..
            })
        ));
        assert!(matches!(
            Reader::new(&[0xa2, 0xff, 0xfe]).read_str(),
            Err(DecodeError::InvalidUtf8 { .. })
        ));
        assert!(matches!(
            Reader::new(&[0xc1]).read_value(),
            Err(DecodeError::ReservedByte { offset: 0 })
        ));
    }

    #[test]
    fn truncated_inputs_are_errors() {
        let full = encode_value(&Value::Array(vec![
            Value::Str("hello".into()),
            Value::Int(70000),
            Value::F64(2.0),
            Value::Bin(vec![1; 20]),
            Value::Ext(1, vec![2; 20]),
        ]));
        for cut in 0..full.len() {
            let err = decode_value(&full[..cut]).unwrap_err();
            assert!(
                matches!(
                    err,
                    DecodeError::Truncated { .. } | DecodeError::LengthTooLarge { .. }
                ),
                "cut at {cut}: {err}"
            );
        }
        assert!(matches!(
            Reader::new(&[]).read_int(),
            Err(DecodeError::Truncated { offset: 0, .. })
        ));
    }

    #[test]
    fn trailing_bytes_are_errors() {
        assert_eq!(
            decode_value(&[0x01, 0x02]),
            Err(DecodeError::TrailingBytes {
                offset: 1,
                remaining: 1
            })
        );
    }

    #[test]
    fn huge_declared_lengths_are_rejected_before_allocating() {
        // Each claims ~4 GiB inside a tiny frame.
        let cases: &[(&[u8], Kind)] = &[
            (&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02], Kind::Array),
            (&[0xdf, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02], Kind::Map),
            (&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'], Kind::Str),
            (&[0xc6, 0xff, 0xff, 0xff, 0xff, 0x00], Kind::Bin),
            (&[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01, 0x00], Kind::Ext),
        ];
        for (bytes, kind) in cases {
            let err = decode_value(bytes).unwrap_err();
            assert!(
                matches!(err, DecodeError::LengthTooLarge { offset: 0, kind: k, declared: 0xffff_ffff, .. } if k == *kind),
                "{kind}: {err}"
            );
            assert!(Reader::new(bytes).skip_value().is_err());
        }
        // A map of n entries needs 2n bytes, not n.
        assert!(matches!(
            Reader::new(&[0x82, 0x01, 0x02, 0x03]).read_map_len(),
            Err(DecodeError::LengthTooLarge {
                kind: Kind::Map,
                declared: 2,
                remaining: 3,
                ..
            })
        ));
    }

    #[test]
    fn nesting_is_bounded() {
        let ok: Vec<u8> = std::iter::repeat_n(0x91, MAX_DEPTH).chain([0xc0]).collect();
        decode_value(&ok).unwrap();
        let deep: Vec<u8> = std::iter::repeat_n(0x91, MAX_DEPTH + 1)
            .chain([0xc0])
            .collect();
        assert!(matches!(
            decode_value(&deep),
            Err(DecodeError::DepthExceeded {
                offset: 64,
                limit: 64
            })
        ));
        assert!(matches!(
            Reader::new(&deep).skip_value(),
            Err(DecodeError::DepthExceeded { .. })
        ));
        let deep_maps: Vec<u8> = std::iter::repeat_n([0x81, 0x00], MAX_DEPTH + 1)
            .flatten()
            .chain([0xc0])
            .collect();
        assert!(matches!(
            decode_value(&deep_maps),
            Err(DecodeError::DepthExceeded { .. })
        ));
    }

    #[test]
    fn error_paths_compose() {
        let e = DecodeError::InvalidUtf8 { offset: 3 }
            .at_index(2)
            .at("token_ids")
            .at("key");
        assert_eq!(e.path(), "key.token_ids[2]");
        assert_eq!(e.root(), &DecodeError::InvalidUtf8 { offset: 3 });
        assert_eq!(
            e.to_string(),
            "at `key.token_ids[2]`: str at byte 3 is not valid UTF-8"
        );
    }

    #[test]
    fn nested_reader_reports_outer_offsets() {
        let inner = [0x00, 0xc3];
        let mut r = Reader::nested(&inner, 100);
        r.read_int().unwrap();
        assert_eq!(r.offset(), 101);
        assert!(matches!(
            r.read_int(),
            Err(DecodeError::TypeMismatch { offset: 101, .. })
        ));
    }

    #[test]
    fn peek_and_is_nil() {
        let r = Reader::new(&[0xc0]);
        assert!(r.is_nil());
        assert_eq!(r.peek_kind().unwrap(), Kind::Nil);
        assert!(!Reader::new(&[]).is_nil());
        assert_eq!(
            Reader::new(&[0xd6, 1, 0, 0, 0, 0]).peek_kind().unwrap(),
            Kind::Ext
        );
        assert_eq!(Reader::new(&[0xe5]).peek_kind().unwrap(), Kind::Int);
    }
}
