//! Weight number formats: the GGML block formats GGUF files store, and the host-side
//! [`WeightMatrix`] that keeps a weight in its own format for the kernels to read.
//!
//! Files:
//! - `blocks.rs`: byte layouts of the 32-element formats and of F16/BF16, dequantize + quantize
//!   (bit-exact with ggml's `dequantize_row_*`, round-to-nearest like `quantize_row_*_ref`);
//! - `kquants.rs`: the same for the 256-element K-quant super-blocks;
//! - `activations.rs`: 8-bit quantization of activations, once per matmul call (ggml's
//!   `block_q8_1` / `block_q8_K`), so that dot products run on integers;
//! - `dot_scalar.rs` / `dot_avx2.rs` (+ `dot_avx2_k.rs` for K-quants): weight-row ×
//!   activation dot products, a plain reference and its AVX2 twin computing the same quantity;
//! - `matmul.rs`: [`WeightMatrix::matmul`], parallel over row chunks with rayon;
//! - `tests_*.rs`: round-trip error budgets, known-answer blocks, bit-exactness against an
//!   independent implementation (gguf-py), SIMD == scalar, matmul against an f64 reference.
//!
//! `examples/qmatmul_bench.rs` times the kernels on the demo model's shapes.

use crate::Error;

mod activations;
mod blocks;
mod dot_avx2;
#[cfg(target_arch = "x86_64")]
mod dot_avx2_k;
mod dot_scalar;
mod float_avx2;
mod kquants;
mod matmul;

#[cfg(test)]
mod tests_blocks;
#[cfg(test)]
mod tests_fixtures;
#[cfg(test)]
mod tests_matmul;

/// Dequantizes one row (`dst.len()` elements, a whole number of blocks) of format `ty` from
/// `src`, which must hold exactly `ty.row_bytes(dst.len())` bytes.
///
/// The result is bit-exact with ggml's reference `dequantize_row_*` (no fused multiply-add).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), Error> {
    check_row(ty, src.len(), dst.len())?;
    blocks::dequantize(ty, src, dst);
    Ok(())
}

/// Quantizes `src` (a whole number of blocks) into `dst`, which must hold exactly
/// `ty.row_bytes(src.len())` bytes.
///
/// Round-to-nearest like ggml's `quantize_row_*_ref` (K-quants included: their scale/min
/// search is ported as is). Non-finite inputs give unspecified codes, never a panic.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), Error> {
    check_row(ty, dst.len(), src.len())?;
    blocks::quantize(ty, src, dst);
    Ok(())
}

/// Checks that `bytes` bytes of `ty` hold exactly `elems` elements.
fn check_row(ty: GgmlType, bytes: usize, elems: usize) -> Result<(), Error> {
    let expected = ty.row_bytes(elems)?;
    if bytes != expected {
        return Err(Error::WeightSize {
            expected,
            actual: bytes,
        });
    }
    Ok(())
}

/// A tensor element format as GGUF numbers it (`ggml_type`).
///
/// Block formats store `block_len()` elements in `block_bytes()` bytes; plain formats have a
/// block of one element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 elements: f16 scale + 16 bytes of 4-bit codes (offset 8).
    Q4_0,
    /// 32 elements: f16 scale, f16 min + 16 bytes of 4-bit codes.
    Q4_1,
    /// 32 elements: f16 scale, 4 bytes of high bits, 16 bytes of low nibbles (offset 16).
    Q5_0,
    /// 32 elements: f16 scale, f16 min, 4 bytes of high bits, 16 bytes of low nibbles.
    Q5_1,
    /// 32 elements: f16 scale + 32 int8 codes.
    Q8_0,
    /// 256-element super-block, 8 sub-blocks with 6-bit scales and mins, 4-bit codes.
    Q4K,
    /// 256-element super-block like Q4_K with a fifth bit plane.
    Q5K,
    /// 256-element super-block, 16 sub-blocks with int8 scales, 6-bit codes.
    Q6K,
}

impl GgmlType {
    /// Maps the on-disk `ggml_type` number; unknown or unsupported numbers are an error that
    /// names the type.
    pub fn from_ggml_id(id: u32) -> Result<Self, Error> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            other => {
                return Err(Error::UnsupportedWeightType {
                    id: other,
                    name: ggml_type_name(other),
                });
            }
        })
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Bytes of a row of `cols` elements, or an error if `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Result<usize, Error> {
        if !cols.is_multiple_of(self.block_len()) {
            return Err(Error::RaggedRow {
                ty: self,
                cols,
                block_len: self.block_len(),
            });
        }
        Ok(cols / self.block_len() * self.block_bytes())
    }
}

/// Human-readable name of a `ggml_type` number, for error messages.
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16..=23 => "IQ*",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        _ => "unknown",
    }
}

/// The bytes of one weight tensor: owned, or a window into a memory-mapped model file so
/// that loading a GGUF copies nothing.
#[derive(Clone, Debug)]
pub enum WeightBytes {
    /// Bytes owned by this process (converted or generated weights).
    Owned(std::sync::Arc<Vec<u8>>),
    /// `len` bytes at `offset` of a mapped file.
    Mapped {
        /// The mapping; shared by every tensor of the file.
        map: std::sync::Arc<memmap2::Mmap>,
        /// Start of the tensor in the mapping.
        offset: usize,
        /// Length in bytes.
        len: usize,
    },
}

impl std::ops::Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            Self::Mapped { map, offset, len } => &map[*offset..*offset + *len],
        }
    }
}

/// A 2-D weight `[rows, cols]` (row-major: each output row's `cols` inputs contiguous) kept
/// in its storage format. Invariant: `bytes.len() == rows * ty.row_bytes(cols)`.
#[derive(Clone, Debug)]
pub struct WeightMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: WeightBytes,
}

impl WeightMatrix {
    /// Wraps `bytes` as a `[rows, cols]` matrix of `ty`, checking the size.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, bytes: WeightBytes) -> Result<Self, Error> {
        let expected = rows
            .checked_mul(ty.row_bytes(cols)?)
            .ok_or(Error::SizeOverflow { rows, cols })?;
        if bytes.len() != expected {
            return Err(Error::WeightSize {
                expected,
                actual: bytes.len(),
            });
        }
        Ok(Self {
            ty,
            rows,
            cols,
            bytes,
        })
    }

    /// An f32 matrix from values (row-major).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Self, Error> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(
            GgmlType::F32,
            rows,
            cols,
            WeightBytes::Owned(std::sync::Arc::new(bytes)),
        )
    }

    /// Storage format.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Inputs per row.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Raw storage bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }
}
