"""The one entry point for the model's linear layers, so that decoding can route thin products on CPU.

`linear(x, weight, bias)` is `F.linear` unless a router is active (`with routed_linears(router):`, set by the
decoder); the router then computes the same product the way that measured fastest on this machine for that
row count and weight shape (decode/matmul_routing.py). Within the same block a decoder layer over a cached step
first offers itself whole to the router (`routed_layer`: the fused layer op of kernels/decode_layer.py). Training
and every forward outside that block run plain `F.linear` and the layers' modules, the reference.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

_router: ContextVar = ContextVar("mtpkit_linear_router", default=None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # compiled code takes no router (a context variable would break its graph): routes are the eager CPU path's
    router = None if torch.compiler.is_compiling() else _router.get()
    return F.linear(x, weight, bias) if router is None else router(x, weight, bias)


def routed_layer(layer, x: torch.Tensor, ctx, cache) -> torch.Tensor | None:
    """The active router's fused computation of a whole decoder layer over a cached step (`router.layer`), or None
    when there is no router or it declines: the layer then runs its modules."""
    router = None if torch.compiler.is_compiling() else _router.get()
    return None if router is None or cache is None else router.layer(layer, x, ctx, cache)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose product goes through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@contextmanager
def routed_linears(router):
    """Within the block, `linear` calls `router(x, weight, bias)` instead of F.linear."""
    token = _router.set(router)
    try:
        yield
    finally:
        _router.reset(token)
