//! 8-bit quantization of activations, done once per matmul call so that every weight row's
//! dot product runs on integers (as ggml does: `vec_dot_type`).
//!
//! - [`Q8Block`] (32 elements) pairs with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights. It is ggml's
//!   `block_q8_1`: scale `d` and `s = d·Σq`, both rounded through f16 exactly as llama.cpp's
//!   x86 `quantize_row_q8_1` does, so our logits follow llama.cpp's rounding; `s` lets the
//!   `*_1` formats apply their min as `m·s` per block.
//! - [`Q8KBlock`] (256 elements, f32 scale, 16-element sums) pairs with the K-quants, as
//!   ggml's `block_q8_K` (reference `quantize_row_q8_K_ref`).
//!
//! The AVX2 and scalar Q8 quantizers give bit-identical blocks: same `127/amax` scale, same
//! round-half-to-even, same saturation.

use super::blocks::{QK, round_f16};
use super::kquants::{QK_K, nearest_int};

/// 32 activations as int8 with their scale. Invariant: `qs` in -127..=127.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct Q8Block {
    /// Scale (an f16 value widened to f32): element `j` ≈ `d·qs[j]`.
    pub d: f32,
    /// `d·Σ qs` rounded through f16 (ggml's `block_q8_1::s`).
    pub s: f32,
    /// The codes.
    pub qs: [i8; QK],
}

impl Q8Block {
    /// An all-zero block, to size buffers.
    pub const ZERO: Self = Self {
        d: 0.0,
        s: 0.0,
        qs: [0; QK],
    };
}

/// 256 activations as int8 with an f32 scale and per-16 sums (ggml's `block_q8_K`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct Q8KBlock {
    /// Scale: element `j` ≈ `d·qs[j]` (may be negative, as in ggml).
    pub d: f32,
    /// The codes, -128..=127.
    pub qs: [i8; QK_K],
    /// `bsums[g] = Σ qs[16g..16g+16]`.
    pub bsums: [i16; 16],
}

impl Q8KBlock {
    /// An all-zero block, to size buffers.
    pub const ZERO: Self = Self {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; 16],
    };
}

/// Quantizes `x` (whole blocks of 32) into `out`, using AVX2 when `simd` is set and the CPU
/// has it.
pub(crate) fn quantize_q8(x: &[f32], out: &mut [Q8Block], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd && super::dot_avx2::available() {
        // SAFETY: `available()` checked AVX2 (and FMA/F16C) support at run time.
        unsafe { avx2::quantize_q8(x, out) };
        return;
    }
    let _ = simd;
    quantize_q8_scalar(x, out);
}

/// The plain reference of [`quantize_q8`].
pub(crate) fn quantize_q8_scalar(x: &[f32], out: &mut [Q8Block]) {
    for (xb, b) in x.chunks_exact(QK).zip(out) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            sum += i32::from(*q);
        }
        let d = amax / 127.0;
        b.d = round_f16(d);
        b.s = round_f16(d * sum as f32);
    }
}

/// Quantizes `x` (whole blocks of 256) into `out` like ggml's `quantize_row_q8_K_ref`.
pub(crate) fn quantize_q8k(x: &[f32], out: &mut [Q8KBlock]) {
    for (xb, b) in x.chunks_exact(QK_K).zip(out) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *b = Q8KBlock::ZERO;
            continue;
        }
        let iscale = -127.0 / max;
        for (q, v) in b.qs.iter_mut().zip(xb) {
            *q = nearest_int(iscale * v).clamp(-128, 127) as i8;
        }
        for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| i16::from(q)).sum();
        }
        b.d = 1.0 / iscale;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q8Block, QK, round_f16};
    use std::arch::x86_64::*;

    /// AVX2 twin of [`super::quantize_q8_scalar`] (llama.cpp's x86 `quantize_row_q8_1`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
        let sign = _mm256_set1_ps(-0.0);
        for (xb, b) in x.chunks_exact(QK).zip(out) {
            let p = xb.as_ptr();
            // SAFETY: `xb` holds exactly 32 floats, read as four unaligned groups of 8.
            let v = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(p.add(o))) };
            let a = v.map(|v| _mm256_andnot_ps(sign, v));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let i = v.map(|v| {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(v, id),
                );
                _mm256_cvtps_epi32(r)
            });
            let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let s4 = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01>(s4));
            let isum = _mm_cvtsi128_si32(s4);
            // packs works per 128-bit lane; the permute restores element order.
            let p01 = _mm256_packs_epi32(i[0], i[1]);
            let p23 = _mm256_packs_epi32(i[2], i[3]);
            let q = _mm256_packs_epi16(p01, p23);
            let q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // SAFETY: `b.qs` is 32 bytes; unaligned store.
            unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
            let d = amax / 127.0;
            b.d = round_f16(d);
            b.s = round_f16(d * isum as f32);
        }
    }
}
