//! Token sampling: repetition penalty, top-k, top-p, min-p, temperature, seeded draw; and
//! stop-string detection over streamed text.
//!
//! The order follows llama.cpp's default chain: penalties, top-k, top-p, min-p, temperature,
//! draw. Top-p and min-p therefore see the temperature-1 distribution (renormalised over what
//! top-k kept). Temperature 0 is greedy (argmax after the penalty).
//!
//! Work per token is linear in the vocabulary: the candidates are partitioned with
//! `select_nth_unstable` for top-k, and top-p sorts only a growing prefix that holds the
//! requested mass, never the whole vocabulary.
//!
//! Candidates are ordered by descending logit (−0.0 equal to +0.0), then ascending id; after
//! top-k they are sorted in that order, so the draw depends only on the set kept, not on how
//! it was found. That is what lets [`Sampler::sample_candidates`] draw from a backend's
//! per-row top-k copy ([`TopKRow`]) exactly what [`Sampler::sample`] draws from the full row.

use std::hash::{BuildHasher, Hasher};

use turbokv_backend::{TOPK_MAX, TopKRow};

/// Errors of sampling parameters and of sampling itself.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    /// A parameter is out of its range.
    #[error("sampling parameter {param} = {value} is invalid: expected {expected}")]
    InvalidParam {
        /// The parameter's name.
        param: &'static str,
        /// The value given.
        value: f64,
        /// The accepted range, in words.
        expected: &'static str,
    },
    /// A stop string is empty (it would match everywhere).
    #[error("stop string #{index} is empty")]
    EmptyStop {
        /// Its position in `stop`.
        index: usize,
    },
    /// `sample` was given no logits.
    #[error("no logits to sample from (vocabulary size 0)")]
    EmptyLogits,
    /// [`Sampler::sample_candidates`] with these parameters needs the full logits
    /// ([`Sampler::candidates_needed`] is `None`).
    #[error("these sampling parameters need the full logits, not top candidates")]
    NeedsFullLogits,
    /// [`Sampler::sample_candidates`] was given a row of fewer candidate slots than needed.
    #[error("{needed} top candidates are needed for an exact draw but {got} were copied")]
    TooFewCandidates {
        /// [`Sampler::candidates_needed`].
        needed: usize,
        /// The row's `k`.
        got: usize,
    },
    /// Every logit is NaN or -inf: the forward pass produced garbage.
    #[error("all {n} logits are NaN or -inf; the model output is invalid")]
    NoFiniteLogits {
        /// How many logits there were.
        n: usize,
    },
}

/// Sampling parameters. Use [`SamplingParams::validate`] (or [`Sampler::new`], which calls
/// it) before use.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature, `>= 0`; 0 means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`, in
    /// `(0, 1]`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one's probability, in
    /// `[0, 1]`; 0 disables.
    pub min_p: f32,
    /// Repetition penalty (`> 0`, 1 disables): a recent token's positive logit is divided by
    /// it, a negative one multiplied (llama.cpp / HF semantics).
    pub repetition_penalty: f32,
    /// How many of the most recent tokens the penalty looks at; 0 disables.
    pub repetition_window: usize,
    /// PRNG seed; `None` draws one from the OS-seeded hasher.
    pub seed: Option<u64>,
    /// Maximum number of tokens to generate, `>= 1`.
    pub max_tokens: usize,
    /// Strings that end generation when they appear in the output (not included in it).
    pub stop: Vec<String>,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no
    /// repetition penalty (window 64), 256 tokens.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            repetition_window: 64,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0, no filters).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Self::default()
        }
    }

    /// Whether these parameters always choose the largest logit (temperature 0, no
    /// repetition penalty): what [`Session::generate_greedy`](crate::Session::generate_greedy)
    /// computes with the device ahead of the host.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && (self.repetition_penalty == 1.0 || self.repetition_window == 0)
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |param, value: f32, expected| SamplingError::InvalidParam {
            param,
            value: value.into(),
            expected,
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(bad(
                "temperature",
                self.temperature,
                "a finite number >= 0 (0 = greedy)",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", self.top_p, "a number in (0, 1] (1 = off)"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad("min_p", self.min_p, "a number in [0, 1] (0 = off)"));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(bad(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0 (1 = off)",
            ));
        }
        if self.max_tokens == 0 {
            return Err(SamplingError::InvalidParam {
                param: "max_tokens",
                value: 0.0,
                expected: "at least 1",
            });
        }
        if let Some(index) = self.stop.iter().position(String::is_empty) {
            return Err(SamplingError::EmptyStop { index });
        }
        Ok(())
    }
}

/// xoshiro256** seeded through SplitMix64: small, fast, and identical on every platform.
#[derive(Clone, Debug)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A seed from the process's randomly keyed hasher and the clock.
fn entropy_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.finish()
}

/// A token still in the running.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    /// The (penalised) logit, −0.0 stored as +0.0 (see [`canon`]); may be +inf.
    logit: f32,
    id: u32,
    /// `exp(logit - max)`: the unnormalised temperature-1 probability (set after top-k).
    weight: f32,
}

/// `l` with −0.0 replaced by +0.0, so that the total order of [`by_logit_desc`] agrees with
/// `>` (which [`argmax`] uses) on every non-NaN value.
#[inline]
fn canon(l: f32) -> f32 {
    if l == 0.0 { 0.0 } else { l }
}

/// Descending logit, then ascending id: a total order, so ties resolve like argmax.
#[inline]
fn by_logit_desc(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// First prefix size tried when top-p looks for its cut without sorting everything.
const TOP_P_FIRST_PREFIX: usize = 256;

/// Draws token ids from logits. Holds its PRNG and scratch buffers, so one sampler serves
/// one sequence and allocates only while its buffers grow.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
    /// Candidates; reused across calls.
    cand: Vec<Candidate>,
    /// Recent distinct token ids; reused across calls.
    recent: Vec<u32>,
}

impl TryFrom<SamplingParams> for Sampler {
    type Error = SamplingError;
    fn try_from(params: SamplingParams) -> Result<Self, SamplingError> {
        Self::new(params)
    }
}

impl Sampler {
    /// A sampler for validated `params`, seeded with `params.seed` (or entropy).
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = Xoshiro256::new(params.seed.unwrap_or_else(entropy_seed));
        Ok(Self {
            params,
            rng,
            cand: Vec::new(),
            recent: Vec::new(),
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Restarts the PRNG from `seed`.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = Xoshiro256::new(seed);
    }

    /// Picks the next token. `logits` (one per vocabulary id) is modified in place by the
    /// repetition penalty; `recent_tokens` is the sequence so far (prompt and output), of
    /// which the last `repetition_window` are penalised. NaN logits are never chosen.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        recent_tokens: &[u32],
    ) -> Result<u32, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        self.apply_repetition_penalty(logits, recent_tokens);
        if self.params.temperature == 0.0 {
            return argmax(logits).ok_or(SamplingError::NoFiniteLogits { n: logits.len() });
        }
        let k = self.params.top_k;
        if k > 0 {
            self.collect_top_k(logits, k);
            // A canonical order: the draw walks the candidates in it.
            self.cand.sort_unstable_by(by_logit_desc);
        } else {
            self.collect_candidates(logits);
        }
        if self.cand.is_empty() {
            return Err(SamplingError::NoFiniteLogits { n: logits.len() });
        }
        Ok(self.filter_and_draw())
    }

    /// How many of a row's best logits (before the repetition penalty, in [`TopKRow`]'s
    /// order) [`Self::sample_candidates`] needs to draw exactly what [`Self::sample`] would,
    /// given the sequence so far; `None` when the full logits are needed.
    ///
    /// Greedy needs 1 and top-k needs `top_k`, plus, with a repetition penalty `> 1`, one per
    /// token in the penalty window: the penalty only lowers logits, so the best `n` after it
    /// lie among the best `n + window` before it. A penalty `< 1` raises logits anywhere in
    /// the vocabulary, and sampling without top-k sees every logit: both need the full row,
    /// as does a count above [`TOPK_MAX`].
    pub fn candidates_needed(&self, recent_tokens: &[u32]) -> Option<usize> {
        let p = &self.params;
        let penalised = if p.repetition_penalty == 1.0 || p.repetition_window == 0 {
            0
        } else if p.repetition_penalty > 1.0 {
            p.repetition_window.min(recent_tokens.len())
        } else {
            return None;
        };
        let base = if p.temperature == 0.0 {
            1
        } else if p.top_k > 0 {
            p.top_k
        } else {
            return None;
        };
        base.checked_add(penalised).filter(|&n| n <= TOPK_MAX)
    }

    /// [`Self::sample`] from a row's top candidates instead of the full logits: the same
    /// token for the same PRNG state and `recent_tokens`, and the same PRNG use. `row` must
    /// hold at least [`Self::candidates_needed`] slots (fewer candidates are fine when the
    /// row had no more eligible logits).
    pub fn sample_candidates(
        &mut self,
        row: TopKRow<'_>,
        recent_tokens: &[u32],
    ) -> Result<u32, SamplingError> {
        let needed = self
            .candidates_needed(recent_tokens)
            .ok_or(SamplingError::NeedsFullLogits)?;
        if row.k < needed {
            return Err(SamplingError::TooFewCandidates { needed, got: row.k });
        }
        if row.cols == 0 {
            return Err(SamplingError::EmptyLogits);
        }
        let penalty = self.recent_window(recent_tokens);
        self.cand.clear();
        for (&id, &l) in row.ids.iter().zip(row.logits) {
            let l = match penalty {
                Some(p) if self.recent.binary_search(&id).is_ok() => penalise(l, p),
                _ => l,
            };
            // The penalty may push a huge negative logit to −inf: no longer drawable.
            if l > f32::NEG_INFINITY {
                self.cand.push(Candidate {
                    logit: canon(l),
                    id,
                    weight: 0.0,
                });
            }
        }
        self.cand.sort_unstable_by(by_logit_desc);
        let n = row.cols;
        let best = self
            .cand
            .first()
            .ok_or(SamplingError::NoFiniteLogits { n })?;
        if self.params.temperature == 0.0 {
            return Ok(best.id);
        }
        self.cand.truncate(self.params.top_k);
        Ok(self.filter_and_draw())
    }

    /// Top-p, min-p, temperature and the draw over `self.cand` (non-empty).
    fn filter_and_draw(&mut self) -> u32 {
        let filtered = self.params.top_p < 1.0 || self.params.min_p > 0.0;
        if filtered {
            self.set_weights(1.0);
            self.top_p();
            self.min_p();
        }
        if !filtered || self.params.temperature != 1.0 {
            self.set_weights(self.params.temperature);
        }
        self.draw()
    }

    /// With a repetition penalty on: fills `self.recent` with the distinct ids of the window
    /// (sorted) and returns the penalty.
    fn recent_window(&mut self, recent_tokens: &[u32]) -> Option<f32> {
        let (penalty, window) = (
            self.params.repetition_penalty,
            self.params.repetition_window,
        );
        if penalty == 1.0 || window == 0 {
            return None;
        }
        self.recent.clear();
        self.recent
            .extend_from_slice(&recent_tokens[recent_tokens.len().saturating_sub(window)..]);
        self.recent.sort_unstable();
        self.recent.dedup();
        Some(penalty)
    }

    fn apply_repetition_penalty(&mut self, logits: &mut [f32], recent_tokens: &[u32]) {
        let Some(penalty) = self.recent_window(recent_tokens) else {
            return;
        };
        for &id in &self.recent {
            if let Some(l) = logits.get_mut(id as usize) {
                *l = penalise(*l, penalty);
            }
        }
    }

    /// Every logit that can be drawn (not NaN, not −inf), in id order.
    fn collect_candidates(&mut self, logits: &[f32]) {
        self.cand.clear();
        self.cand.reserve(logits.len());
        for (id, &l) in logits.iter().enumerate() {
            if l > f32::NEG_INFINITY {
                self.cand.push(Candidate {
                    logit: canon(l),
                    id: id as u32,
                    weight: 0.0,
                });
            }
        }
    }

    /// The `k` best candidates in one pass: a heap of size `k` with the worst kept at the
    /// root, so most logits cost one comparison.
    fn collect_top_k(&mut self, logits: &[f32], k: usize) {
        self.cand.clear();
        self.cand.reserve(k);
        let mut rest = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| **l > f32::NEG_INFINITY);
        for (id, &l) in rest.by_ref() {
            self.cand.push(Candidate {
                logit: canon(l),
                id: id as u32,
                weight: 0.0,
            });
            if self.cand.len() == k {
                break;
            }
        }
        for i in (0..self.cand.len() / 2).rev() {
            sift_down_worst(&mut self.cand, i);
        }
        let Some(root) = self.cand.first() else {
            return;
        };
        let mut worst = root.logit;
        for (id, &l) in rest {
            // Later ids lose ties, so only a strictly larger logit enters.
            if l > worst {
                self.cand[0] = Candidate {
                    logit: canon(l),
                    id: id as u32,
                    weight: 0.0,
                };
                sift_down_worst(&mut self.cand, 0);
                worst = self.cand[0].logit;
            }
        }
    }

    /// `weight = exp((logit - max) / t)`: the top candidate gets 1. +inf is taken as
    /// `f32::MAX` here (only here: the order keeps it above `f32::MAX`) so softmax stays finite.
    fn set_weights(&mut self, t: f32) {
        let max = self
            .cand
            .iter()
            .fold(f32::NEG_INFINITY, |m, c| m.max(c.logit.min(f32::MAX)));
        let inv_t = 1.0 / t;
        for c in &mut self.cand {
            c.weight = ((c.logit.min(f32::MAX) - max) * inv_t).exp();
        }
    }

    /// Keeps the most likely candidates up to and including the one where the cumulative
    /// probability reaches `top_p`.
    fn top_p(&mut self) {
        let p = f64::from(self.params.top_p);
        if p >= 1.0 || self.cand.len() <= 1 {
            return;
        }
        let mass = |c: &[Candidate]| c.iter().map(|c| f64::from(c.weight)).sum::<f64>();
        let target = p * mass(&self.cand);
        // Sort a prefix that holds the mass: grow it 4× at a time (a few rounds of
        // linear-time partitioning), instead of sorting the whole vocabulary.
        let mut m = TOP_P_FIRST_PREFIX;
        loop {
            if m >= self.cand.len() {
                self.cand.sort_unstable_by(by_logit_desc);
                break;
            }
            self.cand.select_nth_unstable_by(m - 1, by_logit_desc);
            if mass(&self.cand[..m]) >= target {
                self.cand[..m].sort_unstable_by(by_logit_desc);
                break;
            }
            m *= 4;
        }
        let mut cum = 0.0;
        let mut keep = self.cand.len();
        for (i, c) in self.cand.iter().enumerate() {
            cum += f64::from(c.weight);
            if cum >= target {
                keep = i + 1;
                break;
            }
        }
        self.cand.truncate(keep.max(1));
    }

    /// Drops candidates with probability below `min_p` × the top one's (whose weight is 1).
    fn min_p(&mut self) {
        let min_p = self.params.min_p;
        if min_p > 0.0 {
            self.cand.retain(|c| c.weight >= min_p);
        }
    }

    /// One draw in proportion to the weights.
    fn draw(&mut self) -> u32 {
        let total: f64 = self.cand.iter().map(|c| f64::from(c.weight)).sum();
        let mut r = self.rng.next_f64() * total;
        for c in &self.cand {
            r -= f64::from(c.weight);
            if r < 0.0 {
                return c.id;
            }
        }
        // Rounding left `r` a hair above zero: the last candidate with weight takes it.
        let last_positive = self.cand.iter().rev().find(|c| c.weight > 0.0);
        last_positive.or(self.cand.first()).map_or(0, |c| c.id)
    }
}

/// The repetition penalty of one logit (llama.cpp / HF): a positive one is divided by it, a
/// negative one multiplied.
#[inline]
fn penalise(l: f32, penalty: f32) -> f32 {
    if l > 0.0 { l / penalty } else { l * penalty }
}

/// Restores the heap property below `i` in a heap whose root is its worst candidate.
fn sift_down_worst(heap: &mut [Candidate], mut i: usize) {
    let worse = |a: &Candidate, b: &Candidate| by_logit_desc(a, b) == std::cmp::Ordering::Greater;
    loop {
        let (l, r) = (2 * i + 1, 2 * i + 2);
        let mut w = i;
        if l < heap.len() && worse(&heap[l], &heap[w]) {
            w = l;
        }
        if r < heap.len() && worse(&heap[r], &heap[w]) {
            w = r;
        }
        if w == i {
            return;
        }
        heap.swap(i, w);
        i = w;
    }
}

/// Index of the largest logit (first on ties), ignoring NaN; `None` if all are NaN or -inf.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let (mut best_id, mut best) = (None, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > best {
            best = l;
            best_id = Some(i as u32);
        }
    }
    best_id
}

/// What [`StopChecker::push`] released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopStep<'a> {
    /// Text now safe to emit (never part of a stop string).
    pub text: &'a str,
    /// `Some(i)` when stop string `i` matched: generation is over, and `text` is everything
    /// before the match.
    pub stopped: Option<usize>,
}

/// Finds stop strings in streamed text, across token boundaries.
///
/// Text that could be the start of a stop string is held back until it either completes
/// the stop string (then it is dropped and generation ends) or cannot (then it is released).
/// Concatenating every released `text` plus [`finish`](Self::finish) gives the generated
/// text cut just before the first stop string.
#[derive(Clone, Debug, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    /// Text not yet released: a suffix that is a proper prefix of some stop string.
    held: String,
    /// The text released by the last call.
    out: String,
    stopped: Option<usize>,
}

impl StopChecker {
    /// A checker for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..Self::default()
        }
    }

    /// Adds a decoded piece; returns what may be emitted and whether a stop string matched.
    /// After a match, further pushes release nothing.
    pub fn push(&mut self, piece: &str) -> StopStep<'_> {
        self.out.clear();
        if self.stopped.is_some() {
            return StopStep {
                text: &self.out,
                stopped: self.stopped,
            };
        }
        self.held.push_str(piece);
        // Earliest match; on equal positions the earlier stop string in the list.
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|pos| (pos, i)))
            .min();
        if let Some((pos, i)) = found {
            self.out.push_str(&self.held[..pos]);
            self.held.clear();
            self.stopped = Some(i);
            return StopStep {
                text: &self.out,
                stopped: self.stopped,
            };
        }
        let keep = self
            .stops
            .iter()
            .map(|s| partial_overlap(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        self.out.push_str(&self.held[..cut]);
        self.held.drain(..cut);
        StopStep {
            text: &self.out,
            stopped: None,
        }
    }

    /// Ends the stream without a stop: releases the held-back text.
    pub fn finish(&mut self) -> &str {
        self.out.clear();
        if self.stopped.is_none() {
            std::mem::swap(&mut self.out, &mut self.held);
        }
        &self.out
    }

    /// The index of the stop string that matched, if any.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn partial_overlap(text: &str, stop: &str) -> usize {
    let max = (stop.len() - 1).min(text.len());
    (1..=max)
        .rev()
        .find(|&k| {
            stop.is_char_boundary(k)
                && text.is_char_boundary(text.len() - k)
                && text.ends_with(&stop[..k])
        })
        .unwrap_or(0)
}
