//! Row kernels: RMSNorm, RoPE, and the dot/axpy inner loops with runtime SIMD dispatch.
//!
//! The inner loops are written once as plain Rust; `#[target_feature]` wrappers let LLVM
//! vectorise them for AVX2+FMA when the CPU has it, and the plain build serves the rest.

use crate::backend::{Rope, RopeStyle};

/// True when AVX2 and FMA are available (checked once).
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Sum of squares with 8 independent accumulators (vectorisable, and more accurate than one).
#[inline(always)]
fn sum_sq_body(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] = c[i].mul_add(c[i], acc[i]);
        }
    }
    acc.iter().sum::<f32>() + rest.iter().map(|v| v * v).sum::<f32>()
}

/// `Σ a_i b_i` with 8 accumulators.
#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

/// `y = y·scale + p·x`.
#[inline(always)]
fn scale_axpy_body(y: &mut [f32], scale: f32, p: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = p.mul_add(x, *y * scale);
    }
}

/// `out[j] = scale · ⟨q, k_j⟩` for the rows `k_j` (length `q.len()`) of `keys`.
#[inline(always)]
fn scores_body(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
        *o = dot_body(q, k) * scale;
    }
}

/// `acc = acc·corr + Σ_j p_j · v_j` for the rows `v_j` (length `acc.len()`) of `values`.
#[inline(always)]
fn weighted_sum_body(acc: &mut [f32], corr: f32, p: &[f32], values: &[f32]) {
    for a in acc.iter_mut() {
        *a *= corr;
    }
    for (&w, v) in p.iter().zip(values.chunks_exact(acc.len())) {
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = w.mul_add(x, *a);
        }
    }
}

macro_rules! dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? => $body:ident) => {
        $(#[$m])*
        #[inline]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn simd($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if has_avx2_fma() {
                    // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
                    return unsafe { simd($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

dispatch!(
    /// Sum of squares.
    pub(crate) fn sum_sq(x: &[f32]) -> f32 => sum_sq_body
);
dispatch!(
    /// `y = y·scale + p·x` (the online-softmax value update).
    pub(crate) fn scale_axpy(y: &mut [f32], scale: f32, p: f32, x: &[f32]) => scale_axpy_body
);

/// `out[j] = scale · ⟨q, k_j⟩` for the rows `k_j` (length `q.len()`) of `keys`: one call
/// per block of keys, not per key.
#[inline]
pub(crate) fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && q.len().is_multiple_of(8) && keys.len() >= out.len() * q.len() {
        // SAFETY: AVX2 and FMA were detected; the lengths were checked just above.
        return unsafe { super::attn_avx2::scores(q, keys, scale, out) };
    }
    scores_body(q, keys, scale, out)
}

/// `acc = acc·corr + Σ_j p_j · v_j` (the online-softmax value update for a block of values).
#[inline]
pub(crate) fn weighted_sum(acc: &mut [f32], corr: f32, p: &[f32], values: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && acc.len().is_multiple_of(8) && values.len() >= p.len() * acc.len() {
        // SAFETY: AVX2 and FMA were detected; the lengths were checked just above.
        return unsafe { super::attn_avx2::weighted_sum(acc, corr, p, values) };
    }
    weighted_sum_body(acc, corr, p, values)
}

/// `max_j x[j]` (−∞ for an empty slice).
#[inline]
pub(crate) fn max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { super::attn_avx2::max(x) };
    }
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `x[j] = e^(x[j] − m)`, returning `Σ_j x[j]` (the softmax numerators of a block).
#[inline]
pub(crate) fn exp_shift_sum(x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { super::attn_avx2::exp_shift_sum(x, m) };
    }
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    sum
}

/// The largest value of `x` that is not NaN (−∞ when there is none, +∞ if one is +∞).
#[inline]
pub(crate) fn max_non_nan(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { super::attn_avx2::max_non_nan(x) };
    }
    max_non_nan_scalar(x)
}

/// The portable [`max_non_nan`].
pub(crate) fn max_non_nan_scalar(x: &[f32]) -> f32 {
    x.iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// `Σ_j e^(x[j] − m)` accumulated in f64, leaving `x` alone (a log-sum-exp over a whole row
/// of logits). NaN and −∞ entries add nothing (the SIMD path: ~1e-38 each). `m` must be
/// finite and at least every `x[j]`; the result is within ~3e-7 relative of the f64 sum.
#[inline]
pub(crate) fn exp_sum(x: &[f32], m: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && m.is_finite() {
        // SAFETY: AVX2 and FMA were detected; `m` is finite.
        return unsafe { super::attn_avx2::exp_sum(x, m) };
    }
    exp_sum_scalar(x, m)
}

/// The portable [`exp_sum`]: f32 `exp`, f64 sum.
pub(crate) fn exp_sum_scalar(x: &[f32], m: f32) -> f64 {
    x.iter()
        .filter(|v| !v.is_nan())
        .map(|&v| f64::from((v - m).exp()))
        .sum()
}

/// `out = x / sqrt(mean(x²) + eps) · w`.
pub(crate) fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt();
    for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
        *o = x * inv * w;
    }
}

/// RMSNorm of one head vector in place.
pub(crate) fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = 1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt();
    for (x, &w) in x.iter_mut().zip(w) {
        *x *= inv * w;
    }
}

/// Rotates one head vector for position `pos`.
pub(crate) fn rope(head: &mut [f32], pos: usize, rope: &Rope) {
    let half = rope.inv_freq.len();
    for (i, &f) in rope.inv_freq.iter().enumerate() {
        let angle = pos as f32 * f;
        let (sin, cos) = angle.sin_cos();
        let (a, b) = match rope.style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::HalfSplit => (i, i + half),
        };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * cos - x1 * sin;
        head[b] = x0 * sin + x1 * cos;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_match_naive_for_ragged_lengths() {
        for n in [1usize, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mut s = [0f32];
            scores(&a, &b, 1.0, &mut s);
            assert!((s[0] as f64 - naive).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn rope_styles_pair_different_coordinates_and_preserve_norm() {
        let inv_freq: Vec<f32> = (0..4)
            .map(|i| 10000f32.powf(-(2 * i) as f32 / 8.0))
            .collect();
        let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let mut a = x.clone();
        let mut b = x.clone();
        rope(
            &mut a,
            5,
            &Rope {
                inv_freq: inv_freq.clone(),
                style: RopeStyle::Interleaved,
            },
        );
        rope(
            &mut b,
            5,
            &Rope {
                inv_freq,
                style: RopeStyle::HalfSplit,
            },
        );
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((n(&a) - n(&x)).abs() < 1e-3 && (n(&b) - n(&x)).abs() < 1e-3);
        // pair 0 of the interleaved style is (x0, x1) rotated by angle 5.
        let (s, c) = 5f32.sin_cos();
        assert!((a[0] - (x[0] * c - x[1] * s)).abs() < 1e-5);
        assert!((b[4] - (x[0] * s + x[4] * c)).abs() < 1e-5);
    }

    #[test]
    fn rope_at_position_zero_is_identity() {
        let inv_freq = vec![1.0, 0.5];
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope(
            &mut x,
            0,
            &Rope {
                inv_freq,
                style: RopeStyle::Interleaved,
            },
        );
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    }
}
