"""Speculation on or off, and when to try it again: the one judge of a row's planner
(``cost_aware.AutoPlanner``) and of a batch's plan (``batch_budget.BatchPlan``).

**Judged on one clock.** A speculative step's rate (tokens / its wall seconds) is compared with what
plain decoding would have done in the same step: one token in the step's time without its drafting,
× T(0) / T(n) from the cost curves (``as_plain``) — the curves give the ratio, the step gives the
clock. Plain walls measured at another time are never compared: this VM's speed swings ±30% from one
prompt to the next, and a plain rate from a fast minute turned speculation off in a slow one. After
``MIN_STEPS_OFF`` speculative steps (the first ``TRIAL_STEPS`` after turning on left out: their
drafter catches up on what it skipped), speculation whose moving-average rate is below ``TIE`` × the
same steps' plain rate is a loss; within it, a tie, and speculation stays on. A loss must also be more
than the steps' noise (``StepRatios``): a draft accepted on 45% of steps gains 0 or 1 tokens, so eight
steps of it can look like a loss that twenty do not show; turning off on such a stretch costs the whole
win until the next probe, so speculation goes off only when the mean of its steps' speed-ups is below
``TIE`` by more than ``Z_NOISE`` standard errors (a clear loss, whose steps all lose, still goes off at
once).

**Probes.** A loss turns speculation off for ``gap`` plain steps, then one probe step drafts again and
the caller says whether its plan expects to beat a plain step (``probed``); every loss in a row
doubles the gap (up to ``GAP_MAX``), so a draft that never pays costs a vanishing share of the steps,
and a long winning stretch (``reset_after`` speculative steps in a row) makes the next loss wait
``start`` steps again, so a draft that pays in stretches finds them quickly. A row's new sequence
probes on its first step and starts the gap over (``restart``): the text, and what a draft wins on it,
changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GAP_MAX = 256  # the longest wait between probes (one probe in 257 steps: under 0.4% of them)
#: a single sequence: its probe costs one step's drafting
ROW_GAP_START, ROW_RESET_AFTER = 4, 64
#: a batch: a probe after a plain stretch also pays every row's draft catch-up of that stretch
BATCH_GAP_START, BATCH_RESET_AFTER = 16, 16
MIN_STEPS_OFF = 12  # speculative steps measured before speculation may be judged a loss
TRIAL_STEPS = 4  # speculative steps after (re)turning on that the judgement leaves out
TIE = 0.97  # speculation is a loss only below this share of the same steps' plain-decoding rate
JUDGE_EMA = 0.05  # the judgement's averages: running means, then moving averages of about 20 steps
Z_NOISE = 1.0  # a loss is judged real when the steps' mean speed-up is this many standard errors below TIE


def weight(alpha: float, count: int) -> float:
    """The next step's weight in a moving average that has seen ``count`` steps: a running mean until
    it has 1/alpha of them, then alpha."""
    return max(alpha, 1.0 / (count + 1))


class RateAverage:
    """A ratio of exponential moving averages (tokens / seconds): a rate that one slow step cannot swing."""

    def __init__(self, alpha: float = JUDGE_EMA):
        self.alpha, self.tokens, self.seconds = alpha, 0.0, 0.0
        self.count = 0

    def add(self, tokens: float, seconds: float) -> None:
        a = weight(self.alpha, self.count)
        self.tokens += a * (tokens - self.tokens)
        self.seconds += a * (seconds - self.seconds)
        self.count += 1

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.count and self.seconds > 0 else None


class StepRatios:
    """Moving mean and variance of each step's speed-up over plain decoding (its tokens × the plain
    step's seconds / its own seconds), weighted as ``RateAverage`` weighs steps (``weight``): how sure
    a loss is."""

    def __init__(self, alpha: float = JUDGE_EMA):
        self.alpha, self.mean, self.var, self.count = alpha, 0.0, 0.0, 0

    def add(self, ratio: float) -> None:
        a = weight(self.alpha, self.count)
        delta = ratio - self.mean
        self.mean += a * delta
        self.var = (1.0 - a) * (self.var + a * delta * delta)  # West's weighted variance update
        self.count += 1

    def surely_below(self, level: float) -> bool:
        """The mean is below ``level`` by more than ``Z_NOISE`` standard errors (the moving average holds
        about (2 − α) / α steps' worth of evidence once it has seen that many)."""
        n = min(self.count, (2.0 - self.alpha) / self.alpha)
        spread = Z_NOISE * (self.var / n) ** 0.5 if n > 1 else float("inf")
        return self.mean + spread < level


def as_plain(t_step: np.ndarray | None, n: int, seconds: float) -> float:
    """A plain step's seconds, from the ``seconds`` a step spent verifying ``n`` drafted nodes per row
    (and its bookkeeping): × T(0) / T(n), the cost curves' ratio (unchanged without usable curves)."""
    if t_step is None or n >= t_step.size or t_step[n] <= 0 or t_step[0] <= 0:
        return seconds
    return seconds * float(t_step[0]) / float(t_step[n])


@dataclass
class ProbeSchedule:
    start: int  # plain steps after a first loss
    reset_after: int  # speculative steps in a row after which the gap starts over
    most: int = GAP_MAX
    gap: int = field(init=False)  # plain steps the next loss waits
    wait: int = 0  # plain steps left before the next probe
    streak: int = 0  # speculative steps since the last loss

    def __post_init__(self) -> None:
        self.gap = self.start

    def lost(self) -> None:
        """Speculation lost: plain for ``gap`` steps, and the next loss waits twice as long."""
        self.wait, self.gap, self.streak = self.gap, min(2 * self.gap, self.most), 0

    def won(self) -> None:
        """One more speculative step without a loss; a long enough stretch resets the gap."""
        self.streak += 1
        if self.streak >= self.reset_after:
            self.gap = self.start

    def restart(self) -> None:
        """A new sequence: the next plain step probes, and a loss waits ``start`` steps again. What a
        draft wins depends on the text (SmolLM2's head with prompt lookup: τ 1.0 on one MT-Bench
        writing prompt, 2.9 on the next), so a long wait learnt on one prompt does not carry over."""
        self.wait, self.gap, self.streak = 0, self.start, 0

    def due(self) -> bool:
        """A plain step asks: is it the probe's turn? (Counts the wait down; True once it is over.)"""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    @classmethod
    def for_row(cls) -> ProbeSchedule:
        return cls(ROW_GAP_START, ROW_RESET_AFTER)

    @classmethod
    def for_batch(cls) -> ProbeSchedule:
        return cls(BATCH_GAP_START, BATCH_RESET_AFTER)


class Judge:
    """Whether to speculate (see the module docstring): fed every speculative step (``speculated``) and
    every probe's verdict (``probed``); asked by plain steps whether a probe is due (``due``)."""

    def __init__(self, probes: ProbeSchedule):
        self.probes = probes
        self.off = False
        self.steps = 0  # speculative steps since speculation was (re)turned on
        self.spec = RateAverage()  # those steps: tokens / seconds
        self.plain = RateAverage()  # the same steps as plain decoding: one token / their priced seconds
        self.ratios = StepRatios()  # the same steps' own speed-ups: is a loss more than noise?

    @classmethod
    def for_row(cls) -> Judge:
        return cls(ProbeSchedule.for_row())

    @classmethod
    def for_batch(cls) -> Judge:
        return cls(ProbeSchedule.for_batch())

    @property
    def trial(self) -> bool:
        """One of the first steps after (re)turning on (a row verifies at least one node in them)."""
        return self.steps < TRIAL_STEPS

    def speculated(self, tokens: float, seconds: float, plain_seconds: float) -> None:
        """A speculative step gained ``tokens`` (per row) in ``seconds``; plain decoding would have
        taken ``plain_seconds`` (``as_plain``) for its one token. Turns speculation off on a loss."""
        self.steps += 1
        self.probes.won()
        if self.steps > TRIAL_STEPS:  # the trial steps (forced trees, a catch-up) are not the policy
            self.spec.add(tokens, seconds)
            self.plain.add(1.0, plain_seconds)
            if seconds > 0:
                self.ratios.add(tokens * plain_seconds / seconds)
        if self.steps < MIN_STEPS_OFF or self.spec.rate is None:
            return
        if self.spec.rate < TIE * (self.plain.rate or 0.0) and self.ratios.surely_below(TIE):
            self.off = True  # loses: off until a probe says otherwise
            self.probes.lost()

    def due(self) -> bool:
        """While off, a plain step asks whether it is the probe's turn."""
        return self.off and self.probes.due()

    def probed(self, wanted: bool) -> None:
        """A probe's verdict: its plan, drafting included, expected to beat plain decoding (``wanted``)
        turns speculation back on with fresh averages; otherwise the next probe waits longer."""
        if wanted:
            self.off, self.steps = False, 0
            self.spec, self.plain, self.ratios = RateAverage(), RateAverage(), StepRatios()
        else:
            self.probes.lost()
