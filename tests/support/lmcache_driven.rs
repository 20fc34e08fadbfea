//! lmcache_driven workers: CPU SHM layer registrations, transfer replies,
//! the refused GPU instances, and paged KV layers.

use super::*;

/// One lmcache_driven (cpu_shm) KV layer: vLLM NHD `[2, 8 blocks, 16 tokens,
/// 2 heads, 32]` float16, contiguous.
pub const LM_LAYER_SHAPE: [i64; 5] = [2, 8, 16, 2, 32];
pub const LM_LAYER_STRIDE: [i64; 5] = [8 * 16 * 64, 16 * 64, 64, 32, 1];
pub const LM_LAYER_BYTES: i64 = 2 * 8 * 16 * 64 * 2;

/// `register_kv_cache` payloads: instance `iid` of vLLM model `model` at
/// `world_size`, its tensors' descriptors, the `kv_layout` hint and its
/// `EngineGroupInfo`s.
pub fn register_kv_cache_frames(
    iid: i64,
    descs: Vec<V>,
    model: &str,
    world_size: i64,
    kv_layout: &str,
    groups: Vec<V>,
) -> Vec<V> {
    vec![
        V::I(iid),
        V::A(descs),
        s(model),
        V::I(world_size),
        s("vllm"),
        map(&[("kv_layout", s(kv_layout))]),
        V::A(groups),
    ]
}

/// `register_kv_cache` payloads for instance `iid` of model "lm" (world size
/// 1, vLLM, NHD) with one layer described by `desc`.
pub fn lm_register_frames(iid: i64, desc: V) -> Vec<V> {
    register_kv_cache_frames(iid, vec![desc], "lm", 1, "NHD", vec![])
}

/// A fresh lmcache_driven layer segment of the `LM_LAYER_*` geometry and its
/// cpu_shm descriptor (the segment lives as long as the returned map).
pub fn lm_layer(prefix: &str) -> (ShmMap, V) {
    let seg = unique(prefix);
    let map = ShmMap::create(&seg, LM_LAYER_BYTES as usize);
    let desc = cpu_shm_wrapper(
        &format!("/{seg}"),
        LM_LAYER_BYTES,
        "float16",
        &LM_LAYER_SHAPE,
        &LM_LAYER_STRIDE,
    );
    (map, desc)
}

// ------------------------------------------ lmcache_driven helpers

/// The block ids of one KV group, as STORE and RETRIEVE carry them.
pub fn group_ids(v: &[i64]) -> V {
    V::A(vec![V::A(v.iter().map(|x| V::I(*x)).collect())])
}

/// STORE/RETRIEVE's `(event, ok)` reply.
pub fn transfer_outcome(reply: Option<V>) -> (Vec<u8>, bool) {
    match reply {
        Some(V::A(a)) if a.len() == 2 => match &a[0] {
            V::Bin(b) => (b.clone(), a[1].boolean()),
            other => panic!("event is not bytes: {other:?}"),
        },
        other => panic!("expected (bytes, bool), got {other:?}"),
    }
}

/// lmcache 0.5.6's timeline-semaphore event (`!B64sQQ`, `--isolated-ipc`):
/// version 1, the semaphore buffer's 64-byte handle (zero-padded), the
/// slot's byte offset and the sequence, big-endian.
pub fn timeline_event(handle: &[u8], slot_offset: u64, seq: u64) -> Vec<u8> {
    assert!(handle.len() <= 64, "a handle is 64 bytes");
    let mut ev = vec![1u8];
    ev.extend_from_slice(handle);
    ev.resize(65, 0);
    ev.extend_from_slice(&slot_offset.to_be_bytes());
    ev.extend_from_slice(&seq.to_be_bytes());
    ev
}

/// An 81-byte timeline-semaphore event's (handle, slot offset, seq).
pub fn parse_timeline(ev: &[u8]) -> (Vec<u8>, u64, u64) {
    assert_eq!(ev.len(), 81, "{ev:?}");
    assert_eq!(ev[0], 1, "version");
    let be = |at: usize| u64::from_be_bytes(ev[at..at + 8].try_into().unwrap());
    (ev[1..65].to_vec(), be(65), be(73))
}

/// `/status`'s `registered_gpu_ids`.
pub fn registered_gpu_ids(srv: &Server) -> Vec<i64> {
    srv.get_json("/status")["registered_gpu_ids"]
        .as_array()
        .expect("registered_gpu_ids")
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// Why instance `iid` is listed in `/status`'s `refused_gpu_instances`, if it is.
pub fn refused_gpu_reason(srv: &Server, iid: i64) -> Option<String> {
    srv.get_json("/status")["refused_gpu_instances"]
        .as_array()?
        .iter()
        .find(|e| e["instance_id"] == iid)
        .map(|e| e["reason"].as_str().unwrap_or("").to_string())
}

// ------------------------------------------------------------------ paged KV layers

/// How a vLLM worker lays out one layer's paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// `[2, blocks, block_tokens, heads, head_size]`, contiguous (FlashAttention, NHD).
    Nhd,
    /// Same logical dims, heads outside slots in memory (`[2, blocks, heads, block_tokens, head_size]`).
    Hnd,
    /// `[blocks, block_tokens, mla_dim]` (fused latent K/V).
    Mla,
}

/// One layer of a worker's paged KV cache: its layout and sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedKv {
    pub layout: Layout,
    pub blocks: usize,
    pub block_tokens: usize,
    pub heads: usize,
    pub head_size: usize,
    pub mla_dim: usize,
    /// Bytes per element.
    pub elem: usize,
}

impl PagedKv {
    pub const fn with(self, layout: Layout) -> PagedKv {
        PagedKv { layout, ..self }
    }

    pub fn planes(self) -> usize {
        if self.layout == Layout::Mla {
            1
        } else {
            2
        }
    }

    /// Bytes of one token in the object (all heads).
    pub fn row(self) -> usize {
        match self.layout {
            Layout::Mla => self.mla_dim * self.elem,
            _ => self.heads * self.head_size * self.elem,
        }
    }

    /// Bytes of one (plane, block): contiguous in every layout here.
    pub fn block(self) -> usize {
        self.block_tokens * self.row()
    }

    pub fn layer_bytes(self) -> usize {
        self.planes() * self.blocks * self.block()
    }

    /// The `kv_layout` hint a worker sends.
    pub fn hint(self) -> &'static str {
        match self.layout {
            Layout::Hnd => "HND",
            _ => "NHD",
        }
    }

    /// The logical shape and element strides a worker reports.
    pub fn shape_stride(self) -> (Vec<i64>, Vec<i64>) {
        let [nb, bs, nh, hs, md] = [
            self.blocks,
            self.block_tokens,
            self.heads,
            self.head_size,
            self.mla_dim,
        ]
        .map(|d| d as i64);
        match self.layout {
            Layout::Nhd => (
                vec![2, nb, bs, nh, hs],
                vec![nb * bs * nh * hs, bs * nh * hs, nh * hs, hs, 1],
            ),
            Layout::Hnd => (
                vec![2, nb, bs, nh, hs],
                vec![nb * nh * bs * hs, nh * bs * hs, hs, bs * hs, 1],
            ),
            Layout::Mla => (vec![nb, bs, md], vec![bs * md, md, 1]),
        }
    }

    /// Byte range of (plane, block) in a layer.
    pub fn block_range(self, plane: usize, block: usize) -> std::ops::Range<usize> {
        let off = (plane * self.blocks + block) * self.block();
        off..off + self.block()
    }

    /// One token's row as the object stores it: heads, then head elements.
    pub fn token_row(self, layer: &[u8], plane: usize, block: usize, slot: usize) -> Vec<u8> {
        let base = self.block_range(plane, block).start;
        match self.layout {
            Layout::Hnd => (0..self.heads)
                .flat_map(|h| {
                    let off = base + (h * self.block_tokens + slot) * self.head_size * self.elem;
                    layer[off..off + self.head_size * self.elem].iter().copied()
                })
                .collect(),
            _ => {
                let off = base + slot * self.row();
                layer[off..off + self.row()].to_vec()
            }
        }
    }
}
