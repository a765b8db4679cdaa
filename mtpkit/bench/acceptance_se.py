"""Acceptance per prompt, with standard errors: how sure a comparison of two heads (or two trunks) is.

The mean acceptance length is vLLM's ratio, tokens kept over verification steps summed over the prompts. Its
standard error over prompts is the ratio estimator's (the delta method): with t_i tokens in s_i steps for prompt i
and R = sum t / sum s, the residuals z_i = (t_i - R s_i) / mean(s) have R's sampling variance var(z) / n. Two
models measured on the same prompts are compared through the difference of their residuals per prompt (paired),
which removes the prompts' own spread from the comparison.
"""

from __future__ import annotations

import math
import statistics

from ..decode.generate import generate


def decode_rows(model, rows: list[list[int]], *, k: int, num_tokens: int, eos_token_id=None, batch_size: int = 64,
                draft_vocab=None) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Greedy decoding of every row at k draft tokens (0: plain), `batch_size` rows at a time. Returns each row's
    new tokens, the tokens kept per verification step of each row, and the accepted drafts per draft position
    (summed over rows)."""
    tokens, lengths, per_position = [], [], [0] * k
    for s in range(0, len(rows), batch_size):
        res = generate(model, rows[s : s + batch_size], max_new_tokens=num_tokens, draft_tokens=k,
                       eos_token_id=eos_token_id, draft_vocab=draft_vocab)
        tokens.extend(res.tokens)
        lengths.extend(res.accept_lengths)
        if k:
            per_position = [a + b for a, b in zip(per_position, res.stats["accepted_per_position"])]
    return tokens, lengths, per_position


def length_figures(lengths: list[list[int]], per_position: list[int]) -> dict:
    """Mean acceptance length, its SE over prompts, and the acceptance rate per draft position."""
    mean, se = mean_length_se(lengths)
    steps = sum(map(len, lengths))
    return {"mean_acceptance_length": mean, "se": se, "accepted_per_position": [a / steps for a in per_position]}


def _residuals(lengths: list[list[int]]) -> tuple[float, list[float]]:
    kept = [sum(row) for row in lengths]
    steps = [len(row) for row in lengths]
    ratio = sum(kept) / sum(steps)
    mean_steps = statistics.mean(steps)
    return ratio, [(t - ratio * s) / mean_steps for t, s in zip(kept, steps)]


def mean_length_se(lengths: list[list[int]]) -> tuple[float, float]:
    """(mean acceptance length, its standard error over prompts). Prompts without a step are left out."""
    lengths = [row for row in lengths if row]
    ratio, z = _residuals(lengths)
    return ratio, (statistics.stdev(z) / math.sqrt(len(z)) if len(z) > 1 else float("nan"))


def paired_difference_se(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(mean length of a - that of b, its standard error), a and b measured on the same prompts in order."""
    if len(a) != len(b):
        raise ValueError(f"paired figures need the same prompts: {len(a)} rows against {len(b)}")
    keep = [i for i in range(len(a)) if a[i] and b[i]]
    ra, za = _residuals([a[i] for i in keep])
    rb, zb = _residuals([b[i] for i in keep])
    d = [x - y for x, y in zip(za, zb)]
    return ra - rb, (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan"))


def kept_tokens(figures: dict) -> dict[str, list[int]]:
    """Tokens kept per prompt at each draft count of one head's figures on one prompt set ({"k1": {"lengths": ...},
    ...}): lossless drafting keeps the same tokens whatever the head, so two heads' counts match on the same prompts."""
    return {key: [sum(steps) for steps in f["lengths"]] for key, f in figures.items()
            if isinstance(f, dict) and "lengths" in f}


def pair_with_first(result: dict) -> list[tuple[str, str, dict]]:
    """Each head of `result` ({head: {set: {"k1": {"lengths": ...}, ...}}}) after the first, paired with the first
    over the same prompts: writes {"difference", "se"} into its figures as "minus_<first>" at each draft count and
    returns (head, set, {draft count: pair}) in order. Counts of kept tokens that differ mean other prompts or settings
    (a ValueError), not another head."""
    base, *others = result
    rows = []
    for name in others:
        for set_name, figures in result[name].items():
            kept = kept_tokens(figures)
            if set_name not in result[base] or kept != kept_tokens(result[base][set_name]):
                raise ValueError(f"{name} and {base} kept other token counts in {set_name} (lossless drafting keeps "
                                 "the same): measure both on the same prompts, size and --eval-tokens")
            paired = {}
            for key in kept:
                diff, se = paired_difference_se(figures[key]["lengths"], result[base][set_name][key]["lengths"])
                paired[key] = figures[key][f"minus_{base}"] = {"difference": diff, "se": se}
            rows.append((name, set_name, paired))
    return rows
