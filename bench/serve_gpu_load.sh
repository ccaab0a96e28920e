#!/usr/bin/env bash
# Bounded loopback load test of `turbokv serve` on a GPU: a llama3-8b-shaped model with random
# bf16 weights (`serve --random-shape`, no model files), for bf16, balanced and compact KV at
# one fixed --kv-memory, driven at 1, 8, 32, 64, 128 and 256 concurrent streamed clients
# (random token-id prompts of --prompt-tokens, exactly --max-tokens output tokens each via
# `ignore_eos`, greedy). Writes serve_gpu_load.md (table) and serve_gpu_load.json (every run,
# with the server's counters: preemptions, padded rows, graph replays/captures, top-k steps)
# under $OUT (or --out), plus each server's log. The whole script stays under --budget-s
# seconds (default 510: runs that would not fit are skipped and marked so).
#
#   export LD_LIBRARY_PATH=/usr/local/cuda/lib64; OUT=/tmp/out bench/serve_gpu_load.sh
#       [--kv-memory 4GiB] [--kv bf16,balanced,compact] [--concurrency 1,8,32,64,128,256]
#       [--prompt-tokens 256] [--max-tokens 128] [--shape llama3-8b] [--budget-s 510]
#
# Needs: the release binary (target/release/turbokv, or $TURBOKV_BIN), an NVIDIA GPU with the
# CUDA 13 libraries on LD_LIBRARY_PATH, python3 (standard library only). No network.
#
# The client is bench/load_client.py, not AIPerf (which bench/serve_load.sh uses on the CPU):
# AIPerf 0.13.0 with its dependencies is about 230 MB of wheels (pyarrow, scipy, pandas,
# transformers, ...), more than can travel to an offline GPU machine. It measures the same
# figures: output tok/s, TTFT and inter-token latency p50/p99.
#
# The first CUDA start JIT-compiles the kernels (~45 s; the PTX is cached in
# $TMPDIR/turbokv-ptx for the next starts).
set -euo pipefail
cd "$(dirname "$0")/.."
KV_MEMORY=4GiB KVS=bf16,balanced,compact CONC=1,8,32,64,128,256 PROMPT=256 MAX_TOKENS=128
SHAPE=llama3-8b BUDGET=510 OUTDIR="${OUT:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        --kv-memory) KV_MEMORY=$2; shift 2 ;;
        --kv) KVS=$2; shift 2 ;;
        --concurrency) CONC=$2; shift 2 ;;
        --prompt-tokens) PROMPT=$2; shift 2 ;;
        --max-tokens) MAX_TOKENS=$2; shift 2 ;;
        --shape) SHAPE=$2; shift 2 ;;
        --budget-s) BUDGET=$2; shift 2 ;;
        --out) OUTDIR=$2; shift 2 ;;
        *) echo "serve_gpu_load: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -n "$OUTDIR" ] || { echo "serve_gpu_load: set \$OUT or --out" >&2; exit 2; }
mkdir -p "$OUTDIR/runs"
BIN="${TURBOKV_BIN:-target/release/turbokv}"
[ -x "$BIN" ] || { echo "serve_gpu_load: no binary at $BIN" >&2; exit 1; }
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
MAX_SEQS=256
for c in ${CONC//,/ }; do [ "$c" -gt "$MAX_SEQS" ] && MAX_SEQS=$c; done
pid=""
stop_server() {
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
}
trap stop_server EXIT

echo "serve_gpu_load: $SHAPE, kv-memory $KV_MEMORY, prompts $PROMPT, outputs $MAX_TOKENS, budget ${BUDGET}s, results in $OUTDIR" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUTDIR/gpu.txt" 2>&1 || true
for kv in ${KVS//,/ }; do
    if [ "$(left)" -lt 60 ]; then
        echo "serve_gpu_load: $kv skipped (budget)" >&2
        echo "{\"kv\": \"$kv\", \"skipped\": \"budget\"}" > "$OUTDIR/runs/$kv-server.json"
        continue
    fi
    log="$OUTDIR/$kv-server.log"
    TURBOKV_LOG=info "$BIN" serve --random-shape "$SHAPE" --device cuda --kv "$kv" \
        --kv-memory "$KV_MEMORY" --max-num-seqs "$MAX_SEQS" --max-batched-tokens 2048 --ctx 4096 \
        --host 127.0.0.1 --port 0 --served-model-name random 2>"$log" &
    pid=$!
    url=""
    wait_s=$(( $(left) - 30 )); [ "$wait_s" -gt 240 ] && wait_s=240
    for _ in $(seq 1 $(( wait_s * 10 ))); do
        url=$(grep -o 'http://[0-9.:]*' "$log" | head -n1 || true)
        [ -n "$url" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if [ -z "$url" ]; then
        tail -n 20 "$log" >&2
        echo "serve_gpu_load: the $kv server did not start" >&2
        stop_server
        echo "{\"kv\": \"$kv\", \"skipped\": \"server did not start\"}" > "$OUTDIR/runs/$kv-server.json"
        continue
    fi
    line=$(grep -m1 'serving' "$log" || true)
    python3 - "$kv" "$line" > "$OUTDIR/runs/$kv-server.json" <<'EOF'
import json, sys
print(json.dumps({"kv": sys.argv[1], "server": sys.argv[2]}))
EOF
    echo "serve_gpu_load: $line" >&2
    # Warm-up (not recorded): cuBLAS plans and the first graphs of small batches.
    if [ "$(left)" -gt 90 ]; then
        python3 bench/load_client.py --url "$url" --model random --concurrency 8 --requests 8 \
            --prompt-tokens "$PROMPT" --max-tokens 16 --duration 20 >/dev/null 2>&1 || true
    fi
    for c in ${CONC//,/ }; do
        n=$(( c * 2 > 8 ? c * 2 : 8 ))
        cap=$(( c >= 128 ? 40 : 25 ))
        rem=$(( $(left) - 25 ))
        if [ "$rem" -lt 8 ]; then
            echo "serve_gpu_load: $kv c=$c skipped (budget)" >&2
            echo "{\"kv\": \"$kv\", \"concurrency\": $c, \"skipped\": \"budget\"}" > "$OUTDIR/runs/$kv-c$c.json"
            continue
        fi
        # The client stops starting requests after `dur` s and cancels at 1.5x.
        dur=$(( cap < rem * 2 / 3 ? cap : rem * 2 / 3 ))
        echo "serve_gpu_load: $kv, $c clients, $n requests (at most ${dur}s)" >&2
        python3 bench/load_client.py --url "$url" --model random --concurrency "$c" --requests "$n" \
            --prompt-tokens "$PROMPT" --max-tokens "$MAX_TOKENS" --duration "$dur" --seed "$c" \
            --json "$OUTDIR/runs/$kv-c$c.raw.json" 2>>"$OUTDIR/client.log" || true
        python3 - "$kv" "$OUTDIR/runs/$kv-c$c.raw.json" > "$OUTDIR/runs/$kv-c$c.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[2]))
except (OSError, ValueError) as e:
    r = {"skipped": f"client failed: {e}"}
r["kv"] = sys.argv[1]
print(json.dumps(r))
EOF
        tail -n 1 "$OUTDIR/client.log" >&2 || true
    done
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
        "$url/metrics" > "$OUTDIR/$kv-metrics.txt" 2>/dev/null || true
    stop_server
done

python3 - "$OUTDIR" "$KVS" "$CONC" "$KV_MEMORY" "$SHAPE" "$PROMPT" "$MAX_TOKENS" <<'EOF'
import json, os, sys
out, kvs, conc, mem, shape, prompt, max_tokens = sys.argv[1:]
runs, servers = [], {}
for kv in kvs.split(","):
    p = os.path.join(out, "runs", f"{kv}-server.json")
    if os.path.exists(p):
        servers[kv] = json.load(open(p))
    for c in conc.split(","):
        p = os.path.join(out, "runs", f"{kv}-c{c}.json")
        if os.path.exists(p):
            r = json.load(open(p))
            r.setdefault("concurrency", int(c))
            runs.append(r)
json.dump({"shape": shape, "kv_memory": mem, "prompt_tokens": int(prompt),
           "max_tokens": int(max_tokens), "servers": servers, "runs": runs},
          open(os.path.join(out, "serve_gpu_load.json"), "w"), indent=1)
f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"
lines = [f"{shape}, random weights, KV memory {mem}, prompts {prompt} tokens, outputs {max_tokens} tokens (ignore_eos, greedy)", "",
         "| KV | clients | done | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | running max / mean | step batch | preempt | graphs replayed / captured / eager | padded rows | top-k / full steps |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in runs:
    if "skipped" in r:
        lines.append(f"| {r['kv']} | {r['concurrency']} | skipped: {r['skipped']} |" + " |" * 9)
        continue
    s = r["server_counters"]
    g = lambda k: str(int(s.get(k, 0)))
    graphs = " / ".join(g('turbokv:step_graphs_total{run="%s"}' % k) for k in ("replayed", "captured", "eager"))
    logits = " / ".join(g('turbokv:step_logits_total{transfer="%s"}' % k) for k in ("top_k", "full"))
    cells = [r["kv"], str(r["concurrency"]), "%d/%d" % (r["requests_completed"], r["requests_sent"]),
             f(r["output_tok_s"], 0), f(r["ttft_ms_p50"]) + " / " + f(r["ttft_ms_p99"]),
             f(r["itl_ms_p50"], 2) + " / " + f(r["itl_ms_p99"], 2),
             f(r["running_max"], 0) + " / " + f(r["running_mean"]), f(r["mean_step_batch"]),
             g("vllm:num_preemptions_total"), graphs, g("turbokv:decode_padding_rows_total"), logits]
    lines.append("| " + " | ".join(cells) + " |")
lines.append("")
for kv, s in servers.items():
    lines.append(f"- {kv}: {s.get('server') or s.get('skipped')}")
text = "\n".join(lines) + "\n"
open(os.path.join(out, "serve_gpu_load.md"), "w").write(text)
print(text)
EOF
echo "serve_gpu_load: done in $(( $(date +%s) - START ))s" >&2
