//! `turbokv bench attention --device cpu`: one decode step's attention alone on the CPU
//! backend, per KV format (presets with their windows), batch and context, beside the
//! machine's memory read bandwidth measured in the same run.
//!
//! In a model step the weights pass through the caches between two layers' attention, so a
//! layer's keys and values come from memory. Here the caches are made cold the same way: each
//! point fills enough copies of its sequences that at least [`COLD_BYTES`] are read between
//! two reads of the same copy, and each timed call attends over the next copy. The formats of
//! a point are timed in alternating rounds, so that a noisy machine's drift falls on all of
//! them alike.

use anyhow::{Result, bail};
use rayon::prelude::*;
use turbokv_backend::cpu::{CodeProducts, CpuBackend, CpuKvPool, CpuOptions, CpuTensor};
use turbokv_backend::cuda::DecodeAttentionCase;
use turbokv_backend::{AttnGeometry, Backend, Rope, RopeStyle, SeqSpan};
use turbokv_cache::KvLayout;

/// Bytes of cache read between two reads of the same copy: several times a CPU's last-level
/// cache, about the demo model's weights.
const COLD_BYTES: f64 = 128.0 * 1024.0 * 1024.0;
/// At most this many copies of a point's sequences.
const MAX_COPIES: usize = 512;
/// Tokens written per `write_kv` call while filling (bounds the activations' memory).
const FILL_CHUNK: usize = 1024;

fn splitmix(z: &mut u64) -> u64 {
    *z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut x = *z;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Uniform in [-1, 1).
fn unit(seed: &mut u64) -> f32 {
    (splitmix(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// The memory read bandwidth of the current rayon pool's threads, in bytes per second: the
/// best of a few parallel sums over a buffer of [`COLD_BYTES`] (an upper bound for a pass
/// that reads its bytes once, as decode attention does).
pub fn read_bandwidth() -> f64 {
    let words = (COLD_BYTES / 8.0) as usize;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    COLD_BYTES / best
}

/// A point's cache, filled and ready to time: [`Prepared::round`] runs one timed round.
pub struct Prepared {
    pool: CpuKvPool,
    geometry: AttnGeometry,
    qkv: CpuTensor,
    out: CpuTensor,
    /// The block tables of every sequence, `per_seq` blocks each.
    blocks: Vec<u32>,
    per_seq: usize,
    batch: usize,
    ctx: usize,
    /// K and V bytes one call reads (every cached token of every sequence once).
    pub kv_bytes: f64,
    /// Copies of the sequences rotated through.
    pub copies: usize,
    /// The output over the first copy, `[batch, n_heads · head_dim]`.
    pub output: Vec<f32>,
}

impl Prepared {
    /// Fills the cache of `case` on `backend` (its `rounds` are the caller's to run):
    /// enough copies of its `batch` sequences that a
    /// rotation through them reads at least [`COLD_BYTES`], every key and value random and
    /// written through the backend's write path (the encoders, and a window's exact copies).
    pub fn new(backend: &CpuBackend, case: &DecodeAttentionCase) -> Result<Self> {
        let g = case.geometry;
        if case.batch == 0 || case.ctx == 0 || case.block_size == 0 {
            bail!(
                "batch {}, ctx {} and block size {} must be positive",
                case.batch,
                case.ctx,
                case.block_size
            );
        }
        backend.check_kv_dtype(case.dtype, g.head_dim)?;
        let per_seq = case.ctx.div_ceil(case.block_size);
        let one = KvLayout::uniform(1, g.n_kv_heads, g.head_dim, case.dtype, case.block_size, 16)?;
        let kv_bytes = (case.batch * case.ctx) as f64 * one.bytes_per_token(0);
        let copies = ((COLD_BYTES / kv_bytes).ceil() as usize).clamp(1, MAX_COPIES);
        let num_blocks = copies * case.batch * per_seq;
        let mut layout = KvLayout::uniform(
            1,
            g.n_kv_heads,
            g.head_dim,
            case.dtype,
            case.block_size,
            num_blocks * case.block_size,
        )?;
        layout.window = case.window;
        let mut pool = backend.kv_pool(&layout, 0)?;

        let mut seed = case.seed;
        let mut blocks: Vec<u32> = (0..num_blocks as u32).collect();
        if case.shuffled_blocks {
            for i in (1..blocks.len()).rev() {
                let j = (splitmix(&mut seed) % (i as u64 + 1)) as usize;
                blocks.swap(i, j);
            }
        }
        // RoPE with zero frequencies leaves the keys as drawn.
        let rope = Rope {
            inv_freq: vec![0.0; g.head_dim / 2],
            style: RopeStyle::HalfSplit,
        };
        let width = g.qkv_width();
        for table in blocks.chunks(per_seq) {
            let mut p0 = 0;
            while p0 < case.ctx {
                let n = FILL_CHUNK.min(case.ctx - p0);
                let data: Vec<f32> = (0..n * width).map(|_| unit(&mut seed)).collect();
                let mut qkv = CpuTensor::from_vec(data, n, width)?;
                let span = SeqSpan {
                    first_row: 0,
                    n_tokens: n,
                    first_pos: p0,
                    blocks: table,
                };
                backend.write_kv(&mut qkv, &g, &rope, None, &[span], &mut pool)?;
                p0 += n;
            }
        }
        let q: Vec<f32> = (0..case.batch * width).map(|_| unit(&mut seed)).collect();
        let mut me = Prepared {
            pool,
            geometry: g,
            qkv: CpuTensor::from_vec(q, case.batch, width)?,
            out: backend.tensor(case.batch, g.n_heads * g.head_dim)?,
            blocks,
            per_seq,
            batch: case.batch,
            ctx: case.ctx,
            kv_bytes,
            copies,
            output: Vec::new(),
        };
        // One untimed pass over every copy, the first copy's output kept.
        for c in (0..copies).rev() {
            me.call(backend, c)?;
        }
        backend.to_host(&me.out, &mut me.output)?;
        Ok(me)
    }

    /// One decode step's attention over copy `c`.
    fn call(&mut self, backend: &CpuBackend, c: usize) -> Result<()> {
        let first = c * self.batch * self.per_seq;
        let spans: Vec<SeqSpan<'_>> = self.blocks[first..first + self.batch * self.per_seq]
            .chunks(self.per_seq)
            .enumerate()
            .map(|(i, blocks)| SeqSpan {
                first_row: i,
                n_tokens: 1,
                first_pos: self.ctx - 1,
                blocks,
            })
            .collect();
        backend.attention(&self.qkv, &self.geometry, &spans, &self.pool, &mut self.out)?;
        Ok(())
    }

    /// One timed round (a pass over the copies, at least 8 calls): seconds per call.
    pub fn round(&mut self, backend: &CpuBackend) -> Result<f64> {
        let calls = self.copies.max(8);
        let t = std::time::Instant::now();
        for i in 0..calls {
            self.call(backend, i % self.copies)?;
        }
        Ok(t.elapsed().as_secs_f64() / calls as f64)
    }
}

/// The configurations `bench attention --device cpu` times: the environment's options, and
/// with `--compare-variants` the compressed formats with exact f32 products of the decoded
/// codes instead of int8 ones. `(label, backend, whether it times compressed formats only)`.
pub fn configs(base: CpuOptions, compare: bool) -> Vec<(String, CpuBackend, Option<bool>)> {
    let mut v = vec![("default".to_string(), CpuBackend::with_options(base), None)];
    if compare {
        v.push((
            "f32-products".to_string(),
            CpuBackend::with_options(CpuOptions {
                code_products: CodeProducts::F32,
                ..base
            }),
            Some(true),
        ));
    }
    v
}

/// A description of the CPU for the report: its model name and the pool's threads.
pub fn describe() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("cpu ({model}, {} threads)", rayon::current_num_threads())
}
