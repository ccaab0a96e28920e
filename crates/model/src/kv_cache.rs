//! The paged KV cache of a model's attention layers: one pool per layer, the block
//! bookkeeping, rings and conv states of the families that have them, and the padding block.

use turbokv_backend::{Backend, KvPoolBlocks};
use turbokv_cache::{BlockAllocator, KvLayout, SeqId};

use crate::ModelError;
use crate::arch::conv::ConvStates;

/// The paged KV cache of every layer plus its block bookkeeping.
///
/// Every pool holds one physical block more than the allocator hands out (`pad_block`, the
/// last): the block the placeholder rows of [`crate::Transformer::forward_padded`] write and read,
/// so that they touch no sequence's blocks and take no block from the allocator.
pub struct KvCache<B: Backend> {
    pub(crate) layout: KvLayout,
    pub(crate) alloc: BlockAllocator,
    pub(crate) pools: Vec<B::KvPool>,
    /// The placeholder rows' block: `layout.num_blocks`, outside the allocator.
    pub(crate) pad_block: u32,
    pub(crate) max_tokens_per_seq: usize,
    /// Ring blocks of the sliding-window layers, when the model has any.
    pub(crate) rings: Option<crate::arch::ring::Rings>,
    /// The conv layers' per-sequence states, when the model has conv layers (LFM2).
    pub(crate) conv: Option<ConvStates>,
}

impl<B: Backend> KvCache<B> {
    /// The cache's shapes.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    /// Block bookkeeping (sequence lengths, free blocks).
    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }
    /// Registers a new, empty sequence.
    pub fn add_sequence(&mut self, id: SeqId) -> Result<(), ModelError> {
        self.alloc.add_sequence(id)?;
        if let Some(r) = &mut self.rings {
            r.add(id);
        }
        Ok(())
    }
    /// Drops a sequence and frees its blocks.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<(), ModelError> {
        let blocks = self.alloc.table(id)?.blocks().to_vec();
        self.alloc.remove_sequence(id)?;
        self.release_freed(&blocks);
        if let Some(r) = &mut self.rings {
            r.remove(id);
        }
        if let Some(c) = &mut self.conv {
            c.remove(id);
        }
        Ok(())
    }
    /// Bytes of conv-layer state each sequence holds beside its KV blocks, when the model
    /// has conv layers (LFM2): a fixed amount, however long the sequence.
    pub fn conv_state_bytes_per_seq(&self) -> Option<usize> {
        self.conv.as_ref().map(ConvStates::bytes_per_seq)
    }
    /// Tokens each sequence's sliding-window layers hold at most (their ring), when the
    /// model has such layers and the cache keeps them in rings.
    pub fn ring_tokens_per_seq(&self) -> Option<usize> {
        self.rings.as_ref().map(|r| r.tokens_per_seq())
    }
    /// Ring blocks sequence `id` holds in each sliding-window layer.
    pub fn ring_blocks(&self, id: SeqId) -> Option<usize> {
        self.rings.as_ref().and_then(|r| r.blocks_of(id))
    }
    /// Tokens a sequence may hold.
    pub fn max_tokens_per_seq(&self) -> usize {
        self.max_tokens_per_seq
    }

    /// Forgets sequence `id`'s tokens from position `len` on (blocks no longer needed are
    /// freed). Conv layers' states reach back only a few tokens
    /// ([`crate::arch::conv::REWIND`]); a cut further back (except to 0) is refused.
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<(), ModelError> {
        if let Some(r) = &self.rings {
            r.check_truncate(self.seq_len(id)?, len)?;
        }
        if let Some(c) = &self.conv {
            c.check_rewind(id, len)?;
        }
        let keep = len.div_ceil(self.alloc.block_size());
        let tail = self
            .alloc
            .table(id)?
            .blocks()
            .get(keep..)
            .unwrap_or(&[])
            .to_vec();
        self.alloc.truncate(id, len)?;
        self.release_freed(&tail);
        if let Some(c) = &mut self.conv {
            c.rewind(id, len);
        }
        Ok(())
    }

    /// Tells every pool which of `blocks` the allocator has just freed (no sequence holds
    /// them), so it can drop what it keeps beside them (a window's exact copies).
    fn release_freed(&mut self, blocks: &[u32]) {
        let freed: Vec<u32> = blocks
            .iter()
            .copied()
            .filter(|&b| self.alloc.pool().refcount(b) == 0)
            .collect();
        if !freed.is_empty() {
            for p in &mut self.pools {
                p.release_blocks(&freed);
            }
        }
    }

    /// Rolls a failed step back (its ring writes only touched positions no query reads).
    pub(crate) fn truncate_unchecked(&mut self, id: SeqId, len: usize) -> Result<(), ModelError> {
        Ok(self.alloc.truncate(id, len)?)
    }

    /// Tokens cached for a sequence.
    pub fn seq_len(&self, id: SeqId) -> Result<usize, ModelError> {
        Ok(self.alloc.table(id)?.len())
    }
    /// Bytes of K and V per cached token over all layers, except ring layers (their memory
    /// is bounded per sequence: [`Self::ring_tokens_per_seq`]) and conv layers (no KV;
    /// [`Self::conv_state_bytes_per_seq`]).
    pub fn bytes_per_token(&self) -> f64 {
        match &self.rings {
            None => self.layout.bytes_per_token_all_layers(),
            Some(r) => (0..self.layout.layers.len())
                .filter(|&l| !r.layers.get(l).copied().unwrap_or(false))
                .map(|l| self.layout.bytes_per_token(l))
                .sum(),
        }
    }

    /// Block bookkeeping, for prefix sharing ([`BlockAllocator::add_sequence_with_prefix`],
    /// [`BlockAllocator::register_blocks`]).
    pub fn allocator_mut(&mut self) -> &mut BlockAllocator {
        &mut self.alloc
    }

    /// The bytes of physical block `block` in every layer, layer after layer (a snapshot's
    /// payload of one block).
    pub fn read_block(&self, backend: &B, block: u32) -> Result<Vec<u8>, ModelError> {
        let (mut all, mut one) = (Vec::new(), Vec::new());
        for pool in &self.pools {
            backend.read_kv_block(pool, block, &mut one)?;
            all.extend_from_slice(&one);
        }
        Ok(all)
    }

    /// Overwrites physical block `block` in every layer from [`Self::read_block`]'s bytes;
    /// `layer_bytes[l]` is layer `l`'s share.
    pub fn write_block(
        &mut self,
        backend: &B,
        block: u32,
        layer_bytes: &[&[u8]],
    ) -> Result<(), ModelError> {
        if layer_bytes.len() != self.pools.len() {
            return Err(ModelError::InvalidConfig(format!(
                "block bytes for {} layers, the cache has {}",
                layer_bytes.len(),
                self.pools.len()
            )));
        }
        for (pool, bytes) in self.pools.iter_mut().zip(layer_bytes) {
            backend.write_kv_block(pool, block, bytes)?;
        }
        Ok(())
    }
}
