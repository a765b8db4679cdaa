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

from ..models.mtp import is_mtp_param
from ..models.transformer import default_positions
from ..models.vlm import VISION_INPUTS
from .chunked_ce import chunked_cross_entropy
from .soft_ce import chunked_soft_cross_entropy

IGNORE = -100


def _same_run(segment_ids: Tensor, depth: int) -> Tensor:
    """[B, T-depth]: True where position i+depth lies in the same contiguous segment as position i."""
    change = torch.zeros_like(segment_ids, dtype=torch.long)
    change[:, 1:] = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
    run = change.cumsum(1)  # index of the contiguous run, so a reused segment id never joins two documents
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


def _check_schedule(name: str, schedule: list[list]) -> None:
    steps = [int(s) for s, _ in schedule]
    if not steps or steps[0] != 0 or any(a >= b for a, b in zip(steps, steps[1:])):
        raise ValueError(f"{name} must be [[step, value], ...] with steps increasing from 0, got {schedule}")


def _at(schedule: list[list], step: int):
    """Value of a piecewise-constant [[step, value], ...] schedule at `step`."""
    return [v for s, v in schedule if s <= step][-1]


@dataclass
class LossConfig:
    mtp_lambda: float = 0.1  # DeepSeek-V3 / Megatron-LM: w_d = lambda / D
    mtp_weights: list[float] | None = None  # explicit per-depth weights (FastMTP: [0.51, 0.31, 0.18])
    lambda_schedule: list[list] | None = None  # [[step, lambda], ...]: lambda from that step on
    depth_curriculum: list[list] | None = None  # [[step, n_depths], ...]: trained depths grow with steps
    # chained depths (default: len(mtp_weights), else the model's MTP layers); beyond D the last layer is reused
    mtp_depths: int | None = None
    mtp_only: bool = False  # only mtp.* trains; trunk, embedding and lm_head get no gradient
    # joint training, isolated: the trunk learns from the main CE only, mtp.* from the MTP CE only (the MTP reads
    # the embeddings, hidden states and lm_head detached; Megatron-LM's `mtp_isolated_loss`)
    detach_trunk: bool = False
    ce_chunk_tokens: int = 2048  # CE over chunks of this many tokens
    head_loss: str = "hard"  # MTP depths: "hard" CE on the tokens | "soft" CE on the batch's stored trunk top-k
    draft_vocab: Tensor | None = None  # sorted ids: MTP CE over these columns only (FR-Spec at training time)

    def __post_init__(self):
        if self.mtp_lambda < 0:
            raise ValueError(f"mtp_lambda must be >= 0, not {self.mtp_lambda}")
        if self.mtp_only and self.detach_trunk:
            raise ValueError("mtp_only already keeps the MTP gradient out of a frozen trunk: set mtp_only or "
                             "detach_trunk, not both")
        if self.mtp_weights is not None and (not self.mtp_weights or min(self.mtp_weights) < 0):
            raise ValueError(f"mtp_weights must be a non-empty list of weights >= 0, not {self.mtp_weights}")
        if self.mtp_weights is not None and self.lambda_schedule is not None:
            raise ValueError("mtp_weights replace lambda: give mtp_weights or lambda_schedule, not both")
        if self.lambda_schedule is not None:
            _check_schedule("lambda_schedule", self.lambda_schedule)
        if self.mtp_depths is not None and self.mtp_depths < 1:
            raise ValueError(f"mtp_depths must be >= 1, not {self.mtp_depths}")
        if self.depth_curriculum is not None:
            _check_schedule("depth_curriculum", self.depth_curriculum)
            top = max(int(n) for _, n in self.depth_curriculum)
            if min(int(n) for _, n in self.depth_curriculum) < 1 or top > (self.mtp_depths or top):
                raise ValueError(f"depth_curriculum values must lie in 1..mtp_depths, got {self.depth_curriculum}")
        if self.mtp_weights is not None:
            most = max([self.mtp_depths or 0] + [int(n) for _, n in self.depth_curriculum or []])
            if most > len(self.mtp_weights):
                raise ValueError(f"mtp_weights has {len(self.mtp_weights)} weights for {most} depths")
        if self.ce_chunk_tokens < 1:
            raise ValueError(f"ce_chunk_tokens must be >= 1, not {self.ce_chunk_tokens}")
        if self.head_loss not in ("hard", "soft"):
            raise ValueError(f"head_loss must be 'hard' or 'soft', not {self.head_loss!r}")


def depth_weights(cfg: LossConfig, step: int, model_depth: int) -> list[float]:
    """Weights of the depths 1..n trained at `step`. n: the curriculum's value, else cfg.mtp_depths, else
    len(cfg.mtp_weights), else the model's MTP layers. Explicit weights: the first n of them. Otherwise
    w_d = lambda / n, so the total MTP weight stays lambda as the curriculum adds depths."""
    if cfg.depth_curriculum:
        n = int(_at(cfg.depth_curriculum, step))
    else:
        n = cfg.mtp_depths or (len(cfg.mtp_weights) if cfg.mtp_weights else model_depth)
    if cfg.mtp_weights is not None:
        return [float(w) for w in cfg.mtp_weights[:n]]
    lam = float(_at(cfg.lambda_schedule, step)) if cfg.lambda_schedule else cfg.mtp_lambda
    return [lam / n] * n if n else []


@dataclass
class LossOutput:
    loss: Tensor  # scalar to backward, normalised by the token counts (local, or the global ones passed in)
    main_loss: Tensor  # detached mean CE of this micro-batch
    mtp_losses: list[Tensor]  # detached mean CE per depth
    mtp_accuracy: list[float]  # teacher-forced top-1 accuracy per depth (training-time acceptance estimate)
    main_tokens: int  # valid targets in this micro-batch
    mtp_tokens: list[int]


def _targets(batch: dict, n: int) -> list[Tensor]:
    labels, seg = batch["labels"], batch.get("segment_ids")
    return [labels] + [mtp_targets(labels, seg, d) for d in range(1, n + 1)]


def count_tokens(batch: dict, cfg: LossConfig, model, step: int) -> dict:
    """Local valid-target counts {"main": n, "mtp": [n_1..n_D]} for the depths active at `step`: what the trainer
    sums over ranks and micro-batches into compute_loss's token_counts."""
    n = len(depth_weights(cfg, step, model.config.mtp_num_hidden_layers))
    counts = torch.stack([(t != IGNORE).sum() for t in _targets(batch, n)]).tolist()
    return {"main": counts[0], "mtp": counts[1:]}


def freeze_trunk(model):
    """requires_grad=False on every parameter outside `mtp.` (MTP-only training); returns the model."""
    for name, p in model.named_parameters():
        if not is_mtp_param(name):
            p.requires_grad_(False)
    return model


def _hidden_states(model, batch: dict, n: int, cfg: LossConfig) -> tuple[Tensor, list[Tensor]]:
    """The trunk's post-norm hidden [B, T, H] and depth d's MTP output [B, T-d, H] for d = 1..n."""
    ids, seg, pos = batch["input_ids"], batch.get("segment_ids"), batch.get("positions")
    if "hidden" in batch:  # the trunk's stored hidden states (data.mode = "features"): the trunk does not run
        with torch.no_grad():
            embeds = model.embed(ids)
        hidden = batch["hidden"].to(embeds.dtype)
        pos = default_positions(ids, seg) if pos is None else pos
        return hidden, model.mtp_teacher_forced(embeds, hidden, pos, seg, n)
    vision = {k: batch[k] for k in VISION_INPUTS if k in batch}  # image patches: a vision-language model
    if not cfg.mtp_only:
        out = model(ids, positions=pos, segment_ids=seg, mtp=n or False, return_logits=False,
                    detach_trunk=cfg.detach_trunk, **vision)
        return out.hidden, out.mtp_hidden or []
    if n == 0:
        raise ValueError("mtp_only training needs an MTP module: add one with mtpkit.add_mtp(model)")
    with torch.no_grad():  # the trunk runs as a fixed feature extractor: no graph, no gradient
        inputs = model.prepare_inputs(ids, seg, **vision)
        pos = inputs.positions if pos is None else pos
        hidden = model(inputs_embeds=inputs.embeds, positions=pos, segment_ids=seg, deepstack=inputs.deepstack,
                       return_logits=False).hidden
    return hidden, model.mtp_teacher_forced(inputs.embeds, hidden, pos, seg, n)


def _depth_ce(h: Tensor, t: Tensor, depth: int, batch: dict, weight: Tensor, cfg: LossConfig,
              remap: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(CE sum, valid targets, correct top-1) of one depth's rows h [B, T-d, H] against t [B, T-d]. MTP depths: a
    hard CE on t or, with head_loss = "soft", a soft CE on the trunk's stored top-k at the target (row i + d);
    with a draft vocabulary (weight: its rows; remap: id -> its column, -1 outside), over its columns only: a
    target outside it adds no loss (nothing can score it) but stays a valid target that counts as wrong."""
    h, t = h.reshape(-1, h.shape[-1]), t.reshape(-1)
    valid = t != IGNORE
    cols = t
    if depth and remap is not None:
        inside = torch.where(valid, remap[t.clamp(min=0)], -1)
        cols = torch.where(inside >= 0, inside, IGNORE)
    if depth and cfg.head_loss == "soft":
        if "topk_ids" not in batch:
            raise ValueError("mtp.head_loss = 'soft' needs the trunk's top-k: rebuild the features with "
                             "`mtpkit features --topk K`")
        k = batch["topk_ids"].shape[-1]
        ids, logprobs = batch["topk_ids"][:, depth:].reshape(-1, k), batch["topk_logprobs"][:, depth:].reshape(-1, k)
        if remap is not None:
            ids = remap[ids]
        loss_sum, argmax = chunked_soft_cross_entropy(h, weight, ids, logprobs, valid, cfg.ce_chunk_tokens)
        return loss_sum, valid.sum(), ((argmax == cols) & (cols != IGNORE)).sum()
    loss_sum, _, n_correct = chunked_cross_entropy(h, weight, cols, cfg.ce_chunk_tokens, IGNORE)
    return loss_sum, valid.sum(), n_correct


def _remap(vocab: Tensor | None, size: int, device) -> Tensor | None:
    """[size] table: id -> its column in the draft vocabulary, -1 outside it (None: no draft vocabulary)."""
    if vocab is None:
        return None
    vocab = vocab.to(device)
    return torch.full((size,), -1, dtype=torch.long, device=device).index_copy_(
        0, vocab, torch.arange(len(vocab), device=device))


def compute_loss(model, batch: dict, cfg: LossConfig, step: int = 0, token_counts: dict | None = None,
                 with_main: bool = True) -> LossOutput:
    """Main + weighted MTP cross-entropy of one micro-batch, with the logits of one chunk alive at a time.

    batch: input_ids [B, T], labels [B, T] (shift_labels), optional segment_ids [B, T] and positions, and for a
    vision-language model pixel_values and image_grid_thw (labels never target a vision token: see vision_data).
    token_counts: GLOBAL {"main": N, "mtp": [N_1..N_D]} over all ranks and micro-batches; each term is then this
    micro-batch's CE sum / global count, so gradients *summed* over ranks and micro-batches equal one big batch's
    (FSDP2/DDP average over ranks by default: scale by the world size or set the divide factor to 1).
    with_main=False (MTP-only): the main CE, which carries no gradient there, is not computed (reported as NaN).
    """
    if not (with_main or cfg.mtp_only):
        raise ValueError("with_main=False is for MTP-only training, where the main CE is only reported")
    weights = depth_weights(cfg, step, model.config.mtp_num_hidden_layers)
    hidden, mtp_hidden = _hidden_states(model, batch, len(weights), cfg)
    # MTP-only: lm_head serves every CE as a constant, so it gets no gradient even if left trainable;
    # detach_trunk: only the MTP CEs read it as a constant (with tied embeddings it is the embedding too)
    main_weight = model.output_weight.detach() if cfg.mtp_only else model.output_weight
    mtp_weight = model.output_weight.detach() if cfg.mtp_only or cfg.detach_trunk else model.output_weight
    global_counts = None if token_counts is None else [token_counts["main"], *token_counts["mtp"]]
    remap = _remap(cfg.draft_vocab, mtp_weight.shape[0], mtp_weight.device)
    if remap is not None:
        mtp_weight = mtp_weight[cfg.draft_vocab.to(mtp_weight.device)]  # [N, H], gathered once for every depth
    terms, sums, valid, correct = [], [], [], []
    for d, (h, t) in enumerate(zip([hidden, *mtp_hidden], _targets(batch, len(weights)))):
        if d == 0 and not with_main:
            n_valid = (t != IGNORE).sum()
            loss_sum, n_correct = torch.full((), float("nan"), device=h.device), torch.zeros_like(n_valid)
        else:
            loss_sum, n_valid, n_correct = _depth_ce(h, t, d, batch, mtp_weight if d else main_weight, cfg, remap)
        norm = n_valid.clamp(min=1) if global_counts is None else max(global_counts[d], 1)
        terms.append(loss_sum / norm)
        sums.append(loss_sum.detach())
        valid.append(n_valid)
        correct.append(n_correct)
    mtp = sum(w * term for w, term in zip(weights, terms[1:]))
    # MTP-only: the main CE is reported but carries no gradient, so it stays out of the objective
    return _output(mtp if cfg.mtp_only else terms[0] + mtp, sums, valid, correct)


def _output(loss: Tensor, sums: list[Tensor], valid: list[Tensor], correct: list[Tensor]) -> LossOutput:
    """The LossOutput of an objective and, per head (main first), its CE sum, valid targets and correct top-1."""
    counts = torch.stack(valid + correct).tolist()  # one host sync for every count
    valid_n, correct_n = counts[: len(valid)], counts[len(valid) :]
    means = [s / max(n, 1) for s, n in zip(sums, valid_n)]
    accuracy = [c / max(n, 1) for c, n in zip(correct_n, valid_n)]
    return LossOutput(loss, means[0], means[1:], accuracy[1:], valid_n[0], valid_n[1:])


def tau_sim(accuracy: list[float]) -> float:
    """Simulated mean acceptance length 1 + sum_k prod_{j<=k} acc_j from teacher-forced per-depth accuracies
    (NeMo AutoModel's training-time estimate): depth k's draft is kept only if every earlier one was."""
    total, run = 1.0, 1.0
    for a in accuracy:
        run *= a
        total += run
    return total
