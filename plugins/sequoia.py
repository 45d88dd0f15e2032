"""Builder `sequoia`: the optimal *static* tree for a measured per-rank acceptance vector.

Sequoia (Chen et al. 2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding",
arXiv 2402.12374) fixes the tree's shape once, from an acceptance vector p = [p_0, p_1, ...]:
p_r is the probability that the target accepts the draft's r-th ranked child of an accepted node.
Under greedy verification the siblings of a node are mutually exclusive (at most one child matches
the target's token), so a node at rank path (r_1 .. r_d) is accepted with probability Π p_{r_i} and

    E(A) = Σ over drafted nodes of Π p_{r_i}          (the expected number of accepted draft tokens)

Dynamic programming over subtree sizes (``optimal_shapes``). With E(m, d) the best value of a
subtree of EXACTLY m nodes (root included, counted as 1) and depth ≤ d,

    E(1, d)  = 1,    E(m, 0) = −∞ for m > 1
    E(m, d)  = 1 + G_0(m − 1)                                    (d ≥ 1)
    G_r(0)   = 0,    G_R(b) = −∞ for b > 0
    G_r(b)   = max_{1 ≤ j ≤ b}  p_r · E(j, d − 1) + G_{r+1}(b − j)  (b ≥ 1)

G_r is a knapsack over ranks: children take the first c ranks (rank r only if ranks < r are used),
and rank r's subtree gets j of the remaining b nodes. The best tree of budget n and depth ≤ D is the
best E(m, D) over m ≤ n + 1, the smallest such m on ties (a node that adds nothing, e.g. one whose
acceptance rounds away, costs verification work for nothing). Ranks beyond the vector have p = 0;
trailing zeros are dropped, and a tree never has more than n children per node, so R ≤ min(len p, n).

Cost: O(D · R · n²) time (each (d, r) is one [n+1, n] max-plus convolution, vectorised), O(D · R · n)
memory for the argmax table; n = 60, D = 10, R = 16 takes a few milliseconds. The table of one solve
also gives the best tree of every smaller depth, which ``build`` uses when the Decoder caps the depth
near ``max_new_tokens`` or the end of the context.

``build`` only walks the cached shape: layer by layer, one ``drafter.expand`` per depth with k = 1 +
the largest rank wanted at that depth, keeping the ranked children the shape asks for. A proposal
with q = 0 (padding: the drafter has fewer candidates) is skipped together with its subtree.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from treespec.errors import ConfigError
from treespec.export.tree import Path as RankPath
from treespec.export.tree import Tree as SequoiaShape  # a static tree: rank paths by depth then rank, and its E(A)
from treespec.files import read_json
from treespec.interfaces import Drafter, TreeBuilder
from treespec.plugins.configs import SequoiaConfig
from treespec.plugins.static import grow, shape_layers
from treespec.tree import DraftTree

MEASURE_HINT = "make one with `treespec sequoia-measure --target T --drafter D --out FILE`"


# ---------------------------------------------------------------------------------------- acceptance
def load_acceptance(value: str | Path | Sequence[float]) -> tuple[float, ...]:
    """The acceptance vector from a list of floats, a JSON list written inline (``"[0.5, 0.2]"``, as a
    command line gives it), or a JSON file: ``{"acceptance": [...], ...}`` (``sequoia-measure``'s
    output) or a bare list. Problems are one-line ``ConfigError``s."""
    source = "acceptance"
    if isinstance(value, (str, Path)):
        text = str(value).strip()
        if isinstance(value, str) and text.startswith("["):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"sequoia: acceptance {text!r} is not a JSON list of numbers ({exc.msg})") from None
        else:
            path = Path(text).expanduser()
            source = f"acceptance file {path}"
            data = read_json(path, "sequoia: acceptance file", MEASURE_HINT, kind=None)
            if isinstance(data, dict):
                if "acceptance" not in data:
                    raise ConfigError(f"sequoia: {source} has no 'acceptance' list; {MEASURE_HINT}")
                data = data["acceptance"]
    else:
        data = value
    if not isinstance(data, (list, tuple)) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in data
    ):
        raise ConfigError(f"sequoia: {source} must be a list of numbers in [0, 1], got {str(data)[:80]}")
    if not data:
        raise ConfigError(f"sequoia: {source} is empty; give at least p_0 (e.g. [0.6, 0.15, 0.05])")
    for r, x in enumerate(data):
        if not (math.isfinite(x) and 0.0 <= x <= 1.0):
            raise ConfigError(f"sequoia: {source}: p_{r} = {x} is not a probability in [0, 1]")
    return tuple(float(x) for x in data)


# ---------------------------------------------------------------------------------------- the DP
def shape_value(paths: Sequence[RankPath], acceptance: Sequence[float]) -> float:
    """Σ over the paths of Π p_r (ranks beyond the vector count as p = 0)."""
    total = 0.0
    for path in paths:
        prod = 1.0
        for r in path:
            prod *= acceptance[r] if r < len(acceptance) else 0.0
        total += prod
    return total


@functools.lru_cache(maxsize=64)
def optimal_shapes(acceptance: tuple[float, ...], nodes: int, max_depth: int) -> tuple[SequoiaShape, ...]:
    """The best tree of at most ``nodes`` drafted nodes for every depth limit 0..max_depth
    (index d: depth ≤ d), from one DP solve. Memoised per (vector, nodes, max_depth)."""
    if nodes < 0 or max_depth < 0:
        raise ValueError("nodes and max_depth must be ≥ 0")
    p = list(acceptance)
    while p and p[-1] <= 0.0:
        p.pop()  # trailing zeros: such ranks never help
    n_ranks = min(len(p), nodes)
    depth = min(max_depth, nodes)  # deeper than n nodes is impossible
    size = nodes + 1  # subtree sizes 1..size (root included); index 0 unused
    neg = -math.inf
    E = torch.full((depth + 1, size + 1), neg, dtype=torch.float64)  # E[d, m]: exactly m nodes
    E[:, 1] = 1.0
    # choice[d, r, b]: the size of rank r's subtree when b nodes go to ranks ≥ r at depth d (0: none)
    choice = torch.zeros((depth + 1, max(n_ranks, 1), size), dtype=torch.long)
    b = torch.arange(size)[:, None]  # [S, 1] nodes left for ranks ≥ r
    j = torch.arange(1, size)[None, :]  # [1, S-1] nodes given to rank r
    rest = (b - j).clamp(min=0)  # [S, S-1] nodes left for ranks > r
    fits = j <= b  # [S, S-1]
    for d in range(1, depth + 1):
        sub = E[d - 1, 1:size]  # [S-1] best subtree of exactly j nodes, depth ≤ d-1
        G = torch.full((size,), neg, dtype=torch.float64)  # G_R
        G[0] = 0.0
        for r in reversed(range(n_ranks)):
            gain = torch.where(torch.isfinite(sub), p[r] * sub.clamp(min=0.0), neg)  # [S-1] (no 0·∞)
            cand = torch.where(fits, gain[None, :] + G[rest], neg)  # [S, S-1]
            best, arg = cand.max(dim=1)  # [S] (first index on ties: the smaller subtree)
            best[0] = 0.0
            choice[d, r] = torch.where(torch.isfinite(best), arg + 1, 0)
            choice[d, r, 0] = 0
            G = best
        E[d, 1:] = 1.0 + G  # E(m) = 1 + G_0(m - 1)

    def rebuild(d: int, m: int, prefix: RankPath, out: list[RankPath]) -> None:
        left, r = m - 1, 0
        while left > 0:
            k = int(choice[d, r, left])
            out.append(prefix + (r,))
            rebuild(d - 1, k, prefix + (r,), out)
            left, r = left - k, r + 1

    shapes = []
    for d in range(depth + 1):
        row = E[d, 1:]  # [S] m = 1..S
        m = int(torch.argmax(row)) + 1  # first maximum: the fewest nodes
        paths: list[RankPath] = []
        rebuild(d, m, (), paths)
        paths.sort(key=lambda path: (len(path), path))
        shapes.append(SequoiaShape(tuple(paths), float(row[m - 1]) - 1.0))
    shapes += [shapes[-1]] * (max_depth - depth)
    return tuple(shapes)


def optimal_shape(acceptance: Sequence[float], nodes: int, max_depth: int) -> SequoiaShape:
    """The best tree of at most ``nodes`` drafted nodes and depth ≤ ``max_depth``."""
    return optimal_shapes(tuple(float(x) for x in acceptance), nodes, max_depth)[-1]


class SequoiaBuilder(TreeBuilder):
    Config = SequoiaConfig
    config: SequoiaConfig

    def __init__(self, config: SequoiaConfig):
        super().__init__(config)
        self.acceptance = load_acceptance(config.acceptance)
        self.shapes = optimal_shapes(self.acceptance, config.nodes, config.max_depth)  # per depth cap
        self._layers: dict[int, list] = {}  # depth cap -> the walk of that cap's optimal shape

    @property
    def shape(self) -> SequoiaShape:
        """The tree built when the Decoder does not cap the depth."""
        return self.shapes[-1]

    @property
    def max_nodes(self) -> int:
        return self.config.nodes

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        d = max(0, min(max_depth, self.config.max_depth))
        if d not in self._layers:
            self._layers[d] = shape_layers([list(p) for p in self.shapes[d].paths])  # sorted: depth, path
        return grow(self._layers[d], drafter, root_token, d, self.sampling)
