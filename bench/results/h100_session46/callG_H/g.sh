#!/usr/bin/env bash
# Session 46, call G: coded split counts at many (row, kv head) pairs, where the per-SM model
# does not apply (pairs >= SMs): attention alone at forced counts, and compact / tiny decode
# steps at the wave model's count against 2 splits (TURBOKV_CODED_SPLITS=2), alternating.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/g; mkdir -p "$R" /tmp/c/turbokv-ptx
G=$PWD/.gpu/s46g
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $G/cub.tar.xz -C /tmp/c/turbokv-ptx; chmod +x $G/turbokv
B="env TMPDIR=/tmp/c $G/turbokv"
left() { echo $(( 175 - SECONDS )); }
if grep -q H200 "$R/gpu.txt"; then
  timeout 150 $B bench attention --kv tq3,k4v2,k4v3,tq4,int8,fp8 --batch 1,8,32 --ctx 8k,32k,128k \
    --json "$R/table.json" --plot "$R/table.svg" > "$R/table.txt" 2>&1; echo "table rc=$? t=$SECONDS"
  python3 - "$R/table.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    q = r.get("ratio_to_sdpa")
    print(r["kv"], r["batch"], r["ctx"], round(r["ms"], 4), r.get("sdpa_backend"), q and round(1 / q, 2), round(r["frac_copy_bw"], 2))
PY
fi
timeout 80 $B bench attention --kv compact,k4v2,tq3 --batch 32,64 --ctx 8k,32k --no-peer \
  --coded-splits 1,2,3 --json "$R/splits.json" > "$R/splits.txt" 2>&1; echo "splits rc=$? t=$SECONDS"
python3 - "$R/splits.json" <<'PY'
import json, sys, collections
d = json.load(open(sys.argv[1]))
t = collections.defaultdict(dict)
for r in d["rows"]:
    t[(r["kv"][:12], r["batch"], r["ctx"])][r["variant"]] = r["ms"] * 1000
for k in sorted(t):
    m = t[k]; base = m.get("default")
    print(*k, "  ".join(f"{v}:{x:.1f}" for v, x in sorted(m.items())), " best:", min(m, key=m.get))
PY
dec() { # name splits kv batch ctx
  [ "$(left)" -gt 30 ] || { echo "skip $1"; return; }
  if [ "$2" = "-" ]; then E=""; else E="TURBOKV_CODED_SPLITS=$2"; fi
  timeout 40 env $E $B bench decode --device cuda --shape llama3-8b --batch $4 --ctx $5 --kv "$3" --steps 32 \
    --json "$R/d_$1.json" > "$R/d_$1.txt" 2>&1
  echo "decode $1 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$1.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
dec compact_b32_8k_model1 - compact 32 8192
dec compact_b32_8k_s2_1 2 compact 32 8192
dec compact_b32_8k_model2 - compact 32 8192
dec compact_b32_8k_s2_2 2 compact 32 8192
tar -czf "$OUT/g.tgz" -C "$OUT" g && rm -rf "$R"
