//! Micro-benchmark of `WeightMatrix::matmul` on the demo model's shapes (SmolLM2-135M:
//! hidden 576, ffn 1536, 30 layers, Q4_1 layer weights, a 49152-row Q8_0 LM head).
//!
//! ```text
//! cargo run --release -p turbokv-backend --example qmatmul_bench [-- --quick] [--hot]
//!     [--formats | --overhead]
//! ```
//!
//! Each shape is timed cold, as in decode: enough distinct copies of the matrix (≥ 64 MiB in
//! all, more than the L3 cache) are cycled through so every call streams its weights from
//! memory. Reported per call: best and median time over passes, weight GB/s, GFLOP/s. Then a
//! whole "decode token" (30 layers × q, k, v, o, gate, up, down + LM head, back to back) is
//! timed directly. `--formats` instead times every weight format on one shape (global pool,
//! all cores), `--overhead` the fixed cost of a call. `--hot` keeps one copy of each matrix
//! (cache-resident: the kernels' compute ceiling). The numbers are noisy on a shared
//! machine: run it several times and take the best.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;
use turbokv_backend::quant::quantize_row;
use turbokv_backend::{GgmlType, WeightBytes, WeightMatrix};

const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const KV: usize = 192;
const FFN: usize = 1536;
const VOCAB: usize = 49152;

/// One named matrix shape of the model, with how many of it a token uses.
struct Shape {
    name: &'static str,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    per_token: usize,
}

const SHAPES: [Shape; 5] = [
    Shape {
        name: "attn q/o 576x576",
        ty: GgmlType::Q4_1,
        rows: HIDDEN,
        cols: HIDDEN,
        per_token: 2 * LAYERS,
    },
    Shape {
        name: "attn k/v 192x576",
        ty: GgmlType::Q4_1,
        rows: KV,
        cols: HIDDEN,
        per_token: 2 * LAYERS,
    },
    Shape {
        name: "ffn gate/up 1536x576",
        ty: GgmlType::Q4_1,
        rows: FFN,
        cols: HIDDEN,
        per_token: 2 * LAYERS,
    },
    Shape {
        name: "ffn down 576x1536",
        ty: GgmlType::Q4_1,
        rows: HIDDEN,
        cols: FFN,
        per_token: LAYERS,
    },
    Shape {
        name: "lm head 49152x576",
        ty: GgmlType::Q8_0,
        rows: VOCAB,
        cols: HIDDEN,
        per_token: 1,
    },
];

/// Deterministic pseudo-random values in [-1, 1) (splitmix64).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `copies` distinct allocations of one random quantized matrix.
fn matrices(s: &Shape, copies: usize) -> Vec<WeightMatrix> {
    let rb = s.ty.row_bytes(s.cols).expect("whole blocks");
    let mut bytes = vec![0u8; s.rows * rb];
    let v = values(s.rows * s.cols, s.rows as u64);
    for (b, x) in bytes.chunks_exact_mut(rb).zip(v.chunks_exact(s.cols)) {
        quantize_row(s.ty, x, b).expect("sizes");
    }
    (0..copies)
        .map(|_| {
            WeightMatrix::new(
                s.ty,
                s.rows,
                s.cols,
                WeightBytes::Owned(Arc::new(bytes.clone())),
            )
            .expect("sizes")
        })
        .collect()
}

/// Best and median seconds per call, cycling through `ws` for `passes` passes.
fn time_calls(ws: &[WeightMatrix], n: usize, passes: usize) -> (f64, f64) {
    let (rows, cols) = (ws[0].rows(), ws[0].cols());
    let x = values(n * cols, 7);
    let mut out = vec![0f32; n * rows];
    let mut per_call = Vec::with_capacity(passes);
    for pass in 0..=passes {
        let t = Instant::now();
        for w in ws {
            w.matmul(black_box(&x), n, &mut out).expect("shapes");
        }
        if pass > 0 {
            per_call.push(t.elapsed().as_secs_f64() / ws.len() as f64);
        }
        black_box(&out);
    }
    per_call.sort_by(f64::total_cmp);
    (per_call[0], per_call[per_call.len() / 2])
}

/// One decode step's matmuls for `n` tokens: every layer's seven, then the LM head.
fn time_token(mats: &[Vec<WeightMatrix>], n: usize, passes: usize) -> (f64, f64) {
    let x_h = values(n * HIDDEN, 3);
    let x_f = values(n * FFN, 4);
    let mut out = vec![0f32; n * VOCAB];
    let order = [0, 1, 1, 0, 2, 2, 3]; // q k v o gate up down
    let mut times = Vec::with_capacity(passes);
    for pass in 0..=passes {
        let t = Instant::now();
        for layer in 0..LAYERS {
            for &s in &order {
                let w = &mats[s][layer % mats[s].len()];
                let x = if w.cols() == FFN { &x_f } else { &x_h };
                w.matmul(x, n, &mut out[..n * w.rows()]).expect("shapes");
            }
        }
        mats[4][0].matmul(&x_h, n, &mut out).expect("shapes");
        if pass > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
        black_box(&out);
    }
    times.sort_by(f64::total_cmp);
    (times[0], times[times.len() / 2])
}

/// Every format on a 1536×768 matrix (768: whole K-quant super-blocks), n = 1 and 8: the per-format cost of the kernels.
fn formats(passes: usize, hot: bool) {
    let tys = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    println!(
        "{:<8} {:>10} {:>8} {:>10} {:>8}",
        "format", "n=1 us", "GB/s", "n=8 us", "GB/s"
    );
    for ty in tys {
        let s = Shape {
            name: "",
            ty,
            rows: FFN,
            cols: 768,
            per_token: 1,
        };
        let bytes = s.rows * ty.row_bytes(s.cols).unwrap_or(0);
        let copies = if hot {
            1
        } else {
            (64usize << 20).div_ceil(bytes).max(1)
        };
        let ws = matrices(&s, copies);
        let (b1, _) = time_calls(&ws, 1, passes);
        let (b8, _) = time_calls(&ws, 8, passes);
        let gbs = |t: f64| bytes as f64 / t / 1e9;
        println!(
            "{:<8} {:>10.1} {:>8.2} {:>10.1} {:>8.2}",
            format!("{ty:?}"),
            b1 * 1e6,
            gbs(b1),
            b8 * 1e6,
            gbs(b8)
        );
    }
}

/// Per-call fixed costs that decode pays ~211 times per token: a tiny 8×32 Q4_1 matrix (one
/// task: activation quantization and allocation only), and a small 64×576 one (23 KiB, one
/// task) against 128×576 (46 KiB, split in two tasks: adds the rayon dispatch).
fn overhead(passes: usize) {
    for rows in [8, 64, 128] {
        let cols = if rows == 8 { 32 } else { HIDDEN };
        let s = Shape {
            name: "",
            ty: GgmlType::Q4_1,
            rows,
            cols,
            per_token: 1,
        };
        let ws = matrices(&s, 200);
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("thread pool");
            let (best, med) = pool.install(|| time_calls(&ws, 1, passes));
            println!(
                "{rows}x{cols}, {threads} thread(s): best {:.2} us, median {:.2} us per call",
                best * 1e6,
                med * 1e6
            );
        }
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // `--hot`: one copy of each matrix, so weights come from cache: the kernels' compute
    // ceiling rather than the memory stream.
    let hot = std::env::args().any(|a| a == "--hot");
    let passes = if quick { 3 } else { 15 };
    if std::env::args().any(|a| a == "--overhead") {
        overhead(passes);
        return;
    }
    if std::env::args().any(|a| a == "--formats") {
        formats(passes, hot);
        return;
    }
    let mats: Vec<Vec<WeightMatrix>> = SHAPES
        .iter()
        .map(|s| {
            let bytes = s.rows * s.ty.row_bytes(s.cols).expect("whole blocks");
            // The layer matrices get one copy per layer (as in the model); the LM head enough
            // copies to exceed the L3 cache.
            let copies = if hot {
                1
            } else if s.per_token >= LAYERS {
                LAYERS
            } else {
                (64usize << 20).div_ceil(bytes).max(1)
            };
            matrices(s, copies)
        })
        .collect();
    let token_bytes: usize = SHAPES
        .iter()
        .map(|s| s.per_token * s.rows * s.ty.row_bytes(s.cols).unwrap_or(0))
        .sum();
    let token_flops: f64 = SHAPES
        .iter()
        .map(|s| (2 * s.per_token * s.rows * s.cols) as f64)
        .sum();
    println!(
        "weight bytes per token: {:.1} MB; {passes} passes, best / median",
        token_bytes as f64 / 1e6
    );
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        pool.install(|| {
            for n in [1, 128] {
                println!("\n== {threads} thread(s), n = {n}");
                println!("{:<22} {:>11} {:>11} {:>8} {:>9}", "shape", "best us", "median us", "GB/s", "GFLOP/s");
                for (s, ws) in SHAPES.iter().zip(&mats) {
                    let p = if n > 1 && s.rows == VOCAB { passes.min(3) } else { passes };
                    let (best, med) = time_calls(ws, n, p);
                    let bytes = (s.rows * s.ty.row_bytes(s.cols).unwrap_or(0)) as f64;
                    let flops = (2 * s.rows * s.cols * n) as f64;
                    println!(
                        "{:<22} {:>11.1} {:>11.1} {:>8.2} {:>9.1}",
                        s.name,
                        best * 1e6,
                        med * 1e6,
                        bytes / best / 1e9,
                        flops / best / 1e9
                    );
                }
                let (best, med) = time_token(&mats, n, if n > 1 { passes.min(3) } else { passes });
                println!(
                    "one decode step (30 layers + LM head), n = {n}: best {:.2} ms, median {:.2} ms -> {:.1} tok/s, {:.2} GB/s, {:.1} GFLOP/s",
                    best * 1e3,
                    med * 1e3,
                    n as f64 / best,
                    token_bytes as f64 / best / 1e9,
                    token_flops * n as f64 / best / 1e9
                );
            }
        });
    }
}
