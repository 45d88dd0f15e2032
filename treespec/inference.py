"""``inference``: ``torch.inference_mode()`` around a function, entered only when it is not on already.

Entering and leaving ``torch.inference_mode()`` costs about 5 µs on a CPU (measured here: 2.8 µs in,
4.0 µs out, in a decode loop). A plain decoding step of a small model is ~1.5 ms and calls several
decorated methods (the target's forward and commit, the drafter's commit), so ``step.step`` enters the
mode once and the methods inside it do not enter again; called on their own, they still run in it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def inference(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` under ``torch.inference_mode()`` (no autograd, no version counters)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run
