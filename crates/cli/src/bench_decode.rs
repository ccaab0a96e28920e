//! `turbokv bench decode`: prefill and decode speed of a model of a real shape (random bf16
//! weights generated on the device, or a model file), against rooflines measured in the same
//! run: decode step time vs (weight bytes + KV bytes) / device copy bandwidth, prefill FLOP/s
//! vs the bf16 GEMM rate.
//!
//! The step is the engine's own: `Transformer::forward` over a batch of sequences in a paged
//! cache. On CUDA the decode steps are timed three times: eager (one launch per op, full
//! logits copied back), through a CUDA graph ([`CudaBackend::run_graphed`]) ending in the full
//! logits copy (the main "graph" figure), and through the graph ending in a greedy pick
//! (`to_host_top_k` with k = 1, what greedy generation copies back: a top-1 copy with the
//! device selection).

use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use turbokv_backend::cpu::CpuBackend;
use turbokv_backend::cuda::{CudaBackend, GraphStats};
use turbokv_backend::{Backend, GgmlType, RopeStyle, TopK, WeightBytes, WeightMatrix};
use turbokv_model::config::RopeScaling;
use turbokv_model::loader::{AttnWeights, LayerWeights, Mixer, Mlp, Weights};
use turbokv_model::{
    Family, KvCache, LoadOptions, LogitsFor, Model, ModelConfig, Scratch, SeqInput, StepOutput,
    StepTokens, Transformer,
};

use crate::args::BenchDecodeArgs;

/// Tokens per KV block.
const BLOCK: usize = 16;
/// Decode steps run before timing.
const WARMUP: usize = 3;

/// The machine-readable result (also written with `--json`).
#[derive(Serialize, Debug)]
pub struct DecodeReport {
    /// The backend that ran (after any fallback).
    pub device: String,
    /// The shape name or model path.
    pub model: String,
    /// Whether the weights were random.
    pub random_weights: bool,
    /// Sequences decoded together.
    pub batch: usize,
    /// Prompt tokens per sequence (the context each decode step sees, ± steps).
    pub ctx: usize,
    /// KV cache number format.
    pub kv: String,
    /// Layers.
    pub layers: usize,
    /// Device copy bandwidth (bytes read + written per second), measured in this run.
    pub copy_bw_gb_s: f64,
    /// bf16 GEMM rate measured in this run (TFLOP/s) and its shape.
    pub gemm_tflops: f64,
    /// `m×n×k` of the GEMM-rate measurement.
    pub gemm_shape: String,
    /// Weight bytes read per decode step.
    pub weight_gb: f64,
    /// KV bytes read per decode step (all sequences, all layers).
    pub kv_gb: f64,
    /// KV bytes per cached token, all layers, side information included.
    pub kv_bytes_per_token: f64,
    /// Prefill: tokens per second of one sequence of `ctx` tokens (median over sequences).
    pub prefill_tok_s: f64,
    /// Prefill FLOP/s (matmuls + attention) in TFLOP/s.
    pub prefill_tflops: f64,
    /// Prefill FLOP/s as a fraction of the measured GEMM rate.
    pub prefill_fraction_of_gemm: f64,
    /// Decode steps timed.
    pub steps: usize,
    /// Eager decode: median ms per step.
    pub decode_ms_step: f64,
    /// Eager decode: tokens per second (batch / step time).
    pub decode_tok_s: f64,
    /// (weight bytes + KV bytes) / copy bandwidth, in ms.
    pub roofline_ms: f64,
    /// Eager step time / roofline (1 = at the roofline).
    pub ratio_to_roofline: f64,
    /// Graph decode ending in the full logits copy (CUDA; equal to the eager figures
    /// elsewhere): median ms per step.
    pub graph_ms_step: f64,
    /// Graph decode tokens per second.
    pub graph_tok_s: f64,
    /// Graph step time / roofline.
    pub graph_ratio_to_roofline: f64,
    /// Graph decode ending in a greedy pick (`to_host_top_k`, k = 1; elsewhere the eager
    /// step with a host pick): median ms per step.
    pub graph_greedy_ms_step: f64,
    /// Its tokens per second.
    pub graph_greedy_tok_s: f64,
    /// Steps that ran as a replayed graph (0 without CUDA graphs).
    pub graph_replays: u64,
    /// Mean host time of a replayed step before its graph is launched, in µs (part of the
    /// graph step time: the GPU waits for it).
    pub graph_host_us_step: f64,
    /// The part of it that uploads the step's inputs, in µs.
    pub graph_upload_us_step: f64,
    /// Mean host time of the graph launch call, in µs.
    pub graph_launch_us_step: f64,
    /// The device's part of a graphed step: the last step's graph launched back to back
    /// (no host code or launch gaps between), ms per launch; 0 without graphs.
    pub graph_gpu_ms_step: f64,
    /// Greedy decoding with the device a step ahead of the host (each step fed the step
    /// before's picks on the device, `turbokv run`'s greedy loop): mean ms per step.
    pub pipelined_ms_step: f64,
    /// Its tokens per second.
    pub pipelined_tok_s: f64,
    /// Its step time / roofline.
    pub pipelined_ratio_to_roofline: f64,
}

/// What the benchmark needs from a backend beyond [`Backend`].
pub trait BenchBackend: Backend + Sized {
    /// A bf16 `[rows, cols]` matrix of uniform random values in `[-scale, scale]`.
    fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        seed: u64,
        scale: f32,
    ) -> Result<Self::Matrix>;
    /// Copy bandwidth in bytes/s (read + write).
    fn copy_bandwidth(&self) -> Result<f64>;
    /// bf16 GEMM rate in FLOP/s and the shape measured.
    fn gemm_rate(&self) -> Result<(f64, String)>;
    /// Whether decode steps replay CUDA graphs (`Backend::run_step`).
    fn has_graphs(&self) -> bool {
        false
    }
    /// How the graphed steps ran so far (`None` without CUDA graphs).
    fn graph_stats(&self) -> Option<GraphStats> {
        None
    }
    /// Seconds per launch of the last step's graph launched `reps` times back to back.
    fn graph_gpu_s(&self, _reps: usize) -> Result<f64> {
        Ok(0.0)
    }
    /// Starts or stops the device profiler's collection (`--profile-step`); a no-op where
    /// there is none.
    fn profiler_range(&self, _on: bool) -> Result<()> {
        Ok(())
    }
}

/// splitmix64.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl BenchBackend for CpuBackend {
    fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        seed: u64,
        scale: f32,
    ) -> Result<Self::Matrix> {
        let n = rows * cols;
        let mut bytes = Vec::with_capacity(2 * n);
        for i in 0..n as u64 {
            let u = (mix(seed.wrapping_mul(0x1000_0000_01B3) ^ i) >> 40) as f32 / 16_777_216.0;
            let v = (2.0 * u - 1.0) * scale;
            bytes.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
        let w = WeightMatrix::new(
            GgmlType::Bf16,
            rows,
            cols,
            WeightBytes::Owned(std::sync::Arc::new(bytes)),
        )?;
        Ok(self.matrix(&w)?)
    }

    fn copy_bandwidth(&self) -> Result<f64> {
        let n = 64 << 20;
        let src = vec![1u8; n];
        let mut dst = vec![0u8; n];
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(2.0 * n as f64 / best)
    }

    fn gemm_rate(&self) -> Result<(f64, String)> {
        let (m, n, k) = (256, 1024, 1024);
        let w = BenchBackend::random_matrix(self, n, k, 5, 1.0)?;
        let x = self.tensor(m, k)?;
        let mut out = self.tensor(m, n)?;
        self.matmul(&x, &w, &mut out)?;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            self.matmul(&x, &w, &mut out)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok((2.0 * (m * n * k) as f64 / best, format!("{m}x{n}x{k}")))
    }
}

impl BenchBackend for CudaBackend {
    fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        seed: u64,
        scale: f32,
    ) -> Result<Self::Matrix> {
        Ok(CudaBackend::random_matrix(self, rows, cols, seed, scale)?)
    }

    fn copy_bandwidth(&self) -> Result<f64> {
        Ok(CudaBackend::copy_bandwidth(self, 1 << 32, 10)?)
    }

    fn gemm_rate(&self) -> Result<(f64, String)> {
        let s = 8192;
        Ok((
            CudaBackend::gemm_rate(self, s, s, s, 10)?,
            format!("{s}x{s}x{s}"),
        ))
    }

    fn has_graphs(&self) -> bool {
        true
    }

    fn graph_stats(&self) -> Option<GraphStats> {
        CudaBackend::graph_stats(self).ok()
    }

    fn graph_gpu_s(&self, reps: usize) -> Result<f64> {
        Ok(self.graph_gpu_time(reps)?)
    }

    fn profiler_range(&self, on: bool) -> Result<()> {
        Ok(CudaBackend::profiler_range(self, on)?)
    }
}

/// A named real model shape.
pub fn shape_config(name: &str) -> Result<(ModelConfig, bool)> {
    // (family, vocab, hidden, layers, heads, kv heads, head dim, ffn, theta, max ctx, tied)
    let (family, vocab, hidden, layers, heads, kv, hd, ffn, theta, max_ctx, tied) = match name {
        "llama3-8b" => (
            Family::Llama,
            128_256,
            4096,
            32,
            32,
            8,
            128,
            14336,
            500_000.0,
            131_072,
            false,
        ),
        "qwen3-8b" => (
            Family::Qwen3,
            151_936,
            4096,
            36,
            32,
            8,
            128,
            12288,
            1_000_000.0,
            40_960,
            false,
        ),
        "smollm2-135m" => (
            Family::Llama,
            49_152,
            576,
            30,
            9,
            3,
            64,
            1536,
            100_000.0,
            8192,
            true,
        ),
        other => bail!("unknown --shape {other:?}; use llama3-8b, qwen3-8b or smollm2-135m"),
    };
    let cfg = ModelConfig {
        family,
        vocab_size: vocab,
        hidden,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: hd,
        ffn,
        rms_eps: 1e-5,
        rope_theta: theta,
        rope_dim: hd,
        rope_style: RopeStyle::HalfSplit,
        rope_scaling: RopeScaling::None,
        max_context: max_ctx,
        arch: Default::default(),
    };
    Ok((cfg, tied))
}

/// Random weights of `cfg`'s shape; returns them and the weight bytes read per decode step
/// of `batch` sequences.
pub(crate) fn random_weights<B: BenchBackend>(
    b: &B,
    cfg: &ModelConfig,
    tied: bool,
    batch: usize,
) -> Result<(Weights<B>, usize)> {
    let mut seed = 100;
    let mut rnd = |rows: usize, cols: usize, scale: f32| {
        seed += 1;
        b.random_matrix(rows, cols, seed, scale)
    };
    let (h, hd) = (cfg.hidden, cfg.head_dim);
    let qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd;
    let ws = 1.0 / (h as f32).sqrt();
    let ones = vec![1.0f32; h];
    let embed = rnd(cfg.vocab_size, h, 1.0)?;
    let lm_head = rnd(cfg.vocab_size, h, ws)?;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for _ in 0..cfg.n_layers {
        let qk_norm = if cfg.family == Family::Qwen3 {
            Some((b.vector(&vec![1.0; hd])?, b.vector(&vec![1.0; hd])?))
        } else {
            None
        };
        let bqkv = if cfg.family == Family::Qwen2 {
            Some(b.vector(&vec![0.0; qkv])?)
        } else {
            None
        };
        layers.push(LayerWeights {
            attn_norm: b.vector(&ones)?,
            mixer: Mixer::Attention(AttnWeights {
                wqkv: vec![rnd(qkv, h, ws)?],
                bqkv,
                qk_norm,
                wo: rnd(h, cfg.n_heads * hd, ws)?,
                bo: None,
                sinks: None,
            }),
            ffn_norm: b.vector(&ones)?,
            mlp: Mlp::Dense {
                gate_up: vec![rnd(2 * cfg.ffn, h, ws)?],
                down: rnd(h, cfg.ffn, 1.0 / (cfg.ffn as f32).sqrt())?,
            },
            extra: Default::default(),
        });
    }
    let per_layer = qkv * h + h * cfg.n_heads * hd + 3 * cfg.ffn * h;
    // bf16 weights; the embedding contributes one row per sequence (all of it when tied, as
    // the LM head reads it).
    let bytes =
        2 * (cfg.n_layers * per_layer + cfg.vocab_size * h + if tied { 0 } else { batch * h });
    Ok((
        Weights {
            embed,
            layers,
            final_norm: b.vector(&ones)?,
            lm_head,
        },
        bytes,
    ))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The formats of the `--kv-budget` capacity table.
const CAPACITY_FORMATS: [&str; 11] = [
    "bf16", "fp8", "int8", "tq4", "k4v3", "tq3", "k4v2", "tq2", "balanced", "compact", "tiny",
];

/// One row of the capacity table: a format's bits per element and the most sequences of
/// `ctx` tokens a KV budget holds.
#[derive(Debug, PartialEq)]
struct CapacityRow {
    label: String,
    bits: f64,
    bytes_per_seq: f64,
    sequences: usize,
}

/// The capacity of `budget_gb` (10⁹ bytes) of KV at `ctx` tokens per sequence for the
/// shape's layers, kv heads and head_dim, per format (windows and centers included, as
/// `KvSpec::bits_per_element` counts them).
fn capacity(cfg: &ModelConfig, ctx: usize, budget_gb: f64) -> Result<Vec<CapacityRow>> {
    let elems = (cfg.n_layers * cfg.n_kv_heads * cfg.head_dim) as f64;
    CAPACITY_FORMATS
        .iter()
        .map(|f| {
            let spec = crate::kvspec::KvSpec::parse(f, Default::default())?;
            let bits =
                spec.bits_per_element((cfg.head_dim, cfg.n_kv_heads), ctx, cfg.kv_layers(), &[]);
            // K and V: 2 · bits per element.
            let bytes_per_seq = ctx as f64 * elems * 2.0 * bits / 8.0;
            Ok(CapacityRow {
                label: spec.label(f),
                bits,
                bytes_per_seq,
                sequences: (budget_gb * 1e9 / bytes_per_seq).floor() as usize,
            })
        })
        .collect()
}

/// `--kv-budget`: prints the capacity table of the shape (nothing is run).
fn print_capacity(args: &BenchDecodeArgs, budget_gb: f64) -> Result<()> {
    anyhow::ensure!(
        args.model.is_none(),
        "--kv-budget works on a --shape, not a --model"
    );
    anyhow::ensure!(
        budget_gb > 0.0 && args.ctx > 0,
        "--kv-budget and --ctx must be positive"
    );
    let (cfg, _) = shape_config(&args.shape)?;
    let rows = capacity(&cfg, args.ctx, budget_gb)?;
    let bf16 = rows[0].sequences.max(1) as f64;
    println!(
        "{} | {} layers × {} kv heads × {} | ctx {} | KV budget {budget_gb} GB",
        args.shape, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, args.ctx
    );
    println!(
        "{:>26} {:>9} {:>12} {:>10} {:>8}",
        "kv", "bits/el", "MB/sequence", "sequences", "vs bf16"
    );
    for r in &rows {
        println!(
            "{:>26} {:>9.3} {:>12.1} {:>10} {:>7.2}x",
            r.label,
            r.bits,
            r.bytes_per_seq / 1e6,
            r.sequences,
            r.sequences as f64 / bf16
        );
    }
    Ok(())
}

/// Runs the benchmark on the device `args.device` names and prints a table (and JSON).
pub fn run(args: &BenchDecodeArgs) -> Result<()> {
    if let Some(budget) = args.kv_budget {
        return print_capacity(args, budget);
    }
    let report = crate::with_device!(&args.device, b => measure(b, args))?;
    print_report(&report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn print_report(r: &DecodeReport) {
    println!(
        "{} | {} | batch {} | ctx {} | kv {} | {} layers",
        r.device, r.model, r.batch, r.ctx, r.kv, r.layers
    );
    println!(
        "copy bandwidth {:.0} GB/s | bf16 GEMM {:.1} TFLOP/s ({}) | weights {:.2} GB | KV {:.3} GB ({:.0} B/token)",
        r.copy_bw_gb_s, r.gemm_tflops, r.gemm_shape, r.weight_gb, r.kv_gb, r.kv_bytes_per_token
    );
    println!(
        "prefill {:.0} tok/s = {:.1} TFLOP/s = {:.0}% of GEMM",
        r.prefill_tok_s,
        r.prefill_tflops,
        100.0 * r.prefill_fraction_of_gemm
    );
    println!(
        "decode eager {:.3} ms/step ({:.1} tok/s) | graph {:.3} ms/step ({:.1} tok/s) | roofline {:.3} ms | ratio eager {:.2}x graph {:.2}x",
        r.decode_ms_step,
        r.decode_tok_s,
        r.graph_ms_step,
        r.graph_tok_s,
        r.roofline_ms,
        r.ratio_to_roofline,
        r.graph_ratio_to_roofline
    );
    println!(
        "graph ending in a greedy pick (top-1) {:.3} ms/step ({:.1} tok/s)",
        r.graph_greedy_ms_step, r.graph_greedy_tok_s
    );
    println!(
        "greedy, device a step ahead (pipelined) {:.3} ms/step ({:.1} tok/s) | ratio {:.2}x",
        r.pipelined_ms_step, r.pipelined_tok_s, r.pipelined_ratio_to_roofline
    );
    if r.graph_replays > 0 {
        println!(
            "graph steps: {} replayed, host time before each launch {:.0} µs (uploads {:.0} µs), launch call {:.0} µs",
            r.graph_replays, r.graph_host_us_step, r.graph_upload_us_step, r.graph_launch_us_step
        );
        println!(
            "the graph alone, launched back to back: {:.3} ms/step ({:.2}x roofline)",
            r.graph_gpu_ms_step,
            r.graph_gpu_ms_step / r.roofline_ms
        );
    }
}

/// Builds (or loads) the model, measures and returns the report.
pub fn measure<B: BenchBackend>(b: B, args: &BenchDecodeArgs) -> Result<DecodeReport> {
    anyhow::ensure!(
        args.batch > 0 && args.ctx > 0,
        "--batch and --ctx must be positive"
    );
    let device = b.describe();
    eprintln!("bench decode on {device}");
    let copy_bw = b.copy_bandwidth()?;
    let (gemm, gemm_shape) = b.gemm_rate()?;
    // A dtype or a preset (`compact`, `tq3@w15s1`, …): its window and key mode apply; a
    // calibrated preset's centers cannot come from random weights and are left out.
    let spec = crate::kvspec::KvSpec::parse(&args.kv, Default::default())
        .with_context(|| format!("--kv {}", args.kv))?;
    if spec.center {
        eprintln!(
            "--kv {}: centers left out (no calibration for random weights)",
            args.kv
        );
    }
    let kv_dtype = spec.dtype;
    let policy = spec.policy(args.ctx, &[], None);
    let (tm, weight_bytes, name, random) = match &args.model {
        Some(path) => {
            let m = Model::load(path, b, &LoadOptions { progress: false })
                .with_context(|| format!("loading {}", path.display()))?;
            (
                m.transformer,
                m.weight_bytes,
                path.display().to_string(),
                false,
            )
        }
        None => {
            let (mut cfg, tied) = shape_config(&args.shape)?;
            if let Some(l) = args.layers {
                cfg.n_layers = l.max(1);
            }
            let (w, bytes) = random_weights(&b, &cfg, tied, args.batch)?;
            (Transformer::new(b, cfg, w), bytes, args.shape.clone(), true)
        }
    };
    let cfg = tm.config().clone();
    let steps = args.steps.max(1);
    // Eager, two graph and one pipelined decode pass, each with warm-up, plus spare steps
    // (one of them for `--profile-step`).
    let per_seq = args.ctx + 4 * (steps + WARMUP) + 8;
    let blocks = args.batch * per_seq.div_ceil(BLOCK) + per_seq.div_ceil(BLOCK);
    let mut cache = tm
        .new_cache_with(kv_dtype, &policy, BLOCK, blocks * BLOCK, per_seq)
        .context("allocating the KV cache")?;
    let mut scratch = tm.new_scratch()?;
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..args.ctx as u32)
        .map(|i| (1 + i.wrapping_mul(7919)) % vocab)
        .collect();
    let mut logits = Vec::new();
    let mut top = TopK::default();

    // Warm-up prefill on a throwaway sequence (first cuBLAS plans, scratch growth).
    let warm = args.batch as u64;
    cache.add_sequence(warm)?;
    fwd(
        &tm,
        &mut cache,
        &mut scratch,
        &[(warm, &prompt)],
        &mut logits,
    )?;
    cache.remove_sequence(warm)?;
    let mut prefill = Vec::with_capacity(args.batch);
    for s in 0..args.batch as u64 {
        cache.add_sequence(s)?;
        let t = Instant::now();
        fwd(&tm, &mut cache, &mut scratch, &[(s, &prompt)], &mut logits)?;
        prefill.push(t.elapsed().as_secs_f64());
    }
    let prefill_s = median(&mut prefill);
    let (h, hd, l) = (cfg.hidden, cfg.head_dim, cfg.n_layers);
    let qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd;
    let per_layer = qkv * h + h * cfg.n_heads * hd + 3 * cfg.ffn * h;
    let n = args.ctx as f64;
    let prefill_flops = 2.0 * (l * per_layer) as f64 * n
        + 2.0 * (cfg.vocab_size * h) as f64
        + 4.0 * (l * cfg.n_heads * hd) as f64 * n * (n + 1.0) / 2.0;

    // Decode: one token per sequence per step.
    let mut next: Vec<u32> = (0..args.batch as u32)
        .map(|i| (7 + 13 * i) % vocab)
        .collect();
    // Median step time after a warm-up (for graphs: eager on the graph's buffers, capture).
    // `greedy`: the step ends in a device top-1 instead of the full logits copy.
    let mut time_steps = |graphs: bool, greedy: bool| -> Result<f64> {
        tm.set_step_graphs(graphs);
        let mut times = Vec::with_capacity(steps);
        for i in 0..WARMUP + steps {
            let t = Instant::now();
            let out = if greedy {
                StepOutput::TopK {
                    k: 1,
                    out: &mut top,
                }
            } else {
                StepOutput::Logits(&mut logits)
            };
            decode(&tm, &mut cache, &mut scratch, &next, out)?;
            if i >= WARMUP {
                times.push(t.elapsed().as_secs_f64());
            }
            advance(&mut next, vocab);
        }
        Ok(median(&mut times))
    };
    let eager_s = time_steps(false, false)?;
    let (graph_s, greedy_s) = if b_has_graphs(&tm) {
        (time_steps(true, false)?, time_steps(true, true)?)
    } else {
        (eager_s, time_steps(false, true)?)
    };
    let pipelined_s = time_pipelined(&tm, &mut cache, &mut scratch, &next, steps)?;
    let gpu_s = if b_has_graphs(&tm) {
        tm.backend().graph_gpu_s(steps)?
    } else {
        0.0
    };
    if args.profile_step {
        tm.set_step_graphs(false);
        tm.backend().profiler_range(true)?;
        decode(
            &tm,
            &mut cache,
            &mut scratch,
            &next,
            StepOutput::Logits(&mut logits),
        )?;
        tm.backend().profiler_range(false)?;
    }
    let gs = tm.backend().graph_stats().unwrap_or_default();
    let replays = gs.replayed;
    let per_replay = |s: f64| 1e6 * s / replays.max(1) as f64;
    let kv_bytes = args.batch as f64 * (args.ctx + steps) as f64 * cache.bytes_per_token();
    let roofline = (weight_bytes as f64 + kv_bytes) / copy_bw;
    let batch = args.batch as f64;
    let prefill_rate = prefill_flops / prefill_s;
    Ok(DecodeReport {
        device,
        model: name,
        random_weights: random,
        batch: args.batch,
        ctx: args.ctx,
        kv: args.kv.clone(),
        layers: l,
        copy_bw_gb_s: copy_bw / 1e9,
        gemm_tflops: gemm / 1e12,
        gemm_shape,
        weight_gb: weight_bytes as f64 / 1e9,
        kv_gb: kv_bytes / 1e9,
        kv_bytes_per_token: cache.bytes_per_token(),
        prefill_tok_s: n / prefill_s,
        prefill_tflops: prefill_rate / 1e12,
        prefill_fraction_of_gemm: prefill_rate / gemm,
        steps,
        decode_ms_step: eager_s * 1e3,
        decode_tok_s: batch / eager_s,
        roofline_ms: roofline * 1e3,
        ratio_to_roofline: eager_s / roofline,
        graph_ms_step: graph_s * 1e3,
        graph_tok_s: batch / graph_s,
        graph_ratio_to_roofline: graph_s / roofline,
        graph_greedy_ms_step: greedy_s * 1e3,
        graph_greedy_tok_s: batch / greedy_s,
        graph_replays: replays,
        graph_host_us_step: per_replay(gs.replay_host_s),
        graph_upload_us_step: per_replay(gs.replay_upload_s),
        graph_launch_us_step: per_replay(gs.replay_launch_s),
        graph_gpu_ms_step: gpu_s * 1e3,
        pipelined_ms_step: pipelined_s * 1e3,
        pipelined_tok_s: batch / pipelined_s,
        pipelined_ratio_to_roofline: pipelined_s / roofline,
    })
}

/// Mean step time of greedy decoding with the device a step ahead of the host: each step is
/// fed the picks of the step before on the device ([`Transformer::forward_pick`]) and issued
/// before those picks are read, as `Session::generate_greedy` and `turbokv run` decode. A
/// mean over the steps, not a median: with the steps overlapping, only their rate is defined.
fn time_pipelined<B: Backend>(
    tm: &Transformer<B>,
    cache: &mut KvCache<B>,
    scratch: &mut Scratch<B>,
    first: &[u32],
    steps: usize,
) -> Result<f64> {
    tm.set_step_graphs(true);
    let b = tm.backend();
    let mut picks = b.new_picks()?;
    let inputs = one_token_each(first);
    tm.forward_pick(StepTokens::Host(&inputs), cache, scratch, &mut picks)?;
    let seqs: Vec<u64> = (0..first.len() as u64).collect();
    let mut ids = Vec::new();
    let mut start = Instant::now();
    for i in 0..WARMUP + steps {
        if i == WARMUP {
            start = Instant::now();
        }
        tm.forward_pick(StepTokens::Picked(&seqs), cache, scratch, &mut picks)?;
        b.wait_picks(&mut picks, &mut ids)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    b.wait_picks(&mut picks, &mut ids)?;
    Ok(elapsed / steps as f64)
}

fn b_has_graphs<B: BenchBackend>(tm: &Transformer<B>) -> bool {
    tm.backend().has_graphs()
}

fn advance(next: &mut [u32], vocab: u32) {
    for t in next {
        *t = (*t * 31 + 17) % vocab;
    }
}

fn fwd<B: Backend>(
    tm: &Transformer<B>,
    cache: &mut KvCache<B>,
    scratch: &mut Scratch<B>,
    seqs: &[(u64, &[u32])],
    logits: &mut Vec<f32>,
) -> Result<()> {
    let inputs: Vec<SeqInput<'_>> = seqs
        .iter()
        .map(|&(seq, tokens)| SeqInput { seq, tokens })
        .collect();
    tm.forward(&inputs, cache, scratch, LogitsFor::LastToken, logits)?;
    Ok(())
}

/// One token per sequence, sequence `i` taking `tokens[i]`.
fn one_token_each(tokens: &[u32]) -> Vec<SeqInput<'_>> {
    tokens
        .iter()
        .enumerate()
        .map(|(s, t)| SeqInput {
            seq: s as u64,
            tokens: std::slice::from_ref(t),
        })
        .collect()
}

fn decode<B: Backend>(
    tm: &Transformer<B>,
    cache: &mut KvCache<B>,
    scratch: &mut Scratch<B>,
    next: &[u32],
    out: StepOutput<'_>,
) -> Result<()> {
    let inputs = one_token_each(next);
    match out {
        StepOutput::Logits(v) => tm.forward(&inputs, cache, scratch, LogitsFor::LastToken, v)?,
        StepOutput::TopK { k, out } => tm.forward_top_k(&inputs, cache, scratch, k, out)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_counts_codes_windows_and_whole_sequences() {
        let (cfg, _) = shape_config("llama3-8b").unwrap();
        let rows = capacity(&cfg, 8192, 60.0).unwrap();
        let get = |l: &str| rows.iter().find(|r| r.label.starts_with(l)).unwrap();
        // bf16: 32 layers × 8 heads × 128 × 2 (K, V) × 2 bytes = 128 KiB per token.
        let bf16 = get("bf16");
        assert_eq!(bf16.bytes_per_seq, 8192.0 * 131_072.0);
        assert_eq!(bf16.sequences, (60e9 / (8192.0 * 131_072.0)) as usize);
        // tq3: 3 bits + one f16 norm per 128 → 3.125 bits; int8 8.125.
        assert!((get("tq3").bits - 3.125).abs() < 1e-9);
        assert!((get("int8").bits - 8.125).abs() < 1e-9);
        // compact = k4v2 ((4.125 + 2.125) / 2 bits) with a window of 1.2% of the context at
        // f16 (98 tokens + 1 sink at 8192: +0.19 bits) and layer 1's values at 4 bits (+2/32
        // / 2): 3.35 bits, inside its 3.5-bit budget.
        let compact = get("compact");
        let want = 3.125 + 99.0 * 16.0 / 8192.0 + 1.0 / 32.0;
        assert!((compact.bits - want).abs() < 0.01, "{}", compact.bits);
        assert!(compact.sequences as f64 >= 4.5 * bf16.sequences as f64);
        for r in &rows {
            assert!(r.sequences as f64 * r.bytes_per_seq <= 60e9);
            assert!((r.sequences + 1) as f64 * r.bytes_per_seq > 60e9);
        }
    }
}
