"""`opt-tree nodes=auto`: each step's tree sized by what drafting and verifying cost, measured.

The objective is tokens per second, not tokens per step. A step that drafted for ``T_d`` seconds and
verifies the n nodes of largest calibrated p̂ emits, in expectation,

    E_n + 1 tokens  in  T_d + T_verify(n) + T_book(n) seconds,     E_n = Σ of the n largest p̂ (calibrated)

so its rate is R(n) = (E_n + 1) / (T_d + T_verify(n) + T_book(n)) (``treespec.cost``, ``treespec.acceptance_map``).
Layer by layer, as OPT-Tree:

- **cut**: after each layer, n* = argmax_n R(n), n = 0 (the root alone) included. Because the p̂ are
  sorted, R(n) grows while the next node's p̂ exceeds R(n) · ΔT(n), the rate times its share of the
  verification: the top-n is cut where a node no longer pays for itself.
- **prune**: a candidate is added, and a node expanded, only if its p̂ exceeds R(n*) · ΔT (its
  children's p̂ are no larger, so below that line no descendant can pay either).
- **depth**: the next layer is drafted only if its expected gain pays for its draft time at the
  current rate: (E* + g + 1) / (T_d + T_expand(m) + T(n* + m)) > R(n*), where g, the next layer's
  expected extra accepted tokens, is the frontier's p̂ mass times the ratio the last layer achieved.
- **off**: when speculative steps have been slower than plain steps (measured tokens per second of
  wall time, moving averages, after 8 speculative steps), the builder verifies the root alone (plain
  decoding) for 4 steps, then probes: it speculates again for 8 steps and measures. A probe that
  loses doubles the plain stretch (up to 64 steps); one that wins keeps speculation on. The 8 trial
  steps after (re)turning on always verify a tree (n* ≥ 1), so the cost curves of tree sizes are
  re-measured and a transient slowdown cannot lock speculation out.

Until the cost curves hold measurements (no saved profile), the first steps explore: their cuts
are forced to a few sizes so that T_verify is measured across the range. Decisions change shapes
from run to run, never tokens: whatever tree is drafted, verification keeps the output lossless.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from treespec.acceptance_map import AcceptanceMap
from treespec.cost import CostModel, load_profile
from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.interfaces import Drafter
    from treespec.stats import StepStats
    from treespec.target import TargetModel

EXPLORE = (1, 4, 16, 48)  # cut sizes forced while T_verify has no measurement there
CHILDREN = 8  # children asked per expanded node
MIN_STEPS_OFF = 8  # speculative steps seen before speculation may be turned off


def top_by(values: torch.Tensor, depths: torch.Tensor, n: int) -> torch.Tensor:
    """The root plus the n drafted nodes with the largest ``values`` (ties: shallower, then older)."""
    ids = torch.arange(1, values.numel())
    ids = ids[torch.argsort(depths[ids], stable=True)]
    ids = ids[torch.argsort(values[ids], descending=True, stable=True)]
    return torch.cat([torch.zeros(1, dtype=torch.long), ids[:n]])


class AutoPlanner:
    """The state of one auto builder: cost model, acceptance map, on/off, and what it decided."""

    def __init__(self, cap: int, max_depth: int, calibration: AcceptanceMap | None, refine: bool, profile: str | None):
        """``calibration``: the builder's acceptance map (it learns in ``TreeBuilder.verified``), or None
        to rank by the raw p̂."""
        self.cap, self.max_depth, self.refine, self.profile = cap, max_depth, refine, profile
        self.cost = CostModel()
        self.calibration = calibration
        self.off, self.probe_in, self.probe_gap = False, 0, 4
        self.spec_rate: float | None = None  # moving averages of measured tokens/s: speculative steps,
        self.plain_rate: float | None = None  # and plain (root-only) steps
        self.spec_steps = 0  # speculative steps since speculation was (re)turned on
        self.last_wall: float | None = None
        self.clock = time.perf_counter  # the wall clock between steps (tests inject their own)
        self.decisions: list[dict[str, Any]] = []  # per step: n, depth, predicted seconds, calibrated E

    # ------------------------------------------------------------------ setup
    def attach(self, target: "TargetModel", drafter: "Drafter") -> None:
        """Cap trees at what the target verifies; start from a saved profile when there is one."""
        self.cap = min(self.cap, target.max_tree_nodes)
        if self.profile == "none":
            return
        if self.profile:
            from pathlib import Path

            self.cost = CostModel.from_json(Path(self.profile).read_text())
            return
        saved = load_profile(profile_key(target, drafter))
        if saved is not None:
            self.cost = saved

    # ------------------------------------------------------------------ one step
    def build(self, drafter: "Drafter", root: int, max_depth: int) -> DraftTree:
        tree = DraftTree(root)
        if max_depth <= 0:
            self.decisions.append({"n": 0, "depth": 0, "off": True})
            return tree
        if self.off:
            if self.probe_in > 0:  # plain decoding: the root alone
                self.probe_in -= 1
                self.decisions.append({"n": 0, "depth": 0, "off": True})
                return tree
            self.off, self.spec_steps, self.spec_rate = False, 0, None  # a probe: speculate for a few steps again
        return self._grow(drafter, tree, min(max_depth, self.max_depth))

    def _grow(self, drafter: "Drafter", tree: DraftTree, depth_cap: int) -> DraftTree:
        # The planner's own arithmetic runs on small numpy arrays: per layer it is a handful of
        # vector operations, which torch would dispatch at ~10 µs each (its cost is reported per step).
        began, expanding = time.perf_counter(), 0.0
        cost, calib = self.cost, self.calibration
        self._fixed = np.add(cost.verify.table(self.cap + 1), cost.bookkeeping.table(self.cap + 1))  # [cap+2] T(n)
        self._expand = cost.expand.table(self.cap + 1)  # [cap+2] T_expand(m) as a list
        phat = np.ones(1)  # [N] calibrated p̂ of every node
        frontier = np.zeros(1, dtype=np.int64)  # [M]
        spent, n_best, rate, gain_ratio = 0.0, 0, self._rate_root(0.0), 1.0
        for depth in range(1, depth_cap + 1):
            m = int(frontier.size)
            if depth > 1 and not self._layer_pays(phat, frontier, n_best, rate, spent, gain_ratio):
                break
            start = time.perf_counter()
            prop = drafter.expand(tree, torch.from_numpy(frontier), min(CHILDREN, self.cap))  # tokens, q: [M, k]
            took = time.perf_counter() - start
            expanding += took
            if self.refine:
                cost.expand.observe(m, took)
                spent += took
            else:  # reproducible: plan with the profile's times, never this run's clock
                spent += cost.expand.predict(m)
            q = prop.q.double().numpy()  # [M, k]
            k = q.shape[1]
            f = calib.lookup(q, depth) if calib is not None else q  # [M, k] calibrated conditional acceptance
            cand = (phat[frontier][:, None] * f).ravel()  # [M*k] p̂ of every candidate
            floor = self._floor(rate, len(tree) - 1)  # a node must pay for its share of the verification
            order = np.argsort(-cand, kind="stable")[: self.cap]  # a layer: at most cap nodes
            best = order[:1]
            order = order[(cand[order] > floor) & (q.ravel()[order] > 0)]
            if order.size == 0 and depth == 1 and self.spec_steps < MIN_STEPS_OFF and q.ravel()[best].sum() > 0:
                order = best  # a trial step tests speculation: at least the draft's best child
            if order.size == 0:
                break
            index = torch.from_numpy(order)
            new = tree.add_children(torch.from_numpy(frontier[order // k]), prop.tokens.flatten()[index],
                                    prop.q.flatten()[index]).numpy()
            mass_before = float(phat[frontier].sum())
            phat = np.concatenate([phat, cand[order]])
            gain_ratio = float(cand[order].sum()) / mass_before if mass_before > 0 else 0.0
            n_best, rate = self._best_cut(phat, spent)
            frontier = self._frontier(new, phat, rate, n_best, gain_ratio)
            if frontier.size == 0:
                break
        if n_best == 0 and len(tree) > 1 and self.spec_steps < MIN_STEPS_OFF:
            n_best = max(1, self._best_cut(phat, spent, at_least=1)[0])  # trial steps verify a tree: curves stay fresh
        n_best = self._explore(n_best, len(tree) - 1)
        keep = top_by(torch.from_numpy(phat), tree.depths, n_best)
        chosen = tree.select(keep)
        self.decisions.append({"n": n_best, "depth": chosen.depth, "off": False,
                               "predicted_seconds": cost.step_seconds(n_best, spent),
                               "expected": float(phat[keep[1:].numpy()].sum()),
                               "own_seconds": time.perf_counter() - began - expanding})
        return chosen

    # ------------------------------------------------------------------ the rules
    def _rate_root(self, spent: float) -> float:
        seconds = self.cost.step_seconds(0, spent)
        return 1.0 / seconds if seconds > 0 else 0.0

    def _marginal(self, n: int) -> float:
        """Seconds one more verified node adds at size n (verification and bookkeeping)."""
        n = min(n, self.cap)
        return max(0.0, float(self._fixed[n + 1] - self._fixed[n]))

    def _floor(self, rate: float, n: int) -> float:
        """The p̂ a node needs to pay for its share of the verification at size n: R · ΔT(n)."""
        marginal = self._marginal(n)
        return rate * marginal if marginal > 0 and rate < float("inf") else 0.0

    def _best_cut(self, phat: np.ndarray, spent: float, at_least: int = 0) -> tuple[int, float]:
        """(n*, R(n*)): the cut of the drafted nodes (p̂ sorted) with the highest expected rate, n* ≥ at_least."""
        values = -np.sort(-phat[1:])[: self.cap]  # [min(N-1, cap)] descending
        tokens = np.concatenate([[1.0], 1.0 + np.cumsum(values)])  # [N] E_n + 1
        seconds = spent + self._fixed[: tokens.size]  # [N]
        if seconds[0] <= 0:  # nothing measured yet: more nodes are free
            return int(values.size), float("inf")
        rates = tokens / np.maximum(seconds, 1e-9)  # [N]
        rates[:at_least] = -1.0
        best = int(np.argmax(rates))
        return best, float(rates[best])

    def _frontier(self, new: np.ndarray, phat: np.ndarray, rate: float, n_best: int, ratio: float) -> np.ndarray:
        """The new nodes worth expanding, best first: the i-th is kept while its children's expected
        mass (p̂ times the ratio the last layer kept) pays, at the current rate, for what expanding one
        more node adds to the expand call and for verifying a child: T_expand(i+1) - T_expand(i) + ΔT."""
        order = new[np.argsort(-phat[new], kind="stable")][: self.cap]
        if rate == float("inf"):
            return order
        expand, verify_one, ratio = self._expand, self._marginal(n_best), min(1.0, ratio)
        keep = 0
        for i, value in enumerate(phat[order].tolist()):
            extra = max(0.0, expand[i + 1] - expand[i]) if i > 0 else 0.0
            if value * ratio <= rate * (extra + verify_one):
                break
            keep = i + 1
        return order[:keep]

    def _layer_pays(self, phat: np.ndarray, frontier: np.ndarray, n_best: int, rate: float, spent: float,
                    gain_ratio: float) -> bool:
        """Draft the next layer only if its expected gain pays for drafting it (module docstring)."""
        m = int(frontier.size)
        gain = float(phat[frontier].sum()) * min(1.0, gain_ratio)
        expected = float(-np.sort(-phat[1:])[:n_best].sum())
        seconds = spent + self._expand[min(m, self.cap + 1)] + float(self._fixed[min(n_best + m, self.cap + 1)])
        return seconds <= 0 or (expected + gain + 1.0) / seconds > rate

    def _explore(self, n_best: int, drafted: int) -> int:
        """While T_verify is unmeasured at a size of EXPLORE this tree can reach, cut there instead."""
        if not self.refine:
            return n_best
        grid, counts = self.cost.verify.xs, self.cost.verify.counts
        for size in EXPLORE:
            if size > drafted:
                break
            i = min(range(len(grid)), key=lambda j: abs(grid[j] - size))
            if counts[i] == 0:
                return size
        return n_best

    # ------------------------------------------------------------------ feedback
    def start(self) -> None:
        """A new generate: the wall clock between steps starts over."""
        self.last_wall = None

    def observe(self, stats: "StepStats") -> None:
        """Refine the cost curves with the step's measured times, then decide speculation on or off.

        A step's real cost is the wall time since the previous step ended: it includes the Decoder's
        own per-step work, which the step's phase timings do not; that remainder is booked as
        bookkeeping, so plain and speculative steps are charged alike."""
        now = self.clock()
        phases = stats.t_draft + stats.t_verify + stats.t_bookkeeping
        wall = now - self.last_wall if self.last_wall is not None else phases
        self.last_wall = now
        if not self.refine:  # reproducible: judge steps by the profile's times
            last = self.decisions[-1] if self.decisions else {}
            wall = last.get("predicted_seconds") or self.cost.plain_seconds()
        if self.refine:
            self.cost.verify.observe(stats.tree_size, stats.t_verify)
            self.cost.bookkeeping.observe(stats.tree_size, stats.t_bookkeeping + max(0.0, wall - phases))
        measured = stats.emitted / wall if wall > 0 else 0.0
        if self.decisions and self.decisions[-1].get("off"):  # a plain step
            self.plain_rate = measured if self.plain_rate is None else 0.8 * self.plain_rate + 0.2 * measured
            return
        self.spec_steps += 1
        self.spec_rate = measured if self.spec_rate is None else 0.8 * self.spec_rate + 0.2 * measured
        if self.spec_steps < MIN_STEPS_OFF:
            return
        plain = self.plain_rate if self.plain_rate is not None else self._rate_root(0.0)
        if plain > 0 and self.spec_rate < plain:  # speculation loses: off until the next probe
            self.off, self.probe_in = True, self.probe_gap
            self.probe_gap = min(2 * self.probe_gap, 64)
        else:
            self.probe_gap = 4

def profile_key(target: "TargetModel", drafter: "Drafter") -> dict[str, Any]:
    """What a cost profile was measured for: target, drafter and its options, device, dtype, threads."""
    options = {k: v for k, v in dict(getattr(drafter, "config", {}) or {}).items() if v is not None}
    return {
        "target": target.name,
        "drafter": f"{type(drafter).__name__}({', '.join(f'{k}={v}' for k, v in sorted(options.items()))})",
        "device": str(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
