//! The working basis of attention on codes: whole blocks decoded to f32 *without* undoing the
//! rotation, so an attention kernel can score and accumulate them with the same dense inner
//! loops it uses for 16-bit caches.
//!
//! For a TurboQuant format the working vector of a token is, part after part,
//! `[s·c[idx] (MSE coordinates)] [γ·κ·(±1) (QJL signs, prod keys only)]`, and a query's is
//! `[R·q_part] [S·R·q_part]`; their dot product is exactly the score of
//! [`crate::score`] (`s·Σ q'_i c[idx_i] + γκ·Σ (Sq')_i·sign_i`). Values are summed in this basis
//! and brought back once per output row by [`VectorCodec::work_to_output`] (Rᵀ, plus Sᵀ for
//! sign coordinates). A full-precision vector enters the basis through
//! [`VectorCodec::exact_to_work`] (rotated, sign coordinates zero), so exact and coded tokens
//! mix in one softmax. Plain formats (`int8`, 16-bit) use the original basis.
//!
//! Decoding a tile costs one table lookup per coordinate (an AVX2 `vpermps` per 8), and the
//! query heads of a kv head share it: this is what lets a 3-bit cache beat a 16-bit one when
//! both are limited by memory reads.

use std::ops::Range;

use half::f16;

use crate::codec::{Format, MAX_SCALARS, VectorCodec, read_scalars};
use crate::error::{Error, Result};
use crate::kernels;
use crate::layout::BlockLayout;
use crate::plain::Plain;
use crate::tq::with_scratch;

/// One run of a token's working coordinates that decodes directly from a run of codes with one
/// per-token scale — the shape attention kernels can read straight from the cache without a
/// tile ([`VectorCodec::direct_codes`]). Working coordinate `work_offset + i` (`i < dim`) of
/// the token is `mul · s · value(code_i)`, where `s` is f16 scalar `scalar_index` of the token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DirectCodes {
    /// What one code is.
    pub kind: DirectKind,
    /// Byte offset of the codes within the token's code record.
    pub code_offset: usize,
    /// Index of the scale among the token's f16 scalars.
    pub scalar_index: usize,
    /// First working coordinate of the run.
    pub work_offset: usize,
    /// Coordinates in the run.
    pub dim: usize,
    /// The factor every token shares besides its scale: QJL's estimator constant κ for sign
    /// runs, 1 otherwise.
    pub mul: f32,
}

/// The code format of [`DirectCodes`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DirectKind {
    /// `bits`-bit (1–4) codes packed LSB-first (8 codes in `bits` bytes); `value(c) =
    /// table[c]` (entries past `2^bits` are zero).
    Table {
        /// Code width.
        bits: u8,
        /// The centroids, padded with zeros to 16.
        table: [f32; 16],
    },
    /// One two's-complement byte per coordinate; `value(c) = c`.
    Int8,
    /// One OCP FP8 E4M3 byte per coordinate; `value(c) =` [`crate::fp8::decode`]`(c)`.
    Fp8,
}

impl VectorCodec {
    /// Length of a working vector (head_dim, plus head_dim of sign coordinates in prod mode).
    pub fn work_dim(&self) -> usize {
        match &self.format {
            Format::Plain(_) => self.head_dim,
            Format::Tq(t) => t
                .parts
                .iter()
                .map(|p| {
                    let mse = if p.mse_bits > 0 { p.dim } else { 0 };
                    mse + if p.qjl.is_some() { p.dim } else { 0 }
                })
                .sum(),
        }
    }

    /// The runs of codes whose concatenation is this format's working vector, when every
    /// run decodes directly: `int8`, `fp8` (one run), and TurboQuant whose parts have MSE codes
    /// of 1–4 bits and/or QJL signs (a run each: MSE codes through the codebook, signs as
    /// 1-bit codes valued ±1 with scale γ and factor κ). `None` for 16-bit formats.
    pub fn direct_codes(&self) -> Option<Vec<DirectCodes>> {
        match &self.format {
            Format::Plain(p @ (Plain::Int8 | Plain::Fp8)) => Some(vec![DirectCodes {
                kind: if *p == Plain::Int8 {
                    DirectKind::Int8
                } else {
                    DirectKind::Fp8
                },
                code_offset: 0,
                scalar_index: 0,
                work_offset: 0,
                dim: self.head_dim,
                mul: 1.0,
            }]),
            Format::Plain(_) => None,
            Format::Tq(t) => {
                let (mut runs, mut at) = (Vec::with_capacity(2 * t.parts.len()), 0);
                for part in &t.parts {
                    if part.mse_bits > 0 {
                        let c = part.codebook.centroids();
                        let packed = (1..=4).contains(&part.mse_bits)
                            && c.len() == 1 << part.mse_bits
                            && part.code_bytes * 8 == part.dim * usize::from(part.mse_bits);
                        if !packed {
                            return None;
                        }
                        let mut table = [0f32; 16];
                        table[..c.len()].copy_from_slice(c);
                        runs.push(DirectCodes {
                            kind: DirectKind::Table {
                                bits: part.mse_bits,
                                table,
                            },
                            code_offset: part.code_offset,
                            scalar_index: part.scalar_index,
                            work_offset: at,
                            dim: part.dim,
                            mul: 1.0,
                        });
                        at += part.dim;
                    }
                    if let Some(qjl) = &part.qjl {
                        if part.sign_bytes * 8 != part.dim {
                            return None;
                        }
                        let mut table = [0f32; 16];
                        table[..2].copy_from_slice(&[-1.0, 1.0]);
                        runs.push(DirectCodes {
                            kind: DirectKind::Table { bits: 1, table },
                            code_offset: part.sign_offset,
                            scalar_index: part.scalar_index + 1,
                            work_offset: at,
                            dim: part.dim,
                            mul: qjl.constant,
                        });
                        at += part.dim;
                    }
                }
                Some(runs)
            }
        }
    }

    /// A query (`head_dim`) in the working basis (`work_dim`): rotated, and sketched in
    /// prod mode. `⟨work(q), tile row⟩` is the score of that token.
    pub fn query_to_work(&self, q: &[f32], out: &mut [f32]) -> Result<()> {
        self.check("query", self.head_dim, q.len())?;
        self.check("working vector", self.work_dim(), out.len())?;
        match &self.format {
            Format::Plain(_) => out.copy_from_slice(q),
            Format::Tq(t) => with_scratch(|s| {
                let mut at = 0;
                for part in &t.parts {
                    let m = part.dim;
                    s.ensure(m);
                    let (g, rotated) = (&mut s.a[..m], &mut s.b[..m]);
                    part.gather(q, g);
                    part.rotation.forward(g, rotated)?;
                    if part.mse_bits > 0 {
                        out[at..at + m].copy_from_slice(rotated);
                        at += m;
                    }
                    if let Some(qjl) = &part.qjl {
                        qjl.apply(rotated, &mut out[at..at + m]);
                        at += m;
                    }
                }
                Ok::<(), Error>(())
            })?,
        }
        Ok(())
    }

    /// A full-precision vector (`head_dim`) in the working basis: rotated, sign coordinates
    /// zero, so its dot product with a working query is the exact `⟨q, x⟩` and its weighted
    /// sum comes back through [`VectorCodec::work_to_output`] unchanged. Formats with a part
    /// that has no MSE coordinates (1-bit prod keys) cannot carry an exact vector: error.
    pub fn exact_to_work(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        self.check("vector", self.head_dim, x.len())?;
        self.check("working vector", self.work_dim(), out.len())?;
        match &self.format {
            Format::Plain(_) => out.copy_from_slice(x),
            Format::Tq(t) => with_scratch(|s| {
                let mut at = 0;
                for part in &t.parts {
                    let m = part.dim;
                    if part.mse_bits == 0 {
                        return Err(Error::InvalidConfig {
                            what: "full-precision window",
                            reason: "needs MSE codes in every part (1-bit prod keys have none)",
                        });
                    }
                    s.ensure(m);
                    part.gather(x, &mut s.a[..m]);
                    part.rotation.forward(&s.a[..m], &mut out[at..at + m])?;
                    at += m;
                    if part.qjl.is_some() {
                        out[at..at + m].fill(0.0);
                        at += m;
                    }
                }
                Ok(())
            })?,
        }
        Ok(())
    }

    /// Decodes slots `slots` of a block into `out` (`slots.len() × work_dim`, row-major),
    /// leaving the rotation in place.
    pub fn decode_tile(
        &self,
        block: &[u8],
        layout: &BlockLayout,
        slots: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_layout(layout)?;
        let w = self.work_dim();
        self.check("tile", slots.len() * w, out.len())?;
        if slots.is_empty() {
            return Ok(());
        }
        layout.check(block.len(), slots.end - 1)?;
        let mut buf = [f16::ZERO; MAX_SCALARS];
        for (slot, row) in slots.zip(out.chunks_exact_mut(w)) {
            let codes = &block[layout.codes_range(slot)];
            let sc = read_scalars(&block[layout.scalars_range(slot)], &mut buf);
            match &self.format {
                Format::Plain(p) => p.decode(codes, sc, row),
                Format::Tq(t) => {
                    let mut at = 0;
                    for part in &t.parts {
                        let m = part.dim;
                        if part.mse_bits > 0 {
                            let packed = &codes[part.code_offset..][..part.code_bytes];
                            kernels::decode_codes(
                                packed,
                                part.mse_bits,
                                part.codebook.centroids(),
                                sc[part.scalar_index].to_f32(),
                                &mut row[at..at + m],
                            );
                            at += m;
                        }
                        if let Some(qjl) = &part.qjl {
                            let signs = &codes[part.sign_offset..][..part.sign_bytes];
                            let c = sc[part.scalar_index + 1].to_f32() * qjl.constant;
                            kernels::decode_signs(signs, c, &mut row[at..at + m]);
                            at += m;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Brings a weighted sum of working vectors (`work_dim`) back to the original basis
    /// (`head_dim`): Sᵀ on sign coordinates, Rᵀ, and the part's channels.
    pub fn work_to_output(&self, acc: &[f32], out: &mut [f32]) -> Result<()> {
        self.check("working vector", self.work_dim(), acc.len())?;
        self.check("output", self.head_dim, out.len())?;
        match &self.format {
            Format::Plain(_) => out.copy_from_slice(acc),
            Format::Tq(t) => with_scratch(|s| {
                let mut at = 0;
                for part in &t.parts {
                    let m = part.dim;
                    s.ensure(m);
                    let (v, st, x) = (&mut s.a[..m], &mut s.b[..m], &mut s.c[..m]);
                    if part.mse_bits > 0 {
                        v.copy_from_slice(&acc[at..at + m]);
                        at += m;
                    } else {
                        v.fill(0.0);
                    }
                    if let Some(qjl) = &part.qjl {
                        // The tile's sign coordinates already carry γ·κ.
                        qjl.apply_t(&acc[at..at + m], st);
                        for (vi, sv) in v.iter_mut().zip(st.iter()) {
                            *vi += sv;
                        }
                        at += m;
                    }
                    part.rotation.inverse(v, x)?;
                    part.scatter(x, out);
                }
                Ok::<(), Error>(())
            })?,
        }
        Ok(())
    }
}
