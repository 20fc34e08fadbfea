//! A lookup load of many requests, shared by benches/rpc.rs and
//! tests/rss_lookups.rs.

use super::*;

/// A lookup workload over requests of `tokens` tokens: `stored` holds the
/// token lists the server has stored. Request `i` (request id `<prefix>-<i>`)
/// is, by `i % 4`: 0 and 1 a full hit of a stored request, 2 the same with
/// its second half changed (half the chunks hit), 3 a miss.
pub struct LookupMix {
    pub model: String,
    pub chunk: usize,
    pub tokens: usize,
    pub prefix: String,
    pub stored: Vec<Vec<u32>>,
    /// `stored`, msgpack-encoded.
    stored_enc: Vec<Vec<u8>>,
}

/// Lookups of a [`LookupMix`] run so far, by outcome.
#[derive(Debug, Clone, Copy, Default)]
pub struct MixCounts {
    pub full: u64,
    pub partial: u64,
    pub miss: u64,
}

impl MixCounts {
    pub fn total(&self) -> u64 {
        self.full + self.partial + self.miss
    }
}

impl LookupMix {
    /// A mix over `n_stored` requests of `tokens` tokens ([`LookupMix::stored_tokens`]).
    pub fn new(model: &str, chunk: usize, tokens: usize, prefix: &str, n_stored: usize) -> Self {
        let stored: Vec<Vec<u32>> = (0..n_stored)
            .map(|j| Self::stored_tokens(tokens, j))
            .collect();
        let mix = LookupMix {
            model: model.into(),
            chunk,
            tokens,
            prefix: prefix.into(),
            stored_enc: stored.iter().map(|t| enc_tokens(t)).collect(),
            stored,
        };
        for i in 0..8 {
            assert_eq!(mix.request(i).0, enc_tokens(&mix.request_tokens(i).0));
        }
        mix
    }

    /// Token list `j` to store: distinct first token, then a constant.
    pub fn stored_tokens(tokens: usize, j: usize) -> Vec<u32> {
        std::iter::once(0x0010_0000 + j as u32)
            .chain(std::iter::repeat_n(9906, tokens - 1))
            .collect()
    }

    /// The token changed in request `i` (position, new token), if any, and
    /// the chunks its lookup must hit.
    fn change(&self, i: u64) -> (Option<(usize, u32)>, i64) {
        let chunks = (self.tokens / self.chunk) as i64;
        // Tokens above any stored one, distinct per request.
        let fresh = 0x0100_0000 + (i % 0x80_0000) as u32;
        match i % 4 {
            0 | 1 => (None, chunks),
            2 => (Some((self.tokens / 2, fresh)), chunks / 2),
            _ => (Some((0, fresh)), 0),
        }
    }

    /// Tokens of request `i` and the chunks its lookup must hit.
    pub fn request_tokens(&self, i: u64) -> (Vec<u32>, i64) {
        let mut toks = self.stored[i as usize % self.stored.len()].clone();
        let (change, want) = self.change(i);
        if let Some((k, x)) = change {
            toks[k] = x;
        }
        (toks, want)
    }

    /// [`LookupMix::request_tokens`] msgpack-encoded, spliced from the stored
    /// request's encoding.
    pub fn request(&self, i: u64) -> (Vec<u8>, i64) {
        let j = i as usize % self.stored.len();
        let (toks, base) = (&self.stored[j], &self.stored_enc[j]);
        let (change, want) = self.change(i);
        let Some((k, x)) = change else {
            return (base.clone(), want);
        };
        let header = base.len() - toks.iter().map(|t| uint_len(*t)).sum::<usize>();
        let at = header + toks[..k].iter().map(|t| uint_len(*t)).sum::<usize>();
        let mut o = Vec::with_capacity(base.len() + 4);
        o.extend_from_slice(&base[..at]);
        put_uint(&mut o, x as u64);
        o.extend_from_slice(&base[at + uint_len(toks[k])..]);
        (o, want)
    }

    /// Runs requests `range` on `clients` connections to `port`, `window`
    /// requests in flight on each: lookup, query_prefetch_status until it is
    /// known, free_lookup_locks after a hit, end_session. Panics on a hit
    /// count other than the expected one.
    pub fn run(
        &self,
        port: u16,
        range: std::ops::Range<u64>,
        clients: usize,
        window: usize,
    ) -> MixCounts {
        let end = (self.tokens / self.chunk * self.chunk) as i64;
        let per = std::thread::scope(|sc| {
            let workers: Vec<_> = (0..clients as u64)
                .map(|t| {
                    let range = range.clone();
                    sc.spawn(move || {
                        let mut c = Client::connect(port);
                        let mut counts = MixCounts::default();
                        let mine: Vec<u64> = range.filter(|i| i % clients as u64 == t).collect();
                        for ids in mine.chunks(window) {
                            let reqs: Vec<_> = ids.iter().map(|&i| (i, self.request(i))).collect();
                            let rids: Vec<String> =
                                ids.iter().map(|i| format!("{}-{i}", self.prefix)).collect();
                            let lookups = reqs
                                .iter()
                                .zip(&rids)
                                .map(|((_, (toks, _)), rid)| {
                                    vec![
                                        enc(&V::I(OP_LOOKUP)),
                                        key_frame_enc(&self.model, None, toks, end, rid),
                                        enc(&V::I(1)),
                                    ]
                                })
                                .collect();
                            for r in c.batch(lookups) {
                                assert_eq!(r, None, "lookup ack");
                            }
                            let mut hits: Vec<Option<i64>> = vec![None; ids.len()];
                            let t0 = Instant::now();
                            loop {
                                let pending: Vec<usize> =
                                    (0..ids.len()).filter(|&k| hits[k].is_none()).collect();
                                if pending.is_empty() {
                                    break;
                                }
                                assert!(
                                    t0.elapsed() < Duration::from_secs(10),
                                    "prefetch never finished"
                                );
                                let q = pending
                                    .iter()
                                    .map(|&k| {
                                        vec![
                                            enc(&V::I(OP_QUERY_PREFETCH_STATUS)),
                                            enc(&s(&rids[k])),
                                        ]
                                    })
                                    .collect();
                                for (k, r) in pending.iter().zip(c.batch(q)) {
                                    hits[*k] = r.map(|v| v.int());
                                }
                            }
                            let mut release = Vec::new();
                            for (k, ((i, (toks, want)), rid)) in reqs.iter().zip(&rids).enumerate()
                            {
                                let got = hits[k].unwrap();
                                assert_eq!(got, *want, "request {i}: hit chunks");
                                match got {
                                    0 => counts.miss += 1,
                                    h if h == end / self.chunk as i64 => counts.full += 1,
                                    _ => counts.partial += 1,
                                }
                                if got > 0 {
                                    release.push(vec![
                                        enc(&V::I(OP_FREE_LOOKUP_LOCKS)),
                                        key_frame_enc(&self.model, None, toks, end, rid),
                                        enc(&V::I(1)),
                                    ]);
                                }
                                release.push(vec![enc(&V::I(OP_END_SESSION)), enc(&s(rid))]);
                            }
                            for r in c.batch(release) {
                                assert_eq!(r, None, "free_lookup_locks / end_session ack");
                            }
                        }
                        counts
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap())
                .collect::<Vec<_>>()
        });
        per.into_iter()
            .fold(MixCounts::default(), |a, b| MixCounts {
                full: a.full + b.full,
                partial: a.partial + b.partial,
                miss: a.miss + b.miss,
            })
    }
}

/// Registers engine_driven instance `iid` of `model` (world size 1, 2 layers,
/// hidden `hidden`, float16, `chunk`-token chunks) and stores each of
/// `requests` whole (prepare_store then commit_store, no bytes written).
/// Returns the pool's (shm name, size).
pub fn store_requests(
    c: &mut Client,
    iid: i64,
    model: &str,
    hidden: i64,
    chunk: usize,
    requests: &[Vec<u32>],
) -> (String, usize) {
    let reg = c
        .call(
            OP_REGISTER_ENGINE,
            &[engine_ctx_payload(
                iid,
                model,
                1,
                2,
                hidden,
                false,
                chunk as i64,
            )],
        )
        .expect("register reply");
    for (j, toks) in requests.iter().enumerate() {
        let rid = format!("store-{model}-{j}");
        let end = (toks.len() / chunk * chunk) as i64;
        let key = ipc_key(model, 1, Some(0), toks, 0, end, &rid, 1);
        let r = c
            .call(OP_PREPARE_STORE, &[key.clone(), V::I(iid)])
            .expect("prepare_store reply");
        assert_eq!(
            ed_slots(&r).len(),
            toks.len() / chunk,
            "request {j}: slots reserved"
        );
        assert_eq!(
            c.call(OP_COMMIT_STORE, &[key, V::I(iid), V::Bin(vec![])]),
            Some(V::B(true)),
            "request {j}: commit_store"
        );
        c.call(OP_END_SESSION, &[s(&rid)]);
    }
    (
        reg.get("shm_name").unwrap().str().to_owned(),
        reg.get("pool_size").unwrap().int() as usize,
    )
}
