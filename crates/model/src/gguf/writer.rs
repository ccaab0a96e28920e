//! A minimal GGUF v3 writer, for building test models and fixtures.

use super::MetaValue;

/// Accumulates metadata and tensors, then serialises a GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<usize>, u32, Vec<u8>)>,
}

const ALIGNMENT: usize = 32;

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry (strings, arrays of strings or numbers, integers, floats, bools).
    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor: GGML dims (fastest first), `ggml_type` number, raw bytes.
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[usize],
        ggml_type: u32,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ggml_type, data));
        self
    }

    /// The serialised file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            put_value(&mut out, v, true);
        }
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + data.len()).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        }
        out
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
        MetaValue::Bool(_) => 7,
        MetaValue::Str(_) => 8,
        MetaValue::Array(_) => 9,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue, with_type: bool) {
    if with_type {
        out.extend_from_slice(&type_id(v).to_le_bytes());
    }
    match v {
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(b) => out.push(u8::from(*b)),
        MetaValue::Str(s) => put_str(out, s),
        MetaValue::Array(items) => {
            let item_ty = items.first().map_or(10, type_id);
            out.extend_from_slice(&item_ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it, false);
            }
        }
    }
}
