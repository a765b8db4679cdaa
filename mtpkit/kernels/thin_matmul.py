"""Thin fp32 products on x86 CPUs with AVX2 and FMA: a small C++ kernel (csrc/thin_product.h, the op in
csrc/thin_matmul.cpp), built on first use together with the fused decoder layer that reuses it (decode_layer.py).

Why hand-written: a decode or verify step multiplies each weight by 1 to 16 rows, so it should stream the weights at
the memory's read bandwidth. Measured on a 2-core AVX2-only AMD EPYC (torch 2.13, read bandwidth 16 GB/s), every
library path we could reach streamed far below it: `F.linear` (MKL) 6-7 GB/s with one row and 2.5-4 GB/s with
4-8, oneDNN through torch 5-11, numpy's OpenBLAS 4-15, MKL's packed GEMM no better than `F.linear`; only fbgemm's
fp16-weight product came near (it rounds the weights, so not the fp32 model). This kernel reads each weight row
once against all rows of x held in L1 and reached 8-17 GB/s there at every row count. How many weight rows share
each load of x (`block`) is the caller's choice: the router times each where it runs.

On CPUs with AVX-512F it has wide blocks too: two weight rows per 512-bit register, the same sums in the same order
(the same bits) from half the multiply instructions, which pays where 2-6 rows make a product partly bound by its
arithmetic (csrc/thin_product.h).

It is one more candidate of the decode router (decode/matmul_routing.py), which uses it only for the shapes where
it measures fastest on the machine that runs; F.linear stays the reference (tests/kernels/test_thin_matmul.py).
It is built with torch's C++ extension loader (ninja, the C++ compiler) into torch's extension cache the first time
a process asks for it (~20 s), and skipped with one warning if it cannot be built. Its name there carries a hash of
the sources and flags, so checkouts with other sources keep their own builds (one shared name was rebuilt at every
switch), and a build lock left by a builder that was killed is removed (torch's loader waits on it for ever).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import warnings

import torch

CSRC = pathlib.Path(__file__).parent / "csrc"
# one extension, op namespace mtpkit_cpu: the thin product and the fused decoder layer built on it (decode_layer.py)
SOURCES = ("thin_matmul.cpp", "decode_layer.cpp")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
MAX_ROWS = 16  # csrc/thin_product.h kMaxRows: more than 8 rows run as groups of at most 8
WIDE = 16  # csrc/thin_product.h kWide: block WIDE + R runs R weight rows per pass as pairs in 512-bit registers
# weight rows per pass that share each load of x (the fastest depends on the rows and the CPU), by candidate name
BLOCKS = {"1": 1, "2": 2, "4": 4, "2z": WIDE + 2, "4z": WIDE + 4}


def supported() -> bool:
    """An x86-64 CPU on which torch itself dispatches AVX2 (or AVX-512) kernels."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pip package's copy is not there when the venv is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def extension_name(csrc: pathlib.Path = CSRC) -> str:
    """The extension's name in torch's cache: a hash of every file under csrc (headers too) and the flags."""
    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for p in sorted(csrc.iterdir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return f"mtpkit_cpu_kernels_{h.hexdigest()[:16]}"


def build(name: str, build_dir: pathlib.Path, csrc: pathlib.Path = CSRC) -> None:
    """Build (or find built) and load the extension. mtpkit's builds of one name take turns on a flock, which the
    kernel drops when its holder dies; so a torch `lock` file found while holding it is a killed build's."""
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "mtpkit_build.flock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # waits while another process builds
        stale = build_dir / "lock"
        if stale.exists():
            stale.unlink(missing_ok=True)
            warnings.warn(f"mtpkit: removed {stale}, left by a kernel build that was killed (torch's loader would "
                          "wait on it for ever); building again")
        load(name, [str(csrc / s) for s in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
             build_directory=str(build_dir), is_python_module=False)


@functools.cache
def available() -> bool:
    """Build (once per machine, cached by torch) and load the kernel; False, with one warning, where it cannot."""
    if not supported():
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory  # torch's own cache layout (root, py, cuda)

        _put_ninja_on_path()
        name = extension_name()
        build(name, pathlib.Path(_get_build_directory(name, verbose=False)))
    except Exception as e:  # no compiler, no ninja, a failed build: decoding keeps torch's own products
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
        cause = next((ln for key in ("not found", "error:") for ln in lines if key in ln.lower()), lines[-1])
        warnings.warn(f"mtpkit: the thin fp32 matmul kernel could not be built ({type(e).__name__}: {cause}); "
                      "decoding uses torch's products. Install a C++ compiler and `pip install ninja` to get it.")
        return False
    return True


@functools.cache
def blocks() -> tuple[int, ...]:
    """The blocks (values of BLOCKS) the kernel runs on this CPU: the wide ones only with AVX-512F; () without it."""
    return tuple(torch.ops.mtpkit_cpu.thin_blocks()) if available() else ()


def thin_linear(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS fp32 rows) @ weight [N, K]^T -> [..., N] in fp32 on CPU, for an fp32 or bf16 weight
    (read as the fp32 values it holds), `block` (one of `blocks()`) weight rows per pass."""
    if not available():
        raise RuntimeError("the thin matmul kernel is not available on this machine (see the warning above)")
    return torch.ops.mtpkit_cpu.thin_linear(x.contiguous(), weight.contiguous(), block)
