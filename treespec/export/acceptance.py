"""Measuring acceptance by depth and rank for a target + drafter: what ``tree.py`` plans engine trees from.

Decoding runs as usual (``treespec.step``: the drafter's own protocol, the target's own verification)
with a chain builder that also asks the drafter for its ``ranks`` best children at every chain node
(and under the leaf). Greedy verification then says, per step, how deep the chain was accepted (m)
and which token the target wanted next (the bonus): the chain's nodes 1..m were rank 0 at their
depth, and the bonus had some rank at depth m + 1 among the drafter's proposals there (≥ ``ranks``:
none of them). So every step adds one test at each depth 1..m+1 that it reached:

    tests[d]    steps whose chain reached depth d (its parent was accepted)
    hits[d][r]  of those, the steps where the target's token at depth d was the drafter's rank r
    p[d][r]     = hits / tests   (the observed, hence calibrated, acceptance of rank r at depth d),
                  pulled towards depth d-1's by 16 pseudo-tests (``smooth``: deep depths get few tests)

It is conditional on the ancestors being rank 0 (the drafter's context below the root holds its own
predictions either way); planning a tree uses it for every path, the one approximation of the
objective (Sequoia's). Under greedy verification the tokens are the target's own greedy tokens, so
the same run also gives the chain's mean acceptance length τ = 1 + mean m, the figure an engine
running the same head as a chain of that length should reproduce.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from treespec.interfaces import Drafter, TreeBuilder
from treespec.tree import DraftTree

FORMAT = "treespec-depth-rank/1"
PRIOR_TESTS = 16.0  # a depth's vector is pulled towards the shallower depth's by this many pseudo-tests


def smooth(hits: list[list[int]], tests: list[int]) -> list[list[float]]:
    """p[d][r] = (hits + w · p[d-1][r]) / (tests + w), w = ``PRIOR_TESTS`` (depth 1: hits / tests):
    deep depths are reached by few steps, and a handful of tests must not make a rank look certain
    or impossible; with no test at all a depth repeats the shallower one."""
    out: list[list[float]] = []
    for d, (row, t) in enumerate(zip(hits, tests)):
        if d == 0:
            out.append([h / t if t else 0.0 for h in row])
        else:
            out.append([(h + PRIOR_TESTS * q) / (t + PRIOR_TESTS) for h, q in zip(row, out[-1])])
    return out


class RankChain(TreeBuilder):
    """A chain of the drafter's top-1 proposals, ``depth`` deep, recording each node's ``ranks`` best
    proposals (tokens) so that the step's outcome can be ranked afterwards."""

    def __init__(self, depth: int, ranks: int):
        self.depth, self.ranks = depth, ranks
        self.proposals: list[list[int]] = []  # per chain node (root first): its proposed children, best first

    def build(self, drafter: Drafter, root_token: int, max_depth: int) -> DraftTree:
        tree = DraftTree(root_token)
        self.proposals = []
        node = 0
        for depth in range(min(self.depth, max_depth) + 1):
            out = drafter.expand(tree, torch.tensor([node]), self.ranks)
            tokens, q = out.tokens[0].tolist(), out.q[0].tolist()
            self.proposals.append([t for t, x in zip(tokens, q) if x > 0])
            if depth == min(self.depth, max_depth) or not self.proposals[-1]:
                break
            node = int(tree.add_children(torch.tensor([node]), torch.tensor([tokens[0]]), torch.tensor([q[0]]))[0])
        return tree


def _count(hits: list[list[int]], tests: list[int], proposals: list[list[int]], tokens: list[int], deep: int) -> None:
    """One step's tests: depths 1..m passed at rank 0 (the chain's node was the target's token), and at
    depth m + 1 the rank the bonus token had among the proposals there (m = len(tokens) - 1 accepted)."""
    m = len(tokens) - 1
    for d in range(deep):
        tests[d] += 1
        hits[d][0] += 1
    if m < len(proposals):
        tests[m] += 1
        if tokens[-1] in proposals[m]:
            hits[m][proposals[m].index(tokens[-1])] += 1


def measure_depth_rank(
    decoder: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    depth: int = 8,
    ranks: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Decode ``prompts`` greedily with ``decoder``'s target and drafter through ``RankChain`` and
    return ``{"format", "acceptance": p [depth+1][ranks], "tests": [depth+1], "chain_tau", "steps",
    "tokens", "seconds", ...}`` (module docstring). ``decoder``: a ``treespec.Decoder``."""
    from treespec import step as steps

    target, drafter = decoder.target, decoder.drafter
    eos = set(target.eos_token_ids or [])
    builder = RankChain(depth, ranks)
    hits = [[0] * ranks for _ in range(depth + 1)]
    tests = [0] * (depth + 1)
    accepted, n_steps, n_tokens = 0, 0, 0
    start = time.perf_counter()
    with target.lock:
        for i, prompt in enumerate(prompts):
            steps.prefill(target, drafter, prompt)
            root, made = prompt[-1], 0
            limit = min(max_new_tokens, (getattr(target, "max_positions", None) or 1 << 62) - len(prompt))
            while made < limit:
                cap = max(0, min(depth, limit - made - 1))
                result = steps.step(target, drafter, builder, root, cap, steps.greedy)
                tokens = result.tokens
                m = len(tokens) - 1  # accepted draft tokens; tokens[-1] is the bonus
                _count(hits, tests, builder.proposals, tokens, min(m, cap))
                accepted += m
                n_steps += 1
                cut = next((j + 1 for j, t in enumerate(tokens) if t in eos), None)
                made += len(tokens) if cut is None else cut
                root = tokens[-1]
                if cut is not None:
                    break
            n_tokens += made
            if progress:
                progress(i + 1, len(prompts))
    seconds = time.perf_counter() - start
    p = smooth(hits, tests)
    return {
        "format": FORMAT,
        "acceptance": p,
        "tests": tests,
        "hits": hits,
        "prior_tests": PRIOR_TESTS,
        "depth": depth,
        "ranks": ranks,
        "chain_tau": 1.0 + accepted / max(n_steps, 1),
        "chain_depth": depth,
        "steps": n_steps,
        "tokens": n_tokens,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "seconds": round(seconds, 2),
    }


def load(path: str) -> dict[str, Any]:
    """A measurement written by ``treespec export measure`` (JSON); problems are one ``ConfigError`` line."""
    from pathlib import Path

    from treespec.errors import ConfigError
    from treespec.files import read_json

    hint = "make one with `treespec export measure --target T --drafter D --out FILE`"
    file = Path(path).expanduser()
    data = read_json(file, "acceptance file", hint)
    if data.get("format") != FORMAT:
        raise ConfigError(f"acceptance file {file} is not a depth-by-rank measurement ({FORMAT}); {hint}")
    p = data.get("acceptance")
    if (
        not isinstance(p, list)
        or not p
        or not all(
            isinstance(row, list)
            and row
            and all(isinstance(x, (int, float)) and math.isfinite(x) and 0 <= x <= 1 for x in row)
            for row in p
        )
    ):
        raise ConfigError(f"acceptance file {file}: 'acceptance' must be rows of probabilities in [0, 1]; {hint}")
    return data
