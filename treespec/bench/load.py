"""``treespec bench --background-load N``: N busy processes beside the measurement.

Users' machines run other work. On a 2-core machine one competing process took HF greedy to 0.63×
of its quiet speed and treespec's rows to 0.24–0.35× of theirs (issue 27): a speed-up measured only
on a quiet machine is not the whole truth. Each process is a Python loop that never sleeps (one
core's worth of work, the plainest competitor), at the bench's own priority; the bench starts them
after the models load and stops them when the measurement ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from treespec.errors import ConfigError

SPIN = "while True:\n    pass\n"
MAX_LOAD = 64  # more busy processes than this measures the scheduler, not treespec


def check_load(n: int | None) -> int:
    """``--background-load`` as a count (None: 0), or one line."""
    if n is None:
        return 0
    if not 0 <= n <= MAX_LOAD:
        raise ConfigError(f"--background-load must be between 0 and {MAX_LOAD} busy processes, got {n}")
    return n


@contextlib.contextmanager
def background_load(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` busy processes for the duration of the ``with`` block (none for n = 0)."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SPIN],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONPATH": ""},
                )
            )
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
