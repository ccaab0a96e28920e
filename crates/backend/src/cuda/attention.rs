//! Attention launches: the tensor-core tile kernel for prefill spans and the split-K decode
//! kernels, with the split count chosen from the shape. Every path takes attention sinks (a
//! device pointer to one logit per query head, null for none, added to each row's softmax
//! denominator) and a sliding window (a runtime parameter, 0 for none: each row's key range
//! starts at its window's first key; coded pools stage whole runs of 16 keys and mask the
//! keys before it, their exact split too).

use cudarc::driver::LaunchConfig;

use super::codes::{
    CODE_HEAD_DIMS, CODE_TILE, CODE_WARPS, CodeVariant, DESC_WORDS, KEYS_AS_M_MAX_GROUP, PoolCodes,
    coded_max_group,
};
use super::kernels::{DEC_M_MAX_GROUP, DECODE_SETS, MANY_PAIRS};
use super::launch::Launches;
use super::ops::{addr, check_geometry, expect_cols, ints, opc};
use super::parts::{self, PARTS_DESC_WORDS, PARTS_HEAD_DIMS, PARTS_PREFILL_HEAD_DIMS};
use super::step::grow;
use super::{CudaBackend, CudaKvPool, CudaTensor, CudaVector, DECODE_VARIANTS, DecodeVariant};
use crate::backend::{AttnGeometry, SeqSpan};
use crate::shape::shape;
use crate::{Backend, Error};
use turbokv_codec::KvDtype;

/// Keys per attention tile and threads per attention block (see attention.cu).
const ATTN_TILE: usize = 32;
const ATTN_THREADS: usize = 128;
/// Accumulator elements per thread: `group · head_dim ≤ 128 · 16`.
const ATTN_MAX_ELEMS: usize = ATTN_THREADS * 16;
/// Spans of at least this many new tokens (prefill) send a step to the tensor-core kernel.
const MMA_MIN_ROWS: usize = 16;
/// Most query heads per kv head of the decode template (the MMAs' 16 rows).
const DEC_MAX_GROUP: usize = 16;
/// Splits of at most this many tiles take the deeper pipeline (see `decode_choice`).
const SHORT_SPLIT_TILES: usize = 2;
/// The fixed cost of one decode split block (prologue, pipeline ramp, partial store and its
/// share of the merge), in keys streamed: the wave-aware split rule charges it per block.
const SPLIT_OVERHEAD_KEYS: usize = 128;
/// The issue-bound TurboQuant decode kernels' cost of an SM's key, in hundredths of its
/// cost with three blocks resident, for 1, 2 and 3 resident blocks: one block alone issues
/// too little to hide its latencies, and a third adds little over two (H100, k4v2: 7.0, 5.7
/// and 5.4 ns a key; BENCHMARKS.md, session 38). See [`sm_load_splits`]
/// (`CudaOptions::sm_load_splits`).
const SM_KEY_COST: [usize; 3] = [130, 105, 100];
/// The fixed cost of one such block (its setup, the last tile's wait, the partial's store
/// and merge), in keys at three blocks an SM (about 3 µs on an H100).
const SM_BLOCK_KEYS: usize = 555;
/// Splits of the wave model at least this long keep its count in [`sm_load_splits`]: there a
/// block's fixed cost is a small part of it, both models' counts ran within a few percent, and
/// at b4–b8 × 128k the per-SM count was 1–2% slower for tq4 and k4v3 (H100, session 39).
const SM_LOAD_MAX_SPLIT_KEYS: usize = 8192;
/// Keys per K/V tile of the tensor-core kernel (see attention.cu).
const MMA_TK: usize = 32;
/// Fewest keys a decode split covers.
const MIN_SPLIT_KEYS: usize = 64;
/// Warps per block of the coded prefill tile kernel (attention.cu `ATTN_MMA_CODES`).
const MMA_CODES_WARPS: usize = 4;
/// The unit of a windowed coded pool's exact splits: attention.cu `EXACT_CHUNK`, the keys whose
/// rows one round of staging brings.
const EXACT_CHUNK: usize = 64;

/// Pipeline stages of the row kernel for splits of fewer tiles than this (they are requested
/// whole at the start; 3 stages otherwise). On the H200 at llama3-8b batch 1, ctx 4096
/// (4-tile splits): 5 stages −0.18 ms per decode step; at batch 8 and 32 (long splits) 5 were
/// slower.
const ATTN_DEEP_STAGES: usize = 5;

/// The `window` kernel parameter: 0 for none; a window wider than any position fits (as the
/// 32-bit maximum, which sees every key).
fn window_param(window: Option<usize>) -> i32 {
    window.map_or(0, |w| i32::try_from(w).unwrap_or(i32::MAX))
}

/// Keys a row at position `pos` attends: `pos + 1`, or its window.
fn keys_seen(pos: usize, window: Option<usize>) -> usize {
    window.map_or(pos + 1, |w| w.min(pos + 1))
}

impl CudaBackend {
    /// Attention through the tensor-core tile kernel: every span cut into tiles of
    /// 16·`prefill_warps`/g consecutive rows (shapes, tables and metadata checked and uploaded by the caller).
    #[allow(clippy::too_many_arguments)]
    fn attention_mma(
        &self,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CudaKvPool,
        window: Option<usize>,
        sinks: u64,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        let (grp, hd, rows) = (g.group(), g.head_dim, qkv.rows);
        let tiles = prefill_tiles(spans, window, 16 * self.prefill_warps / grp);
        let n_tiles = tiles.len() / 2;
        let mut st = self.lock_state("attention")?;
        let sc = st.sc();
        let may_alloc = !sc.defer;
        let ob = addr(
            grow(&self.stream, &mut sc.bf16, rows * g.n_heads * hd, may_alloc)?,
            &self.stream,
        );
        let tp = addr(sc.upload_tiles(&self.stream, &tiles)?, &self.stream);
        let meta = sc.meta()?.addrs(&self.stream);
        let [width, nh, nkv, bs] = ints(
            "attention",
            [g.qkv_width(), g.n_heads, g.n_kv_heads, pool.block_size],
        )?;
        let smem = 2 * 2 * MMA_TK * (hd + 8) * 2;
        let (qp, kp, vp, op) = (
            addr(&qkv.buf, &self.stream),
            addr(&pool.k, &self.stream),
            addr(&pool.v, &self.stream),
            addr(&out.buf, &self.stream),
        );
        let is_bf16 = i32::from(pool.is_bf16);
        let cfg = LaunchConfig {
            grid_dim: (n_tiles as u32, g.n_kv_heads as u32, 1),
            block_dim: (32 * self.prefill_warps as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut l = Launches::new(opc::ATTN_MMA);
        l.kernel(
            "attn_mma",
            &if self.prefill_warps == 8 {
                &self.k.attn_mma8
            } else {
                &self.k.attn_mma
            }[usize::from(hd == 128)],
            cfg,
            false,
        )
        .ptr(qp)
        .arg(width)
        .arg(nh)
        .arg(nkv)
        .arg(g.scale)
        .ptr(meta[0])
        .ptr(meta[1])
        .ptr(meta[2])
        .ptr(meta[3])
        .ptr(kp)
        .ptr(vp)
        .arg(bs)
        .ptr(tp)
        .ptr(op)
        .ptr(ob)
        .arg(is_bf16)
        .arg(window_param(window))
        .ptr(sinks);
        let launch = st.admit(l.signature())?;
        st.bf16_of = Some([op, ob, rows as u64, (g.n_heads * hd) as u64]);
        if !launch {
            return Ok(());
        }
        // SAFETY: every tile lies inside one span (rows first..first+n of one sequence, whose
        // blocks were checked against the pool; a window only narrows the keys read); the
        // pool is 16-bit with head_dim 64 or 128; sinks, when not null, hold n_heads floats;
        // out and the bf16 scratch hold rows·n_heads·head_dim values; smem (≤ 35 KiB) is below
        // the opt-in limit set at load.
        unsafe { self.launch(&mut l) }?;
        Ok(())
    }

    /// Picks the number of key splits for a launch of `rows` query rows over at most
    /// `max_ctx` keys: enough (row, kv head, split) blocks for `blocks_per_sm` per SM, each
    /// split at least `MIN_SPLIT_KEYS` keys. The kernel divides each row's own key range.
    fn split_count(&self, rows: usize, n_kv: usize, max_ctx: usize) -> usize {
        let target = self.blocks_per_sm * self.sms;
        target
            .div_ceil(rows * n_kv)
            .clamp(1, max_ctx.div_ceil(MIN_SPLIT_KEYS).max(1))
    }

    /// [`Backend::supports_attention`]: the limits every attention kernel path meets (a step
    /// may take the tiled kernel, e.g. a short prefill continuation), checked up front.
    pub(super) fn check_attention(&self, g: &AttnGeometry, dtype: KvDtype) -> Result<(), Error> {
        self.check_kv_dtype(dtype, g.head_dim)?;
        let fits = g.n_kv_heads > 0
            && g.n_heads.is_multiple_of(g.n_kv_heads)
            && g.head_dim.is_multiple_of(4)
            && (4..=256).contains(&g.head_dim)
            && g.group() * g.head_dim <= ATTN_MAX_ELEMS;
        let coded_most = coded_max_group(g.head_dim);
        if fits && dtype.is_compressed() && g.group() > coded_most {
            return Err(Error::UnsupportedAttention {
                backend: "cuda",
                detail: format!(
                    "{} query heads per kv head over a {dtype} cache of head_dim {}",
                    g.group(),
                    g.head_dim
                ),
                supported: format!(
                    "at most {coded_most} query heads per kv head on coded caches of this head_dim"
                ),
            });
        }
        if fits {
            return Ok(());
        }
        Err(Error::UnsupportedAttention {
            backend: "cuda",
            detail: format!(
                "{} query heads over {} kv heads of head_dim {}",
                g.n_heads, g.n_kv_heads, g.head_dim
            ),
            supported: format!(
                "head_dim a multiple of 4 up to 256, query heads a multiple of the kv heads, \
                 (query heads per kv head) × head_dim ≤ {ATTN_MAX_ELEMS}"
            ),
        })
    }

    /// Attention over the cache (which holds this step's keys and values already), with a
    /// sliding window where `window` is some and a sink logit per query head where `sinks` is
    /// some.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_impl(
        &self,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CudaKvPool,
        window: Option<usize>,
        sinks: Option<&CudaVector>,
        out: &mut CudaTensor,
    ) -> Result<(), Error> {
        expect_cols("attention", qkv, g.qkv_width())?;
        expect_cols("attention", out, g.n_heads * g.head_dim)?;
        check_geometry(g, pool)?;
        if let Some(s) = sinks.filter(|s| s.len != g.n_heads) {
            return Err(shape(
                "attention",
                format!("{} sink logits for {} query heads", s.len, g.n_heads),
            ));
        }
        let sinks = sinks.map_or(0, |s| addr(&s.data, &self.stream));
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
        let rows = qkv.rows;
        self.set_rows(out, rows)?;
        let mut st = self.lock_state("attention")?;
        let epoch = st.epoch;
        let sc = st.sc();
        sc.prepare_spans(&self.stream, spans, rows, pool, epoch)?;
        if rows == 0 {
            return Ok(());
        }
        let grp = g.group();
        let coded = pool.codes.as_ref();
        if window == Some(0) {
            return Err(shape("attention", "a sliding window of 0 tokens".into()));
        }
        // A parts pool: a launch with a prefill span takes the tile kernel over its dequantized
        // keys, the others `attn_parts_*` on the codes.
        let parts_kernel = match coded {
            Some(c) if c.variant.is_none() => {
                let i = parts::decode_index(g.head_dim, grp).ok_or_else(|| {
                    shape(
                        "attention",
                        format!(
                            "{grp} query heads per kv head over a coded pool of head_dim {} (at \
                             most 16, 8 at head_dim 256)",
                            g.head_dim
                        ),
                    )
                })?;
                if PARTS_PREFILL_HEAD_DIMS.contains(&g.head_dim)
                    && spans.iter().any(|s| s.n_tokens >= MMA_MIN_ROWS)
                {
                    drop(st);
                    return self.attention_mma_codes(qkv, g, spans, pool, window, sinks, out, None);
                }
                Some(i)
            }
            _ => None,
        };
        // Its shared memory follows the pool's record sizes (parts::decode_smem_bytes).
        let parts_smem = match (parts_kernel, coded) {
            (Some(i), Some(c)) => {
                let (d, group) = parts::DECODE_KERNELS[i];
                parts::decode_smem_bytes(
                    d,
                    group,
                    c.k_layout.code_bytes_per_token,
                    c.v_layout.code_bytes_per_token,
                )
            }
            _ => 0,
        };
        let groups = launch_groups(coded, g.n_kv_heads);
        for v in groups.iter().filter_map(|lg| lg.variant) {
            if grp > v.max_group() {
                return Err(shape(
                    "attention",
                    format!(
                        "{grp} query heads per kv head over a coded pool of head_dim {} (at \
                         most {})",
                        g.head_dim,
                        v.max_group()
                    ),
                ));
            }
        }
        if let Some(i) = groups[0].variant.map(kernel_index).transpose()?
            && self.coded_prefill_tiles
            && groups
                .iter()
                .all(|lg| lg.variant.is_some_and(|v| v.has_prefill()))
            && spans.iter().any(|s| s.n_tokens >= MMA_MIN_ROWS)
        {
            drop(st);
            return self.attention_mma_codes(qkv, g, spans, pool, window, sinks, out, Some(i));
        }
        // The most keys one row attends (its window, if narrower): what the splits divide.
        let max_ctx = spans
            .iter()
            .map(|s| keys_seen((s.first_pos + s.n_tokens).saturating_sub(1), window))
            .max()
            .unwrap_or(1);
        if coded.is_none()
            && matches!(g.head_dim, 64 | 128)
            && (16 * self.prefill_warps).is_multiple_of(grp)
            && spans.iter().any(|s| s.n_tokens >= MMA_MIN_ROWS)
        {
            drop(st);
            return self.attention_mma(qkv, g, spans, pool, window, sinks, out);
        }
        // One launch per group of kv heads (see `launch_groups`), each with its own split
        // count: the launches run in stream order, so they reuse the partial buffers.
        for (gi, lg) in groups.iter().enumerate() {
            let last = gi + 1 == groups.len();
            let sc = st.sc();
            let variant = lg.variant;
            let code_kernel = variant.map(kernel_index).transpose()?;
            let hd = g.head_dim;
            // The tensor-core split kernel, else the row-parallel kernel where it is
            // instantiated, else the tiled one.
            let pairs = rows * lg.heads;
            // (Head dims above the template's have only these: the group was checked above.)
            let keys_as_m = grp <= KEYS_AS_M_MAX_GROUP;
            // The kernel with int8 key products where it exists for the pool's forms.
            let int8_keys = code_kernel.filter(|&i| {
                keys_as_m && self.coded_int8_keys && self.k.attn_codes_k8[i].is_some()
            });
            let int8_values =
                int8_keys.filter(|&i| self.coded_int8_values && self.k.attn_codes_k8v[i].is_some());
            let dec = match code_kernel.or(parts_kernel) {
                Some(_) => None,
                None => (self.dec_mma && grp <= dec_max_group(hd))
                    .then(|| self.decode_choice(hd, pairs, max_ctx))
                    .flatten(),
            };
            let dec_kernel = dec.map(|(i, _)| i);
            let rows_kernel = rows_kernel_index(hd, grp).filter(|_| {
                dec_kernel.is_none() && code_kernel.is_none() && parts_kernel.is_none()
            });
            // A windowed coded pool's exact keys are splits of their own, `per_split` keys each
            // (attention.cu `exact_splits`): one chunk by default.
            let exact = pool.exact.as_ref();
            let per_split = self.exact_split_keys.map_or(EXACT_CHUNK, |keys| {
                keys.max(1).next_multiple_of(EXACT_CHUNK)
            });
            let exact_splits = exact.map_or(0, |x| {
                (x.slots.window.sinks + x.slots.window.recent).div_ceil(per_split)
            });
            let splits = match (code_kernel, dec) {
                _ if let Some(i) = parts_kernel => {
                    let slots = self.parts_slots(i, parts_smem)?;
                    wave_splits(pairs, max_ctx, slots, parts::DECODE_TILE) + exact_splits
                }
                (Some(i), _) => {
                    let slots = if int8_values.is_some() {
                        self.code_k8v_slots[i]
                    } else if int8_keys.is_some() {
                        self.code_k8_slots[i]
                    } else if keys_as_m {
                        self.code_m_slots[i]
                    } else {
                        self.code_slots[i]
                    };
                    let tile = match (int8_values, variant) {
                        (Some(_), Some(v)) => v.int8_values_tiling().0,
                        _ => CODE_TILE,
                    };
                    // The int8-product kernels are bound by their issue rate, the others (int8,
                    // fp8 codes; f16 sums) closer to their bytes.
                    let model = if self.sm_load_splits && int8_keys.is_some() {
                        sm_load_splits(pairs, max_ctx, self.sms, slots, tile, exact_splits > 0)
                    } else {
                        wave_splits(pairs, max_ctx, slots, tile)
                    };
                    self.coded_splits.unwrap_or(model) + exact_splits
                }
                (None, Some((_, s))) => s,
                (None, None) => self.split_count(rows, g.n_kv_heads, max_ctx),
            };
            // A split short enough to be requested in one go gets the row kernel's deeper
            // pipeline (the decode kernel's 3 stages of 64-key tiles keep 2 tiles in flight).
            let deep = max_ctx.div_ceil(splits).div_ceil(ATTN_TILE) < ATTN_DEEP_STAGES;
            let parts = rows * g.n_heads * splits;
            let may_alloc = !sc.defer;
            let ob = addr(
                grow(
                    &self.stream,
                    &mut sc.bf16,
                    rows * g.n_heads * g.head_dim,
                    may_alloc,
                )?,
                &self.stream,
            );
            let ml = addr(
                grow(&self.stream, &mut sc.part_ml, 2 * parts, may_alloc)?,
                &self.stream,
            );
            let acc = addr(
                grow(
                    &self.stream,
                    &mut sc.part_acc,
                    parts * g.head_dim,
                    may_alloc,
                )?,
                &self.stream,
            );
            // Arrival counters of the fused merge: zero when allocated, reset by the kernel.
            let counters = addr(
                grow(
                    &self.stream,
                    &mut sc.attn_counters,
                    rows * g.n_kv_heads,
                    may_alloc,
                )?,
                &self.stream,
            );
            let meta = sc.meta()?.addrs(&self.stream);
            let exact_args = match exact {
                Some(x) => {
                    let table = addr(sc.upload_exact(&self.stream, &x.slots.table)?, &self.stream);
                    let [sinks, recent, per_split] = ints(
                        "attention",
                        [x.slots.window.sinks, x.slots.window.recent, per_split],
                    )?;
                    (
                        [addr(&x.k, &self.stream), addr(&x.v, &self.stream), table],
                        [sinks, recent, x.q8(), per_split],
                    )
                }
                None => ([0; 3], [0; 4]),
            };
            let [width, nh, nkv, d, bs, splits_i] = ints(
                "attention",
                [
                    g.qkv_width(),
                    g.n_heads,
                    g.n_kv_heads,
                    g.head_dim,
                    pool.block_size,
                    splits,
                ],
            )?;
            let is_bf16 = i32::from(pool.is_bf16);
            // Decode right behind the kernel that wrote this step's keys (`write_kv`, or the qkv
            // GEMV's rope-write epilogue, both of which trigger at their start): the kernel
            // starts as its programmatic dependent and fetches the older keys meanwhile
            // (attention.cu).
            let prefetch = code_kernel.is_none()
                && (rows_kernel.is_some() || dec_kernel.is_some())
                && self.pdl
                && st.last_write_kv
                && spans.iter().all(|s| s.n_tokens == 1);
            let prefetch_i = i32::from(prefetch);
            let kernel_smem = match (dec_kernel, rows_kernel) {
                _ if parts_kernel.is_some() => parts_smem,
                _ if int8_values.is_some() => variant.map_or(0, |v| v.int8_values_smem_bytes()),
                _ if code_kernel.is_some() => variant.map_or(0, |v| v.smem_bytes()),
                // The pipeline's stages of a 64-key K tile and V tile (rows padded by 8 halves),
                // then the 4 warps' states of 16 × (hd + 2) floats.
                (Some(i), _) => DECODE_VARIANTS[i].smem_bytes(),
                // 4 warps × (32 / (hd / dims per lane)) keys per warp partial states of
                // grp × (hd + 2) floats; 16 dims per lane for up to 4 heads per kv head, else 8.
                (None, Some(i)) => {
                    let partials = 4 * (32 * (16 >> (i % 2)) / hd) * grp * (hd + 2) * 4;
                    // The pipeline's stages of a 32-key K tile and V tile of 16-bit values.
                    let stages = if deep { ATTN_DEEP_STAGES } else { 3 };
                    partials.max(stages * 2 * ATTN_TILE * hd * 2)
                }
                (None, None) => {
                    (grp * hd + ATTN_TILE * (hd + 4) + ATTN_TILE * hd + grp * ATTN_TILE + 3 * grp)
                        * 4
                }
            };
            // The fused merge's split weights and normalisers.
            let smem = kernel_smem.max(grp * (2 * splits + 1) * 4);
            if smem > self.smem_limit {
                return Err(shape(
                    "attention",
                    format!(
                        "needs {smem} bytes of shared memory, the GPU allows {}",
                        self.smem_limit
                    ),
                ));
            }
            let (qp, kp, vp, op) = (
                addr(&qkv.buf, &self.stream),
                addr(&pool.k, &self.stream),
                addr(&pool.v, &self.stream),
                addr(&out.buf, &self.stream),
            );
            let f = match (dec_kernel, rows_kernel) {
                _ if let Some(i) = parts_kernel => &self.k.attn_parts[i],
                _ if int8_values.is_some() => self.k.attn_codes_k8v[int8_values.unwrap_or(0)]
                    .as_ref()
                    .ok_or_else(|| {
                        shape("attention", "no int8-value kernel for these forms".into())
                    })?,
                _ if int8_keys.is_some() => self.k.attn_codes_k8[int8_keys.unwrap_or(0)]
                    .as_ref()
                    .ok_or_else(|| {
                    shape("attention", "no int8-key kernel for these forms".into())
                })?,
                _ if code_kernel.is_some() && keys_as_m => {
                    &self.k.attn_codes_m[code_kernel.unwrap_or(0)]
                }
                _ if code_kernel.is_some() => self.k.attn_codes[code_kernel.unwrap_or(0)]
                    .as_ref()
                    .ok_or_else(|| {
                        shape("attention", "no template kernel at this head_dim".into())
                    })?,
                (Some(i), _) => &self.k.attn_dec[i],
                (None, Some(i)) => &self.k.attn_rows[2 * i + usize::from(deep)],
                (None, None) => {
                    &self.k.attn_partial[match hd {
                        64 => 0,
                        128 => 1,
                        256 => 2,
                        _ => 3,
                    }]
                }
            };
            // Folded exact splits run inside the coded blocks (attention.cu `coded_block_end`):
            // the grid has only the coded splits, the kernel still counts every partial.
            let grid_splits = if self.fold_exact_splits && code_kernel.or(parts_kernel).is_some() {
                splits - exact_splits
            } else {
                splits
            };
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, lg.heads as u32, grid_splits as u32),
                block_dim: (
                    match (code_kernel.or(parts_kernel), dec_kernel) {
                        (Some(_), _) => 32 * CODE_WARPS,
                        (None, Some(i)) => DECODE_VARIANTS[i].threads(),
                        (None, None) => ATTN_THREADS,
                    } as u32,
                    1,
                    1,
                ),
                shared_mem_bytes: smem as u32,
            };
            let mut l = Launches::new(opc::ATTN);
            let a = l
                .kernel("attention", f, cfg, prefetch)
                .ptr(qp)
                .arg(width)
                .arg(nh)
                .arg(nkv)
                .arg(d)
                .arg(g.scale)
                .ptr(meta[0])
                .ptr(meta[1])
                .ptr(meta[2])
                .ptr(meta[3])
                .ptr(kp)
                .ptr(vp)
                .arg(bs)
                .arg(is_bf16)
                .arg(splits_i)
                .ptr(ml)
                .ptr(acc)
                .ptr(counters)
                .ptr(op)
                .ptr(ob)
                .arg(prefetch_i)
                .ptr(sinks);
            if let Some(c) = coded {
                a.ptr(addr(&c.desc, &self.stream) + 4 * lg.desc_offset as u64);
                let ([xk, xv, xt], [sinks, recent, q8, per_split]) = exact_args;
                a.ptr(xk)
                    .ptr(xv)
                    .ptr(xt)
                    .arg(sinks)
                    .arg(recent)
                    .arg(q8)
                    .arg(per_split);
            }
            // Every kernel's last parameter.
            a.arg(window_param(window));
            if let Some(c) = coded.filter(|_| last) {
                self.push_unrotate(&mut l, c, g, rows, op, ob)?;
            }
            let launch = st.admit(l.signature())?;
            st.bf16_of = Some([op, ob, rows as u64, (g.n_heads * hd) as u64]);
            if !launch {
                continue;
            }
            // SAFETY: spans tile the rows and their blocks are inside the pool (checked above; a
            // window only narrows the keys each row reads); sinks, when not null, hold n_heads
            // floats;
            // partial buffers hold rows·n_heads·splits entries and the counters rows·n_kv_heads
            // (zero between launches: the last block of each (row, kv head) resets its own);
            // out holds rows·n_heads·head_dim floats and the bf16 scratch as many halves; smem
            // was checked against the opt-in limit set at load; head_dim % 4 == 0 keeps the
            // 8-byte K/V loads of the tiled kernel and the merge's 16-byte partial loads aligned,
            // head_dim ∈ {64, 128, 256} the 16-byte ones of the row kernel and the decode
            // kernel (64 / 128; its fragment reads stay inside the padded rows).
            // With `prefetch`, the kernel reads nothing the kernel ahead of it writes (the newest
            // key, qkv) before `griddepcontrol.wait`. Coded pools: each (block, kv head) is the
            // descriptor's `total` bytes (built from the pool's layouts), block sizes are
            // powers of two of 16 or more (whole staged runs), head_dim is the kernel's, the group ≤ 16; the
            // un-rotation reads and writes rows·n_heads·head_dim outputs and kv_heads·head_dim
            // centers. A windowed pool's exact table was laid out by the write of these spans
            // (`ExactTokens::prepare`): every exact key of every row has a slot inside the exact
            // blocks, and the exact split reads g·head_dim floats of shared memory (less than the
            // warps' states). A parts pool's kernel reads records and scalars at its descriptor's
            // offsets (built from the pool's layouts; parts of whole 32-code runs keep every
            // record and part 4-byte aligned) with shared memory for its kernel's group ≥ g heads.
            // A launch over one group of a layer with per-head formats reads its heads from the
            // list after its descriptors (one entry per grid row: `lg.heads`).
            unsafe { self.launch(&mut l) }?;
        }
        Ok(())
    }
}

/// One coded attention launch: the format's kernel (`None`: a parts or 16-bit pool), the word
/// offset of its descriptors in the pool's `desc`, and its kv heads.
struct LaunchGroup {
    variant: Option<CodeVariant>,
    desc_offset: usize,
    heads: usize,
}

/// The launches of an attention over `coded` (or a 16-bit pool): one per group of a layer with
/// per-head formats ([`super::codes::HeadGroup`]), else one over all `kv_heads`.
fn launch_groups(coded: Option<&PoolCodes>, kv_heads: usize) -> Vec<LaunchGroup> {
    match coded {
        Some(c) if !c.groups.is_empty() => c
            .groups
            .iter()
            .map(|hg| LaunchGroup {
                variant: Some(hg.variant),
                desc_offset: hg.offset,
                heads: hg.heads.len(),
            })
            .collect(),
        _ => vec![LaunchGroup {
            variant: coded.and_then(|c| c.variant),
            desc_offset: 0,
            heads: kv_heads,
        }],
    }
}

/// The index of `v`'s kernels in [`CodeVariant::all`].
fn kernel_index(v: CodeVariant) -> Result<usize, Error> {
    CodeVariant::all()
        .iter()
        .position(|x| *x == v)
        .ok_or_else(|| shape("attention", format!("no kernel for {v:?}")))
}

impl CudaBackend {
    /// Appends the launch that takes a coded pool's attention output (`op`, and its bf16 copy
    /// `ob`, `rows` rows) back to the original basis where its values were summed rotated or
    /// without their mean.
    fn push_unrotate<'a>(
        &'a self,
        l: &mut Launches<'a>,
        c: &PoolCodes,
        g: &AttnGeometry,
        rows: usize,
        op: u64,
        ob: u64,
    ) -> Result<(), Error> {
        if !(c.values_rotated || c.centers.is_some()) {
            return Ok(());
        }
        let [nh, nkv] = ints("attention", [g.n_heads, g.n_kv_heads])?;
        let (f, desc_words) = match c.variant {
            Some(_) => {
                let fi = CODE_HEAD_DIMS.iter().position(|&d| d == g.head_dim);
                (&self.k.attn_unrotate[fi.unwrap_or(0)], DESC_WORDS)
            }
            None => {
                let fi = PARTS_HEAD_DIMS.iter().position(|&d| d == g.head_dim);
                (
                    &self.k.attn_unrotate_parts[fi.unwrap_or(0)],
                    PARTS_DESC_WORDS,
                )
            }
        };
        let vdesc = addr(&c.desc, &self.stream) + (desc_words * 4) as u64;
        let vc = c.centers.as_ref().map_or(0, |(_, v)| addr(v, &self.stream));
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, g.n_heads as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        l.kernel("attn_unrotate", f, cfg, false)
            .ptr(op)
            .ptr(ob)
            .arg(nh)
            .arg(nkv)
            .ptr(vdesc)
            .ptr(vc);
        Ok(())
    }

    /// Attention of a step with prefill spans over a coded pool, through tensor cores: the
    /// keys each span's rows read from codes (`[max(sinks, first window key), last position −
    /// recent]`, from its first run of 16) are dequantized into f16 rows of a scratch
    /// (`codes_dequant_*`), then `attn_mma_codes_*` runs the tile kernel over them and the
    /// exact blocks (sinks and recent window), and the output is rotated back. Variant `vi`
    /// of [`CodeVariant::all`], or `None` for a parts pool (`codes_dequant_parts_*`); spans,
    /// tables and metadata checked and uploaded by the caller.
    #[allow(clippy::too_many_arguments)]
    fn attention_mma_codes(
        &self,
        qkv: &CudaTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
        pool: &CudaKvPool,
        window: Option<usize>,
        sinks: u64,
        out: &mut CudaTensor,
        vi: Option<usize>,
    ) -> Result<(), Error> {
        let coded = pool
            .codes
            .as_ref()
            .ok_or_else(|| shape("attention", "a 16-bit pool on the coded path".into()))?;
        let no_kernel = || {
            shape(
                "attention",
                "no coded prefill kernel at this head_dim".into(),
            )
        };
        // The dequantizing launches: one per group of kv heads (`launch_groups`).
        let dequants = match vi {
            Some(_) => launch_groups(Some(coded), g.n_kv_heads)
                .into_iter()
                .map(|lg| {
                    let i = kernel_index(lg.variant.ok_or_else(no_kernel)?)?;
                    let f = self.k.codes_dequant.get(i).and_then(Option::as_ref);
                    Ok((f.ok_or_else(no_kernel)?, lg))
                })
                .collect::<Result<Vec<_>, Error>>()?,
            None => {
                let f = PARTS_PREFILL_HEAD_DIMS
                    .iter()
                    .position(|&d| d == g.head_dim)
                    .map(|i| &self.k.codes_dequant_parts[i])
                    .ok_or_else(no_kernel)?;
                vec![(f, launch_groups(Some(coded), g.n_kv_heads).remove(0))]
            }
        };
        let (grp, hd, rows) = (g.group(), g.head_dim, qkv.rows);
        let exact = pool.exact.as_ref();
        let (n_sinks, recent) =
            exact.map_or((0, 0), |x| (x.slots.window.sinks, x.slots.window.recent));
        // Words uploaded together: the tiles (as `attention_mma`'s), each span's scratch base
        // (i32: its first key's row minus that key), then the runs to dequantize (span, first
        // key). A group that does not divide the block's 64 query vectors (the demo model's
        // 3) leaves the last few idle.
        let mut words = prefill_tiles(spans, window, 16 * MMA_CODES_WARPS / grp);
        let n_tiles = words.len() / 2;
        let mut runs = Vec::new();
        let mut keys = 0usize;
        for (si, s) in spans.iter().enumerate() {
            let first = s.first_pos + 1 - keys_seen(s.first_pos, window);
            let lo = first.max(n_sinks) / 16 * 16;
            let hi = (s.first_pos + s.n_tokens).saturating_sub(recent);
            let mut base = 0i64;
            if hi > lo {
                let end = hi.next_multiple_of(16);
                base = keys as i64 - lo as i64;
                for k in (lo..end).step_by(16) {
                    runs.extend([si as u32, k as u32]);
                }
                keys += end - lo;
            }
            let base = i32::try_from(base)
                .map_err(|_| shape("attention", format!("scratch row {base} out of range")))?;
            words.push(base as u32);
        }
        let n_runs = runs.len() / 2;
        words.extend_from_slice(&runs);
        let mut st = self.lock_state("attention")?;
        let sc = st.sc();
        let may_alloc = !sc.defer;
        let ob = addr(
            grow(&self.stream, &mut sc.bf16, rows * g.n_heads * hd, may_alloc)?,
            &self.stream,
        );
        let half = keys.max(1) * g.n_kv_heads * hd;
        let dk = addr(
            grow(&self.stream, &mut sc.code_rows, 2 * half, may_alloc)?,
            &self.stream,
        );
        let dv = dk + 2 * half as u64;
        let tp = addr(sc.upload_tiles(&self.stream, &words)?, &self.stream);
        let bases = tp + 4 * 2 * n_tiles as u64;
        let runs_p = bases + 4 * spans.len() as u64;
        let meta = sc.meta()?.addrs(&self.stream);
        let (xp, [xs, xr], xq) = match exact {
            Some(x) => {
                let table = addr(sc.upload_exact(&self.stream, &x.slots.table)?, &self.stream);
                (
                    [addr(&x.k, &self.stream), addr(&x.v, &self.stream), table],
                    ints("attention", [n_sinks, recent])?,
                    x.q8(),
                )
            }
            None => ([0; 3], [0; 2], 0),
        };
        let [width, nh, nkv, bs] = ints(
            "attention",
            [g.qkv_width(), g.n_heads, g.n_kv_heads, pool.block_size],
        )?;
        let (qp, kp, vp, op) = (
            addr(&qkv.buf, &self.stream),
            addr(&pool.k, &self.stream),
            addr(&pool.v, &self.stream),
            addr(&out.buf, &self.stream),
        );
        let mut l = Launches::new(opc::ATTN_MMA);
        for (dequant, lg) in dequants.iter().filter(|_| n_runs > 0) {
            let fmt = addr(&coded.desc, &self.stream) + 4 * lg.desc_offset as u64;
            let cfg = LaunchConfig {
                grid_dim: (n_runs as u32, lg.heads as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            l.kernel("codes_dequant", dequant, cfg, false)
                .ptr(runs_p)
                .ptr(bases)
                .ptr(meta[2])
                .ptr(meta[3])
                .ptr(kp)
                .ptr(vp)
                .arg(bs)
                .arg(nkv)
                .ptr(fmt)
                .ptr(dk)
                .ptr(dv);
        }
        let cfg = LaunchConfig {
            grid_dim: (n_tiles as u32, g.n_kv_heads as u32, 1),
            block_dim: (32 * MMA_CODES_WARPS as u32, 1, 1),
            shared_mem_bytes: (2 * 2 * MMA_TK * (hd + 8) * 2) as u32,
        };
        l.kernel(
            "attn_mma_codes",
            &self.k.attn_mma_codes[usize::from(hd == 128)],
            cfg,
            false,
        )
        .ptr(qp)
        .arg(width)
        .arg(nh)
        .arg(nkv)
        .arg(g.scale)
        .ptr(meta[0])
        .ptr(meta[1])
        .ptr(bases)
        .ptr(dk)
        .ptr(dv)
        .arg(bs)
        .ptr(tp)
        .ptr(op)
        .ptr(ob)
        .ptr(sinks)
        .ptr(xp[0])
        .ptr(xp[1])
        .ptr(xp[2])
        .arg(xs)
        .arg(xr)
        .arg(xq)
        .arg(EXACT_CHUNK as i32) // the prefill tiles read no exact splits
        .arg(window_param(window));
        self.push_unrotate(&mut l, coded, g, rows, op, ob)?;
        let launch = st.admit(l.signature())?;
        st.bf16_of = Some([op, ob, rows as u64, (g.n_heads * hd) as u64]);
        if !launch {
            return Ok(());
        }
        // SAFETY: every tile lies inside one span (checked against the pool with its
        // tables); each run of 16 keys from a multiple of 16 lies in one pool block (coded
        // pools have power-of-two block sizes of 16 or more), every run's keys and every
        // coded key a tile stages have scratch rows (`base[span] + key` inside the `keys`
        // rows sized above: a tile stages the keys of its rows, which its span's runs
        // cover); the scratch holds K then V, `keys · n_kv · head_dim` halves each; exact
        // keys have slots in the exact table laid out by the write of these spans; head_dim
        // is 64 or 128 (the kernels'); sinks, when not null, hold n_heads floats; out and the
        // bf16 scratch hold rows·n_heads·head_dim values; smem (≤ 35 KiB) is below the
        // opt-in limit.
        unsafe { self.launch(&mut l) }?;
        Ok(())
    }

    /// The decode template instantiation and split count (see [`decode_choice`]).
    fn decode_choice(
        &self,
        head_dim: usize,
        pairs: usize,
        max_ctx: usize,
    ) -> Option<(usize, usize)> {
        decode_choice(
            self.decode_variant,
            &self.decode_slots,
            head_dim,
            pairs,
            max_ctx,
        )
    }
}

/// The decode template instantiation (index of [`DECODE_VARIANTS`]) and split count for `pairs`
/// (row, kv head) pairs over at most `max_ctx` keys of `head_dim`, with `slots[i]` blocks of
/// variant i resident on the GPU at once: `forced` where it has this head_dim; else from the
/// head_dim's [`DECODE_SETS`] entry — `many` from [`MANY_PAIRS`] pairs on, else `few` — and
/// `short` instead where that one's splits come out no longer than [`SHORT_SPLIT_TILES`]
/// tiles (every tile of such a split is then requested at once, instead of one tile's latency
/// after another). `None` where no variant has this head_dim.
pub(super) fn decode_choice(
    forced: Option<DecodeVariant>,
    slots: &[usize],
    head_dim: usize,
    pairs: usize,
    max_ctx: usize,
) -> Option<(usize, usize)> {
    let index = |v: DecodeVariant| DECODE_VARIANTS.iter().position(|w| *w == v);
    let with_splits = |i: usize| {
        let s = wave_splits(pairs, max_ctx, slots[i], DECODE_VARIANTS[i].tile);
        (i, s)
    };
    if let Some(i) = forced.filter(|v| v.head_dim == head_dim).and_then(index) {
        return Some(with_splits(i));
    }
    let set = DECODE_SETS.iter().find(|s| s.few.head_dim == head_dim)?;
    let base = if pairs >= MANY_PAIRS {
        set.many
    } else {
        set.few
    };
    let (i, s) = with_splits(index(base)?);
    if max_ctx.div_ceil(s) <= SHORT_SPLIT_TILES * base.tile {
        return Some(with_splits(index(set.short)?));
    }
    Some((i, s))
}

/// The split count of a decode launch with `pairs` (row, kv head) pairs over at most `max_ctx`
/// keys, when `slots` blocks fit on the GPU at once: the count with the least modelled time,
/// waves × (keys per split + a fixed cost per block), so that the last wave is not a sliver
/// (e.g. 64 pairs on 264 slots: 4 splits, one wave, not 5 splits in 1.2 waves). The key count
/// is rounded up to a power of two first, so the count (part of a replayed graph's launch)
/// changes rarely as a sequence grows. Ties go to fewer splits (less to merge).
pub(super) fn wave_splits(pairs: usize, max_ctx: usize, slots: usize, tile: usize) -> usize {
    let pairs = pairs.max(1);
    let slots = slots.max(1);
    let ctx = max_ctx.max(1).next_power_of_two();
    let most = max_ctx
        .div_ceil(MIN_SPLIT_KEYS)
        .clamp(1, 4 * slots.div_ceil(pairs));
    let cost = |s: usize| {
        let keys = ctx.div_ceil(s).div_ceil(tile) * tile;
        (pairs * s).div_ceil(slots) * (keys + SPLIT_OVERHEAD_KEYS)
    };
    (1..=most).min_by_key(|&s| (cost(s), s)).unwrap_or(1)
}

/// The split count of a launch of an issue-bound coded decode kernel (the int8-product
/// TurboQuant kernels) with `pairs` (row, kv head) pairs over at most `max_ctx` keys, on
/// `sms` SMs holding `slots` blocks at once; `exact`: the launch also has a window's exact
/// splits. Where [`wave_splits`]' splits are long (at least [`SM_LOAD_MAX_SPLIT_KEYS`]), its
/// count stands. Otherwise: the count whose busiest SM finishes first. That SM runs
/// `⌈pairs·s / sms⌉` blocks in waves of as many as stay resident, each block paying
/// [`SM_BLOCK_KEYS`], and each wave's keys cost the [`SM_KEY_COST`] of its own number of
/// blocks, so a last wave of one block is dear. [`wave_splits`] counts each resident block
/// as a whole block's throughput, which these kernels do not get: at b8 × 8k it chose 6
/// splits where 4 ran 15% faster, at b32 × 8k 3 where 1 ran 5–7% faster (a decode step at
/// b32 × 8k: compact 1.4% and tq3 2.2% faster than with the wave model's count; H100,
/// session 49). Key counts are rounded up to a power of two first, as there; ties go to
/// fewer splits.
///
/// With exact splits and at least as many pairs as SMs, the coded blocks alone must fill
/// the GPU's slots: where fewer long coded blocks than slots share the launch with the short
/// exact ones, the SMs that take more of the long ones set its end (compact at b32 × 8k: one
/// coded split 19–33% slower than three, two 4% faster; H100 and H200, sessions 41 and 46).
/// Below that many pairs the count stands as the model gives it (measured there since
/// session 39).
pub(super) fn sm_load_splits(
    pairs: usize,
    max_ctx: usize,
    sms: usize,
    slots: usize,
    tile: usize,
    exact: bool,
) -> usize {
    let wave = wave_splits(pairs, max_ctx, slots, tile);
    let ctx = max_ctx.max(1).next_power_of_two();
    let (pairs, sms) = (pairs.max(1), sms.max(1));
    if ctx.div_ceil(wave) >= SM_LOAD_MAX_SPLIT_KEYS {
        return wave;
    }
    let resident = (slots / sms).clamp(1, SM_KEY_COST.len());
    let most = max_ctx
        .div_ceil(MIN_SPLIT_KEYS)
        .clamp(1, 4 * slots.max(1).div_ceil(pairs));
    let cost = |s: usize| {
        let blocks = (pairs * s).div_ceil(sms);
        let keys = ctx.div_ceil(s).div_ceil(tile) * tile;
        let (waves, rest) = (blocks / resident, blocks % resident);
        let mut key_cost = waves * resident * SM_KEY_COST[resident - 1];
        if rest > 0 {
            key_cost += rest * SM_KEY_COST[rest - 1];
        }
        keys * key_cost / 100 + blocks * SM_BLOCK_KEYS
    };
    let best = (1..=most).min_by_key(|&s| (cost(s), s)).unwrap_or(1);
    if exact && pairs >= sms && pairs * best < slots {
        return slots.div_ceil(pairs).min(most);
    }
    best
}

/// The query tiles of a tensor-core prefill launch as `[first row, rows]` pairs: each span cut
/// into tiles of `rows_per_tile` consecutive rows, the heaviest (most keys read, from the
/// first row's first key to the last row) first: blocks start in grid order, so the last wave
/// is light and the launch ends without a long tail.
fn prefill_tiles(spans: &[SeqSpan<'_>], window: Option<usize>, rows_per_tile: usize) -> Vec<u32> {
    let mut order: Vec<(usize, u32, u32)> = Vec::new();
    for s in spans {
        for i in (0..s.n_tokens).step_by(rows_per_tile) {
            let n = rows_per_tile.min(s.n_tokens - i);
            let keys = keys_seen(s.first_pos + i, window) + n - 1;
            order.push((keys, (s.first_row + i) as u32, n as u32));
        }
    }
    order.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));
    order.iter().flat_map(|&(_, row, n)| [row, n]).collect()
}

/// The largest GQA group of the 16-bit decode kernels at `head_dim`: the template's 16 MMA
/// rows, or the keys-as-M kernels' 8 columns at head_dim 256.
fn dec_max_group(head_dim: usize) -> usize {
    if head_dim == 256 {
        DEC_M_MAX_GROUP
    } else {
        DEC_MAX_GROUP
    }
}

/// Index of the row-parallel attention kernel for a head_dim and group (before the pipeline
/// depth), where one is instantiated.
fn rows_kernel_index(head_dim: usize, group: usize) -> Option<usize> {
    match (head_dim, group) {
        (64, 1..=4) => Some(0),
        (64, 5..=8) => Some(1),
        (128, 1..=4) => Some(2),
        (128, 5..=8) => Some(3),
        (256, 1..=4) => Some(4),
        (256, 5..=8) => Some(5),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{
        DECODE_SETS, DECODE_VARIANTS, MIN_SPLIT_KEYS, SM_LOAD_MAX_SPLIT_KEYS, decode_choice,
        keys_seen, sm_load_splits, wave_splits, window_param,
    };

    #[test]
    fn window_parameter_and_keys_seen() {
        assert_eq!(window_param(None), 0);
        assert_eq!(window_param(Some(512)), 512);
        assert_eq!(window_param(Some(usize::MAX)), i32::MAX);
        assert_eq!(keys_seen(99, None), 100);
        assert_eq!(keys_seen(99, Some(8)), 8);
        assert_eq!(keys_seen(3, Some(8)), 4);
    }

    #[test]
    fn decode_choice_follows_the_sets() {
        // Resident blocks per variant as on an H200 (132 SMs), by shared memory.
        let slots: Vec<usize> = DECODE_VARIANTS
            .iter()
            .map(|v| (227 * 1024 / v.smem_bytes()).min(32 / v.warps.max(1)) * 132)
            .collect();
        let set = DECODE_SETS[1];
        let pick =
            |pairs, ctx| DECODE_VARIANTS[decode_choice(None, &slots, 128, pairs, ctx).unwrap().0];
        // One sequence, 8 kv heads: `few`; many sequences: `many`.
        assert_eq!(pick(8, 32768), set.few);
        assert_eq!(pick(64, 32768), set.many);
        assert_eq!(pick(256, 131072), set.many);
        // Batch 1 at 4k: splits of 2 tiles or fewer take the short-split variant.
        let (i, s) = decode_choice(None, &slots, 128, 8, 4096).unwrap();
        assert_eq!(DECODE_VARIANTS[i], set.short);
        assert!(4096usize.div_ceil(s) <= 2 * set.short.tile.max(set.few.tile));
        // A forced variant is taken where it has the head_dim, ignored elsewhere.
        let forced = set.short;
        assert_eq!(
            DECODE_VARIANTS[decode_choice(Some(forced), &slots, 128, 256, 131072)
                .unwrap()
                .0],
            forced
        );
        assert_eq!(
            DECODE_VARIANTS[decode_choice(Some(forced), &slots, 64, 256, 131072)
                .unwrap()
                .0]
                .head_dim,
            64
        );
        assert!(decode_choice(None, &slots, 96, 8, 4096).is_none());
        // Every set names instantiated variants.
        for s in DECODE_SETS {
            for v in [s.few, s.many, s.short] {
                assert!(DECODE_VARIANTS.contains(&v), "{v:?}");
            }
        }
    }

    #[test]
    fn sm_load_splits_match_the_measured_best_counts() {
        // H100: 132 SMs, three blocks of the int8-value kernels each, 256-key tiles
        // (BENCHMARKS.md, sessions 38–39: the fastest counts of k4v2 and tq3).
        let (sms, slots, tile) = (132, 396, 256);
        for exact in [false, true] {
            assert_eq!(sm_load_splits(8 * 8, 8192, sms, slots, tile, exact), 4);
            assert_eq!(sm_load_splits(8 * 8, 32768, sms, slots, tile, exact), 4);
        }
        // One sequence (8 pairs) at 32k: fewer, longer splits than the wave model's 43.
        assert_eq!(wave_splits(8, 32768, slots, tile), 43);
        assert_eq!(sm_load_splits(8, 32768, sms, slots, tile, false), 16);
        // b32 and b64 at 8k (session 46: k4v2 and tq3 fastest at one split, 5-7% and 2-4%
        // faster than the wave model's three); with a window, one at b64 (7% faster) but two
        // at b32, where one coded block a pair leaves slots to the exact blocks (19% slower).
        assert_eq!(wave_splits(32 * 8, 8192, slots, tile), 3);
        assert_eq!(sm_load_splits(32 * 8, 8192, sms, slots, tile, false), 1);
        assert_eq!(sm_load_splits(64 * 8, 8192, sms, slots, tile, false), 1);
        assert_eq!(sm_load_splits(32 * 8, 8192, sms, slots, tile, true), 2);
        assert_eq!(sm_load_splits(64 * 8, 8192, sms, slots, tile, true), 1);
        // Long splits keep the wave model's count (b32 × 32k: three, the fastest measured).
        for (pairs, ctx) in [
            (32 * 8, 32768),
            (64 * 8, 32768),
            (8 * 8, 131072),
            (4 * 8, 131072),
        ] {
            for exact in [false, true] {
                assert_eq!(
                    sm_load_splits(pairs, ctx, sms, slots, tile, exact),
                    wave_splits(pairs, ctx, slots, tile),
                    "{pairs} pairs, {ctx} keys"
                );
            }
        }
        // A last wave of one block is dear: 100 pairs at 8k in 5 splits would leave the
        // busiest SMs four blocks (three at once, then one alone).
        let s = sm_load_splits(100, 8192, sms, slots, tile, false);
        assert_ne!((100 * s).div_ceil(sms) % 3, 1, "{s} splits");
        // Every choice: at least one split, and no split shorter than MIN_SPLIT_KEYS keys;
        // with exact splits at many pairs, the coded blocks fill the slots where they can.
        for pairs in [1, 3, 8, 24, 64, 100, 132, 256, 1024] {
            for ctx in [1, 64, 1000, 4096, 65536, 131072] {
                for exact in [false, true] {
                    let s = sm_load_splits(pairs, ctx, sms, slots, tile, exact);
                    assert!(s >= 1 && (s == 1 || ctx.div_ceil(s) >= MIN_SPLIT_KEYS));
                    let most = ctx
                        .div_ceil(MIN_SPLIT_KEYS)
                        .clamp(1, 4 * slots.div_ceil(pairs));
                    if exact
                        && pairs >= sms
                        && s < most
                        && ctx.div_ceil(wave_splits(pairs, ctx, slots, tile))
                            < SM_LOAD_MAX_SPLIT_KEYS
                    {
                        assert!(pairs * s >= slots, "{pairs} pairs, {ctx} keys: {s} splits");
                    }
                }
            }
        }
        // Stable while a sequence grows within a power of two.
        assert_eq!(
            sm_load_splits(64, 20_000, sms, slots, tile, false),
            sm_load_splits(64, 32_000, sms, slots, tile, false)
        );
    }

    #[test]
    fn wave_splits_fill_whole_waves() {
        // llama3-8b heads (8 kv) on 132 SMs with 2 blocks each.
        let slots = 264;
        assert_eq!(wave_splits(8 * 8, 32768, slots, 64), 4);
        assert_eq!(wave_splits(32 * 8, 32768, slots, 64), 1);
        let s = wave_splits(8, 8192, slots, 64);
        assert!((32..=33).contains(&s), "{s}");
        // Few keys: never below MIN_SPLIT_KEYS keys per split.
        assert_eq!(wave_splits(8, 100, slots, 64), 2);
        assert_eq!(wave_splits(8, 1, slots, 64), 1);
        // Stable while a sequence grows within a power of two.
        assert_eq!(
            wave_splits(64, 20_000, slots, 64),
            wave_splits(64, 32_000, slots, 64)
        );
        // Every choice puts whole waves to use: blocks ≤ slots, or close to whole waves.
        for pairs in [1, 3, 8, 24, 64, 100, 256, 1024] {
            for ctx in [64, 1000, 4096, 65536, 131072] {
                let s = wave_splits(pairs, ctx, slots, 64);
                assert!(
                    s >= 1 && (s == 1 || ctx.div_ceil(s) >= 32),
                    "{pairs} {ctx} {s}"
                );
                let blocks = pairs * s;
                let waves = blocks.div_ceil(slots);
                assert!(
                    blocks * 10 >= waves * slots * 7 || s == 1 || blocks < slots,
                    "{pairs} {ctx}: {s} splits fill {blocks} of {waves}×{slots}"
                );
            }
        }
    }
}
