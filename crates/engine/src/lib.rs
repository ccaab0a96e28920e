//! The serving engine: requests, a scheduler with continuous batching, chunked prefill,
//! preemption by recompute and cancellation, and the step loop over a model and its paged,
//! prefix-cached KV cache.
//!
//! [`Engine::new`] returns the engine and an [`EngineHandle`]; [`Engine::run`] is the step
//! loop (blocking: run it on a thread of its own, or of the rayon pool). Clients — the HTTP
//! server, tests — only talk to it through the handle: [`EngineHandle::submit`] queues a
//! request and returns a [`RequestStream`] of [`Event`]s; dropping the stream cancels the
//! request and frees its KV blocks at the next step.
#![deny(missing_docs)]

mod admission;
mod batching;
mod emit;
mod engine;
mod handle;
mod metrics;
mod request;
mod sequence;
pub mod snapshots;

pub use admission::{AdmissionOptions, GrowthReserve};
pub use batching::{DecodeBatching, DecodeBuckets, LogitsTransfer};
pub use engine::{Engine, EngineOptions};
pub use handle::{EngineHandle, EngineInfo, RequestStream};
pub use metrics::Metrics;
pub use request::{Event, FinishReason, GenerateRequest, RequestId, TokenLogprob, Usage};

/// Why the engine refused or failed a request.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum EngineError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus `max_tokens` exceed the context.
    #[error(
        "this model's maximum context length is {limit} tokens; the prompt has {prompt} tokens and max_tokens is {max_tokens}: shorten the prompt or lower max_tokens"
    )]
    ContextOverflow {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens asked for.
        max_tokens: usize,
        /// The limit.
        limit: usize,
    },
    /// The request alone needs more KV memory than the cache has.
    #[error(
        "the request needs {needed_tokens} tokens of KV cache but the cache holds {capacity_tokens}; shorten it or start the server with more --kv-memory"
    )]
    TooLargeForCache {
        /// Tokens it needs.
        needed_tokens: usize,
        /// Tokens the whole cache holds.
        capacity_tokens: usize,
    },
    /// An engine option out of range.
    #[error("invalid engine options: {0}")]
    InvalidOptions(String),
    /// A sampling parameter out of range.
    #[error("{0}")]
    InvalidParam(String),
    /// The engine stopped (shutdown) before the request finished.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The model or cache failed during a step.
    #[error("internal error: {0}")]
    Internal(String),
}
