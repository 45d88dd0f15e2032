"""Property tests of DraftTree, TreeTensors and greedy_verify against independent plain-Python
references (parent-pointer walks), on hypothesis-generated random trees."""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from treespec import DraftTree, greedy_verify

SETTINGS = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 40


# ----------------------------------------------------------------------------- strategies
probabilities = st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False)


@st.composite
def trees(draw, max_nodes: int = 24, distinct_siblings: bool = False) -> DraftTree:
    """A random DraftTree grown the way builders grow one: batches of add_children calls whose
    parents already exist (so parents come before children), random tokens, q in (0, 1].

    Between batches the cached ancestor matrix is sometimes read, so a stale cache after growth
    would show. With ``distinct_siblings`` the children of one parent carry distinct tokens."""
    root = draw(st.integers(0, VOCAB - 1))
    tree = DraftTree(root)
    n = 1
    used: dict[int, set[int]] = {}
    for size in draw(st.lists(st.integers(0, 5), max_size=8)):
        size = min(size, max_nodes - n)
        parents = [draw(st.integers(0, n - 1)) for _ in range(size)]
        tokens = []
        for p in parents:
            tok = draw(st.integers(0, VOCAB - 1))
            if distinct_siblings:
                while tok in used.setdefault(p, set()):
                    tok = (tok + 1) % VOCAB
                used[p].add(tok)
            tokens.append(tok)
        q = [draw(probabilities) for _ in parents]
        new = tree.add_children(
            torch.tensor(parents, dtype=torch.long),
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(q, dtype=torch.float64),
        )
        assert new.tolist() == list(range(n, n + size))
        n += size
        if draw(st.booleans()):
            _ = tree.ancestors  # fill the cache; the next add_children must invalidate it
    return tree


# ----------------------------------------------------------------------------- references
def ref_parents(tree: DraftTree) -> list[int]:
    return [int(p) for p in tree.parents.tolist()]


def ref_path(parents: list[int], node: int) -> list[int]:
    """Root-to-node ids by following parent pointers."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def ref_depths(parents: list[int]) -> list[int]:
    return [len(ref_path(parents, i)) - 1 for i in range(len(parents))]


def from_arrays(tokens, parents, depths, q, phat) -> DraftTree:
    """A DraftTree built by hand through its attributes (bypassing add_children)."""
    tree = DraftTree(tokens[0])
    tree.tokens = torch.tensor(tokens, dtype=torch.long)
    tree.parents = torch.tensor(parents, dtype=torch.long)
    tree.depths = torch.tensor(depths, dtype=torch.long)
    tree.q = torch.tensor(q, dtype=torch.float32)
    tree.phat = torch.tensor(phat, dtype=torch.float32)
    return tree


def clone(tree: DraftTree) -> DraftTree:
    return from_arrays(
        tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), tree.q.tolist(), tree.phat.tolist()
    )


# ----------------------------------------------------------------------------- structure and tensors
@SETTINGS
@given(tree=trees(), past_len=st.integers(0, 40), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_tensors_mask_and_positions(tree, past_len, dtype):
    parents = ref_parents(tree)
    n = len(parents)
    depths = ref_depths(parents)
    tt = tree.tensors(past_len, dtype=dtype)
    blocked = torch.finfo(dtype).min

    assert tt.attention_mask.shape == (1, 1, n, past_len + n)
    assert tt.attention_mask.dtype == dtype
    mask = tt.attention_mask[0, 0].tolist()
    for row in range(n):
        on_path = set(ref_path(parents, row))  # ancestors-or-self
        for col in range(past_len + n):
            want = 0.0 if col < past_len or (col - past_len) in on_path else blocked
            assert mask[row][col] == want, (row, col)

    assert tt.position_ids.tolist() == [past_len + d for d in depths]
    assert tt.depths.tolist() == depths
    assert tt.input_ids.tolist() == tree.tokens.tolist()
    assert tt.parents.tolist() == parents
    assert tt.ancestors.tolist() == [[j in set(ref_path(parents, i)) for j in range(n)] for i in range(n)]


@SETTINGS
@given(tree=trees())
def test_paths_depths_and_sizes(tree):
    parents = ref_parents(tree)
    toks = tree.tokens.tolist()
    depths = ref_depths(parents)
    assert tree.depths.tolist() == depths
    assert tree.depth == max(depths)
    assert tree.size == len(parents) - 1 == len(tree) - 1
    for node in range(len(tree)):
        path = ref_path(parents, node)
        assert tree.path(node) == path
        assert tree.path_tokens(node) == [toks[i] for i in path]


@SETTINGS
@given(tree=trees())
def test_phat_and_expected_accepted(tree):
    parents = ref_parents(tree)
    q = tree.q.tolist()
    phat = tree.phat.tolist()
    assert phat[0] == 1.0 and q[0] == 1.0
    for node in range(len(tree)):
        want = math.prod(q[i] for i in ref_path(parents, node)[1:])  # float64 product of the stored q
        assert phat[node] == pytest.approx(want, rel=1e-5, abs=1e-30)
        assert 0.0 <= phat[node] <= 1.0
    assert tree.expected_accepted() == pytest.approx(sum(phat[1:]), rel=1e-5, abs=1e-12)
    if len(tree) == 1:
        assert tree.expected_accepted() == 0.0


@SETTINGS
@given(tree=trees())
def test_graph_is_arborescence_with_attributes(tree):
    parents = ref_parents(tree)
    g = tree.graph
    assert isinstance(g, nx.DiGraph)
    assert nx.is_arborescence(g)
    assert sorted(g.nodes) == list(range(len(tree)))
    assert set(g.edges) == {(p, i) for i, p in enumerate(parents) if p >= 0}
    assert g.in_degree(0) == 0
    toks, deps, qs, ps = tree.tokens.tolist(), tree.depths.tolist(), tree.q.tolist(), tree.phat.tolist()
    for i in range(len(tree)):
        assert g.nodes[i] == {"token": toks[i], "depth": deps[i], "q": qs[i], "phat": ps[i]}
        assert nx.shortest_path(g, 0, i) == ref_path(parents, i)


@SETTINGS
@given(tree=trees(), limit=st.one_of(st.none(), st.integers(0, 6)))
def test_suffixes_are_the_networkx_paths_below_the_root(tree, limit):
    """A retrieval drafter's context: the path's tokens after the root, its last ``limit`` of them."""
    g = tree.graph
    toks = tree.tokens.tolist()
    nodes = list(range(len(tree)))
    for node, got in zip(nodes, tree.suffixes(nodes, limit)):
        below = [toks[n] for n in nx.shortest_path(g, 0, node)[1:]]
        assert got == (below if limit is None else below[len(below) - min(limit, len(below)) :])


# ----------------------------------------------------------------------------- validate
@SETTINGS
@given(tree=trees())
def test_validate_passes_on_generated_trees(tree):
    tree.validate()


@SETTINGS
@given(
    tree=trees(),
    data=st.data(),
    kind=st.sampled_from(["depth", "forward_parent", "second_root", "phat", "q_above_one", "root_parent"]),
)
def test_validate_raises_on_corruption(tree, data, kind):
    assume(len(tree) >= 2)
    n = len(tree)
    bad = clone(tree)
    bad.validate()  # the clone itself is fine
    i = data.draw(st.integers(1, n - 1), label="node")
    if kind == "depth":
        bad.depths[i] += data.draw(st.sampled_from([-2, -1, 1, 3]), label="delta")
    elif kind == "forward_parent":
        bad.parents[i] = data.draw(st.integers(i, n - 1), label="new parent")  # itself or later
    elif kind == "second_root":
        bad.parents[i] = -1
    elif kind == "phat":
        bad.phat[i] += 0.01
    elif kind == "q_above_one":
        p = int(bad.parents[i])
        bad.q[i] = 1.5
        bad.phat[i] = bad.phat[p] * 1.5
    elif kind == "root_parent":
        bad.parents[0] = data.draw(st.integers(0, n - 1), label="root parent")
    with pytest.raises(ValueError):
        bad.validate()


def test_validate_rejects_forward_parent_in_an_otherwise_consistent_tree():
    """Node 1's parent is node 2: still an arborescence rooted at 0 with consistent depths and p̂,
    so only the 'parents before children' check can catch it."""
    tree = from_arrays(tokens=[5, 6, 7], parents=[-1, 2, 0], depths=[0, 2, 1], q=[1.0, 0.5, 0.5], phat=[1.0, 0.25, 0.5])
    assert nx.is_arborescence(tree.graph)
    with pytest.raises(ValueError, match="before"):
        tree.validate()


@pytest.mark.parametrize(
    "arrays",
    [
        dict(tokens=[5, 6, 7], parents=[-1, 2, 1], depths=[0, 1, 1], q=[1, 0.5, 0.5], phat=[1, 0.5, 0.5]),  # cycle
        dict(tokens=[5, 6], parents=[-1, 1], depths=[0, 1], q=[1, 0.5], phat=[1, 0.5]),  # self-loop
        dict(tokens=[5, 6], parents=[-1, 7], depths=[0, 1], q=[1, 0.5], phat=[1, 0.5]),  # parent does not exist
        dict(tokens=[5, 6], parents=[0, 0], depths=[0, 1], q=[1, 0.5], phat=[1, 0.5]),  # root has a parent
        dict(tokens=[5, 6], parents=[-1, -1], depths=[0, 0], q=[1, 0.5], phat=[1, 0.5]),  # two roots
    ],
    ids=["cycle", "self_loop", "missing_parent", "root_with_parent", "two_roots"],
)
def test_validate_rejects_malformed_hand_built_trees(arrays):
    with pytest.raises(ValueError):
        from_arrays(**arrays).validate()


# BUG (treespec/tree.py, DraftTree.validate): the root's own depth and p̂ are never checked. A tree
# whose depths are all shifted by one passes validate(), yet tensors() then gives every node the
# position past_len + depth + 1, so the target's logits are silently wrong.
@pytest.mark.parametrize(
    "arrays",
    [
        dict(tokens=[5], parents=[-1], depths=[1], q=[1.0], phat=[1.0]),
        dict(tokens=[5, 6, 7], parents=[-1, 0, 1], depths=[1, 2, 3], q=[1.0, 0.5, 0.5], phat=[1.0, 0.5, 0.25]),
        dict(tokens=[5, 6], parents=[-1, 0], depths=[0, 1], q=[1.0, 0.5], phat=[0.5, 0.25]),
    ],
    ids=["root_depth_1", "all_depths_shifted", "root_phat_not_1"],
)
def test_validate_rejects_bad_root(arrays):
    """BUG: validate() must check depth(root) == 0 and p̂(root) == 1 (module docstring: 'the root
    has p̂ = 1'; positions are past_len + depth)."""
    with pytest.raises(ValueError):
        from_arrays(**arrays).validate()


# ----------------------------------------------------------------------------- add_children
def test_add_children_rejects_missing_parent():
    tree = DraftTree(1)
    with pytest.raises(ValueError):
        tree.add_children(torch.tensor([1]), torch.tensor([2]), torch.tensor([0.5]))


def test_add_children_rejects_negative_parent():
    """BUG (treespec/tree.py, add_children): only ids >= len(self) are rejected. A parent of -1 is
    accepted and indexes from the end: the new node gets parent -1 (a second root) and the depth
    and p̂ of the *last* node + 1, and the tree no longer validates."""
    tree = DraftTree(1)
    tree.add_children(torch.tensor([0]), torch.tensor([2]), torch.tensor([0.5]))
    with pytest.raises(ValueError):
        tree.add_children(torch.tensor([-1]), torch.tensor([3]), torch.tensor([0.5]))


def test_add_children_rejects_mismatched_lengths():
    """BUG (treespec/tree.py, add_children): parents/tokens/q of different lengths are
    concatenated as they are, leaving tokens, parents and q of different lengths."""
    tree = DraftTree(1)
    with pytest.raises(ValueError):
        tree.add_children(torch.tensor([0, 0]), torch.tensor([2]), torch.tensor([0.5, 0.5]))


# ----------------------------------------------------------------------------- select
@st.composite
def tree_and_keep(draw, closed: bool = True):
    tree = draw(trees())
    parents = ref_parents(tree)
    chosen = draw(st.sets(st.integers(0, len(tree) - 1)))
    if not closed:
        return tree, chosen
    keep = {0}
    for node in chosen:
        keep.update(ref_path(parents, node))
    return tree, keep


@SETTINGS
@given(tk=tree_and_keep(), shuffle=st.randoms(use_true_random=False), duplicate=st.booleans())
def test_select_closed_subset(tk, shuffle, duplicate):
    tree, keep = tk
    order = sorted(keep)
    given_ids = list(keep) + (order[:2] if duplicate else [])
    shuffle.shuffle(given_ids)  # order and repeats must not matter
    sub = tree.select(torch.tensor(given_ids, dtype=torch.long))
    sub.validate()
    assert len(sub) == len(order)
    old_parents, new_parents = ref_parents(tree), ref_parents(sub)
    old_toks, new_toks = tree.tokens.tolist(), sub.tokens.tolist()
    for new_id, old_id in enumerate(order):
        old_path = [old_toks[i] for i in ref_path(old_parents, old_id)]
        new_path = [new_toks[i] for i in ref_path(new_parents, new_id)]
        assert new_path == old_path
        assert sub.path_tokens(new_id) == old_path
        assert float(sub.q[new_id]) == float(tree.q[old_id])
        assert float(sub.phat[new_id]) == float(tree.phat[old_id])
        assert int(sub.depths[new_id]) == int(tree.depths[old_id])
    tt = sub.tensors(3)  # a selected tree is usable as it is
    assert tt.position_ids.tolist() == [3 + d for d in ref_depths(new_parents)]


@SETTINGS
@given(tk=tree_and_keep(closed=False))
def test_select_without_root_raises(tk):
    tree, chosen = tk
    chosen.discard(0)
    with pytest.raises(ValueError):
        tree.select(torch.tensor(sorted(chosen), dtype=torch.long))


@SETTINGS
@given(tree=trees(), data=st.data())
def test_select_not_closed_under_parents_raises(tree, data):
    parents = ref_parents(tree)
    orphans = [i for i in range(1, len(tree)) if parents[i] != 0]  # nodes at depth >= 2
    assume(orphans)
    node = data.draw(st.sampled_from(orphans), label="node")
    keep = data.draw(st.sets(st.integers(0, len(tree) - 1)), label="others") | {0, node}
    keep.discard(parents[node])
    with pytest.raises(ValueError):
        tree.select(torch.tensor(sorted(keep), dtype=torch.long))


# ----------------------------------------------------------------------------- greedy_verify
@st.composite
def tree_and_logits(draw, distinct_siblings: bool = True):
    """A tree and logits [N, V] whose argmax at a node is often one of its children's tokens, so
    that long accepted paths are common. Maxima are unique (a margin of at least 0.5)."""
    tree = draw(trees(distinct_siblings=distinct_siblings))
    n = len(tree)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))
    logits = torch.randn(n, VOCAB, generator=gen, dtype=torch.float64)
    parents, toks = ref_parents(tree), tree.tokens.tolist()
    children: dict[int, list[int]] = {}
    for i in range(1, n):
        children.setdefault(parents[i], []).append(i)
    for node in range(n):
        options = [toks[c] for c in children.get(node, [])]
        if options and draw(st.integers(0, 3), label="follow") > 0:  # 3 in 4: the target agrees with a child
            logits[node, draw(st.sampled_from(options), label="argmax")] = logits[node].max() + 0.5
    dtype = draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    return tree, logits.to(dtype)


def ref_argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda v: (row[v], -v))  # first maximum


def ref_accepted(tree: DraftTree, logits: torch.Tensor) -> list[int]:
    """Every node whose whole root-to-node path agrees with the target's argmax at each parent."""
    parents, toks = ref_parents(tree), tree.tokens.tolist()
    best = [ref_argmax(row) for row in logits.tolist()]
    return [node for node in range(len(tree)) if all(toks[i] == best[parents[i]] for i in ref_path(parents, node)[1:])]


@SETTINGS
@given(tl=tree_and_logits(distinct_siblings=True), past_len=st.integers(0, 10))
def test_greedy_verify_matches_brute_force(tl, past_len):
    tree, logits = tl
    parents, toks = ref_parents(tree), tree.tokens.tolist()
    best = [ref_argmax(row) for row in logits.tolist()]
    accepted = ref_accepted(tree, logits)
    # with distinct sibling tokens the accepted nodes form one chain from the root
    deepest = max(accepted, key=lambda i: len(ref_path(parents, i)))
    chain = ref_path(parents, deepest)
    assert sorted(accepted) == chain

    result = greedy_verify(tree.tensors(past_len), logits)
    assert result.nodes.tolist() == chain
    assert result.tokens == [toks[i] for i in chain[1:]]
    assert result.accepted == len(chain) - 1
    assert result.bonus == best[deepest]


@SETTINGS
@given(tl=tree_and_logits(distinct_siblings=False))
def test_greedy_verify_with_repeated_sibling_tokens(tl):
    """Duplicate sibling tokens (e.g. from merged drafters) may accept several paths: the result
    must still be one fully accepted root path of maximal length, with the bonus at its end."""
    tree, logits = tl
    parents, toks = ref_parents(tree), tree.tokens.tolist()
    best = [ref_argmax(row) for row in logits.tolist()]
    accepted = ref_accepted(tree, logits)
    max_len = max(len(ref_path(parents, i)) for i in accepted)

    result = greedy_verify(tree.tensors(0), logits)
    nodes = result.nodes.tolist()
    assert nodes[-1] in accepted
    assert nodes == ref_path(parents, nodes[-1])
    assert len(nodes) == max_len
    assert result.tokens == [toks[i] for i in nodes[1:]]
    assert result.bonus == best[nodes[-1]]


def test_greedy_verify_root_only():
    tree = DraftTree(4)
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 1.0
    result = greedy_verify(tree.tensors(5), logits)
    assert result.nodes.tolist() == [0] and result.tokens == [] and result.bonus == 9
