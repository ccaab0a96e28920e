//! The SIMD encoder produces exactly the scalar reference's bytes, and the SIMD scorer agrees
//! with the reference to rounding.

use half::f16;
use turbokv_codec::kernels;
use turbokv_codec::prng::Xoshiro256;
use turbokv_codec::score::{dot_codes_ref, dot_signs_ref};
use turbokv_codec::*;

/// Vectors that stress the encoder: Gaussian, heavy-tailed, sparse, constant, tiny, huge,
/// zero and non-finite.
fn nasty_vectors(d: usize, rng: &mut Xoshiro256) -> Vec<Vec<f32>> {
    let mut v = Vec::new();
    for _ in 0..200 {
        v.push((0..d).map(|_| rng.gaussian() as f32).collect());
    }
    for _ in 0..50 {
        v.push(
            (0..d)
                .map(|_| (rng.gaussian().powi(3) * 10.0) as f32)
                .collect(),
        );
    }
    let mut sparse = vec![0.0; d];
    sparse[3] = 1.0;
    v.push(sparse);
    v.push(vec![1.0; d]);
    v.push(vec![1e-30; d]);
    v.push(vec![3e18; d]);
    v.push(vec![0.0; d]);
    let mut nan = vec![1.0; d];
    nan[5] = f32::NAN;
    v.push(nan);
    let mut inf = vec![1.0; d];
    inf[0] = f32::INFINITY;
    v.push(inf);
    v.push((0..d).map(|i| (i % 3) as f32 - 1.0).collect());
    // NaNs with different payloads and signs.
    let mut payloads = vec![0.5; d];
    payloads[0] = f32::from_bits(0xFFFF_4171);
    payloads[1] = f32::from_bits(0x7FC0_0001);
    payloads[d - 1] = f32::from_bits(0xFFFF_FFFF);
    v.push(payloads);
    v
}

/// Found by the `codec_roundtrip` fuzzer: NaNs with different payloads made the scalar and
/// AVX2 encoders store different NaN bit patterns as the norm.
#[test]
fn regression_nan_payload_in_norm() {
    let mut x = vec![0.0f32; 128];
    x[0] = f32::from_bits(0xFFFF_4171);
    x[1..4].fill(f32::from_bits(0xFFFF_FFFF));
    x[4] = f32::from_bits(0x8AFF_FFFF);
    let opts = CodecOptions {
        qjl: QjlSketch::Gaussian,
        base_seed: 14,
        ..Default::default()
    };
    let c = VectorCodec::new("tq3".parse().unwrap(), KvRole::Key, 128, 0, &opts).unwrap();
    let tq = c.tq().unwrap();
    let (mut a, mut b) = (vec![0u8; 48], vec![0u8; 48]);
    let (mut sa, mut sb) = ([f16::ZERO], [f16::ZERO]);
    tq.encode_with_isa(&x, &mut a, &mut sa, Isa::Scalar)
        .unwrap();
    tq.encode_with_isa(&x, &mut b, &mut sb, Isa::detect())
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(sa[0].to_bits(), sb[0].to_bits());
    assert_eq!(sa[0].to_bits(), 0x7E00);
}

#[test]
fn simd_encode_is_bit_identical_to_scalar() {
    if Isa::detect() == Isa::Scalar {
        eprintln!("no SIMD on this CPU: nothing to compare");
        return;
    }
    let mut checked = 0;
    for d in [64usize, 80, 128, 256] {
        let mut rng = Xoshiro256::new(d as u64);
        let xs = nasty_vectors(d, &mut rng);
        for name in ["tq1", "tq1.5", "tq2", "tq2.5", "tq3", "tq3.5", "tq4"] {
            for mode in [KeyMode::Mse, KeyMode::Prod] {
                for norm in [NormMode::Exact, NormMode::Corrected] {
                    let c = TqCodec::new(TqParams {
                        head_dim: d,
                        bits: name[2..].parse().unwrap(),
                        mode,
                        norm,
                        qjl: QjlSketch::Structured,
                        seed: 9,
                        outliers: None,
                    })
                    .unwrap();
                    let mut a = vec![0u8; c.code_bytes()];
                    let mut b = a.clone();
                    let mut sa = vec![f16::ZERO; c.scalars_per_vector()];
                    let mut sb = sa.clone();
                    for x in &xs {
                        c.encode_with_isa(x, &mut a, &mut sa, Isa::Scalar).unwrap();
                        c.encode_with_isa(x, &mut b, &mut sb, Isa::Avx2).unwrap();
                        assert_eq!(a, b, "{name} {mode} {norm:?} d={d} x[..4]={:?}", &x[..4]);
                        let bits = |s: &[f16]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&sa), bits(&sb), "{name} {mode} {norm:?} d={d}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 10_000);
}

#[test]
fn simd_fwht_is_bit_identical() {
    let mut rng = Xoshiro256::new(4);
    for n in [8usize, 16, 32, 64, 128, 256, 512, 1024] {
        let x: Vec<f32> = (0..n).map(|_| rng.gaussian() as f32).collect();
        let mut a = x.clone();
        let mut b = x.clone();
        kernels::fwht_scalar(&mut a);
        kernels::fwht(&mut b);
        assert_eq!(a, b, "n={n}");
        let masks: Vec<u32> = (0..n)
            .map(|i| if i % 3 == 0 { 0x8000_0000 } else { 0 })
            .collect();
        let mut c = vec![0.0; n];
        let mut e = vec![0.0; n];
        let na = kernels::signs_fwht_norm(&x, &masks, &mut c, Isa::Scalar);
        let nb = kernels::signs_fwht_norm(&x, &masks, &mut e, Isa::detect());
        assert_eq!(c, e);
        assert_eq!(na.to_bits(), nb.to_bits());
        assert_eq!(na.to_bits(), kernels::sum_squares(&x).to_bits());
    }
}

#[test]
fn simd_dot_agrees_with_reference() {
    let mut rng = Xoshiro256::new(8);
    for bits in 1..=4u8 {
        for d in [8usize, 64, 128, 96] {
            let q: Vec<f32> = (0..d).map(|_| rng.gaussian() as f32).collect();
            let cents: Vec<f32> = (0..1usize << bits).map(|k| k as f32 * 0.3 - 1.0).collect();
            let codes: Vec<u8> = (0..d).map(|_| rng.below(1 << bits) as u8).collect();
            let mut packed = vec![0u8; bitpack::packed_len(d, bits)];
            bitpack::pack(&codes, bits, &mut packed).unwrap();
            let want: f64 = q
                .iter()
                .zip(&codes)
                .map(|(&a, &c)| a as f64 * cents[c as usize] as f64)
                .sum();
            let r = dot_codes_ref(&q, &packed, bits, &cents) as f64;
            let s = kernels::dot_codes(&q, &packed, bits, &cents) as f64;
            assert!(
                (r - want).abs() < 1e-4 && (s - want).abs() < 1e-4,
                "{bits} {d}: {r} {s} {want}"
            );
            let signs = &packed[..d / 8];
            let r = dot_signs_ref(&q, signs) as f64;
            let s = kernels::dot_signs(&q, signs) as f64;
            assert!((r - s).abs() < 1e-4);
        }
    }
}

/// The SIMD quantizer (a binary search) returns the scalar linear count for every scale,
/// including 0, subnormal, huge, infinite and NaN, and for coordinates exactly on a threshold.
#[test]
fn simd_quantizer_matches_linear_count_at_edges() {
    let mut rng = Xoshiro256::new(12);
    for bits in 1..=4u8 {
        let cb = codebook::Codebook::get(64, bits).unwrap();
        let bounds = cb.boundaries();
        for scale in [
            0.0f32,
            1e-40,
            1e-3,
            1.0,
            8.0,
            1e30,
            3.4e38,
            f32::INFINITY,
            f32::NAN,
        ] {
            let mut y: Vec<f32> = (0..64)
                .map(|_| (rng.gaussian() * 0.2) as f32 * scale)
                .collect();
            // Some coordinates exactly on thresholds, and non-finite ones.
            for (k, &b) in bounds.iter().enumerate() {
                y[k] = b * scale;
            }
            y[40] = f32::NAN;
            y[41] = f32::INFINITY;
            y[42] = f32::NEG_INFINITY;
            y[43] = -0.0;
            let len = bitpack::packed_len(64, bits);
            let (mut a, mut b) = (vec![0u8; len], vec![0u8; len]);
            let (mut ca, mut cb2) = (vec![0u8; 64], vec![0u8; 64]);
            kernels::quantize_pack(&y, bounds, scale, bits, &mut a, Some(&mut ca), Isa::Scalar);
            kernels::quantize_pack(
                &y,
                bounds,
                scale,
                bits,
                &mut b,
                Some(&mut cb2),
                Isa::detect(),
            );
            assert_eq!(a, b, "bits={bits} scale={scale}");
            assert_eq!(ca, cb2);
        }
    }
}
