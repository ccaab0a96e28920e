//! The [`Backend`] trait: the kernel set a forward pass needs, over buffers the backend owns.
//!
//! Tensors are 2-D `[rows, cols]` f32 activations (one row per token). Matrices are weights in
//! whatever resident form the backend prefers. KV pools hold one attention layer's paged keys
//! and values in the layer's dtype; the host addresses them through block tables.

use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

use crate::{Error, TopK, WeightMatrix};

/// How RoPE pairs the coordinates of a head vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(x[2i], x[2i+1])`: llama.cpp's layout for GGUF llama files, whose Q/K weights
    /// were permuted at conversion.
    Interleaved,
    /// Pairs `(x[i], x[i + d/2])`: Hugging Face's `rotate_half` (also GGUF qwen2/qwen3).
    HalfSplit,
}

/// The per-layer attention geometry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnGeometry {
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Score scale, normally `1/sqrt(head_dim)`.
    pub scale: f32,
}

impl AttnGeometry {
    /// Width of the fused QKV row: `(n_heads + 2·n_kv_heads)·head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// Rotary embedding parameters: one inverse frequency per coordinate pair (scaling already
/// applied) and the pairing style.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// `theta_i` per pair, length `rotary_dim / 2`.
    pub inv_freq: Vec<f32>,
    /// Pairing of coordinates.
    pub style: RopeStyle,
}

/// Where one sequence's tokens sit in a step's batch.
///
/// Tokens `first_row .. first_row + n_tokens` of the step's tensors belong to this sequence
/// and sit at positions `first_pos ..`; its cache lives in `blocks` (logical → physical).
/// Attention for a token at position `p` sees positions `0..=p`.
#[derive(Clone, Copy, Debug)]
pub struct SeqSpan<'a> {
    /// First row of this sequence in the step tensors.
    pub first_row: usize,
    /// Rows (new tokens) of this sequence in the step.
    pub n_tokens: usize,
    /// Position of the first new token.
    pub first_pos: usize,
    /// The sequence's block table; covers `first_pos + n_tokens` tokens.
    pub blocks: &'a [u32],
}

/// What turns a layer's residual into its attention input (see
/// [`Backend::project_qkv_write_kv`]).
pub struct QkvProjection<'a, V, M> {
    /// The attention RMSNorm weight and epsilon.
    pub norm: &'a V,
    /// Epsilon of `norm`.
    pub eps: f32,
    /// `[Wq; Wk; Wv]`, as one or several matrices stacked along the output.
    pub weights: &'a [M],
    /// The qkv bias (Qwen2), of the qkv width.
    pub bias: Option<&'a V>,
    /// The per-head q/k norm (Qwen3).
    pub qk_norm: Option<QkNorm<'a, V>>,
}

/// Optional per-head RMSNorm of queries and keys before RoPE (Qwen3).
pub struct QkNorm<'a, V> {
    /// Query-norm weight, length `head_dim`.
    pub q: &'a V,
    /// Key-norm weight, length `head_dim`.
    pub k: &'a V,
    /// Epsilon.
    pub eps: f32,
}

/// How an attention layer departs from plain causal attention (see
/// [`Backend::attention_variant`]).
pub struct AttnVariant<'a, V> {
    /// A query at position `p` sees keys at `p - window < k <= p` only (sliding-window
    /// layers: Gemma 3's local layers, gpt-oss's banded ones). `None`: every earlier key.
    pub window: Option<usize>,
    /// A learned logit per query head that joins each softmax's denominator with no value
    /// (gpt-oss's attention sinks), length `n_heads`.
    pub sinks: Option<&'a V>,
}

impl<V> AttnVariant<'_, V> {
    /// Neither a window nor sinks: plain causal attention.
    pub fn is_plain(&self) -> bool {
        self.window.is_none() && self.sinks.is_none()
    }

    /// What this variant asks of a backend (see [`Backend::supports_attention_variant`]).
    pub fn needs(&self) -> VariantNeeds {
        VariantNeeds {
            window: self.window.is_some(),
            sinks: self.sinks.is_some(),
        }
    }
}

/// Which departures from plain causal attention an attention layer makes: the description of
/// a layer that [`Backend::supports_attention_variant`] answers for, before any variant's
/// values (window length, sink logits) exist.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VariantNeeds {
    /// A sliding window ([`AttnVariant::window`]).
    pub window: bool,
    /// Attention sinks ([`AttnVariant::sinks`]).
    pub sinks: bool,
}

impl VariantNeeds {
    /// Neither a window nor sinks.
    pub fn is_plain(&self) -> bool {
        !self.window && !self.sinks
    }

    /// A few words naming what is asked, for error messages (`"a sliding window"`,
    /// `"attention sinks"`, both, or `"plain attention"`).
    pub fn describe(&self) -> &'static str {
        match (self.window, self.sinks) {
            (false, false) => "plain attention",
            (true, false) => "a sliding window",
            (false, true) => "attention sinks",
            (true, true) => "a sliding window and attention sinks",
        }
    }
}

/// What a KV pool keeps beside its blocks on behalf of the sequences holding them.
pub trait KvPoolBlocks {
    /// `blocks` hold no sequence's tokens any more (the allocator freed them): whatever the
    /// pool keeps beside them, such as the f16 copies of a full-precision window's tokens,
    /// can go. A block written again later starts afresh either way.
    fn release_blocks(&mut self, blocks: &[u32]);
}

/// One expert of a mixture-of-experts MLP (see [`Backend::moe`]).
pub struct MoeExpert<M, V> {
    /// `[2·ffn, hidden]`: each output row is `[gate | up]`.
    pub gate_up: M,
    /// Bias of `gate_up`'s outputs, `2·ffn` values.
    pub gate_up_bias: Option<V>,
    /// `[hidden, ffn]`.
    pub down: M,
    /// Bias of `down`'s outputs, `hidden` values.
    pub down_bias: Option<V>,
}

/// A mixture-of-experts MLP with gpt-oss's routing and activation: per token, the router's
/// `top_k` largest logits are chosen, their softmax weighs the chosen experts, and each
/// expert computes `down · ((clamp(u, ±limit) + 1) · g' · σ(alpha · g')) + b` with
/// `g' = min(g, limit)` and `[g | u] = gate_up · x + b`.
pub struct MoeMlp<'a, M, V> {
    /// `[n_experts, hidden]`.
    pub router: &'a M,
    /// The router's bias, `n_experts` values.
    pub router_bias: Option<&'a V>,
    /// The experts, in router order.
    pub experts: &'a [MoeExpert<M, V>],
    /// Experts per token.
    pub top_k: usize,
    /// The gate's sigmoid slope (gpt-oss: 1.702).
    pub alpha: f32,
    /// The clamp of gate (from above) and up (both sides) (gpt-oss: 7).
    pub limit: f32,
}

/// A compute backend: buffers plus the kernels of a decoder-only transformer step.
pub trait Backend: Send + Sync {
    /// `[rows, cols]` f32 activations.
    type Tensor: Send + Sync;
    /// A weight matrix in resident form.
    type Matrix: Send + Sync;
    /// An f32 vector (norm weight, bias).
    type Vector: Send + Sync;
    /// One attention layer's paged K/V storage.
    type KvPool: Send + Sync + KvPoolBlocks;
    /// Greedy picks of decode steps, kept where the next step reads them (see
    /// [`Backend::pick_greedy`]).
    type Picks: Send + Sync;

    /// A short description, e.g. `cpu (2 threads, avx2)`.
    fn describe(&self) -> String;
    /// Refuses KV formats this backend cannot attend over, with a message listing what it can.
    fn check_kv_dtype(&self, dtype: KvDtype, head_dim: usize) -> Result<(), Error>;
    /// The capability query of attention: refuses what this backend cannot run over a cache
    /// of `dtype` with `geometry` (the format, head_dim, query heads per kv head), with a
    /// message naming what it supports. Called when a cache is made, so that an unsupported
    /// combination is refused at construction and never meets a limit mid-step.
    /// Default: [`Backend::check_kv_dtype`].
    fn supports_attention(&self, geometry: &AttnGeometry, dtype: KvDtype) -> Result<(), Error> {
        self.check_kv_dtype(dtype, geometry.head_dim)
    }

    /// A zeroed tensor.
    fn tensor(&self, rows: usize, cols: usize) -> Result<Self::Tensor, Error>;
    /// Reshapes to `rows` rows of the same width, reusing storage when it is large enough.
    fn set_rows(&self, t: &mut Self::Tensor, rows: usize) -> Result<(), Error>;
    /// Copies a tensor to host memory (row-major).
    fn to_host(&self, t: &Self::Tensor, out: &mut Vec<f32>) -> Result<(), Error>;
    /// Ends a step like [`Backend::to_host`], but copies back only, per row of the logits
    /// tensor `t`, its `k` (`1..=`[`TOPK_MAX`](crate::TOPK_MAX)) best logits with their ids
    /// and the row's max and log-sum-exp (see [`TopK`] for the order and what counts).
    /// Default: the whole tensor to the host, then [`select_top_k`](crate::select_top_k).
    fn to_host_top_k(&self, t: &Self::Tensor, k: usize, out: &mut TopK) -> Result<(), Error> {
        crate::topk::check_k(k)?;
        let cols = self.cols(t);
        let mut host = Vec::new();
        self.to_host(t, &mut host)?;
        crate::select_top_k(&host, cols, k, out)
    }
    /// Columns of a tensor.
    fn cols(&self, t: &Self::Tensor) -> usize;
    /// Makes a weight resident.
    fn matrix(&self, w: &WeightMatrix) -> Result<Self::Matrix, Error>;
    /// Makes an f32 vector resident.
    fn vector(&self, v: &[f32]) -> Result<Self::Vector, Error>;
    /// Allocates layer `layer`'s KV storage as `layout` describes.
    fn kv_pool(&self, layout: &KvLayout, layer: usize) -> Result<Self::KvPool, Error>;

    /// `out[i] = table[ids[i]]` (rows of the embedding matrix, dequantized).
    fn embed(&self, table: &Self::Matrix, ids: &[u32], out: &mut Self::Tensor)
    -> Result<(), Error>;

    /// An empty set of greedy picks.
    fn new_picks(&self) -> Result<Self::Picks, Error>;
    /// Ends a step like [`Backend::to_host_top_k`] with `k = 1`, but without waiting for it:
    /// each row's greedy pick (its largest logit's id, ranked as `to_host_top_k` ranks) is
    /// kept in `picks` for the next step's [`Backend::embed_picks`] and is on its way to the
    /// host for [`Backend::wait_picks`]. So greedy decoding can issue step n + 1 before it
    /// knows step n's tokens, and the device never waits for the host. At most two picks may
    /// be pending.
    fn pick_greedy(&self, logits: &Self::Tensor, picks: &mut Self::Picks) -> Result<(), Error>;
    /// Waits for the oldest pending pick; `out` gets its ids, one per row. A row whose logits
    /// were all NaN is [`Error::NothingToPick`].
    fn wait_picks(&self, picks: &mut Self::Picks, out: &mut Vec<u32>) -> Result<(), Error>;
    /// [`Backend::embed`] of the ids of the latest [`Backend::pick_greedy`] into `picks`
    /// without them passing through the host: `rows` rows, which must be that pick's.
    fn embed_picks(
        &self,
        table: &Self::Matrix,
        picks: &Self::Picks,
        rows: usize,
        out: &mut Self::Tensor,
    ) -> Result<(), Error>;
    /// Row-wise RMSNorm: `out = x / rms(x) · w`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<(), Error>;
    /// `out = x · Wᵀ` (`x: [T, cols]`, `out: [T, rows]`).
    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Matrix,
        out: &mut Self::Tensor,
    ) -> Result<(), Error>;
    /// `acc += x · Wᵀ` (a residual add). `tmp`, of `acc`'s width, is scratch: this default
    /// multiplies into it and adds; a backend may fuse the add into the matmul instead and
    /// leave `tmp` untouched.
    fn matmul_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Matrix,
        acc: &mut Self::Tensor,
        tmp: &mut Self::Tensor,
    ) -> Result<(), Error> {
        self.matmul(x, w, tmp)?;
        self.add_assign(acc, tmp)
    }
    /// `out = silu(g) · u` where each row of `x · [W₀; W₁; …]ᵀ` is `[g | u]` (the gated FFN
    /// input: `matmul_cat` then `silu_mul`). `gate_up`, twice `out`'s width, is scratch: this
    /// default multiplies into it; a backend may fuse both and leave it untouched.
    fn matmul_silu(
        &self,
        x: &Self::Tensor,
        ws: &[Self::Matrix],
        gate_up: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), Error> {
        self.matmul_cat(x, ws, gate_up)?;
        self.silu_mul(gate_up, out)
    }
    /// `out = rms_norm(x, norm, eps) · [W₀; W₁; …]ᵀ`. `xn` (x's width) is scratch: this
    /// default writes the normalised x there; a backend may fuse the norm into the matmul and
    /// leave it untouched.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_cat(
        &self,
        x: &Self::Tensor,
        norm: &Self::Vector,
        eps: f32,
        ws: &[Self::Matrix],
        xn: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), Error> {
        self.rms_norm(x, norm, eps, xn)?;
        self.matmul_cat(xn, ws, out)
    }
    /// [`Backend::matmul_silu`] of `rms_norm(x, norm, eps)`; `xn` and `gate_up` are scratch.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_silu(
        &self,
        x: &Self::Tensor,
        norm: &Self::Vector,
        eps: f32,
        ws: &[Self::Matrix],
        xn: &mut Self::Tensor,
        gate_up: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), Error> {
        self.rms_norm(x, norm, eps, xn)?;
        self.matmul_silu(xn, ws, gate_up, out)
    }
    /// `out = x · [W₀; W₁; …]ᵀ`: the outputs of several matrices with the same input width,
    /// side by side in each row (a fused projection whose parts have different formats).
    fn matmul_cat(
        &self,
        x: &Self::Tensor,
        ws: &[Self::Matrix],
        out: &mut Self::Tensor,
    ) -> Result<(), Error>;
    /// Adds a bias to every row.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Vector) -> Result<(), Error>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<(), Error>;
    /// `out = silu(g) · u` where each row of `gate_up` is `[g | u]`.
    fn silu_mul(&self, gate_up: &Self::Tensor, out: &mut Self::Tensor) -> Result<(), Error>;
    /// Copies the listed rows of `x` into `out` (e.g. the last token of each sequence).
    fn gather_rows(
        &self,
        x: &Self::Tensor,
        rows: &[usize],
        out: &mut Self::Tensor,
    ) -> Result<(), Error>;

    /// The fused write path of one layer. `qkv` rows are `[q | k | v]`; applies the optional
    /// q/k norm and RoPE to q and k in place, then stores k and v of every token into its
    /// paged slot of `pool`, in the pool's dtype.
    fn write_kv(
        &self,
        qkv: &mut Self::Tensor,
        geometry: &AttnGeometry,
        rope: &Rope,
        qk_norm: Option<QkNorm<'_, Self::Vector>>,
        spans: &[SeqSpan<'_>],
        pool: &mut Self::KvPool,
    ) -> Result<(), Error>;

    /// One layer's attention input: `qkv = rms_norm(x) · [Wq; Wk; Wv]ᵀ (+ bias)`, then
    /// [`Backend::write_kv`] of those rows (q/k norm, RoPE, the new keys and values into
    /// `pool`). `xn` (x's width) is scratch. A backend may fuse the write into the matmul (the
    /// CUDA backend does for decode steps); `qkv` and the pool end up as the separate calls
    /// leave them.
    #[allow(clippy::too_many_arguments)]
    fn project_qkv_write_kv(
        &self,
        x: &Self::Tensor,
        proj: QkvProjection<'_, Self::Vector, Self::Matrix>,
        geometry: &AttnGeometry,
        rope: &Rope,
        spans: &[SeqSpan<'_>],
        pool: &mut Self::KvPool,
        xn: &mut Self::Tensor,
        qkv: &mut Self::Tensor,
    ) -> Result<(), Error> {
        separate_qkv_write_kv(self, x, proj, geometry, rope, spans, pool, xn, qkv)
    }

    /// Causal attention of the queries in `qkv` over each sequence's cached keys and values
    /// (which already include this step's tokens). `out` rows are `[n_heads · head_dim]`.
    fn attention(
        &self,
        qkv: &Self::Tensor,
        geometry: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &Self::KvPool,
        out: &mut Self::Tensor,
    ) -> Result<(), Error>;

    /// Whether this backend runs the element-wise operations of the model families beyond
    /// llama/qwen ([`Backend::scale`], [`Backend::gelu_mul`]). A model loader refuses such a
    /// model up front on a backend that says no, rather than failing mid-step. Attention
    /// variants have their own query ([`Backend::supports_attention_variant`]), as do the
    /// short convolution and the mixture of experts. Default: no.
    fn supports_family_ops(&self) -> bool {
        false
    }

    /// The capability query of [`Backend::attention_variant`]: refuses, naming what is not
    /// supported, a layer of `geometry` that `needs` a window and/or sinks over a pool of
    /// `dtype`. Asked by a model loader (with the 16-bit dtype sliding-window rings use, the
    /// cache's dtype being unknown then: whether the model can run at all) and again for
    /// every layer when a cache is made (with the layer's own dtype), so that nothing is
    /// refused mid-step. The geometry and dtype limits of attention itself are
    /// [`Backend::supports_attention`]'s to answer (asked beside this one). Default: plain
    /// attention only.
    fn supports_attention_variant(
        &self,
        geometry: &AttnGeometry,
        dtype: KvDtype,
        needs: VariantNeeds,
    ) -> Result<(), Error> {
        let _ = (geometry, dtype);
        if needs.is_plain() {
            return Ok(());
        }
        Err(Error::UnsupportedOp {
            op: needs.describe(),
            backend: self.describe(),
        })
    }

    /// `x *= factor` (Granite's multipliers, Gemma's embedding scale). Default: refused.
    fn scale(&self, x: &mut Self::Tensor, factor: f32) -> Result<(), Error> {
        let _ = (x, factor);
        Err(Error::UnsupportedOp {
            op: "scale",
            backend: self.describe(),
        })
    }

    /// `out = gelu_tanh(g) · u` where each row of `gate_up` is `[g | u]` (GeGLU, Gemma).
    /// Default: refused.
    fn gelu_mul(&self, gate_up: &Self::Tensor, out: &mut Self::Tensor) -> Result<(), Error> {
        let _ = (gate_up, out);
        Err(Error::UnsupportedOp {
            op: "gelu_mul",
            backend: self.describe(),
        })
    }

    /// Whether this backend runs [`Backend::short_conv`] (LFM2's conv layers). A model
    /// loader refuses a model with conv layers up front on a backend that says no. Default:
    /// no.
    fn supports_short_conv(&self) -> bool {
        false
    }

    /// A conv layer's gated short convolution (LFM2): each row of `bcx` is `[b | c | x]`
    /// (`3·hidden` wide) and `out = c ⊙ conv(b ⊙ x)`, where `conv` is the depthwise causal
    /// convolution of each channel with its `L` taps (`kernel`: `[hidden, L]` row-major,
    /// tap `L − 1` multiplying the current token).
    ///
    /// `states[i]` belongs to `spans[i]`'s sequence: `[keep, hidden]` row-major (any
    /// `keep ≥ L − 1`), the conv inputs `b ⊙ x` of the `keep` positions before the span's
    /// first token, oldest first (zeros before position 0). The convolution reads its last
    /// `L − 1` rows; on return it holds the last `keep` inputs including the span's. The
    /// states are host memory: they are small (`keep · hidden` values per conv layer per
    /// sequence). Default: refused.
    fn short_conv(
        &self,
        bcx: &Self::Tensor,
        kernel: &Self::Vector,
        spans: &[SeqSpan<'_>],
        states: &mut [&mut [f32]],
        out: &mut Self::Tensor,
    ) -> Result<(), Error> {
        let _ = (bcx, kernel, spans, states, out);
        Err(Error::UnsupportedOp {
            op: "short_conv",
            backend: self.describe(),
        })
    }

    /// [`Backend::attention`] with a sliding window and/or attention sinks, where
    /// [`Backend::supports_attention_variant`] admits them. Default: plain attention when the
    /// variant has neither, else refused.
    fn attention_variant(
        &self,
        qkv: &Self::Tensor,
        geometry: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &Self::KvPool,
        variant: &AttnVariant<'_, Self::Vector>,
        out: &mut Self::Tensor,
    ) -> Result<(), Error> {
        if variant.is_plain() {
            return self.attention(qkv, geometry, spans, pool, out);
        }
        Err(Error::UnsupportedOp {
            op: "attention with a sliding window or sinks",
            backend: self.describe(),
        })
    }

    /// Whether this backend runs [`Backend::moe`] (gpt-oss). A model loader refuses a
    /// mixture-of-experts model up front on a backend that says no. Default: no.
    fn supports_moe(&self) -> bool {
        false
    }

    /// `out = Σ_k w_k · expert_k(x)` for each row of `x` (the MLP input, already normed),
    /// routed as [`MoeMlp`] describes; `out` is `[rows, hidden]`. Default: refused.
    fn moe(
        &self,
        x: &Self::Tensor,
        mlp: &MoeMlp<'_, Self::Matrix, Self::Vector>,
        out: &mut Self::Tensor,
    ) -> Result<(), Error> {
        let _ = (x, mlp, out);
        Err(Error::UnsupportedOp {
            op: "mixture-of-experts MLP",
            backend: self.describe(),
        })
    }

    /// Copies the bytes of physical block `block` of `pool` to `out` (replacing its
    /// contents): for each kv head, the key block then the value block, each laid out as
    /// [`turbokv_codec::layout`] defines — the payload order of a snapshot. For persisting
    /// prefix blocks. Default: unsupported.
    fn read_kv_block(
        &self,
        pool: &Self::KvPool,
        block: u32,
        out: &mut Vec<u8>,
    ) -> Result<(), Error> {
        let _ = (pool, block, out);
        Err(Error::Unsupported {
            op: "read_kv_block",
            why: "snapshots of this backend's cache are not implemented",
        })
    }

    /// Overwrites physical block `block` of `pool` with bytes in [`Backend::read_kv_block`]'s
    /// order (a restored snapshot). Default: unsupported.
    fn write_kv_block(
        &self,
        pool: &mut Self::KvPool,
        block: u32,
        bytes: &[u8],
    ) -> Result<(), Error> {
        let _ = (pool, block, bytes);
        Err(Error::Unsupported {
            op: "write_kv_block",
            why: "snapshots of this backend's cache are not implemented",
        })
    }

    /// Runs `step` — the launches of one decode step, ending in a `to_host` — the way this
    /// backend repeats steps fastest: the CUDA backend captures the step once as a CUDA graph
    /// and replays it (a launch-bound small model decodes several times faster). `step` must be
    /// safe to run again after it returned an error (it is rerun eagerly when a graph no longer
    /// fits). Default: run it.
    fn run_step<E, F>(&self, mut step: F) -> Result<(), E>
    where
        Self: Sized,
        E: From<Error>,
        F: FnMut() -> Result<(), E>,
    {
        step()
    }

    /// How the steps of [`Backend::run_step`] ran so far (replayed, captured, eager), where
    /// this backend replays them as graphs; `None` where it just runs them (default).
    fn step_graph_stats(&self) -> Option<crate::cuda::GraphStats> {
        None
    }
}

/// [`Backend::project_qkv_write_kv`] as its separate ops: the normed matmul, the bias,
/// `write_kv`. The default, and a fusing backend's path for what it does not fuse.
#[allow(clippy::too_many_arguments)]
pub fn separate_qkv_write_kv<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    proj: QkvProjection<'_, B::Vector, B::Matrix>,
    geometry: &AttnGeometry,
    rope: &Rope,
    spans: &[SeqSpan<'_>],
    pool: &mut B::KvPool,
    xn: &mut B::Tensor,
    qkv: &mut B::Tensor,
) -> Result<(), Error> {
    b.rms_norm_matmul_cat(x, proj.norm, proj.eps, proj.weights, xn, qkv)?;
    if let Some(bias) = proj.bias {
        b.add_bias(qkv, bias)?;
    }
    b.write_kv(qkv, geometry, rope, proj.qk_norm, spans, pool)
}
