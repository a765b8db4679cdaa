"""Training: the MTP objective (targets, weights, schedules, chunked cross-entropy)."""

from .chunked_ce import chunked_cross_entropy
from .loss import (
    IGNORE,
    LossOutput,
    Targets,
    compute_loss,
    depth_weights,
    freeze_trunk,
    loss_targets,
    mtp_targets,
    shift_labels,
)

__all__ = [
    "IGNORE",
    "LossOutput",
    "Targets",
    "chunked_cross_entropy",
    "compute_loss",
    "depth_weights",
    "freeze_trunk",
    "loss_targets",
    "mtp_targets",
    "shift_labels",
]
