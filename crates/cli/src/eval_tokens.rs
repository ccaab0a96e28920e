//! Which tokens carry a KV cache's loss (`eval ppl --token-report N`): per scored position the
//! next-token NLL above the bf16 cache's and the KL from it, summed by the kind of token
//! predicted, by where the position sits in its window and over positions that repeat an
//! earlier bigram (where the model can copy), how concentrated the KL is, and the N positions
//! with the most KL, each with the text before it.

use std::fmt::Write as _;

/// One scored position of one window.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenLoss {
    /// Index in the evaluated text's token ids of the token predicted.
    pub target_at: usize,
    /// Position of the predicting token in its window (0-based).
    pub pos: usize,
    /// NLL of the target under this cache minus under bf16 (nats).
    pub dnll: f64,
    /// KL(bf16 ‖ this cache) of the next-token distribution (nats).
    pub kl: f64,
}

/// Per position of a window scored by `eval::score`: the target is `window[t + 1]`.
/// `first` is the window's offset in the text's token ids.
pub(crate) fn token_losses(
    lp: &[f32],
    ref_lp: &[f32],
    window: &[u32],
    vocab: usize,
    first: usize,
) -> Vec<TokenLoss> {
    (0..window.len() - 1)
        .map(|t| {
            let row = &lp[t * vocab..(t + 1) * vocab];
            let rrow = &ref_lp[t * vocab..(t + 1) * vocab];
            let target = window[t + 1] as usize;
            TokenLoss {
                target_at: first + t + 1,
                pos: t,
                dnll: f64::from(rrow[target] - row[target]),
                kl: crate::eval::kl_row(rrow, row),
            }
        })
        .collect()
}

/// The kind of a token, by its decoded text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum TokenClass {
    /// Only whitespace: newlines, indentation.
    Whitespace,
    /// Starts a word: a space or newline, then a letter (or `_`).
    WordStart,
    /// Letters (or `_`) with no leading space: the middle or end of a word, an identifier's
    /// part.
    WordPiece,
    /// Digits, with or without a leading space.
    Number,
    /// Anything else: operators, brackets, quotes, punctuation.
    Symbol,
}

impl TokenClass {
    const ALL: [TokenClass; 5] = [
        TokenClass::Whitespace,
        TokenClass::WordStart,
        TokenClass::WordPiece,
        TokenClass::Number,
        TokenClass::Symbol,
    ];

    fn name(self) -> &'static str {
        match self {
            TokenClass::Whitespace => "whitespace",
            TokenClass::WordStart => "word start",
            TokenClass::WordPiece => "word piece",
            TokenClass::Number => "number",
            TokenClass::Symbol => "symbol",
        }
    }
}

/// The class of a token's decoded text.
pub(crate) fn classify(text: &str) -> TokenClass {
    let body = text.trim_start();
    if body.is_empty() {
        TokenClass::Whitespace
    } else if body.chars().all(|c| c.is_ascii_digit()) {
        TokenClass::Number
    } else if body
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
    {
        if body.len() < text.len() {
            TokenClass::WordStart
        } else {
            TokenClass::WordPiece
        }
    } else {
        TokenClass::Symbol
    }
}

/// Whether the token at `target_at` continues a bigram that already occurred earlier in its
/// window (which starts at `window_start`): a position where the model can copy.
fn repeats_a_bigram(ids: &[u32], window_start: usize, target_at: usize) -> bool {
    let pair = [ids[target_at - 1], ids[target_at]];
    ids[window_start..target_at - 1]
        .windows(2)
        .any(|w| w == pair)
}

/// The share of the summed KL held by the `top` fraction of positions with the most KL.
fn top_share(losses: &[TokenLoss], top: f64) -> f64 {
    let mut kl: Vec<f64> = losses.iter().map(|l| l.kl.max(0.0)).collect();
    kl.sort_unstable_by(|a, b| b.total_cmp(a));
    let total: f64 = kl.iter().sum();
    let n = ((kl.len() as f64 * top).ceil() as usize).min(kl.len());
    if total > 0.0 {
        kl[..n].iter().sum::<f64>() / total
    } else {
        0.0
    }
}

/// The report of one cache on one text: `losses` index `ids` (the text's token ids),
/// `text_of` decodes ids, `ctx` is the window length, `worst` the positions to list.
pub(crate) fn report(
    losses: &[TokenLoss],
    ids: &[u32],
    ctx: usize,
    worst: usize,
    text_of: &dyn Fn(&[u32]) -> String,
) -> String {
    let mut out = String::new();
    let kl_total: f64 = losses.iter().map(|l| l.kl).sum();
    let dnll_total: f64 = losses.iter().map(|l| l.dnll).sum();
    let n = losses.len().max(1) as f64;
    let pct = |x: f64, total: f64| if total != 0.0 { 100.0 * x / total } else { 0.0 };
    let _ = writeln!(
        out,
        "  {} positions, mean KL {:.4}, mean ΔNLL {:+.4} nats",
        losses.len(),
        kl_total / n,
        dnll_total / n
    );
    let _ = writeln!(
        out,
        "  KL held by the top 1% / 10% of positions: {:.1}% / {:.1}%",
        100.0 * top_share(losses, 0.01),
        100.0 * top_share(losses, 0.10)
    );
    let copies: Vec<&TokenLoss> = losses
        .iter()
        .filter(|l| repeats_a_bigram(ids, l.target_at.saturating_sub(l.pos + 1), l.target_at))
        .collect();
    let _ = writeln!(
        out,
        "  repeating a bigram seen earlier in the window: {:.1}% of positions, {:.1}% of KL, \
         {:.1}% of ΔNLL",
        pct(copies.len() as f64, losses.len() as f64),
        pct(copies.iter().map(|l| l.kl).sum(), kl_total),
        pct(copies.iter().map(|l| l.dnll).sum(), dnll_total)
    );
    let _ = writeln!(
        out,
        "  {:<12} {:>10} {:>8} {:>8} {:>10}",
        "predicted", "positions", "KL", "ΔNLL", "mean KL"
    );
    for class in TokenClass::ALL {
        let of: Vec<&TokenLoss> = losses
            .iter()
            .filter(|l| classify(&text_of(&ids[l.target_at..=l.target_at])) == class)
            .collect();
        if of.is_empty() {
            continue;
        }
        let kl: f64 = of.iter().map(|l| l.kl).sum();
        let dnll: f64 = of.iter().map(|l| l.dnll).sum();
        let _ = writeln!(
            out,
            "  {:<12} {:>9.1}% {:>7.1}% {:>7.1}% {:>10.4}",
            class.name(),
            pct(of.len() as f64, losses.len() as f64),
            pct(kl, kl_total),
            pct(dnll, dnll_total),
            kl / of.len() as f64
        );
    }
    // Quarters of the window: is the loss where the keys are many (late) or few (early)?
    let quarter = ctx.div_ceil(4).max(1);
    let _ = writeln!(
        out,
        "  {:<12} {:>10} {:>8} {:>8}",
        "window part", "", "KL", "ΔNLL"
    );
    for q in 0..4 {
        let (lo, hi) = (q * quarter, ((q + 1) * quarter).min(ctx));
        let of = losses.iter().filter(|l| (lo..hi).contains(&l.pos));
        let (kl, dnll) = of.fold((0.0, 0.0), |(k, d), l| (k + l.kl, d + l.dnll));
        let _ = writeln!(
            out,
            "  {:<12} {:>10} {:>7.1}% {:>7.1}%",
            format!("{lo}..{hi}"),
            "",
            pct(kl, kl_total),
            pct(dnll, dnll_total)
        );
    }
    let mut order: Vec<&TokenLoss> = losses.iter().collect();
    order.sort_unstable_by(|a, b| b.kl.total_cmp(&a.kl));
    if worst > 0 {
        let _ = writeln!(
            out,
            "  positions with the most KL (text before ⟨predicted⟩):"
        );
    }
    for l in order.into_iter().take(worst) {
        let from = l.target_at.saturating_sub(12);
        let before: String = text_of(&ids[from..l.target_at])
            .chars()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let target = text_of(&ids[l.target_at..=l.target_at]);
        let _ = writeln!(
            out,
            "    pos {:>5}  KL {:>6.3}  ΔNLL {:>+6.3}  {:?}⟨{:?}⟩",
            l.pos, l.kl, l.dnll, before, target
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_classified_by_their_text() {
        assert_eq!(classify("\n    "), TokenClass::Whitespace);
        assert_eq!(classify(" the"), TokenClass::WordStart);
        assert_eq!(classify("\nimport"), TokenClass::WordStart);
        assert_eq!(classify("ing"), TokenClass::WordPiece);
        assert_eq!(classify(" 42"), TokenClass::Number);
        assert_eq!(classify("("), TokenClass::Symbol);
        assert_eq!(classify(" =="), TokenClass::Symbol);
        assert_eq!(classify("_name"), TokenClass::WordPiece);
        assert_eq!(classify(" .5"), TokenClass::Symbol);
    }

    #[test]
    fn losses_are_each_positions_nll_gap_and_kl() {
        // Vocabulary of 2; the reference is sure of token 1, the cache hedges.
        let r = [0.9f32.ln(), 0.1f32.ln()];
        let c = [0.5f32.ln(), 0.5f32.ln()];
        let (ref_lp, lp): (Vec<f32>, Vec<f32>) = (r.repeat(2), c.repeat(2));
        let l = token_losses(&lp, &ref_lp, &[0, 0, 1], 2, 10);
        assert_eq!(l.len(), 2);
        assert_eq!((l[0].target_at, l[0].pos, l[1].target_at), (11, 0, 12));
        // Target 0: −ln 0.5 − (−ln 0.9); target 1: −ln 0.5 − (−ln 0.1).
        assert!((l[0].dnll - (0.9f64.ln() - 0.5f64.ln())).abs() < 1e-6);
        assert!((l[1].dnll - (0.1f64.ln() - 0.5f64.ln())).abs() < 1e-6);
        let kl = 0.9 * (0.9f64 / 0.5).ln() + 0.1 * (0.1f64 / 0.5).ln();
        assert!((l[0].kl - kl).abs() < 1e-6 && (l[1].kl - kl).abs() < 1e-6);
    }

    #[test]
    fn the_report_splits_the_loss_by_class_and_window_part() {
        let loss = |target_at, pos, kl| TokenLoss {
            target_at,
            pos,
            dnll: kl,
            kl,
        };
        // ids 0 = " the", 1 = "\n", 2 = "(": the newline carries 3 of 4 parts of the KL.
        let ids = [0u32, 1, 2, 1];
        let losses = [loss(1, 0, 0.3), loss(2, 1, 0.1), loss(3, 2, 0.0)];
        let text = |ids: &[u32]| {
            ids.iter()
                .map(|&i| [" the", "\n", "("][i as usize])
                .collect::<String>()
        };
        let r = report(&losses, &ids, 4, 1, &text);
        assert!(
            r.contains("top 1% / 10% of positions: 75.0% / 75.0%"),
            "{r}"
        );
        let line = |name: &str| {
            r.lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap()
        };
        assert!(line("whitespace").contains("75.0%"), "{r}");
        assert!(line("symbol").contains("25.0%"), "{r}");
        assert!(line("0..1").contains("75.0%"), "{r}");
        assert!(line("3..4").contains("0.0%"), "{r}");
        assert!(r.contains("⟨\"\\n\"⟩"), "{r}");
        // Position 2 predicts "\n" after "(", a bigram not seen before it; none repeats.
        assert!(
            r.contains("earlier in the window: 0.0% of positions"),
            "{r}"
        );
    }

    #[test]
    fn a_bigram_repeats_only_if_it_occurred_earlier_in_the_window() {
        // 5 7 9 5 7: the last 7 follows a 5 as at index 1.
        let ids = [5u32, 7, 9, 5, 7];
        assert!(repeats_a_bigram(&ids, 0, 4));
        assert!(
            !repeats_a_bigram(&ids, 1, 4),
            "index 1 is before the window"
        );
        assert!(!repeats_a_bigram(&ids, 0, 3));
        assert!(!repeats_a_bigram(&ids, 0, 1));
    }
}
