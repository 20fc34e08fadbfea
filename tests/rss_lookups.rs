//! The server's resident memory outside the L1 arena stays small and flat
//! under many 2048-token lookups with distinct request ids (a mix of full hits,
//! half hits and misses, each followed by its status queries, the release of
//! its locks and the end of its session).

mod support;

use support::*;

const CHUNK: usize = 256;
const TOKENS: usize = 2048;
const LOOKUPS: u64 = 60_000;
const MIB: u64 = 1 << 20;

#[test]
fn rss_outside_the_arena_stays_under_64_mib_and_flat() {
    let srv = Server::start(&[
        "--chunk-size",
        "256",
        "--l1-size-gb",
        "0.25",
        "--no-l1-use-lazy",
    ]);
    let mix = LookupMix::new("rss", CHUNK, TOKENS, "rss", 64);
    store_requests(&mut srv.client(), 1, "rss", 64, CHUNK, &mix.stored);

    let r0 = srv.rss_split();
    assert_eq!(
        r0.arena_size,
        1 << 28,
        "the arena's mapping is found by its path (/dev/shm/{}): {r0:?}",
        srv.shm_name
    );
    let a = mix.run(srv.port, 0..LOOKUPS / 2, 2, 32);
    let r1 = srv.rss_split();
    let b = mix.run(srv.port, LOOKUPS / 2..LOOKUPS, 2, 32);
    let r2 = srv.rss_split();
    assert_eq!(a.total() + b.total(), LOOKUPS);
    assert!(a.full > 0 && a.partial > 0 && a.miss > 0, "{a:?}");
    println!(
        "RSS outside the arena: {:.1} MiB before, {:.1} MiB after {} lookups, {:.1} MiB after {LOOKUPS}",
        r0.outside as f64 / MIB as f64,
        r1.outside as f64 / MIB as f64,
        LOOKUPS / 2,
        r2.outside as f64 / MIB as f64
    );
    assert!(
        r2.outside <= 64 * MIB,
        "RSS outside the arena {:.1} MiB > 64 MiB",
        r2.outside as f64 / MIB as f64
    );
    assert!(
        r2.outside <= r1.outside + 4 * MIB,
        "RSS outside the arena grew {:.1} MiB over the second {} lookups",
        (r2.outside - r1.outside) as f64 / MIB as f64,
        LOOKUPS / 2
    );
}
