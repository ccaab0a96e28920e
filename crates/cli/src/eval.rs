//! `turbokv eval ppl`: perplexity, KL divergence and top-1 agreement against a bf16 KV cache,
//! for several KV dtypes over the same windows of text.

use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};
use turbokv_backend::Backend;
use turbokv_codec::KvDtype;
use turbokv_model::Session;

use crate::args::{EvalPplArgs, cache_dir};
use crate::generate::load;
use crate::kvspec::{KvDefaults, KvSpec, build_policy};
use turbokv_cache::{KvPolicy, KvWindow};

#[derive(Serialize, Deserialize, Clone, Debug)]
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
pub(crate) struct Acc {
    pub(crate) nll: f64,
    pub(crate) kl: f64,
    pub(crate) agree: usize,
    pub(crate) n: usize,
}

/// Runs the evaluation (or, with `--from-json`, reports saved runs again).
pub fn run(args: &EvalPplArgs) -> Result<()> {
    if !args.from_json.is_empty() {
        return report_saved(args);
    }
    crate::with_device!(&args.model.device, b => run_on(b, args))
}

/// A saved `--json` document: what [`report`] needs of it.
#[derive(Deserialize)]
struct Saved {
    model: String,
    ctx: usize,
    windows: usize,
    texts: Vec<TextResult>,
}

/// The tables, worst case, `--json` and `--plot` of earlier runs' `--json` files, whose texts
/// are put side by side (e.g. one run per text). Files that hold the same text (by name) add
/// their caches to its rows (e.g. a later run of more caches; a cache already there is not
/// repeated). Every run must have the same model, context and windows, and every text must
/// end up with the same caches in the same order.
fn report_saved(args: &EvalPplArgs) -> Result<()> {
    let mut results: Vec<TextResult> = Vec::new();
    let mut shape: Option<(String, usize, usize)> = None;
    for path in &args.from_json {
        let doc: Saved = serde_json::from_str(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("{}: not an `eval ppl --json` file", path.display()))?;
        let this = (doc.model.clone(), doc.ctx, doc.windows);
        match &shape {
            None => shape = Some(this),
            Some(s) => ensure!(
                *s == this,
                "{} was run with another model, context or window count than the first file",
                path.display(),
            ),
        }
        for t in doc.texts {
            match results.iter_mut().find(|r| r.name == t.name) {
                Some(r) => {
                    for row in t.rows {
                        if !r.rows.iter().any(|x| x.kv == row.kv) {
                            r.rows.push(row);
                        }
                    }
                }
                None => results.push(t),
            }
        }
    }
    let Some((model, ctx, windows)) = shape else {
        bail!("--from-json: the files hold no texts");
    };
    if let Some(first) = results.first() {
        let kvs = |r: &TextResult| r.rows.iter().map(|x| x.kv.clone()).collect::<Vec<_>>();
        for r in &results[1..] {
            ensure!(
                kvs(r) == kvs(first),
                "text {} has other caches than text {} ({:?} vs {:?}): give every text the same \
                 runs",
                r.name,
                first.name,
                kvs(r),
                kvs(first)
            );
        }
    }
    report(&model, ctx, windows, &results, args)
}

fn run_on<B: Backend>(backend: B, args: &EvalPplArgs) -> Result<()> {
    ensure!(
        args.decode_last < args.ctx,
        "--decode-last {} must leave at least one token of the --ctx {} window to prefill",
        args.decode_last,
        args.ctx
    );
    let cache = crate::args::CacheArgs::plain("bf16", Some(args.ctx));
    let default_window = KvWindow {
        recent: args.kv_window,
        sinks: args.kv_sinks,
        ..Default::default()
    };
    let defaults = KvDefaults::from_args(&args.kv_opts, default_window);
    let layers = KvPolicy::parse_layers(&args.kv_layers).context("--kv-layers")?;
    // `--kv-layers` overrides every entry: its labels say so, as a spec's own overrides do.
    let extra: String = layers.iter().map(|(l, d)| format!(" [{l}:{d}]")).collect();
    let specs: Vec<(String, KvSpec)> = crate::kvspec::split_list(&args.kv)
        .iter()
        .map(|s| Ok(KvSpec::parse(s, defaults).map(|k| (k.label(s), k))?))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        // The bf16 baseline row is always there.
        .filter(|(label, _)| label != "bf16")
        .map(|(label, k)| (format!("{label}{extra}"), k))
        .collect();
    let texts = read_texts(&args.text)?;
    for text in &texts {
        if let Some(passage) = turbokv_model::calibrate::calibration_passage_in(&text.body) {
            bail!(
                "{} contains calibration text of the KV cache or of `eval sensitivity` \
                 (\"{passage}…\"); evaluate on text the calibration has not seen",
                text.path.display()
            );
        }
    }
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
                (args.ctx, &layers),
                &mut calibration,
            )?;
            Ok((label, k, policy))
        })
        .collect::<Result<_>>()?;
    if args.decode_last > 0 {
        println!(
            "the last {} tokens of each window are scored through decode steps",
            args.decode_last
        );
    }
    let need = args.ctx * args.windows;
    let mut domains = Vec::with_capacity(texts.len());
    for text in texts {
        // Tokenize only as much text as the windows need (~4 characters per token, with margin).
        let ids = loaded.tokenizer.encode(
            &text.body[..floor_char(&text.body, need * 8)],
            false,
            false,
        )?;
        ensure!(
            ids.len() >= need,
            "{} holds {} tokens; {} windows of {} need {need}",
            text.path.display(),
            ids.len(),
            args.windows,
            args.ctx
        );
        domains.push((text, ids));
    }
    let vocab = loaded.model.transformer.config().vocab_size;
    let bar =
        indicatif::ProgressBar::new((domains.len() * args.windows * (dtypes.len() + 1)) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "eval {bar:30} {pos}/{len} text×window×dtype {elapsed}/{eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let bf16 = KvSpec::parse("bf16", KvDefaults::default())?;
    let mut results = Vec::with_capacity(domains.len());
    let mut token_reports = String::new();
    for (text, ids) in &domains {
        let mut base = Acc::default();
        let mut accs = vec![Acc::default(); dtypes.len()];
        let mut losses = vec![Vec::new(); dtypes.len()];
        for w in 0..args.windows {
            let window = &ids[w * args.ctx..(w + 1) * args.ctx];
            let reference = window_logits(
                &loaded,
                KvDtype::Bf16,
                &KvPolicy::default(),
                window,
                args.decode_last,
            )?;
            let ref_lp = log_softmax_rows(&reference, vocab);
            drop(reference);
            score(&ref_lp, &ref_lp, window, vocab, &mut base);
            bar.inc(1);
            for (((_, d, policy), acc), loss) in dtypes.iter().zip(&mut accs).zip(&mut losses) {
                let logits = window_logits(&loaded, d.dtype, policy, window, args.decode_last)?;
                let lp = log_softmax_rows(&logits, vocab);
                score(&lp, &ref_lp, window, vocab, acc);
                if args.token_report > 0 {
                    loss.extend(crate::eval_tokens::token_losses(
                        &lp,
                        &ref_lp,
                        window,
                        vocab,
                        w * args.ctx,
                    ));
                }
                bar.inc(1);
            }
        }
        if args.token_report > 0 {
            let text_of = |ids: &[u32]| loaded.tokenizer.decode(ids, false);
            for ((name, _, _), loss) in dtypes.iter().zip(&losses) {
                token_reports.push_str(&format!(
                    "{} · {name}: which tokens carry the loss\n{}",
                    text.name,
                    crate::eval_tokens::report(loss, ids, args.ctx, args.token_report, &text_of)
                ));
            }
        }
        let base_ppl = (base.nll / base.n as f64).exp();
        let mut rows = vec![row("bf16", &bf16, &[], &base, base_ppl, args.ctx, &loaded)];
        rows.extend(
            dtypes
                .iter()
                .zip(&accs)
                .map(|((name, d, _), a)| row(name, d, &layers, a, base_ppl, args.ctx, &loaded)),
        );
        results.push(TextResult {
            name: text.name.clone(),
            path: text.path.display().to_string(),
            rows,
        });
    }
    bar.finish_and_clear();
    print!("{token_reports}");
    report(&loaded.model.name, args.ctx, args.windows, &results, args)
}

/// Prints every text's table and the worst case, and writes `--plot` and `--json`.
fn report(
    model: &str,
    ctx: usize,
    windows: usize,
    results: &[TextResult],
    args: &EvalPplArgs,
) -> Result<()> {
    for r in results {
        print_table(&format!("{}: ", r.name), &r.rows, ctx, windows);
    }
    let worst = worst_case(results);
    if results.len() > 1 {
        print_worst(&worst, results.len(), ctx, windows);
    }
    if let Some(path) = &args.plot {
        let title = format!("{model}: KV cache quality, ctx {ctx} × {windows} windows");
        crate::plot::write_svg(path, &title, &plot_series(results))?;
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "model": model, "ctx": ctx, "windows": windows,
            "texts": results, "worst": worst,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One evaluation text: its name in tables (the file stem), where it came from, its content.
#[derive(Debug)]
struct EvalText {
    name: String,
    path: PathBuf,
    body: String,
}

/// The rows of one text.
#[derive(Serialize, Deserialize, Debug)]
struct TextResult {
    name: String,
    path: String,
    rows: Vec<Row>,
}

/// One KV cache's worst figures over the texts, each with the text it came from.
#[derive(Serialize, Clone, Debug, PartialEq)]
struct WorstRow {
    kv: String,
    bits_per_element: f64,
    delta_ppl_pct: f64,
    delta_ppl_text: String,
    kl_vs_bf16: f64,
    kl_text: String,
    top1_agree: f64,
    top1_text: String,
}

/// The evaluation texts named by `--text` (files, or directories of `*.txt` files in name
/// order); none given means the evaluation set `scripts/fetch-assets.sh` builds.
fn read_texts(given: &[PathBuf]) -> Result<Vec<EvalText>> {
    let default = [cache_dir().join("data/eval")];
    let given = if given.is_empty() {
        &default[..]
    } else {
        given
    };
    let mut files = Vec::new();
    for path in given {
        if path.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("listing {}", path.display()))?
                .map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<Vec<_>>>()
                .with_context(|| format!("listing {}", path.display()))?
                .into_iter()
                .filter(|p| p.extension().is_some_and(|e| e == "txt"))
                .collect();
            ensure!(
                !found.is_empty(),
                "{} holds no .txt files to evaluate on",
                path.display()
            );
            found.sort();
            files.extend(found);
        } else {
            files.push(path.clone());
        }
    }
    let mut texts: Vec<EvalText> = Vec::with_capacity(files.len());
    for path in files {
        let body = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading evaluation text {} (run scripts/fetch-assets.sh)",
                path.display()
            )
        })?;
        let stem = path.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into(),
        );
        // Two texts of one name (from different directories) are told apart by their paths.
        let name = if texts.iter().any(|t| t.name == stem) {
            path.display().to_string()
        } else {
            stem
        };
        texts.push(EvalText { name, path, body });
    }
    Ok(texts)
}

/// The plot's series: per text, every row as (bits, ppl / bf16 ppl, KL).
fn plot_series(results: &[TextResult]) -> Vec<crate::plot::Series> {
    results
        .iter()
        .map(|r| crate::plot::Series {
            text: r.name.clone(),
            points: r
                .rows
                .iter()
                .map(|row| crate::plot::Point {
                    kv: row.kv.clone(),
                    bits: row.bits_per_element,
                    ppl_ratio: 1.0 + row.delta_ppl_pct / 100.0,
                    kl: row.kl_vs_bf16,
                })
                .collect(),
        })
        .collect()
}

/// Per KV cache (same order as every text's rows), the largest Δppl and KL and the lowest
/// top-1 agreement over `results`.
fn worst_case(results: &[TextResult]) -> Vec<WorstRow> {
    let Some(first) = results.first() else {
        return Vec::new();
    };
    (0..first.rows.len())
        .map(|i| {
            let pick = |better: fn(f64, f64) -> bool, of: fn(&Row) -> f64| {
                results
                    .iter()
                    .map(|r| (of(&r.rows[i]), r.name.clone()))
                    .reduce(|a, b| if better(b.0, a.0) { b } else { a })
                    .unwrap_or_default()
            };
            let (delta_ppl_pct, delta_ppl_text) = pick(|b, a| b > a, |r| r.delta_ppl_pct);
            let (kl_vs_bf16, kl_text) = pick(|b, a| b > a, |r| r.kl_vs_bf16);
            let (top1_agree, top1_text) = pick(|b, a| b < a, |r| r.top1_agree);
            WorstRow {
                kv: first.rows[i].kv.clone(),
                bits_per_element: first.rows[i].bits_per_element,
                delta_ppl_pct,
                delta_ppl_text,
                kl_vs_bf16,
                kl_text,
                top1_agree,
                top1_text,
            }
        })
        .collect()
}

fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The next-token logits of every position of `window`: its first `len − decode_last` tokens
/// prefilled, the rest appended one decode step at a time.
pub(crate) fn window_logits<B: Backend>(
    loaded: &crate::generate::Loaded<B>,
    dtype: KvDtype,
    policy: &KvPolicy,
    window: &[u32],
    decode_last: usize,
) -> Result<Vec<f32>> {
    let mut session = Session::with_policy(&loaded.model.transformer, dtype, policy, window.len())?;
    let (head, tail) = window.split_at(window.len() - decode_last.min(window.len()));
    let mut all = session.prefill_all_logits(head)?;
    for &t in tail {
        all.extend_from_slice(session.step(t)?);
    }
    Ok(all)
}

pub(crate) fn log_softmax_rows(logits: &[f32], vocab: usize) -> Vec<f32> {
    let mut out = logits.to_vec();
    for row in out.chunks_mut(vocab) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = m + row.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
        row.iter_mut().for_each(|x| *x -= lse);
    }
    out
}

/// Adds the next-token NLL, KL(reference ‖ this) and top-1 agreement of every position.
pub(crate) fn score(lp: &[f32], ref_lp: &[f32], window: &[u32], vocab: usize, acc: &mut Acc) {
    for t in 0..window.len() - 1 {
        let row = &lp[t * vocab..(t + 1) * vocab];
        let rrow = &ref_lp[t * vocab..(t + 1) * vocab];
        acc.nll -= row[window[t + 1] as usize] as f64;
        acc.kl += kl_row(rrow, row);
        acc.agree += usize::from(argmax(row) == argmax(rrow));
        acc.n += 1;
    }
}

/// KL(reference ‖ this) of one next-token distribution, both as log-probabilities.
pub(crate) fn kl_row(ref_lp: &[f32], lp: &[f32]) -> f64 {
    ref_lp
        .iter()
        .zip(lp)
        .map(|(&r, &q)| f64::from(r.exp() * (r - q)))
        .sum()
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
    kv: &KvSpec,
    layers: &[(i64, KvDtype)],
    a: &Acc,
    base_ppl: f64,
    ctx: usize,
    loaded: &crate::generate::Loaded<B>,
) -> Row {
    let ppl = (a.nll / a.n as f64).exp();
    let cfg = loaded.model.transformer.config();
    let head_dim = cfg.head_dim;
    // Layers with a KV cache only (LFM2's conv layers have none).
    let bits = kv.bits_per_element((head_dim, cfg.n_kv_heads), ctx, cfg.kv_layers(), layers);
    Row {
        kv: name.to_string(),
        bits_per_element: bits,
        kv_bytes_per_token: 2.0 * bits * (cfg.kv_layers() * cfg.n_kv_heads * head_dim) as f64 / 8.0,
        ppl,
        delta_ppl_pct: 100.0 * (ppl / base_ppl - 1.0),
        kl_vs_bf16: a.kl / a.n as f64,
        top1_agree: a.agree as f64 / a.n as f64,
        tokens: a.n,
    }
}

fn print_table(prefix: &str, rows: &[Row], ctx: usize, windows: usize) {
    println!("{prefix}ctx {ctx} × {windows} windows");
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

fn print_worst(rows: &[WorstRow], texts: usize, ctx: usize, windows: usize) {
    println!("worst of {texts} texts: ctx {ctx} × {windows} windows");
    println!(
        "{:>24} {:>9} {:>8} {:>10} {:>10} {:>10} {:>8} {:>10}",
        "kv", "bits/el", "Δppl %", "on", "KL", "on", "top-1", "on"
    );
    for r in rows {
        println!(
            "{:>24} {:>9.3} {:>+8.2} {:>10} {:>10.5} {:>10} {:>7.1}% {:>10}",
            r.kv,
            r.bits_per_element,
            r.delta_ppl_pct,
            r.delta_ppl_text,
            r.kl_vs_bf16,
            r.kl_text,
            100.0 * r.top1_agree,
            r.top1_text
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("turbokv-eval-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_directory_is_its_txt_files_in_name_order_and_files_come_as_given() {
        let d = scratch_dir("dir");
        for (f, body) in [("b.txt", "bee"), ("a.txt", "ay"), ("notes.md", "skip")] {
            std::fs::write(d.join(f), body).unwrap();
        }
        let other = scratch_dir("other");
        std::fs::write(other.join("a.txt"), "second a").unwrap();
        let texts = read_texts(&[d.clone(), other.join("a.txt")]).unwrap();
        let names: Vec<&str> = texts.iter().map(|t| t.name.as_str()).collect();
        let second_a = other.join("a.txt").display().to_string();
        assert_eq!(names, ["a", "b", second_a.as_str()]);
        assert_eq!(texts[1].body, "bee");
        assert_eq!(texts[2].body, "second a");
    }

    #[test]
    fn a_missing_text_or_an_empty_directory_is_an_error_naming_it() {
        let d = scratch_dir("empty");
        let err = read_texts(std::slice::from_ref(&d)).unwrap_err();
        assert!(format!("{err:#}").contains("no .txt files"), "{err:#}");
        let missing = d.join("absent.txt");
        let err = format!("{:#}", read_texts(&[missing]).unwrap_err());
        assert!(
            err.contains("absent.txt") && err.contains("fetch-assets"),
            "{err}"
        );
    }

    fn r(kv: &str, delta: f64, kl: f64, top1: f64) -> Row {
        Row {
            kv: kv.into(),
            bits_per_element: 3.5,
            kv_bytes_per_token: 0.0,
            ppl: 0.0,
            delta_ppl_pct: delta,
            kl_vs_bf16: kl,
            top1_agree: top1,
            tokens: 1,
        }
    }

    fn eval_args(args: &[&str]) -> EvalPplArgs {
        use clap::Parser;
        let cli = crate::args::Cli::try_parse_from(
            ["turbokv", "eval", "ppl"]
                .into_iter()
                .chain(args.iter().copied()),
        )
        .unwrap();
        match cli.command {
            crate::args::Command::Eval(crate::args::EvalCommand::Ppl(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    fn saved(dir: &std::path::Path, name: &str, ctx: usize, rows: Vec<Row>) -> PathBuf {
        let path = dir.join(format!("{name}.json"));
        let doc = serde_json::json!({
            "model": "demo", "ctx": ctx, "windows": 4,
            "texts": [TextResult { name: name.into(), path: String::new(), rows }],
        });
        std::fs::write(&path, doc.to_string()).unwrap();
        path
    }

    #[test]
    fn saved_runs_are_reported_side_by_side_with_their_worst_case() {
        let d = scratch_dir("saved");
        let a = saved(&d, "wiki", 1024, vec![r("tq3", 2.0, 0.05, 0.9)]);
        let b = saved(&d, "code", 1024, vec![r("tq3", 3.0, 0.04, 0.8)]);
        let (out, svg) = (d.join("all.json"), d.join("all.svg"));
        let list = format!("{},{}", a.display(), b.display());
        let args = eval_args(&[
            "--from-json",
            &list,
            "--json",
            out.to_str().unwrap(),
            "--plot",
            svg.to_str().unwrap(),
        ]);
        run(&args).unwrap();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(doc["texts"].as_array().unwrap().len(), 2);
        assert_eq!(doc["worst"][0]["delta_ppl_pct"], 3.0);
        assert_eq!(doc["worst"][0]["delta_ppl_text"], "code");
        assert_eq!(doc["worst"][0]["kl_text"], "wiki");
        assert!(std::fs::read_to_string(&svg).unwrap().contains("code"));
        // Runs of another context or other caches do not go side by side.
        let c = saved(&d, "dialogue", 512, vec![r("tq3", 1.0, 0.01, 0.9)]);
        let list = format!("{},{}", a.display(), c.display());
        let err = run(&eval_args(&["--from-json", &list])).unwrap_err();
        assert!(format!("{err:#}").contains("dialogue"), "{err:#}");
        let e = saved(&d, "other", 1024, vec![r("tq4", 1.0, 0.01, 0.9)]);
        let list = format!("{},{}", a.display(), e.display());
        assert!(run(&eval_args(&["--from-json", &list])).is_err());
        // A second run of a text adds its caches to that text's rows, once each.
        let d2 = scratch_dir("saved-more");
        let more_wiki = saved(
            &d2,
            "wiki",
            1024,
            vec![r("tq3", 9.0, 0.9, 0.1), r("tq4", 1.0, 0.01, 0.9)],
        );
        let more_code = saved(&d2, "code", 1024, vec![r("tq4", 1.5, 0.02, 0.9)]);
        let list = [&a, &b, &more_wiki, &more_code]
            .map(|p| p.display().to_string())
            .join(",");
        run(&eval_args(&[
            "--from-json",
            &list,
            "--json",
            out.to_str().unwrap(),
        ]))
        .unwrap();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let wiki = &doc["texts"][0]["rows"];
        assert_eq!(wiki.as_array().unwrap().len(), 2);
        assert_eq!(wiki[0]["delta_ppl_pct"], 2.0, "the first run's row is kept");
        assert_eq!(doc["worst"][1]["delta_ppl_pct"], 1.5);
        // ... but only when every text then has the same caches.
        let list = [&a, &b, &more_wiki]
            .map(|p| p.display().to_string())
            .join(",");
        let err = run(&eval_args(&["--from-json", &list])).unwrap_err();
        assert!(format!("{err:#}").contains("other caches"), "{err:#}");
    }

    #[test]
    fn the_worst_case_takes_each_figure_from_the_text_where_it_is_worst() {
        let results = [
            TextResult {
                name: "wiki".into(),
                path: String::new(),
                rows: vec![r("tq3", 2.0, 0.05, 0.90), r("int8", 0.1, 0.004, 0.96)],
            },
            TextResult {
                name: "code".into(),
                path: String::new(),
                rows: vec![r("tq3", 3.0, 0.04, 0.85), r("int8", 0.3, 0.003, 0.97)],
            },
        ];
        let w = worst_case(&results);
        assert_eq!(w.len(), 2);
        assert_eq!(
            (w[0].delta_ppl_pct, w[0].delta_ppl_text.as_str()),
            (3.0, "code")
        );
        assert_eq!((w[0].kl_vs_bf16, w[0].kl_text.as_str()), (0.05, "wiki"));
        assert_eq!((w[0].top1_agree, w[0].top1_text.as_str()), (0.85, "code"));
        assert_eq!((w[1].kl_vs_bf16, w[1].kl_text.as_str()), (0.004, "wiki"));
        assert_eq!((w[1].top1_agree, w[1].top1_text.as_str()), (0.96, "wiki"));
        assert!(worst_case(&[]).is_empty());
    }
}
