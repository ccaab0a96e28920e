//! One layer's paged K/V storage in host memory.
//!
//! Layout of each of K and V: `[num_blocks, kv_heads, block_size, head_dim]` 16-bit values,
//! so one head's tokens within a block are contiguous for the attention loop.

use half::slice::{HalfFloatSliceExt, HalfBitsSliceExt};
use half::{bf16, f16};
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

use super::{CpuTensor, shape};
use crate::backend::{AttnGeometry, SeqSpan};
use crate::Error;

/// The element format of a CPU KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvStorage {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

impl KvStorage {
    /// The storage for `dtype`, or an error naming what this backend accepts.
    pub fn for_dtype(dtype: KvDtype, _head_dim: usize) -> Result<Self, Error> {
        match dtype {
            KvDtype::F16 => Ok(Self::F16),
            KvDtype::Bf16 => Ok(Self::Bf16),
            other => Err(Error::UnsupportedKvDtype { dtype: other.to_string(), backend: "cpu", accepted: "f16, bf16" }),
        }
    }
}

/// K and V blocks of one attention layer.
#[derive(Debug)]
pub struct CpuKvPool {
    storage: KvStorage,
    kv_heads: usize,
    block_size: usize,
    head_dim: usize,
    num_blocks: usize,
    k: Vec<u16>,
    v: Vec<u16>,
}

/// Which half of the cache.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Half {
    K,
    V,
}

impl CpuKvPool {
    /// Allocates layer `layer` of `layout`.
    pub fn new(layout: &KvLayout, layer: usize) -> Result<Self, Error> {
        let lk = layout
            .layers
            .get(layer)
            .ok_or_else(|| shape("kv_pool", format!("layer {layer} of {}", layout.layers.len())))?;
        let storage = KvStorage::for_dtype(lk.dtype, layout.head_dim)?;
        let len = layout
            .num_blocks
            .checked_mul(layout.block_elements())
            .ok_or(Error::SizeOverflow { rows: layout.num_blocks, cols: layout.block_elements() })?;
        Ok(Self {
            storage,
            kv_heads: layout.kv_heads,
            block_size: layout.block_size,
            head_dim: layout.head_dim,
            num_blocks: layout.num_blocks,
            k: vec![0; len],
            v: vec![0; len],
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    fn offset(&self, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.kv_heads + head) * self.block_size + slot) * self.head_dim
    }

    /// Physical block holding position `pos` of a sequence, bounds-checked.
    pub(crate) fn block_of(&self, blocks: &[u32], pos: usize) -> Result<usize, Error> {
        let b = *blocks
            .get(pos / self.block_size)
            .ok_or_else(|| shape("kv", format!("position {pos} beyond the block table ({} blocks)", blocks.len())))?
            as usize;
        if b >= self.num_blocks {
            return Err(shape("kv", format!("block {b} outside the pool of {}", self.num_blocks)));
        }
        Ok(b)
    }

    /// Stores k and v of every token of `spans` (rows of `qkv`, already roped).
    pub(crate) fn store(&mut self, qkv: &CpuTensor, g: &AttnGeometry, spans: &[SeqSpan<'_>]) -> Result<(), Error> {
        if g.n_kv_heads != self.kv_heads || g.head_dim != self.head_dim {
            return Err(shape("kv store", format!("geometry {g:?} vs pool {} heads × {}", self.kv_heads, self.head_dim)));
        }
        let d = self.head_dim;
        for s in spans {
            for i in 0..s.n_tokens {
                let pos = s.first_pos + i;
                let block = self.block_of(s.blocks, pos)?;
                let row = qkv.row(s.first_row + i);
                for h in 0..self.kv_heads {
                    let at = self.offset(block, h, pos % self.block_size);
                    let k = &row[(g.n_heads + h) * d..][..d];
                    let v = &row[(g.n_heads + g.n_kv_heads + h) * d..][..d];
                    encode(self.storage, k, &mut self.k[at..at + d]);
                    encode(self.storage, v, &mut self.v[at..at + d]);
                }
            }
        }
        Ok(())
    }

    /// Decodes the first `n` tokens of (block, head) of K or V into `out` (`n · head_dim`).
    pub(crate) fn load(&self, half: Half, block: usize, head: usize, n: usize, out: &mut [f32]) {
        let at = self.offset(block, head, 0);
        let src = match half {
            Half::K => &self.k[at..at + n * self.head_dim],
            Half::V => &self.v[at..at + n * self.head_dim],
        };
        decode(self.storage, src, &mut out[..n * self.head_dim]);
    }
}

fn encode(storage: KvStorage, src: &[f32], dst: &mut [u16]) {
    match storage {
        KvStorage::F16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f16::from_f32(s).to_bits();
            }
        }
        KvStorage::Bf16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16::from_f32(s).to_bits();
            }
        }
    }
}

fn decode(storage: KvStorage, src: &[u16], dst: &mut [f32]) {
    match storage {
        KvStorage::F16 => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
        KvStorage::Bf16 => src.reinterpret_cast::<bf16>().convert_to_f32_slice(dst),
    }
}
