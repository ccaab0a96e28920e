#!/usr/bin/env bash
# Session 49, call A. The build is branch s49-splits (main + session 46's split rule,
# 25592f7: the per-SM split model at any pair count; with a window's exact splits and as many
# pairs as SMs, the coded blocks fill the slots). Its kernels are main's. At b >= 17 on 132
# SMs main's count is the wave model's, which TURBOKV_SM_LOAD_SPLITS=0 / --wave-splits give.
# (1) ncu stall reasons for the k4v2 and tq3 int8-product kernels at b32 x 32k (session 48's
# e.sh; the rule keeps the wave count there); (2) on an H200 only, the attention table against
# SDPA at 32k and 128k (same counts as main); (3) the split rule's A/B at b32 and b64 x 8k and 32k, attention
# and decode steps. (A second call, for the demo model's perplexity on CUDA, would have joined
# the model from a part this one moved to /root; it was dropped for want of device time.)
# Needs (ignored, local): .gpu/s49a = that turbokv and cub.tar.xz of main's cubins.
# Run: `run` with carry [".gpu/s49a"], command `bash bench/results/session49/a.sh`.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/a; mkdir -p "$R" /root/models /root/s49 /tmp/d/turbokv-ptx
snap() { tar -czf "$OUT/a.tgz.tmp" -C "$OUT" a $( [ -d "$OUT/e" ] && echo e ) && mv "$OUT/a.tgz.tmp" "$OUT/a.tgz"; }
cp .gpu/s49a/turbokv .gpu/s49a/cub.tar.xz /root/s49/; [ -f .gpu/s49a/m.aa ] && mv .gpu/s49a/m.aa /root/models/
ln -sfn s49a .gpu/s48t; tar -xJf .gpu/s49a/cub.tar.xz -C /tmp/d/turbokv-ptx; chmod +x .gpu/s49a/turbokv
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$R/gpu.txt"
T="env TMPDIR=/tmp/d $PWD/.gpu/s49a/turbokv"
timeout 80 $T bench attention --kv 'compact,tq3,k4v2,k4v3@w2%s1[1:k4v4],tiny' --batch 32,64 --ctx 8k,32k \
  --no-peer --wave-splits --json "$R/splits.json" > "$R/splits.txt" 2>&1
echo "splits rc=$? t=$SECONDS"; tail -25 "$R/splits.txt"; snap
dec() { # name kv batch ctx [env]
  [ $SECONDS -lt 230 ] || { echo "skip $1"; return; }
  timeout 45 env ${5:-X=1} $T bench decode --device cuda --shape llama3-8b --batch $3 --ctx $4 --kv "$2" --steps 32 \
    --json "$R/d_$1.json" > "$R/d_$1.txt" 2>&1
  echo "decode $1 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$1.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
for i in 1 2; do
  dec compact_rule$i compact 32 8192
  dec compact_wave$i compact 32 8192 TURBOKV_SM_LOAD_SPLITS=0
done
snap
[ $SECONDS -lt 200 ] && timeout 90 bash bench/results/h100_session48/e.sh > "$R/e_stdout.txt" 2>&1; echo "e rc=$? t=$SECONDS"
tail -40 "$R/e_stdout.txt"; snap
grep -q H200 "$R/gpu.txt" && [ $SECONDS -lt 200 ] && timeout 90 $T bench attention --kv 'tq3,tq4,k4v3,int8,fp8,k4v3@w2%s1[1:k4v4],compact' \
  --batch 1,8,32 --ctx 32k,128k --json "$R/att.json" > "$R/att.txt" 2>&1
echo "att rc=$? t=$SECONDS"; tail -45 "$R/att.txt"; snap
dec balanced_rule 'k4v3@w2%s1[1:k4v4]' 32 8192
dec balanced_wave 'k4v3@w2%s1[1:k4v4]' 32 8192 TURBOKV_SM_LOAD_SPLITS=0
dec bf16 bf16 32 8192
dec tq3_rule tq3 32 8192
dec tq3_wave tq3 32 8192 TURBOKV_SM_LOAD_SPLITS=0
snap
