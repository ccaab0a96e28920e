//! What the families beyond llama/qwen add to the plain decoder: Granite's multipliers,
//! Gemma 3's embedding scale, pre/post norms, GeGLU and sliding-window layers with their own
//! RoPE base, and LFM2's gated short-convolution layers, which keep a small per-sequence
//! state instead of a KV cache, and gpt-oss's attention sinks and mixture-of-experts MLP.
//!
//! [`ArchConfig`] holds those hyper-parameters (read from GGUF metadata or `config.json`
//! here); [`forward`] runs the layers of a model that has any of them.

pub(crate) mod conv;
pub(crate) mod forward;
mod gpt_oss;
mod lfm2;
pub(crate) mod ring;

use serde_json::Value;

use crate::ModelError;
use crate::config::{Family, RopeScaling};
use crate::gguf::Metadata;

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpActivation {
    /// `silu(g) · u` (llama, qwen, granite).
    Silu,
    /// `gelu_tanh(g) · u` (Gemma's GeGLU).
    GeluTanh,
}

/// Family-specific hyper-parameters beyond [`crate::ModelConfig`]'s plain decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchConfig {
    /// Multiplies the embedding rows (Granite's `embedding_multiplier`, Gemma's √hidden).
    pub embed_scale: f32,
    /// Multiplies each block's attention and MLP output before the residual add (Granite).
    pub residual_scale: f32,
    /// The softmax scale when it is not `1/√head_dim` (Granite's `attention_multiplier`,
    /// Gemma's `query_pre_attn_scalar^-½`).
    pub attn_scale: Option<f32>,
    /// Multiplies the logits (Granite: `1 / logits_scaling`); folded into the final norm.
    pub logit_scale: f32,
    /// RMSNorms after attention and after the MLP, before the residual add (Gemma).
    pub post_norms: bool,
    /// The MLP activation.
    pub activation: MlpActivation,
    /// Added to every RMSNorm weight on load (Hugging Face Gemma stores `w` for `1 + w`;
    /// llama.cpp's conversion already added it).
    pub norm_shift: f32,
    /// Tokens a sliding-window layer attends (the query's own included).
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a sliding-window layer (empty: none is).
    pub local_layers: Vec<bool>,
    /// RoPE base of sliding-window layers (Gemma 3: 10 000, unscaled).
    pub local_rope_theta: Option<f32>,
    /// Per layer: whether it is a gated short-convolution block instead of attention (LFM2;
    /// empty: none is). Conv layers have no KV cache.
    pub conv_layers: Vec<bool>,
    /// Taps of the conv layers' causal convolution (LFM2's `conv_L_cache`; 0 without conv
    /// layers).
    pub conv_kernel: usize,
    /// The final norm's GGUF tensor name (LFM2 calls it `token_embd_norm.weight`).
    pub final_norm: &'static str,
    /// Whether attention layers have a learned sink logit per head (gpt-oss).
    pub sinks: bool,
    /// The pre-MLP norm's GGUF tensor name (gpt-oss's llama.cpp conversion calls it
    /// `post_attention_norm.weight`).
    pub ffn_norm: &'static str,
    /// A mixture-of-experts MLP in every layer instead of a dense one (gpt-oss).
    pub moe: Option<MoeConfig>,
}

/// A mixture-of-experts MLP's shape and activation (gpt-oss).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub n_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// The clamped SwiGLU's sigmoid slope.
    pub alpha: f32,
    /// The clamped SwiGLU's limit.
    pub limit: f32,
}

impl Default for ArchConfig {
    fn default() -> Self {
        Self {
            embed_scale: 1.0,
            residual_scale: 1.0,
            attn_scale: None,
            logit_scale: 1.0,
            post_norms: false,
            activation: MlpActivation::Silu,
            norm_shift: 0.0,
            sliding_window: None,
            local_layers: Vec::new(),
            local_rope_theta: None,
            conv_layers: Vec::new(),
            conv_kernel: 0,
            final_norm: "output_norm.weight",
            sinks: false,
            ffn_norm: "ffn_norm.weight",
            moe: None,
        }
    }
}

impl ArchConfig {
    /// Nothing beyond the plain decoder: the shared forward path runs it.
    pub fn is_plain(&self) -> bool {
        *self == Self::default()
    }

    /// The sliding window of layer `l`, if it is a local layer.
    pub fn window_of(&self, l: usize) -> Option<usize> {
        match self.local_layers.get(l) {
            Some(true) => self.sliding_window,
            _ => None,
        }
    }

    /// Whether layer `l` is a conv layer (no KV cache).
    pub fn is_conv(&self, l: usize) -> bool {
        self.conv_layers.get(l).copied().unwrap_or(false)
    }

    /// The model indices of the layers with a KV cache, in order: the KV layout's layer `i`
    /// is model layer `kv_layers(n)[i]`.
    pub fn kv_layers(&self, n_layers: usize) -> Vec<usize> {
        (0..n_layers).filter(|&l| !self.is_conv(l)).collect()
    }

    /// Checks the invariants the forward pass relies on.
    pub(crate) fn validate(&self, n_layers: usize) -> Result<(), ModelError> {
        let bad = |w: String| Err(ModelError::InvalidConfig(w));
        for (what, v) in [
            ("embedding scale", self.embed_scale),
            ("residual scale", self.residual_scale),
            ("logit scale", self.logit_scale),
            ("attention scale", self.attn_scale.unwrap_or(1.0)),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{what} {v} must be positive and finite"));
            }
        }
        if !self.local_layers.is_empty() && self.local_layers.len() != n_layers {
            return bad(format!(
                "{} layer types for {n_layers} layers",
                self.local_layers.len()
            ));
        }
        if self.local_layers.contains(&true) && self.sliding_window.is_none_or(|w| w == 0) {
            return bad("sliding-window layers need a sliding_window of at least 1 token".into());
        }
        if let Some(m) = &self.moe {
            if m.n_experts == 0 || !(1..=m.n_experts).contains(&m.top_k) {
                return bad(format!(
                    "a mixture of {} experts with {} per token: need 1 ≤ experts per token \
                     ≤ experts",
                    m.n_experts, m.top_k
                ));
            }
            if !(m.limit.is_finite() && m.limit > 0.0 && m.alpha.is_finite()) {
                return bad(format!(
                    "expert activation limit {} / alpha {} must be positive and finite",
                    m.limit, m.alpha
                ));
            }
        }
        if !self.conv_layers.is_empty() && self.conv_layers.len() != n_layers {
            return bad(format!(
                "{} layer types for {n_layers} layers",
                self.conv_layers.len()
            ));
        }
        if self.conv_layers.contains(&true) {
            if self.conv_kernel == 0 {
                return bad("conv layers need a kernel (conv_L_cache) of at least 1 tap".into());
            }
            if self.conv_layers.iter().all(|&c| c) {
                return bad(
                    "a model whose every layer is a conv layer has no KV cache to \
                     run; at least one attention layer is needed"
                        .into(),
                );
            }
            if self.local_layers.contains(&true) {
                return bad("conv layers beside sliding-window layers are not supported".into());
            }
        }
        Ok(())
    }
}

/// Per-layer tensor names of a Hugging Face checkpoint that differ from llama's, as
/// `(GGUF name, Hugging Face name)` (see [`crate::source::SafetensorsDir::with_layer_names`]).
pub fn hf_layer_names(family: Family) -> &'static [(&'static str, &'static str)] {
    match family {
        Family::Gemma3 => &[
            (
                "post_attention_norm.weight",
                "post_attention_layernorm.weight",
            ),
            ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
            ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
        ],
        Family::Lfm2 => lfm2::HF_LAYER_NAMES,
        Family::GptOss => gpt_oss::HF_LAYER_NAMES,
        _ => &[],
    }
}

/// Gemma 3's layer pattern when the file does not list it: every sixth layer is global.
const GEMMA3_PATTERN: usize = 6;
/// Gemma 3's RoPE base of the local layers when the file does not give it.
const GEMMA3_LOCAL_THETA: f32 = 10_000.0;

fn pattern_layers(n_layers: usize, pattern: usize) -> Vec<bool> {
    (0..n_layers)
        .map(|l| pattern == 0 || (l + 1) % pattern != 0)
        .collect()
}

/// Which layers slide, from `key` (`{arch}.attention.sliding_window_pattern`) as llama.cpp
/// reads it (`load_swa_pattern`): one flag per layer, or a period `n` whose last layer in
/// each period is global (0: every layer slides); the family's period `default` when absent.
fn gguf_sliding_layers(
    md: &Metadata,
    key: &str,
    n_layers: usize,
    default: usize,
) -> Result<Vec<bool>, ModelError> {
    let Some(v) = md.get(key) else {
        return Ok(pattern_layers(n_layers, default));
    };
    let Some(items) = v.as_array() else {
        return Ok(pattern_layers(n_layers, md.u64(key)? as usize));
    };
    items
        .iter()
        .map(|x| x.as_bool().or_else(|| x.as_u64().map(|n| n != 0)))
        .collect::<Option<Vec<bool>>>()
        .filter(|flags| flags.len() == n_layers)
        .ok_or_else(|| {
            ModelError::InvalidConfig(format!(
                "{key}: expected {n_layers} per-layer flags or one period, found {v:?}"
            ))
        })
}

/// The family's extras from GGUF metadata (keys `{arch}.…` as llama.cpp writes them).
pub(crate) fn from_gguf(
    family: Family,
    md: &Metadata,
    arch: &str,
    n_layers: usize,
) -> Result<ArchConfig, ModelError> {
    let k = |s: &str| format!("{arch}.{s}");
    let f = |s: &str, d: f32| -> Result<f32, ModelError> {
        Ok(md.opt_f64(&k(s))?.map_or(d, |v| v as f32))
    };
    let c = match family {
        Family::Llama | Family::Qwen2 | Family::Qwen3 => ArchConfig::default(),
        Family::Lfm2 => lfm2::from_gguf(md, arch, n_layers)?,
        Family::GptOss => gpt_oss::from_gguf(md, arch, n_layers)?,
        Family::Granite => ArchConfig {
            embed_scale: f("embedding_scale", 1.0)?,
            residual_scale: f("residual_scale", 1.0)?,
            attn_scale: md.opt_f64(&k("attention.scale"))?.map(|v| v as f32),
            logit_scale: 1.0 / f("logit_scale", 1.0)?,
            ..ArchConfig::default()
        },
        Family::Gemma3 => {
            if let Some(cap) = md.opt_f64(&k("final_logit_softcapping"))? {
                return Err(softcap_refused("final_logit_softcapping", cap));
            }
            if let Some(cap) = md.opt_f64(&k("attn_logit_softcapping"))? {
                return Err(softcap_refused("attn_logit_softcapping", cap));
            }
            let hidden = md.u64(&k("embedding_length"))? as f32;
            ArchConfig {
                embed_scale: hidden.sqrt(),
                post_norms: true,
                activation: MlpActivation::GeluTanh,
                sliding_window: Some(md.u64(&k("attention.sliding_window"))? as usize),
                local_layers: gguf_sliding_layers(
                    md,
                    &k("attention.sliding_window_pattern"),
                    n_layers,
                    GEMMA3_PATTERN,
                )?,
                local_rope_theta: Some(f("rope.freq_base_swa", GEMMA3_LOCAL_THETA)?),
                ..ArchConfig::default()
            }
        }
    };
    c.validate(n_layers)?;
    Ok(c)
}

fn softcap_refused(key: &str, cap: f64) -> ModelError {
    ModelError::InvalidConfig(format!(
        "{key} = {cap}: logit soft-capping is not implemented (Gemma 3 does not use it; \
         Gemma 2 does and is not supported)"
    ))
}

/// What `config.json` adds for the family, plus the global layers' RoPE base and scaling
/// when Transformers 5 keeps them under `rope_parameters`.
pub(crate) struct HfExtras {
    pub(crate) arch: ArchConfig,
    pub(crate) rope_theta: Option<f32>,
    pub(crate) rope_scaling: Option<RopeScaling>,
    /// The RMSNorm epsilon when the family names it otherwise (LFM2's `norm_eps`).
    pub(crate) rms_eps: Option<f32>,
    /// The MLP width when it is derived from `intermediate_size` (LFM2's auto-adjust).
    pub(crate) ffn: Option<usize>,
}

/// The family's extras from a Hugging Face `config.json`.
pub(crate) fn from_hf(
    family: Family,
    text: &str,
    hidden: usize,
    n_layers: usize,
) -> Result<HfExtras, ModelError> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| ModelError::InvalidConfig(format!("config.json: {e}")))?;
    let num = |key: &str| v.get(key).and_then(Value::as_f64).map(|x| x as f32);
    let params = v.get("rope_parameters");
    let theta_of = |p: Option<&Value>| p.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64);
    let flat_theta = theta_of(params).map(|t| t as f32);
    let mut out = HfExtras {
        arch: ArchConfig::default(),
        rope_theta: flat_theta,
        rope_scaling: None,
        rms_eps: None,
        ffn: None,
    };
    match family {
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {}
        Family::Lfm2 => {
            let l = lfm2::from_hf(&v, n_layers)?;
            out.arch = l.arch;
            out.rms_eps = Some(l.rms_eps);
            out.ffn = Some(l.ffn);
        }
        Family::GptOss => {
            let g = gpt_oss::from_hf(&v, n_layers)?;
            out.arch = g.arch;
            out.rope_scaling = Some(g.rope_scaling);
        }
        Family::Granite => {
            for key in ["attention_bias", "mlp_bias"] {
                if v.get(key).and_then(Value::as_bool) == Some(true) {
                    return Err(ModelError::InvalidConfig(format!(
                        "Granite with {key} = true is not supported"
                    )));
                }
            }
            out.arch = ArchConfig {
                embed_scale: num("embedding_multiplier").unwrap_or(1.0),
                residual_scale: num("residual_multiplier").unwrap_or(1.0),
                attn_scale: num("attention_multiplier"),
                logit_scale: 1.0 / num("logits_scaling").unwrap_or(1.0),
                ..ArchConfig::default()
            };
        }
        Family::Gemma3 => {
            for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
                if let Some(cap) = v.get(key).and_then(Value::as_f64) {
                    return Err(softcap_refused(key, cap));
                }
            }
            if let Some(act) = v.get("hidden_activation").and_then(Value::as_str)
                && act != "gelu_pytorch_tanh"
            {
                return Err(ModelError::InvalidConfig(format!(
                    "Gemma 3 hidden_activation {act:?} is not supported (gelu_pytorch_tanh is)"
                )));
            }
            let local_layers = match sliding_layer_types(&v)? {
                Some(types) => types,
                None => {
                    let pattern = v
                        .get("sliding_window_pattern")
                        .or_else(|| v.get("_sliding_window_pattern"))
                        .and_then(Value::as_u64)
                        .map_or(GEMMA3_PATTERN, |p| p as usize);
                    pattern_layers(n_layers, pattern)
                }
            };
            let local_theta = theta_of(params.and_then(|p| p.get("sliding_attention")))
                .map(|t| t as f32)
                .or(num("rope_local_base_freq"))
                .unwrap_or(GEMMA3_LOCAL_THETA);
            let full = params.and_then(|p| p.get("full_attention"));
            out.rope_theta = theta_of(full).map(|t| t as f32).or(num("rope_theta"));
            if let Some(full) = full {
                out.rope_scaling = match full.get("rope_type").and_then(Value::as_str) {
                    Some("linear") => Some(RopeScaling::Linear(
                        full.get("factor").and_then(Value::as_f64).unwrap_or(1.0) as f32,
                    )),
                    Some("default") | None => None,
                    Some(other) => {
                        return Err(ModelError::InvalidConfig(format!(
                            "unsupported rope type {other:?} for Gemma 3's global layers"
                        )));
                    }
                };
            }
            let window = v
                .get("sliding_window")
                .and_then(Value::as_u64)
                .map(|w| w as usize);
            out.arch = ArchConfig {
                embed_scale: (hidden as f32).sqrt(),
                attn_scale: num("query_pre_attn_scalar").map(|s| 1.0 / s.sqrt()),
                post_norms: true,
                activation: MlpActivation::GeluTanh,
                norm_shift: 1.0,
                sliding_window: window,
                local_layers,
                local_rope_theta: Some(local_theta),
                ..ArchConfig::default()
            };
        }
    }
    out.arch.validate(n_layers)?;
    Ok(out)
}

/// `layer_types` of a model with sliding-window and full attention layers, if given.
fn sliding_layer_types(v: &Value) -> Result<Option<Vec<bool>>, ModelError> {
    let Some(types) = v.get("layer_types").and_then(Value::as_array) else {
        return Ok(None);
    };
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            other => Err(ModelError::InvalidConfig(format!(
                "unknown layer type {other:?} (sliding_attention, full_attention)"
            ))),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use crate::config::{Family, ModelConfig, RopeScaling};

    /// A Gemma 3 1B `config.json` as published (Transformers 4.5x keys: `rope_theta`,
    /// `rope_local_base_freq`, `sliding_window_pattern`, no `layer_types`).
    const GEMMA3_1B: &str = r#"{"architectures":["Gemma3ForCausalLM"],"attn_logit_softcapping":null,
        "final_logit_softcapping":null,"head_dim":256,"hidden_activation":"gelu_pytorch_tanh",
        "hidden_size":1152,"intermediate_size":6912,"max_position_embeddings":32768,
        "model_type":"gemma3_text","num_attention_heads":4,"num_hidden_layers":26,
        "num_key_value_heads":1,"query_pre_attn_scalar":256,"rms_norm_eps":1e-06,
        "rope_local_base_freq":10000,"rope_scaling":null,"rope_theta":1000000,
        "sliding_window":512,"sliding_window_pattern":6,"vocab_size":262144}"#;

    #[test]
    fn gemma3_published_config_parses() {
        let c = ModelConfig::from_hf_json(GEMMA3_1B).unwrap();
        assert_eq!(c.family, Family::Gemma3);
        assert_eq!(c.rope_theta, 1_000_000.0);
        assert_eq!(c.arch.local_rope_theta, Some(10_000.0));
        assert_eq!(c.arch.sliding_window, Some(512));
        let globals: Vec<usize> = (0..26).filter(|&l| c.arch.window_of(l).is_none()).collect();
        assert_eq!(globals, [5, 11, 17, 23]);
        assert_eq!(c.arch.attn_scale, Some(1.0 / 16.0));
        assert_eq!(c.arch.embed_scale, (1152f32).sqrt());
        assert_eq!(c.arch.norm_shift, 1.0);

        // The 4B's linear scaling of the global layers, in either key style.
        let scaled = GEMMA3_1B.replace(
            r#""rope_scaling":null"#,
            r#""rope_scaling":{"factor":8.0,"rope_type":"linear"}"#,
        );
        let c = ModelConfig::from_hf_json(&scaled).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear(8.0));

        let capped = GEMMA3_1B.replace(
            r#""final_logit_softcapping":null"#,
            r#""final_logit_softcapping":30.0"#,
        );
        let err = ModelConfig::from_hf_json(&capped).unwrap_err();
        assert!(err.to_string().contains("soft-capping"), "{err}");
    }

    #[test]
    fn granite_config_multipliers() {
        let text = r#"{"architectures":["GraniteForCausalLM"],"hidden_size":2048,
            "intermediate_size":8192,"num_attention_heads":32,"num_hidden_layers":40,
            "num_key_value_heads":8,"vocab_size":49155,"rms_norm_eps":1e-5,
            "rope_theta":10000000.0,"embedding_multiplier":12.0,"residual_multiplier":0.22,
            "attention_multiplier":0.015625,"logits_scaling":8.0}"#;
        let c = ModelConfig::from_hf_json(text).unwrap();
        assert_eq!(c.family, Family::Granite);
        assert_eq!(c.rope_theta, 1e7);
        assert_eq!(
            (c.arch.embed_scale, c.arch.residual_scale, c.arch.attn_scale),
            (12.0, 0.22, Some(0.015625))
        );
        assert_eq!(c.arch.logit_scale, 0.125);
        let bad = text.replace(r#""logits_scaling":8.0"#, r#""logits_scaling":0.0"#);
        assert!(ModelConfig::from_hf_json(&bad).is_err());
    }
}
