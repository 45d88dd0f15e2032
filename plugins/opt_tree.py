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
"""

from __future__ import annotations

from typing import Any

import torch

from treespec.acceptance_map import AcceptanceMap
from treespec.interfaces import Drafter, TreeBuilder
from treespec.plugins.batch_budget import BatchPlan
from treespec.plugins.cost_aware import AutoPlanner, top_by
from treespec.plugins.configs import OptTreeConfig
from treespec.tree import DraftTree


FIXED_MAX_DEPTH = 10  # a fixed budget: the paper's setting
AUTO_MAX_DEPTH = 32  # auto: layers stop when they no longer pay; this only bounds a step


def top_n_by_phat(tree: DraftTree, n: int) -> torch.Tensor:
    """Ids of the root plus the n drafted nodes with the largest p̂ (ties: shallower, then older)."""
    return top_by(tree.phat, tree.depths, n)


class OptTreeBuilder(TreeBuilder):
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
        self.planner = AutoPlanner(config.cap, self.max_depth, self.calibration, config.refine, config.profile) \
            if auto else None

    @property
    def max_nodes(self) -> int:
        return self.config.cap if self.planner is not None else int(self.config.nodes)

    def attach(self, target: Any, drafter: Drafter) -> None:
        if self.planner is not None:
            self.planner.attach(target, drafter, self.batch_size)

    def join_batch(self, peers: list[TreeBuilder]) -> None:
        """Auto: the rows' planners share one shape per step (``batch_budget.BatchPlan``)."""
        if self.planner is None:
            return
        shared = [p.planner.plan for p in peers if isinstance(p, OptTreeBuilder) and p.planner and p.planner.plan]
        self.planner.plan = shared[0] if shared else BatchPlan()

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
        n, delta, calib = int(self.config.nodes), self.config.threshold, self.calibration
        tree = DraftTree(root_token)
        scores = tree.phat  # [N] p̂ the search ranks by: the raw product of q, or calibrated (calibrate=true)
        frontier = torch.zeros(1, dtype=torch.long)  # [M] the last layer's node ids
        best = 0.0  # E(A) of the best n-node tree so far
        for depth in range(1, min(self.max_depth, max_depth) + 1):
            prop = drafter.expand(tree, frontier, n)  # tokens, q: [M, n]
            q = prop.q.to(scores)  # [M, n]
            if calib is not None:
                q = torch.where(q > 0, calib(q.flatten(), torch.full((q.numel(),), depth)).view_as(q).to(q), q)
            phat = scores[frontier][:, None] * q  # [M, n] p̂ of every candidate
            order = torch.argsort(phat.flatten(), descending=True, stable=True)  # [M*n]
            order = order[: min(n, int((phat > 0).sum()))]  # this layer: the n best
            if order.numel() == 0:
                break
            cols = phat.shape[1]
            frontier = tree.add_children(
                frontier[order // cols], prop.tokens.flatten()[order], prop.q.flatten()[order]
            )
            scores = tree.phat if calib is None else torch.cat([scores, phat.flatten()[order]])
            drafted = scores[1:]  # [N-1]
            e = float(drafted.topk(min(n, drafted.numel())).values.sum())  # E(A) of the best n-node tree
            gain, best = e - best, e
            if gain <= delta:
                break
        return tree.select(top_by(scores, tree.depths, n))
