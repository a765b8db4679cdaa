"""Training: the MTP objective (targets, weights, schedules, chunked cross-entropy)."""

from .chunked_ce import chunked_cross_entropy
from .loss import (
    IGNORE,
    LossConfig,
    LossOutput,
    compute_loss,
    count_tokens,
    depth_weights,
    freeze_trunk,
    mtp_targets,
    shift_labels,
)

__all__ = [
    "IGNORE",
    "LossConfig",
    "LossOutput",
    "chunked_cross_entropy",
    "compute_loss",
    "count_tokens",
    "depth_weights",
    "freeze_trunk",
    "mtp_targets",
    "shift_labels",
]
