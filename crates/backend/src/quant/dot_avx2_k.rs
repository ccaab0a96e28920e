//! AVX2 dot products of K-quant weight rows with [`Q8KBlock`] activations: the quantity of
//! `dot_scalar::dot_q8k`, with the integer work in SIMD.
//!
//! Every format first unpacks a super-block into one common form ([`Unpacked`]): 256
//! unsigned codes (8 vectors of 32), per-vector i16 scales, and per-16-element weights for
//! the activation sums `bsums` that carry what acts on whole sub-blocks (the Q4_K/Q5_K min,
//! Q6_K's +32 code offset). Then, per token, codes × int8 activations go through
//! `_mm256_maddubs_epi16` (codes ≤ 63, so pairs fit i16) and `_mm256_madd_epi16` with the
//! scales into i32 lanes. The unpacking is done once per super-block for up to four tokens.

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
    unsafe {
        match ty {
            GgmlType::Q4K => each_group::<Q4K>(w, row_bytes, acts, n, out),
            GgmlType::Q5K => each_group::<Q5K>(w, row_bytes, acts, n, out),
            GgmlType::Q6K => each_group::<Q6K>(w, row_bytes, acts, n, out),
            _ => {}
        }
    }
}

/// A super-block in the form the token loop consumes.
struct Unpacked {
    /// Codes of elements `32k..32k+32`, unsigned (≤ 63).
    codes: [__m256i; 8],
    /// i16 scale per lane of `maddubs(codes[k], acts)`: lanes 0..8 cover elements
    /// `32k..32k+16`, lanes 8..16 the next 16.
    scales: [__m256i; 8],
    /// Weight of each 16-element activation sum `bsums[g]` in the correction term.
    corr: __m256i,
    /// `d` (scales the main sum) and the correction's factor, both per `d_a`.
    d: f32,
    corr_d: f32,
}

/// Format tags for [`each_group`] (a const parameter keeps the unpacking inlined).
const Q4K: u8 = 0;
const Q5K: u8 = 1;
const Q6K: u8 = 2;

/// Groups of up to four tokens; within a group, rows; within a row, super-blocks unpacked
/// once for the group's tokens.
#[target_feature(enable = "avx2,fma,f16c")]
fn each_group<const FMT: u8>(
    w: &[u8],
    row_bytes: usize,
    acts: &[Q8KBlock],
    n: usize,
    out: &mut [f32],
) {
    let bb = match FMT {
        Q4K => Q4K_BYTES,
        Q5K => Q5K_BYTES,
        _ => Q6K_BYTES,
    };
    let nb = row_bytes / bb;
    let mut t0 = 0;
    while t0 < n {
        let nt = (n - t0).min(4);
        for (o, row) in out.chunks_exact_mut(n).zip(w.chunks_exact(row_bytes)) {
            let mut sums = [0f32; 4];
            for (ib, b) in row.chunks_exact(bb).enumerate() {
                let u = match FMT {
                    Q4K => unpack_q4k(b),
                    Q5K => unpack_q5k(b),
                    _ => unpack_q6k(b),
                };
                for (t, s) in sums.iter_mut().enumerate().take(nt) {
                    *s += block_dot(&u, &acts[(t0 + t) * nb + ib]);
                }
            }
            o[t0..t0 + nt].copy_from_slice(&sums[..nt]);
        }
        t0 += nt;
    }
}

/// One unpacked super-block against one token's Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_dot(u: &Unpacked, a: &Q8KBlock) -> f32 {
    let mut acc = _mm256_setzero_si256();
    for k in 0..8 {
        let p = _mm256_maddubs_epi16(u.codes[k], load32(&a.qs, 32 * k));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, u.scales[k]));
    }
    // SAFETY: `bsums` is 16 i16 = 32 readable bytes.
    let bsums = unsafe { _mm256_loadu_si256(a.bsums.as_ptr().cast()) };
    let corr = hsum_i32(_mm256_madd_epi16(bsums, u.corr));
    a.d * (u.d * hsum_i32(acc) as f32 + u.corr_d * corr as f32)
}

/// 32 bytes at `b[at..]` (the slice index checks the bounds).
#[inline]
#[target_feature(enable = "avx2")]
fn load32<T: Copy>(b: &[T], at: usize) -> __m256i {
    let s = &b[at..at + 32 / size_of::<T>()];
    // SAFETY: `s` spans exactly 32 readable bytes.
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

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K and Q5_K share everything but the fifth bit: `high(s)` gives it (as 0x10 per byte)
/// for sub-block `s`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_k4(b: &[u8], qs_at: usize, high: impl Fn(usize) -> __m256i) -> Unpacked {
    let mask = _mm256_set1_epi8(0x0F);
    let mut codes = [_mm256_setzero_si256(); 8];
    let mut scales = [_mm256_setzero_si256(); 8];
    let mut mins = [0i16; 16];
    for g in 0..4 {
        let q = load32(b, qs_at + 32 * g);
        codes[2 * g] = _mm256_or_si256(_mm256_and_si256(q, mask), high(2 * g));
        let q_hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
        codes[2 * g + 1] = _mm256_or_si256(q_hi, high(2 * g + 1));
    }
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, &b[4..16]);
        scales[s] = _mm256_set1_epi16(i16::from(sc));
        mins[2 * s] = i16::from(m);
        mins[2 * s + 1] = i16::from(m);
    }
    Unpacked {
        codes,
        scales,
        corr: load32(&mins, 0),
        d: f16_at(b, 0),
        corr_d: -f16_at(b, 2),
    }
}

/// Q4_K: codes are the nibbles, no fifth bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q4k(b: &[u8]) -> Unpacked {
    unpack_k4(b, 16, |_| _mm256_setzero_si256())
}

/// Q5_K: the fifth bit of sub-block `s` is bit `s` of each `qh` byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q5k(b: &[u8]) -> Unpacked {
    let qh = load32(b, 16);
    unpack_k4(b, 48, |s| {
        let m = _mm256_set1_epi8(1 << s);
        _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(qh, m), m),
            _mm256_set1_epi8(0x10),
        )
    })
}

/// Q6_K: 6-bit codes from `ql` nibbles and `qh` bit pairs (see `kquants::q6k_code`), int8
/// scales per 16 elements; the +32 offset is removed through `bsums`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q6k(b: &[u8]) -> Unpacked {
    let mask = _mm256_set1_epi8(0x0F);
    let three = _mm256_set1_epi8(3);
    let sc: [i16; 16] = std::array::from_fn(|i| i16::from(b[192 + i] as i8));
    let mut codes = [_mm256_setzero_si256(); 8];
    for h in 0..2 {
        let ql0 = load32(b, 64 * h);
        let ql1 = load32(b, 64 * h + 32);
        let qh = load32(b, 128 + 32 * h);
        // 16-bit shifts then byte masks: no bits cross between bytes after the AND.
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
            codes[4 * h + k] = _mm256_or_si256(low[k], _mm256_slli_epi16::<4>(high[k]));
        }
    }
    let scales = std::array::from_fn(|k| {
        _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]))
    });
    // Σ sc·(q − 32)·a = Σ sc·q·a − 32·Σ_g sc_g·bsums_g.
    let d = f16_at(b, 208);
    Unpacked {
        codes,
        scales,
        corr: load32(&sc, 0),
        d,
        corr_d: -32.0 * d,
    }
}
