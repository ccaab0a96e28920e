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
    /// Whether the stored scale is `n / ‖c[idx]‖` ([`NormMode::Corrected`]) instead of `n`;
    /// only the encoder differs, decoding is the same.
    pub corrected: bool,
}

impl VectorCodec {
    /// The device description of this codec, or `None` for formats a device kernel does not
    /// read directly (16-bit, outlier splits, QJL keys, 0-bit codes, dense rotations).
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
                        corrected: part.norm == NormMode::Corrected,
                    })
                })
            }
        }
    }
}

/// A TurboQuant format of any shape a device reads through [`DeviceParts`]: one or two parts
/// (a fractional width's outlier split), MSE codes of 1–4 bits, optional QJL sign bits
/// (prod keys, structured sketch), exact or corrected norms, randomized Hadamard rotations.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceParts {
    /// The parts in record order; part p's rotated coordinates follow part p − 1's in the
    /// basis a device attends in (`[R₀·x[ch₀] ; R₁·x[ch₁]]`).
    pub parts: Vec<DevicePart>,
    /// Whether a stored scale is `n / ‖c[idx]‖` ([`NormMode::Corrected`]) instead of `n`.
    pub corrected_norm: bool,
}

/// One part of a [`DeviceParts`] format: its channels, codes and rotation.
#[derive(Debug, Clone, PartialEq)]
pub struct DevicePart {
    /// The head-vector channels of this part, in part order (every channel for one part).
    pub channels: Vec<u16>,
    /// MSE code width (1–4).
    pub bits: u8,
    /// The `2^bits` Lloyd–Max centroids and `2^bits − 1` boundaries (see [`HadamardMse`]).
    pub centroids: Vec<f32>,
    /// Decision boundaries, compared with `y_i` against `boundary_k · (n · σ)`.
    pub boundaries: Vec<f32>,
    /// The rotation's sign masks and `σ = √m`.
    pub sign_masks: Vec<u32>,
    /// `σ` of the rotation (`√m`).
    pub sigma: f32,
    /// Byte offset of the part's MSE codes in the token's record (LSB-first packing).
    pub code_offset: usize,
    /// Index of the part's scale among the token's f16 scalars (γ follows in prod mode).
    pub scalar_index: usize,
    /// The QJL stage of a prod key part.
    pub qjl: Option<DeviceQjl>,
}

/// The structured QJL sketch of a part: `S = √m·(H·D₃/√m)·(H·D₂/√m)`.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceQjl {
    /// Sign masks of the first and second randomized Hadamard (`D₂`, `D₃`).
    pub sign_masks: [Vec<u32>; 2],
    /// Byte offset of the sign bits in the record.
    pub sign_offset: usize,
    /// The estimator constant κ: `x̂ = Rᵀ(s·c[idx] + γ·κ·Sᵀ·sign)`.
    pub constant: f32,
}

impl VectorCodec {
    /// The part-wise device description of a TurboQuant codec, or `None` for plain formats
    /// and for what devices do not read (dense rotations, a Gaussian QJL matrix, 0-bit MSE
    /// codes). Every format [`VectorCodec::device_format`] describes as TurboQuant is also
    /// described here, as one part.
    pub fn device_parts(&self) -> Option<DeviceParts> {
        let Format::Tq(t) = &self.format else {
            return None;
        };
        let head_dim = t.params().head_dim;
        let parts = t
            .parts
            .iter()
            .map(|p| {
                let (masks, sigma) = p.rotation.hadamard_parts()?;
                if p.mse_bits == 0 || p.mse_bits > 4 {
                    return None;
                }
                let qjl = match &p.qjl {
                    None => None,
                    Some(q) => {
                        let [a, b] = q.structured_masks()?;
                        Some(DeviceQjl {
                            sign_masks: [a.to_vec(), b.to_vec()],
                            sign_offset: p.sign_offset,
                            constant: q.constant,
                        })
                    }
                };
                let channels = match &p.channels {
                    Some(c) => c.clone(),
                    None => (0..head_dim as u16).collect(),
                };
                Some(DevicePart {
                    channels,
                    bits: p.mse_bits,
                    centroids: p.codebook.centroids().to_vec(),
                    boundaries: p.codebook.boundaries().to_vec(),
                    sign_masks: masks.to_vec(),
                    sigma,
                    code_offset: p.code_offset,
                    scalar_index: p.scalar_index,
                    qjl,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(DeviceParts {
            parts,
            corrected_norm: t.parts.first()?.norm == NormMode::Corrected,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CodecOptions, KvDtype, KvRole, TqBits, f16};

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
        // Corrected norms change only the encoder's scale: still a direct format.
        let corrected = CodecOptions {
            norm: NormMode::Corrected,
            ..Default::default()
        };
        let Some(DeviceFormat::HadamardMse(h)) =
            codec("tq2", KvRole::Key, 64, &corrected).device_format()
        else {
            panic!("corrected tq2 has a device format");
        };
        assert!(h.corrected);
        // Head dims that are not powers of two use a dense rotation.
        assert!(codec("tq3", KvRole::Key, 96, &o).device_format().is_none());
        let _ = TqBits::B3;
    }

    /// The description reproduces the codec: encoding with its numbers in the documented
    /// order gives the codec's own codes and scale (what a device encoder implements), with
    /// exact and with corrected norms.
    #[test]
    fn the_description_reproduces_the_encoder() {
        let mut rng = crate::prng::Xoshiro256::new(7);
        let cases = [("tq3", 64), ("tq4", 128), ("tq2", 128), ("tq2", 64)];
        for ((dtype, d), norm) in cases
            .into_iter()
            .flat_map(|c| [(c, NormMode::Exact), (c, NormMode::Corrected)])
        {
            let o = CodecOptions {
                norm,
                ..Default::default()
            };
            let c = codec(dtype, KvRole::Key, d, &o);
            let Some(DeviceFormat::HadamardMse(h)) = c.device_format() else {
                panic!("{dtype} {norm:?}");
            };
            assert_eq!(h.corrected, norm == NormMode::Corrected);
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
                // Corrected: n / ‖c[idx]‖, the centroids' squares summed in the codec's order.
                let scale = if h.corrected {
                    let cents: Vec<f32> =
                        idx.iter().map(|&k| h.centroids[usize::from(k)]).collect();
                    n / crate::kernels::sum_squares(&cents).sqrt()
                } else {
                    n
                };
                assert_eq!(sc[0], crate::tq::stored_f16(scale), "{dtype} {norm:?}");
            }
        }
    }

    /// Encodes `x` with a [`DeviceParts`] description in the order a device kernel follows
    /// (write_kv_parts in the CUDA backend): per part gather, ‖g‖² in the codec's order,
    /// signs + FWHT, codes against `b_k·(n·σ)`, the (corrected) scale, and for prod the
    /// residual's γ and the signs of `FWHT(D₃·FWHT(D₂·r))`.
    fn encode_with_parts(p: &DeviceParts, x: &[f32], codes: &mut [u8], scalars: &mut [f16]) {
        for part in &p.parts {
            let m = part.channels.len();
            let g: Vec<f32> = part.channels.iter().map(|&c| x[usize::from(c)]).collect();
            let nsq = crate::kernels::sum_squares(&g);
            let mut y: Vec<f32> = g
                .iter()
                .zip(&part.sign_masks)
                .map(|(v, mk)| f32::from_bits(v.to_bits() ^ mk))
                .collect();
            crate::kernels::fwht_scalar(&mut y);
            let n = nsq.sqrt();
            let t = n * part.sigma;
            let idx: Vec<u8> = y
                .iter()
                .map(|&v| part.boundaries.iter().filter(|&&b| v > b * t).count() as u8)
                .collect();
            let bytes = crate::bitpack::packed_len(m, part.bits);
            let at = part.code_offset;
            crate::bitpack::pack(&idx, part.bits, &mut codes[at..at + bytes]).unwrap();
            let scale = if p.corrected_norm {
                let c: Vec<f32> = idx
                    .iter()
                    .map(|&k| part.centroids[usize::from(k)])
                    .collect();
                let cn = crate::kernels::sum_squares(&c).sqrt();
                if cn > 0.0 { n / cn } else { n }
            } else {
                n
            };
            let s16 = crate::tq::stored_f16(scale);
            scalars[part.scalar_index] = s16;
            let Some(q) = &part.qjl else { continue };
            let a = s16.to_f32() * part.sigma;
            let mut r: Vec<f32> = y
                .iter()
                .zip(&idx)
                .map(|(&yi, &k)| yi - a * part.centroids[usize::from(k)])
                .collect();
            let gamma = crate::kernels::sum_squares(&r).sqrt() / part.sigma;
            scalars[part.scalar_index + 1] = crate::tq::stored_f16(gamma);
            for masks in &q.sign_masks {
                for (v, mk) in r.iter_mut().zip(masks) {
                    *v = f32::from_bits(v.to_bits() ^ mk);
                }
                crate::kernels::fwht_scalar(&mut r);
            }
            let signs: Vec<u8> = r.iter().map(|&v| u8::from(v >= 0.0)).collect();
            let at = q.sign_offset;
            crate::bitpack::pack(&signs, 1, &mut codes[at..at + m / 8]).unwrap();
        }
    }

    /// Decodes with a description: per part `v = s·c[idx] (+ γ·κ·√m·R₂ᵀ... of the signs)`
    /// in the rotated basis, then `Rᵀ` and the scatter (a device's dequantize + un-rotate).
    fn decode_with_parts(p: &DeviceParts, codes: &[u8], scalars: &[f16], out: &mut [f32]) {
        let inverse = |v: &mut [f32], masks: &[u32], sigma: f32| {
            crate::kernels::fwht_scalar(v);
            for (x, mk) in v.iter_mut().zip(masks) {
                *x = f32::from_bits((*x / sigma).to_bits() ^ mk);
            }
        };
        for part in &p.parts {
            let m = part.channels.len();
            let s = scalars[part.scalar_index].to_f32();
            let mut v: Vec<f32> = (0..m)
                .map(|i| {
                    let k = crate::bitpack::get(&codes[part.code_offset..], part.bits, i);
                    s * part.centroids[usize::from(k)]
                })
                .collect();
            if let Some(q) = &part.qjl {
                let gamma = scalars[part.scalar_index + 1].to_f32();
                let mut w: Vec<f32> = (0..m)
                    .map(|i| {
                        let b = crate::bitpack::get(&codes[q.sign_offset..], 1, i);
                        if b == 1 { 1.0 } else { -1.0 }
                    })
                    .collect();
                inverse(&mut w, &q.sign_masks[1], part.sigma);
                inverse(&mut w, &q.sign_masks[0], part.sigma);
                let c = gamma * q.constant * part.sigma;
                for (vi, wi) in v.iter_mut().zip(&w) {
                    *vi += c * wi;
                }
            }
            inverse(&mut v, &part.sign_masks, part.sigma);
            for (&ch, &vi) in part.channels.iter().zip(&v) {
                out[usize::from(ch)] = vi;
            }
        }
    }

    #[test]
    fn parts_describe_fractional_prod_and_corrected_formats() {
        let mut rng = crate::prng::Xoshiro256::new(11);
        let prod = CodecOptions {
            key_mode: crate::KeyMode::Prod,
            ..Default::default()
        };
        let corrected = CodecOptions {
            norm: NormMode::Corrected,
            ..Default::default()
        };
        let plain = CodecOptions::default();
        // Calibrated outliers: any half of the channels (here every third, then the rest).
        let scattered = |d: usize| -> Vec<u16> {
            let mut ch: Vec<u16> = (0..d as u16).filter(|c| c % 3 == 0).collect();
            ch.extend((0..d as u16).filter(|c| c % 3 != 0).take(d / 2 - ch.len()));
            ch
        };
        let calibrated = CodecOptions {
            key_outliers: Some(crate::OutlierChannels::new(128, &scattered(128)).unwrap()),
            key_mode: crate::KeyMode::Prod,
            ..Default::default()
        };
        let cases: [(&str, usize, &CodecOptions, usize, bool); 9] = [
            ("tq3.5", 128, &plain, 2, false),
            ("tq2.5", 64, &plain, 2, false),
            ("tq1.5", 128, &plain, 2, false),
            ("tq3", 128, &prod, 1, true),
            ("tq2", 64, &prod, 1, true),
            ("tq3.5", 128, &prod, 2, true),
            ("tq3", 64, &corrected, 1, false),
            ("tq4", 128, &plain, 1, false),
            ("tq2.5", 128, &calibrated, 2, true),
        ];
        for (dtype, d, opts, n_parts, has_qjl) in cases {
            let c = codec(dtype, KvRole::Key, d, opts);
            let p = c.device_parts().expect(dtype);
            assert_eq!(p.parts.len(), n_parts, "{dtype}");
            assert_eq!(p.corrected_norm, opts.norm == NormMode::Corrected);
            let mut seen: Vec<u16> = p.parts.iter().flat_map(|q| q.channels.clone()).collect();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..d as u16).collect::<Vec<_>>(),
                "{dtype}: every channel once"
            );
            for part in &p.parts {
                assert_eq!(part.qjl.is_some(), has_qjl, "{dtype}");
                assert_eq!(part.sign_masks.len(), part.channels.len());
                assert_eq!(part.centroids.len(), 1 << part.bits);
            }
            let sizes = c.token_sizes();
            let mut max_err = 0f32;
            for _ in 0..40 {
                let x: Vec<f32> = (0..d).map(|_| rng.gaussian() as f32).collect();
                let (mut want, mut want_s) =
                    (vec![0u8; sizes.code_bytes], vec![f16::ZERO; sizes.scalars]);
                c.encode(&x, &mut want, &mut want_s).unwrap();
                let (mut got, mut got_s) =
                    (vec![0u8; sizes.code_bytes], vec![f16::ZERO; sizes.scalars]);
                encode_with_parts(&p, &x, &mut got, &mut got_s);
                assert_eq!(got, want, "{dtype}: codes");
                assert_eq!(got_s, want_s, "{dtype}: scalars");
                let mut a = vec![0f32; d];
                let mut b = vec![0f32; d];
                c.decode(&want, &want_s, &mut a).unwrap();
                decode_with_parts(&p, &want, &want_s, &mut b);
                for (u, v) in a.iter().zip(&b) {
                    max_err = max_err.max((u - v).abs());
                }
            }
            assert!(max_err < 1e-4, "{dtype}: decode differs by {max_err}");
        }
        // The calibrated outlier part is the given channels (sorted), not the leading ones.
        let c = codec("tq2.5", KvRole::Key, 128, &calibrated);
        let mut want = scattered(128);
        want.sort_unstable();
        assert_eq!(c.device_parts().unwrap().parts[0].channels, want);
        // A dense rotation (head_dim 96) is not described.
        assert!(
            codec("tq3", KvRole::Key, 96, &plain)
                .device_parts()
                .is_none()
        );
        assert!(
            codec("int8", KvRole::Key, 64, &plain)
                .device_parts()
                .is_none()
        );
    }
}
