//! `VectorCodec`: one layer's keys or values in any [`KvDtype`], with block-slot I/O.

use half::f16;

use crate::dtype::{KeyMode, KvDtype};
use crate::error::{Error, Result};
use crate::layout::{BlockLayout, KvRole, TokenSizes, token_sizes};
use crate::outliers::OutlierChannels;
use crate::plain::Plain;
use crate::prng::{derive_seed, seed_for};
use crate::tq::{NormMode, QjlSketch, TqCodec, TqParams};

/// Most f16 scalars any format stores per token (two parts × norm and γ).
pub const MAX_SCALARS: usize = 4;

/// Everything besides the dtype that determines a layer's bytes (part of the cache identity).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct CodecOptions {
    /// MSE or prod for keys.
    pub key_mode: KeyMode,
    /// Meaning of the stored norm.
    pub norm: NormMode,
    /// QJL matrix for prod keys.
    pub qjl: QjlSketch,
    /// Base rotation seed of the cache. Layer `l`'s keys use
    /// `derive_seed(seed_for(base_seed, l), 0x4B455953)` and its values
    /// `derive_seed(seed_for(base_seed, l), 0x56414C53)` as [`TqParams::seed`]
    /// (see [`crate::prng`]).
    pub base_seed: u64,
    /// Outlier channels of keys for fractional key widths (`None` = leading channels).
    pub key_outliers: Option<OutlierChannels>,
    /// Outlier channels of values for fractional value widths.
    pub value_outliers: Option<OutlierChannels>,
}

#[derive(Debug, Clone)]
pub(crate) enum Format {
    Plain(Plain),
    Tq(TqCodec),
}

/// The codec of one layer's keys or values.
#[derive(Debug, Clone)]
pub struct VectorCodec {
    pub(crate) head_dim: usize,
    pub(crate) format: Format,
    sizes: TokenSizes,
}

/// Seed tags separating keys from values within a layer.
const TAG_KEY: u64 = 0x4B45_5953;
const TAG_VALUE: u64 = 0x5641_4C53;

impl VectorCodec {
    /// The codec for `role` vectors of `layer` stored as `dtype`.
    pub fn new(
        dtype: KvDtype,
        role: KvRole,
        head_dim: usize,
        layer: u32,
        opts: &CodecOptions,
    ) -> Result<Self> {
        let sizes = token_sizes(dtype, role, head_dim, opts.key_mode)?;
        let format = match dtype {
            KvDtype::Bf16 => Format::Plain(Plain::Bf16),
            KvDtype::F16 => Format::Plain(Plain::F16),
            KvDtype::Int8 => Format::Plain(Plain::Int8),
            KvDtype::Fp8 => Format::Plain(Plain::Fp8),
            KvDtype::Tq {
                key_bits,
                value_bits,
            } => {
                let layer_seed = seed_for(opts.base_seed, layer);
                let (bits, mode, tag, outliers) = match role {
                    KvRole::Key => (key_bits, opts.key_mode, TAG_KEY, &opts.key_outliers),
                    KvRole::Value => (value_bits, KeyMode::Mse, TAG_VALUE, &opts.value_outliers),
                };
                Format::Tq(TqCodec::new(TqParams {
                    head_dim,
                    bits,
                    mode,
                    norm: opts.norm,
                    qjl: opts.qjl,
                    seed: derive_seed(layer_seed, tag),
                    outliers: outliers.clone(),
                })?)
            }
        };
        Ok(VectorCodec {
            head_dim,
            format,
            sizes,
        })
    }

    /// A codec around an explicitly configured TurboQuant codec.
    pub fn from_tq(tq: TqCodec) -> Self {
        let sizes = TokenSizes {
            code_bytes: tq.code_bytes(),
            scalars: tq.scalars_per_vector(),
        };
        VectorCodec {
            head_dim: tq.params().head_dim,
            format: Format::Tq(tq),
            sizes,
        }
    }

    /// The vector length.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Per-token code bytes and scalar count.
    pub fn token_sizes(&self) -> TokenSizes {
        self.sizes
    }

    /// The TurboQuant codec inside, if this is a TurboQuant format.
    pub fn tq(&self) -> Option<&TqCodec> {
        match &self.format {
            Format::Tq(t) => Some(t),
            Format::Plain(_) => None,
        }
    }

    /// The layout of a block of `block_size` tokens.
    pub fn block_layout(&self, block_size: usize) -> Result<BlockLayout> {
        BlockLayout::new(self.sizes, block_size)
    }

    pub(crate) fn check(&self, what: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected == got {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                what,
                expected,
                got,
            })
        }
    }

    /// Encodes one vector into a code record and its scalars.
    pub fn encode(&self, x: &[f32], codes: &mut [u8], scalars: &mut [f16]) -> Result<()> {
        match &self.format {
            Format::Tq(t) => t.encode(x, codes, scalars),
            Format::Plain(p) => {
                self.check("vector", self.head_dim, x.len())?;
                self.check("codes", self.sizes.code_bytes, codes.len())?;
                self.check("scalars", self.sizes.scalars, scalars.len())?;
                p.encode(x, codes, scalars);
                Ok(())
            }
        }
    }

    /// Decodes one vector (the reference dequantization).
    pub fn decode(&self, codes: &[u8], scalars: &[f16], out: &mut [f32]) -> Result<()> {
        match &self.format {
            Format::Tq(t) => t.decode(codes, scalars, out),
            Format::Plain(p) => {
                self.check("vector", self.head_dim, out.len())?;
                self.check("codes", self.sizes.code_bytes, codes.len())?;
                self.check("scalars", self.sizes.scalars, scalars.len())?;
                p.decode(codes, scalars, out);
                Ok(())
            }
        }
    }

    /// Encodes `x` into slot `slot` of `block` (laid out by `layout`).
    pub fn encode_slot(
        &self,
        x: &[f32],
        block: &mut [u8],
        layout: &BlockLayout,
        slot: usize,
    ) -> Result<()> {
        self.check_layout(layout)?;
        layout.check(block.len(), slot)?;
        let mut sc = [f16::ZERO; MAX_SCALARS];
        let sc = &mut sc[..layout.scalars_per_token];
        self.encode(x, &mut block[layout.codes_range(slot)], sc)?;
        write_scalars(&mut block[layout.scalars_range(slot)], sc);
        Ok(())
    }

    /// Decodes slot `slot` of `block` into `out`.
    pub fn decode_slot(
        &self,
        block: &[u8],
        layout: &BlockLayout,
        slot: usize,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_layout(layout)?;
        layout.check(block.len(), slot)?;
        let mut sc = [f16::ZERO; MAX_SCALARS];
        let sc = read_scalars(&block[layout.scalars_range(slot)], &mut sc);
        self.decode(&block[layout.codes_range(slot)], sc, out)
    }

    pub(crate) fn check_layout(&self, layout: &BlockLayout) -> Result<()> {
        if layout.code_bytes_per_token != self.sizes.code_bytes
            || layout.scalars_per_token != self.sizes.scalars
        {
            return Err(Error::InvalidConfig {
                what: "block layout",
                reason: "made for a different format",
            });
        }
        Ok(())
    }
}

/// Writes f16 scalars little-endian.
pub(crate) fn write_scalars(dst: &mut [u8], sc: &[f16]) {
    for (d, s) in dst.chunks_exact_mut(2).zip(sc) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

/// Reads little-endian f16 scalars into `buf`, returning the filled prefix.
pub(crate) fn read_scalars<'a>(src: &[u8], buf: &'a mut [f16; MAX_SCALARS]) -> &'a [f16] {
    let n = (src.len() / 2).min(MAX_SCALARS);
    for (b, s) in buf.iter_mut().zip(src.chunks_exact(2)) {
        *b = f16::from_le_bytes([s[0], s[1]]);
    }
    &buf[..n]
}

/// The key and value codecs of one layer.
#[derive(Debug, Clone)]
pub struct LayerCodec {
    /// Keys.
    pub key: VectorCodec,
    /// Values.
    pub value: VectorCodec,
}

impl LayerCodec {
    /// Both codecs of `layer`.
    pub fn new(dtype: KvDtype, head_dim: usize, layer: u32, opts: &CodecOptions) -> Result<Self> {
        Ok(LayerCodec {
            key: VectorCodec::new(dtype, KvRole::Key, head_dim, layer, opts)?,
            value: VectorCodec::new(dtype, KvRole::Value, head_dim, layer, opts)?,
        })
    }
}
