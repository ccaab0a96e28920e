//! The CUDA backend: f32 activations and bf16 weights in device memory, NVRTC-compiled kernels
//! for the row-wise ops, the KV write, paged attention and skinny (decode) matmuls, cuBLAS
//! for the other matmuls.
//!
//! Nothing CUDA is needed to build: `cudarc` loads libcuda, libnvrtc and libcublas at run time.
//! [`CudaBackend::new`] first checks that those libraries can be opened (cudarc panics on a
//! missing one) and returns [`Error::CudaUnavailable`] with a one-line reason otherwise, so a
//! caller can fall back to the CPU.
//!
//! Layouts:
//! - [`CudaTensor`]: row-major `[rows, cols]` f32; matmul inputs are converted to bf16 in a
//!   scratch buffer and multiplied with f32 accumulation and f32 output.
//! - [`CudaMatrix`]: row-major `[rows, cols]` bf16 (GGUF formats dequantized on the host).
//! - [`CudaKvPool`]: per layer, K and V each `[num_blocks, kv_heads, block_size, head_dim]`
//!   16-bit values (f16 or bf16), the same layout as the CPU pool; coded pools (int8, fp8,
//!   TurboQuant) keep the codec's bytes per token in GPU-friendly bit orders (`codes.rs`).
//!
//! All work runs on one stream in submission order; host-visible results appear at
//! [`Backend::to_host`](crate::Backend::to_host), which synchronises.
//!
//! [`CudaBackend::run_graphed`] replays whole steps (decode) as CUDA graphs; see `graph.rs`.
//! Matmuls of few activation rows (decode; ≤ 2 by default, see [`CudaOptions::gemv_max_rows`])
//! run on a hand-written GEMV kernel with fused epilogues (residual add, `silu(g)·u`, RMSNorm
//! in front, and for the qkv projection RoPE plus the KV write:
//! [`Backend::project_qkv_write_kv`](crate::Backend::project_qkv_write_kv)), larger ones on
//! cuBLAS (`CudaBackend::use_gemv` in `ops.rs` decides).
//! Attention has four kernels, all over bf16 or f16 KV: a tensor-core tile kernel for prefill
//! spans (head_dim 64/128), a tensor-core split-K kernel for decode rows (head_dim 64/128, up
//! to 16 query heads per kv head), a SIMT row-parallel split-K kernel for the other decode rows
//! (head_dim 256, or with the tensor-core one off; up to 8 query heads per kv head), and the
//! original tiled kernel for everything else. Coded pools have their own decode kernels, which
//! read the codes in registers (head_dim 64/128/256, windows and sinks included). Sampling ends a step with
//! [`Backend::to_host_top_k`](crate::Backend::to_host_top_k): a device selection
//! (`kernels/sample.cu`) that writes only each row's candidates, max and log-sum-exp into
//! mapped host memory; greedy decoding can instead end it with
//! [`Backend::pick_greedy`](crate::Backend::pick_greedy), a many-block argmax whose ids stay
//! on the device for the next step's embedding ([`CudaPicks`], `picks.rs`), so the host never
//! stands between steps.

mod attention;
mod attention_bench;
mod code_layout;
mod codes;
mod exact;
mod graph;
mod kernels;
mod launch;
mod ops;
pub(crate) mod parts;
mod picks;
mod step;

pub use attention_bench::{DecodeAttentionCase, DecodeAttentionTiming};
pub use graph::GraphStats;
pub use kernels::{DECODE_SETS, DECODE_VARIANTS, DecodeSet, DecodeVariant, MANY_PAIRS};
pub use picks::CudaPicks;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use half::bf16;
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

use crate::Error;
use graph::State;
use kernels::Kernels;

/// Bytes of the cuBLAS workspace (NVIDIA recommends 32 MiB on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// Maps a CUDA library error to [`Error::Cuda`].
pub(crate) fn cuda_err<E: std::fmt::Debug>(op: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::Cuda {
        op,
        detail: format!("{e:?}"),
    }
}

/// Row-major `[rows, cols]` f32 activations in device memory.
#[derive(Debug)]
pub struct CudaTensor {
    buf: CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

impl CudaTensor {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// A weight matrix resident as row-major `[rows, cols]` bf16.
#[derive(Debug)]
pub struct CudaMatrix {
    data: CudaSlice<bf16>,
    rows: usize,
    cols: usize,
}

impl CudaMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes in device memory.
    pub fn bytes(&self) -> usize {
        self.rows * self.cols * 2
    }
}

/// An f32 vector in device memory.
#[derive(Debug)]
pub struct CudaVector {
    data: CudaSlice<f32>,
    len: usize,
}

/// One attention layer's paged K and V: 16-bit pools are each `[num_blocks, kv_heads,
/// block_size, head_dim]` values; coded pools (`codes`) hold each (block, kv head) in the
/// codec's block layout (the u16 slices are then bytes).
#[derive(Debug)]
pub struct CudaKvPool {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    is_bf16: bool,
    codes: Option<codes::PoolCodes>,
    /// The f16 copies of a coded pool's full-precision window (see `exact.rs`).
    exact: Option<exact::ExactTokens>,
    kv_heads: usize,
    block_size: usize,
    head_dim: usize,
    num_blocks: usize,
}

impl crate::KvPoolBlocks for CudaKvPool {
    fn release_blocks(&mut self, blocks: &[u32]) {
        if let Some(x) = &mut self.exact {
            x.slots.release(blocks);
        }
    }
}

impl CudaKvPool {
    /// Exact blocks in use (the f16 copies of a full-precision window), when the pool has a
    /// window.
    pub fn exact_blocks_used(&self) -> Option<usize> {
        self.exact.as_ref().map(|x| x.slots.used())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The u16 ranges of physical block `block` in the K and V slices, and the u16 count of
    /// one kv head's block in each (16-bit: block_size × head_dim values; coded: the
    /// codec's block bytes / 2). Heads of a block are contiguous in both layouts.
    fn block_ranges(
        &self,
        block: u32,
    ) -> Result<(std::ops::Range<usize>, std::ops::Range<usize>, usize, usize), Error> {
        let b = block as usize;
        if b >= self.num_blocks {
            return Err(crate::shape::shape(
                "kv block",
                format!("block {b} of a pool of {}", self.num_blocks),
            ));
        }
        let (kh, vh) = match &self.codes {
            None => (
                self.block_size * self.head_dim,
                self.block_size * self.head_dim,
            ),
            Some(c) => (c.k_layout.total_bytes / 2, c.v_layout.total_bytes / 2),
        };
        let n = self.kv_heads;
        Ok((
            b * n * kh..(b + 1) * n * kh,
            b * n * vh..(b + 1) * n * vh,
            kh,
            vh,
        ))
    }
    /// Physical blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}

/// Construction options.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Where compiled PTX is cached between processes (`None`: compile every time); a cubin
    /// there under the same name (`scripts/cuda-check.py --ptx-cache`) is loaded first.
    pub ptx_cache: Option<PathBuf>,
    /// Attention splits long key ranges until there are this many blocks per SM (decode of
    /// few sequences); at least 1. The default, 2, was the best overall of 1/2/4/8 on an H200
    /// (llama3-8b shape, batch 1/8/32 at 4k context, batch 1 at 32k); 1/4/8 were again no
    /// better at batch 1 with the GEMV kernel.
    pub attention_blocks_per_sm: usize,
    /// Matmuls of at most this many activation rows (decode of a few sequences) run on the
    /// GEMV kernel (`kernels/gemv.cu`), larger ones on cuBLAS; 0 sends everything to cuBLAS.
    /// Capped at 8 (the kernels instantiated). The default is [`DEFAULT_GEMV_MAX_ROWS`].
    pub gemv_max_rows: usize,
    /// Launch the GEMV kernel with programmatic dependent launch (Hopper and newer) when the
    /// kernel ahead of it is one of the backend's own (norm, attention combine, GEMV): it
    /// starts and streams its first weights while that kernel finishes. (Launching the norm,
    /// KV write and attention kernels that way too measured no better, and all five together
    /// worse: 5.1 vs 4.85 ms per llama3-8b decode step.) Default on.
    pub pdl: bool,
    /// `to_host_top_k` selects on the device (`kernels/sample.cu`) and copies back only the
    /// candidates instead of whole logit rows (513 KB per sequence for a 128k vocabulary:
    /// 0.06 / 0.4 / 1.1 ms of a llama3-8b step at batch 1 / 8 / 32 on an H200). Default on;
    /// off copies the rows and selects on the host (tests compare the two).
    pub device_top_k: bool,
    /// Attention with head_dim 64 or 128 and at most 16 query heads per kv head runs the
    /// tensor-core split-K kernel (`attn_dec_mma_*`, MMAs in the cache's bf16 or f16) where
    /// the SIMT row kernel would otherwise run (decode, short spans). Default on; off runs the
    /// SIMT kernels (tests cover both).
    pub dec_mma: bool,
    /// A decode step's KV write (RoPE, then the new keys and values into the pool) runs in
    /// the epilogue of the qkv matmul where that takes the GEMV kernel and the model has no
    /// q/k norm ([`Backend::project_qkv_write_kv`](crate::Backend::project_qkv_write_kv)):
    /// one launch less per layer, and the attention starts right behind the matmul. Default
    /// on; off runs the separate `write_kv` launch (tests cover both).
    pub rope_gemv: bool,
    /// The decode attention template instantiation to run for its head_dim (one of
    /// [`DECODE_VARIANTS`]) instead of the default; for measurements (`turbokv bench
    /// attention`). `None`: the default.
    pub decode_variant: Option<DecodeVariant>,
    /// Warps per block of the tensor-core prefill attention: 4 (64 query vectors per block)
    /// or 8 (128: each K/V tile read from L2 once for twice the queries). Others are an error.
    pub prefill_warps: usize,
    /// Prefill spans over a coded pool (head_dim 64 or 128) run through tensor cores: the keys
    /// they read from codes are dequantized once per launch into f16 rows, then a tile kernel
    /// reads those and the exact blocks. Default on; off runs the coded decode kernels for
    /// every row, which unpack each key once per row (tests cover both).
    pub coded_prefill_tiles: bool,
    /// Decode over TurboQuant keys and values (head_dim 64 or 128, GQA groups up to 8) runs
    /// the kernel whose key products are int8 MMAs (`attn_codes_k8_*`: key codes looked up as
    /// int8 centroids, each within 0.5% of the largest). Default on; off runs the f16
    /// keys-as-M kernel (tests cover both).
    pub coded_int8_keys: bool,
    /// With `coded_int8_keys`, 2- and 3-bit TurboQuant values are summed through int8 MMAs too
    /// (`attn_codes_k8v_*`: codes looked up in the CPU backend's int8 value table, weights ×
    /// value scales rounded to u8 per 32-key tile and head; a tile where one of those is
    /// negative or not finite — never in a cache the encoders wrote, as scales are norms —
    /// takes the f16 sums). Default on: measured 5–16% faster than the f16 value sums from
    /// batch 8 × 32k up (BENCHMARKS.md); off sums every value as f16 (tests cover both).
    pub coded_int8_values: bool,
    /// The number of key splits of the whole-width coded decode kernels (`attn_codes_*`),
    /// instead of the wave model's choice (`wave_splits` in `cuda/attention.rs`); for measurements
    /// (`turbokv bench attention --coded-splits`). `None`: the model's.
    pub coded_splits: Option<usize>,
    /// The int8-product TurboQuant decode kernels take their split count from the per-SM load
    /// model (`sm_load_splits` in `cuda/attention.rs`) where the wave model's splits are
    /// short (under 8,192 keys); with a window's exact splits at as many (row, kv head) pairs
    /// as SMs, the coded blocks then fill the GPU's slots. Default on: attention 5–29% faster
    /// at b1–b8 up to 32k on an H100, compact's decode step 1–2% faster at b1 × 32k and
    /// b8 × 8k (BENCHMARKS.md, session 39). Off: the wave model for every kernel.
    pub sm_load_splits: bool,
    /// A windowed coded pool's exact splits (its sinks and recent keys, 64 a split) run inside
    /// the coded blocks — coded block `s` of `n` also takes exact splits `s`, `s + n`, … after
    /// its own keys — instead of as blocks of their own in the same launch. Short exact blocks
    /// beside long coded ones left SMs idle at the end of compact's launch at one coded split
    /// per pair (BENCHMARKS.md, session 41). Off: separate exact blocks.
    pub fold_exact_splits: bool,
    /// Keys of each of a windowed coded pool's exact splits (rounded up to whole 64-key
    /// chunks, which a split reads one after the other), for measurements; `None`: one chunk a
    /// split. Splits of several chunks ran up to 22% faster in attention alone at b8 × 32k, and
    /// slower in every decode step measured (BENCHMARKS.md, session 45).
    pub exact_split_keys: Option<usize>,
}

/// See [`CudaOptions::gemv_max_rows`]. On an H200 (llama3-8b shapes) the GEMV kernel beat
/// cuBLAS for 1 and 2 rows and lost the decode step at 4 and 8 (BENCHMARKS.md).
pub const DEFAULT_GEMV_MAX_ROWS: usize = 2;

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            ptx_cache: Some(std::env::temp_dir().join("turbokv-ptx")),
            attention_blocks_per_sm: 2,
            gemv_max_rows: DEFAULT_GEMV_MAX_ROWS,
            pdl: true,
            device_top_k: true,
            dec_mma: true,
            rope_gemv: true,
            decode_variant: None,
            prefill_warps: 4,
            coded_prefill_tiles: true,
            coded_int8_keys: true,
            coded_int8_values: true,
            coded_splits: None,
            sm_load_splits: true,
            fold_exact_splits: false,
            exact_split_keys: None,
        }
    }
}

/// The CUDA backend on one GPU.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    ordinal: usize,
    name: String,
    arch: &'static str,
    sms: usize,
    /// Dynamic shared memory a block may opt into, in bytes.
    smem_limit: usize,
    /// See [`CudaOptions::attention_blocks_per_sm`].
    blocks_per_sm: usize,
    /// See [`CudaOptions::gemv_max_rows`] (already capped).
    gemv_max_rows: usize,
    /// See [`CudaOptions::pdl`] (and the GPU is sm_90 or newer).
    pdl: bool,
    /// See [`CudaOptions::device_top_k`].
    pub(crate) device_top_k: bool,
    /// See [`CudaOptions::dec_mma`].
    dec_mma: bool,
    /// See [`CudaOptions::rope_gemv`].
    rope_gemv: bool,
    /// See [`CudaOptions::decode_variant`].
    decode_variant: Option<DecodeVariant>,
    /// See [`CudaOptions::prefill_warps`].
    prefill_warps: usize,
    /// See [`CudaOptions::coded_prefill_tiles`].
    coded_prefill_tiles: bool,
    /// See [`CudaOptions::coded_int8_keys`].
    coded_int8_keys: bool,
    /// See [`CudaOptions::coded_int8_values`].
    coded_int8_values: bool,
    /// See [`CudaOptions::coded_splits`].
    coded_splits: Option<usize>,
    /// See [`CudaOptions::sm_load_splits`].
    sm_load_splits: bool,
    /// See [`CudaOptions::fold_exact_splits`].
    fold_exact_splits: bool,
    /// See [`CudaOptions::exact_split_keys`].
    exact_split_keys: Option<usize>,
    /// Blocks of each decode variant (index of [`DECODE_VARIANTS`]) resident on the whole GPU
    /// at once, from the occupancy calculator with its pipeline's shared memory.
    decode_slots: Vec<usize>,
    /// The same for the coded decode kernels (`codes::CodeVariant::all()` order).
    code_slots: Vec<usize>,
    /// The same for the keys-as-M coded kernels.
    code_m_slots: Vec<usize>,
    /// The same for the coded kernels with int8 key products (0 where not instantiated).
    code_k8_slots: Vec<usize>,
    /// The same for the kernels with int8 value products.
    code_k8v_slots: Vec<usize>,
    /// The same for the decode kernels on parts pools, by (index in `parts::DECODE_KERNELS`,
    /// dynamic shared memory): a pool's record sizes set the latter, so these are found at
    /// the first launch over each and kept.
    parts_slots: Mutex<HashMap<(usize, usize), usize>>,
    state: Mutex<State>,
    /// cuBLAS workspace set on the handle (so that captured GEMMs allocate nothing).
    _blas_workspace: CudaSlice<u8>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&ops::describe(self))
    }
}

/// The GPU ordinal a device spec names: `cuda` → 0, `cuda:N` → N; `None` for other specs.
pub fn parse_device(spec: &str) -> Option<usize> {
    match spec.strip_prefix("cuda") {
        Some("") => Some(0),
        Some(rest) => rest.strip_prefix(':')?.parse().ok(),
        None => None,
    }
}

/// Checks that the CUDA driver, NVRTC and cuBLAS libraries can be loaded, without touching
/// any of them (cudarc panics on first use of a missing library).
pub fn probe() -> Result<(), Error> {
    let missing = |lib: &str| Error::CudaUnavailable {
        reason: format!("{lib} not found (no NVIDIA driver/CUDA 13 libraries on the library path)"),
    };
    // SAFETY: each check only tries to dlopen the library under its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(missing("libcuda"));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(missing("libnvrtc"));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(missing("libcublas"));
    }
    Ok(())
}

/// Blocks of kernel `f` resident on the whole GPU (`sms` multiprocessors) at once, launched
/// with `threads` threads and `smem` bytes of dynamic shared memory (occupancy calculator).
fn resident_blocks(
    f: &cudarc::driver::CudaFunction,
    threads: usize,
    smem: usize,
    sms: usize,
) -> Result<usize, Error> {
    f.occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
        .map(|n| n.max(1) as usize * sms)
        .map_err(cuda_err("occupancy"))
}

impl CudaBackend {
    /// The backend on GPU `ordinal`, PTX cached in the temp directory.
    pub fn new(ordinal: usize) -> Result<Self, Error> {
        Self::with_options(ordinal, &CudaOptions::default())
    }

    /// The backend for a device spec (`cuda` or `cuda:N`).
    pub fn from_spec(spec: &str) -> Result<Self, Error> {
        let ordinal = parse_device(spec).ok_or_else(|| Error::CudaUnavailable {
            reason: format!("'{spec}' is not a CUDA device (cuda or cuda:N)"),
        })?;
        Self::new(ordinal)
    }

    /// The backend on GPU `ordinal` with `opts`.
    pub fn with_options(ordinal: usize, opts: &CudaOptions) -> Result<Self, Error> {
        probe()?;
        // A library that loads but lacks a symbol makes cudarc panic: report it as unavailable.
        std::panic::catch_unwind(|| Self::init(ordinal, opts)).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(Error::CudaUnavailable {
                reason: format!("CUDA library failed to initialise: {msg}"),
            })
        })
    }

    fn init(ordinal: usize, opts: &CudaOptions) -> Result<Self, Error> {
        let unavailable = |what: &str| {
            let what = what.to_string();
            move |e: cudarc::driver::DriverError| Error::CudaUnavailable {
                reason: format!("{what}: {e}"),
            }
        };
        let count = CudaContext::device_count().map_err(unavailable("no usable CUDA device"))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::CudaUnavailable {
                reason: format!("cuda:{ordinal} requested but {count} GPU(s) present"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(unavailable("cannot open the GPU"))?;
        // SAFETY: the backend uses a single stream, so the per-buffer event tracking that
        // orders work across streams is unnecessary.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        let arch = kernels::arch_name(major, minor)?;
        let name = ctx.name().map_err(cuda_err("device name"))?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(cuda_err("device attribute"))?
            .max(1) as usize;
        let smem_limit = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(cuda_err("device attribute"))?
            .max(48 * 1024) as usize;
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().map_err(cuda_err("stream"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_err("cublas init"))?;
        let blas_workspace = stream
            .alloc_zeros::<u8>(BLAS_WORKSPACE)
            .map_err(cuda_err("alloc cublas workspace"))?;
        {
            let (wp, _g) = blas_workspace.device_ptr(&stream);
            // SAFETY: the workspace outlives the handle (both are fields of the backend, the
            // handle declared first so it is destroyed first) and holds BLAS_WORKSPACE bytes.
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    wp as *mut _,
                    BLAS_WORKSPACE,
                )
            }
            .result()
            .map_err(cuda_err("cublas workspace"))?;
        }
        let k = Kernels::load(&ctx, arch, opts.ptx_cache.as_deref())?;
        for f in k
            .attn_partial
            .iter()
            .chain(&k.attn_rows)
            .chain(&k.attn_mma)
            .chain(&k.attn_mma8)
            .chain(&k.attn_dec)
            .chain(k.attn_codes.iter().flatten())
            .chain(&k.attn_codes_m)
            .chain(k.attn_codes_k8.iter().flatten())
            .chain(k.attn_codes_k8v.iter().flatten())
            .chain(&k.attn_parts)
        {
            // The opt-in limit covers static and dynamic shared memory together.
            let fixed = f
                .shared_size_bytes()
                .map_err(cuda_err("function attribute"))?;
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_limit as i32 - fixed,
            )
            .map_err(cuda_err("function attribute"))?;
        }
        let resident = |f: &cudarc::driver::CudaFunction, threads: usize, smem: usize| {
            resident_blocks(f, threads, smem, sms)
        };
        let decode_slots = DECODE_VARIANTS
            .iter()
            .zip(&k.attn_dec)
            .map(|(v, f)| resident(f, v.threads(), v.smem_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        // (0 where the template is not instantiated: never launched.)
        let code_slots = codes::CodeVariant::all()
            .iter()
            .zip(&k.attn_codes)
            .map(|(v, f)| {
                f.as_ref()
                    .map_or(Ok(0), |f| resident(f, v.threads(), v.smem_bytes()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let code_m_slots = codes::CodeVariant::all()
            .iter()
            .zip(&k.attn_codes_m)
            .map(|(v, f)| resident(f, v.threads(), v.smem_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        let optional_slots = |fs: &[Option<cudarc::driver::CudaFunction>],
                              smem: fn(&codes::CodeVariant) -> usize| {
            codes::CodeVariant::all()
                .iter()
                .zip(fs)
                .map(|(v, f)| {
                    f.as_ref()
                        .map_or(Ok(0), |f| resident(f, v.threads(), smem(v)))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let code_k8_slots = optional_slots(&k.attn_codes_k8, codes::CodeVariant::smem_bytes)?;
        let code_k8v_slots = optional_slots(
            &k.attn_codes_k8v,
            codes::CodeVariant::int8_values_smem_bytes,
        )?;
        if let Some(v) = opts.decode_variant
            && !DECODE_VARIANTS.contains(&v)
        {
            return Err(Error::Cuda {
                op: "decode attention",
                detail: format!(
                    "{v:?} is not one of the instantiated variants {DECODE_VARIANTS:?}"
                ),
            });
        }
        if !matches!(opts.prefill_warps, 4 | 8) {
            return Err(Error::Cuda {
                op: "prefill attention",
                detail: format!(
                    "{} warps per block: 4 or 8 are instantiated",
                    opts.prefill_warps
                ),
            });
        }
        Ok(Self {
            ctx,
            stream,
            blas,
            k,
            ordinal,
            name,
            arch,
            sms,
            smem_limit,
            blocks_per_sm: opts.attention_blocks_per_sm.max(1),
            gemv_max_rows: opts.gemv_max_rows.min(kernels::GEMV_MAX_ROWS),
            pdl: opts.pdl && major >= 9,
            device_top_k: opts.device_top_k,
            dec_mma: opts.dec_mma,
            rope_gemv: opts.rope_gemv,
            decode_variant: opts.decode_variant,
            prefill_warps: opts.prefill_warps,
            coded_prefill_tiles: opts.coded_prefill_tiles,
            coded_int8_keys: opts.coded_int8_keys,
            coded_int8_values: opts.coded_int8_values,
            coded_splits: opts.coded_splits.map(|s| s.max(1)),
            sm_load_splits: opts.sm_load_splits,
            fold_exact_splits: opts.fold_exact_splits,
            exact_split_keys: opts.exact_split_keys,
            decode_slots,
            code_slots,
            code_m_slots,
            code_k8_slots,
            code_k8v_slots,
            parts_slots: Mutex::new(HashMap::new()),
            state: Mutex::new(State::default()),
            _blas_workspace: blas_workspace,
        })
    }

    /// The backend's mutable state (scratch buffers, graph machinery).
    pub(crate) fn lock_state(&self, op: &'static str) -> Result<MutexGuard<'_, State>, Error> {
        self.state.lock().map_err(|_| Error::Cuda {
            op,
            detail: "backend state poisoned".into(),
        })
    }

    /// Blocks of the parts decode kernel `kernel` (index in `parts::DECODE_KERNELS`) resident
    /// on the whole GPU at once with `smem` bytes of dynamic shared memory.
    pub(crate) fn parts_slots(&self, kernel: usize, smem: usize) -> Result<usize, Error> {
        let mut slots = self.parts_slots.lock().map_err(|_| Error::Cuda {
            op: "attention",
            detail: "parts occupancy cache poisoned".into(),
        })?;
        if let Some(&n) = slots.get(&(kernel, smem)) {
            return Ok(n);
        }
        let n = resident_blocks(&self.k.attn_parts[kernel], 128, smem, self.sms)?;
        slots.insert((kernel, smem), n);
        Ok(n)
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), Error> {
        self.ctx.mem_get_info().map_err(cuda_err("memory info"))
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    /// A tensor holding `data` as `[rows, cols]`.
    pub fn tensor_from_host(
        &self,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<CudaTensor, Error> {
        if data.len() != rows * cols {
            return Err(crate::shape::shape(
                "tensor",
                format!("{} values for [{rows}, {cols}]", data.len()),
            ));
        }
        let mut t = self.zeros(rows, cols)?;
        if !data.is_empty() {
            self.stream
                .memcpy_htod(data, &mut t.buf)
                .map_err(cuda_err("upload"))?;
        }
        Ok(t)
    }

    /// A bf16 matrix of uniform random values in `[-scale, scale]` generated on the device
    /// (benchmarks of real-sized models without transferring weights).
    pub fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        seed: u64,
        scale: f32,
    ) -> Result<CudaMatrix, Error> {
        let n = rows
            .checked_mul(cols)
            .ok_or(Error::SizeOverflow { rows, cols })?;
        let data = self
            .stream
            .alloc_zeros::<bf16>(n.max(1))
            .map_err(cuda_err("alloc matrix"))?;
        let mut l = launch::Launches::new(ops::opc::FILL_RANDOM);
        l.kernel(
            "fill_random",
            &self.k.fill_random_bf16,
            self.grid_1d(n),
            false,
        )
        .ptr(ops::addr(&data, &self.stream))
        .arg(n as u64)
        .arg(seed)
        .arg(scale);
        // SAFETY: the kernel writes `n` elements of `data`, which holds at least `n`.
        unsafe { self.launch(&mut l) }?;
        Ok(CudaMatrix { data, rows, cols })
    }

    /// The K and V halves of a pool, copied to the host (tests).
    pub fn kv_to_host(&self, pool: &CudaKvPool) -> Result<(Vec<u16>, Vec<u16>), Error> {
        let k = self
            .stream
            .clone_dtoh(&pool.k)
            .map_err(cuda_err("download"))?;
        let v = self
            .stream
            .clone_dtoh(&pool.v)
            .map_err(cuda_err("download"))?;
        Ok((k, v))
    }

    /// Starts (`on`) or stops the CUDA profiler's collection (`cuProfilerStart`/`Stop`), after
    /// draining the stream, so that `ncu --profile-from-start off` measures exactly the
    /// launches between the two calls. Outside a profiler both calls do nothing.
    pub fn profiler_range(&self, on: bool) -> Result<(), Error> {
        self.synchronize()?;
        // SAFETY: both calls take no arguments and act on the current context, which this
        // backend's stream made current; the stream is drained, so no launch straddles them.
        let r = unsafe {
            if on {
                cudarc::driver::sys::cuProfilerStart()
            } else {
                cudarc::driver::sys::cuProfilerStop()
            }
        };
        r.result().map_err(cuda_err("profiler range"))
    }

    /// Device-to-device copy bandwidth in bytes/s (read + write) over a `bytes` buffer, the
    /// median of `reps` copies: the roofline that benchmarks compare against.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64, Error> {
        let n = (bytes / 2).max(1);
        let src = self
            .stream
            .alloc_zeros::<u8>(n)
            .map_err(cuda_err("alloc"))?;
        let mut dst = self
            .stream
            .alloc_zeros::<u8>(n)
            .map_err(cuda_err("alloc"))?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) + 2 {
            self.synchronize()?;
            let t = std::time::Instant::now();
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(cuda_err("copy"))?;
            self.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.drain(..2);
        times.sort_by(f64::total_cmp);
        Ok(2.0 * n as f64 / times[times.len() / 2])
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<CudaTensor, Error> {
        let n = rows
            .checked_mul(cols)
            .ok_or(Error::SizeOverflow { rows, cols })?;
        let buf = self
            .stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(cuda_err("alloc tensor"))?;
        Ok(CudaTensor { buf, rows, cols })
    }

    /// A grid-stride launch over `n` elements.
    fn grid_1d(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, self.sms * 16) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn pool(&self, layout: &KvLayout, layer: usize) -> Result<CudaKvPool, Error> {
        let lk = layout.layers.get(layer).ok_or_else(|| {
            crate::shape::shape(
                "kv_pool",
                format!("layer {layer} of {}", layout.layers.len()),
            )
        })?;
        let overflow = || Error::SizeOverflow {
            rows: layout.num_blocks,
            cols: layout.block_elements(),
        };
        let alloc = |len: usize| {
            self.stream
                .alloc_zeros::<u16>(len.max(1))
                .map_err(cuda_err("alloc kv pool"))
        };
        let (k, v, is_bf16, codes) = match lk.dtype {
            KvDtype::Bf16 | KvDtype::F16 => {
                let len = layout
                    .num_blocks
                    .checked_mul(layout.block_elements())
                    .ok_or_else(overflow)?;
                (alloc(len)?, alloc(len)?, lk.dtype == KvDtype::Bf16, None)
            }
            _ => {
                let c = codes::pool_codes(&self.stream, layout, layer)?;
                let heads = layout
                    .num_blocks
                    .checked_mul(layout.kv_heads)
                    .ok_or_else(overflow)?;
                // Block sizes are multiples of 16 bytes: whole u16 elements.
                let half = |total: usize| heads.checked_mul(total / 2).ok_or_else(overflow);
                let (kl, vl) = (half(c.k_layout.total_bytes)?, half(c.v_layout.total_bytes)?);
                (alloc(kl)?, alloc(vl)?, false, Some(c))
            }
        };
        let exact = match (&codes, layout.window.is_active()) {
            (Some(_), true) => Some(exact::ExactTokens::new(
                &self.stream,
                layout.window,
                layout.num_blocks,
                layout.kv_heads,
                layout.block_size,
                layout.head_dim,
            )?),
            _ => None,
        };
        Ok(CudaKvPool {
            k,
            v,
            is_bf16,
            codes,
            exact,
            kv_heads: layout.kv_heads,
            block_size: layout.block_size,
            head_dim: layout.head_dim,
            num_blocks: layout.num_blocks,
        })
    }
}

fn unsupported_kv(dtype: KvDtype) -> Error {
    Error::UnsupportedKvDtype {
        dtype: dtype.to_string(),
        backend: "cuda",
        accepted: codes::ACCEPTED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse() {
        assert_eq!(parse_device("cuda"), Some(0));
        assert_eq!(parse_device("cuda:3"), Some(3));
        assert_eq!(parse_device("cuda:x"), None);
        assert_eq!(parse_device("cpu"), None);
        assert_eq!(parse_device("cudax"), None);
    }

    #[test]
    fn construction_without_a_driver_is_an_error_not_a_panic() {
        // On machines with a GPU this builds a backend; without one it must fail cleanly.
        match CudaBackend::new(0) {
            Ok(b) => assert!(ops::describe(&b).starts_with("cuda:0")),
            Err(e) => assert!(
                matches!(e, Error::CudaUnavailable { .. } | Error::Cuda { .. }),
                "{e}"
            ),
        }
    }
}
