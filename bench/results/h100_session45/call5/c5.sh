#!/usr/bin/env bash
# Session 45, call 5, the build to land: int8 window copies read as bytes in the exact splits,
# one chunk a split by default (CudaOptions::exact_split_keys for measurements). (1) cuda_codes
# in full; (2) attention alone, default and --exact-split-keys 256 beside main's build; (3) end
# to end, new (B) and main (A) alternating: tiny at b8 x 32k (twice) and b32 x 8k, compact at
# b8 x 32k.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/r5; mkdir -p "$R" /tmp/a/turbokv-ptx /tmp/c/turbokv-ptx
G=$PWD/.gpu/s45e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub_main.tar.xz -C /tmp/a/turbokv-ptx
tar -xJf $G/cub_new.tar.xz -C /tmp/c/turbokv-ptx
chmod +x $G/turbokv_main $G/turbokv_new5 $G/cuda_codes_new5
left() { echo $(( 570 - SECONDS )); }
( cd crates/backend && TMPDIR=/tmp/c timeout 200 $G/cuda_codes_new5 --test-threads 1 ) > "$R/tests_cuda_codes.txt" 2>&1
echo "cuda_codes rc=$? t=$SECONDS"; grep -E "^test |test result|panicked|skipping" -A1 "$R/tests_cuda_codes.txt" | head -30
A="env TMPDIR=/tmp/a $G/turbokv_main"; B="env TMPDIR=/tmp/c $G/turbokv_new5"
KV='tiny,compact,k4v2@w2.4%s1q8+n,tq2[17-18:k3v2][23-24:k3v2],k4v2'
DKV='tiny,tq2,k4v2@w1.2%s1+n,k4v2'
timeout 60 $B bench attention --kv "$KV" --batch 1,8,32 --ctx 8k,32k --no-peer --exact-split-keys 256 --json "$R/att_new.json" > "$R/att_new.txt" 2>&1; echo "att new rc=$? t=$SECONDS"
timeout 40 $A bench attention --kv "$KV" --batch 1,8,32 --ctx 8k,32k --no-peer --json "$R/att_main.json" > "$R/att_main.txt" 2>&1; echo "att main rc=$? t=$SECONDS"
timeout 40 $B bench attention --kv "$DKV" --heads 9 --kv-heads 3 --head-dim 64 --batch 1,8,32 --ctx 8k,32k --no-peer --exact-split-keys 256 --json "$R/demo_new.json" > "$R/demo_new.txt" 2>&1; echo "demo new rc=$? t=$SECONDS"
timeout 30 $A bench attention --kv "$DKV" --heads 9 --kv-heads 3 --head-dim 64 --batch 1,8,32 --ctx 8k,32k --no-peer --json "$R/demo_main.json" > "$R/demo_main.txt" 2>&1; echo "demo main rc=$? t=$SECONDS"
python3 - "$R" <<'PY'
import json, glob, sys, os, collections
R = sys.argv[1]
t = collections.defaultdict(dict)
for f in sorted(glob.glob(f"{R}/att_*.json") + glob.glob(f"{R}/demo_*.json")):
    shape, build = os.path.basename(f)[:-5].split("_")[:2]
    try: d = json.load(open(f))
    except Exception as e: print(f, e); continue
    for r in d["rows"]:
        t[(shape, r["kv"], r["batch"], r["ctx"])][build + ":" + r["variant"]] = r["ms"]
for key in sorted(t):
    m = t[key]; base = m.get("main:default")
    print(*key, "  ".join(f"{v} {x:.4f}" + (f" ({x/base:.3f})" if base else "") for v, x in sorted(m.items())))
PY
dec() { # name A|B kv batch ctx
  local n=$1 w=$2 kv=$3 b=$4 c=$5
  [ "$(left)" -gt 40 ] || { echo "skip $n"; return; }
  timeout $(( $(left) < 60 ? $(left) : 60 )) ${!w} bench decode --device cuda --shape llama3-8b \
    --batch $b --ctx $c --kv "$kv" --steps 32 --json "$R/d_$n.json" > "$R/d_$n.txt" 2>&1
  echo "decode $n rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec tiny_b8_32k_B1 B tiny 8 32768
dec tiny_b8_32k_A1 A tiny 8 32768
dec tiny_b32_8k_B1 B tiny 32 8192
dec tiny_b32_8k_A1 A tiny 32 8192
dec compact_b8_32k_B1 B compact 8 32768
dec compact_b8_32k_A1 A compact 8 32768
dec tiny_b8_32k_B2 B tiny 8 32768
dec tiny_b8_32k_A2 A tiny 8 32768
dec plain_b8_32k_B1 B 'tq2[17-18:k3v2][23-24:k3v2]' 8 32768
tar -czf "$OUT/r5.tgz" -C "$OUT" r5
