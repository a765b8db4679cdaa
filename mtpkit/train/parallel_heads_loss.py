"""Training parallel heads (Gloeckle et al. 2024) with the sequential per-head forward/backward."""

from __future__ import annotations

import torch

from ..models.vlm import VISION_INPUTS
from .loss import IGNORE, LossConfig, LossOutput, _depth_ce, _output, _remap, _targets, depth_weights


def _trunk(model, batch: dict, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The trunk's post-norm hidden [B, T, H] (stored features, or a forward with or without its graph) and the
    positions it ran at."""
    ids, seg = batch["input_ids"], batch.get("segment_ids")
    vision = {k: batch[k] for k in VISION_INPUTS if k in batch}  # image patches: a vision-language model
    with torch.set_grad_enabled(grad):
        inputs = model.prepare_inputs(ids, seg, **vision)  # embeddings and (MRoPE) positions, once
        pos = inputs.positions if batch.get("positions") is None else batch["positions"]
        if "hidden" in batch:  # the trunk's stored hidden states (data.mode = "features"): the trunk does not run
            return batch["hidden"].to(inputs.embeds.dtype), pos
        out = model(inputs_embeds=inputs.embeds, positions=pos, segment_ids=seg, deepstack=inputs.deepstack,
                    return_logits=False)
    return out.hidden, pos


def _backward(tensor: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    """A backward from inside the caller's autocast region, run as it would run outside it."""
    with torch.autocast(tensor.device.type, enabled=False):
        tensor.backward(grad)


def parallel_heads_loss(model, batch: dict, cfg: LossConfig, step: int = 0, token_counts: dict | None = None,
                        with_main: bool = True, backward: bool = False) -> LossOutput:
    """`compute_loss`'s objective (main CE + sum_j w_j CE_j, the same weights, targets and normalisation) with
    heads 1..D of `model.mtp_heads` in place of the MTP depths: head j's row i predicts token i+1+j.

    backward=True also backpropagates it, one head at a time (Gloeckle et al. 2024, section 2): the trunk runs
    once and its output becomes a leaf; each head's forward, chunked CE and backward accumulate the gradient at
    that leaf (and in the heads and the shared final norm and lm_head); one backward then carries the leaf's
    gradient through the trunk. Only one head's activations are alive at a time. The returned loss is then
    detached: nothing is left to backpropagate. cfg.mtp_only: the trunk runs without a graph and only the heads
    learn (the main CE is reported, or NaN with with_main=False)."""
    if not (with_main or cfg.mtp_only):
        raise ValueError("with_main=False is for MTP-only training, where the main CE is only reported")
    if cfg.detach_trunk:
        raise ValueError("detach_trunk cannot isolate parallel heads: they share the trunk's final norm")
    heads = model.mtp_heads
    if heads is None:
        raise ValueError("this model has no parallel heads: add them with "
                         "mtpkit.models.parallel_heads.add_parallel_heads(model, D)")
    weights = depth_weights(cfg, step, len(heads.layers))
    if len(weights) > len(heads.layers):
        raise ValueError(f"{len(weights)} heads are trained but the model has {len(heads.layers)} parallel heads")
    hidden, pos = _trunk(model, batch, backward and not cfg.mtp_only)
    leaf = hidden.detach().requires_grad_(hidden.requires_grad)  # [B, T, H]
    ctx = model.context(pos, batch.get("segment_ids"), dtype=leaf.dtype)
    # MTP-only: lm_head serves every CE as a constant (see compute_loss)
    main_weight = model.output_weight.detach() if cfg.mtp_only else model.output_weight
    head_weight = main_weight
    remap = _remap(cfg.draft_vocab, head_weight.shape[0], head_weight.device)
    if remap is not None:
        head_weight = head_weight[cfg.draft_vocab.to(head_weight.device)]  # [N, H]
    counts = None if token_counts is None else [token_counts["main"], *token_counts["mtp"]]
    total, sums, valid, correct = 0.0, [], [], []
    for j, t in enumerate(_targets(batch, len(weights))):  # t [B, T-j]
        if j == 0 and not with_main:
            n_valid = (t != IGNORE).sum()
            loss_sum, n_correct = torch.full((), float("nan"), device=leaf.device), torch.zeros_like(n_valid)
        else:
            h = leaf if j == 0 else heads(model, leaf, ctx, j)[:, : t.shape[1]]
            loss_sum, n_valid, n_correct = _depth_ce(h, t, j, batch, head_weight if j else main_weight, cfg, remap)
        term = (1.0 if j == 0 else weights[j - 1]) * loss_sum / (n_valid.clamp(min=1) if counts is None
                                                                else max(counts[j], 1))
        if j or not cfg.mtp_only:  # MTP-only: the main CE stays out of the objective
            if backward and term.requires_grad:
                _backward(term)  # frees head j's graph; the leaf, the heads and lm_head accumulate gradients
            total = total + (term.detach() if backward else term)
        sums.append(loss_sum.detach())
        valid.append(n_valid)
        correct.append(n_correct)
    if backward and leaf.grad is not None:
        _backward(hidden, leaf.grad)
    return _output(total, sums, valid, correct)
