#!/usr/bin/env bash
# Session 51, call B: branch s51-cuda-heads (per-head KV formats on CUDA) against main's build.
# (1) the new per-head test; (2) main's per-head refusal; (3) per-head attention beside its
# uniform formats; (4) main vs branch on uniform formats (every coded launch changed); (5) the
# rest of cuda_codes; (6) the issue's table against SDPA; (7) decode steps. LIMIT: seconds this
# call may take (the steps after a guard are skipped when short of time; the tar always runs).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
LIMIT=${LIMIT:-560}
OUT=${OUT:-/tmp/out}; R=$OUT/b; mkdir -p "$R" /tmp/cb/turbokv-ptx /tmp/cm/turbokv-ptx
GB=$PWD/.gpu/s51b; GM=$PWD/.gpu/s51m
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $GB/cub.tar.xz -C /tmp/cb/turbokv-ptx; tar -xJf $GM/cub.tar.xz -C /tmp/cm/turbokv-ptx
chmod +x $GB/* $GM/turbokv
left() { [ $((LIMIT - SECONDS)) -gt $1 ]; }
t() { # binary timeout name [args]
  local b=$1 to=$2 n=$3; shift 3
  ( cd crates/backend && TMPDIR=/tmp/cb timeout $to $GB/$b --test-threads 1 "$@" ) > "$R/t_$n.txt" 2>&1
  echo "$n rc=$? t=$SECONDS $(grep -E '^test result' "$R/t_$n.txt" | tail -1)"
  grep -E "panicked|FAILED|max err [0-9.e-]+" -o "$R/t_$n.txt" | sort | uniq -c | sort -rn | head -4
}
t cuda_codes 200 perhead per_head
BB="env TMPDIR=/tmp/cb $GB/turbokv"; BM="env TMPDIR=/tmp/cm $GM/turbokv"
timeout 30 $BM bench attention --kv 'tq2[0.1:k3v2]' --batch 1 --ctx 1k --no-peer > "$R/main_refusal.txt" 2>&1
echo "main refusal rc=$? $(grep -i -m1 'per-head' "$R/main_refusal.txt")"
H='tq2@w2.9%s1q8+cn'
timeout 90 $BB bench attention --kv "tq2,tq2[0.2,0.5:k3v2],k3v2,$H,$H[0.2,0.5:k3v2],k3v2@w2.9%s1q8+cn" --batch 1,8,32 --ctx 8k,32k \
  --no-peer --json "$R/heads.json" > "$R/heads.txt" 2>&1; echo "heads rc=$? t=$SECONDS"
grep -E " default " "$R/heads.txt" | awk '{print $1, $3, $4, $5, $6}'
for i in 1 2; do
  for b in main branch; do
    B=$BB; [ $b = main ] && B=$BM
    left 200 && timeout 40 $B bench attention --kv tq3,k4v3,compact,tiny --batch 8,32 --ctx 32k --no-peer \
      --json "$R/ab_${b}$i.json" > "$R/ab_${b}$i.txt" 2>&1
  done
done
python3 - "$R" <<'PY'
import json, sys, glob, collections
t = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/ab_*.json")):
    b = "main" if "main" in f else "branch"
    for r in json.load(open(f))["rows"]:
        t[(r["kv"][:10], r["batch"], r["ctx"], b)].append(r["ms"] * 1000)
for k in sorted(t): print("ab", *k, " ".join(f"{x:.1f}" for x in t[k]))
PY
left 260 && t cuda_codes 200 codes --skip per_head
left 250 && { timeout 200 $BB bench attention --kv bf16,tq3,k4v2,k4v3,tq4,int8,fp8,compact,balanced,tiny --batch 1,8,32 --ctx 8k,32k,128k \
  --json "$R/table.json" --plot "$R/table.svg" > "$R/table.txt" 2>&1; echo "table rc=$? t=$SECONDS"; }
TH="$H[18.2,23.0,10.1,20.2,8.0,20.1,23.2,4.2,7.2,17.1,14.1,24.0:k3v2]"
dec() { # name kv batch ctx
  left 50 || { echo "skip $1"; return; }
  timeout 45 $BB bench decode --device cuda --shape llama3-8b --batch $3 --ctx $4 --kv "$2" --steps 32 \
    --json "$R/d_$1.json" > "$R/d_$1.txt" 2>&1
  echo "decode $1 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$1.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec tinyheads_b32_8k "$TH" 32 8192
dec tiny_b32_8k tiny 32 8192
dec compact_b32_8k compact 32 8192
dec bf16_b32_8k bf16 32 8192
dec compact_b8_32k compact 8 32768
dec bf16_b8_32k bf16 8 32768
$BB bench decode --shape llama3-8b --ctx 8192 --kv-budget 60 > "$R/capacity.txt" 2>&1
tar -czf "$OUT/b.tgz" -C "$OUT" b && rm -rf "$R"
