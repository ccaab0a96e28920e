#!/usr/bin/env bash
# Session 44, call 5 (trimmed to the budget left): tiny's exact splits folded into the coded
# blocks (opt-in since session 42) against the default, attention alone and end to end.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/e4; mkdir -p "$R" /tmp/turbokv-ptx; export TMPDIR=/tmp
tar -xJf .gpu/s43/cub43.tar.xz -C /tmp/turbokv-ptx; T=$PWD/.gpu/s43/turbokv; chmod +x $T
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
P='tq2[17-18:k3v2][23-24:k3v2]'
timeout 60 $T bench attention --kv "tiny,$P" --batch 8,32 --ctx 8k,32k --no-peer --fold-exact-splits --json "$R/att_fold.json" > "$R/att_fold.txt" 2>&1
echo "att fold rc=$? t=$SECONDS"; grep -E "^(tiny|tq2)" "$R/att_fold.txt"
n=0
for p in "tiny 8 32768 1" "tiny 8 32768 0" "tiny 32 8192 1" "tiny 32 8192 0"; do
  set -- $p; n=$((n+1))
  TURBOKV_FOLD_EXACT_SPLITS=$4 timeout 40 $T bench decode --device cuda --shape llama3-8b --batch $2 --ctx $3 --kv "$1" --steps 32 --json "$R/d$n.json" > /dev/null 2>&1
  echo "decode $1 b$2 ctx$3 fold=$4 rc=$? $(python3 -c "import json;d=json.load(open('$R/d$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
done
