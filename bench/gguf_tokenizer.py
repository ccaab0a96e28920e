#!/usr/bin/env python3
"""Writes a Hugging Face `tokenizer.json` for a GGUF model with a GPT-2 style byte-level BPE
vocabulary (the demo model's), so that load tools that count tokens with a Hugging Face
tokenizer run offline against it.

    gguf_tokenizer.py MODEL.gguf OUT_DIR
"""

import json
import os
import sys

import gguf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def strings(reader, name):
    f = reader.fields[name]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def main():
    model, out = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(model)
    kind = bytes(r.fields["tokenizer.ggml.model"].parts[-1]).decode()
    if kind != "gpt2":
        sys.exit(f"gguf_tokenizer: only byte-level BPE ('gpt2') vocabularies, this one is {kind!r}")
    tokens = strings(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)


if __name__ == "__main__":
    main()
