//! Tiny random models of each supported family, written both as a GGUF file (llama.cpp's
//! conventions, incl. its Q/K row permutation for llama) and as a Hugging Face safetensors
//! directory, then run through the engine and through a plain float64 reference forward pass
//! written here with Hugging Face semantics. Both files must give the reference's logits.

use std::collections::HashMap;
use std::path::Path;

use turbokv_backend::cpu::CpuBackend;
use turbokv_codec::KvDtype;
use turbokv_model::gguf::{GgufWriter, MetaValue};
use turbokv_model::{LoadOptions, Model, ModelError, Session};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fam {
    Llama,
    Qwen2,
    Qwen3,
}

#[derive(Clone, Copy, Debug)]
struct Shape {
    fam: Fam,
    vocab: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    tied: bool,
}

/// Hugging Face-named f32 tensors with their shapes.
type Tensors = HashMap<String, (Vec<usize>, Vec<f32>)>;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn random_weights(s: &Shape, seed: u64) -> Tensors {
    let mut r = Rng(seed);
    let mut t = Tensors::new();
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut put = |name: String, shape: Vec<usize>, scale: f32, offset: f32, r: &mut Rng| {
        let n = shape.iter().product();
        let v = r.vec(n, scale).into_iter().map(|x| x + offset).collect();
        t.insert(name, (shape, v));
    };
    put(
        "model.embed_tokens.weight".into(),
        vec![s.vocab, s.hidden],
        1.0,
        0.0,
        &mut r,
    );
    put("model.norm.weight".into(), vec![s.hidden], 0.2, 1.0, &mut r);
    if !s.tied {
        put(
            "lm_head.weight".into(),
            vec![s.vocab, s.hidden],
            0.3,
            0.0,
            &mut r,
        );
    }
    for l in 0..s.layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        let w = 1.0 / (s.hidden as f32).sqrt();
        put(
            p("input_layernorm.weight"),
            vec![s.hidden],
            0.2,
            1.0,
            &mut r,
        );
        put(
            p("post_attention_layernorm.weight"),
            vec![s.hidden],
            0.2,
            1.0,
            &mut r,
        );
        put(
            p("self_attn.q_proj.weight"),
            vec![q, s.hidden],
            2.0 * w,
            0.0,
            &mut r,
        );
        put(
            p("self_attn.k_proj.weight"),
            vec![kv, s.hidden],
            2.0 * w,
            0.0,
            &mut r,
        );
        put(
            p("self_attn.v_proj.weight"),
            vec![kv, s.hidden],
            w,
            0.0,
            &mut r,
        );
        put(
            p("self_attn.o_proj.weight"),
            vec![s.hidden, q],
            w,
            0.0,
            &mut r,
        );
        put(
            p("mlp.gate_proj.weight"),
            vec![s.ffn, s.hidden],
            w,
            0.0,
            &mut r,
        );
        put(
            p("mlp.up_proj.weight"),
            vec![s.ffn, s.hidden],
            w,
            0.0,
            &mut r,
        );
        put(
            p("mlp.down_proj.weight"),
            vec![s.hidden, s.ffn],
            1.0 / (s.ffn as f32).sqrt(),
            0.0,
            &mut r,
        );
        if s.fam == Fam::Qwen2 {
            put(p("self_attn.q_proj.bias"), vec![q], 0.5, 0.0, &mut r);
            put(p("self_attn.k_proj.bias"), vec![kv], 0.5, 0.0, &mut r);
            put(p("self_attn.v_proj.bias"), vec![kv], 0.5, 0.0, &mut r);
        }
        if s.fam == Fam::Qwen3 {
            put(
                p("self_attn.q_norm.weight"),
                vec![s.head_dim],
                0.2,
                1.0,
                &mut r,
            );
            put(
                p("self_attn.k_norm.weight"),
                vec![s.head_dim],
                0.2,
                1.0,
                &mut r,
            );
        }
    }
    t
}

const ROPE_THETA: f32 = 10_000.0;
const EPS: f32 = 1e-5;

fn write_hf_dir(s: &Shape, t: &Tensors, dir: &Path) {
    let arch = match s.fam {
        Fam::Llama => "LlamaForCausalLM",
        Fam::Qwen2 => "Qwen2ForCausalLM",
        Fam::Qwen3 => "Qwen3ForCausalLM",
    };
    let config = serde_json::json!({
        "architectures": [arch], "vocab_size": s.vocab, "hidden_size": s.hidden,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "intermediate_size": s.ffn,
        "rms_norm_eps": EPS, "rope_theta": ROPE_THETA, "max_position_embeddings": 256,
        "tie_word_embeddings": s.tied,
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

/// llama.cpp's conversion permutes Q/K rows so that interleaved-pair RoPE equals HF's
/// half-split RoPE: new row `2j + s` of a head = old row `s·hd/2 + j`.
fn permute_rows(v: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = v.len() / cols;
    let hd = rows / heads;
    let mut out = vec![0f32; v.len()];
    for h in 0..heads {
        for j in 0..hd / 2 {
            for s in 0..2 {
                let src = h * hd + s * hd / 2 + j;
                let dst = h * hd + 2 * j + s;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn write_gguf(s: &Shape, t: &Tensors, path: &Path) {
    let arch = match s.fam {
        Fam::Llama => "llama",
        Fam::Qwen2 => "qwen2",
        Fam::Qwen3 => "qwen3",
    };
    let mut w = GgufWriter::new();
    let k = |x: &str| format!("{arch}.{x}");
    w.meta("general.architecture", MetaValue::Str(arch.into()))
        .meta(&k("vocab_size"), MetaValue::U64(s.vocab as u64))
        .meta(&k("embedding_length"), MetaValue::U64(s.hidden as u64))
        .meta(&k("block_count"), MetaValue::U64(s.layers as u64))
        .meta(&k("attention.head_count"), MetaValue::U64(s.heads as u64))
        .meta(
            &k("attention.head_count_kv"),
            MetaValue::U64(s.kv_heads as u64),
        )
        .meta(
            &k("attention.key_length"),
            MetaValue::U64(s.head_dim as u64),
        )
        .meta(&k("feed_forward_length"), MetaValue::U64(s.ffn as u64))
        .meta(
            &k("attention.layer_norm_rms_epsilon"),
            MetaValue::F64(EPS as f64),
        )
        .meta(&k("rope.freq_base"), MetaValue::F64(ROPE_THETA as f64))
        .meta(&k("context_length"), MetaValue::U64(256));
    let gguf_name = |hf: &str| -> String {
        let simple = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, g)) = simple.iter().find(|(h, _)| *h == hf) {
            return g.to_string();
        }
        let rest = hf.strip_prefix("model.layers.").unwrap();
        let (l, tail) = rest.split_once('.').unwrap();
        let g = match tail {
            "input_layernorm.weight" => "attn_norm.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
            "self_attn.q_proj.weight" => "attn_q.weight",
            "self_attn.k_proj.weight" => "attn_k.weight",
            "self_attn.v_proj.weight" => "attn_v.weight",
            "self_attn.o_proj.weight" => "attn_output.weight",
            "self_attn.q_proj.bias" => "attn_q.bias",
            "self_attn.k_proj.bias" => "attn_k.bias",
            "self_attn.v_proj.bias" => "attn_v.bias",
            "self_attn.q_norm.weight" => "attn_q_norm.weight",
            "self_attn.k_norm.weight" => "attn_k_norm.weight",
            "mlp.gate_proj.weight" => "ffn_gate.weight",
            "mlp.up_proj.weight" => "ffn_up.weight",
            "mlp.down_proj.weight" => "ffn_down.weight",
            other => panic!("{other}"),
        };
        format!("blk.{l}.{g}")
    };
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    for hf in names {
        let (shape, v) = &t[hf];
        let mut v = v.clone();
        if s.fam == Fam::Llama && hf.ends_with("q_proj.weight") {
            v = permute_rows(&v, s.heads, s.hidden);
        } else if s.fam == Fam::Llama && hf.ends_with("k_proj.weight") {
            v = permute_rows(&v, s.kv_heads, s.hidden);
        }
        let dims: Vec<usize> = shape.iter().rev().copied().collect();
        w.tensor(
            &gguf_name(hf),
            &dims,
            0,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }
    std::fs::write(path, w.to_bytes()).unwrap();
}

/// Hugging Face semantics in float64: the ground truth for both files.
fn reference_logits(s: &Shape, t: &Tensors, ids: &[u32]) -> Vec<f64> {
    let g = |n: &str| -> Vec<f64> { t[n].1.iter().map(|&x| x as f64).collect() };
    let matvec = |w: &[f64], x: &[f64]| -> Vec<f64> {
        w.chunks(x.len())
            .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + EPS as f64).sqrt();
        x.iter().zip(w).map(|(a, b)| a * inv * b).collect()
    };
    let hd = s.head_dim;
    let rope = |v: &mut [f64], pos: usize| {
        for i in 0..hd / 2 {
            let f = (ROPE_THETA as f64).powf(-((2 * i) as f64) / hd as f64);
            let (sn, cs) = (pos as f64 * f).sin_cos();
            let (a, b) = (v[i], v[i + hd / 2]);
            v[i] = a * cs - b * sn;
            v[i + hd / 2] = a * sn + b * cs;
        }
    };
    let embed = g("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&i| embed[i as usize * s.hidden..(i as usize + 1) * s.hidden].to_vec())
        .collect();
    for l in 0..s.layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        let (mut ks, mut vs, mut qs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let xn = rms(x, &g(&p("input_layernorm.weight")));
            let mut q = matvec(&g(&p("self_attn.q_proj.weight")), &xn);
            let mut k = matvec(&g(&p("self_attn.k_proj.weight")), &xn);
            let mut v = matvec(&g(&p("self_attn.v_proj.weight")), &xn);
            if s.fam == Fam::Qwen2 {
                for (a, b) in [(&mut q, "q"), (&mut k, "k"), (&mut v, "v")] {
                    a.iter_mut()
                        .zip(g(&p(&format!("self_attn.{b}_proj.bias"))))
                        .for_each(|(x, b)| *x += b);
                }
            }
            for (vec, norm) in [(&mut q, "q_norm"), (&mut k, "k_norm")] {
                for head in vec.chunks_mut(hd) {
                    if s.fam == Fam::Qwen3 {
                        let n = rms(head, &g(&p(&format!("self_attn.{norm}.weight"))));
                        head.copy_from_slice(&n);
                    }
                    rope(head, pos);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0f64; s.heads * hd];
            for h in 0..s.heads {
                let kvh = h / (s.heads / s.kv_heads);
                let q = &qs[pos][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|t| {
                        q.iter()
                            .zip(&ks[t][kvh * hd..(kvh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (t, w) in e.iter().enumerate() {
                    for d in 0..hd {
                        attn[h * hd + d] += w / z * vs[t][kvh * hd + d];
                    }
                }
            }
            let o = matvec(&g(&p("self_attn.o_proj.weight")), &attn);
            x.iter_mut().zip(o).for_each(|(a, b)| *a += b);
            let xn = rms(x, &g(&p("post_attention_layernorm.weight")));
            let gate = matvec(&g(&p("mlp.gate_proj.weight")), &xn);
            let up = matvec(&g(&p("mlp.up_proj.weight")), &xn);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = matvec(&g(&p("mlp.down_proj.weight")), &act);
            x.iter_mut().zip(d).for_each(|(a, b)| *a += b);
        }
    }
    let head = if s.tied {
        g("model.embed_tokens.weight")
    } else {
        g("lm_head.weight")
    };
    xs.iter()
        .flat_map(|x| matvec(&head, &rms(x, &g("model.norm.weight"))))
        .collect()
}

fn engine_logits(path: &Path, ids: &[u32], kv: KvDtype) -> Vec<f32> {
    let model =
        Model::load(path, CpuBackend::new(), &LoadOptions::default()).expect("tiny model loads");
    let mut s = Session::new(&model.transformer, kv, 256).unwrap();
    // Two chunks, so the second attends over a cache written by the first.
    let mut all = s.prefill_all_logits(&ids[..ids.len() / 2]).unwrap();
    all.extend(s.prefill_all_logits(&ids[ids.len() / 2..]).unwrap());
    all
}

fn check_family(s: Shape, seed: u64) {
    let t = random_weights(&s, seed);
    let dir = tempdir(&format!("{:?}-{seed}", s.fam));
    write_hf_dir(&s, &t, &dir.join("hf"));
    write_gguf(&s, &t, &dir.join("model.gguf"));
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % s.vocab as u32).collect();
    let want = reference_logits(&s, &t, &ids);
    for path in [dir.join("hf"), dir.join("model.gguf")] {
        let got = engine_logits(&path, &ids, KvDtype::F16);
        assert_eq!(got.len(), want.len());
        let scale = want.iter().map(|x| x.abs()).fold(0.0, f64::max);
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        // f16 KV storage (11-bit mantissa) bounds the error at ~1e-3 relative.
        assert!(
            err < 5e-3 * scale,
            "{:?} {}: max error {err} (scale {scale})",
            s.fam,
            path.display()
        );
    }
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("turbokv-tiny-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const BASE: Shape = Shape {
    fam: Fam::Llama,
    vocab: 96,
    hidden: 64,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
    ffn: 96,
    tied: true,
};

#[test]
fn llama_gqa_tied_embeddings_match_reference() {
    check_family(BASE, 1);
}

#[test]
fn llama_without_gqa_untied_match_reference() {
    check_family(
        Shape {
            kv_heads: 4,
            tied: false,
            ..BASE
        },
        2,
    );
}

#[test]
fn qwen2_qkv_bias_matches_reference() {
    check_family(
        Shape {
            fam: Fam::Qwen2,
            heads: 8,
            kv_heads: 2,
            head_dim: 8,
            tied: false,
            ..BASE
        },
        3,
    );
}

#[test]
fn qwen3_qk_norm_matches_reference() {
    // head_dim × heads ≠ hidden, as in real Qwen3 models.
    check_family(
        Shape {
            fam: Fam::Qwen3,
            head_dim: 32,
            heads: 4,
            kv_heads: 1,
            ..BASE
        },
        4,
    );
}

#[test]
fn bad_models_give_errors_not_panics() {
    let t = random_weights(&BASE, 5);
    let dir = tempdir("bad");
    write_gguf(&BASE, &t, &dir.join("ok.gguf"));
    let bytes = std::fs::read(dir.join("ok.gguf")).unwrap();
    let load = |p: &Path| Model::load(p, CpuBackend::new(), &LoadOptions::default()).map(|_| ());

    for cut in [0, 3, 20, 200, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(dir.join("cut.gguf"), &bytes[..cut]).unwrap();
        assert!(
            load(&dir.join("cut.gguf")).is_err(),
            "truncated at {cut} loaded"
        );
    }

    let mut unknown = bytes.clone();
    let at = unknown.windows(5).position(|w| w == b"llama").unwrap();
    unknown[at..at + 5].copy_from_slice(b"mamba");
    std::fs::write(dir.join("arch.gguf"), &unknown).unwrap();
    let err = load(&dir.join("arch.gguf")).unwrap_err();
    assert!(
        matches!(err, ModelError::UnknownArchitecture { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("mamba") && err.to_string().contains("qwen3"),
        "{err}"
    );

    let mut missing = t.clone();
    missing.remove("model.layers.1.mlp.up_proj.weight");
    write_gguf(&BASE, &missing, &dir.join("missing.gguf"));
    let err = load(&dir.join("missing.gguf")).unwrap_err();
    assert!(err.to_string().contains("blk.1.ffn_up.weight"), "{err}");

    let err = load(&dir.join("nope.gguf")).unwrap_err().to_string();
    assert!(err.contains("nope.gguf"), "{err}");
    std::fs::create_dir_all(dir.join("emptydir")).unwrap();
    assert!(load(&dir.join("emptydir")).is_err());
}

/// The `BASE` shape with weights from `seed`, written as GGUF and loaded on the CPU.
fn base_model(seed: u64, tag: &str) -> Model<CpuBackend> {
    let t = random_weights(&BASE, seed);
    let dir = tempdir(tag);
    write_gguf(&BASE, &t, &dir.join("m.gguf"));
    Model::load(
        &dir.join("m.gguf"),
        CpuBackend::new(),
        &LoadOptions::default(),
    )
    .unwrap()
}

#[test]
fn prompt_longer_than_context_is_refused_and_cache_unchanged() {
    let model = base_model(6, "ctx");
    let mut s = Session::new(&model.transformer, KvDtype::F16, 32).unwrap();
    s.prefill(&[1; 20]).unwrap();
    let err = s.prefill(&[1; 13]).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::ContextOverflow {
                tokens: 33,
                limit: 32
            }
        ),
        "{err}"
    );
    assert_eq!(s.len(), 20, "a refused step must not grow the cache");
    s.prefill(&[1; 12]).unwrap();
}

/// `generate_greedy` (each step fed the step before's pick without a host round trip) gives
/// the tokens of a plain `step_top_k(·, 1)` loop and leaves the cache the same way, when it
/// runs out of tokens, when the caller stops it and when the context fills.
#[test]
fn pipelined_greedy_matches_stepwise_greedy() {
    let model = base_model(7, "greedy");
    let tm = &model.transformer;
    let prompt: Vec<u32> = (0..11).map(|i| (i * 5 + 2) % BASE.vocab as u32).collect();
    let n = 12;
    let mut reference = Vec::new();
    let mut s = Session::new(tm, KvDtype::F16, 64).unwrap();
    let mut next = s.prefill_top_k(&prompt, 1).unwrap().ids[0];
    for _ in 0..n {
        reference.push(next);
        if reference.len() < n {
            next = s.step_top_k(next, 1).unwrap().ids[0];
        }
    }
    assert_eq!(s.len(), prompt.len() + n - 1);

    let mut g = Session::new(tm, KvDtype::F16, 64).unwrap();
    let mut seen = Vec::new();
    let got = g
        .generate_greedy(&prompt, n, |tok| {
            seen.push(tok);
            true
        })
        .unwrap();
    assert_eq!(got, reference);
    assert_eq!(seen, reference, "on_token sees every token in order");
    assert_eq!(g.len(), s.len(), "all tokens but the last are cached");
    assert_eq!(g.times.prefill_tokens, prompt.len());
    assert_eq!(
        g.times.decode_tokens,
        n - 1,
        "one step per token after the first"
    );

    // Stopped by the caller after 5 tokens: the 5th is returned, not cached; a later call
    // fed that token continues the same continuation.
    let mut g = Session::new(tm, KvDtype::F16, 64).unwrap();
    let got = g
        .generate_greedy(&prompt, n, |tok| tok != reference[4])
        .unwrap();
    let stop = got.len();
    assert!(stop <= 5 && got[..] == reference[..stop]);
    assert_eq!(g.len(), prompt.len() + stop - 1);
    let rest = g
        .generate_greedy(&reference[stop - 1..stop], n - stop, |_| true)
        .unwrap();
    assert_eq!(rest, reference[stop..]);

    // A context of prompt + 3 tokens: 4 tokens (the last one is not fed), cache full.
    let mut g = Session::new(tm, KvDtype::F16, prompt.len() + 3).unwrap();
    let got = g.generate_greedy(&prompt, n, |_| true).unwrap();
    assert_eq!(got, reference[..4]);
    assert_eq!(g.len(), prompt.len() + 3);

    // Zero and one token.
    let mut g = Session::new(tm, KvDtype::F16, 64).unwrap();
    assert!(g.generate_greedy(&prompt, 0, |_| true).unwrap().is_empty());
    assert_eq!(g.len(), prompt.len());
    let mut g = Session::new(tm, KvDtype::F16, 64).unwrap();
    assert_eq!(
        g.generate_greedy(&prompt, 1, |_| true).unwrap(),
        reference[..1]
    );
    assert_eq!(g.len(), prompt.len());
    assert!(
        g.generate_greedy(&[], 3, |_| true).is_err(),
        "an empty prompt"
    );
}
