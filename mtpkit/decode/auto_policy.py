"""The decisions of `draft="auto"` (drafters/auto.py): per row and step, decode plainly or draft from the MTP head or
from the context, and how far, by the expected tokens per second of each plan, from figures measured as it decodes.

A plan's expected tokens: 1 + sum_j prod_{i <= j} a_i over its draft positions j, where a_i = P(draft i accepted |
drafts before it accepted) is estimated per draft source and position from the row's own recent steps (counts
decayed by `ROW_DECAY` a step), shrunk toward the batch's (decayed by `BATCH_DECAY`) and a uniform prior, plus an
optimism bonus that fades as the row tries position i. Its cost: the measured seconds of a step that verifies n
tokens (`StepCosts.verify(n)`, the median of recent ones) plus, for the head, the measured seconds of each draft
depth. The head's chain is also cut short draft by draft (gating, `keep_drafting`): after draft d, whose head
probabilities make P(drafts 1..d all accepted) = P (each q fitted to P(accepted | q) as it decodes, `Calibration`),
the row drafts on only if drafting on to some depth m pays: P * sum_{j=d+1..m} prod a tokens, priced at the plan's
seconds per token, against m - d draft steps and verified rows. So no threshold, depth or source is fixed in
advance: the figures that decide them move with the prompt, the context length and the machine.

A row still produces acceptance figures for the sources it does not use, at no cost to it: the drafter scores what
the head and the context would have drafted against the tokens the row went on to emit (drafters/auto.py), so a row
switches back to drafting, or to another source, where that starts paying again. Decisions only pick what is
drafted; verification is unchanged, so output stays exact.

Step costs are also kept on disk (decode/route_store.py, "steps": per machine, model shape, threads and dtype) as
ratios to a plain step, so a new process starts from the last one's ratios and prices them against its own plain
step, timed in its first steps (`StepCosts`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

ROW_DECAY = 0.9  # per step of the row: acceptance drifts with what the row writes
BATCH_DECAY = 0.98
PRIOR = 0.5  # a_i before anything is measured, as pseudo-counts of PRIOR_WEIGHT tries
PRIOR_WEIGHT = 2.0
SHRINK = 4.0  # the batch's estimate counts as this many of the row's own tries
OPTIMISM = 0.1  # a_j + 0.1 / sqrt(1 + the row's tries of j)
WINDOW = 15  # step costs: the median of the last 15 steps of each kind
MEASURED_AFTER = 3  # ... once a width (or the draft depth) has this many in the call: before, priced optimistically
DEFAULT_VERIFY_RATIO = 0.1  # a width never measured: each verified token past the first costs 0.1 of a decode
DEFAULT_DRAFT_RATIO = 0.1  # and each draft depth 0.1 of a decode
BINS = 10
STORE_TOLERANCE = 0.05  # measured step costs within this of the stored ones are not written back
PLAIN_FIRST = 2  # plain steps that start each call, timing the step every plan is priced against


class Acceptance:
    """Decayed counts of tries and acceptances per draft position 1..n."""

    def __init__(self, positions: int, decay: float):
        self.decay = decay
        self.tries = [0.0] * positions
        self.accepted = [0.0] * positions

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification step that proposed `drafted` drafts and kept the first `accepted`: position j was tried
        when every draft before it was kept."""
        self.tries = [t * self.decay for t in self.tries]
        self.accepted = [a * self.decay for a in self.accepted]
        for j in range(min(drafted, accepted + 1)):
            self.tries[j] += 1
            self.accepted[j] += j < accepted

    def rates(self, prior: list[float], weight: float) -> list[float]:
        """a_j per position, the counts shrunk toward `prior` with `weight` pseudo-tries."""
        return [(a + weight * p) / (t + weight) for a, t, p in zip(self.accepted, self.tries, prior)]


def expected_tokens(rates: list[float], drafts: int) -> float:
    """1 + expected drafts kept of a chain of `drafts` with per-position conditional rates."""
    total, kept = 1.0, 1.0
    for a in rates[:drafts]:
        kept *= a
        total += kept
    return total


class Calibration:
    """P(draft accepted | the head's probability q of it, its prefix accepted), in BINS equal bins of q, each
    starting at its own centre (a calibrated head) with PRIOR_WEIGHT pseudo-tries."""

    def __init__(self):
        self.tries = [0.0] * BINS
        self.accepted = [0.0] * BINS

    @staticmethod
    def bin(q: float) -> int:
        return min(int(q * BINS), BINS - 1)

    def observe(self, q: float, kept: bool) -> None:
        i = self.bin(q)
        self.tries[i] = self.tries[i] * BATCH_DECAY + 1
        self.accepted[i] = self.accepted[i] * BATCH_DECAY + kept

    def __call__(self, q: float) -> float:
        i = self.bin(q)
        return (self.accepted[i] + PRIOR_WEIGHT * (i + 0.5) / BINS) / (self.tries[i] + PRIOR_WEIGHT)


class StepCosts:
    """Seconds of a step by the tokens it verifies (1: a plain step), and of one draft depth: the median of the last
    `WINDOW` measured in this call (a step slowed by other work on the machine moves a median little), once there
    are `MEASURED_AFTER` of them. Before that a width is priced optimistically: at this call's plain step times the
    lower of its stored ratio and the default one, or at its own samples where they are lower still.

    The store keeps ratios to a plain step measured within one call, never absolute seconds carried between calls:
    figures taken under different loads, mixed, once priced a plain step at 1.5x its real cost (30 ms stored
    against 20 measured), so auto drafted at a loss and, never decoding plainly, never found out (0.76x plain
    decoding when sampling at T = 1.2). For the same reason each call decodes its first `PLAIN_FIRST` steps
    plainly: the plain step is then measured, not assumed. And a price is never taken above the default from the
    store, nor from one or two samples: a first draft step of a process that took 22 ms (0.9 of a plain step,
    against ~0.05 later), stored, priced the head out of every later call, which, never drafting, never measured
    it again (auto drafted from the context alone)."""

    def __init__(self, seeded: dict | None = None):
        self.steps: dict[int, deque] = {}
        self.drafts: deque = deque(maxlen=WINDOW)
        self.measured: dict[int, float] = {}  # verify width -> the median of its window, once it holds enough
        self.draft_median: float | None = None
        seeded = seeded or {}
        self.ratios = {int(n): r for n, r in seeded.get("ratios", {}).items()}  # older stores held seconds: unread
        self.draft_ratio = seeded.get("draft_ratio")

    def plain_known(self) -> bool:
        """Whether this call has timed enough plain steps to price the others against."""
        return 1 in self.measured

    def observe(self, verified: int, seconds: float, draft_depths: int = 0, draft_seconds: float = 0.0) -> None:
        """A step that verified `verified` tokens took `seconds`, of which `draft_seconds` drafted `draft_depths`
        depths."""
        window = self.steps.setdefault(verified, deque(maxlen=WINDOW))
        window.append(seconds - draft_seconds)
        if len(window) >= (PLAIN_FIRST if verified == 1 else MEASURED_AFTER):
            self.measured[verified] = statistics.median(window)  # once a step: plans read these many times a step
        if draft_depths:
            self.drafts.append(draft_seconds / draft_depths)
            if len(self.drafts) >= MEASURED_AFTER:
                self.draft_median = statistics.median(self.drafts)

    def _envelope(self, n: int) -> float:
        """The least median measured at width n or wider: verifying more tokens never costs less, so a width timed
        slower than a wider one (the first steps of a call run up to 1.5x the later ones) is priced at the wider."""
        return min(s for m, s in self.measured.items() if m >= n)

    def ratio(self, n: int) -> float:
        """V(n) / V(1): measured in this call where both are, else the lower of the stored and the default."""
        if n in self.measured and 1 in self.measured:
            return self._envelope(n) / self._envelope(1)
        default = 1 + DEFAULT_VERIFY_RATIO * (n - 1)
        return min(self.ratios.get(n, default), default)

    def plain(self) -> float:
        """Seconds of a plain step: measured, else from the nearest measured width by its ratio (1.0 before any)."""
        if 1 in self.measured:
            return self._envelope(1)
        if not self.measured:
            return 1.0
        m = min(self.measured, key=lambda w: (abs(w - 1), w))
        return self._envelope(m) / self.ratio(m)

    def verify(self, n: int) -> float:
        """Seconds of a step verifying n tokens: measured, else this call's plain step times its ratio (or the few
        samples of it, where lower)."""
        if n in self.measured:
            return self._envelope(n)
        prior = self.plain() * self.ratio(n)
        return min(prior, statistics.median(self.steps[n])) if self.steps.get(n) else prior

    def draft(self) -> float:
        """Seconds of one draft depth: measured, else the lower of its stored and default share of a plain step
        (or of the few samples of it)."""
        if self.draft_median is not None:
            return self.draft_median
        stored = DEFAULT_DRAFT_RATIO if self.draft_ratio is None else min(self.draft_ratio, DEFAULT_DRAFT_RATIO)
        prior = stored * self.plain()
        return min(prior, statistics.median(self.drafts)) if self.drafts else prior

    def record(self) -> dict:
        """What the store keeps: each width's ratio to a plain step and the draft depth's, those measured in this
        call replacing the stored ones (none without a plain step timed in this call: nothing to divide by)."""
        ratios, draft = dict(self.ratios), self.draft_ratio
        if 1 in self.measured:
            ratios.update({n: self.ratio(n) for n in self.measured if n > 1})
            if self.draft_median is not None:
                draft = self.draft_median / self.plain()
        return {"ratios": {str(n): r for n, r in sorted(ratios.items())},
                **({"draft_ratio": draft} if draft is not None else {})}

    def moved(self) -> bool:
        """Whether `record()` differs from the stored figures by more than STORE_TOLERANCE (a width new or one
        moved): only then is it worth rewriting the store (~15 ms for a route store of SmolLM2's shapes)."""
        now = self.record()
        new_draft = ("draft_ratio" in now) != (self.draft_ratio is not None)
        if now["ratios"].keys() != {str(n) for n in self.ratios} or new_draft:
            return True
        pairs = [(now["ratios"][str(n)], r) for n, r in self.ratios.items()]
        pairs += [(now["draft_ratio"], self.draft_ratio)] if self.draft_ratio is not None else []
        return any(abs(a / b - 1) > STORE_TOLERANCE for a, b in pairs if b)


@dataclass
class Plan:
    """One row's choice for a step: source "plain", "head" or "context", the drafts its expectation picked, the
    seconds per token it expects (gating prices a further draft with it) and, for the head, its rates a_j."""

    source: str
    drafts: int = 0
    seconds_per_token: float = 0.0
    rates: list[float] = field(default_factory=list)


@dataclass
class RowState:
    head: Acceptance
    context: Acceptance


class Controller:
    """Chooses each row's plan, prices gating, and learns from every verification step."""

    def __init__(self, head_drafts: int, context_drafts: int, costs: StepCosts):
        self.head_drafts, self.context_drafts, self.costs = head_drafts, context_drafts, costs
        self.positions = max(head_drafts, context_drafts, 1)
        self.batch = {"head": Acceptance(self.positions, BATCH_DECAY),
                      "context": Acceptance(self.positions, BATCH_DECAY)}
        self.calibration = Calibration()
        self.rows: dict[int, RowState] = {}

    def row(self, r: int) -> RowState:
        if r not in self.rows:
            self.rows[r] = RowState(Acceptance(self.positions, ROW_DECAY), Acceptance(self.positions, ROW_DECAY))
        return self.rows[r]

    def rates(self, r: int, source: str) -> list[float]:
        """Row r's a_j for `source`: its own counts shrunk toward the batch's, those toward PRIOR, plus an optimism
        bonus that shrinks as the row tries position j (a position never tried would otherwise stay at a
        pessimistic estimate for good: a plan that does not reach it learns nothing about it)."""
        own = getattr(self.row(r), source)
        batch = self.batch[source].rates([PRIOR] * self.positions, PRIOR_WEIGHT)
        return [min(1.0, a + OPTIMISM / (1 + t) ** 0.5) for a, t in zip(own.rates(batch, SHRINK), own.tries)]

    def plan(self, r: int, found: int) -> Plan:
        """Row r's plan for this step; `found`: context drafts its lookup found (0: none)."""
        costs = self.costs
        options = [Plan("plain", 0, costs.verify(1))]
        if not costs.plain_known():
            return options[0]
        if self.head_drafts:
            rates = self.rates(r, "head")
            for k in range(1, self.head_drafts + 1):
                seconds = costs.verify(k + 1) + k * costs.draft()
                options.append(Plan("head", k, seconds / expected_tokens(rates, k), rates))
        if found:
            rates = self.rates(r, "context")
            for n in range(1, min(found, self.context_drafts) + 1):
                options.append(Plan("context", n, costs.verify(n + 1) / expected_tokens(rates, n), rates))
        return min(options, key=lambda p: p.seconds_per_token)

    def keep_drafting(self, plan: Plan, depth: int, prefix_accepted: float) -> bool:
        """After draft `depth` of a head plan, with P(drafts 1..depth all accepted) = prefix_accepted (from the
        calibrated head probabilities): whether drafting on to some depth m <= head_drafts is worth its draft steps
        and verified tokens at the plan's price per token (not only the next one: a weak next draft can open a
        strong run after it)."""
        gain, kept, base = 0.0, prefix_accepted, self.costs.verify(depth + 1)
        for m in range(depth + 1, self.head_drafts + 1):
            kept *= plan.rates[m - 1]
            gain += kept
            cost = (m - depth) * self.costs.draft() + self.costs.verify(m + 1) - base
            if gain * plan.seconds_per_token >= cost:
                return True
        return False

    def observe(self, r: int, source: str, drafted: int, accepted: int, confidences: list[float]) -> None:
        """Row r's verification step, or drafts scored against the text that came without being verified (they
        count alike): `drafted` proposed from `source`, the first `accepted` kept; the head's probability of each
        draft where known (for the calibration)."""
        getattr(self.row(r), source).observe(drafted, accepted)
        self.batch[source].observe(drafted, accepted)
        for j, q in enumerate(confidences[: accepted + 1]):
            self.calibration.observe(q, j < accepted)
