//! OCP FP8 E4M3 ("E4M3FN"): the per-coordinate number of the `fp8` KV format.
//!
//! One byte `S EEEE MMM`: sign, a 4-bit exponent with bias 7 and a 3-bit mantissa.
//! * `E = 0`: subnormal, `(−1)^S · M · 2⁻⁹` (so `0x00` is +0 and `0x80` is −0);
//! * `1 ≤ E ≤ 15`: `(−1)^S · (1 + M/8) · 2^(E − 7)`, except
//! * `E = 15, M = 7` (`0x7F`, `0xFF`): NaN. There are no infinities; the largest finite
//!   magnitude is `0x7E` = 1.75 · 2⁸ = 448.
//!
//! [`encode`] rounds to the nearest representable value, ties to an even mantissa, and
//! saturates: every magnitude ≥ 448 (infinity included) becomes ±448, so finite input never
//! yields a NaN code. NaN input becomes `0x00`. Magnitudes in the normal range
//! (`2⁻⁶ ≤ |x| ≤ 448`) keep a relative error ≤ 2⁻⁴ (half of a 3-bit mantissa's unit); below
//! it the absolute error is ≤ 2⁻¹⁰ (half the subnormal step).

/// Largest finite E4M3 magnitude.
pub const MAX: f32 = 448.0;

/// The code of +448 (`0x7E`); −448 is `0xFE`.
const MAX_CODE: u8 = 0x7E;

/// Smallest normal magnitude, 2⁻⁶.
const MIN_NORMAL: f32 = 1.0 / 64.0;

/// Every code's value, in code order (built at compile time from [`decode_slow`]).
static TABLE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = decode_slow(c as u8);
        c += 1;
    }
    t
};

/// The value of code `c` (NaN for `0x7F`, `0xFF`).
#[inline]
pub fn decode(c: u8) -> f32 {
    TABLE[usize::from(c)]
}

/// The value of code `c`, from the bit fields.
const fn decode_slow(c: u8) -> f32 {
    let (e, m) = ((c >> 3) & 0xF, c & 0x7);
    let mag = if e == 0xF && m == 0x7 {
        f32::NAN
    } else if e == 0 {
        // m · 2⁻⁹ is exact in f32.
        m as f32 / 512.0
    } else {
        // The exponent re-biased from 7 to 127, the mantissa moved to the top of f32's.
        f32::from_bits(((e as u32 + 120) << 23) | ((m as u32) << 20))
    };
    if c & 0x80 != 0 { -mag } else { mag }
}

/// The E4M3 code nearest to `x` (ties to even), saturating at ±448; NaN gives `0x00`.
#[inline]
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    let mag = if a >= MAX {
        MAX_CODE
    } else if a < MIN_NORMAL {
        // Subnormal range: steps of 2⁻⁹; a · 2⁹ is exact, and a result of 8 is the code of
        // 2⁻⁶ (E = 1, M = 0), so the rounded count is the code.
        (a * 512.0).round_ties_even() as u8
    } else {
        // Round f32's 23-bit mantissa to 3 bits, ties to even, on the bit pattern: adding
        // 2¹⁹ − 1 plus the lowest kept bit carries exactly when the dropped 20 bits are above
        // half (or at half with an odd kept bit), and a carry out of the mantissa bumps the
        // exponent as it should. `a < 448` cannot round past 448.
        let b = a.to_bits();
        let r = (b + 0x7FFFF + ((b >> 20) & 1)) >> 20;
        // r = (biased exponent) << 3 | mantissa; re-bias the exponent from 127 to 7.
        (r - (120 << 3)) as u8
    };
    sign | mag
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn is_nan_code(c: u8) -> bool {
        c & 0x7F == 0x7F
    }

    /// The code a brute-force search over all finite codes picks for `x`: nearest value, on a
    /// tie the one with an even mantissa (even code), saturating.
    fn nearest_brute_force(x: f32) -> u8 {
        if x.is_nan() {
            return 0;
        }
        let x = x.clamp(-MAX, MAX);
        let mut best: Option<(f64, u8)> = None;
        for c in 0..=255u8 {
            if is_nan_code(c) {
                continue;
            }
            let v = decode(c);
            // The sign of zero follows the input.
            if v == 0.0 && (c & 0x80 != 0) != x.is_sign_negative() {
                continue;
            }
            let d = (f64::from(v) - f64::from(x)).abs();
            best = match best {
                None => Some((d, c)),
                Some((bd, bc)) if d < bd || (d == bd && c % 2 == 0 && bc % 2 == 1) => Some((d, c)),
                keep => keep,
            };
        }
        best.unwrap().1
    }

    #[test]
    fn every_code_decodes_to_its_specified_value() {
        for c in 0..=255u8 {
            let (s, e, m) = (c >> 7, (c >> 3) & 0xF, c & 7);
            let v = decode(c);
            if e == 15 && m == 7 {
                assert!(v.is_nan(), "{c:#04x}");
                continue;
            }
            let mag = if e == 0 {
                f64::from(m) * 2f64.powi(-9)
            } else {
                (1.0 + f64::from(m) / 8.0) * 2f64.powi(i32::from(e) - 7)
            };
            let want = if s == 1 { -mag } else { mag };
            assert_eq!(f64::from(v), want, "{c:#04x}");
            assert_eq!(v.is_sign_negative(), s == 1, "{c:#04x} sign");
        }
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0xFE), -448.0);
        assert_eq!(decode(0x08), 1.0 / 64.0);
        assert_eq!(decode(0x01), 1.0 / 512.0);
        assert_eq!(decode(0x38), 1.0);
    }

    #[test]
    fn every_finite_code_round_trips() {
        for c in 0..=255u8 {
            if !is_nan_code(c) {
                assert_eq!(encode(decode(c)), c, "{c:#04x} = {}", decode(c));
            }
        }
    }

    #[test]
    fn midpoints_round_to_even_and_saturation_holds() {
        // Every midpoint between neighbouring positive finite values, exactly representable
        // in f32, goes to the even code; a hair either side goes to the nearer one.
        for c in 0..MAX_CODE {
            let (lo, hi) = (decode(c), decode(c + 1));
            let mid = (lo + hi) / 2.0;
            let even = if c % 2 == 0 { c } else { c + 1 };
            assert_eq!(encode(mid), even, "midpoint of {c:#04x}");
            assert_eq!(encode(-mid), even | 0x80, "midpoint of -{c:#04x}");
            assert_eq!(encode(mid.next_down()), c, "below midpoint of {c:#04x}");
            assert_eq!(encode(mid.next_up()), c + 1, "above midpoint of {c:#04x}");
        }
        for x in [448.0, 449.0, 464.0, 480.0, 1e30, f32::MAX, f32::INFINITY] {
            assert_eq!(encode(x), 0x7E, "{x}");
            assert_eq!(encode(-x), 0xFE, "-{x}");
        }
        assert_eq!(encode(f32::NAN), 0);
        assert_eq!(encode(-f32::NAN), 0);
        assert_eq!(encode(-0.0), 0x80);
        assert_eq!(encode(f32::from_bits(1)), 0);
        // Half the smallest subnormal is a tie with 0 (even).
        assert_eq!(encode(1.0 / 1024.0), 0);
        assert_eq!(encode(3.0 / 1024.0), 2);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        #[test]
        fn encode_is_the_nearest_code(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assert_eq!(encode(x), nearest_brute_force(x), "x = {:e}", x);
        }

        #[test]
        fn encode_is_the_nearest_code_in_range(x in -500.0f32..500.0) {
            prop_assert_eq!(encode(x), nearest_brute_force(x), "x = {:e}", x);
        }

        #[test]
        fn normal_range_relative_error_is_at_most_one_sixteenth(x in MIN_NORMAL..MAX) {
            let y = decode(encode(x));
            prop_assert!((y - x).abs() <= x / 16.0, "{} -> {}", x, y);
        }
    }
}
