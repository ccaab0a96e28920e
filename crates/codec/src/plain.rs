//! The uncompressed and 8-bit formats: bf16 / f16 passthrough, and int8 and fp8 with a
//! per-vector scale.
//!
//! * bf16 / f16: `2·d` bytes, little-endian, round-to-nearest-even from f32; no scalars.
//! * int8: `d` bytes of two's-complement codes and one f16 scale per vector:
//!   `s = f16(absmax / 127)`, `q_i = clamp(round(x_i / s), −127, 127)` (IEEE division, round
//!   half away from zero; `q = 0` when `s` is 0 or not finite), `x̂_i = s·q_i`. An f16 scale
//!   (not f32) keeps int8 at 8 + 16/d bits; its 11-bit mantissa only rescales the whole vector
//!   by < 0.05 %, and vectors with absmax above ~8.3e6 are out of range (decode to 0).
//! * fp8: `d` bytes of OCP FP8 E4M3 codes (see [`crate::fp8`]) and one f16 scale per vector:
//!   `s = f16(absmax / 448)` (IEEE division, then f16 round-to-nearest-even),
//!   `q_i = e4m3(x_i / s)` (round to nearest, ties to even, saturating at ±448; `q = 0` when
//!   `s` is 0 or not finite, or `x_i` is NaN), `x̂_i = s·e4m3_value(q_i)`. Where int8 keeps an
//!   absolute step of absmax/127, fp8 keeps a relative one: a coordinate with
//!   `|x_i| ≥ 2⁻⁶·s` (about absmax/28672) comes back with a relative error ≤ 2⁻⁴, a smaller
//!   one with an absolute error ≤ 2⁻¹⁰·s. So fp8 loses to int8 on the large coordinates
//!   (3 mantissa bits) and wins on the small ones. Vectors with absmax above ~2.9e7 are out of
//!   the scale's range (decode to 0).

use half::{bf16, f16};

/// One of the plain formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plain {
    Bf16,
    F16,
    Int8,
    Fp8,
}

impl Plain {
    /// Lengths are checked by the caller.
    pub(crate) fn encode(self, x: &[f32], codes: &mut [u8], scalars: &mut [f16]) {
        match self {
            Plain::Bf16 => {
                for (c, &v) in codes.chunks_exact_mut(2).zip(x) {
                    c.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
            }
            Plain::F16 => {
                for (c, &v) in codes.chunks_exact_mut(2).zip(x) {
                    c.copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            Plain::Int8 => {
                let absmax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let s16 = crate::tq::stored_f16(absmax / 127.0);
                let s = s16.to_f32();
                let ok = s > 0.0 && s.is_finite();
                for (c, &v) in codes.iter_mut().zip(x) {
                    // `as i8` saturates and maps NaN to 0.
                    let q = if ok {
                        (v / s).round().clamp(-127.0, 127.0) as i8
                    } else {
                        0
                    };
                    *c = q as u8;
                }
                scalars[0] = s16;
            }
            Plain::Fp8 => {
                let absmax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let s16 = crate::tq::stored_f16(absmax / crate::fp8::MAX);
                let s = s16.to_f32();
                let ok = s > 0.0 && s.is_finite();
                for (c, &v) in codes.iter_mut().zip(x) {
                    // `fp8::encode` saturates and maps NaN to 0.
                    *c = if ok { crate::fp8::encode(v / s) } else { 0 };
                }
                scalars[0] = s16;
            }
        }
    }

    pub(crate) fn decode(self, codes: &[u8], scalars: &[f16], out: &mut [f32]) {
        match self {
            Plain::Bf16 => {
                for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Plain::F16 => {
                for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Plain::Int8 => {
                let s = scalars[0].to_f32();
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = s * f32::from(c as i8);
                }
            }
            Plain::Fp8 => {
                let s = scalars[0].to_f32();
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = s * crate::fp8::decode(c);
                }
            }
        }
    }

    /// `⟨q, x̂⟩` straight from the codes.
    pub(crate) fn score(self, q: &[f32], codes: &[u8], scalars: &[f16]) -> f32 {
        match self {
            Plain::Bf16 => q
                .iter()
                .zip(codes.chunks_exact(2))
                .map(|(&a, c)| a * bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .sum(),
            Plain::F16 => q
                .iter()
                .zip(codes.chunks_exact(2))
                .map(|(&a, c)| a * f16::from_le_bytes([c[0], c[1]]).to_f32())
                .sum(),
            Plain::Int8 => {
                let dot: f32 = q
                    .iter()
                    .zip(codes)
                    .map(|(&a, &c)| a * f32::from(c as i8))
                    .sum();
                scalars[0].to_f32() * dot
            }
            Plain::Fp8 => {
                let dot: f32 = q
                    .iter()
                    .zip(codes)
                    .map(|(&a, &c)| a * crate::fp8::decode(c))
                    .sum();
                scalars[0].to_f32() * dot
            }
        }
    }

    /// `acc += w·x̂` straight from the codes.
    pub(crate) fn accumulate(self, acc: &mut [f32], w: f32, codes: &[u8], scalars: &[f16]) {
        match self {
            Plain::Bf16 => {
                for (a, c) in acc.iter_mut().zip(codes.chunks_exact(2)) {
                    *a += w * bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Plain::F16 => {
                for (a, c) in acc.iter_mut().zip(codes.chunks_exact(2)) {
                    *a += w * f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Plain::Int8 => {
                let ws = w * scalars[0].to_f32();
                for (a, &c) in acc.iter_mut().zip(codes) {
                    *a += ws * f32::from(c as i8);
                }
            }
            Plain::Fp8 => {
                let ws = w * scalars[0].to_f32();
                for (a, &c) in acc.iter_mut().zip(codes) {
                    *a += ws * crate::fp8::decode(c);
                }
            }
        }
    }
}
