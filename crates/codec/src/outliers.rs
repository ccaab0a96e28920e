//! The outlier-channel split behind fractional widths (2.5 = half the channels at 3 bits).
//!
//! Which channels are "outliers" is not specified by the paper; here it is an explicit,
//! deterministic list that is part of the cache identity (stored in snapshots). The usual
//! source is per-channel key energy from a calibration pass: [`OutlierChannels::from_channel_energy`]
//! takes the `n` channels with the largest energy, ties broken by the lower index. Without
//! calibration, [`OutlierChannels::leading`] takes channels `0..n`.

use crate::error::{Error, Result};

/// A sorted set of distinct channel indices below `head_dim`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OutlierChannels {
    head_dim: usize,
    channels: Vec<u16>,
}

impl OutlierChannels {
    /// From an explicit list (any order; must be distinct and `< head_dim`).
    pub fn new(head_dim: usize, channels: &[u16]) -> Result<Self> {
        if head_dim > usize::from(u16::MAX) + 1 {
            return Err(Error::InvalidOutliers {
                head_dim,
                reason: "head_dim above 65536",
            });
        }
        let mut sorted = channels.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::InvalidOutliers {
                head_dim,
                reason: "duplicate channel",
            });
        }
        if sorted.last().is_some_and(|&c| usize::from(c) >= head_dim) {
            return Err(Error::InvalidOutliers {
                head_dim,
                reason: "channel index out of range",
            });
        }
        Ok(OutlierChannels {
            head_dim,
            channels: sorted,
        })
    }

    /// The `n_outliers` channels with the largest energy (e.g. mean squared key value per
    /// channel); ties, and NaNs (treated as −∞), go to the lower index.
    pub fn from_channel_energy(energy: &[f32], n_outliers: usize) -> Result<Self> {
        if n_outliers > energy.len() {
            return Err(Error::InvalidOutliers {
                head_dim: energy.len(),
                reason: "more outliers than channels",
            });
        }
        let key = |i: usize| {
            let e = energy[i];
            if e.is_nan() { f32::NEG_INFINITY } else { e }
        };
        let mut idx: Vec<usize> = (0..energy.len()).collect();
        idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        let chosen: Vec<u16> = idx[..n_outliers].iter().map(|&i| i as u16).collect();
        Self::new(energy.len(), &chosen)
    }

    /// Channels `0..n_outliers` (the default without calibration).
    pub fn leading(head_dim: usize, n_outliers: usize) -> Result<Self> {
        let n = n_outliers.min(head_dim);
        let chosen: Vec<u16> = (0..n).map(|i| i as u16).collect();
        Self::new(head_dim, &chosen)
    }

    /// The head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The outlier channels, increasing.
    pub fn channels(&self) -> &[u16] {
        &self.channels
    }

    /// The remaining channels, increasing.
    pub fn complement(&self) -> Vec<u16> {
        let mut mark = vec![false; self.head_dim];
        for &c in &self.channels {
            mark[usize::from(c)] = true;
        }
        (0..self.head_dim)
            .filter(|&i| !mark[i])
            .map(|i| i as u16)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn energy_selection_is_deterministic_with_ties() {
        let e = [1.0, 5.0, 3.0, 5.0, f32::NAN, 0.5];
        let o = OutlierChannels::from_channel_energy(&e, 3).unwrap();
        assert_eq!(o.channels(), &[1, 2, 3]);
        assert_eq!(o.complement(), vec![0, 4, 5]);
        let o = OutlierChannels::from_channel_energy(&[2.0; 4], 2).unwrap();
        assert_eq!(o.channels(), &[0, 1]);
        assert!(OutlierChannels::from_channel_energy(&e, 7).is_err());
    }

    #[test]
    fn validates() {
        assert!(OutlierChannels::new(4, &[0, 0]).is_err());
        assert!(OutlierChannels::new(4, &[4]).is_err());
        assert_eq!(
            OutlierChannels::new(4, &[3, 1]).unwrap().channels(),
            &[1, 3]
        );
        assert_eq!(
            OutlierChannels::leading(8, 3).unwrap().channels(),
            &[0, 1, 2]
        );
    }
}
