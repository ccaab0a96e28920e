//! Coded KV pools on the GPU (`int8`, `fp8`, TurboQuant-MSE `tq{2,3,4}` and mixed `k{b}v{b}`): the
//! format descriptors the kernels read, and what a coded pool holds beside its bytes.
//!
//! A coded pool stores every (physical block, kv head) in the codec's block layout
//! ([`turbokv_codec::layout`]) with each token's code record rearranged where that unpacks
//! faster ([`RecordLayout`]); block I/O converts records back, so blocks and snapshots move
//! between the backends unchanged. The encoder (`write_kv_codes`, write_kv.cu) reproduces the
//! codec's f32 operations in order, so the codes are the CPU's; attention reads the codes
//! (`attn_codes_*`, attention.cu) with the query rotated into the keys' basis by the encoder
//! launch and the output rotated back by `attn_unrotate` (write_kv.cu).

use cudarc::driver::{CudaSlice, CudaStream};
use half::f16;
use turbokv_cache::KvLayout;
use turbokv_codec::{BlockLayout, DeviceFormat, DeviceParts, KvDtype, LayerCodec, VectorCodec};

use super::code_layout::RecordLayout;
use super::cuda_err;
use super::parts;
use crate::Error;

/// u32 words of one role's format descriptor (write_kv.cu `CODE_DESC_WORDS`; a multiple of
/// four, so that both roles' descriptors stay 16-byte aligned).
pub(crate) const DESC_WORDS: usize = 320;
/// The descriptor word that is 1 when a TurboQuant role stores corrected norms (write_kv.cu
/// `CODE_CORRECTED_WORD`); its f32 centroids follow it.
pub(crate) const CORRECTED_WORD: usize = 300;
/// The word of the first group's key descriptor that holds, for a layer with per-head formats,
/// the word offset of its head table (write_kv.cu `CODE_HEAD_TABLE_WORD`; [`HeadGroup`]).
pub(crate) const HEAD_TABLE_WORD: usize = 319;
/// Keys per staged tile of the coded decode kernels (attention.cu `ATTN_CODES`).
pub(crate) const CODE_TILE: usize = 128;
/// Shared memory of one int8-value kernel block with four per SM (attention.cu
/// `V8_BLOCK_SMEM`): a quarter of an SM's 228 KiB less the 1 KiB each block reserves.
const V8_BLOCK_SMEM: usize = 57344;
/// Warps per block of the coded decode kernels.
pub(crate) const CODE_WARPS: usize = 4;
/// The largest GQA group (query heads per kv head) of the keys-as-M coded kernels (the 8
/// columns of their MMAs); larger groups take the template's kernels.
pub(crate) const KEYS_AS_M_MAX_GROUP: usize = 8;
/// The largest GQA group the coded kernels take at `head_dim`: the template's 16 MMA rows, or
/// the keys-as-M kernels' 8 columns above [`CODE_TEMPLATE_MAX_HEAD_DIM`].
pub(crate) fn coded_max_group(head_dim: usize) -> usize {
    if head_dim <= CODE_TEMPLATE_MAX_HEAD_DIM {
        16
    } else {
        KEYS_AS_M_MAX_GROUP
    }
}
/// Shared memory of a windowed pool's exact split (attention.cu `attn_exact_split`): the
/// group's pre-scaled f32 queries and one chunk of 32 keys' f16 K and V rows.
fn exact_split_smem_bytes(head_dim: usize) -> usize {
    4 * head_dim * coded_max_group(head_dim) + 2 * 32 * head_dim * 2
}
/// The descriptor word where a TurboQuant role's int8 codebook starts (attention.cu
/// `INT8_TABLE_WORD`): four words of table bytes, then 1/α as f32 bits ([`int8_table`]).
/// The rotation's sign masks from word 32 end before it.
pub(crate) const INT8_TABLE_WORD: usize = 288;
/// Where 4-bit records' two one-sided int8 tables start (attention.cu `INT8_PAIR_WORD`; four
/// words, [`int8_pair_words`]).
pub(crate) const INT8_PAIR_WORD: usize = 296;
/// The descriptor word where a TurboQuant role's int8 value codebook starts (attention.cu
/// `INT8_VALUE_WORD`): two words of table bytes, then the step as f32 bits
/// ([`int8_value_words`]).
pub(crate) const INT8_VALUE_WORD: usize = 293;
/// Tile bytes a coded kernel keeps in flight (attention.cu `code_stages`).
const CODE_BYTES_IN_FLIGHT: usize = 49152;

/// Pipeline stages of a coded kernel whose tiles are `tile_bytes` (attention.cu
/// `code_stages`): enough for [`CODE_BYTES_IN_FLIGHT`], 2 to 6. The bytes in flight bound a
/// streaming kernel's bandwidth, and a tile of codes is 2-5× smaller than a 16-bit one.
fn code_stages(tile_bytes: usize) -> usize {
    CODE_BYTES_IN_FLIGHT.div_ceil(tile_bytes).clamp(2, 6)
}

/// Head dims with coded kernels.
pub(crate) const CODE_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// The largest head dim with the template's coded kernels (any GQA group up to 16); above it
/// only the keys-as-M kernels exist (groups up to [`KEYS_AS_M_MAX_GROUP`]).
pub(crate) const CODE_TEMPLATE_MAX_HEAD_DIM: usize = 128;
/// How one role's codes are read by a kernel: one byte per coordinate (int8, fp8) or
/// TurboQuant-MSE codes of 2-4 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CodeForm {
    Int8,
    Fp8,
    Mse(u8),
}

impl CodeForm {
    /// The form a device format is read in.
    pub(crate) fn of(f: &DeviceFormat) -> CodeForm {
        match f {
            DeviceFormat::Int8 => CodeForm::Int8,
            DeviceFormat::Fp8 => CodeForm::Fp8,
            DeviceFormat::HadamardMse(h) => CodeForm::Mse(h.bits),
        }
    }

    /// Bits per coordinate.
    pub(crate) fn bits(self) -> u8 {
        match self {
            CodeForm::Int8 | CodeForm::Fp8 => 8,
            CodeForm::Mse(b) => b,
        }
    }

    /// The form's part of a kernel name (attention.cu's `KB`/`VB` tokens: `8` int8, `f8` fp8).
    fn tag(self) -> String {
        match self {
            CodeForm::Fp8 => "f8".into(),
            f => f.bits().to_string(),
        }
    }
}

/// Code forms of (keys, values) the kernels are instantiated for (int8 and fp8 pair only
/// with themselves), in attention.cu's `ATTN_CODES_D` order.
const CODE_FORMS: [(CodeForm, CodeForm); 11] = {
    use CodeForm::{Fp8, Int8, Mse};
    [
        (Int8, Int8),
        (Fp8, Fp8),
        (Mse(4), Mse(4)),
        (Mse(4), Mse(3)),
        (Mse(4), Mse(2)),
        (Mse(3), Mse(4)),
        (Mse(3), Mse(3)),
        (Mse(3), Mse(2)),
        (Mse(2), Mse(4)),
        (Mse(2), Mse(3)),
        (Mse(2), Mse(2)),
    ]
};

/// One coded decode kernel: head dim and the code forms of keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CodeVariant {
    pub head_dim: usize,
    pub key: CodeForm,
    pub value: CodeForm,
}

impl CodeVariant {
    /// Every instantiated kernel, in a fixed order (the index of [`Kernels::attn_codes`]).
    pub(crate) fn all() -> Vec<CodeVariant> {
        CODE_HEAD_DIMS
            .iter()
            .flat_map(|&head_dim| {
                CODE_FORMS.iter().map(move |&(key, value)| CodeVariant {
                    head_dim,
                    key,
                    value,
                })
            })
            .collect()
    }

    /// The kernel's name in attention.cu: the template's (`attn_codes_*`, any GQA group up
    /// to 16) or, with `keys_as_m`, the kernel with the keys as the MMAs' rows
    /// (`attn_codes_m_*`, groups up to [`KEYS_AS_M_MAX_GROUP`]).
    pub(crate) fn kernel_name(&self, keys_as_m: bool) -> String {
        format!(
            "attn_codes_{}{}_{}_{}",
            if keys_as_m { "m_" } else { "" },
            self.head_dim,
            self.key.tag(),
            self.value.tag()
        )
    }

    /// Whether the template's kernel (`kernel_name(false)`) is instantiated: head dims up to
    /// [`CODE_TEMPLATE_MAX_HEAD_DIM`] (attention.cu `ATTN_CODES_FORMS`).
    pub(crate) fn has_template(&self) -> bool {
        self.head_dim <= CODE_TEMPLATE_MAX_HEAD_DIM
    }

    /// Whether prefill spans take the tensor-core path (`codes_dequant_*`, then
    /// `attn_mma_codes_*`): the tile kernel's head dims, 64 and 128.
    pub(crate) fn has_prefill(&self) -> bool {
        matches!(self.head_dim, 64 | 128)
    }

    /// Whether the kernel with int8 key products (`int8_keys_name`) is instantiated:
    /// TurboQuant keys and values at head_dim 64 or 128 (attention.cu `ATTN_CODES_TQ_FORMS`).
    pub(crate) fn has_int8_keys(&self) -> bool {
        matches!(self.head_dim, 64 | 128)
            && matches!((self.key, self.value), (CodeForm::Mse(_), CodeForm::Mse(_)))
    }

    /// The name of its keys-as-M kernel with int8 key products (attention.cu
    /// `ATTN_CODES_K8`; groups up to [`KEYS_AS_M_MAX_GROUP`]).
    pub(crate) fn int8_keys_name(&self) -> String {
        format!(
            "attn_codes_k8_{}_{}_{}",
            self.head_dim,
            self.key.tag(),
            self.value.tag()
        )
    }

    /// Whether the kernel with int8 key and value products (`int8_values_name`) is
    /// instantiated: those of [`has_int8_keys`](Self::has_int8_keys) with 2- or 3-bit values
    /// (attention.cu `ATTN_CODES_V8_FORMS`).
    pub(crate) fn has_int8_values(&self) -> bool {
        self.has_int8_keys()
            && matches!(self.value, CodeForm::Mse(2 | 3))
            && matches!(self.key, CodeForm::Mse(2..=4))
    }

    /// The name of its kernel with int8 key and value products (attention.cu
    /// `ATTN_CODES_K8V`).
    pub(crate) fn int8_values_name(&self) -> String {
        format!(
            "attn_codes_k8v_{}_{}_{}",
            self.head_dim,
            self.key.tag(),
            self.value.tag()
        )
    }

    /// The name of its dequantization kernel (attention.cu `CODES_DEQUANT`).
    pub(crate) fn dequant_name(&self) -> String {
        format!(
            "codes_dequant_{}_{}_{}",
            self.head_dim,
            self.key.tag(),
            self.value.tag()
        )
    }

    /// The largest GQA group its kernels take ([`coded_max_group`]).
    pub(crate) fn max_group(&self) -> usize {
        coded_max_group(self.head_dim)
    }

    /// Threads per block.
    pub(crate) fn threads(&self) -> usize {
        32 * CODE_WARPS
    }

    /// Dynamic shared memory: the pipeline's K and V tiles (code records and scales) and the
    /// int8-key kernels' query fragments after them (16 bytes per lane per 32 dims), the
    /// warps' final states or an exact split's rows, whichever is largest (the launch takes
    /// the larger of this and the merge's).
    pub(crate) fn smem_bytes(&self) -> usize {
        let tile = self.tile_bytes(CODE_TILE);
        self.smem_for(code_stages(tile) * tile)
    }

    /// Keys per tile and pipeline stages of the int8-value kernel (`int8_values_name`;
    /// attention.cu `v8_tile`, `v8_stages`): 256-key tiles (64 per warp, so the per-tile
    /// softmax reductions, u8 scale and int32 epilogue are paid once per 64 keys) where two
    /// stages of them fit a block with four per SM, else 128; stages as [`code_stages`] but
    /// no more than fit.
    pub(crate) fn int8_values_tiling(&self) -> (usize, usize) {
        let fit = |keys| (V8_BLOCK_SMEM - self.head_dim * 16) / self.tile_bytes(keys);
        let keys = if fit(256) >= 2 { 256 } else { CODE_TILE };
        (keys, code_stages(self.tile_bytes(keys)).min(fit(keys)))
    }

    /// [`smem_bytes`](Self::smem_bytes) of the int8-value kernel.
    pub(crate) fn int8_values_smem_bytes(&self) -> usize {
        let (keys, stages) = self.int8_values_tiling();
        self.smem_for(stages * self.tile_bytes(keys))
    }

    /// Bytes of a tile of `keys` keys: code records and scales of K and V.
    fn tile_bytes(&self, keys: usize) -> usize {
        let row = |f: CodeForm| self.head_dim * usize::from(f.bits()) / 8 + 2;
        keys * (row(self.key) + row(self.value))
    }

    fn smem_for(&self, stage_bytes: usize) -> usize {
        (stage_bytes + self.head_dim * 16)
            .max(CODE_WARPS * 16 * (self.head_dim + 2) * 4)
            .max(exact_split_smem_bytes(self.head_dim))
    }
}

/// What a coded pool holds beside its bytes.
#[derive(Debug)]
pub(crate) struct PoolCodes {
    /// The decode kernel on this pool's codes, or `None` for a parts pool
    /// ([`super::parts`]: dequantized, then attended by the tile kernel).
    pub variant: Option<CodeVariant>,
    /// Whether values are TurboQuant (the output is rotated back).
    pub values_rotated: bool,
    /// How key and value code records are arranged (the codec's layout or a GPU one).
    pub k_records: RecordLayout,
    pub v_records: RecordLayout,
    /// Block layouts of keys and values (bytes per (block, kv head)).
    pub k_layout: BlockLayout,
    pub v_layout: BlockLayout,
    /// The key then the value descriptor, [`DESC_WORDS`] each.
    pub desc: CudaSlice<u32>,
    /// Per-head mean key and value (`[kv_heads, head_dim]` each), subtracted before encoding.
    pub centers: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// A layer with per-head formats ([`turbokv_cache::LayerKv::head_dtypes`]): its kv heads
    /// grouped by format, the first group's the one the fields above describe. Empty: every
    /// head in that one format.
    pub groups: Vec<HeadGroup>,
}

/// The kv heads of one format in a layer with per-head formats. Each group's attention is its
/// own launch of that format's kernels over just its heads (attention.cu `coded_kv_head`),
/// and one write launch encodes every head with its group's descriptors (write_kv.cu). All
/// groups share the layer's rotation, so queries are rotated and outputs rotated back once.
///
/// `desc` then holds, per group, a record of [`DESC_WORDS`] key words, as many value words
/// and the group's heads (padded to a multiple of four words), then a table of each kv
/// head's record offset, whose own offset is word [`HEAD_TABLE_WORD`] of the first record.
/// Every (block, kv head) of the pool is as wide as the widest group's, and each group's
/// descriptors give that width as their block bytes.
#[derive(Debug)]
pub(crate) struct HeadGroup {
    /// The group's decode kernel.
    pub variant: CodeVariant,
    /// Word offset of its record in `desc`.
    pub offset: usize,
    /// Its kv heads, ascending.
    pub heads: Vec<u32>,
}

impl PoolCodes {
    /// Rewrites the code records of one (block, kv head)'s key and value blocks (the codec's
    /// block layout) from the GPU record layouts into the codec's (`to_codec`) or back.
    pub(crate) fn convert_records(&self, k: &mut [u8], v: &mut [u8], to_codec: bool) {
        // A parts pool keeps the codec's records.
        let Some(variant) = self.variant else { return };
        let roles = [
            (k, self.k_records, &self.k_layout, variant.key.bits()),
            (v, self.v_records, &self.v_layout, variant.value.bits()),
        ];
        for (block, records, layout, bits) in roles {
            let end = layout.block_size * layout.code_bytes_per_token;
            for rec in block[..end].chunks_exact_mut(layout.code_bytes_per_token) {
                if to_codec {
                    records.to_codec(bits, rec);
                } else {
                    records.to_device(bits, rec);
                }
            }
        }
    }
}

/// Code width of one role's device format (8 for int8 and fp8).
fn width(f: &DeviceFormat) -> u8 {
    CodeForm::of(f).bits()
}

/// Codes per kernel lane run of each role (the unit of [`RecordLayout`]): keys are read in
/// runs of `head_dim / 4` codes, values in runs of `head_dim / 8` (attention.cu `KvCodes`).
pub(crate) fn runs(head_dim: usize) -> (usize, usize) {
    (head_dim / 4, head_dim / 8)
}

/// The record layout of one role in a GPU pool.
pub(crate) fn record_layout(f: &DeviceFormat, run: usize) -> RecordLayout {
    RecordLayout::for_role(width(f), run)
}

/// The descriptor words of one role (write_kv.cu documents them), whose codes are read in
/// runs of `run`.
pub(crate) fn descriptor(
    f: &DeviceFormat,
    layout: &BlockLayout,
    run: usize,
) -> Result<Vec<u32>, Error> {
    let mut w = vec![0u32; DESC_WORDS];
    let too_large = || Error::Cuda {
        op: "kv pool",
        detail: format!("a block of {} bytes is too large", layout.total_bytes),
    };
    w[2] = u32::try_from(layout.code_bytes_per_token).map_err(|_| too_large())?;
    w[3] = u32::try_from(layout.total_bytes).map_err(|_| too_large())?;
    w[4] = u32::try_from(layout.scalars_offset).map_err(|_| too_large())?;
    let record = record_layout(f, run);
    w[5] = record.descriptor_word();
    match f {
        DeviceFormat::Int8 => {
            w[0] = 0;
            w[1] = 8;
        }
        DeviceFormat::Fp8 => {
            w[0] = 2;
            w[1] = 8;
        }
        DeviceFormat::HadamardMse(h) => {
            if h.sign_masks.len() > INT8_TABLE_WORD - 32 || h.boundaries.len() > 15 {
                return Err(Error::Cuda {
                    op: "kv pool",
                    detail: format!(
                        "{}-bit codes of dimension {} do not fit a descriptor",
                        h.bits,
                        h.sign_masks.len()
                    ),
                });
            }
            w[0] = 1;
            w[1] = u32::from(h.bits);
            w[6] = h.sigma.to_bits();
            w[7] = h.scale.to_bits();
            for (k, b) in h.boundaries.iter().enumerate() {
                w[8 + k] = b.to_bits();
            }
            // Centroid j as f16: low byte j of the table at word 24, high byte at word 28
            // (sign-magnitude records: the 8 positive centroids, magnitude m at j = m).
            let table = match record {
                RecordLayout::SignMagnitude4 => &h.centroids[8..],
                _ => &h.centroids[..],
            };
            for (j, c) in table.iter().enumerate() {
                let bits = f16::from_f32(*c).to_bits();
                w[24 + j / 4] |= u32::from(bits & 0xff) << (8 * (j % 4));
                w[28 + j / 4] |= u32::from(bits >> 8) << (8 * (j % 4));
            }
            w[32..32 + h.sign_masks.len()].copy_from_slice(&h.sign_masks);
            // Sign-magnitude records: magnitudes and their negatives, and the one-sided pair
            // that the int8-key kernels look up; the others the signed centroids.
            // (At most 126 for the pair's |c| + 1.)
            let sign_magnitude = record == RecordLayout::SignMagnitude4;
            let (bytes, inv_alpha) = int8_table(table, if sign_magnitude { 126 } else { 127 });
            let neg = bytes.map(|b| (b as i8).wrapping_neg() as u8);
            for (i, q) in bytes.chunks_exact(4).chain(neg.chunks_exact(4)).enumerate() {
                w[INT8_TABLE_WORD + i] = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
            }
            w[INT8_TABLE_WORD + 4] = inv_alpha.to_bits();
            if sign_magnitude {
                w[INT8_PAIR_WORD..INT8_PAIR_WORD + 4].copy_from_slice(&int8_pair_words(&bytes));
            }
            if h.centroids.len() <= 8 {
                let (tables, step) = int8_value_words(&h.centroids);
                w[INT8_VALUE_WORD..INT8_VALUE_WORD + 2].copy_from_slice(&tables);
                w[INT8_VALUE_WORD + 2] = step.to_bits();
            }
            // The encoder's exact centroids for `n / ‖c[idx]‖` (the f16 tables above are the
            // attention's).
            if h.corrected {
                w[CORRECTED_WORD] = 1;
                for (j, c) in h.centroids.iter().enumerate() {
                    w[CORRECTED_WORD + 1 + j] = c.to_bits();
                }
            }
        }
    }
    Ok(w)
}

/// The two one-sided tables of 4-bit sign-magnitude key records (attention.cu
/// `Codes<4>::int8_pair`) from their 8 magnitudes as int8 bytes (at most 126): the first holds
/// -|c_m| at byte 7 - m (looked up by the stored nibble 8·pos | 7 - m; a positive code gets the
/// byte's sign, -1, instead), the second |c_m| + 1 at byte m (looked up by the complemented
/// nibble; a negative code gets its sign, 0), so their sum is ±|c_m|. A magnitude of 0 has
/// sign 0 in the first table, so the second holds 0 for it.
fn int8_pair_words(mags: &[u8; 8]) -> [u32; 4] {
    let (mut neg, mut pos) = ([0u8; 8], [0u8; 8]);
    for (m, &b) in mags.iter().enumerate() {
        neg[7 - m] = (b as i8).wrapping_neg() as u8;
        pos[m] = if b == 0 { 0 } else { b + 1 };
    }
    let word = |b: &[u8; 8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    [word(&neg, 0), word(&neg, 4), word(&pos, 0), word(&pos, 4)]
}

/// The int8 value codebook of at most 8 signed centroids (attention.cu
/// `keys_as_m_values_s8`): byte j is `round(c[j] / step)` (halves away from zero) with
/// `step = max|c| / 127`, the CPU backend's int8 value table (cpu/direct_vnni.rs
/// `Codebook::signed`), so both backends sum the same centroids; then the step.
pub(crate) fn int8_value_words(centroids: &[f32]) -> ([u32; 2], f32) {
    let max = centroids.iter().fold(0f32, |m, c| m.max(c.abs()));
    if !(max.is_finite() && max > 0.0) {
        return ([0; 2], 0.0);
    }
    let step = max / 127.0;
    let mut b = [0u8; 8];
    for (b, &c) in b.iter_mut().zip(centroids) {
        let y = c / step;
        *b = ((y + 0.5f32.copysign(y)) as i32).clamp(-127, 127) as i8 as u8;
    }
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    ([word(0), word(4)], step)
}

/// A codebook of at most 8 centroids as int8 bytes for the kernels with int8 key products
/// (attention.cu `attn_codes_k8_*`): byte j is `round(α·c[j])`, and the kernel multiplies by the
/// returned 1/α. α puts the largest centroid between 96 and `max_byte` (≤ 127), where the
/// rounding's mean square error over the table is least: every centroid moves by at most half a
/// step, 0.5/96 of the largest (0.5%; unit test below).
pub(crate) fn int8_table(centroids: &[f32], max_byte: u8) -> ([u8; 8], f32) {
    let cmax = centroids.iter().fold(0f32, |m, c| m.max(c.abs()));
    if cmax == 0.0 || !cmax.is_finite() {
        return ([0; 8], 1.0);
    }
    let mse = |alpha: f32| {
        centroids
            .iter()
            .map(|&c| ((alpha * c).round() / alpha - c).powi(2))
            .sum::<f32>()
    };
    const STEPS: u32 = 1024;
    let alpha = (0..=STEPS)
        .map(|i| (96.0 + (f32::from(max_byte) - 96.0) * i as f32 / STEPS as f32) / cmax)
        .min_by(|a, b| mse(*a).total_cmp(&mse(*b)))
        .unwrap_or(f32::from(max_byte) / cmax);
    let mut bytes = [0u8; 8];
    for (b, &c) in bytes.iter_mut().zip(centroids) {
        *b = (alpha * c).round() as i8 as u8;
    }
    (bytes, 1.0 / alpha)
}

/// How a layer's codec is read on the GPU.
enum Route {
    /// Decode kernels on the codes (int8, fp8, whole widths 2-4 with MSE keys, exact or
    /// corrected norms).
    Direct(DeviceFormat, DeviceFormat),
    /// The parts kernels ([`super::parts`]): any other TurboQuant format with Hadamard
    /// rotations (fractional widths, prod keys, 1-bit codes; corrected norms with them).
    Parts(DeviceParts, DeviceParts),
}

/// The route of `codec` at `head_dim`, or why there is none.
fn route(codec: &LayerCodec, head_dim: usize) -> Result<Route, String> {
    let direct = |c: &VectorCodec| c.device_format().filter(|f| width(f) >= 2);
    if let (Some(k), Some(v)) = (direct(&codec.key), direct(&codec.value)) {
        if !CODE_HEAD_DIMS.contains(&head_dim) {
            return Err(format!(
                "head_dim {head_dim} (coded pools have kernels for head_dim {CODE_HEAD_DIMS:?})"
            ));
        }
        return Ok(Route::Direct(k, v));
    }
    match (codec.key.device_parts(), codec.value.device_parts()) {
        (Some(k), Some(v)) => {
            for p in [&k, &v] {
                if let Some(why) = parts::unsupported(p, head_dim) {
                    return Err(why);
                }
            }
            Ok(Route::Parts(k, v))
        }
        _ => Err(format!(
            "head_dim {head_dim}: only int8, fp8 and TurboQuant with Hadamard rotations (head_dim \
             a power of two) and the structured QJL sketch are read on the GPU"
        )),
    }
}

/// Why a dtype has no coded kernel, or `None` when it has one (at `head_dim`).
pub(crate) fn unsupported_reason(dtype: KvDtype, head_dim: usize) -> Option<String> {
    let codec = match LayerCodec::new(dtype, head_dim, 0, &Default::default()) {
        Ok(c) => c,
        Err(e) => return Some(e.to_string()),
    };
    route(&codec, head_dim).err()
}

/// One format of a layer as the GPU reads it: its kernel, record arrangements, block layouts
/// and route.
struct Format {
    variant: Option<CodeVariant>,
    values_rotated: bool,
    k_records: RecordLayout,
    v_records: RecordLayout,
    k_layout: BlockLayout,
    v_layout: BlockLayout,
    route: Route,
}

impl Format {
    /// `dtype` at layer `layer` of `layout` (the layer's codec options).
    fn new(layout: &KvLayout, layer: usize, dtype: KvDtype) -> Result<Format, Error> {
        let refuse = |why: String| refusal(dtype, why);
        let codec = LayerCodec::new(
            dtype,
            layout.head_dim,
            u32::try_from(layer).unwrap_or(u32::MAX),
            &layout.codec_options(layer),
        )
        .map_err(|e| refuse(e.to_string()))?;
        let route = route(&codec, layout.head_dim).map_err(refuse)?;
        let k_layout = codec
            .key
            .block_layout(layout.block_size)
            .map_err(|e| refuse(e.to_string()))?;
        let v_layout = codec
            .value
            .block_layout(layout.block_size)
            .map_err(|e| refuse(e.to_string()))?;
        let (variant, values_rotated, k_records, v_records) = match &route {
            Route::Direct(kf, vf) => {
                let variant = CodeVariant {
                    head_dim: layout.head_dim,
                    key: CodeForm::of(kf),
                    value: CodeForm::of(vf),
                };
                if !CodeVariant::all().contains(&variant) {
                    return Err(refuse(
                        "int8 and fp8 keys pair only with values of the same format".into(),
                    ));
                }
                let (k_run, v_run) = runs(layout.head_dim);
                (
                    Some(variant),
                    matches!(vf, DeviceFormat::HadamardMse(_)),
                    record_layout(kf, k_run),
                    record_layout(vf, v_run),
                )
            }
            Route::Parts(..) => (None, true, RecordLayout::Codec, RecordLayout::Codec),
        };
        Ok(Format {
            variant,
            values_rotated,
            k_records,
            v_records,
            k_layout,
            v_layout,
            route,
        })
    }

    /// The key then the value descriptor, with blocks of `k_total` / `v_total` bytes per
    /// (block, kv head).
    fn descriptors(
        &self,
        head_dim: usize,
        k_total: usize,
        v_total: usize,
    ) -> Result<Vec<u32>, Error> {
        let k_layout = BlockLayout {
            total_bytes: k_total,
            ..self.k_layout
        };
        let v_layout = BlockLayout {
            total_bytes: v_total,
            ..self.v_layout
        };
        Ok(match &self.route {
            Route::Direct(kf, vf) => {
                let (k_run, v_run) = runs(head_dim);
                let mut words = descriptor(kf, &k_layout, k_run)?;
                words.extend(descriptor(vf, &v_layout, v_run)?);
                words
            }
            Route::Parts(kp, vp) => {
                let mut words = parts::parts_descriptor(kp, &k_layout)?;
                words.extend(parts::parts_descriptor(vp, &v_layout)?);
                words
            }
        })
    }
}

fn refusal(dtype: KvDtype, why: String) -> Error {
    Error::UnsupportedKvDtype {
        dtype: format!("{dtype} ({why})"),
        backend: "cuda",
        accepted: ACCEPTED,
    }
}

/// A layer's descriptor words before upload: its first format (head 0's), the bytes of a
/// (block, kv head) for keys and values, and, for per-head formats, the groups.
struct LayerDescriptors {
    first: Format,
    k_total: usize,
    v_total: usize,
    words: Vec<u32>,
    groups: Vec<HeadGroup>,
}

/// The coded state of layer `layer` of `layout` (its dtype compressed), uploaded.
pub(crate) fn pool_codes(
    stream: &std::sync::Arc<CudaStream>,
    layout: &KvLayout,
    layer: usize,
) -> Result<PoolCodes, Error> {
    let LayerDescriptors {
        first,
        k_total,
        v_total,
        words,
        groups,
    } = layer_descriptors(layout, layer)?;
    let desc = stream.clone_htod(&words).map_err(cuda_err("upload"))?;
    let centers = match &layout.centers {
        None => None,
        Some(c) => {
            let (k, v) = c
                .layer_means(layer, layout.kv_heads, layout.head_dim)
                .map_err(|e| crate::shape::shape("kv centers", e.to_string()))?;
            Some((
                stream.clone_htod(&k).map_err(cuda_err("upload"))?,
                stream.clone_htod(&v).map_err(cuda_err("upload"))?,
            ))
        }
    };
    Ok(PoolCodes {
        variant: first.variant,
        values_rotated: first.values_rotated,
        k_records: first.k_records,
        v_records: first.v_records,
        k_layout: BlockLayout {
            total_bytes: k_total,
            ..first.k_layout
        },
        v_layout: BlockLayout {
            total_bytes: v_total,
            ..first.v_layout
        },
        desc,
        centers,
        groups,
    })
}

/// The descriptor words of layer `layer` of `layout` (its dtype compressed).
fn layer_descriptors(layout: &KvLayout, layer: usize) -> Result<LayerDescriptors, Error> {
    let lk = &layout.layers[layer];
    if layout.block_size < 16 || !layout.block_size.is_power_of_two() {
        return Err(refusal(
            lk.dtype,
            format!(
                "block size {} (coded pools need a power of two of 16 or more)",
                layout.block_size
            ),
        ));
    }
    // The layer's format, or with per-head formats its distinct ones in the order of their
    // first head.
    let per_head = !lk.head_dtypes.is_empty();
    let mut dtypes: Vec<KvDtype> = Vec::new();
    for h in 0..layout.kv_heads {
        let d = lk.head_dtype(h);
        if !dtypes.contains(&d) {
            dtypes.push(d);
        }
    }
    let mut formats = dtypes
        .iter()
        .map(|&d| Format::new(layout, layer, d))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = formats.first() else {
        return Err(refusal(lk.dtype, "a layer without kv heads".into()));
    };
    let widest = |of: fn(&Format) -> usize| formats.iter().map(of).fold(0, usize::max);
    let (k_total, v_total) = (
        widest(|f| f.k_layout.total_bytes),
        widest(|f| f.v_layout.total_bytes),
    );
    // The attention kernels address a block's kv heads with 32-bit offsets.
    for total in [k_total, v_total] {
        if total.saturating_mul(layout.kv_heads) > i32::MAX as usize {
            return Err(refusal(
                lk.dtype,
                format!(
                    "{} kv heads of {total}-byte blocks exceed the kernels' 32-bit block offsets",
                    layout.kv_heads
                ),
            ));
        }
    }
    let mut words = first.descriptors(layout.head_dim, k_total, v_total)?;
    let groups = if per_head {
        head_groups(
            layout,
            layer,
            &dtypes,
            &formats,
            &mut words,
            (k_total, v_total),
        )?
    } else {
        Vec::new()
    };
    let first = formats.swap_remove(0);
    Ok(LayerDescriptors {
        first,
        k_total,
        v_total,
        words,
        groups,
    })
}

/// The groups of a layer with per-head formats (`formats[i]` of `dtypes[i]`), their records
/// appended to `words` (which holds the first group's descriptors) as [`HeadGroup`] lays
/// them out.
fn head_groups(
    layout: &KvLayout,
    layer: usize,
    dtypes: &[KvDtype],
    formats: &[Format],
    words: &mut Vec<u32>,
    (k_total, v_total): (usize, usize),
) -> Result<Vec<HeadGroup>, Error> {
    let lk = &layout.layers[layer];
    let d = layout.head_dim;
    let refuse = |why: String| refusal(lk.dtype, why);
    let record = 2 * DESC_WORDS;
    let mut groups = Vec::with_capacity(formats.len());
    for (i, (f, &dtype)) in formats.iter().zip(dtypes).enumerate() {
        let Some(variant) = f.variant else {
            return Err(refuse(format!(
                "per-head dtype {dtype} is read on the GPU only by the parts kernels; per-head \
                 formats need whole TurboQuant widths with MSE keys"
            )));
        };
        let heads: Vec<u32> = (0..layout.kv_heads)
            .filter(|&h| lk.head_dtype(h) == dtype)
            .map(|h| h as u32)
            .collect();
        // The first group's descriptors already open `words`.
        let offset = if i == 0 { 0 } else { words.len() };
        let descriptors = f.descriptors(d, k_total, v_total)?;
        if i > 0 {
            // Queries are rotated and outputs rotated back with the first group's words.
            let basis = |w: &[u32], role: usize| -> Vec<u32> {
                let at = role * DESC_WORDS;
                let mut b = vec![w[at], w[at + 7]];
                b.extend_from_slice(&w[at + 32..at + 32 + d]);
                b
            };
            if (0..2).any(|role| basis(&descriptors, role) != basis(&words[..record], role)) {
                return Err(refuse(format!(
                    "layer {layer}: head dtype {dtype} has another rotation than head 0's {}",
                    dtypes[0]
                )));
            }
            words.extend(descriptors);
        }
        words.extend(&heads);
        words.resize(words.len().next_multiple_of(4), 0);
        groups.push(HeadGroup {
            variant,
            offset,
            heads,
        });
    }
    let table = words.len();
    words[HEAD_TABLE_WORD] =
        u32::try_from(table).map_err(|_| refuse("descriptor too long".into()))?;
    for h in 0..layout.kv_heads {
        let g = groups
            .iter()
            .find(|g| g.heads.contains(&(h as u32)))
            .ok_or_else(|| refuse(format!("kv head {h} in no group")))?;
        words.push(g.offset as u32);
    }
    Ok(groups)
}

/// What the CUDA backend stores KV caches as.
pub(crate) const ACCEPTED: &str = "f16, bf16 (head_dim a multiple of 4, ≤ 256); int8, fp8, tq2, \
     tq3, tq4 and k{b}v{b} with whole b in 2-4 and MSE keys on their codes (head_dim 64, 128 or \
     256, at most 16 query heads per kv head, 8 at head_dim 256); fractional widths, 1-bit codes, \
     prod keys and corrected norms on CUDA cores (the same head dims and groups); a recent \
     window and sinks kept at f16";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_pair_has_one_kernel_per_head_dim() {
        let all = CodeVariant::all();
        assert_eq!(all.len(), CODE_HEAD_DIMS.len() * CODE_FORMS.len());
        for v in &all {
            assert!(v.kernel_name(false).starts_with("attn_codes_"));
            assert!(v.kernel_name(true).starts_with("attn_codes_m_"));
            // Three blocks per SM fit an H200's 228 KiB up to the template's head dims; at
            // head_dim 256 one block does (two for TurboQuant).
            let limit = if v.has_template() { 72 } else { 227 };
            assert!(v.smem_bytes() <= limit * 1024, "{v:?}");
            assert_eq!(v.has_template(), v.head_dim <= 128);
        }
    }

    #[test]
    fn int8_value_kernels_fit_four_blocks_per_sm() {
        for v in CodeVariant::all().iter().filter(|v| v.has_int8_values()) {
            let (keys, stages) = v.int8_values_tiling();
            assert!(stages >= 2, "{v:?}");
            assert!(v.int8_values_smem_bytes() <= V8_BLOCK_SMEM, "{v:?}");
            // tq3 and k4v2 at head_dim 128 take the 256-key tiles.
            if v.head_dim == 128
                && matches!(
                    (v.key, v.value),
                    (CodeForm::Mse(3), CodeForm::Mse(3)) | (CodeForm::Mse(4), CodeForm::Mse(2))
                )
            {
                assert_eq!(keys, 256, "{v:?}");
            }
        }
    }

    #[test]
    fn int8_tables_stay_within_half_a_step() {
        use turbokv_codec::codebook::Codebook;
        for d in [64, 128, 256] {
            for bits in [2u8, 3, 4] {
                let cb = Codebook::get(d, bits).unwrap();
                // The 4-bit records' tables hold the 8 positive magnitudes.
                let table = if bits == 4 {
                    &cb.centroids()[8..]
                } else {
                    cb.centroids()
                };
                let (bytes, inv_alpha) = int8_table(table, 127);
                let cmax = table.iter().fold(0f32, |m, c| m.max(c.abs()));
                for (j, &c) in table.iter().enumerate() {
                    let got = f32::from(bytes[j] as i8) * inv_alpha;
                    assert!(
                        (got - c).abs() <= 0.5 * inv_alpha * 1.0001 && inv_alpha <= cmax / 96.0,
                        "d={d} b={bits} centroid {j}: {got} vs {c}"
                    );
                }
                // A table of fewer than 8 entries leaves the rest zero.
                assert!(bytes[table.len()..].iter().all(|&b| b == 0));
            }
        }
        assert_eq!(int8_table(&[0.0; 4], 127), ([0; 8], 1.0));
    }

    /// One byte of PTX `prmt.b32` (default mode) from the 8 bytes of its two sources: bits 0-2
    /// of the selector nibble pick the byte, bit 3 asks for its sign replicated instead.
    fn prmt_byte(src: &[u32], sel: u32) -> i8 {
        let byte = (src[(sel as usize & 7) / 4] >> (8 * (sel & 3))) as u8;
        match sel & 8 {
            0 => byte as i8,
            _ => -((byte >> 7) as i8),
        }
    }

    #[test]
    fn four_bit_keys_sum_two_one_sided_lookups_to_their_centroid() {
        use turbokv_codec::codebook::Codebook;
        let mut cases: Vec<Vec<f32>> = [64, 128, 256]
            .iter()
            .map(|&d| Codebook::get(d, 4).unwrap().centroids()[8..].to_vec())
            .collect();
        // A magnitude that rounds to zero must still give 0 for both signs.
        cases.push(vec![0.001, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 3.0]);
        for mags in cases {
            let (bytes, _) = int8_table(&mags, 126);
            assert!(bytes.iter().all(|&b| b <= 126), "{bytes:?}");
            let words = int8_pair_words(&bytes);
            // Stored nibble n: bit 3 set for a positive code, bits 0-2 the complement of m.
            for n in 0u32..16 {
                let m = (!n & 7) as usize;
                let want = if n & 8 != 0 {
                    bytes[m] as i8
                } else {
                    -(bytes[m] as i8)
                };
                let got = prmt_byte(&words[..2], n) + prmt_byte(&words[2..], !n & 15);
                assert_eq!(got, want, "mags {mags:?} nibble {n}");
            }
        }
        // The descriptor of 4-bit keys holds them beside the magnitude tables.
        let codec = LayerCodec::new("tq4".parse().unwrap(), 128, 0, &Default::default()).unwrap();
        let kf = codec.key.device_format().unwrap();
        let w = descriptor(&kf, &codec.key.block_layout(16).unwrap(), 32).unwrap();
        let mut mags = [0u8; 8];
        for (i, b) in mags.iter_mut().enumerate() {
            *b = w[INT8_TABLE_WORD + i / 4].to_le_bytes()[i % 4];
        }
        assert_eq!(
            w[INT8_PAIR_WORD..INT8_PAIR_WORD + 4],
            int8_pair_words(&mags)
        );
    }

    /// The width pairs attention.cu instantiates with int8 value products are the ones the
    /// host looks up (a mismatch would only show when a GPU loads the module).
    #[test]
    fn int8_value_kernels_match_the_instantiated_forms() {
        let src = include_str!("kernels/attention.cu");
        let start = src.find("#define ATTN_CODES_V8_FORMS").unwrap();
        // The macro's lines, each but the last ending in a backslash.
        let mut body = String::new();
        for line in src[start..].lines() {
            body.push_str(line);
            if !line.trim_end().ends_with('\\') {
                break;
            }
        }
        let mut listed: Vec<(u8, u8)> = body
            .split("X(__VA_ARGS__,")
            .skip(1)
            .map(|x| {
                let mut n = x
                    .split(')')
                    .next()
                    .unwrap()
                    .split(',')
                    .map(|t| t.trim().parse().unwrap());
                (n.next().unwrap(), n.next().unwrap())
            })
            .collect();
        listed.sort_unstable();
        let mut host: Vec<(u8, u8)> = CodeVariant::all()
            .into_iter()
            .filter(|v| v.head_dim == 128 && v.has_int8_values())
            .map(|v| (v.key.bits(), v.value.bits()))
            .collect();
        host.sort_unstable();
        assert_eq!(listed, host);
        for d in [64, 128] {
            assert!(src.contains(&format!("ATTN_CODES_V8_FORMS(ATTN_CODES_K8V, {d})")));
        }
    }

    #[test]
    fn int8_value_tables_round_to_the_nearest_127th_of_the_largest() {
        use turbokv_codec::codebook::Codebook;
        for d in [64, 128] {
            for bits in [2u8, 3] {
                let c = Codebook::get(d, bits).unwrap().centroids().to_vec();
                let (words, step) = int8_value_words(&c);
                let cmax = c.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert_eq!(step, cmax / 127.0);
                let bytes: Vec<i8> = words
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .map(|b| b as i8)
                    .collect();
                for (j, &x) in c.iter().enumerate() {
                    let got = f32::from(bytes[j]) * step;
                    assert!((got - x).abs() <= 0.5 * step * 1.0001, "d={d} b={bits} {j}");
                }
                // The symmetric codebook's ends are ±127; unused entries stay zero.
                assert_eq!((bytes[0], bytes[c.len() - 1]), (-127, 127));
                assert!(bytes[c.len()..].iter().all(|&b| b == 0));
            }
        }
        assert_eq!(int8_value_words(&[0.0; 4]), ([0; 2], 0.0));
    }

    #[test]
    fn per_head_formats_get_a_record_per_group_and_a_head_table() {
        let d = |s: &str| s.parse::<KvDtype>().unwrap();
        let mut layout = KvLayout::uniform(2, 4, 128, d("tq2"), 16, 64).unwrap();
        // Heads 1 and 3 at k3v2 on layer 1 (not consecutive: one launch reads a list).
        layout.layers[1].head_dtypes = vec![d("tq2"), d("k3v2"), d("tq2"), d("k3v2")];
        let one = layer_descriptors(&layout, 0).unwrap();
        assert!(one.groups.is_empty());
        assert_eq!(one.words.len(), 2 * DESC_WORDS);
        assert_eq!(one.words[HEAD_TABLE_WORD], 0, "one format: no head table");
        let per_head = layer_descriptors(&layout, 1).unwrap();
        let (w, groups) = (&per_head.words, &per_head.groups);
        assert_eq!(groups.len(), 2);
        let k3 = Format::new(&layout, 1, d("k3v2")).unwrap();
        // Every slot is as wide as the widest format's: 3-bit keys, 2-bit values.
        assert_eq!(per_head.k_total, k3.k_layout.total_bytes);
        assert_eq!(per_head.v_total, one.v_total);
        assert!(per_head.k_total > one.k_total);
        for (g, (heads, bits)) in groups.iter().zip([([0, 2], 2), ([1, 3], 3)]) {
            assert_eq!(g.heads, heads);
            assert_eq!(g.variant.key.bits(), bits);
            assert_eq!(g.offset % 4, 0, "records stay 16-byte aligned");
            let rec = &w[g.offset..];
            assert_eq!(rec[1], u32::from(bits), "the key descriptor's width");
            assert_eq!(rec[3] as usize, per_head.k_total);
            assert_eq!(rec[DESC_WORDS + 3] as usize, per_head.v_total);
            // The head list follows the two descriptors (attention.cu `coded_kv_head`).
            assert_eq!(&rec[2 * DESC_WORDS..2 * DESC_WORDS + 2], &heads[..]);
            // Both groups rotate as head 0's (the query is rotated once).
            assert_eq!(&rec[32..32 + 128], &w[32..32 + 128]);
        }
        assert_eq!(groups[0].offset, 0);
        let table = w[HEAD_TABLE_WORD] as usize;
        let offsets: Vec<usize> = w[table..].iter().map(|&o| o as usize).collect();
        assert_eq!(
            offsets,
            [0, groups[1].offset, 0, groups[1].offset],
            "each kv head's record (write_kv.cu)"
        );
        // A head dtype the direct kernels do not read is refused, not mis-encoded.
        layout.layers[1].head_dtypes = vec![d("tq2"), d("tq2.5"), d("tq2"), d("tq2")];
        assert!(layer_descriptors(&layout, 1).is_err());
    }

    #[test]
    fn descriptors_hold_the_codec_numbers() {
        let codec = LayerCodec::new("k4v2".parse().unwrap(), 128, 1, &Default::default()).unwrap();
        let kf = codec.key.device_format().unwrap();
        let kl = codec.key.block_layout(16).unwrap();
        let w = descriptor(&kf, &kl, 32).unwrap();
        let DeviceFormat::HadamardMse(h) = kf else {
            panic!("tq keys");
        };
        assert_eq!((w[0], w[1], w[2]), (1, 4, 64));
        assert_eq!(w[3] as usize, kl.total_bytes);
        assert_eq!(w[4] as usize, kl.scalars_offset);
        assert_eq!(f32::from_bits(w[6]), h.sigma);
        // 4-bit records are sign-magnitude: the table holds the 8 positive centroids.
        assert_eq!(w[5], RecordLayout::SignMagnitude4.descriptor_word());
        for (j, c) in h.centroids[8..].iter().enumerate() {
            let lo = (w[24 + j / 4] >> (8 * (j % 4))) & 0xff;
            let hi = (w[28 + j / 4] >> (8 * (j % 4))) & 0xff;
            assert_eq!(f16::from_bits((lo | hi << 8) as u16), f16::from_f32(*c));
        }
        assert_eq!(&w[32..160], &h.sign_masks[..]);
        assert_eq!(w[CORRECTED_WORD], 0, "exact norms");
        // Corrected norms: the flag and the encoder's f32 centroids, in code order (not the
        // sign-magnitude table's), and a direct route.
        let opts = turbokv_codec::CodecOptions {
            norm: turbokv_codec::NormMode::Corrected,
            ..Default::default()
        };
        let corrected = LayerCodec::new("k4v2".parse().unwrap(), 128, 1, &opts).unwrap();
        assert!(matches!(route(&corrected, 128), Ok(Route::Direct(..))));
        let cf = corrected.key.device_format().unwrap();
        let cw = descriptor(&cf, &kl, 32).unwrap();
        assert_eq!(cw[CORRECTED_WORD], 1);
        for (j, c) in h.centroids.iter().enumerate() {
            assert_eq!(f32::from_bits(cw[CORRECTED_WORD + 1 + j]), *c);
        }
        assert_eq!(&cw[..CORRECTED_WORD], &w[..CORRECTED_WORD]);
        assert!(unsupported_reason("tq3".parse().unwrap(), 128).is_none());
        assert!(unsupported_reason("int8".parse().unwrap(), 64).is_none());
        assert!(unsupported_reason("fp8".parse().unwrap(), 128).is_none());
        // Fractional widths and 1-bit codes take the parts kernels, at head_dim 64, 128, 256.
        assert!(unsupported_reason("tq2.5".parse().unwrap(), 128).is_none());
        assert!(unsupported_reason("k3.5v2".parse().unwrap(), 64).is_none());
        assert!(unsupported_reason("tq1".parse().unwrap(), 128).is_none());
        assert!(unsupported_reason("tq2.5".parse().unwrap(), 256).is_none());
        assert!(unsupported_reason("tq3".parse().unwrap(), 96).is_some());
    }
}
