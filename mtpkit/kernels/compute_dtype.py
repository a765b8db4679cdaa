"""The compute dtype for compute-bound work (distillation, feature caching, head training), measured where it runs.

bf16 is not faster everywhere: on CPUs with AMX (Sapphire Rapids) a bf16 matmul runs ~3.7x faster than fp32, while
on CPUs without native bf16 (AVX2-only EPYC) torch falls back to a path tens of times slower than fp32. So "auto"
times one product of the model's own shape in both dtypes and takes the faster; a CUDA device with bf16 support
takes bf16 without measuring (tensor cores).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

CANDIDATES = (torch.float32, torch.bfloat16)


@functools.cache
def _seconds(device_type: str, threads: int, dtype: torch.dtype, rows: int, inner: int, outer: int) -> float:
    """Fastest of 3 timed products x [rows, inner] @ w[outer, inner]^T after one warm-up."""
    device = torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inner, generator=gen).to(device, dtype)
    w = torch.randn(outer, inner, generator=gen).to(device, dtype)
    F.linear(x, w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        F.linear(x, w)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(device, inner: int, outer: int, rows: int = 256) -> dict[torch.dtype, float]:
    """GFLOP/s of a [rows, inner] x [inner, outer] product per candidate dtype, on this device and thread count."""
    device = torch.device(device)
    return {dt: 2 * rows * inner * outer / _seconds(device.type, torch.get_num_threads(), dt, rows, inner, outer) / 1e9
            for dt in CANDIDATES}


def fastest_dtype(device, inner: int, outer: int) -> torch.dtype:
    """bf16 where it is supported and measured faster than fp32 for a product of this shape, else fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    speeds = matmul_gflops(device, inner, outer)
    return max(speeds, key=speeds.get)


def describe(device, inner: int, outer: int) -> str:
    """One line for logs: the measured speeds that chose the dtype."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{fastest_dtype(device, inner, outer)} (CUDA)"
    speeds = matmul_gflops(device, inner, outer)
    return ", ".join(f"{str(dt).removeprefix('torch.')} {s:.0f} GFLOP/s" for dt, s in speeds.items())


def resolve(choice: str, device, config) -> torch.dtype:
    """A --dtype / --compute choice ("auto", "float32", "bfloat16") as a torch dtype; "auto" is measured on a
    product of the model's MLP shape (hidden_size x intermediate_size)."""
    if choice == "auto":
        return fastest_dtype(device, config.hidden_size, config.intermediate_size)
    return getattr(torch, choice)
