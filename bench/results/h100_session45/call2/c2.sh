#!/usr/bin/env bash
# Session 45, call 2: exact splits of several 64-key chunks (CudaOptions::exact_split_keys,
# TURBOKV_EXACT_SPLIT_KEYS) beside int8 copies read as bytes. (1) the cuda_codes tests that
# run exact splits; (2) attention alone at keys per exact split 64 (call 1's build), 128, 256,
# 512, 1024 and main's build (A), alternating twice, llama3-8b shape and the demo's; (3) end to
# end at b8 x 32k (tiny) and b32 x 8k (compact, bf16).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/r2; mkdir -p "$R" /tmp/a/turbokv-ptx /tmp/c/turbokv-ptx
G=$PWD/.gpu/s45b
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub_main.tar.xz -C /tmp/a/turbokv-ptx
tar -xJf $G/cub_new2.tar.xz -C /tmp/c/turbokv-ptx
chmod +x $G/turbokv_main $G/turbokv_new2 $G/cuda_codes_new2
left() { echo $(( 560 - SECONDS )); }
chmod +x $G/cuda_codes_mainmap
( cd crates/backend && TMPDIR=/tmp/a timeout 100 $G/cuda_codes_mainmap --test-threads 1 windowed_coded ) > "$R/tests_mainmap.txt" 2>&1
echo "main's kernels, new windowed cases: rc=$? t=$SECONDS"; grep -E "^test |test result|panicked|skipping" -A1 "$R/tests_mainmap.txt" | head -8
( cd crates/backend && TMPDIR=/tmp/c timeout 200 $G/cuda_codes_new2 --test-threads 1 windowed_coded folded_exact sliding_windows_over coded_prefill_on_the_decode ) > "$R/tests.txt" 2>&1
echo "tests rc=$? t=$SECONDS"; grep -E "^test |test result|panicked|skipping" -A1 "$R/tests.txt" | head -20
pre() { # the command for K: A (main's build) or a key count for the new build
  if [ "$1" = A ]; then echo "env TMPDIR=/tmp/a $G/turbokv_main"
  else echo "env TMPDIR=/tmp/c TURBOKV_EXACT_SPLIT_KEYS=$1 $G/turbokv_new2"; fi
}
KV8='tiny,tq2[17-18:k3v2][23-24:k3v2],compact,k4v2@w2.4%s1q8+n,k4v2'
for rep in 1 2; do
  for k in A 64 128 256 512 1024; do
    [ "$(left)" -gt 260 ] || { echo "skip att $k$rep"; continue; }
    timeout 40 $(pre $k) bench attention --kv "$KV8" --batch 8,32 --ctx 8k,32k --no-peer \
      --json "$R/att_${k}_${rep}.json" > "$R/att_${k}_${rep}.txt" 2>&1
    echo "att $k $rep rc=$? t=$SECONDS"
    timeout 30 $(pre $k) bench attention --kv 'tiny,tq2,k4v2@w1.2%s1+n,k4v2' --heads 9 --kv-heads 3 --head-dim 64 \
      --batch 8,32 --ctx 8k,32k --no-peer --json "$R/demo_${k}_${rep}.json" > "$R/demo_${k}_${rep}.txt" 2>&1
    echo "demo $k $rep rc=$? t=$SECONDS"
  done
done
python3 - "$R" <<'PY'
import json, glob, sys, os, collections
R = sys.argv[1]
t = collections.defaultdict(list)
for f in sorted(glob.glob(f"{R}/att_*.json") + glob.glob(f"{R}/demo_*.json")):
    shape = os.path.basename(f).split("_")[0]; k = os.path.basename(f).split("_")[1]
    try: d = json.load(open(f))
    except Exception as e: print(f, e); continue
    rows = d["rows"]
    for r in rows:
        if r.get("variant", "default") != "default": continue
        t[(shape, r["kv"], r["batch"], r["ctx"], k)].append(r["ms"])
for key in sorted(t): print(*key, " ".join(f"{x:.4f}" for x in t[key]))
PY
dec() { # name K kv batch ctx
  local n=$1 k=$2 kv=$3 b=$4 c=$5
  [ "$(left)" -gt 40 ] || { echo "skip $n"; return; }
  timeout $(( $(left) < 60 ? $(left) : 60 )) $(pre $k) bench decode --device cuda --shape llama3-8b \
    --batch $b --ctx $c --kv "$kv" --steps 32 --json "$R/d_$n.json" > "$R/d_$n.txt" 2>&1
  echo "decode $n rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec tiny_b8_32k_A A tiny 8 32768
dec tiny_b8_32k_64 64 tiny 8 32768
dec tiny_b8_32k_256 256 tiny 8 32768
dec tiny_b8_32k_512 512 tiny 8 32768
dec plain_b8_32k_256 256 'tq2[17-18:k3v2][23-24:k3v2]' 8 32768
dec compact_b32_8k_A A compact 32 8192
dec compact_b32_8k_256 256 compact 32 8192
dec bf16_b32_8k_256 256 bf16 32 8192
dec compact_b8_32k_256 256 compact 8 32768
tar -czf "$OUT/r2.tgz" -C "$OUT" r2
