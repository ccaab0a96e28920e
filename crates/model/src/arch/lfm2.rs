//! LFM2's hyper-parameters: which layers are gated short-convolution blocks, the conv
//! kernel's taps, the MLP width transformers derives from `intermediate_size`, and the
//! tensor names of its Hugging Face checkpoints.

use serde_json::Value;

use super::ArchConfig;
use crate::ModelError;
use crate::gguf::Metadata;

/// Per-layer tensor names of an LFM2 checkpoint, as `(GGUF name, Hugging Face name)`.
pub(super) const HF_LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "operator_norm.weight"),
    ("ffn_norm.weight", "ffn_norm.weight"),
    ("ffn_gate.weight", "feed_forward.w1.weight"),
    ("ffn_up.weight", "feed_forward.w3.weight"),
    ("ffn_down.weight", "feed_forward.w2.weight"),
    ("attn_output.weight", "self_attn.out_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_layernorm.weight"),
    ("attn_k_norm.weight", "self_attn.k_layernorm.weight"),
    ("shortconv.conv.weight", "conv.conv.weight"),
    ("shortconv.in_proj.weight", "conv.in_proj.weight"),
    ("shortconv.out_proj.weight", "conv.out_proj.weight"),
];

/// The final norm's GGUF name (llama.cpp maps transformers' `model.embedding_norm`, which
/// LFM2 applies after the last layer, to `token_embd_norm`).
const FINAL_NORM: &str = "token_embd_norm.weight";

/// transformers' default conv taps (`conv_L_cache`).
const DEFAULT_KERNEL: usize = 3;

fn conv_arch(conv_layers: Vec<bool>, conv_kernel: usize) -> ArchConfig {
    ArchConfig {
        conv_layers,
        conv_kernel,
        final_norm: FINAL_NORM,
        ..ArchConfig::default()
    }
}

/// From GGUF metadata as llama.cpp's converter writes it: the layer types are the per-layer
/// `attention.head_count_kv` (0 = conv layer), the taps `shortconv.l_cache`.
pub(super) fn from_gguf(
    md: &Metadata,
    arch: &str,
    n_layers: usize,
) -> Result<ArchConfig, ModelError> {
    let key = format!("{arch}.attention.head_count_kv");
    let conv_layers = match md.get(&key).and_then(|v| v.as_array()) {
        Some(heads) => heads
            .iter()
            .map(|h| h.as_u64().map(|h| h == 0))
            .collect::<Option<Vec<bool>>>()
            .ok_or_else(|| ModelError::InvalidConfig(format!("{key}: non-integer entries")))?,
        // One count for every layer: an LFM2 without conv layers.
        None => vec![false; n_layers],
    };
    let kernel = md.u64(&format!("{arch}.shortconv.l_cache"))? as usize;
    Ok(conv_arch(conv_layers, kernel))
}

/// What `config.json` adds for LFM2.
pub(super) struct HfLfm2 {
    pub(super) arch: ArchConfig,
    pub(super) rms_eps: f32,
    pub(super) ffn: usize,
}

/// From a Hugging Face `config.json` (transformers' `Lfm2Config`).
pub(super) fn from_hf(v: &Value, n_layers: usize) -> Result<HfLfm2, ModelError> {
    let bad = |m: String| ModelError::InvalidConfig(m);
    if v.get("conv_bias").and_then(Value::as_bool) == Some(true) {
        return Err(bad("LFM2 with conv_bias = true is not supported".into()));
    }
    let conv_layers = match (
        v.get("layer_types").and_then(Value::as_array),
        v.get("full_attn_idxs").and_then(Value::as_array),
    ) {
        (Some(types), _) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("conv") => Ok(true),
                Some("full_attention") => Ok(false),
                other => Err(bad(format!(
                    "unknown LFM2 layer type {other:?} (conv, full_attention)"
                ))),
            })
            .collect::<Result<_, _>>()?,
        (None, Some(idxs)) => {
            let attn: Vec<u64> = idxs.iter().filter_map(Value::as_u64).collect();
            (0..n_layers as u64).map(|l| !attn.contains(&l)).collect()
        }
        // transformers' default: every layer attends.
        (None, None) => vec![false; n_layers],
    };
    let kernel = v
        .get("conv_L_cache")
        .and_then(Value::as_u64)
        .map_or(DEFAULT_KERNEL, |k| k as usize);
    let rms_eps = v.get("norm_eps").and_then(Value::as_f64).unwrap_or(1e-5) as f32;
    Ok(HfLfm2 {
        arch: conv_arch(conv_layers, kernel),
        rms_eps,
        ffn: mlp_width(v)?,
    })
}

/// The MLP width `Lfm2MLP` builds: with `block_auto_adjust_ff_dim`, ⅔ of
/// `block_ff_dim`/`intermediate_size`, times `block_ffn_dim_multiplier` and rounded up to
/// `block_multiple_of` (the rounding only when a multiplier is given, as transformers does).
fn mlp_width(v: &Value) -> Result<usize, ModelError> {
    let base = v
        .get("block_ff_dim")
        .or_else(|| v.get("intermediate_size"))
        .and_then(Value::as_u64)
        .ok_or_else(|| ModelError::InvalidConfig("LFM2 config has no intermediate_size".into()))?
        as usize;
    if v.get("block_auto_adjust_ff_dim").and_then(Value::as_bool) == Some(false) {
        return Ok(base);
    }
    let mut ff = 2 * base / 3;
    let multiplier = match v.get("block_ffn_dim_multiplier") {
        None => Some(1.0),
        Some(Value::Null) => None,
        Some(m) => m.as_f64(),
    };
    if let Some(m) = multiplier {
        ff = (m * ff as f64) as usize;
        let of = v
            .get("block_multiple_of")
            .and_then(Value::as_u64)
            .unwrap_or(256)
            .max(1) as usize;
        ff = ff.div_ceil(of) * of;
    }
    Ok(ff)
}

#[cfg(test)]
mod tests {
    use crate::config::{Family, ModelConfig};

    /// LFM2-1.2B's hyper-parameters in the keys of its `config.json` (older transformers
    /// style: `full_attn_idxs`, no `layer_types`): 16 layers, attention at six of them, the
    /// MLP width auto-adjusted from 12288 to 8192.
    const LFM2_1_2B: &str = r#"{"architectures":["Lfm2ForCausalLM"],"block_auto_adjust_ff_dim":true,
        "block_dim":2048,"block_ff_dim":12288,"block_ffn_dim_multiplier":1.0,
        "block_multiple_of":256,"block_norm_eps":1e-05,"conv_L_cache":3,"conv_bias":false,
        "full_attn_idxs":[2,5,8,10,12,14],"hidden_size":2048,"intermediate_size":12288,
        "max_position_embeddings":128000,"model_type":"lfm2","norm_eps":1e-05,
        "num_attention_heads":32,"num_hidden_layers":16,"num_key_value_heads":8,
        "rope_theta":1000000.0,"tie_embedding":true,"vocab_size":65536}"#;

    #[test]
    fn lfm2_published_config_parses() {
        let c = ModelConfig::from_hf_json(LFM2_1_2B).unwrap();
        assert_eq!(c.family, Family::Lfm2);
        assert_eq!(c.ffn, 8192);
        assert_eq!(c.rms_eps, 1e-5);
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.arch.conv_kernel, 3);
        assert_eq!(c.arch.kv_layers(c.n_layers), [2, 5, 8, 10, 12, 14]);
        assert_eq!(c.kv_layers(), 6);
        assert_eq!(c.arch.final_norm, "token_embd_norm.weight");

        let biased = LFM2_1_2B.replace(r#""conv_bias":false"#, r#""conv_bias":true"#);
        let err = ModelConfig::from_hf_json(&biased).unwrap_err();
        assert!(err.to_string().contains("conv_bias"), "{err}");

        // Every layer a conv layer leaves nothing to cache: refused, not a zero-layer cache.
        let all_conv = LFM2_1_2B.replace("[2,5,8,10,12,14]", "[]");
        let err = ModelConfig::from_hf_json(&all_conv).unwrap_err();
        assert!(err.to_string().contains("attention layer"), "{err}");
    }
}
