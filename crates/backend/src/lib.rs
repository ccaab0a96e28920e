//! The Backend trait and its implementations.
//!
//! `quant` holds the weight formats (GGML blocks) and the host-side [`WeightMatrix`];
//! `cpu` holds the CPU kernels (SIMD + rayon).
#![deny(missing_docs)]

mod backend;
pub mod cpu;
pub mod cuda;
mod picks;
pub mod quant;
mod shape;
mod topk;

pub use backend::{
    AttnGeometry, AttnVariant, Backend, KvPoolBlocks, MoeExpert, MoeMlp, QkNorm, QkvProjection,
    Rope, RopeStyle, SeqSpan, VariantNeeds,
};
pub use quant::{GgmlType, WeightBytes, WeightMatrix};
pub use topk::{TOPK_MAX, TopK, TopKRow, select_top_k};

/// Errors of the backend crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor type the engine cannot compute with.
    #[error(
        "unsupported weight type {name} (ggml type {id}); supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"
    )]
    UnsupportedWeightType {
        /// The on-disk type number.
        id: u32,
        /// Its name, if known.
        name: &'static str,
    },
    /// A row length that is not a whole number of format blocks.
    #[error("a row of {cols} elements is not a whole number of {ty:?} blocks of {block_len}")]
    RaggedRow {
        /// The format.
        ty: GgmlType,
        /// Elements per row.
        cols: usize,
        /// Elements per block.
        block_len: usize,
    },
    /// Byte count does not match the shape.
    #[error("weight holds {actual} bytes but its shape needs {expected}")]
    WeightSize {
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The shape's byte size overflows.
    #[error("weight shape [{rows}, {cols}] is too large")]
    SizeOverflow {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// A KV-cache number format this backend cannot attend over.
    #[error("the {backend} backend does not support KV dtype {dtype} (accepted: {accepted})")]
    UnsupportedKvDtype {
        /// The requested dtype.
        dtype: String,
        /// The backend.
        backend: &'static str,
        /// What it accepts.
        accepted: &'static str,
    },
    /// An attention shape this backend has no kernel for (see
    /// [`Backend::supports_attention`]).
    #[error("the {backend} backend cannot run attention with {detail} (supported: {supported})")]
    UnsupportedAttention {
        /// The backend.
        backend: &'static str,
        /// The requested shape.
        detail: String,
        /// What it supports.
        supported: String,
    },
    /// The KV codec refused an operation.
    #[error(transparent)]
    Codec(#[from] turbokv_codec::Error),
    /// A top-k copy asked for a `k` outside `1..=max`.
    #[error("top-k of {k} candidates per row is out of range (1..={max})")]
    TopKOutOfRange {
        /// The `k` asked for.
        k: usize,
        /// The largest supported.
        max: usize,
    },
    /// A greedy pick of a row whose logits are all NaN: there is no token to choose.
    #[error("row {row} of the logits has no token to pick (every logit is NaN)")]
    NothingToPick {
        /// The row.
        row: usize,
    },
    /// Two operands whose shapes do not fit together.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What did not fit.
        detail: String,
    },
    /// An operation this backend does not implement (a model family's extra op).
    #[error("the {backend} backend cannot run {op}; run this model on the CPU backend")]
    UnsupportedOp {
        /// The operation.
        op: &'static str,
        /// The backend.
        backend: String,
    },
    /// No usable CUDA device: the driver or a CUDA library is missing, the ordinal does not
    /// exist, or the GPU is too old. Callers fall back to the CPU with this message.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable {
        /// Why, in one line.
        reason: String,
    },
    /// An operation this backend does not implement.
    #[error("{op} is not supported by this backend ({why})")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// Why, or what to use instead.
        why: &'static str,
    },
    /// A CUDA driver, NVRTC or cuBLAS call failed (out of device memory, launch failure, …).
    #[error("CUDA error in {op}: {detail}")]
    Cuda {
        /// The operation.
        op: &'static str,
        /// The library's error.
        detail: String,
    },
}
