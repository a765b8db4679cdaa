"""Drafts looked up in the context: prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding;
vLLM's and SGLang's "ngram" drafting), used next to the MTP head as SAM-Decoding (Hu et al. 2024) and
SuffixDecoding (Oliaro et al. 2024) use a context matcher next to a draft model.

When a row's last n tokens (n from `ngram` = (min, max), longest first) occurred earlier in its prompt or output,
the tokens that followed their latest occurrence are its drafts for the step, in place of the MTP's chain; the
head's top tokens at each position stay in a draft tree as alternatives (`with_context`). Text that repeats
itself (names, code identifiers, lists, a small model's loops) is drafted many tokens at a time, which a head
trained on little data does not predict. Verification is unchanged, so output stays exact: greedily the drafts
are kept while they equal the trunk's argmax, and sampling treats them as drafts from a point mass
(accept d with probability p(d), on rejection draw from p without d).

The index is kept on the host, updated with each step's emitted tokens (a dict per row and n-gram length: the
last end position of each n-gram), so a lookup costs max - min + 1 dict reads whatever the context length.

As a drafter it composes with the one built before it (the MTP chain, or none: k = 0 needs no head): rows with a
match take the context's chain, the others the inner drafter's; when every row matched the inner drafter drafts
only the depths a draft tree verifies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..draft_spec import DEFAULT_NGRAM
from ..sampling import SamplingParams
from ..state import DecodeState
from .base import Drafts, DraftSetup, Prefill, Verified


class ContextDrafts(NamedTuple):
    """Drafts looked up in each live row's context for one step."""

    tokens: torch.Tensor  # [B, L] padded past count (never accepted there)
    count: torch.Tensor  # [B] drafts found (0: no match, the row drafts with the MTP)
    matched: list[bool]  # per row, on the host

    @property
    def every_row(self) -> bool:
        """Every row matched: MTP depths past a draft tree's are not needed."""
        return all(self.matched)

    @classmethod
    def of(cls, found: list[list[int]], pads: list[int], device) -> ContextDrafts:
        """Each row's drafts found (possibly none), padded with that row's `pads` token to the longest."""
        width = max(1, max(map(len, found)))
        padded = [f + [pad] * (width - len(f)) for f, pad in zip(found, pads)]
        return cls(torch.tensor(padded, device=device), torch.tensor(list(map(len, found)), device=device),
                   [bool(f) for f in found])


class ContextLookup:
    """Per row: its tokens so far (prompt and emitted) and where each n-gram last ended, for `propose`."""

    def __init__(self, rows: list[list[int]], tokens: int, ngram: tuple[int, int] = DEFAULT_NGRAM):
        self.tokens = tokens
        self.low, self.high = ngram
        self.sequences = [[] for _ in rows]
        self.ends = [{} for _ in rows]  # row -> {n-gram tuple: end position of its latest occurrence}
        for row, ids in enumerate(rows):
            self.extend(row, ids)

    def extend(self, row: int, ids: list[int]) -> None:
        """Append a row's new tokens; n-grams ending before its last token are indexed (the last token's own are
        the query of the next `propose`, which must find an earlier occurrence)."""
        seq, ends = self.sequences[row], self.ends[row]
        first = max(len(seq) - 1, 0)
        seq.extend(ids)
        for end in range(first, len(seq) - 1):
            for n in range(self.low, min(self.high, end + 1) + 1):
                ends[tuple(seq[end - n + 1 : end + 1])] = end

    def propose(self, row: int) -> list[int]:
        """Up to `tokens` drafts for a row: what followed the latest earlier occurrence of its longest matching
        suffix; [] without a match."""
        seq, ends = self.sequences[row], self.ends[row]
        for n in range(min(self.high, len(seq)), self.low - 1, -1):
            end = ends.get(tuple(seq[-n:]))
            if end is not None:
                return seq[end + 1 : end + 1 + self.tokens]
        return []

    def drafts(self, rows: list[int], device) -> ContextDrafts | None:
        """The live rows' drafts (`rows`: their original indices, in batch order), padded with each row's last
        token; None when no row matched."""
        found = [self.propose(r) for r in rows]
        if not any(found):
            return None
        return ContextDrafts.of(found, [self.sequences[r][-1] for r in rows], device)


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
    confidence = None if drafts.confidence is None else F.pad(drafts.confidence, (0, K - drafts.confidence.shape[1]))
    return Drafts(tokens, q, count, torch.cat(alternatives, 1) if alternatives else None, drafts.widths,
                  confidence=confidence)


def context_only(context: ContextDrafts, params: SamplingParams, vocab_size: int) -> Drafts:
    """The context's drafts alone, rows without a match proposing none: without an inner drafter, or when every
    row matched and no draft tree would verify the inner drafter's tokens."""
    q = None if params.greedy else point_masses(context.tokens, vocab_size, torch.float32)
    return Drafts(context.tokens, q, context.count)


class ContextLookupDrafter:
    def __init__(self, inner, index: ContextLookup, params: SamplingParams, vocab_size: int, k: int,
                 widths: tuple[int, ...]):
        self.inner, self.index, self.params, self.vocab_size = inner, index, params, vocab_size
        self.k, self.widths = k, widths

    def prefill(self, run: Prefill) -> torch.Tensor | None:
        return None if self.inner is None else self.inner.prefill(run)

    def propose(self, state: DecodeState, rows: list[int], depths: int | None = None) -> Drafts | None:
        context = self.index.drafts(rows, state.slot.device)
        if context is None:
            return None if self.inner is None else self.inner.propose(state, rows)
        # every row matched: the context's drafts replace the inner chain, which drafts only the depths a tree
        # verifies (none without a tree)
        depths = min(self.k, len(self.widths)) if context.every_row else self.k
        if not depths:
            drafts = context_only(context, self.params, self.vocab_size)
        else:
            drafts = with_context(self.inner.propose(state, rows, depths), context, self.vocab_size)
        return drafts._replace(looked_up=context.matched)

    def advance(self, state: DecodeState, verified: Verified) -> torch.Tensor | None:
        return None if self.inner is None else self.inner.advance(state, verified)

    def emitted(self, row: int, tokens: list[int]) -> None:
        self.index.extend(row, tokens)
        if self.inner is not None:
            self.inner.emitted(row, tokens)


def build(setup: DraftSetup, drafter):
    """Wraps the drafter built so far when the spec asks for a context lookup."""
    spec = setup.spec
    if not spec.draft_lookup:
        return drafter
    index = ContextLookup(setup.prompts, spec.draft_lookup, spec.draft_lookup_ngram)
    return ContextLookupDrafter(drafter, index, setup.params, setup.model.config.vocab_size, spec.draft_tokens,
                                spec.draft_widths)
