//! `turbokv bench model`: prefill and decode speed of a model, median of repeats.

use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use turbokv_model::Session;

use crate::args::{BenchModelArgs, cache_dir};
use crate::generate::{Loaded, load};

#[derive(Serialize)]
struct Row {
    threads: usize,
    kv: String,
    prompt_tokens: usize,
    gen_tokens: usize,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    decode_ms_per_token: f64,
    /// `--interleave`: decode tok/s of each round's segment, in round order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    decode_rounds_tok_s: Vec<f64>,
}

/// Runs the benchmark and prints a table (and JSON if asked).
pub fn run(args: &BenchModelArgs) -> Result<()> {
    crate::with_device!(&args.model.device, b => run_on(b, args))
}

fn run_on<B: turbokv_backend::Backend>(backend: B, args: &BenchModelArgs) -> Result<()> {
    let loaded = load(backend, &args.model, &args.cache)?;
    let text_path = args
        .text
        .clone()
        .unwrap_or_else(|| cache_dir().join("data/wiki.txt"));
    anyhow::ensure!(
        args.prompt_tokens.iter().all(|&n| n > 0),
        "--prompt-tokens: every length must be at least 1 (decoding starts from the logits of the prompt's last token)"
    );
    let longest = args.prompt_tokens.iter().copied().max().unwrap_or(0);
    let source: Vec<u32> = match std::fs::read_to_string(&text_path) {
        Ok(text) => loaded
            .tokenizer
            .encode(&text[..text.len().min(longest * 16)], false, false)?,
        Err(_) => {
            tracing::warn!(
                "{} not found; using synthetic token ids",
                text_path.display()
            );
            (0..longest as u32)
                .map(|i| 1000 + (i * 7919) % 30000)
                .collect()
        }
    };
    anyhow::ensure!(
        source.len() >= longest,
        "the text has only {} tokens, {longest} wanted",
        source.len()
    );
    let threads = rayon::current_num_threads();
    let rows = if args.interleave.is_empty() {
        one_cache(&loaded, &source, args, threads)?
    } else {
        interleaved(&loaded, &source, args, threads)?
    };
    println!(
        "{:>7} {:>12} {:>8} {:>6} {:>12} {:>11} {:>10}",
        "threads", "kv", "prompt", "gen", "prefill t/s", "decode t/s", "ms/token"
    );
    for r in &rows {
        println!(
            "{:>7} {:>12} {:>8} {:>6} {:>12.1} {:>11.1} {:>10.2}",
            r.threads,
            r.kv,
            r.prompt_tokens,
            r.gen_tokens,
            r.prefill_tok_s,
            r.decode_tok_s,
            r.decode_ms_per_token
        );
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({ "model": loaded.model.name, "rows": rows });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `--kv`'s cache alone: each repeat prefills and decodes in a fresh session.
fn one_cache<B: turbokv_backend::Backend>(
    loaded: &Loaded<B>,
    source: &[u32],
    args: &BenchModelArgs,
    threads: usize,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &n in &args.prompt_tokens {
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        for _ in 0..args.repeats.max(1) {
            let mut session = Session::with_policy(
                &loaded.model.transformer,
                loaded.kv,
                &loaded.policy,
                n + args.gen_tokens + 1,
            )
            .context("creating the session")?;
            let t = Instant::now();
            let mut logits = session.prefill(&source[..n])?.to_vec();
            prefill.push(n as f64 / t.elapsed().as_secs_f64());
            let t = Instant::now();
            for _ in 0..args.gen_tokens {
                let next = argmax(&logits);
                logits.clear();
                logits.extend_from_slice(session.step(next)?);
            }
            decode.push(args.gen_tokens as f64 / t.elapsed().as_secs_f64());
        }
        let (p, d) = (median(&mut prefill), median(&mut decode));
        rows.push(Row {
            threads,
            kv: loaded.kv_label.clone(),
            prompt_tokens: n,
            gen_tokens: args.gen_tokens,
            prefill_tok_s: p,
            decode_tok_s: d,
            decode_ms_per_token: 1000.0 / d,
            decode_rounds_tok_s: Vec::new(),
        });
    }
    Ok(rows)
}

/// `--kv`'s cache and `--interleave`'s in one process: one session per cache and prompt
/// length; the prompt prefilled in `repeats` parts, every session taking each part in turn,
/// then `repeats` rounds in which every session decodes `gen_tokens` tokens; the order is
/// reversed every other round. Reported: each cache's prefill rate over its parts and its
/// median decode segment.
fn interleaved<B: turbokv_backend::Backend>(
    loaded: &Loaded<B>,
    source: &[u32],
    args: &BenchModelArgs,
    threads: usize,
) -> Result<Vec<Row>> {
    use crate::kvspec::{KvDefaults, KvSpec, build_policy};
    let model = &loaded.model.transformer;
    let defaults = KvDefaults::from_args(&args.cache.kv_opts, turbokv_cache::KvWindow::default());
    let layers =
        turbokv_cache::KvPolicy::parse_layers(&args.cache.kv_layers).context("--kv-layers")?;
    let mut caches = vec![(loaded.kv_label.clone(), loaded.kv, loaded.policy.clone())];
    let mut cal = None;
    for text in &crate::kvspec::split_list(&args.interleave) {
        let spec = KvSpec::parse(text, defaults)?;
        let label = spec.label(text);
        let policy = build_policy(
            model,
            &loaded.tokenizer,
            &spec,
            &label,
            (loaded.ctx, &layers),
            &mut cal,
        )?;
        caches.push((label, spec.dtype, policy));
    }
    let (rounds, steps) = (args.repeats.max(1), args.gen_tokens);
    let mut rows = Vec::new();
    for &n in &args.prompt_tokens {
        let tokens = n + rounds * steps + 1;
        anyhow::ensure!(
            tokens <= model.config().max_context,
            "--interleave keeps every cache's tokens: {n} prompt + {rounds} rounds × {steps} \
             tokens exceed the model's context of {}; use a shorter prompt, fewer --repeats \
             or fewer --gen-tokens",
            model.config().max_context
        );
        let mut sessions = Vec::new();
        for (label, dtype, policy) in &caches {
            let session = Session::with_policy(model, *dtype, policy, tokens)
                .with_context(|| format!("creating the session of {label}"))?;
            sessions.push((session, Vec::new(), 0.0, Vec::new()));
        }
        // One untimed prefill first: the process's first pass over the weights (page faults,
        // cold caches) would otherwise fall on whichever cache comes first.
        {
            let (label, dtype, policy) = &caches[0];
            let warm = n.min(64);
            Session::with_policy(model, *dtype, policy, warm + 1)
                .and_then(|mut s| s.prefill(&source[..warm]).map(drop))
                .with_context(|| format!("warming up with {label}"))?;
        }
        // The prompt in `rounds` parts, each prefilled by every session in turn: a part
        // continues its session's prefill (chunked the same way), and each session's
        // prefill time is the sum of its parts.
        for round in 0..rounds {
            let part = n * round / rounds..n * (round + 1) / rounds;
            for i in round_order(round, sessions.len()) {
                let (session, logits, seconds, _) = &mut sessions[i];
                let t = Instant::now();
                *logits = session.prefill(&source[part.clone()])?.to_vec();
                *seconds += t.elapsed().as_secs_f64();
            }
        }
        for ((label, ..), (_, _, seconds, _)) in caches.iter().zip(&mut sessions) {
            *seconds = n as f64 / *seconds;
            tracing::info!(kv = %label, prompt = n, prefill_tok_s = *seconds, "prefilled");
        }
        for round in 0..rounds {
            for i in round_order(round, sessions.len()) {
                let (session, logits, _, segments) = &mut sessions[i];
                let t = Instant::now();
                for _ in 0..steps {
                    let next = argmax(logits);
                    logits.clear();
                    logits.extend_from_slice(session.step(next)?);
                }
                segments.push(steps as f64 / t.elapsed().as_secs_f64());
            }
            tracing::info!(round = round + 1, of = rounds, "decode round done");
        }
        for ((label, ..), (_, _, prefill, segments)) in caches.iter().zip(sessions) {
            let d = median(&mut segments.clone());
            rows.push(Row {
                threads,
                kv: label.clone(),
                prompt_tokens: n,
                gen_tokens: steps,
                prefill_tok_s: prefill,
                decode_tok_s: d,
                decode_ms_per_token: 1000.0 / d,
                decode_rounds_tok_s: segments,
            });
        }
    }
    Ok(rows)
}

/// The sessions in round `round`'s order: forward in even rounds, reversed in odd ones.
fn round_order(round: usize, n: usize) -> Vec<usize> {
    if round.is_multiple_of(2) {
        (0..n).collect()
    } else {
        (0..n).rev().collect()
    }
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
