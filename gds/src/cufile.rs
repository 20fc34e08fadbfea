//! cuFile (GPUDirect Storage), found and loaded at run time.
//!
//! libcufile ships with the CUDA toolkit and in pip wheels
//! (`nvidia/cu13/lib/libcufile.so.0` for CUDA 13, `nvidia/cufile/lib`
//! before). [`CuFile::load`] finds it the way NVRTC is found (see
//! [`libfind`](crate::libfind)), checks that every entry point a cuFile slab
//! backend calls is there, and reads the library's version. Loading needs
//! no GPU and no driver; nothing here opens the cuFile driver (that needs
//! the GPU and, outside its compatibility mode, the nvidia-fs module).

use std::ffi::c_int;
use std::fmt;

use crate::libfind::{error_chain, LibraryUnavailable, Search};

/// Environment variable naming the cuFile library file to use.
pub const CUFILE_PATH_ENV: &str = "KVSHARD_CUFILE_PATH";

const SONAMES: [&str; 2] = ["libcufile.so.0", "libcufile.so"];

const WHEEL_DIRS: [&str; 2] = ["nvidia/cu13/lib", "nvidia/cufile/lib"];

/// The entry points a cuFile slab backend calls (0.5.6's set: driver,
/// handle, buffer and stream registration, synchronous and stream-ordered
/// reads and writes).
pub const CUFILE_SYMBOLS: [&str; 13] = [
    "cuFileGetVersion",
    "cuFileDriverOpen",
    "cuFileDriverClose_v2",
    "cuFileHandleRegister",
    "cuFileHandleDeregister",
    "cuFileBufRegister",
    "cuFileBufDeregister",
    "cuFileRead",
    "cuFileWrite",
    "cuFileStreamRegister",
    "cuFileStreamDeregister",
    "cuFileReadAsync",
    "cuFileWriteAsync",
];

/// `CUfileError_t`: the cuFile status and, for CUDA failures, the driver's.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CuFileError {
    err: c_int,
    cu_err: c_int,
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> CuFileError;

/// A loaded cuFile library.
pub struct CuFile {
    _lib: libloading::Library,
    source: String,
    version: i32,
}

impl fmt::Debug for CuFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CuFile")
            .field("source", &self.source)
            .field("version", &self.version)
            .finish()
    }
}

/// cuFile could not be loaded; lists each place tried and why it failed.
pub type CuFileUnavailable = LibraryUnavailable;

impl CuFile {
    /// Finds and loads libcufile: `$KVSHARD_CUFILE_PATH`, the loader's
    /// search for `libcufile.so.0` and `libcufile.so`, then
    /// `$CUDA_HOME/lib64`, `/usr/local/cuda/lib64` and the pip wheel
    /// directories of every python found. Never panics.
    pub fn load() -> Result<CuFile, CuFileUnavailable> {
        let search = Search {
            library: "cuFile",
            env: CUFILE_PATH_ENV,
            sonames: &SONAMES,
            wheel_dirs: &WHEEL_DIRS,
            what: "libcufile.so*",
        };
        search.find(Self::open)
    }

    fn open(target: &std::ffi::OsStr) -> Result<CuFile, String> {
        // SAFETY: loading libcufile runs its ELF initialisers, which only set
        // up its own state (it links no CUDA library); loaded by name or path.
        let lib = unsafe { libloading::Library::new(target) }.map_err(|e| error_chain(&e))?;
        for name in CUFILE_SYMBOLS {
            // SAFETY: only the symbol's presence is checked; nothing is called.
            unsafe { lib.get::<*const ()>(name) }
                .map_err(|e| format!("missing symbol {name}: {}", error_chain(&e)))?;
        }
        // SAFETY: cuFileGetVersion's C signature is
        // `CUfileError_t cuFileGetVersion(int *version)`.
        let get_version = unsafe { lib.get::<GetVersionFn>("cuFileGetVersion") }
            .map_err(|e| format!("missing symbol cuFileGetVersion: {}", error_chain(&e)))?;
        let mut version: c_int = 0;
        // SAFETY: writes one int through a valid pointer; needs no driver.
        let status = unsafe { get_version(&mut version) };
        if status.err != 0 {
            return Err(format!(
                "cuFileGetVersion failed (cuFile error {}, CUDA error {})",
                status.err, status.cu_err
            ));
        }
        Ok(CuFile {
            _lib: lib,
            source: target.to_string_lossy().into_owned(),
            version,
        })
    }

    /// Where the library was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// cuFile's version number as the library reports it (e.g. 1170 for
    /// 1.17.0).
    pub fn version(&self) -> i32 {
        self.version
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_reported_with_every_place_tried() {
        let search = Search {
            library: "test",
            env: "KVSHARD_TEST_NO_SUCH_LIBRARY",
            sonames: &["libkvshard-no-such-library.so.9"],
            wheel_dirs: &["nvidia/no-such-dir"],
            what: "libkvshard-no-such-library.so*",
        };
        let e = search.find(CuFile::open).unwrap_err();
        let tried = &e.tried;
        assert!(tried
            .iter()
            .any(|(p, _)| p == "loader: libkvshard-no-such-library.so.9"));
        assert!(tried
            .iter()
            .any(|(p, why)| p.ends_with("/usr/local/cuda/lib64")
                && why == "no libkvshard-no-such-library.so* here"));
        let e = e.to_string();
        assert!(
            e.starts_with("test not found (set KVSHARD_TEST_NO_SUCH_LIBRARY to "),
            "{e}"
        );
    }

    #[test]
    fn a_library_without_the_entry_points_is_refused_naming_the_symbol() {
        // libc loads everywhere and has no cuFile symbols.
        let e = CuFile::open("libc.so.6".as_ref()).unwrap_err();
        assert!(e.contains("missing symbol cuFileGetVersion"), "{e}");
    }
}
