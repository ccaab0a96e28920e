//! Parts pools: TurboQuant formats no decode kernel reads on its codes — fractional widths
//! (an outlier part and a regular part), prod (QJL) keys, 1-bit codes and corrected norms.
//!
//! Their records stay in the codec's layout, so block I/O copies them unchanged. The encoder
//! (`write_kv_parts_*`, parts.cu) follows the codec part by part in its f32 operation order,
//! so the codes are the CPU's. A launch with a prefill span at head_dim 64 or 128 dequantizes
//! the keys it reads into f16 rows (`codes_dequant_parts_*`) for the coded prefill's tile
//! kernel (`attn_mma_codes_*`); other launches take `attn_parts_{D}_{G}` (attention.cu), which
//! reads the codes on CUDA cores, without the tensor cores and the GPU record layouts of the
//! whole-width kernels (BENCHMARKS.md has what that costs).

use turbokv_codec::{BlockLayout, DeviceParts};

use crate::Error;

/// Head dims with parts kernels.
pub(crate) const PARTS_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Head dims whose prefill launches dequantize for the coded tile kernel (`attn_mma_codes_*`);
/// at the others every row takes the decode kernel.
pub(crate) const PARTS_PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];
/// u32 words of the header of a role's parts descriptor (parts.cu `PARTS_HEADER`).
const HEADER: usize = 16;
/// u32 words per part (parts.cu `PART_WORDS`).
const PART_WORDS: usize = 1088;
/// u32 words of one role's parts descriptor (parts.cu `PARTS_DESC_WORDS`).
pub(crate) const PARTS_DESC_WORDS: usize = HEADER + 2 * PART_WORDS;
/// Offsets within a part (parts.cu `P_*`).
const BOUNDS: usize = 16;
const CENTROIDS: usize = 32;
const MASKS: usize = 48;
const QJL0: usize = 304;
const QJL1: usize = 560;
const CHANNELS: usize = 816;
/// The most channels a part may have (a whole head vector of the largest head dim).
const MAX_PART: usize = 256;

/// The decode kernels `attn_parts_{D}_{G}` (attention.cu `ATTN_PARTS`) as (head_dim, group)
/// pairs, in [`kernels`](super::kernels) order: groups (query heads per kv head, rounded up)
/// up to 16, and up to 8 at head_dim 256 (the coded pools' limit there,
/// `codes::coded_max_group`), with groups of 2 beside them for one or two query heads per kv
/// head (multi-head attention, Gemma at head_dim 256), where the group-4 kernel spent half
/// or more of its multiply-adds on padding heads.
pub(crate) const DECODE_KERNELS: [(usize, usize); 11] = [
    (64, 2),
    (64, 4),
    (64, 8),
    (64, 16),
    (128, 2),
    (128, 4),
    (128, 8),
    (128, 16),
    (256, 2),
    (256, 4),
    (256, 8),
];
/// Keys one decode block takes per round (4 warps × 32: attention.cu `attn_parts_impl`'s TK).
pub(crate) const DECODE_TILE: usize = 128;
/// Warps per decode block.
const DECODE_WARPS: usize = 4;

/// The index in [`DECODE_KERNELS`] of the kernel for `group` query heads per kv head at
/// `head_dim`: the smallest instantiated group that holds it.
pub(crate) fn decode_index(head_dim: usize, group: usize) -> Option<usize> {
    DECODE_KERNELS
        .iter()
        .position(|&(d, g)| d == head_dim && g >= group)
}

/// Dynamic shared memory of `attn_parts_{head_dim}_{group}` over a pool whose key and value
/// records are `key_code_bytes` and `value_code_bytes` long (multiples of 4): the query and
/// its QJL sketch (`[D][G]` floats each), the warps' chunk weights, the two roles' part
/// tables and each warp's two chunks of 32 staged value rows (record and two scales) and key
/// rows (record padded to an odd number of words); or the warps' final states, or a windowed
/// pool's exact split, whichever is largest (the launch takes the larger of this and the
/// merge's). Below head_dim 256 the rows are those of the widest records, whatever the pool's
/// (attention.cu `attn_parts_impl` says why).
pub(crate) fn decode_smem_bytes(
    head_dim: usize,
    group: usize,
    key_code_bytes: usize,
    value_code_bytes: usize,
) -> usize {
    const ROLE_BYTES: usize = 4 * (5 + 2 * (7 + 16));
    let (key_words, value_words) = if head_dim > 128 {
        (key_code_bytes / 4, value_code_bytes / 4)
    } else {
        (head_dim / 8 + head_dim / 32, head_dim / 8)
    };
    let stage_words = 2 * 32 * ((value_words + 2) + (key_words | 1));
    let loop_bytes =
        4 * (2 * head_dim * group + DECODE_WARPS * (32 * group + stage_words)) + 2 * ROLE_BYTES;
    let states = 4 * DECODE_WARPS * group * (head_dim + 2);
    let exact = 4 * head_dim * 16 + 2 * 32 * head_dim * 2;
    loop_bytes.max(states).max(exact)
}

/// Why `parts` has no parts kernel at `head_dim`, or `None` when it has one.
pub(crate) fn unsupported(parts: &DeviceParts, head_dim: usize) -> Option<String> {
    if !PARTS_HEAD_DIMS.contains(&head_dim) {
        return Some(format!(
            "head_dim {head_dim} (fractional widths, prod keys and 1-bit codes have kernels for \
             head_dim {PARTS_HEAD_DIMS:?})"
        ));
    }
    if parts.parts.is_empty() || parts.parts.len() > 2 {
        return Some(format!("{} parts (one or two are read)", parts.parts.len()));
    }
    for p in &parts.parts {
        let m = p.channels.len();
        if !matches!(m, 32 | 64 | 128 | 256) {
            return Some(format!(
                "a part of {m} channels (32, 64, 128 or 256 are read)"
            ));
        }
    }
    None
}

/// The descriptor words of one role (parts.cu documents them) for blocks of `layout`.
pub(crate) fn parts_descriptor(
    parts: &DeviceParts,
    layout: &BlockLayout,
) -> Result<Vec<u32>, Error> {
    let word = |what: &str, n: usize| {
        u32::try_from(n).map_err(|_| Error::Cuda {
            op: "kv pool",
            detail: format!("{what} {n} does not fit a descriptor"),
        })
    };
    let mut w = vec![0u32; PARTS_DESC_WORDS];
    w[0] = word("parts", parts.parts.len())?;
    w[1] = word("code bytes", layout.code_bytes_per_token)?;
    w[2] = word("block bytes", layout.total_bytes)?;
    w[3] = word("scalars offset", layout.scalars_offset)?;
    w[4] = word("scalars per token", layout.scalars_per_token)?;
    w[5] = u32::from(parts.corrected_norm);
    let mut first = 0usize;
    for (i, p) in parts.parts.iter().enumerate() {
        let m = p.channels.len();
        if m > MAX_PART || p.centroids.len() > 16 || p.boundaries.len() > 15 {
            return Err(Error::Cuda {
                op: "kv pool",
                detail: format!("a part of {m} channels at {} bits", p.bits),
            });
        }
        let d = &mut w[HEADER + i * PART_WORDS..HEADER + (i + 1) * PART_WORDS];
        d[0] = word("part channels", m)?;
        d[1] = u32::from(p.bits);
        d[2] = word("code offset", p.code_offset)?;
        d[3] = word("scale index", p.scalar_index)?;
        d[6] = word("basis offset", first)?;
        d[7] = p.sigma.to_bits();
        d[8] = (1.0 / p.sigma).to_bits();
        if let Some(q) = &p.qjl {
            d[4] = 1;
            d[5] = word("sign offset", q.sign_offset)?;
            d[9] = q.constant.to_bits();
            d[QJL0..QJL0 + m].copy_from_slice(&q.sign_masks[0]);
            d[QJL1..QJL1 + m].copy_from_slice(&q.sign_masks[1]);
        }
        for (k, b) in p.boundaries.iter().enumerate() {
            d[BOUNDS + k] = b.to_bits();
        }
        for (k, c) in p.centroids.iter().enumerate() {
            d[CENTROIDS + k] = c.to_bits();
        }
        d[MASKS..MASKS + m].copy_from_slice(&p.sign_masks);
        for (k, &c) in p.channels.iter().enumerate() {
            d[CHANNELS + k] = u32::from(c);
        }
        first += m;
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use turbokv_codec::{CodecOptions, KeyMode, LayerCodec};

    #[test]
    fn descriptors_hold_each_part() {
        let opts = CodecOptions {
            key_mode: KeyMode::Prod,
            ..Default::default()
        };
        let codec = LayerCodec::new("tq3.5".parse().unwrap(), 128, 2, &opts).unwrap();
        let parts = codec.key.device_parts().unwrap();
        assert!(unsupported(&parts, 128).is_none());
        assert!(unsupported(&parts, 96).is_some());
        let layout = codec.key.block_layout(16).unwrap();
        let w = parts_descriptor(&parts, &layout).unwrap();
        assert_eq!(w[0], 2);
        assert_eq!(w[1] as usize, layout.code_bytes_per_token);
        assert_eq!(w[4], 4, "norm and γ per part");
        for (i, p) in parts.parts.iter().enumerate() {
            let d = &w[HEADER + i * PART_WORDS..];
            assert_eq!(d[0], 64);
            assert_eq!(d[1], u32::from(p.bits));
            assert_eq!(
                d[6] as usize,
                64 * i,
                "parts back to back in the attention basis"
            );
            assert_eq!(d[3] as usize, p.scalar_index);
            let q = p.qjl.as_ref().unwrap();
            assert_eq!((d[4], d[5] as usize), (1, q.sign_offset));
            assert_eq!(&d[QJL1..QJL1 + 64], &q.sign_masks[1][..]);
            assert_eq!(&d[MASKS..MASKS + 64], &p.sign_masks[..]);
            let ch: Vec<u16> = d[CHANNELS..CHANNELS + 64]
                .iter()
                .map(|&c| c as u16)
                .collect();
            assert_eq!(ch, p.channels);
            assert_eq!(f32::from_bits(d[CENTROIDS + 1]), p.centroids[1]);
        }
        // Decode kernels: the smallest group that holds the query heads, at the parts head dims.
        assert_eq!(DECODE_KERNELS[decode_index(128, 3).unwrap()], (128, 4));
        assert_eq!(DECODE_KERNELS[decode_index(64, 5).unwrap()], (64, 8));
        assert_eq!(DECODE_KERNELS[decode_index(128, 16).unwrap()], (128, 16));
        assert_eq!(DECODE_KERNELS[decode_index(256, 8).unwrap()], (256, 8));
        assert_eq!(DECODE_KERNELS[decode_index(256, 1).unwrap()], (256, 2));
        assert_eq!(DECODE_KERNELS[decode_index(128, 1).unwrap()], (128, 2));
        assert_eq!(DECODE_KERNELS[decode_index(64, 2).unwrap()], (64, 2));
        assert_eq!(DECODE_KERNELS[decode_index(256, 3).unwrap()], (256, 4));
        assert!(decode_index(128, 17).is_none() && decode_index(256, 16).is_none());
        // Every head dim has kernels up to the coded pools' largest group there, none above.
        for d in PARTS_HEAD_DIMS {
            let most = crate::cuda::codes::coded_max_group(d);
            let groups: Vec<usize> = DECODE_KERNELS
                .iter()
                .filter(|k| k.0 == d)
                .map(|k| k.1)
                .collect();
            assert_eq!(groups.last(), Some(&most), "head_dim {d}");
        }
        // Two blocks fit an SM's 227 KiB at each head dim's largest group with the widest
        // records (4-bit codes and a sign bit per dim).
        let widest = |d: usize| d / 2 + d / 8;
        assert!(2 * decode_smem_bytes(128, 16, widest(128), widest(128)) <= 227 * 1024);
        assert!(2 * decode_smem_bytes(256, 8, widest(256), widest(256)) <= 227 * 1024);
        // Narrower records take less: tq2.5 at head_dim 256 (80-byte records) fits four blocks
        // of the group-2 kernel an SM, where rows sized for the widest fitted two.
        assert!(4 * (decode_smem_bytes(256, 2, 80, 80) + 1024) <= 228 * 1024);
        assert!(decode_smem_bytes(256, 2, 80, 80) < decode_smem_bytes(256, 2, 160, 128));
        assert_eq!(
            decode_smem_bytes(128, 4, 40, 40),
            decode_smem_bytes(128, 4, widest(128), widest(128))
        );
        // Whole head vectors of 256 channels (prod keys) fit a part.
        let c256 = LayerCodec::new("tq3".parse().unwrap(), 256, 0, &opts).unwrap();
        let p256 = c256.key.device_parts().unwrap();
        assert!(unsupported(&p256, 256).is_none());
        parts_descriptor(&p256, &c256.key.block_layout(16).unwrap()).unwrap();
        // The outlier part has the wider codes.
        assert_eq!(parts.parts[0].bits, 3, "prod: 4 − 1 bits of MSE codes");
        assert_eq!(parts.parts[1].bits, 2);
    }
}
