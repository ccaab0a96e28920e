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
