//! Helpers shared by the CLI's integration tests: running the built binary and finding the
//! fetched assets (absent: a skip message, or a failure under CI, which must have them).

#![allow(dead_code)] // each test crate uses its own subset

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the `turbokv` binary with `args` (no backtrace or log settings inherited).
pub fn turbokv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turbokv"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .env_remove("TURBOKV_LOG")
        .output()
        .expect("runs turbokv")
}

/// The process's standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The asset at `$env`, else at `rel` under the asset cache (`$TURBOKV_CACHE`, default
/// `~/.cache/turbokv`); `None` with a skip message when it is missing (a panic under CI).
pub fn asset(env: &str, rel: &str) -> Option<PathBuf> {
    let path = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("TURBOKV_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/turbokv")
            })
            .join(rel)
    });
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must have {}: run scripts/fetch-assets.sh",
        path.display()
    );
    eprintln!(
        "SKIPPED: {} not found (run scripts/fetch-assets.sh)",
        path.display()
    );
    None
}

/// The demo model's path (see [`asset`]).
pub fn demo_model() -> Option<String> {
    asset("TURBOKV_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
        .map(|p| p.display().to_string())
}
