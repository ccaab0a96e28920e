//! gpt-oss beyond matching transformers: prefill chunks, its sliding-window layers (with
//! sinks) in bounded rings, every KV dtype and the presets' policies, and bad files naming
//! what is wrong.

use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::{KvPolicy, KvWindow};
use turbokv_codec::KvDtype;
use turbokv_model::gguf::MetaValue;
use turbokv_model::{Family, LoadOptions, Model, ModelError, Session};

use super::{assert_close, family_dir, load, mean_kl, reference, rewrite_gguf, tempdir};

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
        window: KvWindow { recent, sinks },
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

    // The family ops without the MoE op (what CUDA would be with attention variants).
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
