//! AVX2 (+FMA, F16C) kernels: weight rows against quantized activations for the 32-element
//! formats (the float formats' are in `float_avx2.rs`). Each computes the same
//! quantity as its `dot_scalar` twin; only the f32 summation order differs. That order is
//! the same for every token whatever the size of its group, so a token's result is
//! bit-for-bit the same alone or batched.
//!
//! Shape of every kernel: `out[r·n + t] = row_r · x_t` for the rows of a chunk `w`
//! (`row_bytes` apart) and all `n` tokens. Tokens go in groups (up to two) so that each
//! weight block is loaded and unpacked once
//! per group (decode with a few sequences reads the
//! weights from memory once); the group loop is outside the row loop so that, in prefill, a
//! chunk of rows stays in cache while every token group passes over it.
//!
//! The integer step is llama.cpp's: unsigned codes × signed activations with
//! `_mm256_maddubs_epi16`, pairs summed to i32 with `_mm256_madd_epi16`, converted and scaled
//! per block with one FMA. Signed weight codes (Q4_0, Q5_0, Q8_0) move their sign onto the
//! activations with `_mm256_sign_epi8` first. No i16 overflow: |code| ≤ 128, |act| ≤ 127.
//! Where the CPU has AVX-512 VNNI (with VL), one `vpdpbusd` replaces the `maddubs` + `madd`
//! pair; with no i16 saturation to differ, its sums are the same integers, so the two paths
//! give the same bits (a test compares them).

use super::activations::Q8Block;

/// Whether this CPU runs the kernels of this file (AVX2, FMA and F16C).
#[inline]
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU also has AVX-512 VNNI with 256-bit forms (`vpdpbusd` on ymm).
#[inline]
pub(crate) fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::{hsum, rows_q8};

#[cfg(not(target_arch = "x86_64"))]
/// Never called: [`available`] is false off x86-64.
pub(crate) unsafe fn rows_q8(
    _: super::GgmlType,
    _: &[u8],
    _: usize,
    _: &[Q8Block],
    _: usize,
    _: &mut [f32],
    _: bool,
) {
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::Q8Block;
    use crate::quant::GgmlType;
    use std::arch::x86_64::*;

    /// How one 32-element weight format turns a block into 32 int8 codes and its scales.
    trait Block {
        /// Bytes per block.
        const BYTES: usize;
        /// Codes are signed (sign trick needed); otherwise unsigned with a min `m`.
        const SIGNED: bool;
        /// Returns the 32 codes and `[d, m, 0, 0]` (`m = 0` for the signed formats).
        ///
        /// # Safety
        /// `p` must point at `BYTES` readable bytes; the CPU must have AVX2 and F16C.
        unsafe fn load(p: *const u8) -> (__m256i, __m128);
    }

    /// Low nibbles of 16 bytes in lanes 0..16, high nibbles in lanes 16..32 (ggml's
    /// `bytes_from_nibbles_32`), matching the element order of the 4- and 5-bit formats.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let lo = unsafe { _mm_loadu_si128(p.cast()) };
        let both =
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), _mm_srli_epi16::<4>(lo));
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// Byte `j` = 0xFF where bit `j` of the little-endian u32 at `p` is set (ggml's
    /// `bytes_from_bits_32`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bits(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 4 readable bytes at `p`.
        let x = unsafe { p.cast::<i32>().read_unaligned() };
        let shuf = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
        let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
    }

    /// The half at `p` widened into lane 0 (lanes 1..4 zero).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn half1(p: *const u8) -> __m128 {
        // SAFETY: the caller guarantees 2 readable bytes at `p`.
        let h = unsafe { p.cast::<u16>().read_unaligned() };
        _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h)))
    }

    /// The halves `d, m` at `p` widened into lanes 0 and 1.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn half2(p: *const u8) -> __m128 {
        // SAFETY: the caller guarantees 4 readable bytes at `p`.
        let h = unsafe { p.cast::<i32>().read_unaligned() };
        _mm_cvtph_ps(_mm_cvtsi32_si128(h))
    }

    struct Q4_0;
    struct Q4_1;
    struct Q5_0;
    struct Q5_1;
    struct Q8_0;

    // SAFETY (all `load`s below): every read stays inside the `BYTES` bytes at `p` that the
    // caller guarantees; the offsets are those of the layouts in `blocks.rs`.
    impl Block for Q4_0 {
        const BYTES: usize = 18;
        const SIGNED: bool = true;
        #[inline(always)]
        unsafe fn load(p: *const u8) -> (__m256i, __m128) {
            unsafe {
                (
                    _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)),
                    half1(p),
                )
            }
        }
    }
    impl Block for Q4_1 {
        const BYTES: usize = 20;
        const SIGNED: bool = false;
        #[inline(always)]
        unsafe fn load(p: *const u8) -> (__m256i, __m128) {
            unsafe { (nibbles(p.add(4)), half2(p)) }
        }
    }
    impl Block for Q5_0 {
        const BYTES: usize = 22;
        const SIGNED: bool = true;
        #[inline(always)]
        unsafe fn load(p: *const u8) -> (__m256i, __m128) {
            // Where the fifth bit is clear, OR-ing 0xF0 makes the byte `q − 16` in i8.
            unsafe {
                let hi = _mm256_andnot_si256(bits(p.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
                (_mm256_or_si256(nibbles(p.add(6)), hi), half1(p))
            }
        }
    }
    impl Block for Q5_1 {
        const BYTES: usize = 24;
        const SIGNED: bool = false;
        #[inline(always)]
        unsafe fn load(p: *const u8) -> (__m256i, __m128) {
            unsafe {
                let hi = _mm256_and_si256(bits(p.add(4)), _mm256_set1_epi8(0x10));
                (_mm256_or_si256(nibbles(p.add(8)), hi), half2(p))
            }
        }
    }
    impl Block for Q8_0 {
        const BYTES: usize = 34;
        const SIGNED: bool = true;
        #[inline(always)]
        unsafe fn load(p: *const u8) -> (__m256i, __m128) {
            unsafe { (_mm256_loadu_si256(p.add(2).cast()), half1(p)) }
        }
    }

    /// How the 32 code × activation products of a block become eight i32 lane sums (each of
    /// four adjacent products): `ax` unsigned codes, `sy` signed activations.
    trait Products {
        /// # Safety
        /// The CPU has the implementation's features (inlined into kernels enabling them).
        unsafe fn sums(ax: __m256i, sy: __m256i) -> __m256i;
    }
    /// AVX2: `maddubs` (pairs to i16, no saturation here) then `madd` with ones.
    struct Avx2;
    impl Products for Avx2 {
        #[inline(always)]
        unsafe fn sums(ax: __m256i, sy: __m256i) -> __m256i {
            // SAFETY: AVX2 per the caller contract.
            unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1)) }
        }
    }
    /// AVX-512 VNNI: one `vpdpbusd` from zero, the same sums.
    struct Vnni;
    impl Products for Vnni {
        #[inline(always)]
        unsafe fn sums(ax: __m256i, sy: __m256i) -> __m256i {
            // SAFETY: AVX-512 VNNI and VL per the caller contract.
            unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy) }
        }
    }

    /// Horizontal sum of 8 floats.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Per-token accumulators: the scaled integer sums, and (lane 1) the `m·s` min terms.
    struct Acc<const NT: usize> {
        dot: [__m256; NT],
        min: [__m128; NT],
    }

    impl<const NT: usize> Acc<NT> {
        #[inline]
        #[target_feature(enable = "avx2")]
        fn new() -> Self {
            Self {
                dot: [_mm256_setzero_ps(); NT],
                min: [_mm_setzero_ps(); NT],
            }
        }
    }

    /// Block `ib` of token activations `act` against a weight block's codes `qx` (`ax`: their
    /// absolute values for the signed formats) and scales `dm`: the block's eight i32 lane
    /// sums as f32, and `[d_w·d_a, m_w·s_a, ..]` (lane 0 scales the sums, lane 1 is the min
    /// term).
    ///
    /// # Safety
    /// Block `ib` of `act` is readable; the CPU has AVX2 (it is inlined into the AVX2
    /// kernels, as the `Block::load`s are).
    #[inline(always)]
    unsafe fn block_terms<B: Block, P: Products>(
        qx: __m256i,
        ax: __m256i,
        dm: __m128,
        act: *const Q8Block,
        ib: usize,
    ) -> (__m256, __m128) {
        // SAFETY: block `ib` of the activations is readable (caller contract); `Q8Block` is
        // `repr(C)` with `d, s` first, then 32 codes. AVX2 per the caller contract.
        unsafe {
            let a = act.add(ib);
            let ds = _mm_castsi128_ps(_mm_loadl_epi64(a.cast()));
            let qy = _mm256_loadu_si256((*a).qs.as_ptr().cast());
            let prod = _mm_mul_ps(dm, ds);
            let sy = if B::SIGNED {
                _mm256_sign_epi8(qy, qx)
            } else {
                qy
            };
            (_mm256_cvtepi32_ps(P::sums(ax, sy)), prod)
        }
    }

    /// Weight block `ib` of the row: its codes, their absolute values (the signed formats'
    /// sign trick) and its scales.
    ///
    /// # Safety
    /// Block `ib` of the row (at `row`) is readable; the CPU has AVX2 and F16C (inlined into
    /// the AVX2 kernels).
    #[inline(always)]
    unsafe fn weight_block<B: Block>(row: *const u8, ib: usize) -> (__m256i, __m256i, __m128) {
        // SAFETY: caller contract.
        unsafe {
            let (qx, dm) = B::load(row.add(ib * B::BYTES));
            let ax = if B::SIGNED {
                _mm256_sign_epi8(qx, qx)
            } else {
                qx
            };
            (qx, ax, dm)
        }
    }

    /// Adds block `ib` of the row times block `ib` of each token's activations into `acc`.
    ///
    /// # Safety
    /// Block `ib` of the row (at `row`) and of each `acts[t]` is readable; the CPU has AVX2,
    /// FMA, F16C and `P`'s features (inlined into kernels enabling them).
    #[inline(always)]
    unsafe fn block_step<B: Block, P: Products, const NT: usize>(
        row: *const u8,
        ib: usize,
        acts: &[*const Q8Block; NT],
        acc: &mut Acc<NT>,
    ) {
        // SAFETY (all calls): block `ib` of the row and of every token is readable; features
        // per the contract.
        unsafe {
            let (qx, ax, dm) = weight_block::<B>(row, ib);
            for (t, &act) in acts.iter().enumerate() {
                let (sums, prod) = block_terms::<B, P>(qx, ax, dm, act, ib);
                acc.dot[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), sums, acc.dot[t]);
                if !B::SIGNED {
                    acc.min[t] = _mm_add_ps(acc.min[t], prod);
                }
            }
        }
    }

    /// One weight row (`nb` blocks at `row`) against `NT` (one or two) tokens' activations.
    ///
    /// Even and odd blocks go to separate accumulators, so a single token's chain does not
    /// wait on the FMA latency every block. Each token's sum is formed in the same order for
    /// one token or two, and `q8_rows` groups tokens in twos only, so a token's result does
    /// not depend on how many tokens share the call: a request batched with others gets the
    /// bits it gets alone. (Groups of four with one chain per token summed in another order;
    /// two chains for four tokens would need more registers than AVX2 has.)
    ///
    /// # Safety
    /// `row` points at `nb·B::BYTES` readable bytes and each `acts[t]` at `nb` blocks; the CPU
    /// has AVX2, FMA, F16C and `P`'s features (inlined into kernels enabling them).
    #[inline(always)]
    unsafe fn dot_row<B: Block, P: Products, const NT: usize>(
        row: *const u8,
        nb: usize,
        acts: [*const Q8Block; NT],
    ) -> [f32; NT] {
        // SAFETY: features per the contract.
        let (mut even, mut odd) = unsafe { (Acc::<NT>::new(), Acc::<NT>::new()) };
        let mut ib = 0;
        // SAFETY (both steps): every block they read is below `nb` (caller contract).
        while ib + 2 <= nb {
            unsafe {
                block_step::<B, P, NT>(row, ib, &acts, &mut even);
                block_step::<B, P, NT>(row, ib + 1, &acts, &mut odd);
            }
            ib += 2;
        }
        if ib < nb {
            unsafe { block_step::<B, P, NT>(row, ib, &acts, &mut even) };
        }
        // SAFETY: features per the contract.
        std::array::from_fn(|t| unsafe {
            let dot = _mm256_add_ps(even.dot[t], odd.dot[t]);
            let min = if B::SIGNED {
                0.0
            } else {
                _mm_cvtss_f32(_mm_movehdup_ps(_mm_add_ps(even.min[t], odd.min[t])))
            };
            hsum(dot) + min
        })
    }

    /// Rows of the chunk × tokens `t0..t0 + NT`.
    ///
    /// # Safety
    /// As [`rows_q8`], whose checks establish it; the CPU has `P`'s features.
    #[inline(always)]
    unsafe fn token_group<B: Block, P: Products, const NT: usize>(
        w: &[u8],
        row_bytes: usize,
        acts: &[Q8Block],
        n: usize,
        t0: usize,
        out: &mut [f32],
    ) {
        let nb = row_bytes / B::BYTES;
        // SAFETY: `t0 + NT <= n` and `acts` holds `n·nb` blocks (checked by `rows_q8`).
        let a: [*const Q8Block; NT] =
            std::array::from_fn(|i| unsafe { acts.as_ptr().add((t0 + i) * nb) });
        for (r, o) in out.chunks_exact_mut(n).enumerate() {
            // SAFETY: row `r` lies inside `w` (rows_q8 checked `w` covers every output row).
            let v = unsafe { dot_row::<B, P, NT>(w.as_ptr().add(r * row_bytes), nb, a) };
            o[t0..t0 + NT].copy_from_slice(&v);
        }
    }

    /// Every row × every token, tokens in groups of up to two.
    ///
    /// # Safety
    /// As [`rows_q8`]; the CPU has `P`'s features.
    #[inline(always)]
    unsafe fn q8_rows<B: Block, P: Products>(
        w: &[u8],
        row_bytes: usize,
        acts: &[Q8Block],
        n: usize,
        out: &mut [f32],
    ) {
        let mut t0 = 0;
        // SAFETY (each call): contract of `rows_q8`, and `t0 + NT <= n` by construction.
        while t0 < n {
            let nt = (n - t0).min(2);
            unsafe {
                match nt {
                    1 => token_group::<B, P, 1>(w, row_bytes, acts, n, t0, out),
                    _ => token_group::<B, P, 2>(w, row_bytes, acts, n, t0, out),
                }
            }
            t0 += nt;
        }
    }

    /// [`q8_rows`] compiled for AVX2.
    ///
    /// # Safety
    /// As [`rows_q8`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_rows_avx2<B: Block>(
        w: &[u8],
        row_bytes: usize,
        acts: &[Q8Block],
        n: usize,
        out: &mut [f32],
    ) {
        // SAFETY: contract passed on; AVX2, FMA, F16C enabled here.
        unsafe { q8_rows::<B, Avx2>(w, row_bytes, acts, n, out) }
    }

    /// [`q8_rows`] compiled for AVX-512 VNNI (256-bit forms).
    ///
    /// # Safety
    /// As [`rows_q8`], and the CPU has AVX-512 VNNI and VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    unsafe fn q8_rows_vnni<B: Block>(
        w: &[u8],
        row_bytes: usize,
        acts: &[Q8Block],
        n: usize,
        out: &mut [f32],
    ) {
        // SAFETY: contract passed on; the features are enabled here.
        unsafe { q8_rows::<B, Vnni>(w, row_bytes, acts, n, out) }
    }

    /// One format's kernel: the VNNI build where the CPU has it (and `vnni` allows), else AVX2.
    ///
    /// # Safety
    /// As [`rows_q8`].
    unsafe fn q8_rows_best<B: Block>(
        vnni: bool,
        w: &[u8],
        row_bytes: usize,
        acts: &[Q8Block],
        n: usize,
        out: &mut [f32],
    ) {
        // SAFETY: contract passed on; VNNI only where `has_vnni` says the CPU has it.
        unsafe {
            if vnni && super::has_vnni() {
                q8_rows_vnni::<B>(w, row_bytes, acts, n, out)
            } else {
                q8_rows_avx2::<B>(w, row_bytes, acts, n, out)
            }
        }
    }

    /// `out[r·n + t] = row_r · acts_t` for the rows of `w` (a 32-element format `ty`, rows
    /// `row_bytes` apart) and `n` tokens whose activations are `acts[t·nb..(t+1)·nb]`.
    /// Inconsistent sizes make it return without writing (callers check them first).
    ///
    /// `vnni: false` keeps the AVX2 products where VNNI would run (tests compare the two).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C ([`super::available`]).
    pub(crate) unsafe fn rows_q8(
        ty: GgmlType,
        w: &[u8],
        row_bytes: usize,
        acts: &[Q8Block],
        n: usize,
        out: &mut [f32],
        vnni: bool,
    ) {
        let rows = out.len().checked_div(n).unwrap_or(0);
        let block_bytes = ty.block_bytes();
        if !row_bytes.is_multiple_of(block_bytes)
            || w.len() < rows * row_bytes
            || acts.len() < n * (row_bytes / block_bytes)
        {
            return;
        }
        // SAFETY: sizes checked above; CPU features per this function's contract.
        unsafe {
            match ty {
                GgmlType::Q4_0 => q8_rows_best::<Q4_0>(vnni, w, row_bytes, acts, n, out),
                GgmlType::Q4_1 => q8_rows_best::<Q4_1>(vnni, w, row_bytes, acts, n, out),
                GgmlType::Q5_0 => q8_rows_best::<Q5_0>(vnni, w, row_bytes, acts, n, out),
                GgmlType::Q5_1 => q8_rows_best::<Q5_1>(vnni, w, row_bytes, acts, n, out),
                GgmlType::Q8_0 => q8_rows_best::<Q8_0>(vnni, w, row_bytes, acts, n, out),
                _ => {}
            }
        }
    }
}
