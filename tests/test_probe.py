"""The one probe schedule of a row's planner and a batch's plan (plugins/probe.py)."""

from __future__ import annotations

import itertools

from treespec.plugins.probe import GAP_MAX, MIN_STEPS_OFF, Judge, ProbeSchedule


def plain_steps_until_probe(p: ProbeSchedule) -> int:
    n = 0
    while not p.due():
        n += 1
    return n


def test_each_loss_in_a_row_doubles_the_wait_up_to_the_most():
    p = ProbeSchedule(start=4, reset_after=10, most=32)
    waits = []
    for _ in range(6):
        p.lost()
        waits.append(plain_steps_until_probe(p))
    assert waits == [4, 8, 16, 32, 32, 32]


def test_a_winning_stretch_resets_the_gap_and_a_short_one_does_not():
    p = ProbeSchedule(start=4, reset_after=10)
    p.lost(), p.lost()  # next loss would wait 16
    for _ in range(9):
        p.won()
    p.lost()
    assert plain_steps_until_probe(p) == 16  # 9 wins < 10: the gap kept doubling
    for _ in range(10):
        p.won()
    p.lost()
    assert plain_steps_until_probe(p) == 4


def test_nothing_to_wait_for_until_a_loss():
    p = ProbeSchedule.for_row()
    assert p.due() and p.gap == p.start
    assert ProbeSchedule.for_batch().start > p.start  # a batch's probe also pays every row's catch-up
    assert ProbeSchedule.for_row().most == GAP_MAX


def test_a_new_sequence_probes_at_once_and_starts_the_gap_over():
    p = ProbeSchedule(start=4, reset_after=10, most=256)
    for _ in range(5):
        p.lost()  # a draft that lost five times on one prompt: the next wait is 128 steps
    assert p.wait == 64 and p.gap == 128
    p.restart()
    assert plain_steps_until_probe(p) == 0  # the next prompt's first plain step probes
    p.lost()
    assert plain_steps_until_probe(p) == 4  # and a loss there waits from the start again


def test_the_row_planner_restarts_its_probes_at_each_generate():
    from treespec.plugins.cost_aware import AutoPlanner

    planner = AutoPlanner(cap=32, max_depth=8, calibration=None, refine=False, profile="none")
    planner.judge.off = True
    for _ in range(4):
        planner.judge.probes.lost()
    assert not planner.judge.due()  # off, waiting
    planner.start()
    assert planner.judge.due()  # a new generate: the probe is due on its first step


def judged_off(tokens: list[float], steps: int, seconds: float = 0.0375, plain: float = 0.030) -> int | None:
    """Feed a row's judge ``steps`` speculative steps gaining ``tokens`` (cycled; each step ``seconds``
    long, a plain step ``plain``): the step at which it turned speculation off, or None."""
    judge = Judge.for_row()
    for step, t in zip(range(1, steps + 1), itertools.cycle(tokens)):
        judge.speculated(t, seconds, plain)
        if judge.off:
            return step
    return None


def test_an_unlucky_start_of_a_winning_draft_keeps_speculation_on_where_a_steady_loss_does_not():
    """SmolLM2's default draft on README command 1's prompt: a step verifying 2 nodes takes 1.25 plain
    steps and gains 1 or 2 tokens, its first token accepted on 40% of steps (1.12× plain's rate).
    Its first judged steps accept 1 of 8 (0.9× plain's rate: a loss by the point estimate, but within
    the noise of eight 0-or-1 outcomes): speculation stays on, and the draft's win shows as it goes.
    Steps gaining 1.125 tokens each, the same 0.9×, lose for sure and turn it off at the first
    judgement."""
    start = [1.0] * 4 + [2.0] + [1.0] * 7  # 4 trial steps (not judged), then 1 of 8 accepted
    winning = [2.0, 1.0, 2.0, 1.0, 1.0]
    assert judged_off(start + winning * 10, len(start) + 50) is None
    assert judged_off([1.125], MIN_STEPS_OFF + 8) == MIN_STEPS_OFF


def test_a_noisy_clear_loss_still_turns_speculation_off():
    """A draft accepted on 10% of steps, each step 1.25 plain steps long (0.88 of plain's rate): its noise
    delays the verdict by a few steps, not for good."""
    step = judged_off([2.0] + [1.0] * 9, 60)
    assert step is not None and step <= 30
