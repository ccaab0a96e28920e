//! Encoding arbitrary f32 vectors (NaN, inf, subnormals included) in every format never
//! panics, the SIMD encoder's bytes equal the scalar reference's, and decoding / scoring the
//! result never panics.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use half::f16;
use libfuzzer_sys::fuzz_target;
use turbokv_codec::*;

/// Codecs are cached by configuration: building rotations on every input would spend the
/// fuzzer's time in construction rather than in the encoder.
fn cached(
    key: (usize, usize, u8),
    make: impl FnOnce() -> Option<VectorCodec>,
) -> Option<Arc<VectorCodec>> {
    static CACHE: OnceLock<Mutex<HashMap<(usize, usize, u8), Option<Arc<VectorCodec>>>>> =
        OnceLock::new();
    let mut map = CACHE.get_or_init(Default::default).lock().unwrap();
    map.entry(key)
        .or_insert_with(|| make().map(Arc::new))
        .clone()
}

const DTYPES: [&str; 11] = [
    "bf16", "f16", "int8", "tq1", "tq2", "tq2.5", "tq3", "tq3.5", "tq4", "k4v1.5", "fp8",
];
const DIMS: [usize; 6] = [8, 16, 24, 64, 80, 128];

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let dtype: KvDtype = DTYPES[usize::from(data[0]) % DTYPES.len()].parse().unwrap();
    let d = DIMS[usize::from(data[1]) % DIMS.len()];
    let flags = data[2];
    let opts = CodecOptions {
        key_mode: if flags & 1 == 1 {
            KeyMode::Prod
        } else {
            KeyMode::Mse
        },
        norm: if flags & 2 == 2 {
            NormMode::Corrected
        } else {
            NormMode::Exact
        },
        qjl: if flags & 4 == 4 {
            QjlSketch::Gaussian
        } else {
            QjlSketch::Structured
        },
        base_seed: u64::from(flags >> 3),
        ..Default::default()
    };
    let role = if flags & 8 == 8 {
        KvRole::Value
    } else {
        KvRole::Key
    };
    let Ok(codec) = VectorCodec::new(dtype, role, d, 0, &opts) else {
        return;
    };
    let mut x = vec![0.0f32; d];
    for (xi, c) in x.iter_mut().zip(data[3..].chunks(4)) {
        let mut b = [0u8; 4];
        b[..c.len()].copy_from_slice(c);
        *xi = f32::from_le_bytes(b);
    }
    let sz = codec.token_sizes();
    let mut codes = vec![0u8; sz.code_bytes];
    let mut sc = vec![f16::ZERO; sz.scalars];
    codec.encode(&x, &mut codes, &mut sc).unwrap();
    if let Some(tq) = codec.tq() {
        let mut c2 = vec![0u8; sz.code_bytes];
        let mut s2 = vec![f16::ZERO; sz.scalars];
        tq.encode_with_isa(&x, &mut c2, &mut s2, Isa::Scalar)
            .unwrap();
        assert_eq!(codes, c2, "SIMD and scalar codes differ");
        let bits = |s: &[f16]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&sc), bits(&s2), "SIMD and scalar scalars differ");
    }
    let mut y = vec![0.0f32; d];
    codec.decode(&codes, &sc, &mut y).unwrap();
    let pq = codec.prepare_query(&x).unwrap();
    let _ = codec.score(&pq, &codes, &sc).unwrap();
    // Arbitrary code bytes (not produced by the encoder) must decode without panicking too.
    let mut junk = codes.clone();
    for (j, b) in junk.iter_mut().zip(data.iter().rev()) {
        *j ^= *b;
    }
    codec.decode(&junk, &sc, &mut y).unwrap();
});
