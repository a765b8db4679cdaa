"""Thin fp32 products on x86 CPUs with AVX2 and FMA: a small C++ kernel (csrc/thin_product.h, the op in
csrc/thin_matmul.cpp), built on first use together with the fused decoder layer that reuses it (decode_layer.py).

Why hand-written: a decode or verify step multiplies each weight by 1 to 16 rows, so it should stream the weights at
the memory's read bandwidth. Measured on a 2-core AVX2-only AMD EPYC (torch 2.13, read bandwidth 16 GB/s), every
library path we could reach streamed far below it: `F.linear` (MKL) 6-7 GB/s with one row and 2.5-4 GB/s with
4-8, oneDNN through torch 5-11, numpy's OpenBLAS 4-15, MKL's packed GEMM no better than `F.linear`; only fbgemm's
fp16-weight product came near (it rounds the weights, so not the fp32 model). This kernel reads each weight row
once against all rows of x held in L1 and reached 8-17 GB/s there at every row count. How many weight rows share
each load of x (`block`) is the caller's choice: the router times each where it runs.

It is one more candidate of the decode router (decode/matmul_routing.py), which uses it only for the shapes where
it measures fastest on the machine that runs; F.linear stays the reference (tests/kernels/test_thin_matmul.py).
It is built with torch's C++ extension loader (ninja, the C++ compiler) into torch's extension cache the first time
a process asks for it (~20 s), and skipped with one warning if it cannot be built.
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform
import shutil
import warnings

import torch

# one extension, op namespace mtpkit_cpu: the thin product and the fused decoder layer built on it (decode_layer.py)
SOURCES = [pathlib.Path(__file__).parent / "csrc" / name for name in ("thin_matmul.cpp", "decode_layer.cpp")]
MAX_ROWS = 16  # csrc/thin_product.h kMaxRows: more than 8 rows run as groups of at most 8
BLOCKS = (1, 2, 4)  # weight rows per pass that share each load of x; the fastest depends on the rows and the CPU


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


@functools.cache
def available() -> bool:
    """Build (once per machine, cached by torch) and load the kernel; False, with one warning, where it cannot."""
    if not supported():
        return False
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        load("mtpkit_cpu_kernels", [str(p) for p in SOURCES], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as e:  # no compiler, no ninja, a failed build: decoding keeps torch's own products
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
        cause = next((ln for key in ("not found", "error:") for ln in lines if key in ln.lower()), lines[-1])
        warnings.warn(f"mtpkit: the thin fp32 matmul kernel could not be built ({type(e).__name__}: {cause}); "
                      "decoding uses torch's products. Install a C++ compiler and `pip install ninja` to get it.")
        return False
    return True


def thin_linear(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS fp32 rows) @ weight [N, K]^T -> [..., N] in fp32 on CPU, for an fp32 or bf16 weight
    (read as the fp32 values it holds), `block` (one of BLOCKS) weight rows per pass."""
    if not available():
        raise RuntimeError("the thin matmul kernel is not available on this machine (see the warning above)")
    return torch.ops.mtpkit_cpu.thin_linear(x.contiguous(), weight.contiguous(), block)
