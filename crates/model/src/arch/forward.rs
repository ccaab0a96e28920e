//! The layer loop of a model with family extras ([`super::ArchConfig`]): the plain loop of
//! [`crate::transformer`] plus embedding and residual scales, per-layer RoPE and attention
//! variants (sliding windows, sinks), output biases, post norms, GeGLU, conv layers in place
//! of attention, and mixture-of-experts MLPs.

use turbokv_backend::{
    AttnGeometry, AttnVariant, Backend, MoeMlp, QkNorm, QkvProjection, Rope, SeqSpan,
};
use turbokv_cache::SeqId;

use super::MlpActivation;
use super::conv::ConvStates;
use crate::ModelError;
use crate::config::{ModelConfig, RopeScaling};
use crate::loader::{AttnWeights, LayerWeights, Mixer, Mlp, MoeWeights, ShortConvWeights};
use crate::transformer::{KvObserver, Scratch, Transformer};

/// What a step's layers read and write besides activations: the attention layers' KV pools
/// (one per attention layer, in order) and, for conv layers, their states with each
/// sequence's new-token count (in span order).
pub(crate) struct LayerState<'a, B: Backend> {
    pub(crate) pools: &'a mut [B::KvPool],
    pub(crate) conv: Option<(&'a mut ConvStates, &'a [(SeqId, usize)])>,
}

/// The RoPE of sliding-window layers when their base differs from the global layers'
/// (Gemma 3: local layers use their own base, unscaled).
pub(crate) fn local_rope(config: &ModelConfig) -> Option<Rope> {
    let theta = config.arch.local_rope_theta?;
    let local = ModelConfig {
        rope_theta: theta,
        rope_scaling: RopeScaling::None,
        ..config.clone()
    };
    Some(Rope {
        inv_freq: local.rope_inv_freq(),
        style: config.rope_style,
    })
}

/// Runs every layer over the step's rows in `s.x` (embedded, unscaled), leaving the
/// residual stream in `s.x`. `ring_tables`: per span, the virtual block table of the
/// sliding-window layers' rings ([`super::ring`]), when the cache keeps them. The observer
/// sees attention layers by their KV-layout index.
pub(crate) fn layers<B: Backend>(
    t: &Transformer<B>,
    spans: &[SeqSpan<'_>],
    ring_tables: Option<&[Vec<u32>]>,
    state: LayerState<'_, B>,
    s: &mut Scratch<B>,
    observe: &mut Option<KvObserver<'_>>,
) -> Result<(), ModelError> {
    let b = &t.backend;
    let a = &t.config.arch;
    let eps = t.config.rms_eps;
    let ring_spans: Option<Vec<SeqSpan<'_>>> = ring_tables.map(|tables| {
        spans
            .iter()
            .zip(tables)
            .map(|(sp, t)| SeqSpan { blocks: t, ..*sp })
            .collect()
    });
    if a.embed_scale != 1.0 {
        b.scale(&mut s.x, a.embed_scale)?;
    }
    let LayerState { pools, mut conv } = state;
    let mut pools = pools.iter_mut();
    let (mut kv, mut conv_layer) = (0, 0);
    for (l, layer) in t.weights.layers.iter().enumerate() {
        match &layer.mixer {
            Mixer::Attention(att) => {
                let pool = pools.next().ok_or_else(|| {
                    ModelError::InvalidConfig(format!("no KV pool for attention layer {l}"))
                })?;
                let window = a.window_of(l);
                let spans = match (&ring_spans, window) {
                    (Some(ring), Some(_)) => ring.as_slice(),
                    _ => spans,
                };
                attention(t, l, kv, layer, att, spans, pool, s, observe)?;
                kv += 1;
            }
            Mixer::ShortConv(w) => {
                let Some((states, steps)) = conv.as_mut() else {
                    return Err(ModelError::InvalidConfig(format!(
                        "conv layer {l} in a cache without conv states"
                    )));
                };
                short_conv(t, layer, w, spans, states.layer_step(conv_layer, steps)?, s)?;
                conv_layer += 1;
            }
        }
        match &layer.mlp {
            Mlp::Dense { gate_up, down } => {
                b.rms_norm_matmul_cat(
                    &s.x,
                    &layer.ffn_norm,
                    eps,
                    gate_up,
                    &mut s.xn,
                    &mut s.gate_up,
                )?;
                match a.activation {
                    MlpActivation::Silu => b.silu_mul(&s.gate_up, &mut s.act)?,
                    MlpActivation::GeluTanh => b.gelu_mul(&s.gate_up, &mut s.act)?,
                }
                residual(
                    b,
                    &s.act,
                    down,
                    None,
                    layer.extra.post_ffn_norm.as_ref(),
                    a.residual_scale,
                    eps,
                    &mut s.x,
                    &mut s.proj,
                    &mut s.xn,
                )?;
            }
            Mlp::Moe(w) => moe(t, layer, w, s)?,
        }
    }
    Ok(())
}

/// Attention layer `l` (KV-layout layer `kv`) of the step, residual add included.
#[allow(clippy::too_many_arguments)]
fn attention<B: Backend>(
    t: &Transformer<B>,
    l: usize,
    kv: usize,
    layer: &LayerWeights<B>,
    att: &AttnWeights<B>,
    spans: &[SeqSpan<'_>],
    pool: &mut B::KvPool,
    s: &mut Scratch<B>,
    observe: &mut Option<KvObserver<'_>>,
) -> Result<(), ModelError> {
    let (b, a, eps) = (&t.backend, &t.config.arch, t.config.rms_eps);
    let geometry: &AttnGeometry = &t.geometry;
    let window = a.window_of(l);
    let rope = match (&t.local_rope, window) {
        (Some(local), Some(_)) => local,
        _ => &t.rope,
    };
    let proj = QkvProjection {
        norm: &layer.attn_norm,
        eps,
        weights: &att.wqkv,
        bias: att.bqkv.as_ref(),
        qk_norm: att.qk_norm.as_ref().map(|(q, k)| QkNorm { q, k, eps }),
    };
    b.project_qkv_write_kv(
        &s.x, proj, geometry, rope, spans, pool, &mut s.xn, &mut s.qkv,
    )?;
    if let Some(f) = observe.as_mut() {
        let mut host = Vec::new();
        b.to_host(&s.qkv, &mut host)?;
        f(kv, &host);
    }
    let variant = AttnVariant {
        window,
        sinks: att.sinks.as_ref(),
    };
    b.attention_variant(&s.qkv, geometry, spans, pool, &variant, &mut s.attn)?;
    residual(
        b,
        &s.attn,
        &att.wo,
        att.bo.as_ref(),
        layer.extra.post_attn_norm.as_ref(),
        a.residual_scale,
        eps,
        &mut s.x,
        &mut s.proj,
        &mut s.xn,
    )
}

/// A conv layer of the step (LFM2): `x += out_proj(c ⊙ conv(b ⊙ x'))` with
/// `[b | c | x'] = in_proj(rms_norm(x))`, each sequence's conv continuing from `states`.
fn short_conv<B: Backend>(
    t: &Transformer<B>,
    layer: &LayerWeights<B>,
    w: &ShortConvWeights<B>,
    spans: &[SeqSpan<'_>],
    mut states: Vec<&mut [f32]>,
    s: &mut Scratch<B>,
) -> Result<(), ModelError> {
    let (b, a, eps) = (&t.backend, &t.config.arch, t.config.rms_eps);
    b.rms_norm_matmul_cat(
        &s.x,
        &layer.attn_norm,
        eps,
        std::slice::from_ref(&w.in_proj),
        &mut s.xn,
        &mut s.bcx,
    )?;
    b.short_conv(&s.bcx, &w.kernel, spans, &mut states, &mut s.mixed)?;
    residual(
        b,
        &s.mixed,
        &w.out_proj,
        None,
        None,
        a.residual_scale,
        eps,
        &mut s.x,
        &mut s.proj,
        &mut s.xn,
    )
}

/// A mixture-of-experts MLP (gpt-oss), residual add included.
fn moe<B: Backend>(
    t: &Transformer<B>,
    layer: &LayerWeights<B>,
    w: &MoeWeights<B>,
    s: &mut Scratch<B>,
) -> Result<(), ModelError> {
    let (b, a, eps) = (&t.backend, &t.config.arch, t.config.rms_eps);
    let Some(m) = &a.moe else {
        return Err(ModelError::InvalidConfig(
            "expert weights in a model without a mixture of experts".into(),
        ));
    };
    b.rms_norm(&s.x, &layer.ffn_norm, eps, &mut s.xn)?;
    let mlp = MoeMlp {
        router: &w.router,
        router_bias: w.router_bias.as_ref(),
        experts: &w.experts,
        top_k: m.top_k,
        alpha: m.alpha,
        limit: m.limit,
    };
    b.moe(&s.xn, &mlp, &mut s.proj)?;
    if let Some(n) = layer.extra.post_ffn_norm.as_ref() {
        b.rms_norm(&s.proj, n, eps, &mut s.xn)?;
        std::mem::swap(&mut s.proj, &mut s.xn);
    }
    if a.residual_scale != 1.0 {
        b.scale(&mut s.proj, a.residual_scale)?;
    }
    b.add_assign(&mut s.x, &s.proj)?;
    Ok(())
}

/// `x += post_norm(input · Wᵀ + bias) · scale` (each part optional); `proj` and `normed` are
/// scratch of x's width.
#[allow(clippy::too_many_arguments)]
fn residual<B: Backend>(
    b: &B,
    input: &B::Tensor,
    w: &B::Matrix,
    bias: Option<&B::Vector>,
    post_norm: Option<&B::Vector>,
    scale: f32,
    eps: f32,
    x: &mut B::Tensor,
    proj: &mut B::Tensor,
    normed: &mut B::Tensor,
) -> Result<(), ModelError> {
    if bias.is_none() && post_norm.is_none() && scale == 1.0 {
        b.matmul_add(input, w, x, proj)?;
        return Ok(());
    }
    b.matmul(input, w, proj)?;
    if let Some(bias) = bias {
        b.add_bias(proj, bias)?;
    }
    let out = match post_norm {
        Some(n) => {
            b.rms_norm(proj, n, eps, normed)?;
            normed
        }
        None => proj,
    };
    if scale != 1.0 {
        b.scale(out, scale)?;
    }
    b.add_assign(x, out)?;
    Ok(())
}
