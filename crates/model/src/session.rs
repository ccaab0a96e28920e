//! A single-sequence session over a model: chunked prefill, then one token per step.
//!
//! This is the loop `turbokv run`/`chat` and the tests drive; batching many sequences is the
//! engine's job and uses [`Transformer::forward`] directly.

use std::time::{Duration, Instant};

use turbokv_backend::{Backend, TopK};
use turbokv_cache::{KvPolicy, SeqId};
use turbokv_codec::KvDtype;

use crate::ModelError;
use crate::transformer::{KvCache, LogitsFor, Scratch, SeqInput, Transformer};

/// Tokens per prefill chunk: bounds activation memory while keeping matmuls large.
pub const PREFILL_CHUNK: usize = 512;
/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

const SEQ: SeqId = 0;

/// Timing of a session's work so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct SessionTimes {
    /// Tokens processed by prefill.
    pub prefill_tokens: usize,
    /// Time spent in prefill.
    pub prefill: Duration,
    /// Tokens processed one at a time.
    pub decode_tokens: usize,
    /// Time spent in single-token steps.
    pub decode: Duration,
}

/// One sequence's KV cache and buffers over a borrowed model.
pub struct Session<'m, B: Backend> {
    model: &'m Transformer<B>,
    cache: KvCache<B>,
    scratch: Scratch<B>,
    logits: Vec<f32>,
    top: TopK,
    /// Accumulated timings.
    pub times: SessionTimes,
}

impl<'m, B: Backend> Session<'m, B> {
    /// A session whose cache holds up to `ctx` tokens in `dtype`.
    pub fn new(model: &'m Transformer<B>, dtype: KvDtype, ctx: usize) -> Result<Self, ModelError> {
        Self::with_policy(model, dtype, &KvPolicy::default(), ctx)
    }

    /// [`Self::new`] under a cache policy (per-layer overrides, full-precision window).
    pub fn with_policy(
        model: &'m Transformer<B>,
        dtype: KvDtype,
        policy: &KvPolicy,
        ctx: usize,
    ) -> Result<Self, ModelError> {
        let ctx = ctx.min(model.config().max_context);
        let mut cache = model.new_cache_with(dtype, policy, BLOCK_SIZE, ctx, ctx)?;
        cache.add_sequence(SEQ)?;
        Ok(Self {
            model,
            cache,
            scratch: model.new_scratch()?,
            logits: Vec::new(),
            top: TopK::default(),
            times: SessionTimes::default(),
        })
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.cache.seq_len(SEQ).unwrap_or(0)
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cache (for its layout and memory figures).
    pub fn cache(&self) -> &KvCache<B> {
        &self.cache
    }

    /// Appends `tokens` (in chunks) and returns the logits after the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        let start = Instant::now();
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            self.run(chunk, LogitsFor::LastToken)?;
        }
        self.times.prefill += start.elapsed();
        self.times.prefill_tokens += tokens.len();
        Ok(&self.logits)
    }

    /// [`Self::prefill`] that copies back only the `k` best next-token logits (for
    /// [`Sampler::sample_candidates`](crate::sampling::Sampler::sample_candidates)).
    pub fn prefill_top_k(&mut self, tokens: &[u32], k: usize) -> Result<&TopK, ModelError> {
        let start = Instant::now();
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            self.run_top_k(chunk, k)?;
        }
        self.times.prefill += start.elapsed();
        self.times.prefill_tokens += tokens.len();
        Ok(&self.top)
    }

    /// Appends `tokens` and returns logits for every one of them (`[n, vocab]`), for
    /// perplexity and reference comparisons.
    pub fn prefill_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mut all = Vec::with_capacity(tokens.len() * self.model.config().vocab_size);
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            self.run(chunk, LogitsFor::AllTokens)?;
            all.extend_from_slice(&self.logits);
        }
        Ok(all)
    }

    /// Appends one token and returns the next-token logits.
    pub fn step(&mut self, token: u32) -> Result<&[f32], ModelError> {
        let start = Instant::now();
        self.run(&[token], LogitsFor::LastToken)?;
        self.times.decode += start.elapsed();
        self.times.decode_tokens += 1;
        Ok(&self.logits)
    }

    /// [`Self::step`] that copies back only the `k` best next-token logits.
    pub fn step_top_k(&mut self, token: u32, k: usize) -> Result<&TopK, ModelError> {
        let start = Instant::now();
        self.run_top_k(&[token], k)?;
        self.times.decode += start.elapsed();
        self.times.decode_tokens += 1;
        Ok(&self.top)
    }

    /// Forgets every cached token.
    pub fn reset(&mut self) -> Result<(), ModelError> {
        self.cache.remove_sequence(SEQ)?;
        self.cache.add_sequence(SEQ)?;
        Ok(())
    }

    fn run(&mut self, tokens: &[u32], want: LogitsFor) -> Result<(), ModelError> {
        let input = [SeqInput { seq: SEQ, tokens }];
        self.model.forward(
            &input,
            &mut self.cache,
            &mut self.scratch,
            want,
            &mut self.logits,
        )
    }

    fn run_top_k(&mut self, tokens: &[u32], k: usize) -> Result<(), ModelError> {
        let input = [SeqInput { seq: SEQ, tokens }];
        self.model
            .forward_top_k(&input, &mut self.cache, &mut self.scratch, k, &mut self.top)
    }
}
