//! `turbokv eval ppl`: perplexity, KL divergence and top-1 agreement against a bf16 KV cache,
//! for several KV dtypes over the same windows of text.

use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use serde::Serialize;
use turbokv_backend::Backend;
use turbokv_codec::KvDtype;
use turbokv_model::Session;

use crate::args::{EvalPplArgs, cache_dir};
use crate::generate::load;
use crate::kvspec::{KvDefaults, KvSpec, build_policy};
use turbokv_cache::{KvPolicy, KvWindow};

#[derive(Serialize, Clone, Debug)]
struct Row {
    kv: String,
    bits_per_element: f64,
    kv_bytes_per_token: f64,
    ppl: f64,
    delta_ppl_pct: f64,
    kl_vs_bf16: f64,
    top1_agree: f64,
    tokens: usize,
}

/// Running sums for one dtype.
#[derive(Default, Clone)]
struct Acc {
    nll: f64,
    kl: f64,
    agree: usize,
    n: usize,
}

/// Runs the evaluation.
pub fn run(args: &EvalPplArgs) -> Result<()> {
    crate::with_device!(&args.model.device, b => run_on(b, args))
}

fn run_on<B: Backend>(backend: B, args: &EvalPplArgs) -> Result<()> {
    let cache = crate::args::CacheArgs::plain("bf16", Some(args.ctx));
    let default_window = KvWindow {
        recent: args.kv_window,
        sinks: args.kv_sinks,
    };
    let defaults = KvDefaults::from_args(&args.kv_opts, default_window);
    let specs: Vec<(String, KvSpec)> = args
        .kv
        .iter()
        .map(|s| KvSpec::parse(s, defaults).map(|k| (k.label(s), k)))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        // The bf16 baseline row is always there.
        .filter(|(label, _)| label != "bf16")
        .collect();
    let layers = KvPolicy::parse_layers(&args.kv_layers).context("--kv-layers")?;
    let loaded = load(backend, &args.model, &cache)?;
    // Refuse a bad layer index or dtype now, not after the first reference window; calibrate
    // once for every entry that needs it.
    let mut calibration = None;
    let dtypes: Vec<(String, KvSpec, KvPolicy)> = specs
        .into_iter()
        .map(|(label, k)| {
            let policy = build_policy(
                &loaded.model.transformer,
                &loaded.tokenizer,
                &k,
                &label,
                &layers,
                &mut calibration,
            )?;
            Ok((label, k, policy))
        })
        .collect::<Result<_>>()?;
    let text_path: PathBuf = args
        .text
        .clone()
        .unwrap_or_else(|| cache_dir().join("data/wiki.txt"));
    let text = std::fs::read_to_string(&text_path).with_context(|| {
        format!(
            "reading {} (run scripts/fetch-assets.sh)",
            text_path.display()
        )
    })?;
    let need = args.ctx * args.windows;
    // Tokenize only as much text as the windows need (~4 characters per token, with margin).
    let ids = loaded
        .tokenizer
        .encode(&text[..floor_char(&text, need * 8)], false, false)?;
    ensure!(
        ids.len() >= need,
        "{} holds {} tokens; {} windows of {} need {need}",
        text_path.display(),
        ids.len(),
        args.windows,
        args.ctx
    );
    let vocab = loaded.model.transformer.config().vocab_size;
    let bar = indicatif::ProgressBar::new((args.windows * (dtypes.len() + 1)) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "eval {bar:30} {pos}/{len} window×dtype {elapsed}/{eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut base = Acc::default();
    let mut accs = vec![Acc::default(); dtypes.len()];
    for w in 0..args.windows {
        let window = &ids[w * args.ctx..(w + 1) * args.ctx];
        let reference = window_logits(&loaded, KvDtype::Bf16, &KvPolicy::default(), window)?;
        let ref_lp = log_softmax_rows(&reference, vocab);
        drop(reference);
        score(&ref_lp, &ref_lp, window, vocab, &mut base);
        bar.inc(1);
        for ((_, d, policy), acc) in dtypes.iter().zip(&mut accs) {
            let lp = log_softmax_rows(&window_logits(&loaded, d.dtype, policy, window)?, vocab);
            score(&lp, &ref_lp, window, vocab, acc);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let base_ppl = (base.nll / base.n as f64).exp();
    let bf16 = KvSpec::parse("bf16", KvDefaults::default())?;
    let mut rows = vec![row("bf16", bf16, &[], &base, base_ppl, args.ctx, &loaded)];
    rows.extend(
        dtypes
            .iter()
            .zip(&accs)
            .map(|((name, d, _), a)| row(name, *d, &layers, a, base_ppl, args.ctx, &loaded)),
    );
    print_table(&rows, args);
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "model": loaded.model.name, "ctx": args.ctx, "windows": args.windows,
            "text": text_path.display().to_string(), "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn window_logits<B: Backend>(
    loaded: &crate::generate::Loaded<B>,
    dtype: KvDtype,
    policy: &KvPolicy,
    window: &[u32],
) -> Result<Vec<f32>> {
    let mut session = Session::with_policy(&loaded.model.transformer, dtype, policy, window.len())?;
    Ok(session.prefill_all_logits(window)?)
}

fn log_softmax_rows(logits: &[f32], vocab: usize) -> Vec<f32> {
    let mut out = logits.to_vec();
    for row in out.chunks_mut(vocab) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = m + row.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
        row.iter_mut().for_each(|x| *x -= lse);
    }
    out
}

/// Adds the next-token NLL, KL(reference ‖ this) and top-1 agreement of every position.
fn score(lp: &[f32], ref_lp: &[f32], window: &[u32], vocab: usize, acc: &mut Acc) {
    for t in 0..window.len() - 1 {
        let row = &lp[t * vocab..(t + 1) * vocab];
        let rrow = &ref_lp[t * vocab..(t + 1) * vocab];
        acc.nll -= row[window[t + 1] as usize] as f64;
        acc.kl += rrow
            .iter()
            .zip(row)
            .map(|(&r, &q)| (r.exp() * (r - q)) as f64)
            .sum::<f64>();
        acc.agree += usize::from(argmax(row) == argmax(rrow));
        acc.n += 1;
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
}

/// One table row; bits per element count side information and, for a windowed cache, the f16
/// copies of its sink and recent tokens amortised over the evaluated context `ctx`, averaged
/// over layers when `layers` overrides some of them. A centered cache also pays for its
/// centers (one f32 per head dimension for K and for V), amortised over `ctx` like the window.
fn row<B: Backend>(
    name: &str,
    kv: KvSpec,
    layers: &[(i64, KvDtype)],
    a: &Acc,
    base_ppl: f64,
    ctx: usize,
    loaded: &crate::generate::Loaded<B>,
) -> Row {
    let ppl = (a.nll / a.n as f64).exp();
    let cfg = loaded.model.transformer.config();
    let head_dim = cfg.head_dim;
    let n = cfg.n_layers as i64;
    let bits = (0..n)
        .map(|l| {
            let d = layers
                .iter()
                .rev()
                .find(|(i, _)| (if *i < 0 { n + i } else { *i }) == l)
                .map_or(kv.dtype, |(_, d)| *d);
            let window = if matches!(d, KvDtype::F16 | KvDtype::Bf16) {
                0.0
            } else {
                kv.window.bits_overhead(ctx) + if kv.center { 32.0 / ctx as f64 } else { 0.0 }
            };
            d.bits_per_element(head_dim, kv.key_mode) + window
        })
        .sum::<f64>()
        / n as f64;
    Row {
        kv: name.to_string(),
        bits_per_element: bits,
        kv_bytes_per_token: 2.0 * bits * (cfg.n_layers * cfg.n_kv_heads * head_dim) as f64 / 8.0,
        ppl,
        delta_ppl_pct: 100.0 * (ppl / base_ppl - 1.0),
        kl_vs_bf16: a.kl / a.n as f64,
        top1_agree: a.agree as f64 / a.n as f64,
        tokens: a.n,
    }
}

fn print_table(rows: &[Row], args: &EvalPplArgs) {
    println!("ctx {} × {} windows", args.ctx, args.windows);
    println!(
        "{:>24} {:>9} {:>10} {:>9} {:>8} {:>10} {:>8}",
        "kv", "bits/el", "KV B/tok", "ppl", "Δppl %", "KL", "top-1"
    );
    for r in rows {
        println!(
            "{:>24} {:>9.3} {:>10.0} {:>9.4} {:>+8.2} {:>10.5} {:>7.1}%",
            r.kv,
            r.bits_per_element,
            r.kv_bytes_per_token,
            r.ppl,
            r.delta_ppl_pct,
            r.kl_vs_bf16,
            100.0 * r.top1_agree
        );
    }
}
