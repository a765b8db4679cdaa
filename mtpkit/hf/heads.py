"""The MTP module of a transformers model, as mtpkit's own `MTP`: read from the checkpoint's `mtp.*` tensors (which
transformers ignores on load), from an mtpkit head file, or newly initialised."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoint.hf import CheckpointError, _SafetensorsDir, fuse_experts, group_experts, read_draft_vocab
from ..checkpoint.mtp_head import DRAFT_VOCAB
from ..models.config import ModelConfig, config_from_hf
from ..models.init import init_weights
from ..models.mtp import MTP, is_mtp_param


def trunk_config(hf_model) -> ModelConfig:
    """mtpkit's ModelConfig of a transformers model (text or vision-language), MTP depth as its config says."""
    return config_from_hf(hf_model.config.to_dict())


def _read(path: Path, vocab_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The `mtp.*` tensors and the draft vocabulary (when the head has one) of an HF model directory or an mtpkit
    head file."""
    if path.is_dir():
        source = _SafetensorsDir(path)
        return {n: source.get(n) for n in source.names() if is_mtp_param(n)}, read_draft_vocab(path, vocab_size)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: pass an HF model directory or an mtpkit head file")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
    return tensors, tensors.pop(DRAFT_VOCAB, None)


def load_head(path, config: ModelConfig) -> MTP:
    """The sequential MTP stored at `path` (an HF directory with `mtp.*`, e.g. a Qwen3.5 release, or a head file),
    its depth as stored, built for a trunk of `config`, in float32 on the CPU."""
    path = Path(path)
    tensors, vocab = _read(path, config.vocab_size)
    if any(n.startswith("mtp_heads.") for n in tensors):
        raise CheckpointError(f"{path} holds parallel heads (mtp_heads.*): train them with mtpkit's own trainer")
    if not any(n.startswith("mtp.layers.") for n in tensors):
        raise CheckpointError(f"{path} has no mtp.layers.* tensors: start a new head with init='random' or "
                              "init='last_layer'")
    for prefix, per in group_experts(list(tensors)).items():  # released MoE heads: one tensor per expert
        gate_up, down = fuse_experts(path, prefix, per, tensors.pop)
        tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = gate_up, down
    depth = 1 + max(int(n.split(".")[2]) for n in tensors if n.startswith("mtp.layers."))
    mtp = MTP(config.replace(mtp_num_hidden_layers=depth))
    state = {n[len("mtp."):]: t.float() for n, t in tensors.items()}
    try:
        mtp.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
        raise CheckpointError(f"{path} does not fit this model's MTP module ({first}): it was trained for another "
                              "architecture or size") from None
    mtp.draft_vocab = None if vocab is None else vocab.long()
    return mtp


def new_head(hf_model, config: ModelConfig, depth: int, init: str) -> MTP:
    """A new `depth`-layer MTP: normal(0.02) weights and identity norms ("random"), or every layer a copy of the
    trunk's last full-attention layer ("last_layer", the rest random), in float32 on the CPU."""
    if init not in ("random", "last_layer"):
        raise ValueError(f"init must be 'random' or 'last_layer', not {init!r}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, not {depth}")
    mtp = MTP(config.replace(mtp_num_hidden_layers=depth))
    init_weights(mtp)
    if init == "last_layer":
        last = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
        layer = hf_model.get_decoder().layers[last]
        for own in mtp.layers:
            own.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    return mtp
