"""Builder `chain`: classic speculative decoding, one path of k greedily drafted tokens."""

from __future__ import annotations

import torch

from treespec.interfaces import Drafter, TreeBuilder
from treespec.plugins.configs import ChainConfig
from treespec.sampling import DraftSampling, sampled_expand
from treespec.tree import DraftTree


class ChainBuilder(TreeBuilder):
    """``sample=true`` with temperature > 0: each token is drawn from the draft's distribution instead
    of being its argmax (classic speculative sampling, verified by SpecInfer's rule)."""

    Config = ChainConfig
    config: ChainConfig
    sampling: DraftSampling | None = None

    @property
    def samples_children(self) -> bool:
        return self.config.sample

    def start(self, sampling: DraftSampling | None) -> None:
        self.sampling = sampling if self.config.sample else None

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        tree = DraftTree(root_token)
        node = torch.zeros(1, dtype=torch.long)  # [1] the chain's last node
        for _ in range(min(self.config.k, max_depth)):
            if self.sampling is not None:
                prop = sampled_expand(drafter, tree, node, 1, self.sampling)  # [1, 1] drawn from the draft
            else:
                prop = drafter.expand(tree, node, 1)  # [1, 1]
            if float(prop.q[0, 0]) <= 0.0:
                break
            node = tree.add_children(node, prop.tokens[:, 0], prop.q[:, 0])
        return tree
