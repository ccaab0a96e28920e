//! The end of a step that copies back only each row's best logits: [`TopK`] and the host
//! selection behind the default [`Backend::to_host_top_k`](crate::Backend::to_host_top_k).
//!
//! Order and eligibility match the host sampler (`turbokv_model::sampling`) so that a draw
//! from the candidates is exactly the draw from the full row:
//! - a logit is *eligible* when it is not NaN and not −inf (+inf is eligible);
//! - candidates are ordered by descending value, −0.0 and +0.0 equal, then ascending id (so
//!   the first candidate is `sampling::argmax`'s pick).

use std::cmp::Ordering;

use crate::Error;

/// Most candidates per row [`Backend::to_host_top_k`](crate::Backend::to_host_top_k) returns
/// (the CUDA kernel sorts them in one block's shared memory).
pub const TOPK_MAX: usize = 256;

/// Per row of a logits tensor: its `k` best eligible logits with their ids, plus the row's
/// maximum and log-sum-exp over every eligible logit, so the host can turn a candidate's
/// logit `l` into its exact softmax probability `exp(l - lse)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopK {
    /// Slots per row (the `k` asked for).
    pub k: usize,
    /// Columns (vocabulary size) of the rows.
    pub cols: usize,
    /// `rows × k` token ids, row-major; row `r`'s first `counts[r]` are valid, best first.
    pub ids: Vec<u32>,
    /// The logits of those ids (the values as stored, not clamped).
    pub logits: Vec<f32>,
    /// Valid candidates per row: `min(k, eligible logits in the row)`.
    pub counts: Vec<u32>,
    /// The largest eligible logit per row (−inf for a row with none, +inf if one is +inf).
    pub max: Vec<f32>,
    /// `log Σ exp(l)` over the row's eligible logits (−inf with none, +inf with a +inf).
    pub lse: Vec<f32>,
}

/// One row of a [`TopK`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopKRow<'a> {
    /// Candidate ids, best first.
    pub ids: &'a [u32],
    /// Their logits.
    pub logits: &'a [f32],
    /// Slots asked for: fewer candidates than this means the row had no more eligible logits.
    pub k: usize,
    /// Columns (vocabulary size) of the row.
    pub cols: usize,
    /// The row's largest eligible logit.
    pub max: f32,
    /// The row's log-sum-exp over eligible logits.
    pub lse: f32,
}

impl TopK {
    /// Rows held.
    pub fn rows(&self) -> usize {
        self.counts.len()
    }

    /// Row `r` (`None` past the end).
    pub fn row(&self, r: usize) -> Option<TopKRow<'_>> {
        let n = *self.counts.get(r)? as usize;
        let start = r * self.k;
        Some(TopKRow {
            ids: self.ids.get(start..start + n)?,
            logits: self.logits.get(start..start + n)?,
            k: self.k,
            cols: self.cols,
            max: self.max[r],
            lse: self.lse[r],
        })
    }

    /// Empties and shapes `self` for `rows` rows of `k` slots over `cols` columns.
    pub(crate) fn reset(&mut self, rows: usize, cols: usize, k: usize) {
        self.k = k;
        self.cols = cols;
        self.ids.clear();
        self.ids.resize(rows * k, 0);
        self.logits.clear();
        self.logits.resize(rows * k, f32::NAN);
        self.counts.clear();
        self.counts.resize(rows, 0);
        self.max.clear();
        self.max.resize(rows, f32::NEG_INFINITY);
        self.lse.clear();
        self.lse.resize(rows, f32::NEG_INFINITY);
    }
}

/// Refuses `k` outside `1..=TOPK_MAX`.
pub(crate) fn check_k(k: usize) -> Result<(), Error> {
    if k == 0 || k > TOPK_MAX {
        return Err(Error::TopKOutOfRange { k, max: TOPK_MAX });
    }
    Ok(())
}

/// `v` with −0.0 turned into +0.0: the candidates' order treats them as equal, like `>`.
#[inline]
fn canon(v: f32) -> f32 {
    if v == 0.0 { 0.0 } else { v }
}

/// Descending canonical value, then ascending id (a total order over eligible logits).
#[inline]
fn better_first(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Selects the top `k` of every `cols`-wide row of `data` into `out` (the reference the CUDA
/// kernel is tested against, and the CPU backend's implementation).
pub fn select_top_k(data: &[f32], cols: usize, k: usize, out: &mut TopK) -> Result<(), Error> {
    check_k(k)?;
    if cols == 0 || !data.len().is_multiple_of(cols) {
        return Err(crate::cpu::shape(
            "to_host_top_k",
            format!("{} values are not rows of {cols}", data.len()),
        ));
    }
    let rows = data.len() / cols;
    out.reset(rows, cols, k);
    let mut cand: Vec<(f32, u32)> = Vec::new();
    for (r, row) in data.chunks_exact(cols).enumerate() {
        cand.clear();
        cand.extend(
            row.iter()
                .enumerate()
                .filter(|(_, v)| **v > f32::NEG_INFINITY)
                .map(|(i, &v)| (canon(v), i as u32)),
        );
        if cand.len() > k {
            cand.select_nth_unstable_by(k - 1, better_first);
            cand.truncate(k);
        }
        cand.sort_unstable_by(better_first);
        for (slot, &(_, id)) in cand.iter().enumerate() {
            out.ids[r * k + slot] = id;
            out.logits[r * k + slot] = row[id as usize];
        }
        out.counts[r] = cand.len() as u32;
        let (max, lse) = max_lse(row);
        out.max[r] = max;
        out.lse[r] = lse;
    }
    Ok(())
}

/// The largest eligible value and the log-sum-exp over eligible values (in f64).
fn max_lse(row: &[f32]) -> (f32, f32) {
    let max = row
        .iter()
        .filter(|v| **v > f32::NEG_INFINITY)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if !max.is_finite() {
        // −inf: nothing eligible; +inf: the sum is infinite.
        return (max, max);
    }
    let m = f64::from(max);
    let sum: f64 = row
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| (f64::from(v) - m).exp())
        .sum();
    (max, (m + sum.ln()) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selects_best_first_with_ties_by_id() {
        let row = [1.0, 3.0, f32::NAN, 3.0, -0.0, 0.0, f32::NEG_INFINITY, 2.0];
        let mut t = TopK::default();
        select_top_k(&row, row.len(), 5, &mut t).unwrap();
        let r = t.row(0).unwrap();
        assert_eq!(r.ids, &[1, 3, 7, 0, 4]);
        assert_eq!(r.logits, &[3.0, 3.0, 2.0, 1.0, -0.0]);
        assert_eq!(r.max, 3.0);
        let want = [1.0f64, 3.0, 3.0, 0.0, 0.0, 2.0]
            .iter()
            .map(|v| v.exp())
            .sum::<f64>()
            .ln();
        assert!((f64::from(r.lse) - want).abs() < 1e-6);
    }

    #[test]
    fn short_rows_and_bad_k() {
        let rows = [
            f32::NAN,
            1.0,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::NAN,
            f32::NAN,
        ];
        let mut t = TopK::default();
        select_top_k(&rows, 3, 4, &mut t).unwrap();
        assert_eq!(t.rows(), 2);
        assert_eq!(t.row(0).unwrap().ids, &[1]);
        assert_eq!(t.row(1).unwrap().ids, &[] as &[u32]);
        assert_eq!(t.max[1], f32::NEG_INFINITY);
        assert_eq!(t.lse[1], f32::NEG_INFINITY);
        assert!(select_top_k(&rows, 3, 0, &mut t).is_err());
        assert!(select_top_k(&rows, 3, TOPK_MAX + 1, &mut t).is_err());
        assert!(select_top_k(&rows, 4, 1, &mut t).is_err());
    }
}
