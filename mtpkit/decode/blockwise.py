"""Blockwise parallel decoding (Stern et al. 2018) with parallel heads (Gloeckle et al. 2024; models/
parallel_heads.py): a step's k drafts come from heads 1..k at the last verified position, all at once, and the
trunk verifies them as it verifies the sequential MTP's (`speculative.verify`: the same greedy and
speculative-sampling acceptance, so the output is lossless). Each draft's q is its head's distribution, which
depends only on verified tokens: a valid draft distribution for speculative sampling.

Each head keeps its own KV cache (`Cache.mtp[j - 1]`) at the trunk's slots. After verification the heads run once
over the K+1 verified rows and row n (the last token kept) holds the next step's drafts; rows past n write stale
slots that later steps overwrite, as in the trunk's cache. Cost per step: the trunk forward over K+1 rows, k head
layers over those K+1 rows, and one lm_head product over k rows per sequence; no sequential draft steps.
Memory: one attention layer's KV cache per head.
"""

from __future__ import annotations

import torch

from ..models.parallel_heads import head_outputs
from . import speculative as spec
from .sampling import SamplingParams
from .state import DecodeState, StepResult


def draft(hidden: torch.Tensor, head: spec.DraftHead, generator) -> spec.Drafts:
    """hidden [B, k, H]: heads 1..k's outputs at the last verified position -> every head's draft at once. With
    gating a row proposes its drafts up to its first unconfident one, as the sequential path does; without,
    count = K = k."""
    B, k, H = hidden.shape
    ids, q, sure, _ = head(hidden.reshape(B * k, H), generator)  # one lm_head product for every head
    drafts, q = ids.view(B, k), None if q is None else q.view(B, k, -1)
    if sure is None:
        return spec.Drafts(drafts, q, torch.full((B,), k, dtype=torch.long, device=hidden.device))
    count = 1 + sure.view(B, k)[:, :-1].long().cumprod(dim=1).sum(dim=1)
    K = int(count.max())
    return spec.Drafts(drafts[:, :K], None if q is None else q[:, :K], count)


def step(model, state: DecodeState, *, k: int, head: spec.DraftHead, params: SamplingParams,
         generator) -> StepResult:
    """One blockwise step for every row, as `speculative.step`; `state.draft_hidden` [B, k, H] holds heads 1..k at
    slot - 1 (the last verified token's row), and the result's at the last accepted row."""
    drafts = draft(state.draft_hidden, head, generator)
    accepted, tokens, hidden = spec.verify(model, state, drafts, params=params, generator=generator)
    slots = state.slots(hidden.shape[1])
    outputs = head_outputs(model, hidden, state.rope_positions(slots), k, state.cache.mtp, slots,
                           kv_len=state.top_slot + hidden.shape[1])  # [B, K+1, k, H]
    rows = torch.arange(state.batch, device=accepted.device)
    return StepResult(accepted, drafts.count, tokens, outputs[rows, accepted])
