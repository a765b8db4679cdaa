"""Draft trees: the MTP's chain of drafts and, at each draft position d, the head's next w_d - 1 most likely tokens
as leaves, all verified in one trunk forward under a tree attention mask.

A chain step ends at its first rejected draft. A head that misses at position d often still ranks the trunk's
token 2nd or 3rd (the shipped SmolLM2 head, first position: top 1 37%, top 3 53%; docs/MTP.md section 4), so
verifying those tokens as well keeps one more token where the chain fails, for a few more tokens in the verify
forward. The tree shape follows the draft's ranking as Medusa's and EAGLE-2's trees do (Cai et al. 2024; Li et
al. 2024); here only the chain is extended by the MTP, so drafting costs what the chain costs and leaves are never
drafted from.

Layout of the T = 1 + K + sum_d (w_d - 1) tokens verified (K chain drafts): node 0 is the last emitted token (the
root), nodes 1..K the chain (node d at depth d), then the alternatives of depth 1, of depth 2, ...; an
alternative at depth d hangs off chain node d - 1. Node i is written to cache slot slot + i and has rope position
slot + depth(i); when an alternative is accepted its K/V are copied to slot + depth, where the next step reads
them. Gated DeltaNet layers read tokens in order and cannot branch, so trees need a trunk of attention layers
(Llama, Qwen3, Qwen3-VL); Qwen3.5 and Qwen3-Next verify chains.

Lossless: the chain is accepted exactly as without a tree (`verify.accept_greedy` / `accept_sampling`), which
emits one more token t at the first rejection, the trunk's argmax or a draw from the residual. If t is one of the
alternatives at that depth, the trunk's distribution after t was computed in the same forward, so the next token is
taken from it as the bonus. The emitted tokens are those the chain algorithm emits, one token further. For fixed
alternatives this is SpecInfer's multi-draft speculative sampling (Miao et al. 2024): testing them one by one
against the residual r, accepting s with probability r(s) and renormalising r without it, accepts s with total
probability r(s), the chance that the draw t is s.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch



class Tree(NamedTuple):
    size: int  # T: the root, the chain and the alternatives
    depth: torch.Tensor  # [T] draft position of each node (0: the root)
    mask: torch.Tensor  # [T, T] bool: node i attends to node j (j is i or an ancestor of i)
    alternatives: torch.Tensor  # [K, W - 1] the alternative nodes hanging off chain node d (-1: none), W = max width


@lru_cache(maxsize=64)
def layout(widths: tuple[int, ...], device: torch.device | str = "cpu") -> Tree:
    """The tree of a chain of K = len(widths) drafts with widths[d - 1] tokens at depth d, its tensors on `device`
    (built once per shape and device)."""
    K, W = len(widths), max(widths)
    depth, parent = list(range(K + 1)), list(range(-1, K))
    alternatives = torch.full((K, W - 1), -1, dtype=torch.long)
    for d, w in enumerate(widths, 1):
        for j in range(w - 1):
            alternatives[d - 1, j] = len(depth)
            depth.append(d)
            parent.append(d - 1)
    T = len(depth)
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(T):
        j = parent[i]
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return Tree(T, torch.tensor(depth, device=device), mask.to(device), alternatives.to(device))


def normalize_widths(widths, k: int) -> tuple[int, ...]:
    """Widths per draft position for k drafts: cut to k, positions past the list width 1, trailing 1s dropped
    (() is a chain). Raises on widths < 1."""
    widths = tuple(int(w) for w in widths)
    if any(w < 1 for w in widths):
        raise ValueError(f"draft widths must be >= 1 per draft position (1: the chain's draft only), not {widths}")
    widths = widths[:k]
    while widths and widths[-1] == 1:
        widths = widths[:-1]
    return widths


def verified_tokens(widths: tuple[int, ...], drafts: int) -> int:
    """Tokens in the verify forward of a step that drafted `drafts` tokens: 1 + drafts + their alternatives."""
    return 1 + drafts + sum(w - 1 for w in widths[:drafts])
