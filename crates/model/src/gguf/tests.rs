//! Reader tests on files built in memory: round trip, and corrupt input → typed errors.

use super::*;

fn parse_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1)).expect("anonymous map");
    map[..bytes.len()].copy_from_slice(bytes);
    let map = map.make_read_only().expect("read-only");
    // An anonymous map is page-sized; parse only the file's bytes by re-checking the length.
    let file = GgufFile::parse(Arc::new(map))?;
    Ok(file)
}

fn sample() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str("llama".into()))
        .meta("llama.block_count", MetaValue::U64(2))
        .meta("a.float", MetaValue::F64(0.5))
        .meta(
            "a.list",
            MetaValue::Array(vec![
                MetaValue::Str("x".into()),
                MetaValue::Str("yz".into()),
            ]),
        )
        .tensor(
            "w",
            &[32, 2],
            0,
            (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect(),
        );
    w.to_bytes()
}

#[test]
fn round_trips_metadata_and_tensors() {
    let f = parse_bytes(&sample()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.metadata.str("general.architecture").unwrap(), "llama");
    assert_eq!(f.metadata.u64("llama.block_count").unwrap(), 2);
    assert_eq!(f.metadata.f64("a.float").unwrap(), 0.5);
    assert_eq!(f.metadata.array("a.list").unwrap().len(), 2);
    let t = f.tensor("w").unwrap();
    assert_eq!(
        (t.dims.clone(), t.ty, t.len),
        (vec![32, 2], GgmlType::F32, 256)
    );
    let bytes = f.tensor_bytes(t);
    assert_eq!(f32::from_le_bytes(bytes[4..8].try_into().unwrap()), 1.0);
}

#[test]
fn wrong_key_type_is_named() {
    let f = parse_bytes(&sample()).unwrap();
    let err = f
        .metadata
        .u64("general.architecture")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("general.architecture") && err.contains("unsigned"),
        "{err}"
    );
    assert!(
        f.metadata
            .str("missing.key")
            .unwrap_err()
            .to_string()
            .contains("missing")
    );
}

#[test]
fn bad_magic_and_version_are_errors() {
    let mut b = sample();
    b[0] = b'X';
    assert!(matches!(parse_bytes(&b), Err(GgufError::BadMagic { .. })));
    let mut b = sample();
    b[4] = 9;
    assert!(matches!(parse_bytes(&b), Err(GgufError::Version(9))));
}

#[test]
fn unsupported_tensor_type_names_the_tensor() {
    let mut w = GgufWriter::new();
    w.tensor(
        "blk.0.attn_q.weight",
        &[256, 1],
        10, /* Q2_K */
        vec![0; 84],
    );
    let err = parse_bytes(&w.to_bytes()).unwrap_err().to_string();
    assert!(
        err.contains("blk.0.attn_q.weight") && err.contains("Q2_K"),
        "{err}"
    );
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let full = sample();
    // The data section is padded; cutting into the header or metadata must fail cleanly.
    let header_end = full.len() - 256;
    for cut in 0..header_end {
        assert!(
            parse_bytes(&full[..cut]).is_err() || cut >= header_end,
            "cut at {cut} parsed"
        );
    }
}

#[test]
fn huge_counts_do_not_allocate() {
    let mut b = sample();
    // metadata count field at offset 16
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(parse_bytes(&b), Err(GgufError::Corrupt { .. })));
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn random_bit_flips_never_panic(flips in proptest::collection::vec((0usize..4096, 0u8..8), 1..6)) {
            let mut b = sample();
            for (at, bit) in flips {
                let i = at % b.len();
                b[i] ^= 1 << bit;
            }
            let _ = parse_bytes(&b);
        }

        #[test]
        fn random_bytes_after_magic_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut b = b"GGUF\x03\0\0\0".to_vec();
            b.extend(tail);
            let _ = parse_bytes(&b);
        }
    }
}

#[test]
fn reencoding_keeps_metadata_and_rounds_matrices_to_the_float_format() {
    use reencode::{FloatFormat, reencode_matrices};
    use turbokv_backend::quant::{dequantize_row, quantize_row};
    // A Q8_0 matrix [2 rows, 32 cols] and a 1-D f32 norm.
    let values: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 7.0).collect();
    let mut q8 = vec![0u8; 2 * 34];
    for (src, dst) in values.chunks(32).zip(q8.chunks_mut(34)) {
        quantize_row(GgmlType::Q8_0, src, dst).unwrap();
    }
    let norm: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str("llama".into()))
        .tensor("m", &[32, 2], 8, q8.clone())
        .tensor("n", &[2], 0, norm.clone());
    let src = parse_bytes(&w.to_bytes()).unwrap();
    let out = parse_bytes(
        &reencode_matrices(&src, FloatFormat::F16)
            .unwrap()
            .to_bytes(),
    )
    .unwrap();
    assert_eq!(out.metadata.str("general.architecture").unwrap(), "llama");
    let m = out.tensor("m").unwrap();
    assert_eq!((m.ty, m.dims.clone()), (GgmlType::F16, vec![32, 2]));
    let mut want = vec![0f32; 64];
    for (src, dst) in q8.chunks(34).zip(want.chunks_mut(32)) {
        dequantize_row(GgmlType::Q8_0, src, dst).unwrap();
    }
    let mut got = vec![0f32; 64];
    dequantize_row(GgmlType::F16, &out.tensor_bytes(m), &mut got).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(*g, half::f16::from_f32(*w).to_f32());
    }
    let n = out.tensor("n").unwrap();
    assert_eq!((n.ty, &out.tensor_bytes(n)[..]), (GgmlType::F32, &norm[..]));
}
