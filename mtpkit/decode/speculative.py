"""Self-speculative decoding with the model's own MTP module: draft by chaining it, verify with the trunk.

Acceptance follows speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): accept draft d with probability min(1, p(d)/q(d)), on the first rejection draw from
normalize(max(p - q, 0)), and when every draft is accepted draw a bonus token from p. The output distribution
is then exactly the trunk's. Greedy decoding is the limit: accept while the draft equals the trunk's argmax.

Position convention (vLLM's, docs/MTP.md section 2): the MTP row that predicts the token at position t+2 sees
the trunk hidden at t and the token at t+1, at position t; chained depth j adds j-1 to that position.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kernels.linear import linear
from .lookup import ContextDrafts
from .sampling import SamplingParams, probs, sample
from .state import DecodeState, StepResult


def frequent_tokens(token_ids: Iterable, n: int) -> torch.Tensor:
    """The n most frequent ids (most frequent first) in an iterable of ids or of id sequences (documents),
    to use as `draft_vocab`."""
    counts = Counter()
    for item in token_ids:
        counts.update(torch.as_tensor(item).flatten().tolist())
    if not counts:
        raise ValueError("frequent_tokens got no token ids to count")
    return torch.tensor([t for t, _ in counts.most_common(n)], dtype=torch.long)


class DraftHead:
    """The lm_head used for drafting: the full output weight, or only the rows of a reduced draft vocabulary.
    Drafting from a subset changes only q (zero outside it), which rejection sampling corrects exactly.

    min_prob > 0 gates drafting by confidence (llama.cpp's `p_min`, EAGLE-2's confidence, transformers'
    `assistant_confidence_threshold`): the head probability of a draft is q(d), the draft distribution's
    probability of the token drafted (greedy: its top-1 probability, softmax at temperature 1 over the draft
    vocabulary). Sampling uses q(d), not max q: a draw from q's tail is unlikely to be accepted however peaked q
    is, and EAGLE-2 finds q(d) tracks the acceptance rate. The rule reads only the draft side, so output
    stays exact."""

    def __init__(self, model, params: SamplingParams, vocab: torch.Tensor | None = None, min_prob: float = 0.0):
        if not 0 <= min_prob <= 1:
            raise ValueError(f"draft_min_prob must be in [0, 1] (0: no gating), not {min_prob}")
        self.params, self.min_prob = params, float(min_prob)
        self.vocab_size = model.config.vocab_size
        weight = model.output_weight
        # a quantised model drafts with its int8 projection too (half the bytes; verification decides anyway)
        self.projection = model.output_projection
        self.vocab = None
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.long, device=weight.device).flatten()
            if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= self.vocab_size:
                raise ValueError(f"draft_vocab must hold token ids in [0, {self.vocab_size}) and not be empty")
            self.vocab = vocab.unique()
            if self.projection is None:
                weight = weight[self.vocab]  # [N, H]: a copy, made once per generate call
                if weight.dtype == torch.float32 and weight.device.type == "cpu":
                    # rounded to bf16 values, which the decode router streams from a bf16 copy: half the bytes of
                    # each draft depth's projection; only q changes (by rounding), which verification corrects
                    weight = weight.bfloat16().float()
            else:
                self.projection = self.projection.rows(self.vocab)
        self.weight = weight

    def __call__(self, hidden: torch.Tensor, generator, width: int = 1) -> HeadDraft:
        """MTP output [B, H] -> one draft per row, its q, its gate and, for width w > 1, the w - 1 next most likely
        ids (see `HeadDraft`)."""
        logits = linear(hidden, self.weight) if self.projection is None else self.projection(hidden)  # [B, V or N]
        if self.params.greedy:
            top = logits.topk(width, dim=-1).indices if width > 1 else logits.argmax(dim=-1, keepdim=True)
            idx, others = top[:, 0], (self._ids(top[:, 1:]) if width > 1 else None)
            sure = None
            if self.min_prob:  # softmax at the argmax = exp(max - logsumexp): one pass over the draft vocabulary
                best = logits.gather(1, idx[:, None])[:, 0].float()
                sure = (best - logits.float().logsumexp(dim=-1)).exp() >= self.min_prob
            return HeadDraft(self._ids(idx), None, sure, others)
        q = probs(logits, self.params)
        idx = sample(q, generator)
        sure = q.gather(1, idx[:, None])[:, 0] >= self.min_prob if self.min_prob else None
        # the most likely ids besides the one drawn (q of the drawn one set below any probability)
        others = self._ids(q.scatter(1, idx[:, None], -1.0).topk(width - 1, dim=-1).indices) if width > 1 else None
        if self.vocab is not None:
            q = q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, self.vocab, q)
        return HeadDraft(self._ids(idx), q, sure, others)

    def _ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the drafting rows -> token ids."""
        return idx if self.vocab is None else self.vocab[idx]


class HeadDraft(NamedTuple):
    ids: torch.Tensor  # [B] the draft of each row
    q: torch.Tensor | None  # [B, V] the draft distribution over the full vocabulary; None when greedy
    sure: torch.Tensor | None  # [B] bool, when gating: the draft is confident enough to draft on after it
    others: torch.Tensor | None  # [B, w - 1] the next most likely ids, most likely first, for a draft tree


class Drafts(NamedTuple):
    tokens: torch.Tensor  # [B, K] (K = max(count) <= k)
    q: torch.Tensor | None  # [B, K, V] the draft distributions over the full vocabulary; None when greedy
    count: torch.Tensor  # [B] drafts each row proposed: its first count[b] (the rest of a gated batch's are padding)
    # [B, sum(w_d - 1) over d <= len(widths)]: the alternatives of a draft tree, depth 1's first; None for a chain
    alternatives: torch.Tensor | None = None
    widths: tuple[int, ...] = ()  # the draft tree's tokens per position that `alternatives` hold (() for a chain)


def draft(model, state: DecodeState, *, k: int, head: DraftHead, generator, widths: tuple[int, ...] = (),
          context: ContextDrafts | None = None) -> Drafts:
    """Up to k draft tokens per row, chaining the MTP from `state.draft_hidden` [B, H], its depth-1 output at
    slot - 1 (which predicts the token after `state.last`). With gating a row stops after its first draft that is
    not confident; once every row has stopped the remaining draft steps are skipped (one device read per step).
    Without gating count = K = k. `widths[d - 1]` = w > 1 also returns the head's w - 1 next most likely tokens at
    depth d as `alternatives` (a draft tree, `decode/tree.py`); the chain follows the first draft only.
    `context`: rows that found their context's drafts take those as the chain instead (see `with_context`)."""
    # every row matched: the context's drafts replace the head's chain, so the head drafts only the depths a tree
    # verifies (none without a tree)
    depths = min(k, len(widths)) if context is not None and context.every_row else k
    if not depths:
        return context_only(context, head.params, head.vocab_size)
    hidden = state.draft_hidden
    tokens, qs, others = [], [], []
    going = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)  # row drafts at this depth
    count = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for depth in range(1, depths + 1):
        if depth > 1:
            if head.min_prob and not bool(going.any()):
                break
            # chain: the previous draft and the MTP's own post-norm output, one position further
            slots = state.slots(1, offset=depth - 2)
            hidden = model.mtp_step(tokens[-1][:, None], hidden[:, None], state.rope_positions(slots), depth,
                                    state.cache, slots, kv_len=state.top_slot + depth - 1)[:, 0]
        token, q, sure, alternatives = head(hidden, generator, widths[depth - 1] if depth <= len(widths) else 1)
        tokens.append(token)
        qs.append(q)
        if alternatives is not None:
            others.append(alternatives)
        count += going
        if sure is not None:
            going &= sure
    drafts = Drafts(torch.stack(tokens, 1), None if qs[0] is None else torch.stack(qs, 1), count,
                    torch.cat(others, 1) if others else None, widths[: len(tokens)])
    return drafts if context is None else with_context(drafts, context, head.vocab_size)


def point_masses(tokens: torch.Tensor, vocab_size: int, dtype) -> torch.Tensor:
    """[B, L] ids -> [B, L, V]: the draft distribution of a draft that was looked up, not drawn."""
    return F.one_hot(tokens, vocab_size).to(dtype)


def with_context(drafts: Drafts, context: ContextDrafts, vocab_size: int) -> Drafts:
    """The MTP's drafts with each matched row's chain replaced by its context drafts. A draft tree keeps the head's
    top w_d tokens at depth d as the alternatives there, less the context's draft at that depth (so a matched row
    verifies the head's first choice too)."""
    matched = context.count > 0  # [B]
    K = max(drafts.tokens.shape[1], context.tokens.shape[1])
    chain = F.pad(context.tokens, (0, K - context.tokens.shape[1]))  # [B, K], padding never accepted
    tokens = torch.where(matched[:, None], chain, F.pad(drafts.tokens, (0, K - drafts.tokens.shape[1])))
    count = torch.where(matched, context.count, drafts.count)
    q = drafts.q
    if q is not None:
        q = torch.where(matched[:, None, None], point_masses(chain, vocab_size, q.dtype),
                        F.pad(q, (0, 0, 0, K - q.shape[1])))
    alternatives, start = [], 0
    for d, w in enumerate(drafts.widths):
        mine = drafts.alternatives[:, start : start + w - 1]
        start += w - 1
        # the head's top w at depth d without the context's draft there (or without its w-th when absent)
        top = torch.cat([drafts.tokens[:, d : d + 1], mine], 1)  # [B, w]
        order = (top == chain[:, d : d + 1]).long().argsort(dim=1, stable=True)
        alternatives.append(torch.where(matched[:, None], top.gather(1, order)[:, : w - 1], mine))
    return Drafts(tokens, q, count, torch.cat(alternatives, 1) if alternatives else None, drafts.widths)


def context_only(context: ContextDrafts, params: SamplingParams, vocab_size: int) -> Drafts:
    """The context's drafts alone, rows without a match proposing none: for a model without a head, or when every
    row matched and no draft tree would verify the head's tokens."""
    q = None if params.greedy else point_masses(context.tokens, vocab_size, torch.float32)
    return Drafts(context.tokens, q, context.count)


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


def mtp_extend(model, state: DecodeState, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Run the MTP (depth 1) over verified rows: hidden [B, T, H] from the trunk at slots slot..slot+T-1 and the
    tokens that follow them [B, T]. Writes the MTP cache there; returns its outputs [B, T, H]. Rows past a
    row's accepted count write stale slots that later steps overwrite, as in the trunk's KV cache."""
    slots = state.slots(tokens.shape[1])
    return model.mtp_step(tokens, hidden, state.rope_positions(slots), 1, state.cache, slots,
                          kv_len=state.top_slot + tokens.shape[1])


def verify(model, state: DecodeState, drafts: Drafts, *, params: SamplingParams, generator):
    """Verify [last, drafts] in one trunk forward at slots slot..slot+K, accept (greedy or speculative sampling)
    and roll the GDN state back to the last accepted token. Returns accepted counts [B], tokens [B, K+1] (first
    accepted+1 emitted) and the trunk's hidden over the verified rows [B, K+1, H]. A gated batch verifies K+1
    positions for every row (one forward; shorter rows' padding is never accepted)."""
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
    return accepted, tokens, out.hidden


def step(model, state: DecodeState, *, k: int, head: DraftHead | None, params: SamplingParams, generator,
         context: ContextDrafts | None = None) -> StepResult:
    """One speculative step for every row: draft up to k tokens by chaining the MTP (or take the context's
    drafts: `context`; k = 0 without a head), `verify` them, and run the MTP over the verified rows; the row of
    the last token kept drafts next."""
    if k:
        drafts = draft(model, state, k=k, head=head, generator=generator, context=context)
    else:
        drafts = context_only(context, params, model.config.vocab_size)
    accepted, tokens, hidden = verify(model, state, drafts, params=params, generator=generator)
    if not k:
        return StepResult(accepted, drafts.count, tokens, None)
    # MTP row j: trunk hidden at slot+j and the token emitted after it
    mtp_out = mtp_extend(model, state, hidden, tokens)
    rows = torch.arange(state.batch, device=accepted.device)
    return StepResult(accepted, drafts.count, tokens, mtp_out[rows, accepted])
