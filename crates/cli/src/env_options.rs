//! The only place that reads the engine's tuning switches from the environment: the
//! libraries take them as options ([`CudaOptions`], [`CpuOptions`],
//! [`Transformer::set_step_graphs`]).
//!
//! | variable | effect |
//! |---|---|
//! | `TURBOKV_STEP_GRAPHS=0\|1` | replay decode steps as CUDA graphs (default 1) |
//! | `TURBOKV_PDL=0\|1` | programmatic dependent launch of the GEMV kernel (default 1) |
//! | `TURBOKV_GEMV_MAX_ROWS=N` | matmuls of at most N rows on the GEMV kernel (default 2, 0 = cuBLAS only) |
//! | `TURBOKV_ATTN_BLOCKS_PER_SM=N` | SIMT decode attention splits until N blocks per SM (default 2, ≥ 1) |
//! | `TURBOKV_PREFILL_WARPS=4\|8` | warps per block of the tensor-core prefill attention (default 4) |
//! | `TURBOKV_CODED_PREFILL_TILES=0\|1` | prefill over coded caches through tensor cores (default 1; 0: the decode kernels per row) |
//! | `TURBOKV_CODED_INT8_KEYS=0\|1` | decode over TurboQuant caches with int8 key products (default 1; 0: the f16 kernel) |
//! | `TURBOKV_CODED_INT8_VALUES=0\|1` | with int8 key products, 2- and 3-bit TurboQuant value sums through int8 products too (default 1; 0: as f16) |
//! | `TURBOKV_SM_LOAD_SPLITS=0\|1` | the int8-product TurboQuant decode kernels' split count from the per-SM load model where splits are short (default 1; 0: the wave model) |
//! | `TURBOKV_FOLD_EXACT_SPLITS=0\|1` | a windowed coded pool's exact splits run inside its coded blocks instead of as blocks of their own (default 0) |
//! | `TURBOKV_EXACT_SPLIT_KEYS=N` | keys of each of a windowed coded pool's exact splits, rounded up to whole 64-key chunks (for measurements; unset: 64, one chunk a split) |
//! | `TURBOKV_CODED_SPLITS=N` | every whole-width coded decode launch cut into N key splits, instead of the split models' count (for measurements; unset: the models') |
//! | `TURBOKV_CPU_WEIGHTS=native\|f32` | CPU matmuls on the stored weights with 8-bit activations (default), or on weights dequantized to f32 (the exact reference; slow) |
//! | `TURBOKV_CPU_CODE_PRODUCTS=int8\|f32` | CPU decode scores and value sums of TurboQuant codes, and scores of int8 records (int8 pools, `q8` window copies), through int8 products where AVX-512 VNNI and VBMI are present (default), or in f32 (exact over the decoded codes) |
//!
//! A value that does not parse is an error naming the variable, never silently ignored.
//!
//! [`Transformer::set_step_graphs`]: turbokv_model::Transformer::set_step_graphs

use anyhow::{Result, bail};
use turbokv_backend::cpu::{CodeProducts, CpuOptions, WeightMode};
use turbokv_backend::cuda::CudaOptions;

/// Switches retired once their A/B question was settled (BENCHMARKS.md, "Retired switches"),
/// with what now always runs.
const RETIRED: [(&str, &str); 4] = [
    ("TURBOKV_DEVICE_TOPK", "the device top-k selection"),
    ("TURBOKV_DEC_MMA", "the tensor-core decode attention"),
    ("TURBOKV_ROPE_GEMV", "the KV write in the qkv GEMV epilogue"),
    (
        "TURBOKV_FUSED_KV_WRITE",
        "the KV write outside the attention launch",
    ),
];

/// What the environment sets.
#[derive(Clone, Debug)]
pub struct EnvOptions {
    /// Options for a CUDA backend.
    pub cuda: CudaOptions,
    /// Whether decode steps replay CUDA graphs.
    pub step_graphs: bool,
    /// Options for a CPU backend.
    pub cpu: CpuOptions,
}

/// The options from the process environment.
pub fn from_env() -> Result<EnvOptions> {
    let opts = from_lookup(|name| std::env::var(name).ok())?;
    for (name, now) in RETIRED {
        if std::env::var_os(name).is_some() {
            tracing::warn!("{name} is retired and ignored: {now} always runs (BENCHMARKS.md)");
        }
    }
    Ok(opts)
}

/// The options from `get` (the environment's lookup; a map in tests).
fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<EnvOptions> {
    let mut cuda = CudaOptions::default();
    let flag = |name: &str, default: bool| -> Result<bool> {
        match get(name).as_deref().map(str::trim) {
            None => Ok(default),
            Some("0") => Ok(false),
            Some("1") => Ok(true),
            Some(v) => bail!("{name}={v:?}: expected 0 or 1"),
        }
    };
    let count = |name: &str, default: usize, min: usize| -> Result<usize> {
        match get(name) {
            None => Ok(default),
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n >= min => Ok(n),
                _ => bail!("{name}={v:?}: expected a whole number of at least {min}"),
            },
        }
    };
    cuda.pdl = flag("TURBOKV_PDL", cuda.pdl)?;
    cuda.gemv_max_rows = count("TURBOKV_GEMV_MAX_ROWS", cuda.gemv_max_rows, 0)?;
    cuda.attention_blocks_per_sm = count(
        "TURBOKV_ATTN_BLOCKS_PER_SM",
        cuda.attention_blocks_per_sm,
        1,
    )?;
    cuda.prefill_warps = match count("TURBOKV_PREFILL_WARPS", cuda.prefill_warps, 4)? {
        n @ (4 | 8) => n,
        n => bail!("TURBOKV_PREFILL_WARPS=\"{n}\": expected 4 or 8"),
    };
    cuda.coded_prefill_tiles = flag("TURBOKV_CODED_PREFILL_TILES", cuda.coded_prefill_tiles)?;
    cuda.coded_int8_keys = flag("TURBOKV_CODED_INT8_KEYS", cuda.coded_int8_keys)?;
    cuda.coded_int8_values = flag("TURBOKV_CODED_INT8_VALUES", cuda.coded_int8_values)?;
    cuda.sm_load_splits = flag("TURBOKV_SM_LOAD_SPLITS", cuda.sm_load_splits)?;
    cuda.fold_exact_splits = flag("TURBOKV_FOLD_EXACT_SPLITS", cuda.fold_exact_splits)?;
    cuda.exact_split_keys = match get("TURBOKV_EXACT_SPLIT_KEYS") {
        None => None,
        Some(_) => Some(count("TURBOKV_EXACT_SPLIT_KEYS", 64, 1)?),
    };
    cuda.coded_splits = match get("TURBOKV_CODED_SPLITS") {
        None => None,
        Some(_) => Some(count("TURBOKV_CODED_SPLITS", 1, 1)?),
    };
    let step_graphs = flag("TURBOKV_STEP_GRAPHS", true)?;
    let weights = match get("TURBOKV_CPU_WEIGHTS").as_deref().map(str::trim) {
        None | Some("native") => WeightMode::Native,
        Some("f32") => WeightMode::DequantizedF32,
        Some(v) => bail!("TURBOKV_CPU_WEIGHTS={v:?}: expected native or f32"),
    };
    let code_products = match get("TURBOKV_CPU_CODE_PRODUCTS").as_deref().map(str::trim) {
        None | Some("int8") => CodeProducts::Int8,
        Some("f32") => CodeProducts::F32,
        Some(v) => bail!("TURBOKV_CPU_CODE_PRODUCTS={v:?}: expected int8 or f32"),
    };
    Ok(EnvOptions {
        cuda,
        step_graphs,
        cpu: CpuOptions {
            weights,
            code_products,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<EnvOptions> {
        from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn unset_variables_give_the_library_defaults() {
        let o = parse(&[]).unwrap();
        let d = CudaOptions::default();
        assert!(o.step_graphs);
        assert_eq!(o.cuda.pdl, d.pdl);
        assert_eq!(o.cuda.gemv_max_rows, d.gemv_max_rows);
        assert_eq!(o.cuda.attention_blocks_per_sm, d.attention_blocks_per_sm);
        assert!(o.cuda.device_top_k && o.cuda.dec_mma && o.cuda.rope_gemv);
        assert_eq!(o.cuda.coded_prefill_tiles, d.coded_prefill_tiles);
        assert_eq!(o.cuda.coded_int8_keys, d.coded_int8_keys);
        assert_eq!(o.cuda.coded_int8_values, d.coded_int8_values);
        assert_eq!(o.cuda.sm_load_splits, d.sm_load_splits);
        assert_eq!(o.cuda.fold_exact_splits, d.fold_exact_splits);
        assert_eq!(o.cuda.exact_split_keys, None);
        assert_eq!(o.cuda.coded_splits, None);
        assert_eq!(o.cpu, CpuOptions::default());
    }

    #[test]
    fn set_variables_reach_the_options() {
        let o = parse(&[
            ("TURBOKV_STEP_GRAPHS", "0"),
            ("TURBOKV_PDL", " 0 "),
            ("TURBOKV_GEMV_MAX_ROWS", "0"),
            ("TURBOKV_ATTN_BLOCKS_PER_SM", "4"),
            ("TURBOKV_PREFILL_WARPS", "8"),
            ("TURBOKV_CODED_PREFILL_TILES", "0"),
            ("TURBOKV_CODED_INT8_KEYS", "0"),
            ("TURBOKV_CODED_INT8_VALUES", "0"),
            ("TURBOKV_SM_LOAD_SPLITS", "0"),
            ("TURBOKV_FOLD_EXACT_SPLITS", "1"),
            ("TURBOKV_EXACT_SPLIT_KEYS", "256"),
            ("TURBOKV_CODED_SPLITS", "2"),
            ("TURBOKV_CPU_WEIGHTS", "f32"),
            ("TURBOKV_CPU_CODE_PRODUCTS", "f32"),
        ])
        .unwrap();
        assert_eq!(o.cpu.weights, WeightMode::DequantizedF32);
        assert_eq!(o.cpu.code_products, CodeProducts::F32);
        assert_eq!(o.cuda.prefill_warps, 8);
        assert!(!o.cuda.coded_prefill_tiles);
        assert!(!o.cuda.coded_int8_keys);
        assert!(!o.cuda.coded_int8_values);
        assert!(!o.cuda.sm_load_splits);
        assert!(o.cuda.fold_exact_splits);
        assert_eq!(o.cuda.exact_split_keys, Some(256));
        assert_eq!(o.cuda.coded_splits, Some(2));
        assert!(!o.step_graphs);
        assert!(!o.cuda.pdl);
        assert_eq!(o.cuda.gemv_max_rows, 0);
        assert_eq!(o.cuda.attention_blocks_per_sm, 4);
    }

    #[test]
    fn unparsable_values_are_errors_naming_the_variable() {
        for (name, v) in [
            ("TURBOKV_PDL", "off"),
            ("TURBOKV_STEP_GRAPHS", "2"),
            ("TURBOKV_GEMV_MAX_ROWS", "-1"),
            ("TURBOKV_ATTN_BLOCKS_PER_SM", "0"),
            ("TURBOKV_ATTN_BLOCKS_PER_SM", "two"),
            ("TURBOKV_PREFILL_WARPS", "6"),
            ("TURBOKV_CODED_PREFILL_TILES", "yes"),
            ("TURBOKV_CODED_INT8_KEYS", "on"),
            ("TURBOKV_CODED_INT8_VALUES", "true"),
            ("TURBOKV_CODED_SPLITS", "0"),
            ("TURBOKV_FOLD_EXACT_SPLITS", "2"),
            ("TURBOKV_EXACT_SPLIT_KEYS", "0"),
            ("TURBOKV_EXACT_SPLIT_KEYS", "many"),
            ("TURBOKV_CPU_WEIGHTS", "q8"),
            ("TURBOKV_CPU_CODE_PRODUCTS", "int4"),
        ] {
            let e = parse(&[(name, v)]).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(v), "{e}");
        }
    }
}
