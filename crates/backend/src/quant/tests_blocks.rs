//! Tests of the block formats: round-trip error under a committed per-format budget,
//! known-answer blocks that pin each layout, activation quantizers, and bad sizes.

use super::activations::{Q8Block, quantize_q8, quantize_q8_scalar};
use super::kquants::scale_min_k4;
use super::{GgmlType, WeightBytes, WeightMatrix, dequantize_row, quantize_row};
use crate::Error;
use half::f16;

/// Every format, in `from_ggml_id` order.
pub(super) const ALL: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Small deterministic generator (splitmix64) so tests need no extra crate.
pub(super) struct Rng(pub u64);

impl Rng {
    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub(super) fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly normal (sum of four uniforms), with a rare ×8 outlier like real weights.
    pub(super) fn weight(&mut self) -> f32 {
        let g = (0..4).map(|_| self.uniform()).sum::<f32>() * 0.866;
        if self.next_u64().is_multiple_of(64) {
            8.0 * g
        } else {
            g
        }
    }
    pub(super) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.weight()).collect()
    }
}

/// Quantizes `rows` rows of `values` into a [`WeightMatrix`] of `ty`.
pub(super) fn matrix(ty: GgmlType, rows: usize, cols: usize, values: &[f32]) -> WeightMatrix {
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * rb];
    for (b, v) in bytes.chunks_exact_mut(rb).zip(values.chunks_exact(cols)) {
        quantize_row(ty, v, b).unwrap();
    }
    WeightMatrix::new(
        ty,
        rows,
        cols,
        WeightBytes::Owned(std::sync::Arc::new(bytes)),
    )
    .unwrap()
}

/// Committed budget: relative RMS error of dequantize(quantize(x)) on [`Rng::weight`] data
/// (near-normal with 1/64 of values ×8 outliers, which dominate the error of the block scale
/// formats). Measured values (4096 values, seed 7) in the comments; budgets ~25% above.
fn budget(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => 3e-4,    // 2.14e-4: 11 significant bits
        GgmlType::Bf16 => 2.3e-3, // 1.72e-3: 8 significant bits
        GgmlType::Q8_0 => 1.3e-2, // 9.67e-3
        GgmlType::Q6K => 3.5e-2,  // 2.76e-2
        GgmlType::Q5_1 => 6.2e-2, // 4.84e-2
        GgmlType::Q5K => 6.2e-2,  // 4.87e-2
        GgmlType::Q5_0 => 9.5e-2, // 7.49e-2: symmetric, one side of the range unused
        GgmlType::Q4K => 0.12,    // 9.37e-2
        GgmlType::Q4_1 => 0.13,   // 1.01e-1
        GgmlType::Q4_0 => 0.19,   // 1.52e-1
    }
}

fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn round_trip_error_within_budget() {
    let mut rng = Rng(7);
    let x = rng.vec(4096);
    for ty in ALL {
        let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &q, &mut y).unwrap();
        let err = rel_rms(&x, &y);
        assert!(
            err <= budget(ty),
            "{ty:?}: relative RMS error {err:.3e} over budget {:.1e}",
            budget(ty)
        );
    }
}

#[test]
fn quantizing_a_dequantized_row_is_stable() {
    // Round-to-nearest formats reproduce values already on their grid.
    let mut rng = Rng(11);
    let x = rng.vec(512);
    for ty in [
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
    ] {
        let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &q, &mut y).unwrap();
        let mut q2 = vec![0u8; q.len()];
        quantize_row(ty, &y, &mut q2).unwrap();
        let mut y2 = vec![0f32; x.len()];
        dequantize_row(ty, &q2, &mut y2).unwrap();
        assert!(rel_rms(&y, &y2) < 2e-3, "{ty:?}");
    }
}

fn h(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

fn deq(ty: GgmlType, block: &[u8]) -> Vec<f32> {
    let mut y = vec![0f32; ty.block_len()];
    dequantize_row(ty, block, &mut y).unwrap();
    y
}

#[test]
fn known_answer_32_element_formats() {
    // qs[j] = j | (15 − j) << 4: element j (< 16) is the low nibble j, element 16 + j the
    // high nibble 15 − j.
    let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
    let nib = |e: usize| if e < 16 { e as f32 } else { (31 - e) as f32 };

    let b: Vec<u8> = [&h(0.5)[..], &qs].concat();
    let y = deq(GgmlType::Q4_0, &b);
    (0..32).for_each(|e| assert_eq!(y[e], (nib(e) - 8.0) * 0.5, "Q4_0 element {e}"));

    let b: Vec<u8> = [&h(0.25)[..], &h(-1.0), &qs].concat();
    let y = deq(GgmlType::Q4_1, &b);
    (0..32).for_each(|e| assert_eq!(y[e], nib(e) * 0.25 - 1.0, "Q4_1 element {e}"));
    assert_eq!(
        (y[0], y[16]),
        (-1.0, 2.75),
        "Q4_1: low nibble of byte 0 is element 0, high is 16"
    );

    // Fifth bits: bit e of qh for element e.
    let qh: u32 = 0xA5C3_0F81;
    let q5 = |e: usize| nib(e) + if qh >> e & 1 == 1 { 16.0 } else { 0.0 };
    let b: Vec<u8> = [&h(2.0)[..], &qh.to_le_bytes(), &qs].concat();
    let y = deq(GgmlType::Q5_0, &b);
    (0..32).for_each(|e| assert_eq!(y[e], (q5(e) - 16.0) * 2.0, "Q5_0 element {e}"));

    let b: Vec<u8> = [&h(0.5)[..], &h(3.0), &qh.to_le_bytes(), &qs].concat();
    let y = deq(GgmlType::Q5_1, &b);
    (0..32).for_each(|e| assert_eq!(y[e], q5(e) * 0.5 + 3.0, "Q5_1 element {e}"));

    let codes: Vec<u8> = (0..32).map(|e| (e as i8 - 16) as u8).collect();
    let b: Vec<u8> = [&h(-0.125)[..], &codes].concat();
    let y = deq(GgmlType::Q8_0, &b);
    (0..32).for_each(|e| assert_eq!(y[e], (e as f32 - 16.0) * -0.125, "Q8_0 element {e}"));
}

#[test]
fn known_answer_float_formats() {
    assert_eq!(deq(GgmlType::F32, &1.5f32.to_le_bytes()), [1.5]);
    assert_eq!(deq(GgmlType::F16, &[0x00, 0x3C]), [1.0]);
    assert_eq!(deq(GgmlType::Bf16, &[0xC0, 0x3F]), [1.5]);
}

/// Scales bytes whose 6-bit pairs (worked out by hand from the layout) are
/// sc = [1, 2, 3, 4, 17, 3, 5, 55] and m = [5, 6, 7, 8, 34, 4, 6, 8].
const K4_SCALES: [u8; 12] = [
    0x41, 0x02, 0x03, 0xC4, 0x85, 0x06, 0x07, 0x08, 0x21, 0x43, 0x65, 0x87,
];
const K4_SC: [f32; 8] = [1.0, 2.0, 3.0, 4.0, 17.0, 3.0, 5.0, 55.0];
const K4_M: [f32; 8] = [5.0, 6.0, 7.0, 8.0, 34.0, 4.0, 6.0, 8.0];

#[test]
fn k4_scale_packing() {
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &K4_SCALES);
        assert_eq!(
            (f32::from(sc), f32::from(m)),
            (K4_SC[j], K4_M[j]),
            "sub-block {j}"
        );
    }
}

/// Q4_K/Q5_K `qs`: byte i = (i % 16) | (15 − i % 16) << 4. Element e of 64-group g = e / 64:
/// position l = e % 64 < 32 takes the low nibble of byte 32g + l (sub-block 2g), else the high
/// nibble of byte 32g + l − 32 (sub-block 2g + 1).
fn k4_qs() -> Vec<u8> {
    (0..128u8)
        .map(|i| (i % 16) | ((15 - i % 16) << 4))
        .collect()
}
fn k4_nibble(e: usize) -> f32 {
    let l = e % 64;
    if l < 32 {
        (l % 16) as f32
    } else {
        (15 - (l - 32) % 16) as f32
    }
}

#[test]
fn known_answer_q4k_q5k() {
    let b: Vec<u8> = [&h(1.0)[..], &h(0.5), &K4_SCALES, &k4_qs()].concat();
    let y = deq(GgmlType::Q4K, &b);
    for (e, &v) in y.iter().enumerate() {
        let sub = e / 32;
        assert_eq!(
            v,
            K4_SC[sub] * k4_nibble(e) - 0.5 * K4_M[sub],
            "Q4_K element {e}"
        );
    }
    // Fifth bit of element e: bit (e / 32) of qh[e % 32].
    let qh: Vec<u8> = (0..32u8).map(|l| l.wrapping_mul(37) ^ 0x5A).collect();
    let b: Vec<u8> = [&h(0.25)[..], &h(2.0), &K4_SCALES, &qh, &k4_qs()].concat();
    let y = deq(GgmlType::Q5K, &b);
    for (e, &v) in y.iter().enumerate() {
        let sub = e / 32;
        let q = k4_nibble(e)
            + if qh[e % 32] >> sub & 1 == 1 {
                16.0
            } else {
                0.0
            };
        assert_eq!(
            v,
            0.25 * K4_SC[sub] * q - 2.0 * K4_M[sub],
            "Q5_K element {e}"
        );
    }
}

#[test]
fn known_answer_q6k() {
    let ql: Vec<u8> = (0..128u8).map(|i| i.wrapping_mul(7)).collect();
    let qh: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(13)).collect();
    let sc: Vec<u8> = (0..16i8).map(|i| (i - 8) as u8).collect();
    let b: Vec<u8> = [&ql[..], &qh, &sc, &h(0.5)].concat();
    let y = deq(GgmlType::Q6K, &b);
    // ggml's loop: half n, l < 32; q1..q4 at l, l+32, l+64, l+96.
    for n in 0..2 {
        for l in 0..32 {
            let (lo, hi, hb) = (ql[64 * n + l], ql[64 * n + l + 32], qh[32 * n + l]);
            let q = [
                lo & 0xF | (hb & 3) << 4,
                hi & 0xF | (hb >> 2 & 3) << 4,
                lo >> 4 | (hb >> 4 & 3) << 4,
                hi >> 4 | (hb >> 6) << 4,
            ];
            for (k, q) in q.iter().enumerate() {
                let e = 128 * n + l + 32 * k;
                let s = f32::from(sc[e / 16] as i8);
                assert_eq!(y[e], 0.5 * s * (f32::from(*q) - 32.0), "Q6_K element {e}");
            }
        }
    }
    // One element by hand: e = 0 → ql[0] = 0, qh[0] = 0 → q = 0 − 32, scale −8: 0.5·−8·−32.
    assert_eq!(y[0], 128.0);
}

#[test]
fn quantize_known_answers() {
    // A ramp −16..16 step 1: Q8_0 scale 16/127, codes round(v·127/16).
    let x: Vec<f32> = (0..32).map(|e| e as f32 - 16.0).collect();
    let mut b = [0u8; 34];
    quantize_row(GgmlType::Q8_0, &x, &mut b).unwrap();
    assert_eq!(
        f16::from_le_bytes([b[0], b[1]]),
        f16::from_f32(16.0 / 127.0)
    );
    assert_eq!(b[2] as i8, -127);
    assert_eq!(b[3] as i8, -119); // −15·127/16 = −119.06
    // Q4_1 of 0..32 step 1: min 0, d = 31/15, element 16 → round(16·15/31) = 8.
    let x: Vec<f32> = (0..32).map(|e| e as f32).collect();
    let mut b = [0u8; 20];
    quantize_row(GgmlType::Q4_1, &x, &mut b).unwrap();
    assert_eq!(f16::from_le_bytes([b[2], b[3]]).to_f32(), 0.0);
    assert_eq!(
        b[4],
        8 << 4,
        "element 0 → code 0 (low nibble), element 16 → code 8 (high)"
    );
    assert_eq!(b[19] >> 4, 15);
    // Q4_0 puts the largest-magnitude value at code 0 (d = max / −8).
    let mut x = [0.5f32; 32];
    x[3] = -4.0;
    let mut b = [0u8; 18];
    quantize_row(GgmlType::Q4_0, &x, &mut b).unwrap();
    assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), 0.5);
    assert_eq!(b[2 + 3] & 0xF, 0);
}

#[test]
fn all_zero_rows_stay_zero() {
    for ty in ALL {
        let n = ty.block_len().max(32) * 2;
        let mut q = vec![0xFFu8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &vec![0.0; n], &mut q).unwrap();
        let mut y = vec![1f32; n];
        dequantize_row(ty, &q, &mut y).unwrap();
        assert!(y.iter().all(|v| *v == 0.0), "{ty:?}");
    }
}

#[test]
fn non_finite_input_does_not_panic() {
    for ty in ALL {
        let n = ty.block_len().max(32);
        let mut x = vec![1.0f32; n];
        x[1] = f32::NAN;
        x[2] = f32::INFINITY;
        let mut q = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut y = vec![0f32; n];
        dequantize_row(ty, &q, &mut y).unwrap();
    }
}

#[test]
fn bad_sizes_are_errors() {
    for ty in ALL.into_iter().filter(|t| t.block_len() > 1) {
        let bl = ty.block_len();
        let mut y = vec![0f32; bl + 1];
        let r = dequantize_row(ty, &vec![0u8; ty.block_bytes()], &mut y);
        assert!(matches!(r, Err(Error::RaggedRow { .. })), "{ty:?}: {r:?}");
        let r = quantize_row(ty, &y, &mut vec![0u8; ty.block_bytes()]);
        assert!(matches!(r, Err(Error::RaggedRow { .. })), "{ty:?}: {r:?}");
        let mut y = vec![0f32; bl];
        let r = dequantize_row(ty, &vec![0u8; ty.block_bytes() - 1], &mut y);
        assert!(matches!(r, Err(Error::WeightSize { .. })), "{ty:?}: {r:?}");
        let r = quantize_row(ty, &y, &mut vec![0u8; ty.block_bytes() + 1]);
        assert!(matches!(r, Err(Error::WeightSize { .. })), "{ty:?}: {r:?}");
    }
    let r = dequantize_row(GgmlType::F16, &[0u8; 3], &mut [0f32; 2]);
    assert!(matches!(r, Err(Error::WeightSize { .. })));
}

#[test]
fn activation_quantizers_agree_bit_for_bit() {
    if !super::dot_avx2::available() {
        return;
    }
    let mut rng = Rng(3);
    let mut x = rng.vec(32 * 40);
    x[32..64].fill(0.0); // an all-zero block
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 0.5; // exact halves of the scale: ties
    }
    let (mut a, mut b) = (vec![Q8Block::ZERO; 40], vec![Q8Block::ZERO; 40]);
    quantize_q8(&x, &mut a, true);
    quantize_q8_scalar(&x, &mut b);
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            (a.d.to_bits(), a.s.to_bits(), a.qs),
            (b.d.to_bits(), b.s.to_bits(), b.qs),
            "block {i}"
        );
    }
}

#[test]
fn activation_blocks_carry_their_sum() {
    let mut rng = Rng(5);
    let x = rng.vec(64);
    let mut a = vec![Q8Block::ZERO; 2];
    quantize_q8_scalar(&x, &mut a);
    for b in &a {
        let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
        assert!((b.s - b.d * sum as f32).abs() <= 2e-3 * b.s.abs().max(b.d));
    }
}

#[test]
fn half_widening_is_exact_for_every_bit_pattern() {
    // The SIMD widening (rows of 65536 values) against `half`'s one-at-a-time conversion.
    let src: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let mut y = vec![0f32; 65536];
    dequantize_row(GgmlType::F16, &src, &mut y).unwrap();
    for (i, v) in y.iter().enumerate() {
        let want = f16::from_bits(i as u16).to_f32();
        assert!(
            v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
            "f16 {i:#06x}"
        );
    }
    dequantize_row(GgmlType::Bf16, &src, &mut y).unwrap();
    for (i, v) in y.iter().enumerate() {
        let want = half::bf16::from_bits(i as u16).to_f32();
        assert!(
            v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
            "bf16 {i:#06x}"
        );
    }
}
