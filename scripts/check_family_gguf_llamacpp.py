#!/usr/bin/env python3
"""Cross-checks a family fixture's GGUF against llama.cpp: its logits of the reference
prompt and its greedy continuation, beside transformers' float64 reference in
reference.json (what crates/model/tests/families.rs checks turbokv against).

Confirms that the GGUF written by scripts/make_family_fixtures.py is laid out the way
llama.cpp reads that architecture (tensor names and shapes, metadata, conv tap order,
MXFP4 blocks).

  # llama.cpp built as a shared library (BENCHMARKS.md has the commands), with the
  # llama-cpp-python sdist's own bindings:
  LLAMA_CPP_LIB_PATH=BUILD/bin PYTHONPATH=SDIST python3 scripts/check_family_gguf_llamacpp.py lfm2 gpt_oss
  # or with the package pip builds:
  /work/venv-ref/bin/pip install llama-cpp-python==0.3.36
  /work/venv-ref/bin/python scripts/check_family_gguf_llamacpp.py lfm2 gpt_oss

gpt-oss: llama.cpp rounds YaRN's ramp ends to whole pairs (floor/ceil in
ggml_rope_yarn_corr_dims) where gpt-oss's config (`truncate: false`), transformers and
OpenAI's reference do not; the fixture's ramp ends fall between pairs on purpose, so that
rounding moves its logits by as much as the logits themselves. And ggml's CPU rounds the
experts' inputs to Q8_0 before its MXFP4 dot products, which this fixture (gate/up weights
large enough to reach the clamp, four layers of routing) amplifies to several percent of
the logit scale. So gpt-oss is checked as a chain against scripts/np_gpt_oss_ref.py, a
float64 forward pass of the same GGUF: (1) without rounding it reproduces transformers;
(2) llama.cpp on an F32 rendering of the GGUF (every tensor dequantized: the same values)
with an F32 KV cache matches it with llama.cpp's YaRN rounding; (3) llama.cpp with the
file's own MXFP4 experts (the rest F32) matches it with the rounding and Q8_0 expert
inputs; (4) the file as users run it (f16 weights and KV) stays within twice what the
Q8_0 rounding alone moves the logits.

Only the LFM2 and gpt-oss fixtures store their 1-D tensors in f32 as llama.cpp's converter
does; the Granite and Gemma 3 fixtures keep f16 norms, which ggml's CPU backend refuses to
multiply (`binary_op: unsupported types`). Not run by CI.
"""

import json
import os
import sys

import numpy as np
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = os.path.join(os.path.dirname(HERE), "crates", "model", "tests", "fixtures", "families")

# Largest llama.cpp logit error relative to the logit scale that passes, as llama.cpp runs the
# file (ggml's CPU multiplies f16 weights with activations rounded to f16 and keeps an f16 KV
# cache: ~1e-3 per value, observed 2.0e-3 on LFM2 through five layers) ...
TOLERANCE = 5e-3
# ... and with every tensor and the KV cache in F32, against a float64 reference computing
# what llama.cpp computes (f32 arithmetic through four layers: observed 1e-6).
TOLERANCE_EXACT = 1e-4
# Greedy tokens that must agree (the issue asks for at least 32 of the 40).
GREEDY_MIN = 32


def llama_cpp_run(path, prompt, greedy_prompt, n, kv=None):
    """llama.cpp's logits of every position of `prompt`, and its greedy continuation; `kv`:
    the KV cache's ggml type (default f16)."""
    kw = {} if kv is None else {"type_k": kv, "type_v": kv}
    llm = Llama(model_path=path, n_ctx=256, n_batch=256, logits_all=True, n_threads=2,
                verbose=False, **kw)
    llm.reset()
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float64)
    llm.reset()
    llm.eval(list(greedy_prompt))
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return logits, out


def agreeing(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rel(got, want):
    return float(np.abs(got - want).max()) / float(np.abs(want).max())


def render(src, dst, keep_mxfp4):
    """`src` with every tensor stored as F32 (the same values: f16 and MXFP4 widen exactly),
    or all but the MXFP4 ones."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        if keep_mxfp4 and t.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_gpt_oss(path, ref, got, got_greedy):
    """The chain of the module docstring; True when (1)–(4) hold."""
    import tempfile

    import llama_cpp
    from np_gpt_oss_ref import GptOssRef

    n = len(ref["greedy"])
    exact = GptOssRef(path)
    r = rel(exact.forward(ref["prompt"]), np.array(ref["logits"]))
    same = agreeing(exact.greedy(ref["greedy_prompt"], n), ref["greedy"])
    print(f"gpt_oss: (1) np_gpt_oss_ref vs transformers: {r:.1e} relative; greedy {same}/{n}")
    ok = r <= 1e-5 and same == n
    rounded = GptOssRef(path, round_yarn=True)
    print(f"gpt_oss:     rounding YaRN's ramp ends (llama.cpp) moves its logits by "
          f"{rel(rounded.forward(ref['prompt']), np.array(ref['logits'])):.1e} relative")
    rounded_q8 = GptOssRef(path, round_yarn=True, q8_experts=True)
    f32 = llama_cpp.GGML_TYPE_F32
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("(2) every tensor F32, F32 KV", os.path.join(tmp, "f32.gguf"), False, rounded),
                ("(3) MXFP4 experts, rest F32, F32 KV", os.path.join(tmp, "mx.gguf"), True,
                 rounded_q8)]
        for what, file, keep, model in runs:
            render(path, file, keep)
            logits, greedy = llama_cpp_run(file, ref["prompt"], ref["greedy_prompt"], n, kv=f32)
            r = rel(logits, model.forward(ref["prompt"]))
            same = agreeing(greedy, model.greedy(ref["greedy_prompt"], n))
            print(f"gpt_oss: {what}: llama.cpp vs np_gpt_oss_ref --round-yarn"
                  f"{' --q8-experts' if keep else ''}: {r:.1e} relative; greedy {same}/{n}")
            ok &= r <= TOLERANCE_EXACT and same >= GREEDY_MIN
    # (4): the Q8_0 rounding alone moves the float64 logits by `noise`; llama.cpp as users run
    # it (f16 activations and KV besides, each ~1e-3) must stay within twice that of the
    # reference that rounds as it does. No greedy bound: noise of that size flips tokens
    # whose margin is below it (the rounded model's smallest is 0.015).
    want = rounded_q8.forward(ref["prompt"])
    noise = rel(want, rounded.forward(ref["prompt"]))
    r = rel(got, want)
    same = agreeing(got_greedy, rounded_q8.greedy(ref["greedy_prompt"], n))
    print(f"gpt_oss:     Q8_0 expert inputs (ggml's CPU) move its logits by {noise:.1e} relative")
    print(f"gpt_oss: (4) as committed (f16 weights and KV) vs np_gpt_oss_ref --round-yarn "
          f"--q8-experts: {r:.1e} relative (bound {2 * noise:.1e}); greedy {same}/{n}")
    return ok and r <= 2 * noise


def check(name):
    d = os.path.join(FAMILIES, name)
    path = os.path.join(d, "model.gguf")
    with open(os.path.join(d, "reference.json")) as f:
        ref = json.load(f)
    want = np.array(ref["logits"], dtype=np.float64)
    n = len(ref["greedy"])
    got, got_greedy = llama_cpp_run(path, ref["prompt"], ref["greedy_prompt"], n)
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    same = agreeing(got_greedy, ref["greedy"])
    print(f"{name}: llama.cpp vs transformers: max logit error {err:.2e} of scale {scale:.2f} "
          f"({err / scale:.1e} relative); greedy agrees for {same}/{n} tokens")
    if name == "gpt_oss":
        return check_gpt_oss(path, ref, got, got_greedy)
    return err / scale <= TOLERANCE and same >= GREEDY_MIN


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    ok = True
    for fam in sys.argv[1:] or ["lfm2"]:
        passed = check(fam)
        print(f"{fam}: {'PASS' if passed else 'FAIL'}")
        ok &= passed
    sys.exit(0 if ok else 1)
