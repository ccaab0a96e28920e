#!/usr/bin/env python3
"""Decode attention peer for `turbokv bench attention`: PyTorch scaled_dot_product_attention
on bf16 K/V of the same shapes, per backend (cuDNN, flash, memory-efficient, math).

One query token per sequence over `ctx` cached tokens, `heads` query heads sharing `kv_heads`
kv heads (GQA). The g = heads / kv_heads query heads of a kv head are passed as g query rows
of that kv head (no mask: a decode token sees every cached key), which every backend runs
and which reads each kv head's bytes once, as a GQA decode kernel does. K/V are contiguous
[batch, kv_heads, ctx, head_dim] tensors, rotated through like `turbokv bench attention`'s
caches (at least 512 MB apart) so that repeated calls do not read from L2, and calls are
queued behind torch.cuda._sleep so that host launch time stays out of the events' interval.

Writes a JSON list of {batch, ctx, backend, ms, error}.
"""
import argparse
import json
import math
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--ctx", default="8192,32768,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # noqa: BLE001 - any import failure means no peer
        print(f"sdpa_peer: torch unavailable: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sdpa_peer: no CUDA device", file=sys.stderr)
        return 2
    backends = [
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]
    g = a.heads // a.kv_heads
    d = a.head_dim
    rows = []
    dev = torch.device("cuda")
    for b in [int(x) for x in a.batch.split(",")]:
        for ctx in [int(x) for x in a.ctx.split(",")]:
            kv_bytes = 2 * b * a.kv_heads * ctx * d * 2
            free, _ = torch.cuda.mem_get_info()
            fit = max(0, (free - (4 << 30)) // max(1, kv_bytes))
            copies = min(16, max(1, math.ceil((512 << 20) / kv_bytes)), fit)
            if copies == 0:
                for name, _ in backends:
                    rows.append(dict(batch=b, ctx=ctx, backend=name, ms=None,
                                     error="does not fit in memory"))
                continue
            gen = torch.Generator(device=dev).manual_seed(b * 1000003 + ctx)
            ks = [torch.rand(b, a.kv_heads, ctx, d, device=dev, dtype=torch.bfloat16,
                             generator=gen) * 2 - 1 for _ in range(copies)]
            vs = [torch.rand(b, a.kv_heads, ctx, d, device=dev, dtype=torch.bfloat16,
                             generator=gen) * 2 - 1 for _ in range(copies)]
            q = torch.rand(b, a.kv_heads, g, d, device=dev, dtype=torch.bfloat16,
                           generator=gen) * 2 - 1
            ref = None
            for name, be in backends:
                try:
                    with sdpa_kernel(be):
                        out = F.scaled_dot_product_attention(q, ks[0], vs[0])
                        torch.cuda.synchronize()
                        if ref is None:
                            ref = out.float()
                        elif (out.float() - ref).abs().max().item() > 5e-2:
                            raise RuntimeError("output differs from the first backend's")
                        launches = max(copies, 8)
                        times = []
                        for _ in range(a.rounds):
                            start = torch.cuda.Event(enable_timing=True)
                            end = torch.cuda.Event(enable_timing=True)
                            torch.cuda._sleep(int(2e6))  # ~1 ms of cycles at ~2 GHz
                            start.record()
                            for i in range(launches):
                                F.scaled_dot_product_attention(q, ks[i % copies], vs[i % copies])
                            end.record()
                            torch.cuda.synchronize()
                            times.append(start.elapsed_time(end) / launches)
                        times.sort()
                        ms = times[len(times) // 2]
                        rows.append(dict(batch=b, ctx=ctx, backend=name, ms=ms, error=None))
                        print(f"sdpa_peer: {name} b{b} ctx{ctx}: {ms:.4f} ms "
                              f"({kv_bytes / ms / 1e6:.0f} GB/s)", file=sys.stderr)
                except Exception as e:  # noqa: BLE001 - a backend refusing a shape is data
                    rows.append(dict(batch=b, ctx=ctx, backend=name, ms=None,
                                     error=str(e).splitlines()[0][:200]))
            del ks, vs, q, ref
            torch.cuda.empty_cache()
    with open(a.json, "w") as f:
        json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
