//! The CPU backend: rayon across rows/heads, runtime-dispatched SIMD in the inner loops.
//!
//! It is also the correctness reference the GPU backend is tested against.

mod attention;
#[cfg(target_arch = "x86_64")]
mod attn_avx2;
mod conv;
mod decode;
mod direct;
#[cfg(target_arch = "x86_64")]
mod direct_avx2;
#[cfg(target_arch = "x86_64")]
mod direct_avx512;
#[cfg(target_arch = "x86_64")]
mod direct_vnni;
#[cfg(target_arch = "x86_64")]
mod direct_vnni_values;
mod kv;
mod moe;
pub(crate) mod ops;
pub(crate) mod picks;
mod variants;

pub use kv::{CpuKvPool, KvStorage};
pub use picks::CpuPicks;

use rayon::prelude::*;
use turbokv_cache::KvLayout;
use turbokv_codec::KvDtype;

use crate::backend::{AttnGeometry, AttnVariant, Backend, QkNorm, Rope, SeqSpan};
use crate::{Error, WeightMatrix};

/// Row-major `[rows, cols]` f32 activations in host memory.
#[derive(Clone, Debug, Default)]
pub struct CpuTensor {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl CpuTensor {
    /// Wraps values as `[rows, cols]`.
    pub fn from_vec(data: Vec<f32>, rows: usize, cols: usize) -> Result<Self, Error> {
        if data.len() != rows * cols {
            return Err(shape(
                "tensor",
                format!("{} values for [{rows}, {cols}]", data.len()),
            ));
        }
        Ok(Self { data, rows, cols })
    }
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        &self.data[..self.rows * self.cols]
    }
    /// The values, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data[..self.rows * self.cols]
    }
    /// One row.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

pub(crate) use crate::shape::shape;

fn expect_cols(op: &'static str, t: &CpuTensor, cols: usize) -> Result<(), Error> {
    if t.cols != cols {
        return Err(shape(
            op,
            format!("tensor has {} columns, expected {cols}", t.cols),
        ));
    }
    Ok(())
}

/// Rows per rayon task for cheap row-wise ops: small batches stay on one thread.
const ROWS_PER_TASK: usize = 16;

/// How the CPU backend keeps weight matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightMode {
    /// In their stored format, multiplied against 8-bit-quantized activations (fast; what
    /// llama.cpp does).
    #[default]
    Native,
    /// Dequantized to f32 at load and multiplied in f32 (slow, 4–8× the memory): the exact
    /// reference the fast path is measured against.
    DequantizedF32,
}

/// How decode attention reads keys and values stored as TurboQuant codes, and keys stored as
/// int8 records (`int8` pools, `q8` window copies).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CodeProducts {
    /// Through int8 products where the CPU has AVX-512 VBMI and VNNI: for scores the query
    /// rows and the codebook rounded to 8 bits (about 0.5% of a score, far below the codes'
    /// own error; int8 records are their own codebook, so only the query rows round), for
    /// value sums of codes the softmax weights rounded to 8 bits per span of 64 keys and the
    /// codebook to 8 bits (about 0.4% of a sum); f32 elsewhere.
    #[default]
    Int8,
    /// In f32 on the decoded codes: attention exactly over the vectors the codes decode to
    /// (the reference the integer path is tested against).
    F32,
}

/// Options of a [`CpuBackend`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuOptions {
    /// How weight matrices are kept.
    pub weights: WeightMode,
    /// How decode attention scores TurboQuant-coded keys.
    pub code_products: CodeProducts,
}

/// The CPU backend. Threads come from rayon's global pool (sized by the CLI's `--threads`).
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    options: CpuOptions,
}

impl CpuBackend {
    /// A CPU backend using rayon's global pool, with the default [`CpuOptions`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A CPU backend that keeps weights as `mode` says (other options default).
    pub fn with_weights(mode: WeightMode) -> Self {
        Self::with_options(CpuOptions {
            weights: mode,
            ..CpuOptions::default()
        })
    }

    /// A CPU backend with `options`.
    pub fn with_options(options: CpuOptions) -> Self {
        Self { options }
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Matrix = WeightMatrix;
    type Vector = Vec<f32>;
    type KvPool = CpuKvPool;
    type Picks = CpuPicks;

    fn describe(&self) -> String {
        let simd = if ops::has_avx2_fma() {
            "avx2+fma"
        } else {
            "scalar"
        };
        format!("cpu ({} threads, {simd})", rayon::current_num_threads())
    }

    fn check_kv_dtype(&self, dtype: KvDtype, head_dim: usize) -> Result<(), Error> {
        KvStorage::for_dtype(dtype, head_dim).map(|_| ())
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CpuTensor, Error> {
        Ok(CpuTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        })
    }

    fn set_rows(&self, t: &mut CpuTensor, rows: usize) -> Result<(), Error> {
        let need = rows * t.cols;
        if t.data.len() < need {
            t.data.resize(need, 0.0);
        }
        t.rows = rows;
        Ok(())
    }

    fn cols(&self, t: &CpuTensor) -> usize {
        t.cols
    }

    /// Selects straight from the tensor (no copy of the logits).
    fn to_host_top_k(&self, t: &CpuTensor, k: usize, out: &mut crate::TopK) -> Result<(), Error> {
        crate::select_top_k(t.as_slice(), t.cols, k, out)
    }

    fn new_picks(&self) -> Result<CpuPicks, Error> {
        Ok(CpuPicks::default())
    }

    fn pick_greedy(&self, logits: &CpuTensor, picks: &mut CpuPicks) -> Result<(), Error> {
        let mut top = crate::TopK::default();
        crate::select_top_k(logits.as_slice(), logits.cols, 1, &mut top)?;
        picks.push(&top)
    }

    fn wait_picks(&self, picks: &mut CpuPicks, out: &mut Vec<u32>) -> Result<(), Error> {
        picks.pop(out)
    }

    fn embed_picks(
        &self,
        table: &WeightMatrix,
        picks: &CpuPicks,
        rows: usize,
        out: &mut CpuTensor,
    ) -> Result<(), Error> {
        let ids = picks.latest()?;
        crate::picks::check_rows(ids.len(), rows)?;
        self.embed(table, ids, out)
    }

    fn to_host(&self, t: &CpuTensor, out: &mut Vec<f32>) -> Result<(), Error> {
        out.clear();
        out.extend_from_slice(t.as_slice());
        Ok(())
    }

    fn matrix(&self, w: &WeightMatrix) -> Result<WeightMatrix, Error> {
        match self.options.weights {
            WeightMode::Native => Ok(w.clone()),
            WeightMode::DequantizedF32 => {
                WeightMatrix::from_f32(w.rows(), w.cols(), &w.dequantize_all())
            }
        }
    }

    fn vector(&self, v: &[f32]) -> Result<Vec<f32>, Error> {
        Ok(v.to_vec())
    }

    fn kv_pool(&self, layout: &KvLayout, layer: usize) -> Result<CpuKvPool, Error> {
        CpuKvPool::new(layout, layer)
    }

    fn read_kv_block(&self, pool: &CpuKvPool, block: u32, out: &mut Vec<u8>) -> Result<(), Error> {
        out.clear();
        pool.export_block(block as usize, out)
    }

    fn write_kv_block(&self, pool: &mut CpuKvPool, block: u32, bytes: &[u8]) -> Result<(), Error> {
        pool.import_block(block as usize, bytes)
    }

    fn embed(&self, table: &WeightMatrix, ids: &[u32], out: &mut CpuTensor) -> Result<(), Error> {
        expect_cols("embed", out, table.cols())?;
        self.set_rows(out, ids.len())?;
        let cols = table.cols();
        for (&id, row) in ids.iter().zip(out.as_mut_slice().chunks_mut(cols)) {
            if id as usize >= table.rows() {
                return Err(shape(
                    "embed",
                    format!("token id {id} outside vocabulary of {}", table.rows()),
                ));
            }
            table.row_f32(id as usize, row)?;
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuTensor,
        w: &Vec<f32>,
        eps: f32,
        out: &mut CpuTensor,
    ) -> Result<(), Error> {
        expect_cols("rms_norm", x, w.len())?;
        expect_cols("rms_norm", out, w.len())?;
        self.set_rows(out, x.rows)?;
        let cols = x.cols;
        out.as_mut_slice()
            .par_chunks_mut(cols * ROWS_PER_TASK)
            .zip(x.as_slice().par_chunks(cols * ROWS_PER_TASK))
            .for_each(|(o, i)| {
                for (orow, irow) in o.chunks_mut(cols).zip(i.chunks(cols)) {
                    ops::rms_norm_row(irow, w, eps, orow);
                }
            });
        Ok(())
    }

    fn matmul(&self, x: &CpuTensor, w: &WeightMatrix, out: &mut CpuTensor) -> Result<(), Error> {
        expect_cols("matmul", x, w.cols())?;
        expect_cols("matmul", out, w.rows())?;
        self.set_rows(out, x.rows)?;
        let n = x.rows;
        w.matmul(x.as_slice(), n, out.as_mut_slice())
    }

    fn matmul_cat(
        &self,
        x: &CpuTensor,
        ws: &[WeightMatrix],
        out: &mut CpuTensor,
    ) -> Result<(), Error> {
        if let [w] = ws {
            return self.matmul(x, w, out);
        }
        let total: usize = ws.iter().map(WeightMatrix::rows).sum();
        expect_cols("matmul_cat", out, total)?;
        self.set_rows(out, x.rows)?;
        let mut col = 0;
        for w in ws {
            let mut part = self.tensor(x.rows, w.rows())?;
            self.matmul(x, w, &mut part)?;
            for (dst, src) in out
                .as_mut_slice()
                .chunks_mut(total)
                .zip(part.as_slice().chunks(w.rows()))
            {
                dst[col..col + w.rows()].copy_from_slice(src);
            }
            col += w.rows();
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut CpuTensor, bias: &Vec<f32>) -> Result<(), Error> {
        expect_cols("add_bias", x, bias.len())?;
        for row in x.as_mut_slice().chunks_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<(), Error> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(shape(
                "add",
                format!("[{}, {}] += [{}, {}]", x.rows, x.cols, y.rows, y.cols),
            ));
        }
        x.as_mut_slice()
            .iter_mut()
            .zip(y.as_slice())
            .for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn silu_mul(&self, gate_up: &CpuTensor, out: &mut CpuTensor) -> Result<(), Error> {
        expect_cols("silu_mul", gate_up, 2 * out.cols)?;
        self.set_rows(out, gate_up.rows)?;
        let f = out.cols;
        out.as_mut_slice()
            .par_chunks_mut(f * ROWS_PER_TASK)
            .zip(gate_up.as_slice().par_chunks(2 * f * ROWS_PER_TASK))
            .for_each(|(o, gu)| {
                for (orow, gurow) in o.chunks_mut(f).zip(gu.chunks(2 * f)) {
                    let (g, u) = gurow.split_at(f);
                    for ((o, &g), &u) in orow.iter_mut().zip(g).zip(u) {
                        *o = g / (1.0 + (-g).exp()) * u;
                    }
                }
            });
        Ok(())
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize], out: &mut CpuTensor) -> Result<(), Error> {
        expect_cols("gather_rows", out, x.cols)?;
        self.set_rows(out, rows.len())?;
        let cols = x.cols;
        for (dst, &r) in out.as_mut_slice().chunks_mut(cols).zip(rows) {
            if r >= x.rows {
                return Err(shape("gather_rows", format!("row {r} of {}", x.rows)));
            }
            dst.copy_from_slice(x.row(r));
        }
        Ok(())
    }

    fn write_kv(
        &self,
        qkv: &mut CpuTensor,
        g: &AttnGeometry,
        rope: &Rope,
        qk_norm: Option<QkNorm<'_, Vec<f32>>>,
        spans: &[SeqSpan<'_>],
        pool: &mut CpuKvPool,
    ) -> Result<(), Error> {
        expect_cols("write_kv", qkv, g.qkv_width())?;
        let positions = token_positions(spans, qkv.rows)?;
        let width = g.qkv_width();
        let qk_heads = g.n_heads + g.n_kv_heads;
        qkv.as_mut_slice()
            .par_chunks_mut(width)
            .zip(positions.par_iter())
            .for_each(|(row, &pos)| {
                for (h, head) in row[..qk_heads * g.head_dim]
                    .chunks_mut(g.head_dim)
                    .enumerate()
                {
                    if let Some(n) = &qk_norm {
                        let w = if h < g.n_heads { n.q } else { n.k };
                        ops::rms_norm_in_place(head, w, n.eps);
                    }
                    ops::rope(head, pos, rope);
                }
            });
        pool.store(qkv, g, spans)
    }

    fn attention(
        &self,
        qkv: &CpuTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CpuKvPool,
        out: &mut CpuTensor,
    ) -> Result<(), Error> {
        expect_cols("attention", qkv, g.qkv_width())?;
        expect_cols("attention", out, g.n_heads * g.head_dim)?;
        self.set_rows(out, qkv.rows)?;
        attention::attend(qkv, g, spans, pool, self.options.code_products, out)
    }

    fn supports_family_ops(&self) -> bool {
        true
    }

    /// Windows and sinks over every pool format (`variants.rs`).
    fn supports_attention_variant(
        &self,
        _: &AttnGeometry,
        _: KvDtype,
        _: crate::backend::VariantNeeds,
    ) -> Result<(), Error> {
        Ok(())
    }

    fn scale(&self, x: &mut CpuTensor, factor: f32) -> Result<(), Error> {
        variants::scale(x, factor);
        Ok(())
    }

    fn gelu_mul(&self, gate_up: &CpuTensor, out: &mut CpuTensor) -> Result<(), Error> {
        self.set_rows(out, gate_up.rows)?;
        variants::gelu_mul(gate_up, out)
    }

    fn supports_short_conv(&self) -> bool {
        true
    }

    fn supports_moe(&self) -> bool {
        true
    }

    fn moe(
        &self,
        x: &CpuTensor,
        mlp: &crate::backend::MoeMlp<'_, WeightMatrix, Vec<f32>>,
        out: &mut CpuTensor,
    ) -> Result<(), Error> {
        moe::moe(self, x, mlp, out)
    }

    fn short_conv(
        &self,
        bcx: &CpuTensor,
        kernel: &Vec<f32>,
        spans: &[SeqSpan<'_>],
        states: &mut [&mut [f32]],
        out: &mut CpuTensor,
    ) -> Result<(), Error> {
        self.set_rows(out, bcx.rows)?;
        conv::short_conv(bcx, kernel, spans, states, out)
    }

    fn attention_variant(
        &self,
        qkv: &CpuTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CpuKvPool,
        variant: &AttnVariant<'_, Vec<f32>>,
        out: &mut CpuTensor,
    ) -> Result<(), Error> {
        if variant.is_plain() {
            return self.attention(qkv, g, spans, pool, out);
        }
        expect_cols("attention", qkv, g.qkv_width())?;
        expect_cols("attention", out, g.n_heads * g.head_dim)?;
        self.set_rows(out, qkv.rows)?;
        variants::attend(qkv, g, spans, pool, variant, out)
    }
}

/// Position of every row of the step, checking that spans tile the rows exactly.
fn token_positions(spans: &[SeqSpan<'_>], rows: usize) -> Result<Vec<usize>, Error> {
    let mut pos = vec![usize::MAX; rows];
    for s in spans {
        let end = s.first_row + s.n_tokens;
        if end > rows {
            return Err(shape(
                "spans",
                format!("span rows {}..{end} beyond {rows} rows", s.first_row),
            ));
        }
        for (i, p) in pos[s.first_row..end].iter_mut().enumerate() {
            *p = s.first_pos + i;
        }
    }
    if pos.contains(&usize::MAX) {
        return Err(shape("spans", "some rows belong to no sequence".into()));
    }
    Ok(pos)
}
