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
use crate::cpu::ops;

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
///
/// Per row: one pass selects the candidates (for `k = 1` a SIMD maximum and the first id
/// holding it; otherwise a small buffer cut back to the best `k` whenever it fills, after
/// which only logits strictly above the `k`-th best are looked at), and one SIMD pass sums
/// `e^(l − max)` for the log-sum-exp.
pub fn select_top_k(data: &[f32], cols: usize, k: usize, out: &mut TopK) -> Result<(), Error> {
    check_k(k)?;
    if cols == 0 || !data.len().is_multiple_of(cols) {
        return Err(crate::shape::shape(
            "to_host_top_k",
            format!("{} values are not rows of {cols}", data.len()),
        ));
    }
    let rows = data.len() / cols;
    out.reset(rows, cols, k);
    let mut cand: Vec<(f32, u32)> = Vec::with_capacity(if k == 1 { 1 } else { bound(k) });
    for (r, row) in data.chunks_exact(cols).enumerate() {
        if k == 1 {
            top_one(row, &mut cand);
        } else {
            top_many(row, k, &mut cand);
        }
        for (slot, &(_, id)) in cand.iter().enumerate() {
            out.ids[r * k + slot] = id;
            out.logits[r * k + slot] = row[id as usize];
        }
        out.counts[r] = cand.len() as u32;
        // The best candidate is the row's largest eligible logit (of a maximum of ±0, the
        // sign of the first zero).
        let max = cand
            .first()
            .map_or(f32::NEG_INFINITY, |&(_, id)| row[id as usize]);
        out.max[r] = max;
        out.lse[r] = if max.is_finite() {
            (f64::from(max) + ops::exp_sum(row, max).ln()) as f32
        } else {
            // −inf: nothing eligible; +inf: the sum is infinite.
            max
        };
    }
    Ok(())
}

/// Values tested at a time by the vectorised "anything here?" checks of the scans.
const CHUNK: usize = 32;

/// Candidates `top_many` holds before cutting back to the best `k`: large enough that the
/// cuts (a `select_nth` each) are rare, small enough to stay in L1.
fn bound(k: usize) -> usize {
    (2 * k).max(64)
}

/// `cand` = the row's best eligible logit (canonical value, id), or nothing.
fn top_one(row: &[f32], cand: &mut Vec<(f32, u32)>) {
    cand.clear();
    let max = ops::max_non_nan(row);
    if max == f32::NEG_INFINITY {
        return; // only NaN and −inf
    }
    // The first chunk holding the maximum (a branch-free test per chunk), then its position.
    let start = row
        .chunks_exact(CHUNK)
        .position(|c| c.iter().fold(false, |a, &v| a | (v == max)))
        .map_or(row.len() / CHUNK * CHUNK, |c| c * CHUNK);
    if let Some(i) = row[start..].iter().position(|&v| v == max) {
        cand.push((canon(max), (start + i) as u32));
    }
}

/// `cand` = the row's best `k` (canonical value, id) pairs, best first.
fn top_many(row: &[f32], k: usize, cand: &mut Vec<(f32, u32)>) {
    cand.clear();
    let cap = bound(k);
    // A logit is pushed only if it beats `thr`: −inf at first (so exactly the eligible
    // ones), then the `k`-th best held. A later logit equal to it has a larger id, so it
    // ranks below all `k` and is skipped too.
    let mut thr = f32::NEG_INFINITY;
    let mut scan = |vals: &[f32], base: usize, thr: &mut f32| {
        for (j, &v) in vals.iter().enumerate() {
            if v > *thr {
                cand.push((canon(v), (base + j) as u32));
                if cand.len() >= cap {
                    cand.select_nth_unstable_by(k - 1, better_first);
                    cand.truncate(k);
                    *thr = cand[k - 1].0;
                }
            }
        }
    };
    let mut chunks = row.chunks_exact(CHUNK);
    for (c, vals) in (&mut chunks).enumerate() {
        // Most chunks hold nothing above the threshold once it is set: test that branch-free.
        if vals.iter().fold(false, |a, &v| a | (v > thr)) {
            scan(vals, c * CHUNK, &mut thr);
        }
    }
    scan(chunks.remainder(), row.len() / CHUNK * CHUNK, &mut thr);
    if cand.len() > k {
        cand.select_nth_unstable_by(k - 1, better_first);
        cand.truncate(k);
    }
    cand.sort_unstable_by(better_first);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The straightforward selection (every eligible pair collected, `select_nth`, sort) and
    /// the f64 log-sum-exp: what `select_top_k` must reproduce.
    fn reference_top_k(data: &[f32], cols: usize, k: usize) -> TopK {
        let mut out = TopK::default();
        out.reset(data.len() / cols, cols, k);
        for (r, row) in data.chunks_exact(cols).enumerate() {
            let mut cand: Vec<(f32, u32)> = row
                .iter()
                .enumerate()
                .filter(|(_, v)| **v > f32::NEG_INFINITY)
                .map(|(i, &v)| (canon(v), i as u32))
                .collect();
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
            let max = row
                .iter()
                .filter(|v| **v > f32::NEG_INFINITY)
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            out.max[r] = max;
            out.lse[r] = if max.is_finite() {
                let m = f64::from(max);
                let sum: f64 = row
                    .iter()
                    .filter(|v| v.is_finite())
                    .map(|&v| (f64::from(v) - m).exp())
                    .sum();
                (m + sum.ln()) as f32
            } else {
                max
            };
        }
        out
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    fn assert_same(what: &str, got: &TopK, want: &TopK) {
        assert_eq!((got.k, got.cols), (want.k, want.cols), "{what}: shape");
        assert_eq!(got.counts, want.counts, "{what}: counts");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for r in 0..want.rows() {
            let (a, b) = (got.row(r).unwrap(), want.row(r).unwrap());
            assert_eq!(a.ids, b.ids, "{what}: row {r} ids");
            assert_eq!(bits(a.logits), bits(b.logits), "{what}: row {r} logits");
            // `==`: a maximum of 0 may be −0 on one side and +0 on the other.
            assert_eq!(a.max, b.max, "{what}: row {r} max");
            if b.lse.is_finite() {
                // The error of a log-sum-exp is absolute (that of the sum, relative).
                assert!(
                    (a.lse - b.lse).abs() <= 1e-6 * b.lse.abs().max(1.0),
                    "{what}: row {r} lse {} vs {}",
                    a.lse,
                    b.lse
                );
            } else {
                assert_eq!(a.lse, b.lse, "{what}: row {r} lse");
            }
        }
    }

    /// Random rows of every kind against the reference: continuous and integer (tie-heavy)
    /// logits, NaN, ±inf and ±0 sprinkled in, rows sorted either way (the worst and best case
    /// for the threshold), rows with fewer eligible logits than `k` or none at all.
    #[test]
    fn matches_reference_on_random_rows() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut out = TopK::default();
        let mut cases = 0;
        for case in 0..260 {
            // Widths log-uniform over 1..300000, plus the sizes that matter.
            let cols = match case % 13 {
                0 => 128_256,
                1 => 262_144,
                2 => 300_000,
                3 => 1 + rng.below(64),
                _ => (300_000f64.powf(f64::from(rng.unit()) * 0.5 + 0.5) as usize).max(1),
            };
            let rows = if cols < 5_000 { 1 + rng.below(4) } else { 1 };
            let n = rows * cols;
            let variant = rng.below(8);
            let mut x: Vec<f32> = (0..n).map(|_| 20.0 * rng.unit()).collect();
            match variant {
                // Integer logits: massive ties at every threshold.
                1 => x.iter_mut().for_each(|v| *v = v.round().clamp(-3.0, 3.0)),
                2 | 3 => {
                    for _ in 0..(n / 5).max(1) {
                        let i = rng.below(n);
                        x[i] = [f32::NAN, f32::NEG_INFINITY, -0.0, 0.0, 8.0][rng.below(5)];
                    }
                    if variant == 3 {
                        x[rng.below(n)] = f32::INFINITY;
                    }
                }
                // Ascending / descending rows (ties kept by rounding).
                4 => {
                    x.iter_mut().for_each(|v| *v = v.round());
                    x.sort_by(f32::total_cmp);
                }
                5 => x.sort_by(|a, b| b.total_cmp(a)),
                // Few eligible logits, the rest NaN / −inf; sometimes none at all.
                6 => {
                    let keep = rng.below(300);
                    for v in &mut x {
                        if rng.below(n) >= keep {
                            *v = if rng.below(2) == 0 {
                                f32::NAN
                            } else {
                                f32::NEG_INFINITY
                            };
                        }
                    }
                }
                // Zeros of both signs only, with some +inf.
                7 => {
                    for v in &mut x {
                        *v = match rng.below(10) {
                            0 => f32::INFINITY,
                            1..5 => -0.0,
                            _ => 0.0,
                        };
                    }
                }
                _ => {}
            }
            for k in [1, 2, 7, 40, 256] {
                let what = format!("case {case} variant {variant} ({rows}x{cols}, k {k})");
                select_top_k(&x, cols, k, &mut out).unwrap();
                assert_same(&what, &out, &reference_top_k(&x, cols, k));
                cases += 1;
            }
        }
        assert_eq!(cases, 260 * 5);
    }

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
