//! `--hash-algorithm sha256_cbor` against chunk hashes computed by lmcache 0.5.6's own
//! TokenHasher (with vLLM's hashing modules; see tools/golden/token_hashes.py).

use kvshard_engine::keys::{
    hex, sha256_cbor_fallback_none_hash, sha256_cbor_seeded_none_hash, ChunkHashes, TokenHasher,
};
use serde_json::Value;

fn cases() -> Vec<Value> {
    let text = include_str!("data/token_hashes_sha256_cbor.json");
    let doc: Value = serde_json::from_str(text).expect("golden JSON");
    doc["cases"].as_array().expect("cases").clone()
}

#[test]
fn sha256_cbor_matches_lmcache_token_hasher() {
    let cases = cases();
    assert!(cases.len() >= 8, "{} cases", cases.len());
    for c in &cases {
        let seed = c["python_hash_seed"].as_str().unwrap();
        let none_hash = match c["none_hash_from"].as_str().unwrap() {
            "vllm" => sha256_cbor_seeded_none_hash(seed),
            "fallback" => sha256_cbor_fallback_none_hash(),
            other => panic!("none hash from {other}"),
        };
        assert_eq!(hex(&none_hash), c["none_hash"].as_str().unwrap(), "{seed}");
        let chunk = c["chunk_size"].as_u64().unwrap() as usize;
        let tokens: Vec<u32> = c["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let want: Vec<&str> = c["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap())
            .collect();
        let end = tokens.len() - tokens.len() % chunk;
        let hasher = TokenHasher::Sha256Cbor { none_hash };
        let got = hasher.chunk_hashes(&tokens, chunk, 0, end).unwrap();
        let got: Vec<String> = got.iter().map(|h| hex(h)).collect();
        assert_eq!(got, want, "seed {seed}, chunk {chunk}");

        // Incremental hashing (a session's tokens growing) gives the same chain.
        let mut inc = ChunkHashes::new(hasher);
        for e in (chunk..=end).step_by(chunk) {
            inc.extend_to(&tokens, chunk, e);
        }
        assert_eq!(inc.all().iter().map(|h| hex(h)).collect::<Vec<_>>(), want);
    }
}

#[test]
fn sha256_cbor_differs_from_blake3_and_by_seed() {
    let tokens: Vec<u32> = (1..=8).collect();
    let a = TokenHasher::Sha256Cbor {
        none_hash: sha256_cbor_seeded_none_hash("7"),
    };
    let b = TokenHasher::Sha256Cbor {
        none_hash: sha256_cbor_seeded_none_hash("8"),
    };
    let ha = a.chunk_hashes(&tokens, 4, 0, 8).unwrap();
    assert_ne!(ha, b.chunk_hashes(&tokens, 4, 0, 8).unwrap());
    assert_ne!(
        ha,
        TokenHasher::Blake3.chunk_hashes(&tokens, 4, 0, 8).unwrap()
    );
}
