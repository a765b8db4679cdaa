"""Acceptance with standard errors: the ratio estimator's SE matches the spread of the ratio over resampled prompt
sets, pairing removes the prompts' own spread from a comparison, and heads measured apart are paired only on the same
tokens kept."""

from __future__ import annotations

import random
import statistics

import pytest

from mtpkit.bench.acceptance_se import mean_length_se, pair_with_first, paired_difference_se


def _prompts(rng, n, p_accept, difficulty):
    """n prompts of 20-60 steps at k = 3; prompt i accepts each draft with p_accept - difficulty[i]."""
    rows = []
    for i in range(n):
        p = min(max(p_accept - difficulty[i], 0.0), 1.0)
        row = []
        for _ in range(rng.randint(20, 60)):
            kept = 1
            while kept < 4 and rng.random() < p:
                kept += 1
            row.append(kept)
        rows.append(row)
    return rows


def test_mean_is_vllms_ratio_and_se_matches_resampling():
    rng = random.Random(0)
    difficulty = [rng.uniform(-0.2, 0.3) for _ in range(200)]
    rows = _prompts(rng, 200, 0.5, difficulty)
    mean, se = mean_length_se(rows)
    assert mean == pytest.approx(sum(map(sum, rows)) / sum(map(len, rows)))
    means = []  # the spread of the ratio over prompt sets drawn again from the same prompts
    for _ in range(400):
        sample = [rows[rng.randrange(len(rows))] for _ in rows]
        means.append(sum(map(sum, sample)) / sum(map(len, sample)))
    assert se == pytest.approx(statistics.stdev(means), rel=0.15)


def test_pairing_removes_the_prompts_spread():
    rng = random.Random(1)
    difficulty = [rng.uniform(-0.3, 0.4) for _ in range(150)]  # prompts differ far more than the two models
    a = _prompts(rng, 150, 0.55, difficulty)
    b = _prompts(rng, 150, 0.50, difficulty)
    diff, se = paired_difference_se(a, b)
    assert diff == pytest.approx(mean_length_se(a)[0] - mean_length_se(b)[0])
    unpaired = (mean_length_se(a)[1] ** 2 + mean_length_se(b)[1] ** 2) ** 0.5
    assert se < 0.8 * unpaired
    assert diff > 2 * se  # the planted gap of 0.05 per draft shows
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference_se(a, b[:-1])


def _steps(rng, total, p_accept, k):
    """`total` tokens split into verification steps that keep 1 + (drafts accepted) each, the last cut to fit."""
    row = []
    while total > 0:
        kept = 1
        while kept < k + 1 and rng.random() < p_accept:
            kept += 1
        row.append(min(kept, total))
        total -= row[-1]
    return row


def test_pair_with_first_pairs_each_head_and_refuses_other_prompts():
    rng = random.Random(2)
    totals = [rng.randint(30, 90) for _ in range(60)]  # tokens kept per prompt: the same for every head

    def head(p):
        return {"set": {"prompts": len(totals),
                        **{f"k{k}": {"lengths": [_steps(rng, t, p, k) for t in totals]} for k in (1, 3)}}}

    result = {"base": head(0.4), "better": head(0.6), "same": head(0.4)}
    rows = pair_with_first(result)
    assert [(name, s) for name, s, _ in rows] == [("better", "set"), ("same", "set")]
    for name, _, paired in rows:
        for key in ("k1", "k3"):
            expected = paired_difference_se(result[name]["set"][key]["lengths"], result["base"]["set"][key]["lengths"])
            assert (paired[key]["difference"], paired[key]["se"]) == expected
            assert result[name]["set"][key]["minus_base"] is paired[key]
    better, same = rows[0][2]["k3"], rows[1][2]["k3"]
    assert better["difference"] > 3 * better["se"] and abs(same["difference"]) < 3 * same["se"]
    result["other"] = head(0.6)
    result["other"]["set"]["k1"]["lengths"][0].append(1)  # one token more on one prompt: not the same prompts
    with pytest.raises(ValueError, match="other token counts in set"):
        pair_with_first(result)
