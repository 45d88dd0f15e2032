"""Measure what a step costs for one target, drafter, device, dtype and thread count — for one
sequence, or for one row of a batch of B rows in which every row does the same.

For every size of the grids in ``treespec.cost`` (or the sizes asked for) it times, on a prompt (the
same prompt in every row):

- a verification of n drafted nodes in every row (``treespec.step.verify_rows``: ONE target forward,
  split into the forward and the bookkeeping around it: tree tensors, acceptance), plus the commit;
- a step's first expansion (the root's children, after a verified and committed chain: the drafter's
  catch-up included);
- a draft expansion of m nodes at once in every row (``DraftRows.expand_together``: one round).

A row's planner prices its nodes with these at its own rate (tokens of the row per second of the
whole step), which for a batch is the batch's rate shared out: a node pays only if it pays for the batch.

Each point is the median of ``repeats`` measurements after one warm-up. ``treespec profile`` runs
the whole grid and saves the ``CostModel`` as JSON under ``treespec.cost.profile_path(key)``, where
``opt-tree nodes=auto`` finds it for the same key; without a saved profile, the auto builder runs
``quick`` (a few sizes, mostly medians of 3: 2.1 s for SmolLM2 here) when it is attached.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from treespec import step
from treespec.batch_target import BatchTarget
from treespec.cost import EXPAND_GRID, VERIFY_GRID, CostModel
from treespec.interfaces import DraftRows, Expansion
from treespec.tree import DraftTree

#: what ``quick`` measures: every size up to 4 nodes, where few-row products make T(n) a staircase
#: (SmolLM2 on an Intel Xeon here: 31, 32, 34, 49, 50 ms at n = 0 … 4; read between n = 1 and 4,
#: T(2) came out 36–39 ms and a run's planner could settle on one-node trees), then the curve's shape
QUICK_VERIFY = (0, 1, 2, 3, 4, 8, 16, 48)
QUICK_EXPAND = (1, 4, 16)
QUICK_REPEATS, QUICK_FEW = 3, 8  # medians of 3 up to QUICK_FEW nodes (and every expansion), above: once

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


def measure(
    target: Any,
    drafter: Any,
    prompt: list[int],
    key: dict[str, Any],
    repeats: int = 5,
    progress: Progress | None = None,
    verify_sizes: tuple[int, ...] = VERIFY_GRID,
    expand_sizes: tuple[int, ...] = EXPAND_GRID,
    batch: int = 1,
    once_above: int | None = None,
) -> CostModel:
    """The cost model of ``target`` + ``drafter`` measured on ``prompt`` (see the module docstring), for
    one sequence (``batch`` 1: the drafter itself) or one row of ``batch`` rows (``drafter.rows``);
    verifications of more than ``once_above`` nodes are measured once (the dear ones). It
    decodes on the target, so it holds the target like a decode does (``TargetModel.exclusive``): a
    Decoder built while another thread decodes on the same target waits instead of breaking it."""
    import threading

    args = (target, drafter, prompt, key, repeats, progress, verify_sizes, expand_sizes, batch, once_above)
    if getattr(target, "decoding_thread", None) == threading.get_ident():  # inside this thread's own decode
        return _measure(*args)
    with target.exclusive():
        return _measure(*args)


def _measure(
    target: Any,
    drafter: Any,
    prompt: list[int],
    key: dict[str, Any],
    repeats: int,
    progress: Progress | None,
    verify_sizes: tuple[int, ...],
    expand_sizes: tuple[int, ...],
    batch: int,
    once_above: int | None,
) -> CostModel:
    model = CostModel(key=key)
    gen = torch.Generator().manual_seed(0)

    def runs(n: int) -> int:  # timed verifications of n nodes (after one warm-up)
        return 1 if once_above is not None and n > once_above else repeats

    # every verification commits one token, every first expansion up to four: what stays for a tree
    room = (target.max_positions or 1 << 30) - len(prompt) - sum(1 + runs(n) for n in verify_sizes) - 4 * (repeats + 1)
    sizes = [n for n in verify_sizes if n < target.max_tree_nodes and n < room]
    total, done = len(sizes) + 1 + len(expand_sizes), 0
    bt = BatchTarget(target)
    rows = DraftRows([drafter]) if batch == 1 else drafter.rows(batch)

    def start() -> None:  # every row: the prompt, in the target and in its drafter
        step.prefill_rows(bt, rows.drafters, [prompt] * batch)

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(what, done, total)

    start()
    for n in sizes:
        forward, rest = _median(lambda n=n: _verify_once(bt, rows, prompt[-1], n, target.vocab_size, gen), runs(n))
        model.verify.observe(n, forward)
        model.bookkeeping.observe(n, rest)
        tick(f"verify n={n}")
    roots = [prompt[-1]] * batch
    model.first.observe(1, _median(lambda: _first_once(bt, rows, roots), repeats)[0])
    tick("first expansion")
    start()
    for m in expand_sizes:
        model.expand.observe(m, _median(lambda m=m: _expand_once(rows, prompt[-1], m, target.vocab_size), repeats)[0])
        tick(f"expand m={m}")
    return model


def _verify_once(bt: BatchTarget, rows: DraftRows, root: int, n: int, vocab: int, gen: Any) -> tuple[float, float]:
    """Every row verifies a random tree of n drafted nodes and keeps its root only (the prefix grows by
    one token): (the forward's seconds, the bookkeeping's)."""
    trees = [random_tree(root, n, vocab, gen) for _ in rows.drafters]
    clock = step.Clock()
    want = step.hidden_request(rows.drafters[0])  # as a decode asks: hidden states cost the forward too
    verdicts = step.verify_rows(bt, trees, [step.greedy] * len(trees), want, clock)
    begin = time.perf_counter()
    bt.commit([v.acceptance.nodes[:1] for v in verdicts])
    return clock.seconds["verify"], clock.seconds["bookkeeping"] + time.perf_counter() - begin


def _first_once(bt: BatchTarget, rows: DraftRows, roots: list[int]) -> tuple[float, float]:
    """A step's first expansion after every row verified and committed a short chain of the draft's
    best guesses (the drafters catch up on the accepted tokens, with the target's hidden states)."""
    want = step.hidden_request(rows.drafters[0])
    trees = []
    for d, root in zip(rows.drafters, roots):
        d.begin_step(root)
        tree, node = DraftTree(root), torch.zeros(1, dtype=torch.long)
        for _ in range(3):
            prop = d.expand(tree, node, 1)
            node = tree.add_children(node, prop.tokens[:, 0], prop.q[:, 0].clamp(min=1e-6))
        trees.append(tree)
    verdicts = step.verify_rows(bt, trees, [step.greedy] * len(trees), want, step.Clock())
    roots[:] = [tokens[-1] for tokens in step.commit_rows(bt, rows.drafters, verdicts)]
    for d, root in zip(rows.drafters, roots):
        d.begin_step(root)
    begin = time.perf_counter()
    rows.expand_together(
        {i: Expansion(DraftTree(root), torch.zeros(1, dtype=torch.long), 8) for i, root in enumerate(roots)}
    )
    return time.perf_counter() - begin, 0.0


def _expand_once(rows: DraftRows, root: int, m: int, vocab: int) -> tuple[float, float]:
    """Every row expands m leaves at once (one round), on a fresh step's tree."""
    trees = [DraftTree(root) for _ in rows.drafters]
    for d in rows.drafters:
        d.begin_step(root)
    first = rows.expand_together(
        {i: Expansion(t, torch.zeros(1, dtype=torch.long), max(m, 1)) for i, t in enumerate(trees)}
    )
    leaves = {
        i: t.add_children(torch.zeros(m, dtype=torch.long), _distinct(first[i], m, vocab), torch.full((m,), 0.5))
        for i, t in enumerate(trees)
    }
    begin = time.perf_counter()
    rows.expand_together({i: Expansion(t, leaves[i], 8) for i, t in enumerate(trees)})
    return time.perf_counter() - begin, 0.0


def _distinct(first: Any, m: int, vocab: int) -> torch.Tensor:
    """m distinct child tokens: the drafter's own proposals first, then others."""
    tokens = [int(t) for t, q in zip(first.tokens[0].tolist(), first.q[0].tolist()) if q > 0]
    proposed = set(tokens)
    extra = (t for t in range(3, vocab) if t not in proposed)
    while len(tokens) < m:
        tokens.append(next(extra))
    return torch.tensor(tokens[:m])


_QUICK: dict[tuple[int, str], CostModel] = {}  # (id of the target, profile key) -> the first quick measurement


def quick(target: Any, drafter: Any, key: dict[str, Any], batch: int = 1) -> CostModel:
    """A rough cost model in seconds at most (SmolLM2 here: 2.1 s; the small pair: 0.25 s): the
    sizes of QUICK_VERIFY and QUICK_EXPAND, medians of QUICK_REPEATS up to QUICK_FEW nodes, on a prompt
    of 128 tokens (or a quarter of the context), for a run that has no saved profile; for a row of a batch
    of ``batch`` rows, every row doing the same. Measured once per target, key and
    batch size in a process (a batch's rows, and later Decoders, start from a copy of it)."""
    import copy
    import json

    memo = (id(target), json.dumps(key, sort_keys=True, default=str), batch)
    if memo not in _QUICK:
        vocab = target.vocab_size
        length = max(4, min(128, (target.max_positions or 512) // 4))
        prompt = [(7 + 31 * i) % max(vocab - 3, 1) + 3 for i in range(length)]  # arbitrary tokens: only the time counts
        _QUICK[memo] = measure(
            target,
            drafter,
            prompt,
            key,
            repeats=QUICK_REPEATS,
            verify_sizes=QUICK_VERIFY,
            expand_sizes=QUICK_EXPAND,
            batch=batch,
            once_above=QUICK_FEW,
        )
    return copy.deepcopy(_QUICK[memo])
