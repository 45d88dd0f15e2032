"""Per-part calibration of a composed drafter: each part's q mapped to how often the target takes
that part's proposals.

The parts of a composition mean different things by q. An EAGLE head's q is a softmax; an n-gram
lookup's is a match count (with ``prior=0`` its share of the matches, so one earlier occurrence
gives q = 1 whether or not the text repeats). Merged into one tree, a single map from q to
acceptance (the builder's, ``acceptance_map``) sees both kinds of q = 1 in one bucket and can
calibrate neither (that was with the raw share): measured on SmolLM2 with its head
and prompt lookup, the planner's E(A) was 0.71–0.83× what was accepted on 1–2-node trees and 1.78×
on trees of 6 or more nodes. So each part gets its own map, and the merge compares calibrated
values:

    q̃_i(t | node) = f_i(q_i(t | node), depth)        f_i: part i's AcceptanceMap
    merge=max:  q(t | node) = max_i q̃_i(t | node)     padding (q_i = 0) stays 0

What each map learns: every candidate part i proposed below a node that the target then accepted
(a node on the committed path, the root included) is one outcome, a hit iff its token is the token
the target committed after that node. That is P(child accepted | parent accepted), the factor p̂
multiplies, and under greedy verification it is known for all k candidates a part proposed there,
not only for those the builder kept in the verified tree. The drafter learns it from ``commit``
(accepted tokens + bonus) alone, so no builder or step has to report anything.

The merged children of a node are exclusive events: the target takes one token there, so at most
one child is accepted and their acceptance probabilities sum to at most 1. Calibrated parts can break
that (a lookup's continuation and the head's different guess, each right 60% of the time on its own
record, would promise 1.2 accepted children), and E(A) sums it: so the merged q of a node's children
are scaled down to sum to 1 where they sum to more (``exclusive``).

Rows of a batch are forks: they share the maps (more evidence, one calibration) and keep their own
step's record of what was asked.
"""

from __future__ import annotations

import numpy as np
import torch

from treespec.acceptance_map import AcceptanceMap
from treespec.interfaces import Proposals
from treespec.tree import DraftTree

MIN_Q = 1e-6  # a proposal stays a proposal: a calibrated q never rounds down to padding (q = 0)


class PartCalibration:
    """Part i's q → its calibrated conditional acceptance (see the module docstring)."""

    def __init__(self, parts: int, maps: list[AcceptanceMap] | None = None):
        self.maps = maps if maps is not None else [AcceptanceMap() for _ in range(parts)]
        # this step's candidates: path below the root -> part -> (tokens [k], raw q [k], depth)
        self.asked: dict[tuple[int, ...], dict[int, tuple[np.ndarray, np.ndarray, int]]] = {}

    def fork(self) -> PartCalibration:
        """A batch row's view: the same maps, its own record of the step."""
        return PartCalibration(len(self.maps), self.maps)

    def begin_step(self) -> None:
        self.asked = {}

    def apply(self, tree: DraftTree, nodes: torch.Tensor, props: list[Proposals]) -> list[Proposals]:
        """Each part's proposals for ``nodes`` [M] with q replaced by its calibrated value; records them
        so that ``learn`` can score them once the step is committed."""
        index = nodes.detach().cpu().long().numpy()  # [M]
        depths = tree.depths.numpy()[index] + 1  # [M] the children's depth
        depth_of = depths.tolist()
        keys = [tuple(path) for path in tree.suffixes(index.tolist())]
        out = []
        for i, p in enumerate(props):
            raw = p.q.detach().cpu().double().numpy()  # [M, k]
            toks = p.tokens.detach().cpu().long().numpy()  # [M, k]
            valid = raw > 0  # [M, k]
            cal = self.maps[i].values(raw, depths[:, None])  # [M, k]
            cal = np.where(valid, np.maximum(cal, MIN_Q), 0.0)
            out.append(Proposals(tokens=p.tokens, q=torch.from_numpy(cal).to(p.q.dtype)))
            for m, key in enumerate(keys):
                if valid[m].any():
                    self.asked.setdefault(key, {})[i] = (toks[m][valid[m]], raw[m][valid[m]], depth_of[m])
        return out

    def learn(self, tokens: list[int]) -> None:
        """Score this step's candidates against the committed ``tokens`` (accepted drafts, then the
        bonus): below the path's j-th node the target took ``tokens[j]``."""
        found: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        for j, taken in enumerate(tokens):
            for i, (toks, raw, depth) in self.asked.get(tuple(tokens[:j]), {}).items():
                found.setdefault(i, []).append((raw, np.full(raw.shape, depth), toks == taken))
        for i, outcomes in found.items():
            q, depth, hit = (np.concatenate(col) for col in zip(*outcomes))
            self.maps[i].update(q, depth, hit)
        self.asked = {}


def exclusive(merged: Proposals) -> Proposals:
    """A node's children as exclusive events: q_j ← q_j / max(1, Σ_j q_j) per row (the ranking is kept)."""
    total = merged.q.sum(dim=1, keepdim=True)  # [M, 1]
    return Proposals(tokens=merged.tokens, q=merged.q / total.clamp(min=1.0))  # [M, k]
