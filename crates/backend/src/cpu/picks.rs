//! Greedy picks on the CPU backend: computed at once, queued like the GPU's pending copies.

use std::collections::VecDeque;

use crate::picks::{MAX_PENDING, nothing_pending, nothing_picked, too_many_pending};
use crate::{Error, TopK};

/// The CPU backend's [`Backend::Picks`](crate::Backend::Picks).
#[derive(Debug, Default)]
pub struct CpuPicks {
    /// Picks not yet waited for, oldest first: the ids, or the first row with nothing to pick.
    pending: VecDeque<Result<Vec<u32>, usize>>,
    /// The latest pick's ids (0 for a row with nothing to pick), for the next embedding.
    latest: Vec<u32>,
}

impl CpuPicks {
    /// Queues the top-1 rows of `top` as a pick.
    pub(crate) fn push(&mut self, top: &TopK) -> Result<(), Error> {
        if self.pending.len() >= MAX_PENDING {
            return Err(too_many_pending());
        }
        self.latest.clear();
        let mut empty = None;
        for r in 0..top.rows() {
            let id = if top.counts[r] == 0 {
                empty.get_or_insert(r);
                0
            } else {
                top.ids[r * top.k]
            };
            self.latest.push(id);
        }
        self.pending
            .push_back(empty.map_or_else(|| Ok(self.latest.clone()), Err));
        Ok(())
    }

    /// The oldest pending pick's ids.
    pub(crate) fn pop(&mut self, out: &mut Vec<u32>) -> Result<(), Error> {
        match self.pending.pop_front() {
            None => Err(nothing_pending()),
            Some(Err(row)) => Err(Error::NothingToPick { row }),
            Some(Ok(ids)) => {
                *out = ids;
                Ok(())
            }
        }
    }

    /// The latest pick's ids.
    pub(crate) fn latest(&self) -> Result<&[u32], Error> {
        if self.latest.is_empty() {
            return Err(nothing_picked());
        }
        Ok(&self.latest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select_top_k;

    #[test]
    fn picks_queue_in_order_and_report_empty_rows() {
        let mut p = CpuPicks::default();
        let mut out = Vec::new();
        assert!(p.latest().is_err());
        assert!(p.pop(&mut out).is_err());
        let mut top = TopK::default();
        select_top_k(&[0.0, 3.0, 1.0, 5.0, 4.0, -1.0], 3, 1, &mut top).unwrap();
        p.push(&top).unwrap();
        assert_eq!(p.latest().unwrap(), &[1, 0]);
        select_top_k(&[f32::NAN, f32::NAN, 2.0, 1.0], 2, 1, &mut top).unwrap();
        p.push(&top).unwrap();
        assert_eq!(p.latest().unwrap(), &[0, 0], "an empty row embeds id 0");
        assert!(p.push(&top).is_err(), "a third pending pick");
        p.pop(&mut out).unwrap();
        assert_eq!(out, [1, 0]);
        assert!(matches!(
            p.pop(&mut out),
            Err(Error::NothingToPick { row: 0 })
        ));
        assert!(p.pop(&mut out).is_err());
    }
}
