//! Start-up failures after the L1 arena exists: the server refuses the start
//! with the cause, stops what it started and leaves no shm segment behind.

mod support;

use std::net::TcpListener;
use std::path::PathBuf;

use support::*;

/// The /dev/shm file of the SHM pool that `--shm-name name` creates.
fn pool_segment(name: &str) -> PathBuf {
    PathBuf::from(format!("/dev/shm/lmcache_l1_pool_{name}"))
}

#[test]
fn a_shard_whose_l2_cannot_start_refuses_the_start_and_removes_the_shm_pool() {
    // The CA bundle is read when each shard builds its S3 client, after the
    // arena is made: a missing one fails the shards' L2, not the config.
    let missing = std::env::temp_dir()
        .join(unique("kvshard-missing-ca"))
        .join("ca.pem");
    let adapter = format!(
        r#"{{"type":"s3","s3_endpoint":"kvb.localhost:9","s3_region":"us-east-1","s3_ca_bundle":"{}","aws_access_key_id":"id","aws_secret_access_key":"secret"}}"#,
        missing.display()
    );
    let shm = unique("kvstart");
    let err = Server::start_refused(&["--shm-name", &shm, "--l2-adapter", &adapter]);
    assert!(err.contains("CA bundle"), "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(
        !pool_segment(&shm).exists(),
        "{} left behind: {err}",
        pool_segment(&shm).display()
    );
}

#[test]
fn a_busy_http_port_refuses_the_start_and_removes_the_shm_pool() {
    // Every shard is up when the HTTP bind fails: they are stopped, and the
    // last of them lets the arena go.
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let shm = unique("kvstart");
    let err = Server::start_refused(&[
        "--shm-name",
        &shm,
        "--http-host",
        "127.0.0.1",
        "--http-port",
        &port,
    ]);
    assert!(err.contains("cannot bind the HTTP server"), "{err}");
    assert!(
        !pool_segment(&shm).exists(),
        "{} left behind: {err}",
        pool_segment(&shm).display()
    );
}

#[test]
fn an_unwritable_lookup_hash_log_dir_refuses_the_start_with_the_path_and_cause() {
    // A path that cannot be a directory (its parent is a file): refused
    // whatever the permissions of the user running it.
    let file = std::env::temp_dir().join(unique("kvshard-not-a-dir"));
    std::fs::write(&file, b"").unwrap();
    let below = file.join("logs");
    let shm = unique("kvstart");
    let err = Server::start_refused(&[
        "--shm-name",
        &shm,
        "--lookup-hash-log-dir",
        below.to_str().unwrap(),
    ]);
    assert!(err.contains("--lookup-hash-log-dir"), "{err}");
    assert!(err.contains(&below.display().to_string()), "{err}");
    assert!(err.contains("Not a directory"), "{err}");
    assert!(!pool_segment(&shm).exists(), "{err}");
    std::fs::remove_file(&file).unwrap();

    // A directory that exists on a read-only file system: refused too (root
    // ignores permission bits, a read-only mount it cannot).
    let Some(ro) = Tmpfs::mount("1m", true) else {
        return;
    };
    let err = Server::start_refused(&["--lookup-hash-log-dir", ro.path.to_str().unwrap()]);
    assert!(err.contains(&ro.path.display().to_string()), "{err}");
    assert!(err.contains("Read-only file system"), "{err}");
}
