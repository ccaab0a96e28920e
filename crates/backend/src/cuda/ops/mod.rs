//! [`Backend`] for [`CudaBackend`]: shape checks on the host, then kernel launches on the
//! backend's stream. This file holds the shared helpers and the trait's dispatch; each op
//! family lives in its own module.

mod bench;
mod conv;
mod elementwise;
mod kv_write;
mod matmul;
mod moe;
mod sample;

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, LaunchConfig};
use half::bf16;
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

use super::graph::Mode;
use super::picks::CudaPicks;
use super::step::graph_changed;
use super::{
    CudaBackend, CudaKvPool, CudaMatrix, CudaTensor, CudaVector, cuda_err, unsupported_kv,
};
use crate::backend::{
    AttnGeometry, AttnVariant, Backend, MoeMlp, QkNorm, QkvProjection, Rope, SeqSpan, VariantNeeds,
};
use crate::shape::shape;
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
    pub const SCALE: u64 = 14;
    pub const GELU: u64 = 15;
    pub const MOE: u64 = 16;
    pub const CONV: u64 = 17;
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

    fn step_graph_stats(&self) -> Option<crate::cuda::GraphStats> {
        self.graph_stats().ok()
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
            other if other.is_compressed() => {
                match crate::cuda::codes::unsupported_reason(other, head_dim) {
                    None => Ok(()),
                    Some(why) => Err(Error::UnsupportedKvDtype {
                        dtype: format!("{other} ({why})"),
                        backend: "cuda",
                        accepted: crate::cuda::codes::ACCEPTED,
                    }),
                }
            }
            other => Err(unsupported_kv(other)),
        }
    }

    fn supports_attention(&self, g: &AttnGeometry, dtype: KvDtype) -> Result<(), Error> {
        self.check_attention(g, dtype)
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

    fn to_host_top_k(&self, t: &CudaTensor, k: usize, out: &mut TopK) -> Result<(), Error> {
        self.to_host_top_k_impl(t, k, out)
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

    fn read_kv_block(&self, pool: &CudaKvPool, block: u32, out: &mut Vec<u8>) -> Result<(), Error> {
        refuse_block_io("read_kv_block", pool)?;
        let (k_range, v_range, kh, vh) = pool.block_ranges(block)?;
        let mut k = vec![0u16; k_range.len()];
        let mut v = vec![0u16; v_range.len()];
        self.stream
            .memcpy_dtoh(&pool.k.slice(k_range), k.as_mut_slice())
            .map_err(cuda_err("download kv block"))?;
        self.stream
            .memcpy_dtoh(&pool.v.slice(v_range), v.as_mut_slice())
            .map_err(cuda_err("download kv block"))?;
        out.clear();
        for (kb, vb) in k.chunks_exact(kh).zip(v.chunks_exact(vh)) {
            let at = out.len();
            out.extend(kb.iter().chain(vb).flat_map(|x| x.to_le_bytes()));
            if let Some(codes) = &pool.codes {
                let (kbytes, vbytes) = out[at..].split_at_mut(2 * kh);
                codes.convert_records(kbytes, vbytes, true);
            }
        }
        Ok(())
    }

    fn write_kv_block(&self, pool: &mut CudaKvPool, block: u32, bytes: &[u8]) -> Result<(), Error> {
        refuse_block_io("write_kv_block", pool)?;
        let (k_range, v_range, kh, vh) = pool.block_ranges(block)?;
        let per_head = 2 * (kh + vh);
        if bytes.len() != per_head * pool.kv_heads {
            return Err(shape(
                "write_kv_block",
                format!(
                    "{} bytes, the block holds {}",
                    bytes.len(),
                    per_head * pool.kv_heads
                ),
            ));
        }
        let (mut k, mut v) = (
            Vec::with_capacity(k_range.len()),
            Vec::with_capacity(v_range.len()),
        );
        let halves = |b: &[u8]| -> Vec<u16> {
            b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        for head in bytes.chunks_exact(per_head) {
            let mut head = head.to_vec();
            if let Some(codes) = &pool.codes {
                let (kbytes, vbytes) = head.split_at_mut(2 * kh);
                codes.convert_records(kbytes, vbytes, false);
            }
            k.extend(halves(&head[..2 * kh]));
            v.extend(halves(&head[2 * kh..]));
        }
        self.stream
            .memcpy_htod(&k, &mut pool.k.slice_mut(k_range))
            .map_err(cuda_err("upload kv block"))?;
        self.stream
            .memcpy_htod(&v, &mut pool.v.slice_mut(v_range))
            .map_err(cuda_err("upload kv block"))?;
        Ok(())
    }

    fn embed(&self, table: &CudaMatrix, ids: &[u32], out: &mut CudaTensor) -> Result<(), Error> {
        self.embed_impl(table, ids, out)
    }

    fn new_picks(&self) -> Result<CudaPicks, Error> {
        Ok(CudaPicks::default())
    }

    fn pick_greedy(&self, t: &CudaTensor, p: &mut CudaPicks) -> Result<(), Error> {
        self.pick_greedy_impl(t, p)
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
        self.embed_picks_impl(table, p, rows, out)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaVector,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.rms_norm_impl(x, w, eps, out)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaMatrix, out: &mut CudaTensor) -> Result<(), Error> {
        self.matmul_impl(x, w, out)
    }

    fn matmul_add(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        acc: &mut CudaTensor,
        _tmp: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.matmul_add_impl(x, w, acc, _tmp)
    }

    fn matmul_cat(
        &self,
        x: &CudaTensor,
        ws: &[CudaMatrix],
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.matmul_cat_impl(x, ws, out)
    }

    fn matmul_silu(
        &self,
        x: &CudaTensor,
        ws: &[CudaMatrix],
        gate_up: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.matmul_silu_impl(x, ws, gate_up, out)
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
        self.rms_norm_matmul_cat_impl(x, norm, eps, ws, xn, out)
    }

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
        self.rms_norm_matmul_silu_impl(x, norm, eps, ws, xn, gate_up, out)
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaVector) -> Result<(), Error> {
        self.add_bias_impl(x, bias)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<(), Error> {
        self.add_assign_impl(x, y)
    }

    fn silu_mul(&self, gate_up: &CudaTensor, out: &mut CudaTensor) -> Result<(), Error> {
        self.silu_mul_impl(gate_up, out)
    }

    fn gather_rows(
        &self,
        x: &CudaTensor,
        rows: &[usize],
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.gather_rows_impl(x, rows, out)
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
        self.write_kv_impl(qkv, g, rope, qk_norm, spans, pool)
    }

    fn attention(
        &self,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CudaKvPool,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.attention_impl(qkv, g, spans, pool, None, None, out)
    }

    /// Granite's and Gemma 3's element-wise ops.
    fn supports_family_ops(&self) -> bool {
        true
    }

    fn scale(&self, x: &mut CudaTensor, factor: f32) -> Result<(), Error> {
        self.scale_impl(x, factor)
    }

    fn gelu_mul(&self, gate_up: &CudaTensor, out: &mut CudaTensor) -> Result<(), Error> {
        self.gelu_mul_impl(gate_up, out)
    }

    /// Sinks and sliding windows over every pool, 16-bit and coded (`attention.rs`).
    fn supports_attention_variant(
        &self,
        _: &AttnGeometry,
        _: KvDtype,
        _: VariantNeeds,
    ) -> Result<(), Error> {
        Ok(())
    }

    fn attention_variant(
        &self,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CudaKvPool,
        variant: &AttnVariant<'_, CudaVector>,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.attention_impl(qkv, g, spans, pool, variant.window, variant.sinks, out)
    }

    /// LFM2's conv layers, over host states (`ops/conv.rs`: eager steps only).
    fn supports_short_conv(&self) -> bool {
        true
    }

    fn short_conv(
        &self,
        bcx: &CudaTensor,
        kernel: &CudaVector,
        spans: &[SeqSpan<'_>],
        states: &mut [&mut [f32]],
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.short_conv_impl(bcx, kernel, spans, states, out)
    }

    /// gpt-oss's experts, routed on the device (`ops/moe.rs`).
    fn supports_moe(&self) -> bool {
        true
    }

    fn moe(
        &self,
        x: &CudaTensor,
        mlp: &MoeMlp<'_, CudaMatrix, CudaVector>,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.moe_impl(x, mlp, out)
    }

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
        self.project_qkv_write_kv_impl(x, proj, g, rope, spans, pool, xn, qkv)
    }
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

/// Block I/O of a pool with a full-precision window is refused, as on the CPU: its exact
/// copies are not part of a block's bytes, so a restored block would attend differently.
/// Block I/O moves blocks in the codec's layout, which neither a window's exact copies (kept
/// outside the blocks) nor a layer with per-head formats (the CPU exports none either) has.
fn refuse_block_io(op: &'static str, pool: &CudaKvPool) -> Result<(), Error> {
    if pool.exact.is_some() {
        return Err(Error::Unsupported {
            op,
            why: "a cache with a full-precision window keeps exact copies outside its blocks",
        });
    }
    if pool.codes.as_ref().is_some_and(|c| !c.groups.is_empty()) {
        return Err(Error::Unsupported {
            op,
            why: "a layer with per-head KV dtypes has no block format to move",
        });
    }
    Ok(())
}
