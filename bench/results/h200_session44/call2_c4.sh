#!/usr/bin/env bash
# Session 42, call 4: join the demo model; its perplexity on CUDA for the presets with int8 window
# copies (q8) beside today's, as session 34 measured (wiki400k, ctx 512, 4 windows, last 256
# tokens through decode steps); the CPU f32 reference runs on the development machine.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/res; W=/tmp/w42b; mkdir -p "$R" "$W" /tmp/turbokv-ptx; export TMPDIR=/tmp
[ -x $W/turbokv ] || { tar -xJf .gpu/s42/b2.tar.xz -C "$W"; cp "$W"/cubins/* /tmp/turbokv-ptx/; }
[ -f /root/models/m.gguf ] || cat /root/models/half.aa .gpu/m2/half.ab | xz -d > /root/models/m.gguf || exit 1
sha256sum /root/models/m.gguf | tee "$R/sha.txt"
KV='compact,k4v2@w2.4%s1q8+n[1:k4v4],tiny,tq2@w2.9%s1q8+cn[17-18:k3v2][23-24:k3v2],balanced,k4v3@w8.5%s1q8[1:k4v4]'
for fold in 0; do
  TURBOKV_FOLD_EXACT_SPLITS=$fold timeout 250 $W/turbokv eval ppl --model /root/models/m.gguf --text .gpu/m2/wiki400k.txt --ctx 512 \
    --windows 4 --decode-last 256 --kv "$KV" --device cuda --json "$R/ppl_cuda_fold$fold.json" > "$R/ppl_cuda_fold$fold.txt" 2>&1
  echo "fold $fold rc=$? t=$SECONDS"; tail -n 9 "$R/ppl_cuda_fold$fold.txt"
done
tar -czf "$OUT/res4.tgz" -C "$OUT" res
