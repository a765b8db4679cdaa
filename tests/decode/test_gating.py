"""Confidence-gated drafting (`draft_min_prob`): greedy output stays token for token plain greedy's at several
thresholds, rows of one batch stop drafting at different lengths (verified together, padding never accepted),
draft steps no row needs are skipped, and the stats count only the drafts actually proposed. Sampling
exactness with gating is tested with the other chi-square tests in test_speculative.py."""

import pytest
import torch
from drafting import PROMPTS, drafting_model

import mtpkit
from mtpkit.decode import verify as verification

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3


def unsure_drafting_model(family: str):
    """A drafting model (see `make_drafting`) whose MTP output norm is scaled down to 0.5, so the head's top-1
    probability spreads over (0, 1) instead of sitting near 1: thresholds 0.4-0.6 stop drafts at every depth."""
    model = drafting_model(family)
    norm = model.mtp.norm
    with torch.no_grad():
        norm.weight.copy_(0.5 * (1 + norm.weight) - 1) if norm.zero_centered else norm.weight.mul_(0.5)
    return model


@pytest.fixture(scope="module", params=["qwen3_5", "llama"])
def model(request):
    return unsure_drafting_model(request.param)


@pytest.fixture
def recorded_steps(monkeypatch):
    """Every speculative step's (accepted n, drafted count, verified drafts K) per row, recorded."""
    seen = []

    def recording_verify(model, state, drafts, **named):
        result = verify(model, state, drafts, **named)
        seen.append((result.accepted.clone(), drafts.count.clone(), result.tokens.shape[1] - 1))
        return result

    verify = verification.verify
    monkeypatch.setattr(verification, "verify", recording_verify)
    return seen


def test_gated_greedy_equals_plain_greedy(model):
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=40)
    full = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=K).stats
    lengths_seen = set()
    for p in (0.4, 0.5, 0.6):
        r = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=K, draft_min_prob=p)
        assert r.tokens == plain.tokens, f"p={p}"
        s = r.stats
        lengths = s["draft_lengths"]
        assert sum(lengths) == s["verification_steps"]
        assert s["drafted"] == sum(j * c for j, c in enumerate(lengths, 1)) < K * s["verification_steps"]
        assert s["drafted_per_step"] == pytest.approx(s["drafted"] / s["verification_steps"])
        assert sum(s["accepted_per_position"]) == s["accepted"] <= s["drafted"]
        assert s["mean_acceptance_length"] == pytest.approx(1 + s["accepted"] / s["verification_steps"])
        lengths_seen |= {j for j, c in enumerate(lengths, 1) if c}
        # drafts cut are mostly ones that would have been rejected: acceptance per drafted token rises
        assert s["acceptance_rate"] > full["acceptance_rate"]
    assert lengths_seen == {1, 2, 3}
    assert full["drafted"] == K * full["verification_steps"]
    assert full["draft_lengths"] == [0, 0, full["verification_steps"]]


def test_rows_stop_at_different_lengths_in_one_batch(recorded_steps):
    model = unsure_drafting_model("qwen3_5")  # hybrid GDN: a step's rollback point differs per row
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=40)
    r = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=K, draft_min_prob=0.5)
    assert r.tokens == plain.tokens
    assert all(v == int(c.max()) for _, c, v in recorded_steps)  # the longest row's drafts are verified
    assert any(len(set(c.tolist())) > 1 for _, c, _ in recorded_steps)  # rows of one step stopped apart
    assert any(v < K for _, _, v in recorded_steps)  # every row stopped early: fewer positions, fewer drafts
    # a padding draft is never accepted, even where it equals the trunk's token (the drafts mostly do)
    assert all(bool((n <= c).all()) for n, c, _ in recorded_steps)
    assert any(bool(((n == c) & (c < v)).any()) for n, c, v in recorded_steps)  # bonus after a short draft
    assert r.stats["drafted"] == sum(int(c.sum()) for _, c, _ in recorded_steps)


def test_gating_changes_nothing_at_zero_and_rejects_bad_thresholds(model):
    a = mtpkit.generate(model, PROMPTS, max_new_tokens=20, draft_tokens=K)
    b = mtpkit.generate(model, PROMPTS, max_new_tokens=20, draft_tokens=K, draft_min_prob=0.0)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    with pytest.raises(ValueError, match=r"draft_min_prob must be in \[0, 1\]"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_tokens=K, draft_min_prob=1.5)
    with pytest.raises(ValueError, match="give draft_tokens >= 1"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_min_prob=0.5)
