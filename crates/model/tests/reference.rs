//! The demo model against committed reference fixtures: llama.cpp (llama-cpp-python 0.3.36,
//! same GGUF) and an exact float64 NumPy forward pass (`scripts/np_llama_ref.py`).
//!
//! Tolerances. llama.cpp rounds activations to 8 bits inside its quantized matmuls (and so
//! does our CPU backend, with the same block scheme), which moves this small model's logits
//! by up to ~1–3 against the exact computation; llama.cpp differs from *itself* by up to 1.48
//! between batched and token-by-token evaluation (fixture metadata). So logits are compared as
//! log-probabilities of the reference's top tokens, with bounds from that measured noise, and
//! the top-1 token must agree wherever the reference's top-2 margin is clear.

mod common;

use common::{argmax, demo_model, fixture, logsumexp};
use turbokv_backend::cpu::{CpuBackend, WeightMode};
use turbokv_codec::KvDtype;
use turbokv_model::{LoadOptions, Model, Session};

fn load_with(mode: WeightMode) -> Option<Model<CpuBackend>> {
    let path = demo_model()?;
    Some(
        Model::load(
            &path,
            CpuBackend::with_weights(mode),
            &LoadOptions::default(),
        )
        .expect("demo model loads"),
    )
}

fn load() -> Option<Model<CpuBackend>> {
    load_with(WeightMode::Native)
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Worst differences of our log-probs against one reference over the fixture's positions.
#[derive(Default, Debug)]
struct Diff {
    top5: f64,
    top32: f64,
    lse: f64,
    clear_top1_disagreements: usize,
    positions: usize,
}

fn compare(ours: &[f32], vocab: usize, positions: &[serde_json::Value], which: &str) -> Diff {
    let mut d = Diff::default();
    for p in positions {
        let pos = p["pos"].as_u64().expect("pos") as usize;
        let row = &ours[pos * vocab..(pos + 1) * vocab];
        let lse = logsumexp(row);
        let r = &p[which];
        let ref_lse = r["lse"].as_f64().expect("lse");
        d.lse = d.lse.max((lse - ref_lse).abs());
        let top = r["top"].as_array().expect("top");
        for (k, pair) in top.iter().enumerate() {
            let id = pair[0].as_u64().expect("id") as usize;
            let ref_lp = pair[1].as_f64().expect("logit") - ref_lse;
            let diff = ((row[id] as f64 - lse) - ref_lp).abs();
            d.top32 = d.top32.max(diff);
            if k < 5 {
                d.top5 = d.top5.max(diff);
            }
        }
        let margin = top[0][1].as_f64().unwrap_or(0.0) - top[1][1].as_f64().unwrap_or(0.0);
        if margin > 1.0 && argmax(row) as u64 != top[0][0].as_u64().unwrap_or(u64::MAX) {
            d.clear_top1_disagreements += 1;
        }
        d.positions += 1;
    }
    d
}

/// Runs every fixture prompt through `model` (f16 KV) and calls `check(name, vs_llama, vs_exact)`.
fn for_each_prompt(model: &Model<CpuBackend>, check: impl Fn(&str, Diff, Diff)) {
    let fx = fixture("logits_smollm2.json");
    let vocab = model.transformer.config().vocab_size;
    for prompt in fx["prompts"].as_array().expect("prompts") {
        let name = prompt["name"].as_str().unwrap_or("?");
        let tokens = ids(&prompt["ids"]);
        let mut session = Session::new(&model.transformer, KvDtype::F16, 2048).expect("session");
        let logits = session.prefill_all_logits(&tokens).expect("forward");
        let positions = prompt["positions"].as_array().expect("positions");
        check(
            name,
            compare(&logits, vocab, positions, "llamacpp"),
            compare(&logits, vocab, positions, "ref_f64"),
        );
    }
}

#[test]
fn logits_match_llamacpp_and_the_exact_reference() {
    let Some(model) = load() else { return };
    for_each_prompt(&model, |name, vs_llama, vs_exact| {
        eprintln!("{name}: vs llama.cpp {vs_llama:?}\n{name}: vs exact f64 {vs_exact:?}");
        for (d, who) in [(&vs_llama, "llama.cpp"), (&vs_exact, "exact f64")] {
            assert!(
                d.top5 <= 1.25 && d.top32 <= 2.0 && d.lse <= 1.0,
                "{name} vs {who}: {d:?}"
            );
            assert_eq!(
                d.clear_top1_disagreements, 0,
                "{name} vs {who}: top-1 differs where the margin exceeds 1"
            );
        }
    });
}

/// Greedy-decodes `n` tokens; returns the ids and, per step, our logits of every token.
fn greedy(model: &Model<CpuBackend>, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut session = Session::new(&model.transformer, KvDtype::F16, 2048).expect("session");
    let mut logits = session.prefill(prompt).expect("prefill").to_vec();
    let (mut got, mut rows) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let next = argmax(&logits);
        got.push(next);
        rows.push(logits.clone());
        logits = session.step(next).expect("step").to_vec();
    }
    (got, rows)
}

#[test]
fn greedy_continuations_match_llamacpp_up_to_near_ties() {
    let Some(model) = load() else { return };
    let fx = fixture("greedy_smollm2.json");
    for prompt in fx["prompts"].as_array().expect("prompts") {
        let name = prompt["name"].as_str().unwrap_or("?");
        let expected = ids(&prompt["llamacpp"]["ids"]);
        let (got, rows) = greedy(&model, &ids(&prompt["prompt_ids"]), expected.len());
        let same = got
            .iter()
            .zip(&expected)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{name}: identical to llama.cpp for {same} of {} tokens",
            expected.len()
        );
        if same < expected.len() {
            // A divergence is acceptable only where llama.cpp's token was a near-tie for us
            // too: 8-bit activation rounding moves logits by up to ~0.7 on this model.
            let row = &rows[same];
            let gap = row[got[same] as usize] - row[expected[same] as usize];
            assert!(
                gap < 0.5,
                "{name}: step {same} chose {} over llama.cpp's {} by {gap}",
                got[same],
                expected[same]
            );
        }
    }
}

#[test]
fn greedy_in_exact_mode_matches_the_float64_reference() {
    let Some(model) = load_with(WeightMode::DequantizedF32) else {
        return;
    };
    let fx = fixture("greedy_smollm2.json");
    for prompt in fx["prompts"].as_array().expect("prompts") {
        let name = prompt["name"].as_str().unwrap_or("?");
        let expected = ids(&prompt["ref_f64"]["ids"]);
        assert!(
            expected.len() >= 32 || prompt["ref_f64"]["stopped_on_eog"] == true,
            "{name}: fixture too short"
        );
        let (got, _) = greedy(&model, &ids(&prompt["prompt_ids"]), expected.len());
        assert_eq!(got, expected, "{name}");
    }
}

#[test]
fn exact_f32_mode_matches_the_float64_reference() {
    let Some(model) = load_with(WeightMode::DequantizedF32) else {
        return;
    };
    for_each_prompt(&model, |name, _, d| {
        eprintln!("{name}: exact mode vs f64 {d:?}");
        // Only the f16 KV cache separates this from the float64 reference (~0.02 measured).
        assert!(
            d.top5 <= 0.05 && d.top32 <= 0.05 && d.lse <= 0.05,
            "{name}: {d:?}"
        );
        assert_eq!(d.clear_top1_disagreements, 0, "{name}");
    });
}

#[test]
fn decoding_token_by_token_equals_one_batched_prefill() {
    for mode in [WeightMode::DequantizedF32, WeightMode::Native] {
        step_vs_batched(mode);
    }
}

/// Largest |logit| gap between token-by-token decoding and one batched prefill of the same
/// tokens. The float path only reorders f32 sums (measured ≤ 0.07 over 77 tokens); the 8-bit
/// activation path also re-rounds activations, and a flipped rounding in a block holding one
/// of this model's huge activation channels moves logits by up to ~1.5 (llama.cpp: 1.48
/// between its own batched and single-token runs, fixture metadata).
fn step_vs_batched(mode: WeightMode) {
    let Some(model) = load_with(mode) else { return };
    let fx = fixture("greedy_smollm2.json");
    let vocab = model.transformer.config().vocab_size;
    let prompt = &fx["prompts"][0];
    let mut tokens = ids(&prompt["prompt_ids"]);
    tokens.extend(ids(&prompt["llamacpp"]["ids"]));
    let mut batched = Session::new(&model.transformer, KvDtype::F16, 2048).expect("session");
    let all = batched.prefill_all_logits(&tokens).expect("prefill");
    let mut stepped = Session::new(&model.transformer, KvDtype::F16, 2048).expect("session");
    let mut worst = 0f32;
    for (t, &tok) in tokens.iter().enumerate() {
        let row = stepped.step(tok).expect("step");
        let want = &all[t * vocab..(t + 1) * vocab];
        worst = row
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(worst, f32::max);
    }
    eprintln!("{mode:?}: max |step − batched| logit difference: {worst}");
    let bound = match mode {
        WeightMode::DequantizedF32 => 0.15,
        _ => 2.0,
    };
    assert!(
        worst < bound,
        "{mode:?}: token-by-token logits differ from batched ones by {worst}"
    );
}
