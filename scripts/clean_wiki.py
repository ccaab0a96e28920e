#!/usr/bin/env python3
"""Turn a MediaWiki XML dump (.xml or .xml.bz2) into plain English prose.

Usage:
    python3 scripts/clean_wiki.py INPUT.xml.bz2 OUTPUT.txt

Python standard library only, and fully deterministic: the same input gives
byte-identical output (scripts/fetch-assets.sh checks the sha256 of the result).

Output format (UTF-8, "\\n" line endings):
  * one block per article: the title on its own line, then the article's
    paragraphs; section headings become plain one-line paragraphs;
  * paragraphs (and articles) are separated by exactly one blank line;
  * the file ends with a single newline.

What is removed: redirects and non-article namespaces, templates {{...}}
(nested), tables {|...|}, <ref> citations, HTML comments and tags (the content
of math/code/gallery-like tags is dropped too), file/image/category/interwiki
links, external link URLs, bold/italic quotes, lists/indented lines, and
paragraphs that are too short to be prose.  Trailing sections such as
"References", "External links" or "See also" are dropped entirely.
Link text is kept: [[target|label]] -> label, [[target]] -> target.
"""

import bz2
import html
import re
import sys
import xml.etree.ElementTree as ET

# Paragraphs with fewer words than this are dropped (captions, leftovers, ...).
MIN_PARAGRAPH_WORDS = 8

# Level-2 sections at which an article's prose ends.
STOP_SECTIONS = {
    "see also", "references", "external links", "further reading", "notes",
    "bibliography", "sources", "citations", "footnotes", "notes and references",
    "references and notes", "works cited", "primary sources", "secondary sources",
    "works", "publications", "discography", "filmography", "gallery",
    "selected works", "selected bibliography", "external link", "reference",
    "other reading", "literature", "links",
}

# Tags whose whole content is dropped.
DROP_CONTENT_TAGS = (
    "math", "chem", "ce", "code", "source", "syntaxhighlight", "pre", "gallery",
    "timeline", "score", "imagemap", "hiero", "graph", "mapframe", "templatedata",
    "poem", "blockquote", "nowiki", "references", "table",
)

# Link namespaces (lower-case) whose links are dropped with their text.
DROP_LINK_PREFIXES = {
    "file", "image", "category", "media", "wikipedia", "wp", "wikt",
    "wiktionary", "help", "template", "portal", "special", "user", "talk",
    "s", "q", "n", "b", "v", "commons", "wikisource", "wikiquote",
    "wikibooks", "wikinews", "wikiversity", "meta", "m", "mw", "species",
    "d", "wikidata", "draft", "module", "book",
}

RE_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
RE_REF_SELF = re.compile(r"<ref\b[^>]*/\s*>", re.I)
RE_REF = re.compile(r"<ref\b[^>]*>.*?(?:</ref\s*>|\Z)", re.I | re.S)
RE_DROP_TAGS = re.compile(
    r"<(%s)\b[^>]*?(?:/\s*>|>.*?(?:</\1\s*>|\Z))" % "|".join(DROP_CONTENT_TAGS),
    re.I | re.S,
)
RE_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*\b[^<>]*/?>")
RE_INNER_LINK = re.compile(r"\[\[((?:[^\[\]]|\[(?!\[)|\](?!\]))*)\]\]")
RE_EXT_LINK_LABEL = re.compile(r"\[(?:https?:|ftp:|mailto:|//)[^\s\]]*\s+([^\]]*)\]")
RE_EXT_LINK_BARE = re.compile(r"\[(?:https?:|ftp:|mailto:|//)[^\]]*\]")
RE_URL = re.compile(r"\b(?:https?|ftp)://\S+")
RE_MAGIC = re.compile(r"__[A-Z]+__")
RE_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
RE_QUOTES = re.compile(r"'{2,}")
RE_WS = re.compile(r"\s+")
RE_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?%)\]])")
RE_SPACE_AFTER_OPEN = re.compile(r"([(\[])\s+")
RE_EMPTY_PARENS = re.compile(r"\(\s*[,;:.\-–—]*\s*\)")
RE_PAREN_LEADING_PUNCT = re.compile(r"\(\s*[,;:]+\s*")
RE_PAREN_TRAILING_PUNCT = re.compile(r"\s*[,;:]+\s*\)")
RE_REPEATED_PUNCT = re.compile(r"([,;])(\s*[,;])+")
RE_LETTER = re.compile(r"[A-Za-z]")


def strip_nested(text, open_tok, close_tok):
    """Remove every (possibly nested) open_tok ... close_tok span.

    An unmatched opener drops the rest of the text; an unmatched closer is
    removed on its own.
    """
    out = []
    depth = 0
    i = 0
    n = len(text)
    lo, lc = len(open_tok), len(close_tok)
    while i < n:
        if text.startswith(open_tok, i):
            depth += 1
            i += lo
        elif text.startswith(close_tok, i):
            if depth > 0:
                depth -= 1
            i += lc
        else:
            if depth == 0:
                # Copy a run of plain characters in one go.
                j_open = text.find(open_tok, i)
                j_close = text.find(close_tok, i)
                cands = [j for j in (j_open, j_close) if j >= 0]
                j = min(cands) if cands else n
                out.append(text[i:j])
                i = j
            else:
                i += 1
    return "".join(out)


def strip_templates(text):
    # "{{{param}}}" only occurs inside templates; treat "{{" / "}}" pairs.
    return strip_nested(text, "{{", "}}")


def strip_tables(text):
    return strip_nested(text, "{|", "|}")


def _link_repl(m):
    inner = m.group(1)
    target, sep, label = inner.partition("|")
    t = target.strip()
    if ":" in t:
        prefix = t.split(":", 1)[0].strip().lower()
        if prefix == "":
            # [[:Category:Foo]] style: a visible link to the page itself.
            t = t[1:]
        elif prefix in DROP_LINK_PREFIXES or re.fullmatch(r"[a-z]{2,3}(?:-[a-z]+)?", prefix):
            # namespace or interlanguage link
            return ""
    if sep:
        # [[a|b|c]] (rare, image-like): the last part is the label.
        label = label.rsplit("|", 1)[-1].strip()
        if label:
            return label
        # pipe trick: [[Foo (bar)|]] -> Foo
        return re.sub(r"\s*\(.*?\)\s*$", "", t.split(":")[-1]).strip()
    t = t.split("#", 1)[0] if not t.startswith("#") else t[1:]
    return t


def resolve_links(text):
    # Innermost first, so captions of [[File:...|...[[x]]...]] resolve before
    # the file link itself is dropped.
    for _ in range(10):
        new = RE_INNER_LINK.sub(_link_repl, text)
        if new == text:
            break
        text = new
    # Anything left unbalanced.
    return text.replace("[[", "").replace("]]", "")


def tidy_inline(s):
    s = RE_QUOTES.sub("", s)
    s = html.unescape(s)
    s = s.replace("\u00a0", " ").replace("\u200b", "").replace("\ufeff", "")
    s = RE_WS.sub(" ", s).strip()
    s = RE_REPEATED_PUNCT.sub(r"\1", s)
    s = RE_EMPTY_PARENS.sub("", s)
    s = RE_PAREN_LEADING_PUNCT.sub("(", s)
    s = RE_PAREN_TRAILING_PUNCT.sub(")", s)
    s = RE_EMPTY_PARENS.sub("", s)
    s = RE_SPACE_AFTER_OPEN.sub(r"\1", s)
    s = RE_SPACE_BEFORE_PUNCT.sub(r"\1", s)
    s = RE_WS.sub(" ", s).strip()
    return s


def is_prose(par):
    words = par.split(" ")
    if len(words) < MIN_PARAGRAPH_WORDS:
        return False
    letters = len(RE_LETTER.findall(par))
    return letters >= 0.5 * len(par)


def clean_article(text):
    """Return a list of paragraphs (headings are one-line paragraphs)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = RE_COMMENT.sub("", text)
    text = RE_REF_SELF.sub("", text)
    text = RE_REF.sub("", text)
    text = RE_DROP_TAGS.sub("", text)
    text = strip_templates(text)
    text = strip_tables(text)
    text = resolve_links(text)
    text = RE_EXT_LINK_LABEL.sub(r"\1", text)
    text = RE_EXT_LINK_BARE.sub("", text)
    text = RE_URL.sub("", text)
    text = RE_TAG.sub("", text)
    text = RE_MAGIC.sub("", text)

    items = []  # ("h", text) or ("p", text)
    cur = []

    def flush():
        if cur:
            items.append(("p", " ".join(cur)))
            cur.clear()

    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            flush()
            continue
        m = RE_HEADING.match(line)
        if m:
            flush()
            level = len(m.group(1))
            title = tidy_inline(m.group(2))
            if level <= 2 and title.lower().rstrip(":") in STOP_SECTIONS:
                break
            items.append(("h", title))
            continue
        if line[0] in "*#:;|!{}=" or line.startswith("----"):
            # lists, definition/indent lines, table residue, rules
            flush()
            continue
        cur.append(line)
    flush()

    out = []
    pending_heading = None
    for kind, s in items:
        if kind == "h":
            pending_heading = s if s else None
            continue
        s = tidy_inline(s)
        if not is_prose(s):
            continue
        if pending_heading:
            out.append(pending_heading)
            pending_heading = None
        out.append(s)
    return out


def iter_pages(fileobj):
    """Yield (title, ns, is_redirect, text) for every <page>."""
    ctx = ET.iterparse(fileobj, events=("end",))
    for _event, elem in ctx:
        tag = elem.tag.rsplit("}", 1)[-1]
        if tag != "page":
            continue
        title = ns = text = None
        redirect = False
        for child in elem.iter():
            ctag = child.tag.rsplit("}", 1)[-1]
            if ctag == "title":
                title = child.text or ""
            elif ctag == "ns":
                ns = (child.text or "").strip()
            elif ctag == "redirect":
                redirect = True
            elif ctag == "text":
                text = child.text or ""
        yield title, ns, redirect, text
        elem.clear()


def clean_dump(fileobj, out):
    n_articles = 0
    n_pars = 0
    first = True
    for title, ns, redirect, text in iter_pages(fileobj):
        if ns != "0" or redirect or text is None:
            continue
        if text.lstrip()[:9].upper() == "#REDIRECT":
            continue
        pars = clean_article(text)
        if not pars:
            continue
        if not first:
            out.write("\n")
        first = False
        out.write(tidy_inline(title) + "\n\n")
        out.write("\n\n".join(pars) + "\n")
        n_articles += 1
        n_pars += len(pars)
    return n_articles, n_pars


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    src, dst = argv[1], argv[2]
    opener = bz2.open if src.endswith(".bz2") else open
    tmp = dst + ".tmp"
    with opener(src, "rb") as f, open(tmp, "w", encoding="utf-8", newline="\n") as out:
        n_articles, n_pars = clean_dump(f, out)
    import os

    os.replace(tmp, dst)
    sys.stderr.write("clean_wiki: %d articles, %d paragraphs -> %s\n" % (n_articles, n_pars, dst))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
