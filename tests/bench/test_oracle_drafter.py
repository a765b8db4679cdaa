"""The oracle drafter: at rate 1 every draft of a plain run's own continuation is accepted (k + 1 tokens a step),
at rate 0 none, at rate r each draft is kept given the ones before with probability r; output stays plain
greedy's."""

import pytest
from drafting import PROMPTS, drafting_model

import mtpkit
from mtpkit.bench.oracle_drafter import oracle
from mtpkit.decode.draft_spec import DraftSpec

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def case():
    model = drafting_model("qwen3_5")
    return model, mtpkit.generate(model, PROMPTS, max_new_tokens=60).tokens


@pytest.mark.parametrize("k", [1, 3])
def test_at_rate_one_every_draft_is_accepted(case, k):
    model, plain = case
    got = mtpkit.generate(model, PROMPTS, max_new_tokens=60, draft=DraftSpec(k), drafter=oracle(plain))
    assert got.tokens == plain
    s = got.stats
    assert s["accepted"] == s["drafted"]  # drafts run out at the end of each continuation, never rejected
    assert s["mean_acceptance_length"] > k + 1 - 0.1


def test_at_rate_r_each_draft_is_kept_with_probability_r(case):
    model, plain = case
    none = mtpkit.generate(model, PROMPTS, max_new_tokens=60, draft=DraftSpec(3), drafter=oracle(plain, 0.0))
    assert none.tokens == plain and none.stats["accepted"] == 0
    half = mtpkit.generate(model, PROMPTS * 8, max_new_tokens=60, draft=DraftSpec(2),
                           drafter=oracle(plain * 8, 0.5, seed=1))
    assert half.tokens == plain * 8
    p1, p2 = half.stats["per_position_acceptance"]
    assert 0.42 < p1 < 0.58 and 0.42 < p2 / p1 < 0.58


def test_bad_oracles_are_refused(case):
    model, plain = case
    with pytest.raises(ValueError, match="rate must be in"):
        oracle(plain, 1.5)
    with pytest.raises(ValueError, match="greedy decoding only"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=8, draft=DraftSpec(2), drafter=oracle(plain), temperature=1.0)
    with pytest.raises(ValueError, match="2 continuations for 3 prompts"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=8, draft=DraftSpec(2), drafter=oracle(plain[:2]))
