//! Row-wise ops: RMSNorm, bias, residual add, a scale, `silu(g)·u` and `gelu_tanh(g)·u`, row
//! gather and the embedding.

use super::{addr, expect_cols, int, opc, rows_cfg};
use crate::Error;
use crate::backend::Backend;
use crate::cuda::launch::Launches;
use crate::cuda::picks::CudaPicks;
use crate::cuda::step::grow;
use crate::cuda::{CudaBackend, CudaMatrix, CudaTensor, CudaVector};
use crate::shape::shape;

/// The activation of a gated MLP's gate half.
#[derive(Clone, Copy)]
enum Gate {
    /// `silu(g)` (llama, qwen, Granite).
    Silu,
    /// Hugging Face's `gelu_pytorch_tanh` (Gemma's GeGLU).
    GeluTanh,
}

impl CudaBackend {
    /// [`Backend::rms_norm`].
    pub(super) fn rms_norm_impl(
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

    /// [`Backend::add_bias`].
    pub(super) fn add_bias_impl(&self, x: &mut CudaTensor, bias: &CudaVector) -> Result<(), Error> {
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

    /// [`Backend::add_assign`].
    pub(super) fn add_assign_impl(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<(), Error> {
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

    /// [`Backend::scale`].
    pub(super) fn scale_impl(&self, x: &mut CudaTensor, factor: f32) -> Result<(), Error> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, xp) = (n as u64, addr(&x.buf, &self.stream));
        let mut l = Launches::new(opc::SCALE);
        l.kernel("scale", &self.k.scale, self.grid_1d(n), false)
            .ptr(xp)
            .arg(factor)
            .arg(n64);
        // `admit` drops any bf16 copy of x an earlier op left: it is stale once x is scaled.
        if !self.lock_state("scale")?.admit(l.signature())? {
            return Ok(());
        }
        // SAFETY: x holds n floats.
        unsafe { self.launch(&mut l) }
    }

    /// [`Backend::silu_mul`].
    pub(super) fn silu_mul_impl(
        &self,
        gate_up: &CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.gated_impl(gate_up, out, Gate::Silu)
    }

    /// [`Backend::gelu_mul`].
    pub(super) fn gelu_mul_impl(
        &self,
        gate_up: &CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        self.gated_impl(gate_up, out, Gate::GeluTanh)
    }

    /// `out = act(g) · u` per row `[g | u]`, with bf16(out) left for the down projection.
    fn gated_impl(
        &self,
        gate_up: &CudaTensor,
        out: &mut CudaTensor,
        gate: Gate,
    ) -> Result<(), Error> {
        let (name, kernel, code) = match gate {
            Gate::Silu => ("silu_mul", &self.k.silu_mul, opc::SILU),
            Gate::GeluTanh => ("gelu_mul", &self.k.gelu_mul, opc::GELU),
        };
        expect_cols(name, gate_up, 2 * out.cols)?;
        self.set_rows(out, gate_up.rows)?;
        let n = out.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, f) = (n as u64, int(name, out.cols)?);
        let (gp, op) = (
            addr(&gate_up.buf, &self.stream),
            addr(&out.buf, &self.stream),
        );
        let mut st = self.lock_state(name)?;
        let sc = st.sc();
        let may_alloc = !sc.defer;
        let ob = addr(
            grow(&self.stream, &mut sc.bf16, n, may_alloc)?,
            &self.stream,
        );
        let mut l = Launches::new(code);
        l.kernel(name, kernel, self.grid_1d(n), false)
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

    /// [`Backend::gather_rows`].
    pub(super) fn gather_rows_impl(
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

    /// [`Backend::embed`].
    pub(super) fn embed_impl(
        &self,
        table: &CudaMatrix,
        ids: &[u32],
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
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

    /// [`Backend::embed_picks`].
    pub(super) fn embed_picks_impl(
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
}
