//! The 256-element K-quant super-blocks: layouts, dequantization (bit-exact with ggml's
//! `dequantize_row_q{4,5,6}_K`) and quantization (ggml's `quantize_row_q{4,5,6}_K_ref`,
//! scale/min search included, ported statement by statement).
//!
//! Layouts (little-endian halves `d`, `dmin`):
//!
//! | format | bytes | layout                                                           |
//! |--------|-------|------------------------------------------------------------------|
//! | Q4_K   | 144   | `d`, `dmin`, `scales[12]`, `qs[128]`                             |
//! | Q5_K   | 176   | `d`, `dmin`, `scales[12]`, `qh[32]`, `qs[128]`                   |
//! | Q6_K   | 210   | `ql[128]`, `qh[64]`, `scales: [i8; 16]`, `d`                     |
//!
//! Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scale `sc` and min `m` packed in `scales[12]`
//! (see [`scale_min_k4`]); element = `d·sc·q − dmin·m`. Each 64-element group `g` reads the
//! 32 bytes `qs[32g..32g+32]`: low nibbles are sub-block `2g`, high nibbles sub-block `2g+1`.
//! Q5_K's fifth bit of element `l` of sub-block `s` is bit `s` of `qh[l]`.
//! Q6_K: 16 sub-blocks of 16 with int8 scales; element = `d·sc·(q − 32)`, `q` 6-bit, split
//! into a nibble in `ql` and two bits in `qh` (see [`q6k_code`]).

use super::GgmlType;
use super::blocks::{f16_at, put_f16};

/// Elements per super-block.
pub(crate) const QK_K: usize = 256;

/// Bytes of a Q4_K super-block.
pub(crate) const Q4K_BYTES: usize = 144;
/// Bytes of a Q5_K super-block.
pub(crate) const Q5K_BYTES: usize = 176;
/// Bytes of a Q6_K super-block.
pub(crate) const Q6K_BYTES: usize = 210;

/// ggml's `nearest_int`: round half to even through the float mantissa (valid for
/// |x| < 2^22; larger or non-finite inputs give garbage, never a panic).
#[inline(always)]
pub(crate) fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K or
/// Q5_K super-block. Sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` and `j + 4`;
/// sub-blocks 4..8 keep the low 4 bits in byte `j + 4` and the top 2 bits in the spare high
/// bits of bytes `j − 4` (scale) and `j` (min).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 6-bit code of element `i` (0..256) of a Q6_K super-block with halves `ql`, `qh`.
/// Within each 128-element half `h`: element `l + 32k` (l < 32, k < 4) takes the nibble of
/// `ql[64h + l + 32(k & 1)]` (low for k < 2, high otherwise) and bits `2k..2k+2` of
/// `qh[32h + l]`.
#[inline(always)]
pub(crate) fn q6k_code(ql: &[u8], qh: &[u8], i: usize) -> u8 {
    let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
    let byte = ql[64 * h + l + 32 * (k & 1)];
    let low = if k < 2 { byte & 0xF } else { byte >> 4 };
    low | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)
}

/// Dequantizes one super-block.
type DequantFn = fn(&[u8], &mut [f32]);
/// Quantizes one super-block.
type QuantFn = fn(&[f32], &mut [u8]);

/// Dequantizes the whole super-blocks of `src` into `dst` (`ty` a K-quant; others: no-op).
pub(super) fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let (bytes, f): (usize, DequantFn) = match ty {
        GgmlType::Q4K => (Q4K_BYTES, dequant_q4k),
        GgmlType::Q5K => (Q5K_BYTES, dequant_q5k),
        GgmlType::Q6K => (Q6K_BYTES, dequant_q6k),
        _ => return,
    };
    for (b, y) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(QK_K)) {
        f(b, y);
    }
}

/// Quantizes the whole super-blocks of `src` into `dst` (`ty` a K-quant; others: no-op).
pub(super) fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    let (bytes, f): (usize, QuantFn) = match ty {
        GgmlType::Q4K => (Q4K_BYTES, quant_q4k),
        GgmlType::Q5K => (Q5K_BYTES, quant_q5k),
        GgmlType::Q6K => (Q6K_BYTES, quant_q6k),
        _ => return,
    };
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(bytes)) {
        f(x, b);
    }
}

fn dequant_q4k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b), f16_at(&b[2..]));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for g in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        for l in 0..32 {
            let q = qs[32 * g + l];
            y[64 * g + l] = d1 * f32::from(q & 0xF) - m1;
            y[64 * g + 32 + l] = d2 * f32::from(q >> 4) - m2;
        }
    }
}

fn dequant_q5k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b), f16_at(&b[2..]));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for g in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        for l in 0..32 {
            let q = qs[32 * g + l];
            let h1 = ((qh[l] >> (2 * g)) & 1) << 4;
            let h2 = ((qh[l] >> (2 * g + 1)) & 1) << 4;
            y[64 * g + l] = d1 * f32::from((q & 0xF) + h1) - m1;
            y[64 * g + 32 + l] = d2 * f32::from((q >> 4) + h2) - m2;
        }
    }
}

fn dequant_q6k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(&b[208..]);
    for (i, y) in y.iter_mut().enumerate().take(QK_K) {
        let q = i32::from(q6k_code(ql, qh, i)) - 32;
        // ggml: `d * sc[is] * q` evaluates left to right.
        *y = d * f32::from(sc[i / 16] as i8) * q as f32;
    }
}

/// Packs 8 six-bit scales and mins into the 12-byte layout [`scale_min_k4`] reads.
fn pack_scales_k4(ls: &[u8; 8], lm: &[u8; 8], out: &mut [u8]) {
    for j in 0..8 {
        if j < 4 {
            out[j] = ls[j];
            out[j + 4] = lm[j];
        } else {
            out[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            out[j - 4] |= (ls[j] >> 4) << 6;
            out[j] |= (lm[j] >> 4) << 6;
        }
    }
}

/// Shared body of the Q4_K/Q5_K reference quantizers: per-sub-block scale/min search, 6-bit
/// scales, then re-quantization against the stored (rounded) scales. Writes `d`, `dmin` and
/// the scales into `b[..16]` and returns the codes (0..=nmax).
fn quant_k4_codes(x: &[f32], b: &mut [u8], nmax: i32, rmin: f32, nstep: i32) -> [u8; QK_K] {
    let mut codes = [0u8; QK_K];
    let mut weights = [0f32; 32];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut codes[32 * j..32 * j + 32],
            rmin,
            nstep,
        );
        (scales[j], mins[j]) = (s, m);
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    // C stores `nearest_int` into a uint8_t (modulo 256) before clamping to 63.
    let ls = scales.map(|s| (nearest_int(inv_scale * s) as u8).min(63));
    let lm = mins.map(|m| (nearest_int(inv_min * m) as u8).min(63));
    pack_scales_k4(&ls, &lm, &mut b[4..16]);
    put_f16(b, max_scale / 63.0);
    put_f16(&mut b[2..], max_min / 63.0);
    let (d_all, dmin_all) = (f16_at(b), f16_at(&b[2..]));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        let d = d_all * f32::from(sc);
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * f32::from(m);
        for i in 32 * j..32 * j + 32 {
            codes[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    codes
}

fn quant_q4k(x: &[f32], b: &mut [u8]) {
    let codes = quant_k4_codes(x, b, 15, -1.0, 20);
    let qs = &mut b[16..144];
    for g in 0..4 {
        for l in 0..32 {
            qs[32 * g + l] = codes[64 * g + l] | (codes[64 * g + 32 + l] << 4);
        }
    }
}

fn quant_q5k(x: &[f32], b: &mut [u8]) {
    let codes = quant_k4_codes(x, b, 31, -0.5, 15);
    let (qh, qs) = b[16..176].split_at_mut(32);
    qh.fill(0);
    for g in 0..4 {
        for l in 0..32 {
            let (c1, c2) = (codes[64 * g + l], codes[64 * g + 32 + l]);
            qh[l] |= ((c1 >> 4) << (2 * g)) | ((c2 >> 4) << (2 * g + 1));
            qs[32 * g + l] = (c1 & 0xF) | ((c2 & 0xF) << 4);
        }
    }
}

fn quant_q6k(x: &[f32], b: &mut [u8]) {
    let mut codes = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for (ib, s) in scales.iter_mut().enumerate() {
        *s = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut codes[16 * ib..16 * ib + 16],
        );
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = *s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        b[..Q6K_BYTES].fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(&mut b[208..], 1.0 / iscale);
    for (ib, s) in scales.iter().enumerate() {
        b[192 + ib] = nearest_int(iscale * s).clamp(-128, 127) as i8 as u8;
    }
    let d_all = f16_at(&b[208..]);
    for j in 0..16 {
        let d = d_all * f32::from(b[192 + j] as i8);
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            codes[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, qh) = b[..192].split_at_mut(128);
    for h in 0..2 {
        for l in 0..32 {
            let c = |k: usize| codes[128 * h + 32 * k + l];
            ql[64 * h + l] = (c(0) & 0xF) | ((c(2) & 0xF) << 4);
            ql[64 * h + l + 32] = (c(1) & 0xF) | ((c(3) & 0xF) << 4);
            qh[32 * h + l] =
                (c(0) >> 4) | ((c(1) >> 4) << 2) | ((c(2) >> 4) << 4) | ((c(3) >> 4) << 6);
        }
    }
}

/// ggml's threshold below which a group counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `make_qkx2_quants` (squared error, no MAD): fits `x ≈ scale·L + min` with
/// `L` in 0..=nmax and `min ≤ 0`, trying `nstep + 1` candidate scales around `nmax/(max−min)`.
/// Returns `(scale, −min)`.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len().min(weights.len()).min(l_out.len()).min(32);
    if n == 0 {
        return (0.0, 0.0);
    }
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + 0.1 * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let (w, lf) = (weights[i], l as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no importance weights (so `w = x²`):
/// symmetric codes `L + nmax` in `0..2·nmax`, searching 19 scales around `−nmax/max`.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [u8]) -> f32 {
    let n = x.len().min(l_out.len());
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in &x[..n] {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    // Returns (sum w·x·l, sum w·l²) for a candidate inverse scale, writing codes if asked.
    let fit = |iscale: f32, out: Option<&mut [u8]>| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        let mut out = out;
        for (i, &v) in x[..n].iter().enumerate() {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            if let Some(o) = out.as_deref_mut() {
                o[i] = (l + nmax) as u8;
            }
            let (w, lf) = (v * v, l as f32);
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        (sumlx, suml2)
    };
    let (sumlx, suml2) = fit(-nmaxf / max, Some(&mut l_out[..n]));
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmaxf + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale, None);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            fit(iscale, Some(&mut l_out[..n]));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}
