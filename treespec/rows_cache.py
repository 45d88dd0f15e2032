"""One draft KV cache for a batch's rows, each row with its own length (``DraftRows`` that batch).

The layout is ``treespec.batch_target``'s, for drafters:

    row b:  [ committed prefix: len_b columns | anything: masked | columns appended this step ]

A round appends a [B, T] block for every row (rows with less to feed pad with queries that see only
themselves), then each row copies what became committed into place after its prefix
(``kv.move_cache_rows``); the columns appended during a step are cut off at the start of the next
step, when no row holds tree items. Rows that finish leave by indexing the batch dimension.

A row is its drafter's ``fork()`` with a row class mixed in (``row_class``, e.g. ``model_rows.ModelRow``):
the row knows its ``group`` and ``index``, answers an ``expand`` called on it alone as a round of one,
and keeps its tree items in the group's cache. The drafter a user builds for one sequence carries
none of this: batch state lives on batch rows only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from treespec.interfaces import DraftRows, Expansion, Proposals
from treespec.kv import concat_caches, crop_cache, rows_mask
from treespec.slack_cache import slack_cache


class CacheRow:
    """What a row of a ``RowsCache`` adds to its drafter's class (mixed in by ``RowsCache.row``)."""

    group: RowsCache  # the batch's rows, whose cache holds this row's
    index: int  # this row's place in ``group.drafters``

    def expand(self, tree: Any, nodes: torch.Tensor, k: int) -> Proposals:
        """Called on this row alone (not through ``treespec.lockstep``): a round of one."""
        return self.group.expand_together({self.index: Expansion(tree, nodes, k)})[self.index]


_ROW_CLASSES: dict[tuple[type, type], type] = {}


class RowsCache(DraftRows):
    """``DraftRows`` whose rows share ``self.cache`` (batch dimension = row)."""

    batched = True
    #: the mixin that makes a fork of ``base`` a row of this group (a ``CacheRow``)
    row_class: type[CacheRow] = CacheRow

    def __init__(self, base: Any, n: int):
        super().__init__([], base)
        self.drafters = [self.row(i) for i in range(n)]
        self.cache = slack_cache()

    def row(self, index: int) -> Any:
        """A fork of ``base`` as row ``index`` of this group: its class gains ``row_class`` (one class
        per drafter class, made once: a ``SelfDrafter``'s rows stay ``SelfDrafter``s)."""
        fork = self.base.fork()
        if isinstance(fork, self.row_class):  # rows of a row (its cost measurement): already the class
            cls: type = type(fork)
        else:
            kind = (self.row_class, type(fork))
            if kind not in _ROW_CLASSES:
                _ROW_CLASSES[kind] = type(f"{type(fork).__name__}Row", kind, {})
            cls = _ROW_CLASSES[kind]
        row = object.__new__(cls)  # the fork's state as it is, in the row class
        row.__dict__.update(fork.__dict__)
        row.group, row.index = self, index
        return row

    @property
    def width(self) -> int:
        """Columns in the cache (every row has them; most rows' tails are masked)."""
        return self.cache.get_seq_length() if self.cache.layers else 0

    def cut(self, width: int) -> None:
        """Drop the columns from ``width`` on (the tails no row needs any more)."""
        if self.width > width:
            crop_cache(self.cache, width)

    def new_step(self, committed: Iterable[int]) -> None:
        """At a new step everywhere (no row has tree nodes in the cache yet), drop the last step's
        columns past the longest committed row (``committed``: each row's committed columns)."""
        if not any(r.row_nodes for r in self.drafters):
            self.cut(max(committed))

    def add(self, n: int) -> list[Any]:
        """``n`` new rows (forks of ``self.base``) join the batch, their cache rows empty (all masked)."""
        first = len(self.drafters)
        new = [self.row(first + j) for j in range(n)]
        self.drafters += new
        self.cache = concat_caches(self.cache, self.width, slack_cache(), 0, first, n)
        return new

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
                layer.values = layer.values.index_select(0, index.to(layer.values.device))
        for i, row in enumerate(self.drafters):
            row.index = i

    #: a row feeds its items alone when it has more than ALONE_MIN of them and more than ALONE_RATIO
    #: times the (lower) median row of its round (padding every row of the block to its length would cost more)
    ALONE_MIN, ALONE_RATIO = 32, 4

    def alone(self, rows: list[int], count: Any, started: bool = True) -> list[int]:
        """Which of ``rows`` (with ``count(i)`` items each to feed) feed them alone: a prompt that just
        joined a running batch has hundreds of items where the others have a few, and a batch's first
        round has prompts of very different lengths. ``started``: only once the cache holds columns
        (the caller feeds the alone rows before the block)."""
        if len(rows) < 2 or (started and not self.width):
            return []
        sizes = {i: count(i) for i in rows}
        middle = sorted(sizes.values())[(len(sizes) - 1) // 2]  # the lower median: of two rows, the shorter
        return [i for i, n in sizes.items() if n > self.ALONE_MIN and n > self.ALONE_RATIO * max(middle, 1)]

    def prefix_cache(self, i: int, length: int) -> Any:
        """A one-row cache holding row i's first ``length`` columns (its committed prefix)."""
        cache = slack_cache()
        if length:
            for j, layer in enumerate(self.cache.layers):
                cache.update(layer.keys[i : i + 1, :, :length], layer.values[i : i + 1, :, :length], j)
        return cache

    def splice(self, i: int, cache: Any, start: int, n: int) -> None:
        """Write columns start..start+n of the one-row ``cache`` into row i of the rows' cache (widened
        with masked columns if it is narrower)."""
        need = start + n
        for layer, own in zip(self.cache.layers, cache.layers):
            if layer.keys.shape[2] < need:
                pad = (0, 0, 0, need - layer.keys.shape[2])
                layer.keys = torch.nn.functional.pad(layer.keys, pad)
                layer.values = torch.nn.functional.pad(layer.values, pad)
            layer.keys[i, :, start:need] = own.keys[0, :, start:need]
            layer.values[i, :, start:need] = own.values[0, :, start:need]

    def block(self, sizes: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Empty inputs for a round: ids [B, T], pos [B, T], visible [B, T, W+T] bool with T the
        largest of ``sizes`` (row -> queries) and every query seeing itself (padding: nothing else)."""
        b, t, w = len(self.drafters), max(sizes.values()), self.width
        visible = torch.zeros(b, t, w + t, dtype=torch.bool)
        visible[:, :, w:] = torch.eye(t, dtype=torch.bool)
        return torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long), visible

    @staticmethod
    def float_mask(
        visible: torch.Tensor,
        dtype: torch.dtype,
        device: Any,
        windows: Any = None,
        q_pos: Any = None,
        kv_pos: Any = None,
    ) -> Any:
        """[B, T, S] bool → the [B, 1, T, S] additive mask (0 = attend, finfo.min = blocked), with a draft
        model's sliding windows on the rows' positions if given (``kv.rows_mask``)."""
        return rows_mask(visible.to(device), dtype, windows, q_pos, kv_pos)
