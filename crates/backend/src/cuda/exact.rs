//! The full-precision recent window and sinks of a coded pool on the GPU.
//!
//! A coded layer with a [`KvWindow`] attends each query's sinks (the first tokens) and most
//! recent tokens at f16, the rest from the codes, as the CPU backend does. Every token is
//! encoded; the tokens that some query may still read exactly are also kept as f16 copies,
//! per physical block, in *exact blocks*, for K and for V: `[slot, kv_heads, block_size,
//! head_dim]` halves, or with [`WindowCopies::Int8`] per slot the rows' int8 codes
//! `[kv_heads, block_size, head_dim]` then one f16 step per row (codec.cuh `exact_q8_row`; the
//! CPU's `CopySlot` values, widened to f16 as the attention stages them). The copies are the
//! encoder's working vectors — centered, and rotated for TurboQuant roles — so the attention
//! reads them in the basis it scores and sums codes in.
//!
//! The host keeps which slot holds which block's copies. Before a write, for every span it
//! drops the blocks that no query from this span on reads exactly (past the sinks and before
//! the first query's window: windows only move forward), gives a slot to every block the
//! span's queries read exactly, and lays out the step's *exact table*, which the encoder
//! (where to copy new tokens) and the attention (where each exact token is) read:
//!
//! ```text
//! [offset of span 0, offset of span 1, …]   then per span, at its offset:
//! [first recent block fb, sink blocks sb, recent blocks nr, slot of block 0 … sb-1, slot of block fb … fb+nr-1]
//! ```
//!
//! Slots are recycled when a block is written anew by another sequence, when the allocator
//! frees it ([`crate::KvPoolBlocks::release_blocks`]), or when it falls behind the window. The
//! exact blocks grow on demand (outside graph capture; a replayed graph that would need more
//! is rerun eagerly, which grows them).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use turbokv_cache::{KvWindow, WindowCopies};

use super::cuda_err;
use super::step::graph_changed;
use crate::Error;
use crate::backend::SeqSpan;

/// No slot.
const NONE: u32 = u32::MAX;
/// Exact blocks a pool starts with.
const FIRST_SLOTS: usize = 64;

/// Which exact block (slot) holds which physical block's copies, and the exact table; host
/// bookkeeping only (the device buffers are [`ExactTokens`]'s).
#[derive(Debug)]
pub(crate) struct ExactSlots {
    /// Which tokens are exact.
    pub window: KvWindow,
    block_size: usize,
    /// Slot of each physical block, or [`NONE`].
    slot_of: Vec<u32>,
    /// Block held by each slot, or [`NONE`].
    owner: Vec<u32>,
    /// Slots holding no block.
    free: Vec<u32>,
    /// The exact table of the last [`ExactSlots::prepare`].
    pub table: Vec<u32>,
}

impl ExactSlots {
    /// Bookkeeping for a pool of `num_blocks` blocks, starting with `slots` slots.
    pub(crate) fn new(
        window: KvWindow,
        num_blocks: usize,
        block_size: usize,
        slots: usize,
    ) -> Self {
        Self {
            window,
            block_size,
            slot_of: vec![NONE; num_blocks],
            owner: vec![NONE; slots],
            free: (0..slots as u32).rev().collect(),
            table: Vec::new(),
        }
    }

    /// Slots (exact blocks) there are.
    pub(crate) fn capacity(&self) -> usize {
        self.owner.len()
    }

    /// Slots in use.
    pub(crate) fn used(&self) -> usize {
        self.owner.len() - self.free.len()
    }

    /// Updates the slots for a write of `spans` and lays out their exact table in
    /// [`ExactSlots::table`]. Needing more slots than there are doubles them when
    /// `may_grow`, else fails with a graph-change error (every change made before is
    /// idempotent, so the step can run again).
    pub(crate) fn prepare(&mut self, spans: &[SeqSpan<'_>], may_grow: bool) -> Result<(), Error> {
        let bs = self.block_size;
        let KvWindow { recent, sinks, .. } = self.window;
        let sink_blocks = sinks.div_ceil(bs);
        for s in spans {
            // Blocks no query from this span on reads exactly: newest first, down to the
            // first one already dropped (they die in position order).
            let lo = (s.first_pos + 1).saturating_sub(recent.max(1));
            for &b in s
                .blocks
                .get(sink_blocks..lo / bs)
                .unwrap_or(&[])
                .iter()
                .rev()
            {
                if !self.drop_block(b) {
                    break;
                }
            }
        }
        self.table.clear();
        self.table.resize(spans.len(), 0);
        for (si, s) in spans.iter().enumerate() {
            let end = s.first_pos + s.n_tokens;
            let sb = sinks.min(end).div_ceil(bs);
            let (fb, nr) = if recent > 0 && s.n_tokens > 0 {
                let fb = (s.first_pos + 1).saturating_sub(recent) / bs;
                (fb, (end - 1) / bs + 1 - fb)
            } else {
                (0, 0)
            };
            if s.blocks.len() < sb.max(fb + nr) {
                return Err(crate::shape::shape(
                    "exact window",
                    format!("a table of {} blocks for {end} tokens", s.blocks.len()),
                ));
            }
            self.table[si] = self.table.len() as u32;
            self.table.extend([fb as u32, sb as u32, nr as u32]);
            for j in (0..sb).chain(fb..fb + nr) {
                let b = s.blocks[j];
                let slot = match self.slot_of.get(b as usize) {
                    Some(&NONE) => self.assign(b, may_grow)?,
                    Some(&slot) => slot,
                    None => {
                        return Err(crate::shape::shape(
                            "exact window",
                            format!("block {b} of a pool of {}", self.slot_of.len()),
                        ));
                    }
                };
                self.table.push(slot);
            }
        }
        Ok(())
    }

    /// The slot of `block`, if it has one.
    #[cfg(test)]
    fn slot(&self, block: u32) -> Option<u32> {
        self.slot_of
            .get(block as usize)
            .copied()
            .filter(|&s| s != NONE)
    }

    /// Frees the slot of `block`; whether it had one.
    fn drop_block(&mut self, block: u32) -> bool {
        match self.slot_of.get_mut(block as usize) {
            Some(slot) if *slot != NONE => {
                self.owner[*slot as usize] = NONE;
                self.free.push(*slot);
                *slot = NONE;
                true
            }
            _ => false,
        }
    }

    /// A slot for `block`, doubling the slots when none is free.
    fn assign(&mut self, block: u32, may_grow: bool) -> Result<u32, Error> {
        if self.free.is_empty() {
            if !may_grow {
                return Err(graph_changed("the exact window needs more blocks"));
            }
            let old = self.owner.len();
            let new = (2 * old).max(1);
            self.owner.resize(new, NONE);
            self.free.extend((old as u32..new as u32).rev());
        }
        let slot = self
            .free
            .pop()
            .ok_or_else(|| graph_changed("no exact block"))?;
        self.owner[slot as usize] = block;
        self.slot_of[block as usize] = slot;
        Ok(slot)
    }

    /// Frees the slots of blocks no sequence holds any more.
    pub(crate) fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.drop_block(b);
        }
    }
}

/// The exact blocks of a windowed coded pool on the device, with their bookkeeping.
#[derive(Debug)]
pub(crate) struct ExactTokens {
    pub slots: ExactSlots,
    /// Halves of one exact block (kv_heads × block_size rows of head_dim halves, or of
    /// head_dim int8 codes and a step).
    slot_halves: usize,
    /// K and V copies (see the module docs), as halves.
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
}

impl ExactTokens {
    /// Exact blocks for a pool of `num_blocks` blocks of `kv_heads × block_size × head_dim`.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        window: KvWindow,
        num_blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_dim: usize,
    ) -> Result<Self, Error> {
        let slot_halves = match window.copies {
            WindowCopies::F16 => kv_heads * block_size * head_dim,
            WindowCopies::Int8 => kv_heads * block_size * (head_dim + 2) / 2,
        };
        let slots = FIRST_SLOTS.min(num_blocks.max(1));
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<u16>(n.max(1))
                .map_err(cuda_err("alloc exact blocks"))
        };
        Ok(Self {
            slots: ExactSlots::new(window, num_blocks, block_size, slots),
            slot_halves,
            k: alloc(slots * slot_halves)?,
            v: alloc(slots * slot_halves)?,
        })
    }

    /// The kernels' `x_q8` parameter: 1 when the copies are int8.
    pub(crate) fn q8(&self) -> i32 {
        i32::from(self.slots.window.copies == WindowCopies::Int8)
    }

    /// [`ExactSlots::prepare`], then the device blocks grown to the slots (keeping their
    /// contents; only with `may_alloc`, i.e. outside graph capture and replay).
    pub(crate) fn prepare(
        &mut self,
        stream: &Arc<CudaStream>,
        spans: &[SeqSpan<'_>],
        may_alloc: bool,
    ) -> Result<(), Error> {
        self.slots.prepare(spans, may_alloc)?;
        let halves = self.slots.capacity() * self.slot_halves;
        if halves > self.k.len() {
            let copy = |from: &CudaSlice<u16>| -> Result<CudaSlice<u16>, Error> {
                let mut to = stream
                    .alloc_zeros::<u16>(halves)
                    .map_err(cuda_err("grow exact blocks"))?;
                stream
                    .memcpy_dtod(from, &mut to.slice_mut(..from.len()))
                    .map_err(cuda_err("grow exact blocks"))?;
                Ok(to)
            };
            self.k = copy(&self.k)?;
            self.v = copy(&self.v)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(first_pos: usize, n_tokens: usize, blocks: &[u32]) -> SeqSpan<'_> {
        SeqSpan {
            first_row: 0,
            n_tokens,
            first_pos,
            blocks,
        }
    }

    /// The slots the table gives span `si`'s block `j`, as the kernels look them up
    /// (common.cuh `exact_slot`).
    fn lookup(table: &[u32], si: usize, j: usize) -> Option<u32> {
        let e = &table[table[si] as usize..];
        let (fb, sb, nr) = (e[0] as usize, e[1] as usize, e[2] as usize);
        if j < sb {
            Some(e[3 + j])
        } else if j >= fb && j < fb + nr {
            Some(e[3 + sb + j - fb])
        } else {
            None
        }
    }

    #[test]
    fn every_exact_token_has_a_slot_and_dead_blocks_give_theirs_back() {
        let window = KvWindow {
            recent: 20,
            sinks: 3,
            ..Default::default()
        };
        let mut x = ExactSlots::new(window, 64, 16, 2);
        let blocks: Vec<u32> = (0..40).map(|i| 63 - i).collect();
        // A prefill chunk of 100 tokens, then decode steps to 300.
        let mut steps = vec![(0, 100)];
        steps.extend((100..300).map(|p| (p, 1)));
        let mut most = 0;
        for (first, n) in steps {
            x.prepare(&[span(first, n, &blocks)], true).unwrap();
            // Every key a query of the span reads exactly is in a block with a slot, and the
            // table gives that slot.
            for q in first..first + n {
                for p in 0..=q {
                    if window.is_exact(q, p) {
                        let j = p / 16;
                        assert_eq!(lookup(&x.table, 0, j), x.slot(blocks[j]), "q {q} p {p}");
                        assert!(x.slot(blocks[j]).is_some());
                    }
                }
            }
            if n == 1 {
                most = most.max(x.used());
            }
        }
        // Decode keeps the sink block and the window's two or three blocks.
        assert!(most <= 4, "{most} slots held while decoding");
        // Distinct blocks never share a slot.
        let held: Vec<u32> = blocks.iter().filter_map(|&b| x.slot(b)).collect();
        let mut dedup = held.clone();
        dedup.sort_unstable();
        dedup.dedup();
        assert_eq!(held.len(), dedup.len());
        x.release(&blocks);
        assert_eq!(x.used(), 0);
    }

    #[test]
    fn a_graph_step_that_needs_more_slots_fails_and_changes_nothing_it_cannot_redo() {
        let window = KvWindow {
            recent: 8,
            sinks: 0,
            ..Default::default()
        };
        let mut x = ExactSlots::new(window, 16, 16, 1);
        let (a, b) = ([0u32, 1], [2u32, 3]);
        x.prepare(&[span(0, 4, &a)], false).unwrap();
        // A second sequence needs a second slot: refused without growth...
        assert!(x.prepare(&[span(0, 4, &a), span(0, 4, &b)], false).is_err());
        // ... and the eager rerun grows.
        x.prepare(&[span(0, 4, &a), span(0, 4, &b)], true).unwrap();
        assert_eq!(x.capacity(), 2);
        assert_ne!(x.slot(0), x.slot(2));
        // A table too short for the span is an error, not a panic.
        assert!(x.prepare(&[span(16, 4, &a[..1])], true).is_err());
    }
}
