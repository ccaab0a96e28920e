//! Sampling one token of a sequence from its logits row and streaming it: penalties,
//! logprobs of the model's own distribution, end-of-sequence and stop strings.

use std::collections::HashMap;
use std::time::Instant;

use turbokv_model::tokenizer::Tokenizer;

use crate::metrics::Metrics;
use crate::request::{Event, FinishReason, TokenLogprob};
use crate::sequence::Sequence;

/// Samples the next token of `seq` from its logits `row`, streams it and says whether the
/// sequence ends with it.
pub(crate) fn emit_next(
    seq: &mut Sequence,
    row: &mut [f32],
    tokenizer: &Tokenizer,
    metrics: &Metrics,
) -> Result<Option<FinishReason>, String> {
    let logprob_top = seq.req.logprobs;
    let lse = logprob_top.map(|_| log_sum_exp(row));
    let (fp, pp) = (seq.req.frequency_penalty, seq.req.presence_penalty);
    if fp != 0.0 || pp != 0.0 {
        for (&t, &c) in &seq.counts {
            if let Some(l) = row.get_mut(t as usize) {
                *l -= fp * c as f32 + pp;
            }
        }
    }
    // The logprobs are of the model's distribution: computed before penalties and filters
    // (the row is only modified for tokens generated before, so keep the original values).
    let raw: Option<Vec<(u32, f32)>> =
        logprob_top.map(|n| top_n(row, n.max(1), &seq.counts, fp, pp));
    let token = seq
        .sampler
        .sample(row, &seq.tokens)
        .map_err(|e| format!("sampling: {e}"))?;
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
    let logprob = match (lse, raw) {
        (Some(lse), Some(top)) => {
            let orig = original_logit(row, token, &seq.counts, fp, pp, true);
            Some(TokenLogprob {
                token,
                logprob: orig - lse,
                top: top
                    .into_iter()
                    .take(logprob_top.unwrap_or(0))
                    .map(|(t, l)| (t, l - lse))
                    .collect(),
            })
        }
        _ => None,
    };
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

/// The logit a token had before the frequency and presence penalties. `counted_now`: the
/// token's count already includes its own pick.
fn original_logit(
    row: &[f32],
    token: u32,
    counts: &HashMap<u32, u32>,
    fp: f32,
    pp: f32,
    counted_now: bool,
) -> f32 {
    let l = row
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let c = counts.get(&token).copied().unwrap_or(0) - u32::from(counted_now);
    if c > 0 { l + fp * c as f32 + pp } else { l }
}

/// The `n` largest original (unpenalised) logits with their ids, best first.
fn top_n(row: &[f32], n: usize, counts: &HashMap<u32, u32>, fp: f32, pp: f32) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for (i, _) in row.iter().enumerate() {
        let l = original_logit(row, i as u32, counts, fp, pp, false);
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
