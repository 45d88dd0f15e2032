"""torch's CPU threads follow the machine: as many as the cores other processes leave idle.

Why. torch runs an op on all its threads and waits for the slowest (an OpenMP barrier; idle
threads spin while they wait). When another process keeps a core busy, one of our threads shares
that core with it, and every op waits for the scheduler to give it a slice back. Measured on this
2-core machine with one busy process beside it (docs/benchmarks.md, "On a busy machine"):
SmolLM2's one-token forward 58 → 165 ms on 2 threads, 55 ms on 1; a 32-node tree 124 → 403 ms on 2
threads, 166 ms on 1; treespec-py's greedy decoding 160 → 45 tokens/s on 2 threads, 170 on 1. A
decode of many small forwards (speculative steps, drafting) pays the barrier most. On a quiet
machine the second thread pays for itself in a tree's forward (124 vs 170 ms for 32 nodes), so the
number of threads cannot be one fixed choice.

How. Over the last ``WINDOW`` seconds, the CPU time every process used (``/proc/stat``) minus this
process's own (``/proc/self/stat``, all its threads) is the other processes' load, in cores; torch
gets ``round(cores - load)`` threads, at least 1 and at most the count it had when the decode began
(``torch.set_num_threads`` or ``--threads``: the ceiling). ``follow()`` is called at step
boundaries; it reads two small files at most every ``WINDOW`` seconds and costs nothing between.
``following()`` brackets a decode and gives torch its ceiling back at the end: treespec changes
torch's thread count only while it decodes. Linux only (elsewhere nothing changes);
``TREESPEC_FOLLOW_LOAD=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import torch

WINDOW = 0.25  # seconds between looks at the machine
FIRST_LOOK = 0.03  # the first look of a process: a short window of its own (nothing earlier to compare)
_STAT = "/proc/stat"
_SELF = "/proc/self/stat"


def enabled() -> bool:
    """Whether threads follow the load: Linux's /proc is readable and ``TREESPEC_FOLLOW_LOAD`` is not 0."""
    return os.environ.get("TREESPEC_FOLLOW_LOAD", "1") not in ("0", "false", "no", "off") and os.path.exists(_STAT)


def _cores() -> int:
    mine = _affinity()
    return len(mine) if mine else (os.cpu_count() or 1)


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _sample() -> tuple[float, int, int] | None:
    """(now, busy ticks of the cores this process may run on, this process's ticks), or None when /proc
    cannot be read. Only those cores count: in a container pinned to 2 of a host's 64 cores, the
    other 62 are someone else's business."""
    mine = _affinity()
    try:
        busy = 0
        with open(_STAT) as f:
            for line in f:  # cpuN user nice system idle iowait irq softirq steal ...
                if not line.startswith("cpu"):
                    break
                fields = line.split()
                if fields[0] == "cpu" or (mine is not None and int(fields[0][3:]) not in mine):
                    continue
                busy += sum(int(v) for i, v in enumerate(fields[1:9]) if i not in (3, 4))  # all but idle, iowait
        with open(_SELF) as f:
            own = f.read().rsplit(")", 1)[1].split()  # the fields after the command name: utime, stime at 11, 12
        return time.monotonic(), busy, int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


def _clock_tick() -> float:
    return float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _others(first: tuple[float, int, int], now: tuple[float, int, int], tick: float) -> float | None:
    """The other processes' mean load between two ``_sample``s, in cores (None: no time between them)."""
    elapsed = now[0] - first[0]
    if elapsed <= 0:
        return None
    return max(0.0, ((now[1] - first[1]) - (now[2] - first[2])) / tick / elapsed)


class LoadMeter:
    """How busy other processes kept this process's cores while something was measured: ``others()`` is
    their mean load since the meter was made, in cores (None where /proc cannot be read). A measurement
    taken beside other work (``treespec.row_matmul``'s verdict) is used but not kept for later runs."""

    def __init__(self) -> None:
        self.first = _sample()

    def others(self) -> float | None:
        now = _sample() if self.first is not None else None
        return _others(self.first, now, _clock_tick()) if now is not None else None


class _Follower:
    """The process's one thread governor (torch's thread count is process-wide)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0  # decodes in progress (several Decoders may run in several threads)
        self.ceiling = 0  # torch's count when the first of them began
        self.last: tuple[float, int, int] | None = None
        self.others = 0.0  # the other processes' load at the last look, in cores
        self.cores = _cores()  # the cores this process may run on, at the last look
        self.tick = _clock_tick()

    def look(self) -> None:
        """Measure the other processes' load since the last look (the first look waits FIRST_LOOK)."""
        self.cores = _cores()
        if self.last is None:
            self.last = _sample()
            if self.last is None:
                return
            time.sleep(FIRST_LOOK)
        now = _sample()
        if now is None or self.last is None:
            return
        others = _others(self.last, now, self.tick)
        if others is None:
            return
        self.others, self.last = others, now

    def threads(self) -> int:
        """What torch should run on now."""
        return max(1, min(self.ceiling, round(self.cores - self.others)))

    def follow(self) -> int:
        with self.lock:
            if self.depth == 0:
                return torch.get_num_threads()
            if self.last is None or time.monotonic() - self.last[0] >= WINDOW:
                self.look()
            want = self.threads()  # also between looks: a decode that begins restores nothing the last look saw
            if want != torch.get_num_threads():
                torch.set_num_threads(want)
            return want


_follower = _Follower()


def follow() -> int:
    """At a step boundary, inside ``following()``: set torch's threads to what the machine leaves idle
    (re-measured at most every WINDOW seconds). Returns the count torch runs on."""
    return _follower.follow() if _follower.depth else torch.get_num_threads()


@contextlib.contextmanager
def following() -> Iterator[None]:
    """One decode during which torch's threads follow the machine's load; torch's own count (the
    ceiling) is back when the last concurrent decode ends. A no-op where ``enabled()`` is False."""
    if not enabled():
        yield
        return
    f = _follower
    with f.lock:
        if f.depth == 0:
            f.ceiling = torch.get_num_threads()
        f.depth += 1
    try:
        follow()
        yield
    finally:
        with f.lock:
            f.depth -= 1
            if f.depth == 0 and torch.get_num_threads() != f.ceiling:
                torch.set_num_threads(f.ceiling)
