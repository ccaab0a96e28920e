//! Byte layouts of the plain float formats and of the 32-element GGML block formats, with
//! dequantization (bit-exact with ggml's `dequantize_row_*`) and round-to-nearest
//! quantization (ggml's `quantize_row_*_ref`).
//!
//! Block layouts (little-endian, no padding; `d`, `m` are IEEE halves):
//!
//! | format | bytes | layout                                   | element `j` (0..32)            |
//! |--------|-------|------------------------------------------|--------------------------------|
//! | Q4_0   | 18    | `d`, `qs[16]`                            | `(nib(j) - 8)·d`               |
//! | Q4_1   | 20    | `d`, `m`, `qs[16]`                       | `nib(j)·d + m`                 |
//! | Q5_0   | 22    | `d`, `qh: u32`, `qs[16]`                 | `(nib(j) | bit(j)<<4 - 16)·d`  |
//! | Q5_1   | 24    | `d`, `m`, `qh: u32`, `qs[16]`            | `(nib(j) | bit(j)<<4)·d + m`   |
//! | Q8_0   | 34    | `d`, `qs: [i8; 32]`                      | `qs[j]·d`                      |
//!
//! `nib(j)` is the low nibble of `qs[j]` for `j < 16` and the high nibble of `qs[j - 16]`
//! otherwise; `bit(j)` is bit `j` of `qh`.
//!
//! Every function here works on whatever whole blocks the slices hold and never panics on
//! short input; the size checks live in the public entry points (`mod.rs`).

use super::GgmlType;
use half::{bf16, f16};

/// Elements per block of the 32-element formats.
pub(crate) const QK: usize = 32;

/// Reads the little-endian half at the start of `b` (which holds at least 2 bytes).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Rounds `v` to the nearest half (ties to even, as F16C and ggml do) and writes it.
#[inline(always)]
pub(crate) fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The value `v` takes once stored as a half: what a reader of the block sees.
#[inline(always)]
pub(crate) fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Dequantizes the whole blocks of `src` into `dst` (a non-K-quant `ty`).
pub(super) fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 if !super::float_avx2::widen_half(false, src, dst) => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Bf16 if !super::float_avx2::widen_half(true, src, dst) => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::F16 | GgmlType::Bf16 => {}
        GgmlType::Q4_0 => each_block(src, dst, 18, dequant_q4_0),
        GgmlType::Q4_1 => each_block(src, dst, 20, dequant_q4_1),
        GgmlType::Q5_0 => each_block(src, dst, 22, dequant_q5_0),
        GgmlType::Q5_1 => each_block(src, dst, 24, dequant_q5_1),
        GgmlType::Q8_0 => each_block(src, dst, 34, dequant_q8_0),
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => super::kquants::dequantize(ty, src, dst),
    }
}

/// Quantizes the whole blocks of `src` into `dst` (a non-K-quant `ty`).
pub(super) fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    match ty {
        GgmlType::F32 => {
            for (b, x) in dst.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&x.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (b, x) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
        GgmlType::Bf16 => {
            for (b, x) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
            }
        }
        GgmlType::Q4_0 => each_block_mut(src, dst, 18, quant_q4_0),
        GgmlType::Q4_1 => each_block_mut(src, dst, 20, quant_q4_1),
        GgmlType::Q5_0 => each_block_mut(src, dst, 22, quant_q5_0),
        GgmlType::Q5_1 => each_block_mut(src, dst, 24, quant_q5_1),
        GgmlType::Q8_0 => each_block_mut(src, dst, 34, quant_q8_0),
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => super::kquants::quantize(ty, src, dst),
    }
}

/// Applies `f` to each (block bytes, 32 outputs) pair.
fn each_block(src: &[u8], dst: &mut [f32], bytes: usize, f: fn(&[u8], &mut [f32; QK])) {
    for (b, y) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(QK)) {
        if let Ok(y) = <&mut [f32; QK]>::try_from(y) {
            f(b, y);
        }
    }
}

/// Applies `f` to each (32 inputs, block bytes) pair.
fn each_block_mut(src: &[f32], dst: &mut [u8], bytes: usize, f: fn(&[f32; QK], &mut [u8])) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(bytes)) {
        if let Ok(x) = <&[f32; QK]>::try_from(x) {
            f(x, b);
        }
    }
}

/// The 4-bit code of element `j` (low nibbles hold elements 0..16, high nibbles 16..32).
#[inline(always)]
fn nib(qs: &[u8], j: usize) -> u8 {
    if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    }
}

fn dequant_q4_0(b: &[u8], y: &mut [f32; QK]) {
    let d = f16_at(b);
    for (j, y) in y.iter_mut().enumerate() {
        *y = (i32::from(nib(&b[2..], j)) - 8) as f32 * d;
    }
}

fn dequant_q4_1(b: &[u8], y: &mut [f32; QK]) {
    let (d, m) = (f16_at(b), f16_at(&b[2..]));
    for (j, y) in y.iter_mut().enumerate() {
        *y = f32::from(nib(&b[4..], j)) * d + m;
    }
}

fn dequant_q5_0(b: &[u8], y: &mut [f32; QK]) {
    let d = f16_at(b);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, y) in y.iter_mut().enumerate() {
        let q = nib(&b[6..], j) | ((((qh >> j) & 1) as u8) << 4);
        *y = (i32::from(q) - 16) as f32 * d;
    }
}

fn dequant_q5_1(b: &[u8], y: &mut [f32; QK]) {
    let (d, m) = (f16_at(b), f16_at(&b[2..]));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, y) in y.iter_mut().enumerate() {
        let q = nib(&b[8..], j) | ((((qh >> j) & 1) as u8) << 4);
        *y = f32::from(q) * d + m;
    }
}

fn dequant_q8_0(b: &[u8], y: &mut [f32; QK]) {
    let d = f16_at(b);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

/// The value of largest magnitude (first one on ties), as ggml's `*_0` quantizers pick it.
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Smallest and largest value, starting from ±f32::MAX like ggml's `*_1` quantizers.
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// Packs 32 codes (< 16 in the low 4 bits) into 16 bytes, element j + 16 in the high nibble.
fn pack_nibbles(codes: &[u8; QK], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = (codes[j] & 0x0F) | ((codes[j + 16] & 0x0F) << 4);
    }
}

/// Bit j of the result is bit 4 of `codes[j]`.
fn high_bits(codes: &[u8; QK]) -> u32 {
    codes
        .iter()
        .enumerate()
        .fold(0u32, |qh, (j, &c)| qh | (u32::from((c >> 4) & 1) << j))
}

/// `1/d`, or 0 for an all-zero block (ggml's `d ? 1.0f/d : 0.0f`).
fn inverse(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

fn quant_q4_0(x: &[f32; QK], b: &mut [u8]) {
    let d = signed_absmax(x) / -8.0;
    let id = inverse(d);
    put_f16(b, d);
    // `as i8` truncates toward zero like C's `(int8_t)`; the clamp only matters for NaN.
    let codes = x.map(|v| ((v * id + 8.5) as i8).clamp(0, 15) as u8);
    pack_nibbles(&codes, &mut b[2..18]);
}

fn quant_q4_1(x: &[f32; QK], b: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    put_f16(b, d);
    put_f16(&mut b[2..], min);
    let codes = x.map(|v| (((v - min) * id + 0.5) as i8).clamp(0, 15) as u8);
    pack_nibbles(&codes, &mut b[4..20]);
}

fn quant_q5_0(x: &[f32; QK], b: &mut [u8]) {
    let d = signed_absmax(x) / -16.0;
    let id = inverse(d);
    put_f16(b, d);
    let codes = x.map(|v| ((v * id + 16.5) as i8).clamp(0, 31) as u8);
    b[2..6].copy_from_slice(&high_bits(&codes).to_le_bytes());
    pack_nibbles(&codes, &mut b[6..22]);
}

fn quant_q5_1(x: &[f32; QK], b: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    put_f16(b, d);
    put_f16(&mut b[2..], min);
    let codes = x.map(|v| (((v - min) * id + 0.5) as u8).min(31));
    b[4..8].copy_from_slice(&high_bits(&codes).to_le_bytes());
    pack_nibbles(&codes, &mut b[8..24]);
}

fn quant_q8_0(x: &[f32; QK], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    put_f16(b, d);
    for (q, v) in b[2..34].iter_mut().zip(x) {
        // `round` is C's `roundf` (half away from zero); `as i8` saturates.
        *q = (v * id).round() as i8 as u8;
    }
}
