//! AVX2 twins of the scalar kernels in `super`: same f32 values, same bytes (see `super`).
//!
//! Every function here is `unsafe` only because it requires AVX2 + FMA: callers must have
//! detected them (see [`super::Isa::detect`]). Slice bounds are checked inside, and fall back
//! to the scalar twin when a precondition does not hold.

use std::arch::x86_64::*;

/// FWHT stages h = 1, 2, 4 inside one register of 8 coordinates.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn stages_1_2_4(v: __m256) -> __m256 {
    // h = 1: partner = swap neighbours; even lanes keep a + b, odd lanes get a − b.
    let s = _mm256_permute_ps::<0b10_11_00_01>(v);
    let v = _mm256_blend_ps::<0b1010_1010>(_mm256_add_ps(v, s), _mm256_sub_ps(s, v));
    // h = 2: partner = swap pairs.
    let s = _mm256_permute_ps::<0b01_00_11_10>(v);
    let v = _mm256_blend_ps::<0b1100_1100>(_mm256_add_ps(v, s), _mm256_sub_ps(s, v));
    // h = 4: partner = the other 128-bit half.
    let s = _mm256_permute2f128_ps::<1>(v, v);
    _mm256_blend_ps::<0b1111_0000>(_mm256_add_ps(v, s), _mm256_sub_ps(s, v))
}

/// The sum of squares of [`super::sum_squares`] from its four 8-lane accumulators
/// (accumulator r holds lanes 8r..8r+7 of the 32).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn finish_sum_squares(acc: [__m256; 4]) -> f32 {
    let a = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    // ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), as `super::reduce8`.
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<0b01>(t, t)))
}

/// Stages h ≥ 8 over memory; two stages per pass where possible (same butterflies).
#[target_feature(enable = "avx2,fma")]
fn cross_stages(x: &mut [f32]) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mut h = 8;
    while h < n {
        if 4 * h <= n {
            for base in (0..n).step_by(4 * h) {
                for j in (base..base + h).step_by(8) {
                    // SAFETY: base + 4h ≤ n and j + 8 ≤ base + h, so j + 3h + 8 ≤ n.
                    unsafe {
                        let a = _mm256_loadu_ps(p.add(j));
                        let b = _mm256_loadu_ps(p.add(j + h));
                        let c = _mm256_loadu_ps(p.add(j + 2 * h));
                        let d = _mm256_loadu_ps(p.add(j + 3 * h));
                        let (ab0, ab1) = (_mm256_add_ps(a, b), _mm256_sub_ps(a, b));
                        let (cd0, cd1) = (_mm256_add_ps(c, d), _mm256_sub_ps(c, d));
                        _mm256_storeu_ps(p.add(j), _mm256_add_ps(ab0, cd0));
                        _mm256_storeu_ps(p.add(j + 2 * h), _mm256_sub_ps(ab0, cd0));
                        _mm256_storeu_ps(p.add(j + h), _mm256_add_ps(ab1, cd1));
                        _mm256_storeu_ps(p.add(j + 3 * h), _mm256_sub_ps(ab1, cd1));
                    }
                }
            }
            h *= 4;
        } else {
            for base in (0..n).step_by(2 * h) {
                for j in (base..base + h).step_by(8) {
                    // SAFETY: base + 2h ≤ n and j + 8 ≤ base + h.
                    unsafe {
                        let a = _mm256_loadu_ps(p.add(j));
                        let b = _mm256_loadu_ps(p.add(j + h));
                        _mm256_storeu_ps(p.add(j), _mm256_add_ps(a, b));
                        _mm256_storeu_ps(p.add(j + h), _mm256_sub_ps(a, b));
                    }
                }
            }
            h *= 2;
        }
    }
}

/// AVX2 [`super::fwht_scalar`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fwht(x: &mut [f32]) {
    let n = x.len();
    if n < 8 || !n.is_power_of_two() {
        super::fwht_scalar(x);
        return;
    }
    for c in x.chunks_exact_mut(8) {
        // SAFETY: `c` holds exactly 8 floats.
        unsafe {
            let v = _mm256_loadu_ps(c.as_ptr());
            _mm256_storeu_ps(c.as_mut_ptr(), stages_1_2_4(v));
        }
    }
    cross_stages(x);
}

/// AVX2 [`super::signs_fwht_norm`] (sum of squares in the same 8-lane order and tree).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn signs_fwht_norm(g: &[f32], masks: &[u32], out: &mut [f32]) -> f32 {
    let n = g.len();
    if n < 8 || !n.is_power_of_two() || masks.len() != n || out.len() != n {
        let nsq = super::sum_squares(g);
        crate::rotation::apply_signs(g, masks, out);
        super::fwht_scalar(out);
        return nsq;
    }
    let mut acc = [_mm256_setzero_ps(); 4];
    for (k, ((gc, mc), oc)) in g
        .chunks_exact(8)
        .zip(masks.chunks_exact(8))
        .zip(out.chunks_exact_mut(8))
        .enumerate()
    {
        // SAFETY: each chunk holds exactly 8 elements of 4 bytes.
        unsafe {
            let v = _mm256_loadu_ps(gc.as_ptr());
            acc[k & 3] = _mm256_add_ps(acc[k & 3], _mm256_mul_ps(v, v));
            let m = _mm256_castsi256_ps(_mm256_loadu_si256(mc.as_ptr().cast()));
            _mm256_storeu_ps(oc.as_mut_ptr(), stages_1_2_4(_mm256_xor_ps(v, m)));
        }
    }
    cross_stages(out);
    finish_sum_squares(acc)
}

/// AVX2 quantize-and-pack for 1–4-bit codes: eight codes per register, `bits` bytes out.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_pack(y: &[f32], thresholds: &[f32], bits: u8, packed: &mut [u8]) {
    let b = usize::from(bits);
    if !y.len().is_multiple_of(8) || !(1..=4).contains(&b) || packed.len() != y.len() / 8 * b {
        let mut codes = vec![0u8; y.len()];
        super::quantize_scalar(y, thresholds, &mut codes);
        let _ = crate::bitpack::pack(&codes, bits, packed);
        return;
    }
    match b {
        1 => quantize_pack_b::<1>(y, thresholds, packed),
        2 => quantize_pack_b::<2>(y, thresholds, packed),
        3 => quantize_pack_b::<3>(y, thresholds, packed),
        _ => quantize_pack_b::<4>(y, thresholds, packed),
    }
}

/// Binary-search tables for [`quantize_reg`]: level l (1-based) holds the 2^(l−1) thresholds
/// `T[(2j+1)·2^(B−l) − 1]`, broadcast or laid out in lanes for `vpermps`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn search_tables<const B: usize>(thresholds: &[f32]) -> [__m256; 4] {
    let mut tables = [_mm256_setzero_ps(); 4];
    for (l, t) in tables.iter_mut().enumerate().take(B) {
        // Lane j ≥ 2^l repeats lane j mod 2^l, so level 0 is a broadcast (it is compared
        // without a permute).
        let mut lanes = [0.0f32; 8];
        for (j, lane) in lanes.iter_mut().enumerate() {
            let k = (2 * (j % (1 << l)) + 1) * (1 << (B - 1 - l)) - 1;
            *lane = thresholds.get(k).copied().unwrap_or(f32::NAN);
        }
        // SAFETY: `lanes` holds 8 floats.
        *t = unsafe { _mm256_loadu_ps(lanes.as_ptr()) };
    }
    tables
}

/// Codes of 8 coordinates: the number of thresholds strictly below each, found by binary
/// search (B compares instead of 2^B − 1). Equal to the linear count because the predicate
/// `v > T_k` is monotone in k for any threshold vector `boundary·scale` with scale ≥ 0,
/// +∞ or NaN (NaN thresholds only ever sit where every later predicate is false too).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn quantize_reg<const B: usize>(v: __m256, tables: &[__m256; 4]) -> __m256i {
    let mut idx = _mm256_setzero_si256();
    for (l, t) in tables.iter().enumerate().take(B) {
        let th = if l == 0 {
            *t
        } else {
            _mm256_permutevar8x32_ps(*t, idx)
        };
        let m = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(v, th));
        // idx = 2·idx + bit (m is −1 where v > th).
        idx = _mm256_sub_epi32(_mm256_slli_epi32::<1>(idx), m);
    }
    idx
}

/// [`quantize_pack`] for a fixed width: the threshold loop has a constant trip count
/// (2^B − 1) so it unrolls, and the per-register store is a fixed-size copy.
#[target_feature(enable = "avx2,fma")]
fn quantize_pack_b<const B: usize>(y: &[f32], thresholds: &[f32], packed: &mut [u8]) {
    let levels = (1usize << B) - 1;
    if thresholds.len() != levels {
        let mut codes = vec![0u8; y.len()];
        super::quantize_scalar(y, thresholds, &mut codes);
        let _ = crate::bitpack::pack(&codes, B as u8, packed);
        return;
    }
    let bi = B as i32;
    let shifts = _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, 4 * bi, 5 * bi, 6 * bi, 7 * bi);
    let tables = search_tables::<B>(thresholds);
    for (yc, pc) in y.chunks_exact(8).zip(packed.chunks_exact_mut(B)) {
        // SAFETY: `yc` holds exactly 8 floats.
        let v = unsafe { _mm256_loadu_ps(yc.as_ptr()) };
        // `v > t` is false for NaN, as in the scalar `>`.
        let cnt = quantize_reg::<B>(v, &tables);
        // Codes do not overlap after the shifts, so OR-reducing the lanes packs them.
        let sh = _mm256_sllv_epi32(cnt, shifts);
        let x = _mm_or_si128(
            _mm256_castsi256_si128(sh),
            _mm256_extracti128_si256::<1>(sh),
        );
        let x = _mm_or_si128(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
        let x = _mm_or_si128(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
        let word = (_mm_cvtsi128_si32(x) as u32).to_le_bytes();
        let mut out = [0u8; B];
        out.copy_from_slice(&word[..B]);
        if let Ok(pc) = <&mut [u8; B]>::try_from(pc) {
            *pc = out;
        }
    }
}

/// `Σ_i q[i]·centroids[code_i]` for 1–4-bit codes: centroids gathered from registers with
/// `vpermps`, accumulated with FMA in two chains. Not bit-identical to the scalar reference
/// (FMA and a different summation order); scores only need to agree to rounding.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_codes(q: &[f32], packed: &[u8], bits: u8, centroids: &[f32]) -> f32 {
    let b = usize::from(bits);
    let ok = q.len().is_multiple_of(8)
        && (1..=4).contains(&b)
        && packed.len() == q.len() / 8 * b
        && centroids.len() == 1 << b;
    if !ok {
        return crate::score::dot_codes_ref(q, packed, bits, centroids);
    }
    let mut table = [0.0f32; 16];
    table[..centroids.len()].copy_from_slice(centroids);
    match b {
        1 => dot_codes_b::<1>(q, packed, &table),
        2 => dot_codes_b::<2>(q, packed, &table),
        3 => dot_codes_b::<3>(q, packed, &table),
        _ => dot_codes_b::<4>(q, packed, &table),
    }
}

#[target_feature(enable = "avx2,fma")]
fn dot_codes_b<const B: usize>(q: &[f32], packed: &[u8], table: &[f32; 16]) -> f32 {
    let bi = B as i32;
    let shifts = _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, 4 * bi, 5 * bi, 6 * bi, 7 * bi);
    let mask = _mm256_set1_epi32((1 << B) - 1);
    // SAFETY: `table` holds 16 floats.
    let (lo, hi) = unsafe {
        (
            _mm256_loadu_ps(table.as_ptr()),
            _mm256_loadu_ps(table.as_ptr().add(8)),
        )
    };
    let mut acc = [_mm256_setzero_ps(); 2];
    for (k, (qc, pc)) in q.chunks_exact(8).zip(packed.chunks_exact(B)).enumerate() {
        let mut w = [0u8; 4];
        w[..B].copy_from_slice(pc);
        let word = _mm256_set1_epi32(i32::from_le_bytes(w));
        let idx = _mm256_and_si256(_mm256_srlv_epi32(word, shifts), mask);
        let c = if B == 4 {
            let a = _mm256_permutevar8x32_ps(lo, idx);
            let h = _mm256_permutevar8x32_ps(hi, idx);
            // Bit 3 of the code selects the upper half of the table.
            _mm256_blendv_ps(a, h, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)))
        } else {
            _mm256_permutevar8x32_ps(lo, idx)
        };
        // SAFETY: `qc` holds exactly 8 floats.
        let qv = unsafe { _mm256_loadu_ps(qc.as_ptr()) };
        acc[k & 1] = _mm256_fmadd_ps(qv, c, acc[k & 1]);
    }
    let v = _mm256_add_ps(acc[0], acc[1]);
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<0b01>(t, t)))
}

/// `Σ_i v[i]·(bit_i ? 1 : −1)` over packed sign bits (8 per byte).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot_signs(v: &[f32], signs: &[u8]) -> f32 {
    if !v.len().is_multiple_of(8) || signs.len() != v.len() / 8 {
        return crate::score::dot_signs_ref(v, signs);
    }
    let bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let sign_bit = _mm256_set1_epi32(i32::MIN);
    let mut acc = _mm256_setzero_ps();
    for (vc, &byte) in v.chunks_exact(8).zip(signs) {
        let set = _mm256_and_si256(_mm256_set1_epi32(i32::from(byte)), bit);
        // Lanes whose bit is clear get their sign flipped.
        let clear = _mm256_cmpeq_epi32(set, _mm256_setzero_si256());
        let flip = _mm256_castsi256_ps(_mm256_and_si256(clear, sign_bit));
        // SAFETY: `vc` holds exactly 8 floats.
        let x = unsafe { _mm256_loadu_ps(vc.as_ptr()) };
        acc = _mm256_add_ps(acc, _mm256_xor_ps(x, flip));
    }
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<0b01>(t, t)))
}

/// The whole MSE encode of one Hadamard part held in registers: sign flips and sum of squares,
/// the FWHT, thresholds from the norm, quantization and packing, with the same f32 operations
/// as the scalar path (`signs_fwht_norm` + `quantize_pack`). Returns the norm `n`, or `None`
/// when the sizes are not supported here (the caller then takes the general path).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn encode_hadamard_mse(
    g: &[f32],
    masks: &[u32],
    boundaries: &[f32],
    sigma: f32,
    bits: u8,
    packed: &mut [u8],
) -> Option<f32> {
    let n = g.len();
    let b = usize::from(bits);
    let ok = masks.len() == n
        && (1..=4).contains(&b)
        && boundaries.len() == (1 << b) - 1
        && packed.len() == n / 8 * b;
    if !ok {
        return None;
    }
    macro_rules! go {
        ($r:literal) => {
            match b {
                1 => fused::<$r, 1>(g, masks, boundaries, sigma, packed),
                2 => fused::<$r, 2>(g, masks, boundaries, sigma, packed),
                3 => fused::<$r, 3>(g, masks, boundaries, sigma, packed),
                _ => fused::<$r, 4>(g, masks, boundaries, sigma, packed),
            }
        };
    }
    Some(match n {
        8 => go!(1),
        16 => go!(2),
        32 => go!(4),
        64 => go!(8),
        128 => go!(16),
        256 => go!(32),
        _ => return None,
    })
}

/// [`encode_hadamard_mse`] for `R` registers (d = 8R) and `B`-bit codes; loops over R and
/// the stages have constant trip counts and unroll.
#[target_feature(enable = "avx2,fma")]
fn fused<const R: usize, const B: usize>(
    g: &[f32],
    masks: &[u32],
    boundaries: &[f32],
    sigma: f32,
    packed: &mut [u8],
) -> f32 {
    let mut v = [_mm256_setzero_ps(); R];
    let mut acc = [_mm256_setzero_ps(); 4];
    for (k, ((vr, gc), mc)) in v
        .iter_mut()
        .zip(g.chunks_exact(8))
        .zip(masks.chunks_exact(8))
        .enumerate()
    {
        // SAFETY: each chunk holds exactly 8 elements of 4 bytes.
        unsafe {
            let x = _mm256_loadu_ps(gc.as_ptr());
            acc[k & 3] = _mm256_add_ps(acc[k & 3], _mm256_mul_ps(x, x));
            let m = _mm256_castsi256_ps(_mm256_loadu_si256(mc.as_ptr().cast()));
            *vr = stages_1_2_4(_mm256_xor_ps(x, m));
        }
    }
    // Stages h = 8, 16, …: butterflies between registers j and j + h/8.
    let mut h = 1;
    while h < R {
        let mut base = 0;
        while base < R {
            for j in base..base + h {
                let (a, c) = (v[j], v[j + h]);
                v[j] = _mm256_add_ps(a, c);
                v[j + h] = _mm256_sub_ps(a, c);
            }
            base += 2 * h;
        }
        h *= 2;
    }
    let norm = finish_sum_squares(acc).sqrt();
    let scale = norm * sigma;
    let mut th = [0.0f32; 15];
    for (tk, &bk) in th.iter_mut().zip(boundaries) {
        *tk = bk * scale;
    }
    let tables = search_tables::<B>(&th[..(1 << B) - 1]);
    let bi = B as i32;
    let shifts = _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, 4 * bi, 5 * bi, 6 * bi, 7 * bi);
    for (vr, pc) in v.iter().zip(packed.chunks_exact_mut(B)) {
        let cnt = quantize_reg::<B>(*vr, &tables);
        let sh = _mm256_sllv_epi32(cnt, shifts);
        let x = _mm_or_si128(
            _mm256_castsi256_si128(sh),
            _mm256_extracti128_si256::<1>(sh),
        );
        let x = _mm_or_si128(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
        let x = _mm_or_si128(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
        let word = (_mm_cvtsi128_si32(x) as u32).to_le_bytes();
        let mut out = [0u8; B];
        out.copy_from_slice(&word[..B]);
        if let Ok(pc) = <&mut [u8; B]>::try_from(pc) {
            *pc = out;
        }
    }
    norm
}

/// AVX2 [`super::pack_signs`]: one `vcmpps` + `vmovmskps` per eight signs.
///
/// # Safety
/// The CPU must support AVX2 and FMA, and `out.len() == v.len() / 8` with `v.len() % 8 == 0`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn pack_signs(v: &[f32], out: &mut [u8]) {
    let zero = _mm256_setzero_ps();
    for (o, c) in out.iter_mut().zip(v.chunks_exact(8)) {
        // SAFETY: `c` holds exactly 8 floats.
        let x = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        // Ordered compare: NaN gives 0, as the scalar `>=`.
        *o = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, zero)) as u8;
    }
}

/// `out[i] = scale·centroids[code_i]` for packed 1–4-bit codes (see [`super::decode_codes`]).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_codes(
    packed: &[u8],
    bits: u8,
    centroids: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let b = usize::from(bits);
    let ok = out.len().is_multiple_of(8)
        && (1..=4).contains(&b)
        && packed.len() == out.len() / 8 * b
        && centroids.len() == 1 << b;
    if !ok {
        return super::decode_codes_scalar(packed, bits, centroids, scale, out);
    }
    let mut table = [0.0f32; 16];
    table[..centroids.len()].copy_from_slice(centroids);
    match b {
        1 => decode_codes_b::<1>(packed, &table, scale, out),
        2 => decode_codes_b::<2>(packed, &table, scale, out),
        3 => decode_codes_b::<3>(packed, &table, scale, out),
        _ => decode_codes_b::<4>(packed, &table, scale, out),
    }
}

#[target_feature(enable = "avx2,fma")]
fn decode_codes_b<const B: usize>(packed: &[u8], table: &[f32; 16], scale: f32, out: &mut [f32]) {
    let bi = B as i32;
    let shifts = _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, 4 * bi, 5 * bi, 6 * bi, 7 * bi);
    let mask = _mm256_set1_epi32((1 << B) - 1);
    let s = _mm256_set1_ps(scale);
    // SAFETY: `table` holds 16 floats.
    let (lo, hi) = unsafe {
        (
            _mm256_mul_ps(_mm256_loadu_ps(table.as_ptr()), s),
            _mm256_mul_ps(_mm256_loadu_ps(table.as_ptr().add(8)), s),
        )
    };
    for (oc, pc) in out.chunks_exact_mut(8).zip(packed.chunks_exact(B)) {
        let mut w = [0u8; 4];
        w[..B].copy_from_slice(pc);
        let word = _mm256_set1_epi32(i32::from_le_bytes(w));
        let idx = _mm256_and_si256(_mm256_srlv_epi32(word, shifts), mask);
        let c = if B == 4 {
            let a = _mm256_permutevar8x32_ps(lo, idx);
            let h = _mm256_permutevar8x32_ps(hi, idx);
            // Bit 3 of the code selects the upper half of the table.
            _mm256_blendv_ps(a, h, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)))
        } else {
            _mm256_permutevar8x32_ps(lo, idx)
        };
        // SAFETY: `oc` holds exactly 8 floats.
        unsafe { _mm256_storeu_ps(oc.as_mut_ptr(), c) };
    }
}

/// `out[i] = bit_i ? c : −c` over packed sign bits (see [`super::decode_signs`]).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_signs(signs: &[u8], c: f32, out: &mut [f32]) {
    if !out.len().is_multiple_of(8) || signs.len() != out.len() / 8 {
        return super::decode_signs_scalar(signs, c, out);
    }
    let bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let sign_bit = _mm256_set1_epi32(i32::MIN);
    let cv = _mm256_set1_ps(c);
    for (oc, &byte) in out.chunks_exact_mut(8).zip(signs) {
        let set = _mm256_and_si256(_mm256_set1_epi32(i32::from(byte)), bit);
        let clear = _mm256_cmpeq_epi32(set, _mm256_setzero_si256());
        let flip = _mm256_castsi256_ps(_mm256_and_si256(clear, sign_bit));
        // SAFETY: `oc` holds exactly 8 floats.
        unsafe { _mm256_storeu_ps(oc.as_mut_ptr(), _mm256_xor_ps(cv, flip)) };
    }
}
