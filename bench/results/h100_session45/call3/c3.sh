#!/usr/bin/env bash
# Session 45, call 3: (1) diagnostic: per-step worst attention errors of q8-windowed cases
# (fp8 centered/uncentered, f16 copies, int8, tq3, k4v2; d 64, group 4) on the new build;
# (2) attention alone with --exact-split-keys 64,128,256,512 beside the default (256) and main's
# build; (3) end to end at several exact split sizes (TURBOKV_EXACT_SPLIT_KEYS).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/r3; mkdir -p "$R" /tmp/a/turbokv-ptx /tmp/c/turbokv-ptx
G=$PWD/.gpu/s45c
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub_main.tar.xz -C /tmp/a/turbokv-ptx
tar -xJf $G/cub_new2.tar.xz -C /tmp/c/turbokv-ptx
chmod +x $G/turbokv_main $G/turbokv_new3 $G/cuda_codes_new3
left() { echo $(( 560 - SECONDS )); }
( cd crates/backend && TMPDIR=/tmp/c timeout 120 $G/cuda_codes_new3 --test-threads 1 --ignored diag_s45 --nocapture ) > "$R/diag.txt" 2>&1
echo "diag rc=$? t=$SECONDS"
awk '/^DIAG/{if(h!="")printf "%s  worst %.2e  steps>1e-2: %d\n",h,w,c; h=$0; w=0; c=0} /attention max err/{e=$NF+0; if(e>w)w=e; if(e>1e-2)c++} END{printf "%s  worst %.2e  steps>1e-2: %d\n",h,w,c}' "$R/diag.txt"
pre() { # A (main's build) or a key count for the new build
  if [ "$1" = A ]; then echo "env TMPDIR=/tmp/a $G/turbokv_main"
  else echo "env TMPDIR=/tmp/c TURBOKV_EXACT_SPLIT_KEYS=$1 $G/turbokv_new3"; fi
}
B="env TMPDIR=/tmp/c $G/turbokv_new3"
for rep in 1 2; do
  timeout 60 $B bench attention --kv 'tiny,compact,k4v2@w2.4%s1q8+n' --batch 1,8,32 --ctx 8k,32k --no-peer \
    --exact-split-keys 64,128,256,512 --json "$R/att_new_$rep.json" > "$R/att_new_$rep.txt" 2>&1
  echo "att new $rep rc=$? t=$SECONDS"
  timeout 40 $(pre A) bench attention --kv 'tiny,compact,k4v2@w2.4%s1q8+n' --batch 1,8,32 --ctx 8k,32k --no-peer \
    --json "$R/att_main_$rep.json" > "$R/att_main_$rep.txt" 2>&1
  echo "att main $rep rc=$? t=$SECONDS"
  timeout 40 $B bench attention --kv 'tiny,k4v2@w1.2%s1+n' --heads 9 --kv-heads 3 --head-dim 64 --batch 1,8,32 --ctx 8k,32k \
    --no-peer --exact-split-keys 64,128,256,512 --json "$R/demo_new_$rep.json" > "$R/demo_new_$rep.txt" 2>&1
  echo "demo new $rep rc=$? t=$SECONDS"
  timeout 30 $(pre A) bench attention --kv 'tiny,k4v2@w1.2%s1+n' --heads 9 --kv-heads 3 --head-dim 64 --batch 1,8,32 --ctx 8k,32k \
    --no-peer --json "$R/demo_main_$rep.json" > "$R/demo_main_$rep.txt" 2>&1
  echo "demo main $rep rc=$? t=$SECONDS"
done
python3 - "$R" <<'PY'
import json, glob, sys, os, collections
R = sys.argv[1]
t = collections.defaultdict(list)
for f in sorted(glob.glob(f"{R}/att_*.json") + glob.glob(f"{R}/demo_*.json")):
    shape, build = os.path.basename(f).split("_")[:2]
    try: d = json.load(open(f))
    except Exception as e: print(f, e); continue
    for r in d["rows"]:
        t[(shape, r["kv"], r["batch"], r["ctx"], build + ":" + r["variant"])].append(r["ms"])
for key in sorted(t): print(*key, " ".join(f"{x:.4f}" for x in t[key]))
PY
dec() { # name K kv batch ctx
  local n=$1 k=$2 kv=$3 b=$4 c=$5
  [ "$(left)" -gt 40 ] || { echo "skip $n"; return; }
  timeout $(( $(left) < 60 ? $(left) : 60 )) $(pre $k) bench decode --device cuda --shape llama3-8b \
    --batch $b --ctx $c --kv "$kv" --steps 32 --json "$R/d_$n.json" > "$R/d_$n.txt" 2>&1
  echo "decode $n rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec compact_b8_32k_A A compact 8 32768
dec compact_b8_32k_64 64 compact 8 32768
dec compact_b8_32k_128 128 compact 8 32768
dec compact_b8_32k_256 256 compact 8 32768
dec compact_b8_32k_512 512 compact 8 32768
dec compact_b32_8k_64 64 compact 32 8192
dec compact_b32_8k_128 128 compact 32 8192
dec tiny_b8_32k_128 128 tiny 8 32768
dec tiny_b32_8k_64 64 tiny 32 8192
dec tiny_b32_8k_A A tiny 32 8192
tar -czf "$OUT/r3.tgz" -C "$OUT" r3
