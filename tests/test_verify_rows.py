"""``verify_rows.greedy_rows`` (a batch's greedy acceptance in one pass) equals ``greedy_verify`` row by row,
on random trees of different sizes, with logits that agree with the drafts to different depths,
duplicate siblings and root-only rows."""

from __future__ import annotations

import torch

from treespec.tree import DraftTree
from treespec.verify import greedy_verify
from treespec.verify_rows import greedy_rows


def _random_tree(gen: torch.Generator, size: int, vocab: int) -> DraftTree:
    tree = DraftTree(int(torch.randint(vocab, (1,), generator=gen)))
    while len(tree) < size:
        parent = torch.randint(len(tree), (1,), generator=gen)
        token = torch.randint(vocab, (1,), generator=gen)
        tree.add_children(parent, token, torch.rand(1, generator=gen))
    return tree


def test_greedy_rows_equal_greedy_verify_per_row():
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
        for r, (tt, g) in enumerate(zip(tts, got)):
            want = greedy_verify(tt, logits[r, : len(trees[r])])
            assert torch.equal(g.nodes, want.nodes) and g.tokens == want.tokens and g.bonus == want.bonus, (trial, r)
