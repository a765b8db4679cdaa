"""Blockwise parallel decoding with parallel heads: greedy output equals plain greedy token for token (hybrid and
plain trunks, k = 1..3, a batch of prompts of different lengths, gated drafting), every draft is the heads'
prediction on the accepted tokens (their caches follow what was kept), and sampling keeps the trunk's
distribution exactly (chi-square against the exact law, shown to fail for a wrong rejection rule)."""

import pytest
import torch
from drafting import CONFIGS, PROMPTS, make_drafting, parallel_drafting_model
from sampling_stats import chi2_pvalue, empirical_counts, exact_joint

import mtpkit
from mtpkit.decode import verify as verification
from mtpkit.decode.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_5", "llama"])
def model(request):
    return parallel_drafting_model(request.param)


def test_greedy_blockwise_equals_plain_greedy(model):
    plain = {n: mtpkit.generate(model, PROMPTS[:n], max_new_tokens=40) for n in (1, 3)}
    partial = False
    for k in (1, 2, 3):
        for n in (1, 3):  # one prompt, and three of lengths 7, 3 and 12
            r = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=40, draft_tokens=k)
            assert r.tokens == plain[n].tokens, f"k={k}, batch {n}"
            s = r.stats
            assert 0 < s["accepted"] < s["drafted"] == k * s["verification_steps"], f"k={k}, batch {n}"
            assert s["new_tokens"] == 40 * n and sum(s["accepted_per_position"]) == s["accepted"]
            partial |= any(1 < a <= k for row in r.accept_lengths for a in row)
    assert partial  # some step kept several drafts but not all: the GDN state rolled back mid-history
    gated = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=3, draft_min_prob=0.9)
    assert gated.tokens == plain[3].tokens and gated.stats["drafted"] < 3 * gated.stats["verification_steps"]


def test_drafts_are_the_heads_predictions_on_the_accepted_tokens(monkeypatch):
    """Every draft of every step equals head j's teacher-forced argmax at the last emitted token's predecessor on
    the final (accepted) sequence: the heads' caches hold the accepted rows, whatever was rejected before."""
    model = parallel_drafting_model("qwen3_5")
    seen = []

    def recording_verify(model_, state, drafts, **named):
        seen.append((state.slot.clone(), drafts.tokens.clone()))
        return verify(model_, state, drafts, **named)

    verify = verification.verify
    monkeypatch.setattr(verification, "verify", recording_verify)
    r = mtpkit.generate(model, PROMPTS[:1], max_new_tokens=30, draft_tokens=3)
    seq = torch.tensor([PROMPTS[0] + r.tokens[0]])
    with torch.no_grad():
        hidden = model(seq, return_logits=False).hidden
        ctx = model.context(torch.arange(seq.shape[1])[None])
        tf = torch.stack([model.logits(model.mtp_heads(model, hidden, ctx, j))[0].argmax(-1) for j in (1, 2, 3)], 1)
    assert len(seen) > 3 and r.stats["accepted"] < r.stats["drafted"]
    for pos, drafts in seen:  # pos: slot of the last emitted token; row pos-1's head j predicts token pos+j
        assert drafts[0].tolist() == tf[int(pos[0]) - 1].tolist()


def test_more_drafts_than_heads_is_an_error(model):
    with pytest.raises(ValueError, match="3 parallel heads, one per draft: use draft_tokens <= 3"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=5, draft_tokens=4)


# --- sampling exactness ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sampling_case():
    """A trunk with flat next-token distributions and random heads (q far from p: many rejections), the exact
    law of 3 new tokens, and a prompt batched over many rows (each row an independent sample)."""
    torch.manual_seed(3)
    raw = dict(CONFIGS["llama"], mtp_num_hidden_layers=0, mtp_parallel_heads=2)
    model = make_drafting(mtpkit.build_model(raw), seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    prompt = [3, 1, 4, 1, 5]
    return model, params, prompt, exact_joint(model, prompt, params, 3)


@pytest.mark.parametrize("k", [1, 2])
def test_blockwise_sampling_matches_the_exact_distribution(sampling_case, k):
    model, params, prompt, joint = sampling_case
    counts, stats = empirical_counts(model, params, prompt, k, seed=k)
    assert chi2_pvalue(counts, joint) > 1e-3
    assert 0.1 < stats["acceptance_rate"] < 0.9


def test_the_blockwise_sampling_test_fails_for_a_wrong_rejection_rule(sampling_case, monkeypatch):
    """Drawing from p instead of normalize(max(p - q, 0)) after a rejection: caught."""
    model, params, prompt, joint = sampling_case
    monkeypatch.setattr(verification, "residual", lambda p, q: p)
    counts, _ = empirical_counts(model, params, prompt, 2, seed=2)
    assert chi2_pvalue(counts, joint) < 1e-6
