//! The block allocator: per-sequence block tables over a [`BlockPool`] (reference counts,
//! the prefix cache and the free queue).
//!
//! Invariants (checked by [`BlockAllocator::check_invariants`]):
//! - every block is either free (refcount 0, in the free queue exactly once) or referenced by
//!   `refcount` block-table entries;
//! - a sequence's table holds `ceil(len / block_size)` blocks;
//! - a hashed block is full in every table that holds it.
//!
//! Allocation never half-succeeds: [`BlockAllocator::grow`] plans before it mutates.

use std::collections::HashMap;

use crate::CacheError;
use crate::hash::BlockHash;
use crate::pool::BlockPool;

/// Identifies a sequence in the cache.
pub type SeqId = u64;

/// Logical block i of a sequence → physical block id. Append-only while the sequence grows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    len: usize,
}

impl BlockTable {
    /// Physical block ids in logical order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Hands out fixed-size blocks to sequences.
#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    pool: BlockPool,
    seqs: HashMap<SeqId, BlockTable>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            pool: BlockPool::new(num_blocks),
            seqs: HashMap::new(),
        }
    }

    /// The block pool (refcounts, prefix cache, free queue).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Blocks free now.
    pub fn free_blocks(&self) -> usize {
        self.pool.free()
    }
    /// Pool size.
    pub fn total_blocks(&self) -> usize {
        self.pool.total()
    }

    /// Registers an empty sequence.
    pub fn add_sequence(&mut self, id: SeqId) -> Result<(), CacheError> {
        if self.seqs.contains_key(&id) {
            return Err(CacheError::DuplicateSequence(id));
        }
        self.seqs.insert(id, BlockTable::default());
        Ok(())
    }

    /// The block table of a sequence.
    pub fn table(&self, id: SeqId) -> Result<&BlockTable, CacheError> {
        self.seqs.get(&id).ok_or(CacheError::UnknownSequence(id))
    }

    /// Blocks needed to grow sequence `id` by `extra` tokens.
    pub fn blocks_needed(&self, id: SeqId, extra: usize) -> Result<usize, CacheError> {
        let t = self.table(id)?;
        let want = (t.len + extra).div_ceil(self.block_size);
        Ok(want.saturating_sub(t.blocks.len()))
    }

    /// Grows sequence `id` by `extra` tokens, allocating blocks as needed. Either every block
    /// is allocated or none is.
    pub fn grow(&mut self, id: SeqId, extra: usize) -> Result<(), CacheError> {
        let needed = self.blocks_needed(id, extra)?;
        let plan = self.pool.plan(needed)?;
        let new_blocks = self.pool.commit(plan)?;
        let t = self
            .seqs
            .get_mut(&id)
            .ok_or(CacheError::UnknownSequence(id))?;
        t.blocks.extend(new_blocks);
        t.len += extra;
        Ok(())
    }

    /// Shortens sequence `id` to `len` tokens (e.g. to drop rejected tokens), freeing the
    /// blocks no longer needed. Refused ([`CacheError::SharedBlock`], nothing changes) when it
    /// would leave a partial last block that other sequences share.
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<(), CacheError> {
        let block_size = self.block_size;
        let t = self
            .seqs
            .get_mut(&id)
            .ok_or(CacheError::UnknownSequence(id))?;
        if len >= t.len {
            return Ok(());
        }
        let keep = len.div_ceil(block_size);
        if !len.is_multiple_of(block_size) && self.pool.refcount(t.blocks[keep - 1]) > 1 {
            // Writing into it again would change the other holders' tokens.
            return Err(CacheError::SharedBlock {
                seq: id,
                block: t.blocks[keep - 1],
            });
        }
        t.len = len;
        let dropped: Vec<u32> = t.blocks.drain(keep..).collect();
        // A block left partial will be written again: it no longer holds its hashed content.
        let partial = (!len.is_multiple_of(block_size))
            .then(|| t.blocks.last().copied())
            .flatten();
        if let Some(b) = partial {
            self.pool.unregister(b);
        }
        for b in dropped {
            self.pool.release(b);
        }
        Ok(())
    }

    /// Forks `parent` into a new sequence `child` sharing all its blocks (copy-on-write is the
    /// caller's job for a partially filled last block: see [`Self::last_block_shared`]).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CacheError> {
        if self.seqs.contains_key(&child) {
            return Err(CacheError::DuplicateSequence(child));
        }
        let t = self.table(parent)?.clone();
        for &b in &t.blocks {
            self.pool.retain(b);
        }
        self.seqs.insert(child, t);
        Ok(())
    }

    /// True when the sequence's last block is also referenced elsewhere, so writing into it
    /// would change another sequence.
    pub fn last_block_shared(&self, id: SeqId) -> Result<bool, CacheError> {
        let t = self.table(id)?;
        Ok(t.blocks.last().is_some_and(|&b| self.pool.refcount(b) > 1))
    }

    /// How many of `hashes` (a prompt's full-block hashes, in order) are cached now, from the
    /// first on.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.pool.lookup(h).is_some())
            .count()
    }

    /// Registers a sequence that starts with the cached blocks of `hashes` (as many leading
    /// ones as are cached, each referenced once more); returns the tokens it holds.
    pub fn add_sequence_with_prefix(
        &mut self,
        id: SeqId,
        hashes: &[BlockHash],
    ) -> Result<usize, CacheError> {
        if self.seqs.contains_key(&id) {
            return Err(CacheError::DuplicateSequence(id));
        }
        let n = self.cached_prefix(hashes);
        let blocks: Vec<u32> = hashes[..n]
            .iter()
            .filter_map(|h| self.pool.lookup(h))
            .collect();
        for &b in &blocks {
            self.pool.retain(b);
        }
        let len = blocks.len() * self.block_size;
        self.seqs.insert(id, BlockTable { blocks, len });
        Ok(len)
    }

    /// Records that sequence `id`'s first `hashes.len()` blocks hold the full blocks these
    /// hashes name, so later prompts can share them. Blocks not yet full are skipped; a hash
    /// already held by another block leaves this block unshared.
    pub fn register_blocks(&mut self, id: SeqId, hashes: &[BlockHash]) -> Result<(), CacheError> {
        let t = self.seqs.get(&id).ok_or(CacheError::UnknownSequence(id))?;
        let full = t.len / self.block_size;
        for (&b, h) in t.blocks.iter().zip(hashes).take(full) {
            if self.pool.hash_of(b).is_none() {
                self.pool.register(b, *h);
            }
        }
        Ok(())
    }

    /// Allocates one block outside any sequence and registers it as holding `hash` (a block
    /// restored from a snapshot: the caller writes its bytes, then [`Self::release_block`]s it
    /// so that it waits in the free queue for a prefix hit). `None` when the hash is cached
    /// already.
    pub fn allocate_cached(&mut self, hash: BlockHash) -> Result<Option<u32>, CacheError> {
        if self.pool.lookup(&hash).is_some() {
            return Ok(None);
        }
        let b = self.pool.allocate(1)?[0];
        self.pool.register(b, hash);
        Ok(Some(b))
    }

    /// Drops the reference [`Self::allocate_cached`] returned; `forget` also drops its hash
    /// (its bytes could not be restored).
    pub fn release_block(&mut self, block: u32, forget: bool) {
        if forget {
            self.pool.unregister(block);
        }
        self.pool.release(block);
    }

    /// Removes a sequence, releasing its blocks.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<(), CacheError> {
        let t = self
            .seqs
            .remove(&id)
            .ok_or(CacheError::UnknownSequence(id))?;
        // The tail first: a finished sequence's last blocks are the least likely to be
        // shared, so they are evicted before its prefix.
        for b in t.blocks.into_iter().rev() {
            self.pool.release(b);
        }
        Ok(())
    }

    /// Checks every invariant; returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counted = vec![0u32; self.total_blocks()];
        for (id, t) in &self.seqs {
            if t.blocks.len() != t.len.div_ceil(self.block_size) {
                return Err(format!(
                    "seq {id}: {} blocks for {} tokens",
                    t.blocks.len(),
                    t.len
                ));
            }
            for (i, &b) in t.blocks.iter().enumerate() {
                counted[b as usize] += 1;
                if self.pool.hash_of(b).is_some() && (i + 1) * self.block_size > t.len {
                    return Err(format!("seq {id}: hashed block {b} is not full"));
                }
            }
        }
        self.pool.check_invariants(Some(&counted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn grow_is_all_or_nothing() {
        let mut a = BlockAllocator::new(4, 16);
        a.add_sequence(1).unwrap();
        a.grow(1, 40).unwrap(); // 3 blocks
        a.add_sequence(2).unwrap();
        let err = a.grow(2, 17).unwrap_err(); // needs 2, 1 free
        assert_eq!(
            err,
            CacheError::OutOfBlocks {
                needed: 2,
                free: 1,
                total: 4
            }
        );
        assert_eq!(a.table(2).unwrap().len(), 0);
        assert_eq!(a.free_blocks(), 1);
        a.check_invariants().unwrap();
    }

    #[test]
    fn fork_shares_and_remove_releases() {
        let mut a = BlockAllocator::new(8, 4);
        a.add_sequence(1).unwrap();
        a.grow(1, 6).unwrap();
        a.fork(1, 2).unwrap();
        assert!(a.last_block_shared(2).unwrap());
        assert_eq!(a.free_blocks(), 6);
        a.remove_sequence(1).unwrap();
        assert_eq!(a.free_blocks(), 6, "blocks still held by the fork");
        assert!(!a.last_block_shared(2).unwrap());
        a.remove_sequence(2).unwrap();
        assert_eq!(a.free_blocks(), 8);
        a.check_invariants().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u8),
        Grow(u8, u16),
        Truncate(u8, u16),
        Fork(u8, u8),
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6).prop_map(Op::Add),
            (0u8..6, 0u16..70).prop_map(|(s, n)| Op::Grow(s, n)),
            (0u8..6, 0u16..70).prop_map(|(s, n)| Op::Truncate(s, n)),
            (0u8..6, 0u8..6).prop_map(|(a, b)| Op::Fork(a, b)),
            (0u8..6).prop_map(Op::Remove),
        ]
    }

    proptest! {
        #[test]
        fn random_operations_keep_invariants(ops in proptest::collection::vec(op(), 1..60)) {
            let mut a = BlockAllocator::new(24, 8);
            for op in ops {
                let before_free = a.free_blocks();
                let r = match op {
                    Op::Add(s) => a.add_sequence(s.into()),
                    Op::Grow(s, n) => a.grow(s.into(), n.into()),
                    Op::Truncate(s, n) => a.truncate(s.into(), n.into()),
                    Op::Fork(p, c) => a.fork(p.into(), c.into()),
                    Op::Remove(s) => a.remove_sequence(s.into()),
                };
                if let (Err(CacheError::OutOfBlocks { .. }), Op::Grow(..)) = (&r, &op) {
                    prop_assert_eq!(a.free_blocks(), before_free);
                }
                a.check_invariants().map_err(TestCaseError::fail)?;
            }
        }
    }
}

#[cfg(test)]
mod prefix_tests {
    use super::*;
    use crate::hash::{BlockHash, CacheIdentity, block_hashes};
    use crate::{CacheError, KvLayout};
    use proptest::prelude::*;

    const BS: usize = 4;

    fn identity() -> CacheIdentity {
        let layout = KvLayout::uniform(1, 1, 8, turbokv_codec::KvDtype::Bf16, BS, 64).unwrap();
        CacheIdentity::new(&[1; 32], &layout)
    }

    /// Prompt `k`: three prompts share their first 8 tokens (two blocks).
    fn prompt(k: u8) -> Vec<u32> {
        (0..64u32)
            .map(|i| if i < 8 { i } else { u32::from(k) * 1000 + i })
            .collect()
    }

    #[test]
    fn a_freed_prefix_stays_hittable_until_evicted() {
        let id = identity();
        let toks = prompt(0);
        let hs = block_hashes(&toks[..12], BS, &id, usize::MAX);
        let mut a = BlockAllocator::new(4, BS);
        a.add_sequence(1).unwrap();
        a.grow(1, 12).unwrap();
        a.register_blocks(1, &hs).unwrap();
        a.remove_sequence(1).unwrap();
        assert_eq!(a.free_blocks(), 4);
        assert_eq!(a.cached_prefix(&hs), 3, "freed blocks keep their hashes");
        assert_eq!(a.add_sequence_with_prefix(2, &hs).unwrap(), 12);
        assert_eq!(a.free_blocks(), 1);
        a.remove_sequence(2).unwrap();
        // The never-hashed block goes first, then the oldest freed: the tail of the prefix.
        a.add_sequence(3).unwrap();
        a.grow(3, 8).unwrap();
        assert_eq!(
            a.cached_prefix(&hs),
            2,
            "the last block of the prefix was evicted first"
        );
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_failed_grow_keeps_every_cached_hash() {
        let id = identity();
        let hs = block_hashes(&prompt(0)[..8], BS, &id, usize::MAX);
        let mut a = BlockAllocator::new(3, BS);
        a.add_sequence(1).unwrap();
        a.grow(1, 8).unwrap();
        a.register_blocks(1, &hs).unwrap();
        a.remove_sequence(1).unwrap();
        a.add_sequence(2).unwrap();
        assert!(matches!(a.grow(2, 16), Err(CacheError::OutOfBlocks { .. })));
        assert_eq!(a.cached_prefix(&hs), 2);
        a.check_invariants().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Start sequence s on prompt k, sharing what is cached.
        Start(u8, u8),
        Grow(u8, u8),
        Register(u8),
        Truncate(u8, u8),
        Remove(u8),
        Restore(u8, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..5, 0u8..3).prop_map(|(s, k)| Op::Start(s, k)),
            (0u8..5, 1u8..12).prop_map(|(s, n)| Op::Grow(s, n)),
            (0u8..5).prop_map(Op::Register),
            (0u8..5, 0u8..40).prop_map(|(s, n)| Op::Truncate(s, n)),
            (0u8..5).prop_map(Op::Remove),
            (0u8..3, 1u8..6).prop_map(|(k, b)| Op::Restore(k, b)),
        ]
    }

    proptest! {
        /// Refcounts, the free queue and the hash map stay consistent, a failed allocation
        /// changes nothing, and every shared block holds exactly the content its hash names.
        #[test]
        fn prefix_sharing_keeps_invariants_and_content(ops in proptest::collection::vec(op(), 1..80)) {
            let id = identity();
            let mut a = BlockAllocator::new(12, BS);
            let mut prompt_of: HashMap<u64, u8> = HashMap::new();
            // What each physical block holds: the hash of the content written into it.
            let mut content: HashMap<u32, BlockHash> = HashMap::new();
            for op in ops {
                let before = (a.free_blocks(), a.pool().cached());
                match op {
                    Op::Start(s, k) => {
                        let hs = block_hashes(&prompt(k), BS, &id, usize::MAX);
                        if a.add_sequence_with_prefix(s.into(), &hs).is_ok() {
                            prompt_of.insert(s.into(), k);
                        }
                    }
                    Op::Grow(s, n) => {
                        let Some(&k) = prompt_of.get(&u64::from(s)) else { continue };
                        let len = a.table(s.into()).unwrap().len();
                        let n = usize::from(n).min(64 - len);
                        match a.grow(s.into(), n) {
                            Ok(()) => {
                                // The writes: every block touched now holds this prompt's content.
                                let t = a.table(s.into()).unwrap().clone();
                                let hs = block_hashes(&prompt(k), BS, &id, usize::MAX);
                                let touched = len / BS..t.len().div_ceil(BS);
                                for (&b, &h) in t.blocks()[touched.clone()].iter().zip(&hs[touched]) {
                                    content.insert(b, h);
                                }
                            }
                            Err(CacheError::OutOfBlocks { .. }) => {
                                prop_assert_eq!((a.free_blocks(), a.pool().cached()), before);
                            }
                            Err(e) => return Err(TestCaseError::fail(e.to_string())),
                        }
                    }
                    Op::Register(s) => {
                        let Some(&k) = prompt_of.get(&u64::from(s)) else { continue };
                        let hs = block_hashes(&prompt(k), BS, &id, usize::MAX);
                        a.register_blocks(s.into(), &hs).unwrap();
                    }
                    Op::Truncate(s, n) => {
                        let _ = a.truncate(s.into(), n.into());
                    }
                    Op::Remove(s) => {
                        if a.remove_sequence(s.into()).is_ok() {
                            prompt_of.remove(&u64::from(s));
                        }
                    }
                    Op::Restore(k, b) => {
                        let hs = block_hashes(&prompt(k), BS, &id, usize::MAX);
                        let h = hs[usize::from(b)];
                        if let Ok(Some(blk)) = a.allocate_cached(h) {
                            content.insert(blk, h);
                            a.release_block(blk, false);
                        }
                    }
                }
                a.check_invariants().map_err(TestCaseError::fail)?;
                // A hashed block holds the content of its hash.
                for (b, h) in a.pool().hashed_blocks() {
                    prop_assert_eq!(content.get(&b), Some(&h), "block {} hash mismatch", b);
                }
                // Every sequence's full blocks hold its own prompt's content.
                for (&s, &k) in &prompt_of {
                    let hs = block_hashes(&prompt(k), BS, &id, usize::MAX);
                    let t = a.table(s).unwrap();
                    for (i, b) in t.blocks().iter().enumerate().take(t.len() / BS) {
                        prop_assert_eq!(content.get(b), Some(&hs[i]), "seq {} block {}", s, i);
                    }
                }
            }
        }
    }
}
