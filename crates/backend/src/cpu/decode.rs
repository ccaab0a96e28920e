//! Decode attention (one query token per task) read straight from the cache pages.
//!
//! For pools whose keys and values are [`direct`] formats (16-bit, `int8`, `fp8`, and
//! TurboQuant: MSE codes, outlier parts, QJL signs) a decode task makes two passes over its key
//! range, with no f32 tile and no online-softmax rescaling per page:
//! 1. scores of every grouped query row against every key, page by page, straight from the
//!    records (each key decoded once into registers for all rows of the kv head);
//! 2. one max and one vectorised exp per row over the whole range, then the weighted value sum,
//!    page by page, the accumulator rows held in registers.
//!
//! A record of several runs (a fractional width's two parts, prod keys' MSE codes and signs)
//! is read run by run, each run's pages scored or summed on their own and added up: a run is
//! the unit the kernels take, and the runs' bytes are read once either way.
//!
//! The scores of a task (`rows × keys`) live in a per-thread scratch that is reused across
//! tasks and layers; the key range of a task is bounded by the planner (`MAX_KEY_CHUNK`).
//! Sink and recent-window tokens are not read from the codes at all: their f16 copies (kept in
//! the working basis) are f16 pages beside the code pages, scored and summed by the same
//! multi-row kernels, run by run, as in the tiled path.

use std::cell::RefCell;

use super::attention::{ExactTiles, Partial, Task, finish_row};
use super::direct::{self, Fmt, Page, Pages};
use super::kv::{CpuKvPool, Half, KvStorage, head_block_offset};
use super::{CodeProducts, CpuTensor, ops, shape};
use crate::Error;
use crate::backend::{AttnGeometry, SeqSpan};
use turbokv_cache::WindowCopies;

/// Where the direct kernels find one run of a half's working coordinates (the whole record for
/// 16-bit, `int8` and `fp8`; a part's MSE codes or QJL signs for TurboQuant).
#[derive(Clone, Copy, Debug)]
struct RunView {
    fmt: Fmt,
    /// Bytes per token record.
    stride: usize,
    /// Offset of the run's codes within a record.
    code_offset: usize,
    /// Codec pools: byte offset of slot 0's f16 scale of this run in the block, and bytes per
    /// slot.
    scale: Option<(usize, usize)>,
    /// The run's working coordinates: `work..work + dim`.
    work: usize,
    dim: usize,
    /// Factor besides the scale (QJL's κ for sign runs, else 1).
    mul: f32,
}

/// Where the direct kernels find one half (K or V) of a pool's pages.
#[derive(Clone, Debug)]
struct HalfView {
    half: Half,
    runs: Vec<RunView>,
}

/// How a decode task reads a pool's keys and values.
#[derive(Clone, Debug)]
pub(super) struct Views {
    k: HalfView,
    v: HalfView,
    /// How decode scores table codes.
    products: CodeProducts,
}

impl Views {
    /// The views of `pool` when both halves are direct formats whose runs the SIMD kernels
    /// take whole (multiples of 8 coordinates) and the CPU has them; `None` sends decode
    /// through the tiled path.
    pub(super) fn of(pool: &CpuKvPool, head_dim: usize, head: usize) -> Option<Views> {
        if !direct::has_simd() {
            return None;
        }
        let raw = |half, fmt| HalfView {
            half,
            runs: vec![RunView {
                fmt,
                stride: 2 * head_dim,
                code_offset: 0,
                scale: None,
                work: 0,
                dim: head_dim,
                mul: 1.0,
            }],
        };
        let views = match pool.storage() {
            KvStorage::Bf16 => Views {
                k: raw(Half::K, Fmt::Bf16),
                v: raw(Half::V, Fmt::Bf16),
                products: CodeProducts::F32,
            },
            KvStorage::F16 => Views {
                k: raw(Half::K, Fmt::F16),
                v: raw(Half::V, Fmt::F16),
                products: CodeProducts::F32,
            },
            KvStorage::Codec => {
                let (codec, k_layout, v_layout) = pool.codec()?.head(head);
                let view =
                    |half, codec: &turbokv_codec::VectorCodec, l: &turbokv_codec::BlockLayout| {
                        let runs = codec.direct_codes()?;
                        let runs = runs.iter().map(|d| RunView {
                            fmt: Fmt::of(d),
                            stride: l.code_bytes_per_token,
                            code_offset: d.code_offset,
                            scale: Some((
                                l.scalars_offset + 2 * d.scalar_index,
                                2 * l.scalars_per_token,
                            )),
                            work: d.work_offset,
                            dim: d.dim,
                            mul: d.mul,
                        });
                        Some(HalfView {
                            half,
                            runs: runs.collect(),
                        })
                    };
                Views {
                    k: view(Half::K, &codec.key, k_layout)?,
                    v: view(Half::V, &codec.value, v_layout)?,
                    products: CodeProducts::F32,
                }
            }
        };
        let whole = |h: &HalfView| h.runs.iter().all(|r| r.dim > 0 && r.dim % 8 == 0);
        (whole(&views.k) && whole(&views.v)).then_some(views)
    }

    /// The views with decode's scores of table codes as `products` says (f32 from
    /// [`Views::of`]).
    pub(super) fn with_products(self, products: CodeProducts) -> Self {
        Views { products, ..self }
    }

    /// Slots `slots` of (block, kv head `head`) of `pool` decoded into `keys` and `values`
    /// (`slots.len()` rows of the halves' working dims), by the direct loaders: the tiled
    /// path's tile fill for direct formats, without the codec's decode per token.
    pub(super) fn fill(
        &self,
        pool: &CpuKvPool,
        (block, head): (usize, usize),
        slots: std::ops::Range<usize>,
        keys: &mut [f32],
        values: &mut [f32],
    ) -> Result<(), Error> {
        if slots.is_empty() {
            return Ok(());
        }
        let r = CodedKeys {
            block,
            slot: slots.start,
            n: slots.len(),
            off: 0,
        };
        for (view, out) in [(&self.k, keys), (&self.v, values)] {
            let (bytes, per) = pool.half_bytes(view.half);
            let base = head_block_offset(pool.kv_heads(), per, block, head);
            let width = out.len() / slots.len();
            for run in &view.runs {
                let list = [run.page(bytes, base, &r)?];
                direct::decode_rows(run.pages(&list, 1.0), run.dim, &mut out[run.work..], width);
            }
        }
        Ok(())
    }
}

impl RunView {
    /// The coded keys `r` as a page of this run: `half` is the pool's whole K or V storage
    /// and `base` the byte offset of (`r.block`, the task's kv head) in it.
    fn page<'a>(&self, half: &'a [u8], base: usize, r: &CodedKeys) -> Result<Page<'a>, Error> {
        let missing = || {
            shape(
                "decode attention",
                format!("block {} lies outside the pool", r.block),
            )
        };
        let start = base + r.slot * self.stride + self.code_offset;
        let scales = match self.scale {
            None => &[][..],
            Some((offset, step)) => half
                .get(base + offset + r.slot * step..)
                .ok_or_else(missing)?,
        };
        Ok(Page {
            bytes: half.get(start..).ok_or_else(missing)?,
            n: r.n,
            off: r.off,
            scales,
        })
    }

    /// The task's pages of this run; `mul` is the factor every key shares besides its
    /// scale and the run's own (the softmax scale for keys).
    fn pages<'a>(&self, list: &'a [Page<'a>], mul: f32) -> Pages<'a> {
        Pages {
            fmt: self.fmt,
            stride: self.stride,
            scale_step: self.scale.map_or(0, |(_, step)| step),
            mul: mul * self.mul * self.fmt.unit(),
            list,
            next: &[],
        }
    }
}

impl HalfView {
    /// Appends the coded keys `r` of the task's kv head to each run's page list: `half` and
    /// `per` are the pool's storage of this half and its bytes per (block, kv head).
    fn push_pages<'a>(
        &self,
        (half, per): (&'a [u8], usize),
        kv_heads: usize,
        head: usize,
        r: &CodedKeys,
        lists: &mut [Vec<Page<'a>>],
    ) -> Result<(), Error> {
        let base = head_block_offset(kv_heads, per, r.block, head);
        for (run, list) in self.runs.iter().zip(lists) {
            list.push(run.page(half, base, r)?);
        }
        Ok(())
    }
}

/// Keys of a task read from the codes, all in one block: slots `slot..slot + n` of `block`
/// are the task's keys `off..off + n`.
#[derive(Clone, Copy, Debug)]
struct CodedKeys {
    block: usize,
    slot: usize,
    n: usize,
    off: usize,
}

/// Per-thread buffers of decode tasks, grown as needed and never shrunk.
#[derive(Default)]
struct Scratch {
    /// Queries in the key working basis, `[rows, wk]`.
    qw: Vec<f32>,
    /// Scores, then softmax weights: `[rows, keys]`.
    p: Vec<f32>,
    /// One finished output row.
    tmp: Vec<f32>,
    /// A run's slice of the query rows, `[rows, run dim]` (multi-run formats).
    qrun: Vec<f32>,
    /// A run's scores `[rows, keys]`, or its value sums `[rows, run dim]` (multi-run formats).
    run: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// One decode task (a single query token, `t.q1 = t.q0 + 1`) through the direct kernels.
pub(super) fn run(
    t: Task,
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    views: &Views,
) -> Result<Partial, Error> {
    debug_assert_eq!(t.q1, t.q0 + 1);
    SCRATCH.with_borrow_mut(|sc| run_in(t, qkv, g, spans, pool, views, sc))
}

fn run_in(
    t: Task,
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    views: &Views,
    sc: &mut Scratch,
) -> Result<Partial, Error> {
    let s = &spans[t.span];
    let (d, rows, bs) = (g.head_dim, g.group(), pool.block_size());
    let codec = pool.codec();
    let wk = codec.map_or(d, |c| c.codec.key.work_dim());
    let wv = codec.map_or(d, |c| c.codec.value.work_dim());
    let qpos = s.first_pos + t.q0;
    let nk = t.k1 - t.k0;

    // Queries in the keys' working basis.
    sc.qw.resize(rows * wk, 0.0);
    let q_row = qkv.row(s.first_row + t.q0);
    for (r, dst) in sc.qw.chunks_exact_mut(wk).enumerate() {
        let h = t.head * rows + r;
        let q = &q_row[h * d..(h + 1) * d];
        match codec {
            None => dst.copy_from_slice(q),
            Some(c) => c.codec.key.query_to_work(q, dst)?,
        }
    }

    // The task's pages: each coded key range as a page of every run (built as the block
    // table is walked, with offsets computed from the pool's storage: at 16 keys a page, a
    // task at 8k context has about a hundred). Keys the query reads exactly go to pages of
    // their copies instead, which have no scales.
    let pages_max = nk.div_ceil(bs) + 1;
    let lists = |h: &HalfView| -> Vec<Vec<Page<'_>>> {
        h.runs
            .iter()
            .map(|_| Vec::with_capacity(pages_max))
            .collect()
    };
    let (mut kpages, mut vpages) = (lists(&views.k), lists(&views.v));
    let (kstore, vstore) = (pool.half_bytes(views.k.half), pool.half_bytes(views.v.half));
    let heads = pool.kv_heads();
    let (mut ekpages, mut evpages) = (Vec::new(), Vec::new());
    let mut exact = ExactTiles::new(codec);
    let mut p0 = t.k0;
    while p0 < t.k1 {
        let n = (bs - p0 % bs).min(t.k1 - p0);
        let block = pool.block_of(s.blocks, p0)?;
        let slot0 = p0 % bs;
        exact.load(pool, block, t.head, p0, slot0..slot0 + n, qpos);
        let coded = exact.coded(qpos, p0, 0..n);
        if !coded.is_empty() {
            let r = CodedKeys {
                block,
                slot: slot0 + coded.start,
                n: coded.len(),
                off: p0 - t.k0 + coded.start,
            };
            views.k.push_pages(kstore, heads, t.head, &r, &mut kpages)?;
            views.v.push_pages(vstore, heads, t.head, &r, &mut vpages)?;
        }
        for r in [0..coded.start, coded.end..n] {
            let Some((k, v)) = exact.copies(r.clone()) else {
                continue;
            };
            let (n, off) = (r.len(), p0 - t.k0 + r.start);
            for (run, list) in [(k, &mut ekpages), (v, &mut evpages)] {
                list.push(Page {
                    bytes: run.records,
                    n,
                    off,
                    scales: run.steps,
                });
            }
        }
        p0 += n;
    }
    // The copies' records: f16, or int8 with an f16 step each (as an int8 pool's pages).
    let (copy_fmt, copy_bytes, scale_step) = match codec.map(|c| c.window.copies) {
        Some(WindowCopies::Int8) => (Fmt::Int8, 1, 2),
        _ => (Fmt::F16, 2, 0),
    };
    let exact_pages = |stride, mul, list, next| Pages {
        fmt: copy_fmt,
        stride,
        scale_step,
        mul,
        list,
        next,
    };
    for (run, list) in (views.k.runs.iter().zip(&kpages)).chain(views.v.runs.iter().zip(&vpages)) {
        direct::prefetch_start(&run.pages(list, 1.0));
    }
    direct::prefetch_start(&exact_pages(copy_bytes * wk, 1.0, &ekpages, &[]));
    direct::prefetch_start(&exact_pages(copy_bytes * wv, 1.0, &evpages, &[]));
    let Scratch {
        qw,
        p,
        tmp,
        qrun,
        run: part,
    } = sc;

    // Pass 1: every score. A format of several runs (outlier parts, QJL signs) scores each
    // run against its slice of the query rows and adds a later run's scores to the first's.
    p.resize(rows * nk, 0.0);
    for (i, (run, list)) in views.k.runs.iter().zip(&kpages).enumerate() {
        let pages = run.pages(list, g.scale);
        let q = if run.dim == wk {
            &qw[..]
        } else {
            qrun.clear();
            for q in qw.chunks_exact(wk) {
                qrun.extend_from_slice(&q[run.work..run.work + run.dim]);
            }
            &qrun[..]
        };
        if i == 0 {
            direct::scores(pages, q, rows, p, nk, views.products);
        } else {
            part.clear();
            part.resize(rows * nk, 0.0);
            direct::scores(pages, q, rows, part, nk, views.products);
            p.iter_mut().zip(part.iter()).for_each(|(a, b)| *a += b);
        }
    }
    // The copies' values are requested while their keys are scored: a task of window keys
    // has no codes to compute with while they come, and its value pass would wait on them.
    let evbytes: Vec<&[u8]> = evpages.iter().map(|p| p.bytes).collect();
    let ekp = exact_pages(copy_bytes * wk, g.scale, &ekpages, &evbytes);
    // f16 copies take f32 products whatever `products` says; int8 ones, as int8 pools, the
    // integer pass where the CPU has it (only the query rows round).
    direct::scores(ekp, qw, rows, p, nk, views.products);

    // Softmax numerators of the whole range, one max and one exp pass per row.
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    for (r, pr) in p.chunks_exact_mut(nk).enumerate() {
        m[r] = ops::max(pr);
        l[r] = ops::exp_shift_sum(pr, m[r]);
    }

    // Pass 2: the weighted value sum, run by run.
    let mut acc = vec![0f32; rows * wv];
    for (run, list) in views.v.runs.iter().zip(&vpages) {
        let pages = run.pages(list, 1.0);
        if run.dim == wv {
            direct::accumulate(pages, p, nk, &mut acc, rows, views.products);
            continue;
        }
        part.clear();
        part.resize(rows * run.dim, 0.0);
        direct::accumulate(pages, p, nk, part, rows, views.products);
        for (a, b) in acc.chunks_exact_mut(wv).zip(part.chunks_exact(run.dim)) {
            a[run.work..run.work + run.dim]
                .iter_mut()
                .zip(b)
                .for_each(|(x, y)| *x += y);
        }
    }
    let evp = exact_pages(copy_bytes * wv, 1.0, &evpages, &[]);
    direct::accumulate(evp, p, nk, &mut acc, rows, CodeProducts::F32);

    // A task that saw every key of its query finishes its rows here, in parallel.
    let whole = t.k0 == 0 && t.k1 == qpos + 1;
    if whole {
        tmp.resize(d, 0.0);
        for (r, row) in acc.chunks_exact_mut(wv).enumerate() {
            let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
            row.iter_mut().for_each(|x| *x *= inv);
            finish_row(pool, t.head, row, tmp)?;
            row.copy_from_slice(tmp);
        }
    }
    Ok(Partial {
        task: t,
        m,
        l,
        acc,
        done: whole,
    })
}

#[cfg(test)]
mod tests {
    use turbokv_cache::KvLayout;
    use turbokv_codec::KvDtype;

    use super::*;

    /// The tiled path's two tile fills give the same numbers: for every format with views,
    /// `Views::fill` (the direct loaders) equals the pool's load hook (`CpuKvPool::load_tile`:
    /// `half`'s conversion or the codec's `decode_tile`) bit for bit, on random keys and
    /// values, over whole blocks and ranges inside them, for every kv head.
    #[test]
    fn direct_tile_fill_equals_the_load_hook() {
        if !direct::has_simd() {
            eprintln!("skipped: no AVX2/FMA/F16C on this CPU");
            return;
        }
        let (heads, d, bs, n) = (2, 64, 16, 40);
        let g = AttnGeometry {
            n_heads: 2 * heads,
            n_kv_heads: heads,
            head_dim: d,
            scale: 0.125,
        };
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        for name in [
            "bf16", "f16", "int8", "fp8", "tq4", "tq3", "tq2", "k4v2", "tq2.5", "tq3.5",
        ] {
            let dtype: KvDtype = name.parse().unwrap();
            let layout = KvLayout::uniform(1, heads, d, dtype, bs, n).unwrap();
            let mut pool = CpuKvPool::new(&layout, 0).unwrap();
            let blocks: Vec<u32> = (0..n.div_ceil(bs) as u32).rev().collect();
            let data: Vec<f32> = (0..n * g.qkv_width()).map(|_| next()).collect();
            let qkv = CpuTensor::from_vec(data, n, g.qkv_width()).unwrap();
            let span = SeqSpan {
                first_row: 0,
                n_tokens: n,
                first_pos: 0,
                blocks: &blocks,
            };
            pool.store(&qkv, &g, &[span]).unwrap();
            let views = Views::of(&pool, d, 0).unwrap_or_else(|| panic!("{name}: no views"));
            let codec = pool.codec();
            let wk = codec.map_or(d, |c| c.codec.key.work_dim());
            let wv = codec.map_or(d, |c| c.codec.value.work_dim());
            for &block in &blocks {
                for head in 0..heads {
                    for slots in [0..bs, 3..11, 15..16] {
                        let m = slots.len();
                        let (mut k1, mut v1) = (vec![f32::NAN; m * wk], vec![f32::NAN; m * wv]);
                        let (mut k2, mut v2) = (k1.clone(), v1.clone());
                        let b = block as usize;
                        views
                            .fill(&pool, (b, head), slots.clone(), &mut k1, &mut v1)
                            .unwrap();
                        pool.load_tile(b, head, slots.clone(), &mut k2, &mut v2)
                            .unwrap();
                        let what = format!("{name} block {b} head {head} slots {slots:?}");
                        assert!(k1.iter().all(|x| x.is_finite()), "{what}: keys");
                        assert_eq!(k1, k2, "{what}: keys");
                        assert_eq!(v1, v2, "{what}: values");
                    }
                }
            }
        }
    }
}
