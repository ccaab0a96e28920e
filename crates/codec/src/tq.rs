//! TurboQuant-MSE and TurboQuant-prod for one kind of vector (one layer's keys or values).
//!
//! A vector is split into one or two *parts* (two for fractional widths: the outlier channels
//! and the rest), each quantized independently with its own rotation, codebook and norm.
//!
//! Encoding one part `g` (the gathered channels, dimension m), exactly as the reference does it:
//! 1. `n = √(sum_squares(g))` (fixed 8-lane order, see [`crate::kernels::sum_squares`]).
//! 2. `y = σ·R·g` with [`Rotation`]'s raw forward (for Hadamard: sign flips then an
//!    unnormalised FWHT, σ = √m; for dense σ = 1).
//! 3. `T_k = boundary_k · (n·σ)`; `idx_i = #{k : y_i > T_k}`; codes packed LSB-first.
//! 4. Scale `s = n` ([`NormMode::Exact`]) or `n / √(sum_squares(c[idx]))`
//!    ([`NormMode::Corrected`], so the reconstruction has norm n), stored as f16 (round to
//!    nearest even; any NaN stored as 0x7E00, see [`stored_f16`]).
//! 5. Prod mode only (`b − 1` bits in steps 3–4; 0 bits means no codes and x̂ = 0): the
//!    rotated residual in raw units `r_i = y_i − (s·σ)·c[idx_i]` (s is the f16-rounded scale,
//!    so r is the residual of what the decoder sees), `γ = √(sum_squares(r)) / σ` (f16), and
//!    sign bits `bit_i = [(S·r)_i ≥ 0]` packed LSB-first. S acts in the rotated basis; see
//!    [`QjlSketch`] for the two choices and their constants κ. The default (structured) S for
//!    power-of-two m is `√m·(H·D₃/√m)·(H·D₂/√m)`, applied to r as two raw sign-flip + FWHT
//!    passes (only the signs of the result matter).
//!
//! Decoding: `x̂ = Rᵀ (s·c[idx] + γ·κ·Sᵀ·sign)`, scattered back to the part's channels; the
//! inner-product estimate `⟨q, x̂⟩` is the QJL estimator, unbiased over the draw of S
//! (for one fixed seed a bias of order 10⁻³·‖x‖² remains; `tests/statistics.rs`).
//!
//! Seeds: part p's rotation uses `derive_seed(seed, 0x524F5400 + p)`, its QJL matrix
//! `derive_seed(seed, 0x514A4C00 + p)` (and sub-seeds 1, 2 of that for the two Hadamards).

use std::sync::Arc;

use half::f16;

use crate::bitpack;
use crate::codebook::Codebook;
use crate::dtype::{KeyMode, TqBits, split_sizes};
use crate::error::{Error, Result};
use crate::kernels::{self, Isa};
use crate::outliers::OutlierChannels;
use crate::prng::{Xoshiro256, derive_seed};
use crate::rotation::{Rotation, axpy_product};

/// What the stored per-part scale means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum NormMode {
    /// Store `n = ‖g‖` (the paper's TurboQuant).
    #[default]
    Exact,
    /// Store `n / ‖c[idx]‖` so the reconstruction has exactly the original norm.
    Corrected,
}

impl NormMode {
    /// Stable code used in snapshots.
    pub fn code(self) -> u8 {
        match self {
            NormMode::Exact => 0,
            NormMode::Corrected => 1,
        }
    }

    /// Inverse of [`NormMode::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(NormMode::Exact),
            1 => Some(NormMode::Corrected),
            _ => None,
        }
    }
}

/// Everything that determines a TurboQuant codec's bytes (part of the cache identity).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TqParams {
    /// Vector length.
    pub head_dim: usize,
    /// Bits per coordinate (fractional = outlier split).
    pub bits: TqBits,
    /// MSE or prod (QJL) quantization.
    pub mode: KeyMode,
    /// Meaning of the stored norm.
    pub norm: NormMode,
    /// The QJL matrix (prod mode only).
    pub qjl: QjlSketch,
    /// Seed of this codec's rotations (already specific to layer and key/value).
    pub seed: u64,
    /// The outlier channels (fractional widths only; `None` = [`OutlierChannels::leading`]).
    pub outliers: Option<OutlierChannels>,
}

/// Which matrix S the QJL stage of TurboQuant-prod uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QjlSketch {
    /// `S = √m·Q` with Q a second seeded rotation (randomized Hadamard for power-of-two m,
    /// dense Haar otherwise). Rows are (close to) uniform on the sphere of radius √m, so the
    /// estimator constant is `1 / (m·√m·E|u₁|)` with `E|u₁| = Γ(m/2) / (√π·Γ((m+1)/2))`, which
    /// makes it exactly unbiased for Haar Q. O(m log m) and lower variance than Gaussian S.
    #[default]
    Structured,
    /// The paper's S: i.i.d. N(0, 1) entries, constant `√(π/2)/m`. O(m²).
    Gaussian,
}

impl QjlSketch {
    /// Stable code used in snapshots.
    pub fn code(self) -> u8 {
        match self {
            QjlSketch::Structured => 0,
            QjlSketch::Gaussian => 1,
        }
    }

    /// Inverse of [`QjlSketch::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(QjlSketch::Structured),
            1 => Some(QjlSketch::Gaussian),
            _ => None,
        }
    }
}

/// `E|u₁|` for u uniform on the unit sphere of R^m: Γ(m/2) / (√π·Γ((m+1)/2)), by the
/// recurrence `E_{m+2} = E_m · m/(m+1)` from E_2 = 2/π, E_3 = 1/2.
pub fn sphere_abs_moment(m: usize) -> f64 {
    let (mut k, mut e) = if m.is_multiple_of(2) {
        (2usize, 2.0 / std::f64::consts::PI)
    } else {
        (3usize, 0.5)
    };
    while k + 2 <= m {
        e *= k as f64 / (k + 1) as f64;
        k += 2;
    }
    e
}

/// The orthogonal factors of a structured S. One randomized Hadamard leaves `S·r` slightly
/// non-Gaussian when r has light-tailed coordinates (a quantization residual does), which
/// biases the estimate by O(1/m) (measured z ≈ 10 at m = 128); a second round removes it.
fn structured_rotations(dim: usize, seed: u64) -> Result<Vec<Rotation>> {
    if dim.is_power_of_two() {
        Ok(vec![
            Rotation::new(dim, derive_seed(seed, 1))?,
            Rotation::new(dim, derive_seed(seed, 2))?,
        ])
    } else {
        Ok(vec![Rotation::new(dim, seed)?])
    }
}

/// The QJL sketch of one part.
#[derive(Debug, Clone)]
pub(crate) struct Qjl {
    matrix: QjlMatrix,
    /// `√m`, the row norm of a structured S.
    root_m: f32,
    /// Estimator constant: `⟨q, r⟩ ≈ γ · constant · ⟨S·q, sign(S·r)⟩`.
    pub(crate) constant: f32,
}

#[derive(Debug, Clone)]
enum QjlMatrix {
    /// Applied in order (two randomized Hadamards for power-of-two m, one dense Haar otherwise).
    Orthogonal(Vec<Rotation>),
    /// `s` row-major (for Sᵀ·z) and `st` = Sᵀ row-major (for S·v).
    Gaussian {
        s: Vec<f32>,
        st: Vec<f32>,
        dim: usize,
    },
}

impl Qjl {
    fn new(dim: usize, seed: u64, kind: QjlSketch) -> Result<Self> {
        let m = dim as f64;
        let (matrix, constant) = match kind {
            QjlSketch::Structured => (
                QjlMatrix::Orthogonal(structured_rotations(dim, seed)?),
                1.0 / (m * m.sqrt() * sphere_abs_moment(dim)),
            ),
            QjlSketch::Gaussian => {
                let mut rng = Xoshiro256::new(seed);
                let s: Vec<f32> = (0..dim * dim).map(|_| rng.gaussian() as f32).collect();
                let mut st = vec![0.0f32; dim * dim];
                for i in 0..dim {
                    for j in 0..dim {
                        st[j * dim + i] = s[i * dim + j];
                    }
                }
                (
                    QjlMatrix::Gaussian { s, st, dim },
                    std::f64::consts::FRAC_PI_2.sqrt() / m,
                )
            }
        };
        Ok(Qjl {
            matrix,
            root_m: m.sqrt() as f32,
            constant: constant as f32,
        })
    }

    /// The sign masks of the two randomized Hadamards of a structured sketch (`None` for a
    /// Gaussian or dense one): `S·r ∝ FWHT(D₃·FWHT(D₂·r))`.
    pub(crate) fn structured_masks(&self) -> Option<[&[u32]; 2]> {
        match &self.matrix {
            QjlMatrix::Orthogonal(rots) => match rots.as_slice() {
                [a, b] => Some([a.hadamard_parts()?.0, b.hadamard_parts()?.0]),
                _ => None,
            },
            QjlMatrix::Gaussian { .. } => None,
        }
    }

    /// A positive multiple of `S·r` (all the encoder needs for the signs).
    fn apply_for_signs(&self, r: &[f32], out: &mut [f32]) {
        match &self.matrix {
            QjlMatrix::Orthogonal(rots) => match rots.as_slice() {
                [one] => {
                    one.forward_raw(r, out);
                }
                many => {
                    out.copy_from_slice(r);
                    for rot in many {
                        rot.forward_in_place(out, true);
                    }
                }
            },
            QjlMatrix::Gaussian { st, dim, .. } => axpy_product(st, *dim, r, out),
        }
    }

    /// `out = S·v`.
    pub(crate) fn apply(&self, v: &[f32], out: &mut [f32]) {
        match &self.matrix {
            QjlMatrix::Orthogonal(rots) => {
                match rots.as_slice() {
                    [one] => {
                        let _ = one.forward(v, out);
                    }
                    many => {
                        out.copy_from_slice(v);
                        for rot in many {
                            rot.forward_in_place(out, false);
                        }
                    }
                }
                out.iter_mut().for_each(|o| *o *= self.root_m);
            }
            QjlMatrix::Gaussian { st, dim, .. } => axpy_product(st, *dim, v, out),
        }
    }

    /// `out = Sᵀ·z`.
    pub(crate) fn apply_t(&self, z: &[f32], out: &mut [f32]) {
        match &self.matrix {
            QjlMatrix::Orthogonal(rots) => {
                match rots.as_slice() {
                    [one] => {
                        let _ = one.inverse(z, out);
                    }
                    many => {
                        out.copy_from_slice(z);
                        for rot in many.iter().rev() {
                            rot.inverse_in_place(out);
                        }
                    }
                }
                out.iter_mut().for_each(|o| *o *= self.root_m);
            }
            QjlMatrix::Gaussian { s, dim, .. } => axpy_product(s, *dim, z, out),
        }
    }
}

/// One independently quantized channel subset.
#[derive(Debug, Clone)]
pub(crate) struct Part {
    /// Channels of the head vector in this part (`None` = all, in order).
    pub(crate) channels: Option<Vec<u16>>,
    pub(crate) dim: usize,
    /// Bits of the MSE codes (0 for 1-bit prod).
    pub(crate) mse_bits: u8,
    pub(crate) rotation: Rotation,
    pub(crate) codebook: Arc<Codebook>,
    pub(crate) qjl: Option<Qjl>,
    pub(crate) norm: NormMode,
    /// Byte offset of the MSE codes within the token's code record.
    pub(crate) code_offset: usize,
    pub(crate) code_bytes: usize,
    /// Byte offset of the sign bits within the record (prod only).
    pub(crate) sign_offset: usize,
    pub(crate) sign_bytes: usize,
    /// Index of this part's scale in the token's f16 scalars (γ follows it in prod mode).
    pub(crate) scalar_index: usize,
}

impl Part {
    pub(crate) fn gather(&self, x: &[f32], out: &mut [f32]) {
        match &self.channels {
            None => out.copy_from_slice(x),
            Some(ch) => {
                for (o, &c) in out.iter_mut().zip(ch) {
                    *o = x[usize::from(c)];
                }
            }
        }
    }

    pub(crate) fn scatter(&self, v: &[f32], x: &mut [f32]) {
        match &self.channels {
            None => x.copy_from_slice(v),
            Some(ch) => {
                for (&val, &c) in v.iter().zip(ch) {
                    x[usize::from(c)] = val;
                }
            }
        }
    }
}

/// Reusable buffers so the per-vector paths never allocate.
#[derive(Debug, Default)]
pub struct Scratch {
    pub(crate) a: Vec<f32>,
    pub(crate) b: Vec<f32>,
    pub(crate) c: Vec<f32>,
    pub(crate) codes: Vec<u8>,
}

impl Scratch {
    pub(crate) fn ensure(&mut self, dim: usize) {
        if self.a.len() < dim {
            self.a.resize(dim, 0.0);
            self.b.resize(dim, 0.0);
            self.c.resize(dim, 0.0);
            self.codes.resize(dim, 0);
        }
    }
}

/// A TurboQuant codec for one kind of vector.
#[derive(Debug, Clone)]
pub struct TqCodec {
    params: TqParams,
    pub(crate) parts: Vec<Part>,
    code_bytes: usize,
    scalars: usize,
}

/// Tags for deriving per-part seeds.
const TAG_ROTATION: u64 = 0x524F_5400;
const TAG_QJL: u64 = 0x514A_4C00;

impl TqCodec {
    /// Builds the codec (rotations and codebooks) for `params`.
    pub fn new(params: TqParams) -> Result<Self> {
        let d = params.head_dim;
        let mut params = params;
        crate::layout::validate_tq_dim(params.bits, d)?;
        let (n_hi, _) = split_sizes(params.bits, d);
        let groups: Vec<(Option<Vec<u16>>, u8)> = if params.bits.is_fractional() {
            let outliers = match params.outliers.take() {
                Some(o) => o,
                None => OutlierChannels::leading(d, n_hi)?,
            };
            if outliers.head_dim() != d || outliers.channels().len() != n_hi {
                return Err(Error::InvalidOutliers {
                    head_dim: d,
                    reason: "a fractional width needs exactly head_dim / 2 outlier channels",
                });
            }
            let hi = outliers.channels().to_vec();
            let lo = outliers.complement();
            params.outliers = Some(outliers);
            vec![
                (Some(hi), params.bits.hi_bits()),
                (Some(lo), params.bits.lo_bits()),
            ]
        } else {
            // Whole widths have no split; normalise so identities compare equal.
            params.outliers = None;
            vec![(None, params.bits.hi_bits())]
        };
        let prod = params.mode == KeyMode::Prod;
        let mut parts = Vec::with_capacity(groups.len());
        let (mut offset, mut scalar_index) = (0usize, 0usize);
        for (p, (channels, bits)) in groups.into_iter().enumerate() {
            let dim = channels.as_ref().map_or(d, Vec::len);
            let mse_bits = if prod { bits - 1 } else { bits };
            let rotation = Rotation::new(dim, derive_seed(params.seed, TAG_ROTATION + p as u64))?;
            let codebook = Codebook::get(dim, mse_bits)?;
            let qjl = if prod {
                Some(Qjl::new(
                    dim,
                    derive_seed(params.seed, TAG_QJL + p as u64),
                    params.qjl,
                )?)
            } else {
                None
            };
            let code_bytes = if mse_bits == 0 {
                0
            } else {
                bitpack::packed_len(dim, mse_bits)
            };
            let sign_bytes = if prod { bitpack::packed_len(dim, 1) } else { 0 };
            parts.push(Part {
                channels,
                dim,
                mse_bits,
                rotation,
                codebook,
                qjl,
                norm: params.norm,
                code_offset: offset,
                code_bytes,
                sign_offset: offset + code_bytes,
                sign_bytes,
                scalar_index,
            });
            offset += code_bytes + sign_bytes;
            scalar_index += if prod { 2 } else { 1 };
        }
        Ok(TqCodec {
            params,
            parts,
            code_bytes: offset,
            scalars: scalar_index,
        })
    }

    /// The parameters (with outliers normalised: `None` for whole widths, explicit otherwise).
    pub fn params(&self) -> &TqParams {
        &self.params
    }

    /// Bytes of packed codes (MSE codes and sign bits) per vector.
    pub fn code_bytes(&self) -> usize {
        self.code_bytes
    }

    /// f16 scalars per vector (one norm per part, plus γ per part in prod mode).
    pub fn scalars_per_vector(&self) -> usize {
        self.scalars
    }

    fn check_io(&self, x: usize, codes: usize, scalars: usize) -> Result<()> {
        let checks = [
            ("vector", self.params.head_dim, x),
            ("codes", self.code_bytes, codes),
            ("scalars", self.scalars, scalars),
        ];
        for (what, expected, got) in checks {
            if expected != got {
                return Err(Error::LengthMismatch {
                    what,
                    expected,
                    got,
                });
            }
        }
        Ok(())
    }

    /// Encodes `x` into `codes` (`code_bytes()` long) and `scalars`.
    pub fn encode(&self, x: &[f32], codes: &mut [u8], scalars: &mut [f16]) -> Result<()> {
        self.encode_with_isa(x, codes, scalars, Isa::detect())
    }

    /// [`TqCodec::encode`] on a chosen instruction set. Every ISA produces identical bytes;
    /// this exists to test that. An ISA the CPU lacks falls back to scalar.
    pub fn encode_with_isa(
        &self,
        x: &[f32],
        codes: &mut [u8],
        scalars: &mut [f16],
        isa: Isa,
    ) -> Result<()> {
        self.check_io(x.len(), codes.len(), scalars.len())?;
        // The fused kernel needs no scratch for exact norms: try it first for such parts.
        // (Kernels check the CPU themselves, so an `isa` this CPU lacks runs the scalar code.)
        let mut done = [false; 2];
        for (part, d) in self.parts.iter().zip(&mut done) {
            if part.channels.is_none() && part.norm == NormMode::Exact {
                *d = encode_part_fast(part, x, codes, scalars, (&mut [], &mut []), isa);
            }
        }
        if done[..self.parts.len()].iter().all(|&d| d) {
            return Ok(());
        }
        with_scratch(|s| {
            for (part, &d) in self.parts.iter().zip(&done) {
                if !d {
                    s.ensure(part.dim);
                    encode_part(part, x, codes, scalars, s, isa);
                }
            }
        });
        Ok(())
    }

    /// Decodes into `out` (`head_dim` long).
    pub fn decode(&self, codes: &[u8], scalars: &[f16], out: &mut [f32]) -> Result<()> {
        self.check_io(out.len(), codes.len(), scalars.len())?;
        with_scratch(|s| {
            for part in &self.parts {
                s.ensure(part.dim);
                decode_part(part, codes, scalars, out, s);
            }
        });
        Ok(())
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch buffers (a fresh set if they are already borrowed).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Rounds a side scalar to f16 for storage. NaN payloads are not reproducible across
/// instruction schedules (IEEE leaves the propagated payload open), so every NaN is stored as
/// the canonical quiet NaN 0x7E00; this keeps encoders bit-identical even on NaN input.
pub fn stored_f16(v: f32) -> f16 {
    if v.is_nan() {
        f16::from_bits(0x7E00)
    } else {
        f16::from_f32(v)
    }
}

/// The fused path (MSE, Hadamard, SIMD): `g` is the part's gathered input; `cbuf` and `idx`
/// are scratch of the part's length for corrected norms (unused, and may be empty, for exact
/// ones). Returns false where it does not apply, having written nothing that the caller's
/// fallback does not overwrite. Same bytes as [`encode_part`].
fn encode_part_fast(
    part: &Part,
    g: &[f32],
    codes: &mut [u8],
    scalars: &mut [f16],
    (cbuf, idx): (&mut [f32], &mut [u8]),
    isa: Isa,
) -> bool {
    if part.qjl.is_some() || part.mse_bits == 0 {
        return false;
    }
    let Some((masks, sigma)) = part.rotation.hadamard_parts() else {
        return false;
    };
    let out = &mut codes[part.code_offset..part.code_offset + part.code_bytes];
    let bounds = part.codebook.boundaries();
    let Some(n) = kernels::encode_hadamard_mse(g, masks, bounds, sigma, part.mse_bits, out, isa)
    else {
        return false;
    };
    let scale = match part.norm {
        NormMode::Exact => n,
        NormMode::Corrected => {
            if bitpack::unpack(out, part.mse_bits, idx).is_err() {
                return false;
            }
            corrected_scale(n, part.codebook.centroids(), idx, cbuf)
        }
    };
    scalars[part.scalar_index] = stored_f16(scale);
    true
}

/// `n / ‖c[idx]‖` ([`NormMode::Corrected`]: the decoded vector gets norm n), or `n` where every
/// centroid is zero; `buf` (the part's length) receives the centroids.
fn corrected_scale(n: f32, centroids: &[f32], idx: &[u8], buf: &mut [f32]) -> f32 {
    for (c, &k) in buf.iter_mut().zip(idx) {
        *c = centroids[usize::from(k)];
    }
    let cn = kernels::sum_squares(buf).sqrt();
    if cn > 0.0 { n / cn } else { n }
}

fn encode_part(
    part: &Part,
    x: &[f32],
    codes: &mut [u8],
    scalars: &mut [f16],
    s: &mut Scratch,
    isa: Isa,
) {
    let m = part.dim;
    let (gbuf, y, idx) = (&mut s.a[..m], &mut s.b[..m], &mut s.codes[..m]);
    let g: &[f32] = match &part.channels {
        None => x,
        Some(_) => {
            part.gather(x, gbuf);
            gbuf
        }
    };
    if encode_part_fast(part, g, codes, scalars, (&mut y[..], &mut idx[..]), isa) {
        return;
    }
    let need_idx = part.qjl.is_some() || part.norm == NormMode::Corrected;
    let (nsq, sigma) = part.rotation.forward_raw_norm(g, y, isa);
    let n = nsq.sqrt();
    let cents = part.codebook.centroids();
    if part.mse_bits > 0 {
        let out = &mut codes[part.code_offset..part.code_offset + part.code_bytes];
        let bounds = part.codebook.boundaries();
        let idx_out = if need_idx { Some(&mut idx[..]) } else { None };
        kernels::quantize_pack(y, bounds, n * sigma, part.mse_bits, out, idx_out, isa);
    } else {
        // The 0-bit codebook is the single centroid 0.
        idx.fill(0);
    }
    let scale = match (part.mse_bits, part.norm) {
        (0, _) | (_, NormMode::Exact) => n,
        (_, NormMode::Corrected) => corrected_scale(n, cents, idx, gbuf),
    };
    let scale16 = stored_f16(scale);
    scalars[part.scalar_index] = scale16;
    let Some(qjl) = &part.qjl else { return };
    // Residual in the rotated basis, raw units, into `gbuf`; S·r into `y`.
    let a = scale16.to_f32() * sigma;
    for ((r, &yi), &k) in gbuf.iter_mut().zip(y.iter()).zip(idx.iter()) {
        *r = yi - a * cents[usize::from(k)];
    }
    let gamma = kernels::sum_squares(gbuf).sqrt() / sigma;
    scalars[part.scalar_index + 1] = stored_f16(gamma);
    qjl.apply_for_signs(gbuf, y);
    let out = &mut codes[part.sign_offset..part.sign_offset + part.sign_bytes];
    kernels::pack_signs(y, out, isa);
}

fn decode_part(part: &Part, codes: &[u8], scalars: &[f16], out: &mut [f32], s: &mut Scratch) {
    let m = part.dim;
    let (v, w, tmp) = (&mut s.a[..m], &mut s.b[..m], &mut s.c[..m]);
    let scale = scalars[part.scalar_index].to_f32();
    let cents = part.codebook.centroids();
    if part.mse_bits > 0 {
        let packed = &codes[part.code_offset..part.code_offset + part.code_bytes];
        for (i, vi) in v.iter_mut().enumerate() {
            *vi = scale * cents[usize::from(bitpack::get(packed, part.mse_bits, i))];
        }
    } else {
        v.fill(0.0);
    }
    if let Some(qjl) = &part.qjl {
        let gamma = scalars[part.scalar_index + 1].to_f32();
        let signs = &codes[part.sign_offset..part.sign_offset + part.sign_bytes];
        for (i, wi) in w.iter_mut().enumerate() {
            *wi = if bitpack::get(signs, 1, i) == 1 {
                1.0
            } else {
                -1.0
            };
        }
        qjl.apply_t(w, tmp);
        let c = gamma * qjl.constant;
        for (vi, &t) in v.iter_mut().zip(tmp.iter()) {
            *vi += c * t;
        }
    }
    // Inverse rotation cannot fail: lengths match by construction.
    let _ = part.rotation.inverse(v, w);
    part.scatter(w, out);
}
