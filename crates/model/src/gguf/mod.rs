//! GGUF v2/v3 reader: header, metadata, tensor index, memory-mapped tensor data.
//!
//! Everything read from the file is bounds-checked: a truncated or corrupt file is a
//! [`GgufError`] naming what was wrong and where, never a panic or an oversized allocation.

mod reader;
pub mod reencode;
mod value;
pub mod writer;

pub use value::{MetaValue, Metadata};
pub use writer::GgufWriter;

use std::path::Path;
use std::sync::Arc;

use turbokv_backend::{GgmlType, WeightBytes};

use reader::Cursor;

/// Errors reading a GGUF file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A version this reader does not know.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    Version(u32),
    /// The file ends inside a structure.
    #[error("GGUF file truncated: needed {needed} bytes at offset {offset}, file has {len}")]
    Truncated {
        /// Where the read started.
        offset: usize,
        /// How many bytes it needed.
        needed: usize,
        /// File length.
        len: usize,
    },
    /// A structurally invalid field.
    #[error("corrupt GGUF at offset {offset}: {what}")]
    Corrupt {
        /// Where.
        offset: usize,
        /// What was wrong.
        what: String,
    },
    /// A tensor's type cannot be computed with.
    #[error("tensor {tensor}: {source}")]
    TensorType {
        /// The tensor name.
        tensor: String,
        /// Why.
        source: turbokv_backend::Error,
    },
    /// A metadata key the model needs is absent or of the wrong type.
    #[error("GGUF metadata key {key}: {problem}")]
    Key {
        /// The key.
        key: String,
        /// Missing, or the type found.
        problem: String,
    },
}

/// One tensor's entry in the index.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// GGML dims, fastest-varying first (`[cols, rows]` for a matrix).
    pub dims: Vec<usize>,
    /// Element format.
    pub ty: GgmlType,
    /// Offset of the data from the start of the file.
    pub offset: usize,
    /// Data length in bytes.
    pub len: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An open GGUF file: parsed header and metadata, tensor index, and the mapping.
pub struct GgufFile {
    /// Format version (2 or 3).
    pub version: u32,
    /// All metadata key/values.
    pub metadata: Metadata,
    tensors: Vec<TensorInfo>,
    /// MXFP4 tensors (gpt-oss's experts): no backend multiplies them, the loader
    /// dequantizes them ([`mxfp4`]).
    mxfp4: Vec<Mxfp4Info>,
    map: Arc<memmap2::Mmap>,
}

/// An MXFP4 tensor's entry in the index (ggml type 39).
#[derive(Clone, Debug)]
pub struct Mxfp4Info {
    /// Tensor name, e.g. `blk.0.ffn_gate_exps.weight`.
    pub name: String,
    /// GGML dims, fastest-varying first.
    pub dims: Vec<usize>,
    /// Offset of the data from the start of the file.
    pub offset: usize,
    /// Data length in bytes.
    pub len: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this process; a model file being
        // truncated by another process while mapped is outside what a reader can defend against
        // (the same contract as llama.cpp's mmap loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Arc::new(map))
    }

    /// Parses an already-mapped file.
    pub fn parse(map: Arc<memmap2::Mmap>) -> Result<Self, GgufError> {
        let mut cur = Cursor::new(&map);
        let magic: [u8; 4] = cur.bytes(4)?.try_into().expect("4 bytes");
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = cur.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let tensor_count = cur.count("tensor count", 8)?;
        let kv_count = cur.count("metadata count", 9)?;
        let mut metadata = Metadata::default();
        for _ in 0..kv_count {
            let key = cur.string()?;
            let value = value::read_value(&mut cur, 0)?;
            metadata.insert(key, value);
        }
        let mut infos = Vec::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            infos.push(read_tensor_header(&mut cur)?);
        }
        let alignment =
            match metadata.get("general.alignment") {
                Some(v) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                    GgufError::Corrupt {
                        offset: cur.pos(),
                        what: format!("general.alignment {v:?} is not a power of two"),
                    }
                })? as usize,
                None => 32,
            };
        let data_start = cur.pos().div_ceil(alignment) * alignment;
        let (mut tensors, mut mxfp4) = (Vec::new(), Vec::new());
        for h in infos {
            if h.ty_id == mxfp4::GGML_TYPE_MXFP4 {
                mxfp4.push(h.locate_mxfp4(data_start, map.len())?);
            } else {
                tensors.push(h.locate(data_start, map.len())?);
            }
        }
        Ok(Self {
            version,
            metadata,
            tensors,
            mxfp4,
            map,
        })
    }

    /// The tensor index, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The file's mapping (shared by every tensor window).
    pub fn mapping(&self) -> Arc<memmap2::Mmap> {
        Arc::clone(&self.map)
    }

    /// The MXFP4 tensors, in file order.
    pub fn mxfp4_tensors(&self) -> &[Mxfp4Info] {
        &self.mxfp4
    }

    /// Looks an MXFP4 tensor up by name.
    pub fn mxfp4_tensor(&self, name: &str) -> Option<&Mxfp4Info> {
        self.mxfp4.iter().find(|t| t.name == name)
    }

    /// The bytes of an MXFP4 tensor.
    pub fn mxfp4_bytes(&self, info: &Mxfp4Info) -> &[u8] {
        &self.map[info.offset..info.offset + info.len]
    }

    /// The bytes of a tensor, as a window of the mapping (no copy).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> WeightBytes {
        WeightBytes::Mapped {
            map: Arc::clone(&self.map),
            offset: info.offset,
            len: info.len,
        }
    }
}

/// A tensor header before the data section's start is known.
struct TensorHeader {
    name: String,
    dims: Vec<usize>,
    ty_id: u32,
    rel_offset: u64,
    header_at: usize,
}

fn read_tensor_header(cur: &mut Cursor<'_>) -> Result<TensorHeader, GgufError> {
    let header_at = cur.pos();
    let name = cur.string()?;
    let n_dims = cur.u32()? as usize;
    if !(1..=4).contains(&n_dims) {
        return Err(GgufError::Corrupt {
            offset: header_at,
            what: format!("tensor {name} has {n_dims} dims"),
        });
    }
    let mut dims = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        let d = cur.u64()?;
        dims.push(usize::try_from(d).map_err(|_| GgufError::Corrupt {
            offset: header_at,
            what: format!("tensor {name} dim {d} too large"),
        })?);
    }
    let ty_id = cur.u32()?;
    let rel_offset = cur.u64()?;
    Ok(TensorHeader {
        name,
        dims,
        ty_id,
        rel_offset,
        header_at,
    })
}

impl TensorHeader {
    fn locate_mxfp4(self, data_start: usize, file_len: usize) -> Result<Mxfp4Info, GgufError> {
        let corrupt = |what: String| GgufError::Corrupt {
            offset: self.header_at,
            what,
        };
        let elements = self
            .dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                corrupt(format!(
                    "tensor {} shape {:?} overflows",
                    self.name, self.dims
                ))
            })?;
        if !self.dims[0].is_multiple_of(mxfp4::BLOCK) {
            return Err(corrupt(format!(
                "MXFP4 tensor {} row of {} elements is not a whole number of {}-element blocks",
                self.name,
                self.dims[0],
                mxfp4::BLOCK
            )));
        }
        let len = (elements / mxfp4::BLOCK)
            .checked_mul(mxfp4::BLOCK_BYTES)
            .ok_or_else(|| corrupt(format!("tensor {} size overflows", self.name)))?;
        let offset = usize::try_from(self.rel_offset)
            .ok()
            .and_then(|o| o.checked_add(data_start))
            .ok_or_else(|| corrupt(format!("tensor {} offset overflows", self.name)))?;
        if offset.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(GgufError::Truncated {
                offset,
                needed: len,
                len: file_len,
            });
        }
        Ok(Mxfp4Info {
            name: self.name,
            dims: self.dims,
            offset,
            len,
        })
    }

    fn locate(self, data_start: usize, file_len: usize) -> Result<TensorInfo, GgufError> {
        let corrupt = |what: String| GgufError::Corrupt {
            offset: self.header_at,
            what,
        };
        let ty = GgmlType::from_ggml_id(self.ty_id).map_err(|source| GgufError::TensorType {
            tensor: self.name.clone(),
            source,
        })?;
        let elements = self
            .dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                corrupt(format!(
                    "tensor {} shape {:?} overflows",
                    self.name, self.dims
                ))
            })?;
        if !elements.is_multiple_of(ty.block_len()) || !self.dims[0].is_multiple_of(ty.block_len())
        {
            return Err(corrupt(format!(
                "tensor {} row of {} elements is not a whole number of {:?} blocks",
                self.name, self.dims[0], ty
            )));
        }
        let len = (elements / ty.block_len())
            .checked_mul(ty.block_bytes())
            .ok_or_else(|| corrupt(format!("tensor {} size overflows", self.name)))?;
        let offset = usize::try_from(self.rel_offset)
            .ok()
            .and_then(|o| o.checked_add(data_start))
            .ok_or_else(|| corrupt(format!("tensor {} offset overflows", self.name)))?;
        match offset.checked_add(len) {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(GgufError::Truncated {
                    offset,
                    needed: len,
                    len: file_len,
                });
            }
        }
        Ok(TensorInfo {
            name: self.name,
            dims: self.dims,
            ty,
            offset,
            len,
        })
    }
}

pub mod mxfp4;
#[cfg(test)]
mod tests;
