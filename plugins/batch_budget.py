"""One shape for a batch's step: the rows of an auto batch draft D rounds of W nodes and verify N each.

In a batch, ONE target forward verifies [B, N_max] nodes and ONE draft forward serves each round of
expansions, so a step costs what its largest tree and its deepest, widest drafting cost, C(N, D, W).
Rows planning alone get this wrong three ways: a row whose tree is smaller than the largest pays for
padding it does not use; a row that stops drafting early waits for the others' rounds anyway; and a
row that turns speculation off decodes plainly inside a step that still drafts and verifies trees
for its neighbours — it saves the batch nothing and gives up its own accepted tokens. So the batch
chooses the shape, and every row fills it:

    each row drafts D layers, each layer the W best candidates by p̂ among the children of the
        last layer's nodes (W = 1: a chain of the draft's best guesses), and reports its table
        E_r[d, n] = the calibrated expected accepted length of its best n-node tree within depth d
    the plan keeps, per width W, a moving average Ē_W of the rows' tables and picks
        (N, D, W) = argmax (1 + Ē_W[D, N]) / C(N, D, W)      against plain decoding's 1 / C_plain
    every row verifies its top-N nodes by p̂: no row pads, no row drafts a round the step does not pay for

C is the batch's cost curves (``cost_measure.measure(batch=B)``, refined online) plus a level the
batch's own measured step walls set (``StepCost``), leaving out steps whose drafters also fed a
backlog (a new prompt, the tokens of a plain stretch). A shape verified as drafted for ``MEASURED_MIN`` row-steps
is judged by its measured rate (tokens over wall, decayed) instead. Widths are tried from ``WIDTHS``;
every ``EXPLORE_EVERY``-th step drafts one round deeper than the shape, alternately at its width and
at another, so the tables can show when another shape pays (a shape changes only where drafted trees
say it does). When plain decoding wins, every row decodes plainly, and a probe every ``gap`` steps
(doubling, ``plugins/probe.py``) drafts the last shape again. The plan changes tree shapes, never tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from treespec.plugins.drafted import Drafted
from treespec.plugins.probe import ProbeSchedule
from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.interfaces import Drafter
    from treespec.plugins.cost_aware import AutoPlanner

WIDTHS = (1, 2)  # layer widths the plan tries (wider layers cost a batch more rounds' time than they found)
EXPLORE_EVERY = 8  # steps between exploring steps (an exploring step drafts more than it verifies)
EMA = 0.25  # weight of a step's mean table in the moving average
MEASURED_MIN = 16  # row-steps after which a shape is judged by its measured rate, not the model's
RATE_DECAY = 0.98  # per row-step: a measured rate follows the last ~50 row-steps of its shape


@dataclass(frozen=True)
class Shape:
    nodes: int  # N: nodes each row verifies (0: the root alone, plain decoding)
    rounds: int  # D: draft rounds (tree levels drafted)
    width: int  # W: candidates kept per layer (and expanded next)


PLAIN = Shape(0, 0, 0)
FIRST = Shape(4, 4, 1)  # before any tree was drafted


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


class StepCost:
    """The batch step's seconds: how a step's cost changes with its shape comes from the cost curves,
    its level from the batch's own measured walls:

        C(N, D, W) = T(N) + T_first + (D − 1) · T_expand(W) + b     a speculative step
        b          = the median of wall − curves over the last ``WINDOW`` speculative steps
        C_plain    = the plain steps' median wall                 (the root alone; no drafting)

    The curves (``cost_measure.measure(batch=B)``, refined online from the phases every row measures)
    price a node and a round; the level b carries what they miss: every row's bookkeeping, the
    drafters' catch-up, padding, the machine's own load. A regression of the walls on the shape
    instead reads whatever else changes between the steps a shape was chosen in (rows in flight,
    long accepted stretches) as the shape's cost: measured on the default pair at B = 4, it priced a
    round at 0.5 ms where the curves and forced-shape runs agree on ~2.3 ms, and chose trees too deep."""

    WINDOW = 256

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, float]] = []  # (N, D, W, wall) measured
        self.plain_walls: list[float] = []
        self.t = np.zeros(1)  # T(n) [cap + 2]
        self.x = np.zeros(1)  # T_expand(m) [cap + 2]
        self.first = 0.0
        self.level: float | None = None

    def use_curves(self, t: np.ndarray, x: np.ndarray, first: float) -> None:
        """The cost curves as they stand (given whenever the plan chooses)."""
        self.t, self.x, self.first, self.level = t, x, first, None

    def add(self, shape: Shape, wall: float) -> None:
        if shape.nodes == 0:
            self.plain_walls = (self.plain_walls + [wall])[-self.WINDOW :]
        else:
            self.rows = (self.rows + [(shape.nodes, shape.rounds, shape.width, wall)])[-self.WINDOW :]
        self.level = None

    @property
    def plain(self) -> float:
        return float(np.median(self.plain_walls)) if len(self.plain_walls) >= 4 else float(self.t[0])

    def curves(self, n: np.ndarray, d: np.ndarray, w: int | np.ndarray) -> np.ndarray:
        """T(N) + T_first + (D − 1) · T_expand(W), sizes clipped to the curves' range."""
        n, w = np.minimum(n, self.t.size - 1), np.minimum(w, self.x.size - 1)
        return self.t[n] + self.first + (np.asarray(d) - 1) * self.x[w]

    def predict(self, n: np.ndarray, d: np.ndarray, w: int) -> np.ndarray:
        if self.level is None:
            rows = np.array(self.rows, dtype=np.float64).reshape(-1, 4)  # [K, 4]
            ints = rows[:, :3].astype(np.int64)
            resid = rows[:, 3] - self.curves(ints[:, 0], ints[:, 1], ints[:, 2])  # [K]
            self.level = float(np.median(resid)) if resid.size else 0.0
        return np.maximum(self.curves(n, d, w) + self.level, 1e-6)


class BatchPlan:
    """The shape a batch's auto rows share (see the module docstring). ``shape(planner)`` is asked by
    every row at the start of its build; ``report(table)`` after it drafted."""

    def __init__(self) -> None:
        self.tables: dict[int, _Average] = {}  # width -> moving average of the rows' E tables
        self.current: Shape = FIRST
        self.draft: Shape = FIRST  # what rows draft this step (the shape, or an exploring variant)
        self.last_spec: Shape = FIRST  # the last speculative shape (probes draft it)
        self.observed = False  # a row's step was observed since the current step began
        self.catch_up = False  # a row of this step also fed its drafter a backlog (its wall is not the shape's)
        self.cost = StepCost()
        self.step_tables: list[np.ndarray] = []  # this step's reports
        self.steps = 0
        self.probes = ProbeSchedule.for_batch()  # while the batch decodes plainly: when to probe (plugins/probe.py)
        self.turn = 0  # which width the next exploring step tries
        self.predicted = 0.0  # the current shape's predicted step seconds
        # per shape verified as drafted: decayed Σ tokens, Σ seconds, row-steps (a measured rate)
        self.rates: dict[Shape, list[float]] = {}

    # ------------------------------------------------------------------ rows' calls
    def shape(self, planner: AutoPlanner) -> tuple[Shape, Shape]:
        """(the step's shape, what to draft this step: the shape, or one round deeper / another width).
        Every row asks before it drafts and is observed after the step's verification, so the first
        ask after an observation starts a new step (rows drafting side by side or one after another)."""
        if self.observed:  # a new step: fold in the last one's reports, choose again
            self.observed = False
            self._new_step(planner)
        return self.current, self.draft

    def report(self, table: np.ndarray, catching_up: bool = False) -> None:
        """A row's E table of the tree it just drafted (at this step's drafting width); ``catching_up``:
        its drafter also fed what it skipped (a new prompt, or the tokens of a plain stretch), so this
        step's wall is not what the shape costs."""
        self.step_tables.append(table)
        self.catch_up = self.catch_up or catching_up

    def observe(self, wall: float, emitted: int) -> None:
        """A row's measured step: its wall time fits the step cost (once per step), and a shape verified
        as drafted keeps its own measured rate."""
        if not self.observed and not self.catch_up:  # the step's first row: every row waited for the same step
            self.cost.add(self.draft, wall)  # (a plain step drafts PLAIN too)
        self.observed = True
        if self.draft == self.current and self.current != PLAIN and not self.catch_up:  # the shape's own rate
            rate = self.rates.setdefault(self.current, [0.0, 0.0, 0])
            rate[0] = RATE_DECAY * rate[0] + emitted
            rate[1] = RATE_DECAY * rate[1] + wall
            rate[2] += 1

    # ------------------------------------------------------------------ the choice
    def _new_step(self, planner: AutoPlanner) -> None:
        self.steps += 1
        self.catch_up = False
        if self.step_tables:
            self.tables.setdefault(self.draft.width, _Average()).fold(self.step_tables)
        self.step_tables = []
        if self.current != PLAIN:
            self._choose(planner)
        elif self.probes.due():  # plain until now; a probe: draft the last shape again, and see
            self.current = self.draft = self.last_spec

    def _choose(self, planner: AutoPlanner) -> None:
        """argmax over (N, D, W) of (1 + Ē_W[D, N]) / C(N, D, W), against the root alone; then explore."""
        t, x, first = (
            planner.t_step,
            planner.t_expand,
            planner.t_first,
        )  # T(n) [cap + 2], T_expand(m) [cap + 2], T_first
        if not planner.known:
            return
        self.cost.use_curves(t, x, first)
        best, best_rate, best_seconds = None, 0.0, 0.0
        # trust region: shapes near those measured (the fit is linear; the tables flat beyond the trees)
        n_cap = max(4, int(1.5 * max((r[0] for r in self.cost.rows), default=FIRST.nodes)))
        for width, avg in self.tables.items():
            mean = avg.mean
            n_top = min(mean.shape[1] - 1, t.size - 1, n_cap)
            if mean.shape[0] < 2 or n_top < 1 or width >= x.size:
                continue
            n = np.arange(1, n_top + 1)  # [N]
            d = np.arange(1, mean.shape[0])  # [D]
            seconds = self.cost.predict(n[None, :], d[:, None], width)  # [D, N] C(n, d, W)
            rate = (1.0 + mean[1:, 1 : n_top + 1]) / seconds  # [D, N] tokens per second per row
            for shape, (tokens, secs, count) in self.rates.items():  # measured shapes: their own rate
                if (
                    shape.width == width
                    and count >= MEASURED_MIN
                    and shape.nodes <= n_top
                    and shape.rounds < mean.shape[0]
                ):
                    rate[shape.rounds - 1, shape.nodes - 1] = tokens / secs
            di, ni = np.unravel_index(int(np.argmax(rate)), rate.shape)
            if rate[di, ni] > best_rate:
                best, best_rate = Shape(int(n[ni]), int(d[di]), width), float(rate[di, ni])
                best_seconds = float(seconds[di, ni])
        plain = 1.0 / self.cost.plain if self.cost.plain > 0 else 0.0
        if best is None or best_rate <= plain:  # the root alone wins: every row decodes plainly until a probe
            self.current = self.draft = PLAIN
            self.probes.lost()
            self.predicted = self.cost.plain
            return
        self.probes.won()  # speculation keeps winning: after a stretch, probes start from a short gap again
        self.current = self.last_spec = best
        self.predicted = best_seconds
        self.draft = best
        if self.steps % EXPLORE_EVERY == 0:  # one round deeper, alternately at this width and another
            self.turn += 1
            others = [w for w in WIDTHS if w != best.width and w < x.size]
            width = best.width if self.turn % 2 or not others else others[(self.turn // 2) % len(others)]
            self.draft = Shape(best.nodes, best.rounds + 1, width)


def grow_row(
    planner: AutoPlanner, drafter: Drafter, root: int, shape: Shape, draft: Shape, max_depth: int, began: float
) -> DraftTree:
    """A batch row's step in the shape the batch chose: ``draft.rounds`` layers, each the ``draft.width``
    best candidates by p̂, all of them expanded next; then the top ``shape.nodes`` by p̂ verified (every
    row fills the shape: the batch pays for the largest tree anyway). ``draft`` is the shape itself, or
    on exploring steps one round deeper or another width. A plain shape (N = 0): the root alone, for
    every row. ``planner`` is the row's ``AutoPlanner`` (its calibration, cost curves and decisions)."""
    planner.probing = False
    # after plain steps the drafter's first round also feeds what it skipped (a one-off catch-up):
    # not what a round costs
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
    width, rounds = draft.width, min(max_depth, planner.max_depth, draft.rounds)
    cost, tree, drafted = planner.cost, DraftTree(root), Drafted(width * rounds)
    drafting = 0.0
    frontier = np.zeros(1, dtype=np.int64)  # [M] tree ids of the nodes to expand
    start = time.perf_counter()
    for depth in range(1, rounds + 1):
        m = int(frontier.size)
        # a layer keeps the `width` best candidates, all among their parents' `width` best children
        prop = drafter.expand(tree, torch.from_numpy(frontier), width)  # tokens, q: [M, width]
        drafting += time.perf_counter() - start
        cand = drafted.candidates(frontier, prop.q.numpy(), depth, planner.calibration)  # [M*width]
        order = np.argsort(-cand, kind="stable")[:width]  # the layer: the `width` best
        order = order[cand[order] > 0]  # q = 0 padding never enters
        if order.size:
            frontier = drafted.add(tree, frontier, prop, order, depth, cand[order])
        took = time.perf_counter() - start  # the round: the batch's draft forward and this row's share of planning
        if planner.refine and not (depth == 1 and catching_up):
            (cost.first.observe(1, took) if depth == 1 else cost.expand.observe(m, took))
        start += took
        if order.size == 0:
            break
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
