#!/usr/bin/env bash
# Session 46, call E: the demo model's perplexity on CUDA with main's build (tiny's int8 window
# copies read as bytes since session 45), against the CPU's exact reference of session 44.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/e; mkdir -p "$R" /tmp/c/turbokv-ptx
G=$PWD/.gpu/m3
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
sha256sum /root/models/m.gguf | tee "$R/sha.txt"
tar -xJf $G/cub.tar.xz -C /tmp/c/turbokv-ptx; chmod +x $G/turbokv
TMPDIR=/tmp/c timeout 400 $G/turbokv eval ppl --model /root/models/m.gguf --device cuda --text $G/wiki400k.txt \
  --ctx 512 --windows 4 --decode-last 256 --kv bf16,tiny,compact,balanced --json "$R/ppl_cuda_wiki400k_ctx512.json" > "$R/ppl.txt" 2>&1
echo "ppl rc=$? t=$SECONDS"; tail -15 "$R/ppl.txt"
tar -czf "$OUT/e.tgz" -C "$OUT" e && rm -rf "$R"
