//! Long context on the demo model for every KV format: prefill 4096 tokens of the Wikipedia
//! text, then decode a few (teacher-forced, so every format sees the same tokens), and compare
//! the logits of the last 32 prefill positions and of every decode step with a bf16 cache:
//! finite everywhere, mean KL(bf16 ‖ format) under a measured bound, and for the good formats
//! (f16, int8, fp8, tq4, balanced) the same top-1 token wherever bf16's choice is clear.
//!
//! The bf16 reference runs once per test binary and is shared by the cases.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use common::{argmax, demo_model, logsumexp};
use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::{KvPolicy, KvWindow};
use turbokv_codec::KvDtype;
use turbokv_model::tokenizer::Tokenizer;
use turbokv_model::{LoadOptions, Model, Session};

/// Tokens prefilled (≥ 4096).
const PREFILL: usize = 4096;
/// Prefill positions at the end whose logits are compared.
const TAIL: usize = 32;
/// Single-token steps after the prefill.
const DECODE: usize = 8;
/// Top-2 log-prob margin (nats) above which bf16's top-1 counts as clear.
const CLEAR_MARGIN: f64 = 1.0;

struct Shared {
    model: Model<CpuBackend>,
    tokens: Vec<u32>,
    /// Log-probs of the bf16 cache at the compared positions, `[TAIL + DECODE, vocab]`.
    reference: Vec<f32>,
}

fn wiki() -> Option<PathBuf> {
    let path = std::env::var_os("TURBOKV_WIKI")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("TURBOKV_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/turbokv")
                })
                .join("data/wiki.txt")
        });
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have the wiki text: run scripts/fetch-assets.sh ({})",
        path.display()
    );
    eprintln!(
        "SKIPPED: wiki text not found at {} (run scripts/fetch-assets.sh)",
        path.display()
    );
    None
}

fn shared() -> Option<&'static Shared> {
    static SHARED: OnceLock<Option<Shared>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let path = demo_model()?;
            let text = std::fs::read_to_string(wiki()?).expect("wiki text reads");
            let model =
                Model::load(&path, CpuBackend::new(), &LoadOptions::default()).expect("loads");
            let tok = Tokenizer::from_gguf(&model.gguf.as_ref().expect("gguf").metadata)
                .expect("tokenizer");
            let mut end = (40 * PREFILL).min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let tokens = tok.encode(&text[..end], true, false).expect("encodes");
            assert!(
                tokens.len() > PREFILL + DECODE,
                "the wiki text gives only {} tokens",
                tokens.len()
            );
            let reference = run(&model, &tokens, KvDtype::Bf16, &KvPolicy::default()).logprobs;
            Some(Shared {
                model,
                tokens,
                reference,
            })
        })
        .as_ref()
}

struct Run {
    logprobs: Vec<f32>,
    finite: bool,
    prefill_s: f64,
    decode_ms: f64,
}

fn log_softmax(row: &[f32], out: &mut Vec<f32>) {
    let lse = logsumexp(row) as f32;
    out.extend(row.iter().map(|&x| x - lse));
}

fn run(model: &Model<CpuBackend>, tokens: &[u32], dtype: KvDtype, policy: &KvPolicy) -> Run {
    let t = &model.transformer;
    let vocab = t.config().vocab_size;
    let mut s = Session::with_policy(t, dtype, policy, PREFILL + DECODE + 1).expect("session");
    let start = Instant::now();
    s.prefill(&tokens[..PREFILL - TAIL]).expect("prefill");
    let tail = s
        .prefill_all_logits(&tokens[PREFILL - TAIL..PREFILL])
        .expect("prefill tail");
    let prefill_s = start.elapsed().as_secs_f64();
    let mut finite = tail.iter().all(|x| x.is_finite());
    let mut logprobs = Vec::with_capacity((TAIL + DECODE) * vocab);
    for row in tail.chunks_exact(vocab) {
        log_softmax(row, &mut logprobs);
    }
    let start = Instant::now();
    // Teacher-forced: the logits after token PREFILL - 1 are the tail's last row; step i feeds
    // token PREFILL + i.
    for i in 0..DECODE {
        let row = s.step(tokens[PREFILL + i]).expect("step");
        finite &= row.iter().all(|x| x.is_finite());
        log_softmax(row, &mut logprobs);
    }
    let decode_ms = 1e3 * start.elapsed().as_secs_f64() / DECODE as f64;
    assert_eq!(s.len(), PREFILL + DECODE);
    Run {
        logprobs,
        finite,
        prefill_s,
        decode_ms,
    }
}

/// Runs `spec` and checks it against the bf16 reference: `max_kl` bounds the mean KL over the
/// compared positions; `max_missed` (for the good formats) bounds the fraction of positions
/// where bf16's top-1 is clear (top-2 margin > [`CLEAR_MARGIN`]) and this format picks another.
fn check(spec: &str, dtype: &str, window: KvWindow, max_kl: f64, max_missed: Option<f64>) {
    let Some(sh) = shared() else { return };
    let dtype: KvDtype = dtype.parse().expect("dtype");
    let policy = KvPolicy {
        window,
        ..Default::default()
    };
    let r = run(&sh.model, &sh.tokens, dtype, &policy);
    let vocab = sh.model.transformer.config().vocab_size;
    let (mut kl, mut agree, mut clear, mut clear_missed) = (0f64, 0, 0, 0);
    let rows = TAIL + DECODE;
    for (p, q) in sh
        .reference
        .chunks_exact(vocab)
        .zip(r.logprobs.chunks_exact(vocab))
    {
        kl += p
            .iter()
            .zip(q)
            .map(|(&a, &b)| (a as f64).exp() * (a - b) as f64)
            .sum::<f64>();
        let best = argmax(p) as usize;
        let same = argmax(q) as usize == best;
        agree += usize::from(same);
        let second = p
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != best)
            .map(|(_, &x)| x)
            .fold(f32::NEG_INFINITY, f32::max);
        if (p[best] - second) as f64 > CLEAR_MARGIN {
            clear += 1;
            clear_missed += usize::from(!same);
        }
    }
    let kl = kl / rows as f64;
    eprintln!(
        "long context {spec:>8}: prefill {PREFILL} tok {:.1} s, decode {:.1} ms/tok, \
         mean KL {kl:.5}, top-1 {agree}/{rows}, clear top-1 missed {clear_missed}/{clear}",
        r.prefill_s, r.decode_ms
    );
    assert!(r.finite, "{spec}: non-finite logits");
    assert!(
        kl.is_finite() && kl <= max_kl,
        "{spec}: mean KL {kl:.5} > {max_kl}"
    );
    assert!(clear > 0, "the text has positions with a clear top-1");
    if let Some(max) = max_missed {
        assert!(
            clear_missed as f64 <= max * clear as f64,
            "{spec}: bf16's clear top-1 lost at {clear_missed} of {clear} positions (max {max})"
        );
    }
}

// Bounds: about 3× the mean KL measured on the demo model (2026-12-01, 4096 + 8 tokens of
// wiki.txt, 40 compared positions, 23 of them with a clear bf16 top-1):
//
// | format   | mean KL | top-1 | clear top-1 missed |
// |----------|---------|-------|--------------------|
// | f16      | 0.0038  | 40/40 | 0/23 |
// | int8     | 0.0038  | 37/40 | 0/23 |
// | fp8      | 0.0104  | 37/40 | 0/23 | (2026-12-02; int8 read 0.0045 in the same run)
// | tq4      | 0.068   | 30/40 | 1/23 |
// | tq3      | 0.199   | 29/40 | 0/23 |
// | tq2      | 1.23    | 15/40 | 10/23 |
// | tq3.5    | 0.246   | 29/40 | 3/23 |
// | tq2.5    | 1.16    | 19/40 | 5/23 |
// | k4v3     | 0.079   | 28/40 | 0/23 |
// | balanced | 0.012   | 36/40 | 0/23 |
// | compact  | 0.060   | 31/40 | 0/23 |
const NONE: KvWindow = KvWindow {
    recent: 0,
    sinks: 0,
    copies: turbokv_cache::WindowCopies::F16,
};

#[test]
fn long_context_bf16_is_its_own_reference() {
    check("bf16", "bf16", NONE, 1e-9, Some(0.0));
}

#[test]
fn long_context_f16() {
    check("f16", "f16", NONE, 0.02, Some(0.05));
}

#[test]
fn long_context_int8() {
    check("int8", "int8", NONE, 0.02, Some(0.05));
}

#[test]
fn long_context_fp8() {
    check("fp8", "fp8", NONE, 0.03, Some(0.05));
}

#[test]
fn long_context_tq4() {
    check("tq4", "tq4", NONE, 0.2, Some(0.2));
}

#[test]
fn long_context_tq3() {
    check("tq3", "tq3", NONE, 0.6, None);
}

#[test]
fn long_context_tq2() {
    check("tq2", "tq2", NONE, 3.0, None);
}

#[test]
fn long_context_tq3_5() {
    check("tq3.5", "tq3.5", NONE, 0.75, None);
}

#[test]
fn long_context_tq2_5() {
    check("tq2.5", "tq2.5", NONE, 3.0, None);
}

#[test]
fn long_context_k4v3() {
    check("k4v3", "k4v3", NONE, 0.25, None);
}

/// k4v3 with 32 recent + 1 sink exact (the CLI's `balanced` preset until issue 19 widened
/// its window to 47).
#[test]
fn long_context_balanced() {
    let w = KvWindow {
        recent: 32,
        sinks: 1,
        ..Default::default()
    };
    check("balanced", "k4v3", w, 0.05, Some(0.1));
}

/// tq3 with 15 recent + 1 sink exact (the CLI's `compact` preset until issue 19 moved it to
/// k4v2 with the same window).
#[test]
fn long_context_compact() {
    let w = KvWindow {
        recent: 15,
        sinks: 1,
        ..Default::default()
    };
    check("compact", "tq3", w, 0.2, None);
}
