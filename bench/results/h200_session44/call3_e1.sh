#!/usr/bin/env bash
# Session 44: the presets' perplexity on CUDA with the current binary, on every domain at ctx 1024.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/e1; mkdir -p "$R" /tmp/turbokv-ptx; export TMPDIR=/tmp
tar -xJf .gpu/s43/cub43.tar.xz -C /tmp/turbokv-ptx; T=$PWD/.gpu/s43/turbokv; chmod +x $T
ls -la /root/models
for d in wiki code dialogue; do
  timeout 150 $T eval ppl --model /root/models/m.gguf --text .gpu/s44/$d.txt --ctx 1024 --windows 4 \
    --kv 'int8,balanced,compact,tiny' --device cuda --json "$R/ppl_$d.json" > "$R/ppl_$d.txt" 2>&1
  echo "$d rc=$? t=$SECONDS"; tail -n 6 "$R/ppl_$d.txt"
done
