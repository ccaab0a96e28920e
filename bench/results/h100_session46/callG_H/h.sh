#!/usr/bin/env bash
# Session 46, call H: the per-SM split model at many pairs (branch s46-splits): decode steps of
# the new default against TURBOKV_SM_LOAD_SPLITS=0 (the wave model, main's count at these
# batches), alternating; attention alone beside --wave-splits.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/h; mkdir -p "$R" /tmp/c/turbokv-ptx
G=$PWD/.gpu/s46h
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub.tar.xz -C /tmp/c/turbokv-ptx; chmod +x $G/turbokv
B="env TMPDIR=/tmp/c $G/turbokv"
timeout 40 $B bench attention --kv compact,tq3,k4v2 --batch 32,64 --ctx 8k --no-peer --wave-splits \
  --json "$R/att.json" > "$R/att.txt" 2>&1; echo "att rc=$? t=$SECONDS"
python3 - "$R/att.json" <<'PY'
import json, sys, collections
t = collections.defaultdict(dict)
for r in json.load(open(sys.argv[1]))["rows"]:
    t[(r["kv"][:12], r["batch"], r["ctx"])][r["variant"]] = r["ms"] * 1000
for k in sorted(t): print(*k, "  ".join(f"{v}:{x:.1f}" for v, x in sorted(t[k].items())))
PY
dec() { # name sm_load kv batch ctx
  [ $SECONDS -lt 120 ] || { echo "skip $1"; return; }
  timeout 30 env TURBOKV_SM_LOAD_SPLITS=$2 $B bench decode --device cuda --shape llama3-8b --batch $4 --ctx $5 --kv "$3" --steps 32 \
    --json "$R/d_$1.json" > "$R/d_$1.txt" 2>&1
  echo "decode $1 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$1.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec compact_b32_8k_new1 1 compact 32 8192
dec compact_b32_8k_wave1 0 compact 32 8192
dec compact_b32_8k_new2 1 compact 32 8192
dec compact_b32_8k_wave2 0 compact 32 8192
dec tq3_b32_8k_new 1 tq3 32 8192
dec tq3_b32_8k_wave 0 tq3 32 8192
tar -czf "$OUT/h.tgz" -C "$OUT" h && rm -rf "$R"
