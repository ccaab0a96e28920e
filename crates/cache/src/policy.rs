//! What a KV cache keeps beyond its default dtype: per-layer dtype overrides, the tokens
//! kept at full precision beside the codes, the key mode, the per-head centers and the
//! outlier channels of fractional widths.

use std::sync::Arc;

use turbokv_codec::{KeyMode, KvDtype, NormMode};

use crate::{CacheError, KvCenters, KvLayout, KvOutliers, KvWindow};

/// A cache policy applied on top of a uniform [`KvLayout`]; part of the cache identity.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvPolicy {
    /// Sink and recent-window tokens attended at f16 in compressed layers.
    pub window: KvWindow,
    /// `(layer, dtype)`: a layer index, negative from the end (`-1` = last layer).
    pub layers: Vec<(i64, KvDtype)>,
    /// `(layer, kv head, dtype)`: one head's dtype, applied after `layers`. Both the layer's
    /// dtype and this one must be whole TurboQuant widths (see
    /// [`crate::LayerKv::head_dtypes`]).
    pub heads: Vec<(i64, usize, KvDtype)>,
    /// How TurboQuant keys are coded (`mse` or `prod`); goes to `layout.codec.key_mode`.
    pub key_mode: KeyMode,
    /// What TurboQuant's stored norms mean; goes to `layout.codec.norm`. `Corrected` rescales
    /// each decoded vector to the true norm, which the MSE codebook shrinks (keys' scores by
    /// about 1 − D(b): a flatter softmax).
    pub norm: NormMode,
    /// Per-head mean key and value subtracted before encoding (from a calibration pass);
    /// `None` = no centering. Must match the layout's layers, kv heads and head dim.
    pub centers: Option<Arc<KvCenters>>,
    /// Per-layer outlier channels for fractional widths (from a calibration pass); `None` =
    /// the codec's default (leading channels). Must cover every layer at the layout's head dim.
    pub outliers: Option<Arc<KvOutliers>>,
}

impl KvPolicy {
    /// Parses `--kv-layers` text: `0:bf16,-1:bf16` (empty text = no overrides); see
    /// [`Self::parse_override`] for one item.
    pub fn parse_layers(text: &str) -> Result<Vec<(i64, KvDtype)>, CacheError> {
        let mut out = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            out.extend(Self::parse_override(item)?);
        }
        Ok(out)
    }

    /// Parses one head override, `LAYER.HEAD:DTYPE` (a negative layer counts from the end).
    pub fn parse_head_override(item: &str) -> Result<(i64, usize, KvDtype), CacheError> {
        let item = item.trim();
        let bad = |why: String| {
            CacheError::InvalidLayout(format!(
                "head override `{item}`: {why} (expected LAYER.HEAD:DTYPE, e.g. 18.2:k3v2)"
            ))
        };
        let (target, d) = item.split_once(':').ok_or_else(|| bad("no `:`".into()))?;
        let (l, h) = target
            .split_once('.')
            .ok_or_else(|| bad("no `.` between layer and head".into()))?;
        let layer = l
            .trim()
            .parse::<i64>()
            .map_err(|e| bad(format!("layer `{l}`: {e}")))?;
        let head = h
            .trim()
            .parse::<usize>()
            .map_err(|e| bad(format!("head `{h}`: {e}")))?;
        let dtype = d
            .trim()
            .parse::<KvDtype>()
            .map_err(|e| bad(format!("dtype `{d}`: {e}")))?;
        Ok((layer, head, dtype))
    }

    /// Parses one override, `LAYER:DTYPE` or `FIRST-LAST:DTYPE` (an inclusive range of
    /// non-negative layers), into its `(layer, dtype)` pairs; a negative layer counts from
    /// the end (`-1:bf16` = the last layer).
    pub fn parse_override(item: &str) -> Result<Vec<(i64, KvDtype)>, CacheError> {
        let item = item.trim();
        let bad = |why: String| {
            CacheError::InvalidLayout(format!(
                "layer override `{item}`: {why} (expected LAYER:DTYPE or FIRST-LAST:DTYPE, e.g. \
                 0:bf16, -1:bf16, 2-5:k4v3)"
            ))
        };
        let (l, d) = item.split_once(':').ok_or_else(|| bad("no `:`".into()))?;
        let l = l.trim();
        let dtype = d
            .trim()
            .parse::<KvDtype>()
            .map_err(|e| bad(format!("dtype `{d}`: {e}")))?;
        let int = |t: &str| {
            t.trim()
                .parse::<i64>()
                .map_err(|e| bad(format!("layer `{t}`: {e}")))
        };
        // `-1` is one layer from the end; `2-5` (no leading sign) is a range.
        let (first, last) = match l.split_once('-') {
            Some((a, b)) if !a.trim().is_empty() => {
                let (a, b) = (int(a)?, int(b)?);
                if b < a {
                    return Err(bad(format!("range {a}-{b} is empty")));
                }
                (a, b)
            }
            _ => {
                let one = int(l)?;
                (one, one)
            }
        };
        Ok((first..=last).map(|i| (i, dtype)).collect())
    }

    /// Applies the policy to `layout`; a layer outside `-n..n` is an error naming the range.
    pub fn apply(&self, layout: &mut KvLayout) -> Result<(), CacheError> {
        let n = layout.layers.len() as i64;
        for &(layer, dtype) in &self.layers {
            let idx = if layer < 0 { n + layer } else { layer };
            if !(0..n).contains(&idx) {
                return Err(CacheError::InvalidLayout(format!(
                    "layer override {layer}:{dtype}: the model has {n} layers with a KV cache (conv layers have none), valid layers are 0..={} or -{n}..=-1",
                    n - 1
                )));
            }
            layout.layers[idx as usize].dtype = dtype;
        }
        for &(layer, head, dtype) in &self.heads {
            let idx = if layer < 0 { n + layer } else { layer };
            let heads = layout.kv_heads;
            let bad = |why: String| {
                CacheError::InvalidLayout(format!("head override {layer}.{head}:{dtype}: {why}"))
            };
            if !(0..n).contains(&idx) {
                return Err(bad(format!(
                    "the model has {n} layers with a KV cache, valid layers are 0..={} or -{n}..=-1",
                    n - 1
                )));
            }
            if head >= heads {
                return Err(bad(format!(
                    "each layer has {heads} kv heads, valid heads are 0..={}",
                    heads - 1
                )));
            }
            let l = &mut layout.layers[idx as usize];
            // Whole TurboQuant widths share one rotation of the head dim; fractional ones
            // rotate their outlier and ordinary channels apart, so a query has another basis.
            let whole_tq = |d: KvDtype| {
                matches!(d, KvDtype::Tq { key_bits, value_bits }
                    if !key_bits.is_fractional() && !value_bits.is_fractional())
            };
            if !whole_tq(l.dtype) || !whole_tq(dtype) {
                return Err(bad(format!(
                    "layer {idx} is {}; a head may take another whole TurboQuant width (tq2, \
                     k3v2, tq4, …) only in a layer of whole TurboQuant widths, whose rotation \
                     its heads share",
                    l.dtype
                )));
            }
            if l.head_dtypes.is_empty() {
                l.head_dtypes = vec![l.dtype; heads];
            }
            l.head_dtypes[head] = dtype;
        }
        for l in &mut layout.layers {
            if l.head_dtypes.iter().all(|&d| d == l.dtype) {
                l.head_dtypes.clear();
            }
        }
        if let Some(c) = &self.centers {
            let (layers, heads, dim) = (layout.layers.len(), layout.kv_heads, layout.head_dim);
            let want = layers * heads * dim;
            if c.kv_heads != heads
                || c.head_dim != dim
                || c.key.len() != want
                || c.value.len() != want
            {
                return Err(CacheError::InvalidLayout(format!(
                    "KV centers cover {} layers × {} kv heads × head dim {} ({} key, {} value values) \
                     but the cache has {layers} × {heads} × {dim}",
                    c.layers(),
                    c.kv_heads,
                    c.head_dim,
                    c.key.len(),
                    c.value.len()
                )));
            }
        }
        if let Some(o) = &self.outliers {
            let (layers, dim) = (layout.layers.len(), layout.head_dim);
            let fits = |sets: &[turbokv_codec::OutlierChannels]| {
                sets.len() == layers && sets.iter().all(|c| c.head_dim() == dim)
            };
            if !fits(&o.key) || !fits(&o.value) {
                return Err(CacheError::InvalidLayout(format!(
                    "outlier channels cover {} key / {} value layers but the cache has {layers} \
                     layers of head dim {dim}",
                    o.key.len(),
                    o.value.len()
                )));
            }
            for ((l, k), v) in layout.layers.iter_mut().zip(&o.key).zip(&o.value) {
                l.key_outliers = Some(k.clone());
                l.value_outliers = Some(v.clone());
            }
        }
        layout.window = self.window;
        layout.codec.key_mode = self.key_mode;
        layout.codec.norm = self.norm;
        layout.centers = self.centers.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WindowCopies;

    fn layout() -> KvLayout {
        KvLayout::uniform(4, 2, 64, "tq3".parse().unwrap(), 16, 64).unwrap()
    }

    #[test]
    fn overrides_index_from_both_ends() {
        let mut l = layout();
        let p = KvPolicy {
            layers: KvPolicy::parse_layers("0:bf16, -1:int8").unwrap(),
            ..Default::default()
        };
        p.apply(&mut l).unwrap();
        let names: Vec<String> = l.layers.iter().map(|x| x.dtype.to_string()).collect();
        assert_eq!(names, ["bf16", "tq3", "tq3", "int8"]);
    }

    #[test]
    fn a_range_overrides_each_of_its_layers_and_later_overrides_win() {
        let mut l = layout();
        let p = KvPolicy {
            layers: KvPolicy::parse_layers("1-3:k4v2,-1:bf16").unwrap(),
            ..Default::default()
        };
        assert_eq!(p.layers.len(), 4);
        p.apply(&mut l).unwrap();
        let names: Vec<String> = l.layers.iter().map(|x| x.dtype.to_string()).collect();
        assert_eq!(names, ["tq3", "k4v2", "k4v2", "bf16"]);
    }

    #[test]
    fn a_layer_outside_the_model_is_refused_with_the_valid_range() {
        for bad in ["4:bf16", "-5:bf16"] {
            let p = KvPolicy {
                layers: KvPolicy::parse_layers(bad).unwrap(),
                ..Default::default()
            };
            let err = p.apply(&mut layout()).unwrap_err().to_string();
            assert!(err.contains("0..=3") && err.contains("-4..=-1"), "{err}");
        }
    }

    #[test]
    fn key_mode_norm_and_centers_reach_the_layout() {
        let mut l = layout();
        let n = 4 * 2 * 64;
        let centers = Arc::new(KvCenters {
            kv_heads: 2,
            head_dim: 64,
            key: vec![0.5; n],
            value: vec![-0.5; n],
        });
        assert_eq!(l.codec.norm, NormMode::Exact);
        let p = KvPolicy {
            key_mode: KeyMode::Prod,
            norm: NormMode::Corrected,
            centers: Some(centers.clone()),
            ..Default::default()
        };
        p.apply(&mut l).unwrap();
        assert_eq!(l.codec.key_mode, KeyMode::Prod);
        assert_eq!(l.codec.norm, NormMode::Corrected);
        assert_eq!(l.centers.as_deref(), Some(&*centers));
        assert_eq!(l.centers.as_ref().unwrap().key(3, 1).unwrap().len(), 64);
    }

    #[test]
    fn centers_of_another_shape_are_refused() {
        let bad = Arc::new(KvCenters {
            kv_heads: 2,
            head_dim: 64,
            key: vec![0.0; 3 * 2 * 64],
            value: vec![0.0; 3 * 2 * 64],
        });
        let p = KvPolicy {
            centers: Some(bad),
            ..Default::default()
        };
        let err = p.apply(&mut layout()).unwrap_err().to_string();
        assert!(
            err.contains("3 layers") && err.contains("4 × 2 × 64"),
            "{err}"
        );
    }

    #[test]
    fn outliers_reach_every_layer_and_a_wrong_count_is_refused() {
        use turbokv_codec::OutlierChannels;
        let set = |first: u16| OutlierChannels::new(64, &(first..first + 32).collect::<Vec<_>>());
        let key: Vec<_> = (0..4).map(|l| set(l).unwrap()).collect();
        let value: Vec<_> = (0..4).map(|l| set(32 - l).unwrap()).collect();
        let p = KvPolicy {
            outliers: Some(Arc::new(crate::KvOutliers {
                key: key.clone(),
                value: value.clone(),
            })),
            ..Default::default()
        };
        let mut l = layout();
        p.apply(&mut l).unwrap();
        for i in 0..4 {
            let o = l.codec_options(i);
            assert_eq!(o.key_outliers.as_ref(), Some(&key[i]));
            assert_eq!(o.value_outliers.as_ref(), Some(&value[i]));
        }
        let short = KvPolicy {
            outliers: Some(Arc::new(crate::KvOutliers {
                key: key[..3].to_vec(),
                value,
            })),
            ..Default::default()
        };
        let err = short.apply(&mut layout()).unwrap_err().to_string();
        assert!(err.contains("3 key") && err.contains("4 layers"), "{err}");
    }

    #[test]
    fn malformed_overrides_are_errors() {
        for bad in ["0", "x:bf16", "0:zz9", "3-1:bf16", "1-:bf16", "1-x:bf16"] {
            assert!(KvPolicy::parse_layers(bad).is_err(), "{bad}");
        }
        let empty = KvPolicy::parse_layers("5-2:bf16").unwrap_err().to_string();
        assert!(empty.contains("5-2 is empty"), "{empty}");
        assert!(KvPolicy::parse_layers("").unwrap().is_empty());
    }

    #[test]
    fn window_membership_and_its_honest_bit_cost() {
        let w = KvWindow {
            recent: 4,
            sinks: 1,
            ..Default::default()
        };
        let exact: Vec<usize> = (0..10).filter(|&p| w.is_exact(9, p)).collect();
        assert_eq!(exact, [0, 6, 7, 8, 9]);
        // 5 f16 tokens over 1024: 16·5/1024 bits per element; capped by the context.
        assert!((w.bits_overhead(1024, 64) - 0.078125).abs() < 1e-12);
        assert_eq!(w.bits_overhead(2, 64), 16.0);
        // int8 copies: 8 bits and a 16-bit step per vector of 64 (128) elements.
        let w8 = KvWindow {
            copies: WindowCopies::Int8,
            ..w
        };
        assert!((w8.bits_overhead(1024, 64) - 8.25 * 5.0 / 1024.0).abs() < 1e-12);
        assert_eq!(w8.bits_overhead(2, 128), 8.125);
    }

    #[test]
    fn a_head_override_gives_one_head_its_dtype_after_the_layer_overrides() {
        let mut l = layout();
        let p = KvPolicy {
            layers: KvPolicy::parse_layers("2:tq2").unwrap(),
            heads: vec![
                KvPolicy::parse_head_override("2.1:k3v2").unwrap(),
                KvPolicy::parse_head_override("-1.0:tq4").unwrap(),
            ],
            ..Default::default()
        };
        p.apply(&mut l).unwrap();
        let d = |t: &str| t.parse::<KvDtype>().unwrap();
        assert!(l.layers[0].head_dtypes.is_empty() && l.layers[1].head_dtypes.is_empty());
        assert_eq!(l.layers[2].dtype, d("tq2"));
        assert_eq!(l.layers[2].head_dtypes, [d("tq2"), d("k3v2")]);
        assert_eq!(l.layers[3].head_dtype(0), d("tq4"));
        assert_eq!(l.layers[3].head_dtype(1), d("tq3"));
        // Two heads at 3 and 4 bits average 3.5 bits of codes (plus their norms).
        let plain = KvLayout::uniform(4, 2, 64, d("tq3"), 16, 64).unwrap();
        let mean = (plain.bytes_per_token(3)
            + KvLayout::uniform(4, 2, 64, d("tq4"), 16, 64)
                .unwrap()
                .bytes_per_token(3))
            / 2.0;
        assert!((l.bytes_per_token(3) - mean).abs() < 1e-9);
    }

    #[test]
    fn a_head_override_that_names_its_layers_dtype_leaves_the_layer_uniform() {
        let mut l = layout();
        let p = KvPolicy {
            heads: vec![KvPolicy::parse_head_override("1.0:tq3").unwrap()],
            ..Default::default()
        };
        p.apply(&mut l).unwrap();
        assert!(l.layers.iter().all(|x| x.head_dtypes.is_empty()));
    }

    #[test]
    fn bad_head_overrides_are_refused_with_what_is_valid() {
        for (item, want) in [
            ("4.0:tq2", "0..=3"),
            ("0.2:tq2", "0..=1"),
            ("0.1:int8", "TurboQuant"),
            ("0.1:tq3.5", "whole TurboQuant"),
        ] {
            let p = KvPolicy {
                heads: vec![KvPolicy::parse_head_override(item).unwrap()],
                ..Default::default()
            };
            let err = p.apply(&mut layout()).unwrap_err().to_string();
            assert!(err.contains(want) && err.contains(item), "{item}: {err}");
        }
        let bf16_layer = KvPolicy {
            layers: KvPolicy::parse_layers("0:bf16").unwrap(),
            heads: vec![KvPolicy::parse_head_override("0.0:tq2").unwrap()],
            ..Default::default()
        };
        let err = bf16_layer.apply(&mut layout()).unwrap_err().to_string();
        assert!(err.contains("layer 0 is bf16"), "{err}");
        for bad in ["3:tq2", "3.x:tq2", "a.1:tq2", "3.1:tq9", "3.1"] {
            let err = KvPolicy::parse_head_override(bad).unwrap_err().to_string();
            assert!(err.contains("LAYER.HEAD:DTYPE"), "{bad}: {err}");
        }
    }

    #[test]
    fn per_head_dtypes_change_the_cache_identity() {
        let mut a = layout();
        let mut b = layout();
        KvPolicy {
            heads: vec![KvPolicy::parse_head_override("1.0:k4v3").unwrap()],
            ..Default::default()
        }
        .apply(&mut b)
        .unwrap();
        let ia = crate::CacheIdentity::new(&[7; 32], &a);
        assert_ne!(ia, crate::CacheIdentity::new(&[7; 32], &b));
        KvPolicy::default().apply(&mut a).unwrap();
        assert_eq!(ia, crate::CacheIdentity::new(&[7; 32], &a));
    }
}
