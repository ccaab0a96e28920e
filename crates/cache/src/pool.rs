//! The block pool: reference counts, the prefix cache's hash → block map, and the free queue.
//!
//! A block is *in use* (refcount > 0) or *free*. A free block sits in the free queue in the
//! order it was freed, oldest first, and keeps its hash: until it is handed out again it can
//! be revived by a prefix-cache hit. Allocation takes the oldest free blocks, evicting their
//! hashes (least recently used first).
//!
//! Invariants (checked by [`BlockPool::check_invariants`]):
//! - a block is in the free queue exactly when its refcount is 0, and at most once;
//! - the hash map and the per-block hashes agree: `cached[h] == b` exactly when `hash[b] == h`.
//!
//! Allocation plans first ([`BlockPool::plan`]) and changes nothing unless the whole plan
//! fits; [`BlockPool::commit`] applies a plan.

use std::collections::{BTreeMap, HashMap};

use crate::CacheError;
use crate::hash::BlockHash;

/// Fixed-size blocks with reference counts and content hashes.
#[derive(Debug, Clone)]
pub struct BlockPool {
    refcount: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    /// Free blocks by the tick at which they were freed (oldest first).
    free: BTreeMap<u64, u32>,
    /// Each free block's key in `free`.
    free_tick: Vec<Option<u64>>,
    tick: u64,
}

/// Blocks an allocation would take, oldest free first; see [`BlockPool::plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocPlan {
    blocks: Vec<u32>,
}

impl AllocPlan {
    /// The blocks, in the order they will be handed out.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks without hashes.
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = Self {
            refcount: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            cached: HashMap::new(),
            free: BTreeMap::new(),
            free_tick: vec![None; num_blocks],
            tick: 0,
        };
        for b in 0..num_blocks as u32 {
            pool.push_free(b);
        }
        pool
    }

    /// Pool size.
    pub fn total(&self) -> usize {
        self.refcount.len()
    }
    /// Free blocks (cached ones included: they are reclaimable).
    pub fn free(&self) -> usize {
        self.free.len()
    }
    /// Blocks referenced by at least one sequence.
    pub fn used(&self) -> usize {
        self.total() - self.free()
    }
    /// Blocks that carry a hash (in use or free).
    pub fn cached(&self) -> usize {
        self.cached.len()
    }
    /// A block's reference count.
    pub fn refcount(&self, block: u32) -> u32 {
        self.refcount.get(block as usize).copied().unwrap_or(0)
    }
    /// A block's hash, if it holds a registered full block.
    pub fn hash_of(&self, block: u32) -> Option<BlockHash> {
        self.hash.get(block as usize).copied().flatten()
    }
    /// The block holding `hash`, if any (in use or free).
    pub fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        self.cached.get(hash).copied()
    }

    /// The `n` blocks an allocation would take, or [`CacheError::OutOfBlocks`]; changes
    /// nothing.
    pub fn plan(&self, n: usize) -> Result<AllocPlan, CacheError> {
        if n > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
                total: self.total(),
            });
        }
        Ok(AllocPlan {
            blocks: self.free.values().take(n).copied().collect(),
        })
    }

    /// The hashed blocks the next `n` allocations would evict (to persist them first).
    pub fn peek_evictions(&self, n: usize) -> Vec<(u32, BlockHash)> {
        self.free
            .values()
            .take(n)
            .filter_map(|&b| self.hash_of(b).map(|h| (b, h)))
            .collect()
    }

    /// Takes the planned blocks (refcount 1 each, hashes evicted). The plan must come from
    /// this pool with no allocation since; a block no longer free is an error and nothing
    /// changes.
    pub fn commit(&mut self, plan: AllocPlan) -> Result<Vec<u32>, CacheError> {
        if plan.blocks.iter().any(|&b| self.refcount(b) != 0) {
            return Err(CacheError::StalePlan);
        }
        for &b in &plan.blocks {
            self.take_free(b);
            if let Some(h) = self.hash[b as usize].take() {
                self.cached.remove(&h);
            }
            self.refcount[b as usize] = 1;
        }
        Ok(plan.blocks)
    }

    /// Plans and commits `n` blocks.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, CacheError> {
        let plan = self.plan(n)?;
        self.commit(plan)
    }

    /// One more reference to `block` (a prefix-cache hit); a free block leaves the free queue
    /// with its hash.
    pub fn retain(&mut self, block: u32) {
        let b = block as usize;
        if self.refcount[b] == 0 {
            self.take_free(block);
        }
        self.refcount[b] += 1;
    }

    /// Drops a reference; at zero the block joins the free queue's tail, keeping its hash.
    pub fn release(&mut self, block: u32) {
        let rc = &mut self.refcount[block as usize];
        debug_assert!(*rc > 0, "releasing free block {block}");
        *rc = rc.saturating_sub(1);
        if *rc == 0 {
            self.push_free(block);
        }
    }

    /// Registers `block` (full, in use) as holding `hash`. When another block already holds
    /// it, nothing changes and false is returned (the block stays an unshared duplicate).
    pub fn register(&mut self, block: u32, hash: BlockHash) -> bool {
        if self.cached.contains_key(&hash) || self.hash[block as usize].is_some() {
            return false;
        }
        self.cached.insert(hash, block);
        self.hash[block as usize] = Some(hash);
        true
    }

    /// Forgets `block`'s hash (its contents are about to change).
    pub fn unregister(&mut self, block: u32) {
        if let Some(h) = self.hash[block as usize].take() {
            self.cached.remove(&h);
        }
    }

    /// Every hashed block with its hash, in-use and free (to persist at shutdown).
    pub fn hashed_blocks(&self) -> Vec<(u32, BlockHash)> {
        self.cached.iter().map(|(h, &b)| (b, *h)).collect()
    }

    fn push_free(&mut self, block: u32) {
        self.tick += 1;
        self.free.insert(self.tick, block);
        self.free_tick[block as usize] = Some(self.tick);
    }

    fn take_free(&mut self, block: u32) {
        if let Some(t) = self.free_tick[block as usize].take() {
            self.free.remove(&t);
        }
    }

    /// Checks the pool's own invariants; `referenced[b]` is how many block-table entries
    /// point at block `b` (when given, refcounts must equal it).
    pub fn check_invariants(&self, referenced: Option<&[u32]>) -> Result<(), String> {
        let mut in_free = vec![false; self.total()];
        for (&t, &b) in &self.free {
            if std::mem::replace(&mut in_free[b as usize], true) {
                return Err(format!("block {b} is in the free queue twice"));
            }
            if self.free_tick[b as usize] != Some(t) {
                return Err(format!("block {b}: free tick out of sync"));
            }
        }
        for b in 0..self.total() {
            let rc = self.refcount[b];
            if (rc == 0) != in_free[b] {
                return Err(format!(
                    "block {b}: refcount {rc}, in free queue {}",
                    in_free[b]
                ));
            }
            if rc != 0 && self.free_tick[b].is_some() {
                return Err(format!("block {b}: in use with a free tick"));
            }
            if let Some(r) = referenced
                && r[b] != rc
            {
                return Err(format!(
                    "block {b}: refcount {rc}, referenced {} times",
                    r[b]
                ));
            }
            if let Some(h) = self.hash[b]
                && self.cached.get(&h) != Some(&(b as u32))
            {
                return Err(format!("block {b}: hash {h:?} not mapped to it"));
            }
        }
        for (h, &b) in &self.cached {
            if self.hash[b as usize] != Some(*h) {
                return Err(format!("hash {h:?} maps to block {b}, which holds another"));
            }
        }
        Ok(())
    }
}
