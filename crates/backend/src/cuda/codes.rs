//! Coded KV pools on the GPU (`int8`, TurboQuant-MSE `tq{2,3,4}` and mixed `k{b}v{b}`): the
//! format descriptors the kernels read, and what a coded pool holds beside its bytes.
//!
//! A coded pool stores every (physical block, kv head) in the codec's block layout
//! ([`turbokv_codec::layout`]) with the code bits rearranged where that unpacks faster
//! ([`RecordLayout`] for keys, [`ValueUnits`] for values); block I/O converts back, so blocks
//! and snapshots move between the backends unchanged. The encoder (`write_kv_codes`,
//! write_kv.cu) reproduces the codec's f32 operations in order, so the codes are the CPU's;
//! attention reads the codes (`attn_imma_*`, attention.cu) on the integer tensor cores, with
//! fixed-point codebooks ([`key_tables`], [`value_tables`]), the query rotated into the keys'
//! basis by the encoder launch and the output rotated back by `attn_unrotate` (write_kv.cu).

use cudarc::driver::{CudaSlice, CudaStream};
use turbokv_cache::KvLayout;
use turbokv_codec::{BlockLayout, DeviceFormat, KvDtype, LayerCodec, VectorCodec};

use super::code_layout::{RecordLayout, ValueUnits};
use super::cuda_err;
use crate::Error;

/// u32 words of one role's format descriptor (write_kv.cu `CODE_DESC_WORDS`).
pub(crate) const DESC_WORDS: usize = 288;
/// Keys per staged tile of the coded decode kernels (attention.cu `attn_imma_impl`).
pub(crate) const CODE_TILE: usize = 128;
/// Warps per block of the coded decode kernels.
pub(crate) const CODE_WARPS: usize = 4;
/// Query heads per kv head that one n-tile of the coded kernels covers (the 8 columns of its
/// MMAs); the `_2` kernels take two, up to 16.
pub(crate) const CODE_HEADS_PER_TILE: usize = 8;
/// Query heads per kv head the coded kernels take at most.
pub(crate) const CODE_MAX_GROUP: usize = 2 * CODE_HEADS_PER_TILE;
/// Tile bytes a coded kernel keeps in flight (attention.cu `code_stages`).
const CODE_BYTES_IN_FLIGHT: usize = 36864;

/// Pipeline stages of a coded kernel whose tiles are `tile_bytes` (attention.cu
/// `code_stages`): enough for [`CODE_BYTES_IN_FLIGHT`], 3 to 6 (the software pipeline holds
/// two tiles while a third loads; int8, unpipelined, 2 to 6). The bytes in flight bound a
/// streaming kernel's bandwidth, and a tile of codes is 2-5× smaller than a 16-bit one.
fn code_stages(tile_bytes: usize, pipelined: bool) -> usize {
    let least = if pipelined { 3 } else { 2 };
    CODE_BYTES_IN_FLIGHT.div_ceil(tile_bytes).clamp(least, 6)
}

/// Head dims with coded kernels.
pub(crate) const CODE_HEAD_DIMS: [usize; 2] = [64, 128];
/// Code widths per role the kernels are instantiated for (8 = int8, which pairs only with
/// itself), in attention.cu's `ATTN_CODES_D` order.
const CODE_WIDTHS: [(u8, u8); 10] = [
    (8, 8),
    (4, 4),
    (4, 3),
    (4, 2),
    (3, 4),
    (3, 3),
    (3, 2),
    (2, 4),
    (2, 3),
    (2, 2),
];

/// One coded decode kernel: head dim, key bits, value bits (8 = int8), n-tiles of 8 query
/// heads (1 or 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CodeVariant {
    pub head_dim: usize,
    pub key_bits: u8,
    pub value_bits: u8,
    pub head_tiles: usize,
}

impl CodeVariant {
    /// Every instantiated kernel, in a fixed order (the index of [`Kernels::attn_imma`]).
    pub(crate) fn all() -> Vec<CodeVariant> {
        let mut all = Vec::new();
        for head_dim in CODE_HEAD_DIMS {
            for (key_bits, value_bits) in CODE_WIDTHS {
                for head_tiles in [1, 2] {
                    all.push(CodeVariant {
                        head_dim,
                        key_bits,
                        value_bits,
                        head_tiles,
                    });
                }
            }
        }
        all
    }

    /// The kernel for a pool's widths and a GQA group of `group` query heads per kv head.
    pub(crate) fn for_group(head_dim: usize, key_bits: u8, value_bits: u8, group: usize) -> Self {
        CodeVariant {
            head_dim,
            key_bits,
            value_bits,
            head_tiles: group.div_ceil(CODE_HEADS_PER_TILE).clamp(1, 2),
        }
    }

    /// The kernel's name in attention.cu.
    pub(crate) fn kernel_name(&self) -> String {
        format!(
            "attn_imma_{}_{}_{}_{}",
            self.head_dim, self.key_bits, self.value_bits, self.head_tiles
        )
    }

    /// Threads per block.
    pub(crate) fn threads(&self) -> usize {
        32 * CODE_WARPS
    }

    /// Dynamic shared memory: the pipeline's K and V tiles (code records and scales), the
    /// weights' fragments, the maxima, one mbarrier per stage and the warps' f32 output totals
    /// (the final sums reuse the tiles; the merge's is added by the launch).
    pub(crate) fn smem_bytes(&self) -> usize {
        let row = |bits: u8| self.head_dim * usize::from(bits) / 8 + 2;
        let tile = CODE_TILE * (row(self.key_bits) + row(self.value_bits));
        let heads = CODE_HEADS_PER_TILE * self.head_tiles;
        // Two buffers of the weights' fragments (hi and lo bytes per run, per lane).
        let weights = 2 * self.head_tiles * 2 * (CODE_TILE / 16) * 32 * 4;
        // int8 runs unpipelined, with its f32 output totals in registers (attention.cu).
        let pipelined = self.key_bits != 8;
        let stages = code_stages(tile, pipelined);
        let maxima = CODE_WARPS * (heads + 1) * 4 + 8 * stages;
        // The warps' f32 output totals, lane-minor.
        let totals = if pipelined {
            CODE_WARPS * self.head_tiles * 16 * 32 * 4
        } else {
            0
        };
        let sums = (CODE_WARPS * (heads + heads * 64) + heads) * 4;
        (stages * tile + weights + maxima + totals).max(sums)
    }
}

/// What a coded pool holds beside its bytes.
#[derive(Debug)]
pub(crate) struct PoolCodes {
    /// The kernel that attends over this pool.
    pub variant: CodeVariant,
    /// Whether values are TurboQuant (the output is rotated back).
    pub values_rotated: bool,
    /// How key records and value runs are arranged.
    pub k_records: RecordLayout,
    pub v_units: ValueUnits,
    /// Block layouts of keys and values (bytes per (block, kv head)).
    pub k_layout: BlockLayout,
    pub v_layout: BlockLayout,
    /// The key then the value descriptor, [`DESC_WORDS`] each.
    pub desc: CudaSlice<u32>,
    /// Per-head mean key and value (`[kv_heads, head_dim]` each), subtracted before encoding.
    pub centers: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

impl PoolCodes {
    /// Rewrites the codes of one (block, kv head)'s key and value blocks (the codec's block
    /// layout) from the GPU layouts into the codec's (`to_codec`) or back.
    pub(crate) fn convert_records(&self, k: &mut [u8], v: &mut [u8], to_codec: bool) {
        let l = &self.k_layout;
        let bits = self.variant.key_bits;
        for rec in
            k[..l.block_size * l.code_bytes_per_token].chunks_exact_mut(l.code_bytes_per_token)
        {
            if to_codec {
                self.k_records.to_codec(bits, rec);
            } else {
                self.k_records.to_device(bits, rec);
            }
        }
        let codes = &mut v[..self.v_layout.block_size * self.v_layout.code_bytes_per_token];
        if to_codec {
            self.v_units.to_codec(codes);
        } else {
            self.v_units.to_device(codes);
        }
    }
}

/// Code width of one role's device format (8 for int8).
fn width(f: &DeviceFormat) -> u8 {
    match f {
        DeviceFormat::Int8 => 8,
        DeviceFormat::HadamardMse(h) => h.bits,
    }
}

/// Codes per kernel lane run of a key record (the unit of [`RecordLayout`]): keys are read in
/// runs of `head_dim / 4` codes (attention.cu `KeyCodes`).
pub(crate) fn key_run(head_dim: usize) -> usize {
    head_dim / 4
}

/// The record layout of the keys in a GPU pool.
pub(crate) fn record_layout(f: &DeviceFormat, run: usize) -> RecordLayout {
    RecordLayout::for_role(width(f), run)
}

/// Which role a descriptor describes: the two are arranged and read differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Keys,
    Values,
}

/// The key codebook as the kernel reads it (attention.cu `KeyCodes`): byte tables of the
/// 16-bit fixed-point centroids `round(c · s)` with `s = 32767 / max |c|` — words 0-1 the low
/// bytes (u8), 2-3 the high bytes (s8) of entries 0-7 — and the factor that turns the
/// kernel's integer dot products (÷ 256) back into `q · c`, `256 / s`. Sign-magnitude
/// (4-bit) records hold the magnitudes `m` as `x = ⌊c[8 + m] · s⌋`, the value being
/// `x + ½` and a negative code `¬x`. int8 keys are their own bytes (no table, factor 1).
pub(crate) fn key_tables(f: &DeviceFormat) -> ([u32; 4], f32) {
    let DeviceFormat::HadamardMse(h) = f else {
        return ([0; 4], 1.0);
    };
    let s = 32767.0 / h.centroids.iter().fold(0f32, |m, c| m.max(c.abs()));
    let values: Vec<i32> = if h.bits == 4 {
        h.centroids[8..]
            .iter()
            .map(|c| (c * s).floor() as i32)
            .collect()
    } else {
        h.centroids.iter().map(|c| (c * s).round() as i32).collect()
    };
    let mut t = [0u32; 4];
    for (j, v) in values.iter().enumerate() {
        let v = *v as u16;
        t[j / 4] |= u32::from(v & 0xff) << (8 * (j % 4));
        t[2 + j / 4] |= u32::from(v >> 8) << (8 * (j % 4));
    }
    (t, 256.0 / s)
}

/// The value codebook as the kernel reads it (attention.cu `ValueUnit`): the 16-bit
/// fixed-point centroids `v = round(c · s)` with `s = 32639 / max |c|`, split as
/// `v = 256·hi + lo` with `lo` in [-128, 127] (so `hi` stays within s8) — words 0-1 the low
/// bytes, 2-3 the high bytes; 4-bit: those of the 8 positive magnitudes, and of their
/// negations in words 4-7 — and `256 / (65535 · s)`, the factor of the kernel's sums
/// (16-bit weights × 16-bit values ÷ 256). An 8-bit codebook would save a byte permute per
/// four codes but puts the GPU up to `max |c| / 254` off the CPU's values, beyond the
/// attention tolerance (BENCHMARKS.md). int8 values are their own (high) bytes: factor
/// `1 / 65535`.
pub(crate) fn value_tables(f: &DeviceFormat) -> ([u32; 8], f32) {
    let DeviceFormat::HadamardMse(h) = f else {
        return ([0; 8], 1.0 / 65535.0);
    };
    let s = 32639.0 / h.centroids.iter().fold(0f32, |m, c| m.max(c.abs()));
    let mut t = [0u32; 8];
    let mut put = |base: usize, j: usize, c: f32| {
        let v = (c * s).round() as i32;
        let hi = (v + 128) >> 8;
        let lo = v - 256 * hi;
        t[base + j / 4] |= (lo as u8 as u32) << (8 * (j % 4));
        t[base + 2 + j / 4] |= (hi as u8 as u32) << (8 * (j % 4));
    };
    if h.bits == 4 {
        for (m, c) in h.centroids[8..].iter().enumerate() {
            put(0, m, *c);
            put(4, m, -*c);
        }
    } else {
        for (j, c) in h.centroids.iter().enumerate() {
            put(0, j, *c);
        }
    }
    (t, 256.0 / (65535.0 * s))
}

/// The descriptor words of one role (write_kv.cu documents them) at `head_dim`.
pub(crate) fn descriptor(
    f: &DeviceFormat,
    layout: &BlockLayout,
    role: Role,
    head_dim: usize,
) -> Result<Vec<u32>, Error> {
    let mut w = vec![0u32; DESC_WORDS];
    let too_large = || Error::Cuda {
        op: "kv pool",
        detail: format!("a block of {} bytes is too large", layout.total_bytes),
    };
    w[2] = u32::try_from(layout.code_bytes_per_token).map_err(|_| too_large())?;
    w[3] = u32::try_from(layout.total_bytes).map_err(|_| too_large())?;
    w[4] = u32::try_from(layout.scalars_offset).map_err(|_| too_large())?;
    let factor = match role {
        Role::Keys => {
            w[5] = record_layout(f, key_run(head_dim)).descriptor_word();
            let (t, factor) = key_tables(f);
            w[24..28].copy_from_slice(&t);
            factor
        }
        Role::Values => {
            w[5] = ValueUnits::DESCRIPTOR_WORD;
            let (t, factor) = value_tables(f);
            w[24..32].copy_from_slice(&t);
            factor
        }
    };
    w[23] = factor.to_bits();
    match f {
        DeviceFormat::Int8 => {
            w[0] = 0;
            w[1] = 8;
        }
        DeviceFormat::HadamardMse(h) => {
            if h.sign_masks.len() > DESC_WORDS - 32 || h.boundaries.len() > 15 {
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
            w[32..32 + h.sign_masks.len()].copy_from_slice(&h.sign_masks);
        }
    }
    Ok(w)
}

/// Why a dtype has no coded kernel, or `None` when it has one (at `head_dim`).
pub(crate) fn unsupported_reason(dtype: KvDtype, head_dim: usize) -> Option<String> {
    if !CODE_HEAD_DIMS.contains(&head_dim) {
        return Some(format!(
            "head_dim {head_dim} (coded pools have kernels for head_dim {CODE_HEAD_DIMS:?})"
        ));
    }
    let codec = match LayerCodec::new(dtype, head_dim, 0, &Default::default()) {
        Ok(c) => c,
        Err(e) => return Some(e.to_string()),
    };
    for (role, c) in [("keys", &codec.key), ("values", &codec.value)] {
        match c.device_format() {
            Some(f) if width(&f) >= 2 => {}
            _ => {
                return Some(format!(
                    "{role}: only int8 and whole widths 2-4 (no outlier split, 1-bit or QJL \
                     codes) are read on the GPU"
                ));
            }
        }
    }
    None
}

/// The coded state of layer `layer` of `layout` (its dtype compressed), uploaded.
pub(crate) fn pool_codes(
    stream: &std::sync::Arc<CudaStream>,
    layout: &KvLayout,
    layer: usize,
) -> Result<PoolCodes, Error> {
    let dtype = layout.layers[layer].dtype;
    let refuse = |why: String| Error::UnsupportedKvDtype {
        dtype: format!("{dtype} ({why})"),
        backend: "cuda",
        accepted: ACCEPTED,
    };
    if let Some(why) = unsupported_reason(dtype, layout.head_dim) {
        return Err(refuse(why));
    }
    if layout.block_size < 16 || !layout.block_size.is_power_of_two() {
        return Err(refuse(format!(
            "block size {} (coded pools need a power of two of 16 or more)",
            layout.block_size
        )));
    }
    let codec = LayerCodec::new(
        dtype,
        layout.head_dim,
        u32::try_from(layer).unwrap_or(u32::MAX),
        &layout.codec_options(layer),
    )
    .map_err(|e| refuse(e.to_string()))?;
    let role = |c: &VectorCodec| -> Result<(DeviceFormat, BlockLayout), Error> {
        let f = c
            .device_format()
            .ok_or_else(|| refuse("prod (QJL) keys are not read on the GPU".into()))?;
        let l = c
            .block_layout(layout.block_size)
            .map_err(|e| refuse(e.to_string()))?;
        Ok((f, l))
    };
    let (kf, k_layout) = role(&codec.key)?;
    let (vf, v_layout) = role(&codec.value)?;
    // The attention kernels address a block's kv heads with 32-bit offsets.
    for l in [&k_layout, &v_layout] {
        if l.total_bytes.saturating_mul(layout.kv_heads) > i32::MAX as usize {
            return Err(refuse(format!(
                "{} kv heads of {}-byte blocks exceed the kernels' 32-bit block offsets",
                layout.kv_heads, l.total_bytes
            )));
        }
    }
    let variant = CodeVariant::for_group(layout.head_dim, width(&kf), width(&vf), 1);
    if !CodeVariant::all().contains(&variant) {
        return Err(refuse("int8 keys pair only with int8 values".into()));
    }
    let hd = layout.head_dim;
    let mut words = descriptor(&kf, &k_layout, Role::Keys, hd)?;
    words.extend(descriptor(&vf, &v_layout, Role::Values, hd)?);
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
        variant,
        values_rotated: matches!(vf, DeviceFormat::HadamardMse(_)),
        k_records: record_layout(&kf, key_run(hd)),
        v_units: ValueUnits {
            bits: width(&vf),
            head_dim: hd,
        },
        k_layout,
        v_layout,
        desc,
        centers,
    })
}

/// What the CUDA backend stores KV caches as.
pub(crate) const ACCEPTED: &str = "f16, bf16 (head_dim a multiple of 4, ≤ 256); int8, tq2, \
     tq3, tq4 and k{b}v{b} with whole b in 2-4 (head_dim 64 or 128, MSE keys; a recent window and sinks kept at f16)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_pair_has_one_kernel_per_head_dim_and_head_tiles() {
        let all = CodeVariant::all();
        assert_eq!(all.len(), CODE_HEAD_DIMS.len() * CODE_WIDTHS.len() * 2);
        for v in &all {
            assert!(v.kernel_name().starts_with("attn_imma_"));
            // Two blocks per SM of every one-tile kernel fit an H200's 228 KiB, one of the rest.
            let most = if v.head_tiles == 1 { 113 } else { 227 };
            assert!(v.smem_bytes() <= most * 1024, "{v:?}");
        }
        assert_eq!(CodeVariant::for_group(128, 3, 3, 4).head_tiles, 1);
        assert_eq!(CodeVariant::for_group(128, 3, 3, 8).head_tiles, 1);
        assert_eq!(CodeVariant::for_group(128, 3, 3, 9).head_tiles, 2);
        assert_eq!(CodeVariant::for_group(128, 3, 3, 16).head_tiles, 2);
    }

    /// A table entry as a signed value: bytes j of words (lo, hi).
    fn entry16(t: &[u32; 4], j: usize) -> i32 {
        let lo = (t[j / 4] >> (8 * (j % 4))) & 0xff;
        let hi = (t[2 + j / 4] >> (8 * (j % 4))) & 0xff;
        i32::from((lo | hi << 8) as u16 as i16)
    }

    #[test]
    fn integer_codebooks_hold_the_centroids() {
        for bits in [2u8, 3, 4] {
            for dims in [64usize, 128] {
                let dtype = format!("tq{bits}").parse().unwrap();
                let codec = LayerCodec::new(dtype, dims, 0, &Default::default()).unwrap();
                let f = codec.key.device_format().unwrap();
                let DeviceFormat::HadamardMse(h) = &f else {
                    panic!("tq has a device format");
                };
                let cmax = h.centroids.iter().fold(0f32, |m, c| m.max(c.abs()));
                // Keys: 16-bit values within half a step of c · s; 4-bit: x + ½ and ¬x + ½.
                let (t, kfac) = key_tables(&f);
                let s = 256.0 / kfac;
                for (j, c) in h.centroids.iter().enumerate() {
                    let got = if bits == 4 {
                        let x = entry16(&t, if j >= 8 { j - 8 } else { 7 - j }) as f32 + 0.5;
                        if j >= 8 { x } else { -x }
                    } else {
                        entry16(&t, j) as f32
                    };
                    assert!(
                        (got / s - c).abs() <= 0.51 / s,
                        "tq{bits} key {j}: {} vs {c} (s {s})",
                        got / s
                    );
                }
                // Values: 16-bit values (256·hi + lo, lo signed) within half a step.
                let (t, vfac) = value_tables(&f);
                let s = 256.0 / (65535.0 * vfac);
                let v16 = |t: &[u32], j: usize| {
                    let b = |w: u32| i32::from(((w >> (8 * (j % 4))) & 0xff) as u8 as i8);
                    256 * b(t[2 + j / 4]) + b(t[j / 4])
                };
                for (j, c) in h.centroids.iter().enumerate() {
                    let got = if bits == 4 {
                        let m = if j >= 8 { j - 8 } else { 7 - j };
                        v16(&t[if j >= 8 { 0 } else { 4 }..], m)
                    } else {
                        v16(&t, j)
                    };
                    assert!((got as f32 / s - c).abs() <= 0.51 / s, "tq{bits} value {j}");
                    assert!(0.5 / s <= cmax / 65000.0);
                }
            }
        }
        let (t, kfac) = key_tables(&DeviceFormat::Int8);
        assert_eq!((t, kfac), ([0; 4], 1.0));
    }

    #[test]
    fn descriptors_hold_the_codec_numbers() {
        let codec = LayerCodec::new("k4v2".parse().unwrap(), 128, 1, &Default::default()).unwrap();
        let kf = codec.key.device_format().unwrap();
        let kl = codec.key.block_layout(16).unwrap();
        let w = descriptor(&kf, &kl, Role::Keys, 128).unwrap();
        let DeviceFormat::HadamardMse(h) = &kf else {
            panic!("tq keys");
        };
        assert_eq!((w[0], w[1], w[2]), (1, 4, 64));
        assert_eq!(w[3] as usize, kl.total_bytes);
        assert_eq!(w[4] as usize, kl.scalars_offset);
        assert_eq!(f32::from_bits(w[6]), h.sigma);
        // 4-bit key records are sign-magnitude.
        assert_eq!(w[5], RecordLayout::SignMagnitude4.descriptor_word());
        let (t, kfac) = key_tables(&kf);
        assert_eq!((&w[24..28], f32::from_bits(w[23])), (&t[..], kfac));
        assert_eq!(&w[32..160], &h.sign_masks[..]);
        let vf = codec.value.device_format().unwrap();
        let vl = codec.value.block_layout(16).unwrap();
        let w = descriptor(&vf, &vl, Role::Values, 128).unwrap();
        assert_eq!((w[1], w[5]), (2, ValueUnits::DESCRIPTOR_WORD));
        assert!(unsupported_reason("tq3".parse().unwrap(), 128).is_none());
        assert!(unsupported_reason("int8".parse().unwrap(), 64).is_none());
        assert!(unsupported_reason("tq2.5".parse().unwrap(), 128).is_some());
        assert!(unsupported_reason("tq1".parse().unwrap(), 128).is_some());
        assert!(unsupported_reason("tq3".parse().unwrap(), 96).is_some());
    }
}
