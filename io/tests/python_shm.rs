//! engine_driven clients map the L1 arena with Python's
//! `multiprocessing.shared_memory.SharedMemory(name, create=False)`; check that
//! exact call sees the server's bytes and that its writes reach the server.

use std::process::Command;

use kvshard_io::arena::{Arena, ArenaConfig, HugePages};

const SCRIPT: &str = r#"
import sys
from multiprocessing import shared_memory, resource_tracker
name, size = sys.argv[1], int(sys.argv[2])
shm = shared_memory.SharedMemory(name=name, create=False)
# Python < 3.13 registers attached segments with its resource tracker, which
# would unlink the server's segment when this process exits.
resource_tracker.unregister(shm._name, "shared_memory")
assert shm.size >= size, (shm.size, size)
sys.stdout.write(bytes(shm.buf[100:105]).decode())
shm.buf[size - 3:size] = b"py!"
shm.close()
"#;

#[test]
fn python_shared_memory_client_sees_the_arena() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("python3 not found: skipping the Python SharedMemory check");
        return;
    }
    let name = format!("kvshard_pytest_{}", std::process::id());
    let size: u64 = 2 * 4096 + 17;
    let arena = Arena::create(&ArenaConfig {
        size_bytes: size,
        shm_name: Some(name.clone()),
        mlock: false,
        populate: false,
        huge_pages: HugePages::Off,
    })
    .unwrap();
    unsafe { arena.slice_mut(100, 5) }.copy_from_slice(b"hello");

    let out = Command::new("python3")
        .args(["-c", SCRIPT, &name, &size.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello");
    assert_eq!(unsafe { arena.slice(size - 3, 3) }, b"py!");
    assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
    drop(arena);
    assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
}
