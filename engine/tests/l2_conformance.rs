//! One behaviour suite that every L2 adapter must pass, driven through
//! `L2Tier` as a shard drives it.
//!
//! The generic part is [`conformance`]; an adapter type contributes only a
//! [`Subject`]: how to build a fresh adapter over a new, empty backing store,
//! and one item whose store that adapter refuses while the rest of its batch
//! succeeds. Every case starts from a fresh backing store.

use std::collections::{BTreeMap, BTreeSet};

use kvshard_engine::eviction::{EvictionConfig, PolicyKind};
use kvshard_engine::keys::{Name, ObjectKey};
use kvshard_engine::l2::config::{FsConfig, MockConfig, GIB};
use kvshard_engine::l2::fs::FsAdapter;
use kvshard_engine::l2::mock::MockAdapter;
use kvshard_engine::l2::tier::L2Tier;
use kvshard_engine::l2::{L2Adapter, ObjectBytes, StoreResult};

mod common;
use common::{join2, payload, run, TempDir};

/// Size of most test objects; capacities of eviction cases are multiples of it.
const OBJ: usize = 4096;

/// Adapters over one backing store.
struct Backing {
    adapter: Box<dyn L2Adapter>,
    /// A second adapter over the same backing store (another process or an
    /// earlier run, as the tier sees it); `None` when the type cannot share one.
    twin: Option<Box<dyn L2Adapter>>,
}

/// The adapter-specific part of the suite.
struct Subject<'a> {
    kind: &'static str,
    /// Fresh, empty backing store for case `case`: room for `capacity` bytes,
    /// or generous room for `None`.
    make: &'a dyn Fn(&str, Option<u64>) -> Backing,
    /// An item that a generously sized adapter fails to store, while the other
    /// items of the same batch are stored.
    failing_item: &'a dyn Fn() -> (ObjectKey, Vec<u8>),
}

impl Subject<'_> {
    fn tier(&self, case: &str, capacity: Option<u64>, eviction: Option<EvictionConfig>) -> L2Tier {
        self.tiers(case, capacity, eviction).0
    }

    fn tiers(
        &self,
        case: &str,
        capacity: Option<u64>,
        eviction: Option<EvictionConfig>,
    ) -> (L2Tier, Option<L2Tier>) {
        let b = (self.make)(case, capacity);
        let name = format!("{}:{case}", self.kind);
        let twin = b.twin.map(|t| L2Tier::new(format!("{name}:twin"), t, None));
        (L2Tier::new(name, b.adapter, eviction), twin)
    }
}

fn key(model: &str, i: u32, salt: &str) -> ObjectKey {
    let mut chunk_hash = [0u8; 32];
    for (j, b) in chunk_hash.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(j as u8 * 7) ^ (i >> 8) as u8;
    }
    chunk_hash[..4].copy_from_slice(&i.to_le_bytes());
    ObjectKey {
        chunk_hash,
        model_name: Name::intern(model).unwrap(),
        kv_rank: 0x0001_0000,
        object_group_id: 0,
        cache_salt: Name::intern(salt).unwrap(),
    }
}

async fn store(t: &L2Tier, items: &[(ObjectKey, Vec<u8>)]) -> Vec<StoreResult> {
    let mut bufs: Vec<Vec<u8>> = items.iter().map(|(_, b)| b.clone()).collect();
    // SAFETY: `bufs` outlives the awaited store and nothing else touches it.
    let views: Vec<(ObjectKey, ObjectBytes)> = items
        .iter()
        .zip(bufs.iter_mut())
        .map(|((k, _), b)| (*k, unsafe { ObjectBytes::from_mut_slice(b) }))
        .collect();
    let res = t.store(&views).await;
    drop(views);
    drop(bufs);
    res
}

async fn store_one(t: &L2Tier, k: &ObjectKey, bytes: &[u8]) -> StoreResult {
    store(t, &[(*k, bytes.to_vec())]).await[0]
}

/// Loads each key into a fresh buffer of the given length (filled with a
/// marker byte, so an untouched buffer is not mistaken for a load).
async fn load(t: &L2Tier, items: &[(ObjectKey, usize)]) -> Vec<(bool, Vec<u8>)> {
    let mut bufs: Vec<Vec<u8>> = items.iter().map(|(_, n)| vec![0xa5; *n]).collect();
    // SAFETY: `bufs` outlives the awaited load and nothing else touches it.
    let views: Vec<(ObjectKey, ObjectBytes)> = items
        .iter()
        .zip(bufs.iter_mut())
        .map(|((k, _), b)| (*k, unsafe { ObjectBytes::from_mut_slice(b) }))
        .collect();
    let ok = t.load(&views).await;
    drop(views);
    ok.into_iter().zip(bufs).collect()
}

async fn load_one(t: &L2Tier, k: &ObjectKey, len: usize) -> (bool, Vec<u8>) {
    load(t, &[(*k, len)]).await.remove(0)
}

/// Looks a key up and unlocks it again: a touch for the tier's LRU.
async fn touch(t: &L2Tier, k: &ObjectKey) -> Option<u64> {
    let r = t.lookup_and_lock(std::slice::from_ref(k)).await[0];
    t.unlock(std::slice::from_ref(k));
    r
}

async fn conformance(s: &Subject<'_>) {
    store_then_lookup_and_load(s).await;
    missing_and_mixed_batches(s).await;
    store_of_existing_key_keeps_first_bytes(s).await;
    load_into_wrong_size_fails(s).await;
    locks_guard_against_delete(s).await;
    concurrent_store_of_one_key(s).await;
    partial_failure_in_a_batch(s).await;
    usage_accounting(s).await;
    lru_eviction(s).await;
    isolated_lru_eviction(s).await;
    list_pages(s).await;
}

/// 1. Stored objects are found with their size and load back byte for byte.
async fn store_then_lookup_and_load(s: &Subject<'_>) {
    let t = s.tier("store_load", None, None);
    let items: Vec<(ObjectKey, Vec<u8>)> = (0..4u32)
        .map(|i| {
            (
                key("m", i, ""),
                payload(i as u64 + 1, OBJ + 100 * i as usize),
            )
        })
        .collect();
    let res = store(&t, &items).await;
    let want: Vec<_> = items
        .iter()
        .map(|(_, b)| StoreResult::Stored(b.len() as u64))
        .collect();
    assert_eq!(res, want, "{}: store", s.kind);
    let keys: Vec<ObjectKey> = items.iter().map(|(k, _)| *k).collect();
    let found = t.lookup_and_lock(&keys).await;
    let want: Vec<_> = items.iter().map(|(_, b)| Some(b.len() as u64)).collect();
    assert_eq!(found, want, "{}: lookup", s.kind);
    let sized: Vec<(ObjectKey, usize)> = items.iter().map(|(k, b)| (*k, b.len())).collect();
    for ((ok, got), (k, b)) in load(&t, &sized).await.into_iter().zip(&items) {
        assert!(ok, "{}: load {k:?}", s.kind);
        assert!(got == *b, "{}: loaded bytes of {k:?} differ", s.kind);
    }
    t.unlock(&keys);
    assert_eq!(t.locked_keys(), 0);
}

/// 2. Missing keys miss everywhere; a mixed batch answers per key, in order.
async fn missing_and_mixed_batches(s: &Subject<'_>) {
    let t = s.tier("missing", None, None);
    let k: Vec<ObjectKey> = (0..4u32).map(|i| key("m", i, "")).collect();
    assert_eq!(t.lookup_and_lock(&k[..1]).await, [None], "{}", s.kind);
    assert!(!load_one(&t, &k[0], OBJ).await.0, "{}", s.kind);
    assert_eq!(t.delete(&k[..1]).await, [None], "{}", s.kind);

    let b1 = payload(11, OBJ);
    let b3 = payload(13, OBJ / 2);
    let res = store(&t, &[(k[1], b1.clone()), (k[3], b3.clone())]).await;
    assert_eq!(
        res,
        [
            StoreResult::Stored(OBJ as u64),
            StoreResult::Stored((OBJ / 2) as u64)
        ]
    );
    let found = t.lookup_and_lock(&k).await;
    assert_eq!(
        found,
        [None, Some(OBJ as u64), None, Some((OBJ / 2) as u64)],
        "{}: mixed lookup",
        s.kind
    );
    let loaded = load(
        &t,
        &[(k[0], OBJ), (k[1], OBJ), (k[2], OBJ), (k[3], OBJ / 2)],
    )
    .await;
    let oks: Vec<bool> = loaded.iter().map(|(ok, _)| *ok).collect();
    assert_eq!(oks, [false, true, false, true], "{}: mixed load", s.kind);
    assert!(
        loaded[1].1 == b1 && loaded[3].1 == b3,
        "{}: mixed load bytes",
        s.kind
    );
    t.unlock(&k);
    assert_eq!(
        t.delete(&[k[0], k[1], k[2]]).await,
        [None, Some(OBJ as u64), None],
        "{}: mixed delete",
        s.kind
    );
    assert_eq!(
        t.lookup_and_lock(&k).await,
        [None, None, None, Some((OBJ / 2) as u64)]
    );
    t.unlock(&k[3..]);
}

/// 3. A second store of a key is skipped and leaves the first bytes.
async fn store_of_existing_key_keeps_first_bytes(s: &Subject<'_>) {
    let t = s.tier("exists", None, None);
    let k = key("m", 1, "");
    let first = payload(21, OBJ);
    assert_eq!(
        store_one(&t, &k, &first).await,
        StoreResult::Stored(OBJ as u64)
    );
    assert_eq!(
        store_one(&t, &k, &payload(22, OBJ)).await,
        StoreResult::Exists,
        "{}",
        s.kind
    );
    assert_eq!(
        store_one(&t, &k, &payload(23, OBJ * 2)).await,
        StoreResult::Exists,
        "{}: existing key, other size",
        s.kind
    );
    let (ok, got) = load_one(&t, &k, OBJ).await;
    assert!(ok && got == first, "{}: first bytes kept", s.kind);
    assert_eq!(t.usage().used_bytes, OBJ as u64, "{}", s.kind);
    assert_eq!(t.usage().keys, 1, "{}", s.kind);
}

/// 4. A buffer whose size differs from the object's is not a load.
async fn load_into_wrong_size_fails(s: &Subject<'_>) {
    let t = s.tier("wrong_size", None, None);
    let k = key("m", 1, "");
    let b = payload(31, OBJ);
    assert_eq!(store_one(&t, &k, &b).await, StoreResult::Stored(OBJ as u64));
    assert!(
        !load_one(&t, &k, OBJ - 1).await.0,
        "{}: smaller buffer",
        s.kind
    );
    assert!(
        !load_one(&t, &k, OBJ + 1).await.0,
        "{}: larger buffer",
        s.kind
    );
    assert!(
        !load_one(&t, &k, 2 * OBJ).await.0,
        "{}: double buffer",
        s.kind
    );
    let (ok, got) = load_one(&t, &k, OBJ).await;
    assert!(ok && got == b, "{}: right size still loads", s.kind);
    assert_eq!(t.stats().load_failed_keys, 3);
}

/// 5. Lookup locks hold off deletion until unlocked; stray unlocks are harmless.
async fn locks_guard_against_delete(s: &Subject<'_>) {
    let t = s.tier("locks", None, None);
    let k = key("m", 1, "");
    let other = key("m", 2, "");
    let b = payload(41, OBJ);
    assert_eq!(store_one(&t, &k, &b).await, StoreResult::Stored(OBJ as u64));
    // Unlocks of unknown and of never-locked keys change nothing.
    t.unlock(&[key("m", 99, ""), key("nobody", 1, "x")]);
    t.unlock(std::slice::from_ref(&k));
    assert_eq!(
        t.lookup_and_lock(std::slice::from_ref(&k)).await,
        [Some(OBJ as u64)]
    );
    assert_eq!(t.locked_keys(), 1);
    assert_eq!(
        t.delete(&[k, other]).await,
        [None, None],
        "{}: locked key deleted",
        s.kind
    );
    assert_eq!(
        t.usage().used_bytes,
        OBJ as u64,
        "{}: locked key still accounted",
        s.kind
    );
    let (ok, got) = load_one(&t, &k, OBJ).await;
    assert!(ok && got == b, "{}: locked key still loads", s.kind);
    // Two locks need two unlocks.
    assert_eq!(
        t.lookup_and_lock(std::slice::from_ref(&k)).await,
        [Some(OBJ as u64)]
    );
    t.unlock(std::slice::from_ref(&k));
    assert_eq!(
        t.delete(std::slice::from_ref(&k)).await,
        [None],
        "{}: one lock left",
        s.kind
    );
    t.unlock(std::slice::from_ref(&k));
    assert_eq!(t.locked_keys(), 0);
    assert_eq!(
        t.delete(std::slice::from_ref(&k)).await,
        [Some(OBJ as u64)],
        "{}",
        s.kind
    );
    assert_eq!(
        t.lookup_and_lock(std::slice::from_ref(&k)).await,
        [None],
        "{}",
        s.kind
    );
    assert!(
        !load_one(&t, &k, OBJ).await.0,
        "{}: deleted key loads",
        s.kind
    );
    assert_eq!(t.usage().used_bytes, 0);
    assert_eq!(t.usage().keys, 0);
}

/// 6. Two stores of one key at once leave one complete object, counted once.
async fn concurrent_store_of_one_key(s: &Subject<'_>) {
    let t = s.tier("concurrent", None, None);
    // Large enough for writes through blocking threads to overlap.
    let len = 1 << 20;
    for round in 0..4u32 {
        let k = key("m", round, "");
        let a = payload(61 + 2 * round as u64, len);
        let b = payload(62 + 2 * round as u64, len);
        let (ra, rb) = join2(store_one(&t, &k, &a), store_one(&t, &k, &b)).await;
        for r in [ra, rb] {
            assert!(
                matches!(r, StoreResult::Stored(n) if n == len as u64) || r == StoreResult::Exists,
                "{}: concurrent store answered {r:?}",
                s.kind
            );
        }
        assert!(
            matches!(ra, StoreResult::Stored(_)) || matches!(rb, StoreResult::Stored(_)),
            "{}: neither concurrent store stored ({ra:?}, {rb:?})",
            s.kind
        );
        let (ok, got) = load_one(&t, &k, len).await;
        assert!(
            ok,
            "{}: round {round}: no object after concurrent stores",
            s.kind
        );
        assert!(
            got == a || got == b,
            "{}: round {round}: object is a mix",
            s.kind
        );
        // Stored only when nothing held the key before: a key answered
        // Exists must hold the other store's bytes.
        if ra == StoreResult::Exists {
            assert!(got == b, "{}: round {round}", s.kind);
        }
        if rb == StoreResult::Exists {
            assert!(got == a, "{}: round {round}", s.kind);
        }
        let u = t.usage();
        assert_eq!(u.keys, round as u64 + 1, "{}: counted once", s.kind);
        assert_eq!(u.used_bytes, (round as u64 + 1) * len as u64, "{}", s.kind);
    }
}

/// 7. One failing item does not fail its batch, and leaves nothing behind.
async fn partial_failure_in_a_batch(s: &Subject<'_>) {
    let t = s.tier("partial_failure", None, None);
    let (bad, bad_bytes) = (s.failing_item)();
    let good0 = (key("m", 1, ""), payload(71, OBJ));
    let good1 = (key("m", 2, ""), payload(72, OBJ));
    let res = store(
        &t,
        &[good0.clone(), (bad, bad_bytes.clone()), good1.clone()],
    )
    .await;
    assert_eq!(
        res,
        [
            StoreResult::Stored(OBJ as u64),
            StoreResult::Failed,
            StoreResult::Stored(OBJ as u64)
        ],
        "{}: batch with one failing item",
        s.kind
    );
    assert_eq!(
        t.lookup_and_lock(&[good0.0, bad, good1.0]).await,
        [Some(OBJ as u64), None, Some(OBJ as u64)],
        "{}: failed item visible",
        s.kind
    );
    t.unlock(&[good0.0, good1.0]);
    assert!(!load_one(&t, &bad, bad_bytes.len()).await.0, "{}", s.kind);
    for (k, b) in [&good0, &good1] {
        let (ok, got) = load_one(&t, k, OBJ).await;
        assert!(ok && got == *b, "{}: good item of a failing batch", s.kind);
    }
    let u = t.usage();
    assert_eq!((u.keys, u.used_bytes), (2, 2 * OBJ as u64), "{}", s.kind);
    assert_eq!(t.stats().store_failed_keys, 1);
}

/// 8. The tier's usage follows stores, deletes and adopted lookups, by salt.
async fn usage_accounting(s: &Subject<'_>) {
    let (t, twin) = s.tiers("usage", None, None);
    let a1 = key("m", 1, "a");
    let a2 = key("m", 2, "a");
    let b1 = key("m", 3, "b");
    let items = [
        (a1, payload(81, OBJ)),
        (a2, payload(82, 1000)),
        (b1, payload(83, 3000)),
    ];
    store(&t, &items).await;
    let u = t.usage();
    assert_eq!(u.used_bytes, (OBJ + 4000) as u64, "{}", s.kind);
    assert_eq!(u.keys, 3);
    assert_eq!(
        u.bytes_by_salt,
        BTreeMap::from([
            ("a".to_string(), (OBJ + 1000) as u64),
            ("b".to_string(), 3000)
        ]),
        "{}",
        s.kind
    );
    // Skipped stores add nothing.
    store(&t, &items[..1]).await;
    assert_eq!(t.usage(), u, "{}: Exists counted", s.kind);
    assert_eq!(
        t.delete(std::slice::from_ref(&a1)).await,
        [Some(OBJ as u64)]
    );
    let u = t.usage();
    assert_eq!((u.used_bytes, u.keys), (4000, 2), "{}", s.kind);
    assert_eq!(u.bytes_by_salt.get("a"), Some(&1000));
    assert_eq!(t.delete(std::slice::from_ref(&b1)).await, [Some(3000)]);
    let u = t.usage();
    assert_eq!(
        u.bytes_by_salt.get("b"),
        None,
        "{}: emptied salt kept",
        s.kind
    );
    assert_eq!((u.used_bytes, u.keys), (1000, 1));

    let Some(twin) = twin else {
        eprintln!(
            "{}: backing store not shareable; adoption not tested",
            s.kind
        );
        return;
    };
    // Stored by someone else: unknown to this tier until a lookup finds it.
    let c = key("m", 4, "c");
    assert_eq!(
        store_one(&twin, &c, &payload(84, 2000)).await,
        StoreResult::Stored(2000)
    );
    assert_eq!(t.usage().used_bytes, 1000, "{}", s.kind);
    assert_eq!(
        t.lookup_and_lock(std::slice::from_ref(&c)).await,
        [Some(2000)],
        "{}",
        s.kind
    );
    t.unlock(std::slice::from_ref(&c));
    let u = t.usage();
    assert_eq!((u.used_bytes, u.keys), (3000, 2), "{}: not adopted", s.kind);
    assert_eq!(u.bytes_by_salt.get("c"), Some(&2000));
    // A second hit does not count it twice.
    touch(&t, &c).await;
    assert_eq!(t.usage().used_bytes, 3000);
    assert_eq!(t.delete(std::slice::from_ref(&c)).await, [Some(2000)]);
    assert_eq!(t.usage().used_bytes, 1000);
}

fn eviction(policy: PolicyKind) -> Option<EvictionConfig> {
    Some(EvictionConfig {
        policy,
        trigger_watermark: 0.5,
        eviction_ratio: 0.5,
    })
}

/// 9a. LRU: over the watermark, a tick deletes the least recently used
/// unlocked keys; locked keys stay whatever their age.
async fn lru_eviction(s: &Subject<'_>) {
    let t = s.tier("lru", Some(4 * OBJ as u64), eviction(PolicyKind::Lru));
    assert_eq!(
        t.usage().capacity_bytes,
        4 * OBJ as u64,
        "{}: capacity",
        s.kind
    );
    let k: Vec<ObjectKey> = (0..4u32).map(|i| key("m", i, "")).collect();
    let bytes: Vec<Vec<u8>> = (0..4).map(|i| payload(90 + i, OBJ)).collect();
    assert_eq!(
        store_one(&t, &k[0], &bytes[0]).await,
        StoreResult::Stored(OBJ as u64)
    );
    let out = t.evict_tick().await;
    assert!(
        !out.triggered && out.evicted_keys == 0,
        "{}: under the watermark",
        s.kind
    );

    // k0 is the oldest and stays locked.
    assert_eq!(t.lookup_and_lock(&k[..1]).await, [Some(OBJ as u64)]);
    for i in 1..4 {
        assert_eq!(
            store_one(&t, &k[i], &bytes[i]).await,
            StoreResult::Stored(OBJ as u64)
        );
    }
    // Touching k1 makes k2 and k3 the least recently used unlocked keys.
    assert_eq!(touch(&t, &k[1]).await, Some(OBJ as u64));
    let out = t.evict_tick().await;
    assert!(out.triggered, "{}: full tier not evicted", s.kind);
    assert_eq!(
        (out.evicted_keys, out.evicted_bytes),
        (2, 2 * OBJ as u64),
        "{}",
        s.kind
    );
    assert_eq!(
        t.lookup_and_lock(&k[2..]).await,
        [None, None],
        "{}: LRU keys kept",
        s.kind
    );
    assert_eq!(t.usage().used_bytes, 2 * OBJ as u64);

    // Still at the watermark: the next tick passes over locked k0 for k1.
    let out = t.evict_tick().await;
    assert_eq!(
        (out.evicted_keys, out.evicted_bytes),
        (1, OBJ as u64),
        "{}",
        s.kind
    );
    let out = t.evict_tick().await;
    assert!(!out.triggered, "{}: evicted below the watermark", s.kind);
    let found = t.lookup_and_lock(&k[..2]).await;
    assert_eq!(
        found,
        [Some(OBJ as u64), None],
        "{}: locked key evicted",
        s.kind
    );
    t.unlock(&k[..1]);
    t.unlock(&k[..1]);
    assert_eq!(t.locked_keys(), 0);
    let (ok, got) = load_one(&t, &k[0], OBJ).await;
    assert!(ok && got == bytes[0], "{}", s.kind);
}

/// 9b. IsolatedLRU: salts without a quota are wiped, salts within their
/// quota kept, salts over it trimmed oldest first.
async fn isolated_lru_eviction(s: &Subject<'_>) {
    let t = s.tier("isolated_lru", None, eviction(PolicyKind::IsolatedLru));
    let kept: Vec<ObjectKey> = (0..2u32).map(|i| key("m", i, "kept")).collect();
    let wiped: Vec<ObjectKey> = (2..4u32).map(|i| key("m", i, "wiped")).collect();
    t.set_quota("kept", 10 * OBJ as u64);
    for (i, k) in kept.iter().chain(&wiped).enumerate() {
        let r = store_one(&t, k, &payload(100 + i as u64, OBJ)).await;
        assert_eq!(r, StoreResult::Stored(OBJ as u64));
    }
    let out = t.evict_tick().await;
    assert_eq!(
        (out.evicted_keys, out.evicted_bytes),
        (2, 2 * OBJ as u64),
        "{}",
        s.kind
    );
    assert_eq!(
        t.lookup_and_lock(&wiped).await,
        [None, None],
        "{}: salt without quota",
        s.kind
    );
    let u = t.usage();
    assert_eq!(
        u.bytes_by_salt,
        BTreeMap::from([("kept".to_string(), 2 * OBJ as u64)]),
        "{}",
        s.kind
    );

    // Within quota: nothing happens.
    assert_eq!(t.evict_tick().await.evicted_keys, 0, "{}", s.kind);
    // At half of a smaller quota (the watermark): the older key goes.
    t.set_quota("kept", 4 * OBJ as u64);
    let out = t.evict_tick().await;
    assert_eq!(out.evicted_keys, 1, "{}: salt at its watermark", s.kind);
    assert_eq!(
        t.lookup_and_lock(&kept).await,
        [None, Some(OBJ as u64)],
        "{}: not the oldest of the salt",
        s.kind
    );
    t.unlock(&kept[1..]);
    // Without a quota the salt may keep nothing.
    t.remove_quota("kept");
    assert_eq!(
        t.evict_tick().await.evicted_keys,
        1,
        "{}: quota removed",
        s.kind
    );
    assert_eq!(t.usage().used_bytes, 0);
    assert_eq!(t.lookup_and_lock(&kept[1..]).await, [None]);
}

/// 10. Listing pages through one model's keys, each exactly once.
async fn list_pages(s: &Subject<'_>) {
    let t = s.tier("list", None, None);
    let model = "org/model-a";
    let mine: Vec<ObjectKey> = (0..5u32).map(|i| key(model, i, "")).collect();
    let theirs = key("org/model-b", 9, "");
    let mut items: Vec<(ObjectKey, Vec<u8>)> = mine
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, payload(110 + i as u64, 1000 + i)))
        .collect();
    items.push((theirs, payload(120, 999)));
    store(&t, &items).await;

    let mut seen: Vec<(ObjectKey, u64)> = Vec::new();
    let mut cursor = None;
    let mut pages = 0;
    loop {
        pages += 1;
        assert!(pages <= 5, "{}: listing does not end", s.kind);
        let page = t.list(Some(model), 2, cursor.take()).await.expect("list");
        assert!(
            page.keys.len() <= 2,
            "{}: page of {}",
            s.kind,
            page.keys.len()
        );
        seen.extend(page.keys);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    let want: BTreeSet<(ObjectKey, u64)> = mine
        .iter()
        .enumerate()
        .map(|(i, k)| (*k, 1000 + i as u64))
        .collect();
    assert_eq!(seen.len(), 5, "{}: listed {seen:?}", s.kind);
    assert_eq!(
        seen.into_iter().collect::<BTreeSet<_>>(),
        want,
        "{}",
        s.kind
    );

    let all = t.list(None, 100, None).await.expect("list all");
    assert_eq!(all.keys.len(), 6, "{}: unfiltered list", s.kind);
    assert!(all.next_cursor.is_none());
    assert!(all.keys.contains(&(theirs, 999)));
    let none = t.list(Some("org/model-c"), 2, None).await.expect("list");
    assert!(
        none.keys.is_empty() && none.next_cursor.is_none(),
        "{}",
        s.kind
    );
}

#[test]
fn mock_conforms() {
    const ROOMY: u64 = 16 << 20;
    let cfg = |capacity: u64| MockConfig {
        max_size_gb: capacity as f64 / GIB,
        mock_bandwidth_gb: 100.0,
        mock_load_latency_ms: 0,
    };
    let make = |_case: &str, capacity: Option<u64>| Backing {
        adapter: Box::new(MockAdapter::new(&cfg(capacity.unwrap_or(ROOMY)), 0, 1)),
        twin: None,
    };
    // More than the whole capacity: never fits, whatever else is stored.
    let failing_item = || (key("m", 7777, ""), payload(7777, ROOMY as usize + 1));
    run(conformance(&Subject {
        kind: "mock",
        make: &make,
        failing_item: &failing_item,
    }));
}

fn fs_subject_run(tag: &str, relative_tmp_dir: Option<&str>) {
    let root = TempDir::new(tag);
    let cfg = |case: &str, capacity: Option<u64>| FsConfig {
        base_path: root.path().join(case).to_string_lossy().into_owned(),
        relative_tmp_dir: relative_tmp_dir.map(str::to_owned),
        read_ahead_size: None,
        use_odirect: false,
        max_capacity_gb: capacity.map_or(0.0, |c| c as f64 / GIB),
    };
    let make = |case: &str, capacity: Option<u64>| {
        let c = cfg(case, capacity);
        Backing {
            adapter: Box::new(FsAdapter::new(&c, 0, 1).expect("fs adapter")),
            twin: Some(Box::new(
                FsAdapter::new(&c, 0, 1).expect("second fs adapter"),
            )),
        }
    };
    // A file name over NAME_MAX (255 bytes): the write fails with ENAMETOOLONG.
    let failing_item = || (key(&"x".repeat(300), 1, ""), payload(7777, OBJ));
    run(conformance(&Subject {
        kind: "fs",
        make: &make,
        failing_item: &failing_item,
    }));
}

#[test]
fn fs_conforms() {
    fs_subject_run("fs", None);
}

#[test]
fn fs_with_tmp_dir_conforms() {
    fs_subject_run("fs-tmp", Some("tmp"));
}

#[path = "../../tests/support/s3s.rs"]
#[allow(dead_code)]
mod s3s;

#[test]
fn s3_conforms() {
    use kvshard_engine::l2::config::S3Config;
    use kvshard_engine::l2::s3::{S3Adapter, S3Store};
    use std::rc::Rc;
    let server = s3s::S3sFs::start(&["conformance"]);
    // Every case gets its own key prefix in the bucket: a fresh, empty store.
    let cfg = |case: &str, capacity: Option<u64>| S3Config {
        endpoint: format!("conformance.localhost:{}", server.port),
        region: "us-east-1".into(),
        num_io_threads: 16,
        prefer_http2: false,
        enable_s3express: false,
        disable_tls: true,
        static_credentials: Some((
            s3s::S3_ACCESS_KEY.into(),
            kvshard_engine::l2::config::Secret(s3s::S3_SECRET_KEY.into()),
        )),
        max_capacity_gb: capacity.map_or(0.0, |c| c as f64 / GIB),
        endpoint_url: None,
        ca_bundle: None,
        key_prefix: format!("suite/{case}"),
        request_timeout_secs: 10.0,
        max_inflight_requests: 16,
        seed_usage_on_start: false,
        breaker_initial_cooldown_s: 5.0,
        breaker_max_cooldown_s: 300.0,
    };
    let adapter = |c: &S3Config| -> Box<dyn L2Adapter> {
        let store = S3Store::connect(c, 1).expect("S3 client");
        Box::new(S3Adapter::new(c, Rc::new(store), 0, 1))
    };
    let make = |case: &str, capacity: Option<u64>| {
        let c = cfg(case, capacity);
        Backing {
            adapter: adapter(&c),
            twin: Some(adapter(&c)),
        }
    };
    // A model name whose object name is one path component longer than the
    // server's file system allows (NAME_MAX): the PUT fails.
    let failing_item = || (key(&"x".repeat(300), 1, ""), payload(7777, OBJ));
    run(conformance(&Subject {
        kind: "s3",
        make: &make,
        failing_item: &failing_item,
    }));
}

#[path = "../../tests/support/redis.rs"]
#[allow(dead_code)]
mod redis;

/// The default user may write only keys that start with `prefix` followed
/// by anything but `x`: the store of a model named `x...` is refused
/// (NOPERM) while the rest of its batch is stored.
fn refuse_x_writes(port: u16, prefix: &str) {
    let pattern = format!("%W~{prefix}[^x]*");
    let r = redis::redis_command(
        port,
        &[
            "ACL",
            "SETUSER",
            "default",
            "on",
            "nopass",
            "+@all",
            "resetkeys",
            "%R~*",
            &pattern,
        ],
    );
    assert_eq!(r, "OK", "ACL SETUSER");
}

fn resp_config(
    flavor: kvshard_engine::l2::config::RespFlavor,
    nodes: Vec<(String, u16)>,
    cluster_mode: bool,
    key_prefix: String,
    capacity: Option<u64>,
) -> kvshard_engine::l2::config::RespConfig {
    kvshard_engine::l2::config::RespConfig {
        flavor,
        nodes,
        cluster_mode,
        username: None,
        password: None,
        key_prefix,
        num_workers: 4,
        tls_enable: false,
        tls_ca_bundle: None,
        database_id: None,
        request_timeout_secs: 10.0,
        connection_timeout_secs: 10.0,
        max_capacity_gb: capacity.map_or(0.0, |c| c as f64 / GIB),
        ttl_seconds: None,
        breaker_initial_cooldown_s: 5.0,
        breaker_max_cooldown_s: 300.0,
    }
}

fn resp_adapter(c: &kvshard_engine::l2::config::RespConfig) -> Box<dyn L2Adapter> {
    Box::new(kvshard_engine::l2::resp::RespAdapter::new(c, 0, 1).expect("resp adapter"))
}

/// The model name whose stores [`refuse_x_writes`] refuses.
fn failing_resp_item() -> (ObjectKey, Vec<u8>) {
    (key("xmodel", 1, ""), payload(7777, OBJ))
}

/// `resp` on one server: every case starts from an empty server (FLUSHALL),
/// as 0.5.6's resp adapter has no key prefix.
#[test]
fn resp_conforms() {
    use kvshard_engine::l2::config::RespFlavor;
    let server = redis::RedisServer::start(&[]);
    refuse_x_writes(server.port, "");
    let make = |_case: &str, capacity: Option<u64>| {
        assert_eq!(server.command(&["FLUSHALL"]), "OK");
        let c = resp_config(
            RespFlavor::Resp,
            vec![("127.0.0.1".into(), server.port)],
            false,
            String::new(),
            capacity,
        );
        Backing {
            adapter: resp_adapter(&c),
            twin: Some(resp_adapter(&c)),
        }
    };
    run(conformance(&Subject {
        kind: "resp",
        make: &make,
        failing_item: &failing_resp_item,
    }));
}

/// `valkey` on `ports` (one server, or a cluster's nodes): every case has
/// its own key prefix.
fn valkey_subject_run(kind: &'static str, ports: &[u16], cluster_mode: bool) {
    use kvshard_engine::l2::config::RespFlavor;
    let make = |case: &str, capacity: Option<u64>| {
        let prefix = format!("suite-{case}");
        for p in ports {
            refuse_x_writes(*p, &format!("{prefix}@"));
        }
        let nodes = ports.iter().map(|p| ("127.0.0.1".to_owned(), *p)).collect();
        let c = resp_config(RespFlavor::Valkey, nodes, cluster_mode, prefix, capacity);
        Backing {
            adapter: resp_adapter(&c),
            twin: Some(resp_adapter(&c)),
        }
    };
    run(conformance(&Subject {
        kind,
        make: &make,
        failing_item: &failing_resp_item,
    }));
}

#[test]
fn valkey_conforms() {
    let server = redis::RedisServer::start(&[]);
    valkey_subject_run("valkey", &[server.port], false);
}

/// `valkey` with `cluster_mode` on 3 masters with a replica each: keys
/// spread over every master, listings visit them all.
#[test]
fn valkey_cluster_conforms() {
    let cluster = redis::RedisCluster::start(3, 1);
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    valkey_subject_run("valkey-cluster", &ports, true);
}
