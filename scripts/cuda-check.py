#!/usr/bin/env python3
"""Compile the embedded CUDA kernels here, without a GPU: NVRTC (as the backend does at run
time) and then ptxas for the target, printing compile errors and each kernel's registers,
spills and shared memory. The NVRTC and ptxas binaries come from NVIDIA's PyPI wheels
(`nvidia-cuda-nvrtc`, `nvidia-cuda-nvcc`), installed on first use into ~/.cache/turbokv/cuda.

    scripts/cuda-check.py [--arch sm_90] [--filter attn_dec] [--ptx-cache DIR]
                          [--entry KERNEL ... --cubin OUT.cubin] [FILE.cu ...]

`--ptx-cache DIR` also writes each module's PTX under the name the backend's PTX disk cache
looks for (crates/backend/src/cuda/kernels.rs), so a GPU machine can start without compiling:
copy DIR's files into its `$TMPDIR/turbokv-ptx` (the default `CudaOptions::ptx_cache`).
Without `--entry`, DIR also gets each module's cubin (ptxas output), which the backend loads
before the PTX: that skips the driver's JIT (minutes for attention.cu on a fresh machine).
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "13.0.*"
ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "crates/backend/src/cuda/kernels"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "turbokv/cuda"
# Headers a module's source starts with after common.cuh, as kernels.rs assembles them.
PRELUDES = {"write_kv.cu": ["codec.cuh"], "parts.cu": ["codec.cuh"], "attention.cu": ["codec.cuh"]}
# Must match OPTIONS in crates/backend/src/cuda/kernels.rs.
OPTIONS = ["--std=c++17", "-default-device"]


def toolkit() -> Path:
    lib = CACHE / "nvidia/cu13"
    if not (lib / "bin/ptxas").exists():
        print(f"installing NVRTC and ptxas {VERSION} into {CACHE}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(CACHE),
             f"nvidia-cuda-nvrtc=={VERSION}", f"nvidia-cuda-nvcc=={VERSION}"],
            check=True)
        (lib / "bin/ptxas").chmod(0o755)
    return lib


def nvrtc_compile(nvrtc, name: str, src: str, arch: str) -> tuple[str | None, str]:
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"{what} failed: {rc}")
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None,
                                   None), "nvrtcCreateProgram")
    opts = OPTIONS + [f"--gpu-architecture={arch}"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    ptx = None
    if rc == 0:
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx, log.value.decode(errors="replace")


def fnv1a(parts: list[str]) -> int:
    """kernels.rs `fnv1a`: FNV-1a over each part's bytes followed by 0xff."""
    h = 0xCBF29CE484222325
    for p in parts:
        for b in p.encode() + b"\xff":
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--filter", default="", help="only report kernels whose name contains it")
    ap.add_argument("--ptx-cache", type=Path)
    ap.add_argument("--entry", action="append", default=[],
                    help="assemble only this kernel (repeatable; ptxas -e): a fast check")
    ap.add_argument("--cubin", type=Path, help="keep ptxas's output here (for cuobjdump -sass)")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    lib = toolkit()
    # NVRTC dlopens its builtins by soname; load them first so it finds them here.
    ctypes.CDLL(str(lib / "lib/libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(lib / "lib/libnvrtc.so.13"))
    common = (KERNELS / "common.cuh").read_text()
    files = [Path(f) for f in a.files] or sorted(KERNELS.glob("*.cu"))
    failed = False
    for f in files:
        src = common + "\n" + "".join((KERNELS / h).read_text() + "\n"
                                       for h in PRELUDES.get(f.name, [])) + f.read_text()
        ptx, log = nvrtc_compile(nvrtc, f.name, src, a.arch)
        if ptx is not None and a.ptx_cache:
            a.ptx_cache.mkdir(parents=True, exist_ok=True)
            key = fnv1a([src, a.arch, " ".join(OPTIONS)])
            (a.ptx_cache / f"{f.stem}-{a.arch}-{key:016x}.ptx").write_text(ptx)
        if log.strip():
            print(f"--- {f.name} (nvrtc)\n{log}")
        if ptx is None:
            failed = True
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as t:
            t.write(ptx)
            t.flush()
            entries = [x for e in a.entry for x in ("-e", e)]
            out = str(a.cubin) if a.cubin else os.devnull
            if a.ptx_cache and not a.entry and not a.cubin:
                out = str(a.ptx_cache / f"{f.stem}-{a.arch}-{key:016x}.cubin")
            r = subprocess.run([str(lib / "bin/ptxas"), f"-arch={a.arch}", "-v", *entries, t.name,
                                "-o", out], capture_output=True, text=True)
        if r.returncode != 0:
            failed = True
            print(f"--- {f.name} (ptxas)\n{r.stderr}")
            continue
        kernel = None
        for line in r.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                kernel = m.group(1)
            elif kernel and a.filter in kernel and ("Used" in line or "spill" in line):
                if "spill" in line and " 0 bytes spill stores, 0 bytes spill loads" in line:
                    continue
                print(f"{f.name}: {kernel}: {line.split(':', 1)[-1].strip()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
