//! `KvDtype`: which number format a layer's keys and values are stored in, and what it costs.
//!
//! Spellings (case-insensitive, surrounding whitespace ignored):
//! `bf16`, `f16`, `int8`, `fp8` (or `e4m3`), `tq{b}` (keys and values at `b` bits), `k{b}v{b}` (different
//! widths), where `b` ∈ {1, 1.5, 2, 2.5, 3, 3.5, 4}. `Display` prints the canonical spelling,
//! which parses back to the same value.
//!
//! Fractional widths `b.5` use an outlier-channel split: half of the channels (the outliers,
//! `head_dim / 2` of them) at `⌈b⌉` bits and the rest at `⌊b⌋` bits, each half with its own
//! rotation and norm. (The TurboQuant paper's "2.5-bit" setting quotes 32 of 128 channels at 3
//! bits, which is really (32·3 + 96·2)/128 = 2.25 bits; we split evenly so the label is true.)

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// How keys are quantized in TurboQuant formats. Values always use [`KeyMode::Mse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyMode {
    /// TurboQuant-MSE: `b` bits of Lloyd–Max codes per coordinate plus one f16 norm.
    #[default]
    Mse,
    /// TurboQuant-prod: `b − 1` bits of MSE codes, a 1-bit QJL sign sketch of the residual,
    /// and the residual norm (f16). Unbiased inner products, higher variance.
    Prod,
}

impl KeyMode {
    /// Stable lower-case name (`"mse"`, `"prod"`).
    pub fn as_str(self) -> &'static str {
        match self {
            KeyMode::Mse => "mse",
            KeyMode::Prod => "prod",
        }
    }
}

impl fmt::Display for KeyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KeyMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "mse" => Ok(KeyMode::Mse),
            "prod" | "qjl" => Ok(KeyMode::Prod),
            _ => Err(Error::InvalidConfig {
                what: "key mode",
                reason: "expected \"mse\" or \"prod\"",
            }),
        }
    }
}

/// A TurboQuant bit width per coordinate, stored in half-bits so that 2.5 and 3.5 are exact.
///
/// Invariant: `2 <= half_bits <= 8` (1 to 4 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TqBits(u8);

impl TqBits {
    /// 1 bit.
    pub const B1: TqBits = TqBits(2);
    /// 1.5 bits (outlier split 2/1).
    pub const B1_5: TqBits = TqBits(3);
    /// 2 bits.
    pub const B2: TqBits = TqBits(4);
    /// 2.5 bits (outlier split 3/2).
    pub const B2_5: TqBits = TqBits(5);
    /// 3 bits.
    pub const B3: TqBits = TqBits(6);
    /// 3.5 bits (outlier split 4/3).
    pub const B3_5: TqBits = TqBits(7);
    /// 4 bits.
    pub const B4: TqBits = TqBits(8);

    /// From a width in half-bits (e.g. 5 = 2.5 bits).
    pub fn from_half_bits(half_bits: u8) -> Result<Self, Error> {
        if (2..=8).contains(&half_bits) {
            Ok(TqBits(half_bits))
        } else {
            Err(Error::UnsupportedBits { half_bits })
        }
    }

    /// From a whole number of bits (1–4).
    pub fn from_bits(bits: u8) -> Result<Self, Error> {
        Self::from_half_bits(bits.saturating_mul(2))
    }

    /// The width in half-bits.
    pub fn half_bits(self) -> u8 {
        self.0
    }

    /// The width in bits.
    pub fn bits(self) -> f64 {
        f64::from(self.0) / 2.0
    }

    /// True for 1.5, 2.5, 3.5.
    pub fn is_fractional(self) -> bool {
        self.0 % 2 == 1
    }

    /// Bits of the outlier channels (`⌈b⌉`).
    pub fn hi_bits(self) -> u8 {
        self.0.div_ceil(2)
    }

    /// Bits of the regular channels (`⌊b⌋`).
    pub fn lo_bits(self) -> u8 {
        self.0 / 2
    }
}

impl fmt::Display for TqBits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_fractional() {
            write!(f, "{}.5", self.0 / 2)
        } else {
            write!(f, "{}", self.0 / 2)
        }
    }
}

impl FromStr for TqBits {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let half = match s {
            "1" => 2,
            "1.5" => 3,
            "2" => 4,
            "2.5" => 5,
            "3" => 6,
            "3.5" => 7,
            "4" => 8,
            _ => {
                return Err(Error::UnknownDtype {
                    input: s.to_owned(),
                    accepted: ACCEPTED,
                });
            }
        };
        Ok(TqBits(half))
    }
}

/// The storage format of one layer's keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// bfloat16, stored raw.
    Bf16,
    /// IEEE half, stored raw.
    F16,
    /// int8 per coordinate with one f16 absmax scale per vector.
    Int8,
    /// FP8 E4M3 per coordinate with one f16 absmax scale per vector (see [`crate::fp8`]).
    Fp8,
    /// TurboQuant with separate key and value widths.
    Tq {
        /// Key bits per coordinate.
        key_bits: TqBits,
        /// Value bits per coordinate.
        value_bits: TqBits,
    },
}

const ACCEPTED: &str = "bf16, f16, int8, fp8, tq{b} or k{b}v{b} with b in {1, 1.5, 2, 2.5, 3, 3.5, 4} \
                        (e.g. tq3, tq2.5, k4v3, k3.5v2)";

/// Bits of one f16 side-info scalar (norm, residual norm, scale).
const F16_BITS: f64 = 16.0;

impl KvDtype {
    /// TurboQuant with equal key and value widths.
    pub fn tq(bits: TqBits) -> Self {
        KvDtype::Tq {
            key_bits: bits,
            value_bits: bits,
        }
    }

    /// True for formats smaller than 16 bits (int8, fp8 and TurboQuant).
    pub fn is_compressed(&self) -> bool {
        !matches!(self, KvDtype::Bf16 | KvDtype::F16)
    }

    /// Storage bits per key element at `head_dim`, including side information (norms,
    /// residual norms, scales), excluding block padding.
    pub fn key_bits_per_element(&self, head_dim: usize, key_mode: KeyMode) -> f64 {
        match *self {
            KvDtype::Tq { key_bits, .. } => tq_bits_per_element(key_bits, head_dim, key_mode),
            _ => self.plain_bits_per_element(head_dim),
        }
    }

    /// Storage bits per value element at `head_dim`, including side information.
    pub fn value_bits_per_element(&self, head_dim: usize) -> f64 {
        match *self {
            KvDtype::Tq { value_bits, .. } => {
                tq_bits_per_element(value_bits, head_dim, KeyMode::Mse)
            }
            _ => self.plain_bits_per_element(head_dim),
        }
    }

    /// Mean of the key and value bits per element.
    pub fn bits_per_element(&self, head_dim: usize, key_mode: KeyMode) -> f64 {
        0.5 * (self.key_bits_per_element(head_dim, key_mode)
            + self.value_bits_per_element(head_dim))
    }

    fn plain_bits_per_element(&self, head_dim: usize) -> f64 {
        match self {
            KvDtype::Bf16 | KvDtype::F16 => 16.0,
            KvDtype::Int8 | KvDtype::Fp8 => 8.0 + F16_BITS / head_dim.max(1) as f64,
            // Not reached: callers handle Tq first.
            KvDtype::Tq { .. } => f64::NAN,
        }
    }
}

/// Bits per element of one TurboQuant vector: code bits plus f16 side info per sub-quantizer
/// (a norm, and a residual norm in prod mode). Fractional widths have two sub-quantizers.
fn tq_bits_per_element(bits: TqBits, head_dim: usize, mode: KeyMode) -> f64 {
    let d = head_dim.max(1);
    let (n_hi, n_lo) = split_sizes(bits, d);
    let code_bits = (n_hi * bits.hi_bits() as usize + n_lo * bits.lo_bits() as usize) as f64;
    let parts = if bits.is_fractional() { 2.0 } else { 1.0 };
    let per_part = match mode {
        KeyMode::Mse => F16_BITS,
        KeyMode::Prod => 2.0 * F16_BITS,
    };
    (code_bits + parts * per_part) / d as f64
}

/// Channel counts (outliers at `hi_bits`, regular at `lo_bits`) for a width at `head_dim`.
/// Whole widths put every channel in the "outlier" set.
pub fn split_sizes(bits: TqBits, head_dim: usize) -> (usize, usize) {
    if bits.is_fractional() {
        let hi = head_dim / 2;
        (hi, head_dim - hi)
    } else {
        (head_dim, 0)
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvDtype::Bf16 => f.write_str("bf16"),
            KvDtype::F16 => f.write_str("f16"),
            KvDtype::Int8 => f.write_str("int8"),
            KvDtype::Fp8 => f.write_str("fp8"),
            KvDtype::Tq {
                key_bits,
                value_bits,
            } if key_bits == value_bits => write!(f, "tq{key_bits}"),
            KvDtype::Tq {
                key_bits,
                value_bits,
            } => write!(f, "k{key_bits}v{value_bits}"),
        }
    }
}

impl FromStr for KvDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let lower = s.trim().to_ascii_lowercase();
        let unknown = || Error::UnknownDtype {
            input: s.to_owned(),
            accepted: ACCEPTED,
        };
        match lower.as_str() {
            "bf16" => return Ok(KvDtype::Bf16),
            "f16" | "fp16" => return Ok(KvDtype::F16),
            "int8" | "i8" => return Ok(KvDtype::Int8),
            "fp8" | "e4m3" | "fp8_e4m3" => return Ok(KvDtype::Fp8),
            _ => {}
        }
        if let Some(b) = lower.strip_prefix("tq") {
            let bits: TqBits = b.parse().map_err(|_| unknown())?;
            return Ok(KvDtype::tq(bits));
        }
        if let Some(rest) = lower.strip_prefix('k')
            && let Some((k, v)) = rest.split_once('v')
        {
            let key_bits: TqBits = k.parse().map_err(|_| unknown())?;
            let value_bits: TqBits = v.parse().map_err(|_| unknown())?;
            return Ok(KvDtype::Tq {
                key_bits,
                value_bits,
            });
        }
        Err(unknown())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_display_round_trip() {
        for s in [
            "bf16", "f16", "int8", "fp8", "tq1", "tq2", "tq2.5", "tq3", "tq3.5", "tq4", "k4v3",
            "k3.5v2", "k1.5v4",
        ] {
            let d: KvDtype = s.parse().unwrap();
            assert_eq!(d.to_string(), s);
            assert_eq!(d.to_string().parse::<KvDtype>().unwrap(), d);
        }
        assert_eq!("k3v3".parse::<KvDtype>().unwrap().to_string(), "tq3");
        assert_eq!(" TQ3 ".parse::<KvDtype>().unwrap(), KvDtype::tq(TqBits::B3));
        for s in ["e4m3", "FP8", "fp8_e4m3"] {
            assert_eq!(s.parse::<KvDtype>().unwrap(), KvDtype::Fp8, "{s}");
        }
    }

    #[test]
    fn parse_rejects_with_list() {
        for s in [
            "", "tq5", "tq0", "tq2.25", "k4", "kv", "q4_0", "k4v", "tq3.5.5", "int4", "fp4", "e5m2",
        ] {
            let err = s.parse::<KvDtype>().unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("accepted") && msg.contains("k{b}v{b}"),
                "{s}: {msg}"
            );
        }
    }

    #[test]
    fn bits_accounting_matches_turboquant_md() {
        let tq3 = KvDtype::tq(TqBits::B3);
        assert_eq!(tq3.key_bits_per_element(128, KeyMode::Mse), 3.125);
        assert_eq!(tq3.key_bits_per_element(128, KeyMode::Prod), 3.25);
        assert_eq!(tq3.value_bits_per_element(128), 3.125);
        assert_eq!(tq3.value_bits_per_element(64), 3.25);
        assert_eq!(KvDtype::Int8.bits_per_element(128, KeyMode::Mse), 8.125);
        assert_eq!(KvDtype::Fp8.bits_per_element(128, KeyMode::Prod), 8.125);
        assert_eq!(KvDtype::Fp8.value_bits_per_element(64), 8.25);
        assert_eq!(KvDtype::Bf16.bits_per_element(128, KeyMode::Prod), 16.0);
        // 2.5 bits: 64 channels at 3 + 64 at 2, two f16 norms.
        let tq25 = KvDtype::tq(TqBits::B2_5);
        assert_eq!(tq25.value_bits_per_element(128), 2.75);
        let k4v3 = KvDtype::Tq {
            key_bits: TqBits::B4,
            value_bits: TqBits::B3,
        };
        assert_eq!(
            k4v3.bits_per_element(128, KeyMode::Mse),
            (4.125 + 3.125) / 2.0
        );
        assert!(k4v3.is_compressed() && KvDtype::Int8.is_compressed());
        assert!(KvDtype::Fp8.is_compressed());
        assert!(!KvDtype::F16.is_compressed());
    }

    #[test]
    fn key_mode_default_and_parse() {
        assert_eq!(KeyMode::default(), KeyMode::Mse);
        assert_eq!("prod".parse::<KeyMode>().unwrap(), KeyMode::Prod);
        assert!("x".parse::<KeyMode>().is_err());
    }
}
