//! Decode attention on the CPU per KV dtype, against the machine's memory read bandwidth
//! measured in the same run.
//!
//! ```text
//! cargo run --release -p turbokv-backend --example attention_bench -- \
//!     [--ctx 512,2048,8000] [--kv f16,bf16,int8,tq4,tq3,tq3@w15s1] [--layers 30] [--passes 20] \
//!     [--queries 1] [--scores int8|f32]
//! ```
//!
//! A dtype may carry a full-precision window (`tq3@w15s1`: 15 recent tokens and 1 sink read
//! from f16 copies). Every pass also writes the step's token into each layer's pool first
//! (`write_kv`), as a decode step does, so per-step work of the store (a window's shadow
//! copies and their pruning) is timed with the attention.
//!
//! The shape is the demo model's (9 query heads, 3 kv heads, head_dim 64) over `--layers`
//! separate pools, so one decode step streams every layer's cache once, as in the model. Each
//! pass runs one single-token attention per layer; reported: the best and median pass in ms,
//! the KV bytes one pass reads, and that over the best time as GB/s, next to a plain parallel
//! read of a 512 MiB buffer (the bandwidth roofline of this machine, same threads).
//!
//! `--queries N` (N > 1) times a prefill chunk instead: the context's last N tokens are the
//! span's rows, each attending causally to everything before it (the tiled path). Use few
//! `--layers` there: a chunk's work grows with N × ctx.
//!
//! `--scores f32` scores TurboQuant-coded keys and sums their values in f32 instead of through
//! int8 products (`CodeProducts`; the same binary for an A/B of the two on a CPU with AVX-512
//! VNNI).

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;
use turbokv_backend::cpu::{CodeProducts, CpuBackend, CpuOptions, CpuTensor};
use turbokv_backend::{AttnGeometry, Backend, Rope, RopeStyle, SeqSpan};
use turbokv_cache::{KvLayout, KvWindow};
use turbokv_codec::KvDtype;

const BLOCK: usize = 16;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

/// GB/s of a parallel wrapping sum of u64 over 512 MiB (vectorised, so memory-bound; best
/// of 5).
fn read_bandwidth() -> f64 {
    let data: Vec<u64> = (0..64 << 20).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let s = data
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (data.len() * 8) as f64 / best / 1e9
}

fn main() {
    let ctxs: Vec<usize> = arg("--ctx", "512,2048,8000")
        .split(',')
        .map(|s| s.parse().expect("--ctx: comma-separated token counts"))
        .collect();
    let kvs = arg("--kv", "f16,bf16,int8,tq4,tq3");
    let layers: usize = arg("--layers", "30").parse().expect("--layers");
    let passes: usize = arg("--passes", "20").parse().expect("--passes");
    let queries: usize = arg("--queries", "1").parse().expect("--queries");
    let (n_heads, n_kv, d) = (9, 3, 64);
    let g = AttnGeometry {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let code_products = match arg("--scores", "int8").as_str() {
        "int8" => CodeProducts::Int8,
        "f32" => CodeProducts::F32,
        v => panic!("--scores {v}: expected int8 or f32"),
    };
    let b = CpuBackend::with_options(CpuOptions {
        code_products,
        ..CpuOptions::default()
    });
    let rope = Rope {
        inv_freq: Vec::new(),
        style: RopeStyle::HalfSplit,
    };
    let bw = read_bandwidth();
    println!(
        "threads {}, memory read {bw:.1} GB/s; shape {n_heads} q / {n_kv} kv heads × {d}, {layers} layers",
        rayon::current_num_threads()
    );
    println!("ctx\tkv\tbest ms\tmedian ms\tKV MB\tGB/s\tof read bw");
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    for &ctx in &ctxs {
        for name in kvs.split(',') {
            let (dtype, window) = name.split_once('@').unwrap_or((name, ""));
            let dtype: KvDtype = dtype.parse().expect("--kv: a KV dtype");
            let mut layout = KvLayout::uniform(layers, n_kv, d, dtype, BLOCK, ctx).unwrap();
            layout.window = parse_window(window);
            let blocks: Vec<u32> = (0..ctx.div_ceil(BLOCK) as u32).collect();
            let mut pools: Vec<_> = (0..layers)
                .map(|l| b.kv_pool(&layout, l).unwrap())
                .collect();
            for pool in &mut pools {
                for first in (0..ctx).step_by(512) {
                    let n = 512.min(ctx - first);
                    let data: Vec<f32> = (0..n * g.qkv_width()).map(|_| next()).collect();
                    let mut qkv = CpuTensor::from_vec(data, n, g.qkv_width()).unwrap();
                    let spans = [SeqSpan {
                        first_row: 0,
                        n_tokens: n,
                        first_pos: first,
                        blocks: &blocks,
                    }];
                    b.write_kv(&mut qkv, &g, &rope, None, &spans, pool).unwrap();
                }
            }
            let n = queries.clamp(1, ctx);
            let data: Vec<f32> = (0..n * g.qkv_width()).map(|_| next()).collect();
            let mut qkv = CpuTensor::from_vec(data, n, g.qkv_width()).unwrap();
            let spans = [SeqSpan {
                first_row: 0,
                n_tokens: n,
                first_pos: ctx - n,
                blocks: &blocks,
            }];
            let mut out = b.tensor(n, n_heads * d).unwrap();
            let mut times = Vec::with_capacity(passes);
            for _ in 0..passes + 2 {
                let t = Instant::now();
                for pool in &mut pools {
                    b.write_kv(&mut qkv, &g, &rope, None, &spans, pool).unwrap();
                    b.attention(&qkv, &g, &spans, pool, &mut out).unwrap();
                }
                times.push(t.elapsed().as_secs_f64());
            }
            times.drain(..2);
            times.sort_by(f64::total_cmp);
            let bytes = layout.bytes_per_token_all_layers() * ctx as f64;
            let gbs = bytes / times[0] / 1e9;
            println!(
                "{ctx}\t{name}\t{:.3}\t{:.3}\t{:.1}\t{gbs:.1}\t{:.0}%",
                times[0] * 1e3,
                times[times.len() / 2] * 1e3,
                bytes / 1e6,
                100.0 * gbs / bw
            );
        }
    }
}

/// `w15s1` → 15 recent tokens and 1 sink; `""` → none.
fn parse_window(w: &str) -> KvWindow {
    let num = |tag: char| {
        w.split_once(tag).map_or(0, |(_, rest)| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().expect("--kv: a window is w<recent>s<sinks>")
        })
    };
    KvWindow {
        recent: num('w'),
        sinks: num('s'),
        ..Default::default()
    }
}
