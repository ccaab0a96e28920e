//! The crate's error type.

/// Everything that can go wrong in the codec on bad input.
///
/// Library paths never panic on caller input; they return one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A dtype string did not parse.
    #[error("unknown KV dtype {input:?}; accepted: {accepted}")]
    UnknownDtype {
        /// The string that was given.
        input: String,
        /// A human-readable list of the accepted spellings.
        accepted: &'static str,
    },
    /// A TurboQuant bit width outside the supported set.
    #[error(
        "unsupported TurboQuant width of {half_bits} half-bits; supported: 1, 1.5, 2, 2.5, 3, 3.5, 4 bits"
    )]
    UnsupportedBits {
        /// The width in half-bits (2 × bits).
        half_bits: u8,
    },
    /// A head dimension the codec cannot handle.
    #[error("unsupported head dimension {head_dim}: {reason}")]
    UnsupportedHeadDim {
        /// The head dimension given.
        head_dim: usize,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A slice had the wrong length.
    #[error("length mismatch for {what}: expected {expected}, got {got}")]
    LengthMismatch {
        /// Which argument.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A token slot outside the block.
    #[error("slot {slot} out of range for a block of {block_size} tokens")]
    SlotOutOfRange {
        /// The slot requested.
        slot: usize,
        /// Tokens per block.
        block_size: usize,
    },
    /// An outlier channel set that does not fit the head dimension.
    #[error("invalid outlier channel set for head_dim {head_dim}: {reason}")]
    InvalidOutliers {
        /// The head dimension.
        head_dim: usize,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// A configuration value that is out of range.
    #[error("invalid {what}: {reason}")]
    InvalidConfig {
        /// The setting.
        what: &'static str,
        /// Why it is invalid.
        reason: &'static str,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
