//! Decode attention (one query token per task) read straight from the cache pages.
//!
//! For pools whose keys and values are [`direct`] formats (16-bit, `int8`, `fp8`, single-part
//! TurboQuant MSE) a decode task makes two passes over its key range, with no f32 tile and no
//! online-softmax rescaling per page:
//! 1. scores of every grouped query row against every key, page by page, straight from the
//!    records (each key decoded once into registers for all rows of the kv head);
//! 2. one max and one vectorised exp per row over the whole range, then the weighted value sum,
//!    page by page, the accumulator rows held in registers.
//!
//! The scores of a task (`rows × keys`) live in a per-thread scratch that is reused across
//! tasks and layers; the key range of a task is bounded by the planner (`MAX_KEY_CHUNK`).
//! Sink and recent-window tokens are not read from the codes at all: their f16 copies (kept in
//! the working basis) are f16 pages beside the code pages, scored and summed by the same
//! multi-row kernels, run by run, as in the tiled path.

use std::cell::RefCell;

use super::attention::{ExactTiles, Partial, Task, finish_row};
use super::direct::{self, Fmt, Page, Pages};
use super::kv::{CpuKvPool, Half, KvStorage};
use super::{CpuTensor, ops, shape};
use crate::Error;
use crate::backend::{AttnGeometry, SeqSpan};

/// Where the direct kernels find one half (K or V) of a pool's pages.
#[derive(Clone, Copy, Debug)]
struct HalfView {
    half: Half,
    fmt: Fmt,
    /// Bytes per token record.
    stride: usize,
    /// Offset of the codes within a record.
    code_offset: usize,
    /// Codec pools: byte offset of slot 0's f16 scale in the block, and bytes per slot.
    scale: Option<(usize, usize)>,
}

/// How a decode task reads a pool's keys and values.
#[derive(Clone, Copy, Debug)]
pub(super) struct Views {
    k: HalfView,
    v: HalfView,
}

impl Views {
    /// The views of `pool` when both halves are direct formats and the CPU runs the SIMD
    /// kernels; `None` sends decode through the tiled path.
    pub(super) fn of(pool: &CpuKvPool, head_dim: usize) -> Option<Views> {
        if !direct::has_simd() {
            return None;
        }
        let raw = |half, fmt| HalfView {
            half,
            fmt,
            stride: 2 * head_dim,
            code_offset: 0,
            scale: None,
        };
        match pool.storage() {
            KvStorage::Bf16 => Some(Views {
                k: raw(Half::K, Fmt::Bf16),
                v: raw(Half::V, Fmt::Bf16),
            }),
            KvStorage::F16 => Some(Views {
                k: raw(Half::K, Fmt::F16),
                v: raw(Half::V, Fmt::F16),
            }),
            KvStorage::Codec => {
                let c = pool.codec()?;
                let view =
                    |half, codec: &turbokv_codec::VectorCodec, l: &turbokv_codec::BlockLayout| {
                        let d = codec.direct_codes()?;
                        Some(HalfView {
                            half,
                            fmt: Fmt::of(&d),
                            stride: l.code_bytes_per_token,
                            code_offset: d.code_offset,
                            scale: Some((
                                l.scalars_offset + 2 * d.scalar_index,
                                2 * l.scalars_per_token,
                            )),
                        })
                    };
                Some(Views {
                    k: view(Half::K, &c.codec.key, &c.k_layout)?,
                    v: view(Half::V, &c.codec.value, &c.v_layout)?,
                })
            }
        }
    }
}

impl HalfView {
    /// Slots `slot0..slot0 + n` of (block, head) as the task's keys `off..off + n`, with
    /// their scales when the pool has them.
    fn page<'a>(
        &self,
        pool: &'a CpuKvPool,
        block: usize,
        head: usize,
        slot0: usize,
        n: usize,
        off: usize,
    ) -> Result<Page<'a>, Error> {
        let missing = || {
            shape(
                "decode attention",
                format!("no {:?} block {block}", self.half),
            )
        };
        let (bytes, start, scales) = match self.scale {
            None => {
                let b = pool
                    .raw16_block(self.half, block, head)
                    .ok_or_else(missing)?;
                (b, slot0 * self.stride, &[][..])
            }
            Some((offset, step)) => {
                let b = pool.codec_block(self.half, block, head);
                let scales = b.get(offset + slot0 * step..).ok_or_else(missing)?;
                (b, slot0 * self.stride + self.code_offset, scales)
            }
        };
        Ok(Page {
            bytes: bytes.get(start..).ok_or_else(missing)?,
            n,
            off,
            scales,
        })
    }

    /// The task's pages of this half; `mul` is the factor every key shares besides its
    /// scale (the softmax scale for keys).
    fn pages<'a>(&self, list: &'a [Page<'a>], mul: f32) -> Pages<'a> {
        Pages {
            fmt: self.fmt,
            stride: self.stride,
            scale_step: self.scale.map_or(0, |(_, step)| step),
            mul: mul * self.fmt.unit(),
            list,
        }
    }
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
    let wv = d;
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

    // The pages of the task. Keys the query reads exactly go to pages of their copies
    // instead, which have no scales.
    let (mut kpages, mut vpages) = (Vec::new(), Vec::new());
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
            let (n, off, slot) = (coded.len(), p0 - t.k0 + coded.start, slot0 + coded.start);
            kpages.push(views.k.page(pool, block, t.head, slot, n, off)?);
            vpages.push(views.v.page(pool, block, t.head, slot, n, off)?);
        }
        for r in [0..coded.start, coded.end..n] {
            let Some((k, v)) = exact.copies(r.clone()) else {
                continue;
            };
            let (n, off) = (r.len(), p0 - t.k0 + r.start);
            let page = |bytes| Page {
                bytes,
                n,
                off,
                scales: &[],
            };
            ekpages.push(page(direct::u16_bytes(k)));
            evpages.push(page(direct::u16_bytes(v)));
        }
        p0 += n;
    }
    let exact_pages = |stride, mul, list| Pages {
        fmt: Fmt::F16,
        stride,
        scale_step: 0,
        mul,
        list,
    };

    // Pass 1: every score.
    sc.p.resize(rows * nk, 0.0);
    let kp = views.k.pages(&kpages, g.scale);
    direct::scores(kp, &sc.qw, rows, &mut sc.p, nk);
    let ekp = exact_pages(2 * wk, g.scale, &ekpages);
    direct::scores(ekp, &sc.qw, rows, &mut sc.p, nk);

    // Softmax numerators of the whole range, one max and one exp pass per row.
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    for (r, pr) in sc.p.chunks_exact_mut(nk).enumerate() {
        m[r] = ops::max(pr);
        l[r] = ops::exp_shift_sum(pr, m[r]);
    }

    // Pass 2: the weighted value sum.
    let mut acc = vec![0f32; rows * wv];
    let vp = views.v.pages(&vpages, 1.0);
    direct::accumulate(vp, &sc.p, nk, &mut acc, rows);
    let evp = exact_pages(2 * wv, 1.0, &evpages);
    direct::accumulate(evp, &sc.p, nk, &mut acc, rows);

    // A task that saw every key of its query finishes its rows here, in parallel.
    let whole = t.k0 == 0 && t.k1 == qpos + 1;
    if whole {
        sc.tmp.resize(wv, 0.0);
        for (r, row) in acc.chunks_exact_mut(wv).enumerate() {
            let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
            row.iter_mut().for_each(|x| *x *= inv);
            finish_row(pool, t.head, row, &mut sc.tmp)?;
            row.copy_from_slice(&sc.tmp);
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
