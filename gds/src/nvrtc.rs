//! NVRTC, found and loaded at run time.
//!
//! NVRTC ships with the CUDA toolkit or as a pip wheel (`nvidia-cuda-nvrtc`,
//! or `nvidia/cu13` in CUDA 13 wheels), so its library is rarely on the
//! loader path of a server host. [`Nvrtc::load`] tries a fixed list of
//! places and, when none works, says every place it looked. Compiling needs
//! no GPU.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;

use crate::libfind::{error_chain, LibraryUnavailable, Search};

/// Environment variable naming the NVRTC library file to use.
pub const NVRTC_PATH_ENV: &str = "KVSHARD_NVRTC_PATH";

/// Library names tried, newest major first.
const SONAMES: [&str; 4] = [
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11.2",
    "libnvrtc.so",
];

/// Where pip wheels put NVRTC, relative to a site-packages directory.
const WHEEL_DIRS: [&str; 2] = ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"];

type NvrtcResult = c_int;
type NvrtcProgram = *mut c_void;

const NVRTC_SUCCESS: NvrtcResult = 0;

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
type GetErrorStringFn = unsafe extern "C" fn(NvrtcResult) -> *const c_char;
type CreateProgramFn = unsafe extern "C" fn(
    *mut NvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type DestroyProgramFn = unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult;
type CompileProgramFn =
    unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult;
type SizeFn = unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult;
type BytesFn = unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult;
type NumArchsFn = unsafe extern "C" fn(*mut c_int) -> NvrtcResult;
type ArchsFn = unsafe extern "C" fn(*mut c_int) -> NvrtcResult;

/// The NVRTC entry points kvshard uses, resolved once at load.
#[derive(Clone, Copy)]
struct Api {
    version: VersionFn,
    get_error_string: GetErrorStringFn,
    create_program: CreateProgramFn,
    destroy_program: DestroyProgramFn,
    compile_program: CompileProgramFn,
    get_program_log_size: SizeFn,
    get_program_log: BytesFn,
    get_ptx_size: SizeFn,
    get_ptx: BytesFn,
    get_cubin_size: SizeFn,
    get_cubin: BytesFn,
    // Present since NVRTC 11.2; optional so older libraries still load.
    get_num_supported_archs: Option<NumArchsFn>,
    get_supported_archs: Option<ArchsFn>,
}

/// A loaded NVRTC library.
pub struct Nvrtc {
    // Keeps the code behind `api` mapped; dropped last.
    _lib: libloading::Library,
    api: Api,
    source: String,
    version: (u32, u32),
}

impl fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nvrtc")
            .field("source", &self.source)
            .field("version", &self.version)
            .finish()
    }
}

/// NVRTC could not be loaded; lists each place tried and why it failed.
pub type NvrtcUnavailable = LibraryUnavailable;

/// What to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// PTX for a virtual architecture, e.g. `Ptx(75)` = `compute_75`; the
    /// driver JIT-compiles it for any newer GPU.
    Ptx(u32),
    /// Machine code for one real architecture, e.g. `Cubin(90)` = `sm_90`.
    Cubin(u32),
}

impl Arch {
    /// The `--gpu-architecture` option for this target.
    pub fn option(self) -> String {
        match self {
            Arch::Ptx(cc) => format!("--gpu-architecture=compute_{cc}"),
            Arch::Cubin(cc) => format!("--gpu-architecture=sm_{cc}"),
        }
    }

    pub fn compute_capability(self) -> u32 {
        match self {
            Arch::Ptx(cc) | Arch::Cubin(cc) => cc,
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arch::Ptx(cc) => write!(f, "compute_{cc}"),
            Arch::Cubin(cc) => write!(f, "sm_{cc}"),
        }
    }
}

/// A compilation that failed: the NVRTC call that failed, its result, and
/// the program log (compiler diagnostics; empty when compilation never ran).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileError {
    pub program: String,
    pub arch: Arch,
    pub call: &'static str,
    pub result: String,
    pub log: String,
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NVRTC {} failed for {} ({}): {}",
            self.call, self.program, self.arch, self.result
        )?;
        if !self.log.is_empty() {
            write!(f, "\n{}", self.log.trim_end())?;
        }
        Ok(())
    }
}

impl std::error::Error for CompileError {}

/// Resolves a required symbol; the caller's library must outlive the value.
///
/// # Safety
/// `T` must be the C signature of `name` in NVRTC.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    // SAFETY: forwarded to the caller: T is the symbol's true signature.
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| format!("missing symbol {name}: {}", error_chain(&e)))
}

impl Api {
    fn resolve(lib: &libloading::Library) -> Result<Api, String> {
        // SAFETY: each type alias above is the documented C signature of the
        // NVRTC function of that name (nvrtc.h, stable since CUDA 11).
        unsafe {
            Ok(Api {
                version: symbol(lib, "nvrtcVersion")?,
                get_error_string: symbol(lib, "nvrtcGetErrorString")?,
                create_program: symbol(lib, "nvrtcCreateProgram")?,
                destroy_program: symbol(lib, "nvrtcDestroyProgram")?,
                compile_program: symbol(lib, "nvrtcCompileProgram")?,
                get_program_log_size: symbol(lib, "nvrtcGetProgramLogSize")?,
                get_program_log: symbol(lib, "nvrtcGetProgramLog")?,
                get_ptx_size: symbol(lib, "nvrtcGetPTXSize")?,
                get_ptx: symbol(lib, "nvrtcGetPTX")?,
                get_cubin_size: symbol(lib, "nvrtcGetCUBINSize")?,
                get_cubin: symbol(lib, "nvrtcGetCUBIN")?,
                get_num_supported_archs: symbol(lib, "nvrtcGetNumSupportedArchs").ok(),
                get_supported_archs: symbol(lib, "nvrtcGetSupportedArchs").ok(),
            })
        }
    }
}

impl Nvrtc {
    /// Finds and loads NVRTC: `$KVSHARD_NVRTC_PATH`, then the loader's search
    /// for `libnvrtc.so.13`, `.12`, `.11.2`, `libnvrtc.so`, then
    /// `$CUDA_HOME/lib64`, `/usr/local/cuda/lib64` and the pip wheel
    /// directories of every python found. Never panics.
    pub fn load() -> Result<Nvrtc, NvrtcUnavailable> {
        let search = Search {
            library: "NVRTC",
            env: NVRTC_PATH_ENV,
            sonames: &SONAMES,
            wheel_dirs: &WHEEL_DIRS,
            what: "libnvrtc.so*",
        };
        search.find(Self::open)
    }

    fn open(target: &std::ffi::OsStr) -> Result<Nvrtc, String> {
        // SAFETY: loading NVRTC runs its ELF initialisers, which only set up
        // its own state; we load it by name or by an explicit file path.
        let lib = unsafe { libloading::Library::new(target) }.map_err(|e| error_chain(&e))?;
        let api = Api::resolve(&lib)?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints through valid pointers.
        let rc = unsafe { (api.version)(&mut major, &mut minor) };
        if rc != NVRTC_SUCCESS {
            return Err(format!("nvrtcVersion returned {rc}"));
        }
        Ok(Nvrtc {
            _lib: lib,
            api,
            source: target.to_string_lossy().into_owned(),
            version: (major.max(0) as u32, minor.max(0) as u32),
        })
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (u32, u32) {
        self.version
    }

    /// The path or name the library was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Real architectures this NVRTC can emit CUBIN for (e.g. 75, 80, 90,
    /// 100), ascending; `None` when the library predates the query.
    pub fn supported_archs(&self) -> Option<Vec<u32>> {
        let (num, archs) = (
            self.api.get_num_supported_archs?,
            self.api.get_supported_archs?,
        );
        let mut n: c_int = 0;
        // SAFETY: writes one int through a valid pointer.
        if unsafe { num(&mut n) } != NVRTC_SUCCESS || n < 0 {
            return None;
        }
        let mut out = vec![0 as c_int; n as usize];
        // SAFETY: `out` holds exactly the count NVRTC just reported.
        if unsafe { archs(out.as_mut_ptr()) } != NVRTC_SUCCESS {
            return None;
        }
        Some(out.into_iter().map(|a| a.max(0) as u32).collect())
    }

    fn error_string(&self, rc: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string (or null).
        let p = unsafe { (self.api.get_error_string)(rc) };
        if p.is_null() {
            return format!("NVRTC error {rc}");
        }
        // SAFETY: non-null, NUL-terminated, static storage.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Compiles `source` for `arch` with `extra_options` appended after the
    /// architecture option. Returns PTX text (without the trailing NUL) or
    /// CUBIN bytes.
    pub fn compile(
        &self,
        source: &str,
        name: &str,
        arch: Arch,
        extra_options: &[&str],
    ) -> Result<Vec<u8>, CompileError> {
        let fail = |call: &'static str, result: String, log: String| CompileError {
            program: name.to_string(),
            arch,
            call,
            result,
            log,
        };
        let c_source = CString::new(source).map_err(|_| {
            fail(
                "nvrtcCreateProgram",
                "source contains a NUL byte".into(),
                String::new(),
            )
        })?;
        let c_name = CString::new(name).map_err(|_| {
            fail(
                "nvrtcCreateProgram",
                "name contains a NUL byte".into(),
                String::new(),
            )
        })?;
        let mut options = vec![arch.option()];
        options.extend(extra_options.iter().map(|o| o.to_string()));
        let c_options = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| {
                fail(
                    "nvrtcCompileProgram",
                    "an option contains a NUL byte".into(),
                    String::new(),
                )
            })?;
        let option_ptrs: Vec<*const c_char> = c_options.iter().map(|o| o.as_ptr()).collect();

        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: source and name are NUL-terminated and outlive the call; no
        // headers are passed (count 0, null arrays).
        let rc = unsafe {
            (self.api.create_program)(
                &mut prog,
                c_source.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if rc != NVRTC_SUCCESS {
            return Err(fail(
                "nvrtcCreateProgram",
                self.error_string(rc),
                String::new(),
            ));
        }
        let program = Program { nvrtc: self, prog };

        // SAFETY: `prog` is live; the option pointers are NUL-terminated
        // strings owned by `c_options`, alive for the call.
        let rc = unsafe {
            (self.api.compile_program)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        let log = program.bytes(self.api.get_program_log_size, self.api.get_program_log);
        let log = match log {
            Ok(mut bytes) => {
                trim_nul(&mut bytes);
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Err(e) => format!("(program log unavailable: {})", self.error_string(e)),
        };
        if rc != NVRTC_SUCCESS {
            return Err(fail("nvrtcCompileProgram", self.error_string(rc), log));
        }
        let out = match arch {
            Arch::Ptx(_) => program
                .bytes(self.api.get_ptx_size, self.api.get_ptx)
                .map(|mut b| {
                    trim_nul(&mut b);
                    b
                }),
            Arch::Cubin(_) => program.bytes(self.api.get_cubin_size, self.api.get_cubin),
        };
        let call = match arch {
            Arch::Ptx(_) => "nvrtcGetPTX",
            Arch::Cubin(_) => "nvrtcGetCUBIN",
        };
        out.map_err(|rc| fail(call, self.error_string(rc), log))
    }
}

/// An error and its sources, so dlopen's own message (the path, the missing
/// file or dependency) is kept.
fn trim_nul(bytes: &mut Vec<u8>) {
    while bytes.last() == Some(&0) {
        bytes.pop();
    }
}

/// An NVRTC program, destroyed on drop (also on every error path).
struct Program<'a> {
    nvrtc: &'a Nvrtc,
    prog: NvrtcProgram,
}

impl Program<'_> {
    /// Reads a sized output (log, PTX, CUBIN) with its size/get pair.
    fn bytes(&self, size: SizeFn, get: BytesFn) -> Result<Vec<u8>, NvrtcResult> {
        let mut n: usize = 0;
        // SAFETY: `prog` is live; writes one size_t.
        let rc = unsafe { size(self.prog, &mut n) };
        if rc != NVRTC_SUCCESS {
            return Err(rc);
        }
        let mut buf = vec![0u8; n];
        if n == 0 {
            return Ok(buf);
        }
        // SAFETY: `buf` holds exactly the `n` bytes NVRTC just reported.
        let rc = unsafe { get(self.prog, buf.as_mut_ptr().cast()) };
        if rc != NVRTC_SUCCESS {
            return Err(rc);
        }
        Ok(buf)
    }
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: `prog` came from nvrtcCreateProgram and is destroyed once.
        let rc = unsafe { (self.nvrtc.api.destroy_program)(&mut self.prog) };
        if rc != NVRTC_SUCCESS {
            log::warn!("nvrtcDestroyProgram: {}", self.nvrtc.error_string(rc));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_options() {
        assert_eq!(Arch::Ptx(75).option(), "--gpu-architecture=compute_75");
        assert_eq!(Arch::Cubin(90).option(), "--gpu-architecture=sm_90");
        assert_eq!(Arch::Cubin(100).to_string(), "sm_100");
    }

    #[test]
    fn missing_file_is_reported_not_panicked() {
        let err = Nvrtc::open("/nonexistent/libnvrtc.so.13".as_ref()).unwrap_err();
        assert!(err.contains("/nonexistent/libnvrtc.so.13"), "{err}");
    }

    #[test]
    fn unavailable_lists_every_place() {
        let e = NvrtcUnavailable {
            library: "NVRTC",
            env: NVRTC_PATH_ENV,
            pattern: "libnvrtc.so*",
            tried: vec![
                ("loader: libnvrtc.so.13".into(), "not found".into()),
                (
                    "/usr/local/cuda/lib64".into(),
                    "no libnvrtc.so* here".into(),
                ),
            ],
        };
        let s = e.to_string();
        assert!(s.contains("tried 2 places"), "{s}");
        assert!(
            s.starts_with("NVRTC not found (set KVSHARD_NVRTC_PATH to libnvrtc.so*)"),
            "{s}"
        );
        assert!(
            s.contains("/usr/local/cuda/lib64: no libnvrtc.so* here"),
            "{s}"
        );
    }
}
