"""Parallelism applied from outside the single-device model code (torchtitan's way): torchrun init and device
mesh, then `apply_ac`, `apply_compile` and `apply_fsdp` per block, in that order."""

from .apply import apply_ac, apply_compile, apply_fsdp, parallelize
from .distributed import Dist, all_reduce_sum, init_distributed

__all__ = ["Dist", "all_reduce_sum", "apply_ac", "apply_compile", "apply_fsdp", "init_distributed", "parallelize"]
