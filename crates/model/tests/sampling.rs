//! Sampler and stop-string behaviour: greedy, determinism, filters checked statistically on
//! a known distribution, validation, and stop strings split across pieces.

use proptest::prelude::*;
use turbokv_model::sampling::{Sampler, SamplingError, SamplingParams, StopChecker, argmax};

/// A deterministic pseudo-random logit vector.
fn logits(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 20.0 - 10.0
        })
        .collect()
}

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: Some(7),
        ..Default::default()
    };
    f(&mut p);
    p
}

/// Token frequencies over `draws` samples of `probs` (as logits ln p).
fn frequencies(p: SamplingParams, probs: &[f64], draws: usize) -> Vec<f64> {
    let mut s = Sampler::new(p).unwrap();
    let base: Vec<f32> = probs.iter().map(|&p| p.ln() as f32).collect();
    let mut counts = vec![0usize; probs.len()];
    for _ in 0..draws {
        let mut l = base.clone();
        counts[s.sample(&mut l, &[]).unwrap() as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / draws as f64).collect()
}

const PROBS: [f64; 5] = [0.4, 0.3, 0.15, 0.1, 0.05];
const DRAWS: usize = 40_000;
/// Several standard deviations of a frequency estimated from `DRAWS` draws.
const TOL: f64 = 0.012;

fn assert_close(got: &[f64], want: &[f64]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() < TOL,
            "token {i}: frequency {g:.4}, expected {w:.4} (all: {got:?})"
        );
    }
}

#[test]
fn greedy_is_argmax() {
    for (n, seed) in [(1, 1), (17, 2), (50_000, 3), (151_936, 4)] {
        let l = logits(n, seed);
        let want = argmax(&l).unwrap();
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&mut l.clone(), &[]).unwrap(), want);
        let best = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(l[want as usize], best);
    }
    // Ties go to the lowest id; NaN is never chosen.
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(s.sample(&mut [1.0, 3.0, f32::NAN, 3.0], &[]).unwrap(), 1);
}

#[test]
fn top_k_one_is_greedy() {
    for seed in 0..20 {
        let l = logits(32_000, seed);
        let mut s = Sampler::new(params(|p| {
            p.top_k = 1;
            p.temperature = 1.5;
            p.seed = Some(seed);
        }))
        .unwrap();
        assert_eq!(s.sample(&mut l.clone(), &[]).unwrap(), argmax(&l).unwrap());
    }
}

#[test]
fn same_seed_same_tokens_and_different_seeds_differ() {
    let run = |seed| {
        let mut s = Sampler::new(SamplingParams {
            seed: Some(seed),
            temperature: 1.2,
            ..Default::default()
        })
        .unwrap();
        (0..200u64)
            .map(|i| s.sample(&mut logits(49_152, i), &[]).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    // Reseeding restarts the sequence.
    let mut s = Sampler::new(params(|p| p.seed = Some(5))).unwrap();
    let a: Vec<u32> = (0..50)
        .map(|_| s.sample(&mut logits(1000, 9), &[]).unwrap())
        .collect();
    s.reseed(5);
    let b: Vec<u32> = (0..50)
        .map(|_| s.sample(&mut logits(1000, 9), &[]).unwrap())
        .collect();
    assert_eq!(a, b);
}

#[test]
fn temperature_one_reproduces_the_distribution() {
    assert_close(&frequencies(params(|_| {}), &PROBS, DRAWS), &PROBS);
}

#[test]
fn temperature_sharpens_and_flattens() {
    // T = 0.5 squares the probabilities (renormalised).
    let sq: Vec<f64> = PROBS.iter().map(|p| p * p).collect();
    let z: f64 = sq.iter().sum();
    let want: Vec<f64> = sq.iter().map(|p| p / z).collect();
    assert_close(
        &frequencies(params(|p| p.temperature = 0.5), &PROBS, DRAWS),
        &want,
    );
}

#[test]
fn top_k_keeps_the_k_most_likely() {
    let f = frequencies(params(|p| p.top_k = 2), &PROBS, DRAWS);
    assert_close(&f, &[0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0, 0.0]);
    assert_eq!(f[2] + f[3] + f[4], 0.0);
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    // 0.4 + 0.3 = 0.7 < 0.8; adding 0.15 reaches 0.85: three tokens stay.
    let f = frequencies(params(|p| p.top_p = 0.8), &PROBS, DRAWS);
    assert_close(&f, &[0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0]);
    assert_eq!(f[3] + f[4], 0.0);
    // A tiny top_p keeps only the most likely token.
    let f = frequencies(params(|p| p.top_p = 0.01), &PROBS, 2000);
    assert_eq!(f[0], 1.0);
}

#[test]
fn top_p_on_a_large_flat_vocabulary_uses_the_prefix_path() {
    // 100k tokens: the first 10 hold 90% of the mass, the rest share 10%.
    let n = 100_000;
    let mut probs = vec![0.1 / (n - 10) as f64; n];
    probs[..10].iter_mut().for_each(|p| *p = 0.09);
    let f = frequencies(params(|p| p.top_p = 0.85), &probs, 300);
    let outside: f64 = f[10..].iter().sum();
    assert_eq!(outside, 0.0, "top-p 0.85 must cut the tail");
    // top_p 0.95 needs about half of the tail: more than the first prefix rounds hold.
    let f = frequencies(params(|p| p.top_p = 0.95), &probs, 600);
    let outside: f64 = f[10..].iter().sum();
    assert!(
        (outside - 0.05 / 0.95).abs() < 0.035,
        "tail share {outside}"
    );
}

#[test]
fn min_p_drops_tokens_below_the_fraction_of_the_best() {
    // Threshold 0.3 × 0.4 = 0.12: 0.1 and 0.05 go.
    let f = frequencies(params(|p| p.min_p = 0.3), &PROBS, DRAWS);
    assert_close(&f, &[0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0]);
    assert_eq!(f[3] + f[4], 0.0);
}

#[test]
fn filters_compose_in_llama_cpp_order() {
    // top-k 4 → {.4,.3,.15,.1}/.95; top-p 0.7 of that needs .4+.3 = .7/.95 = .737 ≥ .7.
    let f = frequencies(
        params(|p| {
            p.top_k = 4;
            p.top_p = 0.7;
        }),
        &PROBS,
        DRAWS,
    );
    assert_close(&f, &[0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0, 0.0]);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let mut s = Sampler::new(SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::greedy()
    })
    .unwrap();
    let mut l = [2.0, -1.0, 1.9, 0.5];
    // Token 0 appears twice: penalised once.
    assert_eq!(s.sample(&mut l, &[0, 1, 0, 99_999]).unwrap(), 2);
    assert_eq!(l, [1.0, -2.0, 1.9, 0.5]);
    // Outside the window, no penalty.
    let mut s = Sampler::new(SamplingParams {
        repetition_penalty: 2.0,
        repetition_window: 2,
        ..SamplingParams::greedy()
    })
    .unwrap();
    let mut l = [2.0, -1.0, 1.9, 0.5];
    assert_eq!(s.sample(&mut l, &[0, 3, 3]).unwrap(), 0);
    assert_eq!(l, [2.0, -1.0, 1.9, 0.25]);
}

#[test]
fn invalid_params_are_rejected() {
    let cases: Vec<(SamplingParams, &str)> = vec![
        (params(|p| p.temperature = -0.1), "temperature"),
        (params(|p| p.temperature = f32::NAN), "temperature"),
        (params(|p| p.temperature = f32::INFINITY), "temperature"),
        (params(|p| p.top_p = 0.0), "top_p"),
        (params(|p| p.top_p = 1.01), "top_p"),
        (params(|p| p.min_p = -0.01), "min_p"),
        (params(|p| p.min_p = 1.5), "min_p"),
        (params(|p| p.repetition_penalty = 0.0), "repetition_penalty"),
        (
            params(|p| p.repetition_penalty = f32::NAN),
            "repetition_penalty",
        ),
        (params(|p| p.max_tokens = 0), "max_tokens"),
    ];
    for (p, name) in cases {
        match Sampler::try_from(p) {
            Err(SamplingError::InvalidParam { param, .. }) => assert_eq!(param, name),
            other => panic!("{name}: expected InvalidParam, got {other:?}"),
        }
    }
    let p = params(|p| p.stop = vec!["ok".into(), String::new()]);
    assert_eq!(p.validate(), Err(SamplingError::EmptyStop { index: 1 }));
    assert!(SamplingParams::default().validate().is_ok());
    assert!(SamplingParams::greedy().validate().is_ok());
}

#[test]
fn degenerate_logits_are_errors_not_panics() {
    for p in [
        SamplingParams::greedy(),
        params(|_| {}),
        params(|p| p.top_p = 0.5),
    ] {
        let mut s = Sampler::new(p).unwrap();
        assert_eq!(s.sample(&mut [], &[]), Err(SamplingError::EmptyLogits));
        assert_eq!(
            s.sample(&mut [f32::NAN, f32::NEG_INFINITY], &[]),
            Err(SamplingError::NoFiniteLogits { n: 2 })
        );
        assert_eq!(
            s.sample(&mut [f32::NAN, 0.5, f32::NEG_INFINITY], &[7])
                .unwrap(),
            1
        );
        assert_eq!(s.sample(&mut [0.0, f32::INFINITY, 1.0], &[]).unwrap(), 1);
    }
}

fn run_stops(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
    let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    let mut c = StopChecker::new(&stops);
    let mut out = String::new();
    for p in pieces {
        let step = c.push(p);
        out.push_str(step.text);
        if let Some(i) = step.stopped {
            return (out, Some(i));
        }
    }
    out.push_str(c.finish());
    (out, None)
}

#[test]
fn stop_strings_across_pieces() {
    assert_eq!(
        run_stops(&["</s>"], &["Hello </", "s> more"]),
        ("Hello ".into(), Some(0))
    );
    assert_eq!(
        run_stops(&["</s>"], &["a <", "/", "b"]),
        ("a </b".into(), None)
    );
    assert_eq!(
        run_stops(&["\n\nUser:", "###"], &["x\n", "\nUs", "er: y"]),
        ("x".into(), Some(0))
    );
    assert_eq!(
        run_stops(&["café!"], &["un caf", "é", "!"]),
        ("un ".into(), Some(0))
    );
    assert_eq!(run_stops(&["ab", "b"], &["xab"]), ("x".into(), Some(0)));
    assert_eq!(run_stops(&[], &["plain"]), ("plain".into(), None));

    // What is held back is released as soon as it cannot be a stop string.
    let mut c = StopChecker::new(&["STOP".to_string()]);
    assert_eq!(c.push("go ST").text, "go ");
    assert_eq!(c.push("ART").text, "START");
    assert_eq!(c.push("ST").text, "");
    assert_eq!(c.finish(), "ST");
    let mut c = StopChecker::new(&["STOP".to_string()]);
    assert_eq!(c.push("xSTOPy").stopped, Some(0));
    assert_eq!(c.push("more").text, "");
    assert_eq!(c.stopped(), Some(0));
    assert_eq!(c.finish(), "");
}

proptest! {
    /// However the text is cut into pieces, the output is the text up to the first stop.
    #[test]
    fn stop_checker_matches_a_plain_search(
        text in "[ab\\n é]{0,40}",
        cuts in proptest::collection::vec(0usize..40, 0..8),
    ) {
        let stops = ["ab\n", "éé", "bbb"];
        let first = stops.iter().enumerate()
            .filter_map(|(i, s)| text.find(s).map(|p| (p, i)))
            .min();
        let want = first.map_or(text.clone(), |(p, _)| text[..p].to_string());
        let mut bounds: Vec<usize> = cuts.into_iter().filter(|&c| c <= text.len() && text.is_char_boundary(c)).collect();
        bounds.sort_unstable();
        bounds.dedup();
        let mut pieces = Vec::new();
        let mut start = 0;
        for b in bounds.into_iter().chain([text.len()]) {
            pieces.push(&text[start..b]);
            start = b;
        }
        let (got, stopped) = run_stops(&stops, &pieces);
        prop_assert_eq!(got, want);
        prop_assert_eq!(stopped, first.map(|f| f.1));
    }
}

/// `sample_candidates` over a host top-k copy draws exactly what `sample` draws from the full
/// logits, for the same seed and history, over many random rows (with ties, NaN, ±inf, ±0)
/// and every combination of the parameters; the PRNG streams stay in step across draws.
#[test]
fn candidates_draw_exactly_what_full_logits_draw() {
    use turbokv_backend::{TopK, select_top_k};
    let mut state = 0x5eed_u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let mut checked = 0;
    for temperature in [0.0, 0.7, 1.0] {
        for top_k in [1, 5, 40] {
            for top_p in [1.0, 0.9] {
                for min_p in [0.0, 0.05] {
                    for repetition_penalty in [1.0, 1.3] {
                        let params = SamplingParams {
                            temperature,
                            top_k,
                            top_p,
                            min_p,
                            repetition_penalty,
                            repetition_window: 16,
                            seed: Some(u64::from(next())),
                            ..SamplingParams::default()
                        };
                        let mut full = Sampler::new(params.clone()).unwrap();
                        let mut cand = Sampler::new(params).unwrap();
                        for _ in 0..40 {
                            let vocab = 50 + (next() % 400) as usize;
                            let coarse = next() % 2 == 0;
                            let mut l: Vec<f32> = (0..vocab)
                                .map(|_| {
                                    let u = next() as f32 / u32::MAX as f32 * 8.0 - 4.0;
                                    // Coarse rows are full of exact ties.
                                    if coarse { u.round() } else { u }
                                })
                                .collect();
                            for _ in 0..next() % 6 {
                                let i = next() as usize % vocab;
                                l[i] = [f32::NAN, f32::NEG_INFINITY, -0.0, 0.0, f32::INFINITY]
                                    [next() as usize % 5];
                            }
                            // History drawn mostly from the best ids, so the penalty bites.
                            let mut order: Vec<u32> = (0..vocab as u32).collect();
                            order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]));
                            let history: Vec<u32> = (0..next() % 30)
                                .map(|_| order[next() as usize % 12.min(vocab)])
                                .collect();
                            let k = cand.candidates_needed(&history).unwrap();
                            let mut top = TopK::default();
                            select_top_k(&l, vocab, k, &mut top).unwrap();
                            let want = full.sample(&mut l.clone(), &history);
                            let got = cand.sample_candidates(top.row(0).unwrap(), &history);
                            assert_eq!(got, want, "{:?}, history {history:?}", full.params());
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(checked, 3 * 3 * 2 * 2 * 2 * 40);
}

#[test]
fn candidates_needed_and_refusals() {
    let s = |f: fn(&mut SamplingParams)| Sampler::new(params(f)).unwrap();
    assert_eq!(
        Sampler::new(SamplingParams::greedy())
            .unwrap()
            .candidates_needed(&[1, 2]),
        Some(1)
    );
    assert_eq!(s(|p| p.top_k = 0).candidates_needed(&[]), None);
    assert_eq!(s(|p| p.top_k = 40).candidates_needed(&[]), Some(40));
    let pen = s(|p| {
        p.top_k = 40;
        p.repetition_penalty = 1.1;
        p.repetition_window = 64;
    });
    assert_eq!(pen.candidates_needed(&[3; 10]), Some(50));
    assert_eq!(pen.candidates_needed(&[3; 100]), Some(104));
    assert_eq!(
        s(|p| p.repetition_penalty = 0.9).candidates_needed(&[1]),
        None,
        "a penalty below 1 raises logits anywhere"
    );
    assert_eq!(s(|p| p.top_k = 300).candidates_needed(&[]), None);
    let mut top = turbokv_backend::TopK::default();
    turbokv_backend::select_top_k(&[1.0, 2.0, 3.0], 3, 2, &mut top).unwrap();
    let mut wide = s(|p| p.top_k = 3);
    assert_eq!(
        wide.sample_candidates(top.row(0).unwrap(), &[]),
        Err(SamplingError::TooFewCandidates { needed: 3, got: 2 })
    );
    let mut all = s(|p| p.top_k = 0);
    assert_eq!(
        all.sample_candidates(top.row(0).unwrap(), &[]),
        Err(SamplingError::NeedsFullLogits)
    );
}
