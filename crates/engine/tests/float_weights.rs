//! Batch invariance with float weight matrices: the demo model re-encoded with f16 weights
//! (CPU) gives each request the same tokens and top-2 log-probability margins, bit for bit,
//! alone and among sixteen concurrent requests (decode rows and prefill chunks sharing each
//! matmul, at batch sizes where a blocked GEMM would sum differently).

mod common;

use common::*;
use turbokv_codec::KvDtype;
use turbokv_engine::{EngineOptions, GenerateRequest};
use turbokv_model::gguf::GgufFile;
use turbokv_model::gguf::reencode::{FloatFormat, reencode_matrices};

#[test]
fn f16_weights_give_each_request_the_same_bits_alone_and_batched() {
    let Some(demo) = demo_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("demo-f16.gguf");
    let file = GgufFile::open(&demo).unwrap();
    let bytes = reencode_matrices(&file, FloatFormat::F16)
        .unwrap()
        .to_bytes();
    std::fs::write(&path, bytes).unwrap();
    drop(file);
    let opts = EngineOptions {
        max_num_seqs: 16,
        max_batched_tokens: 48,
        ..Default::default()
    };
    let requests = |h: &turbokv_engine::EngineHandle| -> Vec<GenerateRequest> {
        PROMPTS
            .iter()
            .flat_map(|p| [p.to_string(), format!("{PREAMBLE}{p}")])
            .map(|t| GenerateRequest::greedy(prompt(h, &t), 8))
            .collect()
    };
    let alone: Vec<Reference> = {
        let solo = EngineOptions {
            prefix_caching: false,
            ..opts.clone()
        };
        let r = start(&path, KvDtype::Bf16, solo, None);
        let h = &r.handle;
        requests(h)
            .into_iter()
            .map(|q| reference_of(h, q))
            .collect()
    };
    let r = start(&path, KvDtype::Bf16, opts, None);
    let h = &r.handle;
    let streams: Vec<_> = requests(h)
        .into_iter()
        .map(|q| h.submit(with_margins(q)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let got = collect_reference(s);
        assert_matches(&got.ids, &alone[i], &format!("request {i} batched"));
        let bits = |m: &[f32]| m.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got.margins),
            bits(&alone[i].margins),
            "request {i}: the same tokens, but other log-probabilities batched than alone"
        );
    }
    assert!(
        metric(h, "turbokv:num_requests_running_peak") >= 8.0,
        "the requests must have run together"
    );
}
