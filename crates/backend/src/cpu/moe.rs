//! The mixture-of-experts MLP on the CPU (gpt-oss): route every row, then run each expert
//! once over the rows that chose it (a gathered batch, so its weights are read once per
//! step however many tokens picked it).

use super::{CpuBackend, CpuTensor, expect_cols, shape};
use crate::backend::{Backend, MoeMlp};
use crate::{Error, WeightMatrix};

/// gpt-oss's clamped SwiGLU of one expert output: `(clamp(u, ±limit) + 1) · g' · σ(α g')`
/// with `g' = min(g, limit)`.
pub(crate) fn clamped_swiglu(g: f32, u: f32, alpha: f32, limit: f32) -> f32 {
    let g = g.min(limit);
    let u = u.clamp(-limit, limit);
    (u + 1.0) * g / (1.0 + (-alpha * g).exp())
}

/// Each row's chosen experts and their weights: the `top_k` largest logits (ties to the
/// lower index) and the softmax over just those.
pub(crate) fn route(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.truncate(top_k);
    let m = idx
        .iter()
        .map(|&i| logits[i])
        .fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = idx.iter().map(|&i| (logits[i] - m).exp()).collect();
    let z: f32 = e.iter().sum();
    idx.into_iter().zip(e).map(|(i, e)| (i, e / z)).collect()
}

fn check(mlp: &MoeMlp<'_, WeightMatrix, Vec<f32>>, hidden: usize) -> Result<(), Error> {
    let n = mlp.experts.len();
    let bad = |m: String| Err(shape("moe", m));
    if !(1..=n).contains(&mlp.top_k) {
        return bad(format!("top-{} of {n} experts", mlp.top_k));
    }
    if (mlp.router.rows(), mlp.router.cols()) != (n, hidden) {
        return bad(format!(
            "router [{}, {}] for {n} experts of width {hidden}",
            mlp.router.rows(),
            mlp.router.cols()
        ));
    }
    if mlp.router_bias.is_some_and(|b| b.len() != n) {
        return bad(format!("router bias for {n} experts has another length"));
    }
    for (e, x) in mlp.experts.iter().enumerate() {
        let f2 = x.gate_up.rows();
        let ok = f2 % 2 == 0
            && x.gate_up.cols() == hidden
            && (x.down.rows(), x.down.cols()) == (hidden, f2 / 2)
            && x.gate_up_bias.as_ref().is_none_or(|b| b.len() == f2)
            && x.down_bias.as_ref().is_none_or(|b| b.len() == hidden);
        if !ok {
            return bad(format!(
                "expert {e}: gate_up [{f2}, {}], down [{}, {}] for width {hidden}",
                x.gate_up.cols(),
                x.down.rows(),
                x.down.cols()
            ));
        }
    }
    Ok(())
}

/// [`Backend::moe`] on the CPU.
pub(super) fn moe(
    b: &CpuBackend,
    x: &CpuTensor,
    mlp: &MoeMlp<'_, WeightMatrix, Vec<f32>>,
    out: &mut CpuTensor,
) -> Result<(), Error> {
    let (rows, hidden) = (x.rows(), x.cols());
    expect_cols("moe", out, hidden)?;
    check(mlp, hidden)?;
    let n = mlp.experts.len();
    let mut logits = b.tensor(rows, n)?;
    b.matmul(x, mlp.router, &mut logits)?;
    if let Some(bias) = mlp.router_bias {
        b.add_bias(&mut logits, bias)?;
    }
    // Per expert: the rows that chose it and their weights.
    let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n];
    for r in 0..rows {
        for (e, w) in route(logits.row(r), mlp.top_k) {
            chosen[e].push((r, w));
        }
    }
    b.set_rows(out, rows)?;
    out.as_mut_slice().fill(0.0);
    let (mut xs, mut down) = (b.tensor(0, hidden)?, b.tensor(0, hidden)?);
    for (expert, picks) in mlp.experts.iter().zip(&chosen) {
        if picks.is_empty() {
            continue;
        }
        let idx: Vec<usize> = picks.iter().map(|&(r, _)| r).collect();
        b.gather_rows(x, &idx, &mut xs)?;
        let f = expert.gate_up.rows() / 2;
        let mut gu = CpuTensor::from_vec(vec![0.0; idx.len() * 2 * f], idx.len(), 2 * f)?;
        b.matmul(&xs, &expert.gate_up, &mut gu)?;
        if let Some(bias) = &expert.gate_up_bias {
            b.add_bias(&mut gu, bias)?;
        }
        let mut act = CpuTensor::from_vec(vec![0.0; idx.len() * f], idx.len(), f)?;
        for (a, g) in act
            .as_mut_slice()
            .chunks_mut(f)
            .zip(gu.as_slice().chunks(2 * f))
        {
            let (g, u) = g.split_at(f);
            for ((a, &g), &u) in a.iter_mut().zip(g).zip(u) {
                *a = clamped_swiglu(g, u, mlp.alpha, mlp.limit);
            }
        }
        b.matmul(&act, &expert.down, &mut down)?;
        if let Some(bias) = &expert.down_bias {
            b.add_bias(&mut down, bias)?;
        }
        let o = out.as_mut_slice();
        for (i, &(r, w)) in picks.iter().enumerate() {
            let dst = &mut o[r * hidden..(r + 1) * hidden];
            dst.iter_mut()
                .zip(down.row(i))
                .for_each(|(d, &v)| *d += w * v);
        }
    }
    Ok(())
}
