//! The CPU's operations for model families beyond llama/qwen: a scale, GeGLU, and causal
//! attention with a sliding window and/or attention sinks.
//!
//! The variant attention is a plain online-softmax loop over (sequence, kv head, tile of
//! query tokens) tasks, reading only the keys inside the tile's window, so a sliding-window
//! layer costs `window` keys per query however long the context is. It reads the same pool
//! formats as [`super::attention`] (16-bit pages, codec blocks in the working basis, and
//! the f16 copies of a policy's exact tokens).

use rayon::prelude::*;

use super::CodeProducts;
use super::attention::{BlockReader, finish_row, head_views, queries_in_work_basis};
use super::kv::CpuKvPool;
use super::{CpuTensor, ROWS_PER_TASK, decode, expect_cols, ops, shape};
use crate::Error;
use crate::backend::{AttnGeometry, AttnVariant, SeqSpan};

/// Query tokens per task.
const QUERY_TILE: usize = 16;

/// `x *= factor`.
pub(super) fn scale(x: &mut CpuTensor, factor: f32) {
    let chunk = (x.cols() * ROWS_PER_TASK).max(1);
    x.as_mut_slice()
        .par_chunks_mut(chunk)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= factor));
}

/// Hugging Face's `gelu_pytorch_tanh` (llama.cpp's `ggml_gelu`).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `out = gelu_tanh(g) · u` per row `[g | u]`.
pub(super) fn gelu_mul(gate_up: &CpuTensor, out: &mut CpuTensor) -> Result<(), Error> {
    let f = out.cols();
    expect_cols("gelu_mul", gate_up, 2 * f)?;
    out.as_mut_slice()
        .par_chunks_mut(f * ROWS_PER_TASK)
        .zip(gate_up.as_slice().par_chunks(2 * f * ROWS_PER_TASK))
        .for_each(|(o, gu)| {
            for (orow, gurow) in o.chunks_mut(f).zip(gu.chunks(2 * f)) {
                let (g, u) = gurow.split_at(f);
                for ((o, &g), &u) in orow.iter_mut().zip(g).zip(u) {
                    *o = gelu_tanh(g) * u;
                }
            }
        });
    Ok(())
}

#[derive(Clone, Copy)]
struct Task {
    span: usize,
    head: usize,
    q0: usize,
    q1: usize,
}

/// Causal attention with `variant`'s window and sinks; `out` has the step's rows.
pub(super) fn attend(
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    variant: &AttnVariant<'_, Vec<f32>>,
    out: &mut CpuTensor,
) -> Result<(), Error> {
    if variant.window == Some(0) {
        return Err(shape("attention", "a sliding window of 0 tokens".into()));
    }
    if let Some(s) = variant.sinks
        && s.len() != g.n_heads
    {
        return Err(shape(
            "attention",
            format!("{} sink logits for {} heads", s.len(), g.n_heads),
        ));
    }
    if let Some(c) = pool.codec()
        && c.codec.value.work_dim() != g.head_dim
    {
        return Err(shape(
            "attention",
            format!("value working dim {} ≠ head dim", c.codec.value.work_dim()),
        ));
    }
    // Validate every block a task will read up front so the parallel part cannot fail.
    for s in spans {
        let end = s.first_pos + s.n_tokens;
        let start = variant
            .window
            .map_or(0, |w| (s.first_pos + 1).saturating_sub(w));
        let bs = pool.block_size();
        for p in (start..end).step_by(bs) {
            pool.block_of(s.blocks, p)?;
        }
        if end > 0 {
            pool.block_of(s.blocks, end - 1)?;
        }
    }
    let mut tasks = Vec::new();
    for (si, s) in spans.iter().enumerate() {
        for head in 0..g.n_kv_heads {
            for q0 in (0..s.n_tokens).step_by(QUERY_TILE) {
                tasks.push(Task {
                    span: si,
                    head,
                    q0,
                    q1: (q0 + QUERY_TILE).min(s.n_tokens),
                });
            }
        }
    }
    let views = head_views(pool, g, CodeProducts::F32);
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&t| run_task(t, qkv, g, spans, pool, views[t.head].as_ref(), variant))
        .collect::<Result<_, _>>()?;
    let (d, group, width) = (g.head_dim, g.group(), out.cols());
    let data = out.as_mut_slice();
    for (t, rows) in tasks.iter().zip(results) {
        let s = &spans[t.span];
        for qi in t.q0..t.q1 {
            for gh in 0..group {
                let r = (qi - t.q0) * group + gh;
                let h = t.head * group + gh;
                data[(s.first_row + qi) * width + h * d..][..d]
                    .copy_from_slice(&rows[r * d..(r + 1) * d]);
            }
        }
    }
    Ok(())
}

/// One task's output rows (query token × grouped head), normalised, in the output basis.
fn run_task(
    t: Task,
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    views: Option<&decode::Views>,
    variant: &AttnVariant<'_, Vec<f32>>,
) -> Result<Vec<f32>, Error> {
    let s = &spans[t.span];
    let (d, group, bs) = (g.head_dim, g.group(), pool.block_size());
    let codec = pool.codec();
    let (wk, wv) = codec.map_or((d, d), |c| (c.codec.key.work_dim(), d));
    let rows = (t.q1 - t.q0) * group;
    let qw = queries_in_work_basis(qkv, s.first_row, t.q0..t.q1, t.head, g, codec, wk)?;
    let lo_of = |qpos: usize| variant.window.map_or(0, |w| (qpos + 1).saturating_sub(w));
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut acc = vec![0f32; rows * wv];
    let mut scores = vec![0f32; bs];
    let qpos = (s.first_pos + t.q0, s.first_pos + t.q1 - 1);
    let mut reader = BlockReader::new(pool, t.head, qpos, (wk, wv), views);
    let kend = s.first_pos + t.q1;
    let mut p0 = lo_of(qpos.0);
    while p0 < kend {
        let n = (bs - p0 % bs).min(kend - p0);
        let (keys, values, exact) = reader.read(s.blocks, p0, n)?;
        for qi in t.q0..t.q1 {
            let qpos = s.first_pos + qi;
            let (a, b) = (lo_of(qpos).max(p0), (qpos + 1).min(p0 + n));
            if a >= b {
                continue;
            }
            let (j0, j1) = (a - p0, b - p0);
            let coded = exact.coded(qpos, p0, j0..j1);
            let (c0, c1) = (coded.start, coded.end);
            for gh in 0..group {
                let r = (qi - t.q0) * group + gh;
                let q = &qw[r * wk..(r + 1) * wk];
                let sc = &mut scores[..j1 - j0];
                let keys = &keys[c0 * wk..c1 * wk];
                ops::scores(q, keys, g.scale, &mut sc[c0 - j0..c1 - j0]);
                exact.rescore(q, g.scale, j0..j1, coded.clone(), sc);
                let m_new = m[r].max(ops::max(sc));
                let corr = (m[r] - m_new).exp();
                l[r] = l[r] * corr + ops::exp_shift_sum(sc, m_new);
                let out = &mut acc[r * wv..(r + 1) * wv];
                let (p, v) = (&sc[c0 - j0..c1 - j0], &values[c0 * wv..c1 * wv]);
                ops::weighted_sum(out, corr, p, v);
                exact.accumulate(out, j0..j1, coded.clone(), sc);
                m[r] = m_new;
            }
        }
        p0 += n;
    }
    let mut result = vec![0f32; rows * d];
    for r in 0..rows {
        let row = &mut acc[r * wv..(r + 1) * wv];
        let mut total = l[r];
        if let Some(sinks) = variant.sinks {
            // The sink joins the denominator only: rescale to the larger max, add its term.
            let h = t.head * group + r % group;
            let m_new = m[r].max(sinks[h]);
            let corr = (m[r] - m_new).exp();
            row.iter_mut().for_each(|x| *x *= corr);
            total = total * corr + (sinks[h] - m_new).exp();
        }
        let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
        row.iter_mut().for_each(|x| *x *= inv);
        finish_row(pool, t.head, row, &mut result[r * d..(r + 1) * d])?;
    }
    Ok(result)
}
