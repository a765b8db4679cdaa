"""draft="auto" (decode/drafters/auto.py, decode/auto_policy.py): whatever it plans for each row and step (plain,
head chains cut by its gating, context drafts, mixed in one batch) greedy output is plain greedy's and sampling
keeps the trunk's law; the MTP run once over a stretch of plain steps leaves the state that running it every step
leaves; the policy drafts where drafting pays and decodes plainly, probing now and then, where it does not; step
costs are medians that seed the next call from the route store."""

import random

import pytest
import torch
from drafting import PROMPTS, drafting_model
from sampling_stats import chi2_pvalue, empirical_counts, exact_joint

import mtpkit
from mtpkit.decode import auto_policy
from mtpkit.decode.auto_policy import Acceptance, Controller, Plan, StepCosts, expected_tokens
from mtpkit.decode.draft_spec import DraftSpec
from mtpkit.decode.drafters import auto, mtp_chain
from mtpkit.decode.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def random_plans(monkeypatch):
    """Controller.plan replaced by a seeded random choice among every plan a row could get."""
    rng = random.Random(0)

    def plan(self, r, found):
        options = [Plan("plain")] + [Plan("head", k, 1.0, [0.9] * self.positions)
                                     for k in range(1, self.head_drafts + 1)]
        options += [Plan("context", n, 1.0) for n in range(1, min(found, self.context_drafts) + 1)]
        return rng.choice(options)

    monkeypatch.setattr(Controller, "plan", plan)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_greedy_output_is_plain_greedy_output_whatever_is_planned(family, random_plans):
    model = drafting_model(family)
    for prompts in (PROMPTS[:1], PROMPTS):
        plain = mtpkit.generate(model, prompts, max_new_tokens=40)
        got = mtpkit.generate(model, prompts, max_new_tokens=40, draft="auto")
        assert got.tokens == plain.tokens
        s = got.stats
        assert s["verification_steps"] > 10 and s["context_drafted_steps"] > 0 and s["accepted"] > 10
        assert s["forward_passes"] > s["verification_steps"] / len(prompts)  # some steps of every batch were plain


VERIFY = {n: 1.0 + 0.1 * (n - 1) for n in range(1, 10)}  # step costs in decodes, as on a CPU that streams weights
DRAFT = 0.05


@pytest.fixture
def fixed_costs(monkeypatch):
    """Step costs fixed at VERIFY / DRAFT (what this machine measures is ignored), and a meter of what auto's steps
    cost at those figures: its decisions are then checked, not this machine's timing."""
    real_init, real_observed = StepCosts.__init__, auto.AutoDrafter.observed
    spent = [0.0]

    def init(self, seeded=None):
        real_init(self, {"ratios": {str(n): c for n, c in VERIFY.items()}, "draft_ratio": DRAFT})
        self.observe = lambda *a, **k: None  # nothing measured: a plain step costs 1.0, the rest their ratios
        self.plain_known = lambda: True

    def observed(self, accepted):
        drafts, head_depths = self.step[2], self.step[4]
        spent[0] += VERIFY[1] if drafts is None else VERIFY[drafts.tokens.shape[1] + 1] + head_depths * DRAFT
        real_observed(self, accepted)

    monkeypatch.setattr(StepCosts, "__init__", init)
    monkeypatch.setattr(auto.AutoDrafter, "observed", observed)
    return spent


def _fixed_cost(stats) -> float:
    """What a fixed-k run of one prompt cost at VERIFY / DRAFT: its plain steps and its steps of j drafts."""
    plain = stats["forward_passes"] - stats["verification_steps"]
    return plain * VERIFY[1] + sum(n * (VERIFY[j + 2] + (j + 1) * DRAFT) for j, n in enumerate(stats["draft_lengths"]))


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_auto_costs_what_the_best_fixed_chain_costs(family, fixed_costs):
    """Over the prompts, auto's steps cost no more than 1.05x those of the best fixed k (k = 1..3, known only after
    running them all), less than plain decoding, with output identical to it."""
    model = drafting_model(family)
    fixed = {k: 0.0 for k in (1, 2, 3)}
    for prompt in PROMPTS:
        plain = mtpkit.generate(model, [prompt], max_new_tokens=96).tokens
        for k in fixed:
            fixed[k] += _fixed_cost(mtpkit.generate(model, [prompt], max_new_tokens=96, draft_tokens=k).stats)
        assert mtpkit.generate(model, [prompt], max_new_tokens=96, draft="auto").tokens == plain
    assert fixed_costs[0] <= 1.05 * min(fixed.values()) and fixed_costs[0] < 0.9 * 3 * 96


def test_where_drafts_fail_auto_decodes_plainly(fixed_costs):
    """A head that drafts at random: auto's steps cost within 3% of plain decoding's, while fixed k = 3 costs 1.45x."""
    model = drafting_model("qwen3_5")
    with torch.no_grad():
        for p in model.mtp.parameters():
            p.normal_(0.0, 1.0)
    prompts = [[5, 17, 2, 29, 11, 8, 23]]  # no repeats: the context finds nothing at first
    plain = mtpkit.generate(model, prompts, max_new_tokens=160)
    k3 = mtpkit.generate(model, prompts, max_new_tokens=160, draft_tokens=3)
    got = mtpkit.generate(model, prompts, max_new_tokens=160, draft="auto")
    assert got.tokens == plain.tokens
    assert _fixed_cost(k3.stats) > 1.2 * 160 and fixed_costs[0] <= 1.03 * 160


@pytest.fixture(scope="module")
def sampling_case():
    """As tests/decode/test_lookup.py's: a prompt that repeats the model's walk (context drafts found), a trunk that
    often leaves it, and the exact law of the first 3 new tokens."""
    model = drafting_model("llama", noise=1.0, seed=3)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    walk = [3, *mtpkit.generate(model, [[3]], max_new_tokens=5).tokens[0]]
    prompt = walk + walk + [3]
    return model, params, prompt, exact_joint(model, prompt, params, 3)


def test_sampling_keeps_the_trunks_law_whatever_is_planned(sampling_case, random_plans):
    model, params, prompt, joint = sampling_case
    counts, stats = empirical_counts(model, params, prompt, 0, seed=5, draft="auto")
    assert chi2_pvalue(counts, joint) > 1e-3
    assert stats["context_drafted_steps"] > 200 and stats["verification_steps"] > 2000 and stats["accepted"] > 150


def test_a_stretch_of_plain_steps_is_caught_up_as_if_the_mtp_had_run_every_step(monkeypatch):
    """The drafter state after the catch-up (the MTP's output at slot - 1, from its cache) equals the state a k = 1
    run, which runs the MTP after every step, has at the same slot."""
    model = drafting_model("qwen3_5", noise=0.6)
    seen = {}
    real_draft = mtp_chain.draft

    def draft(model, state, **kw):  # every chain draft: the slot and the drafter state it drafts from
        seen.setdefault(kw["k"], {})[state.slot_host[0]] = state.drafter_state[0].clone()
        return real_draft(model, state, **kw)

    monkeypatch.setattr(mtp_chain, "draft", draft)
    every = mtpkit.generate(model, PROMPTS[:1], max_new_tokens=30, draft_tokens=1)
    steps = iter(range(1000))
    # plain for 6 steps, then a head draft, and so on: each draft follows a stretch of plain steps
    monkeypatch.setattr(Controller, "plan", lambda self, r, found: Plan("plain") if next(steps) % 7 < 6
                        else Plan("head", 3, 1.0, [0.0] * 8))  # rates 0: gating stops after the first draft
    got = mtpkit.generate(model, PROMPTS[:1], max_new_tokens=30, draft="auto")
    assert got.tokens == every.tokens
    assert got.stats["verification_steps"] >= 3
    caught_up = seen[3]
    assert set(caught_up) <= set(seen[1]) and len(caught_up) >= 3
    for slot, state in caught_up.items():
        torch.testing.assert_close(state, seen[1][slot], atol=1e-5, rtol=1e-5)


def _costs(verify: dict, draft: float) -> StepCosts:
    """Costs measured at these figures, then fixed (observations ignored), so decisions do not depend on this
    machine's timing."""
    costs = StepCosts()
    for _ in range(auto_policy.MEASURED_AFTER):
        for n, seconds in verify.items():
            costs.observe(n, seconds + (draft if n > 1 else 0), n > 1, draft if n > 1 else 0.0)
    assert costs.plain_known() and costs.draft() == pytest.approx(draft)
    assert all(costs.verify(n) == pytest.approx(seconds) for n, seconds in verify.items())
    costs.observe = lambda *a, **k: None
    return costs


def test_a_row_goes_plain_where_drafts_fail_and_back_when_the_scored_drafts_come_good():
    ctl = Controller(3, 8, _costs({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, 0.05))
    assert ctl.plan(0, found=0).source == "head"  # drafting is tried while nothing says it fails
    for _ in range(10):
        ctl.observe(0, "head", 3, 0, [0.9, 0.9, 0.9])
    assert ctl.plan(0, found=0).source == "plain"
    for _ in range(12):  # what a plain stretch's catch-up scored: the head's first drafts were right
        ctl.observe(0, "head", 1, 1, [])
    assert ctl.plan(0, found=0).source == "head"
    # a row whose drafts are kept drafts deep
    good = Controller(3, 8, _costs({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, 0.05))
    for _ in range(50):
        plan = good.plan(0, found=0)
        good.observe(0, plan.source, plan.drafts, plan.drafts, [0.9] * plan.drafts)
    assert good.plan(0, found=0).drafts == 3


def test_plans_follow_the_costs_and_the_sources_acceptance():
    # a machine where verifying 4 tokens costs twice a decode: short chains
    ctl = Controller(3, 8, _costs({1: 1.0, 2: 1.05, 3: 1.6, 4: 2.0}, 0.02))
    for _ in range(30):
        ctl.observe(0, "head", 3, 1, [0.5, 0.5, 0.5])  # the first draft is kept, never the second
    assert ctl.plan(0, found=0).drafts == 1 and ctl.plan(0, found=0).source == "head"
    # the context's drafts are kept 4 at a time: a lookup beats the head where one is found
    for _ in range(30):
        ctl.observe(0, "context", 4, 4, [])
    plan = ctl.plan(0, found=6)
    assert plan.source == "context" and plan.drafts >= 4
    assert ctl.plan(0, found=0).source == "head"  # nothing found: the head again
    # another row has its own figures, shrunk toward the batch's
    assert ctl.rates(1, "head")[1] > ctl.rates(0, "head")[1]


def test_gating_drafts_on_only_while_a_confident_chain_pays():
    ctl = Controller(3, 8, _costs({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}, 0.03))
    plan = Plan("head", 3, 0.5, [0.8, 0.8, 0.8])
    assert ctl.keep_drafting(plan, 1, prefix_accepted=0.9)
    assert not ctl.keep_drafting(plan, 1, prefix_accepted=0.05)
    assert not ctl.keep_drafting(plan, 3, prefix_accepted=1.0)  # at most head_drafts deep
    # a weak next draft that opens strong ones after it is still worth drafting
    assert ctl.keep_drafting(Plan("head", 3, 0.5, [0.9, 0.3, 1.0]), 1, prefix_accepted=0.9)
    # the calibration learns that this head's confident drafts fail
    before = ctl.calibration(0.95)
    for _ in range(50):
        ctl.observe(0, "head", 1, 0, [0.95])
    assert ctl.calibration(0.95) < 0.2 < before


def test_acceptance_counts_and_expected_tokens():
    acc = Acceptance(3, decay=1.0)
    acc.observe(3, 1)  # position 1 kept, 2 tried and rejected, 3 not reached
    acc.observe(2, 2)
    assert acc.tries == [2, 2, 0] and acc.accepted == [2, 1, 0]
    assert acc.rates([0.5] * 3, weight=1e-9)[:2] == pytest.approx([1.0, 0.5])
    assert acc.rates([0.5] * 3, weight=2.0) == pytest.approx([0.75, 0.5, 0.5])
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0


def test_step_costs_are_robust_medians_and_price_what_is_not_measured_yet_optimistically():
    costs = StepCosts({"ratios": {"2": 1.05, "4": 1.5}, "draft_ratio": 0.3})
    # before a plain step is timed, in plain steps: a stored ratio where it is below the default, else the default
    assert not costs.plain_known()
    assert costs.verify(2) == pytest.approx(1.05) and costs.verify(4) == pytest.approx(1.3)
    assert costs.draft() == pytest.approx(auto_policy.DEFAULT_DRAFT_RATIO)
    for s in (0.010, 0.011, 0.012, 0.5, 0.010):  # one step slowed by other work
        costs.observe(1, s)
    assert costs.plain_known() and costs.verify(1) == pytest.approx(0.011)
    assert costs.verify(4) == pytest.approx(0.011 * 1.3) and costs.draft() == pytest.approx(0.0011)
    # one or two samples of a width price it only where they are lower: a slow first step does not stick
    costs.observe(4, 0.030)
    assert costs.verify(4) == pytest.approx(0.011 * 1.3)
    costs.observe(4, 0.0125)
    costs.observe(4, 0.0125)
    assert costs.verify(4) == pytest.approx(0.0125)  # measured: the median of three
    costs.observe(2, 0.017, draft_depths=1, draft_seconds=0.001)
    assert costs.verify(2) == pytest.approx(0.011 * 1.05) and costs.draft() == pytest.approx(0.001)
    for _ in range(2):
        costs.observe(2, 0.017, draft_depths=1, draft_seconds=0.001)
    # a 2-token verify timed at 16 ms is priced at the 4-token one's 12.5: verifying fewer never costs more
    assert costs.verify(2) == pytest.approx(0.0125) and costs.draft() == pytest.approx(0.001)
    record = costs.record()
    assert record["ratios"] == pytest.approx({"2": 0.0125 / 0.011, "4": 0.0125 / 0.011})
    assert record["draft_ratio"] == pytest.approx(0.001 / 0.011)
    assert StepCosts().verify(3) == pytest.approx(1 + 2 * auto_policy.DEFAULT_VERIFY_RATIO)


def test_a_store_that_overprices_drafting_does_not_keep_auto_from_drafting():
    """A first draft step of a process took 0.9 of a plain step and a wide verify 5x one; stored, they priced the
    head and the wide widths out of every later call, which never measured them again."""
    costs = StepCosts({"ratios": {"2": 3.0, "3": 3.0, "4": 3.0, "6": 5.3}, "draft_ratio": 0.9})
    for _ in range(3):
        costs.observe(1, 0.010)
    ctl = Controller(3, 8, costs)
    for _ in range(10):
        ctl.observe(0, "head", 3, 2, [0.9, 0.9, 0.9])
        ctl.observe(0, "context", 5, 5, [])
    assert ctl.plan(0, found=0).source == "head"
    plan = ctl.plan(0, found=8)
    assert plan.source == "context" and plan.drafts >= 5


def test_a_call_that_never_decodes_plainly_prices_the_plain_step_from_what_it_measured():
    """Only wider steps measured: the plain step is the nearest one over its stored ratio, not a stored absolute
    figure (which may come from a call under other load)."""
    costs = StepCosts({"ratios": {"2": 1.05, "4": 1.25}})
    for _ in range(auto_policy.MEASURED_AFTER):
        costs.observe(4, 0.025)
    assert costs.verify(1) == pytest.approx(0.020) and costs.verify(2) == pytest.approx(0.021)
    assert costs.record() == {"ratios": {"2": 1.05, "4": 1.25}}  # no plain step timed: nothing new to store


def test_a_call_starts_with_plain_steps_that_time_the_plain_step():
    model = drafting_model("llama")
    got = mtpkit.generate(model, PROMPTS[:1], max_new_tokens=24, draft="auto")
    # the first verification step can only come after PLAIN_FIRST plain steps
    assert got.stats["forward_passes"] - got.stats["verification_steps"] >= auto_policy.PLAIN_FIRST


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A drafting model with a route store of its own at tmp_path/m.json, and the list of every AutoDrafter built."""
    from mtpkit.decode.matmul_routing import router_for
    from mtpkit.decode.route_store import RouteStore

    model = drafting_model("llama")
    router_for(model).store = RouteStore(tmp_path / "m.json")
    built = []

    class Recorded(auto.AutoDrafter):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(self)

    monkeypatch.setattr(auto, "AutoDrafter", Recorded)
    return model, built


def test_step_costs_are_kept_for_the_next_call(tmp_path, recorded):
    from mtpkit.decode.route_store import RouteStore

    model, built = recorded
    mtpkit.generate(model, PROMPTS[:1], max_new_tokens=48, draft="auto")
    steps = RouteStore(tmp_path / "m.json").entries["steps"]
    assert list(steps) == [built[0].store_key] and steps[built[0].store_key]["ratios"]
    mtpkit.generate(model, PROMPTS[:1], max_new_tokens=4, draft="auto")
    assert built[1].controller.costs.ratios == {int(n): r for n, r in steps[built[0].store_key]["ratios"].items()}


def test_auto_is_a_spec_of_its_own():
    model = drafting_model("llama")
    spec = DraftSpec.automatic(model)
    assert spec.auto and spec.label == "auto" and spec.draft_tokens == 3 and spec.draft_lookup == 8
    with pytest.raises(ValueError, match="chooses its own gating"):
        DraftSpec(3, 0.5, auto=True)
    with pytest.raises(ValueError, match="draft must be a DraftSpec, 'auto' or None"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft="fast")
    with pytest.raises(ValueError, match="not both"):
        mtpkit.generate(model, PROMPTS, max_new_tokens=4, draft="auto", draft_tokens=2)
    # a model without a head: auto drafts from the context only
    model.mtp = None
    assert DraftSpec.automatic(model).draft_tokens == 0


def test_a_long_plain_stretch_is_caught_up_less_and_less_often(monkeypatch):
    """Catch-ups in a plain stretch come after 16, 32, then every 64 plain steps; a drafting step sets the stretch
    back to 16."""
    model = drafting_model("qwen3_5", noise=0.6)
    sizes = []
    real = auto.AutoDrafter._catch_up

    def catch_up(self, state, rows, end):
        sizes.append(len(self.pending))
        return real(self, state, rows, end)

    monkeypatch.setattr(auto.AutoDrafter, "_catch_up", catch_up)
    steps = iter(range(1000))
    monkeypatch.setattr(Controller, "plan", lambda self, r, found: Plan("head", 1, 1.0, [0.0] * 8)
                        if next(steps) == 180 else Plan("plain"))
    mtpkit.generate(model, PROMPTS[:1], max_new_tokens=220, draft="auto")
    # 16 + 32 + 64 + 64 = 176 plain steps, then 4 more before the draft at step 181, then 16 after it
    assert sizes == [16, 32, 64, 64, 4, 16]


def test_step_costs_are_written_back_only_when_they_moved():
    seeded = {"ratios": {"2": 1.2}, "draft_ratio": 0.1}
    costs = StepCosts(seeded)
    assert not costs.moved()  # nothing measured: the stored figures stand
    for s in (0.0102, 0.0099, 0.0100):
        costs.observe(1, s)
    for _ in range(auto_policy.MEASURED_AFTER):
        costs.observe(2, 0.0121 + 0.00102, draft_depths=1, draft_seconds=0.00102)
    assert not costs.moved()  # every ratio within 5% of the stored one
    for _ in range(auto_policy.MEASURED_AFTER - 1):
        costs.observe(3, 0.014)
    assert not costs.moved()  # two samples: not yet measured
    costs.observe(3, 0.014)
    assert costs.moved()  # a width the store lacks
    slower = StepCosts(seeded)
    for s in (0.010, 0.010, 0.010):
        slower.observe(1, s)
    for _ in range(auto_policy.MEASURED_AFTER):
        slower.observe(2, 0.015 + 0.001, draft_depths=1, draft_seconds=0.001)
    assert slower.moved()  # a 2-token verify now 1.5x a plain step


def test_stored_ratios_of_widths_a_call_did_not_measure_are_kept():
    costs = StepCosts({"ratios": {"2": 1.2, "4": 1.3}, "draft_ratio": 0.05})
    for s in (0.020, 0.020, 0.020):  # this call's machine runs at half the speed: ratios unchanged
        costs.observe(1, s)
    for _ in range(auto_policy.MEASURED_AFTER):
        costs.observe(2, 0.030)
    record = costs.record()
    assert record["ratios"] == pytest.approx({"2": 1.5, "4": 1.3}) and record["draft_ratio"] == 0.05
    assert costs.verify(4) == pytest.approx(0.026)


def test_sampled_decoding_starts_from_the_greedy_ratios_until_it_has_its_own(tmp_path, recorded):
    from mtpkit.decode.route_store import RouteStore

    model, built = recorded
    mtpkit.generate(model, PROMPTS[:1], max_new_tokens=24, draft="auto")
    greedy = built[0].controller.costs.record()["ratios"]
    mtpkit.generate(model, PROMPTS[:1], max_new_tokens=24, draft="auto", temperature=1.0, seed=0)
    sampled = built[1]
    assert sampled.store_key != built[0].store_key and sampled.controller.costs.ratios == {
        int(n): r for n, r in greedy.items()}
    steps = RouteStore(tmp_path / "m.json").entries["steps"]
    assert set(steps) == {built[0].store_key, sampled.store_key}  # each kind now has its own
