#!/usr/bin/env python3
"""Build the non-Wikipedia texts of the evaluation set from files PyPI packages ship.

Usage:
    python3 scripts/clean_eval_text.py code     GENSIM.whl      OUTPUT.txt
    python3 scripts/clean_eval_text.py dialogue CHATTERBOT.whl  OUTPUT.txt

Python standard library only, and fully deterministic: the same wheel gives
byte-identical output (scripts/fetch-assets.sh checks the sha256 of the result).

code: the library's Python sources (gensim/**/*.py, tests and the bundled test
data left out), in sorted path order, each preceded by a `# file: PATH` line.
Line endings become "\\n", trailing whitespace and tabs are normalised, runs of
more than two blank lines collapse to two.  Code is kept as written: comments
and docstrings are part of what a model reads in source files.

dialogue: the English conversations of chatterbot-corpus
(chatterbot_corpus/data/english/*.yml, sorted; coding.yml, which is mostly
source code, left out), turns alternating between
`A:` and `B:`, one blank line between conversations.  The files use a small
YAML subset (a `conversations:` list of lists of strings, plain, quoted,
folded continuation lines or `|` blocks), which is parsed here without a YAML
library.  Repeated conversations (the corpus has many) are kept once, at their
first occurrence, so the text is not dominated by copies the model can predict
from its own context.
"""

import re
import sys
import zipfile


def normalise_lines(text):
    lines = [l.replace("\t", "    ").rstrip() for l in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    out, blank = [], 0
    for l in lines:
        blank = blank + 1 if not l else 0
        if blank <= 2:
            out.append(l)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def code_text(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = sorted(
            n for n in z.namelist()
            if n.startswith("gensim/") and n.endswith(".py") and "/test/" not in n
        )
        parts = []
        for n in names:
            src = z.read(n).decode("utf-8")
            body = normalise_lines(src)
            if body.strip():
                parts.append("# file: %s\n%s\n" % (n, body))
    return "\n\n".join(parts)


def unquote(s):
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] == "'":
        return s[1:-1].replace("''", "'")
    if len(s) >= 2 and s[0] == s[-1] == '"':
        return s[1:-1].replace('\\"', '"').replace("\\n", "\n")
    return s


def parse_conversations(yml):
    """The `conversations:` list of a chatterbot-corpus file, as lists of turns."""
    lines = yml.replace("\r\n", "\n").split("\n")
    convs, conv = [], None
    turn = None  # (kind, indent, [lines]) of the turn being read
    in_convs = False

    def close_turn():
        nonlocal turn
        if turn is None:
            return
        kind, _, body = turn
        if kind == "block":
            text = "\n".join(body).strip("\n")
        else:
            text = unquote(" ".join(x.strip() for x in body))
        if text.strip() and conv is not None:
            conv.append(text.strip())
        turn = None

    for line in lines:
        if not in_convs:
            in_convs = line.strip() == "conversations:"
            continue
        if re.match(r"^[A-Za-z_][\w ]*:", line):  # a new top-level key ends the list
            close_turn()
            in_convs = line.strip() == "conversations:"
            continue
        # `- - turn` opens a conversation; so does a stray `- turn` at the top level
        # (trivia.yml has one), read as a conversation of one turn so far.
        m_conv = re.match(r"^- -(?: (.*))?$", line) or re.match(r"^-(?: (.*))?$", line)
        m_turn = re.match(r"^(\s+)- ?(.*)$", line)
        if turn is not None and turn[0] == "block":
            indent = len(line) - len(line.lstrip())
            if not line.strip() or indent > turn[1]:
                turn[2].append(line[turn[1] + 2:] if line.strip() else "")
                continue
        elif turn is not None and line.strip() and not m_conv and not m_turn:
            turn[2].append(line)  # a plain scalar folded over several lines
            continue
        if m_conv:
            close_turn()
            conv = []
            convs.append(conv)
            first = m_conv.group(1)
            if first is not None:
                turn = ("block", 2, []) if first.strip() in ("|", "|-") else ("plain", 2, [first])
        elif m_turn:
            close_turn()
            if conv is None:
                conv = []
                convs.append(conv)
            indent, first = len(m_turn.group(1)), m_turn.group(2)
            turn = ("block", indent, []) if first.strip() in ("|", "|-") else ("plain", indent, [first])
    close_turn()
    return [c for c in convs if c]


# Conversations that are mostly source code belong to the code domain, not this one.
CODE_FILES = {"chatterbot_corpus/data/english/coding.yml"}


def dialogue_text(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = sorted(
            n for n in z.namelist()
            if n.startswith("chatterbot_corpus/data/english/") and n.endswith(".yml")
            and n not in CODE_FILES
        )
        seen, blocks = set(), []
        for n in names:
            for conv in parse_conversations(z.read(n).decode("utf-8")):
                key = tuple(conv)
                if key in seen:
                    continue
                seen.add(key)
                turns = ["%s: %s" % ("AB"[i % 2], normalise_lines(t)) for i, t in enumerate(conv)]
                blocks.append("\n".join(turns))
    return "\n\n".join(blocks)


def main(argv):
    if len(argv) != 4 or argv[1] not in ("code", "dialogue"):
        sys.exit(__doc__)
    text = (code_text if argv[1] == "code" else dialogue_text)(argv[2])
    with open(argv[3] + ".tmp", "w", encoding="utf-8", newline="\n") as f:
        f.write(text.rstrip("\n") + "\n")
    import os
    os.replace(argv[3] + ".tmp", argv[3])
    print("clean_eval_text: %s: %d characters -> %s" % (argv[1], len(text), argv[3]), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
