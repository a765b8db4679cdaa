"""Parallel heads (Gloeckle et al. 2024; models/parallel_heads.py) as a drafter: blockwise parallel decoding (Stern
et al. 2018). A step's k drafts come from heads 1..k at the last verified position, all at once; each draft's q
is its head's distribution, which depends only on verified tokens: a valid draft distribution for speculative
sampling.

Each head keeps its own KV cache (`Cache.mtp[j - 1]`) at the trunk's slots. After verification the heads run once
over the K+1 verified rows and row n (the last token kept) holds the next step's drafts; rows past n write stale
slots that later steps overwrite, as in the trunk's cache. Cost per step: the trunk forward over K+1 rows, k head
layers over those K+1 rows, and one lm_head product over k rows per sequence; no sequential draft steps.
Memory: one attention layer's KV cache per head. The drafter state is heads 1..k's outputs [B, k, H] at slot - 1.
"""

from __future__ import annotations

import torch

from ...models.parallel_heads import head_outputs
from ..draft_head import DraftHead
from ..state import DecodeState
from .base import Drafts, DraftSetup, Prefill, Verified


def draft(hidden: torch.Tensor, head: DraftHead, generator) -> Drafts:
    """hidden [B, k, H]: heads 1..k's outputs at the last verified position -> every head's draft at once. With
    gating a row proposes its drafts up to its first unconfident one, as the sequential MTP does; without,
    count = K = k."""
    B, k, H = hidden.shape
    ids, q, sure, _, _ = head(hidden.reshape(B * k, H), generator)  # one lm_head product for every head
    drafts, q = ids.view(B, k), None if q is None else q.view(B, k, -1)
    if sure is None:
        return Drafts(drafts, q, torch.full((B,), k, dtype=torch.long, device=hidden.device))
    count = 1 + sure.view(B, k)[:, :-1].long().cumprod(dim=1).sum(dim=1)
    K = int(count.max())
    return Drafts(drafts[:, :K], None if q is None else q[:, :K], count)


class ParallelHeads:
    def __init__(self, model, head: DraftHead, generator, k: int):
        self.model, self.head, self.generator, self.k = model, head, generator, k

    def prefill(self, run: Prefill) -> torch.Tensor:
        heads = head_outputs(self.model, run.hidden, run.positions, self.k, run.cache.mtp, run.slots,
                             kv_len=run.slots.shape[1])  # [b, T, k, H]
        return heads[:, -1]

    def propose(self, state: DecodeState, rows: list[int], depths: int | None = None) -> Drafts:
        return draft(state.drafter_state, self.head, self.generator)

    def advance(self, state: DecodeState, verified: Verified) -> torch.Tensor:
        hidden = verified.hidden
        slots = state.slots(hidden.shape[1])
        outputs = head_outputs(self.model, hidden, state.rope_positions(slots), self.k, state.cache.mtp, slots,
                               kv_len=state.top_slot + hidden.shape[1])  # [B, K+1, k, H]
        return outputs[torch.arange(state.batch, device=outputs.device), verified.accepted]

    def emitted(self, row: int, tokens: list[int]) -> None:
        pass


def build(setup: DraftSetup, drafter):
    """Drafts with the parallel heads when the spec asks for draft tokens and the model has them."""
    k, model = setup.spec.draft_tokens, setup.model
    if not k or model.mtp_heads is None:
        return drafter
    return ParallelHeads(model, setup.head, setup.generator, k)
