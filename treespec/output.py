"""What a decode returns, and the one place a finished step becomes output.

The decode loop (``treespec.engine``, for one prompt or a batch's rows) hands every finished step of
a sequence to ``emit``: the tokens are cut after the first EOS, appended to the sequence and
its ``Output``, and the step's statistics recorded. Nothing else does any of the three.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from treespec.interfaces import PlanNote
from treespec.stats import RunStats, StepStats
from treespec.step import Step

StreamCallback = Callable[[list[int]], None]


@dataclass
class Output:
    token_ids: list[int]  # the new tokens only
    text: str
    prompt_ids: list[int]
    stats: RunStats = field(default_factory=RunStats)


def emit(
    out: Output, committed: list[int], done: Step, eos: Collection[int], wall: float, note: PlanNote | None = None
) -> tuple[list[int], bool]:
    """Commit one finished step to a sequence: its tokens up to and including the first EOS go to
    ``committed`` and ``out``, and its statistics to ``out.stats``. Returns (the tokens kept, whether
    an EOS ended the sequence). ``wall``: seconds since the sequence's previous step ended."""
    new = done.tokens
    hit = next((i for i, t in enumerate(new) if t in eos), None)
    if hit is not None:
        new = new[: hit + 1]
    committed += new
    out.token_ids += new
    out.stats.new_tokens = len(out.token_ids)
    out.stats.steps.append(step_stats(done, emitted=len(new), wall=wall, note=note))
    return new, hit is not None


def step_stats(done: Step, emitted: int, wall: float = 0.0, note: PlanNote | None = None) -> StepStats:
    """The statistics of one finished step (``emitted``: tokens kept, after an EOS cut; ``wall``: seconds
    since the previous step ended; ``note``: what a planning builder expected)."""
    tree, seconds = done.tree, done.seconds
    return StepStats(
        tree_size=tree.size,
        depth=tree.depth,
        accepted=done.acceptance.accepted,
        emitted=emitted,
        expected_accepted=tree.expected_accepted(),
        t_draft=seconds["draft"],
        t_verify=seconds["verify"],
        t_bookkeeping=seconds["bookkeeping"],
        t_wall=wall,
        predicted_seconds=note.predicted_seconds if note else None,
        planned_expected=note.expected if note else None,
        plan_seconds=note.own_seconds if note else None,
    )
