//! NVRTC compilation of the embedded `.cu` sources, once per process, with a PTX disk cache
//! keyed by a hash of the source, the target architecture and the compiler options.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::cuda_err;
use crate::Error;

const COMMON: &str = include_str!("kernels/common.cuh");
const ELEMENTWISE: &str = include_str!("kernels/elementwise.cu");
/// The codec's f32 steps, before the sources that encode or decode TurboQuant codes.
const CODEC: &str = include_str!("kernels/codec.cuh");
const WRITE_KV: &str = include_str!("kernels/write_kv.cu");
const PARTS: &str = include_str!("kernels/parts.cu");
const ATTENTION: &str = include_str!("kernels/attention.cu");
const GEMV: &str = include_str!("kernels/gemv.cu");
const SAMPLE: &str = include_str!("kernels/sample.cu");
const MOE: &str = include_str!("kernels/moe.cu");

/// Every kernel function the backend launches.
#[derive(Debug)]
pub(crate) struct Kernels {
    pub embed_bf16: CudaFunction,
    pub rms_norm: CudaFunction,
    pub add_assign: CudaFunction,
    pub add_bias: CudaFunction,
    pub silu_mul: CudaFunction,
    /// `x *= factor` and GeGLU (`gelu_tanh(g)·u`): the family ops of Granite and Gemma 3.
    pub scale: CudaFunction,
    pub gelu_mul: CudaFunction,
    /// LFM2's gated short convolution over one span (elementwise.cu).
    pub short_conv: CudaFunction,
    pub gather_rows: CudaFunction,
    pub f32_to_bf16: CudaFunction,
    pub fill_random_bf16: CudaFunction,
    /// Random 16-bit KV values (benchmark caches) and a timed busy-wait (elementwise.cu).
    pub fill_random_kv: CudaFunction,
    pub gpu_sleep: CudaFunction,
    /// Copies of graph inputs from mapped page-locked memory (elementwise.cu).
    pub upload_words: CudaFunction,
    pub write_kv: CudaFunction,
    /// The coded pools' write (encoder) and output un-rotation for head_dim 64, 128, 256
    /// (write_kv.cu; `codes::CODE_HEAD_DIMS`).
    pub write_kv_codes: [CudaFunction; 3],
    pub attn_unrotate: [CudaFunction; 3],
    /// The parts pools' (fractional widths, prod keys: `parts`) write and un-rotation for
    /// head_dim 64, 128 and 256, and dequantization for 64 and 128 (parts.cu).
    pub write_kv_parts: [CudaFunction; 3],
    pub codes_dequant_parts: [CudaFunction; 2],
    pub attn_unrotate_parts: [CudaFunction; 3],
    /// Decode on a parts pool's codes, in `parts::DECODE_KERNELS` order (attention.cu).
    pub attn_parts: Vec<CudaFunction>,
    /// The decode template on coded K/V, one per `codes::CodeVariant::all()` entry (`None`
    /// where it is not instantiated: `CodeVariant::has_template`).
    pub attn_codes: Vec<Option<CudaFunction>>,
    /// The keys-as-M coded decode kernels (GQA groups up to 8), in the same order.
    pub attn_codes_m: Vec<CudaFunction>,
    /// Their counterparts with int8 key products for TurboQuant keys and values, in the same
    /// order (`None` where not instantiated: `CodeVariant::has_int8_keys`).
    pub attn_codes_k8: Vec<Option<CudaFunction>>,
    /// Those with int8 value products too, in the same order (`None` where not instantiated:
    /// `CodeVariant::has_int8_values`).
    pub attn_codes_k8v: Vec<Option<CudaFunction>>,
    /// The coded prefill's dequantization into f16 rows, in the same order (`None` where
    /// there is no tile kernel: `CodeVariant::has_prefill`).
    pub codes_dequant: Vec<Option<CudaFunction>>,
    /// The tensor-core tile kernel over a coded pool's dequantized rows and exact blocks, for
    /// head_dim 64 and 128.
    pub attn_mma_codes: [CudaFunction; 2],
    /// Attention partials for head_dim 64, 128, 256 (compile-time) and any other.
    pub attn_partial: [CudaFunction; 4],
    /// Row-parallel attention for head_dim 64/128/256 × up to 4/8 query heads per kv head ×
    /// a 3- or 5-stage K/V pipeline (index `4·(head_dim index) + 2·(group index) + deep`).
    pub attn_rows: [CudaFunction; 12],
    /// Tensor-core prefill attention for head_dim 64 and 128 (16-bit KV).
    pub attn_mma: [CudaFunction; 2],
    /// The same with 8 warps (128 query vectors per block).
    pub attn_mma8: [CudaFunction; 2],
    /// The decode attention template for the 16-bit formats, one per entry of
    /// [`DECODE_VARIANTS`] (same index).
    pub attn_dec: Vec<CudaFunction>,
    /// Skinny matmuls, one set per entry of [`GEMV_CONFIGS`] (same index).
    pub gemv: Vec<GemvSet>,
    /// Per-row top-k candidates, max and log-sum-exp of logits (sample.cu).
    pub topk_rows: CudaFunction,
    /// Per-row argmax over several blocks per row (sample.cu): the greedy picks.
    pub argmax_rows: CudaFunction,
    /// The mixture-of-experts MLP (moe.cu): routing, the experts' matmuls over the pairs that
    /// chose them, the clamped SwiGLU, the weighted sum.
    pub moe_route: CudaFunction,
    pub moe_gemv: CudaFunction,
    pub moe_act: CudaFunction,
    pub moe_combine: CudaFunction,
}

/// Threads per block of `moe_route` and `moe_gemv`, the most experts `moe_route` holds, the
/// most experts per token, and `moe_gemv`'s output rows per block (moe.cu).
pub(crate) const MOE_THREADS: u32 = 256;
pub(crate) const MOE_MAX_EXPERTS: usize = 256;
pub(crate) const MOE_MAX_K: usize = 16;
pub(crate) const MOE_ROWS_PER_BLOCK: usize = 64;

/// Threads per block of `topk_rows` (`TOPK_THREADS` in sample.cu).
pub(crate) const TOPK_THREADS: u32 = 1024;
/// Threads per block of `argmax_rows` and logits each reads per round (`ARGMAX_THREADS`,
/// `ARGMAX_UNROLL` in sample.cu).
pub(crate) const ARGMAX_THREADS: u32 = 256;
pub(crate) const ARGMAX_PER_ROUND: usize = ARGMAX_THREADS as usize * 8;
/// Most blocks `argmax_rows` spreads one row over.
pub(crate) const ARGMAX_MAX_BLOCKS: usize = 128;

/// One instantiation of the decode attention template (attention.cu `ATTN_DEC16`): head_dim,
/// keys per shared-memory tile, pipeline stages, warps per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeVariant {
    /// Values per head.
    pub head_dim: usize,
    /// Keys per tile (split evenly over the warps, 16 or more each).
    pub tile: usize,
    /// Pipeline stages (tiles in flight + 1).
    pub stages: usize,
    /// Warps per block.
    pub warps: usize,
}

const fn dec(head_dim: usize, tile: usize, stages: usize, warps: usize) -> DecodeVariant {
    DecodeVariant {
        head_dim,
        tile,
        stages,
        warps,
    }
}

/// Every instantiation of the 16-bit decode template (see [`DECODE_SETS`] for which runs when);
/// at head_dim 256 the keys-as-M kernel (attention.cu `ATTN_DEC16_M`, GQA groups up to
/// [`DEC_M_MAX_GROUP`]).
pub const DECODE_VARIANTS: [DecodeVariant; 7] = [
    dec(64, 64, 2, 4),
    dec(64, 64, 3, 4),
    dec(128, 64, 2, 4),
    dec(128, 64, 3, 4),
    dec(128, 32, 2, 2),
    dec(256, 64, 2, 4),
    dec(256, 32, 2, 2),
];

/// The largest GQA group of the 16-bit decode kernels at head_dim 256 (the keys-as-M
/// kernels' 8 MMA columns); the template's at 64 and 128 take 16.
pub const DEC_M_MAX_GROUP: usize = 8;

/// The decode variants of one head_dim by the launch they suit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeSet {
    /// Few (row, kv head) pairs (decode of one or a few sequences): larger blocks, so that
    /// fewer splits are merged.
    pub few: DecodeVariant,
    /// At least [`MANY_PAIRS`] pairs: the variant that streams fastest.
    pub many: DecodeVariant,
    /// Splits of a couple of tiles: a deeper pipeline, every tile requested at once.
    pub short: DecodeVariant,
}

/// Pairs from which [`DecodeSet::many`] runs.
pub const MANY_PAIRS: usize = 32;

/// Which variant runs when, per head_dim. Measured on the H200 (`turbokv bench attention
/// --compare-variants`, llama3-8b heads; BENCHMARKS.md): blocks resident per SM decided the
/// bandwidth more than tiles in flight (one tile in flight, 3-7 blocks per SM, beat 2-4 tiles
/// in flight at 1-2 blocks per SM), and 2-warp blocks of 32 keys beat 4-warp blocks of 64 when
/// there are many pairs, but not for one sequence (more splits to merge).
pub const DECODE_SETS: [DecodeSet; 3] = [
    DecodeSet {
        few: dec(64, 64, 2, 4),
        many: dec(64, 64, 2, 4),
        short: dec(64, 64, 3, 4),
    },
    DecodeSet {
        few: dec(128, 64, 2, 4),
        many: dec(128, 32, 2, 2),
        short: dec(128, 64, 3, 4),
    },
    DecodeSet {
        few: dec(256, 64, 2, 4),
        many: dec(256, 32, 2, 2),
        short: dec(256, 64, 2, 4),
    },
];

impl DecodeVariant {
    /// The kernel's name in attention.cu.
    pub fn kernel_name(&self) -> String {
        format!(
            "attn_dec_{}_{}_{}_{}",
            self.head_dim, self.tile, self.stages, self.warps
        )
    }
    /// Threads per block.
    pub fn threads(&self) -> usize {
        32 * self.warps
    }
    /// Shared memory of the K/V pipeline (`stages` tiles of K and V rows of head_dim 16-bit
    /// values) or of the warps' final states, whichever is larger.
    pub fn smem_bytes(&self) -> usize {
        (self.stages * 2 * self.tile * self.head_dim * 2)
            .max(self.warps * 16 * (self.head_dim + 2) * 4)
    }
}

/// Most activation rows the GEMV kernels are instantiated for.
pub(crate) const GEMV_MAX_ROWS: usize = 8;
/// Threads per block of the GEMV kernels (`GEMV_THREADS` in gemv.cu).
pub(crate) const GEMV_THREADS: usize = 128;

/// The GEMV kernels of one instantiation (gemv.cu `GEMV_SET`).
#[derive(Debug)]
pub(crate) struct GemvSet {
    /// `y (+)= x · Wᵀ`.
    pub plain: CudaFunction,
    /// The gated epilogue `silu(g) · u` (the FFN input).
    pub silu: CudaFunction,
    /// The same two with the RMSNorm of x fused in front.
    pub norm: CudaFunction,
    pub norm_silu: CudaFunction,
    /// The un-normed and normed matmul with the rope-write epilogue (a decode step's
    /// attention input: RoPE, then the new keys and values into the pool).
    pub rope: CudaFunction,
    pub norm_rope: CudaFunction,
}

/// One instantiation of the GEMV kernels: activation rows `m`, weight rows each block reads
/// (`R` in gemv.cu; the gated kernel writes half as many outputs) and the kernel names'
/// suffix after `_{m}`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemvConfig {
    pub m: usize,
    pub rows_per_block: usize,
    pub suffix: &'static str,
}

const fn config(m: usize, rows_per_block: usize, suffix: &'static str) -> GemvConfig {
    GemvConfig {
        m,
        rows_per_block,
        suffix,
    }
}

/// Every GEMV instantiation in gemv.cu: the default one per activation row count 1..=8
/// (index m - 1), then the one- and two-row alternatives [`gemv_config`] picks by shape
/// (index `GEMV_MAX_ROWS + 2 (m - 1)` for the wide one, + 1 for the long one).
pub(crate) const GEMV_CONFIGS: [GemvConfig; GEMV_MAX_ROWS + 4] = [
    config(1, 2, ""),
    config(2, 2, ""),
    config(3, 2, ""),
    config(4, 2, ""),
    config(5, 4, ""),
    config(6, 4, ""),
    config(7, 4, ""),
    config(8, 4, ""),
    config(1, 8, "_r8u1"),
    config(1, 2, "_r2u2"),
    config(2, 8, "_r8u1"),
    config(2, 2, "_r2u2"),
];

/// Blocks of the 64-register GEMV kernels resident per SM (register-bound: 8 × 128 threads ×
/// 64 registers fill the 64 Ki registers of an SM).
const GEMV_BLOCKS_PER_SM: usize = 8;

/// Index in [`GEMV_CONFIGS`] of the kernel for `m` activation rows of `[n, k]` weights on a
/// GPU with `sms` SMs (1 ≤ m ≤ 8). One or two rows: rows of K ≥ 8192 (the down projection)
/// take 2 chunks per row in flight, not 4 (7 rounds of K = 14336); a grid of 8-row blocks
/// that fits one wave (the qkv and wo projections) takes it with 1 chunk per row in flight.
/// Measured on the H200, llama3-8b ctx 4096, per pipelined step (BENCHMARKS.md, session 8):
/// batch 1 4.634 → 4.414 ms, batch 2 5.141 → 4.960 ms for the qkv/wo blocks alone and −0.05
/// ms for the down projection's; 8-row blocks for the gate/up projection or the LM head
/// (several waves) gained nothing at batch 1, and lost 0.29 ms for the down projection (14
/// rounds).
pub(crate) fn gemv_config(m: usize, n: usize, k: usize, sms: usize) -> usize {
    let default = m.clamp(1, GEMV_MAX_ROWS) - 1;
    if !(1..=2).contains(&m) {
        return default;
    }
    let (wide, long) = (GEMV_MAX_ROWS + 2 * (m - 1), GEMV_MAX_ROWS + 2 * (m - 1) + 1);
    if k >= 8192 {
        long
    } else if n.div_ceil(GEMV_CONFIGS[wide].rows_per_block) <= GEMV_BLOCKS_PER_SM * sms {
        wide
    } else {
        default
    }
}

/// Compiler options; part of the cache key.
const OPTIONS: [&str; 2] = ["--std=c++17", "-default-device"];

/// FNV-1a over the parts (stable across builds, unlike `DefaultHasher`).
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Compiles (or reads from `cache_dir`) one source for `arch` and loads it.
fn module(
    ctx: &Arc<CudaContext>,
    name: &str,
    body: &str,
    arch: &'static str,
    cache_dir: Option<&Path>,
) -> Result<Arc<CudaModule>, Error> {
    let src = format!("{COMMON}\n{body}");
    let key = fnv1a(&[&src, arch, &OPTIONS.join(" ")]);
    let stem = format!("{name}-{arch}-{key:016x}");
    // A cubin (ptxas output, see scripts/cuda-check.py) skips the driver's JIT, which takes
    // minutes for the attention module on a fresh machine; one the driver refuses falls back.
    if let Some(d) = cache_dir
        && let Ok(bin) = std::fs::read(d.join(format!("{stem}.cubin")))
        && let Ok(m) = ctx.load_module(Ptx::from_binary(bin))
    {
        return Ok(m);
    }
    let path: Option<PathBuf> = cache_dir.map(|d| d.join(format!("{stem}.ptx")));
    if let Some(p) = &path
        && let Ok(text) = std::fs::read_to_string(p)
        && let Ok(m) = ctx.load_module(Ptx::from_src(text))
    {
        return Ok(m);
    }
    let opts = CompileOptions {
        arch: Some(arch),
        options: OPTIONS.iter().map(|s| s.to_string()).collect(),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| Error::Cuda {
        op: "nvrtc",
        detail: format!("{name}.cu: {e:?}"),
    })?;
    if let Some(p) = &path {
        // A failed cache write only costs a recompile next time.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let _ = std::fs::create_dir_all(p.parent().unwrap_or(Path::new(".")))
            .and_then(|()| std::fs::write(&tmp, ptx.to_src()))
            .and_then(|()| std::fs::rename(&tmp, p));
    }
    ctx.load_module(ptx).map_err(cuda_err("load module"))
}

/// The `sm_XY` name NVRTC takes for a compute capability.
pub(crate) fn arch_name(major: i32, minor: i32) -> Result<&'static str, Error> {
    Ok(match (major, minor) {
        (7, 0) => "sm_70",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => {
            return Err(Error::CudaUnavailable {
                reason: format!(
                    "compute capability {major}.{minor} is not supported (need sm_80+)"
                ),
            });
        }
    })
}

impl Kernels {
    /// Compiles every source for `arch` and looks up the functions.
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        arch: &'static str,
        cache_dir: Option<&Path>,
    ) -> Result<Self, Error> {
        let ew = module(ctx, "elementwise", ELEMENTWISE, arch, cache_dir)?;
        let kv = module(
            ctx,
            "write_kv",
            &format!("{CODEC}\n{WRITE_KV}"),
            arch,
            cache_dir,
        )?;
        let parts = module(ctx, "parts", &format!("{CODEC}\n{PARTS}"), arch, cache_dir)?;
        let at = module(
            ctx,
            "attention",
            &format!("{CODEC}\n{ATTENTION}"),
            arch,
            cache_dir,
        )?;
        let gv = module(ctx, "gemv", GEMV, arch, cache_dir)?;
        let sm = module(ctx, "sample", SAMPLE, arch, cache_dir)?;
        let moe = module(ctx, "moe", MOE, arch, cache_dir)?;
        let f =
            |m: &Arc<CudaModule>, n: &str| m.load_function(n).map_err(cuda_err("load function"));
        let gemv_set = |c: &GemvConfig| -> Result<GemvSet, Error> {
            let g = |prefix: &str| f(&gv, &format!("{prefix}_{}{}", c.m, c.suffix));
            Ok(GemvSet {
                plain: g("gemv")?,
                silu: g("gemv_silu")?,
                norm: g("gemv_norm")?,
                norm_silu: g("gemv_norm_silu")?,
                rope: g("gemv_rope")?,
                norm_rope: g("gemv_norm_rope")?,
            })
        };
        Ok(Self {
            gemv: GEMV_CONFIGS
                .iter()
                .map(gemv_set)
                .collect::<Result<_, _>>()?,
            embed_bf16: f(&ew, "embed_bf16")?,
            rms_norm: f(&ew, "rms_norm")?,
            add_assign: f(&ew, "add_assign")?,
            add_bias: f(&ew, "add_bias")?,
            silu_mul: f(&ew, "silu_mul")?,
            scale: f(&ew, "scale_f32")?,
            gelu_mul: f(&ew, "gelu_mul")?,
            short_conv: f(&ew, "short_conv_span")?,
            gather_rows: f(&ew, "gather_rows")?,
            f32_to_bf16: f(&ew, "f32_to_bf16_kernel")?,
            fill_random_bf16: f(&ew, "fill_random_bf16")?,
            fill_random_kv: f(&ew, "fill_random_kv")?,
            gpu_sleep: f(&ew, "gpu_sleep")?,
            upload_words: f(&ew, "upload_words")?,
            write_kv: f(&kv, "write_kv")?,
            write_kv_codes: [
                f(&kv, "write_kv_codes_64")?,
                f(&kv, "write_kv_codes_128")?,
                f(&kv, "write_kv_codes_256")?,
            ],
            attn_unrotate: [
                f(&kv, "attn_unrotate_64")?,
                f(&kv, "attn_unrotate_128")?,
                f(&kv, "attn_unrotate_256")?,
            ],
            write_kv_parts: [
                f(&parts, "write_kv_parts_64")?,
                f(&parts, "write_kv_parts_128")?,
                f(&parts, "write_kv_parts_256")?,
            ],
            codes_dequant_parts: [
                f(&parts, "codes_dequant_parts_64")?,
                f(&parts, "codes_dequant_parts_128")?,
            ],
            attn_unrotate_parts: [
                f(&parts, "attn_unrotate_parts_64")?,
                f(&parts, "attn_unrotate_parts_128")?,
                f(&parts, "attn_unrotate_parts_256")?,
            ],
            attn_parts: super::parts::DECODE_KERNELS
                .iter()
                .map(|(d, g)| f(&at, &format!("attn_parts_{d}_{g}")))
                .collect::<Result<_, _>>()?,
            attn_codes: super::codes::CodeVariant::all()
                .iter()
                .map(|v| {
                    v.has_template()
                        .then(|| f(&at, &v.kernel_name(false)))
                        .transpose()
                })
                .collect::<Result<_, _>>()?,
            attn_codes_m: super::codes::CodeVariant::all()
                .iter()
                .map(|v| f(&at, &v.kernel_name(true)))
                .collect::<Result<_, _>>()?,
            attn_codes_k8: super::codes::CodeVariant::all()
                .iter()
                .map(|v| {
                    v.has_int8_keys()
                        .then(|| f(&at, &v.int8_keys_name()))
                        .transpose()
                })
                .collect::<Result<_, _>>()?,
            attn_codes_k8v: super::codes::CodeVariant::all()
                .iter()
                .map(|v| {
                    v.has_int8_values()
                        .then(|| f(&at, &v.int8_values_name()))
                        .transpose()
                })
                .collect::<Result<_, _>>()?,
            codes_dequant: super::codes::CodeVariant::all()
                .iter()
                .map(|v| {
                    v.has_prefill()
                        .then(|| f(&at, &v.dequant_name()))
                        .transpose()
                })
                .collect::<Result<_, _>>()?,
            attn_mma_codes: [f(&at, "attn_mma_codes_64")?, f(&at, "attn_mma_codes_128")?],
            topk_rows: f(&sm, "topk_rows")?,
            argmax_rows: f(&sm, "argmax_rows")?,
            moe_route: f(&moe, "moe_route")?,
            moe_gemv: f(&moe, "moe_gemv")?,
            moe_act: f(&moe, "moe_act")?,
            moe_combine: f(&moe, "moe_combine")?,
            attn_partial: [
                f(&at, "attn_partial_64")?,
                f(&at, "attn_partial_128")?,
                f(&at, "attn_partial_256")?,
                f(&at, "attn_partial_any")?,
            ],
            attn_mma: [f(&at, "attn_mma_64")?, f(&at, "attn_mma_128")?],
            attn_mma8: [f(&at, "attn_mma8_64")?, f(&at, "attn_mma8_128")?],
            attn_dec: DECODE_VARIANTS
                .iter()
                .map(|v| f(&at, &v.kernel_name()))
                .collect::<Result<_, _>>()?,
            attn_rows: {
                let fs = [64, 128, 256]
                    .iter()
                    .flat_map(|d| [4, 8].map(move |g| (d, g)))
                    .flat_map(|(d, g)| ["", "_deep"].map(move |v| format!("attn_rows_{d}_{g}{v}")))
                    .map(|n| f(&at, &n))
                    .collect::<Result<Vec<_>, _>>()?;
                fs.try_into().map_err(|_| Error::Cuda {
                    op: "load function",
                    detail: "attn_rows kernels".into(),
                })?
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_configs_by_shape() {
        let r = |m, n, k| GEMV_CONFIGS[gemv_config(m, n, k, 132)];
        // llama3-8b on an H200, one row: qkv, wo, gate/up, down, LM head.
        assert_eq!(r(1, 6144, 4096).suffix, "_r8u1");
        assert_eq!(r(1, 4096, 4096).suffix, "_r8u1");
        assert_eq!(r(1, 28672, 4096).suffix, "");
        assert_eq!(r(1, 4096, 14336).suffix, "_r2u2");
        assert_eq!(r(1, 128_256, 4096).suffix, "");
        assert_eq!(r(2, 6144, 4096).suffix, "_r8u1");
        assert_eq!(r(2, 4096, 14336).suffix, "_r2u2");
        assert_eq!(r(3, 4096, 14336).suffix, "");
        for m in 1..=GEMV_MAX_ROWS {
            let c = r(m, 128_256, 4096);
            assert_eq!((c.m, c.suffix), (m, ""));
            assert_eq!(r(m, 4096, 4096).m, m);
            assert_eq!(r(m, 4096, 14336).m, m);
        }
        // The alternatives sit where gemv_config looks for them.
        for m in 1..=2 {
            assert_eq!(r(m, 8, 16384).m, m);
            assert_eq!(r(m, 8, 16384).suffix, "_r2u2");
            assert_eq!(r(m, 8, 16).suffix, "_r8u1");
        }
        // Every config's rows per block is even (gated and rope-write blocks hold pairs).
        assert!(GEMV_CONFIGS.iter().all(|c| c.rows_per_block % 2 == 0));
    }

    #[test]
    fn cache_key_depends_on_every_part() {
        assert_ne!(fnv1a(&["a", "sm_90"]), fnv1a(&["a", "sm_80"]));
        assert_ne!(fnv1a(&["ab", "c"]), fnv1a(&["a", "bc"]));
        assert_eq!(fnv1a(&["x"]), fnv1a(&["x"]));
    }
}
