"""Token selection: logits -> the distribution plain sampling draws from (temperature, top-k, top-p), and draws.

Speculative sampling is exact only if the target p and the draft q are built by the very same transform, so
every path (plain decoding, drafting, verification) goes through `probs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        # NaN passes every comparison, so each check is written to fail for it
        if not (_is_real(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), not {self.temperature!r}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
                                           and self.top_k >= 1):
            raise ValueError(f"top_k must be >= 1, an integer (or None for no limit), not {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering.

    The largest logit is subtracted before dividing by the temperature (softmax does not change), so a tiny
    temperature (1e-40) gives all the mass to the top token(s), as its limit, greedy, does, instead of
    inf - inf = NaN; below fp32's smallest normal number (1.2e-38, where fp32 would round it to 0) it is already
    that limit and is clamped there."""
    x = logits.float()
    x = (x - x.amax(dim=-1, keepdim=True)) / max(params.temperature, torch.finfo(torch.float32).tiny)
    if params.top_k is not None and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        # keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays)
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(dim=-1)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= params.top_p
        x = x.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
    return x.softmax(dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of p [..., V] -> [...] long, without a host sync: argmax(p / E), E ~ Exp(1)
    (the exponential-race form of the Gumbel-max trick, as in gpt-fast)."""
    e = torch.empty_like(p).exponential_(1, generator=generator)
    return (p / e).argmax(dim=-1)


def select(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., V] -> token ids [...]: argmax when greedy, else a draw from `probs`."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(probs(logits, params), generator)
