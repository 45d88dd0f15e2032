"""Calibrated p̂: an online map from the draft's confidence q to how often the target accepts.

A node's raw p̂ is the product of the draft's q along its path; builders rank nodes by it and OPT-Tree
sums it into E(A). That is right only if q is calibrated: P(node accepted | parent accepted) = q.
Real drafts are not (an under-trained draft is over-confident, a strong one under-confident), so the
map learns, from every verified tree, how often the target accepts what the draft proposed:

    for every drafted node whose parent was accepted:   outcome = 1 if the node was accepted, else 0
    counts per cell (depth group g, q bucket b): tests n_gb, hits h_gb
    1. a logistic fit of all outcomes (Platt scaling):  m(q) = σ(a · logit q + c), pulled towards the
       identity (a = 1, c = 0) by a weak prior, so it starts as the raw q;
    2. the same per depth group, pulled towards the fit of step 1;
    3. per cell, Beta counts around it:  r_gb = (h_gb + w · m_g(q_b)) / (n_gb + w)
    f(q, depth) = isotonic (non-decreasing in q) fit of r over the buckets of the group, each cell
                  weighted by its tests n_gb (+ ε), read linearly between bucket centres (f(0) = 0)
    calibrated p̂(v) = Π_{u on root→v} f(q(u), depth(u))

Why this shape: two parameters learn fast — a draft that is under-confident everywhere (a raw draft
model) is corrected after a few dozen verified nodes, long before each of 60 cells has its own
evidence — and the cells then fix what a logistic curve cannot (over-confident in one range,
under-confident in another). Counts are exact and cheap (one add per node); the isotonic pass
(pool adjacent violators, weighted by counts) keeps the map monotone, so ranking nodes by calibrated
p̂ still prefers the draft's more confident children. A temperature fit (``treespec calibrate``) is a
one-parameter version of step 1 done offline; the map starts from whatever q the drafter reports.
Depth groups (1, 2, 3+) let deeper nodes, whose draft context holds more drafted tokens, be
calibrated apart. The monotone pass weighs cells by their evidence, not by their prior's pseudo-tests:
a draft whose q takes few values (an n-gram lookup: 1, 1/2, 1/3) fits a steep logistic, whose prior
puts the empty cells just below q = 1 at ≈ 1; weighted as 4 tests each, eight of them pooled with the
q = 1 cell lifted its 80% record to 90%, and a lookup chain of 13 promised twice what it returned.
The fit is redone after 32 new nodes or 5% more evidence, whichever is more.

Only the parent-accepted nodes count: a node whose parent was rejected was never tested.
"""

from __future__ import annotations

import numpy as np
import torch

from treespec.isotonic import isotonic

BUCKETS = 20
DEPTH_GROUPS = 3  # depth 1, 2, >= 3
PRIOR_WEIGHT = 4.0  # w: pseudo-tests of a cell's prior (the logistic fit)
EMPTY_WEIGHT = 1e-3  # a cell's weight in the monotone pass beyond its tests (its prior decides empty runs)
PLATT_PRIOR = 2.0  # pseudo-weight pulling a logistic fit towards its centre (the identity, or the shared fit)
REFIT_MIN, REFIT_SHARE = 32, 0.05  # refit after 32 new nodes or 5% more evidence, whichever is more
LUT = 1024  # f is read from a table of LUT + 2 points per depth group (one index per node)
CENTRES = np.concatenate([(np.arange(LUT) + 0.5) / LUT, [1.0, 1.0]])  # q at which the table holds f
IDENTITY = (1.0, 0.0)  # σ(1 · logit q + 0) = q


class AcceptanceMap:
    """f(q, depth): calibrated conditional acceptance (see the module docstring)."""

    def __init__(self) -> None:
        self._mids = (np.arange(BUCKETS) + 0.5) / BUCKETS  # [B] bucket centres
        self._theta = [IDENTITY] * (DEPTH_GROUPS + 1)  # the logistic fits (shared, then per group): warm starts
        self.hits = np.zeros((DEPTH_GROUPS, BUCKETS))  # [G, B] accepted nodes, as of the last fit
        self.tests = np.zeros((DEPTH_GROUPS, BUCKETS))  # [G, B] tested nodes, as of the last fit
        self.observed = 0  # nodes seen
        self.unfitted = 0  # nodes seen since the last fit
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (q, depths, accepted) not yet counted
        self.table = self._fit()  # [G, B]

    def _fit(self) -> torch.Tensor:
        x = np.log(self._mids / (1 - self._mids))  # [B] logit of the bucket centres
        hits, tests = self.hits, self.tests
        self._theta[0] = shared = _platt(x, hits.sum(0), tests.sum(0), IDENTITY, self._theta[0])
        rows = []
        for g in range(DEPTH_GROUPS):
            self._theta[g + 1] = a, c = _platt(x, hits[g], tests[g], shared, self._theta[g + 1])
            prior = _sigmoid(a * x + c)  # [B] m_g(q_b)
            rates = (hits[g] + PRIOR_WEIGHT * prior) / (tests[g] + PRIOR_WEIGHT)
            rows.append(isotonic(rates.tolist(), (tests[g] + EMPTY_WEIGHT).tolist()))
        table = np.array(rows)  # [G, B]
        # f at the centres of the 1/LUT cells of q (read by truncation: one index op per node), and at
        # q = 1 once more, so that a q a rounding above 1 still has a cell
        anchors = np.concatenate([[0.0], self._mids])  # f(0) = 0, then the bucket centres
        self._lut_np = np.stack(
            [np.interp(CENTRES, anchors, np.concatenate([[0.0], row])) for row in table]
        )  # [G, LUT+2]
        return torch.from_numpy(table)

    def __call__(self, q: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional acceptance of nodes with draft confidence ``q`` [N] at ``depths`` [N]."""
        return torch.from_numpy(self.values(q.detach().cpu().double().numpy(), depths.cpu().numpy()))  # [N] float64

    def values(self, q: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """``f`` for arrays of confidences ``q`` and ``depths`` of shapes that broadcast (numpy: a drafter's
        hot path, where a dozen torch calls on a few numbers cost more than the arithmetic)."""
        groups = np.minimum(np.maximum(depths.astype(np.int64) - 1, 0), DEPTH_GROUPS - 1)  # [...]
        cell = np.minimum(np.maximum(q.astype(np.float64), 0.0), 1.0) * LUT  # [...] q's 1/LUT cell
        return self._lut_np[groups, cell.astype(np.int64)]  # [...] float64

    def lookup(self, q: np.ndarray, depth: int) -> np.ndarray:
        """``f`` for an array of confidences ``q`` at one ``depth`` (numpy, for planners' inner loops)."""
        return self.values(q, np.asarray(depth))

    def update(self, q: np.ndarray, depths: np.ndarray, accepted: np.ndarray) -> None:
        """Record outcomes of tested nodes: confidences ``q`` [N], ``depths`` [N], ``accepted`` [N] bool, for
        nodes whose parent was accepted (numpy arrays, or tensors on the CPU). They are counted into
        ``hits`` / ``tests`` at the next refit, the counts' only reader."""
        # copies: they wait for the next fit, and a caller's tensor may change meanwhile
        q, depths, accepted = np.array(q, dtype=np.float64), np.array(depths), np.array(accepted)
        if q.size == 0:
            return
        self._pending.append((q, depths, accepted))  # counted at the next fit: one bincount for many steps
        self.observed += int(q.size)
        self.unfitted += int(q.size)
        if self.unfitted >= max(REFIT_MIN, REFIT_SHARE * self.observed):  # refit as often as new evidence matters
            self._count()
            self.table = self._fit()
            self.unfitted = 0

    def _count(self) -> None:
        """Add the pending outcomes to ``hits`` and ``tests`` (the fit's only input)."""
        if not self._pending:
            return
        q, depths, accepted = (np.concatenate(parts) for parts in zip(*self._pending))  # [N] each
        self._pending = []
        buckets = np.minimum((np.clip(q, 0, 1) * BUCKETS).astype(np.int64), BUCKETS - 1)  # [N]
        groups = np.clip(depths.astype(np.int64) - 1, 0, DEPTH_GROUPS - 1)  # [N]
        flat = groups * BUCKETS + buckets  # [N]
        cells = DEPTH_GROUPS * BUCKETS
        self.tests += np.bincount(flat, minlength=cells).reshape(DEPTH_GROUPS, BUCKETS)
        self.hits += np.bincount(flat, weights=accepted.astype(np.float64), minlength=cells).reshape(
            DEPTH_GROUPS, BUCKETS
        )

    def learn(self, tree: object, path: torch.Tensor) -> None:
        """Learn from one verified tree: ``path`` [m+1] = the accepted node ids, root first."""
        if len(tree) == 1:  # type: ignore[arg-type]  # the root alone: nothing was tested
            return
        parents = tree.parents.numpy()  # type: ignore[attr-defined]  # [N]
        on_path = np.zeros(parents.size, dtype=np.bool_)  # [N]
        on_path[path.cpu().numpy()] = True
        tested = on_path[np.maximum(parents, 0)]  # [N] the parent was accepted
        tested[0] = False  # the root is no draft
        self.update(tree.q.numpy()[tested], tree.depths.numpy()[tested], on_path[tested])  # type: ignore[attr-defined]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """σ(z) = 1 / (1 + e^-z), written as (1 + tanh(z/2)) / 2: the same values, and no overflow warning
    where a steep fit sends |z| past 709 (e^-z would be inf there; σ saturates to 0 or 1 either way)."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _platt(
    x: np.ndarray,
    hits: np.ndarray,
    tests: np.ndarray,
    centre: tuple[float, float],
    start: tuple[float, float],
    steps: int = 4,
) -> tuple[float, float]:
    """(a, c) of σ(a·x + c) fitted to ``hits``/``tests`` at logits ``x`` (weighted logistic regression,
    Newton's method from ``start``), with a Gaussian prior of weight PLATT_PRIOR around ``centre``:
    no data, the centre. The objective is convex, so a warm start converges in a few steps."""
    a, c = start
    ca, cc = centre
    for _ in range(steps):
        p = _sigmoid(a * x + c)  # [B]
        r, v = tests * p - hits, tests * p * (1 - p)  # residuals and Newton weights
        ga, gc = float(r @ x) + PLATT_PRIOR * (a - ca), float(r.sum()) + PLATT_PRIOR * (c - cc)
        haa, hac, hcc = float(v @ (x * x)) + PLATT_PRIOR, float(v @ x), float(v.sum()) + PLATT_PRIOR
        det = haa * hcc - hac * hac
        a, c = a - (hcc * ga - hac * gc) / det, c - (haa * gc - hac * ga) / det
    return a, c
