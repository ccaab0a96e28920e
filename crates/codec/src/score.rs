//! Attention on codes: the CPU reference that attention kernels must match to rounding.
//!
//! Scores: the query is rotated once per part (`q' = R·q_part`, and `S·q'` in prod mode);
//! each token then costs `s·Σ_i q'_i·c[idx_i]` (+ `γ·κ·Σ_i (S·q')_i·±1`), read straight from
//! the packed codes, never dequantizing a vector. Values: `acc += p·s·c[idx]` (and
//! `p·γ·sign` in prod mode) in the rotated basis; [`VectorCodec::finish`] applies Sᵀ and Rᵀ once.

use half::f16;

use crate::codec::{Format, MAX_SCALARS, VectorCodec, read_scalars};
use crate::error::{Error, Result};
use crate::kernels;
use crate::layout::BlockLayout;
use crate::lut::CodeLut;
use crate::tq::Part;

/// A query prepared for scoring against one codec's codes.
#[derive(Debug, Clone)]
pub struct PreparedQuery {
    head_dim: usize,
    kind: QueryKind,
}

#[derive(Debug, Clone)]
enum QueryKind {
    Plain(Vec<f32>),
    Tq(Vec<PartQuery>),
}

/// One part's rotated query.
#[derive(Debug, Clone)]
pub(crate) struct PartQuery {
    /// `R·q_part`.
    pub(crate) rotated: Vec<f32>,
    /// `S·R·q_part` (prod mode).
    pub(crate) sketched: Option<Vec<f32>>,
    /// Lookup tables for the MSE codes, when prepared with [`VectorCodec::prepare_query_lut`].
    pub(crate) lut: Option<CodeLut>,
}

impl PreparedQuery {
    /// The rotated query of part `p` (TurboQuant formats), for kernels that need it.
    pub fn rotated_part(&self, p: usize) -> Option<&[f32]> {
        match &self.kind {
            QueryKind::Tq(parts) => parts.get(p).map(|q| q.rotated.as_slice()),
            QueryKind::Plain(_) => None,
        }
    }
}

/// Softmax-weighted sum of values, kept in each part's rotated basis until [`VectorCodec::finish`].
#[derive(Debug, Clone)]
pub struct ValueAccumulator {
    head_dim: usize,
    /// Plain formats: one buffer in the original basis. TurboQuant: per part, the centroid sum
    /// and (prod) the sign sum.
    parts: Vec<(Vec<f32>, Option<Vec<f32>>)>,
}

impl ValueAccumulator {
    /// Resets to zero (to reuse the buffers for the next head).
    pub fn clear(&mut self) {
        for (a, s) in &mut self.parts {
            a.fill(0.0);
            if let Some(s) = s {
                s.fill(0.0);
            }
        }
    }
}

/// `Σ_i q[i]·centroids[code_i]`, reading 8 codes per `bits` bytes. Sequential sum in i.
/// Returns NaN when `bits` is not 1..=8 or there are fewer than 2^bits centroids.
pub fn dot_codes_ref(q: &[f32], packed: &[u8], bits: u8, centroids: &[f32]) -> f32 {
    if !(1..=8).contains(&bits) || centroids.len() < 1 << bits {
        return f32::NAN;
    }
    let mask = (1u64 << bits) - 1;
    let mut acc = 0.0f32;
    for (chunk, qs) in packed.chunks(usize::from(bits)).zip(q.chunks(8)) {
        let w = kernels::load_le(chunk);
        for (j, &qi) in qs.iter().enumerate() {
            let code = ((w >> (j * usize::from(bits))) & mask) as usize;
            acc += qi * centroids[code];
        }
    }
    acc
}

/// `Σ_i v[i]·(bit_i ? 1 : −1)` over packed sign bits.
pub fn dot_signs_ref(v: &[f32], signs: &[u8]) -> f32 {
    let mut acc = 0.0f32;
    for (&byte, vs) in signs.iter().zip(v.chunks(8)) {
        for (j, &vi) in vs.iter().enumerate() {
            acc += if (byte >> j) & 1 == 1 { vi } else { -vi };
        }
    }
    acc
}

fn part_score(part: &Part, q: &PartQuery, codes: &[u8], scalars: &[f16]) -> f32 {
    let mut score = 0.0;
    if part.mse_bits > 0 {
        let packed = &codes[part.code_offset..part.code_offset + part.code_bytes];
        let dot = match &q.lut {
            Some(lut) => lut.dot(packed),
            None => {
                kernels::dot_codes(&q.rotated, packed, part.mse_bits, part.codebook.centroids())
            }
        };
        score = scalars[part.scalar_index].to_f32() * dot;
    }
    if let (Some(qjl), Some(sk)) = (&part.qjl, &q.sketched) {
        let signs = &codes[part.sign_offset..part.sign_offset + part.sign_bytes];
        let gamma = scalars[part.scalar_index + 1].to_f32();
        score += gamma * qjl.constant * kernels::dot_signs(sk, signs);
    }
    score
}

fn part_accumulate(
    part: &Part,
    acc: &mut (Vec<f32>, Option<Vec<f32>>),
    w: f32,
    codes: &[u8],
    scalars: &[f16],
) {
    if part.mse_bits > 0 {
        let packed = &codes[part.code_offset..part.code_offset + part.code_bytes];
        let ws = w * scalars[part.scalar_index].to_f32();
        let cents = part.codebook.centroids();
        let mask = (1u64 << part.mse_bits) - 1;
        let b = usize::from(part.mse_bits);
        for (chunk, a8) in packed.chunks(b).zip(acc.0.chunks_mut(8)) {
            let word = kernels::load_le(chunk);
            for (j, a) in a8.iter_mut().enumerate() {
                *a += ws * cents[((word >> (j * b)) & mask) as usize];
            }
        }
    }
    if let Some(sacc) = &mut acc.1 {
        let signs = &codes[part.sign_offset..part.sign_offset + part.sign_bytes];
        let wg = w * scalars[part.scalar_index + 1].to_f32();
        for (&byte, a8) in signs.iter().zip(sacc.chunks_mut(8)) {
            for (j, a) in a8.iter_mut().enumerate() {
                *a += if (byte >> j) & 1 == 1 { wg } else { -wg };
            }
        }
    }
}

impl VectorCodec {
    /// Rotates (and sketches) the query once for scoring many tokens.
    pub fn prepare_query(&self, q: &[f32]) -> Result<PreparedQuery> {
        self.prepare(q, false)
    }

    /// [`VectorCodec::prepare_query`] plus per-query lookup tables for the MSE codes (see
    /// [`crate::lut`]); scores agree with the direct kernel to rounding.
    pub fn prepare_query_lut(&self, q: &[f32]) -> Result<PreparedQuery> {
        self.prepare(q, true)
    }

    fn prepare(&self, q: &[f32], with_lut: bool) -> Result<PreparedQuery> {
        if q.len() != self.head_dim {
            return Err(Error::LengthMismatch {
                what: "query",
                expected: self.head_dim,
                got: q.len(),
            });
        }
        let kind = match &self.format {
            Format::Plain(_) => QueryKind::Plain(q.to_vec()),
            Format::Tq(t) => QueryKind::Tq(
                t.parts
                    .iter()
                    .map(|part| {
                        let mut g = vec![0.0; part.dim];
                        part.gather(q, &mut g);
                        let mut rotated = vec![0.0; part.dim];
                        // Lengths match by construction.
                        let _ = part.rotation.forward(&g, &mut rotated);
                        let sketched = part.qjl.as_ref().map(|qjl| {
                            let mut s = vec![0.0; part.dim];
                            qjl.apply(&rotated, &mut s);
                            s
                        });
                        let lut = if with_lut && part.mse_bits > 0 {
                            CodeLut::new(&rotated, part.mse_bits, part.codebook.centroids())
                        } else {
                            None
                        };
                        PartQuery {
                            rotated,
                            sketched,
                            lut,
                        }
                    })
                    .collect(),
            ),
        };
        Ok(PreparedQuery {
            head_dim: self.head_dim,
            kind,
        })
    }

    fn check_query(&self, pq: &PreparedQuery) -> Result<()> {
        let ok = pq.head_dim == self.head_dim
            && match (&self.format, &pq.kind) {
                (Format::Plain(_), QueryKind::Plain(_)) => true,
                (Format::Tq(t), QueryKind::Tq(parts)) => {
                    parts.len() == t.parts.len()
                        && parts
                            .iter()
                            .zip(&t.parts)
                            .all(|(q, p)| q.sketched.is_some() == p.qjl.is_some())
                }
                _ => false,
            };
        if ok {
            Ok(())
        } else {
            Err(Error::InvalidConfig {
                what: "prepared query",
                reason: "prepared by a codec of another format",
            })
        }
    }

    fn check_record(&self, codes: usize, scalars: usize) -> Result<()> {
        let s = self.token_sizes();
        if codes != s.code_bytes || scalars != s.scalars {
            return Err(Error::LengthMismatch {
                what: "code record (bytes + scalars)",
                expected: s.code_bytes + s.scalars,
                got: codes + scalars,
            });
        }
        Ok(())
    }

    /// `⟨q, x̂⟩` for one token's codes (prepared with the same codec).
    pub fn score(&self, pq: &PreparedQuery, codes: &[u8], scalars: &[f16]) -> Result<f32> {
        self.check_query(pq)?;
        self.check_record(codes.len(), scalars.len())?;
        Ok(self.score_unchecked(pq, codes, scalars))
    }

    fn score_unchecked(&self, pq: &PreparedQuery, codes: &[u8], scalars: &[f16]) -> f32 {
        match (&self.format, &pq.kind) {
            (Format::Plain(p), QueryKind::Plain(q)) => p.score(q, codes, scalars),
            (Format::Tq(t), QueryKind::Tq(qs)) => t
                .parts
                .iter()
                .zip(qs)
                .map(|(part, q)| part_score(part, q, codes, scalars))
                .sum(),
            _ => 0.0,
        }
    }

    /// Scores the first `out.len()` tokens of a block.
    pub fn score_block(
        &self,
        pq: &PreparedQuery,
        block: &[u8],
        layout: &BlockLayout,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_query(pq)?;
        self.check_layout(layout)?;
        if out.is_empty() {
            return Ok(());
        }
        layout.check(block.len(), out.len() - 1)?;
        let mut buf = [f16::ZERO; MAX_SCALARS];
        for (t, o) in out.iter_mut().enumerate() {
            let sc = read_scalars(&block[layout.scalars_range(t)], &mut buf);
            *o = self.score_unchecked(pq, &block[layout.codes_range(t)], sc);
        }
        Ok(())
    }

    /// A zeroed value accumulator for this codec.
    pub fn new_accumulator(&self) -> ValueAccumulator {
        let parts = match &self.format {
            Format::Plain(_) => vec![(vec![0.0; self.head_dim], None)],
            Format::Tq(t) => t
                .parts
                .iter()
                .map(|p| (vec![0.0; p.dim], p.qjl.as_ref().map(|_| vec![0.0; p.dim])))
                .collect(),
        };
        ValueAccumulator {
            head_dim: self.head_dim,
            parts,
        }
    }

    fn check_acc(&self, acc: &ValueAccumulator) -> Result<()> {
        let fresh = self.new_accumulator();
        let same = acc.head_dim == fresh.head_dim
            && acc.parts.len() == fresh.parts.len()
            && acc.parts.iter().zip(&fresh.parts).all(|(a, b)| {
                a.0.len() == b.0.len() && a.1.as_ref().map(Vec::len) == b.1.as_ref().map(Vec::len)
            });
        if same {
            Ok(())
        } else {
            Err(Error::InvalidConfig {
                what: "value accumulator",
                reason: "made by a codec of another format",
            })
        }
    }

    /// `acc += weight · x̂` for one token's codes, in the rotated basis.
    pub fn accumulate(
        &self,
        acc: &mut ValueAccumulator,
        weight: f32,
        codes: &[u8],
        scalars: &[f16],
    ) -> Result<()> {
        self.check_acc(acc)?;
        self.check_record(codes.len(), scalars.len())?;
        self.accumulate_unchecked(acc, weight, codes, scalars);
        Ok(())
    }

    fn accumulate_unchecked(&self, acc: &mut ValueAccumulator, w: f32, codes: &[u8], sc: &[f16]) {
        match &self.format {
            Format::Plain(p) => p.accumulate(&mut acc.parts[0].0, w, codes, sc),
            Format::Tq(t) => {
                for (part, a) in t.parts.iter().zip(&mut acc.parts) {
                    part_accumulate(part, a, w, codes, sc);
                }
            }
        }
    }

    /// Accumulates the first `weights.len()` tokens of a block.
    pub fn accumulate_block(
        &self,
        acc: &mut ValueAccumulator,
        block: &[u8],
        layout: &BlockLayout,
        weights: &[f32],
    ) -> Result<()> {
        self.check_acc(acc)?;
        self.check_layout(layout)?;
        if weights.is_empty() {
            return Ok(());
        }
        layout.check(block.len(), weights.len() - 1)?;
        let mut buf = [f16::ZERO; MAX_SCALARS];
        for (t, &w) in weights.iter().enumerate() {
            let sc = read_scalars(&block[layout.scalars_range(t)], &mut buf);
            self.accumulate_unchecked(acc, w, &block[layout.codes_range(t)], sc);
        }
        Ok(())
    }

    /// Rotates the accumulated sum back once: `out = Σ_t p_t·x̂_t`.
    pub fn finish(&self, acc: &ValueAccumulator, out: &mut [f32]) -> Result<()> {
        self.check_acc(acc)?;
        if out.len() != self.head_dim {
            return Err(Error::LengthMismatch {
                what: "output",
                expected: self.head_dim,
                got: out.len(),
            });
        }
        match &self.format {
            Format::Plain(_) => out.copy_from_slice(&acc.parts[0].0),
            Format::Tq(t) => {
                for (part, (a, s)) in t.parts.iter().zip(&acc.parts) {
                    let mut v = a.clone();
                    if let (Some(qjl), Some(s)) = (&part.qjl, s) {
                        let mut st = vec![0.0; part.dim];
                        qjl.apply_t(s, &mut st);
                        for (vi, x) in v.iter_mut().zip(&st) {
                            *vi += qjl.constant * x;
                        }
                    }
                    let mut x = vec![0.0; part.dim];
                    let _ = part.rotation.inverse(&v, &mut x);
                    part.scatter(&x, out);
                }
            }
        }
        Ok(())
    }
}
