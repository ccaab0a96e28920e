#!/usr/bin/env python3
"""Cross-checks a family fixture's GGUF against llama.cpp: its logits of the reference
prompt and its greedy continuation, beside transformers' float64 reference in
reference.json (what crates/model/tests/families.rs checks turbokv against).

Confirms that the GGUF written by scripts/make_family_fixtures.py is laid out the way
llama.cpp reads that architecture (tensor names and shapes, metadata, conv tap order).

  /work/venv-ref/bin/pip install llama-cpp-python==0.3.36   # builds llama.cpp (CPU)
  /work/venv-ref/bin/python scripts/check_family_gguf_llamacpp.py lfm2

Only the LFM2 fixture stores its 1-D tensors in f32 as llama.cpp's converter does; the
Granite and Gemma 3 fixtures keep f16 norms, which ggml's CPU backend refuses to multiply
(`binary_op: unsupported types`). Not run by CI.
"""

import json
import os
import sys

import numpy as np
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = os.path.join(os.path.dirname(HERE), "crates", "model", "tests", "fixtures", "families")


def check(name):
    d = os.path.join(FAMILIES, name)
    with open(os.path.join(d, "reference.json")) as f:
        ref = json.load(f)
    llm = Llama(
        model_path=os.path.join(d, "model.gguf"),
        n_ctx=256,
        n_batch=256,
        logits_all=True,
        n_threads=2,
        verbose=False,
    )
    prompt = ref["prompt"]
    llm.reset()
    llm.eval(prompt)
    got = np.array(llm.scores[: len(prompt)], dtype=np.float64)
    want = np.array(ref["logits"], dtype=np.float64)
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    llm.reset()
    ids = list(ref["greedy_prompt"])
    llm.eval(ids)
    out = []
    for _ in range(len(ref["greedy"])):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    agree = next((i for i, (a, b) in enumerate(zip(out, ref["greedy"])) if a != b), len(out))
    print(
        f"{name}: llama.cpp max logit error {err:.2e} of scale {scale:.2f} "
        f"({err / scale:.1e} relative); greedy agrees for {agree}/{len(out)} tokens"
    )
    return err / scale, agree == len(out)


if __name__ == "__main__":
    ok = True
    for fam in sys.argv[1:] or ["lfm2"]:
        rel, same = check(fam)
        ok &= same
    sys.exit(0 if ok else 1)
