#!/usr/bin/env python3
"""Tiny, slow, exact numpy reference forward pass for gpt-oss GGUFs (float64).

Our own code (no llama.cpp code), on np_llama_ref.py's GGUF reader: the layout llama.cpp's
converter writes (ffn_{gate,up,down}_exps in MXFP4 or floats, biases, attn_sinks, the
pre-MLP norm as post_attention_norm) and the computation of transformers' GptOss /
OpenAI's reference: RMSNorm, q/k/v/o biases, half-split ("NEOX") RoPE with YaRN, GQA
attention whose softmax has one extra learned logit per head (the sink, no value), even
layers in an `attention.sliding_window`-token window, a router with bias picking the top-k
experts (ties to the lower index) weighted by a softmax over the chosen logits, and each
expert's clamped SwiGLU `(clamp(up, ±7) + 1) · g σ(1.702 g)`, `g = min(gate, 7)`.

YaRN's ramp between interpolated and original frequencies runs between two correction
dims; gpt-oss's config (`truncate: false`) and OpenAI's reference keep them as computed,
llama.cpp always rounds them outwards (floor / ceil in `ggml_rope_yarn_corr_dims`).
`--round-yarn` computes what llama.cpp computes. ggml's CPU also rounds the experts' inputs
to Q8_0 (32-value blocks of int8 with an f16 scale) before multiplying them with MXFP4
weights; `--q8-experts` does the same (scripts/check_family_gguf_llamacpp.py uses both to
show that nothing else separates llama.cpp's reading of a GGUF from transformers').

    python3 scripts/np_gpt_oss_ref.py [--round-yarn] [--q8-experts] MODEL.gguf 1 2 3   # top-5

Needs numpy only.
"""

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from np_llama_ref import GGUF  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0  # the experts' activation (llama.cpp hard-codes them too)


def q8_0(x):
    """`x` through ggml's Q8_0 (quantize_row_q8_0): per 32 values along the last axis, a
    scale d = amax / 127 stored in f16 and codes round(x / d), halves away from zero."""
    b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = b * inv
    codes = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return (codes * d.astype(np.float16).astype(np.float64)).reshape(x.shape)


class GptOssRef:
    def __init__(self, path, round_yarn=False, q8_experts=False):
        self.q8_experts = q8_experts
        g = GGUF(path)
        kv = g.kv
        arch = kv["general.architecture"]
        if arch != "gpt-oss":
            raise NotImplementedError(arch)
        k = lambda s, d=None: kv.get(f"{arch}.{s}", d)
        self.n_layer = int(k("block_count"))
        self.n_head = int(k("attention.head_count"))
        self.n_head_kv = int(k("attention.head_count_kv"))
        self.head_dim = int(k("attention.key_length"))
        self.eps = float(k("attention.layer_norm_rms_epsilon"))
        self.window = int(k("attention.sliding_window"))
        self.top_k = int(k("expert_used_count"))
        base = float(k("rope.freq_base", 10000.0))
        if k("rope.scaling.type") == "yarn":
            factor = float(k("rope.scaling.factor"))
            orig = float(k("rope.scaling.original_context_length"))
            betas = float(k("rope.scaling.yarn_beta_fast", 32.0)), float(
                k("rope.scaling.yarn_beta_slow", 1.0))
            self.inv_freq = yarn_inv_freq(base, self.head_dim, factor, orig, betas, round_yarn)
            self.attn_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        else:
            self.inv_freq = base ** (-np.arange(0, self.head_dim, 2) / self.head_dim)
            self.attn_factor = 1.0
        t = lambda name: g.tensor(name, np.float64)
        self.tok_embd = t("token_embd.weight")
        self.output = t("output.weight")
        self.output_norm = t("output_norm.weight")
        names = ["attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight",
                 "attn_output.weight", "attn_output.bias", "ffn_gate_inp.weight",
                 "ffn_gate_inp.bias"]
        for e in ("gate", "up", "down"):
            names += [f"ffn_{e}_exps.weight", f"ffn_{e}_exps.bias"]
        for p in ("q", "k", "v"):
            names += [f"attn_{p}.weight", f"attn_{p}.bias"]
        self.layers = [{n: t(f"blk.{i}.{n}") for n in names} for i in range(self.n_layer)]

    def _rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, pos):
        half = self.head_dim // 2
        ang = pos[:, None] * self.inv_freq[None, :]
        cos = (np.cos(ang) * self.attn_factor)[:, None, :]
        sin = (np.sin(ang) * self.attn_factor)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def forward(self, tokens):
        """Logits (T, n_vocab) of a whole sequence starting at position 0."""
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        H, KV, D = self.n_head, self.n_head_kv, self.head_dim
        causal = np.arange(T)[None, :] > np.arange(T)[:, None]
        outside = np.arange(T)[:, None] - np.arange(T)[None, :] >= self.window
        x = self.tok_embd[tokens]
        for i, L in enumerate(self.layers):
            h = self._rms(x, L["attn_norm.weight"])
            q = (h @ L["attn_q.weight"].T + L["attn_q.bias"]).reshape(T, H, D)
            k = (h @ L["attn_k.weight"].T + L["attn_k.bias"]).reshape(T, KV, D)
            v = (h @ L["attn_v.weight"].T + L["attn_v.bias"]).reshape(T, KV, D)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k = np.repeat(k, H // KV, axis=1)
            v = np.repeat(v, H // KV, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / math.sqrt(D)
            s = np.where(causal | outside if i % 2 == 0 else causal, -np.inf, s)
            sink = L["attn_sinks.weight"][:, None, None]
            m = np.maximum(s.max(axis=-1, keepdims=True), sink)
            p = np.exp(s - m)
            p /= p.sum(axis=-1, keepdims=True) + np.exp(sink - m)
            o = np.einsum("hts,shd->thd", p, v).reshape(T, H * D)
            x = x + o @ L["attn_output.weight"].T + L["attn_output.bias"]
            h = self._rms(x, L["post_attention_norm.weight"])
            x = x + self._moe(h, L)
        return self._rms(x, self.output_norm) @ self.output.T

    def _moe(self, h, L):
        logits = h @ L["ffn_gate_inp.weight"].T + L["ffn_gate_inp.bias"]
        out = np.zeros_like(h)
        q = q8_0 if self.q8_experts else (lambda x: x)
        xs = q(h)
        for t in range(h.shape[0]):
            chosen = np.argsort(-logits[t], kind="stable")[: self.top_k]
            w = np.exp(logits[t, chosen] - logits[t, chosen].max())
            for e, we in zip(chosen, w / w.sum()):
                g = L["ffn_gate_exps.weight"][e] @ xs[t] + L["ffn_gate_exps.bias"][e]
                u = L["ffn_up_exps.weight"][e] @ xs[t] + L["ffn_up_exps.bias"][e]
                g = np.minimum(g, LIMIT)
                u = np.clip(u, -LIMIT, LIMIT)
                a = (u + 1) * g / (1 + np.exp(-ALPHA * g))
                out[t] += we * (L["ffn_down_exps.weight"][e] @ q(a) + L["ffn_down_exps.bias"][e])
        return out

    def greedy(self, prompt, n):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(np.argmax(self.forward(ids)[-1])))
        return ids[len(prompt):]


def yarn_inv_freq(base, dim, factor, orig, betas, round_ends):
    """Per-pair inverse frequencies: original ones for the pairs that turn more than
    beta_fast times over the original context, `factor`-interpolated ones for those turning
    fewer than beta_slow times, a linear ramp between (transformers' _compute_yarn_parameters)."""
    corr = lambda rot: dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = corr(betas[0]), corr(betas[1])
    if round_ends:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    i = np.arange(dim // 2)
    extrapolated = base ** (-2.0 * i / dim)
    ramp = np.clip((i - low) / (high - low), 0, 1)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def main(argv):
    flags = {a for a in argv if a.startswith("--")}
    argv = [a for a in argv if not a.startswith("--")]
    if len(argv) < 3 or flags - {"--round-yarn", "--q8-experts"}:
        sys.stderr.write(__doc__)
        return 2
    m = GptOssRef(argv[1], "--round-yarn" in flags, "--q8-experts" in flags)
    ids = [int(a) for a in argv[2:]]
    for i, row in enumerate(m.forward(ids)):
        top = np.argsort(-row)[:5]
        print(i, ids[i], [(int(t), round(float(row[t]), 4)) for t in top])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
