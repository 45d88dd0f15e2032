"""One shape for a batch's step: the rows of an auto batch draft a chain of D nodes each and verify it.

In a batch, ONE target forward verifies [B, N_max] nodes and ONE draft forward serves each round of
expansions, so a step costs what its largest tree and its deepest drafting cost. Rows planning alone
get this wrong three ways: a row whose tree is smaller than the largest pays for padding it does not
use; a row that stops drafting early waits for the others' rounds anyway; and a row that turns
speculation off decodes plainly inside a step that still drafts and verifies trees for its neighbours
— it saves the batch nothing and gives up its own accepted tokens. So the batch chooses the shape, and
every row fills it. The shape is a chain (the draft's best guess at each of D depths): every best fixed
row of the batch benchmarks here is a chain, and a plan over trees of any width and size wandered into
shapes its cost model mispriced and ran 10–20% behind them (docs/bench/batch-default-pair-shared-map).
Only the depth is chosen, one round at a time, from what the rows expect and what the steps measured:

    each row reports E_r[d, n] = the calibrated expected accepted length of its best n-node tree
        within depth d; the plan keeps a moving average Ē of the rows' tables
    W(D) = the batch's measured step wall at depth D (decayed by ``WALL_DECAY`` per step, so the
        depths' walls cover the same stretch of prompts)
    D ← argmax over D' in {D − 1, D, D + 1} of (1 + Ē[D', D']) / W(D'), moving only for ``SWITCH``
        more (near the best, chains of 3 to 6 nodes ran within 3% of one another at B = 4)
    every ``EXPLORE_EVERY``-th step runs D + 1 or D − 1 instead (alternately), so both neighbours'
        walls and tables stay measured beside D's

Only steps of the full batch are measured and judged: not those whose drafters also fed a backlog (a
new prompt, the tokens of a plain stretch), nor a tail of fewer rows (cheaper, and a few rows' luck:
one row with poor drafts turned a whole batch plain for the next prompts).
Whether to speculate at all is the row planner's judge (``plugins/probe.py``), fed the batch's steps:
the rows' mean tokens per step over the step's wall, against the same step priced as plain decoding
(its wall without drafting × T(0)/T(D) of the batch's cost curves: one clock for both). When it loses,
every row decodes plainly, and a probe every ``gap`` steps drafts the last chain again; speculation
resumes if the chain, drafting included, promises more than a plain step by the curves and the rows'
tables: (1 + Ē[D, D]) · T(0) > T_draft(D) + T(D). The plan changes tree shapes, never tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from treespec.plugins.drafted import Drafted
from treespec.plugins.probe import Judge
from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.interfaces import Drafter
    from treespec.plugins.cost_aware import AutoPlanner

MEASURED_STEPS = 1.5  # decayed steps of a depth before its wall counts
EXPLORE_EVERY = 6  # steps between exploring steps (a neighbouring depth, alternately deeper and shallower)
EMA = 0.25  # weight of a step's mean table in the moving average
WALL_DECAY = 0.97  # per step: a depth's measured wall follows the last ~30 steps
SWITCH = 0.03  # another depth must promise this much more than the current one


@dataclass(frozen=True)
class Shape:
    nodes: int  # N: nodes each row verifies (0: the root alone, plain decoding)
    rounds: int  # D: draft rounds (tree levels drafted)
    width: int  # W: candidates kept per layer (and expanded next); 1 in a batch's chains


PLAIN = Shape(0, 0, 0)
FIRST = Shape(4, 4, 1)  # before any tree was drafted


def chain(depth: int) -> Shape:
    return Shape(depth, depth, 1)


def expectation_table(phat: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """E[d, n] ([D + 1, M + 1]): Σ of the n largest p̂ among the drafted nodes of depth ≤ d (the best
    n-node tree within depth d: p̂ never grows along a path, so the n largest form a tree); E[0, ·] = 0,
    and beyond the nodes there are, E stays flat. ``phat``/``depths``: the drafted nodes (root excluded)."""
    top, m = int(depths.max()) if depths.size else 0, int(phat.size)
    order = np.argsort(-phat, kind="stable")  # [K] best first
    within = depths[order][None, :] <= np.arange(1, top + 1)[:, None]  # [D, K] node j counts within depth d
    sums = np.cumsum(np.where(within, phat[order], 0.0), axis=1)  # [D, K] Σ p̂ of the first j that count
    table = np.zeros((top + 1, m + 1))
    rows, cols = np.nonzero(within)
    table[rows + 1, np.cumsum(within, axis=1)[rows, cols]] = sums[rows, cols]  # [d, n]: the n best within d
    return np.maximum.accumulate(table, axis=1)  # beyond the nodes there are, E stays flat


def _grow_to(table: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """``table`` padded to ``shape`` with its last row and column (no data: no further gain)."""
    pad = ((0, shape[0] - table.shape[0]), (0, shape[1] - table.shape[1]))
    return np.pad(table, pad, mode="edge") if any(p[1] for p in pad) else table


class _Average:
    """A per-cell moving average of E tables, over the cells the trees reached."""

    def __init__(self) -> None:
        self.mean: np.ndarray | None = None  # [D + 1, M + 1]
        self.seen: np.ndarray | None = None

    def fold(self, tables: list[np.ndarray]) -> None:
        size = (max(t.shape[0] for t in tables), max(t.shape[1] for t in tables))
        if self.mean is not None:
            size = (max(size[0], self.mean.shape[0]), max(size[1], self.mean.shape[1]))
        step = np.mean([_grow_to(t, size) for t in tables], axis=0)  # [D + 1, M + 1]
        reached = np.zeros(size, dtype=bool)
        reached[: min(t.shape[0] for t in tables), : min(t.shape[1] for t in tables)] = True
        if self.mean is None:
            self.mean, self.seen = step, reached
            return
        mean = _grow_to(self.mean, size)
        seen = np.pad(self.seen, ((0, size[0] - self.seen.shape[0]), (0, size[1] - self.seen.shape[1])))
        mean = np.where(reached & seen, mean + EMA * (step - mean), np.where(reached, step, mean))
        # E never falls with more nodes or more depth; cells averaged over different steps can disagree
        self.mean = np.maximum.accumulate(np.maximum.accumulate(mean, axis=0), axis=1)
        self.seen = seen | reached


class BatchPlan:
    """The chain a batch's auto rows share (see the module docstring). ``shape(planner)`` is asked by
    every row at the start of its build; ``report(table)`` after it drafted; ``observe(wall)`` after
    the step."""

    def __init__(self) -> None:
        self.table = _Average()  # moving average of the rows' E tables
        self.current: Shape = FIRST  # what rows draft and verify this step
        self.home = FIRST.rounds  # the chosen depth (exploring steps run a neighbour of it)
        self.last_spec: Shape = FIRST  # the last speculative shape (probes draft it)
        self.walls: dict[int, list[float]] = {}  # depth -> decayed Σ wall, Σ steps
        self.observed = False  # a row's step was observed since the current step began
        self.catch_up = False  # a row of this step also fed its drafter a backlog (its wall is not the shape's)
        self.step_tables: list[np.ndarray] = []  # this step's reports
        self.steps = 0
        self.judge = Judge.for_batch()  # speculation on or off, and when to probe (plugins/probe.py)
        self.probing = False  # the current step is a probe
        self.step_wall = self.step_plain = 0.0  # the last step's wall, and its price as a plain step
        self.step_tokens: list[float] = []  # the last step's tokens, per row
        self.rows = 0  # the most rows a step had: the batch's size (steps with fewer are a tail)
        self.turn = 0  # which neighbour the next exploring step runs
        self.predicted = 0.0  # the current shape's measured step seconds (what the plan expects)

    # ------------------------------------------------------------------ rows' calls
    def shape(self, planner: AutoPlanner) -> Shape:
        """The step's chain (or PLAIN). Every row asks before it drafts and is observed after the step's
        verification, so the first ask after an observation starts a new step."""
        if self.observed:  # a new step: fold in the last one's reports, choose again
            self.observed = False
            self._new_step(planner)
        return self.current

    def report(self, table: np.ndarray, catching_up: bool = False) -> None:
        """A row's E table of the tree it just drafted; ``catching_up``: its drafter also fed what it
        skipped (a new prompt, or the tokens of a plain stretch), so this step's wall is not the shape's."""
        self.step_tables.append(table)
        self.catch_up = self.catch_up or catching_up

    def observe(self, wall: float, tokens: float, plain: float) -> None:
        """A row's measured step: the ``tokens`` it gained; the step's first row records its ``wall`` and
        its price as a plain step (``probe.as_plain``; every row waited for the same step)."""
        if not self.observed:
            self.step_wall, self.step_plain, self.step_tokens = wall, plain, []
        self.step_tokens.append(tokens)
        self.observed = True

    # ------------------------------------------------------------------ the choice
    def _new_step(self, planner: AutoPlanner) -> None:
        self.steps += 1
        if self.step_tables:
            self.table.fold(self.step_tables)
        self.step_tables = []
        probe, self.probing = self.probing, False
        self.rows = max(self.rows, len(self.step_tokens))
        if probe:  # the probe's verdict, from the tables it just reported
            self.judge.probed(self._wanted(planner))
        elif self.current != PLAIN and not self.catch_up and len(self.step_tokens) == self.rows:
            self._measured()  # a full batch's step (a tail of fewer rows is cheaper, and a few rows' luck)
        self.catch_up = False
        if not self.judge.off:
            self._choose(planner)
        elif self.current == PLAIN and self.judge.due():  # plain until now; a probe: draft the last chain again
            self.current, self.probing = self.last_spec, True
        else:
            self.current = PLAIN
            self.predicted = float(planner.t_step[0]) if planner.known else 0.0

    def _measured(self) -> None:
        """The last step's wall joins its depth's record, and the step is judged against plain decoding."""
        for w in self.walls.values():  # every depth's record ages alike: they cover the same stretch
            w[0], w[1] = WALL_DECAY * w[0], WALL_DECAY * w[1]
        w = self.walls.setdefault(self.current.rounds, [0.0, 0.0])
        w[0], w[1] = w[0] + self.step_wall, w[1] + 1.0
        self.judge.speculated(float(np.mean(self.step_tokens)), self.step_wall, self.step_plain)

    def _wanted(self, planner: AutoPlanner) -> bool:
        """Does the probed chain, drafting included, beat a plain step by the batch's cost curves and
        the rows' tables? (1 + Ē[D, D]) · T(0) > T_first + (D − 1) · T_expand(1) + T(D). Without
        curves: yes (the judge then weighs its steps on their own clock)."""
        mean = self.table.mean
        if mean is None or not planner.known:
            return True
        d = min(self.last_spec.rounds, mean.shape[0] - 1, mean.shape[1] - 1, planner.t_step.size - 1)
        drafting = planner.t_first + (d - 1) * float(planner.t_expand[min(1, planner.t_expand.size - 1)])
        return (1.0 + float(mean[d, d])) * float(planner.t_step[0]) > drafting + float(planner.t_step[d])

    def wall(self, depth: int) -> float | None:
        """The measured step wall at ``depth`` (None: not measured in the recent stretch)."""
        w = self.walls.get(depth)
        return w[0] / w[1] if w is not None and w[1] >= MEASURED_STEPS else None

    def _choose(self, planner: AutoPlanner) -> None:
        """D ← the best of D − 1, D, D + 1 by (1 + Ē[D, D]) / W(D) (``SWITCH`` to move)."""
        mean, home = self.table.mean, self.home  # [D + 1, M + 1] or None
        best, best_rate, home_rate = home, 0.0, 0.0
        for d in (home - 1, home, home + 1):
            wall = self.wall(d)
            if mean is None or d < 1 or d >= min(mean.shape) or wall is None:
                continue
            rate = (1.0 + mean[d, d]) / wall  # tokens per second per row
            home_rate = rate if d == home else home_rate
            if rate > best_rate:
                best, best_rate = d, rate
        if best != home and best_rate < (1 + SWITCH) * home_rate:  # noise does not move the depth
            best, best_rate = home, home_rate
        self.home = best
        depth = best
        if self.steps % EXPLORE_EVERY == 0:  # a neighbour, alternately deeper and shallower
            self.turn += 1
            depth = best + 1 if self.turn % 2 or best == 1 else best - 1
        self.current = self.last_spec = chain(min(depth, planner.max_depth))
        self.predicted = self.wall(self.current.rounds) or 0.0


def grow_row(
    planner: AutoPlanner, drafter: Drafter, root: int, shape: Shape, max_depth: int, began: float
) -> DraftTree:
    """A batch row's step in the shape the batch chose: ``shape.rounds`` layers, each the ``shape.width``
    best candidates by p̂, all of them expanded next; then the top ``shape.nodes`` by p̂ verified (every
    row fills the shape: the batch pays for the largest tree anyway). A plain shape (N = 0): the root
    alone, for every row. ``planner`` is the row's ``AutoPlanner`` (its calibration and decisions)."""
    planner.probing = False
    # after plain steps the drafter's first round also feeds what it skipped (a one-off catch-up): the
    # step's wall is not what the shape costs
    catching_up = planner.fresh or (bool(planner.decisions) and planner.decisions[-1]["off"])
    planner.fresh = False
    if shape.nodes <= 0 or max_depth <= 0:
        planner.decide(
            n=0,
            depth=0,
            off=True,
            predicted=float(planner.t_step[0]) if planner.known else 0.0,
            expected=0.0,
            own=time.perf_counter() - began,
        )
        return DraftTree(root, capacity=1)
    width, rounds = shape.width, min(max_depth, planner.max_depth, shape.rounds)
    tree, drafted = DraftTree(root), Drafted(width * rounds)
    drafting = 0.0  # seconds in the drafter (the rest is this row's planning)
    frontier = np.zeros(1, dtype=np.int64)  # [M] tree ids of the nodes to expand
    for depth in range(1, rounds + 1):
        start = time.perf_counter()
        # a layer keeps the `width` best candidates, all among their parents' `width` best children
        prop = drafter.expand(tree, torch.from_numpy(frontier), width)  # tokens, q: [M, width]
        drafting += time.perf_counter() - start
        cand = drafted.candidates(frontier, prop.q.numpy(), depth, planner.calibration)  # [M*width]
        order = np.argsort(-cand, kind="stable")[:width]  # the layer: the `width` best
        order = order[cand[order] > 0]  # q = 0 padding never enters
        if order.size == 0:
            break
        frontier = drafted.add(tree, frontier, prop, order, depth, cand[order])
    phat, depths = drafted.nodes
    planner.plan.report(expectation_table(phat, depths), catching_up)
    n = min(shape.nodes, drafted.size)
    expected = float(np.sort(phat)[::-1][:n].sum())
    chosen = drafted.top(tree, n)
    planner.decide(
        n=n,
        depth=chosen.depth,
        off=n == 0,
        predicted=planner.plan.predicted,
        expected=expected,
        own=time.perf_counter() - began - drafting,
    )
    return chosen
