//! The client side of the engine: the handle requests are submitted through (validated
//! there), the stream of one request's events, and the commands they send the step loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use turbokv_model::sampling::Sampler;
use turbokv_model::tokenizer::Tokenizer;

use crate::EngineError;
use crate::metrics::Metrics;
use crate::request::{Event, GenerateRequest, RequestId};
use crate::sequence::Sequence;

/// Fixed facts about a running engine, for validation and `/v1/models`.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// Most tokens one sequence may hold.
    pub max_model_len: usize,
    /// KV capacity in tokens.
    pub kv_tokens: usize,
    /// Most sequences at once.
    pub max_num_seqs: usize,
    /// Whether prefix caching is on (off for caches it cannot share exactly).
    pub prefix_caching: bool,
    /// Vocabulary size (ids must be below it).
    pub vocab_size: usize,
    /// Batch sizes decode steps are padded to (empty: not padded).
    pub decode_buckets: Vec<usize>,
}

pub(crate) enum Command {
    Submit(Box<Sequence>),
    Cancel(RequestId),
    Shutdown,
}

/// The client side of an engine: cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) tx: Sender<Command>,
    pub(crate) next_id: Arc<AtomicU64>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) info: Arc<EngineInfo>,
    pub(crate) tokenizer: Arc<Tokenizer>,
}

/// The events of one request. Dropping it cancels the request.
pub struct RequestStream {
    /// The request's id.
    pub id: RequestId,
    rx: UnboundedReceiver<Event>,
    cancel: Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The next event; `None` after the last one (or if the engine is gone).
    pub async fn next(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        self.note(&ev);
        ev
    }

    /// [`Self::next`] for threads outside an async runtime.
    pub fn next_blocking(&mut self) -> Option<Event> {
        let ev = self.rx.blocking_recv();
        self.note(&ev);
        ev
    }

    fn note(&mut self, ev: &Option<Event>) {
        if matches!(ev, None | Some(Event::Finished { .. } | Event::Failed(_))) {
            self.done = true;
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cancel.send(Command::Cancel(self.id));
        }
    }
}

impl EngineHandle {
    /// Validates and queues a request.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, EngineError> {
        let info = &self.info;
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(EngineError::InvalidParam(format!(
                "token id {bad} is outside the vocabulary of {}",
                info.vocab_size
            )));
        }
        let max_tokens = req.sampling.max_tokens;
        if req.prompt.len() + max_tokens > info.max_model_len {
            return Err(EngineError::ContextOverflow {
                prompt: req.prompt.len(),
                max_tokens,
                limit: info.max_model_len,
            });
        }
        if req.prompt.len() + max_tokens > info.kv_tokens {
            return Err(EngineError::TooLargeForCache {
                needed_tokens: req.prompt.len() + max_tokens,
                capacity_tokens: info.kv_tokens,
            });
        }
        for (name, v) in [
            ("frequency_penalty", req.frequency_penalty),
            ("presence_penalty", req.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(EngineError::InvalidParam(format!(
                    "{name} must be between -2 and 2, got {v}"
                )));
            }
        }
        if let Some(n) = req.logprobs
            && n > 20
        {
            return Err(EngineError::InvalidParam(format!(
                "top_logprobs must be at most 20, got {n}"
            )));
        }
        let sampler = Sampler::new(req.sampling.clone())
            .map_err(|e| EngineError::InvalidParam(e.to_string()))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let seq = Sequence::new(id, req, sampler, tx, self.tokenizer.decode_stream(true));
        self.tx
            .send(Command::Submit(Box::new(seq)))
            .map_err(|_| EngineError::ShuttingDown)?;
        Ok(RequestStream {
            id,
            rx,
            cancel: self.tx.clone(),
            done: false,
        })
    }

    /// Asks the engine loop to stop: requests in flight end with
    /// [`EngineError::ShuttingDown`], and the prefix cache is persisted.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    /// The engine's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Fixed facts about the engine.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The tokenizer requests are encoded with.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }
}
