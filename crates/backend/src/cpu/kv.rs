//! One layer's paged K/V storage in host memory.
//!
//! Two stores share one addressing scheme, block `b`, kv head `h`:
//! - **16-bit** (`f16`, `bf16`): each of K and V is `[num_blocks, kv_heads, block_size,
//!   head_dim]` raw values, so one head's tokens in a block are contiguous and decode with
//!   one slice conversion;
//! - **codec** (`int8`, `fp8`, `tq*`): each of K and V is `[num_blocks, kv_heads]` blocks laid out
//!   by [`turbokv_codec::BlockLayout`] (codes of every token, then their f16 scalars).
//!   Vectors are encoded straight into their slot; attention reads the codes
//!   (`attention.rs`), never a dequantized copy of the cache.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use std::collections::VecDeque;

use turbokv_cache::{KvLayout, KvWindow, WindowCopies};
use turbokv_codec::{BlockLayout, KvDtype, LayerCodec};

use super::{CpuTensor, shape};
use crate::Error;
use crate::backend::{AttnGeometry, SeqSpan};

/// The element format of a CPU KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvStorage {
    /// IEEE half, raw.
    F16,
    /// bfloat16, raw.
    Bf16,
    /// A codec format (`int8`, `fp8`, TurboQuant), attended over on its codes.
    Codec,
}

impl KvStorage {
    /// The storage for `dtype`, or an error naming what this backend accepts.
    pub fn for_dtype(dtype: KvDtype, head_dim: usize) -> Result<Self, Error> {
        match dtype {
            KvDtype::F16 => Ok(Self::F16),
            KvDtype::Bf16 => Ok(Self::Bf16),
            other if head_dim > MAX_HEAD_DIM => Err(Error::UnsupportedKvDtype {
                dtype: format!("{other} (head dim {head_dim} > {MAX_HEAD_DIM})"),
                backend: "cpu",
                accepted: "f16, bf16 for head dims above 1024",
            }),
            other => {
                // Build a codec once to validate (head dim support, widths).
                LayerCodec::new(other, head_dim, 0, &Default::default()).map_err(|e| {
                    Error::UnsupportedKvDtype {
                        dtype: format!("{other} ({e})"),
                        backend: "cpu",
                        accepted: "f16, bf16, int8, fp8, tq{b}, tq{b}.5, k{b}v{b}",
                    }
                })?;
                Ok(Self::Codec)
            }
        }
    }
}

/// Largest head dimension a compressed pool accepts (the centering scratch lives on the stack).
pub(crate) const MAX_HEAD_DIM: usize = 1024;

/// Compressed K and V blocks with their codecs.
#[derive(Debug)]
pub(crate) struct CodecStore {
    pub(crate) codec: LayerCodec,
    pub(crate) k_layout: BlockLayout,
    pub(crate) v_layout: BlockLayout,
    k: Vec<u8>,
    v: Vec<u8>,
    /// Tokens attended at f16 instead of from the codes.
    pub(crate) window: KvWindow,
    /// This layer's per-head mean key and value (`[kv_heads, head_dim]` each), subtracted
    /// before encoding (see [`turbokv_cache::KvCenters`]); attention adds the value mean back.
    centers: Option<(Vec<f32>, Vec<f32>)>,
    /// The exact copies of K and V of blocks that may still hold sink or recent-window
    /// tokens. Blocks that fall wholly behind every future query's window are dropped on
    /// write, so this holds at most about `sequences × (recent / block_size + sink blocks + 2)`
    /// blocks after prefill.
    shadow: Shadows,
    /// Per-head codecs and block layouts where the layer's heads differ in dtype
    /// ([`turbokv_cache::LayerKv::head_dtypes`]); `None` = every head uses `codec`.
    pub(crate) heads: Option<Vec<HeadCodec>>,
    /// Bytes of one (block, head) of K and of V: the widest head's layout, so (block `b`,
    /// head `h`) starts at `(b · kv_heads + h) · stride` whatever the heads' widths.
    k_stride: usize,
    v_stride: usize,
}

/// One kv head's codecs and block layouts.
#[derive(Debug)]
pub(crate) struct HeadCodec {
    pub(crate) codec: LayerCodec,
    pub(crate) k_layout: BlockLayout,
    pub(crate) v_layout: BlockLayout,
}

impl CodecStore {
    /// The codecs and block layouts of kv head `head`.
    pub(crate) fn head(&self, head: usize) -> (&LayerCodec, &BlockLayout, &BlockLayout) {
        head_codec(
            &self.heads,
            (&self.codec, &self.k_layout, &self.v_layout),
            head,
        )
    }
}

/// Head `head`'s entry of `heads`, or the layer's own codec and layouts.
fn head_codec<'a>(
    heads: &'a Option<Vec<HeadCodec>>,
    own: (&'a LayerCodec, &'a BlockLayout, &'a BlockLayout),
    head: usize,
) -> (&'a LayerCodec, &'a BlockLayout, &'a BlockLayout) {
    match heads {
        Some(hs) => (&hs[head].codec, &hs[head].k_layout, &hs[head].v_layout),
        None => own,
    }
}

/// Whether two codecs of a layer bring vectors into the same working basis (whole TurboQuant
/// widths share the layer's rotation; fractional ones rotate two parts apart): compared on
/// one probe vector.
fn same_basis(a: &LayerCodec, b: &LayerCodec) -> Result<bool, Error> {
    let d = a.key.head_dim();
    let probe: Vec<f32> = (0..d).map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0).collect();
    let work = |c: &turbokv_codec::VectorCodec| -> Result<Vec<f32>, Error> {
        let mut out = vec![0f32; c.work_dim()];
        c.query_to_work(&probe, &mut out)?;
        Ok(out)
    };
    Ok(work(&a.key)? == work(&b.key)? && work(&a.value)? == work(&b.value)?)
}

/// The blocks' exact K and V: rounded to f16 and then brought into the codec's working basis
/// once, when written — not at every read, where the rotation of each window token cost more
/// than reading thousands of codes. The rotated vectors are kept as f16 bits again
/// (native-endian, as the 16-bit pool's values; a second rounding, by at most 2⁻¹¹ of each
/// working coordinate), or with [`WindowCopies::Int8`] as int8 with an f16 step each, so
/// decode reads them as [`super::direct::Fmt::F16`] or `Int8` pages at 2 or 1 bytes a
/// coordinate instead of 4: the window's bytes, not its arithmetic, set its cost beside the
/// codes.
///
/// A block's copies take a slot (a [`CopySlot`]) of each kv head's two byte slabs (`k[h]` of
/// the key work dim, `v[h]` of the value work dim), found through a table indexed by physical
/// block: decode looks a block up once per (block, kv head) of the window, and a hash map's
/// probe, cold after a step's weights went through the caches, cost more there than reading
/// the copies. Freed slots are reused oldest first, so a decoding sequence's window
/// blocks take the slots in turn, and one head's window lies mostly in order in memory, as
/// the prefetchers like.
#[derive(Debug)]
struct Shadows {
    /// Slot + 1 of each physical block's copies, 0 for none.
    slot_of: Vec<u32>,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    /// How a slot of `k` and of `v` is laid out.
    shape: (CopySlot, CopySlot),
    free: VecDeque<u32>,
    /// Slots allocated, and those held by a block.
    slots: usize,
    held: usize,
}

impl Shadows {
    fn new(num_blocks: usize, kv_heads: usize, shape: (CopySlot, CopySlot)) -> Self {
        Shadows {
            slot_of: vec![0; num_blocks],
            k: vec![Vec::new(); kv_heads],
            v: vec![Vec::new(); kv_heads],
            shape,
            free: VecDeque::new(),
            slots: 0,
            held: 0,
        }
    }

    /// Blocks with copies.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held
    }

    fn slot(&self, block: usize) -> Option<usize> {
        match self.slot_of.get(block) {
            Some(&s) if s > 0 => Some(s as usize - 1),
            _ => None,
        }
    }

    /// Head `head`'s copies of `block` (a block's tokens each), if it has them.
    fn get(&self, block: usize, head: usize) -> Option<(CopyRun<'_>, CopyRun<'_>)> {
        let s = self.slot(block)?;
        let (sk, sv) = self.shape;
        Some((
            sk.run(&self.k[head][s * sk.bytes()..][..sk.bytes()]),
            sv.run(&self.v[head][s * sv.bytes()..][..sv.bytes()]),
        ))
    }

    /// The slot of `block`'s copies, taken (and zeroed) when it had none.
    fn slot_or_insert(&mut self, block: usize) -> usize {
        if let Some(s) = self.slot(block) {
            return s;
        }
        let (pk, pv) = (self.shape.0.bytes(), self.shape.1.bytes());
        let s = match self.free.pop_front() {
            Some(s) => s as usize,
            None => {
                self.slots += 1;
                self.slots - 1
            }
        };
        for (slab, per) in self
            .k
            .iter_mut()
            .map(|k| (k, pk))
            .chain(self.v.iter_mut().map(|v| (v, pv)))
        {
            if slab.len() < (s + 1) * per {
                slab.resize((s + 1) * per, 0);
            } else {
                slab[s * per..][..per].fill(0);
            }
        }
        self.slot_of[block] = u32::try_from(s + 1).expect("fewer slots than blocks");
        self.held += 1;
        s
    }

    /// Head `head`'s copies of slot `s`.
    fn slot_mut(&mut self, s: usize, head: usize) -> (&mut [u8], &mut [u8]) {
        let (pk, pv) = (self.shape.0.bytes(), self.shape.1.bytes());
        (
            &mut self.k[head][s * pk..][..pk],
            &mut self.v[head][s * pv..][..pv],
        )
    }

    /// Drops `block`'s copies; false when it had none. The last block's drop gives the slabs'
    /// memory back: they keep their peak size while any block holds copies, not after.
    fn remove(&mut self, block: usize) -> bool {
        let Some(s) = self.slot(block) else {
            return false;
        };
        self.slot_of[block] = 0;
        self.held -= 1;
        if self.held == 0 {
            self.free = VecDeque::new();
            self.slots = 0;
            for slab in self.k.iter_mut().chain(self.v.iter_mut()) {
                *slab = Vec::new();
            }
        } else {
            self.free.push_back(s as u32);
        }
        true
    }

    /// Bytes the slabs hold allocated.
    #[cfg(test)]
    fn capacity_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(Vec::capacity).sum()
    }
}

/// f16 values converted at a time through a stack buffer (the slices' SIMD conversion).
const F16_CHUNK: usize = 64;

/// The layout of one slot of a head's copies: `rows` records of `width` working coordinates,
/// as f16 (`2·width` bytes a record), or as int8 (`width` bytes) followed by each record's f16
/// step.
#[derive(Clone, Copy, Debug)]
struct CopySlot {
    copies: WindowCopies,
    rows: usize,
    width: usize,
}

impl CopySlot {
    /// Bytes of a record.
    fn stride(self) -> usize {
        record_bytes(self.copies, self.width)
    }

    /// Bytes of the slot.
    fn bytes(self) -> usize {
        match self.copies {
            WindowCopies::F16 => self.rows * self.stride(),
            WindowCopies::Int8 => self.rows * (self.stride() + 2),
        }
    }

    /// The slot's bytes as a run of its records.
    fn run(self, slot: &[u8]) -> CopyRun<'_> {
        let (records, steps) = slot.split_at(self.rows * self.stride());
        CopyRun {
            copies: self.copies,
            width: self.width,
            records,
            steps,
        }
    }

    /// Stores `x` (`width` working coordinates) as record `row` of `slot`.
    fn write(self, slot: &mut [u8], row: usize, x: &[f32]) {
        let stride = self.stride();
        let (records, steps) = slot.split_at_mut(self.rows * stride);
        let rec = &mut records[row * stride..][..stride];
        match self.copies {
            WindowCopies::F16 => {
                // Through a word buffer: the slice conversion runs in SIMD, a value at a time
                // does not (prefill writes every token's copies).
                let mut words = [0u16; F16_CHUNK];
                for (d, x) in rec.chunks_mut(2 * F16_CHUNK).zip(x.chunks(F16_CHUNK)) {
                    let w = &mut words[..x.len()];
                    w.reinterpret_cast_mut::<f16>().convert_from_f32_slice(x);
                    for (d, w) in d.chunks_exact_mut(2).zip(w.iter()) {
                        d.copy_from_slice(&w.to_ne_bytes());
                    }
                }
            }
            WindowCopies::Int8 => {
                let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                // The step is stored in f16, so the codes are taken against the stored value;
                // a zero (or non-finite) vector is stored as zero codes.
                let step = f16::from_f32(max / 127.0);
                let s = step.to_f32();
                let live = s > 0.0 && s.is_finite();
                for (d, &v) in rec.iter_mut().zip(x) {
                    let c = if live {
                        (v / s).round().clamp(-127.0, 127.0)
                    } else {
                        0.0
                    };
                    *d = (c as i8) as u8;
                }
                steps[2 * row..2 * row + 2].copy_from_slice(&step.to_le_bytes());
            }
        }
    }
}

/// Bytes of a copy of `width` working coordinates (without an int8 record's step).
fn record_bytes(copies: WindowCopies, width: usize) -> usize {
    match copies {
        WindowCopies::F16 => 2 * width,
        WindowCopies::Int8 => width,
    }
}

/// Consecutive records of a head's copies (see [`CopySlot`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyRun<'a> {
    /// How the records are stored.
    pub(crate) copies: WindowCopies,
    /// Working coordinates a record.
    pub(crate) width: usize,
    /// The records: f16 bits (native-endian), or int8.
    pub(crate) records: &'a [u8],
    /// Each int8 record's step, f16 little-endian (empty for f16 records).
    pub(crate) steps: &'a [u8],
}

impl<'a> CopyRun<'a> {
    /// Bytes of a record.
    pub(crate) fn stride(&self) -> usize {
        record_bytes(self.copies, self.width)
    }

    /// Records `rows` of the run.
    pub(crate) fn rows(&self, rows: std::ops::Range<usize>) -> CopyRun<'a> {
        let stride = self.stride();
        let steps = match self.copies {
            WindowCopies::F16 => &self.steps[..0],
            WindowCopies::Int8 => &self.steps[2 * rows.start..2 * rows.end],
        };
        CopyRun {
            records: &self.records[rows.start * stride..rows.end * stride],
            steps,
            ..*self
        }
    }

    /// Records in the run.
    pub(crate) fn len(&self) -> usize {
        self.records.len() / self.stride().max(1)
    }

    /// The records widened to f32 into `out` (`len() · width`).
    pub(crate) fn widen(&self, out: &mut Vec<f32>) {
        out.resize(self.len() * self.width, 0.0);
        match self.copies {
            WindowCopies::F16 => {
                // Through a word buffer, as in `CopySlot::write`: the tiled path widens a
                // block's copies for every task that reads them.
                let mut words = [0u16; F16_CHUNK];
                for (d, b) in out
                    .chunks_mut(F16_CHUNK)
                    .zip(self.records.chunks(2 * F16_CHUNK))
                {
                    let w = &mut words[..d.len()];
                    for (w, b) in w.iter_mut().zip(b.chunks_exact(2)) {
                        *w = u16::from_ne_bytes([b[0], b[1]]);
                    }
                    w.reinterpret_cast::<f16>().convert_to_f32_slice(d);
                }
            }
            WindowCopies::Int8 => {
                let rows = out.chunks_exact_mut(self.width);
                for ((row, rec), st) in rows
                    .zip(self.records.chunks_exact(self.width))
                    .zip(self.steps.chunks_exact(2))
                {
                    let step = f16::from_le_bytes([st[0], st[1]]).to_f32();
                    for (d, &c) in row.iter_mut().zip(rec) {
                        *d = f32::from(c as i8) * step;
                    }
                }
            }
        }
    }
}

#[derive(Debug)]
enum Store {
    Raw16 {
        storage: KvStorage,
        k: Vec<u16>,
        v: Vec<u16>,
    },
    Codec(Box<CodecStore>),
}

/// K and V blocks of one attention layer.
#[derive(Debug)]
pub struct CpuKvPool {
    kv_heads: usize,
    block_size: usize,
    head_dim: usize,
    num_blocks: usize,
    store: Store,
}

/// Which half of the cache.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Half {
    K,
    V,
}

impl crate::KvPoolBlocks for CpuKvPool {
    fn release_blocks(&mut self, blocks: &[u32]) {
        if let Store::Codec(c) = &mut self.store {
            for b in blocks {
                c.shadow.remove(*b as usize);
            }
        }
    }
}

impl CpuKvPool {
    /// Allocates layer `layer` of `layout`.
    pub fn new(layout: &KvLayout, layer: usize) -> Result<Self, Error> {
        let lk = layout.layers.get(layer).ok_or_else(|| {
            shape(
                "kv_pool",
                format!("layer {layer} of {}", layout.layers.len()),
            )
        })?;
        let storage = KvStorage::for_dtype(lk.dtype, layout.head_dim)?;
        let blocks = layout.num_blocks * layout.kv_heads;
        let overflow = || Error::SizeOverflow {
            rows: layout.num_blocks,
            cols: layout.block_elements(),
        };
        let store = match storage {
            KvStorage::F16 | KvStorage::Bf16 => {
                let len = layout
                    .num_blocks
                    .checked_mul(layout.block_elements())
                    .ok_or_else(overflow)?;
                Store::Raw16 {
                    storage,
                    k: vec![0; len],
                    v: vec![0; len],
                }
            }
            KvStorage::Codec => {
                let codec = LayerCodec::new(
                    lk.dtype,
                    layout.head_dim,
                    layer as u32,
                    &layout.codec_options(layer),
                )?;
                let k_layout = codec.key.block_layout(layout.block_size)?;
                let v_layout = codec.value.block_layout(layout.block_size)?;
                let own = &codec;
                let heads = if lk.head_dtypes.is_empty() {
                    None
                } else {
                    let opts = layout.codec_options(layer);
                    let one = |d: KvDtype| -> Result<HeadCodec, Error> {
                        let codec = LayerCodec::new(d, layout.head_dim, layer as u32, &opts)?;
                        // Queries and window copies are rotated once for every head.
                        if !same_basis(&codec, own)? {
                            return Err(shape(
                                "kv_pool",
                                format!(
                                    "layer {layer}: head dtype {d} has another working basis \
                                     than the layer's {}",
                                    lk.dtype
                                ),
                            ));
                        }
                        Ok(HeadCodec {
                            k_layout: codec.key.block_layout(layout.block_size)?,
                            v_layout: codec.value.block_layout(layout.block_size)?,
                            codec,
                        })
                    };
                    Some(
                        (0..layout.kv_heads)
                            .map(|h| one(lk.head_dtype(h)))
                            .collect::<Result<Vec<_>, _>>()?,
                    )
                };
                let widest = |own: usize, of: fn(&HeadCodec) -> usize| {
                    heads.iter().flatten().map(of).fold(own, usize::max)
                };
                let k_stride = widest(k_layout.total_bytes, |h| h.k_layout.total_bytes);
                let v_stride = widest(v_layout.total_bytes, |h| h.v_layout.total_bytes);
                let k_len = blocks.checked_mul(k_stride).ok_or_else(overflow)?;
                let v_len = blocks.checked_mul(v_stride).ok_or_else(overflow)?;
                let centers = match &layout.centers {
                    None => None,
                    Some(c) => Some(
                        c.layer_means(layer, layout.kv_heads, layout.head_dim)
                            .map_err(|e| shape("kv centers", e.to_string()))?,
                    ),
                };
                // One slot of a head's copies: a block's tokens, in the working bases.
                let slot = |width| CopySlot {
                    copies: layout.window.copies,
                    rows: layout.block_size,
                    width,
                };
                let shadow_shape = (slot(codec.key.work_dim()), slot(codec.value.work_dim()));
                Store::Codec(Box::new(CodecStore {
                    codec,
                    centers,
                    k_layout,
                    v_layout,
                    k: vec![0; k_len],
                    v: vec![0; v_len],
                    window: layout.window,
                    shadow: Shadows::new(layout.num_blocks, layout.kv_heads, shadow_shape),
                    heads,
                    k_stride,
                    v_stride,
                }))
            }
        };
        Ok(Self {
            kv_heads: layout.kv_heads,
            block_size: layout.block_size,
            head_dim: layout.head_dim,
            num_blocks: layout.num_blocks,
            store,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The codec store, when this pool is compressed.
    pub(crate) fn codec(&self) -> Option<&CodecStore> {
        match &self.store {
            Store::Codec(c) => Some(c),
            Store::Raw16 { .. } => None,
        }
    }

    fn raw_offset(&self, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.kv_heads + head) * self.block_size + slot) * self.head_dim
    }

    /// Physical block holding position `pos` of a sequence, bounds-checked.
    pub(crate) fn block_of(&self, blocks: &[u32], pos: usize) -> Result<usize, Error> {
        let b = *blocks.get(pos / self.block_size).ok_or_else(|| {
            shape(
                "kv",
                format!(
                    "position {pos} beyond the block table ({} blocks)",
                    blocks.len()
                ),
            )
        })? as usize;
        if b >= self.num_blocks {
            return Err(shape(
                "kv",
                format!("block {b} outside the pool of {}", self.num_blocks),
            ));
        }
        Ok(b)
    }

    /// Stores k and v of every token of `spans` (rows of `qkv`, already roped).
    pub(crate) fn store(
        &mut self,
        qkv: &CpuTensor,
        g: &AttnGeometry,
        spans: &[SeqSpan<'_>],
    ) -> Result<(), Error> {
        if g.n_kv_heads != self.kv_heads || g.head_dim != self.head_dim {
            return Err(shape(
                "kv store",
                format!(
                    "geometry {g:?} vs pool {} heads × {}",
                    self.kv_heads, self.head_dim
                ),
            ));
        }
        let d = self.head_dim;
        // A window copy in the working basis before its f16 rounding (work dim ≤ 2 · head dim).
        let mut work = Vec::new();
        for s in spans {
            for i in 0..s.n_tokens {
                let pos = s.first_pos + i;
                let block = self.block_of(s.blocks, pos)?;
                let slot = pos % self.block_size;
                let row = qkv.row(s.first_row + i);
                for h in 0..self.kv_heads {
                    let k = &row[(g.n_heads + h) * d..][..d];
                    let v = &row[(g.n_heads + g.n_kv_heads + h) * d..][..d];
                    let at = self.raw_offset(block, h, slot);
                    match &mut self.store {
                        Store::Raw16 {
                            storage,
                            k: kb,
                            v: vb,
                        } => {
                            encode16(*storage, k, &mut kb[at..at + d]);
                            encode16(*storage, v, &mut vb[at..at + d]);
                        }
                        Store::Codec(c) => {
                            let (mut kc, mut vc) = ([0f32; MAX_HEAD_DIM], [0f32; MAX_HEAD_DIM]);
                            let (k, v) = match &c.centers {
                                None => (k, v),
                                Some((mk, mv)) => {
                                    let (kc, vc) = (&mut kc[..d], &mut vc[..d]);
                                    let (mk, mv) = (&mk[h * d..][..d], &mv[h * d..][..d]);
                                    kc.iter_mut()
                                        .zip(k.iter().zip(mk))
                                        .for_each(|(o, (x, m))| *o = x - m);
                                    vc.iter_mut()
                                        .zip(v.iter().zip(mv))
                                        .for_each(|(o, (x, m))| *o = x - m);
                                    (&*kc, &*vc)
                                }
                            };
                            let bi = block * self.kv_heads + h;
                            let (kl, vl) = (c.k_stride, c.v_stride);
                            let cs = &mut **c;
                            let own = (&cs.codec, &cs.k_layout, &cs.v_layout);
                            let (codec, k_layout, v_layout) = head_codec(&cs.heads, own, h);
                            codec.key.encode_slot(
                                k,
                                &mut cs.k[bi * kl..][..k_layout.total_bytes],
                                k_layout,
                                slot,
                            )?;
                            codec.value.encode_slot(
                                v,
                                &mut cs.v[bi * vl..][..v_layout.total_bytes],
                                v_layout,
                                slot,
                            )?;
                            if c.window.is_active() {
                                let cs = &mut **c;
                                let (wk, wv) = (cs.codec.key.work_dim(), cs.codec.value.work_dim());
                                let at = cs.shadow.slot_or_insert(block);
                                let (shape_k, shape_v) = cs.shadow.shape;
                                let (sk, sv) = cs.shadow.slot_mut(at, h);
                                let mut rounded = [0f32; MAX_HEAD_DIM];
                                let rounded = &mut rounded[..d];
                                round_to_f16(k, rounded);
                                work.resize(wk.max(wv), 0.0);
                                cs.codec.key.exact_to_work(rounded, &mut work[..wk])?;
                                shape_k.write(sk, slot, &work[..wk]);
                                round_to_f16(v, rounded);
                                cs.codec.value.exact_to_work(rounded, &mut work[..wv])?;
                                shape_v.write(sv, slot, &work[..wv]);
                            }
                        }
                    }
                }
            }
            if let Store::Codec(c) = &mut self.store {
                c.prune(s, self.block_size);
            }
        }
        Ok(())
    }

    /// Appends block `block`'s bytes to `out`: per kv head, the key block then the value
    /// block (16-bit values little-endian). Refused for a pool with a full-precision window:
    /// its exact copies are not part of the bytes, so a restored block would attend
    /// differently.
    pub fn export_block(&self, block: usize, out: &mut Vec<u8>) -> Result<(), Error> {
        self.check_block_io("export_block", block)?;
        for h in 0..self.kv_heads {
            for half in [Half::K, Half::V] {
                match &self.store {
                    Store::Raw16 { k, v, .. } => {
                        let at = self.raw_offset(block, h, 0);
                        let src = match half {
                            Half::K => &k[at..at + self.block_size * self.head_dim],
                            Half::V => &v[at..at + self.block_size * self.head_dim],
                        };
                        out.extend(src.iter().flat_map(|x| x.to_le_bytes()));
                    }
                    Store::Codec(_) => out.extend_from_slice(self.codec_block(half, block, h)),
                }
            }
        }
        Ok(())
    }

    /// Overwrites block `block` with bytes in [`Self::export_block`]'s order.
    pub fn import_block(&mut self, block: usize, bytes: &[u8]) -> Result<(), Error> {
        self.check_block_io("import_block", block)?;
        let (kv_heads, bs, d) = (self.kv_heads, self.block_size, self.head_dim);
        let per_head = match &self.store {
            Store::Raw16 { .. } => 4 * bs * d,
            Store::Codec(c) => c.k_layout.total_bytes + c.v_layout.total_bytes,
        };
        if bytes.len() != per_head * kv_heads {
            return Err(shape(
                "import_block",
                format!(
                    "{} bytes, the block holds {}",
                    bytes.len(),
                    per_head * kv_heads
                ),
            ));
        }
        for (h, src) in bytes.chunks_exact(per_head).enumerate() {
            let at = ((block * kv_heads + h) * bs) * d;
            match &mut self.store {
                Store::Raw16 { k, v, .. } => {
                    let (ks, vs) = src.split_at(2 * bs * d);
                    for (dst, s) in [(&mut k[at..at + bs * d], ks), (&mut v[at..at + bs * d], vs)] {
                        for (o, b) in dst.iter_mut().zip(s.chunks_exact(2)) {
                            *o = u16::from_le_bytes([b[0], b[1]]);
                        }
                    }
                }
                Store::Codec(c) => {
                    let (kl, vl) = (c.k_layout.total_bytes, c.v_layout.total_bytes);
                    let bi = block * kv_heads + h;
                    c.k[bi * kl..(bi + 1) * kl].copy_from_slice(&src[..kl]);
                    c.v[bi * vl..(bi + 1) * vl].copy_from_slice(&src[kl..]);
                }
            }
        }
        Ok(())
    }

    fn check_block_io(&self, op: &'static str, block: usize) -> Result<(), Error> {
        if block >= self.num_blocks {
            return Err(shape(
                op,
                format!("block {block} outside the pool of {}", self.num_blocks),
            ));
        }
        if let Store::Codec(c) = &self.store {
            if c.window.is_active() {
                return Err(Error::Unsupported {
                    op,
                    why: "a cache with a full-precision window keeps exact copies outside its \
                          blocks",
                });
            }
            if c.heads.is_some() {
                return Err(Error::Unsupported {
                    op,
                    why: "block snapshots hold one dtype a layer; this layer's heads differ",
                });
            }
        }
        Ok(())
    }

    /// The exact K and V copies of tokens `slots` of (block, head), in the codec's working
    /// basis, when the block has them. A block's copy covers all of its slots or none of them.
    pub(crate) fn exact_run(
        &self,
        block: usize,
        head: usize,
        slots: std::ops::Range<usize>,
    ) -> Option<(CopyRun<'_>, CopyRun<'_>)> {
        let Store::Codec(c) = &self.store else {
            return None;
        };
        let (k, v) = c.shadow.get(block, head)?;
        Some((k.rows(slots.clone()), v.rows(slots)))
    }

    /// Decodes tokens `slots` of (block, head) of a 16-bit pool into `out`
    /// (`slots.len() · head_dim`). Codec pools are read through [`Self::codec_block`] instead.
    pub(crate) fn load(
        &self,
        half: Half,
        block: usize,
        head: usize,
        slots: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let at = self.raw_offset(block, head, slots.start);
        let len = slots.len() * self.head_dim;
        if let Store::Raw16 { storage, k, v } = &self.store {
            let src = match half {
                Half::K => &k[at..at + len],
                Half::V => &v[at..at + len],
            };
            decode16(*storage, src, &mut out[..len]);
        }
    }

    /// The element format of this pool.
    pub(crate) fn storage(&self) -> KvStorage {
        match &self.store {
            Store::Raw16 { storage, .. } => *storage,
            Store::Codec(_) => KvStorage::Codec,
        }
    }

    /// K and V of `slots` of `block` (kv head `head`) into `keys` / `values` in the keys' and
    /// values' working basis: the stored 16-bit values, or the codes decoded tile-wise.
    pub(crate) fn load_tile(
        &self,
        block: usize,
        head: usize,
        slots: std::ops::Range<usize>,
        keys: &mut [f32],
        values: &mut [f32],
    ) -> Result<(), Error> {
        match self.codec() {
            None => {
                self.load(Half::K, block, head, slots.clone(), keys);
                self.load(Half::V, block, head, slots, values);
            }
            Some(c) => {
                let (codec, kl, vl) = c.head(head);
                let kb = &self.codec_block(Half::K, block, head)[..kl.total_bytes];
                codec.key.decode_tile(kb, kl, slots.clone(), keys)?;
                let vb = &self.codec_block(Half::V, block, head)[..vl.total_bytes];
                codec.value.decode_tile(vb, vl, slots, values)?;
            }
        }
        Ok(())
    }

    /// The bytes of (block, head) of K or V in a codec pool (empty for a 16-bit pool).
    pub(crate) fn codec_block(&self, half: Half, block: usize, head: usize) -> &[u8] {
        if !matches!(self.store, Store::Codec(_)) {
            return &[];
        }
        let (bytes, per) = self.half_bytes(half);
        let at = head_block_offset(self.kv_heads, per, block, head);
        &bytes[at..at + per]
    }

    /// All of K's or V's storage as bytes (16-bit values native-endian), and the bytes of one
    /// (block, kv head): the bytes of (block `b`, head `h`) start at `(b · kv_heads + h) ·
    /// per`, for computing many pages' offsets without a lookup each.
    pub(crate) fn half_bytes(&self, half: Half) -> (&[u8], usize) {
        match &self.store {
            Store::Raw16 { k, v, .. } => {
                let src = match half {
                    Half::K => k,
                    Half::V => v,
                };
                (
                    super::direct::u16_bytes(src),
                    2 * self.block_size * self.head_dim,
                )
            }
            Store::Codec(c) => match half {
                Half::K => (&c.k, c.k_stride),
                Half::V => (&c.v, c.v_stride),
            },
        }
    }

    /// KV heads per block.
    pub(crate) fn kv_heads(&self) -> usize {
        self.kv_heads
    }
}

impl CodecStore {
    /// The mean value of `head` that attention adds back to its output, if centered.
    pub(crate) fn value_center(&self, head: usize, head_dim: usize) -> Option<&[f32]> {
        self.centers
            .as_ref()
            .map(|(_, v)| &v[head * head_dim..(head + 1) * head_dim])
    }

    /// Drops the shadows of `s`'s blocks that no query from this span on can read exactly:
    /// every position in them is past the sinks and before the window of the span's first
    /// query (later queries' windows only move forward).
    fn prune(&mut self, s: &SeqSpan<'_>, block_size: usize) {
        if !self.window.is_active() {
            return;
        }
        // The first query reads exactly from position `first_pos + 1 - recent` on.
        let lo = (s.first_pos + 1).saturating_sub(self.window.recent.max(1));
        let first_dead = self.window.sinks.div_ceil(block_size);
        let end_dead = lo / block_size;
        // Blocks die in position order and every call drops all of its dead ones, so the scan
        // runs from the newest dead block down and stops at the first one already gone: one
        // or two lookups per decode step instead of one per block of the context.
        for &b in s
            .blocks
            .get(first_dead..end_dead)
            .unwrap_or(&[])
            .iter()
            .rev()
        {
            if !self.shadow.remove(b as usize) {
                break;
            }
        }
    }
}

fn encode16(storage: KvStorage, src: &[f32], dst: &mut [u16]) {
    match storage {
        KvStorage::Bf16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16::from_f32(s).to_bits();
            }
        }
        _ => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f16::from_f32(s).to_bits();
            }
        }
    }
}

/// `src` rounded to f16 (the precision of a window's exact copies), into `dst`.
fn round_to_f16(src: &[f32], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(s).to_f32();
    }
}

/// Where (block, kv head `head`) starts in a half's storage ([`CpuKvPool::half_bytes`]) of
/// `per` bytes per (block, kv head).
#[inline]
pub(crate) fn head_block_offset(kv_heads: usize, per: usize, block: usize, head: usize) -> usize {
    (block * kv_heads + head) * per
}

fn decode16(storage: KvStorage, src: &[u16], dst: &mut [f32]) {
    match storage {
        KvStorage::Bf16 => src.reinterpret_cast::<bf16>().convert_to_f32_slice(dst),
        _ => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shadows held after writing `chunks` (token counts) of one sequence into a windowed
    /// tq3 pool, after each chunk.
    fn shadows_after(window: KvWindow, chunks: &[usize]) -> Vec<usize> {
        let (heads, d, bs) = (1, 64, 16);
        let total: usize = chunks.iter().sum();
        let mut layout =
            KvLayout::uniform(1, heads, d, "tq3".parse::<KvDtype>().unwrap(), bs, total).unwrap();
        layout.window = window;
        let mut pool = CpuKvPool::new(&layout, 0).unwrap();
        let blocks: Vec<u32> = (0..total.div_ceil(bs) as u32).rev().collect();
        let g = AttnGeometry {
            n_heads: 1,
            n_kv_heads: heads,
            head_dim: d,
            scale: 0.125,
        };
        let (mut pos, mut held) = (0, Vec::new());
        for &n in chunks {
            let qkv = CpuTensor::from_vec(vec![0.5; n * 3 * d], n, 3 * d).unwrap();
            let span = SeqSpan {
                first_row: 0,
                n_tokens: n,
                first_pos: pos,
                blocks: &blocks,
            };
            pool.store(&qkv, &g, &[span]).unwrap();
            pos += n;
            let Store::Codec(c) = &pool.store else {
                unreachable!()
            };
            held.push(c.shadow.len());
        }
        held
    }

    #[test]
    fn shadows_behind_the_window_are_dropped_as_decode_moves_on() {
        let window = KvWindow {
            recent: 20,
            sinks: 1,
            ..Default::default()
        };
        // A prefill in two chunks, then 150 single-token steps.
        let mut chunks = vec![100, 60];
        chunks.extend([1; 150]);
        let held = shadows_after(window, &chunks);
        // The sink's block, the blocks the next queries' 20-token window can reach (at most
        // three of 16), and the block being written.
        let bound = 1 + 20usize.div_ceil(16) + 2;
        for (i, &h) in held.iter().enumerate() {
            assert!(
                h <= bound.max(chunks[i].div_ceil(16) + 3),
                "step {i}: {h} shadows"
            );
        }
        assert!(*held.last().unwrap() <= bound, "{held:?}");
        // Without sinks the first block goes too.
        let held = shadows_after(
            KvWindow {
                recent: 5,
                sinks: 0,
                ..Default::default()
            },
            &chunks,
        );
        assert!(*held.last().unwrap() <= 2, "{held:?}");
    }

    #[test]
    fn released_sequences_give_the_window_copies_memory_back() {
        let (heads, d, bs, n) = (2, 64, 16, 100);
        let mut layout = KvLayout::uniform(
            1,
            heads,
            d,
            "tq3".parse::<KvDtype>().unwrap(),
            bs,
            2 * (n + bs),
        )
        .unwrap();
        layout.window = KvWindow {
            recent: 40,
            sinks: 1,
            ..Default::default()
        };
        let mut pool = CpuKvPool::new(&layout, 0).unwrap();
        let g = AttnGeometry {
            n_heads: heads,
            n_kv_heads: heads,
            head_dim: d,
            scale: 0.125,
        };
        let per_seq = n.div_ceil(bs) as u32;
        let tables: Vec<Vec<u32>> = (0..2)
            .map(|i| (i * per_seq..(i + 1) * per_seq).collect())
            .collect();
        let qkv =
            CpuTensor::from_vec(vec![0.25; 2 * n * 3 * heads * d], 2 * n, 3 * heads * d).unwrap();
        let spans: Vec<SeqSpan<'_>> = tables
            .iter()
            .enumerate()
            .map(|(i, blocks)| SeqSpan {
                first_row: i * n,
                n_tokens: n,
                first_pos: 0,
                blocks,
            })
            .collect();
        pool.store(&qkv, &g, &spans).unwrap();
        let shadow = |pool: &CpuKvPool| match &pool.store {
            Store::Codec(c) => (c.shadow.len(), c.shadow.capacity_bytes()),
            _ => unreachable!(),
        };
        let (held, bytes) = shadow(&pool);
        assert!(held > 0 && bytes > 0, "{held} blocks, {bytes} bytes");
        // One sequence ends: its copies go, the other's stay readable where they were.
        crate::KvPoolBlocks::release_blocks(&mut pool, &tables[0]);
        let (left, kept) = shadow(&pool);
        assert!(
            left > 0 && left < held && kept == bytes,
            "{left} of {held}, {kept} bytes"
        );
        let last = *tables[1].last().unwrap() as usize;
        assert!(pool.exact_run(last, 0, 0..(n % bs)).is_some());
        // The last one ends: nothing is held any more.
        crate::KvPoolBlocks::release_blocks(&mut pool, &tables[1]);
        assert_eq!(shadow(&pool), (0, 0));
        // And a new sequence takes copies again.
        pool.store(&qkv, &g, &spans[..1]).unwrap();
        assert!(shadow(&pool).0 > 0);
    }
}
