"""Builder `chain`: classic speculative decoding, one path of k greedily drafted tokens."""

from __future__ import annotations

import torch

from treespec.interfaces import Drafter, TreeBuilder
from treespec.plugins.configs import ChainConfig
from treespec.sampling import propose
from treespec.tree import DraftTree


class ChainBuilder(TreeBuilder):
    """``sample=true`` with temperature > 0: each token is drawn from the draft's distribution instead
    of being its argmax (classic speculative sampling, verified by SpecInfer's rule)."""

    Config = ChainConfig
    config: ChainConfig

    @property
    def max_nodes(self) -> int:
        return self.config.k

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        tree = DraftTree(root_token)
        node = torch.zeros(1, dtype=torch.long)  # [1] the chain's last node
        for _ in range(min(self.config.k, max_depth)):
            prop = propose(drafter, tree, node, 1, self.sampling)  # [1, 1] the draft's best, or a draw
            if float(prop.q[0, 0]) <= 0.0:
                break
            node = tree.add_children(node, prop.tokens[:, 0], prop.q[:, 0])
        return tree
