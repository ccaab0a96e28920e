//! Every format: slot round trips under a committed error budget, on-code scoring and value
//! accumulation equal to the dequantized reference, determinism, and typed errors.

use half::f16;
use turbokv_codec::prng::Xoshiro256;
use turbokv_codec::*;

fn gaussian(rng: &mut Xoshiro256, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gaussian() as f32).collect()
}

/// Relative squared error budget per dtype (unit-variance Gaussian vectors, d = 128, 400
/// vectors). Measured: bf16 2.8e-6, f16 4.3e-8, int8 4.2e-5, fp8 6.6e-4, tq4 0.0094,
/// tq3.5 0.0214, tq3 0.0340, tq2.5 0.0745, tq2 0.1158, tq1.5 0.237, tq1 0.360.
const BUDGET: &[(&str, f64)] = &[
    ("bf16", 3.2e-6),
    ("f16", 5.0e-8),
    ("int8", 4.8e-5),
    ("fp8", 7.0e-4),
    ("tq4", 0.0100),
    ("tq3.5", 0.0225),
    ("tq3", 0.0357),
    ("tq2.5", 0.0785),
    ("tq2", 0.1215),
    ("tq1.5", 0.249),
    ("tq1", 0.378),
];

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num / den
}

#[test]
fn value_round_trip_within_budget() {
    let d = 128;
    let opts = CodecOptions::default();
    for &(name, budget) in BUDGET {
        let dtype: KvDtype = name.parse().unwrap();
        let c = VectorCodec::new(dtype, KvRole::Value, d, 3, &opts).unwrap();
        let layout = c.block_layout(16).unwrap();
        let mut block = vec![0u8; layout.total_bytes];
        let mut rng = Xoshiro256::new(11);
        let (mut err, n) = (0.0, 400);
        for i in 0..n {
            let x = gaussian(&mut rng, d);
            c.encode_slot(&x, &mut block, &layout, i % 16).unwrap();
            let mut y = vec![0.0; d];
            c.decode_slot(&block, &layout, i % 16, &mut y).unwrap();
            err += rel_err(&y, &x);
        }
        let err = err / n as f64;
        assert!(err < budget, "{name}: {err} >= {budget}");
        assert!(err > budget * 0.8, "{name}: budget too loose ({err})");
    }
}

fn all_codecs(d: usize) -> Vec<(String, VectorCodec)> {
    let mut v = Vec::new();
    for name in [
        "bf16", "f16", "int8", "fp8", "tq1", "tq2", "tq2.5", "tq3", "tq3.5", "tq4",
    ] {
        let dtype: KvDtype = name.parse().unwrap();
        for mode in [KeyMode::Mse, KeyMode::Prod] {
            for norm in [NormMode::Exact, NormMode::Corrected] {
                let opts = CodecOptions {
                    key_mode: mode,
                    norm,
                    base_seed: 5,
                    ..Default::default()
                };
                let c = VectorCodec::new(dtype, KvRole::Key, d, 1, &opts).unwrap();
                v.push((format!("{name}/{mode}/{norm:?}/d{d}"), c));
            }
        }
    }
    v
}

#[test]
fn scoring_on_codes_matches_dequantized_dot() {
    for d in [64usize, 80, 128] {
        for (name, c) in all_codecs(d) {
            let layout = c.block_layout(8).unwrap();
            let mut block = vec![0u8; layout.total_bytes];
            let mut rng = Xoshiro256::new(d as u64);
            let xs: Vec<Vec<f32>> = (0..8).map(|_| gaussian(&mut rng, d)).collect();
            for (t, x) in xs.iter().enumerate() {
                c.encode_slot(x, &mut block, &layout, t).unwrap();
            }
            let q = gaussian(&mut rng, d);
            let pq = c.prepare_query(&q).unwrap();
            let mut scores = vec![0.0; 8];
            c.score_block(&pq, &block, &layout, &mut scores).unwrap();
            let pq_lut = c.prepare_query_lut(&q).unwrap();
            let mut lut_scores = vec![0.0; 8];
            c.score_block(&pq_lut, &block, &layout, &mut lut_scores)
                .unwrap();
            let weights: Vec<f32> = (0..8).map(|t| 0.05 + t as f32 * 0.03).collect();
            let mut acc = c.new_accumulator();
            c.accumulate_block(&mut acc, &block, &layout, &weights)
                .unwrap();
            let mut out = vec![0.0; d];
            c.finish(&acc, &mut out).unwrap();
            let mut want_out = vec![0.0f64; d];
            for t in 0..8 {
                let mut xh = vec![0.0; d];
                c.decode_slot(&block, &layout, t, &mut xh).unwrap();
                let dot: f64 = q
                    .iter()
                    .zip(&xh)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum();
                let scale: f64 = q.iter().map(|a| (*a as f64).abs()).sum::<f64>()
                    * xh.iter().map(|a| (*a as f64).abs()).fold(0.0, f64::max);
                assert!(
                    (scores[t] as f64 - dot).abs() <= 2e-5 * scale + 1e-6,
                    "{name} t={t}: {} vs {dot}",
                    scores[t]
                );
                assert!(
                    (lut_scores[t] as f64 - dot).abs() <= 2e-5 * scale + 1e-6,
                    "{name} t={t} (lut): {} vs {dot}",
                    lut_scores[t]
                );
                for (w, v) in want_out.iter_mut().zip(&xh) {
                    *w += weights[t] as f64 * *v as f64;
                }
            }
            let norm = want_out.iter().map(|v| v * v).sum::<f64>().sqrt();
            for (o, w) in out.iter().zip(&want_out) {
                assert!((*o as f64 - w).abs() <= 1e-5 * norm, "{name}: {o} vs {w}");
            }
        }
    }
}

#[test]
fn encoding_is_deterministic_and_seeded() {
    let d = 128;
    let mut rng = Xoshiro256::new(1);
    let x = gaussian(&mut rng, d);
    let enc = |layer: u32, seed: u64| {
        let opts = CodecOptions {
            base_seed: seed,
            ..Default::default()
        };
        let c = VectorCodec::new("tq3".parse().unwrap(), KvRole::Key, d, layer, &opts).unwrap();
        let mut codes = vec![0u8; c.token_sizes().code_bytes];
        let mut sc = vec![f16::ZERO; 1];
        c.encode(&x, &mut codes, &mut sc).unwrap();
        codes
    };
    assert_eq!(enc(0, 1), enc(0, 1));
    assert_ne!(enc(0, 1), enc(1, 1));
    assert_ne!(enc(0, 1), enc(0, 2));
    // Keys and values of one layer use different rotations.
    let opts = CodecOptions::default();
    let l = LayerCodec::new("tq3".parse().unwrap(), d, 0, &opts).unwrap();
    let (mut a, mut b) = (vec![0u8; 48], vec![0u8; 48]);
    let mut sc = [f16::ZERO];
    l.key.encode(&x, &mut a, &mut sc).unwrap();
    l.value.encode(&x, &mut b, &mut sc).unwrap();
    assert_ne!(a, b);
}

#[test]
fn norm_correction_preserves_norm() {
    let d = 128;
    let opts = CodecOptions {
        norm: NormMode::Corrected,
        ..Default::default()
    };
    let c = VectorCodec::new("tq2".parse().unwrap(), KvRole::Value, d, 0, &opts).unwrap();
    let mut rng = Xoshiro256::new(2);
    for _ in 0..50 {
        let x = gaussian(&mut rng, d);
        let mut codes = vec![0u8; 32];
        let mut sc = [f16::ZERO];
        c.encode(&x, &mut codes, &mut sc).unwrap();
        let mut y = vec![0.0; d];
        c.decode(&codes, &sc, &mut y).unwrap();
        let nx: f32 = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        let ny: f32 = y.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((nx - ny).abs() / nx < 1e-3, "{nx} vs {ny}");
    }
}

#[test]
fn outlier_split_uses_given_channels() {
    let d = 128;
    let mut energy = vec![1.0f32; d];
    for c in (0..d).step_by(2) {
        energy[c] = 10.0;
    }
    let outl = OutlierChannels::from_channel_energy(&energy, d / 2).unwrap();
    let opts = CodecOptions {
        value_outliers: Some(outl.clone()),
        ..Default::default()
    };
    let c = VectorCodec::new("tq2.5".parse().unwrap(), KvRole::Value, d, 0, &opts).unwrap();
    assert_eq!(c.tq().unwrap().params().outliers.as_ref(), Some(&outl));
    // Vectors whose energy sits in the outlier channels reconstruct better than ones whose
    // energy sits in the regular channels (3 vs 2 bits).
    let mut rng = Xoshiro256::new(3);
    let (mut e_hi, mut e_lo) = (0.0, 0.0);
    for _ in 0..200 {
        let g = gaussian(&mut rng, d);
        let hi: Vec<f32> = (0..d)
            .map(|i| if i % 2 == 0 { g[i] * 4.0 } else { g[i] })
            .collect();
        let lo: Vec<f32> = (0..d)
            .map(|i| if i % 2 == 1 { g[i] * 4.0 } else { g[i] })
            .collect();
        for (x, e) in [(&hi, &mut e_hi), (&lo, &mut e_lo)] {
            let mut codes = vec![0u8; c.token_sizes().code_bytes];
            let mut sc = [f16::ZERO; 2];
            c.encode(x, &mut codes, &mut sc).unwrap();
            let mut y = vec![0.0; d];
            c.decode(&codes, &sc, &mut y).unwrap();
            *e += rel_err(&y, x);
        }
    }
    assert!(e_hi < 0.5 * e_lo, "{e_hi} vs {e_lo}");
    // A wrong-sized outlier set is refused.
    let bad = CodecOptions {
        value_outliers: Some(OutlierChannels::leading(d, 10).unwrap()),
        ..Default::default()
    };
    let err = VectorCodec::new("tq2.5".parse().unwrap(), KvRole::Value, d, 0, &bad);
    assert!(matches!(err, Err(Error::InvalidOutliers { .. })));
}

#[test]
fn bad_inputs_are_typed_errors() {
    let c = VectorCodec::new(
        "tq3".parse().unwrap(),
        KvRole::Key,
        64,
        0,
        &CodecOptions::default(),
    )
    .unwrap();
    let layout = c.block_layout(4).unwrap();
    let mut block = vec![0u8; layout.total_bytes];
    let x = vec![1.0; 64];
    assert!(matches!(
        c.encode_slot(&x, &mut block, &layout, 4),
        Err(Error::SlotOutOfRange { .. })
    ));
    assert!(matches!(
        c.encode_slot(&x[..63], &mut block, &layout, 0),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(c.encode_slot(&x, &mut block[1..], &layout, 0).is_err());
    let other = VectorCodec::new(
        "tq4".parse().unwrap(),
        KvRole::Key,
        64,
        0,
        &CodecOptions::default(),
    )
    .unwrap();
    assert!(other.encode_slot(&x, &mut block, &layout, 0).is_err());
    let pq = other.prepare_query(&x).unwrap();
    let pq_ok = c.prepare_query(&x).unwrap();
    let mut out = [0.0f32; 2];
    c.score_block(&pq_ok, &block, &layout, &mut out).unwrap();
    // A query of another width has the same shape; a plain query is rejected.
    let plain =
        VectorCodec::new(KvDtype::Bf16, KvRole::Key, 64, 0, &CodecOptions::default()).unwrap();
    let pq_plain = plain.prepare_query(&x).unwrap();
    assert!(c.score_block(&pq_plain, &block, &layout, &mut out).is_err());
    let _ = pq;
    assert!(c.prepare_query(&x[..10]).is_err());
    // Non-finite input never panics.
    let nan = vec![f32::NAN; 64];
    c.encode_slot(&nan, &mut block, &layout, 1).unwrap();
    let mut y = vec![0.0; 64];
    c.decode_slot(&block, &layout, 1, &mut y).unwrap();
    let zero = vec![0.0; 64];
    c.encode_slot(&zero, &mut block, &layout, 2).unwrap();
    c.decode_slot(&block, &layout, 2, &mut y).unwrap();
    assert!(y.iter().all(|&v| v == 0.0));
}
