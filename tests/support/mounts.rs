//! File systems a test mounts for itself: a small tmpfs (full disks,
//! read-only directories) and an ext4 image on a loop device that can be
//! frozen (`fsfreeze`), so a write blocks in the kernel as on a stuck disk.
//!
//! Mounting needs CAP_SYS_ADMIN. Where it is missing the constructors return
//! `None` and the test says it skipped, unless `KVSHARD_REQUIRE_MOUNTS=1` is
//! set (CI sets it), in which case they fail the test.

use std::path::PathBuf;
use std::process::Command;

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// `None` after saying why, or a panic when mounts are required.
fn unavailable<T>(what: &str, why: String) -> Option<T> {
    if std::env::var_os("KVSHARD_REQUIRE_MOUNTS").is_some_and(|v| v == "1") {
        panic!("{what} is required (KVSHARD_REQUIRE_MOUNTS=1) but failed: {why}");
    }
    eprintln!("SKIPPED: {what} is not possible here ({why})");
    None
}

fn fresh_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(super::unique(tag));
    std::fs::create_dir_all(&dir).expect("create the mount point");
    dir
}

/// A tmpfs of its own, unmounted (and its mount point removed) on drop.
pub struct Tmpfs {
    pub path: PathBuf,
}

impl Tmpfs {
    /// A tmpfs of `size` (as `mount -o size=` takes it, e.g. "8m"),
    /// read-only when `read_only`.
    pub fn mount(size: &str, read_only: bool) -> Option<Tmpfs> {
        let path = fresh_dir("kvshard-tmpfs");
        let mut opts = format!("size={size},mode=0755");
        if read_only {
            opts.push_str(",ro");
        }
        let p = path.to_str().expect("UTF-8 temp dir");
        match run("mount", &["-t", "tmpfs", "-o", &opts, "tmpfs", p]) {
            Ok(()) => Some(Tmpfs { path }),
            Err(e) => {
                let _ = std::fs::remove_dir(&path);
                unavailable("mounting a tmpfs", e)
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let p = self.path.to_str().unwrap_or_default().to_owned();
        let _ = run("umount", &["-l", &p]);
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// An ext4 image on a loop device, mounted at `path`. [`Freezable::freeze`]
/// blocks every write to it in the kernel until [`Freezable::thaw`]; drop
/// thaws, unmounts and removes the image.
pub struct Freezable {
    pub path: PathBuf,
    image: PathBuf,
    frozen: bool,
}

impl Freezable {
    pub fn mount(size_mib: u64) -> Option<Freezable> {
        let path = fresh_dir("kvshard-freezable");
        let image = path.with_extension("img");
        let setup = || -> Result<(), String> {
            let f = std::fs::File::create(&image).map_err(|e| e.to_string())?;
            f.set_len(size_mib << 20).map_err(|e| e.to_string())?;
            let img = image.to_str().expect("UTF-8 temp dir");
            run("mkfs.ext4", &["-q", "-F", img])?;
            run("mount", &["-o", "loop", img, path.to_str().unwrap()])
        };
        match setup() {
            Ok(()) => Some(Freezable {
                path,
                image,
                frozen: false,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&image);
                let _ = std::fs::remove_dir(&path);
                unavailable("a loop-mounted ext4 image", e)
            }
        }
    }

    pub fn freeze(&mut self) {
        run("fsfreeze", &["-f", self.path.to_str().unwrap()]).expect("fsfreeze -f");
        self.frozen = true;
    }

    pub fn thaw(&mut self) {
        if self.frozen {
            run("fsfreeze", &["-u", self.path.to_str().unwrap()]).expect("fsfreeze -u");
            self.frozen = false;
        }
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for Freezable {
    fn drop(&mut self) {
        let p = self.path.to_str().unwrap_or_default().to_owned();
        if self.frozen {
            let _ = run("fsfreeze", &["-u", &p]);
        }
        let _ = run("umount", &["-l", &p]);
        let _ = std::fs::remove_dir(&self.path);
        let _ = std::fs::remove_file(&self.image);
    }
}
