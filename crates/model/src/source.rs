//! Where weights come from: a GGUF file or a Hugging Face safetensors directory, behind one
//! [`TensorSource`] that speaks GGUF tensor names.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use turbokv_backend::{GgmlType, WeightBytes, WeightMatrix};

use crate::ModelError;
use crate::gguf::GgufFile;

/// A named-tensor store. Names are GGUF's (`blk.3.attn_q.weight`); sources with other naming
/// schemes translate.
pub trait TensorSource {
    /// True when the tensor exists.
    fn has(&self, name: &str) -> bool;
    /// A 2-D tensor as a `[rows, cols]` matrix in its stored format.
    fn matrix(&self, name: &str) -> Result<WeightMatrix, ModelError>;
    /// A 3-D tensor `[n, rows, cols]` (outermost first) as its `n` matrices `[rows, cols]`:
    /// stacked experts (gpt-oss). A format no backend multiplies (GGUF's MXFP4) comes back
    /// dequantized to bf16, which holds it exactly.
    fn stacked(&self, name: &str) -> Result<Vec<WeightMatrix>, ModelError> {
        Err(ModelError::MissingTensor(name.to_string()))
    }
    /// A 1-D tensor converted to f32.
    fn vector(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let m = self.matrix(name)?;
        let mut out = vec![0f32; m.rows() * m.cols()];
        for (r, row) in out.chunks_mut(m.cols().max(1)).enumerate() {
            m.row_f32(r, row)?;
        }
        Ok(out)
    }
}

impl TensorSource for GgufFile {
    fn has(&self, name: &str) -> bool {
        self.tensor(name).is_some() || self.mxfp4_tensor(name).is_some()
    }

    fn stacked(&self, name: &str) -> Result<Vec<WeightMatrix>, ModelError> {
        let three = |dims: &[usize]| match dims {
            [c, r, n] => Ok((*c, *r, *n)),
            dims => Err(ModelError::TensorShape {
                name: name.into(),
                detail: format!("expected 3 dims (stacked experts), found {dims:?}"),
            }),
        };
        if let Some(t) = self.mxfp4_tensor(name) {
            let (cols, rows, n) = three(&t.dims)?;
            let bytes = self.mxfp4_bytes(t);
            let per = bytes.len() / n.max(1);
            return bytes
                .chunks_exact(per.max(1))
                .take(n)
                .map(|b| {
                    let bf = crate::gguf::mxfp4::to_bf16_bytes(b);
                    let bytes = WeightBytes::Owned(Arc::new(bf));
                    Ok(WeightMatrix::new(GgmlType::Bf16, rows, cols, bytes)?)
                })
                .collect();
        }
        let t = self
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let (cols, rows, n) = three(&t.dims)?;
        let per = t.len / n.max(1);
        (0..n)
            .map(|e| {
                let bytes = WeightBytes::Mapped {
                    map: self.mapping(),
                    offset: t.offset + e * per,
                    len: per,
                };
                Ok(WeightMatrix::new(t.ty, rows, cols, bytes)?)
            })
            .collect()
    }

    fn matrix(&self, name: &str) -> Result<WeightMatrix, ModelError> {
        let t = self
            .tensor(name)
            .ok_or_else(|| match self.mxfp4_tensor(name) {
                Some(_) => ModelError::TensorShape {
                    name: name.into(),
                    detail: "MXFP4 is read only for stacked experts".into(),
                },
                None => ModelError::MissingTensor(name.to_string()),
            })?;
        // GGML dims are fastest-first: [cols, rows]; a 1-D tensor is one row.
        let (cols, rows) = match t.dims.as_slice() {
            [c] => (*c, 1),
            [c, r] => (*c, *r),
            dims => {
                return Err(ModelError::TensorShape {
                    name: name.into(),
                    detail: format!("expected 1 or 2 dims, found {dims:?}"),
                });
            }
        };
        Ok(WeightMatrix::new(t.ty, rows, cols, self.tensor_bytes(t))?)
    }
}

/// A Hugging Face model directory: `*.safetensors` (single file or sharded) memory-mapped.
pub struct SafetensorsDir {
    /// name (HF naming) → (file index, dtype, shape, byte range in the mapping).
    index: HashMap<String, (usize, GgmlType, Vec<usize>, std::ops::Range<usize>)>,
    maps: Vec<Arc<memmap2::Mmap>>,
    /// Per-layer GGUF tensor names → Hugging Face names of a family whose names differ from
    /// llama's (see [`SafetensorsDir::with_layer_names`]).
    layer_names: HashMap<&'static str, &'static str>,
}

impl SafetensorsDir {
    /// Maps every `*.safetensors` file of `dir`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let io = |path: &Path, e: std::io::Error| ModelError::Io {
            path: path.display().to_string(),
            source: e,
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::MissingFile {
                dir: dir.display().to_string(),
                what: "*.safetensors",
            });
        }
        let mut index = HashMap::new();
        let mut maps = Vec::new();
        for (fi, path) in files.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| io(path, e))?;
            // SAFETY: read-only private mapping of a model file; concurrent truncation by
            // another process is outside what a loader can defend against.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io(path, e))?;
            let (header_len, meta) =
                safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
                    ModelError::Safetensors {
                        path: path.display().to_string(),
                        detail: e.to_string(),
                    }
                })?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let ty = match info.dtype {
                    safetensors::Dtype::F32 => GgmlType::F32,
                    safetensors::Dtype::F16 => GgmlType::F16,
                    safetensors::Dtype::BF16 => GgmlType::Bf16,
                    other => {
                        let hint = if name.ends_with("_blocks") || name.ends_with("_scales") {
                            " (MXFP4 experts in transformers' packed form are not read; \
                             a GGUF conversion keeps them in MXFP4, or dequantize to BF16)"
                        } else {
                            ""
                        };
                        return Err(ModelError::Safetensors {
                            path: path.display().to_string(),
                            detail: format!(
                                "tensor {name} has dtype {other:?}; supported: F32, F16, \
                                 BF16{hint}"
                            ),
                        });
                    }
                };
                let (a, b) = info.data_offsets;
                let range = data_start + a..data_start + b;
                index.insert(name.clone(), (fi, ty, info.shape.clone(), range));
            }
            maps.push(Arc::new(map));
        }
        Ok(Self {
            index,
            maps,
            layer_names: HashMap::new(),
        })
    }

    /// Translates a GGUF tensor name to the Hugging Face one.
    /// Adds or overrides per-layer names: `(gguf tail, hf tail)`, e.g. Gemma's
    /// `("ffn_norm.weight", "pre_feedforward_layernorm.weight")`.
    pub fn with_layer_names(mut self, names: &[(&'static str, &'static str)]) -> Self {
        self.layer_names.extend(names.iter().copied());
        self
    }

    fn resolve(&self, name: &str) -> Option<String> {
        if let Some((layer, tail)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.'))
            && let Some(hf) = self.layer_names.get(tail)
        {
            return Some(format!("model.layers.{layer}.{hf}"));
        }
        Self::hf_name(name)
    }

    fn hf_name(name: &str) -> Option<String> {
        let simple = match name {
            "token_embd.weight" => Some("model.embed_tokens.weight"),
            "output_norm.weight" => Some("model.norm.weight"),
            "token_embd_norm.weight" => Some("model.embedding_norm.weight"),
            "output.weight" => Some("lm_head.weight"),
            _ => None,
        };
        if let Some(s) = simple {
            return Some(s.to_string());
        }
        let rest = name.strip_prefix("blk.")?;
        let (layer, tail) = rest.split_once('.')?;
        let hf_tail = match tail {
            "attn_norm.weight" => "input_layernorm.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            "attn_q.weight" => "self_attn.q_proj.weight",
            "attn_k.weight" => "self_attn.k_proj.weight",
            "attn_v.weight" => "self_attn.v_proj.weight",
            "attn_output.weight" => "self_attn.o_proj.weight",
            "attn_q.bias" => "self_attn.q_proj.bias",
            "attn_output.bias" => "self_attn.o_proj.bias",
            "attn_k.bias" => "self_attn.k_proj.bias",
            "attn_v.bias" => "self_attn.v_proj.bias",
            "attn_q_norm.weight" => "self_attn.q_norm.weight",
            "attn_k_norm.weight" => "self_attn.k_norm.weight",
            "ffn_gate.weight" => "mlp.gate_proj.weight",
            "ffn_up.weight" => "mlp.up_proj.weight",
            "ffn_down.weight" => "mlp.down_proj.weight",
            _ => return None,
        };
        Some(format!("model.layers.{layer}.{hf_tail}"))
    }
}

impl TensorSource for SafetensorsDir {
    fn has(&self, name: &str) -> bool {
        self.resolve(name)
            .is_some_and(|n| self.index.contains_key(&n))
    }

    fn stacked(&self, name: &str) -> Result<Vec<WeightMatrix>, ModelError> {
        let missing = || ModelError::MissingTensor(name.to_string());
        let hf = self.resolve(name).ok_or_else(missing)?;
        let (fi, ty, shape, range) = self.index.get(&hf).ok_or_else(missing)?;
        let [n, rows, cols] = shape.as_slice() else {
            return Err(ModelError::TensorShape {
                name: hf,
                detail: format!("expected 3 dims (stacked experts), found {shape:?}"),
            });
        };
        let per = range.len() / (*n).max(1);
        (0..*n)
            .map(|e| {
                let bytes = WeightBytes::Mapped {
                    map: Arc::clone(&self.maps[*fi]),
                    offset: range.start + e * per,
                    len: per,
                };
                Ok(WeightMatrix::new(*ty, *rows, *cols, bytes)?)
            })
            .collect()
    }

    fn matrix(&self, name: &str) -> Result<WeightMatrix, ModelError> {
        let missing = || ModelError::MissingTensor(name.to_string());
        let hf = self.resolve(name).ok_or_else(missing)?;
        let (fi, ty, shape, range) = self.index.get(&hf).ok_or_else(missing)?;
        // Hugging Face stores Linear weights as [out, in]: already our row-major layout.
        let (rows, cols) = match shape.as_slice() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            // A depthwise Conv1d's `[channels, 1, taps]` (LFM2): one row of taps per channel.
            [r, 1, c] => (*r, *c),
            dims => {
                return Err(ModelError::TensorShape {
                    name: hf,
                    detail: format!("expected 1 or 2 dims, found {dims:?}"),
                });
            }
        };
        let bytes = WeightBytes::Mapped {
            map: Arc::clone(&self.maps[*fi]),
            offset: range.start,
            len: range.len(),
        };
        Ok(WeightMatrix::new(*ty, rows, cols, bytes)?)
    }
}
