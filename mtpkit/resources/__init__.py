"""Data shipped with mtpkit, and where it lies once installed: the benchmark prompts and the trained
SmolLM2-135M-Instruct MTP head (the head that goes with the embedded default model)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..assets import is_default_model

DEFAULT_PROMPTS = "bench_prompts.jsonl"
DEFAULT_HEAD = "smollm2_mtp_head.safetensors"


def resource(name: str) -> Path:
    return Path(str(resources.files(__name__).joinpath(name)))


def shipped_head(model_path) -> Path | None:
    """The SmolLM2 MTP head shipped with mtpkit when `model_path` is the embedded default model, else None."""
    return resource(DEFAULT_HEAD) if is_default_model(model_path) else None
