//! Scores and value sums read straight from a page of the cache, for the formats whose working
//! coordinates decode independently with one scale per token: 16-bit values, `int8`, `fp8`, and
//! one run of TurboQuant MSE codes or QJL signs (see [`turbokv_codec::DirectCodes`]; a record of
//! several runs is several pages); a window's exact copies (already in the working basis) are
//! f16 pages too.
//!
//! A page is `n` token records `stride` bytes apart, and optionally their f16 scales
//! `scale_step` bytes apart. Token `j`'s working vector is `x_j = s_j · value(record_j)`
//! (`s_j = 1` for a page without scales); the kernels multiply by `s_j` and by the pages'
//! common factor `mul` (the softmax scale, and [`Fmt::unit`], which is 1 except for fp8, whose
//! values are E4M3's times 2⁻⁸: what the loader gets from the f16 conversion without a
//! multiply). The scales are read page by page beside the records, so they arrive with the
//! records' prefetch instead of costing a separate pass over the pages. Each function has a
//! plain scalar reference (`*_ref`) that the AVX2 twin (`direct_avx2`) is tested against.

use turbokv_codec::{DirectCodes, DirectKind};

use super::CodeProducts;

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
    /// else 1), which callers fold into [`Pages::mul`].
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

    /// Bytes of a record of `w` coordinates.
    fn record_len(self, w: usize) -> usize {
        match self {
            Fmt::Bf16 | Fmt::F16 => 2 * w,
            Fmt::Int8 | Fmt::Fp8 => w,
            Fmt::Table { bits, .. } => (w * usize::from(bits)).div_ceil(8),
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

/// Bytes of records the decode passes keep requested ahead of the page they read
/// ([`Pages::ahead`]). It was 4 pages whatever their size: 8 KiB of 16-bit records but only
/// 2 KiB of 4-bit codes, too little to cover the memory latency. On Zen 5, decode attention
/// over TurboQuant codes ran 10% faster at 16 pages (BENCHMARKS.md, session 40); 16-bit
/// records keep their 4 pages.
pub(crate) const PREFETCH_BYTES: usize = 8192;

/// `n` token records of one page, `stride` bytes apart from the start of `bytes` (the
/// stride is the task's), holding the keys `off..off + n` of a task.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Page<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) n: usize,
    pub(crate) off: usize,
    /// The records' f16 scales, [`Pages::scale_step`] bytes apart; empty when every scale
    /// is 1 (16-bit pages).
    pub(crate) scales: &'a [u8],
}

/// The pages of one task in one format.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pages<'a> {
    pub(crate) fmt: Fmt,
    pub(crate) stride: usize,
    /// Bytes between two records' scales.
    pub(crate) scale_step: usize,
    /// The factor every record shares (softmax scale, [`Fmt::unit`]).
    pub(crate) mul: f32,
    pub(crate) list: &'a [Page<'a>],
    /// Bytes the task reads in a later pass (a window's values, beside its keys' pages), or
    /// none: the 16-bit score passes request them over their first pages, so they arrive
    /// while the scores are computed instead of stalling the value pass.
    pub(crate) next: &'a [&'a [u8]],
}

impl Pages<'_> {
    /// How many pages ahead of the one being read the passes request from memory: about
    /// [`PREFETCH_BYTES`] of records (the hardware prefetchers do not follow a block table),
    /// 1 to 16 pages. A page of 16 keys of 4-bit codes at head_dim 64 is 512 bytes, one of
    /// 16-bit records 2 KiB.
    pub(crate) fn ahead(&self) -> usize {
        let n = self.list.iter().take(2).map(|p| p.n).max().unwrap_or(1);
        (PREFETCH_BYTES / (n * self.stride).max(1)).clamp(1, 16)
    }

    /// Whether every page holds its `n` records of `w` coordinates and their scales (panics
    /// otherwise: a caller's bug), and whether the SIMD loaders may read every chunk of them.
    fn check(&self, w: usize) -> bool {
        let len = self.fmt.read_len(w);
        let mut simd = w > 0 && w.is_multiple_of(8);
        for p in self.list.iter().filter(|p| p.n > 0) {
            let last = (p.n - 1) * self.stride;
            assert!(
                p.bytes.len() >= last + self.fmt.record_len(w)
                    && (p.scales.is_empty() || p.scales.len() >= (p.n - 1) * self.scale_step + 2),
                "direct kernels: a page is shorter than its records"
            );
            simd &= p.bytes.len() >= last + len;
        }
        simd
    }

    /// `s_j · mul` for record `j` of `page`.
    fn scale(&self, page: &Page<'_>, j: usize) -> f32 {
        if page.scales.is_empty() {
            return self.mul;
        }
        let at = j * self.scale_step;
        half::f16::from_le_bytes([page.scales[at], page.scales[at + 1]]).to_f32() * self.mul
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

/// Requests the first pages of `pages`, which the passes' own look-ahead never does (it runs
/// a few pages ahead of the page being read, from the first page on): issued when a task's
/// pages are known, they arrive before its passes start instead of one by one as each
/// begins, which cost every task several round trips to memory.
pub(crate) fn prefetch_start(pages: &Pages<'_>) {
    #[cfg(target_arch = "x86_64")]
    if has_simd() {
        for page in pages.list.iter().take(pages.ahead()) {
            // SAFETY: AVX2/FMA/F16C detected.
            unsafe { super::direct_avx2::prefetch(page, pages) };
        }
    }
}

/// Rows handled by one SIMD call (their accumulators share the registers).
const MAX_ROWS: usize = 4;

/// `out[r·os + off + j] = mul · s_j · ⟨q_r, x_j⟩` for the query rows
/// `q_r = q[r·w..(r + 1)·w]` (`w = q.len() / rows`) and record `j` of every page at `off`.
///
/// Table codes and int8 records are scored through int8 products where the CPU has AVX-512
/// VBMI and VNNI (`direct_vnni`: the query rows and the codebook rounded to 8 bits, within a
/// bound the tests check; int8 records are their own codebook, so only the query rows round)
/// when `products` is `Int8`; 16-bit records of a width that is a multiple of 16
/// through AVX-512 FMAs where the CPU has them (`direct_avx512`); everything else through
/// AVX2 FMAs on decoded f32 coordinates (or the scalar reference).
pub(crate) fn scores(
    pages: Pages<'_>,
    q: &[f32],
    rows: usize,
    out: &mut [f32],
    os: usize,
    products: CodeProducts,
) {
    let (end, w) = (pages.end(), q.len() / rows.max(1));
    assert!(
        rows == 0 || out.len() >= (rows - 1) * os + end,
        "scores: output too short"
    );
    let simd = pages.check(w);
    #[cfg(target_arch = "x86_64")]
    if simd
        && products == CodeProducts::Int8
        && w <= super::direct_vnni::MAX_W
        && super::direct_vnni::available()
        && let Some((bits, book)) = match pages.fmt {
            Fmt::Table { bits, table } => {
                super::direct_vnni::Codebook::new(bits, &table).map(|book| (bits, book))
            }
            Fmt::Int8 => Some((8, super::direct_vnni::Codebook::int8())),
            _ => None,
        }
    {
        let max = super::direct_vnni::MAX_ROWS;
        for r0 in (0..rows).step_by(max) {
            let rr = (rows - r0).min(max);
            let qi = super::direct_vnni::Query::new(&q[r0 * w..(r0 + rr) * w], rr, w, &book);
            // SAFETY: AVX-512 VBMI/VNNI and AVX2 detected; the table's width is `bits`
            // (1..=4: the codec's tables), or 8 for int8 records with the identity book; w is
            // a positive multiple of 8 and at most MAX_W; every page's records and scales are
            // readable (`check`); `out[r0·os..]` holds (rr − 1)·os + end floats (asserted
            // above).
            unsafe {
                super::direct_vnni::scores(pages, bits, &book, &qi, w, &mut out[r0 * os..], os)
            };
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_simd() && simd {
        // 16-bit and int8 records 16 lanes wide where the CPU has AVX-512, else the AVX2
        // passes.
        let wide = super::direct_avx512::takes(pages.fmt, w);
        for r0 in (0..rows).step_by(MAX_ROWS) {
            let rr = (rows - r0).min(MAX_ROWS);
            let (qr, or) = (&q[r0 * w..(r0 + rr) * w], &mut out[r0 * os..]);
            // SAFETY: AVX2/FMA/F16C detected (and, for the AVX-512 pass, `takes` checked the
            // CPU, the format and that w is a multiple of 16); w is a positive multiple of 8,
            // every chunk of every page's records and every scale is readable (`check`); the
            // q rows r0..r0 + rr hold rr·w floats; `out[r0·os..]` holds (rr − 1)·os + end
            // floats (asserted above).
            unsafe {
                if wide {
                    super::direct_avx512::scores(pages, qr, rr, or, os)
                } else {
                    super::direct_avx2::scores(pages, qr, rr, or, os)
                }
            };
        }
        return;
    }
    scores_ref(pages, q, rows, out, os);
}

/// Scalar reference of [`scores`].
pub(crate) fn scores_ref(pages: Pages<'_>, q: &[f32], rows: usize, out: &mut [f32], os: usize) {
    let w = q.len() / rows.max(1);
    for page in pages.list {
        for j in 0..page.n {
            let (x, k, s) = (pages.record(page, j), page.off + j, pages.scale(page, j));
            for r in 0..rows {
                let qr = &q[r * w..(r + 1) * w];
                let dot: f32 = qr
                    .iter()
                    .enumerate()
                    .map(|(i, &a)| a * pages.fmt.value(x, i))
                    .sum();
                out[r * os + k] = dot * s;
            }
        }
    }
}

/// `acc[r·w..(r + 1)·w] += Σ weights[r·ws + off + j] · mul · s_j · x_j` over record `j` of
/// every page at `off`, for the accumulator rows of `acc` (`w = acc.len() / rows`).
///
/// Table codes are summed through int8 products where the CPU has AVX-512 VBMI and VNNI
/// (`direct_vnni_values`: the weights rounded to 8 bits per run of keys, the codebook to 8
/// bits, within a bound the tests check) when `products` is `Int8`; everything else in f32.
pub(crate) fn accumulate(
    pages: Pages<'_>,
    weights: &[f32],
    ws: usize,
    acc: &mut [f32],
    rows: usize,
    products: CodeProducts,
) {
    let (end, w) = (pages.end(), acc.len() / rows.max(1));
    assert!(
        rows == 0 || weights.len() >= (rows - 1) * ws + end,
        "accumulate: weights too short"
    );
    let simd = pages.check(w);
    #[cfg(target_arch = "x86_64")]
    if simd
        && products == CodeProducts::Int8
        && let Fmt::Table { bits, table } = pages.fmt
        && w <= super::direct_vnni::MAX_W
        && super::direct_vnni::available()
        && let Some(book) = super::direct_vnni::Codebook::signed(bits, &table)
    {
        let max = super::direct_vnni::MAX_ROWS;
        for r0 in (0..rows).step_by(max) {
            let rr = (rows - r0).min(max);
            let (wt, out) = (&weights[r0 * ws..], &mut acc[r0 * w..(r0 + rr) * w]);
            // SAFETY: AVX-512 VBMI/VNNI and AVX2 detected; the table's width is `bits`
            // (1..=4: the codec's tables) and `book` its signed codebook; w is a positive
            // multiple of 8 and at most MAX_W; every page's records, the bytes the f32 pass
            // reads past them, and its scales are readable (`check`); `out` holds rr·w floats;
            // `wt` holds (rr − 1)·ws + end floats (asserted above).
            unsafe {
                super::direct_vnni_values::accumulate(pages, bits, &table, &book, wt, ws, out, rr)
            };
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_simd() && simd {
        // 16-bit and int8 records 16 lanes wide where the CPU has AVX-512, else the AVX2 loop; both
        // take up to MAX_ROWS accumulator rows per call.
        let wide = super::direct_avx512::takes(pages.fmt, w);
        for r0 in (0..rows).step_by(MAX_ROWS) {
            let rr = (rows - r0).min(MAX_ROWS);
            let (wt, out) = (&weights[r0 * ws..], &mut acc[r0 * w..(r0 + rr) * w]);
            // SAFETY: AVX2/FMA/F16C detected (and, for the AVX-512 pass, `takes` checked the
            // CPU, the format and that w is a multiple of 16); w is a positive multiple of 8;
            // every chunk of every page's records and every scale is readable (`check`); `out`
            // holds rr·w floats; `wt` holds (rr − 1)·ws + end floats (asserted above).
            unsafe {
                if wide {
                    super::direct_avx512::accumulate(pages, wt, ws, out, rr)
                } else {
                    super::direct_avx2::accumulate(pages, wt, ws, out, rr)
                }
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
            let (x, k, s) = (pages.record(page, j), page.off + j, pages.scale(page, j));
            for r in 0..rows {
                let p = weights[r * ws + k] * s;
                for (i, a) in acc[r * w..(r + 1) * w].iter_mut().enumerate() {
                    *a += p * pages.fmt.value(x, i);
                }
            }
        }
    }
}

/// `out[(off + j)·os + i] = mul · s_j · x_j[i]` for `i < w`: record `j` of every page at
/// `off` decoded into rows `os` floats apart (the tiled path's tile of working vectors).
pub(crate) fn decode_rows(pages: Pages<'_>, w: usize, out: &mut [f32], os: usize) {
    let end = pages.end();
    assert!(
        end == 0 || out.len() >= (end - 1) * os + w,
        "decode_rows: output too short"
    );
    let simd = pages.check(w);
    #[cfg(target_arch = "x86_64")]
    if has_simd() && simd {
        // SAFETY: AVX2/FMA/F16C detected; w is a positive multiple of 8, every chunk of every
        // page's records and every scale is readable (`check`); `out` holds
        // (end − 1)·os + w floats (asserted above).
        unsafe { super::direct_avx2::decode_rows(pages, w, out, os) };
        return;
    }
    decode_rows_ref(pages, w, out, os);
}

/// Scalar reference of [`decode_rows`].
pub(crate) fn decode_rows_ref(pages: Pages<'_>, w: usize, out: &mut [f32], os: usize) {
    for page in pages.list {
        for j in 0..page.n {
            let (x, k, s) = (pages.record(page, j), page.off + j, pages.scale(page, j));
            for (i, o) in out[k * os..k * os + w].iter_mut().enumerate() {
                *o = pages.fmt.value(x, i) * s;
            }
        }
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

    /// Pages of `n` records `stride` bytes apart (scales `scale_step` apart), page `i` holding
    /// `len(i)` records (fewer at the end), each at its offset as a task's block table gives
    /// them.
    fn ragged_pages<'a>(
        bytes: &'a [u8],
        scales: &'a [u8],
        n: usize,
        stride: usize,
        scale_step: usize,
        len: impl Fn(usize) -> usize,
    ) -> Vec<Page<'a>> {
        let mut list = Vec::new();
        let mut off = 0;
        while off < n {
            let len = len(list.len()).min(n - off);
            list.push(Page {
                bytes: &bytes[off * stride..],
                n: len,
                off,
                scales: &scales[off * scale_step..],
            });
            off += len;
        }
        list
    }

    /// Agreement to f32 rounding of a sum of `w` terms up to `mag` in size (order differs).
    fn close(a: f32, b: f32, w: usize, mag: f32, what: &str) {
        let tol = 1e-6 * w as f32 * mag + 2e-6 * b.abs();
        assert!((a - b).abs() <= tol, "{what}: {a} vs reference {b}");
    }

    /// SIMD == scalar reference (f32 scores, value sums, tile fill) for every format, row count
    /// 1–9 (groups of 4 and a rest), head widths with odd chunk counts, record counts around
    /// the 2/4-token passes, padded strides, and one page or many ragged pages (more than the
    /// prefetch distance).
    #[test]
    fn direct_kernels_match_the_scalar_reference() {
        if !has_simd() {
            eprintln!("skipped: no AVX2/FMA/F16C on this CPU");
            return;
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for fmt in formats(&mut rng) {
            for w in [8, 24, 48, 64, 80, 128] {
                for n in [1, 2, 3, 5, 16, 17, 31, 70] {
                    for rows in [1, 2, 3, 4, 5, 9] {
                        let stride = fmt.record_len(w) + if n % 2 == 0 { 0 } else { 6 };
                        let bytes = records(fmt, n, stride, w, &mut rng);
                        // Scales packed (step 2), interleaved with another scalar (step 4),
                        // or none.
                        let scale_step = [0, 2, 4][(n + rows) % 3];
                        let mut scale_bytes = vec![0u8; n * scale_step];
                        for s in scale_bytes.chunks_exact_mut(scale_step.max(1)).take(n) {
                            let h = half::f16::from_f32(rng.next()).to_le_bytes();
                            s[..2].copy_from_slice(&h);
                        }
                        // One page of all n records, or pages of 1, 2, … records at their
                        // offsets (as a task's block table gives them).
                        let list = ragged_pages(&bytes, &scale_bytes, n, stride, scale_step, |i| {
                            if n % 2 == 0 { n } else { i + 1 }
                        });
                        let pages = Pages {
                            fmt,
                            stride,
                            scale_step,
                            mul: 0.75,
                            list: &list,
                            next: &[],
                        };
                        let what = format!("{fmt:?} w {w} n {n} rows {rows} step {scale_step}");
                        // fp8 values are E4M3's over 2⁸: at most 1.75.
                        let mag = if fmt == Fmt::Int8 { 128.0 } else { 3.0 };
                        let q: Vec<f32> = (0..rows * w).map(|_| rng.next()).collect();
                        let os = n + 3;
                        let mut got = vec![f32::NAN; rows * os];
                        let mut want = got.clone();
                        scores(pages, &q, rows, &mut got, os, CodeProducts::F32);
                        scores_ref(pages, &q, rows, &mut want, os);
                        for r in 0..rows {
                            for j in 0..n {
                                close(got[r * os + j], want[r * os + j], w, mag, &what);
                            }
                        }
                        let ws = n + 1;
                        let p: Vec<f32> = (0..rows * ws).map(|_| rng.next()).collect();
                        let mut got: Vec<f32> = (0..rows * w).map(|_| rng.next()).collect();
                        let mut want = got.clone();
                        accumulate(pages, &p, ws, &mut got, rows, CodeProducts::F32);
                        accumulate_ref(pages, &p, ws, &mut want, rows);
                        for (g, e) in got.iter().zip(&want) {
                            close(*g, *e, n, mag, &what);
                        }
                        // The tile fill: the same products, so equal to the bit; the rows'
                        // padding untouched.
                        let os = w + 5;
                        let mut got = vec![f32::NAN; n * os];
                        let mut want = got.clone();
                        decode_rows(pages, w, &mut got, os);
                        decode_rows_ref(pages, w, &mut want, os);
                        for (j, (g, e)) in got.chunks(os).zip(want.chunks(os)).enumerate() {
                            assert_eq!(g[..w], e[..w], "{what}: decoded record {j}");
                            assert!(g[w..].iter().all(|x| x.is_nan()), "{what}: padding");
                        }
                    }
                }
            }
        }
    }

    /// A random table-code case of the integer tests: its pages, the code width, the table's
    /// largest magnitude, the record width, the key count and the row count.
    struct TableCase<'a> {
        pages: Pages<'a>,
        bits: u8,
        tmax: f32,
        w: usize,
        n: usize,
        rows: usize,
    }

    /// Runs `check` on random 1–4-bit table codes: widths with a partial last 64-code chunk,
    /// 1–9 rows, packed records (stride = record) for some counts and padded ones for the
    /// others, f16 scales or none, ragged pages (1, 8, 15, … keys) at their offsets.
    fn for_each_table_case(rng: &mut Rng, mut check: impl FnMut(&mut Rng, TableCase<'_>)) {
        for bits in 1..=4u8 {
            let mut table = [0f32; 16];
            for t in table.iter_mut().take(1 << bits) {
                *t = rng.next() * 2.0;
            }
            let fmt = Fmt::Table { bits, table };
            let tmax = table.iter().fold(0f32, |m, t| m.max(t.abs()));
            for w in [8, 24, 64, 72, 128, 200, 256] {
                for (n, rows) in [(1, 1), (5, 3), (16, 2), (37, 4), (70, 9), (200, 3)] {
                    let stride = fmt.record_len(w) + (n + w) % 3;
                    let bytes = records(fmt, n, stride, w, rng);
                    let scale_step = [0, 2][n % 2];
                    let mut scale_bytes = vec![0u8; n * scale_step];
                    for s in scale_bytes.chunks_exact_mut(2) {
                        let v = rng.next().abs() + 0.01;
                        s.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                    }
                    let list =
                        ragged_pages(&bytes, &scale_bytes, n, stride, scale_step, |i| 7 * i + 1);
                    let pages = Pages {
                        fmt,
                        stride,
                        scale_step,
                        mul: 0.6,
                        list: &list,
                        next: &[],
                    };
                    check(
                        rng,
                        TableCase {
                            pages,
                            bits,
                            tmax,
                            w,
                            n,
                            rows,
                        },
                    );
                }
            }
        }
    }

    /// True, after saying so, when the CPU lacks the integer kernels' AVX-512 VBMI/VNNI (the
    /// integer tests then have nothing to check).
    fn skipped_without_vnni() -> bool {
        #[cfg(target_arch = "x86_64")]
        let missing = !super::super::direct_vnni::available();
        #[cfg(not(target_arch = "x86_64"))]
        let missing = true;
        if missing {
            eprintln!("skipped: no AVX-512 VBMI/VNNI on this CPU");
        }
        missing
    }

    /// Scores `pages` through int8 products for `rows` random query rows of `w` (of different
    /// sizes, one of them zero) and asserts each within `mul·|s_j|·((Δq/2)·Σ|x_i| +
    /// (dt/2)·Σ(|q_ri| + Δq/2))` of the f32 reference (`Δq = max|q_r| / 127`, `dt` the table's
    /// step; plus f32 rounding, scaled by `xmax`, the largest record value), and the outputs
    /// past the keys untouched. Returns the squared errors and reference scores, summed.
    #[allow(clippy::too_many_arguments)]
    fn check_integer_scores(
        rng: &mut Rng,
        pages: Pages<'_>,
        w: usize,
        n: usize,
        rows: usize,
        dt: f32,
        xmax: f32,
        what: &str,
    ) -> (f64, f64) {
        let mut q: Vec<f32> = (0..rows * w)
            .map(|i| rng.next() * (1 + i / w) as f32)
            .collect();
        if rows > 2 {
            q[w..2 * w].fill(0.0);
        }
        let os = n + 2;
        let mut got = vec![f32::NAN; rows * os];
        let mut want = got.clone();
        scores(pages, &q, rows, &mut got, os, CodeProducts::Int8);
        scores_ref(pages, &q, rows, &mut want, os);
        let (mut err2, mut ref2) = (0f64, 0f64);
        for r in 0..rows {
            let qr = &q[r * w..(r + 1) * w];
            let dq = qr.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            let qabs: f32 = qr.iter().map(|x| x.abs() + dq / 2.0).sum();
            for pg in pages.list {
                for j in 0..pg.n {
                    let k = pg.off + j;
                    let xabs: f32 = (0..w)
                        .map(|i| pages.fmt.value(pages.record(pg, j), i).abs())
                        .sum();
                    let s = pages.scale(pg, j).abs();
                    let (g, e) = (got[r * os + k], want[r * os + k]);
                    let bound = s * (dq / 2.0 * xabs + dt / 2.0 * qabs)
                        + 1e-5 * s * w as f32 * dq * 127.0 * xmax;
                    assert!(
                        (g - e).abs() <= bound,
                        "{what} row {r} key {k}: {g} vs {e}, bound {bound}"
                    );
                    err2 += f64::from(g - e).powi(2);
                    ref2 += f64::from(e).powi(2);
                }
            }
            assert!(got[r * os + n..(r + 1) * os].iter().all(|x| x.is_nan()));
        }
        (err2, ref2)
    }

    /// Integer scores of table codes stay within the bound of their two roundings: with
    /// `Δq = max|q_r| / 127` and `Δt = max|t| / 127`, a score moves from the exact one by at
    /// most `mul·|s_j|·((Δq/2)·Σ|t(c_i)| + (Δt/2)·Σ(|q_ri| + Δq/2))` (plus f32 rounding),
    /// and over all keys by under 1% RMS. Widths that are not a multiple of 64 (a partial last
    /// chunk), 1–9 rows, ragged pages, scales or none.
    #[test]
    fn integer_scores_stay_within_their_rounding_bound() {
        if skipped_without_vnni() {
            return;
        }
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        let (mut err2, mut ref2) = (0f64, 0f64);
        for_each_table_case(&mut rng, |rng, c| {
            let what = format!("bits {} w {} n {}", c.bits, c.w, c.n);
            let (e, r) = check_integer_scores(
                rng,
                c.pages,
                c.w,
                c.n,
                c.rows,
                c.tmax / 127.0,
                c.tmax,
                &what,
            );
            err2 += e;
            ref2 += r;
        });
        let rel = (err2 / ref2).sqrt();
        assert!(rel < 0.01, "integer scores: {rel:.2e} relative RMS error");
    }

    /// Integer scores of int8 records (a window's `q8` copies, an `int8` pool) round only the
    /// query rows: with `Δq = max|q_r| / 127` a score moves from the exact one by at most
    /// `mul·|s_j|·(Δq/2)·Σ|x_i|` (plus f32 rounding), and over all keys by under 1% RMS.
    /// Every byte value (−128 too), widths with a partial last 64-byte chunk, 1–9 rows, ragged
    /// pages, padded records, scales or none.
    #[test]
    fn integer_scores_of_int8_records_round_only_the_queries() {
        if skipped_without_vnni() {
            return;
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut err2, mut ref2) = (0f64, 0f64);
        let fmt = Fmt::Int8;
        for w in [8, 24, 64, 72, 128, 200, 256] {
            for (n, rows) in [(1, 1), (5, 3), (16, 2), (37, 4), (70, 9), (200, 3)] {
                let stride = w + (n + w) % 3;
                let bytes = records(fmt, n, stride, w, &mut rng);
                let scale_step = [0, 2][n % 2];
                let mut scale_bytes = vec![0u8; n * scale_step];
                for s in scale_bytes.chunks_exact_mut(2) {
                    let v = rng.next().abs() * 0.05 + 1e-3;
                    s.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
                let list = ragged_pages(&bytes, &scale_bytes, n, stride, scale_step, |i| 5 * i + 3);
                let pages = Pages {
                    fmt,
                    stride,
                    scale_step,
                    mul: 0.6,
                    list: &list,
                    next: &[],
                };
                // Int8 records are their own codebook: no table step, only the queries' rounding.
                let what = format!("int8 w {w} n {n}");
                let (e, r) = check_integer_scores(&mut rng, pages, w, n, rows, 0.0, 128.0, &what);
                err2 += e;
                ref2 += r;
            }
        }
        let rel = (err2 / ref2).sqrt();
        assert!(
            rel < 0.01,
            "integer scores of int8 records: {rel:.2e} relative RMS error"
        );
    }

    /// Integer value sums of table codes stay within the bound of their two roundings: with
    /// `Δw` a span's weight step (`max_j w_j / 255` over its keys, spans of 64 keys in page
    /// order) and `Δt = max|t| / 127`, coordinate `i` moves from the f32 sum by at most
    /// `Σ_j (w_j·Δt/2 + |t(c_ji)|·Δw/2 + Δw·Δt/4)` (`w_j` the weight times `mul · s_j`),
    /// and over all coordinates by under 1% RMS. Rows 1–9, widths with a partial last chunk,
    /// ragged pages, scales or none, weights spread over many orders of magnitude (as softmax
    /// numerators are). Negative weights take the f32 pass: equal to the reference to f32
    /// rounding.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn integer_value_sums_stay_within_their_rounding_bound() {
        use super::super::direct_vnni_values::SPAN;
        if skipped_without_vnni() {
            return;
        }
        let mut rng = Rng(0x5851_F42D_4C95_7F2D);
        let (mut err2, mut ref2) = (0f64, 0f64);
        for_each_table_case(&mut rng, |rng, c| {
            let (pages, fmt, bits, w, n, rows) = (c.pages, c.pages.fmt, c.bits, c.w, c.n, c.rows);
            let dt = c.tmax / 127.0;
            let ws = n + 1;
            // exp(−8…0): the spread of softmax numerators, and some exact zeros.
            let p: Vec<f32> = (0..rows * ws)
                .map(|i| {
                    if i % 11 == 3 {
                        0.0
                    } else {
                        (8.0 * (rng.next() - 1.0) / 2.0).exp()
                    }
                })
                .collect();
            let init: Vec<f32> = (0..rows * w).map(|_| rng.next()).collect();
            let (mut got, mut want) = (init.clone(), init.clone());
            accumulate(pages, &p, ws, &mut got, rows, CodeProducts::Int8);
            accumulate_ref(pages, &p, ws, &mut want, rows);
            // The bound, span by span as the kernel rounds: SPAN keys in page order.
            let keys: Vec<(&Page<'_>, usize)> = pages
                .list
                .iter()
                .flat_map(|pg| (0..pg.n).map(move |j| (pg, j)))
                .collect();
            let mut bound = vec![0f32; rows * w];
            for r in 0..rows {
                let wt =
                    |&(pg, j): &(&Page<'_>, usize)| p[r * ws + pg.off + j] * pages.scale(pg, j);
                for span in keys.chunks(SPAN) {
                    let dw = span.iter().map(wt).fold(0f32, f32::max) / 255.0;
                    for key in span {
                        let rec = pages.record(key.0, key.1);
                        for (i, b) in bound[r * w..][..w].iter_mut().enumerate() {
                            let t = fmt.value(rec, i).abs();
                            *b += wt(key) * dt / 2.0 + t * dw / 2.0 + dw * dt / 4.0;
                        }
                    }
                }
            }
            for (k, ((g, e), b)) in got.iter().zip(&want).zip(&bound).enumerate() {
                let b = b * 1.0001 + 1e-5 * (1.0 + e.abs());
                assert!(
                    (g - e).abs() <= b,
                    "bits {bits} w {w} n {n} rows {rows} coordinate {k}: {g} vs {e}, \
                             bound {b}"
                );
            }
            for ((g, e), i) in got.iter().zip(&want).zip(&init) {
                err2 += f64::from(g - e).powi(2);
                ref2 += f64::from(e - i).powi(2);
            }
            // Negative weights send their runs through the f32 pass: row 0, all
            // negative, equals the reference to f32 rounding.
            let mut neg = p.clone();
            neg[..n].iter_mut().for_each(|x| *x = -*x);
            let (mut got, mut want) = (init.clone(), init.clone());
            accumulate(pages, &neg, ws, &mut got, rows, CodeProducts::Int8);
            accumulate_ref(pages, &neg, ws, &mut want, rows);
            for (g, e) in got[..w].iter().zip(&want) {
                close(*g, *e, n, 3.0, "negative weights");
            }
        });
        let rel = (err2 / ref2).sqrt();
        assert!(
            rel < 0.01,
            "integer value sums: {rel:.2e} relative RMS error"
        );
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
            scales: &[],
        }];
        let pages = Pages {
            fmt: Fmt::Fp8,
            stride: 256,
            scale_step: 0,
            mul: 1.0,
            list: &list,
            next: &[],
        };
        let mut acc = vec![0f32; 256];
        accumulate(pages, &[1.0], 1, &mut acc, 1, CodeProducts::F32);
        for (c, a) in acc.iter().enumerate() {
            let (a, want) = (a * Fmt::Fp8.unit(), turbokv_codec::fp8::decode(c as u8));
            assert!(
                a == want || (a.is_nan() && want.is_nan()),
                "code {c:#04x}: {a} vs {want}"
            );
        }
        let mut s = [0f32; 1];
        let q = vec![1f32; 256];
        scores(pages, &q, 1, &mut s, 1, CodeProducts::F32);
        assert!(s[0].is_nan(), "a NaN code makes the score NaN");
    }
}
