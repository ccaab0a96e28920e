//! Model hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`, validated
//! into one [`ModelConfig`].

use serde::Deserialize;
use turbokv_backend::RopeStyle;

use crate::ModelError;
use crate::arch::ArchConfig;
use crate::gguf::Metadata;

/// The transformer families this crate runs. They differ only in optional pieces
/// (QKV bias, q/k norm) and conventions, all captured by [`ModelConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3/3.1/3.2, SmolLM2, Mistral.
    Llama,
    /// Qwen2/2.5: bias on Q, K and V.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k.
    Qwen3,
    /// IBM Granite (3.x): llama with embedding, residual, attention and logit multipliers.
    Granite,
    /// Gemma 3 (text): sliding-window and global layers, pre/post norms, GeGLU, q/k norm.
    Gemma3,
    /// Liquid AI LFM2: gated short-convolution layers (no KV cache) between attention
    /// layers with q/k norm.
    Lfm2,
    /// OpenAI gpt-oss: attention with biases and learned sinks, alternating sliding-window
    /// and full layers, YaRN RoPE, and a mixture-of-experts MLP.
    GptOss,
}

impl Family {
    fn parse(name: &str) -> Result<Self, ModelError> {
        match name {
            "llama" | "mistral" | "LlamaForCausalLM" | "MistralForCausalLM" => Ok(Self::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            "granite" | "GraniteForCausalLM" => Ok(Self::Granite),
            "gemma3" | "gemma3_text" | "Gemma3ForCausalLM" => Ok(Self::Gemma3),
            "lfm2" | "Lfm2ForCausalLM" | "LFM2ForCausalLM" => Ok(Self::Lfm2),
            "gpt-oss" | "gpt_oss" | "GptOssForCausalLM" => Ok(Self::GptOss),
            other => Err(ModelError::UnknownArchitecture {
                found: sub_variant_hint(other),
                supported: SUPPORTED,
            }),
        }
    }
}

/// The architecture names [`Family::parse`] accepts, for error messages.
const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, granite, gemma3, lfm2, gpt-oss (GGUF) / LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GraniteForCausalLM, Gemma3ForCausalLM, Lfm2ForCausalLM, GptOssForCausalLM (Hugging Face)";

/// Llama-3-style RoPE frequency scaling (long-context extension).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    /// Overall factor.
    pub factor: f32,
    /// Wavelengths above `original_context / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f32,
    /// Wavelengths below `original_context / high_freq_factor` are kept.
    pub high_freq_factor: f32,
    /// The pre-training context length.
    pub original_context: f32,
}

/// YaRN RoPE scaling as transformers computes it (`_compute_yarn_parameters`): per pair, a
/// ramp between the original frequency (fast pairs) and the frequency divided by `factor`
/// (slow pairs), and an attention factor that scales cos and sin.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnRopeScaling {
    /// Context extension factor.
    pub factor: f32,
    /// The pre-training context length.
    pub original_context: f32,
    /// Rotations below which a pair is interpolated (transformers' default 32).
    pub beta_fast: f32,
    /// Rotations above which a pair is extrapolated (transformers' default 1).
    pub beta_slow: f32,
    /// Whether the ramp's ends are rounded to whole pairs (transformers' default true;
    /// gpt-oss sets false).
    pub truncate: bool,
    /// Multiplies cos and sin, so the softmax sees scores times its square
    /// (default `0.1 ln(factor) + 1`).
    pub attention_factor: f32,
}

impl YarnRopeScaling {
    /// transformers' default attention factor for `factor`.
    pub fn default_attention_factor(factor: f32) -> f32 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * factor.ln() + 1.0
        }
    }

    /// The scaled inverse frequencies of `dim` rotated coordinates with base `theta`.
    fn inv_freq(&self, theta: f64, dim: usize) -> Vec<f64> {
        let (b, d) = (theta, dim as f64);
        let correction = |rot: f64| {
            d * (self.original_context as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * b.ln())
        };
        let (mut low, mut high) = (
            correction(self.beta_fast as f64),
            correction(self.beta_slow as f64),
        );
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..dim / 2)
            .map(|i| {
                let extrapolated = b.powf(-((2 * i) as f64) / d);
                let interpolated = extrapolated / self.factor as f64;
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                interpolated * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }
}

/// RoPE frequency adjustment.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by a factor.
    Linear(f32),
    /// Llama 3.1's piecewise scaling.
    Llama3(Llama3RopeScaling),
    /// Per-pair frequency divisors (GGUF's `rope_freqs.weight`).
    Factors(Vec<f32>),
    /// YaRN (gpt-oss).
    Yarn(YarnRopeScaling),
}

impl RopeScaling {
    /// The factor RoPE multiplies queries and keys by (YaRN's attention factor; 1 otherwise).
    pub fn attention_factor(&self) -> f32 {
        match self {
            Self::Yarn(y) => y.attention_factor,
            _ => 1.0,
        }
    }
}

/// Validated hyper-parameters of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub family: Family,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// MLP inner width.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Coordinates per head that RoPE rotates.
    pub rope_dim: usize,
    /// RoPE pairing convention of the stored weights.
    pub rope_style: RopeStyle,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Trained context length.
    pub max_context: usize,
    /// What the family adds to the plain decoder (default: nothing).
    pub arch: ArchConfig,
}

impl ModelConfig {
    /// Layers with a KV cache: all but conv layers ([`ArchConfig::conv_layers`]). The KV
    /// layout, its policy's layer indices and calibration count these only.
    ///
    /// [`ArchConfig::conv_layers`]: crate::arch::ArchConfig::conv_layers
    pub fn kv_layers(&self) -> usize {
        self.n_layers - self.arch.conv_layers.iter().filter(|&&c| c).count()
    }

    /// Checks the invariants the forward pass relies on.
    pub fn validate(self) -> Result<Self, ModelError> {
        let bad = |what: String| Err(ModelError::InvalidConfig(what));
        if [
            self.vocab_size,
            self.hidden,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.ffn,
        ]
        .contains(&0)
        {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} kv heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim {
            return bad(format!(
                "rope dim {} must be even and ≤ head dim {}",
                self.rope_dim, self.head_dim
            ));
        }
        if !(self.rms_eps > 0.0 && self.rope_theta > 0.0) {
            return bad(format!(
                "rms eps {} and rope theta {} must be positive",
                self.rms_eps, self.rope_theta
            ));
        }
        Ok(self)
    }

    /// Per-pair inverse frequencies with scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let half = self.rope_dim / 2;
        if let RopeScaling::Yarn(y) = &self.rope_scaling {
            let f = y.inv_freq(self.rope_theta as f64, self.rope_dim);
            return f.into_iter().map(|f| f as f32).collect();
        }
        (0..half)
            .map(|i| {
                let base = (self.rope_theta as f64).powf(-((2 * i) as f64) / self.rope_dim as f64);
                let f = match &self.rope_scaling {
                    RopeScaling::None => base,
                    RopeScaling::Linear(k) => base / *k as f64,
                    RopeScaling::Factors(fs) => base / fs.get(i).copied().unwrap_or(1.0) as f64,
                    RopeScaling::Llama3(s) => llama3_scale(base, s),
                    RopeScaling::Yarn(_) => base,
                };
                f as f32
            })
            .collect()
    }

    /// Reads a GGUF file's hyper-parameters.
    pub fn from_gguf(md: &Metadata) -> Result<Self, ModelError> {
        let arch = md.str("general.architecture")?;
        let family = Family::parse(arch)?;
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = md.u64(&k("embedding_length"))? as usize;
        let n_heads = md.u64(&k("attention.head_count"))? as usize;
        let n_kv_heads = gguf_kv_heads(md, &k("attention.head_count_kv"))?.unwrap_or(n_heads);
        let head_dim = match md.opt_u64(&k("attention.key_length"))? {
            Some(v) => v as usize,
            None if n_heads > 0 => hidden / n_heads,
            None => 0,
        };
        let vocab_size = match md.opt_u64(&k("vocab_size"))? {
            Some(v) => v as usize,
            None => md.array("tokenizer.ggml.tokens")?.len(),
        };
        let rope_scaling = match md.opt_str(&k("rope.scaling.type"))? {
            Some("linear") => RopeScaling::Linear(md.f64(&k("rope.scaling.factor"))? as f32),
            Some("yarn") => RopeScaling::Yarn(gguf_yarn(md, arch, family)?),
            Some("none") | None => RopeScaling::None,
            Some(other) => {
                return Err(ModelError::InvalidConfig(format!(
                    "unsupported rope scaling type {other:?}"
                )));
            }
        };
        let n_layers = md.u64(&k("block_count"))? as usize;
        let arch_cfg = crate::arch::from_gguf(family, md, arch, n_layers)?;
        Self {
            family,
            vocab_size,
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            // A mixture of experts' width is the experts' (llama.cpp writes it separately).
            ffn: match md.opt_u64(&k("expert_feed_forward_length"))? {
                Some(f) if arch_cfg.moe.is_some() => f as usize,
                _ => md.u64(&k("feed_forward_length"))? as usize,
            },
            rms_eps: md.f64(&k("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta: md.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0) as f32,
            rope_dim: md
                .opt_u64(&k("rope.dimension_count"))?
                .map_or(head_dim, |v| v as usize),
            // llama.cpp permutes llama Q/K weights at conversion for interleaved pairs; qwen
            // files keep Hugging Face's half-split layout ("NEOX" rope in llama.cpp).
            rope_style: match family {
                Family::Llama | Family::Granite => RopeStyle::Interleaved,
                Family::Qwen2 | Family::Qwen3 | Family::Gemma3 | Family::Lfm2 | Family::GptOss => {
                    RopeStyle::HalfSplit
                }
            },
            rope_scaling,
            max_context: md
                .opt_u64(&k("context_length"))?
                .map_or(4096, |v| v as usize),
            arch: arch_cfg,
        }
        .validate()
    }

    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let raw: HfConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::InvalidConfig(format!("config.json: {e}")))?;
        let arch = raw
            .architectures
            .first()
            .map(String::as_str)
            .or(raw.model_type.as_deref())
            .unwrap_or("");
        let family = Family::parse(arch)?;
        let extras = crate::arch::from_hf(family, text, raw.hidden_size, raw.num_hidden_layers)?;
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1));
        let rope_scaling = match raw.rope_scaling.filter(|_| extras.rope_scaling.is_none()) {
            None => RopeScaling::None,
            Some(s) => match s.rope_type.as_deref().or(s.kind.as_deref()) {
                Some("llama3") => RopeScaling::Llama3(Llama3RopeScaling {
                    factor: s.factor.unwrap_or(1.0),
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_context: s.original_max_position_embeddings.unwrap_or(8192) as f32,
                }),
                Some("linear") => RopeScaling::Linear(s.factor.unwrap_or(1.0)),
                Some("default") | None => RopeScaling::None,
                Some(other) => {
                    return Err(ModelError::InvalidConfig(format!(
                        "unsupported rope_scaling type {other:?}"
                    )));
                }
            },
        };
        Self {
            family,
            vocab_size: raw.vocab_size,
            hidden: raw.hidden_size,
            n_layers: raw.num_hidden_layers,
            n_heads: raw.num_attention_heads,
            n_kv_heads: raw.num_key_value_heads.unwrap_or(raw.num_attention_heads),
            head_dim,
            ffn: extras.ffn.unwrap_or(raw.intermediate_size),
            rms_eps: extras.rms_eps.or(raw.rms_norm_eps).unwrap_or(1e-6),
            rope_theta: extras.rope_theta.or(raw.rope_theta).unwrap_or(10_000.0),
            rope_dim: head_dim,
            rope_style: RopeStyle::HalfSplit,
            rope_scaling: extras.rope_scaling.unwrap_or(rope_scaling),
            max_context: raw.max_position_embeddings.unwrap_or(4096),
            arch: extras.arch,
        }
        .validate()
    }
}

/// YaRN parameters from GGUF metadata, as llama.cpp's converter writes them: the factor, the
/// original context (absent: the training context, as llama.cpp falls back), the ramp's
/// betas from the config (`yarn_beta_fast`/`yarn_beta_slow`, else transformers' 32/1) and a
/// config's explicit attention factor (`yarn_attn_factor`, else `0.1 ln(factor) + 1`), times
/// llama.cpp's own multiplier `rope.scaling.attn_factor` when present. GGUF keeps no
/// `truncate`: it is transformers' default (rounded ramp ends) except for gpt-oss, whose
/// published config and reference implementation do not round. llama.cpp always rounds them
/// (`ggml_rope_yarn_corr_dims`), its own approximation for gpt-oss (BENCHMARKS.md measures
/// it on the tiny model).
fn gguf_yarn(md: &Metadata, arch: &str, family: Family) -> Result<YarnRopeScaling, ModelError> {
    let k = |s: &str| format!("{arch}.rope.scaling.{s}");
    let f =
        |s: &str| -> Result<Option<f32>, ModelError> { Ok(md.opt_f64(&k(s))?.map(|v| v as f32)) };
    let factor = md.f64(&k("factor"))? as f32;
    let original = match md.opt_u64(&k("original_context_length"))? {
        Some(n) => n,
        None => md.u64(&format!("{arch}.context_length"))?,
    } as f32;
    let attention_factor = f("yarn_attn_factor")?
        .unwrap_or(YarnRopeScaling::default_attention_factor(factor))
        * f("attn_factor")?.unwrap_or(1.0);
    let y = YarnRopeScaling {
        factor,
        original_context: original,
        beta_fast: f("yarn_beta_fast")?.unwrap_or(32.0),
        beta_slow: f("yarn_beta_slow")?.unwrap_or(1.0),
        truncate: family != Family::GptOss,
        attention_factor,
    };
    if !(y.factor > 0.0 && y.original_context > 0.0 && y.attention_factor > 0.0) {
        return Err(ModelError::InvalidConfig(format!(
            "yarn rope scaling {y:?}: factor, original context and attention factor must be \
             positive"
        )));
    }
    Ok(y)
}

/// KV heads from GGUF metadata: one number, or (LFM2) one per layer with 0 for layers
/// without attention, whose attention layers must then agree.
fn gguf_kv_heads(md: &Metadata, key: &str) -> Result<Option<usize>, ModelError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    if let Some(list) = v.as_array() {
        let heads: Vec<u64> = list.iter().filter_map(|h| h.as_u64()).collect();
        let attn: Vec<u64> = heads.iter().copied().filter(|&h| h > 0).collect();
        if heads.len() != list.len() || attn.windows(2).any(|w| w[0] != w[1]) {
            return Err(ModelError::InvalidConfig(format!(
                "{key}: per-layer kv heads must be one count for every attention layer \
                 (0 for others), found {list:?}"
            )));
        }
        return Ok(attn.first().map(|&h| h as usize));
    }
    Ok(Some(md.u64(key)? as usize))
}

/// An architecture name with a hint when it is a known family's variant this engine does
/// not run (e.g. Gemma 3's vision-language model).
fn sub_variant_hint(found: &str) -> String {
    let hint = match found {
        "Gemma3ForConditionalGeneration" | "Gemma3nForConditionalGeneration" | "gemma3n" => {
            " (a vision-language Gemma 3; only its text model, Gemma3ForCausalLM, is supported)"
        }
        "Gemma2ForCausalLM" | "GemmaForCausalLM" | "gemma2" | "gemma" => {
            " (Gemma 1/2 are not supported; Gemma 3 is)"
        }
        "GraniteMoeForCausalLM"
        | "GraniteMoeHybridForCausalLM"
        | "granitemoe"
        | "granitehybrid" => " (Granite's MoE variants are not supported; dense Granite is)",
        "Lfm2MoeForCausalLM" | "lfm2moe" => {
            " (LFM2's MoE variant is not supported; dense LFM2, Lfm2ForCausalLM, is)"
        }
        "GptOssForSequenceClassification" | "GptOssForTokenClassification" => {
            " (a gpt-oss classifier; only the language model, GptOssForCausalLM, is supported)"
        }
        "Lfm2VlForConditionalGeneration" => {
            " (a vision-language LFM2; only its text model, Lfm2ForCausalLM, is supported)"
        }
        _ => "",
    };
    format!("{found}{hint}")
}

fn llama3_scale(base: f64, s: &Llama3RopeScaling) -> f64 {
    let wavelen = 2.0 * std::f64::consts::PI / base;
    let low_wavelen = s.original_context as f64 / s.low_freq_factor as f64;
    let high_wavelen = s.original_context as f64 / s.high_freq_factor as f64;
    if wavelen < high_wavelen {
        base
    } else if wavelen > low_wavelen {
        base / s.factor as f64
    } else {
        let smooth = (s.original_context as f64 / wavelen - s.low_freq_factor as f64)
            / (s.high_freq_factor - s.low_freq_factor) as f64;
        (1.0 - smooth) * base / s.factor as f64 + smooth * base
    }
}

/// The fields of `config.json` this crate reads.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: usize,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}
