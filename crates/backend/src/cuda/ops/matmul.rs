//! Matmuls: the GEMV kernel (decode rows, with its fused epilogues) and cuBLAS, and the one
//! place that chooses between them.

use super::{addr, expect_cols, int, opc};
use crate::Error;
use crate::backend::Backend;
use crate::cuda::kernels;
use crate::cuda::launch::{BlasGemm, KernelArg, Launches};
use crate::cuda::step::grow;
use crate::cuda::{CudaBackend, CudaMatrix, CudaTensor, CudaVector};
use crate::shape::shape;
use cudarc::driver::LaunchConfig;

/// One GEMV launch: `y[:, 0 .. Σ rows] (+)= x · [W₀; …]ᵀ` (x: `t ≤ 8` bf16 rows of width
/// `k`, `k % 8 == 0`, at `xp`; y: f32 rows of stride `ldy` at `yp`). With `yb` non-zero the
/// gated kernel instead: `y = silu(g) · u` of the two halves of the product (`ldy` = half the
/// rows) and its bf16 copy into `yb`. `pdl`: launched with programmatic dependent launch.
/// The kernel with the RMSNorm of x fused in front when `norm` is set.
pub(super) struct Gemv {
    pub(super) xp: u64,
    pub(super) t: usize,
    pub(super) k: usize,
    pub(super) yp: u64,
    pub(super) ldy: i32,
    pub(super) accumulate: bool,
    pub(super) yb: u64,
    pub(super) pdl: bool,
    /// `Some((norm weights, eps))`: the normed kernel, reading f32 x at `xf` (`xp` unused).
    pub(super) norm: Option<(u64, f32)>,
    pub(super) xf: u64,
    /// The rope-write epilogue's arguments (the `gemv_rope` kernels).
    pub(super) rope: Option<RopeKvArgs>,
}

/// The rope-write GEMV epilogue's arguments: `struct RopeKv` in gemv.cu, field for field
/// (device pointers as `u64`), passed by value as one kernel parameter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct RopeKvArgs {
    pub(super) inv_freq: u64,
    /// Zero: no bias.
    pub(super) bias: u64,
    pub(super) tok_pos: u64,
    pub(super) tok_seq: u64,
    pub(super) seq_tbl: u64,
    pub(super) tables: u64,
    pub(super) k_cache: u64,
    pub(super) v_cache: u64,
    pub(super) n_pairs: i32,
    pub(super) half_split: i32,
    pub(super) head_dim: i32,
    pub(super) q_rows: i32,
    pub(super) k_rows: i32,
    pub(super) block_size: i32,
    pub(super) is_bf16: i32,
    /// The struct's tail padding made explicit (always 0), so that every byte is initialised.
    pub(super) pad: i32,
}

// SAFETY: `repr(C)` like `struct RopeKv` (eight 8-byte pointers, seven ints; C pads the
// struct to 96 bytes, here the explicit `pad`), 8-aligned, no padding bytes.
unsafe impl KernelArg for RopeKvArgs {}
const _: () = assert!(std::mem::size_of::<RopeKvArgs>() == 8 * 8 + 8 * 4);

/// How a matmul finishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Epilogue {
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
    /// [`Backend::matmul`].
    pub(super) fn matmul_impl(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        expect_cols("matmul", x, w.cols)?;
        expect_cols("matmul", out, w.rows)?;
        self.set_rows(out, x.rows)?;
        self.gemm(x, &[w], out, Epilogue::Store, None)
    }

    /// [`Backend::matmul_add`].
    pub(super) fn matmul_add_impl(
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

    /// [`Backend::matmul_cat`].
    pub(super) fn matmul_cat_impl(
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

    /// [`Backend::matmul_silu`].
    pub(super) fn matmul_silu_impl(
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

    /// [`Backend::rms_norm_matmul_cat`].
    pub(super) fn rms_norm_matmul_cat_impl(
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

    /// [`Backend::rms_norm_matmul_silu`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_matmul_silu_impl(
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

    /// Whether a matmul of `t` activation rows of width `k` runs on the GEMV kernel (else
    /// cuBLAS): the one place that chooses. GEMV for few rows (decode), where it reads the
    /// weights faster than cuBLAS and needs no split-K reduction; it needs `k % 8 == 0` for
    /// its 16-byte loads.
    pub(super) fn use_gemv(&self, t: usize, k: usize) -> bool {
        (1..=self.gemv_max_rows).contains(&t) && k.is_multiple_of(8)
    }

    /// Whether `rms_norm(x) · Wᵀ` runs as one normed GEMV launch (else the norm, then the
    /// matmul): when the matmul takes the GEMV kernel, over at most 4 matrices of x's width.
    /// One row only: with 2 the normed kernel was slower than the norm launch it saves
    /// (5.85 vs 5.34 ms per llama3-8b step at batch 2).
    pub(super) fn fuse_norm(&self, x: &CudaTensor, norm: &CudaVector, ws: &[CudaMatrix]) -> bool {
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
    pub(super) fn gemm(
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
    pub(super) fn blas_args(
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
    pub(super) fn gemv<'f>(
        &'f self,
        l: &mut Launches<'f>,
        g: &Gemv,
        ws: &[&CudaMatrix],
    ) -> Result<(), Error> {
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
}
