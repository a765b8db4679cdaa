"""Drafts looked up in the context: prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding;
vLLM's and SGLang's "ngram" drafting), used next to the MTP head as SAM-Decoding (Hu et al. 2024) and
SuffixDecoding (Oliaro et al. 2024) use a context matcher next to a draft model.

When a row's last n tokens (n from `ngram` = (min, max), longest first) occurred earlier in its prompt or output,
the tokens that followed their latest occurrence are its drafts for the step, in place of the MTP's chain; the
head's top tokens at each position stay in a draft tree as alternatives (`speculative.draft`). Text that repeats
itself (names, code identifiers, lists, a small model's loops) is drafted many tokens at a time, which a head
trained on little data does not predict. Verification is unchanged, so output stays exact: greedily the drafts
are kept while they equal the trunk's argmax, and sampling treats them as drafts from a point mass
(accept d with probability p(d), on rejection draw from p without d).

The index is kept on the host, updated with each step's emitted tokens (a dict per row and n-gram length: the
last end position of each n-gram), so a lookup costs max - min + 1 dict reads whatever the context length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

DEFAULT_NGRAM = (2, 4)


class ContextDrafts(NamedTuple):
    """Drafts looked up in each live row's context for one step."""

    tokens: torch.Tensor  # [B, L] padded past count (never accepted there)
    count: torch.Tensor  # [B] drafts found (0: no match, the row drafts with the MTP)
    matched: list[bool]  # per row, on the host

    @property
    def every_row(self) -> bool:
        """Every row matched: MTP depths past a draft tree's are not needed."""
        return all(self.matched)


def most_drafts(k: int, lookup: int) -> int:
    """Drafts a step proposes at most: the MTP's k, or the L looked up where a row found a match."""
    return max(k, lookup)


def check_ngram(ngram) -> tuple[int, int]:
    """(min, max) n-gram lengths to match, 1 <= min <= max."""
    ngram = tuple(ngram)
    if len(ngram) != 2 or not 1 <= int(ngram[0]) <= int(ngram[1]):
        raise ValueError(f"draft_lookup_ngram must be (min, max) with 1 <= min <= max, not {ngram}")
    return int(ngram[0]), int(ngram[1])


class ContextLookup:
    """Per row: its tokens so far (prompt and emitted) and where each n-gram last ended, for `propose`."""

    def __init__(self, rows: list[list[int]], tokens: int, ngram=DEFAULT_NGRAM):
        self.tokens = int(tokens)
        self.low, self.high = check_ngram(ngram)
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
        width = max(map(len, found))
        padded = [f + [self.sequences[r][-1]] * (width - len(f)) for f, r in zip(found, rows)]
        return ContextDrafts(torch.tensor(padded, device=device), torch.tensor(list(map(len, found)), device=device),
                             [bool(f) for f in found])
