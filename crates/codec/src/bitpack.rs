//! LSB-first bit packing of b-bit codes (b = 1..=8).
//!
//! Code `i` occupies bits `[i·b, (i+1)·b)` of the stream; stream bit `k` is bit `k % 8` of
//! byte `k / 8`. The last byte is zero-padded. With b = 3, eight codes fill exactly three bytes.

use crate::error::{Error, Result};

/// Bytes needed for `n` codes of `bits` bits.
pub fn packed_len(n: usize, bits: u8) -> usize {
    (n * usize::from(bits)).div_ceil(8)
}

fn check(n: usize, bits: u8, bytes: usize) -> Result<()> {
    if !(1..=8).contains(&bits) {
        return Err(Error::InvalidConfig {
            what: "code width",
            reason: "1 to 8 bits",
        });
    }
    let want = packed_len(n, bits);
    if bytes != want {
        return Err(Error::LengthMismatch {
            what: "packed codes",
            expected: want,
            got: bytes,
        });
    }
    Ok(())
}

/// Packs `codes` (each `< 2^bits`; higher bits are masked off) into `out`.
pub fn pack(codes: &[u8], bits: u8, out: &mut [u8]) -> Result<()> {
    check(codes.len(), bits, out.len())?;
    match bits {
        8 => out.copy_from_slice(codes),
        1 | 2 | 4 => pack_aligned(codes, bits, out),
        _ => pack_generic(codes, bits, out),
    }
    Ok(())
}

/// Unpacks `out.len()` codes of `bits` bits from `packed`.
pub fn unpack(packed: &[u8], bits: u8, out: &mut [u8]) -> Result<()> {
    check(out.len(), bits, packed.len())?;
    let mask = ((1u16 << bits) - 1) as u8;
    match bits {
        8 => out.copy_from_slice(packed),
        1 | 2 | 4 => {
            let per = 8 / usize::from(bits);
            for (i, o) in out.iter_mut().enumerate() {
                let shift = (i % per) * usize::from(bits);
                *o = (packed[i / per] >> shift) & mask;
            }
        }
        _ => {
            let mut acc: u32 = 0;
            let mut have = 0u32;
            let mut src = packed.iter();
            for o in out.iter_mut() {
                if have < u32::from(bits) {
                    acc |= u32::from(src.next().copied().unwrap_or(0)) << have;
                    have += 8;
                }
                *o = (acc as u8) & mask;
                acc >>= bits;
                have -= u32::from(bits);
            }
        }
    }
    Ok(())
}

/// Reads code `i` without unpacking the rest. Bytes beyond `packed` read as zero; `bits` is
/// clamped to 1..=8.
#[inline]
pub fn get(packed: &[u8], bits: u8, i: usize) -> u8 {
    let bits = bits.clamp(1, 8);
    let bit = i * usize::from(bits);
    let byte = bit / 8;
    let shift = bit % 8;
    let lo = u16::from(packed.get(byte).copied().unwrap_or(0));
    let hi = u16::from(packed.get(byte + 1).copied().unwrap_or(0));
    (((lo | (hi << 8)) >> shift) as u8) & (((1u16 << bits) - 1) as u8)
}

fn pack_aligned(codes: &[u8], bits: u8, out: &mut [u8]) {
    let per = 8 / usize::from(bits);
    let mask = ((1u16 << bits) - 1) as u8;
    for (o, chunk) in out.iter_mut().zip(codes.chunks(per)) {
        let mut byte = 0u8;
        for (k, &c) in chunk.iter().enumerate() {
            byte |= (c & mask) << (k * usize::from(bits));
        }
        *o = byte;
    }
}

fn pack_generic(codes: &[u8], bits: u8, out: &mut [u8]) {
    let mask = (1u32 << bits) - 1;
    let mut acc: u32 = 0;
    let mut have = 0u32;
    let mut dst = out.iter_mut();
    for &c in codes {
        acc |= (u32::from(c) & mask) << have;
        have += u32::from(bits);
        while have >= 8 {
            if let Some(d) = dst.next() {
                *d = acc as u8;
            }
            acc >>= 8;
            have -= 8;
        }
    }
    if have > 0
        && let Some(d) = dst.next()
    {
        *d = acc as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference_pack(codes: &[u8], bits: u8) -> Vec<u8> {
        let mut out = vec![0u8; packed_len(codes.len(), bits)];
        for (i, &c) in codes.iter().enumerate() {
            for k in 0..bits as usize {
                if (c >> k) & 1 == 1 {
                    let bit = i * bits as usize + k;
                    out[bit / 8] |= 1 << (bit % 8);
                }
            }
        }
        out
    }

    #[test]
    fn three_bit_layout_is_lsb_first() {
        let codes = [1u8, 2, 3, 4, 5, 6, 7, 0];
        let mut out = [0u8; 3];
        pack(&codes, 3, &mut out).unwrap();
        // bits: 001 010 011 100 101 110 111 000, LSB first.
        let v = u32::from(out[0]) | u32::from(out[1]) << 8 | u32::from(out[2]) << 16;
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!((v >> (3 * i)) & 7, u32::from(c));
        }
    }

    #[test]
    fn rejects_bad_lengths() {
        let mut out = [0u8; 2];
        assert!(pack(&[0; 8], 3, &mut out).is_err());
        assert!(pack(&[0; 8], 0, &mut out).is_err());
        assert!(unpack(&out, 9, &mut [0; 1]).is_err());
    }

    proptest! {
        #[test]
        fn round_trip(bits in 1u8..=8, raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mask = ((1u16 << bits) - 1) as u8;
            let codes: Vec<u8> = raw.iter().map(|c| c & mask).collect();
            let mut packed = vec![0u8; packed_len(codes.len(), bits)];
            pack(&codes, bits, &mut packed).unwrap();
            prop_assert_eq!(&packed, &reference_pack(&codes, bits));
            let mut back = vec![0u8; codes.len()];
            unpack(&packed, bits, &mut back).unwrap();
            prop_assert_eq!(&back, &codes);
            for (i, &c) in codes.iter().enumerate() {
                prop_assert_eq!(get(&packed, bits, i), c);
            }
        }
    }
}
