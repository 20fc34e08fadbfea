//! lmcache 0.5.6's multi-group gathers and scatters
//! (`gds/tests/golden/golden_group_gather.json`, made by 0.5.6's own
//! `transfer_kv_per_object_group` over a `CPUCacheContext`; see
//! `make_group_golden.py` beside it), as the end-to-end tests replay them:
//! a worker of each case's registration stores the case's chunks, and the
//! L1 objects (read back from an fs L2) and the tensors after each retrieve
//! must be 0.5.6's.

use super::*;

const GROUP_GOLDEN: &str = include_str!("../../gds/tests/golden/golden_group_gather.json");
const OG_GOLDEN: &str = include_str!("../../gds/tests/golden/golden_og_gather.json");

fn cases_of(golden: &str) -> Vec<serde_json::Value> {
    let doc: serde_json::Value = serde_json::from_str(golden).expect("golden json");
    doc["cases"].as_array().expect("cases").clone()
}

/// Every case of the golden file.
pub fn group_golden_cases() -> Vec<serde_json::Value> {
    cases_of(GROUP_GOLDEN)
}

/// Every case of `golden_og_gather.json` (`make_og_golden.py`): the same
/// kind of cases, registered with 0.5.6's `--separate-object-groups`, whose
/// kernel groups form several object groups, one object per chunk and group.
pub fn og_golden_cases() -> Vec<serde_json::Value> {
    cases_of(OG_GOLDEN)
}

/// One registered tensor of a case.
pub struct GoldenTensor {
    pub dtype: String,
    pub shape: Vec<i64>,
    pub stride: Vec<i64>,
    pub bytes: usize,
}

pub fn golden_tensors(case: &serde_json::Value) -> Vec<GoldenTensor> {
    case["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| GoldenTensor {
            dtype: t["dtype"].as_str().expect("dtype").to_string(),
            shape: json_ints(&t["shape"]),
            stride: json_ints(&t["stride"]),
            bytes: t["storage_bytes"].as_u64().expect("storage_bytes") as usize,
        })
        .collect()
}

/// Byte `i` of golden tensor `t`'s storage (the inputs of every case).
pub fn golden_fill(bytes: usize, t: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| ((i * 31 + t * 7 + 1) % 251) as u8)
        .collect()
}

pub fn sha256_hex(b: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, b)
        .as_ref()
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

pub fn json_ints(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_i64().expect("an integer"))
        .collect()
}

fn unhex(h: &str) -> Vec<u8> {
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).expect("hex"))
        .collect()
}

/// One block list per kernel group, as STORE and RETRIEVE carry them.
pub fn block_lists(v: &serde_json::Value) -> V {
    V::A(
        v.as_array()
            .expect("lists")
            .iter()
            .map(|l| V::A(json_ints(l).into_iter().map(V::I).collect()))
            .collect(),
    )
}

/// The case's `EngineGroupInfo`s, as REGISTER_KV_CACHE carries them.
pub fn golden_group_infos(case: &serde_json::Value) -> Vec<V> {
    case["engine_group_infos"]
        .as_array()
        .expect("engine_group_infos")
        .iter()
        .map(|g| {
            let int = |k: &str| V::I(g[k].as_i64().unwrap_or_else(|| panic!("{k}")));
            map(&[
                ("engine_group_id", int("engine_group_id")),
                (
                    "layer_indices",
                    V::A(
                        json_ints(&g["layer_indices"])
                            .into_iter()
                            .map(V::I)
                            .collect(),
                    ),
                ),
                ("tokens_per_block", int("tokens_per_block")),
                ("sw_size_tokens", int("sw_size_tokens")),
                ("extra_object_group_tag", V::I(0)),
                ("recurrent_state", V::B(false)),
            ])
        })
        .collect()
}

/// The chunk objects 0.5.6 stored, sorted (fs L2 names are content hashes,
/// so tests compare the sets). A case of separate object groups lists each
/// group's stored chunks' objects.
pub fn golden_objects(case: &serde_json::Value) -> Vec<Vec<u8>> {
    let hex = |h: &serde_json::Value| unhex(h.as_str().expect("hex"));
    let mut want: Vec<Vec<u8>> = match case["store"]["objects"].as_array() {
        Some(per_group) => per_group
            .iter()
            .flat_map(|g| g.as_array().expect("a group's objects").iter())
            .map(|o| hex(&o["hex"]))
            .collect(),
        None => case["store"]["objects_hex"]
            .as_array()
            .expect("objects_hex")
            .iter()
            .map(hex)
            .collect(),
    };
    want.sort();
    want
}

/// The paths of every `.data` file under `dir` (any depth); waits up to
/// 30 s for at least `n` (an fs L2 writes behind the STORE reply).
pub fn l2_files(dir: &std::path::Path, n: usize) -> Vec<std::path::PathBuf> {
    let list = || {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "data") {
                    out.push(p);
                }
            }
        }
        out
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut got = list();
    while got.len() < n && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        got = list();
    }
    got
}

/// Every `.data` file under `dir`, read, sorted; waits as [`l2_files`].
pub fn l2_objects(dir: &std::path::Path, n: usize) -> Vec<Vec<u8>> {
    let mut got: Vec<Vec<u8>> = l2_files(dir, n)
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_default())
        .collect();
    got.sort();
    got
}

/// The server flags a golden case replays under: an fs L2 at `l2`, and
/// `--separate-object-groups` for the cases of `golden_og_gather.json`
/// (those that list their object groups).
pub fn golden_server_args(l2: &std::path::Path, case: &serde_json::Value) -> Vec<String> {
    let mut args = vec!["--l2-adapter".to_string(), fs_adapter(l2)];
    if case.get("object_groups").is_some() {
        args.push("--separate-object-groups".to_string());
    }
    args
}

/// An fs L2 adapter spec for `dir`.
pub fn fs_adapter(dir: &std::path::Path) -> String {
    format!(r#"{{"type":"fs","base_path":"{}"}}"#, dir.display())
}
