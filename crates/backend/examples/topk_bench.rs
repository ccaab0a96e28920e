//! Time per call of the host top-k selection, `select_top_k`, on logits-like rows.
//!
//! ```text
//! cargo run --release -p turbokv-backend --example topk_bench [-- --passes 200]
//! ```
//!
//! Rows hold pseudo-random logits (roughly normal, σ ≈ 3) at the vocabulary sizes of the
//! Llama 3 (128256) and SmolLM2 (49152) tokenizers. Reported per shape and `k`: the best and
//! median time of one call, in µs.

use std::hint::black_box;
use std::time::Instant;

use turbokv_backend::{TopK, select_top_k};

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn logits(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Sum of four uniforms in [-1, 1): close enough to a normal for a benchmark.
            (0..4)
                .map(|_| {
                    *seed ^= *seed << 13;
                    *seed ^= *seed >> 7;
                    *seed ^= *seed << 17;
                    (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
                })
                .sum::<f32>()
                * 3.0
        })
        .collect()
}

fn main() {
    let passes: usize = arg("--passes", "200").parse().expect("--passes N");
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    println!(
        "{:>14} {:>4} {:>10} {:>10}",
        "shape", "k", "best µs", "median µs"
    );
    for (rows, cols) in [(1, 128_256), (1, 49_152), (8, 128_256)] {
        let data = logits(rows * cols, &mut seed);
        for k in [1, 40, 256] {
            let mut out = TopK::default();
            select_top_k(&data, cols, k, &mut out).unwrap();
            let mut times: Vec<f64> = (0..passes)
                .map(|_| {
                    let t = Instant::now();
                    select_top_k(black_box(&data), cols, k, &mut out).unwrap();
                    black_box(&out);
                    t.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            times.sort_by(f64::total_cmp);
            println!(
                "{:>14} {:>4} {:>10.1} {:>10.1}",
                format!("{rows}x{cols}"),
                k,
                times[0],
                times[passes / 2]
            );
        }
    }
}
