"""Training parallel heads (Gloeckle et al. 2024) with the sequential per-head forward/backward."""

from __future__ import annotations

import torch

from .config import MTPSection
from .loss import LossOutput, Targets, backward_outside_autocast, draft_columns, head_ce, loss_targets, model_inputs


def parallel_heads_loss(model, batch: dict, cfg: MTPSection, targets: Targets | None = None,
                        token_counts: list[int] | None = None, with_main: bool = True,
                        backward: bool = False) -> LossOutput:
    """`compute_loss`'s objective (main CE + sum_j w_j CE_j, the same targets, weights and normalisation) with
    heads 1..D of `model.mtp_heads` in place of the MTP depths: head j's row i predicts token i+1+j.

    backward=True also backpropagates it, one head at a time (Gloeckle et al. 2024, section 2): the trunk runs
    once and its output becomes a leaf; each head's forward, chunked CE and backward accumulate the gradient at
    that leaf (and in the heads and the shared final norm and lm_head); one backward then carries the leaf's
    gradient through the trunk. Only one head's activations are alive at a time. The returned loss is then
    detached: nothing is left to backpropagate. cfg.only: the trunk runs without a graph and only the heads
    learn (the main CE is reported, or NaN with with_main=False)."""
    if not (with_main or cfg.only):
        raise ValueError("with_main=False is for MTP-only training, where the main CE is only reported")
    if cfg.detach_trunk:
        raise ValueError("detach_trunk cannot isolate parallel heads: they share the trunk's final norm")
    heads = model.mtp_heads
    if heads is None:
        raise ValueError("this model has no parallel heads: add them with "
                         "mtpkit.models.parallel_heads.add_parallel_heads(model, D)")
    targets = loss_targets(batch, cfg) if targets is None else targets
    if len(targets.weights) > len(heads.layers):
        raise ValueError(f"{len(targets.weights)} heads are trained but the model has {len(heads.layers)} parallel "
                         "heads")
    # the trunk's post-norm hidden [B, T, H] (stored features, or a forward with or without its graph)
    trunk = model(**model_inputs(batch), return_logits=False, trunk_grad=backward and not cfg.only)
    hidden = trunk.hidden
    leaf = hidden.detach().requires_grad_(hidden.requires_grad)  # [B, T, H]
    ctx = model.context(trunk.positions, batch.get("segment_ids"), dtype=leaf.dtype)
    # MTP-only: lm_head serves every CE as a constant (see compute_loss)
    main_weight = model.output_weight.detach() if cfg.only else model.output_weight
    head_weight = main_weight
    remap = draft_columns(heads.draft_vocab, head_weight.shape[0], head_weight.device)
    if remap is not None:
        head_weight = head_weight[heads.draft_vocab.to(head_weight.device)]  # [N, H]
    total, sums, correct = 0.0, [], []
    for j, t in enumerate(targets.labels):  # t [B, T-j]
        if j == 0 and not with_main:
            loss_sum, n_correct = torch.full((), float("nan"), device=leaf.device), torch.zeros_like(targets.counts[0])
        else:
            h = leaf if j == 0 else heads(model, leaf, ctx, j)[:, : t.shape[1]]
            loss_sum, n_correct = head_ce(h, t, j, batch, head_weight if j else main_weight, cfg, remap)
        norm = targets.counts[j].clamp(min=1) if token_counts is None else max(token_counts[j], 1)
        term = (1.0 if j == 0 else targets.weights[j - 1]) * loss_sum / norm
        if j or not cfg.only:  # MTP-only: the main CE stays out of the objective
            if backward and term.requires_grad:
                # frees head j's graph; the leaf, the heads and lm_head accumulate gradients
                backward_outside_autocast(term)
            total = total + (term.detach() if backward else term)
        sums.append(loss_sum.detach())
        correct.append(n_correct)
    if backward and leaf.grad is not None:
        backward_outside_autocast(hidden, leaf.grad)
    return LossOutput.from_sums(total, sums, correct, targets)
