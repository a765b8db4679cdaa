"""AdamW with a separate parameter group (and learning rate `lr_mtp`) for the MTP module, and warmup + cosine."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.mtp import is_mtp_param


def param_groups(model: nn.Module, lr: float, lr_mtp: float | None, weight_decay: float) -> list[dict]:
    """Trainable parameters in up to four groups: trunk / mtp x decay / no decay. Matrices (and the embedding)
    decay; norms, biases and other 1-D parameters (GDN's A_log, dt_bias) do not."""
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part = "mtp" if is_mtp_param(name) else "trunk"
        groups.setdefault((part, p.dim() >= 2), []).append(p)
    out = []
    for (part, decay), params in sorted(groups.items()):
        out.append({
            "params": params,
            "name": f"{part}{'' if decay else '_no_decay'}",
            "lr": lr_mtp if part == "mtp" and lr_mtp is not None else lr,
            "weight_decay": weight_decay if decay else 0.0,
        })
    if not out:
        raise ValueError("the model has no trainable parameters")
    return out


def build_optimizer(model: nn.Module, cfg_optim) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg_optim.lr, cfg_optim.lr_mtp, cfg_optim.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg_optim.lr, betas=(cfg_optim.beta1, cfg_optim.beta2), eps=cfg_optim.eps)


def lr_factor(step: int, total: int, warmup: int, schedule: str = "cosine", min_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup over `warmup` steps (step 0
    gets 1/warmup of the peak), then constant or cosine from 1 down to `min_ratio` at the last step."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - 1 - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg_optim, total_steps: int):
    """LambdaLR over every group (each keeps its own peak lr); its state is the step count."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, total_steps, cfg_optim.warmup_steps, cfg_optim.schedule, cfg_optim.min_lr_ratio),
    )
