#!/usr/bin/env bash
# Session 48: why the int8-product decode kernels issue less than half the time. ncu's stall
# reasons (per issued instruction) and the memory units' throughput for the k4v2 and tq3
# kernels at b32 x 32k, main's build (tq4's one-sided pairs landed).
# Needs (ignored, local): .gpu/s48t = main's release turbokv and cub.tar.xz of its cubins.
# Run: `run` with carry [".gpu/s48t"], command `bash bench/results/h100_session48/e.sh`.
# Run in session 49 from bench/results/session49/a.sh (results in bench/results/session49/callA/).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
OUT=${OUT:-/tmp/out}; R=$OUT/e; mkdir -p "$R" /tmp/d/turbokv-ptx
N=$PWD/.gpu/s48t
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$R/gpu.txt"
tar -xJf $N/cub.tar.xz -C /tmp/d/turbokv-ptx; chmod +x $N/*
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
M="$M,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active"
M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed"
M="$M,l1tex__throughput.avg.pct_of_peak_sustained_active,lts__throughput.avg.pct_of_peak_sustained_elapsed"
M="$M,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem"
for x in "k4v2 attn_codes_k8v_128_4_2" "tq3 attn_codes_k8v_128_3_3"; do
  set -- $x
  TMPDIR=/tmp/d timeout 100 ncu --kernel-name "regex:$2" --launch-skip 3 --launch-count 1 --clock-control none \
    --metrics "$M" $N/turbokv bench attention --kv $1 --batch 32 --ctx 32k --no-peer > "$R/ncu_$1.txt" 2>&1
  echo "ncu $1 rc=$? t=$SECONDS"
  tar -czf "$OUT/e.tgz" -C "$OUT" e
done
grep -hE "stalled|warps_|issue_active|throughput|occupancy|registers" "$R"/ncu_*.txt | awk '$NF != "0" && $NF != "0.00"' | head -80
