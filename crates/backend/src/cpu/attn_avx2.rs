//! AVX2 + FMA inner loops of the attention kernel, written with intrinsics because the
//! portable versions in `ops` spend most of their time on horizontal sums, scalar `exp` and
//! reloading the accumulator for every key.
//!
//! Every function requires AVX2 and FMA (callers check with `ops::has_avx2_fma`) and a row
//! length that is a multiple of 8; `ops` dispatches to the portable code otherwise.

use std::arch::x86_64::*;

/// Sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<0b01>(t, t)))
}

/// Lane j of the result = sum of the lanes of `v[j]`, for four vectors.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum4(v: [__m256; 4]) -> __m128 {
    let a = _mm256_hadd_ps(v[0], v[1]); // 0 0 1 1 | 0 0 1 1
    let b = _mm256_hadd_ps(v[2], v[3]); // 2 2 3 3 | 2 2 3 3
    let c = _mm256_hadd_ps(a, b); // 0 1 2 3 | 0 1 2 3
    _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c))
}

/// `out[j] = scale · ⟨q, k_j⟩`, four keys per pass so each query chunk is loaded once per
/// four keys and one horizontal reduction serves four scores.
///
/// # Safety
/// AVX2 and FMA; `q.len()` a multiple of 8, `keys.len() >= out.len() * q.len()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    let w = q.len();
    debug_assert!(w.is_multiple_of(8) && keys.len() >= out.len() * w);
    let qp = q.as_ptr();
    let mut j = 0;
    while j + 4 <= out.len() {
        let kp = keys[j * w..(j + 4) * w].as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in (0..w).step_by(8) {
            // SAFETY: c + 8 <= w; the four key rows lie inside `keys[j·w..(j+4)·w]`.
            unsafe {
                let qv = _mm256_loadu_ps(qp.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add(r * w + c)), *a);
                }
            }
        }
        let s = _mm_mul_ps(hsum4(acc), _mm_set1_ps(scale));
        // SAFETY: j + 4 <= out.len().
        unsafe { _mm_storeu_ps(out.as_mut_ptr().add(j), s) };
        j += 4;
    }
    for (o, k) in out[j..].iter_mut().zip(keys[j * w..].chunks_exact(w)) {
        let mut acc = _mm256_setzero_ps();
        for c in (0..w).step_by(8) {
            // SAFETY: c + 8 <= w for both rows.
            unsafe {
                acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(qp.add(c)),
                    _mm256_loadu_ps(k.as_ptr().add(c)),
                    acc,
                );
            }
        }
        *o = hsum(acc) * scale;
    }
}

/// `e^x` for x ≤ 88 (Cephes `expf`: range reduction by ln 2, degree-6 polynomial; relative
/// error ~2e-7; inputs below −87.3 give ~1e-38, i.e. zero next to the softmax maximum).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_set1_ps(88.37),
        _mm256_max_ps(x, _mm256_set1_ps(-87.33)),
    );
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(x, x),
        _mm256_add_ps(x, _mm256_set1_ps(1.0)),
    );
    let n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
    _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(n)))
}

/// `max_j x[j]` (−∞ for an empty slice; NaN-free inputs).
///
/// # Safety
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn max(x: &[f32]) -> f32 {
    let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); 2];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 16 floats.
        unsafe {
            m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(c.as_ptr()));
            m[1] = _mm256_max_ps(m[1], _mm256_loadu_ps(c.as_ptr().add(8)));
        }
    }
    let v = _mm256_max_ps(m[0], m[1]);
    let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_shuffle_ps::<0b01>(h, h));
    chunks
        .remainder()
        .iter()
        .fold(_mm_cvtss_f32(h), |a, &b| a.max(b))
}

/// `x[j] = e^(x[j] − m)`; returns `Σ x[j]`.
///
/// # Safety
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_shift_sum(x: &mut [f32], m: f32) -> f32 {
    let mv = _mm256_set1_ps(m);
    let mut sum = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 floats.
        unsafe {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..rest.len()].copy_from_slice(rest);
        // SAFETY: `buf` holds 8 floats. Only the `rest.len()` real lanes are kept and summed.
        unsafe {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv));
            _mm256_storeu_ps(buf.as_mut_ptr(), e);
        }
        rest.copy_from_slice(&buf[..rest.len()]);
        return hsum(sum) + rest.iter().sum::<f32>();
    }
    hsum(sum)
}

/// The largest value of `x` that is not NaN (−∞ when there is none, +∞ if one is +∞).
///
/// # Safety
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn max_non_nan(x: &[f32]) -> f32 {
    // `maxps a, b` returns `b` when either is NaN: the loaded values go first, so a NaN
    // lane keeps the running maximum (which is never NaN) instead of replacing it.
    let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for (r, mr) in m.iter_mut().enumerate() {
            // SAFETY: `c` holds exactly 32 floats, so `8r..8r + 8` is inside it.
            *mr = _mm256_max_ps(unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * r)) }, *mr);
        }
    }
    let v = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_shuffle_ps::<0b01>(h, h));
    chunks
        .remainder()
        .iter()
        .fold(_mm_cvtss_f32(h), |a, &b| if b > a { b } else { a })
}

/// `Σ_j e^(x[j] − m)` without writing `x`: 8-lane f32 partial sums over 64 values at a
/// time, each block's sum added into an f64 total, so a row of 10⁵–10⁶ values keeps ~1e-7
/// relative accuracy. NaN and −∞ entries (clamped to −87.33 by `exp`) add ~1e-38 each.
///
/// # Safety
/// AVX2 and FMA; `m` finite.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_sum(x: &[f32], m: f32) -> f64 {
    let mv = _mm256_set1_ps(m);
    let mut total = 0f64;
    let mut blocks = x.chunks_exact(64);
    for b in &mut blocks {
        let mut s = [_mm256_setzero_ps(); 2];
        for j in 0..8 {
            // SAFETY: `b` holds exactly 64 floats, so `8j..8j + 8` is inside it.
            let v = unsafe { _mm256_loadu_ps(b.as_ptr().add(8 * j)) };
            s[j % 2] = _mm256_add_ps(s[j % 2], exp(_mm256_sub_ps(v, mv)));
        }
        total += f64::from(hsum(_mm256_add_ps(s[0], s[1])));
    }
    let mut chunks = blocks.remainder().chunks_exact(8);
    let mut s = _mm256_setzero_ps();
    for c in &mut chunks {
        // SAFETY: `c` holds exactly 8 floats.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        s = _mm256_add_ps(s, exp(_mm256_sub_ps(v, mv)));
    }
    total += f64::from(hsum(s));
    total
        + chunks
            .remainder()
            .iter()
            .filter(|v| !v.is_nan())
            .map(|&v| f64::from((v - m).exp()))
            .sum::<f64>()
}

/// `acc = acc·corr + Σ_j p_j·v_j`, the accumulator held in registers 32 floats at a time
/// while every value row streams past.
///
/// # Safety
/// AVX2 and FMA; `acc.len()` a multiple of 8, `values.len() >= p.len() * acc.len()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_sum(acc: &mut [f32], corr: f32, p: &[f32], values: &[f32]) {
    let w = acc.len();
    debug_assert!(w.is_multiple_of(8) && values.len() >= p.len() * w);
    let cv = _mm256_set1_ps(corr);
    let (ap, vp) = (acc.as_mut_ptr(), values.as_ptr());
    let mut c = 0;
    while c + 32 <= w {
        // SAFETY: c + 32 <= w; row j's chunk lies inside `values[j·w..(j+1)·w]`.
        unsafe {
            let mut a = [0; 4].map(|_| _mm256_setzero_ps());
            for (r, ar) in a.iter_mut().enumerate() {
                *ar = _mm256_mul_ps(_mm256_loadu_ps(ap.add(c + 8 * r)), cv);
            }
            for (j, &pj) in p.iter().enumerate() {
                let pv = _mm256_set1_ps(pj);
                let row = vp.add(j * w + c);
                for (r, ar) in a.iter_mut().enumerate() {
                    *ar = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row.add(8 * r)), *ar);
                }
            }
            for (r, ar) in a.iter().enumerate() {
                _mm256_storeu_ps(ap.add(c + 8 * r), *ar);
            }
        }
        c += 32;
    }
    while c < w {
        // SAFETY: c + 8 <= w (w is a multiple of 8).
        unsafe {
            let mut a = _mm256_mul_ps(_mm256_loadu_ps(ap.add(c)), cv);
            for (j, &pj) in p.iter().enumerate() {
                a = _mm256_fmadd_ps(_mm256_set1_ps(pj), _mm256_loadu_ps(vp.add(j * w + c)), a);
            }
            _mm256_storeu_ps(ap.add(c), a);
        }
        c += 8;
    }
}

#[cfg(test)]
mod tests {
    use super::super::ops;

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    #[test]
    fn simd_loops_match_float64_references() {
        if !ops::has_avx2_fma() {
            eprintln!("skipped: no AVX2/FMA on this CPU");
            return;
        }
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for w in [8, 64, 72, 128, 256, 288] {
            for n in [1, 3, 4, 7, 16] {
                let q: Vec<f32> = (0..w).map(|_| rng(&mut s)).collect();
                let keys: Vec<f32> = (0..n * w).map(|_| rng(&mut s)).collect();
                let mut out = vec![f32::NAN; n];
                // SAFETY: AVX2/FMA checked above; w is a multiple of 8 and keys hold n rows.
                unsafe { super::scores(&q, &keys, 0.125, &mut out) };
                for (j, o) in out.iter().enumerate() {
                    let want: f64 = q
                        .iter()
                        .zip(&keys[j * w..])
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * 0.125;
                    assert!((f64::from(*o) - want).abs() < 1e-5, "w {w} n {n} j {j}");
                }
                let p: Vec<f32> = (0..n).map(|_| rng(&mut s).abs()).collect();
                let mut acc: Vec<f32> = (0..w).map(|_| rng(&mut s)).collect();
                let want: Vec<f64> = (0..w)
                    .map(|c| {
                        f64::from(acc[c]) * 0.7
                            + (0..n)
                                .map(|j| f64::from(p[j]) * f64::from(keys[j * w + c]))
                                .sum::<f64>()
                    })
                    .collect();
                // SAFETY: as above.
                unsafe { super::weighted_sum(&mut acc, 0.7, &p, &keys) };
                for (a, e) in acc.iter().zip(&want) {
                    assert!((f64::from(*a) - e).abs() < 1e-5, "w {w} n {n}");
                }
            }
        }
        for n in [0, 1, 5, 8, 13, 16, 17, 33, 50] {
            let x: Vec<f32> = (0..n).map(|_| 40.0 * rng(&mut s)).collect();
            let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // SAFETY: as above.
            assert_eq!(unsafe { super::max(&x) }, want, "max of {n}");
        }
        for n in [1, 5, 8, 13, 16, 33] {
            let mut x: Vec<f32> = (0..n).map(|_| 40.0 * rng(&mut s)).collect();
            x[0] = -200.0; // far below the max: must vanish, not become NaN
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want: Vec<f64> = x
                .iter()
                .map(|v| (f64::from(*v) - f64::from(m)).exp())
                .collect();
            // SAFETY: as above.
            let sum = unsafe { super::exp_shift_sum(&mut x, m) };
            for (g, e) in x.iter().zip(&want) {
                // f32 rounding of x − m (up to 80 here) alone moves e^(x−m) by ~5e-6 relative.
                assert!(
                    (f64::from(*g) - e).abs() <= 2e-5 * e.max(1e-30),
                    "{g} vs {e}"
                );
            }
            let total: f64 = want.iter().sum();
            assert!(
                (f64::from(sum) - total).abs() < 1e-6 * total,
                "sum {sum} vs {total}"
            );
        }
    }

    /// `max_non_nan` and `exp_sum` (the log-sum-exp of a row of logits) against their
    /// portable versions and f64, with NaN and ±inf lanes and every tail length.
    #[test]
    fn row_max_and_exp_sum_skip_nan() {
        if !ops::has_avx2_fma() {
            eprintln!("skipped: no AVX2/FMA on this CPU");
            return;
        }
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for n in [
            0, 1, 7, 8, 31, 32, 33, 63, 64, 65, 100, 1000, 49_152, 262_144,
        ] {
            let mut x: Vec<f32> = (0..n).map(|_| 30.0 * rng(&mut s)).collect();
            for i in (0..n).step_by(5) {
                x[i] = if i % 2 == 0 {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                };
            }
            // SAFETY: AVX2/FMA checked above.
            let m = unsafe { super::max_non_nan(&x) };
            assert_eq!(m, ops::max_non_nan_scalar(&x), "max of {n}");
            let want_m = x
                .iter()
                .filter(|v| !v.is_nan())
                .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            assert_eq!(m, want_m, "max of {n}");
            if n > 1 {
                // SAFETY: as above.
                let all_nan = unsafe { super::max_non_nan(&vec![f32::NAN; n]) };
                assert_eq!(all_nan, f32::NEG_INFINITY);
                let mut inf = x.clone();
                inf[n / 2] = f32::INFINITY;
                // SAFETY: as above.
                assert_eq!(unsafe { super::max_non_nan(&inf) }, f32::INFINITY);
            }
            if !m.is_finite() {
                continue;
            }
            let want: f64 = x
                .iter()
                .filter(|v| v.is_finite())
                .map(|&v| (f64::from(v) - f64::from(m)).exp())
                .sum();
            // SAFETY: as above; `m` is finite.
            let got = unsafe { super::exp_sum(&x, m) };
            assert!((got - want).abs() <= 3e-7 * want, "n {n}: {got} vs {want}");
            let scalar = ops::exp_sum_scalar(&x, m);
            assert!(
                (scalar - want).abs() <= 3e-7 * want,
                "n {n}: {scalar} vs {want}"
            );
        }
    }
}
