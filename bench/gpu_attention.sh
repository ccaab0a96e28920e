#!/usr/bin/env bash
# One GPU-machine session for the attention work: correctness first (the CUDA op tests
# against the CPU backend), then `turbokv bench attention` with the SDPA peer, then optional
# end-to-end decode points. Expects the release binary and test binaries under .gpu/ (built
# on a development machine: see BENCHMARKS.md) and writes logs and JSON under $OUT.
#   bench/gpu_attention.sh [tests] [attention] [variants] [contig] [decode] [ppl]
# Environment: ATTN_KV (formats of `attention`, default bf16,f16), ATTN_ARGS (more flags),
# DECODE_KV (formats of `decode`, default bf16), DECODE_POINTS (batch:ctx list), DEMO_MODEL,
# PPL_TEXT and PPL_KV (`ppl`: the demo model's perplexity on CUDA and on the CPU).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BIN=.gpu/turbokv
ATTN_ARGS=${ATTN_ARGS:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/tests.txt"
for part in "$@"; do
    case "$part" in
    tests)
        for t in .gpu/cuda_codes .gpu/cuda_ops .gpu/cuda_e2e; do
            [ -x "$t" ] || continue
            echo "== $t"
            timeout 300 "$t" --test-threads 1 2>&1 | tail -40 | tee -a "$OUT/tests.txt"
        done ;;
    attention)
        echo "== bench attention"
        timeout 400 "$BIN" bench attention --kv "${ATTN_KV:-bf16,f16}" --batch 1,8,32 --ctx 8k,32k,128k $ATTN_ARGS \
            --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.txt" ;;
    variants)
        echo "== bench attention, every variant (bf16)"
        timeout 400 "$BIN" bench attention --kv bf16 --batch 1,8,32 --ctx 8k,32k,128k $ATTN_ARGS \
            --compare-variants --no-peer --json "$OUT/variants.json" 2>&1 | tee "$OUT/variants.txt" ;;
    contig)
        echo "== bench attention (bf16), consecutive blocks"
        timeout 400 "$BIN" bench attention --kv bf16 --batch 1,8,32 --ctx 8k,32k,128k \
            --no-peer --contiguous-blocks --json "$OUT/contig.json" 2>&1 | tee "$OUT/contig.txt" ;;
    decode)
        for kv in ${DECODE_KV:-bf16}; do
            for bc in ${DECODE_POINTS:-1:4096 8:4096 32:4096 8:32768}; do
                b=${bc%%:*}; c=${bc##*:}
                echo "== bench decode $kv batch $b ctx $c"
                timeout 200 "$BIN" bench decode --device cuda --shape llama3-8b --batch "$b" \
                    --ctx "$c" --kv "$kv" --steps 32 2>&1 | tail -8 | tee -a "$OUT/decode.txt"
            done
        done ;;
    ppl)
        m=${DEMO_MODEL:-/root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
        if [ ! -f "$m" ]; then echo "no demo model at $m"; continue; fi
        for dev in cuda cpu; do
            echo "== eval ppl $dev"
            timeout 300 "$BIN" eval ppl --model "$m" --text "${PPL_TEXT:-.gpu/wiki400k.txt}" --ctx 512 \
                --windows 4 --kv "${PPL_KV:-bf16,compact,balanced}" --device "$dev" \
                --json "$OUT/ppl_$dev.json" 2>&1 | tail -20 | tee -a "$OUT/ppl.txt"
        done ;;
    esac
done
