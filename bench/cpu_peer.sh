#!/usr/bin/env bash
# turbokv vs llama.cpp on the CPU, same GGUF, same prompts (first N tokens of wiki.txt),
# same thread counts, one after the other in one run. llama.cpp runs through
# llama-cpp-python in the reference venv (never needed by CI):
#   python3 -m venv ~/.cache/turbokv/refvenv && ~/.cache/turbokv/refvenv/bin/pip install llama-cpp-python==0.3.36 numpy
# Usage: bench/cpu_peer.sh [extra turbokv bench model args]
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
cargo build --release -q -p turbokv
for t in 1 2; do
  target/release/turbokv bench model --threads "$t" --prompt-tokens 128,1024 --gen-tokens 128 \
    --repeats 3 --json "$out/turbokv_cpu_t$t.json" "$@"
done
"${TURBOKV_REFVENV:-$HOME/.cache/turbokv/refvenv}/bin/python" bench/llamacpp_peer.py \
  --threads 1,2 --prompt-lens 128,1024 --gen 128 --repeats 3 --json "$out/llamacpp_peer.json"
