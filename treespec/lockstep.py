"""Drafting a batch's trees side by side: every row's builder runs as usual, their ``expand`` calls meet.

A builder grows its tree by calling ``drafter.expand`` and deciding what to do with the answer, so
it cannot hand over a level and wait; and builders are plugins (third-party ones included), so they
cannot be rewritten as generators. ``draft_rows`` therefore runs each row's ``draft`` in its own
greenlet (a coroutine with its own stack, switched in about a microsecond), one at a time: a row
runs until it calls ``expand`` (its request is parked) or returns its tree. When every unfinished
row is parked, the round's requests go to ``DraftRows.expand_together`` — ONE draft forward per tree level for all rows — and each row resumes
with its answer:

    round 1:  row 0 … expand(root)  ·  row 1 … expand(root)  ·  …     → expand_together({0, 1, …})
    round 2:  row 0 … expand(layer 1)  ·  row 1 returned its tree  ·  … → expand_together({0, …})
    …         until every row returned its tree

One row runs at a time, on the caller's thread, so a row's builder sees exactly the calls and
answers it would alone, and the order of everything is fixed. (Threads were measured first: a
hand-over cost 30–90 µs here, 4–15 ms per 16-row step; a greenlet switch costs 1.5 µs.) Rows whose
drafters do not batch (``DraftRows.batched`` False: retrieval drafters, third-party drafters) skip all of this
and draft one after another. ``Drafter.distribution`` and ``begin_step`` go straight to the row's
drafter: they answer from what ``expand`` already computed.
"""

from __future__ import annotations

from typing import Any

from greenlet import greenlet

from treespec.errors import TreespecError
from treespec.interfaces import Drafter, DraftRows, Expansion, TreeBuilder
from treespec.tree import DraftTree


def draft(drafter: Drafter, builder: TreeBuilder, root: int, max_depth: int) -> DraftTree:
    """One row's tree: tell the drafter a step starts at ``root``, then let the builder grow the tree
    with it (``treespec.step``'s draft phase)."""
    drafter.begin_step(root)
    tree = builder.build(drafter, root, max_depth=max_depth)
    if tree.depth > max_depth:
        raise TreespecError(
            f"builder {type(builder).__name__} returned a tree of depth {tree.depth} > max_depth {max_depth}"
        )
    return tree


class _Parked:
    """What a row hands back when it calls ``expand``: its request, waiting for the round."""

    def __init__(self, request: Expansion):
        self.request = request


class _RowDrafter:
    """What a row's builder sees in place of the row's drafter: ``expand`` parks the call for the
    round (switching back to the driver); everything else is the row's drafter's own."""

    def __init__(self, drafter: Any, driver: greenlet):
        self._drafter, self._driver = drafter, driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def expand(self, tree: DraftTree, nodes: Any, k: int) -> Any:
        return self._driver.switch(_Parked(Expansion(tree=tree, nodes=nodes, k=k)))


def _row(drafter: Any, builder: TreeBuilder, root: int, max_depth: int) -> Any:
    return lambda: draft(drafter, builder, root, max_depth)


def draft_rows(
    rows: DraftRows, builders: list[TreeBuilder], roots: list[int], max_depths: list[int]
) -> list[DraftTree]:
    """Row i's tree, ``draft(rows.drafters[i], builders[i], roots[i], max_depths[i])``, for every
    row; with ``rows.batched``, all rows' expansions of a round in one ``expand_together`` call."""
    drafters = rows.drafters
    if not rows.batched or len(drafters) == 1:
        return [draft(d, b, r, m) for d, b, r, m in zip(drafters, builders, roots, max_depths)]
    driver = greenlet.getcurrent()
    lets = [
        greenlet(_row(_RowDrafter(d, driver), b, r, m)) for d, b, r, m in zip(drafters, builders, roots, max_depths)
    ]
    trees: list[Any] = [None] * len(lets)
    parked: dict[int, Expansion] = {}

    def run(i: int, *answer: Any) -> None:  # row i runs until it parks or returns its tree
        out = lets[i].switch(*answer)
        if isinstance(out, _Parked):
            parked[i] = out.request
        else:
            trees[i] = out

    try:
        for i in range(len(lets)):
            run(i)
        while parked:
            requests, parked = parked, {}
            answers = rows.expand_together(requests)
            for i in requests:
                run(i, answers[i])
    except BaseException:
        for g in lets:  # unwind the parked rows (their builders' finally blocks run)
            if g and not g.dead:
                g.throw()
        raise
    return trees
