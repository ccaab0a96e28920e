//! End to end on the GPU: random tiny models (llama with GQA, qwen2 with QKV bias, qwen3 with
//! q/k norm) and the Granite and Gemma 3 family fixtures loaded on the CPU backend (f32
//! reference weights) and on the CUDA backend (bf16 weights); logits of a chunked prefill, of
//! single-token decode steps and of a batched step over several sequences must agree, and
//! greedy decoding fed by device-side picks must give the tokens of host-fed steps. With
//! `$TURBOKV_MODEL` set, greedy continuations of the real model must agree for at least 32
//! tokens.
//!
//! Skips with a message when no GPU/driver is present.
//!
//! Tolerance: weights and matmul inputs are rounded to bf16 (2⁻⁹ relative) on the GPU; over a
//! few layers the logits drift by a few times 2⁻⁸ of their scale, so we allow `0.05·rms` of
//! the reference logits per element and require the same argmax where the top two reference
//! logits are more than that apart.

use std::collections::HashMap;
use std::path::Path;

use turbokv_backend::cpu::{CpuBackend, WeightMode};
use turbokv_backend::cuda::CudaBackend;
use turbokv_backend::{Backend, Error, TopK};
use turbokv_codec::{KeyMode, KvDtype, NormMode};
use turbokv_model::{LoadOptions, LogitsFor, Model, SeqInput, Session, StepOutput, StepTokens};

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        // Only a missing GPU or driver skips; a GPU whose backend fails to start is a failure.
        Err(e @ Error::CudaUnavailable { .. }) => {
            eprintln!("skipping CUDA end-to-end tests: {e}");
            None
        }
        Err(e) => panic!("the CUDA backend failed to start: {e}"),
    }
}

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[derive(Clone, Copy)]
struct Shape {
    arch: &'static str,
    vocab: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
}

/// Writes a Hugging Face directory (config.json + model.safetensors, f32) with random weights.
fn write_model(s: &Shape, dir: &Path, seed: u64) {
    let mut r = Rng(seed);
    let mut t: HashMap<String, (Vec<usize>, Vec<f32>)> = HashMap::new();
    let mut put = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        t.insert(
            name,
            (shape, (0..n).map(|_| r.f() * scale + offset).collect()),
        );
    };
    let (q, kv, w) = (
        s.heads * s.head_dim,
        s.kv_heads * s.head_dim,
        1.0 / (s.hidden as f32).sqrt(),
    );
    put(
        "model.embed_tokens.weight".into(),
        vec![s.vocab, s.hidden],
        1.0,
        0.0,
    );
    put("model.norm.weight".into(), vec![s.hidden], 0.2, 1.0);
    put("lm_head.weight".into(), vec![s.vocab, s.hidden], 0.3, 0.0);
    for l in 0..s.layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        put(p("input_layernorm.weight"), vec![s.hidden], 0.2, 1.0);
        put(
            p("post_attention_layernorm.weight"),
            vec![s.hidden],
            0.2,
            1.0,
        );
        put(
            p("self_attn.q_proj.weight"),
            vec![q, s.hidden],
            2.0 * w,
            0.0,
        );
        put(
            p("self_attn.k_proj.weight"),
            vec![kv, s.hidden],
            2.0 * w,
            0.0,
        );
        put(p("self_attn.v_proj.weight"), vec![kv, s.hidden], w, 0.0);
        put(p("self_attn.o_proj.weight"), vec![s.hidden, q], w, 0.0);
        put(p("mlp.gate_proj.weight"), vec![s.ffn, s.hidden], w, 0.0);
        put(p("mlp.up_proj.weight"), vec![s.ffn, s.hidden], w, 0.0);
        put(
            p("mlp.down_proj.weight"),
            vec![s.hidden, s.ffn],
            1.0 / (s.ffn as f32).sqrt(),
            0.0,
        );
        if s.arch == "Qwen2ForCausalLM" {
            put(p("self_attn.q_proj.bias"), vec![q], 0.5, 0.0);
            put(p("self_attn.k_proj.bias"), vec![kv], 0.5, 0.0);
            put(p("self_attn.v_proj.bias"), vec![kv], 0.5, 0.0);
        }
        if s.arch == "Qwen3ForCausalLM" {
            put(p("self_attn.q_norm.weight"), vec![s.head_dim], 0.2, 1.0);
            put(p("self_attn.k_norm.weight"), vec![s.head_dim], 0.2, 1.0);
        }
    }
    let config = serde_json::json!({
        "architectures": [s.arch], "vocab_size": s.vocab, "hidden_size": s.hidden,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "intermediate_size": s.ffn,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": false,
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = t
        .iter()
        .map(|(n, (shape, v))| {
            (
                n.clone(),
                shape.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, shape, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| x * x).sum::<f32>() / v.len().max(1) as f32).sqrt()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

/// Compares logits row by row (each `vocab` wide) within [`TOL_16BIT`]; returns the worst
/// error relative to rms.
fn compare(what: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    compare_rows(what, got, want, vocab, &mut None)
}

/// [`compare`], except that where `row_errs` is some, each row's error (relative to its rms)
/// is collected there instead of being held to [`TOL_16BIT`], for the caller to judge the
/// distribution (see [`SENSITIVE_ROWS`]).
fn compare_rows(
    what: &str,
    got: &[f32],
    want: &[f32],
    vocab: usize,
    row_errs: &mut Option<Vec<f32>>,
) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0f32;
    for (row, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let scale = rms(w);
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        if let Some(errs) = row_errs.as_mut() {
            errs.push(err / scale);
            worst = worst.max(err / scale);
            if err > TOL_16BIT * scale {
                eprintln!("{what} row {row}: max error {err} vs rms {scale}");
            }
            continue;
        }
        assert!(
            err <= TOL_16BIT * scale,
            "{what} row {row}: max error {err} vs rms {scale}"
        );
        worst = worst.max(err / scale);
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 0.1 * scale {
            assert_eq!(argmax(g), argmax(w), "{what} row {row}: argmax");
        }
    }
    worst
}

/// Largest logit error, relative to the row's rms, with a 16-bit cache: the backends round
/// activations to bf16 at different points.
const TOL_16BIT: f32 = 0.05;

/// Bounds on the median and 95th percentile of the per-row logit errors (relative to rms) of
/// the family fixtures in [`ROUNDING_SENSITIVE`], instead of [`TOL_16BIT`] on every row: their
/// random f16 weights amplify rounding. Rounding only their weights to bf16 (what the GPU
/// holds), on the CPU with f32 everywhere else, moves the logits of a 45-token prefill by a
/// median 0.034·rms, a 90th percentile of 0.080 and at most 0.182 for gpt-oss (27% of the
/// rows beyond 0.05), and 0.037 / 0.074 / 0.099 for LFM2 (also 27%; both measured once,
/// 2026-12-03; Granite and Gemma 3 stay within 0.024 on the GPU). gpt-oss's router may also
/// take another expert on the GPU for a token whose k-th and (k+1)-th logits lie within that
/// rounding. A kernel error (a sink, an expert, a conv state or a ring slot read wrong) moves
/// most rows by far more.
const SENSITIVE_ROWS: (f32, f32) = (0.05, 0.25);

/// The family fixtures held to [`SENSITIVE_ROWS`].
const ROUNDING_SENSITIVE: [&str; 2] = ["gpt_oss", "lfm2"];

#[test]
fn random_tiny_models_match_cpu() {
    let Some(_) = gpu() else { return };
    let shapes = [
        Shape {
            arch: "LlamaForCausalLM",
            vocab: 512,
            hidden: 256,
            layers: 3,
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            ffn: 512,
        },
        Shape {
            arch: "Qwen2ForCausalLM",
            vocab: 300,
            hidden: 128,
            layers: 2,
            heads: 4,
            kv_heads: 4,
            head_dim: 32,
            ffn: 256,
        },
        Shape {
            arch: "Qwen3ForCausalLM",
            vocab: 400,
            hidden: 256,
            layers: 2,
            heads: 16,
            kv_heads: 2,
            head_dim: 128,
            ffn: 384,
        },
        // Gemma 3's head_dim (the coded pools' keys-as-M kernels only).
        Shape {
            arch: "LlamaForCausalLM",
            vocab: 320,
            hidden: 192,
            layers: 2,
            heads: 4,
            kv_heads: 1,
            head_dim: 256,
            ffn: 256,
        },
    ];
    for (i, s) in shapes.iter().enumerate() {
        let dir = std::env::temp_dir().join(format!("turbokv-cuda-e2e-{}-{i}", std::process::id()));
        write_model(s, &dir, 7 + i as u64);
        let cpu = Model::load(
            &dir,
            CpuBackend::with_weights(WeightMode::DequantizedF32),
            &LoadOptions::default(),
        )
        .unwrap();
        let gpu = Model::load(&dir, gpu().unwrap(), &LoadOptions::default()).unwrap();
        let mut r = Rng(99 + i as u64);
        let prompt: Vec<u32> = (0..600)
            .map(|_| ((r.f() + 1.0) * 0.5 * (s.vocab - 1) as f32) as u32)
            .collect();
        for dtype in [KvDtype::Bf16, KvDtype::F16] {
            let (mut cs, mut gs) = (
                Session::new(&cpu.transformer, dtype, 1024).unwrap(),
                Session::new(&gpu.transformer, dtype, 1024).unwrap(),
            );
            // 600 tokens: two prefill chunks (512 + 88), then decode steps.
            let (cl, gl) = (
                cs.prefill_all_logits(&prompt).unwrap(),
                gs.prefill_all_logits(&prompt).unwrap(),
            );
            let e = compare(&format!("{} {dtype} prefill", s.arch), &gl, &cl, s.vocab);
            let mut worst_step = 0f32;
            let mut next = argmax(&cl[cl.len() - s.vocab..]) as u32;
            for step in 0..24 {
                let c = cs.step(next).unwrap().to_vec();
                let g = gs.step(next).unwrap().to_vec();
                worst_step = worst_step.max(compare(
                    &format!("{} {dtype} step {step}", s.arch),
                    &g,
                    &c,
                    s.vocab,
                ));
                next = argmax(&c) as u32;
            }
            eprintln!(
                "{} {dtype}: prefill max err {e:.3}·rms, decode max err {worst_step:.3}·rms",
                s.arch
            );
        }
        if matches!(s.head_dim, 64 | 128 | 256) {
            windowed_codes_match(&cpu, &gpu, s, &prompt);
        }
        batched_step_matches(&cpu, &gpu, s);
        padded_decode_matches(&cpu, &gpu, s, &prompt);
        pipelined_greedy_matches(&gpu, s, &prompt);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A coded cache with a full-precision window and sinks (the presets' form) gives the CPU's
/// logits on CUDA, through a chunked prefill and decode steps (graph replays) whose windows
/// cross block boundaries.
///
/// Not row by row within a fixed bound: the GPU rounds activations to bf16 before its matmuls
/// (the CPU keeps f32), so a key or value coordinate within that distance of a codebook
/// boundary takes the neighbouring code on one backend, a jump of a centroid gap that random
/// layers amplify. Every row mixes many such coordinates, so coded rows differ about 3× more
/// than 16-bit ones (plain tq3 measured a median of 0.063·rms, worst 0.39·rms, on the H200),
/// yet the top token stays the same; a wrong window or slot would change whole rows. So: the
/// median row within 2× the 16-bit bound, every row within 0.6·rms, and the top token equal
/// in ≥ 95% of the rows where it leads clearly.
fn windowed_codes_match<C: Backend, G: Backend>(
    cpu: &Model<C>,
    gpu: &Model<G>,
    s: &Shape,
    prompt: &[u32],
) {
    // The plain format first, as the baseline of the windowed ones (`/corrected`: corrected
    // norms, as the tiny preset has); then the parts pools (fractional widths, prod keys) at their
    // head dims.
    // (Prod keys not at head_dim 256: 256 sign bits per key flip more under the backends'
    // bf16 differences than the bounds below hold; cuda_codes checks them on equal inputs.)
    let parts = [("tq3.5", 0, 0), ("tq2.5", 15, 1), ("tq3/prod", 0, 0)];
    let parts = match s.head_dim {
        64 | 128 => &parts[..],
        256 => &parts[..2],
        _ => &[],
    };
    for &(dtype, recent, sinks) in [
        ("tq3", 0, 0),
        ("tq3", 15, 1),
        ("k4v2", 40, 4),
        ("tq3/corrected", 15, 1),
        ("fp8", 0, 0),
    ]
    .iter()
    .chain(parts)
    {
        let (dtype, mode) = dtype.split_once('/').unwrap_or((dtype, "mse"));
        let policy = turbokv_cache::KvPolicy {
            window: turbokv_cache::KvWindow {
                recent,
                sinks,
                ..Default::default()
            },
            key_mode: if mode == "prod" {
                KeyMode::Prod
            } else {
                KeyMode::Mse
            },
            norm: if mode == "corrected" {
                NormMode::Corrected
            } else {
                NormMode::Exact
            },
            ..Default::default()
        };
        let dtype: KvDtype = dtype.parse().unwrap();
        let what = format!("{} {dtype}/{mode}@w{recent}s{sinks}", s.arch);
        let (mut cs, mut gs) = (
            Session::with_policy(&cpu.transformer, dtype, &policy, 1024).unwrap(),
            Session::with_policy(&gpu.transformer, dtype, &policy, 1024).unwrap(),
        );
        let mut rows = Vec::new();
        let mut record = |g: &[f32], c: &[f32]| {
            for (g, c) in g.chunks(s.vocab).zip(c.chunks(s.vocab)) {
                let scale = rms(c);
                let err = g
                    .iter()
                    .zip(c)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                let mut sorted = c.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let clear = sorted[0] - sorted[1] > 0.1 * scale;
                rows.push((err / scale, clear, argmax(g) == argmax(c)));
            }
        };
        let (cl, gl) = (
            cs.prefill_all_logits(prompt).unwrap(),
            gs.prefill_all_logits(prompt).unwrap(),
        );
        record(&gl, &cl);
        let mut next = argmax(&cl[cl.len() - s.vocab..]) as u32;
        for _ in 0..40 {
            let c = cs.step(next).unwrap().to_vec();
            let g = gs.step(next).unwrap().to_vec();
            record(&g, &c);
            next = argmax(&c) as u32;
        }
        let mut errs: Vec<f32> = rows.iter().map(|r| r.0).collect();
        errs.sort_by(f32::total_cmp);
        let (median, worst) = (errs[errs.len() / 2], errs[errs.len() - 1]);
        let clear: Vec<bool> = rows.iter().filter(|r| r.1).map(|r| r.2).collect();
        let agree = clear.iter().filter(|&&a| a).count() as f64 / clear.len().max(1) as f64;
        eprintln!(
            "{what}: {} rows, median err {median:.3}·rms, worst {worst:.3}·rms, top token equal in {:.1}% of {} clear rows",
            rows.len(),
            100.0 * agree,
            clear.len()
        );
        // Prod keys flip more: a key's QJL signs are those of S·r for its MSE residual r,
        // about a sixth of the key's norm at these widths and Gaussian around 0, so the same
        // bf16 perturbation of a key flips several of its m signs where it moves few MSE codes
        // across a boundary, and each flip moves the key by 2γκ√m·(a column of Sᵀ)/m. The
        // kernels themselves match on equal inputs (cuda_codes, 1e-2); here the median row may
        // differ 4× the 16-bit bound and the worst 0.8·rms, the top token as for the others.
        let (median_bound, worst_bound) = if mode == "prod" {
            (4.0 * TOL_16BIT, 0.8)
        } else {
            (2.0 * TOL_16BIT, 0.6)
        };
        assert!(
            median <= median_bound,
            "{what}: median row error {median}·rms"
        );
        assert!(worst <= worst_bound, "{what}: worst row error {worst}·rms");
        assert!(
            agree >= 0.95,
            "{what}: top token equal in only {agree} of clear rows"
        );
    }
}

/// Greedy decoding fed by the device-side picks (`generate_greedy`, `forward_pick`) gives
/// exactly the tokens of host-fed `top_k(1)` steps on the same backend, for one sequence and
/// for three decoded together.
fn pipelined_greedy_matches<G: Backend>(gpu: &Model<G>, s: &Shape, prompt: &[u32]) {
    let tm = &gpu.transformer;
    let n = 40;
    let mut a = Session::new(tm, KvDtype::F16, 1024).unwrap();
    let mut want = Vec::new();
    let mut next = a.prefill_top_k(&prompt[..100], 1).unwrap().ids[0];
    for _ in 0..n {
        want.push(next);
        if want.len() < n {
            next = a.step_top_k(next, 1).unwrap().ids[0];
        }
    }
    let mut b = Session::new(tm, KvDtype::F16, 1024).unwrap();
    let got = b.generate_greedy(&prompt[..100], n, |_| true).unwrap();
    assert_eq!(got, want, "{}: pipelined greedy", s.arch);
    assert_eq!(a.len(), b.len());

    let seqs = [0u64, 1, 2];
    let prompts = [&prompt[..30], &prompt[200..203], &prompt[300..377]];
    let mut ids = [Vec::new(), Vec::new()];
    for (chained, ids) in [false, true].into_iter().zip(&mut ids) {
        let mut cache = tm.new_cache(KvDtype::Bf16, 16, 4096, 2048).unwrap();
        let mut scratch = tm.new_scratch().unwrap();
        let mut logits = Vec::new();
        for (&seq, p) in seqs.iter().zip(prompts) {
            cache.add_sequence(seq).unwrap();
            let input = [SeqInput {
                seq,
                tokens: &p[..p.len() - 1],
            }];
            tm.forward(
                &input,
                &mut cache,
                &mut scratch,
                LogitsFor::LastToken,
                &mut logits,
            )
            .unwrap();
        }
        let mut last: Vec<u32> = prompts.iter().map(|p| p[p.len() - 1]).collect();
        let mut picks = gpu.transformer.backend().new_picks().unwrap();
        let mut top = TopK::default();
        for step in 0..12 {
            let inputs: Vec<SeqInput> = seqs
                .iter()
                .zip(&last)
                .map(|(&seq, t)| SeqInput {
                    seq,
                    tokens: std::slice::from_ref(t),
                })
                .collect();
            if chained {
                let tokens = if step == 0 {
                    StepTokens::Host(&inputs)
                } else {
                    StepTokens::Picked(&seqs)
                };
                tm.forward_pick(tokens, &mut cache, &mut scratch, &mut picks)
                    .unwrap();
                tm.backend().wait_picks(&mut picks, &mut last).unwrap();
            } else {
                tm.forward_top_k(&inputs, &mut cache, &mut scratch, 1, &mut top)
                    .unwrap();
                last = top.ids.clone();
            }
            ids.extend_from_slice(&last);
        }
    }
    assert_eq!(ids[0], ids[1], "{}: three sequences chained", s.arch);
}

/// Decode steps of 3, 2 and 1 sequences padded to 4 rows (`forward_padded`, the engine's
/// buckets) on the GPU give the CPU's unpadded logits and candidates, replay one graph for
/// every size, and take no block from the allocator.
fn padded_decode_matches<C: Backend, G: Backend>(
    cpu: &Model<C>,
    gpu: &Model<G>,
    s: &Shape,
    prompt: &[u32],
) {
    let (ct, gt) = (&cpu.transformer, &gpu.transformer);
    let (mut cc, mut gc) = (
        ct.new_cache(KvDtype::Bf16, 16, 4096, 2048).unwrap(),
        gt.new_cache(KvDtype::Bf16, 16, 4096, 2048).unwrap(),
    );
    let (mut csc, mut gsc) = (ct.new_scratch().unwrap(), gt.new_scratch().unwrap());
    let (mut cl, mut gl) = (Vec::new(), Vec::new());
    let prompts = [&prompt[..40], &prompt[100..117], &prompt[300..301]];
    for (seq, p) in prompts.iter().enumerate() {
        let inp = [SeqInput {
            seq: seq as u64,
            tokens: p,
        }];
        cc.add_sequence(seq as u64).unwrap();
        gc.add_sequence(seq as u64).unwrap();
        ct.forward(&inp, &mut cc, &mut csc, LogitsFor::LastToken, &mut cl)
            .unwrap();
        gt.forward(&inp, &mut gc, &mut gsc, LogitsFor::LastToken, &mut gl)
            .unwrap();
    }
    let replayed = |b: &G| b.step_graph_stats().map_or(0, |g| g.replayed);
    let before = replayed(gt.backend());
    let mut next: Vec<u32> = prompts.iter().map(|p| p[p.len() - 1] ^ 1).collect();
    let mut top = TopK::default();
    for (step, &n) in [3usize, 2, 3, 1, 3, 3, 2, 1, 3, 3].iter().enumerate() {
        let inputs: Vec<SeqInput<'_>> = (0..n)
            .map(|q| SeqInput {
                seq: q as u64,
                tokens: std::slice::from_ref(&next[q]),
            })
            .collect();
        ct.forward(&inputs, &mut cc, &mut csc, LogitsFor::LastToken, &mut cl)
            .unwrap();
        let what = format!("{} padded step {step} ({n} rows + {})", s.arch, 4 - n);
        if step % 2 == 0 {
            let mut out = StepOutput::Logits(&mut gl);
            gt.forward_padded(&inputs, 4 - n, &mut gc, &mut gsc, &mut out)
                .unwrap();
            compare(&what, &gl, &cl, s.vocab);
        } else {
            let mut out = StepOutput::TopK {
                k: 8,
                out: &mut top,
            };
            gt.forward_padded(&inputs, 4 - n, &mut gc, &mut gsc, &mut out)
                .unwrap();
            assert_eq!(top.rows(), n, "{what}: only the real rows");
            for r in 0..n {
                let row = top.row(r).unwrap();
                let want = &cl[r * s.vocab..(r + 1) * s.vocab];
                let scale = rms(want);
                for (&id, &l) in row.ids.iter().zip(row.logits) {
                    let err = (l - want[id as usize]).abs();
                    assert!(
                        err <= TOL_16BIT * scale,
                        "{what} row {r}: {err} vs rms {scale}"
                    );
                }
            }
        }
        for (q, t) in next.iter_mut().enumerate().take(n) {
            *t = argmax(&cl[q * s.vocab..(q + 1) * s.vocab]) as u32;
        }
        assert_eq!(
            gc.allocator().free_blocks(),
            cc.allocator().free_blocks(),
            "{what}: placeholder rows take no block"
        );
    }
    assert!(
        replayed(gt.backend()) > before,
        "{}: padded steps of 3, 2 and 1 rows must replay one graph",
        s.arch
    );
}

/// One `forward` over three sequences of different lengths (a decode row, a continuation,
/// a fresh prompt), after each was prefilled separately.
fn batched_step_matches<C: Backend, G: Backend>(cpu: &Model<C>, gpu: &Model<G>, s: &Shape) {
    let (ct, gt) = (&cpu.transformer, &gpu.transformer);
    let (mut cc, mut gc) = (
        ct.new_cache(KvDtype::Bf16, 16, 4096, 2048).unwrap(),
        gt.new_cache(KvDtype::Bf16, 16, 4096, 2048).unwrap(),
    );
    let (mut csc, mut gsc) = (ct.new_scratch().unwrap(), gt.new_scratch().unwrap());
    let mut r = Rng(5);
    let mut toks = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| ((r.f() + 1.0) * 0.5 * (s.vocab - 1) as f32) as u32)
            .collect()
    };
    let hist = [toks(300), toks(45), vec![]];
    let new = [toks(1), toks(7), toks(33)];
    let (mut cl, mut gl) = (Vec::new(), Vec::new());
    for (id, h) in hist.iter().enumerate() {
        cc.add_sequence(id as u64).unwrap();
        gc.add_sequence(id as u64).unwrap();
        if !h.is_empty() {
            let inp = [SeqInput {
                seq: id as u64,
                tokens: h,
            }];
            ct.forward(&inp, &mut cc, &mut csc, LogitsFor::LastToken, &mut cl)
                .unwrap();
            gt.forward(&inp, &mut gc, &mut gsc, LogitsFor::LastToken, &mut gl)
                .unwrap();
        }
    }
    let inputs: Vec<SeqInput<'_>> = new
        .iter()
        .enumerate()
        .map(|(id, t)| SeqInput {
            seq: id as u64,
            tokens: t,
        })
        .collect();
    ct.forward(&inputs, &mut cc, &mut csc, LogitsFor::AllTokens, &mut cl)
        .unwrap();
    gt.forward(&inputs, &mut gc, &mut gsc, LogitsFor::AllTokens, &mut gl)
        .unwrap();
    let e = compare(&format!("{} batched", s.arch), &gl, &cl, s.vocab);
    eprintln!(
        "{} batched step (3 sequences, 41 rows): max err {e:.3}·rms",
        s.arch
    );
}

/// The demo model on the GPU (weights dequantized to bf16, f16 KV) against the CPU backend in
/// exact mode (f32 weights, no activation rounding: it reproduces the float64 reference's
/// greedy ids, see `reference.rs`), on the committed fixture's prompts. The CPU's default
/// mode rounds activations to 8 bits like llama.cpp and sits at a near-tie on the very first
/// token of the chat prompt, so it is not the reference here.
#[test]
fn demo_model_greedy_agrees() {
    let Some(g) = gpu() else { return };
    let Some(path) = std::env::var_os("TURBOKV_MODEL") else {
        eprintln!("skipping demo-model check: TURBOKV_MODEL is not set");
        return;
    };
    let path = std::path::PathBuf::from(path);
    let cpu = Model::load(
        &path,
        CpuBackend::with_weights(WeightMode::DequantizedF32),
        &LoadOptions::default(),
    )
    .unwrap();
    let gpu = Model::load(&path, g, &LoadOptions::default()).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/greedy_smollm2.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut longest = 0;
    for p in fixture["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let prompt: Vec<u32> = p["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let (mut cs, mut gs) = (
            Session::new(&cpu.transformer, KvDtype::F16, 512).unwrap(),
            Session::new(&gpu.transformer, KvDtype::F16, 512).unwrap(),
        );
        let mut cl = cs.prefill(&prompt).unwrap().to_vec();
        let (mut c, mut gq) = (
            argmax(&cl) as u32,
            argmax(gs.prefill(&prompt).unwrap()) as u32,
        );
        let mut agree = 0;
        while c == gq && agree < 48 {
            agree += 1;
            cl = cs.step(c).unwrap().to_vec();
            c = argmax(&cl) as u32;
            gq = argmax(gs.step(gq).unwrap()) as u32;
        }
        // Where they part, the CPU's margin between its token and the GPU's says whether it
        // was a near-tie that bf16 weights may flip (logit errors ~0.02·rms, see above).
        let margin = cl[c as usize] - cl[gq as usize];
        eprintln!(
            "demo model, {name}: greedy continuations agree for {agree} tokens (margin at the split {margin:.3})"
        );
        assert!(
            agree == 48 || margin < 0.25,
            "{name}: the GPU left the CPU's continuation after {agree} tokens where the CPU's choice led by {margin}"
        );
        longest = longest.max(agree);
        // The device-fed greedy loop against host-fed top-1 steps, both on the GPU.
        let mut stepwise = Vec::new();
        let mut a = Session::new(&gpu.transformer, KvDtype::F16, 512).unwrap();
        let mut next = a.prefill_top_k(&prompt, 1).unwrap().ids[0];
        for i in 0..48 {
            stepwise.push(next);
            if i < 47 {
                next = a.step_top_k(next, 1).unwrap().ids[0];
            }
        }
        let mut b = Session::new(&gpu.transformer, KvDtype::F16, 512).unwrap();
        let piped = b.generate_greedy(&prompt, 48, |_| true).unwrap();
        assert_eq!(piped, stepwise, "{name}: pipelined greedy");
    }
    assert!(
        longest >= 32,
        "greedy continuations agree for at most {longest} tokens"
    );
}

/// The committed family fixtures (`tests/fixtures/families/`, tiny random models in both
/// formats): GGUF or Hugging Face directory, on the CPU (f32 weights) and on the GPU.
fn family_fixture(name: &str, gguf: bool) -> std::path::PathBuf {
    let mut dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/families");
    if !dir.exists() {
        // A test binary carried to the GPU machine runs from the repository root there.
        dir = Path::new("crates/model/tests/fixtures/families").to_path_buf();
    }
    let dir = dir.join(name);
    if gguf {
        dir.join("model.gguf")
    } else {
        dir.join("hf")
    }
}

fn random_prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = Rng(seed);
    (0..n)
        .map(|_| ((r.f() + 1.0) * 0.5 * (vocab - 1) as f32) as u32)
        .collect()
}

/// `prompt` prefilled and `steps` greedy decode steps (each fed the CPU's pick) on both
/// backends, logits compared row by row as in [`random_tiny_models_match_cpu`]; returns the
/// worst prefill and decode errors relative to rms.
fn prefill_and_decode_match<C: Backend, G: Backend>(
    what: &str,
    cpu: &Model<C>,
    gpu: &Model<G>,
    dtype: KvDtype,
    prompt: &[u32],
    steps: usize,
) -> (f32, f32) {
    prefill_and_decode_rows(what, cpu, gpu, dtype, prompt, steps, &mut None)
}

/// [`prefill_and_decode_match`], collecting each row's error into `row_errs` where it is some
/// (see [`compare_rows`]).
fn prefill_and_decode_rows<C: Backend, G: Backend>(
    what: &str,
    cpu: &Model<C>,
    gpu: &Model<G>,
    dtype: KvDtype,
    prompt: &[u32],
    steps: usize,
    row_errs: &mut Option<Vec<f32>>,
) -> (f32, f32) {
    let vocab = cpu.transformer.config().vocab_size;
    let ctx = cpu.transformer.config().max_context;
    let (mut cs, mut gs) = (
        Session::new(&cpu.transformer, dtype, ctx).unwrap(),
        Session::new(&gpu.transformer, dtype, ctx).unwrap(),
    );
    let (cl, gl) = (
        cs.prefill_all_logits(prompt).unwrap(),
        gs.prefill_all_logits(prompt).unwrap(),
    );
    let e = compare_rows(
        &format!("{what} {dtype} prefill"),
        &gl,
        &cl,
        vocab,
        row_errs,
    );
    let mut worst = 0f32;
    let mut next = argmax(&cl[cl.len() - vocab..]) as u32;
    for step in 0..steps {
        let c = cs.step(next).unwrap().to_vec();
        let g = gs.step(next).unwrap().to_vec();
        worst = worst.max(compare_rows(
            &format!("{what} {dtype} step {step}"),
            &g,
            &c,
            vocab,
            row_errs,
        ));
        next = argmax(&c) as u32;
    }
    (e, worst)
}

/// Granite (multipliers: `scale`) and Gemma 3 (GeGLU: `gelu_mul`; sliding-window layers in
/// 16-bit rings: `attention_variant` with a window, read through virtual block tables) run on
/// CUDA from both fixture formats: logits of a prefill (in the rings' 8-token sub-steps for
/// Gemma 3) and of 32 decode steps (replayed as CUDA graphs) match the CPU backend's within
/// [`TOL_16BIT`] (the same bf16 rounding of weights and matmul inputs as the random tiny
/// models; these have 2 and 6 layers of width 64 and 32), and greedy continuations by the
/// device's own picks agree with the CPU's for 32 tokens — where they part, only at a near-tie
/// (the CPU's margin between the two tokens within twice the per-logit bound). gpt-oss (4
/// layers, sliding windows of 8 in rings alternating with global layers, sinks, 4 experts
/// top-2 with biases, YaRN) and LFM2 (2 attention and 3 conv layers, whose states cross the
/// host every step, so its steps run eagerly) the same way, except that their rows' errors
/// are held to [`SENSITIVE_ROWS`] and their greedy continuations may part where the CPU's
/// margin is within twice its 95th-percentile bound. (gpt-oss's head_dim of 16 has no coded
/// kernels: sinks over codes are `cuda_codes`' to test.)
#[test]
fn family_models_match_cpu() {
    let Some(_) = gpu() else { return };
    for (i, name) in ["granite", "gemma3", "gpt_oss", "lfm2"]
        .into_iter()
        .enumerate()
    {
        for gguf in [false, true] {
            let path = family_fixture(name, gguf);
            let cpu = Model::load(
                &path,
                CpuBackend::with_weights(WeightMode::DequantizedF32),
                &LoadOptions::default(),
            )
            .unwrap();
            let gpu = Model::load(&path, gpu().unwrap(), &LoadOptions::default()).unwrap();
            let vocab = cpu.transformer.config().vocab_size;
            let prompt = random_prompt(40 + i as u64, 45, vocab);
            let what = format!("{name} ({})", if gguf { "gguf" } else { "hf" });
            let replayed = |m: &Model<CudaBackend>| {
                m.transformer
                    .backend()
                    .step_graph_stats()
                    .map_or(0, |g| g.replayed)
            };
            let before = replayed(&gpu);
            let sensitive = ROUNDING_SENSITIVE.contains(&name);
            let mut errs = sensitive.then(Vec::new);
            for dtype in [KvDtype::Bf16, KvDtype::F16] {
                let (e, d) =
                    prefill_and_decode_rows(&what, &cpu, &gpu, dtype, &prompt, 32, &mut errs);
                eprintln!("{what} {dtype}: prefill max err {e:.3}·rms, decode max err {d:.3}·rms");
            }
            if let Some(mut errs) = errs {
                errs.sort_by(f32::total_cmp);
                let at = |q: f32| errs[((errs.len() - 1) as f32 * q) as usize];
                let (median, p95) = (at(0.5), at(0.95));
                eprintln!(
                    "{what}: row errors median {median:.3}·rms, p95 {p95:.3}, max {:.3} over {} rows",
                    errs[errs.len() - 1],
                    errs.len()
                );
                assert!(
                    median <= SENSITIVE_ROWS.0 && p95 <= SENSITIVE_ROWS.1,
                    "{what}: row errors median {median}, p95 {p95} (bounds {SENSITIVE_ROWS:?})"
                );
            }
            // LFM2's conv states are host memory: its steps run eagerly, never as graphs.
            if cpu.transformer.config().arch.conv_layers.contains(&true) {
                assert_eq!(replayed(&gpu), before, "{what}: no graph replays");
            } else {
                assert!(
                    replayed(&gpu) > before,
                    "{what}: decode steps must replay a CUDA graph"
                );
            }
            // Greedy: the GPU's device-fed loop against the CPU's argmax steps.
            let n = 32;
            let mut cs = Session::new(&cpu.transformer, KvDtype::F16, 256).unwrap();
            let mut gs = Session::new(&gpu.transformer, KvDtype::F16, 256).unwrap();
            let got = gs.generate_greedy(&prompt, n, |_| true).unwrap();
            let mut cl = cs.prefill(&prompt).unwrap().to_vec();
            for (k, &g) in got.iter().enumerate() {
                let c = argmax(&cl) as u32;
                if c != g {
                    let margin = cl[c as usize] - cl[g as usize];
                    let tol = if sensitive {
                        SENSITIVE_ROWS.1
                    } else {
                        TOL_16BIT
                    };
                    assert!(
                        margin <= 2.0 * tol * rms(&cl),
                        "{what}: greedy token {k}: GPU {g}, CPU {c} leading by {margin}"
                    );
                    eprintln!("{what}: greedy continuations agree for {k} tokens (near-tie)");
                    break;
                }
                if k + 1 < got.len() {
                    cl = cs.step(c).unwrap().to_vec();
                }
            }
            assert_eq!(got.len(), n, "{what}: greedy tokens");
        }
    }
}

/// Gemma 3's ring layers on CUDA past many windows: a 100-token prompt and 120 decode steps
/// (context 220 for a window of 8 in 16-token rings: each ring wraps about 14 times, and every
/// local layer's table maps old positions onto overwritten slots) give the CPU's logits, for
/// both 16-bit dtypes.
#[test]
fn gemma3_rings_wrap_like_the_cpu() {
    let Some(_) = gpu() else { return };
    let path = family_fixture("gemma3", true);
    let cpu = Model::load(
        &path,
        CpuBackend::with_weights(WeightMode::DequantizedF32),
        &LoadOptions::default(),
    )
    .unwrap();
    let gpu = Model::load(&path, gpu().unwrap(), &LoadOptions::default()).unwrap();
    let cfg = cpu.transformer.config();
    let window = cfg.arch.sliding_window.unwrap();
    let prompt = random_prompt(77, 100, cfg.vocab_size);
    assert!(prompt.len() + 120 > 20 * window && prompt.len() + 120 <= cfg.max_context);
    for dtype in [KvDtype::F16, KvDtype::Bf16] {
        let (e, d) = prefill_and_decode_match("gemma3 rings", &cpu, &gpu, dtype, &prompt, 120);
        eprintln!("gemma3 rings {dtype}: prefill max err {e:.3}·rms, decode max err {d:.3}·rms");
    }
}
