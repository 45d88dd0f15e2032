"""The rules a builder's tree and its ``expand`` calls must follow (the builder kit's ``rows.py``).

Pure functions: each returns why something is wrong (a message) or ``None``; the watch raises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from treespec.tree import DraftTree


def describe_tree(tree: DraftTree, limit: int = 8) -> str:
    """Size, depth and the first nodes as (id: parent → token, q)."""
    n = len(tree)
    parents, tokens, q = tree.parents.tolist(), tree.tokens.tolist(), tree.q.tolist()
    nodes = ", ".join(f"{i}: {parents[i]}→{tokens[i]} q={q[i]:.3g}" for i in range(1, min(n, limit + 1)))
    more = f", … {n - 1 - limit} more" if n - 1 > limit else ""
    return f"tree of {n - 1} drafted nodes, depth {tree.depth} (root {tokens[0]}; {nodes}{more})"


def tree_problem(tree: Any, root: int, vocab: int) -> str | None:
    """Why ``build``'s return value is not a valid draft tree of this step: a ``DraftTree`` whose node
    0 is ``root``, passing ``DraftTree.validate`` (an arborescence rooted at node 0, parents before
    children, depth = parent's + 1, p̂ = p̂(parent)·q), with drafted tokens inside the vocabulary,
    no padding (q == 0) and no two siblings carrying the same token."""
    if not isinstance(tree, DraftTree):
        return f"build() returned {type(tree).__name__}, not a treespec.DraftTree"
    if int(tree.tokens[0]) != root:
        return f"node 0 holds token {int(tree.tokens[0])}, not the step's root {root}: create DraftTree(root_token)"
    try:
        tree.validate()
    except ValueError as exc:
        return f"not a valid draft tree: {exc}"
    if len(tree) == 1:
        return None
    tokens, q = tree.tokens[1:], tree.q[1:]
    outside = ((tokens < 0) | (tokens >= vocab)).nonzero().flatten()
    if outside.numel():
        i = int(outside[0]) + 1
        return f"node {i} holds token {int(tree.tokens[i])}, outside the target's vocabulary [0, {vocab})"
    padding = (q <= 0).nonzero().flatten()
    if padding.numel():
        i = int(padding[0]) + 1
        return f"node {i} has q = {float(tree.q[i])}: padding (q == 0) must never be added as a node"
    pairs = np.stack([tree.parents[1:].numpy(), tokens.numpy()], axis=1)  # [N-1, 2] (parent, token)
    _, first, counts = np.unique(pairs, axis=0, return_index=True, return_counts=True)
    if (counts > 1).any():
        parent, token = pairs[first[int(np.argmax(counts > 1))]].tolist()
        return f"node {parent} has two children with token {token}: siblings must be distinct (a duplicate wastes the budget)"
    return None


def budget_problem(tree: DraftTree, max_nodes: int | None) -> str | None:
    """Why the tree breaks the builder's declared budget ``max_nodes`` (drafted nodes, root excluded)."""
    if max_nodes is not None and tree.size > max_nodes:
        return f"{tree.size} drafted nodes, more than the builder's max_nodes = {max_nodes}"
    return None


def max_nodes_problem(max_nodes: Any) -> str | None:
    """Why a builder's ``max_nodes`` is no usable budget: it must be an int ≥ 1."""
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int):
        return (
            f"max_nodes is {max_nodes!r}: declare the most drafted nodes one tree can have (an int), so that "
            "the Decoder can refuse a target that cannot verify such a tree before anything runs"
        )
    if max_nodes < 1:
        return f"max_nodes is {max_nodes}: it must be at least 1"
    return None


def depth_problem(tree: DraftTree, max_depth: int) -> str | None:
    """Why the tree is deeper than the step allows."""
    if tree.depth > max_depth:
        return f"depth {tree.depth} > max_depth {max_depth} (0 means the root alone)"
    return None


def expand_problem(tree: Any, nodes: Any, k: Any) -> str | None:
    """Why one ``expand(tree, nodes, k)`` call breaks the protocol: ``tree`` a ``DraftTree``, ``nodes``
    a 1-D integer tensor of at least one distinct node id of that tree, ``k`` an int ≥ 1."""
    if not isinstance(tree, DraftTree):
        return f"tree is {type(tree).__name__}, not a treespec.DraftTree"
    if not isinstance(nodes, torch.Tensor) or nodes.dtype.is_floating_point or nodes.dtype == torch.bool:
        return (
            f"nodes is {type(nodes).__name__} {getattr(nodes, 'dtype', '')}: pass a 1-D torch.long tensor of node ids"
        )
    if nodes.dim() != 1 or nodes.numel() == 0:
        return f"nodes has shape {list(nodes.shape)}: pass a 1-D tensor of at least one node id"
    ids = nodes.tolist()
    if len(set(ids)) != len(ids):
        return f"nodes {ids} holds a node twice"
    bad = [i for i in ids if not 0 <= i < len(tree)]
    if bad:
        return f"nodes {ids}: node {bad[0]} is not in the tree ({len(tree)} nodes)"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return f"k = {k!r}: ask for at least one child (an int)"
    return None


def grew_only(before: tuple[np.ndarray, np.ndarray], tree: DraftTree) -> str | None:
    """Why ``tree`` is not ``before`` (its tokens and parents at an earlier ``expand``) plus new nodes."""
    tokens, parents = before
    n = tokens.shape[0]
    if len(tree) < n:
        return f"the tree shrank from {n} to {len(tree)} nodes between two expand calls of one step"
    if not (np.array_equal(tree.tokens[:n].numpy(), tokens) and np.array_equal(tree.parents[:n].numpy(), parents)):
        return "nodes the drafter was already asked about changed between two expand calls of one step"
    return None
