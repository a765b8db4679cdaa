"""`generate`: batched plain or MTP self-speculative decoding over a preallocated cache (gpt-fast's design).

Rows may have prompts of different lengths: each is prefilled through a row view of the cache and then decodes
at its own positions. A row that stops (EOS or max_new_tokens) leaves the batch: the decode state (the cache
and every per-row tensor, `state.DecodeState`) is index-selected down to the live rows, so finished rows cost
nothing afterwards (one cache copy per batch shrink, at most B-1 of them). The loop reads the device once per
step, to learn what each row emitted (gated drafting adds one read per draft step, to skip draft steps no row
needs).

A step is propose / verify / advance: the drafter the `DraftSpec` asks for (`drafters/`) proposes each row's
drafts, the trunk verifies them in one forward (`verify.py`), and the drafter advances past what was kept; a step
with nothing proposed decodes plainly. The bookkeeper only counts.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..kernels.linear import routed_linears
from ..models.vlm import VISION_INPUTS
from . import draft_head, tree
from . import verify as verification
from .cache import Cache
from .draft_spec import DEFAULT_NGRAM, DraftSpec
from .drafters import Drafter, DraftSetup, Prefill, Verified, build_drafter
from .matmul_routing import router_for
from .sampling import SamplingParams, select
from .state import DecodeState, StepResult
from .step_engine import StepEngine


@dataclass
class GenerateResult:
    """`stats`, as vLLM defines them (a verification step = one row verified once; acceptance figures are None
    without speculation): new_tokens, forward_passes (trunk forwards after prefill), verification_steps,
    drafted (tokens actually proposed: fewer than k per step when drafting is gated), accepted,
    accepted_per_position [k], acceptance_rate = accepted / drafted, mean_acceptance_length = 1 + accepted /
    verification_steps, per_position_acceptance [k] = accepted at draft position j / verification_steps,
    drafted_per_step = drafted / verification_steps, draft_lengths [k] = verification steps that proposed j
    drafts (the stop distribution), seconds (prefill included), tokens_per_second; with draft trees also
    verified_tokens_per_step (what a row puts in a verify forward: its last token, drafts and, in a draft tree,
    their alternatives) and accepted_alternatives (steps whose last accepted token was a tree's alternative);
    with draft_lookup, context_drafted_steps (verification steps whose chain was looked up in the context; a row
    of a model without a head that found nothing to look up decodes that step plainly, not counted as one)."""

    tokens: list[list[int]]  # per row: the new token ids, ending with EOS when one was produced
    stats: dict
    accept_lengths: list[list[int]]  # per row, speculative only: tokens kept from each verification step


def _prompt_rows(prompts, vocab_size: int) -> tuple[list[list[int]], list[dict]]:
    """Token id rows and, per row, its vision inputs ({} for a text prompt). A prompt is a row of ids, or a dict
    as `mtpkit.image_inputs` returns it: input_ids [1, T] plus pixel values and grids."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() != 2:
        raise ValueError(f"prompts must be a [B, T] tensor of token ids, got shape {tuple(prompts.shape)}")
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    rows, vision = [], []
    for p in prompts:
        extra = {}
        if isinstance(p, dict):
            extra = {k: p[k] for k in VISION_INPUTS if p.get(k) is not None}
            p = torch.as_tensor(p["input_ids"]).flatten().tolist()
        rows.append(list(map(int, p)))
        vision.append(extra)
    if not rows:
        raise ValueError("no prompts given")
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. BOS)")
        if min(r) < 0 or max(r) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
    return rows, vision


class _Bookkeeper:
    """Host side: each row's emitted tokens, its stop conditions and the vLLM-style acceptance counters.
    on_tokens(row, ids) is told every row's new tokens."""

    def __init__(self, batch: int, spec: DraftSpec, max_new: int, eos: set[int], on_tokens):
        self.tokens = [[] for _ in range(batch)]
        self.accept_lengths = [[] for _ in range(batch)]
        self.live = list(range(batch))  # original row index of each batch row still decoding
        self.max_new, self.eos, self.on_tokens, self.widths = max_new, eos, on_tokens, spec.draft_widths
        self.forward_passes = self.steps = self.accepted = self.drafted = 0
        self.verified = self.alternatives = 0  # tokens rows put into verify forwards; draft-tree leaves kept
        self.looked_up = 0  # verification steps whose drafts came from the context
        self.most = spec.most_drafts
        self.accepted_per_position = [0] * self.most
        self.draft_lengths = [0] * self.most

    def emit(self, chunks: list[list[int]], verified: list[tuple[int, int, int, bool]] | None = None) -> list[int]:
        """Append each live row's chunk (cut after EOS or at max_new_tokens); return the batch rows still live.
        verified: per row, (accepted, drafted, 1 if the last accepted token was a tree's leaf, whether its drafts
        were looked up in the context) of its verification step when speculating."""
        keep = []
        for b, (row, chunk) in enumerate(zip(self.live, chunks)):
            spoke = verified is not None and verified[b][1] > 0  # a verification step of this row
            if spoke:
                accepted, drafted, leaf, looked_up = verified[b]
                self.steps += 1
                self.accepted += accepted
                self.drafted += drafted
                self.alternatives += leaf
                self.looked_up += looked_up
                self.verified += tree.verified_tokens(self.widths, drafted)
                self.draft_lengths[drafted - 1] += 1
                for j in range(accepted):
                    self.accepted_per_position[j] += 1
            out = self.tokens[row]
            chunk = chunk[: self.max_new - len(out)]
            stop = next((i for i, t in enumerate(chunk) if t in self.eos), None)
            if stop is not None:
                chunk = chunk[: stop + 1]
            if spoke:
                self.accept_lengths[row].append(len(chunk))
            out.extend(chunk)
            self.on_tokens(row, chunk)
            if stop is None and len(out) < self.max_new:
                keep.append(b)
        self.live = [self.live[b] for b in keep]
        return keep

    def stats(self, seconds: float) -> dict:
        new, drafted = sum(map(len, self.tokens)), self.drafted
        return {
            "new_tokens": new,
            "forward_passes": self.forward_passes,
            "verification_steps": self.steps,
            "drafted": drafted,
            "accepted": self.accepted,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + self.accepted / self.steps if self.steps else None,
            "per_position_acceptance": [a / self.steps for a in self.accepted_per_position] if self.steps else [],
            "drafted_per_step": drafted / self.steps if self.steps else None,
            "draft_lengths": list(self.draft_lengths),
            "accepted_alternatives": self.alternatives,
            "verified_tokens_per_step": self.verified / self.steps if self.steps else None,
            "context_drafted_steps": self.looked_up,
            "seconds": seconds,
            "tokens_per_second": new / seconds if seconds > 0 else 0.0,
        }


def _prefill(model, cache, rows, vision, params, generator, drafter: Drafter | None, on_hidden=None) -> DecodeState:
    """Prefill runs of equal-length text rows in one forward each, and each image prompt on its own. Returns the
    decode state after the prompts: each row's first sampled token, its rope delta (decoding continues at
    position slot + delta; 0 for text) and the drafter's state after them (`Drafter.prefill`).
    on_hidden(rows, hidden [b, T, H]) sees each run's trunk output."""
    device = model.output_weight.device
    firsts, deltas, drafter_states, start = [], [], [], 0
    runs = itertools.groupby(range(len(rows)), key=lambda i: (len(rows[i]), i if vision[i] else -1))
    for (length, _), group in runs:
        group = list(group)
        ids = torch.tensor([rows[i] for i in group], device=device)  # [b, T]
        extra = {k: torch.as_tensor(v).to(device) for k, v in vision[group[0]].items()}
        view = cache.rows(slice(start, start + ids.shape[0]))
        start += ids.shape[0]
        inputs = model.prepare_inputs(ids, **extra)
        slots = torch.arange(length, device=device).expand_as(ids)
        hidden = model(inputs_embeds=inputs.embeds, positions=inputs.positions, deepstack=inputs.deepstack,
                       cache=view, cache_positions=slots, return_logits=False, kv_len=length).hidden  # [b, T, H]
        if on_hidden is not None:
            on_hidden(group, hidden)
        first = select(model.logits(hidden[:, -1]), params, generator)
        firsts.append(first)
        delta = inputs.rope_deltas
        deltas.append(torch.zeros_like(first) if delta is None else delta[:, 0])
        if drafter is not None:
            drafter_states.append(drafter.prefill(Prefill(hidden, inputs.embeds, inputs.positions, first, view, slots)))
    lengths = list(map(len, rows))
    kept = drafter_states and drafter_states[0] is not None
    return DecodeState(cache=cache, last=torch.cat(firsts), slot=torch.tensor(lengths, device=device),
                       slot_host=lengths, rope_delta=torch.cat(deltas),
                       drafter_state=torch.cat(drafter_states) if kept else None)


@torch.inference_mode()
def generate(
    model,
    prompts: torch.Tensor | Sequence[Sequence[int] | dict],
    *,
    max_new_tokens: int,
    draft: DraftSpec | str | None = None,
    draft_tokens: int = 0,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    draft_vocab: torch.Tensor | str | None = None,
    draft_min_prob: float = 0.0,
    draft_widths: Sequence[int] = (),
    draft_lookup: int = 0,
    draft_lookup_ngram: tuple[int, int] = DEFAULT_NGRAM,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    on_hidden: Callable[[list[int], torch.Tensor], None] | None = None,
    drafter: Callable[[DraftSetup], Drafter] | None = None,
    engine: str = "eager",
) -> GenerateResult:
    """Decode up to max_new_tokens new tokens per prompt (rows of token ids, or for a vision-language model
    dicts from `mtpkit.image_inputs` with the image patches), plainly or self-speculatively as `draft` says (a
    `DraftSpec`; "auto": each step chooses for each row whether and how far to draft from the head or the
    context, from the acceptance and step costs it measures, `DraftSpec.automatic`; or the knobs as keyword
    arguments: draft_tokens, draft_min_prob, draft_widths, draft_lookup, draft_lookup_ngram, see `DraftSpec`).
    Drafts are verified in one trunk forward per step (lossless: greedy output is token for token the same,
    sampled output has exactly the same distribution). `draft_vocab` restricts drafting to those ids; by default
    the head's own (`model.drafter.draft_vocab`, from a head trained with mtp.draft_vocab), "full" drafts over the
    whole vocabulary.
    `on_tokens(row, ids)` is called with every row's new tokens as they are produced (for streaming).
    `on_hidden(rows, hidden [b, n, H])`, plain decoding only, is called with the trunk's post-norm hidden states
    of every token a forward reads (the prompt, then each new token but the last), for those prompt rows: a
    self-distillation run stores them as training features without running the trunk again.
    `drafter(setup)` builds a drafter of the caller's in place of the registry's (benchmarks: the oracle of
    bench/oracle_drafter.py); `draft` still sizes each step's verify.
    `engine`: "eager" (the reference: each step at its own shapes, with the CPU's routed products), or fixed-shape
    steps over the cache (`step_engine.py`): "static", "compile" (torch.compile), "cuda-graph" and
    "compile+cuda-graph" (CUDA graphs replayed per step shape)."""
    knobs = DraftSpec(draft_tokens, draft_min_prob, tuple(draft_widths), draft_lookup, tuple(draft_lookup_ngram))
    if draft is not None and knobs != DraftSpec():
        raise ValueError("give the drafting knobs either as draft=DraftSpec(...) or as keyword arguments, not both")
    if isinstance(draft, str):
        if draft != "auto":
            raise ValueError(f"draft must be a DraftSpec, 'auto' or None, not {draft!r}")
        draft = DraftSpec.automatic(model)
    spec = draft or knobs
    params = SamplingParams(temperature, top_k, top_p)
    cfg = model.config
    rows, vision = _prompt_rows(prompts, cfg.vocab_size)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 and an integer, not {max_new_tokens!r}")
    if on_hidden is not None and spec.speculates:
        raise ValueError("on_hidden reads the trunk's hidden states of plain decoding: leave draft_tokens and "
                         "draft_lookup at 0")
    longest = max(map(len, rows))
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{cfg.max_position_embeddings} tokens"
        )
    eos = {int(e) for e in ([] if eos_token_id is None else torch.as_tensor(eos_token_id).flatten().tolist())}
    weight = model.output_weight
    generator = torch.Generator(weight.device).manual_seed(random.getrandbits(63) if seed is None else seed)
    if isinstance(draft_vocab, str):
        if draft_vocab != "full":
            raise ValueError(f"draft_vocab must be token ids, None (the head's own) or 'full', not {draft_vocab!r}")
        draft_vocab = None
    elif draft_vocab is None and model.drafter is not None:
        draft_vocab = model.drafter.draft_vocab
    head = draft_head.DraftHead(model, params, draft_vocab, spec.draft_min_prob) if spec.draft_tokens else None
    spec.check(model, cfg.vocab_size if head is None or head.vocab is None else len(head.vocab))
    router = router_for(model)
    if engine != "eager":  # the routed products are the eager CPU path's; fixed-shape steps use torch's
        model, router = StepEngine.of(model, engine, spec.most_verified), None
    setup = DraftSetup(model, spec, head, params, generator, rows)
    drafter = build_drafter(setup) if drafter is None else drafter(setup)
    book = _Bookkeeper(len(rows), spec, max_new_tokens, eos, _told(drafter, on_tokens))
    with routed_linears(router):
        return _decode(model, rows, vision, book, params, generator, drafter, spec, on_hidden)


def _told(drafter: Drafter | None, on_tokens):
    """on_tokens(row, ids) that tells the drafter first (a context lookup indexes them), then the caller."""
    def told(row: int, ids: list[int]) -> None:
        if drafter is not None:
            drafter.emitted(row, ids)
        if on_tokens is not None:
            on_tokens(row, ids)
    return told


def _plain_step(model, state: DecodeState, params: SamplingParams, generator) -> StepResult:
    """One trunk forward over each row's last token: one new token per row, nothing drafted."""
    slots = state.slots(1)
    out = model(state.last[:, None], positions=state.rope_positions(slots), cache=state.cache,
                cache_positions=slots, kv_len=state.top_slot + 1)
    none = torch.zeros_like(state.last)
    return StepResult(accepted=none, drafted=none, tokens=select(out.logits[:, 0], params, generator)[:, None],
                      drafter_state=None, trunk_hidden=out.hidden[:, 0])


def _speculative_step(model, state: DecodeState, drafts, drafter: Drafter, params, generator) -> StepResult:
    """Verify a step's drafts and let the drafter advance past what was kept."""
    verified = verification.verify(model, state, drafts, params=params, generator=generator)
    return StepResult(verified.accepted, drafts.count, verified.tokens, drafter.advance(state, verified),
                      verified.alternative)


def _decode(model, rows, vision, book: _Bookkeeper, params, generator, drafter, spec: DraftSpec,
            on_hidden=None) -> GenerateResult:
    start = time.perf_counter()
    weight = model.output_weight
    slots = max(map(len, rows)) + book.max_new + spec.most_verified
    fixed = isinstance(model, StepEngine)
    cache = model.new_cache(len(rows), slots) if fixed else Cache(model.config, len(rows), slots, weight.dtype,
                                                                   weight.device)
    state = _prefill(model, cache, rows, vision, params, generator, drafter, on_hidden)
    keep = book.emit([[t] for t in state.last.tolist()])
    # a drafter that adapts (drafters/auto.py) is told each step's outcome, and when decoding ends
    observed, finish = getattr(drafter, "observed", None), getattr(drafter, "finish", None)
    while keep:
        if len(keep) < state.batch:  # some rows stopped: drop them from the batch
            state = state.select(keep)
        if fixed:
            model.bind(state.cache)
        drafts = drafter.propose(state, book.live) if drafter is not None else None
        if drafts is None:
            result = _plain_step(model, state, params, generator)
            if drafter is not None:  # a drafter that let the step go plain still follows the text
                result = result._replace(drafter_state=drafter.advance(state, Verified(
                    torch.zeros_like(state.last), result.tokens, result.trunk_hidden[:, None])))
        else:
            result = _speculative_step(model, state, drafts, drafter, params, generator)
        book.forward_passes += 1
        if on_hidden is not None:
            on_hidden(book.live, result.trunk_hidden[:, None])
        # the one device read of the step
        flags = result.alternative if result.alternative is not None else torch.zeros_like(result.accepted)
        host = torch.cat([result.accepted[:, None], result.drafted[:, None], flags[:, None].long(), result.tokens],
                         dim=1).tolist()
        verified = None
        if drafts is not None:  # a verification step: per row (accepted, drafted, alternative kept, looked up)
            verified = [(*h[:3], m) for h, m in zip(host, drafts.looked_up or [False] * state.batch)]
        keep = book.emit([h[3 : h[0] + 4] for h in host], verified)
        state = state.advanced(result, [h[0] for h in host])
        if observed is not None:
            observed([h[0] for h in host])
    if finish is not None:
        finish()
    return GenerateResult(book.tokens, book.stats(time.perf_counter() - start), book.accept_lengths)
