#!/usr/bin/env bash
# Session 51, call C: the per-head test again (the decode-kernel prefill backend at its
# few-key tolerance), then per-head decode steps beside tiny's, alternating.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/c; mkdir -p "$R" /tmp/cb/turbokv-ptx
GB=$PWD/.gpu/s51b
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $GB/cub.tar.xz -C /tmp/cb/turbokv-ptx; chmod +x $GB/*
( cd crates/backend && TMPDIR=/tmp/cb timeout 300 $GB/cuda_codes --test-threads 1 per_head ) > "$R/t_perhead.txt" 2>&1
echo "perhead rc=$? t=$SECONDS $(grep -E '^test result' "$R/t_perhead.txt" | tail -1)"
grep -E "panicked" -A2 "$R/t_perhead.txt" | head -6
grep -c "max err" "$R/t_perhead.txt"
grep -oE "max err [0-9.e-]+" "$R/t_perhead.txt" | sort -k3 -g | tail -3
H='tq2@w2.9%s1q8+cn'; TH="$H[18.2,23.0,10.1,20.2,8.0,20.1,23.2,4.2,7.2,17.1,14.1,24.0:k3v2]"
for i in 1 2; do for kv in "$TH" tiny; do
  [ $SECONDS -lt $((${LIMIT:-480} - 50)) ] || break 2
  n=$([ "$kv" = tiny ] && echo tiny || echo heads)$i
  timeout 45 env TMPDIR=/tmp/cb $GB/turbokv bench decode --device cuda --shape llama3-8b --batch 32 --ctx 8192 --kv "$kv" --steps 32 \
    --json "$R/d_$n.json" > "$R/d_$n.txt" 2>&1
  echo "decode $n rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
done; done
tar -czf "$OUT/c.tgz" -C "$OUT" c && rm -rf "$R"
