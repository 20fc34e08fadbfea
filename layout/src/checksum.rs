//! `/cache/checksums`: what 0.5.6 checks before it reads a worker's blocks,
//! the bytes it hashes and the report it answers.

use md5::{Digest, Md5};
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};

use kvshard_wire::hex;

use crate::format::{KvDtype, KvFormat};

/// A `/cache/checksums` request refused: the HTTP status 0.5.6 answers it
/// with (400 for a malformed request, 501 for a KV format it does not
/// checksum) and the detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChecksumRefusal {
    pub status: u16,
    pub detail: String,
}

impl ChecksumRefusal {
    pub fn bad_request(detail: impl Into<String>) -> Self {
        ChecksumRefusal {
            status: 400,
            detail: detail.into(),
        }
    }
}

/// What 0.5.6's `/cache/checksums` checks before it reads a block of a
/// worker whose layers are in `format`: block ids given, a positive chunk
/// size, a format it checksums. Returns the block axis to gather along.
pub fn checksum_axis(
    format: KvFormat,
    block_ids: &[i64],
    chunk_size_blocks: usize,
) -> Result<usize, ChecksumRefusal> {
    if block_ids.is_empty() {
        return Err(ChecksumRefusal::bad_request("block_ids is required"));
    }
    if chunk_size_blocks == 0 {
        return Err(ChecksumRefusal::bad_request("chunk_size must be positive"));
    }
    format.checksum_block_axis().ok_or_else(|| ChecksumRefusal {
        status: 501,
        detail: format!("checksum not supported for GPU KV format {}", format.name()),
    })
}

/// The bytes of `tensor.index_select(axis, indices)` in C order, as runs of
/// the innermost dimension: `run(byte offset from the tensor's first
/// element, bytes)` for each, in order. `shape` and `strides` (elements) are
/// a layer's normalised ones, innermost stride 1; `indices` is not empty.
pub fn index_select_runs(
    shape: &[usize],
    strides: &[usize],
    es: usize,
    axis: usize,
    indices: &[usize],
    mut run: impl FnMut(usize, usize),
) {
    let inner = shape.len() - 1;
    debug_assert!(axis < inner && strides[inner] == 1 && !indices.is_empty());
    let run_bytes = shape[inner] * es;
    let mut dims = shape.to_vec();
    dims[axis] = indices.len();
    let mut index = vec![0usize; inner];
    loop {
        let mut elem = 0;
        for d in 0..inner {
            let i = if d == axis {
                indices[index[d]]
            } else {
                index[d]
            };
            elem += i * strides[d];
        }
        run(elem * es, run_bytes);
        // Odometer over every dim but the innermost.
        let mut d = inner;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < dims[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// The digests of a `/cache/checksums` request, added chunk by chunk, and the
/// report they make: one MD5 per chunk over every layer in order, or with
/// `layerwise` one per chunk and layer.
pub struct ChecksumDigests {
    layers: usize,
    layerwise: bool,
    /// One list per layer (layerwise), else one list.
    digests: Vec<Vec<String>>,
}

impl ChecksumDigests {
    pub fn new(layers: usize, layerwise: bool) -> Self {
        let lists = if layerwise { layers } else { 1 };
        Self {
            layers,
            layerwise,
            digests: vec![Vec::new(); lists],
        }
    }

    /// Adds the next chunk: `feed(layer, md5)` hashes that layer's bytes of
    /// the chunk into `md5`.
    pub fn push_chunk(&mut self, mut feed: impl FnMut(usize, &mut Md5)) {
        if self.layerwise {
            for (layer, digests) in self.digests.iter_mut().enumerate() {
                let mut md5 = Md5::new();
                feed(layer, &mut md5);
                digests.push(hex(&md5.finalize()));
            }
        } else {
            let mut md5 = Md5::new();
            for layer in 0..self.layers {
                feed(layer, &mut md5);
            }
            self.digests[0].push(hex(&md5.finalize()));
        }
    }

    /// The 200 body for `block_ids` in chunks of `chunk_size_blocks`.
    pub fn report(self, block_ids: &[i64], chunk_size_blocks: usize) -> ChecksumReport {
        let chunk_checksums = if self.layerwise {
            ChunkChecksums::PerLayer(
                self.digests
                    .into_iter()
                    .enumerate()
                    .map(|(i, d)| (format!("layer_{i}"), d))
                    .collect(),
            )
        } else {
            ChunkChecksums::Aggregated(self.digests.into_iter().next().unwrap_or_default())
        };
        ChecksumReport {
            status: "success".to_string(),
            chunk_size: chunk_size_blocks,
            num_chunks: block_ids.len().div_ceil(chunk_size_blocks),
            chunk_checksums,
            layerwise: self.layerwise,
            block_id_ranges: compress_block_ids(block_ids),
        }
    }
}

/// Feeds KV bytes to a checksum as 0.5.6 hashes them: bfloat16 widened to
/// float32 (exact: the bits move to the high half), other dtypes as they are.
pub fn digest_kv(md5: &mut Md5, bytes: &[u8], dtype: KvDtype) {
    if dtype == KvDtype::BFloat16 {
        for pair in bytes.chunks_exact(2) {
            let bits = (u16::from_le_bytes([pair[0], pair[1]]) as u32) << 16;
            md5.update(bits.to_le_bytes());
        }
    } else {
        md5.update(bytes);
    }
}

/// The 200 body of `POST /cache/checksums`, fields in 0.5.6's order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChecksumReport {
    /// Always `"success"`.
    pub status: String,
    /// Blocks per chunk, echoed from the request.
    pub chunk_size: usize,
    pub num_chunks: usize,
    pub chunk_checksums: ChunkChecksums,
    pub layerwise: bool,
    pub block_id_ranges: Vec<BlockIdRange>,
}

/// Digests: a list (aggregated) or an ordered `{"layer_<i>": [...]}` map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChunkChecksums {
    Aggregated(Vec<String>),
    PerLayer(Vec<(String, Vec<String>)>),
}

impl Serialize for ChunkChecksums {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ChunkChecksums::Aggregated(digests) => {
                let mut seq = serializer.serialize_seq(Some(digests.len()))?;
                for d in digests {
                    seq.serialize_element(d)?;
                }
                seq.end()
            }
            // Emitted in layer order, like a Python dict.
            ChunkChecksums::PerLayer(layers) => {
                let mut map = serializer.serialize_map(Some(layers.len()))?;
                for (name, digests) in layers {
                    map.serialize_entry(name, digests)?;
                }
                map.end()
            }
        }
    }
}

/// One entry of `block_id_ranges`: a lone id, or `[start, end]` (inclusive)
/// for a run of 3 or more ids ascending by one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum BlockIdRange {
    Single(i64),
    Range([i64; 2]),
}

/// 0.5.6 `compress_slot_mapping`: order-preserving run compression.
pub fn compress_block_ids(ids: &[i64]) -> Vec<BlockIdRange> {
    let mut out = Vec::new();
    let push = |start: i64, end: i64, out: &mut Vec<BlockIdRange>| {
        if end - start >= 2 {
            out.push(BlockIdRange::Range([start, end]));
        } else {
            out.extend((start..=end).map(BlockIdRange::Single));
        }
    };
    let Some((&first, rest)) = ids.split_first() else {
        return out;
    };
    let (mut start, mut end) = (first, first);
    for &id in rest {
        if end.checked_add(1) == Some(id) {
            end = id;
        } else {
            push(start, end, &mut out);
            start = id;
            end = id;
        }
    }
    push(start, end, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_id_ranges_compress_like_0_5_6() {
        let json = |ids: &[i64]| serde_json::to_string(&compress_block_ids(ids)).unwrap();
        assert_eq!(json(&[1, 2, 3, 4, 5, 9, 10, 11, 12]), "[[1,5],[9,12]]");
        assert_eq!(json(&[5, 3, 1, 2, 4]), "[5,3,1,2,4]");
        assert_eq!(json(&[1, 2, 3, 4, 5, 7, 8]), "[[1,5],7,8]");
        assert_eq!(json(&[7]), "[7]");
        assert_eq!(json(&[]), "[]");
        assert_eq!(
            json(&[i64::MAX - 1, i64::MAX, 0]),
            format!("[{},{},0]", i64::MAX - 1, i64::MAX)
        );
    }
}
