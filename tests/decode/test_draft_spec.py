"""`DraftSpec`: the rules on the drafting knobs in one place (bounds refused before anything is allocated, the
report label, the benchmark's grid), and `generate(draft=DraftSpec(...))` equal to the keyword arguments."""

import pytest
from drafting import PROMPTS, drafting_model

import mtpkit
from mtpkit import DraftSpec
from mtpkit.decode.drafters import DraftSetup, build_drafter
from mtpkit.decode.drafters.context_lookup import ContextLookupDrafter
from mtpkit.decode.drafters.mtp_chain import MTPChain

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("knobs", [dict(draft_lookup=2000), dict(draft_tokens=1, draft_widths=(40000,)),
                                   dict(draft_lookup=10**12), dict(draft_tokens=300)])
def test_knobs_past_the_verify_budget_are_refused(knobs):
    with pytest.raises(ValueError, match="at most 256"):
        DraftSpec(**knobs)


def test_label_normalisation_and_grid():
    spec = DraftSpec(3, 0.3, [3, 2, 1, 1], 4)
    assert spec.draft_widths == (3, 2) and spec.label == "k=3 p=0.3 w=3,2 lookup=4"
    assert spec.most_drafts == 4 and spec.most_verified == 1 + 4 + 2 + 1
    assert DraftSpec.of({"draft_tokens": 2, "draft_widths": [2], "speedup": 1.2}) == DraftSpec(2, draft_widths=(2,))
    grid = DraftSpec.grid([0, 1, 3], [0, 0.5], [(), (3,)], [0, 2])
    assert [s.label for s in grid][:4] == ["k=0 lookup=2", "k=1", "k=1 lookup=2", "k=1 w=3"]
    assert DraftSpec(3, 0.5) in grid and DraftSpec(1, 0.5) not in grid  # gating cannot change k = 1
    with pytest.raises(ValueError, match="0 only with a lookup length"):
        DraftSpec.grid([0])


def test_generate_takes_a_spec_or_its_knobs_but_not_both():
    model = drafting_model("llama")
    spec = DraftSpec(2, draft_widths=(2,), draft_lookup=3)
    a = mtpkit.generate(model, PROMPTS, max_new_tokens=24, draft=spec)
    b = mtpkit.generate(model, PROMPTS, max_new_tokens=24, draft_tokens=2, draft_widths=(2,), draft_lookup=3)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert {k: v for k, v in a.stats.items() if "second" not in k} == \
        {k: v for k, v in b.stats.items() if "second" not in k}
    with pytest.raises(ValueError, match="not both"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft=spec, draft_tokens=1)


def test_the_registry_composes_the_context_lookup_around_the_chain():
    model = drafting_model("llama")
    setup = lambda spec: DraftSetup(model, spec, None, None, None, PROMPTS)  # noqa: E731
    assert build_drafter(setup(DraftSpec())) is None
    assert isinstance(build_drafter(setup(DraftSpec(2))), MTPChain)
    wrapped = build_drafter(setup(DraftSpec(2, draft_lookup=3)))
    assert isinstance(wrapped, ContextLookupDrafter) and isinstance(wrapped.inner, MTPChain)
    assert build_drafter(setup(DraftSpec(0, draft_lookup=3))).inner is None
