"""A stand-alone MTP head: a safetensors file holding only `mtp.*` tensors (or only the parallel heads'
`mtp_heads.*`, models/parallel_heads.py), to attach to a model that has none (SmolLM2, Qwen3-VL) or to swap a
stale head for a refreshed one without rewriting the whole checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..models.mtp import MTP, add_mtp, is_mtp_param
from ..models.parallel_heads import ParallelHeads, add_parallel_heads
from .hf import CheckpointError, is_draft_vocab
from .safe_write import write_file

DRAFT_VOCAB = "draft_vocab"  # optional int64 [N] tensor beside the head's: the ids it drafts from (FR-Spec)
# the two kinds of head a file may hold: (tensor prefix, the metadata / config.json key counting its layers)
_SEQUENTIAL, _PARALLEL = ("mtp.", "mtp_num_hidden_layers"), ("mtp_heads.", "mtp_parallel_heads")
_WIDTH = "mtp_parallel_intermediate_size"  # parallel heads' MLP width, when not the trunk's


TRUNK = "trunk"  # metadata key: the JSON of trunk_identity(config) of the model the head was trained on


def trunk_identity(config) -> dict:
    """What a head's weights assume of its trunk beyond tensor shapes: its vocabulary (the token ids the head
    embeds and predicts), rotary base and width. A head grafted onto another trunk loads and drafts garbage."""
    return {"vocab size": config.vocab_size, "rope theta": config.rope_theta, "hidden size": config.hidden_size}


def trunk_difference(recorded: dict, config) -> tuple[str, object, object] | None:
    """The first entry of a head's recorded trunk that a model of `config` does not share: (what, the head's, the
    model's), or None."""
    have = trunk_identity(config)
    return next(((what, v, have[what]) for what, v in recorded.items() if what in have and v != have[what]), None)


def check_draft_vocab(path, vocab: torch.Tensor | None, vocab_size: int) -> None:
    """A one-line error unless a head file's `draft_vocab` (when it has one) lists distinct token ids in
    [0, vocab_size)."""
    if vocab is not None and not is_draft_vocab(vocab, vocab_size):
        raise CheckpointError(f"{path}: its {DRAFT_VOCAB} is not a list of distinct token ids in [0, {vocab_size}): "
                              "the head was trained for another vocabulary, or the file is corrupt")


def save_mtp_head(model, path, dtype: torch.dtype | None = torch.bfloat16, *, overwrite: bool = False) -> Path:
    """Write the model's head, `mtp.*` (sequential MTP) or `mtp_heads.*` (parallel heads), cast to dtype (None
    keeps theirs), to one safetensors file, through a temporary sibling that is fsynced and renamed into place.
    An existing file is refused unless `overwrite`."""
    head = model.drafter
    if head is None:
        raise ValueError("this model has no MTP head to save: add one with mtpkit.add_mtp(model) and train it")
    prefix, key = _SEQUENTIAL if head is model.mtp else _PARALLEL
    tensors = {
        f"{prefix}{k}": v.detach().to("cpu", dtype=dtype if v.is_floating_point() and dtype else v.dtype).contiguous()
        for k, v in head.state_dict().items()
    }
    if head.draft_vocab is not None:
        tensors[DRAFT_VOCAB] = head.draft_vocab.to("cpu", torch.long).contiguous()
    meta = {"format": "pt", key: str(len(head.layers)), TRUNK: json.dumps(trunk_identity(model.config))}
    if head is model.mtp_heads and model.config.mtp_parallel_intermediate_size:
        meta[_WIDTH] = str(model.config.mtp_parallel_intermediate_size)
    return write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), overwrite=overwrite)


def _expected(config, prefix: str, depth: int) -> dict[str, torch.Size]:
    """Names and shapes of a `depth`-layer head of this kind for a model of `config`, from one layer built on the
    meta device (every layer has the same shapes), so a file naming a million layers costs nothing to check."""
    with torch.device("meta"):
        if prefix == _SEQUENTIAL[0]:
            one = MTP(config.replace(mtp_num_hidden_layers=1)).state_dict()
        else:
            one = ParallelHeads(config.replace(mtp_num_hidden_layers=0, mtp_parallel_heads=1)).state_dict()
    out = {}
    for name, t in one.items():
        m = re.match(r"layers\.\d+\.(.+)$", name)
        if m is None:
            out[prefix + name] = t.shape
        else:
            out.update({f"{prefix}layers.{i}.{m[1]}": t.shape for i in range(depth)})
    return out


def load_mtp_head(model, path):
    """Load a head file written by `save_mtp_head` (or any `mtp.*`-only or `mtp_heads.*`-only file in mtpkit's
    layout) into the model, in place, adding a head of the file's kind and depth first when the model has none or
    another one. Names and shapes must match the model's exactly (checked from the file's header before anything
    is read or replaced: a file that does not fit leaves the model's head untouched); tensors are cast to the
    model's dtype."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"MTP head {path} does not exist")
    try:
        f = safe_open(str(path), framework="pt")
        shapes = {n: torch.Size(f.get_slice(n).get_shape()) for n in f.keys()}
        meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
    vocab_shape = shapes.pop(DRAFT_VOCAB, None)
    other = [n for n in shapes if not is_mtp_param(n)]
    if other:
        raise CheckpointError(f"{path} is not an MTP head: it holds tensors outside mtp.* ({', '.join(sorted(other)[:4])})")
    parallel = any(n.startswith(_PARALLEL[0]) for n in shapes)
    prefix = (_PARALLEL if parallel else _SEQUENTIAL)[0]
    if parallel and not all(n.startswith(prefix) for n in shapes):
        raise CheckpointError(f"{path} mixes mtp.* and mtp_heads.* tensors: a head file holds one kind of head")
    layers = {int(m[1]) for n in shapes if (m := re.match(rf"^{re.escape(prefix)}layers\.(\d+)\.", n))}
    if not layers:
        raise CheckpointError(f"{path} has no {prefix}layers.* tensors: it is not an MTP head")
    depth = max(layers) + 1
    if layers != set(range(depth)):
        raise CheckpointError(f"{path} names MTP layers up to {depth - 1} but holds tensors of only {len(layers)}: "
                              "the file is corrupt")
    width = meta.get(_WIDTH, "0") if parallel else "0"
    if not width.isdigit():
        raise CheckpointError(f"{path}: its {_WIDTH} metadata is {width!r}, not a width: the file is corrupt")
    expected = _expected(model.config.replace(mtp_parallel_intermediate_size=int(width)), prefix, depth)
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit this model's MTP module (missing: {', '.join(missing[:4]) or 'none'}; "
            f"unexpected: {', '.join(unexpected[:4]) or 'none'}): it was trained for another architecture"
        )
    wrong = [f"{n} {tuple(s)} (model: {tuple(expected[n])})" for n, s in shapes.items() if s != expected[n]]
    if wrong:
        raise CheckpointError(f"{path} was trained for another model size: {'; '.join(wrong[:3])}")
    try:
        differs = trunk_difference(json.loads(meta.get(TRUNK, "{}")), model.config)  # older head files: not recorded
    except (ValueError, AttributeError):
        raise CheckpointError(f"{path}: its {TRUNK} metadata is not a JSON object: the file is corrupt") from None
    if differs:
        what, theirs, ours = differs
        raise CheckpointError(f"{path} was trained on another model's trunk ({what} {theirs}, this model's {ours}): "
                              "attach it to the model it was trained with")
    ref = model.model.embed_tokens.weight
    try:
        state = {n[len(prefix):]: f.get_tensor(n).to(device=ref.device, dtype=ref.dtype, copy=True) for n in shapes}
        vocab = None if vocab_shape is None else f.get_tensor(DRAFT_VOCAB)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({e}): the file is truncated or corrupt") from None
    check_draft_vocab(path, vocab, model.config.vocab_size)
    if parallel:
        add_parallel_heads(model, depth, intermediate_size=int(width))
    elif model.mtp is None or len(model.mtp.layers) != depth:
        add_mtp(model, depth)
    model.drafter.load_state_dict(state, strict=True)
    model.drafter.draft_vocab = None if vocab is None else vocab.long()  # generate/bench draft over it by default
    return model
