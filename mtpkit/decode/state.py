"""What each decoding row carries from one step to the next (`DecodeState`), and what a step returns (`StepResult`).

Row b of every tensor is batch row b. When rows stop, `select` keeps the live ones, so the per-row tensors and the
cache can never fall out of step with each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .cache import Cache


class StepResult(NamedTuple):
    accepted: torch.Tensor  # [B] drafts accepted (0 without drafting)
    drafted: torch.Tensor  # [B] drafts proposed (fewer than k when drafting is gated)
    tokens: torch.Tensor  # [B, K+1] of which the first accepted+1 are emitted; K = the longest row's drafts
    drafter_state: torch.Tensor | None  # the next state's `drafter_state`
    alternative: torch.Tensor | None = None  # [B] bool, draft trees: the last accepted draft was an alternative
    trunk_hidden: torch.Tensor | None = None  # [B, H] plain steps: the trunk's post-norm hidden at `last`


@dataclass
class DecodeState:
    cache: Cache
    last: torch.Tensor  # [B] the last sampled token, not yet in the cache
    slot: torch.Tensor  # [B] the cache slot `last` goes to (= tokens already in the cache)
    slot_host: list[int]  # `slot` on the host, so that no forward reads it back
    rope_delta: torch.Tensor  # [B] rope position - slot: 0 for text, MRoPE's offset after an image
    # [B, ...] what the drafter drafts the next step from (its `advance`'s result; None: it keeps none), e.g. the
    # MTP's output at slot - 1
    drafter_state: torch.Tensor | None

    @property
    def batch(self) -> int:
        return len(self.slot_host)

    @property
    def top_slot(self) -> int:
        """The highest row's slot: a forward over T tokens reads the first top_slot + T cache slots."""
        return max(self.slot_host)

    def slots(self, count: int, offset: int = 0) -> torch.Tensor:
        """[B, count]: each row's cache slots from slot + offset on."""
        return self.slot[:, None] + offset + torch.arange(count, device=self.slot.device)

    def rope_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Rope positions [B, T] of the tokens at cache slots [B, T]."""
        return slots + self.rope_delta[:, None]

    def select(self, rows: list[int]) -> DecodeState:
        """The state of batch rows `rows` only (the cache is copied down to them)."""
        idx = torch.tensor(rows, device=self.slot.device)
        return DecodeState(
            cache=self.cache.rows(idx),
            last=self.last[idx],
            slot=self.slot[idx],
            slot_host=[self.slot_host[b] for b in rows],
            rope_delta=self.rope_delta[idx],
            drafter_state=None if self.drafter_state is None else self.drafter_state[idx],
        )

    def advanced(self, step: StepResult, accepted_host: list[int]) -> DecodeState:
        """The state after `step` emitted its first accepted+1 tokens per row (accepted_host: `step.accepted` as
        read on the host): the last of them is the new `last`, and the cache now holds the tokens before it."""
        return DecodeState(
            cache=self.cache,
            last=step.tokens.gather(1, step.accepted[:, None])[:, 0],
            slot=self.slot + step.accepted + 1,
            slot_host=[s + a + 1 for s, a in zip(self.slot_host, accepted_host)],
            rope_delta=self.rope_delta,
            drafter_state=step.drafter_state,
        )
