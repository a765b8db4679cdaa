"""An oracle drafter for benchmarks: drafts read from a known continuation of each prompt (a plain greedy run's own
output), each kept as it is with probability `rate` and otherwise replaced by another token. At rate 1 every draft
is accepted, so a run measures the engine's speculative ceiling, (k + 1) tokens a step at the cost of a k-token
verify; at rate r < 1 draft j is kept given the ones before it with probability r. Engine cost and head quality
then come apart: what a head would reach at acceptance r on this engine, whatever head it is.

Used through `generate(..., draft=DraftSpec(k), drafter=oracle(continuations, rate))`; greedy decoding only (the
drafts have no distribution to sample against).
"""

from __future__ import annotations

import random

import torch

from ..decode.drafters import Drafts, DraftSetup, Prefill, Verified
from ..decode.state import DecodeState


class OracleDrafter:
    def __init__(self, continuations: list[list[int]], k: int, rate: float, vocab_size: int, seed: int):
        self.continuations, self.k, self.rate, self.vocab_size = continuations, k, rate, vocab_size
        self.emitted_count = [0] * len(continuations)
        self.rng = random.Random(seed)

    def prefill(self, run: Prefill) -> None:
        return None

    def propose(self, state: DecodeState, rows: list[int], depths: int | None = None) -> Drafts:
        drafts, counts = [], []
        for r in rows:
            true = self.continuations[r][self.emitted_count[r] : self.emitted_count[r] + self.k]
            kept = [t if self.rng.random() < self.rate else (t + 1) % self.vocab_size for t in true]
            counts.append(len(kept))
            drafts.append(kept + [0] * (self.k - len(kept)))  # padding past the continuation is never accepted
        device = state.last.device
        return Drafts(torch.tensor(drafts, device=device), None, torch.tensor(counts, device=device))

    def advance(self, state: DecodeState, verified: Verified) -> None:
        return None

    def emitted(self, row: int, tokens: list[int]) -> None:
        self.emitted_count[row] += len(tokens)


def oracle(continuations: list[list[int]], rate: float = 1.0, seed: int = 0):
    """The builder `generate(drafter=...)` takes: an OracleDrafter over `continuations` (one per prompt, the tokens
    after it) drafting the spec's k tokens a step, each kept with probability `rate`."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], not {rate}")

    def build(setup: DraftSetup) -> OracleDrafter:
        if not setup.params.greedy:
            raise ValueError("the oracle drafter drafts for greedy decoding only (temperature 0)")
        if len(continuations) != len(setup.prompts):
            raise ValueError(f"{len(continuations)} continuations for {len(setup.prompts)} prompts")
        return OracleDrafter(continuations, setup.spec.draft_tokens, rate, setup.model.config.vocab_size, seed)

    return build
