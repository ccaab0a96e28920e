//! AVX2 (+FMA, F16C) kernels for F32/F16/BF16 weight rows against f32 token vectors, and the
//! F16/BF16 widening that `dequantize_row` uses.
//!
//! **One summation order per output element, whatever the batch.** Every `row · x` is
//! summed the same way: two 8-lane accumulators, the first over columns `16j..16j+8`, the
//! second over `16j+8..16j+16` (a trailing 8 into the first), each by FMA in column order;
//! then `hsum(acc0 + acc1)`; then the last `cols % 8` products added one by one. Only how
//! many rows and tokens share a pass over the columns changes with the batch (a tile of one
//! row × up to 4 tokens, or 2 rows × 3 tokens, so that each loaded weight vector serves
//! several tokens and each token vector several rows), never the arithmetic of one element:
//! a token's outputs are bit-for-bit the same alone or in a batch of any size. (An outside
//! GEMM, whose blocking depends on the matrix sizes, cannot promise that.)
//!
//! Tiles are computed in two half-steps of 8 columns, each loading only its own half of the
//! weights, so that the 2 × 3 tile's 12 accumulators, 2 weight vectors and 1 token vector fit
//! the 16 AVX2 registers.

/// Widens F16 or BF16 bytes (`src`, 2 per value) into `dst` with F16C/AVX2 when the CPU has
/// them (exact, like the scalar conversion); returns false, writing nothing, otherwise.
/// Per-element `half` conversion costs ~3 ns here, which made F16 prefill widening dominate.
pub(crate) fn widen_half(bf16: bool, src: &[u8], dst: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if super::dot_avx2::available() {
        // SAFETY: `available()` checked the CPU features.
        unsafe { imp::widen_half(bf16, src, dst) };
        return true;
    }
    let _ = (bf16, src, dst);
    false
}

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::rows_float;

#[cfg(not(target_arch = "x86_64"))]
/// Never called: `dot_avx2::available` is false off x86-64.
pub(crate) unsafe fn rows_float(
    _: super::GgmlType,
    _: &[u8],
    _: usize,
    _: &[f32],
    _: usize,
    _: &mut [f32],
) {
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use crate::quant::GgmlType;
    use crate::quant::dot_avx2::hsum;
    use std::arch::x86_64::*;

    /// How a float weight format widens 8 elements to f32.
    trait Floats {
        /// Bytes per element.
        const BYTES: usize;
        /// Eight elements at `p` as f32.
        ///
        /// # Safety
        /// `p` points at `8·BYTES` readable bytes; the CPU has AVX2 and F16C.
        unsafe fn load8(p: *const u8) -> __m256;
        /// One element from its bytes.
        fn one(b: &[u8]) -> f32;
    }
    struct F32;
    struct F16;
    struct Bf16;
    // SAFETY (all `load8`s): reads exactly the `8·BYTES` bytes the caller guarantees.
    impl Floats for F32 {
        const BYTES: usize = 4;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            unsafe { _mm256_loadu_ps(p.cast()) }
        }
        fn one(b: &[u8]) -> f32 {
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
    }
    impl Floats for F16 {
        const BYTES: usize = 2;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
        fn one(b: &[u8]) -> f32 {
            half::f16::from_le_bytes([b[0], b[1]]).to_f32()
        }
    }
    impl Floats for Bf16 {
        const BYTES: usize = 2;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            // bf16 is the top half of an f32: widen to u32 and shift into place.
            unsafe {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p.cast()),
                )))
            }
        }
        fn one(b: &[u8]) -> f32 {
            half::bf16::from_le_bytes([b[0], b[1]]).to_f32()
        }
    }

    /// `acc[r][t] += w_r[c..c+8] · x_t[c..c+8]` lane-wise, for one 8-column half-step.
    ///
    /// # Safety
    /// Each `rows[r]` points at `(c+8)·BYTES` readable bytes and each `xs[t]` at `c+8` floats;
    /// the CPU has AVX2, FMA and F16C (always inlined into the `target_feature` tile).
    #[inline(always)]
    unsafe fn half_step<F: Floats, const MR: usize, const NT: usize>(
        rows: &[*const u8; MR],
        xs: &[*const f32; NT],
        c: usize,
        acc: &mut [[__m256; NT]; MR],
    ) {
        // SAFETY: reads and CPU features per this function's contract.
        unsafe {
            let mut w = [_mm256_setzero_ps(); MR];
            for r in 0..MR {
                w[r] = F::load8(rows[r].add(c * F::BYTES));
            }
            for t in 0..NT {
                let x = _mm256_loadu_ps(xs[t].add(c));
                for r in 0..MR {
                    acc[r][t] = _mm256_fmadd_ps(w[r], x, acc[r][t]);
                }
            }
        }
    }

    /// `MR` weight rows of `cols` elements against `NT` token vectors, each element summed
    /// in the order of this file's header.
    ///
    /// # Safety
    /// Each `rows[r]` points at `cols·BYTES` readable bytes and each `xs[t]` at `cols` floats;
    /// the CPU has AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<F: Floats, const MR: usize, const NT: usize>(
        rows: [*const u8; MR],
        cols: usize,
        xs: [*const f32; NT],
    ) -> [[f32; NT]; MR] {
        let mut acc0 = [[_mm256_setzero_ps(); NT]; MR];
        let mut acc1 = [[_mm256_setzero_ps(); NT]; MR];
        let mut c = 0;
        // SAFETY (half-steps): `c + 16 <= cols` / `c + 8 <= cols` keep every read in bounds.
        while c + 16 <= cols {
            unsafe {
                half_step::<F, MR, NT>(&rows, &xs, c, &mut acc0);
                half_step::<F, MR, NT>(&rows, &xs, c + 8, &mut acc1);
            }
            c += 16;
        }
        if c + 8 <= cols {
            unsafe { half_step::<F, MR, NT>(&rows, &xs, c, &mut acc0) };
            c += 8;
        }
        let mut sums = [[0f32; NT]; MR];
        for r in 0..MR {
            for t in 0..NT {
                sums[r][t] = hsum(_mm256_add_ps(acc0[r][t], acc1[r][t]));
            }
        }
        for k in c..cols {
            for r in 0..MR {
                // SAFETY: `k < cols`, so the element's bytes and the token's float exist.
                let w = F::one(unsafe {
                    std::slice::from_raw_parts(rows[r].add(k * F::BYTES), F::BYTES)
                });
                for t in 0..NT {
                    sums[r][t] += w * unsafe { *xs[t].add(k) };
                }
            }
        }
        sums
    }

    /// Tokens `t0..t0+NT` against every row of the chunk, `MR` rows per tile (the last few
    /// rows one per tile).
    ///
    /// # Safety
    /// As [`rows_float`], whose checks establish it, and `t0 + NT <= n`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn token_group<F: Floats, const MR: usize, const NT: usize>(
        w: &[u8],
        row_bytes: usize,
        x: &[f32],
        n: usize,
        t0: usize,
        out: &mut [f32],
    ) {
        let cols = row_bytes / F::BYTES;
        let rows = out.len() / n;
        // SAFETY: `t0 + NT <= n` and `x` holds `n·cols` floats.
        let xs: [*const f32; NT] =
            std::array::from_fn(|i| unsafe { x.as_ptr().add((t0 + i) * cols) });
        let row = |r: usize| {
            // SAFETY: `r < rows` and `w` holds `rows·row_bytes` bytes.
            unsafe { w.as_ptr().add(r * row_bytes) }
        };
        let mut r0 = 0;
        while r0 + MR <= rows {
            // SAFETY: rows `r0..r0+MR` exist; `xs` as above.
            let v = unsafe { tile::<F, MR, NT>(std::array::from_fn(|i| row(r0 + i)), cols, xs) };
            for (i, vr) in v.iter().enumerate() {
                out[(r0 + i) * n + t0..][..NT].copy_from_slice(vr);
            }
            r0 += MR;
        }
        for r in r0..rows {
            // SAFETY: as above.
            let v = unsafe { tile::<F, 1, NT>([row(r)], cols, xs) };
            out[r * n + t0..][..NT].copy_from_slice(&v[0]);
        }
    }

    /// Every token group over the chunk: the group loop is outside the row loop so that, in
    /// prefill, the chunk's rows stay in cache while each group passes over them.
    ///
    /// Up to four tokens are one group of one-row tiles: the chunk may be larger than the
    /// cache then (`matmul::chunk_rows`), so its rows are streamed from memory once, in
    /// order (interleaving two rows' streams measured 2× slower on the 49152-row f16 output
    /// matrix). More tokens go in groups of three over two-row tiles of a cache-resident
    /// chunk, which load each weight and token vector half as often per product.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_rows<F: Floats>(
        w: &[u8],
        row_bytes: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        // SAFETY (each call): contract of `rows_float`, and `t0 + NT <= n` by construction.
        unsafe {
            match n {
                1 => return token_group::<F, 1, 1>(w, row_bytes, x, n, 0, out),
                2 => return token_group::<F, 1, 2>(w, row_bytes, x, n, 0, out),
                3 => return token_group::<F, 1, 3>(w, row_bytes, x, n, 0, out),
                4 => return token_group::<F, 1, 4>(w, row_bytes, x, n, 0, out),
                _ => {}
            }
        }
        let mut t0 = 0;
        while t0 < n {
            let nt = (n - t0).min(3);
            // SAFETY: as above.
            unsafe {
                match nt {
                    1 => token_group::<F, 2, 1>(w, row_bytes, x, n, t0, out),
                    2 => token_group::<F, 2, 2>(w, row_bytes, x, n, t0, out),
                    _ => token_group::<F, 2, 3>(w, row_bytes, x, n, t0, out),
                }
            }
            t0 += nt;
        }
    }

    /// See [`super::widen_half`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn widen_half(bf16: bool, src: &[u8], dst: &mut [f32]) {
        let mut src8 = src.chunks_exact(16);
        let mut dst8 = dst.chunks_exact_mut(8);
        for (s, d) in (&mut src8).zip(&mut dst8) {
            // SAFETY: `s` is 16 readable bytes and `d` 8 writable floats (exact chunks).
            unsafe {
                let v = if bf16 {
                    Bf16::load8(s.as_ptr())
                } else {
                    F16::load8(s.as_ptr())
                };
                _mm256_storeu_ps(d.as_mut_ptr(), v);
            }
        }
        for (s, d) in src8.remainder().chunks_exact(2).zip(dst8.into_remainder()) {
            *d = if bf16 { Bf16::one(s) } else { F16::one(s) };
        }
    }

    /// `out[r·n + t] = row_r · x_t` for float weights (`ty` F32/F16/BF16, rows `row_bytes`
    /// apart) and `n` f32 token vectors `x[t·cols..]`. Inconsistent sizes: returns unwritten.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C (`dot_avx2::available`).
    pub(crate) unsafe fn rows_float(
        ty: GgmlType,
        w: &[u8],
        row_bytes: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        let rows = out.len().checked_div(n).unwrap_or(0);
        let cols = row_bytes / ty.block_bytes();
        if !row_bytes.is_multiple_of(ty.block_bytes())
            || w.len() < rows * row_bytes
            || x.len() < n * cols
        {
            return;
        }
        // SAFETY: sizes checked above; CPU features per this function's contract.
        unsafe {
            match ty {
                GgmlType::F32 => float_rows::<F32>(w, row_bytes, x, n, out),
                GgmlType::F16 => float_rows::<F16>(w, row_bytes, x, n, out),
                GgmlType::Bf16 => float_rows::<Bf16>(w, row_bytes, x, n, out),
                _ => {}
            }
        }
    }
}
