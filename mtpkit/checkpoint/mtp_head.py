"""A stand-alone MTP head: a safetensors file holding only `mtp.*` tensors, to attach to a model that has none
(SmolLM2, Qwen3-VL) or to swap a stale head for a refreshed one without rewriting the whole checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..models.mtp import add_mtp
from .hf import CheckpointError

_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def save_mtp_head(model, path, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write the model's `mtp.*` tensors (cast to dtype; None keeps theirs) to one safetensors file."""
    if model.mtp is None:
        raise ValueError("this model has no MTP head to save: add one with mtpkit.add_mtp(model) and train it")
    tensors = {
        f"mtp.{k}": v.detach().to("cpu", dtype=dtype if v.is_floating_point() and dtype else v.dtype).contiguous()
        for k, v in model.mtp.state_dict().items()
    }
    path = Path(path)
    save_file(tensors, str(path), metadata={"format": "pt", "mtp_num_hidden_layers": str(len(model.mtp.layers))})
    return path


def load_mtp_head(model, path):
    """Load a head file written by `save_mtp_head` (or any `mtp.*`-only file in mtpkit's layout) into the model,
    in place, adding an MTP module of the file's depth first when the model has none or one of another depth.
    Names and shapes must match the model's exactly; tensors are cast to the model's dtype."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"MTP head {path} does not exist")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
    other = [n for n in tensors if not n.startswith("mtp.")]
    if other:
        raise CheckpointError(f"{path} is not an MTP head: it holds tensors outside mtp.* ({', '.join(sorted(other)[:4])})")
    layers = {int(m[1]) for n in tensors if (m := _LAYER.match(n))}
    if not layers:
        raise CheckpointError(f"{path} has no mtp.layers.* tensors: it is not an MTP head")
    depth = max(layers) + 1
    if model.mtp is None or len(model.mtp.layers) != depth:
        add_mtp(model, depth)
    expected = {f"mtp.{k}": v for k, v in model.mtp.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit this model's MTP module (missing: {', '.join(missing[:4]) or 'none'}; "
            f"unexpected: {', '.join(unexpected[:4]) or 'none'}): it was trained for another architecture"
        )
    wrong = [f"{n} {tuple(t.shape)} (model: {tuple(expected[n].shape)})" for n, t in tensors.items()
             if t.shape != expected[n].shape]
    if wrong:
        raise CheckpointError(f"{path} was trained for another model size: {'; '.join(wrong[:3])}")
    ref = expected[next(iter(expected))]
    state = {n[len("mtp."):]: t.to(device=ref.device, dtype=ref.dtype) for n, t in tensors.items()}
    model.mtp.load_state_dict(state, strict=True)
    return model
