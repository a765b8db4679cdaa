"""Parallel multi-token heads (Gloeckle et al. 2024) on the shared trunk, and greedy drafts for blockwise parallel
decoding (Stern et al. 2018). Training with the sequential per-head backward: `mtpkit.train.parallel_heads_loss`.

Head j (0-based) predicts token t+1+j from the trunk at t. Head 0 is the trunk itself (its last layer, final
norm and lm_head), so a pretrained model keeps its exact next-token distribution, which is also the verifier's.
Heads 1..n-1 are one full-attention decoder layer each, then the trunk's final norm and the shared unembedding.

The heads read the trunk's post-final-norm hidden (`ModelOutput.hidden`), not Gloeckle's pre-norm residual
stream: it is the tensor CausalLM returns in training and in the verify forward alike, and what the sequential
MTP module reads too (docs/MTP.md section 2). Each head's input_layernorm renormalises it anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from .block import DecoderLayer
from .config import ModelConfig
from .init import init_weights


class ParallelHeads(nn.Module):
    """n heads in all: head 0 is the trunk, heads 1..n-1 are `layers[j - 1]`."""

    def __init__(self, config: ModelConfig, n: int):
        super().__init__()
        if n < 2:
            raise ValueError(f"n counts the trunk's own head too and must be >= 2, not {n}")
        self.n = n
        self.layers = nn.ModuleList(DecoderLayer(config, "full_attention", moe=False) for _ in range(n - 1))
        init_weights(self)

    def forward(self, model, hidden: torch.Tensor, ctx, j: int, cache=None) -> torch.Tensor:
        """Head j >= 1 on the trunk's hidden [B, T, H] -> [B, T, H] after the trunk's final norm (row i predicts
        token i+1+j); model.logits of it are the head's logits."""
        return model.model.norm(self.layers[j - 1](hidden, ctx, cache))


@torch.no_grad()
def draft(heads: ParallelHeads, model, hidden: torch.Tensor, positions: torch.Tensor, caches=None):
    """Greedy drafts of tokens t+2..t+n from heads 1..n-1 at the last verified position t (the last column of
    `hidden`); the trunk's own argmax there is token t+1 (blockwise parallel decoding, Stern et al. 2018).

    hidden [B, T, H]: the trunk's post-norm hidden at positions [B, T] (or MRoPE [3, B, T]). The heads attend
    over earlier positions, so pass either the whole sequence (caches=None), or, with one
    `mtpkit.decode.cache.KVCache` per head 1..n-1, just the rows they have not seen yet: those are written at
    their positions, and stale slots past them (rejected drafts) are masked and later overwritten.
    Returns (logits [B, n-1, V], tokens [B, n-1]).
    """
    ctx = model.context(positions, cache=None if caches is None else caches[0], dtype=hidden.dtype)
    outs = [
        heads(model, hidden, ctx, j, None if caches is None else caches[j - 1])[:, -1] for j in range(1, heads.n)
    ]
    logits = model.logits(torch.stack(outs, dim=1))  # [B, n-1, V]
    return logits, logits.argmax(-1)
