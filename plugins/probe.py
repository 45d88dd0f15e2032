"""When speculation is off, when to try it again: one probe schedule for a row's planner
(``cost_aware.AutoPlanner``) and a batch's plan (``batch_budget.BatchPlan``).

A loss turns speculation off for ``gap`` plain steps, then one probe step drafts again; every loss in a
row doubles the gap (up to ``most``), so a draft that never pays costs a vanishing share of the steps,
and a long winning stretch (``reset_after`` speculative steps in a row) makes the next loss wait
``start`` steps again, so a draft that pays in stretches finds them quickly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GAP_MAX = 256  # the longest wait between probes (one probe in 257 steps: under 0.4% of them)
#: a single sequence: its probe costs one step's drafting
ROW_GAP_START, ROW_RESET_AFTER = 4, 64
#: a batch: a probe after a plain stretch also pays every row's draft catch-up of that stretch
BATCH_GAP_START, BATCH_RESET_AFTER = 16, 16


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
