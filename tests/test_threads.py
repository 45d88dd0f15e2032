"""torch's threads follow the machine's load while treespec decodes (treespec/threads.py, issue 27)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import treespec
from conftest import STORIES260K, tinystories_prompts
from treespec import threads
from treespec.bench.load import background_load

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux: threads follow the load there only")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class FakeMachine:
    """``threads._sample`` as a machine where other processes keep ``others`` cores busy (ticks at 100/s)."""

    def __init__(self, others: float):
        self.others, self.t = others, 0.0

    def __call__(self):
        self.t += 1.0
        return 1000.0 + self.t, int(100 * self.others * self.t), 0


@pytest.fixture
def fake_machine(monkeypatch):
    def install(others: float) -> FakeMachine:
        machine = FakeMachine(others)
        monkeypatch.setattr(threads, "_sample", machine)
        monkeypatch.setattr(threads, "_cores", lambda: 2)
        monkeypatch.setattr(threads._follower, "last", None)
        monkeypatch.setattr(threads._follower, "tick", 100.0)
        monkeypatch.setattr(threads, "FIRST_LOOK", 0.0)
        monkeypatch.setenv("TREESPEC_FOLLOW_LOAD", "1")
        return machine

    return install


@pytest.mark.parametrize("others,expected", [(0.0, 2), (0.3, 2), (0.7, 1), (1.0, 1), (3.5, 1)])
def test_threads_are_the_cores_other_processes_leave_idle(fake_machine, two_threads, others, expected):
    fake_machine(others)
    with threads.following():
        assert torch.get_num_threads() == expected
        assert threads._follower.others == pytest.approx(others)
    assert torch.get_num_threads() == 2  # the ceiling is back after the decode


def test_the_ceiling_is_the_count_torch_had_when_the_decode_began(fake_machine):
    fake_machine(0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threads.following():
            assert torch.get_num_threads() == 1  # an idle machine never raises it above the user's choice
    finally:
        torch.set_num_threads(before)


def test_outside_a_decode_nothing_changes(fake_machine, two_threads):
    fake_machine(1.0)
    assert threads.follow() == 2 and torch.get_num_threads() == 2


def test_nested_decodes_restore_the_ceiling_once_the_last_ends(fake_machine, two_threads):
    machine = fake_machine(1.0)
    with threads.following():
        with threads.following():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1  # the outer decode still runs under load
        machine.others = 0.0
        threads._follower.last = (0.0, 0, 0)  # the next look is due at once
        machine.t = 10.0
        assert threads.follow() == 2  # the other process stopped: the core comes back
    assert torch.get_num_threads() == 2


def test_turned_off_by_the_environment(fake_machine, two_threads, monkeypatch):
    fake_machine(1.0)
    monkeypatch.setenv("TREESPEC_FOLLOW_LOAD", "0")
    with threads.following():
        assert torch.get_num_threads() == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the measured case is a 2-core machine")
def test_a_real_busy_process_is_measured_and_leaves_one_thread(two_threads, monkeypatch):
    monkeypatch.setattr(threads._follower, "last", None)
    with background_load(1):
        time.sleep(0.5)  # let the scheduler start it
        with threads.following():
            time.sleep(threads.WINDOW + 0.2)
            assert threads.follow() == 1
            assert threads._follower.others > 0.5  # at least half a core's work besides ours
    assert torch.get_num_threads() == 2


def test_decoding_under_changing_thread_counts_stays_lossless(fake_machine, two_threads, monkeypatch):
    """Each step may run on another thread count (the load comes and goes): still the target's tokens."""
    machine = fake_machine(0.0)
    monkeypatch.setattr(threads, "WINDOW", 0.0)  # look at every step
    seen = []
    real_follow = threads._follower.follow

    def flapping() -> int:
        machine.others = 1.0 - machine.others  # busy, idle, busy, ...
        seen.append(real_follow())
        return seen[-1]

    monkeypatch.setattr(threads._follower, "follow", flapping)
    dec = treespec.Decoder(
        str(STORIES260K),
        drafter=str(STORIES260K),
        drafter_options={"layers": 3},
        builder="opt-tree",
        builder_options={"nodes": 8},
    )
    prompt = tinystories_prompts(1)[0]
    ids = dec.prompt_ids(prompt)
    out = dec.generate(prompt, max_new_tokens=48)
    ref = dec.target.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids) :].tolist()
    assert out.token_ids == ref[: len(out.token_ids)] and len(out.token_ids) == len(ref)
    assert {1, 2} <= set(seen)  # the decode really ran on both counts
    assert torch.get_num_threads() == 2


def test_a_decode_that_begins_between_looks_runs_on_the_measured_count(fake_machine, two_threads, monkeypatch):
    """The next prompt's decode starts within a window of the last look: it must not run on the restored
    ceiling until the next look (under load that cost a prompt's prefill 66-136 ms instead of 3-7)."""
    fake_machine(1.0)
    monkeypatch.setattr(threads, "WINDOW", 1e9)  # no second look
    with threads.following():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with threads.following():
        assert torch.get_num_threads() == 1
