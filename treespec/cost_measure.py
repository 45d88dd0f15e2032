"""Measure what a step costs for one target, drafter, device, dtype and thread count.

For every size of the grids in ``treespec.cost`` (or the sizes asked for) it times, on a prompt:

- a verification of n drafted nodes (``treespec.step.verify``: the target's tree forward, split into
  the forward and the bookkeeping around it: tree tensors, acceptance), plus the commit;
- a step's first expansion (the root's children, after a commit: the drafter's catch-up included);
- a draft expansion of m nodes at once (``drafter.expand`` on a fresh step's tree of m leaves).

Each point is the median of ``repeats`` measurements after one warm-up. ``treespec profile`` runs
the whole grid and saves the ``CostModel`` as JSON under ``treespec.cost.profile_path(key)``, where
``opt-tree nodes=auto`` finds it for the same key; without a saved profile, the auto builder runs
``quick`` (a few sizes, one measurement each: a fraction of a second) when it is attached.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from treespec import step
from treespec.cost import EXPAND_GRID, VERIFY_GRID, CostModel
from treespec.tree import DraftTree

QUICK_VERIFY = (0, 1, 4, 16, 48)  # what ``quick`` measures: enough for the curves' shape
QUICK_EXPAND = (1, 4, 16)

Progress = Callable[[str, int, int], None]


def random_tree(root: int, n: int, vocab: int, gen: torch.Generator) -> DraftTree:
    """A tree of n drafted nodes with random parents among the earlier nodes (bushy and deep)."""
    tree = DraftTree(root)
    for i in range(1, n + 1):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        token = int(torch.randint(3, vocab, (1,), generator=gen))
        tree.add_children(torch.tensor([parent]), torch.tensor([token]), torch.tensor([0.5]))
    return tree


def _median(fn: Callable[[], tuple[float, float]], repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def measure(target: Any, drafter: Any, prompt: list[int], key: dict[str, Any], repeats: int = 5,
            progress: Progress | None = None, verify_sizes: tuple[int, ...] = VERIFY_GRID,
            expand_sizes: tuple[int, ...] = EXPAND_GRID) -> CostModel:
    """The cost model of ``target`` + ``drafter`` measured on ``prompt`` (see the module docstring)."""
    model = CostModel(key=key)
    gen = torch.Generator().manual_seed(0)
    room = (target.max_positions or 1 << 30) - len(prompt) - 16 * (repeats + 1)
    sizes = [n for n in verify_sizes if n < target.max_tree_nodes and n < room]
    total, done = len(sizes) + 1 + len(expand_sizes), 0
    step.prefill(target, drafter, prompt)

    def verify_once(n: int) -> tuple[float, float]:
        tree = random_tree(prompt[-1], n, target.vocab_size, gen)
        clock = step.Clock()
        verdict = step.verify(target, tree, step.greedy, step.hidden_request(drafter), clock)
        start = time.perf_counter()
        target.commit(verdict.acceptance.nodes[:1])  # keep the root only: the prefix grows by one token
        return clock.seconds["verify"], clock.seconds["bookkeeping"] + time.perf_counter() - start

    for n in sizes:
        forward, rest = _median(lambda: verify_once(n), repeats)
        model.verify.observe(n, forward)
        model.bookkeeping.observe(n, rest)
        done += 1
        if progress:
            progress(f"verify n={n}", done, total)

    def expand_once(m: int) -> tuple[float, float]:
        drafter.begin_step(prompt[-1])
        tree = DraftTree(prompt[-1])
        first = drafter.expand(tree, torch.zeros(1, dtype=torch.long), max(m, 1))  # the root's children
        leaves = tree.add_children(torch.zeros(m, dtype=torch.long), _distinct(first, m, target.vocab_size),
                                   torch.full((m,), 0.5))
        start = time.perf_counter()
        drafter.expand(tree, leaves, 8)
        return time.perf_counter() - start, 0.0

    def first_once() -> tuple[float, float]:
        """A step's first expansion after a commit: the drafter catches up on the accepted tokens."""
        root = int(target_root[0])
        drafter.begin_step(root)
        tree = DraftTree(root)
        node = torch.zeros(1, dtype=torch.long)
        for _ in range(3):  # a short chain of the draft's best guesses, verified and committed
            prop = drafter.expand(tree, node, 1)
            node = tree.add_children(node, prop.tokens[:, 0], prop.q[:, 0].clamp(min=1e-6))
        verdict = step.verify(target, tree, step.greedy, step.hidden_request(drafter), step.Clock())
        target_root[0] = step.commit(target, drafter, verdict)[-1]
        drafter.begin_step(int(target_root[0]))
        start = time.perf_counter()
        drafter.expand(DraftTree(int(target_root[0])), torch.zeros(1, dtype=torch.long), 8)
        return time.perf_counter() - start, 0.0

    target_root = [prompt[-1]]
    seconds, _ = _median(first_once, repeats)
    model.first.observe(1, seconds)
    done += 1
    if progress:
        progress("first expansion", done, total)
    step.prefill(target, drafter, prompt)

    for m in expand_sizes:
        seconds, _ = _median(lambda: expand_once(m), repeats)
        model.expand.observe(m, seconds)
        done += 1
        if progress:
            progress(f"expand m={m}", done, total)
    return model


def _distinct(first: Any, m: int, vocab: int) -> torch.Tensor:
    """m distinct child tokens: the drafter's own proposals first, then others."""
    tokens = [int(t) for t, q in zip(first.tokens[0].tolist(), first.q[0].tolist()) if q > 0]
    proposed = set(tokens)
    extra = (t for t in range(3, vocab) if t not in proposed)
    while len(tokens) < m:
        tokens.append(next(extra))
    return torch.tensor(tokens[:m])


_QUICK: dict[tuple[int, str], CostModel] = {}  # (id of the target, profile key) -> the first quick measurement


def quick(target: Any, drafter: Any, key: dict[str, Any]) -> CostModel:
    """A rough cost model in a fraction of a second: a few sizes, one measurement each, on a prompt of
    128 tokens (or a quarter of the context), for a run that has no saved profile. Measured once per
    target and key in a process (a batch's rows, and later Decoders, start from a copy of it)."""
    import copy
    import json

    memo = (id(target), json.dumps(key, sort_keys=True, default=str))
    if memo not in _QUICK:
        _QUICK[memo] = _quick(target, drafter, key)
    return copy.deepcopy(_QUICK[memo])


def _quick(target: Any, drafter: Any, key: dict[str, Any]) -> CostModel:
    vocab = target.vocab_size
    length = max(2, min(128, (target.max_positions or 512) // 4))
    prompt = [(7 + 31 * i) % max(vocab - 3, 1) + 3 for i in range(length)]  # arbitrary tokens: only the time counts
    return measure(target, drafter, prompt, key, repeats=1, verify_sizes=QUICK_VERIFY, expand_sizes=QUICK_EXPAND)
