//! LFM2's gated short convolution on the CPU: `out = c ⊙ conv(b ⊙ x)` with a depthwise
//! causal convolution of a few taps, continuing each sequence from its carried state.

use rayon::prelude::*;

use super::CpuTensor;
use crate::Error;
use crate::backend::SeqSpan;
use crate::shape::check_short_conv;

/// See [`crate::Backend::short_conv`]. `out` must already have `bcx`'s rows.
pub(super) fn short_conv(
    bcx: &CpuTensor,
    kernel: &[f32],
    spans: &[SeqSpan<'_>],
    states: &mut [&mut [f32]],
    out: &mut CpuTensor,
) -> Result<(), Error> {
    let h = out.cols();
    let lens: Vec<usize> = states.iter().map(|s| s.len()).collect();
    let taps = check_short_conv(bcx.rows(), bcx.cols(), h, kernel.len(), spans, &lens)?;
    let mut hist = Vec::new();
    for (sp, state) in spans.iter().zip(states.iter_mut()) {
        let keep = state.len() / h;
        let (first, n) = (sp.first_row, sp.n_tokens);
        // The span's conv inputs after the carried ones: `keep + n` rows, oldest first.
        hist.clear();
        hist.extend_from_slice(state);
        for t in 0..n {
            let row = bcx.row(first + t);
            let (b, x) = (&row[..h], &row[2 * h..]);
            hist.extend(b.iter().zip(x).map(|(b, x)| b * x));
        }
        let hist = &hist;
        out.as_mut_slice()[first * h..(first + n) * h]
            .par_chunks_mut(h)
            .enumerate()
            .for_each(|(t, o)| {
                let gate = &bcx.row(first + t)[h..2 * h];
                // Input row of tap 0 for token t: the window ends at the token itself.
                let base = keep + t + 1 - taps;
                for (c, (o, g)) in o.iter_mut().zip(gate).enumerate() {
                    let w = &kernel[c * taps..(c + 1) * taps];
                    let acc: f32 = w
                        .iter()
                        .enumerate()
                        .map(|(j, w)| w * hist[(base + j) * h + c])
                        .sum();
                    *o = g * acc;
                }
            });
        state.copy_from_slice(&hist[n * h..]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences in one step, one continuing from a carried state: each output is
    /// `c · Σ_j w[j] · u[t − (L−1) + j]` with `u = b · x`, computed by hand.
    #[test]
    fn matches_the_definition_and_carries_the_state() {
        let h = 2;
        // Rows [b | c | x]: sequence A has 2 tokens, B has 1.
        let rows = [
            [1.0, 2.0, 0.5, -2.0, 3.0, 4.0],
            [2.0, 1.0, 2.0, 2.0, 1.0, -3.0],
            [1.0, 1.0, 1.0, 1.0, 5.0, 6.0],
        ];
        let bcx = CpuTensor::from_vec(rows.concat(), 3, 3 * h).unwrap();
        // Three taps per channel.
        let kernel = [0.1, 0.2, 0.3, -0.5, 0.0, 1.0];
        let mut out = CpuTensor::from_vec(vec![0.0; 3 * h], 3, h).unwrap();
        let spans = [
            SeqSpan {
                first_row: 0,
                n_tokens: 2,
                first_pos: 0,
                blocks: &[],
            },
            SeqSpan {
                first_row: 2,
                n_tokens: 1,
                first_pos: 7,
                blocks: &[],
            },
        ];
        // A starts fresh (keep = 2, zeros); B carries u of its two previous tokens (keep = 3).
        let mut sa = vec![0.0; 2 * h];
        let mut sb = vec![9.0, 9.0, 1.0, 2.0, 3.0, 4.0];
        short_conv(&bcx, &kernel, &spans, &mut [&mut sa, &mut sb], &mut out).unwrap();
        // u of A: [3, 8], [2, -3]; of B: [5, 6].
        let want = [
            0.5 * (0.3 * 3.0),
            -2.0 * (1.0 * 8.0),
            2.0 * (0.2 * 3.0 + 0.3 * 2.0),
            2.0 * (0.0 * 8.0 + 1.0 * -3.0),
            1.0 * (0.1 * 1.0 + 0.2 * 3.0 + 0.3 * 5.0),
            1.0 * (-0.5 * 2.0 + 0.0 * 4.0 + 1.0 * 6.0),
        ];
        for (g, w) in out.as_slice().iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{:?} vs {want:?}", out.as_slice());
        }
        assert_eq!(sa, [3.0, 8.0, 2.0, -3.0]);
        assert_eq!(sb, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);

        // A state shorter than the kernel's reach is refused.
        let mut short = vec![0.0; h];
        let err = short_conv(&bcx, &kernel, &spans[..1], &mut [&mut short], &mut out);
        assert!(err.is_err());
    }
}
