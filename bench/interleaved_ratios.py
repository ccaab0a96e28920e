#!/usr/bin/env python3
"""Speed ratios from one interleaved `turbokv bench model` run (`--interleave`, or
`ROUNDS=… bench/cpu_decode_depth.sh`), with how far this machine's noise leaves them open.

Each round decodes every format in turn, so a round's ratio of two formats shares that
round's machine state. For each PRESET,PLAIN pair this prints the ratio of the two medians,
the median of the rounds' ratios, a bootstrap 95% interval of that median (resampling the
rounds, fixed seed), and the rounds' range. Formats are named by a prefix of their label in
the JSON (`balanced`, `k4v3[1:tq4]`, `tiny(`).

    bench/interleaved_ratios.py turbokv_interleaved_t2.json 'balanced,k4v3[1:tq4]' 'tiny(,tq2['
"""
import json
import random
import statistics
import sys


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        rows = {r["kv"]: r["decode_rounds_tok_s"] for r in json.load(f)["rows"]}

    def find(prefix: str) -> str:
        hits = [kv for kv in rows if kv.startswith(prefix)]
        if len(hits) != 1:
            raise SystemExit(f"{prefix!r} names {len(hits)} formats of {sorted(rows)}")
        return hits[0]

    for kv, rounds in rows.items():
        print(f"{kv[:60]:60s} median {statistics.median(rounds):7.1f} tok/s over {len(rounds)} rounds")
    rng = random.Random(1)
    for pair in sys.argv[2:]:
        preset, _, plain = pair.partition(",")
        a, b = rows[find(preset)], rows[find(plain)]
        ratios = [x / y for x, y in zip(a, b)]
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        print(
            f"{preset} / {plain}: ratio of medians {statistics.median(a) / statistics.median(b):.3f}, "
            f"median of rounds {statistics.median(ratios):.3f} "
            f"(95% interval {boot[50]:.3f}-{boot[1949]:.3f}; rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
