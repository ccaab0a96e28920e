#!/usr/bin/env bash
# One GPU-machine call for the integer-MMA coded attention (issue 18): the coded-pool
# correctness tests against the CPU backend first, then `bench attention` with the SDPA peer.
# Expects .gpu/{turbokv,cuda_codes,cuda_ops,cuda_e2e} and .gpu/ptx (scripts/cuda-check.py
# --ptx-cache .gpu/ptx) built on a development machine; writes logs and JSON under $OUT.
#   bench/gpu_imma.sh [tests] [quick] [attention] [decode] [ppl]
# Environment: ATTN_KV, ATTN_BATCH, ATTN_CTX (attention points), DECODE_KV, DECODE_POINTS.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "${TMPDIR:-/tmp}/turbokv-ptx"
tar xzf .gpu/ptx.tgz -C "${TMPDIR:-/tmp}" && mv "${TMPDIR:-/tmp}"/ptx/* "${TMPDIR:-/tmp}/turbokv-ptx/"
BIN=.gpu/turbokv
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
for part in "$@"; do
    start=$(date +%s)
    case "$part" in
    tests)
        for t in cuda_codes cuda_ops cuda_e2e; do
            [ -x ".gpu/$t" ] || continue
            echo "== $t"
            timeout 300 ".gpu/$t" --test-threads 1 > "$OUT/$t.txt" 2>&1
            echo "rc $?"; tail -15 "$OUT/$t.txt"
        done ;;
    quick)
        echo "== bench attention (quick)"
        timeout 240 "$BIN" bench attention --kv "${ATTN_KV:-int8,tq3,k4v2}" --batch 8 --ctx 32k \
            --json "$OUT/quick.json" 2>&1 | tail -30 | tee "$OUT/quick.txt" ;;
    attention)
        echo "== bench attention"
        timeout 400 "$BIN" bench attention --kv "${ATTN_KV:-int8,tq4,k4v3,tq3,tq2,k4v2}" \
            --batch "${ATTN_BATCH:-1,8,32}" --ctx "${ATTN_CTX:-8k,32k,128k}" \
            --json "$OUT/attention.json" 2>&1 | tail -60 | tee "$OUT/attention.txt" ;;
    decode)
        for kv in ${DECODE_KV:-bf16 compact}; do
            for bc in ${DECODE_POINTS:-8:32768 32:8192}; do
                b=${bc%%:*}; c=${bc##*:}
                echo "== bench decode $kv batch $b ctx $c"
                timeout 150 "$BIN" bench decode --device cuda --shape llama3-8b --batch "$b" \
                    --ctx "$c" --kv "$kv" --steps 32 2>&1 | tail -6 | tee -a "$OUT/decode.txt"
            done
        done ;;
    ppl)
        m=${DEMO_MODEL:-/root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
        if [ ! -f "$m" ]; then echo "no demo model at $m"; continue; fi
        for dev in cuda cpu; do
            echo "== eval ppl $dev"
            timeout 300 "$BIN" eval ppl --model "$m" --text "${PPL_TEXT:-.gpu/wiki400k.txt}" --ctx 512 \
                --windows 4 --kv "${PPL_KV:-bf16,int8,tq4,k4v3,tq3,compact,balanced}" --device "$dev" \
                --json "$OUT/ppl_$dev.json" 2>&1 | tail -20 | tee -a "$OUT/ppl.txt"
        done ;;
    esac
    echo "[$part: $(( $(date +%s) - start )) s]"
done
