#!/usr/bin/env python3
"""Which execution pipe bounds a kernel's hot loop, read from its SASS here, without a GPU.

    scripts/cuda-check.py --entry attn_codes_k8v_128_4_2 --cubin /tmp/k.cubin
    scripts/sass-pipes.py /tmp/k.cubin [KERNEL ...] [--all-loops] [--skip 0xLO-0xHI ...]

For each kernel of the cubin (or those named), disassembles it (cuobjdump and nvdisasm from
NVIDIA's PyPI wheels, installed on first use into ~/.cache/turbokv/sass) and reports its
innermost loop that holds a tensor-core MMA (every loop with `--all-loops`): the static
count of its instructions, by pipe, and what each pipe costs an SM sub-partition per
iteration. An SMSP issues one warp instruction a cycle; the ALU pipe (logic, shifts, prmt,
integer adds and compares, float min/max and compares) and the integer half of the FMA pipe
(IMAD, IMUL) take one every two cycles, the XU (MUFU, conversions) one every eight (sm_80 /
sm_90). A loop whose ALU cycles exceed its issue cycles cannot issue faster than that pipe
allows. That is a bound, not a measurement: a kernel that waits on latency (few warps
eligible) runs below it whatever the pipes' counts, as the int8-product decode kernels do
(ncu: ALU pipe at 43% of its peak, BENCHMARKS.md session 48), and moving their shifts to
IMAD gained nothing there. Ask ncu which limit holds before acting on these counts. Counts are
static: a branch inside the loop that rarely runs (a fallback, a rescale) is counted as if
it always did: read the listing (`--sass FILE`) and leave such a block out with `--skip`
(the int8-value kernels' f16 fallback: from the branch after `VOTE.ALL` to its target).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

# The first release of these wheels on PyPI; they disassemble sm_90 cubins from ptxas 13.0.
VERSION = "13.2.51"
# Beside cuda-check.py's NVRTC and ptxas, not in their folder: pip will not add to a target
# that already holds another wheel's `nvidia` package.
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "turbokv/sass"

PIPES = {
    "alu": {"LOP3", "LOP", "PRMT", "SHF", "SHL", "SHR", "ISETP", "FMNMX", "FSETP", "FSEL", "SEL",
            "IADD3", "LEA", "MOV", "IMNMX", "VIMNMX", "VIMNMX3", "PLOP3", "VOTE", "BMSK", "SGXT",
            "IABS", "F2FP", "P2R", "R2P", "FCHK"},
    "fma-int": {"IMAD", "IMUL", "IDP"},
    "fma": {"FFMA", "FMUL", "FADD", "HADD2", "HFMA2", "HMUL2", "VIADD", "FFMA2", "FMUL2",
            "FADD2"},
    "xu": {"MUFU", "I2F", "F2I", "I2FP", "F2IP", "F2F", "FRND"},
    "mio": {"LDS", "STS", "LDSM", "STSM", "SHFL", "MOVM", "LDG", "STG", "LD", "ST", "LDGSTS",
            "ATOMS", "ATOMG", "RED", "LDC", "ULDC"},
    "tensor": {"IMMA", "HMMA", "HGMMA", "IGMMA", "QGMMA"},
}
# Cycles of an SMSP per warp instruction.
COST = {"alu": 2, "fma-int": 2, "xu": 8}


def tools() -> tuple[Path, Path]:
    root = CACHE / "nvidia/cu13/bin"
    cuobjdump, nvdisasm = root / "cuobjdump", root / "nvdisasm"
    if not (cuobjdump.exists() and nvdisasm.exists()):
        print(f"installing cuobjdump and nvdisasm {VERSION} into {CACHE}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(CACHE), f"nvidia-cuda-cuobjdump=={VERSION}",
                        f"nvidia-cuda-nvdisasm=={VERSION}"], check=True)
        for t in (cuobjdump, nvdisasm):
            t.chmod(0o755)
    return cuobjdump, nvdisasm


def disassemble(cubin: Path) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions as (address, text without predicate guard)."""
    cuobjdump, nvdisasm = tools()
    env = dict(os.environ, PATH=f"{nvdisasm.parent}:{os.environ.get('PATH', '')}")
    out = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                         env=env, check=True).stdout
    funcs: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return funcs


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) address of every loop: a branch back to an earlier address."""
    out = []
    for addr, text in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            out.append((int(m.group(1), 16), addr))
    return out


def report(name: str, code: list[tuple[int, str]], lo: int, hi: int,
           skip: list[tuple[int, int]]) -> None:
    body = [opcode(t) for a, t in code
            if lo <= a <= hi and not any(s <= a < e for s, e in skip)]
    ops = collections.Counter(o.split(".")[0] for o in body)
    pipes = collections.Counter()
    for o, n in ops.items():
        pipes[next((p for p, s in PIPES.items() if o in s), "other")] += n
    cycles = {"issue": len(body), **{p: COST[p] * pipes[p] for p in COST}}
    bound = max(cycles, key=cycles.get)
    left_out = f" (less {', '.join(f'{s:#x}-{e:#x}' for s, e in skip)})" if skip else ""
    print(f"{name}: loop {lo:#x}-{hi:#x}{left_out}, {len(body)} instructions")
    print("  pipes:  " + "  ".join(f"{p} {n}" for p, n in pipes.most_common()))
    # The largest count bounds the loop's issue rate; it is not a measured limit (see above).
    print("  cycles: " + "  ".join(f"{p} {c}" for p, c in cycles.items())
          + f"  -> at least {cycles[bound]} cycles an iteration ({bound})")
    print("  top:    " + "  ".join(f"{o} {n}" for o, n in ops.most_common(14)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cubin", type=Path)
    ap.add_argument("kernels", nargs="*", help="only these functions (default: every one)")
    ap.add_argument("--all-loops", action="store_true", help="every loop, not only the MMA loop")
    ap.add_argument("--sass", type=Path, help="also write the disassembly here")
    ap.add_argument("--skip", action="append", default=[], metavar="0xLO-0xHI",
                    help="leave out instructions at addresses LO <= a < HI (repeatable)")
    a = ap.parse_args()
    try:
        skip = [tuple(int(x, 16) for x in r.split("-")) for r in a.skip]
    except ValueError:
        ap.error("--skip takes hex address ranges such as 0xaef0-0xd640")
    funcs = disassemble(a.cubin)
    if a.sass:
        a.sass.write_text("".join(f"{n}\n" + "".join(f"  /*{x:05x}*/ {t}\n" for x, t in c)
                                  for n, c in funcs.items()))
    missing = [k for k in a.kernels if k not in funcs]
    if missing:
        print(f"not in {a.cubin}: {', '.join(missing)}", file=sys.stderr)
        return 1
    for name in a.kernels or sorted(funcs):
        code = funcs[name]
        found = loops(code)
        if not a.all_loops:
            mma = [(lo, hi) for lo, hi in found
                   if any(lo <= x <= hi and opcode(t).split(".")[0] in PIPES["tensor"]
                          for x, t in code)]
            # The innermost: no other MMA loop lies inside it.
            found = [(lo, hi) for lo, hi in mma
                     if not any((l2, h2) != (lo, hi) and lo <= l2 and h2 <= hi for l2, h2 in mma)]
        if not found:
            print(f"{name}: no {'loop' if a.all_loops else 'loop with an MMA'}")
        for lo, hi in found:
            report(name, code, lo, hi, skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
