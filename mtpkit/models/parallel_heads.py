"""Parallel multi-token heads (Gloeckle et al. 2024) on the shared trunk: training with the sequential per-head
forward/backward, and greedy drafts for blockwise parallel decoding (Stern et al. 2018).

Head j (0-based) predicts token t+1+j from the trunk at t. Head 0 is the trunk itself (its last layer, final
norm and lm_head), so a pretrained model keeps its exact next-token distribution, which is also the verifier's.
Heads 1..n-1 are one full-attention decoder layer each, then the trunk's final norm and the shared unembedding.

The heads read the trunk's post-final-norm hidden (`ModelOutput.hidden`), not Gloeckle's pre-norm residual
stream: it is the tensor CausalLM returns in training and in the verify forward alike, and what the sequential
MTP module reads too (mtp-reference.md section 1). Each head's input_layernorm renormalises it anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from ..train.chunked_ce import chunked_cross_entropy
from ..train.loss import IGNORE, mtp_targets
from .block import DecoderLayer
from .config import ModelConfig
from .init import init_weights
from .transformer import segment_positions


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


def parallel_heads_loss_backward(model, heads: ParallelHeads, batch: dict, ce_chunk_tokens: int = 2048) -> dict:
    """Backpropagate sum_j (mean CE of head j), one head at a time (Gloeckle et al. 2024, section 2): the trunk
    runs once and its output becomes a leaf; each head's forward, chunked CE and backward accumulate the gradient
    at that leaf; one backward then carries it through the trunk. Only one head's activations are alive at a time.

    batch: input_ids, labels (train.loss.shift_labels), optional segment_ids and positions, all [B, T].
    Returns {"head_j": detached mean CE} (head_0: the trunk's next-token loss).
    """
    ids, labels, seg = batch["input_ids"], batch["labels"], batch.get("segment_ids")
    pos = batch.get("positions")
    if pos is None:
        B, T = ids.shape
        pos = segment_positions(seg) if seg is not None else torch.arange(T, device=ids.device).expand(B, T)
    out = model(ids, positions=pos, segment_ids=seg, return_logits=False)
    leaf = out.hidden.detach().requires_grad_()  # [B, T, H]
    ctx = model.context(pos, seg, dtype=leaf.dtype)
    losses = {}
    for j in range(heads.n):
        targets = labels if j == 0 else mtp_targets(labels, seg, j)  # [B, T-j]: same roll as MTP depth j
        h = (leaf if j == 0 else heads(model, leaf, ctx, j))[:, : targets.shape[1]]
        loss_sum, n_valid, _ = chunked_cross_entropy(
            h.reshape(-1, h.shape[-1]), model.output_weight, targets.reshape(-1), ce_chunk_tokens, IGNORE
        )
        loss = loss_sum / n_valid.clamp(min=1)
        loss.backward()  # frees head j's graph; the leaf, the heads and lm_head accumulate their gradients
        losses[f"head_{j}"] = loss.detach()
    out.hidden.backward(leaf.grad)
    return losses


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
    if caches is None:
        ctx = model.context(positions, dtype=hidden.dtype)
    else:
        cache_positions = positions if positions.dim() == 2 else positions[0]
        ctx = model.context(positions, cache=caches[0], cache_positions=cache_positions, dtype=hidden.dtype)
    outs = [
        heads(model, hidden, ctx, j, None if caches is None else caches[j - 1])[:, -1] for j in range(1, heads.n)
    ]
    logits = model.logits(torch.stack(outs, dim=1))  # [B, n-1, V]
    return logits, logits.argmax(-1)
