"""A stand-alone MTP head: a safetensors file holding only `mtp.*` tensors, to attach to a model that has none
(SmolLM2, Qwen3-VL) or to swap a stale head for a refreshed one without rewriting the whole checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..models.mtp import MTP, add_mtp, is_mtp_param
from .hf import CheckpointError
from .safe_write import write_file

DRAFT_VOCAB = "draft_vocab"  # optional int64 [N] tensor beside mtp.*: the ids the head drafts from (FR-Spec)
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def save_mtp_head(model, path, dtype: torch.dtype | None = torch.bfloat16, *, overwrite: bool = False) -> Path:
    """Write the model's `mtp.*` tensors (cast to dtype; None keeps theirs) to one safetensors file, through a
    temporary sibling that is fsynced and renamed into place. An existing file is refused unless `overwrite`."""
    if model.mtp is None:
        raise ValueError("this model has no MTP head to save: add one with mtpkit.add_mtp(model) and train it")
    tensors = {
        f"mtp.{k}": v.detach().to("cpu", dtype=dtype if v.is_floating_point() and dtype else v.dtype).contiguous()
        for k, v in model.mtp.state_dict().items()
    }
    if model.mtp.draft_vocab is not None:
        tensors[DRAFT_VOCAB] = model.mtp.draft_vocab.to("cpu", torch.long).contiguous()
    meta = {"format": "pt", "mtp_num_hidden_layers": str(len(model.mtp.layers))}
    return write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), overwrite=overwrite)


def _expected(model, depth: int) -> dict[str, torch.Size]:
    """Names and shapes of a `depth`-layer head for this model, from one layer built on the meta device (every
    MTP layer has the same shapes), so a file naming a million layers costs nothing to check."""
    with torch.device("meta"):
        one = MTP(model.config.replace(mtp_num_hidden_layers=1)).state_dict()
    out = {}
    for name, t in one.items():
        m = _LAYER.match(f"mtp.{name}")
        if m is None:
            out[f"mtp.{name}"] = t.shape
        else:
            out.update({f"mtp.layers.{i}.{m[2]}": t.shape for i in range(depth)})
    return out


def load_mtp_head(model, path):
    """Load a head file written by `save_mtp_head` (or any `mtp.*`-only file in mtpkit's layout) into the model,
    in place, adding an MTP module of the file's depth first when the model has none or one of another depth.
    Names and shapes must match the model's exactly (checked from the file's header before anything is read or
    replaced: a file that does not fit leaves the model's head untouched); tensors are cast to the model's dtype."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"MTP head {path} does not exist")
    try:
        f = safe_open(str(path), framework="pt")
        shapes = {n: torch.Size(f.get_slice(n).get_shape()) for n in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
    vocab_shape = shapes.pop(DRAFT_VOCAB, None)
    other = [n for n in shapes if not is_mtp_param(n)]
    if other:
        raise CheckpointError(f"{path} is not an MTP head: it holds tensors outside mtp.* ({', '.join(sorted(other)[:4])})")
    layers = {int(m[1]) for n in shapes if (m := _LAYER.match(n))}
    if not layers:
        raise CheckpointError(f"{path} has no mtp.layers.* tensors: it is not an MTP head")
    depth = max(layers) + 1
    if layers != set(range(depth)):
        raise CheckpointError(f"{path} names MTP layers up to {depth - 1} but holds tensors of only {len(layers)}: "
                              "the file is corrupt")
    expected = _expected(model, depth)
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit this model's MTP module (missing: {', '.join(missing[:4]) or 'none'}; "
            f"unexpected: {', '.join(unexpected[:4]) or 'none'}): it was trained for another architecture"
        )
    wrong = [f"{n} {tuple(s)} (model: {tuple(expected[n])})" for n, s in shapes.items() if s != expected[n]]
    if wrong:
        raise CheckpointError(f"{path} was trained for another model size: {'; '.join(wrong[:3])}")
    ref = model.model.embed_tokens.weight
    try:
        state = {n[len("mtp."):]: f.get_tensor(n).to(device=ref.device, dtype=ref.dtype, copy=True) for n in shapes}
        vocab = None if vocab_shape is None else f.get_tensor(DRAFT_VOCAB)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({e}): the file is truncated or corrupt") from None
    V = model.config.vocab_size
    if vocab is not None and (vocab.dim() != 1 or vocab.numel() == 0 or vocab.is_floating_point()
                              or int(vocab.min()) < 0 or int(vocab.max()) >= V):
        raise CheckpointError(f"{path}: its {DRAFT_VOCAB} is not a list of token ids in [0, {V}): the head was "
                              "trained for another vocabulary, or the file is corrupt")
    if model.mtp is None or len(model.mtp.layers) != depth:
        add_mtp(model, depth)
    model.mtp.load_state_dict(state, strict=True)
    model.mtp.draft_vocab = None if vocab is None else vocab.long()  # generate/bench draft over it by default
    return model
