//! gpt-oss's hyper-parameters: alternating sliding-window and full attention layers with
//! learned sinks, YaRN RoPE, and the mixture-of-experts MLP (router with bias, top-k, a
//! softmax over the chosen k, clamped SwiGLU experts with biases).

use serde_json::Value;

use super::{ArchConfig, MoeConfig};
use crate::ModelError;
use crate::config::{RopeScaling, YarnRopeScaling};
use crate::gguf::Metadata;

/// Per-layer tensor names of a gpt-oss checkpoint, as `(GGUF name, Hugging Face name)`.
/// transformers' experts keep their own names (`mlp.experts.*`): its `gate_up_proj`
/// (`[experts, hidden, 2·ffn]`, gate and up interleaved by column) is not GGUF's
/// `ffn_gate_up_exps` (llama.cpp's fused `[experts, 2·ffn, hidden]`, gate rows then up rows),
/// and its `down_proj` is the transpose of GGUF's `ffn_down_exps` (see [`crate::loader`]).
pub(super) const HF_LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_output.bias", "self_attn.o_proj.bias"),
    ("attn_sinks.weight", "self_attn.sinks"),
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    ("ffn_gate_inp.weight", "mlp.router.weight"),
    ("ffn_gate_inp.bias", "mlp.router.bias"),
    ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj"),
    (
        "mlp.experts.gate_up_proj_bias",
        "mlp.experts.gate_up_proj_bias",
    ),
    ("mlp.experts.down_proj", "mlp.experts.down_proj"),
    ("mlp.experts.down_proj_bias", "mlp.experts.down_proj_bias"),
];

/// The experts' activation constants (transformers' `swiglu_alpha`/`swiglu_limit`
/// defaults; llama.cpp hard-codes them for the architecture).
const ALPHA: f32 = 1.702;
const LIMIT: f32 = 7.0;

/// gpt-oss's window when a file does not give it.
const DEFAULT_WINDOW: usize = 128;

fn gpt_oss_arch(local_layers: Vec<bool>, window: usize, moe: MoeConfig) -> ArchConfig {
    ArchConfig {
        sliding_window: Some(window),
        local_layers,
        sinks: true,
        ffn_norm: "post_attention_norm.weight",
        moe: Some(moe),
        ..ArchConfig::default()
    }
}

/// transformers' default layer pattern (and llama.cpp's for the architecture): even layers
/// slide, odd layers attend to everything.
fn alternating(n_layers: usize) -> Vec<bool> {
    (0..n_layers).map(|l| l % 2 == 0).collect()
}

/// From GGUF metadata as llama.cpp's converter writes it (`GptOssModel`; the YaRN keys are
/// read with the other RoPE ones, in `config.rs`).
pub(super) fn from_gguf(
    md: &Metadata,
    arch: &str,
    n_layers: usize,
) -> Result<ArchConfig, ModelError> {
    let k = |s: &str| format!("{arch}.{s}");
    let moe = MoeConfig {
        n_experts: md.u64(&k("expert_count"))? as usize,
        top_k: md.u64(&k("expert_used_count"))? as usize,
        alpha: ALPHA,
        limit: LIMIT,
    };
    let window = md
        .opt_u64(&k("attention.sliding_window"))?
        .map_or(DEFAULT_WINDOW, |w| w as usize);
    // llama.cpp gives the sliding layers `rope.freq_base_swa` when a file has it (still
    // YaRN-scaled); gpt-oss has one base, and the local-base path here is Gemma 3's unscaled
    // one, so a file that differs is refused rather than run with the wrong frequencies.
    if let Some(swa) = md.opt_f64(&k("rope.freq_base_swa"))? {
        let base = md.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0);
        if swa != base {
            return Err(ModelError::InvalidConfig(format!(
                "gpt-oss rope.freq_base_swa {swa} differs from rope.freq_base {base}: a \
                 separate RoPE base for the sliding-window layers is not supported"
            )));
        }
    }
    // llama.cpp's period for the architecture is 2 (even layers slide), overridden by the
    // file's pattern when it has one.
    let local =
        super::gguf_sliding_layers(md, &k("attention.sliding_window_pattern"), n_layers, 2)?;
    Ok(gpt_oss_arch(local, window, moe))
}

/// What `config.json` adds for gpt-oss.
pub(super) struct HfGptOss {
    pub(super) arch: ArchConfig,
    pub(super) rope_scaling: RopeScaling,
}

/// From a Hugging Face `config.json` (transformers' `GptOssConfig`).
pub(super) fn from_hf(v: &Value, n_layers: usize) -> Result<HfGptOss, ModelError> {
    let bad = |m: String| ModelError::InvalidConfig(m);
    let uint = |key: &str| v.get(key).and_then(Value::as_u64).map(|x| x as usize);
    let num = |key: &str, d: f32| v.get(key).and_then(Value::as_f64).map_or(d, |x| x as f32);
    let n_experts = uint("num_local_experts")
        .ok_or_else(|| bad("gpt-oss config has no num_local_experts".into()))?;
    let top_k = uint("num_experts_per_tok")
        .ok_or_else(|| bad("gpt-oss config has no num_experts_per_tok".into()))?;
    let moe = MoeConfig {
        n_experts,
        top_k,
        alpha: num("swiglu_alpha", ALPHA),
        limit: num("swiglu_limit", LIMIT),
    };
    let local_layers = super::sliding_layer_types(v)?.unwrap_or_else(|| alternating(n_layers));
    let window = uint("sliding_window").unwrap_or(DEFAULT_WINDOW);
    let max_pos = uint("max_position_embeddings");
    let rope = v
        .get("rope_parameters")
        .filter(|p| p.get("rope_type").is_some() || p.get("type").is_some())
        .or_else(|| v.get("rope_scaling"))
        .filter(|p| !p.is_null());
    let rope_scaling = match rope {
        Some(p) => hf_rope(p, max_pos)?,
        None => RopeScaling::None,
    };
    Ok(HfGptOss {
        arch: gpt_oss_arch(local_layers, window, moe),
        rope_scaling,
    })
}

/// A `rope_parameters`/`rope_scaling` object: YaRN as `_compute_yarn_parameters` reads it,
/// or no scaling.
fn hf_rope(p: &Value, max_pos: Option<usize>) -> Result<RopeScaling, ModelError> {
    let bad = |m: String| ModelError::InvalidConfig(m);
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str);
    match kind {
        Some("yarn") => {}
        Some("default") | None => return Ok(RopeScaling::None),
        Some(other) => {
            return Err(bad(format!(
                "unsupported rope type {other:?} for gpt-oss (yarn, default)"
            )));
        }
    }
    let f = |key: &str| p.get(key).and_then(Value::as_f64);
    let original = f("original_max_position_embeddings")
        .or(max_pos.map(|m| m as f64))
        .ok_or_else(|| bad("yarn rope scaling needs original_max_position_embeddings".into()))?;
    let factor = match (f("factor"), max_pos) {
        (Some(x), _) => x,
        (None, Some(m)) => m as f64 / original,
        (None, None) => return Err(bad("yarn rope scaling has no factor".into())),
    };
    // transformers reads the betas with `or`: a 0 falls back to the default too.
    let beta = |key: &str, d: f64| f(key).filter(|&x| x != 0.0).unwrap_or(d);
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = match (f("attention_factor"), f("mscale"), f("mscale_all_dim")) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
            get_mscale(factor, m) / get_mscale(factor, all)
        }
        _ => get_mscale(factor, 1.0),
    };
    let y = YarnRopeScaling {
        factor: factor as f32,
        original_context: original as f32,
        beta_fast: beta("beta_fast", 32.0) as f32,
        beta_slow: beta("beta_slow", 1.0) as f32,
        truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
        attention_factor: attention_factor as f32,
    };
    if !(y.factor > 0.0 && y.original_context > 0.0 && y.attention_factor > 0.0) {
        return Err(bad(format!(
            "yarn rope scaling {y:?}: factor, original context and attention factor must be \
             positive"
        )));
    }
    Ok(RopeScaling::Yarn(y))
}

#[cfg(test)]
mod tests {
    use crate::config::{Family, ModelConfig, RopeScaling};

    /// gpt-oss-20b's `config.json` as published (transformers 4.55 keys: `rope_scaling`).
    const GPT_OSS_20B: &str = r#"{"architectures":["GptOssForCausalLM"],"attention_bias":true,
        "head_dim":64,"hidden_act":"silu","hidden_size":2880,"intermediate_size":2880,
        "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"],
        "max_position_embeddings":131072,"model_type":"gpt_oss","num_attention_heads":64,
        "num_experts_per_tok":4,"num_hidden_layers":4,"num_key_value_heads":8,
        "num_local_experts":32,"rms_norm_eps":1e-05,"rope_scaling":{"beta_fast":32.0,
        "beta_slow":1.0,"factor":32.0,"original_max_position_embeddings":4096,
        "rope_type":"yarn","truncate":false},"rope_theta":150000,"sliding_window":128,
        "swiglu_limit":7.0,"tie_word_embeddings":false,"vocab_size":201088}"#;

    #[test]
    fn gpt_oss_published_config_parses() {
        let c = ModelConfig::from_hf_json(GPT_OSS_20B).unwrap();
        assert_eq!(c.family, Family::GptOss);
        assert_eq!((c.head_dim, c.n_kv_heads, c.ffn), (64, 8, 2880));
        assert_eq!(c.rope_theta, 150_000.0);
        let RopeScaling::Yarn(y) = c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(
            (y.factor, y.original_context, y.truncate),
            (32.0, 4096.0, false)
        );
        assert!((y.attention_factor - (0.1 * 32f32.ln() + 1.0)).abs() < 1e-6);
        let m = c.arch.moe.unwrap();
        assert_eq!(
            (m.n_experts, m.top_k, m.alpha, m.limit),
            (32, 4, 1.702, 7.0)
        );
        assert!(c.arch.sinks);
        assert_eq!(c.arch.window_of(0), Some(128));
        assert_eq!(c.arch.window_of(1), None);

        let too_many =
            GPT_OSS_20B.replace(r#""num_experts_per_tok":4"#, r#""num_experts_per_tok":33"#);
        let err = ModelConfig::from_hf_json(&too_many).unwrap_err();
        assert!(err.to_string().contains("33 per token"), "{err}");
        let rope = GPT_OSS_20B.replace(r#""rope_type":"yarn""#, r#""rope_type":"longrope""#);
        let err = ModelConfig::from_hf_json(&rope).unwrap_err();
        assert!(err.to_string().contains("longrope"), "{err}");
    }

    #[test]
    fn yarn_frequencies_match_transformers() {
        // transformers 5.24 `_compute_yarn_parameters` for head_dim 64, theta 150000, factor 32,
        // original 4096, betas 32/1, truncate false (gpt-oss): pairs 0, 8, 16, 24, 31.
        let c = ModelConfig::from_hf_json(GPT_OSS_20B).unwrap();
        let f = c.rope_inv_freq();
        for (i, want) in [
            (0, 1.0f64),
            (8, 0.050_813_272_595_405_58),
            (16, 0.000_456_483_918_242_156_5),
            (24, 4.099_978_468_730_114e-6),
            (31, 3.023_511_396_804_679e-7),
        ] {
            let got = f[i] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "pair {i}: {got} vs {want}"
            );
        }
    }
}
