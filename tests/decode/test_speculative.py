"""Self-speculative decoding: greedy output equals plain greedy token for token (every family, k = 1..4, batched
rows of different lengths, EOS inside a draft), the MTP cache follows the accepted tokens, and sampling keeps
the trunk's distribution exactly (statistical tests with a fixed seed, shown to fail for a wrong rule)."""

import pytest
import torch
from drafting import CONFIGS, PROMPTS, drafting_model
from sampling_stats import chi2_pvalue, empirical_counts, exact_joint

import mtpkit
from mtpkit.decode import draft_head
from mtpkit.decode import verify as verification
from mtpkit.decode.drafters import mtp_chain
from mtpkit.decode.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return drafting_model(request.param)


def test_greedy_speculative_equals_plain_greedy(model):
    plain = {n: mtpkit.generate(model, PROMPTS[:n], max_new_tokens=40) for n in (1, 3)}
    partial = False
    for k in range(1, 5):
        for n in (1, 3):
            r = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=40, draft_tokens=k)
            assert r.tokens == plain[n].tokens, f"k={k}, batch {n}"
            s = r.stats
            assert 0 < s["accepted"] < s["drafted"], f"k={k}, batch {n}: no partial acceptance to test"
            assert s["new_tokens"] == 40 * n and s["drafted"] == k * s["verification_steps"]
            assert sum(s["accepted_per_position"]) == s["accepted"]
            assert s["mean_acceptance_length"] == pytest.approx(1 + s["accepted"] / s["verification_steps"])
            # a step that kept 1 < n+1 <= k tokens rolled the GDN state back into the middle of the history
            partial |= any(1 < a <= k for row in r.accept_lengths for a in row)
    assert partial


def first_accepted_draft(result):
    """(token, row): a token that some row first produces as an accepted draft, not as the trunk's own token."""
    for row, (toks, lengths) in enumerate(zip(result.tokens, result.accept_lengths)):
        start = 1  # token 0 comes from the prefill
        for length in lengths:
            for j in range(start, start + length - 1):
                if toks[j] not in toks[:j]:
                    return toks[j], row
            start += length
    return None, None


def test_eos_inside_an_accepted_draft_stops_the_row(model):
    k = 3
    free = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=k)
    eos, row = first_accepted_draft(free)
    assert eos is not None, "no accepted draft to place EOS on"
    ref = mtpkit.generate(model, PROMPTS, max_new_tokens=40, eos_token_id=eos)
    got = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=k, eos_token_id=eos)
    assert got.tokens == ref.tokens
    assert got.tokens[row][-1] == eos and len(got.tokens[row]) < 40


def test_deeper_mtp_and_reduced_draft_vocab_stay_lossless():
    model = drafting_model("qwen3_5", mtp_layers=2)
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=30)
    deep = mtpkit.generate(model, PROMPTS, max_new_tokens=30, draft_tokens=3)
    vocab = draft_head.frequent_tokens(plain.tokens, 12)
    small = mtpkit.generate(model, PROMPTS, max_new_tokens=30, draft_tokens=2, draft_vocab=vocab)
    assert deep.tokens == plain.tokens and small.tokens == plain.tokens
    assert small.stats["accepted"] > 0


def test_frequent_tokens_counts_documents_and_ids():
    assert draft_head.frequent_tokens([[5, 5, 1], torch.tensor([1, 5]), 7], 2).tolist() == [5, 1]
    with pytest.raises(ValueError, match="no token ids"):
        draft_head.frequent_tokens([], 3)


def test_mtp_cache_follows_accepted_tokens(monkeypatch):
    """Every first draft equals the teacher-forced depth-1 MTP prediction on the accepted sequence, so the MTP
    cache and the hidden it drafts from are those of the accepted tokens, whatever was rejected before."""
    model = drafting_model("qwen3_5")
    seen = []

    def recording_draft(model_, state, **named):
        drafts = draft(model_, state, **named)
        seen.append((state.slot.clone(), drafts.tokens[:, 0].clone()))
        return drafts

    draft = mtp_chain.draft
    monkeypatch.setattr(mtp_chain, "draft", recording_draft)
    r = mtpkit.generate(model, PROMPTS[:1], max_new_tokens=30, draft_tokens=3)
    seq = torch.tensor([PROMPTS[0] + r.tokens[0]])
    with torch.no_grad():
        tf = model(seq, mtp=1).mtp_logits[0][0]  # row i predicts token i+2
    for pos, d1 in seen:  # pos: position of the last emitted token; the MTP row at pos-1 predicts pos+1
        assert int(d1[0]) == int(tf[int(pos[0]) - 1].argmax())
    assert r.stats["accepted"] < r.stats["drafted"]


# --- sampling exactness ---------------------------------------------------------------------------------------

def test_accept_sampling_output_is_distributed_as_p():
    """One verification position, many rows: the emitted token's law is p whatever q is."""
    g = torch.Generator().manual_seed(0)
    V, N = 8, 200_000
    p = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
    q = torch.tensor([0.05, 0.05, 0.40, 0.20, 0.10, 0.10, 0.00, 0.10])
    drafts = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
    P = p.expand(N, 2, V)
    Q = q.expand(N, 1, V)
    n, tokens = verification.accept_sampling(drafts, Q, P, g, torch.ones(N, dtype=torch.long))
    first = torch.bincount(tokens[:, 0], minlength=V)
    assert chi2_pvalue(first, p) > 1e-3
    assert 0 < n.float().mean() < 1
    # the bonus token after an accepted draft is drawn from p (row 1) as well
    assert chi2_pvalue(torch.bincount(tokens[n == 1, 1], minlength=V), p) > 1e-3


@pytest.fixture(scope="module")
def sampling_case():
    """A model whose random MTP head drafts from a q far from p, the exact law of 3 new tokens, and a prompt
    batched over many rows (each row an independent sample)."""
    model = drafting_model("llama", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # flatter next-token distributions: many cells to test
        model.mtp.fc.weight.normal_(0.0, 0.1)  # drafts no longer track the trunk: many rejections
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    prompt = [3, 1, 4, 1, 5]
    return model, params, prompt, exact_joint(model, prompt, params, 3)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_speculative_sampling_matches_the_exact_distribution(sampling_case, k):
    model, params, prompt, joint = sampling_case
    counts, stats = empirical_counts(model, params, prompt, k, seed=k)
    assert chi2_pvalue(counts, joint) > 1e-3
    if k:
        assert 0.1 < stats["acceptance_rate"] < 0.9


def test_sampling_from_a_reduced_draft_vocab_stays_exact(sampling_case):
    """q is zero outside the draft vocabulary; tokens outside it still come out at the trunk's rate."""
    model, params, prompt, joint = sampling_case
    counts, stats = empirical_counts(model, params, prompt, 2, seed=5, draft_vocab=torch.arange(0, 32, 2))
    assert chi2_pvalue(counts, joint) > 1e-3
    assert stats["accepted"] > 0


def stale_bonus(accept):
    """The bug gating invites: a row that stopped drafting early (all its drafts accepted, padding after them)
    draws its next token from residual(p, q) of the padding draft instead of from p."""

    def wrong(drafts, q, p, generator, count):
        n, tokens = accept(drafts, q, p, generator, count)
        rows = torch.arange(n.shape[0])
        stale = (n == count) & (n < drafts.shape[1])
        residual = verification.residual(p[rows, n], q[rows, n.clamp(max=drafts.shape[1] - 1)])
        redraw = verification.sample(residual, generator)
        tokens[stale, n[stale]] = redraw[stale]
        return n, tokens

    return wrong


def test_gated_sampling_matches_the_exact_distribution(sampling_case, monkeypatch):
    """The stopping rule reads only q(d) on the draft side, so the output law stays the trunk's; the same counts
    reject the stale-bonus bug."""
    model, params, prompt, joint = sampling_case
    counts, stats = empirical_counts(model, params, prompt, 3, seed=11, draft_min_prob=0.1)
    assert chi2_pvalue(counts, joint) > 1e-3
    assert all(stats["draft_lengths"]) and stats["drafted"] < 3 * stats["verification_steps"]
    monkeypatch.setattr(verification, "accept_sampling", stale_bonus(verification.accept_sampling))
    counts, _ = empirical_counts(model, params, prompt, 3, seed=11, draft_min_prob=0.1)
    assert chi2_pvalue(counts, joint) < 1e-6


def test_the_sampling_test_fails_for_a_wrong_rejection_rule(sampling_case, monkeypatch):
    """Drawing from p instead of normalize(max(p - q, 0)) after a rejection is the classic bug: caught."""
    model, params, prompt, joint = sampling_case
    monkeypatch.setattr(verification, "residual", lambda p, q: p)
    counts, _ = empirical_counts(model, params, prompt, 2, seed=2)
    assert chi2_pvalue(counts, joint) < 1e-6


def test_a_draft_vocabulary_is_drafted_from_bf16_rounded_rows_that_stream_at_half_the_bytes():
    """On CPU in fp32 the draft-vocabulary slice holds its rows rounded to bf16, so the decode router streams it
    from an exact bf16 copy; output stays lossless (the test above), and the full vocabulary is drafted as it is."""
    from mtpkit.decode.matmul_routing import router_for

    model = drafting_model("llama")
    weight, vocab = model.output_weight, torch.tensor([7, 3, 20, 11])
    head = draft_head.DraftHead(model, SamplingParams(), vocab)
    assert weight.dtype == torch.float32 and not torch.equal(weight[vocab.sort().values], head.weight)
    assert torch.equal(head.weight, weight[vocab.sort().values].bfloat16().float())
    assert router_for(model).stream(head.weight).dtype == torch.bfloat16
    assert draft_head.DraftHead(model, SamplingParams()).weight is weight


def test_draft_vocabulary_rows_are_made_once_and_again_when_the_weight_or_vocabulary_changes():
    model = drafting_model("llama")
    weight, vocab = model.output_weight, torch.tensor([7, 3, 20, 11])
    first = draft_head.DraftHead(model, SamplingParams(), vocab).weight
    assert draft_head.DraftHead(model, SamplingParams(), vocab.flip(0)).weight is first  # the same ids: kept
    other = draft_head.DraftHead(model, SamplingParams(), torch.tensor([7, 3, 20])).weight
    assert torch.equal(other, weight[[3, 7, 20]].bfloat16().float())  # other ids: made for them
    with torch.no_grad():
        weight.mul_(2)  # trained in place: the kept rows are stale
    again = draft_head.DraftHead(model, SamplingParams(), vocab).weight
    assert torch.equal(again, weight[vocab.sort().values].bfloat16().float())
    assert not torch.equal(again, first)


def test_a_model_made_under_inference_mode_drafts_from_a_draft_vocabulary():
    """Weights made under torch.inference_mode have no version counter; the kept draft rows must not need one."""
    with torch.inference_mode():
        model = drafting_model("llama")
        vocab = torch.arange(0, 32, 2)
        plain = mtpkit.generate(model, PROMPTS, max_new_tokens=20)
        runs = [mtpkit.generate(model, PROMPTS, max_new_tokens=20, draft_tokens=2, draft_vocab=vocab) for _ in "ab"]
    assert model.output_weight.is_inference()
    assert all(r.tokens == plain.tokens for r in runs)
