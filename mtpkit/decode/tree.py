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

Lossless: the chain is accepted exactly as without a tree (`speculative.accept_greedy` / `accept_sampling`), which
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

from . import speculative as spec
from .lookup import ContextDrafts
from .sampling import SamplingParams, probs, sample
from .state import DecodeState, StepResult


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


def step(model, state: DecodeState, *, k: int, widths: tuple[int, ...], head: spec.DraftHead,
         params: SamplingParams, generator, context: ContextDrafts | None = None) -> StepResult:
    """One tree step for every row: draft the chain and its alternatives (the chain from the context where a row
    found one: `context`), verify the tree in one trunk forward, accept (the chain as `speculative.verify` does,
    then an alternative equal to the token emitted at the first rejection), move the accepted alternative's K/V
    into line and run the MTP over the accepted path."""
    drafts = spec.draft(model, state, k=k, head=head, generator=generator, widths=widths, context=context)
    K = drafts.tokens.shape[1]
    device = drafts.tokens.device
    tree = layout(drafts.widths + (1,) * (K - len(drafts.widths)), device)
    alternatives = drafts.tokens[:, :0] if drafts.alternatives is None else drafts.alternatives
    ids = torch.cat([state.last[:, None], drafts.tokens, alternatives], 1)  # [B, T] in layout order
    slots = state.slots(tree.size)
    positions = state.rope_positions(state.slot[:, None] + tree.depth)
    out = model(ids, positions=positions, cache=state.cache, cache_positions=slots,
                kv_len=state.top_slot + tree.size, tree=tree.mask)
    chain = slice(0, K + 1)
    if params.greedy:
        accepted, tokens = spec.accept_greedy(drafts.tokens, out.logits[:, chain], drafts.count)
    else:
        p = probs(out.logits, params)  # [B, T, V]
        accepted, tokens = spec.accept_sampling(drafts.tokens, drafts.q, p[:, chain], generator, drafts.count)
    rows = torch.arange(state.batch, device=device)
    # the alternatives at the first rejected depth (accepted + 1), hanging off chain node `accepted`
    nodes = tree.alternatives[accepted.clamp(max=K - 1)]  # [B, W - 1]
    emitted = tokens[rows, accepted]
    hit = (nodes >= 0) & (ids.gather(1, nodes.clamp_min(0)) == emitted[:, None]) & (accepted < drafts.count)[:, None]
    leaf = hit.any(dim=1)
    node = (nodes.clamp_min(0) * hit).sum(dim=1)  # the alternative that was emitted (they are distinct ids)
    after = out.logits[rows, node].argmax(dim=-1) if params.greedy else sample(p[rows, node], generator)
    nxt = (accepted + 1).clamp(max=K)
    tokens[rows, nxt] = torch.where(leaf, after, tokens[rows, nxt])
    path = torch.arange(K + 1, device=device).expand(state.batch, -1).clone()  # the verified node of each kept token
    path[rows, nxt] = torch.where(leaf, node, path[rows, nxt])
    accepted = accepted + leaf
    # a kept leaf's K/V to the slot after the chain tokens before it; most steps keep none, and on CPU asking costs
    # nothing (the copy is ~30 index writes, ~0.7 ms a SmolLM2 step), while on a GPU it would add a device read
    if leaf.device.type != "cpu" or bool(leaf.any()):
        state.cache.copy_slots(state.slot + torch.where(leaf, node, nxt), state.slot + nxt)
    hidden = out.hidden.gather(1, path[..., None].expand(-1, -1, out.hidden.shape[-1]))  # [B, K+1, H]
    mtp_out = spec.mtp_extend(model, state, hidden, tokens)
    return StepResult(accepted, drafts.count, tokens, mtp_out[rows, accepted], leaf)
