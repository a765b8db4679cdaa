"""What every section of the GPU check shares: the time budget, guarded steps, error measures, the device's peaks,
and the record of the run (timing: bench/timing.py)."""

from __future__ import annotations

import gc
import importlib.metadata
import time
import traceback

import torch

# memory bandwidth in bytes/s by device name fragment (vendor datasheets); first match wins
PEAK_BANDWIDTH = {
    "GH200": 4.0e12, "H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "H800": 3.35e12, "B200": 8.0e12,
    "A100-SXM4-80GB": 2.04e12, "A100": 1.56e12, "L40S": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12,
}


class Budget:
    """A wall-clock budget for the whole check; each section may run until its share of it has passed."""

    def __init__(self, seconds: float):
        self.start, self.total = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self, until: float = 1.0) -> float:
        """Seconds left before `until` (a fraction of the total) of the budget has passed."""
        return self.total * until - self.elapsed()


def guarded(records: list, name: str, fn, **fields) -> dict:
    """Run fn() -> dict, append {name, **fields, **result} to records; an exception (an OOM, a missing kernel)
    becomes the record's `error` and the check goes on."""
    rec = {"name": name, **fields}
    t0 = time.perf_counter()
    try:
        rec.update(fn())
    except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the check
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        rec["traceback"] = traceback.format_exc()[-3000:]
    if "error" in rec:  # out of the except block, so the failed frames' tensors can be freed
        free_memory()
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    records.append(rec)
    return rec


def skipped(records: list, name: str, why: str, **fields) -> None:
    records.append({"name": name, **fields, "skipped": why})


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_max(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: the largest error on the scale of the values."""
    ref = ref.detach().double()
    return float((got.detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (flash-linear-attention's own tests use this ratio for its kernels)."""
    ref = ref.detach().double()
    return float((got.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


def peak_bandwidth(device: torch.device, override_tbs: float = 0.0) -> float | None:
    """Peak memory bandwidth in bytes/s: the override, a known GPU's datasheet figure, or None."""
    if override_tbs:
        return override_tbs * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)


def quiet_transformers() -> None:
    """No per-model loading progress bars or warnings from transformers in the report."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    env = {
        "device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
        **{d: _version(d) for d in ("transformers", "triton", "flash-linear-attention", "causal-conv1d")},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                   memory_gb=round(props.total_memory / 1e9, 1))
    return env
