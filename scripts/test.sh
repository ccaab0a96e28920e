#!/usr/bin/env bash
# The test command: fetch the assets the integration tests use (idempotent, cached outside
# the repo), then run every test of the workspace in release mode (the model tests run a real
# 135M-parameter model; unoptimised builds make them needlessly slow). Ends with one summary
# line over all test binaries. Then the official `openai` Python client drives the server
# (scripts/openai-test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-assets.sh >/dev/null
eval "$(scripts/fetch-assets.sh --print-env)"
export TURBOKV_MODEL TURBOKV_WIKI
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --release "$@" 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { p += $4; f += $6 } END { printf "%d passed, %d failed\n", p, f }' "$log"
# The official OpenAI Python client against the real server.
scripts/openai-test.sh || { echo "FAILED: scripts/openai-test.sh (openai client vs turbokv serve)"; status=1; }
exit "$status"
