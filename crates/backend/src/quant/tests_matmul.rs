//! Tests of `WeightMatrix::matmul`: every format against an f64 dequantize-then-dot reference
//! under an error bound derived from the 8-bit activation rounding, AVX2 against scalar, and
//! shape errors.

use super::matmul::{Isa, matmul_with};
use super::tests_blocks::{ALL, Rng, matrix};
use super::{GgmlType, WeightMatrix};
use crate::Error;

/// Relative rounding of an f16 value (half an ulp: 2^-11).
const F16_REL: f64 = 1.0 / 2048.0;

/// Worst-case |kernel − exact| for one output, with `w` the dequantized weight row:
///
/// - activations in blocks of `act_block` are stored as `d̃·q`, `d = amax/127`, `q` rounded to
///   nearest, `d̃` = `d` through f16 for the 32-element formats (f32 for K-quants): per element
///   |x − d̃q| ≤ d/2 + rel·(|x| + d/2);
/// - the `*_1` formats add `m·s̃` with `s̃ = f16(d·Σq)`, off from `d̃·Σq` by ≤ 2·rel·d·Σ|q|,
///   and |m| ≤ the block's largest |w|;
/// - f32 arithmetic: at most `cols` roundings of 2^-24 of Σ|w·x|-sized partial sums.
fn bound(ty: GgmlType, w: &[f64], x: &[f32]) -> f64 {
    let cols = x.len() as f64;
    let wx: f64 = w
        .iter()
        .zip(x)
        .map(|(a, b)| (a * f64::from(*b)).abs())
        .sum();
    let arith = 2.0 * cols * f64::from(f32::EPSILON) * wx + 1e-12;
    let (act_block, rel) = match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => return arith,
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => (256, 1e-6),
        _ => (32, F16_REL),
    };
    let has_min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
    let mut e = arith;
    for (wb, xb) in w.chunks(act_block).zip(x.chunks(act_block)) {
        let d = xb.iter().fold(0f64, |a, v| a.max(f64::from(v.abs()))) / 127.0;
        for (wc, xc) in wb.iter().zip(xb) {
            e += wc.abs() * (d / 2.0 + rel * (f64::from(xc.abs()) + d / 2.0));
        }
        if has_min {
            let wmax = wb.iter().fold(0f64, |a, v| a.max(v.abs()));
            let sum_q: f64 = xb
                .iter()
                .map(|v| f64::from(v.abs()) / d.max(f64::MIN_POSITIVE) + 0.5)
                .sum();
            e += wmax * (1.0 + F16_REL) * 2.0 * rel * d * sum_q;
        }
    }
    e
}

/// The kernel sets this CPU runs: scalar, then AVX2, then AVX2 with VNNI products.
fn isas() -> Vec<Isa> {
    let mut isas = vec![Isa::Scalar];
    if super::dot_avx2::available() {
        isas.push(Isa::Avx2);
        if super::dot_avx2::has_vnni() {
            isas.push(Isa::Avx2Vnni);
        }
    }
    isas
}

/// Runs one case and checks it against the f64 reference (and scalar == SIMD).
fn check(ty: GgmlType, rows: usize, cols: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed);
    let w = matrix(ty, rows, cols, &rng.vec(rows * cols));
    let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform() * 2.0).collect();
    let wf: Vec<f64> = w.dequantize_all().iter().map(|v| f64::from(*v)).collect();
    let isas = isas();
    let mut results = Vec::new();
    for &isa in &isas {
        let mut out = vec![f32::NAN; n * rows];
        matmul_with(&w, &x, n, &mut out, isa).unwrap();
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            for r in 0..rows {
                let wr = &wf[r * cols..(r + 1) * cols];
                let exact: f64 = wr.iter().zip(xt).map(|(a, b)| a * f64::from(*b)).sum();
                let got = f64::from(out[t * rows + r]);
                let b = bound(ty, wr, xt);
                assert!(
                    (got - exact).abs() <= b,
                    "{ty:?} {isa:?} [{rows}x{cols}] n={n} t={t} r={r}: got {got}, exact {exact}, bound {b:.3e}"
                );
            }
        }
        results.push(out);
    }
    // The VNNI products are the AVX2 ones: the same bits.
    if let [_, avx2, vnni] = &results[..] {
        assert!(
            avx2.iter()
                .zip(vnni)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty:?} [{rows}x{cols}] n={n}: VNNI and AVX2 results differ"
        );
    }
    if let [scalar, simd, ..] = &results[..] {
        // Same integer sums; only the f32 summation order differs.
        for (i, (a, b)) in scalar.iter().zip(simd).enumerate() {
            let (t, r) = (i / rows, i % rows);
            let wr = &wf[r * cols..(r + 1) * cols];
            let wx: f64 = wr
                .iter()
                .zip(&x[t * cols..])
                .map(|(a, b)| (a * f64::from(*b)).abs())
                .sum();
            let tol = 4.0 * cols as f64 * f64::from(f32::EPSILON) * wx + 1e-12;
            assert!(
                f64::from((a - b).abs()) <= tol,
                "{ty:?} scalar {a} vs simd {b} at t={t} r={r}"
            );
        }
    }
}

#[test]
fn matmul_matches_f64_reference_all_formats() {
    let mut seed = 100;
    for ty in ALL {
        let base = ty.block_len().max(32);
        for &(rows, blocks) in &[(1, 1), (7, 2), (67, 3), (200, 1)] {
            for &n in &[1, 3, 17] {
                seed += 1;
                check(ty, rows, base * blocks, n, seed);
            }
        }
    }
}

/// A token's output row, bit for bit, whatever tokens share its call: alone, and at every
/// place of a batch of every size up to nine (quantized: groups of 1–2 and their mixes) or
/// 33 (float: tiles of 1–3 tokens and 1, 2 or 4 rows, at sizes a GEMM would block
/// differently; models with f16/bf16 weights depend on it).
#[test]
fn matmul_rows_are_bit_identical_whatever_the_batch() {
    let isas = isas();
    let mut seed = 900;
    for ty in ALL {
        let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16);
        let max_n = if float { 33 } else { 9 };
        // Odd and even block counts: the kernels pair blocks and finish an odd one alone.
        for blocks in [1, 2, 3, 6, 7] {
            seed += 1;
            let (rows, cols) = (37, ty.block_len().max(32) * blocks);
            let mut rng = Rng(seed);
            let w = matrix(ty, rows, cols, &rng.vec(rows * cols));
            let x: Vec<f32> = (0..max_n * cols).map(|_| rng.uniform() * 2.0).collect();
            for &isa in &isas {
                let alone: Vec<Vec<f32>> = (0..max_n)
                    .map(|t| {
                        let mut out = vec![f32::NAN; rows];
                        matmul_with(&w, &x[t * cols..(t + 1) * cols], 1, &mut out, isa).unwrap();
                        out
                    })
                    .collect();
                for n in 2..=max_n {
                    let mut out = vec![f32::NAN; n * rows];
                    matmul_with(&w, &x[..n * cols], n, &mut out, isa).unwrap();
                    for (t, row) in out.chunks_exact(rows).enumerate() {
                        let same = row
                            .iter()
                            .zip(&alone[t])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{ty:?} {isa:?} {blocks} blocks: token {t} of {n} differs from alone"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_float_odd_columns() {
    // Float rows need not be a multiple of the SIMD width (tails of 1..15 elements).
    for (ty, cols) in [
        (GgmlType::F32, 45),
        (GgmlType::F16, 23),
        (GgmlType::Bf16, 9),
    ] {
        for n in [1, 2, 9] {
            check(ty, 19, cols, n, 42 + n as u64);
        }
    }
}

#[test]
fn matmul_of_demo_shapes() {
    check(GgmlType::Q4_1, 192, 576, 1, 1);
    check(GgmlType::Q4_1, 64, 1536, 5, 2);
    check(GgmlType::Q8_0, 300, 576, 2, 3);
}

#[test]
fn row_f32_and_dequantize_all_agree() {
    let mut rng = Rng(9);
    for ty in ALL {
        let cols = ty.block_len().max(32) * 2;
        let w = matrix(ty, 5, cols, &rng.vec(5 * cols));
        let all = w.dequantize_all();
        let mut row = vec![0f32; cols];
        for r in 0..5 {
            w.row_f32(r, &mut row).unwrap();
            assert_eq!(row, all[r * cols..(r + 1) * cols], "{ty:?} row {r}");
        }
        assert!(matches!(w.row_f32(5, &mut row), Err(Error::Shape { .. })));
        assert!(matches!(
            w.row_f32(0, &mut row[1..]),
            Err(Error::Shape { .. })
        ));
    }
}

#[test]
fn matmul_shape_errors() {
    let w = WeightMatrix::from_f32(3, 4, &[0.0; 12]).unwrap();
    let mut out = vec![0f32; 6];
    assert!(matches!(
        w.matmul(&[0.0; 7], 2, &mut out),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        w.matmul(&[0.0; 8], 2, &mut out[1..]),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        w.matmul(&[0.0; 8], usize::MAX, &mut out),
        Err(Error::Shape { .. })
    ));
    assert!(w.matmul(&[], 0, &mut []).is_ok());
    let q = matrix(GgmlType::Q4_1, 2, 32, &[1.0; 64]);
    assert!(matches!(
        q.matmul(&[0.0; 31], 1, &mut [0.0; 2]),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn zero_rows_and_columns() {
    let w = WeightMatrix::from_f32(0, 4, &[]).unwrap();
    assert!(w.matmul(&[1.0; 4], 1, &mut []).is_ok());
    let w = WeightMatrix::from_f32(3, 0, &[]).unwrap();
    let mut out = [5f32; 3];
    w.matmul(&[], 1, &mut out).unwrap();
    assert_eq!(out, [0.0; 3]);
    assert!(w.dequantize_all().is_empty());
}

#[test]
fn unaligned_mapped_f32_weights() {
    // A GGUF tensor may start at any offset of the mapping: the gemm path must not read f32
    // through a misaligned pointer (it widens a copy instead).
    use super::WeightBytes;
    use std::io::Write;
    let (rows, cols, n) = (20, 36, 9);
    let mut rng = Rng(77);
    let values = rng.vec(rows * cols);
    let x = rng.vec(n * cols);
    let path = std::env::temp_dir().join(format!("turbokv-quant-test-{}.bin", std::process::id()));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&[0u8]).unwrap();
    for v in &values {
        file.write_all(&v.to_le_bytes()).unwrap();
    }
    drop(file);
    let file = std::fs::File::open(&path).unwrap();
    // SAFETY: the file is private to this test and not modified while mapped.
    let map = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&file) }.unwrap());
    let _ = std::fs::remove_file(&path);
    let bytes = WeightBytes::Mapped {
        map,
        offset: 1,
        len: rows * cols * 4,
    };
    let mapped = WeightMatrix::new(GgmlType::F32, rows, cols, bytes).unwrap();
    let owned = WeightMatrix::from_f32(rows, cols, &values).unwrap();
    let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
    mapped.matmul(&x, n, &mut a).unwrap();
    owned.matmul(&x, n, &mut b).unwrap();
    assert_eq!(a, b);
}
