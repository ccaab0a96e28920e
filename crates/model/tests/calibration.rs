//! KV cache policy options on the demo model: the centering calibration (shapes,
//! determinism, and that the keys do share a large common direction — the reason centering
//! helps; TURBOQUANT.md §6) and the key mode reaching the cache.

mod common;

use std::sync::Arc;

use common::demo_model;
use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::KvPolicy;
use turbokv_codec::{KeyMode, KvDtype};
use turbokv_model::calibrate::{calibrate_kv_centers, calibration_tokens};
use turbokv_model::tokenizer::Tokenizer;
use turbokv_model::{LoadOptions, Model, Session};

fn load() -> Option<(Model<CpuBackend>, Tokenizer)> {
    let path = demo_model()?;
    let model = Model::load(&path, CpuBackend::new(), &LoadOptions::default()).expect("loads");
    let tok = Tokenizer::from_gguf(&model.gguf.as_ref().expect("gguf").metadata).expect("tok");
    Some((model, tok))
}

#[test]
fn centers_have_the_cache_shape_are_finite_deterministic_and_keys_have_a_common_direction() {
    let Some((model, tok)) = load() else { return };
    let t = &model.transformer;
    let c = t.config().clone();
    let n_tokens = calibration_tokens(&tok).unwrap().len();
    assert!(
        (200..=1000).contains(&n_tokens),
        "a few hundred calibration tokens, got {n_tokens}"
    );
    let a = calibrate_kv_centers(t, &tok).unwrap();
    let b = calibrate_kv_centers(t, &tok).unwrap();
    assert_eq!(a, b, "calibration is deterministic");
    let cells = c.n_layers * c.n_kv_heads;
    assert_eq!(a.tokens, n_tokens - 1);
    assert_eq!(a.centers.kv_heads, c.n_kv_heads);
    assert_eq!(a.centers.head_dim, c.head_dim);
    assert_eq!(a.centers.layers(), c.n_layers);
    assert_eq!(a.centers.key.len(), cells * c.head_dim);
    assert_eq!(a.centers.value.len(), cells * c.head_dim);
    assert_eq!(a.mean_key_norm.len(), cells);
    assert!(
        a.centers
            .key
            .iter()
            .chain(&a.centers.value)
            .all(|x| x.is_finite())
    );
    assert!(a.mean_key_norm.iter().all(|x| x.is_finite() && *x > 0.0));

    let mut kf = Vec::new();
    for l in 0..c.n_layers {
        let row: Vec<String> = (0..c.n_kv_heads)
            .map(|h| {
                kf.push(a.key_mean_fraction(l, h));
                format!(
                    "k {:.3} (|k| {:.2}) v {:.3}",
                    a.key_mean_fraction(l, h),
                    a.mean_key_norm[l * c.n_kv_heads + h],
                    a.value_mean_fraction(l, h)
                )
            })
            .collect();
        eprintln!("layer {l:2}: {}", row.join(" | "));
    }
    let max = kf.iter().copied().fold(0.0, f32::max);
    let avg = kf.iter().sum::<f32>() / kf.len() as f32;
    eprintln!("‖mean key‖ / mean ‖k‖: max {max:.3}, mean over heads {avg:.3}");
    assert!(
        max <= 1.0 + 1e-4,
        "a mean is never longer than the mean length"
    );
    // Measured on the demo model (SmolLM2-135M Q4_1): max 0.890, mean over the 90 heads 0.774
    // (TURBOQUANT.md §6: 40–69% of key energy per layer is the mean component). The bounds
    // leave a wide margin for another quantization of the same model.
    assert!(
        max > 0.6,
        "some head's keys share a large common direction: {max}"
    );
    assert!(
        avg > 0.45,
        "keys have a clearly non-zero mean on average: {avg}"
    );

    // The centers go into a cache through the policy.
    let policy = KvPolicy {
        centers: Some(Arc::new(a.centers.clone())),
        key_mode: KeyMode::Prod,
        ..Default::default()
    };
    let s = Session::with_policy(t, KvDtype::Bf16, &policy, 64).unwrap();
    assert_eq!(s.cache().layout().centers.as_deref(), Some(&a.centers));

    // Outlier channels: per layer the half of the channels with the most energy (summed over
    // the layer's kv heads), of x or of x − μ.
    let d = c.head_dim;
    for centered in [false, true] {
        let o = a.outliers(centered).unwrap();
        assert_eq!((o.key.len(), o.value.len()), (c.n_layers, c.n_layers));
        for l in 0..c.n_layers {
            let energy: Vec<f32> = (0..d)
                .map(|ch| {
                    (0..c.n_kv_heads)
                        .map(|h| {
                            let i = (l * c.n_kv_heads + h) * d + ch;
                            let mu = a.centers.key[i];
                            a.key_energy[i] - if centered { mu * mu } else { 0.0 }
                        })
                        .sum()
                })
                .collect();
            let chosen = o.key[l].channels();
            assert_eq!(chosen.len(), d / 2);
            let weakest_in = chosen
                .iter()
                .map(|&ch| energy[ch as usize])
                .fold(f32::INFINITY, f32::min);
            let strongest_out = o.key[l]
                .complement()
                .iter()
                .map(|&ch| energy[ch as usize])
                .fold(f32::NEG_INFINITY, f32::max);
            assert!(
                weakest_in >= strongest_out,
                "layer {l} centered {centered}: {weakest_in} < {strongest_out}"
            );
        }
    }
    // …and reach a fractional cache's layers through the policy.
    let outliers = a.outliers(false).unwrap();
    let policy = KvPolicy {
        outliers: Some(Arc::new(outliers.clone())),
        ..Default::default()
    };
    let s = Session::with_policy(t, "tq3.5".parse().unwrap(), &policy, 64).unwrap();
    let layout = s.cache().layout();
    assert_eq!(
        layout.codec_options(3).key_outliers.as_ref(),
        Some(&outliers.key[3])
    );
    assert_eq!(
        layout.codec_options(3).value_outliers.as_ref(),
        Some(&outliers.value[3])
    );
}

#[test]
fn a_prod_policy_builds_a_prod_cache_that_runs() {
    let Some((model, tok)) = load() else { return };
    let t = &model.transformer;
    let tq4: KvDtype = "tq4".parse().unwrap();
    let ids = tok.encode("The capital of France is", true, false).unwrap();
    let mut bytes = Vec::new();
    for mode in [KeyMode::Mse, KeyMode::Prod] {
        let policy = KvPolicy {
            key_mode: mode,
            ..Default::default()
        };
        let mut s = Session::with_policy(t, tq4, &policy, 64).unwrap();
        assert_eq!(s.cache().layout().codec.key_mode, mode);
        let logits = s.prefill(&ids).unwrap();
        assert!(logits.iter().all(|x| x.is_finite()), "{mode}");
        bytes.push(s.cache().bytes_per_token());
    }
    // 30 layers × 3 kv heads × 64: keys 4.25 → 4.5 bits (the residual norm), values 4.25.
    assert_eq!(bytes, [6120.0, 6300.0]);
}
