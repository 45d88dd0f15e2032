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

import torch

from treespec.interfaces import Drafter, TreeBuilder
from treespec.plugins.configs import OptTreeConfig
from treespec.tree import DraftTree


def top_n_by_phat(tree: DraftTree, n: int) -> torch.Tensor:
    """Ids of the root plus the n drafted nodes with the largest p̂ (ties: shallower, then older)."""
    ids = torch.arange(1, len(tree))  # [N-1] drafted nodes, oldest first
    ids = ids[torch.argsort(tree.depths[ids], stable=True)]  # shallower first
    ids = ids[torch.argsort(tree.phat[ids], descending=True, stable=True)]  # then by p̂
    return torch.cat([torch.zeros(1, dtype=torch.long), ids[:n]])


class OptTreeBuilder(TreeBuilder):
    Config = OptTreeConfig
    config: OptTreeConfig

    @property
    def max_nodes(self) -> int:
        return self.config.nodes

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        n, delta = self.config.nodes, self.config.threshold
        tree = DraftTree(root_token)
        frontier = torch.zeros(1, dtype=torch.long)  # [M] the last layer's node ids
        best = 0.0  # E(A) of the best n-node tree so far
        for _ in range(min(self.config.max_depth, max_depth)):
            prop = drafter.expand(tree, frontier, n)  # tokens, q: [M, n]
            phat = tree.phat[frontier][:, None] * prop.q.to(tree.phat)  # [M, n] p̂ of every candidate
            order = torch.argsort(phat.flatten(), descending=True, stable=True)  # [M*n]
            order = order[: min(n, int((phat > 0).sum()))]  # this layer: the n best
            if order.numel() == 0:
                break
            cols = phat.shape[1]
            frontier = tree.add_children(
                frontier[order // cols], prop.tokens.flatten()[order], prop.q.flatten()[order]
            )
            drafted = tree.phat[1:]  # [N-1]
            e = float(drafted.topk(min(n, drafted.numel())).values.sum())  # E(A) of the best n-node tree
            gain, best = e - best, e
            if gain <= delta:
                break
        return tree.select(top_n_by_phat(tree, n))
