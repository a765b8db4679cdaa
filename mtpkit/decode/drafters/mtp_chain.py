"""The sequential MTP module (DeepSeek-V3 / Qwen3.5 layout) as a drafter: each step chains it k deep from the
last verified position, and after verification it runs once over the kept tokens, filling its cache.

Position convention (vLLM's, docs/MTP.md section 2): the MTP row that predicts the token at position t+2 sees
the trunk hidden at t and the token at t+1, at position t; chained depth j adds j-1 to that position. The drafter
state is the MTP's depth-1 output [B, H] at slot - 1, which predicts the token after `state.last`.
"""

from __future__ import annotations

import torch

from ..draft_head import DraftHead
from ..state import DecodeState
from .base import Drafts, DraftSetup, Prefill, Verified


def draft(model, state: DecodeState, *, k: int, head: DraftHead, generator, widths: tuple[int, ...] = (),
          keep=None) -> Drafts:
    """Up to k draft tokens per row, chaining the MTP from `state.drafter_state` [B, H]. With gating a row stops
    after its first draft that is not confident (the head's min_prob, or keep(depth, confidence [B]) -> [B] bool:
    whether each row drafts on); once every row has stopped the remaining draft steps are skipped (one device read
    per step). Without gating count = K = k. `widths[d - 1]` = w > 1 also returns the head's w - 1 next most
    likely tokens at depth d as `alternatives` (a draft tree, `decode/tree.py`); the chain follows the first draft
    only."""
    hidden = state.drafter_state
    tokens, qs, others, confidences = [], [], [], []
    going = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)  # row drafts at this depth
    count = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for depth in range(1, k + 1):
        if depth > 1:
            if (head.min_prob or keep is not None) and not bool(going.any()):
                break
            # chain: the previous draft and the MTP's own post-norm output, one position further
            slots = state.slots(1, offset=depth - 2)
            hidden = model.mtp_step(tokens[-1][:, None], hidden[:, None], state.rope_positions(slots), depth,
                                    state.cache, slots, kv_len=state.top_slot + depth - 1)[:, 0]
        token, q, sure, alternatives, confidence = head(hidden, generator,
                                                        widths[depth - 1] if depth <= len(widths) else 1)
        tokens.append(token)
        qs.append(q)
        confidences.append(confidence)
        if alternatives is not None:
            others.append(alternatives)
        count += going
        if keep is not None:
            going &= keep(depth, confidence)
        elif sure is not None:
            going &= sure
    return Drafts(torch.stack(tokens, 1), None if qs[0] is None else torch.stack(qs, 1), count,
                  torch.cat(others, 1) if others else None, widths[: len(tokens)],
                  confidence=torch.stack(confidences, 1))


def mtp_extend(model, state: DecodeState, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Run the MTP (depth 1) over verified rows: hidden [B, T, H] from the trunk at slots slot..slot+T-1 and the
    tokens that follow them [B, T]. Writes the MTP cache there; returns its outputs [B, T, H]. Rows past a
    row's accepted count write stale slots that later steps overwrite, as in the trunk's KV cache."""
    slots = state.slots(tokens.shape[1])
    return model.mtp_step(tokens, hidden, state.rope_positions(slots), 1, state.cache, slots,
                          kv_len=state.top_slot + tokens.shape[1])


class MTPChain:
    def __init__(self, model, head: DraftHead, generator, k: int, widths: tuple[int, ...]):
        self.model, self.head, self.generator, self.k, self.widths = model, head, generator, k, widths

    def prefill(self, run: Prefill) -> torch.Tensor:
        # row i: trunk hidden at i and the input after it (a vision embedding at an image token)
        nxt = torch.cat([run.embeds[:, 1:], self.model.embed(run.first)[:, None]], dim=1)
        out = self.model.mtp_step(None, run.hidden, run.positions, 1, run.cache, run.slots,
                                  kv_len=run.slots.shape[1], embeds=nxt)
        return out[:, -1]

    def propose(self, state: DecodeState, rows: list[int], depths: int | None = None) -> Drafts:
        return draft(self.model, state, k=self.k if depths is None else depths, head=self.head,
                     generator=self.generator, widths=self.widths)

    def advance(self, state: DecodeState, verified: Verified) -> torch.Tensor:
        # MTP row j: trunk hidden at slot+j and the token emitted after it
        out = mtp_extend(self.model, state, verified.hidden, verified.tokens)
        return out[torch.arange(state.batch, device=out.device), verified.accepted]

    def emitted(self, row: int, tokens: list[int]) -> None:
        pass


def build(setup: DraftSetup, drafter):
    """Drafts with the sequential MTP when the spec asks for draft tokens and the model has it."""
    k, model = setup.spec.draft_tokens, setup.model
    if not k or model.mtp_heads is not None:
        return drafter
    return MTPChain(model, setup.head, setup.generator, k, setup.spec.draft_widths)
