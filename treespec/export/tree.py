"""The static trees an engine runs, chosen from treespec's measurements (no torch: plain Python).

Input: ``p[d][r]``, the measured probability that the draft's rank-r child of a node at depth d is
accepted given that node was (``acceptance.py`` measures it; ``d`` = 0 is the root's children), and
optionally the measured cost of a step (``treespec profile``, ``treespec/cost.py``). Under greedy
verification at most one child of a node matches the target's token, so a node whose path from the
root has ranks (r_1 .. r_d) is accepted with probability Π p[i-1][r_i] (Sequoia's objective with
per-depth vectors), and E(A) = Σ over the drafted nodes.

What each engine can run:

* **OPT-Tree's optimum** (``optimal_tree``): the best tree of at most n nodes, any shape. With
  per-depth probabilities the greedy rule is exact: the values Π p along a path never grow from a
  node to its child (p ≤ 1) and ranks are ordered (p[d][r] ≥ p[d][r+1] after ``monotone``), so the
  n largest path values always form a tree (every ancestor and every better-ranked sibling has at
  least the value), and no other n-node tree sums to more.
* **vLLM's tree drafter** (``vllm_tree``): vLLM's tree attention
  (``vllm/v1/attention/backends/tree_attn.py``, ``TreeDrafterParams.from_spec_token_tree``) drafts one
  level per forward with the SAME number of children for every node of a level
  (``child_drafts_per_level``, and ``_assert_fixed_branching_factor_per_level`` refuses other
  shapes), so its trees are products: b_1 children at level 1, b_2 under each of those, .... Then
  E(A) = Σ_L Π_{i ≤ L} (p[i-1][0] + ... + p[i-1][b_i - 1]), and the best product of at most n nodes
  is found by enumeration (n ≤ a few hundred).
* **a chain** (``chain``): vLLM without a tree (vLLM 0.32 has no tree attention), or SGLang topk = 1.
* **SGLang's EAGLE-2 drafting** (``sglang_shape``): ``--speculative-num-steps S`` levels, each
  keeping the ``--speculative-eagle-topk K`` best nodes by path score and expanding each to its K
  best children, then the ``--speculative-num-draft-tokens N`` − 1 best of all drafted nodes (N counts
  the root; ``python/sglang/srt/speculative/eagle_utils.py`` ``organize_draft_results``,
  ``build_tree_kernel_efficient``). ``sglang_tree`` replays that selection on the measured p.

The tree string is vLLM's ``speculative_token_tree``: a Python literal list of rank paths, sorted
breadth-first (by length, then lexicographically), e.g. ``[(0,), (1,), (0, 0)]``; vLLM parses it
with ``ast.literal_eval`` and sorts it the same way.
"""

from __future__ import annotations

import ast
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from treespec.errors import ConfigError

Path = tuple[int, ...]


@dataclass(frozen=True)
class Tree:
    """A static tree: the rank paths of its drafted nodes (root excluded), breadth-first."""

    paths: tuple[Path, ...]
    expected_accepted: float  # E(A) under the measured p

    @property
    def nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)


def monotone(p: Sequence[Sequence[float]]) -> list[list[float]]:
    """``p`` with every depth's vector made non-increasing in the rank (a rank is never worth more
    than a better one: a draft proposes its ranks in order, so an inversion is sampling noise)."""
    out = []
    for row in p:
        row = [min(max(float(x), 0.0), 1.0) for x in row]
        for r in range(1, len(row)):
            row[r] = min(row[r], row[r - 1])
        out.append(row)
    if not out or not out[0]:
        raise ConfigError("the acceptance table is empty: measure it with `treespec export measure`")
    return out


def _p(p: list[list[float]], depth: int, rank: int) -> float:
    """p for a child at ``depth`` (1-based) of ``rank``; deeper than measured: the deepest row."""
    row = p[min(depth - 1, len(p) - 1)]
    return row[rank] if rank < len(row) else 0.0


def value(paths: Sequence[Path], p: Sequence[Sequence[float]]) -> float:
    """E(A) of a tree: Σ over its paths of Π p[depth-1][rank]."""
    q = monotone(p)
    return sum(math.prod(_p(q, i + 1, r) for i, r in enumerate(path)) for path in paths)


def bfs(paths: Sequence[Path]) -> tuple[Path, ...]:
    return tuple(sorted((tuple(x) for x in paths), key=lambda t: (len(t), t)))


def optimal_tree(p: Sequence[Sequence[float]], nodes: int, max_depth: int = 16) -> Tree:
    """OPT-Tree's optimum: the ``nodes`` rank paths of largest value, depth ≤ ``max_depth`` (see the
    module docstring for why taking them greedily from the root is exact)."""
    q = monotone(p)
    chosen: list[Path] = []
    total = 0.0
    heap: list[tuple[float, Path]] = [(-_p(q, 1, 0), (0,))]
    while heap and len(chosen) < nodes:
        neg, path = heapq.heappop(heap)
        if -neg <= 0.0:
            break
        chosen.append(path)
        total += -neg
        d = len(path)
        sibling = path[:-1] + (path[-1] + 1,)
        parent_value = -neg / _p(q, d, path[-1])
        heapq.heappush(heap, (-parent_value * _p(q, d, sibling[-1]), sibling))
        if d < max_depth:
            heapq.heappush(heap, (neg * _p(q, d + 1, 0), path + (0,)))
    return Tree(bfs(chosen), total)


def chain(p: Sequence[Sequence[float]], length: int) -> Tree:
    paths = [(0,) * d for d in range(1, length + 1)]
    return Tree(tuple(paths), value(paths, p))


def product_tree(branching: Sequence[int]) -> tuple[Path, ...]:
    """The tree with ``branching[i]`` children (ranks 0..b-1) under every node of level i."""
    paths: list[Path] = []
    level: list[Path] = [()]
    for b in branching:
        level = [node + (r,) for node in level for r in range(b)]
        paths += level
    return bfs(paths)


def vllm_tree(p: Sequence[Sequence[float]], nodes: int, max_depth: int = 16) -> Tree:
    """The best tree vLLM's tree drafter can run (one branching factor per level) with at most
    ``nodes`` drafted nodes."""
    q = monotone(p)
    best: tuple[float, int, tuple[int, ...]] = (0.0, 0, ())  # (E(A), nodes, branching)

    def grow(branching: tuple[int, ...], used: int, width: int, reach: float, total: float) -> None:
        nonlocal best
        if total > best[0] + 1e-12 or (abs(total - best[0]) <= 1e-12 and used < best[1]):
            best = (total, used, branching)
        depth = len(branching) + 1
        if depth > max_depth:
            return
        row_sum = 0.0
        for b in range(1, nodes + 1):
            if used + width * b > nodes or _p(q, depth, b - 1) <= 0.0:
                break
            row_sum += _p(q, depth, b - 1)
            grow(branching + (b,), used + width * b, width * b, reach * row_sum, total + reach * row_sum)

    grow((), 0, 1, 1.0, 0.0)
    paths = product_tree(best[2])
    return Tree(paths, value(paths, q))


def to_vllm_string(paths: Sequence[Path]) -> str:
    """vLLM's ``speculative_token_tree``: the paths as a Python literal list of tuples, breadth-first."""
    return (
        "["
        + ", ".join(
            "(" + ", ".join(str(r) for r in path) + ("," if len(path) == 1 else "") + ")" for path in bfs(paths)
        )
        + "]"
    )


def parse_vllm_string(text: str) -> tuple[Path, ...]:
    """The paths of a ``speculative_token_tree`` string, as vLLM reads it (``ast.literal_eval``, then
    breadth-first order); a string that is not a tree is one line."""
    try:
        data = ast.literal_eval(text)
    except (ValueError, SyntaxError) as exc:
        raise ConfigError(
            f"speculative_token_tree {text[:60]!r} is not a list of tuples ({type(exc).__name__})"
        ) from None
    if (
        not isinstance(data, (list, tuple))
        or not data
        or not all(isinstance(t, tuple) and t and all(isinstance(r, int) and r >= 0 for r in t) for t in data)
    ):
        raise ConfigError(f"speculative_token_tree {text[:60]!r} must be a non-empty list of tuples of ranks ≥ 0")
    paths = bfs(data)
    have = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in have:
            raise ConfigError(f"speculative_token_tree: {path} has no parent {path[:-1]} in the tree")
    return paths


def uniform_branching(paths: Sequence[Path]) -> bool:
    """Whether every node of a level has the same number of children (what vLLM's tree drafter needs)."""
    children: dict[Path, int] = {}
    for path in paths:
        children[path[:-1]] = children.get(path[:-1], 0) + 1
    by_level: dict[int, set[int]] = {}
    for node in [()] + list(paths):
        by_level.setdefault(len(node), set()).add(children.get(node, 0))
    deepest = max((len(x) for x in paths), default=0)
    return all(len(by_level.get(level, {0})) == 1 for level in range(deepest))


# ------------------------------------------------------------------------------------------- SGLang
def sglang_tree(p: Sequence[Sequence[float]], steps: int, topk: int, draft_tokens: int) -> Tree:
    """The tree SGLang's EAGLE-2 drafting builds on the measured p (module docstring): each of
    ``steps`` levels keeps the ``topk`` best frontier nodes by path score and gives each its ``topk``
    best children; then the ``draft_tokens`` − 1 best drafted nodes are verified."""
    q = monotone(p)
    frontier: list[tuple[float, Path]] = [(1.0, ())]
    drafted: list[tuple[float, Path]] = []
    for depth in range(1, steps + 1):
        children = [(score * _p(q, depth, r), node + (r,)) for score, node in frontier for r in range(topk)]
        children = [c for c in children if c[0] > 0.0]
        drafted += children
        frontier = sorted(children, key=lambda c: (-c[0], c[1]))[:topk]
    best = sorted(drafted, key=lambda c: (-c[0], len(c[1]), c[1]))[: max(draft_tokens - 1, 0)]
    return Tree(bfs([path for _, path in best]), sum(s for s, _ in best))


@dataclass(frozen=True)
class SGLangShape:
    steps: int
    topk: int
    draft_tokens: int  # counts the root, as --speculative-num-draft-tokens does
    tree: Tree
    tokens_per_second: float | None  # predicted, when a cost model is given


def sglang_shape(
    p: Sequence[Sequence[float]],
    nodes: int,
    step_seconds: Callable[[int, int, int], float] | None = None,
    max_steps: int = 8,
    max_topk: int = 8,
) -> SGLangShape:
    """(steps, topk, num-draft-tokens) for a budget of ``nodes`` drafted nodes: the best predicted
    tokens per second if ``step_seconds(verified nodes, steps, topk)`` is given, else the best E(A)
    within the budget; ties go to fewer nodes, then fewer steps, then a smaller topk."""
    best: tuple[float, int, int, int] | None = None  # (score, -nodes, -steps, -topk)
    pick: SGLangShape | None = None
    for steps in range(1, max_steps + 1):
        for topk in range(1, max_topk + 1):
            drafted = topk + (steps - 1) * topk * topk
            sizes = [steps] if topk == 1 else range(1, min(nodes, drafted) + 1)  # topk 1: N = steps + 1 (SGLang)
            for n in sizes:
                if n > nodes:
                    continue
                tree = sglang_tree(p, steps, topk, n + 1)
                rate = (1.0 + tree.expected_accepted) / step_seconds(tree.nodes, steps, topk) if step_seconds else None
                key = (round(rate if rate is not None else tree.expected_accepted, 9), -n, -steps, -topk)
                if best is None or key > best:
                    best, pick = key, SGLangShape(steps, topk, n + 1, tree, rate)
    if pick is None:
        raise ConfigError(f"no SGLang shape fits a budget of {nodes} drafted nodes: give --nodes ≥ 1")
    return pick
