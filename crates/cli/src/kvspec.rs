//! KV cache specs of the CLI: a dtype, a named preset, or a dtype with a full-precision
//! window (`k4v3@w16s1`).

use anyhow::{Result, bail};
use turbokv_cache::KvWindow;
use turbokv_codec::KvDtype;

/// A KV dtype plus the tokens kept exact beside its codes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvSpec {
    /// Number format of the codes.
    pub dtype: KvDtype,
    /// Sink and recent tokens attended at f16 (ignored by 16-bit dtypes).
    pub window: KvWindow,
}

/// Presets, chosen by `eval ppl` measurements (BENCHMARKS.md): name → spec.
const PRESETS: &[(&str, &str)] = &[("balanced", "k4v3@w32s1"), ("compact", "tq3@w15s1")];

impl KvSpec {
    /// Parses `spec`; `default` is the window of a plain compressed dtype (from
    /// `--kv-window`/`--kv-sinks`).
    pub fn parse(spec: &str, default: KvWindow) -> Result<Self> {
        let spec = spec.trim();
        let resolved = PRESETS
            .iter()
            .find(|(n, _)| *n == spec)
            .map_or(spec, |(_, s)| *s);
        let (dtype, window) = match resolved.split_once('@') {
            None => (resolved, default),
            Some((d, w)) => (
                d,
                parse_window(w).map_err(|e| anyhow::anyhow!("--kv {spec}: {e}"))?,
            ),
        };
        let dtype: KvDtype = dtype
            .parse()
            .map_err(|e| anyhow::anyhow!("--kv {spec}: {e} (presets: balanced, compact)"))?;
        let window = if matches!(dtype, KvDtype::F16 | KvDtype::Bf16) {
            KvWindow::default()
        } else {
            window
        };
        Ok(Self { dtype, window })
    }

    /// The name printed in tables: the preset or dtype, with its window when it has one.
    pub fn label(&self, spec: &str) -> String {
        let w = self.window;
        if PRESETS.iter().any(|(n, _)| *n == spec.trim()) {
            format!("{}({}@w{}s{})", spec.trim(), self.dtype, w.recent, w.sinks)
        } else if w.is_active() {
            format!("{}@w{}s{}", self.dtype, w.recent, w.sinks)
        } else {
            self.dtype.to_string()
        }
    }
}

/// `w16s1`, `w16`, `s1`.
fn parse_window(w: &str) -> Result<KvWindow> {
    let mut out = KvWindow::default();
    let mut rest = w;
    while !rest.is_empty() {
        let (tag, tail) = rest.split_at(1);
        let digits = tail
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(tail.len());
        let Ok(n) = tail[..digits].parse::<usize>() else {
            bail!("window `{w}`: expected w<recent>s<sinks>, e.g. w16s1");
        };
        match tag {
            "w" => out.recent = n,
            "s" => out.sinks = n,
            _ => bail!("window `{w}`: expected w<recent>s<sinks>, e.g. w16s1"),
        }
        rest = &tail[digits..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_plain_and_windowed() {
        let none = KvWindow::default();
        let b = KvSpec::parse("balanced", none).unwrap();
        assert_eq!(b.dtype, "k4v3".parse().unwrap());
        assert!(b.window.is_active());
        let p = KvSpec::parse("tq4", none).unwrap();
        assert!(!p.window.is_active(), "plain dtypes stay plain");
        let w = KvSpec::parse("tq3@w16s2", none).unwrap();
        assert_eq!(
            w.window,
            KvWindow {
                recent: 16,
                sinks: 2
            }
        );
        let f = KvSpec::parse("f16@w16", none).unwrap();
        assert!(!f.window.is_active(), "16-bit caches have no window");
    }

    #[test]
    fn bad_specs_are_errors() {
        let none = KvWindow::default();
        assert!(KvSpec::parse("tq4@x3", none).is_err());
        assert!(KvSpec::parse("tq4@w", none).is_err());
        assert!(KvSpec::parse("huge", none).is_err());
    }
}
