//! Finds and loads libcufile the way the server does (no GPU or driver
//! needed). Skips with the reason when it cannot be found, unless
//! `KVSHARD_REQUIRE_CUFILE=1` (CI, whose lmcache venv brings the CUDA 13
//! wheels).

use kvshard_gds::cufile::{CuFile, CUFILE_PATH_ENV};

#[test]
fn cufile_is_found_with_every_entry_point_and_its_version() {
    let cufile = match CuFile::load() {
        Ok(c) => c,
        Err(e) => {
            assert!(
                std::env::var("KVSHARD_REQUIRE_CUFILE").as_deref() != Ok("1"),
                "KVSHARD_REQUIRE_CUFILE=1 but {e}"
            );
            eprintln!("skipping: {e}");
            return;
        }
    };
    eprintln!("cuFile {} from {}", cufile.version(), cufile.source());
    assert!(
        cufile.version() >= 1000,
        "cuFile reports version {}",
        cufile.version()
    );
    // A variable naming a missing file is reported, and the search goes on.
    drop(cufile);
    std::env::set_var(CUFILE_PATH_ENV, "/nonexistent/libcufile.so.0");
    let again = CuFile::load();
    std::env::remove_var(CUFILE_PATH_ENV);
    if let Err(e) = again {
        panic!("a bad {CUFILE_PATH_ENV} hides the library: {e}");
    }
}
