//! LFM2's gated short convolution on CUDA. The conv states are host slices (the trait's
//! contract), so each call uploads the spans' states, runs one launch per span and reads the
//! new states back: a host round trip per conv layer, which keeps such steps out of CUDA
//! graphs (the model runs them eagerly; in graph capture or replay the op refuses).

use super::{addr, ints, opc};
use crate::Error;
use crate::backend::{Backend, SeqSpan};
use crate::cuda::graph::Mode;
use crate::cuda::launch::Launches;
use crate::cuda::step::graph_changed;
use crate::cuda::{CudaBackend, CudaTensor, CudaVector, cuda_err};
use crate::shape::check_short_conv;

impl CudaBackend {
    /// [`Backend::short_conv`].
    pub(super) fn short_conv_impl(
        &self,
        bcx: &CudaTensor,
        kernel: &CudaVector,
        spans: &[SeqSpan<'_>],
        states: &mut [&mut [f32]],
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        let h = out.cols;
        let lens: Vec<usize> = states.iter().map(|s| s.len()).collect();
        let taps = check_short_conv(bcx.rows, bcx.cols, h, kernel.len, spans, &lens)?;
        if self.lock_state("short_conv")?.mode() != Mode::Eager {
            return Err(graph_changed("a short convolution reads host state"));
        }
        self.set_rows(out, bcx.rows)?;
        if spans.is_empty() {
            return Ok(());
        }
        let s = &self.stream;
        let host: Vec<f32> = states.iter().flat_map(|st| st.iter().copied()).collect();
        let old = s.clone_htod(&host).map_err(cuda_err("short_conv state"))?;
        let new = s
            .alloc_zeros::<f32>(host.len())
            .map_err(cuda_err("short_conv state"))?;
        let (bp, kp, op) = (addr(&bcx.buf, s), addr(&kernel.data, s), addr(&out.buf, s));
        let (oldp, newp) = (addr(&old, s), addr(&new, s));
        let mut at = 0u64;
        for (sp, state) in spans.iter().zip(states.iter()) {
            let keep = state.len() / h;
            let [n, hi, ti, ki] = ints("short_conv", [sp.n_tokens, h, taps, keep])?;
            let row = sp.first_row as u64;
            let mut l = Launches::new(opc::CONV);
            l.kernel(
                "short_conv",
                &self.k.short_conv,
                self.grid_1d((sp.n_tokens + keep) * h),
                false,
            )
            .ptr(bp + row * 3 * h as u64 * 4)
            .ptr(kp)
            .ptr(oldp + at * 4)
            .ptr(op + row * h as u64 * 4)
            .ptr(newp + at * 4)
            .arg(n)
            .arg(hi)
            .arg(ti)
            .arg(ki);
            self.lock_state("short_conv")?.admit(l.signature())?;
            // SAFETY: the span's rows lie inside bcx (3h wide) and out (h wide), checked
            // above; the kernel holds h·taps values; this span's old and new states are
            // `keep·h` floats at offset `at` of buffers holding every span's.
            unsafe { self.launch(&mut l) }?;
            at += state.len() as u64;
        }
        let back = s.clone_dtoh(&new).map_err(cuda_err("short_conv state"))?;
        let mut from = 0;
        for state in states.iter_mut() {
            state.copy_from_slice(&back[from..from + state.len()]);
            from += state.len();
        }
        Ok(())
    }
}
