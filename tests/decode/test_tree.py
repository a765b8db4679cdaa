"""Draft trees (`draft_widths`, decode/tree.py): a tree verify gives every node the logits of a plain forward over
its own path; after an alternative is kept the cache equals one that saw only the kept tokens; greedy output equals
plain greedy token for token (batched, k = 1..3, several shapes, with gating) with alternatives actually kept; the
MTP drafts from the kept path; sampling keeps the trunk's law exactly, gated too (shown to fail with a causal mask
in place of the tree's); bad shapes and hybrid trunks are one-line errors."""

import pytest
import torch
from drafting import PROMPTS, drafting_model
from sampling_stats import chi2_pvalue, empirical_counts, exact_joint

import mtpkit
from mtpkit.decode import tree
from mtpkit.decode.cache import Cache
from mtpkit.decode.drafters import mtp_chain
from mtpkit.decode.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPES = [(2,), (3,), (3, 2), (2, 2, 2), (4, 1, 3)]


def test_layout_of_a_chain_with_alternatives():
    t = tree.layout((3, 1, 2))  # chain 1-2-3; alternatives 4, 5 at depth 1 and 6 at depth 3
    assert t.size == 7 and t.depth.tolist() == [0, 1, 2, 3, 1, 1, 3]
    assert t.alternatives.tolist() == [[4, 5], [-1, -1], [6, -1]]
    ancestors = {i: t.mask[i].nonzero().flatten().tolist() for i in range(t.size)}
    assert ancestors == {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 4], 5: [0, 5], 6: [0, 1, 2, 6]}
    assert tree.normalize_widths([3, 1, 2, 1], 3) == (3, 1, 2) and tree.normalize_widths([1, 1], 2) == ()
    assert tree.normalize_widths([2, 2, 2], 1) == (2,) and tree.verified_tokens((3, 1, 2), 2) == 5


@pytest.fixture(scope="module")
def random_llama():
    torch.manual_seed(0)
    from drafting import CONFIGS

    return mtpkit.build_model(dict(CONFIGS["llama"], vocab_size=64)).eval()


def test_tree_verify_equals_a_forward_over_each_nodes_path(random_llama):
    model = random_llama
    prompt = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    t = tree.layout((3, 2))  # root, chain c1 c2, alternatives a, b at depth 1 and c at depth 2
    nodes = torch.randint(0, 64, (2, t.size), generator=torch.Generator().manual_seed(2))
    cache = Cache(model.config, 2, 32)
    with torch.no_grad():
        model(prompt, positions=torch.arange(9).expand(2, -1), cache=cache)
        slots = 9 + torch.arange(t.size).expand(2, -1)
        got = model(nodes, positions=9 + t.depth.expand(2, -1), cache=cache, cache_positions=slots, tree=t.mask).logits
        for i in range(t.size):
            path = t.mask[i].nonzero().flatten()  # the node's ancestors and itself, in depth order
            ref = model(torch.cat([prompt, nodes[:, path]], 1)).logits[:, -1]
            assert (got[:, i] - ref).abs().max() < 1e-4, i
        # keep root, alternative 3 at depth 1 (row 0) / chain c1 (row 1): the next token sees only the kept path
        kept, slot = torch.tensor([3, 1]), torch.tensor([9, 9])
        cache.copy_slots(slot + kept, slot + 1)
        nxt = torch.tensor([[5], [6]])
        out = model(nxt, positions=torch.tensor([[11], [11]]), cache=cache).logits[:, 0]
        for b in range(2):
            seq = torch.cat([prompt[b], nodes[b, [0, int(kept[b])]], nxt[b]])[None]
            assert (out[b] - model(seq).logits[0, -1]).abs().max() < 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return drafting_model(request.param)


def test_greedy_tree_equals_plain_greedy(model):
    kept = 0
    for n in (1, 3):
        plain = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=40).tokens
        for k in (1, 2, 3):
            for widths in SHAPES:
                r = mtpkit.generate(model, PROMPTS[:n], max_new_tokens=40, draft_tokens=k, draft_widths=widths)
                assert r.tokens == plain, (n, k, widths)
                s = r.stats
                assert s["verified_tokens_per_step"] == tree.verified_tokens(tree.normalize_widths(widths, k), k)
                assert s["accepted"] <= s["drafted"] and s["accepted_alternatives"] <= s["accepted"]
                kept += s["accepted_alternatives"]
    assert kept > 0


def test_gated_trees_equal_plain_greedy():
    """With confidence gating rows stop drafting at different depths: leaves count only up to a row's last
    proposed draft, and the output stays plain greedy's."""
    model = drafting_model("llama", noise=0.5, seed=1)
    norm = model.mtp.norm
    with torch.no_grad():
        norm.weight.mul_(0.5)  # a less sure head: thresholds stop drafts at every depth
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=40).tokens
    r = mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=3, draft_widths=(3, 2), draft_min_prob=0.5)
    assert r.tokens == plain
    assert all(r.stats["draft_lengths"]) and r.stats["accepted_alternatives"] > 0


def test_the_greedy_test_fails_without_moving_the_kept_alternative(monkeypatch):
    """The KV of a kept alternative sits at its tree slot; not moving it leaves the next steps reading the
    rejected chain draft's K/V there. Caught on a model whose trunk leans on attention."""
    model = drafting_model("llama", noise=0.5, seed=1)
    plain = mtpkit.generate(model, PROMPTS, max_new_tokens=40).tokens
    assert mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=2, draft_widths=(4, 3)).tokens == plain
    monkeypatch.setattr(Cache, "copy_slots", lambda self, src, dst: None)
    assert mtpkit.generate(model, PROMPTS, max_new_tokens=40, draft_tokens=2, draft_widths=(4, 3)).tokens != plain


def test_the_mtp_drafts_from_the_kept_path(monkeypatch):
    """Every first draft equals the teacher-forced depth-1 MTP prediction on the emitted sequence, whether the
    previous step kept the chain or an alternative."""
    model = drafting_model("llama", noise=0.5, seed=1)
    seen = []

    def recording_draft(model_, state, **named):
        drafts = draft(model_, state, **named)
        seen.append((int(state.slot[0]), int(drafts.tokens[0, 0])))
        return drafts

    draft = mtp_chain.draft
    monkeypatch.setattr(mtp_chain, "draft", recording_draft)
    r = mtpkit.generate(model, PROMPTS[:1], max_new_tokens=40, draft_tokens=2, draft_widths=(4, 2))
    assert r.stats["accepted_alternatives"] > 0
    with torch.no_grad():
        tf = model(torch.tensor([PROMPTS[0] + r.tokens[0]]), mtp=1).mtp_logits[0][0]  # row i predicts i+2
    assert all(d1 == int(tf[pos - 1].argmax()) for pos, d1 in seen)


@pytest.fixture(scope="module")
def sampling_case():
    """A drafting model whose trunk departs from its walk often (noise 1.0): at temperature 0.8 most sampled drafts
    are rejected and the token drawn instead is often the head's 2nd or 3rd (a row in ten keeps an alternative),
    and the trunk's law depends on attention, so a wrong tree mask shows. With the exact law of 3 new tokens."""
    model = drafting_model("llama", noise=1.0, seed=3)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    prompt = [3, 1, 4, 1, 5]
    return model, params, prompt, exact_joint(model, prompt, params, 3)


@pytest.mark.parametrize("k, widths", [(1, (3,)), (2, (3, 2))])
def test_tree_sampling_matches_the_exact_distribution(sampling_case, k, widths):
    model, params, prompt, joint = sampling_case
    counts, stats = empirical_counts(model, params, prompt, k, seed=k, draft_widths=widths)
    assert chi2_pvalue(counts, joint) > 1e-3
    assert stats["accepted_alternatives"] > 600


def test_gated_tree_sampling_matches_the_exact_distribution(sampling_case):
    """The same trunk (so the same exact law) with a less sure head: at p = 0.3 rows stop after 1 or 2 drafts."""
    _, params, prompt, joint = sampling_case
    model = drafting_model("llama", noise=1.0, seed=3)
    with torch.no_grad():
        model.mtp.norm.weight.mul_(0.3)
    counts, stats = empirical_counts(model, params, prompt, 2, seed=7, draft_widths=(3, 2), draft_min_prob=0.3)
    assert chi2_pvalue(counts, joint) > 1e-3
    assert all(stats["draft_lengths"]) and stats["accepted_alternatives"] > 300


def test_the_sampling_test_fails_with_a_causal_mask(sampling_case, monkeypatch):
    """Alternatives that also see the chain drafts before them get the wrong p: caught."""
    model, params, prompt, joint = sampling_case
    shape = tree.layout

    def causal(widths, device):
        t = shape(widths, device)
        return t._replace(mask=torch.ones(t.size, t.size, dtype=torch.bool).tril())

    monkeypatch.setattr(tree, "layout", causal)
    counts, _ = empirical_counts(model, params, prompt, 2, seed=2, draft_widths=(3, 2))
    assert chi2_pvalue(counts, joint) < 1e-6


def test_bad_shapes_and_trunks_are_one_line_errors(model):
    with pytest.raises(ValueError, match="draft widths must be >= 1"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_tokens=2, draft_widths=(0,))
    with pytest.raises(ValueError, match="give draft_tokens >= 1"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_widths=(2,))
    with pytest.raises(ValueError, match="more tokens per position than the draft vocabulary"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft_tokens=1, draft_widths=(5,),
                        draft_vocab=torch.arange(4))
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        mtpkit.generate(drafting_model("qwen3_5"), PROMPTS, max_new_tokens=4, draft_tokens=1, draft_widths=(2,))
