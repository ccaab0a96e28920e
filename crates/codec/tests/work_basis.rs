//! The working basis of attention on codes (`decode_tile`, `query_to_work`, `exact_to_work`,
//! `work_to_output`) against the reference scorer and decoder, on fresh random vectors.

use half::f16;
use turbokv_codec::kernels::{
    decode_codes, decode_codes_scalar, decode_signs, decode_signs_scalar,
};
use turbokv_codec::prng::Xoshiro256;
use turbokv_codec::*;

fn gaussian(rng: &mut Xoshiro256, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gaussian() as f32).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Every dtype × role × key mode × head dim the cache can use.
fn codecs() -> Vec<(String, VectorCodec)> {
    let mut out = Vec::new();
    for d in [64, 128, 256] {
        for name in [
            "int8", "fp8", "tq4", "tq3", "tq2", "tq1", "tq3.5", "tq2.5", "tq1.5",
        ] {
            let dtype: KvDtype = name.parse().unwrap();
            for mode in [KeyMode::Mse, KeyMode::Prod] {
                let opts = CodecOptions {
                    key_mode: mode,
                    ..Default::default()
                };
                let key = VectorCodec::new(dtype, KvRole::Key, d, 5, &opts).unwrap();
                out.push((format!("{name}/{mode:?} key d={d}"), key));
            }
            let opts = CodecOptions::default();
            let value = VectorCodec::new(dtype, KvRole::Value, d, 5, &opts).unwrap();
            out.push((format!("{name} value d={d}"), value));
        }
    }
    out
}

/// Encodes `n` random vectors into a fresh block; returns the block, its layout and the vectors.
fn filled_block(c: &VectorCodec, n: usize, rng: &mut Xoshiro256) -> (Vec<u8>, BlockLayout) {
    let layout = c.block_layout(n).unwrap();
    let mut block = vec![0u8; layout.total_bytes];
    for slot in 0..n {
        let x = gaussian(rng, c.head_dim());
        c.encode_slot(&x, &mut block, &layout, slot).unwrap();
    }
    (block, layout)
}

#[test]
fn tile_scores_equal_reference_scores() {
    let mut rng = Xoshiro256::new(11);
    for (name, c) in codecs() {
        let (n, d, w) = (16, c.head_dim(), c.work_dim());
        let (block, layout) = filled_block(&c, n, &mut rng);
        let q = gaussian(&mut rng, d);
        let mut qw = vec![0.0; w];
        c.query_to_work(&q, &mut qw).unwrap();
        // A sub-range of slots, as a kernel reads the tail of a partially visible block.
        let mut tile = vec![f32::NAN; (n - 3) * w];
        c.decode_tile(&block, &layout, 3..n, &mut tile).unwrap();
        let pq = c.prepare_query(&q).unwrap();
        let mut reference = vec![0.0; n];
        c.score_block(&pq, &block, &layout, &mut reference).unwrap();
        for (t, row) in tile.chunks(w).enumerate() {
            let got = dot(&qw, row);
            let want = reference[t + 3];
            let tol = 2e-5 * d as f32 * (1.0 + want.abs());
            assert!(
                (got - want).abs() <= tol,
                "{name} slot {}: {got} vs {want}",
                t + 3
            );
        }
    }
}

#[test]
fn tile_value_sums_equal_dequantized_sums() {
    let mut rng = Xoshiro256::new(12);
    for (name, c) in codecs() {
        let (n, d, w) = (16, c.head_dim(), c.work_dim());
        let (block, layout) = filled_block(&c, n, &mut rng);
        let weights: Vec<f32> = (0..n).map(|_| rng.next_f64() as f32).collect();
        let mut tile = vec![f32::NAN; n * w];
        c.decode_tile(&block, &layout, 0..n, &mut tile).unwrap();
        let mut acc = vec![0.0; w];
        for (row, &p) in tile.chunks(w).zip(&weights) {
            acc.iter_mut().zip(row).for_each(|(a, x)| *a += p * x);
        }
        let mut got = vec![f32::NAN; d];
        c.work_to_output(&acc, &mut got).unwrap();
        let mut want = vec![0.0; d];
        let mut x = vec![0.0; d];
        for (slot, &p) in weights.iter().enumerate() {
            c.decode_slot(&block, &layout, slot, &mut x).unwrap();
            want.iter_mut().zip(&x).for_each(|(a, v)| *a += p * v);
        }
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!((g - e).abs() <= 1e-4 * scale, "{name} [{i}]: {g} vs {e}");
        }
    }
}

#[test]
fn exact_vectors_pass_through_the_working_basis() {
    let mut rng = Xoshiro256::new(13);
    for (name, c) in codecs() {
        let (d, w) = (c.head_dim(), c.work_dim());
        let (q, x) = (gaussian(&mut rng, d), gaussian(&mut rng, d));
        let (mut qw, mut xw) = (vec![0.0; w], vec![0.0; w]);
        c.query_to_work(&q, &mut qw).unwrap();
        let has_mse_everywhere = !(name.starts_with("tq1/Prod") || name.starts_with("tq1.5/Prod"));
        match c.exact_to_work(&x, &mut xw) {
            Ok(()) => assert!(has_mse_everywhere, "{name}: accepted an exact vector"),
            Err(e) => {
                assert!(!has_mse_everywhere, "{name}: {e}");
                continue;
            }
        }
        let (got, want) = (dot(&qw, &xw), dot(&q, &x));
        assert!(
            (got - want).abs() < 1e-4 * d as f32,
            "{name}: {got} vs {want}"
        );
        let mut back = vec![0.0; d];
        c.work_to_output(&xw, &mut back).unwrap();
        for (b, e) in back.iter().zip(&x) {
            assert!((b - e).abs() < 1e-4, "{name}: {b} vs {e}");
        }
    }
}

#[test]
fn simd_tile_decoders_equal_scalar_twins() {
    let mut rng = Xoshiro256::new(14);
    for bits in 1..=4u8 {
        let cents: Vec<f32> = (0..1 << bits).map(|_| rng.gaussian() as f32).collect();
        for n in [8, 64, 72, 256] {
            let packed: Vec<u8> = (0..n / 8 * usize::from(bits))
                .map(|_| rng.next_u64() as u8)
                .collect();
            let scale = f16::from_f32(rng.gaussian() as f32).to_f32();
            let (mut a, mut b) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            decode_codes(&packed, bits, &cents, scale, &mut a);
            decode_codes_scalar(&packed, bits, &cents, scale, &mut b);
            assert_eq!(a, b, "bits {bits} n {n}");
            let signs = &packed[..n / 8];
            decode_signs(signs, scale, &mut a);
            decode_signs_scalar(signs, scale, &mut b);
            assert_eq!(a, b, "signs n {n}");
        }
    }
}

#[test]
fn tile_errors_are_typed() {
    let c = VectorCodec::new(
        "tq3".parse().unwrap(),
        KvRole::Key,
        64,
        0,
        &Default::default(),
    )
    .unwrap();
    let layout = c.block_layout(16).unwrap();
    let block = vec![0u8; layout.total_bytes];
    let mut tile = vec![0.0; 16 * c.work_dim()];
    // Slots past the block, a short tile, a short block.
    assert!(
        c.decode_tile(&block, &layout, 10..17, &mut tile[..7 * 64])
            .is_err()
    );
    assert!(
        c.decode_tile(&block, &layout, 0..16, &mut tile[..64])
            .is_err()
    );
    assert!(
        c.decode_tile(&block[..10], &layout, 0..2, &mut tile[..128])
            .is_err()
    );
    assert!(c.query_to_work(&[0.0; 63], &mut [0.0; 64]).is_err());
    assert!(c.work_to_output(&[0.0; 64], &mut [0.0; 65]).is_err());
}

/// Coordinate `i` of a run of slot `slot`, read the way its `DirectCodes` describes it.
fn direct_coordinate(
    dc: &DirectCodes,
    block: &[u8],
    layout: &BlockLayout,
    slot: usize,
    i: usize,
) -> f32 {
    let rec = &block[layout.codes_range(slot)][dc.code_offset..];
    let at = layout.scalars_range(slot).start + 2 * dc.scalar_index;
    let s = f16::from_le_bytes([block[at], block[at + 1]]).to_f32() * dc.mul;
    match dc.kind {
        DirectKind::Int8 => s * f32::from(rec[i] as i8),
        DirectKind::Fp8 => s * fp8::decode(rec[i]),
        DirectKind::Table { bits, table } => {
            let b = usize::from(bits);
            let mut code = 0usize;
            for k in 0..b {
                let bit = i * b + k;
                code |= usize::from((rec[bit / 8] >> (bit % 8)) & 1) << k;
            }
            table[code] * s
        }
    }
}

/// Every non-16-bit format is a list of direct runs, and the runs tile the working vector and
/// give the decoded tile's coordinates (MSE codes, outlier parts and QJL signs alike).
#[test]
fn direct_codes_describe_the_decoded_tile() {
    let mut rng = Xoshiro256::new(14);
    for (name, c) in codecs() {
        let runs = c
            .direct_codes()
            .unwrap_or_else(|| panic!("{name}: no direct runs"));
        let (n, w) = (16, c.work_dim());
        let mut next = 0;
        for r in &runs {
            assert_eq!(r.work_offset, next, "{name}: runs in order, without gaps");
            next += r.dim;
        }
        assert_eq!(next, w, "{name}: the runs cover the working vector");
        let (block, layout) = filled_block(&c, n, &mut rng);
        let mut tile = vec![f32::NAN; n * w];
        c.decode_tile(&block, &layout, 0..n, &mut tile).unwrap();
        for slot in 0..n {
            for r in &runs {
                for i in 0..r.dim {
                    let got = direct_coordinate(r, &block, &layout, slot, i);
                    let want = tile[slot * w + r.work_offset + i];
                    assert_eq!(got, want, "{name} slot {slot} [{}]", r.work_offset + i);
                }
            }
        }
    }
}
