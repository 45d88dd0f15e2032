"""Drafter ``bigram``: a retrieval drafter over the current sequence.

It counts, for every token, which tokens followed it in the prompt and in everything committed
since. For a tree node it proposes the ``k`` most frequent followers of the node's token with
``q = count / total`` (total: how often the token was followed by anything). These are
normalised counts, not a model's probabilities, hence ``provides_probabilities = False``.

The step protocol (``prefill`` once; per step ``begin_step``, ``expand`` calls on one tree,
``commit``): state is per sequence, created in ``__init__``; ``prefill`` starts from the prompt,
``commit`` appends the step's tokens. ``expand`` reads the counts only, so the tree (and rejected
nodes) never change the state, and there is no per-step state: ``begin_step`` keeps the default,
which does nothing. (A drafter with per-step state, e.g. a KV cache holding tree rows, resets it in
``begin_step``; see treespec's ``plugins/model_drafter.py``.)
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

import torch

import treespec
from treespec import Commit, PrefillContext, Proposals
from treespec_example.configs import BigramConfig


class BigramDrafter(treespec.Drafter):
    Config = BigramConfig
    config: BigramConfig
    needs_target_hidden = False
    provides_probabilities = False

    def __init__(self, config: BigramConfig, target: treespec.TargetModel):
        super().__init__(config, target)
        self.followers: defaultdict[int, Counter[int]] = defaultdict(Counter)
        self.last: int | None = None  # the last committed token (the next root)

    def _extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the sequence, counting each new (previous, next) pair."""
        prev = self.last
        for tok in tokens:
            if prev is not None:
                self.followers[prev][tok] += 1
            prev = tok
        self.last = prev

    def prefill(self, context: PrefillContext) -> None:
        self.followers = defaultdict(Counter)
        self.last = None
        self._extend(context.input_ids.tolist())

    def expand(self, tree: treespec.DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        m = int(nodes.shape[0])
        tokens = torch.zeros(m, k, dtype=torch.long)  # [M, k]; padding: token 0 with q = 0
        q = torch.zeros(m, k, dtype=torch.float32)  # [M, k]
        node_tokens = tree.tokens[nodes.to(tree.tokens.device)].tolist()  # [M]
        for i, tok in enumerate(node_tokens):
            counts = self.followers.get(tok)
            if not counts:
                continue
            total = sum(counts.values())
            best = heapq.nsmallest(
                k,
                ((c, t) for t, c in counts.items() if c >= self.config.min_count),
                key=lambda ct: (-ct[0], ct[1]),  # most frequent first, then the smaller token id
            )
            for j, (c, t) in enumerate(best):
                tokens[i, j] = t
                q[i, j] = c / total
        return Proposals(tokens=tokens, q=q)

    def commit(self, commit: Commit) -> None:
        # commit.tokens = accepted draft tokens + the bonus token; they follow the old root (self.last)
        self._extend(list(commit.tokens))
