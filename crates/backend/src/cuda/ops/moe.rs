//! The mixture-of-experts MLP on CUDA (gpt-oss): routing, the experts and the weighted sum all
//! on the device (moe.cu), so a decode step needs no host round trip and stays one graph. The
//! kernels find each expert's weights through a table of device addresses per layer, built
//! on first use and kept for as long as its contents stay the addresses of the layer's
//! weights.

use super::{addr, expect_cols, ints, opc};
use crate::Error;
use crate::backend::{Backend, MoeMlp};
use crate::cuda::graph::Mode;
use crate::cuda::kernels::{MOE_MAX_EXPERTS, MOE_MAX_K, MOE_ROWS_PER_BLOCK, MOE_THREADS};
use crate::cuda::launch::Launches;
use crate::cuda::step::{graph_changed, grow};
use crate::cuda::{CudaBackend, CudaMatrix, CudaTensor, CudaVector, cuda_err};
use crate::shape::shape;
use cudarc::driver::LaunchConfig;

/// The widest expert input (`hidden`, `ffn`) `moe_gemv` stages in shared memory (44 KiB of
/// f32, under the 48 KiB a kernel gets without opting in).
pub(crate) const MOE_MAX_IN: usize = 11 * 1024;
// moe_gemv's shared memory: the staged row, its pair list and count.
const _: () = assert!(MOE_MAX_IN * 4 + MOE_THREADS as usize * 4 + 4 <= 48 * 1024);

/// Tables of expert addresses kept at once (one per MoE layer of the loaded models).
const MOE_TABLES: usize = 512;

/// Checks `mlp`'s shapes against an input of width `hidden` and the kernels' limits.
fn check(mlp: &MoeMlp<'_, CudaMatrix, CudaVector>, hidden: usize) -> Result<(), Error> {
    let n = mlp.experts.len();
    let bad = |m: String| Err(shape("moe", m));
    if !(1..=n).contains(&mlp.top_k) {
        return bad(format!("top-{} of {n} experts", mlp.top_k));
    }
    if n > MOE_MAX_EXPERTS || mlp.top_k > MOE_MAX_K {
        return bad(format!(
            "{n} experts, {} per token: the CUDA kernels take at most {MOE_MAX_EXPERTS} \
             experts and {MOE_MAX_K} per token",
            mlp.top_k
        ));
    }
    if (mlp.router.rows, mlp.router.cols) != (n, hidden) {
        return bad(format!(
            "router [{}, {}] for {n} experts of width {hidden}",
            mlp.router.rows, mlp.router.cols
        ));
    }
    if mlp.router_bias.is_some_and(|b| b.len != n) {
        return bad(format!("router bias for {n} experts has another length"));
    }
    let f2 = mlp.experts[0].gate_up.rows;
    for (e, x) in mlp.experts.iter().enumerate() {
        let ok = f2.is_multiple_of(2)
            && x.gate_up.rows == f2
            && x.gate_up.cols == hidden
            && (x.down.rows, x.down.cols) == (hidden, f2 / 2)
            && x.gate_up_bias.as_ref().is_none_or(|b| b.len == f2)
            && x.down_bias.as_ref().is_none_or(|b| b.len == hidden);
        if !ok {
            return bad(format!(
                "expert {e}: gate_up [{}, {}], down [{}, {}] for width {hidden} (every \
                 expert of one layer has expert 0's shape)",
                x.gate_up.rows, x.gate_up.cols, x.down.rows, x.down.cols
            ));
        }
    }
    if hidden.max(f2 / 2) > MOE_MAX_IN {
        return bad(format!(
            "experts of width {hidden} → {} → {hidden}: the CUDA kernels take widths up to \
             {MOE_MAX_IN}",
            f2 / 2
        ));
    }
    Ok(())
}

impl CudaBackend {
    /// The device table of `mlp`'s expert addresses, `[gate_up | gate_up bias | down | down
    /// bias]` by expert (0 for a missing bias): found by its contents, else uploaded — only
    /// outside graph capture and replay (a step runs eagerly before it is captured, so a
    /// graph never meets a table it lacks; if it does, the step falls back to eager).
    fn moe_table(&self, mlp: &MoeMlp<'_, CudaMatrix, CudaVector>) -> Result<u64, Error> {
        let s = &self.stream;
        let mut host = Vec::with_capacity(4 * mlp.experts.len());
        host.extend(mlp.experts.iter().map(|x| addr(&x.gate_up.data, s)));
        host.extend(
            mlp.experts
                .iter()
                .map(|x| x.gate_up_bias.as_ref().map_or(0, |b| addr(&b.data, s))),
        );
        host.extend(mlp.experts.iter().map(|x| addr(&x.down.data, s)));
        host.extend(
            mlp.experts
                .iter()
                .map(|x| x.down_bias.as_ref().map_or(0, |b| addr(&b.data, s))),
        );
        let mut st = self.lock_state("moe")?;
        if let Some((_, t)) = st.moe_tables.iter().find(|(h, _)| *h == host) {
            return Ok(addr(t, s));
        }
        if st.mode() != Mode::Eager {
            return Err(graph_changed("an expert table must be uploaded"));
        }
        let table = s.clone_htod(&host).map_err(cuda_err("moe table"))?;
        let a = addr(&table, s);
        if st.moe_tables.len() >= MOE_TABLES {
            st.moe_tables.remove(0);
        }
        st.moe_tables.push((host, table));
        Ok(a)
    }

    /// [`Backend::moe`].
    pub(super) fn moe_impl(
        &self,
        x: &CudaTensor,
        mlp: &MoeMlp<'_, CudaMatrix, CudaVector>,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        let (rows, hidden) = (x.rows, x.cols);
        expect_cols("moe", out, hidden)?;
        check(mlp, hidden)?;
        self.set_rows(out, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let (n, k) = (mlp.experts.len(), mlp.top_k);
        let f = mlp.experts[0].gate_up.rows / 2;
        let pairs = rows * k;
        let table = self.moe_table(mlp)?;
        let n8 = (n * 8) as u64;
        let [n_i, hidden_i, k_i, pairs_i, f_i, f2_i] =
            ints("moe", [n, hidden, k, pairs, f, 2 * f])?;
        let s = &self.stream;
        let (xp, rp, op) = (
            addr(&x.buf, s),
            addr(&mlp.router.data, s),
            addr(&out.buf, s),
        );
        let rb = mlp.router_bias.map_or(0, |b| addr(&b.data, s));
        let mut st = self.lock_state("moe")?;
        let sc = st.sc();
        let may_alloc = !sc.defer;
        let sel = addr(grow(s, &mut sc.moe_sel, pairs, may_alloc)?, s);
        // f32 intermediates end to end: weights, gate_up outputs, activations, expert outputs.
        let (wt_n, gu_n, act_n) = (pairs, pairs * 2 * f, pairs * f);
        let tmp = addr(
            grow(
                s,
                &mut sc.moe,
                wt_n + gu_n + act_n + pairs * hidden,
                may_alloc,
            )?,
            s,
        );
        let (wt, gu) = (tmp, tmp + 4 * wt_n as u64);
        let act = gu + 4 * gu_n as u64;
        let y = act + 4 * act_n as u64;
        let gemv_cfg = |outs: usize, ins: usize| LaunchConfig {
            grid_dim: (outs.div_ceil(MOE_ROWS_PER_BLOCK) as u32, n as u32, 1),
            block_dim: (MOE_THREADS, 1, 1),
            shared_mem_bytes: (ins * 4) as u32,
        };
        let route_cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (MOE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = Launches::new(opc::MOE);
        l.kernel("moe_route", &self.k.moe_route, route_cfg, false)
            .ptr(xp)
            .ptr(rp)
            .ptr(rb)
            .arg(n_i)
            .arg(hidden_i)
            .arg(k_i)
            .ptr(sel)
            .ptr(wt);
        l.kernel("moe_gemv", &self.k.moe_gemv, gemv_cfg(2 * f, hidden), false)
            .ptr(xp)
            .arg(0i32)
            .ptr(table)
            .ptr(table + n8)
            .ptr(sel)
            .arg(pairs_i)
            .arg(k_i)
            .arg(hidden_i)
            .arg(f2_i)
            .ptr(gu);
        l.kernel("moe_act", &self.k.moe_act, self.grid_1d(act_n), false)
            .ptr(gu)
            .ptr(act)
            .arg(act_n as u64)
            .arg(f_i)
            .arg(mlp.alpha)
            .arg(mlp.limit);
        l.kernel("moe_gemv", &self.k.moe_gemv, gemv_cfg(hidden, f), false)
            .ptr(act)
            .arg(1i32)
            .ptr(table + 2 * n8)
            .ptr(table + 3 * n8)
            .ptr(sel)
            .arg(pairs_i)
            .arg(k_i)
            .arg(f_i)
            .arg(hidden_i)
            .ptr(y);
        l.kernel(
            "moe_combine",
            &self.k.moe_combine,
            self.grid_1d(rows * hidden),
            false,
        )
        .ptr(y)
        .ptr(wt)
        .arg(k_i)
        .arg(hidden_i)
        .arg((rows * hidden) as u64)
        .ptr(op);
        if !st.admit(l.signature())? {
            return Ok(());
        }
        // SAFETY: shapes checked above: x and out hold rows·hidden floats, the router n·hidden
        // bf16 and its bias n floats; the table holds 4·n addresses of the experts' gate_up
        // ([2f, hidden] bf16), their biases (2f floats or 0), down ([hidden, f]) and its
        // biases (hidden or 0), all alive while `mlp` borrows them; `sel` holds rows·k words
        // and the scratch rows·k·(1 + 3f + hidden) floats at the offsets above; moe_route
        // writes an expert index < n for every pair before moe_gemv reads it (same stream);
        // n ≤ 256 and k ≤ 16 fit moe_route's arrays, and the staged input widths ≤ MOE_MAX_IN
        // floats fit the 48 KiB default shared memory beside moe_gemv's static arrays.
        unsafe { self.launch(&mut l) }
    }
}
