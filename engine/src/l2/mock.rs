//! The `mock` adapter: objects held in this shard's memory, with a capacity
//! and a simulated bandwidth, as lmcache 0.5.6's `MockL2Adapter`.
//!
//! The configured capacity and bandwidth are the whole server's; each shard
//! gets an equal share of both, so N shards together behave like one 0.5.6
//! adapter. Copies happen on the executor thread (they are memcpy, not I/O);
//! the bandwidth is simulated by a timer after the copy, so other requests of
//! the shard keep running meanwhile. A load latency (`mock_load_latency_ms`,
//! kvshard only) delays each load before its copy, so the buffer is written
//! at the end of the wait, as by a slow read.
//!
//! Unlike 0.5.6, a key locked by `lookup_and_lock` is not deleted until it is
//! unlocked, as the [`L2Adapter`] contract requires of every adapter.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::ready;
use std::io;
use std::time::{Duration, Instant};

use crate::keys::ObjectKey;

use super::config::{MockConfig, GIB};
use super::{KeyPage, L2Adapter, LocalFut, ObjectBytes, StoreResult};

struct Entry {
    bytes: Vec<u8>,
    locks: u32,
}

#[derive(Default)]
struct State {
    objects: HashMap<ObjectKey, Entry>,
    used_bytes: u64,
}

pub struct MockAdapter {
    shard: usize,
    capacity_bytes: u64,
    /// This shard's share of the bandwidth; 0 = no simulated delay.
    bandwidth_bytes_per_s: f64,
    /// Wait of every load before it writes its buffers.
    load_latency: Duration,
    state: RefCell<State>,
}

impl MockAdapter {
    /// This shard's adapter: `1/num_shards` of the configured capacity and
    /// bandwidth.
    pub fn new(cfg: &MockConfig, shard: usize, num_shards: usize) -> MockAdapter {
        let shards = num_shards.max(1) as f64;
        let share = |gb: f64| {
            let v = gb * GIB / shards;
            if v.is_finite() && v > 0.0 {
                v
            } else {
                0.0
            }
        };
        MockAdapter {
            shard,
            capacity_bytes: share(cfg.max_size_gb) as u64,
            bandwidth_bytes_per_s: share(cfg.mock_bandwidth_gb),
            load_latency: Duration::from_millis(cfg.mock_load_latency_ms),
            state: RefCell::new(State::default()),
        }
    }

    /// Waits until moving `bytes` has taken as long as the simulated bandwidth
    /// allows, counting the time already spent since `start`.
    async fn pace(&self, bytes: u64, start: Instant) {
        if bytes == 0 || self.bandwidth_bytes_per_s <= 0.0 {
            return;
        }
        let wanted = Duration::from_secs_f64(bytes as f64 / self.bandwidth_bytes_per_s);
        if let Some(left) = wanted.checked_sub(start.elapsed()) {
            if !left.is_zero() {
                glommio::timer::sleep(left).await;
            }
        }
    }

    fn store_now(&self, items: &[(ObjectKey, ObjectBytes)]) -> (Vec<StoreResult>, u64) {
        let mut st = self.state.borrow_mut();
        let mut results = Vec::with_capacity(items.len());
        let mut copied = 0u64;
        let mut failed = 0usize;
        let mut first_failure: Option<(&ObjectKey, u64, u64)> = None;
        for (key, obj) in items {
            let size = obj.len() as u64;
            if st.objects.contains_key(key) {
                results.push(StoreResult::Exists);
                continue;
            }
            if size > self.capacity_bytes.saturating_sub(st.used_bytes) {
                failed += 1;
                if first_failure.is_none() {
                    first_failure = Some((key, size, st.used_bytes));
                }
                results.push(StoreResult::Failed);
                continue;
            }
            // SAFETY: the caller keeps the object's memory valid and unwritten
            // until this call resolves (ObjectBytes contract); it is copied here.
            let bytes = unsafe { obj.as_slice() }.to_vec();
            st.objects.insert(*key, Entry { bytes, locks: 0 });
            st.used_bytes += size;
            copied += size;
            results.push(StoreResult::Stored(size));
        }
        if let Some((key, size, used)) = first_failure {
            kvshard_io::log_limited!(
                log::Level::Warn,
                "L2 mock (shard {}): not enough capacity for {} of {} objects, first {:?} \
                 ({} bytes; used {} of {} bytes)",
                self.shard,
                failed,
                items.len(),
                key,
                size,
                used,
                self.capacity_bytes
            );
        }
        (results, copied)
    }

    fn load_now(&self, items: &[(ObjectKey, ObjectBytes)]) -> (Vec<bool>, u64) {
        let st = self.state.borrow();
        let mut copied = 0u64;
        let results = items
            .iter()
            .map(|(key, buf)| {
                let Some(entry) = st.objects.get(key) else {
                    return false;
                };
                if entry.bytes.len() != buf.len() {
                    kvshard_io::log_limited!(
                        log::Level::Warn,
                        "L2 mock (shard {}): {:?} holds {} bytes, the load buffer has {}",
                        self.shard,
                        key,
                        entry.bytes.len(),
                        buf.len()
                    );
                    return false;
                }
                // SAFETY: the caller keeps the buffer valid and untouched by
                // others until this call resolves (ObjectBytes contract).
                unsafe { buf.as_mut_slice() }.copy_from_slice(&entry.bytes);
                copied += buf.len() as u64;
                true
            })
            .collect();
        (results, copied)
    }
}

impl L2Adapter for MockAdapter {
    fn kind(&self) -> &'static str {
        "mock"
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn store<'a>(
        &'a self,
        items: &'a [(ObjectKey, ObjectBytes)],
    ) -> LocalFut<'a, Vec<StoreResult>> {
        Box::pin(async move {
            let start = Instant::now();
            // Copy before the first await: the object is in the map, complete,
            // before any other request of the shard can run, so a concurrent
            // store of the same key sees it and answers Exists.
            let (results, copied) = self.store_now(items);
            self.pace(copied, start).await;
            results
        })
    }

    fn lookup_and_lock<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>> {
        let mut st = self.state.borrow_mut();
        let res = keys
            .iter()
            .map(|key| {
                st.objects.get_mut(key).map(|e| {
                    e.locks = e.locks.saturating_add(1);
                    e.bytes.len() as u64
                })
            })
            .collect();
        Box::pin(ready(res))
    }

    fn load<'a>(&'a self, items: &'a [(ObjectKey, ObjectBytes)]) -> LocalFut<'a, Vec<bool>> {
        Box::pin(async move {
            if !self.load_latency.is_zero() {
                glommio::timer::sleep(self.load_latency).await;
            }
            let start = Instant::now();
            let (results, copied) = self.load_now(items);
            self.pace(copied, start).await;
            results
        })
    }

    fn unlock(&self, keys: &[ObjectKey]) {
        let mut st = self.state.borrow_mut();
        for key in keys {
            if let Some(e) = st.objects.get_mut(key) {
                e.locks = e.locks.saturating_sub(1);
            }
        }
    }

    fn delete<'a>(&'a self, keys: &'a [ObjectKey]) -> LocalFut<'a, Vec<Option<u64>>> {
        let mut st = self.state.borrow_mut();
        let mut res = Vec::with_capacity(keys.len());
        for key in keys {
            let freed = match st.objects.get(key) {
                Some(e) if e.locks > 0 => {
                    log::debug!(
                        "L2 mock (shard {}): {:?} not deleted, {} lock(s) held",
                        self.shard,
                        key,
                        e.locks
                    );
                    None
                }
                Some(_) => st.objects.remove(key).map(|e| e.bytes.len() as u64),
                None => None,
            };
            if let Some(size) = freed {
                st.used_bytes -= size;
            }
            res.push(freed);
        }
        Box::pin(ready(res))
    }

    fn list<'a>(
        &'a self,
        model_name: Option<&'a str>,
        page_size: usize,
        cursor: Option<String>,
    ) -> LocalFut<'a, io::Result<KeyPage>> {
        if page_size == 0 {
            return Box::pin(ready(Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "list page size must be at least 1",
            ))));
        }
        let st = self.state.borrow();
        let mut found: Vec<(String, &ObjectKey, u64)> = st
            .objects
            .iter()
            .filter(|(k, _)| model_name.is_none_or(|m| k.model_name == m))
            .map(|(k, e)| (k.file_stem(), k, e.bytes.len() as u64))
            .filter(|(stem, _, _)| cursor.as_deref().is_none_or(|c| stem.as_str() > c))
            .collect();
        found.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let more = found.len() > page_size;
        found.truncate(page_size);
        let page = KeyPage {
            next_cursor: if more {
                found.last().map(|(stem, _, _)| stem.clone())
            } else {
                None
            },
            keys: found.into_iter().map(|(_, k, size)| (*k, size)).collect(),
            modified: Vec::new(),
        };
        Box::pin(ready(Ok(page)))
    }

    fn status(&self) -> serde_json::Value {
        let st = self.state.borrow();
        serde_json::json!({
            "max_size_bytes": self.capacity_bytes,
            "used_bytes": st.used_bytes,
            "keys": st.objects.len(),
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s as u64,
            "load_latency_ms": self.load_latency.as_millis() as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Name;

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(512 * 1024)
            .make()
            .expect("executor")
            .run(f)
    }

    fn key(i: u8) -> ObjectKey {
        ObjectKey {
            chunk_hash: [i; 32],
            model_name: Name::intern("m").unwrap(),
            kv_rank: 0,
            object_group_id: 0,
            cache_salt: Name::EMPTY,
        }
    }

    #[test]
    fn shards_share_capacity_and_bandwidth() {
        let cfg = MockConfig {
            max_size_gb: 2.0,
            mock_bandwidth_gb: 8.0,
            mock_load_latency_ms: 0,
        };
        let a = MockAdapter::new(&cfg, 1, 4);
        assert_eq!(a.capacity_bytes(), 512 << 20);
        let s = a.status();
        assert_eq!(s["max_size_bytes"], 512u64 << 20);
        assert_eq!(s["bandwidth_bytes_per_s"], 2u64 << 30);
        assert_eq!(s["used_bytes"], 0);
        assert_eq!(s["keys"], 0);
        // A shard count of 0 is treated as one shard rather than dividing by 0.
        assert_eq!(MockAdapter::new(&cfg, 0, 0).capacity_bytes(), 2 << 30);
    }

    #[test]
    fn store_and_load_take_the_simulated_time() {
        run(async {
            // 0.01 GiB/s over 2 shards: ~5.4 MB/s, so 256 KiB takes ~49 ms.
            let cfg = MockConfig {
                max_size_gb: 1.0,
                mock_bandwidth_gb: 0.01,
                mock_load_latency_ms: 0,
            };
            let a = MockAdapter::new(&cfg, 0, 2);
            let expect = Duration::from_secs_f64((256 << 10) as f64 / (0.01 * GIB / 2.0));
            let mut src = vec![7u8; 256 << 10];
            // SAFETY (every view in this test): the buffers outlive the
            // awaited calls that receive their views and nothing else touches
            // them meanwhile.
            let t = Instant::now();
            let r = a
                .store(&[(key(1), unsafe { ObjectBytes::from_mut_slice(&mut src) })])
                .await;
            assert_eq!(r, [StoreResult::Stored(256 << 10)]);
            assert!(t.elapsed() >= expect, "store took {:?}", t.elapsed());
            // Already stored: nothing copied, no delay owed.
            let t = Instant::now();
            let r = a
                .store(&[(key(1), unsafe { ObjectBytes::from_mut_slice(&mut src) })])
                .await;
            assert_eq!(r, [StoreResult::Exists]);
            assert!(
                t.elapsed() < expect,
                "duplicate store took {:?}",
                t.elapsed()
            );
            let mut dst = vec![0u8; 256 << 10];
            let t = Instant::now();
            let r = a
                .load(&[(key(1), unsafe { ObjectBytes::from_mut_slice(&mut dst) })])
                .await;
            assert_eq!(r, [true]);
            assert!(t.elapsed() >= expect, "load took {:?}", t.elapsed());
            assert_eq!(dst, src);
        });
    }

    #[test]
    fn status_follows_contents_and_locks_survive_until_unlocked() {
        run(async {
            let cfg = MockConfig {
                max_size_gb: 1.0,
                mock_bandwidth_gb: 100.0,
                mock_load_latency_ms: 0,
            };
            let a = MockAdapter::new(&cfg, 0, 1);
            let mut b1 = vec![1u8; 100];
            let mut b2 = vec![2u8; 50];
            // SAFETY (every view in this test): the buffers outlive the
            // awaited calls that receive their views and nothing else touches
            // them meanwhile.
            a.store(&[
                (key(1), unsafe { ObjectBytes::from_mut_slice(&mut b1) }),
                (key(2), unsafe { ObjectBytes::from_mut_slice(&mut b2) }),
            ])
            .await;
            assert_eq!(a.status()["used_bytes"], 150);
            assert_eq!(a.status()["keys"], 2);
            // Two locks need two unlocks.
            assert_eq!(a.lookup_and_lock(&[key(1)]).await, [Some(100)]);
            assert_eq!(a.lookup_and_lock(&[key(1)]).await, [Some(100)]);
            a.unlock(&[key(1)]);
            assert_eq!(a.delete(&[key(1)]).await, [None]);
            a.unlock(&[key(1)]);
            assert_eq!(a.delete(&[key(1), key(2)]).await, [Some(100), Some(50)]);
            assert_eq!(a.status()["used_bytes"], 0);
            assert_eq!(a.status()["keys"], 0);
            // Freed room is usable again.
            let mut big = vec![3u8; 1 << 20];
            let r = a
                .store(&[(key(3), unsafe { ObjectBytes::from_mut_slice(&mut big) })])
                .await;
            assert_eq!(r, [StoreResult::Stored(1 << 20)]);
            assert!(a.list(None, 0, None).await.is_err());
        });
    }

    #[test]
    fn load_latency_delays_only_loads() {
        run(async {
            let cfg = MockConfig {
                max_size_gb: 1.0,
                mock_bandwidth_gb: 100.0,
                mock_load_latency_ms: 150,
            };
            let a = MockAdapter::new(&cfg, 0, 1);
            assert_eq!(a.status()["load_latency_ms"], 150);
            let mut src = vec![9u8; 4096];
            let mut dst = vec![0u8; 4096];
            // SAFETY (every view in this test): the buffers outlive the
            // awaited calls that receive their views and nothing else touches
            // them meanwhile.
            let t = Instant::now();
            let r = a
                .store(&[(key(1), unsafe { ObjectBytes::from_mut_slice(&mut src) })])
                .await;
            assert_eq!(r, [StoreResult::Stored(4096)]);
            assert!(
                t.elapsed() < Duration::from_millis(150),
                "{:?}",
                t.elapsed()
            );
            let t = Instant::now();
            let r = a
                .load(&[(key(1), unsafe { ObjectBytes::from_mut_slice(&mut dst) })])
                .await;
            assert_eq!(r, [true]);
            assert!(
                t.elapsed() >= Duration::from_millis(150),
                "{:?}",
                t.elapsed()
            );
            assert_eq!(dst, src);
        });
    }
}
