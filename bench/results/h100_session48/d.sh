#!/usr/bin/env bash
# Session 48: tq4's int8-key kernel with 4-bit keys as one-sided pairs (Codes<4>::int8_pair, as
# the int8-value kernels), nothing else changed, against main's build on the same machine.
# (1) the coded CUDA tests on the new build; (2) the issue's attention table for the four
# coded formats, new (with SDPA) then main, twice alternating.
# Needs (ignored, local): .gpu/s48t = this branch's release turbokv, cuda_codes,
# attention_variants and cub.tar.xz of every module's cubin (`scripts/cuda-check.py --arch
# sm_90 --ptx-cache DIR`); .gpu/s47m = main's turbokv and cubins.
# Run: `run` with carry [".gpu/s48t", ".gpu/s47m"], command `bash bench/results/h100_session48/d.sh`.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/d; mkdir -p "$R" /tmp/c/turbokv-ptx /tmp/d/turbokv-ptx
N=$PWD/.gpu/s48t; M=$PWD/.gpu/s47m
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $M/cub.tar.xz -C /tmp/c/turbokv-ptx; tar -xJf $N/cub.tar.xz -C /tmp/d/turbokv-ptx; chmod +x $N/* $M/*
snap() { tar -czf "$OUT/d.tgz.tmp" -C "$OUT" d && mv "$OUT/d.tgz.tmp" "$OUT/d.tgz"; }
for t in cuda_codes attention_variants; do
  ( cd crates/backend && TMPDIR=/tmp/d timeout 90 $N/$t --test-threads 1 ) > "$R/tests_$t.txt" 2>&1
  echo "$t rc=$? t=$SECONDS $(grep -E '^test result' "$R/tests_$t.txt" | tail -1)"
  grep -E "panicked|FAILED" "$R/tests_$t.txt" | head -5
done
snap
A="bench attention --kv tq4,k4v3,tq3,k4v2 --batch 1,8,32 --ctx 8k,32k,128k"
for i in 1 2; do
  TMPDIR=/tmp/d timeout 60 $N/turbokv $A --json "$R/new$i.json" > "$R/new$i.txt" 2>&1; echo "new$i rc=$? t=$SECONDS"
  TMPDIR=/tmp/c timeout 60 $M/turbokv $A --no-peer --json "$R/main$i.json" > "$R/main$i.txt" 2>&1; echo "main$i rc=$? t=$SECONDS"
  snap
done
python3 - "$R" <<'PY'
import json, sys, collections
R = sys.argv[1]
t = collections.defaultdict(dict)
for n in ("new1", "main1", "new2", "main2"):
    try: rows = json.load(open(f"{R}/{n}.json"))["rows"]
    except Exception as e: print(n, e); continue
    for r in rows:
        if r["variant"] != "default": continue
        k = (r["kv"], r["batch"], r["ctx"]); t[k][n] = r["ms"] * 1000
        if r.get("sdpa_ms"): t[k]["sdpa"] = r["sdpa_ms"] * 1000
for k in sorted(t):
    v = t[k]; nn = min(v.get("new1", 9e9), v.get("new2", 9e9)); mm = min(v.get("main1", 9e9), v.get("main2", 9e9))
    print(*k, " ".join(f"{a}:{b:.1f}" for a, b in sorted(v.items())), f"new/main {nn / mm:.3f}", f"sdpa/new {v.get('sdpa', 0) / nn:.2f}")
PY
snap
