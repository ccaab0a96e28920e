//! The score and value passes of decode (`⟨q_r, x_j⟩ · s_j` and `acc_r += Σ_j w_rj · s_j ·
//! x_j`) through AVX-512 for 16-bit records (bf16 and f16 pools, a preset window's f16 copies)
//! and int8 records (`int8` pools, `q8` window copies) whose width is a multiple of 16: the
//! same f32 products as `direct_avx2`, 16 lanes per instruction. (Int8 scores take the
//! integer pass of `direct_vnni` where the CPU has it; their value sums come here.) One value pass covers 64 coordinates of a token where the AVX2 loop makes four
//! passes of 16, each converting its coordinates and broadcasting every row's weight again.
//! A score is summed in 16 lanes and reduced once, where the AVX2 pass sums 8.
//!
//! Table codes are not taken here: expanded as the integer score pass expands them and looked
//! up 16 at a time with `vpermps`, they measured slower than the AVX2 loop on Zen 4, whose
//! 512-bit shuffles and FMAs take two 256-bit slots each (BENCHMARKS.md, session 26); with
//! VNNI they take the integer pass (`direct_vnni_values`).

use std::arch::x86_64::*;

use super::direct::{Fmt, Pages};
use super::direct_avx2::{
    SCALE_RUN, page_scales, prefetch, prefetch_next, scaled_runs, score_runs,
};

/// Whether the pass takes records of `fmt` with `w` coordinates on this CPU: 16-bit values or
/// int8, `w` a positive multiple of 16, AVX-512 F/BW/VL and the AVX2 kernels' features.
pub(super) fn takes(fmt: Fmt, w: usize) -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    matches!(fmt, Fmt::Bf16 | Fmt::F16 | Fmt::Int8)
        && w > 0
        && w.is_multiple_of(16)
        && *HAS.get_or_init(|| {
            super::direct::has_simd()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
        })
}

/// `$go!(loader, R)` for the 16-bit or int8 format `$fmt`'s loader and `R = $rows` (1–4; more take 4
/// at a time); `$go` is the caller's macro.
macro_rules! by_format_and_rows {
    ($fmt:expr, $rows:expr, $go:ident, $what:literal) => {{
        macro_rules! rows {
            ($ld:expr) => {
                match $rows {
                    1 => $go!($ld, 1),
                    2 => $go!($ld, 2),
                    3 => $go!($ld, 3),
                    _ => $go!($ld, 4),
                }
            };
        }
        match $fmt {
            Fmt::Bf16 => rows!(Bf16),
            Fmt::F16 => rows!(F16),
            Fmt::Int8 => rows!(Int8),
            f => unreachable!("the AVX-512 {} does not take {f:?}", $what),
        }
    }};
}

/// Loads coordinates `64c + 16s .. 64c + 16s + 16` of a record for `s < S`.
trait Load64: Copy {
    /// # Safety
    /// [`takes`] holds; the record's bytes up to coordinate `64c + 16S` are readable.
    unsafe fn load<const S: usize>(self, rec: *const u8, c: usize) -> [__m512; S];
}

#[derive(Clone, Copy)]
struct Bf16;

impl Load64 for Bf16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn load<const S: usize>(self, rec: *const u8, c: usize) -> [__m512; S] {
        std::array::from_fn(|s| {
            // SAFETY: 32 bytes at coordinate 64c + 16s are readable (caller).
            let h = unsafe { _mm256_loadu_si256(rec.add(2 * (64 * c + 16 * s)).cast()) };
            // bf16 → f32 is the 16 bits moved to the top of the word.
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        })
    }
}

#[derive(Clone, Copy)]
struct F16;

impl Load64 for F16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn load<const S: usize>(self, rec: *const u8, c: usize) -> [__m512; S] {
        std::array::from_fn(|s| {
            // SAFETY: 32 bytes at coordinate 64c + 16s are readable (caller).
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(rec.add(2 * (64 * c + 16 * s)).cast()) })
        })
    }
}

#[derive(Clone, Copy)]
struct Int8;

impl Load64 for Int8 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn load<const S: usize>(self, rec: *const u8, c: usize) -> [__m512; S] {
        std::array::from_fn(|s| {
            // SAFETY: 16 bytes at coordinate 64c + 16s are readable (caller).
            let b = unsafe { _mm_loadu_si128(rec.add(64 * c + 16 * s).cast()) };
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))
        })
    }
}

/// `acc[r·w + 64c + 16s ..][..16] += Σ_j weights[r·ws + j] · x_j` for `s < S` over the `n`
/// records at `rec` (`stride` bytes apart), the `R·S` accumulators held in registers.
///
/// # Safety
/// [`takes`]; `64c + 16S <= w`; `acc` holds `R·w` floats, `weights` `(R − 1)·ws + n`; the `n`
/// records are readable.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn pass<L: Load64, const R: usize, const S: usize>(
    ld: L,
    rec: *const u8,
    stride: usize,
    n: usize,
    weights: *const f32,
    ws: usize,
    acc: *mut f32,
    w: usize,
    c: usize,
) {
    // SAFETY: the accumulator chunks lie inside every row; token j < n (caller).
    unsafe {
        let at = |r: usize, s: usize| acc.add(r * w + 64 * c + 16 * s);
        let mut a: [[__m512; S]; R] =
            std::array::from_fn(|r| std::array::from_fn(|s| _mm512_loadu_ps(at(r, s))));
        for j in 0..n {
            let x = ld.load::<S>(rec.add(j * stride), c);
            for (r, ar) in a.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(*weights.add(r * ws + j));
                for (ai, xi) in ar.iter_mut().zip(&x) {
                    *ai = _mm512_fmadd_ps(wv, *xi, *ai);
                }
            }
        }
        for (r, ar) in a.iter().enumerate() {
            for (s, ai) in ar.iter().enumerate() {
                _mm512_storeu_ps(at(r, s), *ai);
            }
        }
    }
}

/// [`pass`] over every chunk of the records' `w` coordinates: whole chunks of 64, then the
/// rest (16, 32 or 48).
///
/// # Safety
/// As [`pass`], for the whole width.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn sweep<L: Load64, const R: usize>(
    ld: L,
    rec: *const u8,
    stride: usize,
    n: usize,
    weights: *const f32,
    ws: usize,
    acc: *mut f32,
    w: usize,
) {
    // SAFETY: each pass's chunk lies inside the width (the match follows `w`); the rest is
    // forwarded from the caller.
    unsafe {
        for c in 0..w / 64 {
            pass::<L, R, 4>(ld, rec, stride, n, weights, ws, acc, w, c);
        }
        let c = w / 64;
        match (w % 64) / 16 {
            1 => pass::<L, R, 1>(ld, rec, stride, n, weights, ws, acc, w, c),
            2 => pass::<L, R, 2>(ld, rec, stride, n, weights, ws, acc, w, c),
            3 => pass::<L, R, 3>(ld, rec, stride, n, weights, ws, acc, w, c),
            _ => {}
        }
    }
}

/// `acc[r·w..][..w] += Σ_j weights[r·ws + off + j] · mul · s_j · x_j` over the records of
/// every page, for `rows` accumulator rows (1–4: with 4 chunks of 16 coordinates, 16 of the
/// 32 registers).
///
/// # Safety
/// [`takes`]`(pages.fmt, w)` with `w = acc.len() / rows`; every page's `n` records and its `n`
/// scales (if any) are readable; for every page `weights` holds `(rows − 1)·ws + off + n`
/// floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn accumulate(
    pages: Pages<'_>,
    weights: &[f32],
    ws: usize,
    acc: &mut [f32],
    rows: usize,
) {
    let (w, stride) = (acc.len() / rows, pages.stride);
    let ap = acc.as_mut_ptr();
    macro_rules! go {
        ($ld:expr, $r:literal) => {{
            let ld = $ld;
            // SAFETY: the pages' records, scales and weights are in bounds (caller);
            // `scaled` holds $r rows of SCALE_RUN weights.
            unsafe {
                scaled_runs!(&pages, weights, ws, $r, |rec, n, scaled| {
                    sweep::<_, $r>(ld, rec, stride, n, scaled.as_ptr(), SCALE_RUN, ap, w)
                })
            }
        }};
    }
    by_format_and_rows!(pages.fmt, rows, go, "value pass")
}

/// Tokens scored per pass of [`scores_run`]: the `R·T` accumulators, the four loaded chunks and
/// the query chunk stay within the 32 registers.
const SCORE_TOKENS: usize = 4;

/// Adds `⟨q_r[64c + 16s ..][..16], x_(j+k)[64c + 16s ..][..16]⟩` for `s < S` into `acc[r][k]`.
///
/// # Safety
/// [`takes`]; `64c + 16S <= w`; the q rows hold `w` floats; records `j .. j + T` are readable.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn score_chunks<L: Load64, const R: usize, const T: usize, const S: usize>(
    ld: L,
    q: *const f32,
    w: usize,
    rec: *const u8,
    stride: usize,
    j: usize,
    c: usize,
    acc: &mut [[__m512; T]; R],
) {
    for k in 0..T {
        // SAFETY: token j + k is readable and chunk c's S parts lie inside w (caller).
        let x = unsafe { ld.load::<S>(rec.add((j + k) * stride), c) };
        for (r, ar) in acc.iter_mut().enumerate() {
            for (s, xs) in x.iter().enumerate() {
                // SAFETY: coordinate 64c + 16s + 16 <= w of row r < R (caller).
                let qv = unsafe { _mm512_loadu_ps(q.add(r * w + 64 * c + 16 * s)) };
                ar[k] = _mm512_fmadd_ps(qv, *xs, ar[k]);
            }
        }
    }
}

/// `out[r·os + j + k] = scales[j + k] · ⟨q_r, x_(j+k)⟩` for `k < T`, one pass over `T` tokens.
///
/// # Safety
/// As [`scores_run`], and `j + T <= scales.len()`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn score_pass<L: Load64, const R: usize, const T: usize>(
    ld: L,
    q: *const f32,
    w: usize,
    rec: *const u8,
    stride: usize,
    scales: &[f32],
    out: *mut f32,
    os: usize,
    j: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // SAFETY: every chunk lies inside w (the match follows it); the rest is the caller's.
    unsafe {
        for c in 0..w / 64 {
            score_chunks::<L, R, T, 4>(ld, q, w, rec, stride, j, c, &mut acc);
        }
        let c = w / 64;
        match (w % 64) / 16 {
            1 => score_chunks::<L, R, T, 1>(ld, q, w, rec, stride, j, c, &mut acc),
            2 => score_chunks::<L, R, T, 2>(ld, q, w, rec, stride, j, c, &mut acc),
            3 => score_chunks::<L, R, T, 3>(ld, q, w, rec, stride, j, c, &mut acc),
            _ => {}
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (k, a) in ar.iter().enumerate() {
            // SAFETY: r·os + j + k < (R − 1)·os + n (caller).
            unsafe { *out.add(r * os + j + k) = _mm512_reduce_add_ps(*a) * scales[j + k] };
        }
    }
}

/// `out[r·os + j] = scales[j] · ⟨q_r, x_j⟩` for the `n = scales.len()` records at `rec`,
/// [`SCORE_TOKENS`] per pass and the rest one at a time.
///
/// # Safety
/// [`takes`] with `w = q.len() / R`; `q` holds `R·w` floats; the `n` records are readable;
/// `out` holds `(R − 1)·os + n` floats.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn scores_run<L: Load64, const R: usize>(
    ld: L,
    q: *const f32,
    w: usize,
    rec: *const u8,
    stride: usize,
    scales: &[f32],
    out: *mut f32,
    os: usize,
) {
    let n = scales.len();
    let mut j = 0;
    // SAFETY: each pass's tokens are below n; the rest is forwarded from the caller.
    unsafe {
        while j + SCORE_TOKENS <= n {
            score_pass::<L, R, SCORE_TOKENS>(ld, q, w, rec, stride, scales, out, os, j);
            j += SCORE_TOKENS;
        }
        while j < n {
            score_pass::<L, R, 1>(ld, q, w, rec, stride, scales, out, os, j);
            j += 1;
        }
    }
}

/// `out[r·os + off + j] = mul · s_j · ⟨q_r, x_j⟩` for record `j` of every page at `off`, for
/// `rows` query rows (1–4) `q_r = q[r·w..][..w]`.
///
/// # Safety
/// [`takes`]`(pages.fmt, w)` with `w = q.len() / rows`; every page's `n` records and its `n`
/// scales (if any) are readable; `out` holds `(rows − 1)·os + off + n` floats for every page.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn scores(pages: Pages<'_>, q: &[f32], rows: usize, out: &mut [f32], os: usize) {
    let (w, stride) = (q.len() / rows, pages.stride);
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    macro_rules! go {
        ($ld:expr, $r:literal) => {{
            let ld = $ld;
            // SAFETY: each run's records, their scales and their outputs are in bounds
            // (caller).
            unsafe {
                score_runs!(&pages, |rec, sc, at| {
                    scores_run::<_, $r>(ld, qp, w, rec, stride, sc, op.add(at), os)
                })
            }
        }};
    }
    by_format_and_rows!(pages.fmt, rows, go, "score pass")
}
