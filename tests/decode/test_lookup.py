"""Drafts looked up in the context (`draft_lookup`, decode/drafters/context_lookup.py): the index proposes what
followed the latest earlier occurrence of the longest matching suffix; greedy output equals plain greedy token for token (batched, with
and without a head, chains, trees, a Gated DeltaNet trunk) while context drafts are used and kept; sampling keeps
the trunk's law exactly (shown to fail when a looked-up draft is treated as drawn from the head); bad options are
one-line errors."""

import pytest
import torch
from drafting import PROMPTS, drafting_model, parallel_drafting_model
from sampling_stats import chi2_pvalue, empirical_counts, exact_joint

import mtpkit
from mtpkit.decode.drafters import context_lookup
from mtpkit.decode.drafters.context_lookup import ContextLookup
from mtpkit.decode.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    seq = [7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]  # suffix 1 2 3 occurred at 1-3; 2 3 also at 6-7 (later)
    lookup = ContextLookup([seq], tokens=4, ngram=(2, 4))
    assert lookup.propose(0) == [9, 5, 2, 3]  # the 3-gram wins over the later 2-gram
    assert ContextLookup([seq], tokens=4, ngram=(2, 2)).propose(0) == [8, 1, 2, 3]  # the latest 2-gram
    assert ContextLookup([seq], tokens=2, ngram=(2, 4)).propose(0) == [9, 5]
    assert ContextLookup([[1, 2, 3, 4]], tokens=4).propose(0) == []  # nothing repeats
    assert ContextLookup([[5, 6, 5]], tokens=4, ngram=(2, 3)).propose(0) == []  # a 1-gram is below min
    assert ContextLookup([[5, 6, 5]], tokens=4, ngram=(1, 3)).propose(0) == [6, 5]  # drafts run up to the end
    # a run of one token: its own suffix is not a match, the one before is
    assert ContextLookup([[4, 4, 4]], tokens=3, ngram=(2, 2)).propose(0) == [4]


def test_growing_a_row_step_by_step_indexes_as_building_it_at_once():
    torch.manual_seed(0)
    seq = torch.randint(0, 5, (60,)).tolist()
    grown = ContextLookup([seq[:7], seq[:3]], tokens=5, ngram=(1, 4))
    at = 7
    for n in (1, 3, 2, 1, 5, 1):
        grown.extend(0, seq[at : at + n])
        at += n
        whole = ContextLookup([seq[:at]], tokens=5, ngram=(1, 4))
        assert grown.propose(0) == whole.propose(0) and grown.ends[0] == whole.ends[0]
    found = grown.drafts([1, 0], "cpu")
    assert found is not None and found.matched == [bool(grown.propose(1)), True]
    assert found.count.tolist() == [len(grown.propose(1)), len(grown.propose(0))]
    assert found.tokens[1, : found.count[1]].tolist() == grown.propose(0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return drafting_model(request.param)


def test_greedy_with_context_drafts_equals_plain_greedy(model):
    """The drafting models walk a permutation of 32 tokens, so their text repeats: context drafts are proposed,
    kept and sometimes rejected (the trunk leaves its walk), next to the head's chain and tree."""
    for n in (1, 3):
        plain = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=48).tokens
        for k, widths in [(0, ()), (1, ()), (1, (3,)), (3, ()), (2, (3, 2))]:
            for lookup in (2, 5):
                r = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=48, draft_tokens=k, draft_widths=widths,
                                    draft_lookup=lookup)
                assert r.tokens == plain, (n, k, widths, lookup)
                s = r.stats
                assert 0 < s["context_drafted_steps"] <= s["verification_steps"] and s["accepted"] <= s["drafted"]
                assert len(s["accepted_per_position"]) == max(k, lookup)
                if k == 0:  # only steps that found drafts are verification steps
                    assert s["verification_steps"] == s["context_drafted_steps"]


def test_context_drafts_lengthen_the_steps_and_keep_the_heads_first_choice():
    """With lookup a step keeps more tokens than the head's chain alone; a matched row whose looked-up draft is
    rejected still keeps the head's first choice, which a tree verifies as an alternative."""
    model = drafting_model("llama")
    chain = mtpkit.generate(model, PROMPTS, max_new_tokens=64, draft_tokens=1)
    both = mtpkit.generate(model, PROMPTS, max_new_tokens=64, draft_tokens=1, draft_lookup=4)
    assert chain.tokens == both.tokens
    assert both.stats["mean_acceptance_length"] > chain.stats["mean_acceptance_length"]
    model = drafting_model("llama", noise=0.5, seed=1)  # a trunk that leaves its walk often: drafts are rejected
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=64).tokens
    seen = []

    def recording(drafts, context, vocab_size):
        out = with_context(drafts, context, vocab_size)
        seen.append((drafts, context, out))
        return out

    with_context = context_lookup.with_context
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(context_lookup, "with_context", recording)
        tree = mtpkit.generate(model, PROMPTS, max_new_tokens=64, draft_tokens=1, draft_widths=(3,), draft_lookup=4)
    assert tree.tokens == plain and tree.stats["accepted_alternatives"] > 0
    swapped = 0
    for drafts, context, out in seen:
        for b in range(len(context.count)):
            top = [int(drafts.tokens[b, 0]), *drafts.alternatives[b].tolist()]
            if context.count[b] == 0:
                assert out.tokens[b, : drafts.tokens.shape[1]].tolist() == drafts.tokens[b].tolist()
                continue
            chain0, n = int(context.tokens[b, 0]), int(context.count[b])
            assert out.tokens[b, :n].tolist() == context.tokens[b, :n].tolist()
            assert out.alternatives[b].tolist() == [t for t in top if t != chain0][:2]
            swapped += chain0 != top[0]
    assert swapped > 0  # rows where the head's first choice became an alternative


def test_gdn_trunks_verify_context_chains():
    model = drafting_model("qwen3_5")
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=40).tokens
    for k in (0, 2):
        r = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=k, draft_lookup=4)
        assert r.tokens == plain and r.stats["context_drafted_steps"] > 0


def test_a_model_without_a_head_drafts_from_its_context():
    model = drafting_model("llama", mtp_layers=0)
    assert model.drafter is None
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=40).tokens
    r = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_lookup=6)
    assert r.tokens == plain and r.stats["mean_acceptance_length"] > 1.5 and r.stats["context_drafted_steps"] > 0
    assert r.stats["forward_passes"] < 39  # plain decoding takes 39 forwards after the prefill


@pytest.fixture(scope="module")
def sampling_case():
    """A prompt that repeats the model's own greedy walk, and 1-gram matches, so most rows find context drafts;
    the trunk departs from its walk often (noise 1.0), so at temperature 0.8 most of them are rejected. With the
    exact law of 3 new tokens."""
    model = drafting_model("llama", noise=1.0, seed=3)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    walk = [3, *mtpkit.generate(model, [[3]], max_new_tokens=5).tokens[0]]
    prompt = walk + walk + [3]
    return model, params, prompt, exact_joint(model, prompt, params, 3)


LOOKUP = dict(draft_lookup=3, draft_lookup_ngram=(1, 3))


@pytest.mark.parametrize("k, widths", [(0, ()), (1, (3,)), (2, ())])
def test_sampling_with_context_drafts_matches_the_exact_distribution(sampling_case, k, widths):
    model, params, prompt, joint = sampling_case
    counts, stats = empirical_counts(model, params, prompt, k, seed=k, draft_widths=widths, **LOOKUP)
    assert chi2_pvalue(counts, joint) > 1e-3
    assert stats["context_drafted_steps"] > 5000 and stats["accepted"] > 300


def test_the_sampling_test_fails_when_looked_up_drafts_count_as_drawn(sampling_case, monkeypatch):
    """Accepting a looked-up draft d with probability min(1, p(d) / q(d)) for a q other than its point mass
    (here uniform) biases the output towards the context: caught."""
    model, params, prompt, joint = sampling_case
    monkeypatch.setattr(context_lookup, "point_masses", lambda tokens, V, dtype: torch.full((*tokens.shape, V), 1 / V))
    counts, _ = empirical_counts(model, params, prompt, 0, seed=2, **LOOKUP)
    assert chi2_pvalue(counts, joint) < 1e-6


def test_bad_lookup_options_are_one_line_errors(model):
    with pytest.raises(ValueError, match="draft_lookup must be an integer >= 0"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_lookup=-1)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_lookup=3, draft_lookup_ngram=(3, 2))
    with pytest.raises(ValueError, match="1 <= min <= max"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_lookup=3, draft_lookup_ngram=(2,))
    with pytest.raises(ValueError, match="parallel heads draft one block"):
        mtpkit.generate(parallel_drafting_model("llama"), PROMPTS, max_new_tokens=4, draft_tokens=2, draft_lookup=3)
