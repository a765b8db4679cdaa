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


def draft(m: torch.Tensor, head: spec.DraftHead, generator):
    """m [B, k, H]: heads 1..k at the last verified position -> drafts [B, K], q [B, K, V] (None when greedy) and
    each row's number of drafts count [B] (K = max(count)). With gating a row proposes its drafts up to its first
    unconfident one, as the sequential path does; without, count = K = k."""
    B, k, H = m.shape
    ids, q, sure = head(m.reshape(B * k, H), generator)  # one lm_head product for every head
    drafts, q = ids.view(B, k), None if q is None else q.view(B, k, -1)
    if sure is None:
        return drafts, q, torch.full((B,), k, dtype=torch.long, device=m.device)
    count = 1 + sure.view(B, k)[:, :-1].long().cumprod(dim=1).sum(dim=1)
    K = int(count.max())
    return drafts[:, :K], None if q is None else q[:, :K], count


def step(model, cache, last, pos, delta, m, top: int, k: int, head: spec.DraftHead, params: SamplingParams,
         generator):
    """One blockwise step for every row, with `speculative.step`'s arguments and returns; m [B, k, H]: heads 1..k
    at slot pos-1 (the last verified token's row), and the next m at the last accepted row."""
    drafts, q, count = draft(m, head, generator)
    n, tokens, hidden = spec.verify(model, cache, last, pos, delta, top, drafts, q, count, params, generator)
    slots = pos[:, None] + torch.arange(hidden.shape[1], device=pos.device)
    ext = head_outputs(model, hidden, slots + delta[:, None], k, cache.mtp, slots, kv_len=top + hidden.shape[1])
    return n, count, tokens, ext[torch.arange(n.shape[0], device=n.device), n]  # [B, k, H]
