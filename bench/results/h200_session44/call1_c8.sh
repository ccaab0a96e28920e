#!/usr/bin/env bash
# Session 43, the one call: (1) the tq3 d=128 case of coded_prefill_on_the_decode (failed in
# session 42) with diagnostics on the row-kernel backend with int8 values / f16 values / f16
# keys and on the tile prefill; (2) the test as landed (FEW_KEY_ROWS_ATOL) and neighbours;
# (3) compact against its q8-window twin (`k4v2@w2.4%s1q8+n[1:k4v4]`, better on every domain
# on the CPU) in attention and end to end.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/res8; mkdir -p "$R" /tmp/turbokv-ptx; export TMPDIR=/tmp
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf .gpu/s43/cub43.tar.xz -C /tmp/turbokv-ptx
T=$PWD/.gpu/s43/turbokv; chmod +x "$T" .gpu/s43/cuda_codes_diag
left() { echo $(( 200 - SECONDS )); }
( cd crates/backend && timeout 90 ../../.gpu/s43/cuda_codes_diag --test-threads 1 coded_prefill_on_the_decode coded_pools_match windowed_coded ) > "$R/tests.txt" 2>&1
echo "tests rc=$? t=$SECONDS"; grep -E "^test |test result|panicked" -A1 "$R/tests.txt" | grep -v DIAG | head -20
( cd crates/backend && TKV_NOPANIC=1 timeout 60 ../../.gpu/s43/cuda_codes_diag --test-threads 1 diag_s43 --nocapture ) > "$R/diag.txt" 2>&1
echo "diag rc=$? t=$SECONDS"
grep -E "DIAG backend|rows over|panicked" "$R/diag.txt" | head -40
grep -E "over-tol [0-9]" "$R/diag.txt" | head -12
Q='k4v2@w2.4%s1q8+n[1:k4v4]'
timeout 60 $T bench attention --kv "compact,$Q" --batch 8,32 --ctx 8k,32k --no-peer --json "$R/att.json" > "$R/att.txt" 2>&1
echo "att rc=$? t=$SECONDS"; grep -E "^(compact|k4v2)" "$R/att.txt"
dec() { # name kv batch ctx
  local n=$1 kv=$2 b=$3 c=$4
  [ "$(left)" -gt 40 ] || { echo "skip $n"; return; }
  timeout $(( $(left) < 70 ? $(left) : 70 )) $T bench decode --device cuda --shape llama3-8b \
    --batch $b --ctx $c --kv "$kv" --steps 32 --json "$R/d_$n.json" > "$R/d_$n.txt" 2>&1
  echo "decode $n rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec compact_b8_32k compact 8 32768
dec q8_b8_32k "$Q" 8 32768
dec compact_b32_8k compact 32 8192
dec q8_b32_8k "$Q" 32 8192
tar -czf "$OUT/res8.tgz" -C "$OUT" res8
