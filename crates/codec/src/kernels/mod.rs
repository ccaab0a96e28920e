//! Hot loops with a scalar reference and runtime-dispatched SIMD twins.
//!
//! Encoder kernels are bit-identical to their scalar twins (tests and a fuzzer check this):
//! every f32 value is computed by the same operations in the same order (no FMA contraction,
//! the same reduction tree); only the schedule differs. The one algorithmic difference is the
//! SIMD quantizer's binary search over the thresholds, which provably returns the scalar
//! linear count (see `avx2::quantize_reg`). Scoring kernels use FMA and agree to rounding.

#[cfg(target_arch = "x86_64")]
mod avx2;

use crate::bitpack;

/// Which instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable scalar code (the reference).
    Scalar,
    /// x86-64 AVX2 + FMA, detected at run time.
    Avx2,
}

impl Isa {
    /// The best instruction set this CPU supports (detection is cached by std).
    #[inline]
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }
}

/// True when `isa` asks for AVX2 and this CPU has it. Dispatchers check the CPU themselves,
/// so passing [`Isa::Avx2`] on a CPU without it is safe (it runs the scalar code).
#[inline]
fn use_avx2(isa: Isa) -> bool {
    isa == Isa::Avx2 && Isa::detect() == Isa::Avx2
}

/// In-place unnormalised fast Walsh–Hadamard transform; `x.len()` must be a power of two.
pub fn fwht(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx2 && x.len() >= 8 {
        // SAFETY: AVX2 and FMA were detected on this CPU just above.
        unsafe { avx2::fwht(x) };
        return;
    }
    fwht_scalar(x);
}

/// Scalar reference FWHT: stages h = 1, 2, 4, …; butterfly `(a, b) → (a + b, a − b)`.
pub fn fwht_scalar(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

/// The encoder's first step for a Hadamard part: `out = FWHT(D·g)` and returns
/// [`sum_squares`]`(g)`. `masks` are the sign-bit XOR masks of D.
pub fn signs_fwht_norm(g: &[f32], masks: &[u32], out: &mut [f32], isa: Isa) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if use_avx2(isa) && g.len() >= 8 && g.len().is_power_of_two() {
        // SAFETY: `use_avx2` checked at run time that the CPU has AVX2 and FMA; the kernel
        // checks its slice lengths.
        return unsafe { avx2::signs_fwht_norm(g, masks, out) };
    }
    let _ = isa;
    let nsq = sum_squares(g);
    crate::rotation::apply_signs(g, masks, out);
    fwht_scalar(out);
    nsq
}

/// The fused MSE encode of one Hadamard part (sign flips, FWHT, norm, quantize, pack) for
/// power-of-two dimensions 8–256 and 1–4-bit codes; returns the norm, or `None` where only the
/// general path applies (other sizes, or no SIMD). Bit-identical to that general path.
pub fn encode_hadamard_mse(
    g: &[f32],
    masks: &[u32],
    boundaries: &[f32],
    sigma: f32,
    bits: u8,
    packed: &mut [u8],
    isa: Isa,
) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if use_avx2(isa) {
        // SAFETY: `use_avx2` checked at run time that the CPU has AVX2 and FMA; the kernel
        // checks every length and returns `None` otherwise.
        return unsafe { avx2::encode_hadamard_mse(g, masks, boundaries, sigma, bits, packed) };
    }
    let _ = (g, masks, boundaries, sigma, bits, packed, isa);
    None
}

/// `Σ x_i²` in the codec's fixed order: 32 lane sums (lane j takes the i ≡ j (mod 32) in
/// increasing i, multiply then add), folded to 8 lanes as `(l[k] + l[k+8]) + (l[k+16] + l[k+24])`
/// and reduced by [`reduce8`]. The order is part of the format (the norm decides the
/// quantization thresholds); 32 lanes = four independent AVX2 accumulators, so the sum is not
/// one long dependency chain.
pub fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 32];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for j in 0..32 {
            lanes[j] += c[j] * c[j];
        }
    }
    for (j, &v) in chunks.remainder().iter().enumerate() {
        lanes[j] += v * v;
    }
    let mut l8 = [0.0f32; 8];
    for (k, v) in l8.iter_mut().enumerate() {
        *v = (lanes[k] + lanes[k + 8]) + (lanes[k + 16] + lanes[k + 24]);
    }
    reduce8(l8)
}

/// The fixed 8-lane reduction tree used by [`sum_squares`]:
/// `((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))`.
#[inline]
pub fn reduce8(l: [f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// `codes[i] = #{k : y[i] > thresholds[k]}` (thresholds increasing).
pub fn quantize_scalar(y: &[f32], thresholds: &[f32], codes: &mut [u8]) {
    for (c, &v) in codes.iter_mut().zip(y) {
        let mut n = 0u8;
        for &t in thresholds {
            n += u8::from(v > t);
        }
        *c = n;
    }
}

/// Quantizes raw rotated coordinates and packs the codes LSB-first into `packed`:
/// `code_i = #{k : y[i] > boundaries[k]·scale}` (thresholds computed once per vector, one f32
/// multiply each). `bits` must equal the codebook's width (1..=8) and `packed` hold
/// `packed_len(y.len(), bits)` bytes; `codes` (same length as y) receives the unpacked codes
/// when given.
pub fn quantize_pack(
    y: &[f32],
    boundaries: &[f32],
    scale: f32,
    bits: u8,
    packed: &mut [u8],
    codes: Option<&mut [u8]>,
    isa: Isa,
) {
    // Up to 4-bit codebooks on the stack; wider ones (never used by TurboQuant) allocate.
    let mut small = [0.0f32; 15];
    let mut large = Vec::new();
    let t: &mut [f32] = if boundaries.len() <= small.len() {
        &mut small[..boundaries.len()]
    } else {
        large.resize(boundaries.len(), 0.0);
        &mut large
    };
    for (ti, &b) in t.iter_mut().zip(boundaries) {
        *ti = b * scale;
    }
    let t = &*t;
    #[cfg(target_arch = "x86_64")]
    if use_avx2(isa) && y.len().is_multiple_of(8) && (1..=4).contains(&bits) {
        // SAFETY: `use_avx2` checked at run time that the CPU has AVX2 and FMA; the kernel
        // checks its slice lengths.
        unsafe { avx2::quantize_pack(y, t, bits, packed) };
        if let Some(codes) = codes {
            let _ = bitpack::unpack(packed, bits, codes);
        }
        return;
    }
    let _ = isa;
    match codes {
        Some(codes) => {
            quantize_scalar(y, t, codes);
            let _ = bitpack::pack(codes, bits, packed);
        }
        None => {
            let mut buf = [0u8; 64];
            for (yc, pc) in y.chunks(64).zip(packed.chunks_mut(8 * usize::from(bits))) {
                let c = &mut buf[..yc.len()];
                quantize_scalar(yc, t, c);
                let _ = bitpack::pack(c, bits, pc);
            }
        }
    }
}

/// Packs QJL sign bits LSB-first: bit i = `v[i] >= 0` (false for NaN). `out` holds
/// `packed_len(v.len(), 1)` bytes.
pub fn pack_signs(v: &[f32], out: &mut [u8], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    if use_avx2(isa) && v.len().is_multiple_of(8) && out.len() == v.len() / 8 {
        // SAFETY: `use_avx2` checked at run time that the CPU has AVX2 and FMA; the lengths
        // were checked just above.
        unsafe { avx2::pack_signs(v, out) };
        return;
    }
    let _ = isa;
    for (o, c) in out.iter_mut().zip(v.chunks(8)) {
        let mut byte = 0u8;
        for (j, &x) in c.iter().enumerate() {
            byte |= u8::from(x >= 0.0) << j;
        }
        *o = byte;
    }
}

/// Little-endian load of up to 8 bytes (missing high bytes are zero).
#[inline]
pub fn load_le(bytes: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    let n = bytes.len().min(8);
    buf[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(buf)
}

/// `Σ_i q[i]·centroids[code_i]` over packed codes (SIMD where available; equal to
/// [`crate::score::dot_codes_ref`] up to rounding).
pub fn dot_codes(q: &[f32], packed: &[u8], bits: u8, centroids: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected; the kernel checks its lengths.
        return unsafe { avx2::dot_codes(q, packed, bits, centroids) };
    }
    crate::score::dot_codes_ref(q, packed, bits, centroids)
}

/// `Σ_i v[i]·(bit_i ? 1 : −1)` (SIMD where available; equal to the reference up to rounding).
pub fn dot_signs(v: &[f32], signs: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected; the kernel checks its lengths.
        return unsafe { avx2::dot_signs(v, signs) };
    }
    crate::score::dot_signs_ref(v, signs)
}

/// `out[i] = scale·centroids[code_i]` over packed codes, `out.len()` of them: the decode of
/// one part in its rotated basis (SIMD where available; the same values as the scalar twin,
/// one multiply each).
pub fn decode_codes(packed: &[u8], bits: u8, centroids: &[f32], scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected; the kernel checks its lengths.
        return unsafe { avx2::decode_codes(packed, bits, centroids, scale, out) };
    }
    decode_codes_scalar(packed, bits, centroids, scale, out)
}

/// Scalar twin of [`decode_codes`]. Codes whose index exceeds the table decode to 0.
pub fn decode_codes_scalar(
    packed: &[u8],
    bits: u8,
    centroids: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    if !(1..=8).contains(&bits) {
        out.fill(0.0);
        return;
    }
    let b = usize::from(bits);
    let mask = (1u64 << b) - 1;
    for (chunk, o8) in packed.chunks(b).zip(out.chunks_mut(8)) {
        let w = load_le(chunk);
        for (j, o) in o8.iter_mut().enumerate() {
            let code = ((w >> (j * b)) & mask) as usize;
            *o = centroids.get(code).map_or(0.0, |&c| c * scale);
        }
    }
}

/// `out[i] = bit_i ? c : −c` over packed sign bits (SIMD where available).
pub fn decode_signs(signs: &[u8], c: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected; the kernel checks its lengths.
        return unsafe { avx2::decode_signs(signs, c, out) };
    }
    decode_signs_scalar(signs, c, out)
}

/// Scalar twin of [`decode_signs`].
pub fn decode_signs_scalar(signs: &[u8], c: f32, out: &mut [f32]) {
    for (&byte, o8) in signs.iter().zip(out.chunks_mut(8)) {
        for (j, o) in o8.iter_mut().enumerate() {
            *o = if (byte >> j) & 1 == 1 { c } else { -c };
        }
    }
}
