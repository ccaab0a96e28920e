//! Decode-step timing of a random-weight llama3-8b-shaped model on the CUDA backend, against
//! the roofline (weight + KV bytes / device copy bandwidth measured in the same run).
//!
//! `cargo run --release --example cuda_decode_bench -- [--batch N] [--ctx N] [--layers N]
//! [--blocks-per-sm N]`
//! prints one JSON object per configuration. The layer sequence is the one `Transformer::run`
//! issues (the model crate cannot be used here: it depends on this crate).

use std::time::Instant;

use turbokv_backend::cuda::{CudaBackend, CudaMatrix, CudaOptions, CudaVector};
use turbokv_backend::{AttnGeometry, Backend, Rope, RopeStyle, SeqSpan};
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

const HIDDEN: usize = 4096;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const FFN: usize = 14336;
const VOCAB: usize = 128_256;
const BLOCK: usize = 16;

struct Layer {
    attn_norm: CudaVector,
    ffn_norm: CudaVector,
    wqkv: Vec<CudaMatrix>,
    wo: CudaMatrix,
    gate_up: Vec<CudaMatrix>,
    down: CudaMatrix,
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (batch, ctx, n_layers) = (arg("--batch", 1), arg("--ctx", 4096), arg("--layers", 32));
    let opts = CudaOptions {
        attention_blocks_per_sm: arg("--blocks-per-sm", 2),
        ..CudaOptions::default()
    };
    let b = CudaBackend::with_options(0, &opts)?;
    eprintln!("{}", b.describe());
    let copy_bw = b.copy_bandwidth(1 << 32, 10)?;
    let geo = AttnGeometry {
        n_heads: HEADS,
        n_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
    };
    let rope = Rope {
        inv_freq: (0..HEAD_DIM / 2)
            .map(|i| 500000f32.powf(-(2.0 * i as f32) / HEAD_DIM as f32))
            .collect(),
        style: RopeStyle::HalfSplit,
    };
    let ws = 1.0 / (HIDDEN as f32).sqrt();
    let ones = vec![1.0f32; HIDDEN];
    let mut seed = 1;
    let mut rnd = |rows, cols, scale| {
        seed += 1;
        b.random_matrix(rows, cols, seed, scale)
    };
    let embed = rnd(VOCAB, HIDDEN, 1.0)?;
    let lm_head = rnd(VOCAB, HIDDEN, ws)?;
    let mut layers = Vec::new();
    for _ in 0..n_layers {
        layers.push(Layer {
            attn_norm: b.vector(&ones)?,
            ffn_norm: b.vector(&ones)?,
            wqkv: vec![rnd(geo.qkv_width(), HIDDEN, ws)?],
            wo: rnd(HIDDEN, HEADS * HEAD_DIM, ws)?,
            gate_up: vec![rnd(2 * FFN, HIDDEN, ws)?],
            down: rnd(HIDDEN, FFN, 1.0 / (FFN as f32).sqrt())?,
        });
    }
    let final_norm = b.vector(&ones)?;
    let weight_bytes: usize = embed.bytes() / VOCAB * batch
        + lm_head.bytes()
        + layers
            .iter()
            .map(|l| l.wqkv[0].bytes() + l.wo.bytes() + l.gate_up[0].bytes() + l.down.bytes())
            .sum::<usize>();
    let layout = KvLayout::uniform(
        n_layers,
        KV_HEADS,
        HEAD_DIM,
        KvDtype::Bf16,
        BLOCK,
        batch * ctx,
    )?;
    let mut pools = (0..n_layers)
        .map(|l| b.kv_pool(&layout, l))
        .collect::<Result<Vec<_>, _>>()?;
    let per_seq = ctx.div_ceil(BLOCK);
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    // Each sequence decodes its token at position ctx - 1 (the cache holds ctx - 1 before).
    let spans: Vec<SeqSpan<'_>> = tables
        .iter()
        .enumerate()
        .map(|(s, t)| SeqSpan {
            first_row: s,
            n_tokens: 1,
            first_pos: ctx - 1,
            blocks: t,
        })
        .collect();
    let kv_bytes = batch * ctx * n_layers * KV_HEADS * HEAD_DIM * 2 * 2;
    let ids: Vec<u32> = (0..batch as u32).map(|i| i * 7 + 1).collect();
    let last: Vec<usize> = (0..batch).collect();
    let (mut x, mut xn, mut qkv, mut attn, mut proj) = (
        b.tensor(batch, HIDDEN)?,
        b.tensor(batch, HIDDEN)?,
        b.tensor(batch, geo.qkv_width())?,
        b.tensor(batch, HEADS * HEAD_DIM)?,
        b.tensor(batch, HIDDEN)?,
    );
    let (mut gu, mut act, mut picked, mut picked_n, mut logits) = (
        b.tensor(batch, 2 * FFN)?,
        b.tensor(batch, FFN)?,
        b.tensor(batch, HIDDEN)?,
        b.tensor(batch, HIDDEN)?,
        b.tensor(batch, VOCAB)?,
    );
    let mut host = Vec::new();
    let mut step = |only_attention: bool| -> Result<(), turbokv_backend::Error> {
        b.embed(&embed, &ids, &mut x)?;
        for (l, pool) in layers.iter().zip(pools.iter_mut()) {
            if !only_attention {
                b.rms_norm(&x, &l.attn_norm, 1e-5, &mut xn)?;
                b.matmul_cat(&xn, &l.wqkv, &mut qkv)?;
            }
            b.write_kv(&mut qkv, &geo, &rope, None, &spans, pool)?;
            b.attention(&qkv, &geo, &spans, pool, &mut attn)?;
            if !only_attention {
                b.matmul(&attn, &l.wo, &mut proj)?;
                b.add_assign(&mut x, &proj)?;
                b.rms_norm(&x, &l.ffn_norm, 1e-5, &mut xn)?;
                b.matmul_cat(&xn, &l.gate_up, &mut gu)?;
                b.silu_mul(&gu, &mut act)?;
                b.matmul(&act, &l.down, &mut proj)?;
                b.add_assign(&mut x, &proj)?;
            }
        }
        if !only_attention {
            b.gather_rows(&x, &last, &mut picked)?;
            b.rms_norm(&picked, &final_norm, 1e-5, &mut picked_n)?;
            b.matmul(&picked_n, &lm_head, &mut logits)?;
        }
        b.to_host(&logits, &mut host)
    };
    let mut time = |only_attention: bool, reps: usize| -> Result<f64, turbokv_backend::Error> {
        for _ in 0..3 {
            step(only_attention)?;
        }
        let mut t = Vec::new();
        for _ in 0..reps {
            let s = Instant::now();
            step(only_attention)?;
            t.push(s.elapsed().as_secs_f64());
        }
        Ok(median(t))
    };
    let full = time(false, 30)?;
    let attn_only = time(true, 30)?;
    // Back-to-back launches of one op: host enqueue time per call vs completion time per call
    // (the larger of host and GPU time); tells launch-bound from GPU-bound.
    let burst = |f: &mut dyn FnMut() -> Result<(), turbokv_backend::Error>| -> Result<(f64, f64), turbokv_backend::Error> {
        const N: usize = 200;
        f()?;
        b.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..N {
            f()?;
        }
        let enq = t0.elapsed().as_secs_f64();
        b.synchronize()?;
        Ok((enq / N as f64 * 1e6, t0.elapsed().as_secs_f64() / N as f64 * 1e6))
    };
    let (attn_enq_us, attn_us) =
        burst(&mut || b.attention(&qkv, &geo, &spans, &pools[0], &mut attn))?;
    let (mm_enq_us, mm_us) = burst(&mut || b.matmul_cat(&xn, &layers[0].gate_up, &mut gu))?;
    let gate_up_bytes = layers[0].gate_up[0].bytes() as f64;
    let roofline = (weight_bytes + kv_bytes) as f64 / copy_bw;
    println!(
        "{}",
        serde_like(&[
            ("batch", batch as f64),
            ("ctx", ctx as f64),
            ("layers", n_layers as f64),
            ("blocks_per_sm", opts.attention_blocks_per_sm as f64),
            ("copy_bw_tb_s", copy_bw / 1e12),
            ("weight_gb", weight_bytes as f64 / 1e9),
            ("kv_gb", kv_bytes as f64 / 1e9),
            ("step_ms", full * 1e3),
            ("roofline_ms", roofline * 1e3),
            ("fraction_of_roofline", roofline / full),
            ("attention_write_kv_ms", attn_only * 1e3),
            ("attention_kv_tb_s", kv_bytes as f64 / attn_only / 1e12),
            ("attention_call_us", attn_us),
            ("attention_enqueue_us", attn_enq_us),
            (
                "attention_call_kv_tb_s",
                kv_bytes as f64 / n_layers as f64 / attn_us / 1e6
            ),
            ("gate_up_matmul_us", mm_us),
            ("gate_up_enqueue_us", mm_enq_us),
            ("gate_up_tb_s", gate_up_bytes / mm_us / 1e6),
        ])
    );
    Ok(())
}

/// A flat JSON object of numbers.
fn serde_like(fields: &[(&str, f64)]) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v:.4}"))
        .collect();
    format!("{{{}}}", body.join(", "))
}
