//! Plain reference dot products of one weight row with quantized activations: integer sums
//! per block, scaled in f32, exactly the quantity the AVX2 kernels compute (only the f32
//! summation order differs).
//!
//! Legacy formats against [`Q8Block`]: `Σ_b d_w·d_a·Σ_j q_w[j]·q_a[j]` (+ `m_w·s_a` for the
//! `*_1` formats, whose elements are `d·q + m`). K-quants against [`Q8KBlock`]:
//! `Σ_b d_w·d_a·Σ_sub sc·Σ q_w·q_a − dmin_w·d_a·Σ_sub m·bsum`.
//!
//! Each function reads the whole blocks both slices hold and never panics on short input.

use super::GgmlType;
use super::activations::{Q8Block, Q8KBlock};
use super::blocks::f16_at;
use super::kquants::{Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, q6k_code, scale_min_k4};

/// Dot of one row of a 32-element format with `acts` (one Q8 block per weight block).
pub(crate) fn dot_q8(ty: GgmlType, row: &[u8], acts: &[Q8Block]) -> f32 {
    match ty {
        GgmlType::Q4_0 => dot_blocks(row, acts, 18, |b, a| {
            let isum = (0..32)
                .map(|j| (i32::from(nib(&b[2..], j)) - 8) * i32::from(a.qs[j]))
                .sum::<i32>();
            f16_at(b) * a.d * isum as f32
        }),
        GgmlType::Q4_1 => dot_blocks(row, acts, 20, |b, a| {
            let isum = (0..32)
                .map(|j| i32::from(nib(&b[4..], j)) * i32::from(a.qs[j]))
                .sum::<i32>();
            f16_at(b) * a.d * isum as f32 + f16_at(&b[2..]) * a.s
        }),
        GgmlType::Q5_0 => dot_blocks(row, acts, 22, |b, a| {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let isum = (0..32)
                .map(|j| (i32::from(nib5(&b[6..], qh, j)) - 16) * i32::from(a.qs[j]))
                .sum::<i32>();
            f16_at(b) * a.d * isum as f32
        }),
        GgmlType::Q5_1 => dot_blocks(row, acts, 24, |b, a| {
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let isum = (0..32)
                .map(|j| i32::from(nib5(&b[8..], qh, j)) * i32::from(a.qs[j]))
                .sum::<i32>();
            f16_at(b) * a.d * isum as f32 + f16_at(&b[2..]) * a.s
        }),
        GgmlType::Q8_0 => dot_blocks(row, acts, 34, |b, a| {
            let isum = (0..32)
                .map(|j| i32::from(b[2 + j] as i8) * i32::from(a.qs[j]))
                .sum::<i32>();
            f16_at(b) * a.d * isum as f32
        }),
        _ => 0.0,
    }
}

/// Dot of one row of a K-quant format with `acts` (one Q8K block per super-block).
pub(crate) fn dot_q8k(ty: GgmlType, row: &[u8], acts: &[Q8KBlock]) -> f32 {
    match ty {
        GgmlType::Q4K => dot_blocks(row, acts, Q4K_BYTES, |b, a| {
            dot_k4(b, a, |l| nibble_k4(&b[16..], l))
        }),
        GgmlType::Q5K => dot_blocks(row, acts, Q5K_BYTES, |b, a| {
            dot_k4(b, a, |l| {
                nibble_k4(&b[48..], l) | (((b[16 + l % 32] >> (l / 32)) & 1) << 4)
            })
        }),
        GgmlType::Q6K => dot_blocks(row, acts, Q6K_BYTES, |b, a| {
            let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
            let mut isum = 0i32;
            for (g, &s) in sc.iter().enumerate() {
                let sub: i32 = (16 * g..16 * g + 16)
                    .map(|i| (i32::from(q6k_code(ql, qh, i)) - 32) * i32::from(a.qs[i]))
                    .sum();
                isum += i32::from(s as i8) * sub;
            }
            f16_at(&b[208..]) * a.d * isum as f32
        }),
        _ => 0.0,
    }
}

/// Sums `f(weight block, activation block)` over the whole blocks.
#[inline(always)]
fn dot_blocks<A>(row: &[u8], acts: &[A], bytes: usize, f: impl Fn(&[u8], &A) -> f32) -> f32 {
    row.chunks_exact(bytes)
        .zip(acts)
        .map(|(b, a)| f(b, a))
        .sum()
}

/// Q4_K/Q5_K super-block given the code of each element.
fn dot_k4(b: &[u8], a: &Q8KBlock, code: impl Fn(usize) -> u8) -> f32 {
    let scales = &b[4..16];
    let (mut isum, mut msum) = (0i32, 0i32);
    for sub in 0..8 {
        let (sc, m) = scale_min_k4(sub, scales);
        let s: i32 = (32 * sub..32 * sub + 32)
            .map(|l| i32::from(code(l)) * i32::from(a.qs[l]))
            .sum();
        isum += i32::from(sc) * s;
        msum += i32::from(m) * (i32::from(a.bsums[2 * sub]) + i32::from(a.bsums[2 * sub + 1]));
    }
    f16_at(b) * a.d * isum as f32 - f16_at(&b[2..]) * a.d * msum as f32
}

/// The nibble of element `l` (0..256) of Q4_K/Q5_K `qs`: 64-element group `l / 64` reads
/// 32 bytes, low nibbles first.
#[inline(always)]
fn nibble_k4(qs: &[u8], l: usize) -> u8 {
    let byte = qs[32 * (l / 64) + l % 32];
    if (l / 32).is_multiple_of(2) {
        byte & 0xF
    } else {
        byte >> 4
    }
}

/// The 4-bit code of element `j` of a 32-element block (low nibbles are elements 0..16).
#[inline(always)]
fn nib(qs: &[u8], j: usize) -> u8 {
    if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    }
}

/// The 5-bit code of element `j`: its nibble plus bit `j` of `qh` as bit 4.
#[inline(always)]
fn nib5(qs: &[u8], qh: u32, j: usize) -> u8 {
    nib(qs, j) | ((((qh >> j) & 1) as u8) << 4)
}
