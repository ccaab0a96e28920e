//! Greedy picks that stay on the device: the CUDA backend's [`Backend::Picks`].
//!
//! [`Backend::pick_greedy`](crate::Backend::pick_greedy) launches the argmax selection
//! (`argmax_rows`, several blocks per row) after the step's graph. It writes each row's id
//! into `ids` (the next step's embedding input, read there by
//! [`Backend::embed_picks`](crate::Backend::embed_picks) without a host round trip) and the
//! `[id, eligible]` words straight into one of two mapped page-locked host slots (no copy
//! engine transfer: that cost 7 us of stream time per step on an H200), then records the
//! slot's event; nothing waits. [`wait_picks`] waits for the oldest slot's event. Stream
//! order keeps the device buffers consistent: the next step's graph, queued after the
//! selection, reads `ids` after it is written, and the next selection overwrites `ids` only
//! after that graph. Two host slots let the host parse step n's pick while step n + 1's is
//! being written.
//!
//! [`Backend::Picks`]: crate::Backend::Picks
//! [`wait_picks`]: crate::Backend::wait_picks

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

use crate::Error;
use crate::picks::{MAX_PENDING, check_rows, nothing_pending, nothing_picked, too_many_pending};

/// Words per row of the selection's output: `[id, 1 if the row had an eligible logit]`.
pub(crate) const WORDS: usize = 2;

/// One page-locked host copy of a pick.
pub(crate) struct Slot {
    /// Mapped: the selection kernel writes it directly.
    pub host: PinnedHostSlice<u32>,
    /// `host`'s device address.
    pub dev: u64,
    /// Recorded after the selection that writes `host`.
    pub done: CudaEvent,
    pub rows: usize,
}

/// Greedy picks on the device (see the module docs).
#[derive(Default)]
pub struct CudaPicks {
    /// The latest pick's ids, one per row (0 for a row with nothing to pick).
    pub(crate) ids: Option<CudaSlice<u32>>,
    /// The selection's per-block bests (`rows · blocks`) and per-row arrival counters (zero
    /// between launches).
    pub(crate) partial: Option<CudaSlice<u64>>,
    pub(crate) counters: Option<CudaSlice<u32>>,
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
            // Words: [id, eligible]; not eligible = every logit NaN (or -inf).
            if w[1] == 0 {
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
