"""Drafter ``datastore``: retrieval from a corpus, in the manner of REST (He et al. 2023).

A node's context is the committed sequence (its last token is the tree's root) followed by the
node's path below the root. For n from ``max_suffix`` down to ``min_suffix`` the drafter looks up
the context's last n tokens in a suffix array over a tokenised corpus (``datastore_index.py``); the
longest n that occurs *followed by a token* wins. The tokens that follow its occurrences are the
candidates, ranked by count (ties: smaller token id first), with

    q(t) = count(t) / Σ_t' count(t')

over the occurrences read (all of them, or ``max_matches`` evenly spread ones). These are normalised
match counts, not a model's probabilities, hence ``provides_probabilities = False``. A node whose
context has no match of at least ``min_suffix`` tokens gets only padding (q = 0).

No forward pass. The index is read-only: ``prefill`` and ``commit`` only keep the committed
sequence's last ``max_suffix`` tokens, and ``expand`` runs one vectorised binary search for every
(node, n) pair it has not seen before. Results are memoised by the context's last ``max_suffix``
tokens, which is all they depend on, so sibling subtrees and later steps reuse them.

The ``corpus`` option is a corpus file (its index is cached under ``cache_dir``, keyed by the corpus's
and the tokenizer's sha256, and built on first use) or an index ``.npz`` made by
``treespec datastore build``; an index built with another tokenizer is refused.
"""

from __future__ import annotations

import numpy as np
import torch

from treespec.errors import ConfigError
from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals
from treespec.plugins.configs import DatastoreConfig
from treespec.plugins.datastore_index import Index, open_index
from treespec.tree import DraftTree

MEMO_LIMIT = 200_000  # memoised contexts; the memo is cleared when it grows past this


class DatastoreDrafter(Drafter):
    Config = DatastoreConfig
    config: DatastoreConfig
    needs_target_hidden = False
    provides_probabilities = False

    def __init__(self, config: DatastoreConfig, target=None, index: Index | None = None):
        super().__init__(config, target)
        if config.min_suffix > config.max_suffix:
            raise ConfigError(
                f"drafter 'datastore': min_suffix ({config.min_suffix}) must not exceed max_suffix ({config.max_suffix})"
            )
        self.index_path = None  # the index file read (None: an Index given directly)
        if index is None:
            tokenizer = getattr(target, "tokenizer", None)
            if tokenizer is None:
                raise ConfigError(
                    "drafter 'datastore' needs the target's tokenizer; load the target by name or give TargetModel a tokenizer"
                )
            index, self.index_path = open_index(config.corpus, tokenizer, config.cache_dir)
        vocab = getattr(target, "vocab_size", None)
        if vocab is not None:
            index.check_vocabulary(int(vocab), str(self.index_path or "the given index"))
        self.index = index
        self.tail: list[int] = []  # the committed sequence's last max_suffix tokens
        self.memo: dict[tuple[int, ...], list[tuple[int, float]]] = {}

    # ------------------------------------------------------------------ lookups
    def lookup_many(self, contexts: list[tuple[int, ...]]) -> list[list[tuple[int, float]]]:
        """All (token, q) continuations of each context (its last ``max_suffix`` tokens), best first."""
        found = {c: self.memo[c] for c in contexts if c in self.memo}
        todo = [c for c in dict.fromkeys(contexts) if c not in found]
        if todo:
            if len(self.memo) + len(todo) > MEMO_LIMIT:
                self.memo.clear()
            for ctx, got in zip(todo, self._search(todo)):
                found[ctx] = self.memo[ctx] = got
        return [found[c] for c in contexts]

    def _search(self, contexts: list[tuple[int, ...]]) -> list[list[tuple[int, float]]]:
        cfg = self.config
        lo_n, width = cfg.min_suffix, cfg.max_suffix
        pats, lens, owner = [], [], []  # one row per (context, n): the context's last n tokens
        for i, ctx in enumerate(contexts):
            for n in range(min(width, len(ctx)), lo_n - 1, -1):  # longest first
                pats.append(list(ctx[len(ctx) - n :]) + [0] * (width - n))
                lens.append(n)
                owner.append(i)
        out: list[list[tuple[int, float]]] = [[] for _ in contexts]
        if not pats:
            return out
        lo, hi = self.index.ranges(np.asarray(pats, dtype=np.int64), np.asarray(lens))  # [Q], [Q]
        done = [False] * len(contexts)
        for i, n, a, b in zip(owner, lens, lo.tolist(), hi.tolist()):
            if done[i] or b <= a:
                continue
            toks, counts = self.index.followers(a, b, n, cfg.max_matches)  # [F], [F]
            if toks.size:  # else every occurrence ends a document: try a shorter n
                total = float(counts.sum())
                out[i] = [(t, c / total) for t, c in zip(toks.tolist(), counts.tolist())]
                done[i] = True
        return out

    # ------------------------------------------------------------------ Drafter
    def prefill(self, context: PrefillContext) -> None:
        self.tail = context.input_ids.tolist()[-self.config.max_suffix :]

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        width = self.config.max_suffix
        if not int(nodes.shape[0]) or k <= 0:
            return Proposals.ranked([[] for _ in range(int(nodes.shape[0]))], k)
        contexts = [tuple((self.tail + ext)[-width:]) for ext in tree.suffixes(nodes.tolist(), width)]
        return Proposals.ranked(self.lookup_many(contexts), k)

    def commit(self, commit: Commit) -> None:
        # commit.tokens = accepted draft tokens + the bonus token; they follow the old root (tail[-1])
        self.tail = (self.tail + list(commit.tokens))[-self.config.max_suffix :]
