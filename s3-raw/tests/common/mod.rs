//! Helpers shared by the s3-raw tests: locating crates' packaged files,
//! percent-decoding, `x-amz-date` parsing, temporary directories.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A directory of its own under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kvshard-s3raw-{label}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `text` to `relative` (parent directories created); its path.
    pub fn write(&self, relative: &str, text: &str) -> PathBuf {
        let path = self.0.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The cargo binary running the tests.
pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_owned())
}

/// The host target triple (`rustc -vV`), for `cargo metadata
/// --filter-platform`: without it cargo wants every platform's packages
/// (macOS and Windows TLS crates included) downloaded, which `--offline`
/// cannot do.
pub fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let output = Command::new(rustc)
        .arg("-vV")
        .output()
        .expect("run rustc -vV");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV prints the host triple")
        .trim()
        .to_owned()
}

/// Runs `cargo metadata` on `manifest` and returns the directory of package
/// `name`, or the reason it could not.
pub fn package_dir(manifest: &Path, name: &str, extra_args: &[&str]) -> Result<PathBuf, String> {
    let output = Command::new(cargo())
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(manifest)
        .args(extra_args)
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let meta: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|e| format!("cargo metadata printed invalid JSON: {e}"))?;
    let packages = meta["packages"]
        .as_array()
        .ok_or("cargo metadata has no packages")?;
    let manifest_path = packages
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or_else(|| {
            format!(
                "package {name} is not in the dependency graph of {}",
                manifest.display()
            )
        })?;
    Ok(Path::new(manifest_path)
        .parent()
        .expect("a manifest path has a parent")
        .to_owned())
}

/// Decodes `%XX` escapes; other bytes are kept. The result must be UTF-8.
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).expect("decoded text is UTF-8")
}

/// Splits a request target into (raw path, raw query pairs).
pub fn split_target(target: &str) -> (String, Vec<(String, String)>) {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let mut pairs = Vec::new();
    if let Some(query) = query {
        for part in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').unwrap_or((part, ""));
            pairs.push((percent_decode(k), percent_decode(v)));
        }
    }
    (percent_decode(path), pairs)
}

/// Seconds since the epoch of a `YYYYMMDDTHHMMSSZ` text.
pub fn parse_amz_date(text: &str) -> u64 {
    assert_eq!(text.len(), 16, "x-amz-date {text:?}");
    let iso = format!(
        "{}-{}-{}T{}:{}:{}Z",
        &text[0..4],
        &text[4..6],
        &text[6..8],
        &text[9..11],
        &text[11..13],
        &text[13..15]
    );
    let t = kvshard_s3_raw::time::parse_rfc3339(&iso).expect("valid x-amz-date");
    kvshard_s3_raw::time::unix_secs(t).expect("after the epoch")
}
