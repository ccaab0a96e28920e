//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The demo model's path: `$TURBOKV_MODEL`, else the asset cache's default location.
/// Returns `None` (and says so) when it is absent outside CI; in CI a missing model fails.
pub fn demo_model() -> Option<PathBuf> {
    let path = std::env::var_os("TURBOKV_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("TURBOKV_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/turbokv")
                });
            cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have the demo model: run scripts/fetch-assets.sh ({})",
        path.display()
    );
    eprintln!(
        "SKIPPED: demo model not found at {} (run scripts/fetch-assets.sh)",
        path.display()
    );
    None
}

/// Reads a committed fixture.
pub fn fixture(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

/// `log Σ exp(v)`, in f64.
pub fn logsumexp(v: &[f32]) -> f64 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
