"""`mtpkit bench --acceptance-only`: how far a head's drafts are accepted, without timing anything.

Comparing heads (or a head on a user's own prompts) needs the acceptance figures, not the speed: each speculative
row decodes every prompt once, many prompts per batch (`generate` batches rows of any length), with no plain runs,
warm-up or repeats (20 held-out prompts, 4 rows: 193 s on the 2-core EPYC, where the timed benchmark of 5 rows
took 10 minutes). The figures are the timed benchmark's (vLLM's, summed over the prompts:
`speedup.acceptance_figures`) plus the mean tokens kept per verification step for each prompt kind, since heads
differ most between kinds of text.
"""

from __future__ import annotations

import statistics

from tqdm import tqdm

from ..decode.draft_spec import DraftSpec
from ..decode.generate import generate
from ..prompts import Prompt
from .report import RULE, label
from .speedup import acceptance_figures


def run_acceptance(model, prompts: list[Prompt], *, num_tokens: int, specs: list[DraftSpec], temperature: float = 0.0,
                   seed: int = 0, eos_token_id=None, batch_size: int = 16, progress: bool = True) -> dict:
    """Every speculative row of `specs` (`DraftSpec.grid`) over all prompts in batches of `batch_size`. Returns
    {"runs": [figures + per_kind {kind: mean tokens per step}], "prompts": n}."""
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    bar = tqdm(total=len(specs) * len(prompts), desc="acceptance", unit="prompt", disable=not progress)
    runs = []
    for spec in specs:
        stats, kept = [], {}
        for group in batches:
            res = generate(model, [p.inputs or p.ids for p in group], max_new_tokens=num_tokens, draft=spec,
                           temperature=temperature, seed=seed, eos_token_id=eos_token_id)
            stats.append(res.stats)
            for p, row in zip(group, res.accept_lengths):
                kept.setdefault(p.kind, []).extend(row)
            bar.update(len(group))
        per_kind = {kind: statistics.mean(v) for kind, v in sorted(kept.items()) if v}
        runs.append({**acceptance_figures(spec, stats), "prompts": len(prompts), "per_kind": per_kind})
    bar.close()
    return {"runs": runs, "prompts": len(prompts), "batch_size": batch_size}


def render_acceptance(report: dict) -> str:
    """Plain-text table: per row, acceptance rate, mean acceptance length, per-position acceptance, and the mean
    tokens kept per verification step for each prompt kind."""
    runs = report["runs"]
    kinds = sorted({kind for r in runs for kind in r["per_kind"]})
    mode = "greedy" if report["temperature"] == 0 else f"temperature {report['temperature']}"
    width = max(len(label(r)) for r in runs)
    head = (f"  {'row':<{width}} {'accept':>7} {'mean len':>9}  {'per-position acceptance':<24}"
            + "".join(f" {kind[:8]:>8}" for kind in kinds))
    lines = [RULE, f"  MTP acceptance (no timing) — {report['model']}, head {report['mtp_head']}", RULE,
             f"  {mode} · {report['dtype']} · {report['device']} · {report['num_tokens']} tokens/prompt · "
             f"{report['prompts']} prompts, decoded {report['batch_size']} at a time",
             "  per kind: mean tokens kept per verification step over that kind's prompts", "",
             head, "  " + "-" * (len(head) - 2)]
    for r in runs:
        pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
        lines.append(f"  {label(r):<{width}} {r['acceptance_rate']:>6.0%} {r['mean_acceptance_length']:>9.2f}  "
                     f"{pos:<24}" + "".join(f" {r['per_kind'][kind]:>8.2f}" if kind in r["per_kind"] else
                                            f" {'-':>8}" for kind in kinds))
    lines.append(RULE)
    return "\n".join(lines)
