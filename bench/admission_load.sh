#!/usr/bin/env bash
# Preemptions under a fixed overload, per admission policy: for each --growth-reserve value a
# fresh `turbokv serve --kv bf16 --kv-memory 32MiB` (the demo model: 1456 tokens of KV) on
# 127.0.0.1 gets REQUESTS streamed-off completions at CONCURRENCY at once (curl, each a
# distinct ~50-token prompt, exactly 32 output tokens via ignore_eos, greedy), then its
# /metrics are read: preemptions, requests deferred by the reserve, most requests running in
# one step, mean sequences per step, and the wall time. Not run by CI or the tests.
#
#   bench/admission_load.sh [--reserves none,16,64,full] [--requests 128] [--concurrency 64]
#                           [--kv-memory 32MiB] [--threads 2]
#
# Needs a release build (cargo build --release -p turbokv; $TURBOKV_BIN overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
RESERVES=none,16,64,full REQUESTS=128 CONC=64 KV_MEMORY=32MiB THREADS=2
while [ $# -gt 0 ]; do
    case "$1" in
        --reserves) RESERVES=$2; shift 2 ;;
        --requests) REQUESTS=$2; shift 2 ;;
        --concurrency) CONC=$2; shift 2 ;;
        --kv-memory) KV_MEMORY=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        *) echo "admission_load: unknown option $1" >&2; exit 2 ;;
    esac
done
eval "$(scripts/fetch-assets.sh --print-env)"
BIN="${TURBOKV_BIN:-${CARGO_TARGET_DIR:-target}/release/turbokv}"
[ -x "$BIN" ] || { echo "admission_load: no binary at $BIN" >&2; exit 1; }
log=$(mktemp)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -f "$log"' EXIT
metric() { curl -s "$1/metrics" | awk -v m="$2" '$1 == m { print $2 }'; }
export PROMPT="The history of the city begins with a small settlement on the river, where \
farmers and traders met each week to exchange grain, cloth and news from distant towns. Over \
the centuries"

echo "| --growth-reserve | requests | clients | preempted | deferred by the reserve | running max | mean seqs/step | wall s |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
for reserve in ${RESERVES//,/ }; do
    watermark=0.01
    [ "$reserve" = none ] && watermark=0
    "$BIN" serve --model "$TURBOKV_MODEL" --threads "$THREADS" --kv bf16 --kv-memory "$KV_MEMORY" \
        --max-num-seqs 64 --growth-reserve "$reserve" --kv-watermark "$watermark" \
        --host 127.0.0.1 --port 0 --served-model-name demo 2>"$log" &
    pid=$!
    url=""
    for _ in $(seq 1 600); do
        url=$(grep -o 'http://[0-9.:]*' "$log" | head -n1 || true)
        [ -n "$url" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.1
    done
    [ -n "$url" ] || { cat "$log" >&2; echo "admission_load: no URL" >&2; exit 1; }
    start=$(date +%s.%N)
    seq 1 "$REQUESTS" | URL=$url xargs -P "$CONC" -n 1 bash -c 'curl -sf -o /dev/null \
        "$URL/v1/completions" -H "Content-Type: application/json" -d "{\"model\": \"demo\",
        \"max_tokens\": 32, \"temperature\": 0, \"ignore_eos\": true, \"prompt\":
        \"Request $0. $PROMPT\"}"' || { echo "admission_load: a request failed" >&2; exit 1; }
    wall=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
    pre=$(metric "$url" vllm:num_preemptions_total)
    def=$(metric "$url" turbokv:admissions_deferred_total)
    peak=$(metric "$url" turbokv:num_requests_running_peak)
    steps=$(metric "$url" turbokv:engine_steps_total)
    seqs=$(metric "$url" turbokv:engine_step_sequences_total)
    printf '| %s | %s | %s | %s | %s | %s | %.1f | %.0f |\n' "$reserve" "$REQUESTS" "$CONC" \
        "$pre" "$def" "$peak" "$(awk -v a="$seqs" -v b="$steps" 'BEGIN { print a / b }')" "$wall"
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
done
