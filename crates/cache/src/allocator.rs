//! The block allocator: free list, reference counts and per-sequence block tables.
//!
//! Invariants (checked by [`BlockAllocator::check_invariants`]):
//! - every block is either free (refcount 0, in the free list exactly once) or referenced by
//!   `refcount` block-table entries;
//! - a sequence's table holds `ceil(len / block_size)` blocks.
//!
//! Allocation never half-succeeds: [`BlockAllocator::grow`] checks capacity before it mutates.

use std::collections::HashMap;

use crate::CacheError;

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
    refcount: Vec<u32>,
    free: Vec<u32>,
    seqs: HashMap<SeqId, BlockTable>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        // Pop from the end: lower ids first keeps early sequences compact.
        let free = (0..num_blocks as u32).rev().collect();
        Self {
            block_size,
            refcount: vec![0; num_blocks],
            free,
            seqs: HashMap::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Blocks free now.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    /// Pool size.
    pub fn total_blocks(&self) -> usize {
        self.refcount.len()
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
        if needed > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.free.len(),
                total: self.total_blocks(),
            });
        }
        let new_blocks: Vec<u32> = (0..needed).filter_map(|_| self.free.pop()).collect();
        for &b in &new_blocks {
            self.refcount[b as usize] = 1;
        }
        let t = self
            .seqs
            .get_mut(&id)
            .ok_or(CacheError::UnknownSequence(id))?;
        t.blocks.extend(new_blocks);
        t.len += extra;
        Ok(())
    }

    /// Shortens sequence `id` to `len` tokens (e.g. to drop rejected tokens), freeing the
    /// blocks no longer needed.
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<(), CacheError> {
        let block_size = self.block_size;
        let t = self
            .seqs
            .get_mut(&id)
            .ok_or(CacheError::UnknownSequence(id))?;
        if len >= t.len {
            return Ok(());
        }
        t.len = len;
        let keep = len.div_ceil(block_size);
        let dropped: Vec<u32> = t.blocks.drain(keep..).collect();
        for b in dropped {
            self.release(b);
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
            self.refcount[b as usize] += 1;
        }
        self.seqs.insert(child, t);
        Ok(())
    }

    /// True when the sequence's last block is also referenced elsewhere, so writing into it
    /// would change another sequence.
    pub fn last_block_shared(&self, id: SeqId) -> Result<bool, CacheError> {
        let t = self.table(id)?;
        Ok(t.blocks
            .last()
            .is_some_and(|&b| self.refcount[b as usize] > 1))
    }

    /// Removes a sequence, releasing its blocks.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<(), CacheError> {
        let t = self
            .seqs
            .remove(&id)
            .ok_or(CacheError::UnknownSequence(id))?;
        for b in t.blocks {
            self.release(b);
        }
        Ok(())
    }

    fn release(&mut self, block: u32) {
        let rc = &mut self.refcount[block as usize];
        debug_assert!(*rc > 0, "releasing free block {block}");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(block);
        }
    }

    /// Checks every invariant; returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counted = vec![0u32; self.refcount.len()];
        for (id, t) in &self.seqs {
            if t.blocks.len() != t.len.div_ceil(self.block_size) {
                return Err(format!(
                    "seq {id}: {} blocks for {} tokens",
                    t.blocks.len(),
                    t.len
                ));
            }
            for &b in &t.blocks {
                counted[b as usize] += 1;
            }
        }
        let mut in_free = vec![false; self.refcount.len()];
        for &b in &self.free {
            if std::mem::replace(&mut in_free[b as usize], true) {
                return Err(format!("block {b} is in the free list twice"));
            }
        }
        for (b, (&rc, &c)) in self.refcount.iter().zip(&counted).enumerate() {
            if rc != c {
                return Err(format!("block {b}: refcount {rc}, referenced {c} times"));
            }
            if (rc == 0) != in_free[b] {
                return Err(format!(
                    "block {b}: refcount {rc} but free-list membership {}",
                    in_free[b]
                ));
            }
        }
        Ok(())
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
