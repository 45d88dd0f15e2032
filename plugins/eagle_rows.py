"""A batch's EAGLE rows: every row's frontier expanded in ONE head forward per tree level.

Each row is an ``EagleDrafter`` fork that keeps its own bookkeeping (committed items ``stable``,
``pending`` items, predicted features ``feats``, the tree items fed this step); the head's KV cache
is one cache for all rows (``treespec.rows_cache``):

    row b:  [ stable items 0 .. stable_b − 1 | anything: masked | columns appended this step ]

- **catch-up** (a round's rows with pending items): one forward of a [B, T] block, row b's n_b items at
  positions stable_b … stable_b + n_b − 1, each seeing its row's stable items and the block's items
  before it; the block's columns are then copied to stable_b … (per row; later columns stay as masked
  garbage), so the stable part is exactly what a single sequence's cache holds.
- **a tree level** (the round's rows that need features): one forward of a [B, F_max] block, node n of
  row b at position stable_b − 1 + depth(n), seeing its row's stable items and the columns of its
  own ancestors' tree items (``cols``); a row with fewer nodes, or none, pads with queries that see
  only themselves.
- **proposals**: one lm_head over every requested row of every row, top-k per row.

The math per row is ``eagle.py``'s: same items, positions
and visibility; batching changes the shapes of the matmuls, not what they compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treespec.inference import inference
from treespec.interfaces import Expansion, Proposals
from treespec.kv import causal_mask, move_cache_rows
from treespec.rows_cache import CacheRow, RowsCache
from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.plugins.eagle import EagleDrafter


class EagleRow(CacheRow):
    """A row of ``EagleRows``: ``cols[i]`` is the shared cache's column of its tree item i."""

    def clear_tree(self) -> None:
        super().clear_tree()  # type: ignore[misc]
        self.cols: list[int] = []

    def drop_tree_rows(self) -> None:
        """Nothing of its own: the group cuts the columns a step appended (``RowsCache.cut``)."""


class EagleRows(RowsCache):
    drafters: list[EagleDrafter]
    row_class = EagleRow

    @inference
    def expand_together(self, requests: dict[int, Expansion]) -> dict[int, Proposals]:
        rows = self.drafters
        self.new_step(r.stable for r in rows)
        answers: dict[int, Proposals] = {}
        live: dict[int, tuple[Expansion, int]] = {}  # rows that need the head: (request, k)
        for i, req in requests.items():
            r, k = rows[i], min(req.k, rows[i].vocab)
            m = int(req.nodes.shape[0])
            if m == 0 or (r.feats is None and not r.pending):  # a one-token prompt: no feature before the root yet
                answers[i] = Proposals(torch.zeros(m, k, dtype=torch.long), torch.zeros(m, k))
            else:
                live[i] = (req, k)
        if not live:
            return answers
        flush = [i for i in live if rows[i].pending]
        if flush:  # the rows' block first, then long catch-ups (prompts that just joined) one by one
            long = self.alone(flush, lambda i: sum(int(t.shape[0]) for _, t in rows[i].pending), started=False)
            self._catch_up([i for i in flush if i not in long])  # never empty: the lower median row stays
            for i in long:
                self._catch_up_alone(i)
        levels = {i: rows[i].missing_levels(req.tree, req.nodes.tolist()) for i, (req, _) in live.items()}
        for depth in range(max(len(v) for v in levels.values())):
            self._feed_level({i: (live[i][0].tree, v[depth]) for i, v in levels.items() if depth < len(v)})
        picked = [
            rows[i].feats[torch.tensor([rows[i].node_row[n] for n in req.nodes.tolist()])]
            for i, (req, _) in live.items()
        ]
        q, tokens = rows[next(iter(live))].top(torch.cat(picked), max(k for _, k in live.values()))  # [ΣM, k]
        start = 0
        for (i, (_req, k)), part in zip(live.items(), picked):
            end = start + part.shape[0]
            answers[i] = Proposals(tokens=tokens[start:end, :k].cpu(), q=q[start:end, :k].cpu())
            start = end
        return answers

    def _forward(
        self, feats: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """The head over a [B, T] block appended to the cache; visible [B, T, W+T] bool → [B, T, H]."""
        base = self.base
        dev, dtype = base.device, base.dtype
        return base.forward(
            feats.to(dev, dtype),
            base.embed_ids(ids.to(dev)),
            pos.to(dev),
            self.float_mask(visible, dtype, dev),
            self.cache,
        )

    def _inputs(self, sizes: dict[int, int], dim: int) -> tuple[torch.Tensor, ...]:
        """``RowsCache.block`` plus the features [B, T, dim] each query carries."""
        ids, pos, visible = self.block(sizes)
        return torch.zeros(*ids.shape, dim, dtype=self.base.dtype), ids, pos, visible

    def _catch_up(self, flush: list[int]) -> None:
        """Feed the pending committed items of rows ``flush`` in one forward, then copy each row's
        into place after its stable items (see the module docstring)."""
        rows, w = self.drafters, self.width
        items = {}
        for i in flush:
            r = rows[i]
            items[i] = (torch.cat([f for f, _ in r.pending]), torch.cat([t for _, t in r.pending]))  # [n, ·], [n]
            r.pending = []
        sizes = {i: int(t.shape[0]) for i, (_, t) in items.items()}
        feats, ids, pos, visible = self._inputs(sizes, next(iter(items.values()))[0].shape[-1])
        for i, (f, t) in items.items():
            n, s = sizes[i], rows[i].stable
            feats[i, :n], ids[i, :n] = f.to(feats.dtype), t
            pos[i, :n] = torch.arange(s, s + n)
            visible[i, :n, :s] = True  # the row's stable items
            visible[i, :n, w : w + n] = torch.ones(n, n, dtype=torch.bool).tril()  # and its own earlier items
        out = self._forward(feats, ids, pos, visible)  # [B, T, H]
        which = torch.repeat_interleave(torch.tensor(list(sizes)), torch.tensor(list(sizes.values())))  # [K] rows
        move_cache_rows(
            self.cache,
            which,
            torch.cat([torch.arange(w, w + n) for n in sizes.values()]),
            torch.cat([torch.arange(rows[i].stable, rows[i].stable + n) for i, n in sizes.items()]),
        )
        for i, n in sizes.items():
            r = rows[i]
            r.stable += n
            r.root_feature = out[i, n - 1]
            r.clear_tree()

    def _catch_up_alone(self, i: int) -> None:
        """Row i's pending items in a forward of its own (a prompt that just joined the batch: in the
        rows' block it would pad every other row to its length): its committed prefix is copied into a
        one-row cache, the items run through the head there, and their KV columns are written back
        after the prefix (``RowsCache.splice``)."""
        r, base = self.drafters[i], self.base
        f, t = torch.cat([f for f, _ in r.pending]), torch.cat([t for _, t in r.pending])  # [n, H], [n]
        r.pending = []
        n, s = int(t.shape[0]), r.stable
        cache = self.prefix_cache(i, s)
        dev, dtype = base.device, base.dtype
        out = base.forward(
            f[None].to(dev, dtype),
            base.embed_ids(t[None].to(dev)),
            torch.arange(s, s + n)[None].to(dev),
            causal_mask(s, n, dtype)[None, None].to(dev),
            cache,
        )  # [1, n, H]: the prefix, then causal
        self.splice(i, cache, s, n)
        r.stable += n
        r.root_feature = out[0, n - 1]
        r.clear_tree()

    def _feed_level(self, level: dict[int, tuple[DraftTree, list[int]]]) -> None:
        """Feed one tree level of each row in ``level`` in one forward: node n of row b is the item
        (f̂_parent(n), token(n)) at position stable_b − 1 + depth(n)."""
        rows, w = self.drafters, self.width
        sizes = {i: len(nodes) for i, (_, nodes) in level.items()}
        feats, ids, pos, visible = self._inputs(sizes, rows[next(iter(level))].feats.shape[-1])
        for i, (tree, nodes) in level.items():
            r, f = rows[i], sizes[i]
            index = torch.tensor(nodes)  # [F]
            parents = tree.parents[index].tolist()
            feats[i, :f] = r.feats[torch.tensor([r.node_row[p] for p in parents])]
            ids[i, :f] = tree.tokens[index]
            pos[i, :f] = r.stable - 1 + tree.depths[index]
            visible[i, :f, : r.stable] = True
            if r.row_nodes:  # the tree items fed so far that are the node's ancestors
                visible[i, :f, torch.tensor(r.cols)] = tree.ancestors[index][:, torch.tensor(r.row_nodes)]
        out = self._forward(feats, ids, pos, visible)  # [B, F_max, H]
        for i, (_, nodes) in level.items():
            r, f = rows[i], sizes[i]
            first = r.feats.shape[0]
            r.feats = torch.cat([r.feats, out[i, :f]])
            for j, node in enumerate(nodes):
                r.node_row[node] = first + j
            r.row_nodes += nodes
            r.cols += list(range(w, w + f))
