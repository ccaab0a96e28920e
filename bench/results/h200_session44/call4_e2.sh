#!/usr/bin/env bash
# Session 44: the presets' perplexity on CUDA with the current binary, on every domain at ctx 1024.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/e2; mkdir -p "$R" /tmp/turbokv-ptx; export TMPDIR=/tmp
tar -xJf .gpu/s43/cub43.tar.xz -C /tmp/turbokv-ptx; T=$PWD/.gpu/s43/turbokv; chmod +x $T
ls -la /root/models
for d in wiki code dialogue; do
  timeout 140 $T eval ppl --model /root/models/m.gguf --text .gpu/s44/$d.txt --ctx 4096 --windows 4 \
    --kv 'int8,balanced,compact,tiny' --device cuda --json "$R/ppl_$d.json" > "$R/ppl_$d.txt" 2>&1
  echo "$d rc=$? t=$SECONDS"; tail -n 6 "$R/ppl_$d.txt"
done
Q=$PWD/.gpu/s43/turbokv
for p in "tiny 8 32768" "tq2[17-18:k3v2][23-24:k3v2] 8 32768" "tiny 32 8192" "tq2[17-18:k3v2][23-24:k3v2] 32 8192"; do
  set -- $p
  timeout 60 $Q bench decode --device cuda --shape llama3-8b --batch $2 --ctx $3 --kv "$1" --steps 32 --json "$R/d_$2_$3_${1:0:4}.json" > /dev/null 2>&1
  echo "decode $1 b$2 ctx$3 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$2_$3_${1:0:4}.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
done
