//! [`WeightMatrix::matmul`]: `out[t·rows + r] = Σ_c W[r, c]·x[t·cols + c]`, streaming the
//! weight in its storage format.
//!
//! Plan of one call:
//! 1. quantize the `n` activation vectors once (8-bit blocks, see `activations.rs`), unless
//!    the weight is a float format;
//! 2. split the output rows into chunks and run them on the rayon pool (sized by the CLI's
//!    `--threads`); each chunk is computed as `[chunk_rows, n]` (a row's tokens adjacent) so
//!    every weight block is read once per group of up to four tokens;
//! 3. for `n > 1`, transpose `[rows, n]` into the caller's `[n, rows]`.
//!
//! Every kernel sums each output element in one order whatever `n` and the chunking (float
//! weights included: `float_avx2.rs`), so a token's outputs do not depend on the tokens
//! computed with it.

use super::activations::{Q8Block, Q8KBlock, quantize_q8, quantize_q8k};
use super::kquants::QK_K;
use super::{GgmlType, WeightMatrix, dequantize_row, dot_avx2, dot_scalar, float_avx2};
use crate::Error;
use rayon::prelude::*;

/// Which kernels run: the AVX2 ones, or the plain references (tests compare the two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Portable scalar reference kernels.
    Scalar,
    /// AVX2 + FMA + F16C kernels (x86-64, checked at run time).
    Avx2,
    /// The same, with the 32-element formats' integer products through AVX-512 VNNI
    /// (`vpdpbusd`): the same bits as [`Isa::Avx2`], fewer instructions.
    Avx2Vnni,
}

impl Isa {
    /// The fastest kernels this CPU runs.
    pub(crate) fn best() -> Self {
        if dot_avx2::available() {
            if dot_avx2::has_vnni() {
                Self::Avx2Vnni
            } else {
                Self::Avx2
            }
        } else {
            Self::Scalar
        }
    }

    /// Whether these are one of the AVX2 kernel sets.
    pub(crate) fn avx2(self) -> bool {
        matches!(self, Self::Avx2 | Self::Avx2Vnni)
    }
}

impl WeightMatrix {
    /// Multiplies `n` input vectors by this matrix: for `t < n` and `r < rows`,
    /// `out[t·rows + r] = Σ_c W[r, c]·x[t·cols + c]`.
    ///
    /// Quantized weights are streamed block by block against 8-bit quantized activations
    /// (as llama.cpp does), so results differ from an f32 product by the activation rounding.
    /// Runs on the global rayon pool. Errors if `x` is not `n·cols` or `out` not `n·rows` long.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) -> Result<(), Error> {
        matmul_with(self, x, n, out, Isa::best())
    }

    /// Writes row `r` as f32 into `out` (`cols` long): an embedding lookup.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), Error> {
        if r >= self.rows() || out.len() != self.cols() {
            return Err(Error::Shape {
                op: "row_f32",
                detail: format!(
                    "row {r} into {} values of a [{}, {}] matrix",
                    out.len(),
                    self.rows(),
                    self.cols()
                ),
            });
        }
        let rb = self.row_bytes();
        dequantize_row(self.ty(), &self.bytes()[r * rb..(r + 1) * rb], out)
    }

    /// The whole matrix as row-major f32 (`rows·cols` values).
    pub fn dequantize_all(&self) -> Vec<f32> {
        let (cols, rb) = (self.cols(), self.row_bytes());
        let mut out = vec![0f32; self.rows() * cols];
        if cols == 0 {
            return out;
        }
        out.par_chunks_mut(cols)
            .zip(self.bytes().par_chunks(rb.max(1)))
            .for_each(|(o, b)| {
                // Sizes hold by the `WeightMatrix` invariant, so this cannot fail.
                let _ = dequantize_row(self.ty(), b, o);
            });
        out
    }
}

/// [`WeightMatrix::matmul`] with a chosen kernel set.
pub(crate) fn matmul_with(
    w: &WeightMatrix,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    isa: Isa,
) -> Result<(), Error> {
    let (rows, cols) = (w.rows(), w.cols());
    if Some(x.len()) != n.checked_mul(cols) || Some(out.len()) != n.checked_mul(rows) {
        return Err(Error::Shape {
            op: "matmul",
            detail: format!(
                "x holds {} values and out {} for n = {n} and a [{rows}, {cols}] matrix",
                x.len(),
                out.len()
            ),
        });
    }
    if n == 0 || rows == 0 {
        return Ok(());
    }
    if cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let (ty, rb, bytes) = (w.ty(), w.row_bytes(), w.bytes());
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            by_row_chunks(rows, n, chunk_rows(rows, rb, n), out, |r0, o| {
                float_rows(isa, ty, &bytes[r0 * rb..], rb, x, n, o)
            });
        }
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
            let mut acts = vec![Q8KBlock::ZERO; n * cols / QK_K];
            quantize_q8k(x, &mut acts);
            by_row_chunks(rows, n, chunk_rows(rows, rb, n), out, |r0, o| {
                kquant_rows(isa, ty, &bytes[r0 * rb..], rb, &acts, n, o)
            });
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            let mut acts = vec![Q8Block::ZERO; n * cols / 32];
            quantize_q8(x, &mut acts, isa.avx2());
            by_row_chunks(rows, n, chunk_rows(rows, rb, n), out, |r0, o| {
                q8_rows(isa, ty, &bytes[r0 * rb..], rb, &acts, n, o)
            });
        }
    }
    Ok(())
}

/// Weight bytes (times tokens) a task should have at least: ~2.5 µs of kernel time, against
/// ~1 µs of rayon overhead per task. (16 KiB measured worse: the 192×576 Q4_1 projection took
/// 7.3 µs on two threads in 4 tasks, 4.8 µs in 2.)
const MIN_TASK_BYTES: usize = 32 * 1024;

/// With more than one token group, the weight bytes of one task: every group of four tokens
/// passes over the task's rows, which must stay in the core's L2 (1 MiB here) meanwhile.
const MAX_TASK_BYTES: usize = 256 * 1024;

/// Rows per task: a multiple of the thread count of tasks (so no thread gets one more), as
/// many as the work supports up to 8 per thread (for balance when a core is busy elsewhere),
/// and small enough to stay cache-resident across token groups.
fn chunk_rows(rows: usize, row_bytes: usize, n: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let bytes = rows.saturating_mul(row_bytes);
    let tasks = (bytes.saturating_mul(n.min(16)) / MIN_TASK_BYTES).clamp(1, 8 * threads);
    let tasks = if tasks >= threads {
        tasks / threads * threads
    } else {
        tasks
    };
    let tasks = if n > 4 {
        tasks.max(bytes.div_ceil(MAX_TASK_BYTES))
    } else {
        tasks
    };
    rows.div_ceil(tasks).max(1)
}

/// Runs `f(first_row, chunk_out)` over chunks of `chunk` rows in parallel, where `chunk_out`
/// is that chunk's `[rows, n]` block, and leaves `out` as `[n, rows]`.
fn by_row_chunks(
    rows: usize,
    n: usize,
    chunk: usize,
    out: &mut [f32],
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    let run = |buf: &mut [f32]| {
        if rows <= chunk || rayon::current_num_threads() == 1 {
            for (i, o) in buf.chunks_mut(chunk * n).enumerate() {
                f(i * chunk, o);
            }
        } else {
            buf.par_chunks_mut(chunk * n)
                .enumerate()
                .for_each(|(i, o)| f(i * chunk, o));
        }
    };
    if n == 1 {
        run(out);
        return;
    }
    let mut tmp = vec![0f32; rows * n];
    run(&mut tmp);
    for (t, o) in out.chunks_exact_mut(rows).enumerate() {
        for (r, v) in o.iter_mut().enumerate() {
            *v = tmp[r * n + t];
        }
    }
}

/// A chunk of a 32-element-format weight (`w` starts at its first row) against Q8 blocks.
fn q8_rows(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rb: usize,
    acts: &[Q8Block],
    n: usize,
    out: &mut [f32],
) {
    if isa.avx2() {
        // SAFETY: the AVX2 sets are only chosen (by `Isa::best` or tests) when
        // `dot_avx2::available()` holds; `rows_q8` checks VNNI itself.
        unsafe { dot_avx2::rows_q8(ty, w, rb, acts, n, out, isa == Isa::Avx2Vnni) };
        return;
    }
    let nb = acts.len() / n;
    for (o, row) in out.chunks_exact_mut(n).zip(w.chunks_exact(rb)) {
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot_scalar::dot_q8(ty, row, &acts[t * nb..(t + 1) * nb]);
        }
    }
}

/// A chunk of a K-quant weight against Q8K blocks.
fn kquant_rows(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rb: usize,
    acts: &[Q8KBlock],
    n: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: as in `q8_rows`.
        unsafe { super::dot_avx2_k::rows_q8k(ty, w, rb, acts, n, out) };
        return;
    }
    let _ = isa;
    let nb = acts.len() / n;
    for (o, row) in out.chunks_exact_mut(n).zip(w.chunks_exact(rb)) {
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot_scalar::dot_q8k(ty, row, &acts[t * nb..(t + 1) * nb]);
        }
    }
}

/// A chunk of a float weight against f32 tokens, one row dot at a time.
fn float_rows(isa: Isa, ty: GgmlType, w: &[u8], rb: usize, x: &[f32], n: usize, out: &mut [f32]) {
    if isa.avx2() {
        // SAFETY: as in `q8_rows`.
        unsafe { float_avx2::rows_float(ty, w, rb, x, n, out) };
        return;
    }
    let cols = x.len() / n;
    let mut row_f = vec![0f32; cols];
    for (o, row) in out.chunks_exact_mut(n).zip(w.chunks_exact(rb)) {
        let _ = dequantize_row(ty, row, &mut row_f);
        for (t, v) in o.iter_mut().enumerate() {
            *v = row_f
                .iter()
                .zip(&x[t * cols..(t + 1) * cols])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
}
