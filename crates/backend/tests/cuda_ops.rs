//! Every op of the CUDA backend against the CPU backend on fresh random inputs.
//!
//! Outputs are poisoned with NaN first, so an element a kernel forgets fails the comparison.
//! Skips (with a message) when no GPU or driver is present.
//!
//! Tolerances (bf16 has an 8-bit significand: relative rounding error ≤ 2⁻⁹):
//! - exact f32 ops (add, bias, gather, silu, rms_norm): 1e-5 relative + tiny absolute;
//! - embed: the table is resident as bf16, so 2⁻⁸ relative;
//! - matmul: both operands rounded to bf16 → each product off by ≤ 2⁻⁸ relative with random
//!   sign, so the sum's error is ≈ 2⁻⁸·‖x∘w‖ ≈ 2⁻⁸·rms(out); we allow 8× that over thousands
//!   of outputs: `0.03·rms(ref)`;
//! - write_kv: f32 math, sin/cos of different libms: 1e-4 absolute on O(1) values; the
//!   stored K/V within one 16-bit ulp (a value near a rounding boundary may round either way);
//! - top-k: ids, logits and max exact (a total order on values the kernel only compares);
//!   log-sum-exp 1e-5 relative (f32 sums of up to 256K terms in different orders);
//! - attention: K and V stored in 16 bits on both sides, f32 accumulation in different orders:
//!   2e-3 absolute + 1e-2 relative on outputs of size ≈ rms(V) ≈ 0.5.

use std::sync::OnceLock;

use half::{bf16, f16};
use turbokv_backend::cpu::{CpuBackend, CpuTensor};
use turbokv_backend::cuda::{CudaBackend, CudaOptions, CudaTensor, DECODE_VARIANTS};
use turbokv_backend::{
    AttnGeometry, Backend, Error, QkNorm, QkvProjection, Rope, RopeStyle, SeqSpan, TOPK_MAX, TopK,
    WeightMatrix, select_top_k,
};
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

/// The backend options of these tests: the defaults, with the device top-k explicitly on.
fn test_options() -> CudaOptions {
    CudaOptions {
        device_top_k: true,
        ..CudaOptions::default()
    }
}

fn gpu() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| match CudaBackend::with_options(0, &test_options()) {
        Ok(b) => {
            eprintln!("CUDA tests on {}", b.describe());
            Some(b)
        }
        // Only a missing GPU or driver skips; a GPU whose backend fails to start is a failure.
        Err(e @ Error::CudaUnavailable { .. }) => {
            eprintln!("skipping CUDA tests: {e}");
            None
        }
        Err(e) => panic!("the CUDA backend failed to start: {e}"),
    })
    .as_ref()
}

/// A second backend on the same GPU with the tensor-core decode attention off, so that the
/// SIMT decode kernels are checked too (call after `gpu()` found a GPU).
fn gpu_simt() -> &'static CudaBackend {
    static B: OnceLock<CudaBackend> = OnceLock::new();
    B.get_or_init(|| {
        let opts = CudaOptions {
            dec_mma: false,
            ..test_options()
        };
        CudaBackend::with_options(0, &opts).expect("a second CUDA backend")
    })
}

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.f() + 1.0) * 0.5 * n as f32) as usize % n
    }
}

fn cpu_t(v: Vec<f32>, rows: usize, cols: usize) -> CpuTensor {
    CpuTensor::from_vec(v, rows, cols).unwrap()
}
fn gpu_t(g: &CudaBackend, v: &[f32], rows: usize, cols: usize) -> CudaTensor {
    g.tensor_from_host(v, rows, cols).unwrap()
}
fn poison(g: &CudaBackend, rows: usize, cols: usize) -> CudaTensor {
    gpu_t(g, &vec![f32::NAN; rows * cols], rows, cols)
}
fn host(g: &CudaBackend, t: &CudaTensor) -> Vec<f32> {
    let mut v = Vec::new();
    g.to_host(t, &mut v).unwrap();
    v
}

/// Asserts `|a - b| ≤ atol + rtol·|b|` everywhere (NaN fails); returns the max abs error.
fn close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= atol + rtol * b.abs(),
            "{what}: element {i}: got {a}, want {b}"
        );
        worst = worst.max(err);
    }
    worst
}

fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| x * x).sum::<f32>() / v.len().max(1) as f32).sqrt()
}

#[test]
fn elementwise_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(11);
    for (rows, cols) in [(1, 64), (7, 1000), (33, 4096)] {
        let (x, y, bias) = (
            r.vec(rows * cols, 2.0),
            r.vec(rows * cols, 2.0),
            r.vec(cols, 1.0),
        );
        // add_assign
        let (mut cx, cy) = (cpu_t(x.clone(), rows, cols), cpu_t(y.clone(), rows, cols));
        let (mut gx, gy) = (gpu_t(g, &x, rows, cols), gpu_t(g, &y, rows, cols));
        c.add_assign(&mut cx, &cy).unwrap();
        g.add_assign(&mut gx, &gy).unwrap();
        close("add_assign", &host(g, &gx), cx.as_slice(), 1e-6, 1e-6);
        // add_bias
        let (cb, gb) = (c.vector(&bias).unwrap(), g.vector(&bias).unwrap());
        c.add_bias(&mut cx, &cb).unwrap();
        g.add_bias(&mut gx, &gb).unwrap();
        close("add_bias", &host(g, &gx), cx.as_slice(), 1e-6, 1e-6);
        // rms_norm
        let w = r.vec(cols, 1.0);
        let (cw, gw) = (c.vector(&w).unwrap(), g.vector(&w).unwrap());
        let mut co = c.tensor(rows, cols).unwrap();
        let mut go = poison(g, rows, cols);
        c.rms_norm(&cx, &cw, 1e-5, &mut co).unwrap();
        g.rms_norm(&gx, &gw, 1e-5, &mut go).unwrap();
        close("rms_norm", &host(g, &go), co.as_slice(), 1e-6, 1e-5);
        // silu_mul ([rows, 2·(cols/2)] → [rows, cols/2])
        let f = cols / 2;
        let (mut co, mut go) = (c.tensor(rows, f).unwrap(), poison(g, rows, f));
        c.silu_mul(&cx, &mut co).unwrap();
        g.silu_mul(&gx, &mut go).unwrap();
        close("silu_mul", &host(g, &go), co.as_slice(), 1e-6, 1e-5);
        // gelu_mul (GeGLU): 1 + tanh cancels for very negative gates, where both sides'
        // tanh (libm's and CUDA's, ≤ 2 ulp) differ by ~1e-7 absolute.
        let (mut co, mut go) = (c.tensor(rows, f).unwrap(), poison(g, rows, f));
        c.gelu_mul(&cx, &mut co).unwrap();
        g.gelu_mul(&gx, &mut go).unwrap();
        close("gelu_mul", &host(g, &go), co.as_slice(), 2e-6, 1e-5);
        // scale, in place
        let (mut cs, mut gs) = (cpu_t(x.clone(), rows, cols), gpu_t(g, &x, rows, cols));
        c.scale(&mut cs, -0.37).unwrap();
        g.scale(&mut gs, -0.37).unwrap();
        close("scale", &host(g, &gs), cs.as_slice(), 0.0, 0.0);
        // gather_rows
        let pick: Vec<usize> = (0..rows.min(5)).map(|_| r.below(rows)).collect();
        let (mut co, mut go) = (
            c.tensor(pick.len(), cols).unwrap(),
            poison(g, pick.len(), cols),
        );
        c.gather_rows(&cx, &pick, &mut co).unwrap();
        g.gather_rows(&gx, &pick, &mut go).unwrap();
        close("gather_rows", &host(g, &go), co.as_slice(), 0.0, 0.0);
    }
}

#[test]
fn embed_and_matmuls_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(12);
    for (t, k, n) in [(1, 256, 512), (5, 1024, 300), (64, 2048, 1536)] {
        let table = WeightMatrix::from_f32(n, k, &r.vec(n * k, 1.0)).unwrap();
        let ids: Vec<u32> = (0..t).map(|_| r.below(n) as u32).collect();
        let (ct, gt) = (c.matrix(&table).unwrap(), g.matrix(&table).unwrap());
        let (mut co, mut go) = (c.tensor(t, k).unwrap(), poison(g, t, k));
        c.embed(&ct, &ids, &mut co).unwrap();
        g.embed(&gt, &ids, &mut go).unwrap();
        close("embed", &host(g, &go), co.as_slice(), 1e-30, 1.0 / 256.0);
        assert!(
            g.embed(&gt, &[n as u32], &mut go).is_err(),
            "out-of-vocabulary id must be refused"
        );

        let x = r.vec(t * k, 1.0);
        let (cx, gx) = (cpu_t(x.clone(), t, k), gpu_t(g, &x, t, k));
        let (mut co, mut go) = (c.tensor(t, n).unwrap(), poison(g, t, n));
        c.matmul(&cx, &ct, &mut co).unwrap();
        g.matmul(&gx, &gt, &mut go).unwrap();
        let tol = 0.03 * rms(co.as_slice());
        let e = close("matmul", &host(g, &go), co.as_slice(), tol, 0.0);
        eprintln!(
            "matmul [{t}×{k}]·[{n}×{k}]ᵀ: max err {e:.2e} (rms of output {:.2e})",
            rms(co.as_slice())
        );

        let parts: Vec<WeightMatrix> = [n / 3, n - n / 3, 17]
            .iter()
            .map(|&rows| WeightMatrix::from_f32(rows, k, &r.vec(rows * k, 1.0)).unwrap())
            .collect();
        let total: usize = parts.iter().map(WeightMatrix::rows).sum();
        let cps: Vec<_> = parts.iter().map(|w| c.matrix(w).unwrap()).collect();
        let gps: Vec<_> = parts.iter().map(|w| g.matrix(w).unwrap()).collect();
        let (mut co, mut go) = (c.tensor(t, total).unwrap(), poison(g, t, total));
        c.matmul_cat(&cx, &cps, &mut co).unwrap();
        g.matmul_cat(&gx, &gps, &mut go).unwrap();
        close(
            "matmul_cat",
            &host(g, &go),
            co.as_slice(),
            0.03 * rms(co.as_slice()),
            0.0,
        );
    }
}

/// `x · Wᵀ` of the bf16-rounded operands in float64, and `Σ|x·w|` per output (the scale of
/// the f32 accumulation error).
fn matmul_ref(x: &[f32], w: &[f32], t: usize, k: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let b = |v: &[f32]| -> Vec<f64> { v.iter().map(|&f| bf16::from_f32(f).to_f64()).collect() };
    let (xb, wb) = (b(x), b(w));
    let mut out = vec![0f32; t * n];
    let mut mag = vec![0f32; t * n];
    for i in 0..t {
        for j in 0..n {
            let (xr, wr) = (&xb[i * k..(i + 1) * k], &wb[j * k..(j + 1) * k]);
            out[i * n + j] = xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>() as f32;
            mag[i * n + j] = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum::<f64>() as f32;
        }
    }
    (out, mag)
}

/// Asserts `|got - want| ≤ rel·mag + 1e-6` everywhere; returns the worst `|err| / mag`.
fn close_mag(what: &str, got: &[f32], want: &[f32], mag: &[f32], rel: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, ((&a, &b), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= rel * m + 1e-6,
            "{what}: element {i}: got {a}, want {b} (Σ|x·w| = {m})"
        );
        worst = worst.max(err / m.max(1e-30));
    }
    worst
}

/// The decode matmuls: the GEMV kernel (1..=8 rows, K a multiple of 8 but not of 256, odd N;
/// for 1 and 2 rows each block shape `gemv_config` picks: 8-row blocks for small N, 2 chunks
/// in flight for K ≥ 8192, the default for N beyond one wave of 8-row blocks),
/// its fused residual add (`matmul_add`) and `matmul_cat` over more parts than one launch
/// takes, against a float64 reference of the bf16-rounded operands (f32 accumulation: within
/// 1e-4·Σ|x·w|); the same through cuBLAS (a backend with the GEMV kernel off, and shapes the
/// GEMV kernel does not take: K % 8 ≠ 0, 9 rows); and the CPU backend's `matmul_add`.
#[test]
fn skinny_matmuls_match_reference() {
    let Some(g) = gpu() else { return };
    let opts = CudaOptions {
        gemv_max_rows: 0,
        ..CudaOptions::default()
    };
    let blas = CudaBackend::with_options(0, &opts).unwrap();
    let c = CpuBackend::new();
    let mut r = Rng(31);
    let shapes = [
        (1, 4096, 301),
        (2, 296, 1023),
        (3, 1000, 17),
        (4, 2056, 515),
        (5, 8, 33),
        (6, 1536, 257),
        (7, 600, 129),
        (8, 4104, 301),
        (1, 100, 64),
        (1, 14344, 67),
        (2, 8200, 45),
        (1, 1032, 9001),
        (2, 520, 8999),
        (9, 512, 77),
    ];
    for (t, k, n) in shapes {
        let x = r.vec(t * k, 1.0);
        let wv = r.vec(n * k, 1.0);
        let wm = WeightMatrix::from_f32(n, k, &wv).unwrap();
        let (want, mag) = matmul_ref(&x, &wv, t, k, n);
        let acc0 = r.vec(t * n, 1.0);
        let want_add: Vec<f32> = want.iter().zip(&acc0).map(|(a, b)| a + b).collect();
        for (name, be, rel) in [("gemv", g, 1e-4), ("cublas", &blas, 1e-3)] {
            let (gx, gw) = (gpu_t(be, &x, t, k), be.matrix(&wm).unwrap());
            let mut go = poison(be, t, n);
            be.matmul(&gx, &gw, &mut go).unwrap();
            let e = close_mag(name, &host(be, &go), &want, &mag, rel);
            let mut ga = gpu_t(be, &acc0, t, n);
            let mut tmp = poison(be, t, n);
            be.matmul_add(&gx, &gw, &mut ga, &mut tmp).unwrap();
            let ea = close_mag(name, &host(be, &ga), &want_add, &mag, rel);
            eprintln!("{name} [{t}×{k}]·[{n}×{k}]ᵀ: worst err/Σ|xw| {e:.1e}, with add {ea:.1e}");
        }
        let (cx, cw) = (cpu_t(x.clone(), t, k), c.matrix(&wm).unwrap());
        let mut ca = cpu_t(acc0.clone(), t, n);
        let mut tmp = c.tensor(t, n).unwrap();
        c.matmul_add(&cx, &cw, &mut ca, &mut tmp).unwrap();
        close(
            "cpu matmul_add",
            ca.as_slice(),
            &want_add,
            0.03 * rms(&want),
            0.0,
        );
    }
    // Six parts of odd heights: two GEMV launches (up to 4 matrices each) into one output.
    for t in [1, 3, 8] {
        let k = 264;
        let heights = [5, 130, 1, 77, 300, 9];
        let x = r.vec(t * k, 1.0);
        let parts: Vec<Vec<f32>> = heights.iter().map(|&h| r.vec(h * k, 1.0)).collect();
        let all: Vec<f32> = parts.concat();
        let total: usize = heights.iter().sum();
        let (want, mag) = matmul_ref(&x, &all, t, k, total);
        let ws: Vec<_> = heights
            .iter()
            .zip(&parts)
            .map(|(&h, p)| g.matrix(&WeightMatrix::from_f32(h, k, p).unwrap()).unwrap())
            .collect();
        let gx = gpu_t(g, &x, t, k);
        let mut go = poison(g, t, total);
        g.matmul_cat(&gx, &ws, &mut go).unwrap();
        close_mag("gemv matmul_cat", &host(g, &go), &want, &mag, 1e-4);
    }
    // The gated FFN input `silu(g) · u` (fused into the GEMV kernel for ≤ 8 rows; cuBLAS and
    // `silu_mul` for 9), from [gate | up] as one stacked matrix and as two; then the matmul
    // that reads its output, which must take the kernel's bf16 copy to the same result as a
    // fresh upload of the same values.
    let gated = [
        (1, 4096, 1001),
        (2, 8200, 40),
        (2, 264, 4501),
        (4, 520, 77),
        (8, 1032, 300),
        (9, 256, 40),
    ];
    for (t, k, f) in gated {
        let x = r.vec(t * k, 1.0);
        let wv = r.vec(2 * f * k, 1.0);
        let (gu, mag) = matmul_ref(&x, &wv, t, k, 2 * f);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let mut want = vec![0f32; t * f];
        let mut tol = vec![0f32; t * f];
        for i in 0..t {
            for j in 0..f {
                let (a, b) = (i * 2 * f + j, i * 2 * f + f + j);
                let (gv, uv) = (gu[a], gu[b]);
                want[i * f + j] = silu(gv) * uv;
                tol[i * f + j] = 1.1 * uv.abs() * mag[a] + silu(gv).abs() * mag[b];
            }
        }
        let stacked = vec![
            g.matrix(&WeightMatrix::from_f32(2 * f, k, &wv).unwrap())
                .unwrap(),
        ];
        let split: Vec<_> = [&wv[..f * k], &wv[f * k..]]
            .iter()
            .map(|p| g.matrix(&WeightMatrix::from_f32(f, k, p).unwrap()).unwrap())
            .collect();
        let w2v = r.vec(5 * f, 1.0);
        let w2 = g
            .matrix(&WeightMatrix::from_f32(5, f, &w2v).unwrap())
            .unwrap();
        for ws in [&stacked, &split] {
            let gx = gpu_t(g, &x, t, k);
            let (mut gate_up, mut act) = (poison(g, t, 2 * f), poison(g, t, f));
            g.matmul_silu(&gx, ws, &mut gate_up, &mut act).unwrap();
            let got = host(g, &act);
            let rel = if t > 8 { 1e-3 } else { 1e-4 };
            let worst = close_mag("matmul_silu", &got, &want, &tol, rel);
            eprintln!(
                "matmul_silu [{t}×{k}] → {f} ({} parts): {worst:.1e}",
                ws.len()
            );
            let (mut o1, mut o2) = (poison(g, t, 5), poison(g, t, 5));
            g.matmul_silu(&gx, ws, &mut gate_up, &mut act).unwrap();
            g.matmul(&act, &w2, &mut o1).unwrap();
            let fresh = gpu_t(g, &got, t, f);
            g.matmul(&fresh, &w2, &mut o2).unwrap();
            close(
                "matmul after matmul_silu",
                &host(g, &o1),
                &host(g, &o2),
                0.0,
                0.0,
            );
        }
        let (cx, cw) = (
            cpu_t(x.clone(), t, k),
            vec![
                c.matrix(&WeightMatrix::from_f32(2 * f, k, &wv).unwrap())
                    .unwrap(),
            ],
        );
        let (mut cgu, mut cact) = (c.tensor(t, 2 * f).unwrap(), c.tensor(t, f).unwrap());
        c.matmul_silu(&cx, &cw, &mut cgu, &mut cact).unwrap();
        close(
            "cpu matmul_silu",
            cact.as_slice(),
            &want,
            0.03 * rms(&want),
            0.0,
        );
    }
    // RMSNorm fused in front (the normed GEMV kernel for 1 row; the norm, then the GEMV or
    // cuBLAS, beyond), into `matmul_cat` and into the gated form: against float64 of the
    // unrounded normalised x and bf16 weights (the unfused path rounds x·inv·g to bf16: 2⁻⁹
    // relative per term).
    for (t, k, n) in [(1, 4096, 301), (2, 1032, 77), (3, 264, 40), (9, 512, 33)] {
        let x = r.vec(t * k, 1.0);
        let gnorm: Vec<f32> = r.vec(k, 1.0).iter().map(|v| 1.0 + 0.5 * v).collect();
        let eps = 1e-5f32;
        let mut xn = vec![0f64; t * k];
        for i in 0..t {
            let row = &x[i * k..(i + 1) * k];
            let ms = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / k as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            for j in 0..k {
                xn[i * k + j] = f64::from(row[j]) * inv * f64::from(gnorm[j]);
            }
        }
        let wv = r.vec(2 * n * k, 1.0);
        let wb: Vec<f64> = wv.iter().map(|&f| bf16::from_f32(f).to_f64()).collect();
        let (mut want, mut mag) = (vec![0f32; t * 2 * n], vec![0f32; t * 2 * n]);
        for i in 0..t {
            for j in 0..2 * n {
                let (xr, wr) = (&xn[i * k..(i + 1) * k], &wb[j * k..(j + 1) * k]);
                want[i * 2 * n + j] = xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>() as f32;
                mag[i * 2 * n + j] =
                    xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum::<f64>() as f32;
            }
        }
        let rel = if t > 1 { 4e-3 } else { 1e-4 };
        let ws = vec![
            g.matrix(&WeightMatrix::from_f32(2 * n, k, &wv).unwrap())
                .unwrap(),
        ];
        let nw = g.vector(&gnorm).unwrap();
        let gx = gpu_t(g, &x, t, k);
        let (mut xs, mut out) = (poison(g, t, k), poison(g, t, 2 * n));
        g.rms_norm_matmul_cat(&gx, &nw, eps, &ws, &mut xs, &mut out)
            .unwrap();
        let e = close_mag("rms_norm_matmul_cat", &host(g, &out), &want, &mag, rel);
        eprintln!("rms_norm_matmul_cat [{t}×{k}] → {}: {e:.1e}", 2 * n);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let (mut want_s, mut tol_s) = (vec![0f32; t * n], vec![0f32; t * n]);
        for i in 0..t {
            for j in 0..n {
                let (a, b) = (i * 2 * n + j, i * 2 * n + n + j);
                want_s[i * n + j] = silu(want[a]) * want[b];
                tol_s[i * n + j] = 1.1 * want[b].abs() * mag[a] + silu(want[a]).abs() * mag[b];
            }
        }
        let (mut gate_up, mut act) = (poison(g, t, 2 * n), poison(g, t, n));
        g.rms_norm_matmul_silu(&gx, &nw, eps, &ws, &mut xs, &mut gate_up, &mut act)
            .unwrap();
        let e = close_mag("rms_norm_matmul_silu", &host(g, &act), &want_s, &tol_s, rel);
        eprintln!("rms_norm_matmul_silu [{t}×{k}] → {n}: {e:.1e}");
        let cw = vec![
            c.matrix(&WeightMatrix::from_f32(2 * n, k, &wv).unwrap())
                .unwrap(),
        ];
        let (mut cxs, mut cgu, mut cact) = (
            c.tensor(t, k).unwrap(),
            c.tensor(t, 2 * n).unwrap(),
            c.tensor(t, n).unwrap(),
        );
        let cn = c.vector(&gnorm).unwrap();
        let cx = cpu_t(x.clone(), t, k);
        c.rms_norm_matmul_silu(&cx, &cn, eps, &cw, &mut cxs, &mut cgu, &mut cact)
            .unwrap();
        close(
            "cpu rms_norm_matmul_silu",
            cact.as_slice(),
            &want_s,
            0.03 * rms(&want_s),
            0.0,
        );
    }
    let (gx, gw) = (
        gpu_t(g, &[0.0; 8], 1, 8),
        g.matrix(&WeightMatrix::from_f32(4, 8, &[0.0; 32]).unwrap())
            .unwrap(),
    );
    let (mut acc, mut tmp) = (g.tensor(2, 4).unwrap(), g.tensor(2, 4).unwrap());
    assert!(
        g.matmul_add(&gx, &gw, &mut acc, &mut tmp).is_err(),
        "rows of acc and x must agree"
    );
}

/// Decode matmul speed at the llama3-8b shapes: GEMV kernel vs cuBLAS, weight read rate.
/// A benchmark, not a check: `cargo test --release --test cuda_ops -- --ignored --nocapture`.
#[test]
#[ignore]
fn skinny_matmul_speed() {
    let Some(g) = gpu() else { return };
    let bw = g.copy_bandwidth(2 << 30, 10).unwrap();
    eprintln!("copy bandwidth {:.2} TB/s", bw / 1e12);
    let shapes = [
        ("qkv", 6144, 4096),
        ("wo", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("lm_head", 128256, 4096),
    ];
    for m in [1, 2, 4, 8] {
        for (name, n, k) in shapes {
            let tg = g.matmul_time(m, n, k, 30, true).unwrap();
            let tb = g.matmul_time(m, n, k, 30, false).unwrap();
            let gb = (n * k * 2) as f64;
            eprintln!(
                "m={m} {name:8} [{n}×{k}]: gemv {:7.1} µs ({:.2} TB/s)  cublas {:7.1} µs ({:.2} TB/s)",
                tg * 1e6,
                gb / tg / 1e12,
                tb * 1e6,
                gb / tb / 1e12
            );
        }
    }
}

/// One attention configuration: geometry, dtype, RoPE style, q/k norm.
struct Case {
    heads: usize,
    kv_heads: usize,
    d: usize,
    dtype: KvDtype,
    style: RopeStyle,
    norm: bool,
}

/// Three steps over several sequences: a prefill of each sequence's history, a mixed step
/// (decode rows, a prefill continuation, a new sequence) whose contexts cross blocks and, for
/// the long sequence, trigger split-K decode, then a decode-only step (one row per sequence:
/// the row-parallel kernel for every dtype, its split merge run again on the same counters).
fn run_case(g: &CudaBackend, case: &Case, seed: u64) {
    let c = CpuBackend::new();
    let mut r = Rng(seed);
    let geo = AttnGeometry {
        n_heads: case.heads,
        n_kv_heads: case.kv_heads,
        head_dim: case.d,
        scale: 1.0 / (case.d as f32).sqrt(),
    };
    let rope = Rope {
        inv_freq: (0..case.d / 2)
            .map(|i| 10000f32.powf(-(2.0 * i as f32) / case.d as f32))
            .collect(),
        style: case.style,
    };
    let bs = 16;
    let layout = KvLayout::uniform(1, case.kv_heads, case.d, case.dtype, bs, 8192).unwrap();
    let (mut cpool, mut gpool) = (
        c.kv_pool(&layout, 0).unwrap(),
        g.kv_pool(&layout, 0).unwrap(),
    );
    // Block tables: a random permutation of the pool's blocks, dealt out to 4 sequences.
    let mut perm: Vec<u32> = (0..layout.num_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, r.below(i + 1));
    }
    let tables: Vec<&[u32]> = perm.chunks(layout.num_blocks / 4).take(4).collect();
    let (qn, kn) = (
        r.vec(case.d, 0.3)
            .iter()
            .map(|x| x + 1.0)
            .collect::<Vec<_>>(),
        r.vec(case.d, 0.3)
            .iter()
            .map(|x| x + 1.0)
            .collect::<Vec<_>>(),
    );
    let (cqn, ckn, gqn, gkn) = (
        c.vector(&qn).unwrap(),
        c.vector(&kn).unwrap(),
        g.vector(&qn).unwrap(),
        g.vector(&kn).unwrap(),
    );
    // (history length, new tokens in step 2) per sequence; sequence 3 is new in step 2.
    let seqs = [(1100usize, 1usize), (37, 1), (20, 5), (0, 19)];
    for step in 0..3 {
        let mut spans = Vec::new();
        let mut row = 0;
        for (i, &(hist, new)) in seqs.iter().enumerate() {
            let (first_pos, n) = match step {
                0 => (0, hist),
                1 => (hist, new),
                _ => (hist + new, 1),
            };
            if n > 0 {
                spans.push(SeqSpan {
                    first_row: row,
                    n_tokens: n,
                    first_pos,
                    blocks: tables[i],
                });
                row += n;
            }
        }
        let w = geo.qkv_width();
        let qkv = r.vec(row * w, 1.5);
        let (mut cq, mut gq) = (cpu_t(qkv.clone(), row, w), gpu_t(g, &qkv, row, w));
        let cnorm = case.norm.then_some(QkNorm {
            q: &cqn,
            k: &ckn,
            eps: 1e-6,
        });
        let gnorm = case.norm.then_some(QkNorm {
            q: &gqn,
            k: &gkn,
            eps: 1e-6,
        });
        c.write_kv(&mut cq, &geo, &rope, cnorm, &spans, &mut cpool)
            .unwrap();
        let what = format!(
            "write_kv d={} heads {}/{} {:?} {:?} step {step}",
            case.d, case.heads, case.kv_heads, case.dtype, case.style
        );
        let cols = case.heads * case.d;
        g.write_kv(&mut gq, &geo, &rope, gnorm, &spans, &mut gpool)
            .unwrap();
        close(&what, &host(g, &gq), cq.as_slice(), 1e-4, 1e-4);
        check_pool(
            g,
            &gpool,
            cq.as_slice(),
            &geo,
            &spans,
            bs,
            case.dtype,
            &what,
        );

        let mut co = c.tensor(row, cols).unwrap();
        c.attention(&cq, &geo, &spans, &cpool, &mut co).unwrap();
        let mut go = poison(g, row, cols);
        g.attention(&gq, &geo, &spans, &gpool, &mut go).unwrap();
        // With head_dim 64/128 the tensor-core kernels run (prefill tiles, or the decode
        // kernel; at 256 the keys-as-M decode kernel for every row), whose queries and
        // softmax weights are rounded to the cache's 16-bit type (bf16: 2⁻⁹ relative) for
        // the MMAs.
        let mma = matches!(case.d, 64 | 128) || (case.d == 256 && case.heads <= 8 * case.kv_heads);
        let (atol, rtol) = if mma { (1e-2, 2e-2) } else { (2e-3, 1e-2) };
        let e = close(
            &what.replace("write_kv", "attention"),
            &host(g, &go),
            co.as_slice(),
            atol,
            rtol,
        );
        eprintln!("{}: max err {e:.2e}", what.replace("write_kv", "attention"));
        if step == 2 {
            // The same decode step on the SIMT kernels (the row-parallel kernel where it is
            // instantiated, else the tiled one; f32 throughout), over the same pool: `g`'s
            // stream is idle after the copies above.
            let simt = gpu_simt();
            let mut go = poison(simt, row, cols);
            simt.attention(&gq, &geo, &spans, &gpool, &mut go).unwrap();
            let what = what.replace("write_kv", "SIMT decode attention");
            let e = close(&what, &host(simt, &go), co.as_slice(), 2e-3, 1e-2);
            eprintln!("{what}: max err {e:.2e}");
        }
    }
}

/// The GPU pool holds, at every written slot, the 16-bit encoding of the CPU's roped k and v.
#[allow(clippy::too_many_arguments)]
fn check_pool(
    g: &CudaBackend,
    pool: &turbokv_backend::cuda::CudaKvPool,
    qkv: &[f32],
    geo: &AttnGeometry,
    spans: &[SeqSpan<'_>],
    bs: usize,
    dtype: KvDtype,
    what: &str,
) {
    let (k, v) = g.kv_to_host(pool).unwrap();
    let (d, nkv, w) = (geo.head_dim, geo.n_kv_heads, geo.qkv_width());
    let dec = |x: u16| {
        if dtype == KvDtype::Bf16 {
            bf16::from_bits(x).to_f32()
        } else {
            f16::from_bits(x).to_f32()
        }
    };
    let ulp = if dtype == KvDtype::Bf16 {
        1.0 / 128.0
    } else {
        1.0 / 1024.0
    };
    for s in spans {
        for i in 0..s.n_tokens {
            let pos = s.first_pos + i;
            let row = &qkv[(s.first_row + i) * w..][..w];
            for h in 0..nkv {
                let at = ((s.blocks[pos / bs] as usize * nkv + h) * bs + pos % bs) * d;
                for j in 0..d {
                    let (want_k, want_v) = (
                        row[(geo.n_heads + h) * d + j],
                        row[(geo.n_heads + nkv + h) * d + j],
                    );
                    let (got_k, got_v) = (dec(k[at + j]), dec(v[at + j]));
                    assert!(
                        (got_k - want_k).abs() <= ulp * want_k.abs() + 1e-4,
                        "{what}: K pos {pos} head {h} dim {j}: {got_k} vs {want_k}"
                    );
                    assert!(
                        (got_v - want_v).abs() <= ulp * want_v.abs() + 1e-4,
                        "{what}: V pos {pos} head {h} dim {j}: {got_v} vs {want_v}"
                    );
                }
            }
        }
    }
}

#[test]
fn write_kv_and_attention_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut seed = 100;
    // Decode rows: head_dim 64/128 takes the tensor-core decode kernel (in the unfused form),
    // 256 the keys-as-M one, 96 and group 12 the tiled kernel.
    for d in [64, 96, 128, 256] {
        for (group, dtype) in [1, 4, 8, 12]
            .into_iter()
            .flat_map(|g| [KvDtype::Bf16, KvDtype::F16].map(|t| (g, t)))
        {
            if group * d > 2048 {
                continue;
            }
            let kv_heads = 2;
            let style = if group == 4 {
                RopeStyle::Interleaved
            } else {
                RopeStyle::HalfSplit
            };
            let case = Case {
                heads: kv_heads * group,
                kv_heads,
                d,
                dtype,
                style,
                norm: group != 1,
            };
            seed += 1;
            run_case(g, &case, seed);
        }
    }
    // Every instantiation of the decode template, forced for every launch, on the same cases
    // (the default choice above runs only the variant each shape picks).
    for v in DECODE_VARIANTS {
        let opts = CudaOptions {
            decode_variant: Some(v),
            ..test_options()
        };
        let forced = CudaBackend::with_options(0, &opts).expect("a CUDA backend");
        for (group, dtype) in [(1, KvDtype::Bf16), (4, KvDtype::F16), (8, KvDtype::Bf16)] {
            let case = Case {
                heads: 2 * group,
                kv_heads: 2,
                d: v.head_dim,
                dtype,
                style: RopeStyle::HalfSplit,
                norm: false,
            };
            seed += 1;
            eprintln!("forced decode variant {v:?}");
            run_case(&forced, &case, seed);
        }
    }
    // The 8-warp prefill tile kernel (128 query vectors per block).
    let opts = CudaOptions {
        prefill_warps: 8,
        ..test_options()
    };
    let wide = CudaBackend::with_options(0, &opts).expect("a CUDA backend");
    for d in [64, 128] {
        for (group, dtype) in [(1, KvDtype::Bf16), (4, KvDtype::F16), (8, KvDtype::Bf16)] {
            let case = Case {
                heads: 2 * group,
                kv_heads: 2,
                d,
                dtype,
                style: RopeStyle::Interleaved,
                norm: group == 4,
            };
            seed += 1;
            eprintln!("8-warp prefill, d {d}, group {group}");
            run_case(&wide, &case, seed);
        }
    }
}

/// The host-side inputs of one `project_qkv_write_kv` call.
struct QkvInputs<'a> {
    parts: &'a [WeightMatrix],
    norm: &'a [f32],
    bias: Option<&'a [f32]>,
    qk_norm: Option<(&'a [f32], &'a [f32])>,
    geo: &'a AttnGeometry,
    rope: &'a Rope,
    spans: &'a [SeqSpan<'a>],
    layout: &'a KvLayout,
}

impl QkvInputs<'_> {
    /// Uploads the weights to `be`, runs the op on `x` (already there) into `xn` and `qkv`;
    /// returns the fresh pool it wrote.
    fn run<B: Backend>(
        &self,
        be: &B,
        x: B::Tensor,
        xn: &mut B::Tensor,
        qkv: &mut B::Tensor,
    ) -> B::KvPool {
        let ws: Vec<_> = self.parts.iter().map(|p| be.matrix(p).unwrap()).collect();
        let norm = be.vector(self.norm).unwrap();
        let bias = self.bias.map(|b| be.vector(b).unwrap());
        let qk = self
            .qk_norm
            .map(|(q, k)| (be.vector(q).unwrap(), be.vector(k).unwrap()));
        let mut pool = be.kv_pool(self.layout, 0).unwrap();
        let proj = QkvProjection {
            norm: &norm,
            eps: 1e-5,
            weights: &ws,
            bias: bias.as_ref(),
            qk_norm: qk.as_ref().map(|(q, k)| QkNorm { q, k, eps: 1e-6 }),
        };
        be.project_qkv_write_kv(
            &x, proj, self.geo, self.rope, self.spans, &mut pool, xn, qkv,
        )
        .unwrap();
        pool
    }
}

/// `project_qkv_write_kv` with the KV write in the GEMV's epilogue (decode rows on the GEMV
/// kernel: 1..=8 tokens, normed kernel for one row) against the separate ops on the same GPU
/// (the matmul, `add_bias`, `write_kv`; checked against the CPU above): the roped rows and
/// every pool slot agree to f32 rounding (the same arithmetic; sin/cos and FMA contraction may
/// differ in the last bits) and to one 16-bit ulp; and against the CPU backend within the
/// matmul tolerance. Both RoPE styles, partial rotary, a bias, split or stacked weights, and a
/// q/k norm (which the epilogue does not take: the separate ops).
#[test]
fn qkv_projection_writes_kv_like_the_separate_ops() {
    let Some(_) = gpu() else { return };
    let fused = CudaBackend::with_options(
        0,
        &CudaOptions {
            gemv_max_rows: 8,
            ..test_options()
        },
    )
    .unwrap();
    let split = CudaBackend::with_options(
        0,
        &CudaOptions {
            gemv_max_rows: 8,
            rope_gemv: false,
            ..test_options()
        },
    )
    .unwrap();
    let c = CpuBackend::new();
    let mut r = Rng(77);
    // (heads, kv heads, head_dim, rotary pairs, style, bias, dtype, split weights, q/k norm)
    let cases = [
        (
            9,
            3,
            64,
            32,
            RopeStyle::HalfSplit,
            true,
            KvDtype::Bf16,
            true,
            false,
        ),
        (
            8,
            2,
            128,
            64,
            RopeStyle::Interleaved,
            false,
            KvDtype::F16,
            false,
            false,
        ),
        (
            4,
            4,
            64,
            16,
            RopeStyle::HalfSplit,
            true,
            KvDtype::Bf16,
            false,
            false,
        ),
        (
            16,
            2,
            128,
            24,
            RopeStyle::Interleaved,
            false,
            KvDtype::F16,
            true,
            false,
        ),
        (
            4,
            2,
            64,
            32,
            RopeStyle::HalfSplit,
            false,
            KvDtype::Bf16,
            true,
            true,
        ),
    ];
    let (k, bs) = (264, 16);
    for (ci, &(heads, kv_heads, d, pairs, style, has_bias, dtype, split_w, norm)) in
        cases.iter().enumerate()
    {
        let geo = AttnGeometry {
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let rope = Rope {
            inv_freq: (0..pairs)
                .map(|i| 10000f32.powf(-(2.0 * i as f32) / d as f32))
                .collect(),
            style,
        };
        let w = geo.qkv_width();
        let wv = r.vec(w * k, 0.2);
        let parts: Vec<WeightMatrix> = if split_w {
            let (q, kk) = (heads * d, kv_heads * d);
            [&wv[..q * k], &wv[q * k..(q + kk) * k], &wv[(q + kk) * k..]]
                .iter()
                .map(|p| WeightMatrix::from_f32(p.len() / k, k, p).unwrap())
                .collect()
        } else {
            vec![WeightMatrix::from_f32(w, k, &wv).unwrap()]
        };
        let gnorm: Vec<f32> = r.vec(k, 0.5).iter().map(|v| 1.0 + v).collect();
        let bias = r.vec(w, 0.5);
        let (qn, kn) = (r.vec(d, 0.3), r.vec(d, 0.3));
        let layout = KvLayout::uniform(1, kv_heads, d, dtype, bs, 1024).unwrap();
        let mut perm: Vec<u32> = (0..layout.num_blocks as u32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, r.below(i + 1));
        }
        let tables: Vec<&[u32]> = perm.chunks(layout.num_blocks / 8).take(8).collect();
        for rows in [1, 2, 3, 4, 5, 8] {
            // One token per sequence at a random position, except that with 3 rows the first
            // sequence gets two (two consecutive positions).
            let mut spans = Vec::new();
            let mut row = 0;
            for (i, table) in tables.iter().enumerate() {
                let n = if rows == 3 && i == 0 { 2 } else { 1 };
                if row + n > rows {
                    break;
                }
                spans.push(SeqSpan {
                    first_row: row,
                    n_tokens: n,
                    first_pos: r.below(100),
                    blocks: table,
                });
                row += n;
            }
            let x = r.vec(rows * k, 1.0);
            let what = format!("case {ci} rows {rows}");
            let inputs = QkvInputs {
                parts: &parts,
                norm: &gnorm,
                bias: has_bias.then_some(&bias[..]),
                qk_norm: norm.then_some((&qn[..], &kn[..])),
                geo: &geo,
                rope: &rope,
                spans: &spans,
                layout: &layout,
            };
            let mut outs = Vec::new();
            for be in [&fused, &split] {
                let (mut xn, mut qkv) = (poison(be, rows, k), poison(be, rows, w));
                let pool = inputs.run(be, gpu_t(be, &x, rows, k), &mut xn, &mut qkv);
                outs.push((host(be, &qkv), be.kv_to_host(&pool).unwrap()));
            }
            let ((fq, (fk, fv)), (sq, (sk, sv))) = (&outs[0], &outs[1]);
            close(&format!("{what}: qkv"), fq, sq, 1e-5, 1e-5);
            let dec = |x: u16| match dtype {
                KvDtype::Bf16 => bf16::from_bits(x).to_f32(),
                _ => f16::from_bits(x).to_f32(),
            };
            let ulp = if dtype == KvDtype::Bf16 {
                1.0 / 128.0
            } else {
                1.0 / 1024.0
            };
            for (name, got, want) in [("K", fk, sk), ("V", fv, sv)] {
                for (i, (&a, &b)) in got.iter().zip(want.iter()).enumerate() {
                    let (a, b) = (dec(a), dec(b));
                    assert!(
                        (a - b).abs() <= ulp * b.abs() + 1e-6,
                        "{what}: pool {name} element {i}: {a} vs {b}"
                    );
                }
            }
            let (mut cxn, mut cqkv) = (c.tensor(rows, k).unwrap(), c.tensor(rows, w).unwrap());
            inputs.run(&c, cpu_t(x.clone(), rows, k), &mut cxn, &mut cqkv);
            let want = cqkv.as_slice();
            close(
                &format!("{what}: qkv vs cpu"),
                fq,
                want,
                0.03 * rms(want),
                0.0,
            );
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let Some(g) = gpu() else { return };
    let geo = AttnGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        scale: 0.125,
    };
    let layout = KvLayout::uniform(1, 2, 64, KvDtype::Bf16, 16, 64).unwrap();
    let mut pool = g.kv_pool(&layout, 0).unwrap();
    let rope = Rope {
        inv_freq: vec![1.0; 32],
        style: RopeStyle::HalfSplit,
    };
    let mut qkv = poison(g, 2, geo.qkv_width());
    let far = [999u32];
    let spans = [SeqSpan {
        first_row: 0,
        n_tokens: 2,
        first_pos: 0,
        blocks: &far,
    }];
    assert!(
        g.write_kv(&mut qkv, &geo, &rope, None, &spans, &mut pool)
            .is_err(),
        "block outside the pool"
    );
    let short: [u32; 0] = [];
    let spans = [SeqSpan {
        first_row: 0,
        n_tokens: 2,
        first_pos: 0,
        blocks: &short,
    }];
    assert!(
        g.write_kv(&mut qkv, &geo, &rope, None, &spans, &mut pool)
            .is_err(),
        "table too short"
    );
    assert!(g.check_kv_dtype(KvDtype::Bf16, 512).is_err());
    // The capability query refuses up front what no attention kernel runs, naming the limits.
    let llama = AttnGeometry {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        scale: 0.088,
    };
    g.supports_attention(&llama, KvDtype::Bf16).unwrap();
    g.supports_attention(&llama, KvDtype::F16).unwrap();
    let wide = AttnGeometry {
        n_heads: 64,
        n_kv_heads: 2,
        ..llama
    };
    let e = g.supports_attention(&wide, KvDtype::Bf16).unwrap_err();
    assert!(
        matches!(e, Error::UnsupportedAttention { .. }) && e.to_string().contains("head_dim"),
        "{e}"
    );
    // Coded pools: the formats with kernels, not the others (tests/cuda_codes.rs has more).
    g.supports_attention(&llama, "tq3".parse().unwrap())
        .unwrap();
    g.supports_attention(&llama, "tq2.5".parse().unwrap())
        .unwrap();
    let gemma = AttnGeometry {
        n_heads: 8,
        n_kv_heads: 4,
        head_dim: 256,
        scale: 0.0625,
    };
    g.supports_attention(&gemma, "tq2.5".parse().unwrap())
        .unwrap();
    // head_dim 96: dense rotations, which no coded kernel reads.
    let dense = AttnGeometry {
        head_dim: 96,
        ..gemma
    };
    let e = g
        .supports_attention(&dense, "tq2.5".parse().unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::UnsupportedKvDtype { .. }), "{e}");
    let grouped = AttnGeometry {
        n_heads: 64,
        n_kv_heads: 2,
        head_dim: 64,
        ..llama
    };
    g.supports_attention(&grouped, KvDtype::Bf16).unwrap();
    let e = g
        .supports_attention(&grouped, "int8".parse().unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::UnsupportedAttention { .. }), "{e}");
}

/// Decode steps of a one-layer model (attention, gated FFN, fused residual adds) through
/// `run_graphed` (eager, capture, replays, a batch change that forces a new graph, block-table
/// growth) give the same logits as the same steps run eagerly on an identical cache.
#[test]
fn graphed_steps_match_eager_steps() {
    if gpu().is_none() {
        return;
    }
    // A backend of its own: graph mode is backend-wide and other tests run concurrently.
    let g = CudaBackend::with_options(0, &test_options()).unwrap();
    let (hidden, vocab, bs) = (128, 64, 16);
    let geo = AttnGeometry {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
        scale: 0.125,
    };
    let rope = Rope {
        inv_freq: (0..32).map(|i| 10000f32.powf(-(i as f32) / 32.0)).collect(),
        style: RopeStyle::HalfSplit,
    };
    let embed = g.random_matrix(vocab, hidden, 1, 1.0).unwrap();
    let wqkv = vec![g.random_matrix(geo.qkv_width(), hidden, 2, 0.1).unwrap()];
    let wo = g.random_matrix(hidden, 8 * 64, 3, 0.05).unwrap();
    let lm = g.random_matrix(vocab, hidden, 4, 0.1).unwrap();
    let ffn = 96;
    let w_gate_up = vec![g.random_matrix(2 * ffn, hidden, 5, 0.1).unwrap()];
    let w_down = g.random_matrix(hidden, ffn, 6, 0.1).unwrap();
    let norm = g.vector(&vec![1.0; hidden]).unwrap();
    let layout = KvLayout::uniform(1, 2, 64, KvDtype::Bf16, bs, 64 * bs).unwrap();
    let mut pools = [
        g.kv_pool(&layout, 0).unwrap(),
        g.kv_pool(&layout, 0).unwrap(),
    ];
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let mut proj_lm = g.tensor(0, vocab).unwrap();
    let (mut gate_up, mut act) = (g.tensor(0, 2 * ffn).unwrap(), g.tensor(0, ffn).unwrap());
    let (mut x, mut xn, mut qkv, mut att, mut proj, mut pick, mut pick_n, mut logits) = (
        g.tensor(0, hidden).unwrap(),
        g.tensor(0, hidden).unwrap(),
        g.tensor(0, geo.qkv_width()).unwrap(),
        g.tensor(0, 8 * 64).unwrap(),
        g.tensor(0, hidden).unwrap(),
        g.tensor(0, hidden).unwrap(),
        g.tensor(0, hidden).unwrap(),
        g.tensor(0, vocab).unwrap(),
    );
    // One step: `seqs` sequences, sequence s at `pos[s]` with `n` new tokens each.
    let mut step = |pool: &mut turbokv_backend::cuda::CudaKvPool,
                    seqs: usize,
                    pos: &[usize],
                    n: usize,
                    tok: u32,
                    out: &mut Vec<f32>|
     -> Result<(), turbokv_backend::Error> {
        let spans: Vec<SeqSpan<'_>> = (0..seqs)
            .map(|s| SeqSpan {
                first_row: s * n,
                n_tokens: n,
                first_pos: pos[s],
                blocks: &tables[s],
            })
            .collect();
        let ids: Vec<u32> = (0..seqs * n)
            .map(|i| (tok + 7 * i as u32) % vocab as u32)
            .collect();
        g.embed(&embed, &ids, &mut x)?;
        // Decode steps take the rope-write GEMV and the attention prefetching behind it.
        let qkv_proj = QkvProjection {
            norm: &norm,
            eps: 1e-5,
            weights: &wqkv,
            bias: None,
            qk_norm: None,
        };
        g.project_qkv_write_kv(&x, qkv_proj, &geo, &rope, &spans, pool, &mut xn, &mut qkv)?;
        g.attention(&qkv, &geo, &spans, pool, &mut att)?;
        g.matmul_add(&att, &wo, &mut x, &mut proj)?;
        g.rms_norm_matmul_silu(&x, &norm, 1e-5, &w_gate_up, &mut xn, &mut gate_up, &mut act)?;
        g.matmul_add(&act, &w_down, &mut x, &mut proj)?;
        let last: Vec<usize> = (0..seqs).map(|s| s * n + n - 1).collect();
        g.gather_rows(&x, &last, &mut pick)?;
        g.rms_norm(&pick, &norm, 1e-5, &mut pick_n)?;
        g.matmul(&pick_n, &lm, &mut logits)?;
        g.rms_norm_matmul_cat(
            &pick,
            &norm,
            1e-5,
            std::slice::from_ref(&lm),
            &mut pick_n,
            &mut proj_lm,
        )?;
        g.add_assign(&mut logits, &proj_lm)?;
        g.to_host(&logits, out)
    };
    // Identical prefill of both caches (eager).
    let mut pos = vec![40usize; 3];
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for p in pools.iter_mut() {
        step(p, 3, &[0, 0, 0], 40, 5, &mut a).unwrap();
    }
    let [pa, pb] = &mut pools;
    let mut tok = 11;
    for i in 0..16 {
        // Steps 10..13 decode two sequences only (a second graph), then three again.
        let seqs = if (10..13).contains(&i) { 2 } else { 3 };
        step(pa, seqs, &pos, 1, tok, &mut a).unwrap();
        g.run_graphed(|| step(pb, seqs, &pos, 1, tok, &mut b))
            .unwrap();
        close(&format!("graph step {i}"), &b, &a, 1e-4, 1e-4);
        for p in pos.iter_mut().take(seqs) {
            *p += 1;
        }
        tok += 3;
    }
    let st = g.graph_stats().unwrap();
    eprintln!("graph stats {st:?}");
    assert!(st.replayed >= 8, "{st:?}");
    assert!(st.captured >= 2, "{st:?}");
    let (ka, va) = g.kv_to_host(pa).unwrap();
    let (kb, vb) = g.kv_to_host(pb).unwrap();
    let f = |v: &[u16]| -> Vec<f32> { v.iter().map(|&u| bf16::from_bits(u).to_f32()).collect() };
    close("graph K cache", &f(&kb), &f(&ka), 1e-2, 1e-2);
    close("graph V cache", &f(&vb), &f(&va), 1e-2, 1e-2);
}

/// Asserts the device top-k equals the host reference: ids, logits and counts exactly (the
/// order is a total order), max exactly, log-sum-exp to f32 rounding of a long sum.
fn same_top_k(what: &str, got: &TopK, want: &TopK) {
    assert_eq!(got.rows(), want.rows(), "{what}: rows");
    assert_eq!((got.k, got.cols), (want.k, want.cols), "{what}: shape");
    for r in 0..want.rows() {
        let (a, b) = (got.row(r).unwrap(), want.row(r).unwrap());
        assert_eq!(a.ids, b.ids, "{what}: row {r} ids");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a.logits), bits(b.logits), "{what}: row {r} logits");
        // `==`: a maximum of 0 may come out as -0 or +0 from either side.
        assert_eq!(a.max, b.max, "{what}: row {r} max");
        if b.lse.is_finite() {
            assert!(
                (a.lse - b.lse).abs() <= 1e-5 + 1e-5 * b.lse.abs(),
                "{what}: row {r} lse {} vs {}",
                a.lse,
                b.lse
            );
        } else {
            assert_eq!(a.lse, b.lse, "{what}: row {r} lse");
        }
    }
}

/// A TopK full of garbage, so a field the device path forgets to set fails the comparison.
fn poisoned_top_k() -> TopK {
    TopK {
        k: 7,
        cols: 3,
        ids: vec![u32::MAX; 999],
        logits: vec![f32::NAN; 999],
        counts: vec![u32::MAX; 5],
        max: vec![f32::NAN; 5],
        lse: vec![f32::NAN; 5],
    }
}

/// `to_host_top_k` against `select_top_k` on random rows with the hard cases mixed in: heavy
/// ties (integer logits: the k-th value is shared by thousands of ids, the lowest must win),
/// NaN, ±inf, ±0, rows with fewer eligible logits than k, rows with none.
#[test]
fn top_k_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(31);
    let cases: [(usize, usize, usize); 9] = [
        (1, 128_256, 1),
        (3, 128_256, 40),
        (2, 151_936, 256),
        (5, 1000, 7),
        (4, 50, 256),
        (6, 4096, 2),
        (2, 262_144, 64),
        (33, 3000, 1),
        (1, 1, 1),
    ];
    for (case, &(rows, cols, k)) in cases.iter().enumerate() {
        for variant in 0..4 {
            let mut x = r.vec(rows * cols, 8.0);
            if variant == 1 {
                // Integer logits in [-3, 3]: massive ties at every threshold.
                for v in &mut x {
                    *v = v.round().clamp(-3.0, 3.0);
                }
            }
            if variant >= 2 {
                for _ in 0..(rows * cols / 5).max(1) {
                    let i = r.below(rows * cols);
                    x[i] = [f32::NAN, f32::NEG_INFINITY, -0.0, 0.0, 8.0][r.below(5)];
                }
                if variant == 3 {
                    x[r.below(rows * cols)] = f32::INFINITY;
                }
                // Row 0 entirely ineligible, the last row with only a few eligible values.
                x[..cols].fill(f32::NAN);
                if rows > 1 {
                    let last = &mut x[(rows - 1) * cols..];
                    last.fill(f32::NEG_INFINITY);
                    for j in 0..k.min(cols) / 2 {
                        last[(j * 7) % cols] = j as f32 - 2.0;
                    }
                }
            }
            let what = format!("case {case} variant {variant} ({rows}x{cols}, k {k})");
            let mut want = TopK::default();
            select_top_k(&x, cols, k, &mut want).unwrap();
            let mut got = poisoned_top_k();
            g.to_host_top_k(&gpu_t(g, &x, rows, cols), k, &mut got)
                .unwrap();
            same_top_k(&what, &got, &want);
            // The CPU backend's override agrees with the reference too.
            let mut cpu = poisoned_top_k();
            CpuBackend::new()
                .to_host_top_k(&cpu_t(x.clone(), rows, cols), k, &mut cpu)
                .unwrap();
            same_top_k(&format!("{what}: cpu backend"), &cpu, &want);
        }
    }
    let t = gpu_t(g, &[1.0; 8], 2, 4);
    let mut out = TopK::default();
    for k in [0, TOPK_MAX + 1] {
        assert!(matches!(
            g.to_host_top_k(&t, k, &mut out),
            Err(Error::TopKOutOfRange { .. })
        ));
    }
}

/// Steps through `run_graphed` that end alternately in `to_host` and `to_host_top_k` (k 1 and
/// 40) share one graph (the selection runs after the graph launch, outside it) and give what
/// the same step gives eagerly.
#[test]
fn graphed_top_k_steps_share_the_graph() {
    if gpu().is_none() {
        return;
    }
    // A backend of its own: graph mode is backend-wide and other tests run concurrently.
    let g = CudaBackend::with_options(0, &test_options()).unwrap();
    let (hidden, vocab, rows) = (64, 5000, 3);
    let embed = g.random_matrix(vocab, hidden, 1, 1.0).unwrap();
    let lm = g.random_matrix(vocab, hidden, 2, 0.5).unwrap();
    let (mut x, mut logits) = (g.tensor(0, hidden).unwrap(), g.tensor(0, vocab).unwrap());
    let mut run = |ids: &[u32], end: usize, full: &mut Vec<f32>, top: &mut TopK| {
        g.embed(&embed, ids, &mut x)?;
        g.matmul(&x, &lm, &mut logits)?;
        match end {
            0 => g.to_host(&logits, full),
            1 => g.to_host_top_k(&logits, 1, top),
            _ => g.to_host_top_k(&logits, 40, top),
        }
    };
    let (mut full, mut top) = (Vec::new(), poisoned_top_k());
    for i in 0..12u32 {
        let ids: Vec<u32> = (0..rows as u32)
            .map(|s| (i * 37 + s * 11) % vocab as u32)
            .collect();
        let end = (i % 3) as usize;
        g.run_graphed(|| run(&ids, end, &mut full, &mut top))
            .unwrap();
        let (mut eager_full, mut eager_top) = (Vec::new(), TopK::default());
        run(&ids, 0, &mut eager_full, &mut eager_top).unwrap();
        match end {
            0 => {
                close(&format!("graph step {i}"), &full, &eager_full, 0.0, 0.0);
            }
            _ => {
                let mut want = TopK::default();
                select_top_k(&eager_full, vocab, if end == 1 { 1 } else { 40 }, &mut want).unwrap();
                same_top_k(&format!("graph step {i}"), &top, &want);
                top = poisoned_top_k();
            }
        };
    }
    let st = g.graph_stats().unwrap();
    eprintln!("graph stats {st:?}");
    assert_eq!(st.captured, 1, "{st:?}");
    assert!(st.replayed >= 9, "{st:?}");
}

/// Greedy picks kept on the device: the ids of `to_host_top_k(k = 1)`, two picks pending at
/// once and a third refused, a row of NaN logits reported as nothing to pick (and embedded as
/// id 0 by the next step), `embed_picks` equal to `embed` of the same ids, and bad requests
/// refused.
#[test]
fn device_picks_match_top_1() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(77);
    let (rows, cols, width) = (3, 5000, 24);
    let mut logits = r.vec(rows * cols, 4.0);
    let first = gpu_t(g, &logits, rows, cols);
    let mut top = TopK::default();
    g.to_host_top_k(&first, 1, &mut top).unwrap();
    let mut picks = g.new_picks().unwrap();
    let mut ids = Vec::new();
    assert!(
        g.wait_picks(&mut picks, &mut ids).is_err(),
        "nothing pending"
    );
    g.pick_greedy(&first, &mut picks).unwrap();
    for v in &mut logits[cols..2 * cols] {
        *v = f32::NAN;
    }
    let second = gpu_t(g, &logits, rows, cols);
    g.pick_greedy(&second, &mut picks).unwrap();
    assert!(
        g.pick_greedy(&second, &mut picks).is_err(),
        "a third pending pick"
    );

    let table_rows = r.vec(cols * width, 1.0);
    let table = g
        .matrix(&WeightMatrix::from_f32(cols, width, &table_rows).unwrap())
        .unwrap();
    let mut got = poison(g, rows, width);
    g.embed_picks(&table, &picks, rows, &mut got).unwrap();
    let mut want = poison(g, rows, width);
    g.embed(&table, &[top.ids[0], 0, top.ids[2]], &mut want)
        .unwrap();
    assert_eq!(
        host(g, &got),
        host(g, &want),
        "the latest picks, row 1 as id 0"
    );
    assert!(
        g.embed_picks(&table, &picks, 2, &mut got).is_err(),
        "row count"
    );
    let small = g
        .matrix(&WeightMatrix::from_f32(10, width, &table_rows[..10 * width]).unwrap())
        .unwrap();
    assert!(
        g.embed_picks(&small, &picks, rows, &mut got).is_err(),
        "ids may exceed a smaller table"
    );

    g.wait_picks(&mut picks, &mut ids).unwrap();
    assert_eq!(ids, top.ids, "the first pick");
    assert!(matches!(
        g.wait_picks(&mut picks, &mut ids),
        Err(Error::NothingToPick { row: 1 })
    ));
    assert!(
        g.wait_picks(&mut picks, &mut ids).is_err(),
        "nothing pending"
    );
    // The ring goes on after the error.
    g.pick_greedy(&first, &mut picks).unwrap();
    g.wait_picks(&mut picks, &mut ids).unwrap();
    assert_eq!(ids, top.ids);
}

/// Writes the same K and V contents into every block of a CPU and a GPU 16-bit pool through
/// block I/O: `k`, `v` are `[blocks, kv_heads, bs, d]` 16-bit words.
#[allow(clippy::too_many_arguments)]
fn fill_pools(
    c: &CpuBackend,
    cpool: &mut turbokv_backend::cpu::CpuKvPool,
    g: &CudaBackend,
    gpool: &mut turbokv_backend::cuda::CudaKvPool,
    k: &[u16],
    v: &[u16],
    kv_heads: usize,
    per_head: usize,
) {
    let blocks = k.len() / (kv_heads * per_head);
    let mut bytes = Vec::new();
    for b in 0..blocks {
        bytes.clear();
        for h in 0..kv_heads {
            let at = (b * kv_heads + h) * per_head;
            for x in k[at..at + per_head].iter().chain(&v[at..at + per_head]) {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
        c.write_kv_block(cpool, b as u32, &bytes).unwrap();
        g.write_kv_block(gpool, b as u32, &bytes).unwrap();
    }
}

/// One sliding-window case: a geometry and pool dtype, run on each backend of `backends`.
struct WindowCase {
    heads: usize,
    kv_heads: usize,
    d: usize,
    dtype: KvDtype,
}

/// Sliding-window attention (`attention_variant`) over ring-like block tables on each of
/// `backends` against the CPU backend, for windows smaller and larger than the contexts, in
/// three steps of one ragged batch each: prefill chunks with decode rows (the tensor-core
/// prefill kernel where it applies), decode rows only (the decode template, or the row and
/// tiled kernels), short continuations with decode rows. Each sequence's table maps logical
/// block i to ring block i mod n, with n just large enough for the keys its queries see (as
/// `model/src/arch/ring.rs` does), so blocks before the window alias newer ones; every slot
/// no query may read holds NaN, so a key read outside its window poisons the output even
/// where it is masked (0 · NaN).
fn run_window_case(backends: &[&CudaBackend], case: &WindowCase, seed: u64) {
    let c = CpuBackend::new();
    let mut r = Rng(seed);
    let (d, nkv) = (case.d, case.kv_heads);
    let geo = AttnGeometry {
        n_heads: case.heads,
        n_kv_heads: nkv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let bs = 16;
    let num_blocks = 160;
    let layout = KvLayout::uniform(1, nkv, d, case.dtype, bs, num_blocks * bs).unwrap();
    let mut cpool = c.kv_pool(&layout, 0).unwrap();
    let mut gpools: Vec<_> = backends
        .iter()
        .map(|g| g.kv_pool(&layout, 0).unwrap())
        .collect();
    let bf = case.dtype == KvDtype::Bf16;
    let enc = |x: f32| {
        if bf {
            bf16::from_f32(x).to_bits()
        } else {
            f16::from_f32(x).to_bits()
        }
    };
    let nan = if bf { 0x7fc0u16 } else { 0x7e00u16 };
    // (first position, new tokens) per sequence and step.
    let steps: [&[(usize, usize)]; 3] = [
        &[(300, 40), (517, 1), (0, 23), (64, 1), (1000, 1)],
        &[(340, 1), (518, 1), (23, 1), (65, 1), (1001, 1)],
        &[(341, 5), (519, 1), (24, 3), (66, 1), (1002, 1)],
    ];
    for window in [5usize, 37, 100, 1 << 20] {
        // gpt-oss's sinks: beside a window (its local layers) and alone (a window wider than
        // any context: its global layers), of the size of the scores so that they matter.
        let sinks: Option<Vec<f32>> = matches!(window, 37 | 0x100000)
            .then(|| (0..case.heads).map(|_| 1.0 + 2.0 * r.f()).collect());
        for (si, step) in steps.iter().enumerate() {
            let what = format!(
                "window {window} sinks {} d={d} heads {}/{nkv} {:?} step {si}",
                sinks.is_some(),
                case.heads,
                case.dtype
            );
            // Ring blocks per sequence from a shuffled free list; contents NaN but for the
            // keys some query of the step sees.
            let mut free: Vec<u32> = (0..num_blocks as u32).collect();
            for i in (1..free.len()).rev() {
                free.swap(i, r.below(i + 1));
            }
            let per_head = bs * d;
            let mut k = vec![nan; num_blocks * nkv * per_head];
            let mut v = k.clone();
            let mut tables = Vec::new();
            for &(first_pos, n) in step.iter() {
                let end = first_pos + n;
                let lo = (first_pos + 1).saturating_sub(window);
                let ring_len = (end - lo).div_ceil(bs) + 1;
                let ring: Vec<u32> = free.split_off(free.len() - ring_len);
                let table: Vec<u32> = (0..end.div_ceil(bs)).map(|i| ring[i % ring_len]).collect();
                for p in lo..end {
                    let blk = table[p / bs] as usize;
                    for h in 0..nkv {
                        let at = ((blk * nkv + h) * bs + p % bs) * d;
                        for j in 0..d {
                            k[at + j] = enc(r.f());
                            v[at + j] = enc(r.f());
                        }
                    }
                }
                tables.push(table);
            }
            for (g, gpool) in backends.iter().zip(&mut gpools) {
                fill_pools(&c, &mut cpool, g, gpool, &k, &v, nkv, per_head);
            }
            let mut spans = Vec::new();
            let mut rows = 0;
            for (&(first_pos, n), table) in step.iter().zip(&tables) {
                spans.push(SeqSpan {
                    first_row: rows,
                    n_tokens: n,
                    first_pos,
                    blocks: table,
                });
                rows += n;
            }
            let w = geo.qkv_width();
            let qkv = r.vec(rows * w, 1.5);
            let cols = case.heads * d;
            let cq = cpu_t(qkv.clone(), rows, w);
            let mut co = c.tensor(rows, cols).unwrap();
            let csinks = sinks.as_ref().map(|s| c.vector(s).unwrap());
            let variant = turbokv_backend::AttnVariant {
                window: Some(window),
                sinks: csinks.as_ref(),
            };
            c.attention_variant(&cq, &geo, &spans, &cpool, &variant, &mut co)
                .unwrap();
            for (bi, (g, gpool)) in backends.iter().zip(&gpools).enumerate() {
                let gq = gpu_t(g, &qkv, rows, w);
                let mut go = poison(g, rows, cols);
                let gsinks = sinks.as_ref().map(|s| g.vector(s).unwrap());
                let variant = turbokv_backend::AttnVariant {
                    window: Some(window),
                    sinks: gsinks.as_ref(),
                };
                g.attention_variant(&gq, &geo, &spans, gpool, &variant, &mut go)
                    .unwrap();
                // The tensor-core kernels (head_dim 64/128) round queries and softmax weights
                // to the cache's 16-bit type, as in `run_case`; f32 SIMT kernels otherwise.
                let (atol, rtol) = if matches!(d, 64 | 128) {
                    (1e-2, 2e-2)
                } else {
                    (2e-3, 1e-2)
                };
                let what = format!("{what} backend {bi}");
                let e = close(&what, &host(g, &go), co.as_slice(), atol, rtol);
                eprintln!("{what}: max err {e:.2e}");
            }
        }
    }
}

/// Sliding windows and attention sinks (with a window and alone) on every 16-bit attention
/// path against the CPU backend: bf16 and f16 pools, GQA groups 1/4/8, head_dim 64/128/256 on the default kernels (tensor-core prefill
/// and decode template; the keys-as-M decode kernel for 256) and on the SIMT ones (the row kernel, the
/// tiled kernel for group 12 and head_dim 96), every decode template variant forced, and the
/// 8-warp prefill tiles.
#[test]
fn window_attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    let simt = gpu_simt();
    let mut seed = 900;
    for d in [64, 128, 256] {
        for group in [1, 4, 8] {
            for dtype in [KvDtype::Bf16, KvDtype::F16] {
                seed += 1;
                let case = WindowCase {
                    heads: 2 * group,
                    kv_heads: 2,
                    d,
                    dtype,
                };
                run_window_case(&[g, simt], &case, seed);
            }
        }
    }
    for (group, d) in [(12, 128), (2, 96)] {
        seed += 1;
        let case = WindowCase {
            heads: 2 * group,
            kv_heads: 2,
            d,
            dtype: KvDtype::Bf16,
        };
        run_window_case(&[g, simt], &case, seed);
    }
    let mut others = Vec::new();
    for v in DECODE_VARIANTS {
        let opts = CudaOptions {
            decode_variant: Some(v),
            ..test_options()
        };
        others.push((
            v.head_dim,
            CudaBackend::with_options(0, &opts).expect("a backend"),
        ));
    }
    let opts = CudaOptions {
        prefill_warps: 8,
        ..test_options()
    };
    let wide = CudaBackend::with_options(0, &opts).expect("a backend");
    for d in [64, 128, 256] {
        let mut bs: Vec<&CudaBackend> = others
            .iter()
            .filter(|(hd, _)| *hd == d)
            .map(|(_, b)| b)
            .collect();
        bs.push(&wide);
        for (group, dtype) in [(1, KvDtype::F16), (8, KvDtype::Bf16)] {
            seed += 1;
            let case = WindowCase {
                heads: 2 * group,
                kv_heads: 2,
                d,
                dtype,
            };
            run_window_case(&bs, &case, seed);
        }
    }
}

/// Windows and sinks are admitted over every pool, 16-bit and coded; what CUDA attention
/// cannot run is refused with a typed error naming it: more than 8 query heads per kv head
/// at head_dim 256 (at the capability query and at the call, 16-bit or coded), sink logits
/// of the wrong count, a window of 0.
#[test]
fn unsupported_attention_variants_are_refused() {
    let Some(g) = gpu() else { return };
    let geo = AttnGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        scale: 0.125,
    };
    let window = turbokv_backend::VariantNeeds {
        window: true,
        sinks: false,
    };
    let sinks = turbokv_backend::VariantNeeds {
        window: false,
        sinks: true,
    };
    g.supports_attention_variant(&geo, KvDtype::F16, window)
        .unwrap();
    g.supports_attention_variant(&geo, KvDtype::Bf16, window)
        .unwrap();
    let tq3: KvDtype = "tq3".parse().unwrap();
    g.supports_attention_variant(&geo, tq3, Default::default())
        .unwrap();
    for dtype in [KvDtype::F16, KvDtype::Bf16, tq3] {
        g.supports_attention_variant(&geo, dtype, sinks).unwrap();
    }
    let both = turbokv_backend::VariantNeeds {
        window: true,
        sinks: true,
    };
    g.supports_attention_variant(&geo, KvDtype::F16, both)
        .unwrap();
    for dtype in [tq3, "int8".parse().unwrap()] {
        for needs in [window, both] {
            g.supports_attention_variant(&geo, dtype, needs).unwrap();
        }
    }
    let wide = |group: usize| AttnGeometry {
        n_heads: 2 * group,
        n_kv_heads: 2,
        head_dim: 256,
        scale: 0.0625,
    };
    g.supports_attention(&wide(8), tq3).unwrap();
    g.supports_attention(&wide(8), KvDtype::Bf16).unwrap();
    for dtype in [tq3, KvDtype::Bf16] {
        let e = g.supports_attention(&wide(16), dtype).unwrap_err();
        assert!(
            matches!(e, Error::UnsupportedAttention { .. })
                && e.to_string().contains("head_dim 256"),
            "{e}"
        );
    }
    let table = [0u32];
    let spans = [SeqSpan {
        first_row: 0,
        n_tokens: 1,
        first_pos: 3,
        blocks: &table,
    }];
    let qkv = gpu_t(g, &vec![0.5; geo.qkv_width()], 1, geo.qkv_width());
    let mut out = poison(g, 1, 4 * 64);
    let coded = KvLayout::uniform(1, 2, 256, tq3, 16, 64).unwrap();
    let pool = g.kv_pool(&coded, 0).unwrap();
    let w16 = wide(16);
    let qkv16 = gpu_t(g, &vec![0.5; w16.qkv_width()], 1, w16.qkv_width());
    let mut out16 = poison(g, 1, 32 * 256);
    let e = g
        .attention(&qkv16, &w16, &spans, &pool, &mut out16)
        .unwrap_err();
    assert!(e.to_string().contains("16 query heads"), "{e}");
    let sink_logits = g.vector(&[0.0; 3]).unwrap();
    let layout = KvLayout::uniform(1, 2, 64, KvDtype::F16, 16, 64).unwrap();
    let pool = g.kv_pool(&layout, 0).unwrap();
    let variant = turbokv_backend::AttnVariant {
        window: None,
        sinks: Some(&sink_logits),
    };
    let e = g
        .attention_variant(&qkv, &geo, &spans, &pool, &variant, &mut out)
        .unwrap_err();
    assert!(e.to_string().contains("3 sink logits for 4"), "{e}");
    let variant = turbokv_backend::AttnVariant {
        window: Some(0),
        sinks: None,
    };
    assert!(
        g.attention_variant(&qkv, &geo, &spans, &pool, &variant, &mut out)
            .is_err()
    );
}

/// gpt-oss's mixture of experts on the GPU (routing, experts over the pairs that chose them,
/// clamped SwiGLU, weighted sum: all on the device) against the CPU backend's, with the same
/// bf16-exact weights: the fixture's shape (biases everywhere), a decode row without biases,
/// a 300-row prefill chunk whose widths are not multiples of 8 (the scalar weight loads), 32
/// experts top-4 of width 256 → 512, and rows that repeat (the same experts and output); then
/// the same op replayed as a CUDA graph over new inputs gives the eager result bit for bit.
#[test]
fn moe_matches_cpu() {
    use turbokv_backend::{MoeExpert, MoeMlp, WeightMatrix};
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(4242);
    let bf =
        |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect() };
    for (hidden, ffn, n_exp, top_k, rows, biases) in [
        (64, 32, 4, 2, 9, true),
        (96, 40, 8, 3, 1, false),
        (100, 36, 16, 4, 300, true),
        (256, 512, 32, 4, 20, true),
    ] {
        let what = format!("moe {hidden}→{ffn}, top-{top_k} of {n_exp}, {rows} rows");
        let mat = |r: &mut Rng, rows: usize, cols: usize, scale: f32| {
            WeightMatrix::from_f32(rows, cols, &bf(r.vec(rows * cols, scale))).unwrap()
        };
        let bias = |r: &mut Rng, n: usize| biases.then(|| r.vec(n, 0.5));
        let router = mat(&mut r, n_exp, hidden, 0.3);
        let router_bias = bias(&mut r, n_exp);
        // gate/up large enough that the clamp is reached on both sides.
        let experts: Vec<MoeExpert<WeightMatrix, Vec<f32>>> = (0..n_exp)
            .map(|_| MoeExpert {
                gate_up: mat(&mut r, 2 * ffn, hidden, 1.5),
                gate_up_bias: bias(&mut r, 2 * ffn),
                down: mat(&mut r, hidden, ffn, 0.2),
                down_bias: bias(&mut r, hidden),
            })
            .collect();
        // The experts resident on a GPU backend.
        let upload = |b: &CudaBackend| -> Vec<MoeExpert<_, _>> {
            experts
                .iter()
                .map(|e| MoeExpert {
                    gate_up: b.matrix(&e.gate_up).unwrap(),
                    gate_up_bias: e.gate_up_bias.as_ref().map(|v| b.vector(v).unwrap()),
                    down: b.matrix(&e.down).unwrap(),
                    down_bias: e.down_bias.as_ref().map(|v| b.vector(v).unwrap()),
                })
                .collect()
        };
        let gexperts = upload(g);
        let grouter = g.matrix(&router).unwrap();
        let grouter_bias = router_bias.as_ref().map(|b| g.vector(b).unwrap());
        let cmlp = MoeMlp {
            router: &router,
            router_bias: router_bias.as_ref(),
            experts: &experts,
            top_k,
            alpha: 1.702,
            limit: 7.0,
        };
        let gmlp = MoeMlp {
            router: &grouter,
            router_bias: grouter_bias.as_ref(),
            experts: &gexperts,
            top_k,
            alpha: 1.702,
            limit: 7.0,
        };
        let run = |x: &[f32]| {
            let mut co = c.tensor(rows, hidden).unwrap();
            c.moe(&cpu_t(x.to_vec(), rows, hidden), &cmlp, &mut co)
                .unwrap();
            let mut go = poison(g, rows, hidden);
            g.moe(&gpu_t(g, x, rows, hidden), &gmlp, &mut go).unwrap();
            (co.as_slice().to_vec(), host(g, &go))
        };
        let mut x = r.vec(rows * hidden, 1.0);
        if rows > 2 {
            let first = x[..hidden].to_vec();
            x[(rows - 1) * hidden..].copy_from_slice(&first);
        }
        let (want, got) = run(&x);
        let e = close(&what, &got, &want, 1e-3 * rms(&want), 1e-3);
        eprintln!("{what}: max err {e:.2e} (rms {:.3})", rms(&want));
        if rows > 2 {
            assert_eq!(
                got[..hidden],
                got[(rows - 1) * hidden..],
                "{what}: repeated row"
            );
        }
        // Graph replay: a backend of its own (graph mode is backend-wide).
        let own = CudaBackend::with_options(0, &test_options()).unwrap();
        let oexperts = upload(&own);
        let orouter = own.matrix(&router).unwrap();
        let orouter_bias = router_bias.as_ref().map(|b| own.vector(b).unwrap());
        let omlp = MoeMlp {
            router: &orouter,
            router_bias: orouter_bias.as_ref(),
            experts: &oexperts,
            top_k,
            alpha: 1.702,
            limit: 7.0,
        };
        // Each step's input rows are embedding rows (the graph's uploaded input is the ids).
        let vocab = 64;
        let table = bf(r.vec(vocab * hidden, 1.0));
        let otable = own
            .matrix(&WeightMatrix::from_f32(vocab, hidden, &table).unwrap())
            .unwrap();
        let mut ox = own.tensor(rows, hidden).unwrap();
        let mut oo = own.tensor(rows, hidden).unwrap();
        for step in 0..4 {
            let ids: Vec<u32> = (0..rows).map(|_| r.below(vocab) as u32).collect();
            let x: Vec<f32> = ids
                .iter()
                .flat_map(|&i| table[i as usize * hidden..(i as usize + 1) * hidden].to_vec())
                .collect();
            let (want, _) = run(&x);
            let mut got = Vec::new();
            own.run_graphed(|| -> Result<(), turbokv_backend::Error> {
                own.embed(&otable, &ids, &mut ox)?;
                own.moe(&ox, &omlp, &mut oo)?;
                own.to_host(&oo, &mut got)
            })
            .unwrap();
            close(
                &format!("{what} graphed step {step}"),
                &got,
                &want,
                1e-3 * rms(&want),
                1e-3,
            );
        }
        let stats = own.graph_stats().unwrap();
        assert!(stats.replayed >= 2, "{what}: {stats:?}");
    }
}

/// LFM2's gated short convolution on the GPU against the CPU backend: a ragged batch (a
/// prefill span, decode rows, a span longer than the carried state), states of several
/// lengths carried in and out, 3 and 4 taps; a wrongly sized state is refused.
#[test]
fn short_conv_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut r = Rng(5150);
    for (h, taps) in [(32, 3), (40, 4)] {
        let spans_n = [
            (7usize, 6usize),
            (1, 2 + taps),
            (1, taps - 1),
            (23, taps + 1),
        ];
        let rows: usize = spans_n.iter().map(|s| s.0).sum();
        let bcx = r.vec(rows * 3 * h, 1.0);
        let kernel = r.vec(h * taps, 0.5);
        let mut states: Vec<Vec<f32>> = spans_n
            .iter()
            .map(|&(_, keep)| r.vec(keep * h, 1.0))
            .collect();
        let mut gstates = states.clone();
        let mut spans = Vec::new();
        let mut first = 0;
        let table: Vec<u32> = Vec::new();
        for &(n, _) in &spans_n {
            spans.push(SeqSpan {
                first_row: first,
                n_tokens: n,
                first_pos: 10,
                blocks: &table,
            });
            first += n;
        }
        let mut co = c.tensor(rows, h).unwrap();
        let mut cs: Vec<&mut [f32]> = states.iter_mut().map(|s| s.as_mut_slice()).collect();
        c.short_conv(
            &cpu_t(bcx.clone(), rows, 3 * h),
            &kernel,
            &spans,
            &mut cs,
            &mut co,
        )
        .unwrap();
        let mut go = poison(g, rows, h);
        let gk = g.vector(&kernel).unwrap();
        let gb = gpu_t(g, &bcx, rows, 3 * h);
        let mut gs: Vec<&mut [f32]> = gstates.iter_mut().map(|s| s.as_mut_slice()).collect();
        g.short_conv(&gb, &gk, &spans, &mut gs, &mut go).unwrap();
        let what = format!("short conv h={h} taps={taps}");
        let e = close(&what, &host(g, &go), co.as_slice(), 1e-5, 1e-5);
        eprintln!("{what}: max err {e:.2e}");
        for (i, (a, b)) in gstates.iter().zip(&states).enumerate() {
            close(&format!("{what} state {i}"), a, b, 0.0, 0.0);
        }
        let mut short = vec![0.0; (taps - 2) * h];
        let mut bad: Vec<&mut [f32]> = vec![short.as_mut_slice()];
        let e = g
            .short_conv(&gb, &gk, &spans[..1], &mut bad, &mut go)
            .unwrap_err();
        assert!(e.to_string().contains("state"), "{e}");
    }
}
