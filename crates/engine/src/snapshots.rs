//! Prefix blocks that survive restarts: written to a [`SnapshotStore`] when they are evicted
//! and at shutdown, restored on a prefix-cache miss after validation. A file that fails
//! validation (truncated, corrupt, another model or KV format) is skipped with its reason
//! logged, counted in `turbokv:prefix_snapshots_rejected_total`, and removed.

use std::collections::HashMap;

use turbokv_backend::Backend;
use turbokv_cache::{BlockHash, CacheIdentity, SnapshotStore, decode_block, encode_block};
use turbokv_model::KvCache;

use crate::metrics::Metrics;

/// What a block's file needs besides its bytes: its parent and its tokens.
struct BlockMeta {
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
}

/// The engine's side of a snapshot store.
pub struct Snapshots {
    store: Box<dyn SnapshotStore>,
    /// Blocks registered in the prefix cache and not yet written.
    meta: HashMap<BlockHash, BlockMeta>,
    /// Parents of blocks known to the store (chain order for restores).
    parents: HashMap<BlockHash, Option<BlockHash>>,
}

impl Snapshots {
    /// Snapshots kept in `store`.
    pub fn new(store: Box<dyn SnapshotStore>) -> Self {
        Self {
            store,
            meta: HashMap::new(),
            parents: HashMap::new(),
        }
    }

    /// Remembers the full blocks `hashes` of `tokens` (block `i` covers
    /// `i·block_size ..`), so that they can be written when evicted.
    pub(crate) fn note_blocks(&mut self, hashes: &[BlockHash], tokens: &[u32], block_size: usize) {
        for (i, h) in hashes.iter().enumerate() {
            if self.meta.contains_key(h) || self.store.contains(&h.to_hex()) {
                continue;
            }
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            let tokens = tokens[i * block_size..(i + 1) * block_size].to_vec();
            self.meta.insert(*h, BlockMeta { parent, tokens });
        }
    }

    /// Writes the listed cached blocks that the store does not hold yet.
    pub(crate) fn persist<B: Backend>(
        &mut self,
        blocks: &[(u32, BlockHash)],
        cache: &KvCache<B>,
        backend: &B,
        identity: &CacheIdentity,
        metrics: &Metrics,
    ) {
        for (block, hash) in blocks {
            let key = hash.to_hex();
            if self.store.contains(&key) {
                continue;
            }
            let Some(meta) = self.meta.remove(hash) else {
                continue;
            };
            let written = cache
                .read_block(backend, *block)
                .map_err(|e| e.to_string())
                .and_then(|payload| {
                    encode_block(
                        cache.layout(),
                        identity,
                        hash,
                        meta.parent.as_ref(),
                        &meta.tokens,
                        payload,
                    )
                    .map_err(|e| e.to_string())
                })
                .and_then(|bytes| self.store.put(&key, &bytes).map_err(|e| e.to_string()));
            match written {
                Ok(()) => {
                    metrics.snapshots_written.inc();
                    self.parents.insert(*hash, meta.parent);
                }
                Err(e) => tracing::warn!(block = %key, "prefix snapshot not written: {e}"),
            }
        }
    }

    /// Writes every block of the prefix cache (at shutdown).
    pub(crate) fn persist_all<B: Backend>(
        &mut self,
        cache: &KvCache<B>,
        backend: &B,
        identity: &CacheIdentity,
        metrics: &Metrics,
    ) {
        let blocks = cache.allocator().pool().hashed_blocks();
        self.persist(&blocks, cache, backend, identity, metrics);
        tracing::info!(blobs = self.store.len(), "prefix cache persisted");
    }

    /// Restores `hashes[from..]` (a prompt's block chain, `hashes[..from]` already cached) from
    /// the store into free cache blocks, stopping at the first block it lacks or refuses.
    pub(crate) fn restore<B: Backend>(
        &mut self,
        hashes: &[BlockHash],
        from: usize,
        cache: &mut KvCache<B>,
        backend: &B,
        identity: &CacheIdentity,
        metrics: &Metrics,
    ) {
        for i in from..hashes.len() {
            let hash = &hashes[i];
            let parent = i.checked_sub(1).map(|p| &hashes[p]);
            let key = hash.to_hex();
            let bytes = match self.store.get(&key) {
                Ok(Some(b)) => b,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(block = %key, "prefix snapshot unreadable: {e}");
                    return;
                }
            };
            let snap = match decode_block(&bytes, cache.layout(), identity, hash, parent) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(block = %key, "prefix snapshot rejected: {e}");
                    metrics.snapshots_rejected.inc();
                    let _ = self.store.remove(&key);
                    return;
                }
            };
            // A restore may evict a cached block: write that one first.
            let evicted = cache.allocator().pool().peek_evictions(1);
            self.persist(&evicted, cache, backend, identity, metrics);
            let block = match cache.allocator_mut().allocate_cached(*hash) {
                Ok(Some(b)) => b,
                Ok(None) => continue, // cached meanwhile
                Err(_) => return,     // no free block
            };
            let layers: Option<Vec<&[u8]>> = (0..cache.layout().layers.len())
                .map(|l| snap.layer_bytes(l))
                .collect();
            let written = match layers {
                Some(l) => cache
                    .write_block(backend, block, &l)
                    .map_err(|e| e.to_string()),
                None => Err("payload does not split into layers".to_string()),
            };
            let ok = written.is_ok();
            cache.allocator_mut().release_block(block, !ok);
            if let Err(e) = written {
                tracing::warn!(block = %key, "prefix snapshot not restored: {e}");
                metrics.snapshots_rejected.inc();
                return;
            }
            metrics.snapshots_restored.inc();
        }
    }
}
