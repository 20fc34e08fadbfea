//! Object names of lmcache 0.5.6's fs adapter (file names) and s3 adapter
//! (object names).
//!
//! fs:
//! `<model>@0x<kv_rank, 8 hex digits>@<group hex>@<chunk hash hex>[@<salt>].data`
//! with every `/` of the model name written as `-SEP-`. 0.5.6 forbids `@` in
//! model names and `@ / \ NUL` in salts, which makes splitting on `@`
//! unambiguous.
//!
//! One ambiguity is inherited: a model name that itself contains `-SEP-` gets
//! the same file as the name with `/` in its place. 0.5.6 reads such a file
//! back as the `/` name, and so does [`parse_file_name`].

use crate::keys::{check_cache_salt, file_stem_of, ChunkHash, Name, ObjectKey, CHUNK_HASH_LEN};

/// Suffix of object files.
pub const FILE_EXT: &str = ".data";

const KEY_SEP: char = '@';
const SLASH_REPLACEMENT: &str = "-SEP-";

/// The file name 0.5.6's fs adapter gives `key` (no directory).
pub fn file_name(key: &ObjectKey) -> String {
    let mut s = key.file_stem();
    s.push_str(FILE_EXT);
    s
}

/// Why `key` has no file name of its own: 0.5.6 refuses such keys when they
/// are built, and their names could collide with another key's or parse back
/// as another key.
pub fn check_key(key: &ObjectKey) -> Result<(), String> {
    if key.model_name.contains(KEY_SEP) {
        return Err(format!(
            "model_name must not contain '@' (got {:?})",
            key.model_name
        ));
    }
    check_cache_salt(&key.cache_salt)
}

/// The key of an object file name, or `None` for anything that is not one
/// (temporary files, other tools' files, names not in the exact form
/// [`file_name`] writes, such as unpadded ranks or upper-case hex).
///
/// Only names that [`file_name`] gives back unchanged are accepted, so a key
/// returned here always addresses the file it came from.
pub fn parse_file_name(name: &str) -> Option<ObjectKey> {
    let stem = name.strip_suffix(FILE_EXT)?;
    let mut parts = stem.split(KEY_SEP);
    let safe_model = parts.next()?;
    let rank = parts.next()?;
    let group = parts.next()?;
    let hash = parts.next()?;
    let salt = match parts.next() {
        None => "",
        // 0.5.6 writes no separator for an empty salt.
        Some("") => return None,
        Some(s) => s,
    };
    if parts.next().is_some() {
        return None;
    }
    let rank = rank.strip_prefix("0x")?;
    if rank.len() < 8 {
        return None;
    }
    let kv_rank = parse_lower_hex_u32(rank)?;
    let object_group_id = parse_lower_hex_u32(group)?;
    let chunk_hash = parse_hash(hash)?;
    if check_cache_salt(salt).is_err() {
        return None;
    }
    let model_name = safe_model.replace(SLASH_REPLACEMENT, "/");
    // Rejects leading zeros and any other spelling that differs from ours.
    let mut own = file_stem_of(&model_name, kv_rank, object_group_id, &chunk_hash, salt);
    own.push_str(FILE_EXT);
    if own != name {
        return None;
    }
    Some(ObjectKey {
        chunk_hash,
        model_name: intern_listed(&model_name, name)?,
        kv_rank,
        object_group_id,
        cache_salt: intern_listed(salt, name)?,
    })
}

/// Interns a name read from a listed object; `None` (the object is skipped)
/// when the name table is full.
fn intern_listed(s: &str, object: &str) -> Option<Name> {
    match Name::intern(s) {
        Ok(n) => Some(n),
        Err(e) => {
            kvshard_io::log_limited!(log::Level::Warn, "skipping L2 object {object:?}: {e}");
            None
        }
    }
}

/// The object name 0.5.6's s3 adapter gives `key`:
/// `<model>@<kv_rank, 8 hex digits>@<group hex>@<chunk hash hex>[@<salt>]`,
/// the model name as it is (a `/` in it is a "directory" in the bucket). The
/// request path is `/` + the name percent-encoded once (`-_.~/` kept), which
/// the signer does.
pub fn s3_object_name(key: &ObjectKey) -> String {
    s3_object_name_of(
        &key.model_name,
        key.kv_rank,
        key.object_group_id,
        &key.chunk_hash,
        &key.cache_salt,
    )
}

fn s3_object_name_of(
    model_name: &str,
    kv_rank: u32,
    object_group_id: u32,
    chunk_hash: &ChunkHash,
    cache_salt: &str,
) -> String {
    let mut s = format!(
        "{}@{:08x}@{:x}@{}",
        model_name,
        kv_rank,
        object_group_id,
        crate::keys::hex(chunk_hash)
    );
    if !cache_salt.is_empty() {
        s.push(KEY_SEP);
        s.push_str(cache_salt);
    }
    s
}

/// The key of an s3 object name, or `None` for anything [`s3_object_name`]
/// does not write exactly (other objects in a shared bucket are skipped,
/// as 0.5.6 skips names it cannot parse).
pub fn parse_s3_object_name(name: &str) -> Option<ObjectKey> {
    let mut parts = name.split(KEY_SEP);
    let model = parts.next()?;
    let rank = parts.next()?;
    let group = parts.next()?;
    let hash = parts.next()?;
    let salt = match parts.next() {
        None => "",
        Some("") => return None,
        Some(s) => s,
    };
    if parts.next().is_some() || rank.len() < 8 {
        return None;
    }
    let chunk_hash = parse_hash(hash)?;
    let kv_rank = parse_lower_hex_u32(rank)?;
    let object_group_id = parse_lower_hex_u32(group)?;
    if check_cache_salt(salt).is_err()
        || s3_object_name_of(model, kv_rank, object_group_id, &chunk_hash, salt) != name
    {
        return None;
    }
    Some(ObjectKey {
        chunk_hash,
        model_name: intern_listed(model, name)?,
        kv_rank,
        object_group_id,
        cache_salt: intern_listed(salt, name)?,
    })
}

fn lower_hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

fn parse_lower_hex_u32(s: &str) -> Option<u32> {
    if s.is_empty() {
        return None;
    }
    let mut v: u32 = 0;
    for b in s.bytes() {
        let d = lower_hex_digit(b)?;
        v = v.checked_mul(16)?.checked_add(u32::from(d))?;
    }
    Some(v)
}

fn parse_hash(s: &str) -> Option<[u8; CHUNK_HASH_LEN]> {
    let b = s.as_bytes();
    if b.len() != CHUNK_HASH_LEN * 2 {
        return None;
    }
    let mut out = [0u8; CHUNK_HASH_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (lower_hex_digit(b[2 * i])? << 4) | lower_hex_digit(b[2 * i + 1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(model: &str, kv_rank: u32, group: u32, salt: &str) -> ObjectKey {
        let mut chunk_hash = [0u8; CHUNK_HASH_LEN];
        for (i, b) in chunk_hash.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(5);
        }
        ObjectKey {
            chunk_hash,
            model_name: Name::intern(model).unwrap(),
            kv_rank,
            object_group_id: group,
            cache_salt: Name::intern(salt).unwrap(),
        }
    }

    #[test]
    fn round_trips() {
        for k in [
            key("org/model-7B", 0x0100_0100, 0, ""),
            key("org/model-7B", 0, 3, "tenant"),
            key("a//b/", u32::MAX, u32::MAX, "s.t-u_v"),
            key("", 1, 0x10, ""),
            key("model.with.dots", 0x0002_0001, 0, &"z".repeat(128)),
        ] {
            let name = file_name(&k);
            assert_eq!(parse_file_name(&name), Some(k), "{name}");
        }
    }

    #[test]
    fn names_match_the_0_5_6_shape() {
        let k = key("org/model-7B", 0x0100_0100, 10, "t");
        let h = crate::keys::hex(&k.chunk_hash);
        assert_eq!(
            file_name(&k),
            format!("org-SEP-model-7B@0x01000100@a@{h}@t.data")
        );
    }

    #[test]
    fn rejects_non_object_names() {
        let k = key("org/m", 1, 0, "");
        let name = file_name(&k);
        let stem = name.strip_suffix(".data").unwrap();
        let h = crate::keys::hex(&k.chunk_hash);
        for bad in [
            format!("{stem}.tmp"),
            format!("{name}.123.4.tmp"),
            stem.to_string(),
            format!("{stem}@.data"),
            format!("{stem}@a@b.data"),
            format!("org-SEP-m@0x1@0@{h}.data"),
            format!("org-SEP-m@00000001@0@{h}.data"),
            format!("org-SEP-m@0x00000001@00@{h}.data"),
            format!("org-SEP-m@0x00000001@A@{h}.data"),
            format!("org-SEP-m@0x000000001@0@{h}.data"),
            format!("org-SEP-m@0x100000000@0@{h}.data"),
            format!("org-SEP-m@0x00000001@0@{}.data", h.to_uppercase()),
            format!("org-SEP-m@0x00000001@0@{}.data", &h[..62]),
            format!("org-SEP-m@0x00000001@0@{h}00.data"),
            format!("org-SEP-m@0x00000001@0@{h}@a\\b.data"),
            format!("org-SEP-m@0x00000001@0@{h}@{}.data", "s".repeat(129)),
            format!("org-SEP-m@0x0000000g@0@{h}.data"),
            format!("org-SEP-m@0x00000001@@{h}.data"),
            String::new(),
            ".data".into(),
        ] {
            assert_eq!(parse_file_name(&bad), None, "{bad}");
        }
    }

    #[test]
    fn s3_names_round_trip_and_strangers_are_skipped() {
        let k = key("org/model-7B", 0x0100_0100, 10, "t");
        let h = crate::keys::hex(&k.chunk_hash);
        assert_eq!(s3_object_name(&k), format!("org/model-7B@01000100@a@{h}@t"));
        for k in [
            k,
            key("org/model-7B", 0, 0, ""),
            key("a//b/", u32::MAX, u32::MAX, "s.t-u_v"),
            key("", 1, 0x10, &"z".repeat(128)),
        ] {
            assert_eq!(parse_s3_object_name(&s3_object_name(&k)), Some(k));
        }
        for bad in [
            format!("m@1@0@{h}"),
            format!("m@0x00000001@0@{h}"),
            format!("m@00000001@00@{h}"),
            format!("m@00000001@A@{h}"),
            format!("m@00000001@0@{}", h.to_uppercase()),
            format!("m@00000001@0@{h}@"),
            format!("m@00000001@0@{h}@a@b"),
            format!("m@00000001@0@{h}@{}", "s".repeat(129)),
            "_lmcache_lru_index.json".into(),
            String::new(),
        ] {
            assert_eq!(parse_s3_object_name(&bad), None, "{bad}");
        }
    }

    #[test]
    fn sep_in_a_model_name_reads_back_as_slash() {
        // Same file as "org/m": 0.5.6 reads it as "org/m" too.
        let k = key("org-SEP-m", 1, 0, "");
        let back = parse_file_name(&file_name(&k)).unwrap();
        assert_eq!(back.model_name, "org/m");
        assert_eq!(file_name(&back), file_name(&k));
    }

    #[test]
    fn check_key_refuses_what_0_5_6_refuses() {
        assert!(check_key(&key("org/m", 0, 0, "ok")).is_ok());
        assert!(check_key(&key("a@b", 0, 0, "")).is_err());
        assert!(check_key(&key("m", 0, 0, "a/b")).is_err());
        assert!(check_key(&key("m", 0, 0, &"s".repeat(129))).is_err());
    }
}
