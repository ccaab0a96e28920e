#!/usr/bin/env python3
"""Tiny, slow, exact numpy reference forward pass for llama-architecture GGUFs.

Our own code (no llama.cpp code): a minimal GGUF reader, Q4_0/Q4_1/Q8_0/F16/F32 (and, for
np_gpt_oss_ref.py, MXFP4) dequantization and a plain Llama forward pass (RMSNorm, adjacent-pair "NORM"
RoPE as llama.cpp stores q/k, GQA causal attention, SwiGLU, tied or untied
output).  Weights are dequantized exactly; all activations stay in float64
(or float32), so the only difference to llama.cpp is llama.cpp's own rounding
(activations quantized to Q8_1 for the quantized matmuls, f16 KV cache, ...).
make_fixtures.py uses it to measure that noise.

    python3 scripts/np_llama_ref.py MODEL.gguf 1 2 3   # prints top-5 per position

Needs numpy only.
"""

import struct
import sys

import numpy as np

GGUF_VALUE_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
                      6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_MXFP4 = 0, 1, 2, 3, 8, 39
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 39: "MXFP4"}

# e2m1: the value of each 4-bit MXFP4 code (OCP Microscaling spec).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


class GGUF:
    """Parsed header of a GGUF v2/v3 file; tensor data read lazily."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            self.buf = f.read()
        b = self.buf
        self.pos = 0
        magic = b[:4]
        if magic != b"GGUF":
            raise ValueError("not a GGUF file: %r" % magic)
        self.pos = 4
        self.version = self._u32()
        n_tensors = self._u64()
        n_kv = self._u64()
        self.kv = {}
        for _ in range(n_kv):
            key = self._str()
            vtype = self._u32()
            self.kv[key] = self._value(vtype)
        self.tensors = {}
        for _ in range(n_tensors):
            name = self._str()
            n_dims = self._u32()
            dims = [self._u64() for _ in range(n_dims)]
            ttype = self._u32()
            offset = self._u64()
            self.tensors[name] = (dims, ttype, offset)
        align = int(self.kv.get("general.alignment", 32))
        self.data_start = (self.pos + align - 1) // align * align

    def _unpack(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def _u32(self):
        return self._unpack("<I")

    def _u64(self):
        return self._unpack("<Q")

    def _str(self):
        n = self._u64()
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="surrogateescape")
        self.pos += n
        return s

    def _value(self, vtype):
        if vtype == 8:
            return self._str()
        if vtype == 9:
            etype = self._u32()
            n = self._u64()
            if etype in GGUF_VALUE_FORMATS:
                fmt = GGUF_VALUE_FORMATS[etype]
                size = struct.calcsize(fmt)
                arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos)
                self.pos += size * n
                return arr
            return [self._value(etype) for _ in range(n)]
        return self._unpack(GGUF_VALUE_FORMATS[vtype])

    def tensor_type(self, name):
        return GGML_TYPE_NAMES.get(self.tensors[name][1], str(self.tensors[name][1]))

    def tensor(self, name, dtype=np.float32):
        """Dequantized tensor, numpy shape = reversed ggml ne (rows, cols)."""
        dims, ttype, offset = self.tensors[name]
        n = int(np.prod(dims))
        start = self.data_start + offset
        if ttype == GGML_F32:
            out = np.frombuffer(self.buf, np.float32, n, start).astype(dtype)
        elif ttype == GGML_F16:
            out = np.frombuffer(self.buf, np.float16, n, start).astype(dtype)
        elif ttype in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_MXFP4):
            out = _dequant(self.buf, start, n, ttype).astype(dtype)
        else:
            raise NotImplementedError("ggml type %d (%s)" % (ttype, name))
        return out.reshape(list(reversed(dims)))


def _dequant(buf, start, n, ttype):
    nb = n // 32
    if ttype == GGML_MXFP4:
        # ggml's block_mxfp4: an e8m0 scale byte (2^(e - 127)), then 16 bytes whose low
        # nibbles are elements 0..15 and high nibbles elements 16..31.
        blk = np.frombuffer(buf, np.uint8, nb * 17, start).reshape(nb, 17)
        codes = np.concatenate([blk[:, 1:] & 0x0F, blk[:, 1:] >> 4], axis=1)
        return np.ldexp(E2M1[codes], blk[:, :1].astype(np.int32) - 127).reshape(-1)
    if ttype == GGML_Q8_0:
        blk = np.frombuffer(buf, np.uint8, nb * 34, start).reshape(nb, 34)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = blk[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    if ttype == GGML_Q4_1:
        blk = np.frombuffer(buf, np.uint8, nb * 20, start).reshape(nb, 20)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blk[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blk[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(-1)
    if ttype == GGML_Q4_0:
        blk = np.frombuffer(buf, np.uint8, nb * 18, start).reshape(nb, 18)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
        qs = blk[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8.0
        return (d * q).reshape(-1)
    raise NotImplementedError(ttype)


class LlamaRef:
    def __init__(self, path, dtype=np.float64):
        g = GGUF(path)
        self.gguf = g
        arch = g.kv["general.architecture"]
        if arch != "llama":
            raise NotImplementedError(arch)
        kv = g.kv
        self.dtype = dtype
        self.n_layer = int(kv["llama.block_count"])
        self.n_embd = int(kv["llama.embedding_length"])
        self.n_head = int(kv["llama.attention.head_count"])
        self.n_head_kv = int(kv.get("llama.attention.head_count_kv", self.n_head))
        self.head_dim = self.n_embd // self.n_head
        self.n_rot = int(kv.get("llama.rope.dimension_count", self.head_dim))
        self.eps = float(kv["llama.attention.layer_norm_rms_epsilon"])
        self.rope_base = float(kv.get("llama.rope.freq_base", 10000.0))
        t = lambda name: g.tensor(name, dtype)
        self.tok_embd = t("token_embd.weight")          # (n_vocab, n_embd)
        self.output = t("output.weight") if "output.weight" in g.tensors else self.tok_embd
        self.tied_output = "output.weight" not in g.tensors
        self.output_norm = t("output_norm.weight")
        self.layers = []
        for i in range(self.n_layer):
            p = "blk.%d." % i
            self.layers.append({k: t(p + k + ".weight") for k in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
        self.n_vocab = self.tok_embd.shape[0]

    def _rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, pos):
        # x: (T, H, D); llama.cpp "NORM" rope: rotate adjacent pairs (2i, 2i+1).
        d = self.n_rot
        inv = self.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = pos[:, None].astype(np.float64) * inv[None, :]      # (T, d/2)
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        x = x.copy()
        x0 = x[..., 0:d:2].copy()
        x1 = x[..., 1:d:2].copy()
        x[..., 0:d:2] = x0 * cos - x1 * sin
        x[..., 1:d:2] = x0 * sin + x1 * cos
        return x

    def forward(self, tokens):
        """Logits (T, n_vocab) for a whole sequence starting at position 0."""
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        pos = np.arange(T)
        H, KV, D = self.n_head, self.n_head_kv, self.head_dim
        x = self.tok_embd[tokens].astype(self.dtype)
        mask = np.triu(np.full((T, T), -np.inf, dtype=self.dtype), k=1)
        scale = 1.0 / np.sqrt(D)
        for L in self.layers:
            h = self._rmsnorm(x, L["attn_norm"])
            q = (h @ L["attn_q"].T).reshape(T, H, D)
            k = (h @ L["attn_k"].T).reshape(T, KV, D)
            v = (h @ L["attn_v"].T).reshape(T, KV, D)
            q = self._rope(q, pos)
            k = self._rope(k, pos)
            rep = H // KV
            k = np.repeat(k, rep, axis=1)      # head h uses kv head h // rep
            v = np.repeat(v, rep, axis=1)
            att = np.einsum("thd,shd->hts", q, k) * scale + mask
            att = att - att.max(axis=-1, keepdims=True)
            att = np.exp(att)
            att /= att.sum(axis=-1, keepdims=True)
            o = np.einsum("hts,shd->thd", att, v).reshape(T, H * D)
            x = x + o @ L["attn_output"].T
            h = self._rmsnorm(x, L["ffn_norm"])
            gate = h @ L["ffn_gate"].T
            up = h @ L["ffn_up"].T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ L["ffn_down"].T
        x = self._rmsnorm(x, self.output_norm)
        return x @ self.output.T


def main(argv):
    if len(argv) < 3:
        sys.stderr.write(__doc__)
        return 2
    m = LlamaRef(argv[1])
    ids = [int(a) for a in argv[2:]]
    logits = m.forward(ids)
    for i, row in enumerate(logits):
        top = np.argsort(-row)[:5]
        print(i, ids[i], [(int(t), round(float(row[t]), 4)) for t in top])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
