//! End to end: the L1 arena mapped from `--l1-devdax-path`. A regular file
//! stands in for a /dev/daxX.Y device (the same MAP_SHARED mapping; only the
//! size and alignment come from st_size and the page size instead of sysfs).
//! The test plays an lmcache_driven CPU worker (cpu_shm), which needs no SHM
//! pool, and checks the chunks land in the file.

mod support;
use support::cpu_worker::*;
use support::*;

use std::path::Path;

fn start_on(path: &Path) -> Server {
    Server::start(&["--l1-devdax-path", path.to_str().unwrap(), "--shm-name", ""])
}

#[test]
fn devdax_file_holds_the_l1_and_restarts_empty() {
    let file = TempPath::file("l1", L1_BYTES);
    let mut srv = start_on(&file.0);

    let arena = &srv.get_json("/status")["storage_manager"]["l1_manager"]["arena"];
    assert_eq!(arena["kind"], "file", "{arena}");
    assert_eq!(arena["path"], file.arg(), "{arena}");
    assert_eq!(arena["size_bytes"], L1_BYTES, "{arena}");

    let stored = round_trip(&srv, 11);
    // The chunks live in the file: objects sit at --l1-align-bytes (4096)
    // offsets, and one object is exactly that long.
    assert_eq!(OBJECT_BYTES, 4096);
    let image = std::fs::read(&file.0).unwrap();
    assert_eq!(image.len() as u64, L1_BYTES, "the file keeps its size");
    for (i, obj) in stored.iter().enumerate() {
        assert!(
            image.chunks_exact(OBJECT_BYTES).any(|c| c == obj),
            "stored chunk {i} is not in the devdax file"
        );
    }
    assert!(srv.alive());
    drop(srv);

    // L1 is not persistent: after a restart on the same file nothing hits,
    // although the old bytes are still in it, and the server works.
    srv = start_on(&file.0);
    let mut c = srv.client();
    let _layer = worker(&mut c, 11);
    assert_eq!(lookup(&mut c, &tokens(11), "after-restart"), 0);
    assert_eq!(c.call(OP_END_SESSION, &[s("after-restart")]), None);
    assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(IID)]), None);
    drop(c);
    let stored = round_trip(&srv, 12);
    let image = std::fs::read(&file.0).unwrap();
    assert!(
        image.chunks_exact(OBJECT_BYTES).any(|c| c == stored[0]),
        "chunk stored after the restart is not in the devdax file"
    );
    assert!(srv.alive());
}

#[test]
fn devdax_file_smaller_than_the_l1_is_refused_naming_both_sizes() {
    let file = TempPath::file("small", L1_BYTES / 2);
    let err = Server::start_refused(&["--l1-devdax-path", file.arg(), "--shm-name", ""]);
    assert!(err.contains(file.arg()), "{err}");
    assert!(err.contains(&(L1_BYTES / 2).to_string()), "{err}");
    assert!(err.contains(&L1_BYTES.to_string()), "{err}");
    assert!(err.contains("fallocate -l"), "{err}");
}

#[test]
fn devdax_missing_path_and_directory_are_refused() {
    let missing = TempPath::new("missing");
    let err = Server::start_refused(&["--l1-devdax-path", missing.arg(), "--shm-name", ""]);
    assert!(
        err.contains(missing.arg()) && err.contains("no such file"),
        "{err}"
    );

    let dir = TempPath::new("dir");
    std::fs::create_dir(&dir.0).unwrap();
    let err = Server::start_refused(&["--l1-devdax-path", dir.arg(), "--shm-name", ""]);
    assert!(
        err.contains(dir.arg()) && err.contains("is a directory"),
        "{err}"
    );
}

#[test]
fn devdax_with_the_shm_pool_is_refused_naming_the_fix() {
    // Without devdax the arena is the SHM pool, and /status says so.
    let srv = Server::start(&[]);
    let arena = &srv.get_json("/status")["storage_manager"]["l1_manager"]["arena"];
    assert_eq!(arena["kind"], "shm", "{arena}");
    assert_eq!(
        arena["path"],
        format!("/dev/shm/{}", srv.shm_name),
        "{arena}"
    );
    drop(srv);

    let file = TempPath::file("shm", L1_BYTES);
    // Server::start's defaults name an SHM pool.
    let err = Server::start_refused(&["--l1-devdax-path", file.arg()]);
    assert!(
        err.contains("--l1-devdax-path") && err.contains("add --shm-name \"\""),
        "{err}"
    );
}

#[test]
fn devdax_file_held_by_a_running_server_is_refused() {
    let file = TempPath::file("held", L1_BYTES);
    let mut first = start_on(&file.0);
    let err = Server::start_refused(&["--l1-devdax-path", file.arg(), "--shm-name", ""]);
    assert!(err.contains("in use"), "{err}");
    assert!(first.alive(), "the first server keeps serving");
    round_trip(&first, 21);
}
