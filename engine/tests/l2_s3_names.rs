//! The s3 adapter's object names and request paths against names lmcache
//! 0.5.6's own code computed (tests/data/l2_s3_golden_names.txt, made by
//! tools/golden/s3_names.py), so a bucket written by either server is read by
//! the other.

use kvshard_engine::keys::{Name, ObjectKey};
use kvshard_engine::l2::naming::{parse_s3_object_name, s3_object_name};
use kvshard_s3_raw::sigv4::encode_path;

const GOLDEN: &str = include_str!("data/l2_s3_golden_names.txt");

fn unhex(s: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

#[test]
fn object_names_and_paths_match_lmcache_0_5_6() {
    let mut n = 0;
    for l in GOLDEN
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let f: Vec<&str> = l.split('\t').collect();
        assert_eq!(f.len(), 7, "golden line: {l}");
        let k = ObjectKey {
            chunk_hash: unhex(f[0]),
            model_name: Name::intern(f[1]).unwrap(),
            kv_rank: f[2].parse().unwrap(),
            object_group_id: f[3].parse().unwrap(),
            cache_salt: Name::intern(f[4]).unwrap(),
        };
        let name = s3_object_name(&k);
        assert_eq!(name, f[5]);
        assert_eq!(parse_s3_object_name(&name).as_ref(), Some(&k), "{name}");
        let mut path = String::from("/");
        encode_path(&name, &mut path);
        assert_eq!(path, f[6], "request path of {name}");
        n += 1;
    }
    assert!(n >= 13, "golden file has {n} keys");
}
