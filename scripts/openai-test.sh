#!/usr/bin/env bash
# Drives a real `turbokv serve` (release build, demo model, CPU) with the official `openai`
# Python client from PyPI, pinned, installed into a virtualenv in the asset cache
# (idempotent). Exits non-zero when the server fails to start or any check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
OPENAI_VERSION=1.109.1
CACHE="${TURBOKV_CACHE:-$HOME/.cache/turbokv}"
VENV="$CACHE/venv-openai-$OPENAI_VERSION"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import openai" 2>/dev/null; then
    echo "openai-test: installing openai==$OPENAI_VERSION into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "openai==$OPENAI_VERSION"
fi
eval "$(scripts/fetch-assets.sh --print-env)"
cargo build --release -q -p turbokv
bin="${CARGO_TARGET_DIR:-target}/release/turbokv"
log=$(mktemp)
"$bin" serve --model "$TURBOKV_MODEL" --port 0 --kv int8 --kv-memory 256MiB \
    --served-model-name demo --api-key test-key 2>"$log" &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -f "$log"' EXIT
url=""
for _ in $(seq 1 600); do
    url=$(grep -o 'http://[0-9.:]*/v1' "$log" | head -n1 || true)
    [ -n "$url" ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "openai-test: the server exited" >&2; exit 1; }
    sleep 0.1
done
[ -n "$url" ] || { cat "$log" >&2; echo "openai-test: no URL after 60 s" >&2; exit 1; }
"$VENV/bin/python" crates/server/tests/openai_client.py "$url" demo
