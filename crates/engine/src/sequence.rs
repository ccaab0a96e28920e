//! One request's state inside the engine.

use std::collections::HashMap;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use turbokv_cache::BlockHash;
use turbokv_model::sampling::{Sampler, StopChecker};
use turbokv_model::tokenizer::DecodeStream;

use crate::request::{Event, GenerateRequest, RequestId};

/// A request being served: its tokens so far and how many of them the cache holds.
pub(crate) struct Sequence {
    pub id: RequestId,
    pub tx: UnboundedSender<Event>,
    pub req: GenerateRequest,
    pub sampler: Sampler,
    /// Prompt, then every generated token (the last one not yet fed when decoding).
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose KV is in the cache (0 while waiting or after preemption).
    pub cached: usize,
    /// Whether the cache has a sequence for it.
    pub admitted: bool,
    /// Hashes of the full blocks of `tokens`, computed as they fill.
    pub hashes: Vec<BlockHash>,
    /// Prompt tokens found in the prefix cache at first admission.
    pub cached_tokens: Option<usize>,
    pub decoder: DecodeStream,
    pub stops: StopChecker,
    /// How often each token was generated (frequency and presence penalties).
    pub counts: HashMap<u32, u32>,
    /// Whether the growth reserve held it back once (counted and logged the first time).
    pub deferred: bool,
    pub arrived: Instant,
    pub last_token_at: Option<Instant>,
}

impl Sequence {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens to feed before the next token can be sampled.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.cached
    }

    /// The most tokens it can ever hold: prompt plus `max_tokens`, at most `max_model_len`.
    pub fn limit(&self, max_model_len: usize) -> usize {
        (self.prompt_len + self.req.sampling.max_tokens).min(max_model_len)
    }

    pub fn new(
        id: RequestId,
        req: GenerateRequest,
        sampler: Sampler,
        tx: UnboundedSender<Event>,
        decoder: DecodeStream,
    ) -> Self {
        let stops = StopChecker::new(&req.sampling.stop);
        Self {
            id,
            tx,
            sampler,
            tokens: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            cached: 0,
            admitted: false,
            hashes: Vec::new(),
            cached_tokens: None,
            decoder,
            stops,
            counts: HashMap::new(),
            deferred: false,
            arrived: Instant::now(),
            last_token_at: None,
            req,
        }
    }
}
