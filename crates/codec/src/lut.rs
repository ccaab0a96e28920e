//! Per-query lookup tables for scoring 1–4-bit codes (an alternative to decode-and-FMA).
//!
//! The rotated query is split into groups of `g` coordinates whose codes fill `g·b ≤ 8` bits
//! (one byte for b = 1, 2, 4; six bits for b = 3). For every group and every possible code
//! combination the table holds `Σ_{i∈group} q'_i·c[code_i]`, so a token's dot product is one
//! table lookup and one add per group. Building costs `2^(g·b)·(d/g)·g` multiply-adds per
//! query (32 k at d = 128, b = 4), so it pays off only over many tokens; `turbokv bench codec`
//! measures it against the direct kernel.

use crate::kernels::load_le;

/// Lookup tables of one query part.
#[derive(Debug, Clone)]
pub struct CodeLut {
    bits: u8,
    /// Codes per group.
    group: usize,
    /// `n_groups × 2^(group·bits)` partial sums.
    table: Vec<f32>,
    dim: usize,
}

impl CodeLut {
    /// Tables for the rotated query `q` against `centroids` (2^bits of them, bits 1..=4).
    /// Returns `None` for other widths.
    pub fn new(q: &[f32], bits: u8, centroids: &[f32]) -> Option<Self> {
        if !(1..=4).contains(&bits) || centroids.len() != 1 << bits {
            return None;
        }
        let group = if bits == 3 { 2 } else { 8 / usize::from(bits) };
        let field = group * usize::from(bits);
        let entries = 1usize << field;
        let n_groups = q.len().div_ceil(group);
        let mask = (1usize << bits) - 1;
        let mut table = vec![0.0f32; n_groups * entries];
        for (gi, qs) in q.chunks(group).enumerate() {
            let t = &mut table[gi * entries..(gi + 1) * entries];
            for (v, slot) in t.iter_mut().enumerate() {
                let mut s = 0.0f32;
                for (j, &qj) in qs.iter().enumerate() {
                    s += qj * centroids[(v >> (j * usize::from(bits))) & mask];
                }
                *slot = s;
            }
        }
        Some(CodeLut {
            bits,
            group,
            table,
            dim: q.len(),
        })
    }

    /// `Σ_i q[i]·c[code_i]` for one token's packed codes (`packed_len(dim, bits)` bytes).
    pub fn dot(&self, packed: &[u8]) -> f32 {
        let field = self.group * usize::from(self.bits);
        let entries = 1usize << field;
        if field == 8 {
            // One group per byte.
            let mut acc = [0.0f32; 4];
            for (gi, &byte) in packed.iter().enumerate() {
                let t = self.table.get(gi * entries + usize::from(byte)).copied();
                acc[gi & 3] += t.unwrap_or(0.0);
            }
            (acc[0] + acc[1]) + (acc[2] + acc[3])
        } else {
            // b = 3: eight codes per three bytes, four 6-bit groups.
            let mut acc = [0.0f32; 4];
            let n_groups = self.dim.div_ceil(self.group);
            for (ci, chunk) in packed.chunks(3).enumerate() {
                let w = load_le(chunk) as usize;
                for (j, a) in acc.iter_mut().enumerate() {
                    let gi = 4 * ci + j;
                    if gi >= n_groups {
                        break;
                    }
                    let t = self.table.get(gi * 64 + ((w >> (6 * j)) & 63)).copied();
                    *a += t.unwrap_or(0.0);
                }
            }
            (acc[0] + acc[1]) + (acc[2] + acc[3])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bitpack;
    use crate::prng::Xoshiro256;
    use crate::score::dot_codes_ref;

    #[test]
    fn lut_equals_direct() {
        let mut rng = Xoshiro256::new(3);
        for bits in 1..=4u8 {
            for d in [8usize, 64, 96, 128] {
                let q: Vec<f32> = (0..d).map(|_| rng.gaussian() as f32).collect();
                let cents: Vec<f32> = (0..1 << bits).map(|k| (k as f32 - 3.5) * 0.1).collect();
                let codes: Vec<u8> = (0..d).map(|_| rng.below(1 << bits) as u8).collect();
                let mut packed = vec![0u8; bitpack::packed_len(d, bits)];
                bitpack::pack(&codes, bits, &mut packed).unwrap();
                let lut = CodeLut::new(&q, bits, &cents).unwrap();
                let a = lut.dot(&packed);
                let b = dot_codes_ref(&q, &packed, bits, &cents);
                assert!(
                    (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                    "b={bits} d={d}: {a} vs {b}"
                );
            }
        }
        assert!(CodeLut::new(&[0.0; 8], 5, &[0.0; 32]).is_none());
    }
}
