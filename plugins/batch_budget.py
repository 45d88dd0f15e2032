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
Only the depth is chosen, from what the rows expect and what the steps measured:

    each row reports its chain's p̂ at every depth (calibrated: what it expects accepted there); the
        plan keeps a moving average p̄_d per depth, and Ē_D = p̄_1 + … + p̄_D
    W(D) = W_home · (1 + s · (D − home)): W_home is the moving average of the home depth's step walls,
        s what a round adds in units of W_home, measured on one clock: (W_explore / W_home − 1) / (D −
        home) for the second step of an exploring run against the home step just before the run and
        the second one after it, the median of the last ``SLOPE_SAMPLES`` (the cost curves' until then)
    D ← argmax over the depths drafted so far of (1 + Ē_D) / W(D), moving only for ``SWITCH`` more (a
        step's wall is noisy); not just a neighbour: near the best, depths differ by 1–2% each, less
        than ``SWITCH``, and a plan moving one depth at a time stayed wherever it first arrived
    every ``EXPLORE_EVERY`` steps, two run D + 1 or D − 1 instead (alternately), so s and both
        neighbours' p̄ stay measured

Walls of each depth kept apart (an earlier version) compared a depth measured minutes ago, when the
machine ran at another speed, with one measured now: a trace at B = 4 kept a wall twice today's for
hundreds of steps and chose depths 1 to 8 in turn. There, two consecutive steps' walls differed by a
median 5.5%, steps 30 apart by 23%, and one step in a few by far more: hence neighbours, and a median.
A step also pays for the one before it (its drafter first reads the tokens the last step accepted), so
a lone exploring step and the home step after it each carry part of the other depth's load, which
shrinks the difference measured: a run's second step and the second home step after it carry their own.
Only steps of the full batch are measured and judged: not those whose drafters also fed a backlog (a
new prompt, the tokens of a plain stretch), nor a tail of fewer rows (cheaper, and a few rows' luck:
one row with poor drafts turned a whole batch plain for the next prompts).
Whether to speculate at all is the row planner's judge (``plugins/probe.py``), fed the batch's steps:
the rows' mean tokens per step over the step's wall, against the same step priced as plain decoding
(its wall without drafting × T(0)/T(D) of the batch's cost curves: one clock for both). When it loses,
every row decodes plainly, and a probe every ``gap`` steps drafts the last chain again; speculation
resumes if the chain, drafting included, promises more than a plain step by the curves and the rows'
p̄: (1 + Ē_D) · T(0) > T_draft(D) + T(D). The plan changes tree shapes, never tokens.
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

EXPLORE_EVERY = 8  # steps between exploring runs (two steps at a neighbouring depth, deeper or shallower in turn)
EMA = 0.25  # weight of a step's mean p̂ in a depth's moving average p̄
WALL_EMA = 0.2  # weight of a home step's wall in W_home (it follows the last ~5 home steps)
SLOPE_SAMPLES = 8  # s is the median of this many measurements (two an exploring step)
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


class BatchPlan:
    """The chain a batch's auto rows share (see the module docstring). ``shape(planner)`` is asked by
    every row at the start of its build; ``report(phat)`` after it drafted; ``observe(wall)`` after
    the step."""

    def __init__(self) -> None:
        self.gains = np.zeros(0)  # [D] p̄_d: the rows' calibrated p̂ at depth d + 1, a moving average
        self.current: Shape = FIRST  # what rows draft and verify this step
        self.home = FIRST.rounds  # the chosen depth (exploring steps run a neighbour of it)
        self.last_spec: Shape = FIRST  # the last speculative shape (probes draft it)
        self.base: float | None = None  # W_home: moving average of the home depth's step walls
        self.slopes: list[float] = []  # the last measurements of s (the first: the cost curves')
        self.recent: list[tuple[int, float] | None] = []  # the last steps' (depth, wall); None: not measured
        self.observed = False  # a row's step was observed since the current step began
        self.catch_up = False  # a row of this step also fed its drafter a backlog (its wall is not the shape's)
        self.step_gains: list[np.ndarray] = []  # this step's reports
        self.steps = 0
        self.judge = Judge.for_batch()  # speculation on or off, and when to probe (plugins/probe.py)
        self.probing = False  # the current step is a probe
        self.step_wall = self.step_plain = 0.0  # the last step's wall, and its price as a plain step
        self.step_tokens: list[float] = []  # the last step's tokens, per row
        self.rows = 0  # the most rows a step had: the batch's size (steps with fewer are a tail)
        self.turn = 0  # which neighbour the next exploring step runs
        self.predicted = 0.0  # the current shape's step seconds by W(D) (what the plan expects)

    # ------------------------------------------------------------------ rows' calls
    def shape(self, planner: AutoPlanner) -> Shape:
        """The step's chain (or PLAIN). Every row asks before it drafts and is observed after the step's
        verification, so the first ask after an observation starts a new step."""
        if self.observed:  # a new step: fold in the last one's reports, choose again
            self.observed = False
            self._new_step(planner)
        return self.current

    def report(self, phat: np.ndarray, catching_up: bool = False) -> None:
        """A row's chain, drafted: the calibrated p̂ of its node at each depth ([D]); ``catching_up``: its
        drafter also fed what it skipped (a new prompt, or the tokens of a plain stretch), so this step's
        wall is not the shape's."""
        self.step_gains.append(phat)
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
        probe, self.probing = self.probing, False
        self.rows = max(self.rows, len(self.step_tokens))
        full = len(self.step_tokens) == self.rows  # not a tail of fewer rows (cheaper, and a few rows' luck)
        if self.step_gains and (full or probe):
            self._fold(self.step_gains)
        self.step_gains = []
        if probe:  # the probe's verdict, from the chains it just reported
            self.judge.probed(self._wanted(planner))
        elif self.current != PLAIN and not self.catch_up and full:
            self._measured()
        else:
            self.recent = [*self.recent[-3:], None]  # no wall to pair
        self.catch_up = False
        if not self.judge.off:
            self._choose(planner)
        elif self.current == PLAIN and self.judge.due():  # plain until now; a probe: draft the last chain again
            self.current, self.probing = self.last_spec, True
        else:
            self.current = PLAIN
            self.predicted = float(planner.t_step[0]) if planner.known else 0.0

    def _fold(self, chains: list[np.ndarray]) -> None:
        """p̄_d moves towards this step's mean p̂ at depth d over the rows whose chains reached it (a row
        near its end drafts fewer rounds: it says nothing of the deeper ones)."""
        depth = max(c.size for c in chains)
        grid = np.full((len(chains), depth), np.nan)  # [R, D]
        for r, c in enumerate(chains):
            grid[r, : c.size] = c
        step = np.nanmean(grid, axis=0)  # [D] every column has a row: depth is the longest chain
        old, k = self.gains, min(depth, self.gains.size)
        step[:k] = old[:k] + EMA * (step[:k] - old[:k])
        self.gains = np.concatenate([step, old[depth:]])

    def expected(self, depth: int) -> float | None:
        """Ē_D: the tokens a row expects accepted from a chain of ``depth`` (None: deeper than drafted)."""
        return float(self.gains[:depth].sum()) if 0 < depth <= self.gains.size else None

    @property
    def slope(self) -> float | None:
        """s: what a round adds to a step's wall, in units of the home depth's (None: not measured yet)."""
        return max(float(np.median(self.slopes)), 0.0) if self.slopes else None

    def wall(self, depth: int) -> float | None:
        """W(D) = W_home · (1 + s · (D − home)): a step's seconds at ``depth`` (None: not measured yet)."""
        s = self.slope
        if self.base is None or s is None:
            return None
        return self.base * (1.0 + s * (depth - self.home))

    def _measured(self) -> None:
        """The last step (full batch, speculative) updates W_home (a home step) and s (an exploring step
        against the home steps beside it), and is judged against plain decoding."""
        wall, depth = self.step_wall, self.current.rounds
        if wall > 0:
            if depth == self.home:
                self.base = wall if self.base is None else self.base + WALL_EMA * (wall - self.base)
            self.recent = [*self.recent[-3:], (depth, wall)]
            pair = self._pair()
            if pair is not None:
                (de, we), (dh, wh) = pair
                self.slopes = [*self.slopes, (we / wh - 1.0) / (de - dh)][-SLOPE_SAMPLES:]
        self.judge.speculated(float(np.mean(self.step_tokens)), wall, self.step_plain)

    def _pair(self) -> tuple[tuple[int, float], tuple[int, float]] | None:
        """(exploring, home) steps to compare, if the last steps end H E E or E E H H (E: an exploring
        run's steps, at one depth; H: home steps): the run's second step, and the home step two away."""
        last, home = self.recent[-4:], self.home
        if len(last) < 3 or any(x is None for x in last[-3:]):
            return None
        a, b, c = last[-3:]
        if a[0] == home and b[0] == c[0] != home:
            return c, a
        if len(last) == 4 and last[0] is not None and last[0][0] == a[0] != home and b[0] == c[0] == home:
            return a, c
        return None

    def _wanted(self, planner: AutoPlanner) -> bool:
        """Does the probed chain, drafting included, beat a plain step by the batch's cost curves and
        the rows' p̂? (1 + Ē_D) · T(0) > T_first + (D − 1) · T_expand(1) + T(D). Without curves: yes
        (the judge then weighs its steps on their own clock)."""
        d = min(self.last_spec.rounds, self.gains.size, planner.t_step.size - 1 if planner.known else 0)
        if d < 1:
            return True
        drafting = planner.t_first + (d - 1) * float(planner.t_expand[min(1, planner.t_expand.size - 1)])
        return (1.0 + self.gains[:d].sum()) * float(planner.t_step[0]) > drafting + float(planner.t_step[d])

    def _choose(self, planner: AutoPlanner) -> None:
        """D ← the best depth drafted so far by (1 + Ē_D) / W(D) (``SWITCH`` to move)."""
        home = self.home
        if not self.slopes and planner.known and home + 1 < planner.t_step.size:  # until measured
            expand = float(planner.t_expand[min(1, planner.t_expand.size - 1)])
            here = planner.t_first + (home - 1) * expand + float(planner.t_step[home])
            self.slopes = [(expand + float(planner.t_step[home + 1] - planner.t_step[home])) / here]
        best, best_rate, home_rate = home, 0.0, 0.0
        for d in range(1, self.gains.size + 1):
            gain, wall = self.expected(d), self.wall(d)
            if gain is None or wall is None or wall <= 0:
                continue
            rate = (1.0 + gain) / wall  # tokens per second per row
            home_rate = rate if d == home else home_rate
            if rate > best_rate:
                best, best_rate = d, rate
        if best != home and best_rate < (1 + SWITCH) * home_rate:  # noise does not move the depth
            best = home
        if best != home:
            self.base, moved = self.wall(best), best - home  # W_home and s re-based on the new home
            self.slopes = [r / (1.0 + r * moved) for r in self.slopes if 1.0 + r * moved > 0.1]
            self.recent = []  # the steps before were another home's
        self.home = depth = best
        phase = self.steps % EXPLORE_EVERY
        if phase < 2:  # an exploring run: a neighbour, alternately deeper and shallower
            self.turn += phase == 0
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
    phat, _ = drafted.nodes  # [D] a chain's nodes, one a depth, in tree order
    planner.plan.report(phat.copy(), catching_up)
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
