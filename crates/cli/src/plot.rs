//! `eval ppl --plot FILE.svg`: perplexity and KL divergence against bits per element, one
//! series (colour) per evaluation text, every KV cache a labelled point.

use std::path::Path;

use anyhow::{Context, Result, ensure};
use plotters::prelude::*;

/// One KV cache measured on one text.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// The cache's label (`compact(tq3@w15s1)`).
    pub kv: String,
    /// Bits per element, K and V averaged, window and centers included.
    pub bits: f64,
    /// Perplexity over the bf16 cache's perplexity on the same text.
    pub ppl_ratio: f64,
    /// Mean KL divergence from the bf16 cache's next-token distribution.
    pub kl: f64,
}

/// The points of one evaluation text.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The text's name (`wiki`, `code`, …).
    pub text: String,
    /// Its points.
    pub points: Vec<Point>,
}

/// Smallest KL drawn: the log axis cannot show the bf16 cache's exact 0, so points below
/// this sit on the axis floor.
const KL_FLOOR: f64 = 1e-4;

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Writes the two panels (ppl ratio, KL; both on log axes) to `path` as SVG. `title` heads
/// the figure (model, context, windows). Labels are written once per cache, at its point of
/// the first text, so they do not pile up.
pub fn write_svg(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    ensure!(
        series.iter().any(|s| !s.points.is_empty()),
        "--plot: nothing to draw"
    );
    let all = || series.iter().flat_map(|s| &s.points);
    let (bmin, bmax) = bounds(all().map(|p| p.bits));
    let (rmin, rmax) = bounds(all().map(|p| p.ppl_ratio.max(1e-3)));
    let (kmin, kmax) = bounds(all().map(|p| p.kl.max(KL_FLOOR)));
    let x = (bmin - 0.5).max(0.0)..bmax + 1.0;
    let draw = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let root = SVGBackend::new(path, (1400, 620)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 22))?;
        let (left, right) = root.split_horizontally(700);
        for (area, kl) in [(&left, false), (&right, true)] {
            // KL spans decades; the ppl ratio a few tens of percent, so its axis stays tight.
            let (lo, hi) = if kl {
                (kmin / 1.2, kmax * 1.4)
            } else {
                (rmin / 1.01, rmax * 1.03)
            };
            let mut chart = ChartBuilder::on(area)
                .margin(16)
                .x_label_area_size(44)
                .y_label_area_size(70)
                .build_cartesian_2d(x.clone(), (lo..hi).log_scale())?;
            chart
                .configure_mesh()
                .x_desc("bits per element (K+V average)")
                .y_desc(if kl {
                    "KL vs bf16 cache (nats/token)"
                } else {
                    "perplexity / bf16 perplexity"
                })
                .draw()?;
            for (i, s) in series.iter().enumerate() {
                let colour = PALETTE[i % PALETTE.len()];
                let y = |p: &Point| {
                    if kl {
                        p.kl.max(KL_FLOOR)
                    } else {
                        p.ppl_ratio.max(1e-3)
                    }
                };
                chart
                    .draw_series(
                        s.points
                            .iter()
                            .map(|p| Circle::new((p.bits, y(p)), 4, colour.filled())),
                    )?
                    .label(s.text.as_str())
                    .legend(move |(x, y)| Circle::new((x + 8, y), 4, colour.filled()));
                if i == 0 {
                    chart.draw_series(s.points.iter().map(|p| {
                        Text::new(
                            p.kv.clone(),
                            (p.bits, y(p)),
                            ("sans-serif", 11).into_font().color(&BLACK.mix(0.75)),
                        )
                    }))?;
                }
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }
        root.present()?;
        Ok(())
    };
    draw()
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("writing the plot {}", path.display()))
}

fn bounds(v: impl Iterator<Item = f64>) -> (f64, f64) {
    v.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(kv: &str, bits: f64, ppl_ratio: f64, kl: f64) -> Point {
        Point {
            kv: kv.into(),
            bits,
            ppl_ratio,
            kl,
        }
    }

    #[test]
    fn the_svg_has_a_point_per_cache_and_text_a_label_per_cache_and_a_legend_per_text() {
        let series = vec![
            Series {
                text: "wiki".into(),
                points: vec![
                    point("bf16", 16.0, 1.0, 0.0),
                    point("compact(tq3@w15s1)", 3.5, 1.028, 0.038),
                    point("tq2", 2.25, 2.6, 1.03),
                ],
            },
            Series {
                text: "dialogue".into(),
                points: vec![
                    point("bf16", 16.0, 1.0, 0.0),
                    point("compact(tq3@w15s1)", 3.5, 1.04, 0.05),
                    point("tq2", 2.25, 2.9, 1.2),
                ],
            },
        ];
        let path = std::env::temp_dir().join(format!("turbokv-plot-{}.svg", std::process::id()));
        write_svg(&path, "demo model, ctx 1024 × 4", &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        // 3 caches × 2 texts × 2 panels, plus one legend marker per text per panel.
        assert_eq!(svg.matches("<circle").count(), 3 * 2 * 2 + 2 * 2, "{svg}");
        for label in ["compact(tq3@w15s1)", "tq2", "wiki", "dialogue", "ctx 1024"] {
            assert!(svg.contains(label), "{label} missing");
        }
        // Labels once per cache per panel, from the first text only.
        assert_eq!(svg.matches(">\ntq2\n</text>").count(), 2, "{svg}");
    }

    #[test]
    fn nothing_to_draw_is_an_error() {
        let path = std::env::temp_dir().join("turbokv-plot-empty.svg");
        let err = write_svg(&path, "t", &[]).unwrap_err();
        assert!(err.to_string().contains("nothing to draw"), "{err}");
    }
}
