"""`generate`: batched plain or MTP self-speculative decoding over a preallocated cache (gpt-fast's design).

Rows may have prompts of different lengths: each is prefilled through a row view of the cache and then decodes
at its own positions. A row that stops (EOS or max_new_tokens) leaves the batch: the decode state (the cache
and every per-row tensor, `state.DecodeState`) is index-selected down to the live rows, so finished rows cost
nothing afterwards (one cache copy per batch shrink, at most B-1 of them). The loop reads the device once per
step, to learn what each row emitted (gated drafting adds one read per draft step, to skip draft steps no row
needs).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models.parallel_heads import head_outputs
from ..models.vlm import VISION_INPUTS
from . import blockwise
from . import speculative as spec
from . import tree
from .cache import Cache
from .lookup import DEFAULT_NGRAM, ContextLookup, most_drafts
from ..kernels.linear import routed_linears
from .matmul_routing import router_for
from .sampling import SamplingParams, select
from .state import DecodeState, StepResult


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
    """Host side: each row's emitted tokens, its stop conditions and the vLLM-style acceptance counters."""

    def __init__(self, batch: int, k: int, max_new: int, eos: set[int], on_tokens, widths: tuple[int, ...] = (),
                 lookup: ContextLookup | None = None):
        self.tokens = [[] for _ in range(batch)]
        self.accept_lengths = [[] for _ in range(batch)]
        self.live = list(range(batch))  # original row index of each batch row still decoding
        self.k, self.max_new, self.eos, self.on_tokens, self.widths = k, max_new, eos, on_tokens, widths
        self.lookup = lookup
        self.forward_passes = self.steps = self.accepted = self.drafted = 0
        self.verified = self.alternatives = 0  # tokens rows put into verify forwards; draft-tree leaves kept
        self.looked_up = 0  # verification steps whose drafts came from the context
        self.most = most_drafts(k, lookup.tokens if lookup else 0)
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
            if self.lookup is not None:
                self.lookup.extend(row, chunk)
            if self.on_tokens is not None:
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


def _prefill(model, cache, rows, vision, params, generator, k: int, on_hidden=None) -> DecodeState:
    """Prefill runs of equal-length text rows in one forward each, and each image prompt on its own. Returns the
    decode state after the prompts: each row's first sampled token, its rope delta (decoding continues at
    position slot + delta; 0 for text) and, when drafting k > 0 tokens, the drafting state at its last prompt
    position (its cache filled over the prompt). on_hidden(rows, hidden [b, T, H]) sees each run's trunk output."""
    device = model.output_weight.device
    firsts, deltas, draft_hiddens, start = [], [], [], 0
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
        if k and model.mtp_heads is not None:
            heads = head_outputs(model, hidden, inputs.positions, k, view.mtp, slots, kv_len=length)  # [b, T, k, H]
            draft_hiddens.append(heads[:, -1])
        elif k:  # row i: trunk hidden at i and the input after it (a vision embedding at an image token)
            nxt = torch.cat([inputs.embeds[:, 1:], model.embed(first)[:, None]], dim=1)
            mtp_out = model.mtp_step(None, hidden, inputs.positions, 1, view, slots, kv_len=length, embeds=nxt)
            draft_hiddens.append(mtp_out[:, -1])
    lengths = list(map(len, rows))
    return DecodeState(cache=cache, last=torch.cat(firsts), slot=torch.tensor(lengths, device=device),
                       slot_host=lengths, rope_delta=torch.cat(deltas),
                       draft_hidden=torch.cat(draft_hiddens) if k else None)


@torch.inference_mode()
def generate(
    model,
    prompts: torch.Tensor | Sequence[Sequence[int] | dict],
    *,
    max_new_tokens: int,
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
) -> GenerateResult:
    """Decode up to max_new_tokens new tokens per prompt (rows of token ids, or for a vision-language model
    dicts from `mtpkit.image_inputs` with the image patches); draft_tokens=k > 0 drafts k tokens per step with the
    model's MTP module (chained) or its parallel heads 1..k (blockwise, all at once) and verifies them in one
    trunk forward (lossless: greedy output is token for token the same, sampled output has exactly the same
    distribution). `draft_vocab` restricts drafting to those ids; by default the head's own
    (`model.drafter.draft_vocab`, from a head trained with mtp.draft_vocab), "full" drafts over the whole
    vocabulary.
    `draft_min_prob` = p > 0 gates drafting: a row stops after its first draft whose head probability is below p
    (see `speculative.DraftHead`); output is unchanged, fewer drafts are wasted.
    `draft_widths` = (w_1, w_2, ...) verifies a draft tree (`decode/tree.py`): at draft position d the head's
    w_d - 1 next most likely tokens besides the chain's draft (positions past the list: the draft only); the
    trunk must have attention layers only. Output is unchanged; each step verifies 1 + k + sum(w_d - 1) tokens.
    `draft_lookup` = L > 0 drafts up to L tokens from the context where a row's last n tokens (n in
    `draft_lookup_ngram` = (min, max)) occurred before, in place of the MTP's chain (prompt-lookup decoding,
    `decode/lookup.py`); the head's tree alternatives stay. With draft_tokens = 0 it needs no head.
    `on_tokens(row, ids)` is called with every row's new tokens as they are produced (for streaming).
    `on_hidden(rows, hidden [b, n, H])`, plain decoding only, is called with the trunk's post-norm hidden states
    of every token a forward reads (the prompt, then each new token but the last), for those prompt rows: a
    self-distillation run stores them as training features without running the trunk again."""
    params = SamplingParams(temperature, top_k, top_p)
    cfg = model.config
    rows, vision = _prompt_rows(prompts, cfg.vocab_size)
    k = int(draft_tokens)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 and an integer, not {max_new_tokens!r}")
    if k < 0:
        raise ValueError(f"draft_tokens must be >= 0, not {k}")
    if k and model.drafter is None:
        raise ValueError("this model has no MTP head: load one with --mtp or train one (draft_tokens needs it)")
    if model.mtp_heads is not None and k > len(model.mtp_heads.layers):
        raise ValueError(f"draft_tokens = {k} but the model has {len(model.mtp_heads.layers)} parallel heads, one "
                         f"per draft: use draft_tokens <= {len(model.mtp_heads.layers)}")
    if on_hidden is not None and (k or draft_lookup):
        raise ValueError("on_hidden reads the trunk's hidden states of plain decoding: leave draft_tokens and "
                         "draft_lookup at 0")
    if draft_min_prob and not k:
        raise ValueError("draft_min_prob gates speculative drafting: give draft_tokens >= 1 as well")
    widths = tree.normalize_widths(draft_widths, k)
    if any(w > 1 for w in draft_widths) and not k:
        raise ValueError("draft_widths shapes a draft tree: give draft_tokens >= 1 as well")
    if widths and model.mtp_heads is not None:
        raise ValueError("draft_widths extends the sequential MTP's chain; parallel heads draft one block: "
                         "leave draft_widths out")
    if widths and "linear_attention" in cfg.layer_types:
        raise ValueError(f"draft_widths needs a trunk of attention layers, but {cfg.model_type} has Gated DeltaNet "
                         "layers (they read tokens in order and cannot verify a tree): leave draft_widths out")
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
    head = spec.DraftHead(model, params, draft_vocab, draft_min_prob) if k else None
    lookup = None
    if not isinstance(draft_lookup, int) or draft_lookup < 0:
        raise ValueError(f"draft_lookup must be an integer >= 0 (0: off), not {draft_lookup!r}")
    if draft_lookup:
        if k and model.mtp_heads is not None:
            raise ValueError("draft_lookup replaces the sequential MTP's chain; parallel heads draft one block: "
                             "leave draft_lookup out or draft_tokens = 0")
        lookup = ContextLookup(rows, draft_lookup, draft_lookup_ngram)
    if widths and max(widths) > (len(head.vocab) if head.vocab is not None else cfg.vocab_size):
        raise ValueError(f"draft_widths {list(widths)} asks for more tokens per position than the draft vocabulary "
                         "holds")

    book = _Bookkeeper(len(rows), k, max_new_tokens, eos, on_tokens, widths, lookup)
    with routed_linears(router_for(model)):
        return _decode(model, rows, vision, book, params, generator, head, on_hidden)


def _plain_step(model, state: DecodeState, params: SamplingParams, generator) -> StepResult:
    """One trunk forward over each row's last token: one new token per row, nothing drafted."""
    slots = state.slots(1)
    out = model(state.last[:, None], positions=state.rope_positions(slots), cache=state.cache,
                cache_positions=slots, kv_len=state.top_slot + 1)
    none = torch.zeros_like(state.last)
    return StepResult(accepted=none, drafted=none, tokens=select(out.logits[:, 0], params, generator)[:, None],
                      draft_hidden=None, trunk_hidden=out.hidden[:, 0])


def _decode(model, rows, vision, book: _Bookkeeper, params, generator, head, on_hidden=None) -> GenerateResult:
    start = time.perf_counter()
    k, widths, weight = book.k, book.widths, model.output_weight
    most = tree.verified_tokens(widths, book.most)  # tokens a verify forward writes at most
    cache = Cache(model.config, len(rows), max(map(len, rows)) + book.max_new + most, weight.dtype, weight.device)
    state = _prefill(model, cache, rows, vision, params, generator, k, on_hidden)
    keep = book.emit([[t] for t in state.last.tolist()])
    while keep:
        if len(keep) < state.batch:  # some rows stopped: drop them from the batch
            state = state.select(keep)
        context = book.lookup.drafts(book.live, state.slot.device) if book.lookup is not None else None
        matched = context.matched if context is not None else [False] * state.batch
        if k == 0 and context is None:
            result = _plain_step(model, state, params, generator)
        elif widths:
            result = tree.step(model, state, k=k, widths=widths, head=head, params=params, generator=generator,
                               context=context)
        elif model.mtp_heads is not None and k:
            result = blockwise.step(model, state, k=k, head=head, params=params, generator=generator)
        else:
            result = spec.step(model, state, k=k, head=head, params=params, generator=generator, context=context)
        book.forward_passes += 1
        if on_hidden is not None:
            on_hidden(book.live, result.trunk_hidden[:, None])
        # the one device read of the step
        flags = result.alternative if result.alternative is not None else torch.zeros_like(result.accepted)
        host = torch.cat([result.accepted[:, None], result.drafted[:, None], flags[:, None].long(), result.tokens],
                         dim=1).tolist()
        speculated = k or context is not None
        keep = book.emit([h[3 : h[0] + 4] for h in host],
                         [(*h[:3], m) for h, m in zip(host, matched)] if speculated else None)
        state = state.advanced(result, [h[0] for h in host])
    return GenerateResult(book.tokens, book.stats(time.perf_counter() - start), book.accept_lengths)
