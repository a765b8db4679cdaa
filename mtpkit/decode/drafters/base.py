"""The drafting seam: what a drafter proposes (`Drafts`), what it is told (`Prefill`, `Verified`) and the calls
`generate` makes on it (`Drafter`), in the shape of vLLM's proposers.

A step is propose -> verify (`decode/verify.py`, the same acceptance rules whoever drafted) -> advance. A drafter's
per-row state lives in `DecodeState.drafter_state` (batch first, so the state's row selection keeps it in step
with the cache), its caches in `Cache.mtp`, and anything it keeps on the host is indexed by the prompt's row.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ..state import DecodeState


class Drafts(NamedTuple):
    tokens: torch.Tensor  # [B, K] (K = max(count) <= the most a step drafts)
    q: torch.Tensor | None  # [B, K, V] the draft distributions over the full vocabulary; None when greedy
    count: torch.Tensor  # [B] drafts each row proposed: its first count[b] (the rest of a gated batch's are padding)
    # [B, sum(w_d - 1) over d <= len(widths)]: the alternatives of a draft tree, depth 1's first; None for a chain
    alternatives: torch.Tensor | None = None
    widths: tuple[int, ...] = ()  # the draft tree's tokens per position that `alternatives` hold (() for a chain)
    looked_up: list[bool] | None = None  # per row, on the host: its drafts came from the context (statistics)
    confidence: torch.Tensor | None = None  # [B, K] the head's probability of each draft (None: not the head's)


class Prefill(NamedTuple):
    """One prefill forward over rows of equal length (`generate`'s prefill runs)."""

    hidden: torch.Tensor  # [b, T, H] the trunk's post-norm output over the prompts
    embeds: torch.Tensor  # [b, T, H] the trunk's input embeddings (a vision embedding at an image token)
    positions: torch.Tensor  # rope positions of the prompts' tokens
    first: torch.Tensor  # [b] the token sampled after each prompt
    cache: object  # the rows' view of the cache (`Cache.rows`)
    slots: torch.Tensor  # [b, T] the prompts' cache slots


class Verified(NamedTuple):
    """What a verify forward kept, per row."""

    accepted: torch.Tensor  # [B] drafts accepted (a draft tree's accepted alternative included)
    tokens: torch.Tensor  # [B, K+1] of which the first accepted+1 are emitted
    hidden: torch.Tensor  # [B, K+1, H] the trunk's output at the root and each kept token, in emission order
    alternative: torch.Tensor | None = None  # [B] bool, draft trees: the last accepted token was an alternative


class Drafter(Protocol):
    def prefill(self, run: Prefill) -> torch.Tensor | None:
        """The rows' drafter state after their prompts, [b, ...] (None: the drafter keeps none)."""

    def propose(self, state: DecodeState, rows: list[int], depths: int) -> Drafts | None:
        """Each live row's drafts for this step, at most `depths` deep from a chain; rows: the prompt row of each
        batch row. None: nothing to verify, the step decodes plainly."""

    def advance(self, state: DecodeState, verified: Verified) -> torch.Tensor | None:
        """After verification, before the state moves on: the next drafter state [B, ...], at the last kept token's
        predecessor."""

    def emitted(self, row: int, tokens: list[int]) -> None:
        """Prompt row `row` emitted `tokens` (on the host, after its stop conditions)."""


class DraftSetup(NamedTuple):
    """What the registry's builders choose and build drafters from."""

    model: object
    spec: object  # the `DraftSpec`
    head: object  # the `DraftHead` (None without draft_tokens)
    params: object  # the `SamplingParams`
    generator: torch.Generator
    prompts: list[list[int]]  # each row's prompt ids
