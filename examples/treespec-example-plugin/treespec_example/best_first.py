"""Builder ``best-first``: grow the tree one expansion at a time.

Keep a frontier of nodes not expanded yet, ordered by p̂ (the product of q along the path). Pop the
best one, ask the drafter for up to ``branch`` children of it (one ``drafter.expand`` call), add the
children with q > 0 and push them. Stop when the tree holds ``nodes`` drafted nodes, or when no
frontier node is left above the depth limit ``min(max_depth option, max_depth argument)``.
"""

from __future__ import annotations

import heapq

import torch

import treespec
from treespec import DraftTree
from treespec_example.configs import BestFirstConfig


class BestFirstBuilder(treespec.TreeBuilder):
    Config = BestFirstConfig
    config: BestFirstConfig

    @property
    def max_nodes(self) -> int:
        """The most drafted nodes a tree can have: the Decoder refuses a target that cannot verify them."""
        return self.config.nodes

    def build(self, drafter: treespec.Drafter, root_token: int, max_depth: int) -> DraftTree:
        tree = DraftTree(root_token)
        depth_cap = min(self.config.max_depth, max_depth)
        budget = self.config.nodes
        frontier: list[tuple[float, int, int]] = []  # (-p̂, node id, depth): best p̂ first, then older
        if depth_cap > 0:
            frontier.append((-1.0, 0, 0))
        while frontier and tree.size < budget:
            _, node, depth = heapq.heappop(frontier)
            k = min(self.config.branch, budget - tree.size)
            prop = drafter.expand(tree, torch.tensor([node], dtype=torch.long), k)  # [1, k]
            q = prop.q[0, :k]
            keep = (q > 0).nonzero().flatten()  # padding (q == 0) is never added
            if keep.numel() == 0:
                continue
            new = tree.add_children(torch.full((keep.numel(),), node, dtype=torch.long), prop.tokens[0, keep], q[keep])
            if depth + 1 < depth_cap:
                for child, phat in zip(new.tolist(), tree.phat[new].tolist()):
                    heapq.heappush(frontier, (-phat, child, depth + 1))
        return tree
