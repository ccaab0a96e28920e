#!/usr/bin/env bash
# Session 46, call A: main (098dd05) on whatever card comes. (1) every CUDA test binary;
# (2) the issue's attention table against SDPA, and the presets' attention; (3) decode steps
# of bf16, compact and tiny at b8 x 32k and b32 x 8k; (4) one step kernel by kernel under ncu.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/a; mkdir -p "$R" /tmp/c/turbokv-ptx
G=$PWD/.gpu/s46
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub.tar.xz -C /tmp/c/turbokv-ptx; chmod +x $G/*
left() { echo $(( 575 - SECONDS )); }
t() { # crate binary timeout
  ( cd crates/$1 && TMPDIR=/tmp/c timeout $3 $G/$2 --test-threads 1 ) > "$R/tests_$2.txt" 2>&1
  echo "$2 rc=$? t=$SECONDS $(grep -E '^test result' "$R/tests_$2.txt" | tail -1)"
  grep -E "panicked|FAILED|skipping" "$R/tests_$2.txt" | head -5
}
t backend cuda_codes 150
t backend cuda_ops 60
t backend attention_variants 60
t model cuda_e2e 150
t model families 90
B="env TMPDIR=/tmp/c $G/turbokv"
timeout 170 $B bench attention --kv tq3,k4v2,k4v3,tq4,int8,fp8 --batch 1,8,32 --ctx 8k,32k,128k \
  --json "$R/table.json" --plot "$R/table.svg" > "$R/table.txt" 2>&1; echo "table rc=$? t=$SECONDS"
timeout 60 $B bench attention --kv compact,k4v2@w0s0+n,tiny,'tq2[17-18:k3v2][23-24:k3v2]',balanced,'k4v3[1:k4v4]' \
  --batch 1,8,32 --ctx 8k,32k --no-peer --json "$R/presets.json" > "$R/presets.txt" 2>&1; echo "presets rc=$? t=$SECONDS"
dec() { # name kv batch ctx
  [ "$(left)" -gt 45 ] || { echo "skip $1"; return; }
  timeout 60 $B bench decode --device cuda --shape llama3-8b --batch $3 --ctx $4 --kv "$2" --steps 32 \
    --json "$R/d_$1.json" > "$R/d_$1.txt" 2>&1
  echo "decode $1 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$1.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec bf16_b32_8k bf16 32 8192
dec compact_b32_8k compact 32 8192
dec tiny_b32_8k tiny 32 8192
dec bf16_b8_32k bf16 8 32768
dec compact_b8_32k compact 8 32768
dec tiny_b8_32k tiny 8 32768
for kv in compact bf16; do
  [ "$(left)" -gt 70 ] || { echo "skip ncu $kv"; continue; }
  TMPDIR=/tmp/c timeout 70 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    $G/turbokv bench decode --device cuda --shape llama3-8b --batch 32 --ctx 8192 --kv $kv --steps 8 --profile-step \
    > "$R/ncu_step_$kv.csv" 2> "$R/ncu_step_$kv.err"; echo "ncu $kv rc=$? t=$SECONDS"
  python3 bench/ncu_step_sum.py "$R/ncu_step_$kv.csv" > "$R/ncu_step_$kv.txt" 2>&1; tail -12 "$R/ncu_step_$kv.txt"
done
python3 - "$R" <<'PY'
import json, sys
R = sys.argv[1]
try:
    d = json.load(open(f"{R}/table.json"))
    for r in d["rows"]:
        if r.get("variant", "default") == "default":
            q = r.get("ratio_to_sdpa")
            print(r["kv"], r["batch"], r["ctx"], round(r["ms"], 4), r.get("sdpa_backend"), q and round(1 / q, 2), round(r["frac_copy_bw"], 2))
except Exception as e:
    print("table", e)
PY
