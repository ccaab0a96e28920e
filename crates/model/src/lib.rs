//! Models: weight loading, tokenizer, chat templates, forward passes, sampling.
//!
//! - [`gguf`] reads GGUF files; [`source`] presents GGUF files and safetensors directories
//!   as one [`source::TensorSource`];
//! - [`config`] validates hyper-parameters; [`loader`] makes weights resident on a backend;
//! - [`transformer`] is the forward pass over a paged KV cache;
//! - [`model`] ties them together: open a path, get a model, its tokenizer and a cache;
//! - [`calibrate`] measures the per-head mean key and value that centered caches subtract.
#![deny(missing_docs)]

pub mod arch;
pub mod calibrate;
pub mod config;
pub mod gguf;
mod kv_cache;
pub mod loader;
pub mod model;
pub mod session;
pub mod source;
pub mod transformer;

pub mod chat;
pub mod sampling;
pub mod tokenizer;

pub use calibrate::{KvCalibration, calibrate_kv_centers};
pub use config::{Family, ModelConfig};
pub use model::{LoadOptions, Model};
pub use session::Session;
pub use transformer::{
    KvCache, KvObserver, LogitsFor, Scratch, SeqInput, StepOutput, StepTokens, Transformer,
};

/// Errors of loading and running models.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A required file is missing from a model directory.
    #[error("{dir} has no {what}")]
    MissingFile {
        /// The directory.
        dir: String,
        /// What was looked for.
        what: &'static str,
    },
    /// The GGUF file is invalid.
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    /// A safetensors file is invalid.
    #[error("{path}: {detail}")]
    Safetensors {
        /// The file.
        path: String,
        /// What was wrong.
        detail: String,
    },
    /// The model's architecture is not one this engine runs.
    #[error("unknown model architecture {found:?}; supported: {supported}")]
    UnknownArchitecture {
        /// What the file declares.
        found: String,
        /// What is supported.
        supported: &'static str,
    },
    /// Inconsistent hyper-parameters.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// A tensor the architecture needs is absent.
    #[error("model file has no tensor {0}")]
    MissingTensor(String),
    /// A tensor of the wrong shape.
    #[error("tensor {name}: {detail}")]
    TensorShape {
        /// The tensor.
        name: String,
        /// What was wrong.
        detail: String,
    },
    /// A backend refused an operation.
    #[error(transparent)]
    Backend(#[from] turbokv_backend::Error),
    /// The KV cache refused an operation.
    #[error(transparent)]
    Cache(#[from] turbokv_cache::CacheError),
    /// A sequence would outgrow its context.
    #[error(
        "{tokens} tokens exceed the context limit of {limit}; use a shorter prompt, fewer --max-tokens, or a larger --ctx"
    )]
    ContextOverflow {
        /// Tokens the sequence would hold.
        tokens: usize,
        /// The limit.
        limit: usize,
    },
    /// A step input with no tokens.
    #[error("sequence {0}: a step needs at least one token")]
    EmptyInput(turbokv_cache::SeqId),
    /// A padded step ([`Transformer::forward_padded`]) this model or these inputs cannot take.
    #[error("cannot pad this step: {0}")]
    PaddingUnsupported(&'static str),
    /// The tokenizer refused a text.
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::TokenizerError),
    /// The backend lacks an operation the model's family needs.
    #[error(
        "{family:?} models need {missing}, which the {backend} backend does not have; use the CPU backend"
    )]
    FamilyUnsupported {
        /// The family.
        family: Family,
        /// What the backend lacks.
        missing: String,
        /// The backend.
        backend: String,
    },
    /// A conv layer's per-sequence state cannot serve the request: a step resuming a
    /// sequence at a position its state does not hold (a prefix taken from shared blocks,
    /// a state lost with a failed step), or a cut further back than the state reaches.
    #[error("sequence {seq}: {detail}")]
    ConvState {
        /// The sequence.
        seq: turbokv_cache::SeqId,
        /// What was asked and what the state holds.
        detail: String,
    },
    /// The path is neither a GGUF file nor a model directory.
    #[error("{0} is neither a .gguf file nor a directory with config.json")]
    UnknownFormat(String),
}
