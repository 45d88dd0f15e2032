"""The bench's paired bootstrap interval (treespec/bench/paired.py), checked against what it claims:
drift shared by a prompt's rows cancels, the interval covers the true ratio about 95% of the time, and
its verdicts read a target the way the docs say."""

import numpy as np
import pytest

from treespec.bench import paired


def _bench(rng, prompts, true_ratio, drift=0.3, noise=0.05):
    """Per-prompt (tokens, seconds) of a baseline row and a row ``true_ratio`` times as fast: each prompt
    has its own length and its own machine speed (shared by its two rows, as on a drifting VM), and each
    row its own small noise."""
    tokens = rng.integers(40, 257, prompts).astype(float)  # [P]
    machine = 20.0 * np.exp(rng.normal(0.0, drift, prompts))  # [P] tokens/s of the baseline this minute
    base = np.stack([tokens, tokens / (machine * np.exp(rng.normal(0.0, noise, prompts)))], 1)  # [P, 2]
    fast = np.stack([tokens, tokens / (true_ratio * machine * np.exp(rng.normal(0.0, noise, prompts)))], 1)
    return fast, base


def test_the_ratio_is_the_bench_rate_ratio():
    a, b = [[100, 2.0], [50, 0.5]], [[100, 4.0], [50, 2.0]]
    assert paired.ratio(a, b) == pytest.approx((150 / 2.5) / (150 / 6.0))


def test_identical_rows_give_a_point_interval_and_a_row_exactly_twice_as_fast_gives_two():
    rng = np.random.default_rng(1)
    fast, base = _bench(rng, 12, 2.0, noise=0.0)  # a drifting machine, no noise of the rows' own
    assert paired.interval(base, base) == pytest.approx((1.0, 1.0))
    lo, hi = paired.interval(fast, base)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)  # the shared drift cancels prompt by prompt


def test_a_row_faster_on_half_the_prompts_gets_an_interval_around_its_ratio():
    tokens = [[100.0, 1.0]] * 8
    mixed = [[100.0, 0.5]] * 4 + [[100.0, 1.0]] * 4  # twice as fast on half of them
    point = paired.ratio(mixed, tokens)
    lo, hi = paired.interval(mixed, tokens)
    assert 1.0 <= lo < point < hi <= 2.0


def test_the_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    """200 simulated benches of 20 prompts on a machine whose speed swings ±30% between prompts."""
    rng = np.random.default_rng(7)
    covered, widths = 0, []
    for _ in range(200):
        fast, base = _bench(rng, 20, 1.1)
        lo, hi = paired.interval(fast, base, draws=1000)
        covered += lo <= 1.1 <= hi
        widths.append(hi - lo)
    assert 0.85 <= covered / 200 <= 0.99
    assert np.median(widths) < 0.1  # paired: the ±30% drift does not widen it to ±30%


def test_unpaired_prompts_would_be_far_wider():
    """The same data with the baseline's prompts shuffled (pairing broken) gives a much wider interval:
    the pairing is what makes a 5% target decidable on this machine."""
    rng = np.random.default_rng(3)
    fast, base = _bench(rng, 24, 1.1)
    lo, hi = paired.interval(fast, base)
    shuffled = base[rng.permutation(len(base))]
    shuffled[:, 0] = fast[:, 0]  # same lengths per position, the machine's speed of another minute
    slo, shi = paired.interval(fast, shuffled)
    assert (shi - slo) > 3 * (hi - lo)


def test_too_few_prompts_or_mismatched_rows():
    assert paired.interval([[1, 1.0]] * 3, [[1, 1.0]] * 3) is None
    with pytest.raises(ValueError, match="same prompts"):
        paired.interval([[1, 1.0]] * 5, [[1, 1.0]] * 4)
    assert paired.ratio([], [[1, 1.0]]) is None


@pytest.mark.parametrize(
    ("bounds", "word"),
    [((0.96, 1.02), "met"), ((0.90, 0.94), "MISSED"), ((0.93, 0.99), "undecided"), (None, "undecided")],
)
def test_verdicts(bounds, word):
    assert paired.verdict(bounds, 0.95).startswith(word)
