"""How sure a speed ratio is: a bootstrap interval over prompts, paired.

Why. This machine's speed swings by 10–30% from minute to minute (docs/benchmarks.md shows the same
configuration 42.8 then 29.0 tokens/s back to back), so one run's ratio of two rows — "0.97× the best
fixed row", "1.14× greedy" — can land on either side of a 5% target by chance. The bench runs every
configuration on a prompt back to back (``Bench.run``), so a prompt's rows share the machine's speed of
that minute: the comparison is *paired* by prompt. Resampling prompts with replacement and recomputing
the ratio on each resample gives the spread that the choice of prompts and the drift between them
leave in the ratio; its 2.5th and 97.5th percentiles are the interval reported beside the ratio.

The statistic is the bench's own: a row's rate is Σ tokens / Σ seconds over its prompts, and the ratio
of two rows is the ratio of their rates (long prompts weigh more, as they do in tokens/s). For a row
``a`` against a row ``b``, with per-prompt (tokens, seconds) pairs aligned by prompt:

    ratio = (Σ_p tok_a[p] / Σ_p sec_a[p]) / (Σ_p tok_b[p] / Σ_p sec_b[p])
    resample p* ~ uniform over prompts, B times → ratio*; interval = percentiles (2.5, 97.5) of ratio*

With fewer than ``MIN_PROMPTS`` prompts there is no interval (None): a bootstrap of two prompts says
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DRAWS = 2000  # bootstrap resamples
LEVEL = 0.95  # the interval's coverage
MIN_PROMPTS = 4  # fewer prompts: no interval
SEED = 0  # the resampling is seeded: the same results give the same interval
NEAR_BEST = 0.95  # issue 28's target: nodes=auto within 5% of the best fixed row

Pairs = Sequence[Sequence[float]]  # per prompt: (tokens, seconds)


def ratio(a: Pairs, b: Pairs) -> float | None:
    """Row ``a``'s rate over row ``b``'s (Σ tokens / Σ seconds each), or None if either is empty."""
    ta, sa = np.asarray(a, dtype=float).reshape(-1, 2).sum(0)
    tb, sb = np.asarray(b, dtype=float).reshape(-1, 2).sum(0)
    if sa <= 0 or sb <= 0 or tb <= 0:
        return None
    return float((ta / sa) / (tb / sb))


def interval(a: Pairs, b: Pairs, draws: int = DRAWS, level: float = LEVEL) -> tuple[float, float] | None:
    """The bootstrap interval of ``ratio(a, b)`` over prompts (``a[p]`` and ``b[p]`` the same prompt)."""
    x, y = np.asarray(a, dtype=float).reshape(-1, 2), np.asarray(b, dtype=float).reshape(-1, 2)  # [P, 2] each
    if len(x) != len(y):
        raise ValueError(f"paired rows need the same prompts: {len(x)} against {len(y)}")
    if len(x) < MIN_PROMPTS or (x[:, 1] <= 0).any() or (y[:, 1] <= 0).any():
        return None
    picks = np.random.default_rng(SEED).integers(0, len(x), size=(draws, len(x)))  # [D, P] resampled prompts
    xs, ys = x[picks].sum(1), y[picks].sum(1)  # [D, 2] Σ tokens, Σ seconds per resample
    ratios = (xs[:, 0] / xs[:, 1]) / (ys[:, 0] / ys[:, 1])  # [D]
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


def span(bounds: tuple[float, float]) -> str:
    """An interval as the reports print it: ``lo–hi``."""
    return f"{bounds[0]:.2f}–{bounds[1]:.2f}"


def cell(value: float, bounds: tuple[float, float] | None) -> str:
    """A table cell: the ratio, and its interval in parentheses unless there is none or it is a point
    (the reference row against itself)."""
    if not bounds or bounds[0] == bounds[1]:
        return f"{value:.2f}"
    return f"{value:.2f} ({span(bounds)})"


def verdict(bounds: tuple[float, float] | None, goal: float) -> str:
    """A target "ratio ≥ goal" read against the interval: met (all of it above), MISSED (all of it
    below) or undecided (it straddles the goal: more prompts would decide)."""
    if bounds is None:
        return f"undecided (fewer than {MIN_PROMPTS} paired runs: no interval)"
    lo, hi = bounds
    return "met" if lo >= goal else "MISSED" if hi < goal else "undecided (the interval straddles it)"
