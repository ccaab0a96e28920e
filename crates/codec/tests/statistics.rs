//! Distortion and bias of TurboQuant against the paper's numbers (TURBOQUANT.md §2), on
//! uniformly random unit vectors at d = 128.

use half::f16;
use turbokv_codec::prng::Xoshiro256;
use turbokv_codec::*;

const D: usize = 128;
const SAMPLES: usize = 20_000;

fn unit(rng: &mut Xoshiro256, d: usize) -> Vec<f32> {
    let v: Vec<f64> = (0..d).map(|_| rng.gaussian()).collect();
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter().map(|x| (x / n) as f32).collect()
}

fn codec(bits: u8, mode: KeyMode, qjl: QjlSketch, seed: u64) -> TqCodec {
    TqCodec::new(TqParams {
        head_dim: D,
        bits: TqBits::from_bits(bits).unwrap(),
        mode,
        norm: NormMode::Exact,
        qjl,
        seed,
        outliers: None,
    })
    .unwrap()
}

/// (D_mse, D_prod) over `n` samples: E‖x − x̂‖² and E(⟨y,x⟩ − ⟨y,x̂⟩)²·d/‖y‖², y ~ N(0, I).
fn distortions(c: &TqCodec, n: usize, seed: u64) -> (f64, f64) {
    let mut rng = Xoshiro256::new(seed);
    let mut codes = vec![0u8; c.code_bytes()];
    let mut sc = vec![f16::ZERO; c.scalars_per_vector()];
    let mut xh = vec![0.0f32; D];
    let (mut mse, mut prod) = (0.0, 0.0);
    for _ in 0..n {
        let x = unit(&mut rng, D);
        let y: Vec<f32> = (0..D).map(|_| rng.gaussian() as f32).collect();
        c.encode(&x, &mut codes, &mut sc).unwrap();
        c.decode(&codes, &sc, &mut xh).unwrap();
        mse += x
            .iter()
            .zip(&xh)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>();
        let err: f64 = y
            .iter()
            .zip(x.iter().zip(&xh))
            .map(|(&yi, (&a, &b))| (yi as f64) * ((a - b) as f64))
            .sum();
        let yy: f64 = y.iter().map(|&v| (v as f64).powi(2)).sum();
        prod += err * err * D as f64 / yy;
    }
    (mse / n as f64, prod / n as f64)
}

#[test]
fn mse_distortion_matches_paper() {
    for (bits, paper) in [(1u8, 0.3634), (2, 0.1175), (3, 0.0345), (4, 0.0095)] {
        let c = codec(bits, KeyMode::Mse, QjlSketch::Structured, 1);
        let (mse, _) = distortions(&c, SAMPLES, 100 + u64::from(bits));
        println!("b={bits}: D_mse {mse:.4} (paper {paper})");
        assert!(
            (mse / paper - 1.0).abs() < 0.08,
            "b={bits}: D_mse {mse} vs {paper}"
        );
    }
}

#[test]
fn prod_distortion_gaussian_sketch_matches_paper() {
    // The paper's S (i.i.d. Gaussian): D_prod ≈ 0.56, 0.18, 0.047 at b = 2, 3, 4.
    for (bits, paper) in [(2u8, 0.56), (3, 0.18), (4, 0.047)] {
        let c = codec(bits, KeyMode::Prod, QjlSketch::Gaussian, 1);
        let (_, prod) = distortions(&c, SAMPLES / 2, 200 + u64::from(bits));
        println!("b={bits}: D_prod gaussian S {prod:.4} (paper {paper})");
        assert!(
            (prod / paper - 1.0).abs() < 0.12,
            "b={bits}: D_prod {prod} vs {paper}"
        );
    }
}

#[test]
fn prod_distortion_structured_sketch_beats_paper() {
    // An orthogonal S makes the sign sketch a much better quantizer of the residual:
    // measured 0.202, 0.066, 0.019 (≈ 0.36 × the Gaussian-S values).
    for (bits, paper, measured) in [(2u8, 0.56, 0.202), (3, 0.18, 0.066), (4, 0.047, 0.019)] {
        let c = codec(bits, KeyMode::Prod, QjlSketch::Structured, 1);
        let (_, prod) = distortions(&c, SAMPLES, 300 + u64::from(bits));
        println!("b={bits}: D_prod structured S {prod:.4} (paper {paper})");
        assert!(
            prod < 0.5 * paper,
            "b={bits}: D_prod {prod} vs paper {paper}"
        );
        assert!(
            (prod / measured - 1.0).abs() < 0.08,
            "b={bits}: D_prod {prod} vs {measured}"
        );
    }
}

/// The QJL estimate is unbiased over the draw of the sketch, so the test draws it: 40 seeds
/// × 500 vectors each, estimating ⟨x, x⟩ = 1 (where MSE alone is biased by −D_mse), and a
/// t-test on the 40 per-seed means.
#[test]
fn prod_is_unbiased_mse_is_not() {
    for bits in [2u8, 3, 4] {
        let (seeds, per_seed) = (40, 500);
        let mut means = Vec::with_capacity(seeds);
        let mut mse_bias = 0.0;
        for s in 0..seeds as u64 {
            let c = codec(bits, KeyMode::Prod, QjlSketch::Structured, 1000 + s);
            let m = codec(bits, KeyMode::Mse, QjlSketch::Structured, 1000 + s);
            let mut rng = Xoshiro256::new(5000 + s);
            let mut codes = vec![0u8; c.code_bytes()];
            let mut sc = vec![f16::ZERO; 2];
            let mut mcodes = vec![0u8; m.code_bytes()];
            let mut msc = vec![f16::ZERO; 1];
            let (vc, vm) = (
                VectorCodec::from_tq(c.clone()),
                VectorCodec::from_tq(m.clone()),
            );
            let mut sum = 0.0;
            for _ in 0..per_seed {
                let x = unit(&mut rng, D);
                c.encode(&x, &mut codes, &mut sc).unwrap();
                let pq = vc.prepare_query(&x).unwrap();
                sum += vc.score(&pq, &codes, &sc).unwrap() as f64 - 1.0;
                m.encode(&x, &mut mcodes, &mut msc).unwrap();
                let pqm = vm.prepare_query(&x).unwrap();
                mse_bias += vm.score(&pqm, &mcodes, &msc).unwrap() as f64 - 1.0;
            }
            means.push(sum / per_seed as f64);
        }
        let n = means.len() as f64;
        let mean = means.iter().sum::<f64>() / n;
        let var = means.iter().map(|m| (m - mean).powi(2)).sum::<f64>() / (n - 1.0);
        let t = mean / (var / n).sqrt();
        println!(
            "b={bits}: prod bias {mean:.2e} (t = {t:.2}), mse bias {:.4}",
            mse_bias / (seeds * per_seed) as f64
        );
        assert!(t.abs() < 3.0, "b={bits}: prod bias {mean} (t = {t})");
        let mse_bias = mse_bias / (seeds * per_seed) as f64;
        assert!(mse_bias < -0.5 * [0.0, 0.0, 0.1175, 0.0345, 0.0095][bits as usize]);
    }
}
