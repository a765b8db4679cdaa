"""`DraftSpec`: how `generate` drafts, and the one place for the rules on its knobs (each knob's range, which knobs
combine, what a model must have for them, the label reports give the configuration).

A step verifies at most `MAX_VERIFIED_TOKENS` tokens (the last token, the drafts and a tree's alternatives): the
cache is sized for that many, so a knob far past it (a lookup of 10**12 tokens, a tree 40000 wide) is refused
here, before anything is allocated.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, fields

from .tree import normalize_widths, verified_tokens

DEFAULT_NGRAM = (2, 4)
# well past any configuration that pays off (docs/MTP.md's measured rows verify a few tokens to a few tens), and
# small enough that the cache and the benchmark's step-cost table stay small
MAX_VERIFIED_TOKENS = 256
# draft="auto": up to 3 head drafts (the depth the shipped heads are trained to) and 8 context drafts a step
AUTO_HEAD_DRAFTS, AUTO_CONTEXT_DRAFTS = 3, 8


def _count(value, rule: str) -> int:
    """An integer >= 0 (a numpy integer too), else a ValueError stating the rule."""
    try:
        n = operator.index(value)
    except TypeError:
        n = -1
    if n < 0:
        raise ValueError(f"{rule}, not {value!r}")
    return n


@dataclass(frozen=True, order=True)
class DraftSpec:
    """draft_tokens = k drafts per step from the model's MTP module (chained) or parallel heads 1..k; with
    draft_min_prob = p > 0 a row stops after a draft its head gives less than p; draft_widths = (w_1, ...)
    verifies a draft tree (the head's top w_d at position d; cut to k, () is a chain); draft_lookup = L drafts up
    to L tokens from the context where a row's last n tokens (n in draft_lookup_ngram = (min, max)) occurred
    before, in place of the MTP's chain (k = 0: no head needed). auto: each step chooses for each row, up to
    draft_tokens head drafts and draft_lookup context drafts, whether and how far to draft, from what it measures as
    it decodes (`decode/auto_policy.py`; `DraftSpec.automatic`). Construction checks the knobs; `check` checks them
    against a model."""

    draft_tokens: int = 0
    draft_min_prob: float = 0.0
    draft_widths: tuple[int, ...] = ()
    draft_lookup: int = 0
    draft_lookup_ngram: tuple[int, int] = DEFAULT_NGRAM
    auto: bool = False

    def __post_init__(self):
        k = _count(self.draft_tokens, "draft_tokens must be >= 0 and an integer")
        lookup = _count(self.draft_lookup, "draft_lookup must be an integer >= 0 (0: off)")
        if not 0 <= self.draft_min_prob <= 1:
            raise ValueError(f"draft_min_prob must be in [0, 1] (0: no gating), not {self.draft_min_prob}")
        if self.draft_min_prob and not k:
            raise ValueError("draft_min_prob gates speculative drafting: give draft_tokens >= 1 as well")
        widths = normalize_widths(self.draft_widths, k)
        if any(int(w) > 1 for w in self.draft_widths) and not k:
            raise ValueError("draft_widths shapes a draft tree: give draft_tokens >= 1 as well")
        ngram = tuple(self.draft_lookup_ngram)
        if len(ngram) != 2 or not 1 <= int(ngram[0]) <= int(ngram[1]):
            raise ValueError(f"draft_lookup_ngram must be (min, max) with 1 <= min <= max, not {ngram}")
        object.__setattr__(self, "draft_tokens", k)
        object.__setattr__(self, "draft_lookup", lookup)
        object.__setattr__(self, "draft_min_prob", float(self.draft_min_prob))
        object.__setattr__(self, "draft_widths", widths)
        object.__setattr__(self, "draft_lookup_ngram", (int(ngram[0]), int(ngram[1])))
        if self.auto and (self.draft_min_prob or widths):
            raise ValueError("draft auto chooses its own gating and does not verify draft trees: leave "
                             "draft_min_prob and draft_widths out")
        if self.most_verified > MAX_VERIFIED_TOKENS:
            raise ValueError(f"{self.label} verifies up to {self.most_verified} tokens a step; at most "
                             f"{MAX_VERIFIED_TOKENS}: use fewer draft tokens, a shorter lookup or narrower widths")

    @classmethod
    def automatic(cls, model, head_drafts: int = AUTO_HEAD_DRAFTS, context_drafts: int = AUTO_CONTEXT_DRAFTS):
        """`auto` for `model`: head drafts where it has a sequential MTP module (parallel heads draft a fixed
        block), context drafts always."""
        sequential = model.drafter is not None and model.mtp_heads is None
        return cls(head_drafts if sequential else 0, draft_lookup=context_drafts, auto=True)

    @property
    def speculates(self) -> bool:
        """Steps draft (from a head, the context or both) and verify; False: plain decoding."""
        return bool(self.draft_tokens or self.draft_lookup)

    @property
    def most_drafts(self) -> int:
        """Drafts a step proposes at most: the head's k, or the L looked up where a row found a match."""
        return max(self.draft_tokens, self.draft_lookup)

    @property
    def most_verified(self) -> int:
        """Tokens a verify forward holds at most: the last token, the drafts and a tree's alternatives."""
        return verified_tokens(self.draft_widths, self.most_drafts)

    @property
    def label(self) -> str:
        """k=3, k=3 p=0.3 when gated, k=3 w=3,2 for a draft tree of those widths, k=3 lookup=4 with context drafts
        of up to 4 tokens."""
        p, widths, lookup = self.draft_min_prob, self.draft_widths, self.draft_lookup
        if self.auto:
            return "auto"
        return (f"k={self.draft_tokens}" + (f" p={p:g}" if p else "")
                + (f" w={','.join(map(str, widths))}" if widths else "") + (f" lookup={lookup}" if lookup else ""))

    @classmethod
    def of(cls, record: dict) -> DraftSpec:
        """The spec a report's record names (its draft_* keys; missing ones take their defaults)."""
        return cls(**{f.name: record[f.name] for f in fields(cls) if record.get(f.name) is not None})

    @classmethod
    def grid(cls, ks, min_probs=(0.0,), widths=((),), lookups=(0,), ngram=DEFAULT_NGRAM) -> list[DraftSpec]:
        """Every speculative combination, sorted and without repeats: each k at each threshold, tree shape and
        lookup length; k <= 1 ungated (a step always proposes its first draft, so gating cannot change k = 1), each
        tree cut to k (() is the chain); k = 0 (no head) only with a lookup."""
        specs = sorted({cls(k, float(p) if k > 1 else 0.0, normalize_widths(w, k), n, tuple(ngram))
                        for k, p, w, n in itertools.product(ks, min_probs, widths, lookups) if k or n})
        if not specs:
            raise ValueError(f"no speculative configuration: give draft tokens >= 1 (0 only with a lookup length "
                             f"> 0), got k = {list(ks)} and lookups = {list(lookups)}")
        return specs

    def check(self, model, draft_vocab_size: int) -> None:
        """Raise unless `model` can draft this way; draft_vocab_size: the ids the head drafts over."""
        k, heads, cfg = self.draft_tokens, model.mtp_heads, model.config
        if k and model.drafter is None:
            raise ValueError("this model has no MTP head: load one with --mtp or train one (draft_tokens needs it)")
        if heads is not None and k > len(heads.layers):
            raise ValueError(f"draft_tokens = {k} but the model has {len(heads.layers)} parallel heads, one per "
                             f"draft: use draft_tokens <= {len(heads.layers)}")
        if self.draft_widths and heads is not None:
            raise ValueError("draft_widths extends the sequential MTP's chain; parallel heads draft one block: "
                             "leave draft_widths out")
        if self.draft_widths and "linear_attention" in cfg.layer_types:
            raise ValueError(f"draft_widths needs a trunk of attention layers, but {cfg.model_type} has Gated "
                             "DeltaNet layers (they read tokens in order and cannot verify a tree): leave "
                             "draft_widths out")
        if self.draft_lookup and k and heads is not None:
            raise ValueError("draft_lookup replaces the sequential MTP's chain; parallel heads draft one block: "
                             "leave draft_lookup out or draft_tokens = 0")
        if self.draft_widths and max(self.draft_widths) > draft_vocab_size:
            raise ValueError(f"draft_widths {list(self.draft_widths)} asks for more tokens per position than the "
                             "draft vocabulary holds")
