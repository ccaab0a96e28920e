#!/usr/bin/env bash
# Session 47, call B. New build (s47: code unpacking's shifts and complements on the FMA pipe, 4-bit keys as one-sided pairs in every int8-key kernel;
# split counts of session 46's branch) against main's build (a65d32a), same machine.
# (1) the coded CUDA tests on the new build; (2) the issue's attention table (new, with SDPA;
# main's beside it, no peer); (3) decode steps, alternating builds; (4) one ncu look at the
# k4v2 kernel's pipes.
# Needs (ignored, local): .gpu/s47b = this branch's release turbokv, its test binaries
# (cuda_codes, attention_variants, cuda_e2e) and cub.tar.xz of every module's cubin from
# `scripts/cuda-check.py --arch sm_90 --ptx-cache DIR`; .gpu/s47m = main's turbokv and cubins.
# Run: `run` with carry [".gpu/s47b", ".gpu/s47m"], command `bash bench/results/h100_session47/b.sh`.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/b; mkdir -p "$R" /tmp/c/turbokv-ptx /tmp/d/turbokv-ptx
N=$PWD/.gpu/s47b; M=$PWD/.gpu/s47m
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $M/cub.tar.xz -C /tmp/c/turbokv-ptx; tar -xJf $N/cub.tar.xz -C /tmp/d/turbokv-ptx; chmod +x $N/* $M/*
snap() { tar -czf "$OUT/b.tgz.tmp" -C "$OUT" b && mv "$OUT/b.tgz.tmp" "$OUT/b.tgz"; }
t() { # crate binary timeout
  ( cd crates/$1 && TMPDIR=/tmp/d timeout $3 $N/$2 --test-threads 1 ) > "$R/tests_$2.txt" 2>&1
  echo "$2 rc=$? t=$SECONDS $(grep -E '^test result' "$R/tests_$2.txt" | tail -1)"
  grep -E "panicked|FAILED|skipping" "$R/tests_$2.txt" | head -5
}
t backend cuda_codes 120
t backend attention_variants 60
t model cuda_e2e 90
NB="env TMPDIR=/tmp/d $N/turbokv"; MB="env TMPDIR=/tmp/c $M/turbokv"
timeout 100 $NB bench attention --kv tq3,k4v2,k4v3,tq4,int8,fp8 --batch 1,8,32 --ctx 8k,32k,128k \
  --json "$R/table_new.json" --plot "$R/table_new.svg" > "$R/table_new.txt" 2>&1; echo "table new rc=$? t=$SECONDS"; snap
dec() { # name binary-var kv batch ctx [env]
  [ $SECONDS -lt 330 ] || { echo "skip $1"; return; }
  local B=${!2}
  timeout 40 env ${6:-X=1} $B bench decode --device cuda --shape llama3-8b --batch $4 --ctx $5 --kv "$3" --steps 32 \
    --json "$R/d_$1.json" > "$R/d_$1.txt" 2>&1
  echo "decode $1 rc=$? $(python3 -c "import json;d=json.load(open('$R/d_$1.json'));print(round(d['pipelined_ms_step'],3),'ms',round(d['pipelined_tok_s']),'tok/s')" 2>/dev/null) t=$SECONDS"
}
for i in 1 2; do
  dec compact_b32_8k_new$i NB compact 32 8192
  dec compact_b32_8k_main$i MB compact 32 8192
  dec compact_b32_8k_newwave$i NB compact 32 8192 TURBOKV_SM_LOAD_SPLITS=0
done
dec bf16_b32_8k NB bf16 32 8192
snap
timeout 60 $MB bench attention --kv tq3,k4v2,k4v3,tq4 --batch 1,8,32 --ctx 8k,32k,128k --no-peer \
  --json "$R/table_main.json" > "$R/table_main.txt" 2>&1; echo "table main rc=$? t=$SECONDS"
timeout 50 $NB bench attention --kv compact,tiny,balanced,tq3,k4v2 --batch 8,32,64 --ctx 8k,32k --no-peer --wave-splits \
  --json "$R/presets_new.json" > "$R/presets_new.txt" 2>&1; echo "presets new rc=$? t=$SECONDS"
timeout 40 $MB bench attention --kv compact,tiny,balanced --batch 8,32,64 --ctx 8k,32k --no-peer \
  --json "$R/presets_main.json" > "$R/presets_main.txt" 2>&1; echo "presets main rc=$? t=$SECONDS"
python3 - "$R" <<'PY'
import json, sys, collections
R = sys.argv[1]
def load(f):
    try: return json.load(open(f))["rows"]
    except Exception as e: print(f, e); return []
t = collections.defaultdict(dict)
for name in ("table_new", "table_main", "presets_new", "presets_main"):
    for r in load(f"{R}/{name}.json"):
        t[(r["kv"][:16], r["batch"], r["ctx"])][name.split("_")[1] + ":" + r["variant"]] = r["ms"] * 1000
        if r.get("sdpa_ms"): t[(r["kv"][:16], r["batch"], r["ctx"])]["sdpa"] = r["sdpa_ms"] * 1000
for k in sorted(t): print(*k, "  ".join(f"{v}:{x:.1f}" for v, x in sorted(t[k].items())))
PY
snap
dec tq3_b32_8k_new NB tq3 32 8192
dec tq3_b32_8k_main MB tq3 32 8192
dec tiny_b32_8k_new NB tiny 32 8192
dec tiny_b32_8k_main MB tiny 32 8192
dec compact_b8_32k_new NB compact 8 32768
dec compact_b8_32k_main MB compact 8 32768
dec balanced_b32_8k_new NB balanced 32 8192
dec balanced_b32_8k_main MB balanced 32 8192
if [ $SECONDS -lt 340 ]; then
  TMPDIR=/tmp/d timeout 60 ncu --kernel-name regex:attn_codes_k8v_128_4_2 --launch-skip 3 --launch-count 1 --clock-control none \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --metrics sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_imma.avg.pct_of_peak_sustained_active \
    $N/turbokv bench attention --kv k4v2 --batch 32 --ctx 32k --no-peer > "$R/ncu_k4v2_new.txt" 2>&1; echo "ncu new rc=$? t=$SECONDS"
fi
if [ $SECONDS -lt 380 ]; then
  TMPDIR=/tmp/c timeout 50 ncu --kernel-name regex:attn_codes_k8v_128_4_2 --launch-skip 3 --launch-count 1 --clock-control none \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --metrics sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_imma.avg.pct_of_peak_sustained_active \
    $M/turbokv bench attention --kv k4v2 --batch 32 --ctx 32k --no-peer > "$R/ncu_k4v2_main.txt" 2>&1; echo "ncu main rc=$? t=$SECONDS"
fi
grep -hE "pipe_alu|pipe_fmaheavy|pipe_imma|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Duration" "$R"/ncu_k4v2_*.txt 2>/dev/null | head -30
snap; rm -rf "$R"
