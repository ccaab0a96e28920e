//! What the CPU attention tests share: a seeded generator and the vectors a pool holds (its
//! codes decoded, or a window's f16 copies).

/// xorshift64 generator of uniform values in [-1, 1).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Tokens per cache block in these tests.
pub const BLOCK: usize = 16;

/// Decoded copy of what the pool stores for one vector.
pub fn roundtrip(codec: &turbokv_codec::VectorCodec, x: &[f32]) -> Vec<f32> {
    let layout = codec.block_layout(1).unwrap();
    let mut block = vec![0u8; layout.total_bytes];
    codec.encode_slot(x, &mut block, &layout, 0).unwrap();
    let mut out = vec![0f32; x.len()];
    codec.decode_slot(&block, &layout, 0, &mut out).unwrap();
    out
}

/// f16-rounded copy of `x`.
pub fn f16_round(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// What a full-precision window holds for `x`, back in the original basis: `x` rounded to
/// f16, brought into the codec's working basis (a rotation for TurboQuant) and rounded to
/// f16 again there, as the CPU pool keeps its copies. The second rounding moves each working
/// coordinate by at most 2⁻¹¹ of itself, which came to 4e-4–9e-4 of an output row in these
/// tests, above the 2e-4 they allow for arithmetic: so the reference applies it rather than
/// the tolerance absorbing it.
pub fn window_copy(codec: &turbokv_codec::VectorCodec, x: &[f32]) -> Vec<f32> {
    let mut work = vec![0f32; codec.work_dim()];
    codec.exact_to_work(&f16_round(x), &mut work).unwrap();
    let mut out = vec![0f32; x.len()];
    codec.work_to_output(&f16_round(&work), &mut out).unwrap();
    out
}
