//! AVX2 dot products of K-quant weight rows with [`Q8KBlock`] activations: the quantity of
//! `dot_scalar::dot_q8k`, with the integer work in SIMD.
//!
//! Per super-block, codes are unpacked 32 at a time (unsigned), multiplied with the int8
//! activations by `_mm256_maddubs_epi16` (|code| ≤ 63, so pairs fit i16), and weighted by
//! their sub-block scales with `_mm256_madd_epi16` into i32 lanes. The min (Q4_K/Q5_K) and
//! the −32 offset (Q6_K) act on whole sub-blocks, so they are applied once per sub-block
//! through the activation block sums `bsums`, in scalar code.
//!
//! One token at a time: with several tokens the row's bytes are reused from L1.

use super::activations::Q8KBlock;
use super::kquants::{Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, scale_min_k4};
use crate::quant::GgmlType;
use std::arch::x86_64::*;

/// `out[r·n + t] = row_r · acts_t` for the rows of `w` (K-quant `ty`, rows `row_bytes`
/// apart), `n` tokens with activations `acts[t·nb..(t+1)·nb]`. Inconsistent sizes: returns
/// without writing (callers check first).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C (`dot_avx2::available`).
pub(crate) unsafe fn rows_q8k(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    acts: &[Q8KBlock],
    n: usize,
    out: &mut [f32],
) {
    let bb = ty.block_bytes();
    let rows = out.len().checked_div(n).unwrap_or(0);
    let nb = row_bytes / bb;
    if !row_bytes.is_multiple_of(bb) || w.len() < rows * row_bytes || acts.len() < n * nb {
        return;
    }
    // SAFETY: CPU features per this function's contract; sizes checked above.
    unsafe { each_row(ty, w, row_bytes, acts, n, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn each_row(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    acts: &[Q8KBlock],
    n: usize,
    out: &mut [f32],
) {
    let nb = row_bytes / ty.block_bytes();
    for (o, row) in out.chunks_exact_mut(n).zip(w.chunks_exact(row_bytes)) {
        for (t, v) in o.iter_mut().enumerate() {
            let a = &acts[t * nb..(t + 1) * nb];
            *v = match ty {
                GgmlType::Q4K => row
                    .chunks_exact(Q4K_BYTES)
                    .zip(a)
                    .map(|(b, a)| q4k(b, a))
                    .sum(),
                GgmlType::Q5K => row
                    .chunks_exact(Q5K_BYTES)
                    .zip(a)
                    .map(|(b, a)| q5k(b, a))
                    .sum(),
                GgmlType::Q6K => row
                    .chunks_exact(Q6K_BYTES)
                    .zip(a)
                    .map(|(b, a)| q6k(b, a))
                    .sum(),
                _ => 0.0,
            };
        }
    }
}

/// 32 bytes at `b[at..]` as a vector.
#[inline]
#[target_feature(enable = "avx2")]
fn load32(b: &[u8], at: usize) -> __m256i {
    let s = &b[at..at + 32];
    // SAFETY: `s` is exactly 32 readable bytes (the slice index checks it).
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// The 32 int8 activations at `a.qs[at..]`.
#[inline]
#[target_feature(enable = "avx2")]
fn acts32(a: &Q8KBlock, at: usize) -> __m256i {
    let s = &a.qs[at..at + 32];
    // SAFETY: `s` is exactly 32 readable bytes.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Sum of the 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
}

/// `Σ_sub sc·(codes · acts)` for Q4_K/Q5_K, with `high(g)` giving the fifth bits (as 0x10)
/// of the low and high nibbles of 64-element group `g`, and the min term separately.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_sums(
    b: &[u8],
    qs_at: usize,
    a: &Q8KBlock,
    high: impl Fn(usize) -> (__m256i, __m256i),
) -> (i32, i32) {
    let mask = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_si256();
    let mut msum = 0i32;
    for g in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * g, &b[4..16]);
        let (sc2, m2) = scale_min_k4(2 * g + 1, &b[4..16]);
        let q = load32(b, qs_at + 32 * g);
        let (h1, h2) = high(g);
        let lo = _mm256_or_si256(_mm256_and_si256(q, mask), h1);
        let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), mask), h2);
        let p1 = _mm256_maddubs_epi16(lo, acts32(a, 64 * g));
        let p2 = _mm256_maddubs_epi16(hi, acts32(a, 64 * g + 32));
        let p1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(i16::from(sc1)));
        let p2 = _mm256_madd_epi16(p2, _mm256_set1_epi16(i16::from(sc2)));
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(p1, p2));
        let bs = |s: usize| i32::from(a.bsums[2 * s]) + i32::from(a.bsums[2 * s + 1]);
        msum += i32::from(m1) * bs(2 * g) + i32::from(m2) * bs(2 * g + 1);
    }
    (hsum_i32(acc), msum)
}

/// One Q4_K super-block against one Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k(b: &[u8], a: &Q8KBlock) -> f32 {
    let zero = _mm256_setzero_si256();
    let (isum, msum) = k4_sums(b, 16, a, |_| (zero, zero));
    let (d, dmin) = halves(b, 0);
    d * a.d * isum as f32 - dmin * a.d * msum as f32
}

/// One Q5_K super-block against one Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5k(b: &[u8], a: &Q8KBlock) -> f32 {
    let qh = load32(b, 16);
    let bit16 = |s: usize| {
        // Bit `s` of each qh byte, moved to 0x10.
        let m = _mm256_set1_epi8(1 << s);
        _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(qh, m), m),
            _mm256_set1_epi8(0x10),
        )
    };
    let (isum, msum) = k4_sums(b, 48, a, |g| (bit16(2 * g), bit16(2 * g + 1)));
    let (d, dmin) = halves(b, 0);
    d * a.d * isum as f32 - dmin * a.d * msum as f32
}

/// One Q6_K super-block against one Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k(b: &[u8], a: &Q8KBlock) -> f32 {
    let mask = _mm256_set1_epi8(0x0F);
    let three = _mm256_set1_epi8(3);
    let sc = &b[192..208];
    let mut acc = _mm256_setzero_si256();
    for h in 0..2 {
        let ql0 = load32(b, 64 * h);
        let ql1 = load32(b, 64 * h + 32);
        let qh = load32(b, 128 + 32 * h);
        // Codes of elements 128h + 32k + l, l < 32, as in `kquants::q6k_code`.
        let low = [
            _mm256_and_si256(ql0, mask),
            _mm256_and_si256(ql1, mask),
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), mask),
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), mask),
        ];
        let high = [
            _mm256_and_si256(qh, three),
            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), three),
            _mm256_and_si256(_mm256_srli_epi16::<4>(qh), three),
            _mm256_and_si256(_mm256_srli_epi16::<6>(qh), three),
        ];
        for k in 0..4 {
            let q = _mm256_or_si256(low[k], _mm256_slli_epi16::<4>(high[k]));
            let p = _mm256_maddubs_epi16(q, acts32(a, 128 * h + 32 * k));
            // i16 lanes 0..8 are elements 0..16 (scale 8h + 2k), lanes 8..16 the next 16.
            let s = 8 * h + 2 * k;
            let scales = _mm256_set_m128i(
                _mm_set1_epi16(i16::from(sc[s + 1] as i8)),
                _mm_set1_epi16(i16::from(sc[s] as i8)),
            );
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scales));
        }
    }
    // The codes carry +32: remove 32·sc·Σ acts per 16-element sub-block.
    let offset: i32 = sc
        .iter()
        .zip(&a.bsums)
        .map(|(&s, &bs)| i32::from(s as i8) * i32::from(bs))
        .sum();
    let isum = hsum_i32(acc) - 32 * offset;
    let d = half::f16::from_le_bytes([b[208], b[209]]).to_f32();
    d * a.d * isum as f32
}

/// The halves `d`, `dmin` at `b[at..at + 4]`.
#[inline]
fn halves(b: &[u8], at: usize) -> (f32, f32) {
    let h = |i: usize| half::f16::from_le_bytes([b[at + i], b[at + i + 1]]).to_f32();
    (h(0), h(2))
}
