#!/usr/bin/env bash
# The test command: fetch the assets the integration tests use (idempotent, cached outside
# the repo), then run every test of the workspace in release mode (the model tests run a real
# 135M-parameter model; unoptimised builds make them needlessly slow).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-assets.sh >/dev/null
eval "$(scripts/fetch-assets.sh --print-env)"
export TURBOKV_MODEL TURBOKV_WIKI 2>/dev/null || true
cargo test --workspace --release "$@"
