"""Which implementation a kernel took, logged once per process (logger "mtpkit")."""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("mtpkit")


@functools.cache
def _once(message: str) -> None:
    logger.info(message)


def log_path(message: str) -> None:
    if not torch.compiler.is_compiling():  # compiled steps leave it to an eager call: a cached call breaks the graph
        _once(message)
