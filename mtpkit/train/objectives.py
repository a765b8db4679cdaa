"""The training objective of each head kind (`mtp.kind`): what one micro-batch's loss is and how it is
backpropagated. Both compute main CE + sum_j w_j CE_j over the same targets, weights and normalisation
(`loss.compute_loss`); they differ in how the heads' graphs are held."""

from __future__ import annotations

from .config import MTPSection
from .loss import LossOutput, Targets, backward_outside_autocast, compute_loss
from .parallel_heads_loss import parallel_heads_loss


class SequentialMTP:
    """The sequential MTP module (and no MTP at all): one forward over the trunk and every depth, one backward."""

    one_process_only = None  # trains under FSDP2 and TP

    def __call__(self, model, batch: dict, cfg: MTPSection, targets: Targets, token_counts: list[int],
                 with_main: bool, train: bool) -> LossOutput:
        out = compute_loss(model, batch, cfg, targets, token_counts, with_main)
        if train:
            backward_outside_autocast(out.total)
        return out


class ParallelHeads:
    """Parallel heads: the trunk once, then each head's forward and backward in turn (`parallel_heads_loss`)."""

    one_process_only = ("mtp.kind = 'parallel' trains on one process for now (its per-head backward runs several "
                        "backward passes per step, untested with FSDP2 and TP): launch without torchrun")

    def __call__(self, model, batch: dict, cfg: MTPSection, targets: Targets, token_counts: list[int],
                 with_main: bool, train: bool) -> LossOutput:
        return parallel_heads_loss(model, batch, cfg, targets, token_counts, with_main, backward=train)


OBJECTIVES = {"sequential": SequentialMTP(), "parallel": ParallelHeads()}
