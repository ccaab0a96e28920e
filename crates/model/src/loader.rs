//! Turns a [`TensorSource`] plus a [`ModelConfig`] into resident weights on a backend.

use turbokv_backend::{Backend, WeightBytes, WeightMatrix};

use crate::ModelError;
use crate::config::ModelConfig;
use crate::source::TensorSource;

/// One transformer block's weights, resident on backend `B`.
pub struct LayerWeights<B: Backend> {
    /// Pre-mixer RMSNorm weight (before attention or the conv block).
    pub attn_norm: B::Vector,
    /// What mixes the block's tokens: attention, or (LFM2) a gated short convolution.
    pub mixer: Mixer<B>,
    /// Pre-MLP RMSNorm weight.
    pub ffn_norm: B::Vector,
    /// Gate and up projections, outputs side by side as `[gate | up]`.
    pub w_gate_up: Vec<B::Matrix>,
    /// Down projection.
    pub w_down: B::Matrix,
    /// What the family adds (Gemma's post norms).
    pub extra: LayerExtras<B>,
}

/// The token mixer of a block.
pub enum Mixer<B: Backend> {
    /// Attention over the KV cache.
    Attention(AttnWeights<B>),
    /// LFM2's gated short convolution over a per-sequence state (no KV cache).
    ShortConv(ShortConvWeights<B>),
}

impl<B: Backend> Mixer<B> {
    /// The attention weights, unless this is a conv layer.
    pub fn attention(&self) -> Option<&AttnWeights<B>> {
        match self {
            Self::Attention(a) => Some(a),
            Self::ShortConv(_) => None,
        }
    }
}

/// An attention layer's projections.
pub struct AttnWeights<B: Backend> {
    /// Q, K and V projections; one fused matrix when their formats agree, else three,
    /// whose outputs sit side by side as `[q | k | v]`.
    pub wqkv: Vec<B::Matrix>,
    /// Fused `[q | k | v]` bias (Qwen2).
    pub bqkv: Option<B::Vector>,
    /// Per-head q and k RMSNorm weights (Qwen3, Gemma 3, LFM2).
    pub qk_norm: Option<(B::Vector, B::Vector)>,
    /// Output projection.
    pub wo: B::Matrix,
}

/// A conv layer's weights (see [`Backend::short_conv`]).
pub struct ShortConvWeights<B: Backend> {
    /// `[3·hidden, hidden]`: each row of its output is `[b | c | x]`.
    pub in_proj: B::Matrix,
    /// The depthwise taps, `[hidden, L]` row-major.
    pub kernel: B::Vector,
    /// `[hidden, hidden]`.
    pub out_proj: B::Matrix,
}

/// Per-layer weights of the families beyond llama/qwen; see [`crate::arch`].
pub struct LayerExtras<B: Backend> {
    /// RMSNorm of the attention output before the residual add (Gemma).
    pub post_attn_norm: Option<B::Vector>,
    /// RMSNorm of the MLP output before the residual add (Gemma).
    pub post_ffn_norm: Option<B::Vector>,
}

impl<B: Backend> Default for LayerExtras<B> {
    fn default() -> Self {
        Self {
            post_attn_norm: None,
            post_ffn_norm: None,
        }
    }
}

/// All weights of a model, resident on backend `B`.
pub struct Weights<B: Backend> {
    /// Token embedding `[vocab, hidden]`.
    pub embed: B::Matrix,
    /// Blocks.
    pub layers: Vec<LayerWeights<B>>,
    /// Final RMSNorm weight.
    pub final_norm: B::Vector,
    /// LM head `[vocab, hidden]` (the embedding when tied).
    pub lm_head: B::Matrix,
}

/// Bytes of weights read per decoded token (every matrix once), for roofline figures.
pub fn weight_bytes(src: &dyn TensorSource, cfg: &ModelConfig) -> usize {
    let mut names = vec![cfg.arch.final_norm.to_string()];
    names.push(
        if src.has("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        }
        .into(),
    );
    for l in 0..cfg.n_layers {
        for t in [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "shortconv.in_proj",
            "shortconv.out_proj",
        ] {
            names.push(format!("blk.{l}.{t}.weight"));
        }
    }
    names
        .iter()
        .filter_map(|n| src.matrix(n).ok())
        .map(|m| m.bytes().len())
        .sum()
}

/// Loads every weight of `cfg` from `src` onto `backend`, reporting progress per layer.
pub fn load_weights<B: Backend>(
    backend: &B,
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    progress: &dyn Fn(usize, usize),
) -> Result<Weights<B>, ModelError> {
    let embed = checked(
        src.matrix("token_embd.weight")?,
        "token_embd.weight",
        cfg.vocab_size,
        cfg.hidden,
    )?;
    let lm_head = if src.has("output.weight") {
        checked(
            src.matrix("output.weight")?,
            "output.weight",
            cfg.vocab_size,
            cfg.hidden,
        )?
    } else {
        embed.clone()
    };
    let shift = cfg.arch.norm_shift;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for l in 0..cfg.n_layers {
        let name = |t: &str| format!("blk.{l}.{t}");
        let mat = |t: &str, rows, cols| -> Result<WeightMatrix, ModelError> {
            let n = name(t);
            checked(src.matrix(&n)?, &n, rows, cols)
        };
        let vec = |t: &str, len: usize| -> Result<B::Vector, ModelError> {
            let n = name(t);
            let mut v = src.vector(&n)?;
            if t.contains("norm") && shift != 0.0 {
                v.iter_mut().for_each(|x| *x += shift);
            }
            if v.len() != len {
                return Err(ModelError::TensorShape {
                    name: n,
                    detail: format!("{} values, expected {len}", v.len()),
                });
            }
            Ok(backend.vector(&v)?)
        };
        let mixer = if cfg.arch.is_conv(l) {
            Mixer::ShortConv(load_conv(backend, src, cfg, l)?)
        } else {
            Mixer::Attention(load_attention(backend, src, cfg, l, &vec)?)
        };
        let w_gate_up = fuse_rows(vec![
            mat("ffn_gate.weight", cfg.ffn, cfg.hidden)?,
            mat("ffn_up.weight", cfg.ffn, cfg.hidden)?,
        ]);
        layers.push(LayerWeights {
            attn_norm: vec("attn_norm.weight", cfg.hidden)?,
            mixer,
            ffn_norm: vec("ffn_norm.weight", cfg.hidden)?,
            w_gate_up: w_gate_up
                .iter()
                .map(|m| backend.matrix(m))
                .collect::<Result<_, _>>()?,
            w_down: backend.matrix(&mat("ffn_down.weight", cfg.hidden, cfg.ffn)?)?,
            extra: LayerExtras {
                post_attn_norm: cfg
                    .arch
                    .post_norms
                    .then(|| vec("post_attention_norm.weight", cfg.hidden))
                    .transpose()?,
                post_ffn_norm: cfg
                    .arch
                    .post_norms
                    .then(|| vec("post_ffw_norm.weight", cfg.hidden))
                    .transpose()?,
            },
        });
        progress(l + 1, cfg.n_layers);
    }
    let final_norm = cfg.arch.final_norm;
    let mut norm = src.vector(final_norm)?;
    // The logit multiplier is exact in the final norm's weight: logits are linear in it.
    norm.iter_mut()
        .for_each(|x| *x = (*x + shift) * cfg.arch.logit_scale);
    if norm.len() != cfg.hidden {
        return Err(ModelError::TensorShape {
            name: final_norm.into(),
            detail: format!("{} values, expected {}", norm.len(), cfg.hidden),
        });
    }
    Ok(Weights {
        embed: backend.matrix(&embed)?,
        layers,
        final_norm: backend.vector(&norm)?,
        lm_head: backend.matrix(&lm_head)?,
    })
}

/// Loads layer vector `name` (a tail like `attn_q_norm.weight`) with its length checked.
type VectorLoader<'a, V> = &'a dyn Fn(&str, usize) -> Result<V, ModelError>;

/// Layer `l`'s attention projections.
fn load_attention<B: Backend>(
    backend: &B,
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    l: usize,
    vec: VectorLoader<'_, B::Vector>,
) -> Result<AttnWeights<B>, ModelError> {
    let hd = cfg.head_dim;
    let name = |t: &str| format!("blk.{l}.{t}");
    let mat = |t: &str, rows, cols| -> Result<WeightMatrix, ModelError> {
        let n = name(t);
        checked(src.matrix(&n)?, &n, rows, cols)
    };
    let (q, kv) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let wqkv = fuse_rows(vec![
        mat("attn_q.weight", q, cfg.hidden)?,
        mat("attn_k.weight", kv, cfg.hidden)?,
        mat("attn_v.weight", kv, cfg.hidden)?,
    ]);
    let bqkv = if src.has(&name("attn_q.bias")) {
        let mut b = src.vector(&name("attn_q.bias"))?;
        b.extend(src.vector(&name("attn_k.bias"))?);
        b.extend(src.vector(&name("attn_v.bias"))?);
        if b.len() != q + 2 * kv {
            return Err(ModelError::TensorShape {
                name: name("attn_*.bias"),
                detail: format!("{} values, expected {}", b.len(), q + 2 * kv),
            });
        }
        Some(backend.vector(&b)?)
    } else {
        None
    };
    let qk_norm = if src.has(&name("attn_q_norm.weight")) {
        Some((
            vec("attn_q_norm.weight", hd)?,
            vec("attn_k_norm.weight", hd)?,
        ))
    } else {
        None
    };
    Ok(AttnWeights {
        wqkv: wqkv
            .iter()
            .map(|m| backend.matrix(m))
            .collect::<Result<_, _>>()?,
        bqkv,
        qk_norm,
        wo: backend.matrix(&mat("attn_output.weight", cfg.hidden, q)?)?,
    })
}

/// Layer `l`'s gated short convolution (LFM2), every tensor's shape checked.
fn load_conv<B: Backend>(
    backend: &B,
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    l: usize,
) -> Result<ShortConvWeights<B>, ModelError> {
    let h = cfg.hidden;
    let mat = |t: &str, rows, cols| -> Result<WeightMatrix, ModelError> {
        let n = format!("blk.{l}.{t}");
        checked(src.matrix(&n)?, &n, rows, cols)
    };
    let taps = cfg.arch.conv_kernel;
    let conv = mat("shortconv.conv.weight", h, taps)?;
    let mut kernel = vec![0f32; h * taps];
    for (r, row) in kernel.chunks_mut(taps).enumerate() {
        conv.row_f32(r, row)?;
    }
    Ok(ShortConvWeights {
        in_proj: backend.matrix(&mat("shortconv.in_proj.weight", 3 * h, h)?)?,
        kernel: backend.vector(&kernel)?,
        out_proj: backend.matrix(&mat("shortconv.out_proj.weight", h, h)?)?,
    })
}

fn checked(
    m: WeightMatrix,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<WeightMatrix, ModelError> {
    if (m.rows(), m.cols()) != (rows, cols) {
        return Err(ModelError::TensorShape {
            name: name.into(),
            detail: format!(
                "shape [{}, {}], expected [{rows}, {cols}]",
                m.rows(),
                m.cols()
            ),
        });
    }
    Ok(m)
}

/// Stacks matrices of one format into one (outputs side by side), so a step issues one
/// matmul instead of several; formats that differ stay separate.
fn fuse_rows(parts: Vec<WeightMatrix>) -> Vec<WeightMatrix> {
    let same = parts
        .windows(2)
        .all(|w| w[0].ty() == w[1].ty() && w[0].cols() == w[1].cols());
    if !same || parts.len() < 2 {
        return parts;
    }
    let rows = parts.iter().map(WeightMatrix::rows).sum();
    let mut bytes = Vec::with_capacity(parts.iter().map(|m| m.bytes().len()).sum());
    for m in &parts {
        bytes.extend_from_slice(m.bytes());
    }
    match WeightMatrix::new(
        parts[0].ty(),
        rows,
        parts[0].cols(),
        WeightBytes::Owned(std::sync::Arc::new(bytes)),
    ) {
        Ok(m) => vec![m],
        Err(_) => parts,
    }
}
