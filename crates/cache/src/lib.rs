//! KV storage model: what the cache holds and where, as host-side bookkeeping.
//!
//! This crate knows bytes and shapes, never devices: [`KvLayout`] says how many blocks of
//! which dtype each attention layer has, [`BlockAllocator`] hands physical blocks to
//! sequences, and a sequence's [`BlockTable`] maps its logical blocks to physical ones.
//! The [`BlockPool`] under the allocator is the prefix cache: full blocks are named by a
//! [`BlockHash`] chained over the prefix's tokens and the [`CacheIdentity`], and a freed
//! block keeps its hash until it is reused.
//! Backends allocate the actual storage from the layout and read it through block tables.
#![deny(missing_docs)]

mod allocator;
mod block_snapshot;
mod hash;
mod layout;
mod policy;
mod pool;
mod store;

pub use allocator::{BlockAllocator, BlockTable, SeqId};
pub use block_snapshot::{
    BlockSnapshot, BlockSnapshotError, decode_block, encode_block, snapshot_identity,
};
pub use hash::{BlockHash, CacheIdentity, block_hashes};
pub use layout::{KvCenters, KvLayout, KvOutliers, KvWindow, LayerKv, WindowCopies};
pub use policy::KvPolicy;
pub use pool::{AllocPlan, BlockPool};
pub use store::{DirStore, SnapshotStore};

/// Errors of the cache crate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum CacheError {
    /// Not enough free blocks for the request; nothing was allocated.
    #[error("KV cache full: need {needed} more blocks, {free} free of {total}")]
    OutOfBlocks {
        /// Blocks the request needed.
        needed: usize,
        /// Blocks free.
        free: usize,
        /// Pool size.
        total: usize,
    },
    /// A sequence id that the allocator does not know.
    #[error("unknown sequence {0}")]
    UnknownSequence(SeqId),
    /// A sequence id already in use.
    #[error("sequence {0} already exists")]
    DuplicateSequence(SeqId),
    /// A length beyond what the cache was configured for.
    #[error("{tokens} tokens exceed the context limit of {limit}")]
    ContextOverflow {
        /// Requested length.
        tokens: usize,
        /// The limit.
        limit: usize,
    },
    /// An allocation plan made before another allocation changed the pool.
    #[error("allocation plan is stale: a planned block is no longer free")]
    StalePlan,
    /// A truncation that would leave a shared block partial (to be written again).
    #[error("sequence {seq}: block {block} is shared; truncate to a block boundary")]
    SharedBlock {
        /// The sequence.
        seq: SeqId,
        /// The shared block.
        block: u32,
    },
    /// An impossible layout.
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
}
