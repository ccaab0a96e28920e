//! A single-sequence session over a model: chunked prefill, then one token per step.
//!
//! This is the loop `turbokv run`/`chat` and the tests drive; batching many sequences is the
//! engine's job and uses [`Transformer::forward`] directly.

use std::time::{Duration, Instant};

use turbokv_backend::{Backend, TopK};
use turbokv_cache::{KvPolicy, SeqId};
use turbokv_codec::KvDtype;

use crate::ModelError;
use crate::transformer::{KvCache, LogitsFor, Scratch, SeqInput, StepTokens, Transformer};

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
    picks: B::Picks,
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
            picks: model.backend().new_picks()?,
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

    /// Greedy decoding with the device a step ahead of the host: prefills `prompt`, then
    /// calls `on_token` with each generated token in order until it returns false,
    /// `max_tokens` tokens were generated or the context is full; returns the generated tokens
    /// (the one `on_token` refused included).
    ///
    /// Each step's input is the step before's pick, still on the device
    /// ([`Transformer::forward_pick`]), so step n + 1 is issued before step n's token is read:
    /// the host's share of a step (launch checks, uploads, `on_token`) overlaps the device's.
    /// The tokens are those of a loop of [`Self::step_top_k`] with `k = 1`, and the cache
    /// ends the same way: the prompt and every returned token but the last (a step issued
    /// past that point is rolled back).
    pub fn generate_greedy(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Vec<u32>, ModelError> {
        let mut generated = Vec::new();
        if max_tokens == 0 {
            self.prefill(prompt)?;
            return Ok(generated);
        }
        let start = Instant::now();
        let chunks: Vec<&[u32]> = prompt.chunks(PREFILL_CHUNK).collect();
        let Some((last, head)) = chunks.split_last() else {
            return Err(ModelError::EmptyInput(SEQ));
        };
        for chunk in head {
            self.run(chunk, LogitsFor::LastToken)?;
        }
        let input = [SeqInput {
            seq: SEQ,
            tokens: last,
        }];
        self.model.forward_pick(
            StepTokens::Host(&input),
            &mut self.cache,
            &mut self.scratch,
            &mut self.picks,
        )?;
        // Timing by arrival: the prefill ends when its token arrives (the device may still be
        // working on it when `forward_pick` returns); decode is the span from the first token
        // to the last one, over the steps between them.
        let (mut first_at, mut last_at) = (None, start);
        let limit = self.cache.max_tokens_per_seq();
        let (mut pending, mut ids) = (1usize, Vec::new());
        // Whether the last iteration issued a step, which fed the token it then waited for.
        let mut fed_last;
        let result = loop {
            // Issue the step that feeds the pending pick, if its token may be wanted.
            fed_last = false;
            if generated.len() + pending < max_tokens && self.len() < limit {
                let step = self.model.forward_pick(
                    StepTokens::Picked(&[SEQ]),
                    &mut self.cache,
                    &mut self.scratch,
                    &mut self.picks,
                );
                if let Err(e) = step {
                    break Err(e);
                }
                pending += 1;
                fed_last = true;
            }
            pending -= 1;
            if let Err(e) = self.model.backend().wait_picks(&mut self.picks, &mut ids) {
                break Err(e.into());
            }
            let Some(&token) = ids.first() else {
                break Err(ModelError::EmptyInput(SEQ));
            };
            last_at = Instant::now();
            first_at.get_or_insert(last_at);
            generated.push(token);
            if !on_token(token) || !fed_last {
                break Ok(());
            }
        };
        // Picks still pending are not wanted (the next call must start with none), nor is
        // the token appended by a step that fed the last one (returned, or failed to arrive).
        let mut drained = Ok(());
        for _ in 0..pending {
            drained = drained.and(self.model.backend().wait_picks(&mut self.picks, &mut ids));
        }
        if fed_last {
            let len = self.len();
            self.cache.truncate(SEQ, len.saturating_sub(1))?;
        }
        let first_at = first_at.unwrap_or(last_at);
        self.times.prefill += first_at - start;
        self.times.prefill_tokens += prompt.len();
        self.times.decode += last_at - first_at;
        self.times.decode_tokens += generated.len().saturating_sub(1);
        result?;
        drained?;
        Ok(generated)
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
