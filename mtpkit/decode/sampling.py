"""Token selection: logits -> the distribution plain sampling draws from (temperature, top-k, top-p), and draws.

Speculative sampling is exact only if the target p and the draft q are built by the very same transform, so
every path (plain decoding, drafting, verification) goes through `probs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for no limit), not {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering."""
    x = logits.float() / params.temperature
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
