//! [`Backend`] for [`CudaBackend`]: shape checks on the host, then kernel launches on the
//! backend's stream.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

use super::step::{check_tables, grow};
use super::{
    CudaBackend, CudaKvPool, CudaMatrix, CudaTensor, CudaVector, cuda_err, unsupported_kv,
};
use crate::backend::{AttnGeometry, Backend, QkNorm, Rope, RopeStyle, SeqSpan};
use crate::cpu::shape;
use crate::{Error, WeightMatrix};

/// Keys per attention tile and threads per attention block (see attention.cu).
const ATTN_TILE: usize = 32;
const ATTN_THREADS: usize = 128;
/// Accumulator elements per thread: `group · head_dim ≤ 128 · 16`.
const ATTN_MAX_ELEMS: usize = ATTN_THREADS * 16;
/// Fewest keys a decode split covers.
const MIN_SPLIT_KEYS: usize = 64;

pub(super) fn describe(b: &CudaBackend) -> String {
    format!("cuda:{} ({}, {}, {} SMs)", b.ordinal, b.name, b.arch, b.sms)
}

fn expect_cols(op: &'static str, t: &CudaTensor, cols: usize) -> Result<(), Error> {
    if t.cols != cols {
        return Err(shape(
            op,
            format!("tensor has {} columns, expected {cols}", t.cols),
        ));
    }
    Ok(())
}

fn int(op: &'static str, v: usize) -> Result<i32, Error> {
    i32::try_from(v).map_err(|_| shape(op, format!("{v} exceeds the kernel's 32-bit range")))
}

fn ints<const N: usize>(op: &'static str, v: [usize; N]) -> Result<[i32; N], Error> {
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

impl CudaBackend {
    /// `out[:, col .. col + w.rows] = bf16(x) · Wᵀ` for each `(w, col)`, f32 accumulate.
    fn gemm(&self, x: &CudaTensor, ws: &[&CudaMatrix], out: &mut CudaTensor) -> Result<(), Error> {
        let (t, k) = (x.rows, x.cols);
        if t == 0 {
            return Ok(());
        }
        let mut sc = self.scratch.lock().map_err(|_| Error::Cuda {
            op: "matmul",
            detail: "scratch poisoned".into(),
        })?;
        let xb = grow(&self.stream, &mut sc.bf16, t * k)?;
        let n = (t * k) as u64;
        let mut b = self.stream.launch_builder(&self.k.f32_to_bf16);
        b.arg(&x.buf).arg(&mut *xb).arg(&n);
        // SAFETY: reads t·k floats of x and writes t·k bf16 of xb, both at least that long.
        unsafe { b.launch(self.grid_1d(t * k)) }.map_err(cuda_err("f32_to_bf16"))?;
        let ldc = int("matmul", out.cols)?;
        let (alpha, beta) = (1f32, 0f32);
        let (xp, _gx) = xb.device_ptr(&self.stream);
        let (op, _go) = out.buf.device_ptr_mut(&self.stream);
        let mut col = 0usize;
        for w in ws {
            let (wp, _gw) = w.data.device_ptr(&self.stream);
            // SAFETY: W is [rows, k] bf16, x is [t, k] bf16, out has t rows of ldc ≥ col + rows
            // f32 (checked by the callers); alpha/beta are host scalars (default pointer mode).
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    int("matmul", w.rows)?,
                    int("matmul", t)?,
                    int("matmul", k)?,
                    (&alpha as *const f32).cast(),
                    wp as *const _,
                    cudaDataType::CUDA_R_16BF,
                    int("matmul", k)?,
                    xp as *const _,
                    cudaDataType::CUDA_R_16BF,
                    int("matmul", k)?,
                    (&beta as *const f32).cast(),
                    (op + (col * 4) as u64) as *mut _,
                    cudaDataType::CUDA_R_32F,
                    ldc,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(cuda_err("cublas gemm"))?;
            col += w.rows;
        }
        Ok(())
    }

    /// Launches the partial and combine kernels of one attention call (shapes checked, step
    /// metadata uploaded and partial buffers sized by the caller).
    fn launch_attention(
        &self,
        sc: &mut super::step::Scratch,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        pool: &CudaKvPool,
        out: &mut CudaTensor,
        (chunk, splits): (usize, usize),
    ) -> Result<(), Error> {
        let rows = qkv.rows;
        let (m, ml, acc) = sc.attention_parts()?;
        let [width, nh, nkv, d, bs, chunk_i, splits_i] = ints(
            "attention",
            [
                g.qkv_width(),
                g.n_heads,
                g.n_kv_heads,
                g.head_dim,
                pool.block_size,
                chunk,
                splits,
            ],
        )?;
        let is_bf16 = i32::from(pool.is_bf16);
        let (grp, hd) = (g.group(), g.head_dim);
        let smem =
            (grp * hd + ATTN_TILE * (hd + 4) + ATTN_TILE * hd + grp * ATTN_TILE + 3 * grp) * 4;
        if smem > self.smem_limit {
            return Err(shape(
                "attention",
                format!(
                    "needs {smem} bytes of shared memory, the GPU allows {}",
                    self.smem_limit
                ),
            ));
        }
        {
            let f = &self.k.attn_partial[match hd {
                64 => 0,
                128 => 1,
                256 => 2,
                _ => 3,
            }];
            let mut b = self.stream.launch_builder(f);
            b.arg(&qkv.buf)
                .arg(&width)
                .arg(&nh)
                .arg(&nkv)
                .arg(&d)
                .arg(&g.scale);
            b.arg(&m.pos).arg(&m.seq).arg(&m.seq_tbl).arg(&m.tables);
            b.arg(&pool.k).arg(&pool.v).arg(&bs).arg(&is_bf16);
            b.arg(&chunk_i).arg(&splits_i).arg(&mut *ml).arg(&mut *acc);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, g.n_kv_heads as u32, splits as u32),
                block_dim: (ATTN_THREADS as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: spans tile the rows and their blocks are inside the pool (checked above);
            // partial buffers hold rows·n_heads·splits entries; smem was checked against the
            // opt-in limit set at load; head_dim % 4 == 0 keeps the 8-byte K/V loads aligned.
            unsafe { b.launch(cfg) }.map_err(cuda_err("attn_partial"))?;
        }
        let mut b = self.stream.launch_builder(&self.k.attn_combine);
        b.arg(&*ml)
            .arg(&*acc)
            .arg(&mut out.buf)
            .arg(&nh)
            .arg(&d)
            .arg(&splits_i);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, g.n_heads as u32, 1),
            block_dim: (hd.div_ceil(32).clamp(1, 8) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads the partials written above; out holds rows·n_heads·head_dim floats.
        unsafe { b.launch(cfg) }.map_err(cuda_err("attn_combine"))?;
        Ok(())
    }

    /// Picks the key-split length for a launch of `rows` query rows over at most `max_ctx`
    /// keys: enough (row, kv head, split) blocks for `blocks_per_sm` per SM.
    fn split_keys(&self, rows: usize, n_kv: usize, max_ctx: usize) -> (usize, usize) {
        let target = self.blocks_per_sm * self.sms;
        let splits = target
            .div_ceil(rows * n_kv)
            .clamp(1, max_ctx.div_ceil(MIN_SPLIT_KEYS).max(1));
        let chunk = max_ctx.div_ceil(splits).div_ceil(ATTN_TILE) * ATTN_TILE;
        (chunk, max_ctx.div_ceil(chunk).max(1))
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type KvPool = CudaKvPool;

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
        out.clear();
        out.resize(t.len(), 0.0);
        if t.len() > 0 {
            self.stream
                .memcpy_dtoh(&t.buf.slice(..t.len()), out.as_mut_slice())
                .map_err(cuda_err("download"))?;
        }
        self.synchronize()
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
        let mut sc = self.scratch.lock().map_err(|_| Error::Cuda {
            op: "embed",
            detail: "scratch poisoned".into(),
        })?;
        sc.upload_idx(&self.stream, ids)?;
        let idx = sc
            .idx
            .as_ref()
            .ok_or_else(|| shape("embed", "no ids".into()))?;
        let cols = int("embed", table.cols)?;
        let mut b = self.stream.launch_builder(&self.k.embed_bf16);
        b.arg(&table.data).arg(idx).arg(&mut out.buf).arg(&cols);
        // SAFETY: ids were checked against the table's rows; out holds ids.len() rows.
        unsafe { b.launch(rows_cfg(ids.len(), 256, 0)) }.map_err(cuda_err("embed"))?;
        Ok(())
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
        let mut b = self.stream.launch_builder(&self.k.rms_norm);
        b.arg(&x.buf)
            .arg(&w.data)
            .arg(&mut out.buf)
            .arg(&cols)
            .arg(&eps);
        // SAFETY: x and out hold rows·cols floats, w holds cols; 256 threads (multiple of 32).
        unsafe { b.launch(rows_cfg(x.rows, 256, 0)) }.map_err(cuda_err("rms_norm"))?;
        Ok(())
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaMatrix, out: &mut CudaTensor) -> Result<(), Error> {
        expect_cols("matmul", x, w.cols)?;
        expect_cols("matmul", out, w.rows)?;
        self.set_rows(out, x.rows)?;
        self.gemm(x, &[w], out)
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
        self.gemm(x, &refs, out)
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaVector) -> Result<(), Error> {
        expect_cols("add_bias", x, bias.len)?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, cols) = (n as u64, int("add_bias", x.cols)?);
        let mut b = self.stream.launch_builder(&self.k.add_bias);
        b.arg(&mut x.buf).arg(&bias.data).arg(&n64).arg(&cols);
        // SAFETY: x holds n floats, bias holds cols.
        unsafe { b.launch(self.grid_1d(n)) }.map_err(cuda_err("add_bias"))?;
        Ok(())
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
        let mut b = self.stream.launch_builder(&self.k.add_assign);
        b.arg(&mut x.buf).arg(&y.buf).arg(&n64);
        // SAFETY: x and y hold n floats each.
        unsafe { b.launch(self.grid_1d(n)) }.map_err(cuda_err("add_assign"))?;
        Ok(())
    }

    fn silu_mul(&self, gate_up: &CudaTensor, out: &mut CudaTensor) -> Result<(), Error> {
        expect_cols("silu_mul", gate_up, 2 * out.cols)?;
        self.set_rows(out, gate_up.rows)?;
        let n = out.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, f) = (n as u64, int("silu_mul", out.cols)?);
        let mut b = self.stream.launch_builder(&self.k.silu_mul);
        b.arg(&gate_up.buf).arg(&mut out.buf).arg(&n64).arg(&f);
        // SAFETY: gate_up holds rows·2f floats, out rows·f.
        unsafe { b.launch(self.grid_1d(n)) }.map_err(cuda_err("silu_mul"))?;
        Ok(())
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
        let mut sc = self.scratch.lock().map_err(|_| Error::Cuda {
            op: "gather_rows",
            detail: "scratch poisoned".into(),
        })?;
        sc.upload_idx(&self.stream, &ids)?;
        let idx = sc
            .idx
            .as_ref()
            .ok_or_else(|| shape("gather_rows", "no rows".into()))?;
        let cols = int("gather_rows", x.cols)?;
        let mut b = self.stream.launch_builder(&self.k.gather_rows);
        b.arg(&x.buf).arg(idx).arg(&mut out.buf).arg(&cols);
        // SAFETY: every index is below x.rows; out holds rows.len() rows.
        unsafe { b.launch(rows_cfg(rows.len(), 256, 0)) }.map_err(cuda_err("gather_rows"))?;
        Ok(())
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
        expect_cols("write_kv", qkv, g.qkv_width())?;
        check_geometry(g, pool)?;
        if 2 * rope.inv_freq.len() > g.head_dim {
            return Err(shape(
                "rope",
                format!("{} pairs for head_dim {}", rope.inv_freq.len(), g.head_dim),
            ));
        }
        if let Some(n) = &qk_norm
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
        check_tables(spans, pool)?;
        let rows = qkv.rows;
        let mut sc = self.scratch.lock().map_err(|_| Error::Cuda {
            op: "write_kv",
            detail: "scratch poisoned".into(),
        })?;
        sc.upload_meta(&self.stream, spans, rows)?;
        if rows == 0 {
            return Ok(());
        }
        sc.rope(&self.stream, &rope.inv_freq)?;
        let sc = &*sc;
        let inv_freq = sc.rope_buf()?;
        let m = sc.meta()?;
        let (qn, kn, eps, has_norm) = match &qk_norm {
            Some(n) => (&n.q.data, &n.k.data, n.eps, 1i32),
            None => (inv_freq, inv_freq, 0f32, 0i32),
        };
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
        let mut b = self.stream.launch_builder(&self.k.write_kv);
        b.arg(&mut qkv.buf).arg(&width).arg(&nh).arg(&nkv).arg(&d);
        b.arg(&m.pos).arg(&m.seq).arg(&m.seq_tbl).arg(&m.tables);
        b.arg(inv_freq).arg(&pairs).arg(&half_split);
        b.arg(qn).arg(kn).arg(&eps).arg(&has_norm);
        b.arg(&mut pool.k).arg(&mut pool.v).arg(&bs).arg(&is_bf16);
        let threads = g.head_dim.div_ceil(32).clamp(1, 8) as u32 * 32;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (g.n_heads + 2 * g.n_kv_heads) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((g.head_dim + 32) * 4) as u32,
        };
        // SAFETY: spans tile the rows and every block they touch is inside the pool (checked
        // above); qkv rows are qkv_width wide; the norm/rope vectors have the lengths passed.
        unsafe { b.launch(cfg) }.map_err(cuda_err("write_kv"))?;
        Ok(())
    }

    fn attention(
        &self,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CudaKvPool,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        expect_cols("attention", qkv, g.qkv_width())?;
        expect_cols("attention", out, g.n_heads * g.head_dim)?;
        check_geometry(g, pool)?;
        if !g.head_dim.is_multiple_of(4) || g.head_dim > 256 {
            return Err(shape(
                "attention",
                format!("head_dim {} is not a multiple of 4 up to 256", g.head_dim),
            ));
        }
        if g.group() * g.head_dim > ATTN_MAX_ELEMS {
            return Err(shape(
                "attention",
                format!(
                    "{} query heads per kv head × head_dim {} > {ATTN_MAX_ELEMS}",
                    g.group(),
                    g.head_dim
                ),
            ));
        }
        check_tables(spans, pool)?;
        let rows = qkv.rows;
        self.set_rows(out, rows)?;
        let mut sc = self.scratch.lock().map_err(|_| Error::Cuda {
            op: "attention",
            detail: "scratch poisoned".into(),
        })?;
        sc.upload_meta(&self.stream, spans, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let max_ctx = spans
            .iter()
            .map(|s| s.first_pos + s.n_tokens)
            .max()
            .unwrap_or(1);
        let (chunk, splits) = self.split_keys(rows, g.n_kv_heads, max_ctx);
        let parts = rows * g.n_heads * splits;
        grow(&self.stream, &mut sc.part_ml, 2 * parts)?;
        grow(&self.stream, &mut sc.part_acc, parts * g.head_dim)?;
        self.launch_attention(&mut sc, qkv, g, pool, out, (chunk, splits))
    }
}

fn check_geometry(g: &AttnGeometry, pool: &CudaKvPool) -> Result<(), Error> {
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
