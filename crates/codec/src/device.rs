//! What a device backend needs to reproduce a format's encoder and read its codes: the
//! formats whose every code comes from one run of codes with one per-vector scale and (for
//! TurboQuant) one randomized Hadamard rotation. A GPU encodes with these numbers in the
//! codec's exact operation order (see [`crate::tq`], [`crate::kernels::sum_squares`]) and
//! attends in the rotated basis, rotating the query once and the output back once.

use crate::codec::{Format, VectorCodec};
use crate::plain::Plain;
use crate::tq::NormMode;

/// A format a device can encode and attend over directly.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceFormat {
    /// `int8` (see [`crate::plain`]): d two's-complement bytes and an f16 absmax/127 scale.
    Int8,
    /// `fp8` (see [`crate::fp8`]): d OCP E4M3 bytes and an f16 absmax/448 scale.
    Fp8,
    /// TurboQuant-MSE with a single part, exact norms and a Hadamard rotation.
    HadamardMse(HadamardMse),
}

/// The numbers of a single-part TurboQuant-MSE format with a randomized Hadamard rotation.
#[derive(Debug, Clone, PartialEq)]
pub struct HadamardMse {
    /// Code width (1–4).
    pub bits: u8,
    /// The `2^bits` Lloyd–Max centroids (unit-vector coordinates, ascending).
    pub centroids: Vec<f32>,
    /// The `2^bits − 1` decision boundaries; the encoder compares the raw rotated coordinate
    /// `y_i` with `boundary_k · (n · sigma)`.
    pub boundaries: Vec<f32>,
    /// XOR masks (0 or `0x8000_0000`) of the rotation's signs, one per coordinate.
    pub sign_masks: Vec<u32>,
    /// `σ = √d` as f32 (the unnormalised FWHT's gain).
    pub sigma: f32,
    /// `1/σ`: `R·x = scale · FWHT(D·x)` and `Rᵀ·y = D · (scale · FWHT(y))`.
    pub scale: f32,
}

impl VectorCodec {
    /// The device description of this codec, or `None` for formats a device kernel does not
    /// read directly (16-bit, outlier splits, QJL keys, corrected norms, dense rotations).
    pub fn device_format(&self) -> Option<DeviceFormat> {
        match &self.format {
            Format::Plain(Plain::Int8) => Some(DeviceFormat::Int8),
            Format::Plain(Plain::Fp8) => Some(DeviceFormat::Fp8),
            Format::Plain(_) => None,
            Format::Tq(t) => {
                let [part] = t.parts.as_slice() else {
                    return None;
                };
                let (sign_masks, sigma) = part.rotation.hadamard_parts()?;
                let plain = part.channels.is_none()
                    && part.qjl.is_none()
                    && part.norm == NormMode::Exact
                    && (1..=4).contains(&part.mse_bits)
                    && part.code_offset == 0
                    && part.scalar_index == 0;
                plain.then(|| {
                    DeviceFormat::HadamardMse(HadamardMse {
                        bits: part.mse_bits,
                        centroids: part.codebook.centroids().to_vec(),
                        boundaries: part.codebook.boundaries().to_vec(),
                        sign_masks: sign_masks.to_vec(),
                        sigma,
                        scale: 1.0 / sigma,
                    })
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CodecOptions, KvDtype, KvRole, TqBits};

    fn codec(dtype: &str, role: KvRole, d: usize, opts: &CodecOptions) -> VectorCodec {
        VectorCodec::new(dtype.parse::<KvDtype>().unwrap(), role, d, 3, opts).unwrap()
    }

    #[test]
    fn direct_formats_are_described_and_others_are_not() {
        let o = CodecOptions::default();
        assert_eq!(
            codec("int8", KvRole::Key, 128, &o).device_format(),
            Some(DeviceFormat::Int8)
        );
        assert_eq!(
            codec("fp8", KvRole::Value, 64, &o).device_format(),
            Some(DeviceFormat::Fp8)
        );
        for bits in [2u8, 3, 4] {
            let c = codec(&format!("tq{bits}"), KvRole::Value, 128, &o);
            let Some(DeviceFormat::HadamardMse(h)) = c.device_format() else {
                panic!("tq{bits} has a device format");
            };
            assert_eq!(h.bits, bits);
            assert_eq!(h.centroids.len(), 1 << bits);
            assert_eq!(h.boundaries.len(), (1 << bits) - 1);
            assert_eq!(h.sign_masks.len(), 128);
            assert!((h.sigma * h.scale - 1.0).abs() < 1e-6);
        }
        assert!(
            codec("bf16", KvRole::Key, 128, &o)
                .device_format()
                .is_none()
        );
        assert!(
            codec("tq2.5", KvRole::Key, 128, &o)
                .device_format()
                .is_none()
        );
        let prod = CodecOptions {
            key_mode: crate::KeyMode::Prod,
            ..Default::default()
        };
        assert!(
            codec("tq3", KvRole::Key, 128, &prod)
                .device_format()
                .is_none()
        );
        // Values never use prod mode, so the same options still describe them.
        assert!(
            codec("tq3", KvRole::Value, 128, &prod)
                .device_format()
                .is_some()
        );
        // Head dims that are not powers of two use a dense rotation.
        assert!(codec("tq3", KvRole::Key, 96, &o).device_format().is_none());
        let _ = TqBits::B3;
    }

    /// The description reproduces the codec: encoding with its numbers in the documented
    /// order gives the codec's own codes (what a device encoder implements).
    #[test]
    fn the_description_reproduces_the_encoder() {
        let o = CodecOptions::default();
        let mut rng = crate::prng::Xoshiro256::new(7);
        for (dtype, d) in [("tq3", 64), ("tq4", 128), ("tq2", 128)] {
            let c = codec(dtype, KvRole::Key, d, &o);
            let Some(DeviceFormat::HadamardMse(h)) = c.device_format() else {
                panic!("{dtype}");
            };
            for _ in 0..50 {
                let x: Vec<f32> = (0..d).map(|_| rng.gaussian() as f32).collect();
                let mut y: Vec<f32> = x
                    .iter()
                    .zip(&h.sign_masks)
                    .map(|(v, m)| f32::from_bits(v.to_bits() ^ m))
                    .collect();
                crate::kernels::fwht_scalar(&mut y);
                let n = crate::kernels::sum_squares(&x).sqrt();
                let idx: Vec<u8> = y
                    .iter()
                    .map(|&v| {
                        h.boundaries
                            .iter()
                            .filter(|&&b| v > b * (n * h.sigma))
                            .count() as u8
                    })
                    .collect();
                let mut want = vec![0u8; crate::bitpack::packed_len(d, h.bits)];
                crate::bitpack::pack(&idx, h.bits, &mut want).unwrap();
                let sizes = c.token_sizes();
                let (mut codes, mut sc) = (vec![0u8; sizes.code_bytes], vec![crate::f16::ZERO; 1]);
                c.encode(&x, &mut codes, &mut sc).unwrap();
                assert_eq!(codes, want, "{dtype}");
                assert_eq!(sc[0], crate::tq::stored_f16(n));
            }
        }
    }
}
