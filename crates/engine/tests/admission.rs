//! Admission with a growth reserve on the demo model (CPU, bf16 KV, a pool of a few blocks):
//! fewer preemptions than admitting whatever prompt fits (none at all when the reserve covers
//! every request's max_tokens), the same output as each request alone, and no deadlock when
//! one request as large as the whole pool waits behind small ones.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::*;
use turbokv_codec::KvDtype;
use turbokv_engine::{
    AdmissionOptions, EngineError, EngineHandle, EngineOptions, GenerateRequest, GrowthReserve,
};

const MAX_TOKENS: usize = 40;

/// Sixteen requests that each grow to 3–4 blocks of 16: every prompt bare and as a question.
fn sixteen_prompts(h: &EngineHandle) -> Vec<Vec<u32>> {
    PROMPTS
        .iter()
        .flat_map(|p| [p.to_string(), format!("Question: {p}")])
        .map(|t| prompt(h, &t))
        .collect()
}

fn request(p: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::greedy(p.to_vec(), max_tokens)
    }
}

/// Collects every stream on a thread of its own; fails if they have not all finished within
/// `limit` (a scheduler that stops admitting would hang here).
fn collect_all(streams: Vec<turbokv_engine::RequestStream>, limit: Duration) -> Vec<Vec<u32>> {
    let (tx, rx) = mpsc::channel();
    let n = streams.len();
    for (i, s) in streams.into_iter().enumerate() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let _ = tx.send((i, collect(s).0));
        });
    }
    let deadline = std::time::Instant::now() + limit;
    let mut out = vec![Vec::new(); n];
    for _ in 0..n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let (i, ids) = rx
            .recv_timeout(left)
            .expect("a request failed, or they stalled: admission must not deadlock");
        out[i] = ids;
    }
    out
}

/// Runs the sixteen requests at once under `admission`; returns the preemptions and the
/// most requests that ran in one step, after checking each output against `alone`.
fn run_load(
    path: &std::path::Path,
    admission: AdmissionOptions,
    alone: &[Reference],
) -> (f64, f64) {
    let r = start(path, KvDtype::Bf16, small_pool(admission), None);
    let h = &r.handle;
    let streams = sixteen_prompts(h)
        .iter()
        .map(|p| h.submit(request(p, MAX_TOKENS)).unwrap())
        .collect();
    for (i, ids) in collect_all(streams, Duration::from_secs(600))
        .iter()
        .enumerate()
    {
        assert_matches(ids, &alone[i], &format!("request {i} under {admission:?}"));
        assert_eq!(ids.len(), MAX_TOKENS);
    }
    assert_eq!(metric(h, "turbokv:kv_blocks_used"), 0.0);
    (
        metric(h, "vllm:num_preemptions_total"),
        metric(h, "turbokv:num_requests_running_peak"),
    )
}

/// 20 blocks of 16 tokens: about five of the sixteen requests fit at their full length, but
/// a dozen prompts fit at once.
fn small_pool(admission: AdmissionOptions) -> EngineOptions {
    EngineOptions {
        kv_tokens: 320,
        max_num_seqs: 16,
        max_batched_tokens: 64,
        admission,
        ..Default::default()
    }
}

#[test]
fn the_growth_reserve_stops_preemptions_under_a_small_pool() {
    let Some(path) = demo_model() else { return };
    let alone: Vec<Reference> = {
        let r = start(
            &path,
            KvDtype::Bf16,
            small_pool(AdmissionOptions::default()),
            None,
        );
        let h = &r.handle;
        sixteen_prompts(h)
            .iter()
            .map(|p| reference_of(h, request(p, MAX_TOKENS)))
            .collect()
    };
    let without = AdmissionOptions {
        reserve: GrowthReserve::None,
        watermark: 0.0,
    };
    let (preempted_without, peak_without) = run_load(&path, without, &alone);
    // The default: 64 tokens of lookahead, more than any request's 40, and a 1% watermark.
    let (preempted_with, peak_with) = run_load(&path, AdmissionOptions::default(), &alone);
    let short = AdmissionOptions {
        reserve: GrowthReserve::Lookahead(16),
        ..Default::default()
    };
    let (preempted_short, peak_short) = run_load(&path, short, &alone);
    eprintln!(
        "preemptions / running peak: none {preempted_without} / {peak_without}, lookahead 16 {preempted_short} / {peak_short}, lookahead 64 (default) {preempted_with} / {peak_with}"
    );
    assert!(
        preempted_without >= 4.0,
        "without a reserve this load must thrash: {preempted_without} preemptions"
    );
    // A reserve that covers every request's max_tokens is a guarantee, not a heuristic.
    assert_eq!(preempted_with, 0.0, "the full reserve must never preempt");
    assert!(
        peak_with >= 4.0,
        "the reserve must still batch: at most {peak_with} ran at once"
    );
    assert!(peak_without > peak_with);
}

#[test]
fn a_request_as_large_as_the_pool_runs_after_the_small_ones_before_it() {
    let Some(path) = demo_model() else { return };
    // 16 blocks: the large request needs all of them (more than the pool less its watermark),
    // so it can only run alone.
    let opts = EngineOptions {
        kv_tokens: 256,
        max_num_seqs: 16,
        max_batched_tokens: 64,
        ..Default::default()
    };
    let r = start(&path, KvDtype::Bf16, opts, None);
    let h = &r.handle;
    let large_prompt = prompt(h, &format!("{PREAMBLE}{PREAMBLE}{PREAMBLE}{}", PROMPTS[1]));
    let large_max = 256 - large_prompt.len();
    assert!(large_max >= 8, "the large prompt leaves room to generate");
    let small: Vec<Vec<u32>> = PROMPTS.iter().map(|p| prompt(h, p)).collect();
    let mut reqs: Vec<GenerateRequest> = small[..4].iter().map(|p| request(p, 20)).collect();
    reqs.push(request(&large_prompt, large_max));
    reqs.extend(small[4..].iter().map(|p| request(p, 20)));
    let alone: Vec<Reference> = reqs.iter().map(|q| reference_of(h, q.clone())).collect();
    let deferred_before = metric(h, "turbokv:admissions_deferred_total");
    let streams = reqs.iter().map(|q| h.submit(q.clone()).unwrap()).collect();
    let got = collect_all(streams, Duration::from_secs(600));
    for (i, ids) in got.iter().enumerate() {
        assert_matches(ids, &alone[i], &format!("request {i}"));
    }
    assert_eq!(got[4].len(), large_max, "the large request ran to its end");
    assert!(
        metric(h, "turbokv:admissions_deferred_total") > deferred_before,
        "the large request must have waited for the reserve"
    );
    assert_eq!(metric(h, "vllm:num_preemptions_total"), 0.0);
    // One token more than the pool holds can never run: refused with the typed error.
    let e = h.submit(request(&large_prompt, large_max + 1)).err();
    assert!(
        matches!(
            e,
            Some(EngineError::TooLargeForCache {
                needed_tokens: 257,
                capacity_tokens: 256
            })
        ),
        "{e:?}"
    );
}

#[test]
fn a_watermark_outside_its_range_is_refused() {
    let Some(path) = demo_model() else { return };
    let model = turbokv_model::Model::load(
        &path,
        turbokv_backend::cpu::CpuBackend::new(),
        &Default::default(),
    )
    .unwrap();
    let tokenizer =
        turbokv_model::tokenizer::Tokenizer::from_gguf(&model.gguf.as_ref().unwrap().metadata)
            .unwrap();
    let opts = EngineOptions {
        admission: AdmissionOptions {
            watermark: 0.9,
            ..Default::default()
        },
        ..Default::default()
    };
    let e = turbokv_engine::Engine::new(
        model.transformer,
        std::sync::Arc::new(tokenizer),
        KvDtype::Bf16,
        &Default::default(),
        opts,
    )
    .err()
    .map(|e| e.to_string());
    assert!(
        e.as_deref().is_some_and(|m| m.contains("watermark")),
        "{e:?}"
    );
}
