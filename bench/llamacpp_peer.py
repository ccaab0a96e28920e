#!/usr/bin/env python3
"""llama.cpp speed peer for turbokv: prefill and decode tok/s on the same GGUF.

Runs through llama-cpp-python (the reference venv, never needed by CI):

    ~/.cache/turbokv/refvenv/bin/python bench/llamacpp_peer.py \
        [--model PATH] [--wiki PATH] [--threads 1,2] [--prompt-lens 128,1024] \
        [--gen 128] [--repeats 3] [--n-batch 512] [--json bench/results/llamacpp_peer.json]

What is measured (time.perf_counter around llama-cpp-python calls, median of
--repeats runs after one untimed warm-up per thread count):
  * prefill N: llm.reset(); llm.eval(first N tokens of wiki.txt) -- one
    llama_decode per n_batch chunk, logits only for the last token;
    tok/s = N / seconds.
  * decode: after prefilling the first 128 tokens, 128 steps of
    llm.eval([tok]) with tok = argmax of the last logits (greedy); tok/s =
    128 / seconds (includes the argmax over the 49152 logits, ~negligible).
n_threads == n_threads_batch == the thread count; n_ctx 2048; KV cache f16
(llama.cpp default); no flash attention.  Prompts are the first N tokens of
scripts/fetch-assets.sh's wiki.txt, so every engine can use the same ids.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FETCH = os.path.join(REPO, "scripts", "fetch-assets.sh")
N_CTX = 2048


def asset(flag):
    out = subprocess.run([FETCH, flag], check=True, stdout=subprocess.PIPE)
    return out.stdout.decode().strip()


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load(llama_cpp, model, threads, n_batch):
    return llama_cpp.Llama(model_path=model, n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch,
                           n_threads=threads, n_threads_batch=threads, logits_all=False,
                           seed=0, verbose=False)


def time_prefill(llm, ids):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return time.perf_counter() - t0


def time_decode(llm, prompt, n_gen):
    n_vocab = llm.n_vocab()
    llm.reset()
    llm.eval(prompt)
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
    tok = int(np.argmax(logits))
    generated = []
    t0 = time.perf_counter()
    for _ in range(n_gen):
        llm.eval([tok])
        generated.append(tok)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        tok = int(np.argmax(logits))
    return time.perf_counter() - t0, generated


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--wiki")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt-lens", default="128,1024")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--decode-prompt", type=int, default=128,
                    help="tokens prefilled before the timed decode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--json", default=os.path.join(REPO, "bench", "results", "llamacpp_peer.json"))
    args = ap.parse_args()

    import llama_cpp

    model = args.model or asset("--print-model-path")
    wiki = args.wiki or asset("--print-wiki-path")
    threads = [int(x) for x in args.threads.split(",")]
    lens = [int(x) for x in args.prompt_lens.split(",")]
    need = max(lens + [args.decode_prompt])
    if need + args.gen > N_CTX or max(lens) > N_CTX:
        sys.exit("prompt + gen exceeds n_ctx %d" % N_CTX)

    with open(wiki, encoding="utf-8") as f:
        text = f.read(200000)

    results = []
    load_start = os.getloadavg()
    first_ids = None
    for t in threads:
        llm = load(llama_cpp, model, t, args.n_batch)
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        if len(ids) < need:
            sys.exit("wiki text too short: %d tokens" % len(ids))
        first_ids = ids
        # warm-up: fault in the mmapped weights, size the buffers
        time_prefill(llm, ids[:max(lens)])
        time_decode(llm, ids[:args.decode_prompt], 8)
        row = {"threads": t, "prefill": {}, "decode": {}}
        for n in lens:
            runs = [time_prefill(llm, ids[:n]) for _ in range(args.repeats)]
            med = statistics.median(runs)
            row["prefill"][str(n)] = {"tok_s": round(n / med, 1), "median_s": round(med, 5),
                                      "runs_s": [round(r, 5) for r in runs]}
        runs = []
        gen_ids = None
        for _ in range(args.repeats):
            dt, gen_ids = time_decode(llm, ids[:args.decode_prompt], args.gen)
            runs.append(dt)
        med = statistics.median(runs)
        row["decode"] = {"tok_s": round(args.gen / med, 1), "median_s": round(med, 5),
                         "ms_per_token": round(1000 * med / args.gen, 3),
                         "runs_s": [round(r, 5) for r in runs],
                         "context_start": args.decode_prompt, "n_gen": args.gen}
        row["decode_first_ids"] = gen_ids[:16]
        results.append(row)
        del llm

    # table
    hdr = ["threads"] + ["prefill %d tok/s" % n for n in lens] + ["decode tok/s (ms/tok)"]
    print(" | ".join(hdr))
    print(" | ".join("-" * len(h) for h in hdr))
    for r in results:
        cells = [str(r["threads"])] + ["%.1f" % r["prefill"][str(n)]["tok_s"] for n in lens]
        cells.append("%.1f (%.2f)" % (r["decode"]["tok_s"], r["decode"]["ms_per_token"]))
        print(" | ".join(c.rjust(len(h)) for c, h in zip(cells, hdr)))

    out = {
        "meta": {
            "tool": "bench/llamacpp_peer.py",
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(" |"),
            "model_file": os.path.basename(model),
            "cpu": cpu_model(),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_start],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "settings": {
                "n_ctx": N_CTX, "n_batch": args.n_batch, "n_ubatch": args.n_batch,
                "kv_cache": "f16", "flash_attn": False, "logits_all": False,
                "repeats": args.repeats, "statistic": "median", "warmup_runs": 1,
                "prompt_source": "first N tokens of wiki.txt (scripts/fetch-assets.sh)",
                "decode": "greedy, %d tokens after a %d-token prefill" % (args.gen, args.decode_prompt),
            },
            "prompt_first_ids": first_ids[:16],
        },
        "results": results,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", os.path.relpath(args.json, REPO))


if __name__ == "__main__":
    main()
