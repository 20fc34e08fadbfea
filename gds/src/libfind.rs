//! Finding the CUDA libraries kvshard loads at run time (NVRTC, cuFile).
//!
//! They ship with the CUDA toolkit or in pip wheels (`nvidia/cu13/lib` for
//! CUDA 13, one package per library before), so they are rarely on the
//! loader path of a server host. A [`Search`] tries, in order: the file an
//! environment variable names, the loader's own lookup of each soname, then
//! `$CUDA_HOME/lib64`, `/usr/local/cuda/lib64` and the wheel directories of
//! every python it finds, and reports every place it tried and why it
//! failed.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// A library that could not be loaded: every place tried and why it failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryUnavailable {
    /// The library's name, e.g. "NVRTC".
    pub library: &'static str,
    /// The environment variable that names its file.
    pub env: &'static str,
    /// Its file names, e.g. "libnvrtc.so*".
    pub pattern: &'static str,
    pub tried: Vec<(String, String)>,
}

impl std::fmt::Display for LibraryUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} not found (set {} to {}); tried {} places:",
            self.library,
            self.env,
            self.pattern,
            self.tried.len()
        )?;
        for (place, why) in &self.tried {
            write!(f, "\n  {place}: {why}")?;
        }
        Ok(())
    }
}

impl std::error::Error for LibraryUnavailable {}

/// Where to look for one library.
pub struct Search {
    /// The library's name, for reports.
    pub library: &'static str,
    /// Environment variable naming the library file to use first.
    pub env: &'static str,
    /// Library names, preferred first.
    pub sonames: &'static [&'static str],
    /// Directories pip wheels put the library in, relative to a
    /// `site-packages` directory.
    pub wheel_dirs: &'static [&'static str],
    /// Its file names, for reports (e.g. "libnvrtc.so*").
    pub what: &'static str,
}

impl Search {
    /// The first place `open` accepts, or every place tried with the reason.
    pub fn find<T>(
        &self,
        open: impl Fn(&OsStr) -> Result<T, String>,
    ) -> Result<T, LibraryUnavailable> {
        let mut tried: Vec<(String, String)> = Vec::new();
        let attempt = |tried: &mut Vec<(String, String)>, place: String, target: &OsStr| {
            open(target).map_err(|why| tried.push((place, why))).ok()
        };
        if let Some(path) = std::env::var_os(self.env) {
            let place = format!("${}={}", self.env, Path::new(&path).display());
            if let Some(v) = attempt(&mut tried, place, &path) {
                return Ok(v);
            }
        }
        for soname in self.sonames {
            if let Some(v) = attempt(&mut tried, format!("loader: {soname}"), soname.as_ref()) {
                return Ok(v);
            }
        }
        for dir in self.library_dirs() {
            let mut found = false;
            for soname in self.sonames {
                let file = dir.join(soname);
                if file.exists() {
                    found = true;
                    if let Some(v) =
                        attempt(&mut tried, file.display().to_string(), file.as_os_str())
                    {
                        return Ok(v);
                    }
                }
            }
            if !found {
                tried.push((dir.display().to_string(), format!("no {} here", self.what)));
            }
        }
        Err(LibraryUnavailable {
            library: self.library,
            env: self.env,
            pattern: self.what,
            tried,
        })
    }

    /// Library directories to search after the loader's own lookup.
    fn library_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        if let Some(h) = std::env::var_os("CUDA_HOME") {
            dirs.push(PathBuf::from(h).join("lib64"));
        }
        dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
        for site in site_package_dirs() {
            for wheel in self.wheel_dirs {
                dirs.push(site.join(wheel));
            }
        }
        dirs
    }
}

/// Every `site-packages`/`dist-packages` directory found cheaply: the
/// lmcache venv kvshard provisions, the active virtualenv, the user's and
/// the system's, one `read_dir` per `lib` directory.
fn site_package_dirs() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    let home = std::env::var_os("HOME").map(PathBuf::from);
    if let Some(h) = &home {
        prefixes.push(h.join(".cache/kvshard/lmcache-0.5.6"));
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        prefixes.push(PathBuf::from(v));
    }
    if let Some(c) = std::env::var_os("CONDA_PREFIX") {
        prefixes.push(PathBuf::from(c));
    }
    if let Some(h) = &home {
        prefixes.push(h.join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));

    let mut dirs = Vec::new();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        pythons.reverse(); // newest python first
        for py in pythons {
            for leaf in ["site-packages", "dist-packages"] {
                let d = py.join(leaf);
                if d.is_dir() {
                    dirs.push(d);
                }
            }
        }
    }
    dirs.dedup();
    dirs
}

/// An error and its sources, `: `-separated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}
