#!/usr/bin/env python3
"""Tiny random models of the Granite, Gemma 3, LFM2 and gpt-oss families, with Hugging Face
reference logits.

For each family this writes, under crates/model/tests/fixtures/families/<name>/:

  hf/config.json, hf/model.safetensors   the model as transformers saves it (f16 weights)
  model.gguf                             the same weights in llama.cpp's GGUF conventions
                                         for the architecture (tensor names, metadata,
                                         Gemma's norm weights stored as 1 + w, llama-style
                                         Q/K row permutation for Granite); LFM2's keeps
                                         1-D tensors and conv taps in f32 as the converter
                                         does (llama.cpp runs it:
                                         scripts/check_family_gguf_llamacpp.py) and
                                         carries a character-level tokenizer for the CLI;
                                         gpt-oss's is written from hf/ as llama.cpp's
                                         convert_hf_to_gguf.py writes a gpt-oss checkpoint
                                         (experts in MXFP4, ggml type 39; gpt_oss_gguf has
                                         the details) and carries the same tokenizer
  reference.json                         logits of a prompt from transformers in float64,
                                         and a greedy continuation with its smallest
                                         top-1/top-2 margin

The weights are rounded to f16 before the reference runs, so the reference sees exactly the
stored weights. Shapes keep each family's structure (Gemma 3: five sliding-window layers per
global layer, q/k norms, pre/post norms, GeGLU, separate RoPE bases; Granite: its four
multipliers; LFM2: gated short-conv layers between attention layers, q/k norms, its
auto-adjusted MLP width, tied embeddings; gpt-oss: alternating sliding-window and full
layers, sinks, q/k/v/o biases, YaRN, four experts top-2 with biases, whose weights are
rounded to MXFP4 so that both formats hold exactly what the reference ran) while staying a
few hundred kB.

How to regenerate (never needed by CI; needs torch + transformers + gguf):

  python3 -m venv /work/venv-ref
  /work/venv-ref/bin/pip install torch transformers==5.24.0 gguf==0.19.0 safetensors numpy
  /work/venv-ref/bin/python scripts/make_family_fixtures.py [--only granite,gemma3,lfm2,gpt_oss]

gpt-oss's model.gguf alone, from the committed hf/ (numpy + gguf; hf/ and reference.json
untouched):

  python3 scripts/make_family_fixtures.py --only gpt_oss --gguf-only

Output is deterministic for given package versions (seeded; no timestamps).
"""

import argparse
import json
import math
import os
import shutil
import struct
import sys

import numpy as np

try:
    import torch
except ImportError:  # --gguf-only runs on numpy and gguf alone
    torch = None

sys.dont_write_bytecode = True

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(REPO, "crates", "model", "tests", "fixtures", "families")

PROMPT_LEN = 24
GREEDY_PROMPT_LEN = 8
GREEDY_TOKENS = 40


def randomize(model, seed, norm_center):
    """Weights with signal (HF's init makes near-uniform logits): matrices ~ U(±√3/√fan_in)
    scaled up a little, embeddings ~ U(±1), norm weights around `norm_center`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            u = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1
            if "norm" in name:
                v = norm_center + 0.2 * u
            elif "embed_tokens" in name:
                v = u
            else:
                v = u * 2.0 / math.sqrt(p.shape[-1])
            # Round to f16 so that the stored weights are exactly what the reference uses.
            p.copy_(v.to(torch.float16).to(p.dtype))


def reference(model, vocab, seed):
    rng = np.random.default_rng(seed)
    model = model.to(torch.float64).eval()
    prompt = [int(x) for x in rng.integers(0, vocab, PROMPT_LEN)]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].numpy()
    gprompt = [int(x) for x in rng.integers(0, vocab, GREEDY_PROMPT_LEN)]
    ids = list(gprompt)
    margins = []
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            row = model(torch.tensor([ids])).logits[0, -1].numpy()
            top = np.argsort(-row, kind="stable")[:2]
            margins.append(float(row[top[0]] - row[top[1]]))
            ids.append(int(top[0]))
    return {
        "prompt": prompt,
        "logits": [[float(f"{x:.7g}") for x in r] for r in logits],
        "greedy_prompt": gprompt,
        "greedy": ids[len(gprompt):],
        "greedy_min_margin": min(margins),
    }


def save_hf(model, d):
    model = model.to(torch.float16)
    model.save_pretrained(d, safe_serialization=True)
    # Generation defaults are not part of what the engine reads.
    gc = os.path.join(d, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)


def permute_qk(w, heads):
    """HF's half-split rows → llama.cpp's interleaved pairs: row (h, s, j) → (h, j, s)."""
    rows, cols = w.shape
    hd = rows // heads
    return w.reshape(heads, 2, hd // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def char_tokenizer(w, vocab):
    """A SentencePiece-style vocabulary of single characters (`<unk>`, `<s>`, `</s>`,
    printable ASCII with `▁` for space, newline, padding up to `vocab`), so that the CLI
    (`turbokv eval ppl`, `run`) can drive a tiny model: text outside it maps to `<unk>`."""
    toks = ["<unk>", "<s>", "</s>"] + ["\u2581" if c == 32 else chr(c) for c in range(32, 127)]
    toks.append("\n")
    toks += [f"<pad{i}>" for i in range(len(toks), vocab)]
    assert len(toks) == vocab
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_gguf(path, arch, meta, tensors, tokenizer_vocab=None, f32=lambda name, v: False,
               raw=None):
    """`f32(name, array)`: tensors stored as float32 rather than f16 (the values are
    f16-rounded either way, so both hold exactly what the reference ran). `raw`: name →
    (quantized bytes, ggml type) written as they are. Meta keys are under `{arch}.` except
    those starting with `general.`."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for key, (kind, value) in meta.items():
        full = key if key.startswith("general.") else f"{arch}.{key}"
        if kind == "u32":
            w.add_uint32(full, value)
        elif kind == "f32":
            w.add_float32(full, value)
        elif kind == "u32s":
            w.add_array(full, [int(v) for v in value])
        elif kind == "str":
            w.add_string(full, value)
        else:
            raise ValueError(kind)
    if tokenizer_vocab:
        char_tokenizer(w, tokenizer_vocab)
    raw = raw or {}
    for name in sorted(set(tensors) | set(raw)):
        if name in raw:
            data, qtype = raw[name]
            w.add_tensor(name, data, raw_dtype=qtype)
            continue
        v = tensors[name]
        w.add_tensor(name, v.astype(np.float32 if f32(name, v) else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sd_numpy(model):
    return {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}


LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
}


def gguf_tensors(sd, layer_names, norm_shift=0.0, permute=None):
    out = {}
    for k, v in sd.items():
        if k == "model.embed_tokens.weight":
            out["token_embd.weight"] = v
        elif k == "model.norm.weight":
            out["output_norm.weight"] = v + norm_shift
        elif k == "lm_head.weight":
            out["output.weight"] = v
        else:
            rest = k.removeprefix("model.layers.")
            layer, tail = rest.split(".", 1)
            g = layer_names[tail]
            if "norm" in g:
                v = v + norm_shift
            if permute and g in permute:
                v = permute_qk(v, permute[g])
            out[f"blk.{layer}.{g}"] = v
    return out


def granite(out):
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        embedding_multiplier=6.0,
        residual_multiplier=0.4,
        attention_multiplier=0.09,
        logits_scaling=4.0,
    )
    torch.manual_seed(0)
    model = GraniteForCausalLM(cfg).to(torch.float32)
    randomize(model, 11, 1.0)
    sd = sd_numpy(model)
    ref = reference(model, cfg.vocab_size, 12)
    save_hf(model, os.path.join(out, "hf"))
    names = dict(LAYER_NAMES, **{"post_attention_layernorm.weight": "ffn_norm.weight"})
    perm = {"attn_q.weight": cfg.num_attention_heads, "attn_k.weight": cfg.num_key_value_heads}
    meta = {
        "context_length": ("u32", 256),
        "embedding_length": ("u32", cfg.hidden_size),
        "block_count": ("u32", cfg.num_hidden_layers),
        "feed_forward_length": ("u32", cfg.intermediate_size),
        "attention.head_count": ("u32", cfg.num_attention_heads),
        "attention.head_count_kv": ("u32", cfg.num_key_value_heads),
        "attention.layer_norm_rms_epsilon": ("f32", cfg.rms_norm_eps),
        "rope.freq_base": ("f32", 10000.0),
        "vocab_size": ("u32", cfg.vocab_size),
        "embedding_scale": ("f32", cfg.embedding_multiplier),
        "residual_scale": ("f32", cfg.residual_multiplier),
        "attention.scale": ("f32", cfg.attention_multiplier),
        "logit_scale": ("f32", cfg.logits_scaling),
    }
    write_gguf(os.path.join(out, "model.gguf"), "granite", meta, gguf_tensors(sd, names, 0.0, perm))
    return ref


def gemma3(out):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        sliding_window=8,
        query_pre_attn_scalar=32,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).to(torch.float32)
    # Gemma's norms scale by (1 + w): weights around 0.
    randomize(model, 21, 0.0)
    sd = sd_numpy(model)
    ref = reference(model, cfg.vocab_size, 22)
    save_hf(model, os.path.join(out, "hf"))
    names = dict(
        LAYER_NAMES,
        **{
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
        },
    )
    meta = {
        "context_length": ("u32", 256),
        "embedding_length": ("u32", cfg.hidden_size),
        "block_count": ("u32", cfg.num_hidden_layers),
        "feed_forward_length": ("u32", cfg.intermediate_size),
        "attention.head_count": ("u32", cfg.num_attention_heads),
        "attention.head_count_kv": ("u32", cfg.num_key_value_heads),
        "attention.key_length": ("u32", cfg.head_dim),
        "attention.value_length": ("u32", cfg.head_dim),
        "attention.layer_norm_rms_epsilon": ("f32", cfg.rms_norm_eps),
        "attention.sliding_window": ("u32", cfg.sliding_window),
        "rope.freq_base": ("f32", 1000000.0),
        "vocab_size": ("u32", cfg.vocab_size),
    }
    write_gguf(os.path.join(out, "model.gguf"), "gemma3", meta, gguf_tensors(sd, names, 1.0))
    return ref


LFM2_NAMES = {
    "operator_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight",
    "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "conv.conv.weight": "shortconv.conv.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight",
}


def lfm2(out):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    layer_types = ["conv", "conv", "full_attention", "conv", "full_attention"]
    cfg = Lfm2Config(
        vocab_size=128,
        hidden_size=32,
        # Auto-adjusted as the published models are: int(2/3 · 150) = 100, rounded up to a
        # multiple of 32 = 128 (what llama.cpp's converter writes as feed_forward_length).
        intermediate_size=150,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=32,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        norm_eps=1e-5,
        conv_L_cache=3,
        conv_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(cfg).to(torch.float32)
    randomize(model, 37, 1.0)
    sd = sd_numpy(model)
    ref = reference(model, cfg.vocab_size, 32)
    save_hf(model, os.path.join(out, "hf"))
    ffn = model.model.layers[0].feed_forward.w1.weight.shape[0]
    tensors = {}
    for k, v in sd.items():
        if k == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = v
        elif k == "model.embedding_norm.weight":
            tensors["token_embd_norm.weight"] = v
        elif k == "lm_head.weight":
            continue  # tied: llama.cpp's converter writes no output.weight
        else:
            layer, tail = k.removeprefix("model.layers.").split(".", 1)
            # The converter squeezes the conv's [hidden, 1, L] to [hidden, L].
            tensors[f"blk.{layer}.{LFM2_NAMES[tail]}"] = v.squeeze(1) if v.ndim == 3 else v
    kv = [cfg.num_key_value_heads if t != "conv" else 0 for t in layer_types]
    meta = {
        "context_length": ("u32", 256),
        "embedding_length": ("u32", cfg.hidden_size),
        "block_count": ("u32", cfg.num_hidden_layers),
        "feed_forward_length": ("u32", ffn),
        "attention.head_count": ("u32", cfg.num_attention_heads),
        # Per layer, 0 for conv layers: how llama.cpp marks the layer types.
        "attention.head_count_kv": ("u32s", kv),
        "attention.layer_norm_rms_epsilon": ("f32", cfg.norm_eps),
        "rope.freq_base": ("f32", 1000000.0),
        "vocab_size": ("u32", cfg.vocab_size),
        "shortconv.l_cache": ("u32", cfg.conv_L_cache),
    }
    # As llama.cpp's converter: 1-D tensors and the conv taps in f32 (ggml's CPU multiplies
    # f32 activations by f32 norm weights only).
    keep_f32 = lambda name, v: v.ndim == 1 or name.endswith("shortconv.conv.weight")
    write_gguf(os.path.join(out, "model.gguf"), "lfm2", meta, tensors, cfg.vocab_size, keep_f32)
    return ref


# transformers' names → the names llama.cpp's converter gives them (gguf-py's tensor map
# for MODEL_ARCH.GPT_OSS); the experts are handled apart.
GPT_OSS_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}

# e2m1, the 4-bit code's value (OCP MX spec; transformers' FP4_VALUES).
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_round(w):
    """The values MXFP4 stores for `w` (blocks of 32 along its last axis), by gguf-py's
    quantizer: what the generator rounds the experts to before the reference runs."""
    import gguf

    mx = gguf.GGMLQuantizationType.MXFP4
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), mx), mx)


def hf_mxfp4(w):
    """`w` [..., n] in the packed MXFP4 form of gpt-oss's published checkpoints
    (`*_blocks` [..., n/32, 16]: element 2i in the low nibble of byte i, 2i + 1 in the high
    one; `*_scales` [..., n/32]: e8m0 bytes, 2^(s − 127)). The scale is gguf-py's choice
    (2^(⌊log2 amax⌋ − 2)); `w` must already lie on that grid (mxfp4_round), so nothing is
    rounded here."""
    b = w.astype(np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1)
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    step = np.exp2(s.astype(np.float64) - 127)[..., None]
    codes = np.abs(FP4 * step[..., None] - b[..., None]).argmin(-1).astype(np.uint8)
    if not np.array_equal(FP4[codes] * step, b):
        raise ValueError("expert weights are not on the MXFP4 grid")
    return codes[..., 0::2] | (codes[..., 1::2] << 4), s


def ggml_mxfp4(blocks, scales):
    """ggml's `block_mxfp4` bytes of packed MXFP4, as llama.cpp's converter repacks gpt-oss's
    experts (bits moved, nothing rounded): per block the scale byte, then 16 bytes whose low
    nibbles are elements 0..15 and high nibbles elements 16..31. [..., G, 16] → [..., 17 G]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], -1)
    return np.ascontiguousarray(out.reshape(*out.shape[:-2], -1))


def read_safetensors(path):
    """name → float32 array of a safetensors file (F16, BF16, F32), with numpy alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = np.frombuffer(data[a:b], dtype={"F16": np.float16, "F32": np.float32,
                                              "BF16": np.uint16}[t["dtype"]])
        if t["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float32).reshape(t["shape"])
    return out


def gpt_oss(out):
    from transformers import GptOssConfig, GptOssForCausalLM

    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cfg = GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        # YaRN as gpt-oss configures it, scaled down: a ramp whose ends fall between pairs
        # (truncate false), so rounding them would show.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        attention_bias=True,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).to(torch.float32)
    randomize(model, 41, 1.0)
    g = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for layer in model.model.layers:
            # Sinks large enough to take a real share of each softmax.
            s = layer.self_attn.sinks
            s.copy_((1.0 + 2.0 * (torch.rand(s.shape, generator=g) * 2 - 1)).half().float())
            ex = layer.mlp.experts
            # Gate/up 4x larger than the rest, so that the clamp at ±7 is reached. The experts
            # are rounded to MXFP4 with blocks along their input (as gpt-oss's checkpoints
            # store them), so that both formats hold exactly what the reference runs.
            gu = ex.gate_up_proj.detach().numpy() * 4.0
            gu = mxfp4_round(gu.transpose(0, 2, 1)).transpose(0, 2, 1)
            down = mxfp4_round(ex.down_proj.detach().numpy().transpose(0, 2, 1))
            ex.gate_up_proj.copy_(torch.from_numpy(np.ascontiguousarray(gu)))
            ex.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(down.transpose(0, 2, 1))))
            assert np.array_equal(gu.astype(np.float16).astype(np.float32), gu)
    # Routing makes the logits piecewise: of a few prompt seeds, keep the one whose greedy
    # continuation has the widest top-1/top-2 margin, so f32 noise cannot flip a token.
    ref = max((reference(model, cfg.vocab_size, seed) for seed in range(42, 58)),
              key=lambda r: r["greedy_min_margin"])
    save_hf(model, os.path.join(out, "hf"))
    gpt_oss_gguf(out)
    return ref


def gpt_oss_gguf(out):
    """model.gguf from hf/ as llama.cpp's convert_hf_to_gguf.py (GptOssModel) writes a
    gpt-oss checkpoint whose experts are MXFP4: names from gguf-py's tensor map; the experts'
    packed blocks repacked to ggml's MXFP4 with gate and up split from the interleaved rows
    of `gate_up_proj` (even rows gate, odd rows up) and their biases likewise; 1-D tensors,
    norms, biases and the router in F32, other matrices in the checkpoint's F16; the config's
    YaRN (factor, original context, betas; llama.cpp keeps no `truncate`) and window. Needs
    numpy and gguf only. One deliberate difference: the 128-character tokenizer of the LFM2
    fixture instead of gpt-oss's o200k BPE, so that the CLI can drive the tiny model."""
    import gguf

    hf = os.path.join(out, "hf")
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    sd = read_safetensors(os.path.join(hf, "model.safetensors"))
    tensors, raw = {}, {}
    mx = gguf.GGMLQuantizationType.MXFP4
    for k, v in sd.items():
        if k == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = v
        elif k == "model.norm.weight":
            tensors["output_norm.weight"] = v
        elif k == "lm_head.weight":
            tensors["output.weight"] = v
        else:
            layer, tail = k.removeprefix("model.layers.").split(".", 1)
            blk = f"blk.{layer}."
            if tail == "mlp.experts.gate_up_proj":
                # transformers' [E, hidden, 2·ffn] → the checkpoint's [E, 2·ffn, hidden].
                blocks, scales = hf_mxfp4(v.transpose(0, 2, 1))
                for name, rows in (("ffn_gate_exps", slice(0, None, 2)),
                                   ("ffn_up_exps", slice(1, None, 2))):
                    q = ggml_mxfp4(blocks[:, rows], scales[:, rows])
                    w = v.transpose(0, 2, 1)[:, rows]
                    # Same bytes as gguf-py's own MXFP4 quantizer (ggml's layout).
                    assert np.array_equal(q, gguf.quants.quantize(w, mx)), name
                    raw[f"{blk}{name}.weight"] = (q, mx)
            elif tail == "mlp.experts.down_proj":
                w = v.transpose(0, 2, 1)  # [E, ffn, hidden] → [E, hidden, ffn]
                q = ggml_mxfp4(*hf_mxfp4(w))
                assert np.array_equal(q, gguf.quants.quantize(w, mx))
                raw[f"{blk}ffn_down_exps.weight"] = (q, mx)
            elif tail == "mlp.experts.gate_up_proj_bias":
                tensors[f"{blk}ffn_gate_exps.bias"] = v[:, 0::2]
                tensors[f"{blk}ffn_up_exps.bias"] = v[:, 1::2]
            elif tail == "mlp.experts.down_proj_bias":
                tensors[f"{blk}ffn_down_exps.bias"] = v
            else:
                tensors[blk + GPT_OSS_NAMES[tail]] = v
    rope = cfg["rope_parameters"]
    meta = {
        "general.file_type": ("u32", int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)),
        "general.quantization_version": ("u32", gguf.GGML_QUANT_VERSION),
        "block_count": ("u32", cfg["num_hidden_layers"]),
        "context_length": ("u32", cfg["max_position_embeddings"]),
        "embedding_length": ("u32", cfg["hidden_size"]),
        "feed_forward_length": ("u32", cfg["intermediate_size"]),
        "attention.head_count": ("u32", cfg["num_attention_heads"]),
        "attention.head_count_kv": ("u32", cfg["num_key_value_heads"]),
        "rope.scaling.type": ("str", "yarn"),
        "rope.scaling.factor": ("f32", rope["factor"]),
        "rope.scaling.original_context_length": ("u32", rope["original_max_position_embeddings"]),
        "rope.scaling.yarn_beta_fast": ("f32", rope["beta_fast"]),
        "rope.scaling.yarn_beta_slow": ("f32", rope["beta_slow"]),
        "rope.freq_base": ("f32", rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": ("f32", cfg["rms_norm_eps"]),
        "expert_count": ("u32", cfg["num_local_experts"]),
        "expert_used_count": ("u32", cfg["num_experts_per_tok"]),
        "attention.key_length": ("u32", cfg["head_dim"]),
        "attention.value_length": ("u32", cfg["head_dim"]),
        "attention.sliding_window": ("u32", cfg["sliding_window"]),
        "expert_feed_forward_length": ("u32", cfg["intermediate_size"]),
    }
    # The converter's rule: 1-D tensors, norms, the router and every non-`.weight` tensor
    # (the biases, the experts' 2-D ones included) in F32.
    keep_f32 = lambda name, v: (v.ndim == 1 or name.endswith("_norm.weight")
                                or ".ffn_gate_inp." in name or not name.endswith(".weight"))
    write_gguf(os.path.join(out, "model.gguf"), "gpt-oss", meta, tensors, cfg["vocab_size"],
               keep_f32, raw)


FAMILIES = {"granite": granite, "gemma3": gemma3, "lfm2": lfm2, "gpt_oss": gpt_oss}
# Families whose model.gguf can be rewritten from the committed hf/ alone (numpy + gguf).
GGUF_ONLY = {"gpt_oss": gpt_oss_gguf}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(FAMILIES))
    ap.add_argument("--gguf-only", action="store_true",
                    help="rewrite model.gguf from the committed hf/ (no torch, no transformers; "
                         "hf/ and reference.json stay as they are)")
    args = ap.parse_args()
    for name in args.only.split(","):
        out = os.path.join(OUT, name)
        if args.gguf_only:
            if name not in GGUF_ONLY:
                sys.exit(f"--gguf-only: {name} has no GGUF-only writer ({', '.join(GGUF_ONLY)})")
            GGUF_ONLY[name](out)
            print(name, "model.gguf rewritten from hf/", file=sys.stderr)
            continue
        if torch is None:
            sys.exit("torch and transformers are needed to generate models (or use --gguf-only)")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        ref = FAMILIES[name](out)
        ref["generator"] = {
            "torch": torch.__version__.split("+")[0],
            "transformers": __import__("transformers").__version__,
        }
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(ref, f, separators=(",", ":"))
            f.write("\n")
        print(name, "greedy min margin", round(ref["greedy_min_margin"], 4), file=sys.stderr)


if __name__ == "__main__":
    main()
