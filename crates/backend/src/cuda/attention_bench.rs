//! Decode attention timed alone, over paged caches of random values (`turbokv bench
//! attention`).
//!
//! The caches are rotated through so that at least [`COLD_BYTES`] are read between two reads
//! of the same one (a model reads every layer's cache once per step; one cache read again and
//! again would be served from the 60 MB L2). Launches are queued behind a busy-wait kernel, so
//! the host's launch latency stays out of the interval the events measure.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use turbokv_cache::{KvLayout, KvWindow};
use turbokv_codec::KvDtype;

use super::{CudaBackend, CudaKvPool, cuda_err, unsupported_kv};
use crate::backend::{AttnGeometry, SeqSpan};
use crate::{Backend, Error};

/// Bytes of cache read between two reads of the same one.
const COLD_BYTES: usize = 512 << 20;
/// Most caches rotated through.
const MAX_POOLS: usize = 16;

/// One decode-attention case: `batch` sequences of `ctx` cached tokens each, one new query
/// row per sequence (at position `ctx - 1`), in a paged cache of `dtype`.
#[derive(Clone, Debug)]
pub struct DecodeAttentionCase {
    /// Heads and head_dim.
    pub geometry: AttnGeometry,
    /// The cache's number format.
    pub dtype: KvDtype,
    /// Sinks and recent tokens kept at f16 beside the codes (coded dtypes; a preset's window).
    pub window: KvWindow,
    /// Sequences.
    pub batch: usize,
    /// Cached tokens per sequence (the new one included).
    pub ctx: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Deal the cache blocks to the sequences in a random order (else consecutively).
    pub shuffled_blocks: bool,
    /// Timed rounds (the median is reported).
    pub rounds: usize,
    /// Seed of the cache contents, queries and block tables.
    pub seed: u64,
}

/// What [`CudaBackend::time_decode_attention`] measured.
#[derive(Clone, Debug)]
pub struct DecodeAttentionTiming {
    /// Median time of one launch, in seconds.
    pub seconds: f64,
    /// The fastest round's time per launch, in seconds.
    pub best_seconds: f64,
    /// K and V bytes one launch reads (every cached token of every sequence once).
    pub kv_bytes: f64,
    /// Caches rotated through.
    pub pools: usize,
    /// The attention output over the first cache, `[batch, n_heads · head_dim]` (so that
    /// kernel variants can be checked against each other on the same inputs).
    pub output: Vec<f32>,
}

fn splitmix(z: &mut u64) -> u64 {
    *z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut x = *z;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl CudaBackend {
    /// Times [`Backend::attention`] for one decode step of `case` (see the module docs).
    pub fn time_decode_attention(
        &self,
        case: &DecodeAttentionCase,
    ) -> Result<DecodeAttentionTiming, Error> {
        let g = &case.geometry;
        // Coded pools are filled with random f16 magnitudes: random codes, and finite
        // non-negative scales, as an encoder writes (the kernels' speed does not depend on the
        // values, but a negative scale sends a tile of int8 value sums to the f16 ones).
        let form = match case.dtype {
            KvDtype::Bf16 => 1i32,
            KvDtype::F16 => 0i32,
            KvDtype::Fp8 => {
                self.check_kv_dtype(KvDtype::Fp8, g.head_dim)?;
                3i32
            }
            other if other.is_compressed() => {
                self.check_kv_dtype(other, g.head_dim)?;
                2i32
            }
            other => return Err(unsupported_kv(other)),
        };
        let bad = |detail: String| Error::Cuda {
            op: "bench attention",
            detail,
        };
        if case.batch == 0 || case.ctx == 0 || case.block_size == 0 {
            return Err(bad(format!(
                "batch {}, ctx {} and block size {} must be positive",
                case.batch, case.ctx, case.block_size
            )));
        }
        let per_seq = case.ctx.div_ceil(case.block_size);
        let num_blocks = case.batch * per_seq;
        let mut layout = KvLayout::uniform(
            1,
            g.n_kv_heads,
            g.head_dim,
            case.dtype,
            case.block_size,
            num_blocks * case.block_size,
        )
        .map_err(|e| bad(e.to_string()))?;
        layout.window = case.window;
        let first = self.kv_pool(&layout, 0)?;
        let pool_bytes = 2 * (first.k.len() + first.v.len());
        let (free, _) = self.memory_info()?;
        let fit = (free.saturating_sub(2 << 30)) / pool_bytes.max(1);
        if fit == 0 {
            return Err(bad(format!(
                "a cache of batch {} × ctx {} needs {:.1} GB, {:.1} GB are free",
                case.batch,
                case.ctx,
                pool_bytes as f64 / 1e9,
                free as f64 / 1e9
            )));
        }
        let n_pools = COLD_BYTES.div_ceil(pool_bytes).clamp(1, MAX_POOLS).min(fit);
        let mut seed = case.seed;
        let mut pools: Vec<CudaKvPool> = Vec::with_capacity(n_pools);
        let mut first = Some(first);
        for _ in 0..n_pools {
            let mut p = match first.take() {
                Some(p) => p,
                None => self.kv_pool(&layout, 0)?,
            };
            for half in [&mut p.k, &mut p.v] {
                let n = half.len() as u64;
                let s = splitmix(&mut seed);
                let scale = 1.0f32;
                let mut b = self.stream.launch_builder(&self.k.fill_random_kv);
                b.arg(half).arg(&n).arg(&s).arg(&scale).arg(&form);
                // SAFETY: the kernel writes `n` elements of the buffer, which holds `n`.
                unsafe { b.launch(self.grid_1d(n as usize)) }
                    .map_err(cuda_err("fill_random_kv"))?;
            }
            pools.push(p);
        }
        // Block tables: the blocks (shuffled, or in order), `per_seq` to each sequence.
        let mut perm: Vec<u32> = (0..num_blocks as u32).collect();
        let shuffle = if case.shuffled_blocks { perm.len() } else { 0 };
        for i in (1..shuffle).rev() {
            let j = (splitmix(&mut seed) % (i as u64 + 1)) as usize;
            perm.swap(i, j);
        }
        let spans: Vec<SeqSpan<'_>> = perm
            .chunks(per_seq)
            .enumerate()
            .map(|(i, blocks)| SeqSpan {
                first_row: i,
                n_tokens: 1,
                first_pos: case.ctx - 1,
                blocks,
            })
            .collect();
        // A windowed pool: exact blocks for the spans' windows, filled like the codes.
        for p in &mut pools {
            if let Some(x) = &mut p.exact {
                x.prepare(&self.stream, &spans, true)?;
                for half in [&mut x.k, &mut x.v] {
                    let n = half.len() as u64;
                    let s = splitmix(&mut seed);
                    let (scale, f16) = (1.0f32, 0i32);
                    let mut b = self.stream.launch_builder(&self.k.fill_random_kv);
                    b.arg(half).arg(&n).arg(&s).arg(&scale).arg(&f16);
                    // SAFETY: the kernel writes `n` elements of the buffer, which holds `n`.
                    unsafe { b.launch(self.grid_1d(n as usize)) }
                        .map_err(cuda_err("fill_random_kv"))?;
                }
            }
        }
        let width = g.qkv_width();
        let q: Vec<f32> = (0..case.batch * width)
            .map(|_| (splitmix(&mut seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect();
        let qkv = self.tensor_from_host(&q, case.batch, width)?;
        let mut out = self.tensor(case.batch, g.n_heads * g.head_dim)?;
        for p in pools.iter().rev() {
            self.attention(&qkv, g, &spans, p, &mut out)?;
        }
        let mut output = Vec::new();
        self.to_host(&out, &mut output)?;

        let launches = n_pools.max(8);
        let ev = || {
            self.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda_err("event"))
        };
        let (start, end) = (ev()?, ev()?);
        let mut per_launch = Vec::with_capacity(case.rounds.max(1));
        let mut sleep_ns: u64 = 200_000 + 40_000 * launches as u64;
        for _ in 0..case.rounds.max(1) {
            let mut b = self.stream.launch_builder(&self.k.gpu_sleep);
            b.arg(&sleep_ns);
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel takes one u64 by value and touches no memory.
            unsafe { b.launch(one) }.map_err(cuda_err("gpu_sleep"))?;
            let queued = std::time::Instant::now();
            start.record(&self.stream).map_err(cuda_err("event"))?;
            for i in 0..launches {
                self.attention(&qkv, g, &spans, &pools[i % n_pools], &mut out)?;
            }
            end.record(&self.stream).map_err(cuda_err("event"))?;
            // The busy-wait must outlast the host's queueing, or host time leaks in.
            let host_ns = queued.elapsed().as_nanos() as u64;
            sleep_ns = sleep_ns.max(2 * host_ns);
            let ms = start.elapsed_ms(&end).map_err(cuda_err("event"))?;
            per_launch.push(f64::from(ms) * 1e-3 / launches as f64);
        }
        per_launch.sort_by(f64::total_cmp);
        let kv_bytes = (case.batch * case.ctx) as f64 * layout.bytes_per_token(0);
        Ok(DecodeAttentionTiming {
            seconds: per_launch[per_launch.len() / 2],
            best_seconds: per_launch[0],
            kv_bytes,
            pools: n_pools,
            output,
        })
    }
}
