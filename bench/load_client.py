#!/usr/bin/env python3
"""A minimal load client for OpenAI-compatible completion servers: the Python standard library
and asyncio only, for machines where AIPerf's dependency tree (about 230 MB of wheels:
pyarrow, scipy, pandas, transformers, ...) cannot be installed. It measures what
bench/serve_load.sh reads from AIPerf: output throughput, time to first token and
inter-token latency (p50/p99), plus how many sequences the server kept running (sampled from
its Prometheus /metrics) and the server's own counters over the run.

Each of --concurrency workers sends streamed `POST /v1/completions` requests one after
another until --requests have been sent: a prompt of --prompt-tokens random token ids (exact
lengths, whatever the tokenizer), `temperature` 0, `ignore_eos`, exactly --max-tokens output
tokens, `stream_options.include_usage`. Every SSE chunk without a finish reason is one token
(turbokv streams one chunk per token). TTFT is from sending the request to its first token;
inter-token latency is the gap between consecutive tokens of a request; throughput is the
output tokens of completed requests over the run's wall time. After --duration seconds no
new request starts, and requests still running at the hard limit (1.5 x --duration) are
cancelled (counted, left out of the latencies).

    python3 bench/load_client.py --url http://127.0.0.1:8000 --model m --concurrency 8 \
        --requests 16 --prompt-tokens 256 --max-tokens 128 --json out.json
"""

import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.parse


def percentile(values, q):
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


async def http_request(host, port, method, path, body=None, timeout=30.0):
    """One HTTP/1.1 request on a fresh connection; returns (status, headers, reader, writer)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    data = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout)
    parts = status_line.decode("latin-1").split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {}
    while True:
        line = await asyncio.wait_for(reader.readline(), timeout)
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, reader, writer


async def body_chunks(reader, headers):
    """The response body as it arrives (chunked transfer encoding or until close)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            chunk = await reader.readexactly(size)
            await reader.readexactly(2)
            yield chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            yield chunk


async def get_text(host, port, path):
    status, headers, reader, writer = await http_request(host, port, "GET", path)
    try:
        parts = [c async for c in body_chunks(reader, headers)]
    finally:
        writer.close()
    return status, b"".join(parts).decode("utf-8", "replace")


METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([-+0-9.eEinfNa]+)$")


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line.strip())
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


async def one_request(host, port, body, record):
    """Sends one streamed completion; fills `record` as tokens arrive."""
    record["sent"] = time.perf_counter()
    status, headers, reader, writer = await http_request(host, port, "POST", "/v1/completions", body)
    try:
        if status != 200:
            text = b"".join([c async for c in body_chunks(reader, headers)])
            record["error"] = f"HTTP {status}: {text[:300].decode('utf-8', 'replace')}"
            return
        buf = b""
        async for chunk in body_chunks(reader, headers):
            now = time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        record["done"] = now
                        continue
                    msg = json.loads(data)
                    if "error" in msg and "choices" not in msg:
                        record["error"] = str(msg["error"])[:300]
                        continue
                    if msg.get("usage"):
                        record["completion_tokens"] = msg["usage"].get("completion_tokens")
                    for ch in msg.get("choices") or []:
                        if ch.get("finish_reason") is None:
                            record["tokens"].append(now)
                        else:
                            record["finish_reason"] = ch["finish_reason"]
    finally:
        writer.close()


async def sample_running(host, port, stop, samples):
    """Polls /metrics for the running and waiting request gauges until `stop` is set."""
    while not stop.is_set():
        try:
            _, text = await get_text(host, port, "/metrics")
            m = parse_metrics(text)
            samples.append(
                (m.get("vllm:num_requests_running", 0.0), m.get("vllm:num_requests_waiting", 0.0))
            )
        except (OSError, asyncio.TimeoutError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


COUNTERS = [
    "turbokv:engine_steps_total",
    "turbokv:engine_step_sequences_total",
    "vllm:num_preemptions_total",
    "turbokv:admissions_deferred_total",
    "turbokv:decode_padding_rows_total",
    'turbokv:step_logits_total{transfer="top_k"}',
    'turbokv:step_logits_total{transfer="full"}',
    'turbokv:step_graphs_total{run="replayed"}',
    'turbokv:step_graphs_total{run="captured"}',
    'turbokv:step_graphs_total{run="eager"}',
    "vllm:generation_tokens_total",
]


async def run(args):
    url = urllib.parse.urlparse(args.url)
    host, port = url.hostname, url.port or 80
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(args.vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    _, before_text = await get_text(host, port, "/metrics")
    before = parse_metrics(before_text)
    records = []
    next_index = 0
    start = time.perf_counter()
    soft_end = start + args.duration
    stop = asyncio.Event()
    samples = []
    sampler = asyncio.create_task(sample_running(host, port, stop, samples))

    async def worker():
        nonlocal next_index
        while next_index < args.requests and time.perf_counter() < soft_end:
            i = next_index
            next_index += 1
            body = {
                "model": args.model,
                "prompt": prompts[i],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            rec = {"index": i, "tokens": []}
            records.append(rec)
            try:
                await one_request(host, port, body, rec)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
                rec["error"] = f"{type(e).__name__}: {e}"

    workers = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
    done, pending = await asyncio.wait(workers, timeout=args.duration * 1.5)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    end = time.perf_counter()
    stop.set()
    await sampler
    _, after_text = await get_text(host, port, "/metrics")
    after = parse_metrics(after_text)

    completed = [r for r in records if "done" in r and "error" not in r]
    errors = [r["error"] for r in records if "error" in r]
    cancelled = len(records) - len(completed) - len(errors)
    ttft = [r["tokens"][0] - r["sent"] for r in completed if r["tokens"]]
    itl = [b - a for r in completed for a, b in zip(r["tokens"], r["tokens"][1:])]
    e2e = [r["done"] - r["sent"] for r in completed]
    out_tokens = sum(r.get("completion_tokens") or len(r["tokens"]) for r in completed)
    streamed = sum(len(r["tokens"]) for r in completed)
    last_done = max((r["done"] for r in completed), default=end)
    wall = max(last_done - start, 1e-9)
    running = [s[0] for s in samples]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    steps = delta["turbokv:engine_steps_total"]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    result = {
        "concurrency": args.concurrency,
        "requests_sent": len(records),
        "requests_completed": len(completed),
        "requests_failed": len(errors),
        "requests_cancelled": cancelled,
        "first_errors": errors[:3],
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "streamed_tokens": streamed,
        "output_tok_s": out_tokens / wall,
        "requests_per_s": len(completed) / wall,
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "itl_ms_p50": ms(percentile(itl, 50)),
        "itl_ms_p99": ms(percentile(itl, 99)),
        "e2e_s_p50": percentile(e2e, 50),
        "running_max": max(running, default=None),
        "running_mean": sum(running) / len(running) if running else None,
        "mean_step_batch": delta["turbokv:engine_step_sequences_total"] / steps if steps else None,
        "server_counters": delta,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--vocab", type=int, default=256, help="prompt ids are drawn below this (256: bytes, valid anywhere)"
    )
    p.add_argument("--duration", type=float, default=60.0, help="no new request after this (s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    r = asyncio.run(run(args))
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(
        f"c={r['concurrency']}: {r['requests_completed']}/{r['requests_sent']} requests, "
        f"{r['output_tok_s']:.0f} tok/s, TTFT p50 {fmt(r['ttft_ms_p50'])} p99 {fmt(r['ttft_ms_p99'])} ms, "
        f"ITL p50 {fmt(r['itl_ms_p50'])} p99 {fmt(r['itl_ms_p99'])} ms, running max {fmt(r['running_max'])}",
        file=sys.stderr,
    )
    if r["requests_failed"]:
        print(f"failures: {r['first_errors']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
