#!/usr/bin/env bash
# Session 45, call 1: int8 window copies staged as stored (cp.async, 64 keys at once) and read as
# bytes in the exact splits. (1) the cuda_codes tests that run exact splits, on the new build;
# (2) attention alone, main's build (A) against the new one (B), alternating, llama3-8b shape
# and the demo's; (3) end to end: tiny A/B at b8 x 32k; bf16, compact and compact's q8 twin at
# b32 x 8k (B).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/r1; mkdir -p "$R" /tmp/a/turbokv-ptx /tmp/b/turbokv-ptx
G=$PWD/.gpu/s45
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub_main.tar.xz -C /tmp/a/turbokv-ptx
tar -xJf $G/cub_new.tar.xz -C /tmp/b/turbokv-ptx
chmod +x $G/turbokv_main $G/turbokv_new $G/cuda_codes_new
A="env TMPDIR=/tmp/a $G/turbokv_main"; B="env TMPDIR=/tmp/b $G/turbokv_new"
left() { echo $(( 560 - SECONDS )); }
( cd crates/backend && TMPDIR=/tmp/b timeout 170 $G/cuda_codes_new --test-threads 1 windowed_coded folded_exact sliding_windows_over coded_prefill_on_the_decode ) > "$R/tests.txt" 2>&1
echo "tests rc=$? t=$SECONDS"; grep -E "^test |test result|panicked|skipping" "$R/tests.txt" | head -20
KV8='tiny,tq2[17-18:k3v2][23-24:k3v2],compact,k4v2@w2.4%s1q8+n,k4v2'
for rep in 1 2; do
  for w in A B; do
    [ "$(left)" -gt 200 ] || { echo "skip att $w$rep"; continue; }
    timeout 60 ${!w} bench attention --kv "$KV8" --batch 8,32 --ctx 8k,32k --no-peer \
      --json "$R/att_${w}${rep}.json" > "$R/att_${w}${rep}.txt" 2>&1
    echo "att $w$rep rc=$? t=$SECONDS"
    timeout 40 ${!w} bench attention --kv 'tiny,tq2' --heads 9 --kv-heads 3 --head-dim 64 \
      --batch 8,32 --ctx 8k,32k --no-peer --json "$R/demo_${w}${rep}.json" > "$R/demo_${w}${rep}.txt" 2>&1
    echo "demo $w$rep rc=$? t=$SECONDS"
  done
done
for f in "$R"/att_*.txt "$R"/demo_*.txt; do echo "== $f"; grep -E "^(tiny|tq2|compact|k4v2)" "$f"; done
dec() { # name which kv batch ctx
  local n=$1 w=$2 kv=$3 b=$4 c=$5
  [ "$(left)" -gt 45 ] || { echo "skip $n"; return; }
  timeout $(( $(left) < 75 ? $(left) : 75 )) ${!w} bench decode --device cuda --shape llama3-8b \
    --batch $b --ctx $c --kv "$kv" --steps 32 --json "$R/d_$n.json" > "$R/d_$n.txt" 2>&1
  echo "decode $n rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec tiny_b8_32k_B B tiny 8 32768
dec tiny_b8_32k_A A tiny 8 32768
dec compact_b32_8k_B B compact 32 8192
dec bf16_b32_8k_B B bf16 32 8192
dec q8twin_b32_8k_B B 'k4v2@w2.4%s1q8+n[1:k4v4]' 32 8192
tar -czf "$OUT/r1.tgz" -C "$OUT" r1
