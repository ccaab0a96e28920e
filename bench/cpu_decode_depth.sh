#!/usr/bin/env bash
# CPU decode at a deep context: turbokv per KV format and preset beside llama.cpp's own
# `llama-bench` at the same depth (f16 KV, flash attention), one process after another in
# one run, for each thread count. Not run by CI.
#
# llama-bench comes from the llama-cpp-python sdist's vendored llama.cpp, built with the
# x86 features switched on explicitly (the native build crashes on the development machine):
#   cmake -S vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
#     -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-bench
#
# Usage: LLAMA_BENCH=path/to/llama-bench bench/cpu_decode_depth.sh [DEPTH] [THREADS] [KV ...]
#   defaults: 8000, "2 1", bf16 tq3 k4v2[1:k4v4] compact k4v3[1:k4v4] balanced
#   TURBOKV_BIN: the binary (target/release/turbokv); OUT: the JSON folder
#   (bench/results/cpu_decode_d$DEPTH); GEN: generated tokens per run (32; more tokens
#   average out more of a noisy machine's drift); REPEATS: turbokv runs per process, the
#   median reported (1). ROUNDS: instead of one process per format, one process that
#   prefills every format once and then decodes GEN tokens with each in turn, ROUNDS rounds
#   (`bench model --interleave`), from a prompt of DEPTH − ROUNDS·GEN/2 tokens so that the
#   segments' mean depth is DEPTH: the machine's drift then falls on every format alike.
#   bench/interleaved_ratios.py turns that run's JSON into preset / plain ratios with
#   intervals (14 rounds settle a ratio to about ±2–3% on a 2-vCPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
depth=${1:-8000}
threads=${2:-"2 1"}
shift $(( $# > 2 ? 2 : $# ))
kvs=("$@")
[ ${#kvs[@]} -gt 0 ] || kvs=(bf16 tq3 'k4v2[1:k4v4]' compact 'k4v3[1:k4v4]' balanced)
model=${TURBOKV_MODEL:-$HOME/.cache/turbokv/models/SmolLM2-135M-Instruct.Q4_1.gguf}
bin=${TURBOKV_BIN:-target/release/turbokv}
out=${OUT:-bench/results/cpu_decode_d${depth}}
mkdir -p "$out"
gen=${GEN:-32}
repeats=${REPEATS:-1}
ctx=$(( (depth + gen + 32 + 1023) / 1024 * 1024 ))
for t in $threads; do
  if [ -n "${LLAMA_BENCH:-}" ]; then
    "$LLAMA_BENCH" -m "$model" -t "$t" -d "$depth" -p 0 -n "$gen" -fa on -r 2 -o json \
      > "$out/llama_bench_t$t.json"
  fi
  if [ -n "${ROUNDS:-}" ]; then
    rest=$(IFS=,; echo "${kvs[*]:1}")
    "$bin" bench model --model "$model" --threads "$t" --kv "${kvs[0]}" --interleave "$rest" \
      --prompt-tokens $(( depth - ROUNDS * gen / 2 )) --gen-tokens "$gen" --repeats "$ROUNDS" \
      --ctx "$ctx" --json "$out/turbokv_interleaved_t$t.json"
    continue
  fi
  for kv in "${kvs[@]}"; do
    name=$(echo "$kv" | tr -c 'a-z0-9\n' '_')
    "$bin" bench model --model "$model" --threads "$t" --kv "$kv" --prompt-tokens "$depth" \
      --gen-tokens "$gen" --repeats "$repeats" --ctx "$ctx" --json "$out/turbokv_${name}_t$t.json"
  done
done
