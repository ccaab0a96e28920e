//! Snapshot blobs: round trips, and every kind of damage is a typed error, never a panic.

use proptest::prelude::*;
use turbokv_codec::*;

fn dtype_strategy() -> impl Strategy<Value = KvDtype> {
    prop_oneof![
        Just(KvDtype::Bf16),
        Just(KvDtype::F16),
        Just(KvDtype::Int8),
        Just(KvDtype::Fp8),
        (2u8..=8, 2u8..=8).prop_map(|(k, v)| KvDtype::Tq {
            key_bits: TqBits::from_half_bits(k).unwrap(),
            value_bits: TqBits::from_half_bits(v).unwrap(),
        }),
    ]
}

fn outliers_for(bits: Option<TqBits>, d: usize, seed: u64) -> Option<OutlierChannels> {
    let bits = bits?;
    if !bits.is_fractional() {
        return None;
    }
    let energy: Vec<f32> = (0..d)
        .map(|i| ((i as u64 * 2654435761 + seed) % 97) as f32)
        .collect();
    OutlierChannels::from_channel_energy(&energy, d / 2).ok()
}

prop_compose! {
    fn snapshot_strategy()(
        d in prop_oneof![Just(8usize), Just(16), Just(24), Just(64)],
        dtypes in proptest::collection::vec(dtype_strategy(), 1..4),
        prod in any::<bool>(),
        corrected in any::<bool>(),
        gaussian in any::<bool>(),
        base_seed in any::<u64>(),
        kv_heads in 1u32..3,
        block_size in prop_oneof![Just(1u32), Just(4), Just(16)],
        num_blocks in 0u32..3,
        with_tokens in any::<bool>(),
        fill in any::<u8>(),
    ) -> Snapshot {
        let layers: Vec<LayerIdentity> = dtypes.iter().enumerate().map(|(i, &dtype)| {
            let (kb, vb) = match dtype {
                KvDtype::Tq { key_bits, value_bits } => (Some(key_bits), Some(value_bits)),
                _ => (None, None),
            };
            LayerIdentity {
                layer: 2 * i as u32 + 1,
                dtype,
                key_outliers: outliers_for(kb, d, i as u64),
                value_outliers: outliers_for(vb, d, 7 + i as u64),
            }
        }).collect();
        let identity = SnapshotIdentity {
            codec_version: CODEC_VERSION,
            head_dim: d as u32,
            key_mode: if prod { KeyMode::Prod } else { KeyMode::Mse },
            norm: if corrected { NormMode::Corrected } else { NormMode::Exact },
            qjl: if gaussian { QjlSketch::Gaussian } else { QjlSketch::Structured },
            base_seed,
            layers,
        };
        let num_tokens = (num_blocks * block_size).saturating_sub(block_size / 2);
        let shape = SnapshotShape { kv_heads, block_size, num_blocks, num_tokens };
        let mut payload_len = 0;
        for l in &identity.layers {
            for role in [KvRole::Key, KvRole::Value] {
                payload_len += block_bytes(l.dtype, role, d, block_size as usize, identity.key_mode).unwrap()
                    * (num_blocks * kv_heads) as usize;
            }
        }
        let payload = (0..payload_len).map(|i| (i as u8).wrapping_mul(31) ^ fill).collect();
        let tokens = if with_tokens { (0..num_tokens).map(|t| t * 3 + 1).collect() } else { vec![] };
        Snapshot { identity, shape, tokens, payload }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn round_trip(s in snapshot_strategy()) {
        let bytes = s.encode().unwrap();
        let back = Snapshot::decode(&bytes).unwrap();
        prop_assert_eq!(&back, &s);
        prop_assert!(Snapshot::decode_expecting(&bytes, &s.identity).is_ok());
    }

    #[test]
    fn truncation_is_an_error(s in snapshot_strategy(), cut in any::<prop::sample::Index>()) {
        let bytes = s.encode().unwrap();
        let n = cut.index(bytes.len());
        prop_assert!(Snapshot::decode(&bytes[..n]).is_err());
    }

    #[test]
    fn bit_flips_are_errors(s in snapshot_strategy(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut bytes = s.encode().unwrap();
        let i = at.index(bytes.len());
        bytes[i] ^= 1 << bit;
        let err = Snapshot::decode(&bytes).unwrap_err();
        let typed = matches!(err,
            SnapshotError::ChecksumMismatch { .. } | SnapshotError::BadMagic | SnapshotError::UnsupportedFormat { .. });
        prop_assert!(typed, "{:?}", err);
    }

    #[test]
    fn appended_bytes_are_errors(s in snapshot_strategy(), extra in proptest::collection::vec(any::<u8>(), 1..8)) {
        let mut bytes = s.encode().unwrap();
        bytes.extend_from_slice(&extra);
        prop_assert!(Snapshot::decode(&bytes).is_err());
    }

    #[test]
    fn wrong_identity_is_a_mismatch(s in snapshot_strategy(), which in 0usize..5) {
        let bytes = s.encode().unwrap();
        let mut other = s.identity.clone();
        match which {
            0 => other.base_seed ^= 1,
            1 => other.codec_version += 1,
            2 => other.head_dim *= 2,
            3 => other.key_mode = if other.key_mode == KeyMode::Mse { KeyMode::Prod } else { KeyMode::Mse },
            _ => other.layers[0].dtype = if other.layers[0].dtype == KvDtype::Int8 { KvDtype::Bf16 } else { KvDtype::Int8 },
        }
        let err = Snapshot::decode_expecting(&bytes, &other).unwrap_err();
        prop_assert!(matches!(err, SnapshotError::IdentityMismatch { .. }), "{:?}", err);
    }

    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Snapshot::decode(&bytes);
        let mut with_magic = snapshot::MAGIC.to_vec();
        with_magic.extend_from_slice(&1u32.to_le_bytes());
        with_magic.extend_from_slice(&bytes);
        let _ = Snapshot::decode(&with_magic);
    }
}

/// Garbage with a valid checksum reaches the field parser: it must still never panic.
#[test]
fn checksummed_garbage_never_panics() {
    let mut rng = turbokv_codec::prng::Xoshiro256::new(77);
    let s = Snapshot {
        identity: SnapshotIdentity {
            codec_version: CODEC_VERSION,
            head_dim: 16,
            key_mode: KeyMode::Mse,
            norm: NormMode::Exact,
            qjl: QjlSketch::Structured,
            base_seed: 1,
            layers: vec![LayerIdentity {
                layer: 0,
                dtype: "tq2.5".parse().unwrap(),
                key_outliers: OutlierChannels::leading(16, 8).ok(),
                value_outliers: OutlierChannels::leading(16, 8).ok(),
            }],
        },
        shape: SnapshotShape {
            kv_heads: 1,
            block_size: 2,
            num_blocks: 1,
            num_tokens: 2,
        },
        tokens: vec![5, 6],
        payload: vec![0; 32 + 32],
    };
    let good = s.encode().unwrap();
    assert_eq!(Snapshot::decode(&good).unwrap(), s);
    let mut errors = 0;
    for _ in 0..20_000 {
        let mut b = good.clone();
        let body = b.len() - 4;
        for _ in 0..1 + rng.below(4) {
            let i = 12 + rng.below((body - 12) as u64) as usize;
            b[i] = rng.next_u64() as u8;
        }
        if rng.below(4) == 0 {
            let cut = 12 + rng.below((body - 12) as u64) as usize;
            b.truncate(cut);
        }
        let body = b.len() - 4;
        let crc = checksum::crc32(&b[..body]).to_le_bytes();
        b[body..].copy_from_slice(&crc);
        if Snapshot::decode(&b).is_err() {
            errors += 1;
        }
    }
    assert!(errors > 1000);
}

#[test]
fn payload_size_is_checked_on_encode() {
    let s = Snapshot {
        identity: SnapshotIdentity {
            codec_version: CODEC_VERSION,
            head_dim: 64,
            key_mode: KeyMode::Mse,
            norm: NormMode::Exact,
            qjl: QjlSketch::Structured,
            base_seed: 1,
            layers: vec![LayerIdentity {
                layer: 0,
                dtype: KvDtype::Int8,
                key_outliers: None,
                value_outliers: None,
            }],
        },
        shape: SnapshotShape {
            kv_heads: 1,
            block_size: 16,
            num_blocks: 1,
            num_tokens: 16,
        },
        tokens: vec![],
        payload: vec![0; 10],
    };
    assert!(matches!(s.encode(), Err(SnapshotError::PayloadSize { .. })));
    let range = Snapshot {
        payload: vec![0; 2 * (64 * 16 + 32)],
        ..s
    }
    .block_range(0, 0, 0, KvRole::Value)
    .unwrap();
    assert_eq!(range, 1056..2112);
}

fn one_layer(dtype: KvDtype, d: u32, block_size: u32, payload: Vec<u8>) -> Snapshot {
    Snapshot {
        identity: SnapshotIdentity {
            codec_version: CODEC_VERSION,
            head_dim: d,
            key_mode: KeyMode::Mse,
            norm: NormMode::Exact,
            qjl: QjlSketch::Structured,
            base_seed: 9,
            layers: vec![LayerIdentity {
                layer: 3,
                dtype,
                key_outliers: None,
                value_outliers: None,
            }],
        },
        shape: SnapshotShape {
            kv_heads: 1,
            block_size,
            num_blocks: 1,
            num_tokens: block_size,
        },
        tokens: vec![],
        payload,
    }
}

/// The dtype byte of each plain format on the wire (after the 52-byte header and the layer
/// index): the old codes stay what they were, so snapshots written before fp8 still decode.
#[test]
fn dtype_tags_on_the_wire_are_stable() {
    for (dtype, tag) in [
        (KvDtype::Bf16, 0u8),
        (KvDtype::F16, 1),
        (KvDtype::Int8, 2),
        (KvDtype::Fp8, 4),
    ] {
        let len = 2 * block_bytes(dtype, KvRole::Key, 16, 4, KeyMode::Mse).unwrap();
        let s = one_layer(dtype, 16, 4, vec![0x11; len]);
        let bytes = s.encode().unwrap();
        assert_eq!(bytes[56..59], [tag, 0, 0], "{dtype}");
        assert_eq!(Snapshot::decode(&bytes).unwrap(), s, "{dtype}");
    }
    let tq = one_layer(KvDtype::tq(TqBits::B3), 16, 4, vec![]);
    let len = expected_len(&tq);
    let bytes = one_layer(KvDtype::tq(TqBits::B3), 16, 4, vec![0; len])
        .encode()
        .unwrap();
    assert_eq!(bytes[56..59], [3, 6, 6]);
}

fn expected_len(s: &Snapshot) -> usize {
    let d = s.identity.head_dim as usize;
    let bs = s.shape.block_size as usize;
    let dt = s.identity.layers[0].dtype;
    [KvRole::Key, KvRole::Value]
        .into_iter()
        .map(|r| block_bytes(dt, r, d, bs, KeyMode::Mse).unwrap())
        .sum()
}

/// An fp8 layer's encoded blocks survive a snapshot byte for byte and decode to the same
/// vectors afterwards; a plain tag with bit widths, and an unknown tag, are refused.
#[test]
fn fp8_layer_round_trips_through_a_snapshot() {
    let (d, bs) = (64usize, 8usize);
    let codec = LayerCodec::new(KvDtype::Fp8, d, 3, &CodecOptions::default()).unwrap();
    let kl = codec.key.block_layout(bs).unwrap();
    let vl = codec.value.block_layout(bs).unwrap();
    let (mut kb, mut vb) = (vec![0u8; kl.total_bytes], vec![0u8; vl.total_bytes]);
    let mut rng = prng::Xoshiro256::new(4);
    let xs: Vec<Vec<f32>> = (0..2 * bs)
        .map(|_| (0..d).map(|_| rng.gaussian() as f32 * 3.0).collect())
        .collect();
    for t in 0..bs {
        codec.key.encode_slot(&xs[t], &mut kb, &kl, t).unwrap();
        codec
            .value
            .encode_slot(&xs[bs + t], &mut vb, &vl, t)
            .unwrap();
    }
    let payload = [kb.clone(), vb.clone()].concat();
    let s = one_layer(KvDtype::Fp8, d as u32, bs as u32, payload);
    let bytes = s.encode().unwrap();
    let back = Snapshot::decode_expecting(&bytes, &s.identity).unwrap();
    assert_eq!(back, s);
    let kr = back.block_range(0, 0, 0, KvRole::Key).unwrap();
    let vr = back.block_range(0, 0, 0, KvRole::Value).unwrap();
    assert_eq!(&back.payload[kr.clone()], &kb[..]);
    for t in 0..bs {
        let (mut a, mut b) = (vec![0f32; d], vec![0f32; d]);
        codec.key.decode_slot(&kb, &kl, t, &mut a).unwrap();
        codec
            .key
            .decode_slot(&back.payload[kr.clone()], &kl, t, &mut b)
            .unwrap();
        assert_eq!(a, b);
        codec
            .value
            .decode_slot(&back.payload[vr.clone()], &vl, t, &mut b)
            .unwrap();
        for (y, x) in b.iter().zip(&xs[bs + t]) {
            assert!(
                (y - x).abs() <= x.abs() / 15.9 + 1e-4,
                "value {t}: {y} for {x}"
            );
        }
    }
    // Rewrite the dtype byte and fix the checksum: bad widths, then an unknown tag.
    for (tag, widths, want_unknown) in [(4u8, [1u8, 0], false), (5, [0, 0], true)] {
        let mut b = bytes.clone();
        b[56] = tag;
        b[57..59].copy_from_slice(&widths);
        let body = b.len() - 4;
        let crc = checksum::crc32(&b[..body]);
        b[body..].copy_from_slice(&crc.to_le_bytes());
        let err = Snapshot::decode(&b).unwrap_err();
        let ok = if want_unknown {
            matches!(
                err,
                SnapshotError::UnknownValue {
                    field: "dtype",
                    value: 5
                }
            )
        } else {
            matches!(err, SnapshotError::InvalidField { field: "dtype", .. })
        };
        assert!(ok, "tag {tag}: {err:?}");
    }
}
