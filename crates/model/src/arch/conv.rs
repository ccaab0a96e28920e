//! The per-sequence state of LFM2's conv layers: in place of a KV cache, each conv layer
//! keeps the last conv inputs of each sequence, which the next step's causal convolution
//! continues from.
//!
//! A layer's state holds `keep = taps − 1 + REWIND` rows (`[keep, hidden]`, oldest first):
//! the `taps − 1` the convolution reads, plus [`REWIND`] more so that a sequence can be cut
//! back a few tokens ([`ConvStates::rewind`]; greedy decoding drops the token of a step
//! issued past the last one it returns). Positions before 0 are zeros, so a fresh state can
//! be cut back to any length.
//!
//! Invariants: a state's `end` is the position after its newest row; its last `valid` rows
//! are real inputs or pre-start zeros (`taps − 1 ≤ valid ≤ keep`); every conv layer of a
//! sequence has the same `end`, the sequence's length, between steps.

use std::collections::HashMap;

use turbokv_cache::SeqId;

use crate::ModelError;

/// Tokens a sequence can be cut back by (at least, after any number of steps).
pub const REWIND: usize = 4;

/// One conv layer's state of one sequence.
#[derive(Clone)]
struct LayerState {
    /// `[keep, hidden]`: the conv inputs of positions `end − keep .. end`.
    rows: Vec<f32>,
    /// Trailing rows of `rows` that are real (or pre-start zeros).
    valid: usize,
    /// The position after the newest row.
    end: usize,
}

/// Every conv layer's state of every sequence in a cache.
pub(crate) struct ConvStates {
    conv_layers: usize,
    hidden: usize,
    taps: usize,
    keep: usize,
    seqs: HashMap<SeqId, Vec<LayerState>>,
}

impl ConvStates {
    /// States for `conv_layers` layers of `hidden` channels and `taps` taps.
    pub(crate) fn new(conv_layers: usize, hidden: usize, taps: usize) -> Self {
        Self {
            conv_layers,
            hidden,
            taps,
            keep: taps.saturating_sub(1) + REWIND,
            seqs: HashMap::new(),
        }
    }

    /// Bytes each sequence's state takes over every conv layer (f32 values).
    pub(crate) fn bytes_per_seq(&self) -> usize {
        self.conv_layers * self.keep * self.hidden * 4
    }

    fn fresh(&self) -> Vec<LayerState> {
        let one = LayerState {
            rows: vec![0.0; self.keep * self.hidden],
            valid: self.keep,
            end: 0,
        };
        vec![one; self.conv_layers]
    }

    /// Refuses a step of sequence `seq` starting at `start` that its state cannot continue:
    /// one from position 0 always can (it starts afresh); a later one needs a state ending
    /// exactly there.
    pub(crate) fn check_step(&self, seq: SeqId, start: usize) -> Result<(), ModelError> {
        if start == 0 {
            return Ok(());
        }
        let end = self.seqs.get(&seq).and_then(|l| l.first()).map(|l| l.end);
        if end == Some(start) {
            return Ok(());
        }
        let held = match end {
            Some(e) => format!("holds the state after {e} tokens"),
            None => "holds no state (it was lost with a failed step, or the sequence took \
                     cached prefix blocks, which carry no conv state)"
                .into(),
        };
        Err(ModelError::ConvState {
            seq,
            detail: format!(
                "a step at position {start} needs the conv layers' state after {start} tokens, \
                 but the cache {held}; start the sequence again from position 0"
            ),
        })
    }

    /// Readies `seq` for a step from `start` (checked with [`Self::check_step`]): a step
    /// from 0 starts from zeros.
    pub(crate) fn begin_step(&mut self, seq: SeqId, start: usize) {
        if start == 0 {
            let fresh = self.fresh();
            self.seqs.insert(seq, fresh);
        }
    }

    /// Conv layer `layer`'s states of the step's sequences, in `steps` order, each
    /// advanced by its token count (`(sequence, new tokens)`), for
    /// [`turbokv_backend::Backend::short_conv`] to read and update.
    pub(crate) fn layer_step(
        &mut self,
        layer: usize,
        steps: &[(SeqId, usize)],
    ) -> Result<Vec<&mut [f32]>, ModelError> {
        let order: HashMap<SeqId, usize> = steps
            .iter()
            .enumerate()
            .map(|(i, &(s, _))| (s, i))
            .collect();
        let keep = self.keep;
        let mut out: Vec<Option<&mut [f32]>> = (0..steps.len()).map(|_| None).collect();
        for (seq, layers) in self.seqs.iter_mut() {
            if let Some(&i) = order.get(seq)
                && let Some(st) = layers.get_mut(layer)
            {
                st.end += steps[i].1;
                st.valid = (st.valid + steps[i].1).min(keep);
                out[i] = Some(st.rows.as_mut_slice());
            }
        }
        out.into_iter()
            .zip(steps)
            .map(|(s, &(seq, _))| {
                s.ok_or_else(|| ModelError::ConvState {
                    seq,
                    detail: "no conv state for a sequence in the step".into(),
                })
            })
            .collect()
    }

    /// Refuses cutting `seq` back to `len` tokens further than its states reach.
    pub(crate) fn check_rewind(&self, seq: SeqId, len: usize) -> Result<(), ModelError> {
        let Some(layers) = self.seqs.get(&seq) else {
            return Ok(());
        };
        for st in layers {
            let back = st.end.saturating_sub(len);
            if len > 0 && back + self.taps.saturating_sub(1) > st.valid {
                return Err(ModelError::ConvState {
                    seq,
                    detail: format!(
                        "cannot cut {} tokens back to {len}: its conv layers keep the inputs \
                         of only the last {} positions; start the sequence again",
                        st.end, st.valid
                    ),
                });
            }
        }
        Ok(())
    }

    /// Cuts `seq` back to `len` tokens (checked with [`Self::check_rewind`]).
    pub(crate) fn rewind(&mut self, seq: SeqId, len: usize) {
        if len == 0 {
            self.seqs.remove(&seq);
            return;
        }
        let h = self.hidden;
        let Some(layers) = self.seqs.get_mut(&seq) else {
            return;
        };
        for st in layers {
            let back = st.end.saturating_sub(len).min(self.keep);
            if back == 0 {
                continue;
            }
            // Rows move `back` slots later; the slots freed at the front are not valid.
            let kept = st.rows.len() - back * h;
            st.rows.copy_within(..kept, back * h);
            st.rows[..back * h].fill(0.0);
            st.valid = st.valid.saturating_sub(back);
            st.end = len;
        }
    }

    /// Forgets `seq` (its sequence left the cache).
    pub(crate) fn remove(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }

    /// After a failed step of `seq` from `start`: a state no conv layer touched is kept as
    /// it was; one that any layer advanced is dropped, since that layer's convolution may
    /// have stopped part way (only a restart from 0 continues the sequence then).
    pub(crate) fn roll_back(&mut self, seq: SeqId, start: usize) {
        let touched = self
            .seqs
            .get(&seq)
            .is_some_and(|layers| layers.iter().any(|l| l.end != start));
        if touched {
            self.seqs.remove(&seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of one token, then cuts: within REWIND the rows come back exactly; past it the
    /// cut is refused and nothing changes.
    #[test]
    fn rewind_restores_rows_within_reach_and_refuses_beyond() {
        let (h, taps) = (2, 3);
        let mut c = ConvStates::new(1, h, taps);
        c.begin_step(7, 0);
        let mut history: Vec<Vec<f32>> = Vec::new();
        for t in 0..10 {
            c.check_step(7, t).unwrap();
            let mut s = c.layer_step(0, &[(7, 1)]).unwrap();
            // What the backend does: shift in the token's input.
            let row = [t as f32 + 1.0, -(t as f32) - 1.0];
            let st = &mut s[0];
            st.copy_within(h.., 0);
            let n = st.len();
            st[n - h..].copy_from_slice(&row);
            history.push(st.to_vec());
        }
        assert!(c.check_step(7, 9).is_err());
        c.check_rewind(7, 10 - REWIND).unwrap();
        c.rewind(7, 8);
        c.check_step(7, 8).unwrap();
        let keep = taps - 1 + REWIND;
        // The last taps − 1 rows equal the state after 8 tokens.
        let now = &c.seqs[&7][0].rows;
        assert_eq!(now[(keep - 2) * h..], history[7][(keep - 2) * h..]);
        // Two more back is allowed (REWIND = 4 in all), a third is not.
        c.rewind(7, 6);
        let err = c.check_rewind(7, 5).unwrap_err();
        assert!(
            err.to_string().contains("start the sequence again"),
            "{err}"
        );
        assert_eq!(c.seqs[&7][0].end, 6);
        // Back to 0 always works and forgets the state.
        c.check_rewind(7, 0).unwrap();
        c.rewind(7, 0);
        assert!(c.check_step(7, 6).is_err());
        c.check_step(7, 0).unwrap();
    }

    /// A failed step keeps a state no layer advanced and drops one a layer did.
    #[test]
    fn roll_back_keeps_untouched_states_only() {
        let mut c = ConvStates::new(2, 2, 3);
        c.begin_step(1, 0);
        c.layer_step(0, &[(1, 3)]).unwrap();
        c.layer_step(1, &[(1, 3)]).unwrap();
        // A failed step from 3 before any conv layer ran.
        c.roll_back(1, 3);
        c.check_step(1, 3).unwrap();
        // One that stopped after the first conv layer.
        c.layer_step(0, &[(1, 2)]).unwrap();
        c.roll_back(1, 3);
        let err = c.check_step(1, 3).unwrap_err();
        assert!(err.to_string().contains("holds no state"), "{err}");
    }
}
