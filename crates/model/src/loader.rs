//! Turns a [`TensorSource`] plus a [`ModelConfig`] into resident weights on a backend.

use turbokv_backend::{Backend, GgmlType, MoeExpert, WeightBytes, WeightMatrix};

use crate::arch::MoeConfig;

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
    /// The MLP.
    pub mlp: Mlp<B>,
    /// What the family adds (Gemma's post norms).
    pub extra: LayerExtras<B>,
}

/// A block's MLP.
pub enum Mlp<B: Backend> {
    /// One gated MLP.
    Dense {
        /// Gate and up projections, outputs side by side as `[gate | up]`.
        gate_up: Vec<B::Matrix>,
        /// Down projection.
        down: B::Matrix,
    },
    /// A mixture of experts (gpt-oss; see [`Backend::moe`]).
    Moe(MoeWeights<B>),
}

/// A mixture-of-experts MLP's weights.
pub struct MoeWeights<B: Backend> {
    /// `[n_experts, hidden]`.
    pub router: B::Matrix,
    /// The router's bias.
    pub router_bias: Option<B::Vector>,
    /// The experts, gate and up fused as `[gate | up]` outputs.
    pub experts: Vec<MoeExpert<B::Matrix, B::Vector>>,
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
    /// Output projection bias (gpt-oss).
    pub bo: Option<B::Vector>,
    /// A learned sink logit per query head (gpt-oss; see [`turbokv_backend::AttnVariant`]).
    pub sinks: Option<B::Vector>,
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
            "attn_qkv",
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
        let mlp = match &cfg.arch.moe {
            Some(m) => Mlp::Moe(load_moe(backend, src, cfg, l, m)?),
            None => {
                let gate_up = fuse_rows(vec![
                    mat("ffn_gate.weight", cfg.ffn, cfg.hidden)?,
                    mat("ffn_up.weight", cfg.ffn, cfg.hidden)?,
                ]);
                Mlp::Dense {
                    gate_up: gate_up
                        .iter()
                        .map(|m| backend.matrix(m))
                        .collect::<Result<_, _>>()?,
                    down: backend.matrix(&mat("ffn_down.weight", cfg.hidden, cfg.ffn)?)?,
                }
            }
        };
        layers.push(LayerWeights {
            attn_norm: vec("attn_norm.weight", cfg.hidden)?,
            mixer,
            ffn_norm: vec(cfg.arch.ffn_norm, cfg.hidden)?,
            mlp,
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
    // llama.cpp's converter fuses Q, K and V into `attn_qkv` when asked (`--fuse-qkv`; llama.cpp
    // reads either form, and a fused weight may come with separate biases): the same
    // `[q | k | v]` rows this engine fuses itself.
    let wqkv = if src.has(&name("attn_qkv.weight")) {
        vec![mat("attn_qkv.weight", q + 2 * kv, cfg.hidden)?]
    } else {
        fuse_rows(vec![
            mat("attn_q.weight", q, cfg.hidden)?,
            mat("attn_k.weight", kv, cfg.hidden)?,
            mat("attn_v.weight", kv, cfg.hidden)?,
        ])
    };
    let bias_parts: &[&str] = if src.has(&name("attn_qkv.bias")) {
        &["attn_qkv.bias"]
    } else if src.has(&name("attn_q.bias")) {
        &["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    } else {
        &[]
    };
    let bqkv = if bias_parts.is_empty() {
        None
    } else {
        let mut b = Vec::with_capacity(q + 2 * kv);
        for t in bias_parts {
            b.extend(src.vector(&name(t))?);
        }
        if b.len() != q + 2 * kv {
            return Err(ModelError::TensorShape {
                name: name(if bias_parts.len() == 1 {
                    "attn_qkv.bias"
                } else {
                    "attn_*.bias"
                }),
                detail: format!("{} values, expected {}", b.len(), q + 2 * kv),
            });
        }
        Some(backend.vector(&b)?)
    };
    let qk_norm = if src.has(&name("attn_q_norm.weight")) {
        Some((
            vec("attn_q_norm.weight", hd)?,
            vec("attn_k_norm.weight", hd)?,
        ))
    } else {
        None
    };
    let bo = src
        .has(&name("attn_output.bias"))
        .then(|| vec("attn_output.bias", cfg.hidden))
        .transpose()?;
    let sinks = cfg
        .arch
        .sinks
        .then(|| vec("attn_sinks.weight", cfg.n_heads))
        .transpose()?;
    Ok(AttnWeights {
        wqkv: wqkv
            .iter()
            .map(|m| backend.matrix(m))
            .collect::<Result<_, _>>()?,
        bqkv,
        qk_norm,
        wo: backend.matrix(&mat("attn_output.weight", cfg.hidden, q)?)?,
        bo,
        sinks,
    })
}

/// Layer `l`'s mixture of experts (gpt-oss), from any of three layouts, each expert ending
/// as one `[gate | up]` matrix `[2·ffn, hidden]` and `down` `[hidden, ffn]`:
/// - GGUF as llama.cpp's converter writes it: `ffn_{gate,up}_exps` `[ffn, hidden]` and
///   `ffn_down_exps` `[hidden, ffn]` per expert, output-major as the backends multiply them,
///   with `[experts, ffn]` / `[experts, hidden]` biases;
/// - GGUF with gate and up fused (the converter's `--fuse-gate-up-exps`, which llama.cpp
///   reads for other MoE families): `ffn_gate_up_exps` `[2·ffn, hidden]`, gate rows then up
///   rows, with a fused or separate bias;
/// - transformers: `mlp.experts.gate_up_proj` (`[hidden, 2·ffn]` per expert, input-major,
///   gate and up interleaved by column) and `down_proj` (`[ffn, hidden]`, input-major),
///   transposed and de-interleaved here.
fn load_moe<B: Backend>(
    backend: &B,
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    l: usize,
    m: &MoeConfig,
) -> Result<MoeWeights<B>, ModelError> {
    let (h, f, ne) = (cfg.hidden, cfg.ffn, m.n_experts);
    let name = |t: &str| format!("blk.{l}.{t}");
    let router = checked(
        src.matrix(&name("ffn_gate_inp.weight"))?,
        &name("ffn_gate_inp.weight"),
        ne,
        h,
    )?;
    let opt_vec = |t: &str, len: usize| -> Result<Option<Vec<f32>>, ModelError> {
        let n = name(t);
        if !src.has(&n) {
            return Ok(None);
        }
        let v = src.vector(&n)?;
        if v.len() != len {
            return Err(ModelError::TensorShape {
                name: n,
                detail: format!("{} values, expected {len}", v.len()),
            });
        }
        Ok(Some(v))
    };
    let stacked = |t: &str, rows: usize, cols: usize| -> Result<Vec<WeightMatrix>, ModelError> {
        let n = name(t);
        let ms = src.stacked(&n)?;
        if ms.len() != ne {
            return Err(ModelError::TensorShape {
                name: n,
                detail: format!("{} experts, expected {ne}", ms.len()),
            });
        }
        ms.into_iter().map(|w| checked(w, &n, rows, cols)).collect()
    };
    // GGUF's separate gate and up biases as one `[experts, 2·ffn]` in `[gate | up]` order (a
    // missing half is zero).
    let split_bias = || -> Result<Option<Vec<f32>>, ModelError> {
        let (gb, ub) = (
            opt_vec("ffn_gate_exps.bias", ne * f)?,
            opt_vec("ffn_up_exps.bias", ne * f)?,
        );
        if gb.is_none() && ub.is_none() {
            return Ok(None);
        }
        let part = |b: &Option<Vec<f32>>, e: usize| {
            b.as_ref()
                .map_or(vec![0.0; f], |b| b[e * f..(e + 1) * f].to_vec())
        };
        Ok(Some(
            (0..ne)
                .flat_map(|e| [part(&gb, e), part(&ub, e)].concat())
                .collect(),
        ))
    };
    let router_bias = opt_vec("ffn_gate_inp.bias", ne)?;
    // Per expert `[gate | up]` `[2f, h]` and `down` `[h, f]`; biases `[ne, 2f]` and `[ne, h]`.
    let (gate_ups, downs, gu_bias, down_bias) = if src.has(&name("ffn_gate_exps.weight")) {
        let gates = stacked("ffn_gate_exps.weight", f, h)?;
        let ups = stacked("ffn_up_exps.weight", f, h)?;
        let gate_ups = gates
            .into_iter()
            .zip(ups)
            .map(|(g, u)| match fuse_rows(vec![g, u]).as_slice() {
                [one] => Ok(one.clone()),
                // Gate and up in different formats: one f32 matrix, exactly.
                parts => stack_f32(parts),
            })
            .collect::<Result<Vec<_>, _>>()?;
        (
            gate_ups,
            stacked("ffn_down_exps.weight", h, f)?,
            split_bias()?,
            opt_vec("ffn_down_exps.bias", ne * h)?,
        )
    } else if src.has(&name("ffn_gate_up_exps.weight")) {
        let bias = match opt_vec("ffn_gate_up_exps.bias", ne * 2 * f)? {
            Some(b) => Some(b),
            None => split_bias()?,
        };
        (
            stacked("ffn_gate_up_exps.weight", 2 * f, h)?,
            stacked("ffn_down_exps.weight", h, f)?,
            bias,
            opt_vec("ffn_down_exps.bias", ne * h)?,
        )
    } else {
        // Output row o of `[gate | up]` is input-major column 2o (gate) or 2(o − f) + 1 (up).
        let deinterleave = |o: usize| if o < f { 2 * o } else { 2 * (o - f) + 1 };
        let gate_ups = stacked("mlp.experts.gate_up_proj", h, 2 * f)?
            .iter()
            .map(|gu| permute_float(gu, 2 * f, h, |o, c| (c, deinterleave(o))))
            .collect::<Result<Vec<_>, _>>()?;
        let downs = stacked("mlp.experts.down_proj", f, h)?
            .iter()
            .map(|d| permute_float(d, h, f, |o, c| (c, o)))
            .collect::<Result<Vec<_>, _>>()?;
        let bias = opt_vec("mlp.experts.gate_up_proj_bias", ne * 2 * f)?.map(|b| {
            (0..ne * 2 * f)
                .map(|i| b[i / (2 * f) * 2 * f + deinterleave(i % (2 * f))])
                .collect()
        });
        (
            gate_ups,
            downs,
            bias,
            opt_vec("mlp.experts.down_proj_bias", ne * h)?,
        )
    };
    let mut experts = Vec::with_capacity(ne);
    for (e, (gate_up, down)) in gate_ups.into_iter().zip(downs).enumerate() {
        experts.push(MoeExpert {
            gate_up: backend.matrix(&gate_up)?,
            gate_up_bias: gu_bias
                .as_ref()
                .map(|b| backend.vector(&b[e * 2 * f..(e + 1) * 2 * f]))
                .transpose()?,
            down: backend.matrix(&down)?,
            down_bias: down_bias
                .as_ref()
                .map(|b| backend.vector(&b[e * h..(e + 1) * h]))
                .transpose()?,
        });
    }
    Ok(MoeWeights {
        router: backend.matrix(&router)?,
        router_bias: router_bias.map(|b| backend.vector(&b)).transpose()?,
        experts,
    })
}

/// A `[rows, cols]` matrix whose element `(r, c)` is `m`'s element `at(r, c)`, in `m`'s float
/// format (bit-exact: elements are moved, not converted).
fn permute_float(
    m: &WeightMatrix,
    rows: usize,
    cols: usize,
    at: impl Fn(usize, usize) -> (usize, usize),
) -> Result<WeightMatrix, ModelError> {
    let size = match m.ty() {
        GgmlType::F32 => 4,
        GgmlType::F16 | GgmlType::Bf16 => 2,
        other => {
            return Err(ModelError::InvalidConfig(format!(
                "stacked experts in {other:?}: a Hugging Face checkpoint's experts must be \
                 F32, F16 or BF16"
            )));
        }
    };
    let (src, src_cols) = (m.bytes(), m.cols());
    let mut out = vec![0u8; rows * cols * size];
    for (r, row) in out.chunks_exact_mut(cols * size).enumerate() {
        for (c, dst) in row.chunks_exact_mut(size).enumerate() {
            let (sr, sc) = at(r, c);
            let i = (sr * src_cols + sc) * size;
            dst.copy_from_slice(&src[i..i + size]);
        }
    }
    Ok(WeightMatrix::new(
        m.ty(),
        rows,
        cols,
        WeightBytes::Owned(std::sync::Arc::new(out)),
    )?)
}

/// Matrices of one width stacked along the output as f32 (exact for every format).
fn stack_f32(parts: &[WeightMatrix]) -> Result<WeightMatrix, ModelError> {
    let cols = parts[0].cols();
    let mut vals = Vec::new();
    let mut row = vec![0f32; cols];
    for m in parts {
        for r in 0..m.rows() {
            m.row_f32(r, &mut row)?;
            vals.extend_from_slice(&row);
        }
    }
    Ok(WeightMatrix::from_f32(
        vals.len() / cols.max(1),
        cols,
        &vals,
    )?)
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
