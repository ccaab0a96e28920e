//! Decode steps padded to batch-size buckets and logits copied back as each row's best
//! candidates (CPU, demo model): requests of every kind of sampling, run together with
//! placeholder rows and with neighbours that need whole rows, give the tokens and
//! log-probabilities they give alone, and the tokens the full-row sampler draws.

mod common;

use common::*;
use turbokv_codec::KvDtype;
use turbokv_engine::{
    DecodeBatching, DecodeBuckets, EngineHandle, EngineOptions, Event, GenerateRequest,
    LogitsTransfer, TokenLogprob,
};
use turbokv_model::sampling::SamplingParams;

/// A request's output: its tokens and their log-probabilities.
type Output = (Vec<u32>, Vec<TokenLogprob>);

fn run(h: &EngineHandle, req: GenerateRequest) -> Output {
    collect_output(h.submit(req).unwrap())
}

fn collect_output(mut s: turbokv_engine::RequestStream) -> Output {
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    while let Some(ev) = s.next_blocking() {
        match ev {
            Event::Token { id, logprob, .. } => {
                ids.push(id);
                lps.extend(logprob);
            }
            Event::Finished { .. } => return (ids, lps),
            Event::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("stream ended without Finished");
}

/// Twelve requests: greedy with and without log-probabilities, seeded top-k/top-p sampling,
/// a repetition penalty (drawn from more candidates), and two that need whole rows (a
/// frequency penalty; sampling without top-k).
fn requests(h: &EngineHandle) -> Vec<GenerateRequest> {
    let sampled = |temperature, top_k, top_p, seed| SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p: 0.0,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let kinds: Vec<(SamplingParams, Option<usize>, f32)> = vec![
        (SamplingParams::greedy(), None, 0.0),
        (SamplingParams::greedy(), Some(3), 0.0),
        (sampled(0.8, 40, 0.9, 11), Some(2), 0.0),
        (sampled(1.2, 8, 1.0, 12), None, 0.0),
        (
            SamplingParams {
                repetition_penalty: 1.3,
                ..sampled(0.7, 20, 0.95, 13)
            },
            Some(1),
            0.0,
        ),
        (SamplingParams::greedy(), Some(2), 0.5),
        (sampled(1.0, 0, 1.0, 14), Some(2), 0.0),
    ];
    let mut out = Vec::new();
    for (i, p) in PROMPTS.iter().take(6).enumerate() {
        for j in 0..2 {
            let (params, logprobs, frequency_penalty) = kinds[(2 * i + j) % kinds.len()].clone();
            let mut req = GenerateRequest::greedy(prompt(h, p), 6 + 3 * ((i + j) % 3));
            req.sampling = SamplingParams {
                max_tokens: req.sampling.max_tokens,
                ..params
            };
            req.logprobs = logprobs;
            req.frequency_penalty = frequency_penalty;
            out.push(req);
        }
    }
    out
}

fn options(batching: DecodeBatching, logits: LogitsTransfer) -> EngineOptions {
    EngineOptions {
        max_num_seqs: 16,
        prefix_caching: false,
        decode_batching: batching,
        logits,
        ..Default::default()
    }
}

fn transfer(h: &EngineHandle, kind: &str) -> f64 {
    metric(
        h,
        &format!("turbokv:step_logits_total{{transfer=\"{kind}\"}}"),
    )
}

/// The twelve requests at once on an engine that pads decode steps to buckets and copies
/// back candidates: each gives, bit for bit, the tokens and log-probabilities it gives alone
/// on that engine (so neither the placeholder rows nor a neighbour that needs whole rows
/// changes it), and the tokens of the full-row sampler alone, with the same top
/// alternatives and log-probabilities within float rounding (the log-sum-exp is summed in
/// another order).
#[test]
fn padded_steps_and_candidates_give_each_request_its_output_alone() {
    let Some(path) = demo_model() else { return };
    let buckets = DecodeBatching::Buckets(DecodeBuckets::for_max_seqs(16));
    let reference: Vec<Output> = {
        let r = start(
            &path,
            KvDtype::Bf16,
            options(DecodeBatching::Exact, LogitsTransfer::FullRows),
            None,
        );
        let h = &r.handle;
        let out = requests(h).into_iter().map(|q| run(h, q)).collect();
        assert_eq!(transfer(h, "top_k"), 0.0, "full rows only");
        out
    };
    let alone: Vec<Output> = {
        let r = start(
            &path,
            KvDtype::Bf16,
            options(buckets.clone(), LogitsTransfer::Candidates),
            None,
        );
        let h = &r.handle;
        let reqs = requests(h);
        let mut out = Vec::new();
        let mut rows_needed = false;
        for (i, q) in reqs.into_iter().enumerate() {
            rows_needed |= q.frequency_penalty != 0.0 || q.sampling.top_k == 0;
            out.push(run(h, q));
            if !rows_needed {
                assert_eq!(
                    transfer(h, "full"),
                    0.0,
                    "request {i}: no full row is copied back before a request needs one"
                );
            }
        }
        assert!(rows_needed && transfer(h, "full") > 0.0);
        out
    };
    let r = start(
        &path,
        KvDtype::Bf16,
        options(buckets, LogitsTransfer::Candidates),
        None,
    );
    let h = &r.handle;
    let streams: Vec<_> = requests(h)
        .into_iter()
        .map(|q| h.submit(q).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let got = collect_output(s);
        assert_eq!(got, alone[i], "request {i}: batched and padded vs alone");
        let want = &reference[i];
        assert_eq!(
            got.0, want.0,
            "request {i}: candidates vs full rows, tokens"
        );
        assert_eq!(got.1.len(), want.1.len());
        for (t, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
            let what = format!("request {i} token {t}");
            assert!(
                (a.logprob - b.logprob).abs() < 1e-4,
                "{what}: {a:?} vs {b:?}"
            );
            let ids = |l: &TokenLogprob| l.top.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(ids(a), ids(b), "{what}: top alternatives");
            for (x, y) in a.top.iter().zip(&b.top) {
                assert!((x.1 - y.1).abs() < 1e-4, "{what}: {a:?} vs {b:?}");
            }
        }
    }
    assert!(
        metric(h, "turbokv:num_requests_running_peak") >= 8.0,
        "the requests must have run together"
    );
    assert!(
        metric(h, "turbokv:decode_padding_rows_total") > 0.0,
        "some decode steps must have been padded"
    );
    let bucket_steps: f64 = DecodeBuckets::for_max_seqs(16)
        .sizes()
        .iter()
        .map(|b| {
            metric(
                h,
                &format!("turbokv:decode_bucket_steps_total{{bucket=\"{b}\"}}"),
            )
        })
        .sum();
    assert!(bucket_steps > 0.0);
    assert!(transfer(h, "top_k") > 0.0, "steps with candidates only");
    assert!(
        transfer(h, "full") > 0.0,
        "steps where a neighbour needed whole rows"
    );
}
