//! Paged causal attention on the CPU: flash-attention style online softmax over key blocks.
//!
//! Work is cut into tasks of (sequence, kv head, tile of query tokens, range of keys). The
//! query heads sharing a kv head are processed together so each key/value block is decoded
//! once per tile. A sequence with a single tile (decode) has its key range split into chunks
//! whose partial results `(max, sum, acc)` are merged afterwards, so long-context decode uses
//! every thread.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use rayon::prelude::*;

use super::kv::{CodecStore, CpuKvPool, Half};
use super::{CpuTensor, ops};
use crate::Error;
use crate::backend::{AttnGeometry, SeqSpan};

/// Query tokens per task.
const QUERY_TILE: usize = 16;
/// Keys per task when a sequence's keys are split (rounded to whole blocks).
const KEY_CHUNK: usize = 256;

#[derive(Clone, Copy, Debug)]
struct Task {
    span: usize,
    head: usize,
    q0: usize,
    q1: usize,
    k0: usize,
    k1: usize,
}

/// Softmax state of one task: per row (query token × grouped head) the running max, the
/// running sum of exponentials, and the unnormalised value accumulator.
struct Partial {
    task: Task,
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

pub(crate) fn attend(
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    out: &mut CpuTensor,
) -> Result<(), Error> {
    // Validate every block reference up front so the parallel part cannot fail.
    for s in spans {
        let last = s.first_pos + s.n_tokens;
        if last > 0 {
            pool.block_of(s.blocks, last - 1)?;
        }
    }
    let tasks = plan(spans, g, pool.block_size());
    let partials: Vec<Partial> = match pool.codec() {
        None => tasks
            .par_iter()
            .map(|&t| run_task(t, qkv, g, spans, pool))
            .collect(),
        Some(c) => tasks
            .par_iter()
            .map(|&t| run_task_codec(t, qkv, g, spans, pool, c))
            .collect::<Result<_, _>>()?,
    };
    merge_into(partials, g, spans, out);
    Ok(())
}

fn plan(spans: &[SeqSpan<'_>], g: &AttnGeometry, block_size: usize) -> Vec<Task> {
    let chunk = KEY_CHUNK.div_ceil(block_size) * block_size;
    let mut tasks = Vec::new();
    for (si, s) in spans.iter().enumerate() {
        let ctx = s.first_pos + s.n_tokens;
        let split = s.n_tokens <= QUERY_TILE && ctx > chunk;
        for head in 0..g.n_kv_heads {
            for q0 in (0..s.n_tokens).step_by(QUERY_TILE) {
                let q1 = (q0 + QUERY_TILE).min(s.n_tokens);
                let kend = s.first_pos + q1;
                if split {
                    for k0 in (0..kend).step_by(chunk) {
                        tasks.push(Task {
                            span: si,
                            head,
                            q0,
                            q1,
                            k0,
                            k1: (k0 + chunk).min(kend),
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

fn run_task(
    t: Task,
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
) -> Partial {
    let s = &spans[t.span];
    let (d, group, bs) = (g.head_dim, g.group(), pool.block_size());
    let rows = (t.q1 - t.q0) * group;
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut acc = vec![0f32; rows * d];
    let mut kbuf = vec![0f32; bs * d];
    let mut vbuf = vec![0f32; bs * d];
    let mut scores = vec![0f32; bs];
    let mut p0 = t.k0;
    while p0 < t.k1 {
        let n = (bs - p0 % bs).min(t.k1 - p0);
        // Blocks were validated in `attend`; positions below the span's end are covered.
        let block = pool.block_of(s.blocks, p0).unwrap_or(0);
        let slot = p0 % bs;
        pool.load(Half::K, block, t.head, slot + n, &mut kbuf);
        pool.load(Half::V, block, t.head, slot + n, &mut vbuf);
        for qi in t.q0..t.q1 {
            let visible = (s.first_pos + qi + 1).saturating_sub(p0).min(n);
            if visible == 0 {
                continue;
            }
            let q_row = qkv.row(s.first_row + qi);
            for gh in 0..group {
                let h = t.head * group + gh;
                let q = &q_row[h * d..(h + 1) * d];
                let r = (qi - t.q0) * group + gh;
                let keys = &kbuf[slot * d..(slot + visible) * d];
                ops::scores(q, keys, g.scale, &mut scores[..visible]);
                let block_max = scores[..visible]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let m_new = m[r].max(block_max);
                let corr = (m[r] - m_new).exp();
                let mut block_sum = 0f32;
                for sc in &mut scores[..visible] {
                    *sc = (*sc - m_new).exp();
                    block_sum += *sc;
                }
                l[r] = l[r] * corr + block_sum;
                let values = &vbuf[slot * d..(slot + visible) * d];
                ops::weighted_sum(
                    &mut acc[r * d..(r + 1) * d],
                    corr,
                    &scores[..visible],
                    values,
                );
                m[r] = m_new;
            }
        }
        p0 += n;
    }
    Partial { task: t, m, l, acc }
}

/// [`run_task`] for a compressed pool: for each query row, scores every visible key on its
/// codes (the query rotated once), softmaxes, and accumulates the values' codes in the
/// rotated basis before one inverse rotation. Two passes over the task's key range (scores,
/// then values) read each block's bytes once per query head.
fn run_task_codec(
    t: Task,
    qkv: &CpuTensor,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    pool: &CpuKvPool,
    c: &CodecStore,
) -> Result<Partial, Error> {
    let s = &spans[t.span];
    let (d, group, bs) = (g.head_dim, g.group(), pool.block_size());
    let rows = (t.q1 - t.q0) * group;
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut acc = vec![0f32; rows * d];
    let mut scores = Vec::with_capacity(t.k1 - t.k0);
    let mut exact: Vec<(usize, &[u16])> = Vec::new();
    let (mut kx, mut vx) = (vec![0f32; d], vec![0f32; d]);
    for qi in t.q0..t.q1 {
        let end = (s.first_pos + qi + 1).min(t.k1);
        if end <= t.k0 {
            continue;
        }
        let q_row = qkv.row(s.first_row + qi);
        for gh in 0..group {
            let h = t.head * group + gh;
            let r = (qi - t.q0) * group + gh;
            let pq = c.codec.key.prepare_query(&q_row[h * d..(h + 1) * d])?;
            scores.clear();
            scores.resize(end - t.k0, 0.0);
            for (p0, chunk) in (t.k0..end).step_by(bs).zip(scores.chunks_mut(bs)) {
                let block = pool.block_of(s.blocks, p0)?;
                c.codec.key.score_block(
                    &pq,
                    pool.codec_block(Half::K, block, t.head),
                    &c.k_layout,
                    chunk,
                )?;
            }
            let q = &q_row[h * d..(h + 1) * d];
            let qpos = s.first_pos + qi;
            // Sink and recent-window tokens: exact f16 scores replace the codes' scores.
            exact.clear();
            if c.window.is_active() {
                for p in (t.k0..end).filter(|&p| c.window.is_exact(qpos, p)) {
                    let block = pool.block_of(s.blocks, p)?;
                    if let Some((k, v)) = pool.exact_kv(block, t.head, p % bs) {
                        k.reinterpret_cast::<f16>().convert_to_f32_slice(&mut kx);
                        scores[p - t.k0] = ops::dot(q, &kx);
                        exact.push((p, v));
                    }
                }
            }
            let mut mx = f32::NEG_INFINITY;
            for x in scores.iter_mut() {
                *x *= g.scale;
                mx = mx.max(*x);
            }
            let mut sum = 0f32;
            for x in scores.iter_mut() {
                *x = (*x - mx).exp();
                sum += *x;
            }
            // Exact values are summed in f32 here; their weights leave the codes' pass.
            let out = &mut acc[r * d..(r + 1) * d];
            vx.fill(0.0);
            for &(p, v) in &exact {
                v.reinterpret_cast::<f16>().convert_to_f32_slice(&mut kx);
                let w = scores[p - t.k0];
                vx.iter_mut().zip(&kx).for_each(|(o, x)| *o += w * x);
                scores[p - t.k0] = 0.0;
            }
            let mut values = c.codec.value.new_accumulator();
            for (p0, chunk) in (t.k0..end).step_by(bs).zip(scores.chunks(bs)) {
                let block = pool.block_of(s.blocks, p0)?;
                c.codec.value.accumulate_block(
                    &mut values,
                    pool.codec_block(Half::V, block, t.head),
                    &c.v_layout,
                    chunk,
                )?;
            }
            c.codec.value.finish(&values, out)?;
            out.iter_mut().zip(&vx).for_each(|(o, x)| *o += x);
            m[r] = mx;
            l[r] = sum;
        }
    }
    Ok(Partial { task: t, m, l, acc })
}

/// Merges the key-chunk partials of each (sequence, head, tile) and writes normalised rows.
fn merge_into(
    partials: Vec<Partial>,
    g: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    out: &mut CpuTensor,
) {
    let (d, group) = (g.head_dim, g.group());
    let width = out.cols();
    let data = out.as_mut_slice();
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
            }
        }
        i = j;
    }
}
