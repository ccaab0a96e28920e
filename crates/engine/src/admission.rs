//! Admission control: whether a waiting request may start, given the KV blocks free now and
//! the room the running requests will need as they grow.
//!
//! Admitting a request whenever its prompt fits fills the pool with prompts; the running
//! requests then outgrow it while decoding and are preempted (their KV dropped and
//! recomputed later), over and over under load. So admission keeps a *growth reserve*: a
//! request starts only if the free blocks (evictable prefix-cache blocks included) cover
//!
//! ```text
//!   Σ running r: blocks r still needs to reach target(r)      (this round's tokens included)
//! + blocks the candidate needs to reach target(candidate)     (its whole prompt at least)
//! + watermark                                                  (a fixed margin of the pool)
//! ```
//!
//! where `target(s) = min(tokens(s) + lookahead, limit(s))` and `limit(s)` is the most tokens
//! `s` can ever hold (prompt + max_tokens, at most the model length). With a lookahead of at
//! least every request's `max_tokens` ([`GrowthReserve::Full`]) nothing is ever preempted:
//! the sum above only shrinks as blocks are handed out and finished requests free theirs.
//! A smaller lookahead trades some preemptions for more requests running at once.
//!
//! Never a deadlock: with nothing running, the head of the queue is admitted whenever its
//! prompt fits the pool at all (`EngineHandle::submit` already refused requests whose prompt
//! plus `max_tokens` exceeds the pool); the queue is first come first served, so requests
//! behind a large one wait with it until what runs has drained.

use std::str::FromStr;

use crate::EngineError;

/// How much room admission keeps for the growth of running requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrowthReserve {
    /// None: a request starts when its prompt fits beside this round's tokens; running
    /// requests that outgrow the pool are preempted.
    None,
    /// Room for each running request's next this-many tokens (capped at its limit).
    Lookahead(usize),
    /// Room for every running request to reach its limit: never preempts, admits fewest.
    Full,
}

impl FromStr for GrowthReserve {
    type Err = String;

    /// `none`, `full`, or a number of tokens of lookahead.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "full" => Ok(Self::Full),
            n => n.parse().map(Self::Lookahead).map_err(|_| {
                format!("growth reserve `{s}`: expected none, full or a number of tokens")
            }),
        }
    }
}

/// How the scheduler decides to start a waiting request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdmissionOptions {
    /// Room kept for the running requests' growth.
    pub reserve: GrowthReserve,
    /// Blocks kept free beyond every need, as a fraction of the pool in `[0, 0.5]` (vLLM's
    /// watermark; rounded up, so any positive fraction keeps at least one block).
    pub watermark: f32,
}

impl Default for AdmissionOptions {
    /// A lookahead of 64 tokens (four blocks of 16) and a 1% watermark.
    fn default() -> Self {
        Self {
            reserve: GrowthReserve::Lookahead(64),
            watermark: 0.01,
        }
    }
}

impl AdmissionOptions {
    /// Refuses a watermark outside `[0, 0.5]`.
    pub(crate) fn validate(&self) -> Result<(), EngineError> {
        if !(0.0..=0.5).contains(&self.watermark) {
            return Err(EngineError::InvalidOptions(format!(
                "the admission watermark is a fraction of the KV pool in [0, 0.5], got {}",
                self.watermark
            )));
        }
        Ok(())
    }

    /// The watermark in blocks of a pool of `total` blocks.
    pub(crate) fn watermark_blocks(&self, total: usize) -> usize {
        (f64::from(self.watermark) * total as f64).ceil() as usize
    }

    /// Tokens a sequence holding `tokens` (of at most `limit`) keeps room for. Without a
    /// reserve that is its current tokens (a waiting prompt must fit whole).
    pub(crate) fn target_tokens(&self, tokens: usize, limit: usize) -> usize {
        let target = match self.reserve {
            GrowthReserve::None => tokens,
            GrowthReserve::Lookahead(n) => tokens.saturating_add(n).min(limit),
            GrowthReserve::Full => limit,
        };
        target.max(tokens)
    }
}

/// What the scheduler does with the head of the queue this round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Start it.
    Admit,
    /// Not this round: the token budget is spent, or the blocks are (`by_reserve`: it would
    /// have fit without the growth reserve and the watermark).
    Defer {
        /// Held back by the reserve rather than by the blocks this round needs.
        by_reserve: bool,
    },
    /// It cannot run even alone in an empty pool.
    Never,
}

/// The blocks behind one admission decision.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Need {
    /// Free blocks now (after the candidate's shared prefix was taken).
    pub free: usize,
    /// Blocks this round's planned tokens need.
    pub round: usize,
    /// Blocks the running requests keep: this round's plus their growth reserve.
    pub committed: usize,
    /// Blocks the candidate's first chunk needs.
    pub chunk: usize,
    /// Blocks its whole pending tokens (the rest of its prompt) need.
    pub whole: usize,
    /// Blocks it needs to reach its own target.
    pub growth: usize,
    /// The watermark in blocks.
    pub watermark: usize,
}

/// Decides whether the candidate starts. `lone`: nothing runs (so `free` is the whole pool);
/// `fits_budget`: its first chunk fits this round's token budget.
pub(crate) fn decide(need: &Need, lone: bool, fits_budget: bool) -> Verdict {
    if lone {
        // Alone it may use the whole pool, reserve or not.
        return if need.whole > need.free {
            Verdict::Never
        } else if fits_budget {
            Verdict::Admit
        } else {
            Verdict::Defer { by_reserve: false }
        };
    }
    if !fits_budget {
        return Verdict::Defer { by_reserve: false };
    }
    let with_reserve = need.committed + need.growth + need.watermark;
    if with_reserve <= need.free {
        return Verdict::Admit;
    }
    Verdict::Defer {
        by_reserve: need.round + need.whole.max(need.chunk) <= need.free,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(free: usize, committed: usize, growth: usize) -> Need {
        Need {
            free,
            round: 2,
            committed,
            chunk: 1,
            whole: 2,
            growth,
            watermark: 1,
        }
    }

    #[test]
    fn admits_only_with_room_for_the_reserve_and_the_watermark() {
        // committed 5 + growth 4 + watermark 1 = 10.
        assert_eq!(decide(&need(10, 5, 4), false, true), Verdict::Admit);
        assert_eq!(
            decide(&need(9, 5, 4), false, true),
            Verdict::Defer { by_reserve: true }
        );
        // Not even this round's tokens and the prompt fit: not the reserve's doing.
        assert_eq!(
            decide(&need(3, 5, 4), false, true),
            Verdict::Defer { by_reserve: false }
        );
        assert_eq!(
            decide(&need(100, 5, 4), false, false),
            Verdict::Defer { by_reserve: false }
        );
    }

    #[test]
    fn a_lone_request_ignores_the_reserve_but_not_the_pool() {
        let big = Need {
            free: 12,
            round: 0,
            committed: 0,
            chunk: 4,
            whole: 11,
            growth: 12,
            watermark: 1,
        };
        assert_eq!(decide(&big, true, true), Verdict::Admit);
        assert_eq!(
            decide(&big, false, true),
            Verdict::Defer { by_reserve: true }
        );
        let too_big = Need { whole: 13, ..big };
        assert_eq!(decide(&too_big, true, true), Verdict::Never);
    }

    #[test]
    fn targets_are_capped_at_the_limit_and_never_below_the_tokens() {
        let look = AdmissionOptions {
            reserve: GrowthReserve::Lookahead(64),
            watermark: 0.0,
        };
        assert_eq!(look.target_tokens(10, 1000), 74);
        assert_eq!(look.target_tokens(10, 40), 40);
        let full = AdmissionOptions {
            reserve: GrowthReserve::Full,
            ..look
        };
        assert_eq!(full.target_tokens(10, 40), 40);
        let none = AdmissionOptions {
            reserve: GrowthReserve::None,
            ..look
        };
        assert_eq!(none.target_tokens(10, 40), 10);
        assert_eq!(look.target_tokens(50, 40), 50);
    }

    #[test]
    fn watermark_rounds_up_and_bad_fractions_are_refused() {
        let o = AdmissionOptions::default();
        assert_eq!(o.watermark_blocks(12), 1);
        assert_eq!(o.watermark_blocks(1000), 10);
        let zero = AdmissionOptions {
            watermark: 0.0,
            ..o
        };
        assert_eq!(zero.watermark_blocks(1000), 0);
        for bad in [-0.1, 0.6, f32::NAN] {
            let e = AdmissionOptions {
                watermark: bad,
                ..o
            }
            .validate();
            assert!(matches!(e, Err(EngineError::InvalidOptions(_))), "{bad}");
        }
        assert_eq!("full".parse(), Ok(GrowthReserve::Full));
        assert_eq!("none".parse(), Ok(GrowthReserve::None));
        assert_eq!("32".parse(), Ok(GrowthReserve::Lookahead(32)));
        assert!("lots".parse::<GrowthReserve>().is_err());
    }
}
