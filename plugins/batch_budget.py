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
Only the depth is chosen, from what the rows expect and what the batch's cost curves say:

    each row reports its chain's p̂ at every depth (calibrated: what it expects accepted there); the
        plan keeps each row's moving average p̄_r,d (since its prompt began) and Ē_r,D = Σ_{d ≤ D} p̄_r,d
    W(D) = P(ANCHOR) + S · (D − ANCHOR): a chain's price by the cost curves measured before the batch's
        first step, P(D) = T_first + (D − 1) · T_expand(1) + T(D), drawn once as a line with the slope
        S = P(ANCHOR + 1) − P(ANCHOR) it has there
    D ← argmax over the depths drafted of (1 + min_r Ē_r,D) / W(D), moving only for ``SWITCH`` more
    every ``EXPLORE_EVERY`` steps, one runs D + 1 instead, so the next depth's p̄ stays measured

Why the slowest row: a batch of prompts that started together finishes when its slowest row does, and
depth helps that row least. On 40 HumanEval prompts (default pair, B = 4, one batch per 4 prompts) the
rows' own Ē promised 1.69× fewer steps from chain k=5 than from k=2 and 2.04× from k=7, and one row at a
time took 1.62× and 1.91× fewer (so Ē is right for a row), but the batches took 1.40× and 1.56× fewer:
each batch's last row set its length. Rows that replace finished ones (``batch_size`` below the number
of prompts) lose less to this; there the slowest row's choice priced no worse than the mean's.
Why the curves, drawn once as a line, and not measured walls: a step's wall on this VM moves by a
median 5.5% from one step to the next, 23% over 30 steps, and far more in one step of a few; plans
choosing from walls (each depth's own, or an exploring step against its neighbours) wandered over
depths 1 to 13. The curves' online refinement follows the walls too, and a line redrawn from them at
every step, or the curves' own flatter price of deep chains, sent plans 1–2 rounds deeper than the
walls of fixed chains pay for. Each variant was judged by the depths it chose, priced by one table of
fixed chains' measured walls that no run's noise moves (``docs/bench/batch-plan-slowest-row/NOTES.md``).
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

from treespec.plugins.probe import Judge
from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.interfaces import Drafter
    from treespec.plugins.cost_aware import AutoPlanner

EXPLORE_EVERY = 8  # steps between exploring steps (one round deeper than the chosen depth)
ANCHOR = 4  # the depth whose slope of the curves' price the line W(D) keeps
EMA = 0.25  # weight of a step's mean p̂ in a depth's moving average p̄
SWITCH = 0.03  # another depth must promise this much more than the current one


@dataclass(frozen=True)
class Shape:
    nodes: int  # N: nodes each row verifies (0: the root alone, plain decoding)
    rounds: int  # D: draft rounds (the chain's depth)


PLAIN = Shape(0, 0)
FIRST = Shape(4, 4)  # before any tree was drafted


def chain(depth: int) -> Shape:
    return Shape(depth, depth)


class BatchPlan:
    """The chain a batch's auto rows share (see the module docstring). ``shape(planner)`` is asked by
    every row at the start of its build; ``report(phat)`` after it drafted; ``observe(wall)`` after
    the step."""

    def __init__(self) -> None:
        self.gains = np.zeros(0)  # [D] p̄_d: the rows' calibrated p̂ at depth d + 1, a moving average
        self.current: Shape = FIRST  # what rows draft and verify this step
        self.home = FIRST.rounds  # the chosen depth (exploring steps run one round deeper)
        self.last_spec: Shape = FIRST  # the last speculative shape (probes draft it)
        self.observed = False  # a row's step was observed since the current step began
        self.catch_up = False  # a row of this step also fed its drafter a backlog (its wall is not the shape's)
        self.step_rows: list[tuple[object, np.ndarray, bool]] = []  # this step's reports: (row, p̂, fresh)
        self.row_gains: dict[object, np.ndarray] = {}  # each row's own p̄ (moving average since its prompt began)
        self.steps = 0
        self.judge = Judge.for_batch()  # speculation on or off, and when to probe (plugins/probe.py)
        self.probing = False  # the current step is a probe
        self.step_wall = self.step_plain = 0.0  # the last step's wall, and its price as a plain step
        self.step_tokens: list[float] = []  # the last step's tokens, per row
        self.rows = 0  # the most rows a step had: the batch's size (steps with fewer are a tail)
        self.predicted = 0.0  # the current shape's step seconds by the curves (what the plan expects)
        self.line: tuple[float, float] | None = None  # (P(ANCHOR), S) of W(D), from the batch's cost curves

    # ------------------------------------------------------------------ rows' calls
    def shape(self, planner: AutoPlanner) -> Shape:
        """The step's chain (or PLAIN). Every row asks before it drafts and is observed after the step's
        verification, so the first ask after an observation starts a new step."""
        if self.observed:  # a new step: fold in the last one's reports, choose again
            self.observed = False
            self._new_step(planner)
        return self.current

    def report(self, phat: np.ndarray, catching_up: bool = False, row: object = None, fresh: bool = False) -> None:
        """A row's chain, drafted: the calibrated p̂ of its node at each depth ([D]); ``catching_up``: its
        drafter also fed what it skipped (a new prompt, or the tokens of a plain stretch), so this step's
        wall is not the shape's; ``row``: which row (its planner), ``fresh``: its first step on a prompt."""
        self.step_rows.append((row, phat, fresh))
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
        if self.step_rows and (full or probe):
            self._fold([phat for _, phat, _ in self.step_rows])
            self.row_gains = {
                key: phat if fresh or key not in self.row_gains else _moved(self.row_gains[key], phat)
                for key, phat, fresh in self.step_rows
            }
        self.step_rows = []
        if probe:  # the probe's verdict, from the chains it just reported
            self.judge.probed(self._wanted(planner))
        elif self.current != PLAIN and not self.catch_up and full:  # judged against plain decoding
            self.judge.speculated(sum(self.step_tokens) / len(self.step_tokens), self.step_wall, self.step_plain)
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
        total, rows = np.zeros(depth), np.zeros(depth)  # [D] Σ p̂ over the rows that reached d, and how many
        for c in chains:
            total[: c.size] += c
            rows[: c.size] += 1
        self.gains = _moved(self.gains, total / rows)  # [D] each depth has a row (the longest)

    def slowest(self) -> np.ndarray:
        """[D] min over the rows of Ē_r,D for D = 1 … the depth every row has drafted since its prompt
        began (deeper, the mean of the rows that drafted it would flatter deeper chains)."""
        if not self.row_gains:
            return np.zeros(0)
        reach = min(g.size for g in self.row_gains.values())
        return np.cumsum([g[:reach] for g in self.row_gains.values()], axis=1).min(axis=0)  # [R, D] -> [D]

    def _wanted(self, planner: AutoPlanner) -> bool:
        """Does the probed chain, drafting included, beat a plain step by the batch's cost curves and
        the rows' p̂? (1 + Ē_D) · T(0) > T_first + (D − 1) · T_expand(1) + T(D). Without curves: yes
        (the judge then weighs its steps on their own clock)."""
        d = min(self.last_spec.rounds, self.gains.size, planner.t_step.size - 1 if planner.known else 0)
        if d < 1:
            return True
        return (1.0 + self.gains[:d].sum()) * float(planner.t_step[0]) > chain_price(planner, d)

    def _choose(self, planner: AutoPlanner) -> None:
        """D ← the best depth drafted by (1 + min_r Ē_r,D) / W(D) (``SWITCH`` to move); every
        ``EXPLORE_EVERY``-th step one round deeper."""
        home = self.home
        if self.line is None:  # drawn once, from the curves measured before the batch's first step
            self.line = line(planner)
        best, best_rate, home_rate = home, 0.0, 0.0
        for d, gain in enumerate(self.slowest(), start=1):
            wall = self.price(d)
            if wall is None or wall <= 0:
                continue
            rate = (1.0 + gain) / wall  # the slowest row's tokens per second
            home_rate = rate if d == home else home_rate
            if rate > best_rate:
                best, best_rate = d, rate
        if best != home and best_rate < (1 + SWITCH) * home_rate:  # noise does not move the depth
            best = home
        self.home = depth = best
        if self.steps % EXPLORE_EVERY == 0:
            depth = best + 1
        self.current = self.last_spec = chain(min(depth, planner.max_depth))
        self.predicted = self.price(self.current.rounds) or 0.0

    def price(self, depth: int) -> float | None:
        """W(D) = P(ANCHOR) + S · (D − ANCHOR) (None: no curves)."""
        return None if self.line is None else self.line[0] + self.line[1] * (depth - ANCHOR)


def chain_price(planner: AutoPlanner, depth: int) -> float:
    """P(D) = T_first + (D − 1) · T_expand(1) + T(D): a chain of ``depth`` drafted and verified, by the
    batch's cost curves (``planner.known``)."""
    expand = float(planner.t_expand[min(1, planner.t_expand.size - 1)])
    return planner.t_first + (depth - 1) * expand + float(planner.t_step[depth])


def line(planner: AutoPlanner) -> tuple[float, float] | None:
    """(P(ANCHOR), S): the price of a chain of ``ANCHOR`` rounds, and what one more round adds there
    (None: no curves measured)."""
    if not planner.known or planner.t_step.size <= ANCHOR + 1:
        return None
    at = chain_price(planner, ANCHOR)
    return at, chain_price(planner, ANCHOR + 1) - at


def _moved(old: np.ndarray, step: np.ndarray) -> np.ndarray:
    """A per-depth moving average ``old`` moved ``EMA`` of the way to ``step``: depths only ``step`` has
    start at its value, depths only ``old`` has keep theirs."""
    k = min(old.size, step.size)
    head = old[:k] + EMA * (step[:k] - old[:k])
    return np.concatenate([head, step[k:], old[step.size :]])


def grow_row(
    planner: AutoPlanner, drafter: Drafter, root: int, shape: Shape, max_depth: int, began: float
) -> DraftTree:
    """A batch row's step in the shape the batch chose: a chain of ``shape.rounds`` nodes, the draft's
    best child at each depth, all verified (every row fills the shape: the batch pays for the largest
    tree anyway). A plain shape (N = 0): the root alone, for every row. ``planner`` is the row's
    ``AutoPlanner`` (its calibration and decisions). The chain's calibrated p̂ (its node's calibrated
    acceptance times its parent's p̂) goes to the plan; a node the calibration gives 0 ends it."""
    planner.probing = False
    # after plain steps the drafter's first round also feeds what it skipped (a one-off catch-up): the
    # step's wall is not what the shape costs
    fresh = planner.fresh
    catching_up = fresh or planner.after_plain
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
    rounds, calibration = min(max_depth, planner.max_depth, shape.rounds), planner.calibration
    tree, node = DraftTree(root), torch.zeros(1, dtype=torch.long)  # [1] the chain's last node
    phat = np.zeros(rounds)  # [D] calibrated p̂ of the chain's nodes
    drafting, size, above = 0.0, 0, 1.0  # seconds in the drafter; nodes drafted; their last p̂
    for depth in range(1, rounds + 1):
        start = time.perf_counter()
        prop = drafter.expand(tree, node, 1)  # tokens, q: [1, 1] the draft's best child
        drafting += time.perf_counter() - start
        q = prop.q.numpy()[0]  # [1]
        f = float(calibration.lookup(q, depth)[0]) if calibration is not None and q[0] > 0 else float(q[0])
        if f <= 0:  # padding (q = 0), or a child the calibration says is never taken
            break
        node = tree.add_children(node, prop.tokens[:, 0], prop.q[:, 0])
        above = phat[size] = above * f
        size += 1
    planner.plan.report(phat[:size].copy(), catching_up, planner, fresh)
    planner.decide(
        n=size,
        depth=size,
        off=size == 0,
        predicted=planner.plan.predicted,
        expected=float(phat[:size].sum()),
        own=time.perf_counter() - began - drafting,
    )
    return tree
