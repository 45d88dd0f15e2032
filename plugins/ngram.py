"""Drafter ``ngram``: prompt lookup decoding (Hugging Face's ``prompt_lookup_num_tokens``).

A node's context is the committed sequence (prompt + everything generated so far; its last token is
the tree's root) followed by the node's path below the root. For n from ``max_ngram`` down to
``min_ngram`` the drafter looks for earlier occurrences of the context's last n tokens; the tokens
that followed them are the candidates. The longest n that matches at all wins (as prompt lookup
does); its candidates are ranked by how often they followed (ties: the most recent occurrence
first) and get

    q = count / (total + prior / n²)        total: the matches of that n-gram; prior: ``prior`` (4)

so several distinct followers become several ranked branches, and a node with no match gets only
padding (q = 0). The pseudo-count ``prior / n²`` is the chance of a continuation not seen yet: a
single earlier occurrence of one token says little, of three tokens much. Measured on SmolLM2's
MT-Bench answers (greedy and T = 0.7), the follower of a single match was the next token 15–22% of
the time after a 1-token match, 36–45% after 2 tokens and 68–84% after 3, where the raw share
count / total (``prior=0``) calls all three q = 1; ranked by this q, those cases come out in the
order they are right. These are match counts, not a model's probabilities, hence
``provides_probabilities = False``.

No forward pass at all. The committed sequence is indexed once: ``index[gram]`` (a tuple of n
tokens, min_ngram ≤ n ≤ max_ngram) maps each follower token to ``[count, last position]``. ``prefill``
builds it from the prompt, ``commit`` extends it with the step's tokens (accepted + bonus).
``expand`` only reads it; occurrences that reach into the node's path (not committed yet) are found
by scanning that short path, never inserted, so rejected nodes leave no trace.
"""

from __future__ import annotations

import torch

from treespec.errors import ConfigError
from treespec.interfaces import Commit, Drafter, PrefillContext, Proposals
from treespec.plugins.configs import NgramConfig
from treespec.tree import DraftTree


class NgramDrafter(Drafter):
    Config = NgramConfig
    config: NgramConfig
    needs_target_hidden = False
    provides_probabilities = False

    def __init__(self, config: NgramConfig, target=None):
        super().__init__(config, target)
        if config.min_ngram > config.max_ngram:
            raise ConfigError(
                f"drafter 'ngram': min_ngram ({config.min_ngram}) must not exceed max_ngram ({config.max_ngram})"
            )
        self.seq: list[int] = []
        self.index: dict[tuple[int, ...], dict[int, list[int]]] = {}

    # ------------------------------------------------------------------ index
    def _extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the committed sequence, indexing every n-gram that now has a follower."""
        seq, index = self.seq, self.index
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for tok in tokens:
            p = len(seq)
            for n in range(lo, min(hi, p) + 1):
                gram = tuple(seq[p - n : p])
                followers = index.get(gram)
                if followers is None:
                    index[gram] = {tok: [1, p]}
                    continue
                entry = followers.get(tok)
                if entry is None:
                    followers[tok] = [1, p]
                else:
                    entry[0] += 1
                    entry[1] = p
            seq.append(tok)

    def lookup(self, ext: list[int], k: int) -> list[tuple[int, float]]:
        """Up to ``k`` (token, q) continuations of the context ``committed + ext``, best first.

        ``ext`` are the path's tokens below the root (the root itself is the last committed token).
        """
        seq = self.seq
        L = len(seq)
        hi, lo = self.config.max_ngram, self.config.min_ngram
        base_len = min(L, hi)
        tail = seq[L - base_len :] + ext  # enough to hold every gram whose follower lies in ext
        offset = L - base_len  # global position of tail[0]
        ctx_len = L + len(ext)
        for n in range(min(hi, ctx_len), lo - 1, -1):
            gram = tuple(tail[-n:])
            found = self.index.get(gram)
            counts = found
            if ext:  # occurrences whose follower is a path token: scan the short path, insert nothing
                for nxt in range(max(base_len, n), len(tail)):
                    if tuple(tail[nxt - n : nxt]) == gram:
                        if counts is found:
                            counts = {t: list(e) for t, e in found.items()} if found else {}
                        tok = tail[nxt]
                        entry = counts.get(tok)
                        if entry is None:
                            counts[tok] = [1, offset + nxt]
                        else:
                            entry[0] += 1
                            entry[1] = offset + nxt
            if not counts:
                continue  # no match for this n: try a shorter one
            total = sum(e[0] for e in counts.values()) + self.config.prior / (n * n)
            best = sorted(counts.items(), key=lambda te: (-te[1][0], -te[1][1]))[:k]
            return [(t, e[0] / total) for t, e in best]
        return []

    # ------------------------------------------------------------------ Drafter
    def prefill(self, context: PrefillContext) -> None:
        self.seq = []
        self.index = {}
        self._extend(context.input_ids.tolist())

    def expand(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> Proposals:
        kk = min(k, self.config.max_matches)
        found: list[list[tuple[int, float]]] = [[] for _ in range(int(nodes.shape[0]))]
        if found and kk > 0:
            found = [self.lookup(ext, kk) for ext in tree.suffixes(nodes.tolist())]
        return Proposals.ranked(found, k)

    def commit(self, commit: Commit) -> None:
        # commit.tokens = accepted draft tokens + the bonus token; they follow the old root (seq[-1])
        self._extend(list(commit.tokens))
