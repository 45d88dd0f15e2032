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
from collections.abc import Callable
from typing import Any

import torch

from treespec import step
from treespec.batch_target import BatchTarget
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


def measure(
    target: Any,
    drafter: Any,
    prompt: list[int],
    key: dict[str, Any],
    repeats: int = 5,
    progress: Progress | None = None,
    verify_sizes: tuple[int, ...] = VERIFY_GRID,
    expand_sizes: tuple[int, ...] = EXPAND_GRID,
) -> CostModel:
    """The cost model of ``target`` + ``drafter`` measured on ``prompt`` (see the module docstring). It
    decodes on the target, so it holds the target like a decode does (``TargetModel.exclusive``): a
    Decoder built while another thread decodes on the same target waits instead of breaking it."""
    import threading

    if getattr(target, "decoding_thread", None) == threading.get_ident():  # inside this thread's own decode
        return _measure(target, drafter, prompt, key, repeats, progress, verify_sizes, expand_sizes)
    with target.exclusive():
        return _measure(target, drafter, prompt, key, repeats, progress, verify_sizes, expand_sizes)


def _measure(
    target: Any,
    drafter: Any,
    prompt: list[int],
    key: dict[str, Any],
    repeats: int,
    progress: Progress | None,
    verify_sizes: tuple[int, ...],
    expand_sizes: tuple[int, ...],
) -> CostModel:
    model = CostModel(key=key)
    gen = torch.Generator().manual_seed(0)
    room = (target.max_positions or 1 << 30) - len(prompt) - 16 * (repeats + 1)
    sizes = [n for n in verify_sizes if n < target.max_tree_nodes and n < room]
    total, done = len(sizes) + 1 + len(expand_sizes), 0
    step.prefill(target, drafter, prompt)
    one = BatchTarget(target, single=True)  # the target's sequence as a batch of one row

    def verify_once(n: int) -> tuple[float, float]:
        tree = random_tree(prompt[-1], n, target.vocab_size, gen)
        clock = step.Clock()
        [verdict] = step.verify_rows(one, [tree], [step.greedy], step.hidden_request(drafter), clock)
        start = time.perf_counter()
        target.commit(verdict.acceptance.nodes[:1])  # keep the root only: the prefix grows by one token
        return clock.seconds["verify"], clock.seconds["bookkeeping"] + time.perf_counter() - start

    for n in sizes:
        forward, rest = _median(lambda n=n: verify_once(n), repeats)
        model.verify.observe(n, forward)
        model.bookkeeping.observe(n, rest)
        done += 1
        if progress:
            progress(f"verify n={n}", done, total)

    def expand_once(m: int) -> tuple[float, float]:
        drafter.begin_step(prompt[-1])
        tree = DraftTree(prompt[-1])
        first = drafter.expand(tree, torch.zeros(1, dtype=torch.long), max(m, 1))  # the root's children
        leaves = tree.add_children(
            torch.zeros(m, dtype=torch.long), _distinct(first, m, target.vocab_size), torch.full((m,), 0.5)
        )
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
        [verdict] = step.verify_rows(one, [tree], [step.greedy], step.hidden_request(drafter), step.Clock())
        target_root[0] = step.commit_rows(one, [drafter], [verdict])[0][-1]
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
        seconds, _ = _median(lambda m=m: expand_once(m), repeats)
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


def measure_batch(
    target: Any,
    drafter: Any,
    prompt: list[int],
    key: dict[str, Any],
    batch: int,
    repeats: int = 1,
    verify_sizes: tuple[int, ...] = QUICK_VERIFY,
    expand_sizes: tuple[int, ...] = QUICK_EXPAND,
) -> CostModel:
    """The cost model of ONE row of a batch of ``batch`` rows in which every row does the same: T(n) is
    the batched step (``BatchTarget``) verifying n drafted nodes in every row, T_expand(m) one
    ``DraftRows.expand_together`` round in which every row expands m nodes (``treespec.batch``). A
    row's planner prices its nodes with these at its own rate (tokens of the row per second of the
    whole step), which is the batch's rate shared out: a node pays only if it pays for the batch."""
    from treespec.interfaces import Commit, Expansion, PrefillContext

    model = CostModel(key=key)
    gen = torch.Generator().manual_seed(0)
    bt, want = BatchTarget(target), step.hidden_request(drafter)
    hidden = bt.prefill([prompt] * batch, want_hidden=want)
    rows = drafter.rows(batch)
    for d, h in zip(rows.drafters, hidden):
        d.prefill(PrefillContext(input_ids=torch.tensor(prompt, dtype=torch.long), hidden=h))
    room = (target.max_positions or 1 << 30) - len(prompt) - 16 * (repeats + 1)

    def verify_once(n: int) -> tuple[float, float]:
        trees = [random_tree(prompt[-1], n, target.vocab_size, gen) for _ in range(batch)]
        start = time.perf_counter()
        tts = [t.tensors(int(bt.lens[i]), dtype=bt.dtype) for i, t in enumerate(trees)]
        begin = time.perf_counter()
        logits, _ = bt.forward_trees(tts, want_hidden=want)
        end = time.perf_counter()
        bt.commit(
            [step.greedy(t, tt, logits[i, : len(t)]).nodes[:1] for i, (t, tt) in enumerate(zip(trees, tts))]
        )  # the root only
        return end - begin, (begin - start) + time.perf_counter() - end

    for n in [n for n in verify_sizes if n < target.max_tree_nodes and n < room]:
        forward, rest = _median(lambda n=n: verify_once(n), repeats)
        model.verify.observe(n, forward)
        model.bookkeeping.observe(n, rest)

    def expand_once(m: int) -> tuple[float, float]:
        trees = [DraftTree(prompt[-1]) for _ in rows.drafters]
        for d in rows.drafters:
            d.begin_step(prompt[-1])
        first = rows.expand_together(
            {i: Expansion(t, torch.zeros(1, dtype=torch.long), max(m, 1)) for i, t in enumerate(trees)}
        )
        leaves = [
            t.add_children(
                torch.zeros(m, dtype=torch.long), _distinct(first[i], m, target.vocab_size), torch.full((m,), 0.5)
            )
            for i, t in enumerate(trees)
        ]
        start = time.perf_counter()
        rows.expand_together({i: Expansion(t, leaves[i], 8) for i, t in enumerate(trees)})
        return time.perf_counter() - start, 0.0

    def first_once() -> tuple[float, float]:
        """A step's first expansion after every row committed three tokens (the drafters catch up)."""
        for d, h in zip(rows.drafters, hidden):
            d.commit(Commit(tokens=prompt[-3:], hidden=h[-3:] if h is not None else None))
            d.begin_step(prompt[-1])
        start = time.perf_counter()
        rows.expand_together(
            {i: Expansion(DraftTree(prompt[-1]), torch.zeros(1, dtype=torch.long), 8) for i in range(batch)}
        )
        return time.perf_counter() - start, 0.0

    model.first.observe(1, _median(first_once, repeats)[0])
    for m in expand_sizes:
        model.expand.observe(m, _median(lambda m=m: expand_once(m), repeats)[0])
    return model


_QUICK: dict[tuple[int, str], CostModel] = {}  # (id of the target, profile key) -> the first quick measurement


def quick(target: Any, drafter: Any, key: dict[str, Any], batch: int = 1) -> CostModel:
    """A rough cost model in a fraction of a second: a few sizes, one measurement each, on a prompt of
    128 tokens (or a quarter of the context), for a run that has no saved profile; for a row of a batch
    of ``batch`` rows, every row doing the same (``measure_batch``). Measured once per target, key and
    batch size in a process (a batch's rows, and later Decoders, start from a copy of it)."""
    import copy
    import json

    memo = (id(target), json.dumps(key, sort_keys=True, default=str), batch)
    if memo not in _QUICK:
        vocab = target.vocab_size
        length = max(4, min(128, (target.max_positions or 512) // 4))
        prompt = [(7 + 31 * i) % max(vocab - 3, 1) + 3 for i in range(length)]  # arbitrary tokens: only the time counts
        _QUICK[memo] = (
            measure(target, drafter, prompt, key, repeats=1, verify_sizes=QUICK_VERIFY, expand_sizes=QUICK_EXPAND)
            if batch == 1
            else measure_batch(target, drafter, prompt, key, batch)
        )
    return copy.deepcopy(_QUICK[memo])
