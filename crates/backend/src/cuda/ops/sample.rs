//! Ends of a step that sample: the device top-k selection and the greedy picks.

use super::{addr, int, opc, rows_cfg};
use crate::backend::Backend;
use crate::cuda::kernels;
use crate::cuda::launch::Launches;
use crate::cuda::picks::{self, CudaPicks};
use crate::cuda::step::{device_addr, grow, pinned_words};
use crate::cuda::{CudaBackend, CudaTensor, cuda_err};
use crate::shape::shape;
use crate::topk::{check_k, select_top_k};
use crate::{Error, TopK};
use cudarc::driver::LaunchConfig;

impl CudaBackend {
    /// Ends the step like `to_host`, then selects on the device, which writes
    /// `rows · (2k + 3)` words straight into mapped page-locked memory instead of `rows · cols`
    /// floats coming back.
    ///
    /// The selection kernel is launched *after* `finish_graph_step`, directly on the stream and
    /// without `admit`: it is not part of a captured graph, so one graph serves steps ending
    /// in `to_host` and in this call alike (for any `k`), and switching between them never
    /// recaptures. Stream order puts it after the graph launch, whose logits it reads. The
    /// price is one ordinary launch per step.
    pub(super) fn to_host_top_k_impl(
        &self,
        t: &CudaTensor,
        k: usize,
        out: &mut TopK,
    ) -> Result<(), Error> {
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
            // A step ends here as at `to_host`: the next step re-checks and re-uploads its
            // span metadata (`Scratch::prepare_spans`) even if its spans look the same.
            st.epoch += 1;
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

    /// The top-1 selection is launched after `finish_graph_step`, outside any graph, like
    /// `to_host_top_k`'s; see `picks.rs` for why no wait is needed.
    pub(super) fn pick_greedy_impl(&self, t: &CudaTensor, p: &mut CudaPicks) -> Result<(), Error> {
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
}
