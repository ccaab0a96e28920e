//! A copy of a GGUF file with its weight matrices in a float format: an f16 or bf16 model of
//! a real shape from a quantized one, to test and measure the float-weight kernels without a
//! second download.

use turbokv_backend::quant::{GgmlType, dequantize_row, quantize_row};

use super::{GgufError, GgufFile, GgufWriter};

/// Which float format [`reencode_matrices`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatFormat {
    /// IEEE half precision (`ggml_type` 1).
    F16,
    /// bfloat16 (`ggml_type` 30).
    Bf16,
    /// f32 (`ggml_type` 0).
    F32,
}

impl FloatFormat {
    fn ggml(self) -> (GgmlType, u32) {
        match self {
            Self::F16 => (GgmlType::F16, 1),
            Self::Bf16 => (GgmlType::Bf16, 30),
            Self::F32 => (GgmlType::F32, 0),
        }
    }
}

impl std::str::FromStr for FloatFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::Bf16),
            "f32" => Ok(Self::F32),
            other => Err(format!("unknown float format `{other}` (f16, bf16, f32)")),
        }
    }
}

/// Every metadata entry of `file`, its 2-D tensors dequantized and re-encoded as `to` (the
/// values the quantized weights stand for, rounded to `to`), other tensors as they are.
pub fn reencode_matrices(file: &GgufFile, to: FloatFormat) -> Result<GgufWriter, GgufError> {
    let (ty, id) = to.ggml();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata.iter() {
        w.meta(k, v.clone());
    }
    let type_err = |name: &str| {
        let name = name.to_string();
        move |source| GgufError::TensorType {
            tensor: name,
            source,
        }
    };
    for info in file.tensors() {
        let bytes = file.tensor_bytes(info);
        let &[cols, rows] = info.dims.as_slice() else {
            // Norm weights and biases: already f32 in the files this reader knows.
            let id = ggml_id(info.ty).ok_or_else(|| GgufError::Corrupt {
                offset: info.offset,
                what: format!("{}: a {:?} tensor that is not a matrix", info.name, info.ty),
            })?;
            w.tensor(&info.name, &info.dims, id, bytes.to_vec());
            continue;
        };
        let src_rb = info.ty.row_bytes(cols).map_err(type_err(&info.name))?;
        let dst_rb = ty.row_bytes(cols).map_err(type_err(&info.name))?;
        let mut out = vec![0u8; rows * dst_rb];
        let mut row = vec![0f32; cols];
        for (src, dst) in bytes.chunks_exact(src_rb).zip(out.chunks_exact_mut(dst_rb)) {
            dequantize_row(info.ty, src, &mut row).map_err(type_err(&info.name))?;
            quantize_row(ty, &row, dst).map_err(type_err(&info.name))?;
        }
        w.tensor(&info.name, &info.dims, id, out);
    }
    Ok(w)
}

/// The on-disk number of a float type (the only ones left as they are).
fn ggml_id(ty: GgmlType) -> Option<u32> {
    match ty {
        GgmlType::F32 => Some(0),
        GgmlType::F16 => Some(1),
        GgmlType::Bf16 => Some(30),
        _ => None,
    }
}
