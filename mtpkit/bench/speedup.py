"""`mtpkit bench`: plain vs MTP self-speculative decoding side by side on real prompts.

For every prompt, plain decoding and speculative decoding with each k run one after the other (after a warm-up,
in an order that alternates between repeats), their outputs are compared token for token, and each timing is the
median over the repeats. tokens/s of a configuration = all its new tokens / the sum of its per-prompt medians.
Acceptance metrics are vLLM's (docs/MTP.md section 4), summed over prompts. Each speculative row also gets the
mean acceptance length at which it would break even, from step costs timed separately (`break_even`): the
speedup it achieves is about its mean acceptance length / that figure.
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from ..decode.draft_spec import DraftSpec
from ..decode.generate import generate
from ..decode.tree import verified_tokens
from ..prompts import Prompt
from .decode_step import step_costs
from .hf_baseline import hf_generate


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure_step_costs(model, k: int, context: int, repeats: int, verified: int = 0) -> dict[int, dict]:
    """Median ms of a decode step, and for L = 1..k of a verify step over L+1 tokens and of drafting L tokens
    (over the head's draft vocabulary when it carries one, as generate drafts), at `context` tokens of cache
    (`decode_step.step_costs`, the micro-benchmark of docs/MTP.md section 4); L runs on to verified - 1 where
    a draft tree verifies up to `verified` tokens (a tree's verify costs a chain's of as many tokens)."""
    subset = getattr(model.drafter, "draft_vocab", None)
    vocab = len(subset) if subset is not None else min(4096, model.config.vocab_size)
    rows = step_costs(model, list(range(1, max(k, verified - 1) + 1)), repeats, context, vocab)
    drafting = "full" if subset is None else "subset"
    return {r["k"]: {"k": r["k"], "decode": r["decode"], "verify": r["verify"], "draft": r[drafting]} for r in rows}


def break_even(costs: dict[int, dict], draft_lengths: list[float], widths: tuple[int, ...] = ()) -> float:
    """The mean acceptance length at which speculation matches plain decoding: a step that drafts L tokens
    costs verify(T_L) + draft(L) and a plain step decode(1), weighted by the share of steps that drafted L
    (all k without gating); T_L = L + 1 for a chain, plus the alternatives of a draft tree."""
    step = sum(f * (costs[verified_tokens(widths, L) - 1]["verify"] + costs[L]["draft"])
               for L, f in enumerate(draft_lengths, 1) if f)
    return step / costs[1]["decode"]


def run_bench(model, prompts: list[Prompt], *, num_tokens: int, specs: list[DraftSpec], temperature: float = 0.0,
              repeats: int = 3, seed: int = 0, eos_token_id=None, hf_model=None, baselines=("hf",),
              prompt_lookup: int = 10, step_repeats: int = 5, progress: bool = True) -> dict:
    """Measure every prompt under plain decoding, speculative decoding for each of `specs` (`DraftSpec.grid`)
    and, with hf_model, the transformers baselines ("hf": greedy generate(), "pld": with prompt_lookup_num_tokens =
    prompt_lookup). step_repeats > 0 also times the step costs behind each row's break-even acceptance length,
    at the prompts' median length + num_tokens / 2. Returns the per-prompt and per-row figures (see `summarise`)."""
    extra = list(baselines) if hf_model is not None else []
    configs = [0, *specs, *extra]

    def once(cfg, p: Prompt):
        if cfg in ("hf", "pld"):
            lookup = prompt_lookup if cfg == "pld" else 0
            return _timed(lambda: (hf_generate(hf_model, p.ids, num_tokens, eos_token_id, lookup), None))
        res, sec = _timed(lambda: generate(model, [p.inputs or p.ids], max_new_tokens=num_tokens,
                                           draft=cfg or None, temperature=temperature, seed=seed,
                                           eos_token_id=eos_token_id))
        return (res.tokens[0], res.stats), sec

    for cfg in configs:  # warm-up: first-call allocations and lazy initialisation stay out of the timings
        once(cfg, prompts[0])
    # the decode router times its candidates the first time it sees a row count, and a prefill of up to 16 tokens is
    # one: each other prompt length's prefill runs once here, or the first timed run of that length pays for it
    for p in {len(p.ids): p for p in prompts[1:]}.values():
        generate(model, [p.inputs or p.ids], max_new_tokens=1, eos_token_id=eos_token_id)
    seconds = {(cfg, i): [] for cfg in configs for i in range(len(prompts))}
    outputs = {}
    bar = tqdm(total=repeats * len(prompts) * len(configs), desc="bench", unit="run", disable=not progress)
    for r in range(repeats):
        order = configs if r % 2 == 0 else configs[::-1]  # alternate, so drift hits every configuration alike
        for i, p in enumerate(prompts):
            for cfg in order:
                outputs[cfg, i], sec = once(cfg, p)
                seconds[cfg, i].append(sec)
                bar.update()
    bar.close()
    median = {key: statistics.median(v) for key, v in seconds.items()}
    costs = None
    if step_repeats:
        context = int(statistics.median(len(p.ids) for p in prompts)) + num_tokens // 2
        most = max(s.most_verified for s in specs)
        costs = measure_step_costs(model, max(s.draft_tokens for s in specs), context, step_repeats, most)
    greedy = temperature == 0
    gaps = first_differences(model, prompts, outputs, [*specs, *extra]) if greedy else {}
    report = summarise(prompts, specs, outputs, median, baselines=extra, greedy=greedy, costs=costs, gaps=gaps)
    if "pld" in extra:
        report["prompt_lookup_num_tokens"] = prompt_lookup
    return report


@torch.inference_mode()
def first_differences(model, prompts: list[Prompt], outputs: dict, configs: list) -> dict:
    """For each (config, prompt) whose greedy output differs from plain decoding's: the first differing position
    and the plain model's top-2 logit gap there (one full forward over prompt + the common prefix, in the model's
    dtype). A gap at the logits' rounding step shows a tie broken by rounding (bf16 logits near 20 resolve steps
    of 0.125), not a bug."""
    gaps = {}
    for cfg in configs:
        for i, p in enumerate(prompts):
            plain, other = outputs[0, i][0], outputs[cfg, i][0]
            if other == plain or p.inputs is not None:
                continue
            j = next((t for t, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
            logits = model(torch.tensor([p.ids + plain[:j]])).logits[0, -1].float()
            top = logits.topk(2)
            gaps[cfg, i] = {"position": j, "top2_gap": float(top.values[0] - top.values[1]),
                            "top1": float(top.values[0]), "other_is_top2": j < len(other)
                            and int(top.indices[1]) == other[j]}
    return gaps


def _rate(tokens: int, sec: float) -> float:
    return tokens / sec if sec > 0 else 0.0


def acceptance_figures(spec: DraftSpec, stats: list[dict]) -> dict:
    """A speculative row's drafting knobs and its vLLM acceptance figures summed over the `generate` stats of its
    runs (one per prompt, or per batch of prompts)."""
    most = spec.most_drafts
    steps = sum(s["verification_steps"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    drafted = sum(s["drafted"] for s in stats)
    return {
        "draft_tokens": spec.draft_tokens,
        "draft_min_prob": spec.draft_min_prob,
        "draft_widths": list(spec.draft_widths),
        "draft_lookup": spec.draft_lookup,
        "auto": spec.auto,
        "context_drafted_share": sum(s["context_drafted_steps"] for s in stats) / max(steps, 1),
        "verified_tokens_per_step": sum((s["verified_tokens_per_step"] or 0) * s["verification_steps"]
                                        for s in stats) / max(steps, 1),
        "accepted_alternatives": sum(s["accepted_alternatives"] for s in stats),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "accepted_per_position": [sum(s["accepted_per_position"][j] for s in stats) / max(steps, 1)
                                  for j in range(most)],
        "drafted_per_step": drafted / steps if steps else 0.0,
        # share of steps that proposed j = 1..k drafts (the stop distribution)
        "draft_lengths": [sum(s["draft_lengths"][j] for s in stats) / max(steps, 1) for j in range(most)],
        "verification_steps": steps,
    }


def summarise(prompts, specs, outputs, median, *, baselines=(), greedy: bool, costs=None, gaps=None) -> dict:
    n = len(prompts)
    base_tokens = [len(outputs[0, i][0]) for i in range(n)]
    base_tps = _rate(sum(base_tokens), sum(median[0, i] for i in range(n)))
    runs = []
    for cfg in specs:
        stats = [outputs[cfg, i][1] for i in range(n)]
        figures = acceptance_figures(cfg, stats)
        spec_tokens = [len(outputs[cfg, i][0]) for i in range(n)]
        spec_tps = _rate(sum(spec_tokens), sum(median[cfg, i] for i in range(n)))
        per_prompt = []
        for i, p in enumerate(prompts):
            s = stats[i]
            per_prompt.append({
                "prompt": p.text, "kind": p.kind, "chat": p.chat,
                "baseline_tokens_per_s": _rate(base_tokens[i], median[0, i]),
                "spec_tokens_per_s": _rate(spec_tokens[i], median[cfg, i]),
                "speedup": _rate(spec_tokens[i], median[cfg, i]) / max(_rate(base_tokens[i], median[0, i]), 1e-9),
                "acceptance_rate": s["acceptance_rate"],
                "mean_acceptance_length": s["mean_acceptance_length"],
                "identical": outputs[cfg, i][0] == outputs[0, i][0] if greedy else None,
                "first_difference": (gaps or {}).get((cfg, i)),
            })
        lengths = figures["draft_lengths"]
        runs.append({
            **figures,
            "prompts": n,
            "baseline_tokens_per_s": base_tps,
            "spec_tokens_per_s": spec_tps,
            "speedup": spec_tps / base_tps if base_tps else 0.0,
            # a step's drafting cost depends on where its drafts came from, which the stop distribution does not say
            "break_even": break_even(costs, lengths, cfg.draft_widths) if costs and any(lengths)
            and not cfg.draft_lookup else None,
            # what a step cost in plain steps in these very runs: steadier than break_even, whose step costs are
            # timed apart, with fewer repeats (docs/MTP.md section 6: ~20% jitter on the 2-core VM)
            "realised_break_even": figures["mean_acceptance_length"] * base_tps / spec_tps if spec_tps else None,
            "identical": all(pp["identical"] for pp in per_prompt) if greedy else None,
            "identical_prompts": sum(bool(pp["identical"]) for pp in per_prompt),
            "per_prompt": per_prompt,
        })
    samples = [{"prompt": p.text, "output_ids": outputs[0, i][0]} for i, p in enumerate(prompts)]
    report = {"runs": runs, "samples": samples}
    if costs:
        report["step_costs_ms"] = list(costs.values())
    for name in baselines:
        same = [outputs[name, i][0] == outputs[0, i][0] for i in range(n)]
        report[f"{name}_tokens_per_s"] = _rate(sum(len(outputs[name, i][0]) for i in range(n)),
                                               sum(median[name, i] for i in range(n)))
        report[f"{name}_identical"] = all(same) if greedy else None
        report[f"{name}_identical_prompts"] = sum(same)
        report[f"{name}_first_differences"] = [(gaps or {}).get((name, i)) for i in range(n)]
    return report
