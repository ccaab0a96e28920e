//! Self-describing, checksummed blobs of cached KV blocks.
//!
//! A snapshot carries everything needed to decide whether its bytes can be used by a cache:
//! the codec identity (codec version, head dim, key mode, norm mode, QJL sketch, base seed,
//! and per layer the dtype and outlier channels), the shapes, the payload and a CRC-32.
//! [`Snapshot::decode`] validates all of it and never panics; any problem is a typed
//! [`SnapshotError`], which a cache should treat as a miss.
//!
//! Wire format (all integers little-endian):
//! ```text
//! magic        8  b"TKVSNAP\0"
//! format       u32  = FORMAT_VERSION
//! codec        u32  codec version (CODEC_VERSION of the writer)
//! head_dim     u32
//! key_mode     u8   0 mse, 1 prod
//! norm         u8   0 exact, 1 corrected
//! qjl          u8   0 structured, 1 gaussian
//! reserved     u8   0
//! base_seed    u64
//! kv_heads     u32
//! block_size   u32
//! num_blocks   u32
//! num_tokens   u32  tokens covered (≤ num_blocks · block_size)
//! n_layers     u32
//! per layer:   layer u32, dtype u8 (0 bf16, 1 f16, 2 int8, 3 tq, 4 fp8), key half-bits u8,
//!              value half-bits u8 (0 unless tq), key outliers, value outliers
//!              (outliers: u16 count, 0xFFFF = none, then count × u16 channel)
//! n_tokens     u32, then n_tokens × u32 token ids (may be 0: ids are optional)
//! payload_len  u64, then the payload
//! crc32        u32  over every preceding byte
//! ```
//! Payload order: for each layer (in header order), each block, each kv head: the key block
//! then the value block, each laid out as in [`crate::layout`] (`block_bytes` long).

use crate::checksum::crc32;
use crate::codec::CodecOptions;
use crate::dtype::{KeyMode, KvDtype, TqBits};
use crate::layout::{KvRole, block_bytes};
use crate::outliers::OutlierChannels;
use crate::tq::{NormMode, QjlSketch};

/// First bytes of every snapshot.
pub const MAGIC: [u8; 8] = *b"TKVSNAP\0";
/// Version of the wire format above.
pub const FORMAT_VERSION: u32 = 1;

/// Why a blob was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The blob ended early.
    #[error("snapshot truncated: needed {needed} bytes at offset {offset}, {available} left")]
    Truncated {
        /// Where reading stopped.
        offset: usize,
        /// Bytes needed there.
        needed: usize,
        /// Bytes that were left.
        available: usize,
    },
    /// Not a snapshot.
    #[error("not a turbokv snapshot (bad magic)")]
    BadMagic,
    /// A wire format this build cannot read.
    #[error("unsupported snapshot format version {found} (this build reads {FORMAT_VERSION})")]
    UnsupportedFormat {
        /// The version in the blob.
        found: u32,
    },
    /// The CRC did not match: the bytes are corrupt.
    #[error("snapshot checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// CRC in the blob.
        stored: u32,
        /// CRC of the bytes.
        computed: u32,
    },
    /// An enum field held an unknown value.
    #[error("snapshot field {field} has unknown value {value}")]
    UnknownValue {
        /// The field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// A field that is individually readable but inconsistent or unsupported.
    #[error("invalid snapshot field {field}: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The payload length does not match the shapes and identity.
    #[error("snapshot payload is {found} bytes, shapes and identity require {expected}")]
    PayloadSize {
        /// Bytes required.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// Bytes after the checksummed region.
    #[error("{count} unexpected bytes after the snapshot")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// A valid snapshot of a different cache.
    #[error("snapshot identity differs from the cache's in {field}")]
    IdentityMismatch {
        /// First differing field.
        field: &'static str,
    },
}

/// One layer's part of the identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LayerIdentity {
    /// Layer index in the model.
    pub layer: u32,
    /// Storage format.
    pub dtype: KvDtype,
    /// Key outlier channels (fractional key widths).
    pub key_outliers: Option<OutlierChannels>,
    /// Value outlier channels (fractional value widths).
    pub value_outliers: Option<OutlierChannels>,
}

/// Everything that decides what the payload bytes mean.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SnapshotIdentity {
    /// [`crate::CODEC_VERSION`] of the writer.
    pub codec_version: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Key mode.
    pub key_mode: KeyMode,
    /// Norm mode.
    pub norm: NormMode,
    /// QJL sketch.
    pub qjl: QjlSketch,
    /// Base rotation seed.
    pub base_seed: u64,
    /// The layers in the payload, in payload order.
    pub layers: Vec<LayerIdentity>,
}

impl SnapshotIdentity {
    /// The codec options of layer entry `i` (for building its [`crate::LayerCodec`]).
    pub fn options(&self, i: usize) -> Option<CodecOptions> {
        let l = self.layers.get(i)?;
        Some(CodecOptions {
            key_mode: self.key_mode,
            norm: self.norm,
            qjl: self.qjl,
            base_seed: self.base_seed,
            key_outliers: l.key_outliers.clone(),
            value_outliers: l.value_outliers.clone(),
        })
    }

    /// The first field that differs from `other`, if any.
    pub fn first_difference(&self, other: &SnapshotIdentity) -> Option<&'static str> {
        if self.codec_version != other.codec_version {
            return Some("codec_version");
        }
        if self.head_dim != other.head_dim {
            return Some("head_dim");
        }
        if self.key_mode != other.key_mode {
            return Some("key_mode");
        }
        if self.norm != other.norm {
            return Some("norm");
        }
        if self.qjl != other.qjl {
            return Some("qjl");
        }
        if self.base_seed != other.base_seed {
            return Some("base_seed");
        }
        if self.layers.len() != other.layers.len() {
            return Some("layers");
        }
        for (a, b) in self.layers.iter().zip(&other.layers) {
            if a.layer != b.layer {
                return Some("layer index");
            }
            if a.dtype != b.dtype {
                return Some("dtype");
            }
            if a.key_outliers != b.key_outliers {
                return Some("key_outliers");
            }
            if a.value_outliers != b.value_outliers {
                return Some("value_outliers");
            }
        }
        None
    }
}

/// Shapes of the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SnapshotShape {
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks per layer.
    pub num_blocks: u32,
    /// Tokens covered (≤ num_blocks · block_size).
    pub num_tokens: u32,
}

/// A decoded snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// What the bytes mean.
    pub identity: SnapshotIdentity,
    /// Shapes.
    pub shape: SnapshotShape,
    /// Token ids covered (optional; empty or `num_tokens` long).
    pub tokens: Vec<u32>,
    /// The blocks, in payload order.
    pub payload: Vec<u8>,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> SnapshotError {
    SnapshotError::InvalidField {
        field,
        reason: reason.into(),
    }
}

/// Bytes of (key block + value block) for one (layer, block, head).
fn pair_bytes(
    id: &SnapshotIdentity,
    l: &LayerIdentity,
    block_size: u32,
) -> Result<u64, SnapshotError> {
    let mut total = 0u64;
    for role in [KvRole::Key, KvRole::Value] {
        let n = block_bytes(
            l.dtype,
            role,
            id.head_dim as usize,
            block_size as usize,
            id.key_mode,
        )
        .map_err(|e| invalid("layer dtype", e.to_string()))?;
        total += n as u64;
    }
    Ok(total)
}

/// Validates identity and shapes and returns the required payload length.
fn expected_payload(
    id: &SnapshotIdentity,
    shape: &SnapshotShape,
    n_tokens: usize,
) -> Result<u64, SnapshotError> {
    if id.head_dim == 0 {
        return Err(invalid("head_dim", "zero"));
    }
    if shape.block_size == 0 {
        return Err(invalid("block_size", "zero"));
    }
    if u64::from(shape.num_tokens) > u64::from(shape.num_blocks) * u64::from(shape.block_size) {
        return Err(invalid("num_tokens", "more tokens than the blocks hold"));
    }
    if n_tokens != 0 && n_tokens != shape.num_tokens as usize {
        return Err(invalid(
            "tokens",
            "token id list must be empty or num_tokens long",
        ));
    }
    let mut total = 0u64;
    for (i, l) in id.layers.iter().enumerate() {
        if i > 0 && id.layers[i - 1].layer >= l.layer {
            return Err(invalid(
                "layers",
                "layer indices must be strictly increasing",
            ));
        }
        for (o, field) in [
            (&l.key_outliers, "key_outliers"),
            (&l.value_outliers, "value_outliers"),
        ] {
            if let Some(o) = o
                && o.head_dim() != id.head_dim as usize
            {
                return Err(invalid(field, "head_dim differs"));
            }
        }
        let per = pair_bytes(id, l, shape.block_size)?;
        let n = per
            .checked_mul(u64::from(shape.num_blocks))
            .and_then(|v| v.checked_mul(u64::from(shape.kv_heads)))
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| invalid("shape", "payload size overflows"))?;
        total = n;
    }
    Ok(total)
}

impl Snapshot {
    /// Byte offset and length of one (layer entry, block, head, role) block in the payload.
    pub fn block_range(
        &self,
        layer_entry: usize,
        block: u32,
        head: u32,
        role: KvRole,
    ) -> Result<std::ops::Range<usize>, SnapshotError> {
        let id = &self.identity;
        let sh = &self.shape;
        if layer_entry >= id.layers.len() || block >= sh.num_blocks || head >= sh.kv_heads {
            return Err(invalid("block_range", "index out of range"));
        }
        let mut offset = 0u64;
        for l in &id.layers[..layer_entry] {
            offset += pair_bytes(id, l, sh.block_size)?
                * u64::from(sh.num_blocks)
                * u64::from(sh.kv_heads);
        }
        let l = &id.layers[layer_entry];
        let key = block_bytes(
            l.dtype,
            KvRole::Key,
            id.head_dim as usize,
            sh.block_size as usize,
            id.key_mode,
        )
        .map_err(|e| invalid("layer dtype", e.to_string()))? as u64;
        let pair = pair_bytes(id, l, sh.block_size)?;
        offset += (u64::from(block) * u64::from(sh.kv_heads) + u64::from(head)) * pair;
        let (start, len) = match role {
            KvRole::Key => (offset, key),
            KvRole::Value => (offset + key, pair - key),
        };
        let start = usize::try_from(start).map_err(|_| invalid("block_range", "too large"))?;
        let len = usize::try_from(len).map_err(|_| invalid("block_range", "too large"))?;
        Ok(start..start + len)
    }

    /// Serialises (validating identity, shapes and payload length first).
    pub fn encode(&self) -> Result<Vec<u8>, SnapshotError> {
        let expected = expected_payload(&self.identity, &self.shape, self.tokens.len())?;
        if expected != self.payload.len() as u64 {
            return Err(SnapshotError::PayloadSize {
                expected,
                found: self.payload.len() as u64,
            });
        }
        let id = &self.identity;
        let mut w = Vec::with_capacity(self.payload.len() + 256 + 4 * self.tokens.len());
        w.extend_from_slice(&MAGIC);
        for v in [FORMAT_VERSION, id.codec_version, id.head_dim] {
            w.extend_from_slice(&v.to_le_bytes());
        }
        w.push(match id.key_mode {
            KeyMode::Mse => 0,
            KeyMode::Prod => 1,
        });
        w.push(id.norm.code());
        w.push(id.qjl.code());
        w.push(0);
        w.extend_from_slice(&id.base_seed.to_le_bytes());
        let sh = &self.shape;
        let n_layers = u32::try_from(id.layers.len()).map_err(|_| invalid("layers", "too many"))?;
        for v in [
            sh.kv_heads,
            sh.block_size,
            sh.num_blocks,
            sh.num_tokens,
            n_layers,
        ] {
            w.extend_from_slice(&v.to_le_bytes());
        }
        for l in &id.layers {
            w.extend_from_slice(&l.layer.to_le_bytes());
            let (tag, kb, vb) = match l.dtype {
                KvDtype::Bf16 => (0u8, 0u8, 0u8),
                KvDtype::F16 => (1, 0, 0),
                KvDtype::Int8 => (2, 0, 0),
                KvDtype::Fp8 => (4, 0, 0),
                KvDtype::Tq {
                    key_bits,
                    value_bits,
                } => (3, key_bits.half_bits(), value_bits.half_bits()),
            };
            w.extend_from_slice(&[tag, kb, vb]);
            for o in [&l.key_outliers, &l.value_outliers] {
                match o {
                    None => w.extend_from_slice(&u16::MAX.to_le_bytes()),
                    Some(o) => {
                        let n = u16::try_from(o.channels().len())
                            .ok()
                            .filter(|&n| n != u16::MAX)
                            .ok_or_else(|| invalid("outliers", "too many channels"))?;
                        w.extend_from_slice(&n.to_le_bytes());
                        for &c in o.channels() {
                            w.extend_from_slice(&c.to_le_bytes());
                        }
                    }
                }
            }
        }
        let n_tok = u32::try_from(self.tokens.len()).map_err(|_| invalid("tokens", "too many"))?;
        w.extend_from_slice(&n_tok.to_le_bytes());
        for t in &self.tokens {
            w.extend_from_slice(&t.to_le_bytes());
        }
        w.extend_from_slice(&(self.payload.len() as u64).to_le_bytes());
        w.extend_from_slice(&self.payload);
        let crc = crc32(&w);
        w.extend_from_slice(&crc.to_le_bytes());
        Ok(w)
    }

    /// Parses and validates a blob. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(8)? != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let format = r.u32()?;
        if format != FORMAT_VERSION {
            return Err(SnapshotError::UnsupportedFormat { found: format });
        }
        // Check the CRC before trusting any length field.
        let body_len = bytes.len().checked_sub(4).ok_or(SnapshotError::Truncated {
            offset: 0,
            needed: 4,
            available: bytes.len(),
        })?;
        let stored = u32::from_le_bytes([
            bytes[body_len],
            bytes[body_len + 1],
            bytes[body_len + 2],
            bytes[body_len + 3],
        ]);
        let computed = crc32(&bytes[..body_len]);
        if stored != computed {
            return Err(SnapshotError::ChecksumMismatch { stored, computed });
        }
        let mut r = Reader {
            bytes: &bytes[..body_len],
            pos: r.pos,
        };
        let snap = r.snapshot()?;
        if r.pos != body_len {
            return Err(SnapshotError::TrailingBytes {
                count: body_len - r.pos,
            });
        }
        Ok(snap)
    }

    /// [`Snapshot::decode`], then requires the identity to equal `expected`.
    pub fn decode_expecting(
        bytes: &[u8],
        expected: &SnapshotIdentity,
    ) -> Result<Snapshot, SnapshotError> {
        let snap = Self::decode(bytes)?;
        match snap.identity.first_difference(expected) {
            Some(field) => Err(SnapshotError::IdentityMismatch { field }),
            None => Ok(snap),
        }
    }
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        let available = self.bytes.len() - self.pos;
        if n > available {
            return Err(SnapshotError::Truncated {
                offset: self.pos,
                needed: n,
                available,
            });
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, SnapshotError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn outliers(&mut self, head_dim: u32) -> Result<Option<OutlierChannels>, SnapshotError> {
        let n = self.u16()?;
        if n == u16::MAX {
            return Ok(None);
        }
        let raw = self.take(2 * usize::from(n))?;
        let ch: Vec<u16> = raw
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        OutlierChannels::new(head_dim as usize, &ch)
            .map(Some)
            .map_err(|e| invalid("outliers", e.to_string()))
    }

    fn tq_bits(&mut self, field: &'static str) -> Result<TqBits, SnapshotError> {
        let v = self.u8()?;
        TqBits::from_half_bits(v).map_err(|_| SnapshotError::UnknownValue {
            field,
            value: u64::from(v),
        })
    }

    fn layer(&mut self, head_dim: u32) -> Result<LayerIdentity, SnapshotError> {
        let layer = self.u32()?;
        let tag = self.u8()?;
        let dtype = match tag {
            0..=2 | 4 => {
                let (kb, vb) = (self.u8()?, self.u8()?);
                if kb != 0 || vb != 0 {
                    return Err(invalid("dtype", "bit widths given for a plain dtype"));
                }
                match tag {
                    0 => KvDtype::Bf16,
                    1 => KvDtype::F16,
                    2 => KvDtype::Int8,
                    _ => KvDtype::Fp8,
                }
            }
            3 => KvDtype::Tq {
                key_bits: self.tq_bits("key bits")?,
                value_bits: self.tq_bits("value bits")?,
            },
            _ => {
                return Err(SnapshotError::UnknownValue {
                    field: "dtype",
                    value: u64::from(tag),
                });
            }
        };
        Ok(LayerIdentity {
            layer,
            dtype,
            key_outliers: self.outliers(head_dim)?,
            value_outliers: self.outliers(head_dim)?,
        })
    }

    fn snapshot(&mut self) -> Result<Snapshot, SnapshotError> {
        let codec_version = self.u32()?;
        let head_dim = self.u32()?;
        let unknown = |field, v: u8| SnapshotError::UnknownValue {
            field,
            value: u64::from(v),
        };
        let km = self.u8()?;
        let key_mode = match km {
            0 => KeyMode::Mse,
            1 => KeyMode::Prod,
            v => return Err(unknown("key_mode", v)),
        };
        let nm = self.u8()?;
        let norm = NormMode::from_code(nm).ok_or_else(|| unknown("norm", nm))?;
        let qm = self.u8()?;
        let qjl = QjlSketch::from_code(qm).ok_or_else(|| unknown("qjl", qm))?;
        let reserved = self.u8()?;
        if reserved != 0 {
            return Err(unknown("reserved", reserved));
        }
        let base_seed = self.u64()?;
        let shape = SnapshotShape {
            kv_heads: self.u32()?,
            block_size: self.u32()?,
            num_blocks: self.u32()?,
            num_tokens: self.u32()?,
        };
        let n_layers = self.u32()? as usize;
        // Each layer entry is at least 11 bytes: bound the allocation by the input.
        if n_layers > (self.bytes.len() - self.pos) / 11 {
            return Err(invalid("layers", "count exceeds the blob"));
        }
        let mut layers = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            layers.push(self.layer(head_dim)?);
        }
        let n_tok = self.u32()? as usize;
        let raw = self.take(
            n_tok
                .checked_mul(4)
                .ok_or_else(|| invalid("tokens", "too many"))?,
        )?;
        let tokens = raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let identity = SnapshotIdentity {
            codec_version,
            head_dim,
            key_mode,
            norm,
            qjl,
            base_seed,
            layers,
        };
        let expected = expected_payload(&identity, &shape, n_tok)?;
        let found = self.u64()?;
        if found != expected {
            return Err(SnapshotError::PayloadSize { expected, found });
        }
        let len = usize::try_from(found).map_err(|_| invalid("payload", "too large"))?;
        let payload = self.take(len)?.to_vec();
        Ok(Snapshot {
            identity,
            shape,
            tokens,
            payload,
        })
    }
}
