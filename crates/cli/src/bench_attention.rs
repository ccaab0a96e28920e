//! `turbokv bench attention`: decode attention alone on the GPU, per KV format, batch and
//! context, against a device copy bandwidth measured in the same run and PyTorch's
//! `scaled_dot_product_attention` on bf16 KV of the same shape (`bench/sdpa_peer.py`, run when
//! `python3` with torch is present).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::kvspec::WindowSpec;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use turbokv_backend::cuda::{
    CudaBackend, CudaOptions, DECODE_VARIANTS, DecodeAttentionCase, DecodeVariant,
};
use turbokv_backend::{AttnGeometry, Backend};
use turbokv_cache::KvWindow;
use turbokv_codec::KvDtype;

use crate::args::BenchAttentionArgs;

/// One measured point.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct AttentionRow {
    /// KV format.
    pub kv: String,
    /// Kernel variant (`default`, or `head_dim/tile/stages/warps`).
    pub variant: String,
    pub batch: usize,
    pub ctx: usize,
    /// Median time of one launch.
    pub ms: f64,
    /// Fastest round.
    pub best_ms: f64,
    /// K and V bytes one launch reads.
    pub kv_gb: f64,
    /// kv bytes / median time.
    pub gb_s: f64,
    /// gb_s over the copy bandwidth of this run.
    pub frac_copy_bw: f64,
    /// Largest |difference| from the default variant's output on the same inputs.
    pub max_diff_vs_default: f64,
    /// The best SDPA backend's time on bf16 KV of this shape, and which.
    pub sdpa_ms: Option<f64>,
    pub sdpa_backend: Option<String>,
    /// ms / sdpa_ms.
    pub ratio_to_sdpa: Option<f64>,
}

impl AttentionRow {
    /// A point measured at `(median, fastest)` seconds a call, reading `kv_bytes`, against
    /// `bandwidth` bytes per second; the peer columns are filled in later.
    fn measured(
        (kv, variant, batch, ctx): (&str, &str, usize, usize),
        (seconds, best): (f64, f64),
        kv_bytes: f64,
        bandwidth: f64,
        max_diff_vs_default: f64,
    ) -> Self {
        let gb_s = kv_bytes / seconds / 1e9;
        AttentionRow {
            kv: kv.to_string(),
            variant: variant.to_string(),
            batch,
            ctx,
            ms: seconds * 1e3,
            best_ms: best * 1e3,
            kv_gb: kv_bytes / 1e9,
            gb_s,
            frac_copy_bw: gb_s * 1e9 / bandwidth,
            max_diff_vs_default,
            sdpa_ms: None,
            sdpa_backend: None,
            ratio_to_sdpa: None,
        }
    }
}

/// The whole run.
#[derive(Serialize, Deserialize, Debug)]
pub struct AttentionReport {
    pub device: String,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Device copy bandwidth (read + write), GB/s; on the CPU, the memory read bandwidth.
    pub copy_bw_gb_s: f64,
    /// Why the peer column is empty, if it is.
    pub peer_note: Option<String>,
    /// Every SDPA backend's figures.
    pub peer: Vec<PeerRow>,
    pub rows: Vec<AttentionRow>,
}

/// One row of `bench/sdpa_peer.py`'s output.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct PeerRow {
    pub batch: usize,
    pub ctx: usize,
    pub backend: String,
    /// Median ms per call, absent when the backend refused the shape.
    pub ms: Option<f64>,
    pub error: Option<String>,
}

/// Parses `8192`, `8k`, `32K`, `1m`.
pub fn parse_count(s: &str) -> Result<usize> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = match t.strip_suffix('k') {
        Some(n) => (n, 1024),
        None => match t.strip_suffix('m') {
            Some(n) => (n, 1024 * 1024),
            None => (t.as_str(), 1),
        },
    };
    let v: usize = num
        .parse()
        .with_context(|| format!("'{s}' is not a count (e.g. 8192, 8k)"))?;
    if v == 0 {
        bail!("'{s}': must be positive");
    }
    Ok(v * mul)
}

fn parse_list(s: &str) -> Result<Vec<usize>> {
    s.split(',').map(parse_count).collect()
}

/// Runs the benchmark and prints the table (and JSON).
pub fn run(args: &BenchAttentionArgs) -> Result<()> {
    if let Some(path) = &args.from_json {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let report: AttentionReport = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a bench attention --json file", path.display()))?;
        print_report(&report);
        if let Some(plot) = &args.plot {
            crate::attention_plot::write_svg(plot, &report)?;
        }
        return Ok(());
    }
    let on_cpu = args.device == "cpu";
    if !on_cpu && !args.device.starts_with("cuda") {
        bail!(
            "bench attention runs on cuda, cuda:N or cpu (got --device '{}')",
            args.device
        );
    }
    let batches = parse_list(&args.batch)?;
    let ctxs = parse_list(&args.ctx)?;
    // Each format as its label, dtype and window (presets and `…@w…s…` carry one; a share
    // of the context is resolved per context below).
    let formats: Vec<(String, KvDtype, WindowSpec)> =
        crate::kvspec::split_list(std::slice::from_ref(&args.kv))
            .iter()
            .map(|s| {
                let spec = crate::kvspec::KvSpec::parse(s, Default::default())?;
                // One layer of one format is timed: a spec's layer overrides (a preset's) are
                // beside the point, but kv heads of other widths would be silently dropped.
                if !spec.heads.is_empty() {
                    bail!(
                        "bench attention times one layer in one format; '{}' gives kv heads \
                         other widths: time it in a model with bench decode --kv",
                        s.trim()
                    );
                }
                let window = if spec.dtype.is_compressed() {
                    spec.window
                } else {
                    WindowSpec::default()
                };
                Ok((s.trim().to_string(), spec.dtype, window))
            })
            .collect::<Result<_>>()?;
    if args.heads == 0 || args.kv_heads == 0 || !args.heads.is_multiple_of(args.kv_heads) {
        bail!(
            "--heads {} must be a positive multiple of --kv-heads {}",
            args.heads,
            args.kv_heads
        );
    }
    let geometry = AttnGeometry {
        n_heads: args.heads,
        n_kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        scale: 1.0 / (args.head_dim as f32).sqrt(),
    };
    if on_cpu {
        let cpu = CpuPoint {
            formats: &formats,
            batches: &batches,
            ctxs: &ctxs,
            geometry,
        };
        return finish(args, run_cpu(args, &cpu)?);
    }
    let base = CudaOptions::default();
    let backend = CudaBackend::from_spec(&args.device)?;
    let copy_bw = backend.copy_bandwidth(1 << 32, 10)?;
    eprintln!(
        "{}: copy bandwidth {:.0} GB/s",
        backend.describe(),
        copy_bw / 1e9
    );
    // (label, options, whether it times compressed formats): the default choice, then (with
    // --compare-variants) each 16-bit instantiation for this head_dim forced for every shape,
    // and the compressed formats on the f16 coded kernels and with f16 value sums.
    let mut configs: Vec<(String, CudaOptions, Option<bool>)> =
        vec![("default".into(), base.clone(), None)];
    if args.compare_variants {
        for v in DECODE_VARIANTS
            .iter()
            .filter(|v| v.head_dim == args.head_dim)
        {
            configs.push((
                variant_label(v),
                CudaOptions {
                    decode_variant: Some(*v),
                    ..base.clone()
                },
                Some(false),
            ));
        }
        configs.push((
            "coded-f16".into(),
            CudaOptions {
                coded_int8_keys: false,
                ..base.clone()
            },
            Some(true),
        ));
        configs.push((
            "coded-f16-values".into(),
            CudaOptions {
                coded_int8_values: false,
                ..base.clone()
            },
            Some(true),
        ));
    }
    if args.wave_splits {
        configs.push((
            "wave-splits".into(),
            CudaOptions {
                sm_load_splits: false,
                ..base.clone()
            },
            Some(true),
        ));
    }
    for &n in &args.exact_split_keys {
        configs.push((
            format!("exact={n}"),
            CudaOptions {
                exact_split_keys: Some(n),
                ..base.clone()
            },
            Some(true),
        ));
    }
    // The split counts run on the default options, and folded too with --fold-exact-splits.
    let mut split_bases = vec![("", base.clone())];
    if args.fold_exact_splits {
        let fold = CudaOptions {
            fold_exact_splits: true,
            ..base.clone()
        };
        configs.push(("fold".into(), fold.clone(), Some(true)));
        split_bases.push((",fold", fold));
    }
    for (tag, opts) in &split_bases {
        for &n in &args.coded_splits {
            configs.push((
                format!("splits={n}{tag}"),
                CudaOptions {
                    coded_splits: Some(n),
                    ..opts.clone()
                },
                Some(true),
            ));
        }
    }
    let mut rows = Vec::new();
    // The default configuration's output per point (it runs first), to check the variants on
    // the same inputs.
    let mut default_out: HashMap<(String, usize, usize), Vec<f32>> = HashMap::new();
    for (label, opts, compressed) in &configs {
        let b = if label == "default" {
            None
        } else {
            Some(CudaBackend::with_options(
                turbokv_backend::cuda::parse_device(&args.device).unwrap_or(0),
                opts,
            )?)
        };
        let be = b.as_ref().unwrap_or(&backend);
        for (name, dtype, window) in &formats {
            let (dtype, window) = (*dtype, *window);
            if compressed.is_some_and(|c| c != dtype.is_compressed()) {
                continue;
            }
            for &batch in &batches {
                for &ctx in &ctxs {
                    let case = attention_case(args, geometry, dtype, window.at(ctx), batch, ctx);
                    let t = match be.time_decode_attention(&case) {
                        Ok(t) => t,
                        Err(e) => {
                            eprintln!("{label} {name} batch {batch} ctx {ctx}: skipped: {e}");
                            continue;
                        }
                    };
                    let max_diff =
                        diff_vs_default(&mut default_out, label, (name, batch, ctx), t.output);
                    let row = AttentionRow::measured(
                        (name, label, batch, ctx),
                        (t.seconds, t.best_seconds),
                        t.kv_bytes,
                        copy_bw,
                        max_diff,
                    );
                    eprintln!(
                        "{label} {name} b{batch} ctx{ctx}: {:.4} ms, {:.0} GB/s ({} caches)",
                        row.ms, row.gb_s, t.pools
                    );
                    rows.push(row);
                }
            }
        }
    }
    drop(backend);
    let (peer, peer_note) = if args.no_peer {
        (Vec::new(), Some("--no-peer".to_string()))
    } else {
        match run_peer(args, &batches, &ctxs) {
            Ok(p) => (p, None),
            Err(e) => (Vec::new(), Some(format!("{e:#}"))),
        }
    };
    for r in &mut rows {
        let best = peer
            .iter()
            .filter(|p| p.batch == r.batch && p.ctx == r.ctx)
            .filter_map(|p| p.ms.map(|ms| (ms, p.backend.clone())))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        if let Some((ms, name)) = best {
            r.sdpa_ms = Some(ms);
            r.sdpa_backend = Some(name);
            r.ratio_to_sdpa = Some(r.ms / ms);
        }
    }
    finish(
        args,
        AttentionReport {
            device: args.device.clone(),
            heads: args.heads,
            kv_heads: args.kv_heads,
            head_dim: args.head_dim,
            block_size: args.block_size,
            copy_bw_gb_s: copy_bw / 1e9,
            peer_note,
            peer,
            rows,
        },
    )
}

/// Prints the report, and writes its plot and JSON where asked.
fn finish(args: &BenchAttentionArgs, report: AttentionReport) -> Result<()> {
    print_report(&report);
    if let Some(plot) = &args.plot {
        crate::attention_plot::write_svg(plot, &report)?;
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// What the CPU run measures: every format at every batch and context.
struct CpuPoint<'a> {
    formats: &'a [(String, KvDtype, WindowSpec)],
    batches: &'a [usize],
    ctxs: &'a [usize],
    geometry: AttnGeometry,
}

/// `--device cpu`: the CPU backend's decode attention on the command's thread pool, against
/// the memory read bandwidth of the same threads (there is no peer).
fn run_cpu(args: &BenchAttentionArgs, p: &CpuPoint<'_>) -> Result<AttentionReport> {
    use crate::bench_attention_cpu as cpu;
    let (device, read_bw) = (cpu::describe(), cpu::read_bandwidth());
    eprintln!("{device}: memory read bandwidth {:.1} GB/s", read_bw / 1e9);
    let base = crate::env_options::from_env()?.cpu;
    let mut rows = Vec::new();
    let mut default_out: HashMap<(String, usize, usize), Vec<f32>> = HashMap::new();
    for (label, backend, compressed) in cpu::configs(base, args.compare_variants) {
        let formats: Vec<_> = p
            .formats
            .iter()
            .filter(|(_, dtype, _)| compressed.is_none_or(|c| c == dtype.is_compressed()))
            .collect();
        for &batch in p.batches {
            for &ctx in p.ctxs {
                // Every format of the point filled first, then timed in alternating rounds.
                let mut prepared = Vec::with_capacity(formats.len());
                for (name, dtype, window) in &formats {
                    let case = attention_case(args, p.geometry, *dtype, window.at(ctx), batch, ctx);
                    let what = || format!("{label} {name} batch {batch} ctx {ctx}");
                    prepared.push(cpu::Prepared::new(&backend, &case).with_context(what)?);
                }
                let mut times = vec![Vec::with_capacity(args.rounds); prepared.len()];
                // Each round starts at the next format, so that none always follows the same.
                let n = prepared.len();
                for round in 0..args.rounds.max(1) {
                    for i in (0..n).map(|i| (i + round) % n) {
                        times[i].push(prepared[i].round(&backend)?);
                    }
                }
                for (((name, _, _), prep), mut t) in formats.iter().zip(prepared).zip(times) {
                    t.sort_by(f64::total_cmp);
                    let (seconds, best) = (t[t.len() / 2], t[0]);
                    let max_diff =
                        diff_vs_default(&mut default_out, &label, (name, batch, ctx), prep.output);
                    let row = AttentionRow::measured(
                        (name, &label, batch, ctx),
                        (seconds, best),
                        prep.kv_bytes,
                        read_bw,
                        max_diff,
                    );
                    eprintln!(
                        "{label} {name} b{batch} ctx{ctx}: {:.4} ms, {:.1} GB/s ({} copies)",
                        row.ms, row.gb_s, prep.copies
                    );
                    rows.push(row);
                }
            }
        }
    }
    Ok(AttentionReport {
        device,
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        block_size: args.block_size,
        copy_bw_gb_s: read_bw / 1e9,
        peer_note: Some("no peer on the CPU; copy_bw_gb_s is the memory read bandwidth".into()),
        peer: Vec::new(),
        rows,
    })
}

/// The case `bench attention` times at one point, with the seed that gives every
/// configuration of the point the same cache and queries.
fn attention_case(
    args: &BenchAttentionArgs,
    geometry: AttnGeometry,
    dtype: KvDtype,
    window: KvWindow,
    batch: usize,
    ctx: usize,
) -> DecodeAttentionCase {
    DecodeAttentionCase {
        geometry,
        dtype,
        window,
        batch,
        ctx,
        block_size: args.block_size,
        shuffled_blocks: !args.contiguous_blocks,
        rounds: args.rounds,
        seed: 7 + batch as u64 * 1_000_003 + ctx as u64,
    }
}

/// The default configuration's output of a point is kept (it runs first, so 0 is its own
/// difference); another configuration's is compared with it.
fn diff_vs_default(
    default_out: &mut HashMap<(String, usize, usize), Vec<f32>>,
    label: &str,
    (name, batch, ctx): (&str, usize, usize),
    output: Vec<f32>,
) -> f64 {
    let key = (name.to_string(), batch, ctx);
    if label == "default" {
        default_out.insert(key, output);
        0.0
    } else {
        default_out
            .get(&key)
            .map_or(f64::NAN, |r| max_abs_diff(r, &output))
    }
}

fn variant_label(v: &DecodeVariant) -> String {
    format!("{}/{}/{}/{}", v.head_dim, v.tile, v.stages, v.warps)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let d = (x - y).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                f64::from(d)
            }
        })
        .fold(0.0, f64::max)
}

/// Runs `bench/sdpa_peer.py` (relative to the working directory unless `--peer-script`).
fn run_peer(args: &BenchAttentionArgs, batches: &[usize], ctxs: &[usize]) -> Result<Vec<PeerRow>> {
    let script = args
        .peer_script
        .clone()
        .unwrap_or_else(|| PathBuf::from("bench/sdpa_peer.py"));
    if !script.exists() {
        bail!(
            "peer skipped: {} not found (run from the repository root)",
            script.display()
        );
    }
    let out = std::env::temp_dir().join(format!("turbokv-sdpa-{}.json", std::process::id()));
    let join = |v: &[usize]| {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    eprintln!("running the SDPA peer ({})", script.display());
    let status = Command::new(&args.python)
        .arg(&script)
        .args(["--batch", &join(batches), "--ctx", &join(ctxs)])
        .args(["--heads", &args.heads.to_string()])
        .args(["--kv-heads", &args.kv_heads.to_string()])
        .args(["--head-dim", &args.head_dim.to_string()])
        .args(["--rounds", &args.rounds.to_string()])
        .arg("--json")
        .arg(&out)
        .status()
        .with_context(|| format!("peer skipped: cannot start {}", args.python))?;
    if !status.success() {
        bail!("peer skipped: {} exited with {status}", script.display());
    }
    read_peer(&out)
}

fn read_peer(path: &Path) -> Result<Vec<PeerRow>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let _ = std::fs::remove_file(path);
    serde_json::from_str(&text).context("parsing the peer's JSON")
}

fn print_report(r: &AttentionReport) {
    println!(
        "decode attention, {} heads / {} kv heads × {}, block {} | copy bandwidth {:.0} GB/s{}",
        r.heads,
        r.kv_heads,
        r.head_dim,
        r.block_size,
        r.copy_bw_gb_s,
        r.peer_note
            .as_ref()
            .map(|n| format!(" | no peer: {n}"))
            .unwrap_or_default()
    );
    println!(
        "{:<6} {:<14} {:>5} {:>7} {:>9} {:>8} {:>6} {:>10} {:>9} {:>7} {:>9}",
        "kv",
        "variant",
        "batch",
        "ctx",
        "ms",
        "GB/s",
        "%copy",
        "sdpa ms",
        "backend",
        "ratio",
        "maxdiff"
    );
    for x in &r.rows {
        println!(
            "{:<6} {:<14} {:>5} {:>7} {:>9.4} {:>8.0} {:>5.0}% {:>10} {:>9} {:>7} {:>9.1e}",
            x.kv,
            x.variant,
            x.batch,
            x.ctx,
            x.ms,
            x.gb_s,
            100.0 * x.frac_copy_bw,
            x.sdpa_ms
                .map(|m| format!("{m:.4}"))
                .unwrap_or_else(|| "-".into()),
            x.sdpa_backend.clone().unwrap_or_else(|| "-".into()),
            x.ratio_to_sdpa
                .map(|m| format!("{m:.2}x"))
                .unwrap_or_else(|| "-".into()),
            x.max_diff_vs_default
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_suffixes() {
        assert_eq!(parse_count("8192").unwrap(), 8192);
        assert_eq!(parse_count("8k").unwrap(), 8192);
        assert_eq!(parse_count("128K").unwrap(), 131072);
        assert_eq!(parse_count("1m").unwrap(), 1 << 20);
        assert!(parse_count("0").is_err());
        assert!(parse_count("x").is_err());
        assert_eq!(parse_list("1,8,32").unwrap(), vec![1, 8, 32]);
    }

    #[test]
    fn peer_rows_parse_with_refusals() {
        let dir = std::env::temp_dir().join(format!("tkv-peer-{}", std::process::id()));
        std::fs::write(
            &dir,
            r#"[{"batch":1,"ctx":8192,"backend":"cudnn","ms":0.05,"error":null},
                {"batch":1,"ctx":8192,"backend":"flash","ms":null,"error":"no kernel"}]"#,
        )
        .unwrap();
        let rows = read_peer(&dir).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].ms, Some(0.05));
        assert!(rows[1].ms.is_none());
        assert!(!dir.exists(), "the peer's file is removed after reading");
    }
}
