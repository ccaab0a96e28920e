//! The layer loop of a model with family extras ([`super::ArchConfig`]): the plain loop of
//! [`crate::transformer`] plus embedding and residual scales, per-layer RoPE and attention
//! variants (sliding windows), post norms and GeGLU.

use turbokv_backend::{AttnGeometry, AttnVariant, Backend, QkNorm, QkvProjection, Rope, SeqSpan};

use super::MlpActivation;
use crate::ModelError;
use crate::config::{ModelConfig, RopeScaling};
use crate::transformer::{KvObserver, Scratch, Transformer};

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
/// sliding-window layers' rings ([`super::ring`]), when the cache keeps them.
pub(crate) fn layers<B: Backend>(
    t: &Transformer<B>,
    spans: &[SeqSpan<'_>],
    ring_tables: Option<&[Vec<u32>]>,
    pools: &mut [B::KvPool],
    s: &mut Scratch<B>,
    observe: &mut Option<KvObserver<'_>>,
) -> Result<(), ModelError> {
    let b = &t.backend;
    let a = &t.config.arch;
    let eps = t.config.rms_eps;
    let geometry: &AttnGeometry = &t.geometry;
    let mut host = Vec::new();
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
    for (l, (layer, pool)) in t.weights.layers.iter().zip(pools.iter_mut()).enumerate() {
        let window = a.window_of(l);
        let spans = match (&ring_spans, window) {
            (Some(ring), Some(_)) => ring.as_slice(),
            _ => spans,
        };
        let rope = match (&t.local_rope, window) {
            (Some(local), Some(_)) => local,
            _ => &t.rope,
        };
        let proj = QkvProjection {
            norm: &layer.attn_norm,
            eps,
            weights: &layer.wqkv,
            bias: layer.bqkv.as_ref(),
            qk_norm: layer.qk_norm.as_ref().map(|(q, k)| QkNorm { q, k, eps }),
        };
        b.project_qkv_write_kv(
            &s.x, proj, geometry, rope, spans, pool, &mut s.xn, &mut s.qkv,
        )?;
        if let Some(f) = observe.as_mut() {
            b.to_host(&s.qkv, &mut host)?;
            f(l, &host);
        }
        let variant = AttnVariant {
            window,
            sinks: None,
        };
        b.attention_variant(&s.qkv, geometry, spans, pool, &variant, &mut s.attn)?;
        residual(
            b,
            &s.attn,
            &layer.wo,
            layer.extra.post_attn_norm.as_ref(),
            a.residual_scale,
            eps,
            &mut s.x,
            &mut s.proj,
            &mut s.xn,
        )?;
        b.rms_norm_matmul_cat(
            &s.x,
            &layer.ffn_norm,
            eps,
            &layer.w_gate_up,
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
            &layer.w_down,
            layer.extra.post_ffn_norm.as_ref(),
            a.residual_scale,
            eps,
            &mut s.x,
            &mut s.proj,
            &mut s.xn,
        )?;
    }
    Ok(())
}

/// `x += post_norm(input · Wᵀ) · scale` (either part optional); `proj` and `normed` are
/// scratch of x's width.
#[allow(clippy::too_many_arguments)]
fn residual<B: Backend>(
    b: &B,
    input: &B::Tensor,
    w: &B::Matrix,
    post_norm: Option<&B::Vector>,
    scale: f32,
    eps: f32,
    x: &mut B::Tensor,
    proj: &mut B::Tensor,
    normed: &mut B::Tensor,
) -> Result<(), ModelError> {
    if post_norm.is_none() && scale == 1.0 {
        b.matmul_add(input, w, x, proj)?;
        return Ok(());
    }
    b.matmul(input, w, proj)?;
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
