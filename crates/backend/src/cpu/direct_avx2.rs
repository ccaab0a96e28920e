//! AVX2 + FMA + F16C twins of the direct kernels in `direct`: scores and value sums read
//! straight from the cache's token records (16-bit values, int8 and fp8 codes, packed table
//! codes).
//!
//! One template per kernel, instantiated per record format through [`Load8`] (eight
//! coordinates of one token as f32 lanes) and per number of query rows `R`: the eight
//! coordinates are decoded once into a register and used by all `R` rows of the kv head (the
//! GQA query heads), so nothing is stored to a tile and nothing is decoded twice.
//!
//! Callers (`direct::scores`, `direct::accumulate`) check the CPU features and every length;
//! the `# Safety` sections list what they guarantee.

use std::arch::x86_64::*;

use super::direct::{Fmt, Page, Pages};

/// Eight consecutive coordinates of a token record as f32 lanes (without the token scale).
pub(super) trait Load8: Copy {
    /// Coordinates `8c..8c + 8` of the record at `rec`.
    ///
    /// # Safety
    /// AVX2/FMA/F16C; the bytes this format reads for chunk `c` (see `direct::read_len`) are
    /// readable from `rec`.
    unsafe fn load8(self, rec: *const u8, c: usize) -> __m256;
}

#[derive(Clone, Copy)]
struct Bf16;

impl Load8 for Bf16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(self, rec: *const u8, c: usize) -> __m256 {
        // SAFETY: 16 bytes at rec + 16c are readable (caller).
        let h = unsafe { _mm_loadu_si128(rec.add(16 * c).cast()) };
        // bf16 → f32 is the 16 bits moved to the top of the word.
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

#[derive(Clone, Copy)]
struct F16;

impl Load8 for F16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(self, rec: *const u8, c: usize) -> __m256 {
        // SAFETY: 16 bytes at rec + 16c are readable (caller).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(rec.add(16 * c).cast()) })
    }
}

#[derive(Clone, Copy)]
struct Int8;

impl Load8 for Int8 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(self, rec: *const u8, c: usize) -> __m256 {
        // SAFETY: 8 bytes at rec + 8c are readable (caller).
        let b = unsafe { _mm_loadl_epi64(rec.add(8 * c).cast()) };
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
    }
}

#[derive(Clone, Copy)]
struct Fp8;

impl Load8 for Fp8 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(self, rec: *const u8, c: usize) -> __m256 {
        // SAFETY: 8 bytes at rec + 8c are readable (caller).
        let b = unsafe { _mm_loadl_epi64(rec.add(8 * c).cast()) };
        // E4M3 S.EEEE.MMM becomes the f16 S.0EEEE.MMM0000000: the same value times 2⁻⁸
        // (exponent bias 15 instead of 7; `Fmt::unit`), subnormals included, so the hardware
        // conversion decodes it. Sign-extended and shifted left by 7, the sign lands on bits
        // 15 and 14; the mask clears 14.
        let h = _mm_and_si128(
            _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(b)),
            _mm_set1_epi16(0xBF80u16 as i16),
        );
        // The NaN codes (all of E and M set) become the f16 NaN 0xFFFF.
        let em = _mm_set1_epi16(0x3F80);
        let nan = _mm_cmpeq_epi16(_mm_and_si128(h, em), em);
        _mm256_cvtph_ps(_mm_or_si128(h, nan))
    }
}

/// `B`-bit codes through a 16-entry table held in two registers.
#[derive(Clone, Copy)]
pub(super) struct Table<const B: usize> {
    lo: __m256,
    hi: __m256,
}

impl<const B: usize> Table<B> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn new(table: &[f32; 16]) -> Self {
        // `vpermps` reads the low three bits of each index lane and ignores the rest, so
        // [`Load8::load8`] leaves the next codes' bits above a code in place instead of
        // masking them off. For B < 3 that needs the 2^B entries repeated over all eight
        // lanes: entry i then answers for every index whose low B bits are i.
        let mut wide = *table;
        if B < 3 {
            for i in 1 << B..8 {
                wide[i] = table[i % (1 << B)];
            }
        }
        // SAFETY: `wide` holds 16 floats.
        unsafe {
            Table {
                lo: _mm256_loadu_ps(wide.as_ptr()),
                hi: _mm256_loadu_ps(wide.as_ptr().add(8)),
            }
        }
    }
}

impl<const B: usize> Load8 for Table<B> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(self, rec: *const u8, c: usize) -> __m256 {
        // Eight B-bit codes are the low 8B bits of the (unaligned) little-endian word at
        // rec + B·c; its upper 4 − B bytes belong to the next chunk or token, or to the block's
        // padding and scalars. Lane i shifted right by B·i holds code i in its low B bits and
        // later codes above them, which the lookups below ignore (see [`Table::new`]): no
        // mask, one instruction less per eight codes.
        // SAFETY: 4 bytes at rec + B·c are readable (caller).
        let word = unsafe { rec.add(B * c).cast::<i32>().read_unaligned() };
        // Constant shifts (all < 32) let LLVM emit a bare `vpsrlvd`, without the select it
        // adds for shift counts it cannot bound.
        let b = B as i32;
        let shifts = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
        let idx = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
        if B == 4 {
            let a = _mm256_permutevar8x32_ps(self.lo, idx);
            let h = _mm256_permutevar8x32_ps(self.hi, idx);
            // Bit 3 of the code selects the upper half of the table; the shift drops the
            // bits above it.
            _mm256_blendv_ps(a, h, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)))
        } else {
            _mm256_permutevar8x32_ps(self.lo, idx)
        }
    }
}

/// Lane j of the result = sum of the lanes of `v[j]`, for four vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum4(v: [__m256; 4]) -> __m128 {
    let a = _mm256_hadd_ps(v[0], v[1]);
    let b = _mm256_hadd_ps(v[2], v[3]);
    let c = _mm256_hadd_ps(a, b);
    _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c))
}

/// Tokens scored per pass of [`scores_t`]: 4 while `4R` accumulators fit in registers next to
/// the decoder's, else 2.
const fn tokens_per_pass(r: usize) -> usize {
    if r <= 2 { 4 } else { 2 }
}

/// `out[r·os + j + k] = scales[j + k] · ⟨q_r, x_(j+k)⟩` for `k < T`: one pass over `T` tokens,
/// every loop bound a constant so the `R·T` accumulators stay in registers.
///
/// # Safety
/// As [`scores_t`], and `j + T <= scales.len()`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_pass<L: Load8, const R: usize, const T: usize>(
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
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for c in 0..w / 8 {
        for k in 0..T {
            // SAFETY: token j + k < n; chunk c < w/8; q rows hold w floats (caller).
            unsafe {
                let x = ld.load8(rec.add((j + k) * stride), c);
                for (r, a) in acc.iter_mut().enumerate() {
                    a[k] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(r * w + 8 * c)), x, a[k]);
                }
            }
        }
    }
    if T == 2 || T == 4 {
        // Each group of four sums covers 4/T whole rows: scaled and stored as vectors.
        // SAFETY: tokens j..j + T have scales (caller: j + T <= scales.len()).
        let s = unsafe {
            if T == 4 {
                _mm_loadu_ps(scales.as_ptr().add(j))
            } else {
                let pair = scales.as_ptr().add(j).cast::<i64>().read_unaligned();
                _mm_castsi128_ps(_mm_set1_epi64x(pair))
            }
        };
        for (g, quad) in acc.as_flattened().chunks(4).enumerate() {
            let mut v = [_mm256_setzero_ps(); 4];
            v[..quad.len()].copy_from_slice(quad);
            let h = _mm_mul_ps(hsum4(v), s);
            let r0 = g * 4 / T;
            // SAFETY: row r < R, so r·os + j + T <= (R − 1)·os + n (caller); the 8-byte
            // stores are unaligned-safe.
            unsafe {
                if T == 4 {
                    _mm_storeu_ps(out.add(r0 * os + j), h);
                } else {
                    let hi = _mm_castps_si128(_mm_movehl_ps(h, h));
                    _mm_storel_epi64(out.add(r0 * os + j).cast(), _mm_castps_si128(h));
                    if r0 + 1 < R {
                        _mm_storel_epi64(out.add((r0 + 1) * os + j).cast(), hi);
                    }
                }
            }
        }
        return;
    }
    let mut sums = [0f32; 16];
    for (g, quad) in acc.as_flattened().chunks(4).enumerate() {
        let mut v = [_mm256_setzero_ps(); 4];
        v[..quad.len()].copy_from_slice(quad);
        let h = hsum4(v);
        // SAFETY: R·T <= 16, so g <= 3 and 4g + 4 <= 16.
        unsafe { _mm_storeu_ps(sums.as_mut_ptr().add(4 * g), h) };
    }
    for r in 0..R {
        for k in 0..T {
            // SAFETY: r·os + j + k < (R − 1)·os + n (caller).
            unsafe { *out.add(r * os + j + k) = sums[r * T + k] * scales[j + k] };
        }
    }
}

/// `out[r·os + j] = scales[j] · ⟨q_r, x_j⟩` for `R` query rows `q_r = q[r·w..]` and tokens
/// `x_j` (records at `rec + j·stride`), `T` tokens per pass and the rest one at a time.
///
/// # Safety
/// AVX2/FMA/F16C; `w` a positive multiple of 8; `q` holds `R·w` floats; every chunk of the
/// `n = scales.len()` records is readable; `out` holds `(R − 1)·os + n` floats; `R·T <= 16`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_t<L: Load8, const R: usize, const T: usize>(
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
    while j + T <= n {
        // SAFETY: j + T <= n; the rest is forwarded from the caller.
        unsafe { scores_pass::<L, R, T>(ld, q, w, rec, stride, scales, out, os, j) };
        j += T;
    }
    while j < n {
        // SAFETY: j < n; the rest is forwarded from the caller.
        unsafe { scores_pass::<L, R, 1>(ld, q, w, rec, stride, scales, out, os, j) };
        j += 1;
    }
}

/// Chunks `c..c + C` of `acc[r·w..][..w] += Σ_j weights[r·ws + j] · x_j` over the `n` tokens,
/// the `R·C` accumulator registers held while the records stream past.
///
/// # Safety
/// As [`accumulate_t`], and `c + C <= w / 8`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_pass<L: Load8, const R: usize, const C: usize>(
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
    // SAFETY: chunks c..c + C lie inside every row; token j < n (caller).
    unsafe {
        let mut a = [[_mm256_setzero_ps(); C]; R];
        for (r, ar) in a.iter_mut().enumerate() {
            for (i, ai) in ar.iter_mut().enumerate() {
                *ai = _mm256_loadu_ps(acc.add(r * w + 8 * (c + i)));
            }
        }
        for j in 0..n {
            let p = rec.add(j * stride);
            let mut x = [_mm256_setzero_ps(); C];
            for (i, xi) in x.iter_mut().enumerate() {
                *xi = ld.load8(p, c + i);
            }
            for (r, ar) in a.iter_mut().enumerate() {
                let wv = _mm256_broadcast_ss(&*weights.add(r * ws + j));
                for (ai, xi) in ar.iter_mut().zip(&x) {
                    *ai = _mm256_fmadd_ps(wv, *xi, *ai);
                }
            }
        }
        for (r, ar) in a.iter().enumerate() {
            for (i, ai) in ar.iter().enumerate() {
                _mm256_storeu_ps(acc.add(r * w + 8 * (c + i)), *ai);
            }
        }
    }
}

/// `acc[r·w..][..w] += Σ_j weights[r·ws + j] · x_j` over the `n` tokens for `R` rows, two
/// chunks (16 coordinates) per pass over the records.
///
/// # Safety
/// AVX2/FMA/F16C; `w` a positive multiple of 8; `acc` holds `R·w` floats; every chunk of the
/// `n` records is readable; `weights` holds `(R − 1)·ws + n` floats.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn accumulate_t<L: Load8, const R: usize>(
    ld: L,
    rec: *const u8,
    stride: usize,
    n: usize,
    weights: *const f32,
    ws: usize,
    acc: *mut f32,
    w: usize,
) {
    let chunks = w / 8;
    let mut c = 0;
    while c + 2 <= chunks {
        // SAFETY: c + 2 <= w/8; the rest is forwarded from the caller.
        unsafe { accumulate_pass::<L, R, 2>(ld, rec, stride, n, weights, ws, acc, w, c) };
        c += 2;
    }
    if c < chunks {
        // SAFETY: c + 1 <= w/8; the rest is forwarded from the caller.
        unsafe { accumulate_pass::<L, R, 1>(ld, rec, stride, n, weights, ws, acc, w, c) };
    }
}

/// Runs `$body` with `$ld` bound to the loader of `$fmt`.
macro_rules! with_loader {
    ($fmt:expr, $ld:ident => $body:expr) => {
        match $fmt {
            Fmt::Bf16 => {
                let $ld = Bf16;
                $body
            }
            Fmt::F16 => {
                let $ld = F16;
                $body
            }
            Fmt::Int8 => {
                let $ld = Int8;
                $body
            }
            Fmt::Fp8 => {
                let $ld = Fp8;
                $body
            }
            Fmt::Table { bits: 1, table } => {
                let $ld = Table::<1>::new(&table);
                $body
            }
            Fmt::Table { bits: 2, table } => {
                let $ld = Table::<2>::new(&table);
                $body
            }
            Fmt::Table { bits: 3, table } => {
                let $ld = Table::<3>::new(&table);
                $body
            }
            Fmt::Table { table, .. } => {
                let $ld = Table::<4>::new(&table);
                $body
            }
        }
    };
}

/// Records whose scales are widened at a time, into a buffer on the stack.
pub(super) const SCALE_RUN: usize = 64;

/// Hints the caches to fetch the records and scales of `page`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch(page: &Page<'_>, pages: &Pages<'_>) {
    let records = &page.bytes[..(page.n * pages.stride).min(page.bytes.len())];
    let scales = &page.scales[..(page.n * pages.scale_step).min(page.scales.len())];
    prefetch_lines(records);
    prefetch_lines(scales);
}

/// Hints the caches to fetch page `i`'s share of [`Pages::next`] while page `i` of `pages`
/// is read: the slices dealt out over the first half of the pages, in order, so the last
/// arrive well before the pass that reads them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch_next(pages: &Pages<'_>, i: usize) {
    let (n, over) = (pages.next.len(), pages.list.len().div_ceil(2));
    if n > 0 && i < over {
        for bytes in &pages.next[i * n / over..(i + 1) * n / over] {
            prefetch_lines(bytes);
        }
    }
}

/// Hints the caches to fetch every cache line that `bytes` touches, from the line of its
/// first byte (which need not start a line: a page of a window's copies or a run's scales
/// rarely does) to the line of its last.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch_lines(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let lead = bytes.as_ptr() as usize % 64;
    let line = bytes.as_ptr().wrapping_sub(lead);
    for i in 0..(lead + bytes.len()).div_ceil(64) {
        // A prefetch never faults, whatever the address; this one is formed with wrapping
        // arithmetic and never dereferenced.
        _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(64 * i).cast());
    }
}

/// `out[k] = mul · s_(j0 + k)` for the `out.len()` records of `page` from `j0` on.
///
/// # Safety
/// AVX2/FMA/F16C; the page holds the scales of records `j0..j0 + out.len()` (or none).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn page_scales(pages: &Pages<'_>, page: &Page<'_>, j0: usize, out: &mut [f32]) {
    if page.scales.is_empty() {
        out.fill(pages.mul);
    } else {
        // SAFETY: the scales of records j0..j0 + n lie inside `page.scales` (caller).
        unsafe {
            f16_scales(
                &page.scales[j0 * pages.scale_step..],
                pages.scale_step,
                pages.mul,
                out,
            )
        };
    }
}

/// [`scores_t`] over every page of `pages` for `rows` (1–4) query rows:
/// `out[r·os + off + j] = mul · s_j · ⟨q_r, x_j⟩` for record j of the page at `off`.
///
/// # Safety
/// AVX2/FMA/F16C; `q.len() = rows·w` with `w` a positive multiple of 8; every chunk of every
/// page's `n` records and its `n` scales (if any) are readable; for every page `out` holds
/// `(rows − 1)·os + off + n` floats; the format's table width is 1–4 bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores(pages: Pages<'_>, q: &[f32], rows: usize, out: &mut [f32], os: usize) {
    let (w, stride) = (q.len() / rows, pages.stride);
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    macro_rules! go {
        ($r:literal) => {
            with_loader!(pages.fmt, ld => {
                // SAFETY: each run's records, their scales and their outputs are in bounds
                // (caller).
                unsafe {
                    score_runs!(&pages, |rec, sc, at| {
                        scores_t::<_, $r, { tokens_per_pass($r) }>(
                            ld, qp, w, rec, stride, sc, op.add(at), os,
                        )
                    })
                }
            })
        };
    }
    match rows {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        _ => go!(4),
    }
}

/// [`accumulate_t`] over every page of `pages` for `rows` (1–4) accumulator rows:
/// `acc[r·w..][..w] += Σ_j weights[r·ws + off + j] · mul · s_j · x_j`.
///
/// # Safety
/// AVX2/FMA/F16C; `acc.len() = rows·w` with `w` a positive multiple of 8; every chunk of every
/// page's `n` records and its `n` scales (if any) are readable; for every page `weights`
/// holds `(rows − 1)·ws + off + n` floats; the format's table width is 1–4 bits.
#[target_feature(enable = "avx2,fma,f16c")]
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
        ($r:literal) => {
            with_loader!(pages.fmt, ld => {
                // SAFETY: the pages' records, scales and weights are in bounds (caller);
                // `scaled` holds $r rows of SCALE_RUN weights.
                unsafe {
                    scaled_runs!(&pages, weights, ws, $r, |rec, n, scaled| {
                        accumulate_t::<_, $r>(ld, rec, stride, n, scaled.as_ptr(), SCALE_RUN, ap, w)
                    })
                }
            })
        };
    }
    match rows {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        _ => go!(4),
    }
}

/// The score passes' walk over the pages `$pages`: for each run of at most [`SCALE_RUN`]
/// records of a page, in order and prefetching ahead, `$body` with `$rec` the run's first
/// record, `$sc` its records' scales times `mul` (`&[f32]`, one per record) and `$at` the
/// output index of its first record (`off + j0`).
///
/// Safety (the caller's `unsafe` block): AVX2/F16C; every page's `n` scales (if any) are
/// readable and its records lie in its bytes.
macro_rules! score_runs {
    ($pages:expr, |$rec:ident, $sc:ident, $at:ident| $body:expr) => {{
        let pages = $pages;
        let mut buf = [0f32; SCALE_RUN];
        let ahead = pages.ahead();
        for (i, pg) in pages.list.iter().enumerate() {
            if let Some(next) = pages.list.get(i + ahead) {
                prefetch(next, pages);
            }
            prefetch_next(pages, i);
            for j0 in (0..pg.n).step_by(SCALE_RUN) {
                let $sc = &mut buf[..(pg.n - j0).min(SCALE_RUN)];
                page_scales(pages, pg, j0, $sc);
                let $rec = pg.bytes.as_ptr().add(j0 * pages.stride);
                let $at = pg.off + j0;
                $body
            }
        }
    }};
}
pub(super) use score_runs;

/// The value passes' walk over the pages `$pages`: for each run of at most [`SCALE_RUN`]
/// records of a page, in order and prefetching ahead, `$body` with `$rec` the run's first
/// record, `$n` its count and `$scaled` (`[f32; 4 * SCALE_RUN]`) holding `$rows` rows of
/// [`SCALE_RUN`] weights times the records' scales (`weights[r·ws + off + j] · mul · s_j`).
/// A macro, not a function taking a closure: the closure measured 20% slower on the AVX2
/// loop.
///
/// Safety (the caller's `unsafe` block): AVX2/F16C; `$rows <= 4`; every page's `n` scales (if
/// any) are readable and its records lie in its bytes; for every page `$weights` holds
/// `($rows − 1)·$ws + off + n` floats.
macro_rules! scaled_runs {
    ($pages:expr, $weights:expr, $ws:expr, $rows:expr,
     |$rec:ident, $n:ident, $scaled:ident| $body:expr) => {{
        let pages = $pages;
        let mut buf = [0f32; SCALE_RUN];
        let mut $scaled = [0f32; 4 * SCALE_RUN];
        let ahead = pages.ahead();
        for (i, pg) in pages.list.iter().enumerate() {
            if let Some(next) = pages.list.get(i + ahead) {
                prefetch(next, pages);
            }
            for j0 in (0..pg.n).step_by(SCALE_RUN) {
                let $n = (pg.n - j0).min(SCALE_RUN);
                let sc = &mut buf[..$n];
                page_scales(pages, pg, j0, sc);
                for r in 0..$rows {
                    let src = &$weights[r * $ws + pg.off + j0..][..$n];
                    let dst = &mut $scaled[r * SCALE_RUN..][..$n];
                    for ((d, &p), &s) in dst.iter_mut().zip(src).zip(sc.iter()) {
                        *d = p * s;
                    }
                }
                let $rec = pg.bytes.as_ptr().add(j0 * pages.stride);
                $body
            }
        }
    }};
}
pub(super) use scaled_runs;

/// [`Load8`] over every page of `pages`: `out[(off + j)·os..][..w] = mul · s_j · x_j`.
///
/// # Safety
/// AVX2/FMA/F16C; `w` a positive multiple of 8; every chunk of every page's `n` records and
/// its `n` scales (if any) are readable; `out` holds `(off + n − 1)·os + w` floats for every
/// page.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_rows(pages: Pages<'_>, w: usize, out: &mut [f32], os: usize) {
    let (stride, op) = (pages.stride, out.as_mut_ptr());
    let mut buf = [0f32; SCALE_RUN];
    with_loader!(pages.fmt, ld => {
        for pg in pages.list {
            for j0 in (0..pg.n).step_by(SCALE_RUN) {
                let sc = &mut buf[..(pg.n - j0).min(SCALE_RUN)];
                // SAFETY: records j0..j0 + sc.len() of the page, their scales and their
                // output rows are in bounds (caller).
                unsafe {
                    page_scales(&pages, pg, j0, sc);
                    for (k, &s) in sc.iter().enumerate() {
                        let rec = pg.bytes.as_ptr().add((j0 + k) * stride);
                        let dst = op.add((pg.off + j0 + k) * os);
                        let s = _mm256_set1_ps(s);
                        for c in 0..w / 8 {
                            _mm256_storeu_ps(dst.add(8 * c), _mm256_mul_ps(ld.load8(rec, c), s));
                        }
                    }
                }
            }
        }
    })
}

/// `out[j] = scale · f16(src[j·stride..][..2])` for `out.len()` scalars; eight at a time with
/// one `vcvtph2ps` when they are contiguous (`stride == 2`).
///
/// # Safety
/// AVX2/FMA/F16C; `src` holds `(out.len() − 1)·stride + 2` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_scales(src: &[u8], stride: usize, scale: f32, out: &mut [f32]) {
    let n = out.len();
    let s = _mm256_set1_ps(scale);
    let mut j = 0;
    if stride == 2 {
        while j + 8 <= n {
            // SAFETY: bytes 2j..2j + 16 lie inside `src` since 2(j + 7) + 2 <= 2(n − 1) + 2.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(2 * j).cast());
                _mm256_storeu_ps(
                    out.as_mut_ptr().add(j),
                    _mm256_mul_ps(_mm256_cvtph_ps(h), s),
                );
            }
            j += 8;
        }
    }
    for (k, o) in out.iter_mut().enumerate().skip(j) {
        let bits = u16::from_le_bytes([src[k * stride], src[k * stride + 1]]);
        let x = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)));
        *o = _mm_cvtss_f32(x) * scale;
    }
}
