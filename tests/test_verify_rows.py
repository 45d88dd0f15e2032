"""``verify.greedy_rows`` (a batch's greedy acceptance in one pass; ``greedy_verify`` is its batch of one)
equals a plain-Python reading of the rule row by row, on random trees of different sizes, with logits
that agree with the drafts to different depths, duplicate siblings, ties and root-only rows."""

from __future__ import annotations

import torch

from treespec.tree import DraftTree
from treespec.verify import greedy_rows, greedy_verify


def _random_tree(gen: torch.Generator, size: int, vocab: int) -> DraftTree:
    tree = DraftTree(int(torch.randint(vocab, (1,), generator=gen)))
    while len(tree) < size:
        parent = torch.randint(len(tree), (1,), generator=gen)
        token = torch.randint(vocab, (1,), generator=gen)
        tree.add_children(parent, token, torch.rand(1, generator=gen))
    return tree


def _reference(tree: DraftTree, logits: list[list[float]]) -> tuple[list[int], int]:
    """(accepted path's node ids, bonus) by the rule's words: node i is right when its token is the
    first maximum of its parent's logits; the path ends at the deepest node whose whole root path is
    right, the lowest id among equals."""
    parents, toks = tree.parents.tolist(), tree.tokens.tolist()
    best = [max(range(len(row)), key=lambda v: (row[v], -v)) for row in logits]

    def path(i: int) -> list[int]:
        return [] if i < 0 else path(parents[i]) + [i]

    right = [i for i in range(len(toks)) if all(toks[j] == best[parents[j]] for j in path(i)[1:])]
    end = min(right, key=lambda i: (-len(path(i)), i))
    return path(end), best[end]


def test_greedy_rows_equal_the_rule_per_row():
    gen = torch.Generator().manual_seed(0)
    vocab = 5  # small: paths the target agrees with are common, duplicates too
    for trial in range(200):
        trees = [_random_tree(gen, int(torch.randint(1, 9, (1,), generator=gen)), vocab) for _ in range(5)]
        tts = [t.tensors(10) for t in trees]
        n = max(len(t) for t in trees)
        logits = torch.randn(len(trees), n, vocab, generator=gen)  # [B, N, V]
        for r, t in enumerate(trees):  # make the target agree along some paths
            toks, pars = t.tokens, t.parents
            for i in range(1, len(t)):
                if torch.rand(1, generator=gen) < 0.6:
                    logits[r, pars[i], toks[i]] = 10.0
        got = greedy_rows(tts, logits)
        for r, (tree, g) in enumerate(zip(trees, got)):
            nodes, bonus = _reference(tree, logits[r, : len(tree)].tolist())
            assert g.nodes.tolist() == nodes and g.tokens == tree.tokens[nodes[1:]].tolist() and g.bonus == bonus, (
                trial,
                r,
            )
            alone = greedy_verify(tts[r], logits[r, : len(tree)])  # the batch of one
            assert alone.nodes.tolist() == nodes and alone.bonus == bonus, (trial, r)
