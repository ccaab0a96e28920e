//! KV calibration: the mean post-RoPE key and the mean value of every (layer, kv head), and
//! the energy of every channel, measured once on a fixed text with a bf16 cache.
//!
//! Centering is exact: softmax ignores a shift shared by every key of a head, and attention
//! weights sum to one, so a shared value shift is added back once. What changes is what the
//! codec has to represent: on the demo model a large share of each key's energy is the common
//! direction (TURBOQUANT.md §6), which a centered cache does not spend bits on.
//!
//! The channel energies pick the outlier channels of fractional widths ([`KvCalibration::outliers`]):
//! splitting a vector into two independently rotated halves concentrates each half's coding
//! error in its own channels, so the half holding the high-energy channels — where queries put
//! their weight too — must be the one with the wider code.
//!
//! The pass is deterministic: a committed text ([`CALIBRATION_TEXT`]), the model's own
//! tokenizer, a bf16 cache, sums in f64 in token order. Position 0 is left out of the means:
//! the first token acts as an attention sink whose key and value are far from the others.

use std::time::Instant;

use turbokv_backend::Backend;
use turbokv_cache::{KvCenters, KvOutliers};
use turbokv_codec::{KvDtype, OutlierChannels};

use crate::ModelError;
use crate::session::{BLOCK_SIZE, PREFILL_CHUNK};
use crate::tokenizer::Tokenizer;
use crate::transformer::{LogitsFor, SeqInput, Transformer};

/// The fixed English text of the calibration pass (a few hundred tokens of ordinary prose:
/// narrative, description, dialogue, numbers). Changing it changes every centered cache's
/// identity.
pub const CALIBRATION_TEXT: &str = "\
The town sits where the river bends twice before it reaches the sea, and for most of its \
history it lived on what the water carried. In the spring the boats came down loaded with \
timber, wool and salted fish; in the autumn they went back up with grain, iron tools and \
news. The old market square still has the stone steps where the merchants stood to call \
their prices, and children sit there now to eat ice cream and watch the traffic.\n\n\
A map drawn in 1742 shows fourteen streets, two churches, a mill and a bridge of nine \
arches. The bridge was rebuilt after the flood of 1811, when the river rose almost four \
metres in a single night. People who remembered that night said the water was so quiet that \
nobody woke until it was already inside the houses.\n\n\
\"Do you think it could happen again?\" the teacher asked her class one morning.\n\
\"My grandfather says the new walls are high enough,\" said a boy near the window.\n\
\"Walls are only as good as the people who look after them,\" she answered, and wrote the \
word maintenance on the board.\n\n\
Today the town has about 23,000 inhabitants. The largest employers are the hospital, a \
company that makes precision parts for medical instruments, and the university, which \
opened a campus on the eastern bank in 1998. Students make up nearly a fifth of the \
population during term, and the cafes near the library are full from early morning until \
late at night.\n\n\
Scientists who study rivers describe them by their discharge, the volume of water that \
passes a point each second. Discharge depends on rainfall, on the shape of the valley, on \
the soil and on how much water is taken out for farms and cities. A river can change its \
course slowly over centuries, cutting into the outside of each bend and leaving sand and \
gravel on the inside, so that the loops grow wider until the river breaks through and \
leaves a lake behind.\n\n\
To make a simple bread, mix five hundred grams of flour with ten grams of salt, seven grams \
of yeast and about three hundred and twenty millilitres of warm water. Knead the dough for \
ten minutes, let it rise for an hour, shape it, let it rise again and bake it at two hundred \
and twenty degrees for thirty-five minutes. The crust should sound hollow when you tap it.\n\n\
In the evening the lights come on along the embankment one by one, and the river, which \
has seen all of this before, carries their reflections quietly towards the sea.";

/// What a calibration pass measured: the centers plus the statistics that judge them.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCalibration {
    /// Mean post-RoPE key and mean value per (layer, kv head), for `KvLayout::centers`.
    pub centers: KvCenters,
    /// Mean ‖k‖ per (layer, kv head), `[layers, kv_heads]`, over the same tokens.
    pub mean_key_norm: Vec<f32>,
    /// Mean ‖v‖ per (layer, kv head), `[layers, kv_heads]`.
    pub mean_value_norm: Vec<f32>,
    /// Mean x² per (layer, kv head, channel) of keys, `[layers, kv_heads, head_dim]`.
    pub key_energy: Vec<f32>,
    /// Mean x² per (layer, kv head, channel) of values.
    pub value_energy: Vec<f32>,
    /// Tokens the means are taken over (the calibration tokens less position 0).
    pub tokens: usize,
}

impl KvCalibration {
    /// ‖mean key‖ / mean ‖k‖ of (layer, head): 0 for keys with no common direction, 1 for
    /// keys that all point the same way.
    pub fn key_mean_fraction(&self, layer: usize, head: usize) -> f32 {
        let mu = self.centers.key(layer, head).map_or(0.0, norm);
        mu / self.mean_key_norm[layer * self.centers.kv_heads + head].max(f32::MIN_POSITIVE)
    }

    /// The outlier channels of every layer for fractional widths: the `head_dim / 2` channels
    /// with the largest energy summed over the layer's kv heads — of `x`, or of `x − μ` when
    /// the cache is `centered` (what the codec is given). Ties go to the lower channel.
    pub fn outliers(&self, centered: bool) -> Result<KvOutliers, ModelError> {
        let (heads, d) = (self.centers.kv_heads, self.centers.head_dim);
        let pick = |energy: &[f32], mean: &[f32]| -> Result<Vec<OutlierChannels>, ModelError> {
            energy
                .chunks_exact(heads * d)
                .zip(mean.chunks_exact(heads * d))
                .map(|(e, mu)| {
                    let mut per_channel = vec![0f32; d];
                    for (i, (&x2, &m)) in e.iter().zip(mu).enumerate() {
                        per_channel[i % d] += if centered { x2 - m * m } else { x2 };
                    }
                    OutlierChannels::from_channel_energy(&per_channel, d / 2)
                        .map_err(|e| ModelError::InvalidConfig(format!("outlier channels: {e}")))
                })
                .collect()
        };
        Ok(KvOutliers {
            key: pick(&self.key_energy, &self.centers.key)?,
            value: pick(&self.value_energy, &self.centers.value)?,
        })
    }

    /// ‖mean value‖ / mean ‖v‖ of (layer, head).
    pub fn value_mean_fraction(&self, layer: usize, head: usize) -> f32 {
        let mu = self.centers.value(layer, head).map_or(0.0, norm);
        mu / self.mean_value_norm[layer * self.centers.kv_heads + head].max(f32::MIN_POSITIVE)
    }
}

fn norm(v: &[f32]) -> f32 {
    v.iter().map(|x| x * x).sum::<f32>().sqrt()
}

/// The texts of the layer-sensitivity probe (`turbokv eval sensitivity`), by domain: the
/// calibration prose above, and original Python source and dialogue written for the probe, so
/// that bit allocation is decided on all three kinds of text the evaluation set holds without
/// seeing any of it. Like [`CALIBRATION_TEXT`], an evaluation text must share none of them.
pub const PROBE_TEXTS: &[(&str, &str)] = &[
    ("prose", CALIBRATION_TEXT),
    ("code", include_str!("calibrate_texts/probe_code.txt")),
    (
        "dialogue",
        include_str!("calibrate_texts/probe_dialogue.txt"),
    ),
];

/// The first passage of [`CALIBRATION_TEXT`] or of a [`PROBE_TEXTS`] text that `text`
/// contains, if any: an evaluation text must not share what the centers, outlier channels or
/// per-layer widths were measured on, or a cache would be scored on the text it was fitted
/// to. See [`shared_passage`].
pub fn calibration_passage_in(text: &str) -> Option<&'static str> {
    PROBE_TEXTS
        .iter()
        .find_map(|(_, calibration)| shared_passage(calibration, text))
}

/// The first passage of `calibration` that `text` contains, if any. A passage is the first
/// 48 bytes of one of `calibration`'s paragraphs (quotes and line breaks included), long
/// enough never to occur by chance; paragraphs shorter than 16 bytes are skipped (a lone
/// closing bracket or a blank-ish line would match anything).
pub fn shared_passage<'a>(calibration: &'a str, text: &str) -> Option<&'a str> {
    const PASSAGE: usize = 48;
    calibration
        .split("\n\n")
        .map(str::trim)
        .filter(|p| p.len() >= 16)
        .map(|p| {
            let mut end = PASSAGE.min(p.len());
            while !p.is_char_boundary(end) {
                end -= 1;
            }
            &p[..end]
        })
        .find(|p| text.contains(p))
}

/// [`CALIBRATION_TEXT`] in the model's tokens (with the tokenizer's BOS, as a prompt has).
pub fn calibration_tokens(tokenizer: &Tokenizer) -> Result<Vec<u32>, ModelError> {
    Ok(tokenizer.encode(CALIBRATION_TEXT, true, false)?)
}

/// Runs `model` over [`CALIBRATION_TEXT`] with a bf16 cache and returns the mean key and
/// value of every (layer, kv head). Logs progress with `tracing`.
pub fn calibrate_kv_centers<B: Backend>(
    model: &Transformer<B>,
    tokenizer: &Tokenizer,
) -> Result<KvCalibration, ModelError> {
    calibrate_kv_centers_on(model, &calibration_tokens(tokenizer)?)
}

/// [`calibrate_kv_centers`] over given tokens (at least two; position 0 is not counted).
pub fn calibrate_kv_centers_on<B: Backend>(
    model: &Transformer<B>,
    tokens: &[u32],
) -> Result<KvCalibration, ModelError> {
    let c = model.config();
    let (layers, heads, d) = (c.kv_layers(), c.n_kv_heads, c.head_dim);
    if tokens.len() < 2 {
        return Err(ModelError::InvalidConfig(format!(
            "KV calibration needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    let n = tokens.len().min(c.max_context);
    let tokens = &tokens[..n];
    let start = Instant::now();
    tracing::info!(
        tokens = n,
        layers,
        kv_heads = heads,
        head_dim = d,
        "calibrating KV centers"
    );
    let mut cache = model.new_cache(KvDtype::Bf16, BLOCK_SIZE, n, n)?;
    cache.add_sequence(0)?;
    let mut scratch = model.new_scratch()?;
    let mut logits = Vec::new();
    let k_off = c.n_heads * d;
    let v_off = k_off + heads * d;
    let width = v_off + heads * d;
    let cells = layers * heads;
    let mut k_sum = vec![0f64; cells * d];
    let mut v_sum = vec![0f64; cells * d];
    let mut k_norm = vec![0f64; cells];
    let mut v_norm = vec![0f64; cells];
    let mut k_sq = vec![0f64; cells * d];
    let mut v_sq = vec![0f64; cells * d];
    let mut pos = 0;
    for chunk in tokens.chunks(PREFILL_CHUNK) {
        let first = pos;
        let mut observe = |layer: usize, rows: &[f32]| {
            for (i, row) in rows.chunks_exact(width).enumerate() {
                if first + i == 0 {
                    continue;
                }
                for h in 0..heads {
                    let cell = layer * heads + h;
                    for (off, sum, sqsum, nsum) in [
                        (k_off, &mut k_sum, &mut k_sq, &mut k_norm),
                        (v_off, &mut v_sum, &mut v_sq, &mut v_norm),
                    ] {
                        let x = &row[off + h * d..off + (h + 1) * d];
                        let acc = &mut sum[cell * d..(cell + 1) * d];
                        let acc_sq = &mut sqsum[cell * d..(cell + 1) * d];
                        let mut sq = 0f64;
                        for ((a, a2), &xi) in acc.iter_mut().zip(acc_sq.iter_mut()).zip(x) {
                            let xi = xi as f64;
                            *a += xi;
                            *a2 += xi * xi;
                            sq += xi * xi;
                        }
                        nsum[cell] += sq.sqrt();
                    }
                }
            }
        };
        model.forward_observed(
            &[SeqInput {
                seq: 0,
                tokens: chunk,
            }],
            &mut cache,
            &mut scratch,
            LogitsFor::LastToken,
            &mut logits,
            &mut observe,
        )?;
        pos += chunk.len();
        tracing::debug!(done = pos, of = n, "KV calibration chunk");
    }
    let counted = (n - 1) as f64;
    let mean = |v: Vec<f64>| {
        v.into_iter()
            .map(|x| (x / counted) as f32)
            .collect::<Vec<_>>()
    };
    let cal = KvCalibration {
        centers: KvCenters {
            kv_heads: heads,
            head_dim: d,
            key: mean(k_sum),
            value: mean(v_sum),
        },
        mean_key_norm: mean(k_norm),
        mean_value_norm: mean(v_norm),
        key_energy: mean(k_sq),
        value_energy: mean(v_sq),
        tokens: n - 1,
    };
    let fractions: Vec<f32> = (0..layers)
        .flat_map(|l| (0..heads).map(move |h| (l, h)))
        .map(|(l, h)| cal.key_mean_fraction(l, h))
        .collect();
    tracing::info!(
        tokens = cal.tokens,
        key_mean_fraction_max = fractions.iter().copied().fold(0.0, f32::max),
        key_mean_fraction_avg = fractions.iter().sum::<f32>() / fractions.len() as f32,
        elapsed_ms = start.elapsed().as_millis() as u64,
        "KV centers calibrated (‖mean key‖ / mean ‖k‖ per head)"
    );
    Ok(cal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_evaluation_text_holding_a_calibration_passage_is_found() {
        let paragraph = CALIBRATION_TEXT.split("\n\n").nth(3).unwrap();
        let text = format!("Some other prose first.\n\n{paragraph}\n\nAnd after.");
        let found = calibration_passage_in(&text).expect("the paragraph is found");
        assert!(paragraph.starts_with(found) && found.len() >= 40, "{found}");
        // Ordinary text about the same things is not a match.
        let unrelated = "The town sits on a river. A map drawn in 1742 shows streets.";
        assert_eq!(calibration_passage_in(unrelated), None);
        assert_eq!(calibration_passage_in(""), None);
    }

    #[test]
    fn the_probe_texts_are_refused_as_evaluation_texts_too() {
        for (name, text) in PROBE_TEXTS {
            // A later paragraph of each probe text, embedded in other text.
            let paragraph = text.split("\n\n").last().unwrap().trim();
            let doc = format!("def unrelated():\n    pass\n\n{paragraph}\n");
            let found = calibration_passage_in(&doc).unwrap_or_else(|| panic!("{name}"));
            assert!(paragraph.starts_with(found), "{name}: {found}");
        }
        // Generic code is not a match: passages are whole paragraph openings, not lines.
        let generic = "import os\n\nclass Thing:\n    def __init__(self):\n        pass\n";
        assert_eq!(calibration_passage_in(generic), None);
        assert_eq!(
            shared_passage("ab\n\n}", "ab }"),
            None,
            "short paragraphs are skipped"
        );
    }
}
