//! Sampling one token of a sequence from its logits row or its best candidates, and
//! streaming it: penalties, logprobs of the model's own distribution, end-of-sequence and
//! stop strings.

use std::time::Instant;

use turbokv_backend::{TOPK_MAX, TopKRow};
use turbokv_model::tokenizer::Tokenizer;

use crate::LogitsTransfer;
use crate::metrics::Metrics;
use crate::request::{Event, FinishReason, TokenLogprob};
use crate::sequence::Sequence;

/// What a token is drawn from.
pub(crate) enum Scores<'a> {
    /// The whole row of logits as the model gave them, and a buffer for the penalised copy
    /// the sampler works on.
    Full {
        logits: &'a [f32],
        work: &'a mut Vec<f32>,
    },
    /// The row's best candidates (at least [`candidates_needed`] of them), with its
    /// log-sum-exp.
    Top(TopKRow<'a>),
}

/// How many of a row's best logits the next draw of `seq` needs (its sampler's count, at
/// least its `top_logprobs`), or `None` when it needs the whole row: frequency and
/// presence penalties (they may raise any logit), sampling without top-k, more than
/// [`TOPK_MAX`].
pub(crate) fn candidates_needed(seq: &Sequence) -> Option<usize> {
    if seq.req.frequency_penalty != 0.0 || seq.req.presence_penalty != 0.0 {
        return None;
    }
    let k = seq.sampler.candidates_needed(&seq.tokens)?;
    let k = k.max(seq.req.logprobs.map_or(0, |n| n.max(1)));
    (k <= TOPK_MAX).then_some(k)
}

/// The candidates per row a step of `plan` (`(index into running, tokens fed)`) copies back,
/// or `None` for the full rows: the most any row that samples this step needs, unless one
/// needs its whole row (or `transfer` asks for whole rows). A step where no row samples
/// (prompt chunks short of their prompt's end) needs one.
pub(crate) fn step_candidates(
    transfer: LogitsTransfer,
    running: &[Sequence],
    plan: &[(usize, usize)],
) -> Option<usize> {
    if transfer == LogitsTransfer::FullRows {
        return None;
    }
    let mut k = 1;
    for &(i, n) in plan {
        let s = &running[i];
        if s.cached + n == s.tokens.len() {
            k = k.max(candidates_needed(s)?);
        }
    }
    Some(k)
}

/// Samples the next token of `seq` from `scores`, streams it and says whether the sequence
/// ends with it.
pub(crate) fn emit_next(
    seq: &mut Sequence,
    scores: Scores<'_>,
    tokenizer: &Tokenizer,
    metrics: &Metrics,
) -> Result<Option<FinishReason>, String> {
    let (token, logprob) = match scores {
        Scores::Full { logits, work } => draw_full(seq, logits, work)?,
        Scores::Top(row) => draw_top(seq, row)?,
    };
    let now = Instant::now();
    match seq.last_token_at {
        None => metrics.ttft.observe((now - seq.arrived).as_secs_f64()),
        Some(t) => {
            metrics.itl.observe((now - t).as_secs_f64());
            metrics.tpot.observe((now - t).as_secs_f64());
        }
    }
    seq.last_token_at = Some(now);
    metrics.generation_tokens.inc();
    *seq.counts.entry(token).or_insert(0) += 1;
    seq.tokens.push(token);
    if tokenizer.is_eos(token) && !seq.req.ignore_eos {
        let _ = seq.tx.send(Event::Token {
            id: token,
            text: String::new(),
            logprob,
        });
        return Ok(Some(FinishReason::Stop));
    }
    let mut text = String::new();
    let mut stopped = false;
    if let Some(piece) = seq.decoder.step(tokenizer, token) {
        let step = seq.stops.push(piece);
        text.push_str(step.text);
        stopped = step.stopped.is_some();
    }
    let _ = seq.tx.send(Event::Token {
        id: token,
        text,
        logprob,
    });
    if stopped {
        return Ok(Some(FinishReason::Stop));
    }
    if seq.generated() >= seq.req.sampling.max_tokens {
        return Ok(Some(FinishReason::Length));
    }
    Ok(None)
}

/// The draw from the whole row: frequency and presence penalties on a copy, then the
/// sampler (which applies the repetition penalty to that copy). Log-probabilities are of the
/// unpenalised row.
fn draw_full(
    seq: &mut Sequence,
    logits: &[f32],
    work: &mut Vec<f32>,
) -> Result<(u32, Option<TokenLogprob>), String> {
    work.clear();
    work.extend_from_slice(logits);
    let (fp, pp) = (seq.req.frequency_penalty, seq.req.presence_penalty);
    if fp != 0.0 || pp != 0.0 {
        for (&t, &c) in &seq.counts {
            if let Some(l) = work.get_mut(t as usize) {
                *l -= fp * c as f32 + pp;
            }
        }
    }
    let token = seq
        .sampler
        .sample(work, &seq.tokens)
        .map_err(|e| format!("sampling: {e}"))?;
    let logprob = seq.req.logprobs.map(|n| {
        let lse = log_sum_exp(logits);
        let own = logits.get(token as usize).copied().unwrap_or(f32::NAN);
        TokenLogprob {
            token,
            logprob: own - lse,
            top: top_n(logits, n)
                .into_iter()
                .map(|(t, l)| (t, l - lse))
                .collect(),
        }
    });
    Ok((token, logprob))
}

/// The draw from the row's best candidates (exactly what the whole row would give, see
/// `Sampler::sample_candidates`); log-probabilities from the candidates' unpenalised logits
/// and the row's log-sum-exp.
fn draw_top(seq: &mut Sequence, row: TopKRow<'_>) -> Result<(u32, Option<TokenLogprob>), String> {
    let token = seq
        .sampler
        .sample_candidates(row, &seq.tokens)
        .map_err(|e| format!("sampling: {e}"))?;
    let logprob = seq.req.logprobs.map(|n| {
        // The drawn token is one of the candidates.
        let own = row
            .ids
            .iter()
            .position(|&t| t == token)
            .map_or(f32::NAN, |j| row.logits[j]);
        TokenLogprob {
            token,
            logprob: own - row.lse,
            top: row
                .ids
                .iter()
                .zip(row.logits)
                .take(n)
                .map(|(&t, &l)| (t, l - row.lse))
                .collect(),
        }
    });
    Ok((token, logprob))
}

/// The `n` largest logits with their ids, best first (ties: the lower id), NaN left out.
fn top_n(row: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    for (i, &l) in row.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        if best.len() < n || l > best[best.len() - 1].1 {
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(n);
        }
    }
    best
}

fn log_sum_exp(row: &[f32]) -> f32 {
    let m = row
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    let s: f64 = row
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| ((x - m) as f64).exp())
        .sum();
    m + s.ln() as f32
}
