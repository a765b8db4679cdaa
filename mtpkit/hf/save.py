"""Saving an MTPModel: transformers' own files, then the head as `mtp.*` where vLLM and SGLang read it, so the
directory serves with MTP as it is (the layout `mtpkit graft` writes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.graft import HEAD_FILE, INDEX, write_head
from ..checkpoint.hf import _PER_EXPERT, _SafetensorsDir, checkpoint_state_dict
from ..checkpoint.mtp_head import DRAFT_VOCAB
from ..models.mtp import is_mtp_param
from ..models.transformer import CheckpointInfo


def head_state(model, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """The head's tensors under checkpoint names (`mtp.*`; a LoRA-trained head merged, in a copy), on the CPU;
    `per_expert`: MoE experts one tensor per expert, as the trunk of a released Qwen3.5-MoE stores them."""
    holder = nn.Module()  # checkpoint_state_dict names the tensors of a model's `mtp` attribute
    holder.mtp = model.plain_head()
    experts = {f"mtp.layers.{i}.mlp.experts" for i in range(len(holder.mtp.layers))} if per_expert else set()
    holder.checkpoint_info = CheckpointInfo(raw_config={}, per_expert=experts)
    return {k: v.detach().to("cpu").contiguous() for k, v in checkpoint_state_dict(holder).items()}


def _drop_old_head(out: Path) -> None:
    """A head saved here before, so transformers' save starts clean: its file, and the index that listed it."""
    index = out / INDEX
    if index.is_file() and HEAD_FILE in json.loads(index.read_text()).get("weight_map", {}).values():
        index.unlink()
    (out / HEAD_FILE).unlink(missing_ok=True)


def save_with_head(model, save_directory, **kwargs) -> Path:
    """`model.model.save_pretrained(save_directory, **kwargs)` and the head beside it. A full model: the head in
    `mtp.safetensors`, listed in model.safetensors.index.json, and `mtp_num_hidden_layers` in config.json, so
    vLLM, SGLang, mtpkit.load_model and transformers all load the directory. A PEFT model: the adapter, and the
    head alone in `mtp.safetensors` (an mtpkit head file); merge with `model.merged()` to save a servable model."""
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    _drop_old_head(out)
    model.model.save_pretrained(str(out), **kwargs)
    vocab = model.head.draft_vocab
    if model.model is not model.hf_model:  # an adapter directory: no model weights or config.json to join
        tensors = head_state(model) | ({} if vocab is None else {DRAFT_VOCAB: vocab.to("cpu", torch.long)})
        save_file(tensors, str(out / HEAD_FILE), metadata={"format": "pt",
                                                            "mtp_num_hidden_layers": str(len(model.head.layers))})
        return out
    source = _SafetensorsDir(out)
    weight_map = {n: f.name for n, f in source.files.items() if not is_mtp_param(n)}
    tensors = head_state(model, per_expert=any(_PER_EXPERT.match(n) for n in weight_map))
    raw = json.loads((out / "config.json").read_text())
    write_head(out, tensors, weight_map, raw, {"mtp_num_hidden_layers": len(model.head.layers)}, vocab)
    return out
