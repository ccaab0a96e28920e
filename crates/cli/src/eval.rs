//! `turbokv eval ppl`: perplexity, KL divergence and top-1 agreement against a bf16 KV cache,
//! for several KV dtypes over the same windows of text.

use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use serde::Serialize;
use turbokv_backend::Backend;
use turbokv_codec::{KeyMode, KvDtype};
use turbokv_model::Session;

use crate::args::{EvalPplArgs, cache_dir};
use crate::generate::load;

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
    let cache = crate::args::CacheArgs {
        kv: "bf16".into(),
        ctx: Some(args.ctx),
    };
    let loaded = load(backend, &args.model, &cache)?;
    let dtypes: Vec<KvDtype> = args
        .kv
        .iter()
        .map(|s| s.parse().map_err(|e| anyhow::anyhow!("--kv {s}: {e}")))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .filter(|d| *d != KvDtype::Bf16) // the baseline row is always there
        .collect();
    let head_dim = loaded.model.transformer.config().head_dim;
    for d in &dtypes {
        loaded
            .model
            .transformer
            .backend()
            .check_kv_dtype(*d, head_dim)?;
    }
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
        let reference = window_logits(&loaded, KvDtype::Bf16, window)?;
        let ref_lp = log_softmax_rows(&reference, vocab);
        drop(reference);
        score(&ref_lp, &ref_lp, window, vocab, &mut base);
        bar.inc(1);
        for (d, acc) in dtypes.iter().zip(&mut accs) {
            let lp = log_softmax_rows(&window_logits(&loaded, *d, window)?, vocab);
            score(&lp, &ref_lp, window, vocab, acc);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let base_ppl = (base.nll / base.n as f64).exp();
    let mut rows = vec![row(KvDtype::Bf16, &base, base_ppl, head_dim, &loaded)];
    rows.extend(
        dtypes
            .iter()
            .zip(&accs)
            .map(|(d, a)| row(*d, a, base_ppl, head_dim, &loaded)),
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
    kv: KvDtype,
    window: &[u32],
) -> Result<Vec<f32>> {
    let mut session = Session::new(&loaded.model.transformer, kv, window.len())?;
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

fn row<B: Backend>(
    kv: KvDtype,
    a: &Acc,
    base_ppl: f64,
    head_dim: usize,
    loaded: &crate::generate::Loaded<B>,
) -> Row {
    let ppl = (a.nll / a.n as f64).exp();
    let cfg = loaded.model.transformer.config();
    let bits = kv.bits_per_element(head_dim, KeyMode::Mse);
    Row {
        kv: kv.to_string(),
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
        "{:>10} {:>9} {:>10} {:>9} {:>8} {:>10} {:>8}",
        "kv", "bits/el", "KV B/tok", "ppl", "Δppl %", "KL", "top-1"
    );
    for r in rows {
        println!(
            "{:>10} {:>9.3} {:>10.0} {:>9.4} {:>+8.2} {:>10.5} {:>7.1}%",
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
