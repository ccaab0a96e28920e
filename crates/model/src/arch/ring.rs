//! Sliding-window layers' KV as a ring: each sequence owns at most `per_seq` blocks of a
//! layer's ring pool, and logical block `i` of the sequence lives in its ring block
//! `i mod per_seq`. A ring layer therefore holds a bounded number of tokens however long the
//! context grows, and the attention kernels read it through an ordinary block table (the
//! *virtual* table, `ring[i mod per_seq]` for every logical block) while the window keeps
//! them inside the last `per_seq · block_size` positions.
//!
//! Correctness needs every position a step reads or writes to fit in the ring at once: a
//! step of `n` tokens from position `p` reads keys from `p - window + 1` and writes up to
//! `p + n - 1`, so the ring holds `window + max_step - 1` tokens and longer steps are split
//! ([`Transformer::forward_split`]). Writes of a step then only overwrite positions no later
//! query sees, so a failed step leaves the ring consistent for the rolled-back length.
//!
//! Ring layers stay 16-bit whatever dtype the other layers use: they are small and their
//! slots are overwritten in place.

use std::collections::HashMap;

use turbokv_backend::Backend;
use turbokv_cache::{CacheError, SeqId};

use crate::ModelError;
use crate::transformer::{
    Ending, KvCache, KvObserver, LogitsFor, Scratch, SeqInput, StepOutput, Transformer,
};

/// The ring blocks of every sequence (shared by all ring layers: they advance together).
#[derive(Debug)]
pub(crate) struct Rings {
    /// Tokens a local layer attends.
    pub(crate) window: usize,
    /// Most tokens one step may add to a sequence.
    pub(crate) max_step: usize,
    /// Ring blocks per sequence.
    pub(crate) per_seq: usize,
    block_size: usize,
    free: Vec<u32>,
    total: usize,
    tables: HashMap<SeqId, Vec<u32>>,
    /// Per layer: whether it keeps a ring.
    pub(crate) layers: Vec<bool>,
}

impl Rings {
    /// Rings for `window`-token layers in `block_size` blocks, with room for `seqs`
    /// sequences at full ring size.
    pub(crate) fn new(window: usize, block_size: usize, seqs: usize, layers: Vec<bool>) -> Self {
        let max_step = window.max(1);
        let per_seq = (window + max_step - 1).div_ceil(block_size).max(1);
        let total = per_seq * seqs.max(1);
        Self {
            window,
            max_step,
            per_seq,
            block_size,
            free: (0..total as u32).rev().collect(),
            total,
            tables: HashMap::new(),
            layers,
        }
    }

    /// Blocks of each ring layer's pool.
    pub(crate) fn total_blocks(&self) -> usize {
        self.total
    }

    /// Tokens one sequence's ring holds.
    pub(crate) fn tokens_per_seq(&self) -> usize {
        self.per_seq * self.block_size
    }

    /// Ring blocks sequence `id` holds now.
    pub(crate) fn blocks_of(&self, id: SeqId) -> Option<usize> {
        self.tables.get(&id).map(Vec::len)
    }

    pub(crate) fn add(&mut self, id: SeqId) {
        self.tables.entry(id).or_default();
    }

    pub(crate) fn remove(&mut self, id: SeqId) {
        if let Some(t) = self.tables.remove(&id) {
            self.free.extend(t);
        }
    }

    fn wanted(&self, len: usize) -> usize {
        len.div_ceil(self.block_size).min(self.per_seq)
    }

    /// Refuses growing the inputs' sequences to these lengths when the rings lack blocks.
    pub(crate) fn check(&self, grow: &[(SeqId, usize)]) -> Result<(), CacheError> {
        let needed: usize = grow
            .iter()
            .map(|&(id, len)| {
                let have = self.tables.get(&id).map_or(0, Vec::len);
                self.wanted(len).saturating_sub(have)
            })
            .sum();
        if needed > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.free.len(),
                total: self.total,
            });
        }
        Ok(())
    }

    /// Grows sequence `id`'s ring to cover `len` tokens (after [`Self::check`]).
    pub(crate) fn grow(&mut self, id: SeqId, len: usize) {
        let want = self.wanted(len);
        let t = self.tables.entry(id).or_default();
        while t.len() < want {
            match self.free.pop() {
                Some(b) => t.push(b),
                None => break,
            }
        }
    }

    /// Whether sequence `id`, now `cur` tokens long, may be cut back to `len`: the ring must
    /// still hold the window of the next query.
    pub(crate) fn check_truncate(&self, cur: usize, len: usize) -> Result<(), ModelError> {
        let ring = self.tokens_per_seq();
        let oldest_kept = cur.saturating_sub(ring);
        let oldest_needed = (len + 1).saturating_sub(self.window);
        if len == 0 || len >= cur || oldest_needed >= oldest_kept {
            return Ok(());
        }
        Err(ModelError::InvalidConfig(format!(
            "cannot cut a sequence of {cur} tokens back to {len}: its sliding-window layers \
             keep only the last {ring} tokens (a window of {}); start the sequence again",
            self.window
        )))
    }

    /// The virtual block table of sequence `id` at `len` tokens.
    pub(crate) fn virtual_table(&self, id: SeqId, len: usize) -> Vec<u32> {
        let t = self.tables.get(&id).map_or(&[][..], Vec::as_slice);
        if t.is_empty() {
            return Vec::new();
        }
        (0..len.div_ceil(self.block_size))
            .map(|i| t[i % t.len()])
            .collect()
    }
}

impl<B: Backend> Transformer<B> {
    /// Rings for a new cache, when the model has sliding-window layers, rings are on, and a
    /// ring would hold fewer tokens than a sequence may have.
    pub(crate) fn new_rings(
        &self,
        block_size: usize,
        max_tokens: usize,
        max_tokens_per_seq: usize,
    ) -> Option<Rings> {
        if !self
            .sliding_rings
            .load(std::sync::atomic::Ordering::Relaxed)
            || !self.config.arch.local_layers.contains(&true)
        {
            return None;
        }
        let window = self.config.arch.sliding_window?;
        // Room for as many sequences at full ring size as could be at full length at once.
        let seqs = max_tokens.div_ceil(max_tokens_per_seq.max(1));
        let layers = self.config.arch.local_layers.clone();
        let rings = Rings::new(window, block_size, seqs, layers);
        (rings.tokens_per_seq() < max_tokens_per_seq).then_some(rings)
    }

    /// A step some of whose inputs exceed the rings' `max_step` tokens, run as several: each
    /// long input's leading tokens alone in `max_step` chunks, then every input's tail in one
    /// step that ends as asked. Logits of [`LogitsFor::AllTokens`] are reassembled in the
    /// order one step would give. On error every sequence is cut back to its length before.
    pub(crate) fn forward_split(
        &self,
        inputs: &[SeqInput<'_>],
        cache: &mut KvCache<B>,
        scratch: &mut Scratch<B>,
        want: LogitsFor,
        ending: Ending<'_, '_, B>,
        mut observe: Option<KvObserver<'_>>,
    ) -> Result<(), ModelError> {
        let max_step = cache.rings.as_ref().map_or(usize::MAX, |r| r.max_step);
        let starts: Vec<usize> = inputs
            .iter()
            .map(|i| cache.seq_len(i.seq))
            .collect::<Result<_, _>>()?;
        let tail_len = |n: usize| (n.max(1) - 1) % max_step + 1;
        let mut early: Vec<Vec<f32>> = vec![Vec::new(); inputs.len()];
        let mut result = Ok(());
        'heads: for (i, inp) in inputs.iter().enumerate() {
            let head = inp.tokens.len() - tail_len(inp.tokens.len());
            for chunk in inp.tokens[..head].chunks(max_step) {
                let sub = [SeqInput {
                    seq: inp.seq,
                    tokens: chunk,
                }];
                let mut buf = Vec::new();
                let mut out = StepOutput::Logits(&mut buf);
                result = self.forward_inner(
                    &sub,
                    cache,
                    scratch,
                    want,
                    Ending::Output(&mut out),
                    reborrow(&mut observe),
                );
                if result.is_err() {
                    break 'heads;
                }
                if want == LogitsFor::AllTokens {
                    early[i].extend_from_slice(&buf);
                }
            }
        }
        if result.is_ok() {
            let tails: Vec<SeqInput<'_>> = inputs
                .iter()
                .map(|inp| SeqInput {
                    seq: inp.seq,
                    tokens: &inp.tokens[inp.tokens.len() - tail_len(inp.tokens.len())..],
                })
                .collect();
            result = match (want, ending) {
                (LogitsFor::AllTokens, Ending::Output(StepOutput::Logits(v))) => {
                    let mut last = Vec::new();
                    let mut out = StepOutput::Logits(&mut last);
                    let r = self.forward_inner(
                        &tails,
                        cache,
                        scratch,
                        want,
                        Ending::Output(&mut out),
                        observe,
                    );
                    if r.is_ok() {
                        let vocab = self.config.vocab_size;
                        v.clear();
                        let mut at = 0;
                        for (e, t) in early.iter().zip(&tails) {
                            v.extend_from_slice(e);
                            let n = t.tokens.len() * vocab;
                            v.extend_from_slice(&last[at..at + n]);
                            at += n;
                        }
                    }
                    r
                }
                (_, ending) => self.forward_inner(&tails, cache, scratch, want, ending, observe),
            };
        }
        if result.is_err() {
            for (inp, &start) in inputs.iter().zip(&starts) {
                cache.truncate_unchecked(inp.seq, start)?;
            }
        }
        result
    }
}

/// A shorter-lived handle on the observer, for one sub-step.
fn reborrow<'s>(observe: &'s mut Option<KvObserver<'_>>) -> Option<KvObserver<'s>> {
    match observe {
        Some(f) => Some(&mut **f),
        None => None,
    }
}
