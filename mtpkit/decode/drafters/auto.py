"""`draft="auto"`: every step, each row decodes plainly or drafts from the MTP head or from its context, as far as
`auto_policy.Controller` finds worth it from the acceptance and step costs it measures while decoding.

The pieces are the other drafters': the MTP chain (`mtp_chain.draft`, its depth cut draft by draft by the
controller's gating) and the context index (`context_lookup.ContextLookup`). What is new is the plain step: while
every row decodes plainly the MTP module does not run. Each plain step leaves its trunk hidden state and the token
after it, and every `SHADOW_EVERY` plain steps, or at the next step that drafts, the MTP runs once over all of them
(one forward of P rows, which costs about as much as one of a single row on a CPU): the head then drafts from a
cache as complete as if it had run every step. Each catch-up that finds the batch still decoding plainly doubles
the stretch to the next, up to `SHADOW_MOST`, and a drafting step sets it back; the last `SCORED_MOST` positions
score the head. (A catch-up of 16 positions and its scoring cost ~40% of a decode step of SmolLM2: 2.6% of plain
decoding at one every 16 steps.)

A row teaches the controller what the sources it does not use would give it. Decoding plainly, the catch-up
forward's outputs are the head's first drafts at each of those positions, scored against the tokens the row
emitted (exact for greedy decoding; for sampling, whether the head's top token was the one drawn, a proxy);
drafting from the context, the MTP's outputs over the kept tokens (which the chain computes anyway) are scored the
same way every `SCORE_EVERY` such steps; and what the context lookup finds for a row that does not use it is
scored against the tokens that follow. So a row switches back when another source starts paying, without trying
it blind.

Steps are timed from `propose` to `observed` (after the step's one device read), less what the decode router
spent measuring products in between (decode/matmul_routing.py), so a step that calibrates a new row count does
not teach the controller that verifying is slow. And routes for every verify width auto may try are prepared when
it is built (read from the route store after a machine's first run), while the catch-up and scoring forwards, P
rows each, use torch's products: measured at first sight, each new row count cost 1-3 s of the user's time in
the middle of a call (auto's first call in a fresh process ran at 0.31-2.1x its second).
"""

from __future__ import annotations

import time

import torch

from ...kernels.linear import routed_linears
from ..auto_policy import Controller, StepCosts
from ..matmul_routing import router_for
from ..route_store import entry_key
from ..state import DecodeState
from . import mtp_chain
from .base import Drafts, DraftSetup, Prefill, Verified
from .context_lookup import ContextDrafts, ContextLookup, context_only, with_context

SHADOW_EVERY = 16  # plain steps between catch-up forwards of the MTP (each scores the head's first drafts)
SHADOW_MOST = 64  # ... doubled by each catch-up in a plain stretch, up to this
SCORED_MOST = 16  # of a catch-up's positions, the last this many score the head (a full-vocabulary product each)
SCORE_EVERY = 4  # context-drafted steps between scorings of the head's first drafts (an lm_head product each)


class AutoDrafter:
    def __init__(self, setup: DraftSetup, controller: Controller, store_key: str | None):
        spec, self.model = setup.spec, setup.model
        self.head, self.generator, self.params = setup.head, setup.generator, setup.params
        self.chain = (mtp_chain.MTPChain(self.model, self.head, self.generator, spec.draft_tokens, ())
                      if spec.draft_tokens else None)
        self.index = ContextLookup(setup.prompts, spec.draft_lookup, spec.draft_lookup_ngram)
        self.controller, self.store_key = controller, store_key
        self.router = router_for(self.model)
        self.vocab_size = self.model.config.vocab_size
        self.pending: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []  # plain steps the MTP has not seen
        self.watch: dict[int, tuple[list[int], list[int]]] = {}  # row -> (context drafts it did not use, what came)
        self.context_steps = 0
        self.shadow_every = SHADOW_EVERY
        self.step = None  # (rows, plans, drafts, draft seconds, head depths, start, router's measuring seconds)
        # every verify width it may try routed now (from the store after a machine's first run), not mid-step
        batch = len(setup.prompts)
        for n in range(1, spec.most_verified + 1):
            self.router.prepare(batch * n, self.model.output_weight)
        if self.head is not None:
            self.router.prepare(batch, self.head.weight)

    def prefill(self, run: Prefill) -> torch.Tensor | None:
        return None if self.chain is None else self.chain.prefill(run)

    def propose(self, state: DecodeState, rows: list[int], depths: int | None = None) -> Drafts | None:
        start, measuring = time.perf_counter(), self.router.measuring
        found = [self.index.propose(r) for r in rows]
        plans = [self.controller.plan(r, len(f)) for r, f in zip(rows, found)]
        sources = [p.source for p in plans]
        for r, f, source in zip(rows, found, sources):
            if f and source != "context" and r not in self.watch:
                self.watch[r] = (f, [])
        if set(sources) == {"plain"}:
            self.step = (rows, plans, None, 0.0, 0, start, measuring)
            return None
        if self.chain is not None and self.pending:
            caught = time.perf_counter()
            state.drafter_state = self._catch_up(state, rows, end=0)
            # the plain steps' MTP work, done now: neither this step's drafting nor its verify (charged to the
            # draft depths, it priced drafting after every plain stretch at several times its cost)
            start += time.perf_counter() - caught
        self.shadow_every = SHADOW_EVERY
        drafts, head_depths = None, 0
        if "head" in sources:
            drafts = mtp_chain.draft(self.model, state, k=self.chain.k, head=self.head, generator=self.generator,
                                     keep=self._gate(plans))
            head_depths = drafts.tokens.shape[1]
        if "context" in sources:
            context = ContextDrafts.of([f[: p.drafts] if p.source == "context" else [] for f, p in zip(found, plans)],
                                       [0] * len(rows), state.last.device)  # padding is never accepted
            drafts = (context_only(context, self.params, self.vocab_size) if drafts is None
                      else with_context(drafts, context, self.vocab_size))
        plain = torch.tensor([s == "plain" for s in sources], device=drafts.count.device)
        drafts = drafts._replace(count=drafts.count.masked_fill(plain, 0), looked_up=[s == "context" for s in sources])
        self.step = (rows, plans, drafts, time.perf_counter() - start, head_depths, start, measuring)
        return drafts

    def _gate(self, plans):
        """keep(depth, confidence) for `mtp_chain.draft`: each head row's P(drafts so far all accepted), from the
        calibrated head probabilities, decides whether it drafts on (`Controller.keep_drafting`)."""
        prefix = [1.0] * len(plans)
        calibrated = self.controller.calibration

        def keep(depth: int, confidence: torch.Tensor) -> torch.Tensor:
            out = []
            for b, (plan, q) in enumerate(zip(plans, confidence.tolist())):
                prefix[b] *= calibrated(q)
                out.append(plan.source == "head" and self.controller.keep_drafting(plan, depth, prefix[b]))
            return torch.tensor(out, device=confidence.device)

        return keep

    def _catch_up(self, state: DecodeState, rows: list[int], end: int) -> torch.Tensor:
        """Run the MTP over the plain steps it has not seen (their trunk hidden states and the tokens after them, at
        the P slots before state.slot + end), as the chain's `advance` would have after each; score the head's first
        drafts there against the tokens that came. Returns the drafter state after the last of them."""
        P = len(self.pending)
        hidden = torch.stack([h[[seen.index(r) for r in rows]] for h, _, seen in self.pending], 1)  # [B, P, H]
        tokens = torch.stack([t[[seen.index(r) for r in rows]] for _, t, seen in self.pending], 1)  # [B, P]
        slots = state.slots(P, offset=end - P)
        scored = min(P, SCORED_MOST)
        with routed_linears(None):  # P rows, a different count each time: torch's products, no routes measured
            out = self.model.mtp_step(tokens, hidden, state.rope_positions(slots), 1, state.cache, slots,
                                      kv_len=state.top_slot + end)  # [B, P, H]
            top = self.head.top(out[:, P - scored : -1]) if P > 1 else None
        self.pending = []
        if P > 1:  # the output at slot j drafts the token at j + 2, which is the token after slot j + 1
            kept = (top == tokens[:, P - scored + 1 :]).tolist()
            for r, row in zip(rows, kept):
                for hit in row:
                    self.controller.observe(r, "head", 1, int(hit), [])
        return out[:, -1]

    def advance(self, state: DecodeState, verified: Verified) -> torch.Tensor | None:
        if self.chain is None:
            return None
        rows, plans, drafts = self.step[:3]
        if drafts is not None:  # the chain's advance, keeping the MTP's outputs over the kept tokens
            out = mtp_chain.mtp_extend(self.model, state, verified.hidden, verified.tokens)  # [B, K+1, H]
            context = [b for b, p in enumerate(plans) if p.source == "context"]
            self.context_steps += bool(context)
            if context and self.context_steps % SCORE_EVERY == 0:
                self._score_head(out, verified, rows, context)
            return out[torch.arange(state.batch, device=out.device), verified.accepted]
        # a plain step: kept for the next catch-up, which also scores what the head would have drafted
        self.pending.append((verified.hidden[:, 0], verified.tokens[:, 0], list(self.step[0])))
        if len(self.pending) < self.shadow_every:
            return state.drafter_state
        self.shadow_every = min(2 * self.shadow_every, SHADOW_MOST)
        return self._catch_up(state, self.step[0], end=1)

    def _score_head(self, out: torch.Tensor, verified: Verified, rows: list[int], batch_rows: list[int]) -> None:
        """Rows that took context drafts: the head's first draft at each kept position (out[:, j] drafts the token
        after verified.tokens[:, j]) scored against the token that came."""
        with routed_linears(None):
            hits = (self.head.top(out[:, :-1]) == verified.tokens[:, 1:]).tolist()
        accepted = verified.accepted.tolist()
        for b in batch_rows:
            for hit in hits[b][: accepted[b]]:
                self.controller.observe(rows[b], "head", 1, int(hit), [])

    def emitted(self, row: int, tokens: list[int]) -> None:
        self.index.extend(row, tokens)
        if row in self.watch:  # context drafts the row did not use, scored against what it wrote
            drafts, came = self.watch[row]
            came.extend(tokens)
            kept = next((i for i, (d, t) in enumerate(zip(drafts, came)) if d != t), min(len(drafts), len(came)))
            if kept < len(came) or kept == len(drafts):
                self.controller.observe(row, "context", len(drafts), kept, [])
                del self.watch[row]

    def observed(self, accepted: list[int]) -> None:
        """The step's accepted counts per batch row, read on the host: acceptance and cost figures."""
        rows, plans, drafts, draft_seconds, head_depths, start, measuring = self.step
        seconds = time.perf_counter() - start - (self.router.measuring - measuring)
        costs = self.controller.costs
        if drafts is None:
            costs.observe(1, seconds)
            return
        counts = drafts.count.tolist()
        confidence = drafts.confidence.tolist() if drafts.confidence is not None else None
        for b, (r, plan) in enumerate(zip(rows, plans)):
            if plan.source != "plain":
                qs = confidence[b][: counts[b]] if plan.source == "head" else []
                self.controller.observe(r, plan.source, counts[b], accepted[b], qs)
        # the step's drafting (the head's depths, the context's drafts) is not the verify's cost (a catch-up: neither)
        costs.observe(drafts.tokens.shape[1] + 1, seconds, head_depths, draft_seconds)

    def finish(self) -> None:
        """Keep the measured step costs for the next process (route_store.py, "steps")."""
        costs = self.controller.costs
        store = self.router.store
        if self.store_key is not None and store is not None and (costs.moved() or store.get("steps", self.store_key)
                                                                 is None):  # seeded from the other kind
            self.router.keep("steps", {self.store_key: costs.record()})


def build(setup: DraftSetup, drafter):
    """The auto drafter, in place of the others, when the spec asks for it."""
    spec, model = setup.spec, setup.model
    if not spec.auto:
        return drafter
    weight = model.output_weight
    store = router_for(model).store
    cfg = model.config
    # sampled and greedy steps apart: a sampled verify computes probabilities at every verified row, so its ratio
    # to a plain step differs (1.4 against ~1.2 for two rows of SmolLM2), and one kind's ratios misprice the other;
    # before a kind has its own, the other's are nearer than the default ratios (which drafted at a loss while
    # the first sampled calls on a machine learned them: 0.91x plain)
    def key(kind: str) -> str:
        return entry_key(torch.get_num_threads(), weight.device.type, weight.dtype, len(setup.prompts),
                         cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size if setup.head is None or
                         setup.head.vocab is None else len(setup.head.vocab), kind)

    kind, other = ("sampled", "greedy") if setup.params.temperature > 0 else ("greedy", "sampled")
    seeded = None if store is None else store.get("steps", key(kind)) or store.get("steps", key(other))
    return AutoDrafter(setup, Controller(spec.draft_tokens, spec.draft_lookup, StepCosts(seeded)), key(kind))
