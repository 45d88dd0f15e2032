"""Verifiers: which path of the tree the target accepts, and its bonus token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.tree import TreeTensors


@dataclass(frozen=True)
class Acceptance:
    nodes: torch.Tensor  # [m+1] long: the root and the m accepted nodes, in path order
    tokens: list[int]  # the m accepted draft tokens
    bonus: int  # the target's own token after the accepted path

    @property
    def accepted(self) -> int:
        return len(self.tokens)


def greedy_verify(tt: TreeTensors, logits: torch.Tensor) -> Acceptance:
    """The longest root-to-node path whose every token equals the target's argmax at its parent,
    plus the target's argmax after that path.

    logits: [N, V], row i = the target's logits after node i's path.
    """
    best_next = logits.argmax(dim=-1)  # [N] the target's token after each node
    tokens = tt.input_ids.to(best_next.device)  # [N]
    parents = tt.parents.to(best_next.device).clamp(min=0)  # [N]
    ok = tokens == best_next[parents]  # [N] node i is what the target would say after its parent
    ok[0] = True  # the root is committed
    anc = tt.ancestors.to(best_next.device)  # [N, N]
    path_ok = ~(anc & ~ok[None, :]).any(dim=-1)  # [N] every node on the path is ok
    depths = torch.where(path_ok, tt.depths.to(best_next.device), -1)  # [N]
    best = int(depths.argmax())  # deepest fully accepted node (at most one per depth in greedy)
    nodes = anc[best].nonzero().flatten()  # ids ascend along a path: root ... best
    return Acceptance(nodes=nodes, tokens=tokens[nodes[1:]].tolist(), bonus=int(best_next[best]))
