//! `turbokv eval sensitivity`: which layers' (or, with `--heads`, which kv heads') keys and
//! values a KV spec's loss sits in, and a per-layer bit allocation from it.
//!
//! For every layer and side (keys, values) the probe moves that one width by each `--steps`
//! amount and measures the KL from a bf16 cache over calibration text — the built-in probe
//! texts by default (prose, code, dialogue, none of it in the evaluation set), one window of
//! at most `--ctx` tokens each. A move's figure of merit is ΔKL per bit of the whole cache;
//! `--budget` turns the moves into overrides greedily, assuming the layers' effects add up
//! (they are measured one at a time), so the proposal is a candidate to evaluate with
//! `eval ppl`, not a result.

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde::Serialize;
use turbokv_backend::Backend;
use turbokv_codec::{KvDtype, TqBits};

use crate::args::{EvalSensitivityArgs, cache_dir};
use crate::eval::{Acc, log_softmax_rows, score, window_logits};
use crate::generate::load;
use crate::kvspec::{KvDefaults, KvSpec, build_policy};

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The layer's key width.
    Key,
    /// The layer's value width.
    Value,
}

/// One probe: one layer's (or one kv head's) key or value width moved.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    /// The layer (among those with a KV cache).
    pub layer: usize,
    /// The kv head, when the probe moved one head's width (`--heads`) instead of the layer's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<usize>,
    /// Which width moved.
    pub side: Side,
    /// The layer's dtype in the probed spec.
    pub from: String,
    /// The layer's dtype in this probe.
    pub to: String,
    /// Change of the whole cache's bits per element (K and V averaged over every layer).
    pub delta_bits: f64,
    /// Change of the mean KL from bf16 over every probe position (negative = better).
    pub delta_kl: f64,
    /// The same per probe text, in `texts` order.
    pub delta_kl_per_text: Vec<f64>,
}

/// The probes' numbers that the allocation needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Move {
    /// Layer index.
    pub layer: usize,
    /// Which width.
    pub side: Side,
    /// The new width.
    pub to: TqBits,
    /// Δ bits per element of the whole cache.
    pub delta_bits: f64,
    /// Δ KL.
    pub delta_kl: f64,
}

/// `dtype` with its key or value width moved by `step` bits, if the result is a TurboQuant
/// width (1..=4 in half bits); `None` for int8, fp8 and 16-bit layers.
pub fn stepped(dtype: KvDtype, side: Side, step: f64) -> Option<(KvDtype, TqBits)> {
    let KvDtype::Tq {
        key_bits,
        value_bits,
    } = dtype
    else {
        return None;
    };
    let half = (step * 2.0).round();
    if half == 0.0 || (step * 2.0 - half).abs() > 1e-9 {
        return None;
    }
    let from = match side {
        Side::Key => key_bits,
        Side::Value => value_bits,
    };
    let to = i64::from(from.half_bits()) + half as i64;
    let to = TqBits::from_half_bits(u8::try_from(to).ok()?).ok()?;
    Some(match side {
        Side::Key => (
            KvDtype::Tq {
                key_bits: to,
                value_bits,
            },
            to,
        ),
        Side::Value => (
            KvDtype::Tq {
                key_bits,
                value_bits: to,
            },
            to,
        ),
    })
}

/// Greedy per-layer allocation: starting from the spec at `base_bits`, first takes the
/// cheapest width reductions (least ΔKL per bit saved) until the cache fits `budget`, then
/// repeatedly takes the increase with the most KL saved per bit, paying for it with the
/// cheapest reductions when it does not fit, as long as the exchange lowers the summed ΔKL.
/// Each (layer, side) moves at most once. Returns the chosen moves in the order taken.
pub fn allocate(moves: &[Move], base_bits: f64, budget: f64) -> Vec<Move> {
    const EPS: f64 = 1e-9;
    let mut chosen: Vec<Move> = Vec::new();
    let mut bits = base_bits;
    let free = |chosen: &[Move], m: &Move| {
        !chosen
            .iter()
            .any(|c| c.layer == m.layer && c.side == m.side)
    };
    let mut lowers: Vec<Move> = moves
        .iter()
        .copied()
        .filter(|m| m.delta_bits < 0.0)
        .collect();
    // Least KL lost per bit saved first.
    lowers.sort_by(|a, b| (a.delta_kl / -a.delta_bits).total_cmp(&(b.delta_kl / -b.delta_bits)));
    for m in &lowers {
        if bits <= budget + EPS {
            break;
        }
        if free(&chosen, m) {
            bits += m.delta_bits;
            chosen.push(*m);
        }
    }
    loop {
        let best = moves
            .iter()
            .filter(|m| m.delta_bits > 0.0 && m.delta_kl < 0.0 && free(&chosen, m))
            .max_by(|a, b| (-a.delta_kl / a.delta_bits).total_cmp(&(-b.delta_kl / b.delta_bits)))
            .copied();
        let Some(up) = best else { break };
        let mut pay: Vec<Move> = Vec::new();
        let mut after = bits + up.delta_bits;
        for m in &lowers {
            if after <= budget + EPS {
                break;
            }
            let other_side = !(m.layer == up.layer && m.side == up.side);
            if other_side && free(&chosen, m) && free(&pay, m) {
                after += m.delta_bits;
                pay.push(*m);
            }
        }
        let net = up.delta_kl + pay.iter().map(|m| m.delta_kl).sum::<f64>();
        if after > budget + EPS || net >= 0.0 {
            break;
        }
        bits = after;
        chosen.push(up);
        chosen.extend(pay);
    }
    chosen
}

/// The overrides of `moves` applied to `spec`, one `[layer:dtype]` per layer in layer order.
pub fn overrides(spec: &KvSpec, n_layers: usize, moves: &[Move]) -> Vec<(i64, KvDtype)> {
    let mut dtypes = spec.layer_dtypes(n_layers, &[]);
    let mut touched = vec![false; n_layers];
    for m in moves {
        if let KvDtype::Tq {
            key_bits,
            value_bits,
        } = dtypes[m.layer]
        {
            dtypes[m.layer] = match m.side {
                Side::Key => KvDtype::Tq {
                    key_bits: m.to,
                    value_bits,
                },
                Side::Value => KvDtype::Tq {
                    key_bits,
                    value_bits: m.to,
                },
            };
            touched[m.layer] = true;
        }
    }
    (0..n_layers)
        .filter(|&l| touched[l])
        .map(|l| (l as i64, dtypes[l]))
        .collect()
}

/// Runs the probe.
pub fn run(args: &EvalSensitivityArgs) -> Result<()> {
    crate::with_device!(&args.model.device, b => run_on(b, args))
}

/// The probe texts: the built-in ones, or `--text` files that share nothing with the
/// evaluation set.
fn probe_texts(given: &[std::path::PathBuf]) -> Result<Vec<(String, String)>> {
    if given.is_empty() {
        return Ok(turbokv_model::calibrate::PROBE_TEXTS
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect());
    }
    let eval_dir = cache_dir().join("data/eval");
    let mut eval_texts = Vec::new();
    if let Ok(dir) = std::fs::read_dir(&eval_dir) {
        for e in dir.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "txt") {
                eval_texts.push((p.clone(), std::fs::read_to_string(&p).unwrap_or_default()));
            }
        }
    }
    given
        .iter()
        .map(|path| {
            let body = std::fs::read_to_string(path)
                .with_context(|| format!("reading calibration text {}", path.display()))?;
            refuse_evaluation_text(path, &body, &eval_texts)?;
            let name = path.file_stem().map_or_else(
                || path.display().to_string(),
                |s| s.to_string_lossy().into(),
            );
            Ok((name, body))
        })
        .collect()
}

/// Errors when `body` (from `path`) shares a passage with one of `eval_texts`.
fn refuse_evaluation_text(
    path: &Path,
    body: &str,
    eval_texts: &[(std::path::PathBuf, String)],
) -> Result<()> {
    for (eval_path, eval_body) in eval_texts {
        if let Some(p) = turbokv_model::calibrate::shared_passage(body, eval_body) {
            bail!(
                "{} shares text with the evaluation text {} (\"{p}…\"); calibrate on text the \
                 evaluation does not use",
                path.display(),
                eval_path.display()
            );
        }
    }
    Ok(())
}

fn run_on<B: Backend>(backend: B, args: &EvalSensitivityArgs) -> Result<()> {
    ensure!(
        args.ctx >= 2,
        "--ctx {}: a probe window needs 2 tokens",
        args.ctx
    );
    ensure!(
        !(args.heads && args.budget.is_some()),
        "--budget allocates whole layers; with --heads the probe ranks kv heads, whose \
         overrides ([LAYER.HEAD:DTYPE]) you choose from the ranking"
    );
    let spec = KvSpec::parse(&args.kv, KvDefaults::default())?;
    let label = spec.label(&args.kv);
    let texts = probe_texts(&args.text)?;
    let cache = crate::args::CacheArgs::plain("bf16", Some(args.ctx));
    let loaded = load(backend, &args.model, &cache)?;
    let cfg = loaded.model.transformer.config();
    let (n_layers, head_dim, vocab) = (cfg.kv_layers(), cfg.head_dim, cfg.vocab_size);
    let kv_heads = cfg.n_kv_heads;
    let mut cal = None;
    let base_policy = build_policy(
        &loaded.model.transformer,
        &loaded.tokenizer,
        &spec,
        &label,
        (args.ctx, &[]),
        &mut cal,
    )?;
    let mut windows = Vec::with_capacity(texts.len());
    for (name, body) in &texts {
        let mut ids = loaded.tokenizer.encode(body, false, false)?;
        ids.truncate(args.ctx);
        ensure!(
            ids.len() >= 2,
            "probe text {name} holds fewer than 2 tokens"
        );
        let reference = window_logits(
            &loaded,
            KvDtype::Bf16,
            &turbokv_cache::KvPolicy::default(),
            &ids,
            0,
        )?;
        windows.push((name.clone(), log_softmax_rows(&reference, vocab), ids));
    }
    let kl_of = |dtype: KvDtype, policy: &turbokv_cache::KvPolicy| -> Result<Vec<f64>> {
        windows
            .iter()
            .map(|(_, ref_lp, ids)| {
                let lp = log_softmax_rows(&window_logits(&loaded, dtype, policy, ids, 0)?, vocab);
                let mut acc = Acc::default();
                score(&lp, ref_lp, ids, vocab, &mut acc);
                Ok(acc.kl / acc.n as f64)
            })
            .collect()
    };
    let positions: Vec<f64> = windows
        .iter()
        .map(|(_, _, ids)| (ids.len() - 1) as f64)
        .collect();
    let pooled = |kls: &[f64]| {
        kls.iter().zip(&positions).map(|(k, n)| k * n).sum::<f64>() / positions.iter().sum::<f64>()
    };
    let base_kl = kl_of(spec.dtype, &base_policy)?;
    let base_bits = spec.bits_per_element((head_dim, kv_heads), args.budget_ctx, n_layers, &[]);
    eprintln!(
        "turbokv: probing {label} ({base_bits:.3} bits/el at ctx {}): KL {:.5} over {} texts",
        args.budget_ctx,
        pooled(&base_kl),
        windows.len()
    );
    // What each probe moves: a whole layer, or with --heads one kv head of it.
    let targets: Vec<(usize, Option<usize>, KvDtype)> = if args.heads {
        let heads = spec.head_dtypes(n_layers, kv_heads, &[]);
        (heads.iter().enumerate())
            .flat_map(|(layer, hs)| {
                hs.iter()
                    .enumerate()
                    .map(move |(h, &d)| (layer, Some(h), d))
            })
            .collect()
    } else {
        let layers = spec.layer_dtypes(n_layers, &[]).into_iter().enumerate();
        layers.map(|(layer, d)| (layer, None, d)).collect()
    };
    let mut probes = Vec::new();
    let mut moves = Vec::new();
    let bar = indicatif::ProgressBar::new((targets.len() * 2 * args.steps.len()) as u64);
    for &(layer, head, from) in &targets {
        for side in [Side::Key, Side::Value] {
            for &step in &args.steps {
                bar.inc(1);
                let Some((to, bits)) = stepped(from, side, step) else {
                    continue;
                };
                // A head takes whole widths only (they share the layer's rotation).
                if head.is_some() && crate::kvspec::has_fractional_width(to) {
                    continue;
                }
                let (probe_spec, extra) = match head {
                    None => (spec.clone(), vec![(layer as i64, to)]),
                    Some(h) => {
                        let mut s = spec.clone();
                        s.heads.push((layer as i64, h, to));
                        (s, Vec::new())
                    }
                };
                let policy = build_policy(
                    &loaded.model.transformer,
                    &loaded.tokenizer,
                    &probe_spec,
                    &label,
                    (args.ctx, &extra),
                    &mut cal,
                )?;
                let kl = kl_of(spec.dtype, &policy)?;
                let delta_bits = probe_spec.bits_per_element(
                    (head_dim, kv_heads),
                    args.budget_ctx,
                    n_layers,
                    &extra,
                ) - base_bits;
                let per_text: Vec<f64> = kl.iter().zip(&base_kl).map(|(a, b)| a - b).collect();
                let delta_kl = pooled(&kl) - pooled(&base_kl);
                if head.is_none() {
                    moves.push(Move {
                        layer,
                        side,
                        to: bits,
                        delta_bits,
                        delta_kl,
                    });
                }
                probes.push(Probe {
                    layer,
                    head,
                    side,
                    from: from.to_string(),
                    to: to.to_string(),
                    delta_bits,
                    delta_kl,
                    delta_kl_per_text: per_text,
                });
            }
        }
    }
    bar.finish_and_clear();
    let names: Vec<&str> = windows.iter().map(|(n, _, _)| n.as_str()).collect();
    if args.heads {
        // Ranked: the heads whose width moves KL most per bit first.
        probes.sort_by(|a, b| {
            let merit = |p: &Probe| (p.delta_kl / p.delta_bits).abs();
            merit(b).total_cmp(&merit(a))
        });
    }
    print_probes(&label, &probes, &names);
    let proposal = args.budget.map(|budget| {
        let chosen = allocate(&moves, base_bits, budget);
        let layers = overrides(&spec, n_layers, &chosen);
        let text: String = layers.iter().map(|(l, d)| format!("[{l}:{d}]")).collect();
        let bits = spec.bits_per_element((head_dim, kv_heads), args.budget_ctx, n_layers, &layers);
        let predicted: f64 = chosen.iter().map(|m| m.delta_kl).sum();
        println!(
            "proposal within {budget} bits/el at ctx {}: --kv '{}{text}' ({bits:.3} bits/el, \
             predicted KL {:.5} → {:.5}, one-at-a-time effects summed)",
            args.budget_ctx,
            args.kv.trim(),
            pooled(&base_kl),
            pooled(&base_kl) + predicted
        );
        serde_json::json!({
            "budget": budget, "overrides": text, "bits_per_element": bits,
            "predicted_kl": pooled(&base_kl) + predicted,
        })
    });
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "model": loaded.model.name, "kv": label, "ctx": args.ctx,
            "texts": names, "base_kl": pooled(&base_kl), "base_kl_per_text": base_kl,
            "base_bits_per_element": base_bits, "budget_ctx": args.budget_ctx,
            "probes": probes, "proposal": proposal,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn print_probes(label: &str, probes: &[Probe], texts: &[&str]) {
    let what = if probes.iter().any(|p| p.head.is_some()) {
        "one kv head's (layer.head) keys or values moved, most ΔKL per bit first"
    } else {
        "one layer's keys or values moved"
    };
    println!("{label}: {what}, ΔKL from bf16 (negative = better)");
    print!(
        "{:>5} {:>5} {:>6} {:>6} {:>9} {:>10} {:>11}",
        "layer", "side", "from", "to", "Δbits", "ΔKL", "ΔKL/bit"
    );
    for t in texts {
        print!(" {:>10}", format!("ΔKL {t}"));
    }
    println!();
    for p in probes {
        print!(
            "{:>5} {:>5} {:>6} {:>6} {:>+9.4} {:>+10.5} {:>+11.4}",
            match p.head {
                Some(h) => format!("{}.{h}", p.layer),
                None => p.layer.to_string(),
            },
            match p.side {
                Side::Key => "K",
                Side::Value => "V",
            },
            p.from,
            p.to,
            p.delta_bits,
            p.delta_kl,
            p.delta_kl / p.delta_bits
        );
        for d in &p.delta_kl_per_text {
            print!(" {d:>+10.5}");
        }
        println!();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tq(s: &str) -> KvDtype {
        s.parse().unwrap()
    }

    #[test]
    fn a_step_moves_one_side_within_the_turboquant_widths() {
        assert_eq!(stepped(tq("k4v2"), Side::Value, 1.0).unwrap().0, tq("k4v3"));
        assert_eq!(stepped(tq("k4v2"), Side::Key, -1.0).unwrap().0, tq("k3v2"));
        assert_eq!(stepped(tq("tq2"), Side::Key, 0.5).unwrap().0, tq("k2.5v2"));
        assert_eq!(stepped(tq("k4v2"), Side::Value, 2.0).unwrap().0, tq("tq4"));
        // Past 4 or below 1 bit, a quarter bit, no step, or not TurboQuant: no probe.
        assert_eq!(stepped(tq("k4v2"), Side::Key, 1.0), None);
        assert_eq!(stepped(tq("k4v1"), Side::Value, -1.0), None);
        assert_eq!(stepped(tq("k4v2"), Side::Value, 0.25), None);
        assert_eq!(stepped(tq("k4v2"), Side::Value, 0.0), None);
        assert_eq!(stepped(KvDtype::Int8, Side::Value, 1.0), None);
    }

    fn mv(layer: usize, side: Side, to: &str, delta_bits: f64, delta_kl: f64) -> Move {
        Move {
            layer,
            side,
            to: to.parse().unwrap(),
            delta_bits,
            delta_kl,
        }
    }

    #[test]
    fn allocation_trades_cheap_bits_for_valuable_ones_within_the_budget() {
        let moves = [
            mv(1, Side::Value, "4", 2.0, -10.0), // the best buy: 5 per bit
            mv(2, Side::Value, "3", 1.0, -1.0),  // 1 per bit
            mv(3, Side::Key, "3", -1.0, 0.5),    // cheapest saving
            mv(4, Side::Key, "3", -1.0, 3.0),    // dearer saving
            mv(5, Side::Value, "1", -1.0, 20.0), // too dear to take
        ];
        // At the budget: layer 1's values are paid for with layer 3's and layer 4's keys
        // (10 saved for 3.5 lost); layer 2's gain (1) would cost the 20 of layer 5: stop.
        let chosen = allocate(&moves, 4.0, 4.0);
        let picked: Vec<usize> = chosen.iter().map(|m| m.layer).collect();
        assert_eq!(picked, [1, 3, 4]);
        let bits: f64 = 4.0 + chosen.iter().map(|m| m.delta_bits).sum::<f64>();
        assert!(bits <= 4.0 + 1e-9, "{bits}");
        // With room to spare, increases are taken by value per bit without any saving.
        let roomy = allocate(&moves, 4.0, 7.0);
        let picked: Vec<usize> = roomy.iter().map(|m| m.layer).collect();
        assert_eq!(picked, [1, 2]);
        // Over the budget from the start, the cheapest savings come first.
        let tight = allocate(&moves[2..], 5.0, 4.0);
        assert_eq!(tight.iter().map(|m| m.layer).collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn overrides_merge_both_sides_of_a_layer() {
        let spec = KvSpec::parse("k4v2@w15s1", KvDefaults::default()).unwrap();
        let chosen = [
            mv(3, Side::Key, "3", -0.5, 0.1),
            mv(1, Side::Value, "4", 0.5, -1.0),
            mv(3, Side::Value, "3", 0.5, -0.2),
        ];
        let o = overrides(&spec, 6, &chosen);
        assert_eq!(o, [(1, tq("tq4")), (3, tq("tq3"))]);
    }

    #[test]
    fn a_calibration_text_from_the_evaluation_set_is_refused() {
        let eval = vec![(
            std::path::PathBuf::from("/cache/data/eval/code.txt"),
            "# file: a.py\nimport numpy as np\n\ndef frobnicate(matrix, axis=0):\n    return matrix.sum(axis)\n".to_string(),
        )];
        let copied = "def frobnicate(matrix, axis=0):\n    return matrix.sum(axis)\n";
        let err = refuse_evaluation_text(Path::new("mine.txt"), copied, &eval).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("mine.txt") && msg.contains("code.txt"),
            "{msg}"
        );
        let own = "def something_else(x):\n    return x * 2\n";
        refuse_evaluation_text(Path::new("mine.txt"), own, &eval).unwrap();
    }
}
