//! Dequantization pinned to an independent implementation: blocks of random bytes (with sane
//! f16 scales) dequantized by the `gguf` Python package (gguf-py 0.19, itself checked against
//! ggml), recorded as an FNV-1a hash of the little-endian f32 results. Our output must be
//! bit-identical.

use super::{GgmlType, dequantize_row};

/// (format, block bytes as hex, FNV-1a 64 of the expected f32 bytes).
const FIXTURES: [(GgmlType, &str, u64); 8] = [
    (
        GgmlType::Q4_0,
        "ce28d43d564803add9d0a317a4e2dd36e1601828903f384fe43b9fe863cfa9cc72a553eaaea8ecfe08ec1a14e34d692467a630de485b17ab462e7e2a2e784a2ec4e2efe995d1115c",
        0x5198e316b4cc6d5d,
    ),
    (
        GgmlType::Q4_1,
        "31205a250ac0d390600804b086682f014438dd3347a885a599aff3105860c2f941373ba49657a7cc75a2f822c259c9985b4b5d58701d4a536ad02b21aea1d119f1cf4bc477765671dff775d39eb82d47",
        0x279413a330d03137,
    ),
    (
        GgmlType::Q5_0,
        "b7aece9d2c284c494c9a195ff29615c6abd8165d47140f28276f3e7da418d0779300b47c87aa05f7cea1c83d75abf2e57d011832cf973b1457c0185103b5c53e2a51fb28bb344e2f88375e340c34cde7fcbd02d0ccefc78d",
        0xa6ad2a2f5e3358d5,
    ),
    (
        GgmlType::Q5_1,
        "b8270ba8d52e753a0ee1e7158d7e1c06bbcd832e8cda34b26ca14ca89cfb3b56384cc7afaed38c57587992fdd2819d46cfa7c6a526105840df123792996ff291b046dbeaee997755e6a8552b16faf36c6d43829bf8abb1335d2f12ffe9245281",
        0xec708246350720ac,
    ),
    (
        GgmlType::Q8_0,
        "2022470322dad30a2e64f3035801c33d2f6c6fef64bee30dd690019a9ea4fa0171bf6d1f23007552a38dde2947113168d6c05a0db3d9f2db2a6ad6736031730318d02500dd2b5bb735e6e05c96e7fa74786056adba9ecd966ac9c8adca1a7a2576a1c7c3682ff2a69c09a58ddafe19612c21bf4a29aee9687b4654c7fda6d990d2aa7e308749be42",
        0xec3025e0e0ca3af4,
    ),
    (
        GgmlType::Q4K,
        "37a9d3a9a5798e474c9094617ff7f037bee759089548b2212aa230d9ae3c918c58a5a18ac1c86b32e602bbaeeaa54cc0a6a0faeee9bca547a395fe02ef60cff7626930e4273aab900ee86dfe80998516dcb2548f767fc79e141600374b498235efbf618add10b4605a1fa784c85b213571860b701170bc48f2130a883fedfd9c45558c7dba246681c843a34365c005056c241ca92610afeadf3e939a68ef2f3ff3b7797195685c7c23212a6cbf9fd5203514edd94bc42e62a68884021da946c89fab2204dccb383d0fbf3661ab7334d88f23f9b5144d349da80f747806a53da21fe8bce0b0f7b2e7cad65dc12a667a82a5bb4a38798585237bbcca5e5670f6a3dd94e12f10c269a23578a2d34a44d1ccc2280a5a3b126520e03b25e44758d037",
        0x92ef75e2d8c04dde,
    ),
    (
        GgmlType::Q5K,
        "59a2882d680a33643ca3ac2379e65d2150209a60e9879d975376a55ca3854b0d296bf34f6c364d0f8c5cef1562984242f8c99b95cda6b65e86392912904230900dff37ebe4e811e8f4e7bbe3b2c90f3b92516dd4327c3726fef45e4f76a45522a0647fca574bcd1295de71888a7bab27e52226ed1ad05938ec4e0377ae20baf291abfe86243aa5dfa3c111f744fd0d2411412aa85466bac79f602adb383bac01aa932bed2674f8a951782045a5fb08502b2442131ca7995bb18391f7abd0be39b2c4293687fce58f757566b2102f2eee930c23ca1b6a47d43e8a784f3f95b6d07479ddaa452ddf82e76298bd988d55f95544b4c7f6b7ddd6d73679dc5f8874a0d102194013ef9ee3fe887ec61deb6716b36cc406df6dba37ff06d07adf0f51e80888c6c4e5fb202e228e91a0dd9153155468d50b7cced563c45fb87bdc86a8b74998e917d54665988afae8a30b9c468871f5c6019fd320be2f2f131b036c5dd5",
        0x0d8123e7c7fdd0c6,
    ),
    (
        GgmlType::Q6K,
        "c929db3195a6637d317ee09ac3bb3e55e50f334c75222c22b643e4eccf53ccbcdf67b4504bf7aa1e87d5307cec9183d52708ced52abd922d64efb2af7b3602127c2a5673b52eb9acd18b0419649b168405c0e036f6c3642ed8860ec8f33ed809cbbac7c551d7ad484591e5beec71baddb69a57f9f246dc5f69e693f6694963c5d1b9e6e570f2c1fc043523ef2c2409d04603515fb70dacfc635e57e27492677ccc7d8e18ead78cf3a92f58aa3e8e1432cd79ae30bb2fe830e57f486e90cdcfb11c236839100e6cf761368a04f62058a48a285ca9a6679d92ab3bb2bf174c5ddd6e0feb7745265c4630bd6d6675f181e176f680bfa5e42f0f482b56e5a5d5da36053f834f97fadbcfae36b49fa193448f737b761b68e544d6e69d9974c22e6c6169d5dea8d397ad08d357766faadcf2941629fd9eb07ed6a547da1d70af69ef1ee5fefb338b8fd49c7a1f801d9b1231bf5ff8c4a441af65f6ff78020bfa43a8a9bbe01c2d39a27e93d3e590da41cf67a6c414abd08542bf64ae9d4c7837509a8a34e0de544adf9c71f3a6614139aca58d9d51eedc7e7eb6a4284e4b78459e91a7430c49a8",
        0xfbc75e234c7a4802,
    ),
];

fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    for (ty, hex, want) in FIXTURES {
        let raw: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let mut y = vec![0f32; raw.len() / ty.block_bytes() * ty.block_len()];
        dequantize_row(ty, &raw, &mut y).unwrap();
        let got = fnv1a(y.iter().flat_map(|v| v.to_le_bytes()));
        assert_eq!(got, want, "{ty:?}");
    }
}

/// FNV-1a 64 of the blocks gguf-py's `quantize` makes of `x[i] = ((37·i) mod 101 − 50) / 7`,
/// i < 128 (the same round-to-nearest as ggml's `quantize_row_*_ref`).
const QUANTIZE_FIXTURES: [(GgmlType, u64); 5] = [
    (GgmlType::Q4_0, 0xb9ea2b0135ee19fe),
    (GgmlType::Q4_1, 0xe06c25b1d5122118),
    (GgmlType::Q5_0, 0x206316f9e2adb055),
    (GgmlType::Q5_1, 0xa2170e62e0a0f6f7),
    (GgmlType::Q8_0, 0xeb919beb2a86b2e8),
];

#[test]
fn quantize_matches_gguf_py_bit_for_bit() {
    let x: Vec<f32> = (0..128)
        .map(|i| ((37 * i) % 101 - 50) as f32 / 7.0)
        .collect();
    for (ty, want) in QUANTIZE_FIXTURES {
        let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
        super::quantize_row(ty, &x, &mut q).unwrap();
        assert_eq!(fnv1a(q), want, "{ty:?}");
    }
}
