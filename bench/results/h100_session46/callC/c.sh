#!/usr/bin/env bash
# Session 46, call C: the tensor-core skinny matmul (gemm_mma_*). (1) tests; (2) the matmul
# kernels alone at llama3-8b's shapes, 1-64 rows (ignored speed test); (3) decode steps with
# it (default) and without it (TURBOKV_MMA_GEMM_MAX_ROWS=0: cuBLAS, main's path), alternating;
# (4) one compact step kernel by kernel under ncu.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/b; mkdir -p "$R" /tmp/c/turbokv-ptx
G=$PWD/.gpu/s46c
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub.tar.xz -C /tmp/c/turbokv-ptx; chmod +x $G/*
left() { echo $(( 560 - SECONDS )); }
t() { # crate binary timeout [filter]
  ( cd crates/$1 && TMPDIR=/tmp/c timeout $3 $G/$2 --test-threads 1 ${4:-} ) > "$R/tests_$2.txt" 2>&1
  echo "$2 rc=$? t=$SECONDS $(grep -E '^test result' "$R/tests_$2.txt" | tail -1)"
  grep -E "panicked|FAILED|skipping|tensor cores \[" "$R/tests_$2.txt" | head -20
}
t backend cuda_ops 90
( cd crates/backend && TMPDIR=/tmp/c timeout 240 $G/cuda_ops --ignored --nocapture skinny_matmul_speed ) > "$R/speed.txt" 2>&1
echo "speed rc=$? t=$SECONDS"; grep -E '^m=|^splits=|copy' "$R/speed.txt"
B="env TMPDIR=/tmp/c $G/turbokv"
dec() { # name rows kv batch ctx
  [ "$(left)" -gt 40 ] || { echo "skip $1"; return; }
  timeout 50 env TURBOKV_MMA_GEMM_MAX_ROWS=$2 $B bench decode --device cuda --shape llama3-8b --batch $4 --ctx $5 --kv "$3" --steps 32 \
    --json "$R/d_$1.json" > "$R/d_$1.txt" 2>&1
  echo "decode $1 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$1.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec bf16_b32_8k_mma 64 bf16 32 8192
dec bf16_b32_8k_blas 0 bf16 32 8192
dec compact_b32_8k_mma 64 compact 32 8192
dec compact_b32_8k_blas 0 compact 32 8192
dec bf16_b16_4k_mma 64 bf16 16 4096
dec bf16_b16_4k_blas 0 bf16 16 4096
dec bf16_b8_4k_mma 64 bf16 8 4096
dec bf16_b8_4k_blas 0 bf16 8 4096
if [ "$(left)" -gt 60 ]; then
  TMPDIR=/tmp/c timeout 60 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    $G/turbokv bench decode --device cuda --shape llama3-8b --batch 32 --ctx 8192 --kv compact --steps 8 --profile-step \
    > "$R/ncu_step_compact.csv" 2> "$R/ncu_step_compact.err"; echo "ncu rc=$? t=$SECONDS"
  python3 bench/ncu_step_sum.py "$R/ncu_step_compact.csv" > "$R/ncu_step_compact.txt" 2>&1; head -14 "$R/ncu_step_compact.txt"
fi
tar -czf "$OUT/b.tgz" -C "$OUT" b && rm -rf "$R"
