//! Scores of table codes through int8 products (AVX-512 VBMI + VNNI): the decode kernels'
//! key pass for TurboQuant codes at about a third of the AVX2 decode-and-FMA's instructions.
//! Int8 records (a window's `q8` copies, an `int8` pool) take the same passes as 8-bit
//! "codes" whose codebook is the identity: each byte flipped to `x + 128` is its own entry.
//!
//! The query rows are rounded to int8 once per call (a step per row), the codebook to u8 with
//! an offset of 128 (one step for the table). Per key and 64 codes: a masked load of the
//! record's `8B` bytes, `vpermb` to give each group of eight codes its own qword,
//! `vpmultishiftqb` to bring code `i` to the low bits of byte `i`, `vpermb` through the
//! codebook (repeated to 64 entries, so the next codes' bits above a code do not matter), and
//! one `vpdpbusd` per query row. `128 · Σ q` undoes the offset; the sums become f32 scores
//! with the rows' steps and the keys' scales. The value pass has its own module
//! (`direct_vnni_values`).
//!
//! The rounding is the only difference from the f32 kernels: a score moves by at most
//! `(Δq/2)·Σ|t(c_i)| + (Δt/2)·Σ|q̂_i|` times the key's scale (`Δq`, `Δt` the two steps; see
//! the bound in `direct`'s tests), about 0.5% of the scores' RMS on Gaussian rows — small
//! beside the 3-bit codes' own ≈ 17% inner-product error.

use std::arch::x86_64::*;

use super::direct::Pages;
use super::direct_avx2::{SCALE_RUN, page_scales, prefetch};

/// Widest query row (coordinates of one run) the integer path takes.
pub(super) const MAX_W: usize = 256;

/// Query rows per call (their accumulators share the registers).
pub(super) const MAX_ROWS: usize = 4;

/// True when AVX-512 F/BW/VL/VBMI/VNNI and the AVX2 kernels' features are present (checked
/// once).
pub(super) fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        super::direct::has_simd()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vbmi")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// A `B`-bit codebook as bytes, `round(t_i / step) + 128` (the unsigned operand of
/// `vpdpbusd`), repeated to 64 entries.
#[derive(Clone, Copy, Debug)]
pub(super) struct Codebook {
    pub(super) bytes: [u8; 64],
    /// The value of one unit of a byte.
    pub(super) step: f32,
}

impl Codebook {
    /// The codebook of the first `2^bits` entries of `table`, or `None` when the table is all
    /// zeros or not finite (the f32 kernels take those).
    pub(super) fn new(bits: u8, table: &[f32; 16]) -> Option<Self> {
        let entries = &table[..1 << bits];
        let max = entries.iter().fold(0f32, |m, t| m.max(t.abs()));
        if !(max.is_finite() && max > 0.0) {
            return None;
        }
        let step = max / 127.0;
        let mut bytes = [0u8; 64];
        for (i, b) in bytes.iter_mut().enumerate() {
            // In 1..=255: |t / step| <= 127.
            *b = (nearest(entries[i % entries.len()] / step) + 128) as u8;
        }
        Some(Codebook { bytes, step })
    }

    /// The identity codebook of int8 records (scored as 8-bit codes): a byte is its own
    /// value, one unit each.
    pub(super) fn int8() -> Self {
        Codebook {
            bytes: [0; 64],
            step: 1.0,
        }
    }

    /// The codebook of the first `2^bits` entries of `table` as signed bytes,
    /// `round(t_i / step)` with no offset (the signed operand of `vpdpbusd`, for the value
    /// pass, whose weights are the unsigned one), or `None` as [`Codebook::new`].
    pub(super) fn signed(bits: u8, table: &[f32; 16]) -> Option<Self> {
        let mut book = Self::new(bits, table)?;
        for b in book.bytes.iter_mut() {
            *b = b.wrapping_sub(128);
        }
        Some(book)
    }
}

/// `y` rounded to the nearest integer, halves away from zero (as `f32::round`, which the
/// baseline x86-64 target compiles to a `roundf` call per element); saturating.
#[inline]
fn nearest(y: f32) -> i32 {
    (y + 0.5f32.copysign(y)) as i32
}

/// Up to [`MAX_ROWS`] query rows rounded to int8, each padded with zeros to `wq`, a multiple
/// of 64 (the padding's products are zero, whatever the codes past `w` decode to).
pub(super) struct Query {
    q: [i8; MAX_ROWS * MAX_W],
    wq: usize,
    rows: usize,
    /// Per row: the factor from an integer sum to a score (the row's step times the
    /// codebook's).
    factor: [f32; MAX_ROWS],
    /// Per row: `128 · Σ q̂_i`, the codebook offset's share of an integer sum.
    offset: [i32; MAX_ROWS],
}

impl Query {
    /// `q` holds `rows` (1..=MAX_ROWS) rows of `w` (<= MAX_W) floats; each is rounded with the
    /// step `max|q_i| / 127`.
    pub(super) fn new(q: &[f32], rows: usize, w: usize, book: &Codebook) -> Self {
        assert!(
            (1..=MAX_ROWS).contains(&rows) && w <= MAX_W && q.len() == rows * w,
            "integer scores: query rows of an unsupported shape"
        );
        let wq = w.div_ceil(64) * 64;
        let mut out = Query {
            q: [0; MAX_ROWS * MAX_W],
            wq,
            rows,
            factor: [0.0; MAX_ROWS],
            offset: [0; MAX_ROWS],
        };
        for (r, row) in q.chunks_exact(w).enumerate() {
            let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            // A zero (or non-finite) row scores zero through zero codes rather than dividing
            // by zero; NaN casts to 0.
            let step = if max > 0.0 { max / 127.0 } else { 1.0 };
            let inv = 1.0 / step;
            let mut sum = 0i32;
            for (d, &x) in out.q[r * wq..][..w].iter_mut().zip(row) {
                let v = nearest(x * inv);
                *d = v as i8;
                sum += v;
            }
            out.factor[r] = step * book.step;
            out.offset[r] = 128 * sum;
        }
        out
    }
}

/// Constants of the code expansion for `B`-bit codes.
#[derive(Clone, Copy)]
struct Expand {
    /// Byte `8l + i` takes record byte `B·l + i`: qword `l` starts at code `8l`.
    place: __m512i,
    /// Bit offsets `0, B, …, 7B` of the eight codes in a qword.
    shifts: __m512i,
    /// The codebook bytes.
    book: __m512i,
    /// The load masks of a whole chunk of 64 codes and of the last chunk.
    full: __mmask64,
    last: __mmask64,
    chunks: usize,
}

impl Expand {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    fn new<const B: usize>(book: &Codebook, w: usize) -> Self {
        let mut place = [0u8; 64];
        for (k, p) in place.iter_mut().enumerate() {
            *p = (B * (k / 8) + k % 8) as u8;
        }
        let mut shifts = [0u8; 8];
        for (i, s) in shifts.iter_mut().enumerate() {
            *s = (B * i) as u8;
        }
        let mask = |codes: usize| -> __mmask64 {
            let bytes = codes * B / 8;
            if bytes == 64 { !0 } else { (1u64 << bytes) - 1 }
        };
        let tail = w % 64;
        // SAFETY: both arrays hold 64 bytes.
        let (place, book) = unsafe {
            (
                _mm512_loadu_si512(place.as_ptr().cast()),
                _mm512_loadu_si512(book.bytes.as_ptr().cast()),
            )
        };
        Expand {
            place,
            shifts: _mm512_set1_epi64(i64::from_le_bytes(shifts)),
            book,
            full: mask(64),
            last: mask(if tail == 0 { 64 } else { tail }),
            chunks: w.div_ceil(64),
        }
    }

    /// The codebook bytes of codes `64c..64c + 64` of the record at `rec` (zero codes past
    /// the record's end).
    ///
    /// # Safety
    /// The record's `w·B/8` bytes are readable from `rec`; `c < chunks`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    unsafe fn centroids<const B: usize>(&self, rec: *const u8, c: usize) -> __m512i {
        let mask = if c + 1 == self.chunks {
            self.last
        } else {
            self.full
        };
        // SAFETY: the masked load reads only the chunk's bytes, which lie inside the record
        // (caller); masked-off bytes are neither read nor faulted on.
        let raw = unsafe { _mm512_maskz_loadu_epi8(mask, rec.add(8 * B * c).cast()) };
        if B == 8 {
            // Int8 records: x + 128 as u8 is x with its top bit flipped; past the record's
            // end zeros, which the query's zero padding multiplies away.
            return _mm512_xor_si512(raw, _mm512_set1_epi8(i8::MIN));
        }
        let codes =
            _mm512_multishift_epi64_epi8(self.shifts, _mm512_permutexvar_epi8(self.place, raw));
        // `vpermb` reads the low six bits of each index byte: the codebook's period 2^B makes
        // the bits of the next codes above a code irrelevant.
        _mm512_permutexvar_epi8(codes, self.book)
    }
}

/// `out[r·os + j + k] = factor_r · (Σ_i q̂_ri · û_i − offset_r) · scales[j + k]` for `k < T`.
///
/// # Safety
/// As [`scores`]; tokens `j..j + T` are records of the run (`j + T <= scales.len()`).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
unsafe fn pass<const B: usize, const R: usize, const T: usize>(
    ex: &Expand,
    q: &Query,
    rec: *const u8,
    stride: usize,
    scales: &[f32],
    out: *mut f32,
    os: usize,
    j: usize,
) {
    let mut acc = [[_mm512_setzero_si512(); T]; R];
    for c in 0..ex.chunks {
        for k in 0..T {
            // SAFETY: token j + k is a record of the run; c < chunks; row r's 64 bytes at
            // r·wq + 64c lie inside `q.q` (wq <= MAX_W, r < MAX_ROWS).
            unsafe {
                let cent = ex.centroids::<B>(rec.add((j + k) * stride), c);
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm512_loadu_si512(q.q.as_ptr().add(r * q.wq + 64 * c).cast());
                    a[k] = _mm512_dpbusd_epi32(a[k], cent, qv);
                }
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let factor = q.factor[r];
        if T == 4 {
            // The 16 lanes of each of four keys: 256-bit halves added, then a 4×4
            // transpose-add of the 128-bit parts.
            let h: [__m256i; 4] = std::array::from_fn(|k| {
                _mm256_add_epi32(
                    _mm512_castsi512_si256(a[k]),
                    _mm512_extracti64x4_epi64::<1>(a[k]),
                )
            });
            let x = _mm256_hadd_epi32(h[0], h[1]);
            let y = _mm256_hadd_epi32(h[2], h[3]);
            let z = _mm256_hadd_epi32(x, y);
            let s = _mm_add_epi32(_mm256_castsi256_si128(z), _mm256_extracti128_si256::<1>(z));
            let s = _mm_cvtepi32_ps(_mm_sub_epi32(s, _mm_set1_epi32(q.offset[r])));
            // SAFETY: j + 4 <= scales.len(); row r's outputs j..j + 4 lie inside `out`
            // (caller).
            unsafe {
                let sc = _mm_mul_ps(_mm_loadu_ps(scales.as_ptr().add(j)), _mm_set1_ps(factor));
                _mm_storeu_ps(out.add(r * os + j), _mm_mul_ps(s, sc));
            }
        } else {
            for (k, v) in a.iter().enumerate() {
                let s = (_mm512_reduce_add_epi32(*v) - q.offset[r]) as f32;
                // SAFETY: as above, for token j + k.
                unsafe { *out.add(r * os + j + k) = s * (factor * scales[j + k]) };
            }
        }
    }
}

/// Sixteen keys' score sums as the 16 lanes of one register per row: each key's 64 centroid
/// bytes are 16 dwords (four coordinates each), and a transpose of the 16 × 16 dwords gives,
/// for each dword index `i`, the sixteen keys' dword `i` in one register, which one
/// `vpdpbusd` with the row's dword `i` broadcast adds to lane `l` of key `l`. The transpose
/// (64 two-register shuffles for 16 keys, 4 per key whatever the rows) replaces the per-key
/// horizontal sums of [`pass`] (about 4 instructions per key and row).
///
/// # Safety
/// As [`pass`], with `T = 16`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
unsafe fn pass16<const B: usize, const R: usize>(
    ex: &Expand,
    q: &Query,
    rec: *const u8,
    stride: usize,
    scales: &[f32],
    out: *mut f32,
    os: usize,
    j: usize,
) {
    let mut acc = [_mm512_setzero_si512(); R];
    for c in 0..ex.chunks {
        // SAFETY: tokens j..j + 16 are records of the run; c < chunks (caller). All sixteen
        // loads are issued before the shuffles (measured faster than four at a time).
        let x: [__m512i; 16] =
            std::array::from_fn(|k| unsafe { ex.centroids::<B>(rec.add((j + k) * stride), c) });
        // Within each 128-bit lane: dwords of key pairs interleaved, then of key quads:
        // quads[g][m] holds, in lane L, dword 4L + m of keys 4g..4g + 4.
        let quads: [[__m512i; 4]; 4] = std::array::from_fn(|g| {
            let x = &x[4 * g..4 * g + 4];
            let (lo0, hi0) = (
                _mm512_unpacklo_epi32(x[0], x[1]),
                _mm512_unpackhi_epi32(x[0], x[1]),
            );
            let (lo1, hi1) = (
                _mm512_unpacklo_epi32(x[2], x[3]),
                _mm512_unpackhi_epi32(x[2], x[3]),
            );
            [
                _mm512_unpacklo_epi64(lo0, lo1),
                _mm512_unpackhi_epi64(lo0, lo1),
                _mm512_unpacklo_epi64(hi0, hi1),
                _mm512_unpackhi_epi64(hi0, hi1),
            ]
        });
        // `m` picks the same register of the four quads (an array copy per `m` measured 45%
        // slower: the copies spill).
        #[allow(clippy::needless_range_loop)]
        for m in 0..4 {
            let y = &quads;
            // The 128-bit lanes transposed: t[L] holds dword 4L + m of all 16 keys.
            let s0 = _mm512_shuffle_i32x4::<0x44>(y[0][m], y[1][m]);
            let s1 = _mm512_shuffle_i32x4::<0xEE>(y[0][m], y[1][m]);
            let s2 = _mm512_shuffle_i32x4::<0x44>(y[2][m], y[3][m]);
            let s3 = _mm512_shuffle_i32x4::<0xEE>(y[2][m], y[3][m]);
            let t = [
                _mm512_shuffle_i32x4::<0x88>(s0, s2),
                _mm512_shuffle_i32x4::<0xDD>(s0, s2),
                _mm512_shuffle_i32x4::<0x88>(s1, s3),
                _mm512_shuffle_i32x4::<0xDD>(s1, s3),
            ];
            for (l, tl) in t.iter().enumerate() {
                let i = 16 * c + 4 * l + m;
                for (r, a) in acc.iter_mut().enumerate() {
                    // SAFETY: dword i of row r lies inside `q.q` (i < wq / 4).
                    let qd = unsafe {
                        q.q.as_ptr()
                            .add(r * q.wq + 4 * i)
                            .cast::<i32>()
                            .read_unaligned()
                    };
                    *a = _mm512_dpbusd_epi32(*a, *tl, _mm512_set1_epi32(qd));
                }
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let s = _mm512_cvtepi32_ps(_mm512_sub_epi32(*a, _mm512_set1_epi32(q.offset[r])));
        // SAFETY: j + 16 <= scales.len(); row r's outputs j..j + 16 lie inside `out` (caller).
        unsafe {
            let sc = _mm512_mul_ps(
                _mm512_loadu_ps(scales.as_ptr().add(j)),
                _mm512_set1_ps(q.factor[r]),
            );
            _mm512_storeu_ps(out.add(r * os + j), _mm512_mul_ps(s, sc));
        }
    }
}

/// Integer scores of `pages` (a table format of `B` bits, or int8 records with `B` = 8) for
/// the rows of `q`: `out[r·os + off + j] ≈ mul · s_j · ⟨q_r, x_j⟩` for record j of the page at
/// `off`.
///
/// # Safety
/// [`available`]; `B` in 1..=4 is the pages' table width, or 8 for int8 records and
/// [`Codebook::int8`]; `w` (a positive multiple of 8,
/// at most [`MAX_W`]) their record width; every page's `n` records (`w·B/8` bytes each) and
/// its `n` scales (if any) are readable; for every page `out` holds
/// `(q.rows − 1)·os + off + n` floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
unsafe fn scores_b<const B: usize>(
    pages: Pages<'_>,
    book: &Codebook,
    q: &Query,
    w: usize,
    out: &mut [f32],
    os: usize,
) {
    let ex = Expand::new::<B>(book, w);
    let (stride, op) = (pages.stride, out.as_mut_ptr());
    let mut buf = [0f32; SCALE_RUN];
    macro_rules! go {
        ($r:literal) => {{
            let ahead = pages.ahead();
            for (i, pg) in pages.list.iter().enumerate() {
                if let Some(next) = pages.list.get(i + ahead) {
                    prefetch(next, &pages);
                }
                for j0 in (0..pg.n).step_by(SCALE_RUN) {
                    let sc = &mut buf[..(pg.n - j0).min(SCALE_RUN)];
                    // SAFETY: records j0..j0 + sc.len() of the page, their scales and their
                    // outputs are in bounds (caller); each pass gets tokens inside the run.
                    unsafe {
                        page_scales(&pages, pg, j0, sc);
                        let (rec, o) = (pg.bytes.as_ptr().add(j0 * stride), op.add(pg.off + j0));
                        let mut j = 0;
                        while j + 16 <= sc.len() {
                            pass16::<B, $r>(&ex, q, rec, stride, sc, o, os, j);
                            j += 16;
                        }
                        while j + 4 <= sc.len() {
                            pass::<B, $r, 4>(&ex, q, rec, stride, sc, o, os, j);
                            j += 4;
                        }
                        while j < sc.len() {
                            pass::<B, $r, 1>(&ex, q, rec, stride, sc, o, os, j);
                            j += 1;
                        }
                    }
                }
            }
        }};
    }
    match q.rows {
        1 => go!(1),
        2 => go!(2),
        3 => go!(3),
        _ => go!(4),
    }
}

/// [`scores_b`] for a table of `bits` (1..=4) bits, or for int8 records (`bits` 8 and
/// [`Codebook::int8`]).
///
/// # Safety
/// As [`scores_b`], with `B = bits`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
pub(super) unsafe fn scores(
    pages: Pages<'_>,
    bits: u8,
    book: &Codebook,
    q: &Query,
    w: usize,
    out: &mut [f32],
    os: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match bits {
            1 => scores_b::<1>(pages, book, q, w, out, os),
            2 => scores_b::<2>(pages, book, q, w, out, os),
            3 => scores_b::<3>(pages, book, q, w, out, os),
            8 => scores_b::<8>(pages, book, q, w, out, os),
            _ => scores_b::<4>(pages, book, q, w, out, os),
        }
    }
}
