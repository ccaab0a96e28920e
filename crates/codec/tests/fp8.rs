//! The `fp8` format end to end through `VectorCodec`: the codes are the specified ones, the
//! per-coordinate error bounds of E4M3 hold, edge cases of the scale, and a decoder fed
//! arbitrary bytes never panics.

use proptest::prelude::*;
use turbokv_codec::*;

fn codec(role: KvRole, d: usize) -> VectorCodec {
    VectorCodec::new(KvDtype::Fp8, role, d, 0, &CodecOptions::default()).unwrap()
}

fn encode(c: &VectorCodec, x: &[f32]) -> (Vec<u8>, f16) {
    let mut codes = vec![0u8; c.token_sizes().code_bytes];
    let mut sc = [f16::ZERO];
    c.encode(x, &mut codes, &mut sc).unwrap();
    (codes, sc[0])
}

fn decode(c: &VectorCodec, codes: &[u8], s: f16) -> Vec<f32> {
    let mut out = vec![f32::NAN; c.head_dim()];
    c.decode(codes, &[s], &mut out).unwrap();
    out
}

/// Coordinates spread over many decades, both signs, with exact zeros.
fn spread_vector() -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(
        prop_oneof![
            8 => (-12.0f32..6.0, any::<bool>()).prop_map(|(e, neg)| {
                let v = 10f32.powf(e);
                if neg { -v } else { v }
            }),
            1 => Just(0.0f32),
        ],
        1..80,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The scale is `f16(absmax / 448)`, each code is `e4m3(x / s)`, no code is NaN, and
    /// every coordinate meets the E4M3 bound: relative error ≤ 2⁻⁴ in the normal range
    /// (`|x| ≥ 2⁻⁶·s`), absolute error ≤ 2⁻¹⁰·s below it (plus f32 rounding of x/s and s·v).
    #[test]
    fn codes_are_the_specified_ones_and_errors_are_bounded(x in spread_vector()) {
        let c = codec(KvRole::Key, x.len());
        let (codes, s16) = encode(&c, &x);
        let absmax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        prop_assert_eq!(s16.to_bits(), f16::from_f32(absmax / 448.0).to_bits());
        let s = s16.to_f32();
        let y = decode(&c, &codes, s16);
        for ((&xi, &yi), &q) in x.iter().zip(&y).zip(&codes) {
            prop_assert!(q & 0x7F != 0x7F, "NaN code for {}", xi);
            if !(s > 0.0 && s.is_finite()) {
                prop_assert_eq!(q, 0);
                prop_assert_eq!(yi, 0.0);
                continue;
            }
            prop_assert_eq!(q, fp8::encode(xi / s), "x = {:e}, s = {:e}", xi, s);
            prop_assert_eq!(yi, s * fp8::decode(q));
            if (xi / s).abs() >= 448.0 {
                // Only where the f16 scale rounded below absmax/448 (by ≤ 2⁻¹¹, or more for
                // a subnormal scale): saturated.
                prop_assert_eq!(yi.abs(), 448.0 * s);
                continue;
            }
            let err = f64::from((yi - xi).abs());
            let (xa, sf) = (f64::from(xi.abs()), f64::from(s));
            let bound = if xa >= sf / 64.0 {
                xa / 16.0 + xa * 1e-6
            } else {
                sf / 1024.0 + xa * 1e-6
            };
            prop_assert!(err <= bound, "x {:e} -> {:e} (s {:e}): error {:e} > {:e}", xi, yi, s, err, bound);
        }
    }

    /// Any bytes in a block decode, score and accumulate without a panic (values may be NaN
    /// for NaN codes or scales; that is what the bytes say).
    #[test]
    fn arbitrary_blocks_never_panic(
        d in 1usize..40,
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        slot in 0usize..6,
    ) {
        let c = codec(KvRole::Value, d);
        let layout = c.block_layout(4).unwrap();
        let mut block = bytes.clone();
        block.resize(layout.total_bytes, 0x5A);
        let mut out = vec![0f32; d];
        // The wrong-length block (the raw bytes) must be a typed error, not a panic.
        let _ = c.decode_slot(&bytes, &layout, slot, &mut out);
        let r = c.decode_slot(&block, &layout, slot, &mut out);
        prop_assert_eq!(r.is_ok(), slot < 4);
        let mut tile = vec![0f32; 4 * c.work_dim()];
        c.decode_tile(&block, &layout, 0..4, &mut tile).unwrap();
        let q: Vec<f32> = (0..d).map(|i| i as f32 - 3.0).collect();
        let pq = c.prepare_query(&q).unwrap();
        let mut scores = vec![0f32; 4];
        c.score_block(&pq, &block, &layout, &mut scores).unwrap();
        let mut acc = c.new_accumulator();
        c.accumulate_block(&mut acc, &block, &layout, &[0.25; 4]).unwrap();
        c.finish(&acc, &mut out).unwrap();
    }
}

#[test]
fn scale_edge_cases() {
    let c = codec(KvRole::Value, 4);
    // All zero: scale 0, codes 0, decodes to 0.
    let (codes, s) = encode(&c, &[0.0; 4]);
    assert_eq!((codes, s), (vec![0; 4], f16::ZERO));
    // A NaN coordinate is code 0; the others use the absmax of the rest.
    let (codes, s) = encode(&c, &[f32::NAN, 448.0, -1.0, 0.5]);
    assert_eq!(s, f16::ONE);
    assert_eq!(codes, [0, 0x7E, 0xB8, 0x30]);
    assert_eq!(decode(&c, &codes, s), [0.0, 448.0, -1.0, 0.5]);
    // An infinite coordinate or an absmax beyond the f16 scale's range: every code 0.
    for x in [[f32::INFINITY, 1.0, 2.0, 3.0], [3e7, 1.0, 2.0, 3.0]] {
        let (codes, s) = encode(&c, &x);
        assert!(s.to_f32().is_infinite(), "{x:?}");
        assert_eq!(codes, [0; 4], "{x:?}");
    }
    // Too small for an f16 scale: everything flushes to 0.
    let (codes, s) = encode(&c, &[1e-12, -1e-12, 0.0, 1e-13]);
    assert_eq!((codes, s.to_f32()), (vec![0; 4], 0.0));
    // Just inside: the largest coordinate still maps to ±448 exactly.
    let (codes, s) = encode(&c, &[-2.0e7, 1.0, 0.0, 0.0]);
    assert!(s.to_f32().is_finite());
    assert_eq!(codes[0], 0xFE);
}

/// fp8 and int8 cost the same bits; their blocks have the same size.
#[test]
fn fp8_blocks_are_int8_sized() {
    for d in [64, 80, 128] {
        for role in [KvRole::Key, KvRole::Value] {
            let f = block_bytes(KvDtype::Fp8, role, d, 16, KeyMode::Prod).unwrap();
            let i = block_bytes(KvDtype::Int8, role, d, 16, KeyMode::Prod).unwrap();
            assert_eq!(f, i);
            assert_eq!(f, 16 * d + 32);
        }
    }
}
