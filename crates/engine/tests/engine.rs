//! The engine on the demo model (CPU): batched requests equal the same requests run alone,
//! a load larger than the KV cache completes through preemption with the same output, cancellation frees blocks,
//! a shared prefix is served from the prefix cache with the same output, and prefix blocks
//! survive a restart through the snapshot store (a corrupted file is refused and counted).

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::*;
use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::KvPolicy;
use turbokv_codec::KvDtype;
use turbokv_engine::{
    AdmissionOptions, Engine, EngineHandle, EngineOptions, Event, FinishReason, GenerateRequest,
    GrowthReserve,
};
use turbokv_model::tokenizer::Tokenizer;
use turbokv_model::{LoadOptions, Model};

/// The 32 requests of the batching tests: each prompt bare and after the preamble, each with
/// a short and a longer output.
fn thirty_two_requests(h: &EngineHandle) -> Vec<(Vec<u32>, usize)> {
    let mut out = Vec::new();
    for p in PROMPTS {
        for text in [p.to_string(), format!("{PREAMBLE}{p}")] {
            for max_tokens in [6, 14] {
                out.push((prompt(h, &text), max_tokens));
            }
        }
    }
    out
}

/// Thirty-two greedy requests queued at once, run by continuous batching (up to 32 rows a
/// step, prompts prefilled in 48-token chunks beside running decodes, half of them sharing a
/// cached prefix), each equal token for token to the same request run alone on an engine
/// of its own without prefix caching.
#[test]
fn thirty_two_concurrent_greedy_requests_equal_each_request_alone() {
    let Some(path) = demo_model() else { return };
    let opts = EngineOptions {
        max_num_seqs: 32,
        max_batched_tokens: 48,
        ..Default::default()
    };
    let alone: Vec<Reference> = {
        let solo = EngineOptions {
            prefix_caching: false,
            ..opts.clone()
        };
        let r = start(&path, KvDtype::Bf16, solo, None);
        let h = &r.handle;
        thirty_two_requests(h)
            .into_iter()
            .map(|(p, n)| reference(h, p, n))
            .collect()
    };
    let r = start(&path, KvDtype::Bf16, opts, None);
    let h = &r.handle;
    let requests = thirty_two_requests(h);
    let streams: Vec<_> = requests
        .iter()
        .map(|(p, n)| h.submit(GenerateRequest::greedy(p.clone(), *n)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (ids, reason, usage) = collect(s);
        assert_matches(&ids, &alone[i], &format!("request {i} batched"));
        if reason == FinishReason::Length {
            assert_eq!(usage.completion_tokens, requests[i].1);
        }
    }
    assert!(
        metric(h, "turbokv:num_requests_running_peak") >= 16.0,
        "the requests must have run together"
    );
    assert!(
        metric(h, "vllm:prefix_cache_hits_total") > 0.0,
        "some requests must have started from the prefix cache"
    );
    assert_eq!(
        metric(h, "turbokv:kv_blocks_used"),
        0.0,
        "finished requests hold no blocks"
    );
}

/// A prompt cut into chunks of 16, 48 or 512 tokens gives the same tokens and top-2
/// log-probability margins bit for bit: every chunk but a lone last token takes the same path
/// through attention.
#[test]
fn a_prompt_gives_the_same_bits_whatever_its_chunking() {
    let Some(path) = demo_model() else { return };
    let (mut runs, mut steps) = (Vec::new(), Vec::new());
    for budget in [16, 48, 512] {
        // One sequence at a time: the budget is at least `max_num_seqs`.
        let opts = EngineOptions {
            max_num_seqs: 1,
            max_batched_tokens: budget,
            prefix_caching: false,
            ..Default::default()
        };
        let r = start(&path, KvDtype::Bf16, opts, None);
        let h = &r.handle;
        let mut run = Vec::new();
        // Lengths that leave a one-token last chunk (at 16 or 48) are left out: that token
        // would take the decode path in one cut and the prompt path in another.
        let prompts: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|p| prompt(h, &format!("{PREAMBLE}{PREAMBLE}{p}")))
            .filter(|t| t.len() % 16 != 1 && t.len() % 48 != 1)
            .take(3)
            .collect();
        assert_eq!(prompts.len(), 3, "too few prompts of usable lengths");
        for tokens in prompts {
            assert!(tokens.len() > 48, "the prompt must need two chunks of 48");
            let got = reference(h, tokens, 8);
            let bits: Vec<u32> = got.margins.iter().map(|m| m.to_bits()).collect();
            run.push((got.ids, bits));
        }
        runs.push(run);
        steps.push(metric(h, "turbokv:engine_steps_total"));
    }
    assert!(
        steps[0] > steps[1] && steps[1] > steps[2],
        "the prompts must have been cut differently: {steps:?} steps"
    );
    assert_eq!(runs[0], runs[1], "chunks of 16 vs 48");
    assert_eq!(runs[0], runs[2], "chunks of 16 vs 512");
}

#[test]
fn a_load_larger_than_the_cache_completes_through_preemption() {
    let Some(path) = demo_model() else { return };
    // 12 blocks of 16 tokens: room for about three of these requests at a time. Without a
    // growth reserve more start than fit, so some are preempted.
    let opts = EngineOptions {
        kv_tokens: 192,
        max_batched_tokens: 64,
        admission: AdmissionOptions {
            reserve: GrowthReserve::None,
            watermark: 0.0,
        },
        ..Default::default()
    };
    let r = start(&path, "tq4".parse().unwrap(), opts, None);
    let h = &r.handle;
    let alone: Vec<Reference> = PROMPTS
        .iter()
        .map(|p| reference(h, prompt(h, p), 40))
        .collect();
    let streams: Vec<_> = PROMPTS
        .iter()
        .map(|p| h.submit(GenerateRequest::greedy(prompt(h, p), 40)).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        // A preempted request recomputes its generated tokens one per step, as they were
        // first computed: its output equals the run alone.
        let (ids, reason, _) = collect(s);
        assert_matches(&ids, &alone[i], &format!("prompt {i} under preemption"));
        match reason {
            FinishReason::Length => assert_eq!(ids.len(), 40, "prompt {i}"),
            FinishReason::Stop => assert!(h.tokenizer().is_eos(*ids.last().unwrap())),
        }
    }
    assert!(
        metric(h, "vllm:num_preemptions_total") > 0.0,
        "the load must preempt"
    );
    // A request that cannot fit even alone is refused up front.
    let long = vec![1u32; 150];
    assert!(h.submit(GenerateRequest::greedy(long, 100)).is_err());
}

#[test]
fn dropping_a_stream_cancels_and_frees_its_blocks() {
    let Some(path) = demo_model() else { return };
    let r = start(&path, KvDtype::Bf16, EngineOptions::default(), None);
    let h = &r.handle;
    let mut s = h
        .submit(GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::greedy(prompt(h, PROMPTS[1]), 1000)
        })
        .unwrap();
    for _ in 0..3 {
        assert!(matches!(s.next_blocking(), Some(Event::Token { .. })));
    }
    assert!(metric(h, "turbokv:kv_blocks_used") > 0.0);
    drop(s);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while metric(h, "turbokv:kv_blocks_used") > 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "blocks not freed after cancel"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(metric(h, "vllm:num_requests_running"), 0.0);
}

#[test]
fn a_shared_prefix_hits_the_cache_with_the_same_output() {
    let Some(path) = demo_model() else { return };
    let r = start(
        &path,
        "int8".parse().unwrap(),
        EngineOptions::default(),
        None,
    );
    let h = &r.handle;
    let long = "The history of the city begins with a small settlement on the river, where farmers and traders met each week to exchange grain, cloth and news from distant towns. Over the centuries";
    let p = prompt(h, long);
    let (first, _, u1) = collect(h.submit(GenerateRequest::greedy(p.clone(), 10)).unwrap());
    assert_eq!(u1.cached_tokens, 0);
    let (second, _, u2) = collect(h.submit(GenerateRequest::greedy(p.clone(), 10)).unwrap());
    assert_eq!(first, second);
    assert_eq!(u2.cached_tokens, (p.len() - 1) / 16 * 16);
    assert!(u2.cached_tokens >= 32);
    assert_eq!(
        metric(h, "vllm:prefix_cache_hits_total"),
        u2.cached_tokens as f64
    );
}

#[test]
fn a_cache_whose_heads_differ_in_dtype_shares_prefixes_but_writes_no_snapshots() {
    let Some(path) = demo_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let policy = KvPolicy {
        heads: vec![KvPolicy::parse_head_override("3.1:tq4").unwrap()],
        ..KvPolicy::default()
    };
    let long = "A recipe for bread: mix flour, water, salt and yeast in a large bowl, knead the dough for ten minutes until it is smooth, let it rise for an hour in a warm place, then shape it and";
    {
        let r = common::start_with_policy(
            &path,
            "tq3".parse().unwrap(),
            &policy,
            EngineOptions::default(),
            Some(dir.path()),
        );
        let p = prompt(&r.handle, long);
        let run = || {
            collect(
                r.handle
                    .submit(GenerateRequest::greedy(p.clone(), 6))
                    .unwrap(),
            )
        };
        let (first, _, _) = run();
        let (again, _, usage) = run();
        assert_eq!(again, first);
        assert_eq!(
            usage.cached_tokens,
            (p.len() - 1) / 16 * 16,
            "prefix shared"
        );
    }
    // Shut down: a snapshot store would now hold every cached block.
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files, 0, "no block snapshots of a layer whose heads differ");
}

#[test]
fn prefix_blocks_survive_a_restart_and_bad_files_are_refused() {
    let Some(path) = demo_model() else { return };
    let dir = tempfile::tempdir().unwrap();
    let long = "A recipe for bread: mix flour, water, salt and yeast in a large bowl, knead the dough for ten minutes until it is smooth, let it rise for an hour in a warm place, then shape it and";
    let (first, p) = {
        let r = start(
            &path,
            KvDtype::Bf16,
            EngineOptions::default(),
            Some(dir.path()),
        );
        let p = prompt(&r.handle, long);
        (
            collect(
                r.handle
                    .submit(GenerateRequest::greedy(p.clone(), 10))
                    .unwrap(),
            )
            .0,
            p,
        )
    };
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let full = (p.len() - 1) / 16;
    assert!(
        files.len() >= full,
        "{} files for {full} prompt blocks",
        files.len()
    );
    {
        let r = start(
            &path,
            KvDtype::Bf16,
            EngineOptions::default(),
            Some(dir.path()),
        );
        let (again, _, usage) = collect(
            r.handle
                .submit(GenerateRequest::greedy(p.clone(), 10))
                .unwrap(),
        );
        assert_eq!(again, first, "restored blocks give the same output");
        assert_eq!(usage.cached_tokens, full * 16);
        assert_eq!(
            metric(&r.handle, "turbokv:prefix_snapshots_restored_total"),
            full as f64
        );
    }
    // Damage every file: truncate half of them, flip a byte in the others.
    for (i, f) in std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .enumerate()
    {
        let mut bytes = std::fs::read(&f).unwrap();
        if i % 2 == 0 {
            bytes.truncate(bytes.len() / 2);
        } else {
            let at = bytes.len() - 100;
            bytes[at] ^= 0x40;
        }
        std::fs::write(&f, bytes).unwrap();
    }
    let r = start(
        &path,
        KvDtype::Bf16,
        EngineOptions::default(),
        Some(dir.path()),
    );
    let (again, _, usage) = collect(
        r.handle
            .submit(GenerateRequest::greedy(p.clone(), 10))
            .unwrap(),
    );
    assert_eq!(
        again, first,
        "serving goes on, recomputing what was refused"
    );
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(
        metric(&r.handle, "turbokv:prefix_snapshots_rejected_total"),
        1.0
    );
    // Another cache format ignores these files (other identity: other names).
    drop(r);
    let r = start(
        &path,
        KvDtype::Int8,
        EngineOptions::default(),
        Some(dir.path()),
    );
    let (_, _, usage) = collect(r.handle.submit(GenerateRequest::greedy(p, 4)).unwrap());
    assert_eq!(usage.cached_tokens, 0);
}

/// A model whose sliding-window layers keep per-sequence rings (Gemma 3, the committed tiny
/// fixture) is served without prefix caching: a shared block would leave the new sequence's
/// ring empty for those tokens, a silently wrong answer.
#[test]
fn a_model_with_sliding_window_rings_serves_without_prefix_caching() {
    let Some(demo) = demo_model() else { return };
    let gemma = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/families/gemma3/model.gguf");
    let model = Model::load(&gemma, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let demo = Model::load(&demo, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let tokenizer = Tokenizer::from_gguf(&demo.gguf.as_ref().unwrap().metadata).unwrap();
    let opts = EngineOptions::default();
    assert!(opts.prefix_caching);
    let (_engine, handle) = Engine::new(
        model.transformer,
        Arc::new(tokenizer),
        KvDtype::Bf16,
        &KvPolicy::default(),
        opts,
    )
    .unwrap();
    assert!(!handle.info().prefix_caching);
}

/// A model with conv layers (LFM2, the committed tiny fixture) is served without prefix
/// caching: its conv layers' per-sequence state is not stored with the blocks, so a shared
/// prefix would resume from no state. Two requests with one prompt then both run in full
/// and give the tokens of a single-sequence session.
#[test]
fn a_model_with_conv_layers_serves_without_prefix_caching() {
    let Some(demo) = demo_model() else { return };
    let lfm2 = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/families/lfm2/model.gguf");
    let model = Model::load(&lfm2, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let reference = Model::load(&lfm2, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let demo = Model::load(&demo, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let tokenizer = Tokenizer::from_gguf(&demo.gguf.as_ref().unwrap().metadata).unwrap();
    let opts = EngineOptions {
        max_model_len: 256,
        kv_tokens: 1024,
        ..EngineOptions::default()
    };
    assert!(opts.prefix_caching);
    let (engine, handle) = Engine::new(
        model.transformer,
        Arc::new(tokenizer),
        KvDtype::Bf16,
        &KvPolicy::default(),
        opts,
    )
    .unwrap();
    assert!(!handle.info().prefix_caching);
    let thread = std::thread::spawn(move || engine.run());
    let prompt: Vec<u32> = (0..40).map(|i| (i * 5 + 3) % 128).collect();
    let mut session =
        turbokv_model::Session::new(&reference.transformer, KvDtype::Bf16, 256).unwrap();
    let want = session.generate_greedy(&prompt, 12, |_| true).unwrap();
    for _ in 0..2 {
        let stream = handle
            .submit(GenerateRequest::greedy(prompt.clone(), 12))
            .unwrap();
        let (tokens, _, usage) = collect(stream);
        assert_eq!(usage.cached_tokens, 0);
        // The engine stops at the tokenizer's end-of-sequence id; the session does not.
        assert!(!tokens.is_empty());
        assert_eq!(tokens[..], want[..tokens.len()]);
    }
    handle.shutdown();
    thread.join().unwrap();
}
