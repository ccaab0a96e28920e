#!/usr/bin/env bash
# Session 45, call 6: the exact splits' shared online-softmax step (exact_softmax_step), the
# cuda_codes tests that run exact splits.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/c/turbokv-ptx
G=$PWD/.gpu/s45f
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
tar -xJf $G/cub_new6.tar.xz -C /tmp/c/turbokv-ptx; chmod +x $G/cuda_codes_new6
( cd crates/backend && TMPDIR=/tmp/c timeout 120 $G/cuda_codes_new6 --test-threads 1 windowed_coded folded_exact sliding_windows_over coded_prefill_on_the_decode ) > "$OUT/tests.txt" 2>&1
echo "rc=$?"; grep -E "^test |test result|panicked|skipping" -A1 "$OUT/tests.txt" | head -20
