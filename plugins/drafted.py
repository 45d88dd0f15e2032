"""A step's drafted nodes ranked by p̂: the bookkeeping every p̂-driven builder shares.

p̂(n) = Π over the path root → n of the draft's (calibrated) probabilities; the root has p̂ = 1. p̂
never grows along a path, so the n largest p̂ always form a tree (a node's ancestors rank above it),
and the n-node tree of largest expected acceptance Σ p̂ is the root plus those n nodes. Ties go to the
shallower node, then the older one.

    top_by(values, depths, n)         the root and the n best nodes (torch: opt-tree, eagle2)
    Drafted                           numpy p̂ and depths of a tree drafted layer by layer (the auto
                                      planner and a batch's rows: ``cost_aware``, ``batch_budget``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from treespec.acceptance_map import AcceptanceMap
    from treespec.interfaces import Proposals
    from treespec.tree import DraftTree


def top_by(values: torch.Tensor, depths: torch.Tensor, n: int) -> torch.Tensor:
    """The root plus the n drafted nodes with the largest ``values`` (ties: shallower, then older)."""
    ids = torch.arange(1, values.numel())
    ids = ids[torch.argsort(depths[ids], stable=True)]
    ids = ids[torch.argsort(values[ids], descending=True, stable=True)]
    return torch.cat([torch.zeros(1, dtype=torch.long), ids[:n]])


def top_np(values: np.ndarray, depths: np.ndarray, n: int) -> np.ndarray:
    """``top_by`` on numpy arrays: the root plus the n drafted nodes of largest value (ties: shallower, older)."""
    ids = np.arange(1, values.size)
    order = np.lexsort((ids, depths[1:], -values[1:]))  # last key first: value desc, then depth, then id
    return np.concatenate([[0], ids[order[:n]]])


class Drafted:
    """The calibrated p̂ and depth of every node drafted so far, in tree order (index 0: the root, p̂ 1),
    for a tree grown one layer at a time: ``candidates`` prices a layer's proposals, ``add`` appends
    the chosen ones to the tree and to the arrays, ``top`` keeps the best n."""

    def __init__(self, capacity: int):
        """``capacity``: the most nodes the step may draft (the root not counted)."""
        self.phat = np.zeros(capacity + 1)  # [capacity + 1]
        self.phat[0] = 1.0
        self.depths = np.zeros(capacity + 1, dtype=np.int64)  # [capacity + 1]
        self.size = 0  # drafted nodes (the root not counted)

    @property
    def nodes(self) -> tuple[np.ndarray, np.ndarray]:
        """(p̂, depths) of the drafted nodes, the root left out: [size] each."""
        return self.phat[1 : self.size + 1], self.depths[1 : self.size + 1]

    def candidates(
        self, frontier: np.ndarray, q: np.ndarray, depth: int, calibration: AcceptanceMap | None
    ) -> np.ndarray:
        """p̂ of every proposed child, [M·k] in row-major order of ``q`` [M, k]: the parent's p̂ times
        the child's calibrated acceptance (the raw q without a calibration map); padding (q = 0) gets
        0, whatever the map says of the lowest confidences."""
        f = q.astype(np.float64)  # [M, k]
        if calibration is not None:
            f = np.where(q > 0, calibration.lookup(q, depth), 0.0)
        return (self.phat[frontier, None] * f).ravel()  # [M*k]

    def add(
        self,
        tree: DraftTree,
        frontier: np.ndarray,
        prop: Proposals,
        order: np.ndarray,
        depth: int,
        values: np.ndarray,
    ) -> np.ndarray:
        """Append the candidates ``order`` (indices into the flattened [M, k] proposals of ``frontier``)
        with p̂ ``values`` at ``depth``; their tree ids [len(order)]."""
        k, end = prop.q.shape[1], self.size + 1 + order.size
        new = tree.append(frontier[order // k], prop.tokens.numpy().ravel()[order], prop.q.numpy().ravel()[order])
        self.phat[self.size + 1 : end] = values
        self.depths[self.size + 1 : end] = depth
        self.size += int(order.size)
        return new

    def top(self, tree: DraftTree, n: int) -> DraftTree:
        """The tree of the root and the n drafted nodes of largest p̂ (the whole tree if that is all)."""
        if n == self.size:
            return tree
        return tree.select(torch.from_numpy(top_np(self.phat[: self.size + 1], self.depths[: self.size + 1], n)))
