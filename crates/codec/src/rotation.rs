//! Seeded random rotations `R` (orthogonal d×d) applied before quantization.
//!
//! * d a power of two: randomized Hadamard `R = H·D / √d`, D = diagonal of seeded ±1 signs,
//!   H the Walsh–Hadamard matrix, applied in O(d log d) with an in-place fast transform.
//! * any other d: a seeded dense orthogonal matrix, modified Gram–Schmidt (two passes, f64)
//!   of a seeded Gaussian matrix, i.e. Haar-distributed, stored in f32.
//!
//! The exact sequence of f32 operations is part of the format (encoders on every backend must
//! produce identical codes): the FWHT runs its stages with h = 1, 2, 4, … and each butterfly
//! writes `(a + b, a − b)`; the dense product is `y = Σ_j x_j · R[:, j]` accumulated in
//! increasing `j`, multiply then add (no FMA).

use crate::error::{Error, Result};
use crate::kernels::{self, Isa};
use crate::prng::Xoshiro256;

/// Largest head dimension for the dense construction (its matrix costs 8·d² bytes).
pub const MAX_DENSE_DIM: usize = 1024;
/// Largest power-of-two dimension.
pub const MAX_HADAMARD_DIM: usize = 1 << 16;

/// A seeded orthogonal transform of one dimension.
#[derive(Debug, Clone)]
pub enum Rotation {
    /// `H·D/√d` for power-of-two `d`.
    Hadamard {
        /// XOR masks (0 or the f32 sign bit) that implement D.
        sign_masks: Vec<u32>,
        /// `1/σ`.
        scale: f32,
        /// `σ = √d` rounded to f32 (what the encoder scales thresholds by).
        sigma: f32,
    },
    /// Dense orthogonal `R`, stored twice so that both directions are sequences of axpys.
    Dense {
        /// `R` row-major (row i = what multiplies y_i in the inverse).
        r: Vec<f32>,
        /// `Rᵀ` row-major (row j = column j of R, used by the forward product).
        rt: Vec<f32>,
        /// The dimension.
        dim: usize,
    },
}

impl Rotation {
    /// The rotation of dimension `dim` for `seed`.
    pub fn new(dim: usize, seed: u64) -> Result<Self> {
        if dim < 2 {
            return Err(Error::UnsupportedHeadDim {
                head_dim: dim,
                reason: "a rotation needs at least 2 dimensions",
            });
        }
        if dim.is_power_of_two() {
            if dim > MAX_HADAMARD_DIM {
                return Err(Error::UnsupportedHeadDim {
                    head_dim: dim,
                    reason: "larger than 65536",
                });
            }
            Ok(Self::hadamard(dim, seed))
        } else if dim <= MAX_DENSE_DIM {
            Ok(Self::dense(dim, seed))
        } else {
            Err(Error::UnsupportedHeadDim {
                head_dim: dim,
                reason: "non-power-of-two dimensions above 1024 are not supported",
            })
        }
    }

    fn hadamard(dim: usize, seed: u64) -> Self {
        let mut rng = Xoshiro256::new(seed);
        let sign_masks = (0..dim)
            .map(|_| if rng.sign() < 0.0 { 0x8000_0000 } else { 0 })
            .collect();
        let sigma = (dim as f32).sqrt();
        Rotation::Hadamard {
            sign_masks,
            scale: 1.0 / sigma,
            sigma,
        }
    }

    fn dense(dim: usize, seed: u64) -> Self {
        let mut rng = Xoshiro256::new(seed);
        let mut q: Vec<f64> = (0..dim * dim).map(|_| rng.gaussian()).collect();
        gram_schmidt_rows(&mut q, dim);
        let r: Vec<f32> = q.iter().map(|&v| v as f32).collect();
        let mut rt = vec![0.0f32; dim * dim];
        for i in 0..dim {
            for j in 0..dim {
                rt[j * dim + i] = r[i * dim + j];
            }
        }
        Rotation::Dense { r, rt, dim }
    }

    /// The dimension.
    pub fn dim(&self) -> usize {
        match self {
            Rotation::Hadamard { sign_masks, .. } => sign_masks.len(),
            Rotation::Dense { dim, .. } => *dim,
        }
    }

    fn check(&self, what: &'static str, got: usize) -> Result<()> {
        if got == self.dim() {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                what,
                expected: self.dim(),
                got,
            })
        }
    }

    /// `out = R·x`.
    pub fn forward(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        self.check("rotation input", x.len())?;
        self.check("rotation output", out.len())?;
        match self {
            Rotation::Hadamard {
                sign_masks, scale, ..
            } => {
                apply_signs(x, sign_masks, out);
                crate::kernels::fwht(out);
                out.iter_mut().for_each(|v| *v *= *scale);
            }
            Rotation::Dense { rt, dim, .. } => axpy_product(rt, *dim, x, out),
        }
        Ok(())
    }

    /// `out = σ·R·x` without the final scaling, returning σ (√d for Hadamard, 1 for dense).
    /// This is what the encoder quantizes: thresholds are scaled by σ instead of every output.
    pub(crate) fn forward_raw(&self, x: &[f32], out: &mut [f32]) -> f32 {
        match self {
            Rotation::Hadamard {
                sign_masks, sigma, ..
            } => {
                apply_signs(x, sign_masks, out);
                crate::kernels::fwht(out);
                *sigma
            }
            Rotation::Dense { rt, dim, .. } => {
                axpy_product(rt, *dim, x, out);
                1.0
            }
        }
    }

    /// `v ← R·v` (`raw`: without the final 1/σ scaling). Hadamard works in place; the dense
    /// form needs a temporary copy (so hot paths use the out-of-place calls for it).
    pub(crate) fn forward_in_place(&self, v: &mut [f32], raw: bool) {
        match self {
            Rotation::Hadamard {
                sign_masks, scale, ..
            } => {
                for (x, &m) in v.iter_mut().zip(sign_masks) {
                    *x = f32::from_bits(x.to_bits() ^ m);
                }
                crate::kernels::fwht(v);
                if !raw {
                    v.iter_mut().for_each(|x| *x *= *scale);
                }
            }
            Rotation::Dense { rt, dim, .. } => {
                let x = v.to_vec();
                axpy_product(rt, *dim, &x, v);
            }
        }
    }

    /// `v ← Rᵀ·v`, in place (see [`Rotation::forward_in_place`]).
    pub(crate) fn inverse_in_place(&self, v: &mut [f32]) {
        match self {
            Rotation::Hadamard {
                sign_masks, scale, ..
            } => {
                crate::kernels::fwht(v);
                for (x, &m) in v.iter_mut().zip(sign_masks) {
                    *x = f32::from_bits((*x * *scale).to_bits() ^ m);
                }
            }
            Rotation::Dense { r, dim, .. } => {
                let y = v.to_vec();
                axpy_product(r, *dim, &y, v);
            }
        }
    }

    /// `(sign masks, σ)` of a randomized Hadamard rotation; `None` for the dense form.
    pub(crate) fn hadamard_parts(&self) -> Option<(&[u32], f32)> {
        match self {
            Rotation::Hadamard {
                sign_masks, sigma, ..
            } => Some((sign_masks, *sigma)),
            Rotation::Dense { .. } => None,
        }
    }

    /// The encoder's first step: `out = σ·R·x` (see [`Rotation::forward_raw`]) and the
    /// squared norm of `x` in the codec's fixed summation order. Returns `(‖x‖², σ)`.
    pub(crate) fn forward_raw_norm(&self, x: &[f32], out: &mut [f32], isa: Isa) -> (f32, f32) {
        match self {
            Rotation::Hadamard {
                sign_masks, sigma, ..
            } => (kernels::signs_fwht_norm(x, sign_masks, out, isa), *sigma),
            Rotation::Dense { rt, dim, .. } => {
                axpy_product(rt, *dim, x, out);
                (kernels::sum_squares(x), 1.0)
            }
        }
    }

    /// `out = Rᵀ·y` (the inverse).
    pub fn inverse(&self, y: &[f32], out: &mut [f32]) -> Result<()> {
        self.check("rotation input", y.len())?;
        self.check("rotation output", out.len())?;
        match self {
            Rotation::Hadamard {
                sign_masks, scale, ..
            } => {
                out.copy_from_slice(y);
                crate::kernels::fwht(out);
                for (v, &m) in out.iter_mut().zip(sign_masks) {
                    *v = f32::from_bits((*v * *scale).to_bits() ^ m);
                }
            }
            Rotation::Dense { r, dim, .. } => axpy_product(r, *dim, y, out),
        }
        Ok(())
    }

    /// `R·x` for each of the `xs.len() / d` vectors stored back to back.
    pub fn forward_batch(&self, xs: &[f32], outs: &mut [f32]) -> Result<()> {
        self.batch(xs, outs, Self::forward)
    }

    /// `Rᵀ·y` for each vector stored back to back.
    pub fn inverse_batch(&self, ys: &[f32], outs: &mut [f32]) -> Result<()> {
        self.batch(ys, outs, Self::inverse)
    }

    fn batch(
        &self,
        xs: &[f32],
        outs: &mut [f32],
        f: fn(&Self, &[f32], &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let d = self.dim();
        if !xs.len().is_multiple_of(d) || outs.len() != xs.len() {
            return Err(Error::LengthMismatch {
                what: "batched rotation (input a multiple of d, output the same length)",
                expected: xs.len() - xs.len() % d,
                got: outs.len(),
            });
        }
        for (x, o) in xs.chunks_exact(d).zip(outs.chunks_exact_mut(d)) {
            f(self, x, o)?;
        }
        Ok(())
    }
}

/// `out = D·x` as sign-bit XORs (exact).
pub(crate) fn apply_signs(x: &[f32], masks: &[u32], out: &mut [f32]) {
    for ((o, &v), &m) in out.iter_mut().zip(x).zip(masks) {
        *o = f32::from_bits(v.to_bits() ^ m);
    }
}

/// `out = Σ_j x_j · rows[j]` (rows row-major, `dim × dim`), accumulated in increasing j.
pub(crate) fn axpy_product(rows: &[f32], dim: usize, x: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (&xj, row) in x.iter().zip(rows.chunks_exact(dim)) {
        for (o, &r) in out.iter_mut().zip(row) {
            *o += xj * r;
        }
    }
}

/// Orthonormalises the rows of the `dim × dim` matrix `q` in place (modified Gram–Schmidt,
/// two passes for f64-level orthogonality).
fn gram_schmidt_rows(q: &mut [f64], dim: usize) {
    for i in 0..dim {
        for _pass in 0..2 {
            for k in 0..i {
                let (done, rest) = q.split_at_mut(i * dim);
                let qk = &done[k * dim..(k + 1) * dim];
                let qi = &mut rest[..dim];
                let dot: f64 = qi.iter().zip(qk).map(|(a, b)| a * b).sum();
                qi.iter_mut().zip(qk).for_each(|(a, b)| *a -= dot * b);
            }
        }
        let row = &mut q[i * dim..(i + 1) * dim];
        let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
        // A Gaussian matrix is full rank with probability one; guard anyway.
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel_err(a: &[f32], b: &[f32]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (num / den).sqrt()
    }

    #[test]
    fn rotations_invert_and_preserve_norm() {
        for d in [2usize, 8, 64, 80, 96, 112, 128, 160, 192, 256] {
            let rot = Rotation::new(d, 99 + d as u64).unwrap();
            let mut rng = Xoshiro256::new(d as u64);
            let x: Vec<f32> = (0..d).map(|_| rng.gaussian() as f32).collect();
            let mut y = vec![0.0; d];
            let mut z = vec![0.0; d];
            rot.forward(&x, &mut y).unwrap();
            rot.inverse(&y, &mut z).unwrap();
            assert!(rel_err(&z, &x) < 1e-5, "d={d} err={}", rel_err(&z, &x));
            let nx: f32 = x.iter().map(|v| v * v).sum();
            let ny: f32 = y.iter().map(|v| v * v).sum();
            assert!((nx - ny).abs() / nx < 1e-5, "d={d}");
            assert_ne!(x, y);
        }
    }

    #[test]
    fn dense_is_orthogonal() {
        let d = 96;
        let Rotation::Dense { r, .. } = Rotation::new(d, 1).unwrap() else {
            panic!("96 is not a power of two");
        };
        for i in 0..d {
            for j in 0..d {
                let dot: f32 = (0..d).map(|k| r[i * d + k] * r[j * d + k]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn batched_equals_single_and_checks_lengths() {
        for d in [64usize, 80] {
            let rot = Rotation::new(d, 5).unwrap();
            let mut rng = Xoshiro256::new(1);
            let xs: Vec<f32> = (0..3 * d).map(|_| rng.gaussian() as f32).collect();
            let mut ys = vec![0.0; 3 * d];
            rot.forward_batch(&xs, &mut ys).unwrap();
            let mut back = vec![0.0; 3 * d];
            rot.inverse_batch(&ys, &mut back).unwrap();
            for i in 0..3 {
                let mut y = vec![0.0; d];
                rot.forward(&xs[i * d..(i + 1) * d], &mut y).unwrap();
                assert_eq!(y, ys[i * d..(i + 1) * d]);
            }
            assert!(rel_err(&back, &xs) < 1e-5);
            assert!(rot.forward_batch(&xs[1..], &mut ys[1..]).is_err());
            assert!(rot.forward(&xs[..d - 1], &mut ys[..d]).is_err());
        }
        assert!(Rotation::new(1, 0).is_err());
        assert!(Rotation::new(1025, 0).is_err());
    }

    #[test]
    fn seeds_matter() {
        let a = Rotation::new(64, 1).unwrap();
        let b = Rotation::new(64, 2).unwrap();
        let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let (mut ya, mut yb) = (vec![0.0; 64], vec![0.0; 64]);
        a.forward(&x, &mut ya).unwrap();
        b.forward(&x, &mut yb).unwrap();
        assert_ne!(ya, yb);
    }
}
