"""Causal attention over packed rows (several documents one after another in a row, told apart by segment ids),
computed in blocks of queries that each read only the keys their documents reach.

A dense [B, 1, T, T] mask makes SDPA score every query against every key, T^2 per row however short the documents
are (and takes T^2 bytes per row to hold). Here a block of queries [a, b) attends to keys [lo, b), where lo is the
first position of the document that holds position a (the earliest any query of the block reaches) rounded down to
a multiple of the block, with the mask of that slice: the same result (masked keys add exactly zero), at about
T x (block + document length) for short documents and half of T^2 for one long document. The same idea as
FlashAttention's varlen kernels and flex_attention's block masks, in plain SDPA calls so that it runs (and
backpropagates) on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 256  # queries per SDPA call: smaller reads fewer masked keys, larger makes fewer calls


def contiguous_runs(segment_ids: Tensor) -> Tensor:
    """[B, T] index of each position's contiguous run of equal segment ids, so that a reused id never joins two
    documents."""
    change = torch.zeros_like(segment_ids, dtype=torch.long)
    change[:, 1:] = (segment_ids[:, 1:] != segment_ids[:, :-1]).long()
    return change.cumsum(1)


@dataclass
class PackedCausal:
    """The attention pattern of packed rows, causal inside each contiguous run of segment ids; stands in for the
    dense mask (`Attention` calls `attend`). Built once per forward and shared by every layer."""

    runs: Tensor  # [B, T] contiguous run index
    block_starts: list[int]  # per query block: its first key, a multiple of the block at or before the earliest
    # key any of its queries attends to, so that slices come in few sizes (varied sizes fragment the CPU's heap:
    # RSS grew ~170 MB a training step with exact starts)
    block: int = BLOCK

    @classmethod
    def from_segments(cls, segment_ids: Tensor, block: int = BLOCK) -> PackedCausal:
        runs = contiguous_runs(segment_ids)
        T = runs.shape[1]
        positions = torch.arange(T, device=runs.device).expand_as(runs)
        # a run's first position, for every position of it: positions never fall along a row, runs never rise back
        first = torch.where(F.pad(runs[:, 1:] != runs[:, :-1], (1, 0), value=True), positions, 0).cummax(1).values
        starts = first[:, ::block].min(0).values // block * block
        return cls(runs, starts.tolist(), block)  # one host sync per forward

    def dense(self) -> Tensor:
        """[B, 1, T, T] bool (True = attend): the same pattern as a dense mask."""
        T = self.runs.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.runs.device).tril()
        return ((self.runs[:, :, None] == self.runs[:, None, :]) & causal)[:, None]

    @torch.compiler.disable  # eager inside compiled blocks: traced, every packing's block starts would recompile
    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, Hq, T, D], k and v [B, Hkv, T, D] -> [B, Hq, T, D], as SDPA with `dense()` as its mask."""
        T = q.shape[2]
        outs = []
        for a, lo in zip(range(0, T, self.block), self.block_starts):
            b = min(a + self.block, T)
            keys = torch.arange(lo, b, device=q.device)
            mask = (self.runs[:, a:b, None] == self.runs[:, None, lo:b]) & (keys <= torch.arange(
                a, b, device=q.device)[:, None])  # [B, b - a, b - lo]
            outs.append(F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], attn_mask=mask[:, None],
                enable_gqa=q.shape[1] != k.shape[1]))
        return torch.cat(outs, dim=2)
