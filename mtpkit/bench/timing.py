"""Wall-clock timing shared by the benchmarks: the median of repeated calls, the device synchronised around each."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 1, before=None) -> float:
    """Median wall time of fn() over `repeats` calls, the device synchronised around each, each after an untimed
    `before()` if given."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
