//! How much memory this process may still take: the kernel's `MemAvailable`
//! and, where the process runs in a memory cgroup with a limit, what the limit
//! leaves. The L1 is checked against it at start (an L1 that cannot fit is
//! refused with the figures, instead of meeting the OOM killer), and lazy
//! growth stops short of it.

use std::fs;
use std::path::{Path, PathBuf};

/// A reading of what memory is left, with the figures behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRoom {
    /// `MemAvailable` of `/proc/meminfo`, in bytes.
    pub mem_available: Option<u64>,
    /// The memory cgroup's limit, when it has one.
    pub cgroup_limit: Option<u64>,
    /// What the cgroup holds that the kernel cannot just drop: its usage
    /// less the page cache it could reclaim (shared memory is not reclaimable).
    pub cgroup_used: Option<u64>,
}

impl MemoryRoom {
    /// Reads the figures now.
    pub fn read() -> MemoryRoom {
        let (cgroup_limit, cgroup_used) = match cgroup_memory() {
            Some((limit, used)) => (Some(limit), Some(used)),
            None => (None, None),
        };
        MemoryRoom {
            mem_available: mem_available(),
            cgroup_limit,
            cgroup_used,
        }
    }

    /// Bytes that can still be taken: the smaller of `MemAvailable` and
    /// what the cgroup's limit leaves; `None` when neither can be read.
    pub fn room(&self) -> Option<u64> {
        let cgroup = match (self.cgroup_limit, self.cgroup_used) {
            (Some(l), Some(u)) => Some(l.saturating_sub(u)),
            _ => None,
        };
        match (self.mem_available, cgroup) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
    }

    /// The figures, for an operator: "MemAvailable N bytes, cgroup limit L
    /// bytes with U in use".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(a) = self.mem_available {
            parts.push(format!("MemAvailable {a} bytes"));
        }
        if let (Some(l), Some(u)) = (self.cgroup_limit, self.cgroup_used) {
            parts.push(format!("memory cgroup limit {l} bytes with {u} in use"));
        }
        if parts.is_empty() {
            "no memory figures readable".to_string()
        } else {
            parts.join(", ")
        }
    }
}

/// `MemAvailable` in bytes.
pub fn mem_available() -> Option<u64> {
    meminfo_field(&fs::read_to_string("/proc/meminfo").ok()?, "MemAvailable")
}

/// A `/proc/meminfo` field in bytes (the file gives kB).
fn meminfo_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb * 1024)
    })
}

/// Limits at or above this are "no limit" (cgroup v1 writes a page-rounded
/// `i64::MAX`).
const UNLIMITED: u64 = 1 << 62;

/// `(limit, used)` of this process's memory cgroup, when it has a limit.
fn cgroup_memory() -> Option<(u64, u64)> {
    let own = fs::read_to_string("/proc/self/cgroup").ok()?;
    for (dir, v2) in cgroup_dirs(&own) {
        let (limit, usage, stat) = if v2 {
            ("memory.max", "memory.current", "memory.stat")
        } else {
            (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "memory.stat",
            )
        };
        let Some(limit) = read_u64(&dir.join(limit)) else {
            continue;
        };
        if limit >= UNLIMITED {
            return None;
        }
        let usage = read_u64(&dir.join(usage)).unwrap_or(0);
        let stat = fs::read_to_string(dir.join(stat)).unwrap_or_default();
        return Some((limit, unreclaimable(usage, &stat, v2)));
    }
    None
}

/// Usage less the page cache the kernel could drop before it would OOM.
fn unreclaimable(usage: u64, stat: &str, v2: bool) -> u64 {
    let field = |name: &str| {
        stat.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse::<u64>().ok()).flatten()
        })
    };
    let (file, shmem) = if v2 {
        (field("file"), field("shmem"))
    } else {
        (
            field("total_cache").or_else(|| field("cache")),
            field("total_shmem").or_else(|| field("shmem")),
        )
    };
    let reclaimable = file.unwrap_or(0).saturating_sub(shmem.unwrap_or(0));
    usage.saturating_sub(reclaimable)
}

/// Where this process's memory cgroup may be mounted, most specific first:
/// its own path under the v2 or v1 hierarchy, then the hierarchy's root
/// (what a container with a cgroup namespace sees).
fn cgroup_dirs(own: &str) -> Vec<(PathBuf, bool)> {
    let mut dirs = Vec::new();
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (_id, controllers, path) = match (f.next(), f.next(), f.next()) {
            (Some(i), Some(c), Some(p)) => (i, c, p),
            _ => continue,
        };
        let rel = path.trim_start_matches('/');
        if controllers.is_empty() {
            dirs.push((Path::new("/sys/fs/cgroup").join(rel), true));
            dirs.push((PathBuf::from("/sys/fs/cgroup"), true));
        } else if controllers.split(',').any(|c| c == "memory") {
            dirs.push((Path::new("/sys/fs/cgroup/memory").join(rel), false));
            dirs.push((PathBuf::from("/sys/fs/cgroup/memory"), false));
        }
    }
    // v1 first when both are present: a v2 entry on a hybrid host has no
    // memory controller.
    dirs.sort_by_key(|(_, v2)| *v2);
    dirs
}

fn read_u64(path: &Path) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    let t = text.trim();
    if t == "max" {
        return Some(u64::MAX);
    }
    t.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   23827072 kB\n";
        assert_eq!(meminfo_field(text, "MemAvailable"), Some(23_827_072 * 1024));
        assert_eq!(meminfo_field(text, "MemFree"), Some(100 * 1024));
        assert_eq!(meminfo_field(text, "Mem"), None);
        assert_eq!(meminfo_field("garbage", "MemAvailable"), None);
    }

    #[test]
    fn page_cache_is_room_and_shared_memory_is_not() {
        let v2 = "anon 100\nfile 1000\nshmem 300\n";
        assert_eq!(unreclaimable(2000, v2, true), 2000 - 700);
        let v1 = "cache 5\ntotal_cache 1000\ntotal_shmem 300\n";
        assert_eq!(unreclaimable(2000, v1, false), 1300);
        assert_eq!(unreclaimable(100, "file 1000\n", true), 0);
    }

    #[test]
    fn cgroup_paths_of_both_hierarchies() {
        let own = "4:memory:/a/b\n1:cpu:/x\n0::/c\n";
        let dirs = cgroup_dirs(own);
        assert_eq!(
            dirs,
            vec![
                (PathBuf::from("/sys/fs/cgroup/memory/a/b"), false),
                (PathBuf::from("/sys/fs/cgroup/memory"), false),
                (PathBuf::from("/sys/fs/cgroup/c"), true),
                (PathBuf::from("/sys/fs/cgroup"), true),
            ]
        );
    }

    #[test]
    fn room_is_the_smaller_figure() {
        let r = MemoryRoom {
            mem_available: Some(100),
            cgroup_limit: Some(80),
            cgroup_used: Some(30),
        };
        assert_eq!(r.room(), Some(50));
        let r = MemoryRoom {
            mem_available: Some(10),
            ..r
        };
        assert_eq!(r.room(), Some(10));
        let none = MemoryRoom {
            mem_available: None,
            cgroup_limit: None,
            cgroup_used: None,
        };
        assert_eq!(none.room(), None);
        assert!(
            MemoryRoom::read().mem_available.is_some(),
            "Linux has MemAvailable"
        );
    }
}
