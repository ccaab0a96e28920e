#!/usr/bin/env bash
# Session 45, call 4: the exact splits' size from the model (free slots of the coded wave, else
# one chunk), int8 copies read as bytes. (1) cuda_codes and cuda_ops in full on the new build;
# (2) attention alone: the default, --exact-split-keys 64 (one chunk a split, as before) and
# main's build, twice; (3) end to end: compact and tiny at b8 x 32k, compact and bf16 at b32 x 8k,
# new and main alternating.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/r4; mkdir -p "$R" /tmp/a/turbokv-ptx /tmp/c/turbokv-ptx
G=$PWD/.gpu/s45d
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub_main.tar.xz -C /tmp/a/turbokv-ptx
tar -xJf $G/cub_new.tar.xz -C /tmp/c/turbokv-ptx
chmod +x $G/turbokv_main $G/turbokv_new4 $G/cuda_codes_new4 $G/cuda_ops_new4
left() { echo $(( 570 - SECONDS )); }
for t in cuda_codes cuda_ops; do
  ( cd crates/backend && TMPDIR=/tmp/c timeout 200 $G/${t}_new4 --test-threads 1 ) > "$R/tests_$t.txt" 2>&1
  echo "$t rc=$? t=$SECONDS"; grep -E "test result|panicked|skipping|FAILED" -A1 "$R/tests_$t.txt" | head -12
done
A="env TMPDIR=/tmp/a $G/turbokv_main"; B="env TMPDIR=/tmp/c $G/turbokv_new4"
for rep in 1 2; do
  timeout 60 $B bench attention --kv 'tiny,compact,k4v2@w2.4%s1q8+n,tq2[17-18:k3v2][23-24:k3v2],k4v2' --batch 1,8,32 --ctx 8k,32k \
    --no-peer --exact-split-keys 64 --json "$R/att_new_$rep.json" > "$R/att_new_$rep.txt" 2>&1
  echo "att new $rep rc=$? t=$SECONDS"
  timeout 40 $A bench attention --kv 'tiny,compact,k4v2@w2.4%s1q8+n,tq2[17-18:k3v2][23-24:k3v2],k4v2' --batch 1,8,32 --ctx 8k,32k \
    --no-peer --json "$R/att_main_$rep.json" > "$R/att_main_$rep.txt" 2>&1
  echo "att main $rep rc=$? t=$SECONDS"
  timeout 40 $B bench attention --kv 'tiny,tq2,k4v2@w1.2%s1+n,k4v2' --heads 9 --kv-heads 3 --head-dim 64 --batch 1,8,32 \
    --ctx 8k,32k --no-peer --exact-split-keys 64 --json "$R/demo_new_$rep.json" > "$R/demo_new_$rep.txt" 2>&1
  echo "demo new $rep rc=$? t=$SECONDS"
  timeout 30 $A bench attention --kv 'tiny,tq2,k4v2@w1.2%s1+n,k4v2' --heads 9 --kv-heads 3 --head-dim 64 --batch 1,8,32 \
    --ctx 8k,32k --no-peer --json "$R/demo_main_$rep.json" > "$R/demo_main_$rep.txt" 2>&1
  echo "demo main $rep rc=$? t=$SECONDS"
done
python3 - "$R" <<'PY'
import json, glob, sys, os, collections, statistics as st
R = sys.argv[1]
t = collections.defaultdict(list)
for f in sorted(glob.glob(f"{R}/att_*.json") + glob.glob(f"{R}/demo_*.json")):
    shape, build = os.path.basename(f).split("_")[:2]
    try: d = json.load(open(f))
    except Exception as e: print(f, e); continue
    for r in d["rows"]:
        t[(shape, r["kv"], r["batch"], r["ctx"])].append((build + ":" + r["variant"], r["ms"]))
for key in sorted(t):
    by = collections.defaultdict(list)
    for v, ms in t[key]: by[v].append(ms)
    m = {v: st.median(x) for v, x in by.items()}
    base = m.get("main:default")
    print(*key, "  ".join(f"{v} {x:.4f}" + (f" ({x/base:.3f})" if base else "") for v, x in sorted(m.items())))
PY
dec() { # name A|B kv batch ctx
  local n=$1 w=$2 kv=$3 b=$4 c=$5
  [ "$(left)" -gt 40 ] || { echo "skip $n"; return; }
  timeout $(( $(left) < 60 ? $(left) : 60 )) ${!w} bench decode --device cuda --shape llama3-8b \
    --batch $b --ctx $c --kv "$kv" --steps 32 --json "$R/d_$n.json" > "$R/d_$n.txt" 2>&1
  echo "decode $n rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$n.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec compact_b8_32k_B1 B compact 8 32768
dec compact_b8_32k_A1 A compact 8 32768
dec tiny_b8_32k_B1 B tiny 8 32768
dec tiny_b8_32k_A1 A tiny 8 32768
dec compact_b32_8k_B1 B compact 32 8192
dec compact_b32_8k_A1 A compact 32 8192
dec bf16_b32_8k_B1 B bf16 32 8192
dec compact_b8_32k_B2 B compact 8 32768
dec compact_b8_32k_A2 A compact 8 32768
dec bf16_b8_32k_B1 B bf16 8 32768
tar -czf "$OUT/r4.tgz" -C "$OUT" r4
