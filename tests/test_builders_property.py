"""Property tests of the tree builders on a synthetic drafter, against brute force and against
independent plain-Python re-implementations of each builder's rule.

The drafter's next-token distribution over a tiny vocabulary (V = 2..4) is an arbitrary deterministic
function of the path (a hash of a hypothesis-drawn seed and the path's tokens). On purpose it often
has ties (small integer weights), exact zeros, q = 1 (a child whose p̂ ties its parent's) and dead
ends (nothing to propose), so every tie-breaking rule is exercised.

The *candidate tree* is every path of length ≤ D that the drafter proposes (q > 0): at most
4 + 16 + 64 nodes. Its p̂ are computed here exactly as ``DraftTree`` computes them (float32 products
of the float32 q), so a builder's tree is checked node by node against it. The optimum E* is found by
enumerating every connected subtree that contains the root (``subtree_options``), itself checked
against a plain enumeration of parent-closed subsets on small trees.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import random
import struct
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treespec
from treespec import DraftTree, Proposals
from treespec.config import PluginConfig
from treespec.factory import make_builder


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - missing, or being written right now
        return False
    return True


HAS_STATIC = _importable("treespec.plugins.static")
HAS_SEQUOIA = _importable("treespec.plugins.sequoia")


def settings_(n: int):
    return settings(deadline=None, max_examples=n, suppress_health_check=[HealthCheck.too_slow])


TOL = 1e-6
PAD_TOKEN = 1000  # padding entries carry a token outside the vocabulary: a builder adding one fails the checks


# ------------------------------------------------------------------------------------ the drafter
def f32(x: float) -> float:
    """Round to float32. The product of two float32 values is exact in float64, so
    f32(a * b) is the correctly rounded float32 product, as torch computes it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def path_distribution(seed: int, vocab: int, path: tuple[int, ...]) -> list[float]:
    """q(token | path) for every token: float32 values in [0, 1], all zero for a dead end."""
    digest = hashlib.blake2b(f"{seed}:{vocab}:{path}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    u = rng.random()
    if u < 0.06:
        weights = [0.0] * vocab  # dead end: the drafter has nothing to propose
    elif u < 0.16:
        weights = [0.0] * vocab
        weights[rng.randrange(vocab)] = 1.0  # q = 1: the child's p̂ equals its parent's
    elif u < 0.6:
        weights = [float(rng.choice([0, 1, 1, 2, 2, 3, 4])) for _ in range(vocab)]  # ties and zeros
    else:
        weights = [rng.random() if rng.random() > 0.15 else 0.0 for _ in range(vocab)]
    if u >= 0.06 and sum(weights) == 0:
        weights[rng.randrange(vocab)] = 1.0
    total = sum(weights) or 1.0
    return [min(1.0, f32(w / total)) for w in weights]


class PathDrafter(treespec.Drafter):
    """Proposes, for a node, the tokens with q > 0 by decreasing q (ties: smaller token first), padded
    with q = 0. Records every ``expand`` call as (paths of the requested nodes, k)."""

    def __init__(self, seed: int, vocab: int):
        super().__init__(PluginConfig(), target=None)
        self.seed, self.vocab = seed, vocab
        self.calls: list[tuple[list[tuple[int, ...]], int]] = []
        self.tree: DraftTree | None = None

    def ranked(self, path: tuple[int, ...]) -> list[tuple[int, float]]:
        q = path_distribution(self.seed, self.vocab, path)
        return sorted(((t, q[t]) for t in range(self.vocab) if q[t] > 0), key=lambda tq: (-tq[1], tq[0]))

    def prefill(self, context) -> None:
        pass

    def commit(self, commit) -> None:
        pass

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        if self.tree is None:
            self.tree = tree
        assert tree is self.tree, "a builder must grow ONE append-only tree per step"
        ids = nodes.tolist()
        assert k >= 1 and len(set(ids)) == len(ids) and all(0 <= i < len(tree) for i in ids), (ids, k)
        paths = [tuple(tree.path_tokens(i)) for i in ids]
        self.calls.append((paths, k))
        tokens = torch.full((len(ids), k), PAD_TOKEN, dtype=torch.long)
        q = torch.zeros(len(ids), k, dtype=torch.float32)
        for row, path in enumerate(paths):
            for col, (tok, qq) in enumerate(self.ranked(path)[:k]):
                tokens[row, col], q[row, col] = tok, qq
        return Proposals(tokens, q)


# ------------------------------------------------------------------------------------ the candidate tree
@dataclass
class Candidates:
    """Every path of length ≤ depth the drafter proposes. Node 0 is the root."""

    paths: list[tuple[int, ...]] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    phat: list[float] = field(default_factory=list)  # float32 values, as DraftTree computes them
    children: list[list[int]] = field(default_factory=list)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)

    def add(self, path: tuple[int, ...], parent: int, phat: float) -> int:
        i = len(self.paths)
        self.paths.append(path)
        self.parent.append(parent)
        self.phat.append(phat)
        self.children.append([])
        self.index[path] = i
        if parent >= 0:
            self.children[parent].append(i)
        return i


def candidate_tree(drafter: PathDrafter, root: int, depth: int) -> Candidates:
    cand = Candidates()
    layer = [cand.add((root,), -1, 1.0)]
    for _ in range(depth):
        nxt = []
        for v in layer:
            for tok, q in drafter.ranked(cand.paths[v]):
                nxt.append(cand.add(cand.paths[v] + (tok,), v, f32(cand.phat[v] * q)))
        layer = nxt
    return cand


def subtree_options(cand: Candidates, v: int, budget: int, memo: dict) -> list[tuple[int, float]]:
    """(size, Σ p̂ of its drafted nodes) of EVERY connected subtree rooted at v with at most
    ``budget`` nodes, v included (the root's p̂ is not counted). Each subtree is listed exactly once:
    for each child in turn it either leaves the child out or takes one subtree rooted at it."""
    key = (v, budget)
    if key not in memo:
        options = [(1, cand.phat[v] if v else 0.0)]
        if budget > 1:
            for c in cand.children[v]:
                sub = subtree_options(cand, c, budget - 1, memo)
                options = options + [(s1 + s2, e1 + e2) for s1, e1 in options for s2, e2 in sub if s1 + s2 <= budget]
        memo[key] = options
    return memo[key]


def brute_force_best(cand: Candidates, n: int) -> float:
    """max Σ p̂ over every connected subtree containing the root with at most n drafted nodes."""
    return max(e for _, e in subtree_options(cand, 0, n + 1, {}))


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.path_tokens(i)) for i in range(len(tree))]


def e_of(tree: DraftTree) -> float:
    return math.fsum(tree.phat[1:].tolist())


def check_feasible(tree: DraftTree, cand: Candidates, budget: int, depth: int) -> None:
    """A valid tree of at most ``budget`` drafted nodes and ``depth`` layers, made of candidate nodes
    with the drafter's q and p̂ (so: no padding, no duplicate siblings)."""
    tree.validate()
    assert tree.size <= budget, (tree.size, budget)
    assert tree.depth <= depth, (tree.depth, depth)
    paths = tree_paths(tree)
    assert len(set(paths)) == len(paths), "two siblings carry the same token"
    for i, path in enumerate(paths[1:], start=1):
        assert path in cand.index, f"node {i} {path} is not a candidate (padding, or too deep)"
        assert float(tree.phat[i]) == cand.phat[cand.index[path]], (path, float(tree.phat[i]))
        assert float(tree.q[i]) > 0.0


# ------------------------------------------------------------------------------------ strategies
def biased(lo: int, hi: int) -> st.SearchStrategy[int]:
    """lo..hi, but hi (the largest, hardest case) about half of the time: hypothesis favours small
    integers, and the interesting trees are the big ones."""
    return st.one_of(st.integers(lo, hi), st.just(hi))


seeds = st.integers(0, 2**32 - 1)
vocabs = biased(2, 4)
roots = st.integers(0, 3)
caps = st.one_of(st.integers(0, 5), st.just(1000))  # the build's max_depth (the Decoder's cap); 1000: no cap


def build(name: str, options: dict, seed: int, vocab: int, root: int, max_depth: int):
    drafter = PathDrafter(seed, vocab)
    tree = make_builder(name, options).build(drafter, root, max_depth)
    return tree, drafter


@st.composite
def shapes(draw, max_nodes: int, max_depth: int) -> list[list[int]]:
    """A prefix-closed list of rank paths (ranks 0..3, possibly with gaps) of 1..max_nodes paths."""
    paths: list[tuple[int, ...]] = []
    for _ in range(draw(biased(1, max_nodes))):
        growable = [()] + [p for p in paths if len(p) < max_depth]
        parent = draw(st.sampled_from(growable))
        child = parent + (draw(st.integers(0, 3)),)
        if child not in paths:
            paths.append(child)
    return [list(p) for p in paths]


acceptances = st.lists(st.floats(0.01, 0.9), min_size=1, max_size=4).map(
    lambda xs: [x / max(1.0, sum(xs)) for x in sorted(xs, reverse=True)]
)


# ------------------------------------------------------------------------------------ the brute force itself
@settings_(100)
@given(seed=seeds, vocab=st.integers(2, 3), depth=st.integers(1, 2), root=roots)
def test_brute_force_enumerates_every_rooted_subtree(seed, vocab, depth, root):
    """subtree_options against the plainest enumeration: every subset of drafted nodes that is closed
    under parents (≤ 3 + 9 candidates, so ≤ 4096 subsets)."""
    cand = candidate_tree(PathDrafter(seed, vocab), root, depth)
    m = len(cand.paths) - 1
    best_by_size = [0.0] * (m + 1)  # best Σ p̂ with exactly s drafted nodes
    count = 0
    for mask in range(1 << m):
        nodes = [i + 1 for i in range(m) if mask >> i & 1]
        if all(cand.parent[v] == 0 or mask >> (cand.parent[v] - 1) & 1 for v in nodes):
            count += 1
            best_by_size[len(nodes)] = max(best_by_size[len(nodes)], math.fsum(cand.phat[v] for v in nodes))
    options = subtree_options(cand, 0, m + 1, {})
    assert len(options) == count  # every subtree once
    for n in range(m + 1):
        assert brute_force_best(cand, n) == pytest.approx(max(best_by_size[: n + 1]), abs=1e-12)


def test_brute_force_counts_on_a_full_binary_tree():
    """A full binary tree of depth 2 has (1 + (1 + 1)²)² = 25 rooted subtrees, 3 of them with ≤ 2 nodes."""
    cand = Candidates()
    cand.add((0,), -1, 1.0)
    for a in range(2):
        cand.add((0, a), 0, 0.5)
    for a in range(2):
        for b in range(2):
            cand.add((0, a, b), 1 + a, 0.25)
    assert len(subtree_options(cand, 0, 7, {})) == 25
    assert len(subtree_options(cand, 0, 2, {})) == 3
    assert brute_force_best(cand, 3) == 1.25


# ------------------------------------------------------------------------------------ OPT-Tree is optimal at δ = 0
@settings_(1000)
@given(seed=seeds, vocab=vocabs, root=roots, n=biased(1, 6), depth=biased(1, 3), cap=caps)
def test_opt_tree_with_zero_threshold_is_optimal(seed, vocab, root, n, depth, cap):
    """δ = 0: E(A) of opt-tree = the best connected subtree of the WHOLE candidate tree with ≤ n
    drafted nodes and ≤ min(max_depth, the build's cap) layers."""
    d = min(depth, cap)
    tree, _ = build("opt-tree", {"nodes": n, "threshold": 0.0, "max_depth": depth}, seed, vocab, root, cap)
    cand = candidate_tree(PathDrafter(seed, vocab), root, d)
    check_feasible(tree, cand, n, d)
    assert e_of(tree) == pytest.approx(brute_force_best(cand, n), abs=TOL)
    assert tree.expected_accepted() == pytest.approx(e_of(tree), abs=1e-5)


# ------------------------------------------------------------------------------------ nobody beats it
@settings_(500)
@given(
    seed=seeds,
    vocab=vocabs,
    root=roots,
    n=biased(1, 6),
    depth=biased(1, 3),
    cap=caps,
    top_k=st.integers(1, 5),
    data=st.data(),
)
def test_eagle2_never_beats_the_optimum(seed, vocab, root, n, depth, cap, top_k, data):
    """EAGLE-2 with total_tokens = n and depth ≤ D is a feasible tree, so E ≤ E*. With top_k ≥ n it
    reaches E* (docs/opt-tree-optimality.md, step 2, holds for its frontier too)."""
    e2_depth = data.draw(biased(1, depth), label="eagle2 depth")
    d = min(e2_depth, cap)
    tree, drafter = build("eagle2", {"top_k": top_k, "depth": e2_depth, "total_tokens": n}, seed, vocab, root, cap)
    cand = candidate_tree(PathDrafter(seed, vocab), root, d)
    check_feasible(tree, cand, n, d)
    best = brute_force_best(cand, n)
    assert e_of(tree) <= best + TOL
    if top_k >= n:
        assert e_of(tree) == pytest.approx(best, abs=TOL)
    full = candidate_tree(PathDrafter(seed, vocab), root, min(depth, cap))
    assert e_of(tree) <= brute_force_best(full, n) + TOL


@pytest.mark.skipif(not HAS_STATIC, reason="treespec.plugins.static does not import (yet)")
@settings_(300)
@given(seed=seeds, vocab=vocabs, root=roots, n=biased(1, 6), depth=biased(1, 3), cap=caps, data=st.data())
def test_static_never_beats_the_optimum(seed, vocab, root, n, depth, cap, data):
    shape = data.draw(shapes(n, depth), label="shape")
    d = min(max(map(len, shape)), cap)
    tree, _ = build("static", {"shape": json.dumps(shape)}, seed, vocab, root, cap)
    cand = candidate_tree(PathDrafter(seed, vocab), root, min(depth, cap))
    check_feasible(tree, cand, len(shape), d)
    assert e_of(tree) <= brute_force_best(cand, n) + TOL


@pytest.mark.skipif(not HAS_SEQUOIA, reason="treespec.plugins.sequoia does not import (yet)")
@settings_(300)
@given(
    seed=seeds,
    vocab=vocabs,
    root=roots,
    n=biased(1, 6),
    depth=biased(1, 3),
    cap=caps,
    acceptance=acceptances,
)
def test_sequoia_never_beats_the_optimum(seed, vocab, root, n, depth, cap, acceptance):
    d = min(depth, cap)
    tree, _ = build("sequoia", {"nodes": n, "max_depth": depth, "acceptance": acceptance}, seed, vocab, root, cap)
    cand = candidate_tree(PathDrafter(seed, vocab), root, d)
    check_feasible(tree, cand, n, d)
    assert e_of(tree) <= brute_force_best(cand, n) + TOL


# ------------------------------------------------------------------------------------ the rules, re-implemented
def select_top(drafted: list[tuple[int, ...]], phat: dict, n: int) -> set[tuple[int, ...]]:
    """The n drafted nodes with the largest p̂; ties: shallower, then drafted earlier."""
    order = sorted(range(len(drafted)), key=lambda i: (-phat[drafted[i]], len(drafted[i]), i))
    return {drafted[i] for i in order[:n]}


def reference_opt_tree(drafter: PathDrafter, root: int, n: int, delta: float, layers: int):
    """docs/opt-tree.md, step by step: frontiers of every draft call, the kept paths, E(A).

    A layer is the n best by p̂ (ties: the order of the candidates, i.e. parent's place in the
    previous layer, then child rank) among the top-n children of the previous layer; E_d is the float32
    sum of the n largest p̂ drafted so far, as the builder adds them; stop once E_d − E_{d−1} ≤ δ."""
    phat = {(root,): 1.0}
    frontier, frontiers, drafted, best = [(root,)], [], [], 0.0
    for _ in range(layers):
        frontiers.append(list(frontier))
        cands = [(path + (tok,), f32(phat[path] * q)) for path in frontier for tok, q in drafter.ranked(path)[:n]]
        layer = sorted((c for c in cands if c[1] > 0), key=lambda c: -c[1])[:n]  # stable
        if not layer:
            break
        for path, p in layer:
            phat[path] = p
            drafted.append(path)
        top = sorted((phat[p] for p in drafted), reverse=True)[:n]
        e = float(torch.tensor(top, dtype=torch.float32).sum())
        gain, best = e - best, e
        frontier = [path for path, _ in layer]
        if gain <= delta:
            break
    return frontiers, select_top(drafted, phat, n)


deltas = st.one_of(
    st.sampled_from([0.0, 0.0625, 0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0]),  # exact ties with dyadic gains
    st.floats(1e-4, 2.5),
)


@settings_(800)
@given(
    seed=seeds,
    vocab=vocabs,
    root=roots,
    n=biased(1, 6),
    depth=biased(1, 4),
    cap=caps,
    delta=deltas,
)
def test_opt_tree_stopping_rule(seed, vocab, root, n, depth, cap, delta):
    """δ ≥ 0: the same draft calls on the same frontiers, and the same final tree, as the rule of
    docs/opt-tree.md re-implemented in plain Python."""
    tree, drafter = build("opt-tree", {"nodes": n, "threshold": delta, "max_depth": depth}, seed, vocab, root, cap)
    frontiers, kept = reference_opt_tree(PathDrafter(seed, vocab), root, n, delta, min(depth, cap))
    assert len(drafter.calls) == len(frontiers)
    assert [paths for paths, _ in drafter.calls] == frontiers
    assert all(k == n for _, k in drafter.calls)
    assert set(tree_paths(tree)[1:]) == kept
    check_feasible(tree, candidate_tree(PathDrafter(seed, vocab), root, min(depth, cap)), n, min(depth, cap))


def reference_eagle2(drafter: PathDrafter, root: int, k: int, layers: int, n: int):
    """EAGLE-2 (plugins/eagle2.py docstring): expand the k best of the newest layer, keep every
    candidate, rerank everything at the end."""
    phat = {(root,): 1.0}
    frontier, frontiers, drafted = [(root,)], [], []
    for _ in range(layers):
        frontiers.append(list(frontier))
        layer = []
        for path in frontier:
            for tok, q in drafter.ranked(path)[:k]:
                phat[path + (tok,)] = f32(phat[path] * q)
                layer.append(path + (tok,))
        if not layer:
            break
        drafted += layer
        frontier = sorted(layer, key=lambda p: -phat[p])[:k]  # stable: ties in drafting order
    return frontiers, select_top(drafted, phat, n)


@settings_(500)
@given(
    seed=seeds,
    vocab=vocabs,
    root=roots,
    top_k=biased(1, 5),
    depth=biased(1, 4),
    n=biased(1, 12),
    cap=caps,
)
def test_eagle2_follows_its_rule(seed, vocab, root, top_k, depth, n, cap):
    tree, drafter = build("eagle2", {"top_k": top_k, "depth": depth, "total_tokens": n}, seed, vocab, root, cap)
    frontiers, kept = reference_eagle2(PathDrafter(seed, vocab), root, top_k, min(depth, cap), n)
    assert [paths for paths, _ in drafter.calls] == frontiers
    assert all(k == top_k for _, k in drafter.calls)
    assert set(tree_paths(tree)[1:]) == kept


# ------------------------------------------------------------------------------------ every builder
BUILDERS = [
    pytest.param("opt-tree", id="opt-tree"),
    pytest.param("chain", id="chain"),
    pytest.param("eagle2", id="eagle2"),
    pytest.param("static", id="static", marks=pytest.mark.skipif(not HAS_STATIC, reason="no treespec.plugins.static")),
    pytest.param(
        "sequoia", id="sequoia", marks=pytest.mark.skipif(not HAS_SEQUOIA, reason="no treespec.plugins.sequoia")
    ),
]


@st.composite
def builder_options(draw, name: str) -> tuple[dict, int, int]:
    """(options, node budget, depth limit of the options)."""
    if name == "opt-tree":
        n, d = draw(biased(1, 8)), draw(biased(1, 4))
        return {"nodes": n, "threshold": draw(deltas), "max_depth": d}, n, d
    if name == "chain":
        k = draw(biased(1, 5))
        return {"k": k}, k, k
    if name == "eagle2":
        n, d = draw(biased(1, 12)), draw(biased(1, 4))
        return {"top_k": draw(biased(1, 5)), "depth": d, "total_tokens": n}, n, d
    if name == "static":
        shape = draw(shapes(8, 4))
        return {"shape": json.dumps(shape)}, len(shape), max(map(len, shape))
    if name == "sequoia":
        n, d = draw(biased(1, 8)), draw(biased(1, 4))
        return {"nodes": n, "max_depth": d, "acceptance": draw(acceptances)}, n, d
    raise AssertionError(name)


@pytest.mark.parametrize("name", BUILDERS)
@settings_(100)
@given(seed=seeds, vocab=vocabs, root=roots, cap=caps, data=st.data())
def test_builders_respect_budget_and_depth_and_are_deterministic(name, seed, vocab, root, cap, data):
    options, budget, depth = data.draw(builder_options(name), label="options")
    d = min(depth, cap)
    tree, drafter = build(name, options, seed, vocab, root, cap)
    again, drafter2 = build(name, options, seed, vocab, root, cap)
    cand = candidate_tree(PathDrafter(seed, vocab), root, d)
    check_feasible(tree, cand, budget, d)
    assert len(drafter.calls) <= d  # one draft call per layer at most (the root is no call)
    for got, want in zip(
        (again.tokens, again.parents, again.depths, again.q, again.phat),
        (tree.tokens, tree.parents, tree.depths, tree.q, tree.phat),
    ):
        assert torch.equal(got, want)
    assert drafter2.calls == drafter.calls
    if cap == 0:
        assert len(tree) == 1 and not drafter.calls
