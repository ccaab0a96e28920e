#!/usr/bin/env bash
# Bounded loopback load test of `turbokv serve` on the demo model (CPU): for each KV format
# (bf16, balanced, compact) at one fixed --kv-memory, a fresh server on 127.0.0.1 driven by
# NVIDIA's AIPerf (PyPI `aiperf`, pinned, in a venv of the asset cache) at 1, 8, 32 and 64
# concurrent streamed chat clients (synthetic 24-token prompts, exactly --max-tokens output
# tokens each via `ignore_eos`). AIPerf also scrapes the server's /metrics: the table shows
# how many sequences ran at once. A few minutes on 2 cores. Not run by CI or the tests.
#
#   bench/serve_load.sh [--threads N] [--kv-memory SIZE] [--kv bf16,balanced,compact]
#                       [--concurrency 1,8,32,64] [--max-tokens 32] [--out DIR]
#
# Needs a release build (cargo build --release -p turbokv; $TURBOKV_BIN overrides the binary).
# AIPerf counts tokens with a Hugging Face tokenizer; the demo model ships none, so
# bench/gguf_tokenizer.py writes one from the GGUF's vocabulary (no Hub download).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=2 KV_MEMORY=32MiB KVS=bf16,balanced,compact CONC=1,8,32,64 MAX_TOKENS=32 OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --threads) THREADS=$2; shift 2 ;;
        --kv-memory) KV_MEMORY=$2; shift 2 ;;
        --kv) KVS=$2; shift 2 ;;
        --concurrency) CONC=$2; shift 2 ;;
        --max-tokens) MAX_TOKENS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        *) echo "serve_load: unknown option $1" >&2; exit 2 ;;
    esac
done
AIPERF_VERSION=0.13.0 GGUF_VERSION=0.19.0
CACHE="${TURBOKV_CACHE:-$HOME/.cache/turbokv}"
VENV="$CACHE/venv-aiperf-$AIPERF_VERSION"
if [ ! -x "$VENV/bin/aiperf" ] || ! "$VENV/bin/python" -c "import gguf" 2>/dev/null; then
    echo "serve_load: installing aiperf==$AIPERF_VERSION gguf==$GGUF_VERSION into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION" "gguf==$GGUF_VERSION"
fi
eval "$(scripts/fetch-assets.sh --print-env)"
TOKENIZER="$CACHE/tokenizer-$(basename "$TURBOKV_MODEL" .gguf)"
[ -f "$TOKENIZER/tokenizer.json" ] || "$VENV/bin/python" bench/gguf_tokenizer.py "$TURBOKV_MODEL" "$TOKENIZER"
BIN="${TURBOKV_BIN:-${CARGO_TARGET_DIR:-target}/release/turbokv}"
[ -x "$BIN" ] || { echo "serve_load: no binary at $BIN (cargo build --release -p turbokv)" >&2; exit 1; }
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
log=$(mktemp)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -f "$log"' EXIT

echo "serve_load: $(nproc) cores, threads $THREADS, kv-memory $KV_MEMORY, max_tokens $MAX_TOKENS, results in $OUT" >&2
# The same-run reference: one stream's prefill and decode rate without the server.
"$BIN" bench model --model "$TURBOKV_MODEL" --threads "$THREADS" --kv bf16 \
    --prompt-tokens 48 --gen-tokens "$MAX_TOKENS" --repeats 3 2>/dev/null | tail -n2 > "$OUT/reference.txt"

for kv in ${KVS//,/ }; do
    "$BIN" serve --model "$TURBOKV_MODEL" --threads "$THREADS" --kv "$kv" --kv-memory "$KV_MEMORY" \
        --max-num-seqs 64 --host 127.0.0.1 --port 0 --served-model-name demo 2>"$log" &
    pid=$!
    url=""
    for _ in $(seq 1 600); do
        url=$(grep -o 'http://[0-9.:]*' "$log" | head -n1 || true)
        [ -n "$url" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "serve_load: the server exited" >&2; exit 1; }
        sleep 0.1
    done
    [ -n "$url" ] || { cat "$log" >&2; echo "serve_load: no URL after 60 s" >&2; exit 1; }
    grep -o 'KV .* sequences' "$log" | head -n1 > "$OUT/$kv-server.txt" || true
    for c in ${CONC//,/ }; do
        n=$(( c * 2 > 8 ? c * 2 : 8 ))
        echo "serve_load: $kv, $c clients, $n requests" >&2
        timeout 600 "$VENV/bin/aiperf" profile --model demo --url "$url" --endpoint-type chat --streaming \
            --tokenizer "$TOKENIZER" --use-server-token-count --concurrency "$c" --request-count "$n" \
            --synthetic-input-tokens-mean 24 --synthetic-input-tokens-stddev 0 \
            --output-tokens-mean "$MAX_TOKENS" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
            --random-seed 1 --ui-type none --artifact-dir "$OUT/$kv-c$c" > "$OUT/$kv-c$c.log" 2>&1 ||
            { tail -n 30 "$OUT/$kv-c$c.log" >&2; echo "serve_load: aiperf failed" >&2; exit 1; }
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
done

python3 bench/serve_load_table.py "$OUT" "$KVS" "$CONC"
