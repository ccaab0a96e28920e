//! Paged causal attention on the CPU: flash-attention style online softmax over key blocks.
//!
//! Work is cut into tasks of (sequence, kv head, tile of query tokens, range of keys). The
//! query heads sharing a kv head are processed together so each key/value block is decoded
//! once per tile. A sequence with one new token (decode) has its key range split into chunks
//! whose partial results `(max, sum, acc)` are merged afterwards, so long-context decode uses
//! every thread. Every choice (split points, path) depends on the row's own sequence only:
//! a row's output is bit-for-bit the same whatever else the step holds.
//!
//! Compressed pools run the same loop in the codec's *working basis* (see
//! `turbokv_codec::VectorCodec::decode_tile`): queries are rotated once per task, each block
//! of codes is decoded once into an f32 tile shared by every query row of the task, and the
//! value sum stays rotated until one inverse rotation per output row. Sink and recent-window
//! tokens enter the same basis from their f16 copies, so exact and coded tokens share one
//! softmax.
//!
//! Decode tasks (a one-token span) on pools whose halves are `direct` formats (16-bit, int8,
//! fp8, TurboQuant with runs of whole 8-coordinate chunks) skip the tile and read the pages
//! straight (`decode.rs`); this tiled loop serves prefill and the other formats.

use rayon::prelude::*;

use turbokv_cache::KvWindow;

use super::kv::{CodecStore, CopyRun, CpuKvPool};
use super::{CodeProducts, CpuTensor, decode, ops, shape};
use crate::Error;
use crate::backend::{AttnGeometry, SeqSpan};

/// Query tokens per task.
const QUERY_TILE: usize = 16;
/// Bounds of the key range of a task when a decode sequence's keys are split: at least this
/// many keys (so a task amortises its setup) …
const MIN_KEY_CHUNK: usize = 256;
/// … and at most this many (a decode task's scores live in a `rows × keys` scratch).
const MAX_KEY_CHUNK: usize = 2048;
/// Split decode aims at this many tasks per thread, so work stealing can even out the threads
/// without paying for ~100 tasks per layer.
const TASKS_PER_THREAD: usize = 4;

#[derive(Clone, Copy, Debug)]
pub(super) struct Task {
    pub(super) span: usize,
    pub(super) head: usize,
    pub(super) q0: usize,
    pub(super) q1: usize,
    pub(super) k0: usize,
    pub(super) k1: usize,
}

/// Softmax state of one task: per row (query token × grouped head) the running max, the
/// running sum of exponentials, and the unnormalised value accumulator (in the value codec's
/// working basis). A task that covers its rows' whole key range finishes its rows itself
/// (`done`: `acc` holds output rows), so the sequential merge only handles split decode.
pub(super) struct Partial {
    pub(super) task: Task,
    pub(super) m: Vec<f32>,
    pub(super) l: Vec<f32>,
    pub(super) acc: Vec<f32>,
    pub(super) done: bool,
}

pub(crate) fn attend(
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    products: CodeProducts,
    out: &mut CpuTensor,
) -> Result<(), Error> {
    // Validate every block reference up front so the parallel part cannot fail.
    for s in spans {
        let last = s.first_pos + s.n_tokens;
        if last > 0 {
            pool.block_of(s.blocks, last - 1)?;
        }
    }
    if let Some(c) = pool.codec()
        && c.codec.value.work_dim() != g.head_dim
    {
        return Err(shape(
            "attention",
            format!("value working dim {} ≠ head dim", c.codec.value.work_dim()),
        ));
    }
    let tasks = plan(spans, g, pool);
    let views = head_views(pool, g, products);
    let partials: Vec<Partial> = tasks
        .par_iter()
        .map(|&t| match &views[t.head] {
            Some(v) if spans[t.span].n_tokens == 1 => decode::run(t, qkv, g, spans, pool, v),
            v => run_task(t, qkv, g, spans, pool, v.as_ref()),
        })
        .collect::<Result<_, _>>()?;
    merge_into(partials, g, spans, pool, out)
}

/// The decode views of each kv head of `pool` ([`decode::Views::of`]): one computed and
/// shared unless the heads' dtypes differ.
pub(super) fn head_views(
    pool: &CpuKvPool,
    g: &AttnGeometry,
    products: CodeProducts,
) -> Vec<Option<decode::Views>> {
    let of = |h| decode::Views::of(pool, g.head_dim, h).map(|v| v.with_products(products));
    if pool.codec().is_some_and(|c| c.heads.is_some()) {
        (0..g.n_kv_heads).map(of).collect()
    } else {
        vec![of(0); g.n_kv_heads]
    }
}

/// Keys per task of split decode (whole blocks) for a sequence of `ctx` keys: its decode work
/// over `TASKS_PER_THREAD` tasks per thread, within `MIN_KEY_CHUNK..=MAX_KEY_CHUNK`.
///
/// It depends on the sequence alone, not on the step's other sequences: where the key range
/// is cut decides the order of the softmax merge, and a request's output must not change
/// with what it is batched with.
fn key_chunk(ctx: usize, g: &AttnGeometry, block_size: usize) -> usize {
    let work = ctx * g.n_kv_heads;
    let tasks = TASKS_PER_THREAD * rayon::current_num_threads().max(1);
    let chunk = work.div_ceil(tasks).clamp(MIN_KEY_CHUNK, MAX_KEY_CHUNK);
    let chunk = chunk.div_ceil(block_size) * block_size;
    // Whole blocks may overshoot the bound by less than one block.
    if chunk > MAX_KEY_CHUNK && chunk > block_size {
        chunk - block_size
    } else {
        chunk
    }
}

/// What a decode task pays per key, in bytes read: a key read from the codes costs `coded`,
/// a sink or recent-window key read from its f16 copies `exact` (about four times as much
/// for 3–4-bit codes). Split decode cuts a sequence's keys by this cost rather than by count,
/// so the task holding the window is no longer than the others and the threads finish a
/// layer together.
#[derive(Clone, Copy, Debug)]
struct KeyCost {
    window: KvWindow,
    coded: usize,
    exact: usize,
}

impl KeyCost {
    /// The costs of `pool`'s keys; every key costs the same (1) without a window.
    fn of(pool: &CpuKvPool) -> KeyCost {
        let uniform = KeyCost {
            window: KvWindow::default(),
            coded: 1,
            exact: 1,
        };
        let Some(c) = pool.codec().filter(|c| c.window.is_active()) else {
            return uniform;
        };
        let per_token =
            |l: &turbokv_codec::BlockLayout| l.code_bytes_per_token + 2 * l.scalars_per_token;
        let coded = per_token(&c.k_layout) + per_token(&c.v_layout);
        let exact = 2 * (c.codec.key.work_dim() + c.codec.value.work_dim());
        if coded == 0 {
            return uniform;
        }
        KeyCost {
            window: c.window,
            coded,
            exact,
        }
    }

    /// The cost of keys `keys` to the query that reads keys `0..kend`.
    fn of_keys(&self, keys: std::ops::Range<usize>, kend: usize) -> usize {
        let w = self.window;
        let overlap = |a: usize, b: usize| b.min(keys.end).saturating_sub(a.max(keys.start));
        let sinks = overlap(0, w.sinks);
        let recent = if w.recent > 0 {
            overlap(w.sinks.max(kend.saturating_sub(w.recent)), kend)
        } else {
            0
        };
        let exact = sinks + recent;
        (keys.len() - exact) * self.coded + exact * self.exact
    }
}

/// Where split decode cuts the keys `0..kend` of a sequence into tasks: the task boundaries
/// (`0`, …, `kend`) at whole blocks, each task costing at most `chunk` keys read from the
/// codes (or one block where a block alone costs more). Without sink or window keys these are
/// the multiples of `chunk`.
fn key_cuts(kend: usize, chunk: usize, block_size: usize, cost: &KeyCost) -> Vec<usize> {
    let budget = chunk * cost.coded;
    let mut cuts = vec![0];
    let (mut k0, mut spent) = (0, 0);
    let mut b0 = 0;
    while b0 < kend {
        let b1 = (b0 + block_size).min(kend);
        let c = cost.of_keys(b0..b1, kend);
        if spent + c > budget && b0 > k0 {
            cuts.push(b0);
            (k0, spent) = (b0, 0);
        }
        spent += c;
        b0 = b1;
    }
    cuts.push(kend);
    cuts
}

fn plan(spans: &[SeqSpan<'_>], g: &AttnGeometry, pool: &CpuKvPool) -> Vec<Task> {
    let block_size = pool.block_size();
    let cost = KeyCost::of(pool);
    let mut tasks = Vec::new();
    for (si, s) in spans.iter().enumerate() {
        let ctx = s.first_pos + s.n_tokens;
        // The chunk is sized by the whole range's cost in coded keys, so a window adds
        // tasks rather than lengthening one.
        let work = cost.of_keys(0..ctx, ctx).div_ceil(cost.coded);
        let chunk = key_chunk(work, g, block_size);
        // Only one-token spans (decode) take the split and direct paths; a prompt's rows
        // always take the tiled path over their whole key range, so a row's result does
        // not depend on how its prompt was cut into chunks (nor on the tile it falls in).
        let split = s.n_tokens == 1 && work > chunk;
        let cuts = if split {
            key_cuts(ctx, chunk, block_size, &cost)
        } else {
            Vec::new()
        };
        for head in 0..g.n_kv_heads {
            for q0 in (0..s.n_tokens).step_by(QUERY_TILE) {
                let q1 = (q0 + QUERY_TILE).min(s.n_tokens);
                let kend = s.first_pos + q1;
                if split {
                    for k in cuts.windows(2) {
                        tasks.push(Task {
                            span: si,
                            head,
                            q0,
                            q1,
                            k0: k[0],
                            k1: k[1],
                        });
                    }
                } else {
                    tasks.push(Task {
                        span: si,
                        head,
                        q0,
                        q1,
                        k0: 0,
                        k1: kend,
                    });
                }
            }
        }
    }
    tasks
}

/// Query rows `q` (sequence rows from `first_row`) of the query heads of kv head `head`, in the
/// keys' working basis (`wk` values each): row r = query token · group + grouped head.
pub(super) fn queries_in_work_basis(
    qkv: &CpuTensor,
    first_row: usize,
    q: std::ops::Range<usize>,
    head: usize,
    g: &AttnGeometry,
    codec: Option<&CodecStore>,
    wk: usize,
) -> Result<Vec<f32>, Error> {
    let (d, group) = (g.head_dim, g.group());
    let mut qw = vec![0f32; q.len() * group * wk];
    for qi in q.clone() {
        let q_row = qkv.row(first_row + qi);
        for gh in 0..group {
            let h = head * group + gh;
            let r = (qi - q.start) * group + gh;
            let (src, dst) = (&q_row[h * d..(h + 1) * d], &mut qw[r * wk..(r + 1) * wk]);
            match codec {
                None => dst.copy_from_slice(src),
                Some(c) => c.codec.key.query_to_work(src, dst)?,
            }
        }
    }
    Ok(qw)
}

fn run_task(
    t: Task,
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    views: Option<&decode::Views>,
) -> Result<Partial, Error> {
    let s = &spans[t.span];
    let (d, group, bs) = (g.head_dim, g.group(), pool.block_size());
    let codec = pool.codec();
    let (wk, wv) = codec.map_or((d, d), |c| (c.codec.key.work_dim(), d));
    let rows = (t.q1 - t.q0) * group;
    // Queries in the keys' working basis, once per task.
    let qw = queries_in_work_basis(qkv, s.first_row, t.q0..t.q1, t.head, g, codec, wk)?;
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut acc = vec![0f32; rows * wv];
    let mut scores = vec![0f32; bs];
    let qpos = (s.first_pos + t.q0, s.first_pos + t.q1 - 1);
    let mut reader = BlockReader::new(pool, t.head, qpos, (wk, wv), views);
    let mut p0 = t.k0;
    while p0 < t.k1 {
        let n = (bs - p0 % bs).min(t.k1 - p0);
        let (keys, values, exact) = reader.read(s.blocks, p0, n)?;
        for qi in t.q0..t.q1 {
            let qpos = s.first_pos + qi;
            let visible = (qpos + 1).saturating_sub(p0).min(n);
            if visible == 0 {
                continue;
            }
            let coded = exact.coded(qpos, p0, 0..visible);
            for gh in 0..group {
                let r = (qi - t.q0) * group + gh;
                let q = &qw[r * wk..(r + 1) * wk];
                let sc = &mut scores[..visible];
                let (c0, c1) = (coded.start, coded.end);
                ops::scores(q, &keys[c0 * wk..c1 * wk], g.scale, &mut sc[c0..c1]);
                exact.rescore(q, g.scale, 0..visible, coded.clone(), sc);
                let block_max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let m_new = m[r].max(block_max);
                let corr = (m[r] - m_new).exp();
                let block_sum = ops::exp_shift_sum(sc, m_new);
                l[r] = l[r] * corr + block_sum;
                let out = &mut acc[r * wv..(r + 1) * wv];
                ops::weighted_sum(out, corr, &sc[c0..c1], &values[c0 * wv..c1 * wv]);
                exact.accumulate(out, 0..visible, coded.clone(), sc);
                m[r] = m_new;
            }
        }
        p0 += n;
    }
    // A task that saw every key its rows can see finishes them here, in parallel.
    let whole = t.k0 == 0 && t.k1 == s.first_pos + t.q1;
    if whole {
        let mut tmp = vec![0f32; wv];
        for r in 0..rows {
            let row = &mut acc[r * wv..(r + 1) * wv];
            let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
            row.iter_mut().for_each(|x| *x *= inv);
            finish_row(pool, t.head, row, &mut tmp)?;
            row.copy_from_slice(&tmp);
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

/// A normalised value row in the working basis → the output basis (rotated back, the value
/// mean added when the pool is centered). 16-bit pools copy.
pub(super) fn finish_row(
    pool: &CpuKvPool,
    head: usize,
    row: &[f32],
    out: &mut [f32],
) -> Result<(), Error> {
    match pool.codec() {
        None => out.copy_from_slice(row),
        Some(c) => {
            c.codec.value.work_to_output(row, out)?;
            if let Some(mu) = c.value_center(head, out.len()) {
                out.iter_mut().zip(mu).for_each(|(o, m)| *o += m);
            }
        }
    }
    Ok(())
}

/// The tiled loops' reader of one task's keys and values, a block at a time, into buffers
/// reused from block to block: the exact copies of sink and window tokens go to an
/// [`ExactTiles`], and only the keys some query row reads from the codes are decoded into
/// rows of the working dims (by the direct loaders when the pool's formats have
/// [`decode::Views`], else by the pool's tile decode). The coded range starts where the task's
/// first row's does and ends where its last row's does.
pub(super) struct BlockReader<'a> {
    pool: &'a CpuKvPool,
    head: usize,
    /// Positions of the task's first and last query.
    qpos: (usize, usize),
    keys: Vec<f32>,
    values: Vec<f32>,
    exact: ExactTiles<'a>,
    views: Option<&'a decode::Views>,
}

impl<'a> BlockReader<'a> {
    /// A reader of kv head `head` for queries at `qpos.0 ..= qpos.1`, keys and values of
    /// `wk` and `wv` working dims; `views` are the pool's (see [`decode::Views::of`]).
    pub(super) fn new(
        pool: &'a CpuKvPool,
        head: usize,
        qpos: (usize, usize),
        (wk, wv): (usize, usize),
        views: Option<&'a decode::Views>,
    ) -> Self {
        let bs = pool.block_size();
        BlockReader {
            pool,
            head,
            qpos,
            keys: vec![0f32; bs * wk],
            values: vec![0f32; bs * wv],
            exact: ExactTiles::new(pool.codec()),
            views,
        }
    }

    /// Keys `p0 .. p0 + n` (inside one block of `blocks`): their key and value rows from
    /// `p0` on (filled where a row reads the codes), and the block's exact copies.
    pub(super) fn read(
        &mut self,
        blocks: &[u32],
        p0: usize,
        n: usize,
    ) -> Result<(&[f32], &[f32], &ExactTiles<'a>), Error> {
        let (pool, bs) = (self.pool, self.pool.block_size());
        let (wk, wv) = (self.keys.len() / bs, self.values.len() / bs);
        let block = pool.block_of(blocks, p0)?;
        let slot0 = p0 % bs;
        let exact = &mut self.exact;
        exact.load(pool, block, self.head, p0, slot0..slot0 + n, self.qpos.0);
        exact.widen();
        let lo = exact.coded(self.qpos.0, p0, 0..n).start;
        let hi = exact.coded(self.qpos.1, p0, 0..n).end.max(lo);
        let (slots, keys, values) = (
            slot0 + lo..slot0 + hi,
            &mut self.keys[lo * wk..hi * wk],
            &mut self.values[lo * wv..hi * wv],
        );
        match self.views {
            Some(v) => v.fill(pool, (block, self.head), slots, keys, values)?,
            None => pool.load_tile(block, self.head, slots, keys, values)?,
        }
        Ok((&self.keys[..n * wk], &self.values[..n * wv], &self.exact))
    }
}

/// Sink and recent-window tokens of the current block in the working basis, read straight
/// from the pool's f16 copies, for the query rows that read them exactly. A row's exact keys
/// in a block are a prefix (sinks) and a suffix (its recent window) of the block's keys, so
/// the codes are read for the range between ([`ExactTiles::coded`]) and the copies for the
/// rest, each as one contiguous run.
pub(super) struct ExactTiles<'a> {
    window: Option<KvWindow>,
    wk: usize,
    wv: usize,
    /// The copies of the current block's loaded slots (`n` records of `wk`, of `wv`), when
    /// some row of the task may read one of them exactly and the block has copies. Decode
    /// reads them as pages ([`Self::copies`]).
    run: Option<(CopyRun<'a>, CopyRun<'a>)>,
    /// `run` widened to f32 by [`Self::widen`] for the tiled loops, whose kernels take f32
    /// rows: once per block, however many query rows then read it.
    wide: (Vec<f32>, Vec<f32>),
}

impl<'a> ExactTiles<'a> {
    pub(super) fn new(codec: Option<&CodecStore>) -> Self {
        let window = codec.map(|c| c.window).filter(KvWindow::is_active);
        let wk = codec.map_or(0, |c| c.codec.key.work_dim());
        let wv = codec.map_or(0, |c| c.codec.value.work_dim());
        ExactTiles {
            window,
            wk,
            wv,
            run: None,
            wide: (Vec::new(), Vec::new()),
        }
    }

    /// Takes the copies of positions `p0..p0 + slots.len()` (`slots` of `block`) when a query
    /// at or after `first_qpos` may read one of them exactly.
    pub(super) fn load(
        &mut self,
        pool: &'a CpuKvPool,
        block: usize,
        head: usize,
        p0: usize,
        slots: std::ops::Range<usize>,
        first_qpos: usize,
    ) {
        self.run = None;
        let Some(w) = self.window else {
            return;
        };
        // Exactness only shrinks as the query moves on, except for sinks; the block's last
        // position is the likeliest to be in the first query's window.
        let last = p0 + slots.len().saturating_sub(1);
        if slots.is_empty() || !(p0 < w.sinks || last + w.recent > first_qpos) {
            return;
        }
        self.run = pool.exact_run(block, head, slots);
    }

    /// Widens the loaded copies to f32 for [`Self::rescore`] and [`Self::accumulate`].
    pub(super) fn widen(&mut self) {
        if let Some((keys, values)) = self.run {
            keys.widen(&mut self.wide.0);
            values.widen(&mut self.wide.1);
        }
    }

    /// The keys of `j` (indices into the loaded block, position `p0 + j`) that the query at
    /// `qpos` reads from the codes; the keys of `j` before and after them it reads exactly.
    pub(super) fn coded(
        &self,
        qpos: usize,
        p0: usize,
        j: std::ops::Range<usize>,
    ) -> std::ops::Range<usize> {
        match (self.window, self.run) {
            (Some(w), Some(_)) => {
                // Exact: p0 + j < sinks, or p0 + j + recent > qpos.
                let a = w.sinks.saturating_sub(p0).clamp(j.start, j.end);
                let b = (qpos + 1)
                    .saturating_sub(w.recent)
                    .saturating_sub(p0)
                    .clamp(a, j.end);
                a..b
            }
            _ => j,
        }
    }

    /// The copies of keys `j` of the loaded block, if it has copies and `j` is not empty.
    pub(super) fn copies(&self, j: std::ops::Range<usize>) -> Option<(CopyRun<'a>, CopyRun<'a>)> {
        let (keys, values) = self.run.filter(|_| !j.is_empty())?;
        Some((keys.rows(j.clone()), values.rows(j)))
    }

    /// Scores of the keys of `j` outside `coded` (from [`Self::coded`]) from their widened
    /// copies: `out[i]` is key `j.start + i`'s.
    pub(super) fn rescore(
        &self,
        q: &[f32],
        scale: f32,
        j: std::ops::Range<usize>,
        coded: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        if self.run.is_none() {
            return;
        }
        let (keys, wk, s) = (&self.wide.0, self.wk, j.start);
        for r in [j.start..coded.start, coded.end..j.end] {
            if !r.is_empty() {
                let o = &mut out[r.start - s..r.end - s];
                ops::scores(q, &keys[r.start * wk..r.end * wk], scale, o);
            }
        }
    }

    /// Adds the values of the keys of `j` outside `coded` from their widened copies with
    /// weights `p` (`p[i]` for key `j.start + i`).
    pub(super) fn accumulate(
        &self,
        acc: &mut [f32],
        j: std::ops::Range<usize>,
        coded: std::ops::Range<usize>,
        p: &[f32],
    ) {
        if self.run.is_none() {
            return;
        }
        let (values, wv, s) = (&self.wide.1, self.wv, j.start);
        for r in [j.start..coded.start, coded.end..j.end] {
            if !r.is_empty() {
                let v = &values[r.start * wv..r.end * wv];
                ops::weighted_sum(acc, 1.0, &p[r.start - s..r.end - s], v);
            }
        }
    }
}

/// Merges the key-chunk partials of each (sequence, head, tile) and writes normalised rows.
fn merge_into(
    partials: Vec<Partial>,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    out: &mut CpuTensor,
) -> Result<(), Error> {
    let (d, group) = (g.head_dim, g.group());
    let width = out.cols();
    let data = out.as_mut_slice();
    let mut tmp = vec![0f32; d];
    let mut i = 0;
    while i < partials.len() {
        let t = partials[i].task;
        let mut j = i + 1;
        while j < partials.len() && {
            let u = partials[j].task;
            (u.span, u.head, u.q0) == (t.span, t.head, t.q0)
        } {
            j += 1;
        }
        let parts = &partials[i..j];
        let s = &spans[t.span];
        if let [p] = parts
            && p.done
        {
            for qi in t.q0..t.q1 {
                for gh in 0..group {
                    let r = (qi - t.q0) * group + gh;
                    let h = t.head * group + gh;
                    data[(s.first_row + qi) * width + h * d..][..d]
                        .copy_from_slice(&p.acc[r * d..(r + 1) * d]);
                }
            }
            i = j;
            continue;
        }
        for qi in t.q0..t.q1 {
            for gh in 0..group {
                let r = (qi - t.q0) * group + gh;
                let big_m = parts
                    .iter()
                    .map(|p| p.m[r])
                    .fold(f32::NEG_INFINITY, f32::max);
                let h = t.head * group + gh;
                let dst = &mut data[(s.first_row + qi) * width + h * d..][..d];
                dst.fill(0.0);
                let mut total = 0f32;
                for p in parts {
                    if p.m[r] == f32::NEG_INFINITY {
                        continue;
                    }
                    let w = (p.m[r] - big_m).exp();
                    total += p.l[r] * w;
                    ops::scale_axpy(dst, 1.0, w, &p.acc[r * d..(r + 1) * d]);
                }
                let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
                dst.iter_mut().for_each(|x| *x *= inv);
                tmp.copy_from_slice(dst);
                finish_row(pool, t.head, &tmp, dst)?;
            }
        }
        i = j;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a window the cuts are the multiples of the chunk, as before costs were counted.
    #[test]
    fn key_cuts_without_a_window_are_chunk_multiples() {
        let uniform = KeyCost {
            window: KvWindow::default(),
            coded: 1,
            exact: 1,
        };
        assert_eq!(
            key_cuts(7941, 2048, 16, &uniform),
            [0, 2048, 4096, 6144, 7941]
        );
        assert_eq!(key_cuts(4096, 2048, 16, &uniform), [0, 2048, 4096]);
    }

    /// With a window every task stays within the budget of `chunk` coded keys (the window's
    /// task is not heavier than the others), the cuts fall on whole blocks and cover the keys.
    #[test]
    fn key_cuts_spread_the_window_over_tasks() {
        let cost = KeyCost {
            window: KvWindow {
                recent: 360,
                sinks: 1,
                ..Default::default()
            },
            coded: 60,
            exact: 256,
        };
        for kend in [361, 2049, 7941, 8192] {
            let cuts = key_cuts(kend, 2048, 16, &cost);
            assert_eq!((cuts[0], *cuts.last().unwrap()), (0, kend));
            for k in cuts.windows(2) {
                assert!(k[0] < k[1] && k[0] % 16 == 0, "{kend}: {cuts:?}");
                assert!(
                    cost.of_keys(k[0]..k[1], kend) <= 2048 * 60,
                    "{kend}: {cuts:?}"
                );
            }
        }
        // 360 window keys cost as much as 1536 coded ones: a fifth task at 8k.
        assert_eq!(key_cuts(7941, 2048, 16, &cost).len(), 6);
        assert_eq!(cost.of_keys(0..16, 7941), 256 + 15 * 60);
        assert_eq!(cost.of_keys(7941 - 360..7941, 7941), 360 * 256);
        assert_eq!(cost.of_keys(0..7941, 7941), 361 * 256 + 7580 * 60);
    }
}
