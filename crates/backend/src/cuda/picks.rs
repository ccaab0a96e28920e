//! Greedy picks that stay on the device: the CUDA backend's [`Backend::Picks`].
//!
//! [`Backend::pick_greedy`](crate::Backend::pick_greedy) launches the top-1 selection after the
//! step's graph, writing each row's id into `ids` (the next step's embedding input, read
//! there by [`Backend::embed_picks`](crate::Backend::embed_picks) without a host round trip)
//! and the selection words into `words`, then queues their copy into one of two page-locked
//! host slots and records the slot's event; nothing waits. [`wait_picks`] waits for the
//! oldest slot's event. Stream order keeps the device buffers consistent: the next step's
//! graph, queued after the selection, reads `ids` after it is written, and the next selection
//! overwrites `ids` and `words` only after that graph and the copy before it. Two host slots
//! let the host parse step n's pick while step n + 1's copy is queued.
//!
//! [`Backend::Picks`]: crate::Backend::Picks
//! [`wait_picks`]: crate::Backend::wait_picks

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

use crate::Error;
use crate::cpu::picks::{
    MAX_PENDING, check_rows, nothing_pending, nothing_picked, too_many_pending,
};

/// Words per row of the top-1 selection's output (`2k + 3` for `k = 1`).
pub(crate) const WORDS: usize = 5;

/// One page-locked host copy of a pick.
pub(crate) struct Slot {
    pub host: PinnedHostSlice<u32>,
    /// Recorded after the copy into `host`.
    pub done: CudaEvent,
    pub rows: usize,
}

/// Greedy picks on the device (see the module docs).
#[derive(Default)]
pub struct CudaPicks {
    /// The latest pick's ids, one per row (0 for a row with nothing to pick).
    pub(crate) ids: Option<CudaSlice<u32>>,
    /// The selection's output, `rows · WORDS` words.
    pub(crate) words: Option<CudaSlice<u32>>,
    pub(crate) slots: [Option<Slot>; MAX_PENDING],
    /// The oldest pending slot, and how many are pending.
    pub(crate) head: usize,
    pub(crate) pending: usize,
    /// Rows and columns (vocabulary) of the latest pick; 0 rows before the first.
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl std::fmt::Debug for CudaPicks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPicks")
            .field("rows", &self.rows)
            .field("pending", &self.pending)
            .finish()
    }
}

impl CudaPicks {
    /// The slot the next pick copies into, or the error of a third pending pick.
    pub(crate) fn next_slot(&self) -> Result<usize, Error> {
        if self.pending >= MAX_PENDING {
            return Err(too_many_pending());
        }
        Ok((self.head + self.pending) % MAX_PENDING)
    }

    /// The latest ids on the device (`rows` of them) and the logits' width they index.
    pub(crate) fn latest(&self, rows: usize) -> Result<(&CudaSlice<u32>, usize), Error> {
        match &self.ids {
            Some(ids) if self.rows > 0 => {
                check_rows(self.rows, rows)?;
                Ok((ids, self.cols))
            }
            _ => Err(nothing_picked()),
        }
    }

    /// Waits for the oldest pending pick and parses its ids into `out`.
    pub(crate) fn wait(&mut self, out: &mut Vec<u32>) -> Result<(), Error> {
        if self.pending == 0 {
            return Err(nothing_pending());
        }
        let slot = self.slots[self.head].as_mut().ok_or_else(nothing_pending)?;
        self.head = (self.head + 1) % MAX_PENDING;
        self.pending -= 1;
        slot.done
            .synchronize()
            .map_err(super::cuda_err("wait for picks"))?;
        let words = slot
            .host
            .as_slice()
            .map_err(super::cuda_err("wait for picks"))?;
        out.clear();
        for (row, w) in words[..slot.rows * WORDS].chunks_exact(WORDS).enumerate() {
            // Words: [id, logit, count, max, lse]; count 0 = every logit NaN.
            if w[2] == 0 {
                return Err(Error::NothingToPick { row });
            }
            out.push(w[0]);
        }
        Ok(())
    }
}

impl Drop for CudaPicks {
    fn drop(&mut self) {
        // A copy still queued into a slot must land before its page-locked memory is freed.
        for slot in self.slots.iter().flatten() {
            let _ = slot.done.synchronize();
        }
    }
}
