//! The stride tables and CPU executor against lmcache 0.5.6's own gather
//! output (`golden/golden_kernel_gather.json`, produced by lmcache's
//! `multi_layer_block_kv_transfer` on CPU tensors), then scatter round trips
//! and a seeded comparison against an independent byte-address model over
//! every format and copy width.

use kvshard_layout::stride::{gather, scatter, EngineKvFormat, PageBufferShape, StrideTable};

mod common;
use common::golden::{cases, golden_paged, sha256_hex, Case};

/// One copied run: (paged buffer, engine byte, object, object byte, length).
type Run = (usize, u64, usize, u64, u64);

/// An independent byte-address model of lmcache 0.5.6's kernel, written per
/// format (not from the stride table).
fn reference_runs(
    format: EngineKvFormat,
    s: &PageBufferShape,
    ids: &[i64],
    chunk_slots: u64,
    skip: usize,
    objects: usize,
) -> Vec<Run> {
    let (kv_size, nl, nb, bs, nh, hs, es) = (
        u64::from(s.kv_size),
        u64::from(s.nl),
        s.nb,
        u64::from(s.bs),
        u64::from(s.nh),
        u64::from(s.hs),
        u64::from(s.element_size),
    );
    let head = hs * es;
    let row = nh * head;
    let blk = (if s.block_stride_elems > 0 {
        s.block_stride_elems
    } else {
        bs * nh * hs
    }) * es;
    let bpo = (ids.len() / objects) as u64;
    let f = format.as_u32();
    let hnd = matches!(f, 6 | 7 | 8 | 10 | 12);
    let mut runs = Vec::new();
    for k in 0..kv_size {
        for (flat, &id) in ids.iter().enumerate().skip(skip) {
            let (o, j, b) = (flat as u64 / bpo, flat as u64 % bpo, id as u64);
            for l in 0..nl {
                let (p, g) = match f {
                    0 | 8 => (0, ((b * nl + l) * kv_size + k) * blk),
                    4 | 9 => (k * nl + l, b * blk),
                    1 | 6 => (l, k * nb * blk + b * blk),
                    2 | 7 => (l, (b * kv_size + k) * blk),
                    _ => (l, b * blk),
                };
                let lmc = ((k * nl + l) * chunk_slots + j * bs) * row;
                for t in 0..bs {
                    if f == 14 {
                        let v = row - 4;
                        runs.push((p as usize, g + t * v, o as usize, lmc + t * row, v));
                        runs.push((
                            p as usize,
                            g + bs * v + t * 4,
                            o as usize,
                            lmc + t * row + v,
                            4,
                        ));
                        continue;
                    }
                    for h in 0..nh {
                        let e = if hnd {
                            (h * bs + t) * head
                        } else {
                            h * head + t * row
                        };
                        runs.push((
                            p as usize,
                            g + e,
                            o as usize,
                            lmc + h * head + t * row,
                            head,
                        ));
                    }
                }
            }
        }
    }
    runs
}

fn reference_gather(runs: &[Run], paged: &[Vec<u8>], objs: &mut [Vec<u8>]) {
    for &(p, e, o, c, n) in runs {
        let (e, c, n) = (e as usize, c as usize, n as usize);
        objs[o][c..c + n].copy_from_slice(&paged[p][e..e + n]);
    }
}

fn reference_scatter(runs: &[Run], paged: &mut [Vec<u8>], objs: &[Vec<u8>]) {
    for &(p, e, o, c, n) in runs {
        let (e, c, n) = (e as usize, c as usize, n as usize);
        paged[p][e..e + n].copy_from_slice(&objs[o][c..c + n]);
    }
}

fn run_gather(
    table: &StrideTable,
    paged: &[Vec<u8>],
    objects: usize,
    ids: &[i64],
    chunk_slots: u64,
    skip: usize,
) -> (Vec<Vec<u8>>, u64) {
    let size = table.object_bytes(chunk_slots).unwrap() as usize;
    let mut objs = vec![vec![0u8; size]; objects];
    let paged_refs: Vec<&[u8]> = paged.iter().map(Vec::as_slice).collect();
    let mut obj_refs: Vec<&mut [u8]> = objs.iter_mut().map(Vec::as_mut_slice).collect();
    let copied = gather(table, &paged_refs, &mut obj_refs, ids, chunk_slots, skip).unwrap();
    (objs, copied)
}

fn run_scatter(
    table: &StrideTable,
    paged: &mut [Vec<u8>],
    objs: &[Vec<u8>],
    ids: &[i64],
    chunk_slots: u64,
    skip: usize,
) -> u64 {
    let mut paged_refs: Vec<&mut [u8]> = paged.iter_mut().map(Vec::as_mut_slice).collect();
    let obj_refs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
    scatter(table, &mut paged_refs, &obj_refs, ids, chunk_slots, skip).unwrap()
}

#[test]
fn golden_file_is_intact() {
    let cases = cases();
    assert_eq!(cases.len(), 9);
    for c in &cases {
        assert_eq!(sha256_hex(&c.bytes), c.sha256, "{}", c.name);
    }
    let has = |pred: &dyn Fn(&Case) -> bool| cases.iter().any(pred);
    assert!(has(&|c| c.skip > 0));
    assert!(has(&|c| c.shape.block_stride_elems > 0));
}

#[test]
fn gather_matches_lmcache() {
    for c in cases() {
        let table = StrideTable::new(c.format, &c.shape).unwrap();
        let paged = golden_paged(&c);
        assert_eq!(paged.len(), table.paged_buffers(), "{}", c.name);
        for p in &paged {
            assert!(p.len() as u64 >= table.paged_span_bytes(), "{}", c.name);
        }
        let (objs, copied) = run_gather(&table, &paged, c.objects, &c.ids, c.chunk_slots, c.skip);
        let got: Vec<u8> = objs.concat();
        assert_eq!(sha256_hex(&got), c.sha256, "{}: sha256", c.name);
        assert_eq!(got, c.bytes, "{}: bytes", c.name);
        let copied_blocks = (c.ids.len() - c.skip) as u64;
        let want = copied_blocks
            * u64::from(c.shape.kv_size * c.shape.nl * c.shape.bs)
            * table.row_bytes();
        assert_eq!(copied, want, "{}: bytes copied", c.name);

        // The independent model agrees with lmcache too, so it can stand in
        // as the expectation for scatter below.
        let runs = reference_runs(c.format, &c.shape, &c.ids, c.chunk_slots, c.skip, c.objects);
        let mut model = vec![vec![0u8; objs[0].len()]; c.objects];
        reference_gather(&runs, &paged, &mut model);
        assert_eq!(model.concat(), c.bytes, "{}: reference model", c.name);
    }
}

#[test]
fn scatter_round_trips_exactly_the_copied_bytes() {
    for c in cases() {
        let table = StrideTable::new(c.format, &c.shape).unwrap();
        let original = golden_paged(&c);
        let (objs, _) = run_gather(&table, &original, c.objects, &c.ids, c.chunk_slots, c.skip);

        let mut restored: Vec<Vec<u8>> = original.iter().map(|p| vec![0u8; p.len()]).collect();
        let copied = run_scatter(&table, &mut restored, &objs, &c.ids, c.chunk_slots, c.skip);

        // Expected: the original bytes at every address the model copies,
        // zero everywhere else.
        let runs = reference_runs(c.format, &c.shape, &c.ids, c.chunk_slots, c.skip, c.objects);
        let mut touched: Vec<Vec<bool>> = original.iter().map(|p| vec![false; p.len()]).collect();
        let mut expected: Vec<Vec<u8>> = original.iter().map(|p| vec![0u8; p.len()]).collect();
        for &(p, e, _, _, n) in &runs {
            let (e, n) = (e as usize, n as usize);
            expected[p][e..e + n].copy_from_slice(&original[p][e..e + n]);
            touched[p][e..e + n].iter_mut().for_each(|t| *t = true);
        }
        assert_eq!(restored, expected, "{}: round trip", c.name);
        let touched_bytes: usize = touched
            .iter()
            .map(|t| t.iter().filter(|&&x| x).count())
            .sum();
        assert_eq!(
            copied as usize, touched_bytes,
            "{}: no byte written twice",
            c.name
        );

        // The skipped blocks' regions were not written.
        for &skipped in &c.ids[..c.skip] {
            for l in 0..c.shape.nl {
                for k in 0..c.shape.kv_size {
                    let p = table.ptr_index(l, k);
                    let off = table.engine_offset_bytes(skipped, l, k).unwrap() as usize;
                    let len = (u64::from(c.shape.bs) * table.row_bytes()) as usize;
                    assert!(
                        restored[p][off..off + len].iter().all(|&b| b == 0),
                        "{}: skipped block {skipped} written",
                        c.name
                    );
                    assert!(touched[p][off..off + len].iter().all(|&t| !t));
                }
            }
        }

        // And gathering the restored buffers gives the same objects.
        let (again, _) = run_gather(&table, &restored, c.objects, &c.ids, c.chunk_slots, c.skip);
        assert_eq!(again, objs, "{}: re-gather", c.name);
    }
}

/// Deterministic xorshift64*, so a failure names a replayable seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn range(&mut self, lo: u64, hi_inclusive: u64) -> u64 {
        lo + self.next() % (hi_inclusive - lo + 1)
    }
}

fn random_shape(rng: &mut Rng, format: EngineKvFormat) -> PageBufferShape {
    let blocked = format.is_blocked_scale();
    let (hs, es) = if blocked {
        (4 * rng.range(2, 9) as u32, 1)
    } else {
        // Head bytes of 2, 6, 12, 16, 24, 32...: every copy width appears.
        let es = [1u32, 2, 4][rng.range(0, 2) as usize];
        let mut hs = rng.range(1, 12) as u32;
        if (hs * es) % 2 == 1 {
            hs += 1;
        }
        (hs, es)
    };
    let nh = if blocked { 1 } else { rng.range(1, 4) as u32 };
    let bs = rng.range(1, 5) as u32;
    let tight = u64::from(bs * nh * hs);
    let block_stride_elems = if format.allows_block_stride() && rng.range(0, 1) == 1 {
        // Pad by whole 4-byte units so the stride stays a multiple of the
        // copy unit of 2- and 4-byte heads; 16-byte heads narrow to 4.
        tight + u64::from(4 / es.min(4)) * rng.range(1, 3)
    } else {
        0
    };
    PageBufferShape {
        kv_size: format.kv_size(),
        nl: rng.range(1, 3) as u32,
        nb: rng.range(8, 14),
        bs,
        nh,
        hs,
        element_size: es,
        block_stride_elems,
    }
}

#[test]
fn every_format_and_width_matches_the_model() {
    let mut rng = Rng(0x6b76_7368_6172_6401);
    let mut widths = [0usize; 17];
    for round in 0..400 {
        let format = EngineKvFormat::ALL[round % EngineKvFormat::ALL.len()];
        let shape = random_shape(&mut rng, format);
        let table = StrideTable::new(format, &shape)
            .unwrap_or_else(|e| panic!("round {round}: {format} {shape:?}: {e}"));
        widths[table.unit_bytes() as usize] += 1;
        let objects = rng.range(1, 4) as usize;
        let bpo = rng.range(1, 2);
        let total = objects * bpo as usize;
        let chunk_slots = bpo * u64::from(shape.bs);
        // Distinct ids (so scatter has one writer per byte), shuffled.
        let mut pool: Vec<i64> = (0..shape.nb as i64).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.range(0, i as u64) as usize);
        }
        let ids = pool[..total].to_vec();
        let skip = rng.range(0, total as u64) as usize;

        let span = table.paged_span_bytes() as usize;
        let paged: Vec<Vec<u8>> = (0..table.paged_buffers())
            .map(|p| (0..span).map(|i| (i * 31 + p * 7 + 1) as u8).collect())
            .collect();
        let runs = reference_runs(format, &shape, &ids, chunk_slots, skip, objects);
        let ctx = format!("round {round}: {format} {shape:?} ids {ids:?} skip {skip}");

        let (objs, _) = run_gather(&table, &paged, objects, &ids, chunk_slots, skip);
        let mut model = vec![vec![0u8; objs[0].len()]; objects];
        reference_gather(&runs, &paged, &mut model);
        assert_eq!(objs, model, "gather {ctx}");

        let mut scattered: Vec<Vec<u8>> = (0..paged.len()).map(|_| vec![0xa5u8; span]).collect();
        let mut model_paged = scattered.clone();
        run_scatter(&table, &mut scattered, &objs, &ids, chunk_slots, skip);
        reference_scatter(&runs, &mut model_paged, &objs);
        assert_eq!(scattered, model_paged, "scatter {ctx}");
    }
    assert!(
        widths[2] > 0 && widths[4] > 0 && widths[16] > 0,
        "{widths:?}"
    );
}
