//! A scratch directory for storage benchmarks, removed however the bench ends.

use std::fs;
use std::path::{Path, PathBuf};

pub struct BenchDir(pub PathBuf);

impl BenchDir {
    /// `$KVSHARD_BENCH_DIR` (default: the workspace's `target/`) joined with
    /// `<name>-<pid>`; it should be on the disk being measured, not tmpfs.
    pub fn new(name: &str) -> BenchDir {
        let parent = match std::env::var_os("KVSHARD_BENCH_DIR") {
            Some(p) => PathBuf::from(p),
            None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target"),
        };
        let dir = parent.join(format!("{name}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        BenchDir(dir)
    }

    /// A subdirectory, created.
    #[allow(dead_code)]
    pub fn sub(&self, name: &str) -> PathBuf {
        let p = self.0.join(name);
        fs::create_dir_all(&p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
        p
    }
}

impl Drop for BenchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
