//! Shapes and dtypes of the paged KV storage.

use std::sync::Arc;

use turbokv_codec::{CodecOptions, KvDtype, OutlierChannels};

use crate::CacheError;

/// The KV storage of one attention layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerKv {
    /// Number format of keys and values in this layer.
    pub dtype: KvDtype,
    /// Outlier channels of this layer's keys when their width is fractional (`None` = the
    /// codec's default, the leading channels).
    pub key_outliers: Option<OutlierChannels>,
    /// Outlier channels of this layer's values when their width is fractional.
    pub value_outliers: Option<OutlierChannels>,
    /// Per-kv-head dtypes, `head_dtypes[h]` for head `h`; empty = every head in `dtype`.
    /// Only whole TurboQuant widths in a layer of one ([`KvPolicy`](crate::KvPolicy) checks):
    /// the widths then share the layer's rotation, so a query is rotated once for all heads.
    /// Spends bits on the heads whose keys must match sharply (those that copy from far back)
    /// rather than on whole layers.
    pub head_dtypes: Vec<KvDtype>,
}

impl LayerKv {
    /// The dtype of kv head `head`.
    pub fn head_dtype(&self, head: usize) -> KvDtype {
        self.head_dtypes.get(head).copied().unwrap_or(self.dtype)
    }
}

/// Tokens of each sequence kept at 16-bit precision beside the codes of a compressed pool.
///
/// Attention of a query at position `p` reads positions `< sinks` and `> p - recent` from the
/// exact copy and everything else from the codes. Part of the cache identity: the same codes
/// with a different window give different attention outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvWindow {
    /// Most recent tokens (the query's own included) attended at full precision.
    pub recent: usize,
    /// First tokens of the sequence ("attention sinks") attended at full precision.
    pub sinks: usize,
    /// How the exact copies are stored.
    pub copies: WindowCopies,
}

/// The number format of a window's exact copies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WindowCopies {
    /// IEEE half.
    #[default]
    F16,
    /// int8 with an f16 step per vector (`max|x| / 127`): half the bytes, for KL within a few
    /// percent of f16 copies' at the same window (BENCHMARKS.md, issue 19, session 41).
    Int8,
}

impl WindowCopies {
    /// Bits per element of a copy of a `head_dim`-element vector, its step included.
    pub fn bits(self, head_dim: usize) -> f64 {
        match self {
            WindowCopies::F16 => 16.0,
            WindowCopies::Int8 => 8.0 + 16.0 / head_dim.max(1) as f64,
        }
    }
}

impl KvWindow {
    /// Whether any token is kept exact.
    pub fn is_active(&self) -> bool {
        self.recent > 0 || self.sinks > 0
    }

    /// Whether a query at `query_pos` reads key position `pos` exactly.
    #[inline]
    pub fn is_exact(&self, query_pos: usize, pos: usize) -> bool {
        pos < self.sinks || pos + self.recent > query_pos
    }

    /// Extra bits per element at context `ctx` of keeping up to `recent + sinks` tokens of
    /// `head_dim` elements as copies beside the codes (amortised over the context; the codes
    /// of those tokens are kept too).
    pub fn bits_overhead(&self, ctx: usize, head_dim: usize) -> f64 {
        if ctx == 0 {
            return 0.0;
        }
        self.copies.bits(head_dim) * (self.recent + self.sinks).min(ctx) as f64 / ctx as f64
    }
}

/// Shapes of the whole paged cache: every attention layer has `num_blocks` blocks of
/// `block_size` tokens × `kv_heads` heads × `head_dim` values, in its own dtype.
///
/// A block of a 16-bit layer is laid out `[kv_heads, block_size, head_dim]` for K and the same
/// for V, so one head's tokens are contiguous for the attention kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct KvLayout {
    /// Per-layer storage, index = layer.
    pub layers: Vec<LayerKv>,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Values per head vector.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks per layer (the same for every layer: block ids are shared across layers).
    pub num_blocks: usize,
    /// Key mode, rotation seed and outlier channels of the compressed formats (part of the
    /// cache identity).
    pub codec: CodecOptions,
    /// Tokens kept at full precision beside the codes of compressed layers.
    pub window: KvWindow,
    /// Per-head mean key and value subtracted before encoding compressed layers (exact:
    /// softmax ignores a shift shared by every key, and attention weights sum to 1 so a
    /// shared value shift is added back once). `None` = no centering.
    pub centers: Option<Arc<KvCenters>>,
}

/// Mean key and value per (layer, kv head), each `[layers, kv_heads, head_dim]`, from a
/// calibration pass. Part of the cache identity: codes are only meaningful with them.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCenters {
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Values per head vector.
    pub head_dim: usize,
    /// Mean post-RoPE key, `[layers, kv_heads, head_dim]`.
    pub key: Vec<f32>,
    /// Mean value, same shape.
    pub value: Vec<f32>,
}

/// Outlier channels per layer for fractional widths (`tq3.5`, `k3.5v3`, …), chosen from
/// per-channel energy on a calibration pass: `key[l]` and `value[l]` are the `head_dim / 2`
/// channels of layer `l` that get the wider code. Part of the cache identity.
#[derive(Clone, Debug, PartialEq)]
pub struct KvOutliers {
    /// Key outlier channels, one set per layer.
    pub key: Vec<OutlierChannels>,
    /// Value outlier channels, one set per layer.
    pub value: Vec<OutlierChannels>,
}

impl KvCenters {
    /// The mean key of (layer, head), or `None` outside the calibrated shape.
    pub fn key(&self, layer: usize, head: usize) -> Option<&[f32]> {
        self.slice(&self.key, layer, head)
    }

    /// The mean value of (layer, head), or `None` outside the calibrated shape.
    pub fn value(&self, layer: usize, head: usize) -> Option<&[f32]> {
        self.slice(&self.value, layer, head)
    }

    /// Layers covered.
    pub fn layers(&self) -> usize {
        self.key.len() / (self.kv_heads * self.head_dim).max(1)
    }

    /// Layer `layer`'s mean keys and mean values of `kv_heads` heads of `head_dim`, each
    /// `[kv_heads, head_dim]` (what a pool subtracts before encoding), or an error naming what
    /// the calibration covers.
    pub fn layer_means(
        &self,
        layer: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), CacheError> {
        if self.head_dim != head_dim {
            return Err(CacheError::InvalidLayout(format!(
                "kv centers: head dim {} vs {head_dim}",
                self.head_dim
            )));
        }
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for h in 0..kv_heads {
            let (Some(kc), Some(vc)) = (self.key(layer, h), self.value(layer, h)) else {
                return Err(CacheError::InvalidLayout(format!(
                    "kv centers: no mean for layer {layer} head {h} (calibrated {} layers × {} heads × {})",
                    self.layers(),
                    self.kv_heads,
                    self.head_dim
                )));
            };
            k.extend_from_slice(kc);
            v.extend_from_slice(vc);
        }
        Ok((k, v))
    }

    fn slice<'a>(&self, v: &'a [f32], layer: usize, head: usize) -> Option<&'a [f32]> {
        if head >= self.kv_heads {
            return None;
        }
        let at = (layer * self.kv_heads + head) * self.head_dim;
        v.get(at..at + self.head_dim)
    }
}

impl KvLayout {
    /// A layout with one dtype for every layer, sized to hold `max_tokens` tokens in total.
    pub fn uniform(
        n_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
        block_size: usize,
        max_tokens: usize,
    ) -> Result<Self, CacheError> {
        if n_layers == 0 || kv_heads == 0 || head_dim == 0 || block_size == 0 {
            return Err(CacheError::InvalidLayout(format!(
                "layers {n_layers}, kv heads {kv_heads}, head dim {head_dim}, block size {block_size} must all be positive"
            )));
        }
        Ok(Self {
            layers: vec![
                LayerKv {
                    dtype,
                    key_outliers: None,
                    value_outliers: None,
                    head_dtypes: Vec::new(),
                };
                n_layers
            ],
            kv_heads,
            head_dim,
            block_size,
            num_blocks: max_tokens.div_ceil(block_size).max(1),
            codec: CodecOptions::default(),
            window: KvWindow::default(),
            centers: None,
        })
    }

    /// The codec options of `layer`: the cache's, with the layer's own outlier channels.
    pub fn codec_options(&self, layer: usize) -> CodecOptions {
        let mut opts = self.codec.clone();
        if let Some(l) = self.layers.get(layer) {
            opts.key_outliers = l.key_outliers.clone().or(opts.key_outliers);
            opts.value_outliers = l.value_outliers.clone().or(opts.value_outliers);
        }
        opts
    }

    /// Values (elements) of K, or of V, in one block.
    pub fn block_elements(&self) -> usize {
        self.kv_heads * self.block_size * self.head_dim
    }

    /// Bytes of K plus V per token per layer for its heads' dtypes, side information included.
    pub fn bytes_per_token(&self, layer: usize) -> f64 {
        let l = &self.layers[layer];
        let bits: f64 = (0..self.kv_heads)
            .map(|h| {
                l.head_dtype(h)
                    .bits_per_element(self.head_dim, self.codec.key_mode)
            })
            .sum();
        2.0 * bits * self.head_dim as f64 / 8.0
    }

    /// Bytes of K plus V per token over all layers.
    pub fn bytes_per_token_all_layers(&self) -> f64 {
        (0..self.layers.len())
            .map(|l| self.bytes_per_token(l))
            .sum()
    }
}
