//! `bench attention --plot FILE.svg`: decode-attention time against context, one line per KV
//! format beside the best PyTorch SDPA backend on bf16 KV, one panel per batch size.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use plotters::prelude::*;

use crate::bench_attention::AttentionReport;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

/// The lines of one panel: (label, [(ctx, ms)]), the peer last.
type Lines = Vec<(String, Vec<(f64, f64)>)>;

/// Per batch size: each format's default-variant times, then the peer's.
fn panels(report: &AttentionReport) -> Vec<(usize, Lines)> {
    let rows: Vec<_> = report
        .rows
        .iter()
        .filter(|r| r.variant == "default")
        .collect();
    let batches: BTreeSet<usize> = rows.iter().map(|r| r.batch).collect();
    let mut kvs: Vec<&str> = Vec::new();
    for r in &rows {
        if !kvs.contains(&r.kv.as_str()) {
            kvs.push(&r.kv);
        }
    }
    batches
        .into_iter()
        .map(|b| {
            let at = |kv: &str| -> Vec<(f64, f64)> {
                let mut v: Vec<_> = rows
                    .iter()
                    .filter(|r| r.batch == b && r.kv == kv)
                    .map(|r| (r.ctx as f64, r.ms))
                    .collect();
                v.sort_by(|x, y| x.0.total_cmp(&y.0));
                v
            };
            let mut lines: Lines = kvs.iter().map(|kv| (kv.to_string(), at(kv))).collect();
            let mut peer: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.batch == b && r.kv == kvs[0])
                .filter_map(|r| r.sdpa_ms.map(|ms| (r.ctx as f64, ms)))
                .collect();
            peer.sort_by(|x, y| x.0.total_cmp(&y.0));
            if !peer.is_empty() {
                lines.push(("SDPA on bf16 (best backend)".into(), peer));
            }
            (b, lines)
        })
        .collect()
}

/// Writes the panels to `path` as SVG (log–log axes).
pub fn write_svg(path: &Path, report: &AttentionReport) -> Result<()> {
    let panels = panels(report);
    ensure!(
        panels
            .iter()
            .any(|(_, l)| l.iter().any(|(_, p)| !p.is_empty())),
        "--plot: nothing to draw"
    );
    let title = format!(
        "decode attention, {} heads / {} kv heads × {} ({})",
        report.heads, report.kv_heads, report.head_dim, report.device
    );
    let draw = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let width = 520 * panels.len() as u32;
        let root = SVGBackend::new(path, (width, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(&title, ("sans-serif", 22))?;
        for (area, (batch, lines)) in root.split_evenly((1, panels.len())).iter().zip(&panels) {
            let pts = || lines.iter().flat_map(|(_, p)| p.iter());
            let (x0, x1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
            let (y0, y1) = pts().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
            let mut chart = ChartBuilder::on(area)
                .caption(format!("batch {batch}"), ("sans-serif", 18))
                .margin(14)
                .x_label_area_size(40)
                .y_label_area_size(64)
                .build_cartesian_2d(
                    (x0 / 1.3..x1 * 1.3).log_scale(),
                    (y0 / 1.3..y1 * 1.3).log_scale(),
                )?;
            chart
                .configure_mesh()
                .x_desc("context (tokens)")
                .y_desc("ms per launch")
                .x_labels(6)
                .y_labels(8)
                .x_label_formatter(&|x| format!("{:.0}k", x / 1024.0))
                .y_label_formatter(&|y| format!("{y:.3}"))
                .light_line_style(WHITE)
                .draw()?;
            for (i, (label, p)) in lines.iter().enumerate() {
                let peer = i + 1 == lines.len() && label.starts_with("SDPA");
                let colour = if peer {
                    BLACK
                } else {
                    PALETTE[i % PALETTE.len()]
                };
                let style = colour.stroke_width(if peer { 3 } else { 2 });
                chart
                    .draw_series(std::iter::once(PathElement::new(p.clone(), style)))?
                    .label(label.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
                chart.draw_series(p.iter().map(|&xy| Circle::new(xy, 3, colour.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> AttentionReport {
        let text = r#"{"device":"cuda:0","heads":32,"kv_heads":8,"head_dim":128,"block_size":16,
          "copy_bw_gb_s":4200.0,"peer_note":null,"peer":[],"rows":[
          {"kv":"bf16","variant":"default","batch":8,"ctx":8192,"ms":0.08,"best_ms":0.08,
           "kv_gb":0.27,"gb_s":3390.0,"frac_copy_bw":0.8,"max_diff_vs_default":0.0,
           "sdpa_ms":0.07,"sdpa_backend":"flash","ratio_to_sdpa":1.1},
          {"kv":"bf16","variant":"default","batch":8,"ctx":32768,"ms":0.27,"best_ms":0.27,
           "kv_gb":1.07,"gb_s":4000.0,"frac_copy_bw":0.95,"max_diff_vs_default":0.0,
           "sdpa_ms":0.25,"sdpa_backend":"flash","ratio_to_sdpa":1.07},
          {"kv":"tq3","variant":"default","batch":8,"ctx":8192,"ms":0.081,"best_ms":0.08,
           "kv_gb":0.05,"gb_s":650.0,"frac_copy_bw":0.15,"max_diff_vs_default":0.0,
           "sdpa_ms":0.07,"sdpa_backend":"flash","ratio_to_sdpa":1.15},
          {"kv":"tq3","variant":"128/32/2/2","batch":8,"ctx":8192,"ms":0.5,"best_ms":0.5,
           "kv_gb":0.05,"gb_s":100.0,"frac_copy_bw":0.02,"max_diff_vs_default":0.0,
           "sdpa_ms":null,"sdpa_backend":null,"ratio_to_sdpa":null}]}"#;
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn panels_hold_each_format_and_the_peer_per_batch() {
        let p = panels(&report());
        assert_eq!(p.len(), 1);
        let (batch, lines) = &p[0];
        assert_eq!(*batch, 8);
        let labels: Vec<&str> = lines.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(labels, ["bf16", "tq3", "SDPA on bf16 (best backend)"]);
        // Default variants only, sorted by context; the peer from the first format's rows.
        assert_eq!(lines[0].1, vec![(8192.0, 0.08), (32768.0, 0.27)]);
        assert_eq!(lines[1].1, vec![(8192.0, 0.081)]);
        assert_eq!(lines[2].1, vec![(8192.0, 0.07), (32768.0, 0.25)]);
    }

    #[test]
    fn the_svg_has_a_line_per_format_and_the_peer() {
        let dir = std::env::temp_dir().join(format!("turbokv-attn-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.svg");
        write_svg(&path, &report()).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("batch 8") && svg.contains("tq3") && svg.contains("SDPA on bf16"));
        let empty = AttentionReport {
            rows: Vec::new(),
            ..report()
        };
        assert!(write_svg(&dir.join("b.svg"), &empty).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
