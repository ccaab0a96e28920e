//! gpt-oss beyond matching transformers: prefill chunks, its sliding-window layers (with
//! sinks) in bounded rings, every KV dtype and the presets' policies, the other layouts
//! llama.cpp's converter can write, and bad files naming what is wrong.

use std::path::Path;

use half::f16;
use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::{KvPolicy, KvWindow};
use turbokv_codec::KvDtype;
use turbokv_model::config::RopeScaling;
use turbokv_model::gguf::{GgufFile, GgufWriter, MetaValue, mxfp4};
use turbokv_model::{Family, LoadOptions, Model, ModelError, Session};

use super::{
    assert_close, engine_logits, family_dir, load, mean_kl, reference, rewrite_gguf, tempdir,
};

fn gpt_oss() -> Model<CpuBackend> {
    load(&family_dir("gpt_oss").join("model.gguf")).unwrap()
}

/// Prefill in chunks of several sizes (token by token, sizes that straddle the 8-token
/// window, the whole prompt) gives one-shot prefill's logits at every position, and the
/// decode step after each matches.
#[test]
fn gpt_oss_chunked_prefill_equals_one_shot() {
    let model = gpt_oss();
    let t = &model.transformer;
    let prompt = reference("gpt_oss").prompt;
    let mut one = Session::new(t, KvDtype::F16, 256).unwrap();
    let want = one.prefill_all_logits(&prompt).unwrap();
    let next = super::common::argmax(&want[want.len() - 128..]);
    let want_step = one.step(next).unwrap().to_vec();
    for chunk in [1, 3, 5, 8, 9, prompt.len()] {
        let mut s = Session::new(t, KvDtype::F16, 256).unwrap();
        let mut got = Vec::new();
        for c in prompt.chunks(chunk) {
            got.extend(s.prefill_all_logits(c).unwrap());
        }
        assert_eq!(got.len(), want.len());
        assert_close(&got, &want, &format!("chunks of {chunk}"));
        let step = s.step(next).unwrap().to_vec();
        assert_close(
            &step,
            &want_step,
            &format!("decode after chunks of {chunk}"),
        );
    }
}

/// The sliding-window layers (half of gpt-oss's) keep a bounded ring; decoding far past
/// the point where it wraps gives the logits of the same model keeping every token, with
/// the sinks in every softmax either way.
#[test]
fn gpt_oss_ring_stays_bounded_and_equals_windowed_full_attention() {
    let path = family_dir("gpt_oss").join("model.gguf");
    let (ring, full) = (load(&path).unwrap(), load(&path).unwrap());
    full.transformer.set_sliding_rings(false);
    let (tr, tf) = (&ring.transformer, &full.transformer);
    let window = tr.config().arch.sliding_window.unwrap();
    let ctx = 200;
    let mut a = Session::new(tr, KvDtype::F16, ctx).unwrap();
    let mut b = Session::new(tf, KvDtype::F16, ctx).unwrap();
    let ring_tokens = a.cache().ring_tokens_per_seq().expect("rings on");
    assert!(ring_tokens < 4 * window, "{ring_tokens} ring tokens");
    // Two of four layers count per token.
    let (ba, bb) = (a.cache().bytes_per_token(), b.cache().bytes_per_token());
    assert!((ba * 2.0 - bb).abs() < 1e-9, "{ba} vs {bb} bytes per token");
    let prompt: Vec<u32> = (0..29).map(|i| (i * 11 + 5) % 128).collect();
    let la = a.prefill_all_logits(&prompt).unwrap();
    let lb = b.prefill_all_logits(&prompt).unwrap();
    assert_close(&la, &lb, "prefill");
    let mut next = super::common::argmax(&la[la.len() - 128..]);
    for step in 0..ctx - prompt.len() {
        let ra = a.step(next).unwrap().to_vec();
        let rb = b.step(next).unwrap().to_vec();
        assert_close(&ra, &rb, &format!("decode step {step}"));
        next = super::common::argmax(&ra);
    }
    assert!(ctx >= 8 * ring_tokens, "the ring wrapped many times");
}

/// Every KV dtype and the CLI presets' policies (exact sink and recent tokens over coded
/// ones) run gpt-oss; prefill and decode stay finite and near the 16-bit cache.
#[test]
fn gpt_oss_runs_every_kv_dtype_and_preset_policy() {
    let model = gpt_oss();
    let t = &model.transformer;
    let prompt = reference("gpt_oss").prompt;
    let mut base = Session::new(t, KvDtype::F16, 256).unwrap();
    let base = base.prefill_all_logits(&prompt).unwrap();
    let window = |recent, sinks| KvPolicy {
        window: KvWindow {
            recent,
            sinks,
            ..Default::default()
        },
        ..Default::default()
    };
    for (kv, policy) in [
        ("bf16", KvPolicy::default()),
        ("int8", KvPolicy::default()),
        ("fp8", KvPolicy::default()),
        ("tq4", KvPolicy::default()),
        ("tq3", KvPolicy::default()),
        ("tq2", KvPolicy::default()),
        // balanced, compact, tiny (without its centering).
        ("k4v3", window(47, 1)),
        ("k4v2", window(15, 1)),
        ("tq2", window(19, 1)),
    ] {
        let dtype: KvDtype = kv.parse().unwrap();
        let mut s = Session::with_policy(t, dtype, &policy, 256).unwrap();
        let got = s.prefill_all_logits(&prompt).unwrap();
        assert!(got.iter().all(|x| x.is_finite()), "{kv}");
        let kl = mean_kl(&base, &got, 128);
        eprintln!(
            "gpt-oss {kv} (window {:?}): mean KL {kl:.2e} from the f16 cache",
            policy.window
        );
        assert!(kl < 0.5, "{kv}: mean KL {kl} from the f16 cache");
        let next = s.step(1).unwrap();
        assert!(next.iter().all(|x| x.is_finite()), "{kv} decode");
    }
}

/// Bad gpt-oss files: a missing sink or expert tensor and a mis-shaped sink name the
/// tensor; a top-k the expert count does not allow and a rope type this engine does not
/// run are refused by the config; a backend without the MoE op refuses the family at load.
#[test]
fn gpt_oss_bad_files_give_typed_errors() {
    let dir = tempdir("gptoss");
    let src = family_dir("gpt_oss").join("model.gguf");
    let keep = |_: &str, d: Vec<usize>, b: Vec<u8>| Some((d, b));

    for missing in ["blk.1.attn_sinks.weight", "blk.2.ffn_up_exps.weight"] {
        let path = dir.join("missing.gguf");
        rewrite_gguf(&src, &path, |n, d, b| (n != missing).then_some((d, b)), &[]);
        let err = load(&path).err().unwrap();
        assert!(
            matches!(&err, ModelError::MissingTensor(n) if n == missing),
            "{missing}: {err}"
        );
    }

    let path = dir.join("shape.gguf");
    rewrite_gguf(
        &src,
        &path,
        |n, d, b| {
            if n == "blk.0.attn_sinks.weight" {
                Some((vec![d[0] - 1], b[..b.len() - 4].to_vec()))
            } else {
                Some((d, b))
            }
        },
        &[],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::TensorShape { name, detail } if name == "blk.0.attn_sinks.weight" && detail.contains("expected 4")),
        "{err}"
    );

    // Experts stacked for another expert count.
    let path = dir.join("experts.gguf");
    rewrite_gguf(
        &src,
        &path,
        |n, d, b| {
            if n == "blk.3.ffn_down_exps.weight" {
                let per = b.len() / d[2];
                Some((vec![d[0], d[1], d[2] - 1], b[..b.len() - per].to_vec()))
            } else {
                Some((d, b))
            }
        },
        &[],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::TensorShape { name, detail } if name == "blk.3.ffn_down_exps.weight" && detail.contains("3 experts, expected 4")),
        "{err}"
    );

    let path = dir.join("topk.gguf");
    rewrite_gguf(
        &src,
        &path,
        keep,
        &[("gpt-oss.expert_used_count", MetaValue::U64(5))],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("4 experts with 5 per token")),
        "{err}"
    );

    let path = dir.join("rope.gguf");
    rewrite_gguf(
        &src,
        &path,
        keep,
        &[(
            "gpt-oss.rope.scaling.type",
            MetaValue::Str("longrope".into()),
        )],
    );
    let err = load(&path).err().unwrap();
    assert!(err.to_string().contains("longrope"), "{err}");

    // A Hugging Face directory with a sliding window the kernels cannot run.
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let src_hf = family_dir("gpt_oss").join("hf");
    std::fs::copy(
        src_hf.join("model.safetensors"),
        hf.join("model.safetensors"),
    )
    .unwrap();
    let cfg = std::fs::read_to_string(src_hf.join("config.json")).unwrap();
    std::fs::write(
        hf.join("config.json"),
        cfg.replace("\"sliding_window\": 8", "\"sliding_window\": 0"),
    )
    .unwrap();
    let err = load(&hf).err().unwrap();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("sliding_window")),
        "{err}"
    );

    // transformers' packed MXFP4 experts are refused by name.
    let packed = dir.join("packed");
    std::fs::create_dir_all(&packed).unwrap();
    std::fs::write(packed.join("config.json"), &cfg).unwrap();
    let blocks = vec![0u8; 4 * 64 * 16];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![4, 64, 1, 16], &blocks)
            .unwrap();
    let bytes = safetensors::serialize(
        [("model.layers.0.mlp.experts.gate_up_proj_blocks", view)],
        None,
    )
    .unwrap();
    std::fs::write(packed.join("model.safetensors"), bytes).unwrap();
    let err = load(&packed).err().unwrap();
    assert!(
        matches!(&err, ModelError::Safetensors { detail, .. } if detail.contains("gate_up_proj_blocks") && detail.contains("MXFP4")),
        "{err}"
    );

    // CUDA's capabilities (no sinks, no mixture of experts): refused at load.
    for path in [src_hf, src] {
        let err = Model::load(
            &path,
            super::NoShortConv(CpuBackend::new()),
            &LoadOptions::default(),
        )
        .err()
        .unwrap();
        assert!(
            matches!(
                err,
                ModelError::FamilyUnsupported {
                    family: Family::GptOss,
                    ..
                }
            ),
            "{err}"
        );
    }
}

/// One tensor of a GGUF being rewritten: name, ggml dims (fastest first), ggml type id
/// (0 F32, 1 F16, 39 MXFP4), bytes.
struct Tensor {
    name: String,
    dims: Vec<usize>,
    ty: u32,
    bytes: Vec<u8>,
}

/// Rewrites the gpt-oss fixture's GGUF to `dst` after `edit` has changed its tensor list, with
/// `meta` added or replacing keys.
fn rewrite_fixture(dst: &Path, edit: impl FnOnce(&mut Vec<Tensor>), meta: &[(&str, MetaValue)]) {
    rewrite_fixture_dropping(dst, edit, meta, &[]);
}

/// [`rewrite_fixture`], also leaving the metadata keys `drop` out.
fn rewrite_fixture_dropping(
    dst: &Path,
    edit: impl FnOnce(&mut Vec<Tensor>),
    meta: &[(&str, MetaValue)],
    drop: &[&str],
) {
    let file = GgufFile::open(&family_dir("gpt_oss").join("model.gguf")).unwrap();
    let mut tensors: Vec<Tensor> = file
        .mxfp4_tensors()
        .iter()
        .map(|t| Tensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty: mxfp4::GGML_TYPE_MXFP4,
            bytes: file.mxfp4_bytes(t).to_vec(),
        })
        .collect();
    for t in file.tensors() {
        let ty = match t.ty {
            turbokv_backend::GgmlType::F32 => 0,
            turbokv_backend::GgmlType::F16 => 1,
            other => panic!("fixture tensor type {other:?}"),
        };
        tensors.push(Tensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty,
            bytes: file.tensor_bytes(t).to_vec(),
        });
    }
    edit(&mut tensors);
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata.iter() {
        if !meta.iter().any(|(mk, _)| *mk == k) && !drop.contains(&k) {
            w.meta(k, v.clone());
        }
    }
    for (k, v) in meta {
        w.meta(k, v.clone());
    }
    for t in tensors {
        w.tensor(&t.name, &t.dims, t.ty, t.bytes);
    }
    std::fs::write(dst, w.to_bytes()).unwrap();
}

/// Removes tensor `name` from the list, returning it.
fn take(ts: &mut Vec<Tensor>, name: &str) -> Tensor {
    let i = ts.iter().position(|t| t.name == name).unwrap();
    ts.remove(i)
}

/// Outermost-first slices of `t`'s bytes, one per index of its last (slowest) dim.
fn per_outer(t: &Tensor) -> Vec<&[u8]> {
    let n = *t.dims.last().unwrap();
    t.bytes.chunks_exact(t.bytes.len() / n).collect()
}

/// Forms of a gpt-oss GGUF that llama.cpp's converter writes besides the fixture's (or that
/// llama.cpp reads) give the same model: experts in F16 (a checkpoint without MXFP4, the
/// converter's "not in MXFP4" path), Q/K/V fused into `attn_qkv` (`--fuse-qkv`), gate and
/// up fused into `ffn_gate_up_exps` as llama.cpp lays it out (gate rows, then up rows; bias
/// fused or not), and the sliding-window pattern given explicitly. A pattern that moves the
/// windows to the odd layers changes the logits, so the key is read, not ignored.
#[test]
fn gpt_oss_converter_layouts_load_the_same_model() {
    let dir = tempdir("gptoss-layouts");
    let prompt = reference("gpt_oss").prompt;
    let base = engine_logits(&gpt_oss(), &prompt, KvDtype::F16);
    let run = |path: &Path| engine_logits(&load(path).unwrap(), &prompt, KvDtype::F16);

    let path = dir.join("f16_experts.gguf");
    rewrite_fixture(
        &path,
        |ts| {
            for t in ts.iter_mut().filter(|t| t.ty == mxfp4::GGML_TYPE_MXFP4) {
                let mut vals = vec![0f32; t.bytes.len() / mxfp4::BLOCK_BYTES * mxfp4::BLOCK];
                mxfp4::dequantize(&t.bytes, &mut vals);
                // MXFP4 values of f16-rounded weights: exact in f16.
                t.bytes = vals
                    .iter()
                    .flat_map(|&v| {
                        assert_eq!(f16::from_f32(v).to_f32(), v);
                        f16::from_f32(v).to_le_bytes()
                    })
                    .collect();
                t.ty = 1;
            }
        },
        &[],
    );
    assert_close(&run(&path), &base, "F16 experts");

    let path = dir.join("fused_qkv.gguf");
    rewrite_fixture(
        &path,
        |ts| {
            for l in 0..4 {
                for kind in ["weight", "bias"] {
                    let parts: Vec<Tensor> = ["q", "k", "v"]
                        .iter()
                        .map(|p| take(ts, &format!("blk.{l}.attn_{p}.{kind}")))
                        .collect();
                    let mut dims = parts[0].dims.clone();
                    *dims.last_mut().unwrap() = parts.iter().map(|t| *t.dims.last().unwrap()).sum();
                    ts.push(Tensor {
                        name: format!("blk.{l}.attn_qkv.{kind}"),
                        dims,
                        ty: parts[0].ty,
                        bytes: parts.iter().flat_map(|t| t.bytes.clone()).collect(),
                    });
                }
            }
        },
        &[],
    );
    assert_close(&run(&path), &base, "fused attn_qkv");

    for fuse_bias in [false, true] {
        let path = dir.join("fused_gate_up.gguf");
        rewrite_fixture(
            &path,
            |ts| {
                for l in 0..4 {
                    let kinds: &[&str] = if fuse_bias {
                        &["weight", "bias"]
                    } else {
                        &["weight"]
                    };
                    for kind in kinds {
                        let g = take(ts, &format!("blk.{l}.ffn_gate_exps.{kind}"));
                        let u = take(ts, &format!("blk.{l}.ffn_up_exps.{kind}"));
                        // Per expert: its gate rows, then its up rows.
                        let bytes = per_outer(&g)
                            .into_iter()
                            .zip(per_outer(&u))
                            .flat_map(|(a, b)| [a, b].concat())
                            .collect();
                        let mut dims = g.dims.clone();
                        let at = dims.len() - 2;
                        dims[at] *= 2;
                        if *kind == "bias" {
                            dims = vec![2 * g.dims[0], g.dims[1]];
                        }
                        ts.push(Tensor {
                            name: format!("blk.{l}.ffn_gate_up_exps.{kind}"),
                            dims,
                            ty: g.ty,
                            bytes,
                        });
                    }
                }
            },
            &[],
        );
        assert_close(
            &run(&path),
            &base,
            &format!("fused ffn_gate_up_exps (bias fused: {fuse_bias})"),
        );
    }

    let key = "gpt-oss.attention.sliding_window_pattern";
    let flags = |f: [bool; 4]| MetaValue::Array(f.iter().map(|&b| MetaValue::Bool(b)).collect());
    for (what, pattern) in [
        ("period 2", MetaValue::U64(2)),
        ("per-layer flags", flags([true, false, true, false])),
    ] {
        let path = dir.join("pattern.gguf");
        rewrite_fixture(&path, |_| {}, &[(key, pattern)]);
        assert_close(&run(&path), &base, what);
    }
    let path = dir.join("odd.gguf");
    rewrite_fixture(&path, |_| {}, &[(key, flags([false, true, false, true]))]);
    let moved = run(&path);
    let diff = moved
        .iter()
        .zip(&base)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        diff > 0.1,
        "windows on the odd layers changed logits by only {diff}"
    );
}

/// The YaRN keys llama.cpp's converter writes are read: the betas (from the config), a
/// config's explicit attention factor (`yarn_attn_factor`, replacing 0.1 ln(factor) + 1)
/// times llama.cpp's multiplier `attn_factor`, and the original context falling back to the
/// training context as llama.cpp's does. No rounding of the ramp for gpt-oss (its published
/// `truncate: false`; llama.cpp rounds, see BENCHMARKS.md).
#[test]
fn gpt_oss_gguf_yarn_keys() {
    let yarn = |m: &Model<CpuBackend>| match m.transformer.config().rope_scaling {
        RopeScaling::Yarn(y) => y,
        ref other => panic!("{other:?}"),
    };
    let y = yarn(&gpt_oss());
    assert_eq!(
        (
            y.factor,
            y.original_context,
            y.beta_fast,
            y.beta_slow,
            y.truncate
        ),
        (4.0, 64.0, 32.0, 1.0, false)
    );
    assert!((y.attention_factor - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);

    let dir = tempdir("gptoss-yarn");
    let path = dir.join("yarn.gguf");
    let k = |s: &str| format!("gpt-oss.rope.scaling.{s}");
    let (bf, bs, af, mul) = (
        k("yarn_beta_fast"),
        k("yarn_beta_slow"),
        k("yarn_attn_factor"),
        k("attn_factor"),
    );
    rewrite_fixture(
        &path,
        |_| {},
        &[
            (bf.as_str(), MetaValue::F64(16.0)),
            (bs.as_str(), MetaValue::F64(2.0)),
            (af.as_str(), MetaValue::F64(1.5)),
            (mul.as_str(), MetaValue::F64(0.5)),
        ],
    );
    let y = yarn(&load(&path).unwrap());
    assert_eq!(
        (y.beta_fast, y.beta_slow, y.attention_factor),
        (16.0, 2.0, 0.75)
    );

    // Without the original context: the training context (256).
    let orig = k("original_context_length");
    rewrite_fixture_dropping(&path, |_| {}, &[], &[orig.as_str()]);
    assert_eq!(yarn(&load(&path).unwrap()).original_context, 256.0);
}

/// Converter layouts with something wrong, and sub-variants this engine does not run, are
/// refused with what is wrong named: a fused gate/up of the wrong height, a fused QKV of the
/// wrong height, a per-layer window pattern of the wrong length, and a separate RoPE base
/// for the sliding layers.
#[test]
fn gpt_oss_bad_converter_layouts_give_typed_errors() {
    let dir = tempdir("gptoss-bad-layouts");
    let path = dir.join("bad.gguf");

    // Gate alone under the fused name: half the rows.
    rewrite_fixture(
        &path,
        |ts| {
            let mut g = take(ts, "blk.1.ffn_gate_exps.weight");
            take(ts, "blk.1.ffn_up_exps.weight");
            g.name = "blk.1.ffn_gate_up_exps.weight".into();
            ts.push(g);
        },
        &[],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::TensorShape { name, detail } if name == "blk.1.ffn_gate_up_exps.weight" && detail.contains("expected [64, 64]")),
        "{err}"
    );

    // Q and K alone under the fused name.
    rewrite_fixture(
        &path,
        |ts| {
            let q = take(ts, "blk.2.attn_q.weight");
            let k = take(ts, "blk.2.attn_k.weight");
            take(ts, "blk.2.attn_v.weight");
            ts.push(Tensor {
                name: "blk.2.attn_qkv.weight".into(),
                dims: vec![q.dims[0], q.dims[1] + k.dims[1]],
                ty: q.ty,
                bytes: [q.bytes, k.bytes].concat(),
            });
        },
        &[],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::TensorShape { name, .. } if name == "blk.2.attn_qkv.weight"),
        "{err}"
    );

    let three = MetaValue::Array(vec![MetaValue::Bool(true); 3]);
    rewrite_fixture(
        &path,
        |_| {},
        &[("gpt-oss.attention.sliding_window_pattern", three)],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("sliding_window_pattern") && m.contains("4 per-layer flags")),
        "{err}"
    );

    rewrite_fixture(
        &path,
        |_| {},
        &[("gpt-oss.rope.freq_base_swa", MetaValue::F64(10_000.0))],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("freq_base_swa")),
        "{err}"
    );
    // The same base as the full layers' is what gpt-oss has: accepted.
    rewrite_fixture(
        &path,
        |_| {},
        &[("gpt-oss.rope.freq_base_swa", MetaValue::F64(150_000.0))],
    );
    load(&path).unwrap();
}
