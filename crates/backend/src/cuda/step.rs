//! Per-step device metadata and reusable scratch buffers of the CUDA backend.
//!
//! The token metadata of a step is one `u32` buffer:
//!
//! ```text
//! [ tok_pos: rows | tok_seq: rows | seq_tbl: seqs | tables: Σ blocks ]
//! ```
//!
//! `tok_pos[t]` is row t's position, `tok_seq[t]` its sequence, `seq_tbl[s]` the offset of
//! sequence s's block table inside `tables`. It is uploaded only when the spans change, so the
//! layers of one step share a single upload. A step whose layers read different block tables
//! (a model with sliding-window rings: the ring layers read virtual tables, the others the
//! cache's) keeps one buffer per distinct span set, [`META_SLOTS`] at most, assigned in the
//! order the step first uses them: a CUDA graph, whose inputs are all uploaded before it runs,
//! then finds each layer's tables in its own buffer, at the same address at every replay. The
//! same holds for the RoPE frequencies (Gemma 3's local layers have their own base).

use std::sync::Arc;

use cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
    PinnedHostSlice, ValidAsZeroBits,
};
use half::bf16;

use super::launch::{KernelArg, KernelArgs, launch_kernel};
use super::{CudaKvPool, cuda_err};
use crate::Error;
use crate::backend::SeqSpan;
use crate::shape::shape;

/// Reusable device buffers (grown on demand, never shrunk).
#[derive(Default)]
pub(crate) struct Scratch {
    /// bf16 copy of a matmul input.
    pub bf16: Option<CudaSlice<bf16>>,
    /// A second one, for an op that reads one bf16 copy and writes another (the gated GEMV).
    pub bf16_alt: Option<CudaSlice<bf16>>,
    /// Token ids (embed).
    pub idx: Option<CudaSlice<u32>>,
    /// Row indices (gather_rows); separate from `idx` so that a CUDA graph, whose inputs are
    /// all uploaded before it runs, reads each from its own buffer.
    pub rows_idx: Option<CudaSlice<u32>>,
    /// Query tiles `(first row, rows)` of the tensor-core prefill attention (over a coded
    /// pool: then each span's scratch base and the runs of keys to dequantize).
    pub tiles: Option<CudaSlice<u32>>,
    /// A coded pool's keys, then its values, dequantized to f16 rows for the tensor-core
    /// prefill attention (`[key, kv_heads, head_dim]` each).
    pub code_rows: Option<CudaSlice<u16>>,
    /// Graph mode: no allocation, and uploads are queued in `pending` until
    /// [`Scratch::flush`] (run just before the graph is launched).
    pub defer: bool,
    pending: Vec<(Target, Vec<u32>)>,
    /// Mapped page-locked staging for the queued uploads, which the `upload_words` kernel
    /// reads over the bus.
    staging: Option<PinnedHostSlice<u32>>,
    /// Recorded after the uploads out of `staging`, waited on before it is rewritten.
    staging_done: Option<CudaEvent>,
    /// The device top-k selection's output (`rows · (2k + 3)` words, fully written by each
    /// launch), mapped page-locked memory the kernel writes directly.
    pub topk_host: Option<PinnedHostSlice<u32>>,
    /// The step metadata buffers (see the module docs), the one the last op prepared, and the
    /// step (epoch) the next unused one is counted for.
    metas: Vec<MetaSlot>,
    meta_cur: usize,
    meta_next: usize,
    meta_epoch: u64,
    span_key_tmp: Vec<usize>,
    /// RoPE frequency tables on the device (host copy, device copy), the one used last.
    ropes: Vec<(Vec<f32>, CudaSlice<f32>)>,
    rope_cur: usize,
    /// Attention partials: (max, sum) per (row, head, split).
    pub part_ml: Option<CudaSlice<f32>>,
    /// Attention partials: unnormalised accumulators per (row, head, split).
    pub part_acc: Option<CudaSlice<f32>>,
    /// Attention: finished splits per (row, kv head), zero between launches.
    pub attn_counters: Option<CudaSlice<u32>>,
    /// Mixture of experts: each pair's expert, and the f32 intermediates (weights, gate_up
    /// outputs, activations, expert outputs) end to end.
    pub moe_sel: Option<CudaSlice<u32>>,
    pub moe: Option<CudaSlice<f32>>,
    /// The exact table of windowed coded pools (see `exact.rs`), what it holds (when
    /// `exact_valid`), and whether one was queued in this graph step.
    exact: Option<CudaSlice<u32>>,
    exact_host: Vec<u32>,
    exact_valid: bool,
    exact_queued: bool,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Uploads still queued out of the page-locked staging must run before it is freed.
        if let Some(done) = &self.staging_done {
            let _ = done.synchronize();
        }
    }
}

/// Most distinct span sets (block tables) one graphed step may use: the cache's tables and a
/// model's sliding-window rings' virtual ones, with room to spare.
const META_SLOTS: usize = 4;
/// Most RoPE frequency tables kept on the device (global and local layers).
const ROPE_SLOTS: usize = 4;

/// One step-metadata buffer and what it holds.
#[derive(Default)]
struct MetaSlot {
    /// Whether `dev` holds `host` (or will, once the queued uploads run).
    valid: bool,
    /// Identity of the spans last checked and uploaded here (see
    /// [`Scratch::prepare_spans`]), with the step epoch and pool shape it was checked for.
    key: Vec<usize>,
    epoch: u64,
    pool: (usize, usize),
    host: Vec<u32>,
    dev: Option<CudaSlice<u32>>,
    rows: usize,
    seqs: usize,
}

/// Where a queued upload goes.
#[derive(Clone, Copy, Debug)]
enum Target {
    Idx,
    RowsIdx,
    Tiles,
    /// A step-metadata slot.
    Meta(usize),
    Exact,
}

/// The error of a step that cannot run inside (or be replayed by) a captured CUDA graph.
pub(crate) fn graph_changed(why: &str) -> Error {
    Error::Cuda {
        op: "graph",
        detail: format!("the step differs from the captured CUDA graph ({why})"),
    }
}

/// Views of the uploaded step metadata.
pub(crate) struct Meta<'a> {
    pub pos: CudaView<'a, u32>,
    pub seq: CudaView<'a, u32>,
    pub seq_tbl: CudaView<'a, u32>,
    pub tables: CudaView<'a, u32>,
}

impl Meta<'_> {
    /// Device addresses of `[pos, seq, seq_tbl, tables]`, the kernels' metadata arguments.
    pub(crate) fn addrs(&self, stream: &Arc<CudaStream>) -> [u64; 4] {
        [
            super::ops::addr(&self.pos, stream),
            super::ops::addr(&self.seq, stream),
            super::ops::addr(&self.seq_tbl, stream),
            super::ops::addr(&self.tables, stream),
        ]
    }
}

/// `slot` with room for at least `n` elements (contents unspecified after growth). With
/// `may_alloc` false (graph capture or replay) a slot too small is an error.
pub(crate) fn grow<'a, T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &'a mut Option<CudaSlice<T>>,
    n: usize,
    may_alloc: bool,
) -> Result<&'a mut CudaSlice<T>, Error> {
    let need = n.max(1);
    if slot.as_ref().is_none_or(|s| s.len() < need) {
        if !may_alloc {
            return Err(graph_changed("a scratch buffer must grow"));
        }
        *slot = None;
        *slot = Some(
            stream
                .alloc_zeros::<T>(need.next_power_of_two())
                .map_err(cuda_err("alloc scratch"))?,
        );
    }
    slot.as_mut().ok_or_else(|| Error::Cuda {
        op: "scratch",
        detail: "buffer missing".into(),
    })
}

fn views(m: Option<&CudaSlice<u32>>, t: usize, s: usize) -> Result<Meta<'_>, Error> {
    let m = m.ok_or_else(|| Error::Cuda {
        op: "spans",
        detail: "not uploaded".into(),
    })?;
    Ok(Meta {
        pos: m.slice(..t),
        seq: m.slice(t..2 * t),
        seq_tbl: m.slice(2 * t..2 * t + s),
        tables: m.slice(2 * t + s..),
    })
}

/// Checks that the spans tile `rows` rows exactly and encodes their metadata.
fn encode(spans: &[SeqSpan<'_>], rows: usize, out: &mut Vec<u32>) -> Result<(), Error> {
    out.clear();
    out.resize(2 * rows + spans.len(), u32::MAX);
    let mut tables = 0usize;
    for (si, s) in spans.iter().enumerate() {
        let end = s.first_row + s.n_tokens;
        if end > rows {
            return Err(shape(
                "spans",
                format!("span rows {}..{end} beyond {rows} rows", s.first_row),
            ));
        }
        let last = s.first_pos + s.n_tokens;
        if last > u32::MAX as usize {
            return Err(shape("spans", format!("position {last} too large")));
        }
        for i in 0..s.n_tokens {
            let r = s.first_row + i;
            if out[rows + r] != u32::MAX {
                return Err(shape("spans", format!("row {r} belongs to two sequences")));
            }
            out[r] = (s.first_pos + i) as u32;
            out[rows + r] = si as u32;
        }
        out[2 * rows + si] = tables as u32;
        tables += s.blocks.len();
    }
    if out[rows..2 * rows].contains(&u32::MAX) {
        return Err(shape("spans", "some rows belong to no sequence".into()));
    }
    for s in spans {
        out.extend_from_slice(s.blocks);
    }
    Ok(())
}

/// At least `n` page-locked host words (a power of two), zeroed, in cached memory (the host
/// reads them; write-combined memory is slow to read): copies to and from them are
/// asynchronous.
pub(crate) fn pinned_words(
    stream: &Arc<CudaStream>,
    n: usize,
    op: &'static str,
) -> Result<PinnedHostSlice<u32>, Error> {
    // SAFETY: the memory starts uninitialised and is zeroed here before any other use.
    // Mapped, so kernels may read or write it directly (`device_addr`).
    let mut words = unsafe {
        stream.context().alloc_pinned_with_flags::<u32>(
            n.max(1).next_power_of_two(),
            cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP,
        )
    }
    .map_err(cuda_err(op))?;
    words.as_mut_slice().map_err(cuda_err(op))?.fill(0);
    Ok(words)
}

/// The device address of mapped page-locked memory from [`pinned_words`]: kernels read and
/// write it over the bus, without a copy-engine transfer.
pub(crate) fn device_addr(
    words: &mut PinnedHostSlice<u32>,
    op: &'static str,
) -> Result<u64, Error> {
    let host = words.as_mut_ptr().map_err(cuda_err(op))?;
    let mut dev: cudarc::driver::sys::CUdeviceptr = 0;
    // SAFETY: `host` is the start of a live page-locked allocation made with
    // CU_MEMHOSTALLOC_DEVICEMAP in the current context (bound by `as_mut_ptr`'s caller chain:
    // the allocation bound it); the driver only writes `dev`.
    unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }
        .result()
        .map_err(cuda_err(op))?;
    Ok(dev)
}

/// Checks every block a span reads or writes against the pool.
pub(crate) fn check_tables(spans: &[SeqSpan<'_>], pool: &CudaKvPool) -> Result<(), Error> {
    for s in spans {
        let need = (s.first_pos + s.n_tokens).div_ceil(pool.block_size);
        let blocks = s.blocks.get(..need).ok_or_else(|| {
            shape(
                "kv",
                format!(
                    "position {} beyond the block table ({} blocks)",
                    s.first_pos + s.n_tokens - 1,
                    s.blocks.len()
                ),
            )
        })?;
        if let Some(&b) = blocks.iter().find(|&&b| b as usize >= pool.num_blocks) {
            return Err(shape(
                "kv",
                format!("block {b} outside the pool of {}", pool.num_blocks),
            ));
        }
    }
    Ok(())
}

impl Scratch {
    /// Checks the spans' block tables against `pool` and uploads the step metadata — unless
    /// this step (`epoch`, bumped at every `to_host`) already did so for the same spans: the
    /// KV write and attention of every layer get the same spans, and re-encoding and
    /// re-checking every table per call cost the host ~25 µs per sequence per llama3-8b
    /// decode step (GPU idle time under graph replay: 900 µs per step at batch 32, 110 after). "The same" is by identity (slice addresses,
    /// lengths, rows and positions): block tables only change between steps. Spans another
    /// slot holds for this step are taken from it; new ones go into the step's next slot.
    pub(crate) fn prepare_spans(
        &mut self,
        stream: &Arc<CudaStream>,
        spans: &[SeqSpan<'_>],
        rows: usize,
        pool: &CudaKvPool,
        epoch: u64,
    ) -> Result<(), Error> {
        let mut key = std::mem::take(&mut self.span_key_tmp);
        key.clear();
        key.push(rows);
        for s in spans {
            key.extend([
                s.first_row,
                s.n_tokens,
                s.first_pos,
                s.blocks.as_ptr() as usize,
                s.blocks.len(),
            ]);
        }
        let pool_shape = (pool.num_blocks, pool.block_size);
        if let Some(i) = self
            .metas
            .iter()
            .position(|m| m.valid && m.epoch == epoch && m.pool == pool_shape && m.key == key)
        {
            self.meta_cur = i;
            self.span_key_tmp = key;
            return Ok(());
        }
        check_tables(spans, pool)?;
        if self.meta_epoch != epoch {
            self.meta_epoch = epoch;
            self.meta_next = 0;
        }
        let i = self.meta_next;
        if i >= META_SLOTS {
            if self.defer {
                return Err(graph_changed("more block tables than metadata buffers"));
            }
            // Eager: uploads are ordered on the stream, so the last slot may be reused.
            self.meta_cur = META_SLOTS - 1;
        } else {
            self.meta_next += 1;
            self.meta_cur = i;
        }
        if self.metas.len() <= self.meta_cur {
            self.metas.resize_with(self.meta_cur + 1, MetaSlot::default);
        }
        self.metas[self.meta_cur].key.clear();
        self.upload_meta(stream, spans, rows)?;
        let m = &mut self.metas[self.meta_cur];
        self.span_key_tmp = std::mem::replace(&mut m.key, key);
        m.epoch = epoch;
        m.pool = pool_shape;
        Ok(())
    }

    /// Uploads the step metadata into the current slot unless it holds these spans already.
    fn upload_meta(
        &mut self,
        stream: &Arc<CudaStream>,
        spans: &[SeqSpan<'_>],
        rows: usize,
    ) -> Result<(), Error> {
        let mut host = Vec::new();
        encode(spans, rows, &mut host)?;
        let (defer, cur) = (self.defer, self.meta_cur);
        let m = &mut self.metas[cur];
        if m.dev.is_some() && m.valid && host == m.host && m.rows == rows && m.seqs == spans.len() {
            return Ok(());
        }
        m.valid = false;
        let dev = grow(stream, &mut m.dev, host.len(), !defer)?;
        if defer {
            self.pending.push((Target::Meta(cur), host.clone()));
        } else {
            stream
                .memcpy_htod(&host, &mut dev.slice_mut(..host.len()))
                .map_err(cuda_err("upload spans"))?;
        }
        m.valid = true;
        m.host = host;
        m.rows = rows;
        m.seqs = spans.len();
        Ok(())
    }

    /// Views of the metadata the last [`Scratch::prepare_spans`] made current.
    pub(crate) fn meta(&self) -> Result<Meta<'_>, Error> {
        let m = self.metas.get(self.meta_cur);
        views(
            m.and_then(|m| m.dev.as_ref()),
            m.map_or(0, |m| m.rows),
            m.map_or(0, |m| m.seqs),
        )
    }

    /// Makes the RoPE inverse frequencies `inv_freq` current, uploading them unless one of the
    /// kept tables holds them; returns the device copy.
    pub(crate) fn rope(
        &mut self,
        stream: &Arc<CudaStream>,
        inv_freq: &[f32],
    ) -> Result<&CudaSlice<f32>, Error> {
        if let Some(i) = self.ropes.iter().position(|(h, _)| h == inv_freq) {
            self.rope_cur = i;
            return Ok(&self.ropes[i].1);
        }
        if self.defer {
            return Err(graph_changed("new RoPE frequencies"));
        }
        let mut slot = None;
        let dev = grow(stream, &mut slot, inv_freq.len(), true)?;
        if !inv_freq.is_empty() {
            stream
                .memcpy_htod(inv_freq, &mut dev.slice_mut(..inv_freq.len()))
                .map_err(cuda_err("upload rope"))?;
        }
        let dev = slot.ok_or_else(|| graph_changed("no RoPE table"))?;
        if self.ropes.len() == ROPE_SLOTS {
            // The oldest goes (eager only: its readers are ordered before any later write).
            self.ropes.remove(0);
        }
        self.ropes.push((inv_freq.to_vec(), dev));
        self.rope_cur = self.ropes.len() - 1;
        Ok(&self.ropes[self.rope_cur].1)
    }

    /// The device copy of the RoPE frequencies made current last.
    pub(crate) fn rope_buf(&self) -> Result<&CudaSlice<f32>, Error> {
        self.ropes
            .get(self.rope_cur)
            .map(|(_, d)| d)
            .ok_or_else(|| Error::Cuda {
                op: "rope",
                detail: "not uploaded".into(),
            })
    }

    /// Uploads `ids` into the index buffer (`rows`: the gather buffer, else the embed one).
    pub(crate) fn upload_idx(
        &mut self,
        stream: &Arc<CudaStream>,
        ids: &[u32],
        rows: bool,
    ) -> Result<&CudaSlice<u32>, Error> {
        let (slot, target) = if rows {
            (&mut self.rows_idx, Target::RowsIdx)
        } else {
            (&mut self.idx, Target::Idx)
        };
        Self::upload_to(stream, slot, target, ids, self.defer, &mut self.pending)
    }

    /// Uploads a windowed pool's exact table unless the device holds it already. A graph step
    /// uploads every input before it runs, so all its layers must share one table (they do:
    /// every windowed pool of a cache sees the same spans); another is a graph change.
    pub(crate) fn upload_exact(
        &mut self,
        stream: &Arc<CudaStream>,
        table: &[u32],
    ) -> Result<&CudaSlice<u32>, Error> {
        if self.exact_valid && self.exact_host == table {
            return self
                .exact
                .as_ref()
                .ok_or_else(|| graph_changed("no exact table"));
        }
        if self.defer && self.exact_queued {
            return Err(graph_changed("layers with different exact windows"));
        }
        self.exact_valid = false;
        self.exact_host.clear();
        self.exact_host.extend_from_slice(table);
        self.exact_queued = self.defer;
        let dev = Self::upload_to(
            stream,
            &mut self.exact,
            Target::Exact,
            table,
            self.defer,
            &mut self.pending,
        )?;
        self.exact_valid = true;
        Ok(dev)
    }

    /// Uploads the attention query tiles.
    pub(crate) fn upload_tiles(
        &mut self,
        stream: &Arc<CudaStream>,
        tiles: &[u32],
    ) -> Result<&CudaSlice<u32>, Error> {
        Self::upload_to(
            stream,
            &mut self.tiles,
            Target::Tiles,
            tiles,
            self.defer,
            &mut self.pending,
        )
    }

    fn upload_to<'a>(
        stream: &Arc<CudaStream>,
        slot: &'a mut Option<CudaSlice<u32>>,
        target: Target,
        ids: &[u32],
        defer: bool,
        pending: &mut Vec<(Target, Vec<u32>)>,
    ) -> Result<&'a CudaSlice<u32>, Error> {
        let dev = grow(stream, slot, ids.len(), !defer)?;
        if defer {
            pending.push((target, ids.to_vec()));
        } else {
            stream
                .memcpy_htod(ids, &mut dev.slice_mut(..ids.len()))
                .map_err(cuda_err("upload indices"))?;
        }
        Ok(dev)
    }

    /// Performs the queued uploads (graph mode), in order: their words go into the mapped
    /// page-locked staging buffer, and `upload` (the `upload_words` kernel) copies them to
    /// their device buffers, up to [`UPLOAD_RUNS`] per launch.
    pub(crate) fn flush(
        &mut self,
        stream: &Arc<CudaStream>,
        upload: &CudaFunction,
    ) -> Result<(), Error> {
        self.exact_queued = false;
        if self.pending.is_empty() {
            return Ok(());
        }
        let total: usize = self.pending.iter().map(|(_, d)| d.len()).sum();
        if let Some(done) = &self.staging_done {
            done.synchronize()
                .map_err(cuda_err("upload graph inputs"))?;
        }
        if self.staging.as_ref().is_none_or(|s| s.len() < total) {
            self.staging = None;
            self.staging = Some(pinned_words(stream, total, "alloc staging")?);
        }
        if self.staging_done.is_none() {
            let e = stream
                .context()
                .new_event(None)
                .map_err(cuda_err("upload graph inputs"))?;
            self.staging_done = Some(e);
        }
        let (Some(staging), Some(done)) = (self.staging.as_mut(), self.staging_done.as_ref())
        else {
            return Err(graph_changed("no staging buffer"));
        };
        let base = device_addr(staging, "upload graph inputs")?;
        let host = staging
            .as_mut_slice()
            .map_err(cuda_err("upload graph inputs"))?;
        let mut at = 0;
        let mut runs = UploadRuns::default();
        let mut n_runs = 0;
        for (target, data) in self.pending.drain(..) {
            let slot = match target {
                Target::Idx => &mut self.idx,
                Target::RowsIdx => &mut self.rows_idx,
                Target::Tiles => &mut self.tiles,
                Target::Meta(i) => match self.metas.get_mut(i) {
                    Some(m) => &mut m.dev,
                    None => return Err(graph_changed("no metadata buffer")),
                },
                Target::Exact => &mut self.exact,
            };
            let dev = grow(stream, slot, data.len(), false)?;
            host[at..at + data.len()].copy_from_slice(&data);
            let (dst, _) = dev.device_ptr(stream);
            runs.src[n_runs] = base + 4 * at as u64;
            runs.dst[n_runs] = dst;
            runs.len[n_runs] = i32::try_from(data.len())
                .map_err(|_| graph_changed("an upload beyond 2^31 words"))?;
            n_runs += 1;
            at += data.len();
            if n_runs == UPLOAD_RUNS {
                launch_upload(stream, upload, &runs)?;
                (runs, n_runs) = (UploadRuns::default(), 0);
            }
        }
        if n_runs > 0 {
            launch_upload(stream, upload, &runs)?;
        }
        done.record(stream).map_err(cuda_err("upload graph inputs"))
    }

    /// Drops queued uploads (a step that did not run) and forgets what the device holds.
    pub(crate) fn discard_pending(&mut self) {
        self.pending.clear();
        for m in &mut self.metas {
            m.valid = false;
        }
        // A step run again (eagerly, after a capture or replay that did not fit) assigns its
        // span sets from the first slot again, so it grows the slots the next capture uses.
        self.meta_next = 0;
        self.exact_valid = false;
        self.exact_queued = false;
    }
}

/// Runs per `upload_words` launch (`UPLOAD_CHUNKS` in elementwise.cu).
const UPLOAD_RUNS: usize = 4;

/// `struct UploadRuns` of elementwise.cu, field for field: source (mapped host) and
/// destination device addresses and lengths in words; unused runs have length 0.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct UploadRuns {
    src: [u64; UPLOAD_RUNS],
    dst: [u64; UPLOAD_RUNS],
    len: [i32; UPLOAD_RUNS],
}

// SAFETY: plain integers laid out as the kernel's struct parameter (`repr(C)`, 4 + 4 u64
// then 4 i32: 8-aligned, no padding bytes).
unsafe impl KernelArg for UploadRuns {}
const _: () = assert!(std::mem::size_of::<UploadRuns>() == UPLOAD_RUNS * 20);

fn launch_upload(
    stream: &Arc<CudaStream>,
    upload: &CudaFunction,
    runs: &UploadRuns,
) -> Result<(), Error> {
    let words: i32 = runs.len.iter().sum();
    let threads = 256u32;
    let cfg = LaunchConfig {
        grid_dim: ((words.max(1) as u32).div_ceil(threads), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = KernelArgs::default();
    args.arg(*runs);
    // SAFETY: `upload_words` takes one `UploadRuns` by value. Each run's source is `len`
    // words of the mapped staging buffer, filled above and kept until `staging_done`
    // (recorded after this launch) has passed; each destination is a device buffer of at
    // least `len` words (grown above).
    unsafe { launch_kernel(stream, "upload graph inputs", upload, cfg, false, &mut args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_layout_and_validation() {
        let (a, b) = ([3u32, 4], [7u32]);
        let spans = [
            SeqSpan {
                first_row: 0,
                n_tokens: 2,
                first_pos: 5,
                blocks: &a,
            },
            SeqSpan {
                first_row: 2,
                n_tokens: 1,
                first_pos: 0,
                blocks: &b,
            },
        ];
        let mut out = Vec::new();
        encode(&spans, 3, &mut out).unwrap();
        assert_eq!(out, vec![5, 6, 0, 0, 0, 1, 0, 2, 3, 4, 7]);
        assert!(encode(&spans, 4, &mut out).is_err());
        assert!(encode(&spans, 2, &mut out).is_err());
    }
}
