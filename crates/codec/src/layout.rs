//! Byte layout of one paged block: `block_size` tokens × one kv head, for keys or values.
//!
//! ```text
//! offset 0                       codes_bytes                      total_bytes
//! ├─ token 0 codes ─┼─ token 1 ─┼ … ┼─ pad ─┼─ token 0 scalars ─┼ … ┼─ pad ─┤
//! ```
//! * **Codes**: the code records of all `block_size` tokens back to back, slot `t` at
//!   `t · code_bytes_per_token`; the region is zero-padded to a multiple of 16 bytes.
//! * **Scalars**: `scalars_per_token` little-endian f16 values per token, slot `t` at
//!   `scalars_offset + 2 · t · scalars_per_token`; padded to a multiple of 16 bytes.
//!
//! One token's code record and scalars, per dtype (d = head_dim; all bit fields LSB-first,
//! see [`crate::bitpack`]):
//!
//! | dtype | code record | scalars (f16) |
//! |---|---|---|
//! | `bf16`, `f16` | d values, 2 bytes each, little-endian | none |
//! | `int8` | d bytes, two's complement | scale (absmax/127) |
//! | `fp8` | d bytes, OCP FP8 E4M3 (see [`crate::fp8`]) | scale (absmax/448) |
//! | `tq{b}`, MSE | d·b bits of Lloyd–Max codes | norm |
//! | `tq{b}`, prod (keys) | d·(b−1) bits of codes, then d sign bits | norm, γ |
//! | `tq{b}.5` | outlier part (d/2 channels, ⌈b⌉ bits) then regular part (⌊b⌋ bits), each laid out as above and byte-aligned | per part, in the same order: norm (, γ) |
//!
//! Codes are in the rotated basis of each part; which channels form the outlier part is the
//! sorted list in [`crate::OutlierChannels`], and coordinate `i` of a part's code stream is
//! coordinate `i` of that part's rotated sub-vector.

use crate::bitpack::packed_len;
use crate::dtype::{KeyMode, KvDtype, TqBits, split_sizes};
use crate::error::{Error, Result};
use crate::rotation::{MAX_DENSE_DIM, MAX_HADAMARD_DIM};

/// Alignment of each region of a block.
pub const BLOCK_ALIGN: usize = 16;

/// Whether a block holds keys or values (keys may use prod mode; values never do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvRole {
    /// Attention keys.
    Key,
    /// Attention values.
    Value,
}

/// Per-token sizes of one format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenSizes {
    /// Bytes of one token's code record.
    pub code_bytes: usize,
    /// f16 scalars per token.
    pub scalars: usize,
}

/// Where things are in one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes of one token's code record.
    pub code_bytes_per_token: usize,
    /// f16 scalars per token.
    pub scalars_per_token: usize,
    /// Byte offset of the scalars region (= padded size of the codes region).
    pub scalars_offset: usize,
    /// Total bytes of the block (a multiple of 16).
    pub total_bytes: usize,
}

impl BlockLayout {
    /// The layout for `block_size` tokens of a format with `sizes`.
    pub fn new(sizes: TokenSizes, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::InvalidConfig {
                what: "block size",
                reason: "must be at least 1",
            });
        }
        let too_large = Error::InvalidConfig {
            what: "block size",
            reason: "block too large",
        };
        let round_up = |n: usize| n.checked_next_multiple_of(BLOCK_ALIGN);
        let scalars_offset = sizes
            .code_bytes
            .checked_mul(block_size)
            .and_then(round_up)
            .ok_or(too_large.clone())?;
        let total_bytes = sizes
            .scalars
            .checked_mul(2)
            .and_then(|n| n.checked_mul(block_size))
            .and_then(round_up)
            .and_then(|n| n.checked_add(scalars_offset))
            .ok_or(too_large)?;
        Ok(BlockLayout {
            block_size,
            code_bytes_per_token: sizes.code_bytes,
            scalars_per_token: sizes.scalars,
            scalars_offset,
            total_bytes,
        })
    }

    /// Byte range of slot `t`'s code record.
    pub fn codes_range(&self, slot: usize) -> std::ops::Range<usize> {
        let start = slot * self.code_bytes_per_token;
        start..start + self.code_bytes_per_token
    }

    /// Byte range of slot `t`'s scalars.
    pub fn scalars_range(&self, slot: usize) -> std::ops::Range<usize> {
        let start = self.scalars_offset + 2 * slot * self.scalars_per_token;
        start..start + 2 * self.scalars_per_token
    }

    pub(crate) fn check(&self, block_len: usize, slot: usize) -> Result<()> {
        if block_len != self.total_bytes {
            return Err(Error::LengthMismatch {
                what: "block",
                expected: self.total_bytes,
                got: block_len,
            });
        }
        if slot >= self.block_size {
            return Err(Error::SlotOutOfRange {
                slot,
                block_size: self.block_size,
            });
        }
        Ok(())
    }
}

/// Checks that a TurboQuant width works at `head_dim` (each part needs a rotation).
pub(crate) fn validate_tq_dim(bits: TqBits, head_dim: usize) -> Result<()> {
    let min = if bits.is_fractional() { 4 } else { 2 };
    if head_dim < min {
        return Err(Error::UnsupportedHeadDim {
            head_dim,
            reason: "too small for TurboQuant (2, or 4 for fractional widths)",
        });
    }
    let (hi, lo) = split_sizes(bits, head_dim);
    for m in [hi, lo] {
        let ok = m == 0
            || (m.is_power_of_two() && m <= MAX_HADAMARD_DIM)
            || (!m.is_power_of_two() && m <= MAX_DENSE_DIM);
        if !ok {
            return Err(Error::UnsupportedHeadDim {
                head_dim,
                reason: "non-power-of-two (sub-)dimensions above 1024 are not supported",
            });
        }
    }
    Ok(())
}

/// Per-token sizes of `dtype` for keys or values (values are always MSE).
pub fn token_sizes(
    dtype: KvDtype,
    role: KvRole,
    head_dim: usize,
    key_mode: KeyMode,
) -> Result<TokenSizes> {
    if head_dim == 0 {
        return Err(Error::UnsupportedHeadDim {
            head_dim,
            reason: "must be positive",
        });
    }
    let (bits, mode) = match (dtype, role) {
        (KvDtype::Bf16 | KvDtype::F16, _) => {
            return Ok(TokenSizes {
                code_bytes: 2 * head_dim,
                scalars: 0,
            });
        }
        (KvDtype::Int8 | KvDtype::Fp8, _) => {
            return Ok(TokenSizes {
                code_bytes: head_dim,
                scalars: 1,
            });
        }
        (KvDtype::Tq { key_bits, .. }, KvRole::Key) => (key_bits, key_mode),
        (KvDtype::Tq { value_bits, .. }, KvRole::Value) => (value_bits, KeyMode::Mse),
    };
    validate_tq_dim(bits, head_dim)?;
    let (n_hi, n_lo) = split_sizes(bits, head_dim);
    let prod = mode == KeyMode::Prod;
    let mut sizes = TokenSizes {
        code_bytes: 0,
        scalars: 0,
    };
    for (m, b) in [(n_hi, bits.hi_bits()), (n_lo, bits.lo_bits())] {
        if m == 0 {
            continue;
        }
        let mse_bits = if prod { b - 1 } else { b };
        if mse_bits > 0 {
            sizes.code_bytes += packed_len(m, mse_bits);
        }
        if prod {
            sizes.code_bytes += packed_len(m, 1);
        }
        sizes.scalars += if prod { 2 } else { 1 };
    }
    Ok(sizes)
}

/// Bytes of one block (`block_size` tokens × one kv head) of keys or values in `dtype`.
pub fn block_bytes(
    dtype: KvDtype,
    role: KvRole,
    head_dim: usize,
    block_size: usize,
    key_mode: KeyMode,
) -> Result<usize> {
    let sizes = token_sizes(dtype, role, head_dim, key_mode)?;
    Ok(BlockLayout::new(sizes, block_size)?.total_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_at_d128() {
        let tq3 = KvDtype::tq(TqBits::B3);
        let s = token_sizes(tq3, KvRole::Key, 128, KeyMode::Mse).unwrap();
        assert_eq!((s.code_bytes, s.scalars), (48, 1));
        let s = token_sizes(tq3, KvRole::Key, 128, KeyMode::Prod).unwrap();
        assert_eq!((s.code_bytes, s.scalars), (32 + 16, 2));
        // Values ignore the key mode.
        let s = token_sizes(tq3, KvRole::Value, 128, KeyMode::Prod).unwrap();
        assert_eq!((s.code_bytes, s.scalars), (48, 1));
        let s = token_sizes(KvDtype::tq(TqBits::B2_5), KvRole::Value, 128, KeyMode::Mse).unwrap();
        assert_eq!((s.code_bytes, s.scalars), (24 + 16, 2));
        // bits_per_element agrees with the layout (no padding at these sizes).
        for dt in ["tq2", "tq2.5", "tq3", "tq3.5", "tq4", "int8", "fp8", "bf16"] {
            let dt: KvDtype = dt.parse().unwrap();
            for mode in [KeyMode::Mse, KeyMode::Prod] {
                let s = token_sizes(dt, KvRole::Key, 128, mode).unwrap();
                let bits = (8 * s.code_bytes + 16 * s.scalars) as f64 / 128.0;
                assert_eq!(bits, dt.key_bits_per_element(128, mode), "{dt} {mode}");
            }
        }
    }

    #[test]
    fn block_is_padded_and_slots_fit() {
        let l = BlockLayout::new(
            TokenSizes {
                code_bytes: 30,
                scalars: 1,
            },
            3,
        )
        .unwrap();
        assert_eq!(l.scalars_offset, 96);
        assert_eq!(l.total_bytes, 96 + 16);
        assert_eq!(l.codes_range(2), 60..90);
        assert_eq!(l.scalars_range(2), 100..102);
        assert!(l.check(112, 3).is_err());
        assert!(l.check(111, 0).is_err());
        assert!(l.check(112, 2).is_ok());
        let tq = KvDtype::tq(TqBits::B3);
        assert_eq!(
            block_bytes(tq, KvRole::Key, 128, 16, KeyMode::Mse).unwrap(),
            768 + 32
        );
        assert!(block_bytes(tq, KvRole::Key, 128, 0, KeyMode::Mse).is_err());
        assert!(block_bytes(tq, KvRole::Key, 1, 16, KeyMode::Mse).is_err());
        assert!(block_bytes(tq, KvRole::Key, 2050, 16, KeyMode::Mse).is_err());
    }
}
