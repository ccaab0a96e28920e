#!/usr/bin/env python3
"""The markdown table of a bench/serve_load.sh run, from AIPerf's exports.

    serve_load_table.py OUT_DIR bf16,balanced,compact 1,8,32,64
"""

import json
import os
import sys


def main():
    out, kvs, conc = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    print("Reference (same run, no server, one stream; `turbokv bench model --kv bf16`):")
    print("```")
    print(open(os.path.join(out, "reference.txt")).read().rstrip())
    print("```")
    print()
    print("| KV | KV capacity | clients | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
          "| running max | mean seqs/step | preempted | prefix-cached tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kv in kvs:
        cap = open(os.path.join(out, f"{kv}-server.txt")).read().strip()
        for c in conc:
            d = os.path.join(out, f"{kv}-c{c}")
            p = json.load(open(os.path.join(d, "profile_export_aiperf.json")))
            m = json.load(open(os.path.join(d, "server_metrics_export.json")))["metrics"]

            def stat(k):
                return m[k]["series"][0]["stats"]

            steps = stat("turbokv:engine_steps")["total"]
            seqs = stat("turbokv:engine_step_sequences")["total"] / steps if steps else 0.0
            ttft, itl = p["time_to_first_token"], p["inter_token_latency"]
            print(
                f"| {kv} | {cap} | {c} | {p['output_token_throughput']['avg']:.1f} "
                f"| {ttft['p50']:.0f} / {ttft['p99']:.0f} | {itl['p50']:.1f} / {itl['p99']:.1f} "
                f"| {stat('vllm:num_requests_running')['max']:.0f} | {seqs:.1f} "
                f"| {stat('vllm:num_preemptions')['total']:.0f} | {stat('vllm:prefix_cache_hits')['total']:.0f} |"
            )


if __name__ == "__main__":
    main()
