//! TurboQuant and the other KV-cache number formats: the pure-Rust reference that every
//! backend matches bit for bit (encode) or to rounding (attention on codes).
//!
//! No I/O, no threads. Entry points:
//! * [`KvDtype`] — `bf16`, `f16`, `int8`, `fp8`, `tq{b}`, `tq{b}.5`, `k{b}v{b}`; parsing, display and
//!   bits-per-element accounting (side information included).
//! * [`VectorCodec`] / [`LayerCodec`] — one layer's keys / values: encode and decode one
//!   vector, into or out of a block slot, and attention on codes ([`VectorCodec::prepare_query`],
//!   [`VectorCodec::score_block`], [`VectorCodec::accumulate_block`], [`VectorCodec::finish`]).
//! * [`block_bytes`] / [`BlockLayout`] — the paged block layout below.
//! * [`TqCodec`] — TurboQuant-MSE / -prod on its own (see [`tq`] for the exact algorithm).
//! * [`Snapshot`] — self-describing, checksummed blobs of blocks.
//!
//! # Block layout
//!
//! One block holds `block_size` tokens of one kv head, keys and values in separate blocks
//! (sizes may differ, e.g. `k4v3`). [`block_bytes`] gives its size:
//!
//! ```text
//! offset 0                                   scalars_offset                      total_bytes
//! ├ token 0 codes ┼ token 1 codes ┼ … ┼ pad ─┼ token 0 scalars ┼ … ┼ pad ─┤
//! ```
//! * **Codes**: the code records of all tokens back to back (slot `t` at
//!   `t · code_bytes_per_token`), zero-padded to a multiple of 16 bytes.
//! * **Scalars**: `scalars_per_token` little-endian f16 per token (slot `t` at
//!   `scalars_offset + 2·t·scalars_per_token`), padded to a multiple of 16 bytes.
//!
//! | dtype | one token's code record | scalars (f16) | bytes/token at d = 128 |
//! |---|---|---|---|
//! | `bf16`, `f16` | d little-endian 16-bit values | – | 256 |
//! | `int8` | d two's-complement bytes | absmax/127 scale | 128 + 2 |
//! | `fp8` | d OCP FP8 E4M3 bytes ([`fp8`]) | absmax/448 scale | 128 + 2 |
//! | `tq{b}` (MSE) | d·b bits of Lloyd–Max codes | norm | 16·b + 2 |
//! | `tq{b}` keys, prod | d·(b−1) bits of codes, then d QJL sign bits | norm, γ | 16·b + 4 |
//! | `tq{b}.5` | outlier part (d/2 channels at ⌈b⌉ bits) then regular part (d/2 at ⌊b⌋ bits), each as above, byte-aligned | per part in the same order | 16·b + 4 (MSE) |
//!
//! Bit fields are packed LSB-first: code `i` of width `w` occupies stream bits
//! `[i·w, (i+1)·w)`, stream bit `k` being bit `k % 8` of byte `k / 8` (so eight 3-bit codes
//! fill three bytes). TurboQuant codes index the centroids of the part's rotated coordinates
//! (coordinate `i` of `R·x_part`); a sign bit is 1 for a non-negative `(S·r)_i`. The outlier
//! part's channels are the sorted list in [`OutlierChannels`], recorded in the cache identity.
//!
//! Bits per element ([`KvDtype::bits_per_element`]) count codes and scalars, not block padding
//! (which is zero for d a multiple of 16 and block sizes a multiple of 8).
//!
//! # Determinism
//! Codes depend only on the input, the dtype, [`CodecOptions`] and [`CODEC_VERSION`]: seeds
//! come from the crate's own PRNG ([`prng`]), codebooks from a fixed Lloyd–Max computation,
//! and the f32 operation order of the encoder is specified (see [`tq`], [`kernels`]). The
//! runtime-selected SIMD encoder produces the scalar reference's bytes exactly.
#![deny(missing_docs)]

pub mod bitpack;
pub mod checksum;
pub mod codebook;
pub mod codec;
pub mod device;
pub mod dtype;
mod error;
pub mod fp8;
pub mod kernels;
pub mod layout;
pub mod lut;
pub mod outliers;
mod plain;
pub mod prng;
pub mod rotation;
pub mod score;
pub mod snapshot;
pub mod tq;
mod work;

pub use codec::{CodecOptions, LayerCodec, VectorCodec};
pub use device::{DeviceFormat, DevicePart, DeviceParts, DeviceQjl, HadamardMse};
pub use dtype::{KeyMode, KvDtype, TqBits};
pub use error::{Error, Result};
/// The f16 type used for scalars in the public API (re-exported so callers need not depend on `half`).
pub use half::f16;
pub use kernels::Isa;
pub use layout::{BlockLayout, KvRole, TokenSizes, block_bytes, token_sizes};
pub use outliers::OutlierChannels;
pub use rotation::Rotation;
pub use score::{PreparedQuery, ValueAccumulator};
pub use snapshot::{LayerIdentity, Snapshot, SnapshotError, SnapshotIdentity, SnapshotShape};
pub use tq::{NormMode, QjlSketch, TqCodec, TqParams};
pub use work::{DirectCodes, DirectKind};

/// Version of the numeric definition of every format (rotations, seeds, codebooks, operation
/// order, layouts). Bump it whenever any encoder output could change; it is part of the cache
/// identity, so caches and snapshots of another version are never reused.
pub const CODEC_VERSION: u32 = 1;
