//! The KV write (RoPE, optional q/k norm, new keys and values into the paged pool), alone or
//! fused into the qkv projection's GEMV epilogue.

use super::matmul::{Epilogue, RopeKvArgs};
use super::{addr, check_geometry, expect_cols, ints, opc};
use crate::Error;
use crate::backend::{
    AttnGeometry, Backend, QkNorm, QkvProjection, Rope, RopeStyle, SeqSpan, separate_qkv_write_kv,
};
use crate::cuda::codes::CODE_HEAD_DIMS;
use crate::cuda::kernels;
use crate::cuda::launch::Launches;
use crate::cuda::parts::PARTS_HEAD_DIMS;
use crate::cuda::{CudaBackend, CudaKvPool, CudaMatrix, CudaTensor, CudaVector};
use crate::shape::shape;
use cudarc::driver::LaunchConfig;

impl CudaBackend {
    /// [`Backend::write_kv`].
    pub(super) fn write_kv_impl(
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
        let meta = sc.meta()?.addrs(&self.stream);
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
        // A windowed pool: its exact blocks for these spans, and their table.
        let (exact, q8) = match &mut pool.exact {
            Some(x) => {
                x.prepare(&self.stream, spans, !sc.defer)?;
                let table = addr(sc.upload_exact(&self.stream, &x.slots.table)?, &self.stream);
                (
                    [addr(&x.k, &self.stream), addr(&x.v, &self.stream), table],
                    x.q8(),
                )
            }
            None => ([0; 3], 0),
        };
        if let Some(c) = &pool.codes {
            let hd = g.head_dim;
            let no_kernel = || shape("write_kv", format!("no coded kernel for head_dim {hd}"));
            // A parts pool (fractional widths, prod keys) has its own encoder.
            let f = match c.variant {
                Some(_) => {
                    let fi = CODE_HEAD_DIMS.iter().position(|&d| d == hd);
                    &self.k.write_kv_codes[fi.ok_or_else(no_kernel)?]
                }
                None => {
                    let fi = PARTS_HEAD_DIMS.iter().position(|&d| d == hd);
                    &self.k.write_kv_parts[fi.ok_or_else(no_kernel)?]
                }
            };
            let (kc, vc) = c.centers.as_ref().map_or((0, 0), |(k, v)| {
                (addr(k, &self.stream), addr(v, &self.stream))
            });
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, (g.n_heads + 2 * g.n_kv_heads) as u32, 1),
                block_dim: (32, 1, 1),
                // hv and the reduction's floats, the codes' bytes, an exact copy's floats.
                shared_mem_bytes: ((hd + 32) * 4 + hd + hd * 4) as u32,
            };
            let mut l = Launches::new(opc::WRITE_KV);
            let a = l.kernel("write_kv_codes", f, cfg, false);
            a.ptr(qp).arg(width).arg(nh).arg(nkv);
            a.ptr(meta[0]).ptr(meta[1]).ptr(meta[2]).ptr(meta[3]);
            a.ptr(inv_freq).arg(pairs).arg(half_split);
            a.ptr(qn).ptr(kn).arg(eps).arg(has_norm);
            a.ptr(kp).ptr(vp).arg(bs);
            a.ptr(addr(&c.desc, &self.stream)).ptr(kc).ptr(vc);
            a.ptr(exact[0]).ptr(exact[1]).ptr(exact[2]).arg(q8);
            let launch = st.admit(l.signature())?;
            st.last_write_kv = false;
            if !launch {
                return Ok(());
            }
            // SAFETY: as for write_kv below; each (block, kv head) of the pool is the
            // descriptor's bytes (it was built from the pool's own block layouts),
            // the centers hold kv_heads × head_dim floats, and head_dim is the kernel's. The
            // exact table (when windowed) was laid out for these spans and names only slots
            // inside the exact blocks (`ExactTokens::prepare`).
            return unsafe { self.launch(&mut l) };
        }
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

    #[allow(clippy::too_many_arguments)]
    /// Decode rows on the GEMV kernel, without a q/k norm: one matmul launch (normed for one
    /// row, else after the RMSNorm launch) whose rope-write epilogue (gemv.cu) adds the bias,
    /// applies RoPE and stores the new keys and values. Otherwise the separate ops.
    pub(super) fn project_qkv_write_kv_impl(
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
            && pool.codes.is_none()
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
