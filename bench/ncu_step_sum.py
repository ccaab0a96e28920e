#!/usr/bin/env python3
"""One decode step's GPU time by kernel, from ncu's CSV.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
        turbokv bench decode --device cuda --shape llama3-8b --batch 32 --ctx 8192 --kv compact \
        --steps 8 --profile-step > step.csv
    bench/ncu_step_sum.py step.csv [more.csv ...]

`--profile-step` brackets one eager decode step with the profiler's start and stop, so the
CSV holds that step's launches and nothing else. ncu runs them one at a time: the sum is the
step's kernel time without launch gaps or overlap.
"""
import collections
import csv
import re
import sys

UNIT_NS = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}


def summarize(path):
    lines = [l for l in open(path) if l.startswith('"')]
    totals = collections.defaultdict(lambda: [0, 0.0])
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ns = float(r["Metric Value"].replace(",", "")) * UNIT_NS.get(r.get("Metric Unit", "ns"), 1)
        name = re.sub(r"\(.*", "", r["Kernel Name"]).strip()
        totals[name][0] += 1
        totals[name][1] += ns
    all_ns = sum(t[1] for t in totals.values())
    n = sum(t[0] for t in totals.values())
    print(f"{path}: {n} launches, {all_ns / 1e6:.3f} ms")
    for name, (count, ns) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {ns / 1e3:9.1f} us {100 * ns / all_ns:5.1f}%  x{count:<4d} {ns / count / 1e3:8.2f} us each  {name[:80]}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        summarize(p)
