//! ggml's MXFP4 (type 39, gpt-oss's expert weights): blocks of 32 e2m1 values sharing one
//! e8m0 power-of-two scale, 17 bytes each (the scale byte, then 16 bytes whose low nibbles
//! are elements 0..16 and high nibbles elements 16..32).
//!
//! Every MXFP4 value (at most two significant bits times a power of two in f32's exponent
//! range) is exact in bf16, so dequantizing to bf16 loses nothing.

use half::bf16;

/// The ggml type number.
pub const GGML_TYPE_MXFP4: u32 = 39;
/// Elements per block.
pub const BLOCK: usize = 32;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 17;

/// e2m1 codes times two (ggml's `kvalues_mxfp4`); the scale below halves them back.
const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the e8m0 scale, `2^(e − 128)` (ggml's `GGML_E8M0_TO_FP32_HALF`, subnormal for
/// `e < 2`).
fn half_scale(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// Dequantizes whole blocks of `src` into `dst` (`dst.len() = 32 · blocks`).
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        let d = half_scale(b[0]);
        for (j, &q) in b[1..].iter().enumerate() {
            y[j] = KVALUES[(q & 0x0f) as usize] as f32 * d;
            y[j + BLOCK / 2] = KVALUES[(q >> 4) as usize] as f32 * d;
        }
    }
}

/// Dequantizes whole blocks of `src` to little-endian bf16 bytes (exact).
pub fn to_bf16_bytes(src: &[u8]) -> Vec<u8> {
    let mut vals = vec![0f32; src.len() / BLOCK_BYTES * BLOCK];
    dequantize(src, &mut vals);
    vals.iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_decode_as_ggml_does() {
        // Scale byte 127 → half scale 0.5: codes decode to the e2m1 grid itself.
        let mut block = [0u8; BLOCK_BYTES];
        block[0] = 127;
        for j in 0..16 {
            block[1 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut out = [0f32; BLOCK];
        dequantize(&block, &mut out);
        let grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for j in 0..16 {
            let want = |c: usize| if c < 8 { grid[c] } else { -grid[c - 8] };
            assert_eq!(out[j], want(j), "low nibble {j}");
            assert_eq!(out[j + 16], want(15 - j), "high nibble {j}");
        }
        // The scale is a power of two, subnormal at the bottom of the range.
        assert_eq!(half_scale(130), 4.0);
        assert_eq!(half_scale(1), 2f32.powi(-127));
        assert_eq!(half_scale(0), 2f32.powi(-128));
        // A block as llama.cpp's converter repacks gpt-oss's `*_blocks`/`*_scales` (the scale
        // byte first; its low nibbles are elements 0..16): scale 125 is 2^-2, so code 0x7
        // (e2m1 6) is 1.5 and code 0xB (−1.5) is −0.375; element 3 is code 0x1 (0.5 → 0.125)
        // from the low nibble of byte 3, element 19 code 0xE (−4 → −1) from its high nibble.
        let mut repacked = [0u8; BLOCK_BYTES];
        repacked[0] = 125;
        repacked[1] = 0xB7;
        repacked[4] = 0xE1;
        let mut got = [0f32; BLOCK];
        dequantize(&repacked, &mut got);
        let mut want = [0f32; BLOCK];
        (want[0], want[16], want[3], want[19]) = (1.5, -0.375, 0.125, -1.0);
        assert_eq!(got, want);
        // bf16 holds every value exactly.
        let bytes = to_bf16_bytes(&block);
        for (j, b) in bytes.chunks(2).enumerate() {
            assert_eq!(bf16::from_le_bytes([b[0], b[1]]).to_f32(), out[j]);
        }
    }
}
