//! Scores and value sums read straight from a page of the cache, for the formats whose working
//! coordinates decode independently with one scale per token: 16-bit values, `int8`, `fp8`, and
//! single-part TurboQuant MSE codes (see [`turbokv_codec::DirectCodes`]); a window's exact
//! copies (already in the working basis) are f16 pages too.
//!
//! A page is `n` token records `stride` bytes apart. Token `j`'s working vector is
//! `x_j = s_j · unit · value(record_j)`; the caller folds `s_j · unit` (and the softmax scale)
//! into the per-token `scales` of [`scores`] and the `weights` of [`accumulate`], so the
//! kernels see only the records. `unit` ([`Fmt::unit`]) is 1 except for fp8, whose values
//! are E4M3's times 2⁻⁸ (what the loader gets from the f16 conversion without a multiply). Each function has a plain scalar reference (`*_ref`) that the AVX2 twin
//! (`direct_avx2`) is tested against.

use turbokv_codec::{DirectCodes, DirectKind};

/// The number format of a page's records.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Fmt {
    /// bfloat16, little-endian.
    Bf16,
    /// IEEE half, little-endian.
    F16,
    /// Two's-complement bytes.
    Int8,
    /// OCP FP8 E4M3 bytes.
    Fp8,
    /// `bits`-bit (1–4) codes packed LSB-first, decoded through `table`.
    Table { bits: u8, table: [f32; 16] },
}

impl Fmt {
    /// The format of a codec's direct codes.
    pub(crate) fn of(direct: &DirectCodes) -> Self {
        match direct.kind {
            DirectKind::Int8 => Fmt::Int8,
            DirectKind::Fp8 => Fmt::Fp8,
            DirectKind::Table { bits, table } => Fmt::Table { bits, table },
        }
    }

    /// The factor between [`Fmt::value`] and the format's own value of a code (2⁸ for fp8,
    /// else 1), which callers fold into the per-token scales.
    pub(crate) fn unit(self) -> f32 {
        match self {
            Fmt::Fp8 => 256.0,
            _ => 1.0,
        }
    }

    /// Bytes the SIMD loaders may read from the start of a record of `w` coordinates (table
    /// codes are read as one 4-byte word per 8 codes).
    fn read_len(self, w: usize) -> usize {
        match self {
            Fmt::Bf16 | Fmt::F16 => 2 * w,
            Fmt::Int8 | Fmt::Fp8 => w,
            Fmt::Table { bits, .. } => (w / 8).saturating_sub(1) * usize::from(bits) + 4,
        }
    }

    /// Coordinate `i` of the record `rec` over [`Fmt::unit`] (the scalar reference decode).
    fn value(self, rec: &[u8], i: usize) -> f32 {
        match self {
            Fmt::Bf16 => half::bf16::from_le_bytes([rec[2 * i], rec[2 * i + 1]]).to_f32(),
            Fmt::F16 => half::f16::from_le_bytes([rec[2 * i], rec[2 * i + 1]]).to_f32(),
            Fmt::Int8 => f32::from(rec[i] as i8),
            // Exact: a power of two, and 2⁻⁹ · 2⁻⁸ is still a normal f32.
            Fmt::Fp8 => turbokv_codec::fp8::decode(rec[i]) / 256.0,
            Fmt::Table { bits, table } => {
                let b = usize::from(bits);
                let (bit, mut code) = (i * b, 0usize);
                for k in 0..b {
                    let at = bit + k;
                    code |= usize::from((rec[at / 8] >> (at % 8)) & 1) << k;
                }
                table[code]
            }
        }
    }
}

/// The bytes of 16-bit values `x` (native-endian, so little-endian on x86-64 where the SIMD
/// kernels read them), for an [`Fmt::F16`] or [`Fmt::Bf16`] page.
pub(crate) fn u16_bytes(x: &[u16]) -> &[u8] {
    // SAFETY: any u16 is two initialised bytes, u8 has alignment 1, and the byte slice covers
    // exactly the memory of `x` for the lifetime of its borrow.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// `n` token records of one page, `stride` bytes apart from the start of `bytes` (the
/// stride is the task's), holding the keys `off..off + n` of a task.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Page<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) n: usize,
    pub(crate) off: usize,
}

/// The pages of one task in one format.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pages<'a> {
    pub(crate) fmt: Fmt,
    pub(crate) stride: usize,
    pub(crate) list: &'a [Page<'a>],
}

impl Pages<'_> {
    /// Whether the SIMD loaders may read every chunk of every page's records of `w`
    /// coordinates.
    fn simd_ok(&self, w: usize) -> bool {
        let len = self.fmt.read_len(w);
        w > 0
            && w.is_multiple_of(8)
            && self
                .list
                .iter()
                .all(|p| p.n == 0 || p.bytes.len() >= (p.n - 1) * self.stride + len)
    }

    /// One past the last key offset of the pages.
    fn end(&self) -> usize {
        self.list.iter().map(|p| p.off + p.n).max().unwrap_or(0)
    }

    /// Record `j` of `page`.
    fn record<'b>(&self, page: &Page<'b>, j: usize) -> &'b [u8] {
        &page.bytes[j * self.stride..]
    }
}

/// True when AVX2, FMA and F16C are available (checked once).
pub(crate) fn has_simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            super::ops::has_avx2_fma() && std::arch::is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows handled by one SIMD call (their accumulators share the registers).
const MAX_ROWS: usize = 4;

/// `out[r·os + off + j] = scales[off + j] · ⟨q_r, x_j⟩` for the query rows
/// `q_r = q[r·w..(r + 1)·w]` (`w = q.len() / rows`) and record `j` of every page at `off`.
pub(crate) fn scores(
    pages: Pages<'_>,
    q: &[f32],
    rows: usize,
    scales: &[f32],
    out: &mut [f32],
    os: usize,
) {
    let (end, w) = (pages.end(), q.len() / rows.max(1));
    assert!(
        end <= scales.len() && (rows == 0 || out.len() >= (rows - 1) * os + end),
        "scores: scales or output too short"
    );
    #[cfg(target_arch = "x86_64")]
    if has_simd() && pages.simd_ok(w) {
        for r0 in (0..rows).step_by(MAX_ROWS) {
            let rr = (rows - r0).min(MAX_ROWS);
            // SAFETY: AVX2/FMA/F16C detected; w is a positive multiple of 8 and every chunk of
            // every page is readable (`simd_ok`); the q rows r0..r0 + rr hold rr·w floats;
            // every page ends within `scales`, and `out[r0·os..]` holds (rr − 1)·os + end
            // floats (asserted above).
            unsafe {
                super::direct_avx2::scores(
                    pages.fmt,
                    pages.stride,
                    pages.list,
                    &q[r0 * w..(r0 + rr) * w],
                    rr,
                    scales,
                    &mut out[r0 * os..],
                    os,
                )
            };
        }
        return;
    }
    scores_ref(pages, q, rows, scales, out, os);
}

/// Scalar reference of [`scores`].
pub(crate) fn scores_ref(
    pages: Pages<'_>,
    q: &[f32],
    rows: usize,
    scales: &[f32],
    out: &mut [f32],
    os: usize,
) {
    let w = q.len() / rows.max(1);
    for page in pages.list {
        for j in 0..page.n {
            let (x, k) = (pages.record(page, j), page.off + j);
            for r in 0..rows {
                let qr = &q[r * w..(r + 1) * w];
                let dot: f32 = qr
                    .iter()
                    .enumerate()
                    .map(|(i, &a)| a * pages.fmt.value(x, i))
                    .sum();
                out[r * os + k] = dot * scales[k];
            }
        }
    }
}

/// `acc[r·w..(r + 1)·w] += Σ weights[r·ws + off + j] · x_j` over record `j` of every page at
/// `off`, for the accumulator rows of `acc` (`w = acc.len() / rows`).
pub(crate) fn accumulate(
    pages: Pages<'_>,
    weights: &[f32],
    ws: usize,
    acc: &mut [f32],
    rows: usize,
) {
    let (end, w) = (pages.end(), acc.len() / rows.max(1));
    assert!(
        rows == 0 || weights.len() >= (rows - 1) * ws + end,
        "accumulate: weights too short"
    );
    #[cfg(target_arch = "x86_64")]
    if has_simd() && pages.simd_ok(w) {
        for r0 in (0..rows).step_by(MAX_ROWS) {
            let rr = (rows - r0).min(MAX_ROWS);
            // SAFETY: AVX2/FMA/F16C detected; w is a positive multiple of 8 and every chunk of
            // every page is readable (`simd_ok`); `acc[r0·w..]` holds rr·w floats;
            // `weights[r0·ws..]` holds (rr − 1)·ws + end floats (asserted above).
            unsafe {
                super::direct_avx2::accumulate(
                    pages.fmt,
                    pages.stride,
                    pages.list,
                    &weights[r0 * ws..],
                    ws,
                    &mut acc[r0 * w..(r0 + rr) * w],
                    rr,
                )
            };
        }
        return;
    }
    accumulate_ref(pages, weights, ws, acc, rows);
}

/// Scalar reference of [`accumulate`].
pub(crate) fn accumulate_ref(
    pages: Pages<'_>,
    weights: &[f32],
    ws: usize,
    acc: &mut [f32],
    rows: usize,
) {
    let w = acc.len() / rows.max(1);
    for page in pages.list {
        for j in 0..page.n {
            let (x, k) = (pages.record(page, j), page.off + j);
            for r in 0..rows {
                let p = weights[r * ws + k];
                for (i, a) in acc[r * w..(r + 1) * w].iter_mut().enumerate() {
                    *a += p * pages.fmt.value(x, i);
                }
            }
        }
    }
}

/// Hints the caches to fetch `bytes` (one prefetch per 64-byte line); no effect on results.
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for at in (0..bytes.len()).step_by(64) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch is a hint that never faults; the address lies inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(at).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// `out[j] = scale · f16(src[j·stride..][..2])` (the per-token scales of a page).
pub(crate) fn f16_scales(src: &[u8], stride: usize, scale: f32, out: &mut [f32]) {
    let n = out.len();
    assert!(
        n == 0 || src.len() >= (n - 1) * stride + 2,
        "f16_scales: source too short"
    );
    #[cfg(target_arch = "x86_64")]
    if has_simd() {
        // SAFETY: F16C detected; the length was asserted just above.
        unsafe { super::direct_avx2::f16_scales(src, stride, scale, out) };
        return;
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = half::f16::from_le_bytes([src[j * stride], src[j * stride + 1]]).to_f32() * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        fn byte(&mut self) -> u8 {
            (self.next().to_bits() >> 7) as u8
        }
    }

    fn formats(rng: &mut Rng) -> Vec<Fmt> {
        let mut f = vec![Fmt::Bf16, Fmt::F16, Fmt::Int8, Fmt::Fp8];
        for bits in 1..=4u8 {
            let mut table = [0f32; 16];
            for t in table.iter_mut().take(1 << bits) {
                *t = rng.next();
            }
            f.push(Fmt::Table { bits, table });
        }
        f
    }

    /// Random records: 16-bit formats get finite random values, codes get random bytes.
    fn records(fmt: Fmt, n: usize, stride: usize, w: usize, rng: &mut Rng) -> Vec<u8> {
        // Slack after the last record, as a block's padding and scalars give the loaders.
        let mut bytes: Vec<u8> = (0..n * stride + 4).map(|_| rng.byte()).collect();
        if fmt == Fmt::Fp8 {
            // No NaN codes: they would make every comparison fail (decoding them is checked
            // in `fp8_loader_decodes_every_code`).
            for b in bytes.iter_mut().filter(|b| **b & 0x7F == 0x7F) {
                *b ^= 1;
            }
        }
        if matches!(fmt, Fmt::Bf16 | Fmt::F16) {
            for j in 0..n {
                for i in 0..w {
                    let v = rng.next() * 3.0;
                    let b = if fmt == Fmt::Bf16 {
                        half::bf16::from_f32(v).to_le_bytes()
                    } else {
                        half::f16::from_f32(v).to_le_bytes()
                    };
                    bytes[j * stride + 2 * i..][..2].copy_from_slice(&b);
                }
            }
        }
        bytes
    }

    fn code_bytes(fmt: Fmt, w: usize) -> usize {
        match fmt {
            Fmt::Bf16 | Fmt::F16 => 2 * w,
            Fmt::Int8 | Fmt::Fp8 => w,
            Fmt::Table { bits, .. } => w * usize::from(bits) / 8,
        }
    }

    /// Agreement to f32 rounding of a sum of `w` terms up to `mag` in size (order differs).
    fn close(a: f32, b: f32, w: usize, mag: f32, what: &str) {
        let tol = 1e-6 * w as f32 * mag + 2e-6 * b.abs();
        assert!((a - b).abs() <= tol, "{what}: {a} vs reference {b}");
    }

    /// SIMD == scalar reference for every format, row count 1–9 (groups of 4 and a rest),
    /// head widths with odd chunk counts, record counts around the 2/4-token passes, padded
    /// strides, and one page or many ragged pages (more than the prefetch distance).
    #[test]
    fn direct_kernels_match_the_scalar_reference() {
        if !has_simd() {
            eprintln!("skipped: no AVX2/FMA/F16C on this CPU");
            return;
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for fmt in formats(&mut rng) {
            for w in [8, 24, 64, 128] {
                for n in [1, 2, 3, 5, 16, 17, 31] {
                    for rows in [1, 2, 3, 4, 5, 9] {
                        let stride = code_bytes(fmt, w) + if n % 2 == 0 { 0 } else { 6 };
                        let bytes = records(fmt, n, stride, w, &mut rng);
                        // One page of all n records, or pages of 1, 2, … records at their
                        // offsets (as a task's block table gives them).
                        let mut list = Vec::new();
                        let mut off = 0;
                        while off < n {
                            let len = if n % 2 == 0 {
                                n
                            } else {
                                (list.len() + 1).min(n - off)
                            };
                            list.push(Page {
                                bytes: &bytes[off * stride..],
                                n: len,
                                off,
                            });
                            off += len;
                        }
                        let pages = Pages {
                            fmt,
                            stride,
                            list: &list,
                        };
                        let what = format!("{fmt:?} w {w} n {n} rows {rows}");
                        // fp8 values are E4M3's over 2⁸: at most 1.75.
                        let mag = if fmt == Fmt::Int8 { 128.0 } else { 3.0 };
                        let q: Vec<f32> = (0..rows * w).map(|_| rng.next()).collect();
                        let scales: Vec<f32> = (0..n).map(|_| rng.next()).collect();
                        let os = n + 3;
                        let mut got = vec![f32::NAN; rows * os];
                        let mut want = got.clone();
                        scores(pages, &q, rows, &scales, &mut got, os);
                        scores_ref(pages, &q, rows, &scales, &mut want, os);
                        for r in 0..rows {
                            for j in 0..n {
                                close(got[r * os + j], want[r * os + j], w, mag, &what);
                            }
                        }
                        let ws = n + 1;
                        let p: Vec<f32> = (0..rows * ws).map(|_| rng.next()).collect();
                        let mut got: Vec<f32> = (0..rows * w).map(|_| rng.next()).collect();
                        let mut want = got.clone();
                        accumulate(pages, &p, ws, &mut got, rows);
                        accumulate_ref(pages, &p, ws, &mut want, rows);
                        for (g, e) in got.iter().zip(&want) {
                            close(*g, *e, n, mag, &what);
                        }
                    }
                }
            }
        }
    }

    /// The SIMD loader decodes all 256 E4M3 codes to `fp8::decode`'s values over the unit
    /// (NaN codes to NaN): a value sum with weight 1 into zeros is the decoded record itself.
    #[test]
    fn fp8_loader_decodes_every_code() {
        if !has_simd() {
            eprintln!("skipped: no AVX2/FMA/F16C on this CPU");
            return;
        }
        let rec: Vec<u8> = (0..=255u8).collect();
        let list = [Page {
            bytes: &rec,
            n: 1,
            off: 0,
        }];
        let pages = Pages {
            fmt: Fmt::Fp8,
            stride: 256,
            list: &list,
        };
        let mut acc = vec![0f32; 256];
        accumulate(pages, &[1.0], 1, &mut acc, 1);
        for (c, a) in acc.iter().enumerate() {
            let (a, want) = (a * Fmt::Fp8.unit(), turbokv_codec::fp8::decode(c as u8));
            assert!(
                a == want || (a.is_nan() && want.is_nan()),
                "code {c:#04x}: {a} vs {want}"
            );
        }
        let mut s = [0f32; 1];
        let q = vec![1f32; 256];
        scores(pages, &q, 1, &[1.0], &mut s, 1);
        assert!(s[0].is_nan(), "a NaN code makes the score NaN");
    }

    #[test]
    fn f16_scales_match_half() {
        let mut rng = Rng(7);
        for stride in [2, 4, 6] {
            for n in [0, 1, 7, 8, 9, 16, 19] {
                let src: Vec<u8> = (0..n * stride + 2)
                    .map(|_| rng.byte() & 0x7B) // keep exponents finite
                    .collect();
                let mut out = vec![0f32; n];
                f16_scales(&src, stride, 0.5, &mut out);
                for (j, o) in out.iter().enumerate() {
                    let h = half::f16::from_le_bytes([src[j * stride], src[j * stride + 1]]);
                    assert_eq!(*o, h.to_f32() * 0.5, "stride {stride} n {n} j {j}");
                }
            }
        }
    }
}
