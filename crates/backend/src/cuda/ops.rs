//! [`Backend`] for [`CudaBackend`]: shape checks on the host, then kernel launches on the
//! backend's stream.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, LaunchConfig};
use half::bf16;
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

use super::graph::Mode;
use super::kernels;
use super::launch::{BlasGemm, KernelArg, Launches, launch_raw};
use super::picks::{self, CudaPicks};
use super::step::{device_addr, graph_changed, grow, pinned_words};
use super::{
    CudaBackend, CudaKvPool, CudaMatrix, CudaTensor, CudaVector, cuda_err, unsupported_kv,
};
use crate::backend::{
    AttnGeometry, Backend, QkNorm, QkvProjection, Rope, RopeStyle, SeqSpan, separate_qkv_write_kv,
};
use crate::cpu::shape;
use crate::topk::{check_k, select_top_k};
use crate::{Error, TopK, WeightMatrix};

pub(super) fn describe(b: &CudaBackend) -> String {
    format!("cuda:{} ({}, {}, {} SMs)", b.ordinal, b.name, b.arch, b.sms)
}

pub(super) fn expect_cols(op: &'static str, t: &CudaTensor, cols: usize) -> Result<(), Error> {
    if t.cols != cols {
        return Err(shape(
            op,
            format!("tensor has {} columns, expected {cols}", t.cols),
        ));
    }
    Ok(())
}

pub(super) fn int(op: &'static str, v: usize) -> Result<i32, Error> {
    i32::try_from(v).map_err(|_| shape(op, format!("{v} exceeds the kernel's 32-bit range")))
}

pub(super) fn ints<const N: usize>(op: &'static str, v: [usize; N]) -> Result<[i32; N], Error> {
    let mut out = [0i32; N];
    for (o, v) in out.iter_mut().zip(v) {
        *o = int(op, v)?;
    }
    Ok(out)
}

fn rows_cfg(rows: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// The device address of a buffer (event tracking is off, so the guard does nothing).
pub(super) fn addr<T, P: DevicePtr<T>>(p: &P, stream: &Arc<CudaStream>) -> u64 {
    let (a, _guard) = p.device_ptr(stream);
    a
}

/// The argument array of [`CudaBackend::launch_ex`]: a pointer to each value, in order (the
/// values must have the kernel parameters' exact types and outlive the launch call).
macro_rules! kargs {
    ($($a:expr),* $(,)?) => {
        [$((&$a as *const _ as *mut std::ffi::c_void)),*]
    };
}
pub(super) use kargs;

/// Op codes that start each launch signature.
pub(super) mod opc {
    pub const GEMM: u64 = 1;
    pub const ATTN: u64 = 2;
    pub const EMBED: u64 = 3;
    pub const NORM: u64 = 4;
    pub const BIAS: u64 = 5;
    pub const ADD: u64 = 6;
    pub const SILU: u64 = 7;
    pub const GATHER: u64 = 8;
    pub const WRITE_KV: u64 = 9;
    pub const ATTN_MMA: u64 = 10;
    /// Launched outside graphs (no signature is admitted), listed for completeness.
    pub const TOPK: u64 = 11;
    pub const ARGMAX: u64 = 12;
    pub const FILL_RANDOM: u64 = 13;
}

/// One GEMV launch: `y[:, 0 .. Σ rows] (+)= x · [W₀; …]ᵀ` (x: `t ≤ 8` bf16 rows of width
/// `k`, `k % 8 == 0`, at `xp`; y: f32 rows of stride `ldy` at `yp`). With `yb` non-zero the
/// gated kernel instead: `y = silu(g) · u` of the two halves of the product (`ldy` = half the
/// rows) and its bf16 copy into `yb`. `pdl`: launched with programmatic dependent launch.
/// The kernel with the RMSNorm of x fused in front when `norm` is set.
struct Gemv {
    xp: u64,
    t: usize,
    k: usize,
    yp: u64,
    ldy: i32,
    accumulate: bool,
    yb: u64,
    pdl: bool,
    /// `Some((norm weights, eps))`: the normed kernel, reading f32 x at `xf` (`xp` unused).
    norm: Option<(u64, f32)>,
    xf: u64,
    /// The rope-write epilogue's arguments (the `gemv_rope` kernels).
    rope: Option<RopeKvArgs>,
}

/// The rope-write GEMV epilogue's arguments: `struct RopeKv` in gemv.cu, field for field
/// (device pointers as `u64`), passed by value as one kernel parameter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RopeKvArgs {
    inv_freq: u64,
    /// Zero: no bias.
    bias: u64,
    tok_pos: u64,
    tok_seq: u64,
    seq_tbl: u64,
    tables: u64,
    k_cache: u64,
    v_cache: u64,
    n_pairs: i32,
    half_split: i32,
    head_dim: i32,
    q_rows: i32,
    k_rows: i32,
    block_size: i32,
    is_bf16: i32,
    /// The struct's tail padding made explicit (always 0), so that every byte is initialised.
    pad: i32,
}

// SAFETY: `repr(C)` like `struct RopeKv` (eight 8-byte pointers, seven ints; C pads the
// struct to 96 bytes, here the explicit `pad`), 8-aligned, no padding bytes.
unsafe impl KernelArg for RopeKvArgs {}
const _: () = assert!(std::mem::size_of::<RopeKvArgs>() == 8 * 8 + 8 * 4);

/// How a matmul finishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Epilogue {
    /// `out = x · Wᵀ`.
    Store,
    /// `out += x · Wᵀ` (a fused residual add).
    Add,
    /// `out = silu(g) · u` of the two halves of `x · Wᵀ`, plus its bf16 copy (GEMV only).
    SiluMul,
    /// `out = x · [Wq; Wk; Wv]ᵀ (+ bias)` with RoPE applied to q and k, and k and v stored in
    /// the paged pool (GEMV only): a decode step's `write_kv` in the matmul.
    RopeWrite(RopeKvArgs),
}

impl CudaBackend {
    /// Whether a matmul of `t` activation rows of width `k` runs on the GEMV kernel (else
    /// cuBLAS): the one place that chooses. GEMV for few rows (decode), where it reads the
    /// weights faster than cuBLAS and needs no split-K reduction; it needs `k % 8 == 0` for
    /// its 16-byte loads.
    fn use_gemv(&self, t: usize, k: usize) -> bool {
        (1..=self.gemv_max_rows).contains(&t) && k.is_multiple_of(8)
    }

    /// Whether `rms_norm(x) · Wᵀ` runs as one normed GEMV launch (else the norm, then the
    /// matmul): when the matmul takes the GEMV kernel, over at most 4 matrices of x's width.
    /// One row only: with 2 the normed kernel was slower than the norm launch it saves
    /// (5.85 vs 5.34 ms per llama3-8b step at batch 2).
    fn fuse_norm(&self, x: &CudaTensor, norm: &CudaVector, ws: &[CudaMatrix]) -> bool {
        x.rows == 1
            && self.use_gemv(x.rows, x.cols)
            && norm.len == x.cols
            && ws.len() <= 4
            && ws.iter().all(|w| w.cols == x.cols)
    }

    /// `out[:, col .. col + w.rows] (+)= bf16(x) · Wᵀ` for each `(w, col)`, f32 accumulate,
    /// finished as `epi` says.
    /// With `norm = Some((w, eps))` (GEMV only) the input is `rms_norm(x, w, eps)`, fused
    /// into the kernel.
    fn gemm(
        &self,
        x: &CudaTensor,
        ws: &[&CudaMatrix],
        out: &mut CudaTensor,
        epi: Epilogue,
        norm: Option<(&CudaVector, f32)>,
    ) -> Result<(), Error> {
        let (t, k) = (x.rows, x.cols);
        if t == 0 {
            return Ok(());
        }
        let gemv = self.use_gemv(t, k);
        let rope = match epi {
            Epilogue::RopeWrite(r) => Some(r),
            _ => None,
        };
        if (epi == Epilogue::SiluMul || rope.is_some() || norm.is_some()) && (!gemv || ws.len() > 4)
        {
            return Err(shape(
                "matmul",
                "the fused form needs the GEMV kernel".into(),
            ));
        }
        let normed = norm.map(|(w, eps)| (addr(&w.data, &self.stream), eps));
        let xsrc = addr(&x.buf, &self.stream);
        let mut st = self.lock_state("matmul")?;
        // The op before wrote bf16(x) into a scratch buffer already: no conversion launch.
        let copy = st
            .bf16_of
            .filter(|&[src, _, r, c]| (src, r, c) == (xsrc, t as u64, k as u64))
            .map(|b| b[1]);
        // Programmatic dependent launch of the GEMV only right after one of the backend's
        // kernels that trigger it (the op that wrote bf16(x), or a GEMV), themselves launched
        // after every earlier write of the weights.
        let pdl = gemv && self.pdl && (copy.is_some() || (normed.is_some() && st.last_gemv));
        let sc = st.sc();
        let may_alloc = !sc.defer;
        let xp = match (copy, normed) {
            (Some(p), _) => p,
            // The normed kernel reads x in f32.
            (None, Some(_)) => 0,
            (None, None) => addr(
                grow(&self.stream, &mut sc.bf16, t * k, may_alloc)?,
                &self.stream,
            ),
        };
        // The gated epilogue's bf16 output: the scratch buffer x's copy is not in.
        let yb = if epi == Epilogue::SiluMul {
            let alt_holds_x = sc.bf16_alt.as_ref().map(|b| addr(b, &self.stream)) == Some(xp);
            let slot = if alt_holds_x {
                &mut sc.bf16
            } else {
                &mut sc.bf16_alt
            };
            addr(
                grow(&self.stream, slot, t * out.cols, may_alloc)?,
                &self.stream,
            )
        } else {
            0
        };
        let op = addr(&out.buf, &self.stream);
        let ldc = int("matmul", out.cols)?;
        let mut l = Launches::new(opc::GEMM);
        if copy.is_none() && normed.is_none() {
            l.kernel(
                "f32_to_bf16",
                &self.k.f32_to_bf16,
                self.grid_1d(t * k),
                false,
            )
            .ptr(xsrc)
            .ptr(xp)
            .arg((t * k) as u64);
        }
        let accumulate = epi == Epilogue::Add;
        let mut col = 0usize;
        if gemv {
            let mut pdl = pdl;
            for group in ws.chunks(4) {
                let g = Gemv {
                    xp,
                    t,
                    k,
                    yp: op + (col * 4) as u64,
                    ldy: ldc,
                    accumulate,
                    yb,
                    pdl,
                    xf: xsrc,
                    norm: normed,
                    rope,
                };
                self.gemv(&mut l, &g, group)?;
                pdl = false;
                col += group.iter().map(|w| w.rows).sum::<usize>();
            }
        } else {
            for w in ws {
                l.gemm(self.blas_args(xp, t, k, w, op + (col * 4) as u64, ldc, accumulate)?);
                col += w.rows;
            }
        }
        let launch = st.admit(l.signature())?;
        if epi == Epilogue::SiluMul {
            st.bf16_of = Some([op, yb, t as u64, out.cols as u64]);
        }
        st.last_gemv = gemv;
        // Like `write_kv`, the rope-write GEMV triggers its dependents at its start and wrote
        // this step's keys: a decode attention behind it may prefetch the older ones.
        st.last_write_kv = rope.is_some();
        if !launch {
            return Ok(());
        }
        // SAFETY: the conversion reads t·k floats of x and writes t·k bf16 of the scratch,
        // both at least that long. Each GEMV: W is [rows, k] bf16 (rows summing to n_total,
        // ends cumulative), x is [t, k] bf16 with 1 ≤ t ≤ 8 matching the kernel
        // instantiation, y has t rows of ldy ≥ n_total f32 (n_total / 2 gated, with yb
        // holding as many bf16; checked by the callers; normed: x is [t, k] f32 at xf, gw
        // holds k floats); k % 8 == 0 and 256-byte aligned allocations keep the 16-byte loads
        // aligned. With PDL the kernel reads x and y only after `griddepcontrol.wait`, and
        // before it only the weights, written before the kernel ahead started. Rope-write
        // (`project_qkv_write_kv` checked the geometry and the pool, uploaded the metadata
        // and frequencies): y is [t, q + k + v rows], the tokens' slots are inside the pool,
        // `n_pairs ≤ head_dim / 2` frequencies. cuBLAS: W is [rows, k] bf16, x [t, k] bf16,
        // y t rows of ldc ≥ the columns written (checked by the callers).
        unsafe { self.launch(&mut l) }
    }

    /// The cuBLAS GEMM `y[t, 0 .. w.rows] (+)= x · Wᵀ` (x: `t` bf16 rows of width `k`, y: f32
    /// rows of stride `ldy`).
    #[allow(clippy::too_many_arguments)]
    fn blas_args(
        &self,
        xp: u64,
        t: usize,
        k: usize,
        w: &CudaMatrix,
        yp: u64,
        ldy: i32,
        accumulate: bool,
    ) -> Result<BlasGemm, Error> {
        Ok(BlasGemm {
            w: addr(&w.data, &self.stream),
            n: int("matmul", w.rows)?,
            t: int("matmul", t)?,
            k: int("matmul", k)?,
            x: xp,
            y: yp,
            ldy,
            accumulate,
        })
    }

    /// Appends one launch of the GEMV kernel (see [`Gemv`]) over up to 4 matrices stacked
    /// along the output to `l`.
    fn gemv<'f>(&'f self, l: &mut Launches<'f>, g: &Gemv, ws: &[&CudaMatrix]) -> Result<(), Error> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        let mut ptrs = [addr(&first.data, &self.stream); 4];
        let mut ends = [0i32; 3];
        let mut total = 0usize;
        for (i, w) in ws.iter().take(4).enumerate() {
            ptrs[i] = addr(&w.data, &self.stream);
            total += w.rows;
            if let Some(e) = ends.get_mut(i) {
                *e = int("matmul", total)?;
            }
        }
        for e in ends.iter_mut().skip(ws.len()) {
            *e = int("matmul", total)?;
        }
        if total == 0 {
            return Ok(());
        }
        let (n_total, kk) = (int("matmul", total)?, int("matmul", g.k)?);
        let config = kernels::gemv_config(g.t, total, g.k, self.sms);
        let set = &self.k.gemv[config];
        let f = match (g.yb != 0, g.norm.is_some(), g.rope.is_some()) {
            (false, false, false) => &set.plain,
            (true, false, false) => &set.silu,
            (false, true, false) => &set.norm,
            (true, true, false) => &set.norm_silu,
            (false, false, true) => &set.rope,
            (false, true, true) => &set.norm_rope,
            (true, _, true) => {
                return Err(shape("matmul", "no gated rope-write epilogue".into()));
            }
        };
        let (gw, eps) = g.norm.unwrap_or((0, 0.0));
        let cfg = LaunchConfig {
            grid_dim: (
                total.div_ceil(kernels::GEMV_CONFIGS[config].rows_per_block) as u32,
                1,
                1,
            ),
            block_dim: (kernels::GEMV_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let a = l.kernel("gemv", f, cfg, g.pdl);
        a.ptr(ptrs[0]).ptr(ptrs[1]).ptr(ptrs[2]).ptr(ptrs[3]);
        a.arg(ends[0]).arg(ends[1]).arg(ends[2]).arg(n_total);
        a.ptr(g.xp)
            .arg(kk)
            .ptr(g.yp)
            .arg(g.ldy)
            .arg(i32::from(g.accumulate));
        a.ptr(g.yb).ptr(g.xf).ptr(gw).arg(eps);
        // The rope-write kernels take one more parameter.
        if let Some(rope) = g.rope {
            a.arg(rope);
        }
        Ok(())
    }

    /// Launches `f` with raw parameters (see [`launch_raw`]); for launches not yet described
    /// by a [`Launches`] list.
    ///
    /// # Safety
    /// As [`launch_raw`].
    pub(super) unsafe fn launch_ex(
        &self,
        f: &cudarc::driver::CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
        pdl: bool,
    ) -> Result<(), cudarc::driver::DriverError> {
        // SAFETY: the caller's contract.
        unsafe { launch_raw(&self.stream, f, cfg, params, pdl) }
    }
    /// Measured rate of the backend's GEMM configuration (bf16 inputs, f32 accumulate and
    /// output, cuBLAS) on an `m × n × k` product of random matrices, in FLOP/s: the mean of
    /// `reps` back-to-back products after a warm-up.
    pub fn gemm_rate(&self, m: usize, n: usize, k: usize, reps: usize) -> Result<f64, Error> {
        let a = self.random_matrix(m, k, 11, 1.0)?;
        let w = self.random_matrix(n, k, 12, 1.0)?;
        let mut out = self.zeros(m, n)?;
        let op = addr(&out.buf, &self.stream);
        let ap = addr(&a.data, &self.stream);
        let ldc = int("gemm_rate", n)?;
        // The backend's own GEMM call, so the rate is that of the configuration it runs.
        let g = self.blas_args(ap, m, k, &w, op, ldc, false)?;
        // SAFETY: a is [m, k] bf16, w [n, k] bf16, out [m, n] f32.
        let run = || unsafe { self.blas_gemm(&g) };
        for _ in 0..3 {
            run()?;
        }
        self.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            run()?;
        }
        self.synchronize()?;
        let secs = t.elapsed().as_secs_f64() / reps.max(1) as f64;
        out.rows = 0;
        drop(out);
        Ok(2.0 * m as f64 * n as f64 * k as f64 / secs)
    }

    /// Median kernel time in seconds (CUDA events) of the decode matmul `[m, k] · [n, k]ᵀ`
    /// (bf16 inputs, f32 output) on the GEMV kernel (`gemv`, m ≤ 8, k % 8 == 0) or on cuBLAS,
    /// over `reps` launches that cycle through enough copies of the weights (≥ 512 MB) that
    /// none is still in L2 when it is read again.
    pub fn matmul_time(
        &self,
        m: usize,
        n: usize,
        k: usize,
        reps: usize,
        gemv: bool,
    ) -> Result<f64, Error> {
        if gemv && !(m <= kernels::GEMV_MAX_ROWS && m > 0 && k.is_multiple_of(8)) {
            return Err(shape(
                "matmul_time",
                format!("no GEMV kernel for {m} rows of {k}"),
            ));
        }
        let bytes = (n * k * 2).max(1);
        let copies = (512usize << 20).div_ceil(bytes).clamp(2, 64);
        let ws: Vec<CudaMatrix> = (0..copies)
            .map(|i| self.random_matrix(n, k, 100 + i as u64, 1.0))
            .collect::<Result<_, _>>()?;
        let x = self.random_matrix(m, k, 7, 1.0)?;
        let out = self.zeros(m, n)?;
        let (xp, yp) = (addr(&x.data, &self.stream), addr(&out.buf, &self.stream));
        let ldy = int("matmul_time", n)?;
        let ev = || {
            self.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda_err("event"))
        };
        let (start, end) = (ev()?, ev()?);
        let mut times = Vec::with_capacity(reps);
        for i in 0..reps.max(1) + 3 {
            let w = &ws[i % copies];
            start.record(&self.stream).map_err(cuda_err("event"))?;
            let mut l = Launches::new(opc::GEMM);
            if gemv {
                let g = Gemv {
                    xp,
                    t: m,
                    k,
                    yp,
                    ldy,
                    accumulate: false,
                    yb: 0,
                    pdl: false,
                    norm: None,
                    xf: 0,
                    rope: None,
                };
                self.gemv(&mut l, &g, &[w])?;
            } else {
                l.gemm(self.blas_args(xp, m, k, w, yp, ldy, false)?);
            }
            // SAFETY: x is [m, k] bf16 (m ≤ 8 and k % 8 == 0 for the GEMV, checked above), w
            // [n, k] bf16, out [m, n] f32; no PDL.
            unsafe { self.launch(&mut l) }?;
            end.record(&self.stream).map_err(cuda_err("event"))?;
            let ms = start.elapsed_ms(&end).map_err(cuda_err("event"))?;
            if i >= 3 {
                times.push(f64::from(ms) * 1e-3);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type KvPool = CudaKvPool;
    type Picks = CudaPicks;

    fn run_step<E, F>(&self, step: F) -> Result<(), E>
    where
        E: From<Error>,
        F: FnMut() -> Result<(), E>,
    {
        self.run_graphed(step)
    }

    fn describe(&self) -> String {
        describe(self)
    }

    fn check_kv_dtype(&self, dtype: KvDtype, head_dim: usize) -> Result<(), Error> {
        match dtype {
            KvDtype::F16 | KvDtype::Bf16
                if (1..=256).contains(&head_dim) && head_dim.is_multiple_of(4) =>
            {
                Ok(())
            }
            other => Err(unsupported_kv(other)),
        }
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor, Error> {
        self.zeros(rows, cols)
    }

    fn set_rows(&self, t: &mut CudaTensor, rows: usize) -> Result<(), Error> {
        let need = rows
            .checked_mul(t.cols)
            .ok_or(Error::SizeOverflow { rows, cols: t.cols })?;
        if t.buf.len() < need {
            if self.lock_state("set_rows")?.mode() != Mode::Eager {
                return Err(graph_changed("a tensor must grow"));
            }
            let mut bigger = self
                .stream
                .alloc_zeros::<f32>(need)
                .map_err(cuda_err("alloc tensor"))?;
            let keep = t.buf.len();
            self.stream
                .memcpy_dtod(&t.buf, &mut bigger.slice_mut(..keep))
                .map_err(cuda_err("copy"))?;
            t.buf = bigger;
        }
        t.rows = rows;
        Ok(())
    }

    fn to_host(&self, t: &CudaTensor, out: &mut Vec<f32>) -> Result<(), Error> {
        {
            let mut st = self.lock_state("to_host")?;
            st.epoch += 1;
            self.finish_graph_step(&mut st)?;
        }
        out.clear();
        out.resize(t.len(), 0.0);
        if t.len() > 0 {
            self.stream
                .memcpy_dtoh(&t.buf.slice(..t.len()), out.as_mut_slice())
                .map_err(cuda_err("download"))?;
        }
        self.synchronize()
    }

    fn cols(&self, t: &CudaTensor) -> usize {
        t.cols
    }

    /// Ends the step like `to_host`, then selects on the device, which writes
    /// `rows · (2k + 3)` words straight into mapped page-locked memory instead of `rows · cols`
    /// floats coming back.
    ///
    /// The selection kernel is launched *after* `finish_graph_step`, directly on the stream and
    /// without `admit`: it is not part of a captured graph, so one graph serves steps ending
    /// in `to_host` and in this call alike (for any `k`), and switching between them never
    /// recaptures. Stream order puts it after the graph launch, whose logits it reads. The
    /// price is one ordinary launch per step.
    fn to_host_top_k(&self, t: &CudaTensor, k: usize, out: &mut TopK) -> Result<(), Error> {
        check_k(k)?;
        if !self.device_top_k {
            let mut host = Vec::new();
            self.to_host(t, &mut host)?;
            return select_top_k(&host, t.cols, k, out);
        }
        let cols = int("to_host_top_k", t.cols)?;
        let kk = int("to_host_top_k", k)?;
        let stride = 2 * k + 3;
        {
            let mut st = self.lock_state("to_host_top_k")?;
            self.finish_graph_step(&mut st)?;
            out.reset(t.rows, t.cols, k);
            if t.rows == 0 || t.cols == 0 {
                drop(st);
                return self.synchronize();
            }
            // Not admitted, so clear what `admit` would: the next launch must not take this one
            // for a GEMV or KV write it may overlap with.
            st.last_gemv = false;
            st.last_write_kv = false;
            let n = t.rows * stride;
            let sc = st.sc();
            if sc.topk_host.as_ref().is_none_or(|h| h.len() < n) {
                sc.topk_host = None;
                sc.topk_host = Some(pinned_words(&self.stream, n, "alloc top-k")?);
            }
            let host = sc.topk_host.as_mut().ok_or_else(|| Error::Cuda {
                op: "to_host_top_k",
                detail: "no host buffer".into(),
            })?;
            let (xp, op) = (
                addr(&t.buf, &self.stream),
                device_addr(host, "to_host_top_k")?,
            );
            let mut l = Launches::new(opc::TOPK);
            let cfg = rows_cfg(t.rows, kernels::TOPK_THREADS, 0);
            l.kernel("topk_rows", &self.k.topk_rows, cfg, false)
                .ptr(xp)
                .ptr(op)
                .arg(cols)
                .arg(kk);
            // SAFETY: x holds rows · cols floats; `op` is the mapped page-locked buffer of at
            // least rows · (2k + 3) words (the host reads it only after the sync below), every
            // one of which the kernel writes; 1 ≤ k ≤ TOPK_MAX (checked above), as the
            // kernel's shared candidate array requires; one block of TOPK_THREADS per row.
            unsafe { self.launch(&mut l) }?;
            self.synchronize()?;
            let words = &host.as_slice().map_err(cuda_err("download top-k"))?[..n];
            for (r, w) in words.chunks_exact(stride).enumerate() {
                let n = (w[2 * k] as usize).min(k);
                out.ids[r * k..r * k + n].copy_from_slice(&w[..n]);
                for (l, &bits) in out.logits[r * k..r * k + n].iter_mut().zip(&w[k..k + n]) {
                    *l = f32::from_bits(bits);
                }
                out.counts[r] = n as u32;
                out.max[r] = f32::from_bits(w[2 * k + 1]);
                out.lse[r] = f32::from_bits(w[2 * k + 2]);
            }
        }
        Ok(())
    }

    fn matrix(&self, w: &WeightMatrix) -> Result<CudaMatrix, Error> {
        use half::slice::HalfFloatSliceExt;
        let f = w.dequantize_all();
        let mut h = vec![bf16::ZERO; f.len()];
        h.convert_from_f32_slice(&f);
        drop(f);
        let data = if h.is_empty() {
            self.stream
                .alloc_zeros::<bf16>(1)
                .map_err(cuda_err("alloc matrix"))?
        } else {
            self.stream
                .clone_htod(&h)
                .map_err(cuda_err("upload matrix"))?
        };
        Ok(CudaMatrix {
            data,
            rows: w.rows(),
            cols: w.cols(),
        })
    }

    fn vector(&self, v: &[f32]) -> Result<CudaVector, Error> {
        let data = if v.is_empty() {
            self.stream
                .alloc_zeros::<f32>(1)
                .map_err(cuda_err("alloc vector"))?
        } else {
            self.stream
                .clone_htod(v)
                .map_err(cuda_err("upload vector"))?
        };
        Ok(CudaVector { data, len: v.len() })
    }

    fn kv_pool(&self, layout: &KvLayout, layer: usize) -> Result<CudaKvPool, Error> {
        self.pool(layout, layer)
    }

    fn embed(&self, table: &CudaMatrix, ids: &[u32], out: &mut CudaTensor) -> Result<(), Error> {
        expect_cols("embed", out, table.cols)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(shape(
                "embed",
                format!("token id {id} outside vocabulary of {}", table.rows),
            ));
        }
        self.set_rows(out, ids.len())?;
        if ids.is_empty() {
            return Ok(());
        }
        let mut st = self.lock_state("embed")?;
        let idx = addr(st.sc().upload_idx(&self.stream, ids, false)?, &self.stream);
        let (tp, op) = (
            addr(&table.data, &self.stream),
            addr(&out.buf, &self.stream),
        );
        let cols = int("embed", table.cols)?;
        let mut l = Launches::new(opc::EMBED);
        let cfg = rows_cfg(ids.len(), 256, 0);
        l.kernel("embed", &self.k.embed_bf16, cfg, false)
            .ptr(tp)
            .ptr(idx)
            .ptr(op)
            .arg(cols);
        if !st.admit(l.signature())? {
            return Ok(());
        }
        // SAFETY: ids were checked against the table's rows; out holds ids.len() rows; the
        // index buffer holds ids.len() ids (uploaded before the kernel runs).
        unsafe { self.launch(&mut l) }
    }

    fn new_picks(&self) -> Result<CudaPicks, Error> {
        Ok(CudaPicks::default())
    }

    /// The top-1 selection is launched after `finish_graph_step`, outside any graph, like
    /// `to_host_top_k`'s; see `picks.rs` for why no wait is needed.
    fn pick_greedy(&self, t: &CudaTensor, p: &mut CudaPicks) -> Result<(), Error> {
        let slot_i = p.next_slot()?;
        if t.rows == 0 || t.cols == 0 {
            return Err(shape("pick_greedy", "no logits to pick from".into()));
        }
        let cols = int("pick_greedy", t.cols)?;
        let mut st = self.lock_state("pick_greedy")?;
        self.finish_graph_step(&mut st)?;
        st.epoch += 1;
        // Not admitted, so clear what `admit` would (see `to_host_top_k`).
        st.last_gemv = false;
        st.last_write_kv = false;
        let n = t.rows * picks::WORDS;
        let ids = addr(grow(&self.stream, &mut p.ids, t.rows, true)?, &self.stream);
        if p.slots[slot_i].as_ref().is_none_or(|s| s.host.len() < n) {
            p.slots[slot_i] = None;
            let mut host = pinned_words(&self.stream, n, "alloc picks")?;
            let dev = device_addr(&mut host, "alloc picks")?;
            let done = self.ctx.new_event(None).map_err(cuda_err("alloc picks"))?;
            p.slots[slot_i] = Some(picks::Slot {
                host,
                dev,
                done,
                rows: 0,
            });
        }
        let slot = p.slots[slot_i]
            .as_mut()
            .ok_or_else(|| shape("pick_greedy", "no host slot".into()))?;
        let blocks = t
            .cols
            .div_ceil(kernels::ARGMAX_PER_ROUND)
            .clamp(1, kernels::ARGMAX_MAX_BLOCKS);
        let partial = addr(
            grow(&self.stream, &mut p.partial, t.rows * blocks, true)?,
            &self.stream,
        );
        let counters = addr(
            grow(&self.stream, &mut p.counters, t.rows, true)?,
            &self.stream,
        );
        let xp = addr(&t.buf, &self.stream);
        let cfg = LaunchConfig {
            grid_dim: (t.rows as u32, blocks as u32, 1),
            block_dim: (kernels::ARGMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = Launches::new(opc::ARGMAX);
        l.kernel("argmax_rows", &self.k.argmax_rows, cfg, false)
            .ptr(xp)
            .arg(cols)
            .ptr(partial)
            .ptr(counters)
            .ptr(ids)
            .ptr(slot.dev);
        // SAFETY: x holds rows · cols floats; `partial` rows · blocks words, `counters` rows
        // (zeroed at allocation, reset by the kernel), `ids` rows ids, and the slot (mapped
        // page-locked memory, not read by the host before `done`, recorded below) at least
        // rows · WORDS words; one of each written per row.
        unsafe { self.launch(&mut l) }?;
        slot.done.record(&self.stream).map_err(cuda_err("pick"))?;
        slot.rows = t.rows;
        p.pending += 1;
        p.rows = t.rows;
        p.cols = t.cols;
        Ok(())
    }

    fn wait_picks(&self, p: &mut CudaPicks, out: &mut Vec<u32>) -> Result<(), Error> {
        p.wait(out)
    }

    fn embed_picks(
        &self,
        table: &CudaMatrix,
        p: &CudaPicks,
        rows: usize,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        expect_cols("embed_picks", out, table.cols)?;
        let (ids, vocab) = p.latest(rows)?;
        // Every id is below the logits' width (or 0), so this bounds the gather.
        if vocab > table.rows {
            return Err(shape(
                "embed_picks",
                format!(
                    "picks over {vocab} logits but the embedding has {} rows",
                    table.rows
                ),
            ));
        }
        self.set_rows(out, rows)?;
        let mut st = self.lock_state("embed_picks")?;
        let (tp, idx, op) = (
            addr(&table.data, &self.stream),
            addr(ids, &self.stream),
            addr(&out.buf, &self.stream),
        );
        let cols = int("embed_picks", table.cols)?;
        let mut l = Launches::new(opc::EMBED);
        l.kernel("embed", &self.k.embed_bf16, rows_cfg(rows, 256, 0), false)
            .ptr(tp)
            .ptr(idx)
            .ptr(op)
            .arg(cols);
        if !st.admit(l.signature())? {
            return Ok(());
        }
        // SAFETY: `ids` holds `rows` ids below the table's rows (checked above: each is an
        // index into a row of `vocab ≤ table.rows` logits, or 0), written by the selection
        // queued before this launch; out holds `rows` rows of the table's width.
        unsafe { self.launch(&mut l) }
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaVector,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        expect_cols("rms_norm", x, w.len)?;
        expect_cols("rms_norm", out, w.len)?;
        self.set_rows(out, x.rows)?;
        if x.rows == 0 {
            return Ok(());
        }
        let cols = int("rms_norm", x.cols)?;
        let mut st = self.lock_state("rms_norm")?;
        let sc = st.sc();
        let may_alloc = !sc.defer;
        let ob = addr(
            grow(&self.stream, &mut sc.bf16, x.rows * x.cols, may_alloc)?,
            &self.stream,
        );
        let (xp, wp, op) = (
            addr(&x.buf, &self.stream),
            addr(&w.data, &self.stream),
            addr(&out.buf, &self.stream),
        );
        let threads = if x.cols.is_multiple_of(4) {
            (x.cols / 4).div_ceil(32).clamp(1, 32) as u32 * 32
        } else {
            256
        };
        let mut l = Launches::new(opc::NORM);
        let cfg = rows_cfg(x.rows, threads, 0);
        l.kernel("rms_norm", &self.k.rms_norm, cfg, false)
            .ptr(xp)
            .ptr(wp)
            .ptr(op)
            .arg(cols)
            .arg(eps)
            .ptr(ob);
        let launch = st.admit(l.signature())?;
        st.bf16_of = Some([op, ob, x.rows as u64, x.cols as u64]);
        if !launch {
            return Ok(());
        }
        // SAFETY: x and out hold rows·cols floats, w holds cols, the bf16 scratch rows·cols
        // halves; the block size is a multiple of 32 up to 1024; allocations are 256-byte
        // aligned, so the float4 loads (cols % 4 == 0) are aligned.
        unsafe { self.launch(&mut l) }
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaMatrix, out: &mut CudaTensor) -> Result<(), Error> {
        expect_cols("matmul", x, w.cols)?;
        expect_cols("matmul", out, w.rows)?;
        self.set_rows(out, x.rows)?;
        self.gemm(x, &[w], out, Epilogue::Store, None)
    }

    fn matmul_add(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        acc: &mut CudaTensor,
        _tmp: &mut CudaTensor,
    ) -> Result<(), Error> {
        expect_cols("matmul_add", x, w.cols)?;
        expect_cols("matmul_add", acc, w.rows)?;
        if acc.rows != x.rows {
            return Err(shape(
                "matmul_add",
                format!("[{}, {}] += {} rows", acc.rows, acc.cols, x.rows),
            ));
        }
        self.gemm(x, &[w], acc, Epilogue::Add, None)
    }

    fn matmul_cat(
        &self,
        x: &CudaTensor,
        ws: &[CudaMatrix],
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        let total: usize = ws.iter().map(|w| w.rows).sum();
        expect_cols("matmul_cat", out, total)?;
        for w in ws {
            expect_cols("matmul_cat", x, w.cols)?;
        }
        self.set_rows(out, x.rows)?;
        let refs: Vec<&CudaMatrix> = ws.iter().collect();
        self.gemm(x, &refs, out, Epilogue::Store, None)
    }

    fn matmul_silu(
        &self,
        x: &CudaTensor,
        ws: &[CudaMatrix],
        gate_up: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        let total: usize = ws.iter().map(|w| w.rows).sum();
        if total != 2 * out.cols {
            return Err(shape(
                "matmul_silu",
                format!("{total} rows of [gate | up] for {} outputs", out.cols),
            ));
        }
        if !self.use_gemv(x.rows, x.cols) || ws.len() > 4 {
            self.matmul_cat(x, ws, gate_up)?;
            return self.silu_mul(gate_up, out);
        }
        for w in ws {
            expect_cols("matmul_silu", x, w.cols)?;
        }
        self.set_rows(out, x.rows)?;
        let refs: Vec<&CudaMatrix> = ws.iter().collect();
        self.gemm(x, &refs, out, Epilogue::SiluMul, None)
    }

    fn rms_norm_matmul_cat(
        &self,
        x: &CudaTensor,
        norm: &CudaVector,
        eps: f32,
        ws: &[CudaMatrix],
        xn: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        if !self.fuse_norm(x, norm, ws) {
            self.rms_norm(x, norm, eps, xn)?;
            return self.matmul_cat(xn, ws, out);
        }
        let total: usize = ws.iter().map(|w| w.rows).sum();
        expect_cols("rms_norm_matmul_cat", out, total)?;
        self.set_rows(out, x.rows)?;
        let refs: Vec<&CudaMatrix> = ws.iter().collect();
        self.gemm(x, &refs, out, Epilogue::Store, Some((norm, eps)))
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_silu(
        &self,
        x: &CudaTensor,
        norm: &CudaVector,
        eps: f32,
        ws: &[CudaMatrix],
        xn: &mut CudaTensor,
        gate_up: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        if !self.fuse_norm(x, norm, ws) {
            self.rms_norm(x, norm, eps, xn)?;
            return self.matmul_silu(xn, ws, gate_up, out);
        }
        let total: usize = ws.iter().map(|w| w.rows).sum();
        if total != 2 * out.cols {
            return Err(shape(
                "rms_norm_matmul_silu",
                format!("{total} rows of [gate | up] for {} outputs", out.cols),
            ));
        }
        self.set_rows(out, x.rows)?;
        let refs: Vec<&CudaMatrix> = ws.iter().collect();
        self.gemm(x, &refs, out, Epilogue::SiluMul, Some((norm, eps)))
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaVector) -> Result<(), Error> {
        expect_cols("add_bias", x, bias.len)?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, cols) = (n as u64, int("add_bias", x.cols)?);
        let (xp, bp) = (addr(&x.buf, &self.stream), addr(&bias.data, &self.stream));
        let mut l = Launches::new(opc::BIAS);
        l.kernel("add_bias", &self.k.add_bias, self.grid_1d(n), false)
            .ptr(xp)
            .ptr(bp)
            .arg(n64)
            .arg(cols);
        if !self.lock_state("add_bias")?.admit(l.signature())? {
            return Ok(());
        }
        // SAFETY: x holds n floats, bias holds cols.
        unsafe { self.launch(&mut l) }
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<(), Error> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(shape(
                "add",
                format!("[{}, {}] += [{}, {}]", x.rows, x.cols, y.rows, y.cols),
            ));
        }
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let (xp, yp) = (addr(&x.buf, &self.stream), addr(&y.buf, &self.stream));
        let mut l = Launches::new(opc::ADD);
        l.kernel("add_assign", &self.k.add_assign, self.grid_1d(n), false)
            .ptr(xp)
            .ptr(yp)
            .arg(n64);
        if !self.lock_state("add_assign")?.admit(l.signature())? {
            return Ok(());
        }
        // SAFETY: x and y hold n floats each.
        unsafe { self.launch(&mut l) }
    }

    fn silu_mul(&self, gate_up: &CudaTensor, out: &mut CudaTensor) -> Result<(), Error> {
        expect_cols("silu_mul", gate_up, 2 * out.cols)?;
        self.set_rows(out, gate_up.rows)?;
        let n = out.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, f) = (n as u64, int("silu_mul", out.cols)?);
        let (gp, op) = (
            addr(&gate_up.buf, &self.stream),
            addr(&out.buf, &self.stream),
        );
        let mut st = self.lock_state("silu_mul")?;
        let sc = st.sc();
        let may_alloc = !sc.defer;
        let ob = addr(
            grow(&self.stream, &mut sc.bf16, n, may_alloc)?,
            &self.stream,
        );
        let mut l = Launches::new(opc::SILU);
        l.kernel("silu_mul", &self.k.silu_mul, self.grid_1d(n), false)
            .ptr(gp)
            .ptr(op)
            .arg(n64)
            .arg(f)
            .ptr(ob);
        let launch = st.admit(l.signature())?;
        st.bf16_of = Some([op, ob, out.rows as u64, out.cols as u64]);
        if !launch {
            return Ok(());
        }
        // SAFETY: gate_up holds rows·2f floats, out rows·f, the bf16 scratch rows·f halves.
        unsafe { self.launch(&mut l) }
    }

    fn gather_rows(
        &self,
        x: &CudaTensor,
        rows: &[usize],
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        expect_cols("gather_rows", out, x.cols)?;
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(shape("gather_rows", format!("row {r} of {}", x.rows)));
        }
        self.set_rows(out, rows.len())?;
        if rows.is_empty() {
            return Ok(());
        }
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let mut st = self.lock_state("gather_rows")?;
        let idx = addr(st.sc().upload_idx(&self.stream, &ids, true)?, &self.stream);
        let (xp, op) = (addr(&x.buf, &self.stream), addr(&out.buf, &self.stream));
        let cols = int("gather_rows", x.cols)?;
        let mut l = Launches::new(opc::GATHER);
        let cfg = rows_cfg(rows.len(), 256, 0);
        l.kernel("gather_rows", &self.k.gather_rows, cfg, false)
            .ptr(xp)
            .ptr(idx)
            .ptr(op)
            .arg(cols);
        if !st.admit(l.signature())? {
            return Ok(());
        }
        // SAFETY: every index is below x.rows; out holds rows.len() rows.
        unsafe { self.launch(&mut l) }
    }

    fn write_kv(
        &self,
        qkv: &mut CudaTensor,
        g: &AttnGeometry,
        rope: &Rope,
        qk_norm: Option<QkNorm<'_, CudaVector>>,
        spans: &[SeqSpan<'_>],
        pool: &mut CudaKvPool,
    ) -> Result<(), Error> {
        check_write_args(qkv, g, rope, qk_norm.as_ref(), pool)?;
        let rows = qkv.rows;
        let mut st = self.lock_state("write_kv")?;
        let epoch = st.epoch;
        let sc = st.sc();
        sc.prepare_spans(&self.stream, spans, rows, pool, epoch)?;
        if rows == 0 {
            return Ok(());
        }
        sc.rope(&self.stream, &rope.inv_freq)?;
        let inv_freq = addr(sc.rope_buf()?, &self.stream);
        let m = sc.meta()?;
        let meta = [
            addr(&m.pos, &self.stream),
            addr(&m.seq, &self.stream),
            addr(&m.seq_tbl, &self.stream),
            addr(&m.tables, &self.stream),
        ];
        let (qn, kn, eps, has_norm) = self.norm_args(qk_norm.as_ref());
        let [width, nh, nkv, d, pairs, bs] = ints(
            "write_kv",
            [
                g.qkv_width(),
                g.n_heads,
                g.n_kv_heads,
                g.head_dim,
                rope.inv_freq.len(),
                pool.block_size,
            ],
        )?;
        let half_split = i32::from(rope.style == RopeStyle::HalfSplit);
        let is_bf16 = i32::from(pool.is_bf16);
        let (qp, kp, vp) = (
            addr(&qkv.buf, &self.stream),
            addr(&pool.k, &self.stream),
            addr(&pool.v, &self.stream),
        );
        let threads = g.head_dim.div_ceil(32).clamp(1, 8) as u32 * 32;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (g.n_heads + 2 * g.n_kv_heads) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((g.head_dim + 32) * 4) as u32,
        };
        let mut l = Launches::new(opc::WRITE_KV);
        let a = l.kernel("write_kv", &self.k.write_kv, cfg, false);
        a.ptr(qp).arg(width).arg(nh).arg(nkv).arg(d);
        a.ptr(meta[0]).ptr(meta[1]).ptr(meta[2]).ptr(meta[3]);
        a.ptr(inv_freq).arg(pairs).arg(half_split);
        a.ptr(qn).ptr(kn).arg(eps).arg(has_norm);
        a.ptr(kp).ptr(vp).arg(bs).arg(is_bf16);
        let launch = st.admit(l.signature())?;
        st.last_write_kv = true;
        if !launch {
            return Ok(());
        }
        // SAFETY: spans tile the rows and every block they touch is inside the pool (checked
        // above); qkv rows are qkv_width wide; the norm/rope vectors have the lengths passed;
        // the metadata buffer holds the encoded spans (uploaded before the kernel runs).
        unsafe { self.launch(&mut l) }
    }

    fn attention(
        &self,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CudaKvPool,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.attention_impl(qkv, g, spans, pool, out)
    }

    /// Decode rows on the GEMV kernel, without a q/k norm: one matmul launch (normed for one
    /// row, else after the RMSNorm launch) whose rope-write epilogue (gemv.cu) adds the bias,
    /// applies RoPE and stores the new keys and values. Otherwise the separate ops.
    fn project_qkv_write_kv(
        &self,
        x: &CudaTensor,
        proj: QkvProjection<'_, CudaVector, CudaMatrix>,
        g: &AttnGeometry,
        rope: &Rope,
        spans: &[SeqSpan<'_>],
        pool: &mut CudaKvPool,
        xn: &mut CudaTensor,
        qkv: &mut CudaTensor,
    ) -> Result<(), Error> {
        let total: usize = proj.weights.iter().map(|w| w.rows).sum();
        let fusable = self.rope_gemv
            && proj.qk_norm.is_none()
            && self.use_gemv(x.rows, x.cols)
            && (1..=4).contains(&proj.weights.len())
            && proj.weights.iter().all(|w| w.cols == x.cols)
            && total == g.qkv_width()
            && g.head_dim.is_multiple_of(
                kernels::GEMV_CONFIGS[kernels::gemv_config(x.rows, total, x.cols, self.sms)]
                    .rows_per_block,
            )
            && proj.bias.is_none_or(|b| b.len == total);
        if !fusable {
            return separate_qkv_write_kv(self, x, proj, g, rope, spans, pool, xn, qkv);
        }
        self.set_rows(qkv, x.rows)?;
        check_write_args(qkv, g, rope, None, pool)?;
        let args = {
            let mut st = self.lock_state("project_qkv_write_kv")?;
            let epoch = st.epoch;
            let sc = st.sc();
            sc.prepare_spans(&self.stream, spans, x.rows, pool, epoch)?;
            sc.rope(&self.stream, &rope.inv_freq)?;
            let inv_freq = addr(sc.rope_buf()?, &self.stream);
            let m = sc.meta()?;
            let [n_pairs, head_dim, q_rows, k_rows, block_size] = ints(
                "project_qkv_write_kv",
                [
                    rope.inv_freq.len(),
                    g.head_dim,
                    g.n_heads * g.head_dim,
                    g.n_kv_heads * g.head_dim,
                    pool.block_size,
                ],
            )?;
            RopeKvArgs {
                inv_freq,
                bias: proj.bias.map_or(0, |b| addr(&b.data, &self.stream)),
                tok_pos: addr(&m.pos, &self.stream),
                tok_seq: addr(&m.seq, &self.stream),
                seq_tbl: addr(&m.seq_tbl, &self.stream),
                tables: addr(&m.tables, &self.stream),
                k_cache: addr(&pool.k, &self.stream),
                v_cache: addr(&pool.v, &self.stream),
                n_pairs,
                half_split: i32::from(rope.style == RopeStyle::HalfSplit),
                head_dim,
                q_rows,
                k_rows,
                block_size,
                is_bf16: i32::from(pool.is_bf16),
                pad: 0,
            }
        };
        let refs: Vec<&CudaMatrix> = proj.weights.iter().collect();
        let epi = Epilogue::RopeWrite(args);
        if self.fuse_norm(x, proj.norm, proj.weights) {
            self.gemm(x, &refs, qkv, epi, Some((proj.norm, proj.eps)))
        } else {
            self.rms_norm(x, proj.norm, proj.eps, xn)?;
            self.gemm(xn, &refs, qkv, epi, None)
        }
    }
}

impl CudaBackend {
    /// The q/k norm kernel arguments: weight addresses, eps, and the on flag (zeros when off:
    /// the kernels then never read them).
    fn norm_args(&self, qk_norm: Option<&QkNorm<'_, CudaVector>>) -> (u64, u64, f32, i32) {
        match qk_norm {
            Some(n) => (
                addr(&n.q.data, &self.stream),
                addr(&n.k.data, &self.stream),
                n.eps,
                1,
            ),
            None => (0, 0, 0.0, 0),
        }
    }
}

/// The checks of `write_kv`'s arguments (also the fused decode attention's).
fn check_write_args(
    qkv: &CudaTensor,
    g: &AttnGeometry,
    rope: &Rope,
    qk_norm: Option<&QkNorm<'_, CudaVector>>,
    pool: &CudaKvPool,
) -> Result<(), Error> {
    expect_cols("write_kv", qkv, g.qkv_width())?;
    check_geometry(g, pool)?;
    if 2 * rope.inv_freq.len() > g.head_dim {
        return Err(shape(
            "rope",
            format!("{} pairs for head_dim {}", rope.inv_freq.len(), g.head_dim),
        ));
    }
    if let Some(n) = qk_norm
        && (n.q.len != g.head_dim || n.k.len != g.head_dim)
    {
        return Err(shape(
            "qk_norm",
            format!(
                "weights of {} / {} for head_dim {}",
                n.q.len, n.k.len, g.head_dim
            ),
        ));
    }
    Ok(())
}

pub(super) fn check_geometry(g: &AttnGeometry, pool: &CudaKvPool) -> Result<(), Error> {
    if g.n_kv_heads != pool.kv_heads
        || g.head_dim != pool.head_dim
        || g.n_kv_heads == 0
        || !g.n_heads.is_multiple_of(g.n_kv_heads)
    {
        return Err(shape(
            "kv",
            format!(
                "geometry {g:?} vs pool {} heads × {}",
                pool.kv_heads, pool.head_dim
            ),
        ));
    }
    Ok(())
}
