"""Calibrated p̂: an online map from the draft's confidence q to how often the target accepts.

A node's raw p̂ is the product of the draft's q along its path; builders rank nodes by it and OPT-Tree
sums it into E(A). That is right only if q is calibrated: P(node accepted | parent accepted) = q.
Real drafts are not (an under-trained draft is over-confident, a strong one under-confident), so the
map learns, from every verified tree, the acceptance rate per confidence bucket:

    for every drafted node whose parent was accepted:   outcome = 1 if the node was accepted, else 0
    cell (depth group g, q bucket b):  Beta(a, b) counts, prior a0 = w q_b, b0 = w (1 - q_b)
    f(q, depth) = isotonic (non-decreasing in q) fit of a / (a + b) over the buckets of the group,
                  read linearly between bucket centres (f(0) = 0, flat above the last centre)
    calibrated p̂(v) = Π_{u on root→v} f(q(u), depth(u))

Why Beta counts + isotonic: counts are exact and cheap to update (one add per node), the prior makes
an unseen bucket answer the raw q (so the map starts as the identity and never does worse than no
map until data says so), and the isotonic pass (pool adjacent violators, weighted by counts) keeps the
map monotone, so ranking nodes by calibrated p̂ still prefers the draft's more confident children.
A temperature fit (``treespec calibrate``) is a one-parameter version of the same; the map starts
from whatever q the drafter reports, so an offline fit is its starting point. Depth groups (1, 2, 3+)
let deeper nodes, whose draft context holds more drafted tokens, be calibrated apart.

Only the parent-accepted nodes count: a node whose parent was rejected was never tested.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treespec.isotonic import isotonic

if TYPE_CHECKING:
    import numpy as np

BUCKETS = 20
DEPTH_GROUPS = 3  # depth 1, 2, >= 3
PRIOR_WEIGHT = 4.0
REFIT_MIN, REFIT_SHARE = 32, 0.05  # refit after 32 new nodes or 5% more evidence, whichever is more
LUT = 1024  # f is read from a table of LUT + 1 points per depth group (one index per node)


class AcceptanceMap:
    """f(q, depth): calibrated conditional acceptance (see the module docstring)."""

    def __init__(self) -> None:
        mids = (torch.arange(BUCKETS, dtype=torch.float64) + 0.5) / BUCKETS  # [B] bucket centres
        self.accepted = (PRIOR_WEIGHT * mids).repeat(DEPTH_GROUPS, 1)  # [G, B] a
        self.tried = torch.full((DEPTH_GROUPS, BUCKETS), PRIOR_WEIGHT, dtype=torch.float64)  # [G, B] a + b
        self.observed = 0  # nodes seen
        self.unfitted = 0  # nodes seen since the last fit
        self.table = self._fit()  # [G, B]

    def _fit(self) -> torch.Tensor:
        rates = (self.accepted / self.tried).tolist()
        weights = self.tried.tolist()
        table = torch.tensor([isotonic(r, w) for r, w in zip(rates, weights)], dtype=torch.float64)  # [G, B]
        self.lut = self._interpolate(table, torch.linspace(0, 1, LUT + 1, dtype=torch.float64))  # [G, LUT+1]
        self._lut_np = self.lut.numpy()
        return table

    @staticmethod
    def _interpolate(table: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """f at ``q`` [Q] for every group: linear between bucket centres, f(0) = 0. Returns [G, Q]."""
        x = q * BUCKETS - 0.5  # [Q] position in bucket-centre units
        left = x.floor().long().clamp(-1, BUCKETS - 1)  # [Q] centre at or below x (-1: the anchor f(0) = 0)
        right = (left + 1).clamp(max=BUCKETS - 1)
        frac = (x - left).clamp(0, 1)
        padded = torch.cat([torch.zeros(table.shape[0], 1, dtype=table.dtype), table], dim=1)  # [G, B+1]
        y_left, y_right = padded[:, left + 1], table[:, right]
        return y_left + frac * (y_right - y_left)

    @staticmethod
    def _cells(q: torch.Tensor, depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buckets = (q.double().clamp(0, 1) * BUCKETS).long().clamp(max=BUCKETS - 1)  # [N]
        groups = (depths.long() - 1).clamp(0, DEPTH_GROUPS - 1)  # [N]
        return groups, buckets

    def __call__(self, q: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional acceptance of nodes with draft confidence ``q`` [N] at ``depths`` [N]."""
        groups = (depths.long() - 1).clamp(0, DEPTH_GROUPS - 1)  # [N]
        index = (q.double().clamp(0, 1) * LUT).round().long()  # [N] a 1/LUT grid: the lookup table of _fit
        return self.lut[groups, index]  # [N] float64

    def lookup(self, q: "np.ndarray", depth: int) -> "np.ndarray":
        """``f`` for an array of confidences ``q`` at one ``depth`` (numpy, for planners' inner loops)."""
        import numpy as np

        table = self._lut_np[min(max(depth, 1), DEPTH_GROUPS) - 1]  # [LUT+1]
        return table[np.minimum((q * LUT + 0.5).astype(np.int64), LUT)]  # q >= 0: a probability

    def update(self, q: torch.Tensor, depths: torch.Tensor, accepted: torch.Tensor) -> None:
        """Count outcomes of tested nodes: ``accepted`` [N] bool, for nodes whose parent was accepted."""
        if q.numel() == 0:
            return
        groups, buckets = self._cells(q, depths)
        flat = groups * BUCKETS + buckets  # [N]
        self.tried.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        self.accepted.view(-1).index_add_(0, flat, accepted.to(torch.float64))
        self.observed += int(q.numel())
        self.unfitted += int(q.numel())
        if self.unfitted >= max(REFIT_MIN, REFIT_SHARE * self.observed):  # refit as often as new evidence matters
            self.table = self._fit()
            self.unfitted = 0

    def learn(self, tree: "object", path: torch.Tensor) -> None:
        """Learn from one verified tree: ``path`` [m+1] = the accepted node ids, root first."""
        if len(tree) == 1:  # type: ignore[arg-type]  # the root alone: nothing was tested
            return
        parents = tree.parents  # type: ignore[attr-defined]
        on_path = torch.zeros(len(parents), dtype=torch.bool)  # [N]
        on_path[path.cpu()] = True
        tested = on_path[parents.clamp(min=0)]  # [N] the parent was accepted
        tested[0] = False  # the root is no draft
        self.update(tree.q[tested], tree.depths[tested], on_path[tested])  # type: ignore[attr-defined]
