//! The `fs` adapter on a real directory: lmcache 0.5.6 file names (checked
//! against names its own code computed, tests/data/l2_golden_names.txt),
//! atomic stores, O_DIRECT and buffered I/O, locks, partial failures and
//! temporary files.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs;
use std::path::Path;
use std::slice::from_ref;

use kvshard_engine::keys::{hex, Name, ObjectKey};
use kvshard_engine::l2::config::FsConfig;
use kvshard_engine::l2::fs::FsAdapter;
use kvshard_engine::l2::naming::{file_name, parse_file_name};
use kvshard_engine::l2::{L2Adapter, ObjectBytes, StoreResult};

mod common;
use common::{join2, payload, run, TempDir};

const GOLDEN: &str = include_str!("data/l2_golden_names.txt");

/// A 4096-aligned, zeroed buffer (as L1 slab memory is).
struct Aligned {
    ptr: *mut u8,
    layout: Layout,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout = Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Aligned { ptr, layout }
    }

    fn with(bytes: &[u8]) -> Aligned {
        let a = Aligned::new(bytes.len());
        // SAFETY: the allocation holds at least bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), a.ptr, bytes.len()) };
        a
    }

    /// A view of the first `len` bytes.
    ///
    /// # Safety
    /// As [`ObjectBytes::new`]: `self` outlives, and nobody else touches it
    /// during, every adapter call that receives the view.
    unsafe fn view(&self, len: usize) -> ObjectBytes {
        assert!(len <= self.layout.size());
        // SAFETY: the allocation holds `len` bytes; the caller keeps it alive
        // and untouched for the adapter calls.
        unsafe { ObjectBytes::new(self.ptr, len) }
    }

    fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: see view().
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

fn key(model: &str, i: u32, salt: &str) -> ObjectKey {
    let mut chunk_hash = [0u8; 32];
    for (j, b) in chunk_hash.iter_mut().enumerate() {
        *b = (j as u8).wrapping_mul(13) ^ (i as u8);
    }
    chunk_hash[28..].copy_from_slice(&i.to_be_bytes());
    ObjectKey {
        chunk_hash,
        model_name: Name::intern(model).unwrap(),
        kv_rank: 0x0100_0100,
        object_group_id: 0,
        cache_salt: Name::intern(salt).unwrap(),
    }
}

fn cfg(dir: &Path) -> FsConfig {
    FsConfig {
        base_path: dir.to_string_lossy().into_owned(),
        relative_tmp_dir: None,
        read_ahead_size: None,
        use_odirect: false,
        max_capacity_gb: 0.0,
    }
}

async fn store(a: &FsAdapter, items: &[(ObjectKey, Vec<u8>)]) -> Vec<StoreResult> {
    let mut bufs: Vec<Vec<u8>> = items.iter().map(|(_, b)| b.clone()).collect();
    // SAFETY: `bufs` outlives the awaited store and nothing else touches it.
    let views: Vec<(ObjectKey, ObjectBytes)> = items
        .iter()
        .zip(bufs.iter_mut())
        .map(|((k, _), b)| (*k, unsafe { ObjectBytes::from_mut_slice(b) }))
        .collect();
    a.store(&views).await
}

/// Loads into a buffer of `len` bytes pre-filled with a marker.
async fn load(a: &FsAdapter, k: &ObjectKey, len: usize) -> (bool, Vec<u8>) {
    let mut buf = vec![0xa5u8; len];
    // SAFETY: `buf` outlives the awaited load and nothing else touches it.
    let view = unsafe { ObjectBytes::from_mut_slice(&mut buf) };
    let ok = a.load(&[(*k, view)]).await[0];
    (ok, buf)
}

fn tmp_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    v.sort();
    v
}

fn unhex(s: &str) -> [u8; 32] {
    assert_eq!(s.len(), 64, "{s}");
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

/// (key, file name) pairs of the golden file.
fn golden() -> Vec<(ObjectKey, String)> {
    let v: Vec<(ObjectKey, String)> = GOLDEN
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(f.len(), 6, "golden line: {l}");
            let k = ObjectKey {
                chunk_hash: unhex(f[0]),
                model_name: Name::intern(f[1]).unwrap(),
                kv_rank: f[2].parse().unwrap(),
                object_group_id: f[3].parse().unwrap(),
                cache_salt: Name::intern(f[4]).unwrap(),
            };
            (k, f[5].to_owned())
        })
        .collect();
    assert!(v.len() >= 12, "golden file has {} keys", v.len());
    v
}

#[test]
fn golden_names_match_lmcache_0_5_6() {
    for (k, name) in golden() {
        assert_eq!(file_name(&k), name);
        assert_eq!(parse_file_name(&name).as_ref(), Some(&k), "{name}");
    }
}

#[test]
fn store_writes_the_object_under_its_name_once() {
    let dir = TempDir::new("store");
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        assert_eq!(a.kind(), "fs");
        let k = key("org/model-7B", 1, "tenant");
        let bytes = payload(1, 10_000);
        assert_eq!(
            store(&a, &[(k, bytes.clone())]).await,
            vec![StoreResult::Stored(10_000)]
        );
        let path = dir.path().join(file_name(&k));
        assert_eq!(fs::read(&path).unwrap(), bytes);
        let mtime = fs::metadata(&path).unwrap().modified().unwrap();

        // A second store of other bytes under the same key writes nothing.
        assert_eq!(
            store(&a, &[(k, payload(2, 10_000))]).await,
            vec![StoreResult::Exists]
        );
        assert_eq!(fs::read(&path).unwrap(), bytes);
        assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), mtime);

        assert_eq!(a.lookup_and_lock(from_ref(&k)).await, vec![Some(10_000)]);
        assert_eq!(load(&a, &k, 10_000).await, (true, bytes));
        a.unlock(&[k]);
        assert!(tmp_files(dir.path()).is_empty());
        assert_eq!(a.status()["io_errors"], 0);
    });
}

#[test]
fn odirect_aligned_and_unaligned_read_back_equal() {
    let dir = TempDir::new("odirect");
    run(async {
        let mut c = cfg(dir.path());
        c.use_odirect = true;
        c.relative_tmp_dir = Some("tmp".into());
        let a = FsAdapter::new(&c, 0, 1).unwrap();
        let sizes = [4096usize, 3 * 4096, 256 * 1024, 5000];
        let srcs: Vec<Aligned> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Aligned::with(&payload(10 + i as u64, n)))
            .collect();
        let keys: Vec<ObjectKey> = (0..sizes.len() as u32)
            .map(|i| key("org/m", 100 + i, ""))
            .collect();
        let items: Vec<(ObjectKey, ObjectBytes)> = keys
            .iter()
            .zip(&srcs)
            .zip(sizes)
            // SAFETY: `srcs` outlives the awaited store; nothing writes it.
            .map(|((k, s), n)| (*k, unsafe { s.view(n) }))
            .collect();
        let res = a.store(&items).await;
        let want: Vec<StoreResult> = sizes
            .iter()
            .map(|&n| StoreResult::Stored(n as u64))
            .collect();
        assert_eq!(res, want);
        for ((k, s), n) in keys.iter().zip(&srcs).zip(sizes) {
            assert_eq!(fs::read(dir.path().join(file_name(k))).unwrap(), s.bytes(n));
        }
        let after_store = a.status();

        let dsts: Vec<Aligned> = sizes.iter().map(|&n| Aligned::new(n)).collect();
        let items: Vec<(ObjectKey, ObjectBytes)> = keys
            .iter()
            .zip(&dsts)
            .zip(sizes)
            // SAFETY: `dsts` outlives the awaited load; nothing else touches
            // it meanwhile.
            .map(|((k, d), n)| (*k, unsafe { d.view(n) }))
            .collect();
        assert_eq!(a.load(&items).await, vec![true; sizes.len()]);
        for ((s, d), n) in srcs.iter().zip(&dsts).zip(sizes) {
            assert_eq!(s.bytes(n), d.bytes(n));
        }
        // An unaligned buffer of an aligned size is read buffered.
        let (ok, got) = load(&a, &keys[1], 3 * 4096).await;
        assert!(ok);
        assert_eq!(got, srcs[1].bytes(3 * 4096));

        let st = a.status();
        assert_eq!(st["io_errors"], 0);
        // ext4/xfs/btrfs take O_DIRECT; the adapter falls back elsewhere.
        if odirect_supported(dir.path()) {
            assert_eq!(after_store["odirect_ios"], 3, "{after_store}");
            assert_eq!(after_store["buffered_ios"], 1, "{after_store}");
            assert_eq!(st["odirect_ios"], 6, "{st}");
        }
        let total = st["odirect_ios"].as_u64().unwrap() + st["buffered_ios"].as_u64().unwrap();
        assert_eq!(total, 2 * sizes.len() as u64 + 1);
        assert!(tmp_files(&dir.path().join("tmp")).is_empty());
        assert!(tmp_files(dir.path()).is_empty());
    });
}

fn odirect_supported(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join("odirect-probe");
    let r = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p);
    let _ = fs::remove_file(&p);
    r.is_ok()
}

#[test]
fn read_ahead_load_reads_everything() {
    let dir = TempDir::new("readahead");
    run(async {
        let mut c = cfg(dir.path());
        c.read_ahead_size = Some(1000);
        let a = FsAdapter::new(&c, 0, 1).unwrap();
        let k = key("m", 5, "");
        let bytes = payload(5, 70_001);
        assert_eq!(
            store(&a, &[(k, bytes.clone())]).await,
            vec![StoreResult::Stored(70_001)]
        );
        assert_eq!(load(&a, &k, 70_001).await, (true, bytes));
        // Smaller than the read-ahead: one read.
        let small = key("m", 6, "");
        assert_eq!(
            store(&a, &[(small, vec![7u8; 10])]).await,
            vec![StoreResult::Stored(10)]
        );
        assert_eq!(load(&a, &small, 10).await, (true, vec![7u8; 10]));
    });
}

#[test]
fn wrong_size_and_missing_keys_do_not_load() {
    let dir = TempDir::new("miss");
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        let k = key("m", 1, "");
        store(&a, &[(k, payload(1, 8192))]).await;
        let (ok, buf) = load(&a, &k, 8191).await;
        assert!(!ok);
        assert!(
            buf.iter().all(|&b| b == 0xa5),
            "a refused load wrote the buffer"
        );
        assert!(!load(&a, &k, 8193).await.0);
        assert!(load(&a, &k, 8192).await.0);

        let missing = key("m", 2, "");
        assert_eq!(a.lookup_and_lock(from_ref(&missing)).await, vec![None]);
        assert!(!load(&a, &missing, 8192).await.0);
        assert_eq!(a.status()["locked_keys"], 0);
        // A missing key is a miss, not an I/O error.
        assert_eq!(a.status()["io_errors"], 0);
    });
}

#[test]
fn locked_keys_are_not_deleted() {
    let dir = TempDir::new("lock");
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        let k = key("org/m", 1, "s");
        let other = key("org/m", 2, "s");
        store(&a, &[(k, payload(1, 5000)), (other, payload(2, 6000))]).await;
        let path = dir.path().join(file_name(&k));

        // Two lookups: two locks.
        assert_eq!(a.lookup_and_lock(from_ref(&k)).await, vec![Some(5000)]);
        assert_eq!(a.lookup_and_lock(from_ref(&k)).await, vec![Some(5000)]);
        assert_eq!(a.delete(&[k, other]).await, vec![None, Some(6000)]);
        assert!(path.exists());
        assert!(!dir.path().join(file_name(&other)).exists());
        a.unlock(from_ref(&k));
        assert_eq!(a.delete(from_ref(&k)).await, vec![None]);
        assert!(path.exists());
        a.unlock(from_ref(&k));
        // Unknown and no-longer-locked keys are ignored.
        a.unlock(&[k, other]);
        assert_eq!(a.delete(from_ref(&k)).await, vec![Some(5000)]);
        assert!(!path.exists());
        assert_eq!(a.delete(from_ref(&k)).await, vec![None]);
        assert_eq!(a.lookup_and_lock(&[k]).await, vec![None]);
    });
}

#[test]
fn one_bad_key_fails_alone() {
    let dir = TempDir::new("partial");
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        let good0 = key("m", 1, "");
        let bad = key(&"x".repeat(300), 2, "");
        let at = key("m@x", 3, "");
        let good1 = key("m", 4, "");
        let res = store(
            &a,
            &[
                (good0, payload(1, 4096)),
                (bad, payload(2, 4096)),
                (at, payload(3, 4096)),
                (good1, payload(4, 100)),
            ],
        )
        .await;
        assert_eq!(
            res,
            vec![
                StoreResult::Stored(4096),
                StoreResult::Failed,
                StoreResult::Failed,
                StoreResult::Stored(100),
            ]
        );
        assert_eq!(
            a.lookup_and_lock(&[good0, bad, good1]).await,
            vec![Some(4096), None, Some(100)]
        );
        a.unlock(&[good0, good1]);
        assert!(!load(&a, &bad, 4096).await.0);
        assert!(a.status()["io_errors"].as_u64().unwrap() >= 1);
        assert!(tmp_files(dir.path()).is_empty());
        let mut names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut want = vec![file_name(&good0), file_name(&good1)];
        want.sort();
        assert_eq!(names, want);
    });
}

#[test]
fn stale_tmp_files_of_dead_writers_are_removed() {
    let dir = TempDir::new("stale");
    let stale = dir.path().join("x.data.999999999.1.tmp");
    // Ours, alive: kept. Not of our naming scheme (0.5.6's): kept.
    let live = dir
        .path()
        .join(format!("y.data.{}.7.tmp", std::process::id()));
    let foreign = dir.path().join("z.tmp");
    for p in [&stale, &live, &foreign] {
        fs::write(p, b"partial").unwrap();
    }
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        assert!(!stale.exists());
        assert!(live.exists());
        assert!(foreign.exists());
        assert_eq!(a.status()["stale_tmp_removed"], 1);
    });

    // In a relative tmp dir too.
    let tmp = dir.path().join("t");
    fs::create_dir_all(&tmp).unwrap();
    let stale = tmp.join("x.data.999999999.2.tmp");
    fs::write(&stale, b"partial").unwrap();
    let mut c = cfg(dir.path());
    c.relative_tmp_dir = Some("t".into());
    run(async {
        FsAdapter::new(&c, 0, 1).unwrap();
    });
    assert!(!stale.exists());
}

#[test]
fn reads_a_directory_written_by_lmcache_0_5_6() {
    let dir = TempDir::new("golden");
    let keys = golden();
    for (i, (_, name)) in keys.iter().enumerate() {
        fs::write(dir.path().join(name), payload(i as u64, 4096 + i)).unwrap();
    }
    // 0.5.6's temporary file beside them is not an object.
    let stem = keys[0].1.strip_suffix(".data").unwrap();
    fs::write(dir.path().join(format!("{stem}.tmp")), b"x").unwrap();
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        let ks: Vec<ObjectKey> = keys.iter().map(|(k, _)| *k).collect();
        let sizes = a.lookup_and_lock(&ks).await;
        let want: Vec<Option<u64>> = (0..ks.len()).map(|i| Some(4096 + i as u64)).collect();
        assert_eq!(sizes, want);
        for (i, k) in ks.iter().enumerate() {
            assert_eq!(
                load(&a, k, 4096 + i).await,
                (true, payload(i as u64, 4096 + i)),
                "{}",
                hex(&k.chunk_hash)
            );
        }
        a.unlock(&ks);

        // All listed, in file name order, across pages.
        let mut listed = Vec::new();
        let mut cursor = None;
        let mut pages = 0;
        loop {
            let page = a.list(None, 5, cursor).await.unwrap();
            pages += 1;
            assert!(page.keys.len() <= 5);
            listed.extend(page.keys);
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        assert_eq!(pages, ks.len().div_ceil(5));
        let mut want: Vec<(String, ObjectKey, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, (k, n))| (n.clone(), *k, 4096 + i as u64))
            .collect();
        want.sort();
        let want: Vec<(ObjectKey, u64)> = want.into_iter().map(|(_, k, s)| (k, s)).collect();
        assert_eq!(listed, want);

        // By model.
        let page = a.list(Some("org/model-7B"), 100, None).await.unwrap();
        assert_eq!(page.next_cursor, None);
        let n = ks.iter().filter(|k| k.model_name == "org/model-7B").count();
        assert!(n >= 2);
        assert_eq!(page.keys.len(), n);
        assert!(page
            .keys
            .iter()
            .all(|(k, _)| k.model_name == "org/model-7B"));
        assert!(a.list(None, 0, None).await.is_err());
    });
}

#[test]
fn capacity_is_split_over_shards() {
    let dir = TempDir::new("cap");
    let mut c = cfg(dir.path());
    assert_eq!(FsAdapter::new(&c, 0, 4).unwrap().capacity_bytes(), 0);
    c.max_capacity_gb = 2.0;
    assert_eq!(FsAdapter::new(&c, 1, 4).unwrap().capacity_bytes(), 1 << 29);
    c.base_path = dir.path().join("a/b/c").to_string_lossy().into_owned();
    FsAdapter::new(&c, 0, 1).unwrap();
    assert!(dir.path().join("a/b/c").is_dir());
}

#[test]
fn concurrent_stores_of_one_key_leave_one_complete_object() {
    let dir = TempDir::new("race");
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        let b = FsAdapter::new(&cfg(dir.path()), 1, 2).unwrap();
        let k = key("m", 9, "");
        let bytes = payload(9, 1 << 20);
        let (ra, rb) = join2(
            store(&a, &[(k, bytes.clone())]),
            store(&b, &[(k, bytes.clone())]),
        )
        .await;
        let stored = [ra[0], rb[0]]
            .iter()
            .filter(|r| matches!(r, StoreResult::Stored(_)))
            .count();
        assert!(stored >= 1, "{ra:?} {rb:?}");
        assert!(
            [ra[0], rb[0]].iter().all(|r| *r != StoreResult::Failed),
            "{ra:?} {rb:?}"
        );
        assert_eq!(fs::read(dir.path().join(file_name(&k))).unwrap(), bytes);
        assert!(tmp_files(dir.path()).is_empty());
    });
}

#[test]
fn usage_is_seeded_from_what_the_directory_holds() {
    use kvshard_engine::l2::tier::L2Tier;
    let dir = TempDir::new("seed");
    run(async {
        let a = FsAdapter::new(&cfg(dir.path()), 0, 1).unwrap();
        let items: Vec<(ObjectKey, Vec<u8>)> = (0..2500)
            .map(|i| {
                (
                    key("m", i, if i % 2 == 0 { "" } else { "t" }),
                    payload(i as u64, 100),
                )
            })
            .collect();
        assert!(store(&a, &items)
            .await
            .iter()
            .all(|r| *r == StoreResult::Stored(100)));
        // A restarted server with two shards: each adopts the keys it owns,
        // over several listing pages; together they count everything once.
        let mut total_keys = 0;
        let mut total_bytes = 0;
        for shard in 0..2 {
            let tier = L2Tier::new(
                "fs#1".into(),
                Box::new(FsAdapter::new(&cfg(dir.path()), shard, 2).unwrap()),
                None,
            );
            assert_eq!(tier.usage().keys, 0);
            let adopted = tier.seed_usage(shard, 2).await.unwrap();
            let own = items.iter().filter(|(k, _)| k.shard(2) == shard).count() as u64;
            assert_eq!(adopted, own);
            let u = tier.usage();
            assert_eq!((u.keys, u.used_bytes), (own, own * 100));
            assert_eq!(
                u.bytes_by_salt.get("t").copied().unwrap_or(0),
                items
                    .iter()
                    .filter(|(k, _)| k.shard(2) == shard && k.cache_salt == "t")
                    .count() as u64
                    * 100
            );
            // Seeding again adopts nothing new.
            assert_eq!(tier.seed_usage(shard, 2).await.unwrap(), 0);
            total_keys += u.keys;
            total_bytes += u.used_bytes;
        }
        assert_eq!((total_keys, total_bytes), (2500, 250_000));
    });
}
