"""The compute dtype is the one measured faster here, never assumed."""

from types import SimpleNamespace

import torch

from mtpkit.kernels import compute_dtype


def _with_speeds(monkeypatch, seconds: dict):
    monkeypatch.setattr(compute_dtype, "_seconds", lambda dev, threads, dt, *shape: seconds[dt])


def test_auto_takes_the_dtype_measured_faster(monkeypatch):
    config = SimpleNamespace(hidden_size=64, intermediate_size=128)
    _with_speeds(monkeypatch, {torch.float32: 1.0, torch.bfloat16: 0.25})  # an AMX-like CPU
    assert compute_dtype.resolve("auto", "cpu", config) == torch.bfloat16
    _with_speeds(monkeypatch, {torch.float32: 1.0, torch.bfloat16: 40.0})  # a CPU without native bf16
    assert compute_dtype.resolve("auto", "cpu", config) == torch.float32
    assert "bfloat16" in compute_dtype.describe("cpu", 64, 128)


def test_explicit_choices_are_kept_and_speeds_are_real():
    config = SimpleNamespace(hidden_size=64, intermediate_size=128)
    assert compute_dtype.resolve("float32", "cpu", config) == torch.float32
    assert compute_dtype.resolve("bfloat16", "cpu", config) == torch.bfloat16
    speeds = compute_dtype.matmul_gflops("cpu", 64, 128, rows=32)
    assert set(speeds) == {torch.float32, torch.bfloat16} and all(s > 0 for s in speeds.values())
    assert compute_dtype.fastest_dtype("cpu", 64, 128) in speeds
