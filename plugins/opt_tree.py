"""Builder `opt-tree`: OPT-Tree (Wang et al., TACL 2025, arXiv 2406.17276).

Per step it searches for the draft tree that maximises the expected acceptance length

    E(A) = Σ_{v in tree} p̂(v),     p̂(v) = Π_{u on root→v} q(u | parent(u))

under a budget of n drafted nodes. Layer by layer:

    layer 1      = the n children of the root with the highest q
    layer d + 1  = the n best by p̂ among the top-n children of every node of layer d
    E_d          = Σ of the n largest p̂ over layers 1..d     (the best n-node tree seen so far)
    stop when E_d − E_{d−1} ≤ δ, or at max_depth
    final tree   = the n nodes with the largest p̂ over all layers built

Because p̂(child) ≤ p̂(parent), the n largest p̂ always form a connected tree (ties are broken
towards the shallower node, so a parent sorts before its child). Differences from the reference
code are listed in docs/opt-tree.md: each layer is scored as soon as it is drafted (the reference
scores it one draft forward later, then throws that forward away) and the tree can reach max_depth
(the reference stops one layer short).

``sample=true`` (fixed budget; sampling with temperature > 0): the same search over *slots*. Node
u's j-th slot is its j-th draw without replacement from the draft (``sampled_expand``), and the
search ranks it by its value

    ŝ(u, j) = ŝ(u) · q_u↓j,     q_u↓j = the j-th largest probability of the distribution u's
                                children are drawn from (ŝ(root) = 1)

— what the ranked search would give rank j, known before the draw. Ranking a draw by its OWN
probability would keep or drop it depending on what was drawn, and that biases every exact
verifier (docs/sampling.md, "Sampled opt-tree and eagle2"); ŝ never looks at the draws it ranks.
ŝ is non-increasing along a node's slots, so every cut keeps a prefix of each node's draws, and
ŝ(child) ≤ ŝ(parent), so the top n still form a tree. The layers stop when no later layer could
add more than δ (n · the newest layer's best ŝ ≤ δ) or reach the top n: the measured gain
E_d − E_{d−1} would read the draws below nodes that a deeper layer may still cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treespec.acceptance_map import AcceptanceMap
from treespec.interfaces import Drafter, PlanningBuilder, TreeBuilder
from treespec.plugins.batch_budget import BatchPlan
from treespec.plugins.configs import OptTreeConfig
from treespec.plugins.cost_aware import AutoPlanner
from treespec.plugins.drafted import top_by
from treespec.sampling import DraftSampling, propose
from treespec.tree import DraftTree

FIXED_MAX_DEPTH = 10  # a fixed budget: the paper's setting
AUTO_MAX_DEPTH = 32  # auto: layers stop when they no longer pay; this only bounds a step


def top_n_by_phat(tree: DraftTree, n: int) -> torch.Tensor:
    """Ids of the root plus the n drafted nodes with the largest p̂ (ties: shallower, then older)."""
    return top_by(tree.phat, tree.depths, n)


@dataclass(frozen=True)
class Slots:
    """Up to k child slots for each of M expanded nodes; column j is the node's j-th child.

    Ranked (no sampling): the drafter's top-k, best first, and a slot's value is its q. Sampled: the
    j-th draw without replacement, in draw order (``sampled_expand``, recorded in the tree), and a
    slot's value is q↓j, the j-th largest probability of the distribution drawn from: what rank j is
    worth, whatever was drawn. Values never increase along a row, so any cut by value keeps a
    prefix of each node's slots; padding (q = 0) is always a suffix, with value 0 in both cases.
    """

    tokens: torch.Tensor  # [M, k] long: the children
    q: torch.Tensor  # [M, k] float: each child's draft probability, what the tree stores (0: padding)
    value: torch.Tensor  # [M, k] float: what the builder ranks the slot by

    @property
    def cols(self) -> int:
        return int(self.q.shape[1])


def expand_slots(
    drafter: Drafter, tree: DraftTree, nodes: torch.Tensor, k: int, sampling: DraftSampling | None
) -> Slots:
    """The k child slots of every node in ``nodes`` [M]: ranked (``sampling`` None) or drawn."""
    prop = propose(drafter, tree, nodes, k, sampling)  # tokens, q: [M, k] (sampled: in draw order)
    if sampling is None:
        return Slots(prop.tokens, prop.q, prop.q)
    drawn_from = tree.draw_dist[tree.draw_row[nodes]]  # [M, V'] what each node's children were drawn from
    value = drawn_from.topk(prop.q.shape[1], dim=-1).values  # [M, k] q↓1 ≥ q↓2 ≥ ...: no draw looked at
    return Slots(prop.tokens, prop.q, value.float().cpu())


def slot_order(values: torch.Tensor, n: int) -> torch.Tensor:
    """Flat indices [≤ n] of the n best slots of ``values`` [M, k] with value > 0, best first. The
    sort is stable, so equal values keep their column order: a node's chosen slots are a prefix."""
    order = torch.argsort(values.flatten(), descending=True, stable=True)  # [M*k]
    return order[: min(n, int((values > 0).sum()))]


def sampled_layers_done(scores: torch.Tensor, depths: torch.Tensor, layer: torch.Tensor, n: int, delta: float) -> bool:
    """Stop drafting layers of a sampled search after ``layer`` (the newest node ids, [L]; ``scores`` [N]
    the slot values ŝ of every node). Every later node is worth at most the newest layer's best ŝ, so
    a later layer adds at most n · max ŝ to E(A): stop when that is ≤ δ, or when no node of the layer
    is among the top n (then none below it ever will be, and stopping changes nothing). Both read
    only the layer's best ŝ and the ranking above it, never draws below a node a later layer may cut."""
    if n * float(scores[layer].max()) <= delta:
        return True
    kept = top_by(scores, depths, n)  # [n+1] the root and the n best so far
    return not bool((kept >= int(layer.min())).any())


class OptTreeBuilder(PlanningBuilder):
    """Fixed budget (``nodes=N``): the OPT-Tree search above, exactly. ``nodes=auto``: the budget and
    depth of every step chosen for tokens per second (``treespec.plugins.cost_aware``)."""

    Config = OptTreeConfig
    config: OptTreeConfig

    def __init__(self, config: OptTreeConfig):
        super().__init__(config)
        auto = config.nodes == "auto"
        calibrate = config.calibrate if config.calibrate is not None else auto  # default: on with auto only
        self.calibration = AcceptanceMap() if calibrate else None
        self.max_depth = config.max_depth or (AUTO_MAX_DEPTH if auto else FIXED_MAX_DEPTH)
        self.planner = (
            AutoPlanner(config.cap, self.max_depth, self.calibration, config.refine, config.profile) if auto else None
        )

    @property
    def max_nodes(self) -> int:
        return self.config.cap if self.planner is not None else int(self.config.nodes)

    def attach(self, target: Any, drafter: Drafter) -> None:
        if self.planner is not None:
            self.planner.attach(target, drafter, self.batch_size)

    def join_batch(self, peers: list[TreeBuilder]) -> None:
        """Auto: the rows' planners share one shape per step (``batch_budget.BatchPlan``) and one
        calibration map (every row's verified trees teach it: one drafter, one map, refitted once for the
        batch, not once per row). Each row keeps its own cost curves: their online refinement moves a
        point a fixed share per observation, and B rows observing one set would move it B times as fast."""
        if self.planner is None or len(peers) <= 1:  # a batch of one plans as a single sequence does
            return
        first = next((p for p in peers if isinstance(p, OptTreeBuilder) and p.planner and p.planner.plan), None)
        if first is None or first.planner is None:
            self.planner.plan = BatchPlan()
            return
        self.planner.plan = first.planner.plan
        self.calibration = self.planner.calibration = first.calibration

    def verified(self, tree: DraftTree, path: torch.Tensor) -> None:
        if self.calibration is not None:
            self.calibration.learn(tree, path)

    def plan_note(self) -> Any:
        return self.planner.note if self.planner is not None else None

    def observe(self, stats: Any) -> None:
        if self.planner is not None:
            self.planner.observe(stats)

    def start(self, sampling: Any) -> None:
        super().start(sampling)
        if self.planner is not None:
            self.planner.start()

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        if self.planner is not None:
            return self.planner.build(drafter, root_token, max_depth)
        return self._fixed(drafter, root_token, max_depth)

    def _fixed(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        n, delta, calib, sampling = int(self.config.nodes), self.config.threshold, self.calibration, self.sampling
        tree = DraftTree(root_token)
        # [N] what the search ranks by: p̂ (the raw product of q, or calibrated with calibrate=true); sampled:
        # the slot values ŝ (module docstring), which never read the drawn tokens' own q
        scores = tree.phat
        frontier = torch.zeros(1, dtype=torch.long)  # [M] the last layer's node ids
        best = 0.0  # E(A) of the best n-node tree so far
        for depth in range(1, min(self.max_depth, max_depth) + 1):
            slots = expand_slots(drafter, tree, frontier, n, sampling)  # tokens, q, value: [M, n]
            q = slots.value.to(scores)  # [M, n]
            if calib is not None:
                q = torch.where(q > 0, calib(q.flatten(), torch.full((q.numel(),), depth)).view_as(q).to(q), q)
            phat = scores[frontier][:, None] * q  # [M, n] p̂ (sampled: ŝ) of every candidate
            order = slot_order(phat, n)  # this layer: the n best
            if order.numel() == 0:
                break
            frontier = tree.add_children(
                frontier[order // slots.cols], slots.tokens.flatten()[order], slots.q.flatten()[order]
            )
            scores = tree.phat if calib is None and sampling is None else torch.cat([scores, phat.flatten()[order]])
            if sampling is not None:  # the stopping rule that never reads draws a later layer may cut
                if sampled_layers_done(scores, tree.depths, frontier, n, delta):
                    break
            else:
                drafted = scores[1:]  # [N-1]
                e = float(drafted.topk(min(n, drafted.numel())).values.sum())  # E(A) of the best n-node tree
                gain, best = e - best, e
                if gain <= delta:
                    break
        return tree.select(top_by(scores, tree.depths, n))
