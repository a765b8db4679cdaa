"""The MTP training objective: targets on packed rows, per-depth weights and schedules, and the loss itself.

total = main CE + sum_d w_d * CE_d, with w_d = lambda / D by default (DeepSeek-V3; Megatron-LM's
`mtp_loss_scaling_factor`), explicit per-depth weights (FastMTP), a lambda schedule (DeepSeek-V3: 0.3 then 0.1)
and a depth curriculum. Depth d's targets are the labels rolled left by d inside each packed segment, as in
Megatron-LM, so no supervision crosses a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.packed_attention import contiguous_runs
from ..models.mtp import is_mtp_param
from .chunked_ce import chunked_cross_entropy
from .config import MTPSection
from .soft_ce import chunked_soft_cross_entropy

IGNORE = -100


def _same_run(segment_ids: Tensor, depth: int) -> Tensor:
    """[B, T-depth]: True where position i+depth lies in the same contiguous segment as position i."""
    run = contiguous_runs(segment_ids)
    return run[:, depth:] == run[:, :-depth]


def shift_labels(input_ids: Tensor, segment_ids: Tensor | None = None, loss_mask: Tensor | None = None) -> Tensor:
    """labels [B, T]: labels[t] = input_ids[t+1] when t+1 is in t's segment and loss_mask[t+1] (if given) is
    true, else IGNORE; the last position is always IGNORE."""
    labels = torch.full_like(input_ids, IGNORE)
    keep = torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if segment_ids is not None:
        keep &= _same_run(segment_ids, 1)
    if loss_mask is not None:
        keep &= loss_mask[:, 1:].bool()
    labels[:, :-1] = torch.where(keep, input_ids[:, 1:], IGNORE)
    return labels


def mtp_targets(labels: Tensor, segment_ids: Tensor | None, depth: int) -> Tensor:
    """targets [B, T-depth] of MTP depth d (row i predicts token i+1+d): labels[i+d] when i+d is in i's
    segment, else IGNORE; so the last d positions of every segment are masked (Megatron-LM's per-segment roll)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, not {depth}")
    targets = labels[:, depth:]
    if segment_ids is None or targets.shape[1] == 0:
        return targets
    return torch.where(_same_run(segment_ids, depth), targets, IGNORE)


def _at(schedule: list[list], step: int):
    """Value of a piecewise-constant [[step, value], ...] schedule at `step`."""
    return [v for s, v in schedule if s <= step][-1]


def depth_weights(cfg: MTPSection, step: int) -> list[float]:
    """Weights of the depths 1..n trained at `step`. n: the curriculum's value, else cfg.depth. Explicit weights:
    the first n of them. Otherwise w_d = lambda / n, so the total MTP weight stays lambda as the curriculum adds
    depths."""
    n = int(_at(cfg.depth_curriculum, step)) if cfg.depth_curriculum else cfg.depth
    if cfg.weights is not None:
        return [float(w) for w in cfg.weights[:n]]
    lam = float(_at(cfg.lambda_schedule, step)) if cfg.lambda_schedule else cfg.mtp_lambda
    return [lam / n] * n if n else []


@dataclass
class Targets:
    """What one micro-batch is scored against at one step, built once: the trainer sums `counts` over
    micro-batches and ranks before any loss is computed, and the loss reads the same labels and weights."""

    labels: list[Tensor]  # the main labels [B, T], then depth d's targets [B, T-d] (row i: token i+1+d)
    weights: list[float]  # w_1..w_n of the depths trained at this step
    counts: Tensor  # [1 + n] valid targets per head, main first


def loss_targets(batch: dict, cfg: MTPSection, step: int = 0) -> Targets:
    """The Targets of a batch (labels from shift_labels, optional segment_ids) at `step`."""
    weights = depth_weights(cfg, step)
    labels, seg = batch["labels"], batch.get("segment_ids")
    targets = [labels] + [mtp_targets(labels, seg, d) for d in range(1, len(weights) + 1)]
    return Targets(targets, weights, torch.stack([(t != IGNORE).sum() for t in targets]))


@dataclass
class LossOutput:
    """One micro-batch's objective and, per head (main first), what the trainer sums over micro-batches and ranks."""

    total: Tensor  # the scalar to backward, normalised by the token counts (local, or the global ones passed in)
    ce: list[float]  # CE sums (main: NaN where it was not computed)
    correct: list[int]  # teacher-forced top-1 hits (training-time acceptance estimate)
    counts: list[int]  # valid targets

    @classmethod
    def from_sums(cls, total: Tensor, sums: list[Tensor], correct: list[Tensor], targets: Targets) -> LossOutput:
        """The LossOutput of an objective from its per-head CE sums and top-1 hits (two host syncs in all)."""
        counts = torch.cat([targets.counts, torch.stack(correct)]).tolist()
        n = len(sums)
        return cls(total, torch.stack(sums).tolist(), counts[n:], counts[:n])

    @property
    def main(self) -> float:
        """Mean main CE of this micro-batch."""
        return self.ce[0] / max(self.counts[0], 1)

    @property
    def per_depth(self) -> list[float]:
        """Mean CE per MTP depth."""
        return [s / max(n, 1) for s, n in zip(self.ce[1:], self.counts[1:])]

    @property
    def accuracy(self) -> list[float]:
        """Top-1 accuracy per MTP depth."""
        return [c / max(n, 1) for c, n in zip(self.correct[1:], self.counts[1:])]


def freeze_trunk(model):
    """requires_grad=False on every parameter outside `mtp.` (MTP-only training); returns the model."""
    for name, p in model.named_parameters():
        if not is_mtp_param(name):
            p.requires_grad_(False)
    return model


_LOSS_KEYS = ("labels", "hidden", "topk_ids", "topk_logprobs")  # the rest of a batch is the model's input


def model_inputs(batch: dict) -> dict:
    """model.forward's keyword arguments from a batch: every key but the loss's own (input_ids, segment_ids,
    optional positions, a vision-language model's image inputs), and a features batch's stored trunk output."""
    return {**{k: v for k, v in batch.items() if k not in _LOSS_KEYS}, "trunk_hidden": batch.get("hidden")}


def head_ce(h: Tensor, t: Tensor, depth: int, batch: dict, weight: Tensor, cfg: MTPSection,
            remap: Tensor | None) -> tuple[Tensor, Tensor]:
    """(CE sum, correct top-1) of one head's rows h [B, T-d, H] against t [B, T-d] (depth 0: the main head; the
    sequential MTP's depth d or parallel head d otherwise). MTP depths: a
    hard CE on t or, with head_loss = "soft", a soft CE on the trunk's stored top-k at the target (row i + d), or
    with "greedy" a hard CE on the trunk's stored top-1 there (where t is a target);
    with a draft vocabulary (weight: its rows; remap: id -> its column, -1 outside), over its columns only: a
    target outside it adds no loss (nothing can score it) but stays a valid target that counts as wrong."""
    if depth and cfg.head_loss in ("soft", "greedy") and "topk_ids" not in batch:
        raise ValueError(f"mtp.head_loss = {cfg.head_loss!r} needs the trunk's top-k: rebuild the features with "
                         "`mtpkit features --topk K`")
    h, t = h.reshape(-1, h.shape[-1]), t.reshape(-1)
    valid = t != IGNORE
    if depth and cfg.head_loss == "greedy":  # the trunk's own top-1 at row i + d, where the data's token counts
        t = torch.where(valid, batch["topk_ids"][:, depth:, 0].reshape(-1), IGNORE)
    cols = t
    if depth and remap is not None:
        inside = torch.where(valid, remap[t.clamp(min=0)], -1)
        cols = torch.where(inside >= 0, inside, IGNORE)
    if depth and cfg.head_loss == "soft":
        k = batch["topk_ids"].shape[-1]
        ids, logprobs = batch["topk_ids"][:, depth:].reshape(-1, k), batch["topk_logprobs"][:, depth:].reshape(-1, k)
        if remap is not None:
            ids = remap[ids]
        loss_sum, argmax = chunked_soft_cross_entropy(h, weight, ids, logprobs, valid, cfg.ce_chunk_tokens)
        return loss_sum, ((argmax == cols) & (cols != IGNORE)).sum()
    loss_sum, _, n_correct = chunked_cross_entropy(h, weight, cols, cfg.ce_chunk_tokens, IGNORE)
    return loss_sum, n_correct


def draft_columns(vocab: Tensor | None, size: int, device) -> Tensor | None:
    """[size] table: id -> its column in the draft vocabulary, -1 outside it (None: no draft vocabulary)."""
    if vocab is None:
        return None
    vocab = vocab.to(device)
    return torch.full((size,), -1, dtype=torch.long, device=device).index_copy_(
        0, vocab, torch.arange(len(vocab), device=device))


def backward_outside_autocast(tensor: Tensor, grad: Tensor | None = None) -> None:
    """A backward from inside the caller's autocast region, run as it would run outside it."""
    with torch.autocast(tensor.device.type, enabled=False):
        tensor.backward(grad)


def compute_loss(model, batch: dict, cfg: MTPSection, targets: Targets | None = None,
                 token_counts: list[int] | None = None, with_main: bool = True) -> LossOutput:
    """Main + weighted MTP cross-entropy of one micro-batch, with the logits of one chunk alive at a time.

    batch: the model's inputs (input_ids [B, T], optional segment_ids [B, T] and positions, and for a
    vision-language model pixel_values and image_grid_thw), labels [B, T] (shift_labels; never a vision token: see
    data/images.py) and, from stored features, the trunk's hidden and top-k. cfg: the [mtp] section. targets: this
    micro-batch's `loss_targets` (default: at step 0). token_counts: GLOBAL valid targets per head, main first, over
    all ranks and micro-batches; each term is then this micro-batch's CE sum / global count, so gradients *summed*
    over ranks and micro-batches equal one big batch's (FSDP2/DDP average over ranks by default: scale by the world
    size or set the divide factor to 1). with_main=False (MTP-only): the main CE, which carries no gradient there,
    is not computed (reported as NaN). A head trained with mtp.draft_vocab (model.drafter.draft_vocab) gets its CE
    over those ids only.
    """
    if not (with_main or cfg.only):
        raise ValueError("with_main=False is for MTP-only training, where the main CE is only reported")
    targets = loss_targets(batch, cfg) if targets is None else targets
    out = model(**model_inputs(batch), mtp=len(targets.weights) or False, return_logits=False,
                detach_trunk=cfg.detach_trunk, trunk_grad=not cfg.only, mtp_as_drafted=cfg.as_drafted)
    vocab = model.drafter.draft_vocab if targets.weights else None
    return score(out.hidden, out.mtp_hidden, model.output_weight, vocab, batch, cfg, targets, token_counts, with_main)


def score(hidden: Tensor, mtp_hidden: list[Tensor] | None, output_weight: Tensor, draft_vocab: Tensor | None,
          batch: dict, cfg: MTPSection, targets: Targets, token_counts: list[int] | None = None,
          with_main: bool = True) -> LossOutput:
    """The objective of `compute_loss` from a forward's outputs: the trunk's post-norm hidden [B, T, H], depth d's
    MTP output [B, T-d, H] and the lm_head weight [V, H], scored against `targets` (see compute_loss)."""
    # MTP-only: lm_head serves every CE as a constant, so it gets no gradient even if left trainable;
    # detach_trunk: only the MTP CEs read it as a constant (with tied embeddings it is the embedding too)
    main_weight = output_weight.detach() if cfg.only else output_weight
    mtp_weight = output_weight.detach() if cfg.only or cfg.detach_trunk else output_weight
    remap = draft_columns(draft_vocab, mtp_weight.shape[0], mtp_weight.device)
    if remap is not None:
        mtp_weight = mtp_weight[draft_vocab.to(mtp_weight.device)]  # [N, H], gathered once for every depth
    terms, sums, correct = [], [], []
    for d, (h, t) in enumerate(zip([hidden, *(mtp_hidden or [])], targets.labels)):
        if d == 0 and not with_main:
            loss_sum, n_correct = torch.full((), float("nan"), device=h.device), torch.zeros_like(targets.counts[0])
        else:
            loss_sum, n_correct = head_ce(h, t, d, batch, mtp_weight if d else main_weight, cfg, remap)
        norm = targets.counts[d].clamp(min=1) if token_counts is None else max(token_counts[d], 1)
        terms.append(loss_sum / norm)
        sums.append(loss_sum.detach())
        correct.append(n_correct)
    mtp = sum(w * term for w, term in zip(targets.weights, terms[1:]))
    # MTP-only: the main CE is reported but carries no gradient, so it stays out of the objective
    return LossOutput.from_sums(mtp if cfg.only else terms[0] + mtp, sums, correct, targets)


def tau_sim(accuracy: list[float]) -> float:
    """Simulated mean acceptance length 1 + sum_k prod_{j<=k} acc_j from teacher-forced per-depth accuracies
    (NeMo AutoModel's training-time estimate): depth k's draft is kept only if every earlier one was."""
    total, run = 1.0, 1.0
    for a in accuracy:
        run *= a
        total += run
    return total
