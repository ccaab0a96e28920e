//! One prefix block on disk: the codec's snapshot blob of that block, behind a small header
//! that names the block (its chain hash and its parent's) and the cache identity.
//!
//! ```text
//! magic     8   b"TKVBLK\0\0"
//! version   u32 = 1
//! identity  32  the cache identity (model, formats, window, centers)
//! hash      32  this block's chain hash
//! parent    u8 (0 none, 1 some), then 32 bytes when some
//! blob      the rest: a `turbokv_codec::Snapshot` of one block, with its token ids
//! ```
//! [`decode_block`] trusts nothing: the blob's checksum, its codec identity against the
//! cache's, the identity in the header, and the hash recomputed from the parent, the tokens
//! and the identity must all agree with what the caller asked for.

use turbokv_codec::{
    KvRole, LayerIdentity, Snapshot, SnapshotError, SnapshotIdentity, SnapshotShape,
};

use crate::KvLayout;
use crate::hash::{BlockHash, CacheIdentity};

const MAGIC: [u8; 8] = *b"TKVBLK\0\0";
const VERSION: u32 = 1;

/// Why a block file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockSnapshotError {
    /// Not a block file, or an unknown version.
    #[error("not a turbokv block snapshot (bad magic or version)")]
    BadHeader,
    /// Shorter than its header.
    #[error("block snapshot truncated in its header")]
    Truncated,
    /// Written by a cache with another identity (another model, format, window or centers).
    #[error("block snapshot of another cache (model or KV format differs)")]
    ForeignCache,
    /// Its hash is not the one asked for, or does not match its content.
    #[error("block snapshot names another block: {0}")]
    WrongBlock(&'static str),
    /// The codec blob was refused.
    #[error(transparent)]
    Blob(#[from] SnapshotError),
}

/// The codec identity of `layout`'s blocks, for [`Snapshot::decode_expecting`].
pub fn snapshot_identity(layout: &KvLayout) -> SnapshotIdentity {
    let c = &layout.codec;
    SnapshotIdentity {
        codec_version: turbokv_codec::CODEC_VERSION,
        head_dim: layout.head_dim as u32,
        key_mode: c.key_mode,
        norm: c.norm,
        qjl: c.qjl,
        base_seed: c.base_seed,
        layers: (0..layout.layers.len())
            .map(|l| {
                let o = layout.codec_options(l);
                LayerIdentity {
                    layer: l as u32,
                    dtype: layout.layers[l].dtype,
                    key_outliers: o.key_outliers,
                    value_outliers: o.value_outliers,
                }
            })
            .collect(),
    }
}

/// A decoded block: its tokens and each layer's bytes (as `Backend::read_kv_block` gives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// The block's token ids.
    pub tokens: Vec<u32>,
    /// The blob; [`Self::layer_bytes`] slices it per layer.
    snapshot: Snapshot,
}

impl BlockSnapshot {
    /// Layer `l`'s bytes: for each kv head, the key block then the value block.
    pub fn layer_bytes(&self, l: usize) -> Option<&[u8]> {
        let heads = self.snapshot.shape.kv_heads;
        let start = self.snapshot.block_range(l, 0, 0, KvRole::Key).ok()?.start;
        let end = self
            .snapshot
            .block_range(l, 0, heads.checked_sub(1)?, KvRole::Value)
            .ok()?
            .end;
        self.snapshot.payload.get(start..end)
    }
}

/// Encodes one block. `payload` is every layer's bytes, layer after layer.
pub fn encode_block(
    layout: &KvLayout,
    identity: &CacheIdentity,
    hash: &BlockHash,
    parent: Option<&BlockHash>,
    tokens: &[u32],
    payload: Vec<u8>,
) -> Result<Vec<u8>, SnapshotError> {
    let snap = Snapshot {
        identity: snapshot_identity(layout),
        shape: SnapshotShape {
            kv_heads: layout.kv_heads as u32,
            block_size: layout.block_size as u32,
            num_blocks: 1,
            num_tokens: tokens.len() as u32,
        },
        tokens: tokens.to_vec(),
        payload,
    };
    let blob = snap.encode()?;
    let mut out = Vec::with_capacity(blob.len() + 120);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&identity.0.0);
    out.extend_from_slice(&hash.0);
    match parent {
        None => out.push(0),
        Some(p) => {
            out.push(1);
            out.extend_from_slice(&p.0);
        }
    }
    out.extend_from_slice(&blob);
    Ok(out)
}

/// Decodes and validates a block file expected to hold block `hash` (whose parent is
/// `parent`) of the cache `layout`/`identity`. Never panics.
pub fn decode_block(
    bytes: &[u8],
    layout: &KvLayout,
    identity: &CacheIdentity,
    hash: &BlockHash,
    parent: Option<&BlockHash>,
) -> Result<BlockSnapshot, BlockSnapshotError> {
    let take = |at: usize, n: usize| bytes.get(at..at + n).ok_or(BlockSnapshotError::Truncated);
    if take(0, 8)? != MAGIC || take(8, 4)? != VERSION.to_le_bytes() {
        return Err(BlockSnapshotError::BadHeader);
    }
    if take(12, 32)? != identity.0.0 {
        return Err(BlockSnapshotError::ForeignCache);
    }
    if take(44, 32)? != hash.0 {
        return Err(BlockSnapshotError::WrongBlock("hash differs from its name"));
    }
    let (stored_parent, blob_at) = match take(76, 1)?[0] {
        0 => (None, 77),
        1 => {
            let mut p = [0u8; 32];
            p.copy_from_slice(take(77, 32)?);
            (Some(BlockHash(p)), 109)
        }
        _ => return Err(BlockSnapshotError::BadHeader),
    };
    if stored_parent.as_ref() != parent {
        return Err(BlockSnapshotError::WrongBlock("parent differs"));
    }
    let snapshot = Snapshot::decode_expecting(&bytes[blob_at..], &snapshot_identity(layout))?;
    let sh = snapshot.shape;
    if sh.kv_heads as usize != layout.kv_heads
        || sh.block_size as usize != layout.block_size
        || sh.num_blocks != 1
        || sh.num_tokens as usize != layout.block_size
    {
        return Err(BlockSnapshotError::ForeignCache);
    }
    if BlockHash::chain(parent, &snapshot.tokens, identity) != *hash {
        return Err(BlockSnapshotError::WrongBlock(
            "content does not hash to its name",
        ));
    }
    Ok(BlockSnapshot {
        tokens: snapshot.tokens.clone(),
        snapshot,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use turbokv_codec::KvDtype;

    fn setup(dtype: KvDtype) -> (KvLayout, CacheIdentity, Vec<u32>, BlockHash, Vec<u8>) {
        let layout = KvLayout::uniform(2, 2, 64, dtype, 4, 64).unwrap();
        let id = CacheIdentity::new(&[3; 32], &layout);
        let tokens = vec![5, 6, 7, 8];
        let hash = BlockHash::chain(None, &tokens, &id);
        let per_layer = 2
            * 2
            * turbokv_codec::block_bytes(dtype, KvRole::Key, 64, 4, Default::default()).unwrap();
        let payload: Vec<u8> = (0..2 * per_layer).map(|i| i as u8).collect();
        (layout, id, tokens, hash, payload)
    }

    #[test]
    fn a_block_round_trips_and_splits_per_layer() {
        let (layout, id, tokens, hash, payload) = setup(KvDtype::Bf16);
        let bytes = encode_block(&layout, &id, &hash, None, &tokens, payload.clone()).unwrap();
        let b = decode_block(&bytes, &layout, &id, &hash, None).unwrap();
        assert_eq!(b.tokens, tokens);
        let half = payload.len() / 2;
        assert_eq!(b.layer_bytes(0).unwrap(), &payload[..half]);
        assert_eq!(b.layer_bytes(1).unwrap(), &payload[half..]);
    }

    #[test]
    fn foreign_and_misnamed_blocks_are_refused() {
        let (layout, id, tokens, hash, payload) = setup(KvDtype::Bf16);
        let bytes = encode_block(&layout, &id, &hash, None, &tokens, payload).unwrap();
        let other = CacheIdentity::new(&[4; 32], &layout);
        assert_eq!(
            decode_block(&bytes, &layout, &other, &hash, None),
            Err(BlockSnapshotError::ForeignCache)
        );
        let wrong = BlockHash::chain(None, &[1, 2, 3, 4], &id);
        assert!(matches!(
            decode_block(&bytes, &layout, &id, &wrong, None),
            Err(BlockSnapshotError::WrongBlock(_))
        ));
        assert!(matches!(
            decode_block(&bytes, &layout, &id, &hash, Some(&wrong)),
            Err(BlockSnapshotError::WrongBlock(_))
        ));
        let int8 = KvLayout::uniform(2, 2, 64, KvDtype::Int8, 4, 64).unwrap();
        assert!(decode_block(&bytes, &int8, &id, &hash, None).is_err());
    }

    proptest! {
        /// Any truncation or single-byte corruption is refused, never accepted or a panic.
        #[test]
        fn damaged_files_are_refused(cut in 0usize..2000, flip in 0usize..2000, bit in 0u8..8) {
            let (layout, id, tokens, hash, payload) = setup(KvDtype::Int8);
            let bytes = encode_block(&layout, &id, &hash, None, &tokens, payload).unwrap();
            let cut = cut % bytes.len();
            prop_assert!(decode_block(&bytes[..cut], &layout, &id, &hash, None).is_err());
            let mut bad = bytes.clone();
            let at = flip % bad.len();
            bad[at] ^= 1 << bit;
            prop_assert!(decode_block(&bad, &layout, &id, &hash, None).is_err());
        }
    }
}
