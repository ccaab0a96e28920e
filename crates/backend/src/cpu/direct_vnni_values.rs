//! The value pass of decode (`acc_r += Σ_j w_rj · x_j`) for table codes through int8 products
//! (AVX-512 VBMI + VNNI), the twin of `direct_vnni`'s score pass.
//!
//! A score sums over the coordinates of one key, so its `vpdpbusd` takes four coordinates of
//! a key per lane. A value sum runs over keys, so here a lane takes one coordinate of four
//! keys: four registers whose lane `ℓ` holds coordinate `16m + ℓ` of the four keys (register
//! `m`) as codebook bytes, built from the four records by three shuffles each ([`Gather4`]),
//! and each row's four weights, one byte each, broadcast as the other operand (four keys that
//! are consecutive records of 64 codes, as in a block of the cache, take two loads instead of
//! four). The integer sums of a span are converted and added to the accumulator rows in place.
//! Per four keys and 64 coordinates: four masked loads, twelve shuffles and four `vpdpbusd`
//! per row, where the f32 pass decodes 256 coordinates and issues 48 FMAs per row.
//!
//! The weights are rounded to u8 per span of up to [`SPAN`] keys (across the cache's blocks)
//! and row, with the step `max_j w_rj / 255`; the codebook to i8 with the step `max|t| / 127`.
//! A span whose weights are not all finite and non-negative (softmax numerators times norms
//! always are) takes the f32 pass. A sum moves from the f32 one by at most
//! `Σ_j (w_rj·Δt/2 + |t(c_ji)|·Δw/2 + Δw·Δt/4)` (the bound the tests check).

use std::arch::x86_64::*;

use super::direct::Pages;
use super::direct_avx2::{Table, accumulate_t, page_scales, prefetch};
use super::direct_vnni::{Codebook, MAX_ROWS};

/// Keys gathered for one rounding of their weights: up to [`SPAN`] keys from one page or
/// several (a cache block holds fewer), so that the rounding, the conversion of the integer
/// sums and a partial last group cost once per span rather than once per block.
struct Span<const R: usize> {
    rec: [*const u8; SPAN],
    /// Row `r`'s weights times `mul · s_j`, for the first `n` keys.
    scaled: [[f32; SPAN]; R],
    n: usize,
}

/// Keys per span: the integer sums of a span stay far below `i32::MAX` (255 · 127 per
/// product, four products per lane and instruction).
pub(super) const SPAN: usize = 64;

/// One span's weights rounded to u8: row `r`'s byte `j` is key `j`'s weight over `step[r]`,
/// zero past the span's keys (so that a partial group of four adds nothing).
struct SpanWeights {
    bytes: [[u8; SPAN]; MAX_ROWS],
    /// Per row: the value of one unit of a byte times the codebook's step.
    step: [f32; MAX_ROWS],
}

impl SpanWeights {
    /// Rounds the span's weights; `None` when one of them is negative or not finite.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    fn new<const R: usize>(span: &Span<R>, book: &Codebook) -> Option<Self> {
        const V: usize = SPAN / 16;
        let mut out = SpanWeights {
            bytes: [[0; SPAN]; MAX_ROWS],
            step: [0.0; MAX_ROWS],
        };
        let masks: [__mmask16; V] = std::array::from_fn(|v| {
            let k = span.n.saturating_sub(16 * v).min(16);
            ((1u32 << k) - 1) as __mmask16
        });
        for (r, row) in span.scaled.iter().enumerate() {
            // SAFETY: the row's SPAN floats are readable; masked-off lanes are neither read
            // nor faulted on and load as zero.
            let x: [__m512; V] = std::array::from_fn(|v| unsafe {
                _mm512_maskz_loadu_ps(masks[v], row.as_ptr().add(16 * v))
            });
            let (mut lo, mut hi) = (x[0], x[0]);
            for xv in &x[1..] {
                lo = _mm512_min_ps(lo, *xv);
                hi = _mm512_max_ps(hi, *xv);
            }
            let (lo, hi) = (_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi));
            // `!(lo >= 0)` also catches NaN; an infinite weight makes `hi` infinite.
            if !(lo >= 0.0 && hi.is_finite()) {
                return None;
            }
            if hi == 0.0 {
                continue;
            }
            let inv = _mm512_set1_ps(255.0 / hi);
            out.step[r] = hi / 255.0 * book.step;
            for (v, xv) in x.iter().enumerate() {
                // Round to nearest (MXCSR's default), 0..=255 already; saturate to u8.
                let q = _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(*xv, inv)));
                // SAFETY: bytes 16v..16v + 16 of row r lie inside `out.bytes`.
                unsafe { _mm_storeu_si128(out.bytes[r].as_mut_ptr().add(16 * v).cast(), q) };
            }
        }
        Some(out)
    }
}

/// The `vpermt2b` indices of [`GatherTables`] for `b`-bit codes, the four keys' records at
/// bytes 0, 32, 64, 96 of the two table registers or, for a `run`, at `8b·k`.
const fn gather_idx(b: usize, run: bool) -> [[u8; 64]; 4] {
    let mut idx = [[0u8; 64]; 4];
    let mut m = 0;
    while m < 4 {
        let mut q = 0;
        while q < 8 {
            let byte = b * (16 * m + 2 * q) / 8;
            let mut k = 0;
            while k < 4 {
                let base = if run { 8 * b * k } else { 32 * k } + byte;
                idx[m][8 * q + 2 * k] = (base & 127) as u8;
                idx[m][8 * q + 2 * k + 1] = ((base + 1) & 127) as u8;
                k += 1;
            }
            q += 1;
        }
        m += 1;
    }
    idx
}

/// The [`Gather4`] shuffle controls for `B`-bit codes, computed at compile time.
struct GatherTables<const B: usize>;

impl<const B: usize> GatherTables<B> {
    /// Per register `m`: the `vpermt2b` index of each byte of each qword `Q` (coordinates
    /// `16m + 2Q` and the next): its bytes `2k`, `2k + 1` are key `k`'s record bytes holding
    /// them (keys 0, 1 in the first table register at bytes 0 and 32, keys 2, 3 in the second).
    const IDX: [[u8; 64]; 4] = gather_idx(B, false);

    /// [`Self::IDX`] for four consecutive records of 64 codes (`8B` bytes each) loaded as one
    /// run of `32B` bytes across the two table registers: key `k`'s bytes start at `8B·k`.
    const IDX_RUN: [[u8; 64]; 4] = gather_idx(B, true);

    /// Per register `m`: the `vpmultishiftqb` bit offset of output byte `4e + k` of qword
    /// `Q`, key `k`'s code of coordinate `16m + 2Q + e` within the gathered qword.
    const SHIFTS: [[u8; 64]; 4] = {
        let mut shifts = [[0u8; 64]; 4];
        let mut m = 0;
        while m < 4 {
            let mut q = 0;
            while q < 8 {
                let first = 16 * m + 2 * q;
                let byte = B * first / 8;
                let mut e = 0;
                while e < 2 {
                    let mut k = 0;
                    while k < 4 {
                        shifts[m][8 * q + 4 * e + k] = (16 * k + B * (first + e) - 8 * byte) as u8;
                        k += 1;
                    }
                    e += 1;
                }
                q += 1;
            }
            m += 1;
        }
        shifts
    };
}

/// Constants that expand four keys' `B`-bit codes of a chunk of 64 coordinates straight into
/// the interleaved layout: register `m` (0..4) holds, in byte `k` of its dword lane `ℓ`, the
/// codebook byte of key `k`'s coordinate `16m + ℓ` (so the sums come out in coordinate order).
///
/// Keys 0 and 1 are loaded into one register (bytes 0.. and 32..), keys 2 and 3 into
/// another. A qword of the output covers two coordinates of the four keys, whose codes lie
/// in two bytes of each key's record (`2B` bits from an even coordinate never cross more than
/// two bytes for `B <= 4`): `vpermt2b` gathers those eight bytes into the qword,
/// `vpmultishiftqb` brings each code to the low bits of its output byte, and `vpermb` looks
/// it up in the codebook (period `2^B`, so the bits above a code do not matter). Three
/// shuffles per register, where expanding each key and interleaving takes five.
#[derive(Clone, Copy)]
struct Gather4 {
    /// Per register: the `vpermt2b` indices into the two pairs of records.
    idx: [__m512i; 4],
    /// Per register: the `vpmultishiftqb` bit offsets of the codes in their qwords.
    shifts: [__m512i; 4],
    /// The signed codebook, repeated to 64 entries.
    book: __m512i,
    /// Load masks of a whole chunk (`8B` bytes) and of the last one.
    full: __mmask64,
    last: __mmask64,
    chunks: usize,
}

impl Gather4 {
    /// The constants for `B`-bit codes, records of `w` coordinates and `book`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    fn new<const B: usize>(book: &Codebook, w: usize) -> Self {
        let mask = |codes: usize| -> __mmask64 { (1u64 << (codes * B).div_ceil(8)) - 1 };
        let tail = w % 64;
        // SAFETY: every array holds 64 bytes.
        let load = |a: &[u8; 64]| unsafe { _mm512_loadu_si512(a.as_ptr().cast()) };
        Gather4 {
            idx: std::array::from_fn(|m| load(&GatherTables::<B>::IDX[m])),
            shifts: std::array::from_fn(|m| load(&GatherTables::<B>::SHIFTS[m])),
            book: load(&book.bytes),
            full: mask(64),
            last: mask(if tail == 0 { 64 } else { tail }),
            chunks: w.div_ceil(64),
        }
    }

    /// The four registers of chunk `c` of the keys at `rec` (zero codes past a record's end).
    ///
    /// # Safety
    /// Each record's `w·B/8` bytes are readable; `c < chunks`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    unsafe fn centroids<const B: usize>(&self, rec: [*const u8; 4], c: usize) -> [__m512i; 4] {
        let lo = if c + 1 == self.chunks {
            self.last
        } else {
            self.full
        };
        let hi = lo << 32;
        let at = |k: usize| rec[k].wrapping_add(8 * B * c).cast::<i8>();
        // SAFETY: the masked loads read only the chunk's bytes of each record (caller), the
        // second key of a pair from 32 bytes before its address into bytes 32..; masked-off
        // bytes are neither read nor faulted on.
        let (a, b) = unsafe {
            (
                _mm512_mask_loadu_epi8(
                    _mm512_maskz_loadu_epi8(lo, at(0)),
                    hi,
                    at(1).wrapping_sub(32),
                ),
                _mm512_mask_loadu_epi8(
                    _mm512_maskz_loadu_epi8(lo, at(2)),
                    hi,
                    at(3).wrapping_sub(32),
                ),
            )
        };
        std::array::from_fn(|m| {
            let codes = _mm512_multishift_epi64_epi8(
                self.shifts[m],
                _mm512_permutex2var_epi8(a, self.idx[m], b),
            );
            _mm512_permutexvar_epi8(codes, self.book)
        })
    }
}

impl Gather4 {
    /// [`Gather4::centroids`] of four records of 64 codes that lie one after another from
    /// `rec`: two loads of their `32B` bytes instead of four.
    ///
    /// # Safety
    /// The `32B` bytes from `rec` are readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    unsafe fn centroids_run<const B: usize>(&self, rec: *const u8) -> [__m512i; 4] {
        let mask = |bytes: usize| -> __mmask64 {
            match bytes {
                0 => 0,
                64.. => !0,
                b => (1 << b) - 1,
            }
        };
        let (first, second) = (mask(32 * B), mask((32 * B).saturating_sub(64)));
        // SAFETY: the masked loads read bytes 0..32B from rec (caller); masked-off bytes are
        // neither read nor faulted on.
        let (a, b) = unsafe {
            (
                _mm512_maskz_loadu_epi8(first, rec.cast()),
                _mm512_maskz_loadu_epi8(second, rec.wrapping_add(64).cast()),
            )
        };
        std::array::from_fn(|m| {
            // SAFETY: the table holds 64 bytes.
            let idx = unsafe { _mm512_loadu_si512(GatherTables::<B>::IDX_RUN[m].as_ptr().cast()) };
            let codes =
                _mm512_multishift_epi64_epi8(self.shifts[m], _mm512_permutex2var_epi8(a, idx, b));
            _mm512_permutexvar_epi8(codes, self.book)
        })
    }
}

/// `acc[r·w + 64c + d] += Σ_j ŵ_rj · t̂(c_j, 64c + d) · step_r` for the chunk's coordinates
/// `d < 64` (those below `w`) over the span's keys.
///
/// # Safety
/// As [`accumulate_b`]; the span's records are readable; `c < g.chunks`; `acc` holds `R·w`
/// floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
unsafe fn span_chunk<const B: usize, const R: usize>(
    g: &Gather4,
    span: &Span<R>,
    wt: &SpanWeights,
    c: usize,
    acc: *mut f32,
    w: usize,
) {
    let n = span.n;
    let mut ints = [[_mm512_setzero_si512(); 4]; R];
    for j in (0..n).step_by(4) {
        // A partial last group repeats its last key, whose weight bytes are zero.
        let rec: [*const u8; 4] = std::array::from_fn(|k| span.rec[(j + k).min(n - 1)]);
        let run = w == 64 && (1..4).all(|k| rec[k] as usize == rec[0] as usize + 8 * B * k);
        // SAFETY: every key index is below n, whose records are readable (caller); a run's
        // four records are its 32B bytes.
        let z = unsafe {
            if run {
                g.centroids_run::<B>(rec[0])
            } else {
                g.centroids::<B>(rec, c)
            }
        };
        for (r, ar) in ints.iter_mut().enumerate() {
            // SAFETY: bytes j..j + 4 of row r lie inside the row (j + 4 <= SPAN, a multiple
            // of 4).
            let wv = unsafe { wt.bytes[r].as_ptr().add(j).cast::<i32>().read_unaligned() };
            let wv = _mm512_set1_epi32(wv);
            for (am, zm) in ar.iter_mut().zip(&z) {
                *am = _mm512_dpbusd_epi32(*am, wv, *zm);
            }
        }
    }
    for (r, ar) in ints.iter().enumerate() {
        let step = _mm512_set1_ps(wt.step[r]);
        for (m, am) in ar.iter().enumerate() {
            let d = 64 * c + 16 * m;
            if d >= w {
                break;
            }
            // Lanes past the record's width are neither read nor written (w is a multiple
            // of 8).
            let mask: __mmask16 = if w - d >= 16 { !0 } else { 0xFF };
            // SAFETY: coordinates d.. of row r below w lie inside `acc` (caller).
            unsafe {
                let at = acc.add(r * w + d);
                let s = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(*am),
                    step,
                    _mm512_maskz_loadu_ps(mask, at),
                );
                _mm512_mask_storeu_ps(at, mask, s);
            }
        }
    }
}

/// The integer value pass over every page for `R` rows and `B`-bit codes: `acc[r·w..][..w] +=
/// Σ_j weights[r·ws + off + j] · mul · s_j · x_j`, within the rounding bound of the module.
///
/// # Safety
/// [`super::direct_vnni::available`]; `B` is the pages' table width and `w` (a positive
/// multiple of 8, at most [`super::direct_vnni::MAX_W`]) their record width; every page's
/// `n` records (`w·B/8` bytes each, and the 4 bytes the f32 pass reads past a chunk) and its
/// `n` scales (if any) are readable; for every page `weights` holds `(R − 1)·ws + off + n`
/// floats; `acc` holds `R·w`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
unsafe fn accumulate_b<const B: usize, const R: usize>(
    pages: Pages<'_>,
    table: &[f32; 16],
    book: &Codebook,
    weights: &[f32],
    ws: usize,
    acc: &mut [f32],
    w: usize,
) {
    let g = Gather4::new::<B>(book, w);
    let f32_pass = Table::<B>::new(table);
    let mut span = Span::<R> {
        rec: [std::ptr::null(); SPAN],
        scaled: [[0.0; SPAN]; R],
        n: 0,
    };
    let mut scales = [0f32; SPAN];
    let mut flush = |span: &mut Span<R>| {
        match SpanWeights::new(span, book) {
            Some(wt) => {
                for c in 0..g.chunks {
                    // SAFETY: the span's records are readable (caller); c < chunks.
                    unsafe { span_chunk::<B, R>(&g, span, &wt, c, acc.as_mut_ptr(), w) };
                }
            }
            None => {
                for (k, &rec) in span.rec[..span.n].iter().enumerate() {
                    // SAFETY: one readable record (caller) and its R weights SPAN apart;
                    // `acc` holds R·w floats.
                    unsafe {
                        let wk = span.scaled.as_ptr().cast::<f32>().add(k);
                        accumulate_t::<_, R>(f32_pass, rec, 0, 1, wk, SPAN, acc.as_mut_ptr(), w)
                    };
                }
            }
        }
        span.n = 0;
    };
    let ahead = pages.ahead();
    for (i, pg) in pages.list.iter().enumerate() {
        if let Some(next) = pages.list.get(i + ahead) {
            prefetch(next, &pages);
        }
        // A page starts a group of four keys: groups that straddle two pages (after a page
        // whose record count is not a multiple of four, such as a block whose first slot is
        // a sink read exactly) take the gather path, several times slower than a run, for
        // the rest of the span. Zero-weight repeats of the last key fill the group instead.
        while !span.n.is_multiple_of(4) {
            span.rec[span.n] = span.rec[span.n - 1];
            for row in span.scaled.iter_mut() {
                row[span.n] = 0.0;
            }
            span.n += 1;
        }
        if span.n == SPAN {
            flush(&mut span);
        }
        let mut j0 = 0;
        while j0 < pg.n {
            let take = (pg.n - j0).min(SPAN - span.n);
            let sc = &mut scales[..take];
            // SAFETY: the page holds the scales of records j0..j0 + take (caller).
            unsafe { page_scales(&pages, pg, j0, sc) };
            for r in 0..R {
                let src = &weights[r * ws + pg.off + j0..][..take];
                let dst = &mut span.scaled[r][span.n..][..take];
                for ((d, &p), &s) in dst.iter_mut().zip(src).zip(sc.iter()) {
                    *d = p * s;
                }
            }
            for (k, rec) in span.rec[span.n..][..take].iter_mut().enumerate() {
                *rec = pg.bytes[(j0 + k) * pages.stride..].as_ptr();
            }
            span.n += take;
            j0 += take;
            if span.n == SPAN {
                flush(&mut span);
            }
        }
    }
    if span.n > 0 {
        flush(&mut span);
    }
}

/// [`accumulate_b`] for a table of `bits` (1..=4) bits and `rows` (1..=[`MAX_ROWS`]) rows.
///
/// # Safety
/// As [`accumulate_b`], with `B = bits`, `R = rows` and `book` [`Codebook::signed`] of the
/// table.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
pub(super) unsafe fn accumulate(
    pages: Pages<'_>,
    bits: u8,
    table: &[f32; 16],
    book: &Codebook,
    weights: &[f32],
    ws: usize,
    acc: &mut [f32],
    rows: usize,
) {
    let w = acc.len() / rows;
    macro_rules! go {
        ($b:literal) => {
            // SAFETY: forwarded from the caller.
            unsafe {
                match rows {
                    1 => accumulate_b::<$b, 1>(pages, table, book, weights, ws, acc, w),
                    2 => accumulate_b::<$b, 2>(pages, table, book, weights, ws, acc, w),
                    3 => accumulate_b::<$b, 3>(pages, table, book, weights, ws, acc, w),
                    _ => accumulate_b::<$b, 4>(pages, table, book, weights, ws, acc, w),
                }
            }
        };
    }
    match bits {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        _ => go!(4),
    }
}
