"""Verification: the trunk checks a step's drafts in one forward and keeps what speculative decoding's rules
accept, whoever drafted them. A chain is verified in order; a draft tree (`decode/tree.py`) is a verify shape: the
chain plus each position's alternatives under a tree mask, accepted as the chain and then one alternative.

Acceptance follows speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): accept draft d with probability min(1, p(d)/q(d)), on the first rejection draw from
normalize(max(p - q, 0)), and when every draft is accepted draw a bonus token from p. The output distribution
is then exactly the trunk's. Greedy decoding is the limit: accept while the draft equals the trunk's argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tree
from .drafters.base import Drafts, Verified
from .sampling import SamplingParams, probs, sample
from .state import DecodeState


def verify(model, state: DecodeState, drafts: Drafts, *, params: SamplingParams, generator) -> Verified:
    """The drafts of every row checked in one trunk forward: a draft tree's when they carry widths, else a chain's."""
    check = verify_tree if drafts.widths else verify_chain
    return check(model, state, drafts, params=params, generator=generator)


def verify_chain(model, state: DecodeState, drafts: Drafts, *, params: SamplingParams, generator) -> Verified:
    """Verify [last, drafts] in one trunk forward at slots slot..slot+K, accept (greedy or speculative sampling)
    and roll the GDN state back to the last accepted token. A gated batch verifies K+1 positions for every row
    (one forward; shorter rows' padding is never accepted)."""
    K = drafts.tokens.shape[1]
    slots = state.slots(K + 1)
    with state.cache.verifying():
        out = model(torch.cat([state.last[:, None], drafts.tokens], 1), positions=state.rope_positions(slots),
                    cache=state.cache, cache_positions=slots, kv_len=state.top_slot + K + 1)
    if params.greedy:
        accepted, tokens = accept_greedy(drafts.tokens, out.logits, drafts.count)
    else:
        accepted, tokens = accept_sampling(drafts.tokens, drafts.q, probs(out.logits, params), generator, drafts.count)
    state.cache.commit(accepted + 1)  # GDN layers continue from the state after the last accepted token
    return Verified(accepted, tokens, out.hidden)


def verify_tree(model, state: DecodeState, drafts: Drafts, *, params: SamplingParams, generator) -> Verified:
    """Verify the chain and its alternatives in one trunk forward under the tree mask, accept (the chain as
    `verify_chain` does, then an alternative equal to the token emitted at the first rejection) and move the
    accepted alternative's K/V into line; the hidden returned follows the kept path."""
    K = drafts.tokens.shape[1]
    device = drafts.tokens.device
    shape = tree.layout(drafts.widths + (1,) * (K - len(drafts.widths)), device)
    alternatives = drafts.tokens[:, :0] if drafts.alternatives is None else drafts.alternatives
    ids = torch.cat([state.last[:, None], drafts.tokens, alternatives], 1)  # [B, T] in layout order
    slots = state.slots(shape.size)
    positions = state.rope_positions(state.slot[:, None] + shape.depth)
    out = model(ids, positions=positions, cache=state.cache, cache_positions=slots,
                kv_len=state.top_slot + shape.size, tree=shape.mask)
    chain = slice(0, K + 1)
    if params.greedy:
        accepted, tokens = accept_greedy(drafts.tokens, out.logits[:, chain], drafts.count)
    else:
        p = probs(out.logits, params)  # [B, T, V]
        accepted, tokens = accept_sampling(drafts.tokens, drafts.q, p[:, chain], generator, drafts.count)
    rows = torch.arange(state.batch, device=device)
    # the alternatives at the first rejected depth (accepted + 1), hanging off chain node `accepted`
    nodes = shape.alternatives[accepted.clamp(max=K - 1)]  # [B, W - 1]
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
    return Verified(accepted, tokens, hidden, leaf)


def proposed(count: torch.Tensor, K: int) -> torch.Tensor:
    """[B, K] bool: the draft positions each row proposed (its first count[b]; the rest of a gated batch's
    drafts are padding, never accepted)."""
    return torch.arange(K, device=count.device) < count[:, None]


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, K] (row b proposed the first count[b]), trunk logits [B, K+1, V] -> accepted counts [B] and
    tokens [B, K+1], of which the first accepted+1 are emitted: the accepted drafts (equal to the trunk's argmax)
    and the trunk's own next token."""
    target = logits.argmax(dim=-1)
    accepted = ((drafts == target[:, :-1]) & proposed(count, drafts.shape[1])).long().cumprod(dim=1).sum(dim=1)
    return accepted, target


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) per row of [B, V]: the distribution to draw from after a rejection."""
    r = (p - q).clamp_min(0)
    mass = r.sum(dim=-1, keepdim=True)
    # zero mass only by rounding when p == q, where a rejection has (almost) no probability: fall back to p
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def accept_sampling(drafts, q, p, generator, count) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, K] (row b proposed the first count[b]), draft distributions q [B, K, V], trunk distributions
    p [B, K+1, V] -> accepted counts [B], tokens [B, K+1] (first accepted+1 emitted): drafts accepted with
    probability min(1, p/q), then one draw from the residual after the first rejection, or from p after the row's
    last draft (the bonus token)."""
    B, K = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    p_d = p[:, :K].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0]  # > 0: each draft was drawn from q
    u = torch.rand(B, K, generator=generator, device=p.device)
    accepted = ((u * q_d < p_d) & proposed(count, K)).long().cumprod(dim=1).sum(dim=1)
    # no draft after a row's last one: q = 0 there, so the residual is p
    q_next = F.pad(q, (0, 0, 0, 1))[rows, accepted] * (accepted < count)[:, None]
    fix = sample(residual(p[rows, accepted], q_next), generator)
    tokens = F.pad(drafts, (0, 1)).scatter(1, accepted[:, None], fix[:, None])
    return accepted, tokens
