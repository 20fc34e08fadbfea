//! The lmcache 0.5.6 gather golden file (`golden/golden_kernel_gather.json`)
//! and the page buffers its generator (make_kernel_golden.py) filled.

use kvshard_layout::stride::{EngineKvFormat, PageBufferShape, StrideTable};
use serde_json::Value;

const GOLDEN: &str = include_str!("../golden/golden_kernel_gather.json");

/// One case of the golden file.
pub struct Case {
    pub name: String,
    pub format: EngineKvFormat,
    pub shape: PageBufferShape,
    pub chunk_slots: u64,
    pub ids: Vec<i64>,
    pub skip: usize,
    pub objects: usize,
    pub sha256: String,
    pub bytes: Vec<u8>,
}

impl Case {
    pub fn table(&self) -> StrideTable {
        StrideTable::new(self.format, &self.shape)
            .unwrap_or_else(|e| panic!("{}: stride table: {e}", self.name))
    }

    pub fn blocks_per_object(&self) -> usize {
        assert_eq!(self.ids.len() % self.objects, 0, "{}", self.name);
        self.ids.len() / self.objects
    }
}

pub fn hex_decode(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0, "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

pub fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex_encode(ring::digest::digest(&ring::digest::SHA256, b).as_ref())
}

/// Every case of the golden file, in the file's order.
pub fn cases() -> Vec<Case> {
    let root: Value = serde_json::from_str(GOLDEN).expect("golden json");
    let obj = root.as_object().expect("object of cases");
    let u = |c: &Value, k: &str| c[k].as_u64().unwrap_or_else(|| panic!("field {k}"));
    obj.iter()
        .map(|(name, c)| {
            let format = EngineKvFormat::from_u32(u(c, "format") as u32).expect("format");
            Case {
                name: name.clone(),
                format,
                shape: PageBufferShape {
                    kv_size: u(c, "kv_size") as u32,
                    nl: u(c, "nl") as u32,
                    nb: u(c, "nb"),
                    bs: u(c, "bs") as u32,
                    nh: u(c, "nh") as u32,
                    hs: u(c, "hs") as u32,
                    // make_kernel_golden.py builds every buffer as int16.
                    element_size: 2,
                    block_stride_elems: u(c, "block_stride_elems"),
                },
                chunk_slots: u(c, "chunk_tokens"),
                ids: c["block_ids"]
                    .as_array()
                    .expect("block_ids")
                    .iter()
                    .map(|v| v.as_i64().expect("id"))
                    .collect(),
                skip: u(c, "skip_prefix_n_blocks") as usize,
                objects: u(c, "objects") as usize,
                sha256: c["sha256"].as_str().expect("sha256").to_string(),
                bytes: hex_decode(c["hex"].as_str().expect("hex")),
            }
        })
        .collect()
}

/// make_kernel_golden.py's `fill`: element `i` of buffer `b` holds
/// `(b * 7919 + i) % 65521` as an int16, little-endian.
pub fn fill(numel: u64, b: u64) -> Vec<u8> {
    (0..numel)
        .flat_map(|i| (((i + b * 7919) % 65521) as u16).to_le_bytes())
        .collect()
}

/// The paged buffers make_kernel_golden.py builds for a case, in kernel
/// pointer order. Padded MLA layers are allocated `[NB, BS*HS + PAD]`.
pub fn golden_paged(c: &Case) -> Vec<Vec<u8>> {
    let s = &c.shape;
    let (nl, nb, bs, nh, hs) = (
        u64::from(s.nl),
        s.nb,
        u64::from(s.bs),
        u64::from(s.nh),
        u64::from(s.hs),
    );
    if matches!(c.format.as_u32(), 0 | 8) {
        return vec![fill(nb * nl * 2 * bs * nh * hs, 0)];
    }
    let per = if s.block_stride_elems != 0 {
        nb * s.block_stride_elems
    } else {
        let planes = if matches!(c.format.as_u32(), 1 | 2 | 6 | 7) {
            2
        } else {
            1
        };
        planes * nb * bs * nh * hs
    };
    (0..nl).map(|l| fill(per, l)).collect()
}
