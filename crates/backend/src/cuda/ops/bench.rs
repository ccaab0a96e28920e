//! Measurements of the backend's own matmul configurations (benchmarks' peers and rooflines).

use super::matmul::Gemv;
use super::{addr, int, opc};
use crate::Error;
use crate::cuda::kernels;
use crate::cuda::launch::Launches;
use crate::cuda::{CudaBackend, CudaMatrix, cuda_err};
use crate::shape::shape;

impl CudaBackend {
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
