"""Models for the GPU check beyond the tests' tiny ones (models/presets.py): the Qwen3.5-shaped configs for
decoding and training, and an HF twin of an mtpkit model."""

from __future__ import annotations

import torch

from ...models.mtp import is_mtp_param
from ...models.presets import QWEN35_SIZES, qwen35_config

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_vl")  # the families whose CUDA paths differ


def tiny_qwen35(mtp_layers: int = 1) -> dict:
    """A Qwen3.5 text config.json at the size of the correctness models (for --tiny decoding and training)."""
    raw = qwen35_config(64, 4, 4, 2, 96, 2, 4, True, vocab=512, mtp_layers=mtp_layers)
    raw.update(head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096)
    raw["rope_parameters"]["mrope_section"] = [2, 1, 1]
    return raw


def qwen35_shapes(tiny: bool, mtp_layers: int = 1) -> dict[str, dict]:
    """name -> config.json of a random model shaped like a released Qwen3.5 (the real 248,320-token vocabulary)."""
    if tiny:
        return {"tiny": tiny_qwen35(mtp_layers)}
    return {name: qwen35_config(*QWEN35_SIZES[name], mtp_layers=mtp_layers) for name in ("0.8B", "2B")}


def hf_twin(model, raw: dict) -> torch.nn.Module:
    """transformers' model for a text config.json with mtpkit model's weights copied in (mtp.* left out: HF
    does not run it), on the same device and in the same dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ...checkpoint.hf import checkpoint_state_dict

    weight = model.output_weight
    with torch.device(weight.device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=weight.dtype)
    hf = hf.to(weight.device).eval()
    state = {k: v for k, v in checkpoint_state_dict(model).items() if not is_mtp_param(k)}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"HF twin does not match: missing {sorted(set(missing) - tied)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    return hf
