//! Element types and the per-layer paged formats of vLLM's KV tensors, and
//! 0.5.6's detector that tells one from a tensor's shape and strides.

use crate::error::{unsupported, DetectError};
use crate::stride::EngineKvFormat;

/// Element types a KV tensor may have (torch names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    Float16,
    BFloat16,
    Float32,
    Float64,
    Float8E4m3fn,
    Float8E4m3fnuz,
    Float8E5m2,
    Float8E5m2fnuz,
    Uint8,
    Int8,
    Int16,
    Int32,
    Int64,
}

impl KvDtype {
    /// Parse a torch dtype name; a `torch.` prefix is tolerated.
    pub fn parse(name: &str) -> Result<KvDtype, DetectError> {
        let bare = name.strip_prefix("torch.").unwrap_or(name);
        Ok(match bare {
            "float16" => KvDtype::Float16,
            "bfloat16" => KvDtype::BFloat16,
            "float32" => KvDtype::Float32,
            "float64" => KvDtype::Float64,
            "float8_e4m3fn" => KvDtype::Float8E4m3fn,
            "float8_e4m3fnuz" => KvDtype::Float8E4m3fnuz,
            "float8_e5m2" => KvDtype::Float8E5m2,
            "float8_e5m2fnuz" => KvDtype::Float8E5m2fnuz,
            "uint8" => KvDtype::Uint8,
            "int8" => KvDtype::Int8,
            "int16" => KvDtype::Int16,
            "int32" => KvDtype::Int32,
            "int64" => KvDtype::Int64,
            _ => return Err(unsupported(format!("KV dtype '{name}'"))),
        })
    }

    /// The torch name without `torch.`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Float16 => "float16",
            KvDtype::BFloat16 => "bfloat16",
            KvDtype::Float32 => "float32",
            KvDtype::Float64 => "float64",
            KvDtype::Float8E4m3fn => "float8_e4m3fn",
            KvDtype::Float8E4m3fnuz => "float8_e4m3fnuz",
            KvDtype::Float8E5m2 => "float8_e5m2",
            KvDtype::Float8E5m2fnuz => "float8_e5m2fnuz",
            KvDtype::Uint8 => "uint8",
            KvDtype::Int8 => "int8",
            KvDtype::Int16 => "int16",
            KvDtype::Int32 => "int32",
            KvDtype::Int64 => "int64",
        }
    }

    /// Bytes per element, from the torch dtype table of the wire crate.
    pub fn size_bytes(self) -> usize {
        kvshard_wire::dtype_itemsize(self.name()).expect("every KV dtype is a torch dtype") as usize
    }
}

/// The per-layer paged layouts of vLLM that this path transfers (0.5.6's
/// `EngineKVFormat` names; shapes are after stride-order normalisation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvFormat {
    /// `[2, NB, BS, NH, HS]`: vLLM flash attention, NHD.
    TwoNbBsNhHs,
    /// `[2, NB, NH, BS, HS]`: vLLM flash attention, HND.
    TwoNbNhBsHs,
    /// `[NB, 2, BS, NH, HS]`: FlashInfer, NHD.
    NbTwoBsNhHs,
    /// `[NB, 2, NH, BS, HS]`: FlashInfer, HND.
    NbTwoNhBsHs,
    /// `[NB, BS, HS]`: MLA latent cache (kv_size 1).
    NbBsHs,
    /// `[NB, BS, NH, CS]`: fused K/V per head (kv_size 1), NHD.
    NbBsNhCs,
    /// `[NB, NH, BS, CS]`: fused K/V per head (kv_size 1), HND.
    NbNhBsCs,
}

/// Axis positions of one format inside the normalised shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FormatAxes {
    /// The K/V plane axis; none for one-plane formats.
    pub plane: Option<usize>,
    pub block: usize,
    pub token: usize,
    /// The head axis; none for MLA (one head).
    pub head: Option<usize>,
    /// The innermost axis: head elements (or the fused K/V content).
    pub elem: usize,
}

impl KvFormat {
    /// 0.5.6's `EngineKVFormat` member name.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::TwoNbBsNhHs => "NL_X_TWO_NB_BS_NH_HS",
            KvFormat::TwoNbNhBsHs => "NL_X_TWO_NB_NH_BS_HS",
            KvFormat::NbTwoBsNhHs => "NL_X_NB_TWO_BS_NH_HS",
            KvFormat::NbTwoNhBsHs => "NL_X_NB_TWO_NH_BS_HS",
            KvFormat::NbBsHs => "NL_X_NB_BS_HS",
            KvFormat::NbBsNhCs => "NL_X_NB_BS_NH_CS",
            KvFormat::NbNhBsCs => "NL_X_NB_NH_BS_CS",
        }
    }

    /// The kernel's `EngineKVFormat` of this per-layer format (its wire value).
    pub fn engine_format(self) -> EngineKvFormat {
        match self {
            KvFormat::TwoNbBsNhHs => EngineKvFormat::NL_X_TWO_NB_BS_NH_HS,
            KvFormat::NbTwoBsNhHs => EngineKvFormat::NL_X_NB_TWO_BS_NH_HS,
            KvFormat::NbBsHs => EngineKvFormat::NL_X_NB_BS_HS,
            KvFormat::TwoNbNhBsHs => EngineKvFormat::NL_X_TWO_NB_NH_BS_HS,
            KvFormat::NbTwoNhBsHs => EngineKvFormat::NL_X_NB_TWO_NH_BS_HS,
            KvFormat::NbNhBsCs => EngineKvFormat::NL_X_NB_NH_BS_CS,
            KvFormat::NbBsNhCs => EngineKvFormat::NL_X_NB_BS_NH_CS,
        }
    }

    pub fn is_mla(self) -> bool {
        self == KvFormat::NbBsHs
    }

    /// 0.5.6's symbolic shape of the format, read off its name:
    /// `NL_X_TWO_NB_BS_NH_HS` is `NL x [2, NB, BS, NH, HS]`.
    pub fn shape_description(self) -> String {
        self.render_shape(|label| label.to_string())
    }

    /// The shape with a worker's sizes in it, e.g. `32 x [2, 2048, 16, 8, 128]`
    /// (`elems` is the innermost axis: HS, or CS of a fused K/V format, for
    /// which 0.5.6 itself prints "Unknown").
    pub fn concrete_shape(
        self,
        layers: usize,
        blocks: usize,
        block_size: usize,
        heads: usize,
        elems: usize,
    ) -> String {
        self.render_shape(|label| match label {
            "NL" => layers.to_string(),
            "NB" => blocks.to_string(),
            "BS" => block_size.to_string(),
            "NH" => heads.to_string(),
            _ => elems.to_string(),
        })
    }

    /// `NL_X_<inner>`: the list levels, then the bracketed tensor axes.
    fn render_shape(self, size: impl Fn(&str) -> String) -> String {
        let label = |t: &str| match t {
            "TWO" => "2".to_string(),
            t => size(t),
        };
        let mut levels: Vec<&str> = self.name().split("_X_").collect();
        let inner = levels.pop().expect("a format name has an inner shape");
        let body: Vec<String> = inner.split('_').map(label).collect();
        let mut parts: Vec<String> = levels.into_iter().map(label).collect();
        parts.push(format!("[{}]", body.join(", ")));
        parts.join(" x ")
    }

    /// The attention backend 0.5.6 names as the format's usual producer.
    pub fn attention_backend(self) -> &'static str {
        match self {
            KvFormat::TwoNbBsNhHs => "vLLM non-MLA flash attention",
            KvFormat::TwoNbNhBsHs => "vLLM non-MLA flash attention (HND layout)",
            KvFormat::NbTwoBsNhHs => "vLLM non-MLA flash infer",
            KvFormat::NbTwoNhBsHs => "vLLM non-MLA flash infer (HND layout)",
            KvFormat::NbBsHs => "vLLM MLA / SGLang MLA (MP)",
            KvFormat::NbBsNhCs => "vLLM non-MLA blocks-first, fused K/V (NHD)",
            KvFormat::NbNhBsCs => "vLLM non-MLA blocks-first, fused K/V (HND)",
        }
    }

    /// Planes per object: 2 (K, V) or 1 (MLA latent, fused K/V).
    pub fn kv_size(self) -> usize {
        if self.axes().plane.is_some() {
            2
        } else {
            1
        }
    }

    /// The block axis `/cache/checksums` gathers along; `None` where 0.5.6
    /// declines the format (501).
    pub fn checksum_block_axis(self) -> Option<usize> {
        match self {
            KvFormat::TwoNbBsNhHs | KvFormat::TwoNbNhBsHs => Some(1),
            KvFormat::NbTwoBsNhHs | KvFormat::NbTwoNhBsHs | KvFormat::NbBsHs => Some(0),
            KvFormat::NbBsNhCs | KvFormat::NbNhBsCs => None,
        }
    }

    /// Where the format's axes sit in the normalised shape.
    pub fn axes(self) -> FormatAxes {
        let (plane, block, token, head, elem) = match self {
            KvFormat::TwoNbBsNhHs => (Some(0), 1, 2, Some(3), 4),
            KvFormat::TwoNbNhBsHs => (Some(0), 1, 3, Some(2), 4),
            KvFormat::NbTwoBsNhHs => (Some(1), 0, 2, Some(3), 4),
            KvFormat::NbTwoNhBsHs => (Some(1), 0, 3, Some(2), 4),
            KvFormat::NbBsHs => (None, 0, 1, None, 2),
            KvFormat::NbBsNhCs => (None, 0, 1, Some(2), 3),
            KvFormat::NbNhBsCs => (None, 0, 2, Some(1), 3),
        };
        FormatAxes {
            plane,
            block,
            token,
            head,
            elem,
        }
    }
}

/// The `kv_layout` 0.5.6 assumes when a registration carries no hint: vLLM's
/// detector picks HND on a server without an accelerator, NHD otherwise.
pub fn default_kv_layout(server_has_accelerator: bool) -> &'static str {
    if server_has_accelerator {
        "NHD"
    } else {
        "HND"
    }
}

/// 0.5.6 `attempt_permute_to_contiguous_view`: reorder dims by stride,
/// largest first, a size-1 dim placed innermost among equal strides.
pub(crate) fn normalise_dims(shape: &[usize], strides: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let mut perm: Vec<usize> = (0..shape.len()).collect();
    // Stable sort on the reversed key keeps the input order of ties, like
    // Python's sorted(..., reverse=True).
    perm.sort_by(|&a, &b| {
        let key = |i: usize| (strides[i], shape[i] != 1);
        key(b).cmp(&key(a))
    });
    (
        perm.iter().map(|&i| shape[i]).collect(),
        perm.iter().map(|&i| strides[i]).collect(),
    )
}

/// 0.5.6's vLLM detector on a normalised per-layer shape.
pub(crate) fn detect_format(
    shape: &[usize],
    dtype: KvDtype,
    is_hnd: bool,
) -> Result<KvFormat, DetectError> {
    // The fp8 DSA indexer cache: 128 fp8 values + one fp32 scale per row.
    let indexer = dtype == KvDtype::Uint8 && shape.last() == Some(&132);
    match shape.len() {
        4 => {
            let head_axis = if is_hnd { 1 } else { 2 };
            if shape[head_axis] == 1 && indexer {
                return Err(unsupported(
                    "the blocked fp8 indexer cache (NL_X_NB_BSV_BSS)".to_string(),
                ));
            }
            Ok(if is_hnd {
                KvFormat::NbNhBsCs
            } else {
                KvFormat::NbBsNhCs
            })
        }
        3 => {
            if indexer {
                return Err(unsupported(
                    "the blocked fp8 indexer cache (NL_X_NB_BSV_BSS)".to_string(),
                ));
            }
            Ok(KvFormat::NbBsHs)
        }
        5 if shape[0] == 2 => Ok(if is_hnd {
            KvFormat::TwoNbNhBsHs
        } else {
            KvFormat::TwoNbBsNhHs
        }),
        5 if shape[1] == 2 => Ok(if is_hnd {
            KvFormat::NbTwoNhBsHs
        } else {
            KvFormat::NbTwoBsNhHs
        }),
        _ => Err(unsupported(format!(
            "per-layer KV tensor shape {shape:?} matches no vLLM layout this server \
             transfers (NL x [2,NB,BS,NH,HS], [NB,2,BS,NH,HS], their HND forms, \
             MLA [NB,BS,HS], fused [NB,BS,NH,CS])"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kv_dtype_has_a_torch_itemsize() {
        for name in [
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "uint8",
            "int8",
            "int16",
            "int32",
            "int64",
        ] {
            let d = KvDtype::parse(name).unwrap();
            assert_eq!(d.name(), name);
            assert!(matches!(d.size_bytes(), 1 | 2 | 4 | 8), "{name}");
        }
        assert_eq!(KvDtype::parse("torch.bfloat16").unwrap().size_bytes(), 2);
    }

    #[test]
    fn format_shapes_read_as_0_5_6_prints_them() {
        assert_eq!(
            KvFormat::TwoNbBsNhHs.shape_description(),
            "NL x [2, NB, BS, NH, HS]"
        );
        assert_eq!(KvFormat::NbBsHs.shape_description(), "NL x [NB, BS, HS]");
        assert_eq!(
            KvFormat::TwoNbBsNhHs.concrete_shape(4, 65, 16, 4, 64),
            "4 x [2, 65, 16, 4, 64]"
        );
        assert_eq!(
            KvFormat::NbTwoNhBsHs.concrete_shape(32, 2048, 16, 8, 128),
            "32 x [2048, 2, 8, 16, 128]"
        );
        assert_eq!(
            KvFormat::NbBsNhCs.concrete_shape(2, 8, 16, 2, 64),
            "2 x [8, 16, 2, 64]"
        );
    }

    #[test]
    fn each_detected_format_is_the_kernel_format_of_the_same_name() {
        for f in [
            KvFormat::TwoNbBsNhHs,
            KvFormat::TwoNbNhBsHs,
            KvFormat::NbTwoBsNhHs,
            KvFormat::NbTwoNhBsHs,
            KvFormat::NbBsHs,
            KvFormat::NbBsNhCs,
            KvFormat::NbNhBsCs,
        ] {
            assert_eq!(f.engine_format().name(), f.name());
        }
    }
}
