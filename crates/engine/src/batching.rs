//! How the engine shapes a step for the backend: decode steps padded to a few batch sizes
//! (so a backend that replays steps as graphs replays the same few), and how the logits come
//! back for sampling.

use crate::EngineError;

/// How pure decode steps (one token per row) are sized.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DecodeBatching {
    /// Each step has exactly its rows (default; what the CPU wants: a placeholder row costs
    /// as much as a real one and there is no graph to keep).
    #[default]
    Exact,
    /// Padded with placeholder rows up to the smallest bucket that holds them, so that a
    /// backend replaying decode steps as graphs (CUDA) finds one captured for that size
    /// instead of capturing anew whenever the batch changes. Steps larger than the largest
    /// bucket run as they are.
    Buckets(DecodeBuckets),
}

/// Batch sizes decode steps are padded to: strictly increasing, the first at least 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeBuckets(Vec<usize>);

/// Up to this size buckets double; above it they grow by [`LINEAR_STEP`].
const DOUBLING_UP_TO: usize = 128;
/// The spacing of the buckets above [`DOUBLING_UP_TO`].
const LINEAR_STEP: usize = 32;

impl DecodeBuckets {
    /// Buckets of these sizes (any order; duplicates are merged).
    pub fn new(mut sizes: Vec<usize>) -> Result<Self, EngineError> {
        sizes.sort_unstable();
        sizes.dedup();
        match sizes.first() {
            None => Err(EngineError::InvalidOptions(
                "decode buckets: give at least one batch size".into(),
            )),
            Some(0) => Err(EngineError::InvalidOptions(
                "decode buckets: a batch size of 0".into(),
            )),
            Some(_) => Ok(Self(sizes)),
        }
    }

    /// The default ladder for at most `max_seqs` rows: 1, 2, 4, … up to 128, then every 32 up
    /// to `max_seqs`, which is always the last (1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256
    /// for 256).
    ///
    /// Why these: a decode step of a model of billions of weights reads every weight once
    /// whatever its batch, and up to about 128 rows a bf16 matmul on a GPU of the H100/H200
    /// class is still bound by that read, so rounding a batch up to the next power of two
    /// costs little; above it the matmuls' arithmetic shows, and steps of 32 bound the waste
    /// (32 rows is also a whole number of the GEMM's row tiles). A placeholder row's attention
    /// reads one key, so padding adds nothing there. Twelve sizes for 256 rows fit the graphs
    /// the CUDA backend keeps.
    pub fn for_max_seqs(max_seqs: usize) -> Self {
        let max = max_seqs.max(1);
        let mut sizes = Vec::new();
        let mut s = 1;
        while s < max && s <= DOUBLING_UP_TO {
            sizes.push(s);
            s *= 2;
        }
        let mut s = DOUBLING_UP_TO + LINEAR_STEP;
        while s < max {
            sizes.push(s);
            s += LINEAR_STEP;
        }
        sizes.push(max);
        Self(sizes)
    }

    /// The sizes, increasing.
    pub fn sizes(&self) -> &[usize] {
        &self.0
    }

    /// Index of the smallest bucket holding `rows` rows, if any does.
    pub fn index_for(&self, rows: usize) -> Option<usize> {
        let i = self.0.partition_point(|&s| s < rows);
        (i < self.0.len()).then_some(i)
    }
}

impl DecodeBatching {
    /// The bucket sizes (none when steps are not padded).
    pub fn sizes(&self) -> &[usize] {
        match self {
            Self::Exact => &[],
            Self::Buckets(b) => b.sizes(),
        }
    }

    /// Placeholder rows for a step of `rows` rows, and the index of its bucket: only a
    /// `decode_shaped` step (every row one token) is padded, to the smallest bucket that
    /// holds it.
    pub(crate) fn padding(&self, rows: usize, decode_shaped: bool) -> (usize, Option<usize>) {
        match self {
            Self::Buckets(b) if decode_shaped => match b.index_for(rows) {
                Some(i) => (b.sizes()[i] - rows, Some(i)),
                None => (0, None),
            },
            _ => (0, None),
        }
    }
}

impl std::str::FromStr for DecodeBatching {
    type Err = EngineError;

    /// `none` ([`DecodeBatching::Exact`]) or comma-separated batch sizes (`1,2,4,8`).
    fn from_str(text: &str) -> Result<Self, EngineError> {
        let t = text.trim();
        if t == "none" {
            return Ok(Self::Exact);
        }
        let sizes = t
            .split(',')
            .map(|p| {
                p.trim().parse::<usize>().map_err(|_| {
                    EngineError::InvalidOptions(format!(
                        "decode buckets `{text}`: expected `none` or batch sizes like 1,2,4,8"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::Buckets(DecodeBuckets::new(sizes)?))
    }
}

/// How a step's logits come back to the host for sampling.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogitsTransfer {
    /// Each row's best candidates with its max and log-sum-exp (`to_host_top_k`, selected on
    /// the device on CUDA) when every row that samples in the step can be drawn from them
    /// (its sampler's `candidates_needed`, its `top_logprobs`, no frequency or presence
    /// penalty); else the full rows for that step. A request draws from its candidates
    /// either way (taken from the full row on the host when a neighbour needed it), so its
    /// tokens and log-probabilities do not depend on what it runs with. Default.
    #[default]
    Candidates,
    /// The full rows, always, each sampled from its whole row: the reference the candidates
    /// path is tested against, and the way to measure what it saves.
    FullRows,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_ladder_doubles_then_steps_by_32_and_ends_at_the_maximum() {
        assert_eq!(
            DecodeBuckets::for_max_seqs(256).sizes(),
            [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256]
        );
        assert_eq!(
            DecodeBuckets::for_max_seqs(64).sizes(),
            [1, 2, 4, 8, 16, 32, 64]
        );
        assert_eq!(
            DecodeBuckets::for_max_seqs(100).sizes(),
            [1, 2, 4, 8, 16, 32, 64, 100]
        );
        assert_eq!(
            DecodeBuckets::for_max_seqs(200).sizes(),
            [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 200]
        );
        assert_eq!(DecodeBuckets::for_max_seqs(1).sizes(), [1]);
        assert_eq!(DecodeBuckets::for_max_seqs(0).sizes(), [1]);
    }

    #[test]
    fn a_batch_goes_to_the_smallest_bucket_that_holds_it() {
        let b = DecodeBuckets::new(vec![8, 1, 4, 4]).unwrap();
        assert_eq!(b.sizes(), [1, 4, 8]);
        let pick = |rows| b.index_for(rows).map(|i| b.sizes()[i]);
        assert_eq!(pick(1), Some(1));
        assert_eq!(pick(2), Some(4));
        assert_eq!(pick(4), Some(4));
        assert_eq!(pick(5), Some(8));
        assert_eq!(pick(9), None);
    }

    #[test]
    fn only_decode_shaped_steps_within_the_buckets_are_padded() {
        let b = DecodeBatching::Buckets(DecodeBuckets::new(vec![1, 4, 8]).unwrap());
        assert_eq!(b.padding(3, true), (1, Some(1)));
        assert_eq!(b.padding(8, true), (0, Some(2)));
        assert_eq!(b.padding(3, false), (0, None));
        assert_eq!(b.padding(9, true), (0, None));
        assert_eq!(DecodeBatching::Exact.padding(3, true), (0, None));
    }

    #[test]
    fn bucket_lists_are_parsed_and_checked() {
        assert_eq!(
            "none".parse::<DecodeBatching>().unwrap(),
            DecodeBatching::Exact
        );
        assert_eq!(
            " 4, 1,2 ".parse::<DecodeBatching>().unwrap(),
            DecodeBatching::Buckets(DecodeBuckets(vec![1, 2, 4]))
        );
        for bad in ["", "0,4", "1,x", "auto"] {
            assert!(bad.parse::<DecodeBatching>().is_err(), "{bad:?}");
        }
    }
}
