"""`opt-tree nodes=auto`: each step's tree sized by what drafting and verifying cost, measured.

The objective is tokens per second over the whole run, not tokens per step. Renewal-reward theory
turns that ratio into a per-step sum: a policy has the best long-run rate λ* exactly when every step
maximises

    expected tokens − λ* · expected seconds          (Dinkelbach's parametric form of a ratio)

so time has a price, λ tokens per second, and every piece of work is done only if it returns more
tokens than it costs at that price. λ is the run's measured rate (tokens / wall seconds, a slow
moving average over steps; until there is one, the plain rate of the cost model). Dinkelbach's
iteration — plan at λ, measure the rate, plan at that — climbs to λ*: a plan that is best at λ has a
rate of at least λ. With the cost curves of ``treespec.cost`` (T_first, T_expand(m), T(n) = verify +
bookkeeping of n drafted nodes) and calibrated p̂ (``treespec.acceptance_map``), layer by layer:

- **keep** a drafted node iff its p̂ exceeds λ · ΔT, the price of its share of the verification (ΔT is
  the slope of T beyond the first node: the jump T(1) − T(0) of speculating at all is paid at the cut);
- **expand** the j best new nodes (p̂ descending), j maximising  r · Σ p̂ − λ · (T_expand(j) + T(s + j) − T(s)):
  their children's expected mass (r = the share of its parents' mass the last layer kept) against the
  expansion and the children's verification, priced by the curve at the s nodes drafted so far (a CPU's
  T(n) is steep for the first few nodes and flat after); no j > 0 pays: the tree stops growing;
- **cut**: the drafting is spent, so the tree verified is the top-n by p̂ with n maximising
  E_n − λ · T(n), n = 0 (the root alone: a plain step) included.

**Off** (the judge of ``plugins/probe.py``, shared with batches). After 12 speculative steps, if
their rate (a moving average of about 20 steps, the 4 trial steps left out) is below 97% of what plain
decoding would have done in the same steps — each step's time without its drafting, × T(0)/T(n): one
clock for both, so a machine whose speed swings never decides on its own — by more than the steps'
noise (``probe.StepRatios``), the builder verifies the
root alone (the drafter is not called, and catches up in one forward when drafting resumes). Every
``gap`` steps a probe drafts and verifies a tree (at least the draft's best child), and speculation
resumes if the probe's own plan expects its step, drafting included (as the curves predict it), to
beat the root alone: (1 + E_n) / (T_draft + T(n)) > 1 / T(0). Each probe that does not, and each
on-phase that loses, doubles the gap (4 … 256 steps); 64 winning steps in a row reset it. The first
layer of a step after plain steps also feeds the drafter the skipped tokens, so it refines no curve:
priced into T_first, each probe's catch-up made the next probe's plan dearer (on SmolLM2 under
sampling, the head with prompt lookup: a 3.5 ms first layer priced at 20–30 ms).
docs/cost-aware.md gives the reasons and the measurements.

Decisions change tree shapes from run to run, never tokens: whatever tree is drafted, verification
keeps the output lossless. The planner's own arithmetic is a few numpy operations per layer on
arrays of at most ``cap`` entries; cost tables and the calibration map are refreshed every few steps,
not every step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from treespec.acceptance_map import AcceptanceMap
from treespec.cost import CostModel, load_profile, user_profile
from treespec.interfaces import Drafter, PlanNote
from treespec.plugins.batch_budget import BatchPlan, grow_row
from treespec.plugins.drafted import Drafted
from treespec.plugins.probe import Judge, RateAverage, as_plain
from treespec.rows_cache import CacheRow
from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.stats import StepStats
    from treespec.target import TargetModel

EXPLORE = (1, 4, 16, 48)  # cut sizes forced while T(n) has no measurement there (profile=none)
EXPLORE_DEPTH = 4  # layers a step drafts while no expansion has been measured (profile=none)
CHILDREN = 8  # children asked per expanded node
REFRESH = 32  # steps between refreshes of the cost tables (the curves move slowly)
RATE_EMA = 0.05  # λ: moving averages of tokens and seconds (about the last 20 steps)


def _slope(t: np.ndarray, span: int = 32) -> float:
    """ΔT: seconds one more verified node adds, the least-squares slope of T(n) over n = 1 … span.
    (Not T(2) − T(1): one noisy point would price every node; the jump T(1) − T(0) of speculating at
    all is the cut's business.)"""
    n = np.arange(1, min(span, t.size - 1) + 1)
    if n.size < 2:
        return 0.0
    y = t[n]
    return max(0.0, float(np.polyfit(n, y, 1)[0]))


class AutoPlanner:
    """The state of one auto builder: cost model, price, on/off, and what it decided."""

    def __init__(self, cap: int, max_depth: int, calibration: AcceptanceMap | None, refine: bool, profile: str | None):
        """``calibration``: the builder's acceptance map (it learns in ``TreeBuilder.verified``), or None
        to rank by the raw p̂."""
        self.cap, self.max_depth, self.refine, self.profile = cap, max_depth, refine, profile
        self.cost = CostModel()
        self.calibration = calibration
        self.run_rate = RateAverage(RATE_EMA)  # every step: λ
        self.judge = Judge.for_row()  # speculation on or off, and when to probe (plugins/probe.py)
        self.probing = False  # the current step is a probe
        self.wanted = False  # the last plan's own verdict: a tree beats the root alone
        self._tables_age = REFRESH  # steps since the tables were read from the curves (REFRESH: stale)
        self._seen = -1  # measured points of the curves when the tables were read
        self.decisions: list[dict[str, Any]] = []  # per step: n, depth, off, predicted seconds, calibrated E
        self.note: PlanNote | None = None
        self.plan: BatchPlan | None = None  # a batch row's: the shape the rows share (batch_budget.py)
        self.fresh = False  # a new prompt: the next step's drafter also feeds it (a batch row's catch-up)

    # ------------------------------------------------------------------ setup
    def attach(self, target: TargetModel, drafter: Drafter, batch: int = 1) -> None:
        """Cap trees at what the target verifies; start from a saved profile when there is one, else
        from a quick measurement of a few sizes (``treespec.cost_measure.quick``: 0.25 s for the
        small pair, 2.1 s for SmolLM2 here, once per Decoder). ``profile=none``: start empty and learn
        online only. A row of a batch of ``batch`` > 1 prices its nodes by the batched step: a profile
        measured for that batch size (``quick(..., batch)``: every row verifying n nodes, expanding m),
        refined online from the batch's step times; trees shrink as the step fills the machine, down to
        plain decoding (docs/design.md, "Batches")."""
        self.cap = min(self.cap, target.max_tree_nodes)
        if self.profile == "none":
            return
        if self.profile:
            self.cost = user_profile(self.profile)
        else:
            key = profile_key(target, drafter)
            if batch > 1:
                key["batch"] = batch
            saved = load_profile(key)
            if saved is None:
                from treespec.cost_measure import quick

                saved = quick(target, drafter, key, batch)
            self.cost = saved
        self._tables_age = REFRESH

    def _tables(self) -> None:
        """T(n) (verify + bookkeeping) and T_expand(m) as arrays, read from the curves every REFRESH
        steps, and at once when a size is measured for the first time."""
        cost, size = self.cost, self.cap + 1
        seen = cost.verify.seen + cost.bookkeeping.seen + cost.expand.seen + cost.first.seen
        if self._tables_age < REFRESH and seen == self._seen:
            self._tables_age += 1
            return
        self._seen = seen
        self.t_step = np.add(cost.verify.table(size), cost.bookkeeping.table(size))  # [cap+2] T(n)
        self.t_expand = np.asarray(cost.expand.table(size))  # [cap+2] T_expand(m)
        self.t_first = cost.first.predict(1)
        self.known = cost.verify.known and cost.bookkeeping.known
        self._slope = _slope(self.t_step)
        self._tables_age = 0

    @property
    def price(self) -> float:
        """λ, tokens per second: the run's measured rate, and never less than plain decoding's (a rate
        any run can have: the root alone every step); 0 while nothing is known (every node is free,
        and the first steps explore)."""
        plain = float(self.t_step[0]) if self.known else 0.0
        floor = 1.0 / plain if plain > 0 else 0.0
        rate = self.run_rate.rate
        return max(rate, floor) if rate is not None else floor

    # ------------------------------------------------------------------ one step
    def build(self, drafter: Drafter, root: int, max_depth: int) -> DraftTree:
        began = time.perf_counter()
        self._tables()
        if self.plan is not None:  # a row of a batch: the batch chose the step's shape
            return grow_row(self, drafter, root, self.plan.shape(self), max_depth, began)
        self.probing = False
        if max_depth > 0 and self.judge.due():
            self.probing = True
        if max_depth <= 0 or (self.judge.off and not self.probing) or not self.known:  # plain decoding: the root alone
            # (with nothing measured yet, the first step is plain: it measures the rate to beat)
            seconds = float(self.t_step[0]) if self.known else 0.0
            own = time.perf_counter() - began
            self.decide(n=0, depth=0, off=True, predicted=seconds, expected=0.0, own=own)
            return DraftTree(root, capacity=1)
        depth_cap = min(max_depth, self.max_depth if self.cost.expand.known else EXPLORE_DEPTH)
        return self._grow(drafter, DraftTree(root), depth_cap, began)

    @property
    def after_plain(self) -> bool:
        """The last step was plain: this step's first expansion also feeds the drafter what it skipped
        (one forward over the stretch), a one-off catch-up that is not what a first layer costs."""
        return bool(self.decisions) and bool(self.decisions[-1]["off"])

    @property
    def step_cap(self) -> int:
        """The most nodes this step may verify."""
        return self.cap

    def _grow(self, drafter: Drafter, tree: DraftTree, depth_cap: int, began: float) -> DraftTree:
        lam, cap, calib, slope = self.price, self.step_cap, self.calibration, self._slope
        floor = lam * slope  # the p̂ a node needs to pay for its verification
        drafted = Drafted(cap * depth_cap)
        spent, drafting, typical = 0.0, 0.0, 0.0  # typical: the drafting by the model's curves
        frontier = np.zeros(1, dtype=np.int64)  # [M] tree ids of the nodes to expand
        mass = 1.0  # Σ p̂ over the frontier
        caught_up = self.after_plain  # then the first layer prices the catch-up: it refines no curve
        start = time.perf_counter()
        for depth in range(1, depth_cap + 1):
            m, size = int(frontier.size), drafted.size
            prop = drafter.expand(tree, torch.from_numpy(frontier), CHILDREN)  # tokens, q: [M, k]
            drafting += time.perf_counter() - start
            cand = drafted.candidates(frontier, prop.q.numpy(), depth, calib)  # [M*k] p̂ of every candidate
            # a candidate must pay for its verification and be able to make the final top-cap (its
            # descendants' p̂ are no larger, so below the cap-th best no subtree can enter either)
            bar = floor if size < cap else max(floor, float(np.partition(drafted.nodes[0], size - cap)[size - cap]))
            order = np.argsort(-cand, kind="stable")[:cap]  # best first; a layer adds at most cap nodes
            kept = cand[order]  # [K] descending
            count = int(np.searchsorted(-kept, -bar))  # those strictly above the bar (q = 0 padding: p̂ 0, never)
            if count == 0 and depth == 1 and (self.probing or self.judge.trial) and kept[0] > 0:
                count = 1  # a trial step tests speculation: at least the draft's best child
            order, kept = order[:count], kept[:count]
            if count:
                new = drafted.add(tree, frontier, prop, order, depth, kept)
                total = np.cumsum(kept)  # [K]
                ratio = min(1.0, float(total[-1]) / mass) if mass > 0 else 0.0  # share of the parents' mass kept
                j = self._frontier_size(total, ratio, lam, self._layer_cost(lam, drafted.size, total.size))
                frontier, mass = new[:j], (float(total[j - 1]) if j else 0.0)
            took = time.perf_counter() - start  # the layer: drafting and this planner's own work on it
            if self.refine and not (depth == 1 and caught_up):
                (self.cost.first.observe(1, took) if depth == 1 else self.cost.expand.observe(m, took))
            predicted = self.t_first if depth == 1 else float(self.t_expand[min(m, cap + 1)])
            spent += took if self.refine else predicted
            typical += predicted
            start += took
            if count == 0 or frontier.size == 0:
                break
        n, expected, seconds = self._cut(drafted.phat[: drafted.size + 1], spent, lam, typical)
        chosen = drafted.top(tree, n)
        self.decide(
            n=n,
            depth=chosen.depth,
            off=False,
            predicted=seconds,
            expected=expected,
            own=time.perf_counter() - began - drafting,
            drafting=spent,
        )
        return chosen

    def _layer_cost(self, lam: float, size: int, count: int) -> np.ndarray:
        """Expanding the j best of ``count`` new nodes, in tokens (j = 1..count): λ·(T_expand(j) + T(size
        + j) − T(size)), the children priced where the tree is (not j·ΔT: docs/cost-aware.md, rule 2)."""
        last = self.t_step.size - 1
        j = np.arange(1, count + 1)  # [K]
        grown = self.t_step[np.minimum(size + j, last)] - self.t_step[min(size, last)]  # [K]
        return lam * (self.t_expand[np.minimum(j, self.t_expand.size - 1)] + grown)  # [K]

    @staticmethod
    def _frontier_size(total: np.ndarray, ratio: float, lam: float, layer_cost: np.ndarray) -> int:
        """How many of the new nodes (p̂ descending, ``total`` = their running Σ p̂) to expand: the j
        maximising r·Σ_{i≤j} p̂ − λ·(T_expand(j) + T(s + j) − T(s)), or 0 if no j pays."""
        if lam <= 0:
            return int(total.size)
        gain = ratio * total - layer_cost[: total.size]  # [K]
        best = int(np.argmax(gain))
        return best + 1 if gain[best] > 0 else 0

    def _cut(self, phat: np.ndarray, spent: float, lam: float, typical: float) -> tuple[int, float, float]:
        """(n, E_n, predicted seconds): the top-n verified, n maximising E_n − λ·T(n) (drafting is spent).
        ``typical``: this step's drafting as the cost curves predict it (for ``wanted``: a probe after a
        long plain stretch also pays the drafter's one-off catch-up, which future steps will not)."""
        drafted = min(phat.size - 1, self.step_cap)  # at most cap nodes are verified
        values = -np.sort(-phat[1:])[:drafted]  # [N] descending
        tokens = np.concatenate([[0.0], np.cumsum(values)])  # [N+1] E_n
        t = self.t_step[: drafted + 1]  # [N+1] T(n)
        value = tokens - lam * t
        n = int(np.argmax(value))
        # the plan's own verdict, before the rules below: would this step, drafting included, beat the
        # root alone? (a probe turns speculation back on only if so)
        self.wanted = n > 0 and (1.0 + tokens[n]) * t[0] > typical + t[n]
        if n == 0 and drafted and (self.probing or self.judge.trial):
            n = 1 + int(np.argmax(value[1:]))  # a trial or probe step verifies a tree: the map keeps learning
        n = self._explore(n, drafted)
        return n, float(tokens[n]), spent + float(t[n])

    def _explore(self, n: int, drafted: int) -> int:
        """While T(n) has no measurement at an EXPLORE size this tree reaches (no profile, first steps),
        cut there instead, so that the curve is measured across the range."""
        if not self.refine:
            return n
        grid, counts = self.cost.verify.xs, self.cost.verify.counts
        for size in EXPLORE:
            if size > drafted:
                break
            i = min(range(len(grid)), key=lambda j: abs(grid[j] - size))
            if counts[i] == 0:
                return size
        return n

    def decide(
        self, n: int, depth: int, off: bool, predicted: float, expected: float, own: float, drafting: float = 0.0
    ) -> None:
        """Record the step's plan; ``drafting``: its drafting seconds as the curves predict them (with
        ``refine=false`` the judge prices steps by the curves, never this run's clock)."""
        self.decisions.append(
            {
                "n": n,
                "depth": depth,
                "off": off,
                "probe": self.probing,
                "predicted_seconds": predicted,
                "expected": expected,
                "own_seconds": own,
                "drafting": drafting,
            }
        )
        self.note = PlanNote(predicted_seconds=predicted, expected=expected, own_seconds=own)

    # ------------------------------------------------------------------ feedback
    def start(self) -> None:
        """A new generate: prices, curves and the calibration carry over between prompts; a judge that
        turned speculation off probes on the first step (``ProbeSchedule.restart``)."""
        self.fresh = True  # the next step's first round also feeds the new prompt to the drafter
        self.judge.probes.restart()

    def observe(self, stats: StepStats) -> None:
        """Refine the cost curves with the step's measured times, update λ, then judge speculation.

        A step's real cost is its wall time (``StepStats.t_wall``): it includes the Decoder's own
        per-step work, which the phase timings do not; that remainder is booked as bookkeeping, so
        plain and speculative steps are charged alike."""
        phases = stats.t_draft + stats.t_verify + stats.t_bookkeeping
        wall = stats.t_wall if stats.t_wall > 0 else phases
        if self.refine:
            self.cost.verify.observe(stats.tree_size, stats.t_verify)
            self.cost.bookkeeping.observe(stats.tree_size, stats.t_bookkeeping + max(0.0, wall - phases))
        else:  # reproducible: judge steps by the profile's times, never this run's clock
            wall = (self.decisions[-1]["predicted_seconds"] if self.decisions else 0.0) or wall
        self.run_rate.add(stats.emitted, wall)
        last = self.decisions[-1] if self.decisions else {"off": False, "probe": False, "drafting": 0.0}
        drafting = stats.t_draft if self.refine else last["drafting"]
        plain = self._as_plain(stats.tree_size, wall - drafting)  # the same step as plain decoding
        if self.plan is not None:  # a batch row: the batch's plan judges, for every row
            self.plan.observe(wall, stats.emitted, plain)
        elif last["probe"]:
            self.judge.probed(self.wanted)  # its own plan, made with everything calibrated so far
        elif not last["off"]:
            self.judge.speculated(stats.emitted, wall, plain)

    def _as_plain(self, n: int, seconds: float) -> float:
        """``probe.as_plain`` with this planner's T(n) (the seconds unchanged before the curves are known)."""
        return as_plain(self.t_step if self.known else None, n, seconds)


def profile_key(target: TargetModel, drafter: Drafter) -> dict[str, Any]:
    """What a cost profile was measured for: target, drafter and its options, device, dtype, threads,
    which few-row products the target's forward uses (``treespec.row_matmul``; with how many weights read
    from a GGUF's blocks, ``treespec.gguf_blocks``) and whether trees are
    verified by the lean forward (``treespec.lean.lean_target``): both change T(n)."""
    rows = getattr(target, "row_matmul", None)
    return {
        "target": target.name,
        "drafter": drafter_key(drafter),
        "device": str(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **({"row_matmul": "".join(v[0] for v in rows.verdict())} if rows is not None else {}),  # s/r/p/n a size
        **({"blocks": rows.blocks()} if rows is not None else {}),  # treespec.gguf_blocks
        **({"forward": "lean"} if getattr(target, "lean", None) is not None else {}),  # treespec.lean_target
    }


def drafter_key(drafter: Drafter) -> str:
    """A drafter in a profile key: its class and ``cost_options``, and a composition's parts in order
    (``eagle+ngram`` and ``model+ngram`` cost differently). A batch row is keyed as its drafter's own
    class (the batch size is keyed apart)."""
    kind = type(drafter)
    if isinstance(drafter, CacheRow):
        kind = next(c for c in kind.__mro__[1:] if not issubclass(c, CacheRow))
    options = ", ".join(f"{k}={v}" for k, v in sorted(drafter.cost_options().items()))
    parts = [p for p in getattr(drafter, "parts", None) or [] if isinstance(p, Drafter)]
    inner = "; " + " + ".join(drafter_key(p) for p in parts) if parts else ""
    return f"{kind.__name__}({options}{inner})"
